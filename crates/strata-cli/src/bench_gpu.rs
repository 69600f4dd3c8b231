//! `strata bench gpu`: `strata bench train` on one GPU for the two models a user moving to a
//! GPU would try first, in bf16 autocast with fused attention and Strata's kernels, at the
//! shapes of the published anchors: GPT-2 small (124M) at 64 × 1024 tokens per step (llm.c's)
//! and a LLaMA of 1.1B parameters at 8 × 2048 (TinyLlama's), each against PyTorch eager and
//! under `torch.compile`; a slice of an 8B-shaped LLaMA (a few blocks at full width) in bf16
//! against fp8 linears, their speed and their loss after the same steps; and matrix products
//! in bf16 against fp8 at square and at layer shapes.
use crate::bench::{self, per_call_ms, Amp, BenchModel, BenchTrainArgs, Report};
use crate::bench_runs::GptShape;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use strata::compute::fp8::{self, Fp8Config, Fp8Scaling, Fp8Unit};
use tch::{Device, Kind, Tensor};

#[derive(Args, Debug, Clone)]
pub struct BenchGpuArgs {
    /// The GPU: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Sequences per step of GPT-2 (1024 tokens each).
    #[arg(long, default_value_t = 64)]
    gpt_batch_size: i64,
    /// Sequences per step of the LLaMA (2048 tokens each).
    #[arg(long, default_value_t = 8)]
    llama_batch_size: i64,
    /// Every side of the 1.1B LLaMA recomputes each block's activations (by default none
    /// does): room for its sides on one GPU at once.
    #[arg(long)]
    llama_checkpoint: bool,
    /// Blocks of the 8B-shaped LLaMA slice (width 4096, 32 heads, 8 key/value heads,
    /// feed-forward 14336), trained at 16 × 2048 tokens per step.
    #[arg(long, default_value_t = 4)]
    slice_layers: i64,
    /// Training steps of each side of the slice (its last loss compares fp8 with bf16).
    #[arg(long, default_value_t = 50)]
    slice_steps: u64,
    /// Leave out the `torch.compile` sides.
    #[arg(long)]
    no_compile: bool,
    /// Each side of each model alone on the GPU (`bench train --one-side-at-a-time`): for
    /// a GPU that cannot hold PyTorch's side beside Strata's (an 80 GB H100 at GPT-2's
    /// 64 × 1024 tokens, where PyTorch's eager side alone peaked at 65.3 GiB).
    #[arg(long)]
    one_side_at_a_time: bool,
    /// The parts measured, in this order: the models (gpt2, llama-1.1b, llama-8b-slice: bf16
    /// against fp8), the products in bf16 and fp8 (gemm), the experts' products (experts)
    /// and attention.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "gpt2,llama-1.1b,llama-8b-slice,gemm,experts,attention"
    )]
    parts: Vec<Part>,
    /// A side of GPT-2 replaying Strata's step as a CUDA graph (the LLaMA's sides fill the
    /// GPU already).
    #[arg(long)]
    cuda_graph: bool,
    /// Dense bf16 peak of the GPU in TFLOP/s (default: known from its name).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Measured blocks of each side, alternating between the sides.
    #[arg(long, default_value_t = 10)]
    rounds: u64,
    /// Training steps per block.
    #[arg(long, default_value_t = 5)]
    block: u64,
    /// Warm-up steps of each side before measuring.
    #[arg(long, default_value_t = 5)]
    warmup: u64,
    /// Python of the environment with torch (default: the checkout's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// After everything is timed, one step of each side traced by libtorch's Kineto profiler
    /// into this folder (`<model>/<side>.json`, from sides started afresh, so no profiler has
    /// run in a process that is timed), and the device time per kernel compared.
    #[arg(long)]
    kernel_trace: Option<PathBuf>,
}

/// What `bench gpu` measures.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq)]
enum Part {
    Gpt2,
    #[value(name = "llama-1.1b")]
    Llama1b,
    #[value(name = "llama-8b-slice")]
    Llama8bSlice,
    Gemm,
    Experts,
    Attention,
}

