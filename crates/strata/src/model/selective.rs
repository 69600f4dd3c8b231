//! Mamba's selective state space mixer (Mamba-1: Mamba's, Falcon Mamba's and Jamba's
//! `mamba` layers): per channel of its inner width a state of `state` values, each decaying
//! at its own learned rate `A` by `exp(dt·A)` at every position and taking `dt·x·B`, read
//! with `C`; the step `dt` (one per channel, through a low-rank projection), `B` and `C`
//! come from the input, `A` and the skip `D` are learned. Before it a short causal
//! depthwise convolution over `x` followed by silu; after it the gate `silu(z)`. Falcon
//! Mamba norms the step's low-rank input, `B` and `C` without a weight, Jamba with one.
//!
//! Each state value decays at its own rate, so the scan does not fold into the per-head
//! products Mamba-2's chunks use ([`super::mamba`]): it runs position by position, as
//! `transformers`' torch path does, in fp32.
//!
//! Owns: the layer's configuration, the declaration of its parameters and its forward,
//! with and without a decoding cache (which carries the convolution's last inputs and the
//! state). Must not own the block around it ([`super::llama`] runs the norms, residual sums
//! and feed-forward).
use super::linear::RecurrentState;
use super::mamba::{masked_conv, mixer_projection, WHOLE};
use super::{DecodeCache, Init, ParamId, Params, UnitBuilder, INIT_STD};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// A Mamba-1 mixer's sizes, as Mamba's `config.json` names them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SelectiveScanConfig {
    /// The mixer's inner width (`intermediate_size`, `expand · hidden_size`).
    pub inner: i64,
    /// State values per channel (`state_size`).
    pub state: i64,
    /// Width of the causal convolution (`conv_kernel`).
    pub conv_kernel: i64,
    /// Rank of the step's projection (`time_step_rank`).
    pub time_step_rank: i64,
    /// A bias on the convolution (`use_conv_bias`).
    pub conv_bias: bool,
    /// Biases on the input and output projections (`use_bias`).
    pub proj_bias: bool,
    /// RMS norms of the step's low-rank input, `B` and `C`, where the family has them.
    #[serde(default)]
    pub inner_norms: Option<InnerNorms>,
}

/// The RMS norms a Mamba-1 mixer applies to its step's low-rank input, `B` and `C`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct InnerNorms {
    /// Their epsilon (Falcon Mamba's `mixer_rms_eps`, Jamba's `rms_norm_eps`).
    pub eps: f64,
    /// Each with a learned weight (Jamba's `dt_layernorm`, `b_layernorm`, `c_layernorm`);
    /// without one, Falcon Mamba's.
    pub weighted: bool,
}

impl SelectiveScanConfig {
    /// Fails with the first size that is not positive.
    pub fn validate(&self) -> Result<()> {
        super::positive(&[
            ("intermediate_size", self.inner),
            ("state_size", self.state),
            ("conv_kernel", self.conv_kernel),
            ("time_step_rank", self.time_step_rank),
        ])?;
        match self.inner_norms {
            Some(n) if !(n.eps > 0.0 && n.eps.is_finite()) => {
                Err(Error::Config(format!("the mixer's norm epsilon must be positive, got {}", n.eps)))
            }
            _ => Ok(()),
        }
    }

    /// Values a token keeps for the backward beyond the block's residual stream: the
    /// projection, the convolution's input and output, the low-rank projection and step, and
    /// per channel its state and the state's decay and input at the position (fp32), the
    /// skip, the gate and their product.
    pub(crate) fn kept_per_token(&self, dim: i64) -> i64 {
        let (i, n) = (self.inner, self.state);
        4 * dim + 2 * i + 2 * i + (self.time_step_rank + 2 * n) + 2 * i + 3 * i * n + 4 * i
    }
}

/// A block's Mamba-1 mixer: its parameters and sizes.
pub(crate) struct Mamba1 {
    in_proj: (ParamId, Option<ParamId>),
    conv: (ParamId, Option<ParamId>),
    x_proj: ParamId,
    dt_proj: (ParamId, ParamId),
    a_log: ParamId,
    skip: ParamId,
    /// The weights of the step's, `B`'s and `C`'s norms, where they are weighted.
    norm_weights: Option<[ParamId; 3]>,
    out_proj: (ParamId, Option<ParamId>),
    config: SelectiveScanConfig,
}

