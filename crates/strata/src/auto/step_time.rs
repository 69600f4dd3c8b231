//! Time before anything runs: the seconds of one training step of a layout of a model on a
//! described cluster, split into compute, memory-bound work, the pipeline's bubble, the
//! communication each method leaves exposed, offload traffic and the optimizer's update.
//!
//! Owns the time formulas and the cluster's description. Must not run anything: device
//! throughputs come from [`super::estimate::DeviceKind`] (data sheets, or this machine's
//! own, measured by [`super::calibrate`]), link bandwidths from the cluster's description.
//!
//! - Compute: each unit's matrix products (2 FLOPs per weight per token, and the
//!   attention's scores and sums, 4 · positions · width) three times (forward, input and
//!   weight gradients), four for a recomputed block and a head scoring its loss in chunks,
//!   at the device's peak for the precision times an efficiency.
//! - Memory-bound work: the activations each unit keeps (the memory estimate's bytes) are
//!   written, read, and their gradients written and read: four passes at the memory's
//!   bandwidth, five for a recomputed block.
//! - Collectives: α–β over rings (an all-reduce moves 2(n − 1)/n of its bytes, a gather or
//!   scatter (n − 1)/n), on the link the group spans: within a node, or across nodes at
//!   each device's share of its node's network.
//! - Overlap: data parallelism's reduction hides behind the backward, fsdp's gathers and
//!   reductions behind the forward and backward; tensor parallelism's collectives and the
//!   pipeline's sends and the expert groups' all-to-alls are exposed; so is offload's
//!   traffic, and the host's update.
//! - The pipeline: its schedule run by the schedule simulator with the slowest stage's
//!   costs.
use super::candidate::{Candidate, Layout, Precision, Sharding};
use super::estimate::{self, DeviceKind, Kept, PipelineShapes, Workload};
use crate::model::ModelSpec;
use crate::parallel::pipeline::schedule::{self, Costs, Pipeline};
use crate::strategy::{ContextKind, ScheduleKind};
use crate::{Error, Result};
use serde::Serialize;
use std::collections::HashMap;

/// A kind of link between devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkKind {
    /// NVIDIA's NVLink between the GPUs of a node.
    Nvlink,
    /// InfiniBand between nodes.
    Infiniband,
    /// Ethernet (RoCE included).
    Ethernet,
    /// Shared memory between processes of one machine.
    Shm,
}

/// A link class: its bandwidth per device (bytes/s each way) and its latency per message.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Link {
    /// What kind of link it is (sets the latency).
    pub kind: LinkKind,
    /// Bytes/s each way per device, after sharing.
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
}

impl Link {
    /// Parses `KIND:BANDWIDTH` with the bandwidth in `GB/s` or `Gb/s`, optionally as
    /// `COUNTxBANDWIDTH` (a node's NICs): `nvlink:450GB/s`, `ib:4x400Gb/s`, `eth:100Gb/s`.
    /// `share` divides it among the devices using it at once (a node's network among its
    /// devices; 1 for a link each device has to itself).
    pub fn parse(text: &str, share: usize) -> Result<Link> {
        let bad = |why: &str| Error::Config(format!("link {text:?}: {why} (e.g. nvlink:450GB/s or ib:4x400Gb/s)"));
        let (kind, rate) = text.split_once(':').ok_or_else(|| bad("no KIND:"))?;
        let (kind, latency) = match kind.to_ascii_lowercase().as_str() {
            "nvlink" => (LinkKind::Nvlink, 3e-6),
            "ib" | "infiniband" => (LinkKind::Infiniband, 6e-6),
            "eth" | "ethernet" | "roce" => (LinkKind::Ethernet, 15e-6),
            "shm" => (LinkKind::Shm, 2e-6),
            _ => return Err(bad("unknown kind; expected nvlink, ib, eth or shm")),
        };
        let bandwidth = parse_rate(rate).map_err(|why| bad(&why))?;
        Ok(Link { kind, bandwidth: bandwidth / share.max(1) as f64, latency })
    }
}

