//! Functional building blocks shared by the reference models. Each takes its parameters
//! as tensors, so units stay plain data and the engine decides where weights live.
//!
//! Attention, norms and activations are the plain composites and kernels of eager PyTorch
//! modules; the running unit's compute policy (`crate::compute`) may replace them with
//! faster implementations (`module_replace`), compute linear layers in fp8, or cast to a lower precision
//! (`amp_native`: matrix products and attention in it, norms, softmax and the loss in fp32).
//!
//! Owns the layer functions. Must not hold parameters or call a process group: tensors come
//! in as arguments, and a split layer communicates only through the [`TensorParallel`]
//! context it is handed.
use super::dropout::Dropping;
use super::tensor::{vocab_rows, TensorParallel};
use crate::compute::{self, cast};
use crate::Result;
use tch::{Kind, Tensor};

pub(crate) fn is_low(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16)
}

/// Norms compute in fp32 under autocast.
fn norm_input(x: &Tensor) -> Result<Tensor> {
    cast(x, compute::autocast_on().then_some(Kind::Float).filter(|_| x.kind() != Kind::Double))
}

/// `x @ w.T + b` with PyTorch's `[out, in]` weight layout.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if let Some(out) = compute::fp8_linear(x, w, b) {
        return out;
    }
    if let Some(out) = compute::deferred::linear(x, w, b) {
        return out;
    }
    // A replaced linear computes in its input's dtype: none serves a product that autocast
    // (the layers' own or libtorch's) puts in a lower one.
    let product = compute::product_kind();
    if product.is_none() {
        if let Some(replaced) = compute::replaced(|r| r.linear(x.kind())) {
            return replaced(x, w, b);
        }
    }
    let kind = compute::autocast_kind();
    let b = b.map(|b| cast(b, kind)).transpose()?;
    // Under libtorch's autocast only the weight is cast here (its gradient may go straight
    // into its buffer); autocast casts the rest.
    let w = match product {
        Some(product) => {
            if let Some(out) = compute::product_linear(x, w, b.as_ref(), product) {
                return out;
            }
            compute::weight_for_product(w, product)?
        }
        None => w.shallow_clone(),
    };
    Ok(cast(x, kind)?.f_linear(&w, b.as_ref())?)
}

/// The rows of `x` through one linear layer per group: `[out, in]` weight `weights[j]` applied
/// to the `counts[j]` rows of group `j`, groups in order, in one grouped product (libtorch's
/// `_grouped_mm`) on a GPU computing in bf16. `None` where that does not apply (another
/// device or dtype, a weight computed in fp8 or whose gradient is deferred): the caller then
/// runs a product per group.
pub fn grouped_linear(x: &Tensor, weights: &[&Tensor], counts: &[i64]) -> Result<Option<Tensor>> {
    let kind = compute::product_kind().unwrap_or(x.kind());
    let same_shape = |w: &&Tensor| w.dim() == 2 && w.size() == weights[0].size();
    let applies = x.device().is_cuda()
        && kind == Kind::BFloat16
        && x.dim() == 2
        && !weights.is_empty()
        && weights.len() == counts.len()
        && !compute::deferred::active()
        && weights.iter().all(|w| same_shape(w) && !compute::computes_in_fp8(w));
    if !applies {
        return Ok(None);
    }
    let cast_weights = weights
        .iter()
        .map(|w| if w.kind() == kind { Ok(w.shallow_clone()) } else { compute::weight_for_product(w, kind) })
        .collect::<Result<Vec<_>>>()?;
    // Each group's end row, as the product reads them.
    let ends: Vec<i32> = counts
        .iter()
        .scan(0i64, |end, &count| {
            *end += count;
            Some(i32::try_from(*end).unwrap_or(i32::MAX))
        })
        .collect();
    let offsets = Tensor::from_slice(&ends).f_to_device(x.device())?;
    let stacked = Tensor::f_stack(&cast_weights, 0)?;
    Ok(Some(cast(x, Some(kind))?.f_internal_grouped_mm(
        &stacked.f_transpose(1, 2)?,
        Some(&offsets),
        None::<&Tensor>,
        None,
    )?))
}

