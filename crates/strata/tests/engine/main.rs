//! The engine, its memory ledger against its storages, the planner's time model, and the
//! library's modules standing on floors.

mod activations;
mod architecture;
mod engine;
mod memory;
mod plan;
mod reference_docs;
