//! The engine, its memory ledger against its storages, and the planner's time model.

mod engine;
mod memory;
mod plan;
