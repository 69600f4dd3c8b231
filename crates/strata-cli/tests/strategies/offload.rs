//! Offload end to end: `strata train` with model states placed between device and host
//! under a device budget reaches what the run without a budget reaches, also when a run is
//! resumed across offload and no offload; budgets that nothing fits are one clear line.
use crate::common;

use crate::common::{assert_fails_with, assert_follows, global_gap, losses, reports, strata, train_run, Run};
use std::path::Path;

/// A constant learning rate: a run of 6 steps and one of 3 resumed to 6 see the same rates.
const RUN: [&str; 16] = [
    "--model",
    "gpt",
    "--layers",
    "4",
    "--dim",
    "32",
    "--ctx",
    "32",
    "--seed",
    "5",
    "--batch-size",
    "4",
    "--threads",
    "1",
    "--schedule",
    "constant",
];

/// Trains `steps` steps with `extra` flags.
fn train(dir: &Path, name: &str, steps: usize, extra: &[&str]) -> Run {
    train_run(dir, name, steps, &[&RUN, extra])
}

/// The device peak of a run without a budget (everything the allocator held: model states,
/// activations, temporaries) less 60% of its model states (parameters, gradients, Adam's
/// moments): the run itself does not fit.
fn tight_budget(metrics: &Path) -> String {
    let first = &reports(metrics)[0];
    let states = first["model_state_peak_bytes"].as_u64().unwrap();
    (first["allocator_peak_bytes"].as_u64().unwrap() - states * 6 / 10).to_string()
}

