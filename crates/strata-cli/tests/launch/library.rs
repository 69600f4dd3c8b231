//! The library's run (`strata::run::train`) against `strata train`, its examples, and its
//! TensorBoard log read back by TensorBoard itself.
use crate::common;
use crate::common::{global_gap, losses, reports, stderr, strata};
use std::path::{Path, PathBuf};
use std::process::Command;
use strata::data::Batching;
use strata::data::SyntheticCorpus;
use strata::model::{GptConfig, ModelConfig};
use strata::optim::{LrSchedule, OptimizerConfig};
use strata::run::{self, Checkpoints, Data, Model, Outputs, RunConfig};

/// The flags of `strata train` that give the run [`library_config`] describes (the model
/// and the step's shape are also the `multi_rank` example's).
const SAME_MODEL: &str = "--model gpt --layers 2 --heads 4 --dim 64 --ctx 32 --batch-size 8 --accumulation 2 \
                          --steps 6 --lr 3e-3 --weight-decay 0.01 --schedule constant";
const SAME_RUN: &str = "--threads 1 --checkpoint-every 3 --eval-every 3";

fn words(flags: &str) -> Vec<&str> {
    flags.split_whitespace().collect()
}

fn library_config(dir: &Path) -> RunConfig {
    RunConfig {
        steps: 6,
        threads: Some(1),
        optimizer: OptimizerConfig { lr: 3e-3, ..OptimizerConfig::default() },
        schedule: LrSchedule::Constant,
        eval_every: Some(3),
        checkpoints: Some(Checkpoints { dir: dir.join("checkpoints"), every: Some(3), keep: 2, asynchronous: false }),
        outputs: Outputs {
            weights: Some(dir.join("weights.safetensors")),
            metrics: Some(dir.join("metrics.jsonl")),
            ..Outputs::default()
        },
        batching: Batching { batch_size: 8, ctx: 32, accumulation: 2, ..Batching::default() },
        ..RunConfig::default()
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The same losses step by step, validation included, and the same weights.
fn assert_same_run(cli: &Path, library: &Path) {
    let (a, b) = (reports(&cli.join("metrics.jsonl")), reports(&library.join("metrics.jsonl")));
    assert_eq!(a.len(), b.len(), "steps recorded");
    for (x, y) in a.iter().zip(&b) {
        for field in ["step", "loss", "val_loss", "lr"] {
            assert_eq!(x[field], y[field], "{field} at step {}", x["step"]);
        }
    }
    let gap = global_gap(&cli.join("weights.safetensors"), &library.join("weights.safetensors"));
    assert_eq!(gap, 0.0, "the weights differ by {gap:e}");
}

/// A token file of the synthetic corpus's first 20,000 tokens in `dir`, to validate on.
fn validation_file(dir: &Path) -> PathBuf {
    let path = dir.join("val.tokens");
    let held_out = strata::data::TokenData::new(SyntheticCorpus::default().generate().to_vec()[..20_000].to_vec(), "v");
    held_out.write_token_file(&path, strata::data::TokenWidth::U16).unwrap();
    path
}

#[test]
fn library_run_is_strata_train() {
    let dir = tempfile::tempdir().unwrap();
    let (cli, library) = (dir.path().join("cli"), dir.path().join("library"));
    let synthetic = SyntheticCorpus::default().generate();
    let val = validation_file(dir.path());
    std::fs::create_dir_all(&cli).unwrap();
    let files = [
        "--val-token-file",
        s(&val),
        "--save-checkpoint",
        &format!("{}/checkpoints", s(&cli)),
        "--save-weights",
        &format!("{}/weights.safetensors", s(&cli)),
        "--metrics",
        &format!("{}/metrics.jsonl", s(&cli)),
    ];
    let o = strata(&[&["train"][..], &words(SAME_MODEL), &words(SAME_RUN), &files].concat());
    assert!(o.status.success(), "{}", stderr(&o));

    let model = Model::from(ModelConfig::Gpt(GptConfig::new(256, 32, 2, 4, 64)));
    let validation = strata::data::TokenData::open(&val, None).unwrap();
    let data = Data::with_validation(synthetic, validation);
    std::fs::create_dir_all(&library).unwrap();
    let summary = run::train(&model, &data, &library_config(&library), &mut []).unwrap();
    assert_eq!(summary.last.map(|r| r.step), Some(6));
    assert_same_run(&cli, &library);
    // Both saved their checkpoints at the same steps.
    for step in ["step-00000003", "step-00000006"] {
        assert!(
            cli.join("checkpoints").join(step).is_dir() && library.join("checkpoints").join(step).is_dir(),
            "{step}"
        );
    }
}

/// The example binary `name` as `cargo build --examples` leaves it (`scripts/test.sh` builds
/// them first: `cargo test` builds examples only as empty test harnesses). Refused when any
/// source of the library or its examples is newer, so a stale binary never passes for the
/// current code.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().and_then(Path::parent).unwrap().join("examples").join(name);
    let built = std::fs::metadata(&path).and_then(|m| m.modified()).unwrap_or_else(|_| {
        panic!("{} is not built: run `cargo build --examples` (scripts/test.sh does)", path.display())
    });
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../strata");
    for source in ["src", "examples"].iter().flat_map(|d| rust_files(&crate_dir.join(d))) {
        let changed = std::fs::metadata(&source).and_then(|m| m.modified()).unwrap();
        assert!(
            changed <= built,
            "{} is older than {}: run `cargo build --examples` (scripts/test.sh does)",
            path.display(),
            source.display()
        );
    }
    path
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
        let path = entry.path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

fn run_example(name: &str, args: &[&str]) -> String {
    let o = Command::new(example(name)).args(args).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "example {name}:\n{out}\n{}", stderr(&o));
    out
}

#[test]
fn example_resume_continues_the_interrupted_run_exactly() {
    let out = run_example("resume", &[]);
    assert!(out.contains("first attempt stopped after step 6"), "{out}");
    assert!(out.contains("resumed run trained steps [7, 8, 9, 10, 11, 12]"), "{out}");
}

#[test]
fn example_custom_units_trains_with_the_searched_strategy_on_two_ranks() {
    let o = strata(&["launch", "--nproc-per-node", "2", "--stdout-of", "0", "--", s(&example("custom_units"))]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("strategy [") && out.contains("step 30: loss"), "{out}");
}

#[test]
fn example_custom_classifier_learns_within_its_memory_budget() {
    let out = run_example("custom_classifier", &[]);
    assert!(out.contains("step 80:") && out.contains("strategy [["), "{out}");
}

#[test]
fn example_custom_data_loss_learns() {
    let out = run_example("custom_data_loss", &[]);
    assert!(out.contains("step 60:"), "{out}");
}

/// The multi-rank example started by `strata launch` trains as `strata train --nproc 2` with
/// the same strategy: data parallel with FSDP, and a pipeline.
fn multi_rank_matches_cli(strategy: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (cli, library) = (dir.path().join("cli"), dir.path().join("library"));
    std::fs::create_dir_all(&library).unwrap();
    let o = strata(&["launch", "--nproc-per-node", "2", "--", s(&example("multi_rank")), strategy, s(&library)]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::create_dir_all(&cli).unwrap();
    let (weights, metrics) = (cli.join("weights.safetensors"), cli.join("metrics.jsonl"));
    let ranks = ["train", "--nproc", "2", "--strategy", strategy];
    let files = ["--save-weights", s(&weights), "--metrics", s(&metrics)];
    let flags = [&ranks[..], &words(SAME_MODEL), &files].concat();
    let o = strata(&flags);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(&cli.join("metrics.jsonl")).len(), 6);
    assert_same_run(&cli, &library);
}

#[test]
fn multi_rank_example_is_strata_train_fsdp() {
    multi_rank_matches_cli(r#"["fsdp"]"#);
}

#[test]
fn multi_rank_example_is_strata_train_pipelined() {
    multi_rank_matches_cli(r#"[["parallel_mode", [[["pipeline", 2]], null]]]"#);
}

/// TensorBoard's own reader finds every scalar of the metrics file, step by step, at the
/// metrics file's value (as the 32-bit float an event holds), once per step across a resumed
/// run's two event files, and the profile's pictures.
#[test]
fn tensorboard_reads_the_metrics_series_and_profile_pictures() {
    let Some(python) = common::venv_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (metrics, logs, profile) = (dir.path().join("m.jsonl"), dir.path().join("tb"), dir.path().join("profile"));
    let val = validation_file(dir.path());
    let ckpt = dir.path().join("ckpt");
    let shape = "--steps 6 --ctx 32 --batch-size 8 --layers 1 --eval-every 2 --checkpoint-every 3";
    let files = [
        "--val-token-file",
        s(&val),
        "--metrics",
        s(&metrics),
        "--tensorboard",
        s(&logs),
        "--profile",
        s(&profile),
        "--save-checkpoint",
        s(&ckpt),
    ];
    let flags = [&["train"][..], &words(shape), &files].concat();
    let o = strata(&flags);
    assert!(o.status.success(), "{}", stderr(&o));
    // Resumed from step 3: its steps 4 to 6 replace the first run's, in the metrics file
    // and for TensorBoard's reader (a second event file, starting a session at step 4).
    let step_3 = ckpt.join("step-00000003");
    let o = strata(&[&flags[..], &["--resume", s(&step_3)]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read_dir(&logs).unwrap().count(), 2, "an event file per run");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/tensorboard_read.py");
    let out = Command::new(&python).arg(script).arg(&logs).output().unwrap();
    assert!(out.status.success(), "tensorboard_read.py: {}", String::from_utf8_lossy(&out.stderr));
    let read: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let scalars = read["scalars"].as_object().unwrap();

    let lines = reports(&metrics);
    let mut expected = std::collections::BTreeMap::<String, Vec<(u64, f64)>>::new();
    for line in &lines {
        let step = line["step"].as_u64().unwrap();
        for (name, value) in line.as_object().unwrap() {
            if let (true, Some(v)) = (name != "step", value.as_f64()) {
                expected.entry(name.clone()).or_default().push((step, v));
            }
        }
    }
    for name in ["loss", "lr", "grad_norm", "tokens_per_s", "peak_bytes", "val_loss", "val_perplexity"] {
        assert!(expected.contains_key(name), "the metrics file has {name}");
    }
    assert_eq!(expected["val_loss"].len(), 3, "validations after steps 2, 4 and 6");
    assert_eq!(expected["loss"].iter().map(|&(step, _)| step).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    let mut tags: Vec<&String> = scalars.keys().collect();
    tags.sort();
    assert_eq!(tags, expected.keys().collect::<Vec<_>>(), "TensorBoard's scalar series are the metrics file's");
    for (name, series) in &expected {
        // Both sides as the 32-bit float an event holds (JSON text may round the last digit).
        let got: Vec<(u64, f32)> = scalars[name]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap() as f32))
            .collect();
        let want: Vec<(u64, f32)> = series.iter().map(|&(step, v)| (step, v as f32)).collect();
        assert_eq!(got, want, "{name}");
    }
    let images = read["images"].as_object().unwrap();
    for picture in ["profile/memory", "profile/units", "profile/unit_bars"] {
        let at = images.get(picture).and_then(|i| i.as_array()).unwrap_or_else(|| panic!("{picture} in {images:?}"));
        let (step, width, height) = (at[0][0].as_u64(), at[0][1].as_u64().unwrap(), at[0][2].as_u64().unwrap());
        assert_eq!(step, Some(6), "{picture} at the last step");
        assert!(width > 100 && height > 100, "{picture}: {width}×{height}");
    }
}

/// A library caller can tell failures apart by kind: a damaged checkpoint, data too short for
/// the context, a strategy that cannot apply, an output that cannot be written.
#[test]
fn run_errors_have_kinds_a_caller_can_match() {
    use strata::run::Resume;
    use strata::Error;
    let dir = tempfile::tempdir().unwrap();
    let model = Model::from(ModelConfig::Gpt(GptConfig::new(256, 32, 1, 4, 64)));
    let data = Data::new(SyntheticCorpus::default().generate());
    let config = RunConfig {
        steps: 2,
        batching: Batching { batch_size: 4, ctx: 32, ..Batching::default() },
        ..RunConfig::default()
    };

    let damaged = dir.path().join("damaged");
    std::fs::create_dir_all(&damaged).unwrap();
    std::fs::write(damaged.join("meta.json"), "{\"format\":").unwrap();
    let resumed = RunConfig { resume: Some(Resume::From(damaged)), ..config.clone() };
    let e = run::train(&model, &data, &resumed, &mut []).unwrap_err();
    assert!(matches!(e, Error::Checkpoint(ref m) if m.contains("not a checkpoint description")), "{e}");

    let short = Data::new(strata::data::TokenData::new(vec![1; 20], "twenty tokens"));
    let e = run::train(&model, &short, &config, &mut []).unwrap_err();
    assert!(matches!(e, Error::Data(_)), "{e}");

    let tensor = strata::strategy::Strategy::parse(r#"[["parallel_mode", [[["tensor", 2]], null]]]"#).unwrap();
    let alone = RunConfig { strategy: run::StrategySource::Given(tensor), ..config.clone() };
    let e = run::train(&model, &data, &alone, &mut []).unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");

    let nowhere = Outputs { metrics: Some(dir.path().join("missing/m.jsonl")), ..Outputs::default() };
    let e = run::train(&model, &data, &RunConfig { outputs: nowhere, ..config.clone() }, &mut []).unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("--metrics")), "{e}");

    // A CUDA graph needs a GPU, and a step that needs no host between its kernels.
    let graphed = RunConfig { cuda_graph: true, ..config.clone() };
    let e = run::train(&model, &data, &graphed, &mut []).unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("cuda_graph") && m.contains("CUDA device")), "{e}");
    let packed = RunConfig { batching: Batching { pack: true, ..graphed.batching.clone() }, ..graphed };
    let e = run::train(&model, &data, &packed, &mut []).unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("cuda_graph") && m.contains("--pack")), "{e}");
}

