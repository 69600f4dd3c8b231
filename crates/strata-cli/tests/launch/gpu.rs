//! `strata train` on a GPU: two ranks sharing one GPU (collectives staged through pinned
//! host memory, as NCCL refuses two ranks on one device) reach the parameters one process
//! reaches, for data parallelism and the ZeRO family; and the GPU's run reports the
//! allocator's peak. Skipped, with a message, where no GPU is visible.

use crate::common::{assert_fails_with, global_gap, reports, stderr, strata};
use std::path::{Path, PathBuf};

const MODEL: [&str; 12] =
    ["--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--ctx", "32", "--seed", "3"];
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
    "--device",
    "cuda",
];

fn gpu_visible(test: &str) -> bool {
    let visible = tch::Cuda::is_available();
    if !visible {
        eprintln!("{test}: skipped, no GPU visible");
    }
    visible
}

/// Trains 6 AdamW steps (fp32) on the GPU with `extra` flags; returns the saved weights.
fn train(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let path = dir.join(name);
    let metrics = dir.join(format!("{name}.jsonl"));
    let args = [
        &["train"][..],
        &MODEL,
        &RUN,
        &["--steps", "6", "--save-weights", path.to_str().unwrap(), "--metrics", metrics.to_str().unwrap()],
        extra,
    ]
    .concat();
    let o = strata(&args);
    assert!(o.status.success(), "{extra:?}:\n{}", stderr(&o));
    let last = reports(&metrics).pop().unwrap();
    assert!(last["allocator_peak_bytes"].as_u64().unwrap() > 0, "the GPU's allocator peak is reported");
    path
}

#[test]
fn two_ranks_sharing_a_gpu_match_one_process() {
    if !gpu_visible("two_ranks_sharing_a_gpu_match_one_process") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let one = train(dir.path(), "one.st", &[]);
    for (name, strategy) in
        [("ddp", "[]"), ("zero1", r#"["zero1"]"#), ("zero2", r#"["zero2"]"#), ("fsdp", r#"["fsdp"]"#)]
    {
        let two = train(dir.path(), &format!("{name}.st"), &["--strategy", strategy, "--nproc", "2"]);
        let gap = global_gap(&one, &two);
        eprintln!("{name} on 2 ranks sharing the GPU: parameters differ by {gap:.2e}");
        assert!(gap < 1e-5, "{name}: {gap:e}");
    }
    // Half the batch on one rank really differs: the two ranks learned together.
    let half = train(dir.path(), "half.st", &["--batch-size", "4"]);
    assert!(global_gap(&one, &half) > 1e-3);
}

/// Asynchronous saves on a GPU copy the values into a snapshot whose pages are locked at
/// the first save and stay locked (each later save reports no locking), and the run ends
/// with the weights of the run without saves.
#[test]
fn asynchronous_saves_on_a_gpu_lock_their_snapshot_once() {
    if !gpu_visible("asynchronous_saves_on_a_gpu_lock_their_snapshot_once") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let plain = train(dir.path(), "plain.st", &[]);
    let checkpoints = dir.path().join("ckpt");
    let saves = ["--checkpoint-every", "1", "--checkpoint-async", "true", "--save-checkpoint"];
    let saved = train(dir.path(), "saved.st", &[&saves[..], &[checkpoints.to_str().unwrap()]].concat());
    assert_eq!(global_gap(&plain, &saved), 0.0, "saving changed the weights");
    let rows: Vec<serde_json::Value> = reports(&dir.path().join("saved.st.jsonl"))
        .iter()
        .map(|r| r["checkpoint"].clone())
        .filter(|c| !c.is_null())
        .collect();
    assert_eq!(rows.len(), 5, "a save after each step but the last is reported with the next: {rows:?}");
    let (locked, locking) = (rows[0]["locked_bytes"].as_u64().unwrap(), rows[0]["locking_s"].as_f64().unwrap());
    eprintln!("snapshot of {locked} bytes locked in {locking:.4} s");
    assert!(locked > 0 && locking > 0.0, "{rows:?}");
    for row in &rows[1..] {
        assert_eq!((row["locked_bytes"].as_u64(), row["locking_s"].as_f64()), (Some(locked), Some(0.0)), "{row}");
    }
}

/// The one build serves machines without a GPU: there it starts, and a GPU run stops in one
/// line saying none is present (not that the build lacks something). With a GPU it trains.
#[test]
fn a_gpu_run_without_a_gpu_says_none_is_present() {
    if tch::Cuda::is_available() {
        eprintln!("a_gpu_run_without_a_gpu_says_none_is_present: skipped, a GPU is visible");
        return;
    }
    assert!(strata_ext::cuda::is_built(), "the set-up's libtorch carries CUDA, so the build does too");
    let o = strata(&[&["train"][..], &MODEL, &RUN, &["--steps", "1"]].concat());
    assert_fails_with(&o, "--device cuda: no GPU is present on this machine");
}
