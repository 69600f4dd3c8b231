//! `module_replace`: a registry of replacement pairs — an op of the reference models and a
//! faster implementation of it, with the dtypes it supports. The reference models compute
//! attention, norms, activations and the loss with plain composites (the eager modules); a
//! strategy with `module_replace` swaps in the registered implementations wherever the op's
//! dtype is supported. Built in: `FlashAttention` (libtorch's fused scaled-dot-product
//! attention, flash kernels where the device has them), `FusedLayerNorm`, `FusedRMSNorm`
//! (Strata's kernel on fp32 CPU tensors, libtorch's `rms_norm` elsewhere), and, where
//! libtorch has oneDNN, `OneDnnLinear` (fp32 linear layers on the CPU through oneDNN's
//! inner product, forward and input gradient, instead of libtorch's BLAS; applied only where
//! named, as it trails libtorch's MKL product on x86-64). Strata's own
//! kernels (`strata_ext::kernels`: vectorised on fp32 CPU tensors, NVRTC-compiled on GPU
//! tensors of fp32, bf16 and fp16) serve `VectorGelu` (GELU's tanh form), `FusedSwiGLU`
//! (`silu(gate) * up` in one pass), `FusedRoPE` (rotary positions), and, on a GPU only,
//! `StrataAttention` (causal attention within sliding windows, with soft-capped scores or
//! sinks, which libtorch's fused kernels decline: one kernel each way on a GPU's tensor
//! cores, bf16 and fp16), `FusedCrossEntropy` (the loss from the logits' own dtype, no fp32 logits or
//! log-probabilities written), `FusedAddLayerNorm` and `FusedAddRMSNorm` (a residual sum and
//! the norm that follows it in one pass), and `FusedLinearGrad` (a linear layer under a
//! GPU's autocast whose backward writes the weight's fp32 gradient and the bias's in one
//! cuBLASLt product: `compute::weight_cast::ProductLinear`). Where a kernel does not serve
//! its inputs (device, dtype, shape) the composite runs.
//!
//! Owns the registry and the selection a strategy names. Must not decide where a replacement
//! runs: the layer functions of `model::layers` ask the running unit's policy for one and
//! fall back to the composite.
use crate::error::text;
use crate::{Error, Result};
use std::sync::{Arc, Mutex, OnceLock};
use tch::{Kind, Tensor};