/// Bytes/s of `COUNTxBANDWIDTH` or `BANDWIDTH` in `GB/s`, `Gb/s` or `TB/s` (`4x400Gb/s`).
pub fn parse_rate(text: &str) -> std::result::Result<f64, String> {
    let (count, rate) = match text.split_once(['x', '×']) {
        Some((n, r)) => (n.trim().parse::<f64>().map_err(|_| "bad count".to_string())?, r),
        None => (1.0, text),
    };
    let rate = rate.trim();
    let (number, scale) = if let Some(n) = rate.strip_suffix("GB/s") {
        (n, 1e9)
    } else if let Some(n) = rate.strip_suffix("Gb/s") {
        (n, 1e9 / 8.0)
    } else if let Some(n) = rate.strip_suffix("TB/s") {
        (n, 1e12)
    } else {
        return Err("the bandwidth needs a unit: GB/s, Gb/s or TB/s".into());
    };
    let value: f64 = number.trim().parse().map_err(|_| "bad bandwidth".to_string())?;
    if !(value > 0.0 && count > 0.0) {
        return Err("the bandwidth must be positive".into());
    }
    Ok(count * value * scale)
}

/// A cluster: nodes of devices, the link within a node and the one between nodes, and
/// each device's link to its host (offload's copies).
#[derive(Clone, Debug, Serialize)]
pub struct Cluster {
    /// Nodes in the cluster.
    pub nodes: usize,
    /// Devices per node.
    pub gpus_per_node: usize,
    /// The kind of every device.
    pub device: DeviceKind,
    /// The link between devices of one node.
    pub intra: Link,
    /// The link between nodes, as each device's share of its node's network.
    pub inter: Link,
    /// Bytes/s each way between a device and its host.
    pub host_link: f64,
    /// Bytes/s of the host's memory available to one device's update.
    pub host_bandwidth: f64,
    /// The share of the device's peak its largest matrix products reach; smaller ones
    /// reach less ([`product_efficiency`]).
    pub efficiency: f64,
}

impl Cluster {
    /// Devices in all: nodes × devices per node.
    pub fn devices(&self) -> usize {
        self.nodes * self.gpus_per_node
    }

    /// The link a group of `n` ranks spaced `stride` apart crosses at its slowest.
    fn link(&self, n: usize, stride: usize) -> Link {
        if n * stride > self.gpus_per_node {
            self.inter
        } else {
            self.intra
        }
    }

    fn all_reduce(&self, bytes: f64, n: usize, stride: usize) -> f64 {
        self.ring(2.0, bytes, n, stride)
    }

    /// An all-gather or a reduce-scatter of `bytes` whole.
    fn gather(&self, bytes: f64, n: usize, stride: usize) -> f64 {
        self.ring(1.0, bytes, n, stride)
    }

    fn ring(&self, passes: f64, bytes: f64, n: usize, stride: usize) -> f64 {
        if n < 2 {
            return 0.0;
        }
        let l = self.link(n, stride);
        let steps = (n - 1) as f64;
        passes * (steps / n as f64 * bytes / l.bandwidth + steps * l.latency)
    }
}

/// One step's seconds by where they go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepTime {
    /// Matrix products (the busiest rank's, over all its micro-batches).
    pub compute: f64,
    /// Memory-bound work: writing and reading what the units keep.
    pub memory: f64,
    /// Issuing operators where the device does not hide it (the CPU).
    pub dispatch: f64,
    /// Idle time of the pipeline's schedule.
    pub bubble: f64,
    /// Data parallelism's and sharding's collectives not hidden behind compute.
    pub data_comm: f64,
    /// Tensor parallelism's collectives.
    pub tensor_comm: f64,
    /// The pipeline's sends and receives.
    pub pipeline_comm: f64,
    /// Context parallelism's exchanges in attention (the ring's passes of keys and values,
    /// the all-to-all's of heads), not hidden.
    pub context_comm: f64,
    /// Expert parallelism's all-to-alls: each sparse layer's token slots to their experts'
    /// ranks and back, forward and backward, not hidden.
    pub expert_comm: f64,
    /// Copies between device and host, and the host's update.
    pub offload: f64,
    /// The optimizer's update on the device.
    pub optimizer: f64,
    /// Seconds of the whole step: every part above together.
    pub total: f64,
    /// Tokens per second of the whole job.
    pub tokens_per_s: f64,
    /// Model FLOPs per second over the devices' peak in the precision's format.
    pub mfu: f64,
}

