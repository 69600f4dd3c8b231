//! `strata train --strategy auto` and the strategy commands: the guided search against an
//! exhaustive one on several scenarios, included/excluded, the time limit, saved strategies.
mod common;

use common::{stderr, strata, strata_env};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// One test at a time: the search measures throughput, which a concurrent test would skew.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const MODEL: [&str; 12] =
    ["--model", "gpt", "--layers", "4", "--heads", "4", "--dim", "128", "--ctx", "64", "--seed", "1"];
const RUN: [&str; 10] =
    ["--batch-size", "8", "--threads", "1", "--steps", "1", "--schedule", "constant", "--log-every", "1000"];

/// Runs one step after an automatic search; returns the search report.
fn search(dir: &Path, name: &str, extra: &[&str]) -> Value {
    let report = dir.join(format!("{name}.json"));
    let args =
        [&["train"][..], &MODEL, &RUN, &["--strategy", "auto", "--search-report", report.to_str().unwrap()], extra]
            .concat();
    let o = strata_env(&args, &[("STRATA_LOG", "warn")]);
    assert!(o.status.success(), "{extra:?}:\n{}", stderr(&o));
    serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap()
}

fn outcomes(report: &Value) -> impl Iterator<Item = (&str, &Value)> {
    report["trials"].as_array().unwrap().iter().map(|t| (t["label"].as_str().unwrap(), &t["outcome"]))
}

/// Measured candidates: label → (tokens/s, fits).
fn measured(report: &Value) -> BTreeMap<String, (f64, bool)> {
    outcomes(report)
        .filter(|(_, o)| o["outcome"] == "measured")
        .map(|(l, o)| (l.to_string(), (o["tokens_per_s"].as_f64().unwrap(), o["fits"].as_bool().unwrap())))
        .collect()
}

#[test]
fn the_guided_search_comes_within_5_percent_of_the_best_with_a_third_of_the_dry_runs() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    // Model size × memory budget × world size. The budgets leave fp32 without recomputation
    // out (it peaks near 33 MB on one rank).
    for (scenario, nproc, budget) in [
        ("one rank, no budget", "1", None),
        ("one rank, 24 MB", "1", Some("24000000")),
        ("two ranks, 20 MB", "2", Some("20000000")),
    ] {
        let mut flags = vec!["--nproc", nproc];
        if let Some(b) = budget {
            flags.extend(["--device-memory", b]);
        }
        let flags = &flags[..];
        let steps = ["--dry-run-steps", "5"];
        let all = search(dir.path(), "exhaustive", &[flags, &steps, &["--search", "exhaustive"]].concat());
        let guided = search(dir.path(), "guided", &[flags, &steps[..]].concat());
        let candidates = outcomes(&all).filter(|(_, o)| o["outcome"] != "pruned").count();
        let every = measured(&all);
        assert_eq!(every.len() + outcomes(&all).filter(|(_, o)| o["outcome"] == "failed").count(), candidates);
        let best = every.values().filter(|(_, fits)| *fits).map(|(s, _)| *s).fold(0.0, f64::max);
        let chosen = guided["chosen"].as_str().expect("the guided search chose a strategy").to_string();
        let (speed, fits) = every[&chosen];
        // Both searches measure on a shared machine: the chosen candidate's own dry run in
        // the guided search counts too.
        let own = measured(&guided)[&chosen].0;
        let dry_runs = guided["dry_runs"].as_u64().unwrap() as usize;
        eprintln!(
            "{scenario}: chose {chosen} at {:.0} tokens/s (exhaustive best {best:.0}), {dry_runs} dry runs of {candidates} candidates",
            speed.max(own)
        );
        assert!(fits, "{scenario}: {chosen} does not fit");
        if speed.max(own) < 0.95 * best {
            // The best of many noisy dry runs is inflated by its luck: measure the two side
            // by side, alternating, before judging.
            let best_label =
                every.iter().filter(|(_, (s, f))| *f && *s == best).map(|(l, _)| l.clone()).next().unwrap();
            let ratio = paired_ratio(dir.path(), nproc, &strategy_of(&all, &chosen), &strategy_of(&all, &best_label));
            eprintln!("{scenario}: side by side, {chosen} runs at {ratio:.3} of {best_label}");
            assert!(ratio >= 0.95, "{scenario}: {chosen} at {ratio:.3} of {best_label}");
        }
        assert!(3 * dry_runs <= candidates, "{scenario}: {dry_runs} dry runs of {candidates} candidates");
    }
}

fn strategy_of(report: &Value, label: &str) -> String {
    let trial = report["trials"].as_array().unwrap().iter().find(|t| t["label"] == label).unwrap();
    trial["strategy"].to_string()
}

