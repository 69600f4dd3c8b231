use std::sync::{Arc, Mutex};
use strata::engine::{BackwardMode, Engine, EngineConfig, HeldStates, Phase, ScheduleContext, UnitSchedule};
use strata::model::{self, layers::cross_entropy, Builder, DecodeCache, GptConfig, LlamaConfig, MlpConfig};
use strata::Error;
use tch::{Kind, Tensor};

type ModelFn = fn(&mut Builder) -> strata::Result<()>;

fn tiny_gpt(b: &mut Builder) -> strata::Result<()> {
    model::gpt(&GptConfig::new(11, 6, 2, 2, 8), b)
}
fn tiny_llama(b: &mut Builder) -> strata::Result<()> {
    model::llama(&LlamaConfig::new(11, 6, 2, 2, 8), b)
}
fn tiny_mlp(b: &mut Builder) -> strata::Result<()> {
    model::mlp(&MlpConfig { vocab: 11, layers: 2, dim: 8 }, b)
}

fn engine(f: ModelFn, kind: Kind, backward: BackwardMode, seed: i64) -> Engine {
    let mut b = Builder::new();
    f(&mut b).unwrap();
    Engine::new(b.build().unwrap(), EngineConfig { kind, backward, seed, ..Default::default() }).unwrap()
}

fn batch(seed: i64) -> (Tensor, Tensor) {
    let tokens = strata::engine::with_seed(seed, || Tensor::randint(11, [3, 7], (Kind::Int64, tch::Device::Cpu)));
    (tokens.narrow(1, 0, 6), tokens.narrow(1, 1, 6))
}

fn loss(e: &mut Engine, x: &Tensor, y: &Tensor) -> f64 {
    cross_entropy(&e.evaluate(x).unwrap(), y).unwrap().double_value(&[])
}

/// Every parameter's gradient, as computed by the engine's unit-by-unit backward, against
/// central finite differences of the loss in f64 — a check of every layer of every unit
/// kind and of the upstream gradients handed between units.
fn finite_difference_check(f: ModelFn) {
    let mut e = engine(f, Kind::Double, BackwardMode::UnitByUnit, 3);
    let (x, y) = batch(5);
    let out = e.forward(&x).unwrap();
    e.backward(&cross_entropy(&out, &y).unwrap()).unwrap();
    let names: Vec<String> = e.named_params().map(|(n, _)| n.to_string()).collect();
    let h = 1e-6;
    for name in names {
        let p = e.param_by_name(&name).unwrap().shallow_clone();
        let grad = p.grad().flatten(0, -1);
        let flat = p.detach().flatten(0, -1);
        let n = flat.numel() as i64;
        // A spread of entries of each parameter keeps the test fast and still covers it.
        for i in [0, n / 3, n / 2, n - 1] {
            let orig = flat.double_value(&[i]);
            let _ = flat.get(i).fill_(orig + h);
            let up = loss(&mut e, &x, &y);
            let _ = flat.get(i).fill_(orig - h);
            let down = loss(&mut e, &x, &y);
            let _ = flat.get(i).fill_(orig);
            let numeric = (up - down) / (2.0 * h);
            let analytic = grad.double_value(&[i]);
            assert!(
                (numeric - analytic).abs() <= 1e-6 + 1e-5 * numeric.abs().max(analytic.abs()),
                "{name}[{i}]: finite difference {numeric:e} vs backward {analytic:e}"
            );
        }
    }
}

#[test]
fn gpt_gradients_match_finite_differences() {
    finite_difference_check(tiny_gpt);
}

#[test]
fn llama_gradients_match_finite_differences() {
    finite_difference_check(tiny_llama);
}

#[test]
fn mlp_gradients_match_finite_differences() {
    finite_difference_check(tiny_mlp);
}

