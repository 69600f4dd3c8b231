//! Mamba-2's selective state space mixer (Granite 4's `mamba` layers): per head a state
//! `[head_dim, state]` that each position decays by `exp(dt·A)` and writes `dt·x ⊗ B`
//! into, read with `C`; `dt`, `B` and `C` come from the input, `A` and the skip `D` are
//! learned per head. Before it a short causal depthwise convolution (with a bias) over `x`,
//! `B` and `C`, followed by silu; after it the gate `silu(z)` and an RMS norm over groups of
//! the heads' outputs, in the order [`GatedNorm`] gives (or the gate alone). Training computes the scan in chunks, as
//! `transformers`' own torch path does: within a chunk as a masked product, between chunks
//! through the state.
//!
//! Owns: the layer's configuration, the declaration of its parameters and its forward,
//! with and without a decoding cache (which carries the convolution's last inputs and the
//! state). Must not own the block around it ([`super::llama`] runs the norms, residual sums
//! and feed-forward).
use super::linear::{causal_conv, RecurrentState};
use super::{DecodeCache, Init, ParamId, Params, TpRole, UnitBuilder, INIT_STD};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// A Mamba-2 mixer's sizes, as Granite 4's `config.json` names them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateSpaceConfig {
    /// Heads (`mamba_n_heads`).
    pub heads: i64,
    /// Width of a head (`mamba_d_head`); the heads together are the mixer's inner width.
    pub head_dim: i64,
    /// Groups sharing one `B` and `C` (`mamba_n_groups`), a divisor of the heads.
    pub groups: i64,
    /// Width of each head's state per channel (`mamba_d_state`).
    pub state: i64,
    /// Width of the causal convolution (`mamba_d_conv`).
    pub conv_kernel: i64,
    /// Positions the scan computes together (`mamba_chunk_size`).
    pub chunk: i64,
    /// A bias on the convolution (`mamba_conv_bias`).
    pub conv_bias: bool,
    /// Biases on the input and output projections (`mamba_proj_bias`).
    pub proj_bias: bool,
    /// The step `dt` clamped from below (`time_step_limit`'s first value).
    #[serde(default)]
    pub time_step_min: f64,
    /// The step `dt` clamped from above, where it is (`time_step_limit`'s second value).
    #[serde(default)]
    pub time_step_max: Option<f64>,
    /// How the output meets its gate and its norm.
    #[serde(default)]
    pub gated_norm: GatedNorm,
}

/// How a Mamba-2 mixer's output meets its gate `silu(z)` and its RMS norm (over each group
/// of heads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GatedNorm {
    /// Gated, then normed (Granite 4's, Bamba's and Nemotron-H's mixers).
    #[default]
    GateThenNorm,
    /// Normed, then gated (Falcon-H1's with `mamba_norm_before_gate`).
    NormThenGate,
    /// Gated alone: the mixer has no norm (Falcon-H1's without `mamba_rms_norm`).
    GateAlone,
}

impl StateSpaceConfig {
    /// Fails with the first size that is not positive or groups that do not divide the heads.
    pub fn validate(&self) -> Result<()> {
        super::positive(&[
            ("mamba_n_heads", self.heads),
            ("mamba_d_head", self.head_dim),
            ("mamba_n_groups", self.groups),
            ("mamba_d_state", self.state),
            ("mamba_d_conv", self.conv_kernel),
            ("mamba_chunk_size", self.chunk),
        ])?;
        if self.time_step_max.is_some_and(|max| max < self.time_step_min) {
            return Err(Error::Config(format!(
                "time_step_limit's bounds {} and {:?} are in the wrong order",
                self.time_step_min, self.time_step_max
            )));
        }
        if self.heads % self.groups != 0 {
            return Err(Error::Config(format!(
                "mamba_n_groups {} must divide mamba_n_heads {}",
                self.groups, self.heads
            )));
        }
        Ok(())
    }

    /// The heads' outputs together (`mamba_expand · hidden_size`).
    pub fn inner(&self) -> i64 {
        self.heads * self.head_dim
    }

    /// Channels of the convolution: `x`, then every group's `B`, then every group's `C`.
    fn conv_channels(&self) -> i64 {
        self.inner() + 2 * self.groups * self.state
    }

