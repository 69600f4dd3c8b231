//! Jobs started by `strata launch`, other launchers and the library, and on a GPU.

#[path = "../common/mod.rs"]
mod common;
mod gpu;
mod launch;
mod launchers;
mod library;
mod snapshots;
