//! Checkpoints that do not stop training: each save is first a snapshot in host memory (a
//! checkpoint folder of the usual format in shared memory, `/dev/shm`), into which every
//! rank copies its values on a GPU while training waits; a writer thread then copies in the
//! values already on the host, from where they lie, while the next step computes (its
//! updates wait for that copy: [`crate::optim::Fence`]), and persists the snapshot to the
//! checkpoint folder on disk while training goes on, with the same staging, atomic renames
//! and `latest` as a synchronous save.
//!
//! At most one save is in flight: the next waits for the writer (and says how long). The
//! snapshot outlives the process that wrote it, so a job restarted after a crash resumes
//! from memory ([`newest_in_memory`]) where every node holds its ranks' part of one step,
//! no older than the disk's newest checkpoint; a job of several nodes first sends each
//! node the other nodes' files. The memory folder is private to the user (a
//! 0700 folder of 0600 files) and removed when the run ends cleanly ([`AsyncSaver::close`]).
//!
//! The disk copy is published by rank 0's writer once every rank's file is in the staging
//! folder (the checkpoint folder is one file system all ranks see, as for synchronous
//! saves); a writer that fails leaves a marker there, so rank 0's stops waiting. A crash at
//! any point leaves `latest` naming the previous complete checkpoint.
//!
//! Owns the memory folder's place and lifetime, the writer thread and the choice between
//! memory and disk at a resume. Must not change the checkpoint format (the parent module
//! writes and reads it) or decide when to save (the training loop does).
use super::{
    latest, prepare_staging, publish, rank_file, read_meta, save_into, Checkpoint, Layout, Meta, Part, RankWrite,
    RunInfo,
};
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::io::{Deferred, MappedFile};
use crate::optim::{Fence, FenceOpener};
use crate::{fault, io, Error, Result};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tch::Tensor;

/// How long rank 0's writer waits for the other ranks' files before it gives up (a rank
/// that died stops the whole job long before).
const OTHERS_DEADLINE: Duration = Duration::from_secs(30 * 60);

/// What one save cost (a synchronous save's is all blocking).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SaveTimes {
    /// Seconds training stood still for the save: waiting for the previous save's writer,
    /// the snapshot into host memory and the ranks' agreements.
    pub blocked_s: f64,
    /// Of `blocked_s`, seconds spent waiting for the previous save's writer.
    pub waited_s: f64,
    /// Seconds the previous save's writer took to persist it, where one ran.
    pub persisted_s: Option<f64>,
    /// Of those, the seconds the writer's thread ran on a CPU: what it took from training
    /// where the ranks use every core.
    pub persisted_cpu_s: Option<f64>,
    /// Seconds the step after the save waited, before updating, for the writer to copy the
    /// values already on the host into the snapshot (asynchronous saves; 0 otherwise).
    pub updates_waited_s: f64,
    /// Bytes of this rank's snapshot page-locked for the GPU's copies into it (0 on the
    /// CPU, and where the driver refused): kept locked from one save to the next.
    pub locked_bytes: u64,
    /// Of `blocked_s`, seconds spent locking the snapshot's pages (the first save on a GPU,
    /// and any save whose snapshot changed size).
    pub locking_s: f64,
}

/// The folder snapshots in host memory are taken in: `STRATA_SNAPSHOT_DIR` (set by `strata
/// launch` to a folder it removes when it ends), else `/dev/shm`, else the temporary folder.
pub fn snapshot_base() -> PathBuf {
    match std::env::var_os("STRATA_SNAPSHOT_DIR") {
        Some(dir) => PathBuf::from(dir),
        None if Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
        None => std::env::temp_dir(),
    }
}

/// Where the host-memory snapshots of the run checkpointing to `disk` live: a folder in
/// [`snapshot_base`] named by the user and the checkpoint folder's path.
pub fn memory_root(disk: &Path) -> Result<PathBuf> {
    let base = snapshot_base();
    std::fs::create_dir_all(disk).map_err(|e| Error::io(disk, e))?;
    let canonical = std::fs::canonicalize(disk).map_err(|e| Error::io(disk, e))?;
    let digest = Sha256::digest(canonical.as_os_str().as_encoded_bytes());
    let key: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    Ok(base.join(format!("strata-{uid}-{key}")))
}

