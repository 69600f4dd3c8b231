//! `strata bench gpu`: `strata bench train` on one GPU for the two models a user moving to a
//! GPU would try first, in bf16 autocast with fused attention and Strata's kernels, at the
//! shapes of the published anchors: GPT-2 small (124M) at 64 × 1024 tokens per step (llm.c's)
//! and a LLaMA of 1.1B parameters at 8 × 2048 (TinyLlama's), the latter also with fp8
//! linears; and matrix products in bf16 against fp8 at square and at layer shapes.
use crate::bench::{self, Amp, BenchModel, BenchTrainArgs, Report};
use crate::bench_runs::GptShape;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
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
    /// Strata's LLaMA sides keep every activation instead of recomputing each block's: the
    /// recomputation leaves room for the three sides (PyTorch, Strata bf16 and Strata fp8)
    /// on one GPU at once.
    #[arg(long)]
    llama_without_checkpoint: bool,
    /// Each side of each model alone on the GPU (`bench train --one-side-at-a-time`): for
    /// a GPU that cannot hold PyTorch's side beside Strata's (an 80 GB H100 at GPT-2's
    /// 64 × 1024 tokens, where PyTorch's alone peaks near 67 GB).
    #[arg(long)]
    one_side_at_a_time: bool,
    /// Leave out the fp8 side of the LLaMA and the fp8 products.
    #[arg(long)]
    no_fp8: bool,
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

impl BenchGpuArgs {
    fn train_args(&self, model: BenchModel) -> BenchTrainArgs {
        let (shape, vocab, batch_size, kv_heads, ffn_dim, fp8) = match model {
            // GPT-2 small, its vocabulary padded to a multiple of 64.
            BenchModel::Gpt => {
                (GptShape { layers: 12, heads: 12, dim: 768, ctx: 1024 }, 50304, self.gpt_batch_size, None, None, false)
            }
            // TinyLlama's shape (1.1B): 22 blocks of width 2048, head size 128, 4 key/value
            // heads, LLaMA-2's vocabulary.
            BenchModel::Llama => (
                GptShape { layers: 22, heads: 16, dim: 2048, ctx: 2048 },
                32000,
                self.llama_batch_size,
                Some(4),
                Some(5632),
                !self.no_fp8,
            ),
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
            fp8,
            cuda_graph: self.cuda_graph && model == BenchModel::Gpt,
            checkpoint: model == BenchModel::Llama && !self.llama_without_checkpoint,
            one_side_at_a_time: self.one_side_at_a_time,
            peak_tflops: self.peak_tflops,
            rounds: self.rounds,
            block: self.block,
            warmup: self.warmup,
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

#[derive(Serialize)]
struct GpuReport {
    models: Vec<Report>,
    gemm: Vec<GemmRow>,
}

/// TFLOP/s of `f`, an m×k×n product, over 20 calls after 3 warm-up calls.
fn tflops(device: Device, (m, k, n): (i64, i64, i64), mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    let Device::Cuda(index) = device else { bail!("the products are measured on a GPU") };
    for _ in 0..3 {
        let _ = f()?;
    }
    tch::Cuda::synchronize(index as i64);
    let start = Instant::now();
    for _ in 0..20 {
        let _ = f()?;
    }
    tch::Cuda::synchronize(index as i64);
    Ok(20.0 * 2.0 * (m * k * n) as f64 / start.elapsed().as_secs_f64() / 1e12)
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

/// The device time per kernel of one step of each of `model`'s sides, traced into
/// `dir/<model>/` by sides started afresh and warmed up.
fn trace_kernels(a: &BenchGpuArgs, model: BenchModel, dir: &std::path::Path) -> Result<Vec<BTreeMap<String, f64>>> {
    // One timed block of one step, its time left out.
    let args = BenchTrainArgs {
        rounds: 1,
        block: 1,
        kernel_trace: Some(dir.join(format!("{model:?}").to_lowercase())),
        ..a.train_args(model)
    };
    Ok(bench::measure(&args)?.sides.into_iter().map(|m| m.kernels_ms).collect())
}

pub fn run(a: BenchGpuArgs) -> Result<()> {
    let mut reports: Vec<Report> = Vec::new();
    for model in [BenchModel::Gpt, BenchModel::Llama] {
        let report = bench::measure(&a.train_args(model))?;
        if !a.json {
            bench::print(&report, a.block);
            println!();
        }
        reports.push(report);
    }
    let device = crate::options::parse_device(&a.device)?;
    let gemm = if a.no_fp8 { Vec::new() } else { gemm_table(device)? };
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
    if let Some(dir) = &a.kernel_trace {
        for report in &mut reports {
            let traced = trace_kernels(&a, report.model, dir)?;
            for (side, kernels) in report.sides.iter_mut().zip(traced) {
                side.kernels_ms = kernels;
            }
            if !a.json {
                println!("\n{:?}, one step traced", report.model);
                bench::print_kernels(&report.sides, bench::TracedTime::Device);
            }
        }
    }
    let json = serde_json::to_string_pretty(&GpuReport { models: reports, gemm })?;
    if a.json {
        println!("{json}");
    }
    if let Some(path) = &a.json_out {
        std::fs::write(path, json + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
