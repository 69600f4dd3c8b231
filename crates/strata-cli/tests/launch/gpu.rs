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
