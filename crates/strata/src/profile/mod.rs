//! The profiler: records what an engine and its schedule report — every phase of every unit
//! with the ledger's bytes per placement and category and the allocator's bytes at that
//! moment, every gather and free, every copy between device and host and eviction, the
//! update — stamped with the time it arrives, and every collective and every wait on one
//! as the communication layer reports them; one JSON-lines file per rank. It reads such
//! files back, validated. A Chrome trace ([`trace`]), a summary ([`summary`]) and pictures
//! ([`plot`]) are made from what it reads, through the series of [`series`].
//! Beside it, [`kernels`] records and reads libtorch's own kernel traces (Kineto), where a
//! GPU's kernels are timed one by one.
//!
//! Owns: the on-disk format and its validation. Must not time anything inside the engine,
//! the schedules or the collectives: it stamps the events handed to it through the
//! engine's one sink and the communication layer's observer.
//!
//! The format (`strata-profile`, version [`VERSION`]): the first line is a [`Header`]
//! (`{"format": "strata-profile", "version": 2, "rank", "world", "units": [names],
//! "unit_param_bytes", "device", "started_at"}`); every other line is a [`Record`] tagged by
//! `kind` (`phase`, `gather`, `freed`, `copy`, `evict`, `copy_wait`, `recompute`, `update`,
//! `op`, `collective`, `wait`) with `t`, seconds since recording started (for a stretch:
//! when it ended, with its `start`), in order.
pub mod kernels;
pub mod plot;
pub mod series;
pub mod summary;
pub mod trace;

use crate::comm::{Collective, CommObserver, Waited};
use crate::engine::{Category, Engine, EngineConfig, Event, EventSink, MemoryLedger, Phase, Placement};
use crate::model::ModelSpec;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Bytes in a mebibyte: Strata reports bytes in binary units, labelled (KiB, MiB, GiB).
pub const MIB: f64 = 1024.0 * 1024.0;

/// Bytes in binary units, labelled (`1.5 GiB`): the one convention of Strata's output.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// The `format` a profile's header names.
pub const FORMAT: &str = "strata-profile";
/// The version of the format written, and the only one read.
pub const VERSION: u32 = 2;

/// The first line of a rank's profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    /// The format's name: [`FORMAT`].
    pub format: String,
    /// The format's version: [`VERSION`].
    pub version: u32,
    /// The rank that recorded the profile.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// The units' names, in order.
    pub units: Vec<String>,
    /// Bytes of each unit's parameters, whole (not sharded), in the engine's dtype.
    pub unit_param_bytes: Vec<u64>,
    /// The engine's device, as `Debug` prints it (`Cpu`, `Cuda(0)`).
    pub device: String,
    /// When recording started, in seconds since the Unix epoch: the ranks' records line up
    /// on it (exactly on one host, as well as the hosts' clocks agree across hosts).
    pub started_at: f64,
}

/// Bytes the ledger counts now, per placement and category.
pub type Memory = BTreeMap<Placement, BTreeMap<Category, u64>>;

