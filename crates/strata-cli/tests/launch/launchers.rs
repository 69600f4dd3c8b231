//! `strata train` started by other launchers: PyTorch's torchrun (from the project's `.venv`;
//! skipped, with a message, where it has none) — the same run as `strata launch`, an elastic
//! restart that resumes from the newest checkpoint, bad rendezvous input — and the variables
//! Slurm's `srun` and Open MPI's `mpirun` give their tasks, set here by hand.

use crate::common::{free_port, global_gap, losses, stderr, strata, torchrun, weights};
use std::path::Path;
use std::process::{Command, Output};

const MODEL: [&str; 12] =
    ["--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--ctx", "32", "--seed", "3"];
const RUN: [&str; 10] =
    ["--batch-size", "8", "--schedule", "constant", "--threads", "1", "--lr", "0.003", "--log-every", "1000"];

/// `torchrun --standalone --nproc-per-node 2 [extra torchrun flags] --no-python strata train ARGS`.
fn under_torchrun(torchrun: &Path, launcher: &[&str], args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(torchrun);
    c.args(["--standalone", "--nproc-per-node", "2"])
        .args(launcher)
        .args(["--no-python", env!("CARGO_BIN_EXE_strata"), "train"])
        .args(args)
        .env("STRATA_LOG", "warn")
        .env_remove("STRATA_STORE_TOKEN");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("torchrun runs")
}

