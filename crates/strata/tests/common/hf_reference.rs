//! The `transformers` reference (scripts/hf_reference.py) run with the project's `.venv`;
//! shared by the library's and the command line's model-folder tests. One reference process
//! per test binary answers every command (`serve`), so `transformers` is imported once.
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock};

/// The environment's Python, if it has `transformers` (else the test says why it skips).
/// Asked once per test binary: importing `transformers` takes seconds.
pub fn python() -> Option<PathBuf> {
    static FOUND: OnceLock<Option<PathBuf>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
        let ok = p.exists()
            && Command::new(&p).args(["-c", "import transformers"]).output().is_ok_and(|o| o.status.success());
        ok.then_some(p)
    });
    if found.is_none() {
        eprintln!("skipping: .venv/bin/python with transformers is missing (run scripts/setup.sh)");
    }
    found.clone()
}

/// The serving reference process: commands in, one JSON answer a line out; its standard
/// error (warnings, tracebacks) goes to `log`. It ends when the test binary does, as its
/// standard input closes.
struct Server {
    /// Held, never waited for: it exits by itself once `commands` closes.
    _process: Child,
    commands: ChildStdin,
    answers: BufReader<ChildStdout>,
    log: PathBuf,
}

static SERVER: Mutex<Option<Server>> = Mutex::new(None);

fn start(py: &Path) -> Server {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf_reference.py");
    let exe = std::env::current_exe().expect("the test binary's path");
    let binary = exe.file_stem().and_then(|s| s.to_str()).unwrap_or("tests");
    let log = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("hf_reference-{binary}.log"));
    let errors = std::fs::File::create(&log).expect("the reference's log can be written");
    let mut child = Command::new(py)
        .arg(script)
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(errors)
        .spawn()
        .expect("python runs");
    let commands = child.stdin.take().expect("piped");
    let answers = BufReader::new(child.stdout.take().expect("piped"));
    Server { _process: child, commands, answers, log }
}

/// Runs one command of the reference script; its standard output.
pub fn reference(py: &Path, args: &[&str]) -> String {
    let (answer, log) = {
        let mut server = SERVER.lock().unwrap_or_else(|e| e.into_inner());
        let s = server.get_or_insert_with(|| start(py));
        writeln!(s.commands, "{}", serde_json::to_string(args).unwrap()).expect("the reference takes commands");
        s.commands.flush().unwrap();
        let mut line = String::new();
        s.answers.read_line(&mut line).expect("the reference answers");
        (line, s.log.clone())
    };
    let answer: serde_json::Value = serde_json::from_str(&answer)
        .unwrap_or_else(|e| panic!("hf_reference.py {args:?} gave no answer ({e}); see {}", log.display()));
    assert!(answer["ok"] == true, "hf_reference.py {args:?}: {} (see {})", answer["error"], log.display());
    answer["out"].as_str().unwrap_or_default().to_string()
}
