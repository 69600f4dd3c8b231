//! Tensor parallelism as the model sees it: how each parameter splits across the ranks of
//! a tensor group ([`TpRole`]), and the collectives a unit calls at the edges of a split
//! region ([`TensorParallel`]).
//!
//! A parameter's spec keeps its whole (global) shape; a rank holds the piece its role and
//! tensor rank give it, so whole weights can always be gathered and split again at another
//! size. Units never talk to a process group: the engine hands them a [`TensorParallel`]
//! through [`super::Params::tp`], implemented over `comm` by the `parallel` layer, or the
//! one-rank [`super::layers::NoTensorParallel`] that does nothing.
use crate::{Error, Result};
use tch::Tensor;

/// How tensor parallelism splits a parameter across the ranks of a tensor group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TpRole {
    /// Every rank holds the whole tensor, applied to activations every rank holds whole
    /// (position embeddings read before sequence parallel splits the sequence).
    Replicated,
    /// Every rank holds the whole tensor, but applies it to the residual stream, which
    /// sequence parallel splits along the sequence (norm weights, biases added after a
    /// row-parallel reduction): each rank's gradient is then a partial sum, all-reduced
    /// over the tensor group. Without sequence parallel it is [`TpRole::Replicated`].
    SequenceReplicated,
    /// Split along the output dimension (rows of a `[out, in]` weight, and its bias). The
    /// output holds `parts` equal blocks fused into one tensor (GPT's `c_attn` holds q, k
    /// and v: `parts: 3`); each rank holds its piece of every block.
    Column {
        /// Equal blocks fused into the output; 1 for an unfused one.
        parts: i64,
    },
    /// Split along the output dimension of a fused query/key/value projection holding
    /// `heads` query heads, then `kv_heads` key heads and `kv_heads` value heads, all of
    /// one width (Phi-3's `qkv_proj` under grouped-query attention): each rank holds its
    /// heads of each of the three blocks.
    QueryKeyValue {
        /// Query heads of the projection.
        heads: i64,
        /// Key heads of the projection, and as many value heads.
        kv_heads: i64,
    },
    /// Every rank holds the whole tensor, but each rank's gradient covers only its share of
    /// the work, so it is all-reduced over the tensor group: per-head query and key norms
    /// applied to the rank's own heads, a LoRA factor beside a split weight.
    PartialGradient,
    /// Split along the input dimension (columns of a `[out, in]` weight).
    Row,
    /// Split along the vocabulary (rows of an embedding or output head, and its bias). The
    /// vocabulary is padded with zero rows to a multiple of the tensor size; padding rows
    /// are never looked up and their logits never win the softmax.
    Vocab,
}

impl TpRole {
    /// A column split of an unfused output.
    pub const COLUMN: TpRole = TpRole::Column { parts: 1 };

    /// Whether ranks hold different pieces (rather than the whole tensor).
    pub fn is_split(self) -> bool {
        matches!(self, TpRole::Column { .. } | TpRole::QueryKeyValue { .. } | TpRole::Row | TpRole::Vocab)
    }

    /// Checks that a parameter of `shape` called `name` splits `tp` ways.
    pub fn check(self, name: &str, shape: &[i64], tp: i64) -> Result<()> {
        let refuse = |why: String| Err(Error::Config(format!("tensor size {tp}: {name} {shape:?} {why}")));
        match self {
            TpRole::Column { parts } => {
                let out = shape.first().copied().unwrap_or(0);
                if parts < 1 || out % (parts * tp) != 0 {
                    return refuse(format!("has {out} outputs in {parts} fused parts, not divisible by {tp} per part"));
                }
            }
            TpRole::QueryKeyValue { heads, kv_heads } => {
                let out = shape.first().copied().unwrap_or(0);
                let blocks = heads + 2 * kv_heads;
                if heads < 1 || kv_heads < 1 || out % blocks != 0 || heads % tp != 0 || kv_heads % tp != 0 {
                    return refuse(format!(
                        "fuses {heads} query and {kv_heads} key/value heads in {out} outputs, not divisible by {tp} per block"
                    ));
                }
            }
            TpRole::Row => {
                if shape.len() != 2 || shape[1] % tp != 0 {
                    return refuse(format!("is not a [out, in] weight whose {tp} column pieces are equal"));
                }
            }
            TpRole::Vocab => {
                if shape.is_empty() {
                    return refuse("has no vocabulary dimension to split".into());
                }
            }
            TpRole::Replicated | TpRole::SequenceReplicated | TpRole::PartialGradient => {}
        }
        Ok(())
    }

