//! The library's modules stand on floors: each imports only modules on floors below its
//! own, so data flows one way (model spec → strategy → engine → training loop). The test
//! reads the sources (comments and unit tests left out), fails on a circle, naming it, and
//! draws the floors. `STRATA_ARCHITECTURE_PICTURE=docs/pictures/architecture.png` keeps
//! the picture that docs/architecture.md shows.

use plotters::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module of the library: its source lines and the modules it names.
struct Module {
    lines: usize,
    imports: BTreeSet<String>,
}

fn rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_path_buf()];
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files.into_iter().flat_map(|p| if p.is_dir() { rust_files(&p) } else { vec![p] }).filter(|p| is_rust(p)).collect()
}

fn is_rust(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "rs")
}

/// The code of a file: its unit tests (from `#[cfg(test)]` on) and comment lines removed.
fn code_of(text: &str) -> String {
    let code = text.split("\n#[cfg(test)]").next().unwrap_or("");
    code.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The first identifier at the start of `s`.
fn identifier(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The top-level names `code` reaches through `crate::`: `crate::engine::Engine` names
/// `engine`, `use crate::{data::Step, engine}` names both.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut start) = (0, 0);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        names.insert(identifier(group[start..i].trim()).to_string());
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        names.insert(identifier(group[start..i].trim()).to_string());
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            names.insert(identifier(rest).to_string());
        }
    }
    names
}

/// Every top-level module of the library (`lib.rs`, which declares them, aside).
fn modules() -> BTreeMap<String, Module> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&src).unwrap().map(|e| e.unwrap().path()).collect();
    entries.retain(|p| p.is_dir() || (is_rust(p) && !p.ends_with("lib.rs")));
    let names: BTreeSet<String> =
        entries.iter().map(|p| p.file_stem().unwrap().to_string_lossy().into_owned()).collect();
    entries
        .iter()
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            let (mut lines, mut imports) = (0, BTreeSet::new());
            for file in rust_files(p) {
                let text = std::fs::read_to_string(&file).unwrap();
                lines += text.lines().count();
                imports.extend(crate_paths(&code_of(&text)).into_iter().filter(|n| names.contains(n) && *n != name));
            }
            (name, Module { lines, imports })
        })
        .collect()
}

/// Each module's floor (1 + the highest floor it imports from), or the first circle found.
fn floors(modules: &BTreeMap<String, Module>) -> Result<BTreeMap<String, usize>, Vec<String>> {
    fn visit(
        name: &str,
        modules: &BTreeMap<String, Module>,
        path: &mut Vec<String>,
        done: &mut BTreeMap<String, usize>,
    ) -> Result<usize, Vec<String>> {
        if let Some(&floor) = done.get(name) {
            return Ok(floor);
        }
        if let Some(at) = path.iter().position(|p| p == name) {
            let mut circle = path[at..].to_vec();
            circle.push(name.to_string());
            return Err(circle);
        }
        path.push(name.to_string());
        let mut floor = 1;
        for import in &modules[name].imports {
            floor = floor.max(1 + visit(import, modules, path, done)?);
        }
        path.pop();
        done.insert(name.to_string(), floor);
        Ok(floor)
    }
    let mut done = BTreeMap::new();
    for name in modules.keys() {
        visit(name, modules, &mut Vec::new(), &mut done)?;
    }
    Ok(done)
}

