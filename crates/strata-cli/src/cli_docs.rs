//! docs/cli.md names every command and flag exactly: every flag `strata train` takes has a
//! row in its options table, every other command has a synopsis line naming each of its
//! flags, and every flag the page names exists. Read from the parser itself, as `--help`
//! lists them (hidden flags and `--help` aside).
use crate::Cli;
use clap::CommandFactory;
use std::collections::BTreeSet;

fn page() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/cli.md")).expect("docs/cli.md")
}

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

/// The long flags `--help` lists for `command`.
fn flags_of(command: &clap::Command) -> BTreeSet<String> {
    let shown = command.get_arguments().filter(|a| !a.is_hide_set());
    shown.filter_map(|a| a.get_long()).filter(|l| *l != "help").map(|l| format!("--{l}")).collect()
}

/// Every command without subcommands, as the words after `strata`, with its flags.
fn commands(prefix: &[String], command: &clap::Command) -> Vec<(Vec<String>, BTreeSet<String>)> {
    let subcommands: Vec<&clap::Command> = command.get_subcommands().filter(|c| !c.is_hide_set()).collect();
    if subcommands.is_empty() {
        return vec![(prefix.to_vec(), flags_of(command))];
    }
    let named = |c: &clap::Command| [prefix, &[c.get_name().to_string()]].concat();
    subcommands.into_iter().flat_map(|c| commands(&named(c), c)).collect()
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

/// The flags the first column of the `strata train` options table names, and the one the
/// sentence before it names (`--config`).
fn documented_train_flags(page: &str) -> BTreeSet<String> {
    let start = page.find("`strata train` options").expect("the options table's heading sentence");
    let table = page[start..].lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|'));
    let mut flags: BTreeSet<String> =
        table.flat_map(|row| flags_in(row.split(" | ").next().unwrap_or_default())).collect();
    flags.insert("--config".into());
    flags
}

/// What `taken` and `documented` do not share, as a message naming both sides.
fn mismatch(what: &str, taken: &BTreeSet<String>, documented: &BTreeSet<String>) -> Option<String> {
    let undocumented: Vec<_> = taken.difference(documented).collect();
    let unknown: Vec<_> = documented.difference(taken).collect();
    (!undocumented.is_empty() || !unknown.is_empty()).then(|| {
        format!("{what}: flags missing from docs/cli.md: {undocumented:?}; named there but not taken: {unknown:?}")
    })
}

#[test]
fn every_train_flag_is_documented_and_every_documented_flag_exists() {
    let cli = Cli::command();
    let train = cli.find_subcommand("train").expect("strata train");
    let taken = flags_of(train);
    assert!(taken.len() > 60, "the flags were read from the parser: {taken:?}");
    if let Some(message) = mismatch("strata train", &taken, &documented_train_flags(&page())) {
        panic!("{message}");
    }
}

#[test]
fn every_command_has_a_synopsis_naming_exactly_its_flags() {
    let page = page();
    let commands = commands(&[], &Cli::command());
    assert!(commands.len() > 25, "the commands were read from the parser: {}", commands.len());
    for (command, taken) in commands.iter().filter(|(c, _)| c[..] != ["train"]) {
        let line = synopsis(&page, command);
        assert!(!line.is_empty(), "docs/cli.md has no synopsis line for strata {}", command.join(" "));
        if let Some(message) = mismatch(&format!("strata {}", command.join(" ")), taken, &flags_in(&line)) {
            panic!("{message}");
        }
    }
}

/// The checks read what `--help` shows: a flag the page lacks, or one it names that no
/// command takes, is found.
#[test]
fn a_flag_missing_from_the_page_or_unknown_to_the_parser_is_found() {
    let taken: BTreeSet<String> = ["--a", "--b"].map(String::from).into();
    let documented: BTreeSet<String> = ["--b", "--c"].map(String::from).into();
    let message = mismatch("strata x", &taken, &documented).expect("a mismatch");
    assert!(message.contains(r#"["--a"]"#) && message.contains(r#"["--c"]"#), "{message}");
    assert!(mismatch("strata x", &taken, &taken).is_none());
    assert_eq!(flags_in("strata x [--one N] [--two-three] -- --"), ["--one", "--two-three"].map(String::from).into());
}
