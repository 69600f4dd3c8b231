//! What one process measures of itself: the compute methods, the optimizers', offload's
//! and decoding's allocations, and the CUDA paths. The allocator's counts are per process,
//! so every test of this binary holds [`serial`] and runs alone.

#[path = "../common/mod.rs"]
mod common;
mod compute;
mod cuda;
mod generation;
mod offload_room;
mod optim;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The lock every test of this binary holds while it runs.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
