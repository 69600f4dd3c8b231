//! Datasets, loaders and every parser of outside input, with property tests.

mod data;
mod fuzz;
#[path = "../common/hf_reference.rs"]
mod hf_reference;
