//! One optimizer step over a step's micro-batches: the loop body shared by `strata train`,
//! the benchmark and library users who do not want to write it themselves.
//!
//! Owns: the order forward → loss → backward per micro-batch, gradient clipping, the
//! schedule, the update and the per-step report. Must not own data loading or output.
use crate::compute::scaler::GradDecision;
pub use crate::compute::scaler::GradScaling;
use crate::data::{Batch, Step};
use crate::engine::memory::PlacementReport;
use crate::engine::{memory, Engine, Placement};
use crate::model::layers::cross_entropy;
use crate::optim::{LrSchedule, Optimizer};
use crate::Result;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;
use tch::Tensor;

/// What one step did, as written to `--metrics`.
#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub step: u64,
    /// Loss per supervised token of the step's global batch (this rank's share until the
    /// run averages it over the data ranks).
    pub loss: f64,
    /// Supervised tokens (targets that take a loss) in the step's global batch.
    pub supervised_tokens: u64,
    pub lr: f64,
    /// Global gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    pub tokens: u64,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// Peak bytes held by the engine and optimizer (all placements).
    pub peak_bytes: u64,
    /// The loss scale of this step (with a loss scaler).
    pub loss_scale: Option<f64>,
    /// Whether the update was skipped because gradients were not finite.
    pub skipped: bool,
    /// Peak bytes libtorch's allocator held during the step (activations inside units
    /// included), this rank; on the CPU once tracking is on.
    pub allocator_peak_bytes: Option<u64>,
    /// Peak bytes of parameters, gradients and optimizer state (model states), this rank.
    pub model_state_peak_bytes: u64,
    /// What the engine and optimizer hold now and at their peak, per placement and category.
    pub memory: BTreeMap<Placement, PlacementReport>,
    /// Peak resident memory of the whole process.
    pub rss_peak_bytes: Option<u64>,
    /// Seconds of this step the rank spent waiting for collectives to complete: the
    /// communication its computation did not hide.
    pub comm_wait_s: f64,
    /// Copies between device and host during this step (offload): bytes each way and the
    /// seconds spent waiting for them.
    pub transfers: crate::engine::memory::Transfers,
    /// Per unit: forward and backward seconds and communication waited for around them,
    /// when a [`crate::engine::UnitClock`] times the engine (filled in by its owner).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unit_times: Option<Vec<crate::engine::UnitTime>>,
    /// Per pipeline stage (rank), where a pipeline ran the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineFigures>,
    /// Loss per learned token of the validation batches, after steps where a validation ran (filled in
    /// by the training loop's owner).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// `exp(val_loss)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_perplexity: Option<f64>,
}

impl StepReport {
    /// Records a validation loss and its perplexity.
    pub fn set_validation(&mut self, loss: f64) {
        self.val_loss = Some(loss);
        self.val_perplexity = Some(loss.exp());
    }
}

/// What each pipeline rank measured in a step, in rank order.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PipelineFigures {
    /// The share of the step's schedule (as long as its slowest rank's) that the rank spent
    /// outside its compute operations.
    pub bubble: Vec<f64>,
    /// The most micro-batches whose forward records the rank held at once.
    pub micro_batches_held: Vec<u64>,
    /// The allocator's peak beyond model states: activations and temporaries.
    pub activation_peak_bytes: Vec<u64>,
    /// Stage outputs whose values the rank freed once sent, before their backward.
    pub outputs_freed: Vec<u64>,
    /// The rank's mean seconds of a forward, a backward (its input-gradient part under the
    /// zero-bubble schedule) and a deferred weight gradient (0 under other schedules).
    pub mean_op_seconds: Vec<[f64; 3]>,
}

/// The next-token loss per supervised token of `engine` over `steps`, forward only.
pub fn evaluate(engine: &mut Engine, steps: &[Step]) -> Result<f64> {
    let loss = next_token_loss_of(engine);
    evaluate_with(engine, steps, &token_input(), &loss)
}