    /// Values a token keeps for the backward beyond the block's residual stream: the
    /// projection, the convolution's input and output, the scan's inputs in fp32, its
    /// chunk's square matrices (a chunk's entries per head) and outputs, the gate and norm.
    pub(crate) fn kept_per_token(&self, dim: i64) -> i64 {
        let projected = self.inner() + self.conv_channels() + self.heads;
        let heads_widened = 2 * self.heads * self.state;
        4 * dim
            + projected
            + 2 * self.conv_channels()
            + 2 * heads_widened
            + 3 * self.chunk * self.heads
            + 5 * self.inner()
    }
}

/// A block's Mamba-2 mixer: its parameters and sizes.
pub(crate) struct Mamba2 {
    in_proj: (ParamId, Option<ParamId>),
    conv: (ParamId, Option<ParamId>),
    dt_bias: ParamId,
    a_log: ParamId,
    skip: ParamId,
    /// `None` where the gate alone meets the output ([`GatedNorm::GateAlone`]).
    norm: Option<ParamId>,
    out_proj: (ParamId, Option<ParamId>),
    config: StateSpaceConfig,
    norm_eps: f64,
    /// Multipliers of the input projection's parts `z`, `x`, `B`, `C` and `dt`, where the
    /// family scales them (Falcon-H1's `ssm_multipliers`).
    projection_scales: Option<[f64; 5]>,
}

impl Mamba2 {
    /// Declares layer `name`'s mixer over hidden states `dim` wide, named as Granite 4's
    /// folders name it (`{name}.mamba.*`), its input projection's parts scaled by
    /// `projection_scales` where given.
    pub(crate) fn declare(
        u: &mut UnitBuilder<'_>,
        name: &str,
        config: &StateSpaceConfig,
        (dim, norm_eps): (i64, f64),
        projection_scales: Option<[f64; 5]>,
    ) -> Mamba2 {
        let (normal, whole) = (Init::Normal { std: INIT_STD }, WHOLE);
        let at = |what: &str| format!("{name}.mamba.{what}");
        let c = config;
        let mut linear = |what: &str, shape: [i64; 2], bias: bool| mixer_projection(u, &at(what), shape, bias);
        let in_proj = linear("in_proj", [c.inner() + c.conv_channels() + c.heads, dim], c.proj_bias);
        let out_proj = linear("out_proj", [dim, c.inner()], c.proj_bias);
        let conv = u.param(at("conv1d.weight"), &[c.conv_channels(), 1, c.conv_kernel], normal, whole);
        let conv_bias = c.conv_bias.then(|| u.param(at("conv1d.bias"), &[c.conv_channels()], Init::Zeros, whole));
        Mamba2 {
            in_proj,
            conv: (conv, conv_bias),
            dt_bias: u.param(at("dt_bias"), &[c.heads], Init::Ones, whole),
            // A = -exp(A_log) = -1 on every head to start.
            a_log: u.param(at("A_log"), &[c.heads], Init::Zeros, whole),
            skip: u.param(at("D"), &[c.heads], Init::Ones, whole),
            norm: (c.gated_norm != GatedNorm::GateAlone)
                .then(|| u.norm(at("norm.weight"), &[c.inner()], Init::Ones, whole)),
            out_proj,
            config: config.clone(),
            norm_eps,
            projection_scales,
        }
    }

