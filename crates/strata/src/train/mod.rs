//! The training step: one [`Trainer`] over the model parts a rank holds, whatever the
//! parallel methods. A [`StepExecutor`] runs each step's forwards and backwards over the
//! parts (one engine, micro-batch after micro-batch: [`SinglePart`]; a pipeline schedule
//! over stages: `parallel::pipeline`) and answers for the whole model (its gradient norm,
//! its loss, its layout); the trainer writes the rest once for every executor: the learning
//! rate, loss scaling, clipping, the update, the report, validation, checkpoints, saved
//! weights and CUDA-graph capture.
//!
//! Owns: the order of a step, the update and the per-step report. Must not own data
//! loading, output files or how parts are built from a strategy (`parallel` does).
mod graph;
mod single;

use crate::checkpoint::{Checkpoint, Layout, RunInfo};
use crate::comm::ProcessGroup;
use crate::compute::scaler::GradDecision;
pub use crate::compute::scaler::GradScaling;
use crate::data::{Batch, Step};
use crate::engine::memory::PlacementReport;
use crate::engine::{memory, Engine, Event, EventSink, GradReady, MemoryLedger, Placement, UnitTime};
use crate::generate::Decoder;
use crate::io::WeightsTarget;
use crate::model::layers::cross_entropy;
use crate::model::{DecodeCache, DropoutDraw, ModelSpec, RowLayout};
use crate::optim::{LrSchedule, Optimizer};
use crate::profile::Profiler;
use crate::{Error, Result};
pub use graph::LossWeights;
use graph::{GraphedSteps, StepRead};
use serde::Serialize;
pub use single::SinglePart;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tch::Tensor;

/// Weights of a trainer's parts as they were when kept, gathered whole
/// (`Engine::full_unit`): a frozen reference model laid out as the trainer's is, pipeline
/// stages included (each rank keeps its stages' units), scored by swapping it in.
pub struct KeptWeights {
    /// Per part, what is kept of its units.
    units: Vec<Vec<KeptUnit>>,
}

/// What is kept of one unit: its parameters at `ranges` of its whole flat layout, or all of
/// them.
struct KeptUnit {
    unit: usize,
    /// `(offset, length)` of each parameter kept; `None`: the whole unit.
    ranges: Option<Vec<(i64, i64)>>,
    /// The kept values, the ranges' one after another.
    values: Tensor,
}

impl KeptUnit {
    /// What of `whole` (the unit's flat parameters) this keeps, in storage of its own.
    fn select(&self, whole: &Tensor) -> Result<Tensor> {
        Ok(match &self.ranges {
            None => whole.f_detach_copy()?,
            Some(ranges) => {
                let pieces = ranges
                    .iter()
                    .map(|&(at, n)| whole.f_narrow(0, at, n))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                Tensor::f_cat(&pieces, 0)?
            }
        })
    }
}

impl KeptWeights {
    /// The trainer's weights as they are now (every rank together: sharded and split units
    /// are gathered).
    pub fn of(trainer: &mut Trainer) -> Result<KeptWeights> {
        Self::keeping(trainer, |_, _| None)
    }

    /// The trainer's trainable parameters as they are now, the frozen ones left to the
    /// trainer (every rank together).
    pub fn of_trainable(trainer: &mut Trainer) -> Result<KeptWeights> {
        Self::keeping(trainer, |engine, u| {
            let spec = engine.spec();
            let trainable = spec.units[u].params.iter().filter(|id| spec.params[id.0].requires_grad);
            Some(trainable.map(|&id| (engine.full_offset(id), spec.params[id.0].numel())).collect())
        })
    }

    /// Keeps of each unit `u` of every part the ranges `ranges(engine, u)` names (`None`:
    /// all of it); units with no range kept are left out.
    fn keeping(
        trainer: &mut Trainer,
        ranges: impl Fn(&Engine, usize) -> Option<Vec<(i64, i64)>>,
    ) -> Result<KeptWeights> {
        trainer.settle_updates()?;
        let mut units = Vec::with_capacity(trainer.parts.len());
        for part in &mut trainer.parts {
            let mut kept = vec![];
            for unit in 0..part.engine.spec().units.len() {
                let ranges = ranges(&part.engine, unit);
                if ranges.as_ref().is_some_and(Vec::is_empty) {
                    continue;
                }
                let mut k = KeptUnit { unit, ranges, values: Tensor::new() };
                k.values = k.select(&part.engine.full_unit(unit)?)?;
                kept.push(k);
            }
            units.push(kept);
        }
        Ok(KeptWeights { units })
    }

