//! Runs a rank's schedule: one engine per chunk (virtual stage) it holds, activations and
//! gradients between neighbouring stages over one ordered group per direction, tied weights
//! summed across the stages that hold them, then one update with the global gradient norm.
use super::partition::{self, UnitCost};
use super::schedule::{schedule, Op, Pipeline, ScheduleKind};
use crate::comm::{all_reduce_values, Comm, ProcessGroup, ReduceOp, Work};
use crate::compute::deferred::{self, WeightGrads};
use crate::compute::scaler::GradDecision;
use crate::data::Step;
use crate::engine::{Engine, EngineConfig, Event, EventSink, UnitClock, Upstream};
use crate::model::{ModelSpec, ParamId};
use crate::optim::{LrSchedule, Optimizer, OptimizerConfig};
use crate::strategy::{Dim, ShardMethod, Strategy};
use crate::train::{
    next_token_loss, next_token_loss_of, token_input, Feed, GradScaling, HostUpdating, InputFn, LossFn,
    PipelineFigures, StepReport,
};
use crate::{Error, Result};
use std::collections::HashMap;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, Tensor};

/// One direction between two stages: the group of the two ranks and the peer's place in it.
struct Link {
    group: Arc<dyn ProcessGroup>,
    peer: usize,
}

/// Dimensions a header carries at most.
const MAX_DIMS: usize = 8;

fn kind_code(kind: Kind) -> Result<i64> {
    Ok(match kind {
        Kind::Float => 0,
        Kind::Double => 1,
        Kind::Half => 2,
        Kind::BFloat16 => 3,
        other => return Err(Error::Engine(format!("pipeline: cannot send {other:?} activations"))),
    })
}

fn kind_of(code: i64) -> Result<Kind> {
    [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16]
        .get(code as usize)
        .copied()
        .ok_or_else(|| Error::Comm(format!("pipeline: a header names dtype {code}")))
}

impl Link {
    /// Sends `t`'s shape and dtype, then its values; the works complete later.
    fn send(&self, t: &Tensor) -> Result<Vec<Work>> {
        let size = t.size();
        if size.len() > MAX_DIMS {
            return Err(Error::Engine(format!("pipeline: a {}-dimensional activation", size.len())));
        }
        let mut header = vec![size.len() as i64, kind_code(t.kind())?];
        header.extend(size.iter().copied().chain(std::iter::repeat(0)).take(MAX_DIMS));
        let header = Tensor::from_slice(&header);
        let values = t.f_detach()?.f_contiguous()?;
        Ok(vec![self.group.send(&header, self.peer)?, self.group.send(&values, self.peer)?])
    }

    fn recv(&self, device: tch::Device) -> Result<Tensor> {
        let header = Tensor::f_zeros([2 + MAX_DIMS as i64], (Kind::Int64, tch::Device::Cpu))?;
        self.group.recv(&header, self.peer)?.wait()?;
        let header: Vec<i64> = Vec::<i64>::try_from(&header).map_err(|e| Error::Comm(e.to_string()))?;
        let dims = (header[0].max(0) as usize).min(MAX_DIMS);
        let t = Tensor::f_empty(&header[2..2 + dims], (kind_of(header[1])?, device))?;
        self.group.recv(&t, self.peer)?.wait()?;
        Ok(t)
    }
}

/// One chunk this rank holds: its global stage, engine and optimizer, and the weight
/// gradients its zero-bubble backward defers.
struct Chunk {
    stage: usize,
    engine: Engine,
    optimizer: Optimizer,
    weight_grads: Arc<WeightGrads>,
}

/// A tied parameter held by several stages: the ranks holding it sum its gradient.
struct Tie {
    param: ParamId,
    group: Option<Arc<dyn ProcessGroup>>,
}

/// A parameter of the whole model: its name and shape, the stage that owns it and the
/// owning unit's place in that stage.
struct WholeParam {
    id: ParamId,
    name: String,
    shape: Vec<i64>,
    stage: usize,
    unit_in_stage: usize,
}

/// A pipeline rank's trainer: [`crate::train::Trainer`]'s step for a stage.
pub struct PipelineTrainer {
    chunks: Vec<Chunk>,
    kind: ScheduleKind,
    pipeline: Pipeline,
    rank: usize,
    /// This rank's operations for every step, and the (micro-batch, chunk) of each chunk's
    /// last backward.
    ops: Arc<[Op]>,
    last_backward: HashSet<(usize, usize)>,
    /// Whether linear layers' weight gradients wait for their [`Op::BackwardWeight`] (the
    /// zero-bubble schedule), or are computed in the backward as usual.
    defer_weight_grads: bool,
    /// Activations in from the previous stage and out to the next, gradients the other way,
    /// by chunk.
    activations_in: Vec<Option<Link>>,
    activations_out: Vec<Option<Link>>,
    grads_in: Vec<Option<Link>>,
    grads_out: Vec<Option<Link>>,
    ties: Vec<Tie>,
    /// Every parameter of the whole model in unit order: name, shape and the stage that owns it.
    params: Vec<WholeParam>,
    /// The whole model's layout, as checkpoints describe it, and each stage's unit range.
    layout: crate::checkpoint::Layout,
    ranges: Vec<(usize, usize)>,
    /// Every stage of this pipeline: losses and norms are summed over it.
    stages_group: Option<Arc<dyn ProcessGroup>>,
    /// Every rank, where several pipelines run (data replicas, tensor ranks): losses are
    /// averaged over it, measurements agreed.
    world_group: Option<Arc<dyn ProcessGroup>>,
    pub schedule: LrSchedule,
    pub grad_clip: Option<f64>,
    /// The loss scale and the check of gradients before the update (`amp_native`,
    /// `loss_scaler`), decided from the gradients of every stage together.
    pub scaling: GradScaling,
    pub prepare_input: InputFn,
    pub loss_func: LossFn,
    step: u64,
    /// Told each operation as it ends, and (through each chunk's engine) its units' events.
    events: Option<Arc<dyn EventSink>>,
}

