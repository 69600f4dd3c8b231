//! `strata bench estimate`: the memory estimate of `strata estimate` against the
//! allocator's peak of real runs, over models of every family the command line trains,
//! sizes, precisions, sharding stages, recomputation, offload, tensor and pipeline sizes
//! and one to four ranks: per run the estimate, the measurement and the error, then the
//! median absolute error and the worst underestimate.
//!
//! Owns the configurations and the table. Must not train in this process: each run is a
//! `strata train` child ([`crate::bench_runs`]), so its peaks are its own; the estimate is
//! computed before the run, from the configuration alone.
use crate::bench_runs::{self, median};
use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use strata::auto::candidate::{Candidate, Precision, Sharding};
use strata::auto::estimate::{self, Layout, Machine, Workload};
use strata::model::{GptConfig, LlamaConfig, MlpConfig, ModelConfig};
use strata::profile::MIB;
use strata::strategy::ScheduleKind;

#[derive(Args, Debug, Clone)]
pub struct BenchEstimateArgs {
    /// Steps per run (the last one's peak is compared).
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Run only the configurations whose label contains this text.
    #[arg(long)]
    only: Option<String>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// One configuration: the model, its layout, and the run's shape.
struct Case {
    label: String,
    model: ModelConfig,
    layout: Layout,
    ranks: usize,
    /// Global rows per step.
    batch_size: usize,
    accumulation: usize,
    /// A device budget per rank, which offload plans against.
    device_budget: Option<u64>,
}

#[derive(Serialize)]
struct Row {
    label: String,
    ranks: usize,
    /// Rank 0's estimate, device and host together (on the CPU both are one allocator).
    estimated_bytes: u64,
    /// The allocator's peak on rank 0 during the last step.
    measured_bytes: u64,
    /// (estimated − measured) / measured.
    error: f64,
    /// Median seconds per step after the first.
    step_seconds: f64,
}

#[derive(Serialize)]
struct Report {
    rows: Vec<Row>,
    median_absolute_error: f64,
    /// The most negative error (an underestimate), or the least positive one.
    worst_underestimate: f64,
}

const VOCAB: i64 = 512;

fn base(precision: Precision, sharding: Sharding, checkpoint: bool, tensor: usize, offload: bool) -> Layout {
    Layout::new(Candidate { precision, module_replace: false, sharding, checkpoint, tensor, offload })
}

fn gpt(layers: i64, dim: i64, ctx: i64) -> ModelConfig {
    ModelConfig::Gpt(GptConfig::new(VOCAB, ctx, layers, 4, dim))
}

fn llama(layers: i64, dim: i64, ctx: i64) -> ModelConfig {
    ModelConfig::Llama(LlamaConfig {
        kv_heads: Some(2),
        ffn_dim: Some(dim * 8 / 3),
        ..LlamaConfig::new(VOCAB, ctx, layers, 4, dim)
    })
}

/// Every configuration the benchmark runs.
fn cases() -> Vec<Case> {
    use Precision::{AmpBf16, Fp32, HalfBf16};
    use Sharding::{Fsdp, None as Plain, Zero1, Zero2};
    let mut out = vec![];
    let mut add = |label: &str, model: ModelConfig, layout: Layout, ranks: usize, batch_size: usize, accumulation| {
        out.push(Case { label: label.into(), model, layout, ranks, batch_size, accumulation, device_budget: None })
    };
    for (name, model) in [("gpt", gpt(4, 64, 32)), ("llama", llama(4, 64, 32))] {
        let one = |precision, checkpoint| base(precision, Plain, checkpoint, 1, false);
        add(&format!("{name} fp32"), model.clone(), one(Fp32, false), 1, 8, 1);
        add(&format!("{name} checkpoint"), model.clone(), one(Fp32, true), 1, 8, 1);
        add(&format!("{name} half bf16"), model.clone(), one(HalfBf16, false), 1, 8, 1);
        add(&format!("{name} amp bf16"), model.clone(), one(AmpBf16, false), 1, 8, 1);
        add(&format!("{name} amp bf16 + checkpoint"), model.clone(), one(AmpBf16, true), 1, 8, 1);
        add(&format!("{name} fp32, 2 micro-batches"), model.clone(), one(Fp32, false), 1, 16, 2);
        add(&format!("{name} data parallel ×2"), model.clone(), one(Fp32, false), 2, 16, 1);
        add(&format!("{name} zero1 ×2"), model.clone(), base(Fp32, Zero1, false, 1, false), 2, 16, 1);
        add(&format!("{name} zero2 ×2"), model.clone(), base(Fp32, Zero2, false, 1, false), 2, 16, 1);
        add(&format!("{name} fsdp ×2"), model.clone(), base(Fp32, Fsdp, false, 1, false), 2, 16, 1);
        add(&format!("{name} fsdp + checkpoint ×2"), model.clone(), base(Fp32, Fsdp, true, 1, false), 2, 16, 1);
        add(&format!("{name} fsdp ×4"), model.clone(), base(Fp32, Fsdp, false, 1, false), 4, 16, 1);
        add(&format!("{name} zero2 ×4"), model.clone(), base(Fp32, Zero2, false, 1, false), 4, 16, 1);
        add(&format!("{name} tensor 2"), model.clone(), base(Fp32, Plain, false, 2, false), 2, 8, 1);
        let piped = |schedule| Layout { pipeline: 2, schedule, ..one(Fp32, false) };
        add(&format!("{name} pipeline 2 1f1b"), model.clone(), piped(ScheduleKind::OneForwardOneBackward), 2, 16, 4);
        add(&format!("{name} pipeline 2 gpipe"), model.clone(), piped(ScheduleKind::Gpipe), 2, 16, 4);
    }
    let g = gpt(4, 64, 32);
    add("gpt tensor 2 × data 2", g.clone(), base(Fp32, Plain, false, 2, false), 4, 16, 1);
    add("gpt pipeline 2 × data 2", g.clone(), Layout { pipeline: 2, ..base(Fp32, Plain, false, 1, false) }, 4, 16, 2);
    add("gpt half bf16 + fsdp ×2", g.clone(), base(HalfBf16, Fsdp, false, 1, false), 2, 16, 1);
    add("gpt amp bf16 + zero2 ×2", g.clone(), base(AmpBf16, Zero2, false, 1, false), 2, 16, 1);
    add("gpt 6 × 128, ctx 64", gpt(6, 128, 64), base(Fp32, Plain, false, 1, false), 1, 4, 1);
    add("gpt 6 × 128, ctx 64, checkpoint", gpt(6, 128, 64), base(Fp32, Plain, true, 1, false), 1, 4, 1);
    add("llama 8 × 128, ctx 64", llama(8, 128, 64), base(Fp32, Plain, false, 1, false), 1, 4, 1);
    add("llama 8 × 128, ctx 64, fsdp ×2", llama(8, 128, 64), base(Fp32, Fsdp, false, 1, false), 2, 8, 1);
    let mlp = ModelConfig::Mlp(MlpConfig { vocab: VOCAB, layers: 4, dim: 128 });
    add("mlp fp32", mlp.clone(), base(Fp32, Plain, false, 1, false), 1, 8, 1);
    add("mlp fsdp ×2", mlp, base(Fp32, Fsdp, false, 1, false), 2, 16, 1);
    // Offload plans against a device budget the model's states overfill.
    for (label, layout, ranks, budget_mib) in [
        ("gpt offload", base(Fp32, Plain, false, 1, true), 1, 10),
        ("gpt fsdp + offload ×2", base(Fp32, Fsdp, false, 1, true), 2, 10),
        ("llama offload", base(Fp32, Plain, false, 1, true), 1, 10),
    ] {
        let model = if label.starts_with("gpt") { g.clone() } else { llama(4, 64, 32) };
        out.push(Case {
            label: label.into(),
            model,
            layout,
            ranks,
            batch_size: 8 * ranks,
            accumulation: 1,
            device_budget: Some(budget_mib * MIB as u64),
        });
    }
    out
}

/// The `strata train` arguments of a case.
fn train_args(case: &Case, steps: u64) -> Result<Vec<String>> {
    let mut a: Vec<String> = vec![];
    let mut flag = |name: &str, value: String| a.extend([format!("--{name}"), value]);
    let blocks = match &case.model {
        ModelConfig::Gpt(c) => {
            flag("model", "gpt".into());
            for (n, v) in [("layers", c.layers), ("heads", c.heads), ("dim", c.dim), ("ctx", c.ctx), ("vocab", c.vocab)]
            {
                flag(n, v.to_string());
            }
            "GptBlock"
        }
        ModelConfig::Llama(c) => {
            flag("model", "llama".into());
            for (n, v) in [("layers", c.layers), ("heads", c.heads), ("dim", c.dim), ("ctx", c.ctx), ("vocab", c.vocab)]
            {
                flag(n, v.to_string());
            }
            flag("ffn-dim", c.hidden().to_string());
            flag("kv-heads", c.key_value_heads().to_string());
            "LlamaBlock"
        }
        ModelConfig::Mlp(c) => {
            flag("model", "mlp".into());
            for (n, v) in [("layers", c.layers), ("dim", c.dim), ("ctx", 32), ("vocab", c.vocab)] {
                flag(n, v.to_string());
            }
            "MlpLayer"
        }
        other => anyhow::bail!("the benchmark trains no {other:?}"),
    };
    let l = &case.layout;
    let pipeline = (l.pipeline > 1).then_some((l.pipeline, l.schedule, l.virtual_stages));
    let strategy = l.candidate.strategy_with_pipeline(&[blocks.to_string()], pipeline)?;
    flag("strategy", strategy.to_value().to_string());
    flag("batch-size", case.batch_size.to_string());
    flag("accumulation", case.accumulation.to_string());
    flag("steps", steps.to_string());
    flag("nproc", case.ranks.to_string());
    flag("threads", "1".into());
    flag("schedule", "constant".into());
    if let Some(b) = case.device_budget {
        flag("device-memory", b.to_string());
    }
    Ok(a)
}

fn ctx_of(model: &ModelConfig) -> i64 {
    model.context().unwrap_or(32)
}

pub fn run(args: BenchEstimateArgs) -> Result<()> {
    let cpu = estimate::device_kind("cpu")?;
    let mut rows = vec![];
    for case in cases().into_iter().filter(|c| args.only.as_ref().is_none_or(|o| c.label.contains(o.as_str()))) {
        let dp = case.layout.data_ranks(case.ranks);
        let work = Workload {
            ranks: case.ranks,
            micro_batch: case.batch_size / (dp * case.accumulation),
            ctx: ctx_of(&case.model),
            micro_batches: case.accumulation,
            optimizer_state_bytes: 8,
        };
        let machine = Machine {
            device_bytes: case.device_budget.unwrap_or(cpu.memory_bytes),
            host_bytes: cpu.memory_bytes,
            device: cpu.clone(),
        };
        let e = estimate::estimate(&case.model, &case.layout, &work, &machine)
            .with_context(|| format!("estimating {}", case.label))?;
        let rank0 = e.pipeline_ranks[0];
        let estimated = rank0.device.total() + rank0.host.total();
        let run = bench_runs::train(&train_args(&case, args.steps)?, 1)?;
        let measured = run.last["allocator_peak_bytes"].as_u64().context("no allocator peak in the metrics")?;
        let seconds: Vec<f64> = run.timed.iter().filter_map(|r| r["seconds"].as_f64()).collect();
        let error = (estimated as f64 - measured as f64) / measured as f64;
        if !args.json {
            eprintln!(
                "{:<40} {:>8.3} MiB {:>8.3} MiB {:>+7.1}%",
                case.label,
                estimated as f64 / MIB,
                measured as f64 / MIB,
                100.0 * error
            );
        }
        rows.push(Row {
            label: case.label,
            ranks: case.ranks,
            estimated_bytes: estimated,
            measured_bytes: measured,
            error,
            step_seconds: median(seconds),
        });
    }
    let median_absolute_error = median(rows.iter().map(|r| r.error.abs()).collect());
    let worst_underestimate = rows.iter().map(|r| r.error).fold(f64::INFINITY, f64::min);
    let report = Report { rows, median_absolute_error, worst_underestimate };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("{:<40} {:>5} {:>12} {:>12} {:>8}", "configuration", "ranks", "estimate", "measured", "error");
    for r in &report.rows {
        println!(
            "{:<40} {:>5} {:>8.3} MiB {:>8.3} MiB {:>+7.1}%",
            r.label,
            r.ranks,
            r.estimated_bytes as f64 / MIB,
            r.measured_bytes as f64 / MIB,
            100.0 * r.error
        );
    }
    println!(
        "{} runs: median absolute error {:.1}%, worst underestimate {:+.1}%",
        report.rows.len(),
        100.0 * report.median_absolute_error,
        100.0 * report.worst_underestimate
    );
    Ok(())
}
