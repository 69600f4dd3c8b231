//! This machine's throughput, measured: what the step-time model needs of a device that
//! has no data sheet (the CPU acting as one). A product of the size a run's blocks multiply
//! in fp32 and in bf16, and a large copy, each timed for a short while.
//!
//! Owns the measurements and the description of the machine at hand. Must not predict
//! anything ([`super::step_time`] does) or hold what it allocates past the call.
use super::estimate::{self, DeviceKind};
use super::step_time::{Cluster, Link, LinkKind};
use crate::Result;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// How long each measurement runs.
const SPAN: Duration = Duration::from_millis(200);

/// Repeats `work` for about [`SPAN`] after one warm-up, and returns its seconds per call.
/// A warm-up longer than the span is the measurement itself (a bf16 product on a CPU
/// without bf16 units takes seconds; warming up matters at microseconds).
fn seconds_per_call(mut work: impl FnMut() -> Result<()>) -> Result<f64> {
    let warm_up = Instant::now();
    work()?;
    if warm_up.elapsed() >= SPAN {
        return Ok(warm_up.elapsed().as_secs_f64());
    }
    let start = Instant::now();
    let mut calls = 0u32;
    while start.elapsed() < SPAN || calls < 3 {
        work()?;
        calls += 1;
    }
    Ok(start.elapsed().as_secs_f64() / f64::from(calls))
}

/// Rows of the first, small product [`product_flops`] times.
const PROBE_ROWS: i64 = 16;

/// FLOP/s of `[tokens, width] × [width, 4·width]` products in `kind` on the CPU. A product
/// of [`PROBE_ROWS`] rows is timed first: where it says the full one would outlast
/// [`SPAN`] (bf16 on a CPU without bf16 units, whose loops run at one rate whatever the
/// rows), its rate stands, and the search does not wait seconds for a figure it already has.
fn product_flops(tokens: i64, width: i64, kind: Kind) -> Result<f64> {
    let flops = |rows: i64| 2.0 * (rows * width * 4 * width) as f64;
    let rate = |rows: i64| -> Result<f64> {
        let opts = (kind, Device::Cpu);
        let (a, b) = (Tensor::f_randn([rows, width], opts)?, Tensor::f_randn([width, 4 * width], opts)?);
        let seconds = seconds_per_call(|| {
            let _product = a.f_matmul(&b)?;
            Ok(())
        })?;
        Ok(flops(rows) / seconds)
    };
    let probe = tokens.min(PROBE_ROWS);
    let probed = rate(probe)?;
    if probe == tokens || flops(tokens) / probed > SPAN.as_secs_f64() {
        return Ok(probed);
    }
    rate(tokens)
}

/// The CPU as a device, its products measured at `tokens` rows of `width` features (the
/// sizes a run multiplies), its memory bandwidth by a 64 MiB copy, and the cost of issuing
/// one operator by a tiny product's forward and backward.
/// Measured once per process and size: a search's passes ask again for the same sizes.
pub fn this_machine(tokens: i64, width: i64) -> Result<DeviceKind> {
    static MEASURED: std::sync::Mutex<Vec<((i64, i64), DeviceKind)>> = std::sync::Mutex::new(Vec::new());
    if let Some((_, known)) =
        MEASURED.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(k, _)| *k == (tokens, width))
    {
        return Ok(known.clone());
    }
    let measured = measure(tokens, width)?;
    MEASURED.lock().unwrap_or_else(|e| e.into_inner()).push(((tokens, width), measured.clone()));
    Ok(measured)
}

fn measure(tokens: i64, width: i64) -> Result<DeviceKind> {
    let src = Tensor::f_zeros([16 << 20], (Kind::Float, Device::Cpu))?;
    let dst = src.f_empty_like()?;
    let copy = seconds_per_call(|| {
        dst.shallow_clone().f_copy_(&src)?;
        Ok(())
    })?;
    // A small product forward and backward: four operators (the product, its two gradient
    // products, the accumulation), each with autograd's bookkeeping.
    let x = Tensor::f_randn([8, 64], (Kind::Float, Device::Cpu))?;
    let w = Tensor::f_randn([64, 64], (Kind::Float, Device::Cpu))?.set_requires_grad(true);
    let small = seconds_per_call(|| {
        let y = x.f_matmul(&w)?.f_sum(Kind::Float)?;
        y.f_backward()?;
        Ok(())
    })?;
    let mut cpu = estimate::device_kind("cpu")?;
    cpu.op_seconds = small / 4.0;
    cpu.fp32_flops = product_flops(tokens, width, Kind::Float)?;
    cpu.bf16_flops = product_flops(tokens, width, Kind::BFloat16)?;
    // Read and written once each.
    cpu.memory_bandwidth = 2.0 * (16u64 << 20) as f64 * 4.0 / copy;
    Ok(cpu)
}

/// This machine as one node of `ranks` devices of `device`'s kind. Processes of one
/// machine share memory: a copy between two of them reads and writes once each. A GPU
/// node is taken to link its devices by NVLink (an H100 SXM's 450 GB/s each way).
pub fn node_of(device: DeviceKind, ranks: usize) -> Cluster {
    let intra = match device.name {
        "cpu" => Link { kind: LinkKind::Shm, bandwidth: device.memory_bandwidth / 2.0, latency: 2e-6 },
        _ => Link { kind: LinkKind::Nvlink, bandwidth: 450e9, latency: 3e-6 },
    };
    let host = if device.name == "cpu" { device.memory_bandwidth } else { 25e9 };
    Cluster {
        nodes: 1,
        gpus_per_node: ranks.max(1),
        intra,
        inter: intra,
        host_link: host,
        host_bandwidth: host,
        efficiency: if device.name == "cpu" { 1.0 } else { 0.87 },
        device,
    }
}

/// The kind of CUDA device `index` from the table, by its name (an H100 where the name
/// matches none).
pub fn cuda_kind(index: usize) -> Result<DeviceKind> {
    let name = strata_ext::cuda::device_name(index)?.to_ascii_lowercase();
    let kinds = estimate::device_kinds();
    let family = |k: &&DeviceKind| k.name != "cpu" && name.contains(k.name.split('-').next().unwrap_or(k.name));
    // The family's entry of the same memory size where the name says it, else its first.
    let matching = kinds
        .iter()
        .filter(family)
        .find(|k| k.name.split_once('-').is_none_or(|(_, size)| name.contains(size)))
        .or_else(|| kinds.iter().find(family));
    matching.cloned().map_or_else(|| estimate::device_kind("h100-80gb"), Ok)
}
