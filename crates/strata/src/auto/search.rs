//! The strategy search: candidates from every method (minus `excluded`, each containing
//! `included`), pruned by device capability, world-size divisibility and a memory model fed
//! by one profiling pass, then dry runs — warm-up and measured steps — of the survivors,
//! guided one dimension at a time (precision, module replacement, sharding, recomputation)
//! from a starting point predicted to fit, or of all of them (`SearchMode::Exhaustive`).
//! Every rank runs the same candidates in the same order and agrees on each measurement
//! (the slowest step and the largest peak), so every rank reaches the same decision.
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::data::Step;
use crate::engine::{memory, EngineConfig, Phase, ScheduleContext, UnitSchedule};
use crate::model::{Builder, ModelSpec};
use crate::optim::{GroupRule, Optimizer, OptimizerConfig, Schedule};
use crate::parallel::{self, Placement};
use crate::strategy::Strategy;
use crate::train::{InputFn, LossFn, Trainer};
use crate::{Error, Result};
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::Device;

/// How the numbers are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    Fp32,
    AmpBf16,
    AmpFp16,
    HalfBf16,
    HalfFp16,
    /// fp8 linear layers (head excluded) over bf16 autocast.
    Fp8,
}

const PRECISIONS: [Precision; 6] =
    [Precision::Fp32, Precision::AmpBf16, Precision::HalfBf16, Precision::AmpFp16, Precision::HalfFp16, Precision::Fp8];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Sharding {
    None,
    Zero1,
    Zero2,
    Fsdp,
}

const SHARDINGS: [Sharding; 4] = [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp];

/// One point of the search space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Candidate {
    pub precision: Precision,
    pub module_replace: bool,
    pub sharding: Sharding,
    pub checkpoint: bool,
}

impl Candidate {
    /// The method names the candidate uses.
    pub fn methods(&self) -> Vec<&'static str> {
        let mut m = vec!["parallel_mode"];
        m.extend(match self.precision {
            Precision::Fp32 => &[][..],
            Precision::AmpBf16 | Precision::AmpFp16 => &["amp_native"],
            Precision::HalfBf16 | Precision::HalfFp16 => &["half"],
            Precision::Fp8 => &["fp8", "amp_native"],
        });
        if self.module_replace {
            m.push("module_replace");
        }
        if self.checkpoint {
            m.push("checkpoint");
        }
        m.extend(match self.sharding {
            Sharding::None => None,
            Sharding::Zero1 => Some("zero1"),
            Sharding::Zero2 => Some("zero2"),
            Sharding::Fsdp => Some("fsdp"),
        });
        m
    }

    /// The candidate as a strategy; `blocks` are the unit kinds recomputed by `checkpoint`.
    pub fn strategy(&self, blocks: &[String]) -> Result<Strategy> {
        let mut items = vec![serde_json::json!("parallel_mode")];
        items.extend(match self.precision {
            Precision::Fp32 => vec![],
            Precision::AmpBf16 => vec![serde_json::json!(["amp_native", {"dtype": "bf16"}])],
            Precision::AmpFp16 => vec![serde_json::json!(["amp_native", {"dtype": "fp16"}])],
            Precision::HalfBf16 => vec![serde_json::json!(["half", "bf16"])],
            Precision::HalfFp16 => vec![serde_json::json!(["half", "fp16"])],
            Precision::Fp8 => vec![
                serde_json::json!(["fp8", {"exclude": ["lm_head"]}]),
                serde_json::json!(["amp_native", {"dtype": "bf16"}]),
            ],
        });
        if self.module_replace {
            items.push(serde_json::json!("module_replace"));
        }
        if self.checkpoint {
            items.push(serde_json::json!(["checkpoint", blocks]));
        }
        if let Some(name) = self.methods().iter().find(|m| ["zero1", "zero2", "fsdp"].contains(m)) {
            items.push(serde_json::json!(name));
        }
        Strategy::from_value(&serde_json::Value::Array(items))
    }

    pub fn label(&self) -> String {
        let mut parts = vec![match self.precision {
            Precision::Fp32 => "fp32",
            Precision::AmpBf16 => "amp bf16",
            Precision::AmpFp16 => "amp fp16",
            Precision::HalfBf16 => "half bf16",
            Precision::HalfFp16 => "half fp16",
            Precision::Fp8 => "fp8 + amp bf16",
        }];
        if self.module_replace {
            parts.push("module_replace");
        }
        if self.checkpoint {
            parts.push("checkpoint");
        }
        parts.push(match self.sharding {
            Sharding::None => "data parallel",
            Sharding::Zero1 => "zero1",
            Sharding::Zero2 => "zero2",
            Sharding::Fsdp => "fsdp",
        });
        parts.join(" + ")
    }
}

