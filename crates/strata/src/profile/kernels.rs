//! Kernel traces: libtorch's Kineto profiler (what `torch.profiler` drives) records the
//! operators a thread runs and a GPU's kernels and copies in a Chrome trace; this starts and
//! saves one, and reads back from any such trace, PyTorch's own included, the device's time
//! per kernel or the host's self time per operator, so two stacks' steps compare kernel by
//! kernel, or operator by operator on a CPU.
//!
//! Owns: reading the trace format's activity. Must not decide what to trace: its callers
//! start and save around the stretch they want.
use crate::{Error, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

/// Starts recording the calling thread's operators and, with `gpu`, the device's activity.
pub fn start(gpu: bool) -> Result<()> {
    Ok(strata_ext::kernel_trace::start(gpu)?)
}

/// Stops the recording this thread started and writes its Chrome trace to `path`.
pub fn save(path: &Path) -> Result<()> {
    Ok(strata_ext::kernel_trace::save(path)?)
}

/// The categories of device activity in a Kineto trace: kernels, copies and fills.
const DEVICE_CATEGORIES: [&str; 3] = ["kernel", "gpu_memcpy", "gpu_memset"];

#[derive(Deserialize)]
struct Trace {
    #[serde(rename = "traceEvents")]
    events: Vec<TraceEvent>,
}

/// The category of the host's operators (`aten::mm`, ...) in a Kineto trace.
const HOST_CATEGORY: &str = "cpu_op";

#[derive(Deserialize)]
struct TraceEvent {
    #[serde(default)]
    cat: String,
    #[serde(default)]
    name: String,
    /// Microseconds from the trace's start.
    ts: Option<f64>,
    /// Microseconds, on complete ("X") events.
    dur: Option<f64>,
    /// The recording thread: a number in Kineto's traces, a name in some others.
    #[serde(default)]
    tid: serde_json::Value,
}

fn read_trace(path: &Path) -> Result<Vec<TraceEvent>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let trace: Trace =
        serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: not a Chrome trace: {e}", path.display())))?;
    Ok(trace.events)
}

/// Milliseconds of device time per kernel (or copy) name in the Chrome trace at `path`.
pub fn device_ms_by_name(path: &Path) -> Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for e in read_trace(path)?.into_iter().filter(|e| DEVICE_CATEGORIES.contains(&e.cat.as_str())) {
        if let Some(us) = e.dur {
            *out.entry(e.name).or_default() += us / 1e3;
        }
    }
    Ok(out)
}

/// Milliseconds of host time per operator name in the Chrome trace at `path`, each
/// operator's self time: its duration less that of the operators it called, which run
/// nested inside it on the same thread (a copy inside a product counts as the copy's).
pub fn host_self_ms_by_name(path: &Path) -> Result<BTreeMap<String, f64>> {
    // Whole nanoseconds, so that an operator ending where the next starts compares equal
    // (decimal microseconds need not add up exactly).
    let ns = |us: f64| (us * 1e3).round() as i64;
    let mut by_thread: BTreeMap<String, Vec<(i64, i64, String)>> = BTreeMap::new();
    for e in read_trace(path)?.into_iter().filter(|e| e.cat == HOST_CATEGORY) {
        if let (Some(ts), Some(dur)) = (e.ts, e.dur) {
            by_thread.entry(e.tid.to_string()).or_default().push((ns(ts), ns(dur), e.name));
        }
    }
    let mut out = BTreeMap::new();
    for mut ops in by_thread.into_values() {
        // Callers before callees: by start, the longer first of two that start together.
        ops.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut own: Vec<i64> = ops.iter().map(|op| op.1).collect();
        // The operators still running at each start: (end, index), innermost last.
        let mut running: Vec<(i64, usize)> = Vec::new();
        for (i, &(ts, dur, _)) in ops.iter().enumerate() {
            while running.last().is_some_and(|&(end, _)| end <= ts) {
                running.pop();
            }
            if let Some(&(_, caller)) = running.last() {
                own[caller] -= dur;
            }
            running.push((ts + dur, i));
        }
        for ((_, _, name), ns) in ops.into_iter().zip(own) {
            // A callee's clock may overrun its caller's by a rounding.
            *out.entry(name).or_default() += ns.max(0) as f64 / 1e6;
        }
    }
    Ok(out)
}