/// Four query heads sharing two key/value heads (dim 16, head size 4).
fn tiny_gqa_llama(b: &mut Builder) -> strata::Result<()> {
    model::llama(&LlamaConfig { kv_heads: Some(2), ..LlamaConfig::new(11, 6, 2, 4, 16) }, b)
}

#[test]
fn grouped_query_llama_gradients_match_finite_differences() {
    finite_difference_check(tiny_gqa_llama);
}

/// The head reads the embedding's weight: its gradient gathers both units' contributions.
fn tiny_tied_llama(b: &mut Builder) -> strata::Result<()> {
    model::llama(&LlamaConfig { tie_embeddings: true, norm_eps: 1e-3, ..LlamaConfig::new(11, 6, 2, 2, 8) }, b)
}

#[test]
fn tied_llama_gradients_match_finite_differences() {
    finite_difference_check(tiny_tied_llama);
}

/// Grouped-query attention is multi-head attention whose key/value heads are repeated over
/// their groups: a GQA LLaMA and an MHA LLaMA holding its key/value weights repeated per
/// group give the same logits.
/// Gemma's options at once: (1 + w) norms around attention and feed-forward, GeGLU, √d
/// embeddings, query/key norms, a score scale, both soft-caps, a sliding layer with its own
/// scaled rotation beside a global one, heads wider than dim / heads.
fn tiny_gemma_like(b: &mut Builder) -> strata::Result<()> {
    use strata::model::{Activation, LayerAttention, NormKind, Rope, RopeScaling};
    model::llama(
        &LlamaConfig {
            kv_heads: Some(1),
            head_dim: Some(6),
            norm: NormKind::PlusOne,
            activation: Activation::GeluTanh,
            qk_norm: true,
            sandwich_norms: true,
            scale_embeddings: true,
            query_pre_attn_scalar: Some(5.0),
            attn_softcap: Some(1.5),
            logit_softcap: Some(2.0),
            sliding_window: Some(3),
            layer_types: Some(vec![LayerAttention::Sliding, LayerAttention::Full]),
            local_rope: Some(Rope { scaling: RopeScaling::Linear { factor: 2.0 }, ..Rope::new(50.0) }),
            tie_embeddings: true,
            ..LlamaConfig::new(11, 6, 2, 2, 8)
        },
        b,
    )
}

#[test]
fn gemma_like_gradients_match_finite_differences() {
    finite_difference_check(tiny_gemma_like);
}

/// Phi-3's fused projections with a partial, YaRN-scaled rotation and a sliding window.
fn tiny_phi_like(b: &mut Builder) -> strata::Result<()> {
    use strata::model::RopeScaling;
    model::llama(
        &LlamaConfig {
            kv_heads: Some(1),
            fused_projections: true,
            partial_rotary: 0.5,
            rope_scaling: RopeScaling::Yarn {
                factor: 4.0,
                original_context: 4,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: 1.1,
                truncate: true,
            },
            sliding_window: Some(4),
            ..LlamaConfig::new(11, 6, 2, 2, 8)
        },
        b,
    )
}

#[test]
fn phi_like_gradients_match_finite_differences() {
    finite_difference_check(tiny_phi_like);
}