/// The newest snapshot in host memory of the run checkpointing to `disk` that the job can
/// resume from, or `None` for the disk. Every rank calls it, and they choose together.
///
/// A snapshot is chosen only when every rank's node holds it at one step, taken at this
/// world size, with the rank's own file complete (marked so by its writer),
/// and no older than the disk's newest checkpoint. A node holds only its own ranks' files:
/// those it lacks are sent by the ranks that wrote them before any rank opens the snapshot,
/// the bytes a restore from disk would read from the shared file system. Should the
/// snapshot then fail to open anywhere, every rank takes the disk.
pub fn newest_in_memory(
    disk: &Path,
    world: Option<&dyn ProcessGroup>,
    node_publisher: bool,
) -> Result<Option<Checkpoint>> {
    let (rank, ranks) = world.map_or((0, 1), |g| (g.rank(), g.size()));
    let memory = memory_root(disk)?;
    let own = rank_file(rank);
    let usable = latest(&memory).ok().and_then(|dir| Some((read_meta(&dir).ok()?, dir))).filter(|(meta, dir)| {
        let complete = dir.join(&own).is_file() && dir.join(complete_marker(&own)).is_file();
        meta.world_size == ranks && (!meta.files.contains(&own) || complete) && taken_since_boot(dir)
    });
    let step = usable.as_ref().map_or(-1.0, |(meta, _)| meta.step as f64);
    let on_disk = newest_step_on(disk);
    let agreed = most_over(world, &[step, -step, on_disk])?;
    let (newest, oldest, disk_newest) = (agreed[0], -agreed[1], agreed[2]);
    let Some((meta, dir)) = usable.filter(|_| newest == oldest && oldest >= disk_newest) else { return Ok(None) };
    if let Some(g) = world {
        fill_from_other_nodes(g, &meta, &dir, node_publisher)?;
    }
    let opened = Checkpoint::open(&dir);
    let failed_anywhere = most_over(world, &[f64::from(u8::from(opened.is_err()))])?[0] > 0.0;
    match (opened, failed_anywhere) {
        (Ok(snapshot), false) => Ok(Some(snapshot)),
        (opened, _) => {
            let why = opened.err().map_or_else(|| "on another rank".to_string(), |e| e.to_string());
            tracing::warn!(snapshot = %dir.display(), %why, "the snapshot in host memory does not open; resuming from disk");
            Ok(None)
        }
    }
}

/// The checkpoint the run checkpointing to `disk` resumes from, and where it lies: with
/// `asynchronous` saves the snapshot in host memory that [`newest_in_memory`] chooses,
/// else the disk's `latest`; `None` where there is neither. Every rank calls it.
pub fn newest(
    disk: &Path,
    world: Option<&dyn ProcessGroup>,
    node_publisher: bool,
    asynchronous: bool,
) -> Result<Option<(Checkpoint, &'static str)>> {
    if asynchronous {
        if let Some(snapshot) = newest_in_memory(disk, world, node_publisher)? {
            return Ok(Some((snapshot, "host memory")));
        }
    }
    match disk.join("latest").is_file() {
        true => Ok(Some((Checkpoint::open(disk)?, "disk"))),
        false => Ok(None),
    }
}

/// The step of the newest checkpoint in the folder `disk`; −1 where there is none.
fn newest_step_on(disk: &Path) -> f64 {
    latest(disk).ok().and_then(|d| read_meta(&d).ok()).map_or(-1.0, |m| m.step as f64)
}

/// Each of `values`' largest over the ranks of `world` (itself without one).
fn most_over(world: Option<&dyn ProcessGroup>, values: &[f64]) -> Result<Vec<f64>> {
    match world {
        Some(g) => all_reduce_values(g, values, ReduceOp::Max),
        None => Ok(values.to_vec()),
    }
}