/// Median tokens/s of `a` over `b`, each trained five times in alternation.
fn paired_ratio(dir: &Path, nproc: &str, a: &str, b: &str) -> f64 {
    let mut speeds = [vec![], vec![]];
    for round in 0..5 {
        for (i, strategy) in [a, b].iter().enumerate() {
            let metrics = dir.join(format!("paired{round}{i}.jsonl"));
            let run =
                ["--nproc", nproc, "--steps", "12", "--strategy", strategy, "--metrics", metrics.to_str().unwrap()];
            let args = [&["train"][..], &MODEL, &RUN, &run].concat();
            let o = strata(&args);
            assert!(o.status.success(), "{}", stderr(&o));
            let text = std::fs::read_to_string(&metrics).unwrap();
            let mut v: Vec<f64> = text
                .lines()
                .skip(2)
                .map(|l| serde_json::from_str::<Value>(l).unwrap()["tokens_per_s"].as_f64().unwrap())
                .collect();
            v.sort_by(f64::total_cmp);
            speeds[i].push(v[v.len() / 2]);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    median(&mut speeds[0]) / median(&mut speeds[1])
}

#[test]
fn included_and_excluded_methods_shape_every_candidate() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let report = search(dir.path(), "r", &["--included", "checkpoint", "--excluded", "module_replace"]);
    for (label, _) in outcomes(&report) {
        assert!(label.contains("checkpoint") && !label.contains("module_replace"), "{label}");
    }
    assert!(report["chosen"].as_str().unwrap().contains("checkpoint"));
    let args = [&["train"][..], &MODEL, &RUN, &["--strategy", "auto", "--included", "fp8"]].concat();
    let o = strata_env(&args, &[("STRATA_LOG", "error")]);
    assert!(!o.status.success() && stderr(&o).contains("every candidate was pruned"), "{}", stderr(&o));
    let o = strata_env(&[&args[..], &["--included", "zero7"]].concat(), &[("STRATA_LOG", "error")]);
    assert!(stderr(&o).contains("unknown method \"zero7\""), "{}", stderr(&o));
}

#[test]
fn the_time_limit_ends_the_search_with_the_best_so_far() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let free = search(dir.path(), "free", &[]);
    let limited = search(dir.path(), "limited", &["--time-limit", "0.05"]);
    assert_eq!(limited["stopped_by_time_limit"], true);
    let dry_runs = limited["dry_runs"].as_u64().unwrap();
    assert!(dry_runs >= 1 && dry_runs < free["dry_runs"].as_u64().unwrap());
    let longest = outcomes(&limited).filter_map(|(_, o)| o["seconds"].as_f64()).fold(0.0, f64::max);
    let spent = limited["seconds"].as_f64().unwrap();
    // The analysis, then dry runs until the limit: at most one runs past it.
    assert!(spent <= 0.05 + 2.0 * longest + 1.0, "{spent} s with dry runs of up to {longest} s");
    assert!(limited["chosen"].is_string());
}

#[test]
fn strategies_round_trip_through_files_and_bad_ones_are_refused() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("s.json");
    search(dir.path(), "r", &["--save-strategy", saved.to_str().unwrap()]);
    let shown = strata(&["strategy", "show", saved.to_str().unwrap()]);
    assert!(shown.status.success());
    let a: Value = serde_json::from_slice(&shown.stdout).unwrap();
    let b: Value = serde_json::from_slice(&std::fs::read(&saved).unwrap()).unwrap();
    assert_eq!(a, b, "show prints what was saved");
    let o = strata(&[&["train"][..], &MODEL, &RUN, &["--strategy", saved.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let seed = r#"[["parallel_mode", [[["tensor", 4], ["pipeline", 2], ["data", 2]], null]]]"#;
    let ok = strata(&["strategy", "validate", seed, "--world-size", "16"]);
    assert!(String::from_utf8_lossy(&ok.stdout).contains("tensor: 4 groups of 4"));
    std::fs::write(&saved, "zero2").unwrap();
    for (args, expected) in [
        (vec!["strategy", "validate", saved.to_str().unwrap()], "must be JSON"),
        (vec!["strategy", "validate", r#"[["zero2", {"reshard": 1}]]"#], "unknown field `reshard`"),
        (vec!["strategy", "validate", seed, "--world-size", "12"], "do not divide the world size 12"),
        (vec!["strategy", "show", r#"["pipeline"]"#], "unknown method \"pipeline\""),
    ] {
        let o = strata(&args);
        assert!(!o.status.success(), "{args:?}");
        assert!(stderr(&o).contains(expected), "{args:?}: {}", stderr(&o));
    }
}
