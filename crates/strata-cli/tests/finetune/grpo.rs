//! GRPO against TRL's `GRPOTrainer` (scripts/trl_reference.py, the pinned TRL) on a tiny
//! LLaMA folder and the same generation batches — prompts, completions and rewards given to
//! both, TRL's generation replaced by them — for every loss type, GSPO's sequence-level
//! ratio, the KL term, two-sided clipping, batch and no reward scaling and masked truncated
//! completions: each step's loss, gradient norm and TRL's metrics, and the final weights.
//! Then batched sampling and the loop together: a toy reward raises its mean over 50 steps.
use crate::common::{self, reports};
use crate::preference::{python, s};
use crate::{TENSOR, TENSOR_AND_SEQUENCE};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use strata::engine::{Engine, EngineConfig};
use strata::grpo::{GrpoConfig, GrpoObjective, Rollouts};
use strata::io::{load_model_dir, FolderOut, WeightsTarget};
use strata::model::from_pretrained_dir;
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::run::grpo::{generate_rollouts, train_rollouts, Reference, StepShape};
use strata::run::Flow;
use strata::train::{StepReport, Trainer};

const GENERATIONS: usize = 4;
const MAX_COMPLETION: usize = 6;
const EOS: i64 = 1;
/// One process, one micro-batch a step, rows padded with the end token.
const ONE_PROCESS: StepShape = StepShape { pad: EOS, accumulation: 1, group: None, report_over: None };

/// One run: its name and the GRPOConfig fields it sets, on both sides.
struct Case {
    name: &'static str,
    fields: fn() -> Value,
}

const CASES: &[Case] = &[
    Case { name: "grpo", fields: || json!({"loss_type": "grpo", "num_iterations": 2}) },
    Case { name: "bnpo", fields: || json!({"loss_type": "bnpo", "num_iterations": 2, "epsilon_high": 0.28}) },
    Case { name: "dr_grpo", fields: || json!({"loss_type": "dr_grpo", "scale_rewards": "none"}) },
    Case { name: "dapo", fields: || json!({"loss_type": "dapo", "num_iterations": 2, "delta": 1.1}) },
    Case { name: "cispo", fields: || json!({"loss_type": "cispo", "num_iterations": 2, "epsilon_high": 1.0}) },
    Case { name: "sapo", fields: || json!({"loss_type": "sapo", "num_iterations": 2}) },
    Case {
        name: "luspo",
        fields: || json!({"loss_type": "luspo", "num_iterations": 2, "importance_sampling_level": "sequence"}),
    },
    Case { name: "vespo", fields: || json!({"loss_type": "vespo", "num_iterations": 2}) },
    Case {
        name: "gspo",
        fields: || json!({"loss_type": "grpo", "num_iterations": 2, "importance_sampling_level": "sequence"}),
    },
    Case {
        name: "kl",
        fields: || json!({"loss_type": "dapo", "beta": 0.05, "num_iterations": 2, "scale_rewards": "batch"}),
    },
    Case { name: "masked", fields: || json!({"loss_type": "grpo", "mask_truncated_completions": true}) },
    // Two micro-batches a step: dapo's token normalisation spans them, grpo's mean is per
    // micro-batch over their count.
    Case { name: "dapo-accumulated", fields: || json!({"loss_type": "dapo", "accumulation": 2}) },
    Case { name: "grpo-accumulated", fields: || json!({"loss_type": "grpo", "accumulation": 2}) },
];

/// A small deterministic draw.
struct Draw(u64);

impl Draw {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % below
    }
}

/// Two generation batches of three prompts with four completions each: lengths from one
/// token to the most, some ended by the end token; one group's rewards all equal.
fn generation_batches() -> Vec<Rollouts> {
    let mut draw = Draw(11);
    (0..2)
        .map(|b| {
            let mut r = Rollouts::default();
            for p in 0..3 {
                let prompt: Vec<i64> = (0..2 + draw.next(4)).map(|_| 3 + draw.next(300) as i64).collect();
                for _ in 0..GENERATIONS {
                    let len = 1 + draw.next(MAX_COMPLETION as u64) as usize;
                    let mut completion: Vec<i64> = (0..len).map(|_| 3 + draw.next(300) as i64).collect();
                    let ended = len < MAX_COMPLETION || draw.next(2) == 0;
                    if ended {
                        *completion.last_mut().unwrap() = EOS;
                    }
                    r.prompts.push(prompt.clone());
                    r.completions.push(completion);
                    r.truncated.push(!ended);
                    r.rewards.push(if b == 1 && p == 2 { 0.5 } else { draw.next(7) as f64 / 2.0 });
                }
            }
            r
        })
        .collect()
}