/// Decoding with a cache through sliding-window layers equals the uncached forward over
/// the whole sequence (the prompt's last position, then each new one: the head reads only
/// the last position of what it is given), and each window layer's cache holds no more than
/// its window reads.
#[test]
fn sliding_windows_decode_as_the_forward_computes_and_their_caches_stay_within_the_window() {
    let window = |b: &mut Builder| {
        model::llama(
            &LlamaConfig { sliding_window: Some(4), kv_heads: Some(1), ..LlamaConfig::new(11, 16, 2, 2, 8) },
            b,
        )
    };
    let mut e = engine(window, Kind::Double, BackwardMode::UnitByUnit, 4);
    let tokens = strata::engine::with_seed(9, || Tensor::randint(11, [1, 12], (Kind::Int64, tch::Device::Cpu)));
    let whole = e.evaluate(&tokens).unwrap();
    let mut caches: Vec<DecodeCache> = (0..e.spec().units.len()).map(|_| DecodeCache::default()).collect();
    let prefill = e.decode(&tokens.narrow(1, 0, 6), &mut caches).unwrap();
    assert_eq!(prefill.size(), [1, 1, 11], "the prompt's last position's logits alone");
    let mut pieces = vec![prefill];
    for t in 6..12 {
        pieces.push(e.decode(&tokens.narrow(1, t, 1), &mut caches).unwrap());
        for (k, cache) in caches.iter().enumerate().filter(|(k, _)| (1..=2).contains(k)) {
            assert_eq!(cache.held(), 3, "unit {k} holds the 3 positions before the next query");
        }
    }
    let decoded = Tensor::cat(&pieces, 1);
    let gap = (&decoded - &whole.narrow(1, 5, 7)).abs().max().double_value(&[]);
    assert!(gap < 1e-10, "decoded logits differ from the forward's by {gap}");
    // Without the window the last positions differ: the window changed what they read.
    let mut full = engine(tiny_llama_16, Kind::Double, BackwardMode::UnitByUnit, 4);
    let unwindowed = full.evaluate(&tokens).unwrap();
    assert!((&unwindowed - &whole).narrow(1, 6, 6).abs().max().double_value(&[]) > 1e-6);
    assert!((&unwindowed - &whole).narrow(1, 0, 4).abs().max().double_value(&[]) < 1e-12);
}

/// The padding token's embedding row learns nothing from its look-ups (`padding_idx`), while
/// every other row looked up does.
#[test]
fn the_padding_row_takes_no_gradient_from_look_ups() {
    let padded =
        |b: &mut Builder| model::llama(&LlamaConfig { padding_token: Some(4), ..LlamaConfig::new(11, 6, 1, 2, 8) }, b);
    let mut e = engine(padded, Kind::Double, BackwardMode::UnitByUnit, 1);
    let x = Tensor::from_slice(&[4i64, 1, 4, 2, 3, 4]).view([1, 6]);
    let out = e.forward(&x).unwrap();
    e.backward(&cross_entropy(&out, &x).unwrap()).unwrap();
    let grad = e.param_by_name("model.embed_tokens.weight").unwrap().grad();
    let row_norm = |r: i64| grad.get(r).abs().sum(Kind::Double).double_value(&[]);
    assert_eq!(row_norm(4), 0.0);
    assert!([1, 2, 3].iter().all(|&r| row_norm(r) > 1e-6));
    let bad = LlamaConfig { padding_token: Some(11), ..LlamaConfig::new(11, 6, 1, 2, 8) };
    assert!(model::llama(&bad, &mut Builder::new()).unwrap_err().to_string().contains("padding token 11"));
}

fn tiny_llama_16(b: &mut Builder) -> strata::Result<()> {
    model::llama(&LlamaConfig { kv_heads: Some(1), ..LlamaConfig::new(11, 16, 2, 2, 8) }, b)
}

#[test]
fn grouped_query_attention_equals_attention_with_repeated_key_value_heads() {
    let mha = |b: &mut Builder| model::llama(&LlamaConfig::new(11, 6, 2, 4, 16), b);
    let mut gqa = engine(tiny_gqa_llama, Kind::Double, BackwardMode::UnitByUnit, 3);
    let mut full = engine(mha, Kind::Double, BackwardMode::UnitByUnit, 4);
    let (group, head) = (2, 4);
    let values: Vec<(String, Tensor)> = gqa.named_params().map(|(n, p)| (n.to_string(), p.detach())).collect();
    assert_eq!(values.iter().find(|(n, _)| n.ends_with("layers.0.self_attn.k_proj.weight")).unwrap().1.size(), [8, 16]);
    for ((name, target), (_, source)) in full.named_params().zip(&values) {
        let source = if name.contains("k_proj") || name.contains("v_proj") {
            // [kv_heads · head, dim] -> each head's rows repeated for its group.
            source.view([-1, head, 16]).repeat_interleave_self_int(group, 0, None).reshape([-1, 16])
        } else {
            source.shallow_clone()
        };
        tch::no_grad(|| target.shallow_clone().copy_(&source));
    }
    let (x, _) = batch(5);
    let (a, b) = (gqa.evaluate(&x).unwrap(), full.evaluate(&x).unwrap());
    let gap = (&a - &b).abs().max().double_value(&[]);
    assert!(gap < 1e-12, "GQA and repeated-head MHA differ by {gap}");
    assert!(a.abs().max().double_value(&[]) > 0.0);
}

