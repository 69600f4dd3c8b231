//! GRPO's loop over a trainer: a generation batch of completions (each prompt
//! [`GrpoConfig::num_generations`] times, decoded together with the key/value cache), their
//! rewards, then [`GrpoConfig::num_iterations`] passes of optimizer steps over it, as TRL's
//! `GRPOTrainer` orders them.
//!
//! Owns the order of generation, scoring and updates. Must not own the loss
//! ([`crate::grpo`]) nor a step ([`crate::train`]).
use super::Flow;
use crate::comm::{all_gather_values, all_reduce_values, ProcessGroup, ReduceOp};
use crate::data::{Batch, PromptSet, RowSet, Step};
use crate::engine::with_seed;
use crate::engine::Engine;
use crate::generate::generate_streams;
use crate::grpo::{advantages, GrpoConfig, GrpoMetrics, GrpoObjective, RewardScaling, Rollouts};
use crate::train::{token_input, Feed, KeptWeights, LoraReference, StepReport, Trainer};
use crate::{Error, Result};
use std::collections::btree_map::{BTreeMap, Entry};
use std::sync::Arc;
use tch::Tensor;

/// A generation batch's completion as a reward function reads it.
pub struct Sample<'a> {
    /// The prompt's tokens.
    pub prompt: &'a [i64],
    /// The completion's tokens (its stop token, where one ended it, last).
    pub completion: &'a [i64],
    /// Which prompt of the data the completion answers (its record, counting from 0).
    pub record: usize,
}

/// Rewards of a generation batch's completions, one each, in their order (NaN: none
/// could be given; such a completion's advantage is 0).
pub type RewardFn = Arc<dyn Fn(&[Sample<'_>]) -> Result<Vec<f64>> + Send + Sync>;

/// A GRPO run's parameters beside the run's: TRL's configuration, the reward, and the
/// tokens that end a completion and pad a row (the tokenizer's).
#[derive(Clone)]
pub struct GrpoRun {
    /// TRL's `GRPOConfig` fields.
    pub config: GrpoConfig,
    /// The completions' rewards.
    pub reward: RewardFn,
    /// Tokens that end a completion (the end-of-sequence tokens).
    pub stop_tokens: Vec<i64>,
    /// The token rows are padded with.
    pub pad: i64,
}

/// Where a run's GRPO stands: its prompts, this rank's share of each generation batch and
/// the group its ranks average over.
pub(super) struct Setup<'a> {
    pub prompts: &'a PromptSet,
    pub run: &'a GrpoRun,
    /// Micro-batches per optimizer step.
    pub accumulation: usize,
    /// Completions per micro-batch on each rank.
    pub micro_rows: usize,
    pub data_rank: usize,
    pub data_world: usize,
    /// Every data rank, where there are several.
    pub group: Option<&'a dyn ProcessGroup>,
    /// Every rank of the run, where there are several.
    pub world: Option<&'a dyn ProcessGroup>,
    /// Seeds the prompts' order and the sampling.
    pub seed: u64,
}

impl Setup<'_> {
    /// Micro-batches per generation batch.
    fn per_generation(&self) -> usize {
        self.run.config.steps_per_generation.unwrap_or(self.accumulation)
    }

    /// Prompts per generation batch on each rank, refused where the completions do not make
    /// whole groups.
    fn prompts_per_rank(&self) -> Result<usize> {
        let completions = self.micro_rows * self.per_generation();
        let group = self.run.config.num_generations;
        if !completions.is_multiple_of(group) {
            return Err(Error::Config(format!(
                "grpo: a rank's generation batch of {completions} completions ({} a micro-batch, {} micro-batches) is \
                 not whole groups of num_generations {group}",
                self.micro_rows,
                self.per_generation()
            )));
        }
        Ok(completions / group)
    }

    /// This rank's prompts of generation batch `g` (record numbers): the prompts in an order
    /// shuffled anew each epoch by the seed, each generation batch the next of them over
    /// every rank, each rank its consecutive share.
    fn prompts_of(&self, g: usize) -> Result<Vec<usize>> {
        let n = self.prompts.len();
        let mine = self.prompts_per_rank()?;
        let first = (g * self.data_world + self.data_rank) * mine;
        let mut orders: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
        let mut out = Vec::with_capacity(mine);
        for k in first..first + mine {
            let epoch = k / n;
            let order = match orders.entry(epoch) {
                Entry::Occupied(o) => o.into_mut(),
                Entry::Vacant(v) => {
                    let order = with_seed(self.seed.wrapping_add(epoch as u64) as i64, || {
                        Tensor::f_randperm(n as i64, (tch::Kind::Int64, tch::Device::Cpu))
                    })?;
                    v.insert(Vec::<i64>::try_from(order)?)
                }
            };
            out.push(order[k % n] as usize);
        }
        Ok(out)
    }
}

