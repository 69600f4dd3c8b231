//! Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
//! projection with a norm between its halves; keys and values from one compressed latent
//! per position (normed), expanded per head, beside a rotated key part that one key serves
//! for every head; each head's query and key hold a part without rotation and a rotated
//! part, and its value a width of its own.
//!
//! Owns: the attention's configuration, the declaration of its projections and the queries,
//! keys and values it hands the decoder block. Must not own the attention itself, the output
//! projection or the rest of the block ([`super::llama`] runs those as for every head
//! layout). Generation caches the latent and the rotated key part, not whole keys and
//! values: a position costs `kv_rank + rope_dim` values per layer.
use super::layers::{rms_norm, rms_norm_into_product, split_heads, Projected};
use super::rope::{pairs_as_halves, Placed, QueryScaling, Rope, RopeScaling, Rotation};
use super::{DecodeCache, Init, ParamId, Params, TpRole, UnitBuilder, INIT_STD};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// The epsilon of the latent attention's own norms (`transformers` builds them with their
/// class default, whatever `rms_norm_eps` says).
const LATENT_NORM_EPS: f64 = 1e-6;

/// A latent attention's sizes, as `config.json` names them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatentConfig {
    /// Rank of the queries' low-rank projection (`q_lora_rank`); `None`: one projection.
    pub q_rank: Option<i64>,
    /// Width of the compressed key/value latent (`kv_lora_rank`).
    pub kv_rank: i64,
    /// Each head's query and key dimensions without rotation (`qk_nope_head_dim`).
    pub nope_dim: i64,
    /// Each head's rotated query and key dimensions (`qk_rope_head_dim`).
    pub rope_dim: i64,
    /// Each head's value width (`v_head_dim`).
    pub value_dim: i64,
    /// The projections give the rotated dimensions as interleaved pairs (`rope_interleave`).
    pub interleaved: bool,
    /// YaRN's `mscale_all_dim`: the attention scores are scaled by the square of
    /// `0.1 · m · ln(factor) + 1` besides `head^-1/2` where the rotation is scaled; 0: not.
    #[serde(default)]
    pub mscale_all_dim: f64,
}

impl LatentConfig {
    /// Width of a head's query and key.
    pub fn query_dim(&self) -> i64 {
        self.nope_dim + self.rope_dim
    }

    /// Fails with the first size that is not positive or a rotated width that is odd.
    pub fn validate(&self) -> Result<()> {
        super::positive(&[
            ("kv_lora_rank", self.kv_rank),
            ("qk_nope_head_dim", self.nope_dim),
            ("qk_rope_head_dim", self.rope_dim),
            ("v_head_dim", self.value_dim),
        ])?;
        if let Some(r) = self.q_rank.filter(|&r| r <= 0) {
            return Err(Error::Config(format!("q_lora_rank must be positive, got {r}")));
        }
        if self.rope_dim % 2 != 0 {
            return Err(Error::Config(format!("qk_rope_head_dim must be even, got {}", self.rope_dim)));
        }
        if !(self.mscale_all_dim.is_finite() && self.mscale_all_dim >= 0.0) {
            return Err(Error::Config(format!("mscale_all_dim must be 0 or more, got {}", self.mscale_all_dim)));
        }
        Ok(())
    }

    /// The attention scores' scale: `query_dim^-1/2`, times YaRN's `mscale²` where the
    /// rotation is scaled by a factor and `mscale_all_dim` is set.
    pub fn score_scale(&self, rope: &Rope) -> f64 {
        let factor = match rope.scaling {
            RopeScaling::None | RopeScaling::NtkAlpha { .. } | RopeScaling::LongRope { .. } => None,
            RopeScaling::Linear { factor }
            | RopeScaling::Dynamic { factor, .. }
            | RopeScaling::Yarn { factor, .. }
            | RopeScaling::Llama3 { factor, .. } => Some(factor),
        };
        let mscale = match factor {
            Some(f) if self.mscale_all_dim > 0.0 && f > 1.0 => 0.1 * self.mscale_all_dim * f.ln() + 1.0,
            _ => 1.0,
        };
        (self.query_dim() as f64).powf(-0.5) * mscale * mscale
    }
}

/// The queries' projection: one, or down to a low rank, normed, and up.
enum QueryProjection {
    Direct(ParamId),
    LowRank { down: (ParamId, Option<ParamId>), norm: ParamId, up: ParamId },
}

/// A block's latent attention: its projections, sizes and rotation.
pub(crate) struct LatentAttention {
    queries: QueryProjection,
    kv_down: (ParamId, Option<ParamId>),
    kv_norm: ParamId,
    kv_up: ParamId,
    config: LatentConfig,
    rotation: Rotation,
    /// Mistral 4's scale of the queries by position, after their rotation.
    query_scaling: Option<QueryScaling>,
}