/// Causal attention: queries, keys, values.
pub type AttentionFn = Arc<dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + Send + Sync>;
/// What causal attention beyond libtorch's fused kernels computes besides its queries, keys
/// and values.
pub struct CausalScores<'a> {
    /// The factor the scores are multiplied by.
    pub scale: f64,
    /// Scores pass through `cap · tanh(score / cap)` where given.
    pub softcap: Option<f64>,
    /// Each query sees the `window` positions up to itself where given.
    pub window: Option<i64>,
    /// One logit per head `[H]` joining each softmax, attended to nothing.
    pub sinks: Option<&'a Tensor>,
}
/// Causal attention of queries, keys and values under [`CausalScores`]; `None` where the
/// implementation does not serve the inputs.
pub type MaskedAttentionFn =
    Arc<dyn Fn(&Tensor, &Tensor, &Tensor, &CausalScores<'_>) -> Result<Option<Tensor>> + Send + Sync>;
/// Layer norm: input, weight, bias, eps.
pub type LayerNormFn = Arc<dyn Fn(&Tensor, &Tensor, &Tensor, f64) -> Result<Tensor> + Send + Sync>;
/// RMS norm: input, weight, eps.
pub type RmsNormFn = Arc<dyn Fn(&Tensor, &Tensor, f64) -> Result<Tensor> + Send + Sync>;
/// A linear layer: input, `[out, in]` weight, optional bias.
pub type LinearFn = Arc<dyn Fn(&Tensor, &Tensor, Option<&Tensor>) -> Result<Tensor> + Send + Sync>;
/// The activations and rotary positions may decline inputs they do not serve (`None`): the
/// reference composite runs instead.
pub type GeluFn = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;
/// SwiGLU's gating: gate and up.
pub type SwiGluFn = Arc<dyn Fn(&Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync>;
/// Rotary positions: `x`, then the cos and sin tables.
pub type RotaryFn = Arc<dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync>;
/// Logits, targets and the target that takes no loss.
pub type CrossEntropyFn = Arc<dyn Fn(&Tensor, &Tensor, i64) -> Result<Option<Tensor>> + Send + Sync>;
/// A residual sum and its norm: `(x, r, weight, bias, eps, out)` to `(x + r, norm(x + r))`,
/// the norm in `out` (the weight's dtype where `None`); without `r`, `(x, norm(x))`.
pub type AddNormFn = Arc<
    dyn Fn(&Tensor, Option<&Tensor>, &Tensor, Option<&Tensor>, f64, Option<Kind>) -> Result<Option<(Tensor, Tensor)>>
        + Send
        + Sync,
>;

/// The op a pair replaces, with its implementation.
#[derive(Clone)]
pub enum Replacement {
    /// Causal attention over `[B, H, T, D]` queries, keys, values.
    Attention(AttentionFn),
    /// Causal attention with a window, soft-capped scores or sinks ([`CausalScores`]).
    MaskedAttention(MaskedAttentionFn),
    /// Layer norm over the last dimension: input, weight, bias, eps.
    LayerNorm(LayerNormFn),
    /// RMS norm over the last dimension: input, weight, eps.
    RmsNorm(RmsNormFn),
    /// `x @ w.T + b` with PyTorch's `[out, in]` weight layout.
    Linear(LinearFn),
    /// GELU in its tanh form (`gelu(x, "tanh")`).
    Gelu(GeluFn),
    /// SwiGLU's gating, `silu(gate) * up`.
    SwiGlu(SwiGluFn),
    /// Rotary positions, `x·cos + rotate_half(x)·sin` for `[B, H, T, D]` `x` and `[T, D]`
    /// tables.
    Rotary(RotaryFn),
    /// The mean cross-entropy of `[..., V]` logits against targets, over those other than
    /// the ignored one.
    CrossEntropy(CrossEntropyFn),
    /// `x + r` and its layer norm (weight and bias); also the norm of `x` alone that feeds
    /// a product (`layers::layer_norm_into_product`).
    AddLayerNorm(AddNormFn),
    /// `x + r` and its RMS norm (weight, no bias); also `x`'s alone before a product.
    AddRmsNorm(AddNormFn),
    /// A linear layer of an fp32 master weight computing in the autocast dtype, whose
    /// backward computes the weight's and the bias's gradients in one product, in fp32
    /// (Strata's node: the pair selects it, by the products' dtype).
    LinearGrad,
}

/// A registered replacement: an op, a faster implementation of it, and the dtypes it serves.
#[derive(Clone)]
pub struct ReplacePair {
    /// The name `module_replace` selects the pair by.
    pub name: String,
    /// The dtypes the op may run in for this implementation to be used.
    pub supported_dtypes: Vec<Kind>,
    /// The op it replaces, with its implementation.
    pub with: Replacement,
    /// Whether `module_replace` without a list applies it; otherwise only where named.
    pub by_default: bool,
}

impl ReplacePair {
    /// A pair `module_replace` without a list applies.
    pub fn new(name: &str, supported_dtypes: Vec<Kind>, with: Replacement) -> ReplacePair {
        ReplacePair { name: name.to_string(), supported_dtypes, with, by_default: true }
    }
}

fn registry() -> &'static Mutex<Vec<ReplacePair>> {
    static PAIRS: OnceLock<Mutex<Vec<ReplacePair>>> = OnceLock::new();
    PAIRS.get_or_init(|| {
        let all = vec![Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16];
        let attention: AttentionFn = Arc::new(|q, k, v| {
            Ok(Tensor::f_scaled_dot_product_attention(q, k, v, None::<&Tensor>, 0.0, true, None, false)?)
        });
        let layer_norm: LayerNormFn = Arc::new(|x, w, b, eps| {
            let dim = *x.size().last().unwrap_or(&1);
            Ok(x.f_layer_norm([dim], Some(w), Some(b), eps, true)?)
        });
        // Strata's kernel on fp32 CPU tensors, libtorch's op elsewhere.
        let rms_norm: RmsNormFn = Arc::new(|x, w, eps| match strata_ext::kernels::rms_norm(x, w, eps)? {
            Some(y) => Ok(y),
            None => Ok(x.f_rms_norm([*x.size().last().unwrap_or(&1)], Some(w), eps)?),
        });
        let low = vec![Kind::Float, Kind::Half, Kind::BFloat16];
        let add_norm: AddNormFn =
            Arc::new(|x, r, w, b, eps, out| Ok(strata_ext::kernels::add_norm(x, r, w, b, eps, out)?));
        let mut pairs = vec![
            ReplacePair::new("FlashAttention", all.clone(), Replacement::Attention(attention)),
            ReplacePair::new(
                "StrataAttention",
                vec![Kind::Half, Kind::BFloat16],
                Replacement::MaskedAttention(Arc::new(|q, k, v, scores| {
                    let CausalScores { scale, softcap, window, sinks } = *scores;
                    Ok(strata_ext::kernels::attention(q, k, v, sinks, scale, softcap, window)?)
                })),
            ),
            ReplacePair::new("FusedLayerNorm", all.clone(), Replacement::LayerNorm(layer_norm)),
            ReplacePair::new("FusedRMSNorm", all, Replacement::RmsNorm(rms_norm)),
            ReplacePair::new(
                "VectorGelu",
                low.clone(),
                Replacement::Gelu(Arc::new(|x| Ok(strata_ext::kernels::gelu_tanh(x)?))),
            ),
            ReplacePair::new(
                "FusedSwiGLU",
                low.clone(),
                Replacement::SwiGlu(Arc::new(|gate, up| Ok(strata_ext::kernels::swiglu(gate, up)?))),
            ),
            ReplacePair::new(
                "FusedRoPE",
                low.clone(),
                Replacement::Rotary(Arc::new(|x, cos, sin| Ok(strata_ext::kernels::rotary(x, cos, sin)?))),
            ),
            ReplacePair::new(
                "FusedCrossEntropy",
                low.clone(),
                Replacement::CrossEntropy(Arc::new(|logits, targets, ignore| {
                    Ok(strata_ext::kernels::cross_entropy(logits, targets, ignore)?)
                })),
            ),
            ReplacePair::new("FusedAddLayerNorm", low.clone(), Replacement::AddLayerNorm(add_norm.clone())),
            ReplacePair::new("FusedAddRMSNorm", low, Replacement::AddRmsNorm(add_norm)),
            ReplacePair::new("FusedLinearGrad", vec![Kind::Half, Kind::BFloat16], Replacement::LinearGrad),
        ];
        if strata_ext::onednn::available() {
            pairs.push(ReplacePair {
                // 0.93–0.94× libtorch's MKL product on x86-64 Xeons (`strata bench kernels`):
                // applied only where named, for libtorch builds whose BLAS is weaker.
                by_default: false,
                ..ReplacePair::new("OneDnnLinear", vec![Kind::Float], Replacement::Linear(Arc::new(onednn_linear)))
            });
        }
        Mutex::new(pairs)
    })
}

/// `x @ w.T + b` through oneDNN on the CPU, as one autograd node whose backward computes
/// the input's gradient on oneDNN too; libtorch's linear on other devices.
fn onednn_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let cpu = x.device() == tch::Device::Cpu && w.device() == tch::Device::Cpu;
    if !cpu || w.dim() != 2 || w.kind() != x.kind() {
        return Ok(x.f_linear(w, b)?);
    }
    let function = OneDnnLinear { needs: [x.requires_grad(), w.requires_grad()], saved: None };
    let mut inputs = vec![x, w];
    inputs.extend(b);
    Ok(strata_ext::apply_function(function, &inputs)?.remove(0))
}

