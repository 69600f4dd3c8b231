//! `strata bench zero`: per-rank peak model-state bytes of data parallelism and each ZeRO
//! stage at several world sizes, against the ZeRO paper's formula, and each stage's
//! throughput against plain data parallelism at the same world size, measured in one run.
//!
//! Owns the formula's figures and the table. Must not train in this process: each run is a
//! `strata train` child ([`crate::bench_runs`]), so its peaks are its own.
use crate::bench_runs;
use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use strata::model::GptConfig;
use strata::model::ModelConfig;
use strata::profile::MIB;

#[derive(Args, Debug, Clone)]
pub struct BenchZeroArgs {
    /// World sizes to measure, comma-separated.
    #[arg(long, default_value = "1,2,4")]
    nproc: String,
    #[arg(long, default_value_t = 8)]
    layers: i64,
    #[arg(long, default_value_t = 4)]
    heads: i64,
    #[arg(long, default_value_t = 256)]
    dim: i64,
    #[arg(long, default_value_t = 64)]
    ctx: i64,
    /// Global batch (rows per step).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Steps per run; the first two are warm-up and not timed.
    #[arg(long, default_value_t = 8)]
    steps: u64,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    precision: &'static str,
    method: &'static str,
    world_size: usize,
    /// Peak bytes of parameters, gradients and optimizer state on rank 0, as the engine's
    /// ledger counts them (checked against the allocator by the test suite).
    model_state_bytes: u64,
    /// Peak bytes libtorch's allocator handed out on rank 0 during the last step: model
    /// states, activations and every temporary.
    allocator_peak_bytes: u64,
    formula_bytes: f64,
    /// measured / formula.
    ratio: f64,
    /// Whether measured is within the formula plus what is in use: for fsdp one gathered
    /// unit (its parameters and whole gradient) and one prefetched unit (its parameters),
    /// for zero2 one whole gradient, and for both the whole gradient of units whose weights
    /// another unit borrows (tied embeddings: their gradient gathers contributions from the
    /// first unit of backward to the last); for ddp and zero1, which gather nothing, 1.1 ×
    /// the formula.
    within_target: bool,
    tokens_per_s: f64,
    /// Throughput over data parallelism's at the same world size and precision.
    speed_vs_ddp: f64,
}

#[derive(Serialize)]
struct Report {
    params: i64,
    largest_unit_params: i64,
    rows: Vec<Row>,
}

/// `fsdp` runs FSDP's defaults (backward prefetch PRE); `fsdp-post` prefetches after
/// freeing, holding one gathered unit fewer.
const METHODS: [&str; 5] = ["ddp", "zero1", "zero2", "fsdp", "fsdp-post"];

/// Bytes per parameter of the ZeRO paper's model states: parameters `p` and gradients `g`
/// bytes each, `k` bytes of optimizer state (fp32 master, if separate, and Adam's moments).
fn formula(method: &str, params: f64, n: f64, (p, g, k): (f64, f64, f64)) -> f64 {
    params
        * match method {
            "ddp" => p + g + k,
            "zero1" => p + g + k / n,
            "zero2" => p + (g + k) / n,
            _ => (p + g + k) / n,
        }
}

/// Rank 0's peak model-state bytes (ledger), allocator peak and median tokens/s after warm-up.
fn run_one(args: &BenchZeroArgs, n: usize, strategy: &str) -> Result<(u64, u64, f64)> {
    let flags = format!(
        "--model gpt --steps {} --schedule constant --layers {} --heads {} --dim {} --ctx {} --batch-size {} --threads 1 --nproc {n}",
        args.steps, args.layers, args.heads, args.dim, args.ctx, args.batch_size
    );
    let mut argv: Vec<String> = flags.split_whitespace().map(String::from).collect();
    argv.extend(["--strategy".to_string(), strategy.to_string()]);
    let run = bench_runs::train(&argv, 2)?;
    let peak = run.last["model_state_peak_bytes"].as_u64().context("no model-state peak in the metrics")?;
    let allocated = run.last["allocator_peak_bytes"].as_u64().context("no allocator peak in the metrics")?;
    Ok((peak, allocated, run.tokens_per_s))
}