/// What the profiling pass learnt about the model.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    pub params: i64,
    pub unit_params: Vec<i64>,
    /// Bytes each unit's forward keeps for backward (fp32, one micro-batch of this rank).
    pub unit_activation_bytes: Vec<u64>,
    /// Bytes of each unit's output.
    pub unit_output_bytes: Vec<u64>,
    /// Seconds of one fp32 forward and backward of one micro-batch.
    pub step_seconds: f64,
    /// Unit kinds that repeat (the blocks): what `checkpoint` recomputes.
    pub blocks: Vec<String>,
}

/// Why a candidate was not dry-run, or what its dry run gave.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Pruned { reason: String },
    Measured { tokens_per_s: f64, peak_bytes: u64, fits: bool, seconds: f64 },
    Failed { reason: String },
    NotTried,
}

#[derive(Clone, Debug, Serialize)]
pub struct Trial {
    pub label: String,
    /// The search-space point (none for a fine-tuning variant).
    pub candidate: Option<Candidate>,
    /// Its strategy in list form.
    pub strategy: Option<serde_json::Value>,
    pub predicted_peak_bytes: u64,
    pub outcome: Outcome,
}

/// The readable account of a search.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SearchReport {
    pub mode: String,
    pub analysis: Option<Analysis>,
    pub budget_bytes: Option<u64>,
    pub trials: Vec<Trial>,
    pub dry_runs: usize,
    pub chosen: Option<String>,
    pub chosen_strategy: Option<serde_json::Value>,
    pub seconds: f64,
    pub stopped_by_time_limit: bool,
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
                Outcome::Measured { tokens_per_s, peak_bytes, fits, .. } => format!(
                    "{tokens_per_s:.0} tokens/s, peak {:.1} MB{}",
                    *peak_bytes as f64 / 1e6,
                    if *fits { "" } else { ", over the budget" }
                ),
                Outcome::Failed { reason } => format!("failed: {reason}"),
                Outcome::NotTried => "not dry-run".into(),
            };
            let mark = if self.chosen.as_deref() == Some(t.label.as_str()) { "*" } else { " " };
            out +=
                &format!("{mark} {:<58} predicted {:>8.1} MB  {what}\n", t.label, t.predicted_peak_bytes as f64 / 1e6);
        }
        for (reason, n) in pruned {
            out += &format!("  {n} candidates pruned: {reason}\n");
        }
        out += &format!("{} dry runs in {:.1} s\n", self.dry_runs, self.seconds);
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SearchMode {
    /// One dimension at a time from a starting point predicted to fit.
    Guided,
    /// Every candidate that survives capability and divisibility pruning.
    Exhaustive,
}

/// Everything a dry run needs; shared by all candidates.
pub struct Bench<'a> {
    pub model: &'a (dyn Fn(&mut Builder) -> Result<()> + Sync),
    pub freeze: &'a [String],
    pub engine: EngineConfig,
    pub optimizer: OptimizerConfig,
    pub rules: &'a [GroupRule],
    pub schedule: Schedule,
    pub grad_clip: Option<f64>,
    pub placement: Placement<'a>,
    pub prepare_input: InputFn,
    pub loss_func: LossFn,
    /// This rank's steps: the first is warm-up, the rest are timed.
    pub steps: Vec<Step>,
    /// The group every rank belongs to, to agree on measurements.
    pub world: Option<Arc<dyn ProcessGroup>>,
}

