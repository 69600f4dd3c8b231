//! `strata plan`: the fastest layouts of a model for a described cluster, a global batch and
//! a sequence length, found by searching data parallelism and its sharding stages × tensor
//! size × context size and exchange × pipeline size (schedule, micro-batches, chunks per
//! rank) × expert group size (a mixture of experts) × recomputation × offload × precision (and, where rows fit no layout otherwise, the
//! chunked loss and activation offload), pruned by the memory estimate and ranked by the
//! predicted step.
//!
//! Owns the search space and the ranking. Must not predict bytes or seconds itself
//! ([`super::estimate`] and [`super::step_time`] do) nor run anything.
use super::candidate::{context_kinds, shape_obstacle, Layout, Precision};
use super::estimate::{self, Estimate, Machine, Workload};
use super::step_time::{self, Cluster, StepTime, UnitWork};
use crate::model::ModelConfig;
use crate::strategy::{ChunkedLossConfig, ContextKind, ScheduleKind};
use crate::{Error, Result};
use serde::Serialize;

/// What to plan for.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    /// The model's family and configuration.
    pub model: ModelConfig,
    /// The devices, their links and hosts.
    pub cluster: Cluster,
    /// Sequences per step over all ranks.
    pub global_batch: usize,
    /// Positions per sequence.
    pub seq_len: i64,
    /// Precisions to try.
    pub precisions: Vec<Precision>,
    /// Bytes of optimizer state per trained element (AdamW: 8).
    pub optimizer_state_bytes: u64,
    /// Host bytes per device.
    pub host_bytes: u64,
}

/// One layout the search kept: its shape, bytes and predicted step.
#[derive(Clone, Debug, Serialize)]
pub struct PlanRow {
    /// Tensor and pipeline sizes, methods and schedule.
    pub layout: Layout,
    /// Readable name: the layout's, its chunks per rank, and the micro-batches.
    pub label: String,
    /// Rows per micro-batch of a data-parallel group, and micro-batches per step.
    pub micro_batch: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Data-parallel groups (ranks over tensor × pipeline size).
    pub data: usize,
    /// The estimated bytes of the busiest rank and each pipeline rank.
    pub memory: Estimate,
    /// The predicted step, split into its parts.
    pub time: StepTime,
    /// Why it lost to the best: the part of the step that grew the most.
    pub behind: Option<String>,
}

/// What the search found.
#[derive(Clone, Debug, Serialize)]
pub struct PlanReport {
    /// Layouts that fit, fastest first.
    pub rows: Vec<PlanRow>,
    /// Layouts considered in all, and those whose estimate overfilled a device or host.
    pub considered: usize,
    /// Layouts whose estimate overfilled a device or host.
    pub over_memory: usize,
    /// Of the layouts that did not fit, the one that overfilled least (its device and host
    /// bytes against the device's and host's), for the message when none fits.
    pub least_over: Option<Estimate>,
}

