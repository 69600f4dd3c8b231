//! GRPO's loop over a trainer: a generation batch of completions (each prompt
//! [`GrpoConfig::num_generations`] times, decoded together with the key/value cache), their
//! rewards, then [`GrpoConfig::num_iterations`] passes of optimizer steps over it, as TRL's
//! `GRPOTrainer` orders them.
//!
//! Owns the order of generation, scoring and updates. Must not own the loss
//! ([`crate::grpo`]) nor a step ([`crate::train`]).
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::data::{Batch, Step};
use crate::engine::Engine;
use crate::generate::{generate_batch, GenerateConfig};
use crate::grpo::{advantages, GrpoMetrics, GrpoObjective, Rollouts};
use crate::train::{set_rows, token_input, Feed, StepReport, Trainer};
use crate::{Error, Result};
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

/// Each of `prompts` (its record and tokens) completed `num_generations` times by the
/// trainer's model, sampling as `objective`'s configuration says from `seed`, ending at a
/// stop token or the most completion tokens; rewards left NaN for the caller to give.
pub fn generate_rollouts(
    trainer: &mut Trainer,
    objective: &GrpoObjective,
    prompts: &[(usize, Vec<i64>)],
    stop_tokens: &[i64],
    seed: u64,
) -> Result<(Rollouts, Vec<usize>)> {
    let c = objective.config();
    let repeated: Vec<Vec<i64>> =
        prompts.iter().flat_map(|(_, p)| std::iter::repeat_n(p.clone(), c.num_generations)).collect();
    let records: Vec<usize> = prompts.iter().flat_map(|(r, _)| std::iter::repeat_n(*r, c.num_generations)).collect();
    let sampling = GenerateConfig {
        max_new_tokens: c.max_completion_length,
        temperature: c.temperature,
        top_k: c.top_k,
        top_p: c.top_p,
        seed,
        stop_tokens: stop_tokens.to_vec(),
        cache: true,
    };
    trainer.settle_updates()?;
    let engine = trainer.engine_mut();
    let completions = generate_batch(engine, &repeated, &sampling, None)?;
    let truncated =
        completions.iter().map(|c| c.last().is_none_or(|t| !stop_tokens.contains(t))).collect::<Vec<bool>>();
    let rewards = vec![f64::NAN; completions.len()];
    Ok((Rollouts { prompts: repeated, completions, truncated, rewards }, records))
}

/// Where the KL term's reference log-probabilities come from.
pub enum Reference<'a> {
    /// None is read (`beta` = 0).
    None,
    /// The trainer's model with its LoRA adapters switched off: the frozen base.
    Base,
    /// A frozen copy of the model as it started.
    Copy(&'a mut Engine),
}

/// Trains on one generation batch whose rewards are given: its advantages, the old and
/// reference log-probabilities where the loss reads them, then `num_iterations` passes over
/// its micro-batches (`steps_per_generation` of them, `accumulation` to an optimizer step).
/// `group`: the data-parallel ranks, each with its own generation batch of the same size.
/// The trainer's loss becomes `objective`'s. Returns each step's report with GRPO's metrics.
pub fn train_rollouts(
    trainer: &mut Trainer,
    objective: &Arc<GrpoObjective>,
    rollouts: &Rollouts,
    pad: i64,
    mut reference: Reference<'_>,
    accumulation: usize,
    group: Option<&dyn ProcessGroup>,
) -> Result<Vec<StepReport>> {
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
    let (advantages, _) = advantages(&rollouts.rewards, c.num_generations, c.scale_rewards);
    // The tokens the dapo-normalised losses divide by: every rank's, per rank, per micro-batch window.
    let learned = |i: usize| !(c.mask_truncated_completions && rollouts.truncated[i]);
    let mine = (0..rollouts.len()).filter(|&i| learned(i)).map(|i| rollouts.completions[i].len()).sum::<usize>();
    let (tokens, ranks) = match group {
        Some(g) => (all_reduce_values(g, &[mine as f64], ReduceOp::Sum)?[0], g.size()),
        None => (mine as f64, 1),
    };
    let normalizer = tokens / ranks as f64 * accumulation as f64 / per_generation as f64;
    let device = trainer.engine().config().device;
    let mut batches = (0..per_generation)
        .map(|s| objective.batch(rollouts, s * rows..(s + 1) * rows, &advantages, normalizer, pad)?.to_device(device))
        .collect::<Result<Vec<Batch>>>()?;
    trainer.settle_updates()?;
    // The completions came from the model as it is now: a later pass over them measures its
    // ratio against these (TRL computes them where generation and updates do not align).
    if !accumulation.is_multiple_of(micro_batches) {
        for batch in &mut batches {
            let old = token_log_probs(trainer.engine_mut(), objective, batch)?;
            if let Some(r) = batch.rollout.as_mut() {
                r.old = Some(old);
            }
        }
    }
    if c.beta != 0.0 {
        for batch in &mut batches {
            let scores = match &mut reference {
                Reference::None => {
                    return Err(Error::Config("grpo: beta > 0 needs a reference model (a copy, or LoRA's base)".into()))
                }
                Reference::Base => {
                    let engine = trainer.engine_mut();
                    engine.set_adapters_enabled(false);
                    let scores = token_log_probs(engine, objective, batch);
                    engine.set_adapters_enabled(true);
                    scores?
                }
                Reference::Copy(engine) => token_log_probs(engine, objective, batch)?,
            };
            if let Some(r) = batch.rollout.as_mut() {
                r.reference = Some(scores);
            }
        }
    }
    trainer.set_feed(&Feed { input: token_input(), loss: Some(objective.loss_fn()) });
    let data_ranks = group.map_or(1, |g| g.size());
    let generation = GrpoMetrics::of_rollouts(rollouts, c.num_generations, c.scale_rewards);
    let order: Vec<usize> = (0..micro_batches).map(|m| m % per_generation).collect();
    let mut reports = vec![];
    for chunk in order.chunks(accumulation) {
        let micro = chunk.iter().map(|&m| batches[m].to_device(device)).collect::<Result<Vec<Batch>>>()?;
        let step = Step {
            index: trainer.step() as usize,
            micro_batches: micro,
            global_supervised: (accumulation * data_ranks) as u64,
            data_ranks,
        };
        objective.reset();
        let mut report = trainer.train_step(&step)?;
        let mut metrics = generation;
        objective.take_metrics(group, &mut metrics)?;
        report.grpo = Some(metrics);
        reports.push(report);
    }
    Ok(reports)
}

/// `engine`'s per-position log-probabilities of `batch`'s targets (`[rows, positions]`).
fn token_log_probs(engine: &mut Engine, objective: &GrpoObjective, batch: &Batch) -> Result<Tensor> {
    set_rows(engine, batch, None);
    let logits = engine.evaluate(&batch.inputs);
    engine.set_targets(None);
    objective.token_log_probs(&logits?, batch)
}
