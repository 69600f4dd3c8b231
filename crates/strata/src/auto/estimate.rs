//! Memory before anything runs: for a model's configuration, a layout (precision,
//! sharding, recomputation, offload, tensor and pipeline sizes) and a workload, the peak
//! bytes each rank needs on its device and its host, split into parameters, gradients,
//! optimizer states, activations, communication buffers and the allocator's overhead.
//!
//! Owns the memory formulas. Must not allocate a tensor or run a unit: the model's spec is
//! a list of shapes (the builder allocates nothing), and what each unit keeps for its
//! backward is what its family declared ([`crate::model::UnitCost`]).
//!
//! Model states follow the engine's own layout exactly ([`UnitLayout::of`], the optimizer's
//! bytes per element, the gathers of fsdp and zero2). Activations are what each unit's
//! forward keeps for its backward per token, counted from the tensors its layers save in
//! this implementation (libtorch's CPU kernels): a coefficient per model width, feed-forward
//! width, vocabulary and attended position. `strata bench estimate` checks the whole
//! against the allocator's peak over runs of every family and layout it can run here.
use super::candidate::{Candidate, Layout, Precision, Sharding};
use crate::engine::{Holding, UnitLayout};
pub use crate::model::Kept;
use crate::model::{ModelConfig, ModelSpec, ParamSpec};
use crate::parallel::pipeline::partition::{self, Stages, UnitCost};
use crate::parallel::pipeline::schedule::{self, Pipeline};
use crate::strategy::{ContextKind, ScheduleKind};
use crate::{Error, Result};
use serde::Serialize;
use std::collections::HashMap;

/// One kind of accelerator (or the CPU acting as one): its memory, its peak dense
/// throughput, and what its kernels keep.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceKind {
    /// Name `strata estimate` and `strata plan` know the kind by (e.g. `h100-80gb`).
    pub name: &'static str,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// Peak dense bf16 tensor throughput, FLOP/s (without sparsity).
    pub bf16_flops: f64,
    /// Peak fp32 throughput (TF32 tensor cores where the card has them), FLOP/s.
    pub fp32_flops: f64,
    /// Peak dense fp8 throughput, FLOP/s (0 where the card has no fp8 tensor cores).
    pub fp8_flops: f64,
    /// Memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// Attention runs fused (flash attention through SDPA): no score matrices are kept.
    pub fused_attention: bool,
    /// Bytes the device holds outside the allocator's count: the CUDA context, cuBLAS and
    /// cuDNN workspaces and handles.
    pub reserved_bytes: u64,
    /// The caching allocator's blocks beyond what tensors use, as a share of the peak.
    pub fragmentation: f64,
    /// Host memory per device of the kind's usual server (where no host size is given).
    pub host_bytes_per_device: u64,
    /// Tokens, and weights per rank of a width × width product, at which a product reaches
    /// half of the efficiency's ceiling (0: every size reaches it, as where the peak was
    /// measured at the sizes that run).
    pub half_efficiency_tokens: f64,
    /// Weights per rank of a width × width product at which it reaches half of the
    /// efficiency's ceiling (0: every size reaches it).
    pub half_efficiency_weights: f64,
    /// Seconds the host spends issuing one operator that the device does not hide (0 on a
    /// GPU, whose queue runs ahead of the host; measured on the CPU).
    pub op_seconds: f64,
}

const GIB: u64 = 1 << 30;

/// The device kinds `strata estimate` and `strata plan` know by name. Peak figures are the
/// vendors' data-sheet numbers for dense math (NVIDIA H100 SXM5: 989 TFLOP/s bf16, 1,979
/// fp8, 494 TF32, 3.35 TB/s; H200 SXM: the same compute with 141 GB at 4.8 TB/s; A100 SXM:
/// 312 TFLOP/s bf16, 156 TF32, 2.04 TB/s at 80 GB and 1.56 TB/s at 40 GB). The reserve
/// outside the allocator is an allowance of 1 GiB for the CUDA context and library
/// workspaces; fragmentation is an allowance of 5% of the allocator's peak. Host memory is
/// that of the vendors' eight-GPU servers (DGX H100, H200 and A100 80GB: 2 TB; DGX A100
/// 40GB: 1 TB), an eighth per device. Small products reach less of the peak: half of the
/// efficiency's ceiling at 512 tokens, and at 1.6 million weights per rank of a width ×
/// width product. These two constants and the ceiling `strata plan` assumes (0.87) are
/// set from published runs (`crates/strata/tests/engine/published_layouts.json`: one law for
/// Megatron-LM's ten weak-scaling rows on A100s, 137 to 163 teraFLOP/s per GPU, and
/// torchtitan's Llama 3 8B and 70B). The CPU's figures are measured
/// ([`super::calibrate::this_machine`]).
pub fn device_kinds() -> Vec<DeviceKind> {
    let gpu = |name, memory_gb: u64, bf16: f64, tf32: f64, fp8: f64, bandwidth: f64, host_tb: u64| DeviceKind {
        name,
        memory_bytes: memory_gb * 1_000_000_000,
        bf16_flops: bf16 * 1e12,
        fp32_flops: tf32 * 1e12,
        fp8_flops: fp8 * 1e12,
        memory_bandwidth: bandwidth * 1e12,
        fused_attention: true,
        reserved_bytes: GIB,
        fragmentation: 0.05,
        host_bytes_per_device: host_tb * 1_000_000_000_000 / 8,
        half_efficiency_tokens: 512.0,
        half_efficiency_weights: 1.6e6,
        op_seconds: 0.0,
    };
    vec![
        gpu("h100-80gb", 80, 989.0, 494.0, 1979.0, 3.35, 2),
        gpu("h200", 141, 989.0, 494.0, 1979.0, 4.8, 2),
        gpu("a100-80gb", 80, 312.0, 156.0, 0.0, 2.04, 2),
        gpu("a100-40gb", 40, 312.0, 156.0, 0.0, 1.56, 1),
        DeviceKind {
            name: "cpu",
            memory_bytes: host_memory_bytes().unwrap_or(16 * GIB),
            bf16_flops: 0.0,
            fp32_flops: 0.0,
            fp8_flops: 0.0,
            memory_bandwidth: 0.0,
            fused_attention: false,
            reserved_bytes: 0,
            fragmentation: 0.0,
            host_bytes_per_device: host_memory_bytes().unwrap_or(16 * GIB),
            half_efficiency_tokens: 0.0,
            half_efficiency_weights: 0.0,
            op_seconds: 0.0,
        },
    ]
}

