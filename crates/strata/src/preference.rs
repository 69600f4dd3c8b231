//! Preference optimisation: DPO and its family of losses over pairs of a chosen and a
//! rejected completion, scored as TRL's `DPOTrainer` scores them — the same loss types and
//! parameters, the same metrics under the same names.
//!
//! A pair's score is the sum of its completion tokens' log-probabilities; the loss compares
//! the policy's scores with a reference's. The reference is the model as training starts
//! (for LoRA, the base with its fresh adapters, which change nothing yet): its scores are
//! computed once before the first step ([`reference_recorder`]) and ride with the batches,
//! so no second copy of the model is held; or, live ([`PreferenceConfig::live_reference`]),
//! each step's just before it, TR-DPO's from a copy that follows the policy
//! ([`ReferenceSync`]). The reference-free CPO, SimPO and ORPO (TRL's
//! `CPOTrainer` and `ORPOTrainer`) score the policy alone.
//!
//! Owns: the loss types, their parameters and validation, the per-pair arithmetic, and the
//! step's metrics. Must not read records (`data::PreferenceSet` does) nor run the model: it
//! scores the logits the engine's last unit returns.
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::data::{Batch, IGNORE};
use crate::model::TensorParallel;
use crate::{Error, Result};
use serde::Serialize;
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// A loss of the model's output for a micro-batch: the trainer's loss function, whose type
/// it is (the trainer reads this module's metrics, so this module names it itself).
pub type ScoreFn = Arc<dyn Fn(&Tensor, &Batch) -> Result<Tensor> + Send + Sync>;

/// A loss of the DPO family, by TRL's `loss_type` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreferenceLoss {
    /// DPO's `-log σ(β Δ)`.
    Sigmoid,
    /// SLiC's `max(0, 1 - β Δ)`.
    Hinge,
    /// IPO's squared distance of the per-token Δ from `1 / 2β`.
    Ipo,
    /// EXO's reverse KL to the smoothed preference (needs `label_smoothing > 0`).
    ExoPair,
    /// NCA's absolute-likelihood loss.
    NcaPair,
    /// Robust DPO under a label-flip rate of `label_smoothing`.
    Robust,
    /// BCO on the two rewards.
    BcoPair,
    /// SPPO with hard probabilities.
    SppoHard,
    /// AOT: sorted log-ratio differences, paired.
    Aot,
    /// AOT: chosen and rejected log-ratios sorted apart.
    AotUnpaired,
    /// APO-zero: chosen up, rejected down.
    ApoZero,
    /// APO-down: both down, rejected more.
    ApoDown,
    /// DiscoPOP's log-ratio modulated loss.
    Discopop,
    /// The chosen completions' next-token loss.
    Sft,
    /// DPO on per-token averaged scores.
    SigmoidNorm,
    /// KTO, on unpaired completions: each against the KL estimate of mismatched ones.
    Kto,
    /// APO-zero on unpaired completions: desirable ones up, the others down.
    ApoZeroUnpaired,
    /// CPO (TRL's `CPOTrainer`, `loss_type="sigmoid"`): DPO's sigmoid on the policy's own
    /// summed scores, with no reference, plus `cpo_alpha` times the chosen rows' token loss.
    Cpo,
    /// SimPO (`CPOTrainer`, `loss_type="simpo"`): the sigmoid of the per-token averaged
    /// scores' difference less the margin `simpo_gamma`, reference-free.
    Simpo,
    /// ORPO (TRL's `ORPOTrainer`): the chosen rows' token loss less β times the log-sigmoid
    /// of the log odds ratio of the per-token averaged scores, reference-free.
    Orpo,
}

const LOSSES: [(&str, PreferenceLoss); 20] = [
    ("sigmoid", PreferenceLoss::Sigmoid),
    ("hinge", PreferenceLoss::Hinge),
    ("ipo", PreferenceLoss::Ipo),
    ("exo_pair", PreferenceLoss::ExoPair),
    ("nca_pair", PreferenceLoss::NcaPair),
    ("robust", PreferenceLoss::Robust),
    ("bco_pair", PreferenceLoss::BcoPair),
    ("sppo_hard", PreferenceLoss::SppoHard),
    ("aot", PreferenceLoss::Aot),
    ("aot_unpaired", PreferenceLoss::AotUnpaired),
    ("apo_zero", PreferenceLoss::ApoZero),
    ("apo_down", PreferenceLoss::ApoDown),
    ("discopop", PreferenceLoss::Discopop),
    ("sft", PreferenceLoss::Sft),
    ("sigmoid_norm", PreferenceLoss::SigmoidNorm),
    ("kto", PreferenceLoss::Kto),
    ("apo_zero_unpaired", PreferenceLoss::ApoZeroUnpaired),
    ("cpo", PreferenceLoss::Cpo),
    ("simpo", PreferenceLoss::Simpo),
    ("orpo", PreferenceLoss::Orpo),
];

impl PreferenceLoss {
    /// Every loss type, in TRL's order (DPO's, then KTO's, then the reference-free ones).
    pub fn all() -> impl Iterator<Item = PreferenceLoss> {
        LOSSES.iter().map(|(_, l)| *l)
    }

    /// Whether the loss scores unpaired completions (KTO's trainer) rather than pairs.
    pub fn unpaired(self) -> bool {
        matches!(self, PreferenceLoss::Kto | PreferenceLoss::ApoZeroUnpaired)
    }

    /// Whether the loss scores the policy alone, with no reference (CPO, SimPO, ORPO).
    pub fn reference_free(self) -> bool {
        matches!(self, PreferenceLoss::Cpo | PreferenceLoss::Simpo | PreferenceLoss::Orpo)
    }

    /// TRL's name of the loss type.
    pub fn name(self) -> &'static str {
        LOSSES.iter().find(|(_, l)| *l == self).map_or("", |(n, _)| n)
    }

    /// Whether the loss is built on the chosen-minus-rejected score, the only kind an
    /// f-divergence other than the reverse KL applies to.
    fn on_score_difference(self) -> bool {
        use PreferenceLoss::*;
        matches!(self, Sigmoid | SigmoidNorm | Hinge | Ipo | ExoPair | Robust | Discopop | Sft)
    }
}

impl std::str::FromStr for PreferenceLoss {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        LOSSES.iter().find(|(n, _)| *n == s).map(|(_, l)| *l).ok_or_else(|| {
            let names: Vec<&str> = LOSSES.iter().map(|(n, _)| *n).collect();
            Error::Config(format!("preference loss {s:?}: not one of {}", names.join(", ")))
        })
    }
}