/// Hands a chunk engine's events on with its units numbered as in the whole model.
struct WholeModelUnits {
    first_unit: usize,
    sink: Arc<dyn EventSink>,
}

impl EventSink for WholeModelUnits {
    fn record(&self, event: Event) {
        let shift = |unit: usize| unit + self.first_unit;
        self.sink.record(match event {
            Event::Phase { phase, unit, ledger_bytes, storage_bytes } => {
                Event::Phase { phase, unit: shift(unit), ledger_bytes, storage_bytes }
            }
            Event::GatherStarted { unit } => Event::GatherStarted { unit: shift(unit) },
            Event::ParamsFreed { unit } => Event::ParamsFreed { unit: shift(unit) },
            Event::Copied { unit, to, bytes } => Event::Copied { unit: shift(unit), to, bytes },
            Event::Evicted { unit } => Event::Evicted { unit: shift(unit) },
            Event::Recomputed { unit, began } => Event::Recomputed { unit: shift(unit), began },
            Event::CopyWaited { unit, began } => Event::CopyWaited { unit: shift(unit), began },
            other @ (Event::Update { .. } | Event::Operation { .. }) => other,
        });
    }
}

/// What [`PipelineTrainer::new`] builds from.
pub struct PipelineSetup<'a> {
    /// Makes the whole model's spec (called once per chunk this rank holds).
    pub spec: &'a dyn Fn() -> Result<ModelSpec>,
    pub engine: EngineConfig,
    pub strategy: &'a Strategy,
    pub comm: Option<&'a Comm>,
    /// Ranks on this host, and data parallelism's buckets (for the stages' replicas).
    pub local_world_size: usize,
    pub data_parallel: crate::parallel::DataParallelOptions,
    pub optimizer: OptimizerConfig,
    pub schedule: LrSchedule,
    pub grad_clip: Option<f64>,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// The stages' unit ranges where the caller decided them (a balance of
    /// [`PipelineTrainer::measure_units`]' costs by [`partition::balance`]); `None`: the
    /// strategy's hand split, or a balance by parameter count.
    pub split: Option<Vec<(usize, usize)>>,
}

/// What running a step's operations measured.
struct OpsOutcome {
    /// The last stage's micro-batch losses, each times its [`Step::loss_weight`].
    weighted_loss: f64,
    /// Seconds in compute operations, and the schedule's whole span.
    busy: f64,
    span: f64,
    /// Mean seconds of a forward, a backward (its input-gradient part where split) and a
    /// deferred weight gradient (0 where none ran).
    mean_op_seconds: [f64; 3],
    /// The most micro-batches whose forward records were held at once.
    most_held: u64,
    /// Outputs whose values were freed once sent, before their backward.
    outputs_freed: u64,
}

/// A stage's output sent to the next stage: the backward keeps the tensor (its autograd
/// node), not its values, which go once the send has completed.
struct SentOutput {
    works: Vec<Work>,
    micro: usize,
    chunk: usize,
}

/// The stages' unit ranges, stage `s` on rank `s % ranks`: the strategy's, or balanced by
/// parameter count.
pub fn stage_ranges(
    spec: &ModelSpec,
    stages: usize,
    ranks: usize,
    given: Option<&[(usize, usize)]>,
) -> Result<Vec<(usize, usize)>> {
    let units = spec.units.len();
    match given {
        Some(split) => partition::check(split, units, stages),
        None => {
            let costs: Vec<UnitCost> = spec
                .units
                .iter()
                .map(|u| {
                    let params: i64 = u.params.iter().map(|id| spec.params[id.0].numel()).sum();
                    // A unit without parameters still costs something to run.
                    UnitCost { seconds: params.max(1) as f64, bytes: params.max(0) as u64, activation_bytes: 0 }
                })
                .collect();
            partition::balance(&costs, stages, ranks, None, &vec![0; stages])
        }
    }
}

/// For each of a chunk's last weight gradients, in order, given the unit each adds to: the
/// lowest unit from which on every unit is complete before it runs (none of it or the ones
/// after it reaches them).
fn complete_from(units: &[usize]) -> Vec<usize> {
    let mut out = vec![0; units.len()];
    let mut reached = None;
    for (i, &u) in units.iter().enumerate().rev() {
        reached = reached.max(Some(u));
        out[i] = reached.map_or(0, |r| r + 1);
    }
    out
}

impl PipelineTrainer {
    /// Feeds the first stage and scores the last as `feed` says (a loss left out keeps the
    /// next-token loss).
    pub fn set_feed(&mut self, feed: &Feed) {
        self.prepare_input = feed.input.clone();
        if let Some(loss) = &feed.loss {
            self.loss_func = loss.clone();
        }
    }

