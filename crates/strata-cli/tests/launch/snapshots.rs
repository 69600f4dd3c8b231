//! Asynchronous checkpoints (`--checkpoint-async`): saving every step changes no weight and
//! leaves complete checkpoints; a rank killed while a snapshot is persisted resumes from host
//! memory under `strata launch --max-restarts` and torchrun; a crash between snapshot and
//! persist, or mid-write, leaves the last complete checkpoint to `--resume auto`; a job of
//! two nodes resumes from their memories, each sent the other's part. Every resumed run
//! ends with the weights of the uninterrupted one, bit for bit.

use crate::common::{losses, reports, shared_dir, stderr, strata, strata_env, weights};
use std::path::{Path, PathBuf};
use std::process::Command;
use strata::profile::Record;

const MODEL: [&str; 12] =
    ["--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--ctx", "32", "--seed", "5"];
const RUN: [&str; 12] = [
    "--batch-size",
    "8",
    "--schedule",
    "constant",
    "--threads",
    "1",
    "--lr",
    "0.003",
    "--log-every",
    "1000",
    "--steps",
    "6",
];
const ASYNC: [&str; 4] = ["--checkpoint-every", "1", "--checkpoint-async", "true"];
const FSDP: &str = r#"["fsdp"]"#;
const OFFLOAD: &str = r#"["fsdp", ["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]]"#;

/// The uninterrupted run of `strategy` at two ranks, without checkpoints: its weights and
/// metrics, shared by the tests.
fn uninterrupted(strategy: &str) -> PathBuf {
    let key = if strategy == FSDP { "snapshots-fsdp" } else { "snapshots-offload" };
    shared_dir(key, |dir| {
        let (w, m) = (dir.join("full.st"), dir.join("full.jsonl"));
        let flags = ["--nproc", "2", "--strategy", strategy, "--save-weights", w.to_str().unwrap()];
        let o = strata(&[&["train"][..], &MODEL, &RUN, &flags, &["--metrics", m.to_str().unwrap()]].concat());
        assert!(o.status.success(), "{}", stderr(&o));
    })
}

/// The two weight files hold the same tensors, bit for bit.
fn assert_identical(a: &Path, b: &Path, what: &str) {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len(), "{what}");
    for (name, t) in &a {
        assert!(t.equal(&b[name]), "{what}: {name} differs");
    }
}

