//! `strata plan`: how should a model run on a cluster one describes? The best layouts by
//! predicted step time among those the memory estimate lets fit, with tokens/s, MFU,
//! device memory, bubble and exposed communication, why the others lost, and the winner
//! written as a strategy file `strata train` runs unchanged.
//!
//! Owns the command's flags and its table. Must not search or predict (`strata::auto::plan`
//! does).
use crate::estimate_cmd::{optimizer_state_bytes, ModelArgs, PrecisionArg};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;
use strata::auto::estimate;
use strata::auto::plan::{self, PlanReport, PlanRequest};
use strata::auto::step_time::{self, Cluster, Link};
use strata::profile::human_bytes;

#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    #[arg(long, default_value_t = 8)]
    gpus_per_node: usize,
    /// The device kind: h100-80gb, h200, a100-80gb or a100-40gb.
    #[arg(long, default_value = "h100-80gb")]
    device: String,
    /// The link between the devices of a node, per device each way (default: NVLink at
    /// 450 GB/s on H100 and H200, 300 GB/s on A100).
    #[arg(long)]
    intra: Option<String>,
    /// The network between nodes, per node (shared by its devices).
    #[arg(long, default_value = "ib:8x400Gb/s")]
    inter: String,
    /// A device's link to its host, each way (offload's copies).
    #[arg(long, default_value = "pcie:25GB/s")]
    host_link: String,
    /// Host memory per node in bytes (default: the device kind's usual server).
    #[arg(long)]
    host_memory: Option<u64>,
    /// Sequences per step over all devices.
    #[arg(long, default_value_t = 512)]
    global_batch: usize,
    /// Precisions to search, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "amp-bf16")]
    precision: Vec<PrecisionArg>,
    /// The share of the device's peak its matrix products reach.
    #[arg(long, default_value_t = 0.87)]
    efficiency: f64,
    /// Optimizer: adamw or sgd.
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// Plans to print.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Write the best plan's strategy here (JSON).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// `pcie:25GB/s` as bytes/s (a device's own link to its host).
fn host_link(text: &str) -> Result<f64> {
    step_time::parse_rate(text.strip_prefix("pcie:").unwrap_or(text)).map_err(|why| anyhow::anyhow!("{text:?}: {why}"))
}

#[derive(Serialize)]
struct Output<'a> {
    cluster: &'a Cluster,
    global_batch: usize,
    seq_len: i64,
    #[serde(flatten)]
    report: &'a PlanReport,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let (model, seq_len) = a.model.resolve()?;
    let device = estimate::device_kind(&a.device)?;
    if device.name == "cpu" {
        bail!("strata plan is for GPU clusters; --device cpu has no data-sheet throughput (strata bench estimate measures this machine)");
    }
    if a.nodes == 0 || a.gpus_per_node == 0 {
        bail!("--nodes and --gpus-per-node must be positive");
    }
    if !(a.efficiency > 0.0 && a.efficiency <= 1.0) {
        bail!("--efficiency must lie in (0, 1], got {}", a.efficiency);
    }
    let intra = a.intra.clone().unwrap_or_else(|| {
        if device.name.starts_with("a100") { "nvlink:300GB/s" } else { "nvlink:450GB/s" }.to_string()
    });
    let host_per_node = a.host_memory.unwrap_or(device.host_bytes_per_device * a.gpus_per_node as u64);
    let cluster = Cluster {
        nodes: a.nodes,
        gpus_per_node: a.gpus_per_node,
        intra: Link::parse(&intra, 1).context("--intra")?,
        inter: Link::parse(&a.inter, a.gpus_per_node).context("--inter")?,
        host_link: host_link(&a.host_link).context("--host-link")?,
        // An update streams its states through the host's memory once per step; a node's
        // memory bandwidth (about 200 GB/s for two server sockets) is shared by its devices.
        host_bandwidth: 200e9 / a.gpus_per_node as f64,
        efficiency: a.efficiency,
        device,
    };
    let req = PlanRequest {
        model: model.clone(),
        cluster: cluster.clone(),
        global_batch: a.global_batch,
        seq_len,
        precisions: a.precision.iter().map(|p| p.precision()).collect(),
        optimizer_state_bytes: optimizer_state_bytes(&a.optimizer)?,
        host_bytes: host_per_node / a.gpus_per_node as u64,
    };
    let report = plan::plan(&req)?;
    let Some(best) = report.rows.first() else {
        let closest = report.least_over.as_ref().map_or(String::new(), |e| {
            format!(
                "; the closest, {}, needs {} per device and {} of host per device",
                e.layout,
                human_bytes(e.device.total()),
                human_bytes(e.host.total())
            )
        });
        bail!(
            "no layout of {} considered fits {} devices of {} with {} of host memory each{closest}",
            report.considered,
            cluster.devices(),
            human_bytes(cluster.device.memory_bytes),
            human_bytes(req.host_bytes),
        );
    };
    let spec = model.spec()?;
    let strategy = best.layout.strategy(&spec.block_kinds())?;
    if let Some(path) = &a.out {
        let text = serde_json::to_string_pretty(&strategy.to_value())? + "\n";
        strata::files::write_atomic(path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if a.json {
        let shown = PlanReport { rows: report.rows.iter().take(a.top).cloned().collect(), ..report.clone() };
        let out = Output { cluster: &cluster, global_batch: a.global_batch, seq_len, report: &shown };
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let params = spec.num_params() as f64;
    let size = if params >= 1e9 { format!("{:.1}B", params / 1e9) } else { format!("{:.1}M", params / 1e6) };
    println!(
        "{size} parameters on {} × {} {} ({} devices); {} sequences of {} tokens per step",
        a.nodes,
        a.gpus_per_node,
        cluster.device.name,
        cluster.devices(),
        a.global_batch,
        seq_len
    );
    let w = report.rows.iter().take(a.top).map(|r| r.label.chars().count()).max().unwrap_or(6);
    println!(
        "{:>3} {:<w$} {:>11} {:>6} {:>10} {:>7} {:>10} {:>9}  behind the best",
        "#", "layout", "tokens/s", "MFU", "memory", "bubble", "exposed", "step"
    );
    for (i, r) in report.rows.iter().take(a.top).enumerate() {
        let t = &r.time;
        println!(
            "{:>3} {:<w$} {:>11.0} {:>5.1}% {:>10} {:>6.1}% {:>7.1} ms {:>6.1} ms  {}",
            i + 1,
            r.label,
            t.tokens_per_s,
            100.0 * t.mfu,
            human_bytes(r.memory.device.total()),
            100.0 * t.bubble / t.total,
            1e3 * (t.data_comm + t.tensor_comm + t.pipeline_comm + t.context_comm + t.expert_comm),
            1e3 * t.total,
            r.behind.as_deref().unwrap_or("—")
        );
    }
    println!("{} layouts considered, {} over memory, {} fit", report.considered, report.over_memory, report.rows.len());
    let accumulation = best.micro_batches;
    match &a.out {
        Some(path) => println!(
            "best written to {}; run it with: strata train --strategy {} --batch-size {} --accumulation {accumulation} --ctx {seq_len} (on {} ranks)",
            path.display(),
            path.display(),
            a.global_batch,
            cluster.devices()
        ),
        None => println!("best strategy: {}", strategy.to_value()),
    }
    Ok(())
}