    pub fn new(setup: PipelineSetup<'_>) -> Result<PipelineTrainer> {
        let config = setup.strategy.pipeline_parallel().unwrap_or_default();
        let world = setup.comm.map_or(1, Comm::size);
        let mesh = crate::parallel::mesh_of(setup.strategy, setup.comm, setup.local_world_size)?;
        let p = mesh.size(Dim::Pipeline);
        let zero_bubble = config.schedule.splits_backward();
        let v = config.virtual_stages;
        let pipeline = Pipeline { stages: p, micro_batches: setup.micro_batches, virtual_stages: v };
        // The ranks of every pipeline, each in stage order; this rank's stage is its place.
        let (rank, pipelines) = mesh.pipelines();
        // The schedule refuses bad shapes before anything is built; it is the same every step.
        let ops: Arc<[Op]> = schedule(config.schedule, pipeline, rank)?.into();
        // Each chunk's last backward completes its gradients (data parallelism reduces then);
        // under the zero-bubble schedule, its last weight-gradient operation does.
        let mut last_backward: HashSet<(usize, usize)> = HashSet::new();
        for chunk in 0..v {
            let last = ops.iter().rev().find_map(|op| match *op {
                Op::Backward { micro, chunk: c } | Op::BackwardInput { micro, chunk: c }
                    if c == chunk && !zero_bubble =>
                {
                    Some(micro)
                }
                Op::BackwardWeight { micro, chunk: c } if c == chunk => Some(micro),
                _ => None,
            });
            last_backward.extend(last.map(|micro| (micro, chunk)));
        }
        let whole = (setup.spec)()?;
        let total = p * v;
        let ranges = match &setup.split {
            Some(split) => partition::check(split, whole.units.len(), total)?,
            None => stage_ranges(&whole, total, p, config.stages.as_deref())?,
        };
        // Tied parameters: the stages that read each.
        let stage_of = |unit: usize| ranges.iter().position(|&(a, b)| (a..b).contains(&unit)).unwrap_or(0);
        let mut readers: HashMap<ParamId, Vec<usize>> = HashMap::new();
        for (k, unit) in whole.units.iter().enumerate() {
            for &id in unit.params.iter().chain(&unit.borrowed) {
                let stages = readers.entry(id).or_default();
                if !stages.contains(&stage_of(k)) {
                    stages.push(stage_of(k));
                }
            }
        }
        let params = whole
            .units
            .iter()
            .enumerate()
            .flat_map(|(k, u)| u.params.iter().map(move |&id| (k, id)))
            .map(|(k, id)| WholeParam {
                id,
                name: whole.params[id.0].name.clone(),
                shape: whole.params[id.0].shape.clone(),
                stage: stage_of(k),
                unit_in_stage: k - ranges[stage_of(k)].0,
            })
            .collect();
        let tensor_size = mesh.size(Dim::Tensor);
        let layout = crate::checkpoint::Layout::of_spec(&whole, tensor_size);
        let mut tied: Vec<(ParamId, Vec<usize>)> = readers.into_iter().filter(|(_, s)| s.len() > 1).collect();
        tied.sort();
        // zero2 and fsdp free a unit's whole gradient once reduced, before a weight tied
        // across ranks (GPT's wte) could be summed over its stages: units holding one stay
        // whole (ignored by the sharding), so their gradients are summed whole as under zero1.
        let tied_across_ranks: HashSet<ParamId> = tied
            .iter()
            .filter(|(_, stages)| stages.iter().any(|s| s % p != stages[0] % p))
            .map(|(id, _)| *id)
            .collect();
        let frees_whole_grads = matches!(setup.strategy.sharding(), Some((ShardMethod::Zero2 | ShardMethod::Fsdp, _)));
        let mut chunks = Vec::with_capacity(v);
        for chunk in 0..v {
            let stage = pipeline.stage(rank, chunk);
            let (start, end) = ranges[stage];
            let spec = (setup.spec)()?.stage(start, end)?;
            let holding_ties: Vec<String> = whole.units[start..end]
                .iter()
                .filter(|u| u.params.iter().chain(&u.borrowed).any(|id| tied_across_ranks.contains(id)))
                .map(|u| u.name.clone())
                .collect();
            let strategy = setup.strategy.for_stage(&whole, &spec)?;
            let strategy = match frees_whole_grads && !holding_ties.is_empty() {
                true => strategy.with_ignored_units(&holding_ties),
                false => strategy,
            };
            let placement = crate::parallel::RankLayout {
                comm: setup.comm,
                local_world_size: setup.local_world_size,
                // Deferred weight gradients arrive outside autograd, where the unused-parameter
                // check's hooks would not see them.
                data_parallel: crate::parallel::DataParallelOptions {
                    find_unused_parameters: setup.data_parallel.find_unused_parameters || zero_bubble,
                    ..setup.data_parallel
                },
                stage: true,
                optimizer_bytes_per_element: setup.optimizer.state_bytes_per_element(),
                non_model: None,
                shard_floor: None,
            };
            let mut engine = crate::parallel::build_engine(spec, setup.engine.clone(), &strategy, &placement)?;
            let optimizer = Optimizer::new(&mut engine, setup.optimizer.clone(), &[])?;
            chunks.push(Chunk { stage, engine, optimizer, weight_grads: WeightGrads::new() });
        }
        // Groups: every rank creates every one, in one order.
        let link = |comm: &Comm, from: usize, to: usize| -> Result<Option<Link>> {
            let group = comm.new_group(&[from, to])?;
            Ok(group.map(|g| {
                let group: Arc<dyn ProcessGroup> = Arc::from(g);
                let peer = 1 - group.rank();
                Link { group, peer }
            }))
        };
        let (mut activations_in, mut activations_out, mut grads_in, mut grads_out) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut links: HashMap<(usize, bool), Link> = HashMap::new();
        let mut ties = Vec::new();
        let (mut stages_group, mut world_group) = (None, None);
        if let Some(comm) = setup.comm.filter(|_| world > 1) {
            for ranks in &pipelines {
                for s in 0..total - 1 {
                    let (from, to) = (ranks[s % p], ranks[(s + 1) % p]);
                    if from == to {
                        continue;
                    }
                    // One group per stage boundary and direction: activations, then gradients.
                    if let Some(l) = link(comm, from, to)? {
                        links.insert((s, false), l);
                    }
                    if let Some(l) = link(comm, to, from)? {
                        links.insert((s, true), l);
                    }
                }
                for (param, stages) in &tied {
                    let mut holders: Vec<usize> = stages.iter().map(|s| ranks[s % p]).collect();
                    holders.dedup();
                    if holders.len() < 2 {
                        continue;
                    }
                    if let Some(group) = comm.new_group(&holders)? {
                        ties.push(Tie { param: *param, group: Some(Arc::from(group)) });
                    }
                }
                if let Some(g) = comm.new_group(ranks)? {
                    stages_group = Some(Arc::<dyn ProcessGroup>::from(g));
                }
            }
            if pipelines.len() > 1 {
                world_group = Some(Arc::<dyn ProcessGroup>::from(comm.world()?));
            }
        }
        for c in &chunks {
            let s = c.stage;
            activations_in.push(if s > 0 { links.remove(&(s - 1, false)) } else { None });
            grads_out.push(if s > 0 { links.remove(&(s - 1, true)) } else { None });
            activations_out.push(if s + 1 < total { links.remove(&(s, false)) } else { None });
            grads_in.push(if s + 1 < total { links.remove(&(s, true)) } else { None });
        }
        // The last stage's loss: vocabulary-parallel where its units are split.
        let loss_func = match chunks.iter().find(|c| c.stage == total - 1) {
            Some(c) => next_token_loss_of(&c.engine),
            None => next_token_loss(),
        };
        Ok(PipelineTrainer {
            chunks,
            kind: config.schedule,
            defer_weight_grads: config.schedule.splits_backward(),
            pipeline,
            rank,
            ops,
            last_backward,
            activations_in,
            activations_out,
            grads_in,
            grads_out,
            ties,
            params,
            layout,
            ranges,
            stages_group,
            world_group,
            schedule: setup.schedule,
            grad_clip: setup.grad_clip,
            scaling: setup.strategy.grad_scaling()?,
            prepare_input: token_input(),
            loss_func,
            step: 0,
            events: None,
        })
    }

