//! `strata bench pipeline`: each schedule at several micro-batch counts on one pipeline:
//! tokens/s, the measured bubble (the share of the schedule each rank spent outside compute)
//! against the schedule's analytic one (equal forward, input- and weight-gradient costs) and
//! against the bubble the schedule simulator gives with the operation costs measured in the
//! same run, and per stage the micro-batches held and the activation peak.
//!
//! Owns the configurations and the comparison. Must not train in this process or simulate
//! schedules itself: each run is a `strata train` child ([`crate::bench_runs`]), and the
//! analytic and simulated bubbles come from the library's `schedule` module.
use crate::bench_runs::{self, mean, median};
use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use strata::parallel::pipeline::schedule::{self, Costs, Pipeline, ScheduleKind};
use strata::profile::MIB;

#[derive(Args, Debug, Clone)]
pub struct BenchPipelineArgs {
    /// Pipeline stages (one rank each).
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// Micro-batch counts, comma-separated.
    #[arg(long, default_value = "2,4,8")]
    micro_batches: String,
    /// Schedules, comma-separated (gpipe, 1f1b, interleaved, zero_bubble, zero_bubble_h2).
    #[arg(long, default_value = "gpipe,1f1b,interleaved,zero_bubble,zero_bubble_h2")]
    schedules: String,
    #[arg(long, default_value_t = 8)]
    layers: i64,
    #[arg(long, default_value_t = 4)]
    heads: i64,
    #[arg(long, default_value_t = 256)]
    dim: i64,
    #[arg(long, default_value_t = 128)]
    ctx: i64,
    /// Global batch (rows per step); every micro-batch count must divide it.
    #[arg(long, default_value_t = 16)]
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
    schedule: String,
    micro_batches: usize,
    tokens_per_s: f64,
    /// Median over the timed steps of the mean over ranks.
    measured_bubble: f64,
    analytic_bubble: f64,
    /// Median over the timed steps of the simulated bubble with that step's mean operation
    /// costs (mean over ranks of forward, backward, weight gradient).
    simulated_bubble: f64,
    /// The operation costs of the last step, mean over ranks, in milliseconds.
    op_ms: [f64; 3],
    micro_batches_held: Vec<u64>,
    activation_peak_bytes: Vec<u64>,
}

fn parse_kind(name: &str) -> Result<ScheduleKind> {
    serde_json::from_value(serde_json::Value::String(name.to_string())).with_context(|| {
        format!("--schedules: {name:?} is not gpipe, 1f1b, interleaved, zero_bubble or zero_bubble_h2")
    })
}

pub fn run(args: BenchPipelineArgs) -> Result<()> {
    let counts: Vec<usize> = args
        .micro_batches
        .split(',')
        .map(|s| s.trim().parse().with_context(|| format!("--micro-batches: {s:?}")))
        .collect::<Result<_>>()?;
    let mut rows = Vec::new();
    for name in args.schedules.split(',').map(str::trim) {
        let kind = parse_kind(name)?;
        let v = if kind == ScheduleKind::Interleaved { 2 } else { 1 };
        for &m in &counts {
            let pipeline = Pipeline { stages: args.stages, micro_batches: m, virtual_stages: v };
            if kind == ScheduleKind::Interleaved && m % args.stages != 0 {
                continue;
            }
            let strategy = format!(
                r#"[["parallel_mode", [[["pipeline", {}]], null]], ["pipeline_parallel", {{"schedule": "{name}", "virtual_stages": {v}}}]]"#,
                args.stages
            );
            let flags = format!(
                "--model gpt --steps {} --schedule constant --layers {} --heads {} --dim {} --ctx {} --batch-size {} --accumulation {m} --threads 1 --nproc {}",
                args.steps, args.layers, args.heads, args.dim, args.ctx, args.batch_size, args.stages
            );
            let mut argv: Vec<String> = flags.split_whitespace().map(String::from).collect();
            argv.extend(["--strategy".to_string(), strategy]);
            let run = bench_runs::train(&argv, 2)?;
            let figures = &run.last["pipeline"];
            let numbers = |key: &str| -> Vec<u64> {
                figures[key].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).collect()).unwrap_or_default()
            };
            let bubbles = run.timed.iter().map(|r| mean(&numbers_of(&r["pipeline"]["bubble"])));
            let ranks: Vec<Vec<_>> =
                (0..args.stages).map(|r| schedule::schedule(kind, pipeline, r)).collect::<Result<_, _>>()?;
            let simulated = run
                .timed
                .iter()
                .map(|r| {
                    let [forward, input_grad, weight_grad] = mean_op_seconds(&r["pipeline"]["mean_op_seconds"]);
                    let sim = schedule::simulate(pipeline, &ranks, Costs { forward, input_grad, weight_grad })?;
                    Ok(mean(&sim.bubbles()))
                })
                .collect::<Result<Vec<f64>>>()?;
            rows.push(Row {
                schedule: name.to_string(),
                micro_batches: m,
                tokens_per_s: run.tokens_per_s,
                measured_bubble: median(bubbles.collect()),
                analytic_bubble: pipeline.analytic_bubble(kind),
                simulated_bubble: median(simulated),
                op_ms: mean_op_seconds(&figures["mean_op_seconds"]).map(|s| s * 1e3),
                micro_batches_held: numbers("micro_batches_held"),
                activation_peak_bytes: numbers("activation_peak_bytes"),
            });
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "GPT {} blocks of width {}, ctx {}, global batch {}, {} stages",
        args.layers, args.dim, args.ctx, args.batch_size, args.stages
    );
    println!(
        "{:<14} {:>3} {:>10} {:>9} {:>9} {:>9} {:>16} {:>10} {:>24}",
        "schedule", "m", "tokens/s", "bubble", "analytic", "simulated", "F/B/W ms", "held", "activations per stage"
    );
    for r in &rows {
        let held: Vec<String> = r.micro_batches_held.iter().map(u64::to_string).collect();
        let acts: Vec<String> = r.activation_peak_bytes.iter().map(|b| format!("{:.1}MiB", *b as f64 / MIB)).collect();
        let [f, b, w] = r.op_ms;
        println!(
            "{:<14} {:>3} {:>10.0} {:>9.3} {:>9.3} {:>9.3} {:>16} {:>10} {:>24}",
            r.schedule,
            r.micro_batches,
            r.tokens_per_s,
            r.measured_bubble,
            r.analytic_bubble,
            r.simulated_bubble,
            format!("{f:.1}/{b:.1}/{w:.1}"),
            held.join("/"),
            acts.join(" ")
        );
    }
    Ok(())
}

/// The numbers of a JSON array (none where it is not one).
fn numbers_of(values: &serde_json::Value) -> Vec<f64> {
    values.as_array().map(|a| a.iter().filter_map(|x| x.as_f64()).collect()).unwrap_or_default()
}

/// Forward, backward and weight-gradient seconds averaged over the ranks' `[f, b, w]` rows.
fn mean_op_seconds(rows: &serde_json::Value) -> [f64; 3] {
    let rows = rows.as_array().map(Vec::as_slice).unwrap_or_default();
    std::array::from_fn(|k| mean(&rows.iter().filter_map(|r| r.get(k).and_then(|x| x.as_f64())).collect::<Vec<_>>()))
}