pub fn run(args: BenchZeroArgs) -> Result<()> {
    let worlds: Vec<usize> = args.nproc.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?;
    let cfg = GptConfig::new(256, args.ctx, args.layers, args.heads, args.dim);
    let spec = ModelConfig::Gpt(cfg).spec()?;
    let params = spec.num_params();
    let unit_numel = |u: &strata::model::UnitSpec| u.params.iter().map(|id| spec.params[id.0].numel()).sum::<i64>();
    let largest = spec.units.iter().map(unit_numel).max().unwrap_or(0);
    let lent: i64 =
        spec.units.iter().zip(spec.lent_units()).filter(|(_, lent)| *lent).map(|(u, _)| unit_numel(u)).sum();
    let mut rows = Vec::new();
    // fp32: parameters, gradients and Adam's two moments, no separate master.
    // mixed: bf16 parameters and gradients, fp32 master and moments (the paper's K = 12).
    for (precision, sizes, policy) in [
        ("fp32", (4.0, 4.0, 8.0), ""),
        ("bf16-mixed", (2.0, 2.0, 12.0), r#""mixed_precision": {"param_dtype": "bf16"}"#),
    ] {
        for &n in &worlds {
            let mut ddp_speed = None;
            for method in METHODS {
                let strategy = match (method, precision) {
                    // Data parallelism in mixed precision: the same schedule without sharding.
                    ("ddp", "fp32") => "[]".to_string(),
                    ("ddp", _) => format!(r#"[["fsdp", {{"sharding_strategy": "NO_SHARD", {policy}}}]]"#),
                    ("fsdp-post", "fp32") => r#"[["fsdp", {"backward_prefetch": "BACKWARD_POST"}]]"#.to_string(),
                    ("fsdp-post", _) => format!(r#"[["fsdp", {{"backward_prefetch": "BACKWARD_POST", {policy}}}]]"#),
                    (m, _) => format!(r#"[["{m}", {{{policy}}}]]"#),
                };
                let (bytes, allocated, speed) = run_one(&args, n, &strategy)?;
                let expected = formula(method, params as f64, n as f64, sizes);
                let unit = match method {
                    // One rank shards nothing: every method holds what data parallelism does.
                    _ if n == 1 => 0.1 * expected,
                    "ddp" | "zero1" => 0.1 * expected,
                    "zero2" => (largest + lent) as f64 * sizes.1,
                    _ => largest as f64 * (2.0 * sizes.0 + sizes.1) + lent as f64 * sizes.1,
                };
                let ddp = *ddp_speed.get_or_insert(speed);
                rows.push(Row {
                    precision,
                    method,
                    world_size: n,
                    model_state_bytes: bytes,
                    allocator_peak_bytes: allocated,
                    formula_bytes: expected,
                    ratio: bytes as f64 / expected,
                    within_target: (bytes as f64) <= expected + unit,
                    tokens_per_s: speed,
                    speed_vs_ddp: speed / ddp.max(1e-9),
                });
            }
        }
    }
    let report = Report { params, largest_unit_params: largest, rows };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("GPT {} parameters (largest unit {}), peaks per rank (rank 0)", params, largest);
    println!("  model states: the ledger's count; allocator: everything libtorch allocated (activations too)");
    println!(
        "{:<11} {:<9} {:>5} {:>12} {:>12} {:>7} {:>6} {:>12} {:>10} {:>8}",
        "precision", "method", "ranks", "model states", "formula", "ratio", "target", "allocator", "tokens/s", "vs ddp"
    );
    for r in &report.rows {
        println!(
            "{:<11} {:<9} {:>5} {:>9.2}MiB {:>9.2}MiB {:>7.3} {:>6} {:>9.2}MiB {:>10.0} {:>8.3}",
            r.precision,
            r.method,
            r.world_size,
            r.model_state_bytes as f64 / MIB,
            r.formula_bytes / MIB,
            r.ratio,
            if r.within_target { "ok" } else { "over" },
            r.allocator_peak_bytes as f64 / MIB,
            r.tokens_per_s,
            r.speed_vs_ddp
        );
    }
    Ok(())
}
