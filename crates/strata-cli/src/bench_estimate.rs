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
use strata::auto::candidate::Layout;
use strata::auto::candidate::{Candidate, Precision, Sharding};
use strata::auto::estimate::{self, Machine, Workload};
use strata::auto::step_time::{self, Cluster, UnitWork};
use strata::model::{GptConfig, LlamaConfig, MlpConfig, ModelConfig};
use strata::profile::MIB;
use strata::strategy::ScheduleKind;

#[derive(Args, Debug, Clone)]
pub struct BenchEstimateArgs {
    /// Steps per run (the last one's peak is compared; the steps after the first two are
    /// timed).
    #[arg(long, default_value_t = 6)]
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
    /// The run that calibrated the cost of an operator (its predicted time is its own).
    calibration: bool,
    ranks: usize,
    /// Rank 0's estimate, device and host together (on the CPU both are one allocator).
    estimated_bytes: u64,
    /// The allocator's peak on rank 0 during the last step.
    measured_bytes: u64,
    /// (estimated − measured) / measured.
    error: f64,
    /// Median seconds per step after the first two.
    step_seconds: f64,
    /// The step-time model's seconds, from this machine's measured throughput.
    predicted_seconds: f64,
    /// (predicted − measured) / measured.
    time_error: f64,
}

#[derive(Serialize)]
struct Report {
    rows: Vec<Row>,
    median_absolute_error: f64,
    /// The most negative error (an underestimate), or the least positive one.
    worst_underestimate: f64,
    /// The median absolute error of the predicted step times (the calibration run left out).
    median_time_error: f64,
}

const VOCAB: i64 = 512;

fn base(precision: Precision, sharding: Sharding, checkpoint: bool, tensor: usize, offload: bool) -> Layout {
    Layout::new(Candidate { tensor, offload, ..Candidate::plain(precision, sharding, checkpoint) })
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
    let strategy = case.layout.strategy(&[blocks.to_string()])?;
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

fn width_of(model: &ModelConfig) -> i64 {
    match model {
        ModelConfig::Gpt(c) => c.dim,
        ModelConfig::Llama(c) => c.dim,
        ModelConfig::Mlp(c) => c.dim,
        ModelConfig::Bert(c) => c.dim,
        ModelConfig::T5(c) => c.dim,
    }
}

fn ctx_of(model: &ModelConfig) -> i64 {
    model.context().unwrap_or(32)
}

/// This machine as a cluster of `ranks` devices: its measured throughput at the products
/// of `tokens` rows and `width` features, each rank's share of its cores.
/// `op_seconds`, where given, replaces the measured cost of issuing one operator.
fn this_machine(ranks: usize, tokens: i64, width: i64, op_seconds: Option<f64>) -> Result<Cluster> {
    let mut device = strata::auto::calibrate::this_machine(tokens, width)?;
    device.op_seconds = op_seconds.unwrap_or(device.op_seconds);
    // Ranks beyond the cores share them.
    let share = core_share(ranks);
    device.fp32_flops *= share;
    device.bf16_flops *= share;
    device.memory_bandwidth *= share;
    device.op_seconds /= share;
    Ok(strata::auto::calibrate::node_of(device, ranks))
}

/// The share of a core each of `ranks` ranks gets on this machine.
fn core_share(ranks: usize) -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores as f64 / ranks as f64).min(1.0)
}

pub fn run(args: BenchEstimateArgs) -> Result<()> {
    let cpu = estimate::device_kind("cpu")?;
    // Each run trains on one thread per rank; measure the machine the same way.
    tch::set_num_threads(1);
    let mut rows = vec![];
    // The cost of an operator inside a step, from the first run: what its products and
    // memory traffic leave of its measured time, per operator.
    let mut op_seconds: Option<f64> = None;
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
        let cluster = this_machine(case.ranks, work.micro_batch as i64 * work.ctx, width_of(&case.model), op_seconds)?;
        let spec = case.model.spec()?;
        let units = UnitWork::counted(&spec, work.ctx)?;
        let time = step_time::step_time(&units, &spec, &case.layout, &work, &cluster, &mut step_time::Memo::default())?;
        let run = bench_runs::train(&train_args(&case, args.steps)?, 2)?;
        let measured = run.last["allocator_peak_bytes"].as_u64().context("no allocator peak in the metrics")?;
        let seconds: Vec<f64> = run.timed.iter().filter_map(|r| r["seconds"].as_f64()).collect();
        let error = (estimated as f64 - measured as f64) / measured as f64;
        let step_seconds = median(seconds);
        let calibration = op_seconds.is_none();
        let predicted = if calibration {
            let ops = time.dispatch / cluster.device.op_seconds.max(f64::MIN_POSITIVE);
            let fitted = ((step_seconds - (time.total - time.dispatch)) / ops.max(1.0)).max(0.0);
            op_seconds = Some(fitted * core_share(case.ranks));
            step_seconds
        } else {
            time.total
        };
        rows.push(Row {
            calibration,
            label: case.label,
            ranks: case.ranks,
            estimated_bytes: estimated,
            measured_bytes: measured,
            error,
            step_seconds,
            predicted_seconds: predicted,
            time_error: predicted / step_seconds - 1.0,
        });
    }
    let median_absolute_error = median(rows.iter().map(|r| r.error.abs()).collect());
    let worst_underestimate = rows.iter().map(|r| r.error).fold(f64::INFINITY, f64::min);
    let median_time_error = median(rows.iter().filter(|r| !r.calibration).map(|r| r.time_error.abs()).collect());
    let report = Report { rows, median_absolute_error, worst_underestimate, median_time_error };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{:<40} {:>5} {:>12} {:>12} {:>8} {:>10} {:>10} {:>8}",
        "configuration", "ranks", "estimate", "measured", "error", "predicted", "measured", "error"
    );
    for r in &report.rows {
        println!(
            "{:<40} {:>5} {:>8.3} MiB {:>8.3} MiB {:>+7.1}% {:>7.1} ms {:>7.1} ms {:>+7.1}%",
            r.label,
            r.ranks,
            r.estimated_bytes as f64 / MIB,
            r.measured_bytes as f64 / MIB,
            100.0 * r.error,
            1e3 * r.predicted_seconds,
            1e3 * r.step_seconds,
            100.0 * r.time_error
        );
    }
    println!(
        "{} runs: memory median absolute error {:.1}%, worst underestimate {:+.1}%; step time median absolute error {:.1}%",
        report.rows.len(),
        100.0 * report.median_absolute_error,
        100.0 * report.worst_underestimate,
        100.0 * report.median_time_error
    );
    Ok(())
}