/// The KL term's reference model a run holds.
pub(super) enum ReferenceModel {
    /// None (`beta` = 0).
    None,
    /// LoRA's model as it started.
    Lora(LoraReference),
    /// A frozen copy of the model as it started.
    Copy(Box<Engine>),
    /// The weights this rank's parts started with, swapped in while they score: the frozen
    /// model where pipeline stages split it.
    Kept(KeptWeights),
}

impl ReferenceModel {
    fn as_reference(&mut self) -> Reference<'_> {
        match self {
            ReferenceModel::None => Reference::None,
            ReferenceModel::Lora(base) => Reference::Lora(base),
            ReferenceModel::Copy(engine) => Reference::Copy(engine),
            ReferenceModel::Kept(weights) => Reference::Kept(weights),
        }
    }
}

/// GRPO until `after` says stop: each generation batch's prompts completed by the model,
/// rewarded, and trained on, every step's report handed to `after`.
pub(super) fn train(
    trainer: &mut Trainer,
    objective: &Arc<GrpoObjective>,
    setup: &Setup<'_>,
    mut reference: ReferenceModel,
    after: &mut dyn FnMut(&mut Trainer, StepReport) -> Result<Flow>,
) -> Result<()> {
    let c = objective.config();
    let micro_per_generation = setup.per_generation() * c.num_iterations;
    loop {
        // A resumed run starts at the next whole generation batch.
        let done = trainer.step() as usize * setup.accumulation;
        let g = done.div_ceil(micro_per_generation);
        let records = setup.prompts_of(g)?;
        let prompts: Vec<(usize, Vec<i64>)> = records.iter().map(|&r| (r, setup.prompts.prompt(r))).collect();
        // Each prompt's group draws from its own seed: the completions do not depend on
        // how prompts fall to ranks.
        let seed = setup.seed.wrapping_mul(0x9e37_79b9).wrapping_add(g as u64);
        let (mut rollouts, records) = generate_rollouts(trainer, objective, &prompts, &setup.run.stop_tokens, seed)?;
        let samples: Vec<Sample> = (0..rollouts.len())
            .map(|i| Sample { prompt: &rollouts.prompts[i], completion: &rollouts.completions[i], record: records[i] })
            .collect();
        let rewards = (setup.run.reward)(&samples)?;
        if rewards.len() != rollouts.len() {
            return Err(Error::Data(format!(
                "the reward gave {} rewards for {} completions",
                rewards.len(),
                rollouts.len()
            )));
        }
        rollouts.rewards = rewards;
        let kl = reference.as_reference();
        let steps = StepShape {
            pad: setup.run.pad,
            accumulation: setup.accumulation,
            group: setup.group,
            report_over: setup.world,
        };
        let flow = train_rollouts(trainer, objective, &rollouts, kl, &steps, after)?;
        if flow == Flow::Stop {
            return Ok(());
        }
    }
}

/// Each of `prompts` (its record and tokens) completed `num_generations` times by the
/// trainer's model, every prompt's group decoded together with the key/value cache and
/// sampled as `objective`'s configuration says, each group from a stream seeded by `seed`
/// and its record (so its completions do not depend on the prompts beside it), ending at a
/// stop token or the most completion tokens; rewards left NaN for the caller to give.
/// Returns each completion's record too.
pub fn generate_rollouts(
    trainer: &mut Trainer,
    objective: &GrpoObjective,
    prompts: &[(usize, Vec<i64>)],
    stop_tokens: &[i64],
    seed: u64,
) -> Result<(Rollouts, Vec<usize>)> {
    let c = objective.config();
    trainer.settle_updates()?;
    let vocabulary = objective.vocabulary_split();
    let sampling = c.sampling(seed, stop_tokens.to_vec());
    let rows: Vec<(usize, &Vec<i64>)> =
        prompts.iter().flat_map(|(record, prompt)| std::iter::repeat_n((*record, prompt), c.num_generations)).collect();
    let texts: Vec<Vec<i64>> = rows.iter().map(|(_, prompt)| (*prompt).clone()).collect();
    let streams: Vec<u64> =
        rows.iter().map(|(record, _)| seed.wrapping_mul(1_000_003).wrapping_add(*record as u64)).collect();
    let completions = generate_streams(trainer, vocabulary.as_ref(), &texts, &streams, &sampling, None)?;
    let mut rollouts = Rollouts::default();
    for ((_, prompt), completion) in rows.iter().zip(completions) {
        rollouts.truncated.push(completion.last().is_none_or(|t| !stop_tokens.contains(t)));
        rollouts.completions.push(completion);
        rollouts.prompts.push((*prompt).clone());
        rollouts.rewards.push(f64::NAN);
    }
    let records = rows.iter().map(|(record, _)| *record).collect();
    Ok((rollouts, records))
}