#[test]
fn offloaded_training_under_a_budget_matches_the_run_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let (reference, reference_metrics) = train(dir.path(), "reference", 8, &[]);
    let budget = tight_budget(&reference_metrics);
    let limit: u64 = budget.parse().unwrap();
    // At the budget the offloaded runs keep, the plain run is refused before its first
    // step: its model states fit, but not beside what a step holds.
    let states = reports(&reference_metrics)[0]["model_state_peak_bytes"].as_u64().unwrap();
    assert!(states < limit, "the plain run's states {states} alone fit {budget}");
    let refused = strata(&[&["train"][..], &RUN, &["--steps", "2", "--device-memory", &budget]].concat());
    assert_fails_with(&refused, "do not fit");
    for (name, strategy) in [
        ("auto", r#"["offload"]"#),
        ("full", r#"[["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]]"#),
    ] {
        let (weights, metrics) = train(dir.path(), name, 8, &["--strategy", strategy, "--device-memory", &budget]);
        assert_eq!(losses(&metrics), losses(&reference_metrics), "{name}");
        assert_eq!(global_gap(&reference, &weights), 0.0, "{name}");
        for r in reports(&metrics) {
            let peak = r["memory"]["device"]["peak"].as_u64().unwrap();
            assert!(peak <= limit, "{name}: the ledger's device peak {peak} over {budget}");
            // On the CPU the allocator holds the host's states too: the rest is the device's.
            let host = r["memory"]["host"]["current"].as_u64().unwrap();
            let allocated = r["allocator_peak_bytes"].as_u64().unwrap() - host;
            assert!(allocated <= limit, "{name}: the allocator's device peak {allocated} over {budget}");
        }
    }
    let plain = reports(&reference_metrics)[0]["allocator_peak_bytes"].as_u64().unwrap();
    assert!(plain > limit, "the plain run's peak {plain} does not fit {budget}");
    // The host's budget: what full offload held at its peak is enough, and every step stays
    // within it; a tenth less is refused when the engine is built.
    let full = dir.path().join("full.jsonl");
    let host_peak = reports(&full).iter().map(|r| r["memory"]["host"]["peak"].as_u64().unwrap()).max().unwrap();
    let strategy = r#"[["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]]"#;
    let hosted = |host: u64| {
        let host = host.to_string();
        ["--strategy", strategy, "--device-memory", &budget, "--host-memory", &host].map(String::from)
    };
    let flags = hosted(host_peak);
    let (_, metrics) = train(dir.path(), "host-budget", 8, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(losses(&metrics), losses(&reference_metrics), "within the host's budget");
    for r in reports(&metrics) {
        let peak = r["memory"]["host"]["peak"].as_u64().unwrap();
        assert!(peak <= host_peak, "the host's peak {peak} over its budget {host_peak}");
    }
    let flags = hosted(host_peak * 9 / 10);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let refused = strata(&[&["train"][..], &RUN, &["--steps", "2"], &flags].concat());
    assert_fails_with(&refused, "the host needs");
}

/// A run checkpointed with full offload and resumed without it, and the reverse, records
/// the losses of the run that never stopped, in one metrics file: the resumed run keeps
/// the lines up to its checkpoint and drops those of steps that ran after it (a crash's).
#[test]
fn a_run_resumes_across_offload_and_no_offload() {
    let dir = tempfile::tempdir().unwrap();
    let straight = train(dir.path(), "straight", 6, &[]);
    let offload = ["--strategy", r#"[["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]]"#];
    for (what, first, then) in [("offload then none", &offload[..], &[][..]), ("none then offload", &[], &offload)] {
        let ckpt = dir.path().join(what.replace(' ', "-"));
        let (_, metrics) =
            train(dir.path(), what, 3, &[first, &["--save-checkpoint", ckpt.to_str().unwrap()]].concat());
        // A step that ran after the checkpoint before the run died.
        let mut lines = std::fs::read_to_string(&metrics).unwrap();
        lines.push_str("{\"step\": 4, \"loss\": 99.0}\n");
        std::fs::write(&metrics, lines).unwrap();
        let resumed = train(dir.path(), what, 6, &[then, &["--resume", ckpt.to_str().unwrap()]].concat());
        assert_follows(&straight, &resumed, what, 1e-6, 1e-6);
    }
}

#[test]
fn budgets_nothing_fits_are_refused_with_the_numbers() {
    let o = strata(
        &[&["train"][..], &RUN, &["--steps", "1", "--strategy", r#"["offload"]"#, "--device-memory", "1000"]].concat(),
    );
    assert_fails_with(&o, "do not fit");
    let full = r#"[["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]]"#;
    let o = strata(&[&["train"][..], &RUN, &["--steps", "1", "--strategy", full, "--host-memory", "1000"]].concat());
    assert_fails_with(&o, "the host needs");
    let o = strata(&[&["train"][..], &RUN, &["--steps", "1", "--strategy", r#"[["offload", {"ratio": 2}]]"#]].concat());
    assert_fails_with(&o, "ratio must lie in (0, 1]");
}

#[test]
fn zero_stages_with_their_shards_on_the_host_match_the_same_stages_on_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let common = ["--nproc", "2", "--accumulation", "2", "--grad-clip", "0.5"];
    // The first units covering half of the shard states' bytes, or all of them.
    let cases =
        [("zero1", "zero1", "none", 1.0), ("zero2", "zero2", "none", 1.0), ("zero2-half", "zero2", "none", 0.5)];
    for (name, stage, params, ratio) in cases.into_iter().chain([("fsdp", "fsdp", "cpu", 1.0)]) {
        let plain = format!(r#"["{stage}"]"#);
        let offloaded = format!(
            r#"["{stage}", ["offload", {{"params": "{params}", "optimizer": "cpu", "policy": "static", "ratio": {ratio}}}]]"#
        );
        let (w0, m0) =
            train(dir.path(), &format!("{name}-device"), 6, &[&common[..], &["--strategy", &plain]].concat());
        let (w1, m1) =
            train(dir.path(), &format!("{name}-host"), 6, &[&common[..], &["--strategy", &offloaded]].concat());
        assert_eq!(losses(&m1), losses(&m0), "{name}");
        assert_eq!(global_gap(&w0, &w1), 0.0, "{name}");
        let memory = &reports(&m1)[5]["memory"];
        assert!(bytes(&memory["host"]["current"]) > 0, "{name}: shards live on the host: {memory}");
        let kept = bytes(&memory["device"]["by_category"]["optimizer_state"]);
        assert_eq!(kept > 0, ratio < 1.0, "{name}: shard states kept on the device: {memory}");
    }
    let o = strata(
        &[
            &["train"][..],
            &RUN,
            &[
                "--steps",
                "1",
                "--strategy",
                r#"["fsdp", ["offload", {"params": "none", "optimizer": "cpu", "policy": "static"}]]"#,
            ],
        ]
        .concat(),
    );
    assert_fails_with(&o, "params must be \"cpu\"");
}

fn bytes(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// For a ZeRO stage's run without offload (its metrics): its allocator peak less 60% of the
/// shard states it keeps on the device (stage 3 keeps parameter shards too; stage 2 whole
/// parameters, which cannot leave), so the run itself does not fit.
fn shard_budget(stage: &str, metrics: &Path) -> u64 {
    let last = reports(metrics).pop().unwrap();
    let shards = &last["memory"]["device"]["by_category"];
    let mut movable = bytes(&shards["grads"]) + bytes(&shards["optimizer_state"]);
    if stage == "fsdp" {
        movable += bytes(&shards["params"]);
    }
    allocator_peak(metrics) - movable * 6 / 10
}

fn allocator_peak(metrics: &Path) -> u64 {
    reports(metrics).iter().map(|r| bytes(&r["allocator_peak_bytes"])).max().unwrap()
}

/// `auto` beside a ZeRO stage.
fn shard_auto(stage: &str) -> String {
    let params = if stage == "fsdp" { "auto" } else { "none" };
    format!(r#"["{stage}", ["offload", {{"params": "{params}", "optimizer": "auto", "policy": "auto"}}]]"#)
}

/// `auto` beside zero2 and fsdp (2 ranks, accumulation, clipping) under a budget that the
/// same stage without offload exceeds: the units whose shard states fit stay on the device,
/// the others go to the host, losses and weights are those of the run without offload, and
/// the device stays within the budget at every step; a budget below the step itself is
/// refused when the engine is built.
#[test]
fn auto_beside_zero2_and_fsdp_keeps_what_fits_on_the_device_and_trains_as_without_offload() {
    let dir = tempfile::tempdir().unwrap();
    let common = ["--nproc", "2", "--accumulation", "2", "--grad-clip", "0.5"];
    for stage in ["zero2", "fsdp"] {
        let plain = format!(r#"["{stage}"]"#);
        let (w0, m0) =
            train(dir.path(), &format!("{stage}-device"), 6, &[&common[..], &["--strategy", &plain]].concat());
        let limit = shard_budget(stage, &m0);
        assert!(allocator_peak(&m0) > limit, "{stage}: the run without offload does not fit");
        let budget = limit.to_string();
        let auto = shard_auto(stage);
        let flags = [&common[..], &["--strategy", &auto, "--device-memory", &budget]].concat();
        let (w1, m1) = train(dir.path(), &format!("{stage}-auto"), 6, &flags);
        assert_eq!(losses(&m1), losses(&m0), "{stage}");
        assert_eq!(global_gap(&w0, &w1), 0.0, "{stage}");
        for r in reports(&m1) {
            let peak = bytes(&r["memory"]["device"]["peak"]);
            assert!(peak <= limit, "{stage}: the ledger's device peak {peak} over {budget}");
            // On the CPU the allocator holds the host's states too: the rest is the device's.
            let allocated = bytes(&r["allocator_peak_bytes"]) - bytes(&r["memory"]["host"]["current"]);
            assert!(allocated <= limit, "{stage}: the allocator's device peak {allocated} over {budget}");
        }
        let memory = &reports(&m1)[5]["memory"];
        for side in ["device", "host"] {
            let held = bytes(&memory[side]["by_category"]["optimizer_state"]);
            assert!(held > 0, "{stage}: some shard states live on the {side}: {memory}");
        }
    }
    let auto = shard_auto("zero2");
    let o = strata(
        &[&["train"][..], &RUN, &["--nproc", "2", "--steps", "1", "--strategy", &auto, "--device-memory", "100000"]]
            .concat(),
    );
    assert_fails_with(&o, "with every shard on the host a step needs");
}

/// Two ranks of zero2: a run checkpointed with `auto` placing shard states under a budget
/// and resumed without offload, and the reverse, end where the run without offload ends.
#[test]
fn a_sharded_run_resumes_across_offload_and_no_offload() {
    let dir = tempfile::tempdir().unwrap();
    let plain = ["--nproc", "2", "--strategy", r#"["zero2"]"#];
    let (straight, metrics) = train(dir.path(), "straight", 6, &plain);
    let budget = shard_budget("zero2", &metrics).to_string();
    let auto = shard_auto("zero2");
    let offloaded = ["--nproc", "2", "--strategy", &auto, "--device-memory", &budget];
    let (from_offloaded, from_plain) = (dir.path().join("offloaded"), dir.path().join("plain"));
    let (from_offloaded, from_plain) = (from_offloaded.to_str().unwrap(), from_plain.to_str().unwrap());
    let (_, first) =
        train(dir.path(), "offloaded-first", 3, &[&offloaded[..], &["--save-checkpoint", from_offloaded]].concat());
    let host = &reports(&first)[2]["memory"]["host"]["by_category"];
    assert!(bytes(&host["optimizer_state"]) > 0, "shard states went to the host: {host}");
    let (resumed, _) = train(dir.path(), "plain-after", 6, &[&plain[..], &["--resume", from_offloaded]].concat());
    assert!(global_gap(&straight, &resumed) < 1e-6, "offload then none: {}", global_gap(&straight, &resumed));
    train(dir.path(), "plain-first", 3, &[&plain[..], &["--save-checkpoint", from_plain]].concat());
    let (resumed, _) = train(dir.path(), "offloaded-after", 6, &[&offloaded[..], &["--resume", from_plain]].concat());
    assert!(global_gap(&straight, &resumed) < 1e-6, "none then offload: {}", global_gap(&straight, &resumed));
}

#[test]
fn a_patrickstar_configuration_file_trains_as_its_optimizer_does_without_offload() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("patrickstar.json");
    std::fs::write(
        &config,
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01, "use_hybrid_adam": true}},
            "default_chunk_size": 1048576, "use_cpu_embedding": true}"#,
    )
    .unwrap();
    let optimizer = ["--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01", "--eps", "1e-8"];
    let (reference, reference_metrics) = train(dir.path(), "reference", 6, &optimizer);
    let budget = tight_budget(&reference_metrics);
    let flags = ["--patrickstar-config", config.to_str().unwrap(), "--device-memory", &budget];
    let (weights, metrics) = train(dir.path(), "patrickstar", 6, &flags);
    assert_eq!(losses(&metrics), losses(&reference_metrics));
    assert_eq!(global_gap(&reference, &weights), 0.0);
    let host = &reports(&metrics)[5]["memory"]["host"];
    assert!(host["current"].as_u64().unwrap() > 0, "{host}");
    let o = strata(&[&["train"][..], &RUN, &["--steps", "1", "--lr", "0.1"], &flags].concat());
    assert_fails_with(&o, "--lr conflicts with --patrickstar-config");
    std::fs::write(&config, r#"{"optimizer": {"type": "Lamb"}}"#).unwrap();
    let o = strata(&[&["train"][..], &RUN, &["--steps", "1"], &flags].concat());
    assert_fails_with(&o, "expected Adam or AdamW");
}

#[test]
fn the_automatic_search_offloads_a_model_that_fits_no_device_only_strategy() {
    let dir = tempfile::tempdir().unwrap();
    let (_, reference_metrics) = train(dir.path(), "reference", 1, &[]);
    // With fp32 and the reference modules kept (other precisions, recomputation and fused
    // kernels left out), only offload can fit.
    let budget = tight_budget(&reference_metrics);
    let saved = dir.path().join("chosen.json");
    let flags = [
        "--strategy",
        "auto",
        "--excluded",
        "amp_native,half,checkpoint,module_replace",
        "--device-memory",
        &budget,
        "--save-strategy",
        saved.to_str().unwrap(),
    ];
    let (_, metrics) = train(dir.path(), "auto", 3, &flags);
    let chosen = std::fs::read_to_string(&saved).unwrap();
    assert!(chosen.contains("offload"), "{chosen}");
    for r in reports(&metrics) {
        let peak = r["memory"]["device"]["peak"].as_u64().unwrap();
        assert!(peak <= budget.parse().unwrap(), "device peak {peak} over {budget}");
    }
}

/// Over two ranks a PatrickStar configuration trains as fsdp with every shard on the host,
/// step for step as AdamW without offload on two ranks. `release_after_init: true` keeps
/// every unit whole until the model is built, so the device once held the whole model's
/// parameters; false releases each unit's remote half as it is made.
#[test]
fn a_patrickstar_configuration_trains_over_two_ranks_and_releases_after_init_when_told() {
    let dir = tempfile::tempdir().unwrap();
    // Wide blocks on short sequences: the parameters outweigh what a step holds beside them.
    let model = ["--model", "gpt", "--layers", "6", "--dim", "64", "--ctx", "16", "--seed", "5", "--threads", "1"];
    let two = [&model[..], &["--nproc", "2", "--batch-size", "4", "--schedule", "constant"]].concat();
    let train = |name: &str, steps: usize, extra: &[&str]| train_run(dir.path(), name, steps, &[&two, extra]);
    let optimizer = ["--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01", "--eps", "1e-8"];
    let reference = train("reference", 4, &optimizer);
    let whole_params = reports(&reference.1)[0]["memory"]["device"]["by_category"]["params"].as_u64().unwrap();
    let mut peaks = vec![];
    for release in [false, true] {
        let config = dir.path().join(format!("release-{release}.json"));
        let text = format!(
            r#"{{"optimizer": {{"type": "AdamW", "params": {{"lr": 0.003, "weight_decay": 0.01}}}}, "release_after_init": {release}}}"#
        );
        std::fs::write(&config, text).unwrap();
        let run = train(&format!("release-{release}"), 4, &["--patrickstar-config", config.to_str().unwrap()]);
        assert_follows(&reference, &run, &format!("release_after_init {release}"), 1e-5, 1e-5);
        peaks.push(reports(&run.1)[0]["memory"]["device"]["peak"].as_u64().unwrap());
    }
    eprintln!("whole parameters {whole_params} bytes; device peaks (release false, true) {peaks:?}");
    assert!(peaks[0] < whole_params, "released unit by unit: {peaks:?} against {whole_params}");
    assert!(peaks[1] >= whole_params, "kept whole until built: {peaks:?} against {whole_params}");
}

/// `strata bench offload` on a tiny GPT and budgets: each placement's largest model grows
/// with what it moves off the device (auto above static full offload, which is bounded by
/// the host, above the optimizer alone, above nothing), only offload moves bytes, and the
/// rows run at another's size report their speed against it.
#[test]
fn bench_offload_orders_the_placements_by_the_model_they_fit() {
    let budgets = ["--device-memory", "1048576", "--host-memory", "4194304", "--max-layers", "32"];
    let shape = ["--heads", "2", "--dim", "32", "--ctx", "16", "--batch-size", "2", "--steps", "2", "--rounds", "1"];
    let o = strata(&[&["bench", "offload", "--json"][..], &budgets, &shape].concat());
    assert!(o.status.success(), "{}", common::stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let row = |name: &str| rows.iter().find(|r| r["placement"] == name).unwrap_or_else(|| panic!("{name}"));
    let layers = |name: &str| row(name)["layers"].as_i64().unwrap();
    eprintln!("{}", serde_json::to_string(rows).unwrap());
    assert!(layers("none") >= 1, "something fits without offload");
    assert!(layers("optimizer") > layers("none"));
    assert!(layers("static-full") > layers("optimizer"));
    assert!(layers("auto") > layers("static-full"), "auto uses the device's room as well as the host's");
    assert!(layers("auto") < 32, "the budgets bound auto, not --max-layers");
    assert_eq!(row("none")["moved_per_step"].as_f64(), Some(0.0));
    for name in ["optimizer", "static-full", "auto"] {
        assert!(row(name)["moved_per_step"].as_f64().unwrap() > 0.0, "{name} moves bytes");
    }
    assert_eq!(layers("auto-no-prefetch"), layers("auto"), "prefetch changes no placement");
    assert!(row("auto-no-prefetch")["vs_same_size"].as_f64().unwrap() > 0.0);
    // A delayed update's gradient twins take host room: it runs at the optimizer's size
    // where they fit there (and then has a speed at the same size), below it otherwise.
    let (delayed, optimizer) = (layers("optimizer-delayed"), layers("optimizer"));
    assert!(delayed >= 1 && delayed <= optimizer, "{delayed} against {optimizer}");
    assert_eq!(row("optimizer-delayed").get("vs_same_size").is_some(), delayed == optimizer);
}

/// `strata bench long` on a tiny LLaMA and budget: every method added lengthens the longest
/// row that fits (the allocator's peak is deterministic on the CPU), each row's peak is
/// within the budget and the next length tried was not, and the budget, not `--max-ctx`,
/// bounds them.
#[test]
fn bench_long_lengthens_the_row_with_each_method() {
    let (budget, granularity, most) = (24u64 << 20, 256, 8192);
    let args = ["--device-memory", &budget.to_string(), "--granularity", "256", "--max-ctx", "8192", "--steps", "2"];
    let o = strata(&[&["bench", "long", "--json"][..], &args].concat());
    assert!(o.status.success(), "{}", common::stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    eprintln!("{}", serde_json::to_string(rows).unwrap());
    let names: Vec<&str> = rows.iter().map(|r| r["configuration"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "nothing",
            "recomputation",
            "+ chunked loss",
            "+ activation offload",
            "+ context parallel 2",
            "+ context parallel 4"
        ]
    );
    let keys: Vec<&str> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["nothing", "recomputation", "chunked-loss", "activation-offload", "context-2", "context-4"]);
    let longest: Vec<i64> = rows.iter().map(|r| r["longest"].as_i64().unwrap()).collect();
    assert!(longest[0] >= granularity, "something fits: {longest:?}");
    assert!(longest.windows(2).all(|w| w[1] > w[0]), "each method lengthens the row: {longest:?}");
    for r in rows {
        let what = &r["configuration"];
        assert!(r["peak_bytes"].as_u64().unwrap() <= budget, "{what}: {r}");
        let (at, over) = (r["longest"].as_i64().unwrap(), r["first_over"].as_i64());
        assert!(at < most, "{what}: the budget binds, not --max-ctx: {r}");
        assert_eq!(over, Some(at + granularity), "{what}: the search stops at the boundary: {r}");
        let ratio = r["vs_nothing"].as_f64().unwrap();
        assert!((ratio - at as f64 / longest[0] as f64).abs() < 1e-12, "{what}: {r}");
    }
}

/// `--only` takes the configurations' keys, and names them where it is given another.
#[test]
fn bench_long_names_its_configurations_keys() {
    let o = strata(&["bench", "long", "--only", "nothing,+ chunked loss"]);
    assert!(!o.status.success());
    let err = common::stderr(&o);
    assert!(
        err.contains("no configuration \"+ chunked loss\"") && err.contains("chunked-loss, activation-offload"),
        "{err}"
    );
}

/// With `--lora-rank` and `--bf16`, every configuration trains adapters over a bf16 base
/// (less memory at the same row than fp32 full training), and `--reference` adds
/// `transformers`' rows, trained the same way (peft's adapters on every linear layer), each
/// configuration's longest row set against theirs.
#[test]
fn bench_long_trains_adapters_in_bf16_beside_transformers() {
    if common::venv_python().is_none() {
        return;
    }
    let args = ["--only", "nothing,context-2", "--max-ctx", "512", "--granularity", "256", "--steps", "2"];
    let args = [&["bench", "long", "--json", "--device-memory", "4000000000"][..], &args].concat();
    let report = |extra: &[&str]| -> serde_json::Value {
        let o = strata(&[&args[..], extra].concat());
        assert!(o.status.success(), "{}", common::stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let full = report(&[]);
    let adapted = report(&["--lora-rank", "4", "--bf16", "--reference"]);
    let rows = adapted["rows"].as_array().unwrap();
    eprintln!("{}", serde_json::to_string(rows).unwrap());
    let keys: Vec<&str> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["nothing", "context-2", "transformers", "transformers-recomputation"]);
    for r in rows {
        assert_eq!(r["longest"], 512, "{r}");
        assert_eq!(r["vs_reference"], 1.0, "{r}");
    }
    for r in &rows[..2] {
        let strategy = r["strategy"].as_str().unwrap();
        assert!(strategy.contains(r#"["lora", {"r": 4"#) && strategy.contains(r#""param_dtype": "bf16""#), "{r}");
    }
    let peak = |r: &serde_json::Value| r["peak_bytes"].as_u64().unwrap();
    assert!(peak(&rows[0]) < peak(&full["rows"][0]), "adapters over a bf16 base hold less: {rows:?} {full}");
    // peft's adapters of rank 4 on the 7 linear layers of each of 2 blocks (width 64, 2 of
    // 4 heads' keys and values, feed-forward 172): r · (inputs + outputs) each.
    let per_block = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 172), (64, 172), (172, 64)];
    let adapters: u64 = 2 * per_block.iter().map(|(i, o)| 4 * (i + o)).sum::<u64>();
    for r in &rows[2..] {
        assert_eq!(r["trained_parameters"], adapters, "{r}");
    }
    assert!(rows[3]["strategy"].as_str().unwrap().ends_with("--checkpoint"), "{}", rows[3]);
}
