//! Reward models: a decoder with a score head ([`crate::model::DecoderHead::Reward`])
//! trained on preference pairs with the Bradley–Terry loss, as TRL's `RewardTrainer` trains
//! it — the same optional margin and centring, the same metrics under the same names.
//!
//! A row's reward is the head's score at its last token that is not the padding token (how
//! `transformers`' sequence classifiers pool, the padding token included where a text ends
//! with it); the loss is `-log σ(r_chosen - r_rejected - margin)`, averaged over pairs.
//!
//! Owns: the pooling, the loss and the step's metrics. Must not read records
//! (`data::PreferenceSet` does) nor run the model: it scores the scores the engine's last
//! unit returns.
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::data::Batch;
use crate::preference::ScoreFn;
use crate::{Error, Result};
use serde::Serialize;
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// How a reward model's pairs are scored: TRL's `RewardConfig` field of the same name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RewardConfig {
    /// Adds this times the mean of each pair's summed rewards squared, which draws the
    /// rewards towards zero (`None`: nothing added).
    pub center_rewards_coefficient: Option<f64>,
    /// The padding token, by which each row's last token is found (`None`: the model's
    /// `pad_token_id`). TRL takes the tokenizer's padding token, else its end token.
    pub pad_token: Option<i64>,
}

/// A step's reward-model metrics, named as TRL logs them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RewardMetrics {
    /// The share of pairs whose chosen reward exceeds the rejected one.
    pub accuracy: f64,
    /// Mean chosen reward minus rejected reward.
    pub margin: f64,
    /// The least reward of any row of the step.
    pub min_reward: f64,
    /// The mean reward over every row of the step.
    pub mean_reward: f64,
    /// The greatest reward of any row of the step.
    pub max_reward: f64,
}

/// Sums and extremes over a step's micro-batches, added over ranks.
#[derive(Clone, Copy, Debug)]
struct Tally {
    /// Pairs, pairs ranked right, summed margins, summed rewards, rows.
    sums: [f64; 5],
    /// The greatest reward and the negated least one.
    extremes: [f64; 2],
}

impl Default for Tally {
    fn default() -> Self {
        Tally { sums: [0.0; 5], extremes: [f64::NEG_INFINITY; 2] }
    }
}

impl Tally {
    fn add(&mut self, other: &Tally) {
        for (a, b) in self.sums.iter_mut().zip(other.sums) {
            *a += b;
        }
        for (a, b) in self.extremes.iter_mut().zip(other.extremes) {
            *a = a.max(b);
        }
    }

    fn metrics(&self) -> RewardMetrics {
        let [pairs, accurate, margins, rewards, rows] = self.sums;
        RewardMetrics {
            accuracy: accurate / pairs,
            margin: margins / pairs,
            min_reward: -self.extremes[1],
            mean_reward: rewards / rows,
            max_reward: self.extremes[0],
        }
    }
}

/// A reward model's scoring for a run: the loss function the trainer calls on each
/// micro-batch of pairs, and the tally of the metrics since the last reading.
pub struct RewardObjective {
    config: RewardConfig,
    /// The padding token: a row's reward is read at its last other token.
    pad: i64,
    tally: Mutex<Tally>,
}

impl RewardObjective {
    /// Scoring by `config` of rows padded with `pad`.
    pub fn new(config: RewardConfig, pad: i64) -> Result<Arc<RewardObjective>> {
        if config.center_rewards_coefficient.is_some_and(|c| !(c >= 0.0 && c.is_finite())) {
            return Err(Error::Config(format!(
                "center_rewards_coefficient {:?} must be a number at least 0",
                config.center_rewards_coefficient
            )));
        }
        Ok(Arc::new(RewardObjective { config, pad, tally: Mutex::new(Tally::default()) }))
    }

    /// The loss of a micro-batch of pairs from the model's scores `[rows, ctx, 1]`: the
    /// mean over its pairs of the Bradley–Terry loss (with the centring term).
    pub fn loss_fn(self: &Arc<Self>) -> ScoreFn {
        let this = self.clone();
        Arc::new(move |scores: &Tensor, batch: &Batch| this.loss(scores, batch))
    }