    /// The shape of one rank's piece of a parameter of whole shape `shape`.
    pub fn local_shape(self, shape: &[i64], tp: i64) -> Vec<i64> {
        let mut local = shape.to_vec();
        let dim = match self {
            TpRole::Column { .. } | TpRole::QueryKeyValue { .. } | TpRole::Vocab => 0,
            TpRole::Row => 1,
            TpRole::Replicated | TpRole::SequenceReplicated | TpRole::PartialGradient => return local,
        };
        // A shape the role does not fit stays whole; `check` refuses it where it matters.
        if let Some(d) = local.get_mut(dim) {
            *d = if self == TpRole::Vocab { vocab_rows(*d, tp) } else { *d / tp };
        }
        local
    }

    /// Rank `rank`'s piece of the whole tensor `full` (a new tensor; padding rows are zeros).
    pub fn shard(self, full: &Tensor, tp: i64, rank: i64) -> Result<Tensor> {
        let shape = full.size();
        Ok(match self {
            _ if tp == 1 || !self.is_split() => full.shallow_clone(),
            TpRole::Column { parts } => {
                let block = shape[0] / parts;
                let mut blocked = vec![parts, block];
                blocked.extend_from_slice(&shape[1..]);
                let piece = block / tp;
                full.f_reshape(blocked.as_slice())?
                    .f_narrow(1, rank * piece, piece)?
                    .f_reshape(self.local_shape(&shape, tp).as_slice())?
            }
            TpRole::QueryKeyValue { .. } => {
                let pieces: Vec<Tensor> = self
                    .blocks(shape[0])
                    .into_iter()
                    .map(|(start, len)| full.f_narrow(0, start + rank * len / tp, len / tp))
                    .collect::<std::result::Result<_, _>>()?;
                Tensor::f_cat(&pieces, 0)?
            }
            TpRole::Row => {
                let piece = shape[1] / tp;
                full.f_narrow(1, rank * piece, piece)?.f_contiguous()?
            }
            TpRole::Vocab => {
                let rows = vocab_rows(shape[0], tp);
                let (start, end) = ((rank * rows).min(shape[0]), ((rank + 1) * rows).min(shape[0]));
                let local = Tensor::f_zeros(self.local_shape(&shape, tp).as_slice(), (full.kind(), full.device()))?;
                if end > start {
                    local.f_narrow(0, 0, end - start)?.f_copy_(&full.f_narrow(0, start, end - start)?)?;
                }
                local
            }
            TpRole::Replicated | TpRole::SequenceReplicated | TpRole::PartialGradient => unreachable!("not split"),
        })
    }

    /// Where each block of a fused query/key/value output of `out` rows starts, and its
    /// length (one block for every other role).
    fn blocks(self, out: i64) -> Vec<(i64, i64)> {
        match self {
            TpRole::QueryKeyValue { heads, kv_heads } => {
                let width = out / (heads + 2 * kv_heads);
                let (q, kv) = (heads * width, kv_heads * width);
                vec![(0, q), (q, kv), (q + kv, kv)]
            }
            _ => vec![(0, out)],
        }
    }

    /// The whole tensor of shape `shape` from every rank's piece, in rank order.
    pub fn unshard(self, pieces: &[Tensor], shape: &[i64]) -> Result<Tensor> {
        let tp = pieces.len() as i64;
        let first = pieces.first().ok_or_else(|| Error::Model("no pieces to assemble".into()))?;
        Ok(match self {
            _ if tp == 1 || !self.is_split() => first.shallow_clone(),
            TpRole::Column { parts } => {
                let blocked: Vec<Tensor> = pieces
                    .iter()
                    .map(|p| {
                        let mut s = vec![parts, shape[0] / parts / tp];
                        s.extend_from_slice(&shape[1..]);
                        p.f_reshape(s.as_slice())
                    })
                    .collect::<std::result::Result<_, _>>()?;
                Tensor::f_cat(&blocked, 1)?.f_reshape(shape)?
            }
            TpRole::QueryKeyValue { .. } => {
                // Each rank's piece holds its share of every block, in block order.
                let mut whole = Vec::new();
                let mut offset = 0;
                for (_, len) in self.blocks(shape[0]) {
                    for p in pieces {
                        whole.push(p.f_narrow(0, offset, len / tp)?);
                    }
                    offset += len / tp;
                }
                Tensor::f_cat(&whole, 0)?
            }
            TpRole::Row => Tensor::f_cat(pieces, 1)?,
            TpRole::Vocab => Tensor::f_cat(pieces, 0)?.f_narrow(0, 0, shape[0])?,
            TpRole::Replicated | TpRole::SequenceReplicated | TpRole::PartialGradient => unreachable!("not split"),
        })
    }
}