/// Model FLOPs of one trained token (forward and backward) at `seq_len` positions: 6 per
/// parameter it is multiplied by (not the experts a router passed over), plus three times the forward's attention FLOPs, 4 · positions · width per
/// attention each unit declares (as if not causal).
pub fn model_flops_per_token(spec: &ModelSpec, seq_len: i64) -> Result<f64> {
    let (mut attention_width, mut idle) = (0.0, 0.0);
    for u in &spec.units {
        let cost = u.declared_cost()?;
        attention_width += cost.attention_width;
        idle += cost.idle_weights;
    }
    Ok(6.0 * (spec.num_params() as f64 - idle) + 12.0 * seq_len as f64 * attention_width)
}

/// A model's units as the step-time model reads them: what each keeps for its backward,
/// its forward FLOPs per token (on one rank, unsplit), and the model's FLOPs per trained
/// token (for MFU).
#[derive(Clone, Debug)]
pub struct UnitWork {
    /// What each unit keeps for its backward, per token.
    pub kept: Vec<Kept>,
    /// Each unit's forward FLOPs per token, on one rank, unsplit.
    pub flops: Vec<f64>,
    /// Model FLOPs per trained token, forward and backward (for MFU).
    pub model_flops_per_token: f64,
}

impl UnitWork {
    /// Counted from what `spec`'s units declare at `seq_len` positions: 2 FLOPs per weight
    /// a unit multiplies by (its own and those it borrows, as a tied head does), and the
    /// attention's 4 · positions · width.
    pub fn counted(spec: &ModelSpec, seq_len: i64) -> Result<UnitWork> {
        let mut kept = Vec::with_capacity(spec.units.len());
        let mut flops = Vec::with_capacity(spec.units.len());
        for u in &spec.units {
            let cost = u.declared_cost()?;
            kept.push(cost.kept);
            flops.push(
                2.0 * (weights_multiplied(spec, u) - cost.idle_weights) + 4.0 * seq_len as f64 * cost.attention_width,
            );
        }
        Ok(UnitWork { kept, flops, model_flops_per_token: model_flops_per_token(spec, seq_len)? })
    }

    /// For a model known only by its spec and what each unit was measured to keep: the
    /// products' FLOPs from the weights alone (the attention's are not known), 6 per
    /// parameter per trained token.
    pub fn measured(spec: &ModelSpec, kept: Vec<Kept>) -> UnitWork {
        let flops = spec.units.iter().map(|u| 2.0 * weights_multiplied(spec, u)).collect();
        UnitWork { kept, flops, model_flops_per_token: 6.0 * spec.num_params() as f64 }
    }
}

/// The matrix elements a unit multiplies its inputs by: its own and borrowed 2-D weights,
/// none for a unit that declares it looks them up (an embedding).
fn weights_multiplied(spec: &ModelSpec, u: &crate::model::UnitSpec) -> f64 {
    if u.looks_up() {
        return 0.0;
    }
    u.params
        .iter()
        .chain(&u.borrowed)
        .map(|id| &spec.params[id.0])
        .filter(|p| p.shape.len() == 2)
        .map(|p| p.numel())
        .sum::<i64>() as f64
}

/// What a search computes once and asks for many times: stage splits, and makespans of
/// pipeline schedules per forward cost, by schedule, shape and the backward's cost over the
/// forward's (a schedule's makespan scales with its costs).
#[derive(Default)]
pub struct Memo {
    /// Stage splits and held micro-batches already worked out.
    pub shapes: PipelineShapes,
    makespans: HashMap<(ScheduleKind, usize, usize, usize, u64), f64>,
}

