//! What the engine and its schedule report as they run, through one sink per engine: each
//! phase of each unit with the model-state bytes at that moment (as the ledger counts them
//! and as the allocator holds them), and each parameter gather started and each freed.
//! Tests check the schedules against these; [`UnitClock`] times the units from them.
//! Nothing is computed for events while no sink is installed.
//!
//! Owns the events, the [`EventSink`] trait and the plain sinks. Must not change the run or
//! write anything: a sink only observes, and the profile's files are `profile`'s.
use super::Phase;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Something the engine or its schedule did, as a sink receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The schedule has run for `phase` of `unit`. `ledger_bytes`: parameters and gradients
    /// the ledger counts; `storage_bytes`: what the storages of every buffer holding them
    /// (the engine's and the schedule's, each storage once) have from the allocator.
    Phase {
        /// The phase the schedule has run for.
        phase: Phase,
        /// The unit's index.
        unit: usize,
        /// Parameter and gradient bytes the ledger counts.
        ledger_bytes: u64,
        /// Bytes the storages holding them have from the allocator.
        storage_bytes: u64,
    },
    /// A gather of `unit`'s parameters was started.
    GatherStarted {
        /// The unit whose parameters are gathered.
        unit: usize,
    },
    /// `unit`'s gathered parameters were freed.
    ParamsFreed {
        /// The unit whose gathered parameters were freed.
        unit: usize,
    },
    /// `bytes` of `unit`'s states were copied to `to` (offload).
    Copied {
        /// The unit whose states were copied.
        unit: usize,
        /// Where the states were copied to.
        to: super::Placement,
        /// Bytes copied.
        bytes: u64,
    },
    /// The device copy of `unit`'s parameters was released (offload).
    Evicted {
        /// The unit whose device copy was released.
        unit: usize,
    },
    /// The step's gradients are complete and the update begins (`done: false`), or the
    /// step has ended, updated or skipped (`done: true`).
    Update {
        /// Whether the step has ended, rather than its update beginning.
        done: bool,
    },
    /// The engine's thread waited from `began` to now for a copy of `unit`'s states between
    /// device and host (offload: a prefetch still running, or a copy made in place).
    CopyWaited {
        /// The unit whose states were waited for.
        unit: usize,
        /// When the wait began.
        began: Instant,
    },
    /// `unit`'s forward was run again in its backward (recomputation), from `began` to now.
    Recomputed {
        /// The unit whose forward was run again.
        unit: usize,
        /// When the recomputation began.
        began: Instant,
    },
    /// An operation of a schedule running above the engine (a pipeline's forward, backward,
    /// send or receive of micro-batch `micro` on its chunk `chunk`) ran from `began` to now.
    Operation {
        /// What the operation did (a forward, a backward, a send, a receive).
        name: &'static str,
        /// The micro-batch it worked on.
        micro: usize,
        /// The chunk of the model it ran for.
        chunk: usize,
        /// When it began.
        began: Instant,
    },
}

/// Hands every event to each of several sinks, in order.
pub struct EventSinks(pub Vec<std::sync::Arc<dyn EventSink>>);

impl EventSink for EventSinks {
    fn record(&self, event: Event) {
        for sink in &self.0 {
            sink.record(event.clone());
        }
    }
}

/// Receives events as they happen, from the thread running the engine.
pub trait EventSink: Send + Sync {
    /// Takes one event, as it happens.
    fn record(&self, event: Event);
}

/// A sink that keeps every event in order.
#[derive(Default)]
pub struct EventLog {
    events: Mutex<Vec<Event>>,
}

impl EventLog {
    /// The events recorded so far, leaving the log empty.
    pub fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl EventSink for EventLog {
    fn record(&self, event: Event) {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).push(event);
    }
}

/// One unit's share of a step: seconds of its forward and backward (from the phase event
/// before each to the one after), and seconds this rank waited for collectives since the
/// phase event before each of its phases (the gathers it needed and whatever the schedule
/// waited for there). The step's remaining wait (gradient reductions completed after the
/// last unit, norms) is its `comm_wait_s` minus these. A clock that measures memory also
/// gives the most bytes one forward of the unit left allocated (what it keeps for backward).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct UnitTime {
    /// The unit's index.
    pub unit: usize,
    /// Seconds of the unit's forward.
    pub forward_s: f64,
    /// Seconds of the unit's backward.
    pub backward_s: f64,
    /// Seconds this rank waited for collectives since the phase event before each of the
    /// unit's phases.
    pub comm_wait_s: f64,
    /// The most bytes one forward of the unit left allocated; `None` where the clock
    /// measures no memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_bytes: Option<u64>,
}

/// A sink that times every unit's phases, step by step ([`UnitClock::take`]).
#[derive(Default)]
pub struct UnitClock {
    state: Mutex<ClockState>,
    /// The device whose allocator the clock reads around each forward, if any.
    memory_of: Option<tch::Device>,
}

#[derive(Default)]
struct ClockState {
    /// When the previous phase event came, and the communication waited for by then.
    last: Option<(Instant, Duration)>,
    /// When the phase being timed began (its `Before*` event).
    began: Option<Instant>,
    units: BTreeMap<usize, UnitTime>,
    /// The allocator's bytes when the forward being measured began.
    allocated_before: Option<u64>,
}

impl UnitClock {
    /// A clock that also measures, on `device`'s allocator (which must be tracked), the
    /// bytes each unit's forward keeps.
    pub fn measuring_memory(device: tch::Device) -> UnitClock {
        UnitClock { memory_of: Some(device), ..UnitClock::default() }
    }

    /// The units' times since the last call, in unit order; the next step's clock starts now.
    pub fn take(&self) -> Vec<UnitTime> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.last = Some((Instant::now(), crate::comm::time_waited()));
        std::mem::take(&mut s.units).into_values().collect()
    }
}

impl EventSink for UnitClock {
    fn record(&self, event: Event) {
        let Event::Phase { phase, unit, .. } = event else { return };
        let (now, waited) = (Instant::now(), crate::comm::time_waited());
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let waited_since = s.last.map_or(Duration::ZERO, |(_, w)| waited.saturating_sub(w));
        let began = s.began;
        let t = s.units.entry(unit).or_insert_with(|| UnitTime { unit, ..UnitTime::default() });
        t.comm_wait_s += waited_since.as_secs_f64();
        let spent = began.map_or(0.0, |b| now.duration_since(b).as_secs_f64());
        let allocated = self.memory_of.and_then(crate::engine::memory::allocator_current);
        match phase {
            Phase::BeforeForward | Phase::BeforeBackward => s.began = Some(now),
            Phase::AfterForward => t.forward_s += spent,
            Phase::AfterBackward => t.backward_s += spent,
        }
        match phase {
            Phase::BeforeForward => s.allocated_before = allocated,
            Phase::AfterForward => {
                if let (Some(before), Some(after)) = (s.allocated_before.take(), allocated) {
                    let t = s.units.entry(unit).or_default();
                    t.kept_bytes = Some(t.kept_bytes.unwrap_or(0).max(after.saturating_sub(before)));
                }
            }
            _ => {}
        }
        s.last = Some((now, waited));
    }
}
