//! The compute methods inside one process: the loss scaler's skip and recovery, fp8
//! numerics and delayed scaling, recomputation's gradients and memory, replaced modules
//! against the reference ones (Strata's GELU, SwiGLU and rotary kernels against the exact
//! functions), and where amp_native computes in which dtype.
use crate::common;

use crate::common::rel;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use strata::compute::fp8::{self, AmaxAlgo, Fp8Config, Fp8Unit};
use strata::compute::replace::Replacements;
use strata::compute::{self, UnitCompute};
use strata::data::{Batch, Step};
use strata::engine::{with_seed, Engine, EngineConfig};
use strata::model::{self, layers, Builder, GptConfig};
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::parallel::{build_engine, RankLayout};
use strata::strategy::Strategy;
use strata::train::Trainer;
use tch::{Device, Kind, Tensor};

use crate::serial;

const GPT: GptConfig = GptConfig::new(32, 16, 2, 2, 32);

fn spec() -> strata::model::ModelSpec {
    let mut b = Builder::new();
    model::gpt(&GPT, &mut b).unwrap();
    b.build().unwrap()
}

fn step(seed: i64) -> Step {
    tch::manual_seed(seed);
    let tokens = Tensor::randint(32, [4, 17], (Kind::Int64, Device::Cpu));
    Step::new(0, vec![Batch::new(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16)).unwrap()])
}

#[test]
fn the_loss_scaler_skips_non_finite_steps_lowers_the_scale_and_recovers() {
    let _serial = serial();
    let strategy = Strategy::parse(
        r#"[["amp_native", {"dtype": "fp16", "loss_scaler": {"initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 2}}]]"#,
    )
    .unwrap();
    let mut engine = build_engine(spec(), EngineConfig::default(), &strategy, &RankLayout::single()).unwrap();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    let mut t = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
    t.scaling = strategy.grad_scaling().unwrap();
    // Injection: while set, one weight's gradient is replaced by infinities.
    let poison = Arc::new(AtomicBool::new(false));
    let flag = poison.clone();
    let weight = t.engine().param_by_name("transformer.h.0.mlp.c_fc.weight").unwrap().shallow_clone();
    let _hook =
        strata_ext::register_hook(&weight, move |g| flag.load(Ordering::Relaxed).then(|| g.full_like(f64::INFINITY)))
            .unwrap();
    let first = t.train_step(&step(1)).unwrap();
    assert_eq!((first.skipped, first.loss_scale), (false, Some(256.0)));
    poison.store(true, Ordering::Relaxed);
    let before = weight.detach().copy();
    let bad = t.train_step(&step(2)).unwrap();
    assert!(bad.skipped, "non-finite gradients skip the update");
    assert!(weight.equal(&before), "a skipped step leaves the parameters alone");
    poison.store(false, Ordering::Relaxed);
    let next = t.train_step(&step(3)).unwrap();
    assert_eq!((next.skipped, next.loss_scale), (false, Some(128.0)), "the scale halved after the overflow");
    assert!(!weight.equal(&before), "training goes on");
    t.train_step(&step(4)).unwrap();
    assert_eq!(t.scaling.scaler.as_ref().unwrap().scale, 256.0, "two clean steps double it again");
}

#[test]
fn a_skipped_step_still_ends_the_fp8_step() {
    let _serial = serial();
    let strategy = Strategy::parse(
        r#"[["fp8", {"exclude": ["lm_head"]}], ["amp_native", {"dtype": "bf16", "skip_if_nonfinite": true}]]"#,
    )
    .unwrap();
    let mut engine = build_engine(spec(), EngineConfig::default(), &strategy, &RankLayout::single()).unwrap();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    let mut t = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
    t.scaling = strategy.grad_scaling().unwrap();
    let weight = t.engine().param_by_name("transformer.h.0.mlp.c_fc.weight").unwrap().shallow_clone();
    let _hook = strata_ext::register_hook(&weight, |g| Some(g.full_like(f64::INFINITY))).unwrap();
    assert!(t.train_step(&step(1)).unwrap().skipped);
    // The step's amaxes entered the histories (the overflowing gradients' left out) and
    // nothing is pending for the next step.
    let states: Vec<_> = t.engine().fp8_states().into_iter().flatten().collect();
    assert!(!states.is_empty());
    for state in states {
        for l in &state.lock().unwrap().layers {
            assert_eq!([l.input.pending, l.weight.pending, l.grad.pending], [0.0; 3]);
            assert_eq!((l.input.history.len(), l.weight.history.len()), (1, 1));
        }
    }
}