impl Memo {
    /// The makespan of `pipeline` under `kind` with a forward of `forward` seconds and a
    /// backward of `backward` (half input gradient, half weight gradient) per stage.
    pub fn makespan(&mut self, kind: ScheduleKind, pipeline: Pipeline, forward: f64, backward: f64) -> Result<f64> {
        let ratio = backward / forward.max(f64::MIN_POSITIVE);
        let key =
            (kind, pipeline.stages, pipeline.micro_batches, pipeline.virtual_stages, (ratio * 1e3).round() as u64);
        if let Some(per_forward) = self.makespans.get(&key) {
            return Ok(per_forward * forward);
        }
        let ops = schedule::every_rank(kind, pipeline)?;
        let costs = Costs { forward: 1.0, input_grad: ratio / 2.0, weight_grad: ratio / 2.0 };
        let per_forward = schedule::simulate(pipeline, &ops, costs)?.ends.iter().copied().fold(0.0, f64::max);
        self.makespans.insert(key, per_forward);
        Ok(per_forward * forward)
    }
}

/// The share of `device`'s peak a product reaches, under a ceiling of `ceiling`, over
/// `tokens` rows with a `width` × `width / tensor` weight on each tensor rank: small
/// products leave the device's units idle (tiles not filled, waves not full).
pub fn product_efficiency(device: &DeviceKind, ceiling: f64, tokens: f64, width: f64, tensor: usize) -> f64 {
    let weights = width * width / tensor.max(1) as f64;
    ceiling * tokens / (tokens + device.half_efficiency_tokens) * weights / (weights + device.half_efficiency_weights)
}

/// The device's peak FLOP/s for the products of `precision`.
fn peak(device: &DeviceKind, precision: Precision) -> f64 {
    match precision {
        Precision::Fp32 => device.fp32_flops,
        Precision::Fp8 if device.fp8_flops > 0.0 => device.fp8_flops,
        _ => device.bf16_flops,
    }
}

/// The share of a unit's forward products its backward computes again: a recomputed
/// block's whole forward, and a head scoring in chunks its logits (each chunk's again from
/// the head's input and weight).
fn computed_again(c: &Candidate, k: &Kept) -> f64 {
    let chunked_head = c.chunked_loss.is_some() && !k.block && k.vocab_values > 0.0;
    if (c.checkpoint && k.block) || chunked_head {
        1.0
    } else {
        0.0
    }
}