/// Completes every node's copy of the snapshot in `dir`: each file `meta` lists that some
/// node's memory lacks is sent by the rank that wrote it, and written by the first rank of
/// each node lacking it. Every rank calls it.
fn fill_from_other_nodes(g: &dyn ProcessGroup, meta: &Meta, dir: &Path, node_publisher: bool) -> Result<()> {
    let lacks = |q: usize| node_publisher && meta.files.contains(&rank_file(q)) && !dir.join(rank_file(q)).is_file();
    let lacking: Vec<f64> = (0..g.size()).map(|q| f64::from(u8::from(lacks(q)))).collect();
    let lacking = all_reduce_values(g, &lacking, ReduceOp::Max)?;
    let mut local = Ok(());
    for owner in (0..g.size()).filter(|&q| lacking[q] > 0.0) {
        let received = send_file(g, owner, &dir.join(rank_file(owner)), lacks(owner));
        local = local.and(received);
    }
    super::agree(Some(g), local, &[]).map(drop)
}

/// Bytes of a file moved by one broadcast of [`send_file`].
const TRANSFER_BYTES: usize = 64 << 20;

/// Broadcasts rank `owner`'s file `path` to every rank; where `receive`, it is written at
/// `path` (0600, under a hidden name renamed into place once whole). Whatever fails on a
/// rank, it takes part in every broadcast, so that none waits for one the others skipped.
fn send_file(g: &dyn ProcessGroup, owner: usize, path: &Path, receive: bool) -> Result<()> {
    use std::io::{Read, Write};
    let mut outcome = Ok(());
    let mut source = None;
    if g.rank() == owner {
        match std::fs::File::open(path) {
            Ok(f) => source = Some(f),
            Err(e) => outcome = Err(Error::io(path, e)),
        }
    }
    let length = source.as_ref().and_then(|f| f.metadata().ok()).map_or(0.0, |m| m.len() as f64);
    let length_of = Tensor::from_slice(&[length]);
    g.broadcast(&length_of, owner)?.wait()?;
    let length = length_of.double_value(&[0]) as usize;
    let incoming = path.with_file_name(format!(
        ".{}.incoming",
        path.file_name().map_or_else(Default::default, |n| n.to_string_lossy())
    ));
    let mut sink = None;
    if receive {
        let opened = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&incoming);
        match opened {
            Ok(f) => sink = Some(f),
            Err(e) => outcome = outcome.and(Err(Error::io(&incoming, e))),
        }
    }
    let mut at = 0;
    while at < length {
        let mut bytes = vec![0u8; TRANSFER_BYTES.min(length - at)];
        if let Some(f) = source.as_mut() {
            if let Err(e) = f.read_exact(&mut bytes) {
                outcome = outcome.and(Err(Error::io(path, e)));
            }
        }
        let piece = Tensor::from_slice(&bytes);
        g.broadcast(&piece, owner)?.wait()?;
        if let Some(out) = sink.as_mut() {
            let received = Vec::<u8>::try_from(&piece)?;
            if let Err(e) = out.write_all(&received) {
                outcome = outcome.and(Err(Error::io(&incoming, e)));
            }
        }
        at += bytes.len();
    }
    // Whether the owner read its whole file: what it sent after a failed read is not the
    // file, and must not be taken for it where it arrived.
    let read = Tensor::from_slice(&[f64::from(u8::from(outcome.is_ok()))]);
    g.broadcast(&read, owner)?.wait()?;
    if read.double_value(&[0]) == 0.0 && g.rank() != owner {
        outcome = outcome.and(Err(Error::Checkpoint(format!("rank {owner} could not read its {}", path.display()))));
    }
    if sink.is_some() && outcome.is_ok() {
        outcome = std::fs::rename(&incoming, path).map_err(|e| Error::io(path, e));
        tracing::info!(file = %path.display(), bytes = length, from_rank = owner, "snapshot part received from another node");
    } else if sink.is_some() {
        _ = std::fs::remove_file(&incoming);
    }
    outcome
}

/// A save being persisted by the writer thread.
struct InFlight {
    step: u64,
    writer: JoinHandle<Result<(Persisted, Option<MappedFile>)>>,
}

/// What a writer spent persisting a save.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Persisted {
    /// Seconds from its start to the save being on disk.
    pub seconds: f64,
    /// Seconds its thread ran on a CPU.
    pub cpu_s: f64,
}

