use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use strata_ext::*;
use tch::{Kind, Tensor};

fn close(a: &Tensor, b: &Tensor, tol: f64) -> bool {
    (a - b).abs().max().double_value(&[]) <= tol
}

#[test]
fn backward_seeds_outputs_with_given_gradients() {
    let x = Tensor::from_slice(&[1.0f64, 2.0, 3.0]).set_requires_grad(true);
    let y = &x * &x;
    let upstream = Tensor::from_slice(&[1.0f64, 10.0, 100.0]);
    backward(&[&y], &[&upstream], false).unwrap();
    // d(x^2)/dx * upstream = 2x * upstream
    assert!(close(&x.grad(), &Tensor::from_slice(&[2.0f64, 40.0, 600.0]), 0.0));
}

#[test]
fn grad_returns_without_accumulating_and_reports_unused() {
    let x = Tensor::from_slice(&[2.0f64]).set_requires_grad(true);
    let unused = Tensor::from_slice(&[5.0f64]).set_requires_grad(true);
    let y = x.pow_tensor_scalar(3);
    let ones = Tensor::ones_like(&y);
    let options = GradOptions { allow_unused: true, ..Default::default() };
    let g = grad(&[&y], &[&ones], &[&x, &unused], options).unwrap();
    assert!(close(g[0].as_ref().unwrap(), &Tensor::from_slice(&[12.0f64]), 1e-12));
    assert!(g[1].is_none());
    assert!(!x.grad().defined(), "grad must not accumulate into .grad");
}

#[test]
fn set_grad_makes_autograd_accumulate_into_a_flat_buffer_view() {
    let flat_grad = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
    let w = Tensor::ones([2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    set_grad(&w, Some(&flat_grad.narrow(0, 2, 2))).unwrap();
    (&w * 3.0).sum(Kind::Float).backward();
    (&w * 4.0).sum(Kind::Float).backward();
    assert_eq!(Vec::<f32>::try_from(&flat_grad).unwrap(), vec![0.0, 0.0, 7.0, 7.0]);
}

#[test]
fn hooks_see_and_replace_gradients_and_can_be_removed() {
    let calls = Arc::new(AtomicUsize::new(0));
    let x = Tensor::from_slice(&[1.0f32, 1.0]).set_requires_grad(true);
    let seen = calls.clone();
    let hook = register_hook(&x, move |g| {
        seen.fetch_add(1, Ordering::SeqCst);
        Some(g * 2.0)
    })
    .unwrap();
    (&x * 5.0).sum(Kind::Float).backward();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(Vec::<f32>::try_from(&x.grad()).unwrap(), vec![10.0, 10.0]);
    hook.remove(&x).unwrap();
    (&x * 5.0).sum(Kind::Float).backward();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "removed hook must not run");
    assert_eq!(Vec::<f32>::try_from(&x.grad()).unwrap(), vec![15.0, 15.0]);
}

/// y = a * x with a Rust backward; also counts drops to prove the closure is freed.
struct Scale {
    factor: f64,
    dropped: Arc<AtomicUsize>,
}
impl Drop for Scale {
    fn drop(&mut self) {
        self.dropped.fetch_add(1, Ordering::SeqCst);
    }
}
impl Function for Scale {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![&inputs[0] * self.factor])
    }
    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![&grads[0] * self.factor])
    }
}

#[test]
fn custom_function_runs_rust_forward_and_backward() {
    let dropped = Arc::new(AtomicUsize::new(0));
    let x = Tensor::from_slice(&[1.0f64, -2.0]).set_requires_grad(true);
    {
        let y = apply_function(Scale { factor: 3.0, dropped: dropped.clone() }, &[&x]).unwrap();
        assert!(close(&y[0], &Tensor::from_slice(&[3.0f64, -6.0]), 0.0));
        (&y[0] * &y[0]).sum(Kind::Double).backward();
        // d/dx (3x)^2 = 18 x
        assert!(close(&x.grad(), &Tensor::from_slice(&[18.0f64, -36.0]), 1e-12));
    }
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "the closure is freed with its graph");
}

struct Failing;
impl Function for Failing {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Ok(vec![inputs[0].shallow_clone() * 1.0])
    }
    fn backward(&mut self, _: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        Err("backward refused on purpose".into())
    }
}

#[test]
fn a_failing_rust_backward_is_an_error_not_a_crash() {
    let x = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
    let y = apply_function(Failing, &[&x]).unwrap();
    let seed = Tensor::ones_like(&y[0]);
    let err = backward(&[&y[0]], &[&seed], false).unwrap_err();
    assert!(err.0.contains("backward refused on purpose"), "{err}");
}