#[test]
fn torchrun_and_strata_launch_reach_the_same_weights() {
    let Some(torchrun) = torchrun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (ours, theirs) = (dir.path().join("launch.st"), dir.path().join("torchrun.st"));
    let args = [&MODEL[..], &RUN, &["--steps", "4", "--strategy", r#"["zero2"]"#]].concat();
    let o = strata(&[&["train"][..], &args, &["--nproc", "2", "--save-weights", ours.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let o = under_torchrun(&torchrun, &[], &[&args[..], &["--save-weights", theirs.to_str().unwrap()]].concat(), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (a, b) = (weights(&ours), weights(&theirs));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, t) in &a {
        assert!(t.equal(&b[name]), "{name} differs");
    }
}

#[test]
fn a_rank_killed_under_torchrun_is_restarted_and_resumes_from_the_newest_checkpoint() {
    let Some(torchrun) = torchrun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let args = [&MODEL[..], &RUN, &["--steps", "6"]].concat();
    let o = strata(
        &[&["train"][..], &args, &["--nproc", "2", "--metrics", &p("full.jsonl"), "--save-weights", &p("full.st")]]
            .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // Rank 1 is SIGKILLed in the middle of step 5, after the checkpoint at step 4, once.
    let fault = [("STRATA_FAULT", "backward@5"), ("STRATA_FAULT_RANK", "1"), ("STRATA_FAULT_ONCE", &p("fired"))];
    let elastic = ["--save-checkpoint", &p("ckpt"), "--checkpoint-every", "2", "--resume", "auto"];
    let outputs = ["--metrics", &p("restarted.jsonl"), "--save-weights", &p("restarted.st")];
    let o = under_torchrun(&torchrun, &["--max-restarts", "1"], &[&args[..], &elastic, &outputs].concat(), &fault);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(Path::new(&p("fired")).exists(), "the first round was killed");
    // The second round began at step 4's checkpoint (the metrics keep the first round's steps
    // 1 to 4 and go on with 5 and 6) and ends where an uninterrupted run ends. Its keys live
    // under its own round: the first round's (the shared segment's path, the ranks' process
    // ids) are never read.
    let (full, restarted) = (losses(Path::new(&p("full.jsonl"))), losses(Path::new(&p("restarted.jsonl"))));
    assert_eq!(restarted.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    for ((step, a), (_, b)) in full.iter().zip(&restarted) {
        assert!((a - b).abs() <= 1e-6 * a.abs(), "step {step}: {a} uninterrupted, {b} restarted");
    }
    let gap = global_gap(Path::new(&p("full.st")), Path::new(&p("restarted.st")));
    assert!(gap <= 1e-6, "weights differ by {gap:e}");
}

#[test]
fn resume_auto_starts_fresh_without_a_checkpoint_and_needs_a_checkpoint_folder() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let args = [&["train"][..], &MODEL, &RUN, &["--steps", "2"]].concat();
    let o = strata(
        &[&args[..], &["--resume", "auto", "--save-checkpoint", &p("ckpt"), "--metrics", &p("m.jsonl")]].concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(Path::new(&p("m.jsonl"))).len(), 2, "nothing to resume: a fresh start");
    let o = strata(
        &[
            &args[..],
            &["--steps", "3", "--resume", "auto", "--save-checkpoint", &p("ckpt"), "--metrics", &p("r.jsonl")],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(Path::new(&p("r.jsonl"))).iter().map(|r| r.0).collect::<Vec<_>>(), [3]);
    let o = strata(&[&args[..], &["--resume", "auto"]].concat());
    assert!(!o.status.success() && stderr(&o).contains("give --save-checkpoint"), "{}", stderr(&o));
}

#[test]
fn a_store_that_never_answers_is_one_line_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    // Accepts connections (the kernel completes them) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port().to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([&["train"][..], &MODEL, &RUN, &["--steps", "1", "--comm-timeout", "3"]].concat())
        .current_dir(dir.path())
        .env("STRATA_LOG", "error")
        .envs([
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
            ("TORCHELASTIC_RUN_ID", "silent"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
        ])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!o.status.success());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // Ended by the join's own 3-second limit, not by anything outside it.
    assert!(err.contains("did not answer within 3s"), "{err}");
    drop(silent);
}

/// Two ranks of `strata train ARGS` started as a launcher would, with `vars(rank)` each;
/// a rank left waiting for a peer gives up within a minute (`--comm-timeout`).
fn two_ranks_with<const N: usize>(args: &[&str], vars: impl Fn(usize) -> [(&'static str, String); N]) {
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_strata"))
                .arg("train")
                .args(args)
                .args(["--comm-timeout", "60"])
                .env("STRATA_LOG", "warn")
                .env_remove("STRATA_STORE_TOKEN")
                .envs(vars(rank))
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
}

#[test]
fn slurm_open_mpi_and_torchrun_without_an_agent_store_run_the_same_job_as_strata_launch() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let args = [&MODEL[..], &RUN, &["--steps", "3"]].concat();
    let o = strata(&[&["train"][..], &args, &["--nproc", "2", "--save-weights", &p("launch.st")]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    // srun: the store on the step's first node, the token from the user's secret.
    let (home, port) = (p("home"), free_port());
    let out = p("slurm.st");
    two_ranks_with(&[&args[..], &["--save-weights", &out]].concat(), |rank| {
        [
            ("SLURM_PROCID", rank.to_string()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_LOCALID", rank.to_string()),
            ("SLURM_NODEID", "0".into()),
            ("SLURM_TASKS_PER_NODE", "2".into()),
            ("SLURM_JOB_ID", "4242".into()),
            ("SLURM_STEP_NODELIST", "localhost".into()),
            ("MASTER_PORT", port.clone()),
            ("HOME", home.clone()),
        ]
    });
    // mpirun: Open MPI's variables, the token derived from its job id the same way.
    let port = free_port();
    let out_mpi = p("mpi.st");
    two_ranks_with(&[&args[..], &["--save-weights", &out_mpi]].concat(), |rank| {
        [
            ("OMPI_COMM_WORLD_RANK", rank.to_string()),
            ("OMPI_COMM_WORLD_SIZE", "2".into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", rank.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
            ("OMPI_MCA_ess_base_jobid", "77".into()),
            ("MASTER_PORT", port.clone()),
            ("HOME", home.clone()),
        ]
    });
    // torchrun whose agent keeps no store (TORCHELASTIC_USE_AGENT_STORE=False): rank 0 hosts
    // c10d's store itself, as PyTorch's env:// initialisation does.
    let port = free_port();
    let out_torchrun = p("torchrun-own-store.st");
    two_ranks_with(&[&args[..], &["--save-weights", &out_torchrun]].concat(), |rank| {
        [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", "2".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
            ("TORCHELASTIC_RUN_ID", "own".into()),
            ("TORCHELASTIC_RESTART_COUNT", "0".into()),
            ("TORCHELASTIC_USE_AGENT_STORE", "False".into()),
        ]
    });
    let reference = weights(Path::new(&p("launch.st")));
    for file in [out, out_mpi, out_torchrun] {
        let other = weights(Path::new(&file));
        for (name, t) in &reference {
            assert!(t.equal(&other[name]), "{file}: {name} differs");
        }
    }
}

/// `strata` ends without libtorch's exit handlers, so it finalises MPI itself: ranks that
/// used the mpi backend under a real `mpirun` end as Open MPI expects.
#[test]
fn ranks_on_the_mpi_backend_end_cleanly_under_mpirun() {
    let port = free_port();
    let run = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_ADDR", "-x", "MASTER_PORT"])
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .arg(crate::common::binary())
        .args(["bench", "comm", "--backends", "mpi", "--ops", "all_reduce", "--min-bytes", "1024"])
        .args(["--max-bytes", "1024", "--rounds", "1"])
        .output();
    let Ok(out) = run else {
        eprintln!("skipped: no mpirun here (install Open MPI)");
        return;
    };
    let err = stderr(&out);
    if err.contains("unknown backend \"mpi\"") {
        eprintln!("skipped: this build has no mpi backend (build with --features strata/mpi)");
        return;
    }
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("improperly") && !err.contains("abnormal termination"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("all_reduce"));
}
