//! Pipeline parallelism end to end: GPT (tied embedding on the first and last stage) and
//! LLaMA (untied), 7 blocks (9 units) on 2 and 4 ranks, with GPipe, 1F1B, the interleaved
//! schedule, ZB-H1 and ZB-H2, reach what one process reaches with the same micro-batches; bad
//! layouts are refused in one line. Each configuration is a test of its own.
use crate::common;

use crate::common::{assert_follows, losses, stderr, strata, train_run, Run};
use std::path::Path;

const RUN: [&str; 16] = [
    "--layers",
    "7",
    "--dim",
    "32",
    "--ctx",
    "32",
    "--seed",
    "3",
    "--batch-size",
    "8",
    "--schedule",
    "constant",
    "--threads",
    "1",
    "--accumulation",
    "4",
];
const GPT: [&str; 4] = ["--model", "gpt", "--vocab", "97"];
const LLAMA: [&str; 6] = ["--model", "llama", "--heads", "4", "--kv-heads", "2"];

fn pipeline(stages: usize, schedule: &str, virtual_stages: usize) -> String {
    format!(
        r#"[["parallel_mode", [[["pipeline", {stages}]], null]], ["pipeline_parallel", {{"schedule": "{schedule}", "virtual_stages": {virtual_stages}}}]]"#
    )
}

/// Trains 10 AdamW steps (fp32).
fn train(dir: &Path, name: &str, model: &[&str], extra: &[&str]) -> Run {
    train_run(dir, name, 10, &[model, &RUN, extra])
}

/// The one-process run of `model` with `extra` flags, trained once per test binary.
fn one_process(key: &str, model: &[&str], extra: &[&str]) -> Run {
    let dir = common::shared_dir(key, |dir| {
        train(dir, "one", model, extra);
    });
    (dir.join("one.st"), dir.join("one.jsonl"))
}

/// A pipeline run with `strategy` on `nproc` ranks follows one process step for step.
fn follows_one_process(one: Run, model: &[&str], nproc: usize, strategy: &str, what: &str, bounds: (f64, f64)) {
    let dir = tempfile::tempdir().unwrap();
    let run = train(dir.path(), "pp", model, &["--nproc", &nproc.to_string(), "--strategy", strategy]);
    assert_follows(&one, &run, what, bounds.0, bounds.1);
    // Every parameter of every unit comes back, uneven stages included.
    assert_eq!(common::weights(&one.0).len(), common::weights(&run.0).len(), "{what}");
}

/// One test per model, stage count and schedule, so a failure names its case.
macro_rules! schedules_match_one_process {
    ($($case:ident: $model:ident, $stages:expr, $schedule:expr, $virtual:expr;)*) => {$(
        #[test]
        fn $case() {
            let one = one_process(stringify!($model), &$model, &[]);
            let what = format!("{}: {} stages, {}, {} chunks per rank", stringify!($model), $stages, $schedule, $virtual);
            follows_one_process(one, &$model, $stages, &pipeline($stages, $schedule, $virtual), &what, (1e-6, 1e-5));
        }
    )*};
}

schedules_match_one_process! {
    gpt_2_stages_gpipe: GPT, 2, "gpipe", 1;
    gpt_2_stages_1f1b: GPT, 2, "1f1b", 1;
    gpt_4_stages_1f1b: GPT, 4, "1f1b", 1;
    gpt_4_stages_gpipe: GPT, 4, "gpipe", 1;
    gpt_2_stages_interleaved: GPT, 2, "interleaved", 2;
    gpt_4_stages_interleaved: GPT, 4, "interleaved", 2;
    gpt_2_stages_zero_bubble: GPT, 2, "zero_bubble", 1;
    gpt_4_stages_zero_bubble: GPT, 4, "zero_bubble", 1;
    gpt_2_stages_zero_bubble_h2: GPT, 2, "zero_bubble_h2", 1;
    gpt_4_stages_zero_bubble_h2: GPT, 4, "zero_bubble_h2", 1;
    llama_2_stages_gpipe: LLAMA, 2, "gpipe", 1;
    llama_2_stages_1f1b: LLAMA, 2, "1f1b", 1;
    llama_4_stages_1f1b: LLAMA, 4, "1f1b", 1;
    llama_4_stages_gpipe: LLAMA, 4, "gpipe", 1;
    llama_2_stages_interleaved: LLAMA, 2, "interleaved", 2;
    llama_4_stages_interleaved: LLAMA, 4, "interleaved", 2;
    llama_2_stages_zero_bubble: LLAMA, 2, "zero_bubble", 1;
    llama_4_stages_zero_bubble: LLAMA, 4, "zero_bubble", 1;
    llama_2_stages_zero_bubble_h2: LLAMA, 2, "zero_bubble_h2", 1;
    llama_4_stages_zero_bubble_h2: LLAMA, 4, "zero_bubble_h2", 1;
}