/// A low-rank adapter's factors as a layer reads them: `A` `[r, in]`, `B` `[out, r]` and
/// the scale of their product, and in a training forward the dropout of its input.
pub struct LowRank<'a> {
    /// `A`, `[r, in]`.
    pub a: Tensor,
    /// `B`, `[out, r]`.
    pub b: Tensor,
    /// The factor of the product (`alpha / r`, or `alpha / √r` with `use_rslora`).
    pub scale: f64,
    /// Dropout of the adapter's input, whose masks fall at the coordinates of the input's
    /// place in the whole one (`None`: nothing dropped).
    pub dropout: Option<super::dropout::Dropping<'a>>,
}

impl LowRank<'_> {
    /// What the adapter adds to its layer's output for input `x`: `scale·(dropout(x)·Aᵀ)·Bᵀ`
    /// (peft's `lora_B(lora_A(dropout(x))) · scaling`), each product a linear layer of its
    /// own (so autocast and fp8 treat it as one).
    pub fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let x = match &self.dropout {
            Some(d) => d.apply(x)?,
            None => x.shallow_clone(),
        };
        Ok(linear(&linear(&x, &self.a, None)?, &self.b, None)?.f_mul_scalar(self.scale)?)
    }
}

/// A row-parallel linear layer: this rank's input columns times its weight columns, summed
/// over the tensor group (split along the sequence under sequence parallel); the bias, held
/// whole by every rank, is added once after the sum. An adapter's `A` is split along the
/// input as the weight is, so its part joins the sum before the reduction.
pub fn row_linear(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    adapter: Option<LowRank<'_>>,
    tp: &dyn TensorParallel,
) -> Result<Tensor> {
    let unreduced = |bias: Option<&Tensor>| -> Result<Tensor> {
        let y = linear(x, w, bias)?;
        match &adapter {
            Some(adapter) => Ok(y.f_add(&adapter.delta(x)?)?),
            None => Ok(y),
        }
    };
    if tp.size() == 1 {
        return unreduced(b);
    }
    let y = tp.leave(&unreduced(None)?)?;
    match b {
        Some(b) => Ok(y.f_add(&cast(b, Some(y.kind()))?)?),
        None => Ok(y),
    }
}

/// Token ids `[B, T]` to vectors `[B, T, D]` through an embedding table split along a
/// vocabulary of `vocab` rows: each rank looks up the ids in its rows and the partial
/// vectors are summed (split along the sequence under sequence parallel). The row of
/// `padding`, where given, receives no gradient from the look-up (`nn.Embedding`'s
/// `padding_idx`).
pub fn vocab_embedding(
    table: &Tensor,
    tokens: &Tensor,
    vocab: i64,
    padding: Option<i64>,
    tp: &dyn TensorParallel,
) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(Tensor::f_embedding(table, tokens, padding.unwrap_or(-1), false, false)?);
    }
    let rows = vocab_rows(vocab, tp.size());
    let local = tokens.f_sub_scalar(tp.rank() * rows)?;
    let local_padding = padding.map(|p| p - tp.rank() * rows).filter(|p| (0..rows).contains(p)).unwrap_or(-1);
    let elsewhere = local.f_lt(0)?.f_logical_or(&local.f_ge(rows)?)?;
    let found = Tensor::f_embedding(table, &local.f_masked_fill(&elsewhere, 0)?, local_padding, false, false)?;
    tp.leave(&found.f_masked_fill(&elsewhere.f_unsqueeze(-1)?, 0.0)?)
}

/// Logits `[B, T, V/tp]` of this rank's vocabulary rows `w` (and `b`) for `x`, gathered
/// whole first and soft-capped where `softcap` says; the padding rows past `vocab` get
/// -inf, so they never win the softmax and never receive a gradient.
pub fn vocab_logits(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    vocab: i64,
    softcap: Option<f64>,
    tp: &dyn TensorParallel,
) -> Result<Tensor> {
    let capped = |logits: Tensor| match softcap {
        Some(cap) => soft_cap(&logits, cap),
        None => Ok(logits),
    };
    if tp.size() == 1 {
        return capped(linear(x, w, b)?);
    }
    let logits = capped(linear(&tp.enter(x)?, w, b)?)?;
    let rows = vocab_rows(vocab, tp.size());
    let real = (vocab - tp.rank() * rows).clamp(0, rows);
    if real == rows {
        return Ok(logits);
    }
    let padding = Tensor::f_arange(rows, (Kind::Int64, x.device()))?.f_ge(real)?;
    Ok(logits.f_masked_fill(&padding, f64::NEG_INFINITY)?)
}

