//! The series drawn and summarised, taken from read profiles: memory at each moment, each
//! unit's stretches away from its home, and per-unit costs. Pure functions, tested without
//! drawing.
use crate::engine::{Category, Phase, Placement};
use crate::profile::{Memory, Profile, Record, SpanKind};
use std::collections::BTreeMap;

/// The memory of one moment of a profile.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPoint {
    /// Seconds since recording started.
    pub t: f64,
    /// Every byte the ledger counts, per placement.
    pub by_placement: BTreeMap<Placement, u64>,
    /// Parameters, gradients and optimizer states on the device (model states).
    pub device_model_states: u64,
    /// The allocator's bytes, where tracked.
    pub allocated: Option<u64>,
}

/// The memory recorded at each phase and update of `p`, in time order.
pub fn memory_series(p: &Profile) -> Vec<MemoryPoint> {
    p.records
        .iter()
        .filter_map(|r| match r {
            Record::Phase { t, memory, allocated, .. } | Record::Update { t, memory, allocated, .. } => {
                Some(MemoryPoint {
                    t: *t,
                    by_placement: memory.iter().map(|(p, by)| (*p, by.values().sum())).collect(),
                    device_model_states: memory
                        .get(&Placement::Device)
                        .map_or(0, |by| by.iter().filter(|(c, _)| c.is_model_state()).map(|(_, b)| b).sum()),
                    allocated: *allocated,
                })
            }
            _ => None,
        })
        .collect()
}

/// Where a unit's parameters are over a stretch of time, beyond their home.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// Gathered whole on the device (ZeRO-3 / fsdp), from the gather's start to the free.
    Gathered,
    /// Copied from their host home to the device (offload), until evicted.
    OnDevice,
}

/// A stretch of time over which a unit's parameters are away from their home.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnitStretch {
    /// The unit's index in the model.
    pub unit: usize,
    /// Where the parameters are over the stretch.
    pub residency: Residency,
    /// When the stretch began, in seconds since recording started.
    pub start: f64,
    /// When the stretch ended, in seconds since recording started.
    pub end: f64,
}

/// Each unit's stretches away from home, from its gathers and frees, copies to the device
/// and evictions; one still open when the profile ends closes there.
pub fn residency(p: &Profile) -> Vec<UnitStretch> {
    let mut open: BTreeMap<(usize, bool), f64> = BTreeMap::new();
    let mut stretches = Vec::new();
    let mut close = |unit: usize, gathered: bool, end: f64, open: &mut BTreeMap<(usize, bool), f64>| {
        if let Some(start) = open.remove(&(unit, gathered)) {
            let residency = if gathered { Residency::Gathered } else { Residency::OnDevice };
            stretches.push(UnitStretch { unit, residency, start, end });
        }
    };
    for r in &p.records {
        match *r {
            Record::Gather { t, unit } => {
                open.entry((unit, true)).or_insert(t);
            }
            Record::Freed { t, unit } => close(unit, true, t, &mut open),
            Record::Copy { t, unit, to: Placement::Device, .. } => {
                open.entry((unit, false)).or_insert(t);
            }
            Record::Evict { t, unit } => close(unit, false, t, &mut open),
            _ => {}
        }
    }
    let end = p.records.last().map_or(0.0, Record::t);
    for (unit, gathered) in open.keys().copied().collect::<Vec<_>>() {
        close(unit, gathered, end, &mut open);
    }
    stretches
}

/// Whether `unit`'s parameters live on the host between uses (they are copied in).
pub(crate) fn host_homed(p: &Profile, unit: usize) -> bool {
    p.records.iter().any(|r| matches!(r, Record::Copy { unit: u, to: Placement::Device, .. } if *u == unit))
}

/// One unit's cost, averaged over the ranks that ran it.
#[derive(Clone, Debug, PartialEq)]
pub struct UnitCost {
    /// The unit's name.
    pub name: String,
    /// Seconds in the unit's forwards, summed over the profile.
    pub forward_s: f64,
    /// Seconds in the unit's backwards, summed over the profile.
    pub backward_s: f64,
    /// Bytes of the unit's parameters, whole (not sharded), in the engine's dtype.
    pub param_bytes: u64,
    /// Activations the ledger gained over the unit's forward (what it keeps for backward),
    /// the largest over its forwards.
    pub activation_bytes: u64,
}

