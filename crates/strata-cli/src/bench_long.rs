//! `strata bench long`: at a fixed LLaMA, the longest row (one a step) that trains with its
//! step's allocator peak within a device budget, for each of: nothing, recomputation, then
//! the chunked loss, activation offload, and context parallelism over 2 and 4 ranks added
//! in turn; with tokens/s at that length. Every configuration runs fused attention where it
//! applies (`module_replace`), as long rows need.
use crate::bench_runs;
use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;
use std::collections::BTreeMap;
use strata::profile::MIB;

#[derive(Args, Debug, Clone)]
pub struct BenchLongArgs {
    #[arg(long, default_value_t = 2)]
    layers: i64,
    #[arg(long, default_value_t = 4)]
    heads: i64,
    #[arg(long, default_value_t = 2)]
    kv_heads: i64,
    #[arg(long, default_value_t = 64)]
    dim: i64,
    #[arg(long, default_value_t = 172)]
    ffn_dim: i64,
    #[arg(long, default_value_t = 2048)]
    vocab: i64,
    /// Bytes each rank's device may hold: a length fits when its steps' allocator peak
    /// (rank 0's) stays within them.
    #[arg(long, default_value_t = 24 << 20)]
    device_memory: u64,
    /// Lengths tried are multiples of this (a multiple of twice the largest context size,
    /// so the ring's balanced pieces divide it).
    #[arg(long, default_value_t = 256)]
    granularity: i64,
    /// Longest row tried.
    #[arg(long, default_value_t = 32768)]
    max_ctx: i64,
    /// Steps of each run (the first is warm-up; the peak is the largest of the others',
    /// which hold the optimizer's states made in the first).
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Configurations to measure, by key: nothing, recomputation, chunked-loss,
    /// activation-offload, context-2, context-4 (default: all, in order).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// One configuration the bench measures.
struct Configuration {
    /// How `--only` names it.
    key: &'static str,
    /// How the table names it.
    label: &'static str,
    ranks: usize,
    /// Its methods beyond fused attention.
    methods: &'static [&'static str],
}

const fn configuration(
    key: &'static str,
    label: &'static str,
    ranks: usize,
    methods: &'static [&'static str],
) -> Configuration {
    Configuration { key, label, ranks, methods }
}

/// The configurations, each adding to the one before.
const CONFIGURATIONS: [Configuration; 6] = [
    configuration("nothing", "nothing", 1, &[]),
    configuration("recomputation", "recomputation", 1, &[CHECKPOINT]),
    configuration("chunked-loss", "+ chunked loss", 1, &[CHECKPOINT, CHUNKED]),
    configuration("activation-offload", "+ activation offload", 1, &[CHECKPOINT, CHUNKED, OFFLOAD]),
    configuration("context-2", "+ context parallel 2", 2, &[CHECKPOINT, CHUNKED, OFFLOAD, CONTEXT_2]),
    configuration("context-4", "+ context parallel 4", 4, &[CHECKPOINT, CHUNKED, OFFLOAD, CONTEXT_4]),
];
const CHECKPOINT: &str = r#"["checkpoint", ["LlamaBlock"]]"#;
const CHUNKED: &str = r#""chunked_loss""#;
const OFFLOAD: &str = r#""activation_offload""#;
const CONTEXT_2: &str = r#"["context_parallel", {"size": 2}]"#;
const CONTEXT_4: &str = r#"["context_parallel", {"size": 4}]"#;

#[derive(Serialize)]
struct Row {
    configuration: &'static str,
    key: &'static str,
    ranks: usize,
    strategy: String,
    /// The longest row that fits (0: not even the shortest tried).
    longest: i64,
    /// The shortest row tried that did not fit, where one was tried below `--max-ctx`'s
    /// bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    first_over: Option<i64>,
    /// Rank 0's allocator peak at the longest row.
    peak_bytes: u64,
    /// Median tokens/s (the whole row's tokens) of the timed steps at the longest row.
    tokens_per_s: f64,
    /// `longest` over the configuration "nothing"'s.
    vs_nothing: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    device_memory: u64,
    granularity: i64,
    max_ctx: i64,
    rows: Vec<Row>,
}

/// What a run at one length measured.
struct Probe {
    peak: u64,
    tokens_per_s: f64,
}

