//! GRPO (group relative policy optimisation), as TRL's `GRPOTrainer` computes it: groups of
//! completions of one prompt, each completion's advantage its reward measured against its
//! group's, and a clipped-ratio policy loss of each of the pinned TRL's `loss_type`s, with
//! the KL term at `beta > 0` and GSPO's sequence-level ratio.
//!
//! A micro-batch's rows are each a prompt followed by one completion, padded on the right;
//! the targets are the completion's tokens (the prompt and the padding are [`IGNORE`]d),
//! and [`RolloutScores`] carries the advantages and the log-probabilities the ratio and the
//! KL term are measured against.
//!
//! Owns: advantages, the loss, the rows of a generation batch, the step's metrics and how
//! completions are sampled ([`GrpoConfig::sampling`]). Must not generate, reward nor step: the training loop ([`crate::run`]) does, with the
//! trainer and [`crate::generate`].
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::data::{Batch, RolloutScores, IGNORE};
use crate::generate::GenerateConfig;
use crate::preference::{token_entropy, token_log_probs, whole_logits, ScoreFn, VocabularySplit};
use crate::{Error, Result};
use serde::Serialize;
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// How the per-token losses of a batch become one loss: TRL's `loss_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrpoLoss {
    /// The mean over completions of each completion's mean token loss.
    Grpo,
    /// The mean over the micro-batch's completion tokens.
    Bnpo,
    /// The token sum over completions times the most completion tokens (Dr. GRPO).
    DrGrpo,
    /// The token sum over the step's completion tokens, every rank's and micro-batch's (DAPO).
    Dapo,
    /// The importance weight clipped from above and detached, times the advantage and the
    /// log-probability (MiniMax-M1); normalised as `dapo`.
    Cispo,
    /// A sigmoid gate in place of the clip (soft adaptive policy optimisation); normalised as `grpo`.
    Sapo,
    /// Each completion's token sum, averaged over completions (length-unbiased GSPO).
    Luspo,
    /// A gamma weighting of the sequence's importance weight, detached, times the advantage
    /// and the log-probability; normalised as `dapo`.
    Vespo,
}

impl GrpoLoss {
    /// Every loss, in TRL's order.
    pub fn all() -> [GrpoLoss; 8] {
        use GrpoLoss::*;
        [Grpo, Bnpo, DrGrpo, Dapo, Cispo, Sapo, Luspo, Vespo]
    }

    /// TRL's name of the loss.
    pub fn name(self) -> &'static str {
        use GrpoLoss::*;
        match self {
            Grpo => "grpo",
            Bnpo => "bnpo",
            DrGrpo => "dr_grpo",
            Dapo => "dapo",
            Cispo => "cispo",
            Sapo => "sapo",
            Luspo => "luspo",
            Vespo => "vespo",
        }
    }

    /// Whether the loss clips the ratio to `[1 - ε, 1 + ε_high]` (and logs the clipped share).
    fn clips(self) -> bool {
        matches!(self, GrpoLoss::Grpo | GrpoLoss::Bnpo | GrpoLoss::DrGrpo | GrpoLoss::Dapo | GrpoLoss::Luspo)
    }
}

impl std::str::FromStr for GrpoLoss {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        GrpoLoss::all().into_iter().find(|l| l.name() == s).ok_or_else(|| {
            let names: Vec<&str> = GrpoLoss::all().iter().map(|l| l.name()).collect();
            Error::Config(format!("unknown GRPO loss type {s:?}: one of {}", names.join(", ")))
        })
    }
}

/// Whether the importance weight is taken per token or once per completion (GSPO).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportanceSampling {
    /// One weight per token: `exp(log π - log π_old)`.
    Token,
    /// One weight per completion: the exponential of its mean token log-ratio.
    Sequence,
}

impl std::str::FromStr for ImportanceSampling {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "token" => Ok(ImportanceSampling::Token),
            "sequence" => Ok(ImportanceSampling::Sequence),
            _ => Err(Error::Config(format!("importance sampling level {s:?}: token or sequence"))),
        }
    }
}

/// What a reward is divided by after its group's mean is taken away: TRL's `scale_rewards`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RewardScaling {
    /// The standard deviation of its group's rewards.
    Group,
    /// The standard deviation of the whole generation batch's rewards.
    Batch,
    /// Nothing (Dr. GRPO).
    None,
}