impl Mamba1 {
    /// Declares layer `name`'s mixer over hidden states `dim` wide, named as Jamba's folders
    /// name it (`{name}.mamba.*`).
    pub(crate) fn declare(u: &mut UnitBuilder<'_>, name: &str, config: &SelectiveScanConfig, dim: i64) -> Mamba1 {
        let (normal, whole) = (Init::Normal { std: INIT_STD }, WHOLE);
        let at = |what: &str| format!("{name}.mamba.{what}");
        let c = config;
        let mut linear = |what: &str, shape: [i64; 2], bias: bool| mixer_projection(u, &at(what), shape, bias);
        let in_proj = linear("in_proj", [2 * c.inner, dim], c.proj_bias);
        let out_proj = linear("out_proj", [dim, c.inner], c.proj_bias);
        let (x_proj, _) = linear("x_proj", [c.time_step_rank + 2 * c.state, c.inner], false);
        let (dt_weight, _) = linear("dt_proj", [c.inner, c.time_step_rank], false);
        // softplus(-2.25) ≈ 0.1: a step within Mamba's initial range.
        let dt_bias = u.param(at("dt_proj.bias"), &[c.inner], Init::Constant { value: -2.25 }, whole);
        let conv = u.param(at("conv1d.weight"), &[c.inner, 1, c.conv_kernel], normal, whole);
        let conv_bias = c.conv_bias.then(|| u.param(at("conv1d.bias"), &[c.inner], Init::Zeros, whole));
        let norm_weights = c.inner_norms.filter(|n| n.weighted).map(|_| {
            let mut weight =
                |what: &str, width: i64| u.norm(at(&format!("{what}.weight")), &[width], Init::Ones, whole);
            [weight("dt_layernorm", c.time_step_rank), weight("b_layernorm", c.state), weight("c_layernorm", c.state)]
        });
        Mamba1 {
            in_proj,
            conv: (conv, conv_bias),
            x_proj,
            dt_proj: (dt_weight, dt_bias),
            // A = -exp(A_log) = -1 for every state value to start.
            a_log: u.param(at("A_log"), &[c.inner, c.state], Init::Zeros, whole),
            skip: u.param(at("D"), &[c.inner], Init::Ones, whole),
            norm_weights,
            out_proj,
            config: config.clone(),
        }
    }

    /// The mixer over the normed hidden states `h` `[B, T, D]`; with a cache, continuing
    /// from (and leaving) its convolution inputs and state. `keep` `[B, T]` (1 for a token,
    /// 0 for padding) zeroes padding's convolution inputs and outputs, which the biases of
    /// the projection and the convolution would otherwise make and write into the state.
    pub(crate) fn forward(
        &self,
        p: &Params<'_>,
        h: &Tensor,
        cache: Option<&mut DecodeCache>,
        keep: Option<&Tensor>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let projected = p.linear(h, self.in_proj.0, self.in_proj.1)?;
        let halves = projected.f_split(c.inner, -1)?;
        let [x, z] = <[Tensor; 2]>::try_from(halves).map_err(|_| Error::Model("in_proj split".into()))?;
        let (x, kept, initial) = masked_conv(p, self.conv, x, cache.as_deref(), keep)?;
        let parts = p.linear(&x, self.x_proj, None)?.f_split_with_sizes([c.time_step_rank, c.state, c.state], -1)?;
        let [low_rank, input_map, output_map] =
            <[Tensor; 3]>::try_from(parts).map_err(|_| Error::Model("x_proj split".into()))?;
        let [low_rank, input_map, output_map] = match (c.inner_norms, self.norm_weights) {
            (None, _) => [low_rank, input_map, output_map],
            (Some(n), weights) => {
                let mut normed = [low_rank, input_map, output_map].into_iter().enumerate().map(|(k, t)| {
                    let kind = t.kind();
                    let unit = super::layers::rms_normalized(&t.f_to_kind(Kind::Float)?, n.eps)?.f_to_kind(kind)?;
                    Ok(match weights {
                        Some(w) => unit.f_mul(&p[w[k]])?,
                        None => unit,
                    })
                });
                let mut next = || normed.next().unwrap_or_else(|| Err(Error::Model("inner norms".into())));
                [next()?, next()?, next()?]
            }
        };
        // The step per channel, in fp32: softplus of the projection plus its bias.
        let dt = p
            .linear(&low_rank, self.dt_proj.0, None)?
            .f_to_kind(Kind::Float)?
            .f_add(&p[self.dt_proj.1].f_to_kind(Kind::Float)?)?
            .f_softplus()?;
        let decay_rate = p[self.a_log].f_to_kind(Kind::Float)?.f_exp()?.f_neg()?;
        let (y, state) = scan(&x, &dt, &decay_rate, &input_map, &output_map, initial.as_ref())?;
        if let Some(cache) = cache {
            cache.keep_recurrent(RecurrentState { conv: kept.f_detach()?, state: Some(state.f_detach()?) });
        }
        let skip = p[self.skip].f_to_kind(Kind::Float)?;
        let y = y.f_add(&x.f_to_kind(Kind::Float)?.f_mul(&skip)?)?.f_mul(&z.f_to_kind(Kind::Float)?.f_silu()?)?;
        p.linear(&y.f_to_kind(h.kind())?, self.out_proj.0, self.out_proj.1)
    }
}