    /// The engines of the chunks this rank holds, in chunk order.
    pub fn engines(&mut self) -> impl Iterator<Item = &mut Engine> {
        self.chunks.iter_mut().map(|c| &mut c.engine)
    }

    fn last_stage(&self) -> usize {
        self.pipeline.total_stages() - 1
    }

    /// Reports every operation and every unit's events to `sink`, units numbered as in the
    /// whole model.
    pub fn set_event_sink(&mut self, sink: Arc<dyn EventSink>) {
        for c in &mut self.chunks {
            let first_unit = self.ranges[c.stage].0;
            c.engine.set_event_sink(Arc::new(WholeModelUnits { first_unit, sink: sink.clone() }));
        }
        self.events = Some(sink);
    }

    /// The memory ledgers of this rank's chunks.
    pub fn ledgers(&self) -> Vec<Arc<crate::engine::MemoryLedger>> {
        self.chunks.iter().map(|c| c.engine.ledger().clone()).collect()
    }

    /// The stages' unit ranges `[start, end)`, in stage order.
    pub fn ranges(&self) -> &[(usize, usize)] {
        &self.ranges
    }

    /// The pipeline's shape: ranks, micro-batches, chunks per rank.
    pub fn pipeline(&self) -> Pipeline {
        self.pipeline
    }

    /// One optimizer step over `step`'s micro-batches, as the schedule orders them.
    pub fn train_step(&mut self, step: &Step) -> Result<StepReport> {
        let start = Instant::now();
        let factor = self.schedule.factor(self.step);
        for c in &mut self.chunks {
            c.optimizer.set_lr_factor(factor)?;
        }
        crate::engine::memory::reset_allocator_peak(self.chunks[0].engine.config().device);
        let outcome = self.run_ops(step)?;
        for c in &mut self.chunks {
            c.engine.finish_grads()?;
        }
        self.update(step, outcome, start)
    }

