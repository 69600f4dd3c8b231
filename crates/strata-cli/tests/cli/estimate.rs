//! `strata estimate` and the memory estimate under it, against runs of `strata train`.
use crate::common::*;
use strata::auto::candidate::{Candidate, Layout, Precision, Sharding};
use strata::auto::estimate::{self, Machine, Workload};
use strata::model::{GptConfig, LlamaConfig, ModelConfig};
use strata::strategy::{ContextKind, ScheduleKind};

/// Estimates a layout of a small model, then trains it for three steps and reads rank 0's
/// last step: the optimizer states equal the estimate's to the byte (the engine's layout,
/// sharding and pipeline split followed exactly), the allocator's peak lies within 5% of
/// the estimate's total, and what the chunked loss, a context split and activation offload
/// save within 10% of what the estimate says.
#[test]
fn the_estimate_follows_the_allocator_over_families_and_layouts() {
    let gpt = ModelConfig::Gpt(GptConfig::new(512, 32, 4, 4, 64));
    let llama = ModelConfig::Llama(LlamaConfig {
        kv_heads: Some(2),
        ffn_dim: Some(160),
        ..LlamaConfig::new(512, 32, 4, 4, 64)
    });
    let plain = |sharding, checkpoint, tensor| {
        Layout::new(Candidate { tensor, ..Candidate::plain(Precision::Fp32, sharding, checkpoint) })
    };
    let piped =
        Layout { pipeline: 2, schedule: ScheduleKind::OneForwardOneBackward, ..plain(Sharding::None, false, 1) };
    // The head's loss in chunks of 32 of the micro-batch's 256 positions.
    let chunked = Layout::new(Candidate { chunked_loss: Some(32), ..plain(Sharding::None, false, 1).candidate });
    let context = |kind| plain(Sharding::None, false, 1).with_context(2, kind);
    let shelved = |checkpoint| {
        let c = plain(Sharding::None, checkpoint, 1).candidate;
        Layout::new(Candidate { activation_offload: true, ..c })
    };
    // (label, model, layout, ranks, global rows, micro-batches)
    let cases = [
        ("gpt", &gpt, plain(Sharding::None, false, 1), 1, 8, 1),
        ("llama checkpoint", &llama, plain(Sharding::None, true, 1), 1, 8, 1),
        ("gpt fsdp ×2", &gpt, plain(Sharding::Fsdp, false, 1), 2, 16, 1),
        ("llama zero1 ×2", &llama, plain(Sharding::Zero1, false, 1), 2, 16, 1),
        ("llama pipeline 2", &llama, piped, 2, 16, 4),
        ("gpt tensor 2", &gpt, plain(Sharding::None, false, 2), 2, 8, 1),
        ("llama", &llama, plain(Sharding::None, false, 1), 1, 8, 1),
        ("llama chunked loss", &llama, chunked, 1, 8, 1),
        ("llama context 2 ring", &llama, context(ContextKind::Ring), 2, 8, 1),
        ("llama context 2 all-to-all", &llama, context(ContextKind::AllToAll), 2, 8, 1),
        ("llama activation offload", &llama, shelved(false), 1, 8, 1),
        ("llama checkpoint + activation offload", &llama, shelved(true), 1, 8, 1),
    ];
    let mut peaks = std::collections::BTreeMap::new();
    let cpu = estimate::device_kind("cpu").unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (label, model, layout, ranks, rows, micro) in cases {
        let work = Workload {
            ranks,
            micro_batch: rows / (layout.data_ranks(ranks) * micro),
            ctx: 32,
            micro_batches: micro,
            optimizer_state_bytes: 8,
        };
        let machine = Machine { device: cpu.clone(), device_bytes: u64::MAX, host_bytes: u64::MAX };
        let e = estimate::estimate(model, &layout, &work, &machine).unwrap();
        let (name, block, extra): (&str, &str, Vec<String>) = match model {
            ModelConfig::Gpt(_) => ("gpt", "GptBlock", vec![]),
            _ => ("llama", "LlamaBlock", vec!["--ffn-dim".into(), "160".into(), "--kv-heads".into(), "2".into()]),
        };
        let strategy = layout.strategy(&[block.into()]).unwrap().to_value().to_string();
        let metrics = dir.path().join(format!("{}.jsonl", label.replace(' ', "_")));
        let mut args: Vec<String> =
            format!("train --model {name} --layers 4 --heads 4 --dim 64 --ctx 32 --vocab 512 --steps 3 --threads 1")
                .split_whitespace()
                .map(String::from)
                .collect();
        args.extend(extra);
        for (flag, value) in [
            ("--nproc", ranks.to_string()),
            ("--batch-size", rows.to_string()),
            ("--accumulation", micro.to_string()),
            ("--strategy", strategy),
            ("--metrics", metrics.display().to_string()),
        ] {
            args.extend([flag.to_string(), value]);
        }
        let out = strata(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(out.status.success(), "{label}: {}", stderr(&out));
        let last = reports(&metrics).pop().unwrap();
        let held = &last["memory"]["device"]["by_category"];
        let rank0 = e.pipeline_ranks[0];
        assert_eq!(held["optimizer_state"].as_u64().unwrap(), rank0.device.optimizer, "{label}: optimizer states");
        let measured = last["allocator_peak_bytes"].as_u64().unwrap() as f64;
        // Offloaded activations wait outside the allocator (on a GPU, in the host's memory).
        let estimated = (rank0.device.total() + rank0.host.total() - rank0.host.activations) as f64;
        let error = estimated / measured - 1.0;
        eprintln!("{label}: estimated {estimated} measured {measured} ({:+.1}%)", 100.0 * error);
        assert!(error.abs() <= 0.05, "{label}: estimated {estimated} bytes against {measured} measured");
        peaks.insert(label, (estimated, measured));
    }
    // The chunked loss, each context split and activation offload (alone and beside
    // recomputation) lower the peak by what the estimate says they save.
    for (method, against) in [
        ("llama chunked loss", "llama"),
        ("llama context 2 ring", "llama"),
        ("llama context 2 all-to-all", "llama"),
        ("llama activation offload", "llama"),
        ("llama checkpoint + activation offload", "llama checkpoint"),
    ] {
        let ((whole_e, whole_m), (less_e, less_m)) = (peaks[against], peaks[method]);
        let (saved_e, saved_m) = (whole_e - less_e, whole_m - less_m);
        eprintln!("{method}: estimated {saved_e} bytes saved, measured {saved_m}");
        let close = saved_m > 0.0 && (saved_e / saved_m - 1.0).abs() <= 0.10;
        assert!(close, "{method}: saved {saved_e} estimated, {saved_m} measured");
    }
}

/// A 70B model on 64 GPUs: instant, some layouts fit and some do not, sharding and
/// recomputation shrink the device's share, and the busiest pipeline rank is reported.
#[test]
fn strata_estimate_says_what_fits_a_70b_model_on_64_gpus() {
    let out = strata(&[
        "estimate",
        "--preset",
        "llama-3-70b",
        "--nproc",
        "64",
        "--device",
        "h100-80gb",
        "--ctx",
        "4096",
        "--tensor",
        "1,8",
        "--pipeline",
        "1,4",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let device = |label: &str| {
        let row = rows.iter().find(|r| r["layout"] == label).unwrap_or_else(|| panic!("no row {label}"));
        (row["device"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum::<u64>(), row["fits"] == true)
    };
    let (plain, plain_fits) = device("amp bf16 + data parallel");
    let (sharded, sharded_fits) = device("amp bf16 + checkpoint + fsdp");
    assert!(!plain_fits && sharded_fits, "plain {plain} bytes, fsdp + checkpoint {sharded}");
    assert!(sharded * 4 < plain);
    assert!(rows.iter().any(|r| r["layout"].as_str().unwrap().contains("pipeline 4")));
    assert!(report["params"].as_i64().unwrap() > 70_000_000_000);
}

/// Qwen3-30B-A3B (48 sparse layers of 128 experts 768 wide, 8 per token, width 2048) over
/// expert groups: each rank computes 128/k experts and stores their fp32 weights alone, and
/// sends (k−1)/k of its token slots' hidden states out and back, forward and backward, in
/// bf16.
#[test]
fn strata_estimate_places_experts_and_counts_their_all_to_all() {
    let args = ["estimate", "--preset", "qwen3-30b-a3b", "--nproc", "8", "--ctx", "4096", "--micro-batch", "2"];
    let out = strata(&[&args[..], &["--expert-parallel", "1,2,8", "--json"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let placed: Vec<(u64, u64, u64, u64)> = report["experts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["size"].as_u64().unwrap(),
                e["experts_per_rank"].as_u64().unwrap(),
                e["expert_bytes_per_rank"].as_u64().unwrap(),
                e["all_to_all_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    let slots_bytes = 2 * 4096 * 8 * 2048 * 2;
    let step = |k: u64| 4 * 48 * slots_bytes * (k - 1) / k;
    let weights = |k: u64| 48 * 128 / k * 3 * 2048 * 768 * 4;
    assert_eq!(placed, [(1, 128, weights(1), 0), (2, 64, weights(2), step(2)), (8, 16, weights(8), step(8))]);
    // Every layout at each size: a rank's parameters lose the experts other ranks store,
    // its all-to-all holds one layer's slots sent and received, and zero stages shard over
    // the ranks outside the expert groups (none left at 8).
    let rows = report["rows"].as_array().unwrap();
    let row = |label: &str| rows.iter().find(|r| r["layout"] == label).unwrap_or_else(|| panic!("no {label}"));
    let device = |label: &str, part: &str| row(label)["device"][part].as_u64().unwrap();
    for k in [2, 8] {
        let apart = format!("amp bf16 + data parallel + experts {k}");
        assert_eq!(device(&apart, "params"), device("amp bf16 + data parallel", "params") - weights(1) + weights(k));
        assert_eq!(device(&apart, "comm"), 2 * slots_bytes);
    }
    let zero = |label: &str| device(label, "optimizer");
    let sharded = zero("amp bf16 + zero1 + experts 2") as f64 / zero("amp bf16 + data parallel + experts 2") as f64;
    assert!((sharded - 0.25).abs() < 1e-3, "zero1 beside experts 2 shards over 4 ranks: {sharded}");
    assert!(rows.iter().all(|r| r["layout"] != "amp bf16 + zero1 + experts 8"), "nothing left to shard");
    assert_fails_with(&strata(&[&args[..], &["--expert-parallel", "3"]].concat()), "128 experts do not split over 3");
    assert_fails_with(&strata(&["estimate", "--preset", "gpt2", "--expert-parallel", "2"]), "the model has no experts");
}

/// Llama 3 8B at 8,192 positions on 8 H100s: split over 8 context ranks, a rank keeps an
/// eighth of the activations (the ring's blocks of keys and values beside them), and fsdp
/// shards over the context ranks as over data ranks; the all-to-all needs heads that
/// divide, and linear attention does not split at all.
#[test]
fn strata_estimate_splits_rows_over_context_ranks() {
    let args = ["estimate", "--preset", "llama-3-8b", "--ctx", "8192", "--nproc", "8", "--json"];
    let out = strata(&[&args[..], &["--context-parallel", "1,8"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let row = |label: &str| rows.iter().find(|r| r["layout"] == label).unwrap_or_else(|| panic!("no {label}"));
    let device = |r: &serde_json::Value, part: &str| r["device"][part].as_u64().unwrap();
    let (whole, split) = (row("amp bf16 + checkpoint + fsdp"), row("amp bf16 + checkpoint + fsdp + context 8 (ring)"));
    assert_eq!(device(split, "activations"), device(whole, "activations") / 8);
    assert_eq!(device(split, "optimizer"), device(whole, "optimizer"), "fsdp shards over all 8 ranks either way");
    assert!(device(split, "comm") > 0, "the ring's blocks");
    let odd =
        ["estimate", "--preset", "gpt2", "--nproc", "5", "--context-parallel", "5", "--context-kind", "all_to_all"];
    assert_fails_with(&strata(&odd), "does not divide the 12 heads");
    let linear = ["estimate", "--preset", "qwen3-next-80b-a3b", "--nproc", "2", "--context-parallel", "2"];
    assert_fails_with(&strata(&linear), "linear attention's state runs along the whole row");
}

/// Long rows: an 8B Llama shape at 65,536 positions on eight H100s is best split over
/// context ranks, and the strategy written trains that split; at 8,192 positions no
/// layout splits rows.
#[test]
fn strata_plan_splits_long_rows_over_context_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let shape = "plan --model llama --layers 32 --heads 32 --dim 4096 --vocab 128256 --ffn-dim 14336 --kv-heads 8 \
                 --nodes 1 --gpus-per-node 8 --global-batch 8 --json";
    let plan = |ctx: &str, extra: &[&str]| -> serde_json::Value {
        let args: Vec<&str> = shape.split_whitespace().chain(["--ctx", ctx]).chain(extra.iter().copied()).collect();
        let o = strata(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let long = plan("65536", &["--out", out.to_str().unwrap()]);
    let best = &long["rows"][0]["layout"];
    assert!(best["context"].as_u64().unwrap() > 1, "{best}");
    let written = std::fs::read_to_string(&out).unwrap();
    assert!(written.contains("context_parallel"), "{written}");
    let short = plan("8192", &[]);
    let rows = short["rows"].as_array().unwrap();
    assert!(!rows.is_empty() && rows.iter().all(|r| r["layout"]["context"] == 1));
}

/// TinyLlama's shape on one H100, rows ever longer: at 32,768 positions recomputation
/// fits; at 131,072 the logits fit no layout whole, so the plan's pass with the loss in
/// chunks does; at 262,144 that fits nothing either, so the last pass offloads the
/// activations too, and its strategy says so.
#[test]
fn strata_plan_chunks_the_loss_then_offloads_activations_where_nothing_else_fits() {
    let shape = "plan --model llama --layers 22 --heads 32 --dim 2048 --vocab 32000 --ffn-dim 5632 --kv-heads 4 \
                 --nodes 1 --gpus-per-node 1 --global-batch 1 --json";
    let plan = |ctx: &str| -> Vec<serde_json::Value> {
        let o = strata(&shape.split_whitespace().chain(["--ctx", ctx]).collect::<Vec<_>>());
        assert!(o.status.success(), "{}", stderr(&o));
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let rows = report["rows"].as_array().unwrap().clone();
        assert!(!rows.is_empty(), "{ctx}: {report}");
        rows
    };
    let methods = |rows: &[serde_json::Value]| -> Vec<(bool, bool)> {
        let of = |r: &serde_json::Value| {
            let c = &r["layout"]["candidate"];
            (!c["chunked_loss"].is_null(), c["activation_offload"] == true)
        };
        rows.iter().map(of).collect()
    };
    for (ctx, chunked, shelved) in [("32768", false, false), ("131072", true, false), ("262144", true, true)] {
        let rows = plan(ctx);
        assert!(methods(&rows).iter().all(|&m| m == (chunked, shelved)), "{ctx}: {:?}", methods(&rows));
    }
}

#[test]
fn strata_estimate_refuses_two_models_and_unknown_names_in_one_line() {
    assert_fails_with(&strata(&["estimate", "--preset", "gpt2", "--model", "gpt"]), "exactly one of");
    assert_fails_with(&strata(&["estimate", "--preset", "gpt5"]), "no model preset \"gpt5\"");
    assert_fails_with(&strata(&["estimate", "--preset", "gpt2", "--device", "tpu"]), "unknown device \"tpu\"");
    assert_fails_with(&strata(&["estimate", "--model-dir", "no/such/folder"]), "no such folder or file");
    assert_fails_with(
        &strata(&["plan", "--preset", "llama-3-70b", "--nodes", "1", "--gpus-per-node", "2", "--global-batch", "2"]),
        "no layout of",
    );
}

/// A folder's config.json is read without weights: GPT-2's sizes give GPT-2's parameters.
#[test]
fn strata_estimate_reads_a_folder_s_config_alone() {
    let dir = tempfile::tempdir().unwrap();
    let config = r#"{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257,
        "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12}"#;
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    let out = strata(&["estimate", "--model-dir", dir.path().to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let params = report["params"].as_i64().unwrap();
    assert!((124_000_000..=125_000_000).contains(&params), "{params}");
}

/// A 70B LLaMA on 64 H100s: the plan's best layout is one `strata estimate` says fits,
/// and its strategy file validates for 64 ranks.
#[test]
fn strata_plan_for_a_70b_llama_on_64_h100s_picks_a_layout_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plan.json");
    let out = strata(&[
        "plan",
        "--preset",
        "llama-3-70b",
        "--nodes",
        "8",
        "--gpus-per-node",
        "8",
        "--device",
        "h100-80gb",
        "--global-batch",
        "64",
        "--ctx",
        "8192",
        "--out",
        file.to_str().unwrap(),
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let best = &report["rows"][0];
    assert_eq!(best["memory"]["fits"], true);
    assert!(report["over_memory"].as_u64().unwrap() > 0, "some layouts must not fit a 70B model");
    let times: Vec<f64> =
        report["rows"].as_array().unwrap().iter().map(|r| r["time"]["total"].as_f64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "fastest first: {times:?}");
    assert!(best["time"]["mfu"].as_f64().unwrap() > 0.1 && best["time"]["mfu"].as_f64().unwrap() < 0.9);
    // The same layout through `strata estimate`.
    let layout = &best["layout"];
    let candidate = &layout["candidate"];
    let (t, p) = (candidate["tensor"].as_u64().unwrap(), layout["pipeline"].as_u64().unwrap());
    let (mb, m) = (best["micro_batch"].as_u64().unwrap(), best["micro_batches"].as_u64().unwrap());
    let schedule = layout["schedule"].as_str().unwrap();
    let chunks = layout["virtual_stages"].as_u64().unwrap();
    let estimate = strata(&[
        "estimate",
        "--preset",
        "llama-3-70b",
        "--nproc",
        "64",
        "--gpus-per-node",
        "8",
        "--ctx",
        "8192",
        "--micro-batch",
        &mb.to_string(),
        "--accumulation",
        &m.to_string(),
        "--tensor",
        &t.to_string(),
        "--pipeline",
        &p.to_string(),
        "--schedule",
        schedule,
        "--virtual-stages",
        &chunks.to_string(),
        "--json",
    ]);
    assert!(estimate.status.success(), "{}", stderr(&estimate));
    let rows: serde_json::Value = serde_json::from_slice(&estimate.stdout).unwrap();
    let label = best["memory"]["layout"].as_str().unwrap();
    let same = rows["rows"].as_array().unwrap().iter().find(|r| r["layout"] == label && r["lora"] == false);
    let same = same.unwrap_or_else(|| panic!("strata estimate shows no {label}"));
    assert_eq!(same["fits"], true, "{label}");
    assert_eq!(same["device"], best["memory"]["device"], "{label}: the same bytes");
    let valid = strata(&["strategy", "validate", file.to_str().unwrap(), "--world-size", "64"]);
    assert!(valid.status.success(), "{}", stderr(&valid));
}

/// Qwen3-30B-A3B on two nodes of eight H100s: the best layout splits the experts over
/// expert groups within a node, more than 1.2× as fast as the best that does not, pays for
/// their all-to-alls, and its strategy names the expert dimension.
#[test]
fn strata_plan_splits_a_mixture_of_experts_over_expert_groups() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plan.json");
    let args =
        "plan --preset qwen3-30b-a3b --nodes 2 --gpus-per-node 8 --global-batch 32 --ctx 4096 --top 10000 --json";
    let out = strata(&[&args.split_whitespace().collect::<Vec<_>>()[..], &["--out", file.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let experts = |r: &serde_json::Value| r["layout"]["experts"].as_u64().unwrap();
    let speed = |r: &serde_json::Value| r["time"]["tokens_per_s"].as_f64().unwrap();
    let best = &rows[0];
    assert!((2..=8).contains(&experts(best)), "{}", best["label"]);
    assert!(best["time"]["expert_comm"].as_f64().unwrap() > 0.0);
    let dense = rows.iter().find(|r| experts(r) == 1).expect("a layout without expert groups fits");
    assert!(speed(best) > 1.2 * speed(dense), "{} against {}", best["label"], dense["label"]);
    let strategy: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let methods = strategy.as_array().unwrap();
    assert!(methods.iter().any(|m| m == "expert_parallel" || m[0] == "expert_parallel"), "{strategy}");
    let dims = methods.iter().find(|m| m[0] == "parallel_mode").map(|m| m[1][0].clone()).unwrap();
    assert!(dims.as_array().unwrap().iter().any(|d| d[0] == "expert" && d[1] == experts(best)), "{dims}");
    // On one node only offloaded layouts fit: each is one a run can take (sharded, without
    // tensor or pipeline stages), and the best still splits the experts.
    let one_node = "plan --preset qwen3-30b-a3b --nodes 1 --gpus-per-node 8 --global-batch 16 --ctx 4096 --json";
    let out = strata(&one_node.split_whitespace().collect::<Vec<_>>());
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert!(experts(&rows[0]) > 1, "{}", rows[0]["label"]);
    for label in rows.iter().map(|r| r["label"].as_str().unwrap()) {
        let sharded = ["zero1", "zero2", "fsdp"].iter().any(|s| label.contains(s));
        assert!(
            label.contains("offload") && sharded && !label.contains("pipeline") && !label.contains("tensor"),
            "{label}"
        );
    }
}

/// The strategy file of a plan for a small GPT on two devices trains unchanged.
#[test]
fn a_plan_s_strategy_file_trains_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plan.json");
    let shape = ["--model", "gpt", "--layers", "4", "--heads", "4", "--dim", "64", "--vocab", "512", "--ctx", "32"];
    let mut plan =
        vec!["plan", "--nodes", "1", "--gpus-per-node", "2", "--global-batch", "8", "--out", file.to_str().unwrap()];
    plan.extend(shape);
    let out = strata(&plan);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let accumulation =
        text.split("--accumulation ").nth(1).and_then(|t| t.split_whitespace().next()).unwrap().to_string();
    let mut train = vec![
        "train",
        "--nproc",
        "2",
        "--steps",
        "2",
        "--threads",
        "1",
        "--batch-size",
        "8",
        "--accumulation",
        &accumulation,
        "--strategy",
        file.to_str().unwrap(),
    ];
    train.extend(shape);
    let run = strata(&train);
    assert!(run.status.success(), "{}", stderr(&run));
}

/// `--checkpoint-async` adds each rank's snapshot to its host bytes: its checkpoint file,
/// which a two-rank fsdp run writes at the size the estimate says (the file's tensors, to
/// the per-unit rounding of the shards), half of what plain data parallelism's one writer
/// holds.
#[test]
fn strata_estimate_counts_an_asynchronous_checkpoint_s_snapshot_as_the_file_it_writes() {
    let model = ["--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--ctx", "32", "--vocab", "256"];
    let host = |extra: &[&str]| -> Vec<(String, u64)> {
        let args = ["estimate", "--device", "cpu", "--precision", "fp32", "--nproc", "2", "--json"];
        let out = strata(&[&args[..], &model, extra].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let rows = report["rows"].as_array().unwrap().iter();
        rows.map(|r| (r["layout"].as_str().unwrap().to_string(), r["host"]["comm"].as_u64().unwrap())).collect()
    };
    let (without, with) = (host(&[]), host(&["--checkpoint-async"]));
    let snapshot = |name: &str| {
        let at = with.iter().position(|(l, _)| l == name).unwrap_or_else(|| panic!("no {name} in {with:?}"));
        with[at].1 - without[at].1
    };
    let (plain, fsdp) = (snapshot("fp32 + data parallel"), snapshot("fp32 + fsdp"));
    assert!(fsdp > 0 && fsdp.abs_diff(plain / 2) <= 64, "fsdp {fsdp}, data parallel {plain}");
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let run = ["--steps", "1", "--batch-size", "4", "--nproc", "2", "--strategy", r#"["fsdp"]"#, "--threads", "1"];
    let o = strata(&[&["train"][..], &model, &run, &["--save-checkpoint", ckpt.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let file = std::fs::read(ckpt.join("step-00000001/rank0.safetensors")).unwrap();
    let header = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let data = (file.len() - 8 - header) as u64;
    let gap = data.abs_diff(fsdp) as f64 / data as f64;
    assert!(gap <= 0.01, "estimated {fsdp} bytes, the file holds {data}");
}

/// `strata estimate --num-generations` decodes prompts of `--ctx` less
/// `--max-completion-length` positions: a long prompt's prefill outgrows the last token's
/// cache and raises the activations, a short one leaves the cache as the peak, and a
/// completion that leaves no room for a prompt is refused.
#[test]
fn strata_estimate_counts_the_prompts_prefill() {
    let activations = |completion: &str| {
        // 64 completions decoded (a micro-batch of 1, 64 accumulated), one row trained at once.
        let args = ["estimate", "--preset", "gpt2", "--ctx", "1024", "--accumulation", "64", "--num-generations", "4"];
        let out = strata(&[&args[..], &["--max-completion-length", completion, "--json"]].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let row = report["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["layout"] == "amp bf16 + checkpoint + data parallel")
            .cloned();
        row.unwrap_or_else(|| panic!("no plain layout: {report}"))["device"]["activations"].as_u64().unwrap()
    };
    let (long_prompt, short_prompt, shorter_prompt) = (activations("64"), activations("960"), activations("992"));
    assert!(long_prompt > short_prompt, "{long_prompt} against {short_prompt}");
    assert_eq!(short_prompt, shorter_prompt, "the last token's cache is the peak for both");
    let refused = ["estimate", "--preset", "gpt2", "--ctx", "512", "--accumulation", "4", "--num-generations", "4"];
    assert_fails_with(&strata(&refused), "leaves no room for a prompt beside --max-completion-length 512");
}
