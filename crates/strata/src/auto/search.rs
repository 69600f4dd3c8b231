//! The strategy search: layouts pruned by device capability, world-size divisibility and
//! the memory estimate, then dry runs of the survivors — guided one dimension at a time
//! (precision, module replacement, sharding, tensor, pipeline and expert group sizes,
//! recomputation, offload) from a starting point predicted to fit, or all of them
//! (`SearchMode::Exhaustive`). Every trial carries its prediction (peak bytes, tokens/s)
//! beside what its dry run measured.
//!
//! The search asks a [`Measure`] for every dry run and for the time, so its logic runs the
//! same against real dry runs ([`super::bench::Bench`]) and against a deterministic cost
//! table. Every rank runs the same candidates in the same order and decides from outcomes
//! agreed as codes ([`agree_outcome`]), so every rank reaches the same decision.
//!
//! Owns the order of the trials and the choice. Must not build engines or train: every dry
//! run and every reading of the clock goes through the [`Measure`].
use super::candidate::{capability, Layout, Precision, Sharding, PRECISIONS};
use super::cost::{Analysis, Prediction};
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::strategy::Strategy;
use crate::{Error, Result};
use serde::Serialize;
use std::time::Duration;
use tch::Device;

/// Why a candidate was not dry-run, or what its dry run gave, as every rank agrees.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// Ruled out without a dry run: the device cannot run it, the job cannot take its shape,
    /// or its memory estimate is clearly over the budget.
    Pruned {
        /// Why it was ruled out.
        reason: String,
    },
    /// Ran on every rank within the budget: the slowest rank's speed, the largest peak.
    Fits {
        /// Tokens per second of the whole job, at the slowest rank.
        tokens_per_s: f64,
        /// The largest device peak over the ranks, bytes.
        peak_bytes: u64,
        /// Seconds the dry run took.
        seconds: f64,
    },
    /// Ran out of memory on some rank (`peak_bytes` unknown), or peaked over the budget.
    OverBudget {
        /// The largest peak over the ranks; `None` where a rank ran out of memory.
        peak_bytes: Option<u64>,
        /// Seconds the dry run took.
        seconds: f64,
    },
    /// Failed on some rank for another reason (this rank's error, or that another failed).
    Failed {
        /// This rank's error, or that another rank failed.
        reason: String,
        /// Seconds the dry run took.
        seconds: f64,
    },
    /// Not dry-run: the search chose or stopped without it.
    NotTried,
}

/// How one rank's dry run ended, as a code every rank can all-reduce: the largest wins.
const RAN: f64 = 0.0;
const OUT_OF_MEMORY: f64 = 1.0;
const FAILED: f64 = 2.0;

/// The outcome every rank agrees on from each rank's own dry run (`local`: tokens/s of the
/// job and peak bytes, or the error), taken `seconds`: the worst code, the slowest speed and
/// the largest peak over `group`. Only codes and numbers cross; error text stays local.
pub fn agree_outcome(
    group: Option<&dyn ProcessGroup>,
    local: &Result<(f64, u64)>,
    seconds: f64,
    budget: Option<u64>,
) -> Result<Outcome> {
    let mine = match local {
        Ok((speed, peak)) => [RAN, 1.0 / speed.max(1e-12), *peak as f64],
        Err(Error::OutOfMemory { .. }) => [OUT_OF_MEMORY, 0.0, 0.0],
        Err(_) => [FAILED, 0.0, 0.0],
    };
    let agreed = match group {
        Some(g) => all_reduce_values(g, &mine, ReduceOp::Max)?,
        None => mine.to_vec(),
    };
    let (code, inverse_speed, peak) = (agreed[0], agreed[1], agreed[2] as u64);
    Ok(if code >= FAILED {
        let reason = match local {
            Err(e) if !matches!(e, Error::OutOfMemory { .. }) => e.to_string(),
            _ => "failed on another rank".into(),
        };
        Outcome::Failed { reason, seconds }
    } else if code >= OUT_OF_MEMORY {
        Outcome::OverBudget { peak_bytes: None, seconds }
    } else if budget.is_some_and(|b| peak > b) {
        Outcome::OverBudget { peak_bytes: Some(peak), seconds }
    } else {
        Outcome::Fits { tokens_per_s: 1.0 / inverse_speed, peak_bytes: peak, seconds }
    })
}

