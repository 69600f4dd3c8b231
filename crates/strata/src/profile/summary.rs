//! A profile's summary, per rank: per unit its forward and backward time and calls, the
//! ledger's peaks per placement, bytes copied each way, the update's time; collectives per
//! operation with how much of their time the computation hid; and the critical path of the
//! engine's thread, split into unit compute, exposed communication, update and the rest.
//!
//! Owns the arithmetic over read profiles and the table. Must not read files or draw: it
//! takes [`Profile`]s the parent module read, and pictures are [`super::plot`]'s.
use super::series::unit_costs;
use super::{covered_seconds, Profile, Record, SpanKind};
use crate::engine::Placement;
use serde::Serialize;
use std::collections::BTreeMap;

/// One unit's figures on one rank.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct UnitSummary {
    /// The unit's index in the model.
    pub unit: usize,
    /// The unit's name.
    pub name: String,
    /// Forward spans recorded.
    pub forwards: u64,
    /// Backward spans recorded.
    pub backwards: u64,
    /// Seconds in the unit's forwards, summed.
    pub forward_s: f64,
    /// Seconds in the unit's backwards, summed.
    pub backward_s: f64,
    /// Bytes of the unit's parameters (whole) and of the activations its forward kept for
    /// backward (the most over its forwards).
    pub param_bytes: u64,
    /// Bytes of the activations its forward kept for backward.
    pub activation_bytes: u64,
    /// Forwards run again in backward, and their seconds (part of `backward_s`).
    pub recomputes: u64,
    /// Seconds of those recomputes (part of `backward_s`).
    pub recompute_s: f64,
}

/// Collectives of one operation.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct OpSummary {
    /// The operation's name.
    pub op: String,
    /// Collectives of this operation recorded.
    pub calls: u64,
    /// Bytes they moved or reduced, summed.
    pub bytes: u64,
    /// Seconds they ran (each from its start on its group to its end), summed.
    pub seconds: f64,
}

/// Where the engine's thread spent the recorded time. The engine runs on one thread, so
/// this is the step's critical path: communication on it is what was not hidden.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CriticalPath {
    /// Units computing (forward and backward spans, less waits inside them).
    pub compute_s: f64,
    /// Blocked on collectives.
    pub exposed_comm_s: f64,
    /// Waiting for copies between device and host (offload), outside collectives.
    pub copy_wait_s: f64,
    /// In the update, outside unit spans and waits.
    pub update_s: f64,
    /// Neither: data, loss, the schedule's own work.
    pub other_s: f64,
}

/// One rank's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RankSummary {
    /// The rank whose profile this is.
    pub rank: usize,
    /// Seconds from the first record to the last.
    pub seconds: f64,
    /// Units by forward + backward time, slowest first.
    pub units: Vec<UnitSummary>,
    /// The ledger's largest total at any recorded moment, per placement.
    pub peak_bytes: BTreeMap<Placement, u64>,
    /// Bytes of states copied from the host to the device.
    pub copied_to_device: u64,
    /// Bytes of states copied from the device to the host.
    pub copied_to_host: u64,
    /// Gathers of parameters started.
    pub gathers: u64,
    /// Seconds in updates, summed.
    pub update_s: f64,
    /// Updates recorded.
    pub updates: u64,
    /// Checkpoint saves recorded.
    pub checkpoints: u64,
    /// Seconds checkpoint saves stopped training, summed.
    pub checkpoint_blocked_s: f64,
    /// Seconds the asynchronous saves' writer ran beside training, summed.
    pub checkpoint_persist_s: f64,
    /// Collectives by operation, most time first.
    pub collectives: Vec<OpSummary>,
    /// Seconds some collective of this rank was running.
    pub comm_busy_s: f64,
    /// Of those, seconds the engine's thread was not waiting: communication hidden behind
    /// computation.
    pub comm_overlapped_s: f64,
    /// How the engine's thread spent the recorded time.
    pub critical_path: CriticalPath,
    /// Where a pipeline ran: the fraction of its time this rank computed nothing.
    pub pipeline_bubble: Option<f64>,
}

