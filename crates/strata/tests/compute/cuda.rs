//! The CUDA paths on a GPU: the engine against the CPU, amp (autocast) and half, fp8 scaled
//! products, fused attention, streams and events, the caching allocator against the
//! ledger, NCCL on a one-rank group, and ranks sharing one GPU through the host-staged
//! backend. Every test says it is skipped, and passes, where no GPU is visible or the build's
//! libtorch has no CUDA (the same build on a machine with a GPU runs them).
use crate::common;

use crate::common::ranks::{assert_all_ok, run_ranks};
use crate::common::rel;
use std::time::Duration;
use strata::comm::{Comm, ProcessGroup, ReduceOp, Store, StoreServer};
use strata::compute::fp8::{self, Fp8Config, Fp8Unit};
use strata::compute::{self, UnitCompute};
use strata::data::{Batch, ClassifySet, LabeledText, RowSet, Step, Tokenizer};
use strata::engine::{memory, with_seed, Engine, EngineConfig};
use strata::model::{layers, GptConfig, LlamaConfig, ModelConfig};
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::parallel::{build_engine, RankLayout};
use strata::strategy::Strategy;
use strata::train::Trainer;
use strata_ext::cuda;
use strata_ext::kernels::{fp8_cast, row_col_amax, Fp8Scale};
use tch::{Device, Kind, Tensor};

/// The GPU to test on, holding the lock that runs these tests one at a time; `None` (with
/// a message) where there is none.
fn gpu(test: &str) -> Option<(Device, std::sync::MutexGuard<'static, ()>)> {
    if !(cuda::is_built() && tch::Cuda::is_available()) {
        eprintln!("{test}: skipped, no GPU visible to a build with CUDA");
        return None;
    }
    Some((Device::Cuda(0), crate::serial()))
}

const GPT: GptConfig = GptConfig::new(64, 32, 2, 4, 64);

/// Batches of 4 sequences, drawn on the CPU (the same for every device), placed on `device`.
fn steps(n: usize, device: Device) -> Vec<Step> {
    let tokens = with_seed(7, || Tensor::randint(GPT.vocab, [n as i64, 4, GPT.ctx + 1], (Kind::Int64, Device::Cpu)));
    (0..n)
        .map(|i| {
            let t = tokens.get(i as i64).to_device(device);
            let batch = Batch::new(t.narrow(1, 0, GPT.ctx), t.narrow(1, 1, GPT.ctx)).unwrap();
            Step::new(i, vec![batch])
        })
        .collect()
}

fn trainer(device: Device, strategy: &str) -> Trainer {
    trainer_of(ModelConfig::Gpt(GPT), device, strategy)
}

fn trainer_of(model: ModelConfig, device: Device, strategy: &str) -> Trainer {
    let strategy = Strategy::parse(strategy).unwrap();
    let spec = model.spec().unwrap();
    let config = EngineConfig { device, ..EngineConfig::default() };
    let mut engine = build_engine(spec, config, &strategy, &RankLayout::single()).unwrap();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    let mut t = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
    t.scaling = strategy.grad_scaling().unwrap();
    t
}

/// `to`'s parameters set to `from`'s (the devices' random generators differ).
fn copy_weights(from: &Trainer, to: &Trainer) {
    tch::no_grad(|| {
        for (name, value) in from.engine().named_params() {
            to.engine().param_by_name(name).unwrap().shallow_clone().copy_(value);
        }
    });
}

fn losses(t: &mut Trainer, steps: &[Step]) -> Vec<f64> {
    steps.iter().map(|s| t.train_step(s).unwrap().loss).collect()
}

/// Largest relative difference between the loss curves.
fn loss_gap(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| ((x - y) / y).abs()).fold(0.0, f64::max)
}

/// ‖θa − θb‖ / ‖θb‖ over all parameters as one vector.
fn weight_gap(a: &Trainer, b: &Trainer) -> f64 {
    let (mut diff, mut norm) = (0.0, 0.0);
    for (name, x) in a.engine().named_params() {
        let x = x.to_device(Device::Cpu).to_kind(Kind::Double);
        let y = b.engine().param_by_name(name).unwrap().to_device(Device::Cpu).to_kind(Kind::Double);
        diff += (&x - &y).square().sum(Kind::Double).double_value(&[]);
        norm += y.square().sum(Kind::Double).double_value(&[]);
    }
    (diff / norm).sqrt()
}

#[test]
fn the_engine_on_a_gpu_matches_the_cpu_in_fp32() {
    let Some((gpu, _serial)) = gpu("the_engine_on_a_gpu_matches_the_cpu_in_fp32") else { return };
    for strategy in ["[]", r#"[["checkpoint", ["GptBlock"]]]"#] {
        let (mut cpu, mut cuda) = (trainer(Device::Cpu, strategy), trainer(gpu, strategy));
        copy_weights(&cpu, &cuda);
        assert!(cuda.engine().named_params().all(|(_, p)| p.device() == gpu), "every parameter on the GPU");
        // Clipping that engages: the GPU clips where the gradients are, the CPU on the host.
        (cpu.grad_clip, cuda.grad_clip) = (Some(0.05), Some(0.05));
        let (on_cpu, on_gpu) = (steps(4, Device::Cpu), steps(4, gpu));
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for (c, g) in on_cpu.iter().zip(&on_gpu) {
            let (c, g) = (cpu.train_step(c).unwrap(), cuda.train_step(g).unwrap());
            losses.push((g.loss, c.loss));
            norms.push((g.grad_norm.unwrap(), c.grad_norm.unwrap()));
        }
        let gap = |pairs: &[(f64, f64)]| pairs.iter().map(|(g, c)| ((g - c) / c).abs()).fold(0.0, f64::max);
        let weights = weight_gap(&cuda, &cpu);
        eprintln!("{strategy}: (gpu, cpu) losses {losses:?}, norms {norms:?}; weights differ by {weights:.2e}");
        assert!(gap(&losses) < 1e-5 && gap(&norms) < 1e-5 && weights < 1e-5, "{strategy}: {weights:e}");
        assert!(norms.iter().all(|(_, c)| *c > 0.05), "clipping engaged");
        assert!(losses[3].1 < losses[0].1, "it trained");
        // A step waits for the device once: reading the loss and the norm at its end.
        cuda::count_syncs(true).unwrap();
        let before = cuda::syncs_counted();
        cuda.train_step(&on_gpu[0]).unwrap();
        let syncs = cuda::syncs_counted() - before;
        cuda::count_syncs(false).unwrap();
        assert_eq!(syncs, 1, "{strategy}: host-device synchronisations in a step");
    }
}