    /// Runs this rank's operations on `step`'s micro-batches: forwards and backwards, their
    /// sends and receives; gradients accumulate, nothing is updated.
    fn run_ops(&mut self, step: &Step) -> Result<OpsOutcome> {
        let start = Instant::now();
        let m = step.micro_batches.len();
        if m != self.pipeline.micro_batches {
            return Err(Error::Config(format!(
                "pipeline: a step of {m} micro-batches, the schedule runs {}",
                self.pipeline.micro_batches
            )));
        }
        let ops = self.ops.clone();
        let device = self.chunks[0].engine.config().device;
        let last = self.last_stage();
        let mut received: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut outputs: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut input_grads: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut sending: Vec<Work> = Vec::new();
        let mut sent: Vec<SentOutput> = Vec::new();
        let mut outputs_freed = 0;
        let mut weighted_loss = 0.0;
        let scale = self.scaling.scale();
        // Busy seconds in compute operations, and forward records held (now and at most).
        let (mut busy, mut held, mut most_held) = (0.0, 0u64, 0u64);
        // Seconds and counts of forwards, backwards and weight gradients.
        let (mut op_seconds, mut op_counts) = ([0.0f64; 3], [0u32; 3]);
        let missing = |what: &str, micro: usize, chunk: usize| {
            Error::Engine(format!("pipeline: no {what} for micro-batch {micro} of chunk {chunk}"))
        };
        for &op in ops.iter() {
            // Sent outputs whose sends have completed give their values back; so does the
            // output this op's backward is for, whatever the send's thread has marked: its
            // gradient came back, so the peer has it, and the wait costs nothing.
            let backward_of = match op {
                Op::Backward { micro, chunk } | Op::BackwardInput { micro, chunk } => Some((micro, chunk)),
                _ => None,
            };
            let (done, waiting): (Vec<SentOutput>, Vec<SentOutput>) = sent
                .drain(..)
                .partition(|s| backward_of == Some((s.micro, s.chunk)) || s.works.iter().all(Work::is_completed));
            sent = waiting;
            for s in done {
                for work in &s.works {
                    work.wait()?;
                }
                outputs_freed += self.chunks[s.chunk].engine.free_output_values(s.micro)? as u64;
            }
            let began = Instant::now();
            let compute_kind = match op {
                Op::Forward { .. } => Some(0),
                Op::Backward { .. } | Op::BackwardInput { .. } => Some(1),
                Op::BackwardWeight { .. } => Some(2),
                _ => None,
            };
            match op {
                Op::RecvActivation { micro, chunk } => {
                    let link =
                        self.activations_in[chunk].as_ref().ok_or_else(|| missing("input link", micro, chunk))?;
                    received.insert((micro, chunk), link.recv(device)?.f_set_requires_grad(true)?);
                }
                Op::Forward { micro, chunk } => {
                    let batch = &step.micro_batches[micro];
                    let stage = self.chunks[chunk].stage;
                    let input = match stage {
                        0 => (self.prepare_input)(batch)?,
                        _ => received.remove(&(micro, chunk)).ok_or_else(|| missing("activation", micro, chunk))?,
                    };
                    let out = self.in_chunk(chunk, micro, |engine| {
                        engine.set_layout(batch.layout.as_ref());
                        engine.forward_micro(micro, &input)
                    })?;
                    let kept = if stage == last {
                        // Weighted by the micro-batch's share of the global batch's
                        // supervised tokens, as one process weighs it, times the loss scale.
                        let loss = self.chunks[chunk].engine.compute_loss(|| (self.loss_func)(&out, batch))?;
                        let weight = step.loss_weight(micro);
                        if weight > 0.0 {
                            weighted_loss += loss.f_double_value(&[])? * weight;
                        }
                        loss.f_mul_scalar(scale * weight)?
                    } else {
                        out
                    };
                    outputs.insert((micro, chunk), kept);
                }
                Op::SendActivation { micro, chunk } => {
                    let out = outputs.get(&(micro, chunk)).ok_or_else(|| missing("output", micro, chunk))?;
                    let link =
                        self.activations_out[chunk].as_ref().ok_or_else(|| missing("output link", micro, chunk))?;
                    let works = link.send(out)?;
                    sent.push(SentOutput { works: works.clone(), micro, chunk });
                    sending.extend(works);
                }
                Op::RecvGrad { micro, chunk } => {
                    let link = self.grads_in[chunk].as_ref().ok_or_else(|| missing("gradient link", micro, chunk))?;
                    received.insert((micro, chunk), link.recv(device)?);
                }
                Op::Backward { micro, chunk } | Op::BackwardInput { micro, chunk } => {
                    let kept = outputs.remove(&(micro, chunk)).ok_or_else(|| missing("output", micro, chunk))?;
                    // Under the zero-bubble schedule the weight gradients complete later.
                    let completes = !self.kind.splits_backward() && self.last_backward.contains(&(micro, chunk));
                    self.chunks[chunk].engine.set_grad_sync(completes);
                    let grad = if self.chunks[chunk].stage == last {
                        self.in_chunk(chunk, micro, |engine| engine.backward_micro(micro, Upstream::Loss(&kept)))?
                    } else {
                        let g = received.remove(&(micro, chunk)).ok_or_else(|| missing("gradient", micro, chunk))?;
                        self.in_chunk(chunk, micro, |engine| engine.backward_micro(micro, Upstream::Grad(&g)))?
                    };
                    if let Some(g) = grad {
                        input_grads.insert((micro, chunk), g);
                    }
                }
                Op::SendGrad { micro, chunk } => {
                    let g =
                        input_grads.remove(&(micro, chunk)).ok_or_else(|| missing("input gradient", micro, chunk))?;
                    let link = self.grads_out[chunk].as_ref().ok_or_else(|| missing("gradient link", micro, chunk))?;
                    sending.extend(link.send(&g)?);
                }
                Op::BackwardWeight { micro, chunk } if !self.last_backward.contains(&(micro, chunk)) => {
                    self.chunks[chunk].weight_grads.run(micro)?;
                }
                Op::BackwardWeight { micro, chunk } => {
                    // The chunk's gradients complete here: each unit's reduction starts as
                    // soon as no weight gradient left adds to it, beside those still to come.
                    let Chunk { engine, weight_grads, .. } = &mut self.chunks[chunk];
                    let weights = weight_grads.weights(micro)?;
                    let units = weights.iter().map(|w| engine.unit_holding(w)).collect::<Result<Vec<_>>>()?;
                    let complete = complete_from(&units);
                    let mut unsynced = engine.spec().units.len();
                    weight_grads.run_each(micro, |i| {
                        // A gradient queued after the weights were read reaches every unit.
                        while unsynced > complete.get(i).copied().unwrap_or(unsynced) {
                            unsynced -= 1;
                            engine.sync_unit_grads_now(unsynced)?;
                        }
                        Ok(())
                    })?;
                    while unsynced > 0 {
                        unsynced -= 1;
                        engine.sync_unit_grads_now(unsynced)?;
                    }
                }
            }
            match op {
                Op::Forward { .. } => held += 1,
                Op::Backward { .. } | Op::BackwardInput { .. } => held -= 1,
                _ => {}
            }
            most_held = most_held.max(held);
            if let Some(k) = compute_kind {
                let seconds = began.elapsed().as_secs_f64();
                busy += seconds;
                op_seconds[k] += seconds;
                op_counts[k] += 1;
            }
            if let Some(sink) = &self.events {
                let (name, micro, chunk) = op.parts();
                sink.record(Event::Operation { name, micro, chunk, began });
            }
        }
        for w in sending {
            w.wait()?;
        }
        let mean_op_seconds = std::array::from_fn(|k| op_seconds[k] / f64::from(op_counts[k].max(1)));
        Ok(OpsOutcome {
            weighted_loss,
            busy,
            span: start.elapsed().as_secs_f64(),
            mean_op_seconds,
            most_held,
            outputs_freed,
        })
    }