/// The device kind called `name` (`h100-80gb`, `h200`, `a100-80gb`, `a100-40gb`, `cpu`).
pub fn device_kind(name: &str) -> Result<DeviceKind> {
    let kinds = device_kinds();
    let names: Vec<&str> = kinds.iter().map(|k| k.name).collect();
    let known = names.join(", ");
    kinds
        .into_iter()
        .find(|k| k.name.eq_ignore_ascii_case(name) || (name.eq_ignore_ascii_case("h100") && k.name == "h100-80gb"))
        .ok_or_else(|| Error::Config(format!("unknown device {name:?}; known: {known}")))
}

/// This machine's memory (`MemTotal` of `/proc/meminfo`).
pub fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// What runs: ranks, the rows of one micro-batch of one data-parallel group, their length,
/// the micro-batches per step, and the optimizer's state per trained element.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Workload {
    /// Ranks the job runs on.
    pub ranks: usize,
    /// Rows of one micro-batch of one data-parallel group.
    pub micro_batch: usize,
    /// Positions of a row.
    pub ctx: i64,
    /// Micro-batches per step (gradient accumulation).
    pub micro_batches: usize,
    /// Bytes of optimizer state per trained element (AdamW: 8).
    pub optimizer_state_bytes: u64,
}

/// Bytes of one placement by what holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// Parameter bytes.
    pub params: u64,
    /// Gradient bytes.
    pub grads: u64,
    /// Optimizer states, with the fp32 masters of low-precision parameters.
    pub optimizer: u64,
    /// Activations kept for backward.
    pub activations: u64,
    /// Transfer buffers: sequence parallel's gathered input, the pipeline's boundary
    /// activations, offload's copies in flight; on the host, an asynchronous checkpoint's
    /// snapshot.
    pub comm: u64,
    /// Outside the tensors: the device's reserve and the allocator's fragmentation.
    pub overhead: u64,
}

impl Breakdown {
    /// Bytes of every part together.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.activations + self.comm + self.overhead
    }
}

/// One rank's device and host bytes at its peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RankBytes {
    /// Bytes on the device.
    pub device: Breakdown,
    /// Bytes on the host.
    pub host: Breakdown,
    /// Elements of parameters whose values and optimizer states this rank's checkpoint file
    /// holds: its shard of its units (all of them where states are not sharded).
    pub saved: u64,
    /// Elements of parameters in this rank's units before ZeRO shards them: its stage's
    /// units, its piece of each under tensor parallelism, its share of the experts.
    pub held: u64,
}

/// The estimate for one layout: the busiest rank's device and host bytes, and each
/// pipeline rank's (one entry without a pipeline).
#[derive(Clone, Debug, Serialize)]
pub struct Estimate {
    /// The layout's readable name ([`Layout::label`]).
    pub layout: String,
    /// The busiest rank's device bytes.
    pub device: Breakdown,
    /// The busiest rank's host bytes.
    pub host: Breakdown,
    /// The pipeline rank (or 0) that holds the most on its device.
    pub busiest: usize,
    /// Every pipeline rank fits the machine's device and host bytes.
    pub fits: bool,
    /// Each pipeline rank's bytes, in stage order.
    pub pipeline_ranks: Vec<RankBytes>,
    /// The pipeline rank holding each unit of the model, in the units' order.
    #[serde(skip)]
    pub unit_ranks: Vec<usize>,
}

/// The machine an estimate is for: its device kind and, per rank, the device and host bytes.
#[derive(Clone, Debug)]
pub struct Machine {
    /// The device kind (its reserve and fragmentation allowance).
    pub device: DeviceKind,
    /// Device bytes each rank may use.
    pub device_bytes: u64,
    /// Host bytes each rank may use.
    pub host_bytes: u64,
}

/// The share of the head's values over the vocabulary still held while the last block is
/// recomputed: the logits and their log-softmax, which the loss's graph keeps until the
/// step's backward ends (2.5 of the 4 values per entry at the peak, measured on the CPU).
const LOSS_GRAPH_SHARE: f64 = 0.625;

/// Bytes per kept value relative to fp32 under `precision`, for a block's values and a
/// head's values off and over the vocabulary. Under `half` most saved tensors are bf16,
/// the norms' statistics and the loss's are fp32; under autocast the products' inputs are
/// kept in both precisions where a norm or softmax (which autocast runs in fp32) saves
/// its own.
fn precision_share(precision: Precision) -> (f64, f64, f64) {
    match precision {
        Precision::Fp32 => (1.0, 1.0, 1.0),
        Precision::HalfBf16 | Precision::HalfFp16 => (0.66, 0.5, 0.83),
        Precision::AmpBf16 | Precision::AmpFp16 | Precision::Fp8 => (0.81, 0.9, 0.91),
    }
}

/// A mixture of experts over expert groups of `size` ranks: where its experts run and what
/// one rank exchanges for them in a step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertPlacement {
    /// Ranks in one expert group.
    pub size: usize,
    /// Routed experts each rank of a group computes (rank `r` those from `r · experts_per_rank`)
    /// in each sparse layer.
    pub experts_per_rank: i64,
    /// Bytes of routed experts' weights one rank stores: those of the experts it computes
    /// (before zero or fsdp shards them over the ranks storing the same ones).
    pub expert_bytes_per_rank: u64,
    /// Bytes one rank sends (and as many it receives) in a step's all-to-alls: each sparse
    /// layer sends its token slots' hidden states to the ranks of their experts and takes
    /// their outputs back, and backward does the same with their gradients; the slots of its
    /// own experts stay, routing assumed balanced. The counts sent first are not counted.
    pub all_to_all_bytes: u64,
}