/// Seconds the calling thread has run on a CPU.
fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills the timespec it is given; this clock exists on Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0.0;
    }
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Saves checkpoints asynchronously: a snapshot in host memory, persisted to disk by a
/// writer thread. Every rank holds one and calls it at the same steps.
pub struct AsyncSaver {
    disk: PathBuf,
    memory: PathBuf,
    /// Whether this rank publishes the snapshots of its node (its first local rank).
    node_publisher: bool,
    /// The folder of this process's last snapshot, whose files the next one overwrites.
    taken: Option<PathBuf>,
    /// The map of this rank's file of the last snapshot, which the next one writes through.
    kept: Option<MappedFile>,
    in_flight: Option<InFlight>,
}

impl AsyncSaver {
    /// A saver persisting to the checkpoint folder `disk`; `node_publisher` for exactly one
    /// rank of each node.
    pub fn new(disk: &Path, node_publisher: bool) -> Result<AsyncSaver> {
        let memory = memory_root(disk)?;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&memory).map_err(|e| Error::io(&memory, e))?;
        Ok(AsyncSaver { disk: disk.to_path_buf(), memory, node_publisher, taken: None, kept: None, in_flight: None })
    }

    /// The folder the snapshots are taken in.
    pub fn memory(&self) -> &Path {
        &self.memory
    }

    /// Snapshots `parts` into host memory, then starts the writer (which copies in the
    /// values already on the host, `parts`' updates waiting for it, then persists the
    /// snapshot to disk) and returns; waits first for the previous save's writer. Every rank
    /// calls it.
    pub fn save(
        &mut self,
        layout: &Layout,
        parts: &mut [Part<'_>],
        run: &RunInfo,
        world: Option<&dyn ProcessGroup>,
        keep: usize,
    ) -> Result<SaveTimes> {
        let start = Instant::now();
        let persisted = self.wait(world)?;
        let waited_s = start.elapsed().as_secs_f64();
        // The memory keeps one snapshot, the previous one being on disk now: its files are
        // overwritten in place (their pages are already there), so it stops being a
        // checkpoint before any rank touches them.
        let memory_latest = self.memory.join("latest");
        let invalidated = match self.node_publisher {
            true => std::fs::remove_file(&memory_latest)
                .or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) })
                .map_err(|e| Error::io(&memory_latest, e)),
            false => Ok(()),
        };
        super::agree(world, invalidated, &[])?;
        let reusing = RankWrite::Reusing(self.taken.as_deref(), self.kept.take());
        let (snapshot, meta, deferred) =
            save_into(&self.memory, layout, parts, run, world, 1, self.node_publisher, reusing)?;
        self.taken = Some(snapshot.clone());
        let rank = world.map_or(0, |g| g.rank());
        let own = Some(rank_file(rank)).filter(|f| meta.files.contains(f));
        let (locked_bytes, locking_s) =
            deferred.as_ref().map_or((0, 0.0), |d| (d.locked_bytes() as u64, d.locking_s()));
        // Values already on the host are copied into the snapshot by the writer, while the
        // next step computes; whatever would change them waits for that copy.
        let opener = deferred.as_ref().filter(|d| d.bytes() > 0).map(|_| {
            let (fence, opener) = Fence::closed();
            for part in parts.iter_mut() {
                part.optimizer.hold_updates(fence.clone());
            }
            opener
        });
        // Rank files are made 0600; the description and `latest` are written as any file.
        if self.node_publisher {
            let boot = snapshot.join(BOOT_FILE);
            std::fs::write(&boot, boot_id()).map_err(|e| Error::io(&boot, e))?;
            for path in [snapshot.join("meta.json"), memory_latest, boot] {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                    .map_err(|e| Error::io(&path, e))?;
            }
        }
        fault::point("snapshot-taken", run.step)?;
        let staging = prepare_staging(&self.disk, run.step, rank == 0, world)?;
        let job = Persist { snapshot, deferred, opener, disk: self.disk.clone(), staging, rank, own, meta, keep };
        self.start_writer(job)?;
        Ok(SaveTimes {
            blocked_s: start.elapsed().as_secs_f64(),
            waited_s,
            persisted_s: persisted.map(|p| p.seconds),
            persisted_cpu_s: persisted.map(|p| p.cpu_s),
            updates_waited_s: 0.0,
            locked_bytes,
            locking_s,
        })
    }

    /// Starts persisting `resumed`, a snapshot in this saver's host memory newer than the
    /// disk's newest checkpoint (its writer stopped before publishing it), in the
    /// background: the next save replaces memory's one snapshot, so it must first wait for
    /// this one to be on disk, as for any save's. Nothing where the disk has it already or
    /// it was not read from memory. Every rank calls it.
    pub fn persist_resumed(
        &mut self,
        resumed: &Checkpoint,
        world: Option<&dyn ProcessGroup>,
        keep: usize,
    ) -> Result<()> {
        let on_disk = newest_step_on(&self.disk);
        let in_memory = match resumed.location.starts_with(&self.memory) {
            true => resumed.meta.step as f64,
            false => -1.0,
        };
        let agreed = most_over(world, &[on_disk, in_memory])?;
        if agreed[1] <= agreed[0] {
            return Ok(());
        }
        let rank = world.map_or(0, |g| g.rank());
        tracing::info!(step = resumed.meta.step, "the snapshot resumed from host memory is not on disk: persisting it");
        let staging = prepare_staging(&self.disk, resumed.meta.step, rank == 0, world)?;
        let own = Some(rank_file(rank)).filter(|f| resumed.meta.files.contains(f));
        self.start_writer(Persist {
            snapshot: resumed.location.clone(),
            deferred: None,
            opener: None,
            disk: self.disk.clone(),
            staging,
            rank,
            own,
            meta: resumed.meta.clone(),
            keep,
        })
    }

    /// Starts the writer thread persisting `job`.
    fn start_writer(&mut self, job: Persist) -> Result<()> {
        let (step, began) = (job.meta.step, Instant::now());
        let writer = std::thread::Builder::new()
            .name("strata-checkpoint-writer".into())
            .spawn(move || {
                let kept = job.run()?;
                Ok((Persisted { seconds: began.elapsed().as_secs_f64(), cpu_s: thread_cpu_seconds() }, kept))
            })
            .map_err(|e| Error::Checkpoint(format!("cannot start the checkpoint writer: {e}")))?;
        self.in_flight = Some(InFlight { step, writer });
        Ok(())
    }

    /// Waits for the save in flight to be on disk on every rank; returns what its writer
    /// spent (`None`: none was in flight). Every rank calls it.
    pub fn wait(&mut self, world: Option<&dyn ProcessGroup>) -> Result<Option<Persisted>> {
        let Some(InFlight { step, writer }) = self.in_flight.take() else { return Ok(None) };
        let done = writer
            .join()
            .unwrap_or_else(|_| Err(Error::Checkpoint("the checkpoint writer stopped".into())))
            .map_err(|e| Error::Checkpoint(format!("persisting the checkpoint of step {step}: {e}")))
            .map(|(persisted, kept)| {
                self.kept = kept;
                persisted
            });
        let spent = done.as_ref().map_or(Persisted { seconds: 0.0, cpu_s: 0.0 }, |p| *p);
        super::agree(world, done.map(|_| ()), &[])?;
        Ok(Some(spent))
    }

    /// Waits for the save in flight, then removes the memory folder (this node's first
    /// rank, once every rank is done with it): the run ended cleanly, its checkpoints are
    /// on disk. Returns what the last writer spent.
    pub fn close(mut self, world: Option<&dyn ProcessGroup>) -> Result<Option<Persisted>> {
        let persisted = self.wait(world)?;
        if self.node_publisher && self.memory.exists() {
            std::fs::remove_dir_all(&self.memory).map_err(|e| Error::io(&self.memory, e))?;
        }
        Ok(persisted)
    }
}

