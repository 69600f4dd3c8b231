//! Rotary position embeddings and the ways checkpoints stretch them past the context they
//! were trained at: linear interpolation, dynamic NTK scaling, YaRN, Llama 3's
//! wavelength-banded remap and LongRoPE's per-frequency factors.
//!
//! Owns the inverse frequencies and the factor the cosines and sines are multiplied by.
//! Must not read config files (the `hf` module maps `rope_parameters` onto [`Rope`]) nor
//! hold parameters: a rotation has none.
use super::layers::rotary;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::f64::consts::PI;
use std::sync::Mutex;
use tch::{Device, Kind, Tensor};

/// How the inverse frequencies are scaled from the unscaled `theta^(-2i/d)`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// The frequencies as trained.
    #[default]
    None,
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        /// The divisor of every frequency.
        factor: f64,
    },
    /// Past `original_context` positions the base grows with the sequence's length (NTK-aware
    /// scaling recomputed as the sequence grows).
    Dynamic {
        /// The scaling factor: for `len` positions the base is
        /// `theta · (factor · len / original_context − (factor − 1))^(d/(d−2))`.
        factor: f64,
        /// The context the model was trained at, in positions; shorter sequences are not scaled.
        original_context: i64,
    },
    /// YaRN: high frequencies kept, low ones interpolated by `factor`, a linear ramp between
    /// the dimensions that turn `beta_fast` and `beta_slow` times over `original_context`;
    /// cosines and sines multiplied by `attention_factor`.
    Yarn {
        /// The divisor of the interpolated (low) frequencies.
        factor: f64,
        /// The context the model was trained at, in positions.
        original_context: i64,
        /// Turns over `original_context` of the dimension where the ramp starts (frequencies kept).
        beta_fast: f64,
        /// Turns over `original_context` of the dimension where the ramp ends (frequencies interpolated).
        beta_slow: f64,
        /// The factor cosines and sines are multiplied by.
        attention_factor: f64,
        /// Whether the ramp's ends are rounded outwards to whole dimensions.
        truncate: bool,
    },
    /// LongRoPE (Phi-3.5, Phi-4-mini): each frequency divided by its own factor, `short`'s
    /// while the sequence stays within `original_context` positions and `long`'s past it;
    /// cosines and sines multiplied by `attention_factor`.
    LongRope {
        /// One factor per rotated pair, within the original context.
        short: Vec<f64>,
        /// One factor per rotated pair, past it.
        long: Vec<f64>,
        /// The context the model was trained at, in positions.
        original_context: i64,
        /// The factor cosines and sines are multiplied by.
        attention_factor: f64,
    },
    /// The base stretched once by `alpha^(d/(d−2))`, whatever the sequence's length
    /// (HunYuan's fixed NTK-aware scaling, a `dynamic` rotation with an `alpha`).
    NtkAlpha {
        /// The stretch.
        alpha: f64,
    },
    /// Llama 3: wavelengths longer than `original_context / low_freq_factor` divided by
    /// `factor`, shorter than `original_context / high_freq_factor` kept, a smooth blend
    /// between.
    Llama3 {
        /// The divisor of the long wavelengths' frequencies.
        factor: f64,
        /// Wavelengths longer than `original_context / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original_context / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the model was trained at, in positions.
        original_context: i64,
    },
}

/// Queries and keys `[.., D]` (of one width) with their first `dims` dimensions, rotated as
/// adjacent pairs (`x0, x1`), (`x2, x3`), ... (GLM's and DeepSeek's layout), reordered as
/// the halves (`x0, x2, ...`), (`x1, x3, ...`) every [`Rotation`] turns: the same turn, and
/// as queries and keys are reordered alike, the same scores.
pub(crate) fn pairs_as_halves(q: &Tensor, k: &Tensor, dims: i64) -> Result<(Tensor, Tensor)> {
    let options = (Kind::Int64, q.device());
    let order = Tensor::f_cat(
        &[
            Tensor::f_arange_start_step(0, dims, 2, options)?,
            Tensor::f_arange_start_step(1, dims, 2, options)?,
            Tensor::f_arange_start(dims, q.size()[q.dim() - 1], options)?,
        ],
        0,
    )?;
    Ok((q.f_index_select(-1, &order)?, k.f_index_select(-1, &order)?))
}

