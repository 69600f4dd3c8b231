//! The `strata` binary's front door: training against PyTorch, options, documents, tokens,
//! profiles and the estimate.

#[path = "../common/mod.rs"]
mod common;
mod cli;
mod docs;
mod fuzz;
mod tokens;
mod profile;
mod estimate;
