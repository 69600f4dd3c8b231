//! `strata bench search`: the guided strategy search against an exhaustive one on real dry
//! runs, per scenario (world size × memory budget). The guided choice and the exhaustive
//! best are then trained side by side, alternating, and compared by median tokens/s: the
//! best of many noisy dry runs is inflated by its luck, so only a paired run judges. Every
//! dry run's prediction (peak bytes, tokens/s) is set against its measurement.
//!
//! Owns the scenarios and the paired comparison. Must not search or train in this process:
//! both searches and the paired runs are `strata train` children ([`crate::bench_runs`]).
use crate::bench_runs::{self, median, GptShape};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use serde_json::Value;

#[derive(Args, Debug, Clone)]
pub struct BenchSearchArgs {
    #[command(flatten)]
    shape: GptShape,
    /// Scenarios as RANKS or RANKS:BUDGET_BYTES (a device-memory budget per rank),
    /// comma-separated; budgets that leave some candidates out depend on the shape.
    #[arg(long, default_value = "1,2")]
    scenarios: String,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Micro-batches per step (a pipeline's micro-batches).
    #[arg(long, default_value_t = 1)]
    accumulation: usize,
    /// Methods no candidate may use (comma-separated), in both searches.
    #[arg(long)]
    excluded: Option<String>,
    /// Timed steps of each dry run.
    #[arg(long, default_value_t = 5)]
    dry_run_steps: usize,
    /// Paired runs of each side (alternating) after the searches.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Steps of each paired run; the first two are warm-up.
    #[arg(long, default_value_t = 12)]
    steps: u64,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    ranks: usize,
    budget_bytes: Option<u64>,
    /// Candidates the exhaustive search dry-ran (not pruned).
    candidates: usize,
    guided_dry_runs: usize,
    exhaustive_dry_runs: usize,
    guided_seconds: f64,
    exhaustive_seconds: f64,
    guided_choice: String,
    /// Whether the guided choice's dry run peaked within the budget.
    choice_fits: bool,
    exhaustive_best: String,
    /// Over the exhaustive search's dry runs that ran: the median and the largest of
    /// |measured / predicted − 1| for the peak, and the median of measured / predicted
    /// tokens/s.
    peak_error_median: f64,
    peak_error_max: f64,
    speed_ratio_median: f64,
    /// Median tokens/s of the guided choice over the exhaustive best's, trained side by side
    /// (1 when both chose the same).
    paired_ratio: f64,
}

/// One search (`mode`) of a scenario; its report.
fn search(args: &BenchSearchArgs, base: &[String], mode: &str) -> Result<Value> {
    let dir = tempfile::tempdir()?;
    let report = dir.path().join("report.json");
    let mut argv = base.to_vec();
    argv.extend(
        ["--steps", "1", "--strategy", "auto", "--search", mode, "--dry-run-steps"].iter().map(|s| s.to_string()),
    );
    argv.push(args.dry_run_steps.to_string());
    argv.push("--search-report".into());
    argv.push(report.to_string_lossy().into_owned());
    bench_runs::train(&argv, 0)?;
    let text = std::fs::read(&report).context("the search wrote no report")?;
    Ok(serde_json::from_slice(&text)?)
}

/// Over `report`'s dry runs with a measured peak: (median, largest) relative peak error,
/// and the median measured over predicted speed.
fn prediction_errors(report: &Value) -> (f64, f64, f64) {
    let (mut peaks, mut speeds) = (vec![], vec![]);
    for t in report["trials"].as_array().into_iter().flatten() {
        let (predicted, outcome) = (&t["predicted"], &t["outcome"]);
        let ratio = |measured: &Value, predicted: &Value| Some(measured.as_f64()? / predicted.as_f64()?.max(1e-9));
        if let Some(r) = ratio(&outcome["peak_bytes"], &predicted["peak_bytes"]) {
            peaks.push((r - 1.0).abs());
        }
        if let Some(r) = ratio(&outcome["tokens_per_s"], &predicted["tokens_per_s"]) {
            speeds.push(r);
        }
    }
    let largest = peaks.iter().copied().fold(0.0, f64::max);
    (median(peaks), largest, median(speeds))
}

fn strategy_of(report: &Value, label: &str) -> Result<String> {
    let trials = report["trials"].as_array().context("no trials in the report")?;
    let trial = trials.iter().find(|t| t["label"] == label).context("the chosen label is not among the trials")?;
    Ok(trial["strategy"].to_string())
}

pub fn run(args: BenchSearchArgs) -> Result<()> {
    let s = &args.shape;
    let mut rows = Vec::new();
    for scenario in args.scenarios.split(',').map(str::trim) {
        let (ranks, budget) = match scenario.split_once(':') {
            Some((r, b)) => (r.parse::<usize>()?, Some(b.parse::<u64>()?)),
            None => (scenario.parse::<usize>()?, None),
        };
        if ranks == 0 {
            bail!("scenario {scenario:?}: ranks must be positive");
        }
        let mut base: Vec<String> = format!(
            "--model gpt --layers {} --heads {} --dim {} --ctx {} --batch-size {} --accumulation {} --threads 1 --schedule constant --seed 1 --nproc {ranks}",
            s.layers, s.heads, s.dim, s.ctx, args.batch_size, args.accumulation
        )
        .split_whitespace()
        .map(String::from)
        .collect();
        if let Some(b) = budget {
            base.extend(["--device-memory".to_string(), b.to_string()]);
        }
        let mut searched = base.clone();
        // A dry run failing on some ranks gives up at once; the timeout still bounds a rank
        // that stalls without failing: a short one keeps the exhaustive search short.
        searched.extend(["--comm-timeout".to_string(), "30".into()]);
        if let Some(methods) = &args.excluded {
            searched.extend(["--excluded".to_string(), methods.clone()]);
        }
        let exhaustive = search(&args, &searched, "exhaustive")?;
        let guided = search(&args, &searched, "guided")?;
        let label = |r: &Value, what: &str| -> Result<String> {
            Ok(r["chosen"].as_str().with_context(|| format!("the {what} search chose nothing"))?.to_string())
        };
        let (choice, best) = (label(&guided, "guided")?, label(&exhaustive, "exhaustive")?);
        let paired_ratio = if choice == best {
            1.0
        } else {
            let sides = [strategy_of(&exhaustive, &choice)?, strategy_of(&exhaustive, &best)?];
            let mut speeds = [vec![], vec![]];
            for _ in 0..args.rounds {
                for (side, strategy) in sides.iter().enumerate() {
                    let mut argv = base.clone();
                    argv.extend(["--steps".to_string(), args.steps.to_string(), "--strategy".into(), strategy.clone()]);
                    speeds[side].push(bench_runs::train(&argv, 2)?.tokens_per_s);
                }
            }
            let [a, b] = speeds;
            median(a) / median(b).max(1e-9)
        };
        let count = |r: &Value| r["dry_runs"].as_u64().unwrap_or(0) as usize;
        let seconds = |r: &Value| r["seconds"].as_f64().unwrap_or(0.0);
        let choice_fits = guided["trials"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["label"] == choice.as_str()))
            .is_some_and(|t| t["outcome"]["outcome"] == "fits");
        let (peak_error_median, peak_error_max, speed_ratio_median) = prediction_errors(&exhaustive);
        let not_pruned = exhaustive["trials"]
            .as_array()
            .map_or(0, |t| t.iter().filter(|t| t["outcome"]["outcome"] != "pruned").count());
        rows.push(Row {
            ranks,
            budget_bytes: budget,
            candidates: not_pruned,
            guided_dry_runs: count(&guided),
            exhaustive_dry_runs: count(&exhaustive),
            guided_seconds: seconds(&guided),
            exhaustive_seconds: seconds(&exhaustive),
            guided_choice: choice,
            choice_fits,
            exhaustive_best: best,
            peak_error_median,
            peak_error_max,
            speed_ratio_median,
            paired_ratio,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("guided search against exhaustive (GPT {}x{}, ctx {})", s.layers, s.dim, s.ctx);
    for r in &rows {
        let budget = r.budget_bytes.map_or("no budget".to_string(), |b| format!("{:.0} MB", b as f64 / 1e6));
        println!(
            "{} rank(s), {budget}: guided {} dry runs in {:.0} s, exhaustive {} in {:.0} s ({} candidates)",
            r.ranks, r.guided_dry_runs, r.guided_seconds, r.exhaustive_dry_runs, r.exhaustive_seconds, r.candidates
        );
        let fits = if r.choice_fits { "fits" } else { "does not fit" };
        println!("  guided chose   {} ({fits})", r.guided_choice);
        println!("  exhaustive best {}", r.exhaustive_best);
        println!(
            "  dry runs guided/exhaustive = {:.3}; side by side: guided/exhaustive tokens/s = {:.3}",
            r.guided_dry_runs as f64 / r.exhaustive_dry_runs.max(1) as f64,
            r.paired_ratio
        );
        println!(
            "  predictions over the exhaustive dry runs: peak error median {:.1}%, largest {:.1}%; measured/predicted tokens/s median {:.2}",
            100.0 * r.peak_error_median,
            100.0 * r.peak_error_max,
            r.speed_ratio_median
        );
    }
    Ok(())
}
