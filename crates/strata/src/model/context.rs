//! Context parallelism as a model sees it: which positions of every row a rank holds
//! ([`SequencePiece`]), the attention that reaches the positions other ranks hold
//! ([`ContextParallel`], implemented over a process group by `parallel`), and the mask of
//! what a query may not see, from positions' true places in their row ([`unseen`]).
//!
//! Owns: the split of rows into pieces and the visibility rule across them. Must not
//! communicate: the exchanges are the implementation's.
use super::layers::{chunks_differ, examples_differ, AttentionOptions};
use crate::{Error, Result};
use tch::Tensor;

/// Which positions of every row rank `index` of a context group of `count` ranks holds:
/// the `index`-th of `count` equal runs, or, `balanced`, runs `index` and
/// `2·count − 1 − index` of `2·count` (an early and a late run, so that causal attention
/// costs every rank the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SequencePiece {
    /// This rank's place in its context group.
    pub index: usize,
    /// Ranks in the group.
    pub count: usize,
    /// Two runs, one from each end of the row, in place of one.
    pub balanced: bool,
}

impl SequencePiece {
    /// The length of the runs a row of `len` positions splits into, and the runs this
    /// piece holds (by their place in the row), in order.
    pub fn runs(&self, len: i64) -> Result<(i64, Vec<i64>)> {
        let count = self.count as i64;
        let (parts, mine) = match self.balanced {
            true => (2 * count, vec![self.index as i64, 2 * count - 1 - self.index as i64]),
            false => (count, vec![self.index as i64]),
        };
        if len % parts != 0 {
            return Err(Error::Config(format!(
                "context_parallel: rows of {len} positions do not split into {parts} equal runs for {count} ranks{}",
                if self.balanced { " (two each, ring)" } else { "" }
            )));
        }
        Ok((len / parts, mine))
    }

    /// The places in a row of `len` positions of the positions this piece holds, in the
    /// order the rank holds them.
    pub fn positions(&self, len: i64) -> Result<Vec<i64>> {
        let (run, mine) = self.runs(len)?;
        Ok(mine.into_iter().flat_map(|r| r * run..(r + 1) * run).collect())
    }

    /// [`SequencePiece::positions`] as an int64 tensor on `device`.
    pub fn places(&self, len: i64, device: tch::Device) -> Result<Tensor> {
        Ok(Tensor::f_from_slice(&self.positions(len)?)?.f_to_device(device)?)
    }

    /// This piece of `x` along dimension `dim` (of `len` positions).
    pub fn take(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        let len = x.size()[dim as usize];
        let (run, mine) = self.runs(len)?;
        let runs = mine.iter().map(|r| x.f_narrow(dim, r * run, run)).collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Tensor::f_cat(&runs, dim)?)
    }

    /// Rank `index`'s piece of the same group.
    pub fn of_rank(&self, index: usize) -> SequencePiece {
        SequencePiece { index, ..*self }
    }
}

/// A context group's attention: each rank holds its piece of every row's positions
/// ([`SequencePiece`]) and attends to the keys and values of the whole row.
pub trait ContextParallel: Send + Sync + std::fmt::Debug {
    /// Ranks in the group.
    fn size(&self) -> i64;
    /// The sums over the group's ranks of each of `values`.
    fn sum_values(&self, values: &[f64]) -> Result<Vec<f64>>;
    /// Attention of this rank's queries `[B, H, Tl, D]` over the keys and values of every
    /// position of their rows (this rank's `[B, Hkv, Tl, D]`, the others' from them; each
    /// of the `Hkv` heads, which divide `H`, serves `H / Hkv` adjacent query heads), as
    /// [`super::layers::attention`] computes over whole rows: causal unless `options` says
    /// bidirectional, within its window, soft-capped, never across examples (`examples`:
    /// `[B, Tl]`, the example of each of this rank's positions), with a sink logit per head
    /// (`sinks`, `[H]`) where given.
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        options: &AttentionOptions,
        examples: &Tensor,
        sinks: Option<&Tensor>,
    ) -> Result<Tensor>;
}

/// The `[B, 1, Tq, Tk]` mask of the keys each query may not see, from the queries' and the
/// keys' places in their row (`[Tq]`, `[Tk]`) and examples (`[B, Tq]`, `[B, Tk]`): another
/// example's, a later one's (unless bidirectional), one `window` or more places behind, and
/// one of another chunk.
pub fn unseen(
    query_places: &Tensor,
    key_places: &Tensor,
    query_examples: &Tensor,
    key_examples: &Tensor,
    options: &AttentionOptions,
) -> Result<Tensor> {
    let mut mask = examples_differ(query_examples, key_examples)?;
    let behind = query_places.f_unsqueeze(1)?.f_sub(&key_places.f_unsqueeze(0)?)?;
    if !options.bidirectional {
        mask = mask.f_logical_or(&behind.f_lt(0)?)?;
    }
    if let Some(w) = options.window {
        mask = mask.f_logical_or(&behind.f_ge(w)?)?;
    }
    if let Some(c) = options.chunk {
        mask = mask.f_logical_or(&chunks_differ(query_places, key_places, c)?)?;
    }
    Ok(mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tch::Kind;

    proptest! {
        /// A group's pieces cover every place of a row exactly once, each piece in order.
        #[test]
        fn pieces_cover_the_row_once(count in 1usize..6, runs in 1i64..5, balanced: bool) {
            let len = runs * count as i64 * if balanced { 2 } else { 1 };
            let mut all: Vec<i64> = vec![];
            for index in 0..count {
                let piece = SequencePiece { index, count, balanced };
                let places = piece.positions(len).unwrap();
                prop_assert_eq!(places.len() as i64, len / count as i64);
                let row = Tensor::arange(len, (Kind::Int64, tch::Device::Cpu));
                prop_assert_eq!(Vec::<i64>::try_from(piece.take(&row, 0).unwrap()).unwrap(), places.clone());
                all.extend(places);
            }
            all.sort_unstable();
            prop_assert_eq!(all, (0..len).collect::<Vec<_>>());
        }
    }

    #[test]
    fn balanced_pieces_take_an_early_and_a_late_run_and_odd_rows_are_refused() {
        let piece = SequencePiece { index: 0, count: 2, balanced: true };
        assert_eq!(piece.positions(8).unwrap(), [0, 1, 6, 7]);
        assert_eq!(piece.of_rank(1).positions(8).unwrap(), [2, 3, 4, 5]);
        let err = piece.positions(6).unwrap_err().to_string();
        assert!(
            err.contains("rows of 6 positions do not split into 4 equal runs for 2 ranks (two each, ring)"),
            "{err}"
        );
    }

    #[test]
    fn the_mask_hides_later_places_other_examples_and_places_outside_the_window() {
        let places = Tensor::from_slice(&[0i64, 1, 2, 3]);
        let examples = Tensor::from_slice(&[0i64, 0, 1, 1]).view([1, 4]);
        let options = AttentionOptions { window: Some(2), ..AttentionOptions::default() };
        let mask = unseen(&places, &places, &examples, &examples, &options).unwrap();
        let seen: Vec<bool> = Vec::try_from(mask.logical_not().view([-1])).unwrap();
        #[rustfmt::skip]
        let expected = [
            true, false, false, false,
            true, true, false, false,
            false, false, true, false,
            false, false, true, true,
        ];
        assert_eq!(seen, expected);
    }
}