#[test]
fn fp8_linear_stays_close_to_fp32_and_its_scaling_follows_the_history() {
    let _serial = serial();
    tch::manual_seed(0);
    let x = Tensor::randn([32, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let w = (Tensor::randn([48, 64], (Kind::Float, Device::Cpu)) * 0.1).set_requires_grad(true);
    let b = Tensor::randn([48], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let reference = x.linear(&w, Some(&b));
    let config = Fp8Config { amax_history_len: 3, interval: 2, ..Default::default() };
    let state = Fp8Unit::new(config);
    let mut errors = (0.0, 0.0, 0.0);
    for s in 0..4 {
        let out = fp8::linear(&state, 0, true, &x, &w, Some(&b), Kind::Float).unwrap();
        errors.0 = rel(&out, &reference);
        let got = Tensor::run_backward(&[&out], &[&x, &w], false, false);
        let want = Tensor::run_backward(&[&x.linear(&w, Some(&b))], &[&x, &w], false, false);
        errors.1 = rel(&got[0], &want[0]);
        errors.2 = rel(&got[1], &want[1]);
        let scale_before = state.lock().unwrap().layers[0].input.scale;
        state.lock().unwrap().end_step(None).unwrap();
        let st = state.lock().unwrap();
        let meters = &st.layers[0];
        assert_eq!(meters.input.history.len(), (s + 1).min(3), "history keeps amax_history_len entries");
        let amax = x.abs().max().double_value(&[]);
        assert!((meters.input.history.back().unwrap() - amax).abs() < 1e-6);
        if s % 2 == 1 {
            assert!((meters.input.scale - 448.0 / amax).abs() < 1e-3, "refreshed every interval steps");
            assert!((meters.grad.scale - 57344.0 / meters.grad.history.back().unwrap()).abs() < 1e-2, "E5M2 gradients");
        } else {
            assert_eq!(meters.input.scale, scale_before, "not refreshed between intervals");
        }
    }
    // E4M3 keeps 3 mantissa bits (relative rounding up to 2^-4), E5M2 two (2^-3); products
    // of 64 terms average the errors down. Bounds: 5% forward, 10% gradients.
    eprintln!(
        "fp8 relative errors: output {:.3e}, input grad {:.3e}, weight grad {:.3e}",
        errors.0, errors.1, errors.2
    );
    assert!(errors.0 < 0.05 && errors.1 < 0.1 && errors.2 < 0.1, "{errors:?}");
    // Quantised, not silently computed in fp32.
    assert!(errors.0 > 1e-4 && errors.1 > 1e-4 && errors.2 > 1e-4, "{errors:?}");
    let recent = Fp8Unit::new(Fp8Config { amax_compute_algo: AmaxAlgo::MostRecent, ..Default::default() });
    for scale in [4.0, 1.0] {
        let _ = fp8::linear(&recent, 0, true, &(&x * scale), &w, None, Kind::Float).unwrap();
        recent.lock().unwrap().end_step(None).unwrap();
    }
    let amax = x.abs().max().double_value(&[]);
    assert!(
        (recent.lock().unwrap().layers[0].input.scale - 448.0 / amax).abs() < 1e-3,
        "most_recent ignores older maxima"
    );
}

/// `t · scale` saturated to E4M3 and back: what an fp8 operand holds, in fp32.
fn e4m3(t: &Tensor, scale: &Tensor) -> Tensor {
    (t * scale).clamp(-448.0, 448.0).to_kind(Kind::Float8e4m3fn).to_kind(Kind::Float) / scale
}

#[test]
fn current_and_rowwise_scaling_take_each_tensors_own_maxima() {
    let _serial = serial();
    tch::manual_seed(4);
    // One row of outliers, 10^5 times the others: one scale for the tensor puts the other
    // rows below E4M3's smallest normal number (2^-6), where precision runs out.
    let x = Tensor::randn([32, 64], (Kind::Float, Device::Cpu));
    let _ = x.get(0).g_mul_scalar_(1e5);
    let w = Tensor::randn([48, 64], (Kind::Float, Device::Cpu)) * 0.1;
    let reference = x.linear::<Tensor>(&w, None);
    let rest = |t: &Tensor| t.narrow(0, 1, 31);
    let mut errors = Vec::new();
    for scaling in [fp8::Fp8Scaling::Current, fp8::Fp8Scaling::Rowwise] {
        let state = Fp8Unit::new(Fp8Config { scaling, ..Default::default() });
        let out = fp8::linear(&state, 0, true, &x, &w, None, Kind::Float).unwrap();
        // The product of the operands as each scaling quantises them, from its definition.
        let (sx, sw) = match scaling {
            fp8::Fp8Scaling::Current => (x.abs().max().reciprocal() * 448.0, w.abs().max().reciprocal() * 448.0),
            _ => (x.abs().amax([1], true).reciprocal() * 448.0, w.abs().amax([1], true).reciprocal() * 448.0),
        };
        let expected = e4m3(&x, &sx).matmul(&e4m3(&w, &sw).tr());
        assert!(rel(&out, &expected) < 1e-5, "{scaling:?}: {:e}", rel(&out, &expected));
        let error = rel(&rest(&out), &rest(&reference));
        errors.push(error);
        // Nothing is kept for later steps, and nothing is read at the end of a step.
        let mut st = state.lock().unwrap();
        st.end_step(None).unwrap();
        assert!(st.layers[0].input.history.is_empty() && st.layers[0].input.scale == 1.0, "{scaling:?}: no history");
    }
    eprintln!("relative error of the rows beside the outliers: current {:.3e}, rowwise {:.3e}", errors[0], errors[1]);
    // A scale per row keeps fp8's full precision for each row (and is still quantised).
    assert!(errors[1] > 1e-4 && errors[1] < 0.05 && errors[0] > 3.0 * errors[1], "{errors:?}");
    // Rowwise gradients: E4M3 throughout, each product's operands scaled along the axis it
    // sums over; both gradients stay near fp32's (on operands without outliers, which would
    // carry the weight's gradient alone).
    let xg = Tensor::randn([32, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let wg = w.shallow_clone().set_requires_grad(true);
    let state = Fp8Unit::new(Fp8Config { scaling: fp8::Fp8Scaling::Rowwise, ..Default::default() });
    let out = fp8::linear(&state, 0, true, &xg, &wg, None, Kind::Float).unwrap();
    let got = Tensor::run_backward(&[&out], &[&xg, &wg], false, false);
    let want = Tensor::run_backward(&[&xg.linear::<Tensor>(&wg, None)], &[&xg, &wg], false, false);
    let grads = [rel(&got[0], &want[0]), rel(&got[1], &want[1])];
    eprintln!("rowwise gradient errors (input, weight): {grads:?}");
    assert!(grads.iter().all(|&e| e > 1e-4 && e < 0.05), "{grads:?}");
}

/// A weight is cast to fp8 once a step: later forwards of the step (micro-batches,
/// recomputation) reuse that cast, and the next step casts afresh.
#[test]
fn fp8_weights_are_cast_once_a_step() {
    let _serial = serial();
    tch::manual_seed(2);
    let x = Tensor::randn([16, 64], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([32, 64], (Kind::Float, Device::Cpu)) * 0.1;
    // Scales refresh only every 1000 steps: they stay as they start.
    let config = Fp8Config { interval: 1000, ..Default::default() };
    let (state, fresh) = (Fp8Unit::new(config.clone()), Fp8Unit::new(config));
    let forward = |state: &fp8::SharedFp8, w: &Tensor| fp8::linear(state, 0, true, &x, w, None, Kind::Float).unwrap();
    let first = forward(&state, &w);
    // The weight changes within the step: the step's cast still serves.
    let doubled = &w * 2.0;
    assert!(forward(&state, &doubled).equal(&first), "the step's cast of the weight is reused");
    state.lock().unwrap().end_step(None).unwrap();
    let next = forward(&state, &doubled);
    assert!(next.equal(&forward(&fresh, &doubled)), "a new step casts the weight again");
    assert!(!next.equal(&first));
}

#[test]
fn fp8_pads_rows_that_are_not_a_multiple_of_16() {
    let _serial = serial();
    tch::manual_seed(1);
    // 2 × 5 = 10 rows.
    let x = Tensor::randn([2, 5, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let w = (Tensor::randn([32, 64], (Kind::Float, Device::Cpu)) * 0.1).set_requires_grad(true);
    let state = Fp8Unit::new(Fp8Config::default());
    let out = fp8::linear(&state, 0, true, &x, &w, None, Kind::Float).unwrap();
    assert_eq!(out.size(), [2, 5, 32]);
    let reference = x.linear::<Tensor>(&w, None);
    let got = Tensor::run_backward(&[&out], &[&x, &w], false, false);
    let want = Tensor::run_backward(&[&reference], &[&x, &w], false, false);
    let errors = [rel(&out, &reference), rel(&got[0], &want[0]), rel(&got[1], &want[1])];
    eprintln!("fp8 with padded rows: relative errors {errors:?}");
    // Quantised (not silently run in fp32), and as close as unpadded fp8.
    assert!(errors.iter().all(|&e| e > 1e-4 && e < 0.1), "{errors:?}");
    let mut st = state.lock().unwrap();
    st.end_step(None).unwrap();
    let recorded = *st.layers[0].input.history.back().unwrap();
    assert!((recorded - x.abs().max().double_value(&[])).abs() < 1e-6, "the padding is no amax");
    drop(st);
    // Inside a model: a batch of 2 × 5 tokens still computes every block's linears in fp8.
    let strategy = Strategy::parse(r#"[["fp8", {"exclude": ["lm_head"]}]]"#).unwrap();
    let mut engine = build_engine(spec(), EngineConfig::default(), &strategy, &RankLayout::single()).unwrap();
    let tokens = Tensor::randint(32, [2, 5], (Kind::Int64, Device::Cpu));
    let _ = engine.forward(&tokens).unwrap();
    let recorded: Vec<usize> = engine.fp8_states().iter().flatten().map(|s| s.lock().unwrap().layers.len()).collect();
    // Embedding and head hold no fp8 linear (the head is excluded); each block holds four.
    assert_eq!(recorded, [0, 4, 4, 0], "fp8 linears per unit");
}

/// Zeros scale by a floor, not by infinity: a row or column of the input that is zero
/// everywhere (a masked token, a dead feature), an output feature whose gradient is zero,
/// and a gradient that is zero throughout (a micro-batch whose targets are all ignored)
/// leave current and rowwise fp8 linears finite, and equal to their exact values there.
#[test]
fn zero_rows_columns_and_gradients_stay_finite_under_current_and_rowwise_scaling() {
    let _serial = serial();
    tch::manual_seed(2);
    let x = Tensor::randn([32, 64], (Kind::Float, Device::Cpu));
    let _ = x.get(3).zero_();
    let _ = x.narrow(1, 5, 1).zero_();
    let w = Tensor::randn([48, 64], (Kind::Float, Device::Cpu)) * 0.1;
    // Output feature 7 takes no gradient; the second pass takes none at all.
    let mask = Tensor::ones([32, 48], (Kind::Float, Device::Cpu));
    let _ = mask.narrow(1, 7, 1).zero_();
    for scaling in [fp8::Fp8Scaling::Current, fp8::Fp8Scaling::Rowwise] {
        for weight in [mask.shallow_clone(), mask.zeros_like()] {
            let (xg, wg) = (x.copy().set_requires_grad(true), w.copy().set_requires_grad(true));
            let state = Fp8Unit::new(Fp8Config { scaling, ..Default::default() });
            let out = fp8::linear(&state, 0, true, &xg, &wg, None, Kind::Float).unwrap();
            let grads = Tensor::run_backward(&[&(&out * &weight).sum(Kind::Float)], &[&xg, &wg], false, false);
            for (name, t) in [("output", &out), ("input gradient", &grads[0]), ("weight gradient", &grads[1])] {
                let finite = t.isfinite().all().int64_value(&[]) == 1;
                assert!(finite, "{scaling:?}: the {name} is not finite");
            }
            assert_eq!(out.get(3).abs().max().double_value(&[]), 0.0, "{scaling:?}: the zero row's output");
            assert_eq!(grads[1].narrow(1, 5, 1).abs().max().double_value(&[]), 0.0, "{scaling:?}: the zero column's");
            assert_eq!(grads[1].get(7).abs().max().double_value(&[]), 0.0, "{scaling:?}: no gradient, none given");
            if weight.sum(Kind::Float).double_value(&[]) == 0.0 {
                assert_eq!(grads[0].abs().max().double_value(&[]), 0.0, "{scaling:?}: a zero gradient stays zero");
            } else {
                // The other values still quantised, and near their exact ones.
                let exact = x.linear::<Tensor>(&w, None);
                let error = rel(&out, &exact);
                assert!(error > 1e-4 && error < 0.05, "{scaling:?}: {error:e}");
            }
        }
    }
}
fn grads_and_peak(recompute: bool) -> (Vec<Tensor>, i64) {
    strata_ext::cpu_memory::track().unwrap();
    let mut e = Engine::new(spec(), EngineConfig::default()).unwrap();
    let policy = UnitCompute { recompute, ..Default::default() };
    let n = e.spec().units.len();
    e.set_compute(
        (0..n).map(|k| UnitCompute { recompute: recompute && k > 0 && k < n - 1, ..policy.clone() }).collect(),
    )
    .unwrap();
    let s = step(7);
    let batch = &s.micro_batches[0];
    let base = strata_ext::cpu_memory::stats().unwrap().0;
    strata_ext::cpu_memory::reset_peak().unwrap();
    let out = e.forward(&batch.inputs).unwrap();
    e.backward(&layers::cross_entropy(&out, &batch.targets).unwrap()).unwrap();
    let peak = strata_ext::cpu_memory::stats().unwrap().1 - base;
    (e.storage().iter().map(|s| s.grad.copy()).collect(), peak)
}

#[test]
fn recomputed_units_give_the_same_gradients_with_less_memory() {
    let _serial = serial();
    let (plain, plain_peak) = grads_and_peak(false);
    let (recomputed, recomputed_peak) = grads_and_peak(true);
    for (a, b) in plain.iter().zip(&recomputed) {
        assert!(a.equal(b), "recomputation gives exactly the same gradients");
    }
    eprintln!("forward+backward peak: {plain_peak} bytes plain, {recomputed_peak} recomputing the blocks");
    assert!(recomputed_peak < plain_peak, "{recomputed_peak} < {plain_peak}");
}

#[test]
fn replaced_modules_match_the_reference_ones() {
    let _serial = serial();
    for module in common::replaced_modules(Device::Cpu) {
        module.check(Device::Cpu);
    }
    assert!(Replacements::select(Some(&["NoSuchPair".to_string()])).is_err());
}

/// The training loss runs under the `module_replace` selection of the unit that made the
/// logits: a cross-entropy pair registered and selected is called for every micro-batch's
/// loss (and for evaluation), and not without `module_replace`.
#[test]
fn the_loss_runs_under_the_output_unit_s_replacements() {
    use std::sync::atomic::AtomicUsize;
    use strata::compute::replace::{register_replace_pair, Replacement};
    let _serial = serial();
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    // Counts its calls and declines, so the composite computes the loss.
    register_replace_pair(
        "CountingCrossEntropy",
        &[Kind::Float],
        Replacement::CrossEntropy(Arc::new(|_: &Tensor, _: &Tensor, ignore: i64| {
            assert_eq!(ignore, layers::IGNORE);
            CALLS.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        })),
    );
    let mut calls = vec![];
    for strategy in [r#"[["module_replace", ["CountingCrossEntropy"]]]"#, "[]"] {
        let strategy = Strategy::parse(strategy).unwrap();
        let mut engine = build_engine(spec(), EngineConfig::default(), &strategy, &RankLayout::single()).unwrap();
        let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
        let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, None);
        let before = CALLS.load(Ordering::SeqCst);
        let steps = [step(1), step(2)];
        for s in &steps {
            trainer.train_step(s).unwrap();
        }
        strata::train::evaluate(trainer.engine_mut(), &steps).unwrap();
        calls.push(CALLS.load(Ordering::SeqCst) - before);
    }
    assert_eq!(calls, vec![4, 0], "two training and two evaluation losses replaced, none without module_replace");
}

/// Forward and backward of a linear layer under `policy`: output and the gradients of
/// input, weight and bias for the upstream gradient `g` (undefined where none).
fn linear_with_grads(policy: &Arc<UnitCompute>, x: &Tensor, w: &Tensor, b: Option<&Tensor>, g: &Tensor) -> Vec<Tensor> {
    let (x, w) = (x.detach().set_requires_grad(x.requires_grad()), w.detach().set_requires_grad(true));
    let b = b.map(|b| b.detach().set_requires_grad(true));
    let y = compute::run(policy, Default::default(), false, || layers::linear(&x, &w, b.as_ref())).unwrap();
    strata_ext::backward(&[&y], &[g], false).unwrap();
    let mut out = vec![y.detach(), x.grad(), w.grad()];
    out.extend(b.map(|b| b.grad()));
    out
}

/// A policy that replaces linear layers by `OneDnnLinear`; none (the test is skipped, with
/// a message) where libtorch has no oneDNN.
fn onednn_policy() -> Option<Arc<UnitCompute>> {
    if !strata_ext::onednn::available() {
        eprintln!("skipped: this libtorch has no oneDNN, so OneDnnLinear is not registered");
        return None;
    }
    Some(replacing("OneDnnLinear"))
}

#[test]
fn onednn_linear_matches_libtorch_forward_and_backward() {
    let _serial = serial();
    let Some(onednn) = onednn_policy() else { return };
    let plain = Arc::new(UnitCompute::default());
    let draw = |seed: i64, shape: &[i64]| with_seed(seed, || Tensor::randn(shape, (Kind::Float, Device::Cpu)));
    // (input, weight out × in, bias, whether the input takes a gradient)
    let cases = [
        ("3-d input with bias", draw(1, &[3, 5, 7]), 4, true, true),
        ("input without gradient", draw(2, &[6, 7]), 9, true, false),
        ("transposed input, no bias", draw(3, &[7, 5, 3]).transpose(0, 2), 4, false, true),
        ("one row", draw(4, &[1, 1, 7]), 4, true, true),
        ("no rows", draw(5, &[0, 7]), 4, true, true),
    ];
    for (name, x, outs, bias, input_grad) in cases {
        let ins = *x.size().last().unwrap();
        let (w, b) = (draw(10, &[outs, ins]), draw(11, &[outs]));
        let mut shape = x.size();
        *shape.last_mut().unwrap() = outs;
        let g = draw(12, &shape);
        let x = x.set_requires_grad(input_grad);
        let b = bias.then_some(&b);
        let replaced = linear_with_grads(&onednn, &x, &w, b, &g);
        let reference = linear_with_grads(&plain, &x, &w, b, &g);
        for (what, (r, e)) in
            ["output", "input grad", "weight grad", "bias grad"].iter().zip(replaced.iter().zip(&reference))
        {
            assert_eq!(r.defined(), e.defined(), "{name}: {what} defined on both sides");
            if e.defined() {
                assert_eq!(r.size(), e.size(), "{name}: {what} shape");
                if e.numel() == 0 {
                    continue;
                }
                if e.abs().max().double_value(&[]) > 0.0 {
                    assert!(rel(r, e) < 1e-5, "{name}: {what} differs by {:e}", rel(r, e));
                } else {
                    assert_eq!(r.abs().max().double_value(&[]), 0.0, "{name}: {what} is zero");
                }
            }
        }
    }
    // The replacement really runs: the output comes from its own autograd node, not
    // libtorch's product.
    let (x, w) = (draw(20, &[4, 8]).set_requires_grad(true), draw(21, &[3, 8]).set_requires_grad(true));
    let node = |policy: &Arc<UnitCompute>| {
        let y = compute::run(policy, Default::default(), false, || layers::linear(&x, &w, None)).unwrap();
        strata_ext::grad_fn_name(&y).unwrap().unwrap_or_default()
    };
    assert!(node(&onednn).contains("RustFunction"), "OneDnnLinear's node, got {:?}", node(&onednn));
    assert!(!node(&plain).contains("RustFunction"), "libtorch's node without the replacement");
    // Other dtypes keep libtorch's linear.
    let (xd, wd) = (x.to_kind(Kind::Double), w.to_kind(Kind::Double));
    let yd = compute::run(&onednn, Default::default(), false, || layers::linear(&xd, &wd, None)).unwrap();
    assert!(!strata_ext::grad_fn_name(&yd).unwrap().unwrap_or_default().contains("RustFunction"));
}

/// OneDnnLinear's weight gradient reads the output gradient transposed in place: its
/// backward allocates the three gradients and no contiguous copy of the output gradient,
/// which oneDNN's product would first make of a transposed input.
#[test]
fn onednn_linear_backward_copies_no_output_gradient() {
    let _serial = serial();
    let Some(onednn) = onednn_policy() else { return };
    let (rows, ins, outs) = (4096, 16, 512);
    let draw = |seed: i64, shape: &[i64]| with_seed(seed, || Tensor::randn(shape, (Kind::Float, Device::Cpu)));
    let (x, w, b) = (draw(1, &[rows, ins]).set_requires_grad(true), draw(2, &[outs, ins]), draw(3, &[outs]));
    let (w, b) = (w.set_requires_grad(true), b.set_requires_grad(true));
    let g = draw(4, &[rows, outs]);
    let y = compute::run(&onednn, Default::default(), false, || layers::linear(&x, &w, Some(&b))).unwrap();
    strata_ext::cpu_memory::track().unwrap();
    let held = strata_ext::cpu_memory::stats().unwrap().0;
    strata_ext::cpu_memory::reset_peak().unwrap();
    strata_ext::backward(&[&y], &[&g], false).unwrap();
    let extra = strata_ext::cpu_memory::stats().unwrap().1 - held;
    let grads = 4 * (rows * ins + outs * ins + outs);
    let output_grad = 4 * rows * outs;
    eprintln!("backward allocated {extra} bytes: gradients {grads}, the output gradient {output_grad}");
    assert!(extra >= grads && extra < grads + output_grad / 2, "backward allocated {extra} bytes");
}

/// `op` of `inputs` under `policy`, the first `learned` of them taking gradients (the rest
/// as given), with the inputs' gradients for the upstream gradient `g`: (output,
/// gradients, the name of the output's autograd node).
fn with_grads(
    policy: &Arc<UnitCompute>,
    op: impl Fn(&[Tensor]) -> strata::Result<Tensor>,
    inputs: &[&Tensor],
    learned: usize,
    g: &Tensor,
) -> (Tensor, Vec<Tensor>, String) {
    let inputs: Vec<Tensor> = inputs
        .iter()
        .enumerate()
        .map(|(i, x)| if i < learned { x.detach().set_requires_grad(true) } else { x.shallow_clone() })
        .collect();
    let y = compute::run(policy, Default::default(), false, || op(&inputs)).unwrap();
    let node = strata_ext::grad_fn_name(&y).unwrap().unwrap_or_default();
    strata_ext::backward(&[&y], &[g], false).unwrap();
    (y.detach(), inputs.iter().map(Tensor::grad).collect(), node)
}

/// GELU (tanh form) under `policy` of `x`, with the gradient for upstream `g`.
fn gelu_with_grad(policy: &Arc<UnitCompute>, x: &Tensor, g: &Tensor) -> (Tensor, Tensor, String) {
    let (y, mut grads, node) = with_grads(policy, |t| layers::gelu_tanh(&t[0]), &[x], 1, g);
    (y, grads.remove(0), node)
}

/// Sets libtorch's intra-op thread count until dropped, then restores the one before (also
/// when an assertion fails in between).
struct Threads(i32);

impl Threads {
    fn set(n: i32) -> Threads {
        let before = tch::get_num_threads();
        tch::set_num_threads(n);
        Threads(before)
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        tch::set_num_threads(self.0);
    }
}

/// `op` of `inputs` (all taking gradients) under the replacement and under libtorch's ops:
/// each side's output and gradients, after checking that Strata's kernel (autograd node
/// `kernel`) made the replacement's output and not the other.
fn kernel_and_composite(
    replaced: &Arc<UnitCompute>,
    plain: &Arc<UnitCompute>,
    op: impl Fn(&[Tensor]) -> strata::Result<Tensor> + Copy,
    inputs: &[&Tensor],
    g: &Tensor,
    kernel: &str,
) -> ((Tensor, Vec<Tensor>), (Tensor, Vec<Tensor>)) {
    let (y, grads, node) = with_grads(replaced, op, inputs, inputs.len(), g);
    let (reference_y, reference_grads, reference_node) = with_grads(plain, op, inputs, inputs.len(), g);
    assert!(node.contains(kernel), "Strata's kernel made the output, got node {node:?}");
    assert!(!reference_node.contains(kernel), "libtorch's ops without the replacement");
    ((y, grads), (reference_y, reference_grads))
}

/// A policy that replaces `pair` only.
fn replacing(pair: &str) -> Arc<UnitCompute> {
    Arc::new(UnitCompute {
        replacements: Replacements::select(Some(&[pair.to_string()])).unwrap(),
        ..Default::default()
    })
}

/// Every element once: −100 to 100 densely (the tails included), then normal samples
/// scaled by `scale`; more than one parallel grain of elements.
fn activation_inputs(scale: f64) -> Tensor {
    Tensor::cat(
        &[
            Tensor::linspace(-100.0, 100.0, 200_001, (Kind::Float, Device::Cpu)),
            with_seed(1, || Tensor::randn([300_000], (Kind::Float, Device::Cpu))) * scale,
        ],
        0,
    )
}

/// GELU's tanh form and its derivative in f64, from the exact rewrite x·σ(2u), where
/// nothing cancels: 1 − σ(2u) is σ(−2u).
fn exact_gelu(x: &Tensor) -> (Tensor, Tensor) {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let x = x.to_kind(Kind::Double);
    let u = (&x + x.pow_tensor_scalar(3) * 0.044715) * k;
    let (s, one_minus_s) = ((&u * 2.0).sigmoid(), (&u * -2.0).sigmoid());
    let du = (x.square() * (3.0 * 0.044715) + 1.0) * (2.0 * k);
    let dy = &s + &x * &s * one_minus_s * du;
    (&x * s, dy)
}

/// The largest of |a − b| / max(|b|, floor) (both read as f64).
fn worst_relative(a: &Tensor, b: &Tensor, floor: f64) -> f64 {
    let b = b.to_kind(Kind::Double);
    ((a.to_kind(Kind::Double) - &b).abs() / b.abs().clamp_min(floor)).max().double_value(&[])
}

#[test]
fn vector_gelu_is_the_exact_function_within_the_rounding_of_its_argument() {
    let _serial = serial();
    let vector = replacing("VectorGelu");
    let plain = Arc::new(UnitCompute::default());
    let x = activation_inputs(3.0);
    let g = with_seed(2, || Tensor::randn(x.size(), (Kind::Float, Device::Cpu)));
    let single = Threads::set(1);
    let (y, dx, node) = gelu_with_grad(&vector, &x, &g);
    let (reference_y, reference_dx, reference_node) = gelu_with_grad(&plain, &x, &g);
    assert!(node.contains("GeluTanh"), "Strata's kernel made the output, got node {node:?}");
    assert!(!reference_node.contains("GeluTanh"), "libtorch's kernel without the replacement");
    let (exact_y, exact_dy) = exact_gelu(&x);
    let exact_dx = exact_dy * g.to_kind(Kind::Double);

    // u carries fp32's rounding (ε/2 ≈ 6e-8 relative), which e^(−2u) multiplies by 2|u|: at
    // most 88 before the result drops below the 1e-30 floor, so 5e-6, and from −3 on (2|u| ≤
    // 6.6) 4e-7, each with a few ulp of the kernel's own on top.
    let forward = worst_relative(&y, &exact_y, 1e-30);
    assert!(forward < 1e-5, "forward within 1e-5 of the exact function, worst {forward:e}");
    assert!(rel(&y, &reference_y) < 1e-6, "forward near libtorch's: {:e}", rel(&y, &reference_y));
    let middle = x.ge(-3.0);
    let from_minus_3 = worst_relative(&y.masked_select(&middle), &exact_y.masked_select(&middle), 1e-30);
    assert!(from_minus_3 < 1e-6, "from −3 on within 1e-6, worst {from_minus_3:e}");
    // The gradient, in units of the upstream gradient (the derivative is at most 1.13).
    let backward = ((dx.to_kind(Kind::Double) - &exact_dx).abs() / g.abs().to_kind(Kind::Double).clamp_min(1e-30))
        .max()
        .double_value(&[]);
    assert!(backward < 1e-6, "backward within 1e-6·|g| of the exact derivative, worst {backward:e}");
    assert!(rel(&dx, &reference_dx) < 1e-5, "backward near libtorch's: {:e}", rel(&dx, &reference_dx));
    assert!(!dx.equal(&reference_dx), "a kernel of its own computes the gradient");

    // Several threads split the work without changing a bit.
    drop(single);
    let two = Threads::set(2);
    let (y2, dx2, _) = gelu_with_grad(&vector, &x, &g);
    drop(two);
    assert!(y2.equal(&y) && dx2.equal(&dx), "the same values on two threads");

    // Strided input, empty and zero-dimensional tensors, and special values.
    let block = with_seed(3, || Tensor::randn([3, 5, 7], (Kind::Float, Device::Cpu)));
    let strided = block.transpose(0, 2);
    let gs = with_seed(4, || Tensor::randn(strided.size(), (Kind::Float, Device::Cpu)));
    let (ys, dxs, _) = gelu_with_grad(&vector, &strided, &gs);
    let (yc, dxc, _) = gelu_with_grad(&vector, &strided.contiguous(), &gs.contiguous());
    assert!(ys.equal(&yc) && dxs.equal(&dxc), "a transposed input gives the contiguous one's values");
    let (ye, dxe, _) = gelu_with_grad(
        &vector,
        &Tensor::zeros([0, 4], (Kind::Float, Device::Cpu)),
        &Tensor::zeros([0, 4], (Kind::Float, Device::Cpu)),
    );
    assert_eq!((ye.size(), dxe.size()), (vec![0, 4], vec![0, 4]));
    // Far right, e^(−2u) underflows to 0 and the derivative is exactly 1.
    let special = Tensor::from_slice(&[f32::NAN, f32::INFINITY, -50.0, 0.0, 50.0, 1e13]);
    let (yv, dxv, _) = gelu_with_grad(&vector, &special, &special.ones_like());
    let (yv, dxv) = (Vec::<f32>::try_from(&yv).unwrap(), Vec::<f32>::try_from(&dxv).unwrap());
    assert!(yv[0].is_nan() && dxv[0].is_nan(), "NaN stays NaN");
    assert_eq!(&yv[1..], &[f32::INFINITY, 0.0, 0.0, 50.0, 1e13]);
    assert_eq!(&dxv[2..], &[0.0, 0.5, 1.0, 1.0]);
    let scalar = Tensor::from(0.5f32);
    let (y0, _, _) = gelu_with_grad(&vector, &scalar, &scalar.ones_like());
    assert_eq!(y0.size(), Vec::<i64>::new());
    assert!((y0.double_value(&[]) - 0.345_714).abs() < 1e-6, "GELU(0.5) = 0.345714, got {y0}");

    // A second derivative is refused, not silently wrong.
    let xg = x.narrow(0, 0, 8).detach().set_requires_grad(true);
    let yg = compute::run(&vector, Default::default(), false, || layers::gelu_tanh(&xg)).unwrap();
    let options = strata_ext::GradOptions { retain_graph: true, create_graph: true, allow_unused: false };
    let err = strata_ext::grad(&[&yg], &[&yg.ones_like()], &[&xg], options).unwrap_err();
    assert!(err.to_string().contains("no second derivative"), "{err}");

    // Other dtypes keep libtorch's kernel, bit for bit.
    for kind in [Kind::Double, Kind::BFloat16] {
        let xk = x.narrow(0, 0, 1000).to_kind(kind);
        let gk = g.narrow(0, 0, 1000).to_kind(kind);
        let (a, da, node) = gelu_with_grad(&vector, &xk, &gk);
        let (b, db, _) = gelu_with_grad(&plain, &xk, &gk);
        assert!(!node.contains("GeluTanh") && a.equal(&b) && da.equal(&db), "{kind:?} runs libtorch's GELU");
    }
}

#[test]
fn fused_swiglu_is_silu_times_up_within_1e_6_keeping_one_tensor_less() {
    let _serial = serial();
    let fused = replacing("FusedSwiGLU");
    let plain = Arc::new(UnitCompute::default());
    let swiglu = |t: &[Tensor]| layers::swiglu(&t[0], &t[1]);
    let gate = activation_inputs(4.0);
    let up = with_seed(2, || Tensor::randn(gate.size(), (Kind::Float, Device::Cpu)));
    let dy = with_seed(3, || Tensor::randn(gate.size(), (Kind::Float, Device::Cpu)));
    let single = Threads::set(1);
    let ((y, grads), (reference_y, reference_grads)) =
        kernel_and_composite(&fused, &plain, swiglu, &[&gate, &up], &dy, "SwiGlu");

    // The exact values in f64, with 1 − σ(g) as σ(−g).
    let (g64, u64, dy64) = (gate.to_kind(Kind::Double), up.to_kind(Kind::Double), dy.to_kind(Kind::Double));
    let (s, one_minus_s) = (g64.sigmoid(), g64.neg().sigmoid());
    let exact_y = &g64 * &s * &u64;
    let exact_dgate = &dy64 * &u64 * &s * (&g64 * one_minus_s + 1.0);
    let exact_dup = &dy64 * &g64 * &s;
    // Relative, down to 1e-20 (the kernel's e^−g overflows a little early, near g = −88.4,
    // where the product is below 1e-35).
    let forward = worst_relative(&y, &exact_y, 1e-20);
    assert!(forward < 1e-6, "forward within 1e-6 of the exact product, worst {forward:e}");
    assert!(rel(&y, &reference_y) < 1e-6, "forward near libtorch's: {:e}", rel(&y, &reference_y));
    // The gate's gradient in units of |dy·u| (silu's derivative lies in [−0.1, 1.1]).
    let scale = (&dy64 * &u64).abs().clamp_min(1e-30);
    let dgate = ((grads[0].to_kind(Kind::Double) - &exact_dgate).abs() / scale).max().double_value(&[]);
    assert!(dgate < 1e-6, "gate gradient within 1e-6·|dy·u| of the exact one, worst {dgate:e}");
    let dup = worst_relative(&grads[1], &exact_dup, 1e-20);
    assert!(dup < 1e-6, "up gradient within 1e-6 of the exact one, worst {dup:e}");
    for (what, (a, b)) in ["gate", "up"].iter().zip(grads.iter().zip(&reference_grads)) {
        assert!(rel(a, b) < 1e-6, "{what} gradient near libtorch's: {:e}", rel(a, b));
    }
    assert!(
        !(y.equal(&reference_y) && grads[0].equal(&reference_grads[0])),
        "a kernel of its own computes the product and the gate's gradient"
    );

    // Several threads split the work without changing a bit.
    drop(single);
    let two = Threads::set(2);
    let (y2, grads2, _) = with_grads(&fused, swiglu, &[&gate, &up], 2, &dy);
    drop(two);
    assert!(y2.equal(&y) && grads2[0].equal(&grads[0]) && grads2[1].equal(&grads[1]), "the same values on two threads");

    // Held for backward beside the inputs: the product alone, where libtorch's ops also
    // keep silu(gate).
    strata_ext::cpu_memory::track().unwrap();
    let held = |policy: &Arc<UnitCompute>| {
        let (g, u) = (gate.detach().set_requires_grad(true), up.detach().set_requires_grad(true));
        let before = strata_ext::cpu_memory::stats().unwrap().0;
        let y = compute::run(policy, Default::default(), false, || layers::swiglu(&g, &u)).unwrap();
        let bytes = strata_ext::cpu_memory::stats().unwrap().0 - before;
        drop(y);
        bytes
    };
    let bytes = gate.numel() as i64 * 4;
    assert_eq!((held(&fused), held(&plain)), (bytes, 2 * bytes), "bytes held after forward");

    // Strided inputs, broadcasting, and other dtypes.
    let block = with_seed(4, || Tensor::randn([2, 3, 5, 7], (Kind::Float, Device::Cpu)));
    let (gs, us) = (block.get(0).transpose(0, 2), block.get(1).transpose(0, 2));
    let ds = with_seed(5, || Tensor::randn(gs.size(), (Kind::Float, Device::Cpu)));
    let (a, da, _) = with_grads(&fused, swiglu, &[&gs, &us], 2, &ds);
    let (b, db, _) = with_grads(&fused, swiglu, &[&gs.contiguous(), &us.contiguous()], 2, &ds.contiguous());
    assert!(
        a.equal(&b) && da[0].equal(&db[0]) && da[1].equal(&db[1]),
        "transposed inputs give the contiguous ones' values"
    );
    let (g2, u1) = (gate.narrow(0, 0, 1000).view([4, 250]), up.narrow(0, 0, 250).view([1, 250]));
    let d2 = dy.narrow(0, 0, 1000).view([4, 250]);
    let double = |t: &Tensor| t.to_kind(Kind::Double);
    for (what, g, u, d) in [
        ("broadcast up", g2.shallow_clone(), u1.shallow_clone(), d2.shallow_clone()),
        ("f64", double(&g2), double(&g2.flip([0])), double(&d2)),
    ] {
        let (a, da, node) = with_grads(&fused, swiglu, &[&g, &u], 2, &d);
        let (b, db, _) = with_grads(&plain, swiglu, &[&g, &u], 2, &d);
        assert!(!node.contains("SwiGlu"), "{what}: libtorch's ops");
        assert!(a.equal(&b) && da[0].equal(&db[0]) && da[1].equal(&db[1]), "{what}: libtorch's values, bit for bit");
    }
}

/// RMSNorm and its gradients in f64: y = x·r·w with r = 1/√(mean(x²) + eps),
/// dx = r·(w·dy − x·r²·mean(w·dy·x)), dw = Σ over rows of dy·x·r.
fn exact_rms_norm(x: &Tensor, w: &Tensor, dy: &Tensor, eps: f64) -> (Tensor, Tensor, Tensor) {
    let (x, w, dy) = (x.to_kind(Kind::Double), w.to_kind(Kind::Double), dy.to_kind(Kind::Double));
    let mean = |t: &Tensor| t.mean_dim(-1, true, Kind::Double);
    let r = (mean(&x.square()) + eps).rsqrt();
    let y = &x * &r * &w;
    let dx = &r * (&w * &dy - &x * r.square() * mean(&(&w * &dy * &x)));
    let dw = (&dy * &x * &r).reshape([-1, *x.size().last().unwrap()]).sum_dim_intlist(0, false, Kind::Double);
    (y, dx, dw)
}

#[test]
fn fused_rms_norm_is_the_exact_norm_within_1e_6_keeping_half_as_much() {
    let _serial = serial();
    let fused = replacing("FusedRMSNorm");
    let plain = Arc::new(UnitCompute::default());
    let eps = 1e-5;
    let norm = |t: &[Tensor]| layers::rms_norm(&t[0], &t[1], eps);
    // Rows of very different scales (e^−6 to e^6), more rows than one thread's share; rows
    // whose length is no multiple of the kernel's 16 partial sums.
    // And many short rows, whose weight gradient sums 16 384 of them (over two threads
    // when two are set).
    for (shape, d) in [([4, 96], 256), ([3, 5], 70), ([64, 256], 16)] {
        let rows = shape[0] * shape[1];
        let scales = with_seed(1, || Tensor::randn([shape[0], shape[1], 1], (Kind::Float, Device::Cpu)) * 2.0).exp();
        let x = with_seed(2, || Tensor::randn([shape[0], shape[1], d], (Kind::Float, Device::Cpu))) * scales;
        let w = with_seed(3, || Tensor::randn([d], (Kind::Float, Device::Cpu))) * 0.1 + 1.0;
        let dy = with_seed(4, || Tensor::randn(x.size(), (Kind::Float, Device::Cpu)));
        let single = Threads::set(1);
        let ((y, grads), (reference_y, reference_grads)) =
            kernel_and_composite(&fused, &plain, norm, &[&x, &w], &dy, "RmsNorm");
        let (exact_y, exact_dx, exact_dw) = exact_rms_norm(&x, &w, &dy, eps);
        let forward = worst_relative(&y, &exact_y, 1e-30);
        assert!(forward < 1e-6, "d {d}: forward within 1e-6 of the exact norm, worst {forward:e}");
        for (what, got, exact, reference) in [
            ("input", &grads[0], &exact_dx, &reference_grads[0]),
            ("weight", &grads[1], &exact_dw, &reference_grads[1]),
        ] {
            let err = rel(&got.to_kind(Kind::Double), exact);
            assert!(err < 1e-6, "d {d}: {what} gradient within 1e-6 of the exact one, {err:e}");
            assert!(rel(got, reference) < 1e-5, "d {d}: {what} gradient near libtorch's: {:e}", rel(got, reference));
        }
        assert!(rel(&y, &reference_y) < 1e-6, "d {d}: forward near libtorch's");
        assert!(!grads[0].equal(&reference_grads[0]), "a kernel of its own computes the input's gradient");

        // Two threads: rows are each computed whole, so the output and the input's gradient
        // keep every bit; the weight's sums its rows in another order.
        drop(single);
        let two = Threads::set(2);
        let (y2, grads2, _) = with_grads(&fused, norm, &[&x, &w], 2, &dy);
        drop(two);
        assert!(y2.equal(&y) && grads2[0].equal(&grads[0]), "d {d}: the same rows on two threads");
        assert!(rel(&grads2[1], &grads[1]) < 1e-6, "d {d}: the weight's gradient on two threads");

        // Held after forward beside the inputs: the output and one scale per row, where
        // libtorch's composite also keeps the normalised input.
        strata_ext::cpu_memory::track().unwrap();
        let held = |policy: &Arc<UnitCompute>| {
            let (xg, wg) = (x.detach().set_requires_grad(true), w.detach().set_requires_grad(true));
            let before = strata_ext::cpu_memory::stats().unwrap().0;
            let y = compute::run(policy, Default::default(), false, || layers::rms_norm(&xg, &wg, eps)).unwrap();
            let bytes = strata_ext::cpu_memory::stats().unwrap().0 - before;
            drop(y);
            bytes
        };
        let output = rows * d * 4;
        let (fused_bytes, plain_bytes) = (held(&fused), held(&plain));
        assert_eq!(fused_bytes, output + rows * 4, "d {d}: bytes held after forward");
        assert!(plain_bytes >= 2 * output, "d {d}: libtorch's composite held {plain_bytes}");
    }

    // A second derivative is refused; other dtypes keep libtorch's ops, bit for bit.
    let x = with_seed(5, || Tensor::randn([6, 32], (Kind::Float, Device::Cpu)));
    let w = Tensor::ones([32], (Kind::Float, Device::Cpu));
    let (xg, wg) = (x.set_requires_grad(true), w.set_requires_grad(true));
    let yg = compute::run(&fused, Default::default(), false, || layers::rms_norm(&xg, &wg, eps)).unwrap();
    let options = strata_ext::GradOptions { retain_graph: true, create_graph: true, allow_unused: false };
    let err = strata_ext::grad(&[&yg], &[&yg.ones_like()], &[&xg], options).unwrap_err();
    assert!(err.to_string().contains("no second derivative"), "{err}");
    let (xd, wd) = (x.to_kind(Kind::Double), w.to_kind(Kind::Double));
    let dy = x.ones_like().to_kind(Kind::Double);
    let (a, da, node) = with_grads(&fused, norm, &[&xd, &wd], 2, &dy);
    let (b, db, _) = with_grads(&plain, norm, &[&xd, &wd], 2, &dy);
    assert!(!node.contains("RmsNorm") && a.equal(&b) && da[0].equal(&db[0]), "f64 runs libtorch's ops");
}

#[test]
fn fused_rope_rotates_as_the_composite_does_and_declines_what_it_does_not_serve() {
    let _serial = serial();
    let fused = replacing("FusedRoPE");
    let plain = Arc::new(UnitCompute::default());
    let rope = |t: &[Tensor]| layers::rotary(&t[0], &t[1], &t[2]);
    // Distinct sizes, so batch, head and position cannot stand in for one another.
    let (b, h, t, d) = (2, 3, 128, 64);
    // Heads split from [B, T, H·D] rows, as attention makes them: a strided view.
    let x = with_seed(1, || Tensor::randn([b, t, h, d], (Kind::Float, Device::Cpu))).transpose(1, 2);
    let angles = with_seed(2, || Tensor::rand([t, d], (Kind::Float, Device::Cpu))) * 6.0;
    let (cos, sin) = (angles.cos(), angles.sin());
    let dy = with_seed(3, || Tensor::randn([b, h, t, d], (Kind::Float, Device::Cpu)));
    let single = Threads::set(1);
    let (y, grads, node) = with_grads(&fused, rope, &[&x, &cos, &sin], 1, &dy);
    let (reference_y, reference_grads, reference_node) = with_grads(&plain, rope, &[&x, &cos, &sin], 1, &dy);
    assert!(node.contains("Rotary"), "Strata's kernel made the output, got node {node:?}");
    assert!(!reference_node.contains("Rotary"), "libtorch's ops without the replacement");
    assert!(!grads[1].defined() && !grads[2].defined(), "the tables take no gradient");
    // The composite in f64 as the exact values.
    let double = |t: &Tensor| t.to_kind(Kind::Double);
    let (exact_y, exact_grads, _) =
        with_grads(&plain, rope, &[&double(&x), &double(&cos), &double(&sin)], 1, &double(&dy));
    for (what, ours, theirs, exact) in
        [("output", &y, &reference_y, &exact_y), ("input gradient", &grads[0], &reference_grads[0], &exact_grads[0])]
    {
        // Two products and a sum in fp32, fused or not depending on the CPU's kernel clone.
        assert!(rel(ours, exact) < 3e-7, "{what} within 3e-7 of the exact one: {:e}", rel(ours, exact));
        assert!(rel(ours, theirs) < 3e-7, "{what} near libtorch's: {:e}", rel(ours, theirs));
    }

    drop(single);
    let two = Threads::set(2);
    let (y2, grads2, _) = with_grads(&fused, rope, &[&x, &cos, &sin], 1, &dy);
    drop(two);
    assert!(y2.equal(&y) && grads2[0].equal(&grads[0]), "the same values on two threads");
    let (yc, gc, _) = with_grads(&fused, rope, &[&x.contiguous(), &cos, &sin], 1, &dy);
    assert!(yc.equal(&y) && gc[0].equal(&grads[0]), "a contiguous input gives the strided one's values");
    let empty = Tensor::zeros([0, h, t, d], (Kind::Float, Device::Cpu));
    let (ye, _, _) = with_grads(&fused, rope, &[&empty, &cos, &sin], 1, &empty);
    assert_eq!(ye.size(), vec![0, h, t, d]);

    // What the kernel declines runs libtorch's ops: tables that take gradients, tables
    // broadcast over positions, other dtypes.
    let one_row = |t: &Tensor| t.narrow(0, 0, 1);
    for (what, inputs) in [
        ("tables with gradients", vec![x.shallow_clone(), cos.detach().set_requires_grad(true), sin.shallow_clone()]),
        ("broadcast tables", vec![x.shallow_clone(), one_row(&cos), one_row(&sin)]),
        ("f64", vec![double(&x), double(&cos), double(&sin)]),
    ] {
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let g = if what == "f64" { double(&dy) } else { dy.shallow_clone() };
        let (a, da, node) = with_grads(&fused, rope, &refs, 1, &g);
        let (b, db, _) = with_grads(&plain, rope, &refs, 1, &g);
        assert!(!node.contains("Rotary"), "{what}: libtorch's ops");
        assert!(a.equal(&b) && da[0].equal(&db[0]), "{what}: libtorch's values, bit for bit");
    }
}

/// One forward and backward of `batch` on `engine`, its gradients added to what it holds.
fn backward_on(engine: &mut Engine, batch: &Batch) {
    let out = engine.forward(&batch.inputs).unwrap();
    engine.backward(&layers::cross_entropy(&out, &batch.targets).unwrap()).unwrap();
}

/// Under `amp_native` a weight's gradient goes from the product's dtype straight into its
/// slot of the unit's flat gradient buffer: backward never holds an fp32 gradient of a
/// weight beside the buffer, and what lands is what accumulating the plain cast gives.
#[test]
fn amp_converts_weight_gradients_straight_into_the_gradient_buffer() {
    let _serial = serial();
    strata_ext::cpu_memory::track().unwrap();
    // Wide weights and four tokens: a block's gradients outweigh everything else backward holds.
    const WIDE: GptConfig = GptConfig::new(32, 4, 1, 4, 256);
    let amp_engine = || {
        let mut b = Builder::new();
        model::gpt(&WIDE, &mut b).unwrap();
        // The engine draws its initial weights from its own seed: both engines start alike.
        let mut e = Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap();
        let amp = UnitCompute { autocast: Some(Kind::BFloat16), ..Default::default() };
        e.set_compute(vec![amp; e.spec().units.len()]).unwrap();
        e
    };
    let batch = |seed| {
        tch::manual_seed(seed);
        let tokens = Tensor::randint(32, [1, 5], (Kind::Int64, Device::Cpu));
        Batch::new(tokens.narrow(1, 0, 4), tokens.narrow(1, 1, 4)).unwrap()
    };
    let (a, b) = (batch(1), batch(2));
    let (mut ab, mut ba) = (amp_engine(), amp_engine());
    // Zeroed, as a step starts: the next backward's gradients are fresh.
    ab.zero_grad().unwrap();
    ba.zero_grad().unwrap();
    let out = ab.forward(&a.inputs).unwrap();
    let loss = layers::cross_entropy(&out, &a.targets).unwrap();
    let base = strata_ext::cpu_memory::stats().unwrap().0;
    strata_ext::cpu_memory::reset_peak().unwrap();
    ab.backward(&loss).unwrap();
    let peak = strata_ext::cpu_memory::stats().unwrap().1 - base;
    let block = (ab.storage()[1].grad.numel() * 4) as i64;
    eprintln!("backward's peak: {peak} bytes beside a block of {block} bytes of fp32 gradients");
    assert!(peak < block / 2, "backward held {peak} bytes beside {block} of the block's gradients");
    // The first backward's gradients go into the slots, the second's add to them: in either
    // order the sums are the same, bit for bit, but for the tied embedding's (unit 0's),
    // which sums four gradients in two orders.
    backward_on(&mut ab, &b);
    backward_on(&mut ba, &b);
    backward_on(&mut ba, &a);
    for (k, (x, y)) in ab.storage().iter().zip(ba.storage()).enumerate() {
        let gap = rel(&x.grad, &y.grad);
        assert!(if k == 0 { gap < 1e-6 } else { gap == 0.0 }, "unit {k}: a then b differs from b then a by {gap:e}");
        assert!(x.grad.abs().max().double_value(&[]) > 0.0, "unit {k} got a gradient");
    }
}

/// A weight's gradient under `amp_native`, through its slot in a gradient buffer or not: the
/// slot becomes `.grad` where the weight is used once, and serves the first cast alone where
/// it is used twice; the values are the plain cast's either way, bit for bit.
#[test]
fn a_weight_s_slot_takes_its_gradient_once_per_forward() {
    let _serial = serial();
    let amp = Arc::new(UnitCompute { autocast: Some(Kind::BFloat16), ..Default::default() });
    let x = Tensor::randn([3, 8], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([8, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let buffer = Tensor::zeros([72], (Kind::Float, Device::Cpu));
    // The gradient of `uses` products by `w`, with `w`'s slot offered or not.
    let grad = |uses: usize, slot: bool| {
        strata_ext::set_grad(&w, None).unwrap();
        let grad_slots =
            if slot { vec![(w.data_ptr() as usize, buffer.narrow(0, 8, 64).view([8, 8]))] } else { vec![] };
        let weights = compute::UnitWeights { fp8: vec![], grad_slots };
        let y = compute::run(&amp, weights, false, || {
            let mut y = x.shallow_clone();
            for _ in 0..uses {
                y = layers::linear(&y, &w, None)?;
            }
            Ok(y)
        })
        .unwrap();
        y.to_kind(Kind::Float).sum(Kind::Float).backward();
        w.grad()
    };
    for uses in [1, 2] {
        let (plain, slotted) = (grad(uses, false), grad(uses, true));
        assert!(slotted.equal(&plain), "{uses} uses: the slot's gradient differs from the plain cast's");
        let in_buffer = strata_ext::storage_id(&slotted).unwrap() == strata_ext::storage_id(&buffer).unwrap();
        assert!(uses == 2 || in_buffer, "one use: the gradient is the slot itself");
    }
}

#[test]
fn amp_computes_products_in_low_precision_and_norms_and_loss_in_fp32() {
    let _serial = serial();
    let amp = Arc::new(UnitCompute { autocast: Some(Kind::BFloat16), ..Default::default() });
    let x = Tensor::randn([2, 4, 16], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([16, 16], (Kind::Float, Device::Cpu));
    let ones = Tensor::ones([16], (Kind::Float, Device::Cpu));
    let (y, n, l) = compute::run(&amp, Default::default(), false, || {
        let y = layers::linear(&x, &w, None)?;
        let n = layers::layer_norm(&y, &ones, &ones.zeros_like(), 1e-5)?;
        let l = layers::cross_entropy(&y, &Tensor::zeros([2, 4], (Kind::Int64, Device::Cpu)))?;
        Ok((y, n, l))
    })
    .unwrap();
    assert_eq!((y.kind(), n.kind(), l.kind()), (Kind::BFloat16, Kind::Float, Kind::Float));
    assert_eq!(layers::linear(&x, &w, None).unwrap().kind(), Kind::Float, "outside a unit nothing is cast");
}
