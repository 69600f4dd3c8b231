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

/// The largest size in `1..=most` for which `fits` holds (0: none), where it holds for
/// every size up to some bound and for none beyond. `from` is a guess: the search steps
/// away from it by strides that double (up while sizes fit, down while they do not) until
/// the bound lies between a size that fit and one that did not, then bisects. A guess `k`
/// off costs about twice log2(k) runs, and from 1 the search doubles. `fits` runs once per
/// size tried, in the order tried.
pub fn largest_fitting(from: i64, most: i64, mut fits: impl FnMut(i64) -> Result<bool>) -> Result<i64> {
    if most < 1 {
        return Ok(0);
    }
    let start = from.clamp(1, most);
    // `good`: the largest size known to fit (0: none); `bad`: the smallest known not to
    // (`most + 1`: none).
    let (mut good, mut bad) = if fits(start)? { (start, most + 1) } else { (0, start) };
    let mut stride = 1;
    if good > 0 {
        while good < most && bad > most {
            let next = (good + stride).min(most);
            if fits(next)? {
                good = next;
                stride *= 2;
            } else {
                bad = next;
            }
        }
    } else {
        while bad > 1 && good == 0 {
            let next = (bad - stride).max(1);
            if fits(next)? {
                good = next;
            } else {
                bad = next;
                stride *= 2;
            }
        }
    }
    while bad - good > 1 {
        let mid = (good + bad) / 2;
        if fits(mid)? {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Ok(good)
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against a bound known in advance: the search finds it (or `most`, or 0), never
        /// tries a size twice, and tries few.
        #[test]
        fn the_search_finds_the_largest_size_that_fits(bound in 0i64..3000, most in 0i64..2000, from in 0i64..2500) {
            let mut tried = vec![];
            let found = largest_fitting(from, most, |n| {
                tried.push(n);
                Ok(n <= bound)
            })
            .unwrap();
            prop_assert_eq!(found, bound.min(most));
            let mut unique = tried.clone();
            unique.sort();
            unique.dedup();
            prop_assert_eq!(unique.len(), tried.len(), "sizes tried twice: {:?}", tried);
            prop_assert!(tried.iter().all(|&n| (1..=most).contains(&n)), "outside 1..={}: {:?}", most, tried);
            prop_assert!(tried.len() <= 2 * 12 + 2, "{} tries: {:?}", tried.len(), tried);
        }

        /// A guess near the bound costs few runs wherever the bound lies.
        #[test]
        fn a_close_guess_is_cheap(bound in 1i64..2000, off in -3i64..=3) {
            let mut tries = 0;
            let found = largest_fitting(bound + off, 4000, |n| {
                tries += 1;
                Ok(n <= bound)
            })
            .unwrap();
            prop_assert_eq!(found, bound);
            prop_assert!(tries <= 6, "{} tries from {} off", tries, off);
        }
    }

    #[test]
    fn a_failing_probe_stops_the_search() {
        let err = largest_fitting(1, 100, |n| if n < 8 { Ok(true) } else { anyhow::bail!("probe {n} broke") });
        assert_eq!(err.unwrap_err().to_string(), "probe 8 broke");
    }
}