#[test]
fn unit_by_unit_backward_equals_whole_graph_backward() {
    for f in [tiny_gpt as ModelFn, tiny_llama, tiny_mlp] {
        let mut a = engine(f, Kind::Float, BackwardMode::UnitByUnit, 9);
        let mut b = engine(f, Kind::Float, BackwardMode::WholeGraph, 9);
        let (x, y) = batch(1);
        for e in [&mut a, &mut b] {
            // Two micro-batches: gradients must also accumulate identically.
            for _ in 0..2 {
                let out = e.forward(&x).unwrap();
                e.backward(&cross_entropy(&out, &y).unwrap()).unwrap();
            }
        }
        for ((name, pa), (_, pb)) in a.named_params().zip(b.named_params()) {
            let diff = (pa.grad() - pb.grad()).abs().max().double_value(&[]);
            assert!(diff <= 1e-6, "{name}: unit-by-unit and whole-graph gradients differ by {diff}");
            assert!(pa.grad().abs().sum(Kind::Float).double_value(&[]) > 0.0, "{name} got no gradient");
        }
    }
}

struct Recorder(Arc<Mutex<Vec<(Phase, usize)>>>);

impl UnitSchedule for Recorder {
    fn on(&mut self, phase: Phase, ctx: ScheduleContext<'_>) -> strata::Result<()> {
        assert_eq!(ctx.storage.len(), ctx.spec.units.len());
        self.0.lock().unwrap().push((phase, ctx.unit));
        Ok(())
    }
}

/// Keeps nothing beside the engine's buffers.
impl HeldStates for Recorder {}

#[test]
fn schedule_is_called_around_every_unit_in_forward_then_reverse_order() {
    let mut e = engine(tiny_mlp, Kind::Float, BackwardMode::UnitByUnit, 0);
    let log = Arc::new(Mutex::new(vec![]));
    e.set_schedule(Box::new(Recorder(log.clone())));
    let (x, y) = batch(0);
    let out = e.forward(&x).unwrap();
    e.backward(&cross_entropy(&out, &y).unwrap()).unwrap();
    use Phase::*;
    let n = e.spec().units.len();
    let mut expected = vec![];
    for k in 0..n {
        expected.extend([(BeforeForward, k), (AfterForward, k)]);
    }
    for k in (0..n).rev() {
        expected.extend([(BeforeBackward, k), (AfterBackward, k)]);
    }
    assert_eq!(*log.lock().unwrap(), expected);
}

#[test]
fn units_have_stable_kind_names_and_pytorch_parameter_names() {
    let e = engine(tiny_gpt, Kind::Float, BackwardMode::UnitByUnit, 0);
    let kinds: Vec<&str> = e.spec().units.iter().map(|u| u.kind()).collect();
    assert_eq!(kinds, ["GptEmbedding", "GptBlock", "GptBlock", "GptHead"]);
    let w = e.param_by_name("transformer.h.1.attn.c_attn.weight").unwrap();
    assert_eq!(w.size(), [24, 8], "PyTorch [out, in] layout");
    assert!(
        e.param_by_name("lm_head.weight").unwrap().data_ptr()
            == e.param_by_name("transformer.wte.weight").unwrap().data_ptr()
    );
    let l = engine(tiny_llama, Kind::Float, BackwardMode::UnitByUnit, 0);
    assert_eq!(l.spec().units[1].kind(), "LlamaBlock");
    assert!(l.param_by_name("model.layers.0.mlp.gate_proj.weight").is_some());
}

