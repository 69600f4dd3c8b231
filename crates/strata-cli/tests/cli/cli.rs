//! End-to-end tests of the `strata` binary: training against PyTorch, weights round trips,
//! learning on the default corpus, one-line errors for bad input, and the binary's reuse of
//! freed heap memory.
use crate::common;
use crate::common::assert_fails_with;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn strata(args: &[&str]) -> Output {
    common::strata_env(args, &[("STRATA_LOG", "warn")])
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn losses(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "strata failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The error output of a failed run: exactly one line, no panic, non-zero exit.
fn one_line_error(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure, got success");
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(err.lines().count(), 1, "error must be one line, got:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Writes a token file and a 20-step batch-offsets plan for ctx 32, batch 4.
fn replay_inputs(dir: &Path) -> (PathBuf, PathBuf) {
    let tokens = strata::data::SyntheticCorpus { tokens: 20_000, ..Default::default() }.generate();
    let token_file = dir.join("tokens.bin");
    tokens.write_u16_file(&token_file).unwrap();
    let mut x: u64 = 12345;
    let offsets: Vec<Vec<usize>> = (0..20)
        .map(|_| {
            (0..4)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((x >> 33) as usize) % (tokens.len() - 33)
                })
                .collect()
        })
        .collect();
    let plan = dir.join("offsets.json");
    std::fs::write(&plan, serde_json::json!({"ctx": 32, "batch": 4, "offsets": offsets}).to_string()).unwrap();
    (token_file, plan)
}

const GPT: [&str; 11] = ["train", "--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--ctx", "32"];
const OPTIM: [&str; 14] = [
    "--lr",
    "0.003",
    "--betas",
    "0.9,0.95",
    "--eps",
    "1e-8",
    "--weight-decay",
    "0.1",
    "--decay-norms-and-biases",
    "false",
    "--grad-clip",
    "1.0",
    "--schedule",
    "constant",
];

#[test]
fn gpt_losses_match_pytorch_step_by_step() {
    let Some(python) = common::venv_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (tokens, plan) = replay_inputs(dir.path());
    let init = dir.path().join("init.safetensors");
    let vocab = ["--vocab", "96", "--threads", "2"];
    ok(&strata(&[&GPT[..], &vocab, &["--steps", "0", "--seed", "7", "--save-weights", s(&init)]].concat()));

    let torch = Command::new(python)
        .arg(repo().join("scripts/torch_reference.py"))
        .args(["train", "--weights", s(&init), "--tokens", s(&tokens), "--offsets", s(&plan), "--steps", "20"])
        .args(["--heads", "2", "--lr", "0.003", "--betas", "0.9", "0.95", "--eps", "1e-8", "--weight-decay", "0.1"])
        .args(["--decay-norms-and-biases", "false"])
        .args(["--grad-clip", "1.0", "--threads", "2"])
        .output()
        .unwrap();
    assert!(torch.status.success(), "{}", String::from_utf8_lossy(&torch.stderr));
    let reference: Vec<f64> = serde_json::from_slice::<serde_json::Value>(&torch.stdout).unwrap()["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();

    let metrics = dir.path().join("metrics.jsonl");
    let replay = ["--init-weights", s(&init), "--token-file", s(&tokens), "--batch-offsets", s(&plan)];
    // Fused attention and layer norm, as the reference's modules use.
    let run = ["--steps", "20", "--batch-size", "4", "--metrics", s(&metrics), "--strategy", r#"["module_replace"]"#];
    ok(&strata(&[&GPT[..], &vocab, &OPTIM, &replay, &run].concat()));
    let ours = losses(&metrics);
    assert_eq!(ours.len(), 20);
    assert_eq!(reference.len(), 20);
    let mut worst: f64 = 0.0;
    for (step, (a, b)) in ours.iter().zip(&reference).enumerate() {
        let rel = (a - b).abs() / b.abs();
        assert!(rel < 1e-4, "step {step}: strata {a} vs pytorch {b} (relative {rel:e})");
        worst = worst.max(rel);
    }
    eprintln!("largest relative loss difference to PyTorch over 20 steps: {worst:.2e}");
    assert!(ours[19] < ours[0] - 0.5, "the replayed run learns: {ours:?}");
}

#[test]
fn saved_weights_load_back_exactly_with_or_without_lm_head() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.safetensors"), dir.path().join("b.safetensors"));
    let tiny = ["--steps", "3", "--batch-size", "2", "--threads", "1"];
    ok(&strata(&[&GPT[..], &tiny, &["--save-weights", s(&a)]].concat()));
    // Zero training steps from loaded weights must save the identical tensors.
    ok(&strata(&[&GPT[..], &["--steps", "0", "--init-weights", s(&a), "--save-weights", s(&b)]].concat()));
    let (ta, tb) = (strata::io::read_safetensors(&a).unwrap(), strata::io::read_safetensors(&b).unwrap());
    assert_eq!(ta.keys().collect::<Vec<_>>(), tb.keys().collect::<Vec<_>>());
    assert!(!ta.contains_key("lm_head.weight"), "the tied head is saved once");
    for (name, t) in &ta {
        assert!(t.equal(&tb[name]), "{name} changed in the round trip");
    }
    // A file that also carries lm_head.weight (as torch state dicts do) loads as well...
    let mut with_head: Vec<(&str, &tch::Tensor)> = ta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    with_head.push(("lm_head.weight", &ta["transformer.wte.weight"]));
    let c = dir.path().join("c.safetensors");
    std::fs::write(&c, strata::io::to_safetensors(with_head).unwrap()).unwrap();
    ok(&strata(&[&GPT[..], &["--steps", "0", "--init-weights", s(&c)]].concat()));
    // ...but not when the head disagrees with the embedding it is tied to.
    let other = &ta["transformer.wte.weight"] + 1.0;
    let mut bad: Vec<(&str, &tch::Tensor)> = ta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    bad.push(("lm_head.weight", &other));
    std::fs::write(&c, strata::io::to_safetensors(bad).unwrap()).unwrap();
    let err = one_line_error(&strata(&[&GPT[..], &["--steps", "0", "--init-weights", s(&c)]].concat()));
    assert!(err.contains("tie"), "{err}");
}

#[test]
fn default_corpus_loss_falls_toward_its_known_optimum() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let out = ok(&strata(&[
        "train",
        "--model",
        "mlp",
        "--layers",
        "1",
        "--dim",
        "64",
        "--steps",
        "150",
        "--batch-size",
        "16",
        "--threads",
        "2",
        "--lr",
        "0.01",
        "--metrics",
        s(&metrics),
    ]));
    let l = losses(&metrics);
    let best = strata::data::SyntheticCorpus::default().best_loss();
    assert!(l[0] > 5.0, "starts near ln(256): {}", l[0]);
    let tail: f64 = l[l.len() - 10..].iter().sum::<f64>() / 10.0;
    assert!(tail < best + 0.1, "mean of the last 10 losses {tail} is not within 0.1 of the optimum {best}");
    assert!(tail > best - 0.05, "a loss below the entropy bound {best} means the data leaks: {tail}");
    assert!(out.contains("best possible"), "{out}");
}

#[test]
fn metrics_have_the_promised_fields() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    ok(&strata(&[
        "train",
        "--model",
        "llama",
        "--layers",
        "1",
        "--dim",
        "32",
        "--heads",
        "2",
        "--ctx",
        "16",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--accumulation",
        "2",
        "--metrics",
        s(&metrics),
    ]));
    let text = std::fs::read_to_string(&metrics).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    for key in ["step", "loss", "lr", "tokens_per_s", "peak_bytes"] {
        assert!(first.get(key).is_some(), "missing {key} in {first}");
    }
    assert_eq!(first["tokens"], 64, "4 rows × 16 tokens over 2 micro-batches");
    assert!(first["peak_bytes"].as_u64().unwrap() > 0);
}

/// The learning rate each step logs follows its schedule: a constant after a warm-up
/// (`transformers`' `constant_with_warmup`), a wsd schedule's cosine decay; a flag the
/// schedule has no use for is refused, not ignored.
#[test]
fn schedules_set_each_step_s_rate_and_refuse_flags_they_do_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let rates = |schedule: &[&str]| {
        let metrics = dir.path().join("m.jsonl");
        let base = ["train", "--model", "mlp", "--layers", "1", "--dim", "16", "--ctx", "8", "--batch-size", "2"];
        ok(&strata(&[&base[..], &["--steps", "6", "--lr", "0.01", "--metrics", s(&metrics)], schedule].concat()));
        let text = std::fs::read_to_string(&metrics).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"].as_f64().unwrap())
            .collect::<Vec<_>>()
    };
    let close = |got: Vec<f64>, want: &[f64]| {
        assert_eq!(got.len(), want.len(), "{got:?}");
        assert!(got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12), "{got:?} against {want:?}");
    };
    close(rates(&["--schedule", "constant", "--warmup", "4"]), &[0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01]);
    // Decay over steps 2 to 6 towards 0.1 of the rate: (1 + cos(πp)) / 2 of the way.
    let wsd =
        ["--schedule", "wsd", "--warmup", "1", "--decay-start", "2", "--decay-steps", "4", "--min-lr-factor", "0.1"];
    let cosine = |p: f64| 0.001 + 0.009 * 0.5 * (1.0 + (std::f64::consts::PI * p).cos());
    close(
        rates(&[&wsd[..], &["--decay-shape", "cosine"]].concat()),
        &[0.01, 0.01, 0.01, cosine(0.25), cosine(0.5), cosine(0.75)],
    );
    for (flags, refusal) in [
        (
            &["--schedule", "step", "--warmup", "3"][..],
            "--warmup shapes the constant, cosine, linear and wsd schedules",
        ),
        (
            &["--schedule", "constant", "--min-lr-factor", "0.1"][..],
            "--min-lr-factor shapes the cosine, linear and wsd",
        ),
        (&["--schedule", "cosine", "--step-gamma", "0.5"][..], "--step-gamma shapes the step schedule"),
        (&["--schedule", "linear", "--decay-shape", "cosine"][..], "--decay-shape shapes the wsd schedule"),
    ] {
        assert_fails_with(&strata(&[&["train", "--model", "mlp", "--steps", "1"][..], flags].concat()), refusal);
    }
}

