//! `strata bench checkpoint`: what checkpointing every step costs a run, synchronous against
//! asynchronous (`--checkpoint-async`), beside the same run without checkpoints, for each
//! strategy given: the time each save stops training, the writer's time, and the tokens/s
//! of the whole run (steps and saves) against the run without checkpoints.
use crate::bench_runs::{self, GptShape};
use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;

#[derive(Args, Debug, Clone)]
pub struct BenchCheckpointArgs {
    #[command(flatten)]
    shape: GptShape,
    #[arg(long, default_value_t = 256)]
    vocab: i64,
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Ranks of each run.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Steps of each run (every step saves a checkpoint; the first two steps are warm-up:
    /// the first save allocates the snapshot's memory, which its writer fills during the
    /// second step).
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Runs per configuration, in rounds that visit every configuration in turn; the
    /// figures are medians over their steps.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Strategies to compare (strategy JSON, one per flag).
    #[arg(long = "strategy", default_values_t = [
        r#"["fsdp"]"#.to_string(),
        r#"["fsdp", ["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]]"#.to_string(),
    ])]
    strategies: Vec<String>,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// How a run checkpoints.
const MODES: [(&str, &[&str]); 3] = [
    ("none", &[]),
    ("sync", &["--checkpoint-every", "1"]),
    ("async", &["--checkpoint-every", "1", "--checkpoint-async", "true"]),
];

#[derive(Serialize)]
struct Row {
    strategy: String,
    mode: &'static str,
    /// Median seconds of a step (saves excluded).
    step_s: f64,
    /// Median seconds a save stopped training (0 without checkpoints).
    blocked_s: f64,
    /// Of those, median seconds waiting for the previous save's writer (asynchronous saves).
    waited_s: f64,
    /// Median seconds the writer took to persist a save (asynchronous saves).
    persisted_s: Option<f64>,
    /// Of those, median seconds the writer's thread ran on a CPU.
    persisted_cpu_s: Option<f64>,
    /// Median seconds the step after a save waited, before its updates, for the writer's
    /// copy of the values on the host (asynchronous saves; counted in `step_s`).
    updates_waited_s: f64,
    /// Tokens over the seconds of the timed steps and their saves.
    tokens_per_s: f64,
    /// `tokens_per_s` over the run without checkpoints'.
    vs_none: f64,
    /// `blocked_s` over the synchronous save's (asynchronous saves).
    blocked_vs_sync: Option<f64>,
}

/// Per-step samples of one configuration over the rounds.
#[derive(Default)]
struct Samples {
    step_s: Vec<f64>,
    blocked_s: Vec<f64>,
    waited_s: Vec<f64>,
    persisted_s: Vec<f64>,
    persisted_cpu_s: Vec<f64>,
    updates_waited_s: Vec<f64>,
    tokens: f64,
    seconds: f64,
}

