//! The compute methods through `strata train --strategy`: mixed and half precision follow
//! the fp32 run, every method gives the same parameters on 2 ranks under zero2 and fsdp as
//! in one process, and bad configurations are one-line errors that list what is allowed.

use crate::common::{assert_fails_with, global_gap, losses, stderr, strata, strata_env, train_run, Run};
use std::path::Path;

const MODEL: [&str; 12] =
    ["--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--ctx", "32", "--seed", "3"];
const RUN: [&str; 8] = ["--batch-size", "8", "--schedule", "constant", "--threads", "1", "--log-every", "1000"];

/// Trains `steps` AdamW steps with `strategy` and `extra` flags.
fn train(dir: &Path, name: &str, steps: usize, strategy: &str, extra: &[&str]) -> Run {
    train_run(dir, name, steps, &[&MODEL, &RUN, &["--strategy", strategy], extra])
}

#[test]
fn mixed_and_half_precision_follow_the_fp32_loss_curve() {
    let dir = tempfile::tempdir().unwrap();
    let fp32 = losses(&train(dir.path(), "fp32", 20, "[]", &[]).1);
    // bf16 keeps 8 significant bits, fp16 11: one rounding of the logits moves the loss by
    // about 2^-9 of its size; over 20 steps the curves may drift apart a few times that.
    // Bound: 2% of the loss at every step for amp (fp32 masters), 5% for half (no masters).
    for (strategy, bound) in [
        (r#"[["amp_native", {"dtype": "bf16"}]]"#, 0.02),
        (r#"["amp_native"]"#, 0.02),
        (r#"[["half", "bf16"]]"#, 0.05),
        (r#"["half"]"#, 0.05),
    ] {
        let curve = losses(&train(dir.path(), "low", 20, strategy, &[]).1);
        let worst = fp32.iter().zip(&curve).map(|((_, a), (_, b))| (a - b).abs() / a).fold(0.0, f64::max);
        eprintln!("{strategy}: largest relative loss difference {worst:.2e}");
        assert!(worst < bound, "{strategy}: {worst:e}");
        // A method that changed nothing would leave the curves equal (the runs are
        // deterministic); fp16's rounding, averaged over the batch, moves the loss by ~1e-5.
        assert!(worst > 1e-6, "{strategy} computes in fp32: {worst:e}");
        assert!(curve[19].1 < curve[0].1 - 0.5, "{strategy} trains: {:?}", curve);
    }
}

#[test]
fn every_method_combines_with_zero2_and_fsdp_on_2_ranks() {
    let dir = tempfile::tempdir().unwrap();
    // Exact methods compute the same values in any layout (1e-5, as for the ZeRO stages
    // alone); low-precision ones round differently when the batch is split (2e-2, five
    // bf16 ulps, as for a bf16 param_dtype; 5e-2 for fp8, whose E4M3 keeps 3 bits).
    for (method, bound) in [
        (r#"["checkpoint", ["GptBlock"]]"#, 1e-5),
        (r#""module_replace""#, 1e-5),
        (r#"["amp_native", {"dtype": "bf16"}]"#, 2e-2),
        (r#""amp_native""#, 2e-2),
        (r#"["half", "bf16"]"#, 2e-2),
        (r#"["fp8", {"exclude": ["lm_head"]}]"#, 5e-2),
    ] {
        let one = train(dir.path(), "one", 6, &format!("[{method}]"), &[]).0;
        for sharding in [r#""zero2""#, r#""fsdp""#] {
            let strategy = format!("[{method}, {sharding}]");
            let two = train(dir.path(), "two", 6, &strategy, &["--nproc", "2"]).0;
            let gap = global_gap(&one, &two);
            eprintln!("{strategy}: {gap:.2e}");
            assert!(gap < bound, "{strategy}: parameters differ by {gap:e}");
        }
    }
}

#[test]
fn bad_method_configurations_are_one_line_errors_listing_what_is_allowed() {
    for (strategy, expected) in [
        (r#"[["amp_native", {"dtype": "fp12"}]]"#, "allowed: bf16, fp16, fp32"),
        (r#"[["fp8", {"fp8_format": "E5M3"}]]"#, "expected `HYBRID` or `E4M3`"),
        (r#"[["checkpoint", ["Transformer"]]]"#, "its unit kinds are GptEmbedding, GptBlock, GptHead"),
        (r#"["half", "amp_native"]"#, "half and amp_native cannot be combined"),
        (r#"[["half", "int8"]]"#, "allowed: bf16, fp16, fp32"),
        (
            r#"[["module_replace", ["FusedMoE"]]]"#,
            "registered: FlashAttention, StrataAttention, FusedLayerNorm, FusedRMSNorm, VectorGelu, FusedSwiGLU, \
             FusedRoPE, FusedCrossEntropy, FusedAddLayerNorm, FusedAddRMSNorm, FusedLinearGrad",
        ),
        (r#"[["amp_native", {"loss_scaler": {"hysteresis": 0}}]]"#, "hysteresis must be positive"),
    ] {
        let o = strata_env(
            &[&["train"][..], &MODEL, &RUN, &["--steps", "1", "--strategy", strategy]].concat(),
            &[("STRATA_LOG", "error")],
        );
        assert!(!o.status.success(), "{strategy}");
        let err = stderr(&o);
        assert_eq!(err.trim().lines().count(), 1, "{strategy}: {err}");
        assert!(err.contains(expected), "{strategy}: expected {expected:?} in {err}");
    }
}

#[test]
fn fp8_and_loss_scaled_runs_resume_exactly() {
    // The fp8 histories and scales and the loss scaler's state travel in the checkpoint:
    // a resumed run computes the same losses as an uninterrupted one.
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let strategy = r#"[["fp8", {"amax_history_len": 4}], ["amp_native", {"dtype": "bf16", "loss_scaler": {"initial_scale_power": 4, "loss_scale_window": 2}}]]"#;
    let run = |extra: &[&str]| {
        let args = [&["train"][..], &MODEL, &RUN, &["--steps", "6", "--strategy", strategy], extra].concat();
        let o = strata(&args);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    run(&["--metrics", &p("full.jsonl")]);
    run(&["--steps", "3", "--save-checkpoint", &p("ckpt")]);
    run(&["--resume", &p("ckpt"), "--metrics", &p("resumed.jsonl")]);
    let (full, resumed) = (losses(&dir.path().join("full.jsonl")), losses(&dir.path().join("resumed.jsonl")));
    assert_eq!(&full[3..], &resumed[..], "steps 4 to 6");
    // A saved scale of zero or an fp8 scale that is not finite is refused when the
    // checkpoint is opened, in one line.
    let meta = newest_meta(&dir.path().join("ckpt"));
    let saved = std::fs::read_to_string(&meta).unwrap();
    let mut value: serde_json::Value = serde_json::from_str(&saved).unwrap();
    value["loss_scaler"]["scale"] = 0.0.into();
    std::fs::write(&meta, value.to_string()).unwrap();
    let ckpt = p("ckpt");
    let resume = [&["train"][..], &MODEL, &RUN, &["--steps", "6", "--strategy", strategy, "--resume", &ckpt]].concat();
    assert_fails_with(&strata(&resume), "loss scaler: a scale of 0");
    let mut value: serde_json::Value = serde_json::from_str(&saved).unwrap();
    let layer = value["fp8"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|s| s["layers"].as_array().is_some_and(|l| !l.is_empty()))
        .unwrap();
    layer["layers"][0]["weight"]["scale"] = serde_json::Value::from(-1.0);
    std::fs::write(&meta, value.to_string()).unwrap();
    assert_fails_with(&strata(&resume), "has a scale of -1");
}

/// The `meta.json` of the newest checkpoint under `root`.
fn newest_meta(root: &Path) -> std::path::PathBuf {
    let mut metas: Vec<_> = walk(root).into_iter().filter(|p| p.ends_with("meta.json")).collect();
    metas.sort();
    metas.pop().expect("a checkpoint")
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .flat_map(|e| {
            let path = e.unwrap().path();
            if path.is_dir() {
                walk(&path)
            } else {
                vec![path]
            }
        })
        .collect()
}

/// The chunked loss gives the plain head's run: GPT (its head tied to the embedding) and
/// LLaMA, chunks of 7 positions over rows of 32, validation included, alone to within
/// rounding, over two tensor ranks (each scoring its columns), and with checkpointed
/// blocks under fsdp on two ranks and in two pipeline stages as the one-process chunked run
/// does. Its head's output is a scalar: the ledger's
/// activation peak falls by the logits it never holds.
#[test]
fn the_chunked_loss_trains_as_the_whole_logits() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..400).map(|i| format!("line {i} of the chunked loss's text, {} ", i * 7 % 13)).collect();
    let (data, val) = (dir.path().join("train.txt"), dir.path().join("val.txt"));
    std::fs::write(&data, &text).unwrap();
    std::fs::write(&val, &text[..3000]).unwrap();
    let (data, val) = (data.to_str().unwrap(), val.to_str().unwrap());
    let files = ["--data", data, "--val-data", val, "--eval-every", "3", "--eval-batches", "2"];
    let chunked = r#"["chunked_loss", {"positions": 7}]"#;
    for model in ["gpt", "llama"] {
        let shape = ["--model", model, "--layers", "2", "--heads", "2", "--dim", "32", "--ctx", "32", "--seed", "3"];
        let run = |name: &str, strategy: &str, extra: &[&str]| {
            let args: [&[&str]; 5] = [&shape, &RUN, &files, &["--strategy", strategy], extra];
            train_run(dir.path(), &format!("{model}-{name}"), 6, &args)
        };
        let plain = run("plain", "[]", &[]);
        let alone = run("chunked", &format!("[{chunked}]"), &[]);
        crate::common::assert_follows(&plain, &alone, &format!("{model} chunked"), 1e-6, 1e-6);
        // Each tensor rank scores its half of the vocabulary.
        let tensor = format!(r#"[{chunked}, ["parallel_mode", [[["tensor", 2]], null]], "tensor_parallel"]"#);
        let split = run("tensor", &tensor, &["--nproc", "2"]);
        crate::common::assert_follows(&alone, &split, &format!("{model} chunked tensor"), 1e-5, 1e-5);
        let val_losses = |run: &Run| -> Vec<f64> {
            crate::common::reports(&run.1).iter().filter_map(|r| r["val_loss"].as_f64()).collect()
        };
        let (a, b) = (val_losses(&plain), val_losses(&alone));
        assert!(a.len() == 2 && a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6), "{model}: {a:?} against {b:?}");
        let peak = |run: &Run| crate::common::reports(&run.1)[0]["memory"]["device"]["peak"].as_u64();
        let (whole, scored) = (peak(&plain).unwrap(), peak(&alone).unwrap());
        // The logits of a micro-batch (8 rows × 32 positions × 256 tokens of fp32) in place
        // of the loss's one value.
        assert_eq!(
            whole - scored,
            8 * 32 * 256 * 4 - 4,
            "{model}: {whole} bytes at the peak with logits, {scored} without"
        );
        let block = if model == "gpt" { "GptBlock" } else { "LlamaBlock" };
        let recomputed = format!(r#"[{chunked}, ["checkpoint", ["{block}"]]"#);
        let one = run("one", &format!("{recomputed}]"), &["--accumulation", "2"]);
        let fsdp = run("fsdp", &format!(r#"{recomputed}, "fsdp"]"#), &["--nproc", "2"]);
        crate::common::assert_follows(&one, &fsdp, &format!("{model} chunked fsdp"), 1e-5, 1e-5);
        let pipeline = format!(r#"{recomputed}, ["parallel_mode", [[["pipeline", 2]], null]], "pipeline_parallel"]"#);
        let staged = run("pipeline", &pipeline, &["--nproc", "2", "--accumulation", "2"]);
        crate::common::assert_follows(&one, &staged, &format!("{model} chunked pipeline"), 1e-5, 1e-5);
    }
}