/// [`ExpertPlacement`] of `spec`'s sparse layers over expert groups of `size` ranks, for
/// `work`'s micro-batches in `precision`; `None` for a model without experts.
pub fn expert_placement(
    spec: &ModelSpec,
    work: &Workload,
    precision: Precision,
    size: usize,
) -> Result<Option<ExpertPlacement>> {
    let Some(first) = spec.expert_sets.first() else { return Ok(None) };
    let experts = first.up.len() as i64;
    if size == 0 || !spec.expert_sets.iter().all(|s| s.up.len().is_multiple_of(size)) {
        return Err(Error::Config(format!("expert_parallel: {experts} experts do not split over {size} ranks")));
    }
    let tokens = (work.micro_batch as i64 * work.ctx) as f64 * work.micro_batches as f64;
    let remote = expert_slot_bytes(spec, tokens, precision) * (size - 1) as f64 / size as f64;
    let routed: i64 = spec.params.iter().filter(|p| p.expert.is_some()).map(ParamSpec::numel).sum();
    Ok(Some(ExpertPlacement {
        size,
        experts_per_rank: experts / size as i64,
        expert_bytes_per_rank: routed as u64 / size as u64 * param_bytes(precision),
        all_to_all_bytes: 4 * remote as u64,
    }))
}

/// Bytes of the hidden states of `tokens` tokens' routed slots over every sparse layer of
/// `spec` in `precision`: what one all-to-all pass of a step's layers carries where no slot
/// stays home (each layer's width × its experts per token).
pub(crate) fn expert_slot_bytes(spec: &ModelSpec, tokens: f64, precision: Precision) -> f64 {
    let element = compute_bytes(precision);
    spec.expert_sets
        .iter()
        .map(|set| {
            let width = set.up.first().map_or(0, |u| spec.params[u.0].shape[1]);
            tokens * (set.top_k * width) as f64 * element
        })
        .sum()
}

/// The bytes of an element of what the layers compute under `precision`: fp32, or the
/// half-precision dtype that `amp_native`, `half` and fp8 compute in.
fn compute_bytes(precision: Precision) -> f64 {
    match precision {
        Precision::Fp32 => 4.0,
        _ => 2.0,
    }
}

/// The bytes of a parameter element under `precision` (`half` keeps bf16 or fp16 weights).
fn param_bytes(precision: Precision) -> u64 {
    match precision {
        Precision::HalfBf16 | Precision::HalfFp16 => 2,
        _ => 4,
    }
}

/// Bytes one micro-batch of `work` leaves in a unit that keeps `k`, off and over the
/// vocabulary, on one tensor rank of `layout` (sequence parallel splits what the blocks
/// keep, heads and vocabulary what the rest keep).
fn split_activation_bytes(k: &Kept, layout: &Layout, work: &Workload, device: &DeviceKind) -> (f64, f64) {
    let t = layout.candidate.tensor.max(1) as f64;
    let tokens = rank_tokens(layout, work);
    // The composite keeps each query's probabilities over every position it attends (the
    // all-to-all's queries attend whole rows); the ring recomputes them block by block.
    let attended = match device.fused_attention || (layout.context > 1 && layout.context_kind == ContextKind::Ring) {
        true => 0.0,
        false => work.ctx as f64,
    };
    let (block_share, head_share, vocab_share) = precision_share(layout.candidate.precision);
    // Under sequence parallel a block's column-parallel products keep the gathered whole
    // sequence as their input: two widths that tensor ranks do not split.
    let whole = if k.block && t > 1.0 { 2.0 * k.output * t } else { 0.0 };
    let values = k.values - k.vocab_values + k.scores * attended + whole;
    let scale = 4.0 * tokens / t;
    match k.block {
        true => (values * block_share * scale, 0.0),
        false => (values * head_share * scale, k.vocab_values * vocab_share * scale),
    }
}

/// Positions of one micro-batch a rank computes: its rows' whole length, or its piece of
/// them under context parallelism.
pub(crate) fn rank_tokens(layout: &Layout, work: &Workload) -> f64 {
    (work.micro_batch as i64 * work.ctx) as f64 / layout.context.max(1) as f64
}

/// What the units keep under `layout` where its head scores in chunks (`chunked_loss`): a
/// vocabulary head that hands on logits (as declared, or as a plain profile measured it)
/// holds one chunk's values over the vocabulary rather than those of every token of the
/// micro-batch, and hands on a scalar; `kept` as it is otherwise (a profile of the chunked
/// head measured it so already).
fn scored_in_chunks(kept: &[Kept], layout: &Layout, work: &Workload) -> Vec<Kept> {
    let Some(positions) = layout.candidate.chunked_loss else { return kept.to_vec() };
    let tokens = rank_tokens(layout, work);
    let share = (positions as f64 / tokens.max(1.0)).min(1.0);
    kept.iter()
        .map(|k| match k.block || k.vocab_values == 0.0 || k.output < 1.0 {
            true => *k,
            false => {
                let vocab_values = k.vocab_values * share;
                Kept { values: k.values - k.vocab_values + vocab_values, vocab_values, output: 0.0, ..*k }
            }
        })
        .collect()
}

/// Bytes one micro-batch leaves in each unit (of `kept`) on one rank of `layout`.
pub fn unit_activation_bytes(kept: &[Kept], layout: &Layout, work: &Workload, device: &DeviceKind) -> Vec<f64> {
    scored_in_chunks(kept, layout, work)
        .iter()
        .map(|k| {
            let (off, over) = split_activation_bytes(k, layout, work, device);
            off + over
        })
        .collect()
}

/// What a rank of `layout` on `ranks` ranks stores of each parameter, and the shard count
/// its units' buffers are padded to: split over its tensor ranks, an expert group's first
/// rank storing only its own experts (every rank of the group stores as many), padded to
/// the shard count where it is sharded.
fn storage(spec: &ModelSpec, layout: &Layout, ranks: usize) -> (Holding, i64) {
    let shards = layout.shard_ranks(ranks);
    let pad = if layout.candidate.sharding != Sharding::None && shards > 1 { shards as i64 } else { 1 };
    let holding = Holding {
        tensor: layout.candidate.tensor.max(1) as i64,
        experts: (layout.experts > 1 && !spec.expert_sets.is_empty()).then_some((layout.experts as i64, 0)),
    };
    (holding, pad)
}

/// One unit's parameters as the engine lays them out.
struct UnitStates {
    /// Elements of the unit's buffer (padded for sharding).
    len: u64,
    /// Elements that train.
    grad_len: u64,
    /// Another unit reads its parameters (a tied weight): its whole gradient lives from
    /// the first backward that adds to it to the last.
    lent: bool,
}