/// What the search asks of the world: dry runs and the time, both agreed across ranks.
pub trait Measure {
    /// Dry-runs `layout` (as `strategy`) against `budget`.
    fn trial(&mut self, layout: &Layout, strategy: &Strategy, budget: Option<u64>) -> Result<Outcome>;
    /// Seconds since the search began (its analysis included), the largest over the ranks.
    fn elapsed(&mut self) -> Result<f64>;
}

/// One candidate of a search (or variant of a fine-tuning): its prediction and outcome.
#[derive(Clone, Debug, Serialize)]
pub struct Trial {
    /// Readable name: the layout's label, or the fine-tuning change tried.
    pub label: String,
    /// The search-space point (none for a fine-tuning variant).
    pub candidate: Option<Layout>,
    /// Its strategy in list form.
    pub strategy: Option<serde_json::Value>,
    /// What the analytic models predicted (none for a fine-tuning variant).
    pub predicted: Option<Prediction>,
    /// What its dry run gave, or why there was none.
    pub outcome: Outcome,
}

/// The readable account of a search.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SearchReport {
    /// How the strategy was found: `guided`, `exhaustive`, `finetune`, or loaded.
    pub mode: String,
    /// What the profiling pass learnt (none without a search).
    pub analysis: Option<Analysis>,
    /// Bytes each rank's device may hold, if limited.
    pub budget_bytes: Option<u64>,
    /// Every candidate tried or ruled out, in order.
    pub trials: Vec<Trial>,
    /// Every dry run executed, re-measurements included.
    pub dry_runs: usize,
    /// Label of the chosen trial, if any.
    pub chosen: Option<String>,
    /// The chosen candidate's strategy in list form.
    pub chosen_strategy: Option<serde_json::Value>,
    /// Seconds the search took, its analysis included (the largest over the ranks).
    pub seconds: f64,
    /// The time limit ended the search early.
    pub stopped_by_time_limit: bool,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / crate::profile::MIB
}

impl Trial {
    /// The predicted peak (0 where nothing was predicted).
    pub fn predicted_peak_bytes(&self) -> u64 {
        self.predicted.map_or(0, |p| p.peak_bytes)
    }
}

/// The share of the fastest measured speed below which a precision's leader gets no
/// alternatives of its own.
const LEADER_FLOOR: f64 = 0.5;

/// A measurement against its prediction (`predicted` 0: none).
fn against(measured: f64, predicted: f64) -> String {
    match predicted > 0.0 {
        true => format!(" ({:.2}× predicted)", measured / predicted),
        false => String::new(),
    }
}

impl SearchReport {
    /// One line per candidate dry-run or left untried (the chosen one marked), then the
    /// pruned ones counted by reason.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let mut pruned: Vec<(&str, usize)> = Vec::new();
        for t in &self.trials {
            let what = match &t.outcome {
                Outcome::Pruned { reason } => {
                    match pruned.iter_mut().find(|(r, _)| r == reason) {
                        Some(entry) => entry.1 += 1,
                        None => pruned.push((reason, 1)),
                    }
                    continue;
                }
                Outcome::Fits { tokens_per_s, peak_bytes, .. } => {
                    let speed = t.predicted.map_or(0.0, |p| p.tokens_per_s);
                    format!(
                        "{tokens_per_s:.0} tokens/s{}, peak {:.1} MiB{}",
                        against(*tokens_per_s, speed),
                        mib(*peak_bytes),
                        against(*peak_bytes as f64, t.predicted_peak_bytes() as f64)
                    )
                }
                Outcome::OverBudget { peak_bytes: Some(peak), .. } => {
                    let predicted = t.predicted_peak_bytes() as f64;
                    format!("peak {:.1} MiB{}, over the budget", mib(*peak), against(*peak as f64, predicted))
                }
                Outcome::OverBudget { peak_bytes: None, .. } => "out of memory".into(),
                Outcome::Failed { reason, .. } => format!("failed: {reason}"),
                Outcome::NotTried => "not dry-run".into(),
            };
            let mark = if self.chosen.as_deref() == Some(t.label.as_str()) { "*" } else { " " };
            let predicted = t.predicted.map_or(String::new(), |p| {
                format!("predicted {:>8.1} MiB {:>8.0} tokens/s", mib(p.peak_bytes), p.tokens_per_s)
            });
            out += &format!("{mark} {:<70} {predicted}  {what}\n", t.label);
        }
        for (reason, n) in pruned {
            out += &format!("  {n} candidates pruned: {reason}\n");
        }
        out += &format!("{} dry runs in {:.1} s\n", self.dry_runs, self.seconds);
        out
    }
}