#[test]
fn gpt2_initialisation_scales_residual_projections() {
    let mut b = Builder::new();
    model::gpt(&GptConfig::new(64, 8, 8, 4, 256), &mut b).unwrap();
    let e = Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap();
    let std = |n: &str| e.param_by_name(n).unwrap().std(true).double_value(&[]);
    assert!((std("transformer.h.0.attn.c_attn.weight") - 0.02).abs() < 0.001);
    assert!((std("transformer.h.0.mlp.c_proj.weight") - 0.02 / 4.0).abs() < 0.0005);
    assert_eq!(e.param_by_name("transformer.h.0.ln_1.weight").unwrap().mean(Kind::Float).double_value(&[]), 1.0);
}

#[test]
fn parameters_are_views_into_one_flat_buffer_per_unit() {
    let e = engine(tiny_gpt, Kind::Float, BackwardMode::UnitByUnit, 0);
    for (unit, storage) in e.spec().units.iter().zip(e.storage()) {
        let numel: i64 = unit.params.iter().map(|id| e.spec().params[id.0].numel()).sum();
        assert_eq!(storage.flat.numel() as i64, numel);
        for id in &unit.params {
            let p = e.param(*id);
            let start = storage.flat.data_ptr() as usize;
            let end = start + storage.flat.numel() * 4;
            assert!(
                (start..end).contains(&(p.data_ptr() as usize)),
                "{} lies outside its unit's buffer",
                e.spec().params[id.0].name
            );
        }
    }
    let report = e.ledger().report();
    let device = &report[&strata::engine::Placement::Device];
    assert_eq!(device.current as i64, 2 * 4 * e.spec().num_params(), "params + grads, f32");
}

#[test]
fn a_device_budget_is_an_out_of_memory_error_before_allocation() {
    let mut b = Builder::new();
    tiny_gpt(&mut b).unwrap();
    let err = Engine::new(b.build().unwrap(), EngineConfig { device_budget: Some(1000), ..Default::default() })
        .err()
        .unwrap();
    assert!(matches!(err, Error::OutOfMemory { budget: 1000, .. }), "{err}");
}

#[test]
fn backward_without_forward_and_non_scalar_losses_are_errors() {
    let mut e = engine(tiny_mlp, Kind::Float, BackwardMode::UnitByUnit, 0);
    assert!(e.backward(&Tensor::from(1.0f32)).is_err());
    let (x, _) = batch(0);
    let out = e.forward(&x).unwrap();
    assert!(e.backward(&out).unwrap_err().to_string().contains("scalar"));
}

struct Identity;
impl model::Unit for Identity {
    fn kind(&self) -> &'static str {
        "Identity"
    }
    fn forward(&self, _: &model::Params<'_>, x: &Tensor) -> strata::Result<Tensor> {
        Ok(x.shallow_clone())
    }
}