/// The estimate for `layout` of `config` running `work` on `machine`.
pub fn estimate(config: &ModelConfig, layout: &Layout, work: &Workload, machine: &Machine) -> Result<Estimate> {
    estimate_spec(&config.spec()?, layout, work, machine)
}

/// [`estimate`] for a spec already built (with what it froze).
pub fn estimate_spec(spec: &ModelSpec, layout: &Layout, work: &Workload, machine: &Machine) -> Result<Estimate> {
    estimate_with(&counted(spec)?, spec, layout, work, machine, &mut PipelineShapes::default())
}

/// What each unit of `spec` keeps, as its family declared it.
pub fn counted(spec: &ModelSpec) -> Result<Vec<Kept>> {
    spec.units.iter().map(|u| Ok(u.declared_cost()?.kept)).collect()
}

/// Pipeline stage splits already balanced (by the units' buffer lengths and the stage
/// count), micro-batches each stage holds (by schedule and shape), and the units' buffer
/// lengths (by how a rank stores them): a search over one model asks for the same few many
/// times. One memo serves one model.
#[derive(Default)]
pub struct PipelineShapes {
    splits: HashMap<(Vec<u64>, usize, usize), Stages>,
    held: HashMap<(ScheduleKind, usize, usize, usize), Vec<u64>>,
    lengths: HashMap<(Holding, i64), Vec<(u64, u64)>>,
}

impl PipelineShapes {
    /// Each unit's buffer length and trained length as the engine lays the unit out under
    /// `layout` on `ranks` ranks ([`storage`]).
    pub(crate) fn unit_lengths(&mut self, spec: &ModelSpec, layout: &Layout, ranks: usize) -> Vec<(u64, u64)> {
        let (holding, pad) = storage(spec, layout, ranks);
        self.lengths
            .entry((holding, pad))
            .or_insert_with(|| {
                (0..spec.units.len())
                    .map(|u| UnitLayout::held(spec, u, holding, pad))
                    .map(|l| (l.len as u64, l.grad_len() as u64))
                    .collect()
            })
            .clone()
    }

    /// The most micro-batches each stage of `pipeline` holds at once under `kind`.
    pub fn held(&mut self, kind: ScheduleKind, pipeline: Pipeline) -> Result<Vec<u64>> {
        let key = (kind, pipeline.stages, pipeline.micro_batches, pipeline.virtual_stages);
        if let Some(held) = self.held.get(&key) {
            return Ok(held.clone());
        }
        let held = schedule::most_held(kind, pipeline)?;
        self.held.insert(key, held.clone());
        Ok(held)
    }

    /// The split of units of buffer lengths `lens` into `pipeline × virtual_stages`
    /// contiguous stages balanced by parameters, as `Balance::Parameters` splits them (and
    /// as the strategies Strata writes ask for).
    pub fn stages(&mut self, lens: &[u64], pipeline: usize, virtual_stages: usize) -> Result<Stages> {
        if pipeline <= 1 {
            return Ok(vec![(0, lens.len())]);
        }
        let key = (lens.to_vec(), pipeline, virtual_stages);
        if let Some(split) = self.splits.get(&key) {
            return Ok(split.clone());
        }
        let costs: Vec<UnitCost> =
            lens.iter().map(|&len| UnitCost { seconds: len as f64, bytes: len, activation_bytes: 0 }).collect();
        let total = pipeline * virtual_stages.max(1);
        let split = partition::balance(&costs, total, pipeline, None, &vec![1; total])?;
        self.splits.insert(key, split.clone());
        Ok(split)
    }
}