/// Where the KL term's reference log-probabilities come from.
pub enum Reference<'a> {
    /// None is read (`beta` = 0).
    None,
    /// LoRA's model as it started.
    Lora(&'a mut LoraReference),
    /// A frozen copy of the model as it started.
    Copy(&'a mut Engine),
    /// The weights the trainer's parts started with, swapped in while they score.
    Kept(&'a mut KeptWeights),
}

/// How a generation batch's rows become optimizer steps.
#[derive(Clone, Copy)]
pub struct StepShape<'a> {
    /// The token rows are padded with.
    pub pad: i64,
    /// Micro-batches per optimizer step.
    pub accumulation: usize,
    /// The data-parallel ranks, each with its own generation batch of the same size.
    pub group: Option<&'a dyn ProcessGroup>,
    /// Every rank that may compute some of the loss (all of them): the loss's metrics are
    /// ratios of sums over it, to which ranks that score nothing (a pipeline's earlier
    /// stages) add nothing and the ranks of a tensor group add alike.
    pub report_over: Option<&'a dyn ProcessGroup>,
}

/// Trains on one generation batch whose rewards are given: its advantages, the old and
/// reference log-probabilities where the loss reads them, then `num_iterations` passes over
/// its micro-batches (`steps_per_generation` of them, `steps.accumulation` to an optimizer
/// step).
/// The trainer's loss becomes `objective`'s. Each step's report, with GRPO's metrics, goes
/// to `after`, which may stop the passes (what it said last is returned).
pub fn train_rollouts(
    trainer: &mut Trainer,
    objective: &Arc<GrpoObjective>,
    rollouts: &Rollouts,
    mut reference: Reference<'_>,
    steps: &StepShape<'_>,
    after: &mut dyn FnMut(&mut Trainer, StepReport) -> Result<Flow>,
) -> Result<Flow> {
    let StepShape { pad, accumulation, group, report_over } = *steps;
    let c = objective.config();
    let per_generation = c.steps_per_generation.unwrap_or(accumulation);
    let micro_batches = per_generation * c.num_iterations;
    if accumulation == 0 || !micro_batches.is_multiple_of(accumulation) {
        return Err(Error::Config(format!(
            "grpo: {per_generation} micro-batches per generation times {} iterations is not a whole number of steps \
             of {accumulation} micro-batches",
            c.num_iterations
        )));
    }
    if !rollouts.len().is_multiple_of(per_generation) {
        return Err(Error::Config(format!(
            "grpo: a generation batch of {} completions does not split into {per_generation} micro-batches",
            rollouts.len()
        )));
    }
    let rows = rollouts.len() / per_generation;
    // Batch scaling's spread is every data rank's generation batch's, as TRL gathers them.
    let batch = match (c.scale_rewards, group) {
        (RewardScaling::Batch, Some(g)) => all_gather_values(g, &rollouts.rewards)?,
        _ => rollouts.rewards.clone(),
    };
    let (advantages, zero_spread) = advantages(&rollouts.rewards, &batch, c.num_generations, c.scale_rewards);
    // The tokens the dapo-normalised losses divide by: every rank's, per rank, per micro-batch window.
    // Completion tokens each micro-batch learns (a truncated one's none where those are masked).
    let learned: Vec<usize> = (0..per_generation)
        .map(|m| {
            let learns = |i: &usize| !(c.mask_truncated_completions && rollouts.truncated[*i]);
            (m * rows..(m + 1) * rows).filter(learns).map(|i| rollouts.completions[i].len()).sum()
        })
        .collect();
    let mine: usize = learned.iter().sum();
    let (tokens, ranks) = match group {
        Some(g) => (all_reduce_values(g, &[mine as f64], ReduceOp::Sum)?[0], g.size()),
        None => (mine as f64, 1),
    };
    // TRL divides the token sum of a micro-batch by every rank's generation batch's tokens
    // over the ranks, times the accumulation over the micro-batches per generation, and
    // does not divide these losses by the accumulation; the trainer weighs every
    // micro-batch by one over it, so it is left out here.
    let normalizer = tokens.max(1.0) / ranks as f64 / per_generation as f64;
    let device = trainer.engine().config().device;
    // A sequence-parallel group splits every row's positions evenly.
    let split = trainer.engine().tensor_parallel().filter(|t| t.sequence_parallel()).map_or(1, |t| t.size() as usize);
    let mut batches = (0..per_generation)
        .map(|s| {
            objective
                .batch(rollouts, s * rows..(s + 1) * rows, &advantages, normalizer, (pad, split))?
                .to_device(device)
        })
        .collect::<Result<Vec<Batch>>>()?;
    trainer.settle_updates()?;
    // The completions came from the model as it is now: a later pass over them measures its
    // ratio against these (TRL computes them where generation and updates do not align).
    if !accumulation.is_multiple_of(micro_batches) {
        let old = token_log_probs(trainer, objective, &batches)?;
        for (batch, old) in batches.iter_mut().zip(old) {
            if let Some(r) = batch.rollout.as_mut() {
                r.old = old;
            }
        }
    }
    if c.beta != 0.0 {
        let scores = match &mut reference {
            Reference::None => {
                return Err(Error::Config(
                    "grpo: beta > 0 needs a reference model (a copy, or LoRA's starting model)".into(),
                ))
            }
            Reference::Lora(base) => base.scoring(trainer, |t| token_log_probs(t, objective, &batches))?,
            Reference::Copy(engine) => {
                batches.iter().map(|batch| copy_log_probs(engine, objective, batch).map(Some)).collect::<Result<_>>()?
            }
            Reference::Kept(weights) => weights.scoring(trainer, |t| token_log_probs(t, objective, &batches))?,
        };
        for (batch, scores) in batches.iter_mut().zip(scores) {
            if let Some(r) = batch.rollout.as_mut() {
                r.reference = scores;
            }
        }
    }
    trainer.set_feed(&Feed { input: token_input(), loss: Some(objective.loss_fn()) });
    let data_ranks = group.map_or(1, |g| g.size());
    let generation = GrpoMetrics::of_rollouts(rollouts, &zero_spread, group)?;
    let order: Vec<usize> = (0..micro_batches).map(|m| m % per_generation).collect();
    for chunk in order.chunks(accumulation) {
        let micro = chunk.iter().map(|&m| batches[m].to_device(device)).collect::<Result<Vec<Batch>>>()?;
        let step = Step {
            index: trainer.step() as usize,
            micro_batches: micro,
            global_supervised: (accumulation * data_ranks) as u64,
            data_ranks,
        };
        // The step's learned completion tokens, every rank's.
        let mine = chunk.iter().map(|&m| learned[m]).sum::<usize>() as f64;
        let supervised = match group {
            Some(g) => all_reduce_values(g, &[mine], ReduceOp::Sum)?[0],
            None => mine,
        };
        objective.reset();
        let mut report = trainer.train_step(&step)?;
        report.supervised_tokens = supervised as u64;
        let mut metrics = generation;
        objective.take_metrics(report_over, &mut metrics)?;
        report.grpo = Some(metrics);
        if after(trainer, report)? == Flow::Stop {
            return Ok(Flow::Stop);
        }
    }
    Ok(Flow::Continue)
}

/// The trainer's per-position log-probabilities of each of `batches`' targets (`[rows,
/// positions]`), forward only, where this rank scores the model's output (`None` on a
/// pipeline's earlier stages, which never read them).
fn token_log_probs(
    trainer: &mut Trainer,
    objective: &Arc<GrpoObjective>,
    batches: &[Batch],
) -> Result<Vec<Option<Tensor>>> {
    let steps = super::steps_of(batches, trainer.engine().config().device)?;
    let recorded = Arc::new(std::sync::Mutex::new(vec![]));
    let record = recorded.clone();
    let objective = Arc::clone(objective);
    let loss: crate::train::LossFn = Arc::new(move |logits: &Tensor, batch: &Batch| {
        let scores = objective.token_log_probs(logits, batch)?;
        record.lock().unwrap_or_else(|e| e.into_inner()).push(scores);
        Ok(Tensor::f_zeros([], (tch::Kind::Float, logits.device()))?)
    });
    trainer.set_feed(&Feed { input: token_input(), loss: Some(loss) });
    trainer.evaluate(&steps)?;
    let recorded = std::mem::take(&mut *recorded.lock().unwrap_or_else(|e| e.into_inner()));
    match recorded.len() {
        0 => Ok(batches.iter().map(|_| None).collect()),
        n if n == batches.len() => Ok(recorded.into_iter().map(Some).collect()),
        n => Err(Error::Engine(format!("{n} log-probabilities for {} micro-batches", batches.len()))),
    }
}

/// A whole copy's per-position log-probabilities of `batch`'s targets (`[rows, positions]`).
fn copy_log_probs(engine: &mut Engine, objective: &GrpoObjective, batch: &Batch) -> Result<Tensor> {
    objective.token_log_probs(&super::copy_logits(engine, batch)?, batch)
}
