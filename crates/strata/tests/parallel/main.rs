//! Data, tensor, context and pipeline parallelism in the library, and the strategy search against cost
//! tables.

#[path = "../common/mod.rs"]
mod common;
mod context;
mod parallel;
mod pipeline;
mod search;
mod tensor;
