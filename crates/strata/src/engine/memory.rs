//! Accounting of every byte the engine and optimizers hold, per placement and category,
//! checked against optional budgets so that running out of memory is an error raised before
//! the allocation (and a CPU-only machine can simulate a device of a given size).
//!
//! Owns the ledger, its budgets and peaks, and the reading of the allocators' statistics.
//! Must not decide what to hold, free or move: the engine, the optimizers and offload do,
//! and record it here before they allocate.
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Where bytes live: the compute device (a GPU, or the CPU acting as one) or host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// The compute device (a GPU, or the CPU acting as one).
    Device,
    /// Host memory.
    Host,
}

impl Placement {
    /// The placement as messages, traces and pictures name it.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Device => "device",
            Placement::Host => "host",
        }
    }
}

/// What the bytes hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Parameters.
    Params,
    /// Gradients.
    Grads,
    /// Optimizer state, such as Adam's moments.
    OptimizerState,
    /// Activations kept between a unit's forward and its backward.
    Activations,
}

impl Category {
    /// Parameters, gradients and optimizer state: what ZeRO shards.
    pub fn is_model_state(self) -> bool {
        self != Category::Activations
    }
}

#[derive(Default)]
struct State {
    current: BTreeMap<(Placement, Category), u64>,
    peak: BTreeMap<Placement, u64>,
    budget: BTreeMap<Placement, u64>,
    /// Bytes of host buffers in page-locked memory (the GPU copies them without staging).
    pinned: u64,
    model_state_peak: u64,
    transfers: Transfers,
}

/// Offload's figures since the ledger was made: bytes copied to each placement, the time
/// spent waiting for copies, and the units whose host update ran beside the device's work
/// (during backward, or delayed during the next step) and the time those updates took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Transfers {
    /// Bytes copied to the device.
    pub to_device: u64,
    /// Bytes copied to the host.
    pub to_host: u64,
    /// Seconds spent waiting for copies.
    pub wait_s: f64,
    /// Units whose host update ran beside the device's work.
    pub updated_during_backward: u64,
    /// Seconds those host updates took.
    pub host_update_s: f64,
}

impl Transfers {
    /// What happened after `earlier` was taken.
    pub fn since(&self, earlier: &Transfers) -> Transfers {
        Transfers {
            to_device: self.to_device - earlier.to_device,
            to_host: self.to_host - earlier.to_host,
            wait_s: self.wait_s - earlier.wait_s,
            updated_during_backward: self.updated_during_backward - earlier.updated_during_backward,
            host_update_s: self.host_update_s - earlier.host_update_s,
        }
    }
}

impl State {
    fn total(&self, placement: Placement) -> u64 {
        self.current.iter().filter(|((p, _), _)| *p == placement).map(|(_, b)| b).sum()
    }
}

/// Shared by the engine and the optimizer (behind an `Arc`).
#[derive(Default)]
pub struct MemoryLedger {
    state: Mutex<State>,
}

/// Bytes held on one placement.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PlacementReport {
    /// Bytes held now.
    pub current: u64,
    /// The most bytes held at once since the ledger was made or its peak last reset.
    pub peak: u64,
    /// Of `current`, the bytes of each category.
    pub by_category: BTreeMap<Category, u64>,
    /// Of `current`, the bytes in page-locked memory (the host's, where the device is a GPU
    /// and `pin_memory` is on).
    pub pinned: u64,
}

impl MemoryLedger {
    /// An empty ledger without budgets.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain counters behind, still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Limits the bytes that may be held on `placement`.
    pub fn set_budget(&self, placement: Placement, bytes: u64) {
        self.lock().budget.insert(placement, bytes);
    }

    /// Records `bytes` as held, or fails without recording if that would pass the budget.
    pub fn alloc(&self, placement: Placement, category: Category, bytes: u64) -> Result<()> {
        let mut s = self.lock();
        let in_use = s.total(placement);
        if let Some(&budget) = s.budget.get(&placement) {
            if in_use + bytes > budget {
                return Err(Error::OutOfMemory {
                    placement: placement.name().into(),
                    requested: bytes,
                    in_use,
                    budget,
                });
            }
        }
        *s.current.entry((placement, category)).or_default() += bytes;
        let total = in_use + bytes;
        let peak = s.peak.entry(placement).or_default();
        *peak = (*peak).max(total);
        let model_state: u64 = s.current.iter().filter(|((_, c), _)| c.is_model_state()).map(|(_, b)| b).sum();
        s.model_state_peak = s.model_state_peak.max(model_state);
        Ok(())
    }

    /// Records `bytes` as no longer held (the count stops at zero).
    pub fn free(&self, placement: Placement, category: Category, bytes: u64) {
        let mut s = self.lock();
        let held = s.current.entry((placement, category)).or_default();
        *held = held.saturating_sub(bytes);
    }

    /// Bytes of `category` held on `placement` now.
    pub fn held(&self, placement: Placement, category: Category) -> u64 {
        self.lock().current.get(&(placement, category)).copied().unwrap_or(0)
    }

    /// Records a copy of `bytes` that arrived on `to`, waited for for `waited`.
    pub fn record_transfer(&self, to: Placement, bytes: u64, waited: std::time::Duration) {
        let mut s = self.lock();
        match to {
            Placement::Device => s.transfers.to_device += bytes,
            Placement::Host => s.transfers.to_host += bytes,
        }
        s.transfers.wait_s += waited.as_secs_f64();
    }

    /// Records the host updates of `units` units run beside the device's work, which took
    /// `seconds`.
    pub fn record_host_updates(&self, units: u64, seconds: std::time::Duration) {
        let mut s = self.lock();
        s.transfers.updated_during_backward += units;
        s.transfers.host_update_s += seconds.as_secs_f64();
    }