#[test]
fn storage_can_be_freed_and_refilled_under_live_views() {
    let mut flat = Tensor::arange(8, (Kind::Float, tch::Device::Cpu));
    let view = flat.narrow(0, 4, 4);
    assert_eq!(storage_nbytes(&flat).unwrap(), 32);
    // SAFETY: neither view is touched while the storage is empty; `flat` spans it.
    unsafe { resize_storage(&flat, 0) }.unwrap();
    assert_eq!(storage_nbytes(&view).unwrap(), 0, "views share the freed storage");
    unsafe { resize_storage(&flat, 32) }.unwrap();
    flat.copy_(&Tensor::full([8], 7.0, (Kind::Float, tch::Device::Cpu)));
    assert_eq!(Vec::<f32>::try_from(&view).unwrap(), vec![7.0; 4]);
}

#[test]
fn fused_adamw_matches_the_textbook_update() {
    let p0 = Tensor::from_slice(&[0.5f32, -1.0, 2.0]);
    let g = Tensor::from_slice(&[0.1f32, -0.2, 0.3]);
    let params = vec![p0.copy()];
    let (m, v, s) = (vec![p0.zeros_like()], vec![p0.zeros_like()], vec![Tensor::from(0.0f32)]);
    let h =
        AdamStep { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1, decoupled: true, maximize: false };
    let t = AdamTensors { params: &params, grads: &[g.shallow_clone()], exp_avgs: &m, exp_avg_sqs: &v, steps: &s };
    for step in 1..=2 {
        fused_adam(&t, h, DeviceInputs::default()).unwrap();
        assert_eq!(s[0].double_value(&[]), step as f64);
    }
    // Reference: two AdamW steps with a constant gradient.
    let mut p = p0.copy();
    let (mut mm, mut vv) = (p0.zeros_like(), p0.zeros_like());
    for step in 1..=2 {
        p = &p * (1.0 - h.lr * h.weight_decay);
        mm = &mm * h.beta1 + &g * (1.0 - h.beta1);
        vv = &vv * h.beta2 + (&g * &g) * (1.0 - h.beta2);
        let mhat = &mm / (1.0 - h.beta1.powi(step));
        let vhat = &vv / (1.0 - h.beta2.powi(step));
        p = &p - mhat / (vhat.sqrt() + h.eps) * h.lr;
    }
    assert!(close(&params[0], &p, 1e-6));
}

#[test]
fn fused_sgd_applies_nesterov_momentum() {
    let p = vec![Tensor::from_slice(&[1.0f32])];
    let g = vec![Tensor::from_slice(&[0.5f32])];
    let buf = vec![Tensor::zeros([1], (Kind::Float, tch::Device::Cpu))];
    let mut h = SgdStep {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: true,
        maximize: false,
        is_first_step: true,
    };
    fused_sgd(&p, &g, &buf, h, DeviceInputs::default()).unwrap();
    // buf = g = 0.5; step = g + 0.9 * buf = 0.95
    assert!((p[0].double_value(&[0]) - (1.0 - 0.095)).abs() < 1e-6);
    h.is_first_step = false;
    fused_sgd(&p, &g, &buf, h, DeviceInputs::default()).unwrap();
    // buf = 0.9 * 0.5 + 0.5 = 0.95; step = 0.5 + 0.9 * 0.95 = 1.355
    assert!((p[0].double_value(&[0]) - (0.905 - 0.1355)).abs() < 1e-6);
}

#[test]
fn fused_adam_skips_the_step_when_found_inf_is_set() {
    let params = vec![Tensor::from_slice(&[1.0f32])];
    let zeros = || vec![Tensor::zeros([1], (Kind::Float, tch::Device::Cpu))];
    let (m, v) = (zeros(), zeros());
    let s = vec![Tensor::from(0.0f32)];
    let found_inf = Tensor::from(1.0f32);
    let scale = Tensor::from(1.0f32);
    let t = AdamTensors {
        params: &params,
        grads: &[Tensor::from_slice(&[1.0f32])],
        exp_avgs: &m,
        exp_avg_sqs: &v,
        steps: &s,
    };
    let h =
        AdamStep { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false, maximize: false };
    fused_adam(&t, h, DeviceInputs { grad_scale: Some(&scale), found_inf: Some(&found_inf), lr: None }).unwrap();
    assert_eq!(params[0].double_value(&[0]), 1.0);
}