/// The models measured, each with its own sides.
#[derive(Clone, Copy, PartialEq)]
enum Workload {
    /// GPT-2 small, its vocabulary padded to a multiple of 64.
    Gpt2,
    /// TinyLlama's shape (1.1B): 22 blocks of width 2048, head size 128, 4 key/value heads,
    /// LLaMA-2's vocabulary.
    Llama1b,
    /// Llama 3 8B's blocks (width 4096, head size 128, 8 key/value heads, feed-forward
    /// 14336), a few of them, under LLaMA-2's vocabulary: where fp8 products pay.
    Llama8bSlice,
}

impl Workload {
    fn chosen(a: &BenchGpuArgs) -> Vec<Workload> {
        let all = [
            (Part::Gpt2, Workload::Gpt2),
            (Part::Llama1b, Workload::Llama1b),
            (Part::Llama8bSlice, Workload::Llama8bSlice),
        ];
        all.into_iter().filter(|(part, _)| a.parts.contains(part)).map(|(_, w)| w).collect()
    }

    /// The folder of its kernel traces.
    fn name(self) -> &'static str {
        match self {
            Workload::Gpt2 => "gpt2",
            Workload::Llama1b => "llama-1.1b",
            Workload::Llama8bSlice => "llama-8b-slice",
        }
    }
}

impl BenchGpuArgs {
    fn train_args(&self, workload: Workload) -> BenchTrainArgs {
        let (shape, model, vocab, batch_size, kv_heads, ffn_dim) = match workload {
            Workload::Gpt2 => (
                GptShape { layers: 12, heads: 12, dim: 768, ctx: 1024 },
                BenchModel::Gpt,
                50304,
                self.gpt_batch_size,
                None,
                None,
            ),
            Workload::Llama1b => (
                GptShape { layers: 22, heads: 16, dim: 2048, ctx: 2048 },
                BenchModel::Llama,
                32000,
                self.llama_batch_size,
                Some(4),
                Some(5632),
            ),
            Workload::Llama8bSlice => (
                GptShape { layers: self.slice_layers, heads: 32, dim: 4096, ctx: 2048 },
                BenchModel::Llama,
                32000,
                16,
                Some(8),
                Some(14336),
            ),
        };
        let slice = workload == Workload::Llama8bSlice;
        // The slice's sides train `slice_steps` steps in all, in blocks of 5.
        let (warmup, block, rounds) = match slice {
            true => (5, 5, self.slice_steps.saturating_sub(5).div_ceil(5).max(1)),
            false => (self.warmup, self.block, self.rounds),
        };
        BenchTrainArgs {
            shape,
            model,
            kv_heads,
            ffn_dim,
            vocab,
            batch_size,
            threads: 4,
            device: self.device.clone(),
            amp: Amp::Bf16,
            fp8: slice,
            cuda_graph: self.cuda_graph && workload == Workload::Gpt2,
            checkpoint: workload == Workload::Llama1b && self.llama_checkpoint,
            compile: !self.no_compile && !slice,
            one_side_at_a_time: self.one_side_at_a_time,
            peak_tflops: self.peak_tflops,
            rounds,
            block,
            warmup,
            python: self.python.clone(),
            json: self.json,
            kernel_trace: None,
        }
    }
}

/// One matrix product `[m, k] × [k, n]`, in TFLOP/s.
#[derive(Serialize)]
struct GemmRow {
    /// What the shape is: a square, or a layer of a model at its tokens per step.
    shape: String,
    m: i64,
    k: i64,
    n: i64,
    bf16: f64,
    /// `_scaled_mm` on operands already in fp8.
    fp8_product: f64,
    /// Strata's fp8 linear: amaxes, casts to fp8 and the product, as training runs it
    /// with delayed scaling.
    fp8_linear: f64,
    /// The same with current scaling (each operand's maximum reduced before its cast).
    fp8_current: f64,
    /// The same with rowwise scaling.
    fp8_rowwise: f64,
}

/// One forward and backward of a sparse layer's experts (SwiGLU: gate, up, down), every
/// token slot through its expert, by a product per expert against one grouped product per
/// weight.
#[derive(Serialize)]
struct ExpertRow {
    experts: i64,
    dim: i64,
    hidden: i64,
    /// Token slots (tokens × experts chosen per token).
    slots: i64,
    loop_ms: f64,
    grouped_ms: f64,
    /// TFLOP/s of the grouped products (6 products of slots × dim × hidden, each counted 3
    /// times: forward, and both gradients).
    grouped_tflops: f64,
    /// The largest difference between the two sides' outputs and weight gradients, each
    /// relative to its largest magnitude.
    max_relative_difference: f64,
}

