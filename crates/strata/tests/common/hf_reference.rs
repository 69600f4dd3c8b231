//! The `transformers` reference (scripts/hf_reference.py) run with the project's `.venv`;
//! shared by the library's and the command line's model-folder tests.
use std::path::{Path, PathBuf};
use std::process::Command;

/// The environment's Python, if it has `transformers` (else the test says why it skips).
pub fn python() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    let ok =
        p.exists() && Command::new(&p).args(["-c", "import transformers"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipping: {} with transformers is missing (run scripts/setup.sh)", p.display());
    }
    ok.then_some(p)
}

/// Runs one command of the reference script; its standard output.
pub fn reference(py: &Path, args: &[&str]) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf_reference.py");
    let out = Command::new(py).arg(script).args(args).output().expect("python runs");
    assert!(out.status.success(), "hf_reference.py {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}