/// Queries scaled up by their position (Llama 4's and Ministral 3's attention temperature):
/// times `1 + beta · ln(1 + ⌊position / every⌋)`, one past the first `every` positions, so
/// that attention stays sharp far past the context a model was trained at.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueryScaling {
    /// How fast the scale grows (`llama_4_scaling_beta`, Llama 4's `attn_scale`).
    pub beta: f64,
    /// Positions per step of the logarithm (`original_max_position_embeddings`, Llama 4's
    /// `floor_scale`).
    pub every: i64,
    /// Positions counted from one rather than zero (Llama 4's).
    #[serde(default)]
    pub from_one: bool,
    /// Only the layers that turn no position scale their queries (Llama 4's).
    #[serde(default)]
    pub unrotated_only: bool,
}

impl QueryScaling {
    /// Fails where `every` is not positive or `beta` not finite.
    pub fn validate(&self) -> Result<()> {
        if self.every <= 0 || !self.beta.is_finite() {
            return Err(Error::Config(format!(
                "query scaling: beta {} must be finite and every {} positive",
                self.beta, self.every
            )));
        }
        Ok(())
    }

    /// Queries `[B, H, T, D]` at the positions `placed` says, scaled.
    pub(crate) fn apply(&self, q: &Tensor, placed: Placed<'_>) -> Result<Tensor> {
        // `[T, 1]` or `[B, 1, T, 1]`: a scale per position, across its head's dimensions.
        let (positions, _) = placed.positions(q.size()[2], q.device())?;
        let positions = if self.from_one { positions.f_add_scalar(1.0)? } else { positions };
        let steps = positions.f_unsqueeze(-1)?.f_div_scalar(self.every as f64)?.f_floor()?;
        let scale = steps.f_add_scalar(1.0)?.f_log()?.f_mul_scalar(self.beta)?.f_add_scalar(1.0)?;
        Ok(q.f_mul(&scale.f_to_kind(q.kind())?)?)
    }
}

/// A rotary embedding: its base, scaling, and the share of each head's dimensions it turns
/// (the rest pass through, as in Phi-3's `partial_rotary_factor`), or, proportionally, the
/// share of each head's pairs that turn at all (Gemma 4's global layers).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    /// Base of the unscaled inverse frequencies `theta^(-2i/d)` (`rope_theta`).
    pub theta: f64,
    /// How the frequencies are scaled; none by default.
    #[serde(default)]
    pub scaling: RopeScaling,
    /// The share of each head's dimensions the rotation turns; 1 (all) by default.
    #[serde(default = "whole")]
    pub partial: f64,
    /// The partial share is of the pairs of the whole head's halves: the first
    /// `⌊partial · d/2⌋` pairs turn at the frequencies `theta^(-2i/d)` of the whole width
    /// `d`, the others not at all (`transformers`' `proportional` rotation).
    #[serde(default)]
    pub proportional: bool,
}

fn whole() -> f64 {
    1.0
}

impl Rope {
    /// An unscaled rotation of base `theta` that turns whole heads.
    pub fn new(theta: f64) -> Rope {
        Rope { theta, scaling: RopeScaling::None, partial: 1.0, proportional: false }
    }

    /// The rotated width of a head `head_dim` wide (even, as the half-rotation needs): a
    /// proportional rotation spans the whole head, its unturned pairs at frequency zero.
    pub fn rotated_dims(&self, head_dim: i64) -> i64 {
        if self.proportional {
            return head_dim;
        }
        let dims = (head_dim as f64 * self.partial) as i64;
        dims - dims % 2
    }

    /// The pairs that turn in a head `head_dim` wide.
    fn turning_pairs(&self, head_dim: i64) -> i64 {
        match self.proportional {
            true => (self.partial * head_dim as f64 / 2.0).floor() as i64,
            false => self.rotated_dims(head_dim) / 2,
        }
    }