/// One event as recorded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Record {
    /// The schedule has run for `phase` of `unit` (the unit computes between a `before_*`
    /// and its `after_*`); `storage_bytes`: what the buffers of parameters and gradients
    /// hold from the allocator then (the ledger's `params` and `grads` say the same);
    /// `allocated`: every byte libtorch's allocator holds for this process on the engine's
    /// device then (on the CPU: host memory, offloaded states included), where tracked.
    Phase {
        /// When the record was made, seconds since recording started.
        t: f64,
        /// The phase the schedule has run for.
        phase: Phase,
        /// The unit's index.
        unit: usize,
        /// Bytes the ledger counts then, per placement and category.
        memory: Memory,
        /// Bytes the buffers of parameters and gradients hold from the allocator then.
        storage_bytes: u64,
        /// Bytes libtorch's allocator holds for this process on the engine's device then, where
        /// tracked.
        allocated: Option<u64>,
    },
    /// A gather of `unit`'s parameters started.
    Gather {
        /// When the record was made, seconds since recording started.
        t: f64,
        /// The unit's index.
        unit: usize,
    },
    /// `unit`'s gathered parameters were freed.
    Freed {
        /// When the record was made, seconds since recording started.
        t: f64,
        /// The unit's index.
        unit: usize,
    },
    /// `bytes` of `unit`'s states were copied to `to`.
    Copy {
        /// When the record was made, seconds since recording started.
        t: f64,
        /// The unit's index.
        unit: usize,
        /// Where the states went.
        to: Placement,
        /// Bytes copied.
        bytes: u64,
    },
    /// The device copy of `unit`'s parameters was released.
    Evict {
        /// When the record was made, seconds since recording started.
        t: f64,
        /// The unit's index.
        unit: usize,
    },
    /// The engine's thread waited for a copy of `unit`'s states from `start` to `t`.
    CopyWait {
        /// When the wait ended, seconds since recording started.
        t: f64,
        /// When the wait began, seconds since recording started.
        start: f64,
        /// The unit's index.
        unit: usize,
    },
    /// `unit`'s forward ran again in its backward (recomputation), from `start` to `t`.
    Recompute {
        /// When the recomputation ended, seconds since recording started.
        t: f64,
        /// When it began, seconds since recording started.
        start: f64,
        /// The unit's index.
        unit: usize,
    },
    /// The update began (`done: false`) or the step ended (`done: true`).
    Update {
        /// When the record was made, seconds since recording started.
        t: f64,
        /// `false` where the update began, `true` where the step ended.
        done: bool,
        /// Bytes the ledger counts then, per placement and category.
        memory: Memory,
        /// Bytes libtorch's allocator holds for this process on the engine's device then, where
        /// tracked.
        allocated: Option<u64>,
    },
    /// A pipeline operation (`forward`, `backward`, `backward_input`, `backward_weight`,
    /// `send_*`, `recv_*`) of micro-batch `micro` on this rank's chunk `chunk`, from `start`
    /// to `t`.
    Op {
        /// When the operation ended, seconds since recording started.
        t: f64,
        /// When it began, seconds since recording started.
        start: f64,
        /// The operation's name (`forward`, `send_activation`, ...).
        op: String,
        /// The micro-batch it ran on.
        micro: usize,
        /// The chunk of this rank it ran on.
        chunk: usize,
    },
    /// A collective `op` over `group`, moving or reducing `bytes`, issued at `start` and
    /// finished at `t` (it ran on the group's own thread or stream, one at a time).
    Collective {
        /// When it finished, seconds since recording started.
        t: f64,
        /// When it was issued, seconds since recording started.
        start: f64,
        /// The operation's name (e.g. `all_reduce`).
        op: String,
        /// The group's name.
        group: String,
        /// Bytes moved or reduced, the larger side.
        bytes: u64,
    },
    /// A checkpoint save of `step` stopped training from `start` to `t`; `waited_s` of it
    /// went to waiting for the previous save's writer (asynchronous saves).
    Save {
        /// When training went on, seconds since recording started.
        t: f64,
        /// When the save began, seconds since recording started.
        start: f64,
        /// The step saved.
        step: u64,
        /// Seconds of it spent waiting for the previous save's writer.
        waited_s: f64,
    },
    /// The writer thread persisted the asynchronous save of `step` to disk from `start` to
    /// `t`, while training went on.
    Persist {
        /// When the save was on disk, seconds since recording started.
        t: f64,
        /// When the writer began, seconds since recording started.
        start: f64,
        /// The step persisted.
        step: u64,
    },
    /// A thread blocked on a collective from `start` to `t`; `compute`: the thread that
    /// runs the engine (its wait is communication the computation did not hide).
    Wait {
        /// When the wait ended, seconds since recording started.
        t: f64,
        /// When it began, seconds since recording started.
        start: f64,
        /// The operation's name (e.g. `all_reduce`).
        op: String,
        /// The group's name.
        group: String,
        /// Whether the thread that waited is the one running the engine.
        compute: bool,
    },
}