/// What each rank of [`one_rank_stopping_stops_every_rank`] runs, when that test starts this
/// binary again under `strata launch`: a data-parallel run whose callback says stop on rank
/// 0 alone, after step 3. It prints the last step this rank trained.
#[test]
fn rank_of_a_stopped_job() {
    if std::env::var_os("STRATA_TEST_STOPPED_JOB").is_none() {
        return; // only as a launched rank
    }
    let model = Model::from(ModelConfig::Gpt(GptConfig::new(256, 32, 1, 4, 64)));
    let data = Data::new(SyntheticCorpus::default().generate());
    let config = RunConfig {
        steps: 8,
        comm_timeout: std::time::Duration::from_secs(60),
        batching: Batching { batch_size: 4, ctx: 32, ..Batching::default() },
        ..RunConfig::default()
    };
    let rank0 = std::env::var("RANK").as_deref() == Ok("0");
    let mut stop =
        |r: &strata::train::StepReport| Ok(if rank0 && r.step == 3 { run::Flow::Stop } else { run::Flow::Continue });
    let summary = run::train(&model, &data, &config, &mut [&mut stop]).unwrap();
    println!("last step {}", summary.last.map_or(0, |r| r.step));
}

/// A callback that stops the run on one rank stops every rank at the same step: each rank
/// ends after step 3 and the job exits cleanly (a rank left running would wait for the
/// stopped one's collectives and fail).
#[test]
fn one_rank_stopping_stops_every_rank() {
    let exe = std::env::current_exe().unwrap();
    let args =
        ["launch", "--nproc-per-node", "2", "--", s(&exe), "--exact", "library::rank_of_a_stopped_job", "--nocapture"];
    let o = common::strata_env(&args, &[("STRATA_TEST_STOPPED_JOB", "1")]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert_eq!(out.matches("last step 3").count(), 2, "both ranks stop after step 3:\n{out}");
}