fn config_of(fields: &Value) -> GrpoConfig {
    let f = |k: &str| fields.get(k);
    GrpoConfig {
        num_generations: GENERATIONS,
        max_completion_length: MAX_COMPLETION,
        loss: f("loss_type").and_then(Value::as_str).unwrap().parse().unwrap(),
        beta: f("beta").and_then(Value::as_f64).unwrap_or(0.0),
        epsilon_high: f("epsilon_high").and_then(Value::as_f64),
        delta: f("delta").and_then(Value::as_f64),
        importance_sampling: f("importance_sampling_level").and_then(Value::as_str).unwrap_or("token").parse().unwrap(),
        scale_rewards: f("scale_rewards").and_then(Value::as_str).unwrap_or("group").parse().unwrap(),
        num_iterations: f("num_iterations").and_then(Value::as_u64).unwrap_or(1) as usize,
        mask_truncated_completions: f("mask_truncated_completions").and_then(Value::as_bool).unwrap_or(false),
        ..GrpoConfig::default()
    }
}

/// The model folder and TRL's runs of every case, made once.
fn reference(py: &Path) -> PathBuf {
    common::shared_dir("trl-grpo", |dir| {
        let batches: Vec<Value> = generation_batches()
            .iter()
            .map(|r| json!({"prompts": r.prompts, "completions": r.completions, "rewards": r.rewards}))
            .collect();
        std::fs::write(dir.join("rollouts.json"), Value::from(batches).to_string()).unwrap();
        let runs: Vec<Value> = CASES
            .iter()
            .map(|c| {
                let mut run = (c.fields)();
                run["name"] = json!(c.name);
                run
            })
            .collect();
        std::fs::write(dir.join("runs.json"), Value::from(runs).to_string()).unwrap();
        let trl = dir.join("trl");
        std::fs::create_dir_all(&trl).unwrap();
        // The model folder, then TRL's runs on it, in one reference process.
        python(
            py,
            &[
                &["make", "--out", s(&dir.join("model")), "--seed", "4"],
                &[
                    "grpo",
                    "--model",
                    s(&dir.join("model")),
                    "--runs",
                    s(&dir.join("runs.json")),
                    "--rollouts",
                    s(&dir.join("rollouts.json")),
                    "--out",
                    s(&trl),
                    "--generations",
                    &GENERATIONS.to_string(),
                    "--max-completion-length",
                    &MAX_COMPLETION.to_string(),
                ],
            ],
        );
    })
}

/// The folder's model as a trainer with AdamW at `lr` (the gradient norm measured, never
/// clipped), and a frozen copy.
fn trainer(folder: &Path, lr: f64) -> (Trainer, Engine) {
    let dir = from_pretrained_dir(folder).unwrap();
    let load = || {
        let mut engine = Engine::new(dir.spec().unwrap(), EngineConfig::default()).unwrap();
        load_model_dir(&mut engine, &dir).unwrap();
        engine
    };
    let mut engine = load();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig { lr, weight_decay: 0.0, ..Default::default() }, &[]);
    (Trainer::new(engine, optimizer.unwrap(), LrSchedule::Constant, Some(1e9)), load())
}

/// A step callback that keeps every report and goes on.
fn keep(into: &mut Vec<StepReport>) -> impl FnMut(&mut Trainer, StepReport) -> strata::Result<Flow> + '_ {
    |_, report| {
        into.push(report);
        Ok(Flow::Continue)
    }
}

