//! Collectives, their backends and the memory groups hand out, across processes.

mod comm;
#[path = "../common/mod.rs"]
mod common;
mod shared_memory;