    /// Runs `score` on the trainer with the kept weights in place of its own, which it gets
    /// back afterwards, unchanged, whatever `score` returns (every rank together).
    pub fn scoring<T>(&mut self, trainer: &mut Trainer, score: impl FnOnce(&mut Trainer) -> Result<T>) -> Result<T> {
        trainer.settle_updates()?;
        self.swap(trainer)?;
        let scored = score(trainer);
        self.swap(trainer)?;
        scored
    }

    /// Exchanges the kept weights with the trainer's.
    fn swap(&mut self, trainer: &mut Trainer) -> Result<()> {
        for (part, kept) in trainer.parts.iter_mut().zip(&mut self.units) {
            for k in kept.iter_mut() {
                let whole = owned_unit(&mut part.engine, k.unit)?;
                k.values = match &k.ranges {
                    None => {
                        part.engine.set_full_unit(k.unit, &k.values)?;
                        whole
                    }
                    Some(ranges) => {
                        let current = k.select(&whole)?;
                        let mut at = 0;
                        for &(offset, n) in ranges {
                            whole.f_narrow(0, offset, n)?.f_copy_(&k.values.f_narrow(0, at, n)?)?;
                            at += n;
                        }
                        part.engine.set_full_unit(k.unit, &whole)?;
                        current
                    }
                };
            }
        }
        Ok(())
    }

    /// Moves each kept weight to `mixup` of the trainer's and `1 − mixup` of its own
    /// (TR-DPO's sync; every rank together).
    pub fn follow(&mut self, trainer: &mut Trainer, mixup: f64) -> Result<()> {
        trainer.settle_updates()?;
        for (part, kept) in trainer.parts.iter_mut().zip(&mut self.units) {
            for k in kept.iter_mut() {
                let policy = k.select(&part.engine.full_unit(k.unit)?)?;
                k.values = synced(&k.values, &policy, mixup)?;
            }
        }
        Ok(())
    }
}

/// LoRA's reference model (preference and GRPO training): the model as it started. Where
/// the adapters start at zero and nothing of the base trains, that is the base with the
/// adapters switched off; where a loaded adapter starts elsewhere (TRL's reference is a
/// frozen copy of it) or `modules_to_save` train parameters of the base (peft's
/// `disable_adapter` computes with the original modules), the trainable parameters'
/// starting values are kept, gathered whole, and swapped in while it scores: a gather and
/// a scatter of each unit holding some, twice per scoring.
pub enum LoraReference {
    /// The base, the adapters switched off.
    AdaptersOff,
    /// The starting values of the trainable parameters.
    Starting(KeptWeights),
}

impl LoraReference {
    /// The reference of a trainer as it starts, under `lora`, `changed` where a loaded
    /// adapter already changes the base (every rank together).
    pub fn of(trainer: &mut Trainer, lora: &crate::strategy::LoraConfig, changed: bool) -> Result<LoraReference> {
        Ok(match changed || !lora.modules_to_save.is_empty() {
            true => LoraReference::Starting(KeptWeights::of_trainable(trainer)?),
            false => LoraReference::AdaptersOff,
        })
    }

    /// Runs `score` on the trainer as the reference model, and leaves the trainer as it
    /// found it, whatever `score` returns (every rank together).
    pub fn scoring<T>(&mut self, trainer: &mut Trainer, score: impl FnOnce(&mut Trainer) -> Result<T>) -> Result<T> {
        match self {
            LoraReference::AdaptersOff => {
                trainer.set_adapters_enabled(false);
                let scored = score(trainer);
                trainer.set_adapters_enabled(true);
                scored
            }
            LoraReference::Starting(kept) => kept.scoring(trainer, score),
        }
    }
}

/// TR-DPO's sync of a reference's weights towards the policy's: `mixup · policy + (1 −
/// mixup) · reference`.
pub fn synced(reference: &Tensor, policy: &Tensor, mixup: f64) -> Result<Tensor> {
    Ok(reference.f_mul_scalar(1.0 - mixup)?.f_add(&policy.f_mul_scalar(mixup)?)?)
}

/// Unit `u`'s whole parameters in storage of their own: where nothing is gathered,
/// `full_unit` reads the unit's buffer itself, which the next update or swap overwrites.
fn owned_unit(engine: &mut Engine, u: usize) -> Result<Tensor> {
    Ok(engine.full_unit(u)?.f_detach_copy()?)
}