impl Bench<'_> {
    pub fn spec(&self) -> Result<ModelSpec> {
        let mut b = Builder::new();
        (self.model)(&mut b)?;
        let mut spec = b.build()?;
        spec.freeze(self.freeze)?;
        Ok(spec)
    }

    /// The largest of `values` over all ranks.
    fn agree(&self, values: &[f64]) -> Result<Vec<f64>> {
        match &self.world {
            Some(g) => all_reduce_values(g.as_ref(), values, ReduceOp::Max),
            None => Ok(values.to_vec()),
        }
    }

    /// Dry-runs `strategy`; the outcome as every rank sees it: the slowest rank's speed, the
    /// largest peak, and a failure (out of memory or other) on any rank.
    pub fn trial(&self, strategy: &Strategy, budget: Option<u64>) -> Result<Outcome> {
        let started = Instant::now();
        let result = self.dry_run(strategy);
        let seconds = started.elapsed().as_secs_f64();
        let (speed, peak, failed, oom) = match &result {
            Ok((speed, peak)) => (1.0 / speed.max(1e-12), *peak as f64, 0.0, 0.0),
            Err(Error::OutOfMemory { .. }) => (0.0, 0.0, 1.0, 1.0),
            Err(_) => (0.0, 0.0, 1.0, 0.0),
        };
        let agreed = self.agree(&[speed, peak, failed, oom])?;
        Ok(if agreed[3] > 0.0 {
            Outcome::Failed { reason: "over the memory budget".into() }
        } else if agreed[2] > 0.0 {
            Outcome::Failed { reason: result.err().map_or("failed on another rank".into(), |e| e.to_string()) }
        } else {
            let peak = agreed[1] as u64;
            Outcome::Measured {
                tokens_per_s: 1.0 / agreed[0],
                peak_bytes: peak,
                fits: budget.is_none_or(|b| peak <= b),
                seconds,
            }
        })
    }

    fn world_size(&self) -> usize {
        self.placement.comm.map_or(1, |c| c.size())
    }

    /// Trains the warm-up and timed steps with `strategy`; (tokens/s of the job, peak bytes).
    pub fn dry_run(&self, strategy: &Strategy) -> Result<(f64, u64)> {
        let device = self.engine.device;
        let mut engine = parallel::build_engine(self.spec()?, self.engine.clone(), strategy, &self.placement)?;
        let optimizer = Optimizer::new(&mut engine, self.optimizer.clone(), self.rules)?;
        let mut trainer = Trainer::new(engine, optimizer, self.schedule.clone(), self.grad_clip);
        trainer.scaling = strategy.grad_scaling()?;
        trainer.prepare_input = self.prepare_input.clone();
        trainer.loss_func = self.loss_func.clone();
        memory::reset_allocator_peak(device);
        // The median timed step: one slow step of a shared machine does not decide.
        let mut rates = Vec::new();
        for (i, step) in self.steps.iter().enumerate() {
            let report = trainer.train_step(step)?;
            if i > 0 {
                rates.push(report.tokens as f64 * self.world_size() as f64 / report.seconds.max(1e-9));
            }
        }
        rates.sort_by(f64::total_cmp);
        let ledger_peak = trainer.engine.ledger().report().get(&crate::engine::Placement::Device).map_or(0, |r| r.peak);
        let peak = memory::allocator_peak(device).unwrap_or(0).max(ledger_peak);
        Ok((rates.get(rates.len() / 2).copied().unwrap_or(0.0), peak))
    }
}

/// Bytes each unit keeps between its forward and its backward, and its output's.
struct Probe {
    device: Device,
    at_start: Vec<(i64, u64)>,
    kept: Arc<Mutex<Vec<(u64, u64)>>>,
}

fn allocated(device: Device) -> i64 {
    match device {
        Device::Cuda(i) => strata_ext::cuda::memory_stats(i).map(|s| s.allocated).unwrap_or(0),
        _ => strata_ext::cpu_memory::stats().map(|s| s.0).unwrap_or(0),
    }
}

