//! Real dry runs: a job's model, optimizer and batches, trained for a few steps under one
//! strategy and measured (tokens/s, allocator peak), and the profiling pass that feeds the
//! memory model.
//!
//! Owns the dry runs and the profiling pass. Must not choose between candidates: it reports
//! each outcome, and [`super::search`] decides.
use super::candidate::Layout;
use super::cost::Analysis;
use super::search::{agree_outcome, Measure, Outcome};
use crate::comm::{all_reduce_values, Comm, ProcessGroup, ReduceOp};
use crate::data::Step;
use crate::engine::{
    memory, ActivationOffload, Category, EngineConfig, GradLayout, HeldStates, MemoryLedger, Phase, ScheduleContext,
    UnitSchedule, UnitStorage,
};
use crate::generate::GenerateConfig;
use crate::model::{Builder, ModelSpec, SequencePiece};
use crate::optim::{GroupRule, LrSchedule, OptimizerConfig};
use crate::parallel::{self, Mesh, RankLayout, TrainerSetup};
use crate::strategy::{LoraConfig, Strategy};
use crate::train::{Feed, Trainer};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tch::{Device, Tensor};

/// Decoding a dry run does before its steps, as a run does beside its own (GRPO's
/// generation): a rank's generation batch of continuations of `prompt`, `new_tokens` each,
/// decoded together with the key/value cache.
#[derive(Clone, Debug)]
pub struct GenerationProbe {
    /// The prompt every row continues.
    pub prompt: Vec<i64>,
    /// Micro-batches of a generation batch (GRPO's `steps_per_generation`), or `None`: a
    /// step's. A rank decodes as many rows as these micro-batches of its hold together.
    pub micro_batches: Option<usize>,
    /// Tokens each row decodes.
    pub new_tokens: usize,
    /// The model's vocabulary, where a tensor group splits the head's columns (each rank
    /// then gathers the whole logits).
    pub vocab: Option<i64>,
    /// The run keeps a frozen fp32 copy of the model as the KL term's reference: each dry
    /// run's peak counts the rank's share of it (its tensor piece, its stage's units; whole
    /// under ZeRO), and its trainer plans offload with room for the whole copy.
    pub reference_copy: bool,
}

/// Everything a dry run needs; shared by all candidates.
pub struct Bench<'a> {
    /// Adds the model's layers to a builder; called anew for each dry run and for [`Self::spec`].
    pub model: &'a (dyn Fn(&mut Builder) -> Result<()> + Sync),
    /// Patterns of parameter names to keep frozen ([`ModelSpec::freeze`]).
    pub freeze: &'a [String],
    /// Adapters every dry run trains (the model's description has them, and each strategy
    /// tried gains the `lora` method).
    pub lora: Option<&'a LoraConfig>,
    /// The profiling pass computes the loss in the head, this many positions at a time
    /// (the search's pass over layouts with `chunked_loss`).
    pub chunk: Option<i64>,
    /// Engine settings each dry run's trainer is built with.
    pub engine: EngineConfig,
    /// Optimizer each dry run trains with.
    pub optimizer: OptimizerConfig,
    /// Parameter groups with their own learning rate or weight decay.
    pub rules: &'a [GroupRule],
    /// Learning-rate schedule of the dry runs.
    pub schedule: LrSchedule,
    /// Global gradient-norm clip, if any.
    pub grad_clip: Option<f64>,
    /// The communicator and ranks each strategy's mesh is made from.
    pub placement: RankLayout<'a>,
    /// What the dry runs (and the measurements before them) feed the model and score it by.
    pub feed: Feed,
    /// This rank's steps per share of the batch and piece of the rows ([`batch_key`]): the
    /// first is warm-up, the rest are timed; or why the batch does not split that way.
    pub steps: BTreeMap<BatchKey, std::result::Result<Vec<Step>, String>>,
    /// The group every rank belongs to, to agree on measurements.
    pub world: Option<Arc<dyn ProcessGroup>>,
    /// Decoding each dry run does before its steps.
    pub generation: Option<GenerationProbe>,
    /// When the search (or check) that uses this bench began.
    pub started: Instant,
}