/// The step and source (`host memory` or `disk`) of the resume the output's log reports.
fn resumed_from(err: &str) -> (u64, String) {
    let line = err.lines().find(|l| l.contains("resumed")).unwrap_or_else(|| panic!("no resume in:\n{err}"));
    let field = |name: &str| -> String {
        let at = line.find(&format!("{name}=")).unwrap_or_else(|| panic!("no {name} in {line}")) + name.len() + 1;
        let rest = &line[at..];
        match rest.strip_prefix('"') {
            Some(quoted) => quoted.split('"').next().unwrap().to_string(),
            None => rest.split_whitespace().next().unwrap().to_string(),
        }
    };
    (field("step").parse().unwrap(), field("source"))
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn saving_every_step_asynchronously_changes_no_weight_and_leaves_complete_checkpoints() {
    for strategy in [FSDP, OFFLOAD] {
        let full = uninterrupted(strategy);
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
        let shm = p("shm");
        std::fs::create_dir(&shm).unwrap();
        let flags = ["--nproc", "2", "--strategy", strategy, "--save-checkpoint", &p("ckpt")];
        let outputs = ["--save-weights", &p("async.st"), "--metrics", &p("async.jsonl"), "--profile", &p("profile")];
        let o = strata_env(
            &[&["train"][..], &MODEL, &RUN, &flags, &ASYNC, &outputs].concat(),
            &[("STRATA_SNAPSHOT_DIR", &shm)],
        );
        assert!(o.status.success(), "{strategy}: {}", stderr(&o));
        assert_identical(&full.join("full.st"), Path::new(&p("async.st")), strategy);
        // The two newest saves are on disk, the last named by latest; the snapshots in host
        // memory are gone with the job.
        assert_eq!(entries(Path::new(&p("ckpt"))), ["latest", "step-00000005", "step-00000006"], "{strategy}");
        assert!(entries(Path::new(&shm)).is_empty(), "{strategy}: left in memory: {:?}", entries(Path::new(&shm)));
        // Every save after a step is reported with the next: its blocking time, and from the
        // second on the writer's time for the one before.
        let rows = reports(Path::new(&p("async.jsonl")));
        for row in &rows[1..] {
            let c = &row["checkpoint"];
            assert!(c["blocked_s"].as_f64().unwrap() > 0.0, "{strategy}: {row}");
            assert!(c["updates_waited_s"].as_f64().unwrap() >= 0.0, "{strategy}: {row}");
            // Only a GPU's copies lock the snapshot's pages.
            assert_eq!(
                (c["locked_bytes"].as_u64(), c["locking_s"].as_f64()),
                (Some(0), Some(0.0)),
                "{strategy}: {row}"
            );
        }
        for row in &rows[2..] {
            // The writer's thread ran for part of its wall time.
            let (wall, cpu) =
                (row["checkpoint"]["persisted_s"].as_f64(), row["checkpoint"]["persisted_cpu_s"].as_f64());
            assert!(matches!((wall, cpu), (Some(w), Some(c)) if w > 0.0 && c > 0.0 && c <= w), "{strategy}: {row}");
        }
        // The profile (written before the last step's save) holds the same saves: each pause
        // on the training thread, and the writer's stretch from the end of that pause (known
        // at the next save).
        let profiles = strata::profile::read_dir(Path::new(&p("profile"))).unwrap();
        let (mut saves, mut persists) = (vec![], vec![]);
        for r in &profiles[0].records {
            match *r {
                Record::Save { t, start, step, .. } => saves.push((step, start, t)),
                Record::Persist { t, start, step } => persists.push((step, start, t)),
                _ => {}
            }
        }
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
        assert_eq!(saves.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5], "{strategy}");
        for &(step, start, t) in &saves {
            let reported = rows[step as usize]["checkpoint"]["blocked_s"].as_f64().unwrap();
            assert!(close(t - start, reported), "{strategy}: step {step} {} against {reported}", t - start);
        }
        assert_eq!(persists.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2, 3, 4], "{strategy}");
        for (&(step, start, t), save) in persists.iter().zip(&saves) {
            let reported = rows[step as usize + 1]["checkpoint"]["persisted_s"].as_f64().unwrap();
            assert!(close(start, save.2) && close(t - start, reported), "{strategy}: step {step}");
        }
        let summary = &strata::profile::summary::summarize(&profiles)[0];
        let blocked: f64 = saves.iter().map(|(_, start, t)| t - start).sum();
        assert!(summary.checkpoints == 5 && close(summary.checkpoint_blocked_s, blocked), "{strategy}: {summary:?}");
        let trace = strata::profile::trace::chrome_trace(&profiles[..1]);
        let drawn = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["cat"] == "checkpoint").count();
        assert_eq!(drawn, saves.len() + persists.len(), "{strategy}");
        // Step 5's checkpoint as persisted continues to step 6's weights exactly.
        let resume = ["--resume", &p("ckpt/step-00000005"), "--save-weights", &p("resumed.st")];
        let o = strata(&[&["train"][..], &MODEL, &RUN, &["--nproc", "2", "--strategy", strategy], &resume].concat());
        assert!(o.status.success(), "{strategy}: {}", stderr(&o));
        assert_identical(&full.join("full.st"), Path::new(&p("resumed.st")), strategy);
    }
}

/// Runs `command` to its end and checks that the job was killed once, then resumed from
/// host memory at step 3 and ended with the uninterrupted run's weights and losses.
fn assert_resumed_from_memory(mut command: Command, dir: &Path, what: &str) {
    let o = command.output().expect("the launcher runs");
    let err = stderr(&o);
    assert!(o.status.success(), "{what}: {err}");
    assert!(dir.join("fired").exists(), "{what}: the first round was killed");
    // Disk held step 2 when rank 1 died before persisting step 3; memory held step 3.
    assert_eq!(resumed_from(&err), (3, "host memory".to_string()), "{what}");
    let full = uninterrupted(FSDP);
    assert_identical(&full.join("full.st"), &dir.join("restarted.st"), what);
    let (a, b) = (losses(&full.join("full.jsonl")), losses(&dir.join("restarted.jsonl")));
    assert_eq!(a, b, "{what}: the losses of every step");
}