    /// Records `bytes` of host buffers made page-locked.
    pub fn record_pinned(&self, bytes: u64) {
        self.lock().pinned += bytes;
    }

    /// Records that `bytes` of page-locked host buffers were freed.
    pub fn release_pinned(&self, bytes: u64) {
        let mut s = self.lock();
        s.pinned = s.pinned.saturating_sub(bytes);
    }

    /// Copies between device and host so far.
    pub fn transfers(&self) -> Transfers {
        self.lock().transfers
    }

    /// Starts a new peak from what is held now.
    pub fn reset_peak(&self) {
        let mut s = self.lock();
        let placements: Vec<Placement> = s.peak.keys().copied().collect();
        for p in placements {
            let now = s.total(p);
            s.peak.insert(p, now);
        }
        s.model_state_peak = s.current.iter().filter(|((_, c), _)| c.is_model_state()).map(|(_, b)| b).sum();
    }

    /// Peak bytes of model states (parameters, gradients, optimizer state) over all placements.
    pub fn model_state_peak(&self) -> u64 {
        self.lock().model_state_peak
    }

    /// Bytes held on each placement now, with their peaks and categories.
    pub fn report(&self) -> BTreeMap<Placement, PlacementReport> {
        let s = self.lock();
        let mut out: BTreeMap<Placement, PlacementReport> = BTreeMap::new();
        for (&(p, c), &bytes) in &s.current {
            let r = out.entry(p).or_default();
            r.current += bytes;
            r.by_category.insert(c, bytes);
        }
        for (&p, &peak) in &s.peak {
            out.entry(p).or_default().peak = peak;
        }
        if s.pinned > 0 {
            out.entry(Placement::Host).or_default().pinned = s.pinned;
        }
        out
    }

    /// Peak bytes over all placements (the sum of each placement's peak).
    pub fn peak_total(&self) -> u64 {
        self.lock().peak.values().sum()
    }
}

/// Frees the memory behind a buffer the engine owns (a unit's flat parameters or
/// gradients) while the tensor and its views stay valid objects.
///
/// # Safety
/// No view of `t` (parameter views, autograd's saved tensors) may be read or written, and no
/// operation on it may be in flight, until [`restore_buffer`] gives it memory again and it
/// is refilled.
pub unsafe fn release_buffer(t: &tch::Tensor) -> Result<()> {
    // SAFETY: the caller's contract above.
    Ok(unsafe { strata_ext::resize_storage(t, 0) }?)
}

/// Gives a released buffer its full size again, uninitialised until written.
///
/// # Safety
/// `t` spans its whole storage (a unit's flat buffer, as the engine makes them), so every
/// view of the storage lies within the bytes it gets back.
pub unsafe fn restore_buffer(t: &tch::Tensor) -> Result<()> {
    // SAFETY: the caller's contract above.
    Ok(unsafe { strata_ext::resize_storage(t, t.numel() * t.kind().elt_size_in_bytes()) }?)
}

/// Bytes of a tensor's elements.
pub fn tensor_bytes(t: &tch::Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// Starts a new allocator peak on `device` (the CPU's counts only once tracking is on:
/// [`strata_ext::cpu_memory::track`]).
pub fn reset_allocator_peak(device: tch::Device) {
    let _ = match device {
        tch::Device::Cuda(i) => strata_ext::cuda::reset_peak_stats(i),
        _ => strata_ext::cpu_memory::reset_peak(),
    };
}

/// Peak bytes libtorch's allocator handed out on `device` since the last reset: every
/// tensor, activations inside units included. `None` when it is not tracked.
pub fn allocator_peak(device: tch::Device) -> Option<u64> {
    match device {
        tch::Device::Cuda(i) => strata_ext::cuda::memory_stats(i).ok().map(|s| s.allocated_peak as u64),
        _ => strata_ext::cpu_memory::stats().ok().map(|(_, peak)| peak as u64),
    }
}

/// Bytes libtorch's allocator holds on `device` now. `None` when it is not tracked.
pub fn allocator_current(device: tch::Device) -> Option<u64> {
    match device {
        tch::Device::Cuda(i) => strata_ext::cuda::memory_stats(i).ok().map(|s| s.allocated as u64),
        _ => strata_ext::cpu_memory::stats().ok().map(|(current, _)| current as u64),
    }
}

/// Peak resident set size of this process (Linux `VmHWM`), if the system reports it.
pub fn process_peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_refuses_before_recording_and_peak_tracks_the_high_water_mark() {
        let ledger = MemoryLedger::new();
        ledger.set_budget(Placement::Device, 100);
        ledger.alloc(Placement::Device, Category::Params, 60).unwrap();
        ledger.alloc(Placement::Device, Category::Activations, 30).unwrap();
        let err = ledger.alloc(Placement::Device, Category::Grads, 20).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { requested: 20, in_use: 90, budget: 100, .. }));
        ledger.free(Placement::Device, Category::Activations, 30);
        ledger.alloc(Placement::Host, Category::OptimizerState, 500).unwrap();
        let r = ledger.report();
        assert_eq!(r[&Placement::Device].current, 60);
        assert_eq!(r[&Placement::Device].peak, 90);
        assert_eq!(r[&Placement::Host].peak, 500);
        ledger.reset_peak();
        assert_eq!(ledger.report()[&Placement::Device].peak, 60);
        assert_eq!(ledger.peak_total(), 560);
        assert_eq!(ledger.model_state_peak(), 560, "params 60 + optimizer state 500");
    }
}
