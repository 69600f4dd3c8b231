//! `strata bench dist`: Strata's data parallelism and fsdp against PyTorch's
//! DistributedDataParallel and FSDP2 (`scripts/torch_dist_reference.py`, gloo), on the same
//! GPT and global batch at each world size, in rounds that alternate the two sides so both
//! see the same drifts of the machine: tokens/s with the ratio, and rank 0's allocator and
//! RSS peaks (PyTorch's CPU allocator keeps no statistics: its RSS peak, the largest of any
//! rank, stands in).
//!
//! Owns the rounds and the comparison. Must not train in this process: Strata's side runs as
//! `strata train` children ([`crate::bench_runs`]), PyTorch's as the Python script.
use crate::bench_runs::{self, median, GptShape};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;
use strata::profile::MIB;

#[derive(Args, Debug, Clone)]
pub struct BenchDistArgs {
    #[command(flatten)]
    shape: GptShape,
    /// World sizes, comma-separated.
    #[arg(long, default_value = "2,4")]
    nproc: String,
    /// Methods, comma-separated: ddp (data parallel) and fsdp.
    #[arg(long, default_value = "ddp,fsdp")]
    methods: String,
    /// Global batch (rows per step), split evenly over the ranks.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Steps per run; the first two are warm-up and not timed.
    #[arg(long, default_value_t = 12)]
    steps: u64,
    /// Rounds; each figure is the median over rounds.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Strata's `module_replace` pairs, comma-separated (default: those `module_replace`
    /// applies without a list).
    /// `FlashAttention` gives both sides the same attention kernel;
    /// `OneDnnLinear` is Strata's own choice of matrix-product kernel on the CPU.
    #[arg(long)]
    replace: Option<String>,
    /// Compute threads per rank, on both sides.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Python of the environment with torch (default: the checkout's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    method: String,
    world_size: usize,
    strata_tokens_per_s: f64,
    pytorch_tokens_per_s: f64,
    /// Strata's tokens/s over PyTorch's.
    speedup: f64,
    /// The share of Strata's step time rank 0 spent waiting for collectives (exposed
    /// communication), median over rounds.
    strata_exposed_comm: f64,
    /// Strata's `module_replace` pairs.
    strata_replace: Vec<String>,
    strata_allocator_peak_bytes: u64,
    strata_rss_peak_bytes: u64,
    pytorch_rss_peak_bytes: u64,
}

/// The `module_replace` pairs Strata runs with: those named, or those applied by default.
/// The reference's GPT calls PyTorch's fused attention (`F.scaled_dot_product_attention`),
/// which is what `FlashAttention` puts in Strata's attention.
fn replace_pairs(args: &BenchDistArgs) -> Vec<String> {
    match &args.replace {
        Some(names) => names.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect(),
        None => strata::compute::replace::default_pair_names(),
    }
}

/// Strata's strategy for a method, with `module_replace` over `pairs`.
fn strategy(method: &str, pairs: &[String]) -> Result<String> {
    let replace = serde_json::json!(["module_replace", pairs]);
    Ok(match method {
        "ddp" => serde_json::json!([replace]),
        "fsdp" => serde_json::json!([["fsdp", {}], replace]),
        other => bail!("unknown method {other:?}; expected ddp or fsdp"),
    }
    .to_string())
}

/// One PyTorch run: (tokens/s, largest peak RSS of a rank).
fn pytorch(args: &BenchDistArgs, method: &str, n: usize) -> Result<(f64, u64)> {
    let s = &args.shape;
    let flags = format!(
        "--nproc {n} --mode {method} --layers {} --heads {} --dim {} --ctx {} --batch-size {} --steps {} --threads {}",
        s.layers, s.heads, s.dim, s.ctx, args.batch_size, args.steps, args.threads
    );
    let flags: Vec<String> = flags.split_whitespace().map(String::from).collect();
    let report = crate::bench::run_reference(args.python.as_ref(), "torch_dist_reference.py", &flags)?;
    let speed = report["tokens_per_s"].as_f64().context("no tokens_per_s in the PyTorch report")?;
    Ok((speed, report["peak_rss_bytes"].as_u64().unwrap_or(0)))
}

