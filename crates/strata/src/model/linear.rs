//! Gated DeltaNet linear attention (Qwen3-Next's, Qwen3.5's and OLMo Hybrid's `linear_attn`): a recurrent state per
//! value head, `[key_dim, value_dim]`, that each position decays by its gate, corrects by
//! the delta rule (the state's prediction for the position's key moved towards its value by
//! `beta`) and reads with its query. Training computes it in chunks of 64 positions, as
//! `transformers`' own torch path does: within a chunk by a triangular solve, between chunks
//! through the state. Before it, a short causal depthwise convolution over the queries, keys
//! and values; after it, an RMS norm gated by `silu(z)` per head.
//!
//! Owns: the layer's configuration, the declaration of its parameters and its forward,
//! with and without a decoding cache (which carries the convolution's last inputs and the
//! recurrent state instead of keys and values). Must not own the block around it
//! ([`super::llama`] runs the norms, residual sums and feed-forward).
use super::layers::rms_normalized;
use super::{DecodeCache, Init, ParamId, Params, TpRole, UnitBuilder, INIT_STD};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// Positions computed together by the chunked delta rule.
pub(crate) const CHUNK: i64 = 64;

/// A Gated DeltaNet's sizes, as `config.json` names them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinearAttentionConfig {
    /// Query and key heads (`linear_num_key_heads`).
    pub key_heads: i64,
    /// Value heads (`linear_num_value_heads`), a multiple of the key heads.
    pub value_heads: i64,
    /// Width of a query or key head (`linear_key_head_dim`).
    pub key_dim: i64,
    /// Width of a value head (`linear_value_head_dim`).
    pub value_dim: i64,
    /// Width of the causal convolution (`linear_conv_kernel_dim`).
    pub conv_kernel: i64,
    /// Qwen3.5's projections: the queries, keys and values in one (`in_proj_qkv`, every
    /// query head, then every key head, then every value head), the output gates `z`, the
    /// betas and the decays each in their own (`in_proj_z`, `in_proj_b`, `in_proj_a`). Else
    /// Qwen3-Next's two, which hold each key head's part together: its query, key, values
    /// and gates (`in_proj_qkvz`), then its betas and decays (`in_proj_ba`).
    #[serde(default)]
    pub split_projections: bool,
    /// OLMo Hybrid's projections, each apart: `q_proj`, `k_proj`, `v_proj`, the gates
    /// `g_proj`, the betas `b_proj` and the decays `a_proj`, the gated norm `o_norm` and the
    /// output `o_proj` (in place of `norm` and `out_proj`); the convolution's weight apart
    /// too, `q_conv1d`, `k_conv1d` and `v_conv1d`.
    #[serde(default)]
    pub apart_projections: bool,
    /// Each beta doubled, so that it lies in `(0, 2)` and the state's update may reverse
    /// (OLMo Hybrid's `linear_allow_neg_eigval`).
    #[serde(default)]
    pub doubled_beta: bool,
    /// The gated norm's epsilon where it is its own (OLMo Hybrid's 1e-5); `None`: the
    /// decoder's.
    #[serde(default)]
    pub gate_norm_eps: Option<f64>,
}

impl LinearAttentionConfig {
    /// Fails with the first size that is not positive or value heads that the key heads do
    /// not divide.
    pub fn validate(&self) -> Result<()> {
        super::positive(&[
            ("linear_num_key_heads", self.key_heads),
            ("linear_num_value_heads", self.value_heads),
            ("linear_key_head_dim", self.key_dim),
            ("linear_value_head_dim", self.value_dim),
            ("linear_conv_kernel_dim", self.conv_kernel),
        ])?;
        if self.split_projections && self.apart_projections {
            return Err(Error::Config("the linear attention's projections are split or apart, not both".into()));
        }
        if let Some(eps) = self.gate_norm_eps.filter(|e| !(e.is_finite() && *e > 0.0)) {
            return Err(Error::Config(format!("the linear attention's norm epsilon must be positive, got {eps}")));
        }
        if self.value_heads % self.key_heads != 0 {
            return Err(Error::Config(format!(
                "linear_num_key_heads {} must divide linear_num_value_heads {}",
                self.key_heads, self.value_heads
            )));
        }
        Ok(())
    }