    /// The mixer over the normed hidden states `h` `[B, T, D]`; with a cache, continuing
    /// from (and leaving) its convolution inputs and state. `keep` `[B, T]` (1 for a token,
    /// 0 for padding) zeroes padding's convolution inputs and outputs, which the biases of
    /// the projection and the convolution would otherwise make and write into the state, so
    /// that a padded row reads as it does alone.
    pub(crate) fn forward(
        &self,
        p: &Params<'_>,
        h: &Tensor,
        cache: Option<&mut DecodeCache>,
        keep: Option<&Tensor>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let (b, t) = (h.size()[0], h.size()[1]);
        let mut projected = p.linear(h, self.in_proj.0, self.in_proj.1)?;
        if let Some(scales) = self.projection_scales {
            let group_width = c.groups * c.state;
            let widths = [c.inner(), c.inner(), group_width, group_width, c.heads];
            let opts = (projected.kind(), projected.device());
            let parts = widths
                .iter()
                .zip(scales)
                .map(|(&w, s)| Tensor::f_full([w], s, opts))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            projected = projected.f_mul(&Tensor::f_cat(&parts, 0)?)?;
        }
        let parts = projected.f_split_with_sizes([c.inner(), c.conv_channels(), c.heads], -1)?;
        let [z, mixed, dt] = <[Tensor; 3]>::try_from(parts).map_err(|_| Error::Model("in_proj split".into()))?;
        let (convolved, kept, initial) = masked_conv(p, self.conv, mixed, cache.as_deref(), keep)?;
        let group_width = c.groups * c.state;
        let x = convolved.f_narrow(-1, 0, c.inner())?.f_view([b, t, c.heads, c.head_dim])?;
        let widened = |start: i64| -> Result<Tensor> {
            let part = convolved.f_narrow(-1, start, group_width)?.f_view([b, t, c.groups, c.state])?;
            Ok(part.f_repeat_interleave_self_int(c.heads / c.groups, 2, None)?)
        };
        let (input_map, output_map) = (widened(c.inner())?, widened(c.inner() + group_width)?);
        let dt = dt.f_to_kind(Kind::Float)?.f_add(&p[self.dt_bias].f_to_kind(Kind::Float)?)?.f_softplus()?;
        let dt = match c.time_step_max {
            Some(max) => dt.f_clamp(c.time_step_min, max)?,
            None => dt.f_clamp_min(c.time_step_min)?,
        };
        let decay_rate = p[self.a_log].f_to_kind(Kind::Float)?.f_exp()?.f_neg()?;
        let scan = Scan { x: &x, dt: &dt, decay_rate: &decay_rate, input_map: &input_map, output_map: &output_map };
        // Chunks no longer than the row: a decoded token is a chunk of one.
        let (y, state) = scan.chunked(c.chunk.min(t.max(1)), initial.as_ref())?;
        if let Some(cache) = cache {
            cache.keep_recurrent(RecurrentState { conv: kept.f_detach()?, state: Some(state.f_detach()?) });
        }
        // The skip, then the gate and an RMS norm over each group of heads, all in fp32.
        let skip = p[self.skip].f_to_kind(Kind::Float)?.f_unsqueeze(-1)?;
        let y = y.f_add(&x.f_to_kind(Kind::Float)?.f_mul(&skip)?)?.f_reshape([b, t, -1])?;
        let gate = z.f_to_kind(Kind::Float)?.f_silu()?;
        let norm = |y: &Tensor, weight: ParamId| -> Result<Tensor> {
            Ok(super::layers::rms_normalized(&y.f_view([b, t, c.groups, -1])?, self.norm_eps)?
                .f_reshape([b, t, -1])?
                .f_mul(&p[weight].f_to_kind(Kind::Float)?)?)
        };
        let out = match (c.gated_norm, self.norm) {
            (GatedNorm::NormThenGate, Some(weight)) => norm(&y, weight)?.f_mul(&gate)?,
            (_, Some(weight)) => norm(&y.f_mul(&gate)?, weight)?,
            (_, None) => y.f_mul(&gate)?,
        };
        p.linear(&out.f_to_kind(h.kind())?, self.out_proj.0, self.out_proj.1)
    }
}

/// How a Mamba mixer's parameters are held: whole on every rank (tensor parallelism is
/// refused for these layers, `check_tensor_parallel`).
pub(crate) const WHOLE: TpRole = TpRole::SequenceReplicated;

/// Declares a Mamba mixer's projection `module` (`{module}.weight`, and `{module}.bias`
/// where `bias`), `shape` `[out, in]`, held whole.
pub(crate) fn mixer_projection(
    u: &mut UnitBuilder<'_>,
    module: &str,
    shape: [i64; 2],
    bias: bool,
) -> (ParamId, Option<ParamId>) {
    let weight = u.linear(format!("{module}.weight"), &shape, Init::Normal { std: INIT_STD }, WHOLE);
    (weight, bias.then(|| u.param(format!("{module}.bias"), &shape[..1], Init::Zeros, WHOLE)))
}

/// The convolution before a Mamba mixer's scan over `inputs` `[B, T, C]`: padding's inputs
/// zeroed where `keep` `[B, T]` is 0, the causal convolution continuing from a cache's last
/// inputs, silu, padding's outputs zeroed again (the biases would otherwise write them into
/// the state). The outputs, the last inputs to keep, and the cache's state where it holds one.
pub(crate) fn masked_conv(
    p: &Params<'_>,
    (weight, bias): (ParamId, Option<ParamId>),
    inputs: Tensor,
    cache: Option<&DecodeCache>,
    keep: Option<&Tensor>,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let keep = keep.map(|k| k.f_unsqueeze(-1)?.f_to_kind(inputs.kind())).transpose()?;
    let masked = |x: Tensor| -> Result<Tensor> {
        match &keep {
            Some(keep) => Ok(x.f_mul(keep)?),
            None => Ok(x),
        }
    };
    let recurrent = cache.and_then(|c| c.recurrent());
    let initial = recurrent.and_then(|r| r.state.as_ref()).map(Tensor::shallow_clone);
    let bias = bias.map(|b| &p[b]);
    let (convolved, kept) = causal_conv(&masked(inputs)?, &p[weight], bias, recurrent.map(|r| &r.conv))?;
    Ok((masked(convolved.f_silu()?)?, kept, initial))
}

