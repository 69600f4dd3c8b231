//! Fine-tuning Hugging Face model folders end to end, against `transformers` itself
//! (scripts/hf_reference.py, the project's `.venv`): a folder trains under a strategy
//! (one process, fsdp, tensor parallel, a pipeline), its validation loss equals `transformers`' on the folder
//! Strata writes back, `strata eval` agrees, `strata generate` stops at the end token, and
//! bad folders are refused in one line.
use crate::common;
use crate::{TENSOR, TENSOR_AND_SEQUENCE};

use crate::common::{assert_fails_with, stderr, strata};
use crate::hf_reference::{python, reference};
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A random model folder of `family` and token files (ids below the tokenizer's 90 words)
/// to train and validate on.
fn setup(py: &Path, dir: &Path, family: &str) -> (PathBuf, PathBuf, PathBuf) {
    let folder = dir.join(family);
    reference(py, &["make", "--family", family, "--out", s(&folder)]);
    let mut x: u64 = 99;
    let mut tokens = |n: usize| {
        let ids: Vec<u32> = (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) % 90) as u32
            })
            .collect();
        strata::data::TokenData::new(ids, "random")
    };
    let (train, val) = (dir.join("train.bin"), dir.join("val.bin"));
    tokens(4000).write_u16_file(&train).unwrap();
    tokens(1200).write_u16_file(&val).unwrap();
    (folder, train, val)
}

/// The windows of training and validation: 3 batches of 4 rows of 16 positions.
const WINDOWS: [&str; 6] = ["--ctx", "16", "--batch-size", "4", "--eval-batches", "3"];

const RUN: [&str; 10] =
    ["--steps", "4", "--eval-every", "2", "--lr", "0.01", "--threads", "1", "--schedule", "constant"];

/// The validation losses of a metrics file, by step.
fn val_losses(metrics: &Path) -> Vec<(u64, f64)> {
    let validated = common::reports(metrics).into_iter().filter(|r| r.get("val_loss").is_some());
    validated.map(|r| (r["step"].as_u64().unwrap(), r["val_loss"].as_f64().unwrap())).collect()
}

fn transformers_val_loss(py: &Path, folder: &Path, val: &Path) -> f64 {
    let out = reference(
        py,
        &["val-loss", "--dir", s(folder), "--token-file", s(val), "--ctx", "16", "--batch-size", "4", "--batches", "3"],
    );
    serde_json::from_str::<serde_json::Value>(&out).unwrap()["val_loss"].as_f64().unwrap()
}

/// Fine-tunes `family`'s folder under each strategy: the last validation loss is
/// `transformers`' on the written folder, and `strata eval` of that folder says the same.
fn fine_tune(family: &str, runs: &[(&str, &[&str])]) {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, train, val) = setup(&py, dir.path(), family);
    let untrained = transformers_val_loss(&py, &folder, &val);
    for (name, extra) in runs {
        let (saved, metrics) = (dir.path().join(format!("{name}-out")), dir.path().join(format!("{name}.jsonl")));
        let files = [
            "--model-dir",
            s(&folder),
            "--token-file",
            s(&train),
            "--val-token-file",
            s(&val),
            "--save-model-dir",
            s(&saved),
            "--metrics",
            s(&metrics),
        ];
        let o = strata(&[&["train"][..], &RUN, &WINDOWS, &files, extra].concat());
        assert!(o.status.success(), "{family} {name}:\n{}", stderr(&o));
        let vals = val_losses(&metrics);
        assert_eq!(vals.iter().map(|v| v.0).collect::<Vec<_>>(), vec![2, 4], "{family} {name}: validation steps");
        let last = vals[1].1;
        let theirs = transformers_val_loss(&py, &saved, &val);
        eprintln!("{family} {name}: validation loss {last:.7}, transformers {theirs:.7}");
        assert!((last - theirs).abs() < 1e-5, "{family} {name}: validation loss {last}, transformers {theirs}");
        assert!((last - untrained).abs() > 1e-3, "{family} {name}: training changed nothing ({last})");
        let source = ["eval", "--model-dir", s(&saved), "--val-token-file", s(&val), "--json"];
        let o = strata(&[&source[..], &WINDOWS].concat());
        assert!(o.status.success(), "eval:\n{}", stderr(&o));
        let eval: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let evaluated = eval["val_loss"].as_f64().unwrap();
        assert!((evaluated - theirs).abs() < 1e-5, "{family} {name}: strata eval {evaluated}, transformers {theirs}");
        assert_eq!(eval["tokens"].as_i64(), Some(3 * 4 * 16));
        // Every layout takes the same rows a step (and draws the same dropout masks).
        let first = dir.path().join(format!("{}.jsonl", runs[0].0));
        common::assert_losses_follow(&first, &metrics, &format!("{family} {name}"), 1e-5);
    }
}