impl Record {
    /// When the record was made, in seconds since recording started (for a stretch: when it ended).
    pub fn t(&self) -> f64 {
        match *self {
            Record::Phase { t, .. }
            | Record::Gather { t, .. }
            | Record::Freed { t, .. }
            | Record::Copy { t, .. }
            | Record::Evict { t, .. }
            | Record::Recompute { t, .. }
            | Record::CopyWait { t, .. }
            | Record::Update { t, .. }
            | Record::Op { t, .. }
            | Record::Collective { t, .. }
            | Record::Save { t, .. }
            | Record::Persist { t, .. }
            | Record::Wait { t, .. } => t,
        }
    }

    /// When the record's stretch began: its `start`, or `t` for a record of a moment.
    pub fn start(&self) -> f64 {
        match *self {
            Record::Collective { start, .. }
            | Record::Wait { start, .. }
            | Record::Op { start, .. }
            | Record::Save { start, .. }
            | Record::Persist { start, .. }
            | Record::Recompute { start, .. }
            | Record::CopyWait { start, .. } => start,
            _ => self.t(),
        }
    }

    /// The unit the record is about, if it is about one.
    pub fn unit(&self) -> Option<usize> {
        match *self {
            Record::Phase { unit, .. }
            | Record::Gather { unit, .. }
            | Record::Freed { unit, .. }
            | Record::Copy { unit, .. }
            | Record::Evict { unit, .. }
            | Record::Recompute { unit, .. }
            | Record::CopyWait { unit, .. } => Some(unit),
            Record::Update { .. }
            | Record::Op { .. }
            | Record::Collective { .. }
            | Record::Save { .. }
            | Record::Persist { .. }
            | Record::Wait { .. } => None,
        }
    }
}

/// Records an engine's events while started (PatrickStar's `profiler.start()` /
/// `end()` / `save()`).
pub struct Profiler {
    header: Header,
    /// The ledgers of the engines recorded (a pipeline rank has one per chunk), summed.
    ledgers: Vec<Arc<MemoryLedger>>,
    device: tch::Device,
    /// The thread that made the profiler: the one running the engine.
    compute_thread: std::thread::ThreadId,
    started: Instant,
    recording: AtomicBool,
    records: Mutex<Vec<Record>>,
    /// The step and end (seconds since recording started) of the last checkpoint save.
    last_save: Mutex<Option<(u64, f64)>>,
}

impl Profiler {
    /// A profiler for `engine`, this process being `rank` of `world`, recording from now;
    /// made on the thread that runs the engine. Install it as (or among) the engine's event
    /// sinks, and as the job's communication observer ([`crate::comm::Comm::observe`]).
    pub fn new(engine: &Engine, rank: usize, world: usize) -> Arc<Profiler> {
        Profiler::of_model(engine.spec(), engine.config(), vec![engine.ledger().clone()], rank, world)
    }

