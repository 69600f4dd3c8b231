//! Chrome trace / Perfetto JSON from profiles: one process per rank, with its unit phases on
//! a compute track, the engine thread's waits on collectives on a track of their own,
//! gathers and frees on a communication track, each group's collectives on that group's
//! track, copies and evictions on a copy track (so overlap, or its absence, is visible),
//! checkpoint saves on the compute track and their writer on a track of its own, and the
//! ledger's bytes per placement and the allocator's as counters.
//!
//! Owns the mapping of records to trace events. Must not read or write files: it takes read
//! [`Profile`]s and returns JSON, which the CLI writes.
use super::{Memory, Profile, Record, SpanKind};
use serde_json::{json, Value};

const COMPUTE: usize = 0;
const COMMUNICATION: usize = 1;
const COPIES: usize = 2;
const WAITS: usize = 3;
const PIPELINE: usize = 4;
const CHECKPOINT_WRITER: usize = 5;
/// Groups' tracks are numbered from here, in the order their first collective finished.
const FIRST_GROUP: usize = 10;

fn micros(t: f64) -> f64 {
    t * 1e6
}

/// Bytes per placement, for a counter.
fn totals(memory: &Memory) -> Value {
    let per: serde_json::Map<String, Value> =
        memory.iter().map(|(p, by)| (p.name().to_string(), json!(by.values().sum::<u64>()))).collect();
    Value::Object(per)
}

/// The trace of `profiles` (`{"traceEvents": [...], "displayTimeUnit": "ms"}`).
pub fn chrome_trace(profiles: &[Profile]) -> Value {
    let mut events = Vec::new();
    let offsets = super::clock_offsets(profiles);
    for (p, offset) in profiles.iter().zip(offsets) {
        let pid = p.header.rank;
        // Every rank's times on one clock, so the ranks line up.
        let at = |t: f64| micros(t + offset);
        events.push(json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": format!("rank {pid}")}}));
        for (tid, name) in [
            (COMPUTE, "compute"),
            (WAITS, "blocked on communication"),
            (COMMUNICATION, "gathers and frees"),
            (COPIES, "copies"),
            (PIPELINE, "pipeline operations"),
            (CHECKPOINT_WRITER, "checkpoint writer"),
        ] {
            events.push(json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}));
        }
        let mut groups: Vec<String> = Vec::new();
        for run in p.collectives() {
            let index = groups.iter().position(|g| *g == run.group).unwrap_or_else(|| {
                groups.push(run.group.clone());
                groups.len() - 1
            });
            events.push(json!({
                "ph": "X", "pid": pid, "tid": FIRST_GROUP + index, "cat": "collective", "name": run.op,
                "ts": at(run.start), "dur": micros(run.end - run.start),
                "args": {"bytes": run.bytes, "issued_us": micros(run.issued)},
            }));
        }
        for (index, group) in groups.iter().enumerate() {
            events.push(json!({
                "ph": "M", "name": "thread_name", "pid": pid, "tid": FIRST_GROUP + index, "args": {"name": group},
            }));
        }
        for span in p.spans() {
            let (cat, name) = match span.kind {
                SpanKind::Forward(u) => ("forward", format!("forward {}", p.unit_name(u))),
                SpanKind::Backward(u) => ("backward", format!("backward {}", p.unit_name(u))),
                SpanKind::Recompute(u) => ("recompute", format!("recompute {}", p.unit_name(u))),
                SpanKind::Update => ("update", "update".to_string()),
            };
            events.push(json!({
                "ph": "X", "pid": pid, "tid": COMPUTE, "cat": cat, "name": name,
                "ts": at(span.start), "dur": micros(span.end - span.start),
            }));
        }
        for r in &p.records {
            match r {
                Record::Phase { t, memory, allocated, .. } | Record::Update { t, memory, allocated, .. } => {
                    events.push(json!({"ph": "C", "pid": pid, "name": "memory", "ts": at(*t), "args": totals(memory)}));
                    if let Some(bytes) = allocated {
                        events.push(json!({
                            "ph": "C", "pid": pid, "name": "allocator", "ts": at(*t), "args": {"allocated": bytes},
                        }));
                    }
                }
                Record::Wait { t, start, op, compute: true, .. } => events.push(json!({
                    "ph": "X", "pid": pid, "tid": WAITS, "cat": "wait", "name": format!("wait {op}"),
                    "ts": at(*start), "dur": micros(t - start),
                })),
                Record::Op { t, start, op, micro, chunk } => events.push(json!({
                    "ph": "X", "pid": pid, "tid": PIPELINE, "cat": "pipeline",
                    "name": format!("{op} {micro}"), "ts": at(*start), "dur": micros(t - start),
                    "args": {"micro_batch": micro, "chunk": chunk},
                })),
                Record::CopyWait { t, start, unit } => events.push(json!({
                    "ph": "X", "pid": pid, "tid": WAITS, "cat": "copy_wait",
                    "name": format!("wait for the copy of {}", p.unit_name(*unit)),
                    "ts": at(*start), "dur": micros(t - start),
                })),
                Record::Save { t, start, step, waited_s } => events.push(json!({
                    "ph": "X", "pid": pid, "tid": COMPUTE, "cat": "checkpoint",
                    "name": format!("checkpoint of step {step}"), "ts": at(*start), "dur": micros(t - start),
                    "args": {"waited_for_writer_us": micros(*waited_s)},
                })),
                Record::Persist { t, start, step } => events.push(json!({
                    "ph": "X", "pid": pid, "tid": CHECKPOINT_WRITER, "cat": "checkpoint",
                    "name": format!("persist step {step}"), "ts": at(*start), "dur": micros(t - start),
                })),
                Record::Wait { .. } | Record::Collective { .. } | Record::Recompute { .. } => {}
                Record::Gather { t, unit } | Record::Freed { t, unit } => {
                    let what = if matches!(r, Record::Gather { .. }) { "gather" } else { "free" };
                    events.push(json!({
                        "ph": "i", "s": "t", "pid": pid, "tid": COMMUNICATION, "cat": what,
                        "name": format!("{what} {}", p.unit_name(*unit)), "ts": at(*t),
                    }));
                }
                Record::Copy { t, unit, to, bytes } => events.push(json!({
                    "ph": "i", "s": "t", "pid": pid, "tid": COPIES, "cat": "copy",
                    "name": format!("copy {} to the {}", p.unit_name(*unit), to.name()),
                    "ts": at(*t), "args": {"bytes": bytes},
                })),
                Record::Evict { t, unit } => events.push(json!({
                    "ph": "i", "s": "t", "pid": pid, "tid": COPIES, "cat": "evict",
                    "name": format!("evict {}", p.unit_name(*unit)), "ts": at(*t),
                })),
            }
        }
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}