/// Layer norm over the last dimension, `(x − mean) / √(var + eps) · w + b`, computed in at
/// least fp32 and returned in x's dtype; the unit's `module_replace` implementation where
/// one serves it.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let x = norm_input(x)?;
    if let Some(fused) = compute::replaced(|r| r.layer_norm(x.kind())) {
        return fused(&x, w, b, eps);
    }
    Ok(cast(&layer_normalized(&x, eps)?, Some(x.kind()))?.f_mul(w)?.f_add(b)?)
}

/// `(x − mean(x)) / √(var(x) + eps)` over the last dimension, in at least fp32 (as torch's
/// kernels compute it).
fn layer_normalized(x: &Tensor, eps: f64) -> Result<Tensor> {
    let x32 = cast(x, is_low(x.kind()).then_some(Kind::Float))?;
    let centred = x32.f_sub(&x32.f_mean_dim(-1, true, None)?)?;
    let var = centred.f_square()?.f_mean_dim(-1, true, None)?;
    Ok(centred.f_mul(&var.f_add_scalar(eps)?.f_rsqrt()?)?)
}

/// Layer norm with a weight and no bias, the weight applied in at least fp32 before the
/// result returns to x's dtype (Cohere's).
pub fn layer_norm_unbiased(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let x = norm_input(x)?;
    let normed = layer_normalized(&x, eps)?;
    cast(&normed.f_mul(&cast(w, Some(normed.kind()))?)?, Some(x.kind()))
}

/// RMS norm over the last dimension, `x / rms(x) · w`, computed in at least fp32 and
/// returned in x's dtype; the unit's `module_replace` implementation where one serves it.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let x = norm_input(x)?;
    if let Some(fused) = compute::replaced(|r| r.rms_norm(x.kind())) {
        return fused(&x, w, eps);
    }
    Ok(rms_norm_unweighted(&x, eps)?.f_mul(w)?)
}

/// RMS norm with a weight over a last dimension that the ranks of `tp` split in columns,
/// each holding its own `x` and `w` (OLMo 2's query/key norms over whole projections under
/// tensor parallelism): the squares' sum is all-reduced both ways, forward for the mean,
/// backward because every rank's columns read it.
pub fn rms_norm_split(x: &Tensor, w: &Tensor, eps: f64, tp: &dyn TensorParallel) -> Result<Tensor> {
    let x = norm_input(x)?;
    let x32 = cast(&x, is_low(x.kind()).then_some(Kind::Float))?;
    let local = x32.f_square()?.f_sum_dim_intlist(-1, true, None)?;
    let columns = x.size().last().copied().unwrap_or(1) * tp.size();
    let mean_square = tp.copy_in(&tp.reduce_out(&local)?)?.f_div_scalar(columns as f64)?;
    let normalized = x32.f_mul(&mean_square.f_add_scalar(eps)?.f_rsqrt()?)?;
    Ok(cast(&normalized, Some(x.kind()))?.f_mul(w)?)
}

/// RMS norm over the last dimension without a weight, `x / rms(x)`, computed in at least
/// fp32 and returned in x's dtype (Gemma 4's norm of its values).
pub fn rms_norm_unweighted(x: &Tensor, eps: f64) -> Result<Tensor> {
    let x = norm_input(x)?;
    let x32 = cast(&x, is_low(x.kind()).then_some(Kind::Float))?;
    cast(&rms_normalized(&x32, eps)?, Some(x.kind()))
}

/// The layer norm of `x` where its only reader is a matrix product: one kernel each way
/// where `module_replace` has `FusedAddLayerNorm` and it serves the tensors, the norm then
/// written in the products' dtype under autocast (as [`add_layer_norm`]'s).
pub fn layer_norm_into_product(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    match fused_add_norm(x, None, w, Some(b), eps, |reps, kind| reps.add_layer_norm(kind))? {
        Some((_, normed)) => Ok(normed),
        None => layer_norm(x, w, b, eps),
    }
}

/// The RMS norm of `x` where its only reader is a matrix product (as
/// [`layer_norm_into_product`], with `FusedAddRMSNorm`).
pub fn rms_norm_into_product(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    match fused_add_norm(x, None, w, None, eps, |reps, kind| reps.add_rms_norm(kind))? {
        Some((_, normed)) => Ok(normed),
        None => rms_norm(x, w, eps),
    }
}

