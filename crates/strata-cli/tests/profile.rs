//! Profiles end to end: a 2-rank fsdp run with recomputation and accumulation recorded with
//! `--profile`, read back and checked against what is known of it; the Chrome trace and the
//! summary made from it; bad profile folders refused in one line.
mod common;

use common::{assert_fails_with, stderr, strata};
use std::path::Path;
use strata::engine::{Category, Placement};
use strata::profile::{self, Record, SpanKind};

const STEPS: usize = 3;
const MICRO: usize = 2;

fn record(dir: &Path) {
    let steps = STEPS.to_string();
    let micro = MICRO.to_string();
    let o = strata(&[
        "train",
        "--model",
        "gpt",
        "--layers",
        "2",
        "--dim",
        "32",
        "--ctx",
        "32",
        "--batch-size",
        "8",
        "--threads",
        "1",
        "--steps",
        &steps,
        "--accumulation",
        &micro,
        "--nproc",
        "2",
        "--strategy",
        r#"["fsdp", ["checkpoint", ["GptBlock"]]]"#,
        "--profile",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_recorded_fsdp_profile_holds_what_the_run_did() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let profiles = profile::read_dir(dir.path()).unwrap();
    assert_eq!(profiles.len(), 2);
    for p in &profiles {
        let units = p.header.units.len();
        let spans = p.spans();
        for u in 0..units {
            let forwards = spans.iter().filter(|s| s.kind == SpanKind::Forward(u)).count();
            let backwards = spans.iter().filter(|s| s.kind == SpanKind::Backward(u)).count();
            assert_eq!((forwards, backwards), (STEPS * MICRO, STEPS * MICRO), "rank {} unit {u}", p.header.rank);
        }
        assert_eq!(spans.iter().filter(|s| s.kind == SpanKind::Update).count(), STEPS);
        // FULL_SHARD: each forward begins with its unit gathered (the last gather or free of
        // it before the forward is a gather).
        for s in spans.iter().filter(|s| matches!(s.kind, SpanKind::Forward(_))) {
            let SpanKind::Forward(u) = s.kind else { continue };
            let last = p.records.iter().filter(|r| r.t() <= s.start).rev().find_map(|r| match r {
                Record::Gather { unit, .. } if *unit == u => Some(true),
                Record::Freed { unit, .. } if *unit == u => Some(false),
                _ => None,
            });
            assert_eq!(last, Some(true), "rank {}: forward of unit {u} at {}", p.header.rank, s.start);
        }
        // The ledger's parameters and gradients are what their buffers hold, at every phase.
        let mut phases = 0;
        for r in &p.records {
            if let Record::Phase { memory, storage_bytes, phase, unit, .. } = r {
                let ledger: u64 = memory
                    .values()
                    .flat_map(|by| by.iter())
                    .filter(|(c, _)| matches!(c, Category::Params | Category::Grads))
                    .map(|(_, b)| b)
                    .sum();
                assert_eq!(ledger, *storage_bytes, "rank {}: {phase:?} of unit {unit}", p.header.rank);
                assert!(memory.contains_key(&Placement::Device));
                phases += 1;
            }
        }
        assert_eq!(phases, 4 * units * STEPS * MICRO);
    }
}

#[test]
fn the_trace_and_the_summary_come_from_the_profile() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let trace = dir.path().join("trace.json");
    let o = strata(&["profile", "trace", dir.path().to_str().unwrap(), "-o", trace.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let value: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = value["traceEvents"].as_array().unwrap();
    let pids: std::collections::BTreeSet<u64> = events.iter().filter_map(|e| e["pid"].as_u64()).collect();
    assert_eq!(pids, [0, 1].into_iter().collect(), "a track group per rank");
    for e in events {
        let ph = e["ph"].as_str().unwrap();
        assert!(["M", "X", "i", "C"].contains(&ph), "{e}");
        if ph == "X" {
            assert!(e["ts"].as_f64().is_some() && e["dur"].as_f64().unwrap() >= 0.0, "{e}");
        }
    }
    let names = |cat: &str| events.iter().filter(|e| e["cat"] == cat).count();
    assert_eq!(names("forward"), 2 * 4 * STEPS * MICRO, "two ranks, four units");
    assert!(names("gather") > 0, "gathers on the communication track");
    let o = strata(&["profile", "summary", dir.path().to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary.as_array().unwrap().len(), 2);
    assert_eq!(summary[0]["updates"], STEPS as u64);
}

#[test]
fn bad_profile_folders_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let summary = |d: &Path| strata(&["profile", "summary", d.to_str().unwrap()]);
    assert_fails_with(&summary(dir.path()), "no profile");
    let header = r#"{"format":"strata-profile","version":1,"rank":0,"world":1,"units":["a"],"device":"Cpu"}"#;
    let file = dir.path().join("rank0.jsonl");
    std::fs::write(&file, format!("{header}\n")).unwrap();
    assert_fails_with(&summary(dir.path()), "recorded nothing");
    std::fs::write(&file, format!("{header}\n{{\"kind\":\"gather\",\"t\":0.1,\"un")).unwrap();
    assert_fails_with(&summary(dir.path()), "rank0.jsonl:2: bad record");
    std::fs::write(&file, header.replace("\"version\":1", "\"version\":9")).unwrap();
    assert_fails_with(&summary(dir.path()), "profile version 9");
    std::fs::write(dir.path().join("rank1.jsonl"), format!("{header}\n")).unwrap();
    std::fs::write(&file, format!("{header}\n{{\"kind\":\"gather\",\"t\":0.1,\"unit\":0}}\n")).unwrap();
    assert_fails_with(&summary(dir.path()), "every rank's file must be there once");
}