impl std::str::FromStr for RewardScaling {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "group" | "true" => Ok(RewardScaling::Group),
            "batch" => Ok(RewardScaling::Batch),
            "none" | "false" => Ok(RewardScaling::None),
            _ => Err(Error::Config(format!("scale_rewards {s:?}: group, batch or none"))),
        }
    }
}

/// GRPO's parameters, named and defaulted as TRL's `GRPOConfig` names them.
#[derive(Clone, Debug, PartialEq)]
pub struct GrpoConfig {
    /// Completions generated for each prompt: one group.
    pub num_generations: usize,
    /// The most tokens of a completion.
    pub max_completion_length: usize,
    /// Sampling temperature; the log-probabilities are of the logits divided by it too.
    pub temperature: f64,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities first reach `p` together.
    pub top_p: Option<f64>,
    /// Sample among the tokens at least this fraction as likely as the most likely one.
    pub min_p: Option<f64>,
    /// The repetition penalty of sampling (1: none), as [`GenerateConfig::repetition_penalty`].
    ///
    /// [`GenerateConfig::repetition_penalty`]: crate::generate::GenerateConfig::repetition_penalty
    pub repetition_penalty: f64,
    /// The loss.
    pub loss: GrpoLoss,
    /// The KL term's coefficient (0: no reference model is read).
    pub beta: f64,
    /// The ratio's lower clip, `1 - epsilon`.
    pub epsilon: f64,
    /// The ratio's upper clip, `1 + epsilon_high` (`None`: `epsilon`); `cispo`'s clip of the weight.
    pub epsilon_high: Option<f64>,
    /// Clips the unclipped ratio from above too (two-sided GRPO), where given.
    pub delta: Option<f64>,
    /// Token-level ratios, or GSPO's one per completion.
    pub importance_sampling: ImportanceSampling,
    /// How rewards are scaled into advantages.
    pub scale_rewards: RewardScaling,
    /// Updates on each generation batch (μ).
    pub num_iterations: usize,
    /// Micro-batches one generation batch is cut into (`None`: the run's accumulation).
    pub steps_per_generation: Option<usize>,
    /// Leave completions cut at the most tokens out of the loss.
    pub mask_truncated_completions: bool,
    /// Multiply the KL term by the importance weight (DeepSeek-V3.2's unbiased estimate).
    pub use_bias_correction_kl: bool,
    /// `sapo`'s gate temperature where the advantage is positive.
    pub sapo_temperature_pos: f64,
    /// `sapo`'s gate temperature where the advantage is not.
    pub sapo_temperature_neg: f64,
    /// `vespo`'s power and decay where the advantage is at least 0.
    pub vespo_pos: (f64, f64),
    /// `vespo`'s power and decay where the advantage is negative.
    pub vespo_neg: (f64, f64),
}

impl Default for GrpoConfig {
    /// TRL 1.16's defaults.
    fn default() -> Self {
        GrpoConfig {
            num_generations: 8,
            max_completion_length: 512,
            temperature: 1.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: 1.0,
            loss: GrpoLoss::Dapo,
            beta: 0.0,
            epsilon: 0.2,
            epsilon_high: None,
            delta: None,
            importance_sampling: ImportanceSampling::Token,
            scale_rewards: RewardScaling::Group,
            num_iterations: 1,
            steps_per_generation: None,
            mask_truncated_completions: false,
            use_bias_correction_kl: true,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            vespo_pos: (2.0, 3.0),
            vespo_neg: (3.0, 2.0),
        }
    }
}