#[test]
fn a_non_blocking_copy_writes_its_destination_and_a_bad_one_is_an_error() {
    let src = Tensor::arange(6, (Kind::Float, tch::Device::Cpu));
    let dst = Tensor::zeros([6], (Kind::Float, tch::Device::Cpu));
    // SAFETY: on the CPU the copy is done when the call returns.
    unsafe { strata_ext::copy_non_blocking(&dst, &src) }.unwrap();
    assert_eq!(Vec::<f32>::try_from(&dst).unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let short = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
    // SAFETY: as above; the shapes do not match, so nothing is written.
    assert!(unsafe { strata_ext::copy_non_blocking(&short, &src) }.is_err());
    if !(tch::Cuda::is_available() && cuda::is_built()) {
        return;
    }
    // From page-locked memory to the GPU: queued without the host waiting.
    let gpu = tch::Device::Cuda(0);
    let (pinned, on_gpu) = (src.pin_memory(gpu), Tensor::zeros([6], (Kind::Float, gpu)));
    cuda::count_syncs(true).unwrap();
    let before = cuda::syncs_counted();
    // SAFETY: the values are read below through the same stream, and both buffers live on.
    unsafe { strata_ext::copy_non_blocking(&on_gpu, &pinned) }.unwrap();
    let queued = cuda::syncs_counted() - before;
    cuda::count_syncs(false).unwrap();
    assert_eq!(queued, 0, "the host did not wait");
    assert_eq!(Vec::<f32>::try_from(&on_gpu.to_device(tch::Device::Cpu)).unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
}

#[test]
fn cuda_calls_work_on_a_gpu_and_fail_cleanly_without_one() {
    if tch::Cuda::is_available() && cuda::is_built() {
        let stats = cuda::memory_stats(0).unwrap();
        assert!(stats.reserved >= stats.allocated);
        let stream = cuda::Stream::from_pool(0, false).unwrap();
        let (a, b) = (cuda::Event::new(true).unwrap(), cuda::Event::new(true).unwrap());
        a.record(&stream).unwrap();
        b.record(&stream).unwrap();
        b.synchronize().unwrap();
        assert!(a.elapsed_ms(&b).unwrap() >= 0.0);
        assert!(!cuda::device_name(0).unwrap().is_empty());
        // Kernels queue without a synchronisation; reading a value back is one, and so is
        // waiting for an event.
        let x = Tensor::ones([1024], (Kind::Float, tch::Device::Cuda(0)));
        cuda::count_syncs(true).unwrap();
        let before = cuda::syncs_counted();
        let y = (&x * 2.0).sum(Kind::Float);
        let queued = cuda::syncs_counted() - before;
        assert_eq!(y.double_value(&[]), 2048.0);
        let read = cuda::syncs_counted() - before - queued;
        b.synchronize().unwrap();
        let waited = cuda::syncs_counted() - before - queued - read;
        cuda::count_syncs(false).unwrap();
        assert_eq!((queued, read, waited), (0, 1, 1));
        return;
    }
    let err = cuda::memory_stats(0).unwrap_err();
    assert!(cuda::count_syncs(true).is_err());
    assert!(err.0.contains("CUDA"), "{err}");
    assert!(cuda::Event::new(false).is_err());
    assert!(cuda::Stream::from_pool(0, false).is_err());
}

#[test]
fn a_cuda_graph_replays_its_work_with_what_its_inputs_hold_then() {
    if !(tch::Cuda::is_available() && cuda::is_built()) {
        let err = cuda::Graph::capture(0, || Ok::<_, ExtError>(())).err().expect("no GPU, no capture");
        assert!(err.0.contains("CUDA"), "{err}");
        eprintln!("a_cuda_graph_replays_its_work_with_what_its_inputs_hold_then: skipped, no GPU");
        return;
    }
    let gpu = tch::Device::Cuda(0);
    let h =
        AdamStep { lr: 0.0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, decoupled: true, maximize: false };
    // Two copies of one parameter: one updated by replays of a captured step whose learning
    // rate lives on the device, one by eager steps given each rate on the host.
    let state = || {
        let p = vec![Tensor::linspace(-1.0, 1.0, 64, (Kind::Float, gpu))];
        let zeros = || vec![Tensor::zeros([64], (Kind::Float, gpu))];
        (p, zeros(), zeros(), vec![Tensor::zeros([], (Kind::Float, gpu))])
    };
    let (gp, gm, gv, gs) = state();
    let (ep, em, ev, es) = state();
    let grad = Tensor::zeros([64], (Kind::Float, gpu));
    let lr = Tensor::zeros([], (Kind::Float, gpu));
    let t = |p, m, v, s| AdamTensors {
        params: p,
        grads: std::slice::from_ref(&grad),
        exp_avgs: m,
        exp_avg_sqs: v,
        steps: s,
    };
    let (graph, doubled) = cuda::Graph::capture(0, || {
        fused_adam(&t(&gp, &gm, &gv, &gs), h, DeviceInputs { lr: Some(&lr), ..Default::default() })?;
        Ok::<_, ExtError>(&grad * 2.0)
    })
    .unwrap();
    assert_eq!(gs[0].double_value(&[]), 0.0, "capturing runs nothing");
    for (i, rate) in [1e-2, 5e-3, 2.5e-3].into_iter().enumerate() {
        grad.shallow_clone().copy_(&Tensor::linspace(0.5, -0.5 * i as f64, 64, (Kind::Float, gpu)));
        let _ = lr.shallow_clone().fill_(rate);
        graph.replay().unwrap();
        fused_adam(&t(&ep, &em, &ev, &es), AdamStep { lr: rate as f32 as f64, ..h }, DeviceInputs::default()).unwrap();
        assert!(close(&doubled, &(&grad * 2.0), 0.0), "replay {i} reads the input as it is now");
    }
    assert_eq!(gs[0].double_value(&[]), 3.0, "three replays, three steps");
    assert!(close(&gp[0], &ep[0], 1e-6), "replayed updates equal eager ones");
    assert!(!close(&gp[0], &Tensor::linspace(-1.0, 1.0, 64, (Kind::Float, gpu)), 1e-4), "the parameter moved");
    // A capture whose host code fails, or that waits for the device, is dropped; the stream
    // it ran on works on.
    let err = cuda::Graph::capture(0, || Err::<(), _>(ExtError("stopped".into()))).err().expect("an error");
    assert_eq!(err.0, "stopped");
    let waited = cuda::Graph::capture(0, || {
        let x = Tensor::ones([4], (Kind::Float, gpu));
        x.f_sum(Kind::Float).and_then(|s| s.f_double_value(&[])).map_err(|e| ExtError(e.to_string()))
    });
    assert!(waited.is_err(), "a read of a value cannot be captured");
    assert_eq!(Tensor::ones([4], (Kind::Float, gpu)).sum(Kind::Float).double_value(&[]), 4.0);
}

#[test]
fn a_linear_weight_gradient_and_its_bias_come_from_one_product() {
    let cpu = |rows, cols, seed| {
        tch::manual_seed(seed);
        Tensor::randn([rows, cols], (Kind::Float, tch::Device::Cpu))
    };
    let (g, x) = (cpu(300, 24, 1), cpu(300, 40, 2));
    let (dw, db) = (
        Tensor::zeros([24, 40], (Kind::Float, tch::Device::Cpu)),
        Tensor::zeros([24], (Kind::Float, tch::Device::Cpu)),
    );
    assert!(!kernels::linear_weight_grad(&g, &x, &dw, Some(&db), false).unwrap(), "a CPU tensor is not served");
    if !(tch::Cuda::is_available() && cuda::is_built()) {
        eprintln!("a_linear_weight_gradient_and_its_bias_come_from_one_product: skipped, no GPU");
        return;
    }
    let gpu = tch::Device::Cuda(0);
    let relative =
        |a: &Tensor, b: &Tensor| ((a.to_device(tch::Device::Cpu) - b).abs().max() / b.abs().max()).double_value(&[]);
    for (kind, into, bound) in [
        (Kind::Float, Kind::Float, 1e-5),
        (Kind::BFloat16, Kind::Float, 1e-5),
        (Kind::BFloat16, Kind::BFloat16, 1e-2),
        (Kind::Half, Kind::Half, 2e-3),
    ] {
        let (g, x) = (g.to_kind(kind).to_device(gpu), x.to_kind(kind).to_device(gpu));
        // The exact product of the operands as stored (a bf16 or fp16 operand's rounding is
        // not the product's error).
        let stored = |t: &Tensor| t.to_device(tch::Device::Cpu).to_kind(Kind::Float);
        let (want_w, want_b) =
            (stored(&g).tr().mm(&stored(&x)), stored(&g).sum_dim_intlist([0].as_slice(), false, Kind::Float));
        let dw = Tensor::full([24, 40], 7.0, (into, gpu));
        let db = Tensor::full([24], 7.0, (into, gpu));
        assert!(kernels::linear_weight_grad(&g, &x, &dw, Some(&db), false).unwrap(), "{kind:?} into {into:?} served");
        let (ew, eb) = (relative(&dw.to_kind(Kind::Float), &want_w), relative(&db.to_kind(Kind::Float), &want_b));
        eprintln!("{kind:?} into {into:?}: weight {ew:.2e}, bias {eb:.2e}");
        assert!(ew < bound && eb < bound, "{kind:?} into {into:?}: weight {ew:e}, bias {eb:e}");
        // Accumulating adds the product to what the gradient holds; the bias is written.
        assert!(kernels::linear_weight_grad(&g, &x, &dw, None, true).unwrap());
        let twice = relative(&dw.to_kind(Kind::Float), &(&want_w * 2.0));
        assert!(twice < bound, "{kind:?}: accumulated {twice:e}");
        assert!(relative(&db.to_kind(Kind::Float), &want_b) < bound, "no bias asked, none written");
    }
    // Shapes it does not take are declined, nothing written.
    let (g, x) = (g.to_device(gpu), x.to_device(gpu));
    let dw = Tensor::zeros([24, 40], (Kind::Float, gpu));
    assert!(!kernels::linear_weight_grad(&g, &x.narrow(0, 0, 299), &dw, None, false).unwrap(), "rows differ");
    assert!(!kernels::linear_weight_grad(&g, &x.tr().contiguous().tr(), &dw, None, false).unwrap(), "not contiguous");
    assert!(!kernels::linear_weight_grad(&g.to_kind(Kind::BFloat16), &x, &dw, None, false).unwrap(), "dtypes differ");
    assert_eq!(dw.abs().sum(Kind::Float).double_value(&[]), 0.0);
}

#[test]
fn the_cuda_kernels_compile_for_every_dtype_without_a_device() {
    if !cuda::is_built() {
        let err = cuda::compile_kernels("sm_90").unwrap_err();
        assert!(err.0.contains("without CUDA"), "{err}");
        eprintln!(
            "the_cuda_kernels_compile_for_every_dtype_without_a_device: skipped, built against a libtorch without CUDA"
        );
        return;
    }
    // Hopper; NVRTC needs no GPU to compile for it. The sources branch on no architecture,
    // so one compiles them all (each architecture costs some 20 s on two cores).
    cuda::compile_kernels("sm_90").unwrap();
    let err = cuda::compile_kernels("sm_1").unwrap_err();
    assert!(err.0.contains("NVRTC"), "{err}");
}

#[test]
fn cpu_memory_counts_allocations_and_their_release() {
    strata_ext::cpu_memory::track().unwrap();
    strata_ext::cpu_memory::reset_peak().unwrap();
    let (before, _) = strata_ext::cpu_memory::stats().unwrap();
    let t = tch::Tensor::zeros([1 << 20], (tch::Kind::Float, tch::Device::Cpu));
    let (during, peak) = strata_ext::cpu_memory::stats().unwrap();
    assert!(during - before >= 4 << 20, "4 MiB counted: {before} -> {during}");
    drop(t);
    let (after, peak_after) = strata_ext::cpu_memory::stats().unwrap();
    assert!(after < during && peak_after >= peak && peak >= during);
}

#[test]
fn nccl_tensor_lists_are_checked_before_anything_is_enqueued() {
    use strata_ext::nccl::{check_collective, Collective};
    let t = |n: i64| Tensor::zeros([n], (Kind::Float, tch::Device::Cpu));
    let (a, b, c, d) = (t(4), t(4), t(4), t(3));
    let half = Tensor::zeros([4], (Kind::Half, tch::Device::Cpu));
    assert!(check_collective(Collective::AllGather, &[&a, &b, &c], 1, 2).is_ok());
    assert!(check_collective(Collective::ReduceScatter, &[&a, &b, &c], 0, 2).is_ok());
    assert!(check_collective(Collective::AllToAll, &[&a, &d, &b, &d], 0, 2).is_ok());
    for (what, tensors, peer, needle) in [
        (Collective::AllReduce, vec![&a, &b], 0, "2 tensors for 2 ranks, expected 1"),
        (Collective::AllGather, vec![&a, &b], 0, "expected 3"),
        (Collective::Send, vec![&a], 2, "rank 2 outside a group of 2"),
        (Collective::ReduceScatter, vec![&a, &b, &d], 0, "tensor 2 holds 3 elements"),
        (Collective::AllGather, vec![&d, &a, &a], 0, "tensor 0 holds 3 elements"),
        (Collective::AllToAll, vec![&a, &b, &d, &c], 0, "tensor 0 holds 4 elements, tensor 2 3"),
        (Collective::ReduceScatter, vec![&a, &half, &b], 0, "mixed dtypes"),
    ] {
        let err = check_collective(what, &tensors, peer, 2).unwrap_err();
        assert!(err.0.contains(needle), "{what:?}: {err}");
    }
}

#[test]
fn pytorch_s_tcp_store_serves_and_answers_a_client() {
    use std::time::Duration;
    use strata_ext::c10d::TcpStore;
    let timeout = Duration::from_secs(5);
    let server = TcpStore::new("127.0.0.1", 0, true, timeout).unwrap();
    let client = TcpStore::new("127.0.0.1", server.port().unwrap(), false, timeout).unwrap();
    client.set("a", b"1").unwrap();
    assert_eq!(server.get("a", timeout).unwrap(), b"1");
    assert_eq!(client.add("n", 5).unwrap(), 5);
    assert_eq!(client.add("n", -2).unwrap(), 3);
    assert_eq!(client.compare_set("c", b"", b"x").unwrap(), b"x", "unset key: set");
    assert_eq!(client.compare_set("c", b"y", b"z").unwrap(), b"x", "mismatch: unchanged");
    assert!(client.check(&["a", "n"]).unwrap() && !client.check(&["missing"]).unwrap());
    let err = client.get("never", Duration::from_millis(200)).unwrap_err();
    assert!(err.0.to_lowercase().contains("timeout") || err.0.contains("timed out"), "{err}");
    client.wait(&["a", "c"], timeout).unwrap();
}

/// Saved values held as copies by ticket: backward must read the copies (scaled by 2 here,
/// so a backward that read the originals gives other gradients).
struct DoublingStore {
    values: std::sync::Mutex<Vec<Tensor>>,
    unpacked: std::sync::atomic::AtomicUsize,
}

impl strata_ext::saved_tensors::SavedTensorHooks for DoublingStore {
    fn pack(&self, t: &Tensor) -> std::result::Result<strata_ext::saved_tensors::Packed, String> {
        use strata_ext::saved_tensors::Packed;
        if t.numel() < 4 {
            return Ok(Packed::Keep);
        }
        let mut values = self.values.lock().unwrap();
        values.push(t.detach() * 2.0);
        Ok(Packed::Ticket(std::num::NonZeroU64::new(values.len() as u64).unwrap()))
    }

    fn unpack(&self, ticket: std::num::NonZeroU64) -> std::result::Result<Tensor, String> {
        self.unpacked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(self.values.lock().unwrap()[ticket.get() as usize - 1].shallow_clone())
    }
}

#[test]
fn saved_tensor_hooks_hold_what_backward_reads_only_inside_their_scope() {
    let x = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0]).set_requires_grad(true);
    let store = std::sync::Arc::new(DoublingStore { values: Default::default(), unpacked: Default::default() });
    let y = {
        let _scope = strata_ext::saved_tensors::push(store.clone()).unwrap();
        // `mul` saves both factors: x twice, each through the store.
        (&x * &x).sum(Kind::Double)
    };
    // Outside the scope nothing goes to the store.
    let z = (&x * &x).sum(Kind::Double);
    assert_eq!(store.values.lock().unwrap().len(), 2);
    strata_ext::backward(&[&y], &[&y.ones_like()], false).unwrap();
    // d(x·x)/dx read from copies holding 2x: 2x + 2x = 4x.
    assert!(close(&x.grad(), &(&x * 4.0), 0.0));
    assert_eq!(store.unpacked.load(std::sync::atomic::Ordering::SeqCst), 2);
    let _ = x.grad().zero_();
    strata_ext::backward(&[&z], &[&z.ones_like()], false).unwrap();
    assert!(close(&x.grad(), &(&x * 2.0), 0.0));
    // Kept values (under four elements) are the tensors themselves.
    let w = Tensor::from_slice(&[3.0f64]).set_requires_grad(true);
    let v = {
        let _scope = strata_ext::saved_tensors::push(store.clone()).unwrap();
        (&w * &w).sum(Kind::Double)
    };
    strata_ext::backward(&[&v], &[&v.ones_like()], false).unwrap();
    assert!(close(&w.grad(), &Tensor::from_slice(&[6.0f64]), 0.0));
    assert_eq!(store.values.lock().unwrap().len(), 2);
}