/// Stages balanced by parameter count instead of measured time.
#[test]
fn stages_balanced_by_parameters_match_one_process() {
    let by_params =
        r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {"balance": "parameters"}]]"#;
    follows_one_process(
        one_process("GPT", &GPT, &[]),
        &GPT,
        2,
        by_params,
        "stages balanced by parameters",
        (1e-5, 1e-5),
    );
}

/// Recomputation per micro-batch, under the split backward too.
#[test]
fn checkpointed_blocks_in_a_zero_bubble_pipeline_match_one_process() {
    let strategy = r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {"schedule": "zero_bubble"}], ["checkpoint", ["GptBlock"]]]"#;
    let what = "checkpointed blocks in a pipeline";
    follows_one_process(one_process("GPT", &GPT, &[]), &GPT, 2, strategy, what, (1e-5, 1e-5));
}

/// Replaced kernels (oneDNN's linear where libtorch has it) compute the deferred layers'
/// forward and input gradient.
#[test]
fn zero_bubble_with_replaced_modules_matches_one_process() {
    let one = one_process("GPT-module_replace", &GPT, &["--strategy", r#"["module_replace"]"#]);
    let strategy = r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {"schedule": "zero_bubble"}], "module_replace"]"#;
    follows_one_process(one, &GPT, 2, strategy, "zero bubble with module_replace", (1e-5, 1e-5));
}