/// The predicted step of `layout` of `spec` (its units doing `units`' work) running `work`
/// on `cluster`.
pub fn step_time(
    units: &UnitWork,
    spec: &ModelSpec,
    layout: &Layout,
    work: &Workload,
    cluster: &Cluster,
    memo: &mut Memo,
) -> Result<StepTime> {
    let c = &layout.candidate;
    let (t, p, cp) = (c.tensor.max(1), layout.pipeline.max(1), layout.context.max(1));
    // Ranks that average gradients: data × context; those a ZeRO stage shards over: the
    // same outside the expert groups.
    let dp = layout.replicas(work.ranks).max(1);
    let e = if spec.expert_sets.is_empty() { 1 } else { layout.experts.max(1) };
    let shards = dp / e;
    let device = &cluster.device;
    let kept = &units.kept;
    // A rank computes its piece of each row's positions (each attending the whole row:
    // the units' FLOPs per token are counted at the whole length).
    let tokens = estimate::rank_tokens(layout, work);
    let width = kept.first().map_or(1.0, |k| k.output);
    let flops_peak = peak(device, c.precision) * product_efficiency(device, cluster.efficiency, tokens, width, t);
    if flops_peak <= 0.0 || device.memory_bandwidth <= 0.0 {
        return Err(Error::Config(format!("device {} has no throughput to predict from (calibrate it)", device.name)));
    }
    let flops: Vec<f64> = units.flops.iter().map(|f| f / t as f64).collect();
    let act_bytes = estimate::unit_activation_bytes(kept, layout, work, device);
    let value_bytes = if matches!(c.precision, Precision::Fp32) { 4.0 } else { 2.0 };
    // Per unit, one micro-batch: forward, and backward (with recomputation where asked).
    let (mut forward, mut backward) = (vec![], vec![]);
    for (u, k) in kept.iter().enumerate() {
        let again = computed_again(c, k);
        let f = flops[u] * tokens / flops_peak + act_bytes[u] / device.memory_bandwidth;
        let b = (2.0 + again) * flops[u] * tokens / flops_peak + (3.0 + again) * act_bytes[u] / device.memory_bandwidth;
        forward.push(f);
        backward.push(b);
    }
    let m = work.micro_batches.max(1);
    // The stages as the engine splits them (by parameters, the balance plans ask for).
    let lens: Vec<u64> = memo.shapes.unit_lengths(spec, layout, work.ranks).into_iter().map(|(len, _)| len).collect();
    let stages = memo.shapes.stages(&lens, p, layout.virtual_stages)?;
    let stage_sum = |v: &[f64], (a, b): (usize, usize)| v[a..b].iter().sum::<f64>();
    // The slowest stage sets the pipeline's pace (per micro-batch, per chunk).
    let slowest = stages.iter().copied().max_by(|x, y| {
        (stage_sum(&forward, *x) + stage_sum(&backward, *x))
            .total_cmp(&(stage_sum(&forward, *y) + stage_sum(&backward, *y)))
    });
    let (a, b) = slowest.unwrap_or((0, spec.units.len()));
    let (f, bw) = (stage_sum(&forward, (a, b)), stage_sum(&backward, (a, b)));
    // The products alone of one micro-batch through a range of units.
    let compute_share = |(a, b): (usize, usize)| {
        (a..b).map(|u| flops[u] * (3.0 + computed_again(c, &kept[u]))).sum::<f64>() * tokens / flops_peak
    };
    let mut time = StepTime::default();
    // Operators per micro-batch and unit: about eight per parameter tensor forward and
    // backward (product, bias, norm, activation and their gradients), a third more when
    // recomputed, and a few for the unit itself.
    let ops: f64 = (a..b)
        .map(|u| {
            let tensors = spec.units[u].params.len() as f64;
            let again = 1.0 + 0.33 * computed_again(c, &kept[u]);
            (8.0 * tensors * again + 10.0) * layout.virtual_stages.max(1) as f64
        })
        .sum();
    let per_rank_chunks = layout.virtual_stages.max(1) as f64;
    let busy = (f + bw) * m as f64 * per_rank_chunks;
    if p == 1 {
        time.compute = compute_share((a, b)) * m as f64;
        time.memory = busy - time.compute;
    } else {
        let pipeline = Pipeline { stages: p, micro_batches: m, virtual_stages: layout.virtual_stages };
        let makespan = memo.makespan(layout.schedule, pipeline, f, bw)?;
        time.compute = compute_share((a, b)) * m as f64 * per_rank_chunks;
        time.memory = busy - time.compute;
        time.bubble = (makespan - busy).max(0.0);
        // Each micro-batch crosses every stage boundary forward and back.
        let boundary = tokens * kept[0].output * value_bytes / t as f64;
        let link = cluster.link(2, t);
        time.pipeline_comm = 2.0 * m as f64 * per_rank_chunks * (boundary / link.bandwidth + link.latency);
    }
    if t > 1 {
        // Sequence parallel: per block two gathers and two scatters of the micro-batch's
        // activations forward, as many backward, and the forward's again when recomputed.
        let blocks = kept[a..b].iter().filter(|k| k.block).count() as f64;
        let whole = tokens * kept[0].output * value_bytes;
        let passes = 4.0 * (2.0 + if c.checkpoint { 1.0 } else { 0.0 });
        time.tensor_comm = blocks * passes * cluster.gather(whole, t, 1) * m as f64 * per_rank_chunks;
    }
    if cp > 1 {
        // Per attention block and micro-batch: the ring's passes of keys and values travel
        // while the block before is computed (taken as hidden); the gradients of keys and
        // values (fp32, taken as a width each: grouped-query ones are narrower) follow each
        // block of the backward, cp times, exposed.
        // The all-to-all sends (cp − 1)/cp of queries, keys, values and the output each way,
        // forward and backward, exposed. Context groups sit next to the tensor groups
        // (stride t).
        let blocks = kept[a..b].iter().filter(|k| k.block).count() as f64;
        let width_bytes = tokens * kept[0].output / t as f64;
        let link = cluster.link(cp, t);
        let again = if c.checkpoint { 1.0 } else { 0.0 };
        let per_block = match layout.context_kind {
            ContextKind::Ring => cp as f64 * (2.0 * 4.0 * width_bytes / link.bandwidth + link.latency),
            ContextKind::AllToAll => {
                let exchange = width_bytes * value_bytes * (cp as f64 - 1.0) / cp as f64;
                (4.0 * (1.0 + again) + 4.0) * (exchange / link.bandwidth + link.latency)
            }
        };
        time.context_comm = blocks * per_block * m as f64 * per_rank_chunks;
    }
    // Data parallelism over the stage's parameters: gradients reduced, sharded parameters
    // gathered; the reduction hides behind the backward, fsdp's gathers behind all compute.
    // A rank stores 1/e of the routed experts, averaged over the dp/e ranks storing the same
    // ones; the rest over all dp. ZeRO shards both over the dp/e ranks outside the expert
    // groups, and the rest's shards are averaged over the e ranks of an expert group.
    let stage_elements = |routed: bool| -> f64 {
        stages
            .iter()
            .map(|&(s, end)| {
                spec.units[s..end]
                    .iter()
                    .flat_map(|u| &u.params)
                    .map(|id| &spec.params[id.0])
                    .filter(|q| q.expert.is_some() == routed)
                    .map(|q| q.numel())
                    .sum::<i64>()
            })
            .fold(0i64, i64::max) as f64
            / t as f64
    };
    let (rest, routed) = (stage_elements(false), stage_elements(true) / e as f64);
    let stage_params = rest + routed;
    let grad_width = if matches!(c.precision, Precision::HalfBf16 | Precision::HalfFp16) { 2.0 } else { 4.0 };
    let grad_bytes = stage_params * grad_width;
    let param_bytes = stage_params * value_bytes;
    // Expert groups sit next to the tensor and context groups; the data replicas beyond
    // them and the pipeline.
    let stride = t * cp * p;
    let apart = stride * e;
    let (comm, hidden_behind) = match c.sharding {
        Sharding::None => (
            cluster.all_reduce(rest * grad_width, dp, stride) + cluster.all_reduce(routed * grad_width, dp / e, apart),
            bw * m as f64,
        ),
        Sharding::Zero1 | Sharding::Zero2 => (
            cluster.gather(grad_bytes, shards, apart)
                + cluster.gather(param_bytes, shards, apart)
                + cluster.all_reduce(rest * grad_width / shards as f64, e, t * cp),
            bw * m as f64,
        ),
        // Gathered for the forward and again for the backward, gradients scattered, per
        // micro-batch.
        Sharding::Fsdp => (
            m as f64 * (2.0 * cluster.gather(param_bytes, shards, apart) + cluster.gather(grad_bytes, shards, apart))
                + cluster.all_reduce(rest * grad_width / shards as f64, e, t * cp),
            busy,
        ),
    };
    time.data_comm = (comm - 0.9 * hidden_behind).max(0.0) + comm / spec.units.len().max(1) as f64;
    if e > 1 {
        // Each sparse layer of the stage sends the slots routed to other ranks' experts and
        // takes their outputs back, forward and backward (the forward's again when
        // recomputed): all-to-alls within the expert group, exposed.
        let layers = kept[a..b].iter().filter(|k| k.block).count() as f64
            / kept.iter().filter(|k| k.block).count().max(1) as f64;
        let remote = estimate::expert_slot_bytes(spec, tokens, c.precision) * layers * (e - 1) as f64 / e as f64;
        let link = cluster.link(e, t * cp);
        let passes = 4.0 + if c.checkpoint { 2.0 } else { 0.0 };
        let per_layer = spec.expert_sets.len() as f64 * layers;
        time.expert_comm = m as f64 * per_rank_chunks * passes * (remote / link.bandwidth + per_layer * link.latency);
    }
    // The update: read and write parameters, gradients and two moments (fp32).
    let shard = if c.sharding == Sharding::None { 1.0 } else { shards as f64 };
    let update_bytes = stage_params / shard * 28.0;
    if c.offload {
        let moved = grad_bytes / shard + param_bytes / shard;
        let fetched =
            if matches!(c.sharding, Sharding::None | Sharding::Fsdp) { 2.0 * param_bytes * m as f64 } else { 0.0 };
        time.offload = (moved + fetched) / cluster.host_link + update_bytes / cluster.host_bandwidth;
    } else {
        time.optimizer = update_bytes / device.memory_bandwidth;
    }
    if c.activation_offload {
        // Each offloaded unit's values (a recomputed block's input) go to the host and back
        // once a micro-batch, on a copy stream behind the compute; all units of a stage but
        // its last.
        let per_stage = spec.units.len().div_ceil(p);
        let shelved: f64 = kept
            .iter()
            .zip(&act_bytes)
            .take(spec.units.len().saturating_sub(1))
            .map(|(k, &bytes)| if c.checkpoint && k.block { k.output * tokens * value_bytes / t as f64 } else { bytes })
            .sum::<f64>()
            * per_stage as f64
            / spec.units.len().max(1) as f64;
        let copies = 2.0 * shelved * m as f64 / cluster.host_link;
        time.offload += (copies - 0.9 * time.compute).max(0.0);
    }
    time.dispatch = ops * m as f64 * device.op_seconds;
    time.total = time.compute
        + time.memory
        + time.dispatch
        + time.bubble
        + time.data_comm
        + time.tensor_comm
        + time.pipeline_comm
        + time.context_comm
        + time.expert_comm
        + time.offload
        + time.optimizer;
    let global_tokens = tokens * (m * dp) as f64;
    time.tokens_per_s = global_tokens / time.total;
    let model_flops = units.model_flops_per_token * time.tokens_per_s;
    time.mfu = model_flops / (peak(device, c.precision) * work.ranks as f64);
    Ok(time)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auto::candidate::Candidate;
    use crate::model::{GptConfig, ModelConfig};

    fn cluster(gpus: usize) -> Cluster {
        Cluster {
            nodes: gpus.div_ceil(8),
            gpus_per_node: gpus.min(8),
            device: estimate::device_kind("h100-80gb").unwrap(),
            intra: Link::parse("nvlink:450GB/s", 1).unwrap(),
            inter: Link::parse("ib:8x400Gb/s", 8).unwrap(),
            host_link: 25e9,
            host_bandwidth: 25e9,
            efficiency: 0.87,
        }
    }

    fn layout(sharding: Sharding, tensor: usize, pipeline: usize) -> Layout {
        let candidate = Candidate { tensor, ..Candidate::plain(Precision::AmpBf16, sharding, false) };
        Layout { pipeline, ..Layout::new(candidate) }
    }

    #[test]
    fn links_parse_with_their_units_and_shares() {
        let ib = Link::parse("ib:4x400Gb/s", 8).unwrap();
        assert_eq!((ib.kind, ib.bandwidth), (LinkKind::Infiniband, 4.0 * 50e9 / 8.0));
        assert_eq!(Link::parse("nvlink:450GB/s", 1).unwrap().bandwidth, 450e9);
        for bad in ["ib:400", "pigeon:1GB/s", "ib:-1GB/s", "450GB/s"] {
            assert!(Link::parse(bad, 1).is_err(), "{bad}");
        }
    }

    #[test]
    fn rings_cost_what_their_formula_says_on_the_link_they_span() {
        let c = cluster(16);
        let bytes = 1e9;
        let within = c.all_reduce(bytes, 8, 1);
        assert!((within - (2.0 * 7.0 / 8.0 * bytes / 450e9 + 2.0 * 7.0 * 3e-6)).abs() < 1e-12);
        // Spaced eight apart, two ranks sit on two nodes: each device's share of the network.
        let across = c.all_reduce(bytes, 2, 8);
        assert!((across - (2.0 * 0.5 * bytes / 50e9 + 2.0 * 6e-6)).abs() < 1e-12);
        assert_eq!(c.all_reduce(bytes, 1, 1), 0.0);
    }

    /// With every stage alike, the simulated 1F1B bubble is the analytic (p − 1)/(m + p − 1).
    #[test]
    fn a_pipeline_s_bubble_is_its_schedule_s() {
        let model = ModelConfig::Gpt(GptConfig::new(50257, 1024, 8, 12, 768));
        let spec = model.spec().unwrap();
        for m in [4usize, 16] {
            let work = Workload { ranks: 4, micro_batch: 1, ctx: 1024, micro_batches: m, optimizer_state_bytes: 8 };
            let units = UnitWork::counted(&spec, 1024).unwrap();
            let t = step_time(&units, &spec, &layout(Sharding::None, 1, 4), &work, &cluster(4), &mut Memo::default())
                .unwrap();
            let busy = t.compute + t.memory;
            let share = t.bubble / (busy + t.bubble);
            let analytic = 3.0 / (m as f64 + 3.0);
            assert!((share - analytic).abs() < 1e-9, "m={m}: {share} against {analytic}");
        }
    }

    /// Tensor parallelism pays its collectives; sharding pays more traffic than plain data
    /// parallelism; a larger micro-batch reaches more of the peak.
    /// The FLOPs come from what the units declare: a looked-up embedding multiplies by
    /// nothing, a block by its weights plus its attention, the tied head by the table.
    #[test]
    fn unit_flops_follow_the_declared_costs() {
        let (vocab, layers, dim, seq) = (100, 2, 16, 8);
        let spec = ModelConfig::Gpt(GptConfig::new(vocab, seq, layers, 2, dim)).spec().unwrap();
        let work = UnitWork::counted(&spec, seq).unwrap();
        let f = |x: i64| x as f64;
        assert_eq!(work.flops[0], 0.0, "the embedding looks its tables up");
        let block_weights = f(3 * dim * dim + dim * dim + 4 * dim * dim + 4 * dim * dim);
        assert_eq!(work.flops[1], 2.0 * block_weights + 4.0 * f(seq * dim));
        assert_eq!(work.flops[3], 2.0 * f(vocab * dim), "the head multiplies by the embedding's table");
        let model = 6.0 * f(spec.num_params()) + 12.0 * f(layers * seq * dim);
        assert_eq!(work.model_flops_per_token, model);
    }

    #[test]
    fn each_method_pays_what_it_moves() {
        let model = ModelConfig::Gpt(GptConfig::new(50257, 1024, 12, 12, 768));
        let spec = model.spec().unwrap();
        let units = UnitWork::counted(&spec, 1024).unwrap();
        let run = |l: Layout, micro_batch| {
            let work = Workload { ranks: 8, micro_batch, ctx: 1024, micro_batches: 1, optimizer_state_bytes: 8 };
            step_time(&units, &spec, &l, &work, &cluster(8), &mut Memo::default()).unwrap()
        };
        assert_eq!(run(layout(Sharding::None, 1, 1), 1).tensor_comm, 0.0);
        assert!(run(layout(Sharding::None, 2, 1), 1).tensor_comm > 0.0);
        let (small, large) = (run(layout(Sharding::None, 1, 1), 1), run(layout(Sharding::None, 1, 1), 8));
        assert!(large.compute / 8.0 < small.compute, "larger products run nearer the peak");
        assert!(product_efficiency(&cluster(1).device, 0.87, 8192.0, 4096.0, 1) > 0.6);
        assert!(product_efficiency(&cluster(1).device, 0.87, 128.0, 512.0, 8) < 0.05);
    }
}