/// Which batches a rank reads: its index among the data replicas and their count (the
/// ranks of a tensor group or a pipeline read the same batches), and its piece of every
/// row under context parallelism.
pub type BatchKey = (usize, usize, Option<SequencePiece>);

/// The batches this rank of `mesh` reads under `strategy`.
pub fn batch_key(mesh: &Mesh, strategy: &Strategy) -> BatchKey {
    let (index, count) = mesh.batch_shard();
    (index, count, parallel::rows_piece(mesh, strategy))
}

/// The search measures by real dry runs.
impl Measure for &Bench<'_> {
    fn trial(&mut self, _layout: &Layout, strategy: &Strategy, budget: Option<u64>) -> Result<Outcome> {
        Bench::trial(self, strategy, budget)
    }

    fn elapsed(&mut self) -> Result<f64> {
        Bench::elapsed(self)
    }
}

impl Bench<'_> {
    /// The model's description as the dry runs train it: with the bench's adapters, and `freeze` applied.
    pub fn spec(&self) -> Result<ModelSpec> {
        let mut b = Builder::new();
        (self.model)(&mut b)?;
        let mut spec = b.build()?;
        if let Some(lora) = self.lora {
            lora.apply(&mut spec)?;
        }
        spec.freeze(self.freeze)?;
        Ok(spec)
    }

    /// `strategy` with the bench's `lora` method, where it has one and the strategy not.
    fn with_adapters(&self, strategy: &Strategy) -> Strategy {
        let mut strategy = strategy.clone();
        if let (Some(lora), None) = (self.lora, strategy.lora()) {
            strategy.methods.push(crate::strategy::Method::Lora(lora.clone()));
        }
        strategy
    }

    /// The largest of `values` over all ranks.
    fn agree(&self, values: &[f64]) -> Result<Vec<f64>> {
        match &self.world {
            Some(g) => all_reduce_values(g.as_ref(), values, ReduceOp::Max),
            None => Ok(values.to_vec()),
        }
    }

    /// Dry-runs `strategy`; the outcome every rank agrees on ([`agree_outcome`]).
    pub fn trial(&self, strategy: &Strategy, budget: Option<u64>) -> Result<Outcome> {
        let started = Instant::now();
        let attempt = self.placement.comm.map(Comm::attempt);
        let result = self.dry_run(strategy);
        // Peers still waiting on this rank in the dry run's groups (a pipeline's later
        // stages, a collective this rank never joined, a group it never made) stop waiting
        // now, not at the timeout.
        if let (Err(e), Some(attempt)) = (&result, &attempt) {
            attempt.give_up(&e.to_string())?;
        }
        drop(attempt);
        let outcome = agree_outcome(self.world.as_deref(), &result, started.elapsed().as_secs_f64(), budget)?;
        // A dry run that failed on some rank (every rank agrees it did) may have left the
        // ranks with different numbers of groups made.
        let failed = matches!(outcome, Outcome::Failed { .. } | Outcome::OverBudget { peak_bytes: None, .. });
        if let (Some(comm), Some(world), true) = (self.placement.comm, &self.world, failed) {
            comm.align_groups(world.as_ref())?;
        }
        Ok(outcome)
    }

    /// Seconds since the bench was made (the search's start), the largest over the ranks.
    pub fn elapsed(&self) -> Result<f64> {
        Ok(self.agree(&[self.started.elapsed().as_secs_f64()])?[0])
    }

    /// Ranks taking part: the communicator's size, or 1 without one.
    pub fn world_size(&self) -> usize {
        self.placement.comm.map_or(1, |c| c.size())
    }

    /// This rank's steps on `mesh` under `strategy`, and the ranks reading other tokens of
    /// them (the data replicas, times the context ranks reading other pieces of the rows).
    fn steps_for(&self, mesh: &Mesh, strategy: &Strategy) -> Result<(&[Step], usize)> {
        let key = batch_key(mesh, strategy);
        let steps = match self.steps.get(&key) {
            Some(Ok(steps)) => steps.as_slice(),
            Some(Err(why)) => return Err(Error::Config(why.clone())),
            None => {
                return Err(Error::Config(format!(
                    "no batches for replica {} of {} at {} ranks",
                    key.0,
                    key.1,
                    self.world_size()
                )))
            }
        };
        Ok((steps, key.1 * key.2.map_or(1, |piece| piece.count)))
    }

    /// Trains the warm-up and timed steps with `strategy`; (tokens/s of the job, peak bytes).
    pub fn dry_run(&self, strategy: &Strategy) -> Result<(f64, u64)> {
        let strategy = &self.with_adapters(strategy);
        let mesh = self.placement.mesh(strategy)?;
        let (steps, readers) = self.steps_for(&mesh, strategy)?;
        let device = self.engine.device;
        let copying = self.generation.as_ref().is_some_and(|g| g.reference_copy);
        let engine = match (copying, self.engine.device_budget) {
            (true, Some(budget)) => {
                let whole = self.spec()?.num_params() as u64 * 4;
                EngineConfig { device_budget: Some(budget.saturating_sub(whole)), ..self.engine.clone() }
            }
            _ => self.engine.clone(),
        };
        let mut trainer = self.trainer_with(engine, strategy, &steps[0], None)?;
        let copy = if copying { reference_copy_bytes(&trainer) } else { 0 };
        memory::reset_allocator_peak(device);
        // Each step starts its own peak: the decoding's is read before the first.
        let decoding_peak = match &self.generation {
            Some(probe) => {
                let micro_rows = steps[0].micro_batches.first().map_or(0, |b| b.inputs.size()[0] as usize);
                let rows = micro_rows * probe.micro_batches.unwrap_or(steps[0].micro_batches.len());
                probe.decode(&mut trainer, rows)?;
                memory::allocator_peak(device).unwrap_or(0)
            }
            None => 0,
        };
        // The median timed step: one slow step of a shared machine does not decide.
        let mut rates = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let report = trainer.train_step(step)?;
            if i > 0 {
                rates.push(report.tokens as f64 * readers as f64 / report.seconds.max(1e-9));
            }
        }
        rates.sort_by(f64::total_cmp);
        let (mut ledger_peak, mut host) = (0, 0);
        for ledger in trainer.ledgers() {
            let report = ledger.report();
            ledger_peak += report.get(&crate::engine::Placement::Device).map_or(0, |r| r.peak);
            host += report.get(&crate::engine::Placement::Host).map_or(0, |r| r.current);
        }
        // On the CPU the allocator also holds what the ledger places on the host.
        let host = if device == Device::Cpu { host } else { 0 };
        let allocated = memory::allocator_peak(device).unwrap_or(0).max(decoding_peak);
        let peak = allocated.saturating_sub(host).max(ledger_peak) + copy;
        Ok((rates.get(rates.len() / 2).copied().unwrap_or(0.0), peak))
    }

    /// This rank's trainer for `strategy`, built as a run builds it: an offload plan keeps
    /// room for what a step holds beside model states, and a pipeline balances its stages
    /// by the unit costs the strategy asks for, measured on `first`. A one-engine trainer
    /// averages its losses over `report_over`.
    pub fn trainer(
        &self,
        strategy: &Strategy,
        first: &Step,
        report_over: Option<Arc<dyn ProcessGroup>>,
    ) -> Result<Trainer> {
        self.trainer_with(self.engine.clone(), strategy, first, report_over)
    }

    /// [`Bench::trainer`] with its engines configured by `engine`.
    fn trainer_with(
        &self,
        engine: EngineConfig,
        strategy: &Strategy,
        first: &Step,
        report_over: Option<Arc<dyn ProcessGroup>>,
    ) -> Result<Trainer> {
        let spec = || self.spec();
        let first_step = || Ok(first);
        parallel::build_trainer(&TrainerSetup {
            spec: &spec,
            engine,
            strategy,
            comm: self.placement.comm,
            local_world_size: self.placement.local_world_size,
            data_parallel: self.placement.data_parallel,
            optimizer: self.optimizer.clone(),
            rules: self.rules,
            schedule: self.schedule.clone(),
            grad_clip: self.grad_clip,
            micro_batches: first.micro_batches.len(),
            feed: self.feed.clone(),
            first_step: Some(&first_step),
            report_over,
        })
    }
}