fn activations_held(ctx: &ScheduleContext<'_>) -> u64 {
    let report = ctx.ledger.report();
    report
        .get(&crate::engine::Placement::Device)
        .and_then(|r| r.by_category.get(&crate::engine::Category::Activations))
        .copied()
        .unwrap_or(0)
}

impl UnitSchedule for Probe {
    fn on(&mut self, phase: Phase, ctx: ScheduleContext<'_>) -> Result<()> {
        match phase {
            Phase::BeforeForward => {
                self.at_start.resize(ctx.unit + 1, (0, 0));
                self.at_start[ctx.unit] = (allocated(self.device), activations_held(&ctx));
            }
            Phase::AfterForward => {
                let (mem, act) = self.at_start[ctx.unit];
                let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
                kept.resize(ctx.unit + 1, (0, 0));
                kept[ctx.unit] =
                    ((allocated(self.device) - mem).max(0) as u64, activations_held(&ctx).saturating_sub(act));
            }
            _ => {}
        }
        Ok(())
    }
}

/// One fp32 forward and backward on a micro-batch, unit by unit: parameters per unit,
/// what each unit keeps for backward, the time, the repeated unit kinds.
pub fn analyse(bench: &Bench<'_>) -> Result<Analysis> {
    let spec = bench.spec()?;
    let unit_params: Vec<i64> =
        spec.units.iter().map(|u| u.params.iter().map(|id| spec.params[id.0].numel()).sum()).collect();
    let mut kinds: Vec<String> = spec.units.iter().map(|u| u.kind().to_string()).collect();
    let blocks: Vec<String> = {
        let all = kinds.clone();
        kinds.sort();
        kinds.dedup();
        kinds.into_iter().filter(|k| all.iter().filter(|a| *a == k).count() > 1).collect()
    };
    let params = spec.num_params();
    let config = EngineConfig { device_budget: None, ..bench.engine.clone() };
    let mut engine = crate::engine::Engine::new(spec, config)?;
    let kept = Arc::new(Mutex::new(Vec::new()));
    engine.set_schedule(Box::new(Probe { device: bench.engine.device, at_start: vec![], kept: kept.clone() }));
    let batch = bench
        .steps
        .first()
        .and_then(|s| s.micro_batches.first())
        .ok_or_else(|| Error::Data("no batch to profile".into()))?;
    let start = Instant::now();
    let out = engine.forward(&(bench.prepare_input)(batch)?)?;
    engine.backward(&(bench.loss_func)(&out, batch)?)?;
    let step_seconds = start.elapsed().as_secs_f64();
    let kept = kept.lock().unwrap_or_else(|e| e.into_inner()).clone();
    // Every rank predicts from the same numbers: the largest over the ranks.
    let local: Vec<f64> = kept.iter().flat_map(|k| [k.0 as f64, k.1 as f64]).chain([step_seconds]).collect();
    let agreed = bench.agree(&local)?;
    let (pairs, step_seconds) = agreed.split_at(agreed.len() - 1);
    Ok(Analysis {
        params,
        unit_params,
        unit_activation_bytes: pairs.chunks(2).map(|k| k[0] as u64).collect(),
        unit_output_bytes: pairs.chunks(2).map(|k| k[1] as u64).collect(),
        step_seconds: step_seconds[0],
        blocks,
    })
}