    /// Forgets what was tallied (before a step whose metrics are read after it).
    pub fn reset(&self) {
        *self.tally.lock().unwrap_or_else(|e| e.into_inner()) = Tally::default();
    }

    /// The metrics of the micro-batches scored since the last reset, over every rank of
    /// `group` (ranks that scored nothing add nothing); `None` where nothing was scored.
    pub fn take_metrics(&self, group: Option<&dyn ProcessGroup>) -> Result<Option<RewardMetrics>> {
        let mut all = std::mem::take(&mut *self.tally.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(g) = group {
            let lost = || Error::Comm("the metrics' all-reduce lost values".into());
            all.sums = all_reduce_values(g, &all.sums, ReduceOp::Sum)?.try_into().map_err(|_| lost())?;
            all.extremes = all_reduce_values(g, &all.extremes, ReduceOp::Max)?.try_into().map_err(|_| lost())?;
        }
        Ok((all.sums[0] > 0.0).then(|| all.metrics()))
    }

    /// Each row's reward: its score at its last token that is not the padding token.
    fn rewards(&self, scores: &Tensor, inputs: &Tensor) -> Result<Tensor> {
        let shape = scores.size();
        if shape.len() != 3 || shape[2] != 1 {
            return Err(Error::Config(format!(
                "a reward model scores each position once ([rows, positions, 1]), not {shape:?}: train a model \
                 whose head is a reward model's (a sequence classifier of one label)"
            )));
        }
        let inputs = inputs.f_to_device(scores.device())?;
        let positions = Tensor::f_arange(inputs.size()[1], (Kind::Int64, scores.device()))?;
        let last = positions.f_mul(&inputs.f_ne(self.pad)?)?.f_argmax(-1, true)?;
        let scores = scores.f_squeeze_dim(-1)?;
        let scores = match scores.kind() {
            Kind::Double => scores,
            _ => scores.f_to_kind(Kind::Float)?,
        };
        Ok(scores.f_gather(1, &last, false)?.f_squeeze_dim(1)?)
    }

    fn loss(&self, scores: &Tensor, batch: &Batch) -> Result<Tensor> {
        let rewards = self.rewards(scores, &batch.inputs)?;
        let n = rewards.size()[0] / 2;
        if rewards.size()[0] != 2 * n {
            return Err(Error::Data(format!("a batch of pairs has an even number of rows, not {}", 2 * n + 1)));
        }
        let (chosen, rejected) = (rewards.f_narrow(0, 0, n)?, rewards.f_narrow(0, n, n)?);
        let gap = chosen.f_sub(&rejected)?;
        let pushed = match &batch.margin {
            Some(m) => gap.f_sub(&m.f_to_device(gap.device())?.f_to_kind(gap.kind())?)?,
            None => gap.shallow_clone(),
        };
        let mut loss = pushed.f_log_sigmoid()?.f_mean(gap.kind())?.f_neg()?;
        if let Some(c) = self.config.center_rewards_coefficient {
            let centring = chosen.f_add(&rejected)?.f_square()?.f_mean(gap.kind())?;
            loss = loss.f_add(&centring.f_mul_scalar(c)?)?;
        }
        self.record(&rewards, &gap)?;
        Ok(loss)
    }

    /// Adds the micro-batch's sums and extremes to the tally.
    fn record(&self, rewards: &Tensor, gap: &Tensor) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let value = |t: Tensor| -> Result<f64> { Ok(t.f_to_kind(Kind::Double)?.f_double_value(&[])?) };
        let (rewards, gap) = (rewards.f_detach()?, gap.f_detach()?);
        let tally = Tally {
            sums: [
                gap.size()[0] as f64,
                value(gap.f_gt(0.0)?.f_sum(Kind::Double)?)?,
                value(gap.f_sum(Kind::Double)?)?,
                value(rewards.f_sum(Kind::Double)?)?,
                rewards.size()[0] as f64,
            ],
            extremes: [value(rewards.f_max()?)?, -value(rewards.f_min()?)?],
        };
        self.tally.lock().unwrap_or_else(|e| e.into_inner()).add(&tally);
        Ok(())
    }
}