/// Profiles one micro-batch unit by unit without ever holding the whole model: a unit's
/// parameters (and the units' whose parameters it borrows) are given memory just before its
/// forward or backward and freed right after, as FSDP does on one rank; their values are a
/// constant (the profile measures bytes and time, not what is learnt). Records the bytes
/// each unit keeps between its forward and its backward, and its output's.
struct Probe {
    device: Device,
    /// Units each unit reads: itself and the owners of parameters it borrows.
    needs: Vec<Vec<usize>>,
    at_start: Vec<(i64, u64)>,
    kept: Arc<Mutex<Vec<(u64, u64)>>>,
}

/// The value every profiled parameter holds.
const PROFILE_VALUE: f64 = 0.02;

impl Probe {
    /// Gives the units `ctx.unit` reads their parameters (and gradients, for backward).
    fn materialise(&self, ctx: &ScheduleContext<'_>, grads: bool) -> Result<()> {
        for &u in &self.needs[ctx.unit] {
            let s = &ctx.storage[u];
            let mut buffers = vec![(&s.flat, Category::Params)];
            if grads {
                buffers.push((&s.grad, Category::Grads));
            }
            for (t, category) in buffers {
                if strata_ext::storage_nbytes(t)? > 0 {
                    continue;
                }
                ctx.ledger.alloc(crate::engine::Placement::Device, category, memory::tensor_bytes(t))?;
                // SAFETY: the engine's per-unit buffers span their storages.
                unsafe { memory::restore_buffer(t) }?;
                let value = if category == Category::Params { PROFILE_VALUE } else { 0.0 };
                // Written through an alias of the memory, not `t` itself: autograd has saved
                // views of these parameters in forward, and a write through them would count
                // as a change of what backward needs (it changes nothing it needs here).
                // SAFETY: the alias covers exactly `t`'s elements, restored just above, and
                // lives only for the fill.
                let alias = unsafe {
                    Tensor::f_from_blob(t.data_ptr() as *const u8, &[t.numel() as i64], &[], t.kind(), t.device())
                }?;
                let _ = alias.shallow_clone().f_fill_(value)?;
            }
        }
        Ok(())
    }