/// What one step did, as written to `--metrics`.
#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    /// The step's number, counted from 1.
    pub step: u64,
    /// Loss per supervised token of the step's global batch (this rank's share until the
    /// run averages it over the data ranks).
    pub loss: f64,
    /// Supervised tokens (targets that take a loss) in the step's global batch.
    pub supervised_tokens: u64,
    /// The learning rate of the step, after the schedule's factor.
    pub lr: f64,
    /// Global gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    /// Tokens (targets, supervised or not) in this rank's micro-batches of the step (the
    /// run counts them over the data ranks).
    pub tokens: u64,
    /// Wall-clock seconds the step took on this rank.
    pub seconds: f64,
    /// `tokens` over `seconds`.
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
    /// A mixture of experts' routing in the step's last micro-batch, this rank: the
    /// load-balancing loss (before its coefficient; the loss above includes it times the
    /// coefficient) and the token slots of the least and most loaded expert.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<crate::model::BalanceReport>,
    /// Preference pairs' metrics over the step's global batch, under TRL's names (filled in
    /// by the training loop's owner where the run optimises preferences).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub preference: Option<crate::preference::PreferenceMetrics>,
    /// A reward model's metrics over the step's global batch, under TRL's names (filled in
    /// by the training loop's owner where the run trains a reward model).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub reward: Option<crate::reward::RewardMetrics>,
    /// GRPO's metrics of the step and the generation batch it trained on, under TRL's names
    /// (filled in by the training loop's owner where the run trains by GRPO).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub grpo: Option<crate::grpo::GrpoMetrics>,
    /// The checkpoint saved after the previous step: how long training stood still for it
    /// and, where saves are asynchronous, how long the writer took to persist the save
    /// before it (filled in by the training loop's owner).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<crate::checkpoint::snapshot::SaveTimes>,
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
        set_rows(engine, batch, None);
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

/// The default `loss_func`: mean cross-entropy against the next tokens; a scalar output is
/// that loss already, from a head that scored its rows itself (`chunked_loss`).
pub fn next_token_loss() -> LossFn {
    Arc::new(|out: &Tensor, b: &Batch| match out.dim() {
        0 => Ok(out.shallow_clone()),
        _ => cross_entropy(out, &b.targets),
    })
}

/// [`next_token_loss`] for `engine`'s output: over a vocabulary split across a tensor
/// group, the vocabulary-parallel cross-entropy (a scalar output being the loss already).
pub fn next_token_loss_of(engine: &Engine) -> LossFn {
    match engine.tensor_parallel() {
        Some(tp) => {
            let tp = tp.clone();
            Arc::new(move |out: &Tensor, b: &Batch| match out.dim() {
                0 => Ok(out.shallow_clone()),
                _ => tp.cross_entropy(out, &b.targets),
            })
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
    /// Turns each micro-batch into the model's input.
    pub input: InputFn,
    /// Scores the model's output against the micro-batch (`None`: the next-token loss).
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

/// A piece of the model that a rank trains: an engine over some of the model's units (all
/// of them outside a pipeline), its optimizer, and the place of its first unit in the model.
pub struct ModelPart {
    /// Runs the part's units forward and backward.
    pub engine: Engine,
    /// Updates the part's parameters.
    pub optimizer: Optimizer,
    /// Index in the whole model of the part's first unit.
    pub first_unit: usize,
}

impl ModelPart {
    /// The part as a checkpoint sees it.
    fn as_checkpoint(&mut self) -> crate::checkpoint::Part<'_> {
        crate::checkpoint::Part {
            engine: &mut self.engine,
            optimizer: &mut self.optimizer,
            first_unit: self.first_unit,
        }
    }
}

/// What a step's forwards and backwards run on.
pub struct StepInput<'a> {
    /// The step's micro-batches, in order.
    pub batches: &'a [Batch],
    /// What each micro-batch's loss is multiplied by before backward.
    pub weights: LossWeights<'a>,
    /// The loss scale.
    pub scale: f64,
    /// Turns a micro-batch into the model's input.
    pub input: &'a InputFn,
    /// Scores the model's output against a micro-batch.
    pub loss: &'a LossFn,
    /// The step's number, counted from 1 (failure injection names it).
    pub number: u64,
    /// Told of each unit whose gradient the step's last backward completes, where the
    /// executor runs host updates beside backward ([`StepExecutor::updates_in_backward`]).
    pub grad_ready: Option<Arc<GradReady>>,
    /// The seed dropout masks are drawn from ([`Trainer::set_dropout_seed`]).
    pub dropout_seed: u64,
}

impl StepInput<'_> {
    /// The draw of `batch`'s dropout masks in this step.
    pub fn dropout(&self, batch: &Batch) -> DropoutDraw {
        batch_draw(self.dropout_seed, self.number, batch)
    }
}