    /// Each unit's forward and backward seconds over `step`'s micro-batches, timed after a
    /// warm-up pass (the same on every rank: the slowest replica's) and the bytes of its model states as one rank of
    /// its tensor group holds them unsharded. The step's gradients are discarded and nothing
    /// is updated; the trainer is used up, as its engines now report to a clock.
    pub fn measure_units(mut self, step: &Step) -> Result<Vec<UnitCost>> {
        let device = self.chunks[0].engine.config().device;
        let clocks: Vec<Arc<UnitClock>> =
            self.chunks.iter().map(|_| Arc::new(UnitClock::measuring_memory(device))).collect();
        for (c, clock) in self.chunks.iter_mut().zip(&clocks) {
            c.engine.set_event_sink(clock.clone());
        }
        // A unit's clock times its forward and backward: deferred weight gradients would run
        // outside both, so the measuring passes compute them in the backward.
        self.defer_weight_grads = false;
        // The first pass pays one-time costs (allocations, lazy initialisation): the second
        // is timed.
        for _ in 0..2 {
            for clock in &clocks {
                clock.take();
            }
            self.run_ops(step)?;
            for c in &mut self.chunks {
                c.engine.finish_grads()?;
                c.engine.end_step()?;
                c.engine.zero_grad()?;
            }
        }
        let units = self.layout.unit_numel.len();
        let mut seconds = vec![0.0; units];
        let mut bytes = vec![0.0; units];
        let mut activations = vec![0.0; units];
        for (c, clock) in self.chunks.iter_mut().zip(&clocks) {
            let first = self.ranges[c.stage].0;
            for t in clock.take() {
                seconds[first + t.unit] += t.forward_s + t.backward_s;
                activations[first + t.unit] = t.kept_bytes.unwrap_or(0) as f64;
            }
            // Parameters and gradients, and each optimizer state, in the master dtype.
            let per_element = c.engine.master_kind().elt_size_in_bytes() * (2 + c.optimizer.state_names().len());
            for (k, s) in c.engine.storage().iter().enumerate() {
                bytes[first + k] = (s.numel as usize * per_element) as f64;
            }
        }
        // Each stage measured its own units: summed over the pipeline, the slowest replica's.
        let whole = self.sum(&[seconds, bytes, activations].concat())?;
        let agreed = match &self.world_group {
            Some(g) => all_reduce_values(g.as_ref(), &whole, ReduceOp::Max)?,
            None => whole,
        };
        Ok((0..units)
            .map(|k| UnitCost {
                seconds: agreed[k],
                bytes: agreed[units + k] as u64,
                activation_bytes: agreed[2 * units + k] as u64,
            })
            .collect())
    }

    /// The most micro-batches each stage holds at once under this trainer's schedule.
    pub fn most_held(&self) -> Result<Vec<u64>> {
        super::schedule::most_held(self.kind, self.pipeline)
    }