    /// A profiler of engines over parts of the model `spec` (a pipeline rank's chunks, whose
    /// events number units as in `spec`), built with `config`, with their `ledgers`.
    pub fn of_model(
        spec: &ModelSpec,
        config: &EngineConfig,
        ledgers: Vec<Arc<MemoryLedger>>,
        rank: usize,
        world: usize,
    ) -> Arc<Profiler> {
        let element = config.kind.elt_size_in_bytes() as u64;
        let unit_param_bytes = spec
            .units
            .iter()
            .map(|u| u.params.iter().map(|&p| spec.params[p.0].numel() as u64 * element).sum())
            .collect();
        let header = Header {
            format: FORMAT.into(),
            version: VERSION,
            rank,
            world,
            units: spec.units.iter().map(|u| u.name.clone()).collect(),
            unit_param_bytes,
            device: format!("{:?}", config.device),
            started_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        };
        Arc::new(Profiler {
            header,
            ledgers,
            device: config.device,
            compute_thread: std::thread::current().id(),
            started: Instant::now(),
            recording: AtomicBool::new(true),
            records: Mutex::new(vec![]),
            last_save: Mutex::new(None),
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
        // Threads stamp and push separately, so arrival order can differ from time order.
        let mut records = self.records();
        records.sort_by(|a, b| a.t().total_cmp(&b.t()));
        for r in records {
            text.push_str(&serde_json::to_string(&r).map_err(|e| Error::Engine(e.to_string()))?);
            text.push('\n');
        }
        crate::files::write_atomic(path, text.as_bytes())
    }

    /// A checkpoint save of `step` that stopped training from `began` for `blocked_s`
    /// seconds (`waited_s` of them for the previous save's writer); `persisted_s`: that
    /// writer's seconds, where one ran. The writer began as the previous save's pause ended.
    pub fn checkpoint_saved(&self, step: u64, began: Instant, blocked_s: f64, waited_s: f64, persisted_s: Option<f64>) {
        let start = self.seconds(began);
        let mut last = self.last_save.lock().unwrap_or_else(|e| e.into_inner());
        if let (Some((step, ended)), Some(seconds)) = (*last, persisted_s) {
            self.push(Record::Persist { t: ended + seconds, start: ended, step });
        }
        self.push(Record::Save { t: start + blocked_s, start, step, waited_s });
        *last = Some((step, start + blocked_s));
    }

    /// The file a rank's profile goes to in `dir`.
    pub fn rank_file(dir: &Path, rank: usize) -> PathBuf {
        dir.join(format!("rank{rank}.jsonl"))
    }

    fn memory(&self) -> Memory {
        let mut memory = Memory::new();
        for ledger in &self.ledgers {
            for (placement, report) in ledger.report() {
                let by = memory.entry(placement).or_default();
                for (category, bytes) in report.by_category {
                    *by.entry(category).or_default() += bytes;
                }
            }
        }
        memory
    }

    fn seconds(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.started).as_secs_f64()
    }

    fn push(&self, record: Record) {
        if self.recording.load(Ordering::SeqCst) {
            self.records.lock().unwrap_or_else(|e| e.into_inner()).push(record);
        }
    }
}

impl EventSink for Profiler {
    fn record(&self, event: Event) {
        if !self.recording.load(Ordering::SeqCst) {
            return;
        }
        let t = self.seconds(Instant::now());
        let allocated = || crate::engine::memory::allocator_current(self.device);
        let record = match event {
            Event::Phase { phase, unit, storage_bytes, .. } => {
                Record::Phase { t, phase, unit, memory: self.memory(), storage_bytes, allocated: allocated() }
            }
            Event::GatherStarted { unit } => Record::Gather { t, unit },
            Event::ParamsFreed { unit } => Record::Freed { t, unit },
            Event::Copied { unit, to, bytes } => Record::Copy { t, unit, to, bytes },
            Event::Evicted { unit } => Record::Evict { t, unit },
            Event::Recomputed { unit, began } => Record::Recompute { t, start: self.seconds(began), unit },
            Event::CopyWaited { unit, began } => Record::CopyWait { t, start: self.seconds(began), unit },
            Event::Update { done } => Record::Update { t, done, memory: self.memory(), allocated: allocated() },
            Event::Operation { name, micro, chunk, began } => {
                Record::Op { t, start: self.seconds(began), op: name.into(), micro, chunk }
            }
        };
        self.push(record);
    }
}

impl CommObserver for Profiler {
    fn collective(&self, c: &Collective) {
        self.push(Record::Collective {
            t: self.seconds(c.finished),
            start: self.seconds(c.issued),
            op: c.op.into(),
            group: c.group.to_string(),
            bytes: c.bytes,
        });
    }

    fn waited(&self, w: &Waited) {
        self.push(Record::Wait {
            t: self.seconds(w.ended),
            start: self.seconds(w.began),
            op: w.op.into(),
            group: w.group.to_string(),
            compute: std::thread::current().id() == self.compute_thread,
        });
    }
}

/// What a [`Span`] covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    /// The forward of the unit of this index.
    Forward(usize),
    /// The backward of the unit of this index.
    Backward(usize),
    /// A forward run again inside its unit's backward.
    Recompute(usize),
    /// The update, from its start to the step's end.
    Update,
}