/// How the search walks the candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SearchMode {
    /// One dimension at a time from a starting point predicted to fit.
    Guided,
    /// Every candidate that survives capability and divisibility pruning.
    Exhaustive,
}

/// Where the candidates would run and within what.
#[derive(Clone, Copy, Debug)]
pub struct SearchLimits {
    /// The device each rank runs on: what rules candidates out by capability.
    pub device: Device,
    /// Ranks in all.
    pub world: usize,
    /// Bytes each rank's device may hold.
    pub budget: Option<u64>,
    /// Time for the whole search; checked before every dry run.
    pub time_limit: Option<Duration>,
    /// Dry runs more of each close finalist (see [`AutoOptions::confirm_runs`]).
    ///
    /// [`AutoOptions::confirm_runs`]: super::AutoOptions::confirm_runs
    pub confirm_runs: usize,
}

/// The searched dimensions, as indices into [`coordinates`].
const PRECISION: usize = 0;
const MODULE_REPLACE: usize = 1;
const SHARDING: usize = 2;
const TENSOR: usize = 3;
const CHECKPOINT: usize = 4;
const OFFLOAD: usize = 5;
const PIPELINE: usize = 6;
const EXPERTS: usize = 7;

/// A layout's value in each searched dimension.
fn coordinates(l: &Layout) -> [u8; 8] {
    let c = &l.candidate;
    [
        c.precision as u8,
        c.module_replace as u8,
        c.sharding as u8,
        c.tensor as u8,
        c.checkpoint as u8,
        c.offload as u8,
        l.pipeline as u8,
        l.experts as u8,
    ]
}

/// Search state shared by both modes.
pub struct Search<'m> {
    measure: &'m mut dyn Measure,
    /// The candidates, in the order of `trials`.
    pub cands: Vec<Layout>,
    /// What the profiling pass learnt about the model.
    pub analysis: Analysis,
    /// Device, ranks, memory budget and time limit.
    pub limits: SearchLimits,
    /// Each candidate's prediction and outcome, in the order of `cands`.
    pub trials: Vec<Trial>,
    /// The time limit ended the search early.
    pub stopped_by_time_limit: bool,
    /// Dry runs executed, re-measurements included.
    pub dry_runs: usize,
    /// Log each dry run (the caller sets it on one rank).
    pub verbose: bool,
}

impl<'m> Search<'m> {
    /// A search over `cands` (of the model `analysis` profiled), each predicted by
    /// `predict` (a layout it cannot predict, the job cannot take) and measured by `measure`.
    pub fn new(
        measure: &'m mut dyn Measure,
        analysis: Analysis,
        cands: Vec<Layout>,
        predict: &mut dyn FnMut(&Layout) -> Result<Prediction>,
        limits: SearchLimits,
    ) -> Result<Search<'m>> {
        let trials = cands
            .iter()
            .map(|&l| -> Result<Trial> {
                let (predicted, outcome) = match capability(&l, limits.device, limits.world) {
                    Some(reason) => (None, Outcome::Pruned { reason }),
                    None => match predict(&l) {
                        Ok(p) => (Some(p), Outcome::NotTried),
                        Err(e) => (None, Outcome::Pruned { reason: e.to_string() }),
                    },
                };
                let strategy = Some(l.strategy(&analysis.blocks)?.to_value());
                Ok(Trial { label: l.label(), candidate: Some(l), strategy, predicted, outcome })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Search {
            measure,
            cands,
            analysis,
            limits,
            trials,
            stopped_by_time_limit: false,
            dry_runs: 0,
            verbose: false,
        })
    }

    fn predicted_fit(&self, i: usize) -> bool {
        self.limits.budget.is_none_or(|b| self.trials[i].predicted_peak_bytes() <= b)
    }

    fn open(&self, i: usize) -> bool {
        matches!(self.trials[i].outcome, Outcome::NotTried)
    }

    /// Whether the time limit is used up (all ranks agree). The first dry run always
    /// happens, so that a search ends with a measured strategy.
    fn out_of_time(&mut self) -> Result<bool> {
        let Some(limit) = self.limits.time_limit else { return Ok(false) };
        if self.dry_runs == 0 {
            return Ok(false);
        }
        let elapsed = self.measure.elapsed()?;
        self.stopped_by_time_limit |= elapsed >= limit.as_secs_f64();
        Ok(self.stopped_by_time_limit)
    }

