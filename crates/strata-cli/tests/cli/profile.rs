//! Profiles end to end: a 2-rank fsdp run with recomputation and accumulation recorded with
//! `--profile`, read back and checked against what is known of it; the Chrome trace, the
//! summary and the pictures made from it; metrics drawn; bad input refused in one line.

use crate::common::{assert_fails_with, stderr, strata};
use std::path::Path;
use strata::engine::{Category, Phase, Placement};
use strata::profile::{self, Record, SpanKind};

const STEPS: usize = 3;
const MICRO: usize = 2;

/// Records a 2-rank run of a small GPT with `strategy`, `steps` steps of `micro` micro-batches.
fn record_run(dir: &Path, steps: usize, micro: usize, strategy: &str) {
    let (steps, micro) = (steps.to_string(), micro.to_string());
    let o = strata(&[
        "train",
        "--model",
        "gpt",
        "--layers",
        "2",
        "--dim",
        "32",
        "--ctx",
        "32",
        "--batch-size",
        "8",
        "--threads",
        "1",
        "--steps",
        &steps,
        "--accumulation",
        &micro,
        "--nproc",
        "2",
        "--strategy",
        strategy,
        "--profile",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

fn record(dir: &Path) {
    record_run(dir, STEPS, MICRO, r#"["fsdp", ["checkpoint", ["GptBlock"]]]"#);
}

#[test]
fn a_recorded_fsdp_profile_holds_what_the_run_did() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let profiles = profile::read_dir(dir.path()).unwrap();
    assert_eq!(profiles.len(), 2);
    for p in &profiles {
        let units = p.header.units.len();
        let spans = p.spans();
        for u in 0..units {
            let forwards = spans.iter().filter(|s| s.kind == SpanKind::Forward(u)).count();
            let backwards = spans.iter().filter(|s| s.kind == SpanKind::Backward(u)).count();
            assert_eq!((forwards, backwards), (STEPS * MICRO, STEPS * MICRO), "rank {} unit {u}", p.header.rank);
        }
        assert_eq!(spans.iter().filter(|s| s.kind == SpanKind::Update).count(), STEPS);
        // The blocks (checkpointed) run their forward again inside each backward; the
        // embedding and the head do not.
        for u in 0..units {
            let recomputes: Vec<_> = spans.iter().filter(|s| s.kind == SpanKind::Recompute(u)).collect();
            let block = p.header.units[u].starts_with("transformer.h.");
            assert_eq!(recomputes.len(), if block { STEPS * MICRO } else { 0 }, "unit {u}");
            for r in recomputes {
                let inside =
                    spans.iter().any(|b| b.kind == SpanKind::Backward(u) && b.start <= r.start && r.end <= b.end);
                assert!(inside, "rank {}: recompute of unit {u} at {}", p.header.rank, r.start);
            }
        }
        // FULL_SHARD: each forward begins with its unit gathered (the last gather or free of
        // it before the forward is a gather).
        for s in spans.iter().filter(|s| matches!(s.kind, SpanKind::Forward(_))) {
            let SpanKind::Forward(u) = s.kind else { continue };
            let last = p.records.iter().filter(|r| r.t() <= s.start).rev().find_map(|r| match r {
                Record::Gather { unit, .. } if *unit == u => Some(true),
                Record::Freed { unit, .. } if *unit == u => Some(false),
                _ => None,
            });
            assert_eq!(last, Some(true), "rank {}: forward of unit {u} at {}", p.header.rank, s.start);
        }
        // The ledger's parameters and gradients are what their buffers hold, at every phase.
        let mut phases = 0;
        for r in &p.records {
            if let Record::Phase { memory, storage_bytes, phase, unit, .. } = r {
                let ledger: u64 = memory
                    .values()
                    .flat_map(|by| by.iter())
                    .filter(|(c, _)| matches!(c, Category::Params | Category::Grads))
                    .map(|(_, b)| b)
                    .sum();
                assert_eq!(ledger, *storage_bytes, "rank {}: {phase:?} of unit {unit}", p.header.rank);
                assert!(memory.contains_key(&Placement::Device));
                phases += 1;
            }
        }
        assert_eq!(phases, 4 * units * STEPS * MICRO);
        // The allocator's bytes at every moment hold at least the parameter and gradient
        // buffers it allocated.
        for r in &p.records {
            if let Record::Phase { allocated, storage_bytes, .. } = r {
                assert!(allocated.is_some_and(|a| a >= *storage_bytes), "{r:?}");
            }
        }
        // Every gather is an all-gather the communication layer saw finish, issued when
        // the gather started; gradients leave through reduce-scatters, once per step.
        let gathers: Vec<f64> =
            p.records.iter().filter(|r| matches!(r, Record::Gather { .. })).map(|r| r.t()).collect();
        let runs = p.collectives();
        let all_gathers: Vec<_> = runs.iter().filter(|c| c.op == "all_gather").collect();
        assert_eq!(all_gathers.len(), gathers.len(), "rank {}", p.header.rank);
        for (k, c) in all_gathers.iter().enumerate() {
            // Issued while the engine started that gather: after the one before it.
            let after_previous = k == 0 || c.issued >= gathers[k - 1];
            assert!(after_previous && c.issued <= gathers[k], "{c:?}: gather {k} of {gathers:?}");
            assert!(c.issued <= c.start && c.start <= c.end && c.bytes > 0, "{c:?}");
        }
        let scatters = runs.iter().filter(|c| c.op == "reduce_scatter").count();
        assert!(scatters > 0 && scatters % STEPS == 0, "{scatters} reduce-scatters in {STEPS} steps");
        assert!(!p.compute_waits().is_empty(), "the engine's thread waited on some collective");
    }
}

#[test]
fn the_trace_the_summary_and_the_pictures_come_from_the_profile() {
    let dir = tempfile::tempdir().unwrap();
    record(dir.path());
    let trace = dir.path().join("trace.json");
    let o = strata(&["profile", "trace", dir.path().to_str().unwrap(), "-o", trace.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let value: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = value["traceEvents"].as_array().unwrap();
    let pids: std::collections::BTreeSet<u64> = events.iter().filter_map(|e| e["pid"].as_u64()).collect();
    assert_eq!(pids, [0, 1].into_iter().collect(), "a track group per rank");
    for e in events {
        let ph = e["ph"].as_str().unwrap();
        assert!(["M", "X", "i", "C"].contains(&ph), "{e}");
        if ph == "X" {
            assert!(e["ts"].as_f64().is_some() && e["dur"].as_f64().unwrap() >= 0.0, "{e}");
        }
    }
    let names = |cat: &str| events.iter().filter(|e| e["cat"] == cat).count();
    assert_eq!(names("forward"), 2 * 4 * STEPS * MICRO, "two ranks, four units");
    assert!(names("gather") > 0, "gathers on the communication track");
    let profiles = profile::read_dir(dir.path()).unwrap();
    let collectives: usize = profiles.iter().map(|p| p.collectives().len()).sum();
    assert_eq!(names("collective"), collectives, "each collective on its group's track");
    let o = strata(&["profile", "summary", dir.path().to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary.as_array().unwrap().len(), 2);
    assert_eq!(summary[0]["updates"], STEPS as u64);
    for rank in summary.as_array().unwrap() {
        // The critical path's parts cover the recorded time without counting any twice.
        let path = &rank["critical_path"];
        let parts: f64 =
            ["compute_s", "exposed_comm_s", "update_s", "other_s"].iter().map(|k| path[k].as_f64().unwrap()).sum();
        let seconds = rank["seconds"].as_f64().unwrap();
        assert!(path["compute_s"].as_f64().unwrap() > 0.0 && path["exposed_comm_s"].as_f64().unwrap() > 0.0);
        assert!(parts >= seconds * 0.999 && parts <= seconds * 1.001, "{parts} against {seconds}");
        let busy = rank["comm_busy_s"].as_f64().unwrap();
        let hidden = rank["comm_overlapped_s"].as_f64().unwrap();
        assert!(hidden >= 0.0 && hidden <= busy, "{hidden} of {busy}");
        assert!(rank["collectives"].as_array().unwrap().iter().any(|c| c["op"] == "all_gather"));
    }

    if !fonts_present() {
        return;
    }
    let pictures = dir.path().join("pictures");
    let o =
        strata(&["profile", "plot", dir.path().to_str().unwrap(), "-o", pictures.to_str().unwrap(), "--format", "svg"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = |name: &str| std::fs::read_to_string(pictures.join(name)).unwrap();
    // The unit map draws each stretch a unit spent gathered as one rectangle of the
    // gathered colour (and one more in each rank's legend).
    let stretches: usize = profiles.iter().map(|p| strata::profile::series::residency(p).len()).sum();
    let units = svg("units.svg");
    assert_eq!(units.matches(r##"fill="#4678C8""##).count(), stretches + profiles.len());
    for name in &profiles[0].header.units {
        assert!(texts(&units).contains(name), "row label {name}");
    }
    let memory = texts(&svg("memory.svg"));
    for want in
        ["rank 0: memory over time (Cpu)", "rank 1: memory over time (Cpu)", "allocator (whole process)", "backward"]
    {
        assert!(memory.iter().any(|t| t == want), "{want}");
    }
    assert!(texts(&svg("unit_bars.svg")).iter().any(|t| t == "activations kept for backward"));
    let o = strata(&["profile", "plot", dir.path().to_str().unwrap(), "-o", pictures.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    for name in ["memory.png", "units.png", "unit_bars.png"] {
        assert!(std::fs::read(pictures.join(name)).unwrap().starts_with(b"\x89PNG"), "{name}");
    }
}

/// A 2-stage pipeline's profile: each rank records its own stage's units (numbered as in the
/// whole model) and every micro-batch's forward and backward once per step, and its schedule
/// is drawn as a timeline with the bubble. Under the zero-bubble schedule a unit's backward
/// is still one span per micro-batch: completing the deferred weight gradients ends none.
#[test]
fn a_pipeline_profile_holds_each_stage_and_its_schedule() {
    for (schedule, operations) in
        [("1f1b", &["forward", "backward"][..]), ("zero_bubble", &["forward", "backward_input", "backward_weight"])]
    {
        let dir = tempfile::tempdir().unwrap();
        let strategy = format!(
            r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {{"schedule": "{schedule}"}}]]"#
        );
        record_run(dir.path(), 2, 4, &strategy);
        let profiles = profile::read_dir(dir.path()).unwrap();
        let units = profiles[0].header.units.len();
        let (mut forwards, mut backwards_ended) = (vec![0usize; units], vec![0usize; units]);
        for p in &profiles {
            let steps = p.operation_steps();
            assert_eq!(steps.len(), 2, "rank {}", p.header.rank);
            for ops in &steps {
                for (op, micro) in operations.iter().flat_map(|op| (0..4).map(move |m| (*op, m))) {
                    let n = ops.iter().filter(|o| o.op == op && o.micro == micro).count();
                    assert_eq!(n, 1, "{schedule} rank {}: {op} of micro-batch {micro}", p.header.rank);
                }
            }
            let bubble = p.bubble().unwrap();
            assert!(bubble > 0.0 && bubble < 1.0, "{bubble}");
            for s in p.spans() {
                if let SpanKind::Forward(u) = s.kind {
                    forwards[u] += 1;
                    // A unit computes inside one of its stage's forward operations.
                    let inside =
                        steps.iter().flatten().any(|o| o.op == "forward" && o.start <= s.start && s.end <= o.end);
                    assert!(inside, "rank {}: unit {u} at {}", p.header.rank, s.start);
                }
            }
            for r in &p.records {
                if let Record::Phase { phase: Phase::AfterBackward, unit, .. } = r {
                    backwards_ended[*unit] += 1;
                }
            }
        }
        // Every unit of the model ran on exactly one stage, once per micro-batch of each step.
        assert_eq!(forwards, vec![2 * 4; units], "{schedule}");
        assert_eq!(backwards_ended, vec![2 * 4; units], "{schedule}");
        if schedule == "1f1b" {
            draws_the_schedule(dir.path(), &profiles);
        }
    }
}

/// The pipeline's timeline picture: a box per forward.
fn draws_the_schedule(dir: &Path, profiles: &[profile::Profile]) {
    if !fonts_present() {
        return;
    }
    let o = strata(&["profile", "plot", dir.to_str().unwrap(), "--format", "svg"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let timeline = std::fs::read_to_string(dir.join("pipeline.svg")).unwrap();
    // A box per forward (blue), one more in the legend.
    let forwards: usize = profiles.iter().map(|p| p.operations().iter().filter(|o| o.op == "forward").count()).sum();
    assert_eq!(timeline.matches(r##"fill="#4678C8""##).count(), forwards + 1);
}

/// The texts of an SVG picture.
fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_string()))
        .collect()
}

/// Labels need a TrueType font; without one in the usual places the pictures are skipped.
fn fonts_present() -> bool {
    let present = strata::profile::plot::FONT_PLACES.iter().any(|p| Path::new(p).is_file());
    if !present {
        eprintln!("skipping the pictures: no font in the usual places");
    }
    present
}

#[test]
fn metrics_of_runs_are_drawn_and_bad_ones_refused() {
    if !fonts_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let metrics = |name: &str, lr: &str| {
        let path = dir.path().join(name);
        let o = strata(&[
            "train",
            "--model",
            "gpt",
            "--layers",
            "1",
            "--dim",
            "16",
            "--ctx",
            "16",
            "--batch-size",
            "4",
            "--threads",
            "1",
            "--steps",
            "4",
            "--lr",
            lr,
            "--metrics",
            path.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        path
    };
    let (a, b) = (metrics("fast.jsonl", "3e-3"), metrics("slow.jsonl", "1e-4"));
    let picture = dir.path().join("runs.svg");
    let o = strata(&["plot", a.to_str().unwrap(), b.to_str().unwrap(), "-o", picture.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = texts(&std::fs::read_to_string(&picture).unwrap());
    for want in ["loss", "learning rate", "tokens per second", "fast", "slow"] {
        assert!(svg.iter().any(|t| t == want), "{want}");
    }
    let text = std::fs::read_to_string(&a).unwrap();
    std::fs::write(&a, &text[..text.len() - 20]).unwrap();
    let plot = |p: &Path| strata(&["plot", p.to_str().unwrap(), "-o", picture.to_str().unwrap()]);
    assert_fails_with(&plot(&a), "fast.jsonl:4: not a step's metrics");
    assert_fails_with(&plot(&dir.path().join("missing.jsonl")), "missing.jsonl");
    let jpg = strata(&["plot", b.to_str().unwrap(), "-o", dir.path().join("x.jpg").to_str().unwrap()]);
    assert_fails_with(&jpg, "pictures are .png or .svg");
}

#[test]
fn bad_profile_folders_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let summary = |d: &Path| strata(&["profile", "summary", d.to_str().unwrap()]);
    assert_fails_with(&summary(dir.path()), "no profile");
    let header = r#"{"format":"strata-profile","version":2,"rank":0,"world":1,"units":["a"],"unit_param_bytes":[4],"device":"Cpu","started_at":0.0}"#;
    let file = dir.path().join("rank0.jsonl");
    std::fs::write(&file, format!("{header}\n")).unwrap();
    assert_fails_with(&summary(dir.path()), "recorded nothing");
    std::fs::write(&file, format!("{header}\n{{\"kind\":\"gather\",\"t\":0.1,\"un")).unwrap();
    assert_fails_with(&summary(dir.path()), "rank0.jsonl:2: bad record");
    std::fs::write(&file, header.replace("\"version\":2", "\"version\":1")).unwrap();
    assert_fails_with(&summary(dir.path()), "profile version 1 is not this version's (2)");
    std::fs::write(&file, header.replace("\"version\":2", "\"version\":9")).unwrap();
    assert_fails_with(&summary(dir.path()), "profile version 9");
    std::fs::write(dir.path().join("rank1.jsonl"), format!("{header}\n")).unwrap();
    std::fs::write(&file, format!("{header}\n{{\"kind\":\"gather\",\"t\":0.1,\"unit\":0}}\n")).unwrap();
    assert_fails_with(&summary(dir.path()), "every rank's file must be there once");
    // Two ranks of a world of 2, from runs of different models.
    let two = |units: &str| header.replace("\"world\":1", "\"world\":2").replace("[\"a\"]", units);
    let record = "{\"kind\":\"gather\",\"t\":0.1,\"unit\":0}";
    std::fs::write(&file, format!("{}\n{record}\n", two("[\"a\"]"))).unwrap();
    let other = two("[\"a\",\"b\"]").replace("\"rank\":0", "\"rank\":1").replace("[4]", "[4,4]");
    std::fs::write(dir.path().join("rank1.jsonl"), format!("{other}\n{record}\n")).unwrap();
    assert_fails_with(&summary(dir.path()), "rank 1 names other units than rank 0");
    let plot = strata(&["profile", "plot", dir.path().to_str().unwrap(), "-o", dir.path().join("p").to_str().unwrap()]);
    assert_fails_with(&plot, "rank 1 names other units than rank 0");
}

/// Kernel traces in libtorch's own format: the operators a thread ran are in one, with
/// their inputs' shapes; the device time per kernel is read from a trace's kernels, copies
/// and fills alone, and the host's self time per operator from its operators, less the
/// operators they called.
#[test]
fn kernel_traces_are_written_and_read_by_kernel_and_by_operator() {
    use profile::kernels;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cpu.json");
    kernels::start(false).unwrap();
    let a = tch::Tensor::ones([64, 64], (tch::Kind::Float, tch::Device::Cpu));
    let _ = a.matmul(&a);
    kernels::save(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(r#""aten::mm""#), "the product is in the trace");
    assert!(text.contains(r#""Input Dims": [[64, 64], [64, 64]]"#), "with its inputs' shapes");
    assert!(kernels::device_ms_by_name(&path).unwrap().is_empty(), "no device ran anything");
    let host = kernels::host_self_ms_by_name(&path).unwrap();
    assert!(host.get("aten::mm").is_some_and(|&ms| ms > 0.0), "the product's own time: {host:?}");
    assert!(kernels::save(&dir.path().join("none.json")).is_err(), "nothing was being recorded");
    // A GPU's trace as Kineto writes it, its host side included.
    let gpu = dir.path().join("gpu.json");
    let events = r#"{"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1500},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 2000, "dur": 500.5},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 3000, "dur": 20},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 3100, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 7},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 10},
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "python"}}
    ]}"#;
    std::fs::write(&gpu, events).unwrap();
    let ms: Vec<(String, f64)> = kernels::device_ms_by_name(&gpu).unwrap().into_iter().collect();
    let expected = [("Memcpy DtoH (Device -> Pinned)", 0.02), ("Memset (Device)", 0.005), ("gemm", 2.0005)];
    assert_eq!(ms.len(), expected.len(), "{ms:?}");
    for ((name, got), (want_name, want)) in ms.iter().zip(expected) {
        assert!(name == want_name && (got - want).abs() < 1e-12, "{ms:?}");
    }
    // Self times: a product calling a copy that calls an allocation, then a second product,
    // on one thread; a product of another thread overlapping them; device work and
    // annotations left out.
    let host = dir.path().join("host.json");
    let events = r#"{"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.1, "dur": 1000.2, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 100, "dur": 300, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 150, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1000.3, "dur": 400, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 200, "dur": 600, "tid": 2},
        {"ph": "X", "cat": "user_annotation", "name": "step", "ts": 0, "dur": 2000, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1500, "tid": "stream 7"}
    ]}"#;
    std::fs::write(&host, events).unwrap();
    let ms: Vec<(String, f64)> = kernels::host_self_ms_by_name(&host).unwrap().into_iter().collect();
    // The first product ends at 0.1 + 1000.2 µs, which f64 makes 1000.3000000000001: the
    // second, starting at 1000.3, is its neighbour, not its callee.
    let expected = [("aten::copy_", 0.25), ("aten::empty", 0.05), ("aten::mm", 0.7002 + 0.4 + 0.6)];
    assert_eq!(ms.len(), expected.len(), "{ms:?}");
    for ((name, got), (want_name, want)) in ms.iter().zip(expected) {
        assert!(name == want_name && (got - want).abs() < 1e-12, "{ms:?}");
    }
    std::fs::write(&gpu, "not a trace").unwrap();
    let err = kernels::device_ms_by_name(&gpu).unwrap_err().to_string();
    assert!(err.contains("gpu.json") && err.contains("not a Chrome trace"), "{err}");
}

/// A context ring gathers every rank's examples once per micro-batch, however many layers
/// attend over its rows and recompute: each all-gather a rank issues is that one.
#[test]
fn a_context_ring_gathers_its_rows_examples_once_per_micro_batch() {
    let dir = tempfile::tempdir().unwrap();
    record_run(dir.path(), STEPS, MICRO, r#"[["context_parallel", {"size": 2}], ["checkpoint", ["GptBlock"]]]"#);
    for p in profile::read_dir(dir.path()).unwrap() {
        let gathers = p.records.iter().filter(|r| matches!(r, Record::Collective { op, .. } if op == "all_gather"));
        assert_eq!(gathers.count(), STEPS * MICRO, "rank {}", p.header.rank);
    }
}