/// The peak bytes per rank the memory model predicts for `c` (AdamW's two fp32 moments).
pub fn predicted_peak(a: &Analysis, c: &Candidate, world: usize) -> u64 {
    let psi = a.params as f64;
    let n = if c.sharding == Sharding::None { 1.0 } else { world as f64 };
    let (p, g, k) = match c.precision {
        Precision::HalfBf16 | Precision::HalfFp16 => (2.0, 2.0, 8.0),
        _ => (4.0, 4.0, 8.0),
    };
    let largest = a.unit_params.iter().copied().max().unwrap_or(0) as f64;
    let states = match c.sharding {
        Sharding::None => psi * (p + g + k),
        Sharding::Zero1 => psi * (p + g) + psi * k / n,
        Sharding::Zero2 => psi * p + psi * (g + k) / n + 2.0 * largest * g,
        Sharding::Fsdp => psi * (p + g + k) / n + 2.0 * largest * (p + g),
    };
    // Lower precision keeps lower-precision copies of most saved tensors; fused attention
    // keeps no score matrices.
    let scale = match c.precision {
        Precision::Fp32 => 1.0,
        Precision::HalfBf16 | Precision::HalfFp16 => 0.55,
        _ => 0.8,
    } * if c.module_replace { 0.85 } else { 1.0 };
    let acts: Vec<f64> = a.unit_activation_bytes.iter().map(|&b| b as f64 * scale).collect();
    let activations = if c.checkpoint {
        let blocks_kept: f64 = a.unit_output_bytes.iter().map(|&b| b as f64).sum();
        let biggest = acts.iter().copied().fold(0.0, f64::max);
        blocks_kept + biggest
    } else {
        acts.iter().sum()
    };
    (states + activations) as u64
}

/// The candidates: every combination of the methods that exist, minus those using an
/// `excluded` method, keeping only those using every `included` one.
pub fn candidates(excluded: &[String], included: &[String], has_blocks: bool) -> Vec<Candidate> {
    let mut out = Vec::new();
    for precision in PRECISIONS {
        for module_replace in [true, false] {
            for sharding in SHARDINGS {
                for checkpoint in [false, true] {
                    if checkpoint && !has_blocks {
                        continue;
                    }
                    let c = Candidate { precision, module_replace, sharding, checkpoint };
                    let methods = c.methods();
                    if methods.iter().any(|m| excluded.iter().any(|e| e == m)) {
                        continue;
                    }
                    if included.iter().all(|i| methods.contains(&i.as_str())) {
                        out.push(c);
                    }
                }
            }
        }
    }
    out
}

/// Why `c` cannot run here, if it cannot: the device lacks fast kernels for it, or there is
/// nothing to shard.
pub fn capability(c: &Candidate, device: Device, world: usize) -> Option<String> {
    let fp16 = matches!(c.precision, Precision::AmpFp16 | Precision::HalfFp16);
    match device {
        Device::Cpu if fp16 => return Some("libtorch has no fast fp16 matrix products on the CPU".into()),
        Device::Cpu if c.precision == Precision::Fp8 => return Some("fp8 products are emulated on the CPU".into()),
        _ if c.precision == Precision::Fp8 => {
            if let Some(why) = crate::compute::fp8::unsupported_on(device) {
                return Some(why);
            }
        }
        _ => {}
    }
    (world == 1 && c.sharding != Sharding::None).then(|| "nothing to shard on one rank".into())
}

/// Search state shared by both modes.
pub struct Search<'a> {
    pub bench: &'a Bench<'a>,
    /// The candidates, in the order of `trials`.
    pub cands: Vec<Candidate>,
    pub analysis: Analysis,
    pub budget: Option<u64>,
    pub time_limit: Option<Duration>,
    pub trials: Vec<Trial>,
    started: Instant,
    pub stopped_by_time_limit: bool,
    pub dry_runs: usize,
    pub verbose: bool,
}

impl<'a> Search<'a> {
    /// A search over `cands` from `analysis`; `started` is when the search (its analysis
    /// included) began, for the time limit.
    pub fn new(
        bench: &'a Bench<'a>,
        analysis: Analysis,
        cands: Vec<Candidate>,
        budget: Option<u64>,
        time_limit: Option<Duration>,
        started: Instant,
    ) -> Result<Search<'a>> {
        let world = bench.world_size();
        let trials = cands
            .iter()
            .map(|&c| -> Result<Trial> {
                let predicted = predicted_peak(&analysis, &c, world);
                let outcome = match capability(&c, bench.engine.device, world) {
                    Some(reason) => Outcome::Pruned { reason },
                    None => Outcome::NotTried,
                };
                let strategy = Some(c.strategy(&analysis.blocks)?.to_value());
                Ok(Trial { label: c.label(), candidate: Some(c), strategy, predicted_peak_bytes: predicted, outcome })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Search {
            bench,
            cands,
            analysis,
            budget,
            time_limit,
            trials,
            started,
            stopped_by_time_limit: false,
            dry_runs: 0,
            verbose: false,
        })
    }

