//! `strata bench moe`: what a mixture of experts costs beside the dense work it replaces —
//! the experts' products over tokens grouped by expert against one product of equal FLOPs,
//! the expert all-to-all against a memory copy of the same bytes (`strata bench comm`'s
//! all_to_all row, with every rank copying beside it), and a mixture of experts' training
//! tokens/s at expert-parallel sizes 1, 2 and 4.
//!
//! Owns the configurations and the table. Must not train in this process: each training
//! run and the all-to-all run in children ([`crate::bench_runs`]).
use crate::bench_runs::{self, median};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use std::process::Command;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

#[derive(Args, Debug, Clone)]
pub struct BenchMoeArgs {
    /// Experts of each sparse layer.
    #[arg(long, default_value_t = 8)]
    experts: i64,
    /// Experts each token is sent to.
    #[arg(long, default_value_t = 2)]
    experts_per_token: i64,
    /// Model width.
    #[arg(long, default_value_t = 256)]
    dim: i64,
    /// Hidden width of each expert.
    #[arg(long, default_value_t = 256)]
    expert_ffn_dim: i64,
    /// Tokens routed in the product comparison (and, as fp32 rows of width --dim, the
    /// all-to-all's bytes: 16 MiB by default, where bench comm measures memcpy beside it).
    #[arg(long, default_value_t = 8192)]
    tokens: i64,
    /// Layers of the trained model.
    #[arg(long, default_value_t = 2)]
    layers: i64,
    #[arg(long, default_value_t = 64)]
    ctx: i64,
    /// Rows of each rank's batch in the training runs.
    #[arg(long, default_value_t = 4)]
    batch_size: i64,
    /// Steps per training run; the first two are warm-up and not timed.
    #[arg(long, default_value_t = 8)]
    steps: u64,
    /// Rounds (products) and runs (training) per figure; each figure is the median.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// libtorch threads per process.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Products {
    /// Rows through each expert (tokens × experts per token, routed at random).
    rows: i64,
    grouped_seconds: f64,
    dense_seconds: f64,
    grouped_tflops: f64,
    dense_tflops: f64,
    /// The grouped products' pace over the dense one's (1: no cost for grouping).
    grouped_vs_dense: f64,
}

#[derive(Serialize)]
struct Exchange {
    ranks: usize,
    bytes: u64,
    time_us: f64,
    algbw_gbps: f64,
    /// Every rank copying the same bytes at once, beside the exchange.
    memcpy_beside_gbps: Option<f64>,
    /// The all-to-all's pace over memcpy's.
    vs_memcpy: Option<f64>,
}

#[derive(Serialize)]
struct Training {
    expert_parallel: usize,
    tokens_per_s: f64,
    /// Against expert parallel 1 (one process).
    speed_vs_one: f64,
    /// Token slots rank 0 sent to experts on other ranks in the last step.
    remote_expert_tokens: i64,
    final_loss: f64,
}

#[derive(Serialize)]
struct Report {
    products: Products,
    exchange: Option<Exchange>,
    training: Vec<Training>,
}

/// The same gated feed-forward products as a sparse layer's experts: SwiGLU over `rows`
/// rows with one expert's weights.
fn expert(x: &Tensor, w: &(Tensor, Tensor, Tensor)) -> Tensor {
    (x.matmul(&w.0.tr()).silu() * x.matmul(&w.1.tr())).matmul(&w.2.tr())
}

fn products(a: &BenchMoeArgs) -> Result<Products> {
    let (e, k, d, f) = (a.experts, a.experts_per_token, a.dim, a.expert_ffn_dim);
    let rows = a.tokens * k;
    let options = (Kind::Float, Device::Cpu);
    let weights: Vec<(Tensor, Tensor, Tensor)> = (0..e)
        .map(|_| (Tensor::randn([f, d], options), Tensor::randn([f, d], options), Tensor::randn([d, f], options)))
        .collect();
    let x = Tensor::randn([rows, d], options);
    // Random routing: each expert's share of the rows, as a router's top-k would give them.
    let slots = Tensor::randint(e, [rows], (Kind::Int64, Device::Cpu));
    let counts = Vec::<i64>::try_from(slots.bincount::<Tensor>(None, e)).context("expert counts")?;
    let grouped = || {
        let start = Instant::now();
        let mut at = 0;
        let outs: Vec<Tensor> = counts
            .iter()
            .zip(&weights)
            .filter(|(&n, _)| n > 0)
            .map(|(&n, w)| {
                let y = expert(&x.narrow(0, at, n), w);
                at += n;
                y
            })
            .collect();
        let _ = Tensor::cat(&outs, 0);
        start.elapsed().as_secs_f64()
    };
    let dense = || {
        let start = Instant::now();
        let _ = expert(&x, &weights[0]);
        start.elapsed().as_secs_f64()
    };
    // One untimed run of each first (first-touch of the outputs, kernel selection).
    grouped();
    dense();
    let (mut g, mut dn) = (Vec::new(), Vec::new());
    for _ in 0..a.rounds.max(1) {
        g.push(grouped());
        dn.push(dense());
    }
    let (g, dn) = (median(g), median(dn));
    let flops = 6.0 * (rows * d * f) as f64;
    Ok(Products {
        rows,
        grouped_seconds: g,
        dense_seconds: dn,
        grouped_tflops: flops / g / 1e12,
        dense_tflops: flops / dn / 1e12,
        grouped_vs_dense: dn / g,
    })
}