    /// Values a token keeps for the backward beyond the block's residual stream: its
    /// projections, the convolution's input and output, the normalised queries and keys,
    /// the chunk's values and corrections and its square matrices (a chunk's entries a
    /// position per head).
    pub(crate) fn kept_per_token(&self, dim: i64) -> i64 {
        let qk = 2 * self.key_heads * self.key_dim;
        let values = self.value_heads * self.value_dim;
        let squares = 2 * CHUNK * self.value_heads;
        4 * dim + 2 * (qk + 2 * values) + 3 * (qk + values) + 4 * values + squares
    }

    /// Channels of the convolution: every query, key and value head.
    fn conv_channels(&self) -> i64 {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// A decoding cache's state of a recurrent mixer: the convolution's last `kernel - 1`
/// inputs `[B, C, K - 1]` and the recurrent state (fp32: a Gated DeltaNet's
/// `[B, Hv, Dk, Dv]`, a Mamba-2 mixer's `[B, H, P, N]`; none for a short convolution alone).
pub struct RecurrentState {
    /// The convolution's last inputs.
    pub conv: Tensor,
    /// The recurrence's state, where the mixer has one.
    pub state: Option<Tensor>,
}

/// A Gated DeltaNet's input projections, in one of [`LinearAttentionConfig`]'s layouts.
enum Projections {
    /// Qwen3-Next's: each key head's query, key, values and gates; its betas and decays.
    ByKeyHead { qkvz: ParamId, ba: ParamId },
    /// Qwen3.5's: queries, keys and values; gates; betas; decays.
    Split { qkv: ParamId, z: ParamId, b: ParamId, a: ParamId },
    /// OLMo Hybrid's: queries, keys, values, gates, betas and decays each apart.
    Apart { q: ParamId, k: ParamId, v: ParamId, z: ParamId, b: ParamId, a: ParamId },
}

/// A block's Gated DeltaNet: its parameters and sizes.
pub(crate) struct GatedDeltaNet {
    projections: Projections,
    /// The convolution's weight, or its parts over the queries, keys and values, in order.
    conv: Vec<ParamId>,
    dt_bias: ParamId,
    a_log: ParamId,
    norm: ParamId,
    out: ParamId,
    config: LinearAttentionConfig,
    norm_eps: f64,
}

impl GatedDeltaNet {
    /// Declares layer `name`'s linear attention over hidden states `dim` wide, named as
    /// Qwen3-Next's, Qwen3.5's or OLMo Hybrid's folders name it.
    pub(crate) fn declare(
        u: &mut UnitBuilder<'_>,
        name: &str,
        config: &LinearAttentionConfig,
        dim: i64,
        norm_eps: f64,
    ) -> GatedDeltaNet {
        let normal = Init::Normal { std: INIT_STD };
        let at = |what: &str| format!("{name}.linear_attn.{what}");
        let c = config;
        let ratio = c.value_heads / c.key_heads;
        // Tensor parallelism is refused for this layer (`check_tensor_parallel`): its
        // parameters are whole on every rank.
        let whole = TpRole::SequenceReplicated;
        let mut linear = |what: &str, rows: i64| u.linear(at(&format!("{what}.weight")), &[rows, dim], normal, whole);
        let (keys, values) = (c.key_heads * c.key_dim, c.value_heads * c.value_dim);
        let projections = match (c.split_projections, c.apart_projections) {
            (true, _) => Projections::Split {
                qkv: linear("in_proj_qkv", c.conv_channels()),
                z: linear("in_proj_z", values),
                b: linear("in_proj_b", c.value_heads),
                a: linear("in_proj_a", c.value_heads),
            },
            (_, true) => Projections::Apart {
                q: linear("q_proj", keys),
                k: linear("k_proj", keys),
                v: linear("v_proj", values),
                z: linear("g_proj", values),
                b: linear("b_proj", c.value_heads),
                a: linear("a_proj", c.value_heads),
            },
            _ => Projections::ByKeyHead {
                qkvz: linear("in_proj_qkvz", c.key_heads * (2 * c.key_dim + 2 * ratio * c.value_dim)),
                ba: linear("in_proj_ba", 2 * c.value_heads),
            },
        };
        let (norm, out) = if c.apart_projections { ("o_norm", "o_proj") } else { ("norm", "out_proj") };
        let mut conv = |what: &str, channels: i64| u.param(at(what), &[channels, 1, c.conv_kernel], normal, whole);
        let conv = match c.apart_projections {
            true => vec![conv("q_conv1d.weight", keys), conv("k_conv1d.weight", keys), conv("v_conv1d.weight", values)],
            false => vec![conv("conv1d.weight", c.conv_channels())],
        };
        GatedDeltaNet {
            projections,
            conv,
            dt_bias: u.param(at("dt_bias"), &[c.value_heads], Init::Ones, whole),
            a_log: u.param(at("A_log"), &[c.value_heads], Init::Zeros, whole),
            norm: u.norm(at(&format!("{norm}.weight")), &[c.value_dim], Init::Ones, whole),
            out: u.linear(at(&format!("{out}.weight")), &[dim, values], normal, whole),
            config: config.clone(),
            norm_eps: c.gate_norm_eps.unwrap_or(norm_eps),
        }
    }

    /// The layer over the normed hidden states `h` `[B, T, D]`; with a cache, continuing
    /// from (and leaving) its convolution inputs and recurrent state.
    pub(crate) fn forward(&self, p: &Params<'_>, h: &Tensor, cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        let c = &self.config;
        let (b, t) = (h.size()[0], h.size()[1]);
        let ratio = c.value_heads / c.key_heads;
        // The convolution's input `[B, T, C]` (every query, key, then value head; a key
        // head's values are its `ratio` value heads in order), the gates `z` and the betas'
        // and decays' logits, each with its value heads in order.
        let (mixed, z, beta_logit, a) = match self.projections {
            Projections::ByKeyHead { qkvz, ba } => {
                let qkvz = p.linear(h, qkvz, None)?.f_view([b, t, c.key_heads, -1])?;
                let widths = [c.key_dim, c.key_dim, ratio * c.value_dim, ratio * c.value_dim];
                let parts = qkvz.f_split_with_sizes(widths, 3)?;
                let [q, k, v, z] =
                    <[Tensor; 4]>::try_from(parts).map_err(|_| Error::Model("in_proj_qkvz split".into()))?;
                let ba = p.linear(h, ba, None)?.f_view([b, t, c.key_heads, 2 * ratio])?;
                let flat = |x: &Tensor| x.f_reshape([b, t, -1]);
                let mixed = Tensor::f_cat(&[flat(&q)?, flat(&k)?, flat(&v)?], -1)?;
                (mixed, z, ba.f_narrow(3, 0, ratio)?, ba.f_narrow(3, ratio, ratio)?)
            }
            Projections::Split { qkv, z, b: beta, a } => {
                (p.linear(h, qkv, None)?, p.linear(h, z, None)?, p.linear(h, beta, None)?, p.linear(h, a, None)?)
            }
            Projections::Apart { q, k, v, z, b: beta, a } => {
                let mixed = Tensor::f_cat(&[p.linear(h, q, None)?, p.linear(h, k, None)?, p.linear(h, v, None)?], -1)?;
                (mixed, p.linear(h, z, None)?, p.linear(h, beta, None)?, p.linear(h, a, None)?)
            }
        };
        let recurrent = cache.as_ref().and_then(|c| c.recurrent());
        let state = recurrent.and_then(|r| r.state.as_ref()).map(Tensor::shallow_clone);
        let conv = match self.conv.as_slice() {
            [whole] => p[*whole].shallow_clone(),
            parts => Tensor::f_cat(&parts.iter().map(|&part| &p[part]).collect::<Vec<_>>(), 0)?,
        };
        let (convolved, kept) = causal_conv(&mixed, &conv, None, recurrent.map(|r| &r.conv))?;
        let convolved = convolved.f_silu()?;
        let key_width = c.key_heads * c.key_dim;
        let q = convolved.f_narrow(-1, 0, key_width)?.f_view([b, t, c.key_heads, c.key_dim])?;
        let k = convolved.f_narrow(-1, key_width, key_width)?.f_view([b, t, c.key_heads, c.key_dim])?;
        let v = convolved.f_narrow(-1, 2 * key_width, c.value_heads * c.value_dim)?;
        let v = v.f_view([b, t, c.value_heads, c.value_dim])?;
        let beta = beta_logit.f_reshape([b, t, c.value_heads])?.f_sigmoid()?;
        let beta = if c.doubled_beta { beta.f_mul_scalar(2.0)? } else { beta };
        let a = a.f_reshape([b, t, c.value_heads])?.f_to_kind(Kind::Float)?;
        let decay = p[self.a_log]
            .f_to_kind(Kind::Float)?
            .f_exp()?
            .f_neg()?
            .f_mul(&a.f_add(&p[self.dt_bias].f_to_kind(Kind::Float)?)?.f_softplus()?)?;
        let (out, state) = chunked_delta_rule(&q, &k, &v, &decay, &beta, state.as_ref(), ratio)?;
        if let Some(cache) = cache {
            cache.keep_recurrent(RecurrentState { conv: kept.f_detach()?, state: Some(state.f_detach()?) });
        }
        // RMS norm per value head, then gated by silu(z) in fp32.
        let z = z.f_reshape([b, t, c.value_heads, c.value_dim])?;
        let normed =
            rms_normalized(&out.f_to_kind(Kind::Float)?, self.norm_eps)?.f_to_kind(out.kind())?.f_mul(&p[self.norm])?;
        let gated = normed.f_mul(&z.f_to_kind(Kind::Float)?.f_silu()?)?.f_to_kind(h.kind())?;
        p.linear(&gated.f_reshape([b, t, -1])?, self.out, None)
    }
}

/// The short causal depthwise convolution before a recurrent mixer, over `inputs`
/// `[B, T, C]` with `weight` `[C, 1, K]` (and `bias` `[C]`): each position sees the kernel's
/// width of inputs ending at it, the first ones after `previous` (a cache's last `K - 1`
/// inputs `[B, C, K - 1]`, else zeros). The outputs `[B, T, C]` and the last `K - 1` inputs
/// to keep.
pub(crate) fn causal_conv(
    inputs: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    previous: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (b, channels, width) = (inputs.size()[0], inputs.size()[2], weight.size()[2]);
    let inputs = inputs.f_transpose(1, 2)?;
    let previous = match previous {
        Some(previous) => previous.shallow_clone(),
        None => Tensor::f_zeros([b, channels, width - 1], (inputs.kind(), inputs.device()))?,
    };
    let inputs = Tensor::f_cat(&[previous, inputs], -1)?;
    let kept = inputs.f_narrow(-1, inputs.size()[2] - (width - 1), width - 1)?;
    let weight = weight.f_to_kind(inputs.kind())?;
    let bias = bias.map(|b| b.f_to_kind(inputs.kind())).transpose()?;
    let out = inputs.f_conv1d(&weight, bias.as_ref(), [1], [0], [1], channels)?;
    Ok((out.f_transpose(1, 2)?, kept))
}

/// `x / sqrt(Σ x² + 1e-6)` over the last dimension.
fn l2_normalized(x: &Tensor) -> Result<Tensor> {
    Ok(x.f_mul(&x.f_square()?.f_sum_dim_intlist(-1, true, Kind::Float)?.f_add_scalar(1e-6)?.f_rsqrt()?)?)
}

/// The gated delta rule over queries and keys `[B, T, Hk, Dk]`, values `[B, T, Hv, Dv]`,
/// log decays and betas `[B, T, Hv]` (each key head serving `ratio` value heads), from
/// `initial` (`[B, Hv, Dk, Dv]`, else zeros), in chunks: the outputs `[B, T, Hv, Dv]` (in
/// the values' dtype) and the final state (fp32).
fn chunked_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    decay: &Tensor,
    beta: &Tensor,
    initial: Option<&Tensor>,
    ratio: i64,
) -> Result<(Tensor, Tensor)> {
    let (b, t, kind) = (q.size()[0], q.size()[1], q.kind());
    let (heads, dk, dv) = (v.size()[2], q.size()[3], v.size()[3]);
    let widen = |x: &Tensor| -> Result<Tensor> {
        let x = if ratio > 1 { x.f_repeat_interleave_self_int(ratio, 2, None)? } else { x.shallow_clone() };
        Ok(x.f_transpose(1, 2)?.f_to_kind(Kind::Float)?.f_contiguous()?)
    };
    // [B, H, T, D] in fp32, queries and keys of unit length, queries scaled.
    let q = l2_normalized(&widen(q)?)?.f_mul_scalar((dk as f64).powf(-0.5))?;
    let k = l2_normalized(&widen(k)?)?;
    let v = v.f_transpose(1, 2)?.f_to_kind(Kind::Float)?;
    let (beta, decay) =
        (beta.f_transpose(1, 2)?.f_to_kind(Kind::Float)?, decay.f_transpose(1, 2)?.f_to_kind(Kind::Float)?);
    let pad = (CHUNK - t % CHUNK) % CHUNK;
    let padded = |x: &Tensor, dims: usize| -> Result<Tensor> {
        let spec: Vec<i64> = if dims == 4 { vec![0, 0, 0, pad] } else { vec![0, pad] };
        Ok(x.f_constant_pad_nd(spec)?)
    };
    let (q, k, v) = (padded(&q, 4)?, padded(&k, 4)?, padded(&v, 4)?);
    let (beta, decay) = (padded(&beta, 3)?, padded(&decay, 3)?);
    let chunks = (t + pad) / CHUNK;
    let by_chunk = |x: &Tensor| x.f_reshape([b, heads, chunks, CHUNK, -1]);
    let v_beta = by_chunk(&v.f_mul(&beta.f_unsqueeze(-1)?)?)?;
    let k_beta = by_chunk(&k.f_mul(&beta.f_unsqueeze(-1)?)?)?;
    let (q, k) = (by_chunk(&q)?, by_chunk(&k)?);
    let decay = decay.f_reshape([b, heads, chunks, CHUNK])?;
    let later = Tensor::f_ones([CHUNK, CHUNK], (Kind::Bool, q.device()))?.f_triu(1)?;
    let cumulative = decay.f_cumsum(3, Kind::Float)?;
    // exp(c_i - c_j) for j <= i, 0 above the diagonal.
    let pairwise = cumulative
        .f_unsqueeze(4)?
        .f_sub(&cumulative.f_unsqueeze(3)?)?
        .f_masked_fill(&later, f64::NEG_INFINITY)?
        .f_exp()?;
    let system = k_beta.f_matmul(&k.f_transpose(-1, -2)?)?.f_mul(&pairwise)?;
    let within = q.f_matmul(&k.f_transpose(-1, -2)?)?.f_mul(&pairwise)?;
    let decayed_k_beta = k_beta.f_mul(&cumulative.f_exp()?.f_unsqueeze(-1)?)?;
    // (I + strictly lower part of `system`)⁻¹ applied to the betas' values and keys.
    let new_values = system.f_linalg_solve_triangular(&v_beta, false, true, true)?;
    let k_cumdecay = system.f_linalg_solve_triangular(&decayed_k_beta, false, true, true)?;
    let mut state = match initial {
        Some(s) => s.f_to_kind(Kind::Float)?,
        None => Tensor::f_zeros([b, heads, dk, dv], (Kind::Float, q.device()))?,
    };
    let q = q.f_mul(&cumulative.f_exp()?.f_unsqueeze(-1)?)?;
    let last = cumulative.f_narrow(3, CHUNK - 1, 1)?;
    let k = k.f_mul(&last.f_sub(&cumulative)?.f_exp()?.f_unsqueeze(-1)?)?;
    let chunk_decay = last.f_exp()?.f_unsqueeze(-1)?;
    let mut outputs = Vec::with_capacity(chunks as usize);
    for i in 0..chunks {
        let pick = |x: &Tensor| x.f_select(2, i);
        let v_new = pick(&new_values)?.f_sub(&pick(&k_cumdecay)?.f_matmul(&state)?)?;
        let across = pick(&q)?.f_matmul(&state)?;
        outputs.push(across.f_add(&pick(&within)?.f_matmul(&v_new)?)?);
        state = state.f_mul(&pick(&chunk_decay)?)?.f_add(&pick(&k)?.f_transpose(-1, -2)?.f_matmul(&v_new)?)?;
    }
    let out = Tensor::f_stack(&outputs, 2)?.f_reshape([b, heads, -1, dv])?.f_narrow(2, 0, t)?;
    Ok((out.f_transpose(1, 2)?.f_to_kind(kind)?.f_contiguous()?, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gated delta rule position by position: decay the state, move its prediction
    /// for the key towards the value by beta, read it with the query.
    fn recurrent(q: &Tensor, k: &Tensor, v: &Tensor, decay: &Tensor, beta: &Tensor, ratio: i64) -> Tensor {
        let widen = |x: &Tensor| x.repeat_interleave_self_int(ratio, 2, None);
        let (q, k) = (l2_normalized(&widen(q)).unwrap(), l2_normalized(&widen(k)).unwrap());
        let (b, t, heads, dk, dv) = (q.size()[0], q.size()[1], v.size()[2], q.size()[3], v.size()[3]);
        let q = q * (dk as f64).powf(-0.5);
        let mut state = Tensor::zeros([b, heads, dk, dv], (Kind::Float, tch::Device::Cpu));
        let mut outputs = vec![];
        for i in 0..t {
            let (qi, ki, vi) = (q.select(1, i), k.select(1, i), v.select(1, i));
            state = &state * decay.select(1, i).exp().unsqueeze(-1).unsqueeze(-1);
            let predicted = (&state * ki.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float);
            let delta = (vi - predicted) * beta.select(1, i).unsqueeze(-1);
            state = &state + ki.unsqueeze(-1) * delta.unsqueeze(-2);
            outputs.push((&state * qi.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float));
        }
        Tensor::stack(&outputs, 1)
    }

    /// Over 150 positions (three chunks, the last partial) with two value heads per key
    /// head, the chunked rule gives the per-position recurrence's outputs and final state;
    /// continuing from a split point's state gives the whole run's outputs.
    #[test]
    fn the_chunked_delta_rule_is_the_recurrence_and_continues_from_its_state() {
        tch::manual_seed(3);
        let (b, t, key_heads, value_heads, dk, dv) = (2, 150, 2, 4, 8, 6);
        let opts = (Kind::Float, tch::Device::Cpu);
        let q = Tensor::randn([b, t, key_heads, dk], opts);
        let k = Tensor::randn([b, t, key_heads, dk], opts);
        let v = Tensor::randn([b, t, value_heads, dv], opts);
        let decay = -Tensor::rand([b, t, value_heads], opts) * 0.3;
        let beta = Tensor::rand([b, t, value_heads], opts);
        let ratio = value_heads / key_heads;
        let (chunked, state) = chunked_delta_rule(&q, &k, &v, &decay, &beta, None, ratio).unwrap();
        let expected = recurrent(&q, &k, &v, &decay, &beta, ratio);
        let gap = (&chunked - &expected).abs().max().double_value(&[]);
        assert!(gap < 1e-4, "chunked against recurrent: {gap}");
        assert!(expected.abs().max().double_value(&[]) > 0.1, "outputs this small compare nothing");
        // The first 70 positions, then the other 80 from their state.
        let first = |x: &Tensor| x.narrow(1, 0, 70);
        let rest = |x: &Tensor| x.narrow(1, 70, t - 70);
        let (head, middle) =
            chunked_delta_rule(&first(&q), &first(&k), &first(&v), &first(&decay), &first(&beta), None, ratio).unwrap();
        let (tail, last) =
            chunked_delta_rule(&rest(&q), &rest(&k), &rest(&v), &rest(&decay), &rest(&beta), Some(&middle), ratio)
                .unwrap();
        let gap = (Tensor::cat(&[head, tail], 1) - &chunked).abs().max().double_value(&[]);
        assert!(gap < 1e-4, "continued from the state: {gap}");
        assert!((last - state).abs().max().double_value(&[]) < 1e-4);
    }
}