fn follows_trl(dir: &Path, c: &Case) {
    let fields = (c.fields)();
    let objective = GrpoObjective::new(config_of(&fields)).unwrap();
    let (mut trainer, mut reference) = trainer(&dir.join("model"), 1e-3);
    let accumulation = fields.get("accumulation").and_then(Value::as_u64).unwrap_or(1) as usize;
    let shape = StepShape { accumulation, ..ONE_PROCESS };
    let mut ours: Vec<StepReport> = vec![];
    for rollouts in generation_batches() {
        let kl = Reference::Copy(&mut reference);
        train_rollouts(&mut trainer, &objective, &rollouts, kl, &shape, &mut keep(&mut ours)).unwrap();
    }
    let theirs = reports(&dir.join("trl").join(format!("{}.jsonl", c.name)));
    assert_eq!(ours.len(), theirs.len(), "{}: steps", c.name);
    let mut clipped = 0.0;
    for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let a = serde_json::to_value(a).unwrap();
        // TRL's per-token metrics of an accumulated step are its last micro-batch's alone.
        let keys: &[&str] = match accumulation {
            1 => &["loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "entropy"],
            _ => &["loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std"],
        };
        let optional: &[&str] = match accumulation {
            1 => &["kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"],
            _ => &[],
        };
        for key in keys.iter().chain(optional.iter().filter(|k| b.get(**k).is_some())) {
            let want = b[*key].as_f64().unwrap();
            let got = a[*key].as_f64().unwrap_or_else(|| panic!("{}: Strata's report lacks {key}", c.name));
            // The gradient norm and the loss after the first update follow a trajectory whose
            // rounding differs with the CPU's kernels (the loss most: advantages of both signs
            // nearly cancel in it); the weights at the end are held to 1e-5 below.
            let drifts = ["grad_norm", "loss"].contains(key) && step > 0;
            let bound = 1e-5 * want.abs().max(0.1) * if drifts { 10.0 } else { 1.0 };
            assert!((got - want).abs() <= bound, "{}: step {} {key}: Strata {got}, TRL {want}", c.name, step + 1);
        }
        clipped += b.get("clip_ratio/region_mean").and_then(Value::as_f64).unwrap_or(0.0);
    }
    if ["grpo", "dapo", "gspo"].contains(&c.name) {
        assert!(clipped > 0.0, "{}: no update was clipped, so the clip is not tested", c.name);
    }
    let saved = dir.join(format!("strata-{}", c.name));
    let out = FolderOut::like(&saved, &from_pretrained_dir(&dir.join("model")).unwrap());
    trainer.save_weights(WeightsTarget::Folder(&out), true).unwrap();
    let gap =
        common::global_gap(&dir.join("trl").join(format!("{}.safetensors", c.name)), &saved.join("model.safetensors"));
    eprintln!("{}: weights after {} steps differ from TRL's by {gap:.2e}", c.name, ours.len());
    assert!(gap < 1e-5, "{}: weights differ from TRL's by {gap:e}", c.name);
}

#[test]
fn every_grpo_loss_type_follows_trl() {
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    for c in CASES {
        follows_trl(&dir, c);
    }
}

/// Sampling, rewards and updates together: rewarded for each token it writes of a tenth of
/// the vocabulary (ids 3 to 35), a random model writes more of them within 50 steps.
#[test]
fn a_toy_reward_rises_over_fifty_steps() {
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let config = GrpoConfig { num_generations: 8, max_completion_length: 8, ..GrpoConfig::default() };
    let objective = GrpoObjective::new(config).unwrap();
    let (mut trainer, _) = trainer(&dir.join("model"), 1e-2);
    let prompts: Vec<(usize, Vec<i64>)> = vec![(0, vec![40, 41, 42]), (1, vec![50, 9])];
    let reward = Arc::new(|c: &[i64]| c.iter().filter(|&&t| (3..=35).contains(&t)).count() as f64);
    let mut means = vec![];
    for step in 0..50 {
        let (mut rollouts, _) = generate_rollouts(&mut trainer, &objective, &prompts, &[EOS], step).unwrap();
        rollouts.rewards = rollouts.completions.iter().map(|c| reward(c)).collect();
        let mut reports = vec![];
        train_rollouts(&mut trainer, &objective, &rollouts, Reference::None, &ONE_PROCESS, &mut keep(&mut reports))
            .unwrap();
        means.push(reports[0].grpo.unwrap().reward);
    }
    let early: f64 = means[..10].iter().sum::<f64>() / 10.0;
    let late: f64 = means[40..].iter().sum::<f64>() / 10.0;
    eprintln!("mean reward over the first ten steps {early:.3}, over the last ten {late:.3}");
    assert!(late > early + 0.5, "the reward did not rise: {means:?}");
}

/// `count` prompts (`Question i: say more`, where `varied` then `please` up to twice, so that
/// their lengths differ, with their `id`) in `dir`'s `prompts.jsonl`, and the command of
/// [`reward_script`].
fn prompts_and_reward(dir: &Path, count: usize, varied: bool) -> (PathBuf, String) {
    let prompts = dir.join("prompts.jsonl");
    let text = |i: usize| format!("Question {i}: say more{}", " please".repeat(if varied { i % 3 } else { 0 }));
    let lines: Vec<String> = (0..count).map(|i| json!({"prompt": text(i), "id": i}).to_string()).collect();
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    (prompts, reward_script(dir))
}