    fn predicted_fit(&self, i: usize) -> bool {
        self.budget.is_none_or(|b| self.trials[i].predicted_peak_bytes <= b)
    }

    fn open(&self, i: usize) -> bool {
        matches!(self.trials[i].outcome, Outcome::NotTried)
    }

    /// Whether the time limit is used up (all ranks agree).
    fn out_of_time(&mut self) -> Result<bool> {
        let Some(limit) = self.time_limit else { return Ok(false) };
        let elapsed = self.bench.agree(&[self.started.elapsed().as_secs_f64()])?[0];
        self.stopped_by_time_limit |= elapsed >= limit.as_secs_f64();
        Ok(self.stopped_by_time_limit)
    }

    /// Dry-runs candidate `i` (once) unless the time is up — the first dry run always
    /// happens, so that a search ends with a measured strategy; returns its tokens/s if it
    /// fits.
    fn measure(&mut self, i: usize) -> Result<Option<f64>> {
        if !self.open(i) {
            return Ok(self.fitting_speed(i));
        }
        if self.dry_runs > 0 && self.out_of_time()? {
            return Ok(None);
        }
        let strategy = self.cands[i].strategy(&self.analysis.blocks)?;
        self.dry_runs += 1;
        self.trials[i].outcome = self.bench.trial(&strategy, self.budget)?;
        if self.verbose && self.bench.placement.comm.is_none_or(|c| c.rank() == 0) {
            tracing::info!(candidate = %self.trials[i].label, outcome = ?self.trials[i].outcome, "dry run");
        }
        Ok(self.fitting_speed(i))
    }

    /// Whether candidate `i` was measured (or failed) for want of memory.
    fn over_budget(&self, i: usize) -> bool {
        match &self.trials[i].outcome {
            Outcome::Measured { fits, .. } => !fits,
            Outcome::Failed { reason } => reason.contains("memory"),
            _ => false,
        }
    }

    fn fitting_speed(&self, i: usize) -> Option<f64> {
        match self.trials[i].outcome {
            Outcome::Measured { tokens_per_s, fits: true, .. } => Some(tokens_per_s),
            _ => None,
        }
    }

