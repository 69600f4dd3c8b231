//! Helpers shared by the command-line tests.
#![allow(dead_code)] // each test binary uses its own subset
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::OnceLock;

/// The binary under test: `STRATA_BIN` where set (test binaries built on another machine,
/// run beside a copy of the binary), else the one cargo built with them.
pub fn binary() -> String {
    std::env::var("STRATA_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_strata").to_string())
}

/// The project's environment's Python (scripts/setup.sh makes it), if it exists; a test
/// that needs it says why it skips otherwise.
pub fn venv_python() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    if !p.exists() {
        eprintln!("skipping: {} is missing (run scripts/setup.sh)", p.display());
        return None;
    }
    Some(p)
}

pub fn strata(args: &[&str]) -> Output {
    strata_env(args, &[])
}

pub fn strata_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    strata_in(&std::env::current_dir().expect("a working folder"), args, env)
}

/// The binary under test run in the folder `cwd` with `args`, the variables `env` added to
/// ours: by this test binary's `strata fork-server` where it may, else as a process of its
/// own.
pub fn strata_in(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    if let Some(output) = run_forked(cwd, args, env) {
        return output;
    }
    let mut c = Command::new(binary());
    c.args(args).current_dir(cwd);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the strata binary runs")
}

/// The socket of a `strata fork-server` this test binary started (once), which ends when
/// the test binary does; `None` if it could not start.
fn fork_server() -> Option<&'static Path> {
    static SOCKET: OnceLock<Option<PathBuf>> = OnceLock::new();
    SOCKET
        .get_or_init(|| {
            let socket = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("fork-server-{}", std::process::id()));
            let _ = std::fs::remove_file(&socket);
            let server = fork_server_start(&socket, &[]);
            if server.is_none() {
                eprintln!("the fork server did not start: commands run as processes of their own");
            }
            server.map(|_| socket)
        })
        .as_deref()
}

/// Starts `strata fork-server --socket SOCKET EXTRA` and waits for the line it says once it
/// takes commands; `None` if it ended first.
pub fn fork_server_start(socket: &Path, extra: &[&str]) -> Option<std::process::Child> {
    let mut server = Command::new(binary())
        .args(["fork-server", "--socket"])
        .arg(socket)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .ok()?;
    let mut line = String::new();
    BufReader::new(server.stdout.take()?).read_line(&mut line).ok()?;
    line.starts_with("listening on").then_some(server)
}

