//! `strata bench train`: the same GPT trained by Strata and by PyTorch eager (the project's
//! reference script, run with the project's virtual environment) in one run, side by side.
use crate::bench_runs::GptShape;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;
use strata::data::{Batch, Step};
use strata::engine::{memory, EngineConfig};
use strata::model::GptConfig;
use strata::model::ModelConfig;
use strata::optim::{Optimizer, OptimizerConfig, Schedule};
use strata::parallel::{self, Placement};
use strata::strategy::Strategy;
use strata::train::Trainer;
use tch::{Kind, Tensor};

#[derive(Args, Debug, Clone)]
pub struct BenchTrainArgs {
    #[command(flatten)]
    shape: GptShape,
    #[arg(long, default_value_t = 256)]
    vocab: i64,
    #[arg(long, default_value_t = 8)]
    batch_size: i64,
    #[arg(long, default_value_t = 2)]
    threads: i32,
    /// Measured blocks of each side, alternating PyTorch and Strata.
    #[arg(long, default_value_t = 10)]
    rounds: u64,
    /// Training steps per block.
    #[arg(long, default_value_t = 5)]
    block: u64,
    /// Warm-up steps of each side before measuring.
    #[arg(long, default_value_t = 5)]
    warmup: u64,
    /// Python of the environment with torch (default: the checkout's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Debug, Default, Serialize)]
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
    /// Measured steps of each side.
    steps: u64,
    strata: Measurement,
    pytorch: Measurement,
    /// Strata tokens/s divided by PyTorch tokens/s.
    ratio: f64,
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs the PyTorch reference `scripts/SCRIPT` with `args` in the environment of `python`
/// (default: the checkout's .venv) and returns the JSON report it prints.
pub fn run_reference(python: Option<&PathBuf>, script: &str, args: &[String]) -> Result<serde_json::Value> {
    let python = python.cloned().unwrap_or_else(|| repo_root().join(".venv/bin/python"));
    let out = Command::new(&python)
        .arg(repo_root().join("scripts").join(script))
        .args(args)
        .output()
        .with_context(|| format!("cannot run {} (run scripts/setup.sh first)", python.display()))?;
    if !out.status.success() {
        bail!("the PyTorch reference {script} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("the PyTorch reference {script} printed no JSON report"))
}

/// Strata's side: a trainer and a few fixed batches, timed block by block.
struct StrataSide {
    trainer: Trainer,
    batches: Vec<Step>,
    done: usize,
}

impl StrataSide {
    fn new(cfg: &GptConfig, batch_size: i64) -> Result<StrataSide> {
        // The reference uses fused attention and layer norm: so does this side.
        let strategy = Strategy::parse(r#"["module_replace"]"#)?;
        let spec = ModelConfig::Gpt(cfg.clone()).spec()?;
        let mut engine = parallel::build_engine(spec, EngineConfig::default(), &strategy, &Placement::single())?;
        let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[])?;
        let trainer = Trainer::new(engine, optimizer, Schedule::Constant, Some(1.0));
        let batches = (0..4)
            .map(|i| {
                let t = Tensor::randint(cfg.vocab, [batch_size, cfg.ctx + 1], (Kind::Int64, tch::Device::Cpu));
                Step {
                    index: i,
                    micro_batches: vec![Batch { inputs: t.narrow(1, 0, cfg.ctx), targets: t.narrow(1, 1, cfg.ctx) }],
                }
            })
            .collect();
        Ok(StrataSide { trainer, batches, done: 0 })
    }

    fn run(&mut self, steps: u64) -> Result<f64> {
        let start = Instant::now();
        for _ in 0..steps {
            self.trainer.train_step(&self.batches[self.done % self.batches.len()])?;
            self.done += 1;
        }
        Ok(start.elapsed().as_secs_f64())
    }
}

/// PyTorch's side: the reference script serving blocks of steps over stdin/stdout.
struct PytorchSide {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    peak_rss_bytes: u64,
}

impl PytorchSide {
    fn start(a: &BenchTrainArgs, cfg: &GptConfig) -> Result<PytorchSide> {
        let root = repo_root();
        let python = a.python.clone().unwrap_or_else(|| root.join(".venv/bin/python"));
        let n = |v: i64| v.to_string();
        let mut child = Command::new(&python)
            .arg(root.join("scripts/torch_reference.py"))
            .args(["bench", "--vocab", &n(cfg.vocab), "--ctx", &n(cfg.ctx), "--layers", &n(cfg.layers)])
            .args(["--heads", &n(cfg.heads), "--dim", &n(cfg.dim), "--batch", &n(a.batch_size)])
            .args(["--threads", &a.threads.to_string(), "--grad-clip", "1.0"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {} (run scripts/setup.sh first)", python.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            bail!("no pipes to the PyTorch reference");
        };
        Ok(PytorchSide { child, stdin, stdout: BufReader::new(stdout), peak_rss_bytes: 0 })
    }

    fn run(&mut self, steps: u64) -> Result<f64> {
        #[derive(Deserialize)]
        struct Answer {
            seconds: f64,
            peak_rss_bytes: u64,
        }
        writeln!(self.stdin, "{steps}").context("the PyTorch reference stopped")?;
        let mut line = String::new();
        self.stdout.read_line(&mut line).context("the PyTorch reference stopped")?;
        let answer: Answer = serde_json::from_str(&line).with_context(|| {
            let status = self.child.try_wait().ok().flatten();
            format!("the PyTorch reference failed (exit {status:?}); run it by hand to see why")
        })?;
        self.peak_rss_bytes = answer.peak_rss_bytes;
        Ok(answer.seconds)
    }
}

impl Drop for PytorchSide {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn run(a: BenchTrainArgs) -> Result<()> {
    let GptShape { layers, heads, dim, ctx } = a.shape;
    let cfg = GptConfig::new(a.vocab, ctx, layers, heads, dim);
    cfg.validate()?;
    if a.rounds == 0 || a.block == 0 || a.batch_size <= 0 || a.threads <= 0 {
        bail!("rounds, block, batch size and threads must be positive");
    }
    tch::set_num_threads(a.threads);
    tch::manual_seed(0);
    let mut pytorch = PytorchSide::start(&a, &cfg)?;
    let mut strata = StrataSide::new(&cfg, a.batch_size)?;
    pytorch.run(a.warmup)?;
    strata.run(a.warmup)?;
    // Short alternating blocks: both sides see the same drifts of a shared machine, and
    // only one of them runs at a time.
    let (mut t_pytorch, mut t_strata) = (0.0, 0.0);
    for _ in 0..a.rounds {
        t_pytorch += pytorch.run(a.block)?;
        t_strata += strata.run(a.block)?;
    }
    let steps = a.rounds * a.block;
    let tokens = (steps as i64 * a.batch_size * cfg.ctx) as f64;
    let measured = |seconds: f64, peak_rss_bytes: u64| Measurement {
        tokens_per_s: tokens / seconds,
        step_ms: 1000.0 * seconds / steps as f64,
        peak_rss_bytes,
    };
    let strata = measured(t_strata, memory::process_peak_rss().unwrap_or(0));
    let pytorch = measured(t_pytorch, pytorch.peak_rss_bytes);
    let ratio = strata.tokens_per_s / pytorch.tokens_per_s;
    let report = Report { config: cfg, batch_size: a.batch_size, threads: a.threads, steps, strata, pytorch, ratio };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let c = &report.config;
    println!(
        "GPT {} layers, {} heads, dim {}, ctx {}, vocab {}, batch {}, {} threads; {} steps each, in alternating blocks of {}",
        c.layers, c.heads, c.dim, c.ctx, c.vocab, report.batch_size, report.threads, steps, a.block
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
