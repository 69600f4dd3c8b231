//! `strata bench parallel`: tensor parallelism beside data parallelism and sharding. For
//! each world size, every tensor size that divides it with data parallelism, zero2 and fsdp
//! over the rest (and sequence parallel where the tensor size is above one): throughput,
//! per-rank model states and allocator peak, against plain data parallelism at the same
//! world size, measured in one run.
//!
//! Owns the configurations and the table. Must not train in this process: each run is a
//! `strata train` child ([`crate::bench_runs`]), so its peaks are its own.
use crate::bench_runs;
use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use strata::profile::MIB;

#[derive(Args, Debug, Clone)]
pub struct BenchParallelArgs {
    /// World sizes to measure, comma-separated.
    #[arg(long, default_value = "2,4")]
    nproc: String,
    /// Tensor sizes to measure (those dividing a world size), comma-separated.
    #[arg(long, default_value = "1,2,4")]
    tensor: String,
    /// Methods over the ranks that hold one tensor piece, comma-separated (data, zero2, fsdp).
    #[arg(long, default_value = "data,zero2,fsdp")]
    methods: String,
    #[arg(long, default_value_t = 4)]
    layers: i64,
    #[arg(long, default_value_t = 8)]
    heads: i64,
    #[arg(long, default_value_t = 256)]
    dim: i64,
    #[arg(long, default_value_t = 128)]
    ctx: i64,
    /// Global batch (rows per step).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Steps per run; the first two are warm-up and not timed.
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    world_size: usize,
    tensor_size: usize,
    sequence_parallel: bool,
    /// data, zero2 or fsdp over the ranks of one tensor coordinate.
    method: String,
    tokens_per_s: f64,
    /// Throughput over data parallelism's on every rank at the same world size.
    speed_vs_data: f64,
    /// Peak parameters, gradients and optimizer state on rank 0 (the ledger's count).
    model_state_bytes: u64,
    /// Peak bytes libtorch's allocator handed out on rank 0 during the last step.
    allocator_peak_bytes: u64,
    /// What the allocator held beyond model states at its peak: activations and
    /// temporaries.
    activation_bytes: u64,
}

#[derive(Serialize)]
struct Report {
    rows: Vec<Row>,
    /// Per tensor size above one: activation bytes with sequence parallel over without
    /// (data parallelism), measured; Megatron-LM's estimate for the same shape, whose
    /// dropout masks this model does not have, beside it.
    sequence_parallel_activation_ratio: Vec<(usize, usize, f64, f64)>,
}

fn list<T: std::str::FromStr>(text: &str, what: &str) -> Result<Vec<T>> {
    text.split(',').map(|s| s.trim().parse().ok().with_context(|| format!("--{what}: {s:?} is not a number"))).collect()
}

/// Megatron-LM's activation bytes per layer per token-row, over s·b·h, with tensor size `t`:
/// 10 + 24/t + 5as/(ht) without sequence parallel, 34/t + 5as/(ht) with it.
fn megatron_ratio(args: &BenchParallelArgs, t: usize) -> f64 {
    let t = t as f64;
    let attention = 5.0 * args.heads as f64 * args.ctx as f64 / (args.dim as f64 * t);
    (34.0 / t + attention) / (10.0 + 24.0 / t + attention)
}

pub fn run(args: BenchParallelArgs) -> Result<()> {
    let worlds: Vec<usize> = list(&args.nproc, "nproc")?;
    let tensors: Vec<usize> = list(&args.tensor, "tensor")?;
    let methods: Vec<&str> = args.methods.split(',').map(str::trim).collect();
    if let Some(bad) = methods.iter().find(|m| !["data", "zero2", "fsdp"].contains(m)) {
        anyhow::bail!("--methods: {bad:?} is not one of data, zero2, fsdp");
    }
    let mut rows: Vec<Row> = Vec::new();
    for &n in &worlds {
        let mut data_speed = None;
        for &t in tensors.iter().filter(|&&t| t >= 1 && n % t == 0) {
            for &method in &methods {
                for sequence_parallel in [false, true].into_iter().filter(|&sp| !sp || t > 1) {
                    let mut items = vec![];
                    if t > 1 {
                        items.push(format!(r#"["parallel_mode", [[["tensor", {t}]], null]]"#));
                        items.push(format!(r#"["tensor_parallel", {{"sequence_parallel": {sequence_parallel}}}]"#));
                    }
                    if method != "data" {
                        items.push(format!("{method:?}"));
                    }
                    let strategy = format!("[{}]", items.join(", "));
                    let flags = format!(
                        "--model gpt --steps {} --schedule constant --layers {} --heads {} --dim {} --ctx {} --batch-size {} --threads 1 --nproc {n}",
                        args.steps, args.layers, args.heads, args.dim, args.ctx, args.batch_size
                    );
                    let mut argv: Vec<String> = flags.split_whitespace().map(String::from).collect();
                    argv.extend(["--strategy".to_string(), strategy]);
                    let run = bench_runs::train(&argv, 2)?;
                    let states = run.last["model_state_peak_bytes"].as_u64().context("no model-state peak")?;
                    let allocated = run.last["allocator_peak_bytes"].as_u64().context("no allocator peak")?;
                    let data = *data_speed.get_or_insert(run.tokens_per_s);
                    rows.push(Row {
                        world_size: n,
                        tensor_size: t,
                        sequence_parallel,
                        method: method.to_string(),
                        tokens_per_s: run.tokens_per_s,
                        speed_vs_data: run.tokens_per_s / data.max(1e-9),
                        model_state_bytes: states,
                        allocator_peak_bytes: allocated,
                        activation_bytes: allocated.saturating_sub(states),
                    });
                }
            }
        }
    }
    let find = |r: &Row, sp: bool| r.method == "data" && r.tensor_size > 1 && r.sequence_parallel == sp;
    let ratios = rows
        .iter()
        .filter(|r| find(r, true))
        .filter_map(|with| {
            let without = rows
                .iter()
                .find(|r| find(r, false) && r.world_size == with.world_size && r.tensor_size == with.tensor_size)?;
            let measured = with.activation_bytes as f64 / (without.activation_bytes as f64).max(1.0);
            Some((with.world_size, with.tensor_size, measured, megatron_ratio(&args, with.tensor_size)))
        })
        .collect();
    let report = Report { rows, sequence_parallel_activation_ratio: ratios };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "GPT {} blocks of width {}, {} heads, ctx {}, global batch {}; peaks on rank 0",
        args.layers, args.dim, args.heads, args.ctx, args.batch_size
    );
    println!(
        "{:>5} {:>6} {:>3} {:<6} {:>10} {:>8} {:>12} {:>12} {:>12}",
        "ranks", "tensor", "sp", "method", "tokens/s", "vs data", "model states", "allocator", "activations"
    );
    for r in &report.rows {
        println!(
            "{:>5} {:>6} {:>3} {:<6} {:>10.0} {:>8.3} {:>9.2}MiB {:>9.2}MiB {:>9.2}MiB",
            r.world_size,
            r.tensor_size,
            if r.sequence_parallel { "yes" } else { "no" },
            r.method,
            r.tokens_per_s,
            r.speed_vs_data,
            r.model_state_bytes as f64 / MIB,
            r.allocator_peak_bytes as f64 / MIB,
            r.activation_bytes as f64 / MIB
        );
    }
    for (n, t, measured, estimate) in &report.sequence_parallel_activation_ratio {
        println!(
            "sequence parallel at {n} ranks, tensor size {t}: activations × {measured:.3} (Megatron-LM's estimate × {estimate:.3}, with dropout masks)"
        );
    }
    Ok(())
}
