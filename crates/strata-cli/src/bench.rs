//! `strata bench train`: the same GPT trained by Strata and by PyTorch eager (the project's
//! reference script, run with the project's virtual environment) in one run, side by side.
use crate::options::ModelChoice;
use crate::train::build_engine;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;
use strata::data::{Batch, Step};
use strata::engine::{memory, EngineConfig};
use strata::model::GptConfig;
use strata::optim::{Optimizer, OptimizerConfig, Schedule};
use strata::train::Trainer;
use tch::{Kind, Tensor};

#[derive(Args, Debug, Clone)]
pub struct BenchTrainArgs {
    #[arg(long, default_value_t = 4)]
    layers: i64,
    #[arg(long, default_value_t = 4)]
    heads: i64,
    #[arg(long, default_value_t = 256)]
    dim: i64,
    #[arg(long, default_value_t = 128)]
    ctx: i64,
    #[arg(long, default_value_t = 256)]
    vocab: i64,
    #[arg(long, default_value_t = 8)]
    batch_size: i64,
    #[arg(long, default_value_t = 2)]
    threads: i32,
    /// Measured steps (after the warm-up).
    #[arg(long, default_value_t = 30)]
    steps: u64,
    #[arg(long, default_value_t = 5)]
    warmup: u64,
    /// Rounds, alternating PyTorch and Strata; the median of each is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Python of the environment with torch (default: the checkout's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Measurement {
    tokens_per_s: f64,
    step_ms: f64,
    peak_rss_bytes: u64,
}

#[derive(Serialize)]
struct Report {
    config: GptConfig,
    batch_size: i64,
    threads: i32,
    steps: u64,
    rounds: usize,
    /// The round with the median throughput of each.
    strata: Measurement,
    pytorch: Measurement,
    /// Strata tokens/s divided by PyTorch tokens/s (medians).
    ratio: f64,
    /// Every round's tokens/s, in the order measured.
    strata_rounds: Vec<f64>,
    pytorch_rounds: Vec<f64>,
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn strata_trainer(cfg: &GptConfig) -> Result<Trainer> {
    let engine = build_engine(&ModelChoice::Gpt(cfg.clone()), EngineConfig::default())?;
    let optimizer = Optimizer::new(&engine, OptimizerConfig::default(), &[])?;
    Ok(Trainer::new(engine, optimizer, Schedule::Constant, Some(1.0)))
}

fn measure_strata(a: &BenchTrainArgs, cfg: &GptConfig, trainer: &mut Trainer) -> Result<Measurement> {
    let steps: Vec<Step> = (0..4)
        .map(|i| {
            let t = Tensor::randint(cfg.vocab, [a.batch_size, cfg.ctx + 1], (Kind::Int64, tch::Device::Cpu));
            Step {
                index: i,
                micro_batches: vec![Batch { inputs: t.narrow(1, 0, cfg.ctx), targets: t.narrow(1, 1, cfg.ctx) }],
            }
        })
        .collect();
    let mut elapsed = 0.0;
    for i in 0..a.warmup + a.steps {
        let start = Instant::now();
        trainer.train_step(&steps[i as usize % steps.len()])?;
        if i >= a.warmup {
            elapsed += start.elapsed().as_secs_f64();
        }
    }
    let tokens = (a.steps as i64 * a.batch_size * cfg.ctx) as f64;
    Ok(Measurement {
        tokens_per_s: tokens / elapsed,
        step_ms: 1000.0 * elapsed / a.steps as f64,
        peak_rss_bytes: memory::process_peak_rss().unwrap_or(0),
    })
}

fn measure_pytorch(a: &BenchTrainArgs, cfg: &GptConfig) -> Result<Measurement> {
    let root = repo_root();
    let python = a.python.clone().unwrap_or_else(|| root.join(".venv/bin/python"));
    let n = |v: i64| v.to_string();
    let out = std::process::Command::new(&python)
        .arg(root.join("scripts/torch_reference.py"))
        .args(["bench", "--vocab", &n(cfg.vocab), "--ctx", &n(cfg.ctx), "--layers", &n(cfg.layers)])
        .args(["--heads", &n(cfg.heads), "--dim", &n(cfg.dim), "--batch", &n(a.batch_size)])
        .args(["--threads", &a.threads.to_string(), "--steps", &a.steps.to_string(), "--warmup", &a.warmup.to_string()])
        .args(["--grad-clip", "1.0"])
        .output()
        .with_context(|| format!("cannot run {} (run scripts/setup.sh first)", python.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("the PyTorch reference failed: {}", err.lines().last().unwrap_or("no output"));
    }
    serde_json::from_slice(&out.stdout).context("unreadable output from the PyTorch reference")
}

pub fn run(a: BenchTrainArgs) -> Result<()> {
    let cfg = GptConfig { vocab: a.vocab, ctx: a.ctx, layers: a.layers, heads: a.heads, dim: a.dim };
    cfg.validate()?;
    if a.steps == 0 || a.batch_size <= 0 || a.threads <= 0 {
        bail!("steps, batch size and threads must be positive");
    }
    if a.rounds == 0 {
        bail!("--rounds must be positive");
    }
    tch::set_num_threads(a.threads);
    tch::manual_seed(0);
    let mut trainer = strata_trainer(&cfg)?;
    // Alternating rounds spread the machine's drifts over both sides.
    let (mut strata, mut pytorch) = (vec![], vec![]);
    for _ in 0..a.rounds {
        pytorch.push(measure_pytorch(&a, &cfg)?);
        strata.push(measure_strata(&a, &cfg, &mut trainer)?);
    }
    let rounds = |ms: &[Measurement]| ms.iter().map(|m| m.tokens_per_s).collect::<Vec<_>>();
    let (strata_rounds, pytorch_rounds) = (rounds(&strata), rounds(&pytorch));
    let (strata, pytorch) = (median(strata), median(pytorch));
    let ratio = strata.tokens_per_s / pytorch.tokens_per_s;
    let report = Report {
        config: cfg,
        batch_size: a.batch_size,
        threads: a.threads,
        steps: a.steps,
        rounds: a.rounds,
        strata,
        pytorch,
        ratio,
        strata_rounds,
        pytorch_rounds,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let c = &report.config;
    println!(
        "GPT {} layers, {} heads, dim {}, ctx {}, vocab {}, batch {}, {} threads; median of {} rounds of {} steps",
        c.layers, c.heads, c.dim, c.ctx, c.vocab, report.batch_size, report.threads, a.rounds, report.steps
    );
    println!("{:<16} {:>12} {:>10} {:>14}", "", "tokens/s", "ms/step", "peak RSS MiB");
    for (name, m) in [("strata", &report.strata), ("pytorch eager", &report.pytorch)] {
        println!(
            "{:<16} {:>12.0} {:>10.1} {:>14.1}",
            name,
            m.tokens_per_s,
            m.step_ms,
            m.peak_rss_bytes as f64 / 1048576.0
        );
    }
    println!("strata / pytorch tokens/s: {:.3}", report.ratio);
    Ok(())
}

/// The measurement with the median throughput.
fn median(mut ms: Vec<Measurement>) -> Measurement {
    ms.sort_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
    ms.swap_remove(ms.len() / 2)
}
