//! Data, tensor and pipeline parallelism in the library, and the strategy search against cost
//! tables.

#[path = "../common/mod.rs"]
mod common;
mod parallel;
mod tensor;
mod pipeline;
mod search;