/// A stretch of a rank's time: a unit's forward or backward (from its `before_*` phase to
/// its `after_*`), or the update (from its start to the step's end).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// What the span covers.
    pub kind: SpanKind,
    /// When it began, seconds since recording started.
    pub start: f64,
    /// When it ended, seconds since recording started.
    pub end: f64,
}

/// A pipeline operation as it ran.
#[derive(Clone, Debug, PartialEq)]
pub struct Operation {
    /// The operation's name (`forward`, `send_activation`, ...).
    pub op: String,
    /// The micro-batch it ran on.
    pub micro: usize,
    /// The chunk of this rank it ran on.
    pub chunk: usize,
    /// When it began, seconds since recording started.
    pub start: f64,
    /// When it ended, seconds since recording started.
    pub end: f64,
}

impl Operation {
    /// A forward or a backward (part), not a send or receive.
    pub fn computes(&self) -> bool {
        self.op.starts_with("forward") || self.op.starts_with("backward")
    }

    /// The first start and the last end of `ops`.
    pub fn extent(ops: &[Operation]) -> Option<(f64, f64)> {
        let first = ops.iter().map(|o| o.start).reduce(f64::min)?;
        let last = ops.iter().map(|o| o.end).reduce(f64::max)?;
        Some((first, last))
    }
}

/// A collective as it ran on its group's thread or stream.
#[derive(Clone, Debug, PartialEq)]
pub struct CollectiveRun {
    /// The operation's name (e.g. `all_reduce`).
    pub op: String,
    /// The group's name.
    pub group: String,
    /// Bytes moved or reduced, the larger side.
    pub bytes: u64,
    /// When it was issued, seconds since recording started.
    pub issued: f64,
    /// When it began running: when it was issued or when the group's previous collective
    /// finished, if later.
    pub start: f64,
    /// When it finished, seconds since recording started.
    pub end: f64,
}

/// Per profile, what to add to its times to put every rank on the clock of the one that
/// started recording first.
pub fn clock_offsets(profiles: &[Profile]) -> Vec<f64> {
    let first = profiles.iter().map(|p| p.header.started_at).fold(f64::INFINITY, f64::min);
    profiles.iter().map(|p| p.header.started_at - first).collect()
}

/// Seconds covered by the union of `intervals` (each `(start, end)`).
pub fn covered_seconds(mut intervals: Vec<(f64, f64)>) -> f64 {
    intervals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut current: Option<(f64, f64)> = None;
    for (start, end) in intervals {
        match current {
            Some((s, e)) if start <= e => current = Some((s, e.max(end))),
            _ => {
                total += current.map_or(0.0, |(s, e)| e - s);
                current = Some((start, end));
            }
        }
    }
    total + current.map_or(0.0, |(s, e)| e - s)
}

