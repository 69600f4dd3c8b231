//! Pipeline parallelism: contiguous unit ranges (stages) on different ranks, run by a
//! schedule of micro-batches.
//!
//! Owns: the schedules (`schedule`: pure functions from the pipeline's shape and a rank to
//! its operations, and a simulator that runs them against each other) and the stage split
//! (`partition`), and the executor that runs a rank's operations on one engine per chunk
//! (`executor`). Must not own the engine's per-micro-batch forward and backward.
pub mod executor;
pub mod partition;
pub mod schedule;

pub use executor::{stage_ranges, trainer, PipelineExecutor};
