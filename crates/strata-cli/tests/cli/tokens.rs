//! Token files from the command line: `strata tokenize` writes what `--token-file` reads, a
//! u32 file trains a model of a 128k vocabulary, and a bad token file stops a run in one
//! line before its first step.
use crate::common;

use crate::common::{assert_fails_with, stderr, strata};
use std::path::Path;
use strata::data::{TokenData, TokenWidth};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const LLAMA_128K: [&str; 12] =
    ["--model", "llama", "--layers", "1", "--dim", "16", "--heads", "2", "--ctx", "8", "--vocab", "128256"];

/// Ids spread over Llama 3's vocabulary, most past u16's reach.
fn wide_ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + 65_000) % 128_256).collect()
}

#[test]
fn a_u32_token_file_trains_a_128k_vocabulary_model() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("wide.tok");
    TokenData::new(wide_ids(3000), "wide").write_token_file(&tokens, TokenWidth::U32).unwrap();
    let metrics = dir.path().join("m.jsonl");
    let run = ["train", "--token-file", s(&tokens), "--steps", "2", "--batch-size", "2", "--metrics", s(&metrics)];
    let o = strata(&[&run[..], &LLAMA_128K].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(common::losses(&metrics).len(), 2);
    // The same ids raw: read at the width asked for.
    let raw = dir.path().join("wide.bin");
    std::fs::write(&raw, wide_ids(3000).iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let run = ["train", "--token-file", s(&raw), "--token-width", "u32", "--steps", "1", "--batch-size", "2"];
    let o = strata(&[&run[..], &LLAMA_128K].concat());
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn bad_token_files_stop_the_run_in_one_line_before_any_step() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, bytes: Vec<u8>| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let narrow_ids: Vec<u8> = (0..3000u16).flat_map(|t| (t % 60_000).to_le_bytes()).collect();
    let mut odd = narrow_ids.clone();
    odd.push(7);
    let headed = dir.path().join("headed.tok");
    TokenData::new(wide_ids(3000), "wide").write_token_file(&headed, TokenWidth::U32).unwrap();
    let cases: Vec<(std::path::PathBuf, Vec<&str>, &str)> = vec![
        (file("odd.bin", odd), vec![], "6001 bytes is not a whole number of u16 tokens"),
        (file("narrow.bin", narrow_ids), vec![], "holds u16 ids, too narrow for the model's vocabulary of 128256"),
        (headed.clone(), vec!["--token-width", "u16"], "holds u32 ids (its header says so) but u16 ids were asked for"),
        (headed, vec!["--vocab", "100000"], "holds token id"),
    ];
    for (path, extra, expected) in cases {
        let metrics = dir.path().join("m.jsonl");
        let run = ["train", "--token-file", s(&path), "--steps", "1", "--batch-size", "2", "--metrics", s(&metrics)];
        let o = strata(&[&run[..], &LLAMA_128K, &extra].concat());
        assert_fails_with(&o, expected);
        assert_eq!(stderr(&o).trim().lines().count(), 1, "{expected}: {}", stderr(&o));
        assert!(!metrics.exists(), "{expected}: no step ran");
    }
}

/// `strata tokenize` writes a token file `strata train` reads (its width from the
/// tokenizer's vocabulary), the same ids as training on the text itself.
#[test]
fn tokenized_text_trains_as_the_text_does() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "to be or not to be, that is the question.\n".repeat(60)).unwrap();
    let tokens = dir.path().join("t.tok");
    let o = strata(&["tokenize", s(&text), "--output", s(&tokens), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["tokens"], 60 * 42);
    assert_eq!(report["width"], "u16");
    let data = TokenData::open(&tokens, None).unwrap();
    assert_eq!(data.to_vec(), std::fs::read(&text).unwrap().into_iter().map(u32::from).collect::<Vec<_>>());
    let model = ["--model", "gpt", "--layers", "1", "--dim", "16", "--ctx", "16", "--vocab", "256", "--steps", "3"];
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    let o = strata(&[&["train", "--token-file", s(&tokens), "--metrics", s(&a)][..], &model].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let o = strata(&[&["train", "--data", s(&text), "--metrics", s(&b)][..], &model].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(common::losses(&a), common::losses(&b));
    let o = strata(&["tokenize", s(&text), "--output", s(&tokens), "--width", "u8"]);
    assert_fails_with(&o, "u8");
}

/// `strata bench tokenize` on a small text: both sides wrote the same ids, and the report
/// has its rows and ratio.
#[test]
fn the_tokenize_benchmark_compares_equal_ids() {
    if common::venv_python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "Shall I compare thee to a summer's day?\nThou art more lovely.\n".repeat(300)).unwrap();
    let o = strata(&[
        "bench",
        "tokenize",
        "--input",
        s(&text),
        "--repeat",
        "2",
        "--rounds",
        "1",
        "--vocab",
        "300",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["same_ids"], true);
    assert_eq!(report["rows"].as_array().unwrap().len(), 2);
    assert!(report["ratio"].as_f64().unwrap() > 0.0);
    assert!(report["tokens"].as_u64().unwrap() > 1000);
}

/// `strata bench generate` with prompts of several lengths: Strata's batch, padded on the
/// left, decodes every row as `transformers`' `generate` does on the same left-padded
/// prompts with their attention mask.
#[test]
fn the_generation_benchmark_decodes_mixed_lengths_as_transformers() {
    if common::venv_python().is_none() {
        return;
    }
    let args = ["--batch", "6", "--prompt-tokens", "9", "--new-tokens", "12", "--rounds", "1", "--mixed-lengths"];
    let o = strata(&[&["bench", "generate"][..], &args, &["--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["same_rows"], 6, "{report}");
    assert_eq!(report["rows"].as_array().unwrap().len(), 3);
    assert!(report["ratio"].as_f64().unwrap() > 0.0);
}

/// `strata bench kernels` at a small size: every kernel against the libtorch operators it
/// replaces gives the same outputs and input gradients, and a time for each side.
#[test]
fn the_kernel_benchmark_compares_equal_results() {
    let args = ["--tokens", "512", "--threads", "1", "--calls", "1", "--rounds", "1", "--json"];
    let o = strata(&[&["bench", "kernels"][..], &args].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let kernels: Vec<&str> = rows.iter().map(|r| r["kernel"].as_str().unwrap()).collect();
    assert_eq!(kernels, ["VectorGelu", "FusedRMSNorm", "FusedSwiGLU", "FusedRoPE", "OneDnnLinear"]);
    for r in rows {
        // Two implementations of one function round differently somewhere in 512 tokens:
        // no difference at all would mean one side timed the other's code.
        let difference = r["max_difference"].as_f64().unwrap();
        assert!(difference > 0.0 && difference < 1e-4, "{r}");
        assert!(r["strata_ms"].as_f64().unwrap() > 0.0 && r["libtorch_ms"].as_f64().unwrap() > 0.0, "{r}");
    }
}