    /// One dry run of candidate `i`, unless the time is up (then `None`).
    fn dry_run(&mut self, i: usize) -> Result<Option<Outcome>> {
        if self.out_of_time()? {
            return Ok(None);
        }
        let strategy = self.cands[i].strategy(&self.analysis.blocks)?;
        self.dry_runs += 1;
        let outcome = self.measure.trial(&self.cands[i], &strategy, self.limits.budget)?;
        if self.verbose {
            tracing::info!(candidate = %self.trials[i].label, outcome = ?outcome, "dry run");
        }
        Ok(Some(outcome))
    }

    /// Dry-runs candidate `i` if it has not been; its tokens/s if it fits.
    fn measure(&mut self, i: usize) -> Result<Option<f64>> {
        if self.open(i) {
            if let Some(outcome) = self.dry_run(i)? {
                self.trials[i].outcome = outcome;
            }
        }
        Ok(self.fitting_speed(i))
    }

    /// Whether candidate `i` ran out of memory or peaked over the budget.
    fn over_budget(&self, i: usize) -> bool {
        matches!(self.trials[i].outcome, Outcome::OverBudget { .. })
    }

    fn fitting_speed(&self, i: usize) -> Option<f64> {
        match self.trials[i].outcome {
            Outcome::Fits { tokens_per_s, .. } => Some(tokens_per_s),
            _ => None,
        }
    }

    /// The three fastest that lie within 15% of the best are measured `confirm_runs` times
    /// more each, alternating, and keep the mean of their runs: a single dry run on a busy machine does
    /// not decide a close call. A re-measurement that does not fit takes the candidate out.
    fn confirm_finalists(&mut self) -> Result<()> {
        let top = self.fastest(3);
        let Some(lead) = top.first().and_then(|&i| self.fitting_speed(i)) else { return Ok(()) };
        let close: Vec<usize> =
            top.into_iter().filter(|&i| self.fitting_speed(i).unwrap_or(0.0) >= 0.85 * lead).collect();
        if close.len() < 2 {
            return Ok(());
        }
        let mut runs: Vec<Vec<f64>> = close.iter().map(|&i| self.fitting_speed(i).into_iter().collect()).collect();
        'rounds: for _ in 0..self.limits.confirm_runs {
            for (k, &i) in close.iter().enumerate().rev() {
                if self.fitting_speed(i).is_none() {
                    continue; // a re-measurement found it no longer fits
                }
                let Some(outcome) = self.dry_run(i)? else { break 'rounds };
                match outcome {
                    Outcome::Fits { tokens_per_s, .. } => runs[k].push(tokens_per_s),
                    other => self.trials[i].outcome = other,
                }
            }
        }
        for (k, &i) in close.iter().enumerate() {
            if let Outcome::Fits { tokens_per_s, .. } = &mut self.trials[i].outcome {
                *tokens_per_s = runs[k].iter().sum::<f64>() / runs[k].len() as f64;
            }
        }
        Ok(())
    }

    /// The `k` fastest measured candidates that fit, fastest first.
    fn fastest(&self, k: usize) -> Vec<usize> {
        let mut measured: Vec<(usize, f64)> =
            (0..self.trials.len()).filter_map(|i| self.fitting_speed(i).map(|s| (i, s))).collect();
        measured.sort_by(|a, b| b.1.total_cmp(&a.1));
        measured.into_iter().take(k).map(|(i, _)| i).collect()
    }

    /// The fastest measured candidate that fits of each precision, fastest first. Precision
    /// interacts with every other dimension (the best sharding of bf16 parameters is not
    /// always fp32's), so each precision's leader gets the alternatives of each dimension,
    /// not only the overall fastest; but not a leader measured at under [`LEADER_FLOOR`] of
    /// the fastest (bf16 on a CPU without bf16 units): no other dimension makes up that much.
    fn precision_leaders(&self) -> Vec<usize> {
        let mut leaders: Vec<usize> = Vec::new();
        let fastest = self.fastest(self.trials.len());
        let floor = fastest.first().and_then(|&b| self.fitting_speed(b)).unwrap_or(0.0) * LEADER_FLOOR;
        for i in fastest {
            if self.fitting_speed(i).is_some_and(|s| s < floor) {
                break;
            }
            if leaders.iter().all(|&l| self.cands[l].candidate.precision != self.cands[i].candidate.precision) {
                leaders.push(i);
            }
        }
        leaders
    }

