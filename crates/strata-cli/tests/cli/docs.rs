//! The command-line page documents every command and flag exactly: every flag `strata train`
//! takes has a row in docs/cli.md's options table, every other command has a synopsis line
//! naming each of its flags, and every flag the page names exists. The environment page names
//! every variable the code reads, and the troubleshooting page quotes only messages the code
//! still says.
use crate::common;
use std::collections::BTreeSet;

/// `--flag` names in `text`.
fn flags_in(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("--") {
        let name: String =
            rest[at + 2..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-').collect();
        if name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
            found.insert(format!("--{name}"));
        }
        rest = &rest[at + 2..];
    }
    found
}

/// `strata COMMAND --help`'s text.
fn help(command: &[&str]) -> String {
    let o = common::strata(&[command, &["--help"]].concat());
    assert!(o.status.success(), "{command:?} --help");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The long flags a command's `--help` text lists, each from the start of its own entry
/// (`-o, --output` included).
fn flags_of(help: &str) -> BTreeSet<String> {
    let entries = help.lines().filter_map(|l| {
        let l = l.trim_start();
        let l = l.strip_prefix('-').filter(|r| r.chars().nth(1) == Some(',')).map_or(l, |r| r[2..].trim_start());
        l.strip_prefix("--").map(|f| format!("--{f}"))
    });
    entries.flat_map(|e| flags_in(e.split_whitespace().next().unwrap_or_default())).filter(|f| f != "--help").collect()
}

/// Every command that takes flags (one without subcommands), as the words after `strata`,
/// with its `--help` text.
fn commands(prefix: &[String]) -> Vec<(Vec<String>, String)> {
    let words: Vec<&str> = prefix.iter().map(String::as_str).collect();
    let text = help(&words);
    let subcommands: Vec<String> = text
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    if subcommands.is_empty() {
        return vec![(prefix.to_vec(), text)];
    }
    subcommands.into_iter().flat_map(|c| commands(&[prefix, &[c]].concat())).collect()
}

fn train_flags() -> BTreeSet<String> {
    flags_of(&help(&["train"]))
}

/// The page's synopsis lines (its first block) of `command`: those that begin with it.
fn synopsis(page: &str, command: &[String]) -> String {
    let block = page.split("```sh").nth(1).and_then(|b| b.split("```").next()).unwrap_or_default();
    let start = format!("strata {}", command.join(" "));
    block
        .lines()
        .filter(|l| l.strip_prefix(&start).is_some_and(|rest| rest.is_empty() || rest.starts_with(' ')))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The flags the first column of docs/cli.md's `strata train` options table names, and the
/// one the sentence before it names (`--config`).
fn documented_flags() -> BTreeSet<String> {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/cli.md")).unwrap();
    let start = page.find("`strata train` options").expect("the options table's heading sentence");
    let table = page[start..].lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|'));
    let mut flags: BTreeSet<String> =
        table.flat_map(|row| flags_in(row.split(" | ").next().unwrap_or_default())).collect();
    flags.insert("--config".into());
    flags
}

#[test]
fn every_train_flag_is_documented_and_every_documented_flag_exists() {
    let (taken, documented) = (train_flags(), documented_flags());
    assert!(taken.len() > 60, "the flags were read from --help: {taken:?}");
    let undocumented: Vec<_> = taken.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&taken).collect();
    assert!(undocumented.is_empty(), "flags of strata train missing from docs/cli.md: {undocumented:?}");
    assert!(unknown.is_empty(), "docs/cli.md documents flags strata train does not take: {unknown:?}");
}

#[test]
fn every_command_has_a_synopsis_naming_exactly_its_flags() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/cli.md")).unwrap();
    let commands = commands(&[]);
    let names: Vec<&Vec<String>> = commands.iter().map(|(c, _)| c).collect();
    assert!(names.len() > 25, "the commands were read from --help: {names:?}");
    for (command, help) in commands.iter().filter(|(c, _)| c[..] != ["train"]) {
        let line = synopsis(&page, command);
        assert!(!line.is_empty(), "docs/cli.md has no synopsis line for strata {}", command.join(" "));
        let (taken, documented) = (flags_of(help), flags_in(&line));
        let undocumented: Vec<_> = taken.difference(&documented).collect();
        let unknown: Vec<_> = documented.difference(&taken).collect();
        assert!(
            undocumented.is_empty(),
            "strata {}: flags missing from docs/cli.md: {undocumented:?}",
            command.join(" ")
        );
        assert!(
            unknown.is_empty(),
            "strata {}: docs/cli.md names flags it does not take: {unknown:?}",
            command.join(" ")
        );
    }
}

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