    /// Checks the parameters, naming the first that cannot work.
    pub fn validate(&self, head_dim: i64) -> Result<()> {
        let bad = |what: String| Err(Error::Config(format!("rotary embedding: {what}")));
        if !(self.theta.is_finite() && self.theta > 0.0) {
            return bad(format!("rope_theta must be positive, got {}", self.theta));
        }
        if !(self.partial > 0.0 && self.partial <= 1.0) || self.turning_pairs(head_dim) < 1 {
            return bad(format!("partial_rotary_factor {} leaves no pair of the {head_dim} dimensions", self.partial));
        }
        if self.proportional && !matches!(self.scaling, RopeScaling::None | RopeScaling::Linear { .. }) {
            return bad("a proportional rotation scales its frequencies linearly or not at all".into());
        }
        let (factor, context) = match &self.scaling {
            RopeScaling::None => return Ok(()),
            RopeScaling::NtkAlpha { alpha } => (*alpha, 1),
            RopeScaling::LongRope { short, long, original_context, attention_factor } => {
                let pairs = self.rotated_dims(head_dim) as usize / 2;
                if short.len() != pairs || long.len() != pairs {
                    return bad(format!(
                        "longrope needs a short and a long factor per rotated pair ({pairs}), got {} and {}",
                        short.len(),
                        long.len()
                    ));
                }
                if !short.iter().chain(long).chain([attention_factor]).all(|f| f.is_finite() && *f > 0.0) {
                    return bad("longrope's factors must be positive".into());
                }
                (1.0, *original_context)
            }
            RopeScaling::Linear { factor } => (*factor, 1),
            RopeScaling::Dynamic { factor, original_context } => (*factor, *original_context),
            RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, attention_factor, .. } => {
                if !(beta_fast > beta_slow && *beta_slow > 0.0 && attention_factor.is_finite()) {
                    return bad(format!("yarn needs beta_fast > beta_slow > 0, got {beta_fast} and {beta_slow}"));
                }
                (*factor, *original_context)
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_context } => {
                if !(high_freq_factor > low_freq_factor && *low_freq_factor > 0.0) {
                    return bad(format!(
                        "llama3 needs high_freq_factor > low_freq_factor > 0, got {high_freq_factor} and {low_freq_factor}"
                    ));
                }
                (*factor, *original_context)
            }
        };
        if !(factor.is_finite() && factor > 0.0) || context <= 0 {
            return bad(format!("scaling factor {factor} and original context {context} must be positive"));
        }
        Ok(())
    }

    /// The factor cosines and sines are multiplied by (YaRN's attention factor; else 1).
    pub fn attention_factor(&self) -> f64 {
        match self.scaling {
            RopeScaling::Yarn { attention_factor, .. } | RopeScaling::LongRope { attention_factor, .. } => {
                attention_factor
            }
            _ => 1.0,
        }
    }

    /// The inverse frequencies of the `rotated_dims(head_dim) / 2` rotated pairs once the
    /// sequence reaches `len` positions (only dynamic scaling depends on it).
    pub fn inverse_frequencies(&self, head_dim: i64, len: i64) -> Vec<f64> {
        let dim = self.rotated_dims(head_dim);
        let turning = self.turning_pairs(head_dim);
        let unscaled = |base: f64| -> Vec<f64> {
            let frequency = |i: i64| if i < turning { base.powf(-2.0 * i as f64 / dim as f64) } else { 0.0 };
            (0..dim / 2).map(frequency).collect()
        };
        match &self.scaling {
            RopeScaling::None => unscaled(self.theta),
            RopeScaling::LongRope { short, long, original_context, .. } => {
                let factors = if len > *original_context { long } else { short };
                unscaled(self.theta).into_iter().zip(factors).map(|(f, by)| f / by).collect()
            }
            RopeScaling::Linear { factor } => unscaled(self.theta).into_iter().map(|f| f / factor).collect(),
            &RopeScaling::NtkAlpha { alpha } => {
                let d = dim as f64;
                unscaled(self.theta * alpha.powf(d / (d - 2.0)))
            }
            &RopeScaling::Dynamic { factor, original_context } => {
                let (len, context) = (len.max(original_context) as f64, original_context as f64);
                let d = dim as f64;
                unscaled(self.theta * (factor * len / context - (factor - 1.0)).powf(d / (d - 2.0)))
            }
            &RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, truncate, .. } => {
                let d = dim as f64;
                // The dimension whose pair turns `turns` times over the original context.
                let dimension_of =
                    |turns: f64| d * (original_context as f64 / (turns * 2.0 * PI)).ln() / (2.0 * self.theta.ln());
                let (mut low, mut high) = (dimension_of(beta_fast), dimension_of(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                unscaled(self.theta)
                    .into_iter()
                    .enumerate()
                    .map(|(i, kept)| {
                        let keep = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        kept / factor * (1.0 - keep) + kept * keep
                    })
                    .collect()
            }
            &RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_context } => {
                let context = original_context as f64;
                let (long, short) = (context / low_freq_factor, context / high_freq_factor);
                unscaled(self.theta)
                    .into_iter()
                    .map(|f| {
                        let wavelength = 2.0 * PI / f;
                        if wavelength < short {
                            f
                        } else if wavelength > long {
                            f / factor
                        } else {
                            let smooth =
                                (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}

/// Where a forward's new positions sit: after `start` earlier ones (those a decoding cache
/// holds), or at each row's positions `[B, T]` (packed examples, each starting again at 0,
/// or left-padded rows decoded together) in rows of the given length.
#[derive(Clone, Copy)]
pub(crate) enum Placed<'a> {
    After(i64),
    Packed(&'a Tensor, i64),
}

impl Placed<'_> {
    /// The positions of `t` new positions in fp32 (`[T]` after a start, `[B, 1, T]` packed:
    /// one row of them per row, shared by its heads), and the length of the rows they lie in.
    pub(crate) fn positions(self, t: i64, device: Device) -> Result<(Tensor, i64)> {
        Ok(match self {
            Placed::After(start) => (Tensor::f_arange_start(start, start + t, (Kind::Float, device))?, start + t),
            Placed::Packed(positions, len) => (positions.f_to_kind(Kind::Float)?.f_unsqueeze(1)?, len),
        })
    }
}

/// A [`Rope`] at work in a unit: queries and keys rotated with one pair of cosine and sine
/// tables, from inverse frequencies kept on the device they were last used on. They are
/// made again only where they change: on another device, or, under dynamic scaling, for
/// another sequence length.
pub struct Rotation {
    rope: Rope,
    /// The device, the length the frequencies are for (0 where they do not depend on it;
    /// LongRoPE's: 1 past its original context), and the frequencies.
    frequencies: Mutex<Option<(Device, i64, Tensor)>>,
}

impl Rotation {
    /// The rotation `rope` describes, its tables made at first use.
    pub fn new(rope: Rope) -> Rotation {
        Rotation { rope, frequencies: Mutex::new(None) }
    }

    /// The fp32 inverse frequencies of heads `head_dim` wide on `device`, for `len` positions.
    fn frequencies(&self, head_dim: i64, len: i64, device: Device) -> Result<Tensor> {
        // Only these scalings depend on the length; LongRoPE only on which side of its
        // original context it lies.
        let key = match &self.rope.scaling {
            RopeScaling::Dynamic { .. } => len,
            RopeScaling::LongRope { original_context, .. } => i64::from(len > *original_context),
            _ => 0,
        };
        let mut held = self.frequencies.lock().map_err(|_| Error::Model("a rotation's lock was poisoned".into()))?;
        if let Some((_, _, f)) = held.as_ref().filter(|(d, l, _)| *d == device && *l == key) {
            return Ok(f.shallow_clone());
        }
        let f = Tensor::f_from_slice(&self.rope.inverse_frequencies(head_dim, len))?
            .f_to_kind(Kind::Float)?
            .f_to_device(device)?;
        *held = Some((device, key, f.shallow_clone()));
        Ok(f)
    }

    /// Rotates queries and keys `[B, H, T, D]` whose first position is `start`, by
    /// position; the frequencies are those of a sequence of `start + T` positions.
    pub fn rotate(&self, q: &Tensor, k: &Tensor, start: i64) -> Result<(Tensor, Tensor)> {
        self.rotate_placed(q, k, Placed::After(start))
    }

    /// The dimensions of heads `head_dim` wide it turns.
    pub(crate) fn rotated_dims(&self, head_dim: i64) -> i64 {
        self.rope.rotated_dims(head_dim)
    }

    /// Rotates queries and keys `[B, H, T, D]` at the positions `placed` says.
    pub(crate) fn rotate_placed(&self, q: &Tensor, k: &Tensor, placed: Placed<'_>) -> Result<(Tensor, Tensor)> {
        let (positions, len) = placed.positions(q.size()[2], q.device())?;
        // LongRoPE reads the furthest position, as transformers' does: packed examples each
        // restart, so a row may be longer than any of them.
        let len = match (&self.rope.scaling, placed) {
            (RopeScaling::LongRope { .. }, Placed::Packed(..)) => positions.f_max()?.f_double_value(&[])? as i64 + 1,
            _ => len,
        };
        self.rotate_by(q, k, &positions, len)
    }

    /// Rotates queries and keys `[B, H, T, D]` by each row's own positions `[B, T]` (packed
    /// examples, each starting again at 0); the frequencies are those of rows `len` long.
    pub fn rotate_at(&self, q: &Tensor, k: &Tensor, positions: &Tensor, len: i64) -> Result<(Tensor, Tensor)> {
        self.rotate_placed(q, k, Placed::Packed(positions, len))
    }

    /// Rotates by angles `positions · frequencies` (`positions` `[T]`, or `[B, 1, T]`), the
    /// frequencies those of a sequence of `len` positions.
    fn rotate_by(&self, q: &Tensor, k: &Tensor, positions: &Tensor, len: i64) -> Result<(Tensor, Tensor)> {
        let d = q.size()[3];
        let dims = self.rope.rotated_dims(d);
        let inv_freq = self.frequencies(d, len, q.device())?;
        // Angles in fp32 whatever the heads' dtype, as the frequencies are.
        let freqs = positions.f_unsqueeze(-1)?.f_mul(&inv_freq)?;
        let angles = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        let factor = self.rope.attention_factor();
        let (cos, sin) = (angles.f_cos()?.f_mul_scalar(factor)?, angles.f_sin()?.f_mul_scalar(factor)?);
        let (cos, sin) = (cos.f_to_kind(q.kind())?, sin.f_to_kind(q.kind())?);
        let turn = |x: &Tensor| -> Result<Tensor> {
            if dims == d {
                return rotary(x, &cos, &sin);
            }
            let (turned, passed) = (x.f_narrow(-1, 0, dims)?, x.f_narrow(-1, dims, d - dims)?);
            Ok(Tensor::f_cat(&[&rotary(&turned, &cos, &sin)?, &passed], -1)?)
        };
        Ok((turn(q)?, turn(k)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-12 * x.abs().max(1e-30))
    }

    #[test]
    fn unscaled_frequencies_fall_from_one_by_the_base() {
        let f = Rope::new(10_000.0).inverse_frequencies(8, 1);
        assert!(close(&f, &[1.0, 0.1, 0.01, 0.001]), "{f:?}");
    }

    #[test]
    fn llama3_keeps_short_wavelengths_divides_long_ones_and_blends_between() {
        let rope = Rope {
            theta: 10_000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 64,
            },
            ..Rope::new(10_000.0)
        };
        let base = Rope::new(10_000.0).inverse_frequencies(16, 1);
        let scaled = rope.inverse_frequencies(16, 1);
        let (mut kept, mut divided, mut blended) = (0, 0, 0);
        for (f, s) in base.iter().zip(&scaled) {
            let wavelength = 2.0 * PI / f;
            if wavelength < 16.0 {
                assert_eq!(f, s);
                kept += 1;
            } else if wavelength > 64.0 {
                assert!((s - f / 8.0).abs() < 1e-15);
                divided += 1;
            } else {
                assert!(*s < *f && *s > f / 8.0, "{s} between {f} and its eighth");
                blended += 1;
            }
        }
        assert!(kept > 0 && divided > 0 && blended > 0, "{kept} {divided} {blended}");
    }

    #[test]
    fn dynamic_scaling_starts_past_the_original_context() {
        let rope = Rope { scaling: RopeScaling::Dynamic { factor: 2.0, original_context: 16 }, ..Rope::new(100.0) };
        assert_eq!(rope.inverse_frequencies(8, 10), Rope::new(100.0).inverse_frequencies(8, 10));
        let longer = rope.inverse_frequencies(8, 32);
        // base · (2·32/16 − 1)^(8/6)
        let base = 100.0 * 3f64.powf(8.0 / 6.0);
        assert!(close(&longer, &Rope::new(base).inverse_frequencies(8, 1)), "{longer:?}");
    }

    #[test]
    fn a_fixed_ntk_stretch_raises_the_base_once() {
        let rope = Rope { scaling: RopeScaling::NtkAlpha { alpha: 4.0 }, ..Rope::new(100.0) };
        let base = 100.0 * 4f64.powf(8.0 / 6.0);
        assert!(close(&rope.inverse_frequencies(8, 1), &Rope::new(base).inverse_frequencies(8, 1)));
        assert_eq!(rope.inverse_frequencies(8, 1), rope.inverse_frequencies(8, 4096), "whatever the length");
        assert!(Rope { scaling: RopeScaling::NtkAlpha { alpha: 0.0 }, ..rope }.validate(8).is_err());
    }

    #[test]
    fn yarn_interpolates_low_frequencies_only() {
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_context: 32,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
            truncate: true,
        };
        let rope = Rope { scaling, ..Rope::new(10_000.0) };
        let (base, scaled) = (Rope::new(10_000.0).inverse_frequencies(32, 1), rope.inverse_frequencies(32, 1));
        assert_eq!(scaled[0], base[0], "the fastest pair is kept");
        assert!((scaled[15] - base[15] / 4.0).abs() < 1e-15, "the slowest pair is interpolated");
        assert!((rope.attention_factor() - 1.138_629_436_111_989).abs() < 1e-12);
    }

    #[test]
    fn a_partial_rotation_passes_the_other_dimensions_through() {
        let rope = Rope { partial: 0.5, ..Rope::new(10.0) };
        let too_narrow = Rope { partial: 0.1, ..Rope::new(10.0) };
        let x = Tensor::randn([1, 2, 5, 8], (Kind::Float, tch::Device::Cpu));
        let (y, _) = Rotation::new(rope).rotate(&x, &x, 3).unwrap();
        assert_eq!(y.narrow(-1, 4, 4), x.narrow(-1, 4, 4));
        assert!((y.narrow(-1, 0, 4) - x.narrow(-1, 0, 4)).abs().max().double_value(&[]) > 1e-3);
        assert!(too_narrow.validate(8).is_err());
    }

    #[test]
    fn a_proportional_rotation_turns_the_first_pairs_of_whole_halves_at_the_whole_widths_frequencies() {
        let rope = Rope {
            partial: 0.25,
            proportional: true,
            scaling: RopeScaling::Linear { factor: 2.0 },
            ..Rope::new(100.0)
        };
        // Of 8 pairs, the first 2 turn, at 100^(-2i/16) halved.
        let f = rope.inverse_frequencies(16, 1);
        assert!(close(&f[..2], &[0.5, 100f64.powf(-0.125) / 2.0]) && f[2..].iter().all(|&f| f == 0.0), "{f:?}");
        let x = Tensor::randn([1, 2, 5, 16], (Kind::Float, tch::Device::Cpu));
        let (y, _) = Rotation::new(rope.clone()).rotate(&x, &x, 3).unwrap();
        // Pairs (i, i + 8): the first two of each half turn, the rest pass through.
        for (at, n) in [(2, 6), (10, 6)] {
            assert_eq!(y.narrow(-1, at, n), x.narrow(-1, at, n));
        }
        assert!((y.narrow(-1, 8, 2) - x.narrow(-1, 8, 2)).abs().max().double_value(&[]) > 1e-3);
        assert!(Rope { partial: 0.05, ..rope.clone() }.validate(16).is_err());
        assert!(Rope { scaling: RopeScaling::Dynamic { factor: 2.0, original_context: 4 }, ..rope }
            .validate(16)
            .is_err());
    }

    #[test]
    fn each_row_turns_by_its_own_positions() {
        let rotation = Rotation::new(Rope::new(10_000.0));
        let x = Tensor::randn([2, 2, 4, 8], (Kind::Float, tch::Device::Cpu));
        // Row 0 at positions 0..4; row 1 holds an example at 3..5 then one from 0 again.
        let positions = Tensor::from_slice(&[0i64, 1, 2, 3, 3, 4, 0, 1]).view([2, 4]);
        let (packed, _) = rotation.rotate_at(&x, &x, &positions, x.size()[2]).unwrap();
        let (from_0, _) = rotation.rotate(&x, &x, 0).unwrap();
        let (from_3, _) = rotation.rotate(&x, &x, 3).unwrap();
        let row = |t: &Tensor, r: i64, at: i64, n: i64| t.get(r).narrow(1, at, n);
        let same = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) < 1e-6;
        assert!(same(&row(&packed, 0, 0, 4), &row(&from_0, 0, 0, 4)));
        assert!(same(&row(&packed, 1, 0, 2), &row(&from_3, 1, 0, 2)));
        // The second example of row 1 turns as if it began the row: by positions 0 and 1.
        let second = x.get(1).narrow(1, 2, 2).unsqueeze(0);
        let alone = rotation.rotate(&second, &second, 0).unwrap().0;
        assert!(same(&row(&packed, 1, 2, 2), &alone.get(0)));
    }
}