/// One Strata run: (tokens/s, allocator peak, RSS peak, exposed communication share) of
/// rank 0.
fn strata(args: &BenchDistArgs, method: &str, n: usize) -> Result<(f64, u64, u64, f64)> {
    let s = &args.shape;
    let flags = format!(
        "--model gpt --steps {} --schedule constant --layers {} --heads {} --dim {} --ctx {} --batch-size {} --threads {} --nproc {n}",
        args.steps, s.layers, s.heads, s.dim, s.ctx, args.batch_size, args.threads
    );
    let mut argv: Vec<String> = flags.split_whitespace().map(String::from).collect();
    argv.extend(["--strategy".into(), strategy(method, &replace_pairs(args))?]);
    let run = bench_runs::train(&argv, 2)?;
    let bytes = |k: &str| run.last[k].as_u64().with_context(|| format!("no {k} in the metrics"));
    let share = |k: &str| run.last[k].as_f64().with_context(|| format!("no {k} in the metrics"));
    let exposed = share("comm_wait_s")? / share("seconds")?.max(1e-12);
    Ok((run.tokens_per_s, bytes("allocator_peak_bytes")?, bytes("rss_peak_bytes")?, exposed))
}

pub fn run(args: BenchDistArgs) -> Result<()> {
    let worlds: Vec<usize> = args.nproc.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?;
    if worlds.iter().any(|&n| n < 2 || !args.batch_size.is_multiple_of(n)) {
        bail!("every world size must be at least 2 and divide --batch-size {}", args.batch_size);
    }
    let methods: Vec<&str> = args.methods.split(',').map(str::trim).collect();
    let mut rows = Vec::new();
    for &n in &worlds {
        for &method in &methods {
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for _ in 0..args.rounds.max(1) {
                ours.push(strata(&args, method, n)?);
                theirs.push(pytorch(&args, method, n)?);
            }
            let strata_speed = median(ours.iter().map(|r| r.0).collect());
            let torch_speed = median(theirs.iter().map(|r| r.0).collect());
            rows.push(Row {
                method: method.to_string(),
                world_size: n,
                strata_tokens_per_s: strata_speed,
                pytorch_tokens_per_s: torch_speed,
                speedup: strata_speed / torch_speed.max(1e-9),
                strata_exposed_comm: median(ours.iter().map(|r| r.3).collect()),
                strata_replace: replace_pairs(&args),
                strata_allocator_peak_bytes: ours.iter().map(|r| r.1).max().unwrap_or(0),
                strata_rss_peak_bytes: ours.iter().map(|r| r.2).max().unwrap_or(0),
                pytorch_rss_peak_bytes: theirs.iter().map(|r| r.1).max().unwrap_or(0),
            });
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let s = &args.shape;
    println!(
        "GPT {} layers, width {}, ctx {}, global batch {}, {} thread(s) per rank: medians over {} rounds",
        s.layers, s.dim, s.ctx, args.batch_size, args.threads, args.rounds
    );
    println!("Strata's module_replace pairs: {}", replace_pairs(&args).join(", "));
    println!(
        "{:<6} {:>5} {:>14} {:>14} {:>8} {:>9} {:>14} {:>12} {:>12}",
        "method",
        "ranks",
        "strata tok/s",
        "pytorch tok/s",
        "ratio",
        "exposed",
        "strata alloc",
        "strata RSS",
        "pytorch RSS"
    );
    for r in &rows {
        println!(
            "{:<6} {:>5} {:>14.0} {:>14.0} {:>8.2} {:>8.1}% {:>11.1}MiB {:>9.1}MiB {:>9.1}MiB",
            r.method,
            r.world_size,
            r.strata_tokens_per_s,
            r.pytorch_tokens_per_s,
            r.speedup,
            100.0 * r.strata_exposed_comm,
            r.strata_allocator_peak_bytes as f64 / MIB,
            r.strata_rss_peak_bytes as f64 / MIB,
            r.pytorch_rss_peak_bytes as f64 / MIB
        );
    }
    Ok(())
}
