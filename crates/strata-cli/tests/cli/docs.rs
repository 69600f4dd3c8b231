//! The command-line page documents `strata train`'s flags exactly: every flag the command
//! takes has a row in docs/cli.md's options table, and every flag a row names exists.
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

/// The flags `strata train --help` lists, each from the start of its own entry.
fn train_flags() -> BTreeSet<String> {
    let o = common::strata(&["train", "--help"]);
    assert!(o.status.success());
    let help = String::from_utf8_lossy(&o.stdout).into_owned();
    let entries = help.lines().filter_map(|l| l.trim_start().strip_prefix("--").map(|f| format!("--{f}")));
    entries.flat_map(|e| flags_in(e.split_whitespace().next().unwrap_or_default())).filter(|f| f != "--help").collect()
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