/// The residual sum `x + r` and its layer norm, `(x + r, layer_norm(x + r))`: one kernel
/// each way where `module_replace` has `FusedAddLayerNorm` and it serves the tensors (the
/// norm then in the products' dtype under autocast).
pub fn add_layer_norm(x: &Tensor, r: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    if let Some(pair) = fused_add_norm(x, Some(r), w, Some(b), eps, |reps, kind| reps.add_layer_norm(kind))? {
        return Ok(pair);
    }
    let s = x.f_add(r)?;
    let normed = layer_norm(&s, w, b, eps)?;
    Ok((s, normed))
}

/// The residual sum `x + r` and its RMS norm, `(x + r, rms_norm(x + r))`: one kernel each
/// way where `module_replace` has `FusedAddRMSNorm` and it serves the tensors (as
/// [`add_layer_norm`]).
pub fn add_rms_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    if let Some(pair) = fused_add_norm(x, Some(r), w, None, eps, |reps, kind| reps.add_rms_norm(kind))? {
        return Ok(pair);
    }
    let s = x.f_add(r)?;
    let normed = rms_norm(&s, w, eps)?;
    Ok((s, normed))
}

/// The replaced residual sum and norm, where one is selected and serves. The kernel returns
/// the sum in the weight's dtype, as the composite does; under autocast only an fp32 weight
/// (and so an fp32 sum) is handed to it, and the norm comes in the products' dtype: the
/// composite's fp32 norm rounded as the next product's cast would round it, without
/// writing it in fp32 first (its gradient comes back in that dtype, which the cast's
/// backward would have widened exactly).
fn fused_add_norm(
    x: &Tensor,
    r: Option<&Tensor>,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
    pick: impl FnOnce(&compute::replace::Replacements, Kind) -> Option<compute::replace::AddNormFn>,
) -> Result<Option<(Tensor, Tensor)>> {
    if compute::autocast_on() && w.kind() != Kind::Float {
        return Ok(None);
    }
    match compute::replaced(|reps| pick(reps, w.kind())) {
        Some(fused) => fused(x, r, w, b, eps, compute::product_kind()),
        None => Ok(None),
    }
}

/// `x / rms(x)` over the last dimension, in x's dtype.
pub(crate) fn rms_normalized(x: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.f_square()?.f_mean_dim(-1, true, None)?;
    Ok(x.f_mul(&ms.f_add_scalar(eps)?.f_rsqrt()?)?)
}

/// Gemma's RMS norm, `x / rms(x) · (1 + w)`, computed in fp32 and returned in x's dtype.
pub fn rms_norm_plus_one(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let x = norm_input(x)?;
    let x32 = cast(&x, is_low(x.kind()).then_some(Kind::Float))?;
    let w32 = cast(w, Some(x32.kind()))?.f_add_scalar(1.0)?;
    if let Some(fused) = compute::replaced(|r| r.rms_norm(x32.kind())) {
        return cast(&fused(&x32, &w32, eps)?, Some(x.kind()));
    }
    cast(&rms_normalized(&x32, eps)?.f_mul(&w32)?, Some(x.kind()))
}

/// GELU in its tanh form, GPT-2's activation.
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    if let Some(replaced) = compute::replaced(|r| r.gelu(x.kind())) {
        if let Some(y) = replaced(x)? {
            return Ok(y);
        }
    }
    Ok(x.f_gelu("tanh")?)
}

/// GeGLU's gating, `gelu_tanh(gate) * up` (Gemma's feed-forward).
pub fn geglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(gelu_tanh(gate)?.f_mul(up)?)
}

/// SwiGLU's gating, `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if let Some(replaced) = compute::replaced(|r| r.swiglu(gate.kind())) {
        if let Some(y) = replaced(gate, up)? {
            return Ok(y);
        }
    }
    Ok(gate.f_silu()?.f_mul(up)?)
}

