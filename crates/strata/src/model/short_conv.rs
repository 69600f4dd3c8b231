//! LFM2's gated short convolution (`conv` layers): `in_proj` gives per channel an input gate
//! `B`, an output gate `C` and a value `x`; the causal depthwise convolution (a few positions
//! wide) runs over `B · x`, and `C` gates its output before `out_proj`. Its state is the
//! convolution's last inputs alone.
//!
//! Owns: the layer's configuration, the declaration of its parameters and its forward, with
//! and without a decoding cache. Must not own the block around it ([`super::llama`] runs the
//! norms, residual sums and feed-forward).
use super::linear::{causal_conv, RecurrentState};
use super::{DecodeCache, Init, ParamId, Params, TpRole, UnitBuilder, INIT_STD};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// A short convolution's sizes, as LFM2's `config.json` names them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShortConvConfig {
    /// Width of the convolution (`conv_L_cache`).
    pub kernel: i64,
    /// Biases on the convolution and both projections (`conv_bias`).
    pub bias: bool,
}

impl ShortConvConfig {
    /// Fails where the width is not positive.
    pub fn validate(&self) -> Result<()> {
        super::positive(&[("conv_L_cache", self.kernel)])
    }

    /// Values a token keeps for the backward beyond the block's residual stream: the
    /// projection, the gated input, the convolution's output and the gated output.
    pub(crate) fn kept_per_token(&self, dim: i64) -> i64 {
        4 * dim + 3 * dim + 3 * dim
    }
}

/// A weight and its optional bias.
type Dense = (ParamId, Option<ParamId>);

/// A block's short convolution: its parameters and width.
pub(crate) struct ShortConv {
    in_proj: Dense,
    conv: Dense,
    out_proj: Dense,
}

impl ShortConv {
    /// Declares layer `name`'s short convolution over hidden states `dim` wide, named as
    /// LFM2's folders name it (`{name}.conv.*`).
    pub(crate) fn declare(u: &mut UnitBuilder<'_>, name: &str, config: &ShortConvConfig, dim: i64) -> ShortConv {
        let normal = Init::Normal { std: INIT_STD };
        let at = |what: &str| format!("{name}.conv.{what}");
        // Tensor parallelism is refused for this layer (`check_tensor_parallel`): its
        // parameters are whole on every rank.
        let whole = TpRole::SequenceReplicated;
        let bias = |u: &mut UnitBuilder<'_>, what: &str, width: i64| {
            config.bias.then(|| u.param(at(&format!("{what}.bias")), &[width], Init::Zeros, whole))
        };
        let in_proj = u.linear(at("in_proj.weight"), &[3 * dim, dim], normal, whole);
        let in_proj = (in_proj, bias(u, "in_proj", 3 * dim));
        let conv = u.param(at("conv.weight"), &[dim, 1, config.kernel], normal, whole);
        let conv = (conv, bias(u, "conv", dim));
        let out_proj = u.linear(at("out_proj.weight"), &[dim, dim], normal, whole);
        ShortConv { in_proj, conv, out_proj: (out_proj, bias(u, "out_proj", dim)) }
    }

    /// The layer over the normed hidden states `h` `[B, T, D]`; with a cache, continuing
    /// from (and leaving) the convolution's last inputs. `keep` `[B, T]` (1 for a token, 0
    /// for padding) zeroes padding's convolution inputs, which the projection's bias would
    /// otherwise make, so that a padded row reads as it does alone.
    pub(crate) fn forward(
        &self,
        p: &Params<'_>,
        h: &Tensor,
        cache: Option<&mut DecodeCache>,
        keep: Option<&Tensor>,
    ) -> Result<Tensor> {
        let projected = p.linear(h, self.in_proj.0, self.in_proj.1)?;
        let parts = projected.f_chunk(3, -1)?;
        let [input_gate, output_gate, x] =
            <[Tensor; 3]>::try_from(parts).map_err(|_| Error::Model("in_proj split".into()))?;
        let previous = cache.as_ref().and_then(|c| c.recurrent()).map(|r| &r.conv);
        let bias = self.conv.1.map(|b| &p[b]);
        let mut gated = input_gate.f_mul(&x)?;
        if let Some(keep) = keep {
            gated = gated.f_mul(&keep.f_unsqueeze(-1)?.f_to_kind(gated.kind())?)?;
        }
        let (convolved, kept) = causal_conv(&gated, &p[self.conv.0], bias, previous)?;
        if let Some(cache) = cache {
            cache.keep_recurrent(RecurrentState { conv: kept.f_detach()?, state: None });
        }
        p.linear(&output_gate.f_mul(&convolved)?, self.out_proj.0, self.out_proj.1)
    }
}