/// A fault that kills rank 1 as its writer begins to persist step 3, once.
fn persist_fault(dir: &Path) -> [(&'static str, String); 3] {
    [
        ("STRATA_FAULT", "persist-begun@3".into()),
        ("STRATA_FAULT_RANK", "1".into()),
        ("STRATA_FAULT_ONCE", dir.join("fired").to_str().unwrap().into()),
    ]
}

/// `strata train` flags of the restarted job: async saves every step, resumed by `auto`.
fn restarted_job(dir: &Path) -> Vec<String> {
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let flags = [
        "--strategy",
        FSDP,
        "--save-checkpoint",
        &p("ckpt"),
        "--resume",
        "auto",
        "--save-weights",
        &p("restarted.st"),
        "--metrics",
        &p("restarted.jsonl"),
    ];
    [&["train"][..], &MODEL, &RUN, &ASYNC, &flags].concat().into_iter().map(String::from).collect()
}

#[test]
fn a_rank_killed_while_persisting_is_restarted_by_strata_launch_and_resumes_from_host_memory() {
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let mut c = Command::new(crate::common::binary());
    c.args(["launch", "--nproc-per-node", "2", "--max-restarts", "1", "--"]).arg(crate::common::binary());
    c.args(restarted_job(dir.path())).env("STRATA_SNAPSHOT_DIR", &shm);
    c.envs(persist_fault(dir.path()).map(|(k, v)| (k, v)));
    assert_resumed_from_memory(c, dir.path(), "strata launch");
    assert!(entries(&shm).is_empty(), "the launcher removes its snapshots: {:?}", entries(&shm));
}

#[test]
fn a_rank_killed_while_persisting_is_restarted_by_torchrun_and_resumes_from_host_memory() {
    let Some(torchrun) = crate::common::torchrun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let mut c = Command::new(torchrun);
    c.args(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--no-python"]);
    c.arg(crate::common::binary()).args(restarted_job(dir.path())).env("STRATA_SNAPSHOT_DIR", &shm);
    c.envs(persist_fault(dir.path()).map(|(k, v)| (k, v)));
    assert_resumed_from_memory(c, dir.path(), "torchrun");
    // The run that ended cleanly removed its snapshots.
    assert!(entries(&shm).is_empty(), "left in memory: {:?}", entries(&shm));
}

/// Two nodes of one rank each under torchrun (c10d's rendezvous on loopback, each node its
/// own memory): rank 1 is killed while persisting step 3, both nodes' agents restart their
/// ranks, and each node, holding only its own rank's file of step 3's snapshot, receives the
/// other's before the job resumes from host memory.
#[test]
fn a_job_over_two_nodes_resumes_from_host_memory_each_node_receiving_the_other_s_part() {
    let Some(torchrun) = crate::common::torchrun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", crate::common::free_port());
    let nodes: Vec<_> = (0..2)
        .map(|node| {
            let shm = dir.path().join(format!("shm-node{node}"));
            std::fs::create_dir(&shm).unwrap();
            let mut c = Command::new(&torchrun);
            c.args(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "two-nodes"]);
            c.args(["--rdzv-endpoint", &endpoint, "--max-restarts", "1", "--no-python"]);
            c.arg(crate::common::binary()).args(restarted_job(dir.path())).env("STRATA_SNAPSHOT_DIR", &shm);
            c.envs(persist_fault(dir.path()).map(|(k, v)| (k, v)));
            c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
            (shm, c.spawn().expect("torchrun starts"))
        })
        .collect();
    let mut logs = String::new();
    for (shm, child) in nodes {
        let o = child.wait_with_output().unwrap();
        let err = stderr(&o);
        assert!(o.status.success(), "{}: {err}", shm.display());
        // Each node's rank resumed from its memory at step 3, the disk holding step 2.
        assert_eq!(resumed_from(&err), (3, "host memory".to_string()), "{}", shm.display());
        assert!(entries(&shm).is_empty(), "{}: left in memory: {:?}", shm.display(), entries(&shm));
        logs.push_str(&err);
    }
    assert!(dir.path().join("fired").exists(), "the first round was killed");
    assert_eq!(logs.matches("received from another node").count(), 2, "each node lacked one file:\n{logs}");
    let full = uninterrupted(FSDP);
    assert_identical(&full.join("full.st"), &dir.path().join("restarted.st"), "two nodes");
    assert_eq!(losses(&full.join("full.jsonl")), losses(&dir.path().join("restarted.jsonl")), "two nodes");
}

#[test]
fn a_crash_between_snapshot_and_persist_or_mid_write_resumes_from_the_last_complete_checkpoint() {
    let full = uninterrupted(FSDP);
    // Two ranks under a launcher that does not restart: its snapshots go with it, so the
    // resume reads the disk, whose latest complete checkpoint is step 2's. Rank 1's writer
    // failing (an error, the process living on) keeps rank 0's from publishing step 3.
    for (fault, rank, error) in
        [("snapshot-taken@3", "1", "0"), ("persist-written@3", "0", "0"), ("persist-begun@3", "1", "1")]
    {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
        let job = restarted_job(dir.path());
        let job: Vec<&str> = job.iter().map(String::as_str).chain(["--nproc", "2"]).collect();
        let o =
            strata_env(&job, &[("STRATA_FAULT", fault), ("STRATA_FAULT_RANK", rank), ("STRATA_FAULT_ERROR", error)]);
        assert!(!o.status.success(), "{fault}: the job fails");
        assert_eq!(std::fs::read_to_string(p("ckpt/latest")).unwrap(), "step-00000002", "{fault}");
        let o = strata(&job);
        assert!(o.status.success(), "{fault}: {}", stderr(&o));
        assert_eq!(resumed_from(&stderr(&o)), (2, "disk".to_string()), "{fault}");
        assert_identical(&full.join("full.st"), Path::new(&p("restarted.st")), fault);
    }
    // One process, its snapshot in the memory it leaves behind: killed once the writer has
    // copied in the values on the host (as it begins persisting), the rerun resumes from
    // the snapshot. Killed before that copy (the training thread done with the snapshot, the
    // writer not started), or while writing step 3's snapshot over step 2's file, it leaves
    // no complete snapshot, and the rerun resumes from the disk.
    let one = shared_dir("snapshots-one-process", |dir| {
        let w = dir.join("full.st");
        let o = strata(&[&["train"][..], &MODEL, &RUN, &["--save-weights", w.to_str().unwrap()]].concat());
        assert!(o.status.success(), "{}", stderr(&o));
    });
    for (fault, resumed) in
        [("persist-begun@3", (3, "host memory")), ("snapshot-taken@3", (2, "disk")), ("save-written@3", (2, "disk"))]
    {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
        let shm = p("shm");
        std::fs::create_dir(&shm).unwrap();
        let flags = ["--save-checkpoint", &p("ckpt"), "--resume", "auto", "--save-weights", &p("restarted.st")];
        let job = [&["train"][..], &MODEL, &RUN, &ASYNC, &flags].concat();
        let o = strata_env(&job, &[("STRATA_FAULT", fault), ("STRATA_SNAPSHOT_DIR", &shm)]);
        assert!(!o.status.success(), "{fault}: the process is killed");
        assert_eq!(std::fs::read_to_string(p("ckpt/latest")).unwrap(), "step-00000002", "{fault}");
        let o = strata_env(&job, &[("STRATA_SNAPSHOT_DIR", &shm)]);
        assert!(o.status.success(), "{fault}: {}", stderr(&o));
        assert_eq!(resumed_from(&stderr(&o)), (resumed.0, resumed.1.to_string()), "{fault}");
        assert_identical(&one.join("full.st"), Path::new(&p("restarted.st")), fault);
        assert!(entries(Path::new(&shm)).is_empty(), "{fault}: left in memory: {:?}", entries(Path::new(&shm)));
    }
}