#[test]
fn text_data_and_config_files_are_used() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "to be or not to be, that is the question. ".repeat(40)).unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!("model = \"mlp\"\nlayers = 1\ndim = 16\nsteps = 4\nbatch-size = 2\nctx = 8\ndata = \"{}\"\n", s(&text)),
    )
    .unwrap();
    let metrics = dir.path().join("m.jsonl");
    ok(&strata(&["train", "--config", s(&cfg), "--steps", "3", "--metrics", s(&metrics)]));
    assert_eq!(losses(&metrics).len(), 3, "the flag overrides the file's steps = 4");
}

#[test]
fn bad_input_gets_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let quick = ["--model", "mlp", "--layers", "1", "--dim", "8", "--ctx", "8", "--steps", "1", "--batch-size", "2"];
    let run = |extra: &[&str]| strata(&[&["train"][..], &quick, extra].concat());

    let err = run(&["--init-weights", s(&d.join("missing.safetensors"))]);
    assert!(one_line_error(&err).contains("missing.safetensors"));

    let good = d.join("good.safetensors");
    ok(&run(&["--save-weights", s(&good)]));
    let bytes = std::fs::read(&good).unwrap();
    let truncated = d.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let e = one_line_error(&run(&["--init-weights", s(&truncated)]));
    assert!(e.contains("truncated.safetensors") && e.contains("not a valid safetensors"), "{e}");
    // Refused before a strategy search spends any time (the search would print its table).
    for (flag, bad) in [
        ("--init-weights", truncated.clone()),
        ("--init-weights", d.join("missing.safetensors")),
        ("--resume", d.join("no-checkpoint")),
    ] {
        let e = one_line_error(&run(&["--strategy", "auto", flag, s(&bad)]));
        assert!(e.contains(s(&bad)), "{flag}: {e}");
    }

    // Weights of a one-layer MLP of width 8 loaded into other models.
    for (model, needle) in [
        (&["--model", "mlp", "--layers", "1", "--dim", "16"][..], "shape"),
        (&["--model", "mlp", "--layers", "2", "--dim", "8"], "missing parameter"),
        (&["--model", "gpt", "--layers", "1", "--dim", "8", "--heads", "2"], "unknown tensor"),
    ] {
        let e = one_line_error(&strata(&[&["train", "--steps", "0", "--init-weights", s(&good)][..], model].concat()));
        assert!(e.contains(needle), "{model:?}: {e}");
    }

    let empty = d.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    assert!(one_line_error(&run(&["--data", s(&empty)])).contains("fewer than"));
    let short = d.join("short.txt");
    std::fs::write(&short, "abc").unwrap();
    assert!(one_line_error(&run(&["--data", s(&short)])).contains("fewer than"));
    let odd = d.join("odd.bin");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    assert!(one_line_error(&run(&["--token-file", s(&odd)])).contains("u16"));

    for (flags, needle) in [
        (&["--lr", "-1"][..], "learning rate"),
        (&["--betas", "0.9"], "betas"),
        (&["--optimizer", "lion"], "unknown optimizer"),
        (&["--batch-size", "3", "--accumulation", "2"], "does not split"),
        (&["--device", "tpu"], "unknown device"),
        (&["--model", "rnn"], "unknown model"),
        (&["--grad-clip", "-2"], "grad-clip"),
        (&["--min-lr-factor", "-1"], "the floor factor must lie in [0, 1]"),
        (&["--schedule", "step", "--step-gamma", "nan"], "the step factor must be positive"),
        (&["--comm-timeout", "1e19"], "more seconds than a run can wait"),
    ] {
        let e = one_line_error(&run(flags));
        assert!(e.contains(needle), "{flags:?}: {e}");
    }
    let e = one_line_error(&strata(&["train", "--model", "gpt", "--heads", "3", "--dim", "8", "--steps", "0"]));
    assert!(e.contains("divisible"), "{e}");
    let bad_toml = d.join("bad.toml");
    std::fs::write(&bad_toml, "stepz = 3\n").unwrap();
    assert!(one_line_error(&run(&["--config", s(&bad_toml)])).contains("stepz"));
    let e = one_line_error(&strata(&["train", "--no-such-flag"]));
    assert!(e.contains("--no-such-flag"), "{e}");
    assert_eq!(strata(&["train", "--no-such-flag"]).status.code(), Some(2));
}