    /// Frees what [`Probe::materialise`] gave.
    fn release(&self, ctx: &ScheduleContext<'_>) -> Result<()> {
        for &u in &self.needs[ctx.unit] {
            let s = &ctx.storage[u];
            for (t, category) in [(&s.flat, Category::Params), (&s.grad, Category::Grads)] {
                if strata_ext::storage_nbytes(t)? == 0 {
                    continue;
                }
                // SAFETY: the unit's forward or backward is over; the next use materialises
                // (and refills) it first.
                unsafe { memory::release_buffer(t) }?;
                ctx.ledger.free(crate::engine::Placement::Device, category, memory::tensor_bytes(t));
            }
        }
        Ok(())
    }
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
                self.materialise(&ctx, false)?;
                if self.at_start.len() <= ctx.unit {
                    self.at_start.resize(ctx.unit + 1, (0, 0));
                }
                self.at_start[ctx.unit] = (allocated(self.device), activations_held(&ctx));
            }
            Phase::AfterForward => {
                let (mem, act) = self.at_start[ctx.unit];
                let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
                if kept.len() <= ctx.unit {
                    kept.resize(ctx.unit + 1, (0, 0));
                }
                kept[ctx.unit] =
                    ((allocated(self.device) - mem).max(0) as u64, activations_held(&ctx).saturating_sub(act));
                drop(kept);
                self.release(&ctx)?;
            }
            Phase::BeforeBackward => self.materialise(&ctx, true)?,
            Phase::AfterBackward => self.release(&ctx)?,
        }
        Ok(())
    }
}

