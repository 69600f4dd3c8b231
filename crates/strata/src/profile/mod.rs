//! The profiler: records what an engine and its schedule report — every phase of every unit
//! with the ledger's bytes per placement and category at that moment, every gather and free,
//! every copy between device and host and eviction, the update — stamped with the time it
//! arrives, one JSON-lines file per rank; and reads such files back, validated. A Chrome
//! trace ([`trace`]) and a summary ([`summary`]) are made from what it reads.
//!
//! Owns: the on-disk format and its validation. Must not time anything inside the engine
//! or the schedules: it stamps the events handed to it through the engine's one sink.
//!
//! The format (`strata-profile`, version [`VERSION`]): the first line is a [`Header`]
//! (`{"format": "strata-profile", "version": 1, "rank", "world", "units": [names],
//! "device"}`); every other line is a [`Record`] tagged by `kind` (`phase`, `gather`,
//! `freed`, `copy`, `evict`, `update`) with `t`, seconds since recording started.
pub mod summary;
pub mod trace;

use crate::engine::{Category, Engine, Event, EventSink, MemoryLedger, Phase, Placement};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub const FORMAT: &str = "strata-profile";
pub const VERSION: u32 = 1;

/// The first line of a rank's profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    pub format: String,
    pub version: u32,
    pub rank: usize,
    pub world: usize,
    /// The units' names, in order.
    pub units: Vec<String>,
    pub device: String,
}

/// Bytes the ledger counts now, per placement and category.
pub type Memory = BTreeMap<Placement, BTreeMap<Category, u64>>;

/// One event as recorded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Record {
    /// The schedule has run for `phase` of `unit` (the unit computes between a `before_*`
    /// and its `after_*`); `storage_bytes`: what the buffers of parameters and gradients
    /// hold from the allocator then (the ledger's `params` and `grads` say the same).
    Phase { t: f64, phase: Phase, unit: usize, memory: Memory, storage_bytes: u64 },
    /// A gather of `unit`'s parameters started.
    Gather { t: f64, unit: usize },
    /// `unit`'s gathered parameters were freed.
    Freed { t: f64, unit: usize },
    /// `bytes` of `unit`'s states were copied to `to`.
    Copy { t: f64, unit: usize, to: Placement, bytes: u64 },
    /// The device copy of `unit`'s parameters was released.
    Evict { t: f64, unit: usize },
    /// The update began (`done: false`) or the step ended (`done: true`).
    Update { t: f64, done: bool, memory: Memory },
}

impl Record {
    pub fn t(&self) -> f64 {
        match *self {
            Record::Phase { t, .. }
            | Record::Gather { t, .. }
            | Record::Freed { t, .. }
            | Record::Copy { t, .. }
            | Record::Evict { t, .. }
            | Record::Update { t, .. } => t,
        }
    }
}

/// Records an engine's events while started (PatrickStar's `profiler.start()` /
/// `end()` / `save()`).
pub struct Profiler {
    header: Header,
    ledger: Arc<MemoryLedger>,
    started: Instant,
    recording: AtomicBool,
    records: Mutex<Vec<Record>>,
}

impl Profiler {
    /// A profiler for `engine`, this process being `rank` of `world`, recording from now.
    /// Install it as (or among) the engine's event sinks.
    pub fn new(engine: &Engine, rank: usize, world: usize) -> Arc<Profiler> {
        let spec = engine.spec();
        let header = Header {
            format: FORMAT.into(),
            version: VERSION,
            rank,
            world,
            units: spec.units.iter().map(|u| u.name.clone()).collect(),
            device: format!("{:?}", engine.config().device),
        };
        Arc::new(Profiler {
            header,
            ledger: engine.ledger().clone(),
            started: Instant::now(),
            recording: AtomicBool::new(true),
            records: Mutex::new(vec![]),
        })
    }

    /// A profiler for `engine` installed as its event sink, recording from now.
    pub fn start(engine: &mut Engine, rank: usize, world: usize) -> Arc<Profiler> {
        let profiler = Profiler::new(engine, rank, world);
        engine.set_event_sink(profiler.clone());
        profiler
    }

    /// Stops recording (what was recorded stays).
    pub fn end(&self) {
        self.recording.store(false, Ordering::SeqCst);
    }

    /// The records so far.
    pub fn records(&self) -> Vec<Record> {
        self.records.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Writes the profile to `path` (replaced whole, or left as it was on failure).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut text = serde_json::to_string(&self.header).map_err(|e| Error::Engine(e.to_string()))?;
        text.push('\n');
        for r in self.records() {
            text.push_str(&serde_json::to_string(&r).map_err(|e| Error::Engine(e.to_string()))?);
            text.push('\n');
        }
        crate::io::write_atomic(path, text.as_bytes())
    }

    /// The file a rank's profile goes to in `dir`.
    pub fn rank_file(dir: &Path, rank: usize) -> PathBuf {
        dir.join(format!("rank{rank}.jsonl"))
    }

    fn memory(&self) -> Memory {
        self.ledger.report().into_iter().map(|(p, r)| (p, r.by_category)).collect()
    }
}