/// The draw of `batch`'s dropout masks at step `step` from `seed`.
pub(crate) fn batch_draw(seed: u64, step: u64, batch: &Batch) -> DropoutDraw {
    DropoutDraw { seed, step, first_row: batch.first_row as i64 }
}

/// The draw of a run's first step, for forwards that measure before training (dropout's
/// masks take room and time too).
pub(crate) fn first_step_draw(batch: &Batch) -> DropoutDraw {
    batch_draw(0, 1, batch)
}

/// The loss a training step's backward starts from: `loss` of `engine`'s `output` for
/// `batch`, with the last unit's module replacements, plus the load-balancing and z-loss
/// term where a mixture of experts routed the forward (its routers train through it; a
/// backward without it is refused).
pub(crate) fn training_loss(engine: &Engine, loss: &LossFn, output: &Tensor, batch: &Batch) -> Result<Tensor> {
    let scored = engine.compute_loss(|| loss(output, batch))?;
    Ok(match engine.routed().and_then(|r| r.loss_term.as_ref()) {
        Some(term) => scored.f_add(&term.f_to_device(scored.device())?)?,
        None => scored,
    })
}

/// Readies `engine`'s next forwards for `batch`'s rows: their layout, their padding, and the
/// draw of their dropout masks where they train (`None`: they do not).
pub(crate) fn set_rows(engine: &mut Engine, batch: &Batch, dropout: Option<DropoutDraw>) {
    engine.set_layout(batch.layout.as_ref());
    engine.set_padding(batch.padding.as_ref());
    engine.set_targets(Some(&batch.targets));
    engine.set_dropout(dropout);
}