impl GrpoConfig {
    /// Refuses what TRL refuses and what cannot be computed, in one line naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Config(format!("grpo: {why}")));
        if self.num_generations < 2 {
            return bad(format!(
                "num_generations must be at least 2 (a group's mean needs two), got {}",
                self.num_generations
            ));
        }
        if self.max_completion_length == 0 || self.num_iterations == 0 || self.steps_per_generation == Some(0) {
            return bad("max_completion_length, num_iterations and steps_per_generation must be positive".into());
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return bad(format!("temperature must be positive, got {}", self.temperature));
        }
        if !(self.beta >= 0.0 && self.epsilon >= 0.0 && self.epsilon_high.unwrap_or(0.0) >= 0.0) {
            return bad("beta, epsilon and epsilon_high must be at least 0".into());
        }
        if self.loss == GrpoLoss::Luspo && self.importance_sampling != ImportanceSampling::Sequence {
            return bad("luspo takes the sequence-level ratio (importance_sampling_level sequence)".into());
        }
        self.sampling(0, vec![]).validate().map_err(|e| match e {
            Error::Config(why) => Error::Config(format!("grpo: {why}")),
            other => other,
        })
    }

    /// How completions are sampled: as configured, from `seed`, ending at `stop_tokens`,
    /// decoded with the key/value cache.
    pub fn sampling(&self, seed: u64, stop_tokens: Vec<i64>) -> GenerateConfig {
        GenerateConfig {
            max_new_tokens: self.max_completion_length,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed,
            stop_tokens,
            cache: true,
        }
    }

    fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }
}

/// A generation batch: completions in groups of [`GrpoConfig::num_generations`] (the
/// rows of one group consecutive and of one prompt), and each completion's reward.
#[derive(Clone, Debug, Default)]
pub struct Rollouts {
    /// Each completion's prompt.
    pub prompts: Vec<Vec<i64>>,
    /// The completions (a stop token, where one ended it, last).
    pub completions: Vec<Vec<i64>>,
    /// Whether each completion was cut at the most tokens rather than ended by a stop token.
    pub truncated: Vec<bool>,
    /// Each completion's reward; NaN where none could be given (its advantage is then 0).
    pub rewards: Vec<f64>,
}

impl Rollouts {
    /// The completions' count.
    pub fn len(&self) -> usize {
        self.completions.len()
    }

    /// Whether it holds no completion.
    pub fn is_empty(&self) -> bool {
        self.completions.is_empty()
    }

    fn check(&self, group: usize) -> Result<()> {
        let n = self.completions.len();
        if self.prompts.len() != n || self.truncated.len() != n || self.rewards.len() != n {
            return Err(Error::Data(format!(
                "rollouts: {} prompts, {n} completions, {} truncation marks and {} rewards",
                self.prompts.len(),
                self.truncated.len(),
                self.rewards.len()
            )));
        }
        if n == 0 || !n.is_multiple_of(group) {
            return Err(Error::Data(format!("rollouts: {n} completions are not whole groups of {group}")));
        }
        Ok(())
    }
}

/// The mean of the numbers that are not NaN, and their standard deviation with Bessel's
/// correction (NaN where fewer than two): TRL's `nanmean` and `nanstd`.
fn nan_mean_std(values: &[f64]) -> (f64, f64) {
    let kept: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    let n = kept.len() as f64;
    let mean = kept.iter().sum::<f64>() / n;
    let variance = kept.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, if kept.len() > 1 { variance.sqrt() } else { f64::NAN })
}

/// Each completion's advantage from the rewards, in groups of `group`, and per completion
/// whether the spread it was scaled by is zero (TRL's `frac_reward_zero_std`); batch
/// scaling takes the spread of `batch`, the whole generation batch's rewards (every data
/// rank's, as TRL gathers them). Computed in fp32, as TRL's tensors are, so advantages
/// agree to the last bit that matters.
pub fn advantages(rewards: &[f64], batch: &[f64], group: usize, scaling: RewardScaling) -> (Vec<f64>, Vec<bool>) {
    let round = |r: &[f64]| -> Vec<f64> { r.iter().map(|&r| r as f32 as f64).collect() };
    let (rounded, batch) = (round(rewards), nan_mean_std(&round(batch)).1);
    let mut out = Vec::with_capacity(rewards.len());
    let mut zero = Vec::with_capacity(rewards.len());
    for g in rounded.chunks(group) {
        let (mean, spread) = nan_mean_std(g);
        let std = match scaling {
            RewardScaling::Batch => batch,
            RewardScaling::Group | RewardScaling::None => spread,
        };
        for &r in g {
            let a = match scaling {
                RewardScaling::None => r - mean,
                _ => (r - mean) / (std + 1e-4),
            };
            out.push(if a.is_nan() { 0.0 } else { a as f32 as f64 });
            zero.push(std.abs() <= 1e-8);
        }
    }
    (out, zero)
}