impl EventSink for Profiler {
    fn record(&self, event: Event) {
        if !self.recording.load(Ordering::SeqCst) {
            return;
        }
        let t = self.started.elapsed().as_secs_f64();
        let record = match event {
            Event::Phase { phase, unit, storage_bytes, .. } => {
                Record::Phase { t, phase, unit, memory: self.memory(), storage_bytes }
            }
            Event::GatherStarted { unit } => Record::Gather { t, unit },
            Event::ParamsFreed { unit } => Record::Freed { t, unit },
            Event::Copied { unit, to, bytes } => Record::Copy { t, unit, to, bytes },
            Event::Evicted { unit } => Record::Evict { t, unit },
            Event::Update { done } => Record::Update { t, done, memory: self.memory() },
        };
        self.records.lock().unwrap_or_else(|e| e.into_inner()).push(record);
    }
}

/// What a [`Span`] covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Forward(usize),
    Backward(usize),
    Update,
}

/// A stretch of a rank's time: a unit's forward or backward (from its `before_*` phase to
/// its `after_*`), or the update (from its start to the step's end).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub kind: SpanKind,
    pub start: f64,
    pub end: f64,
}

/// One rank's profile as read back.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    pub header: Header,
    pub records: Vec<Record>,
}

impl Profile {
    /// The spans of this rank's records, in the order they end.
    pub fn spans(&self) -> Vec<Span> {
        let mut began: BTreeMap<(usize, bool), f64> = BTreeMap::new();
        let mut update_began = None;
        let mut spans = Vec::new();
        for r in &self.records {
            match *r {
                Record::Phase { t, phase, unit, .. } => {
                    let forward = matches!(phase, Phase::BeforeForward | Phase::AfterForward);
                    match phase {
                        Phase::BeforeForward | Phase::BeforeBackward => {
                            began.insert((unit, forward), t);
                        }
                        Phase::AfterForward | Phase::AfterBackward => {
                            if let Some(start) = began.remove(&(unit, forward)) {
                                let kind = if forward { SpanKind::Forward(unit) } else { SpanKind::Backward(unit) };
                                spans.push(Span { kind, start, end: t });
                            }
                        }
                    }
                }
                Record::Update { t, done: false, .. } => update_began = Some(t),
                Record::Update { t, done: true, .. } => {
                    if let Some(start) = update_began.take() {
                        spans.push(Span { kind: SpanKind::Update, start, end: t });
                    }
                }
                _ => {}
            }
        }
        spans
    }

    /// The name of unit `u`.
    pub fn unit_name(&self, u: usize) -> String {
        self.header.units.get(u).cloned().unwrap_or_else(|| format!("unit {u}"))
    }
}

/// Reads one rank's profile, refusing in one line (naming the file and line) another
/// format or version, a line that does not parse (a truncated file), or times that go back.
pub fn read(path: &Path) -> Result<Profile> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let bad = |line: usize, why: String| Error::Data(format!("{}:{line}: {why}", path.display()));
    let mut lines = text.lines().enumerate();
    let (_, first) = lines.next().ok_or_else(|| bad(1, "empty file: not a Strata profile".into()))?;
    let header: Header =
        serde_json::from_str(first).map_err(|e| bad(1, format!("not a Strata profile header: {e}")))?;
    if header.format != FORMAT {
        return Err(bad(1, format!("format {:?}, expected {FORMAT:?}", header.format)));
    }
    if header.version != VERSION {
        return Err(bad(1, format!("profile version {} is not this version's ({VERSION})", header.version)));
    }
    let mut records: Vec<Record> = Vec::new();
    for (i, line) in lines {
        let record: Record = serde_json::from_str(line).map_err(|e| bad(i + 1, format!("bad record: {e}")))?;
        let unit = match &record {
            Record::Phase { unit, .. }
            | Record::Gather { unit, .. }
            | Record::Freed { unit, .. }
            | Record::Copy { unit, .. }
            | Record::Evict { unit, .. } => Some(*unit),
            Record::Update { .. } => None,
        };
        if unit.is_some_and(|u| u >= header.units.len()) {
            return Err(bad(i + 1, format!("unit {} of a model of {} units", unit.unwrap_or(0), header.units.len())));
        }
        if records.last().is_some_and(|last| record.t() < last.t()) {
            return Err(bad(i + 1, "time goes back".into()));
        }
        records.push(record);
    }
    Ok(Profile { header, records })
}

/// Reads every rank's profile in `dir` (`rank<R>.jsonl`), in rank order: one per rank of
/// the job, none missing, else one line saying what is wrong.
pub fn read_dir(dir: &Path) -> Result<Vec<Profile>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("rank") && n.ends_with(".jsonl"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Data(format!("{}: no profile (rank<R>.jsonl files) in this folder", dir.display())));
    }
    let mut profiles = files.iter().map(|f| read(f)).collect::<Result<Vec<_>>>()?;
    profiles.sort_by_key(|p| p.header.rank);
    let world = profiles[0].header.world;
    let ranks: Vec<usize> = profiles.iter().map(|p| p.header.rank).collect();
    if ranks != (0..world).collect::<Vec<_>>() || profiles.iter().any(|p| p.header.world != world) {
        return Err(Error::Data(format!(
            "{}: ranks {ranks:?} of a job of {world}: every rank's file must be there once",
            dir.display()
        )));
    }
    if profiles.iter().all(|p| p.records.is_empty()) {
        return Err(Error::Data(format!("{}: the profile recorded nothing (an empty run)", dir.display())));
    }
    Ok(profiles)
}
