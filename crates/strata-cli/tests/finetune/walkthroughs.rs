//! docs/walkthroughs.md's scripts run as they are, each with tiny folders and files, a few
//! steps and the CPU in place of its defaults: every command works, and each evaluation
//! prints its figures.
use crate::common;
use crate::hf_reference::{python, reference};
use std::path::Path;
use std::process::Command;

/// The script under the walkthrough's heading.
fn script(title: &str) -> String {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/walkthroughs.md")).unwrap();
    let section =
        page.split("\n## ").find(|s| s.starts_with(title)).unwrap_or_else(|| panic!("no walkthrough {title:?}"));
    let block = section.split("```sh\n").nth(1).unwrap_or_else(|| panic!("{title}: no script"));
    block.split("\n```").next().unwrap().to_string()
}

/// Walkthrough `title`'s script in `dir` with `env` in place of its defaults, `strata` the
/// binary under test.
fn command(title: &str, dir: &Path, env: &[(&str, &str)]) -> Command {
    let bin = Path::new(&common::binary()).parent().unwrap().to_path_buf();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let mut c = Command::new("bash");
    c.args(["-euo", "pipefail", "-c", &script(title)]).current_dir(dir).env("PATH", path).env("DEVICE", "cpu");
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// Checks that walkthrough `title` succeeded; returns its standard output.
fn succeeded(title: &str, o: std::process::Output) -> String {
    assert!(o.status.success(), "{title}:\n{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs walkthrough `title` ([`command`]); returns its standard output.
fn run(title: &str, dir: &Path, env: &[(&str, &str)]) -> String {
    succeeded(title, command(title, dir, env).output().unwrap())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn every_walkthrough_runs_as_written() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let folder = |family: &str| {
        let out = d.join(family);
        reference(&py, &["make", "--family", family, "--out", s(&out)]);
        out
    };
    let write = |name: &str, text: String| {
        std::fs::write(d.join(name), text).unwrap();
        d.join(name)
    };
    let (llama, t5, bert) = (folder("llama"), folder("t5"), folder("bert-classifier"));

    let sums = crate::finetune::example_file(d);
    let tiny = [("NPROC", "2"), ("STEPS", "2"), ("PROMPT", "3+4=")];
    let env = [&tiny[..], &[("MODEL", s(&llama)), ("DATA", s(&sums)), ("VAL", s(&sums)), ("LENGTH", "48")]].concat();
    let out = run("Instruction-tune", d, &env);
    assert!(out.contains("\"val_loss\""), "the evaluation's figures: {out}");
    assert!(d.join("adapter/adapter_config.json").is_file() && d.join("merged/config.json").is_file());

    let pairs = (0..16).map(|i| {
        let p = format!("w{} w{}", 3 + i % 7, 11 + i % 5);
        serde_json::json!({"prompt": p, "chosen": format!(" w{}", 20 + i % 9), "rejected": format!(" w{} w40", 50 + i % 6)})
    });
    let pairs = write("pairs.jsonl", pairs.map(|r| r.to_string() + "\n").collect());
    let merged = d.join("merged");
    let env = [&tiny[..], &[("MODEL", s(&merged)), ("PAIRS", s(&pairs)), ("LENGTH", "48")]].concat();
    let out = run("Then prefer", d, &env);
    assert!(out.contains("\"rewards/margins\":"), "the last step's margin: {out}");
    assert!(d.join("aligned/config.json").is_file());
    let out = run("Or train a reward model", d, &env);
    assert!(out.contains("\"accuracy\":"), "the last step's accuracy: {out}");
    let config = std::fs::read_to_string(d.join("reward-model/config.json")).unwrap();
    assert!(config.contains("LlamaForSequenceClassification"), "{config}");
    let prompts = (0..8).map(|i| serde_json::json!({"prompt": format!("w{} w{}", 3 + i, 11 + i), "answer": "w20"}));
    let prompts = write("prompts.jsonl", prompts.map(|r| r.to_string() + "\n").collect());
    let python = common::venv_python().unwrap();
    let aligned = d.join("aligned");
    let grpo = [("MODEL", s(&aligned)), ("PROMPTS", s(&prompts)), ("CTX", "48"), ("COMPLETION", "8")];
    let out = run("Then reinforce", d, &[&tiny[..], &grpo, &[("PYTHON", s(&python))]].concat());
    assert!(out.contains("\"reward\":"), "the last generation batch's reward: {out}");
    assert!(d.join("grpo-adapter/adapter_config.json").is_file());

    let (train, val) =
        (write("s.jsonl", crate::seq2seq::summaries(32, 3)), write("v.jsonl", crate::seq2seq::summaries(8, 4)));
    let env = [&tiny[..], &[("MODEL", s(&t5)), ("DATA", s(&train)), ("VAL", s(&val)), ("CTX", "40")]].concat();
    let out = run("Summarize", d, &env);
    assert!(out.contains("\"rouge_l\""), "the evaluation's figures: {out}");

    let (train, val) =
        (write("r.csv", crate::hf::reviews(64, 1, true)), write("r.jsonl", crate::hf::reviews(32, 2, false)));
    let env = [&tiny[..], &[("MODEL", s(&bert)), ("DATA", s(&train)), ("VAL", s(&val)), ("CTX", "16")]].concat();
    let out = run("Classify", d, &env);
    assert!(out.contains("\"accuracy\"") && out.contains("\"macro_f1\""), "the evaluation's figures: {out}");

    let words = ["the", "was", "it", "of", "and", "a"];
    let text = (0..3000).map(|i| words[(i * 7 + i / 5) % words.len()]).collect::<Vec<_>>().join(" ");
    let (corpus, tokenizer) = (write("corpus.txt", text), llama.join("tokenizer.json"));
    let env = [
        &tiny[..],
        &[("TEXT", s(&corpus)), ("TOKENIZER", s(&tokenizer)), ("STEPS", "4"), ("EVERY", "1")],
        &[("SHAPE", "--layers 1 --heads 2 --dim 16 --ctx 16")],
    ]
    .concat();
    run("Pretrain", d, &env);
    let metrics = std::fs::read_to_string(d.join("pretrain.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4], "stopped after two steps, resumed to four: {steps:?}");

    // Both nodes on this machine, one rank each, the checkpoint folder shared.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let node = |rank: &str| {
        let env = [
            ("NODE_RANK", rank),
            ("HOST0", "127.0.0.1"),
            ("PORT", &port),
            ("GPUS", "1"),
            ("STEPS", "2"),
            ("SHAPE", "--layers 1 --heads 2 --dim 16 --ctx 16"),
            ("STRATA_STORE_TOKEN", "walkthrough"),
        ];
        command("Train on two nodes", d, &env)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (first, second) = (node("0"), node("1"));
    for (rank, child) in [first, second].into_iter().enumerate() {
        succeeded(&format!("Train on two nodes, node {rank}"), child.wait_with_output().unwrap());
    }
    assert!(d.join("shared/ckpt/latest").is_file(), "the nodes' checkpoint");
}