#[test]
fn builder_refuses_duplicate_names_and_bad_configs() {
    let mut b = Builder::new();
    let mut u = b.unit("a");
    u.param("w", &[2], model::Init::Zeros, model::TpRole::Replicated);
    u.param("w", &[2], model::Init::Zeros, model::TpRole::Replicated);
    u.finish(Identity);
    assert!(b.build().err().unwrap().to_string().contains("declared twice"));
    assert!(Builder::new().build().is_err(), "a model without units");
    let mut b = Builder::new();
    let err = model::gpt(&GptConfig::new(11, 6, 1, 3, 8), &mut b).unwrap_err();
    assert!(err.to_string().contains("not divisible"), "{err}");
    let err =
        model::llama(&LlamaConfig { layers: 0, ..LlamaConfig::new(11, 6, 1, 2, 8) }, &mut Builder::new()).unwrap_err();
    assert!(err.to_string().contains("layers must be positive"), "{err}");
    let err =
        model::llama(&LlamaConfig { kv_heads: Some(3), ..LlamaConfig::new(11, 6, 1, 4, 16) }, &mut Builder::new())
            .unwrap_err();
    assert!(err.to_string().contains("kv_heads 3 must divide the 4 query heads"), "{err}");
    let huge = LlamaConfig { dim: 1 << 60, heads: 1 << 50, ..LlamaConfig::new(11, 6, 1, 2, 8) };
    let err = model::llama(&huge, &mut Builder::new()).unwrap_err();
    assert!(err.to_string().contains("larger than a model size may be"), "{err}");
    let err =
        model::llama(&LlamaConfig { rope_theta: f64::NAN, ..LlamaConfig::new(11, 6, 1, 2, 8) }, &mut Builder::new())
            .unwrap_err();
    assert!(err.to_string().contains("rope_theta must be positive"), "{err}");
    let mut b = Builder::new();
    let mut u = b.unit("a");
    u.param("w", &[1 << 40, 1 << 40], model::Init::Zeros, model::TpRole::Replicated);
    u.finish(Identity);
    assert!(b.build().err().unwrap().to_string().contains("more elements than an i64 counts"));
}

/// Under a weight-gradient queue, a micro-batch's backward leaves linear weights' gradients
/// for later and computes everything else; running the queue completes them exactly.
#[test]
fn deferred_weight_gradients_complete_the_same_gradients_later() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use strata::compute::deferred::{deferring, WeightGrads};
    use strata::compute::replace::{register_replace_pair, Replacement, Replacements};
    use strata::compute::UnitCompute;
    use strata::engine::Upstream;
    // A replacement linear that counts its calls: the deferred layers compute their forward
    // and input gradient through it.
    static PRODUCTS: AtomicUsize = AtomicUsize::new(0);
    register_replace_pair(
        "CountingLinear",
        &[Kind::Float],
        Replacement::Linear(Arc::new(|x: &Tensor, w: &Tensor, b: Option<&Tensor>| {
            PRODUCTS.fetch_add(1, Ordering::SeqCst);
            Ok(x.f_linear(w, b)?)
        })),
    );
    let counting = Replacements::select(Some(&["CountingLinear".to_string()])).unwrap();
    // f64; bf16 autocast over fp32 weights (the product in bf16, added to the fp32 gradient
    // as the cast's backward adds it); fp32 through the replacement.
    for (kind, autocast, replaced, tolerance) in [
        (Kind::Double, None, false, 1e-10),
        (Kind::Float, Some(Kind::BFloat16), false, 1e-6),
        (Kind::Float, None, true, 1e-5),
    ] {
        let build = || {
            let mut b = model::Builder::new();
            model::gpt(&model::GptConfig::new(16, 8, 1, 2, 8), &mut b).unwrap();
            let mut e = Engine::new(b.build().unwrap(), EngineConfig { kind, ..Default::default() }).unwrap();
            let units = e.spec().units.len();
            let replacements = if replaced { counting.clone() } else { Replacements::default() };
            e.set_compute(vec![UnitCompute { autocast, replacements, ..Default::default() }; units]).unwrap();
            e
        };
        let tokens = Tensor::from_slice(&[1i64, 5, 3, 7, 2, 9, 4, 0]).view([2, 4]);
        let targets = tokens.roll([1], [1]);
        let loss = |out: &Tensor| model::layers::cross_entropy(out, &targets).unwrap();
        let mut plain = build();
        let out = plain.forward(&tokens).unwrap();
        plain.backward(&loss(&out)).unwrap();
        let mut split = build();
        PRODUCTS.store(0, Ordering::SeqCst);
        let queue = WeightGrads::new();
        deferring(&queue, 0, || {
            let out = split.forward_micro(0, &tokens)?;
            split.backward_micro(0, Upstream::Loss(&loss(&out)))
        })
        .unwrap();
        let weight = "transformer.h.0.attn.c_attn.weight";
        let grad = |e: &Engine, name: &str| e.param_by_name(name).unwrap().grad();
        assert!(queue.pending() >= 4, "the block's linear layers queued their weight gradients");
        assert_eq!(grad(&split, weight).abs().sum(Kind::Double).double_value(&[]), 0.0, "not computed yet");
        let bias = "transformer.h.0.attn.c_attn.bias";
        assert!(grad(&split, bias).allclose(&grad(&plain, bias), tolerance, 1e-12, false), "biases are not deferred");
        let deferred = queue.pending();
        // Forward and input gradient, through the replacement where it is on.
        assert_eq!(PRODUCTS.load(Ordering::SeqCst), if replaced { 2 * deferred } else { 0 });
        queue.run(0).unwrap();
        assert_eq!(queue.pending(), 0);
        // The weight gradients are added into `.grad` in place, not through it.
        assert_eq!(PRODUCTS.load(Ordering::SeqCst), if replaced { 2 * deferred } else { 0 });
        for (name, p) in plain.named_params() {
            let other = grad(&split, name);
            assert_eq!(other.kind(), kind, "{name}: the gradient keeps the weight's dtype");
            assert!(p.grad().allclose(&other, tolerance, 1e-12, false), "{name} under {autocast:?}");
        }
    }
}