/// What the writer thread persists: this rank's file of the snapshot, once the values left
/// on the host are copied in, and on rank 0 the publication once every rank's file is on
/// disk.
struct Persist {
    snapshot: PathBuf,
    /// What this rank's file of the snapshot still lacks, where it wrote one.
    deferred: Option<Deferred>,
    /// The fence the updates wait at until the deferred values are copied in.
    opener: Option<FenceOpener>,
    disk: PathBuf,
    staging: PathBuf,
    rank: usize,
    /// This rank's file in the snapshot, where it wrote one.
    own: Option<String>,
    meta: Meta,
    keep: usize,
}

impl Persist {
    /// Persists the save; returns the map of this rank's snapshot file, for the next save.
    fn run(mut self) -> Result<Option<MappedFile>> {
        let result = self.complete().and_then(|kept| self.copy_and_publish().map(|()| kept));
        if let Err(e) = &result {
            // Rank 0's writer stops waiting for this rank's file when it sees the marker.
            let _ = std::fs::write(self.staging.join(failure_marker(self.rank)), e.to_string());
        }
        result
    }

    /// Copies the values left on the host into this rank's file of the snapshot, lets the
    /// updates go on (whether the copy succeeded or not: the save then fails, not the
    /// step), and marks the file complete: only then may a restart read it. Returns the
    /// file's map.
    fn complete(&mut self) -> Result<Option<MappedFile>> {
        let kept = self.deferred.take().map(Deferred::fill).transpose().map_err(super::where_snapshots_go);
        drop(self.opener.take());
        let kept = kept?;
        if let Some(name) = &self.own {
            let marker = self.snapshot.join(complete_marker(name));
            std::fs::write(&marker, b"").map_err(|e| Error::io(&marker, e))?;
        }
        Ok(kept)
    }