struct OneDnnLinear {
    /// Whether the input and the weight take gradients.
    needs: [bool; 2],
    saved: Option<(Tensor, Tensor, bool)>,
}

impl strata_ext::Function for OneDnnLinear {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let (x, w, b) = (&inputs[0], &inputs[1], inputs.get(2));
        let out = strata_ext::onednn::linear(x, w, b).map_err(text)?;
        self.saved = Some((x.shallow_clone(), w.shallow_clone(), b.is_some()));
        Ok(vec![out])
    }

    /// With `g` and `x` as `[rows, ·]` matrices: the input's gradient `g @ w` (an inner
    /// product with `w.T`, a transposed view, as the weight), the weight's `gᵀ @ x` through
    /// libtorch's product, and the bias's the column sums of `g`. oneDNN would first copy
    /// `gᵀ` into a contiguous matrix (its input must be one), which costs more than BLAS's
    /// slower kernel reading it transposed in place (4.3 ms a step less for the 4-layer GPT
    /// of `bench dist` on one core, traced).
    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let (x, w, has_bias) = self.saved.take().ok_or("OneDnnLinear: backward twice")?;
        let (outs, ins) = (w.size()[0], w.size()[1]);
        let g = grads[0].f_contiguous().and_then(|g| g.f_reshape([-1, outs])).map_err(text)?;
        let mut result = vec![Tensor::new(), Tensor::new()];
        if self.needs[0] {
            let grad_x = strata_ext::onednn::linear(&g, &w.f_tr().map_err(text)?, None).map_err(text)?;
            result[0] = grad_x.f_reshape(x.size()).map_err(text)?;
        }
        if self.needs[1] {
            let rows = x.f_reshape([-1, ins]).map_err(text)?;
            result[1] = if g.size()[0] == 0 {
                w.f_zeros_like().map_err(text)?
            } else {
                g.f_tr().and_then(|gt| gt.f_mm(&rows)).map_err(text)?
            };
        }
        if has_bias {
            result.push(g.f_sum_dim_intlist([0].as_slice(), false, g.kind()).map_err(text)?);
        }
        Ok(result)
    }
}

