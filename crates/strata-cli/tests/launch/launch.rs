//! `strata launch` and `strata bench comm` end to end.

use crate::common::{strata, strata_env, weight_gap};
use std::time::{Duration, Instant};

#[test]
fn ranks_get_torchrun_variables_and_prefixed_output() {
    let out = strata(&[
        "launch",
        "--nproc-per-node",
        "3",
        "--",
        "sh",
        "-c",
        "echo \"R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE A=$MASTER_ADDR P=${MASTER_PORT:+set} T=${#STRATA_STORE_TOKEN}\"; echo to-stderr >&2",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for r in 0..3 {
        let line = format!("[rank {r}] R={r} W=3 L={r} LW=3 A=127.0.0.1 P=set T=32");
        assert!(stdout.lines().any(|l| l == line), "missing {line:?} in\n{stdout}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("[rank {r}] to-stderr")));
    }
}

#[test]
fn ranks_running_strata_are_forks_of_the_launcher_and_other_commands_fresh_processes() {
    let debug = [("STRATA_LOG", "strata::launch=debug")];
    let tiny =
        ["train", "--model", "gpt", "--layers", "1", "--heads", "2", "--dim", "16", "--ctx", "8", "--steps", "1"];
    let forked = strata_env(&[&tiny[..], &["--nproc", "2"]].concat(), &debug);
    let fresh = strata_env(&["launch", "--nproc-per-node", "2", "--", "sh", "-c", "true"], &debug);
    for (out, way) in [(&forked, "a fork of the launcher"), (&fresh, "a fresh process")] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert_eq!(err.matches(&format!("rank started as {way}")).count(), 2, "{err}");
    }
}

#[test]
fn a_failing_or_killed_rank_stops_the_others_and_is_named() {
    for (ranks, script, expected) in [
        ("3", "if [ \"$RANK\" = 2 ]; then exit 3; fi; sleep 60", "rank 2 exited with status 3"),
        ("2", "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; sleep 60", "rank 1 was killed by signal 9"),
    ] {
        let start = Instant::now();
        let out = strata(&["launch", "--nproc-per-node", ranks, "--", "sh", "-c", script]);
        assert!(start.elapsed() < Duration::from_secs(30), "the sleeping ranks were not stopped");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{err}");
    }
}

#[test]
fn bad_launch_arguments_are_one_line_errors() {
    for args in [
        &["launch", "--nproc-per-node", "0", "--", "true"][..],
        &["launch", "--nnodes", "2", "--node-rank", "2", "--", "true"],
        &["launch", "--grace", "inf", "--", "true"],
        &["launch", "--grace", "-1", "--", "true"],
    ] {
        let out = strata(args);
        assert!(!out.status.success());
        assert_eq!(String::from_utf8_lossy(&out.stderr).trim().lines().count(), 1, "{args:?}");
    }
    let out = strata(&["launch", "--", "/no/such/program"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/program"));
}

#[test]
fn bench_comm_runs_real_collectives_under_the_launcher() {
    let out = strata(&["bench", "comm", "--nproc", "2", "--min-bytes", "4096", "--max-bytes", "65536", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Only rank 0's report, unprefixed: the whole of stdout is one JSON document.
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["world_size"], 2);
    let rows = report["rows"].as_array().unwrap();
    // shm measures private and shared buffers; tcp offers no shared memory.
    assert_eq!(rows.len(), 3 * 4 * 3, "(shm private, shm shared, tcp private) × 4 operations × 3 sizes");
    assert!(rows.iter().any(|r| r["buffers"] == "shared" && r["backend"] == "shm"));
    assert!(rows.iter().all(|r| r["buffers"] == "private" || r["backend"] == "shm"));
    assert!(rows.iter().all(|r| r["busbw_gbps"].as_f64().unwrap() > 0.0));
    // gloo measured the same operations and sizes in the same run.
    assert!(rows.iter().all(|r| r["gloo_time_us"].as_f64().unwrap() > 0.0 && r["speedup_vs_gloo"].is_number()));
    assert!(report["memcpy_gbps"][0][1].as_f64().unwrap() > 0.0);
    // Below 16 MiB caches set the pace: no memcpy is timed beside the rows.
    assert!(rows.iter().all(|r| r["memcpy_beside_gbps"].is_null()));
    let sizes = ["--min-bytes", "16777216", "--max-bytes", "16777216"];
    let quick = ["--backends", "shm", "--ops", "all_reduce", "--buffers", "private", "--warmup", "1", "--rounds", "2"];
    let out = strata(&[&["bench", "comm", "--nproc", "2", "--no-reference", "--json"][..], &sizes, &quick].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["rows"][0]["memcpy_beside_gbps"].as_f64().unwrap() > 0.0, "{report}");
}

#[test]
fn train_nproc_is_data_parallel_and_matches_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str], out: &str| {
        let path = dir.path().join(out);
        let base =
            ["train", "--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--ctx", "32", "--steps", "10"];
        let rest = ["--batch-size", "8", "--seed", "3", "--schedule", "constant", "--threads", "1", "--save-weights"];
        let o = strata(&[&base[..], &rest, &[path.to_str().unwrap()], extra].concat());
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        path
    };
    // SGD with momentum is linear in the gradients: ranks must agree to float rounding.
    let sgd = ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.1"];
    let one = run(&sgd, "one.st");
    for (extra, name) in [
        (&["--nproc", "2"][..], "two.st"),
        (&["--nproc", "4"], "four.st"),
        (&["--nproc", "2", "--accumulation", "2"], "acc.st"),
    ] {
        let gap = weight_gap(&one, &run(&[&sgd[..], extra].concat(), name));
        assert!(gap < 1e-5, "{extra:?}: relative weight difference {gap:e}");
    }
    // The ranks really learned together: one rank alone on its half batch would differ.
    let half = run(&[&sgd[..], &["--batch-size", "4"]].concat(), "half.st");
    assert!(weight_gap(&one, &half) > 1e-3);
}

/// Without `--threads`, the ranks of a host split its cores instead of each taking all.
#[test]
fn ranks_share_the_cores_unless_told_otherwise() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let base = ["train", "--model", "mlp", "--layers", "1", "--dim", "8", "--steps", "1", "--nproc", "2"];
    let run = |extra: &[&str], omp: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_strata"));
        c.args(base).args(extra).env_remove("OMP_NUM_THREADS");
        if let Some(n) = omp {
            c.env("OMP_NUM_THREADS", n);
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let shared = run(&[], None);
    let expected = format!("threads={}", (cores / 2).max(1));
    assert!(shared.contains("compute threads per rank") && shared.contains(&expected), "{shared}");
    for told in [run(&["--threads", "1"], None), run(&[], Some("1"))] {
        assert!(!told.contains("compute threads per rank"), "{told}");
    }
}

/// `--unit-times` writes each unit's forward and backward seconds and the communication
/// waited for around them; the units' waits are part of the step's. Under a pipeline every
/// unit is timed on the rank of its stage, and the metrics hold them all.
#[test]
fn unit_times_cover_every_unit_within_the_step() {
    let pipeline =
        r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {"balance": "parameters"}]]"#;
    for strategy in [r#"["fsdp"]"#, pipeline] {
        assert_eq!(steps_with_unit_times(strategy), 3, "{strategy}: one line per step");
    }
}

/// The steps of a 2-rank run of `strategy` with `--unit-times`, after checking that every
/// unit of the 4 was timed (and, outside a pipeline, within the step's time and waits).
fn steps_with_unit_times(strategy: &str) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let args = ["train", "--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--ctx", "32"];
    let rest = ["--steps", "3", "--batch-size", "4", "--threads", "1", "--nproc", "2", "--strategy", strategy];
    let out = strata(&[&args[..], &rest, &["--unit-times", "true", "--metrics", metrics.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{strategy}: {}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&metrics).unwrap();
    for line in text.lines() {
        let step: serde_json::Value = serde_json::from_str(line).unwrap();
        let units = step["unit_times"].as_array().unwrap();
        // Embedding, two blocks, head.
        assert_eq!(units.iter().map(|u| u["unit"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2, 3]);
        for u in units {
            assert!(u["forward_s"].as_f64().unwrap() > 0.0 && u["backward_s"].as_f64().unwrap() > 0.0, "{u}");
        }
        // A pipeline's stages run side by side: their units' times are not parts of one rank's.
        if step.get("pipeline").is_some() {
            continue;
        }
        let waited: f64 = units.iter().map(|u| u["comm_wait_s"].as_f64().unwrap()).sum();
        assert!(waited <= step["comm_wait_s"].as_f64().unwrap() + 1e-6, "{step}");
        // The units' forwards and backwards run one after another inside the step.
        let computed: f64 =
            units.iter().map(|u| u["forward_s"].as_f64().unwrap() + u["backward_s"].as_f64().unwrap()).sum();
        assert!(computed <= step["seconds"].as_f64().unwrap(), "{step}");
    }
    text.lines().count()
}

/// Ranks started by `--nproc` that all fail alike (an input none can read, a freeze that
/// names nothing) are one error line, as one process would be.
#[test]
fn ranks_that_fail_alike_are_one_error_line() {
    let base = ["train", "--model", "mlp", "--layers", "1", "--dim", "8", "--steps", "1", "--nproc", "2"];
    for (flags, expected) in [
        (["--data", "no-such-file.txt"], "error: no-such-file.txt: No such file or directory"),
        (["--freeze", "nothing"], "error: invalid configuration: freeze: no parameter name contains \"nothing\""),
    ] {
        let o = strata(&[&base[..], &flags].concat());
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{flags:?}: {err}");
        assert!(err.starts_with(expected), "{flags:?}: {err}");
    }
}