/// Keeps nothing beside the engine's buffers.
impl HeldStates for Probe {}

/// One fp32 forward and backward on a micro-batch, unit by unit: parameters per unit,
/// what each unit keeps for backward, the time, the repeated unit kinds. Where the device
/// cannot keep every unit's values, again with each unit's values waiting on the host once
/// measured, so that long rows can still be profiled.
pub fn analyse(bench: &Bench<'_>) -> Result<Analysis> {
    match analyse_with(bench, false) {
        Err(Error::OutOfMemory { placement, .. }) if placement == crate::engine::Placement::Device.name() => {
            analyse_with(bench, true)
        }
        other => other,
    }
}

fn analyse_with(bench: &Bench<'_>, shelve: bool) -> Result<Analysis> {
    let spec = bench.spec()?;
    let unit_params: Vec<i64> =
        spec.units.iter().map(|u| u.params.iter().map(|id| spec.params[id.0].numel()).sum()).collect();
    let blocks = spec.block_kinds();
    let params = spec.num_params();
    let trainable_params = spec.params.iter().filter(|p| p.requires_grad).map(|p| p.numel()).sum();
    // Sizes dividing the world: tensor sizes the model splits over, pipeline sizes that
    // leave each stage a unit, expert group sizes its experts split over.
    let world = bench.world_size();
    let divisors = (2..=world).filter(|d| world.is_multiple_of(*d));
    let tensor_sizes: Vec<usize> = divisors.clone().filter(|&t| spec.check_tensor_parallel(t as i64).is_ok()).collect();
    let pipeline_sizes: Vec<usize> = divisors.filter(|&p| p <= spec.units.len()).collect();
    let expert_sizes = spec.expert_group_sizes(world);
    let needs = spec.units_read();
    // Within the device budget: one unit at a time is ever resident.
    // Unit by unit both ways: backward must pass through the probe to find its units' memory.
    let config = EngineConfig {
        grad_layout: GradLayout::PerUnit,
        backward: crate::engine::BackwardMode::UnitByUnit,
        ..bench.engine.clone()
    };
    let mut release_after_init = |_: usize, s: &mut UnitStorage, _: &Tensor, ledger: &MemoryLedger| -> Result<()> {
        for (t, category) in [(&s.flat, Category::Params), (&s.grad, Category::Grads)] {
            // SAFETY: nothing has run yet; the probe materialises a unit before any use.
            unsafe { memory::release_buffer(t) }?;
            ledger.free(crate::engine::Placement::Device, category, memory::tensor_bytes(t));
        }
        Ok(())
    };
    memory::reset_allocator_peak(bench.engine.device);
    let units = spec.units.len();
    let mut engine = crate::engine::Engine::new_with(spec, config, &mut release_after_init)?;
    engine.set_chunked_loss(bench.chunk)?;
    if shelve {
        let shelved = ActivationOffload { min_bytes: 1024, pin_memory: true };
        engine.set_activation_offload((0..units).map(|k| (k + 1 < units).then_some(shelved)).collect())?;
    }
    let kept = Arc::new(Mutex::new(Vec::new()));
    engine.set_schedule(Box::new(Probe { device: bench.engine.device, needs, at_start: vec![], kept: kept.clone() }));
    // A micro-batch of whole rows: plain data parallelism's, or, where the batch does not
    // split over every rank, that of a layout with fewer replicas.
    let default = Strategy::default();
    let batch = match bench.steps_for(&bench.placement.mesh(&default)?, &default) {
        Ok((steps, _)) => steps.first(),
        Err(_) => bench.steps.iter().find_map(|((_, _, piece), steps)| match (piece, steps) {
            (None, Ok(steps)) => steps.first(),
            _ => None,
        }),
    }
    .and_then(|s| s.micro_batches.first())
    .ok_or_else(|| Error::Data("no batch to profile".into()))?;
    let start = Instant::now();
    crate::train::set_rows(&mut engine, batch, Some(crate::train::first_step_draw(batch)));
    let out = engine.forward(&(bench.feed.input)(batch)?)?;
    let loss = bench.feed.loss_of(&engine);
    engine.backward(&crate::train::training_loss(&engine, &loss, &out, batch)?)?;
    let step_seconds = start.elapsed().as_secs_f64();
    let kept = kept.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let ledger_peak = engine.ledger().report().get(&crate::engine::Placement::Device).map_or(0, |r| r.peak);
    let allocator_peak = memory::allocator_peak(bench.engine.device).unwrap_or(0);
    // Every rank predicts from the same numbers: the largest over the ranks.
    let local: Vec<f64> = kept
        .iter()
        .flat_map(|k| [k.0 as f64, k.1 as f64])
        .chain([step_seconds, ledger_peak as f64, allocator_peak as f64])
        .collect();
    let agreed = bench.agree(&local)?;
    let (pairs, totals) = agreed.split_at(agreed.len() - 3);
    Ok(Analysis {
        params,
        trainable_params,
        unit_params,
        unit_activation_bytes: pairs.chunks(2).map(|k| k[0] as u64).collect(),
        unit_output_bytes: pairs.chunks(2).map(|k| k[1] as u64).collect(),
        profiled_rows: batch.inputs.size().first().copied().unwrap_or(1).max(1) as u64,
        profiled_tokens: batch.inputs.numel() as u64,
        step_seconds: totals[0],
        ledger_peak_bytes: totals[1] as u64,
        allocator_peak_bytes: totals[2] as u64,
        blocks,
        tensor_sizes,
        pipeline_sizes,
        expert_sizes,
    })
}