/// The estimate for `layout` of `spec`, whose units keep `kept` (counted from a
/// configuration, or measured by the profiling pass), reusing the stage splits of `memo`.
pub fn estimate_with(
    kept: &[Kept],
    spec: &ModelSpec,
    layout: &Layout,
    work: &Workload,
    machine: &Machine,
    memo: &mut PipelineShapes,
) -> Result<Estimate> {
    let c = &layout.candidate;
    let kept = &scored_in_chunks(kept, layout, work);
    let (t, p) = (c.tensor.max(1), layout.pipeline.max(1));
    if work.ranks == 0 || !work.ranks.is_multiple_of(t * p) {
        return Err(Error::Config(format!("tensor {t} × pipeline {p} ranks do not divide the {} ranks", work.ranks)));
    }
    if t > 1 {
        spec.check_tensor_parallel(t as i64)?;
    }
    let cp = layout.context.max(1);
    if cp > 1 {
        if !work.ranks.is_multiple_of(t * p * cp) {
            return Err(Error::Config(format!(
                "tensor {t} × pipeline {p} × context {cp} ranks do not divide the {} ranks",
                work.ranks
            )));
        }
        let split_heads = (layout.context_kind == ContextKind::AllToAll).then_some((t * cp) as i64);
        spec.check_context_parallel(split_heads)?;
    }
    let dp = layout.shard_ranks(work.ranks);
    let sharded = c.sharding != Sharding::None && dp > 1;
    let lent = spec.lent_units();
    let units: Vec<UnitStates> = memo
        .unit_lengths(spec, layout, work.ranks)
        .into_iter()
        .zip(lent)
        .map(|((len, grad_len), lent)| UnitStates { len, grad_len, lent })
        .collect();
    if kept.len() != spec.units.len() {
        return Err(Error::Config(format!("{} units' activations for {} units", kept.len(), spec.units.len())));
    }
    let tokens = rank_tokens(layout, work);
    // One micro-batch's activation bytes per unit, off and over the vocabulary.
    let splits: Vec<(f64, f64)> =
        kept.iter().map(|k| split_activation_bytes(k, layout, work, &machine.device)).collect();
    let output_bytes = |k: &Kept| k.output * tokens * param_bytes(c.precision) as f64 / t as f64;
    let held: Vec<u64> = if p == 1 {
        vec![1]
    } else {
        let pipeline = Pipeline { stages: p, micro_batches: work.micro_batches, virtual_stages: layout.virtual_stages };
        memo.held(layout.schedule, pipeline)?
    };
    let lens: Vec<u64> = units.iter().map(|u| u.len).collect();
    let stages = memo.stages(&lens, p, layout.virtual_stages)?;
    // Gradients take the parameters' width.
    let pb = param_bytes(c.precision);
    let mut pipeline_ranks = Vec::with_capacity(p);
    let mut unit_ranks = vec![0; units.len()];
    for rank in 0..p {
        let ranges: Vec<(usize, (usize, usize))> = (0..layout.virtual_stages.max(1))
            .map(|chunk| chunk * p + rank)
            .filter_map(|s| stages.get(s).map(|&r| (s, r)))
            .collect();
        for &(_, (start, end)) in &ranges {
            unit_ranks[start..end].fill(rank);
        }
        let mut device = Breakdown::default();
        let mut host = Breakdown::default();
        let mut largest = 0u64;
        let mut lent_grads = 0u64;
        let mut trained = 0u64;
        let mut saved = 0u64;
        // Kept through the whole backward (under recomputation a block's output, the next
        // one's input; everything otherwise); kept by the units after the blocks (the head) until
        // their backward, and the part of it that lives on while the last block is
        // recomputed; the most one recomputed block holds.
        let mut activations = 0.0f64;
        let mut after_blocks = 0.0f64;
        let mut during_recompute = 0.0f64;
        let mut recompute = 0.0f64;
        let mut seen_block = false;
        let mut boundary = 0.0f64;
        // The most one offloaded unit keeps; what units that keep their values still hold
        // while the offloaded ones run their backward.
        let mut working = 0.0f64;
        let mut held_by_loss = 0.0f64;
        for &(stage, (start, end)) in &ranges {
            let n = held[stage.min(held.len() - 1)] as f64;
            for u in start..end {
                let s = &units[u];
                largest = largest.max(s.len);
                if s.lent {
                    lent_grads += s.grad_len;
                }
                let (off, over) = splits[u];
                let full = off + over;
                seen_block |= kept[u].block;
                let recomputed = c.checkpoint && kept[u].block;
                // Every unit of the stage but its last offloads what it keeps (a recomputed
                // block, its input).
                if c.activation_offload && u + 1 < end {
                    let shelved = if recomputed { output_bytes(&kept[u]) } else { full };
                    host.activations += (n * shelved) as u64;
                    working = working.max(shelved);
                    if recomputed {
                        recompute = recompute.max(full);
                    }
                } else if recomputed {
                    activations += n * output_bytes(&kept[u]);
                    recompute = recompute.max(full);
                } else if c.checkpoint && seen_block {
                    after_blocks += n * full;
                    during_recompute += n * (off + LOSS_GRAPH_SHARE * over);
                } else {
                    activations += n * full;
                    held_by_loss += n * (off + LOSS_GRAPH_SHARE * over);
                }
                device.params += s.len * pb;
                device.grads += s.grad_len * pb;
                device.optimizer += s.grad_len * work.optimizer_state_bytes;
                trained += s.grad_len;
                saved += s.len;
            }
            boundary = boundary.max(output_bytes(&kept[end - 1]));
        }
        let dpu = dp as u64;
        // Beside its shard of the step's gradient, each rank holds whole gradients while a
        // backward adds to them: one unit's at a time (and the lent units') where each
        // backward completes the step, every unit's where micro-batches accumulate.
        let whole_grads = match work.micro_batches {
            1 => (largest + lent_grads) * pb,
            _ => device.grads,
        };
        if sharded {
            match c.sharding {
                Sharding::Zero1 => device.optimizer /= dpu,
                Sharding::Zero2 => {
                    device.optimizer /= dpu;
                    device.grads = device.grads / dpu + whole_grads;
                }
                Sharding::Fsdp => {
                    device.optimizer /= dpu;
                    device.grads = device.grads / dpu + whole_grads;
                    // The unit running and the one gathered ahead of it.
                    device.params = device.params / dpu + 2 * largest * pb;
                }
                Sharding::None => {}
            }
            if pb != 4 {
                // Sharded low-precision parameters keep an fp32 master shard.
                device.optimizer += trained / dpu * 4;
            }
        }
        // The optimizer's step over low-precision parameters works on an fp32 copy of one
        // unit's parameters and gradient at a time, after the activations are gone.
        let step_work = if pb != 4 && !sharded { 2 * largest * 4 } else { 0 };
        if c.offload {
            // The optimizer's states and masters move to the host; beside fsdp and alone,
            // the parameters and gradients too, the device keeping the units at work.
            host.optimizer = std::mem::take(&mut device.optimizer);
            if c.sharding == Sharding::Fsdp || c.sharding == Sharding::None {
                // The device keeps the units at work: two units' parameters, and the
                // gradients a backward adds to (beside sharded fsdp, the whole ones; else two
                // units').
                let working = 2 * largest * pb;
                let grads_kept = if sharded { whole_grads } else { working };
                host.params = device.params.saturating_sub(working);
                device.params = working.min(device.params);
                host.grads = device.grads.saturating_sub(grads_kept);
                device.grads = grads_kept.min(device.grads);
            }
            if c.sharding == Sharding::None {
                // The copies in flight to the device: two units ahead (offload's prefetch).
                device.comm += 2 * largest * pb;
            }
        }
        // Offloaded units hold their values two at a time (the unit at work and the one
        // fetched ahead) beside what the loss's graph keeps, and one beside the stage's last
        // unit, whose values stay.
        let kept_at_once = match working > 0.0 {
            true => (activations + working).max(2.0 * working + held_by_loss),
            false => activations,
        };
        device.activations = (kept_at_once + after_blocks.max(during_recompute + recompute)) as u64;
        // Sequence parallel gathers a block's whole input; pipeline stages send and receive
        // one micro-batch's boundary activation each way.
        if t > 1 {
            device.comm += (tokens * kept[0].output * pb as f64) as u64;
        }
        if p > 1 {
            device.comm += (2.0 * boundary) as u64;
        }
        // The ring's backward holds its block's keys and values (in the compute dtype) and
        // their gradients (in fp32), and the next block's arriving, each taken as a model
        // width. Grouped-query keys and values pass narrower, but are repeated to the
        // queries' width per block beside the queries' gradient and the block's own: about
        // as much in all (multi-head attention's working copies come to somewhat more).
        if cp > 1 && layout.context_kind == ContextKind::Ring {
            device.comm += (4.0 * (compute_bytes(c.precision) + 4.0) * tokens * kept[0].output / t as f64) as u64;
        }
        // An expert group's all-to-all holds one sparse layer's token slots sent and those
        // received (as many, routing balanced).
        if layout.experts > 1 {
            let layers = spec.expert_sets.len().max(1) as f64;
            device.comm += (2.0 * expert_slot_bytes(spec, tokens, c.precision) / layers) as u64;
        }
        if step_work > device.activations + device.comm {
            device.grads += step_work;
            device.activations = 0;
            device.comm = 0;
        }
        let allocated = device.total();
        device.overhead = machine.device.reserved_bytes + (allocated as f64 * machine.device.fragmentation) as u64;
        let held = saved;
        let saved = if sharded { saved.div_ceil(dpu) } else { saved };
        pipeline_ranks.push(RankBytes { device, host, saved, held });
    }
    let (busiest, fits) = busiest_and_fit(&pipeline_ranks, machine);
    let RankBytes { device, host, .. } = pipeline_ranks[busiest];
    Ok(Estimate { layout: layout.label(), device, host, busiest, fits, pipeline_ranks, unit_ranks })
}