/// The floors as boxes, top floor first, with an arrow from each module to every module it
/// imports; returns the boxes' labels.
fn draw(modules: &BTreeMap<String, Module>, floors: &BTreeMap<String, usize>, path: &Path) -> Vec<String> {
    let top = floors.values().copied().max().unwrap_or(1);
    let (width, row) = (1400i32, 90i32);
    let height = row * top as i32 + 40;
    let root = BitMapBackend::new(path, (width as u32, height as u32)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    // Each box's place: its floor's row, its rank among the floor's modules.
    let mut places = BTreeMap::new();
    for floor in 1..=top {
        let here: Vec<&String> = floors.iter().filter(|(_, &f)| f == floor).map(|(n, _)| n).collect();
        let step = width / (here.len() as i32 + 1);
        for (i, name) in here.into_iter().enumerate() {
            places.insert(name.clone(), (step * (i as i32 + 1), 20 + row * (top - floor) as i32 + row / 2));
        }
    }
    for (name, module) in modules {
        let (x, y) = places[name];
        for import in &module.imports {
            let (tx, ty) = places[import];
            root.draw(&PathElement::new(vec![(x, y + 16), (tx, ty - 16)], BLACK.mix(0.25))).unwrap();
        }
    }
    let label = ("sans-serif", 15).into_font().color(&BLACK);
    let mut labels = vec![];
    for (name, module) in modules {
        let (x, y) = places[name];
        root.draw(&Rectangle::new([(x - 70, y - 16), (x + 70, y + 16)], ShapeStyle::from(&WHITE).filled())).unwrap();
        root.draw(&Rectangle::new([(x - 70, y - 16), (x + 70, y + 16)], BLUE.stroke_width(2))).unwrap();
        let text = format!("{name} ({})", module.lines);
        root.draw(&Text::new(text.clone(), (x - 64, y - 8), label.clone())).unwrap();
        labels.push(text);
    }
    for floor in 1..=top {
        let y = 20 + row * (top - floor) as i32 + row / 2 - 8;
        root.draw(&Text::new(format!("floor {floor}"), (8, y), label.clone())).unwrap();
    }
    root.present().unwrap();
    labels
}

#[test]
fn the_library_s_modules_stand_on_floors_without_a_circle() {
    let modules = modules();
    // The parts the design names, each a module of its own.
    for part in ["engine", "model", "comm", "strategy", "auto", "data", "optim", "checkpoint", "profile", "train"] {
        assert!(modules.contains_key(part), "no module {part}");
    }
    let floors = floors(&modules).unwrap_or_else(|circle| panic!("modules import in a circle: {}", circle.join(" → ")));
    // The one-way order of the design: units described by the model, executed by the
    // engine, driven step by step by the trainer, which the parallel methods build from a
    // strategy; the run on top. The engine knows no strategy: the parallel methods
    // translate one into its schedule.
    let order = ["model", "engine", "train", "parallel", "run"];
    for pair in order.windows(2) {
        let (low, high) = (pair[0], pair[1]);
        assert!(floors[low] < floors[high], "{low} stands on floor {}, {high} on {}", floors[low], floors[high]);
    }
    assert!(floors["strategy"] < floors["parallel"], "strategy stands above parallel");
    assert!(!modules["engine"].imports.contains("strategy"), "the engine imports the strategy");
    let font = strata::profile::plot::FONT_PLACES.iter().map(Path::new).find(|p| p.is_file());
    let Some(font) = font else {
        eprintln!("no font for the labels: the floors are checked, not drawn");
        return;
    };
    strata::profile::plot::use_font(font).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = std::env::var_os("STRATA_ARCHITECTURE_PICTURE").map_or_else(|| dir.path().join("a.png"), PathBuf::from);
    let labels = draw(&modules, &floors, &path);
    for name in modules.keys() {
        assert!(labels.iter().any(|l| l.starts_with(&format!("{name} ("))), "{name} is not drawn");
    }
    assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"), "{} is not a PNG", path.display());
}

#[test]
fn crate_paths_are_read_from_paths_and_groups() {
    let code = "use crate::engine::Engine;\nuse crate::{data::{Batch, Step}, optim, train::Trainer};\nlet x = crate::comm::rank();";
    let names: Vec<String> = crate_paths(code).into_iter().collect();
    assert_eq!(names, ["comm", "data", "engine", "optim", "train"]);
    assert_eq!(code_of("use crate::a;\n// crate::b\n#[cfg(test)]\nuse crate::c;"), "use crate::a;");
}