/// Rotary positions of `[B, H, T, D]` `x` by `[T, D]` tables: `x·cos + rotate_half(x)·sin`,
/// where rotate_half maps the halves (x₁, x₂) of the last dimension to (−x₂, x₁).
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    // Replacements take one table for every row; a table per row (packed examples) is
    // computed here.
    if let Some(replaced) = compute::replaced(|r| r.rotary(x.kind())).filter(|_| cos.dim() == 2) {
        if let Some(y) = replaced(x, cos, sin)? {
            return Ok(y);
        }
    }
    let halves = x.f_chunk(2, -1)?;
    let rotated = Tensor::f_cat(&[&halves[1].f_neg()?, &halves[0]], -1)?;
    Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
}

/// What a model's attention does beyond plain causal softmax attention.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// The factor scores are multiplied by; `None`: 1/√head width.
    pub scale: Option<f64>,
    /// Each query sees itself and the `window - 1` positions before it (sliding-window
    /// attention); `None`: every earlier position.
    pub window: Option<i64>,
    /// Scores pass through `cap · tanh(score / cap)` before the mask (Gemma 2's soft-capping).
    pub softcap: Option<f64>,
    /// Each query sees every key of its example, before and after it (an encoder's
    /// attention); `false`: only those up to it (causal).
    pub bidirectional: bool,
    /// Each query sees only the keys of its own chunk: places `[c·n, c·(n+1))` of its row
    /// (Llama 4's chunked attention); `None`: no chunks.
    pub chunk: Option<i64>,
}

/// What joins the attention scores beside the queries and keys.
#[derive(Clone, Copy, Default)]
pub struct ScoreTerms<'a> {
    /// Added to the scores before the mask (T5's relative position bias), `[.., Tq, Tk]`.
    pub bias: Option<&'a Tensor>,
    /// One learned logit per head `[H]` that joins each query's softmax as one more key
    /// with no value (gpt-oss's attention sinks): its share of the softmax is attended to
    /// nothing.
    pub sinks: Option<&'a Tensor>,
}

/// Where rows hold packed examples (`layout`), the `[B, 1, T, T]` mask of the key positions
/// each query may not see because they belong to another example; `None` for plain rows.
pub fn other_examples(layout: Option<&super::RowLayout>) -> Result<Option<Tensor>> {
    let Some(layout) = layout else { return Ok(None) };
    examples_differ(&layout.examples, &layout.examples).map(Some)
}

/// The `[Tq, Tk]` mask of the keys in another chunk of `chunk` places than their query's,
/// from the queries' (`[Tq]`) and the keys' (`[Tk]`) places in their row.
pub fn chunks_differ(query_places: &Tensor, key_places: &Tensor, chunk: i64) -> Result<Tensor> {
    let (queries, keys) = (query_places.f_floor_divide_scalar(chunk)?, key_places.f_floor_divide_scalar(chunk)?);
    Ok(queries.f_unsqueeze(1)?.f_ne_tensor(&keys.f_unsqueeze(0)?)?)
}

/// The `[B, 1, Tq, Tk]` mask of the keys of another example than their query's, from the
/// example numbers of the queries' (`[B, Tq]`) and the keys' (`[B, Tk]`) positions.
pub fn examples_differ(queries: &Tensor, keys: &Tensor) -> Result<Tensor> {
    Ok(queries.f_unsqueeze(2)?.f_ne_tensor(&keys.f_unsqueeze(1)?)?.f_unsqueeze(1)?)
}