/// What GRPO's generation adds to a rank beside its training step.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Generation {
    /// Completions decoded together (a rank's generation batch).
    pub rows: usize,
    /// Positions of a row at most: its prompt and its completion.
    pub positions: i64,
    /// Positions of the longest prompt: every row's prompt goes through the model at once
    /// (the prefill) before the first token is decoded.
    pub prompt: i64,
    /// A whole frozen copy of the model is the KL term's reference (`beta > 0` without LoRA,
    /// whose base serves with no copy).
    pub reference_copy: bool,
}

/// `estimate` with GRPO's generation counted for `spec` (the model `config` builds, with
/// any adapters), in the parameters' precision (decoding runs the units as declared),
/// beside two fp32 rows of logits per row on the last pipeline rank, which alone computes
/// them (whole on every rank of its tensor group). Each rank counts the units it holds:
/// its stage's layers, its share of their key/value heads. Its peak is the larger of the
/// prefill's and the last token's: the prefill holds its layers' cache of the prompt and,
/// while a unit runs, at most what the unit's training forward keeps for backward at the
/// prompt's length (no-grad frees the rest as it goes); the last token holds the cache of
/// every position, one layer's twice while its next position is joined to it. Generation
/// ends before the step's activations exist, so the device holds the larger of the two; a
/// reference copy holds the rank's parameters ([`RankBytes::held`]: split as the trained
/// model's are over tensor ranks, pipeline stages and expert groups, but not sharded by
/// ZeRO) in fp32.
pub fn with_generation(
    mut estimate: Estimate,
    (config, spec): (&ModelConfig, &ModelSpec),
    layout: &Layout,
    generation: &Generation,
    machine: &Machine,
) -> Result<Estimate> {
    let tensor = layout.candidate.tensor.max(1) as i64;
    let not_decoder = || Error::Config("GRPO generates with a decoder: the model is not one".into());
    let caches = config.cached_values(generation.positions, tensor).ok_or_else(not_decoder)?;
    let prompt = generation.prompt.clamp(0, generation.positions);
    let prompt_caches = config.cached_values(prompt, tensor).ok_or_else(not_decoder)?;
    let kept = counted(spec)?;
    // The blocks are the layers, in order.
    let layers: Vec<Option<usize>> = kept
        .iter()
        .scan(0, |next, k| {
            let layer = k.block.then_some(*next);
            *next += usize::from(k.block);
            Some(layer)
        })
        .collect();
    let element = param_bytes(layout.candidate.precision);
    let rows = generation.rows as u64;
    let last_rank = estimate.pipeline_ranks.len() - 1;
    for (r, rank) in estimate.pipeline_ranks.iter_mut().enumerate() {
        let units: Vec<usize> = (0..kept.len()).filter(|&u| estimate.unit_ranks.get(u) == Some(&r)).collect();
        let mine = |caches: &[i64]| -> Vec<i64> {
            units.iter().filter_map(|&u| layers[u]).filter_map(|l| caches.get(l).copied()).collect()
        };
        // Each step's cache grows by a copy: one layer's old and new cache are held at once.
        let cache = mine(&caches);
        let last_token = cache.iter().sum::<i64>() + cache.iter().copied().max().unwrap_or(0);
        // The head reads only the last position while decoding: its values over the
        // vocabulary are the logits counted below. Unfused attention's scores and their
        // softmax exist together for a moment, twice the probabilities kept.
        let unit_at_once = units
            .iter()
            .map(|&u| kept[u].values - kept[u].vocab_values + 2.0 * kept[u].scores * prompt as f64)
            .fold(0.0f64, f64::max);
        let prefill =
            mine(&prompt_caches).iter().sum::<i64>() + (unit_at_once * prompt as f64 / tensor as f64).ceil() as i64;
        let logits = if r == last_rank { 2 * rows * config.vocab() as u64 * 4 } else { 0 };
        let decoding = rows * last_token.max(prefill) as u64 * element + logits;
        let device = &mut rank.device;
        device.activations = device.activations.max(decoding);
        if generation.reference_copy {
            device.params += rank.held * 4;
        }
        let allocated = device.total() - device.overhead;
        device.overhead = machine.device.reserved_bytes + (allocated as f64 * machine.device.fragmentation) as u64;
    }
    Ok(settled(estimate, machine))
}

/// `estimate` with asynchronous checkpoints counted: each rank's snapshot in host memory
/// holds its checkpoint file, the fp32 values of its saved parameters and of each of their
/// optimizer states (`work.optimizer_state_bytes` per element), as transfer buffers on the
/// host.
pub fn with_snapshot(mut estimate: Estimate, work: &Workload, machine: &Machine) -> Estimate {
    for rank in &mut estimate.pipeline_ranks {
        rank.host.comm += rank.saved * (4 + work.optimizer_state_bytes);
    }
    settled(estimate, machine)
}

/// The pipeline rank holding the most on its device, and whether every rank fits
/// `machine`'s device and host bytes.
fn busiest_and_fit(ranks: &[RankBytes], machine: &Machine) -> (usize, bool) {
    let busiest = (0..ranks.len()).max_by_key(|&r| ranks[r].device.total()).unwrap_or(0);
    let fits = ranks.iter().all(|r| r.device.total() <= machine.device_bytes && r.host.total() <= machine.host_bytes);
    (busiest, fits)
}