/// One rank's profile as read back.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// The profile's first line.
    pub header: Header,
    /// The records of every other line, in order.
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
                Record::Recompute { t, start, unit } => {
                    spans.push(Span { kind: SpanKind::Recompute(unit), start, end: t })
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

    /// The collectives of this rank's records, in the order they finished, each with the
    /// time it ran: a group runs its collectives one at a time in issue order, so one
    /// starts when it was issued or when the group's previous one finished, if later.
    pub fn collectives(&self) -> Vec<CollectiveRun> {
        let mut group_free: BTreeMap<&str, f64> = BTreeMap::new();
        let mut runs = Vec::new();
        for r in &self.records {
            if let Record::Collective { t, start, op, group, bytes } = r {
                let free = group_free.entry(group.as_str()).or_insert(0.0);
                let began = start.max(*free).min(*t);
                *free = *t;
                runs.push(CollectiveRun {
                    op: op.clone(),
                    group: group.clone(),
                    bytes: *bytes,
                    issued: *start,
                    start: began,
                    end: *t,
                });
            }
        }
        runs
    }

    /// The first and last moment the records speak of (a collective or a wait may have
    /// begun before the first record arrived).
    pub fn time_range(&self) -> (f64, f64) {
        let start = self.records.iter().map(Record::start).fold(f64::INFINITY, f64::min);
        let end = self.records.last().map_or(0.0, Record::t);
        (if start.is_finite() { start } else { 0.0 }, end)
    }

    /// The pipeline operations of this rank's records, in the order they ended.
    pub fn operations(&self) -> Vec<Operation> {
        self.operation_steps().into_iter().flatten().collect()
    }

    /// The pipeline operations, step by step (a step's end closes its operations).
    pub fn operation_steps(&self) -> Vec<Vec<Operation>> {
        let mut steps: Vec<Vec<Operation>> = vec![vec![]];
        for r in &self.records {
            match r {
                Record::Op { t, start, op, micro, chunk } => steps.last_mut().into_iter().for_each(|s| {
                    s.push(Operation { op: op.clone(), micro: *micro, chunk: *chunk, start: *start, end: *t })
                }),
                Record::Update { done: true, .. } if steps.last().is_some_and(|s| !s.is_empty()) => steps.push(vec![]),
                _ => {}
            }
        }
        steps.retain(|s| !s.is_empty());
        steps
    }

    /// The fraction of the pipeline's time this rank computed nothing: over each step, the
    /// stretch from its first operation to its last less its forwards and backwards
    /// (`None` without a pipeline).
    pub fn bubble(&self) -> Option<f64> {
        let (mut span, mut computing) = (0.0, 0.0);
        for ops in self.operation_steps() {
            let (first, last) = Operation::extent(&ops)?;
            span += last - first;
            computing += covered_seconds(ops.iter().filter(|o| o.computes()).map(|o| (o.start, o.end)).collect());
        }
        (span > 0.0).then(|| 1.0 - computing / span)
    }

    /// The stretches the engine's thread spent waiting for copies between device and host.
    pub fn copy_waits(&self) -> Vec<(f64, f64)> {
        self.records
            .iter()
            .filter_map(|r| match r {
                Record::CopyWait { t, start, .. } => Some((*start, *t)),
                _ => None,
            })
            .collect()
    }

    /// The stretches the engine's thread spent blocked on collectives.
    pub fn compute_waits(&self) -> Vec<(f64, f64)> {
        self.records
            .iter()
            .filter_map(|r| match r {
                Record::Wait { t, start, compute: true, .. } => Some((*start, *t)),
                _ => None,
            })
            .collect()
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
    // The version first, so another version's header is named as such, not as malformed.
    let version = serde_json::from_str::<serde_json::Value>(first).ok().and_then(|v| v.get("version")?.as_u64());
    if version.is_some_and(|v| v != u64::from(VERSION)) {
        return Err(bad(1, format!("profile version {} is not this version's ({VERSION})", version.unwrap_or(0))));
    }
    let header: Header =
        serde_json::from_str(first).map_err(|e| bad(1, format!("not a Strata profile header: {e}")))?;
    if header.format != FORMAT {
        return Err(bad(1, format!("format {:?}, expected {FORMAT:?}", header.format)));
    }
    if header.unit_param_bytes.len() != header.units.len() {
        return Err(bad(1, format!("{} unit sizes for {} units", header.unit_param_bytes.len(), header.units.len())));
    }
    let mut records: Vec<Record> = Vec::new();
    for (i, line) in lines {
        let record: Record = serde_json::from_str(line).map_err(|e| bad(i + 1, format!("bad record: {e}")))?;
        if let Some(unit) = record.unit().filter(|&u| u >= header.units.len()) {
            return Err(bad(i + 1, format!("unit {unit} of a model of {} units", header.units.len())));
        }
        if records.last().is_some_and(|last| record.t() < last.t()) {
            return Err(bad(i + 1, "time goes back".into()));
        }
        if record.start() > record.t() {
            return Err(bad(i + 1, "ends before it starts".into()));
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
    if let Some(p) = profiles.iter().find(|p| p.header.units != profiles[0].header.units) {
        return Err(Error::Data(format!(
            "{}: rank {} names other units than rank 0: files of different runs",
            dir.display(),
            p.header.rank
        )));
    }
    if profiles.iter().all(|p| p.records.is_empty()) {
        return Err(Error::Data(format!("{}: the profile recorded nothing (an empty run)", dir.display())));
    }
    Ok(profiles)
}