fn evaluate_with(engine: &mut Engine, steps: &[Step], input: &InputFn, loss: &LossFn) -> Result<f64> {
    let mut losses = vec![];
    for batch in steps.iter().flat_map(|s| &s.micro_batches) {
        engine.set_layout(batch.layout.as_ref());
        let output = engine.evaluate(&input(batch)?)?;
        losses.push(engine.compute_loss(|| loss(&output, batch))?.f_double_value(&[])?);
    }
    token_mean(steps, &losses)
}

/// The token-weighted mean of `losses`, one mean loss per micro-batch of `steps` in order:
/// this rank's share, which averaged over the data ranks is the loss per supervised token
/// of all of `steps`' global batches. No micro-batch at all is an error (nothing was
/// evaluated); no supervised token gives 0.
pub(crate) fn token_mean(steps: &[Step], losses: &[f64]) -> Result<f64> {
    if losses.is_empty() {
        return Err(crate::Error::Data("no validation batches to evaluate".into()));
    }
    let total: u64 = steps.iter().map(|s| s.global_supervised).sum();
    // Each micro-batch's mean times its share of the tokens, over the data ranks' average.
    let weights =
        steps.iter().flat_map(|s| s.micro_batches.iter().map(|b| (b.supervised * s.data_ranks as u64) as f64));
    // A micro-batch without supervised tokens weighs nothing, whatever its loss reads.
    let sum: f64 = losses.iter().zip(weights).filter(|(_, w)| *w > 0.0).map(|(l, w)| l * w).sum();
    Ok(if total == 0 { 0.0 } else { sum / total as f64 })
}

/// Turns a micro-batch into the model's input (`prepare_input`).
pub type InputFn = Arc<dyn Fn(&Batch) -> Result<Tensor> + Send + Sync>;
/// The loss from the model's output and the micro-batch (`loss_func`).
pub type LossFn = Arc<dyn Fn(&Tensor, &Batch) -> Result<Tensor> + Send + Sync>;

/// The default `prepare_input`: the batch's token ids.
pub fn token_input() -> InputFn {
    Arc::new(|b: &Batch| Ok(b.inputs.shallow_clone()))
}

/// The default `loss_func`: mean cross-entropy against the next tokens.
pub fn next_token_loss() -> LossFn {
    Arc::new(|logits: &Tensor, b: &Batch| cross_entropy(logits, &b.targets))
}

/// [`next_token_loss`] for `engine`'s output: over a vocabulary split across a tensor
/// group, the vocabulary-parallel cross-entropy.
pub fn next_token_loss_of(engine: &Engine) -> LossFn {
    match engine.tensor_parallel() {
        Some(tp) => {
            let tp = tp.clone();
            Arc::new(move |logits: &Tensor, b: &Batch| tp.cross_entropy(logits, &b.targets))
        }
        None => next_token_loss(),
    }
}

/// What a step feeds the model and scores it by: the input function, and the loss where
/// one is given (`None`: [`next_token_loss_of`] the engine the step runs on). Measurements
/// taken before training (the room a step needs beside model states, a pipeline's unit
/// costs) take the run's own, so a model that reads other inputs is measured as it trains.
#[derive(Clone)]
pub struct Feed {
    pub input: InputFn,
    pub loss: Option<LossFn>,
}

impl Default for Feed {
    /// Token ids in, the next-token loss out.
    fn default() -> Self {
        Feed { input: token_input(), loss: None }
    }
}

impl Feed {
    /// The loss for `engine`'s output.
    pub fn loss_of(&self, engine: &Engine) -> LossFn {
        self.loss.clone().unwrap_or_else(|| next_token_loss_of(engine))
    }
}

pub struct Trainer {
    pub engine: Engine,
    pub optimizer: Optimizer,
    pub schedule: LrSchedule,
    /// Clip the global gradient norm to this value.
    pub grad_clip: Option<f64>,
    pub scaling: GradScaling,
    pub prepare_input: InputFn,
    pub loss_func: LossFn,
    step: u64,
    graphs: Option<GraphedSteps>,
}