pub fn run(args: BenchCheckpointArgs) -> Result<()> {
    if args.steps < 4 {
        bail!("--steps must be at least 4 (two warm-up steps, and saves timed after them)");
    }
    if args.rounds == 0 || args.nproc == 0 {
        bail!("--rounds and --nproc must be at least 1");
    }
    let s = &args.shape;
    let base = format!(
        "--model gpt --vocab {} --layers {} --heads {} --dim {} --ctx {} --batch-size {} --steps {} --threads {} \
         --schedule constant --nproc {}",
        args.vocab, s.layers, s.heads, s.dim, s.ctx, args.batch_size, args.steps, args.threads, args.nproc
    );
    let configurations: Vec<(String, &'static str, &[&str])> = args
        .strategies
        .iter()
        .flat_map(|strategy| MODES.iter().map(move |(mode, flags)| (strategy.clone(), *mode, *flags)))
        .collect();
    let mut samples: Vec<Samples> = configurations.iter().map(|_| Samples::default()).collect();
    for _ in 0..args.rounds {
        for ((strategy, _, flags), sample) in configurations.iter().zip(&mut samples) {
            let dir = tempfile::tempdir()?;
            let mut argv: Vec<String> = base.split_whitespace().map(String::from).collect();
            argv.extend(["--strategy".into(), strategy.clone()]);
            if !flags.is_empty() {
                argv.extend(["--save-checkpoint".into(), dir.path().join("ckpt").to_string_lossy().into_owned()]);
                argv.extend(flags.iter().map(|f| f.to_string()));
            }
            // The first save allocates the snapshot's memory (a cost each job pays once),
            // and its writer fills it during the second step: both are warm-up.
            let run = bench_runs::train(&argv, 2)?;
            // A step's report carries the save after the step before it: the saves after
            // the timed steps are those reported from the step after the first timed one.
            for (i, r) in run.timed.iter().enumerate() {
                let seconds = r["seconds"].as_f64().unwrap_or(0.0);
                sample.step_s.push(seconds);
                sample.tokens += r["tokens"].as_f64().unwrap_or(0.0);
                sample.seconds += seconds;
                if i == 0 {
                    continue;
                }
                let blocked = r["checkpoint"]["blocked_s"].as_f64().unwrap_or(0.0);
                sample.blocked_s.push(blocked);
                sample.waited_s.push(r["checkpoint"]["waited_s"].as_f64().unwrap_or(0.0));
                sample.updates_waited_s.push(r["checkpoint"]["updates_waited_s"].as_f64().unwrap_or(0.0));
                sample.seconds += blocked;
                // Reported once the previous save's writer is done (asynchronous saves).
                for (key, into) in
                    [("persisted_s", &mut sample.persisted_s), ("persisted_cpu_s", &mut sample.persisted_cpu_s)]
                {
                    into.extend(r["checkpoint"][key].as_f64());
                }
            }
        }
    }
    let mut rows: Vec<Row> = configurations
        .iter()
        .zip(samples)
        .map(|((strategy, mode, _), s)| Row {
            strategy: strategy.clone(),
            mode,
            step_s: bench_runs::median(s.step_s),
            blocked_s: bench_runs::median(s.blocked_s),
            waited_s: bench_runs::median(s.waited_s),
            persisted_s: (!s.persisted_s.is_empty()).then(|| bench_runs::median(s.persisted_s)),
            persisted_cpu_s: (!s.persisted_cpu_s.is_empty()).then(|| bench_runs::median(s.persisted_cpu_s)),
            updates_waited_s: bench_runs::median(s.updates_waited_s),
            tokens_per_s: s.tokens / s.seconds.max(1e-9),
            vs_none: 0.0,
            blocked_vs_sync: None,
        })
        .collect();
    for chunk in rows.chunks_mut(MODES.len()) {
        let none = chunk[0].tokens_per_s.max(1e-9);
        let sync = chunk[1].blocked_s.max(1e-9);
        for row in chunk.iter_mut() {
            row.vs_none = row.tokens_per_s / none;
        }
        chunk[2].blocked_vs_sync = Some(chunk[2].blocked_s / sync);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "GPT {} layers × {} wide, {} ranks, a checkpoint after every step ({} steps, {} round(s))",
        s.layers, s.dim, args.nproc, args.steps, args.rounds
    );
    println!(
        "{:<44} {:>6} {:>8} {:>10} {:>9} {:>11} {:>9} {:>13} {:>10} {:>8} {:>8}",
        "strategy",
        "saves",
        "step s",
        "blocked s",
        "waited s",
        "persisted s",
        "its CPU s",
        "upd. waited s",
        "tokens/s",
        "/none",
        "/sync"
    );
    for r in &rows {
        println!(
            "{:<44} {:>6} {:>8.3} {:>10.3} {:>9.3} {:>11} {:>9} {:>13.3} {:>10.0} {:>8.3} {:>8}",
            r.strategy,
            r.mode,
            r.step_s,
            r.blocked_s,
            r.waited_s,
            r.persisted_s.map_or(String::new(), |p| format!("{p:.3}")),
            r.persisted_cpu_s.map_or(String::new(), |p| format!("{p:.3}")),
            r.updates_waited_s,
            r.tokens_per_s,
            r.vs_none,
            r.blocked_vs_sync.map_or(String::new(), |v| format!("{v:.3}"))
        );
    }
    Ok(())
}