/// Causal attention of one shape, forward and backward, in bf16: libtorch's fused kernel
/// and Strata's on plain causal attention, then Strata's kernel and the composite with the
/// shape's window, cap or sinks.
#[derive(Serialize)]
struct AttentionRow {
    shape: String,
    batch: i64,
    heads: i64,
    kv_heads: i64,
    ctx: i64,
    head_dim: i64,
    window: Option<i64>,
    softcap: Option<f64>,
    sinks: bool,
    libtorch_fused_ms: f64,
    strata_plain_ms: f64,
    strata_ms: f64,
    composite_ms: f64,
    /// The forward alone, libtorch's fused kernel and Strata's, plain causal.
    libtorch_forward_ms: f64,
    strata_forward_ms: f64,
}

#[derive(Serialize)]
struct GpuReport {
    models: Vec<Report>,
    gemm: Vec<GemmRow>,
    experts: Vec<ExpertRow>,
    attention: Vec<AttentionRow>,
}

/// `device`, refused unless it is a GPU: the tables time a GPU's kernels.
fn on_gpu(device: Device) -> Result<Device> {
    match device {
        Device::Cuda(_) => Ok(device),
        _ => bail!("bench gpu measures on a GPU"),
    }
}

/// TFLOP/s of `f`, an m×k×n product, over 20 calls after 3 warm-up calls.
fn tflops(device: Device, (m, k, n): (i64, i64, i64), f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    let ms = per_call_ms(on_gpu(device)?, (3, 20), f)?;
    Ok(2.0 * (m * k * n) as f64 / (ms / 1e3) / 1e12)
}

/// The products measured: squares of growing size, then the feed-forward layers of the
/// 1.1B LLaMA (width 2048, hidden 5632) and of an 8B-like one (4096, 14336) at 8 × 2048
/// tokens, each way (up and down projections).
fn gemm_shapes() -> Vec<(String, (i64, i64, i64))> {
    let mut shapes: Vec<(String, (i64, i64, i64))> =
        [1024, 2048, 4096, 8192, 16384].into_iter().map(|n| (format!("square {n}"), (n, n, n))).collect();
    let tokens = 8 * 2048;
    for (model, width, hidden) in [("1.1B", 2048, 5632), ("8B-like", 4096, 14336)] {
        shapes.push((format!("{model} up"), (tokens, width, hidden)));
        shapes.push((format!("{model} down"), (tokens, hidden, width)));
    }
    shapes
}

/// bf16 against fp8 matrix products: where fp8 pays once its casts are counted.
fn gemm_table(device: Device) -> Result<Vec<GemmRow>> {
    let mut rows = Vec::new();
    for (shape, (m, k, n)) in gemm_shapes() {
        let x = Tensor::f_randn([m, k], (Kind::BFloat16, device))?;
        let w = Tensor::f_randn([n, k], (Kind::BFloat16, device))?;
        let bf16 = tflops(device, (m, k, n), || Ok(x.f_linear::<Tensor>(&w, None)?))?;
        let (xq, wq) = (x.f_to_kind(Kind::Float8e4m3fn)?, w.f_to_kind(Kind::Float8e4m3fn)?);
        let one = Tensor::f_ones([], (Kind::Float, device))?;
        let fp8_product = tflops(device, (m, k, n), || {
            Ok(xq.f_internal_scaled_mm::<Tensor>(&wq.tr(), &one, &one, None, None, Kind::BFloat16, true)?)
        })?;
        let linear = |scaling| {
            let state = Fp8Unit::new(Fp8Config { scaling, ..Fp8Config::default() });
            tflops(device, (m, k, n), || Ok(fp8::linear(&state, 0, true, &x, &w, None, Kind::BFloat16)?))
        };
        let fp8_linear = linear(Fp8Scaling::Delayed)?;
        let (fp8_current, fp8_rowwise) = (linear(Fp8Scaling::Current)?, linear(Fp8Scaling::Rowwise)?);
        rows.push(GemmRow { shape, m, k, n, bf16, fp8_product, fp8_linear, fp8_current, fp8_rowwise });
    }
    Ok(rows)
}

/// Milliseconds per call of `f` over 10 calls after 2 warm-up calls.
fn milliseconds<T>(device: Device, f: impl FnMut() -> Result<T>) -> Result<f64> {
    per_call_ms(on_gpu(device)?, (2, 10), f)
}

