//! Reward models against TRL's `RewardTrainer` (scripts/trl_reference.py, the pinned TRL of
//! the project's environment) on a tiny LLaMA sequence classifier and the same batches: text
//! pairs, pairs with margins under the centring term, conversations through the chat
//! template, LoRA (the score head trained whole), fsdp, tensor parallelism and two pipeline
//! stages over two ranks — each of 10
//! steps' loss, gradient norm and TRL's metrics, and the weights the steps end with; and a
//! causal folder turned into a reward model, saved as a folder `transformers` reads back.
use super::preference::{python, s, said, steps_as_trl, sums, trl_runs, write_lines};
use crate::common::{self, reports, stderr, strata};
use crate::TENSOR;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

const STEPS: usize = 10;
const BATCH: usize = 4;

/// One run, on Strata and on TRL.
struct Case {
    name: &'static str,
    /// The records file.
    records: &'static str,
    center: Option<f64>,
    /// Train a LoRA adapter (made here, peft's fresh draw of a sequence classifier's, the
    /// score head saved whole) and the score head.
    adapter: bool,
    /// Strata's flags beyond the shared ones; the TRL run of `trl_name` is the reference.
    strata_flags: &'static [&'static str],
    trl_name: &'static str,
}

const fn case(name: &'static str, records: &'static str) -> Case {
    Case { name, records, center: None, adapter: false, strata_flags: &[], trl_name: name }
}

