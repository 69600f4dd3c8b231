//! Dropout whose masks are a function of where they fall, not of a random stream.
//!
//! An element's fate is a hash of the run's seed, the step, the unit, the site within the
//! unit and the element's coordinates in the global batch (its row among every rank's and
//! micro-batch's rows, then its position, head or feature counted over the whole model,
//! not this rank's piece of it). So a step draws the same masks whether one process runs it
//! or ranks split its rows, heads or features; a recomputed unit draws again exactly what
//! its first forward drew; and a resumed run draws what the uninterrupted one would have.
//! libtorch's generator could give none of this: its stream depends on how much each rank
//! drew before.
//!
//! The hash works on 32-bit values held in int64 tensors (products stay below 2⁶³, so
//! nothing relies on overflow): `mix` is a bijection on 32 bits, and `fold(h, v)` =
//! `mix((h + v) mod 2³²)` chains the key's parts and then each coordinate, dimension by
//! dimension. An element is dropped where its hash is below `rate · 2³²`; kept elements
//! are scaled by `1 / (1 − rate)`, as `torch.nn.functional.dropout` does.
//!
//! Owns the rates a model's configuration carries and the masks. Must not read libtorch's
//! random state, and must not decide when a forward trains: the engine hands a draw only to
//! training forwards.
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

const MASK: i64 = 0xffff_ffff;
const MULTIPLIER: i64 = 0x045d_9f3b;

/// Dropout probabilities at a model's sites, as its folder configures them (all zero: no
/// dropout). A family reads those of its sites that it has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DropoutRates {
    /// On the embedded tokens (GPT-2's `embd_pdrop`, BERT's `hidden_dropout_prob`, T5's
    /// `dropout_rate`).
    pub embedding: f64,
    /// On the attention probabilities (`attn_pdrop`, `attention_probs_dropout_prob`,
    /// `dropout_rate`).
    pub attention: f64,
    /// On each sub-layer's output before its residual sum, and on T5's final norms' output
    /// (`resid_pdrop`, `hidden_dropout_prob`, `dropout_rate`).
    pub residual: f64,
    /// Inside T5's feed-forward layer, after its activation (`dropout_rate`).
    pub inner: f64,
    /// On the pooled vector before a classifier (BERT's `classifier_dropout`, else
    /// `hidden_dropout_prob`).
    pub classifier: f64,
}

impl DropoutRates {
    /// No dropout anywhere.
    pub const NONE: DropoutRates =
        DropoutRates { embedding: 0.0, attention: 0.0, residual: 0.0, inner: 0.0, classifier: 0.0 };

    /// Every site at `rate`.
    pub fn all(rate: f64) -> DropoutRates {
        DropoutRates { embedding: rate, attention: rate, residual: rate, inner: rate, classifier: rate }
    }

