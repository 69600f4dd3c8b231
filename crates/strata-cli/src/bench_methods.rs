//! `strata bench methods`: the compute methods (amp_native, half, fp8, checkpoint,
//! module_replace) and LoRA adapters (alone, on a bf16 base, beside fsdp over two ranks and
//! offloaded) each against none on the same GPT, in rounds that visit every configuration in
//! turn so that all see the same drifts of the machine: tokens/s, the allocator's peak
//! (activations included) and the model-state peaks, in all and on the host.
//!
//! Owns the configurations and the table. Must not train in this process: each run is a
//! `strata train` child ([`crate::bench_runs`]), so its peaks are its own.
use crate::bench_runs::{self, median, GptShape};
use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use strata::profile::MIB;

#[derive(Args, Debug, Clone)]
pub struct BenchMethodsArgs {
    #[command(flatten)]
    shape: GptShape,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Steps per run; the first two are warm-up and not timed.
    #[arg(long, default_value_t = 8)]
    steps: u64,
    /// Rounds over all configurations; each figure is the median over rounds.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// libtorch threads per run.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

const LORA: &str = r#"["lora", {"r": 8, "alpha": 16, "target_modules": "all-linear"}]"#;

/// (label, strategy, ranks) of every configuration; the first is the reference. `{lora}`
/// stands for [`LORA`].
const CONFIGS: [(&str, &str, usize); 14] = [
    ("none", "[]", 1),
    ("amp_native bf16", r#"[["amp_native", {"dtype": "bf16"}]]"#, 1),
    ("amp_native fp16", r#"["amp_native"]"#, 1),
    ("half bf16", r#"[["half", "bf16"]]"#, 1),
    ("half fp16", r#"["half"]"#, 1),
    ("fp8", r#"[["fp8", {"exclude": ["lm_head"]}]]"#, 1),
    ("checkpoint", r#"[["checkpoint", ["GptBlock"]]]"#, 1),
    ("module_replace", r#"["module_replace"]"#, 1),
    ("all but fp16", r#"[["amp_native", {"dtype": "bf16"}], ["checkpoint", ["GptBlock"]], "module_replace"]"#, 1),
    ("lora r=8", "[{lora}]", 1),
    ("lora, half bf16", r#"[["half", "bf16"], {lora}]"#, 1),
    ("fsdp ×2 bf16", r#"[["fsdp", {"mixed_precision": {"param_dtype": "bf16"}}]]"#, 2),
    ("lora, fsdp ×2 bf16", r#"[["fsdp", {"mixed_precision": {"param_dtype": "bf16"}}], {lora}]"#, 2),
    ("lora, offload", r#"[["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}], {lora}]"#, 1),
];

#[derive(Serialize)]
struct Row {
    method: &'static str,
    strategy: &'static str,
    tokens_per_s: f64,
    speed_vs_none: f64,
    ranks: usize,
    allocator_peak_bytes: u64,
    memory_vs_none: f64,
    model_state_bytes: u64,
    host_model_state_bytes: u64,
    final_loss: f64,
}

pub fn run(args: BenchMethodsArgs) -> Result<()> {
    let flags = format!(
        "--model gpt --steps {} --schedule constant --layers {} --heads {} --dim {} --ctx {} --batch-size {} --threads {}",
        args.steps, args.shape.layers, args.shape.heads, args.shape.dim, args.shape.ctx, args.batch_size, args.threads
    );
    let base: Vec<String> = flags.split_whitespace().map(String::from).collect();
    let mut samples: Vec<Vec<[f64; 5]>> = vec![Vec::new(); CONFIGS.len()];
    for _ in 0..args.rounds.max(1) {
        for (i, (_, strategy, ranks)) in CONFIGS.iter().enumerate() {
            let strategy = strategy.replace("{lora}", LORA);
            let argv = [&base[..], &["--strategy".into(), strategy, "--nproc".into(), ranks.to_string()]].concat();
            let run = bench_runs::train(&argv, 2)?;
            let field = |k: &str| run.last[k].as_f64().with_context(|| format!("no {k} in the metrics"));
            samples[i].push([
                run.tokens_per_s,
                field("allocator_peak_bytes")?,
                field("model_state_peak_bytes")?,
                run.last["memory"]["host"]["peak"].as_f64().unwrap_or(0.0),
                field("loss")?,
            ]);
        }
    }
    let pick = |i: usize, k: usize| median(samples[i].iter().map(|s| s[k]).collect());
    let (speed0, mem0) = (pick(0, 0), pick(0, 1));
    let rows: Vec<Row> = CONFIGS
        .iter()
        .enumerate()
        .map(|(i, &(method, strategy, ranks))| Row {
            method,
            strategy,
            tokens_per_s: pick(i, 0),
            speed_vs_none: pick(i, 0) / speed0.max(1e-9),
            ranks,
            allocator_peak_bytes: pick(i, 1) as u64,
            memory_vs_none: pick(i, 1) / mem0.max(1.0),
            model_state_bytes: pick(i, 2) as u64,
            host_model_state_bytes: pick(i, 3) as u64,
            final_loss: pick(i, 4),
        })
        .collect();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "GPT {} layers, width {}, ctx {}, batch {}: medians over {} rounds",
        args.shape.layers, args.shape.dim, args.shape.ctx, args.batch_size, args.rounds
    );
    println!(
        "{:<20} {:>5} {:>10} {:>8} {:>13} {:>8} {:>13} {:>13} {:>8}",
        "method", "ranks", "tokens/s", "speed", "peak alloc", "memory", "model states", "on the host", "loss"
    );
    for r in &rows {
        println!(
            "{:<20} {:>5} {:>10.0} {:>8.3} {:>10.1}MiB {:>8.3} {:>10.1}MiB {:>10.1}MiB {:>8.4}",
            r.method,
            r.ranks,
            r.tokens_per_s,
            r.speed_vs_none,
            r.allocator_peak_bytes as f64 / MIB,
            r.memory_vs_none,
            r.model_state_bytes as f64 / MIB,
            r.host_model_state_bytes as f64 / MIB,
            r.final_loss
        );
    }
    Ok(())
}
