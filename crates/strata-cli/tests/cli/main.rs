//! The `strata` binary's front door: training against PyTorch, options, documents, tokens,
//! profiles and the estimate.

mod cli;
#[path = "../common/mod.rs"]
mod common;
mod docs;
mod estimate;
mod fuzz;
mod profile;
mod tokens;