    fn each(&self) -> [(&'static str, f64); 5] {
        [
            ("embedding", self.embedding),
            ("attention", self.attention),
            ("residual", self.residual),
            ("inner", self.inner),
            ("classifier", self.classifier),
        ]
    }

    /// Whether any site drops anything.
    pub fn any(&self) -> bool {
        self.each().iter().any(|(_, r)| *r > 0.0)
    }

    /// Refuses a rate outside `[0, 1)`.
    pub fn validate(&self) -> Result<()> {
        match self.each().into_iter().find(|(_, r)| !(0.0..1.0).contains(r)) {
            Some((site, rate)) => Err(Error::Config(format!("{site} dropout {rate} is outside [0, 1)"))),
            None => Ok(()),
        }
    }
}

/// Elements per token a dropout at `rate` masks over `width` features (for a unit's
/// declared cost: [`super::Kept::with_dropout`]).
pub(crate) fn masked(rate: f64, width: i64) -> f64 {
    if rate > 0.0 {
        width as f64
    } else {
        0.0
    }
}

fn mix(x: u32) -> u32 {
    let x = (x ^ (x >> 16)).wrapping_mul(MULTIPLIER as u32);
    let x = (x ^ (x >> 16)).wrapping_mul(MULTIPLIER as u32);
    x ^ (x >> 16)
}

fn fold(h: u32, v: u32) -> u32 {
    mix(h.wrapping_add(v))
}

/// [`mix`] of each element of an int64 tensor of 32-bit values, in place (one temporary of
/// its size at a time).
fn mix_in_place(x: &mut Tensor) -> Result<()> {
    let shift_xor = |x: &mut Tensor| -> Result<()> {
        let shifted = x.f_bitwise_right_shift_tensor_scalar(16)?;
        // In-place operations hand back the tensor they changed: nothing to keep.
        let _ = x.f_bitwise_xor_tensor_(&shifted)?;
        Ok(())
    };
    for _ in 0..2 {
        shift_xor(x)?;
        let _ = x.f_mul_scalar_(MULTIPLIER)?;
        let _ = x.f_bitwise_and_(MASK)?;
    }
    shift_xor(x)
}

/// Elements whose hashes are computed at once: a mask of any size takes at most two int64
/// temporaries of this many elements beside itself.
const CHUNK: i64 = 1 << 22;

/// Which elements of a `shape` tensor on `device`, dimension `d` counted from `starts[d]`,
/// hash below `threshold` when their coordinates are folded into `prefix` in order, at most
/// `chunk` elements hashed at once: a block of leading indices with whole trailing
/// dimensions, or, where one leading index alone holds more, each index on its own (its
/// fold taken on the host).
fn below(prefix: u32, shape: &[i64], starts: &[i64], device: Device, threshold: i64, chunk: i64) -> Result<Tensor> {
    let inner: i64 = shape.iter().skip(1).product();
    let leading = shape.first().copied().unwrap_or(1);
    if shape.len() > 1 && inner > chunk {
        let pieces = (0..leading)
            .map(|i| below(fold(prefix, (starts[0] + i) as u32), &shape[1..], &starts[1..], device, threshold, chunk))
            .collect::<Result<Vec<_>>>()?;
        return Ok(Tensor::f_stack(&pieces, 0)?);
    }
    let rows = (chunk / inner.max(1)).clamp(1, leading.max(1));
    let mut pieces = Vec::new();
    for first in (0..leading).step_by(rows as usize) {
        let mut hash = Tensor::f_scalar_tensor(f64::from(prefix), (Kind::Int64, device))?;
        for (d, &len) in shape.iter().enumerate() {
            let (start, len) = if d == 0 { (starts[0] + first, rows.min(leading - first)) } else { (starts[d], len) };
            let mut view = vec![1; shape.len()];
            view[d] = len;
            let index = Tensor::f_arange_start(start, start + len, (Kind::Int64, device))?.f_view(view.as_slice())?;
            hash = hash.f_add(&index)?;
            let _ = hash.f_bitwise_and_(MASK)?;
            mix_in_place(&mut hash)?;
        }
        pieces.push(hash.f_lt(threshold)?);
    }
    match pieces.len() {
        1 => Ok(pieces.remove(0)),
        _ => Ok(Tensor::f_cat(&pieces, 0)?),
    }
}

/// `parts` folded in order into one 32-bit key (for [`uniforms`]).
pub(crate) fn key_of(parts: &[u32]) -> u32 {
    parts.iter().fold(0, |h, &v| fold(h, v))
}

/// `[keys.len(), width]` draws uniform in (0, 1), fp64: element `(r, v)` is `v` folded into
/// `keys[r]`, so each row's draws follow from its key alone, whatever rows are drawn
/// beside it (sampling's streams, one a decoded row).
pub(crate) fn uniforms(keys: &[u32], width: i64, device: Device) -> Result<Tensor> {
    let keys: Vec<i64> = keys.iter().map(|&k| i64::from(k)).collect();
    let rows = Tensor::f_from_slice(&keys)?.f_to_device(device)?.f_unsqueeze(1)?;
    let mut hash = rows.f_add(&Tensor::f_arange(width, (Kind::Int64, device))?.f_unsqueeze(0)?)?;
    let _ = hash.f_bitwise_and_(MASK)?;
    mix_in_place(&mut hash)?;
    // The 2³² hashes' bins, each drawn at its middle: never 0 or 1.
    Ok(hash.f_to_kind(Kind::Double)?.f_add_scalar(0.5)?.f_div_scalar((1u64 << 32) as f64)?)
}

/// FNV-1a of a unit's name: which unit draws.
fn name_hash(name: &str) -> u32 {
    name.bytes().fold(0x811c_9dc5, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// Marks the sites of adapters' inputs, apart from the units' own small site numbers.
const ADAPTER_SITES: u32 = 1 << 30;

/// The dropout site of the input of the adapter of the weight named `weight`: the bit of
/// adapters' sites beside the name's hash, so that a reference can name it too.
pub fn adapter_site(weight: &str) -> u32 {
    ADAPTER_SITES | (name_hash(weight) & (ADAPTER_SITES - 1))
}

/// What a training forward over one micro-batch draws its masks from: the run's seed, the
/// step's number and the global number of the micro-batch's first row (its row among the
/// step's rows of every rank and micro-batch, in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutDraw {
    /// The run's seed.
    pub seed: u64,
    /// The step's number.
    pub step: u64,
    /// The global number of the micro-batch's first row.
    pub first_row: i64,
}

impl DropoutDraw {
    /// The draw of the unit named `unit`.
    pub fn unit(&self, unit: &str) -> UnitDraw {
        let key = [self.seed as u32, (self.seed >> 32) as u32, self.step as u32, (self.step >> 32) as u32]
            .into_iter()
            .fold(0, fold);
        UnitDraw { key: fold(key, name_hash(unit)), first_row: self.first_row }
    }
}

/// A unit's share of a [`DropoutDraw`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitDraw {
    key: u32,
    first_row: i64,
}

impl UnitDraw {
    /// Which elements of a `shape` tensor on `device` site `site` drops at `rate` (true:
    /// dropped). Dimension 0 counts rows from the draw's first row; dimension `d + 1` counts
    /// from `offsets[d]` (where this rank holds a piece of a wider dimension), or from 0.
    pub fn dropped(&self, shape: &[i64], device: Device, rate: f64, site: u32, offsets: &[i64]) -> Result<Tensor> {
        let start = |d: usize| if d == 0 { self.first_row } else { offsets.get(d - 1).copied().unwrap_or(0) };
        let starts: Vec<i64> = (0..shape.len()).map(start).collect();
        // Below the threshold: dropped, with probability `rate`.
        let threshold = (rate * (1u64 << 32) as f64) as i64;
        below(fold(self.key, site), shape, &starts, device, threshold, CHUNK)
    }

