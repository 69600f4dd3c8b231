//! `strata bench methods`: the compute methods (amp_native, half, fp8, checkpoint,
//! module_replace) and LoRA adapters each against none on the same GPT, in rounds that visit every
//! configuration in turn so that all see the same drifts of the machine: tokens/s, the
//! allocator's peak (activations included) and the model-state peak.
//!
//! Owns the configurations and the table. Must not train in this process: each run is a
//! `strata train` child ([`crate::bench_runs`]), so its peaks are its own.
use crate::bench_runs::{self, median, GptShape};
use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;

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

/// (label, strategy) of every configuration; the first is the reference.
const CONFIGS: [(&str, &str); 11] = [
    ("none", "[]"),
    ("amp_native bf16", r#"[["amp_native", {"dtype": "bf16"}]]"#),
    ("amp_native fp16", r#"["amp_native"]"#),
    ("half bf16", r#"[["half", "bf16"]]"#),
    ("half fp16", r#"["half"]"#),
    ("fp8", r#"[["fp8", {"exclude": ["lm_head"]}]]"#),
    ("checkpoint", r#"[["checkpoint", ["GptBlock"]]]"#),
    ("module_replace", r#"["module_replace"]"#),
    ("all but fp16", r#"[["amp_native", {"dtype": "bf16"}], ["checkpoint", ["GptBlock"]], "module_replace"]"#),
    ("lora r=8", r#"[["lora", {"r": 8, "alpha": 16, "target_modules": "all-linear"}]]"#),
    ("lora, half bf16", r#"[["half", "bf16"], ["lora", {"r": 8, "alpha": 16, "target_modules": "all-linear"}]]"#),
];

#[derive(Serialize)]
struct Row {
    method: &'static str,
    strategy: &'static str,
    tokens_per_s: f64,
    speed_vs_none: f64,
    allocator_peak_bytes: u64,
    memory_vs_none: f64,
    model_state_bytes: u64,
    final_loss: f64,
}

pub fn run(args: BenchMethodsArgs) -> Result<()> {
    let flags = format!(
        "--model gpt --steps {} --schedule constant --layers {} --heads {} --dim {} --ctx {} --batch-size {} --threads {}",
        args.steps, args.shape.layers, args.shape.heads, args.shape.dim, args.shape.ctx, args.batch_size, args.threads
    );
    let base: Vec<String> = flags.split_whitespace().map(String::from).collect();
    let mut samples: Vec<Vec<(f64, f64, f64, f64)>> = vec![Vec::new(); CONFIGS.len()];
    for _ in 0..args.rounds.max(1) {
        for (i, (_, strategy)) in CONFIGS.iter().enumerate() {
            let argv = [&base[..], &["--strategy".to_string(), strategy.to_string()]].concat();
            let run = bench_runs::train(&argv, 2)?;
            let field = |k: &str| run.last[k].as_f64().with_context(|| format!("no {k} in the metrics"));
            samples[i].push((
                run.tokens_per_s,
                field("allocator_peak_bytes")?,
                field("model_state_peak_bytes")?,
                field("loss")?,
            ));
        }
    }
    let pick = |i: usize, f: fn(&(f64, f64, f64, f64)) -> f64| median(samples[i].iter().map(f).collect());
    let (speed0, mem0) = (pick(0, |s| s.0), pick(0, |s| s.1));
    let rows: Vec<Row> = CONFIGS
        .iter()
        .enumerate()
        .map(|(i, (method, strategy))| Row {
            method,
            strategy,
            tokens_per_s: pick(i, |s| s.0),
            speed_vs_none: pick(i, |s| s.0) / speed0.max(1e-9),
            allocator_peak_bytes: pick(i, |s| s.1) as u64,
            memory_vs_none: pick(i, |s| s.1) / mem0.max(1.0),
            model_state_bytes: pick(i, |s| s.2) as u64,
            final_loss: pick(i, |s| s.3),
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
        "{:<16} {:>10} {:>8} {:>13} {:>8} {:>13} {:>8}",
        "method", "tokens/s", "speed", "peak alloc", "memory", "model states", "loss"
    );
    for r in &rows {
        println!(
            "{:<16} {:>10.0} {:>8.3} {:>11.1}MB {:>8.3} {:>11.1}MB {:>8.4}",
            r.method,
            r.tokens_per_s,
            r.speed_vs_none,
            r.allocator_peak_bytes as f64 / 1e6,
            r.memory_vs_none,
            r.model_state_bytes as f64 / 1e6,
            r.final_loss
        );
    }
    Ok(())
}
