//! A profile's summary: per unit its forward and backward time and calls, the ledger's peaks
//! per placement, bytes copied each way, the update's time, per rank and over the job.
use super::{Profile, Record, SpanKind};
use crate::engine::Placement;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct UnitSummary {
    pub unit: usize,
    pub name: String,
    pub forwards: u64,
    pub backwards: u64,
    pub forward_s: f64,
    pub backward_s: f64,
}

/// One rank's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RankSummary {
    pub rank: usize,
    /// Seconds from the first record to the last.
    pub seconds: f64,
    /// Units by forward + backward time, slowest first.
    pub units: Vec<UnitSummary>,
    pub peak_bytes: BTreeMap<Placement, u64>,
    pub copied_to_device: u64,
    pub copied_to_host: u64,
    pub gathers: u64,
    pub update_s: f64,
    pub updates: u64,
}

/// Summarises each rank's profile.
pub fn summarize(profiles: &[Profile]) -> Vec<RankSummary> {
    profiles.iter().map(rank_summary).collect()
}

fn rank_summary(p: &Profile) -> RankSummary {
    let mut s = RankSummary { rank: p.header.rank, ..Default::default() };
    let mut units: Vec<UnitSummary> = p
        .header
        .units
        .iter()
        .enumerate()
        .map(|(unit, name)| UnitSummary { unit, name: name.clone(), ..Default::default() })
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
            Record::Freed { .. } | Record::Evict { .. } => {}
        }
    }
    if let (Some(first), Some(last)) = (p.records.first(), p.records.last()) {
        s.seconds = last.t() - first.t();
    }
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
            let placement = format!("{placement:?}").to_lowercase();
            out.push_str(&format!("  peak on the {placement}: {:.2} MB (ledger)\n", *peak as f64 / 1e6));
        }
        out.push_str(&format!(
            "  {:<24} {:>9} {:>12} {:>9} {:>12}\n",
            "unit", "forwards", "forward ms", "backwards", "backward ms"
        ));
        for u in s.units.iter().take(top) {
            out.push_str(&format!(
                "  {:<24} {:>9} {:>12.2} {:>9} {:>12.2}\n",
                u.name,
                u.forwards,
                u.forward_s * 1e3,
                u.backwards,
                u.backward_s * 1e3
            ));
        }
    }
    out
}