    /// `x` through dropout at `rate` at site `site` ([`UnitDraw::dropped`]): dropped elements
    /// zero, kept ones scaled by `1 / (1 − rate)`.
    pub fn apply(&self, x: &Tensor, rate: f64, site: u32, offsets: &[i64]) -> Result<Tensor> {
        if rate <= 0.0 {
            return Ok(x.shallow_clone());
        }
        let dropped = self.dropped(&x.size(), x.device(), rate, site, offsets)?;
        Ok(x.f_masked_fill(&dropped, 0.0)?.f_mul_scalar(1.0 / (1.0 - rate))?)
    }
}

/// One site's dropout as a layer applies it inside its computation (attention's
/// probabilities): the unit's draw, the rate, the site and the offsets of this rank's piece.
pub struct Dropping<'a> {
    /// The unit's draw.
    pub draw: &'a UnitDraw,
    /// The fraction of elements dropped.
    pub rate: f64,
    /// The site's number within the unit.
    pub site: u32,
    /// Where this rank's piece starts in each dimension after the first.
    pub offsets: Vec<i64>,
}

impl Dropping<'_> {
    /// `x` through this site's dropout ([`UnitDraw::apply`]).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        self.draw.apply(x, self.rate, self.site, &self.offsets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(first_row: i64) -> UnitDraw {
        DropoutDraw { seed: 7, step: 3, first_row }.unit("block.0")
    }

    #[test]
    fn the_tensor_hash_is_the_scalar_one() {
        let values: Vec<i64> = vec![0, 1, 2, 0xffff, 0x1234_5678, MASK];
        let mut mixed = Tensor::from_slice(&values);
        mix_in_place(&mut mixed).unwrap();
        let expected: Vec<i64> = values.iter().map(|&v| i64::from(mix(v as u32))).collect();
        assert_eq!(Vec::<i64>::try_from(&mixed).unwrap(), expected);
    }

    #[test]
    fn a_rate_drops_that_share_and_scales_the_rest() {
        let x = Tensor::ones([64, 32, 16], (Kind::Float, Device::Cpu));
        let y = draw(0).apply(&x, 0.25, 1, &[]).unwrap();
        let dropped = y.eq(0.0).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
        assert!((0.24..0.26).contains(&dropped), "dropped {dropped}");
        let kept = y.masked_select(&y.ne(0.0)).mean(Kind::Float).double_value(&[]);
        assert!((kept - 1.0 / 0.75).abs() < 1e-6, "kept scaled to {kept}");
        assert!(y.equal(&draw(0).apply(&x, 0.25, 1, &[]).unwrap()), "the same draw again");
        assert!(!y.equal(&draw(0).apply(&x, 0.25, 2, &[]).unwrap()), "another site");
        let other = DropoutDraw { seed: 7, step: 4, first_row: 0 }.unit("block.0");
        assert!(!y.equal(&other.apply(&x, 0.25, 1, &[]).unwrap()), "another step");
    }

    /// A piece of the rows, positions or features — a rank's — draws that piece of the
    /// whole tensor's mask.
    #[test]
    fn a_piece_draws_its_part_of_the_whole_mask() {
        let whole = draw(0).dropped(&[6, 10, 8], Device::Cpu, 0.5, 0, &[]).unwrap();
        let rows = draw(2).dropped(&[3, 10, 8], Device::Cpu, 0.5, 0, &[]).unwrap();
        assert!(rows.equal(&whole.narrow(0, 2, 3)));
        let columns = draw(0).dropped(&[6, 5, 4], Device::Cpu, 0.5, 0, &[5, 4]).unwrap();
        assert!(columns.equal(&whole.narrow(1, 5, 5).narrow(2, 4, 4)));
    }

    /// Hashed a few elements at a time (blocks of rows, or one leading index at a time), a
    /// mask is the one hashed whole.
    #[test]
    fn a_mask_hashed_in_chunks_is_the_mask_hashed_whole() {
        for shape in [[6i64, 5, 4].as_slice(), &[3, 4, 2, 5]] {
            let starts: Vec<i64> = (0..shape.len() as i64).map(|d| 3 * d + 1).collect();
            let whole = below(99, shape, &starts, Device::Cpu, 1 << 31, i64::MAX).unwrap();
            for chunk in [1, 7, 20, 64] {
                let chunked = below(99, shape, &starts, Device::Cpu, 1 << 31, chunk).unwrap();
                assert!(chunked.equal(&whole), "shape {shape:?} in chunks of {chunk}");
            }
            let dropped = whole.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
            assert!((0.3..0.7).contains(&dropped), "half of {shape:?} dropped: {dropped}");
        }
    }

    #[test]
    fn rates_outside_zero_to_one_are_refused() {
        assert!(DropoutRates::all(0.1).validate().is_ok());
        let err = DropoutRates { attention: 1.0, ..Default::default() }.validate().unwrap_err().to_string();
        assert!(err.contains("attention dropout 1 is outside [0, 1)"), "{err}");
    }
}