/// Bytes of an fp32 copy of the parameters `trainer`'s parts hold whole, as a run's frozen
/// reference holds them: split over a tensor group as the model is, a pipeline stage's own
/// units, not sharded by ZeRO.
fn reference_copy_bytes(trainer: &Trainer) -> u64 {
    let part_bytes = |engine: &crate::engine::Engine| -> u64 {
        let tp = engine.tensor_parallel().map_or(1, |t| t.size());
        engine.spec().params.iter().map(|p| p.local_shape(tp).iter().product::<i64>() as u64 * 4).sum()
    };
    trainer.parts().iter().map(|part| part_bytes(&part.engine)).sum()
}

impl GenerationProbe {
    /// Decodes `rows` continuations with `trainer`'s model (greedily: sampling holds the same).
    fn decode(&self, trainer: &mut Trainer, rows: usize) -> Result<()> {
        let group = trainer.parts().iter().find_map(|part| part.engine.tensor_parallel().cloned());
        let vocabulary = match (group, self.vocab) {
            (None, _) => None,
            (Some(group), Some(vocab)) => Some(crate::preference::VocabularySplit { group, vocab }),
            (Some(_), None) => {
                return Err(Error::Config("decoding under tensor parallelism needs the model's vocabulary".into()))
            }
        };
        let config = GenerateConfig { max_new_tokens: self.new_tokens, cache: true, ..GenerateConfig::default() };
        let prompts = vec![self.prompt.clone(); rows];
        crate::generate::generate_batch(trainer, vocabulary.as_ref(), &prompts, &config, None)?;
        Ok(())
    }
}