/// A reward command: one reward per completion, the count of "e" in its text.
fn reward_script(dir: &Path) -> String {
    let script = dir.join("reward.py");
    let body = "import json, sys\nfor line in sys.stdin:\n    print(json.loads(line)[\"completion\"].count(\"e\"))\n";
    std::fs::write(&script, body).unwrap();
    let py = common::venv_python().unwrap();
    format!("{} {}", py.display(), script.display())
}

/// Each step's loss and GRPO's metrics of `two` within 1e-6 + 1e-5 relative of `one`'s, and
/// its final weights within 1e-5.
fn follows_one_process(name: &str, one: &common::Run, two: &common::Run) {
    for (x, y) in reports(&one.1).iter().zip(&reports(&two.1)) {
        for key in ["loss", "reward", "kl", "entropy", "clip_ratio/region_mean", "supervised_tokens"] {
            let (want, got) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
            let step = &x["step"];
            assert!((want - got).abs() <= 1e-6 + 1e-5 * want.abs(), "{name} step {step}: {key} {got} against {want}");
        }
    }
    let gap = common::global_gap(&one.0, &two.0);
    eprintln!("GRPO over two {name} ranks: weights differ from one process's by {gap:.2e}");
    assert!(gap < 1e-5, "{name}: weights differ by {gap:e}");
}

/// `strata train` on prompts with a reward command: over two fsdp ranks, two tensor ranks
/// (with and without sequence parallel) and two pipeline stages (under LoRA) it follows one
/// process step for step (each prompt's group sampled from its own seed, the KL term read
/// from a frozen copy) and ends with its weights; under LoRA the base is the reference;
/// what GRPO cannot take is refused in one line.
#[test]
fn grpo_from_the_command_line_over_two_ranks_follows_one_process() {
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let work = tempfile::tempdir().unwrap();
    // Prompts of several lengths: each generation batch decodes them together, left-padded.
    let (prompts, command) = prompts_and_reward(work.path(), 6, true);
    let model = dir.join("model");
    let shared = [
        "--model-dir",
        s(&model),
        "--data",
        s(&prompts),
        "--reward-command",
        &command,
        "--num-generations",
        "4",
        "--max-completion-length",
        "8",
        "--batch-size",
        "8",
        "--ctx",
        "64",
        // Adam's first steps move a weight by about lr whatever its gradient's size, so a
        // gradient within rounding of zero moves it by rounding's choice: the rate keeps
        // that well under the bound on the weights' gap.
        "--lr",
        "1e-3",
        "--beta",
        "0.04",
        "--grad-clip",
        "0",
    ];
    let twice = ["--num-iterations", "2"];
    let one = common::train_run(work.path(), "one", 6, &[&shared, &twice]);
    let a = reports(&one.1);
    assert_eq!(a.len(), 6);
    assert!(a[5]["kl"].as_f64().unwrap() > 0.0, "the policy moved from its reference");
    // Two data ranks, each generating for its own prompts; two tensor ranks, generating
    // together for the same prompts (each decoding its heads, the whole logits gathered),
    // also with sequence parallel in training (decoding keeps the new positions whole).
    for (name, strategy) in [("fsdp", r#"["fsdp"]"#), ("tensor", TENSOR), ("sequence", TENSOR_AND_SEQUENCE)] {
        let two =
            common::train_run(work.path(), name, 6, &[&shared, &twice, &["--nproc", "2", "--strategy", strategy]]);
        follows_one_process(name, &one, &two);
    }
    // Rewards scaled by the whole generation batch's spread: every data rank's rewards.
    let batch = ["--scale-rewards", "batch"];
    let one_batch = common::train_run(work.path(), "one-batch", 4, &[&shared, &batch]);
    let two = common::train_run(work.path(), "fsdp-batch", 4, &[&shared, &batch, &["--nproc", "2"]]);
    follows_one_process("batch scaling", &one_batch, &two);
    // LoRA: the base without its adapters is the reference. One update per generation
    // batch, so a reference that were the policy itself would read no KL at all.
    let lora = r#"[["lora", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}]]"#;
    let adapted = common::train_run(work.path(), "lora", 4, &[&shared, &["--strategy", lora]]);
    let kl: Vec<f64> = reports(&adapted.1).iter().map(|r| r["kl"].as_f64().unwrap()).collect();
    assert!(kl[0] == 0.0 && kl[1..].iter().all(|&k| k > 0.0 && k < 1.0), "LoRA's KL to its base: {kl:?}");
    // Two pipeline stages decode together, each its own units, the tokens chosen on the
    // last reaching the first; the base (adapters off on both stages) is the reference.
    let staged = r#"[["lora", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}],
        ["parallel_mode", [[["pipeline", 2]], null]], "pipeline_parallel"]"#;
    let two = common::train_run(work.path(), "pipeline", 4, &[&shared, &["--nproc", "2", "--strategy", staged]]);
    follows_one_process("pipeline", &adapted, &two);
    // Without LoRA, two pipeline stages keep their units' starting weights as the reference
    // and swap them in to score it.
    let stages = r#"[["parallel_mode", [[["pipeline", 2]], null]], "pipeline_parallel"]"#;
    let two =
        common::train_run(work.path(), "pipeline-kept", 6, &[&shared, &twice, &["--nproc", "2", "--strategy", stages]]);
    follows_one_process("staged", &one, &two);
    for (flags, expected) in [
        (vec!["--num-generations", "3"], "not whole groups of num_generations 3"),
        (vec!["--grpo-loss", "ppo"], "unknown GRPO loss type"),
    ] {
        let o = common::strata(&[&["train", "--steps", "1"][..], &shared, &flags].concat());
        common::assert_fails_with(&o, expected);
    }
    let o = common::strata(&["train", "--model-dir", s(&model), "--data", s(&prompts), "--steps", "1"]);
    common::assert_fails_with(&o, "trained on by GRPO: give --reward-command");
}