/// The divergence from the reference that the score of a completion measures (f-DPO).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FDivergence {
    /// The log-ratio itself (DPO's own).
    ReverseKl,
    /// `1 - exp(-log-ratio)`.
    ForwardKl,
    /// `log 2 + log σ(log-ratio)`.
    JsDivergence,
    /// `(exp((α-1)·log-ratio) - 1) / (α-1)`, the log-ratio at α = 1.
    AlphaDivergence(f64),
}

impl FDivergence {
    /// The divergence of TRL's `f_divergence_type` name, α for the α-divergence.
    pub fn parse(name: &str, alpha: f64) -> Result<FDivergence> {
        Ok(match name {
            "reverse_kl" => FDivergence::ReverseKl,
            "forward_kl" => FDivergence::ForwardKl,
            "js_divergence" => FDivergence::JsDivergence,
            "alpha_divergence" => FDivergence::AlphaDivergence(alpha),
            other => {
                return Err(Error::Config(format!(
                    "f-divergence {other:?}: not one of reverse_kl, forward_kl, js_divergence, alpha_divergence"
                )))
            }
        })
    }

    fn score(self, log_ratio: &Tensor) -> Result<Tensor> {
        Ok(match self {
            FDivergence::ReverseKl => log_ratio.shallow_clone(),
            FDivergence::ForwardKl => log_ratio.f_neg()?.f_exp()?.f_neg()?.f_add_scalar(1.0)?,
            FDivergence::JsDivergence => log_ratio.f_log_sigmoid()?.f_add_scalar(std::f64::consts::LN_2)?,
            FDivergence::AlphaDivergence(a) if (a - 1.0).abs() < 1e-6 => log_ratio.shallow_clone(),
            // Clamped so that the exponential stays finite (TRL's bound for fp32).
            FDivergence::AlphaDivergence(a) => {
                log_ratio.f_mul_scalar(a - 1.0)?.f_clamp_max(80.0)?.f_exp()?.f_sub_scalar(1.0)?.f_div_scalar(a - 1.0)?
            }
        })
    }
}

/// How pairs are scored: TRL's `DPOConfig` fields of the same names.
#[derive(Clone, Debug, PartialEq)]
pub struct PreferenceConfig {
    /// The loss types, each with its weight; several are summed (MPO).
    pub losses: Vec<(PreferenceLoss, f64)>,
    /// How far the policy may move from the reference (IPO's τ).
    pub beta: f64,
    /// Robust DPO's flip rate, EXO's ε, AOT's smoothing.
    pub label_smoothing: f64,
    /// DiscoPOP's temperature.
    pub discopop_tau: f64,
    /// The divergence each completion's score measures.
    pub f_divergence: FDivergence,
    /// Unpaired losses: the weights of desirable and of undesirable completions' losses.
    pub desirable_weight: f64,
    /// See `desirable_weight`.
    pub undesirable_weight: f64,
    /// SimPO's target margin between the averaged scores, over β (TRL's `simpo_gamma`).
    pub simpo_gamma: f64,
    /// CPO and SimPO: the weight of the chosen rows' token loss (`None`: TRL's 1 for CPO,
    /// 0 for SimPO, what its `cpo_alpha` is set to for SimPO proper).
    pub cpo_alpha: Option<f64>,
    /// Where the reference's scores are kept between runs: read back where the file holds
    /// the scores of the same pairs from the same model, else computed and written there
    /// ([`crate::data::StoredReference`]). `None`: computed before every run's first step.
    pub reference_scores: Option<std::path::PathBuf>,
    /// Score each step's pairs with the reference as they come (TRL's default, without
    /// `precompute_ref_log_probs`) rather than every pair before the first step: under LoRA
    /// the model as it started, else a frozen copy of the model.
    pub live_reference: bool,
    /// TR-DPO (TRL's `sync_ref_model`): the reference is a live frozen copy of the model
    /// that moves towards the policy every so many steps. `None`: the reference is the
    /// model as training starts.
    pub reference_sync: Option<ReferenceSync>,
}

/// How a TR-DPO reference follows the policy: after every `every`-th optimizer step each of
/// its parameters becomes `mixup · policy + (1 − mixup) · reference` (TRL's
/// `ref_model_sync_steps` and `ref_model_mixup_alpha`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReferenceSync {
    /// Optimizer steps between two syncs.
    pub every: u64,
    /// The policy's share of the synced reference, in [0, 1].
    pub mixup: f64,
}

impl Default for PreferenceConfig {
    /// DPO's sigmoid loss at β = 0.1, TRL's defaults.
    fn default() -> Self {
        PreferenceConfig {
            losses: vec![(PreferenceLoss::Sigmoid, 1.0)],
            beta: 0.1,
            label_smoothing: 0.0,
            discopop_tau: 0.05,
            f_divergence: FDivergence::ReverseKl,
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
            simpo_gamma: 0.5,
            cpo_alpha: None,
            reference_scores: None,
            live_reference: false,
            reference_sync: None,
        }
    }
}

impl PreferenceConfig {
    /// Whether the loss is reference-free (CPO, SimPO, ORPO): no reference is scored.
    pub fn reference_free(&self) -> bool {
        self.losses.iter().any(|(l, _)| l.reference_free())
    }

    /// Whether the reference scores each step's pairs as they come (live, or synced).
    pub fn live(&self) -> bool {
        self.live_reference || self.reference_sync.is_some()
    }