/// How a trainer's parts run a step, and what only the executor knows of the whole model.
/// Everything else about a step (the update, clipping, loss scaling, reports, checkpoints)
/// is the [`Trainer`]'s and the same under every executor.
pub trait StepExecutor {
    /// Forward and backward of every micro-batch of `input` over `parts`, leaving every
    /// part's gradients complete for the update (reduced over their replicas). Returns the
    /// micro-batches' losses in order, unweighted and detached, where this rank scores the
    /// model's output; none where it does not (a pipeline's earlier stages).
    fn forward_backward(&mut self, parts: &mut [ModelPart], input: StepInput<'_>) -> Result<Vec<Tensor>>;

    /// A sum over this rank's parts (the squared gradient norm) made the sum over the whole
    /// model: over every rank holding other pieces of it.
    fn whole_model_sum(&self, local: f64) -> Result<f64>;

    /// Whether this rank's parts alone give the global gradient norm (it may then be
    /// measured and clipped on the device, with no collective).
    fn grad_norm_is_local(&self, parts: &[ModelPart]) -> bool;

    /// Whether units updated on the host may start during the step's last backward.
    fn updates_in_backward(&self) -> bool;

    /// Completes a step's report from this rank's share: `local_loss` where this rank
    /// scored the output, agreed into the loss of everything the executor's ranks ran.
    fn complete_report(&mut self, parts: &[ModelPart], local_loss: Option<f64>, report: &mut StepReport) -> Result<()>;

    /// The loss per learned token over `steps`, forward only.
    fn evaluate(&mut self, parts: &mut [ModelPart], steps: &[Step], input: &InputFn, loss: &LossFn) -> Result<f64>;

    /// The whole model's description, as profiles number its units.
    fn model_spec<'a>(&'a self, parts: &'a [ModelPart]) -> &'a ModelSpec;

    /// The whole model's layout, as checkpoints describe it.
    fn layout(&self, parts: &[ModelPart]) -> Layout;

    /// Saves the whole model's parameters under their names: every rank calls this, those
    /// with `write` write.
    fn save_weights(&mut self, parts: &mut [ModelPart], target: WeightsTarget<'_>, write: bool) -> Result<()>;

    /// Why a step cannot be captured as a CUDA graph, where the executor prevents it.
    fn capture_obstacle(&self) -> Option<String>;

    /// The part whose output the loss scores, where this rank holds it.
    fn scoring_part(&self) -> Option<usize>;

    /// Each of the model's units' times, from the times of this rank's units.
    fn unit_times(&self, mine: Vec<UnitTime>) -> Result<Vec<UnitTime>>;

    /// Told of every event the executor's own operations make (beside the engines').
    fn set_event_sink(&mut self, _sink: Arc<dyn EventSink>) {}

    /// Decoding, forward only: the logits of `tokens` (`[rows, positions]` ids) following
    /// the positions `cache` holds (a list per part), where this rank computes them.
    fn decode(
        &mut self,
        parts: &mut [ModelPart],
        tokens: &Tensor,
        cache: &mut [Vec<DecodeCache>],
    ) -> Result<Option<Tensor>> {
        match (parts, cache) {
            ([part], [units]) => part.engine.decode(tokens, units).map(Some),
            (parts, cache) => {
                Err(Error::Engine(format!("{} decode caches for {} model parts", cache.len(), parts.len())))
            }
        }
    }

    /// Tokens chosen where the logits are (`chosen`, one for each of `rows` rows), on every
    /// rank that decodes together.
    fn share_tokens(&self, chosen: Option<Vec<i64>>, _rows: usize) -> Result<Vec<i64>> {
        chosen.ok_or_else(|| Error::Engine("decoding computed no logits to choose tokens from".into()))
    }
}

/// A trainer decodes its parts as its executor runs them: a pipeline's stages each their
/// own units, the tokens chosen on the last stage reaching the others.
impl Decoder for Trainer {
    fn device(&self) -> tch::Device {
        self.parts[0].engine.config().device
    }

    fn start(&mut self) -> Vec<Vec<DecodeCache>> {
        self.parts
            .iter_mut()
            .map(|part| {
                part.engine.set_layout(None);
                (0..part.engine.spec().units.len()).map(|_| DecodeCache::default()).collect()
            })
            .collect()
    }

    fn decode(
        &mut self,
        tokens: &Tensor,
        rows: Option<&RowLayout>,
        cache: &mut [Vec<DecodeCache>],
    ) -> Result<Option<Tensor>> {
        let place = |parts: &mut [ModelPart], rows: Option<&RowLayout>| {
            parts.iter_mut().for_each(|part| part.engine.set_layout(rows));
        };
        place(&mut self.parts, rows);
        let logits = self.executor.decode(&mut self.parts, tokens, cache);
        place(&mut self.parts, None);
        logits
    }

    fn share(&self, chosen: Option<Vec<i64>>, rows: usize) -> Result<Vec<i64>> {
        self.executor.share_tokens(chosen, rows)
    }
}

/// The training loop's body over a rank's model parts ([`ModelPart`]) and the
/// [`StepExecutor`] that runs their forwards and backwards.
pub struct Trainer {
    parts: Vec<ModelPart>,
    executor: Box<dyn StepExecutor>,
    /// The learning rate's factor at each step.
    pub schedule: LrSchedule,
    /// Clip the global gradient norm to this value.
    pub grad_clip: Option<f64>,
    /// Loss scaling and the check for non-finite gradients.
    pub scaling: GradScaling,
    /// Turns a micro-batch into the model's input (set by [`Trainer::set_feed`]).
    pub prepare_input: InputFn,
    /// Scores the model's output against a micro-batch (set by [`Trainer::set_feed`]).
    pub loss_func: LossFn,
    step: u64,
    graphs: Option<GraphedSteps>,
    dropout_seed: u64,
}

/// A step queued on the device, with what the host decided about it.
struct QueuedStep {
    read: StepRead,
    norm_on_device: bool,
    grad_norm: Option<f64>,
    skipped: bool,
}

/// Hands a part's engine events on with its units numbered as in the whole model.
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
                    engine.move_choice_biases(false)?;
                    engine.after_update()?;
                }
                HostUpdating::Delayed => {
                    let started = optimizer.start_delayed_host_updates()?;
                    optimizer.step_except(&started)?;
                    // Published with the update, when the next step settles it.
                    engine.move_choice_biases(false)?;
                }
            }
        } else {
            engine.move_choice_biases(true)?;
        }
        engine.end_step()?;
        engine.zero_grad()
    }
}

impl Trainer {
    /// A trainer over one engine and its optimizer.
    pub fn new(engine: Engine, optimizer: Optimizer, schedule: LrSchedule, grad_clip: Option<f64>) -> Trainer {
        let part = ModelPart { engine, optimizer, first_unit: 0 };
        Trainer::over_parts(vec![part], Box::new(SinglePart::default()), schedule, grad_clip)
            .expect("one part is never empty")
    }