/// A step's first backward writes each unit's own gradients over whatever its slice of the
/// flat buffer held (zeroing them first is left out), while a tied weight's gradients, which
/// arrive in two units' backward, still accumulate from zero; later micro-batches add.
#[test]
fn a_first_backward_overwrites_own_gradients_and_accumulates_tied_ones() {
    for mode in [BackwardMode::UnitByUnit, BackwardMode::WholeGraph] {
        let grads_after = |stale: bool, micro_batches: i64| {
            let mut e = engine(tiny_gpt, Kind::Double, mode, 3);
            e.zero_grad().unwrap();
            if stale {
                // What a previous step left behind, everywhere but the tied embedding.
                for (name, p) in e.named_params() {
                    if name != "transformer.wte.weight" {
                        let _ = p.grad().fill_(f64::NAN);
                    }
                }
            }
            for m in 0..micro_batches {
                let (x, y) = batch(5 + m);
                let out = e.forward(&x).unwrap();
                e.backward(&cross_entropy(&out, &y).unwrap()).unwrap();
            }
            e.named_params().map(|(n, p)| (n.to_string(), p.grad().copy())).collect::<Vec<_>>()
        };
        let (clean, over_stale) = (grads_after(false, 1), grads_after(true, 1));
        for ((name, a), (_, b)) in clean.iter().zip(&over_stale) {
            assert!(a.isfinite().all().int64_value(&[]) == 1 && a.abs().sum(Kind::Double).double_value(&[]) > 0.0);
            assert!(a.equal(b), "{mode:?}: {name} is this step's gradient alone");
        }
        // A second micro-batch adds its gradients to the first's.
        let two = grads_after(false, 2);
        let (x, y) = batch(6);
        let mut second = engine(tiny_gpt, Kind::Double, mode, 3);
        let out = second.forward(&x).unwrap();
        second.backward(&cross_entropy(&out, &y).unwrap()).unwrap();
        for (((name, sum), (_, first)), (_, only)) in two.iter().zip(&clean).zip(second.named_params()) {
            let expected = first + only.grad();
            assert!((sum - &expected).abs().max().double_value(&[]) < 1e-12, "{mode:?}: {name} accumulates");
        }
    }
}