/// Summarises each rank's profile.
pub fn summarize(profiles: &[Profile]) -> Vec<RankSummary> {
    profiles.iter().map(rank_summary).collect()
}

fn rank_summary(p: &Profile) -> RankSummary {
    let mut s = RankSummary { rank: p.header.rank, ..Default::default() };
    let mut units: Vec<UnitSummary> = unit_costs(std::slice::from_ref(p))
        .into_iter()
        .enumerate()
        .map(|(unit, c)| UnitSummary {
            unit,
            name: c.name,
            param_bytes: c.param_bytes,
            activation_bytes: c.activation_bytes,
            ..Default::default()
        })
        .collect();
    for span in p.spans() {
        let spent = span.end - span.start;
        match span.kind {
            SpanKind::Forward(u) => {
                units[u].forwards += 1;
                units[u].forward_s += spent;
            }
            SpanKind::Backward(u) => {
                units[u].backwards += 1;
                units[u].backward_s += spent;
            }
            SpanKind::Recompute(u) => {
                units[u].recomputes += 1;
                units[u].recompute_s += spent;
            }
            SpanKind::Update => {
                s.updates += 1;
                s.update_s += spent;
            }
        }
    }
    for r in &p.records {
        match r {
            Record::Phase { memory, .. } | Record::Update { memory, .. } => {
                for (placement, by) in memory {
                    let peak = s.peak_bytes.entry(*placement).or_default();
                    *peak = (*peak).max(by.values().sum());
                }
            }
            Record::Gather { .. } => s.gathers += 1,
            Record::Copy { to: Placement::Device, bytes, .. } => s.copied_to_device += bytes,
            Record::Copy { to: Placement::Host, bytes, .. } => s.copied_to_host += bytes,
            Record::Save { t, start, .. } => {
                s.checkpoints += 1;
                s.checkpoint_blocked_s += t - start;
            }
            Record::Persist { t, start, .. } => s.checkpoint_persist_s += t - start,
            Record::Freed { .. }
            | Record::Evict { .. }
            | Record::Recompute { .. }
            | Record::CopyWait { .. }
            | Record::Op { .. }
            | Record::Collective { .. }
            | Record::Wait { .. } => {}
        }
    }
    s.pipeline_bubble = p.bubble();
    let (first, last) = p.time_range();
    s.seconds = last - first;
    let runs = p.collectives();
    let mut by_op: BTreeMap<&str, OpSummary> = BTreeMap::new();
    for run in &runs {
        let o = by_op.entry(run.op.as_str()).or_insert_with(|| OpSummary { op: run.op.clone(), ..Default::default() });
        o.calls += 1;
        o.bytes += run.bytes;
        o.seconds += run.end - run.start;
    }
    s.collectives = by_op.into_values().collect();
    s.collectives.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    s.comm_busy_s = covered_seconds(runs.iter().map(|r| (r.start, r.end)).collect());
    let waits = p.compute_waits();
    let exposed = covered_seconds(waits.clone());
    s.comm_overlapped_s = (s.comm_busy_s - exposed).max(0.0);
    let spans = p.spans();
    let unit_spans: Vec<(f64, f64)> =
        spans.iter().filter(|x| x.kind != SpanKind::Update).map(|x| (x.start, x.end)).collect();
    let updates: Vec<(f64, f64)> =
        spans.iter().filter(|x| x.kind == SpanKind::Update).map(|x| (x.start, x.end)).collect();
    // Each part is what it adds to the ones before it, so the parts add up to the whole.
    let all_waits = [waits, p.copy_waits()].concat();
    let waiting = covered_seconds(all_waits.clone());
    let units_or_waiting = covered_seconds([unit_spans.clone(), all_waits.clone()].concat());
    let busy = covered_seconds([unit_spans, all_waits, updates].concat());
    s.critical_path = CriticalPath {
        compute_s: units_or_waiting - waiting,
        exposed_comm_s: exposed,
        copy_wait_s: waiting - exposed,
        update_s: busy - units_or_waiting,
        other_s: (s.seconds - busy).max(0.0),
    };
    units.sort_by(|a, b| (b.forward_s + b.backward_s).total_cmp(&(a.forward_s + a.backward_s)));
    s.units = units;
    s
}