#[test]
fn gpt2_fine_tunes_alone_sharded_and_split() {
    fine_tune(
        "gpt2",
        &[
            ("one", &[]),
            ("fsdp", &["--nproc", "2", "--strategy", r#"["fsdp"]"#]),
            ("tensor", &["--nproc", "2", "--strategy", TENSOR]),
        ],
    );
}

#[test]
fn qwen2_fine_tunes_in_a_pipeline() {
    fine_tune("qwen2", &[("pp", &["--nproc", "2", "--accumulation", "2", "--strategy", PIPELINE])]);
}

/// Gemma 4's experts' block (beside the dense feed-forward on every layer, stacked on disk
/// under the layer) trains over two ranks as one process does with the same micro-batches:
/// its experts split over an expert group (alone, and sharded by fsdp), its attention split
/// over a tensor group (and under sequence parallel, each rank routing its part of the
/// tokens from the residual stream), in two pipeline stages, and with adapters on its
/// attention and its stacked experts (peft's `target_parameters` under the layer) split over
/// an expert group. Plain SGD, whose step is the gradient itself: a gradient off by any
/// factor shows, where Adam's normalised step would hide it (and amplifies rounding instead).
#[test]
fn gemma4_experts_train_split_as_one_process() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, train, _) = setup(&py, dir.path(), "gemma4-moe");
    let files = ["--model-dir", s(&folder), "--token-file", s(&train)];
    let flags = ["--ctx", "16", "--batch-size", "4", "--threads", "1", "--schedule", "constant"];
    let sgd = ["--optimizer", "sgd", "--lr", "0.05"];
    let one = common::train_run(dir.path(), "one", 6, &[&files, &flags, &sgd, &["--accumulation", "2"]]);
    for (name, strategy) in [
        ("experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("experts 2 with fsdp", r#"[["expert_parallel", {"size": 2}], "fsdp"]"#),
        ("tensor 2", TENSOR),
        ("sequence 2", TENSOR_AND_SEQUENCE),
        ("pipeline 2", PIPELINE),
    ] {
        let micro = if name.starts_with("experts") { "1" } else { "2" };
        let extra = ["--nproc", "2", "--accumulation", micro, "--strategy", strategy];
        let run = common::train_run(dir.path(), name, 6, &[&files, &flags, &sgd, &extra]);
        common::assert_follows(&one, &run, name, 1e-6, 1e-6);
    }
    let lora = r#"["lora", {"r": 2, "alpha": 4, "target_modules": ["q_proj"],
                 "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}]"#;
    let adapted = ["--accumulation", "2", "--strategy", &format!("[{lora}]")];
    let alone = common::train_run(dir.path(), "lora", 6, &[&files, &flags, &sgd, &adapted]);
    let split = ["--nproc", "2", "--strategy", &format!(r#"[["expert_parallel", {{"size": 2}}], {lora}]"#)];
    let run = common::train_run(dir.path(), "lora experts 2", 6, &[&files, &flags, &sgd, &split]);
    common::assert_follows(&alone, &run, "lora on the experts with expert parallel 2", 1e-6, 1e-6);
    let last = |run: &common::Run| common::reports(&run.1).pop().unwrap()["loss"].as_f64().unwrap();
    assert!(last(&alone) != last(&one), "the adapters train apart from the whole model");
}

/// Arcee's and Apertus's feed-forwards without a gate split their up projections over a
/// tensor group (xIELU's learned scales summing their partial gradients over it),
/// Granite-MoE's experts (stacked in its files) split over an expert group, and HunYuan-MoE's
/// renamed shared expert over a tensor group, and Llama 4's experts (their inputs scaled by
/// the routing weights before they cross to their ranks) over an expert group and its chunked
/// attention under sequence parallel, and Cohere's parallel block under sequence parallel
/// (its feed-forward entering the tensor group from the norm attention read), StarCoder2
/// under sequence parallel (its `c_fc` bias split, its `c_proj` and norm biases whole, its
/// dropout after the embeddings, of the scores and of each sub-layer's output drawing one
/// process's masks), Nemotron under tensor parallel, MiniMax-M2's experts (chosen with a
/// choice bias) and GLM-4.7-Flash's (a dense layer after a sparse one) over an expert group,
/// and MiniMax-M2 under tensor parallel and OLMo 2 under tensor and sequence parallel (query/key
/// norms over whole projections, their squares summed over the tensor ranks), and a Qwen3-VL-MoE
/// release's language model over an expert group, and Granite 4's hybrid (Mamba-2 mixers,
/// experts beside its `shared_mlp`) over an expert group and sharded, and LFM2 (short
/// convolutions, its names, a tied head) sharded and over two pipeline stages, LFM2-MoE's
/// experts (a choice bias, its own names) over an expert group, and
/// DeepSeek-V2's greedy softmax routing over an expert group, each training as one
/// process does (a LoRA of Llama 4's input-major expert stacks is refused). Plain SGD,
/// whose step is the gradient itself.
#[test]
fn newer_families_train_split_as_one_process() {
    let Some(py) = python() else { return };
    let mut previous: Option<(&str, tempfile::TempDir, PathBuf, PathBuf, common::Run)> = None;
    for (family, name, strategy) in [
        ("arcee", "tensor 2", TENSOR),
        ("apertus", "tensor 2", TENSOR),
        ("granite-moe", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("hunyuan-moe", "tensor 2", TENSOR),
        ("llama4", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("llama4", "sequence 2", TENSOR_AND_SEQUENCE),
        ("cohere", "sequence 2", TENSOR_AND_SEQUENCE),
        ("starcoder2", "sequence 2", TENSOR_AND_SEQUENCE),
        ("nemotron", "tensor 2", TENSOR),
        ("minimax-m2", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("minimax-m2", "tensor 2", TENSOR),
        ("olmo2", "sequence 2", TENSOR_AND_SEQUENCE),
        ("qwen3-vl-moe-release", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("glm4-moe-lite", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("granite4-hybrid", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("granite4-hybrid", "fsdp", r#"["fsdp"]"#),
        ("lfm2", "fsdp", r#"["fsdp"]"#),
        ("lfm2", "pipeline 2", PIPELINE),
        ("lfm2-moe", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("deepseek-v2", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("dots1", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("solar-open", "tensor 2", TENSOR),
        ("olmo-hybrid", "fsdp", r#"["fsdp"]"#),
        ("nemotron-h", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("nemotron-h", "pipeline 2", PIPELINE),
        ("falcon-h1", "fsdp", r#"["fsdp"]"#),
        ("jamba", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
        ("flex-olmo", "experts 2", r#"[["expert_parallel", {"size": 2}]]"#),
    ] {
        let flags = ["--ctx", "16", "--batch-size", "4", "--threads", "1", "--optimizer", "sgd", "--lr", "0.05"];
        // A family's layouts (listed together) follow one run of it alone.
        if previous.as_ref().is_none_or(|(last, ..)| *last != family) {
            let dir = tempfile::tempdir().unwrap();
            let (folder, train, _) = setup(&py, dir.path(), family);
            let files = ["--model-dir", s(&folder), "--token-file", s(&train)];
            let one = common::train_run(dir.path(), "one", 4, &[&files, &flags, &["--accumulation", "2"]]);
            previous = Some((family, dir, folder, train, one));
        }
        let Some((_, dir, folder, train, one)) = &previous else { unreachable!() };
        let files = ["--model-dir", s(folder), "--token-file", s(train)];
        // Expert and data parallel ranks read rows of their own; tensor ranks share them.
        let micro = if name.starts_with("experts") || name == "fsdp" { "1" } else { "2" };
        let extra = ["--nproc", "2", "--accumulation", micro, "--strategy", strategy];
        let run = common::train_run(dir.path(), name, 4, &[&files, &flags, &extra]);
        common::assert_follows(one, &run, &format!("{family} {name}"), 1e-6, 1e-6);
        // Llama 4's stacks are input-major, which peft adapts otherwise; Nemotron-H's experts
        // have no gate_up_proj.
        let stacked = match (family, name) {
            ("llama4", "experts 2") => Some("feed_forward.experts.gate_up_proj"),
            ("nemotron-h", "experts 2") => Some("experts.up_proj"),
            _ => None,
        };
        if let Some(target) = stacked {
            let lora = format!(r#"[["lora", {{"r": 2, "target_parameters": ["{target}"]}}]]"#);
            let o = strata(&[&["train"][..], &files, &flags, &["--steps", "1", "--strategy", &lora]].concat());
            assert!(!o.status.success());
            assert!(stderr(&o).contains("stacks the experts in another layout than peft's"), "{}", stderr(&o));
        }
    }
}

/// A mixture of experts (Qwen3-MoE: 16 experts, top 4, every other layer sparse) trains over
/// two ranks as one process does with the same micro-batches (the load-balancing loss is
/// each micro-batch's own): with fsdp, and with zero2 and recomputed blocks (the loss's
/// gradient reaches a recomputed layer), with tensor parallel attention (the experts whole on
/// each tensor rank; under sequence parallel each routes its part of the tokens and the loss
/// sums their routing), expert groups beside tensor groups. Each rank of an expert group
/// stores only its own experts, sharded by fsdp over the ranks storing the same ones (the
/// folder saved from them is whole, a checkpoint resumes at any expert size). Its
/// metrics carry the routing; the folder the fsdp run writes gives `transformers`'
/// validation loss. In two
/// pipeline stages (alone and beside expert groups) the routing sums travel forward with the
/// activations and the loss's gradient back with theirs.
#[test]
fn a_mixture_of_experts_trains_sharded_as_one_process() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, train, val) = setup(&py, dir.path(), "qwen3-moe");
    let files = ["--model-dir", s(&folder), "--token-file", s(&train)];
    let flags = ["--ctx", "16", "--batch-size", "4", "--lr", "0.01", "--threads", "1", "--schedule", "constant"];
    let one = common::train_run(dir.path(), "one", 6, &[&files, &flags, &["--accumulation", "2"]]);
    let routed = common::reports(&one.1).pop().unwrap()["experts"].clone();
    assert!(routed["aux_loss"].as_f64().unwrap() > 0.5, "{routed}");
    assert!(routed["max_expert_tokens"].as_i64() > routed["min_expert_tokens"].as_i64(), "{routed}");
    let saved = dir.path().join("fsdp-out");
    let experts: i64 = strata::io::read_safetensors(&folder.join("model.safetensors"))
        .unwrap()
        .iter()
        .filter(|(name, _)| name.contains(".mlp.experts."))
        .map(|(_, t)| t.numel() as i64)
        .sum();
    let whole = stored_param_bytes(&one);
    // Each rank of an expert group of `size` stores `1/size` of the routed experts' weights.
    let apart = |size: i64| whole - 4 * experts * (size - 1) / size;
    // (name, ranks, micro-batches each, strategy): every run takes 8 rows a step as `one` does.
    let runs = [
        ("fsdp", 2, 1, r#"["fsdp"]"#),
        ("zero2", 2, 1, r#"["zero2", ["checkpoint", ["LlamaBlock"]]]"#),
        ("experts 2", 2, 1, r#"[["expert_parallel", {"size": 2}]]"#),
        ("experts 2 with fsdp", 2, 1, r#"[["expert_parallel", {"size": 2}], "fsdp"]"#),
        (
            "experts 2 with zero2",
            2,
            1,
            r#"[["expert_parallel", {"size": 2}], "zero2", ["checkpoint", ["LlamaBlock"]]]"#,
        ),
        ("tensor 2", 2, 2, TENSOR),
        ("sequence 2", 2, 2, TENSOR_AND_SEQUENCE),
        ("pipeline 2", 2, 2, PIPELINE),
        (
            "experts 2 × pipeline 2",
            4,
            1,
            r#"[["parallel_mode", [[["pipeline", 2], ["expert", 2]], null]], "pipeline_parallel", "expert_parallel"]"#,
        ),
        (
            "experts 2 × tensor 2",
            4,
            1,
            r#"[["parallel_mode", [[["tensor", 2], ["expert", 2]], null]], "tensor_parallel", "expert_parallel"]"#,
        ),
    ];
    for (name, ranks, micro, strategy) in runs {
        let (ranks, micro) = (ranks.to_string(), micro.to_string());
        let extra =
            ["--nproc", &ranks, "--accumulation", &micro, "--strategy", strategy, "--save-model-dir", s(&saved)];
        let run = common::train_run(dir.path(), name, 6, &[&files, &flags, &extra]);
        common::assert_follows(&one, &run, name, 1e-5, 1e-5);
        let remote = common::reports(&run.1).pop().unwrap()["experts"]["remote_expert_tokens"].as_i64();
        assert_eq!(remote.is_some_and(|r| r > 0), name.starts_with("experts"), "{name}: tokens sent to other ranks");
        if name == "experts 2" || name.starts_with("experts 2 with") {
            assert_eq!(stored_param_bytes(&run), apart(2), "{name}: parameter bytes a rank stores");
        }
        if name == "experts 2" {
            let alone = ["--accumulation", "2"];
            let ways = [("expert parallel 2", &extra[..], &run), ("one process", &alone[..], &one)];
            assert_resumes(dir.path(), &[&files, &flags, &extra], &ways);
            let folder = strata::io::read_safetensors(&saved.join("model.safetensors")).unwrap();
            let saved_experts = folder.iter().filter(|(n, _)| n.contains(".mlp.experts.")).map(|(_, t)| t.numel());
            assert_eq!(saved_experts.sum::<usize>() as i64, experts, "{name}: every expert in the saved folder");
        }
    }
    // Four expert groups of 4 experts each, one row per rank.
    let four = common::train_run(dir.path(), "one-4", 6, &[&files, &flags, &["--accumulation", "4"]]);
    for (name, strategy) in [
        ("experts 4", r#"[["expert_parallel", {"size": 4}]]"#),
        ("experts 2 × data 2 with fsdp", r#"[["expert_parallel", {"size": 2}], "fsdp"]"#),
    ] {
        let split = ["--nproc", "4", "--strategy", strategy];
        let run = common::train_run(dir.path(), name, 6, &[&files, &flags, &split]);
        common::assert_follows(&four, &run, name, 1e-5, 1e-5);
        // fsdp over the two ranks storing the same experts: half of them each.
        let stored = if name == "experts 4" { apart(4) } else { apart(2) / 2 };
        assert_eq!(stored_param_bytes(&run), stored, "{name}: parameter bytes a rank stores");
        if name.ends_with("fsdp") {
            let alone = ["--accumulation", "4"];
            assert_resumes(dir.path(), &[&files, &flags, &split], &[("one process", &alone[..], &four)]);
        }
        assert!(common::reports(&run.1).pop().unwrap()["experts"]["remote_expert_tokens"].as_i64() > Some(0));
    }
    // Adapters on the attention and the stacked experts: a rank trains, stores and
    // checkpoints its own experts' factors (a checkpoint resumes in one process).
    let lora = r#"["lora", {"r": 2, "alpha": 4, "target_modules": ["q_proj"],
                 "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}]"#;
    let adapted = format!("[{lora}]");
    let one_process = ["--accumulation", "2", "--strategy", &adapted];
    let alone = common::train_run(dir.path(), "lora", 6, &[&files, &flags, &one_process]);
    let sharded = format!(r#"[["expert_parallel", {{"size": 2}}], "fsdp", {lora}]"#);
    let sharded =
        common::train_run(dir.path(), "lora fsdp", 6, &[&files, &flags, &["--nproc", "2", "--strategy", &sharded]]);
    common::assert_follows(&alone, &sharded, "lora with expert parallel 2 and fsdp", 1e-5, 1e-5);
    let split = format!(r#"[["expert_parallel", {{"size": 2}}], {lora}]"#);
    let split = ["--nproc", "2", "--strategy", &split];
    let run = common::train_run(dir.path(), "lora experts 2", 6, &[&files, &flags, &split]);
    common::assert_follows(&alone, &run, "lora with expert parallel 2", 1e-5, 1e-5);
    assert_resumes(dir.path(), &[&files, &flags, &split], &[("lora in one process", &one_process[..], &alone)]);
    // Each expert's factors (r = 2: `A` over the gate and up projections' input and the
    // down projection's, `B` over their outputs) are stored where its weights are.
    let expert_factors: i64 = strata::io::read_safetensors(&folder.join("model.safetensors"))
        .unwrap()
        .iter()
        .filter(|(name, _)| name.contains(".mlp.experts.") && name.ends_with(".gate_proj.weight"))
        .map(|(_, t)| match t.size()[..] {
            [width, dim] => 2 * (dim + 2 * width) + 2 * (width + dim),
            _ => panic!("an expert's gate is not a matrix"),
        })
        .sum();
    let apart = stored_param_bytes(&alone) - 4 * (experts + expert_factors) / 2;
    assert_eq!(stored_param_bytes(&run), apart, "lora with expert parallel 2: parameter bytes a rank stores");
    // Capacity is each rank's (of the tokens it routes), as one process's is per micro-batch.
    let routing = ["--expert-capacity", "0.75", "--router-z-loss", "0.01"];
    let capped = common::train_run(dir.path(), "capped", 6, &[&files, &flags, &routing, &["--accumulation", "2"]]);
    let split = ["--nproc", "2", "--strategy", r#"[["expert_parallel", {"size": 2}]]"#];
    let run = common::train_run(dir.path(), "capped experts 2", 6, &[&files, &flags, &routing, &split]);
    common::assert_follows(&capped, &run, "capacity with expert parallel 2", 1e-5, 1e-5);
    let routed = common::reports(&run.1).pop().unwrap()["experts"].clone();
    assert!(routed["dropped_expert_tokens"].as_i64() > Some(0) && routed["z_loss"].as_f64() > Some(1.0), "{routed}");
    let ours =
        strata(&[&["eval", "--model-dir", s(&saved), "--val-token-file", s(&val), "--json"][..], &WINDOWS].concat());
    assert!(ours.status.success(), "eval:\n{}", stderr(&ours));
    let evaluated = serde_json::from_slice::<serde_json::Value>(&ours.stdout).unwrap()["val_loss"].as_f64().unwrap();
    let theirs = transformers_val_loss(&py, &saved, &val);
    assert!((evaluated - theirs).abs() < 1e-5, "strata eval {evaluated}, transformers {theirs}");
}

/// The frontier families train over two ranks as one process does, with fsdp, over expert
/// groups of two and in two pipeline stages: DeepSeek-V3 (latent attention, routing with a
/// choice bias among groups, shared experts) also split by tensor and sequence parallel
/// (each rank expands its heads from the latent; the down projections' gradients are
/// summed over the tensor group), GLM-4.5, and gpt-oss (sinks and biased experts) also by
/// tensor parallel (the sinks split with their heads) and, alone, with its states offloaded
/// by the automatic policy (whose measuring pass trains through the load-balancing loss),
/// and Qwen3-Next (linear attention beside gated full attention), whose linear attention
/// refuses tensor parallelism in one line.
#[test]
fn frontier_families_train_sharded_split_and_staged_as_one_process() {
    let Some(py) = python() else { return };
    let experts = r#"[["expert_parallel", {"size": 2}]]"#;
    let offload = r#"[["offload", {"policy": "auto"}]]"#;
    // (name, ranks, micro-batches each, strategy): every run takes 8 rows a step.
    let common_layouts =
        [("fsdp", "2", "1", r#"["fsdp"]"#), ("experts 2", "2", "1", experts), ("pipeline 2", "2", "2", PIPELINE)];
    for (family, own) in [
        ("deepseek-v3", &[("sequence 2", "2", "2", TENSOR_AND_SEQUENCE)][..]),
        ("glm4-moe", &[][..]),
        ("gpt-oss", &[("tensor 2", "2", "2", TENSOR), ("offload auto", "1", "2", offload)][..]),
        ("qwen3-next", &[][..]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (folder, train, _) = setup(&py, dir.path(), family);
        let files = ["--model-dir", s(&folder), "--token-file", s(&train)];
        // AdamW's epsilon at 1e-6: experts and layers that take a token or two get
        // gradients near 1e-8, whose normalised steps would carry the split sums' rounding
        // into the weights at ~1e-4 (a tensor gradient left unsummed is refused at the
        // save instead, as the ranks' whole copies of a weight then differ).
        let flags = [
            "--ctx",
            "16",
            "--batch-size",
            "4",
            "--lr",
            "0.01",
            "--eps",
            "1e-6",
            "--threads",
            "1",
            "--schedule",
            "constant",
        ];
        // DeepSeek's choice biases move after each step by the loads of every rank's tokens.
        let moving: &[&str] = if family == "deepseek-v3" { &["--router-bias-rate", "0.01"] } else { &[] };
        let one = common::train_run(dir.path(), "one", 4, &[&files, &flags, moving, &["--accumulation", "2"]]);
        if family == "deepseek-v3" {
            let (before, after) = (choice_biases(&folder), choice_biases(&one.0));
            let steps: Vec<f64> = before.iter().zip(&after).map(|(b, a)| ((a - b) / 0.01).abs()).collect();
            assert!(steps.iter().all(|s| (s - s.round()).abs() < 1e-3 && *s < 4.5), "bias steps {steps:?}");
            assert!(steps.iter().any(|s| s.round() >= 1.0), "no choice bias moved");
        }
        for &(name, ranks, micro, strategy) in common_layouts.iter().chain(own) {
            let extra = ["--nproc", ranks, "--accumulation", micro, "--strategy", strategy];
            let run = common::train_run(dir.path(), name, 4, &[&files, &flags, moving, &extra]);
            // Experts computed for other ranks' rows group them otherwise: their gradients
            // differ by up to ~5e-5 of an SGD step (Qwen3-MoE's as well), which four AdamW
            // steps carry to ~1e-4 of Qwen3-Next's weights.
            let weights = if name.starts_with("experts") { 3e-4 } else { 1e-5 };
            common::assert_follows(&one, &run, &format!("{family} {name}"), 1e-5, weights);
        }
        if family == "qwen3-next" {
            let o = strata(
                &[&["train"][..], &files, &flags, &["--steps", "1", "--nproc", "2", "--strategy", TENSOR]].concat(),
            );
            assert!(!o.status.success());
            assert!(stderr(&o).contains("linear attention does not split over tensor ranks"), "{}", stderr(&o));
        }
    }
}

/// A run of `args` checkpointed at step 3 (each rank writing the experts it stores) and
/// resumed each of `ways` — (what, its flags, the uninterrupted run) — carries on to the
/// uninterrupted run's weights at step 6.
fn assert_resumes(dir: &Path, args: &[&[&str]], ways: &[(&str, &[&str], &common::Run)]) {
    let ckpt_dir = tempfile::tempdir_in(dir).unwrap();
    let ckpt = ["--save-checkpoint", s(ckpt_dir.path())];
    common::train_run(dir, "to step 3", 3, &[args, &[&ckpt[..]]].concat());
    let resume = ["--resume", s(ckpt_dir.path())];
    for &(how, flags, uninterrupted) in ways {
        let resumed = common::train_run(dir, how, 6, &[&args[..2], &[flags, &resume]].concat());
        let gap = common::global_gap(&uninterrupted.0, &resumed.0);
        assert!(gap < 1e-5, "resumed in {how}: weights differ by {gap:e}");
    }
}

/// Bytes of parameters rank 0 of `run` stores, as its last report's ledger counts them.
fn stored_param_bytes(run: &common::Run) -> i64 {
    let report = common::reports(&run.1).pop().unwrap();
    report["memory"]["device"]["by_category"]["params"].as_i64().unwrap()
}

/// Every choice bias's values, layer after layer, from a folder's or a run's weights.
fn choice_biases(weights: &Path) -> Vec<f64> {
    let files: Vec<std::path::PathBuf> = match weights.is_dir() {
        true => std::fs::read_dir(weights)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect(),
        false => vec![weights.to_path_buf()],
    };
    let mut biases = std::collections::BTreeMap::new();
    for file in files {
        let tensors = strata::io::read_safetensors(&file).unwrap();
        biases.extend(tensors.into_iter().filter(|(name, _)| name.ends_with("e_score_correction_bias")));
    }
    assert!(!biases.is_empty(), "no choice bias in {}", weights.display());
    biases.values().flat_map(|t| Vec::<f64>::try_from(&t.to_kind(tch::Kind::Double)).unwrap()).collect()
}

/// Routing that never reaches the experts of one rank (a folder whose routers send every
/// token to expert 0 or 1 of 4, frozen; rank 1 computes experts 2 and 3): 1,000 steps of
/// expert parallel 2 under fsdp finish — the idle rank joins every exchange — step for step
/// with one process, to its weights.
#[test]
fn expert_parallel_never_waits_on_a_rank_whose_experts_get_no_tokens() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, train, _) = setup(&py, dir.path(), "qwen3-moe-idle");
    let files = ["--model-dir", s(&folder), "--token-file", s(&train)];
    // The routers frozen: they take no gradient but rounding's, which AdamW would blow up.
    let flags = [
        "--ctx",
        "8",
        "--batch-size",
        "2",
        "--lr",
        "0.001",
        "--threads",
        "1",
        "--schedule",
        "constant",
        "--freeze",
        "mlp.gate",
    ];
    let strategy = r#"[["expert_parallel", {"size": 2}], "fsdp"]"#;
    let split = ["--nproc", "2", "--strategy", strategy];
    let steps = 1000;
    let one = common::train_run(dir.path(), "one", steps, &[&files, &flags, &["--accumulation", "2"]]);
    let long = common::train_run(dir.path(), "long", steps, &[&files, &flags, &split]);
    common::assert_follows(&one, &long, "an idle expert rank", 1e-5, 1e-5);
    let reports = common::reports(&long.1);
    assert_eq!(reports.len(), steps);
    // Rank 0 (whose report this is) sends nothing away: its tokens all go to experts 0 and 1.
    let routed = &reports[steps - 1]["experts"];
    assert_eq!(routed["min_expert_tokens"].as_i64(), Some(0), "{routed}");
    assert_eq!(routed["remote_expert_tokens"].as_i64(), Some(0), "{routed}");
}

/// 64 prompt-and-completion records in the folders' words (`w0` to `w89`): prompts of 2 to
/// 7 words, completions of 1 to 4, so that packed rows of 16 hold examples across the
/// pieces' borders.
fn word_examples(dir: &Path) -> PathBuf {
    let mut x: u64 = 7;
    let mut next = |n: u64| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) % n
    };
    let mut words = |count: u64| (0..count).map(|_| format!("w{}", next(90))).collect::<Vec<_>>().join(" ");
    let lines: Vec<String> = (0..64)
        .map(|i| {
            let (prompt, completion) = (words(2 + i % 6), words(1 + i % 4));
            serde_json::json!({"prompt": prompt, "completion": format!(" {completion}")}).to_string()
        })
        .collect();
    let path = dir.join("words.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

/// Context parallelism trains as one process does, ten AdamW steps, each loss within 1e-5
/// and the weights within 1e-5, on the attention kinds the families bring: Llama 3
/// (grouped-query heads; also the ring beside fsdp and the all-to-all beside tensor
/// parallel 2 on four ranks, the former holding the model states fsdp holds over four data
/// ranks, and packed prompt-and-completion rows), Mistral (a window of 4
/// in rows of 16, so that the ring's far blocks are all hidden), Gemma 2 (soft-capped scores
/// and windows), DeepSeek-V3 (latent attention: keys wider than values), Mistral 4 (its
/// queries scaled by each token's true position) and gpt-oss (a sink
/// per head, windows, experts): the ring (each rank an early and a late quarter of every
/// row) and the all-to-all (each rank half the heads of whole rows). Qwen3-Next's linear
/// attention is refused in one line.
#[test]
fn context_parallel_trains_the_attention_kinds_as_one_process() {
    let Some(py) = python() else { return };
    let ring = r#"[["context_parallel", {"size": 2}]]"#;
    let all_to_all = r#"[["context_parallel", {"size": 2, "kind": "all_to_all"}]]"#;
    let ring_fsdp = r#"[["context_parallel", {"size": 2}], "fsdp"]"#;
    let all_to_all_tensor = r#"[["parallel_mode", [[["tensor", 2], ["context", 2]], null]], "tensor_parallel",
        ["context_parallel", {"kind": "all_to_all"}]]"#;
    let flags = ["--ctx", "16", "--batch-size", "4", "--lr", "0.01", "--threads", "1", "--schedule", "constant"];
    for family in ["llama3", "mistral", "gemma2", "deepseek-v3", "mistral4", "gpt-oss", "qwen3-next"] {
        let dir = tempfile::tempdir().unwrap();
        let (folder, train, _) = setup(&py, dir.path(), family);
        let files = ["--model-dir", s(&folder), "--token-file", s(&train)];
        if family == "qwen3-next" {
            let split = ["--steps", "1", "--nproc", "2", "--strategy", ring];
            let o = strata(&[&["train"][..], &files, &flags, &split].concat());
            assert_fails_with(&o, "linear attention's state runs along the whole row");
            continue;
        }
        // Mistral 4's experts that take a token or two get gradients near 1e-8, whose
        // normalised steps would carry the ring's other order of sums into the weights:
        // AdamW's epsilon at 1e-6 keeps those steps small.
        let eps: &[&str] = if family == "mistral4" { &["--eps", "1e-6"] } else { &[] };
        let one = common::train_run(dir.path(), "one", 10, &[&files, &flags, eps]);
        let mut layouts = vec![("ring", "2", ring), ("all-to-all", "2", all_to_all)];
        if family == "llama3" {
            layouts.extend([
                ("fsdp", "4", r#"["fsdp"]"#),
                ("ring fsdp", "4", ring_fsdp),
                ("all-to-all tensor", "4", all_to_all_tensor),
            ]);
        }
        let mut state_bytes = std::collections::BTreeMap::new();
        for (name, ranks, strategy) in layouts {
            let split = ["--nproc", ranks, "--strategy", strategy];
            let run = common::train_run(dir.path(), name, 10, &[&files, &flags, eps, &split]);
            // DeepSeek's routing picks groups and experts by thresholds a summation order can
            // move across near a tie; its weights get five times the others' room (measured
            // 2.3e-5 under the ring on some CPUs, the others within 2.2e-6).
            let weights = if matches!(family, "deepseek-v3" | "mistral4") { 5e-5 } else { 1e-5 };
            common::assert_follows(&one, &run, &format!("{family} {name}"), 1e-5, weights);
            state_bytes.insert(name, common::reports(&run.1)[9]["model_state_peak_bytes"].as_u64().unwrap());
        }
        if family == "llama3" {
            // fsdp shards over the context ranks as over data ranks: 2 data × 2 context
            // ranks each hold what 4 data ranks each hold.
            assert_eq!(state_bytes["ring fsdp"], state_bytes["fsdp"], "{state_bytes:?}");
        }
        if family == "llama3" {
            let examples = word_examples(dir.path());
            let packed = ["--model-dir", s(&folder), "--data", s(&examples), "--pack", "true", "--max-length", "16"];
            let one = common::train_run(dir.path(), "packed-one", 10, &[&packed, &flags[2..]]);
            let split = ["--nproc", "2", "--strategy", ring];
            let run = common::train_run(dir.path(), "packed-ring", 10, &[&packed, &flags[2..], &split]);
            common::assert_follows(&one, &run, "llama3 packed ring", 1e-5, 1e-5);
        }
    }
}

/// A folder whose tokenizer configuration names no end token (GPT-2's) ends each
/// completion with the token of its config's `eos_token_id` where the tokenizer holds it as
/// a special token, as one naming it does; an id the tokenizer holds as a plain word ends
/// nothing: one learned token fewer per example.
#[test]
fn completions_end_with_the_folder_s_special_end_token() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, _, _) = setup(&py, dir.path(), "llama3");
    let examples = word_examples(dir.path());
    let edit = |name: &str, change: &dyn Fn(&mut serde_json::Value)| {
        let path = folder.join(name);
        let mut value: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        change(&mut value);
        std::fs::write(&path, value.to_string()).unwrap();
    };
    edit("tokenizer.json", &|t| {
        let end = serde_json::json!({"id": 90, "content": "<eos>", "single_word": false, "lstrip": false,
                                     "rstrip": false, "normalized": false, "special": true});
        t["added_tokens"].as_array_mut().unwrap().push(end);
    });
    let learned = |name: &str| {
        let flags = ["--model-dir", s(&folder), "--data", s(&examples), "--batch-size", "4", "--max-length", "16"];
        let run = common::train_run(dir.path(), name, 1, &[&flags]);
        common::reports(&run.1)[0]["supervised_tokens"].as_u64().unwrap()
    };
    edit("config.json", &|c| c["eos_token_id"] = serde_json::json!(90));
    let by_id = learned("by-id");
    std::fs::write(folder.join("tokenizer_config.json"), r#"{"eos_token": "<eos>"}"#).unwrap();
    assert_eq!(learned("named"), by_id, "the end token named, or found by its id");
    std::fs::remove_file(folder.join("tokenizer_config.json")).unwrap();
    edit("config.json", &|c| c["eos_token_id"] = serde_json::json!(2));
    assert_eq!(learned("a-word"), by_id - 4, "a plain word's id ends nothing");
}

/// Under amp_native a ring attends in bf16 as one process does over whole rows, though
/// Qwen3's query and key norms hand it fp32 queries and keys beside bf16 values: its losses
/// follow one process's within bf16's rounding, and its profile shows keys and values passed
/// in bf16 (half the bytes of their gradients' passes, which stay fp32).
#[test]
fn a_context_ring_under_amp_attends_in_bf16_as_one_process_does() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, train, _) = setup(&py, dir.path(), "qwen3");
    let amp = r#"["amp_native", {"dtype": "bf16"}]"#;
    let flags = ["--model-dir", s(&folder), "--token-file", s(&train), "--ctx", "16", "--batch-size", "4"];
    let run = ["--lr", "0.002", "--threads", "1", "--schedule", "constant"];
    let one = common::train_run(dir.path(), "one", 4, &[&flags, &run, &["--strategy", &format!("[{amp}]")]]);
    let profile = dir.path().join("profile");
    let ring = format!(r#"[["context_parallel", {{"size": 2}}], {amp}]"#);
    let split = ["--nproc", "2", "--strategy", &ring, "--profile", s(&profile)];
    let two = common::train_run(dir.path(), "ring", 4, &[&flags, &run, &split]);
    // bf16 keeps 8 significant bits; blockwise merges round apart from whole rows.
    common::assert_follows(&one, &two, "qwen3 amp ring", 1e-2, 2e-2);
    let profiles = strata::profile::read_dir(&profile).unwrap();
    // A ring's passes are the run's only all-to-alls.
    let sizes: std::collections::BTreeSet<u64> = profiles[0]
        .records
        .iter()
        .filter_map(|r| match r {
            strata::profile::Record::Collective { op, bytes, .. } if op == "all_to_all" => Some(*bytes),
            _ => None,
        })
        .collect();
    let gradients = *sizes.last().unwrap();
    assert_eq!(sizes, [gradients / 2, gradients].into(), "keys and values against their gradients' passes");
}

const PIPELINE: &str = r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {"schedule": "1f1b"}]]"#;

/// A family trained alone, over two ranks with fsdp, split by tensor parallel with and
/// without sequence parallel (where its heads allow) and in two pipeline stages: every run
/// follows the first step for step (Phi-3's folder drops each sub-layer's output) and ends
/// at `transformers`' validation loss of the folder it writes.
fn fine_tunes_under_every_layout(family: &str, tensor: bool) {
    let mut runs: Vec<(&str, &[&str])> = vec![
        ("one", &[]),
        ("fsdp", &["--nproc", "2", "--strategy", r#"["fsdp"]"#]),
        ("pp", &["--nproc", "2", "--accumulation", "2", "--strategy", PIPELINE]),
    ];
    if tensor {
        runs.push(("tensor", &["--nproc", "2", "--strategy", TENSOR]));
        runs.push(("sequence", &["--nproc", "2", "--strategy", TENSOR_AND_SEQUENCE]));
    }
    fine_tune(family, &runs);
}

#[test]
fn llama3_fine_tunes_under_every_layout() {
    fine_tunes_under_every_layout("llama3", true);
}

#[test]
fn qwen3_fine_tunes_under_every_layout() {
    fine_tunes_under_every_layout("qwen3", true);
}

#[test]
fn mistral_fine_tunes_under_every_layout() {
    fine_tunes_under_every_layout("mistral", true);
}

#[test]
fn gemma2_fine_tunes_under_every_layout() {
    fine_tunes_under_every_layout("gemma2", true);
}

#[test]
fn phi3_fine_tunes_under_every_layout() {
    fine_tunes_under_every_layout("phi3", true);
}

/// Gemma 3's single key/value head cannot split over two tensor ranks: refused in one line
/// that says so, before any step.
#[test]
fn gemma3_fine_tunes_and_refuses_a_split_of_its_one_key_value_head() {
    fine_tunes_under_every_layout("gemma3", false);
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, train, _) = setup(&py, dir.path(), "gemma3");
    let o = strata(&[
        "train",
        "--model-dir",
        s(&folder),
        "--token-file",
        s(&train),
        "--ctx",
        "16",
        "--steps",
        "1",
        "--nproc",
        "2",
        "--strategy",
        TENSOR,
    ]);
    assert_fails_with(&o, "key/value heads");
}

/// Generation from the command line: text in, text out, and it ends at the folder's end
/// token.
#[test]
fn generate_stops_at_the_end_token() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, ..) = setup(&py, dir.path(), "llama");
    let run_with = |extra: &[&str]| {
        let o = strata(&[&["generate", "--model-dir", s(&folder), "--prompt", "w7 w31 w3"][..], extra].concat());
        assert!(o.status.success(), "generate {extra:?}:\n{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let run = |extra: &[&str]| run_with(&[extra, &["--max-new-tokens", "12"]].concat());
    let ids: serde_json::Value = serde_json::from_str(&run(&["--ids"])).unwrap();
    assert_eq!(ids["prompt"], serde_json::json!([7, 31, 3]));
    let new: Vec<i64> = ids["new"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    // The folder's end token is 2; make the fourth token produced the end instead.
    assert!(!new[..4].contains(&2), "the random model ends early: {new:?}");
    let text = run(&[]);
    assert!(text.starts_with("w7 w31 w3 "), "{text}");
    assert_eq!(text.split_whitespace().count(), 3 + new.len(), "{text}");
    // The end tokens are generation_config.json's where it names them, as generate reads
    // them: config.json's alone no longer stop it.
    let edit = |file: &str, key: &str, value: serde_json::Value| {
        let path = folder.join(file);
        let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config[key] = value;
        std::fs::write(&path, config.to_string()).unwrap();
    };
    let end = new[3];
    edit("config.json", "eos_token_id", serde_json::json!([end]));
    let unstopped: serde_json::Value = serde_json::from_str(&run(&["--ids"])).unwrap();
    assert_eq!(unstopped["new"], serde_json::json!(new), "generation_config.json's end token 2 rules");
    edit("generation_config.json", "eos_token_id", serde_json::json!([2, end]));
    let stopped: serde_json::Value = serde_json::from_str(&run(&["--ids"])).unwrap();
    let first = new.iter().position(|&t| t == end).unwrap();
    assert_eq!(stopped["new"], serde_json::json!(new[..=first]), "generation ends at the end token, which it keeps");
    // Its decoding settings are the defaults flags replace: sampling here, as flags say
    // (with no end token, so each text runs its length).
    edit("generation_config.json", "eos_token_id", serde_json::Value::Null);
    edit("config.json", "eos_token_id", serde_json::Value::Null);
    for (key, value) in [
        ("do_sample", serde_json::json!(true)),
        ("temperature", serde_json::json!(0.8)),
        ("top_k", serde_json::json!(6)),
        ("repetition_penalty", serde_json::json!(1.3)),
        ("max_new_tokens", serde_json::json!(9)),
    ] {
        edit("generation_config.json", key, value);
    }
    let by_folder = run_with(&["--ids", "--seed", "4"]);
    let by_flags = run_with(&[
        "--ids",
        "--seed",
        "4",
        "--temperature",
        "0.8",
        "--top-k",
        "6",
        "--repetition-penalty",
        "1.3",
        "--max-new-tokens",
        "9",
    ]);
    assert_eq!(by_folder, by_flags);
    let greedy: serde_json::Value = serde_json::from_str(&run_with(&["--ids", "--temperature", "0"])).unwrap();
    let sampled: serde_json::Value = serde_json::from_str(&by_folder).unwrap();
    assert_eq!(sampled["new"].as_array().unwrap().len(), 9, "{sampled}");
    assert_ne!(greedy["new"], sampled["new"], "the folder's sampling changes nothing here");
    // A tokenizer that opens a text with its begin token opens the prompt with it.
    let tokenizer = folder.join("tokenizer.json");
    let mut t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tokenizer).unwrap()).unwrap();
    t["post_processor"] = serde_json::json!({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "w1", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"w1": {"id": "w1", "ids": [1], "tokens": ["w1"]}}});
    std::fs::write(&tokenizer, t.to_string()).unwrap();
    let opened: serde_json::Value = serde_json::from_str(&run(&["--ids"])).unwrap();
    assert_eq!(opened["prompt"], serde_json::json!([1, 7, 31, 3]));
    let text = run(&[]);
    assert!(text.starts_with("w7 w31 w3 "), "the begin token is printed: {text}");
}

#[test]
fn bad_folders_are_refused_in_one_line() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, train, _) = setup(&py, dir.path(), "llama");
    let edit = |name: &str, change: &dyn Fn(&Path)| {
        let copy = dir.path().join(name);
        std::fs::create_dir_all(&copy).unwrap();
        for entry in std::fs::read_dir(&folder).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
        }
        change(&copy);
        copy
    };
    let set_config = |key: &'static str, value: serde_json::Value| {
        move |dir: &Path| {
            let path = dir.join("config.json");
            let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            c[key] = value.clone();
            std::fs::write(&path, c.to_string()).unwrap();
        }
    };
    let sharded = dir.path().join("sharded");
    reference(&py, &["make", "--family", "qwen2", "--out", s(&sharded), "--shard-bytes", "20000"]);
    std::fs::remove_file(sharded.join("model-00002-of-00005.safetensors")).unwrap();
    let cases: Vec<(PathBuf, &str)> = vec![
        (sharded, "missing shard model-00002-of-00005.safetensors"),
        (
            edit(
                "scaled",
                &set_config("rope_parameters", serde_json::json!({"rope_type": "axial", "rope_theta": 1e4})),
            ),
            "rope_parameters type \"axial\" is not supported",
        ),
        // LLaMA's feed-forward biases are read, and a folder whose weights lack them is refused.
        (
            edit("mlp-bias", &set_config("mlp_bias", serde_json::json!(true))),
            "missing parameter \"model.layers.0.mlp.gate_proj.bias\"",
        ),
        (
            edit("mistral-mlp-bias", &|dir: &Path| {
                set_config("model_type", serde_json::json!("mistral"))(dir);
                set_config("mlp_bias", serde_json::json!(true))(dir);
            }),
            "mlp_bias = true is not supported",
        ),
        (
            edit("bert", &set_config("model_type", serde_json::json!("bert"))),
            "architecture LlamaForCausalLM has no task Strata runs (BertForSequenceClassification, BertForMaskedLM)",
        ),
        (
            edit("t5", &set_config("model_type", serde_json::json!("t5"))),
            "architecture LlamaForCausalLM has no task Strata runs (T5ForConditionalGeneration)",
        ),
        (edit("gemma", &set_config("model_type", serde_json::json!("gemma"))), "model_type \"gemma\" is not a family"),
        (
            edit(
                "llama3-incomplete",
                &set_config("rope_parameters", serde_json::json!({"rope_type": "llama3", "factor": 8.0})),
            ),
            "rope_parameters.low_freq_factor is missing",
        ),
        (edit("small-vocab", &set_config("vocab_size", serde_json::json!(64))), "the tokenizer has 90 tokens"),
        (
            edit("truncated", &|d: &Path| {
                let path = d.join("model.safetensors");
                let bytes = std::fs::read(&path).unwrap();
                std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
            }),
            "not a valid safetensors file",
        ),
    ];
    for (bad, expected) in cases {
        // The tokenizer only matters with text: validation text makes it load.
        let text = dir.path().join("val.txt");
        std::fs::write(&text, "w1 w2 w3 ".repeat(200)).unwrap();
        let o = strata(&[
            "train",
            "--model-dir",
            s(&bad),
            "--token-file",
            s(&train),
            "--val-data",
            s(&text),
            "--ctx",
            "16",
            "--steps",
            "1",
        ]);
        assert_fails_with(&o, expected);
        assert_eq!(stderr(&o).trim().lines().count(), 1, "{expected}: {}", stderr(&o));
    }
    let o = strata(&["train", "--model-dir", s(&folder), "--token-file", s(&train), "--layers", "3"]);
    assert_fails_with(&o, "--layers is set by the model folder's config.json");
    let o = strata(&["train", "--model-dir", s(&folder), "--token-file", s(&train), "--ctx", "65"]);
    assert_fails_with(&o, "--ctx 65 is longer than the model folder's context of 64");
}

/// A checkpoint of a built-in model records the model: `strata eval --resume` gives the
/// run's last validation loss and `strata generate --resume` continues a prompt, no flags.
#[test]
fn checkpoints_evaluate_and_generate_without_model_flags() {
    let dir = tempfile::tempdir().unwrap();
    let val = dir.path().join("val.txt");
    std::fs::write(&val, "to be or not to be, that is the question. ".repeat(40)).unwrap();
    let (ckpt, metrics) = (dir.path().join("ckpt"), dir.path().join("m.jsonl"));
    let model = ["--model", "llama", "--layers", "1", "--dim", "32", "--kv-heads", "2", "--ctx", "16"];
    let files = ["--val-data", s(&val), "--save-checkpoint", s(&ckpt), "--metrics", s(&metrics), "--steps", "3"];
    let o = strata(&[&["train"][..], &model, &files, &["--batch-size", "4", "--eval-batches", "2"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let trained = val_losses(&metrics);
    assert_eq!(trained.len(), 1, "one validation, after the last step");
    let o = strata(&["eval", "--resume", s(&ckpt), "--val-data", s(&val), "--ctx", "16", "--batch-size", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let line = String::from_utf8_lossy(&o.stdout).to_string();
    // Without --eval-batches every whole batch: 1720 bytes hold 107 windows of 16 + 1, 26
    // batches of 4; the run read the first 2.
    assert!(line.contains("(1664 tokens in 26 batches)"), "{line}");
    let o = strata(&[
        "eval",
        "--resume",
        s(&ckpt),
        "--val-data",
        s(&val),
        "--ctx",
        "16",
        "--batch-size",
        "4",
        "--eval-batches",
        "2",
        "--json",
    ]);
    let eval: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let evaluated = eval["val_loss"].as_f64().unwrap();
    assert!((evaluated - trained[0].1).abs() < 1e-6, "eval {evaluated}, the run's validation {}", trained[0].1);
    let o = strata(&["generate", "--resume", s(&ckpt), "--prompt", "to be", "--max-new-tokens", "8", "--ids"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ids: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ids["new"].as_array().unwrap().len(), 8);
    let o = strata(&["generate", "--resume", s(&ckpt), "--prompt", "x", "--top-k", "5"]);
    assert_fails_with(&o, "--top-k, --top-p and --min-p shape sampling");
}

/// A model of a vocabulary smaller than the byte tokenizer's (trained on a token file) is
/// refused text without its own tokenizer, in one line; its token files evaluate as before.
#[test]
fn text_needs_a_tokenizer_the_vocabulary_holds() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.bin");
    strata::data::TokenData::new((0..2000).map(|i| (i * 7 % 60) as u32).collect(), "counting")
        .write_u16_file(&tokens)
        .unwrap();
    let ckpt = dir.path().join("ckpt");
    let model = ["--model", "gpt", "--layers", "1", "--dim", "16", "--ctx", "16", "--batch-size", "4"];
    let o = strata(
        &[&["train"][..], &model, &["--token-file", s(&tokens), "--steps", "1", "--save-checkpoint", s(&ckpt)]]
            .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = strata(&["generate", "--resume", s(&ckpt), "--prompt", "to be", "--max-new-tokens", "2"]);
    assert_fails_with(&o, "the tokenizer has 256 tokens, the model's vocabulary 60");
    let o = strata(&["eval", "--resume", s(&ckpt), "--val-token-file", s(&tokens), "--ctx", "16", "--batch-size", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

const LORA: &str = r#"["lora", {"r": 4, "alpha": 8, "lora_dropout": 0.1,
    "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}]"#;

/// A LoRA run of a folder (its adapters' inputs dropped at 0.1) over two ranks with fsdp,
/// split by tensor parallel (row-split layers' adapters drop their pieces of the whole
/// input's mask), with its states offloaded to the host and in two pipeline stages follows
/// the one-process run: every step's loss and the adapters it writes; the merged folder it
/// writes has `transformers`' validation loss (nothing is dropped in validation); and a run
/// started from its adapter folder (the lora method read from the folder, the learning rate
/// 0) validates where it ended. Without the dropout the adapters end elsewhere; beside
/// sequence parallel it is refused.
#[test]
fn lora_runs_alone_sharded_split_offloaded_and_pipelined_alike() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (folder, train, val) = setup(&py, dir.path(), "llama3");
    let runs: [(&str, String, &[&str]); 5] = [
        ("one", format!("[{LORA}]"), &[]),
        ("fsdp", format!(r#"["fsdp", {LORA}]"#), &["--nproc", "2"]),
        (
            "tensor",
            format!(r#"[["parallel_mode", [[["tensor", 2]], null]], "tensor_parallel", {LORA}]"#),
            &["--nproc", "2"],
        ),
        (
            "offload",
            format!(r#"[["offload", {{"params": "cpu", "optimizer": "cpu", "policy": "static"}}], {LORA}]"#),
            &[],
        ),
        (
            "pp",
            format!(r#"[["parallel_mode", [[["pipeline", 2]], null]], "pipeline_parallel", {LORA}]"#),
            &["--nproc", "2"],
        ),
    ];
    let out = |name: &str, what: &str| dir.path().join(format!("{name}-{what}"));
    let file = |name: &str| out(name, "adapter").join("adapter_model.safetensors");
    let data = ["--model-dir", s(&folder), "--token-file", s(&train), "--val-token-file", s(&val)];
    for (name, strategy, extra) in &runs {
        let (adapter, merged, metrics) = (out(name, "adapter"), out(name, "merged"), out(name, "metrics.jsonl"));
        let files = [
            "--accumulation",
            "2",
            "--strategy",
            strategy,
            "--save-adapter-dir",
            s(&adapter),
            "--save-model-dir",
            s(&merged),
            "--metrics",
            s(&metrics),
        ];
        let o = strata(&[&["train"][..], &RUN, &WINDOWS, &data, &files, extra].concat());
        assert!(o.status.success(), "lora {name}:\n{}", stderr(&o));
        let last = val_losses(&metrics)[1].1;
        let theirs = transformers_val_loss(&py, &merged, &val);
        assert!((last - theirs).abs() < 1e-5, "lora {name}: validation loss {last}, transformers {theirs}");
        if *name == "one" {
            continue;
        }
        let (one, this) = (common::losses(&out("one", "metrics.jsonl")), common::losses(&metrics));
        for ((step, a), (_, b)) in one.iter().zip(&this) {
            assert!(((a - b) / a).abs() < 1e-5, "lora {name}: step {step} loss {b} against {a}");
        }
        let gap = common::global_gap(&file("one"), &file(name));
        eprintln!("lora {name}: adapters differ from one process's by {gap:.2e}");
        assert!(gap < 1e-5, "lora {name}: adapters differ by {gap:e}");
    }
    let plain = LORA.replace(r#""lora_dropout": 0.1"#, r#""lora_dropout": 0.0"#);
    let undropped = ["--accumulation", "2", "--strategy", &format!("[{plain}]"), "--save-adapter-dir"];
    let o = strata(&[&["train"][..], &RUN, &WINDOWS, &data, &undropped, &[s(&out("undropped", "adapter"))]].concat());
    assert!(o.status.success(), "lora without dropout:\n{}", stderr(&o));
    let gap = common::global_gap(&file("one"), &file("undropped"));
    assert!(gap > 1e-4, "adapters trained with and without dropout differ by {gap:e}");
    let sequence = format!("{}, {LORA}]", TENSOR_AND_SEQUENCE.strip_suffix(']').unwrap());
    let o = strata(&[&["train"][..], &data, &["--steps", "1", "--nproc", "2", "--strategy", &sequence]].concat());
    assert_fails_with(&o, "lora: dropout beside sequence_parallel or context_parallel is not supported");
    let (metrics, adapter) = (out("again", "metrics.jsonl"), out("one", "adapter"));
    let again =
        ["--init-adapter", s(&adapter), "--steps", "1", "--eval-every", "1", "--lr", "0", "--metrics", s(&metrics)];
    let o = strata(&[&["train"][..], &WINDOWS, &data, &again].concat());
    assert!(o.status.success(), "lora from the adapter folder:\n{}", stderr(&o));
    let (resumed, ended) = (val_losses(&metrics)[0].1, val_losses(&out("one", "metrics.jsonl"))[1].1);
    assert!(
        (resumed - ended).abs() < 1e-6,
        "from the adapter folder: validation loss {resumed}, the run ended at {ended}"
    );

    // Stopped after two steps and resumed from its checkpoint, the run ends with the
    // adapters of the run that went straight through.
    let (ckpt, adapter) = (out("halves", "ckpt"), out("halves", "adapter"));
    let strategy = format!("[{LORA}]");
    for steps in ["2", "4"] {
        let halves = [
            "--accumulation",
            "2",
            "--strategy",
            &strategy,
            "--steps",
            steps,
            "--lr",
            "0.01",
            "--threads",
            "1",
            "--schedule",
            "constant",
            "--save-checkpoint",
            s(&ckpt),
            "--resume",
            "auto",
            "--save-adapter-dir",
            s(&adapter),
        ];
        let o = strata(&[&["train"][..], &WINDOWS, &data, &halves].concat());
        assert!(o.status.success(), "lora to step {steps}:\n{}", stderr(&o));
    }
    let file = |dir: &Path| dir.join("adapter_model.safetensors");
    let gap = common::global_gap(&file(&out("one", "adapter")), &file(&adapter));
    assert_eq!(gap, 0.0, "the resumed LoRA run's adapters differ by {gap:e}");

    // Its checkpoint holds the adapters and their optimizer state, not the base the folder
    // gives: merged, it is the adapters alone; generating from it needs the folder beside it.
    let merged = out("halves", "merged.safetensors");
    let o = strata(&["ckpt", "merge", s(&ckpt), s(&merged)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let names: Vec<String> = strata::io::read_safetensors(&merged).unwrap().into_keys().collect();
    assert!(!names.is_empty() && names.iter().all(|n| n.contains(".lora_")), "the merged checkpoint holds {names:?}");
    let ask = ["generate", "--prompt", "to be", "--max-new-tokens", "6", "--ids"];
    let o = strata(&[&ask[..], &["--resume", s(&ckpt)]].concat());
    assert_fails_with(&o, "not the frozen base: give the base with --model-dir DIR");
    let from_checkpoint = strata(&[&ask[..], &["--resume", s(&ckpt), "--model-dir", s(&folder)]].concat());
    let from_merged = strata(&[&ask[..], &["--model-dir", s(&out("one", "merged"))]].concat());
    assert!(from_checkpoint.status.success(), "{}", stderr(&from_checkpoint));
    assert_eq!(
        from_checkpoint.stdout, from_merged.stdout,
        "the checkpoint beside its base answers as the merged model"
    );
    let o = strata(&["train", "--token-file", s(&train), "--ctx", "16", "--batch-size", "4", "--resume", s(&ckpt)]);
    assert_fails_with(&o, "not the frozen base it started from");
    // Beside another base of the same shape (the merged folder), it is refused as well: by
    // generate, eval and a resumed run.
    let other = out("one", "merged");
    let another = ["--resume", s(&ckpt), "--model-dir", s(&other)];
    let o = strata(&[&ask[..], &another].concat());
    assert_fails_with(&o, "trained on the base in");
    let o =
        strata(&[&["eval", "--val-token-file", s(&val), "--ctx", "16", "--batch-size", "4"][..], &another].concat());
    assert_fails_with(&o, "trained on the base in");
    let resumed = ["train", "--token-file", s(&train), "--strategy", &strategy, "--steps", "5", "--accumulation", "2"];
    let o = strata(&[&resumed[..], &WINDOWS[..4], &another].concat());
    assert_fails_with(&o, "trained on the base in");

    // Saved by fsdp over two ranks (each rank its shard of the adapters) and resumed by one
    // process, the run ends where the one-process run does.
    let (ckpt, adapter) = (out("fsdp-then-one", "ckpt"), out("fsdp-then-one", "adapter"));
    let fsdp = format!(r#"["fsdp", {LORA}]"#);
    for (steps, strategy, ranks) in [("2", &fsdp, "2"), ("4", &strategy, "1")] {
        let halves = [
            ["--accumulation", "2", "--strategy", strategy, "--steps", steps, "--nproc", ranks].as_slice(),
            &["--lr", "0.01", "--threads", "1", "--schedule", "constant", "--resume", "auto"],
            &["--save-checkpoint", s(&ckpt), "--save-adapter-dir", s(&adapter)],
        ]
        .concat();
        let o = strata(&[&["train"][..], &WINDOWS, &data, &halves].concat());
        assert!(o.status.success(), "lora to step {steps} on {ranks} ranks:\n{}", stderr(&o));
    }
    let gap = common::global_gap(&file(&out("one", "adapter")), &file(&adapter));
    assert!(gap < 1e-5, "the LoRA run resumed from fsdp's checkpoint: adapters differ by {gap:e}");

    let bad = r#"[["lora", {"target_modules": ["q_proj", "qkv"]}]]"#;
    let o = strata(&["train", "--model-dir", s(&folder), "--token-file", s(&train), "--strategy", bad]);
    assert_fails_with(&o, "target_modules \"qkv\" names no linear layer of this model");
}

/// Labeled reviews over the BERT folder's words, positive where "good" outnumbers "bad";
/// as JSON Lines, or CSV where `csv`.
pub(crate) fn reviews(count: usize, seed: u64, csv: bool) -> String {
    let mut state = seed;
    let mut draw = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let words = ["good", "bad", "movie", "plot", "story", "the", "was"];
    let rows = (0..count).map(|_| {
        let picked: Vec<&str> = (0..3 + draw(5)).map(|_| words[draw(words.len() as u64) as usize]).collect();
        let count = |w: &str| picked.iter().filter(|p| **p == w).count();
        (picked.join(" "), if count("good") > count("bad") { "positive" } else { "negative" })
    });
    if csv {
        std::iter::once("text,label\n".to_string()).chain(rows.map(|(t, l)| format!("{t},{l}\n"))).collect()
    } else {
        rows.map(|(t, l)| format!("{}\n", serde_json::json!({"text": t, "label": l}))).collect()
    }
}

/// `strata train` on a BERT classifier's folder reads labeled records (JSON Lines or CSV)
/// through the folder's tokenizer and label names, and its validation loss falls; a label
/// the folder does not name, or data that is not records, is refused in one line.
#[test]
fn a_bert_classifier_folder_trains_on_labeled_records() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("bert");
    reference(&py, &["make", "--family", "bert-classifier", "--out", s(&folder)]);
    // The folder's labels are negative, neutral and positive.
    let (train, val) = (dir.path().join("train.csv"), dir.path().join("val.jsonl"));
    std::fs::write(&train, reviews(400, 1, true)).unwrap();
    std::fs::write(&val, reviews(48, 2, false)).unwrap();
    let (metrics, trained) = (dir.path().join("metrics.jsonl"), dir.path().join("trained"));
    let base = ["train", "--model-dir", s(&folder), "--ctx", "16", "--batch-size", "16", "--threads", "1"];
    let run = [
        &base[..],
        &["--data", s(&train), "--val-data", s(&val), "--eval-batches", "3", "--steps", "60", "--eval-every", "30"],
        &["--lr", "0.002", "--metrics", s(&metrics), "--save-model-dir", s(&trained)],
    ]
    .concat();
    let o = strata(&run);
    assert!(o.status.success(), "{}", stderr(&o));
    let losses = val_losses(&metrics);
    eprintln!("validation losses {losses:?}");
    assert_eq!(losses.len(), 2);
    assert!(losses[1].1 < losses[0].1 * 0.8, "the validation loss falls: {losses:?}");
    // `strata eval` of the written folder: the same loss on the same texts, and the
    // classifier's accuracy and F1, well above chance (a third) after training.
    let o = strata(&["eval", "--model-dir", s(&trained), "--val-data", s(&val), "--ctx", "16", "--json"]);
    assert!(o.status.success(), "eval:\n{}", stderr(&o));
    let eval: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    eprintln!("eval {eval}");
    assert!((eval["loss"].as_f64().unwrap() - losses[1].1).abs() < 1e-5, "{eval} against {losses:?}");
    assert_eq!(eval["texts"].as_u64(), Some(48));
    assert!(eval["accuracy"].as_f64().unwrap() > 0.6 && eval["macro_f1"].as_f64().unwrap() > 0.5, "{eval}");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"good movie\", \"label\": \"great\"}\n").unwrap();
    assert_fails_with(
        &strata(&[&base[..], &["--data", s(&bad), "--steps", "1"]].concat()),
        "bad.jsonl:1: label \"great\" is not one of the model's labels (negative, neutral, positive)",
    );
    assert_fails_with(&strata(&[&base[..], &["--steps", "1"]].concat()), "a classifier trains on labeled records");
}

/// PatrickStar's BERT example in small: a BERT classifier trained under a PatrickStar
/// configuration (hybrid Adam, the embedding on the host) takes the same steps as plain
/// AdamW, with the embedding unit's parameters, gradients and Adam states — and only
/// them — on the host.
#[test]
fn a_bert_classifier_trains_under_patrickstars_configuration_with_its_embedding_on_the_host() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("bert");
    reference(&py, &["make", "--family", "bert-classifier", "--out", s(&folder)]);
    let (data, config) = (dir.path().join("train.jsonl"), dir.path().join("patrickstar.json"));
    std::fs::write(&data, reviews(64, 3, false)).unwrap();
    std::fs::write(
        &config,
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01, "use_hybrid_adam": true}},
            "default_chunk_size": 1048576, "use_cpu_embedding": true}"#,
    )
    .unwrap();
    let run = |name: &str, flags: &[&str]| {
        let metrics = dir.path().join(format!("{name}.jsonl"));
        let base = ["train", "--model-dir", s(&folder), "--data", s(&data), "--ctx", "16", "--batch-size", "8"];
        let o = strata(
            &[
                &base[..],
                &["--steps", "4", "--schedule", "constant", "--threads", "1"],
                flags,
                &["--metrics", s(&metrics)],
            ]
            .concat(),
        );
        assert!(o.status.success(), "{name}:\n{}", stderr(&o));
        common::reports(&metrics)
    };
    let plain = run("plain", &["--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01", "--eps", "1e-8"]);
    let patrickstar = run("patrickstar", &["--patrickstar-config", s(&config)]);
    let losses = |r: &[serde_json::Value]| r.iter().map(|r| r["loss"].as_f64().unwrap()).collect::<Vec<_>>();
    assert_eq!(losses(&patrickstar), losses(&plain));
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap()).unwrap();
    let size = |k: &str| c[k].as_u64().unwrap();
    let embedding =
        4 * size("hidden_size") * (size("vocab_size") + size("max_position_embeddings") + size("type_vocab_size") + 2);
    let host = &patrickstar.last().unwrap()["memory"]["host"]["by_category"];
    assert_eq!(host["params"].as_u64(), Some(embedding), "{host}");
    assert_eq!(host["optimizer_state"].as_u64(), Some(2 * embedding), "{host}");
}

/// Masked-language pretraining from the command line: a BERT masked language model's folder
/// trains on text (a line a text, joined and cut into rows, 15% of the words masked), its
/// validation loss on the masked words falls, and `strata eval` of the written folder
/// reports the run's last validation loss on the same masked words (the first two batches).
#[test]
fn a_bert_masked_language_model_pretrains_on_text() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("bert-mlm");
    reference(&py, &["make", "--family", "bert-mlm", "--out", s(&folder)]);
    let (train, val) = (dir.path().join("train.txt"), dir.path().join("val.txt"));
    // Each line's words are reviews; the model learns which words follow which.
    let text = |seed: u64, lines: usize| -> String {
        let records = reviews(lines, seed, false);
        records
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["text"].as_str().unwrap().to_string() + "\n")
            .collect()
    };
    std::fs::write(&train, text(5, 600)).unwrap();
    std::fs::write(&val, text(6, 160)).unwrap();
    let evaluate = |model: &Path| -> f64 {
        let eval = ["eval", "--model-dir", s(model), "--val-data", s(&val), "--ctx", "32", "--json"];
        let o = strata(&[&eval[..], &["--batch-size", "16", "--eval-batches", "2"]].concat());
        assert!(o.status.success(), "eval:\n{}", stderr(&o));
        let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(out["masked_tokens"].as_u64().unwrap() > 20, "{out}");
        out["loss"].as_f64().unwrap()
    };
    let untrained = evaluate(&folder);
    let (trained, metrics) = (dir.path().join("trained"), dir.path().join("metrics.jsonl"));
    let o = strata(&[
        "train",
        "--model-dir",
        s(&folder),
        "--data",
        s(&train),
        "--val-data",
        s(&val),
        "--ctx",
        "32",
        "--batch-size",
        "16",
        "--steps",
        "80",
        "--eval-every",
        "80",
        "--eval-batches",
        "2",
        "--lr",
        "0.003",
        "--threads",
        "1",
        "--metrics",
        s(&metrics),
        "--save-model-dir",
        s(&trained),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let last = val_losses(&metrics)[0].1;
    let evaluated = evaluate(&trained);
    eprintln!("masked-word loss {untrained:.4} -> {last:.4} (strata eval {evaluated:.4})");
    assert!(last < 0.8 * untrained, "the loss on masked words falls: {untrained} -> {last}");
    assert!((evaluated - last).abs() < 1e-5, "strata eval {evaluated}, the run's last validation {last}");
}