/// Rows of the vocabulary each of `tp` ranks holds: the vocabulary rounded up to a multiple
/// of `tp`, divided by `tp` (computed without rounding up first, which could overflow for
/// the sizes a damaged checkpoint claims).
pub fn vocab_rows(vocab: i64, tp: i64) -> i64 {
    vocab / tp + i64::from(vocab % tp != 0)
}

/// The collectives a unit calls where a tensor-parallel region begins and ends. Forward and
/// backward are each other's transposes, so every one is an autograd function.
pub trait TensorParallel: Send + Sync {
    /// Ranks in the tensor group.
    fn size(&self) -> i64;
    /// This rank's position in it.
    fn rank(&self) -> i64;
    /// Whether activations outside split regions are split along the sequence (dimension 1
    /// of `[B, T, D]`).
    fn sequence_parallel(&self) -> bool;
    /// Identity forward; the gradient is all-reduced over the group in backward.
    fn copy_in(&self, x: &Tensor) -> Result<Tensor>;
    /// The sum of every rank's `x` forward; the gradient passes through in backward.
    fn reduce_out(&self, x: &Tensor) -> Result<Tensor>;
    /// Every rank's sequence piece concatenated forward; the gradient reduce-scattered back.
    fn gather_sequence(&self, x: &Tensor) -> Result<Tensor>;
    /// The sum of every rank's `x`, of which this rank keeps its sequence piece; the
    /// gradient all-gathered in backward.
    fn scatter_sequence(&self, x: &Tensor) -> Result<Tensor>;
    /// Mean cross-entropy of vocabulary-split logits `[..., V/tp]` against `[...]` targets,
    /// reducing the maximum, the target logit and the sum of exponentials over the group
    /// (whole logits never exist on one rank).
    fn cross_entropy(&self, local_logits: &Tensor, targets: &Tensor) -> Result<Tensor>;
    /// The whole logits `[..., vocab]` from each rank's columns (the last rank's padding
    /// left out), for a loss that reads every column and is the same on every rank: the
    /// backward hands each rank its own columns of the gradient, nothing to reduce.
    fn whole_vocabulary(&self, local_logits: &Tensor, vocab: i64) -> Result<Tensor>;
    /// Every rank's `x` (same shape everywhere), in rank order, outside autograd.
    fn gather(&self, x: &Tensor) -> Result<Vec<Tensor>>;
    /// The sums over the group of `values`.
    fn sum_values(&self, values: &[f64]) -> Result<Vec<f64>>;

    /// Into a split region (before column-parallel layers): the whole activation.
    fn enter(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel() {
            self.gather_sequence(x)
        } else {
            self.copy_in(x)
        }
    }

    /// Out of a split region (after a row-parallel layer or a vocabulary look-up): partial
    /// results summed, split along the sequence under sequence parallel.
    fn leave(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel() {
            self.scatter_sequence(x)
        } else {
            self.reduce_out(x)
        }
    }

    /// Start and length of this rank's positions of a `t`-long sequence outside split regions.
    fn sequence_range(&self, t: i64) -> (i64, i64) {
        if self.sequence_parallel() {
            let piece = t / self.size();
            (self.rank() * piece, piece)
        } else {
            (0, t)
        }
    }
}

/// A tensor group seen without sequence parallel: activations outside split regions are
/// whole on every rank. Decoding runs so, its few new positions not splitting over the group.
pub struct WholeSequence<'a>(pub &'a dyn TensorParallel);

impl TensorParallel for WholeSequence<'_> {
    fn size(&self) -> i64 {
        self.0.size()
    }
    fn rank(&self) -> i64 {
        self.0.rank()
    }
    fn sequence_parallel(&self) -> bool {
        false
    }
    fn copy_in(&self, x: &Tensor) -> Result<Tensor> {
        self.0.copy_in(x)
    }
    fn reduce_out(&self, x: &Tensor) -> Result<Tensor> {
        self.0.reduce_out(x)
    }
    fn gather_sequence(&self, x: &Tensor) -> Result<Tensor> {
        self.0.gather_sequence(x)
    }
    fn scatter_sequence(&self, x: &Tensor) -> Result<Tensor> {
        self.0.scatter_sequence(x)
    }
    fn cross_entropy(&self, local_logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.0.cross_entropy(local_logits, targets)
    }
    fn whole_vocabulary(&self, local_logits: &Tensor, vocab: i64) -> Result<Tensor> {
        self.0.whole_vocabulary(local_logits, vocab)
    }
    fn gather(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.0.gather(x)
    }
    fn sum_values(&self, values: &[f64]) -> Result<Vec<f64>> {
        self.0.sum_values(values)
    }
}