/// The summary as a table: per rank, the `top` slowest units and the totals.
pub fn table(summaries: &[RankSummary], top: usize) -> String {
    let mut out = String::new();
    for s in summaries {
        out.push_str(&format!(
            "rank {}: {:.3} s recorded, {} updates ({:.3} s), {} gathers, copied {:.1} MB to the device and {:.1} MB to the host\n",
            s.rank,
            s.seconds,
            s.updates,
            s.update_s,
            s.gathers,
            s.copied_to_device as f64 / 1e6,
            s.copied_to_host as f64 / 1e6
        ));
        for (placement, peak) in &s.peak_bytes {
            out.push_str(&format!("  peak on the {}: {:.2} MB (ledger)\n", placement.name(), *peak as f64 / 1e6));
        }
        if s.checkpoints > 0 {
            out.push_str(&format!(
                "  checkpoints: {} saves stopped training for {:.3} s; their writer ran {:.3} s beside it\n",
                s.checkpoints, s.checkpoint_blocked_s, s.checkpoint_persist_s
            ));
        }
        if let Some(bubble) = s.pipeline_bubble {
            out.push_str(&format!("  pipeline bubble: {:.1}% of the schedule's time\n", bubble * 100.0));
        }
        let path = &s.critical_path;
        let per_step = |x: f64| x * 1e3 / s.updates.max(1) as f64;
        out.push_str(&format!(
            "  critical path per step: {:.2} ms unit compute, {:.2} ms exposed communication, {:.2} ms copy-wait, {:.2} ms update, {:.2} ms other\n",
            per_step(path.compute_s),
            per_step(path.exposed_comm_s),
            per_step(path.copy_wait_s),
            per_step(path.update_s),
            per_step(path.other_s)
        ));
        if !s.collectives.is_empty() {
            let hidden = if s.comm_busy_s > 0.0 { 100.0 * s.comm_overlapped_s / s.comm_busy_s } else { 0.0 };
            out.push_str(&format!(
                "  communication: {:.2} ms running, {:.2} ms exposed, {:.2} ms overlapped ({hidden:.0}% hidden)\n",
                s.comm_busy_s * 1e3,
                path.exposed_comm_s * 1e3,
                s.comm_overlapped_s * 1e3
            ));
            for o in &s.collectives {
                out.push_str(&format!(
                    "    {:<16} {:>6} calls {:>10.2} MB {:>10.2} ms\n",
                    o.op,
                    o.calls,
                    o.bytes as f64 / 1e6,
                    o.seconds * 1e3
                ));
            }
        }
        out.push_str(&format!(
            "  {:<24} {:>9} {:>12} {:>9} {:>12} {:>13} {:>10} {:>10}\n",
            "unit", "forwards", "forward ms", "backwards", "backward ms", "recompute ms", "params MB", "kept MB"
        ));
        for u in s.units.iter().take(top) {
            out.push_str(&format!(
                "  {:<24} {:>9} {:>12.2} {:>9} {:>12.2} {:>13.2} {:>10.2} {:>10.2}\n",
                u.name,
                u.forwards,
                u.forward_s * 1e3,
                u.backwards,
                u.backward_s * 1e3,
                u.recompute_s * 1e3,
                u.param_bytes as f64 / 1e6,
                u.activation_bytes as f64 / 1e6
            ));
        }
        let mut by_memory: Vec<&UnitSummary> = s.units.iter().collect();
        by_memory.sort_by_key(|u| std::cmp::Reverse(u.param_bytes + u.activation_bytes));
        let most: Vec<String> = by_memory
            .iter()
            .take(top.min(5))
            .map(|u| format!("{} {:.2} MB", u.name, (u.param_bytes + u.activation_bytes) as f64 / 1e6))
            .collect();
        out.push_str(&format!("  most memory (parameters + kept activations): {}\n", most.join(", ")));
    }
    out
}