/// A sparse layer's experts at Qwen3-30B-A3B's shapes (128 experts of hidden size 768 over
/// width 2048, 8 chosen per token) and Mixtral 8×7B's (8 of 14336 over 4096, 2 chosen), at
/// 8 × 2048 tokens routed at random: a product per expert against grouped products.
fn expert_table(device: Device) -> Result<Vec<ExpertRow>> {
    use strata::model::layers::{grouped_linear, linear, swiglu};
    let mut rows = Vec::new();
    for (experts, dim, hidden, top_k) in [(128, 2048, 768, 8), (8, 4096, 14336, 2)] {
        let tokens = 8 * 2048;
        let slots = tokens * top_k;
        // Slots per expert from random choices, as a router spreads them.
        let chosen = Tensor::f_randint(experts, [slots], (Kind::Int64, device))?;
        let counts: Vec<i64> = Vec::try_from(chosen.f_bincount::<Tensor>(None, experts)?.f_to_device(Device::Cpu)?)?;
        let x = Tensor::f_randn([slots, dim], (Kind::BFloat16, device))?.f_mul_scalar(0.5)?;
        let weight = |out: i64, inp: i64| -> Result<Vec<Tensor>> {
            (0..experts)
                .map(|_| {
                    Ok(Tensor::f_randn([out, inp], (Kind::BFloat16, device))?
                        .f_mul_scalar(0.02)?
                        .set_requires_grad(true))
                })
                .collect()
        };
        let (gate, up, down) = (weight(hidden, dim)?, weight(hidden, dim)?, weight(dim, hidden)?);
        let looped = || -> Result<Tensor> {
            let mut outs = Vec::new();
            let mut start = 0;
            for (j, &count) in counts.iter().enumerate() {
                let rows = x.f_narrow(0, start, count)?;
                let h = swiglu(&linear(&rows, &gate[j], None)?, &linear(&rows, &up[j], None)?)?;
                outs.push(linear(&h, &down[j], None)?);
                start += count;
            }
            Ok(Tensor::f_cat(&outs, 0)?)
        };
        let grouped = || -> Result<Tensor> {
            let product = |x: &Tensor, w: &[Tensor]| {
                let weights: Vec<&Tensor> = w.iter().collect();
                grouped_linear(x, &weights, &counts)?.context("the grouped product does not serve bf16 on this GPU")
            };
            let h = swiglu(&product(&x, &gate)?, &product(&x, &up)?)?;
            product(&h, &down)
        };
        let params: Vec<&Tensor> = gate.iter().chain(&up).chain(&down).collect();
        let step = |f: &dyn Fn() -> Result<Tensor>| -> Result<(Tensor, Vec<Tensor>)> {
            for w in &params {
                let mut grad = w.grad();
                if grad.defined() {
                    let _ = grad.f_zero_()?;
                }
            }
            let out = f()?;
            out.f_sum(Kind::Float)?.f_backward()?;
            Ok((out, params.iter().map(|w| w.grad().copy()).collect()))
        };
        let loop_ms = milliseconds(device, || step(&looped))?;
        let grouped_ms = milliseconds(device, || step(&grouped))?;
        let ((a, ga), (b, gb)) = (step(&looped)?, step(&grouped)?);
        let relative = |a: &Tensor, b: &Tensor| -> Result<f64> {
            let scale = a.f_abs()?.f_max()?.f_double_value(&[])?.max(1e-30);
            Ok(a.f_sub(b)?.f_abs()?.f_max()?.f_double_value(&[])? / scale)
        };
        let mut max_relative_difference = relative(&a, &b)?;
        for (a, b) in ga.iter().zip(&gb) {
            // An expert without slots has a zero gradient on both sides.
            if a.f_abs()?.f_max()?.f_double_value(&[])? > 0.0 {
                max_relative_difference = max_relative_difference.max(relative(a, b)?);
            }
        }
        let flops = 3.0 * 3.0 * 2.0 * (slots * dim * hidden) as f64;
        rows.push(ExpertRow {
            experts,
            dim,
            hidden,
            slots,
            loop_ms,
            grouped_ms,
            grouped_tflops: flops / (grouped_ms / 1e3) / 1e12,
            max_relative_difference,
        });
    }
    Ok(rows)
}

