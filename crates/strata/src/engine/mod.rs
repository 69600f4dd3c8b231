//! The engine: owns parameter storage and runs a model unit by unit.
//!
//! Owns: one flat parameter buffer and one flat gradient buffer per unit (every parameter is
//! a view at an offset into them), the forward pass in unit order, the backward pass in
//! reverse order seeded with each unit's upstream gradient, and the [`MemoryLedger`] entries
//! for what it holds. Must not own optimisation policy (that is the optimizer's), data, or
//! what a strategy does to a unit: strategies plug in through [`UnitSchedule`], which the
//! engine calls around every unit's forward and backward — the seam where sharding
//! (gather before, free after), prefetch, recompute and offload go.

pub mod memory;

use crate::model::{Init, ModelSpec, ParamId, ParamSpec, Params};
use crate::{Error, Result};
pub use memory::{Category, MemoryLedger, Placement};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// How backward walks the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardMode {
    /// Each unit's graph is cut at its input; backward runs unit by unit in reverse with the
    /// upstream gradient, so the engine acts between units (the mode strategies build on).
    UnitByUnit,
    /// One autograd graph over the whole model and one backward call (a reference).
    WholeGraph,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub device: Device,
    /// dtype of parameters whose spec does not fix one.
    pub kind: Kind,
    /// Seed of parameter initialisation.
    pub seed: i64,
    pub backward: BackwardMode,
    /// Bytes the compute device may hold; `None` for no limit.
    pub device_budget: Option<u64>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            device: Device::Cpu,
            kind: Kind::Float,
            seed: 0,
            backward: BackwardMode::UnitByUnit,
            device_budget: None,
        }
    }
}

/// A unit's contiguous storage.
pub struct UnitStorage {
    /// All parameters the unit owns, concatenated in declaration order.
    pub flat: Tensor,
    /// Their gradients, laid out the same way; autograd accumulates into it.
    pub grad: Tensor,
}

/// The moment of a unit's execution at which a [`UnitSchedule`] is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    BeforeForward,
    AfterForward,
    BeforeBackward,
    AfterBackward,
}

/// What a schedule may act on when it is called for one unit.
pub struct ScheduleContext<'a> {
    pub unit: usize,
    pub spec: &'a ModelSpec,
    pub storage: &'a mut [UnitStorage],
    pub ledger: &'a MemoryLedger,
    /// Whether this backward completes the step's gradients (false on the earlier
    /// micro-batches of gradient accumulation, when nothing needs communicating).
    pub sync_grads: bool,
}