/// A BERT forward on a GPU reads nothing back on the host: its token types (checked against
/// the model on the host before the data reaches the device) are not read mid-forward.
#[test]
fn a_bert_forward_on_a_gpu_waits_for_nothing() {
    let Some((gpu, _serial)) = gpu("a_bert_forward_on_a_gpu_waits_for_nothing") else { return };
    let config = common::tiny_bert_classifier(32, 2, &["no", "yes"]);
    let records = [
        LabeledText { text: "good film".into(), pair: Some("good cast".into()), label: 1 },
        LabeledText { text: "bad".into(), pair: None, label: 0 },
    ];
    let set = ClassifySet::encode(&records, &Tokenizer::Bytes, 32, 0, "pairs").unwrap();
    let batch = set.batch(&[0, 1]).unwrap().to_device(gpu).unwrap();
    let spec = ModelConfig::Bert(config).spec().unwrap();
    let mut engine = Engine::new(spec, EngineConfig { device: gpu, ..EngineConfig::default() }).unwrap();
    engine.set_layout(batch.layout.as_ref());
    // The first forward compiles kernels and allocates; the second is counted.
    let _ = engine.evaluate(&batch.inputs).unwrap();
    cuda::count_syncs(true).unwrap();
    let before = cuda::syncs_counted();
    let logits = engine.evaluate(&batch.inputs).unwrap();
    let syncs = cuda::syncs_counted() - before;
    cuda::count_syncs(false).unwrap();
    assert_eq!(logits.size(), [2, 2]);
    assert_eq!(syncs, 0, "host-device synchronisations in a BERT forward");
}

/// `t`'s losses and gradient norms over `steps`, and its CUDA graph's replays.
fn curve(t: &mut Trainer, steps: &[&Step]) -> (Vec<f64>, Vec<f64>) {
    let reports: Vec<_> = steps.iter().map(|s| t.train_step(s).unwrap()).collect();
    (reports.iter().map(|r| r.loss).collect(), reports.iter().map(|r| r.grad_norm.unwrap()).collect())
}

