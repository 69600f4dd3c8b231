//! The compute methods in one process and the CUDA paths; the allocator's counts are per
//! process, so each module runs its tests one at a time.

#[path = "../common/mod.rs"]
mod common;
mod compute;
mod cuda;
