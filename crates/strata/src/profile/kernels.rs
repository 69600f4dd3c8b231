//! Kernel traces: libtorch's Kineto profiler (what `torch.profiler` drives) records the
//! operators a thread runs and a GPU's kernels and copies in a Chrome trace; this starts and
//! saves one, and reads the device's time per kernel back from any such trace, PyTorch's
//! own included, so two stacks' steps compare kernel by kernel.
//!
//! Owns: reading the trace format's device activity. Must not decide what to trace: its
//! callers start and save around the stretch they want.
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

#[derive(Deserialize)]
struct TraceEvent {
    #[serde(default)]
    cat: String,
    #[serde(default)]
    name: String,
    /// Microseconds, on complete ("X") events.
    dur: Option<f64>,
}

/// Milliseconds of device time per kernel (or copy) name in the Chrome trace at `path`.
pub fn device_ms_by_name(path: &Path) -> Result<BTreeMap<String, f64>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let trace: Trace =
        serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: not a Chrome trace: {e}", path.display())))?;
    let mut out = BTreeMap::new();
    for e in trace.events.into_iter().filter(|e| DEVICE_CATEGORIES.contains(&e.cat.as_str())) {
        if let Some(us) = e.dur {
            *out.entry(e.name).or_default() += us / 1e3;
        }
    }
    Ok(out)
}