/// A step's GRPO metrics, named as TRL logs them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct GrpoMetrics {
    /// The mean reward of the generation batch the step trained on.
    pub reward: f64,
    /// Their standard deviation.
    pub reward_std: f64,
    /// The share of completions whose group's rewards were all equal (no signal).
    pub frac_reward_zero_std: f64,
    /// Mean completion length in tokens.
    #[serde(rename = "completions/mean_length")]
    pub mean_length: f64,
    /// The shortest completion.
    #[serde(rename = "completions/min_length")]
    pub min_length: f64,
    /// The longest completion.
    #[serde(rename = "completions/max_length")]
    pub max_length: f64,
    /// The share of completions cut at the most tokens.
    #[serde(rename = "completions/clipped_ratio")]
    pub clipped_ratio: f64,
    /// Mean entropy of the next-token distribution over the completion tokens.
    pub entropy: f64,
    /// Mean per-token KL to the reference model (at `beta > 0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<f64>,
    /// The share of tokens (completions, for sequence-level ratios) whose ratio fell below
    /// `1 - ε` with a negative advantage.
    #[serde(rename = "clip_ratio/low_mean", skip_serializing_if = "Option::is_none")]
    pub clip_low: Option<f64>,
    /// The share whose ratio rose above `1 + ε_high` with a positive advantage.
    #[serde(rename = "clip_ratio/high_mean", skip_serializing_if = "Option::is_none")]
    pub clip_high: Option<f64>,
    /// The share clipped either way.
    #[serde(rename = "clip_ratio/region_mean", skip_serializing_if = "Option::is_none")]
    pub clip_region: Option<f64>,
}

impl GrpoMetrics {
    /// The generation batch's part of the metrics: its rewards and completion lengths, over
    /// every rank of `ranks` (each with its own generation batch); `zero` marks the
    /// completions whose group's spread is zero ([`advantages`]).
    pub fn of_rollouts(rollouts: &Rollouts, zero: &[bool], ranks: Option<&dyn ProcessGroup>) -> Result<GrpoMetrics> {
        let scored: Vec<f64> = rollouts.rewards.iter().copied().filter(|r| !r.is_nan()).collect();
        let lengths: Vec<f64> = rollouts.completions.iter().map(|c| c.len() as f64).collect();
        let count = |flags: &[bool]| flags.iter().filter(|&&f| f).count() as f64;
        let mut sums = [
            scored.len() as f64,
            scored.iter().sum(),
            scored.iter().map(|r| r * r).sum(),
            count(zero),
            lengths.len() as f64,
            lengths.iter().sum(),
            count(&rollouts.truncated),
        ];
        let mut extremes =
            [lengths.iter().copied().fold(0.0, f64::max), -lengths.iter().copied().fold(f64::INFINITY, f64::min)];
        if let Some(g) = ranks {
            let lost = || Error::Comm("the metrics' all-reduce lost values".into());
            sums = all_reduce_values(g, &sums, ReduceOp::Sum)?.try_into().map_err(|_| lost())?;
            extremes = all_reduce_values(g, &extremes, ReduceOp::Max)?.try_into().map_err(|_| lost())?;
        }
        let [scored, sum, squares, zero, n, length, truncated] = sums;
        let mean = sum / scored;
        // With Bessel's correction, as TRL's nanstd.
        let variance = (squares - scored * mean * mean).max(0.0) / (scored - 1.0);
        Ok(GrpoMetrics {
            reward: mean,
            reward_std: if scored > 1.0 { variance.sqrt() } else { f64::NAN },
            frac_reward_zero_std: zero / n,
            mean_length: length / n,
            min_length: -extremes[1],
            max_length: extremes[0],
            clipped_ratio: truncated / n,
            ..GrpoMetrics::default()
        })
    }
}

/// Sums of a step's micro-batches, added over ranks.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    /// Entropy and KL summed over completion tokens, the tokens, then the clipped shares'
    /// sums and what they are shares of (tokens, or completions for sequence-level ratios).
    sums: [f64; 7],
}

