//! Runs a rank's schedule as the [`StepExecutor`] of its [`Trainer`]: one model part per
//! chunk (virtual stage) it holds, activations and gradients between neighbouring stages
//! over one ordered group per direction, tied weights summed across the stages that hold
//! them, the gradient norm and the loss over every stage.
use super::partition::{self, UnitCost};
use super::schedule::{schedule, Op, Pipeline, ScheduleKind};
use crate::checkpoint::Layout;
use crate::comm::{all_reduce_values, Comm, ProcessGroup, ReduceOp, Work};
use crate::compute::deferred::{self, WeightGrads};
use crate::data::Step;
use crate::engine::{Engine, Event, EventSink, Holding, UnitClock, UnitTime, Upstream};
use crate::io::WeightsTarget;
use crate::model::{BalanceReport, DecodeCache, LoadBalance, ModelSpec, ParamId};
use crate::optim::Optimizer;
use crate::parallel::TrainerSetup;
use crate::strategy::{Balance, Dim, ShardMethod};
use crate::train::{
    Feed, InputFn, LossFn, LossWeights, ModelPart, PipelineFigures, StepExecutor, StepInput, StepReport, Trainer,
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

/// The routing a mixture of experts' part gathers for its load-balancing loss.
fn balance_of(part: &ModelPart) -> Option<Arc<LoadBalance>> {
    part.engine.spec().load_balance.clone()
}

/// What the executor keeps of each chunk (virtual stage) this rank holds, beside its
/// model part: its global stage, and the weight gradients its zero-bubble backward defers.
struct Chunk {
    stage: usize,
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

/// A pipeline rank's step executor: its chunks' schedule, links, ties and groups.
pub struct PipelineExecutor {
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
    /// The whole model's description and layout, as checkpoints describe it, and each
    /// stage's unit range.
    whole: ModelSpec,
    layout: Layout,
    ranges: Vec<(usize, usize)>,
    /// Every stage of this pipeline: losses and norms are summed over it.
    stages_group: Option<Arc<dyn ProcessGroup>>,
    /// Every rank, where several pipelines run (data replicas, tensor ranks): losses are
    /// averaged over it, measurements agreed.
    world_group: Option<Arc<dyn ProcessGroup>>,
    /// What the last step's operations measured, for its report.
    last_outcome: Option<OpsOutcome>,
    /// Told each operation as it ends.
    events: Option<Arc<dyn EventSink>>,
}

/// What running a step's operations measured.
struct OpsOutcome {
    /// The last stage's micro-batch losses, detached (none on other stages).
    losses: Vec<Tensor>,
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
    /// The last micro-batch's routing (a mixture of experts), on the last stage.
    routed: Option<BalanceReport>,
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

/// This rank's pipeline trainer: its chunks' parts under the schedule's executor, the
/// stages balanced by measured unit costs where the strategy asks for that and a first
/// step is given (the units are timed on a first build, then the parts are built again).
pub fn trainer(setup: &TrainerSetup<'_>) -> Result<Trainer> {
    if !setup.rules.is_empty() {
        return Err(Error::Config("a pipeline's optimizer takes no parameter groups".into()));
    }
    let config = setup.strategy.pipeline_parallel().unwrap_or_default();
    let mut built = PipelineExecutor::build(setup, None)?;
    if let (None, Balance::Measured, Some(first_step)) = (&config.stages, config.balance, setup.first_step) {
        let (executor, parts) = built;
        let (before, stages, ranks) = (executor.ranges.clone(), executor.ranges.len(), executor.pipeline.stages);
        let held = executor.most_held()?;
        let costs = executor.measure_units(parts, first_step()?, &setup.feed)?;
        let split = partition::balance(&costs, stages, ranks, setup.engine.device_budget, &held)?;
        if setup.comm.is_none_or(|c| c.rank() == 0) {
            let ms: Vec<String> = costs.iter().map(|c| format!("{:.1}", c.seconds * 1e3)).collect();
            let kept: Vec<String> = costs.iter().map(|c| crate::profile::human_bytes(c.activation_bytes)).collect();
            tracing::info!(
                by_parameters = ?before,
                measured = ?split,
                unit_ms = ms.join(" "),
                unit_activations = kept.join(", "),
                "balanced the stages"
            );
        }
        built = PipelineExecutor::build(setup, Some(split))?;
    }
    let (executor, parts) = built;
    let mut trainer = Trainer::over_parts(parts, Box::new(executor), setup.schedule.clone(), setup.grad_clip)?;
    trainer.scaling = setup.strategy.grad_scaling()?;
    trainer.set_feed(&setup.feed);
    Ok(trainer)
}

impl PipelineExecutor {
    /// The executor and this rank's parts for `setup`, its stages split as `split` says
    /// (a balance of measured costs), or else as the strategy says or by parameter count.
    pub fn build(
        setup: &TrainerSetup<'_>,
        split: Option<Vec<(usize, usize)>>,
    ) -> Result<(PipelineExecutor, Vec<ModelPart>)> {
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
        let ranges = match &split {
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
        let layout = crate::checkpoint::Layout::of_spec(&whole, Holding::tensor(mesh.size(Dim::Tensor) as i64));
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
        let (mut chunks, mut parts) = (Vec::with_capacity(v), Vec::with_capacity(v));
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
            let mut placement = setup.rank_layout(true);
            // Deferred weight gradients arrive outside autograd, where the unused-parameter
            // check's hooks would not see them.
            placement.data_parallel.find_unused_parameters |= zero_bubble;
            let mut engine = crate::parallel::build_engine(spec, setup.engine.clone(), &strategy, &placement)?;
            let optimizer = Optimizer::new(&mut engine, setup.optimizer.clone(), &[])?;
            parts.push(ModelPart { engine, optimizer, first_unit: start });
            chunks.push(Chunk { stage, weight_grads: WeightGrads::new() });
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
        let executor = PipelineExecutor {
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
            whole,
            layout,
            ranges,
            stages_group,
            world_group,
            last_outcome: None,
            events: None,
        };
        Ok((executor, parts))
    }

    fn last_stage(&self) -> usize {
        self.pipeline.total_stages() - 1
    }

    /// The stages' unit ranges `[start, end)`, in stage order.
    pub fn ranges(&self) -> &[(usize, usize)] {
        &self.ranges
    }

    /// Runs this rank's operations on `input`'s micro-batches over `parts`: forwards and
    /// backwards, their sends and receives; gradients accumulate, nothing is updated.
    fn run_ops(&mut self, parts: &mut [ModelPart], input: &StepInput<'_>) -> Result<OpsOutcome> {
        let start = Instant::now();
        let m = input.batches.len();
        if m != self.pipeline.micro_batches {
            return Err(Error::Config(format!(
                "pipeline: a step of {m} micro-batches, the schedule runs {}",
                self.pipeline.micro_batches
            )));
        }
        let ops = self.ops.clone();
        let device = parts[0].engine.config().device;
        let last = self.last_stage();
        let mut received: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut outputs: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut input_grads: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut sending: Vec<Work> = Vec::new();
        let mut sent: Vec<SentOutput> = Vec::new();
        let mut outputs_freed = 0;
        let mut losses: Vec<Option<Tensor>> = (0..m).map(|_| None).collect();
        // A mixture of experts' routing sums travel with the activations, the gradient of
        // the load-balancing loss with the activations' gradients (LoadBalance).
        let mut sums_in: HashMap<(usize, usize), Vec<f64>> = HashMap::new();
        let mut sums_out: HashMap<(usize, usize), Vec<f64>> = HashMap::new();
        let mut routed = None;
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
                outputs_freed += parts[s.chunk].engine.free_output_values(s.micro)? as u64;
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
                    if balance_of(&parts[chunk]).is_some() {
                        sums_in.insert((micro, chunk), Vec::<f64>::try_from(&link.recv(tch::Device::Cpu)?)?);
                    }
                }
                Op::Forward { micro, chunk } => {
                    let batch = &input.batches[micro];
                    let stage = self.chunks[chunk].stage;
                    let values = match stage {
                        0 => (input.input)(batch)?,
                        _ => received.remove(&(micro, chunk)).ok_or_else(|| missing("activation", micro, chunk))?,
                    };
                    let dropout = input.dropout(batch);
                    let out = self.in_chunk(&mut parts[chunk], chunk, micro, |engine| {
                        crate::train::set_rows(engine, batch, Some(dropout));
                        engine.forward_micro(micro, &values)
                    })?;
                    let balance = balance_of(&parts[chunk]);
                    if let (Some(balance), false) = (&balance, stage == last) {
                        if let Some(earlier) = sums_in.remove(&(micro, chunk)) {
                            balance.receive_sums(micro, earlier)?;
                        }
                        sums_out.insert((micro, chunk), balance.sums(micro)?);
                    }
                    let kept = if stage == last {
                        let engine = &mut parts[chunk].engine;
                        // A mixture of experts trains its routers through the load-balancing
                        // loss too, closed here over every stage's routing.
                        if balance.is_some() {
                            engine.close_routing(micro, sums_in.remove(&(micro, chunk)))?;
                        }
                        let loss = crate::train::training_loss(engine, input.loss, &out, batch)?;
                        if let Some(r) = engine.routed() {
                            routed = Some(r.report);
                        }
                        losses[micro] = Some(loss.f_detach()?);
                        // Weighted by the micro-batch's share of the global batch's
                        // supervised tokens, as one process weighs it, times the loss scale.
                        input.weights.weigh(micro, &loss, input.scale)?
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
                    if let Some(sums) = sums_out.remove(&(micro, chunk)) {
                        sending.extend(link.send(&Tensor::f_from_slice(&sums)?)?);
                    }
                }
                Op::RecvGrad { micro, chunk } => {
                    let link = self.grads_in[chunk].as_ref().ok_or_else(|| missing("gradient link", micro, chunk))?;
                    received.insert((micro, chunk), link.recv(device)?);
                    if let Some(balance) = balance_of(&parts[chunk]).filter(|b| b.adds_loss()) {
                        balance.receive_gradient(micro, link.recv(tch::Device::Cpu)?);
                    }
                }
                Op::Backward { micro, chunk } | Op::BackwardInput { micro, chunk } => {
                    let kept = outputs.remove(&(micro, chunk)).ok_or_else(|| missing("output", micro, chunk))?;
                    // Under the zero-bubble schedule the weight gradients complete later.
                    let completes = !self.kind.splits_backward() && self.last_backward.contains(&(micro, chunk));
                    parts[chunk].engine.set_grad_sync(completes);
                    let part = &mut parts[chunk];
                    let grad = if self.chunks[chunk].stage == last {
                        self.in_chunk(part, chunk, micro, |engine| engine.backward_micro(micro, Upstream::Loss(&kept)))?
                    } else {
                        let g = received.remove(&(micro, chunk)).ok_or_else(|| missing("gradient", micro, chunk))?;
                        self.in_chunk(part, chunk, micro, |engine| engine.backward_micro(micro, Upstream::Grad(&g)))?
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
                    if let Some(balance) = balance_of(&parts[chunk]).filter(|b| b.adds_loss()) {
                        sending.extend(link.send(&balance.gradient(micro)?)?);
                    }
                }
                Op::BackwardWeight { micro, chunk } if !self.last_backward.contains(&(micro, chunk)) => {
                    self.chunks[chunk].weight_grads.run(micro)?;
                }
                Op::BackwardWeight { micro, chunk } => {
                    // The chunk's gradients complete here: each unit's reduction starts as
                    // soon as no weight gradient left adds to it, beside those still to come.
                    let (engine, weight_grads) = (&mut parts[chunk].engine, &self.chunks[chunk].weight_grads);
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
            losses: losses.into_iter().flatten().collect(),
            busy,
            span: start.elapsed().as_secs_f64(),
            mean_op_seconds,
            most_held,
            outputs_freed,
            routed,
        })
    }

    /// Each unit's forward and backward seconds over `step`'s micro-batches, timed after a
    /// warm-up pass (the same on every rank: the slowest replica's) and the bytes of its model states as one rank of
    /// its tensor group holds them unsharded. The step's gradients are discarded and nothing
    /// is updated; the executor and its `parts` are used up, as their engines now report to
    /// a clock. `feed` feeds and scores the model as the run will.
    pub fn measure_units(mut self, mut parts: Vec<ModelPart>, step: &Step, feed: &Feed) -> Result<Vec<UnitCost>> {
        let device = parts[0].engine.config().device;
        let clocks: Vec<Arc<UnitClock>> = parts.iter().map(|_| Arc::new(UnitClock::measuring_memory(device))).collect();
        for (part, clock) in parts.iter_mut().zip(&clocks) {
            part.engine.set_event_sink(clock.clone());
        }
        let loss = match self.scoring_part() {
            Some(k) => feed.loss_of(&parts[k].engine),
            None => crate::train::next_token_loss(),
        };
        // A unit's clock times its forward and backward: deferred weight gradients would run
        // outside both, so the measuring passes compute them in the backward.
        self.defer_weight_grads = false;
        // The first pass pays one-time costs (allocations, lazy initialisation): the second
        // is timed.
        for _ in 0..2 {
            for clock in &clocks {
                clock.take();
            }
            let input = StepInput {
                batches: &step.micro_batches,
                weights: LossWeights::Host(step),
                scale: 1.0,
                input: &feed.input,
                loss: &loss,
                number: 0,
                grad_ready: None,
                dropout_seed: 0,
            };
            self.run_ops(&mut parts, &input)?;
            for part in &mut parts {
                part.engine.finish_grads()?;
                part.engine.end_step()?;
                part.engine.zero_grad()?;
            }
        }
        let units = self.layout.unit_numel.len();
        let mut seconds = vec![0.0; units];
        let mut bytes = vec![0.0; units];
        let mut activations = vec![0.0; units];
        for (part, clock) in parts.iter().zip(&clocks) {
            let first = part.first_unit;
            for t in clock.take() {
                seconds[first + t.unit] += t.forward_s + t.backward_s;
                activations[first + t.unit] = t.kept_bytes.unwrap_or(0) as f64;
            }
            // Parameters and gradients, and each optimizer state, in the master dtype.
            let (engine, optimizer) = (&part.engine, &part.optimizer);
            let per_element = engine.master_kind().elt_size_in_bytes() * (2 + optimizer.state_names().len());
            for (k, s) in engine.storage().iter().enumerate() {
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

    /// Runs `f` on chunk `chunk`'s engine; under the zero-bubble schedule with micro-batch
    /// `micro`'s linear weight gradients deferred to its [`Op::BackwardWeight`].
    fn in_chunk<R>(
        &self,
        part: &mut ModelPart,
        chunk: usize,
        micro: usize,
        f: impl FnOnce(&mut Engine) -> Result<R>,
    ) -> Result<R> {
        if self.defer_weight_grads {
            deferred::deferring(&self.chunks[chunk].weight_grads, micro, || f(&mut part.engine))
        } else {
            f(&mut part.engine)
        }
    }

    /// Sums `values` over the pipeline's stages.
    fn sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        match &self.stages_group {
            Some(g) => all_reduce_values(g.as_ref(), values, ReduceOp::Sum),
            None => Ok(values.to_vec()),
        }
    }

    /// The loss of every pipeline, averaged over the data replicas.
    fn averaged(&self, loss: f64) -> Result<f64> {
        match &self.world_group {
            Some(g) => Ok(all_reduce_values(g.as_ref(), &[loss], ReduceOp::Avg)?[0]),
            None => Ok(loss),
        }
    }

    /// Tied weights: every stage holding one adds the others' gradients to its own, so all
    /// copies take the same step.
    fn sum_ties(&self, parts: &[ModelPart]) -> Result<()> {
        for tie in &self.ties {
            let Some(group) = &tie.group else { continue };
            for part in parts {
                let p = part.engine.param(tie.param);
                if p.defined() && p.grad().defined() {
                    group.all_reduce(&p.grad(), ReduceOp::Sum)?.wait()?;
                }
            }
        }
        Ok(())
    }
}

impl StepExecutor for PipelineExecutor {
    fn forward_backward(&mut self, parts: &mut [ModelPart], input: StepInput<'_>) -> Result<Vec<Tensor>> {
        let mut outcome = self.run_ops(parts, &input)?;
        for part in parts.iter_mut() {
            // Later forwards of the engine (a caller's own) are not this step's.
            part.engine.set_dropout(None);
            part.engine.finish_grads()?;
        }
        self.sum_ties(parts)?;
        let losses = std::mem::take(&mut outcome.losses);
        self.last_outcome = Some(outcome);
        Ok(losses)
    }

    /// Each rank's chunks, summed over the pipeline's stages.
    fn whole_model_sum(&self, local: f64) -> Result<f64> {
        Ok(self.sum(&[local])?[0])
    }

    fn grad_norm_is_local(&self, _: &[ModelPart]) -> bool {
        false
    }

    fn updates_in_backward(&self) -> bool {
        false
    }

    /// The last stage computed the losses: every stage reports them, averaged over the data
    /// replicas, and every rank's figures.
    fn complete_report(&mut self, parts: &[ModelPart], local_loss: Option<f64>, report: &mut StepReport) -> Result<()> {
        let OpsOutcome { busy, span, mean_op_seconds, most_held, outputs_freed, routed, .. } =
            self.last_outcome.take().ok_or_else(|| Error::Engine("pipeline: a report of no step".into()))?;
        let device = parts[0].engine.config().device;
        let activations = crate::engine::memory::allocator_peak(device)
            .unwrap_or(0)
            .saturating_sub(parts[0].engine.ledger().model_state_peak());
        let p = self.pipeline.stages;
        // Past the figures of every stage: the last stage's routing, where there is one.
        let mut mine = vec![0.0; 1 + 8 * p + 7];
        mine[0] = local_loss.unwrap_or(0.0);
        if let Some(r) = routed {
            let counts = [r.min_expert_tokens, r.max_expert_tokens, r.remote_expert_tokens, r.dropped_expert_tokens]
                .map(|c| c as f64);
            let figures = [1.0, r.aux_loss, r.z_loss, counts[0], counts[1], counts[2], counts[3]];
            mine[1 + 8 * p..].copy_from_slice(&figures);
        }
        mine[1 + self.rank] = busy;
        mine[1 + p + self.rank] = most_held as f64;
        mine[1 + 2 * p + self.rank] = activations as f64;
        mine[1 + 3 * p + self.rank] = outputs_freed as f64;
        mine[1 + 4 * p + self.rank] = span;
        mine[1 + 5 * p + 3 * self.rank..][..3].copy_from_slice(&mean_op_seconds);
        let all = self.sum(&mine)?;
        report.loss = self.averaged(all[0])?;
        report.pipeline = Some(PipelineFigures {
            // The ranks begin a step together: they leave the last step's reductions at once.
            bubble: super::schedule::idle_shares(&all[1..1 + p], &all[1 + 4 * p..1 + 5 * p]),
            micro_batches_held: all[1 + p..1 + 2 * p].iter().map(|&x| x as u64).collect(),
            activation_peak_bytes: all[1 + 2 * p..1 + 3 * p].iter().map(|&x| x as u64).collect(),
            outputs_freed: all[1 + 3 * p..1 + 4 * p].iter().map(|&x| x as u64).collect(),
            mean_op_seconds: all[1 + 5 * p..1 + 8 * p].chunks(3).map(|c| [c[0], c[1], c[2]]).collect(),
        });
        // Summed over the stages, of which the last alone reported it.
        let routing = &all[1 + 8 * p..];
        if routing[0] > 0.0 {
            let count = |i: usize| (routing[i] / routing[0]) as i64;
            report.experts = Some(BalanceReport {
                aux_loss: routing[1] / routing[0],
                z_loss: routing[2] / routing[0],
                min_expert_tokens: count(3),
                max_expert_tokens: count(4),
                remote_expert_tokens: count(5),
                dropped_expert_tokens: count(6),
            });
        }
        Ok(())
    }

    /// The same on every rank: each micro-batch passes the stages in order, this rank's
    /// chunks in stage order, and the last stage's losses are shared and averaged over the
    /// data replicas.
    fn evaluate(&mut self, parts: &mut [ModelPart], steps: &[Step], input: &InputFn, loss: &LossFn) -> Result<f64> {
        if steps.iter().all(|s| s.micro_batches.is_empty()) {
            return crate::train::token_mean(steps, &[]);
        }
        let device = parts[0].engine.config().device;
        let last = self.last_stage();
        let mut losses = vec![];
        let mut sending: Vec<Work> = Vec::new();
        for batch in steps.iter().flat_map(|s| &s.micro_batches) {
            for (chunk, part) in parts.iter_mut().enumerate() {
                let values = match &self.activations_in[chunk] {
                    Some(link) => link.recv(device)?,
                    None => input(batch)?,
                };
                crate::train::set_rows(&mut part.engine, batch, None);
                let out = part.engine.evaluate(&values)?;
                match &self.activations_out[chunk] {
                    Some(link) => sending.extend(link.send(&out)?),
                    None if self.chunks[chunk].stage == last => {
                        losses.push(part.engine.compute_loss(|| loss(&out, batch))?.f_double_value(&[])?)
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
        self.averaged(loss)
    }

    /// Each chunk decodes its units in turn, as [`StepExecutor::evaluate`] runs them: its
    /// input from the previous stage (the token ids on the first), its output to the next;
    /// the last stage's are the logits.
    fn decode(
        &mut self,
        parts: &mut [ModelPart],
        tokens: &Tensor,
        cache: &mut [Vec<DecodeCache>],
    ) -> Result<Option<Tensor>> {
        if cache.len() != parts.len() {
            return Err(Error::Engine(format!("{} decode caches for {} pipeline chunks", cache.len(), parts.len())));
        }
        let device = parts[0].engine.config().device;
        let last = self.last_stage();
        let mut logits = None;
        let mut sending: Vec<Work> = Vec::new();
        for (chunk, (part, units)) in parts.iter_mut().zip(cache.iter_mut()).enumerate() {
            let values = match &self.activations_in[chunk] {
                Some(link) => link.recv(device)?,
                None => tokens.shallow_clone(),
            };
            let out = part.engine.decode(&values, units)?;
            match &self.activations_out[chunk] {
                Some(link) => sending.extend(link.send(&out)?),
                None if self.chunks[chunk].stage == last => logits = Some(out),
                None => {}
            }
        }
        for w in sending {
            w.wait()?;
        }
        Ok(logits)
    }

    /// The last stage's tokens, summed over the stages (the others give zeros).
    fn share_tokens(&self, chosen: Option<Vec<i64>>, rows: usize) -> Result<Vec<i64>> {
        let mine: Vec<f64> = match &chosen {
            Some(c) => c.iter().map(|&t| t as f64).collect(),
            None => vec![0.0; rows],
        };
        Ok(self.sum(&mine)?.into_iter().map(|t| t as i64).collect())
    }

    fn model_spec<'a>(&'a self, _: &'a [ModelPart]) -> &'a ModelSpec {
        &self.whole
    }

    fn layout(&self, parts: &[ModelPart]) -> Layout {
        // The stages' engines say whether their expert groups store experts apart.
        let holding = parts.first().and_then(|p| p.engine.holding().experts);
        Layout { expert_size: holding.map_or(1, |(size, _)| size as usize), ..self.layout.clone() }
    }

    /// Unit by unit: the ranks of the stage that owns a unit gather it whole (from tensor
    /// pieces and shards), and its first rank in each pipeline hands it on.
    fn save_weights(&mut self, parts: &mut [ModelPart], target: WeightsTarget<'_>, write: bool) -> Result<()> {
        // Every stage's spec declares the whole model's adapters.
        let adapters = parts[0].engine.spec().adapters.clone();
        // The unit gathered last: (stage, unit in stage) and its whole flat values.
        let mut current: Option<((usize, usize), Tensor)> = None;
        let chunks = &self.chunks;
        let mut fetch = |i: usize| -> Result<Tensor> {
            let WholeParam { id, shape, stage, unit_in_stage, .. } = &self.params[i];
            let key = (*stage, *unit_in_stage);
            let held = chunks.iter().position(|c| c.stage == *stage);
            let t = match held {
                Some(k) => {
                    let engine = &mut parts[k].engine;
                    if current.as_ref().map(|(k, _)| *k) != Some(key) {
                        current = Some((key, engine.full_unit(*unit_in_stage)?));
                    }
                    let (_, flat) = current.as_ref().expect("set above");
                    let numel = shape.iter().product::<i64>();
                    flat.f_narrow(0, engine.full_offset(*id), numel)?
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

    fn capture_obstacle(&self) -> Option<String> {
        Some("a pipeline schedules its stages' sends and receives from the host".into())
    }

    fn scoring_part(&self) -> Option<usize> {
        let last = self.last_stage();
        self.chunks.iter().position(|c| c.stage == last)
    }

    /// Each unit is timed on the rank of its stage: summed over the pipeline, every unit's.
    fn unit_times(&self, mine: Vec<UnitTime>) -> Result<Vec<UnitTime>> {
        let units = self.layout.unit_numel.len();
        let mut values = vec![0.0; 5 * units];
        for t in mine.iter().filter(|t| t.unit < units) {
            let k = 5 * t.unit;
            values[k..k + 5].copy_from_slice(&[
                t.forward_s,
                t.backward_s,
                t.comm_wait_s,
                t.kept_bytes.unwrap_or(0) as f64,
                t.kept_bytes.is_some() as u8 as f64,
            ]);
        }
        let all = self.sum(&values)?;
        Ok(all
            .chunks(5)
            .enumerate()
            .map(|(unit, v)| UnitTime {
                unit,
                forward_s: v[0],
                backward_s: v[1],
                comm_wait_s: v[2],
                kept_bytes: (v[4] > 0.0).then_some(v[3] as u64),
            })
            .collect())
    }

    fn set_event_sink(&mut self, sink: Arc<dyn EventSink>) {
        self.events = Some(sink);
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
