//! One optimizer step over a step's micro-batches: the loop body shared by `strata train`,
//! the benchmark and library users who do not want to write it themselves.
//!
//! Owns: the order forward → loss → backward per micro-batch, gradient clipping, the
//! schedule, the update and the per-step report. Must not own data loading or output.
use crate::data::Step;
use crate::engine::memory::PlacementReport;
use crate::engine::{memory, Engine, Placement};
use crate::model::layers::cross_entropy;
use crate::optim::{Optimizer, Schedule};
use crate::Result;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Instant;

/// What one step did, as written to `--metrics`.
#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub step: u64,
    /// Mean loss over the step's micro-batches.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping (when clipping is on).
    pub grad_norm: Option<f64>,
    pub tokens: u64,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// Peak bytes held by the engine and optimizer (all placements).
    pub peak_bytes: u64,
    /// Peak bytes of parameters, gradients and optimizer state (model states), this rank.
    pub model_state_peak_bytes: u64,
    /// What the engine and optimizer hold now and at their peak, per placement and category.
    pub memory: BTreeMap<Placement, PlacementReport>,
    /// Peak resident memory of the whole process.
    pub rss_peak_bytes: Option<u64>,
}

pub struct Trainer {
    pub engine: Engine,
    pub optimizer: Optimizer,
    pub schedule: Schedule,
    /// Clip the global gradient norm to this value.
    pub grad_clip: Option<f64>,
    step: u64,
}

impl Trainer {
    pub fn new(engine: Engine, optimizer: Optimizer, schedule: Schedule, grad_clip: Option<f64>) -> Trainer {
        Trainer { engine, optimizer, schedule, grad_clip, step: 0 }
    }

    /// Steps completed so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Continues the step count (and the schedule) from a checkpoint's.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Runs forward and backward on every micro-batch (gradients accumulate, each loss
    /// scaled by 1/micro-batches so the step sees the mean), then clips and updates.
    pub fn train_step(&mut self, step: &Step) -> Result<StepReport> {
        let start = Instant::now();
        let factor = self.schedule.factor(self.step);
        self.optimizer.set_lr_factor(factor);
        let n = step.micro_batches.len() as f64;
        let mut loss_sum = 0.0;
        let mut tokens = 0;
        let last = step.micro_batches.len().saturating_sub(1);
        for (i, batch) in step.micro_batches.iter().enumerate() {
            // Only the last micro-batch's backward completes the step's gradients.
            self.engine.set_grad_sync(i == last);
            let logits = self.engine.forward(&batch.inputs)?;
            let loss = cross_entropy(&logits, &batch.targets)?;
            self.engine.backward(&loss.f_div_scalar(n)?)?;
            loss_sum += loss.f_double_value(&[])?;
            tokens += batch.inputs.numel() as u64;
        }
        self.engine.finish_grads()?;
        let grad_norm = match self.grad_clip {
            Some(max) => Some(self.optimizer.clip_grad_norm_with(max, |per_unit| self.engine.grad_sq_sum(per_unit))?),
            None => None,
        };
        self.optimizer.step()?;
        self.engine.after_step()?;
        self.engine.zero_grad()?;
        let seconds = start.elapsed().as_secs_f64();
        self.step += 1;
        Ok(StepReport {
            step: self.step,
            loss: loss_sum / n,
            lr: self.optimizer.lr(),
            grad_norm,
            tokens,
            seconds,
            tokens_per_s: tokens as f64 / seconds.max(1e-12),
            peak_bytes: self.engine.ledger().peak_total(),
            model_state_peak_bytes: self.engine.ledger().model_state_peak(),
            memory: self.engine.ledger().report(),
            rss_peak_bytes: memory::process_peak_rss(),
        })
    }
}