/// The selective scan's inputs: `x` `[B, T, H, P]`, steps `dt` `[B, T, H]` (fp32), each
/// head's decay rate `A` `[H]` (negative), and the input and output maps `B` and `C`
/// `[B, T, H, N]` (each head's group's).
struct Scan<'a> {
    x: &'a Tensor,
    dt: &'a Tensor,
    decay_rate: &'a Tensor,
    input_map: &'a Tensor,
    output_map: &'a Tensor,
}

impl Scan<'_> {
    /// The scan from `initial` (`[B, H, P, N]`, else zeros) in chunks of `chunk`
    /// positions: the outputs `[B, T, H, P]` and the final state, both fp32, without the skip.
    fn chunked(&self, chunk: i64, initial: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let (b, t, heads, width) = self.x.size4()?;
        let states = self.input_map.size()[3];
        let pad = (chunk - t % chunk) % chunk;
        let chunks = (t + pad) / chunk;
        // Each tensor as [B, H, chunks, L, ...] in fp32, padded with zeros.
        let by_chunk = |x: &Tensor| -> Result<Tensor> {
            let x = x.f_to_kind(Kind::Float)?;
            let trailing = x.dim() - 3;
            let mut spec = vec![0; 2 * trailing];
            spec.extend([0, 0, 0, pad]);
            let x = x.f_constant_pad_nd(spec)?.f_transpose(1, 2)?;
            let mut shape = vec![b, heads, chunks, chunk];
            shape.extend(&x.size()[3..]);
            Ok(x.f_reshape(shape)?)
        };
        let dt = self.dt.f_unsqueeze(-1)?;
        let x = by_chunk(&self.x.f_to_kind(Kind::Float)?.f_mul(&dt)?)?;
        let (input_map, output_map) = (by_chunk(self.input_map)?, by_chunk(self.output_map)?);
        // The log decay of each position, [B, H, chunks, L], and its running sum in the chunk.
        let log_decay = by_chunk(&self.dt.f_mul(self.decay_rate)?.f_unsqueeze(-1)?)?.f_squeeze_dim(-1)?;
        let cumulative = log_decay.f_cumsum(-1, Kind::Float)?;
        // Between positions s <= l of a chunk, the sum of the log decays after s up to l, as
        // a cumulative sum of the masked steps (not a difference of running sums, which
        // loses precision where they grow large); -inf above the diagonal.
        let steps = log_decay.f_unsqueeze(-1)?.f_expand([b, heads, chunks, chunk, chunk], false)?;
        let below = Tensor::f_ones([chunk, chunk], (Kind::Bool, x.device()))?.f_tril(-1)?;
        let between = steps.f_masked_fill(&below.f_logical_not()?, 0.0)?.f_cumsum(-2, Kind::Float)?;
        let on_or_below = Tensor::f_ones([chunk, chunk], (Kind::Bool, x.device()))?.f_tril(0)?;
        let decays = between.f_masked_fill(&on_or_below.f_logical_not()?, f64::NEG_INFINITY)?.f_exp()?;
        // Within a chunk: scores C_l·B_s, decayed from s to l, applied to the steps' inputs.
        let within = output_map.f_matmul(&input_map.f_transpose(-1, -2)?)?.f_mul(&decays)?.f_matmul(&x)?;
        // What each chunk writes into the state, decayed to its end: [B, H, chunks, P, N].
        let last = cumulative.f_narrow(-1, chunk - 1, 1)?;
        let to_end = last.f_sub(&cumulative)?.f_exp()?.f_unsqueeze(-1)?;
        let written = x.f_transpose(-1, -2)?.f_matmul(&input_map.f_mul(&to_end)?)?;
        let from_start = cumulative.f_exp()?.f_unsqueeze(-1)?;
        let chunk_decay = last.f_exp()?.f_unsqueeze(-1)?;
        let mut state = match initial {
            Some(s) => s.f_to_kind(Kind::Float)?,
            None => Tensor::f_zeros([b, heads, width, states], (Kind::Float, x.device()))?,
        };
        let mut outputs = Vec::with_capacity(chunks as usize);
        for i in 0..chunks {
            let pick = |x: &Tensor| x.f_select(2, i);
            // The state at the chunk's start, read by each position's C, decayed to it.
            let across = pick(&output_map)?.f_matmul(&state.f_transpose(-1, -2)?)?.f_mul(&pick(&from_start)?)?;
            outputs.push(pick(&within)?.f_add(&across)?);
            state = state.f_mul(&pick(&chunk_decay)?)?.f_add(&pick(&written)?)?;
        }
        let out = Tensor::f_stack(&outputs, 2)?.f_reshape([b, heads, -1, width])?.f_narrow(2, 0, t)?;
        Ok((out.f_transpose(1, 2)?.f_contiguous()?, state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scan position by position: decay each head's state by `exp(dt·A)`, add
    /// `dt·x ⊗ B`, read it with `C`.
    fn recurrent(scan: &Scan<'_>, initial: Option<&Tensor>) -> (Tensor, Tensor) {
        let (b, t, heads, width) = scan.x.size4().unwrap();
        let states = scan.input_map.size()[3];
        let mut state = match initial {
            Some(s) => s.shallow_clone(),
            None => Tensor::zeros([b, heads, width, states], (Kind::Float, tch::Device::Cpu)),
        };
        let mut outputs = vec![];
        for i in 0..t {
            let dt = scan.dt.select(1, i);
            let decay = (&dt * scan.decay_rate).exp().unsqueeze(-1).unsqueeze(-1);
            let written =
                (scan.x.select(1, i) * dt.unsqueeze(-1)).unsqueeze(-1) * scan.input_map.select(1, i).unsqueeze(-2);
            state = &state * decay + written;
            outputs.push(state.matmul(&scan.output_map.select(1, i).unsqueeze(-1)).squeeze_dim(-1));
        }
        (Tensor::stack(&outputs, 1), state)
    }

    /// Over 150 positions (three chunks of 64, the last partial), the chunked scan gives the
    /// per-position recurrence's outputs and final state; continuing from a split point's
    /// state gives the whole run's outputs.
    #[test]
    fn the_chunked_scan_is_the_recurrence_and_continues_from_its_state() {
        tch::manual_seed(5);
        let (b, t, heads, width, states) = (2, 150, 4, 6, 8);
        let opts = (Kind::Float, tch::Device::Cpu);
        let x = Tensor::randn([b, t, heads, width], opts);
        let dt = Tensor::rand([b, t, heads], opts) * 0.5;
        let decay_rate = -Tensor::arange_start(1, heads + 1, opts);
        let input_map = Tensor::randn([b, t, heads, states], opts);
        let output_map = Tensor::randn([b, t, heads, states], opts);
        let scan = Scan { x: &x, dt: &dt, decay_rate: &decay_rate, input_map: &input_map, output_map: &output_map };
        let (chunked, state) = scan.chunked(64, None).unwrap();
        let (expected, expected_state) = recurrent(&scan, None);
        let gap = (&chunked - &expected).abs().max().double_value(&[]);
        assert!(gap < 1e-4, "chunked against recurrent: {gap}");
        assert!(expected.abs().max().double_value(&[]) > 0.1, "outputs this small compare nothing");
        assert!((&state - &expected_state).abs().max().double_value(&[]) < 1e-4);
        // The first 70 positions, then the other 80 from their state, in chunks of 32.
        let (first, rest) = (|x: &Tensor| x.narrow(1, 0, 70), |x: &Tensor| x.narrow(1, 70, t - 70));
        let part = |f: &dyn Fn(&Tensor) -> Tensor, initial: Option<&Tensor>| {
            let (x, dt, bm, cm) = (f(&x), f(&dt), f(&input_map), f(&output_map));
            let scan = Scan { x: &x, dt: &dt, decay_rate: &decay_rate, input_map: &bm, output_map: &cm };
            scan.chunked(32, initial).unwrap()
        };
        let (head, middle) = part(&first, None);
        let (tail, last) = part(&rest, Some(&middle));
        let gap = (Tensor::cat(&[head, tail], 1) - &chunked).abs().max().double_value(&[]);
        assert!(gap < 1e-4, "continued from the state: {gap}");
        assert!((last - state).abs().max().double_value(&[]) < 1e-4);
    }
}