    /// The three fastest that lie within 15% of the best are measured twice more each,
    /// alternating, and keep the mean of their three runs: a single dry run on a busy
    /// machine does not decide a close call.
    fn confirm_finalists(&mut self) -> Result<()> {
        let top = self.fastest(3);
        let Some(lead) = top.first().and_then(|&i| self.fitting_speed(i)) else { return Ok(()) };
        let close: Vec<usize> =
            top.into_iter().filter(|&i| self.fitting_speed(i).unwrap_or(0.0) >= 0.85 * lead).collect();
        if close.len() < 2 || self.out_of_time()? {
            return Ok(());
        }
        let mut sums: Vec<f64> = close.iter().map(|&i| self.fitting_speed(i).unwrap_or(0.0)).collect();
        for _ in 0..2 {
            for (k, &i) in close.iter().enumerate().rev() {
                let strategy = self.cands[i].strategy(&self.analysis.blocks)?;
                let speed = match self.bench.dry_run(&strategy) {
                    Ok((speed, _)) => 1.0 / speed.max(1e-12),
                    Err(_) => f64::INFINITY,
                };
                sums[k] += 1.0 / self.bench.agree(&[speed])?[0];
            }
        }
        for (k, &i) in close.iter().enumerate() {
            if let Outcome::Measured { tokens_per_s, .. } = &mut self.trials[i].outcome {
                *tokens_per_s = sums[k] / 3.0;
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

    /// The fastest measured candidate that fits.
    pub fn best(&self) -> Option<usize> {
        (0..self.trials.len())
            .filter_map(|i| self.fitting_speed(i).map(|s| (i, s)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(i, _)| i)
    }

    pub fn exhaustive(&mut self) -> Result<()> {
        for i in 0..self.trials.len() {
            self.measure(i)?;
        }
        Ok(())
    }

    /// Coordinate search: from the candidate predicted to fit at the least cost, try the
    /// alternatives of one dimension at a time and keep the fastest that fits.
    pub fn guided(&mut self) -> Result<()> {
        // At most a third of the candidates that could run are dry-run.
        let cap = (self.trials.iter().filter(|t| matches!(t.outcome, Outcome::NotTried)).count() / 3).max(1);
        if let Some(b) = self.budget {
            for t in self.trials.iter_mut().filter(|t| matches!(t.outcome, Outcome::NotTried)) {
                // A margin: only a clear miss is pruned unmeasured.
                if t.predicted_peak_bytes as f64 > b as f64 * 1.25 {
                    t.outcome = Outcome::Pruned {
                        reason: format!(
                            "the memory model predicts {:.1} MB, over the {:.1} MB budget",
                            t.predicted_peak_bytes as f64 / 1e6,
                            b as f64 / 1e6
                        ),
                    };
                }
            }
        }
        // Cost order of the starting point: the least machinery (no recomputation, no
        // sharding, the reference modules) that is predicted to fit. Precision is decided
        // first, then replacement is tried on the chosen precision: fused kernels differ
        // most between precisions (bf16 attention can be slower fused on a CPU).
        let cost = |c: &Candidate| {
            (c.checkpoint, c.sharding, c.module_replace, PRECISIONS.iter().position(|p| *p == c.precision))
        };
        let mut order: Vec<usize> = (0..self.trials.len()).filter(|&i| self.open(i)).collect();
        order.sort_by_key(|&i| (!self.predicted_fit(i), cost(&self.cands[i])));
        let Some(&start) = order.first() else { return Ok(()) };
        self.measure(start)?;
        let mut current = start;
        // Each dimension: the values it can take, each kept as close to the current choice as
        // fits (same recomputation and sharding if predicted to fit, else the least machinery
        // that is). Passes repeat while they change the choice, within a third of the
        // candidates in dry runs.
        type Key = fn(&Candidate) -> u8;
        type Keeps = fn(&Candidate, &Candidate) -> bool;
        let dimensions: [(Key, Keeps); 4] = [
            (|c| c.precision as u8, |a, b| a.module_replace == b.module_replace),
            (|c| c.module_replace as u8, |a, b| a.precision == b.precision),
            (
                |c| c.sharding as u8,
                |a, b| {
                    a.precision == b.precision && a.module_replace == b.module_replace && a.checkpoint == b.checkpoint
                },
            ),
            // Recomputation only costs time: try dropping it, never adding it.
            (
                |c| c.checkpoint as u8,
                |a, b| {
                    a.precision == b.precision
                        && a.module_replace == b.module_replace
                        && a.sharding == b.sharding
                        && !b.checkpoint
                },
            ),
        ];
        for _pass in 0..2 {
            let before = current;
            for (value, keeps) in dimensions {
                // The two fastest so far each get their alternatives: dimensions interact
                // (the best sharding of one precision is not always another's).
                let mut seeds = self.fastest(2);
                if seeds.is_empty() {
                    seeds.push(current);
                }
                for seed in seeds {
                    let here = self.cands[seed];
                    // A seed over the budget also gets its own value's next option.
                    let here_fits = !self.over_budget(seed);
                    let distance =
                        |c: &Candidate| (c.checkpoint != here.checkpoint, c.sharding != here.sharding, cost(c));
                    let mut options: Vec<usize> = (0..self.trials.len())
                        .filter(|&i| self.predicted_fit(i) && !matches!(self.trials[i].outcome, Outcome::Pruned { .. }))
                        .filter(|&i| {
                            i != seed
                                && keeps(&here, &self.cands[i])
                                && (value(&self.cands[i]) != value(&here) || !here_fits)
                        })
                        .collect();
                    options.sort_by_key(|&i| distance(&self.cands[i]));
                    // Per value, the closest option; when it turns out not to fit, the next.
                    let mut settled: Vec<u8> = Vec::new();
                    for i in options {
                        let v = value(&self.cands[i]);
                        if settled.contains(&v) {
                            continue;
                        }
                        if self.dry_runs >= cap {
                            break;
                        }
                        if self.measure(i)?.is_some() || !self.over_budget(i) {
                            settled.push(v);
                        }
                    }
                }
                current = self.best().unwrap_or(current);
            }
            if current == before || self.dry_runs >= cap {
                break;
            }
        }
        self.confirm_finalists()?;
        // Nothing measured fits: try the rest, least memory first, until one does.
        if self.best().is_none() {
            let mut rest: Vec<usize> = (0..self.trials.len()).filter(|&i| self.open(i)).collect();
            rest.sort_by_key(|&i| self.trials[i].predicted_peak_bytes);
            for i in rest {
                if self.measure(i)?.is_some() || self.stopped_by_time_limit {
                    break;
                }
            }
        }
        Ok(())
    }

    pub fn report(&self, mode: SearchMode, chosen: Option<usize>) -> Result<SearchReport> {
        Ok(SearchReport {
            mode: format!("{mode:?}").to_lowercase(),
            analysis: Some(self.analysis.clone()),
            budget_bytes: self.budget,
            trials: self.trials.clone(),
            dry_runs: self.dry_runs,
            chosen: chosen.map(|i| self.trials[i].label.clone()),
            chosen_strategy: chosen
                .map(|i| self.cands[i].strategy(&self.analysis.blocks))
                .transpose()?
                .map(|s| s.to_value()),
            seconds: self.started.elapsed().as_secs_f64(),
            stopped_by_time_limit: self.stopped_by_time_limit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_cover_every_method_and_honour_included_and_excluded() {
        let all = candidates(&[], &[], true);
        assert_eq!(all.len(), PRECISIONS.len() * 2 * SHARDINGS.len() * 2);
        for c in &all {
            let s = c.strategy(&["GptBlock".into()]).unwrap();
            let names: Vec<&str> = s.methods.iter().map(|m| m.name()).collect();
            assert_eq!(names.len(), c.methods().len(), "{}", c.label());
        }
        let some = candidates(&["fsdp".into()], &["checkpoint".into(), "amp_native".into()], true);
        assert!(!some.is_empty());
        assert!(some
            .iter()
            .all(|c| c.checkpoint && c.sharding != Sharding::Fsdp && c.methods().contains(&"amp_native")));
        assert!(
            candidates(&[], &["checkpoint".into()], false).is_empty(),
            "nothing to recompute without repeated units"
        );
        let cpu = Candidate {
            precision: Precision::HalfFp16,
            module_replace: false,
            sharding: Sharding::None,
            checkpoint: false,
        };
        assert!(capability(&cpu, Device::Cpu, 1).is_some());
        let shard = Candidate { precision: Precision::Fp32, sharding: Sharding::Zero2, ..cpu };
        assert_eq!(capability(&shard, Device::Cpu, 1).as_deref(), Some("nothing to shard on one rank"));
        assert!(capability(&shard, Device::Cpu, 2).is_none());
    }

    #[test]
    fn the_memory_model_orders_the_methods_as_zero_does() {
        let a = Analysis {
            params: 1_000_000,
            unit_params: vec![100_000; 10],
            unit_activation_bytes: vec![1_000_000; 10],
            unit_output_bytes: vec![100_000; 10],
            step_seconds: 0.1,
            blocks: vec!["Block".into()],
        };
        let at = |precision, sharding, checkpoint| {
            predicted_peak(&a, &Candidate { precision, module_replace: false, sharding, checkpoint }, 4)
        };
        let fp32 = Precision::Fp32;
        assert!(at(fp32, Sharding::None, false) > at(fp32, Sharding::Zero1, false));
        assert!(at(fp32, Sharding::Zero1, false) > at(fp32, Sharding::Zero2, false));
        assert!(at(fp32, Sharding::Zero2, false) > at(fp32, Sharding::Fsdp, false));
        assert!(at(fp32, Sharding::None, true) < at(fp32, Sharding::None, false), "recomputation keeps less");
        assert!(at(Precision::HalfBf16, Sharding::None, false) < at(Precision::AmpBf16, Sharding::None, false));
    }
}
