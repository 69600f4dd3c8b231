//! One training step looked into on a GPU, for `strata bench train`: its host-device
//! synchronisations, attributed to the stretch of the step they happened in, and the GPU
//! time of each part of it, from CUDA events recorded at the engine's events.
//!
//! Owns the marks and their attribution. Must not add timing to the library: it listens, as
//! an [`EventSink`], to the events the engine already emits.
use anyhow::Result;
use std::collections::BTreeMap;
use std::sync::Mutex;
use strata::engine::events::{Event, EventSink};
use strata::engine::Phase;

/// One step looked into on a GPU: its host-device synchronisations (the total, and where in
/// the step they were) and the GPU time of each part of it, in ms.
pub struct Inspection {
    pub syncs: u64,
    pub sync_sites: BTreeMap<String, u64>,
    pub phases_ms: BTreeMap<String, f64>,
}

/// The parts of a step timed on the GPU, in order; every side splits its step alike.
pub const PHASES: [&str; 4] = ["1 forward and loss", "2 backward", "3 clipping and update", "4 after the update"];

/// CUDA events recorded where a step passes from one of [`PHASES`] to the next, as the
/// engine reports it: backward begins, the update begins (clipping included), it ends.
pub struct GpuPhases {
    device: usize,
    marks: Mutex<Vec<(&'static str, strata_ext::cuda::Event)>>,
}

impl GpuPhases {
    pub fn new(device: usize) -> GpuPhases {
        GpuPhases { device, marks: Mutex::default() }
    }

    pub fn mark(&self, phase: &'static str) -> Result<()> {
        let event = strata_ext::cuda::Event::new(true)?;
        event.record(&strata_ext::cuda::Stream::current(self.device)?)?;
        self.marks.lock().unwrap_or_else(|e| e.into_inner()).push((phase, event));
        Ok(())
    }

    /// GPU milliseconds of each phase, once the device passed the last mark.
    pub fn times(&self) -> Result<BTreeMap<String, f64>> {
        let marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = BTreeMap::new();
        for pair in marks.windows(2) {
            *out.entry(pair[0].0.to_string()).or_default() += f64::from(pair[0].1.elapsed_ms(&pair[1].1)?);
        }
        Ok(out)
    }
}

impl EventSink for GpuPhases {
    fn record(&self, event: Event) {
        let current = self.marks.lock().unwrap_or_else(|e| e.into_inner()).last().map(|(p, _)| *p);
        let next = match event {
            Event::Phase { phase: Phase::BeforeBackward, .. } if current == Some(PHASES[0]) => PHASES[1],
            Event::Update { done: false } => PHASES[2],
            Event::Update { done: true } => PHASES[3],
            _ => return,
        };
        // A failed mark leaves its phase joined to the one before.
        let _ = self.mark(next);
    }
}

/// Attributes synchronisations to the stretch of a step they happened in: between one engine
/// event and the next, named after the earlier one.
#[derive(Default)]
pub struct SyncSites {
    /// The count at the last event, and the stretch that began there.
    state: Mutex<(u64, String)>,
    counts: Mutex<BTreeMap<String, u64>>,
}

impl SyncSites {
    /// Starts counting at `count`, in the stretch named `stretch`.
    pub fn start(&self, count: u64, stretch: &str) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = (count, stretch.to_string());
    }

    /// The counts so far, by stretch, taken out.
    pub fn take(&self) -> BTreeMap<String, u64> {
        std::mem::take(&mut *self.counts.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn record_until_now(&self, next: &str) {
        let now = strata_ext::cuda::syncs_counted();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (at, stretch) = std::mem::replace(&mut *state, (now, next.to_string()));
        if now > at {
            *self.counts.lock().unwrap_or_else(|e| e.into_inner()).entry(stretch).or_default() += now - at;
        }
    }
}

impl EventSink for SyncSites {
    fn record(&self, event: Event) {
        let next = match event {
            Event::Phase { phase: Phase::BeforeForward, unit, .. } => format!("unit {unit} forward"),
            Event::Phase { phase: Phase::AfterForward, unit, .. } => format!("after unit {unit} forward"),
            Event::Phase { phase: Phase::BeforeBackward, unit, .. } => format!("unit {unit} backward"),
            Event::Phase { phase: Phase::AfterBackward, unit, .. } => format!("after unit {unit} backward"),
            Event::Update { done: false } => "optimizer update".into(),
            Event::Update { done: true } => "after the update".into(),
            _ => return,
        };
        self.record_until_now(&next);
    }
}