    /// Refuses parameters the losses cannot take, in one line naming why.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Config(format!("preference loss: {why}")));
        if self.losses.is_empty() {
            return bad("no loss type given".into());
        }
        if !(self.beta > 0.0 && self.beta.is_finite()) {
            return bad(format!("beta {} must be positive", self.beta));
        }
        let unpaired = self.losses.iter().filter(|(l, _)| l.unpaired()).count();
        if unpaired > 0 && self.losses.len() > 1 {
            return bad("kto and apo_zero_unpaired score unpaired completions: give one alone".into());
        }
        if self.reference_free() && self.losses.len() > 1 {
            return bad("cpo, simpo and orpo score the policy with no reference: give one alone".into());
        }
        if self.reference_free() && (self.reference_scores.is_some() || self.live()) {
            return bad("cpo, simpo and orpo score no reference: there is none to keep, sync or score live".into());
        }
        if self.live() && self.reference_scores.is_some() {
            return bad("a live reference scores each step's pairs as they come: there are no scores to keep".into());
        }
        if let Some(sync) = self.reference_sync {
            if sync.every == 0 || !(0.0..=1.0).contains(&sync.mixup) {
                return bad(format!(
                    "a synced reference takes a positive step count and a mixup in [0, 1], not {} and {}",
                    sync.every, sync.mixup
                ));
            }
            if self.losses.iter().any(|(l, _)| l.unpaired()) {
                return bad(
                    "a synced reference is DPO's: kto and apo_zero_unpaired keep the reference they start from".into(),
                );
            }
        }
        let weighs_token_loss =
            self.losses.iter().any(|(l, _)| matches!(l, PreferenceLoss::Cpo | PreferenceLoss::Simpo));
        if self.cpo_alpha.is_some() && !weighs_token_loss {
            return bad("cpo_alpha weighs cpo's and simpo's token loss: the loss is neither".into());
        }
        if self.desirable_weight < 0.0 || self.undesirable_weight < 0.0 {
            return bad("the desirable and undesirable weights must not be negative".into());
        }
        for (loss, _) in &self.losses {
            match loss {
                PreferenceLoss::Robust if !(0.0..0.5).contains(&self.label_smoothing) => {
                    return bad(format!("robust takes a label smoothing in [0, 0.5), not {}", self.label_smoothing))
                }
                PreferenceLoss::ExoPair if !(self.label_smoothing > 0.0 && self.label_smoothing < 1.0) => {
                    return bad(format!("exo_pair takes a label smoothing in (0, 1), not {}", self.label_smoothing))
                }
                l if self.f_divergence != FDivergence::ReverseKl && !l.on_score_difference() => {
                    return bad(format!("{} has no f-divergence form: it takes reverse_kl only", l.name()))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Sums over a step's micro-batches from which its metrics are the means; added over ranks.
#[derive(Clone, Copy, Debug, Default)]
struct Tally([f64; Tally::LEN]);

/// The sums a [`Tally`] holds, by place.
#[derive(Clone, Copy)]
enum Sum {
    /// Chosen completions scored (pairs, or desirable unpaired completions).
    Chosen,
    /// Rejected completions scored (pairs, or undesirable unpaired completions).
    Rejected,
    RewardsChosen,
    RewardsRejected,
    /// Pairs whose chosen reward exceeds the rejected one.
    Accurate,
    LogpsChosen,
    LogpsRejected,
    /// The chosen rows' mean logits summed over the positions the metric reads, and how
    /// many positions: the completions' (DPO's), or every position but the padding (CPO's
    /// and ORPO's).
    LogitsChosen,
    LogitPositionsChosen,
    LogitsRejected,
    LogitPositionsRejected,
    /// Chosen and rejected completion tokens.
    ChosenTokens,
    RejectedTokens,
    Entropy,
    EntropyTokens,
    /// Chosen tokens that are the model's most likely next token.
    Top1,
    /// The KL estimates of unpaired micro-batches, and how many there were.
    Kl,
    KlBatches,
    /// Reference-free micro-batches: the chosen rows' token losses, ORPO's mean
    /// log-sigmoid of the log odds ratio and mean log odds ratio, and how many there were.
    Nll,
    LogOddsRatio,
    LogOddsChosen,
    FreeBatches,
    OddsBatches,
}

impl Tally {
    const LEN: usize = Sum::OddsBatches as usize + 1;

    fn get(&self, s: Sum) -> f64 {
        self.0[s as usize]
    }

    fn add(&mut self, other: &Tally) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }

    fn metrics(&self) -> PreferenceMetrics {
        let over = |a: Sum, n: Sum| if self.get(n) > 0.0 { self.get(a) / self.get(n) } else { 0.0 };
        let unpaired = self.get(Sum::KlBatches) > 0.0;
        let rewards_chosen = over(Sum::RewardsChosen, Sum::Chosen);
        let rewards_rejected = over(Sum::RewardsRejected, Sum::Rejected);
        PreferenceMetrics {
            rewards_chosen,
            rewards_rejected,
            rewards_accuracies: (!unpaired).then(|| over(Sum::Accurate, Sum::Chosen)),
            rewards_margins: rewards_chosen - rewards_rejected,
            logps_chosen: over(Sum::LogpsChosen, Sum::Chosen),
            logps_rejected: over(Sum::LogpsRejected, Sum::Rejected),
            logits_chosen: over(Sum::LogitsChosen, Sum::LogitPositionsChosen),
            logits_rejected: over(Sum::LogitsRejected, Sum::LogitPositionsRejected),
            entropy: over(Sum::Entropy, Sum::EntropyTokens),
            mean_token_accuracy: (!unpaired).then(|| over(Sum::Top1, Sum::ChosenTokens)),
            kl: unpaired.then(|| over(Sum::Kl, Sum::KlBatches)),
            nll_loss: (self.get(Sum::FreeBatches) > 0.0).then(|| over(Sum::Nll, Sum::FreeBatches)),
            log_odds_ratio: (self.get(Sum::OddsBatches) > 0.0).then(|| over(Sum::LogOddsRatio, Sum::OddsBatches)),
            log_odds_chosen: (self.get(Sum::OddsBatches) > 0.0).then(|| over(Sum::LogOddsChosen, Sum::OddsBatches)),
        }
    }
}

/// A step's preference metrics, named as TRL logs them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PreferenceMetrics {
    /// Mean `β · (log π(chosen) - log π_ref(chosen))`.
    #[serde(rename = "rewards/chosen")]
    pub rewards_chosen: f64,
    /// Mean `β · (log π(rejected) - log π_ref(rejected))`.
    #[serde(rename = "rewards/rejected")]
    pub rewards_rejected: f64,
    /// The share of pairs whose chosen reward exceeds the rejected one (pairs only).
    #[serde(rename = "rewards/accuracies", skip_serializing_if = "Option::is_none")]
    pub rewards_accuracies: Option<f64>,
    /// Mean chosen reward minus mean rejected reward.
    #[serde(rename = "rewards/margins")]
    pub rewards_margins: f64,
    /// Mean summed log-probability of the chosen completions.
    #[serde(rename = "logps/chosen")]
    pub logps_chosen: f64,
    /// Mean summed log-probability of the rejected completions.
    #[serde(rename = "logps/rejected")]
    pub logps_rejected: f64,
    /// Mean over the chosen completions' tokens of the mean logit over the vocabulary.
    #[serde(rename = "logits/chosen")]
    pub logits_chosen: f64,
    /// The same over the rejected completions' tokens.
    #[serde(rename = "logits/rejected")]
    pub logits_rejected: f64,
    /// Mean entropy of the next-token distribution over every completion token.
    pub entropy: f64,
    /// The share of chosen completion tokens that are the model's most likely next token
    /// (pairs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_token_accuracy: Option<f64>,
    /// Unpaired completions: the mean over micro-batches of the KL estimate, the mean
    /// log-ratio of the mismatched completions, clamped at 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<f64>,
    /// Reference-free losses (CPO, SimPO, ORPO): the mean over micro-batches of the chosen
    /// completions' mean token loss.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nll_loss: Option<f64>,
    /// ORPO: the mean log-sigmoid of the log odds ratio of chosen over rejected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_odds_ratio: Option<f64>,
    /// ORPO: the mean log odds ratio of chosen over rejected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_odds_chosen: Option<f64>,
}

/// Each row's next-token log-probabilities where its target is learned (0 elsewhere), in
/// fp32 or wider, the learned positions as a float mask, and the whole log-softmax they
/// were picked from (the metrics' entropy reads it), for logits `[rows, ctx, V]`.
pub(crate) fn token_log_probs(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let logits = match logits.kind() {
        Kind::Double => logits.shallow_clone(),
        _ => logits.f_to_kind(Kind::Float)?,
    };
    let mask = targets.f_ne(IGNORE)?;
    let index = targets.f_masked_fill(&mask.f_logical_not()?, 0)?.f_unsqueeze(-1)?;
    let log_softmax = logits.f_log_softmax(-1, None::<Kind>)?;
    let picked = log_softmax.f_gather(-1, &index, false)?.f_squeeze_dim(-1)?;
    let mask = mask.f_to_kind(picked.kind())?;
    Ok((picked.f_mul(&mask)?, mask, log_softmax))
}

/// Each position's entropy of the next-token distribution (`[rows, ctx]`, fp32, detached)
/// from its log-softmax `[rows, ctx, V]`.
pub(crate) fn token_entropy(log_softmax: &Tensor) -> Result<Tensor> {
    let log_p = log_softmax.f_detach()?.f_to_kind(Kind::Float)?;
    Ok(log_p.f_exp()?.f_mul(&log_p)?.f_sum_dim_intlist(-1, false, Kind::Float)?.f_neg()?)
}

/// Preference scoring for a run: the loss function the trainer calls on each micro-batch,
/// and the tally of the metrics of the micro-batches it scored since the last reading.
pub struct PreferenceObjective {
    config: PreferenceConfig,
    tally: Mutex<Tally>,
    /// Where the logits' vocabulary is split over a tensor-parallel group, once the engine is built.
    tensor: Mutex<Option<VocabularySplit>>,
    /// The data-parallel ranks scoring the other rows of each micro-batch, once the engine is built.
    batch: Mutex<Option<Arc<dyn ProcessGroup>>>,
}

impl PreferenceObjective {
    /// Scoring by `config`, refused where its parameters cannot be taken.
    pub fn new(config: PreferenceConfig) -> Result<Arc<PreferenceObjective>> {
        config.validate()?;
        Ok(Arc::new(PreferenceObjective {
            config,
            tally: Mutex::new(Tally::default()),
            tensor: Mutex::new(None),
            batch: Mutex::new(None),
        }))
    }

    /// Scores logits whose vocabulary a tensor-parallel group splits: each rank's columns
    /// are gathered into the whole logits first (the pairs' scores need every column).
    pub fn set_vocabulary_split(&self, split: Option<VocabularySplit>) {
        *self.tensor.lock().unwrap_or_else(|e| e.into_inner()) = split;
    }

    /// The split set by [`PreferenceObjective::set_vocabulary_split`].
    pub fn vocabulary_split(&self) -> Option<VocabularySplit> {
        self.tensor.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Scores micro-batches whose rows are shared out over `group`'s data-parallel ranks (a
    /// dedicated group: every rank of it scores the same number of micro-batches, in step).
    /// KTO's KL estimate is then the mean over every rank's mismatched completions, which
    /// TRL gathers over its processes, so that the ranks' losses add up to one process's.
    pub fn set_batch_group(&self, group: Option<Arc<dyn ProcessGroup>>) {
        *self.batch.lock().unwrap_or_else(|e| e.into_inner()) = group;
    }

    /// The mean of `values` over every rank of the batch group (this rank's alone without one).
    fn mean_over_batch(&self, values: &Tensor) -> Result<f64> {
        let mine = [values.f_sum(Kind::Double)?.f_double_value(&[])?, values.numel() as f64];
        let summed = match self.batch.lock().unwrap_or_else(|e| e.into_inner()).as_deref() {
            Some(group) => all_reduce_values(group, &mine, ReduceOp::Sum)?,
            None => mine.to_vec(),
        };
        Ok(summed[0] / summed[1].max(1.0))
    }

    fn whole(&self, logits: &Tensor) -> Result<Tensor> {
        whole_logits(self.tensor.lock().unwrap_or_else(|e| e.into_inner()).as_ref(), logits)
    }

    /// The parameters.
    pub fn config(&self) -> &PreferenceConfig {
        &self.config
    }

    /// The loss of a micro-batch of pairs from the model's logits: the mean over its pairs
    /// of the configured losses. A batch without reference log-probabilities is measured
    /// against the policy itself, which is the reference before the first update (what a
    /// measurement before training reads); a run attaches them before its first step.
    pub fn loss_fn(self: &Arc<Self>) -> ScoreFn {
        let this = self.clone();
        Arc::new(move |logits: &Tensor, batch: &Batch| this.loss(logits, batch))
    }

    /// Forgets what was tallied (before a step whose metrics are read after it).
    pub fn reset(&self) {
        *self.tally.lock().unwrap_or_else(|e| e.into_inner()) = Tally::default();
    }

    /// The metrics of the micro-batches scored since the last reset, over every rank of
    /// `group` (ranks that scored nothing add nothing; ranks that scored the same rows, as
    /// tensor-parallel ones do, weigh each mean the same); `None` where nothing was scored.
    pub fn take_metrics(&self, group: Option<&dyn ProcessGroup>) -> Result<Option<PreferenceMetrics>> {
        let mine = std::mem::take(&mut *self.tally.lock().unwrap_or_else(|e| e.into_inner()));
        let all = match group {
            Some(g) => {
                let summed = all_reduce_values(g, &mine.0, ReduceOp::Sum)?;
                Tally(summed.try_into().map_err(|_| Error::Comm("the metrics' all-reduce lost values".into()))?)
            }
            None => mine,
        };
        Ok((all.get(Sum::Chosen) + all.get(Sum::Rejected) > 0.0).then(|| all.metrics()))
    }

    fn loss(&self, logits: &Tensor, batch: &Batch) -> Result<Tensor> {
        let logits = &self.whole(logits)?;
        if logits.dim() != 3 {
            return Err(Error::Config(format!(
                "a preference loss scores logits [rows, positions, vocabulary], not a tensor of shape {:?} (the \
                 chunked loss and classifier heads give no logits)",
                logits.size()
            )));
        }
        let rows = logits.size()[0];
        if rows % 2 != 0 {
            return Err(Error::Data(format!("a batch of preference pairs has an even number of rows, not {rows}")));
        }
        let targets = batch.targets.f_to_device(logits.device())?;
        let (per_token, mask, log_softmax) = token_log_probs(logits, &targets)?;
        if self.config.reference_free() {
            // ORPO's token loss reads the chosen rows whole, prompt and completion (TRL's).
            let nll = match self.config.losses.first() {
                Some((PreferenceLoss::Orpo, _)) => chosen_row_loss(&log_softmax, batch)?,
                _ => chosen_token_loss(&per_token, &mask)?,
            };
            let (loss, scores, mut extras) = self.reference_free(&per_token, &mask, &nll)?;
            let positions = match &batch.padding {
                Some(p) => p.f_to_device(mask.device())?.f_logical_not()?.f_to_kind(mask.kind())?,
                None => mask.f_ones_like()?,
            };
            extras.logit_positions = Some(positions);
            let sides = Sides::paired(rows, logits.device())?;
            self.record(logits, &targets, (&mask, &log_softmax), &sides, (&scores, &scores), extras)?;
            return Ok(loss);
        }
        let logps = per_token.f_sum_dim_intlist(1, false, per_token.kind())?;
        let reference = match &batch.reference {
            Some(r) => r.f_to_device(logps.device())?.f_to_kind(logps.kind())?,
            None => logps.f_detach()?,
        };
        let (chosen, rejected) = halves(&logps)?;
        let (ref_chosen, ref_rejected) = halves(&reference)?;
        let chosen_ratio = chosen.f_sub(&ref_chosen)?;
        let rejected_ratio = rejected.f_sub(&ref_rejected)?;
        let lengths = mask.f_sum_dim_intlist(1, false, mask.kind())?;
        let pair = PairScores {
            chosen: &chosen,
            rejected: &rejected,
            ref_chosen: &ref_chosen,
            ref_rejected: &ref_rejected,
            chosen_ratio: &chosen_ratio,
            rejected_ratio: &rejected_ratio,
            lengths: &lengths,
            per_token: &per_token,
            mask: &mask,
        };
        let ratios = logps.f_sub(&reference)?;
        if let Some(desirable) = &batch.desirable {
            let desirable = desirable.f_to_device(logps.device())?;
            let (loss, kl) = self.unpaired(&pair, &desirable)?;
            let extras = Extras { kl: Some(kl), ..Extras::default() };
            let sides = Sides::unpaired(&desirable)?;
            self.record(logits, &targets, (&mask, &log_softmax), &sides, (&logps, &ratios), extras)?;
            return Ok(loss);
        }
        let mut total: Option<Tensor> = None;
        for (kind, weight) in &self.config.losses {
            let term = self.per_pair(*kind, &pair)?.f_mean(per_token.kind())?.f_mul_scalar(*weight)?;
            total = Some(match total {
                Some(t) => t.f_add(&term)?,
                None => term,
            });
        }
        let sides = Sides::paired(rows, logits.device())?;
        self.record(logits, &targets, (&mask, &log_softmax), &sides, (&logps, &ratios), Extras::default())?;
        total.ok_or_else(|| Error::Config("preference loss: no loss type given".into()))
    }

    /// Unpaired completions' loss (the first half of the rows; the second half holds the
    /// mismatched completions whose log-ratio estimates the KL term), and that estimate.
    fn unpaired(&self, s: &PairScores, desirable: &Tensor) -> Result<(Tensor, f64)> {
        let PreferenceConfig { beta, desirable_weight, undesirable_weight, .. } = self.config;
        let kind = self.config.losses.first().map(|(k, _)| *k);
        let ratio = s.chosen_ratio;
        let (kl, good, bad) = match kind {
            Some(PreferenceLoss::Kto) => {
                let estimate = self.mean_over_batch(&s.rejected_ratio.f_detach()?)?.max(0.0);
                let kl = Tensor::from(estimate).f_to_kind(ratio.kind())?.f_to_device(ratio.device())?;
                let good = ratio.f_sub(&kl)?.f_mul_scalar(beta)?.f_sigmoid()?.f_neg()?.f_add_scalar(1.0)?;
                let bad = kl.f_sub(ratio)?.f_mul_scalar(beta)?.f_sigmoid()?.f_neg()?.f_add_scalar(1.0)?;
                (estimate, good, bad)
            }
            Some(PreferenceLoss::ApoZeroUnpaired) => {
                let scaled = ratio.f_mul_scalar(beta)?.f_sigmoid()?;
                (0.0, scaled.f_neg()?.f_add_scalar(1.0)?, scaled)
            }
            _ => {
                return Err(Error::Config(
                    "unpaired completions (records with a \"label\") are scored by kto or apo_zero_unpaired".into(),
                ))
            }
        };
        let losses =
            good.f_mul_scalar(desirable_weight)?.f_where_self(desirable, &bad.f_mul_scalar(undesirable_weight)?)?;
        Ok((losses.f_mean(ratio.kind())?, kl))
    }

    /// Each pair's loss of one type.
    fn per_pair(&self, kind: PreferenceLoss, s: &PairScores) -> Result<Tensor> {
        let PreferenceConfig { beta, label_smoothing: eps, discopop_tau, f_divergence, .. } = self.config;
        let chosen_score = f_divergence.score(s.chosen_ratio)?;
        let rejected_score = f_divergence.score(s.rejected_ratio)?;
        let delta = chosen_score.f_sub(&rejected_score)?;
        let logsig = |t: &Tensor| -> Result<Tensor> { Ok(t.f_log_sigmoid()?) };
        let smoothed = |d: &Tensor| smoothed_sigmoid(d, beta, eps);
        let (chosen_len, rejected_len) = halves(s.lengths)?;
        let per_token_delta = || -> Result<Tensor> {
            let c = chosen_score.f_div(&chosen_len.f_clamp_min(1.0)?)?;
            Ok(c.f_sub(&rejected_score.f_div(&rejected_len.f_clamp_min(1.0)?)?)?)
        };
        let bd = delta.f_mul_scalar(beta)?;
        use PreferenceLoss::*;
        Ok(match kind {
            Sigmoid => logsig(&bd)?.f_neg()?,
            Hinge => bd.f_neg()?.f_add_scalar(1.0)?.f_relu()?,
            Ipo => per_token_delta()?.f_sub_scalar(1.0 / (2.0 * beta))?.f_square()?,
            ExoPair => {
                let (qw, log_qw) = (bd.f_sigmoid()?, logsig(&bd)?);
                let (ql, log_ql) = (bd.f_neg()?.f_sigmoid()?, logsig(&bd.f_neg()?)?);
                let w = qw.f_mul(&log_qw.f_sub_scalar((-eps).ln_1p())?)?;
                w.f_add(&ql.f_mul(&log_ql.f_sub_scalar(eps.ln())?)?)?
            }
            NcaPair => {
                let (cr, rr) = (s.chosen_ratio.f_mul_scalar(beta)?, s.rejected_ratio.f_mul_scalar(beta)?);
                let a = logsig(&cr)?.f_neg()?;
                a.f_sub(&logsig(&cr.f_neg()?)?.f_mul_scalar(0.5)?)?.f_sub(&logsig(&rr.f_neg()?)?.f_mul_scalar(0.5)?)?
            }
            Robust => {
                let clean = logsig(&bd)?.f_mul_scalar(-(1.0 - eps))?;
                let flipped = logsig(&bd.f_neg()?)?.f_mul_scalar(-eps)?;
                clean.f_sub(&flipped)?.f_div_scalar(1.0 - 2.0 * eps)?
            }
            BcoPair => {
                let (cr, rr) = (s.chosen_ratio.f_mul_scalar(beta)?, s.rejected_ratio.f_mul_scalar(beta)?);
                logsig(&cr)?.f_neg()?.f_sub(&logsig(&rr.f_neg()?)?)?
            }
            SppoHard => {
                let w = s.chosen_ratio.f_sub_scalar(0.5 / beta)?.f_square()?;
                w.f_add(&s.rejected_ratio.f_add_scalar(0.5 / beta)?.f_square()?)?
            }
            Aot => {
                let sorted = |t: Tensor| -> Result<Tensor> { Ok(t.f_sort(0, false)?.0) };
                let policy = sorted(s.chosen.f_sub(s.rejected)?)?;
                let reference = sorted(s.ref_chosen.f_sub(s.ref_rejected)?)?;
                smoothed(&policy.f_sub(&reference)?)?
            }
            AotUnpaired => {
                let sorted = |t: &Tensor| -> Result<Tensor> { Ok(t.f_sort(0, false)?.0) };
                smoothed(&sorted(s.chosen_ratio)?.f_sub(&sorted(s.rejected_ratio)?)?)?
            }
            ApoZero => {
                let chosen = s.chosen_ratio.f_mul_scalar(beta)?.f_sigmoid()?.f_neg()?.f_add_scalar(1.0)?;
                chosen.f_add(&s.rejected_ratio.f_mul_scalar(beta)?.f_sigmoid()?)?
            }
            ApoDown => {
                let chosen = s.chosen_ratio.f_mul_scalar(beta)?.f_sigmoid()?;
                let gap = s.chosen_ratio.f_sub(s.rejected_ratio)?.f_mul_scalar(beta)?.f_sigmoid()?;
                chosen.f_add(&gap.f_neg()?.f_add_scalar(1.0)?)?
            }
            Discopop => {
                let modulation = bd.f_div_scalar(discopop_tau)?.f_sigmoid()?;
                let logistic = logsig(&bd)?.f_neg()?;
                let exponential = bd.f_neg()?.f_exp()?;
                let keep = modulation.f_neg()?.f_add_scalar(1.0)?;
                logistic.f_mul(&keep)?.f_add(&exponential.f_mul(&modulation)?)?
            }
            // The chosen rows' mean token loss, the same for every pair.
            Sft => chosen_token_loss(s.per_token, s.mask)?.f_expand([s.chosen.size()[0]], false)?,
            SigmoidNorm => logsig(&per_token_delta()?.f_mul_scalar(beta)?)?.f_neg()?,
            Cpo | Simpo | Orpo => {
                return Err(Error::Config(format!("{} scores the policy with no reference", kind.name())))
            }
            Kto | ApoZeroUnpaired => {
                return Err(Error::Config(format!(
                    "{} scores unpaired completions (records of \"completion\" and \"label\"), not pairs",
                    kind.name()
                )))
            }
        })
    }

    /// A reference-free loss (CPO, SimPO, ORPO) of a micro-batch of pairs from its
    /// per-token log-probabilities and learned positions and the chosen rows' token loss
    /// `nll`; the scores its rewards are β times (each row's summed log-probability for
    /// CPO, else the per-token average); and the metrics it adds.
    fn reference_free(&self, per_token: &Tensor, mask: &Tensor, nll: &Tensor) -> Result<(Tensor, Tensor, Extras)> {
        let PreferenceConfig { beta, label_smoothing: eps, simpo_gamma, cpo_alpha, .. } = self.config;
        let kind = self.config.losses.first().map_or(PreferenceLoss::Cpo, |(k, _)| *k);
        let sums = per_token.f_sum_dim_intlist(1, false, per_token.kind())?;
        let lengths = mask.f_sum_dim_intlist(1, false, mask.kind())?.f_clamp_min(1.0)?;
        let scores = match kind {
            PreferenceLoss::Cpo => sums,
            _ => sums.f_div(&lengths)?,
        };
        let (chosen, rejected) = halves(&scores)?;
        let smoothed = |d: &Tensor| -> Result<Tensor> { Ok(smoothed_sigmoid(d, beta, eps)?.f_mean(d.kind())?) };
        let value = |t: &Tensor| -> Result<f64> { Ok(t.f_detach()?.f_double_value(&[])?) };
        let gap = chosen.f_sub(&rejected)?;
        let with_nll = |loss: Tensor, default_alpha: f64| -> Result<(Tensor, f64)> {
            // TRL reports a token loss of 0 where its weight is 0.
            match cpo_alpha.unwrap_or(default_alpha) {
                0.0 => Ok((loss, 0.0)),
                alpha => Ok((loss.f_add(&nll.f_mul_scalar(alpha)?)?, value(nll)?)),
            }
        };
        let (loss, nll_value, log_odds) = match kind {
            PreferenceLoss::Simpo => {
                let (loss, nll) = with_nll(smoothed(&gap.f_sub_scalar(simpo_gamma / beta)?)?, 0.0)?;
                (loss, nll, None)
            }
            PreferenceLoss::Orpo => {
                let odds = gap.f_sub(&log1mexp(&chosen)?.f_sub(&log1mexp(&rejected)?)?)?;
                let ratio = odds.f_log_sigmoid()?.f_mean(odds.kind())?;
                let loss = nll.f_sub(&ratio.f_mul_scalar(beta)?)?;
                (loss, value(nll)?, Some((value(&ratio)?, value(&odds.f_mean(odds.kind())?)?)))
            }
            _ => {
                let (loss, nll) = with_nll(smoothed(&gap)?, 1.0)?;
                (loss, nll, None)
            }
        };
        Ok((loss, scores, Extras { nll: Some(nll_value), log_odds, ..Extras::default() }))
    }

    /// Adds the micro-batch's sums to the tally (nothing here takes a gradient): the rows
    /// `sides` names, their learned positions and log-softmax, each row's score and reward
    /// (over β) in `scores`, and what `extras` adds.
    fn record(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        (mask, log_softmax): (&Tensor, &Tensor),
        sides: &Sides,
        (logps, ratios): (&Tensor, &Tensor),
        extras: Extras,
    ) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let value = |t: &Tensor| -> Result<f64> {
            Ok(t.f_detach()?.f_to_kind(Kind::Double)?.f_sum(Kind::Double)?.f_double_value(&[])?)
        };
        let picked = |t: &Tensor, rows: &Tensor| -> Result<f64> { value(&t.f_index_select(0, rows)?) };
        let logits = logits.f_detach()?.f_to_kind(Kind::Float)?;
        let over = |t: &Tensor, mask: &Tensor| -> Result<Tensor> {
            Ok(t.f_mul(mask)?.f_sum_dim_intlist(1, false, Kind::Float)?)
        };
        let per_row = |t: Tensor| over(&t, mask);
        let logit_mask = extras.logit_positions.as_ref().unwrap_or(mask);
        let mean_logits = over(&logits.f_mean_dim(-1, false, Kind::Float)?, logit_mask)?;
        let logit_positions = logit_mask.f_sum_dim_intlist(1, false, Kind::Float)?;
        let entropy = per_row(token_entropy(log_softmax)?)?;
        let top1 = per_row(logits.f_argmax(-1, false)?.f_eq_tensor(targets)?.f_to_kind(Kind::Float)?)?;
        let tokens = mask.f_sum_dim_intlist(1, false, Kind::Float)?;
        let rewards = ratios.f_mul_scalar(self.config.beta)?;
        let mut tally = Tally::default();
        let mut set = |sum: Sum, v: f64| tally.0[sum as usize] = v;
        set(Sum::Chosen, sides.chosen.size()[0] as f64);
        set(Sum::Rejected, sides.rejected.size()[0] as f64);
        set(Sum::RewardsChosen, picked(&rewards, &sides.chosen)?);
        set(Sum::RewardsRejected, picked(&rewards, &sides.rejected)?);
        set(Sum::LogpsChosen, picked(logps, &sides.chosen)?);
        set(Sum::LogpsRejected, picked(logps, &sides.rejected)?);
        set(Sum::LogitsChosen, picked(&mean_logits, &sides.chosen)?);
        set(Sum::LogitPositionsChosen, picked(&logit_positions, &sides.chosen)?);
        set(Sum::LogitsRejected, picked(&mean_logits, &sides.rejected)?);
        set(Sum::LogitPositionsRejected, picked(&logit_positions, &sides.rejected)?);
        set(Sum::ChosenTokens, picked(&tokens, &sides.chosen)?);
        set(Sum::RejectedTokens, picked(&tokens, &sides.rejected)?);
        set(Sum::Entropy, picked(&entropy, &sides.scored)?);
        set(Sum::EntropyTokens, picked(&tokens, &sides.scored)?);
        set(Sum::Top1, picked(&top1, &sides.chosen)?);
        if let Some(nll) = extras.nll {
            set(Sum::Nll, nll);
            set(Sum::FreeBatches, 1.0);
        }
        if let Some((ratio, odds)) = extras.log_odds {
            set(Sum::LogOddsRatio, ratio);
            set(Sum::LogOddsChosen, odds);
            set(Sum::OddsBatches, 1.0);
        }
        match extras.kl {
            Some(kl) => {
                set(Sum::Kl, kl);
                set(Sum::KlBatches, 1.0);
            }
            None => {
                let (chosen, rejected) =
                    (rewards.f_index_select(0, &sides.chosen)?, rewards.f_index_select(0, &sides.rejected)?);
                set(Sum::Accurate, value(&chosen.f_gt_tensor(&rejected)?)?);
            }
        }
        self.tally.lock().unwrap_or_else(|e| e.into_inner()).add(&tally);
        Ok(())
    }
}

/// What a micro-batch adds to its metrics beyond its rows' scores.
#[derive(Default)]
struct Extras {
    /// Unpaired completions: the KL estimate.
    kl: Option<f64>,
    /// Reference-free losses: the chosen rows' token loss (0 where it is not weighed in).
    nll: Option<f64>,
    /// ORPO: the mean log-sigmoid of the log odds ratio, and the mean log odds ratio.
    log_odds: Option<(f64, f64)>,
    /// The positions the mean logits read where not the completions' (CPO's and ORPO's:
    /// every position of a row but its padding), as a float mask.
    logit_positions: Option<Tensor>,
}

/// DPO's sigmoid loss of `β·d` under a label-flip rate `eps`, elementwise:
/// `-(1 - eps)·log σ(β·d) - eps·log σ(-β·d)` (AOT's, CPO's and SimPO's too).
fn smoothed_sigmoid(d: &Tensor, beta: f64, eps: f64) -> Result<Tensor> {
    let bd = d.f_mul_scalar(beta)?;
    let clean = bd.f_log_sigmoid()?.f_mul_scalar(-(1.0 - eps))?;
    Ok(clean.f_sub(&bd.f_neg()?.f_log_sigmoid()?.f_mul_scalar(eps)?)?)
}

/// The chosen rows' (the first half's) mean next-token loss over their learned positions.
fn chosen_token_loss(per_token: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (tokens, _) = halves(per_token)?;
    let (learned, _) = halves(mask)?;
    Ok(tokens.f_sum(tokens.kind())?.f_neg()?.f_div(&learned.f_sum(learned.kind())?)?)
}

/// The chosen rows' mean next-token loss over every position whose next token is not
/// padding, prompt included, from the rows' log-softmax `[rows, ctx, V]`.
fn chosen_row_loss(log_softmax: &Tensor, batch: &Batch) -> Result<Tensor> {
    let (rows, ctx) = (log_softmax.size()[0], log_softmax.size()[1]);
    let device = log_softmax.device();
    let next = batch.inputs.f_to_device(device)?.f_narrow(1, 1, ctx - 1)?;
    let picked = log_softmax.f_narrow(1, 0, ctx - 1)?.f_gather(-1, &next.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
    let real = match &batch.padding {
        Some(p) => p.f_to_device(device)?.f_narrow(1, 1, ctx - 1)?.f_logical_not()?,
        None => Tensor::f_ones([rows, ctx - 1], (Kind::Bool, device))?,
    };
    chosen_token_loss(&picked.f_mul(&real.f_to_kind(picked.kind())?)?, &real.f_to_kind(picked.kind())?)
}

/// `log(1 - exp(x))` for `x < 0`, computed on whichever side of `-ln 2` keeps its precision.
fn log1mexp(x: &Tensor) -> Result<Tensor> {
    let far = x.f_exp()?.f_neg()?.f_log1p()?;
    let near = x.f_expm1()?.f_neg()?.f_log()?;
    Ok(far.f_where_self(&x.f_lt(-std::f64::consts::LN_2)?, &near)?)
}

/// The rows a micro-batch's metrics read as chosen and as rejected, and the rows whose
/// tokens their entropy averages over (row indices).
struct Sides {
    chosen: Tensor,
    rejected: Tensor,
    scored: Tensor,
}

impl Sides {
    /// Pairs: the first half of the `rows` chosen, the second rejected, every row scored.
    fn paired(rows: i64, device: tch::Device) -> Result<Sides> {
        let all = Tensor::f_arange(rows, (Kind::Int64, device))?;
        Ok(Sides { chosen: all.f_narrow(0, 0, rows / 2)?, rejected: all.f_narrow(0, rows / 2, rows / 2)?, scored: all })
    }

    /// Unpaired completions (the first half of the rows, as many as `desirable` has):
    /// desirable ones chosen, the others rejected; the mismatched second half not scored.
    fn unpaired(desirable: &Tensor) -> Result<Sides> {
        let rows = |t: &Tensor| -> Result<Tensor> { Ok(t.f_nonzero()?.f_reshape([-1])?) };
        let n = desirable.size()[0];
        Ok(Sides {
            chosen: rows(desirable)?,
            rejected: rows(&desirable.f_logical_not()?)?,
            scored: Tensor::f_arange(n, (Kind::Int64, desirable.device()))?,
        })
    }
}

/// What the losses of a micro-batch's pairs read.
struct PairScores<'a> {
    chosen: &'a Tensor,
    rejected: &'a Tensor,
    ref_chosen: &'a Tensor,
    ref_rejected: &'a Tensor,
    chosen_ratio: &'a Tensor,
    rejected_ratio: &'a Tensor,
    /// Each row's learned positions.
    lengths: &'a Tensor,
    per_token: &'a Tensor,
    mask: &'a Tensor,
}

/// The chosen rows (the first half) and the rejected ones.
fn halves(t: &Tensor) -> Result<(Tensor, Tensor)> {
    let n = t.size()[0] / 2;
    Ok((t.f_narrow(0, 0, n)?, t.f_narrow(0, n, n)?))
}

/// A tensor-parallel group that splits the logits' columns, and the model's vocabulary
/// (the last rank's columns past it are padding).
#[derive(Clone)]
pub struct VocabularySplit {
    /// The group.
    pub group: Arc<dyn TensorParallel>,
    /// The model's vocabulary.
    pub vocab: i64,
}

/// `logits` with the vocabulary whole: gathered where `split` says.
pub(crate) fn whole_logits(split: Option<&VocabularySplit>, logits: &Tensor) -> Result<Tensor> {
    match split {
        Some(s) if logits.dim() == 3 => s.group.whole_vocabulary(logits, s.vocab),
        _ => Ok(logits.shallow_clone()),
    }
}

/// A loss function that scores nothing but records each row's summed completion
/// log-probability, in order, into `into` (its value is 0): run over every pair before
/// training, it gives the reference's scores. `split`: where a tensor-parallel group splits
/// the vocabulary.
pub fn reference_recorder(into: Arc<Mutex<Vec<f64>>>, split: Option<VocabularySplit>) -> ScoreFn {
    Arc::new(move |logits: &Tensor, batch: &Batch| {
        let sums = row_scores(logits, batch, split.as_ref())?.f_to_device(tch::Device::Cpu)?;
        into.lock().unwrap_or_else(|e| e.into_inner()).extend(Vec::<f64>::try_from(&sums)?);
        Ok(Tensor::f_zeros([], (Kind::Float, logits.device()))?)
    })
}

/// Each of `batch`'s rows' summed log-probability of its completion under `logits`
/// (`[rows]`, fp64, no gradient): a reference's scores, laid out as
/// [`Batch::reference`] holds them. `split`: where a tensor-parallel group splits the
/// vocabulary.
pub fn row_scores(logits: &Tensor, batch: &Batch, split: Option<&VocabularySplit>) -> Result<Tensor> {
    let _guard = tch::no_grad_guard();
    let logits = &whole_logits(split, logits)?;
    let (per_token, _, _) = token_log_probs(logits, &batch.targets.f_to_device(logits.device())?)?;
    // Summed as the policy's scores are, so that the two agree to the bit at the start.
    Ok(per_token.f_sum_dim_intlist(1, false, per_token.kind())?.f_to_kind(Kind::Double)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_trl_loss_name_parses_back_to_itself() {
        for loss in PreferenceLoss::all() {
            assert_eq!(loss.name().parse::<PreferenceLoss>().expect("a known name"), loss);
        }
        assert!("dpo".parse::<PreferenceLoss>().is_err());
    }

    #[test]
    fn parameters_a_loss_cannot_take_are_refused() {
        let config =
            |loss, eps| PreferenceConfig { losses: vec![(loss, 1.0)], label_smoothing: eps, ..Default::default() };
        assert!(config(PreferenceLoss::Robust, 0.5).validate().is_err());
        assert!(config(PreferenceLoss::Robust, 0.1).validate().is_ok());
        assert!(config(PreferenceLoss::ExoPair, 0.0).validate().is_err());
        let forward = PreferenceConfig {
            losses: vec![(PreferenceLoss::BcoPair, 1.0)],
            f_divergence: FDivergence::ForwardKl,
            ..Default::default()
        };
        assert!(forward.validate().is_err());
    }
}