/// GRPO scoring for a run: the loss function the trainer calls on each micro-batch and the
/// tally of its metrics since the last reading.
pub struct GrpoObjective {
    config: GrpoConfig,
    tally: Mutex<Tally>,
    /// Where the logits' vocabulary is split over a tensor-parallel group.
    tensor: Mutex<Option<VocabularySplit>>,
}

impl GrpoObjective {
    /// Scoring by `config`, refused where its parameters cannot be taken.
    pub fn new(config: GrpoConfig) -> Result<Arc<GrpoObjective>> {
        config.validate()?;
        Ok(Arc::new(GrpoObjective { config, tally: Mutex::new(Tally::default()), tensor: Mutex::new(None) }))
    }

    /// The parameters.
    pub fn config(&self) -> &GrpoConfig {
        &self.config
    }

    /// Scores logits whose vocabulary a tensor-parallel group splits (gathered first).
    pub fn set_vocabulary_split(&self, split: Option<VocabularySplit>) {
        *self.tensor.lock().unwrap_or_else(|e| e.into_inner()) = split;
    }

    /// The split set by [`GrpoObjective::set_vocabulary_split`].
    pub fn vocabulary_split(&self) -> Option<VocabularySplit> {
        self.tensor.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The loss of a micro-batch of completions from the model's logits, as TRL's
    /// `GRPOTrainer` computes it before dividing by the accumulation (the trainer weighs
    /// each micro-batch by one over it).
    pub fn loss_fn(self: &Arc<Self>) -> ScoreFn {
        let this = self.clone();
        Arc::new(move |logits: &Tensor, batch: &Batch| this.loss(logits, batch))
    }

    /// Each row's per-position log-probabilities of its targets (0 where none is learned),
    /// `[rows, positions]` fp32 and detached: what a later update's ratio (or the KL term)
    /// is measured against. Reads no rollout scores.
    pub fn token_log_probs(&self, logits: &Tensor, batch: &Batch) -> Result<Tensor> {
        let logits = self.scaled(logits)?;
        let targets = batch.targets.f_to_device(logits.device())?;
        Ok(token_log_probs(&logits, &targets)?.0.f_detach()?.f_to_kind(Kind::Float)?)
    }

    /// Forgets what was tallied.
    pub fn reset(&self) {
        *self.tally.lock().unwrap_or_else(|e| e.into_inner()) = Tally::default();
    }

    /// The micro-batches' part of the metrics since the last reset, over every rank of
    /// `group`, written into `into` (whose generation part the loop fills); `false` where
    /// nothing was scored.
    pub fn take_metrics(&self, group: Option<&dyn ProcessGroup>, into: &mut GrpoMetrics) -> Result<bool> {
        let mut all = std::mem::take(&mut *self.tally.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(g) = group {
            let lost = || Error::Comm("the metrics' all-reduce lost values".into());
            all.sums = all_reduce_values(g, &all.sums, ReduceOp::Sum)?.try_into().map_err(|_| lost())?;
        }
        let [entropy, kl, tokens, low, high, region, shares] = all.sums;
        if tokens == 0.0 {
            return Ok(false);
        }
        into.entropy = entropy / tokens;
        into.kl = (self.config.beta != 0.0).then_some(kl / tokens);
        let share = |s: f64| self.config.loss.clips().then_some(s / shares.max(1.0));
        (into.clip_low, into.clip_high, into.clip_region) = (share(low), share(high), share(region));
        Ok(true)
    }

    /// The whole logits divided by the temperature, in fp32 or wider.
    fn scaled(&self, logits: &Tensor) -> Result<Tensor> {
        let logits = whole_logits(self.tensor.lock().unwrap_or_else(|e| e.into_inner()).as_ref(), logits)?;
        if logits.dim() != 3 {
            return Err(Error::Config(format!(
                "GRPO scores logits [rows, positions, vocabulary], not a tensor of shape {:?}",
                logits.size()
            )));
        }
        let logits = match logits.kind() {
            Kind::Double => logits,
            _ => logits.f_to_kind(Kind::Float)?,
        };
        Ok(logits.f_div_scalar(self.config.temperature)?)
    }

    fn loss(&self, logits: &Tensor, batch: &Batch) -> Result<Tensor> {
        let c = &self.config;
        let logits = self.scaled(logits)?;
        let device = logits.device();
        let targets = batch.targets.f_to_device(device)?;
        let (logps, mask, log_softmax) = token_log_probs(&logits, &targets)?;
        let kind = logps.kind();
        // Rows without rollout scores (what is measured before training reads) have no
        // advantage: their loss is 0, its graph the same.
        let blank = RolloutScores {
            advantages: Tensor::f_zeros([logps.size()[0]], (kind, device))?,
            old: None,
            reference: None,
            token_normalizer: 1.0,
        };
        let rollout = batch.rollout.as_ref().unwrap_or(&blank);
        let on = |t: &Tensor| -> Result<Tensor> { Ok(t.f_to_device(device)?.f_to_kind(kind)?) };
        let advantages = on(&rollout.advantages)?.f_unsqueeze(1)?;
        let old = match &rollout.old {
            Some(o) => on(o)?,
            None => logps.f_detach()?,
        };
        let row_tokens = mask.f_sum_dim_intlist(-1, true, kind)?.f_clamp_min(1.0)?;
        let log_ratio = logps.f_sub(&old)?;
        let log_weights = match c.importance_sampling {
            ImportanceSampling::Token => log_ratio.shallow_clone(),
            ImportanceSampling::Sequence => {
                log_ratio.f_mul(&mask)?.f_sum_dim_intlist(-1, true, kind)?.f_div(&row_tokens)?
            }
        };
        let mut coef = log_weights.f_exp()?;
        let kl = match &rollout.reference {
            Some(r) if c.beta != 0.0 => {
                let gap = on(r)?.f_sub(&logps)?;
                let kl = gap.f_exp()?.f_sub(&gap)?.f_sub_scalar(1.0)?;
                // Weighted by the ratio, its gradient is the unbiased reverse-KL one.
                Some(if c.use_bias_correction_kl { kl.f_mul(&coef)? } else { kl })
            }
            None if c.beta != 0.0 && batch.rollout.is_some() => {
                return Err(Error::Data("GRPO at beta > 0 reads the reference model's log-probabilities".into()))
            }
            _ => None,
        };
        let (low, high) = (1.0 - c.epsilon, 1.0 + c.epsilon_high());
        let mut per_token = match c.loss {
            GrpoLoss::Cispo => {
                let clamped = coef.f_clamp_max(c.epsilon_high())?.f_detach()?;
                clamped.f_mul(&advantages)?.f_mul(&logps)?.f_neg()?
            }
            GrpoLoss::Sapo => {
                let positive = advantages.f_gt(0.0)?;
                let temperature = Tensor::f_scalar_tensor(c.sapo_temperature_pos, (kind, device))?
                    .f_where_self(&positive, &Tensor::f_scalar_tensor(c.sapo_temperature_neg, (kind, device))?)?;
                let gate =
                    temperature.f_mul(&coef.f_sub_scalar(1.0)?)?.f_sigmoid()?.f_mul_scalar(4.0)?.f_div(&temperature)?;
                gate.f_mul(&advantages)?.f_neg()?
            }
            GrpoLoss::Vespo => {
                let phi = gamma_weights(c, &advantages, &log_ratio, &mask)?;
                phi.f_mul(&advantages)?.f_mul(&logps)?.f_neg()?
            }
            _ => {
                let clipped = coef.f_clamp(low, high)?;
                // Two-sided clipping bounds the unclipped term too (and the logged clip shares read it).
                if let Some(d) = c.delta {
                    coef = coef.f_clamp_max(d)?;
                }
                coef.f_mul(&advantages)?.f_minimum(&clipped.f_mul(&advantages)?)?.f_neg()?
            }
        };
        if let Some(kl) = &kl {
            per_token = per_token.f_add(&kl.f_mul_scalar(c.beta)?)?;
        }
        let masked = per_token.f_mul(&mask)?;
        let loss = match c.loss {
            GrpoLoss::Grpo | GrpoLoss::Sapo => {
                masked.f_sum_dim_intlist(-1, true, kind)?.f_div(&row_tokens)?.f_mean(kind)?
            }
            GrpoLoss::Bnpo => masked.f_sum(kind)?.f_div(&mask.f_sum(kind)?.f_clamp_min(1.0)?)?,
            GrpoLoss::DrGrpo => {
                masked.f_sum(kind)?.f_div_scalar((per_token.size()[0] * c.max_completion_length as i64) as f64)?
            }
            GrpoLoss::Dapo | GrpoLoss::Cispo | GrpoLoss::Vespo => {
                masked.f_sum(kind)?.f_div_scalar(rollout.token_normalizer)?
            }
            GrpoLoss::Luspo => masked.f_sum_dim_intlist(-1, false, kind)?.f_mean(kind)?,
        };
        self.record(&log_softmax, &mask, kl.as_ref(), &coef, &advantages, low, high)?;
        Ok(loss)
    }

    /// Adds the micro-batch's entropy, KL and clipped shares to the tally.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        log_softmax: &Tensor,
        mask: &Tensor,
        kl: Option<&Tensor>,
        coef: &Tensor,
        advantages: &Tensor,
        low: f64,
        high: f64,
    ) -> Result<()> {
        let sum = |t: &Tensor| -> Result<f64> { Ok(t.f_sum(Kind::Double)?.f_double_value(&[])?) };
        let entropy = token_entropy(log_softmax)?;
        let tokens = sum(mask)?;
        let kl_sum = match kl {
            Some(k) => sum(&k.f_detach()?.f_mul(mask)?)?,
            None => 0.0,
        };
        // Token-level ratios are shares of tokens; sequence-level ones of completions.
        let over = match coef.size().last() {
            Some(1) => coef.f_ones_like()?,
            _ => mask.shallow_clone(),
        };
        let coef = coef.f_detach()?;
        let is_low = coef.f_lt(low)?.f_logical_and(&advantages.f_lt(0.0)?)?.f_to_kind(mask.kind())?;
        let is_high = coef.f_gt(high)?.f_logical_and(&advantages.f_gt(0.0)?)?.f_to_kind(mask.kind())?;
        let region = is_low.f_add(&is_high)?.f_clamp_max(1.0)?;
        let sums = [
            sum(&entropy.f_mul(mask)?)?,
            kl_sum,
            tokens,
            sum(&is_low.f_mul(&over)?)?,
            sum(&is_high.f_mul(&over)?)?,
            sum(&region.f_mul(&over)?)?,
            sum(&over)?,
        ];
        let mut tally = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        for (a, b) in tally.sums.iter_mut().zip(sums) {
            *a += b;
        }
        Ok(())
    }

    /// The micro-batch of completions `rows` of `rollouts`: each row its prompt then its
    /// completion, padded with `pad` on the right to the longest, rounded up to a multiple of
    /// `multiple` (what a sequence-parallel group splits); the completion's tokens the
    /// targets (none of a truncated completion's where those are masked); `advantages` one
    /// per completion of the whole generation batch.
    pub fn batch(
        &self,
        rollouts: &Rollouts,
        rows: std::ops::Range<usize>,
        advantages: &[f64],
        token_normalizer: f64,
        (pad, multiple): (i64, usize),
    ) -> Result<Batch> {
        rollouts.check(self.config.num_generations)?;
        let longest = rows.clone().map(|i| rollouts.prompts[i].len() + rollouts.completions[i].len()).max();
        let width = longest.unwrap_or(0).next_multiple_of(multiple.max(1));
        let (mut inputs, mut targets, mut padding) = (vec![], vec![], vec![]);
        for i in rows.clone() {
            let (prompt, completion) = (&rollouts.prompts[i], &rollouts.completions[i]);
            if prompt.is_empty() {
                return Err(Error::Data(format!("rollout {i}: its prompt holds no tokens")));
            }
            let len = prompt.len() + completion.len();
            let learned = !(self.config.mask_truncated_completions && rollouts.truncated[i]);
            inputs.extend(prompt.iter().chain(completion).copied().chain(std::iter::repeat_n(pad, width - len)));
            // Position p predicts token p + 1: the completion's tokens from the prompt's last position.
            targets.extend(std::iter::repeat_n(IGNORE, prompt.len() - 1));
            targets.extend(completion.iter().map(|&t| if learned { t } else { IGNORE }));
            targets.extend(std::iter::repeat_n(IGNORE, width - len + 1));
            padding.extend((0..width).map(|p| p >= len));
        }
        let shape = [rows.len() as i64, width as i64];
        let mut batch =
            Batch::new(Tensor::f_from_slice(&inputs)?.f_view(shape)?, Tensor::f_from_slice(&targets)?.f_view(shape)?)?;
        batch.padding = padding.iter().any(|&p| p).then(|| Tensor::from_slice(&padding).view(shape));
        batch.first_row = rows.start;
        // Every micro-batch weighs the same: the loss is normalised as TRL normalises it.
        batch.supervised = 1;
        batch.rollout = Some(RolloutScores {
            advantages: Tensor::f_from_slice(&advantages[rows].iter().map(|&a| a as f32).collect::<Vec<_>>())?,
            old: None,
            reference: None,
            token_normalizer,
        });
        Ok(batch)
    }
}

/// VESPO's weights of each completion (`[rows, 1]`, detached): `exp(λ + k log w - λ w)` of
/// its summed log-ratio `log w` (clamped to [log 1e-8, 20]), `k` and `λ` by the advantage's sign.
fn gamma_weights(c: &GrpoConfig, advantages: &Tensor, log_ratio: &Tensor, mask: &Tensor) -> Result<Tensor> {
    tch::no_grad(|| {
        let kind = log_ratio.kind();
        let floor = 1e-8f64.ln();
        let summed = log_ratio.f_clamp(-20.0, 20.0)?.f_mul(mask)?.f_sum_dim_intlist(-1, true, kind)?;
        let log_w = summed.f_clamp(floor, 20.0)?;
        let w = log_w.f_exp()?;
        let non_negative = advantages.f_ge(0.0)?;
        let pick = |pos: f64, neg: f64| -> Result<Tensor> {
            let device = advantages.device();
            Ok(Tensor::f_scalar_tensor(pos, (kind, device))?
                .f_where_self(&non_negative, &Tensor::f_scalar_tensor(neg, (kind, device))?)?)
        };
        let k = pick(c.vespo_pos.0, c.vespo_neg.0)?;
        let lambda = pick(c.vespo_pos.1, c.vespo_neg.1)?.f_clamp_min(1e-4)?;
        let log_phi = lambda.f_add(&k.f_mul(&log_w)?)?.f_sub(&lambda.f_mul(&w)?)?;
        Ok(log_phi.f_exp()?.f_nan_to_num(0.0, 0.0, 0.0)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_trl_loss_name_parses_back_to_itself() {
        for loss in GrpoLoss::all() {
            assert_eq!(loss.name().parse::<GrpoLoss>().unwrap(), loss);
        }
        assert!("ppo".parse::<GrpoLoss>().is_err());
    }

    #[test]
    fn advantages_are_measured_within_each_group() {
        let (a, zero) = advantages(&[1.0, 3.0, 2.0, 2.0, f64::NAN, 5.0], &[], 2, RewardScaling::Group);
        // Group 1: mean 2, std √2; group 2: equal rewards; group 3: one reward, no spread.
        let s = 2f64.sqrt() + 1e-4;
        assert!((a[0] + 1.0 / s).abs() < 1e-6 && (a[1] - 1.0 / s).abs() < 1e-6, "{a:?}");
        assert_eq!(&a[2..], &[0.0, 0.0, 0.0, 0.0]);
        assert_eq!(zero, vec![false, false, true, true, false, false]);
        let (unscaled, _) = advantages(&[1.0, 3.0], &[], 2, RewardScaling::None);
        assert_eq!(unscaled, vec![-1.0, 1.0]);
    }

    #[test]
    fn parameters_grpo_cannot_take_are_refused() {
        for bad in [
            GrpoConfig { num_generations: 1, ..Default::default() },
            GrpoConfig { temperature: 0.0, ..Default::default() },
            GrpoConfig { loss: GrpoLoss::Luspo, ..Default::default() },
            GrpoConfig { beta: -0.1, ..Default::default() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        // Sampling settings are refused before training, in one line named once.
        let bad = GrpoConfig { min_p: Some(2.0), ..Default::default() }.validate().unwrap_err().to_string();
        assert_eq!(bad, "invalid configuration: grpo: min_p must lie in [0, 1], got 2");
        assert!(GrpoConfig { repetition_penalty: 0.0, ..Default::default() }.validate().is_err());
    }
}
