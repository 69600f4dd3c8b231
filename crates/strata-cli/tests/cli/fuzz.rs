//! `strata train` with random options: it trains or refuses in one line, never panics, and
//! a refusal writes no file.
use proptest::prelude::*;
use std::path::Path;

/// Flags and values a user could type, odd ones included. Sizes stay small: a valid large
/// model is not what this test is about.
fn option() -> impl Strategy<Value = Vec<String>> {
    let number =
        prop::sample::select(vec!["0", "1", "2", "-1", "3.5", "1e20", "nan", "inf", "x", "", "99999999999999999999"]);
    let text = prop::sample::select(vec![
        "auto",
        "gpt",
        "llama",
        "mlp",
        "rnn",
        "[]",
        r#"["zero2"]"#,
        r#"[["fsdp", {"forward_prefetch": true}]]"#,
        "[[",
        "cosine",
        "step",
        "sgd",
        "adamw",
        "cpu",
        "cuda:x",
        "0.9,0.99",
        "guided",
        "exhaustive",
        "checkpoint,fp8",
        "true",
        "false",
        "out/w.safetensors",
        "missing.bin",
    ]);
    let numeric = prop::sample::select(vec![
        "--steps",
        "--layers",
        "--heads",
        "--dim",
        "--ctx",
        "--lr",
        "--eps",
        "--weight-decay",
        "--momentum",
        "--grad-clip",
        "--warmup",
        "--batch-size",
        "--accumulation",
        "--seed",
        "--threads",
        "--nproc",
        "--bucket-bytes",
        "--time-limit",
        "--dry-run-steps",
        "--device-memory",
        "--checkpoint-every",
        "--keep-checkpoints",
        "--log-every",
        "--vocab",
    ]);
    let textual = prop::sample::select(vec![
        "--model",
        "--strategy",
        "--schedule",
        "--optimizer",
        "--device",
        "--betas",
        "--search",
        "--included",
        "--excluded",
        "--finetune-strategy",
        "--nesterov",
        "--data",
        "--token-file",
        "--init-weights",
        "--resume",
        "--config",
        "--freeze",
    ]);
    prop_oneof![
        (numeric, number).prop_map(|(f, v)| vec![f.to_string(), v.to_string()]),
        (textual, text).prop_map(|(f, v)| vec![f.to_string(), v.to_string()]),
    ]
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        walk(dir).into_iter().map(|p| p.strip_prefix(dir).unwrap().display().to_string()).collect();
    names.sort();
    names
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn random_train_options_train_or_are_refused_in_one_line(options in prop::collection::vec(option(), 1..5)) {
        let dir = tempfile::tempdir().unwrap();
        let base = ["train", "--model", "mlp", "--layers", "1", "--dim", "8", "--ctx", "8", "--batch-size", "2", "--steps", "1"];
        let args: Vec<String> = base.iter().map(|s| s.to_string()).chain(options.concat()).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = crate::common::strata_in(dir.path(), &args, &[("STRATA_LOG", "error")]);
        let err = String::from_utf8_lossy(&out.stderr);
        prop_assert!(!err.contains("panicked"), "{args:?}: {err}");
        if !out.status.success() {
            prop_assert_eq!(err.trim().lines().count(), 1, "{:?}: {}", args, err);
            prop_assert!(files_in(dir.path()).is_empty(), "{:?} was refused but wrote {:?}", args, files_in(dir.path()));
        }
    }
}
