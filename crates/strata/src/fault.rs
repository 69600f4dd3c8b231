//! Failure injection for tests, driven by the environment, compiled only with the
//! `fault-injection` feature (which the test suites turn on): other builds ignore the
//! variables and [`point`] does nothing. `STRATA_FAULT=PLACE@STEP` kills
//! this process with SIGKILL — as the OOM killer or a lost node would, with no chance to
//! clean up — when it reaches `PLACE` during step `STEP`; `STRATA_FAULT_RANK=R` limits that
//! to the process whose `RANK` is `R`, and `STRATA_FAULT_ONCE=PATH` to the first time (see
//! [`first_time`]). With `STRATA_FAULT_ERROR=1` the place returns an error instead, as a
//! step that failed on this rank alone would (out of memory on one pipeline stage), and the
//! process lives on. Places: `backward` (mid-step, between a
//! micro-batch's forward and its backward), and the stages of a checkpoint save:
//! `save-written`, `save-described`, `save-published`, `save-pointed`; and of an
//! asynchronous save: `snapshot-taken` (in host memory, before the writer starts), then in
//! the writer thread `persist-begun` (the values on the host copied into the snapshot) and
//! `persist-written` (this rank's file on disk, before rank 0 publishes).
//!
//! Reading two variables at a handful of points costs nothing measurable; without them set
//! nothing happens.
//!
//! Owns reading the variables and the kill. Must not choose the places: `train` and
//! `checkpoint` call [`point`] at theirs.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn point(_place: &str, _step: u64) -> crate::Result<()> {
    Ok(())
}

#[cfg(feature = "fault-injection")]
pub(crate) fn point(place: &str, step: u64) -> crate::Result<()> {
    let Ok(spec) = std::env::var("STRATA_FAULT") else { return Ok(()) };
    let wanted = spec.split_once('@').is_some_and(|(p, s)| p == place && s.parse::<u64>().ok() == Some(step));
    let rank_matches = std::env::var("STRATA_FAULT_RANK").ok().is_none_or(|r| std::env::var("RANK").ok() == Some(r));
    if wanted && rank_matches && first_time() {
        if std::env::var("STRATA_FAULT_ERROR").is_ok_and(|v| v == "1") {
            return Err(crate::Error::Engine(format!("injected failure at {place} of step {step}")));
        }
        // SAFETY: signalling this very process.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    Ok(())
}

#[cfg(feature = "fault-injection")]
/// With `STRATA_FAULT_ONCE=PATH` a fault fires only while PATH does not exist, and creates it
/// (so a restarted job runs through).
fn first_time() -> bool {
    match std::env::var_os("STRATA_FAULT_ONCE") {
        Some(path) => std::fs::OpenOptions::new().write(true).create_new(true).open(path).is_ok(),
        None => true,
    }
}
