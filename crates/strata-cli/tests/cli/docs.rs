//! The environment page names every variable the code reads, and the troubleshooting page
//! quotes only messages the code still says. (That the command-line page names every command
//! and flag exactly is checked against the parser itself, in the binary's own tests.)
use std::collections::BTreeSet;

/// Every source file of the workspace's crates.
fn sources() -> Vec<std::path::PathBuf> {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = vec![];
    for krate in ["strata", "strata-cli", "strata-ext"] {
        walk(&crates.join(krate).join("src"), &mut out);
    }
    out
}

/// Upper-case names in the code that are not environment variables it reads (`LC_ALL` is
/// set for a child process a test runs).
const NOT_VARIABLES: [&str; 12] = [
    "BACKWARD_POST",
    "BACKWARD_PRE",
    "CAUSAL_LM",
    "SEQ_CLS",
    "FULL_SHARD",
    "HALF_SHARD",
    "HYBRID_SHARD",
    "NO_SHARD",
    "SHARD_GRAD_OP",
    "LABEL_0",
    "LABEL_1",
    "LC_ALL",
];

/// The environment variables the code names: upper-case string literals with an
/// underscore (cargo's own `CARGO_*` aside), and any name read or set through `var`,
/// `var_os`, `env` or `try_from_env`.
fn variables_in_code() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for file in sources() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (at, _) in text.match_indices('"') {
            let literal: String = text[at + 1..].chars().take_while(|c| *c != '"').collect();
            let upper = literal.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            let before = &text[..at];
            let called = ["var(", "var_os(", "env(", "try_from_env("].iter().any(|f| before.ends_with(f));
            let valid = !literal.is_empty() && literal.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if valid
                && (called || (upper && literal.contains('_') && literal.starts_with(|c: char| c.is_ascii_uppercase())))
            {
                names.insert(literal);
            }
        }
    }
    names.retain(|n| !n.starts_with("CARGO_") && !NOT_VARIABLES.contains(&n.as_str()) && n != "SCREAMING_SNAKE_CASE");
    names
}

#[test]
fn every_environment_variable_is_documented() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/environment.md")).unwrap();
    let table = page.lines().filter(|l| l.starts_with("| `"));
    let documented: BTreeSet<String> = table
        .flat_map(|row| {
            let first = row.split(" | ").next().unwrap_or_default().to_string();
            first.split('`').skip(1).step_by(2).map(str::to_string).collect::<Vec<_>>()
        })
        .collect();
    let read = variables_in_code();
    assert!(read.contains("STRATA_LOG") && read.contains("RANK"), "the names were read from the code: {read:?}");
    let undocumented: Vec<_> = read.difference(&documented).collect();
    let gone: Vec<_> = documented.difference(&read).collect();
    assert!(undocumented.is_empty(), "variables the code reads missing from docs/environment.md: {undocumented:?}");
    assert!(gone.is_empty(), "docs/environment.md documents variables the code no longer names: {gone:?}");
}

/// The error lines of `page`'s ```text blocks, without their `error: `.
fn quoted_errors(page: &str) -> Vec<String> {
    let mut inside = false;
    let mut out = vec![];
    for line in page.lines() {
        if line.starts_with("```") {
            inside = line == "```text";
        } else if let Some(message) = line.strip_prefix("error: ").filter(|_| inside) {
            out.push(message.to_string());
        }
    }
    out
}

/// Each error message the troubleshooting page quotes is still the code's: split where
/// figures and names vary (`…`) and where messages nest (`: `), every piece long enough to
/// mean something stands in some source file.
#[test]
fn every_message_the_troubleshooting_page_quotes_is_in_the_code() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/troubleshooting.md")).unwrap();
    let code: String = sources().iter().map(|f| std::fs::read_to_string(f).unwrap()).collect();
    let messages = quoted_errors(&page);
    assert!(messages.len() >= 6, "the page quotes its messages in ```text blocks: {messages:?}");
    for message in messages {
        let pieces = message.split('…').flat_map(|p| p.split(": ")).map(str::trim);
        for piece in pieces.filter(|p| p.chars().count() >= 12) {
            assert!(code.contains(piece), "docs/troubleshooting.md quotes {piece:?} ({message}), which no source says");
        }
    }
}