/// Registers (or replaces) a pair under `name`, used where its op runs in one of
/// `supported_dtypes` (ATorch's `register_replace_pair`); `module_replace` without a list
/// applies it.
pub fn register_replace_pair(name: &str, supported_dtypes: &[Kind], with: Replacement) {
    let mut pairs = registry().lock().unwrap_or_else(|e| e.into_inner());
    pairs.retain(|p| p.name != name);
    pairs.push(ReplacePair::new(name, supported_dtypes.to_vec(), with));
}

/// The names of every registered pair.
pub fn pair_names() -> Vec<String> {
    registry().lock().unwrap_or_else(|e| e.into_inner()).iter().map(|p| p.name.clone()).collect()
}

/// The names of the pairs `module_replace` without a list applies.
pub fn default_pair_names() -> Vec<String> {
    Replacements::select(None).map(|r| r.pairs.into_iter().map(|p| p.name).collect()).unwrap_or_default()
}

/// The pairs a unit applies.
#[derive(Clone, Default)]
pub struct Replacements {
    pairs: Vec<ReplacePair>,
}

impl Replacements {
    /// The named pairs (for `None`, every registered one applied by default); an unknown
    /// name is an error.
    pub fn select(names: Option<&[String]>) -> Result<Replacements> {
        let all = registry().lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(names) = names else {
            return Ok(Replacements { pairs: all.into_iter().filter(|p| p.by_default).collect() });
        };
        let mut pairs = Vec::new();
        for n in names {
            match all.iter().find(|p| &p.name == n) {
                Some(p) => pairs.push(p.clone()),
                None => {
                    let known: Vec<&str> = all.iter().map(|p| p.name.as_str()).collect();
                    return Err(Error::Config(format!(
                        "module_replace: no replacement pair {n:?}; registered: {}",
                        known.join(", ")
                    )));
                }
            }
        }
        Ok(Replacements { pairs })
    }