/// How a step's micro-batch losses are weighted before backward: by numbers given to the
/// kernels when the step is queued, or by scalars on the device that a captured step reads
/// at each replay.
#[derive(Clone, Copy)]
enum LossWeights<'a> {
    Host(&'a Step),
    Device(&'a [Tensor]),
}

/// What a queued step sends back when it ends: the losses of its micro-batches, then the
/// gradient norm where clipping measured it on the device.
enum StepRead {
    Started(crate::compute::ScalarRead),
    /// Stacked on the device, in a step being captured (read after each replay).
    OnDevice(Tensor),
}

impl StepRead {
    fn finish(self) -> Result<Vec<f64>> {
        match self {
            StepRead::Started(read) => read.finish(),
            StepRead::OnDevice(values) => Ok(Vec::<f64>::try_from(values.f_to_device(tch::Device::Cpu)?)?),
        }
    }
}

/// A step queued on the device, with what the host decided about it.
struct QueuedStep {
    read: StepRead,
    norm_on_device: bool,
    grad_norm: Option<f64>,
    skipped: bool,
}

/// `cuda_graph` ([`Trainer::capture_cuda_graph`]): the step captured once the warm-up's
/// eager steps are over.
struct GraphedSteps {
    warmup_left: u64,
    device: usize,
    captured: Option<CapturedStep>,
    replays: u64,
}

/// A step captured as a CUDA graph, with its own copies of the micro-batches and of their
/// loss weights, which each replay refills from the step it runs.
struct CapturedStep {
    graph: strata_ext::cuda::Graph,
    batches: Vec<Batch>,
    weights: Vec<Tensor>,
    /// The micro-batches' losses, then the norm where clipping measured one, as f64s.
    read: Tensor,
    norm_on_device: bool,
    /// Device memory the graph's pool holds for its step (activations, casts, scratch).
    pool_bytes: u64,
}

impl CapturedStep {
    /// A copy of `batch` the captured step owns (packed layouts are refused before).
    fn own_batch(batch: &Batch) -> Result<Batch> {
        let own = |t: &Tensor| -> Result<Tensor> {
            let mut copy = t.f_empty_like()?;
            copy.f_copy_(t)?;
            Ok(copy)
        };
        Ok(Batch {
            inputs: own(&batch.inputs)?,
            targets: own(&batch.targets)?,
            supervised: batch.supervised,
            layout: None,
        })
    }

    /// Whether `step`'s micro-batches have the captured ones' shapes, dtypes and devices.
    fn fits(&self, step: &Step) -> bool {
        let same = |a: &Tensor, b: &Tensor| a.size() == b.size() && a.kind() == b.kind() && a.device() == b.device();
        self.batches.len() == step.micro_batches.len()
            && self
                .batches
                .iter()
                .zip(&step.micro_batches)
                .all(|(a, b)| same(&a.inputs, &b.inputs) && same(&a.targets, &b.targets))
    }

    /// Refills the captured inputs from `step` and replays the graph.
    fn replay(&self, step: &Step) -> Result<()> {
        for (i, (own, batch)) in self.batches.iter().zip(&step.micro_batches).enumerate() {
            own.inputs.shallow_clone().f_copy_(&batch.inputs)?;
            own.targets.shallow_clone().f_copy_(&batch.targets)?;
            let _ = self.weights[i].shallow_clone().f_fill_(step.loss_weight(i))?;
        }
        Ok(self.graph.replay()?)
    }
}

/// Where a step's host updates stand when its update is applied.
pub(crate) enum HostUpdating<'a> {
    /// Those of these units ran during backward; the rest run with the update.
    Done(&'a BTreeSet<usize>),
    /// They run during the next step, which computes with the parameters from before them.
    Delayed,
}

impl GradDecision {
    /// Ends the step on `engine` and its `optimizer`: gradients scaled, the update unless
    /// skipped, gradients cleared. Delayed host updates wait for (and publish) the previous
    /// step's first, then start this step's.
    pub(crate) fn apply(&self, engine: &mut Engine, optimizer: &mut Optimizer, host: HostUpdating) -> Result<()> {
        if let HostUpdating::Delayed = host {
            optimizer.settle(engine)?;
        }
        if self.factor != 1.0 {
            optimizer.scale_grads(self.factor)?;
        }
        if !self.skipped {
            match host {
                HostUpdating::Done(updated) => {
                    optimizer.step_except(updated)?;
                    engine.after_update()?;
                }
                HostUpdating::Delayed => {
                    let started = optimizer.start_delayed_host_updates()?;
                    optimizer.step_except(&started)?;
                }
            }
        }
        engine.end_step()?;
        engine.zero_grad()
    }
}

impl Trainer {
    pub fn new(engine: Engine, optimizer: Optimizer, schedule: LrSchedule, grad_clip: Option<f64>) -> Trainer {
        Trainer {
            loss_func: next_token_loss_of(&engine),
            engine,
            optimizer,
            schedule,
            grad_clip,
            scaling: GradScaling::default(),
            prepare_input: token_input(),
            step: 0,
            graphs: None,
        }
    }

    /// Feeds the model and scores it as `feed` says (a loss left out keeps the next-token
    /// loss).
    pub fn set_feed(&mut self, feed: &Feed) {
        self.prepare_input = feed.input.clone();
        self.loss_func = feed.loss_of(&self.engine);
    }

    /// Waits for host updates still running from the last step (a delayed update) and puts
    /// their parameters on the device: before reading or saving the model.
    pub fn settle_updates(&mut self) -> Result<()> {
        self.optimizer.settle(&mut self.engine)
    }

    /// Queues one step on `batches`: forward and backward of each, the gradients' decision
    /// and the update. The losses (and a norm measured on the device) are read back by a
    /// copy queued before the update, or, `into_graph`, left stacked on the device for the
    /// replays of the graph this step is being captured into to refill.
    fn queue_step(&mut self, batches: &[Batch], weights: LossWeights, into_graph: bool) -> Result<QueuedStep> {
        let scale = self.scaling.scale();
        let mut losses = Vec::with_capacity(batches.len());
        let last = batches.len().saturating_sub(1);
        // Units updated on the host start as soon as their gradient is complete, while the
        // device computes the rest of backward, where nothing decided later can stop them.
        self.engine.set_grad_ready(None);
        let delayed = self.engine.delays_host_updates();
        let host_updates = (!delayed && self.scaling.updates_unconditionally(self.grad_clip))
            .then(|| Arc::new(self.optimizer.host_updates()));
        for (i, batch) in batches.iter().enumerate() {
            // Only the last micro-batch's backward completes the step's gradients.
            self.engine.set_grad_sync(i == last);
            if let (true, Some(updates)) = (i == last, &host_updates) {
                let updates = updates.clone();
                self.engine.set_grad_ready(Some(Arc::new(move |unit| updates.start(unit))));
            }
            self.engine.set_layout(batch.layout.as_ref());
            let output = self.engine.forward(&(self.prepare_input)(batch)?)?;
            crate::fault::point("backward", self.step + 1)?;
            let loss = self.engine.compute_loss(|| (self.loss_func)(&output, batch))?;
            let weighted = match weights {
                LossWeights::Host(step) => loss.f_mul_scalar(scale * step.loss_weight(i))?,
                LossWeights::Device(weights) => loss.f_mul(&weights[i].f_to_kind(loss.kind())?)?,
            };
            self.engine.backward(&weighted)?;
            losses.push(loss.f_detach()?);
        }
        self.engine.set_grad_ready(None);
        self.engine.finish_grads()?;
        let updated = match host_updates.map(Arc::try_unwrap) {
            Some(Ok(updates)) => updates.finish()?,
            Some(Err(_)) => return Err(crate::Error::Engine("host updates still shared after backward".into())),
            None => BTreeSet::new(),
        };
        // Plain clipping on a GPU runs there: the norm is read back with the loss, at the end.
        let plain = self.scaling.updates_unconditionally(None) && scale == 1.0 && self.engine.grad_norm_is_local();
        let device_norm = match self.grad_clip {
            Some(max_norm) if plain => self.optimizer.clip_grad_norm_on_device(max_norm)?,
            _ => None,
        };
        let decision = match device_norm {
            Some(_) => GradDecision { factor: 1.0, grad_norm: None, skipped: false },
            None => {
                let (engine, optimizer) = (&self.engine, &self.optimizer);
                self.scaling.decide(self.grad_clip, scale, || engine.grad_sq_sum(&optimizer.grad_sq_per_unit()?))?
            }
        };
        let norm_on_device = device_norm.is_some();
        losses.extend(device_norm);
        // Queued ahead of the update, so the device still updates while the host waits for
        // these and starts the next step.
        let read = match into_graph {
            true => StepRead::OnDevice(crate::compute::stack_scalars(&losses)?),
            false => StepRead::Started(crate::compute::ScalarRead::start(&losses)?),
        };
        let host = if delayed { HostUpdating::Delayed } else { HostUpdating::Done(&updated) };
        decision.apply(&mut self.engine, &mut self.optimizer, host)?;
        Ok(QueuedStep { read, norm_on_device, grad_norm: decision.grad_norm, skipped: decision.skipped })
    }

    /// Whether `step` runs through the CUDA graph: graphs are on, the warm-up is over and
    /// the step has the captured shapes (or none is captured yet).
    fn graph_due(&self, step: &Step) -> Result<bool> {
        let Some(graphs) = &self.graphs else { return Ok(false) };
        if step.micro_batches.iter().any(|b| b.layout.is_some()) {
            return Err(crate::Error::Config(
                "cuda_graph: packed rows (a row layout) are laid out on the host for each step".into(),
            ));
        }
        Ok(graphs.warmup_left == 0 && graphs.captured.as_ref().is_none_or(|c| c.fits(step)))
    }

    /// `step` through the CUDA graph: captured first if none is, then replayed.
    fn replay_step(&mut self, step: &Step) -> Result<QueuedStep> {
        let graphs = self.graphs.as_mut().ok_or_else(|| crate::Error::Engine("no CUDA graph to replay".into()))?;
        let device = graphs.device;
        let captured = match graphs.captured.take() {
            Some(captured) => {
                // The update the host code of a captured step counts once, each replay again.
                self.optimizer.count_replayed_step();
                captured
            }
            None => self.capture_step(step, device)?,
        };
        captured.replay(step)?;
        let queued = QueuedStep {
            read: StepRead::Started(crate::compute::ScalarRead::start_stacked(&captured.read, device)?),
            norm_on_device: captured.norm_on_device,
            grad_norm: None,
            skipped: false,
        };
        if let Some(graphs) = self.graphs.as_mut() {
            graphs.captured = Some(captured);
            graphs.replays += 1;
        }
        Ok(queued)
    }

    /// Captures a step shaped as `step` on GPU `device`, over copies of its micro-batches and
    /// loss weights that the graph owns; nothing of it runs until the graph is replayed.
    fn capture_step(&mut self, step: &Step, device: usize) -> Result<CapturedStep> {
        let batches = step.micro_batches.iter().map(CapturedStep::own_batch).collect::<Result<Vec<_>>>()?;
        let weights = (0..batches.len())
            .map(|i| Ok(Tensor::f_full([], step.loss_weight(i), (tch::Kind::Float, tch::Device::Cuda(device)))?))
            .collect::<Result<Vec<_>>>()?;
        let reserved = || strata_ext::cuda::memory_stats(device).map(|s| s.reserved as u64);
        let before = reserved()?;
        let (graph, queued) = strata_ext::cuda::Graph::capture(device, || {
            self.queue_step(&batches, LossWeights::Device(&weights), true)
        })?;
        // A graph's memory comes from segments of its own pool, reserved for it alone.
        let pool_bytes = reserved()?.saturating_sub(before);
        let StepRead::OnDevice(read) = queued.read else {
            return Err(crate::Error::Engine("a captured step must leave its read on the device".into()));
        };
        Ok(CapturedStep { graph, batches, weights, read, norm_on_device: queued.norm_on_device, pool_bytes })
    }

    /// Steps completed so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Continues the step count (and the schedule) from a checkpoint's.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// The loss per learned token over `steps`, forward only (validation): this rank's
    /// share, as [`Trainer::train_step`] reports its training loss.
    pub fn evaluate(&mut self, steps: &[Step]) -> Result<f64> {
        self.settle_updates()?;
        evaluate_with(&mut self.engine, steps, &self.prepare_input, &self.loss_func)
    }

    /// Captures the training step as a CUDA graph after `warmup` eager steps (at least one:
    /// the first steps compile kernels and allocate what every later step reuses), and
    /// replays it for every later step whose micro-batches have the captured shapes: one
    /// launch instead of the host queueing every kernel. A step of other shapes (a shorter
    /// last batch) runs eagerly. Refused, with the reason, where a step needs the host
    /// between its kernels ([`Engine::capture_obstacle`]; a loss scaler or
    /// `skip_if_nonfinite`, which decide on the host whether a step updates).
    pub fn capture_cuda_graph(&mut self, warmup: u64) -> Result<()> {
        let refuse = |why: &str| Err(crate::Error::Config(format!("cuda_graph: {why}")));
        if let Some(why) = self.engine.capture_obstacle() {
            return refuse(&why);
        }
        if !self.scaling.updates_unconditionally(None) {
            return refuse("a loss scaler or skip_if_nonfinite decides on the host whether each step updates");
        }
        let tch::Device::Cuda(device) = self.engine.config().device else {
            return refuse("it needs a CUDA device");
        };
        self.graphs = Some(GraphedSteps { warmup_left: warmup.max(1), device, captured: None, replays: 0 });
        Ok(())
    }

    /// Steps replayed from a captured CUDA graph so far (the captured step among them).
    pub fn graph_replays(&self) -> u64 {
        self.graphs.as_ref().map_or(0, |g| g.replays)
    }

    /// Device bytes the captured CUDA graph's memory pool holds for the whole run: what its
    /// step needs beyond the model states, which no allocation between replays shows.
    pub fn graph_pool_bytes(&self) -> Option<u64> {
        self.graphs.as_ref()?.captured.as_ref().map(|c| c.pool_bytes)
    }

    /// Runs forward and backward on every micro-batch (gradients accumulate, each loss
    /// weighted by its share of the global batch's supervised tokens, [`Step::loss_weight`],
    /// so every token weighs the same, and scaled by the loss scale), then
    /// unscales, checks, clips and updates — or skips the update when the gradients are not
    /// finite and the scaling says to check.
    pub fn train_step(&mut self, step: &Step) -> Result<StepReport> {
        let start = Instant::now();
        let waited_before = crate::comm::time_waited();
        let moved_before = self.engine.ledger().transfers();
        let device = self.engine.config().device;
        memory::reset_allocator_peak(device);
        let factor = self.schedule.factor(self.step);
        let scale = self.scaling.scale();
        self.optimizer.set_lr_factor(factor)?;
        let tokens = step.micro_batches.iter().map(|b| b.targets.numel() as u64).sum();
        let queued = match self.graph_due(step)? {
            true => self.replay_step(step)?,
            false => {
                if let Some(graphs) = self.graphs.as_mut() {
                    graphs.warmup_left = graphs.warmup_left.saturating_sub(1);
                }
                self.queue_step(&step.micro_batches, LossWeights::Host(step), false)?
            }
        };
        let QueuedStep { read, norm_on_device, mut grad_norm, skipped } = queued;
        let mut read = read.finish()?;
        if norm_on_device {
            grad_norm = read.pop();
        }
        let loss = token_mean(std::slice::from_ref(step), &read)?;
        let seconds = start.elapsed().as_secs_f64();
        self.step += 1;
        Ok(StepReport {
            step: self.step,
            loss,
            supervised_tokens: step.global_supervised,
            lr: self.optimizer.lr(),
            grad_norm,
            loss_scale: self.scaling.scaler.as_ref().map(|_| scale),
            skipped,
            tokens,
            seconds,
            tokens_per_s: tokens as f64 / seconds.max(1e-12),
            peak_bytes: self.engine.ledger().peak_total(),
            allocator_peak_bytes: memory::allocator_peak(device),
            model_state_peak_bytes: self.engine.ledger().model_state_peak(),
            memory: self.engine.ledger().report(),
            rss_peak_bytes: memory::process_peak_rss(),
            comm_wait_s: (crate::comm::time_waited() - waited_before).as_secs_f64(),
            transfers: self.engine.ledger().transfers().since(&moved_before),
            unit_times: None,
            pipeline: None,
            val_loss: None,
            val_perplexity: None,
        })
    }
}