/// Divisors of `n` in increasing order.
fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Searches every layout of `req` and ranks those that fit by predicted step time.
pub fn plan(req: &PlanRequest) -> Result<PlanReport> {
    let spec = req.model.spec()?;
    let ranks = req.cluster.devices();
    if ranks == 0 || req.global_batch == 0 || req.seq_len < 1 {
        return Err(Error::Config("a plan needs devices, a global batch and a sequence length".into()));
    }
    let blocks = spec.block_count();
    let units = UnitWork::counted(&spec, req.seq_len)?;
    let machine = Machine {
        device: req.cluster.device.clone(),
        device_bytes: req.cluster.device.memory_bytes,
        host_bytes: req.host_bytes,
    };
    let tensors: Vec<usize> = divisors(req.cluster.gpus_per_node.min(ranks))
        .into_iter()
        .filter(|&t| t == 1 || spec.check_tensor_parallel(t as i64).is_ok())
        .collect();
    // A mixture of experts: no expert groups, and each size its experts split over.
    let expert_sizes: Vec<usize> = std::iter::once(1).chain(spec.expert_group_sizes(ranks)).collect();
    let mut memo = step_time::Memo::default();
    let mut rows = vec![];
    let (mut considered, mut over_memory, mut least_over) = (0, 0, None::<(f64, Estimate)>);
    // How far a layout overfills the fuller of its device and host.
    let overfill = |e: &Estimate| {
        (e.device.total() as f64 / machine.device_bytes.max(1) as f64)
            .max(e.host.total() as f64 / machine.host_bytes.max(1) as f64)
    };
    // Each pass tries every layout with more of the long-row methods, until one fits: rows
    // whole (and split over context ranks where they are long); the loss computed in chunks
    // in the head (where the model's head can); rows split where they were not; the units'
    // kept values offloaded to the host.
    let chunk = spec.scores_in_chunks().then_some(ChunkedLossConfig::default().positions);
    let long = req.seq_len >= LONG_ROWS;
    let mut passes = vec![RowPass { whole: true, split_rows: long, chunk: None, shelved: false }];
    if chunk.is_some() {
        passes.push(RowPass { whole: true, split_rows: long, chunk, shelved: false });
    }
    if !long {
        passes.push(RowPass { whole: false, split_rows: true, chunk, shelved: false });
    }
    passes.push(RowPass { whole: true, split_rows: true, chunk, shelved: true });
    for RowPass { whole, split_rows, chunk, shelved } in passes {
        for &t in &tensors {
            for (c, kind) in context_splits(&spec, req, t, whole, split_rows) {
                for p in divisors(ranks / (t * c)).into_iter().filter(|&p| p <= blocks.max(1)) {
                    let dp = ranks / (t * c * p);
                    if !req.global_batch.is_multiple_of(dp) {
                        continue;
                    }
                    let rows_per_group = req.global_batch / dp;
                    for micro_batch in divisors(rows_per_group).into_iter().filter(|&b| b <= 64) {
                        let m = rows_per_group / micro_batch;
                        let shapes = schedules(p, m, blocks).into_iter().flat_map(|schedule| {
                            expert_sizes.iter().filter(move |&&e| dp.is_multiple_of(e)).map(move |&e| (schedule, e))
                        });
                        for ((schedule, virtual_stages), e) in shapes {
                            // ZeRO stages shard over the context ranks beside the data ranks,
                            // outside the expert groups.
                            let layouts = req.precisions.iter().flat_map(|&precision| {
                                estimate::variants(precision, t, (p, schedule, virtual_stages), dp * c / e, blocks > 0)
                                    .into_iter()
                                    .map(|l| l.with_context(c, kind).with_experts(e))
                                    .map(|mut l| {
                                        l.candidate.activation_offload = shelved;
                                        l.candidate.chunked_loss = chunk;
                                        l
                                    })
                            });
                            for layout in layouts.filter(|l| shape_obstacle(l, ranks).is_none()) {
                                considered += 1;
                                let work = Workload {
                                    ranks,
                                    micro_batch,
                                    ctx: req.seq_len,
                                    micro_batches: m,
                                    optimizer_state_bytes: req.optimizer_state_bytes,
                                };
                                let memory = estimate::estimate_with(
                                    &units.kept,
                                    &spec,
                                    &layout,
                                    &work,
                                    &machine,
                                    &mut memo.shapes,
                                )?;
                                if !memory.fits {
                                    over_memory += 1;
                                    let over = overfill(&memory);
                                    if least_over.as_ref().is_none_or(|(least, _)| over < *least) {
                                        least_over = Some((over, memory));
                                    }
                                    continue;
                                }
                                let time =
                                    step_time::step_time(&units, &spec, &layout, &work, &req.cluster, &mut memo)?;
                                let label = layout_label(&layout, micro_batch, m);
                                rows.push(PlanRow {
                                    layout,
                                    label,
                                    micro_batch,
                                    micro_batches: m,
                                    data: dp,
                                    memory,
                                    time,
                                    behind: None,
                                });
                            }
                        }
                    }
                }
            }
        }
        if !rows.is_empty() {
            break;
        }
    }
    rows.sort_by(|a, b| a.time.total.total_cmp(&b.time.total));
    if let Some(best) = rows.first().map(|r| r.time) {
        for r in rows.iter_mut().skip(1) {
            r.behind = Some(behind(&r.time, &best));
        }
    }
    Ok(PlanReport { rows, considered, over_memory, least_over: least_over.map(|(_, e)| e) })
}

