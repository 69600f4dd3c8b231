//! Datasets, loaders and every parser of outside input, with property tests.

mod data;
mod fuzz;