/// `estimate` with its busiest rank, that rank's bytes and whether every rank fits taken
/// again from its pipeline ranks' bytes.
fn settled(mut estimate: Estimate, machine: &Machine) -> Estimate {
    (estimate.busiest, estimate.fits) = busiest_and_fit(&estimate.pipeline_ranks, machine);
    estimate.device = estimate.pipeline_ranks[estimate.busiest].device;
    estimate.host = estimate.pipeline_ranks[estimate.busiest].host;
    estimate
}

/// Every layout of one shape (tensor size, pipeline with its schedule and chunks, `data`
/// ranks holding the same pieces) in `precision`: plain data parallelism and, where more
/// than one rank holds the same pieces, zero1, zero2 and fsdp; each with and without
/// recomputation (where the model has blocks) and offload.
pub fn variants(
    precision: Precision,
    tensor: usize,
    (pipeline, schedule, virtual_stages): (usize, ScheduleKind, usize),
    data: usize,
    has_blocks: bool,
) -> Vec<Layout> {
    let mut out = vec![];
    for sharding in [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp] {
        if sharding != Sharding::None && data < 2 {
            continue;
        }
        for checkpoint in [false, true] {
            if checkpoint && !has_blocks {
                continue;
            }
            for offload in [false, true] {
                let candidate = Candidate { tensor, offload, ..Candidate::plain(precision, sharding, checkpoint) };
                out.push(match pipeline {
                    1 => Layout::new(candidate),
                    _ => Layout { pipeline, schedule, virtual_stages, ..Layout::new(candidate) },
                });
            }
        }
    }
    out
}