const fn laid_out(name: &'static str, strata_flags: &'static [&'static str]) -> Case {
    Case { strata_flags, trl_name: "text", ..case(name, "text.jsonl") }
}

const PIPELINE: &str = r#"[["parallel_mode", [[["pipeline", 2]], null]], "pipeline_parallel"]"#;

const CASES: &[Case] = &[
    case("text", "text.jsonl"),
    Case { center: Some(0.01), ..case("centred_margins", "margins.jsonl") },
    case("conversations", "conversations.jsonl"),
    Case { adapter: true, ..case("lora", "text.jsonl") },
    laid_out("fsdp", &["--nproc", "2", "--strategy", r#"["fsdp"]"#]),
    laid_out("tensor", &["--nproc", "2", "--strategy", TENSOR]),
    laid_out("pipeline", &["--nproc", "2", "--strategy", PIPELINE]),
];

/// The reward folder, a causal folder, the pair files and TRL's runs, made once.
fn reference(py: &Path) -> PathBuf {
    common::shared_dir("trl-reward", |dir| {
        let lora =
            r#"{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"], "task_type": "SEQ_CLS"}"#;
        // The folders and adapter, then TRL's runs, in one reference process once the files
        // below are written.
        let (reward, causal, adapter) = (dir.join("reward"), dir.join("causal"), dir.join("adapter"));
        let setup: [&[&str]; 3] = [
            &["make", "--out", s(&reward), "--seed", "5", "--reward"],
            &["make", "--out", s(&causal), "--seed", "6"],
            &["lora", "--model", s(&reward), "--out", s(&adapter), "--config", lora],
        ];
        let pairs = sums();
        write_lines(
            &dir.join("text.jsonl"),
            pairs.iter().map(|(p, c, r)| json!({"prompt": p, "chosen": c, "rejected": r})),
        );
        write_lines(
            &dir.join("margins.jsonl"),
            pairs
                .iter()
                .enumerate()
                .map(|(i, (p, c, r))| json!({"prompt": p, "chosen": c, "rejected": r, "margin": (i % 3) as f64 * 0.5})),
        );
        let conversation = |p: &str, answer: &str| json!([said("user", p), said("assistant", answer.trim())]);
        write_lines(
            &dir.join("conversations.jsonl"),
            pairs.iter().map(|(p, c, r)| json!({"chosen": conversation(p, c), "rejected": conversation(p, r)})),
        );
        let offsets: Vec<Vec<usize>> = (0..STEPS).map(|k| (0..BATCH).map(|i| (k * BATCH + i) % 24).collect()).collect();
        std::fs::write(dir.join("offsets.json"), json!({"ctx": 64, "batch": BATCH, "offsets": offsets}).to_string())
            .unwrap();
        let runs: Vec<Value> = CASES
            .iter()
            .filter(|c| c.trl_name == c.name)
            .map(|c| {
                json!({"name": c.name, "pairs": dir.join(c.records), "trainer": "reward",
                       "center_rewards_coefficient": c.center, "adapter": c.adapter.then(|| dir.join("adapter"))})
            })
            .collect();
        trl_runs(py, dir, &setup, &reward, runs, BATCH, STEPS);
    })
}

/// `strata train` on pairs with the flags every case shares: `steps` steps at learning rate
/// `lr`, the batches of offsets.json, the metrics in `out` and the model folder saved there
/// (where `flags` name no adapter folder to save).
fn train(dir: &Path, model: &Path, records: &str, out: &Path, steps: usize, lr: &str, flags: &[&str]) -> PathBuf {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    let (metrics, saved) = (out.join("metrics.jsonl"), out.join("saved"));
    let (pairs, offsets, steps) = (dir.join(records), dir.join("offsets.json"), steps.to_string());
    let mut args = vec!["train", "--model-dir", s(model), "--data", s(&pairs)];
    args.extend(steps_as_trl(&steps, lr, &offsets, &metrics));
    if !flags.contains(&"--save-adapter-dir") {
        args.extend(["--save-model-dir", s(&saved)]);
    }
    args.extend(flags);
    let o = strata(&args);
    assert!(o.status.success(), "{flags:?}:\n{}", stderr(&o));
    out.to_path_buf()
}

/// Strata's metrics of each step equal TRL's (`theirs`, a file of its lines): within 1e-5
/// relative (of 0.1 for smaller values); after the first step the gradient norm and the
/// batch's reward statistics within 1e-4 (the trajectory's rounding moves them, and a
/// mean of rewards of both signs cancels: its error is relative to the rewards', not to
/// its own size; the first step's, from the same weights, within 1e-5).
fn assert_metrics_follow(name: &str, ours: &Path, theirs: &Path, steps: usize) {
    let (ours, theirs) = (reports(ours), reports(theirs));
    assert_eq!(ours.len(), steps, "{name}: steps recorded");
    for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let Value::Object(fields) = b else { panic!("TRL's line is an object") };
        for (key, want) in fields {
            let want = want.as_f64().unwrap();
            let got = a[key].as_f64().unwrap_or_else(|| panic!("{name}: Strata's metrics lack {key}"));
            let bound = match key.as_str() {
                "grad_norm" | "mean_reward" | "min_reward" | "max_reward" if step > 0 => 1e-4 * want.abs().max(0.1),
                _ => 1e-5 * want.abs().max(0.1),
            };
            assert!((got - want).abs() <= bound, "{name}: step {} {key}: Strata {got}, TRL {want}", step + 1);
        }
    }
}

fn follows_trl(c: &Case) {
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let mut flags: Vec<String> = c.strata_flags.iter().map(|f| f.to_string()).collect();
    if let Some(center) = c.center {
        flags.extend(["--center-rewards-coefficient".into(), center.to_string()]);
    }
    let out = dir.join("strata").join(c.name);
    if c.adapter {
        let (adapter, saved) = (dir.join("adapter"), out.join("saved"));
        flags.extend(["--init-adapter".into(), s(&adapter).into(), "--save-adapter-dir".into(), s(&saved).into()]);
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let out = train(&dir, &dir.join("reward"), c.records, &out, STEPS, "1e-3", &flags);
    let trl = dir.join("trl").join(c.trl_name);
    assert_metrics_follow(c.name, &out.join("metrics.jsonl"), &trl.with_extension("jsonl"), STEPS);
    let (theirs, ours) = match c.adapter {
        true => (trl.join("adapter_model.safetensors"), out.join("saved/adapter_model.safetensors")),
        false => (trl.with_extension("safetensors"), out.join("saved/model.safetensors")),
    };
    let gap = common::global_gap(&theirs, &ours);
    eprintln!("{}: weights after {STEPS} steps differ from TRL's by {gap:.2e}", c.name);
    assert!(gap < 1e-5, "{}: weights differ from TRL's by {gap:e}", c.name);
}

fn follow(names: &[&str]) {
    for name in names {
        follows_trl(CASES.iter().find(|c| c.name == *name).expect("a case of that name"));
    }
}

#[test]
fn reward_models_follow_trl_on_text_margins_conversations_and_lora() {
    follow(&["text", "centred_margins", "conversations", "lora"]);
}

#[test]
fn reward_models_over_two_ranks_sharded_split_or_pipelined_follow_trl() {
    follow(&["fsdp", "tensor", "pipeline"]);
}

/// A causal folder trained with --reward-model starts from a fresh score head and is saved
/// as a sequence classifier: `transformers` reads the folder back and TRL, scoring the first
/// step's pairs with it, finds the loss and the rewards Strata measured (the step's learning
/// rate is 0, so the saved weights are those that step scored with).
#[test]
fn a_causal_folder_becomes_a_reward_model_that_transformers_reads_back() {
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let out = tempfile::tempdir().unwrap();
    let ours = train(&dir, &dir.join("causal"), "text.jsonl", out.path(), 1, "0", &["--reward-model", "true"]);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(ours.join("saved/config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"], json!(["LlamaForSequenceClassification"]), "{config}");
    let runs = out.path().join("runs.json");
    let run = json!([{"name": "fresh", "pairs": dir.join("text.jsonl"), "trainer": "reward",
                      "model": ours.join("saved")}]);
    std::fs::write(&runs, run.to_string()).unwrap();
    let trl = out.path().join("trl");
    std::fs::create_dir_all(&trl).unwrap();
    let args = ["runs", "--model", s(&ours), "--runs", s(&runs), "--out", s(&trl), "--max-length", "64"];
    python(&py, &[&[&args[..], &["--batch", "4", "--steps", "1", "--lr", "0"]].concat()]);
    assert_metrics_follow("fresh head", &ours.join("metrics.jsonl"), &trl.join("fresh.jsonl"), 1);
}

#[test]
fn reward_flags_that_cannot_apply_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "to be or not to be ".repeat(40)).unwrap();
    let o = strata(&["train", "--data", s(&text), "--steps", "1", "--reward-model", "true"]);
    common::assert_fails_with(&o, "--reward-model turns a decoder's model folder into a reward model");
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let (reward, causal, pairs) = (dir.join("reward"), dir.join("causal"), dir.join("text.jsonl"));
    let base = ["train", "--steps", "1", "--batch-size", "4", "--ctx", "64"];
    let o = strata(&[&base[..], &["--model-dir", s(&reward), "--data", s(&pairs), "--beta", "0.2"]].concat());
    common::assert_fails_with(&o, "--beta scores a language model's preferences");
    let o = strata(
        &[&base[..], &["--model-dir", s(&causal), "--data", s(&pairs), "--center-rewards-coefficient", "0.1"]].concat(),
    );
    common::assert_fails_with(&o, "--center-rewards-coefficient scores a reward model's pairs");
    let o = strata(&[&base[..], &["--model-dir", s(&reward), "--data", s(&text)]].concat());
    common::assert_fails_with(&o, "a reward model trains on preference pairs");
    let o = strata(&["generate", "--model-dir", s(&reward), "--prompt", "What is", "--max-new-tokens", "4"]);
    common::assert_fails_with(&o, "it scores texts, it does not write them");
}