    /// The optimizer step after a step's operations: ties, clipping, update, report.
    fn update(&mut self, step: &Step, outcome: OpsOutcome, start: Instant) -> Result<StepReport> {
        let OpsOutcome { weighted_loss, busy, span: schedule_seconds, mean_op_seconds, most_held, outputs_freed } =
            outcome;
        let device = self.chunks[0].engine.config().device;
        self.sum_ties()?;
        let scale = self.scaling.scale();
        let (chunks, stages_group) = (&self.chunks, &self.stages_group);
        // The norm spans every stage: each rank's chunks, summed over the pipeline.
        let sq_norm = || -> Result<f64> {
            let mut local = 0.0;
            for c in chunks {
                local += c.engine.grad_sq_sum(&c.optimizer.grad_sq_per_unit()?)?;
            }
            Ok(match stages_group {
                Some(g) => all_reduce_values(g.as_ref(), &[local], ReduceOp::Sum)?[0],
                None => local,
            })
        };
        let decision = self.scaling.decide(self.grad_clip, scale, sq_norm)?;
        for c in &mut self.chunks {
            decision.apply(&mut c.engine, &mut c.optimizer, HostUpdating::Done(&Default::default()))?;
        }
        let GradDecision { grad_norm, skipped, .. } = decision;
        let ledger = self.chunks[0].engine.ledger().clone();
        let activations =
            crate::engine::memory::allocator_peak(device).unwrap_or(0).saturating_sub(ledger.model_state_peak());
        // The last stage computed the losses: every stage reports them, and its figures.
        let p = self.pipeline.stages;
        let mut mine = vec![0.0; 1 + 8 * p];
        mine[0] = weighted_loss;
        mine[1 + self.rank] = busy;
        mine[1 + p + self.rank] = most_held as f64;
        mine[1 + 2 * p + self.rank] = activations as f64;
        mine[1 + 3 * p + self.rank] = outputs_freed as f64;
        mine[1 + 4 * p + self.rank] = schedule_seconds;
        mine[1 + 5 * p + 3 * self.rank..][..3].copy_from_slice(&mean_op_seconds);
        let all = self.sum(&mine)?;
        // Each pipeline's loss, averaged over the data replicas.
        let loss = match &self.world_group {
            Some(g) => all_reduce_values(g.as_ref(), &[all[0]], ReduceOp::Avg)?[0],
            None => all[0],
        };
        let figures = PipelineFigures {
            // The ranks begin a step together: they leave the last step's reductions at once.
            bubble: super::schedule::idle_shares(&all[1..1 + p], &all[1 + 4 * p..1 + 5 * p]),
            micro_batches_held: all[1 + p..1 + 2 * p].iter().map(|&x| x as u64).collect(),
            activation_peak_bytes: all[1 + 2 * p..1 + 3 * p].iter().map(|&x| x as u64).collect(),
            outputs_freed: all[1 + 3 * p..1 + 4 * p].iter().map(|&x| x as u64).collect(),
            mean_op_seconds: all[1 + 5 * p..].chunks(3).map(|c| [c[0], c[1], c[2]]).collect(),
        };
        self.step += 1;
        let seconds = start.elapsed().as_secs_f64();
        let tokens: u64 = step.micro_batches.iter().map(|b| b.targets.numel() as u64).sum();
        Ok(StepReport {
            step: self.step,
            loss,
            supervised_tokens: step.global_supervised,
            lr: self.chunks[0].optimizer.lr(),
            grad_norm,
            tokens,
            seconds,
            tokens_per_s: tokens as f64 / seconds.max(1e-12),
            peak_bytes: ledger.peak_total(),
            loss_scale: self.scaling.scaler.as_ref().map(|_| scale),
            skipped,
            allocator_peak_bytes: crate::engine::memory::allocator_peak(device),
            model_state_peak_bytes: ledger.model_state_peak(),
            memory: ledger.report(),
            rss_peak_bytes: crate::engine::memory::process_peak_rss(),
            comm_wait_s: 0.0,
            transfers: Default::default(),
            unit_times: None,
            pipeline: Some(figures),
            val_loss: None,
            val_perplexity: None,
        })
    }

    /// The loss per learned token over `steps`, forward only (validation), the same on
    /// every rank: each micro-batch passes the stages in order, this rank's chunks in stage
    /// order, and the last stage's losses are shared and averaged over the data replicas.
    pub fn evaluate(&mut self, steps: &[Step]) -> Result<f64> {
        if steps.iter().all(|s| s.micro_batches.is_empty()) {
            return crate::train::token_mean(steps, &[]);
        }
        let device = self.chunks[0].engine.config().device;
        let last = self.last_stage();
        let mut losses = vec![];
        let mut sending: Vec<Work> = Vec::new();
        for batch in steps.iter().flat_map(|s| &s.micro_batches) {
            for chunk in 0..self.chunks.len() {
                let input = match &self.activations_in[chunk] {
                    Some(link) => link.recv(device)?,
                    None => (self.prepare_input)(batch)?,
                };
                self.chunks[chunk].engine.set_layout(batch.layout.as_ref());
                let out = self.chunks[chunk].engine.evaluate(&input)?;
                match &self.activations_out[chunk] {
                    Some(link) => sending.extend(link.send(&out)?),
                    None if self.chunks[chunk].stage == last => {
                        let engine = &self.chunks[chunk].engine;
                        losses.push(engine.compute_loss(|| (self.loss_func)(&out, batch))?.f_double_value(&[])?)
                    }
                    None => {}
                }
            }
        }
        for w in sending {
            w.wait()?;
        }
        // Only the last stage holds losses: the others add nothing to the sum.
        let mine = if losses.is_empty() { 0.0 } else { crate::train::token_mean(steps, &losses)? };
        let loss = self.sum(&[mine])?[0];
        match &self.world_group {
            Some(g) => Ok(all_reduce_values(g.as_ref(), &[loss], ReduceOp::Avg)?[0]),
            None => Ok(loss),
        }
    }

    /// Runs `f` on chunk `chunk`'s engine; under the zero-bubble schedule with micro-batch
    /// `micro`'s linear weight gradients deferred to its [`Op::BackwardWeight`].
    fn in_chunk<R>(&mut self, chunk: usize, micro: usize, f: impl FnOnce(&mut Engine) -> Result<R>) -> Result<R> {
        let c = &mut self.chunks[chunk];
        if self.defer_weight_grads {
            deferred::deferring(&c.weight_grads, micro, || f(&mut c.engine))
        } else {
            f(&mut c.engine)
        }
    }

