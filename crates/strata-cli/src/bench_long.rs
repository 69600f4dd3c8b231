//! `strata bench long`: at a fixed LLaMA, the longest row (one a step) that trains with its
//! step's allocator peak within a device budget, for each of: nothing, recomputation, then
//! the chunked loss, activation offload, and context parallelism over 2 and 4 ranks added
//! in turn; with tokens/s at that length. Every configuration runs fused attention where it
//! applies (`module_replace`), as long rows need. On any device, in fp32 or bf16, training
//! every weight or LoRA adapters; with `--reference`, `transformers` beside it (SDPA
//! attention, with and without recomputation), its longest row found the same way.
use crate::{bench, bench_runs};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
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
    /// The device every run trains on (cpu, cuda, cuda:N).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute in bf16: autocast over fp32 weights (`amp_native`), or with --lora-rank a
    /// bf16 base (`zero1`'s `mixed_precision` policy) under fp32 adapters.
    #[arg(long)]
    bf16: bool,
    /// Train LoRA adapters of this rank on every linear layer (alpha twice the rank) instead
    /// of every weight; the base is frozen.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    lora_rank: Option<i64>,
    /// Measure `transformers` beside Strata, the same LLaMA with SDPA attention, with and
    /// without recomputation (`scripts/long_reference.py`; its peak is the CUDA allocator's
    /// on a GPU, the process's resident set on the CPU).
    #[arg(long)]
    reference: bool,
    /// Python of the environment with torch and transformers (default: the checkout's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
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
    /// Parameters the optimizer updates, where the side reports them (`transformers`').
    #[serde(skip_serializing_if = "Option::is_none")]
    trained_parameters: Option<u64>,
    /// `longest` over the configuration "nothing"'s.
    vs_nothing: Option<f64>,
    /// `longest` over the longest of `transformers`' rows (with `--reference`).
    vs_reference: Option<f64>,
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
    /// Parameters the optimizer updates, where the side reports them (`transformers`').
    trained_parameters: Option<u64>,
}

/// What the search found for one configuration: the longest row that fits, the shortest
/// tried that did not (below `--max-ctx`'s bound), and what the longest measured.
struct Found {
    longest: i64,
    first_over: Option<i64>,
    at_longest: Option<Probe>,
}

/// The longest row (a multiple of `--granularity`, up to `--max-ctx`) whose `probe` fits
/// `--device-memory`, searched from a guess of `from` positions.
fn longest(args: &BenchLongArgs, from: i64, mut probe: impl FnMut(i64) -> Result<Probe>) -> Result<Found> {
    let mut probes: BTreeMap<i64, Probe> = BTreeMap::new();
    let units = bench_runs::largest_fitting(from / args.granularity, args.max_ctx / args.granularity, |units| {
        let probe = probe(units * args.granularity)?;
        let fits = probe.peak <= args.device_memory;
        probes.insert(units, probe);
        Ok(fits)
    })?;
    let first_over = probes.keys().find(|&&u| u > units).map(|u| u * args.granularity);
    Ok(Found { longest: units * args.granularity, first_over, at_longest: probes.remove(&units) })
}

/// `transformers`' configurations (key, label, flags of `scripts/long_reference.py`).
const REFERENCES: [(&str, &str, &[&str]); 2] = [
    ("transformers", "transformers + SDPA", &[]),
    ("transformers-recomputation", "transformers, recomputed", &["--checkpoint"]),
];

impl Row {
    fn new(configuration: &'static str, key: &'static str, ranks: usize, strategy: String, found: Found) -> Row {
        Row {
            configuration,
            key,
            ranks,
            strategy,
            longest: found.longest,
            first_over: found.first_over,
            peak_bytes: found.at_longest.as_ref().map_or(0, |p| p.peak),
            trained_parameters: found.at_longest.as_ref().and_then(|p| p.trained_parameters),
            tokens_per_s: found.at_longest.map_or(0.0, |p| p.tokens_per_s),
            vs_nothing: None,
            vs_reference: None,
        }
    }
}