/// Attention at Mistral 7B's shape (its 4096-position window over 8192), gpt-oss's (a
/// 128-position window and sinks, head width 64) and a soft-capped one (Gemma 2's cap of 50
/// at head width 128).
fn attention_table(device: Device) -> Result<Vec<AttentionRow>> {
    use strata::model::layers::{attention, AttentionOptions, ScoreTerms};
    type Shape = (&'static str, [i64; 5], Option<i64>, Option<f64>, bool);
    let shapes: [Shape; 3] = [
        ("Mistral 7B", [1, 32, 8, 8192, 128], Some(4096), None, false),
        ("gpt-oss", [2, 64, 8, 4096, 64], Some(128), None, true),
        ("soft-capped", [2, 16, 8, 4096, 128], None, Some(50.0), false),
    ];
    let mut rows = Vec::new();
    for (shape, [batch, heads, kv_heads, ctx, head_dim], window, softcap, with_sinks) in shapes {
        let draw = |h: i64| -> Result<Tensor> {
            Ok(Tensor::f_randn([batch, h, ctx, head_dim], (Kind::BFloat16, device))?.set_requires_grad(true))
        };
        let (q, k, v) = (draw(heads)?, draw(kv_heads)?, draw(kv_heads)?);
        let sinks = Tensor::f_randn([heads], (Kind::Float, device))?.set_requires_grad(true);
        let sinks = with_sinks.then_some(&sinks);
        let seed = Tensor::f_randn([batch, heads, ctx, head_dim], (Kind::BFloat16, device))?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let both_ways = |out: Tensor| -> Result<()> { Ok(out.f_mul(&seed)?.f_sum(Kind::Float)?.f_backward()?) };
        let own = |window, softcap, sinks| -> Result<Tensor> {
            strata_ext::kernels::attention(&q, &k, &v, sinks, scale, softcap, window)?
                .context("Strata's attention kernel does not serve this GPU")
        };
        let libtorch_fused_ms = milliseconds(device, || {
            both_ways(Tensor::f_scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, scale, true)?)
        })?;
        let strata_plain_ms = milliseconds(device, || both_ways(own(None, None, None)?))?;
        let strata_ms = milliseconds(device, || both_ways(own(window, softcap, sinks)?))?;
        let (kr, vr) = (
            k.f_repeat_interleave_self_int(heads / kv_heads, 1, None)?,
            v.f_repeat_interleave_self_int(heads / kv_heads, 1, None)?,
        );
        let options = AttentionOptions { scale: Some(scale), window, softcap, bidirectional: false, chunk: None };
        let terms = ScoreTerms { bias: None, sinks };
        let composite_ms = milliseconds(device, || both_ways(attention(&q, &kr, &vr, &options, None, terms, None)?))?;
        let (libtorch_forward_ms, strata_forward_ms) = tch::no_grad(|| -> Result<(f64, f64)> {
            let fused = milliseconds(device, || {
                Ok(Tensor::f_scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, scale, true)?)
            })?;
            Ok((fused, milliseconds(device, || own(None, None, None))?))
        })?;
        rows.push(AttentionRow {
            shape: shape.into(),
            batch,
            heads,
            kv_heads,
            ctx,
            head_dim,
            window,
            softcap,
            sinks: with_sinks,
            libtorch_fused_ms,
            strata_plain_ms,
            strata_ms,
            composite_ms,
            libtorch_forward_ms,
            strata_forward_ms,
        });
    }
    Ok(rows)
}

/// The device time per kernel of one step of each of `model`'s sides, traced into
/// `dir/<model>/` by sides started afresh and warmed up.
fn trace_kernels(a: &BenchGpuArgs, workload: Workload, dir: &std::path::Path) -> Result<Vec<BTreeMap<String, f64>>> {
    // One timed block of one step, its time left out.
    let args =
        BenchTrainArgs { rounds: 1, block: 1, kernel_trace: Some(dir.join(workload.name())), ..a.train_args(workload) };
    Ok(bench::measure(&args)?.sides.into_iter().map(|m| m.kernels_ms).collect())
}

