//! Fine-tuning data end to end: example files (prompt and completion, conversations through
//! a chat template) learn only what they should, and the step's loss weighs every learned
//! token of the global batch alike, however the batch is split into micro-batches, ranks
//! and pipeline stages.
mod common;

use common::{assert_follows, reports, stderr, strata_env, Run};
use std::path::{Path, PathBuf};

const MODEL: [&str; 10] = ["--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--seed", "3"];
const RUN: [&str; 14] = [
    "--batch-size",
    "32",
    "--max-length",
    "48",
    "--schedule",
    "constant",
    "--threads",
    "1",
    "--lr",
    "0.003",
    "--log-every",
    "1000",
    "--grad-clip",
    "0",
];

/// 96 prompt-and-completion records of different lengths: sums written out, with prompts of
/// 10 to 40 bytes and completions of 2 to 12, so micro-batches hold very different numbers
/// of learned tokens.
fn example_file(dir: &Path) -> PathBuf {
    let path = dir.join("sums.jsonl");
    let mut state = 12345u64;
    let mut next = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let lines: Vec<String> = (0..96)
        .map(|_| {
            let terms: Vec<u64> = (0..2 + next(6)).map(|_| next(100)).collect();
            let prompt = terms.iter().map(u64::to_string).collect::<Vec<_>>().join("+") + "=";
            let completion = format!("{}{}", terms.iter().sum::<u64>(), ".".repeat(next(10) as usize));
            serde_json::json!({"prompt": prompt, "completion": completion}).to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

/// `strata train` on the example file for 6 steps with `extra` flags.
fn train(dir: &Path, name: &str, extra: &[&str]) -> Run {
    let data = example_file(dir);
    let (w, m) = (dir.join(format!("{name}.st")), dir.join(format!("{name}.jsonl")));
    let files = [
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "6",
        "--save-weights",
        w.to_str().unwrap(),
        "--metrics",
        m.to_str().unwrap(),
    ];
    let args = [&["train"][..], &MODEL, &RUN, &files, extra].concat();
    let cache = dir.join("cache");
    let o = strata_env(&args, &[("STRATA_CACHE", cache.to_str().unwrap())]);
    assert!(o.status.success(), "{name} {extra:?}:\n{}", stderr(&o));
    (w, m)
}

/// One process, the whole batch of 32 in one micro-batch: trained once per test binary.
fn one_batch() -> Run {
    let dir = common::shared_dir("one", |dir| {
        train(dir, "one", &[]);
    });
    (dir.join("one.st"), dir.join("one.jsonl"))
}

/// `extra` reaches the losses and weights of one batch of 32, and reports the same learned
/// tokens per step.
fn same_as_one_batch(extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let what = format!("{extra:?}");
    let run = train(dir.path(), "run", extra);
    let one = one_batch();
    assert_follows(&one, &run, &what, 1e-6, 1e-6);
    let learned = |m: &Path| reports(m).iter().map(|r| r["supervised_tokens"].as_u64().unwrap()).collect::<Vec<_>>();
    assert_eq!(learned(&one.1), learned(&run.1), "{what}: learned tokens per step");
}

#[test]
fn eight_by_accumulation_4_is_one_batch_of_32() {
    same_as_one_batch(&["--accumulation", "4"]);
}

#[test]
fn four_zero2_ranks_of_8_are_one_batch_of_32() {
    same_as_one_batch(&["--nproc", "4", "--strategy", r#"["zero2"]"#]);
}

#[test]
fn four_fsdp_ranks_of_8_are_one_batch_of_32() {
    same_as_one_batch(&["--nproc", "4", "--strategy", r#"["fsdp"]"#]);
}

#[test]
fn two_pipeline_stages_of_4_micro_batches_are_one_batch_of_32() {
    let pipeline = r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {"schedule": "1f1b"}]]"#;
    same_as_one_batch(&["--nproc", "2", "--accumulation", "4", "--strategy", pipeline]);
}

#[test]
fn learned_tokens_are_counted_and_examples_cached() {
    let one = one_batch();
    let first = &reports(&one.1)[0];
    let learned = first["supervised_tokens"].as_u64().unwrap();
    // Completions of 1 to 12 bytes are all that is learned, 32 per step: far fewer than
    // the batch's positions, yet some in every row.
    assert!((32..32 * 13).contains(&learned), "{learned}");
    assert!(first["tokens"].as_u64().unwrap() > learned);
}