    fn copy_and_publish(&self) -> Result<()> {
        fault::point("persist-begun", self.meta.step)?;
        if let Some(name) = &self.own {
            let source = self.snapshot.join(name);
            io::copy_atomic(&source, &self.staging.join(name))?;
        }
        fault::point("persist-written", self.meta.step)?;
        if self.rank == 0 {
            self.wait_for_others()?;
            publish(&self.disk, &self.staging, &self.meta, self.keep)?;
        }
        Ok(())
    }

    /// Waits until every file the description lists is in the staging folder, or a rank's
    /// writer says it failed.
    fn wait_for_others(&self) -> Result<()> {
        let deadline = Instant::now() + OTHERS_DEADLINE;
        loop {
            if self.meta.files.iter().all(|f| self.staging.join(f).is_file()) {
                return Ok(());
            }
            for rank in 0..self.meta.world_size {
                let marker = self.staging.join(failure_marker(rank));
                if let Ok(why) = std::fs::read_to_string(&marker) {
                    return Err(Error::Checkpoint(format!("rank {rank} could not persist its part: {why}")));
                }
            }
            if Instant::now() > deadline {
                return Err(Error::Checkpoint(format!(
                    "the other ranks' files did not reach {} within {} s",
                    self.staging.display(),
                    OTHERS_DEADLINE.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The file of a snapshot in memory naming the boot it was taken in ([`boot_id`]).
const BOOT_FILE: &str = "boot_id";

/// This boot of the machine, as the kernel names it (empty where it does not).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map_or_else(|_| String::new(), |s| s.trim().to_string())
}

/// Whether the snapshot in `dir` was taken since the machine last booted. Snapshots are
/// written in place through memory maps and never flushed: in shared memory a reboot
/// clears them, but in a folder on disk (`STRATA_SNAPSHOT_DIR`) one may come back from a
/// power loss with some pages of the next save's and some not.
fn taken_since_boot(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join(BOOT_FILE)).is_ok_and(|taken| taken == boot_id())
}

/// The name of the marker beside a rank's snapshot file `file` saying it is complete.
fn complete_marker(file: &str) -> String {
    format!("{file}.complete")
}

fn failure_marker(rank: usize) -> String {
    format!("rank{rank}.failed")
}

#[cfg(test)]
mod tests {
    use super::super::{save, DataPosition};
    use super::*;
    use crate::engine::{Engine, EngineConfig};
    use crate::model::{self, Builder, MlpConfig, ParamId};
    use crate::optim::{Optimizer, OptimizerConfig};
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;
    use tch::{Kind, Tensor};

    fn run_info(step: u64) -> RunInfo {
        RunInfo {
            step,
            world_size: 1,
            strategy: serde_json::json!([]),
            optimizer: "adamw".into(),
            data: DataPosition { seed: 0, batch_size: 1, ctx: 1, next_step: step },
            loss_scaler: None,
            model: None,
            base: None,
        }
    }

    fn mlp() -> (Engine, Optimizer) {
        let mut b = Builder::new();
        model::mlp(&MlpConfig { vocab: 11, layers: 2, dim: 8 }, &mut b).unwrap();
        let mut engine = Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap();
        let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
        (engine, optimizer)
    }

    /// Each snapshot after the first is written into the previous one's file (the same
    /// inode: its pages are reused, not allocated again), holds its own step's values though
    /// an update follows at once, and is private; memory older than the disk's newest
    /// checkpoint is never chosen, nor memory taken before the machine's last boot.
    #[test]
    fn snapshots_overwrite_the_previous_file_in_place_and_stale_memory_is_not_chosen() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("ckpt");
        let (mut engine, mut optimizer) = mlp();
        let layout = Layout::of(&engine);
        let mut saver = AsyncSaver::new(&disk, true).unwrap();
        let first = ParamId(0);
        let mut inodes = Vec::new();
        for step in 1..=3u64 {
            let values = BTreeMap::from([(first, engine.param(first).ones_like() * step as f64)]);
            engine.set_params(&values).unwrap();
            let mut parts = [Part { engine: &mut engine, optimizer: &mut optimizer, first_unit: 0 }];
            saver.save(&layout, &mut parts, &run_info(step), None, 2).unwrap();
            // The parameters lie on the host: the writer copies them into the snapshot while
            // this update waits (AdamW's decay would change them).
            optimizer.step().unwrap();
            saver.wait(None).unwrap();
            let snapshot = latest(saver.memory()).unwrap();
            let file = std::fs::metadata(snapshot.join(rank_file(0))).unwrap();
            assert_eq!(file.mode() & 0o777, 0o600);
            inodes.push(file.ino());
            let chosen = newest_in_memory(&disk, None, true).unwrap().expect("the snapshot is complete and newest");
            assert_eq!(chosen.meta.step, step);
            let (mut restored, mut restored_optimizer) = mlp();
            chosen.restore(&mut restored, &mut restored_optimizer, "adamw").unwrap();
            let held = restored.param(first).to_kind(Kind::Double);
            assert_eq!(held, Tensor::full_like(&held, step as f64), "step {step}");
        }
        assert!(inodes.windows(2).all(|w| w[0] == w[1]), "a new file per snapshot: {inodes:?}");
        saver.wait(None).unwrap();
        let kept: Vec<_> = std::fs::read_dir(saver.memory()).unwrap().filter_map(|e| e.ok()).collect();
        assert_eq!(kept.len(), 2, "one snapshot folder and latest: {kept:?}");
        // A synchronous save of a later step: the memory's step 3 is older.
        save(&disk, &mut engine, &mut optimizer, &run_info(4), None, 2).unwrap();
        assert!(newest_in_memory(&disk, None, true).unwrap().is_none(), "memory older than the disk was chosen");
        // A snapshot of another boot, perhaps torn by a power loss, is not chosen.
        save(&disk, &mut engine, &mut optimizer, &run_info(4), None, 2).unwrap();
        let mut parts = [Part { engine: &mut engine, optimizer: &mut optimizer, first_unit: 0 }];
        saver.save(&layout, &mut parts, &run_info(5), None, 2).unwrap();
        saver.wait(None).unwrap();
        assert_eq!(newest_in_memory(&disk, None, true).unwrap().map(|c| c.meta.step), Some(5));
        std::fs::write(latest(saver.memory()).unwrap().join(BOOT_FILE), "an earlier boot").unwrap();
        assert!(newest_in_memory(&disk, None, true).unwrap().is_none(), "a snapshot of another boot was chosen");
        let memory = saver.memory().to_path_buf();
        saver.close(None).unwrap();
        assert!(!memory.exists());
    }

    /// A snapshot file a node lacks arrives whole from its owner, and where the owner cannot
    /// read it, nothing arrives: no file takes its place, complete-looking but not its
    /// bytes. Two ranks over TCP, as threads.
    #[test]
    fn a_snapshot_file_sent_to_another_node_arrives_whole_or_not_at_all() {
        use crate::comm::{Comm, Store, StoreServer};
        let dir = tempfile::tempdir().unwrap();
        let (sent, unreadable) = (dir.path().join("owner"), dir.path().join("unreadable"));
        std::fs::create_dir_all(&unreadable).unwrap();
        let bytes: Vec<u8> = (0..(TRANSFER_BYTES + 1000)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&sent, &bytes).unwrap();
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "send").unwrap();
        let address = server.addr();
        let mut hosted = Some(server);
        let ranks: Vec<_> = (0..2usize)
            .map(|rank| {
                let (hosted, dir) = (if rank == 0 { hosted.take() } else { None }, dir.path().to_path_buf());
                let (sent, unreadable) = (sent.clone(), unreadable.clone());
                std::thread::spawn(move || {
                    let store = Store::connect(address, "send", Duration::from_secs(30)).unwrap();
                    let comm = Comm::new(store, hosted, rank, 2, "cpu:tcp", Duration::from_secs(30)).unwrap();
                    let g = comm.world().unwrap();
                    // Rank 0 owns both files; rank 1 receives them under names of its own.
                    let at = |name: &str, own: &Path| if rank == 0 { own.to_path_buf() } else { dir.join(name) };
                    let whole = send_file(g.as_ref(), 0, &at("received", &sent), rank == 1);
                    // A folder opens but does not read: its owner's read fails part-way.
                    let failed = send_file(g.as_ref(), 0, &at("not-received", &unreadable), rank == 1);
                    (whole.map_err(|e| e.to_string()), failed.map_err(|e| e.to_string()))
                })
            })
            .collect();
        let outcomes: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(outcomes.iter().all(|(whole, _)| whole.is_ok()), "{outcomes:?}");
        assert_eq!(std::fs::read(dir.path().join("received")).unwrap(), bytes);
        let refused = outcomes[1].1.as_ref().expect_err("rank 1 took what rank 0 could not read");
        assert!(refused.contains("rank 0 could not read"), "{refused}");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left.len(), 3, "only the two files and the folder: {left:?}");
    }

    /// A snapshot resumed from memory that the disk lacks (its writer stopped before
    /// publishing it) is persisted as the next saver starts, so the save that then replaces
    /// memory's one snapshot finds it on disk; one the disk holds is not written again.
    #[test]
    fn a_snapshot_resumed_from_memory_reaches_the_disk_before_memory_moves_on() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("ckpt");
        let (mut engine, mut optimizer) = mlp();
        let layout = Layout::of(&engine);
        let first = ParamId(0);
        let mut saver = AsyncSaver::new(&disk, true).unwrap();
        let mut published = vec![];
        for step in 1..=2u64 {
            let values = BTreeMap::from([(first, engine.param(first).ones_like() * step as f64)]);
            engine.set_params(&values).unwrap();
            let mut parts = [Part { engine: &mut engine, optimizer: &mut optimizer, first_unit: 0 }];
            saver.save(&layout, &mut parts, &run_info(step), None, 2).unwrap();
            saver.wait(None).unwrap();
            published.push(latest(&disk).unwrap());
        }
        // The disk as a writer killed before publishing step 2 leaves it; the process dies
        // with its snapshot in memory.
        std::fs::remove_dir_all(&published[1]).unwrap();
        let step_one = published[0].file_name().unwrap().to_str().unwrap();
        std::fs::write(disk.join("latest"), step_one).unwrap();
        drop(saver);
        let chosen = newest_in_memory(&disk, None, true).unwrap().expect("memory holds step 2");
        assert_eq!(chosen.meta.step, 2);
        let mut restarted = AsyncSaver::new(&disk, true).unwrap();
        restarted.persist_resumed(&chosen, None, 2).unwrap();
        assert!(restarted.wait(None).unwrap().is_some(), "step 2 was not persisted");
        let on_disk = Checkpoint::open(&disk).unwrap();
        assert_eq!(on_disk.meta.step, 2);
        let (mut restored, mut restored_optimizer) = mlp();
        on_disk.restore(&mut restored, &mut restored_optimizer, "adamw").unwrap();
        let held = restored.param(first).to_kind(Kind::Double);
        assert_eq!(held, Tensor::full_like(&held, 2.0));
        let mut again = AsyncSaver::new(&disk, true).unwrap();
        again.persist_resumed(&chosen, None, 2).unwrap();
        assert!(again.wait(None).unwrap().is_none(), "a snapshot the disk holds was written again");
        again.close(None).unwrap();
    }
}