/// The layouts `strata estimate` shows for `ranks` ranks in `precision`: the
/// [`variants`] of each tensor size of `tensors` and pipeline size of `pipelines` (run by
/// `schedule` over `virtual_stages` chunks per rank) that divide the ranks and that the
/// model splits over.
pub fn layouts(
    spec: &ModelSpec,
    ranks: usize,
    precision: Precision,
    tensors: &[usize],
    pipelines: &[usize],
    (schedule, virtual_stages): (ScheduleKind, usize),
) -> Vec<Layout> {
    let has_blocks = spec.block_count() > 0;
    let mut out = vec![];
    for &tensor in tensors {
        if tensor == 0 || (tensor > 1 && spec.check_tensor_parallel(tensor as i64).is_err()) {
            continue;
        }
        for &pipeline in pipelines {
            if pipeline == 0 || !ranks.is_multiple_of(tensor * pipeline) || pipeline > spec.units.len() {
                continue;
            }
            let data = ranks / (tensor * pipeline);
            out.extend(variants(precision, tensor, (pipeline, schedule, virtual_stages), data, has_blocks));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    fn run(layout: Layout, ranks: usize, micro_batches: usize) -> Estimate {
        let model = ModelConfig::Gpt(GptConfig::new(256, 32, 2, 4, 64));
        let device = device_kind("cpu").unwrap();
        let machine = Machine { device, device_bytes: u64::MAX, host_bytes: u64::MAX };
        let work = Workload { ranks, micro_batch: 8, ctx: 32, micro_batches, optimizer_state_bytes: 8 };
        estimate(&model, &layout, &work, &machine).unwrap()
    }

    fn layout(precision: Precision, sharding: Sharding, checkpoint: bool) -> Layout {
        Layout::new(Candidate::plain(precision, sharding, checkpoint))
    }

    /// One memo serving a search gives every layout the estimate a fresh one would: the
    /// units' buffers it keeps are told apart by tensor split and shard padding.
    #[test]
    fn a_memo_shared_across_layouts_estimates_each_as_a_fresh_one() {
        let model = ModelConfig::Gpt(GptConfig::new(250, 32, 2, 4, 64));
        let spec = model.spec().unwrap();
        let kept = counted(&spec).unwrap();
        let machine = Machine { device: device_kind("cpu").unwrap(), device_bytes: u64::MAX, host_bytes: u64::MAX };
        // Six shards pad the units' buffers, which four would divide.
        let work = Workload { ranks: 6, micro_batch: 8, ctx: 32, micro_batches: 1, optimizer_state_bytes: 8 };
        let tensor = |t: usize| {
            let c = Candidate { tensor: t, ..Candidate::plain(Precision::Fp32, Sharding::None, false) };
            Layout::new(c)
        };
        let layouts = [tensor(1), layout(Precision::Fp32, Sharding::Fsdp, false), tensor(2)];
        let mut memo = PipelineShapes::default();
        for l in &layouts {
            let shared = serde_json::to_value(estimate_with(&kept, &spec, l, &work, &machine, &mut memo).unwrap());
            let fresh = serde_json::to_value(estimate_spec(&spec, l, &work, &machine).unwrap());
            assert_eq!(shared.unwrap(), fresh.unwrap(), "{l:?}");
        }
    }

    #[test]
    fn generation_counts_its_cache_and_the_reference_copy() {
        let model = ModelConfig::Gpt(GptConfig::new(256, 32, 2, 4, 64));
        let spec = model.spec().unwrap();
        let plain = layout(Precision::Fp32, Sharding::None, false);
        let base = run(plain, 1, 1);
        let machine = Machine { device: device_kind("cpu").unwrap(), device_bytes: u64::MAX, host_bytes: u64::MAX };
        // 512 rows of 32 positions: 2 layers' keys and values of width 64 in fp32 (and one
        // layer's again, while it grows), beside two fp32 rows of 256 logits each.
        let g = Generation { rows: 512, positions: 32, prompt: 1, reference_copy: false };
        let e = with_generation(base.clone(), (&model, &spec), &plain, &g, &machine).unwrap();
        let cache = 512 * 32 * 3 * 2 * 64 * 4 + 2 * 512 * 256 * 4;
        assert!(cache > base.device.activations, "the cache is the larger here");
        assert_eq!(e.device.activations, cache);
        assert_eq!(e.device.params, base.device.params);
        // A prompt of 31 positions: its prefill holds the 2 layers' cache of it and, while a
        // block runs, what the block keeps for backward (GPT's 19 values per width, 3 more,
        // and a probability per head and attended position, twice: the scores beside them),
        // more than the last token's cache.
        let long =
            with_generation(base.clone(), (&model, &spec), &plain, &Generation { prompt: 31, ..g }, &machine).unwrap();
        let prefill = 2 * 2 * 64 * 31 + (19 * 64 + 3 + 2 * 4 * 31) * 31;
        assert_eq!(long.device.activations, 512 * prefill * 4 + 2 * 512 * 256 * 4);
        // A few rows keep less than the step's activations, which then stand.
        let few =
            with_generation(base.clone(), (&model, &spec), &plain, &Generation { rows: 1, ..g }, &machine).unwrap();
        assert_eq!(few.device.activations, base.device.activations);
        let copy = Generation { reference_copy: true, ..g };
        let e = with_generation(base.clone(), (&model, &spec), &plain, &copy, &machine).unwrap();
        let whole = spec.num_params() as u64 * 4;
        assert_eq!(e.device.params, base.device.params + whole);
        // Under fsdp the copy stays whole; two pipeline stages each copy their own units,
        // and two tensor ranks their halves of the split weights.
        let fsdp = layout(Precision::Fp32, Sharding::Fsdp, false);
        let e = with_generation(run(fsdp, 2, 1), (&model, &spec), &fsdp, &copy, &machine).unwrap();
        assert_eq!(e.device.params, run(fsdp, 2, 1).device.params + whole);
        let piped = Layout { pipeline: 2, ..plain };
        let base = run(piped, 2, 2);
        let e = with_generation(base.clone(), (&model, &spec), &piped, &copy, &machine).unwrap();
        let stages: Vec<u64> =
            e.pipeline_ranks.iter().zip(&base.pipeline_ranks).map(|(e, b)| e.device.params - b.device.params).collect();
        assert_eq!(stages.iter().sum::<u64>(), whole, "the stages' copies make one model");
        assert!(stages.iter().all(|&s| s > 0 && s < whole), "{stages:?}");
        let split = Layout { candidate: Candidate { tensor: 2, ..plain.candidate }, ..plain };
        let base = run(split, 2, 1);
        let e = with_generation(base.clone(), (&model, &spec), &split, &copy, &machine).unwrap();
        let copied = e.device.params - base.device.params;
        assert!(copied < whole && copied > whole / 2, "{copied} of {whole}: the split weights halve");
        assert_eq!(copied, base.device.params, "fp32: the copy is the trained parameters again");
        // Each tensor rank caches its half of the heads; each stage its own layer, the last
        // one alone the logits.
        let e = with_generation(base.clone(), (&model, &spec), &split, &g, &machine).unwrap();
        let layer = 512 * 32 * 2 * 64 * 4;
        assert_eq!(e.device.activations, 3 * layer / 2 + 2 * 512 * 256 * 4);
        let base = run(piped, 2, 2);
        let e = with_generation(base.clone(), (&model, &spec), &piped, &g, &machine).unwrap();
        let stages: Vec<u64> = e.pipeline_ranks.iter().map(|r| r.device.activations).collect();
        assert_eq!(stages, [2 * layer, 2 * layer + 2 * 512 * 256 * 4]);
    }

    /// The engine's ledger holds 474,112 bytes of parameters for this GPT, as many of
    /// gradients and twice as many of AdamW's moments; zero1 halves the moments over two
    /// ranks, zero2 the gradients too (beside a block's and the tied embedding's whole
    /// gradients, or every unit's while micro-batches accumulate), fsdp the parameters too
    /// (beside two gathered blocks), `half` the parameters.
    #[test]
    fn model_states_are_the_engine_s() {
        let plain = run(layout(Precision::Fp32, Sharding::None, false), 1, 1).device;
        assert_eq!((plain.params, plain.grads, plain.optimizer), (474_112, 474_112, 948_224));
        let zero1 = run(layout(Precision::Fp32, Sharding::Zero1, false), 2, 1).device;
        assert_eq!((zero1.params, zero1.optimizer), (474_112, 474_112));
        let block = (12 * 64 * 64 + 13 * 64) * 4;
        // The tied embedding (256 × 64 tokens and 32 × 64 positions) is read by the head: its
        // whole gradient lives through backward beside the unit's in backward.
        let embedding = (256 + 32) * 64 * 4;
        let zero2 = run(layout(Precision::Fp32, Sharding::Zero2, false), 2, 1).device;
        assert_eq!(zero2.grads, 237_056 + block + embedding);
        let fsdp = run(layout(Precision::Fp32, Sharding::Fsdp, false), 2, 1).device;
        assert_eq!(fsdp.params, 237_056 + 2 * block);
        assert_eq!(fsdp.grads, 237_056 + block + embedding);
        assert_eq!(run(layout(Precision::HalfBf16, Sharding::None, false), 1, 1).device.params, 237_056);
        // Accumulating micro-batches keep every unit's whole gradient beside the shard.
        let accumulating = run(layout(Precision::Fp32, Sharding::Zero2, false), 2, 2).device;
        assert_eq!(accumulating.grads, 237_056 + 474_112);
        // Offloaded beside fsdp, the shards go to the host; the gathered blocks and the
        // whole gradients stay.
        let offloaded =
            Layout::new(Candidate { offload: true, ..layout(Precision::Fp32, Sharding::Fsdp, false).candidate });
        let e = run(offloaded, 2, 2);
        assert_eq!((e.host.params, e.host.grads), (237_056, 237_056));
        assert_eq!((e.device.params, e.device.grads), (2 * block, 474_112));
    }

    /// Recomputation keeps less; GPipe's first stage holds all four micro-batches, 1F1B's
    /// two (as many as stages).
    #[test]
    fn activations_follow_recomputation_and_the_schedule() {
        let full = run(layout(Precision::Fp32, Sharding::None, false), 1, 1).device.activations;
        let recomputed = run(layout(Precision::Fp32, Sharding::None, true), 1, 1).device.activations;
        assert!(recomputed < full && recomputed * 3 > full, "{recomputed} against {full}");
        let piped = |schedule| Layout { pipeline: 2, schedule, ..layout(Precision::Fp32, Sharding::None, false) };
        let gpipe = run(piped(ScheduleKind::Gpipe), 2, 4).pipeline_ranks[0].device.activations;
        let one_f_one_b = run(piped(ScheduleKind::OneForwardOneBackward), 2, 4).pipeline_ranks[0].device.activations;
        assert_eq!(gpipe, 2 * one_f_one_b);
    }
}
