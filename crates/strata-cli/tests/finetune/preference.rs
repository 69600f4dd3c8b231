//! Preference optimisation against TRL's `DPOTrainer` and `KTOTrainer`
//! (scripts/trl_reference.py, the pinned TRL of the project's environment) on a tiny LLaMA
//! folder and the same batches: for every DPO loss type, several summed, f-divergences, KTO
//! (on one process and sharded over two ranks, and on pairs it unpairs) and unpaired APO on labelled completions, the reference-free CPO, SimPO and ORPO (TRL's
//! `CPOTrainer` and `ORPOTrainer`), conversations through the chat template
//! with their prompt left implicit, LoRA (the reference being the base with its fresh
//! adapter, or the starting values of an adapter that starts off the base: trained factors,
//! a head trained whole), fsdp, tensor parallelism and two pipeline stages over two ranks and offloaded
//! model states, a live reference (a copy, LoRA's base, in two stages) and TR-DPO's synced
//! reference alone, sharded and split, each of 10 steps'
//! loss, gradient norm and TRL's metrics, and the weights the steps end with; reference
//! scores kept in a file or given by the records.
use crate::common::{self, reports, stderr, strata};
use crate::TENSOR;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

const STEPS: usize = 10;
const BATCH: usize = 4;

/// One run, on Strata and on TRL.
struct Case {
    name: &'static str,
    /// TRL's `loss_type` names, comma-separated.
    loss: &'static str,
    weights: Option<&'static str>,
    beta: f64,
    smoothing: f64,
    f_divergence: &'static str,
    /// Conversations with their prompts left implicit, in place of text records.
    conversational: bool,
    /// Unpaired completions with their labels (KTO's records), in place of pairs.
    unpaired: bool,
    /// KTO on the pair records, which both unpair (each run of records' chosen completions,
    /// then their rejected ones).
    from_pairs: bool,
    /// KTO's weight of the undesirable completions' losses.
    undesirable_weight: f64,
    /// Train a LoRA adapter (made here, peft's fresh draw) alone.
    adapter: bool,
    /// Which adapter folder trains: `adapter` (peft's fresh draw) or one that starts off the
    /// base as a trained adapter does, `adapter_trained` (every `B` moved off zero) or
    /// `adapter_head` (the head trained whole, `modules_to_save`, its copy moved off the
    /// base's): the reference keeps its starting values, as TRL's copy of it does.
    folder: &'static str,
    /// TR-DPO: steps between the reference's syncs towards the policy (mixup 0.5); 0: none.
    sync: u64,
    /// Strata's flags beyond the shared ones; the TRL run of `trl_name` is the reference.
    strata_flags: &'static [&'static str],
    trl_name: &'static str,
}

const fn case(name: &'static str, loss: &'static str) -> Case {
    Case {
        name,
        loss,
        weights: None,
        beta: 0.1,
        smoothing: 0.0,
        f_divergence: "reverse_kl",
        conversational: false,
        unpaired: false,
        from_pairs: false,
        undesirable_weight: 1.0,
        adapter: false,
        folder: "adapter",
        sync: 0,
        strata_flags: &[],
        trl_name: name,
    }
}