/// Multi-head attention over `[B, H, Tq, D]` queries and `[B, H, Tk, D]` keys and values,
/// `Tk ≥ Tq`: the queries are the last `Tq` of the `Tk` positions (decoding with a
/// key/value cache), each attending to itself and the positions before it (within its
/// window or chunk, where `options` sets one; every position where `options.bidirectional`), and
/// never to keys `hidden` masks ([`other_examples`]). `bias`, where given, is added to the
/// scaled scores (T5's relative position bias, `[1, H, Tq, Tk]`). `dropout`, where given,
/// drops attention probabilities (the composite then runs: a fused kernel would draw its own).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &AttentionOptions,
    hidden: Option<&Tensor>,
    terms: ScoreTerms<'_>,
    dropout: Option<&Dropping<'_>>,
) -> Result<Tensor> {
    let kind = compute::autocast_kind();
    let (q, k, v) = (cast(q, kind)?, cast(k, kind)?, cast(v, kind)?);
    let (t, d, keys) = (q.size()[2], q.size()[3], k.size()[2]);
    let window = options.window.filter(|&w| w < keys);
    let default_scale = 1.0 / (d as f64).sqrt();
    // Fused kernels align a causal mask to the first key, so they serve equal lengths only,
    // of causal attention over unpacked rows without a bias or dropout.
    let fusable = keys == t && hidden.is_none() && terms.bias.is_none() && !options.bidirectional && dropout.is_none();
    // Chunks take the composite's mask where the keys span more than one.
    let chunk = options.chunk.filter(|&c| c < keys);
    let fusable = fusable && chunk.is_none();
    // libtorch's know no window, cap or sinks; another scale is folded into the queries.
    if let Some(fused) = compute::replaced(|r| r.attention(q.kind()))
        .filter(|_| fusable && window.is_none() && options.softcap.is_none() && terms.sinks.is_none())
    {
        let q = match options.scale {
            Some(scale) => q.f_mul_scalar(scale / default_scale)?,
            None => q,
        };
        return fused(&q, &k, &v);
    }
    // Windows, caps and sinks: Strata's own kernel where it serves.
    if let Some(own) = compute::replaced(|r| r.masked_attention(q.kind())).filter(|_| fusable) {
        let scale = options.scale.unwrap_or(default_scale);
        let scores = compute::replace::CausalScores { scale, softcap: options.softcap, window, sinks: terms.sinks };
        if let Some(out) = own(&q, &k, &v, &scores)? {
            return Ok(out);
        }
    }
    let scores = q.f_matmul(&k.f_transpose(-2, -1)?)?.f_mul_scalar(options.scale.unwrap_or(default_scale))?;
    let scores = match options.softcap {
        Some(cap) => soft_cap(&scores, cap)?,
        None => scores,
    };
    let scores = match terms.bias {
        Some(bias) => scores.f_add(bias)?,
        None => scores,
    };
    // Query i sits at key position keys - t + i: later keys are its future, and keys `window`
    // or more behind it are outside its window.
    let ones = Tensor::f_ones([t, keys], (Kind::Bool, q.device()))?;
    let mut masked = if options.bidirectional { ones.f_logical_not()? } else { ones.f_triu(1 + keys - t)? };
    if let Some(w) = window {
        masked = masked.f_logical_or(&ones.f_tril(keys - t - w)?)?;
    }
    if let Some(c) = chunk {
        let places = |from: i64| Tensor::f_arange_start(from, keys, (Kind::Int64, q.device()));
        masked = masked.f_logical_or(&chunks_differ(&places(keys - t)?, &places(0)?, c)?)?;
    }
    if let Some(other) = hidden {
        masked = masked.f_logical_or(other)?;
    }
    let scores = scores.f_masked_fill(&masked, f64::NEG_INFINITY)?;
    // Softmax in fp32 for low-precision inputs, as torch.amp does; a sink is one more
    // column of the softmax, dropped after it.
    let softmax_kind = if is_low(q.kind()) { Kind::Float } else { q.kind() };
    let probs = match terms.sinks {
        Some(sinks) => {
            let (b, h) = (scores.size()[0], scores.size()[1]);
            let column = sinks.f_to_kind(scores.kind())?.f_reshape([1, h, 1, 1])?.f_expand([b, h, t, 1], false)?;
            Tensor::f_cat(&[scores, column], -1)?.f_softmax(-1, softmax_kind)?.f_narrow(-1, 0, keys)?
        }
        None => scores.f_softmax(-1, softmax_kind)?,
    };
    let probs = probs.f_to_kind(q.kind())?;
    let probs = match dropout {
        Some(dropout) => dropout.apply(&probs)?,
        None => probs,
    };
    Ok(probs.f_matmul(&v)?)
}

/// [`attention`] over the rows `p` runs on (their `layout`, where they hold packed examples
/// or pieces of rows): under context parallelism, through the context group over the whole
/// rows, whose pieces its ranks hold; otherwise over this rank's rows.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    p: &super::Params<'_>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &AttentionOptions,
    layout: Option<&super::RowLayout>,
    terms: ScoreTerms<'_>,
    dropout: Option<&Dropping<'_>>,
) -> Result<Tensor> {
    let Some(context) = p.context() else {
        return attention(q, k, v, options, other_examples(layout)?.as_ref(), terms, dropout);
    };
    let refused =
        |what: &str| crate::Error::Config(format!("context_parallel: {what} is not split over the context group"));
    if terms.bias.is_some() {
        return Err(refused("a position bias over whole rows (T5's)"));
    }
    if dropout.is_some() {
        return Err(refused("attention dropout"));
    }
    let layout = layout.ok_or_else(|| refused("a row without the layout that places its piece"))?;
    // In the products' dtype under either autocast, as attention over whole rows computes
    // (libtorch's on a device does not reach the context group's kernels).
    let kind = compute::product_kind();
    let (q, k, v) = (cast(q, kind)?, cast(k, kind)?, cast(v, kind)?);
    context.attention(&q, &k, &v, options, &layout.examples, terms.sinks)
}