/// A configuration's strategy: fused attention, its methods, then what `args` asks of
/// every run (bf16, LoRA).
fn strategy(args: &BenchLongArgs, methods: &[&str]) -> String {
    let mut all: Vec<String> =
        [r#""module_replace""#].into_iter().chain(methods.iter().copied()).map(String::from).collect();
    match (args.lora_rank, args.bf16) {
        (Some(rank), bf16) => {
            if bf16 {
                all.push(r#"["zero1", {"mixed_precision": {"param_dtype": "bf16"}}]"#.into());
            }
            let alpha = 2 * rank;
            all.push(format!(r#"["lora", {{"r": {rank}, "alpha": {alpha}, "target_modules": "all-linear"}}]"#));
        }
        (None, true) => all.push(r#"["amp_native", {"dtype": "bf16"}]"#.into()),
        (None, false) => {}
    }
    format!("[{}]", all.join(", "))
}

/// The model's shape as both sides' flags name it.
fn shape_flags(args: &BenchLongArgs, len: i64) -> Vec<String> {
    let text = format!(
        "--layers {} --heads {} --kv-heads {} --dim {} --ffn-dim {} --vocab {} --ctx {len} --steps {} --device {}",
        args.layers, args.heads, args.kv_heads, args.dim, args.ffn_dim, args.vocab, args.steps, args.device
    );
    text.split_whitespace().map(String::from).collect()
}

/// What a length past the device's memory reports: a peak no budget holds.
const OUT_OF_MEMORY: Probe = Probe { peak: u64::MAX, tokens_per_s: 0.0, trained_parameters: None };

/// Trains `args`' LLaMA on one row of `len` positions a step under `strategy` at `ranks`;
/// a run that runs out of device memory does not fit.
fn probe(args: &BenchLongArgs, ranks: usize, strategy: &str, len: i64) -> Result<Probe> {
    let mut argv = vec!["--model".to_string(), "llama".into()];
    argv.extend(shape_flags(args, len));
    let rest = format!("--batch-size 1 --threads {} --schedule constant --nproc {ranks}", args.threads);
    argv.extend(rest.split_whitespace().map(String::from));
    argv.extend(["--strategy".to_string(), strategy.to_string()]);
    let run = match bench_runs::train(&argv, 1) {
        Ok(run) => run,
        Err(e) if e.to_string().to_lowercase().contains("out of memory") => return Ok(OUT_OF_MEMORY),
        Err(e) => return Err(e),
    };
    // The steps after the first hold the optimizer's states beside the activations.
    let Some(peak) = run.timed.iter().filter_map(|r| r["allocator_peak_bytes"].as_u64()).max() else {
        bail!("strata train reported no allocator peak (at {len} positions under {strategy})");
    };
    Ok(Probe { peak, tokens_per_s: run.tokens_per_s, trained_parameters: None })
}

/// `transformers`' side (`scripts/long_reference.py`) at one length, with `extra` flags.
fn reference_probe(args: &BenchLongArgs, extra: &[&str], len: i64) -> Result<Probe> {
    let mut argv = shape_flags(args, len);
    argv.extend(extra.iter().map(|f| f.to_string()));
    if args.bf16 {
        argv.push("--bf16".into());
    }
    if let Some(rank) = args.lora_rank {
        argv.extend(["--lora-rank".to_string(), rank.to_string()]);
    }
    let report = bench::run_reference(args.python.as_ref(), "long_reference.py", &argv)?;
    if report["out_of_memory"].as_bool() == Some(true) {
        return Ok(OUT_OF_MEMORY);
    }
    let peak = report["peak_bytes"].as_u64().context("long_reference.py reported no peak")?;
    let tokens_per_s = report["tokens_per_s"].as_f64().unwrap_or(0.0);
    Ok(Probe { peak, tokens_per_s, trained_parameters: report["trained_parameters"].as_u64() })
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
    let mut rows: Vec<Row> = vec![];
    for Configuration { key, label, ranks, methods } in CONFIGURATIONS {
        if !args.only.is_empty() && !args.only.iter().any(|n| n == key) {
            continue;
        }
        let strategy = strategy(&args, methods);
        // Each configuration keeps less on the device than the one before: its search
        // starts at the length that one reached, times the ranks it adds (each rank holds
        // its share of the row).
        let from = rows.last().map_or(0, |r| r.longest * ranks as i64 / r.ranks as i64);
        let found = longest(&args, from, |len| probe(&args, ranks, &strategy, len))?;
        rows.push(Row::new(label, key, ranks, strategy, found));
    }
    if args.reference {
        let mut from = 0;
        for (key, label, flags) in REFERENCES {
            let found = longest(&args, from, |len| reference_probe(&args, flags, len))?;
            let script = format!("scripts/long_reference.py {}", flags.join(" ")).trim().to_string();
            let row = Row::new(label, key, 1, script, found);
            from = row.longest;
            rows.push(row);
        }
    }
    let nothing = rows.iter().find(|r| r.key == "nothing").map(|r| r.longest).filter(|&l| l > 0);
    let reference = rows.iter().filter(|r| REFERENCES.iter().any(|(key, _, _)| *key == r.key)).map(|r| r.longest).max();
    for r in &mut rows {
        r.vs_nothing = nothing.map(|n| r.longest as f64 / n as f64);
        r.vs_reference = reference.filter(|&l| l > 0).map(|l| r.longest as f64 / l as f64);
    }
    let report =
        Report { device_memory: args.device_memory, granularity: args.granularity, max_ctx: args.max_ctx, rows };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let training = match (args.lora_rank, args.bf16) {
        (Some(rank), true) => format!("LoRA rank {rank} over a bf16 base"),
        (Some(rank), false) => format!("LoRA rank {rank}"),
        (None, true) => "bf16 autocast".to_string(),
        (None, false) => "fp32".to_string(),
    };
    println!(
        "LLaMA {} layers × {} wide ({} heads, {} key/value), vocabulary {}, {training} on {}: the longest row \
         within {:.1} MiB a rank (lengths in steps of {}, up to {})",
        args.layers,
        args.dim,
        args.heads,
        args.kv_heads,
        args.vocab,
        args.device,
        args.device_memory as f64 / MIB,
        args.granularity,
        args.max_ctx
    );
    if args.reference && !args.device.starts_with("cuda") {
        println!("(transformers' peak on the CPU is its process's resident set, not an allocator's: not comparable)");
    }
    println!(
        "{:<34} {:>5} {:>9} {:>10} {:>14} {:>9} {:>10} {:>9}",
        "configuration", "ranks", "longest", "/nothing", "/transformers", "peak MiB", "tokens/s", "over at"
    );
    let ratio = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.2}"));
    for r in &report.rows {
        println!(
            "{:<34} {:>5} {:>9} {:>10} {:>14} {:>9.1} {:>10.0} {:>9}",
            r.configuration,
            r.ranks,
            r.longest,
            ratio(r.vs_nothing),
            ratio(r.vs_reference),
            r.peak_bytes as f64 / MIB,
            r.tokens_per_s,
            r.first_over.map_or("-".to_string(), |l| l.to_string())
        );
    }
    Ok(())
}