    /// Whether no pair is selected.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    fn find<T>(&self, kind: Kind, pick: impl Fn(&Replacement) -> Option<T>) -> Option<T> {
        self.pairs.iter().filter(|p| p.supported_dtypes.contains(&kind)).find_map(|p| pick(&p.with))
    }

    /// The first selected attention implementation that serves `kind`.
    pub fn attention(&self, kind: Kind) -> Option<AttentionFn> {
        self.find(kind, |r| if let Replacement::Attention(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected implementation of attention beyond the fused kernels that serves
    /// `kind`.
    pub fn masked_attention(&self, kind: Kind) -> Option<MaskedAttentionFn> {
        self.find(kind, |r| if let Replacement::MaskedAttention(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected layer norm implementation that serves `kind`.
    pub fn layer_norm(&self, kind: Kind) -> Option<LayerNormFn> {
        self.find(kind, |r| if let Replacement::LayerNorm(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected RMS norm implementation that serves `kind`.
    pub fn rms_norm(&self, kind: Kind) -> Option<RmsNormFn> {
        self.find(kind, |r| if let Replacement::RmsNorm(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected linear-layer implementation that serves `kind`.
    pub fn linear(&self, kind: Kind) -> Option<LinearFn> {
        self.find(kind, |r| if let Replacement::Linear(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected GELU implementation that serves `kind`.
    pub fn gelu(&self, kind: Kind) -> Option<GeluFn> {
        self.find(kind, |r| if let Replacement::Gelu(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected SwiGLU implementation that serves `kind`.
    pub fn swiglu(&self, kind: Kind) -> Option<SwiGluFn> {
        self.find(kind, |r| if let Replacement::SwiGlu(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected rotary-position implementation that serves `kind`.
    pub fn rotary(&self, kind: Kind) -> Option<RotaryFn> {
        self.find(kind, |r| if let Replacement::Rotary(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected cross-entropy implementation that serves `kind`.
    pub fn cross_entropy(&self, kind: Kind) -> Option<CrossEntropyFn> {
        self.find(kind, |r| if let Replacement::CrossEntropy(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected residual-sum-and-layer-norm implementation that serves `kind`.
    pub fn add_layer_norm(&self, kind: Kind) -> Option<AddNormFn> {
        self.find(kind, |r| if let Replacement::AddLayerNorm(f) = r { Some(f.clone()) } else { None })
    }

    /// The first selected residual-sum-and-RMS-norm implementation that serves `kind`.
    pub fn add_rms_norm(&self, kind: Kind) -> Option<AddNormFn> {
        self.find(kind, |r| if let Replacement::AddRmsNorm(f) = r { Some(f.clone()) } else { None })
    }

    /// Whether products in `kind` compute their weight and bias gradients in one product.
    pub fn linear_grad(&self, kind: Kind) -> bool {
        self.find(kind, |r| matches!(r, Replacement::LinearGrad).then_some(())).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(r: &Replacements) -> Vec<&str> {
        r.pairs.iter().map(|p| p.name.as_str()).collect()
    }

    #[test]
    fn a_pair_off_by_default_is_applied_only_where_named() {
        register_replace_pair("TestOnlyNorm", &[Kind::Double], Replacement::RmsNorm(Arc::new(|x, _, _| Ok(x.copy()))));
        let defaults = Replacements::select(None).unwrap();
        assert!(names(&defaults).contains(&"FusedRMSNorm") && names(&defaults).contains(&"TestOnlyNorm"));
        assert_eq!(default_pair_names(), names(&defaults));
        assert!(!names(&defaults).contains(&"OneDnnLinear"), "{:?}", names(&defaults));
        assert!(defaults.linear(Kind::Float).is_none(), "a default set replaces linear layers");
        if !strata_ext::onednn::available() {
            eprintln!("this libtorch has no oneDNN: OneDnnLinear is not registered");
            return;
        }
        let named = Replacements::select(Some(&["OneDnnLinear".to_string()])).unwrap();
        assert_eq!(names(&named), ["OneDnnLinear"]);
        assert!(named.linear(Kind::Float).is_some());
    }
}