/// The selective scan over `x` and steps `dt` `[B, T, I]`, decay rates `A` `[I, N]`
/// (negative) and input and output maps `B`, `C` `[B, T, N]`, from `initial` (`[B, I, N]`,
/// else zeros), position by position in fp32: the outputs `[B, T, I]` without the skip, and
/// the final state.
fn scan(
    x: &Tensor,
    dt: &Tensor,
    decay_rate: &Tensor,
    input_map: &Tensor,
    output_map: &Tensor,
    initial: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (b, t, inner) = x.size3()?;
    let states = decay_rate.size()[1];
    let float = |t: &Tensor| t.f_to_kind(Kind::Float);
    let (input_map, output_map) = (float(input_map)?, float(output_map)?);
    // Each position's decay [B, T, I, N] and what it writes, dt·x·B.
    let decay = dt.f_unsqueeze(-1)?.f_mul(decay_rate)?.f_exp()?;
    let written = dt.f_mul(&float(x)?)?.f_unsqueeze(-1)?.f_mul(&input_map.f_unsqueeze(2)?)?;
    let mut state = match initial {
        Some(s) => float(s)?,
        None => Tensor::f_zeros([b, inner, states], (Kind::Float, x.device()))?,
    };
    let mut outputs = Vec::with_capacity(t as usize);
    for i in 0..t {
        state = state.f_mul(&decay.f_select(1, i)?)?.f_add(&written.f_select(1, i)?)?;
        outputs.push(state.f_matmul(&output_map.f_select(1, i)?.f_unsqueeze(-1)?)?.f_squeeze_dim(-1)?);
    }
    Ok((Tensor::f_stack(&outputs, 1)?, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scanning a row whole gives what scanning its first part and then the rest from the
    /// first part's state gives; a state value's input decays by `exp(dt·A)` per position.
    #[test]
    fn the_scan_continues_from_its_state_and_decays_each_value_at_its_rate() {
        tch::manual_seed(3);
        let (b, t, inner, states) = (2, 9, 3, 4);
        let opts = (Kind::Float, tch::Device::Cpu);
        let x = Tensor::randn([b, t, inner], opts);
        let dt = Tensor::rand([b, t, inner], opts) * 0.5;
        let rate = -Tensor::rand([inner, states], opts) - 0.1;
        let (bm, cm) = (Tensor::randn([b, t, states], opts), Tensor::randn([b, t, states], opts));
        let (whole, last) = scan(&x, &dt, &rate, &bm, &cm, None).unwrap();
        let first = |v: &Tensor| v.narrow(1, 0, 4);
        let rest = |v: &Tensor| v.narrow(1, 4, t - 4);
        let (head, middle) = scan(&first(&x), &first(&dt), &rate, &first(&bm), &first(&cm), None).unwrap();
        let (tail, end) = scan(&rest(&x), &rest(&dt), &rate, &rest(&bm), &rest(&cm), Some(&middle)).unwrap();
        let gap = (Tensor::cat(&[head, tail], 1) - &whole).abs().max().double_value(&[]);
        assert!(gap < 1e-5, "continued from the state: {gap}");
        assert!((end - &last).abs().max().double_value(&[]) < 1e-5);
        // One input at the first position, then nothing: after two more positions each
        // state value holds dt₀·x₀·B₀ decayed by exp((dt₁ + dt₂)·A).
        let pulse = Tensor::zeros([1, 3, inner], opts);
        let _ = pulse.get(0).get(0).fill_(1.0);
        let steps = Tensor::full([1, 3, inner], 0.2, opts);
        let ones = Tensor::ones([1, 3, states], opts);
        let (_, state) = scan(&pulse, &steps, &rate, &ones, &ones, None).unwrap();
        let expected = (&rate * 0.4).exp() * 0.2;
        assert!((state.get(0) - expected).abs().max().double_value(&[]) < 1e-6);
    }
}