impl LatentAttention {
    /// Declares the projections of layer `name`'s attention over hidden states `dim` wide
    /// with `heads` heads (biases on the down projections where `bias`), named as
    /// DeepSeek's folders name them.
    pub(crate) fn declare(
        u: &mut UnitBuilder<'_>,
        name: &str,
        config: &LatentConfig,
        dim: i64,
        heads: i64,
        bias: bool,
        rope: Rope,
    ) -> LatentAttention {
        let normal = Init::Normal { std: INIT_STD };
        let attn = |what: &str| format!("{name}.self_attn.{what}");
        // The down projections and their norms are whole on every tensor rank, which uses
        // them for its own heads alone: their gradients are partial sums.
        let down = |u: &mut UnitBuilder<'_>, what: &str, out: i64| {
            let weight = u.linear(attn(&format!("{what}.weight")), &[out, dim], normal, TpRole::PartialGradient);
            let bias =
                bias.then(|| u.param(attn(&format!("{what}.bias")), &[out], Init::Zeros, TpRole::PartialGradient));
            (weight, bias)
        };
        let query_out = heads * config.query_dim();
        let queries = match config.q_rank {
            None => QueryProjection::Direct(u.linear(attn("q_proj.weight"), &[query_out, dim], normal, TpRole::COLUMN)),
            Some(rank) => QueryProjection::LowRank {
                down: down(u, "q_a_proj", rank),
                norm: u.norm(attn("q_a_layernorm.weight"), &[rank], Init::Ones, TpRole::PartialGradient),
                up: u.linear(attn("q_b_proj.weight"), &[query_out, rank], normal, TpRole::COLUMN),
            },
        };
        let kv_down = down(u, "kv_a_proj_with_mqa", config.kv_rank + config.rope_dim);
        let kv_norm = u.norm(attn("kv_a_layernorm.weight"), &[config.kv_rank], Init::Ones, TpRole::PartialGradient);
        let kv_out = heads * (config.nope_dim + config.value_dim);
        let kv_up = u.linear(attn("kv_b_proj.weight"), &[kv_out, config.kv_rank], normal, TpRole::COLUMN);
        let rotation = Rotation::new(rope);
        LatentAttention { queries, kv_down, kv_norm, kv_up, config: config.clone(), rotation, query_scaling: None }
    }

    /// The attention with its queries scaled by position as `scaling` says (Mistral 4).
    pub(crate) fn with_query_scaling(self, scaling: Option<QueryScaling>) -> LatentAttention {
        LatentAttention { query_scaling: scaling, ..self }
    }

    /// This rank's queries and keys `[B, H, T, nope + rope]` and values `[B, H, T', value]`
    /// (`heads` of them) for the normed input `h`, rotated where `placed` says; with a
    /// cache, the keys and values cover every position it holds. No output gates.
    pub(crate) fn queries_keys_values(
        &self,
        p: &Params<'_>,
        h: &Tensor,
        heads: i64,
        placed: Placed<'_>,
        cache: Option<&mut DecodeCache>,
    ) -> Result<Projected> {
        let c = &self.config;
        let q = match self.queries {
            QueryProjection::Direct(w) => p.linear(h, w, None)?,
            QueryProjection::LowRank { down, norm, up } => {
                let low = p.linear(h, down.0, down.1)?;
                p.linear(&rms_norm_into_product(&low, &p[norm], LATENT_NORM_EPS)?, up, None)?
            }
        };
        let q = split_heads(&q, heads)?;
        let (q_plain, q_turned) = (q.f_narrow(-1, 0, c.nope_dim)?, q.f_narrow(-1, c.nope_dim, c.rope_dim)?);
        let compressed = p.linear(h, self.kv_down.0, self.kv_down.1)?;
        let latent = rms_norm(&compressed.f_narrow(-1, 0, c.kv_rank)?, &p[self.kv_norm], LATENT_NORM_EPS)?;
        // One rotated key part for every head: [B, 1, T, rope].
        let k_turned = compressed.f_narrow(-1, c.kv_rank, c.rope_dim)?.f_unsqueeze(1)?;
        let (q_turned, k_turned) = match c.interleaved {
            true => pairs_as_halves(&q_turned, &k_turned, c.rope_dim)?,
            false => (q_turned, k_turned),
        };
        let (q_turned, k_turned) = self.rotation.rotate_placed(&q_turned, &k_turned, placed)?;
        let (latent, k_turned) = match cache {
            Some(cache) => cache.extend(&latent.f_unsqueeze(1)?, &k_turned)?,
            None => (latent.f_unsqueeze(1)?, k_turned),
        };
        let kv = split_heads(&p.linear(&latent.f_squeeze_dim(1)?, self.kv_up, None)?, heads)?;
        let (k_plain, v) = (kv.f_narrow(-1, 0, c.nope_dim)?, kv.f_narrow(-1, c.nope_dim, c.value_dim)?);
        let k_turned = k_turned.f_expand([-1, heads, -1, -1], false)?;
        let q = Tensor::f_cat(&[q_plain, q_turned], -1)?;
        let q = match &self.query_scaling {
            Some(scaling) => scaling.apply(&q, placed)?,
            None => q,
        };
        let k = Tensor::f_cat(&[k_plain, k_turned], -1)?;
        Ok((q, k, v, None))
    }
}