/// DeepSeek-V3's auxiliary-loss-free balancing on forced imbalance: one sparse layer of 4
/// experts, one per token, whose choice bias starts at [2, 0, 0, 0] so that expert 0 takes
/// every token. With an update rate the first step moves the bias by exactly one rate step
/// towards the idle experts, every later step by one step or none per expert, and the
/// loads spread; without, expert 0 keeps every token.
#[test]
fn choice_biases_move_towards_underloaded_experts() {
    use std::collections::BTreeMap;
    use strata::data::{Batch, Step};
    use strata::model::{MoeConfig, Scoring};
    use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
    let (rate_given, steps, tokens) = (0.05, 30, 18);
    let run = |rate: f64| {
        let moe = MoeConfig {
            scoring: Scoring::Sigmoid,
            choice_bias: true,
            norm_topk: true,
            bias_update_rate: rate,
            ..MoeConfig::new(4, 1, 8)
        };
        let mut b = Builder::new();
        model::llama(&LlamaConfig { moe: Some(moe), ..LlamaConfig::new(11, 6, 1, 2, 8) }, &mut b).unwrap();
        let mut engine = Engine::new(b.build().unwrap(), EngineConfig { seed: 3, ..Default::default() }).unwrap();
        let find = |suffix: &str| engine.named_params().position(|(n, _)| n.ends_with(suffix)).unwrap();
        let (bias, router) = (find("e_score_correction_bias"), find("mlp.gate.weight"));
        // A router whose scores spread over (0, 1), so that balanced biases spread the tokens.
        let spread = strata::engine::with_seed(1, || Tensor::randn([4, 8], (Kind::Float, tch::Device::Cpu)));
        let values = BTreeMap::from([
            (model::ParamId(bias), Tensor::from_slice(&[2.0f32, 0.0, 0.0, 0.0])),
            (model::ParamId(router), spread),
        ]);
        engine.set_params(&values).unwrap();
        let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
        let mut trainer = strata::train::Trainer::new(engine, optimizer, LrSchedule::Constant, None);
        let mut history = vec![];
        for step in 0..steps {
            let micro = |k: i64| {
                let (x, y) = batch(100 * step + k);
                Batch::new(x, y).unwrap()
            };
            let report = trainer.train_step(&Step::new(step as usize, vec![micro(0), micro(1)])).unwrap();
            let value = trainer.engine().param(model::ParamId(bias)).detach().copy();
            history.push((Vec::<f64>::try_from(&value.to_kind(Kind::Double)).unwrap(), report.experts.unwrap()));
        }
        history
    };
    let moved = run(rate_given);
    let first: Vec<f64> = moved[0].0.iter().zip([2.0, 0.0, 0.0, 0.0]).map(|(b, was)| b - was).collect();
    let expected = [-rate_given, rate_given, rate_given, rate_given];
    assert!(first.iter().zip(expected).all(|(d, e)| (d - e).abs() < 1e-6), "first step moved the bias by {first:?}");
    for pair in moved.windows(2) {
        for (after, before) in pair[1].0.iter().zip(&pair[0].0) {
            let d = (after - before).abs();
            assert!(d < 1e-6 || (d - rate_given).abs() < 1e-6, "a step of {d}: {:?} to {:?}", pair[0].0, pair[1].0);
        }
    }
    // The last micro-batch's loads, late in the run: no expert takes every token any more.
    let late: Vec<i64> = moved[steps as usize - 5..].iter().map(|(_, r)| r.max_expert_tokens).collect();
    assert_eq!(moved[0].1.max_expert_tokens, tokens, "the imbalance is not forced");
    assert!(late.iter().all(|&m| m < tokens * 3 / 4), "still imbalanced: {late:?}");
    let kept = run(0.0);
    assert!(kept.iter().all(|(b, r)| b == &[2.0, 0.0, 0.0, 0.0] && r.max_expert_tokens == tokens));
}