/// Which layouts a pass of the search tries: rows whole, split over context ranks, the loss
/// in chunks of this many positions, the units' kept values on the host.
struct RowPass {
    whole: bool,
    split_rows: bool,
    chunk: Option<i64>,
    shelved: bool,
}

/// Rows at least this long are tried split over context ranks (shorter ones only where no
/// layout fits them whole): below it attention is a small share of a step and the split's
/// exchanges rarely pay.
const LONG_ROWS: i64 = 16_384;

/// The context splits worth trying beside tensor size `t`: none where `whole`, and where `split_rows`,
/// each size that keeps tensor × context within a node and splits the rows, by the ring
/// (rows in `2c` runs) and, where the heads divide, by the all-to-all.
fn context_splits(
    spec: &crate::model::ModelSpec,
    req: &PlanRequest,
    t: usize,
    whole: bool,
    split_rows: bool,
) -> Vec<(usize, ContextKind)> {
    let mut out = if whole { vec![(1, ContextKind::Ring)] } else { vec![] };
    let sizes = if split_rows { divisors(req.cluster.gpus_per_node / t) } else { vec![] };
    for c in sizes.into_iter().filter(|&c| c > 1 && req.cluster.devices().is_multiple_of(t * c)) {
        out.extend(context_kinds(spec, req.seq_len, t, c).into_iter().map(|kind| (c, kind)));
    }
    out
}

/// The schedules worth trying at `p` stages and `m` micro-batches: none without a
/// pipeline; 1F1B, the interleaved schedule over two chunks per rank (where the blocks
/// and micro-batches allow) and zero-bubble ZB-H1 with one.
fn schedules(p: usize, m: usize, blocks: usize) -> Vec<(ScheduleKind, usize)> {
    if p == 1 {
        return vec![(ScheduleKind::OneForwardOneBackward, 1)];
    }
    let mut out = vec![(ScheduleKind::OneForwardOneBackward, 1), (ScheduleKind::ZeroBubble, 1)];
    if m.is_multiple_of(p) && blocks >= 2 * p {
        out.push((ScheduleKind::Interleaved, 2));
    }
    out
}

fn layout_label(layout: &Layout, micro_batch: usize, micro_batches: usize) -> String {
    let mut label = layout.label();
    if layout.virtual_stages > 1 {
        label.push_str(&format!(" ×{} chunks", layout.virtual_stages));
    }
    format!("{label}; micro-batch {micro_batch} × {micro_batches}")
}

/// The part of `slower`'s step that most exceeds `best`'s, as a reason.
fn behind(slower: &StepTime, best: &StepTime) -> String {
    let parts = [
        ("compute", slower.compute - best.compute),
        ("memory-bound work", slower.memory - best.memory),
        ("pipeline bubble", slower.bubble - best.bubble),
        ("data-parallel communication", slower.data_comm - best.data_comm),
        ("tensor-parallel communication", slower.tensor_comm - best.tensor_comm),
        ("pipeline communication", slower.pipeline_comm - best.pipeline_comm),
        ("context-parallel communication", slower.context_comm - best.context_comm),
        ("expert all-to-all", slower.expert_comm - best.expert_comm),
        ("offload traffic", slower.offload - best.offload),
        ("optimizer update", slower.optimizer - best.optimizer),
    ];
    let (what, by) = parts.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap_or(("compute", 0.0));
    format!("{what} +{:.1} ms", 1e3 * by.max(0.0))
}