    /// Sums `values` over the pipeline's stages.
    fn sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        match &self.stages_group {
            Some(g) => all_reduce_values(g.as_ref(), values, ReduceOp::Sum),
            None => Ok(values.to_vec()),
        }
    }

    /// Tied weights: every stage holding one adds the others' gradients to its own, so all
    /// copies take the same step.
    fn sum_ties(&mut self) -> Result<()> {
        for tie in &self.ties {
            let Some(group) = &tie.group else { continue };
            for c in &self.chunks {
                let p = c.engine.param(tie.param);
                if p.defined() && p.grad().defined() {
                    group.all_reduce(&p.grad(), ReduceOp::Sum)?.wait()?;
                }
            }
        }
        Ok(())
    }

    /// Steps completed so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// This rank's chunks as checkpoint parts: each engine, optimizer and first unit.
    fn parts(&mut self) -> Vec<crate::checkpoint::Part<'_>> {
        let ranges = &self.ranges;
        self.chunks
            .iter_mut()
            .map(|c| crate::checkpoint::Part {
                engine: &mut c.engine,
                optimizer: &mut c.optimizer,
                first_unit: ranges[c.stage].0,
            })
            .collect()
    }

    /// Saves a checkpoint of the whole model (every rank calls this; `world` is the group of
    /// all ranks): each stage writes its units, so any pipeline size can load it.
    pub fn save_checkpoint(
        &mut self,
        root: &std::path::Path,
        run: &crate::checkpoint::RunInfo,
        world: Option<&dyn ProcessGroup>,
        keep: usize,
    ) -> Result<std::path::PathBuf> {
        let layout = self.layout.clone();
        crate::checkpoint::save_parts(root, &layout, &mut self.parts(), run, world, keep)
    }

    /// Loads `checkpoint` (saved at any pipeline, tensor or data size) into this rank's stages.
    pub fn restore(&mut self, checkpoint: &crate::checkpoint::Checkpoint, optimizer_name: &str) -> Result<()> {
        let layout = self.layout.clone();
        checkpoint.restore_parts(&layout, &mut self.parts(), optimizer_name)?;
        self.step = checkpoint.meta.step;
        if let (Some(saved), Some(scaler)) = (&checkpoint.meta.loss_scaler, &mut self.scaling.scaler) {
            scaler.resume_from(saved)?;
        }
        Ok(())
    }

    /// Saves the whole model's parameters (fp32) under their names, unit by unit: the ranks
    /// of the stage that owns a unit gather it whole (from tensor pieces and shards), and its
    /// first rank in each pipeline hands it on. Every rank calls this; only `write` ones write.
    pub fn save_weights(&mut self, target: crate::io::WeightsTarget<'_>, write: bool) -> Result<()> {
        // Every stage's spec declares the whole model's adapters.
        let adapters = self.chunks.first().map(|c| c.engine.spec().adapters.clone()).unwrap_or_default();
        // The unit gathered last: (stage, unit in stage) and its whole flat values.
        let mut current: Option<((usize, usize), Tensor)> = None;
        let mut fetch = |i: usize| -> Result<Tensor> {
            let WholeParam { id, shape, stage, unit_in_stage, .. } = &self.params[i];
            let key = (*stage, *unit_in_stage);
            let chunk = self.chunks.iter_mut().find(|c| c.stage == *stage);
            let t = match chunk {
                Some(c) => {
                    if current.as_ref().map(|(k, _)| *k) != Some(key) {
                        current = Some((key, c.engine.full_unit(*unit_in_stage)?));
                    }
                    let (_, flat) = current.as_ref().expect("set above");
                    let numel = shape.iter().product::<i64>();
                    flat.f_narrow(0, c.engine.full_offset(*id), numel)?
                        .f_reshape(shape.as_slice())?
                        .f_to_kind(Kind::Float)?
                        .f_contiguous()?
                }
                None => Tensor::f_zeros(shape.as_slice(), (Kind::Float, tch::Device::Cpu))?,
            };
            if let Some(g) = &self.stages_group {
                g.broadcast(&t, stage % self.pipeline.stages)?.wait()?;
            }
            Ok(t)
        };
        if !write {
            for i in 0..self.params.len() {
                drop(fetch(i)?);
            }
            return Ok(());
        }
        let layout: Vec<(ParamId, String, Kind, Vec<i64>)> =
            self.params.iter().map(|p| (p.id, p.name.clone(), Kind::Float, p.shape.clone())).collect();
        crate::io::write_model_weights(target, &adapters, &layout, fetch)
    }
}

#[cfg(test)]
mod tests {
    use super::complete_from;

    #[test]
    fn a_unit_is_complete_once_no_weight_gradient_left_reaches_it() {
        // Units 3, 2, 1 in backward order, with a tied weight of unit 0 queued first.
        assert_eq!(complete_from(&[0, 3, 3, 2, 1, 1]), [4, 4, 4, 3, 2, 2]);
        assert_eq!(complete_from(&[3, 3, 2, 1]), [4, 4, 3, 2]);
        // Out of order: unit 2 waits for its last gradient behind unit 1's.
        assert_eq!(complete_from(&[2, 1, 2, 0]), [3, 3, 3, 1]);
        assert!(complete_from(&[]).is_empty());
    }
}