/// `strata bench comm`'s all_to_all row for the bytes a sparse layer of 2 ranks exchanges.
fn exchange(a: &BenchMoeArgs) -> Result<Exchange> {
    // Each rank sends its routed rows (fp32) for the half of the experts the other computes.
    let bytes = (a.tokens * a.experts_per_token * a.dim * 4) as u64;
    let out = Command::new(std::env::current_exe()?)
        .args(["bench", "comm", "--nproc", "2", "--backends", "shm", "--ops", "all_to_all", "--buffers", "private"])
        .args(["--min-bytes", &bytes.to_string(), "--max-bytes", &bytes.to_string(), "--no-reference", "--json"])
        .output()
        .context("cannot run strata bench comm")?;
    if !out.status.success() {
        bail!("strata bench comm failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).context("bench comm's JSON")?;
    let row = report["rows"].as_array().and_then(|r| r.first()).context("bench comm measured no row")?;
    let algbw = row["algbw_gbps"].as_f64().context("no algbw_gbps")?;
    let memcpy = row["memcpy_beside_gbps"].as_f64();
    Ok(Exchange {
        ranks: 2,
        bytes,
        time_us: row["time_us"].as_f64().context("no time_us")?,
        algbw_gbps: algbw,
        memcpy_beside_gbps: memcpy,
        vs_memcpy: memcpy.map(|m| algbw / m),
    })
}

fn training(a: &BenchMoeArgs) -> Result<Vec<Training>> {
    let flags = format!(
        "--model llama --experts {} --experts-per-token {} --layers {} --heads 4 --dim {} --ffn-dim {} --ctx {} \
         --batch-size {} --steps {} --schedule constant --threads {}",
        a.experts, a.experts_per_token, a.layers, a.dim, a.expert_ffn_dim, a.ctx, a.batch_size, a.steps, a.threads
    );
    let base: Vec<String> = flags.split_whitespace().map(String::from).collect();
    let sizes = [1usize, 2, 4];
    let mut samples: Vec<Vec<(f64, i64, f64)>> = vec![Vec::new(); sizes.len()];
    for _ in 0..a.rounds.max(1) {
        for (i, &n) in sizes.iter().enumerate() {
            // Every rank reads a batch of its own: the global batch grows with the ranks.
            let mut argv = base.clone();
            if n > 1 {
                let strategy = format!(r#"[["expert_parallel", {{"size": {n}}}]]"#);
                argv.extend(["--nproc".into(), n.to_string(), "--strategy".into(), strategy]);
            }
            let run = bench_runs::train(&argv, 2)?;
            let remote = run.last["experts"]["remote_expert_tokens"].as_i64().unwrap_or(0);
            let loss = run.last["loss"].as_f64().context("no loss in the metrics")?;
            samples[i].push((run.tokens_per_s, remote, loss));
        }
    }
    let speed = |i: usize| median(samples[i].iter().map(|s| s.0).collect());
    let one = speed(0);
    Ok(sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| Training {
            expert_parallel: n,
            tokens_per_s: speed(i),
            speed_vs_one: speed(i) / one.max(1e-9),
            remote_expert_tokens: samples[i].last().map_or(0, |s| s.1),
            final_loss: samples[i].last().map_or(0.0, |s| s.2),
        })
        .collect())
}

pub fn run(a: BenchMoeArgs) -> Result<()> {
    if a.experts % 4 != 0 || a.experts_per_token > a.experts || a.experts_per_token < 1 {
        bail!("--experts must split over 4 ranks and hold --experts-per-token (1 or more)");
    }
    tch::set_num_threads(a.threads as i32);
    let report = Report { products: products(&a)?, exchange: Some(exchange(&a)?), training: training(&a)? };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let p = &report.products;
    println!(
        "{} experts, {} per token, width {}, expert width {}; medians over {} rounds",
        a.experts, a.experts_per_token, a.dim, a.expert_ffn_dim, a.rounds
    );
    println!("{:<40} {:>12} {:>10} {:>10}", "experts' products", "seconds", "TFLOP/s", "ratio");
    println!(
        "{:<40} {:>12.6} {:>10.3} {:>10}",
        format!("one product, {} rows", p.rows),
        p.dense_seconds,
        p.dense_tflops,
        "1.000"
    );
    println!(
        "{:<40} {:>12.6} {:>10.3} {:>10.3}",
        format!("grouped by expert, {} products", a.experts),
        p.grouped_seconds,
        p.grouped_tflops,
        p.grouped_vs_dense
    );
    if let Some(x) = &report.exchange {
        println!(
            "all-to-all of {} bytes over {} ranks: {:.1} us, {:.2} GB/s; memcpy beside it {}",
            x.bytes,
            x.ranks,
            x.time_us,
            x.algbw_gbps,
            match (x.memcpy_beside_gbps, x.vs_memcpy) {
                (Some(m), Some(r)) => format!("{m:.2} GB/s (all-to-all at {r:.3} of it)"),
                _ => "not measured (below bench comm's memcpy size)".into(),
            }
        );
    }
    println!("{:<16} {:>12} {:>10} {:>14} {:>10}", "expert parallel", "tokens/s", "speed", "sent away", "loss");
    for t in &report.training {
        println!(
            "{:<16} {:>12.0} {:>10.3} {:>14} {:>10.4}",
            t.expert_parallel, t.tokens_per_s, t.speed_vs_one, t.remote_expert_tokens, t.final_loss
        );
    }
    Ok(())
}