    /// A trainer over `parts`, whose steps `executor` runs. No part is an error.
    pub fn over_parts(
        parts: Vec<ModelPart>,
        executor: Box<dyn StepExecutor>,
        schedule: LrSchedule,
        grad_clip: Option<f64>,
    ) -> Result<Trainer> {
        if parts.is_empty() {
            return Err(Error::Engine("a trainer over no model part".into()));
        }
        let mut trainer = Trainer {
            loss_func: next_token_loss(),
            parts,
            executor,
            schedule,
            grad_clip,
            scaling: GradScaling::default(),
            prepare_input: token_input(),
            step: 0,
            graphs: None,
            dropout_seed: 0,
        };
        trainer.set_feed(&Feed::default());
        Ok(trainer)
    }

    /// Feeds the model and scores it as `feed` says (a loss left out keeps the next-token
    /// loss, vocabulary-parallel where the scored part splits the vocabulary).
    pub fn set_feed(&mut self, feed: &Feed) {
        self.prepare_input = feed.input.clone();
        self.loss_func = match (&feed.loss, self.executor.scoring_part()) {
            (Some(loss), _) => loss.clone(),
            (None, Some(k)) => next_token_loss_of(&self.parts[k].engine),
            (None, None) => next_token_loss(),
        };
    }