/// `--strategy auto` searches GRPO's layouts on rows as long as its training rows at their
/// longest, each dry run first decoding a rank's generation batch as generation does: with
/// 512 completions of 48 tokens a step (micro-batches of 4 rows, so that decoding holds the
/// most) a dry run peaks higher than with 8 by about the key and value cache the 504 more
/// rows hold; at `--beta` above 0 without LoRA its peak is higher again by the frozen copy's
/// fp32 weights (the whole model, on one rank), against the budget as given; the runs then
/// train.
#[test]
fn auto_counts_grpo_s_generation_and_its_reference_copy() {
    let Some(py) = common::venv_python() else { return };
    let dir = reference(&py);
    let work = tempfile::tempdir().unwrap();
    let (prompts, command) = prompts_and_reward(work.path(), 4, false);
    let model = dir.join("model");
    let budget = 400_000_000u64;
    let search = |name: &str, (batch, accumulation): (&str, &str), beta: &[&str]| -> Value {
        let report = work.path().join(format!("{name}.json"));
        let args = [
            "train",
            "--model-dir",
            s(&model),
            "--data",
            s(&prompts),
            "--reward-command",
            &command,
            "--num-generations",
            "4",
            "--max-completion-length",
            "48",
            "--batch-size",
            batch,
            "--accumulation",
            accumulation,
            "--ctx",
            "128",
            "--steps",
            "1",
            "--threads",
            "1",
            "--strategy",
            "auto",
            "--excluded",
            "module_replace,amp_native,half,fp8,offload",
            "--dry-run-steps",
            "1",
            "--confirm-runs",
            "0",
            "--device-memory",
            &budget.to_string(),
            "--search-report",
            s(&report),
        ];
        let o = common::strata(&[&args[..], beta].concat());
        assert!(o.status.success(), "{}", common::stderr(&o));
        serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap()
    };
    let (few, many) = (search("few", ("8", "2"), &[]), search("many", ("512", "128"), &[]));
    let copied = search("copied", ("512", "128"), &["--beta", "0.04"]);
    let peak = |r: &Value, label: &str| {
        let trial = r["trials"].as_array().unwrap().iter().find(|t| t["label"] == label).unwrap();
        trial["outcome"]["peak_bytes"].as_u64().unwrap_or_else(|| panic!("{label}: {trial}"))
    };
    let config: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let field = |k: &str| config[k].as_u64().unwrap();
    let kv_width = field("num_key_value_heads") * field("hidden_size") / field("num_attention_heads");
    // 504 more rows of the longest prompt and 48 decoded (within the 128 positions of a
    // row), keys and values in fp32; decoding also holds a layer's cache twice while it
    // grows, and the logits.
    let cache = |positions: u64| 504 * positions * field("num_hidden_layers") * 2 * kv_width * 4;
    let plain = "fp32 + data parallel";
    let grown = peak(&many, plain) as f64 - peak(&few, plain) as f64;
    let (least, most) = (cache(48) as f64, 2.0 * cache(128) as f64);
    assert!((least..most).contains(&grown), "the peak grew by {grown} bytes, the cache by {least} to {most}");
    let params = many["analysis"]["params"].as_u64().unwrap();
    assert_eq!(peak(&copied, plain) - peak(&many, plain), 4 * params, "the frozen copy's weights");
    for report in [&few, &many, &copied] {
        assert_eq!(report["budget_bytes"], json!(budget));
    }
}
