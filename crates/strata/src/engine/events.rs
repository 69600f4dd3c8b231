//! What the engine and its schedule report as they run, through one sink per engine: each
//! phase of each unit with the model-state bytes at that moment (as the ledger counts them
//! and as the allocator holds them), and each parameter gather started and each freed.
//! Tests check the schedules against these; a profiler records them. Nothing is computed
//! for events while no sink is installed.
use super::Phase;
use std::sync::Mutex;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The schedule has run for `phase` of `unit`. `ledger_bytes`: parameters and gradients
    /// the ledger counts; `storage_bytes`: what the storages of every buffer holding them
    /// (the engine's and the schedule's, each storage once) have from the allocator.
    Phase { phase: Phase, unit: usize, ledger_bytes: u64, storage_bytes: u64 },
    /// A gather of `unit`'s parameters was started.
    GatherStarted { unit: usize },
    /// `unit`'s gathered parameters were freed.
    ParamsFreed { unit: usize },
}

/// Receives events as they happen, from the thread running the engine.
pub trait EventSink: Send + Sync {
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