    /// Draws dropout masks from `seed` (0 until set; a run sets its own seed): a step's masks
    /// are a function of the seed, the step's number and where each element falls in the
    /// global batch ([`crate::model::dropout`]).
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.dropout_seed = seed;
    }

    /// The engine of this rank's first part (its only one outside a pipeline).
    pub fn engine(&self) -> &Engine {
        &self.parts[0].engine
    }

    /// The engine of this rank's first part, mutable.
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.parts[0].engine
    }

    /// The optimizer of this rank's first part.
    pub fn optimizer(&self) -> &Optimizer {
        &self.parts[0].optimizer
    }

    /// The optimizer of this rank's first part, mutable.
    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.parts[0].optimizer
    }

    /// This rank's model parts, in the model's order.
    pub fn parts(&self) -> &[ModelPart] {
        &self.parts
    }

    /// This rank's model parts, mutable.
    pub fn parts_mut(&mut self) -> &mut [ModelPart] {
        &mut self.parts
    }

    /// Switches every part's LoRA adapters off (the frozen base computes) or on again.
    pub fn set_adapters_enabled(&mut self, on: bool) {
        self.parts.iter_mut().for_each(|part| part.engine.set_adapters_enabled(on));
    }

    /// This rank's model parts, the trainer used up.
    pub fn into_parts(self) -> Vec<ModelPart> {
        self.parts
    }

    /// The memory ledgers of this rank's parts.
    pub fn ledgers(&self) -> Vec<Arc<MemoryLedger>> {
        self.parts.iter().map(|p| p.engine.ledger().clone()).collect()
    }

    /// Reports every unit's events to `sink`, units numbered as in the whole model, and
    /// the executor's own operations.
    pub fn set_event_sink(&mut self, sink: Arc<dyn EventSink>) {
        for part in &mut self.parts {
            let numbered: Arc<dyn EventSink> = match part.first_unit {
                0 => sink.clone(),
                first_unit => Arc::new(WholeModelUnits { first_unit, sink: sink.clone() }),
            };
            part.engine.set_event_sink(numbered);
        }
        self.executor.set_event_sink(sink);
    }

    /// A profiler of this rank's parts, units numbered as in the whole model.
    pub fn profiler(&self, rank: usize, world: usize) -> Arc<Profiler> {
        let spec = self.executor.model_spec(&self.parts);
        Profiler::of_model(spec, self.parts[0].engine.config(), self.ledgers(), rank, world)
    }

    /// Every unit of the model's times in the last step, from the times this rank's parts
    /// measured (a [`crate::engine::UnitClock`] told their events).
    pub fn unit_times(&self, mine: Vec<UnitTime>) -> Result<Vec<UnitTime>> {
        self.executor.unit_times(mine)
    }

    /// Waits for host updates still running from the last step (a delayed update) and puts
    /// their parameters on the device: before reading or saving the model.
    pub fn settle_updates(&mut self) -> Result<()> {
        for part in &mut self.parts {
            part.optimizer.settle(&mut part.engine)?;
        }
        Ok(())
    }

    /// Steps completed so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Continues the step count (and the schedule) from a checkpoint's.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// The loss per learned token over `steps`, forward only (validation), as
    /// [`Trainer::train_step`] reports its training loss.
    pub fn evaluate(&mut self, steps: &[Step]) -> Result<f64> {
        self.settle_updates()?;
        self.executor.evaluate(&mut self.parts, steps, &self.prepare_input, &self.loss_func)
    }

    /// Saves a checkpoint of the whole model under `root` (every rank calls this; `world`
    /// is the group of all ranks), keeping the `keep` newest (0: all).
    pub fn save_checkpoint(
        &mut self,
        root: &Path,
        run: &RunInfo,
        world: Option<&dyn ProcessGroup>,
        keep: usize,
    ) -> Result<PathBuf> {
        let layout = self.executor.layout(&self.parts);
        let mut parts: Vec<_> = self.parts.iter_mut().map(ModelPart::as_checkpoint).collect();
        crate::checkpoint::save_parts(root, &layout, &mut parts, run, world, keep)
    }

    /// [`Trainer::save_checkpoint`] through `saver`: a snapshot in host memory that its
    /// writer persists to disk while training goes on.
    pub fn save_checkpoint_async(
        &mut self,
        saver: &mut crate::checkpoint::snapshot::AsyncSaver,
        run: &RunInfo,
        world: Option<&dyn ProcessGroup>,
        keep: usize,
    ) -> Result<crate::checkpoint::snapshot::SaveTimes> {
        let layout = self.executor.layout(&self.parts);
        let mut parts: Vec<_> = self.parts.iter_mut().map(ModelPart::as_checkpoint).collect();
        saver.save(&layout, &mut parts, run, world, keep)
    }

    /// Seconds this rank's updates waited since the last call for those reading the
    /// parameters and states where they lie (an asynchronous save's writer).
    pub fn take_readers_wait(&mut self) -> f64 {
        self.parts.iter_mut().map(|p| p.optimizer.take_readers_wait()).sum()
    }

    /// Loads `checkpoint` (saved at any pipeline, tensor or data size) into this rank's
    /// parts, and continues its step count and loss scale.
    pub fn restore(&mut self, checkpoint: &Checkpoint, optimizer_name: &str) -> Result<()> {
        let layout = self.executor.layout(&self.parts);
        let mut parts: Vec<_> = self.parts.iter_mut().map(ModelPart::as_checkpoint).collect();
        checkpoint.restore_parts(&layout, &mut parts, optimizer_name)?;
        self.step = checkpoint.meta.step;
        self.scaling.resume_from(checkpoint.meta.loss_scaler.as_ref())
    }

    /// Saves the whole model's parameters (every rank takes part in gathering them; those
    /// with `write` write).
    pub fn save_weights(&mut self, target: WeightsTarget<'_>, write: bool) -> Result<()> {
        self.settle_updates()?;
        self.executor.save_weights(&mut self.parts, target, write)
    }

    /// Queues one step on `batches`: forward and backward of each, the gradients' decision
    /// and the update. The losses (and a norm measured on the device) are read back by a
    /// copy queued before the update, or, `into_graph`, left stacked on the device for the
    /// replays of the graph this step is being captured into to refill.
    fn queue_step(&mut self, batches: &[Batch], weights: LossWeights, into_graph: bool) -> Result<QueuedStep> {
        let scale = self.scaling.scale();
        let single = self.parts.len() == 1;
        // Units updated on the host start as soon as their gradient is complete, while the
        // device computes the rest of backward, where nothing decided later can stop them.
        let delayed = single && self.parts[0].engine.held_states().delays_host_updates();
        let host_updates = (single
            && !delayed
            && self.executor.updates_in_backward()
            && self.scaling.updates_unconditionally(self.grad_clip))
        .then(|| Arc::new(self.parts[0].optimizer.host_updates()));
        let grad_ready = host_updates.as_ref().map(|updates| {
            let updates = updates.clone();
            Arc::new(move |unit| updates.start(unit)) as Arc<GradReady>
        });
        let input = StepInput {
            batches,
            weights,
            scale,
            input: &self.prepare_input,
            loss: &self.loss_func,
            number: self.step + 1,
            grad_ready,
            dropout_seed: self.dropout_seed,
        };
        let mut losses = self.executor.forward_backward(&mut self.parts, input)?;
        let updated = match host_updates.map(Arc::try_unwrap) {
            Some(Ok(updates)) => updates.finish()?,
            Some(Err(_)) => return Err(Error::Engine("host updates still shared after backward".into())),
            None => BTreeSet::new(),
        };
        // Plain clipping of one part whose norm is its own runs on the device: the norm is
        // read back with the loss, at the end.
        let plain = self.scaling.updates_unconditionally(None)
            && scale == 1.0
            && single
            && self.executor.grad_norm_is_local(&self.parts);
        let device_norm = match self.grad_clip {
            Some(max_norm) if plain => self.parts[0].optimizer.clip_grad_norm_on_device(max_norm)?,
            _ => None,
        };
        let decision = match device_norm {
            Some(_) => GradDecision { factor: 1.0, grad_norm: None, skipped: false },
            None => {
                let (executor, parts) = (&self.executor, &self.parts);
                let sq_norm = || {
                    let mut local = 0.0;
                    for part in parts {
                        local += part.engine.grad_sq_sum(&part.optimizer.grad_sq_per_unit()?)?;
                    }
                    executor.whole_model_sum(local)
                };
                self.scaling.decide(self.grad_clip, scale, sq_norm)?
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
        for part in &mut self.parts {
            let host = if delayed { HostUpdating::Delayed } else { HostUpdating::Done(&updated) };
            decision.apply(&mut part.engine, &mut part.optimizer, host)?;
        }
        Ok(QueuedStep { read, norm_on_device, grad_norm: decision.grad_norm, skipped: decision.skipped })
    }

    /// Runs forward and backward on every micro-batch (gradients accumulate, each loss
    /// weighted by its share of the global batch's supervised tokens, [`Step::loss_weight`],
    /// so every token weighs the same, and scaled by the loss scale), then
    /// unscales, checks, clips and updates — or skips the update when the gradients are not
    /// finite and the scaling says to check. The report's loss is this rank's share for a
    /// [`Trainer::new`] trainer, the loss of every rank the executor agrees with otherwise.
    pub fn train_step(&mut self, step: &Step) -> Result<StepReport> {
        let start = Instant::now();
        let waited_before = crate::comm::time_waited();
        let moved_before = self.parts[0].engine.ledger().transfers();
        let device = self.parts[0].engine.config().device;
        memory::reset_allocator_peak(device);
        let factor = self.schedule.factor(self.step);
        let scale = self.scaling.scale();
        for part in &mut self.parts {
            part.optimizer.set_lr_factor(factor)?;
        }
        let tokens = step.micro_batches.iter().map(|b| b.targets.numel() as u64).sum();
        let queued = match self.graph_due(step)? {
            true => self.replay_step(step)?,
            false => {
                if let Some(graphs) = self.graphs.as_mut() {
                    graphs.count_eager_step();
                }
                self.queue_step(&step.micro_batches, LossWeights::Host(step), false)?
            }
        };
        let QueuedStep { read, norm_on_device, mut grad_norm, skipped } = queued;
        let mut read = read.finish()?;
        if norm_on_device {
            grad_norm = read.pop();
        }
        let local_loss = match read.is_empty() {
            true => None,
            false => Some(token_mean(std::slice::from_ref(step), &read)?),
        };
        self.step += 1;
        let ledger = self.parts[0].engine.ledger();
        let mut report = StepReport {
            step: self.step,
            loss: local_loss.unwrap_or(0.0),
            supervised_tokens: step.global_supervised,
            lr: self.parts[0].optimizer.lr(),
            grad_norm,
            loss_scale: self.scaling.scaler.as_ref().map(|_| scale),
            skipped,
            tokens,
            seconds: 0.0,
            tokens_per_s: 0.0,
            peak_bytes: ledger.peak_total(),
            allocator_peak_bytes: memory::allocator_peak(device),
            model_state_peak_bytes: ledger.model_state_peak(),
            memory: ledger.report(),
            rss_peak_bytes: memory::process_peak_rss(),
            comm_wait_s: 0.0,
            transfers: ledger.transfers().since(&moved_before),
            unit_times: None,
            pipeline: None,
            experts: self.parts[0].engine.routed().map(|r| r.report),
            preference: None,
            reward: None,
            grpo: None,
            checkpoint: None,
            val_loss: None,
            val_perplexity: None,
        };
        // The step's own time and waits, before the ranks agree on its report.
        report.comm_wait_s = (crate::comm::time_waited() - waited_before).as_secs_f64();
        report.seconds = start.elapsed().as_secs_f64();
        report.tokens_per_s = tokens as f64 / report.seconds.max(1e-12);
        self.executor.complete_report(&self.parts, local_loss, &mut report)?;
        Ok(report)
    }
}