/// Per-unit policy run by the engine around every forward and backward of a unit.
pub trait UnitSchedule: Send {
    fn on(&mut self, phase: Phase, ctx: ScheduleContext<'_>) -> Result<()>;

    /// Completes whatever the schedule started on the gradients (communication in flight)
    /// before the optimizer reads them; see [`Engine::finish_grads`].
    fn finish_grads(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Everything stays resident where it was allocated: the single-process default.
pub struct Resident;

impl UnitSchedule for Resident {
    fn on(&mut self, _: Phase, _: ScheduleContext<'_>) -> Result<()> {
        Ok(())
    }
}

/// A contiguous slice of one unit's buffers in which every parameter belongs to the same
/// optimizer group: the optimizer updates it as one tensor.
pub struct Segment {
    pub param: Tensor,
    pub grad: Tensor,
    pub group: usize,
}

struct Boundary {
    /// The leaf that cut the graph at this unit's input (unit-by-unit mode, units after the first).
    input: Option<Tensor>,
    output: Tensor,
}

struct ForwardRecord {
    boundaries: Vec<Boundary>,
    out: Tensor,
    activation_bytes: u64,
}

pub struct Engine {
    spec: ModelSpec,
    config: EngineConfig,
    /// Every unit's gradient buffer, concatenated in unit order.
    grads: Tensor,
    storage: Vec<UnitStorage>,
    /// Leaf views into `storage[unit].flat`, indexed by `ParamId`.
    params: Vec<Tensor>,
    /// Offset of each parameter within its unit's flat buffer.
    offsets: Vec<i64>,
    ledger: Arc<MemoryLedger>,
    schedule: Box<dyn UnitSchedule>,
    record: Option<ForwardRecord>,
    sync_grads: bool,
}

impl Engine {
    /// Allocates and initialises the model described by `spec`.
    pub fn new(spec: ModelSpec, config: EngineConfig) -> Result<Engine> {
        let ledger = Arc::new(MemoryLedger::new());
        if let Some(budget) = config.device_budget {
            ledger.set_budget(Placement::Device, budget);
        }
        if spec.params.iter().any(|p| p.kind.is_some_and(|k| k != config.kind)) {
            return Err(Error::Model("parameters with their own dtype are not supported yet".into()));
        }
        let opts = (config.kind, config.device);
        let mut offsets = vec![0; spec.params.len()];
        let mut params: Vec<Option<Tensor>> = (0..spec.params.len()).map(|_| None).collect();
        let mut storage = Vec::with_capacity(spec.units.len());
        // All gradients live in one buffer, unit after unit, so that a run of adjacent units
        // is one contiguous slice (a data-parallel bucket needs no copy).
        let grad_numel: i64 = spec.params.iter().map(ParamSpec::numel).sum();
        ledger.alloc(
            Placement::Device,
            Category::Grads,
            (grad_numel as usize * config.kind.elt_size_in_bytes()) as u64,
        )?;
        let grads = Tensor::f_zeros([grad_numel], opts)?;
        let mut grad_start = 0;
        tch::manual_seed(config.seed);
        for unit in &spec.units {
            let numel: i64 = unit.params.iter().map(|id| spec.params[id.0].numel()).sum();
            let bytes = (numel as usize * config.kind.elt_size_in_bytes()) as u64;
            ledger.alloc(Placement::Device, Category::Params, bytes)?;
            let flat = Tensor::f_zeros([numel], opts)?;
            let grad = grads.f_narrow(0, grad_start, numel)?;
            grad_start += numel;
            let mut offset = 0;
            for &id in &unit.params {
                let p = &spec.params[id.0];
                let view = flat.f_narrow(0, offset, p.numel())?.f_view(p.shape.as_slice())?;
                tch::no_grad(|| init(&view, p.init))?;
                let leaf = view.f_detach()?.f_set_requires_grad(p.requires_grad)?;
                if p.requires_grad {
                    let g = grad.f_narrow(0, offset, p.numel())?.f_view(p.shape.as_slice())?;
                    strata_ext::set_grad(&leaf, Some(&g))?;
                }
                offsets[id.0] = offset;
                params[id.0] = Some(leaf);
                offset += p.numel();
            }
            storage.push(UnitStorage { flat, grad });
        }
        let params = params.into_iter().map(|p| p.expect("every parameter belongs to a unit")).collect();
        tracing::debug!(units = spec.units.len(), params = spec.num_params(), device = ?config.device, "engine allocated");
        Ok(Engine {
            spec,
            config,
            grads,
            storage,
            params,
            offsets,
            ledger,
            schedule: Box::new(Resident),
            record: None,
            sync_grads: true,
        })
    }

    /// Replaces the per-unit policy (strategies install theirs here).
    pub fn set_schedule(&mut self, schedule: Box<dyn UnitSchedule>) {
        self.schedule = schedule;
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }

    pub fn storage(&self) -> &[UnitStorage] {
        &self.storage
    }

    /// All gradients in one buffer; unit `k`'s `grad` is the slice after units `0..k`'s.
    pub fn grads(&self) -> &Tensor {
        &self.grads
    }

    /// The parameter tensor (a leaf view into its unit's flat buffer).
    pub fn param(&self, id: ParamId) -> &Tensor {
        &self.params[id.0]
    }

    /// The parameter called `name` (aliases included).
    pub fn param_by_name(&self, name: &str) -> Option<&Tensor> {
        self.spec.find(name).map(|id| &self.params[id.0])
    }

    /// Parameters with their canonical names, in declaration order.
    pub fn named_params(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.spec.params.iter().map(|p| p.name.as_str()).zip(self.params.iter())
    }

    fn run_schedule(&mut self, phase: Phase, unit: usize) -> Result<()> {
        let ctx = ScheduleContext {
            unit,
            spec: &self.spec,
            storage: &mut self.storage,
            ledger: &self.ledger,
            sync_grads: self.sync_grads,
        };
        self.schedule.on(phase, ctx)
    }

    /// Says whether the next backward completes the step's gradients (default true); with
    /// gradient accumulation, only the last micro-batch's should.
    pub fn set_grad_sync(&mut self, sync: bool) {
        self.sync_grads = sync;
    }

    /// Waits for the schedule's work on the gradients; call before the optimizer step.
    pub fn finish_grads(&mut self) -> Result<()> {
        self.schedule.finish_grads()
    }

    /// Runs every unit in order and returns the last unit's output. In unit-by-unit mode the
    /// output is a leaf: compute the loss from it, then call [`Engine::backward`].
    pub fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        self.release_record();
        let unit_by_unit = self.config.backward == BackwardMode::UnitByUnit;
        let mut x = input.shallow_clone();
        let mut boundaries = Vec::with_capacity(self.spec.units.len());
        let mut activation_bytes = 0;
        for k in 0..self.spec.units.len() {
            self.run_schedule(Phase::BeforeForward, k)?;
            let cut = (unit_by_unit && k > 0).then(|| x.detach().set_requires_grad(true));
            let y = self.spec.units[k].body.forward(&Params::new(&self.params), cut.as_ref().unwrap_or(&x))?;
            let bytes = memory::tensor_bytes(&y);
            self.ledger.alloc(Placement::Device, Category::Activations, bytes)?;
            activation_bytes += bytes;
            boundaries.push(Boundary { input: cut, output: y.shallow_clone() });
            self.run_schedule(Phase::AfterForward, k)?;
            x = y;
        }
        let out = if unit_by_unit { x.detach().set_requires_grad(true) } else { x };
        self.record = Some(ForwardRecord { boundaries, out: out.shallow_clone(), activation_bytes });
        Ok(out)
    }

    /// Forward without recording anything for backward (evaluation).
    pub fn evaluate(&mut self, input: &Tensor) -> Result<Tensor> {
        self.release_record();
        let mut x = input.shallow_clone();
        for k in 0..self.spec.units.len() {
            self.run_schedule(Phase::BeforeForward, k)?;
            x = tch::no_grad(|| self.spec.units[k].body.forward(&Params::new(&self.params), &x))?;
            self.run_schedule(Phase::AfterForward, k)?;
        }
        Ok(x)
    }

    /// Backward from `loss`, a scalar computed from the last [`Engine::forward`]'s output.
    /// Parameter gradients accumulate into the flat gradient buffers.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let record = self.record.take().ok_or_else(|| Error::Engine("backward called without a forward".into()))?;
        let result = self.backward_from(loss, &record);
        self.ledger.free(Placement::Device, Category::Activations, record.activation_bytes);
        result
    }

    fn backward_from(&mut self, loss: &Tensor, record: &ForwardRecord) -> Result<()> {
        if loss.numel() != 1 {
            return Err(Error::Engine(format!("backward needs a scalar loss, got shape {:?}", loss.size())));
        }
        let seed = loss.f_ones_like()?;
        strata_ext::backward(&[loss], &[&seed], false)?;
        if self.config.backward == BackwardMode::WholeGraph {
            return Ok(());
        }
        let mut upstream = record.out.grad();
        if !upstream.defined() {
            return Err(Error::Engine("the loss does not depend on the model's output".into()));
        }
        for k in (0..self.spec.units.len()).rev() {
            self.run_schedule(Phase::BeforeBackward, k)?;
            let b = &record.boundaries[k];
            if b.output.requires_grad() {
                strata_ext::backward(&[&b.output], &[&upstream], false)?;
            }
            self.run_schedule(Phase::AfterBackward, k)?;
            match &b.input {
                Some(input) if input.grad().defined() => upstream = input.grad(),
                _ => break,
            }
        }
        Ok(())
    }

    fn release_record(&mut self) {
        if let Some(r) = self.record.take() {
            self.ledger.free(Placement::Device, Category::Activations, r.activation_bytes);
        }
    }

    /// Sets every gradient to zero (the buffers stay allocated).
    pub fn zero_grad(&mut self) -> Result<()> {
        let _ = self.grads.f_zero_()?;
        Ok(())
    }

    /// Splits every unit's buffers into contiguous runs of parameters of the same optimizer
    /// group, as chosen by `group_of`. Parameters that take no gradient are left out.
    pub fn segments(&self, group_of: impl Fn(&ParamSpec) -> usize) -> Result<Vec<Segment>> {
        let mut out = Vec::new();
        for (unit, s) in self.spec.units.iter().zip(&self.storage) {
            let mut run: Option<(usize, i64, i64)> = None; // (group, start, end)
            for &id in &unit.params {
                let p = &self.spec.params[id.0];
                let (start, end) = (self.offsets[id.0], self.offsets[id.0] + p.numel());
                let group = p.requires_grad.then(|| group_of(p));
                match (&mut run, group) {
                    (Some((g, _, e)), Some(gr)) if *g == gr && *e == start => *e = end,
                    _ => {
                        if let Some(r) = run.take() {
                            out.push(segment(s, r)?);
                        }
                        run = group.map(|g| (g, start, end));
                    }
                }
            }
            if let Some(r) = run {
                out.push(segment(s, r)?);
            }
        }
        Ok(out)
    }

    /// Copies `value` into the parameter `id`, converting dtype and device.
    pub fn set_param(&mut self, id: ParamId, value: &Tensor) -> Result<()> {
        let p = &self.params[id.0];
        if value.size() != p.size() {
            return Err(Error::Model(format!(
                "{}: shape {:?} does not match the model's {:?}",
                self.spec.params[id.0].name,
                value.size(),
                p.size()
            )));
        }
        let mut target = p.shallow_clone();
        tch::no_grad(|| target.f_copy_(value))?;
        Ok(())
    }
}

fn segment(s: &UnitStorage, (group, start, end): (usize, i64, i64)) -> Result<Segment> {
    Ok(Segment { param: s.flat.f_narrow(0, start, end - start)?, grad: s.grad.f_narrow(0, start, end - start)?, group })
}

fn init(t: &Tensor, how: Init) -> Result<()> {
    let mut t = t.shallow_clone();
    let _ = match how {
        Init::Normal { std } => t.f_normal_(0.0, std)?,
        Init::Zeros => t.f_zero_()?,
        Init::Ones => t.f_fill_(1.0)?,
    };
    Ok(())
}