/// `x` (`[B, Hkv, T, D]`) with each head repeated `times` times in place: the query heads a
/// key/value head serves are adjacent.
pub fn repeat_heads(x: &Tensor, times: i64) -> Result<Tensor> {
    Ok(match times {
        1 => x.shallow_clone(),
        _ => x.f_repeat_interleave_self_int(times, 1, None)?,
    })
}

/// `cap · tanh(x / cap)`: values kept within ±cap, smoothly.
pub fn soft_cap(x: &Tensor, cap: f64) -> Result<Tensor> {
    Ok(x.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?)
}

/// GELU in its exact form, `x·Φ(x)` (BERT's `gelu`).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    Ok(x.f_gelu("none")?)
}

/// Queries, keys and values `[B, H, T, D]`, and the heads' output gates `[B, T, H·D]` where
/// there are some: what a block's attention projects, whatever its head layout.
pub(crate) type Projected = (Tensor, Tensor, Tensor, Option<Tensor>);

/// `[B, T, H*D]` -> `[B, H, T, D]`.
pub fn split_heads(x: &Tensor, heads: i64) -> Result<Tensor> {
    let (b, t, c) = x.size3()?;
    Ok(x.f_view([b, t, heads, c / heads])?.f_transpose(1, 2)?)
}

/// `[B, H, T, D]` -> `[B, T, H*D]`.
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.size4()?;
    Ok(x.f_transpose(1, 2)?.f_contiguous()?.f_view([b, t, h * d])?)
}

/// The target of a position that takes no loss (a prompt, padding), as `transformers`'
/// labels and torch's `cross_entropy` mark it.
pub const IGNORE: i64 = -100;

/// Mean cross-entropy of `[B, T, V]` logits against `[B, T]` targets, computed in fp32
/// when the logits are of lower precision.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if let Some(fused) = compute::replaced(|r| r.cross_entropy(logits.kind())) {
        if let Some(loss) = fused(logits, targets, IGNORE)? {
            return Ok(loss);
        }
    }
    let v = *logits.size().last().unwrap_or(&1);
    let logits = cast(logits, is_low(logits.kind()).then_some(Kind::Float))?;
    let targets = targets.f_reshape([-1])?;
    let sum =
        logits.f_reshape([-1, v])?.f_cross_entropy_loss::<&Tensor>(&targets, None, tch::Reduction::Sum, IGNORE, 0.0)?;
    // A micro-batch with no supervised target (all prompt) contributes 0, not 0 / 0.
    Ok(sum.f_div(&supervised_count(&targets)?)?)
}

/// The number of `targets` that take a loss, at least 1, as a float scalar on their device.
pub(crate) fn supervised_count(targets: &Tensor) -> Result<Tensor> {
    Ok(targets.f_ne(IGNORE)?.f_sum(Kind::Float)?.f_clamp_min(1)?)
}

/// One rank: every collective is the identity.
pub struct NoTensorParallel;

impl TensorParallel for NoTensorParallel {
    fn size(&self) -> i64 {
        1
    }
    fn rank(&self) -> i64 {
        0
    }
    fn sequence_parallel(&self) -> bool {
        false
    }
    fn copy_in(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.shallow_clone())
    }
    fn reduce_out(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.shallow_clone())
    }
    fn gather_sequence(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.shallow_clone())
    }
    fn scatter_sequence(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.shallow_clone())
    }
    fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        cross_entropy(logits, targets)
    }
    fn whole_vocabulary(&self, logits: &Tensor, _vocab: i64) -> Result<Tensor> {
        Ok(logits.shallow_clone())
    }
    fn gather(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        Ok(vec![x.shallow_clone()])
    }
    fn sum_values(&self, values: &[f64]) -> Result<Vec<f64>> {
        Ok(values.to_vec())
    }
}
