//! Collectives, their backends and the memory groups hand out, across processes.

#[path = "../common/mod.rs"]
mod common;
mod comm;
mod shared_memory;
