//! Parallel execution across ranks, as engine schedules.
//!
//! Owns: data parallelism (`DataParallel`): every rank holds the whole model, trains on its
//! share of the global batch, and the gradients of each unit are averaged across ranks by
//! an asynchronous all-reduce started as soon as that unit's backward is done, so the
//! communication of later units overlaps the backward of earlier ones. Must not touch model
//! definitions or the optimizer: it acts on the engine's flat buffers only.
use crate::comm::{ProcessGroup, ReduceOp, Work};
use crate::engine::{Engine, Phase, ScheduleContext, UnitSchedule};
use crate::{Error, Result};
use std::sync::Arc;

pub struct DataParallel {
    group: Arc<dyn ProcessGroup>,
    in_flight: Vec<Work>,
}

impl DataParallel {
    /// Installs data parallelism over `group` on `engine`, after making every rank start
    /// from rank 0's parameters (`sync_module_states`).
    pub fn install(engine: &mut Engine, group: Arc<dyn ProcessGroup>) -> Result<()> {
        for s in engine.storage() {
            group.broadcast(&s.flat, 0)?.wait()?;
        }
        engine.set_schedule(Box::new(DataParallel { group, in_flight: Vec::new() }));
        Ok(())
    }
}

impl UnitSchedule for DataParallel {
    fn on(&mut self, phase: Phase, ctx: ScheduleContext<'_>) -> Result<()> {
        if phase == Phase::AfterBackward && ctx.sync_grads {
            let grad = &ctx.storage[ctx.unit].grad;
            self.in_flight.push(self.group.all_reduce(grad, ReduceOp::Avg)?);
        }
        Ok(())
    }

    fn finish_grads(&mut self) -> Result<()> {
        for work in self.in_flight.drain(..) {
            work.wait().map_err(|e| Error::Comm(format!("gradient all-reduce failed: {e}")))?;
        }
        Ok(())
    }
}