/// The sigmoid run laid out by Strata's `strata_flags`, compared with TRL's one process.
const fn laid_out(name: &'static str, strata_flags: &'static [&'static str]) -> Case {
    Case { strata_flags, trl_name: "sigmoid", ..case(name, "sigmoid") }
}

const PIPELINE: &str = r#"[["parallel_mode", [[["pipeline", 2]], null]], "pipeline_parallel"]"#;
const OFFLOAD: &str = r#"[["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]]"#;

const CASES: &[Case] = &[
    case("sigmoid", "sigmoid"),
    case("hinge", "hinge"),
    Case { beta: 0.5, ..case("ipo", "ipo") },
    Case { smoothing: 1e-3, ..case("exo_pair", "exo_pair") },
    case("nca_pair", "nca_pair"),
    Case { smoothing: 0.1, ..case("robust", "robust") },
    case("bco_pair", "bco_pair"),
    case("sppo_hard", "sppo_hard"),
    Case { smoothing: 0.1, ..case("aot", "aot") },
    case("aot_unpaired", "aot_unpaired"),
    case("apo_zero", "apo_zero"),
    case("apo_down", "apo_down"),
    case("discopop", "discopop"),
    case("sft", "sft"),
    case("sigmoid_norm", "sigmoid_norm"),
    Case { weights: Some("0.8,0.2,1.0"), ..case("mpo", "sigmoid,bco_pair,sft") },
    Case { f_divergence: "js_divergence", ..case("js", "sigmoid") },
    Case { f_divergence: "forward_kl", ..case("forward_kl", "hinge") },
    Case { conversational: true, ..case("conversations", "sigmoid") },
    Case { adapter: true, ..case("lora", "sigmoid") },
    Case { unpaired: true, ..case("kto", "kto") },
    Case { unpaired: true, undesirable_weight: 1.5, beta: 0.3, ..case("kto_weighted", "kto") },
    Case { unpaired: true, ..case("apo_zero_unpaired", "apo_zero_unpaired") },
    Case { unpaired: true, adapter: true, ..case("kto_lora", "kto") },
    Case { unpaired: true, from_pairs: true, ..case("kto_from_pairs", "kto") },
    // Each rank scores two of the four records: the KL estimate spans both ranks' mismatched
    // completions, as TRL's one process's does.
    Case {
        unpaired: true,
        strata_flags: &["--nproc", "2", "--strategy", r#"["fsdp"]"#],
        trl_name: "kto",
        ..case("kto_fsdp", "kto")
    },
    Case { smoothing: 0.1, ..case("cpo", "cpo") },
    Case { beta: 2.0, ..case("simpo", "simpo") },
    case("orpo", "orpo"),
    laid_out("fsdp", &["--nproc", "2", "--strategy", r#"["fsdp"]"#]),
    laid_out("pipeline", &["--nproc", "2", "--strategy", PIPELINE]),
    laid_out("tensor", &["--nproc", "2", "--strategy", TENSOR]),
    laid_out("offload", &["--strategy", OFFLOAD]),
    // A live reference, as TRL's: a frozen copy, the starting weights two pipeline stages
    // keep, LoRA's base with the adapters off, and that base in two pipeline stages.
    laid_out("live", &["--live-reference", "true"]),
    laid_out("live_pipeline", &["--live-reference", "true", "--nproc", "2", "--strategy", PIPELINE]),
    Case { adapter: true, trl_name: "lora", ..laid_out("lora_live", &["--live-reference", "true"]) },
    Case {
        adapter: true,
        trl_name: "lora",
        ..laid_out("lora_live_pipeline", &["--live-reference", "true", "--nproc", "2", "--strategy", PIPELINE])
    },
    // Adapters that start off the base: scored first, and live as they move.
    Case { adapter: true, folder: "adapter_trained", ..case("lora_trained", "sigmoid") },
    Case { adapter: true, folder: "adapter_head", ..case("lora_head", "sigmoid") },
    Case {
        adapter: true,
        folder: "adapter_trained",
        trl_name: "lora_trained",
        ..laid_out("lora_trained_live", &["--live-reference", "true"])
    },
    Case {
        adapter: true,
        folder: "adapter_head",
        trl_name: "lora_head",
        ..laid_out("lora_head_live", &["--live-reference", "true"])
    },
    // Its kept values gathered whole from fsdp's shards and tensor ranks' pieces, and scattered back.
    Case {
        adapter: true,
        folder: "adapter_head",
        trl_name: "lora_head",
        ..laid_out("lora_head_live_fsdp", &["--live-reference", "true", "--nproc", "2", "--strategy", r#"["fsdp"]"#])
    },
    Case {
        adapter: true,
        folder: "adapter_head",
        trl_name: "lora_head",
        ..laid_out("lora_head_live_tensor", &["--live-reference", "true", "--nproc", "2", "--strategy", TENSOR])
    },
    // TR-DPO: the reference syncs after steps 3, 6 and 9, on one process and split as the policy is.
    Case { sync: 3, ..case("tr_dpo", "sigmoid") },
    Case { sync: 3, trl_name: "tr_dpo", ..laid_out("tr_dpo_fsdp", &["--nproc", "2", "--strategy", r#"["fsdp"]"#]) },
    Case { sync: 3, trl_name: "tr_dpo", ..laid_out("tr_dpo_tensor", &["--nproc", "2", "--strategy", TENSOR]) },
    Case { sync: 3, trl_name: "tr_dpo", ..laid_out("tr_dpo_pipeline", &["--nproc", "2", "--strategy", PIPELINE]) },
];

const WORDS: [&str; 10] = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"];

/// 24 sums asked, each answered right (sometimes at more length) and wrong.
pub(super) fn sums() -> Vec<(String, String, String)> {
    let mut state = 7u64;
    let mut next = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) % n) as usize
    };
    (0..24)
        .map(|i| {
            let (a, b) = (next(10), next(10));
            let wrong = a + b + 1 + next(4);
            let more = if i % 3 == 0 { " That is all." } else { "" };
            (
                format!("What is {} plus {}?", WORDS[a], WORDS[b]),
                format!(" It is {}.{more}", a + b),
                format!(" It is {wrong}."),
            )
        })
        .collect()
}

pub(super) fn said(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

pub(super) fn write_lines(path: &Path, records: impl Iterator<Item = Value>) {
    let lines: Vec<String> = records.map(|r| r.to_string()).collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

pub(super) fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn script() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/trl_reference.py").display().to_string()
}

/// Runs `commands` of the TRL reference in turn, in one process.
pub(super) fn python(py: &Path, commands: &[&[&str]]) {
    let args = commands.join(&"+");
    let o = Command::new(py).arg(script()).args(&args).output().unwrap();
    assert!(o.status.success(), "trl_reference.py {args:?}:\n{}", stderr(&o));
}

/// TRL's trainer of case `c`.
fn trainer(c: &Case) -> &'static str {
    match c.loss {
        "cpo" | "simpo" => "cpo",
        "orpo" => "orpo",
        _ if c.unpaired => "kto",
        _ => "dpo",
    }
}

/// The records file of case `c`.
fn records(c: &Case) -> &'static str {
    match (c.unpaired && !c.from_pairs, c.conversational) {
        (true, _) => "unpaired.jsonl",
        (false, true) => "conversations.jsonl",
        (false, false) => "text.jsonl",
    }
}

/// The model folder, pair files, adapter and TRL's runs of every case, made once.
fn reference(py: &Path) -> PathBuf {
    common::shared_dir("trl", |dir| {
        let lora = r#"{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}"#;
        let head =
            r#"{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}"#;
        let (model, fresh) = (dir.join("model"), dir.join("adapter"));
        let (trained, with_head) = (dir.join("adapter_trained"), dir.join("adapter_head"));
        // The folders, adapters and TRL's runs in one reference process, once the files
        // below are written.
        let setup: [&[&str]; 4] = [
            &["make", "--out", s(&model), "--seed", "3"],
            &["lora", "--model", s(&model), "--out", s(&fresh), "--config", lora],
            &["lora", "--model", s(&model), "--out", s(&trained), "--config", lora, "--move-b"],
            &["lora", "--model", s(&model), "--out", s(&with_head), "--config", head, "--move-saved"],
        ];
        let pairs = sums();
        write_lines(
            &dir.join("text.jsonl"),
            pairs.iter().map(|(p, c, r)| json!({"prompt": p, "chosen": c, "rejected": r})),
        );
        let conversation = |p: &str, answer: &str| json!([said("user", p), said("assistant", answer.trim())]);
        write_lines(
            &dir.join("conversations.jsonl"),
            pairs.iter().map(|(p, c, r)| json!({"chosen": conversation(p, c), "rejected": conversation(p, r)})),
        );
        // Right answers are desirable, wrong ones not: three in four records, mixed in every batch.
        write_lines(
            &dir.join("unpaired.jsonl"),
            pairs.iter().enumerate().map(|(i, (p, c, r))| match i % 4 {
                1 => json!({"prompt": p, "completion": r, "label": false}),
                _ => json!({"prompt": p, "completion": c, "label": true}),
            }),
        );
        // TRL's rows in order, around the 24 records (48 where pairs are unpaired).
        for (file, count) in [("offsets.json", 24), ("offsets_unpaired.json", 48)] {
            let offsets: Vec<Vec<usize>> =
                (0..STEPS).map(|k| (0..BATCH).map(|i| (k * BATCH + i) % count).collect()).collect();
            let offsets = json!({"ctx": 64, "batch": BATCH, "offsets": offsets});
            std::fs::write(dir.join(file), offsets.to_string()).unwrap();
        }
        let runs: Vec<Value> = CASES
            .iter()
            .filter(|c| c.trl_name == c.name)
            .map(|c| {
                let losses: Vec<&str> = c.loss.split(',').collect();
                json!({
                    "name": c.name,
                    "pairs": dir.join(records(c)),
                    "trainer": trainer(c),
                    "loss_type": match trainer(c) {
                        "dpo" => json!(losses),
                        "cpo" if c.loss == "cpo" => json!("sigmoid"),
                        _ => json!(c.loss),
                    },
                    "cpo_alpha": if c.loss == "simpo" { 0.0 } else { 1.0 },
                    "undesirable_weight": c.undesirable_weight,
                    "loss_weights": c.weights.map(|w| w.split(',').map(|x| x.parse::<f64>().unwrap()).collect::<Vec<_>>()),
                    "beta": c.beta,
                    "label_smoothing": c.smoothing,
                    "f_divergence": c.f_divergence,
                    "adapter": c.adapter.then(|| dir.join(c.folder)),
                    "sync_steps": (c.sync > 0).then_some(c.sync),
                    "mixup": 0.5,
                })
            })
            .collect();
        trl_runs(py, dir, &setup, &model, runs, BATCH, STEPS);
    })
}

/// Runs the reference's `setup` commands, then TRL's `runs` on `model` (`batch` records a
/// step, `steps` steps, rows of at most 64 tokens) into `dir/trl`, in one process.
pub(super) fn trl_runs(
    py: &Path,
    dir: &Path,
    setup: &[&[&str]],
    model: &Path,
    runs: Vec<Value>,
    batch: usize,
    steps: usize,
) {
    let (runs_file, out) = (dir.join("runs.json"), dir.join("trl"));
    std::fs::write(&runs_file, Value::from(runs).to_string()).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    let (batch, steps) = (batch.to_string(), steps.to_string());
    let run: &[&str] = &[
        "runs",
        "--model",
        s(model),
        "--runs",
        s(&runs_file),
        "--out",
        s(&out),
        "--max-length",
        "64",
        "--batch",
        &batch,
        "--steps",
        &steps,
    ];
    python(py, &[setup, &[run]].concat());
}

/// The flags of a `strata train` run that steps as the TRL reference does: `steps` steps at
/// learning rate `lr` on the batches of `offsets` (4 records each, rows of at most 64
/// tokens), AdamW with neither decay nor clipping, one thread, the metrics to `metrics`.
pub(super) fn steps_as_trl<'a>(steps: &'a str, lr: &'a str, offsets: &'a Path, metrics: &'a Path) -> [&'a str; 20] {
    [
        "--ctx",
        "64",
        "--batch-size",
        "4",
        "--steps",
        steps,
        "--lr",
        lr,
        "--weight-decay",
        "0",
        "--grad-clip",
        "1e9",
        "--schedule",
        "constant",
        "--threads",
        "1",
        "--batch-offsets",
        s(offsets),
        "--metrics",
        s(metrics),
    ]
}

/// The case on Strata: its metrics file and its saved weights (the adapter's, for LoRA).
fn strata_run(dir: &Path, c: &Case) -> (PathBuf, PathBuf) {
    let out = dir.join("strata").join(c.name);
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let (metrics, saved) = (out.join("metrics.jsonl"), out.join("saved"));
    let pairs = dir.join(records(c));
    let undesirable = c.undesirable_weight.to_string();
    let (beta, smoothing) = (c.beta.to_string(), c.smoothing.to_string());
    let offsets = if c.from_pairs { "offsets_unpaired.json" } else { "offsets.json" };
    let (model, offsets) = (dir.join("model"), dir.join(offsets));
    let mut args = vec!["train", "--model-dir", s(&model), "--data", s(&pairs)];
    args.extend(steps_as_trl("10", "1e-3", &offsets, &metrics));
    args.extend([
        "--preference-loss",
        c.loss,
        "--beta",
        &beta,
        "--label-smoothing",
        &smoothing,
        "--f-divergence",
        c.f_divergence,
    ]);
    if let Some(w) = c.weights {
        args.extend(["--preference-loss-weights", w]);
    }
    if c.unpaired {
        args.extend(["--undesirable-weight", &undesirable]);
    }
    let sync = c.sync.to_string();
    if c.sync > 0 {
        args.extend(["--sync-reference-every", &sync, "--reference-mixup", "0.5"]);
    }
    let adapter = dir.join(c.folder);
    match c.adapter {
        true => args.extend(["--init-adapter", s(&adapter), "--save-adapter-dir", s(&saved)]),
        false => args.extend(["--save-model-dir", s(&saved)]),
    }
    args.extend(c.strata_flags);
    let o = strata(&args);
    assert!(o.status.success(), "{}:\n{}", c.name, stderr(&o));
    let weights = match c.adapter {
        true => saved.join("adapter_model.safetensors"),
        false => saved.join("model.safetensors"),
    };
    (metrics, weights)
}

/// How far Strata's `key` at `step` (from 1) may be from TRL's `want`, in TRL's report `b`.
/// Everything within 1e-5 relative (of 0.1 for smaller values) except: the rewards, β times
/// a difference of two sums of fp32 log-probabilities of tens each, whose rounding alone is
/// about 1e-7 of them (so within 1e-6 of β·|logps|, beside 1e-5 relative), the loss, a
/// function of that difference (hinge's `1 − βΔ` keeps its rounding whole near 0), and KTO's KL
/// estimate, a mean of such differences (within 1e-6 of |logps|); and the gradient
/// norm after the first step, which the trajectory's rounding moves (within 1e-4; the first
/// step's, from the same weights, within 1e-5, and the final weights within 1e-5 below).
fn tolerance(key: &str, step: usize, want: f64, b: &Value, beta: f64) -> f64 {
    let relative = 1e-5 * want.abs().max(0.1);
    match key {
        k if k.starts_with("rewards/") && k != "rewards/accuracies" || k == "kl" || k == "loss" => {
            let logps =
                b["logps/chosen"].as_f64().unwrap_or(0.0).abs() + b["logps/rejected"].as_f64().unwrap_or(0.0).abs();
            relative + 1e-6 * if k == "kl" { 1.0 } else { beta } * logps
        }
        "grad_norm" if step > 1 => 1e-4 * want.abs(),
        _ => relative,
    }
}

fn follows_trl(c: &Case) {
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let (metrics, weights) = strata_run(&dir, c);
    let trl = dir.join("trl").join(c.trl_name);
    assert_eq!(reports(&metrics).len(), STEPS, "{}: steps recorded", c.name);
    metrics_follow_trl(c, &metrics, &trl.with_extension("jsonl"));
    let theirs = match c.adapter {
        true => trl.join("adapter_model.safetensors"),
        false => trl.with_extension("safetensors"),
    };
    let gap = common::global_gap(&theirs, &weights);
    eprintln!("{}: weights after {STEPS} steps differ from TRL's by {gap:.2e}", c.name);
    assert!(gap < 1e-5, "{}: weights differ from TRL's by {gap:e}", c.name);
}

/// Each step Strata's `metrics` recorded follows TRL's of case `c` (`trl`), metric by metric.
fn metrics_follow_trl(c: &Case, metrics: &Path, trl: &Path) {
    let (ours, theirs) = (reports(metrics), reports(trl));
    for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let Value::Object(fields) = b else { panic!("TRL's line is an object") };
        for (key, want) in fields {
            let want = want.as_f64().unwrap();
            // CPO's and ORPO's mean logits read the padded positions too, which attend
            // otherwise under transformers' padding mask: not compared.
            if key.starts_with("logits/") && matches!(trainer(c), "cpo" | "orpo") {
                continue;
            }
            // A tie of rewards is broken by rounding: the share of pairs it decides is not compared.
            if key == "rewards/accuracies" && b["rewards/margins"].as_f64().unwrap().abs() < 1e-4 {
                continue;
            }
            let got = a[key].as_f64().unwrap_or_else(|| panic!("{}: Strata's metrics lack {key}", c.name));
            let bound = tolerance(key, step + 1, want, b, c.beta);
            assert!((got - want).abs() <= bound, "{}: step {} {key}: Strata {got}, TRL {want}", c.name, step + 1);
        }
    }
}

fn follow(names: &[&str]) {
    for name in names {
        follows_trl(CASES.iter().find(|c| c.name == *name).expect("a case of that name"));
    }
}

#[test]
fn dpo_sigmoid_hinge_ipo_exo_and_nca_follow_trl() {
    follow(&["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair"]);
}

#[test]
fn robust_bco_sppo_and_aot_follow_trl() {
    follow(&["robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired"]);
}

#[test]
fn apo_discopop_sft_and_normalised_dpo_follow_trl() {
    follow(&["apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]);
}

#[test]
fn summed_losses_and_f_divergences_follow_trl() {
    follow(&["mpo", "js", "forward_kl"]);
}

#[test]
fn kto_alone_over_two_ranks_and_unpaired_apo_follow_trl() {
    follow(&["kto", "kto_weighted", "apo_zero_unpaired", "kto_lora", "kto_fsdp", "kto_from_pairs"]);
}

#[test]
fn reference_free_cpo_simpo_and_orpo_follow_trl() {
    follow(&["cpo", "simpo", "orpo"]);
}

#[test]
fn conversations_and_lora_follow_trl() {
    follow(&["conversations", "lora", "lora_trained", "lora_head"]);
}

#[test]
fn pairs_over_two_ranks_sharded_split_or_pipelined_and_offloaded_follow_trl() {
    follow(&["fsdp", "tensor", "pipeline", "offload"]);
}

#[test]
fn a_live_reference_follows_trl_as_a_copy_and_as_the_base_alone_and_staged_each() {
    follow(&["live", "live_pipeline", "lora_live", "lora_live_pipeline", "lora_trained_live", "lora_head_live"]);
}

#[test]
fn a_live_lora_reference_keeps_its_starting_values_sharded_and_split() {
    follow(&["lora_head_live_fsdp", "lora_head_live_tensor"]);
}

#[test]
fn a_synced_reference_follows_trl_alone_sharded_split_and_staged() {
    follow(&["tr_dpo", "tr_dpo_fsdp", "tr_dpo_tensor", "tr_dpo_pipeline"]);
}

#[test]
fn preference_flags_without_pairs_and_impossible_parameters_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "to be or not to be ".repeat(40)).unwrap();
    let o = strata(&["train", "--data", s(&text), "--steps", "1", "--beta", "0.2"]);
    common::assert_fails_with(&o, "--beta scores preference pairs");
    let o = strata(&[
        "train",
        "--data",
        s(&text),
        "--steps",
        "1",
        "--preference-loss",
        "robust",
        "--label-smoothing",
        "0.5",
    ]);
    common::assert_fails_with(&o, "robust takes a label smoothing in [0, 0.5)");
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let (model, pairs, unpaired) = (dir.join("model"), dir.join("text.jsonl"), dir.join("unpaired.jsonl"));
    let base = ["train", "--model-dir", s(&model), "--steps", "1", "--batch-size", "4", "--ctx", "64"];
    let o = strata(&[&base[..], &["--data", s(&unpaired)]].concat());
    common::assert_fails_with(&o, "are scored by kto or apo_zero_unpaired");
    let alone = ["--data", s(&unpaired), "--preference-loss", "kto", "--accumulation", "4"];
    let o = strata(&[&base[..], &alone].concat());
    common::assert_fails_with(
        &o,
        "kto: a micro-batch of 1 record (--batch-size / --accumulation) makes each record's KL",
    );
    let o = strata(&["train", "--data", s(&text), "--steps", "1", "--preference-loss", "dpo"]);
    common::assert_fails_with(&o, "preference loss \"dpo\": not one of sigmoid");
    let sync = ["--sync-reference-every", "2"];
    let o = strata(&[&base[..], &["--data", s(&pairs), "--init-adapter", s(&dir.join("adapter"))], &sync].concat());
    common::assert_fails_with(&o, "a synced reference is a copy of the whole model");
    let o = strata(&[&base[..], &["--data", s(&pairs), "--reference-mixup", "0.5"]].concat());
    common::assert_fails_with(&o, "give --sync-reference-every too");
}

/// Validation on pairs scores them with the preference loss against their own reference
/// scores: after updates on the same pairs it falls below ln 2 (a reference missing would
/// read the policy itself, ln 2 exactly), and it has no perplexity.
#[test]
fn validation_pairs_are_scored_against_their_reference() {
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let (model, pairs) = (dir.join("model"), dir.join("text.jsonl"));
    let out = tempfile::tempdir().unwrap();
    let metrics = out.path().join("m.jsonl");
    let o = strata(&[
        "train",
        "--model-dir",
        s(&model),
        "--data",
        s(&pairs),
        "--val-data",
        s(&pairs),
        "--eval-every",
        "3",
        "--eval-batches",
        "2",
        "--ctx",
        "64",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        "--threads",
        "1",
        "--metrics",
        s(&metrics),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let last = reports(&metrics).pop().unwrap();
    let val = last["val_loss"].as_f64().unwrap();
    assert!(val < std::f64::consts::LN_2 - 1e-3, "validation loss {val}");
    assert!(last.get("val_perplexity").is_none_or(Value::is_null), "{last}");
}

/// The reference's scores kept in a file (`--reference-scores`): the first run scores the
/// pairs and writes them, the next reads them back and trains exactly as the first did (and
/// as TRL does), as does a records file that gives them itself (TRL's `ref_chosen_logps`
/// and `ref_rejected_logps`); a score changed in the file changes the step that reads it,
/// and a file whose first pairs the model scores otherwise, or that holds other pairs'
/// scores, is refused in one line.
#[test]
fn reference_scores_kept_in_a_file_or_given_by_the_records_train_as_scored_ones() {
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let (model, pairs, offsets) = (dir.join("model"), dir.join("text.jsonl"), dir.join("offsets.json"));
    let out = tempfile::tempdir().unwrap();
    let store = out.path().join("reference.json");
    let run = |name: &str, data: &Path, store: Option<&Path>| {
        let metrics = out.path().join(format!("{name}.jsonl"));
        let mut args = vec!["train", "--model-dir", s(&model), "--data", s(data)];
        args.extend(steps_as_trl("3", "1e-3", &offsets, &metrics));
        if let Some(store) = store {
            args.extend(["--reference-scores", s(store)]);
        }
        (strata(&args), metrics)
    };
    let (o, written) = run("written", &pairs, Some(&store));
    assert!(o.status.success() && stderr(&o).contains("reference scores written"), "{}", stderr(&o));
    metrics_follow_trl(&CASES[0], &written, &dir.join("trl").join("sigmoid.jsonl"));
    let (o, read) = run("read", &pairs, Some(&store));
    assert!(o.status.success() && stderr(&o).contains("reference scores read"), "{}", stderr(&o));
    assert_eq!(scored(&read), scored(&written), "a run reading the scores trains as the one that wrote them");
    // The records give the scores the file holds.
    let kept: Value = serde_json::from_slice(&std::fs::read(&store).unwrap()).unwrap();
    let scores = kept["sets"]["train"]["scores"].as_array().unwrap().clone();
    assert_eq!(scores.len(), 24);
    let text = std::fs::read_to_string(&pairs).unwrap();
    let given = out.path().join("records-with-scores.jsonl");
    write_lines(
        &given,
        text.lines().zip(&scores).map(|(line, score)| {
            let mut record: Value = serde_json::from_str(line).unwrap();
            record["ref_chosen_logps"] = score[0].clone();
            record["ref_rejected_logps"] = score[1].clone();
            record
        }),
    );
    let (o, from_records) = run("given", &given, None);
    assert!(o.status.success(), "{}", stderr(&o));
    let o =
        strata(&["train", "--model-dir", s(&model), "--data", s(&given), "--steps", "1", "--live-reference", "true"]);
    common::assert_fails_with(&o, "the records give their own reference scores, which a live reference would not read");
    assert_eq!(scored(&from_records), scored(&written), "records giving the scores train as scoring them does");
    // A stored score moved: pair 5 is read at the second step, past the pairs checked.
    let moved = |pair: usize| {
        let mut changed = kept.clone();
        let chosen = &mut changed["sets"]["train"]["scores"][pair][0];
        *chosen = Value::from(chosen.as_f64().unwrap() + 1.0);
        let path = out.path().join(format!("moved{pair}.json"));
        std::fs::write(&path, changed.to_string()).unwrap();
        path
    };
    let (o, shifted) = run("moved", &pairs, Some(&moved(5)));
    assert!(o.status.success(), "{}", stderr(&o));
    let (shifted, written) = (reports(&shifted), reports(&written));
    assert_eq!(scored_step(&shifted[0]), scored_step(&written[0]), "the first step reads no moved score");
    let margin = |r: &Value| r["rewards/margins"].as_f64().unwrap();
    // β times the moved score, over four pairs, less the margin: 0.1 · 1 / 4.
    let drop = margin(&written[1]) - margin(&shifted[1]);
    assert!((drop - 0.025).abs() < 1e-5, "the second step's margin moved by {drop}, not 0.025");
    let (o, _) = run("not_the_model", &pairs, Some(&moved(0)));
    common::assert_fails_with(&o, "reference scores are not this model's (pair 0's chosen completion");
    let fewer = out.path().join("fewer.jsonl");
    write_lines(&fewer, text.lines().take(20).map(|l| serde_json::from_str(l).unwrap()));
    let (o, _) = run("other_pairs", &fewer, Some(&store));
    common::assert_fails_with(&o, "holds reference scores of other train pairs than");
    let half = out.path().join("half.jsonl");
    write_lines(
        &half,
        text.lines().map(|l| {
            let mut record: Value = serde_json::from_str(l).unwrap();
            record["ref_chosen_logps"] = Value::from(-1.0);
            record
        }),
    );
    let (o, _) = run("half", &half, None);
    common::assert_fails_with(&o, "gives both \"ref_chosen_logps\" and \"ref_rejected_logps\" or neither");
}

/// Each step's loss, gradient norm and TRL's metrics, as `metrics` recorded them.
fn scored(metrics: &Path) -> Vec<Vec<(String, Option<f64>)>> {
    reports(metrics).iter().map(scored_step).collect()
}

fn scored_step(report: &Value) -> Vec<(String, Option<f64>)> {
    let Value::Object(fields) = report else { panic!("a report is an object") };
    let trained = |k: &str| k == "loss" || k == "grad_norm" || k.contains('/');
    fields.iter().filter(|(k, _)| trained(k)).map(|(k, v)| (k.clone(), v.as_f64())).collect()
}