#[test]
fn options_that_would_do_nothing_are_refused_by_name() {
    let quick = ["--model", "mlp", "--layers", "1", "--dim", "8", "--ctx", "8", "--steps", "1", "--batch-size", "2"];
    let run = |extra: &[&str]| strata(&[&["train"][..], &quick, extra].concat());
    for (flags, needle) in [
        (&["--included", "checkpoint"][..], "--included shapes the automatic search"),
        (&["--excluded", "fp8"], "--excluded shapes the automatic search"),
        (&["--time-limit", "5"], "--time-limit shapes"),
        (&["--search", "exhaustive"], "--search shapes"),
        (&["--confirm-runs", "0"], "--confirm-runs shapes"),
        (&["--dry-run-steps", "2"], "--dry-run-steps needs dry runs"),
        (&["--search-report", "r.json"], "--search-report needs dry runs"),
        (&["--strategy", "auto", "--finetune-strategy", "true"], "--strategy auto searches"),
        (&["--strategy", "auto", "--time-limit", "1e20"], "more seconds than a run can wait"),
        (&["--bucket-bytes", "1000"], "one rank reduces nothing"),
        (&["--nproc", "2", "--bucket-bytes", "1000", "--strategy", r#"["zero2"]"#], "zero2 reduces unit by unit"),
        (&["--nproc", "0"], "--nproc must be at least 1"),
        (&["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
        (&["--strategy", r#"[["zero2", {"forward_prefetch": true}]]"#], "forward_prefetch belongs to fsdp"),
        (&["--strategy", r#"[["zero1", {"limit_all_gathers": false}]]"#], "limit_all_gathers belongs to fsdp"),
        (&["--strategy", r#"[["zero1", {"overlap_comm": true}]]"#], "overlap_comm belongs to zero2 and fsdp"),
        (&["--ffn-dim", "64"], "--ffn-dim belongs to --model llama"),
        (&["--rope-theta", "500000"], "--rope-theta belongs to --model llama"),
        (&["--kv-heads", "1"], "--kv-heads belongs to --model llama"),
        (&["--norm-eps", "1e-6"], "--norm-eps belongs to --model gpt or llama"),
        (&["--tie-embeddings", "true"], "--tie-embeddings belongs to --model llama"),
        (
            &["--strategy", r#"[["zero2", {"backward_prefetch": "BACKWARD_POST"}]]"#],
            "backward_prefetch belongs to fsdp",
        ),
        (&["--strategy", r#"[["fsdp", {"mixed_precision": {"buffer_dtype": "bf16"}}]]"#], "hold no buffers"),
        (&["--strategy", r#"["zero2"]"#, "--finetune-strategy", "true"], "zero2 (no buckets) has nothing to tune"),
        (&["--finetune-strategy", "true"], "data parallel on one rank has nothing to tune"),
    ] {
        let e = one_line_error(&run(flags));
        assert!(e.contains(needle), "{flags:?}: {e}");
    }
    // Where buckets exist, the flag is taken: the ranks of a launched job see its size.
    ok(&run(&["--nproc", "2", "--bucket-bytes", "100000"]));
    // What `strategy show` writes out (every default) is still accepted for zero2.
    let shown = ok(&strata(&["strategy", "show", r#"["zero2"]"#]));
    ok(&strata(&["strategy", "validate", shown.trim()]));
}

#[test]
fn strategy_show_prints_the_mesh_a_strategy_makes_of_a_world() {
    let strategy = r#"[["parallel_mode", [[["tensor", 2]], null]], "tensor_parallel", "fsdp"]"#;
    let shown = ok(&strata(&["strategy", "show", strategy, "--world-size", "8"]));
    assert!(shown.contains("mesh at 8 ranks: tensor 2 × zero 4"), "{shown}");
    assert!(shown.contains("  tensor (2): [0, 1] [2, 3] [4, 5] [6, 7]"), "{shown}");
    assert!(shown.contains("  zero (4): [0, 2, 4, 6] [1, 3, 5, 7]"), "{shown}");
    // HYBRID_SHARD's shard groups are a host's ranks over the tensor size.
    let hybrid = r#"[["parallel_mode", [[["tensor", 2]], null]], "tensor_parallel", ["fsdp", {"sharding_strategy": "HYBRID_SHARD"}]]"#;
    let shown = ok(&strata(&["strategy", "show", hybrid, "--world-size", "8", "--local-world-size", "4"]));
    assert!(shown.contains("mesh at 8 ranks: tensor 2 × zero 2 × data 2"), "{shown}");
    assert!(shown.contains("  data (2): [0, 4] [1, 5] [2, 6] [3, 7]"), "{shown}");
    // Expert groups: adjacent data-parallel ranks; fsdp's shard groups across them.
    let experts =
        ok(&strata(&["strategy", "show", r#"[["expert_parallel", {"size": 2}], "fsdp"]"#, "--world-size", "8"]));
    assert!(experts.contains("mesh at 8 ranks: expert 2 × zero 4"), "{experts}");
    assert!(experts.contains("  expert (2): [0, 1] [2, 3] [4, 5] [6, 7]"), "{experts}");
    assert!(experts.contains("  zero (4): [0, 2, 4, 6] [1, 3, 5, 7]"), "{experts}");
    let bare = one_line_error(&strata(&["strategy", "show", r#"[["parallel_mode", [[["expert", 2]], null]]]"#]));
    assert!(bare.contains("the expert dimension needs the expert_parallel method"), "{bare}");
    let bare = one_line_error(&strata(&["strategy", "show", r#"[["parallel_mode", [[["context", 2]], null]]]"#]));
    assert!(bare.contains("the context dimension needs the context_parallel method"), "{bare}");
    // Context groups: adjacent ranks reading the same rows.
    let context =
        ok(&strata(&["strategy", "show", r#"[["context_parallel", {"size": 2}], "fsdp"]"#, "--world-size", "8"]));
    assert!(context.contains("mesh at 8 ranks: context 2 × zero 4"), "{context}");
    assert!(context.contains("  context (2): [0, 1] [2, 3] [4, 5] [6, 7]"), "{context}");
}

#[test]
fn output_locations_are_checked_before_the_first_step() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let quick = ["--model", "mlp", "--layers", "1", "--dim", "8", "--ctx", "8", "--batch-size", "2"];
    let metrics = d.join("m.jsonl");
    let run = |extra: &[&str]| {
        strata(&[&["train"][..], &quick, &["--steps", "50", "--metrics", s(&metrics)], extra].concat())
    };
    let missing = d.join("no/such/dir/w.safetensors");
    let a_file = d.join("file");
    std::fs::write(&a_file, "x").unwrap();
    let locked = d.join("locked");
    std::fs::create_dir(&locked).unwrap();
    std::fs::set_permissions(&locked, std::os::unix::fs::PermissionsExt::from_mode(0o500)).unwrap();
    // Root writes anywhere: the locked folder only counts where permissions bind.
    let locked_binds = std::fs::write(locked.join("probe"), "x").is_err();
    let inside = locked.join("ckpt");
    let mut cases = vec![
        (vec!["--save-weights", s(&missing)], format!("--save-weights {}", missing.display()), "does not exist"),
        (vec!["--save-weights", s(d)], format!("--save-weights {}", d.display()), "is a folder"),
        (vec!["--save-checkpoint", s(&a_file)], format!("--save-checkpoint {}", a_file.display()), "not a folder"),
        (
            vec!["--search-report", "/nonexistent/r.json", "--strategy", "auto"],
            "--search-report /nonexistent/r.json".into(),
            "does not exist",
        ),
    ];
    if locked_binds {
        cases.push((
            vec!["--save-checkpoint", s(&inside)],
            format!("--save-checkpoint {}", inside.display()),
            "cannot create",
        ));
    }
    for (flags, path, why) in cases {
        let e = one_line_error(&run(&flags));
        assert!(e.contains(&path) && e.contains(why), "{flags:?}: {e}");
        assert!(!e.contains(".safetensors.tmp"), "the error names the given path: {e}");
        assert!(!metrics.exists(), "{flags:?}: no step ran before the check");
    }
}

/// `--ffn-dim`, `--rope-theta`, `--kv-heads`, `--norm-eps` and `--tie-embeddings` shape the
/// LLaMA: the feed-forward's width changes the parameter count by exactly its three
/// matrices, the key/value heads by exactly the key and value projections, tying by the
/// head's matrix; the rotary base and the norms' epsilon change the loss.
#[test]
fn llama_shape_flags_reach_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str], name: &str| {
        let metrics = dir.path().join(name);
        let base = ["train", "--model", "llama", "--layers", "1", "--dim", "32", "--heads", "2", "--ctx", "16"];
        let out =
            strata(&[&base[..], &["--steps", "1", "--batch-size", "2", "--metrics", s(&metrics)], extra].concat());
        ok(&out);
        let step: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(&metrics).unwrap().lines().next().unwrap()).unwrap();
        // fp32 parameters on one process, unpadded: 4 bytes each.
        let params = step["memory"]["device"]["by_category"]["params"].as_i64().unwrap() / 4;
        (params, losses(&metrics)[0])
    };
    let (default_params, default_loss) = run(&[], "default.jsonl");
    // The default hidden size of width 32 is 8/3 · 32 rounded up to 32: 96.
    let (narrow_params, _) = run(&["--ffn-dim", "64"], "ffn.jsonl");
    assert_eq!(default_params - narrow_params, 3 * 32 * (96 - 64), "gate, up and down shrink");
    let (rope_params, rope_loss) = run(&["--rope-theta", "500000"], "rope.jsonl");
    assert_eq!(rope_params, default_params);
    assert_ne!(rope_loss, default_loss, "the rotary base changes the attention");
    // Two query heads of size 16 sharing one key/value head: k and v shrink to [16, 32].
    let (gqa_params, _) = run(&["--kv-heads", "1"], "gqa.jsonl");
    assert_eq!(default_params - gqa_params, 2 * (32 - 16) * 32, "k_proj and v_proj shrink");
    // Tied, the head reads the embedding: one vocab × dim matrix fewer.
    let (tied_params, _) = run(&["--tie-embeddings", "true"], "tied.jsonl");
    assert_eq!(default_params - tied_params, 256 * 32, "lm_head is the embedding");
    let (_, eps_loss) = run(&["--norm-eps", "0.5"], "eps.jsonl");
    assert_ne!(eps_loss, default_loss, "the norms' epsilon reaches them");
    // GPT's LayerNorms take the epsilon too.
    let gpt = |extra: &[&str], name: &str| {
        let metrics = dir.path().join(name);
        let base = ["train", "--model", "gpt", "--layers", "1", "--dim", "32", "--heads", "2", "--ctx", "16"];
        ok(&strata(&[&base[..], &["--steps", "1", "--batch-size", "2", "--metrics", s(&metrics)], extra].concat()));
        losses(&metrics)[0]
    };
    assert_ne!(gpt(&["--norm-eps", "0.5"], "gpt-eps.jsonl"), gpt(&[], "gpt.jsonl"), "GPT's norms take it");
    let bad = strata(&["train", "--model", "llama", "--heads", "2", "--dim", "32", "--kv-heads", "3", "--steps", "1"]);
    assert!(one_line_error(&bad).contains("kv_heads 3 must divide the 2 query heads"));
}

/// A mixture of experts' load-balancing loss joins the first step's loss at the weight
/// `--router-aux-loss` gives it, and not at all at 0 (as `transformers` trains by default).
#[test]
fn the_load_balancing_loss_joins_the_loss_at_its_flag_s_weight() {
    let dir = tempfile::tempdir().unwrap();
    let run = |weight: &str| {
        let metrics = dir.path().join(format!("{weight}.jsonl"));
        let base = ["train", "--model", "llama", "--layers", "2", "--dim", "32", "--heads", "2", "--ctx", "16"];
        let moe = ["--experts", "4", "--router-aux-loss", weight, "--steps", "1", "--batch-size", "2"];
        ok(&strata(&[&base[..], &moe, &["--metrics", s(&metrics)]].concat()));
        let step: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(&metrics).unwrap().lines().next().unwrap()).unwrap();
        (step["loss"].as_f64().unwrap(), step["experts"]["aux_loss"].as_f64().unwrap())
    };
    let ((without, aux), (with, same_aux)) = (run("0"), run("0.5"));
    assert_eq!(aux, same_aux, "the same weights route alike");
    assert!(aux > 0.5, "E · Σ f_e · P_e is 1 at perfect balance: {aux}");
    let added = with - without;
    assert!((added - 0.5 * aux).abs() < 1e-5 * with, "the loss rose by {added}, not 0.5 × {aux}");
    let dense = strata(&["train", "--model", "llama", "--router-aux-loss", "0.1", "--steps", "1"]);
    assert!(one_line_error(&dense).contains("--router-aux-loss routes a mixture of experts: the model has no experts"));
}

/// Minor page faults of one `strata train` run of `steps` steps, from the child's own
/// resource usage, on a GPT whose activations pass malloc's default mapping threshold
/// (128 KiB): a [8, 64, 512] hidden layer is 1 MiB.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(clippy::zombie_processes)] // reaped by wait4, which also reads its resource usage
fn train_page_faults(steps: u32, env: &[(&str, &str)]) -> i64 {
    let steps = steps.to_string();
    let args = ["train", "--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "128", "--ctx", "64"];
    let child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .args(["--batch-size", "8", "--threads", "1", "--steps", &steps])
        .env("STRATA_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the strata binary runs");
    let mut status = 0;
    // SAFETY: rusage is plain old data, filled in by wait4.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child, writing into the two live locals.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert!(pid > 0 && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "strata train failed");
    usage.ru_minflt
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn training_steps_reuse_freed_heap_memory_unless_the_user_tunes_malloc() {
    // Faults of ten more steps, so start-up and the first steps' growth cancel out.
    let per_step = |env: &[(&str, &str)]| (train_page_faults(12, env) - train_page_faults(2, env)) as f64 / 10.0;
    let kept = per_step(&[]);
    let tuned = per_step(&[("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")]);
    eprintln!("page faults per step: {kept} with the binary's malloc setting, {tuned} under the user's tunables");
    // The difference of two runs' faults varies by a hundred or so a step on a busy machine
    // (-60 to 134 seen); a malloc that returns activations to the system faults 12,000.
    assert!(kept < 1000.0, "steps reuse freed memory: {kept} page faults a step");
    assert!(tuned > 1000.0, "the user's malloc tunables win: {tuned} page faults a step");
}

/// `strata bench train` measures PyTorch's side and Strata's in alternating blocks, or each
/// alone one after the other (`--one-side-at-a-time`); either way every side is timed over
/// every block and reported with its last loss. With `--compile` (here beside
/// `--checkpoint`, every side recomputing) PyTorch under `torch.compile` is one more side,
/// training the same model as its eager side from the same weights and batches.
#[test]
fn bench_train_times_every_side_in_alternating_blocks_or_one_at_a_time() {
    if common::venv_python().is_none() {
        return;
    }
    let args = ["bench", "train", "--layers", "1", "--heads", "2", "--dim", "16", "--ctx", "16", "--batch-size", "2"];
    for alone in [false, true] {
        let mut args = args.to_vec();
        args.extend(["--rounds", "2", "--block", "2", "--warmup", "1", "--threads", "1", "--json"]);
        if alone {
            args.extend(["--one-side-at-a-time", "--compile", "--checkpoint"]);
        }
        let o = strata(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(report["one_side_at_a_time"], alone);
        assert_eq!(report["steps"], 4);
        assert_eq!(report["trained_steps"], 5);
        let sides = report["sides"].as_array().unwrap();
        let names: Vec<&str> = sides.iter().map(|s| s["side"].as_str().unwrap()).collect();
        let expected: &[&str] =
            if alone { &["pytorch eager", "strata", "pytorch compile"] } else { &["pytorch eager", "strata"] };
        assert_eq!(names, expected);
        for side in sides {
            let rate = side["tokens_per_s"].as_f64().unwrap();
            assert!(rate.is_finite() && rate > 0.0, "{alone}: {side}");
            // A 256-token vocabulary starts near ln 256 = 5.5.
            let loss = side["final_loss"].as_f64().unwrap();
            assert!(loss > 1.0 && loss < 7.0, "{alone}: {side}");
        }
        assert!(report["ratio"].as_f64().unwrap() > 0.0);
        if alone {
            // Compiled or not, PyTorch trains the same weights on the same batches.
            let (eager, compiled) =
                (sides[0]["final_loss"].as_f64().unwrap(), sides[2]["final_loss"].as_f64().unwrap());
            assert!((eager - compiled).abs() < 1e-3 * eager, "eager {eager}, compiled {compiled}");
            assert!(report["compile_ratio"].as_f64().unwrap() > 0.0);
            assert!(sides[2]["compiled_graphs"].as_u64().unwrap() > 0, "the compiled side made no graph");
            assert!(sides[0].get("compiled_graphs").is_none());
        }
    }
}

#[test]
fn the_fork_server_runs_commands_as_processes_of_their_own_and_ends_when_idle() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("socket");
    let mut server = common::fork_server_start(&socket, &["--idle", "2"]).expect("the server listens");
    let (own, forked) = (dir.path().join("own"), dir.path().join("forked"));
    std::fs::create_dir_all(&own).unwrap();
    std::fs::create_dir_all(&forked).unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let by_server = common::fork_server_run(&socket, &forked, args, env).expect("the server answers");
        let by_process = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(args)
            .current_dir(&own)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (by_server, by_process)
    };
    // The same output, status and files (in the folder asked for).
    let train = ["train", "--model", "mlp", "--layers", "1", "--dim", "8", "--ctx", "8", "--batch-size", "2"];
    let saved = [&train[..], &["--steps", "2", "--save-weights", "w.st"]].concat();
    for (args, env) in [
        (&["strategy", "show", r#"["zero2"]"#, "--world-size", "4"][..], &[][..]),
        (&["train", "--model", "nonsense"], &[]),
        (&saved, &[("STRATA_LOG", "error")]),
    ] {
        let (by_server, by_process) = run(args, env);
        assert_eq!(by_server.status.code(), by_process.status.code(), "{args:?}");
        assert_eq!(by_server.stderr, by_process.stderr, "{args:?}");
        if args[0] == "strategy" {
            assert_eq!(by_server.stdout, by_process.stdout);
        }
    }
    assert_eq!(common::weight_gap(&own.join("w.st"), &forked.join("w.st")), 0.0);
    // Each command's own variables: its log, and a fault that kills it.
    let steps = [&train[..], &["--steps", "2"]].concat();
    let (logged, _) = run(&steps, &[("STRATA_LOG", "info")]);
    assert!(common::stderr(&logged).contains("training"), "{}", common::stderr(&logged));
    let (killed, by_process) = run(&steps, &[("STRATA_FAULT", "backward@1")]);
    assert_eq!((killed.status.signal(), by_process.status.signal()), (Some(9), Some(9)));
    // Idle past --idle, it ends by itself and removes its socket.
    assert!(server.wait().unwrap().success());
    assert!(!socket.exists());
}