    /// Plain data parallel and plain fsdp (fp32, nothing else), where they may run.
    fn baselines(&self) -> Vec<usize> {
        let plain = |l: &Layout| {
            let c = &l.candidate;
            c.precision == Precision::Fp32
                && !c.module_replace
                && !c.checkpoint
                && c.tensor == 1
                && !c.offload
                && l.pipeline == 1
                && l.experts == 1
                && [Sharding::None, Sharding::Fsdp].contains(&c.sharding)
        };
        (0..self.cands.len()).filter(|&i| plain(&self.cands[i])).collect()
    }

    /// The fastest measured candidate that fits.
    pub fn best(&self) -> Option<usize> {
        self.fastest(1).first().copied()
    }

    /// Dry-runs every candidate neither pruned nor tried yet.
    pub fn exhaustive(&mut self) -> Result<()> {
        for i in 0..self.trials.len() {
            self.measure(i)?;
        }
        Ok(())
    }

    /// Coordinate search: from the candidate predicted to fit at the least cost, try the
    /// alternatives of one dimension at a time and keep the fastest that fits.
    pub fn guided(&mut self) -> Result<()> {
        if let Some(b) = self.limits.budget {
            for t in self.trials.iter_mut().filter(|t| matches!(t.outcome, Outcome::NotTried)) {
                // A margin: only a clear miss is pruned unmeasured.
                let predicted = t.predicted_peak_bytes();
                if predicted as f64 > b as f64 * 1.25 {
                    t.outcome = Outcome::Pruned {
                        reason: format!(
                            "the memory estimate predicts {:.1} MiB, over the {:.1} MiB budget",
                            mib(predicted),
                            mib(b)
                        ),
                    };
                }
            }
        }
        // The coordinate passes dry-run at most a third of the candidates the estimate left
        // (re-measuring the finalists, or finding any fit at all, may take more).
        let cap = (self.trials.iter().filter(|t| matches!(t.outcome, Outcome::NotTried)).count() / 3).max(1);
        // Cost order of the starting point: the least machinery (no recomputation, no
        // sharding, the reference modules) that is predicted to fit. Precision is decided
        // first, then replacement is tried on the chosen precision: fused kernels differ
        // most between precisions (bf16 attention can be slower fused on a CPU).
        let cost = |l: &Layout| {
            let c = &l.candidate;
            (
                c.offload,
                c.checkpoint,
                l.pipeline,
                c.tensor,
                l.experts,
                c.sharding,
                c.module_replace,
                PRECISIONS.iter().position(|p| *p == c.precision),
            )
        };
        let mut order: Vec<usize> = (0..self.trials.len()).filter(|&i| self.open(i)).collect();
        order.sort_by_key(|&i| (!self.predicted_fit(i), cost(&self.cands[i])));
        let Some(&start) = order.first() else { return Ok(()) };
        self.measure(start)?;
        // Plain data parallel and plain fsdp, the layouts anyone tries first, are dry-run
        // whatever the passes visit: the choice is never a layout measured slower than them.
        for i in self.baselines() {
            self.measure(i)?;
        }
        let mut current = self.best().unwrap_or(start);
        // Each dimension: the values it can take, each kept as close to the current choice as
        // fits (same recomputation and sharding if predicted to fit, else the least machinery
        // that is). Passes repeat while they change the choice, within a third of the
        // candidates in dry runs.
        // A dimension: its coordinate, and the coordinates its alternatives keep as they are.
        let dimensions: [(usize, &[usize]); 8] = [
            (PRECISION, &[MODULE_REPLACE, OFFLOAD, PIPELINE, EXPERTS]),
            (MODULE_REPLACE, &[PRECISION, OFFLOAD, PIPELINE, EXPERTS]),
            (SHARDING, &[PRECISION, MODULE_REPLACE, CHECKPOINT, TENSOR, OFFLOAD, PIPELINE, EXPERTS]),
            // Splitting units over a tensor group: the other methods kept.
            (TENSOR, &[PRECISION, MODULE_REPLACE, SHARDING, CHECKPOINT, OFFLOAD, PIPELINE]),
            // Stages leave fewer replicas to shard over: the sharding and tensor size closest
            // to the current ones that the ranks allow.
            (PIPELINE, &[PRECISION, MODULE_REPLACE, CHECKPOINT, OFFLOAD]),
            // Expert groups store a share of the experts each and leave fewer ranks to shard
            // the rest over: the sharding closest to the current one.
            (EXPERTS, &[PRECISION, MODULE_REPLACE, CHECKPOINT, TENSOR, OFFLOAD, PIPELINE]),
            // Recomputation and offload only cost time: try dropping them, never adding them
            // (below); the start is offloaded only when nothing else is predicted to fit.
            (CHECKPOINT, &[PRECISION, MODULE_REPLACE, SHARDING, TENSOR, OFFLOAD, PIPELINE, EXPERTS]),
            (OFFLOAD, &[PRECISION, MODULE_REPLACE, SHARDING, TENSOR, CHECKPOINT, PIPELINE, EXPERTS]),
        ];
        let value = |dimension: usize, l: &Layout| coordinates(l)[dimension];
        let keeps =
            |kept: &[usize], a: &Layout, b: &Layout| kept.iter().all(|&k| coordinates(a)[k] == coordinates(b)[k]);
        // First the options predicted to fit; then, under a budget and with dry runs to
        // spare, those predicted within the estimate's margin over it (the rest is pruned),
        // which may fit.
        let tiers = if self.limits.budget.is_some() { &[false, true][..] } else { &[false][..] };
        for &within_margin in tiers {
            for _pass in 0..2 {
                let before = current;
                for (dimension, kept) in dimensions {
                    let mut seeds = self.precision_leaders();
                    if seeds.is_empty() {
                        seeds.push(current);
                    }
                    for seed in seeds {
                        let here = self.cands[seed];
                        // A seed over the budget also gets its own value's next option.
                        let here_fits = !self.over_budget(seed);
                        let distance = |l: &Layout| {
                            let (c, h) = (&l.candidate, &here.candidate);
                            (
                                c.offload != h.offload,
                                c.checkpoint != h.checkpoint,
                                l.pipeline != here.pipeline,
                                c.tensor != h.tensor,
                                l.experts != here.experts,
                                c.sharding != h.sharding,
                                cost(l),
                            )
                        };
                        let mut options: Vec<usize> = (0..self.trials.len())
                            .filter(|&i| !matches!(self.trials[i].outcome, Outcome::Pruned { .. }))
                            .filter(|&i| within_margin || self.predicted_fit(i))
                            .filter(|&i| {
                                let c = &self.cands[i];
                                i != seed
                                    && keeps(kept, &here, c)
                                    && !(dimension == CHECKPOINT && c.candidate.checkpoint)
                                    && !(dimension == OFFLOAD && c.candidate.offload)
                                    && (value(dimension, c) != value(dimension, &here) || !here_fits)
                            })
                            .collect();
                        options.sort_by_key(|&i| distance(&self.cands[i]));
                        // Per value, the closest option; when it turns out not to fit, the next.
                        let mut settled: Vec<u8> = Vec::new();
                        for i in options {
                            let v = value(dimension, &self.cands[i]);
                            if settled.contains(&v) {
                                continue;
                            }
                            if self.dry_runs >= cap || self.stopped_by_time_limit {
                                break;
                            }
                            if self.measure(i)?.is_some() || !self.over_budget(i) {
                                settled.push(v);
                            }
                        }
                    }
                    current = self.best().unwrap_or(current);
                }
                if current == before || self.dry_runs >= cap || self.stopped_by_time_limit {
                    break;
                }
            }
        }
        self.confirm_finalists()?;
        // Nothing measured fits: try the rest, least memory first, until one does.
        if self.best().is_none() {
            let mut rest: Vec<usize> = (0..self.trials.len()).filter(|&i| self.open(i)).collect();
            rest.sort_by_key(|&i| self.trials[i].predicted_peak_bytes());
            for i in rest {
                if self.measure(i)?.is_some() || self.stopped_by_time_limit {
                    break;
                }
            }
        }
        Ok(())
    }

    /// The readable account of the search so far, with trial `chosen` as the choice.
    pub fn report(&mut self, mode: SearchMode, chosen: Option<usize>) -> Result<SearchReport> {
        Ok(SearchReport {
            mode: format!("{mode:?}").to_lowercase(),
            analysis: Some(self.analysis.clone()),
            budget_bytes: self.limits.budget,
            trials: self.trials.clone(),
            dry_runs: self.dry_runs,
            chosen: chosen.map(|i| self.trials[i].label.clone()),
            chosen_strategy: chosen
                .map(|i| self.cands[i].strategy(&self.analysis.blocks))
                .transpose()?
                .map(|s| s.to_value()),
            seconds: self.measure.elapsed()?,
            stopped_by_time_limit: self.stopped_by_time_limit,
        })
    }
}