/// `strata args` run by the fork server, or `None`, before anything ran, where it cannot:
/// a variable in `env` other than Strata's own may be one a library reads only when a
/// process starts, which the server's copies read long before.
fn run_forked(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Option<Output> {
    if !env.iter().all(|(k, _)| k.starts_with("STRATA_")) {
        return None;
    }
    fork_server_run(fork_server()?, cwd, args, env)
}

/// `strata args` run in `cwd` by the fork server listening on `socket`, with our variables
/// and those of `env`; `None` if the server cannot be reached (nothing ran).
pub fn fork_server_run(socket: &Path, cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Option<Output> {
    let mut connection = UnixStream::connect(socket).ok()?;
    let streams = tempfile::tempdir().expect("a temporary folder");
    let (stdout, stderr) = (streams.path().join("stdout"), streams.path().join("stderr"));
    let mut vars: BTreeMap<String, String> = std::env::vars().collect();
    vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let command_line: Vec<String> = std::iter::once(binary()).chain(args.iter().map(|a| a.to_string())).collect();
    let request = serde_json::json!({
        "args": command_line,
        "env": vars.into_iter().collect::<Vec<_>>(),
        "cwd": cwd,
        "stdout": stdout,
        "stderr": stderr,
    });
    writeln!(connection, "{request}").expect("the fork server takes the command");
    let mut status = String::new();
    BufReader::new(&connection).read_line(&mut status).expect("the fork server answers");
    let status: i32 = status.trim().parse().unwrap_or_else(|_| panic!("the fork server's answer: {status:?}"));
    Some(Output {
        status: ExitStatus::from_raw(status),
        stdout: std::fs::read(&stdout).expect("the command's standard output"),
        stderr: std::fs::read(&stderr).expect("the command's standard error"),
    })
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The run failed, and an error line of its output says `expected`.
pub fn assert_fails_with(o: &Output, expected: &str) {
    let text = stderr(o);
    assert!(!o.status.success(), "{expected}: the run must fail");
    let line = text.lines().find(|l| l.contains(expected)).unwrap_or_else(|| panic!("{expected}:\n{text}"));
    assert!(line.contains("error"), "one error line says it: {line}");
}

pub fn weights(path: &Path) -> BTreeMap<String, tch::Tensor> {
    strata::io::read_safetensors(path).unwrap()
}

/// Largest relative difference ‖a − b‖ / ‖a‖ over the tensors of two weight files.
pub fn weight_gap(a: &Path, b: &Path) -> f64 {
    let (a, b) = (weights(a), weights(b));
    a.iter().map(|(k, t)| (t - &b[k]).norm().double_value(&[]) / t.norm().double_value(&[])).fold(0.0, f64::max)
}

/// Relative difference of all parameters as one vector, ‖θa − θb‖ / ‖θa‖.
pub fn global_gap(a: &Path, b: &Path) -> f64 {
    let (a, b) = (weights(a), weights(b));
    let sq = |t: &tch::Tensor| t.to_kind(tch::Kind::Double).square().sum(tch::Kind::Double).double_value(&[]);
    let diff: f64 = a.iter().map(|(k, t)| sq(&(t.to_kind(tch::Kind::Double) - b[k].to_kind(tch::Kind::Double)))).sum();
    let norm: f64 = a.values().map(sq).sum();
    (diff / norm).sqrt()
}

/// A finished training run: its saved weights and its metrics file.
pub type Run = (PathBuf, PathBuf);

/// `strata train` for `steps` steps with the flags of `args`, its weights and metrics
/// saved as `name` in `dir`; the run must succeed.
pub fn train_run(dir: &Path, name: &str, steps: usize, args: &[&[&str]]) -> Run {
    let (w, m) = (dir.join(format!("{name}.st")), dir.join(format!("{name}.jsonl")));
    let steps = steps.to_string();
    let files = ["--steps", &steps, "--save-weights", w.to_str().unwrap(), "--metrics", m.to_str().unwrap()];
    let flags = args.concat();
    let o = strata(&[&["train"][..], &flags, &files].concat());
    assert!(o.status.success(), "{name} {flags:?}:\n{}", stderr(&o));
    (w, m)
}

/// `other` follows `one` step for step: every loss within a relative `loss` of one's, and
/// the final weights within a global gap of `weights`.
pub fn assert_follows(one: &Run, other: &Run, what: &str, loss: f64, weights: f64) {
    assert_losses_follow(&one.1, &other.1, what, loss);
    let gap = global_gap(&one.0, &other.0);
    eprintln!("{what}: weights differ by {gap:.2e}");
    assert!(gap < weights, "{what}: weights differ by {gap:e}");
}

/// Every step's loss in the metrics file `other` is within `bound` (relative) of the same
/// step's in `one`, and both hold the same steps.
pub fn assert_losses_follow(one: &Path, other: &Path, what: &str, bound: f64) {
    let (expected, got) = (losses(one), losses(other));
    assert_eq!(expected.len(), got.len(), "{what}: steps recorded");
    for ((step, a), (_, b)) in expected.iter().zip(&got) {
        assert!(((a - b) / a).abs() < bound, "{what}: step {step} loss {b} against {a}");
    }
}

/// The step reports of a metrics file, one per line.
pub fn reports(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Per-step losses of a metrics file.
pub fn losses(path: &Path) -> Vec<(u64, f64)> {
    reports(path).iter().map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap())).collect()
}

/// A folder of runs shared by the cases of one test module — the one-process baseline many
/// cases compare with — made by `make` once, on first use, under cargo's temporary folder for
/// tests. Each case is then its own test, named by its configuration, yet the baseline trains
/// once. `key` names the folder within the calling module (its file): modules of one binary
/// may use the same keys for baselines of their own.
#[track_caller]
pub fn shared_dir(key: &str, make: impl FnOnce(&Path)) -> PathBuf {
    let module = Path::new(std::panic::Location::caller().file()).file_stem().unwrap().to_string_lossy();
    let key = &format!("{module}-{key}");
    use std::sync::Mutex;
    static MADE: Mutex<Option<(PathBuf, Vec<String>)>> = Mutex::new(None);
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    let (root, keys) = made.get_or_insert_with(|| {
        let exe = std::env::current_exe().unwrap();
        let name = exe.file_stem().and_then(|s| s.to_str()).unwrap_or("tests").to_string();
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-shared"));
        let _ = std::fs::remove_dir_all(&root);
        (root, vec![])
    });
    let dir = root.join(key);
    if !keys.iter().any(|k| k == key) {
        std::fs::create_dir_all(&dir).unwrap();
        make(&dir);
        keys.push(key.to_string());
    }
    dir
}

/// A loopback port free at the moment of asking.
pub fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// The project's torchrun (`scripts/setup.sh` installs it in `.venv`); `None`, saying the
/// test is skipped, where it is missing.
pub fn torchrun() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/torchrun");
    if path.exists() {
        Some(path)
    } else {
        eprintln!("skipping: {} is missing (run scripts/setup.sh)", path.display());
        None
    }
}