pub fn run(a: BenchGpuArgs) -> Result<()> {
    let workloads = Workload::chosen(&a);
    let mut reports: Vec<Report> = Vec::new();
    for &workload in &workloads {
        let args = a.train_args(workload);
        let report = bench::measure(&args)?;
        if !a.json {
            bench::print(&report, args.block);
            println!();
        }
        reports.push(report);
    }
    let device = crate::options::parse_device(&a.device)?;
    let chosen = |part| a.parts.contains(&part);
    let gemm = if chosen(Part::Gemm) { gemm_table(device)? } else { Vec::new() };
    if !a.json && !gemm.is_empty() {
        println!("Products m×k×n, TFLOP/s (fp8 linear: with its amaxes and casts, forward only; delayed, current and rowwise scaling)");
        println!(
            "{:<14} {:>20} {:>8} {:>12} {:>11} {:>16} {:>8} {:>8}",
            "shape", "m×k×n", "bf16", "fp8 product", "fp8 linear", "fp8 linear/bf16", "current", "rowwise"
        );
        for r in &gemm {
            let (dims, ratio) = (format!("{}×{}×{}", r.m, r.k, r.n), r.fp8_linear / r.bf16);
            println!(
                "{:<14} {:>20} {:>8.0} {:>12.0} {:>11.0} {:>16.2} {:>8.0} {:>8.0}",
                r.shape, dims, r.bf16, r.fp8_product, r.fp8_linear, ratio, r.fp8_current, r.fp8_rowwise
            );
        }
    }
    let experts = if chosen(Part::Experts) { expert_table(device)? } else { Vec::new() };
    if !a.json && !experts.is_empty() {
        println!("\nExperts (SwiGLU), forward and backward, a product per expert against grouped products");
        println!(
            "{:>8} {:>6} {:>7} {:>8} {:>9} {:>11} {:>8} {:>15} {:>15}",
            "experts",
            "dim",
            "hidden",
            "slots",
            "loop ms",
            "grouped ms",
            "speedup",
            "grouped TFLOP/s",
            "max rel. diff."
        );
        for r in &experts {
            println!(
                "{:>8} {:>6} {:>7} {:>8} {:>9.2} {:>11.2} {:>8.2} {:>15.0} {:>15.2e}",
                r.experts,
                r.dim,
                r.hidden,
                r.slots,
                r.loop_ms,
                r.grouped_ms,
                r.loop_ms / r.grouped_ms,
                r.grouped_tflops,
                r.max_relative_difference
            );
        }
    }
    let attention = if chosen(Part::Attention) { attention_table(device)? } else { Vec::new() };
    if !a.json && !attention.is_empty() {
        println!(
            "\nCausal attention in bf16, forward and backward, ms (the shape's window, cap or sinks in the last two)"
        );
        println!(
            "{:<12} {:>22} {:>8} {:>7} {:>6} {:>15} {:>13} {:>12} {:>10} {:>15} {:>17}",
            "shape",
            "B×H/KV×T×D",
            "window",
            "cap",
            "sinks",
            "libtorch fused",
            "strata plain",
            "strata own",
            "composite",
            "plain/libtorch",
            "forward/libtorch"
        );
        for r in &attention {
            let dims = format!("{}×{}/{}×{}×{}", r.batch, r.heads, r.kv_heads, r.ctx, r.head_dim);
            let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            println!(
                "{:<12} {:>22} {:>8} {:>7} {:>6} {:>15.2} {:>13.2} {:>12.2} {:>10.2} {:>15.2} {:>17.2}",
                r.shape,
                dims,
                or_dash(r.window.map(|w| w.to_string())),
                or_dash(r.softcap.map(|c| c.to_string())),
                r.sinks,
                r.libtorch_fused_ms,
                r.strata_plain_ms,
                r.strata_ms,
                r.composite_ms,
                r.strata_plain_ms / r.libtorch_fused_ms,
                r.strata_forward_ms / r.libtorch_forward_ms
            );
        }
    }
    if let Some(dir) = &a.kernel_trace {
        for (report, &workload) in reports.iter_mut().zip(&workloads) {
            let traced = trace_kernels(&a, workload, dir)?;
            for (side, kernels) in report.sides.iter_mut().zip(traced) {
                side.kernels_ms = kernels;
            }
            if !a.json {
                println!("\n{}, one step traced", workload.name());
                bench::print_kernels(&report.sides, bench::TracedTime::Device);
            }
        }
    }
    let json = serde_json::to_string_pretty(&GpuReport { models: reports, gemm, experts, attention })?;
    if a.json {
        println!("{json}");
    }
    if let Some(path) = &a.json_out {
        std::fs::write(path, json + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