/// Per unit, time in forward and backward (summed over the profile) and memory, averaged
/// over the ranks of `profiles` that ran it (all of them, or one pipeline stage's).
pub fn unit_costs(profiles: &[Profile]) -> Vec<UnitCost> {
    let Some(first) = profiles.first() else { return vec![] };
    let mut costs: Vec<UnitCost> = first
        .header
        .units
        .iter()
        .zip(&first.header.unit_param_bytes)
        .map(|(name, &param_bytes)| UnitCost {
            name: name.clone(),
            forward_s: 0.0,
            backward_s: 0.0,
            param_bytes,
            activation_bytes: 0,
        })
        .collect();
    let mut ran = vec![0usize; costs.len()];
    for p in profiles {
        let mut ran_here = vec![false; costs.len()];
        for span in p.spans() {
            match span.kind {
                SpanKind::Forward(u) => {
                    costs[u].forward_s += span.end - span.start;
                    ran_here[u] = true;
                }
                SpanKind::Backward(u) => costs[u].backward_s += span.end - span.start,
                SpanKind::Recompute(_) | SpanKind::Update => {}
            }
        }
        ran.iter_mut().zip(ran_here).for_each(|(n, here)| *n += usize::from(here));
        let activations =
            |memory: &Memory| -> u64 { memory.values().filter_map(|by| by.get(&Category::Activations)).sum() };
        let mut before: BTreeMap<usize, u64> = BTreeMap::new();
        for r in &p.records {
            if let Record::Phase { phase, unit, memory, .. } = r {
                match phase {
                    Phase::BeforeForward => {
                        before.insert(*unit, activations(memory));
                    }
                    Phase::AfterForward => {
                        if let Some(b) = before.remove(unit) {
                            let kept = activations(memory).saturating_sub(b);
                            costs[*unit].activation_bytes = costs[*unit].activation_bytes.max(kept);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    for (c, &n) in costs.iter_mut().zip(&ran) {
        c.forward_s /= n.max(1) as f64;
        c.backward_s /= n.max(1) as f64;
    }
    costs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Header;

    fn memory(device_params: u64, activations: u64) -> Memory {
        let mut by = BTreeMap::new();
        by.insert(Category::Params, device_params);
        by.insert(Category::Activations, activations);
        [(Placement::Device, by)].into_iter().collect()
    }

    fn phase(t: f64, phase: Phase, unit: usize, activations: u64) -> Record {
        Record::Phase { t, phase, unit, memory: memory(100, activations), storage_bytes: 0, allocated: Some(500) }
    }

    fn profile(records: Vec<Record>) -> Profile {
        let header = Header {
            format: crate::profile::FORMAT.into(),
            version: crate::profile::VERSION,
            rank: 0,
            world: 1,
            units: vec!["a".into(), "b".into()],
            unit_param_bytes: vec![40, 60],
            device: "Cpu".into(),
            started_at: 0.0,
        };
        Profile { header, records }
    }

    #[test]
    fn series_follow_the_records() {
        let p = profile(vec![
            Record::Gather { t: 0.0, unit: 1 },
            phase(0.1, Phase::BeforeForward, 0, 0),
            phase(0.2, Phase::AfterForward, 0, 30),
            phase(0.3, Phase::BeforeForward, 1, 30),
            Record::Freed { t: 0.35, unit: 1 },
            phase(0.4, Phase::AfterForward, 1, 80),
            Record::Copy { t: 0.45, unit: 0, to: Placement::Device, bytes: 40 },
            Record::Evict { t: 0.5, unit: 0 },
            Record::Copy { t: 0.55, unit: 1, to: Placement::Device, bytes: 60 },
        ]);
        let series = memory_series(&p);
        assert_eq!(series.len(), 4);
        assert_eq!(series[1].by_placement[&Placement::Device], 130);
        assert_eq!(series[1].device_model_states, 100);
        assert_eq!(series[1].allocated, Some(500));
        let stretches = residency(&p);
        assert_eq!(
            stretches,
            vec![
                UnitStretch { unit: 1, residency: Residency::Gathered, start: 0.0, end: 0.35 },
                UnitStretch { unit: 0, residency: Residency::OnDevice, start: 0.45, end: 0.5 },
                UnitStretch { unit: 1, residency: Residency::OnDevice, start: 0.55, end: 0.55 },
            ]
        );
        assert!(host_homed(&p, 0) && host_homed(&p, 1));
        let costs = unit_costs(&[p.clone(), p]);
        assert_eq!((costs[0].param_bytes, costs[0].activation_bytes), (40, 30));
        assert_eq!((costs[1].param_bytes, costs[1].activation_bytes), (60, 50));
        assert!((costs[0].forward_s - 0.1).abs() < 1e-12 && costs[0].backward_s == 0.0);
    }
}