fn strategy(methods: &[&str]) -> String {
    let all: Vec<&str> = [r#""module_replace""#].into_iter().chain(methods.iter().copied()).collect();
    format!("[{}]", all.join(", "))
}

/// Trains `args`' LLaMA on one row of `len` positions a step under `strategy` at `ranks`.
fn probe(args: &BenchLongArgs, ranks: usize, strategy: &str, len: i64) -> Result<Probe> {
    let text = format!(
        "--model llama --layers {} --heads {} --kv-heads {} --dim {} --ffn-dim {} --vocab {} --ctx {len} \
         --batch-size 1 --steps {} --threads {} --schedule constant --nproc {ranks}",
        args.layers, args.heads, args.kv_heads, args.dim, args.ffn_dim, args.vocab, args.steps, args.threads
    );
    let mut argv: Vec<String> = text.split_whitespace().map(String::from).collect();
    argv.extend(["--strategy".to_string(), strategy.to_string()]);
    let run = bench_runs::train(&argv, 1)?;
    // The steps after the first hold the optimizer's states beside the activations.
    let Some(peak) = run.timed.iter().filter_map(|r| r["allocator_peak_bytes"].as_u64()).max() else {
        bail!("strata train reported no allocator peak (at {len} positions under {strategy})");
    };
    Ok(Probe { peak, tokens_per_s: run.tokens_per_s })
}

pub fn run(args: BenchLongArgs) -> Result<()> {
    if args.steps < 2 {
        bail!("--steps must be at least 2 (one warm-up, one timed)");
    }
    let most_ranks = CONFIGURATIONS.iter().map(|c| c.ranks).max().unwrap_or(1) as i64;
    if args.granularity <= 0 || args.granularity % (2 * most_ranks) != 0 {
        bail!("--granularity must be a positive multiple of {}", 2 * most_ranks);
    }
    if let Some(unknown) = args.only.iter().find(|n| !CONFIGURATIONS.iter().any(|c| c.key == *n)) {
        let keys: Vec<&str> = CONFIGURATIONS.iter().map(|c| c.key).collect();
        bail!("--only: no configuration {unknown:?} (there are {})", keys.join(", "));
    }
    let most = args.max_ctx / args.granularity;
    let mut rows: Vec<Row> = vec![];
    for Configuration { key, label, ranks, methods } in CONFIGURATIONS {
        if !args.only.is_empty() && !args.only.iter().any(|n| n == key) {
            continue;
        }
        let strategy = strategy(methods);
        let mut probes: BTreeMap<i64, Probe> = BTreeMap::new();
        // Each configuration keeps less on the device than the one before: its search
        // starts at the length that one reached.
        let from = rows.last().map_or(1, |r| r.longest / args.granularity);
        let units = bench_runs::largest_fitting(from, most, |units| {
            let probe = probe(&args, ranks, &strategy, units * args.granularity)?;
            let fits = probe.peak <= args.device_memory;
            probes.insert(units, probe);
            Ok(fits)
        })?;
        let first_over = probes.keys().find(|&&u| u > units).map(|u| u * args.granularity);
        let at_longest = probes.remove(&units);
        rows.push(Row {
            configuration: label,
            key,
            ranks,
            strategy,
            longest: units * args.granularity,
            first_over,
            peak_bytes: at_longest.as_ref().map_or(0, |p| p.peak),
            tokens_per_s: at_longest.map_or(0.0, |p| p.tokens_per_s),
            vs_nothing: None,
        });
    }
    if let Some(nothing) = rows.iter().find(|r| r.key == "nothing").map(|r| r.longest).filter(|&l| l > 0) {
        for r in &mut rows {
            r.vs_nothing = Some(r.longest as f64 / nothing as f64);
        }
    }
    let report =
        Report { device_memory: args.device_memory, granularity: args.granularity, max_ctx: args.max_ctx, rows };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "LLaMA {} layers × {} wide ({} heads, {} key/value), vocabulary {}: the longest row within {:.1} MiB a rank \
         (lengths in steps of {}, up to {})",
        args.layers,
        args.dim,
        args.heads,
        args.kv_heads,
        args.vocab,
        args.device_memory as f64 / MIB,
        args.granularity,
        args.max_ctx
    );
    println!(
        "{:<22} {:>5} {:>9} {:>10} {:>9} {:>10} {:>9}",
        "configuration", "ranks", "longest", "/nothing", "peak MiB", "tokens/s", "over at"
    );
    for r in &report.rows {
        println!(
            "{:<22} {:>5} {:>9} {:>10} {:>9.1} {:>10.0} {:>9}",
            r.configuration,
            r.ranks,
            r.longest,
            r.vs_nothing.map_or(String::new(), |v| format!("{v:.2}")),
            r.peak_bytes as f64 / MIB,
            r.tokens_per_s,
            r.first_over.map_or("-".to_string(), |l| l.to_string())
        );
    }
    Ok(())
}
