//! Runs of `strata train` as child processes, for benchmarks that compare configurations:
//! each run gets a process of its own, so peaks of memory are its own.
//!
//! Owns starting the children and reading their metrics. Must not choose configurations or
//! judge results: the benchmarks that call it do.
use anyhow::{bail, Context, Result};
use clap::Args;
use std::process::Command;

/// The shape of the GPT the benchmarks train.
#[derive(Args, Debug, Clone)]
pub struct GptShape {
    #[arg(long, default_value_t = 4)]
    pub layers: i64,
    #[arg(long, default_value_t = 4)]
    pub heads: i64,
    #[arg(long, default_value_t = 256)]
    pub dim: i64,
    #[arg(long, default_value_t = 128)]
    pub ctx: i64,
}

/// What one run measured.
pub struct RunFigures {
    /// The last step's metrics (rank 0).
    pub last: serde_json::Value,
    /// Median tokens/s over the steps after `warmup`.
    pub tokens_per_s: f64,
    /// The metrics of the steps after `warmup`.
    pub timed: Vec<serde_json::Value>,
}

/// Runs `strata train ARGS --metrics TMP` and reads its metrics.
pub fn train(args: &[String], warmup: usize) -> Result<RunFigures> {
    let dir = tempfile::tempdir()?;
    let metrics = dir.path().join("m.jsonl");
    let out = Command::new(std::env::current_exe()?)
        .arg("train")
        .args(args)
        .args(["--log-every", "1000000", "--metrics"])
        .arg(&metrics)
        .output()
        .context("cannot run strata train")?;
    if !out.status.success() {
        bail!("strata train {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = std::fs::read_to_string(&metrics)?;
    let rows: Vec<serde_json::Value> = text.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    let last = rows.last().cloned().context("the run wrote no metrics")?;
    let mut speeds: Vec<f64> = rows.iter().skip(warmup).filter_map(|r| r["tokens_per_s"].as_f64()).collect();
    speeds.sort_by(f64::total_cmp);
    let tokens_per_s = speeds.get(speeds.len() / 2).copied().unwrap_or(0.0);
    Ok(RunFigures { last, tokens_per_s, timed: rows.into_iter().skip(warmup).collect() })
}

/// The median of some samples (the upper one of an even count; 0 for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The mean of some samples (0 for none).
pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}