#[test]
fn bad_pipelines_are_refused_in_one_line() {
    let hand = |stages: &str| {
        format!(r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {{"stages": {stages}}}]]"#)
    };
    let cases: Vec<(Vec<&str>, String, &str)> = vec![
        (vec!["--layers", "1"], pipeline(2, "interleaved", 2), "4 stages for 3 units"),
        (vec!["--accumulation", "3"], pipeline(2, "1f1b", 1), "does not split into 1 ranks × 3 micro-batches"),
        (vec![], hand("[[0, 4], [5, 9]]"), "skips unit 4"),
        (vec![], hand("[[0, 5], [4, 9]]"), "repeats unit 4"),
        (vec!["--accumulation", "3"], pipeline(2, "interleaved", 2), "groups of the 2 stages"),
        // Refused by the trainer, whatever the device, before any step.
        (
            vec!["--cuda-graph", "true"],
            pipeline(2, "1f1b", 1),
            "cuda_graph: a pipeline schedules its stages' sends and receives from the host",
        ),
    ];
    for (extra, strategy, expected) in cases {
        let args =
            [&["train"][..], &GPT, &RUN, &["--steps", "1", "--nproc", "2", "--strategy", &strategy], &extra].concat();
        let o = strata(&args);
        common::assert_fails_with(&o, expected);
    }
    let o = strata(&[&["train"][..], &GPT, &RUN, &["--steps", "1", "--strategy", r#"["pipeline_parallel"]"#]].concat());
    assert!(stderr(&o).contains("pipeline_parallel: give the number of stages in parallel_mode"), "{}", stderr(&o));
}

/// 1F1B's stage r holds at most p − r micro-batches' activations, ZB-H2's 2(p − r) − 1;
/// GPipe holds all m; the
/// values of outputs sent on are freed.
#[test]
fn schedules_hold_the_micro_batches_their_analysis_says() {
    let dir = tempfile::tempdir().unwrap();
    for (schedule, expected) in [
        ("1f1b", [4, 3, 2, 1]),
        ("gpipe", [8, 8, 8, 8]),
        ("zero_bubble", [4, 3, 2, 1]),
        ("zero_bubble_h2", [7, 5, 3, 1]),
    ] {
        let metrics = dir.path().join(format!("{schedule}.jsonl"));
        let args = ["--layers", "2", "--accumulation", "8", "--steps", "1", "--nproc", "4"];
        let files = ["--strategy", &pipeline(4, schedule, 1), "--metrics", metrics.to_str().unwrap()];
        let o = strata(&[&["train"][..], &GPT, &RUN, &args, &files].concat());
        assert!(o.status.success(), "{schedule}:\n{}", stderr(&o));
        let text = std::fs::read_to_string(&metrics).unwrap();
        let report: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        let held: Vec<u64> =
            report["pipeline"]["micro_batches_held"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(held, expected, "{schedule}");
        // Every stage but the last frees each output's values once sent, before its backward.
        let freed: Vec<u64> =
            report["pipeline"]["outputs_freed"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(freed, [8, 8, 8, 0], "{schedule}");
        let bubbles = report["pipeline"]["bubble"].as_array().unwrap();
        assert!(bubbles.iter().all(|b| (0.0..1.0).contains(&b.as_f64().unwrap())), "{bubbles:?}");
    }
}

/// A pipeline beside tensor parallelism and beside sharding, at 4 ranks, reaches what one
/// process reaches, zero2 and fsdp with GPT's embedding tied across stages included.
/// A pipeline beside other layouts on 4 ranks (`dims`, then `more` methods) follows one
/// process, both with 2 micro-batches.
fn beside_matches_one_process(model_name: &str, model: &[&str], dims: &str, more: &str) {
    let two = ["--accumulation", "2"];
    let one = one_process(&format!("{model_name}-2-micro-batches"), model, &two);
    let dir = tempfile::tempdir().unwrap();
    let strategy = format!(r#"[["parallel_mode", [{dims}, null]], {more}]"#);
    let run = train(dir.path(), "pp", model, &[&two[..], &["--nproc", "4", "--strategy", &strategy]].concat());
    assert_follows(&one, &run, &format!("{model_name}: {dims} with {more}"), 1e-5, 1e-5);
}

macro_rules! beside_matches_one_process {
    ($($case:ident: $model:ident, $dims:expr, $more:expr;)*) => {$(
        #[test]
        fn $case() {
            beside_matches_one_process(stringify!($model), &$model, $dims, $more);
        }
    )*};
}

const TP_PP: &str = r#"[["tensor", 2], ["pipeline", 2]]"#;
const PP: &str = r#"[["pipeline", 2]]"#;
const SEQUENCE: &str = r#""pipeline_parallel", ["tensor_parallel", {"sequence_parallel": true}]"#;

beside_matches_one_process! {
    gpt_pipeline_beside_sequence_parallel: GPT, TP_PP, SEQUENCE;
    gpt_pipeline_beside_zero1: GPT, PP, r#""pipeline_parallel", "zero1""#;
    // The units holding the tied wte stay whole; the blocks are sharded.
    gpt_pipeline_beside_zero2: GPT, PP, r#""pipeline_parallel", "zero2""#;
    gpt_pipeline_beside_fsdp: GPT, PP, r#""pipeline_parallel", "fsdp""#;
    // ZB-H2 and ZB-H1 beside data replicas: the reduction waits for the deferred weight
    // gradients.
    gpt_zero_bubble_h2_beside_data_replicas: GPT, PP, r#"["pipeline_parallel", {"schedule": "zero_bubble_h2"}]"#;
    llama_zero_bubble_beside_zero1: LLAMA, PP, r#"["pipeline_parallel", {"schedule": "zero_bubble"}], "zero1""#;
    // Beside zero2 and fsdp the whole gradients wait for the deferred ones before they are
    // reduce-scattered and freed.
    llama_zero_bubble_beside_zero2: LLAMA, PP, r#"["pipeline_parallel", {"schedule": "zero_bubble"}], "zero2""#;
    gpt_zero_bubble_h2_beside_fsdp: GPT, PP, r#"["pipeline_parallel", {"schedule": "zero_bubble_h2"}], "fsdp""#;
    llama_pipeline_beside_sequence_parallel: LLAMA, TP_PP, SEQUENCE;
    llama_pipeline_beside_zero2: LLAMA, PP, r#""pipeline_parallel", "zero2""#;
    // DeepSpeed's layout of the same sizes: tensor ranks adjacent, pipeline outermost.
    llama_deepspeed_3d_layout: LLAMA, r#"[["pipeline", 2], ["tensor", 2]]"#, r#""ds_3d_parallel""#;
}

/// Saved by a pipeline of 2, resumed by one process, saved, resumed by 2 stages × tensor
/// size 2: every resumed step's loss is the uninterrupted run's.
#[test]
fn checkpoints_move_between_pipeline_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let run = |extra: &[&str]| {
        let o = strata(&[&["train"][..], &GPT, &RUN, extra].concat());
        assert!(o.status.success(), "{extra:?}:\n{}", stderr(&o));
    };
    run(&["--steps", "6", "--metrics", &p("whole.jsonl")]);
    run(&["--steps", "2", "--nproc", "2", "--strategy", &pipeline(2, "1f1b", 1), "--save-checkpoint", &p("a")]);
    run(&["--steps", "4", "--resume", &p("a"), "--save-checkpoint", &p("b"), "--metrics", &p("r1.jsonl")]);
    let mixed = r#"[["parallel_mode", [[["pipeline", 2], ["tensor", 2]], null]], "mixed_parallel"]"#;
    run(&["--steps", "6", "--nproc", "4", "--strategy", mixed, "--resume", &p("b"), "--metrics", &p("r2.jsonl")]);
    let full = losses(Path::new(&p("whole.jsonl")));
    let resumed = [losses(Path::new(&p("r1.jsonl"))), losses(Path::new(&p("r2.jsonl")))].concat();
    assert_eq!(resumed.iter().map(|r| r.0).collect::<Vec<_>>(), [3, 4, 5, 6]);
    for ((step, a), (_, b)) in full[2..].iter().zip(&resumed) {
        assert!((a - b).abs() <= 1e-6 * a.abs(), "step {step}: {a} uninterrupted, {b} resumed");
    }
    // Whole weights go into the stages and come back out unchanged.
    run(&["--steps", "2", "--save-weights", &p("one.st")]);
    let through = ["--init-weights", &p("one.st"), "--steps", "0", "--save-weights", &p("through.st")];
    run(&[&["--nproc", "4", "--strategy", mixed][..], &through].concat());
    let (before, after) = (common::weights(Path::new(&p("one.st"))), common::weights(Path::new(&p("through.st"))));
    assert_eq!(before.len(), after.len());
    for (name, t) in &before {
        assert!(t.equal(&after[name]), "{name} changed through the pipeline's stages");
    }
}

/// fp16 with a dynamic loss scale that starts far too high: the first steps overflow and
/// are skipped on every stage together, and the pipeline follows one process step for step.
#[test]
fn loss_scaling_skips_the_same_steps_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let scaler = r#"["amp_native", {"dtype": "fp16", "loss_scaler": {"initial_scale_power": 22, "hysteresis": 1}}]"#;
    let one = train(dir.path(), "one", &GPT, &["--strategy", &format!("[{scaler}]")]);
    let staged = format!(r#"[["parallel_mode", [[["pipeline", 2]], null]], "pipeline_parallel", {scaler}]"#);
    let run = train(dir.path(), "pp", &GPT, &["--nproc", "2", "--strategy", &staged]);
    let report = |path: &Path| -> Vec<(bool, f64)> {
        let scaled = |r: &serde_json::Value| (r["skipped"].as_bool().unwrap(), r["loss_scale"].as_f64().unwrap());
        common::reports(path).iter().map(scaled).collect()
    };
    let (a, b) = (report(&one.1), report(&run.1));
    let skipped = a.iter().filter(|r| r.0).count();
    assert!((1..10).contains(&skipped), "the scale skipped {skipped} of 10 steps");
    assert_eq!(a, b, "skipped steps and loss scales");
    // fp16 compute: the stages sum a tied weight's gradients in another order than one
    // process, and fp16 (unit roundoff 4.9e-4) rounds what that leaves; a static scale
    // leaves the weights about 5e-4 apart too.
    assert_follows(&one, &run, "fp16 with loss scaling", 1e-4, 1e-3);
}

/// ZB-H1 under bf16 autocast: the deferred weight gradients are computed in bf16 and added
/// to the fp32 gradients as the cast's backward adds them, so the pipeline follows 1F1B
/// on the same stages step for step, and one process within bf16's rounding of the tied
/// embedding's gradient, which the stages sum in another order.
#[test]
fn zero_bubble_under_amp_matches_one_f_one_b_and_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let amp = r#"["amp_native", {"dtype": "bf16"}]"#;
    let one = train(dir.path(), "one", &GPT, &["--strategy", &format!("[{amp}]")]);
    let staged = |schedule: &str| {
        let strategy = format!(
            r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {{"schedule": "{schedule}"}}], {amp}]"#
        );
        train(dir.path(), schedule, &GPT, &["--nproc", "2", "--strategy", &strategy])
    };
    let (zb, plain) = (staged("zero_bubble"), staged("1f1b"));
    assert_follows(&plain, &zb, "zero bubble against 1F1B under bf16 autocast", 1e-6, 1e-6);
    // bf16's unit roundoff is 3.9e-3.
    assert_follows(&one, &zb, "zero bubble under bf16 autocast against one process", 1e-4, 5e-3);
}
