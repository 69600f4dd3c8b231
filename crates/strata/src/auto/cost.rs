//! Predictions for the search: what the profiling pass learnt about a model, turned into
//! the inputs of the analytic models ([`super::estimate`] for bytes, [`super::step_time`]
//! for seconds), and each layout's predicted peak and speed from them. The same models
//! serve `strata estimate` and `strata plan`; here each unit's activations are the ones the
//! profile measured instead of counted from a family's configuration, so that any model a
//! builder makes can be predicted.
//!
//! Owns the translation of a profile into predictions. Must not run or measure anything:
//! the [`Analysis`] comes from the profiling pass of [`super::bench`], the machine from
//! [`super::calibrate`], and [`super::search`] decides what a prediction rules out.
use super::candidate::Layout;
use super::estimate::{self, Kept, Machine, PipelineShapes, Workload};
use super::step_time::{self, Cluster, Memo, UnitWork};
use crate::model::ModelSpec;
use crate::{Error, Result};
use serde::Serialize;

/// What the profiling pass learnt about the model.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    /// Parameter elements of the whole model, frozen ones included.
    pub params: i64,
    /// Parameters that train (the rest are frozen: LoRA's base, `freeze`): only they have
    /// gradients and optimizer states.
    pub trainable_params: i64,
    /// Parameter elements each unit owns, in unit order.
    pub unit_params: Vec<i64>,
    /// Bytes each unit's forward keeps for backward (fp32, one micro-batch of this rank).
    pub unit_activation_bytes: Vec<u64>,
    /// Bytes of each unit's output.
    pub unit_output_bytes: Vec<u64>,
    /// Rows of the micro-batch profiled, and its tokens (its input's positions: rows ×
    /// their padded length, which may be shorter than the run's context).
    pub profiled_rows: u64,
    /// Tokens of the micro-batch profiled (its input's elements).
    pub profiled_tokens: u64,
    /// Seconds of one fp32 forward and backward of one micro-batch.
    pub step_seconds: f64,
    /// The most the profiling held at once on the device, as the ledger counts it: one unit's
    /// parameters and gradients at a time, and the activations (within the device budget).
    pub ledger_peak_bytes: u64,
    /// The allocator's peak during the profiling (on the CPU: every tensor of the process).
    pub allocator_peak_bytes: u64,
    /// Unit kinds that repeat (the blocks): what `checkpoint` recomputes.
    pub blocks: Vec<String>,
    /// Tensor sizes above 1 the model splits over at this world size.
    pub tensor_sizes: Vec<usize>,
    /// Pipeline sizes above 1 that divide the world and leave every stage a unit.
    pub pipeline_sizes: Vec<usize>,
    /// Expert group sizes above 1 that divide the world and every sparse layer's experts
    /// (none for a dense model).
    pub expert_sizes: Vec<usize>,
}

/// What each unit keeps per token, from the profile: its measured fp32 bytes over the
/// profiled tokens. A repeated unit is a block (what recomputation drops); what any other
/// unit keeps is counted as over the vocabulary (a head's logits and their gradients, which
/// the loss's graph holds while the last block is recomputed). Attention probabilities are
/// inside the measured values, at the profiled length.
pub fn measured_kept(spec: &ModelSpec, a: &Analysis) -> Result<Vec<Kept>> {
    if a.unit_activation_bytes.len() != spec.units.len() || a.unit_output_bytes.len() != spec.units.len() {
        return Err(Error::Config(format!(
            "the profile measured {} units, the model has {}",
            a.unit_activation_bytes.len(),
            spec.units.len()
        )));
    }
    let per_token = 4.0 * a.profiled_tokens.max(1) as f64;
    Ok(spec
        .units
        .iter()
        .enumerate()
        .map(|(u, unit)| {
            let block = a.blocks.iter().any(|b| b == unit.kind());
            let values = a.unit_activation_bytes[u] as f64 / per_token;
            Kept {
                values,
                vocab_values: if block { 0.0 } else { values },
                scores: 0.0,
                output: a.unit_output_bytes[u] as f64 / per_token,
                block,
            }
        })
        .collect())
}

/// The job as the predictions see it: ranks, the rows of a step over all of them, the
/// micro-batches each step is split into, the positions of a row, and the optimizer's state
/// bytes per trained element.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct JobShape {
    /// Ranks the job runs on.
    pub world: usize,
    /// Rows of one step over all ranks.
    pub batch_size: usize,
    /// Micro-batches each replica's share of a step is split into.
    pub accumulation: usize,
    /// Positions of a row (the profiled rows' length).
    pub ctx: i64,
    /// Optimizer state bytes per trained parameter element.
    pub optimizer_state_bytes: u64,
}

/// A layout's predicted busiest-rank device peak and the job's tokens per second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Prediction {
    /// Predicted device bytes at the busiest rank's peak.
    pub peak_bytes: u64,
    /// Predicted tokens per second of the whole job.
    pub tokens_per_s: f64,
}

/// Predicts layouts of one model and job on one machine.
pub struct Predictor {
    spec: ModelSpec,
    units: UnitWork,
    job: JobShape,
    cluster: Cluster,
    memo: Memo,
}

impl Predictor {
    /// From `spec`, its profile `analysis`, the job and the machine (`cluster`, one node of
    /// `job.world` devices).
    pub fn new(spec: ModelSpec, analysis: &Analysis, job: JobShape, cluster: Cluster) -> Result<Predictor> {
        let units = UnitWork::measured(&spec, measured_kept(&spec, analysis)?);
        Ok(Predictor { spec, units, job, cluster, memo: Memo::default() })
    }

    /// The prediction for `layout`; an error where the job cannot take its shape (the
    /// batch does not split into its replicas' micro-batches).
    pub fn predict(&mut self, layout: &Layout) -> Result<Prediction> {
        let j = self.job;
        let groups = layout.data_ranks(j.world).max(1) * j.accumulation.max(1);
        if j.batch_size == 0 || !j.batch_size.is_multiple_of(groups) {
            return Err(Error::Config(format!(
                "a batch of {} rows does not split into {} replicas × {} micro-batches",
                j.batch_size,
                layout.data_ranks(j.world),
                j.accumulation
            )));
        }
        let work = Workload {
            ranks: j.world,
            micro_batch: j.batch_size / groups,
            ctx: j.ctx,
            micro_batches: j.accumulation.max(1),
            optimizer_state_bytes: j.optimizer_state_bytes,
        };
        let machine = Machine { device: self.cluster.device.clone(), device_bytes: u64::MAX, host_bytes: u64::MAX };
        let shapes: &mut PipelineShapes = &mut self.memo.shapes;
        let memory = estimate::estimate_with(&self.units.kept, &self.spec, layout, &work, &machine, shapes)?;
        let time = step_time::step_time(&self.units, &self.spec, layout, &work, &self.cluster, &mut self.memo)?;
        Ok(Prediction { peak_bytes: memory.device.total(), tokens_per_s: time.tokens_per_s })
    }
}
