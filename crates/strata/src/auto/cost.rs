//! The memory model: what the profiling pass learnt about a model, and the peak bytes per
//! rank it predicts for a candidate (ZeRO's model-state formula plus the activations kept).
//!
//! Owns the formula. Must not run or measure anything: the [`Analysis`] comes from the
//! profiling pass of [`super::bench`], and [`super::search`] decides what a prediction rules
//! out.
use super::candidate::{Candidate, Precision, Sharding};
use serde::Serialize;

/// What the profiling pass learnt about the model.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    pub params: i64,
    /// Parameters that train (the rest are frozen: LoRA's base, `freeze`): only they have
    /// gradients and optimizer states.
    pub trainable_params: i64,
    pub unit_params: Vec<i64>,
    /// Bytes each unit's forward keeps for backward (fp32, one micro-batch of this rank).
    pub unit_activation_bytes: Vec<u64>,
    /// Bytes of each unit's output.
    pub unit_output_bytes: Vec<u64>,
    /// Seconds of one fp32 forward and backward of one micro-batch.
    pub step_seconds: f64,
    /// The most the profiling held at once on the device, as the ledger counts it: one unit's
    /// parameters and gradients at a time, and the activations (within the device budget).
    pub ledger_peak_bytes: u64,
    /// The allocator's peak during the profiling (on the CPU: every tensor of the process).
    pub allocator_peak_bytes: u64,
    /// Unit kinds that repeat (the blocks): what `checkpoint` recomputes.
    pub blocks: Vec<String>,
    /// Parameters tensor parallelism splits (the rest every tensor rank holds whole).
    pub split_params: i64,
    /// Tensor sizes above 1 the model splits over at this world size.
    pub tensor_sizes: Vec<usize>,
}

/// The peak bytes per rank the memory model predicts for `c` (AdamW's two fp32 moments).
pub fn predicted_peak(a: &Analysis, c: &Candidate, world: usize) -> u64 {
    let t = c.tensor.max(1) as f64;
    // Each tensor rank holds the whole parameters and its piece of the split ones; sharding
    // spans the ranks that hold the same pieces.
    let psi = (a.params - a.split_params) as f64 + a.split_params as f64 / t;
    // What of it trains, in the same proportion: gradients, masters and optimizer state
    // exist for that alone, sharded or not.
    let share = a.trainable_params as f64 / a.params.max(1) as f64;
    let trained = psi * share;
    let n = if c.sharding == Sharding::None { 1.0 } else { world as f64 / t };
    let (p, g, k) = match c.precision {
        Precision::HalfBf16 | Precision::HalfFp16 => (2.0, 2.0, 8.0),
        _ => (4.0, 4.0, 8.0),
    };
    let largest = a.unit_params.iter().copied().max().unwrap_or(0) as f64 / t;
    // The whole gradients alive at once: two units' trained parts.
    let whole_grads = 2.0 * largest * share * g;
    let states = match (c.sharding, c.offload) {
        (Sharding::None, false) => psi * p + trained * (g + k),
        (Sharding::Zero1, false) => psi * p + trained * g + trained * k / n,
        (Sharding::Zero2, false) => psi * p + trained * (g + k) / n + whole_grads,
        (Sharding::Fsdp, false) => psi * p / n + trained * (g + k) / n + 2.0 * largest * p + whole_grads,
        // Offloaded, the device needs at least the unit computing: its parameters and
        // gradient (and, beside zero1/zero2, the whole parameters they keep there); the
        // plan fills the rest of the budget with whatever fits.
        (Sharding::None | Sharding::Fsdp, true) => 2.0 * largest * p + whole_grads,
        (Sharding::Zero1 | Sharding::Zero2, true) => psi * p + whole_grads,
    };
    // Lower precision keeps lower-precision copies of most saved tensors; fused attention
    // keeps no score matrices.
    let scale = match c.precision {
        Precision::Fp32 => 1.0,
        Precision::HalfBf16 | Precision::HalfFp16 => 0.55,
        _ => 0.8,
    } * if c.module_replace { 0.85 } else { 1.0 };
    // A tensor rank's micro-batch is `t` times a data rank's, and sequence parallel splits
    // what it keeps `t` ways: about the same bytes (`strata bench parallel` measures it).
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