#[test]
fn a_step_replayed_from_a_cuda_graph_trains_as_the_eager_step() {
    let Some((gpu, _serial)) = gpu("a_step_replayed_from_a_cuda_graph_trains_as_the_eager_step") else { return };
    let full = steps(6, gpu);
    // A step of other shapes (two sequences) runs eagerly between replays.
    let short = {
        let b = &full[0].micro_batches[0];
        Step::new(9, vec![Batch::new(b.inputs.narrow(0, 0, 2), b.targets.narrow(0, 0, 2)).unwrap()])
    };
    let order: Vec<&Step> = vec![&full[0], &full[1], &full[2], &full[3], &short, &full[4], &full[5]];
    let fused = r#"[["amp_native", {"dtype": "bf16"}], "module_replace", ["checkpoint", ["GptBlock"]]]"#;
    let fp8_current = r#"[["amp_native", {"dtype": "bf16"}], ["fp8", {"scaling": "current"}]]"#;
    let fp8_rowwise = r#"[["amp_native", {"dtype": "bf16"}], ["fp8", {"scaling": "rowwise"}]]"#;
    for strategy in ["[]", fused, fp8_current, fp8_rowwise] {
        let make = || {
            let mut t = trainer(gpu, strategy);
            // A learning rate that changes every step, and clipping that engages.
            t.schedule = LrSchedule::WarmupCosine { warmup: 3, total: 8, min_factor: 0.1 };
            t.grad_clip = Some(0.05);
            t
        };
        let (mut eager, mut again, mut graphed) = (make(), make(), make());
        graphed.capture_cuda_graph(2).unwrap();
        let (losses, norms) = curve(&mut eager, &order);
        let repeat = curve(&mut again, &order);
        let replayed = curve(&mut graphed, &order);
        assert_eq!(graphed.graph_replays(), 4, "{strategy}: steps 3, 4, 6 and 7 replay the graph");
        assert_eq!(graphed.optimizer().steps_taken(), 7, "{strategy}: a replay's update is counted");
        // Kernels that repeat exactly repeat under replay too; others stay within their own
        // run-to-run spread.
        let spread = loss_gap(&repeat.0, &losses).max(weight_gap(&again, &eager));
        let gap = loss_gap(&replayed.0, &losses).max(loss_gap(&replayed.1, &norms)).max(weight_gap(&graphed, &eager));
        eprintln!(
            "{strategy}: eager losses {losses:?}, replayed {:?}; gap {gap:.2e}, eager spread {spread:.2e}",
            replayed.0
        );
        assert!(
            gap <= 10.0 * spread,
            "{strategy}: replays differ from eager steps by {gap:e} (eager runs by {spread:e})"
        );
        if strategy == "[]" {
            assert_eq!(replayed.0, losses, "fp32 replays give the eager losses bit for bit");
        }
        assert!(losses[6] < losses[0] && norms.iter().all(|&n| n > 0.05), "{strategy}: it trained, clipped");
        // A replayed step waits for the device once, to read its losses and norm.
        cuda::count_syncs(true).unwrap();
        let before = cuda::syncs_counted();
        graphed.train_step(&full[0]).unwrap();
        let syncs = cuda::syncs_counted() - before;
        cuda::count_syncs(false).unwrap();
        assert_eq!((syncs, graphed.graph_replays()), (1, 5), "{strategy}: synchronisations of a replayed step");
    }
    // Where a step needs the host between its kernels, the capture is refused by name.
    let mut scaled = trainer(gpu, r#"[["amp_native", {"dtype": "fp16"}]]"#);
    let err = scaled.capture_cuda_graph(2).unwrap_err().to_string();
    assert!(err.contains("loss scaler"), "{err}");
    let mut fp8 = trainer(gpu, r#"[["amp_native", {"dtype": "bf16"}], "fp8"]"#);
    let err = fp8.capture_cuda_graph(2).unwrap_err().to_string();
    assert!(err.contains("delayed scaling"), "{err}");
}

#[test]
fn amp_and_half_on_a_gpu_stay_near_fp32_and_compute_in_low_precision() {
    let Some((gpu, _serial)) = gpu("amp_and_half_on_a_gpu_stay_near_fp32_and_compute_in_low_precision") else {
        return;
    };
    let batches = steps(4, gpu);
    let reference = losses(&mut trainer(gpu, "[]"), &batches);
    // Same seed, same device: every run starts from the same weights.
    for (strategy, bound) in [
        (r#"[["amp_native", {"dtype": "bf16"}]]"#, 2e-2),
        (r#"[["amp_native", {"dtype": "fp16"}]]"#, 5e-3),
        (r#"["half"]"#, 2e-2),
    ] {
        let got = losses(&mut trainer(gpu, strategy), &batches);
        let gap = loss_gap(&got, &reference);
        eprintln!("{strategy}: losses {got:?}, gap to fp32 {gap:.2e}");
        // Low precision shows (runs in fp32 on one GPU repeat exactly), and stays close.
        assert!(gap > 1e-6 && gap < bound, "{strategy}: gap {gap:e}");
    }
    // Autocast puts a unit's products in bf16 while its norms stay fp32.
    let bf16 = UnitCompute { autocast: Some(Kind::BFloat16), device_autocast: true, ..Default::default() };
    let x = Tensor::randn([8, 64], (Kind::Float, gpu));
    let w = Tensor::randn([32, 64], (Kind::Float, gpu));
    let (product, norm) = compute::run(&std::sync::Arc::new(bf16), Default::default(), false, || {
        Ok((x.linear::<Tensor>(&w, None), layers::layer_norm(&x, &w.get(0), &w.get(1), 1e-5)?))
    })
    .unwrap();
    assert_eq!((product.kind(), norm.kind()), (Kind::BFloat16, Kind::Float));
}

#[test]
fn fp8_products_on_a_gpu_stay_near_bf16_without_waiting_for_the_device() {
    let Some((gpu, _serial)) = gpu("fp8_products_on_a_gpu_stay_near_bf16_without_waiting_for_the_device") else {
        return;
    };
    if let Some(why) = fp8::unsupported_on(gpu) {
        eprintln!("fp8_products_on_a_gpu_stay_near_bf16_without_waiting_for_the_device: skipped, {why}");
        return;
    }
    let x = with_seed(1, || Tensor::randn([64, 128], (Kind::BFloat16, Device::Cpu))).to_device(gpu);
    let w = with_seed(2, || Tensor::randn([96, 128], (Kind::BFloat16, Device::Cpu)) * 0.1).to_device(gpu);
    let (x, w) = (x.set_requires_grad(true), w.set_requires_grad(true));
    let reference = x.linear::<Tensor>(&w, None);
    let want = Tensor::run_backward(&[&reference], &[&x, &w], false, false);
    let state = Fp8Unit::new(Fp8Config::default());
    let mut errors = [0.0; 3];
    for step in 0..3 {
        cuda::count_syncs(true).unwrap();
        let before = cuda::syncs_counted();
        let out = fp8::linear(&state, 0, true, &x, &w, None, Kind::BFloat16).unwrap();
        let got = Tensor::run_backward(&[&out], &[&x, &w], false, false);
        let during = cuda::syncs_counted() - before;
        state.lock().unwrap().end_step(None).unwrap();
        let ending = cuda::syncs_counted() - before - during;
        cuda::count_syncs(false).unwrap();
        assert_eq!((during, ending), (0, 1), "step {step}: the amaxes are read once, when the step ends");
        errors = [rel(&out, &reference), rel(&got[0], &want[0]), rel(&got[1], &want[1])];
    }
    let amax = x.abs().max().double_value(&[]);
    let meters = &state.lock().unwrap().layers[0];
    assert!((meters.input.history.back().unwrap() - amax).abs() < 1e-6, "the device amax reached the history");
    assert!((meters.input.scale - 448.0 / amax).abs() < 1e-3);
    // Quantised for real (bf16 itself would be far closer), and within fp8's rounding.
    eprintln!("fp8 against bf16 on the GPU: relative errors {errors:?}");
    assert!(errors.iter().all(|&e| e > 1e-3), "{errors:?}");
    assert!(errors[0] < 0.05 && errors[1] < 0.1 && errors[2] < 0.1, "{errors:?}");
    // In a model: fp8 linears train as bf16 does.
    let batches = steps(4, gpu);
    let bf16 = losses(&mut trainer(gpu, r#"[["amp_native", {"dtype": "bf16"}]]"#), &batches);
    let with_fp8 = losses(
        &mut trainer(gpu, r#"[["fp8", {"exclude": ["lm_head"]}], ["amp_native", {"dtype": "bf16"}]]"#),
        &batches,
    );
    let gap = loss_gap(&with_fp8, &bf16);
    eprintln!("fp8 model losses {with_fp8:?} against bf16 {bf16:?}: gap {gap:.2e}");
    assert!(gap > 1e-5 && gap < 5e-2, "{gap:e}");
}

#[test]
fn fp8_casts_on_a_gpu_equal_the_composite_ops_in_one_pass() {
    let Some((gpu, _serial)) = gpu("fp8_casts_on_a_gpu_equal_the_composite_ops_in_one_pass") else { return };
    if let Some(why) = fp8::unsupported_on(gpu) {
        eprintln!("fp8_casts_on_a_gpu_equal_the_composite_ops_in_one_pass: skipped, {why}");
        return;
    }
    // Rows and columns off the 32 × 32 tiles; values past the formats' largest once scaled.
    let x = with_seed(3, || Tensor::randn([50, 70], (Kind::Float, Device::Cpu))).to_device(gpu) * 300.0;
    for (kind, max, e5m2) in [(Kind::Float8e4m3fn, 448.0, false), (Kind::Float8e5m2, 57344.0, true)] {
        // The largest inputs land at several times the format's largest value.
        let scale = max / 300.0;
        let (q, qt, amax) = fp8_cast(&x, Fp8Scale::Given(scale), e5m2, true).unwrap().expect("served on a GPU");
        let composite = (&x * scale).clamp(-max, max).to_kind(kind);
        let as_float = |t: &Tensor| t.to_kind(Kind::Float);
        assert_eq!(q.kind(), kind);
        assert!(as_float(&q).equal(&as_float(&composite)), "{kind:?}: the cast equals the composite's");
        assert!(as_float(&qt.unwrap()).equal(&as_float(&composite).tr().contiguous()), "{kind:?}: its transpose");
        let largest = x.abs().max();
        assert_eq!(amax.double_value(&[]), largest.double_value(&[]), "{kind:?}: the amax");
        assert!(as_float(&q).abs().max().double_value(&[]) == max, "{kind:?}: saturated, not infinite");
        // The same scale read on the device (current scaling) casts the same.
        let at = Tensor::full([], scale, (Kind::Float, gpu));
        let (q_at, _, _) = fp8_cast(&x, Fp8Scale::At(&at), e5m2, true).unwrap().expect("served");
        assert!(as_float(&q_at).equal(&as_float(&q)), "{kind:?}: a scale read on the device");
    }
    // Rowwise: every row's and column's maximum in one pass (a zero row and column among
    // them), then each copy scaled along its own dimension, in fp32 and bf16, whole tiles
    // and ragged ones.
    for (rows, cols) in [(50, 70), (128, 192)] {
        for dtype in [Kind::Float, Kind::BFloat16] {
            let x = with_seed(6, || Tensor::randn([rows, cols], (Kind::Float, Device::Cpu)) * 300.0);
            let _ = x.get(1).zero_();
            let _ = x.narrow(1, 2, 1).zero_();
            let x = x.to_kind(dtype).to_device(gpu);
            let (row_amax, col_amax) = row_col_amax(&x).unwrap().expect("served on a GPU");
            let along = |d: i64| x.abs().amax([d], false).to_kind(Kind::Float);
            assert!(row_amax.equal(&along(1)) && col_amax.equal(&along(0)), "{dtype:?} {rows}×{cols}: the maxima");
            // Scales with a row and a column past E4M3's largest once applied.
            let (row_scale, col_scale) =
                (row_amax.clamp_min(1.0).reciprocal() * 600.0, col_amax.clamp_min(1.0).reciprocal() * 500.0);
            let scales = Fp8Scale::Rowwise { rows: &row_scale, cols: &col_scale };
            let (q, qt, _) = fp8_cast(&x, scales, false, true).unwrap().expect("served on a GPU");
            let wide = x.to_kind(Kind::Float);
            let e4m3 = |t: Tensor| t.clamp(-448.0, 448.0).to_kind(Kind::Float8e4m3fn).to_kind(Kind::Float);
            let (want_q, want_qt) =
                (e4m3(&wide * row_scale.reshape([-1, 1])), e4m3(&wide * &col_scale).tr().contiguous());
            let (got_q, got_qt) = (q.to_kind(Kind::Float), qt.unwrap().to_kind(Kind::Float));
            assert!(got_q.equal(&want_q), "{dtype:?} {rows}×{cols}: the row-scaled copy");
            assert!(got_qt.equal(&want_qt), "{dtype:?} {rows}×{cols}: the column-scaled transpose");
            assert!(!got_q.equal(&got_qt.tr()), "{dtype:?} {rows}×{cols}: the two copies take different scales");
        }
    }
    // Current and rowwise fp8 linears on the GPU: the same products as on the CPU's
    // emulation, forward and backward, from the same operands.
    let w = with_seed(4, || Tensor::randn([48, 80], (Kind::Float, Device::Cpu))) * 0.1;
    let x = with_seed(5, || Tensor::randn([64, 80], (Kind::Float, Device::Cpu)));
    for scaling in [fp8::Fp8Scaling::Current, fp8::Fp8Scaling::Rowwise] {
        let run = |device: Device| {
            let (x, w) = (x.to_device(device).set_requires_grad(true), w.to_device(device).set_requires_grad(true));
            let state = Fp8Unit::new(Fp8Config { scaling, ..Default::default() });
            let out = fp8::linear(&state, 0, true, &x, &w, None, Kind::Float).unwrap();
            let grads = Tensor::run_backward(&[&out], &[&x, &w], false, false);
            [out, grads[0].shallow_clone(), grads[1].shallow_clone()].map(|t| t.to_device(Device::Cpu))
        };
        let (on_gpu, on_cpu) = (run(gpu), run(Device::Cpu));
        let gaps: Vec<f64> = on_gpu.iter().zip(&on_cpu).map(|(g, c)| rel(g, c)).collect();
        eprintln!("{scaling:?} fp8 linear, GPU against the CPU (output, input grad, weight grad): {gaps:?}");
        // The GPU's fp8 matrix units accumulate with fewer bits than fp32 (1e-4 apart,
        // measured), and its rowwise products come out in bf16; the quantisation itself
        // moves the result by a few percent, so a wrong scale could not pass.
        let bound = if scaling == fp8::Fp8Scaling::Rowwise { 8e-3 } else { 1e-3 };
        assert!(gaps.iter().all(|&g| g < bound), "{scaling:?}: {gaps:?}");
    }
}

#[test]
fn replaced_modules_on_a_gpu_match_the_composites_forward_and_backward() {
    let Some((gpu, _serial)) = gpu("replaced_modules_on_a_gpu_match_the_composites_forward_and_backward") else {
        return;
    };
    for module in common::replaced_modules(gpu) {
        module.check(gpu);
    }
    // Under bf16 autocast the fused norm comes in bf16, as the product after it casts the
    // composite's fp32 norm; the residual sum stays fp32.
    let amp = std::sync::Arc::new(UnitCompute {
        autocast: Some(Kind::BFloat16),
        device_autocast: true,
        replacements: strata::compute::replace::Replacements::select(None).unwrap(),
        ..Default::default()
    });
    let draw = |seed: i64, kind: Kind| {
        with_seed(seed, || Tensor::randn([4, 16, 64], (Kind::Float, Device::Cpu))).to_kind(kind).to_device(gpu)
    };
    let (x, r, w, b) = (
        draw(1, Kind::Float),
        draw(2, Kind::BFloat16),
        draw(3, Kind::Float).get(0).get(0),
        draw(4, Kind::Float).get(0).get(0),
    );
    let (s, y) =
        compute::run(&amp, Default::default(), false, || layers::add_layer_norm(&x, &r, &w, &b, 1e-5)).unwrap();
    let composite = layers::layer_norm(&(&x + &r), &w, &b, 1e-5).unwrap();
    assert_eq!((s.kind(), y.kind()), (Kind::Float, Kind::BFloat16));
    let error = rel(&y, &composite.to_kind(Kind::BFloat16));
    assert!(error < 1e-2, "{error:e}");
    // A norm that only a product reads: the same kernel without the sum, in bf16.
    let y =
        compute::run(&amp, Default::default(), false, || layers::layer_norm_into_product(&x, &w, &b, 1e-5)).unwrap();
    let composite = layers::layer_norm(&x, &w, &b, 1e-5).unwrap();
    assert_eq!(y.kind(), Kind::BFloat16);
    let error = rel(&y, &composite.to_kind(Kind::BFloat16));
    assert!(error < 1e-2, "{error:e}");
    // FusedLinearGrad: the weight's gradient in fp32 from the bf16 operands and the bias's,
    // from one product; without it the weight's gradient comes rounded to bf16.
    let without: Vec<String> =
        strata::compute::replace::pair_names().into_iter().filter(|n| n != "FusedLinearGrad").collect();
    let (xb, seed) = (x.to_kind(Kind::BFloat16), draw(6, Kind::Float).narrow(2, 0, 32));
    let exact_w = seed
        .to_kind(Kind::BFloat16)
        .to_kind(Kind::Double)
        .reshape([-1, 32])
        .tr()
        .mm(&xb.to_kind(Kind::Double).reshape([-1, 64]));
    let exact_b = seed.to_kind(Kind::BFloat16).to_kind(Kind::Double).reshape([-1, 32]).sum_dim_intlist(
        [0].as_slice(),
        false,
        Kind::Double,
    );
    for (pairs, fused) in [(None, true), (Some(without.as_slice()), false)] {
        let policy = std::sync::Arc::new(UnitCompute {
            replacements: strata::compute::replace::Replacements::select(pairs).unwrap(),
            ..(*amp).clone()
        });
        let weight = draw(7, Kind::Float).reshape([-1, 64]).narrow(0, 0, 32).set_requires_grad(true);
        let bias = draw(8, Kind::Float).get(0).get(0).narrow(0, 0, 32).set_requires_grad(true);
        let y = compute::run(&policy, Default::default(), false, || layers::linear(&x, &weight, Some(&bias))).unwrap();
        assert_eq!(y.kind(), Kind::BFloat16);
        let reference =
            xb.to_kind(Kind::Float).matmul(&weight.to_kind(Kind::BFloat16).to_kind(Kind::Float).tr()) + &bias;
        let error = rel(&y, &reference.to_kind(Kind::BFloat16));
        assert!(error < 1e-2, "fused {fused}: output {error:e}");
        (y.to_kind(Kind::Float) * &seed).sum(Kind::Float).backward();
        let (ew, eb) =
            (rel(&weight.grad().to_kind(Kind::Double), &exact_w), rel(&bias.grad().to_kind(Kind::Double), &exact_b));
        eprintln!("linear, FusedLinearGrad {fused}: weight gradient {ew:.2e}, bias gradient {eb:.2e}");
        assert_eq!(weight.grad().kind(), Kind::Float);
        if fused {
            assert!(ew < 1e-5 && eb < 1e-5, "weight {ew:e}, bias {eb:e}");
        } else {
            assert!(ew > 1e-4, "the composite's bf16 weight gradient: {ew:e}");
        }
    }
    // Whole models: with every pair (fused attention, Strata's CUDA kernels for the
    // activations, rotary positions, residual sums with their norms and the loss), the
    // losses of the composites, in fp32 and in bf16 autocast.
    let batches = steps(3, gpu);
    let llama = ModelConfig::Llama(LlamaConfig::new(GPT.vocab, GPT.ctx, 2, 4, 64));
    for ((name, model), amp, bound) in [
        (("gpt", ModelConfig::Gpt(GPT)), "", 1e-5),
        (("llama", llama.clone()), "", 1e-5),
        (("gpt", ModelConfig::Gpt(GPT)), r#"["amp_native", {"dtype": "bf16"}], "#, 2e-2),
        (("llama", llama), r#"["amp_native", {"dtype": "bf16"}], "#, 2e-2),
    ] {
        let mut composite = trainer_of(model.clone(), gpu, &format!("[{}]", amp.trim_end_matches(", ")));
        let mut fused = trainer_of(model.clone(), gpu, &format!(r#"[{amp}"module_replace"]"#));
        copy_weights(&composite, &fused);
        let (a, b) = (losses(&mut fused, &batches), losses(&mut composite, &batches));
        let gap = loss_gap(&a, &b);
        eprintln!("{name} {amp}: fused {a:?}, composites {b:?}, gap {gap:.2e}");
        assert!(gap < bound, "{gap:e}");
    }
}

/// Queries, keys and values `[B, H, T, D]` (keys and values `kv_heads` heads) and sinks,
/// drawn on the CPU, in `kind` on the GPU, each a leaf taking gradients.
fn attention_inputs(gpu: Device, kind: Kind, heads: i64, kv_heads: i64, d: i64) -> [Tensor; 4] {
    let (b, t) = (2, 200);
    let draw = |seed: i64, shape: &[i64]| {
        with_seed(seed, || Tensor::randn(shape, (Kind::Float, Device::Cpu))).to_kind(kind).to_device(gpu)
    };
    // Queries and keys laid out `[B, T, H, D]` and viewed as `[B, H, T, D]`, as projections
    // give them: the kernel reads them in place.
    let q = draw(1, &[b, t, heads, d]).transpose(1, 2).set_requires_grad(true);
    let k = draw(2, &[b, t, kv_heads, d]).transpose(1, 2).set_requires_grad(true);
    let v = draw(3, &[b, kv_heads, t, d]).set_requires_grad(true);
    let sinks = draw(4, &[heads]).to_kind(Kind::Float).set_requires_grad(true);
    [q, k, v, sinks]
}

#[test]
fn strata_s_attention_kernel_matches_the_composite_with_windows_caps_and_sinks() {
    let test = "strata_s_attention_kernel_matches_the_composite_with_windows_caps_and_sinks";
    let Some((gpu, _serial)) = gpu(test) else { return };
    for (kind, d, window, softcap, sinks) in [
        (Kind::BFloat16, 64, Some(40), None, false),
        (Kind::BFloat16, 128, None, Some(30.0), false),
        (Kind::BFloat16, 64, Some(100), None, true),
        (Kind::Half, 128, Some(70), Some(20.0), true),
        (Kind::BFloat16, 128, None, None, false),
    ] {
        let (heads, kv_heads) = (4, 2);
        let [q, k, v, sink] = attention_inputs(gpu, kind, heads, kv_heads, d);
        let scale = 0.3 / (d as f64).sqrt();
        let own = strata_ext::kernels::attention(&q, &k, &v, sinks.then_some(&sink), scale, softcap, window)
            .unwrap()
            .expect("the kernel serves bf16 and fp16 on this GPU");
        // The kernel writes `[B, T, H, D]`: the heads merge without a copy.
        assert!(own.transpose(1, 2).is_contiguous());
        let seed = with_seed(5, || Tensor::randn(own.size(), (Kind::Float, Device::Cpu))).to_device(gpu);
        let leaves = if sinks { vec![&q, &k, &v, &sink] } else { vec![&q, &k, &v] };
        let grads = |out: &Tensor| {
            let g = Tensor::run_backward(&[(out.to_kind(Kind::Float) * &seed).sum(Kind::Float)], &leaves, false, false);
            g.into_iter().map(|g| g.to_kind(Kind::Float)).collect::<Vec<_>>()
        };
        let own_grads = grads(&own);
        // The composite in fp32 from the same values, keys and values repeated per head.
        let (qf, kf, vf) = (q.to_kind(Kind::Float), k.to_kind(Kind::Float), v.to_kind(Kind::Float));
        let repeat = |x: &Tensor| x.repeat_interleave_self_int(heads / kv_heads, 1, None);
        let options =
            layers::AttentionOptions { scale: Some(scale), window, softcap, bidirectional: false, chunk: None };
        let terms = layers::ScoreTerms { bias: None, sinks: sinks.then_some(&sink) };
        let composite = layers::attention(&qf, &repeat(&kf), &repeat(&vf), &options, None, terms, None).unwrap();
        let composite_grads = grads(&composite);
        let case = format!("{kind:?} d {d} window {window:?} cap {softcap:?} sinks {sinks}");
        let error = rel(&own.to_kind(Kind::Float), &composite);
        eprintln!("attention {case}: output {error:.2e}");
        assert!(error < 2e-2, "{case}: output {error:e}");
        for (name, (a, b)) in ["q", "k", "v", "sinks"].iter().zip(own_grads.iter().zip(&composite_grads)) {
            let error = rel(a, b);
            eprintln!("attention {case}: gradient of {name} {error:.2e}");
            assert!(error < 2e-2, "{case}: gradient of {name} {error:e}");
        }
        // Under module_replace the layer takes the kernel where libtorch's decline (the same
        // values), and the composite without it.
        let policy = std::sync::Arc::new(UnitCompute {
            replacements: strata::compute::replace::Replacements::select(None).unwrap(),
            ..Default::default()
        });
        let (kr, vr) = (repeat(&k), repeat(&v));
        let routed = compute::run(&policy, Default::default(), false, || {
            layers::attention(&q, &kr, &vr, &options, None, terms, None)
        })
        .unwrap();
        if window.is_some() || softcap.is_some() || sinks {
            assert!(routed.transpose(1, 2).is_contiguous(), "{case}: Strata's kernel ran");
        }
        assert!(rel(&routed.to_kind(Kind::Float), &composite) < 2e-2, "{case}: routed");
    }
}

#[test]
fn grouped_expert_products_match_a_product_per_expert() {
    let test = "grouped_expert_products_match_a_product_per_expert";
    let Some((gpu, _serial)) = gpu(test) else { return };
    let counts = [5i64, 0, 17, 3];
    let rows: i64 = counts.iter().sum();
    let x = with_seed(1, || Tensor::randn([rows, 64], (Kind::Float, Device::Cpu)))
        .to_kind(Kind::BFloat16)
        .to_device(gpu)
        .set_requires_grad(true);
    let weights: Vec<Tensor> = (0..counts.len() as i64)
        .map(|e| {
            with_seed(10 + e, || Tensor::randn([32, 64], (Kind::Float, Device::Cpu)))
                .to_kind(Kind::BFloat16)
                .to_device(gpu)
                .set_requires_grad(true)
        })
        .collect();
    let refs: Vec<&Tensor> = weights.iter().collect();
    let grouped = layers::grouped_linear(&x, &refs, &counts).unwrap().expect("a grouped product in bf16 on a GPU");
    let mut start = 0;
    let looped = Tensor::cat(
        &counts
            .iter()
            .zip(&weights)
            .map(|(&count, w)| {
                let out = x.narrow(0, start, count).linear::<&Tensor>(w, None);
                start += count;
                out
            })
            .collect::<Vec<_>>(),
        0,
    );
    let error = rel(&grouped.to_kind(Kind::Float), &looped.to_kind(Kind::Float));
    assert!(error < 1e-2, "output {error:e}");
    let seed = with_seed(2, || Tensor::randn([rows, 32], (Kind::Float, Device::Cpu))).to_device(gpu);
    let mut leaves: Vec<&Tensor> = vec![&x];
    leaves.extend(&weights);
    let grads = |out: &Tensor| {
        Tensor::run_backward(&[(out.to_kind(Kind::Float) * &seed).sum(Kind::Float)], &leaves, false, false)
    };
    let (a, b) = (grads(&grouped), grads(&looped));
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        if i == 2 {
            // The expert that received no rows: a zero gradient, not a missing one.
            assert!(a.defined() && a.abs().max().double_value(&[]) == 0.0, "the idle expert's gradient");
            continue;
        }
        let error = rel(&a.to_kind(Kind::Float), &b.to_kind(Kind::Float));
        assert!(error < 1e-2, "gradient {i}: {error:e}");
    }
}

#[test]
fn streams_and_events_order_work_between_streams() {
    let Some((gpu, _serial)) = gpu("streams_and_events_order_work_between_streams") else { return };
    let Device::Cuda(index) = gpu else { unreachable!() };
    let main = cuda::Stream::current(index).unwrap();
    let side = cuda::Stream::from_pool(index, false).unwrap();
    assert_ne!(main, side);
    // A long chain on the side stream, then a copy on the main stream that waits for it.
    let x = Tensor::zeros([1 << 22], (Kind::Float, gpu));
    side.make_current().unwrap();
    for _ in 0..50 {
        let _ = x.shallow_clone().f_add_scalar_(1.0).unwrap();
    }
    let produced = cuda::Event::new(false).unwrap();
    produced.record(&side).unwrap();
    main.make_current().unwrap();
    produced.wait(&main).unwrap();
    let y = &x * 2.0;
    main.synchronize().unwrap();
    assert!(produced.query().unwrap(), "the main stream waited for the side stream's event");
    assert_eq!(y.min().double_value(&[]), 100.0, "the copy saw all 50 additions");
    // Timing events measure the time between them.
    let (a, b) = (cuda::Event::new(true).unwrap(), cuda::Event::new(true).unwrap());
    a.record(&main).unwrap();
    let m = x.view([2048, 2048]);
    let _ = m.matmul(&m);
    b.record(&main).unwrap();
    b.synchronize().unwrap();
    // A 2048² product between the two events: the device time is not zero.
    assert!(a.elapsed_ms(&b).unwrap() > 0.0);
}

#[test]
fn the_caching_allocator_holds_what_the_ledger_counts() {
    let Some((gpu, _serial)) = gpu("the_caching_allocator_holds_what_the_ledger_counts") else { return };
    let Device::Cuda(index) = gpu else { unreachable!() };
    let before = cuda::memory_stats(index).unwrap().allocated as u64;
    let mut t = trainer(gpu, "[]");
    let states = memory::allocator_current(gpu).unwrap() - before;
    let counted = t.engine().ledger().report().get(&strata::engine::Placement::Device).map_or(0, |r| r.current);
    eprintln!("model states: allocator {states} bytes, ledger {counted} bytes");
    // Every byte the ledger counts is allocated; the allocator's rounding (512-byte blocks)
    // adds little.
    assert!(states >= counted && states <= counted + counted / 50 + (1 << 16), "{states} vs {counted}");
    // A step's peak: model states plus activations, all counted by the allocator.
    let report = t.train_step(&steps(1, gpu)[0]).unwrap();
    let peak = report.allocator_peak_bytes.unwrap();
    assert!(peak > t.engine().ledger().model_state_peak(), "{peak}");
}

/// Clipping on the GPU reads each gradient where it is: its norm allocates no copy of the
/// gradients (an f64 reduction of fp32 ones would write an f64 copy of each first) and is
/// the f64 norm within fp32 accumulation's rounding.
#[test]
fn clipping_on_a_gpu_reduces_the_gradients_without_copying_them() {
    let Some((gpu, _serial)) = gpu("clipping_on_a_gpu_reduces_the_gradients_without_copying_them") else { return };
    let mut t = trainer(gpu, "[]");
    // A step leaves its gradients in the flat buffers (the next backward overwrites them).
    losses(&mut t, &steps(1, gpu));
    let grads: Vec<Tensor> = t.engine().named_params().map(|(_, p)| p.grad()).filter(Tensor::defined).collect();
    let grad_bytes: u64 = grads.iter().map(memory::tensor_bytes).sum();
    let expected = grads
        .iter()
        .map(|g| g.to_device(Device::Cpu).to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[]))
        .sum::<f64>()
        .sqrt();
    let before = memory::allocator_current(gpu).unwrap();
    memory::reset_allocator_peak(gpu);
    let norm = t.optimizer_mut().clip_grad_norm_on_device(1.0).unwrap().unwrap().double_value(&[]);
    let extra = memory::allocator_peak(gpu).unwrap() - before;
    eprintln!(
        "gradient norm {norm} (f64 on the host {expected}); {extra} bytes allocated beside {grad_bytes} of gradients"
    );
    assert!(expected > 0.0 && ((norm - expected) / expected).abs() < 1e-6, "{norm} vs {expected}");
    assert!(extra < grad_bytes / 8, "the norm allocated {extra} bytes beside {grad_bytes} of gradients");
}

/// A step's scalars are read back by a copy queued behind the work so far: starting the read
/// waits for nothing and finishing it waits once, so work queued between the two (a step's
/// update) keeps the device busy while the host waits.
#[test]
fn scalars_are_read_back_by_a_queued_copy() {
    let Some((gpu, _serial)) = gpu("scalars_are_read_back_by_a_queued_copy") else { return };
    let values = [
        Tensor::from(2.5f32).to_device(gpu),
        Tensor::from(-3i64).to_device(gpu),
        Tensor::ones([1, 1], (Kind::BFloat16, gpu)),
    ];
    cuda::count_syncs(true).unwrap();
    let before = cuda::syncs_counted();
    let reading = compute::ScalarRead::start(&values).unwrap();
    let when_started = cuda::syncs_counted() - before;
    let queued = matches!(reading, compute::ScalarRead::Queued { .. });
    let read = reading.finish().unwrap();
    let in_all = cuda::syncs_counted() - before;
    cuda::count_syncs(false).unwrap();
    assert!(queued && (when_started, in_all) == (0, 1), "synchronisations: {when_started} starting, {in_all} in all");
    assert_eq!(read, [2.5, -3.0, 1.0]);
    // On the CPU the values are there at once.
    let on_cpu = compute::ScalarRead::start(&[Tensor::from(7.0f64)]).unwrap();
    assert!(matches!(on_cpu, compute::ScalarRead::Ready(ref v) if v == &[7.0]));
}

/// A kernel trace on a GPU holds the device's kernels and copies with their times.
#[test]
fn kernel_traces_record_the_device_s_kernels_and_copies() {
    let Some((gpu, _serial)) = gpu("kernel_traces_record_the_device_s_kernels_and_copies") else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let m = Tensor::ones([1024, 1024], (Kind::Float, gpu));
    strata::profile::kernels::start(true).unwrap();
    let product = m.matmul(&m).sum(Kind::Float).to_device(Device::Cpu);
    strata::profile::kernels::save(&path).unwrap();
    assert_eq!(product.double_value(&[]), 1024.0f64.powi(3));
    let ms = strata::profile::kernels::device_ms_by_name(&path).unwrap();
    eprintln!("device ms by kernel: {ms:?}");
    assert!(ms.keys().any(|k| k.starts_with("Memcpy DtoH")), "the copy to the host: {ms:?}");
    assert!(ms.iter().filter(|(k, _)| !k.starts_with("Memcpy")).count() >= 2, "the product and the sum: {ms:?}");
    assert!(ms.values().all(|&t| t > 0.0 && t < 1e3), "{ms:?}");
}

/// Offload's host buffers (parameter copies, gradients, and with `delayed_update` the
/// gradients' twins) are page-locked with `pin_memory` and counted so in the ledger; without
/// it nothing is; the optimizer state, updated on the host, is not.
#[test]
fn offloads_host_buffers_are_page_locked_and_counted() {
    let Some((gpu, _serial)) = gpu("offloads_host_buffers_are_page_locked_and_counted") else { return };
    use strata::engine::{Category, Placement as Where};
    for (pin, delayed) in [(true, false), (true, true), (false, false)] {
        let strategy = format!(
            r#"[["offload", {{"params": "none", "optimizer": "cpu", "policy": "static", "pin_memory": {pin}, "delayed_update": {delayed}}}]]"#
        );
        let mut t = trainer(gpu, &strategy);
        losses(&mut t, &steps(2, gpu));
        let report = t.engine().ledger().report();
        let host = &report[&Where::Host];
        let buffers = host.by_category[&Category::Params] + host.by_category[&Category::Grads];
        assert_eq!(host.pinned, if pin { buffers } else { 0 }, "{strategy}: {host:?}");
    }
}

/// A unit that offload keeps on the host computes there (PatrickStar's `use_cpu_embedding`):
/// the LLaMA's embedding keeps its buffers on the CPU, takes the token ids there and hands
/// its output to the GPU, and the run follows the one that keeps everything on the GPU
/// (both draw their initial values on the GPU).
#[test]
fn an_embedding_kept_on_the_host_computes_there_beside_a_gpu() {
    let Some((gpu, _serial)) = gpu("an_embedding_kept_on_the_host_computes_there_beside_a_gpu") else { return };
    let llama = || ModelConfig::Llama(LlamaConfig::new(GPT.vocab, GPT.ctx, 2, 4, 64));
    // No device budget: the rest stays on the GPU.
    let host_embedding = r#"[["offload", {"host_units": ["embedding"]}]]"#;
    let (mut plain, mut offloaded) = (trainer_of(llama(), gpu, "[]"), trainer_of(llama(), gpu, host_embedding));
    let storage = offloaded.engine().storage();
    assert_eq!(storage[0].flat.device(), Device::Cpu, "the embedding's parameters");
    assert_eq!(storage[0].grad.device(), Device::Cpu, "the embedding's gradient");
    assert!(storage[1..].iter().all(|s| s.flat.device() == gpu), "the other units compute on the GPU");
    let on_gpu = steps(4, gpu);
    // A copy: the parameter itself lives on the host, where `to_device` would alias it.
    let embedding = |t: &Trainer| t.engine().param_by_name("model.embed_tokens.weight").unwrap().copy();
    let before = embedding(&offloaded);
    let (want, got) = (losses(&mut plain, &on_gpu), losses(&mut offloaded, &on_gpu));
    let (gap, weights) = (loss_gap(&got, &want), weight_gap(&offloaded, &plain));
    eprintln!("losses {got:?} against {want:?}: {gap:.2e}; weights differ by {weights:.2e}");
    assert!(gap < 1e-5 && weights < 1e-5, "{gap:e} {weights:e}");
    assert!(!embedding(&offloaded).equal(&before), "the embedding on the host was updated");
    let transfers = offloaded.engine().ledger().transfers();
    assert_eq!((transfers.to_device, transfers.to_host), (0, 0), "no state moves between host and GPU");
}

/// Offload's parameter copies started ahead run on a stream of their own: the host never
/// waits for them (a copy made when needed waits for the device), and a run that prefetches
/// trains as one that does not and as one that keeps everything on the GPU.
#[test]
fn prefetched_copies_run_on_a_stream_of_their_own() {
    let Some((gpu, _serial)) = gpu("prefetched_copies_run_on_a_stream_of_their_own") else { return };
    let offload = |prefetch: usize| {
        format!(r#"[["offload", {{"params": "cpu", "optimizer": "cpu", "policy": "static", "prefetch": {prefetch}}}]]"#)
    };
    let on_gpu = steps(4, gpu);
    let mut plain = trainer(gpu, "[]");
    let want = losses(&mut plain, &on_gpu);
    let mut syncs = vec![];
    for prefetch in [0, 2] {
        let mut t = trainer(gpu, &offload(prefetch));
        let got = losses(&mut t, &on_gpu[..3]);
        cuda::count_syncs(true).unwrap();
        let before = cuda::syncs_counted();
        let last = t.train_step(&on_gpu[3]).unwrap().loss;
        syncs.push(cuda::syncs_counted() - before);
        cuda::count_syncs(false).unwrap();
        let got: Vec<f64> = got.into_iter().chain([last]).collect();
        let gap = loss_gap(&got, &want);
        eprintln!(
            "prefetch {prefetch}: losses {got:?} against {want:?} ({gap:.2e}); {} syncs a step",
            syncs[syncs.len() - 1]
        );
        assert!(gap < 1e-5, "prefetch {prefetch}: {gap:e}");
    }
    assert!(syncs[1] < syncs[0], "copies started ahead do not make the host wait: {syncs:?}");
}

/// A one-rank job on `spec`: its store on loopback, its world group.
fn one_rank(spec: &str) -> (Comm, Box<dyn ProcessGroup>) {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t").unwrap();
    let store = Store::connect(server.addr(), "t", Duration::from_secs(10)).unwrap();
    let comm = Comm::new(store, Some(server), 0, 1, spec, Duration::from_secs(30)).unwrap();
    let world = comm.world().unwrap();
    (comm, world)
}

#[test]
fn nccl_runs_every_collective_in_every_dtype_on_one_rank() {
    let Some((gpu, _serial)) = gpu("nccl_runs_every_collective_in_every_dtype_on_one_rank") else { return };
    let (_comm, world) = one_rank("cpu:shm,cuda:nccl");
    assert_eq!(world.backend(), "cpu:shm,cuda:nccl");
    for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16, Kind::Int, Kind::Int64] {
        let t = Tensor::arange(16, (Kind::Float, gpu)).to_kind(kind);
        let expect = t.copy();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            world.all_reduce(&t, op).unwrap().wait().unwrap();
        }
        world.broadcast(&t, 0).unwrap().wait().unwrap();
        world.reduce(&t, 0, ReduceOp::Sum).unwrap().wait().unwrap();
        assert!(t.equal(&expect), "{kind:?}: a group of one leaves values as they are");
        let gathered = [t.zeros_like()];
        world.all_gather(&gathered, &t).unwrap().wait().unwrap();
        let scattered = t.zeros_like();
        world.reduce_scatter(&scattered, &[t.shallow_clone()], ReduceOp::Sum).unwrap().wait().unwrap();
        let exchanged = [t.zeros_like()];
        world.all_to_all(&exchanged, &[t.shallow_clone()]).unwrap().wait().unwrap();
        for (what, got) in [("all_gather", &gathered[0]), ("reduce_scatter", &scattered), ("all_to_all", &exchanged[0])]
        {
            assert!(got.equal(&expect), "{what} in {kind:?}");
        }
    }
    let f = Tensor::ones([4], (Kind::Float, gpu));
    world.all_reduce(&f, ReduceOp::Avg).unwrap().wait().unwrap();
    assert!(f.equal(&Tensor::ones([4], (Kind::Float, gpu))));
    world.barrier().unwrap().wait().unwrap();
}

#[test]
fn ranks_sharing_a_gpu_run_collectives_through_the_host() {
    if gpu("ranks_sharing_a_gpu_run_collectives_through_the_host").is_none() {
        return;
    }
    assert_all_ok(&run_ranks(2, "cpu:shm,cuda:shm", "staged"));
}

/// Ranks of the multi-process tests (started by [`run_ranks`]).
#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var("STRATA_TEST_SCENARIO") else { return };
    let comm = common::ranks::connect();
    let world = comm.world().unwrap();
    let (rank, gpu) = (comm.rank() as f64, Device::Cuda(0));
    assert_eq!(scenario, "staged");
    for kind in [Kind::Float, Kind::BFloat16, Kind::Int64] {
        let t = Tensor::full([1000], rank + 1.0, (kind, gpu));
        world.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        assert_eq!(t.device(), gpu);
        assert!(t.equal(&Tensor::full([1000], 3.0, (kind, gpu))), "all_reduce in {kind:?}");
        let pieces = [Tensor::zeros([3], (kind, gpu)), Tensor::zeros([3], (kind, gpu))];
        world.all_gather(&pieces, &Tensor::full([3], rank, (kind, gpu))).unwrap().wait().unwrap();
        assert!(pieces[1].equal(&Tensor::ones([3], (kind, gpu))), "all_gather in {kind:?}");
        let mine = Tensor::zeros([2], (kind, gpu));
        let inputs = [Tensor::full([2], 1.0, (kind, gpu)), Tensor::full([2], 2.0, (kind, gpu))];
        world.reduce_scatter(&mine, &inputs, ReduceOp::Sum).unwrap().wait().unwrap();
        assert!(mine.equal(&Tensor::full([2], 2.0 * (rank + 1.0), (kind, gpu))), "reduce_scatter in {kind:?}");
        let b = Tensor::full([5], rank, (kind, gpu));
        world.broadcast(&b, 1).unwrap().wait().unwrap();
        assert!(b.equal(&Tensor::ones([5], (kind, gpu))), "broadcast in {kind:?}");
    }
    // Point to point, and a non-contiguous tensor written in place.
    let m = Tensor::zeros([4, 4], (Kind::Float, gpu));
    let column = m.select(1, 2);
    if comm.rank() == 0 {
        world.send(&Tensor::arange(4, (Kind::Float, gpu)), 1).unwrap().wait().unwrap();
    } else {
        world.recv(&column, 0).unwrap().wait().unwrap();
        assert!(
            m.select(1, 2).equal(&Tensor::arange(4, (Kind::Float, gpu))) && m.sum(Kind::Float).double_value(&[]) == 6.0
        );
    }
    world.barrier().unwrap().wait().unwrap();
    println!("RANK-OK");
}
