//! The seam between the engine and a strategy: the phases of a unit's execution, what a
//! schedule may act on at each, and the [`UnitSchedule`] trait strategies implement
//! (gather before, free after, reduce gradients, publish updates). The engine calls it; a
//! schedule never runs units itself.
use super::{EventSink, MemoryLedger, Placement, UnitStorage};
use crate::model::ModelSpec;
use crate::Result;
use std::sync::Arc;
use tch::{Kind, Tensor};

/// The buffers the optimizer updates for one unit: `param` and `grad` cover elements
/// `offset..offset + len` of the unit's flat layout (its whole gradient span unless a
/// strategy shards it; the frozen head before it is never updated).
pub struct OptimizerView {
    /// The parameters the optimizer updates.
    pub param: Tensor,
    /// Their gradients, element for element.
    pub grad: Tensor,
    /// Where `param` begins in the unit's flat layout.
    pub offset: i64,
    /// Where `param` and `grad` live, and so where the optimizer keeps its state for them.
    pub placement: Placement,
}

/// The moment of a unit's execution at which a [`UnitSchedule`] is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Before the unit's forward.
    BeforeForward,
    /// After the unit's forward.
    AfterForward,
    /// Before the unit's backward.
    BeforeBackward,
    /// After the unit's backward.
    AfterBackward,
}

/// What a schedule may act on when it is called for one unit.
pub struct ScheduleContext<'a> {
    /// The unit being run.
    pub unit: usize,
    /// The model being run.
    pub spec: &'a ModelSpec,
    /// Every unit's storage, the engine's buffers.
    pub storage: &'a mut [UnitStorage],
    /// The ledger the schedule records what it holds and frees in.
    pub ledger: &'a MemoryLedger,
    /// Whether this backward completes the step's gradients (false on the earlier
    /// micro-batches of gradient accumulation, when nothing needs communicating).
    pub sync_grads: bool,
    /// Called with a unit once its gradient of the step is complete where the optimizer
    /// updates it (the host), so its update can start while backward goes on.
    pub grad_ready: Option<&'a GradReady>,
}

/// What [`ScheduleContext::grad_ready`] calls.
pub type GradReady = dyn Fn(usize) + Send + Sync;

/// The phase protocol a strategy runs around every unit: before and after each forward
/// and backward ([`UnitSchedule::on`]), when a step's gradients are complete, after the
/// update and when gradients are cleared. What it keeps of the model states, and what can
/// be asked of them, is its [`HeldStates`].
pub trait UnitSchedule: HeldStates + Send {
    /// Acts on `ctx.unit` at `phase` of its execution.
    fn on(&mut self, phase: Phase, ctx: ScheduleContext<'_>) -> Result<()>;

    /// Completes whatever the schedule started on the gradients (communication in flight)
    /// before the optimizer reads them; see `Engine::finish_grads`.
    fn finish_grads(&mut self, _ctx: ScheduleContext<'_>) -> Result<()> {
        Ok(())
    }

    /// Runs after the optimizer updated what [`HeldStates::optimizer_view`] handed it.
    fn after_update(&mut self, _ctx: ScheduleContext<'_>) -> Result<()> {
        Ok(())
    }

    /// Where the schedule reports its gathers and frees.
    fn attach_events(&mut self, _sink: Arc<dyn EventSink>) {}

    /// Sets every gradient the schedule or engine holds to zero.
    fn zero_grads(&mut self, ctx: ScheduleContext<'_>) -> Result<()> {
        for s in ctx.storage.iter() {
            let _ = s.grad.shallow_clone().f_zero_()?;
        }
        Ok(())
    }
}

/// What a strategy keeps instead of (or beside) the engine's buffers — shards, fp32 masters,
/// copies on the host — and what the engine, the optimizer and checkpoints ask of it.
/// Every answer has a default for a strategy that keeps nothing of its own.
pub trait HeldStates {
    /// What the optimizer updates for `ctx.unit`.
    fn optimizer_view(&self, ctx: ScheduleContext<'_>) -> Result<OptimizerView> {
        let s = &ctx.storage[ctx.unit];
        Ok(OptimizerView {
            param: s.flat.f_narrow(0, s.grad_start, s.grad.numel() as i64)?,
            grad: s.grad.shallow_clone(),
            offset: s.grad_start,
            placement: Placement::Device,
        })
    }

    /// Whether the host's updates of a step run during the next step (ZeRO-Offload's
    /// delayed parameter update): the device computes that step with the parameters before
    /// them, and [`UnitSchedule::after_update`] runs once they are over.
    fn delays_host_updates(&self) -> bool {
        false
    }

    /// The tensors the schedule holds besides the engine's buffers (shards, masters, copies
    /// in flight), for counting what model states occupy.
    fn held_tensors(&self) -> Vec<Tensor> {
        Vec::new()
    }

    /// Why a step under this schedule cannot be captured as a CUDA graph, if it cannot:
    /// something in it makes the host wait for the device or act between kernels.
    fn capture_obstacle(&self) -> Option<String> {
        None
    }

    /// Whether this schedule reads each unit's gradients only from the engine's contiguous
    /// buffer, once that unit's backward is over: the engine may then let a step's first
    /// backward produce them freely and copy them in, rather than add them to zeros.
    fn accepts_copied_grads(&self) -> bool {
        false
    }

    /// Whether [`HeldStates::grad_sq_sum`] is this rank's own sum (no shards elsewhere),
    /// so the norm can be computed where the gradients are, without reading it back.
    fn grad_norm_is_local(&self) -> bool {
        true
    }

    /// The global sum of squared gradients from this rank's per-unit sums (unit, sum):
    /// adds the shards other ranks hold.
    fn grad_sq_sum(&self, per_unit: &[(usize, f64)]) -> Result<f64> {
        Ok(per_unit.iter().map(|(_, x)| x).sum())
    }

    /// Whether this rank holds a part of the model states no other rank holds, and so
    /// writes it into checkpoints (replicas leave it to one of them).
    fn checkpoint_writer(&self) -> bool {
        true
    }

    /// Whether this rank writes the units' frozen heads (which every rank holding a unit
    /// can gather) into checkpoints: one writer of each unit's.
    fn writes_frozen_heads(&self) -> bool {
        self.checkpoint_writer()
    }

    /// dtype of the values the optimizer updates (the fp32 master of a mixed-precision run).
    fn master_kind(&self) -> Option<Kind> {
        None
    }

    /// `ctx.unit`'s parameters, all of them and unpadded, in the master dtype.
    fn full_unit(&mut self, ctx: ScheduleContext<'_>) -> Result<Tensor> {
        let s = &ctx.storage[ctx.unit];
        Ok(s.flat.f_narrow(0, 0, s.numel)?)
    }

    /// Replaces `ctx.unit`'s parameters with `values` (unpadded, any dtype).
    fn set_full_unit(&mut self, ctx: ScheduleContext<'_>, values: &Tensor) -> Result<()> {
        let s = &ctx.storage[ctx.unit];
        tch::no_grad(|| s.flat.f_narrow(0, 0, s.numel)?.f_copy_(values))?;
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

impl HeldStates for Resident {
    fn accepts_copied_grads(&self) -> bool {
        true
    }
}