impl std::fmt::Debug for dyn TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TensorParallel(rank {} of {}, sequence parallel {})",
            self.rank(),
            self.size(),
            self.sequence_parallel()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn vocabulary_rows_round_up_without_overflowing() {
        assert_eq!((vocab_rows(10, 4), vocab_rows(8, 4), vocab_rows(0, 3)), (3, 2, 0));
        // The size a damaged checkpoint may claim.
        assert_eq!(vocab_rows(i64::MAX, 1), i64::MAX);
        assert_eq!(vocab_rows(i64::MAX, 2), i64::MAX / 2 + 1);
    }

    fn whole(shape: &[i64]) -> Tensor {
        Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, tch::Device::Cpu)).reshape(shape)
    }

    #[test]
    fn pieces_reassemble_into_the_whole_for_every_role() {
        let cases = [
            (TpRole::Column { parts: 3 }, vec![12, 4]),
            (TpRole::COLUMN, vec![8]),
            (TpRole::Row, vec![3, 8]),
            (TpRole::Vocab, vec![7, 2]),
            (TpRole::Vocab, vec![5]),
            (TpRole::QueryKeyValue { heads: 4, kv_heads: 2 }, vec![16, 3]),
        ];
        for (role, shape) in cases {
            for tp in [1, 2, 4] {
                if role.check("p", &shape, tp).is_err() {
                    continue;
                }
                let full = whole(&shape);
                let pieces: Vec<Tensor> = (0..tp).map(|r| role.shard(&full, tp, r).unwrap()).collect();
                for p in &pieces {
                    assert_eq!(p.size(), role.local_shape(&shape, tp), "{role:?} {shape:?} tp {tp}");
                }
                assert!(role.unshard(&pieces, &shape).unwrap().equal(&full), "{role:?} {shape:?} tp {tp}");
            }
        }
    }

    #[test]
    fn a_fused_column_gives_each_rank_its_piece_of_every_part() {
        // q = rows 0..4, k = 4..8, v = 8..12: rank 1 of 2 holds rows 2,3 of each.
        let piece = TpRole::Column { parts: 3 }.shard(&whole(&[12]), 2, 1).unwrap();
        assert_eq!(Vec::<f32>::try_from(&piece).unwrap(), [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]);
        let plain = TpRole::COLUMN.shard(&whole(&[12]), 2, 1).unwrap();
        assert_eq!(Vec::<f32>::try_from(&plain).unwrap(), [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
    }

    #[test]
    fn a_fused_query_key_value_gives_each_rank_its_heads_of_each_block() {
        // Four query heads (rows 0..8), two key heads (8..12), two value heads (12..16), two
        // rows a head: rank 1 of 2 holds query heads 2, 3, key head 1 and value head 1.
        let role = TpRole::QueryKeyValue { heads: 4, kv_heads: 2 };
        let piece = role.shard(&whole(&[16]), 2, 1).unwrap();
        assert_eq!(Vec::<f32>::try_from(&piece).unwrap(), [4.0, 5.0, 6.0, 7.0, 10.0, 11.0, 14.0, 15.0]);
        assert!(role.check("qkv_proj", &[16, 3], 4).is_err(), "two key/value heads do not split four ways");
    }

    #[test]
    fn the_vocabulary_pads_with_zero_rows_on_the_last_ranks() {
        let last = TpRole::Vocab.shard(&whole(&[5]).f_add_scalar(1.0).unwrap(), 4, 2).unwrap();
        assert_eq!(Vec::<f32>::try_from(&last).unwrap(), [5.0, 0.0]);
        let beyond = TpRole::Vocab.shard(&whole(&[5]).f_add_scalar(1.0).unwrap(), 4, 3).unwrap();
        assert_eq!(Vec::<f32>::try_from(&beyond).unwrap(), [0.0, 0.0]);
        assert!(TpRole::Column { parts: 3 }.check("c_attn", &[18, 6], 4).is_err());
        assert!(TpRole::Row.check("proj", &[6, 6], 4).is_err());
    }
}
