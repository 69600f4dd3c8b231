//! The engine, its memory ledger against the allocator, the optimizers and the planner's time
//! model.

mod engine;
mod memory;
mod optim;
mod plan;
