//! Training checkpoints: sharded saves with exact resume, merging, and loading at another
//! world size.
//!
//! A checkpoint is a folder `step-NNNNNNNN` under the run's checkpoint folder, holding
//! `meta.json` (model layout, strategy, world size, step, optimizer, data position) and
//! one safetensors file per rank that holds a distinct part of the model states: for each
//! unit, the rank's range of the unit's flat layout (`param.<unit>`, and one tensor per
//! optimizer state, e.g. `exp_avg.<unit>`), with the ranges in the file's metadata. A save
//! is staged in a hidden folder, renamed into place and then named by the `latest` file,
//! each step atomic, so a crash while saving leaves the previous checkpoint as it was.
//! Loading assembles whatever ranges the loading rank needs from the files that hold them,
//! one unit at a time, so any world size and strategy can load any checkpoint.
//!
//! Under tensor parallelism each tensor rank's units hold its pieces: its files store
//! ranges of that rank's layout (`tensor_rank` in their metadata), and the description
//! gives every parameter's split, so a loader joins the pieces into whole units and splits
//! them again for its own tensor size.
//!
//! Owns: the format, its validation, and merging into one file. Must not decide when to
//! save (the training loop does) or how states are sharded (the engine's schedule does).
pub mod snapshot;

use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::compute::fp8::Fp8Snapshot;
use crate::compute::scaler::LossScaler;
use crate::engine::{Engine, Holding};
use crate::io::{self, write_safetensors_deferring, write_safetensors_streamed, Deferred, MappedFile};
use crate::model::{ExpertSlot, ModelConfig, ModelSpec, TpRole};
use crate::optim::Optimizer;
use crate::{fault, Error, Result};
use memmap2::Mmap;
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

const FORMAT: &str = "strata-checkpoint-1";
/// Metadata key of a merged file that carries the checkpoint's description.
const MERGED_KEY: &str = "strata_checkpoint";

/// One parameter as a checkpoint records it: its name, shape, unit and place in the unit's layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// The parameter's name in the model.
    pub name: String,
    /// The whole (unsplit) parameter's shape.
    pub shape: Vec<i64>,
    /// Index of the unit that owns it.
    pub unit: usize,
    /// Position in the unit's whole (unsplit) flat layout.
    pub offset: i64,
    /// How tensor parallelism splits it (absent in checkpoints that predate the split).
    #[serde(default)]
    pub tp: Option<TpRole>,
    /// In its unit's frozen head (ahead of the first trainable parameter: a LoRA run's
    /// base), which has no optimizer state and is stored only where the run's base did not
    /// come from its initial weights ([`RunInfo::base`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub frozen: bool,
    /// The routed expert it belongs to, if it is one's weight or bias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert: Option<ExpertSlot>,
}

impl ParamEntry {
    /// Elements of the piece a rank stores at tensor size `tensor_size`, as rank
    /// `expert_rank` of an expert group of `expert_size` storing its experts apart (none of
    /// another rank's expert).
    fn local_numel(&self, tensor_size: i64, (expert_size, expert_rank): (usize, usize)) -> i64 {
        if self.expert.is_some_and(|slot| expert_size > 1 && slot.owner(expert_size as i64) != expert_rank as i64) {
            return 0;
        }
        self.tp.unwrap_or(TpRole::Replicated).local_shape(&self.shape, tensor_size).iter().product()
    }
}

fn one() -> usize {
    1
}

/// Where the data loader stands and how it was configured (all must match to resume exactly).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    /// The loader's shuffling seed.
    pub seed: u64,
    /// Rows per optimizer step over all ranks.
    pub batch_size: usize,
    /// Positions per row.
    pub ctx: usize,
    /// Index of the next step the loader produces.
    pub next_step: u64,
}

/// A checkpoint's description: `meta.json` of a folder, or a merged file's metadata.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// The format's name and version (`strata-checkpoint-1`).
    pub format: String,
    /// Training steps completed when it was saved.
    pub step: u64,
    /// Ranks that saved it.
    pub world_size: usize,
    /// The run's strategy in list form.
    pub strategy: serde_json::Value,
    /// Every parameter of the whole model, in `ParamId` order.
    pub params: Vec<ParamEntry>,
    /// Elements of each unit's whole flat layout (without padding).
    pub unit_numel: Vec<i64>,
    /// Ranks each unit was split over (tensor parallelism); the rank files hold pieces.
    #[serde(default = "one")]
    pub tensor_size: usize,
    /// Ranks of the expert groups that stored their routed experts apart (1: every rank
    /// file holds every expert); each rank file then holds its expert rank's.
    #[serde(default = "one")]
    pub expert_size: usize,
    /// The optimizer's name (e.g. `adamw`); a resume must use the same.
    pub optimizer: String,
    /// Names of the optimizer's states (e.g. `exp_avg`), each stored per unit beside `param`.
    pub state_names: Vec<String>,
    /// Where the data loader stands, for an exact resume.
    pub data: DataPosition,
    /// The loss scaler's state, when the run scales its loss.
    #[serde(default)]
    pub loss_scaler: Option<LossScaler>,
    /// Each unit's fp8 scaling state (amax histories, scales), where it computes in fp8.
    #[serde(default)]
    pub fp8: Vec<Option<Fp8Snapshot>>,
    /// Updates the optimizer has applied (PyTorch's `state["step"]`; every parameter group
    /// steps together). Below `step` when the loss scaler skipped steps; absent in
    /// checkpoints that predate it, which resume from `step`.
    #[serde(default)]
    pub optimizer_steps: Option<u64>,
    /// The rank files; empty in a merged file.
    pub files: Vec<String>,
    /// The built-in model trained, where the run used one (a model folder's, or the flags').
    #[serde(default)]
    pub model: Option<ModelConfig>,
    /// The frozen base the run loaded from its initial weights and this checkpoint leaves
    /// out; `None` where it holds every parameter (or predates the record).
    #[serde(default)]
    pub base: Option<BaseRecord>,
}

/// The base weights a run started from: where they were read and a digest of them
/// ([`crate::io::weights_digest`]). A checkpoint that leaves its frozen base out records
/// it, so that it is never completed with another base.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseRecord {
    /// The files or folders the base was read from, as given.
    pub sources: Vec<String>,
    /// The digest of their weights.
    pub digest: String,
}

impl BaseRecord {
    /// The record of the weights in `files`, read from `sources`.
    pub fn of(sources: Vec<String>, files: &[PathBuf]) -> Result<BaseRecord> {
        Ok(BaseRecord { sources, digest: io::weights_digest(files)? })
    }

    /// Fails, in one line, where `given` is another base than this one, which the checkpoint
    /// at `location` was trained on.
    pub fn check(&self, given: &BaseRecord, location: &Path) -> Result<()> {
        if self.digest == given.digest {
            return Ok(());
        }
        Err(Error::Checkpoint(format!(
            "{}: trained on the base in {} (weights digest {}), not the one given in {} (digest {}): \
             give the base it was trained on",
            location.display(),
            self.sources.join(", "),
            &self.digest[..12.min(self.digest.len())],
            given.sources.join(", "),
            &given.digest[..12.min(given.digest.len())],
        )))
    }
}

/// What a training run puts in a checkpoint besides the model states.
pub struct RunInfo {
    /// Training steps completed.
    pub step: u64,
    /// Ranks taking part.
    pub world_size: usize,
    /// The run's strategy in list form.
    pub strategy: serde_json::Value,
    /// The optimizer's name (e.g. `adamw`).
    pub optimizer: String,
    /// Where the data loader stands.
    pub data: DataPosition,
    /// The loss scaler's state, when the run scales its loss.
    pub loss_scaler: Option<LossScaler>,
    /// The built-in model trained, where the run used one.
    pub model: Option<ModelConfig>,
    /// The base the run loaded from its initial weights (a model folder or weights file):
    /// checkpoints record it and leave out the units' frozen heads, which a resumed run
    /// loads again. `None`: the frozen heads are stored.
    pub base: Option<BaseRecord>,
}

fn state_names(optimizer: &Optimizer) -> Vec<String> {
    optimizer.state_names().iter().map(|s| s.to_string()).collect()
}

/// The whole model as a checkpoint lays it out: every parameter (in `ParamId` order), the
/// units' sizes, and the tensor size its units are split over.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Every parameter, in `ParamId` order.
    pub params: Vec<ParamEntry>,
    /// Elements of each unit's whole flat layout (without padding).
    pub unit_numel: Vec<i64>,
    /// Ranks each unit is split over (tensor parallelism).
    pub tensor_size: usize,
    /// Ranks of the expert groups storing their experts apart (1: each stores every expert).
    pub expert_size: usize,
}

impl Layout {
    /// The layout of `engine`'s model, which it holds whole (no pipeline stage).
    pub fn of(engine: &Engine) -> Layout {
        Layout::of_spec(engine.spec(), engine.holding())
    }

    /// The layout of the whole model `spec` describes, stored as `holding` says (split over
    /// its tensor ranks; experts apart over its expert ranks), for pipeline stages, whose
    /// engines hold some of its units.
    pub fn of_spec(spec: &ModelSpec, holding: Holding) -> Layout {
        let tensor_size = holding.tensor as usize;
        let mut offsets = vec![0; spec.params.len()];
        let mut frozen = vec![false; spec.params.len()];
        let mut unit_numel = Vec::with_capacity(spec.units.len());
        for unit in &spec.units {
            let (mut offset, mut head) = (0, true);
            for id in &unit.params {
                offsets[id.0] = offset;
                offset += spec.params[id.0].numel();
                head &= !spec.params[id.0].requires_grad;
                frozen[id.0] = head;
            }
            unit_numel.push(offset);
        }
        let params = spec
            .params
            .iter()
            .zip(offsets.into_iter().zip(frozen))
            .map(|(p, (offset, frozen))| ParamEntry {
                name: p.name.clone(),
                shape: p.shape.clone(),
                unit: p.unit,
                offset,
                tp: Some(p.tp),
                frozen,
                expert: p.expert,
            })
            .collect();
        let expert_size = holding.experts.map_or(1, |(size, _)| size as usize);
        Layout { params, unit_numel, tensor_size, expert_size }
    }
}

/// An engine and its optimizer that hold units `first_unit..` of the whole model (all of
/// it, or a pipeline stage's).
pub struct Part<'a> {
    /// The engine holding the part's units.
    pub engine: &'a mut Engine,
    /// The optimizer over the engine's parameters.
    pub optimizer: &'a mut Optimizer,
    /// Index in the whole model of the engine's first unit.
    pub first_unit: usize,
}

fn describe(layout: &Layout, parts: &[Part<'_>], run: &RunInfo) -> Meta {
    let mut fp8 = vec![None; layout.unit_numel.len()];
    for part in parts {
        for (k, s) in part.engine.fp8_states().iter().enumerate() {
            fp8[part.first_unit + k] = s.as_ref().and_then(|s| s.lock().ok().map(|s| s.snapshot()));
        }
    }
    let optimizer = &parts[0].optimizer;
    Meta {
        format: FORMAT.into(),
        step: run.step,
        world_size: run.world_size,
        strategy: run.strategy.clone(),
        params: layout.params.clone(),
        unit_numel: layout.unit_numel.clone(),
        tensor_size: layout.tensor_size,
        expert_size: layout.expert_size,
        optimizer: run.optimizer.clone(),
        state_names: state_names(optimizer),
        data: run.data.clone(),
        loss_scaler: run.loss_scaler.clone(),
        fp8,
        optimizer_steps: Some(optimizer.steps_taken()),
        files: vec![],
        model: run.model.clone(),
        base: run.base.clone(),
    }
}

fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

/// Saves a checkpoint of `engine` and `optimizer` under `root`. Every rank calls it; `world`
/// (the group of all ranks, if several) orders the ranks' writes; `keep` checkpoints are
/// kept, older ones removed.
pub fn save(
    root: &Path,
    engine: &mut Engine,
    optimizer: &mut Optimizer,
    run: &RunInfo,
    world: Option<&dyn ProcessGroup>,
    keep: usize,
) -> Result<PathBuf> {
    let layout = Layout::of(engine);
    save_parts(root, &layout, &mut [Part { engine, optimizer, first_unit: 0 }], run, world, keep)
}

/// [`save`] of a model of `layout` whose units this rank holds in `parts` (a pipeline
/// rank's chunks); `parts` must not be empty.
pub fn save_parts(
    root: &Path,
    layout: &Layout,
    parts: &mut [Part<'_>],
    run: &RunInfo,
    world: Option<&dyn ProcessGroup>,
    keep: usize,
) -> Result<PathBuf> {
    let publisher = world.is_none_or(|g| g.rank() == 0);
    save_into(root, layout, parts, run, world, keep, publisher, RankWrite::Atomic).map(|(dir, ..)| dir)
}

/// Runs `local` on every rank and has them agree that it went well, so that a failure on
/// one rank stops all of them with an error instead of leaving them waiting. `flags`, one
/// per rank of `world`, come back as the maximum over ranks.
fn agree(world: Option<&dyn ProcessGroup>, local: Result<()>, flags: &[f64]) -> Result<Vec<f64>> {
    let Some(g) = world else { return local.map(|()| flags.to_vec()) };
    let mut values = vec![f64::from(u8::from(local.is_err()))];
    values.extend_from_slice(flags);
    let agreed = all_reduce_values(g, &values, ReduceOp::Max)?;
    local?;
    if agreed[0] > 0.0 {
        return Err(Error::Comm("writing the checkpoint failed on another rank".into()));
    }
    Ok(agreed[1..].to_vec())
}

/// The hidden folder a save of `step` is staged in under `root`.
fn staging_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".step-{step:08}.partial"))
}

/// Has `publisher` start step `step`'s staging folder under `root` empty (a crashed
/// attempt may have left files), every rank agreeing before any writes into it.
fn prepare_staging(root: &Path, step: u64, publisher: bool, world: Option<&dyn ProcessGroup>) -> Result<PathBuf> {
    let staging = staging_dir(root, step);
    let local = match publisher {
        true => (|| {
            if staging.exists() {
                std::fs::remove_dir_all(&staging).map_err(|e| Error::io(&staging, e))?;
            }
            std::fs::create_dir_all(&staging).map_err(|e| Error::io(&staging, e))
        })(),
        false => Ok(()),
    };
    agree(world, local, &[])?;
    Ok(staging)
}

/// The description (`meta.json`) of the checkpoint folder `dir`, validated; its files are
/// not opened.
fn read_meta(dir: &Path) -> Result<Meta> {
    let meta_path = dir.join("meta.json");
    let text = std::fs::read(&meta_path).map_err(|e| Error::io(&meta_path, e))?;
    let meta: Meta =
        serde_json::from_slice(&text).map_err(|e| fail(&meta_path, format!("not a checkpoint description ({e})")))?;
    if meta.format != FORMAT {
        return Err(fail(&meta_path, format!("format {:?}, expected {FORMAT:?}", meta.format)));
    }
    meta.validate(&meta_path)?;
    Ok(meta)
}

/// The name of rank `rank`'s file in a checkpoint folder.
fn rank_file(rank: usize) -> String {
    format!("rank{rank}.safetensors")
}

/// How a rank writes its file of a checkpoint.
enum RankWrite<'a> {
    /// A new file, flushed to disk and renamed into place.
    Atomic,
    /// Into this rank's file of the checkpoint folder given, moved into the new checkpoint
    /// and overwritten where it lies (a new file where there is none): snapshots in host
    /// memory, whose previous one nothing may read any more. Values already on the host are
    /// left to be copied in later ([`Deferred`]). The file's map at the previous save, where
    /// kept, serves again.
    Reusing(Option<&'a Path>, Option<MappedFile>),
}

/// Writes this rank's file of a checkpoint under `root`; `publisher` (one rank of those
/// sharing `root`'s file system) describes it and moves it into place once every rank's
/// file is written. Returns the checkpoint's folder and its description.
#[allow(clippy::too_many_arguments)]
fn save_into(
    root: &Path,
    layout: &Layout,
    parts: &mut [Part<'_>],
    run: &RunInfo,
    world: Option<&dyn ProcessGroup>,
    keep: usize,
    publisher: bool,
    write: RankWrite<'_>,
) -> Result<(PathBuf, Meta, Option<Deferred>)> {
    if parts.is_empty() {
        return Err(Error::Engine("a checkpoint of no engine".into()));
    }
    // A delayed host update still running writes the masters and moments saved here.
    for part in parts.iter_mut() {
        part.optimizer.settle(part.engine)?;
    }
    let (rank, ranks) = world.map_or((0, 1), |g| (g.rank(), g.size()));
    let staging = prepare_staging(root, run.step, publisher, world)?;
    let heads = match run.base {
        None => frozen_heads(parts),
        Some(_) => Ok(vec![]),
    };
    let writes = parts[0].engine.held_states().checkpoint_writer();
    let target = staging.join(rank_file(rank));
    let moved = match &write {
        RankWrite::Atomic => Ok(()),
        RankWrite::Reusing(previous, _) => move_previous(previous.map(|d| d.join(rank_file(rank))), &target),
    };
    let written = match (heads, moved) {
        (Ok(heads), Ok(())) if writes => write_rank_file(&target, layout, parts, &heads, write),
        (Ok(_), Ok(_)) => Ok(None),
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    let (written, deferred) = match written {
        Ok(deferred) => (Ok(()), deferred),
        Err(e) => (Err(e), None),
    };
    fault::point("save-written", run.step)?;
    // Which ranks wrote a file: the description lists them, whichever file system each
    // rank's file went to.
    let mut wrote = vec![0.0; ranks];
    wrote[rank] = f64::from(u8::from(writes));
    let wrote = agree(world, written, &wrote)?;
    let files = (0..ranks).filter(|&r| wrote[r] > 0.0).map(rank_file).collect();
    let meta = Meta { files, ..describe(layout, parts, run) };
    let mut published = None;
    agree(
        world,
        match publisher {
            true => publish(root, &staging, &meta, keep).map(|d| published = Some(d)),
            false => Ok(()),
        },
        &[],
    )?;
    // The other ranks learn the folder's name from `latest`, written before the agreement.
    Ok((published.map_or_else(|| latest(root), Ok)?, meta, deferred))
}

/// Whether `name` is a plain name inside a checkpoint folder (no separators, not `..`):
/// what `latest` and `meta.json` name must stay inside the checkpoint.
fn plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\'])
}

/// The folder a run's checkpoint folder `root` names as its newest complete checkpoint
/// (`root/latest`).
pub fn latest(root: &Path) -> Result<PathBuf> {
    let path = root.join("latest");
    let name = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let name = name.trim();
    if !plain_name(name) {
        return Err(fail(&path, format!("names {name:?}, not a checkpoint folder inside {}", root.display())));
    }
    Ok(root.join(name))
}

/// A name for step `step`'s folder that is not taken: `step-NNNNNNNN`, or when that holds an
/// earlier save of the same step, `step-NNNNNNNN.K`.
fn free_step_dir(root: &Path, step: u64) -> PathBuf {
    let mut dir = step_dir(root, step);
    let mut k = 0u64;
    while dir.exists() {
        k += 1;
        dir = root.join(format!("step-{step:08}.{k}"));
    }
    dir
}

/// The publisher's part once every rank file is in `staging`: the description, the move
/// into place under a free name, `latest`, then removal of an earlier save of the same step
/// and pruning. `latest` names a complete folder at every instant: it moves only once the
/// new folder is in place, and the old one goes only after it moved.
fn publish(root: &Path, staging: &Path, meta: &Meta, keep: usize) -> Result<PathBuf> {
    let text = serde_json::to_vec_pretty(meta).map_err(|e| Error::Model(e.to_string()))?;
    io::write_atomic(&staging.join("meta.json"), &text)?;
    fault::point("save-described", meta.step)?;
    let target = free_step_dir(root, meta.step);
    std::fs::rename(staging, &target).map_err(|e| Error::io(&target, e))?;
    io::sync_dir(root)?;
    fault::point("save-published", meta.step)?;
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    io::write_atomic(&root.join("latest"), name.as_bytes())?;
    fault::point("save-pointed", meta.step)?;
    prune(root, keep, &target)?;
    Ok(target)
}

/// Whether two checkpoint folders hold the same step (`step-N` and `step-N.K`).
fn same_step(a: &Path, b: &Path) -> bool {
    let step = |p: &Path| p.file_name().map(|n| n.to_string_lossy().split('.').next().unwrap_or_default().to_string());
    step(a) == step(b)
}

/// Removes all but the newest `keep` complete checkpoints (never `saved`, the one `latest`
/// names), other copies of `saved`'s step, and stale partial ones.
fn prune(root: &Path, keep: usize, saved: &Path) -> Result<()> {
    let mut done = Vec::new();
    for entry in std::fs::read_dir(root).map_err(|e| Error::io(root, e))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !entry.path().is_dir() {
            continue;
        }
        if entry.path() != saved && same_step(&entry.path(), saved) {
            // An earlier save of the same step (or one whose save was cut short).
            std::fs::remove_dir_all(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
        } else if name.starts_with("step-") {
            done.push(entry.path());
        } else if name.starts_with(".step-") && name.ends_with(".partial") {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    done.sort();
    for old in done.iter().rev().skip(keep.max(1)).filter(|p| p.as_path() != saved) {
        std::fs::remove_dir_all(old).map_err(|e| Error::io(old, e))?;
    }
    Ok(())
}

/// This rank's part: for each unit it holds, its range of parameters and of every optimizer
/// state (a stage's copies of other stages' weights left out: their owners save them).
/// Per part, per unit, this rank's piece of the unit's frozen head (master dtype, on the
/// CPU) where it writes them; every rank takes part in the gathers.
fn frozen_heads(parts: &mut [Part<'_>]) -> Result<Vec<Vec<Option<Tensor>>>> {
    let mut heads = Vec::with_capacity(parts.len());
    for part in parts.iter_mut() {
        let engine = &mut *part.engine;
        let writes = engine.held_states().writes_frozen_heads();
        let mut of_part = Vec::new();
        for k in 0..engine.spec().units.len() {
            let head = engine.storage()[k].grad_start;
            if head == 0 {
                of_part.push(None);
                continue;
            }
            let whole = engine.full_unit(k)?;
            let local = engine.split_unit(k, &whole)?;
            of_part.push(writes.then(|| local.f_narrow(0, 0, head)?.f_to_device(tch::Device::Cpu)).transpose()?);
        }
        heads.push(of_part);
    }
    Ok(heads)
}

/// What one tensor of a rank file holds for a unit.
#[derive(Clone, Copy)]
enum Stored<'a> {
    Param,
    FrozenHead,
    State(&'a str),
}

/// Moves the file `previous`, where there is one, to `target` to be written in place.
fn move_previous(previous: Option<PathBuf>, target: &Path) -> Result<()> {
    if let Some(previous) = previous {
        match std::fs::rename(&previous, target) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&previous, e)),
            _ => {}
        }
    }
    Ok(())
}

fn write_rank_file(
    path: &Path,
    whole: &Layout,
    parts: &mut [Part<'_>],
    heads: &[Vec<Option<Tensor>>],
    write: RankWrite<'_>,
) -> Result<Option<Deferred>> {
    let units = whole.unit_numel.len();
    let mut ranges = vec![(0i64, 0i64); units];
    // Which part, and which of its units, holds each unit of the model.
    let mut holder: Vec<(usize, usize)> = vec![(0, 0); units];
    for (i, part) in parts.iter_mut().enumerate() {
        for (k, (start, len)) in part.engine.shard_ranges()?.into_iter().enumerate() {
            let u = part.first_unit + k;
            let numel = *whole.unit_numel.get(u).ok_or_else(|| Error::Engine(format!("unit {u} outside the model")))?;
            let start = start.min(numel);
            ranges[u] = (start, len.min(numel - start));
            holder[u] = (i, k);
        }
    }
    let kind = parts[0].engine.master_kind();
    let names: Vec<String> = state_names(parts[0].optimizer);
    // Owned, so that the parts' engines can be borrowed while writing.
    let states: Vec<Vec<(usize, i64, String, Tensor)>> = parts
        .iter()
        .map(|p| p.optimizer.state().into_iter().map(|(u, o, n, t)| (u, o, n.to_string(), t.shallow_clone())).collect())
        .collect();
    let mut layout = Vec::new();
    let mut jobs: Vec<(usize, Stored)> = Vec::new();
    let head_of = |unit: usize| {
        let (part, local) = holder[unit];
        heads.get(part).and_then(|h| h.get(local)).and_then(Option::as_ref)
    };
    let mut head_lens = vec![0i64; units];
    for (unit, &(_, len)) in ranges.iter().enumerate() {
        if let Some(head) = head_of(unit) {
            head_lens[unit] = head.numel() as i64;
            layout.push((format!("head.{unit}"), kind, vec![head_lens[unit]]));
            jobs.push((unit, Stored::FrozenHead));
        }
        if len == 0 {
            continue;
        }
        layout.push((format!("param.{unit}"), kind, vec![len]));
        jobs.push((unit, Stored::Param));
        for name in &names {
            layout.push((format!("{name}.{unit}"), kind, vec![len]));
            jobs.push((unit, Stored::State(name.as_str())));
        }
    }
    let tensor_rank = parts[0].engine.tensor_parallel().map_or(0, |t| t.rank());
    let expert_rank = parts[0].engine.holding().experts.map_or(0, |(_, rank)| rank);
    let metadata = BTreeMap::from([
        ("ranges".to_string(), serde_json::to_string(&ranges).map_err(|e| Error::Model(e.to_string()))?),
        ("tensor_rank".to_string(), tensor_rank.to_string()),
        ("expert_rank".to_string(), expert_rank.to_string()),
        ("heads".to_string(), serde_json::to_string(&head_lens).map_err(|e| Error::Model(e.to_string()))?),
    ]);
    let value = |i: usize| {
        let (unit, what) = jobs[i];
        let (start, len) = ranges[unit];
        let (part, local) = holder[unit];
        match what {
            Stored::Param => Ok(parts[part].engine.local_params(local)?.f_narrow(0, 0, len)?.f_to_kind(kind)?),
            Stored::FrozenHead => {
                Ok(head_of(unit).ok_or_else(|| Error::Engine("a frozen head not gathered".into()))?.f_to_kind(kind)?)
            }
            Stored::State(name) => {
                let pieces: Vec<(i64, &Tensor)> = states[part]
                    .iter()
                    .filter(|(u, _, n, _)| *u == local && n == name)
                    .map(|(_, offset, _, t)| (*offset, t))
                    .collect();
                // The common case, one state tensor over the whole range, is written from
                // where it lies.
                if let [(offset, t)] = pieces[..] {
                    if offset <= start && offset + t.numel() as i64 >= start + len {
                        return Ok(t.f_narrow(0, start - offset, len)?.f_to_kind(kind)?);
                    }
                }
                // Frozen parameters and padding have no state: zeros.
                let out = Tensor::f_zeros([len], (kind, tch::Device::Cpu))?;
                for (offset, t) in pieces {
                    let (lo, hi) = (offset.max(start), (offset + t.numel() as i64).min(start + len));
                    if lo < hi {
                        out.f_narrow(0, lo - start, hi - lo)?.f_copy_(&t.f_narrow(0, lo - offset, hi - lo)?)?;
                    }
                }
                Ok(out)
            }
        }
    };
    // A file written in place is a snapshot in host memory: what lies on the host already
    // is left to its writer ([`Deferred`]).
    match write {
        RankWrite::Reusing(_, kept) => {
            write_safetensors_deferring(path, &layout, &metadata, kept, value).map(Some).map_err(where_snapshots_go)
        }
        RankWrite::Atomic => write_safetensors_streamed(path, &layout, &metadata, value).map(|()| None),
    }
}

/// A snapshot's write error (a folder without room among them) with where snapshots can go.
pub(super) fn where_snapshots_go(e: Error) -> Error {
    match e {
        Error::Checkpoint(m) => {
            Error::Checkpoint(format!("{m} (host-memory snapshots: STRATA_SNAPSHOT_DIR names a folder with more room)"))
        }
        other => other,
    }
}

/// One stored range of a unit's flat layout (of one tensor rank's pieces): `tensor` in
/// `file` covers `start..start+len`.
struct Piece {
    file: usize,
    tensor: String,
    start: i64,
    len: i64,
}

/// A checkpoint opened for reading: its description and where every range lives.
pub struct Checkpoint {
    /// The checkpoint's description.
    pub meta: Meta,
    /// The checkpoint's folder, or the merged file.
    pub location: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    /// By (what, tensor rank, expert rank, unit): "param" or a state name.
    pieces: BTreeMap<(String, usize, usize, usize), Vec<Piece>>,
    /// Whole units joined from tensor ranks' pieces, for the unit read last.
    joined: std::cell::RefCell<BTreeMap<(String, usize), Tensor>>,
    /// Units whose frozen head is stored.
    heads: std::collections::BTreeSet<usize>,
}

fn fail(path: &Path, message: impl Into<String>) -> Error {
    Error::Checkpoint(format!("{}: {}", path.display(), message.into()))
}

impl Meta {
    /// Checks that the description is self-consistent before anything is read or allocated
    /// from it: every parameter lies inside its unit's layout, sizes do not overflow, the fp8
    /// states (if any) are one per unit, the optimizer has not stepped more than the run.
    fn validate(&self, at: &Path) -> Result<()> {
        let bad = |m: String| Err(fail(at, format!("inconsistent checkpoint description: {m}")));
        if let Some(n) = self.unit_numel.iter().find(|&&n| n < 0) {
            return bad(format!("a unit of {n} elements"));
        }
        if self.tensor_size == 0 || i64::try_from(self.tensor_size).is_err() {
            return bad(format!("{} tensor ranks", self.tensor_size));
        }
        if self.expert_size == 0 || i64::try_from(self.expert_size).is_err() {
            return bad(format!("{} expert ranks", self.expert_size));
        }
        if let Some(p) = self
            .params
            .iter()
            .find(|p| p.expert.is_some_and(|s| s.index < 0 || s.index >= s.of || s.of % self.expert_size as i64 != 0))
        {
            return bad(format!("{} is expert {:?}, stored over {} expert ranks", p.name, p.expert, self.expert_size));
        }
        let mut ends = vec![0i64; self.unit_numel.len()];
        for p in &self.params {
            let numel = p.shape.iter().try_fold(1i64, |acc, &d| if d < 0 { None } else { acc.checked_mul(d) });
            let end = numel.and_then(|n| p.offset.checked_add(n)).filter(|_| p.offset >= 0);
            match (end, self.unit_numel.get(p.unit)) {
                (Some(end), Some(&unit_numel)) if end <= unit_numel => ends[p.unit] = ends[p.unit].max(end),
                (_, None) => {
                    return bad(format!("{} is in unit {}, of {} units", p.name, p.unit, self.unit_numel.len()))
                }
                _ => return bad(format!("{} {:?} at {} lies outside its unit", p.name, p.shape, p.offset)),
            }
        }
        if let Some(k) = (0..ends.len()).find(|&k| ends[k] != self.unit_numel[k]) {
            return bad(format!("unit {k} holds {} elements, its parameters end at {}", self.unit_numel[k], ends[k]));
        }
        if self.tensor_size > 1 {
            let size = self.tensor_size as i64;
            for p in &self.params {
                match p.tp {
                    None => return bad(format!("{} has no tensor-parallel split, the units have {size}", p.name)),
                    Some(role) => {
                        if let Err(e) = role.check(&p.name, &p.shape, size) {
                            return bad(e.to_string());
                        }
                    }
                }
            }
        }
        if !self.fp8.is_empty() && self.fp8.len() != self.unit_numel.len() {
            return bad(format!("{} fp8 states for {} units", self.fp8.len(), self.unit_numel.len()));
        }
        if let Some(name) = self.files.iter().find(|f| !plain_name(f)) {
            return bad(format!("rank file {name:?} lies outside the checkpoint"));
        }
        if let Some(s) = self.fp8.iter().flatten().find(|s| s.steps > self.step) {
            return bad(format!("fp8 state of {} steps in {} training steps", s.steps, self.step));
        }
        if let Some(why) = self.fp8.iter().flatten().find_map(|s| s.check().err()) {
            return bad(why);
        }
        if let Some(Err(e)) = self.loss_scaler.as_ref().map(LossScaler::check) {
            return bad(e.to_string());
        }
        if self.optimizer_steps.is_some_and(|s| s > self.step) {
            return bad(format!("{:?} optimizer steps in {} training steps", self.optimizer_steps, self.step));
        }
        Ok(())
    }

    /// Elements of each unit's layout on one tensor rank of expert rank `expert_rank`.
    /// Saturating: overlapping parameters of a damaged description may sum past any size,
    /// which no rank file then matches.
    fn local_unit_numel(&self, expert_rank: usize) -> Vec<i64> {
        let mut numel = vec![0i64; self.unit_numel.len()];
        for p in &self.params {
            let n = p.local_numel(self.tensor_size as i64, (self.expert_size, expert_rank));
            numel[p.unit] = numel[p.unit].saturating_add(n);
        }
        numel
    }
}

fn map(path: &Path) -> Result<Mmap> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: checkpoint files are written once, atomically, and never modified in place.
    unsafe { Mmap::map(&f) }.map_err(|e| Error::io(path, e))
}

impl Checkpoint {
    /// Opens a checkpoint: a run's checkpoint folder (its `latest`), one `step-…` folder,
    /// or a merged `.safetensors` file. Every file is validated here.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        if path.is_file() {
            return Checkpoint::open_merged(path);
        }
        let dir = if path.join("latest").is_file() { latest(path)? } else { path.to_path_buf() };
        let meta = read_meta(&dir)?;
        let mut files = Vec::new();
        let mut pieces: BTreeMap<(String, usize, usize, usize), Vec<Piece>> = BTreeMap::new();
        let mut heads = std::collections::BTreeSet::new();
        for name in &meta.files {
            let file_path = dir.join(name);
            if !file_path.is_file() {
                return Err(fail(&file_path, "missing: the checkpoint lists this rank's file but it does not exist"));
            }
            let mmap = map(&file_path)?;
            let (_, header) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| fail(&file_path, format!("damaged or truncated shard ({e})")))?;
            SafeTensors::deserialize(&mmap)
                .map_err(|e| fail(&file_path, format!("damaged or truncated shard ({e})")))?;
            let ranges: Vec<(i64, i64)> = header
                .metadata()
                .as_ref()
                .and_then(|m| m.get("ranges"))
                .and_then(|r| serde_json::from_str(r).ok())
                .ok_or_else(|| fail(&file_path, "no shard ranges in its metadata"))?;
            let tensor_rank = match header.metadata().as_ref().and_then(|m| m.get("tensor_rank")) {
                None => 0,
                Some(r) => r.parse::<usize>().ok().filter(|&r| r < meta.tensor_size).ok_or_else(|| {
                    fail(&file_path, format!("tensor rank {r:?} of a tensor size {}", meta.tensor_size))
                })?,
            };
            let expert_rank = match header.metadata().as_ref().and_then(|m| m.get("expert_rank")) {
                None => 0,
                Some(r) => r.parse::<usize>().ok().filter(|&r| r < meta.expert_size).ok_or_else(|| {
                    fail(&file_path, format!("expert rank {r:?} of an expert size {}", meta.expert_size))
                })?,
            };
            let local_numel = meta.local_unit_numel(expert_rank);
            let outside = |(unit, &(start, len)): (usize, &(i64, i64))| {
                start < 0 || len < 0 || local_numel.get(unit).is_none_or(|&n| start.saturating_add(len) > n)
            };
            if ranges.iter().enumerate().any(outside) {
                return Err(fail(&file_path, "shard ranges outside the units the checkpoint describes"));
            }
            let head_lens: Vec<i64> = match header.metadata().as_ref().and_then(|m| m.get("heads")) {
                None => vec![],
                Some(h) => serde_json::from_str(h).map_err(|_| fail(&file_path, "unreadable frozen heads"))?,
            };
            let index = files.len();
            for (unit, &len) in head_lens.iter().enumerate().filter(|(_, &len)| len != 0) {
                if len < 0 || local_numel.get(unit).is_none_or(|&n| len > n) {
                    return Err(fail(&file_path, "a frozen head outside the units the checkpoint describes"));
                }
                let piece = Piece { file: index, tensor: format!("head.{unit}"), start: 0, len };
                pieces.entry(("param".to_string(), tensor_rank, expert_rank, unit)).or_default().push(piece);
                heads.insert(unit);
            }
            for (unit, &(start, len)) in ranges.iter().enumerate().filter(|(_, r)| r.1 > 0) {
                for what in std::iter::once("param".to_string()).chain(meta.state_names.iter().cloned()) {
                    let tensor = format!("{what}.{unit}");
                    let piece = Piece { file: index, tensor, start, len };
                    pieces.entry((what, tensor_rank, expert_rank, unit)).or_default().push(piece);
                }
            }
            files.push((file_path, mmap));
        }
        Ok(Checkpoint { meta, location: dir, files, pieces, joined: Default::default(), heads })
    }

    fn open_merged(path: &Path) -> Result<Checkpoint> {
        let mmap = map(path)?;
        let (_, header) =
            SafeTensors::read_metadata(&mmap).map_err(|e| fail(path, format!("not a valid safetensors file ({e})")))?;
        SafeTensors::deserialize(&mmap).map_err(|e| fail(path, format!("damaged or truncated ({e})")))?;
        let meta: Meta = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(MERGED_KEY))
            .ok_or_else(|| fail(path, "a weights file, not a merged checkpoint (no checkpoint description)"))
            .and_then(|t| {
                serde_json::from_str(t).map_err(|e| fail(path, format!("bad checkpoint description ({e})")))
            })?;
        if meta.tensor_size != 1 || meta.expert_size != 1 {
            return Err(fail(path, "a merged checkpoint holds whole tensors: its tensor and expert sizes must be 1"));
        }
        meta.validate(path)?;
        let mut pieces: BTreeMap<(String, usize, usize, usize), Vec<Piece>> = BTreeMap::new();
        let mut heads = std::collections::BTreeSet::new();
        let stored: std::collections::BTreeSet<String> = header.tensors().into_keys().collect();
        for p in &meta.params {
            let len = p.shape.iter().product();
            let mut add = |what: String, tensor: String| {
                pieces.entry((what, 0, 0, p.unit)).or_default().push(Piece { file: 0, tensor, start: p.offset, len });
            };
            match (p.frozen, stored.contains(&p.name)) {
                (true, true) => heads.insert(p.unit),
                (true, false) => continue,
                (false, _) => false,
            };
            add("param".into(), p.name.clone());
            if !p.frozen {
                for s in &meta.state_names {
                    add(s.clone(), format!("optim.{s}.{}", p.name));
                }
            }
        }
        let files = vec![(path.to_path_buf(), mmap)];
        Ok(Checkpoint { meta, location: path.to_path_buf(), files, pieces, joined: Default::default(), heads })
    }

    /// Elements `start..start+len` of `what` ("param" or a state) of `unit`'s whole layout,
    /// in `kind` on the CPU, joined from the tensor ranks' pieces where the units were split
    /// and from the expert ranks' where they stored their experts apart.
    fn read_range(&self, what: &str, unit: usize, start: i64, len: i64, kind: Kind) -> Result<Tensor> {
        if self.meta.tensor_size == 1 && self.meta.expert_size == 1 {
            return self.read_pieces(what, (0, 0), unit, start, len, kind);
        }
        let key = (what.to_string(), unit);
        let mut joined = self.joined.borrow_mut();
        joined.retain(|(_, u), _| *u == unit);
        if !joined.contains_key(&key) {
            let whole = self.join_unit(what, unit)?;
            joined.insert(key.clone(), whole);
        }
        let held = self.held_start(what, unit);
        if start < held {
            return Err(fail(
                &self.location,
                format!("{what} of unit {unit}: elements from {start} on are not stored"),
            ));
        }
        Ok(joined[&key].f_narrow(0, start - held, len)?.f_to_kind(kind)?)
    }

    /// Whether `what` of parameter `p` is stored: states and parameters outside frozen
    /// heads always, a frozen head's parameters where the head is.
    fn stores(&self, what: &str, p: &ParamEntry) -> bool {
        !p.frozen || (what == "param" && self.heads.contains(&p.unit))
    }

    /// Whether the checkpoint holds every parameter (the frozen base too).
    pub fn holds_every_parameter(&self) -> bool {
        self.meta.params.iter().all(|p| self.stores("param", p))
    }

    /// Where the stored part of `what` of unit `unit`'s whole layout begins.
    fn held_start(&self, what: &str, unit: usize) -> i64 {
        let held = self.meta.params.iter().filter(|p| p.unit == unit && self.stores(what, p));
        held.map(|p| p.offset).min().unwrap_or(self.meta.unit_numel[unit])
    }

    /// `what` of unit `unit` from [`Checkpoint::held_start`] on, whole: each stored
    /// parameter's pieces from every tensor rank joined, each routed expert's from the
    /// expert rank that stored it.
    fn join_unit(&self, what: &str, unit: usize) -> Result<Tensor> {
        let (size, experts) = (self.meta.tensor_size, self.meta.expert_size);
        let mut params: Vec<&ParamEntry> = self.meta.params.iter().filter(|p| p.unit == unit).collect();
        params.sort_by_key(|p| p.offset);
        // Per (tensor rank, expert rank), each stored parameter's piece (empty where the
        // expert rank stored none of it).
        let pieces_of_rank = |rank: usize, expert_rank: usize| -> Result<Vec<Tensor>> {
            let local = |p: &ParamEntry| p.local_numel(size as i64, (experts, expert_rank));
            let head: i64 = params.iter().filter(|p| !self.stores(what, p)).map(|p| local(p)).sum();
            let stored = params.iter().filter(|p| self.stores(what, p));
            let numel: i64 = stored.clone().map(|p| local(p)).sum();
            let flat = self.read_pieces(what, (rank, expert_rank), unit, head, numel, Kind::Float)?;
            let mut start = 0;
            stored
                .map(|p| {
                    let n = local(p);
                    start += n;
                    Ok(flat.f_narrow(0, start - n, n)?)
                })
                .collect()
        };
        let by_rank = (0..experts)
            .map(|e| (0..size).map(|t| pieces_of_rank(t, e)).collect::<Result<Vec<_>>>())
            .collect::<Result<Vec<_>>>()?;
        params.retain(|p| self.stores(what, p));
        let mut whole = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let role = p.tp.unwrap_or(TpRole::Replicated);
            let local = role.local_shape(&p.shape, size as i64);
            let owner = p.expert.map_or(0, |slot| slot.owner(experts as i64) as usize);
            let pieces = by_rank[owner]
                .iter()
                .map(|r| r[i].f_view(local.as_slice()))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            whole.push(role.unshard(&pieces, &p.shape)?.f_reshape([-1])?);
        }
        Ok(Tensor::f_cat(&whole, 0)?)
    }

    /// Elements `start..start+len` of `what` of `unit` in the layout of (tensor rank, expert
    /// rank) `ranks`, as `kind` on the CPU; fails if the checkpoint's files do not cover them.
    fn read_pieces(
        &self,
        what: &str,
        (tensor_rank, expert_rank): (usize, usize),
        unit: usize,
        start: i64,
        len: i64,
        kind: Kind,
    ) -> Result<Tensor> {
        let out = Tensor::f_zeros([len], (kind, tch::Device::Cpu))?;
        // Replicated units are stored by several ranks: coverage is the union of the pieces.
        let mut spans: Vec<(i64, i64)> = Vec::new();
        for piece in self.pieces.get(&(what.to_string(), tensor_rank, expert_rank, unit)).into_iter().flatten() {
            let (lo, hi) = (start.max(piece.start), (start + len).min(piece.start + piece.len));
            if lo >= hi {
                continue;
            }
            let (path, mmap) = &self.files[piece.file];
            let st = SafeTensors::deserialize(mmap).map_err(|e| fail(path, e.to_string()))?;
            let view =
                st.tensor(&piece.tensor).map_err(|_| fail(path, format!("tensor {:?} is missing", piece.tensor)))?;
            let kind_in = io::kind_of(view.dtype()).ok_or_else(|| fail(path, "unsupported dtype"))?;
            let stored = Tensor::f_from_data_size(
                view.data(),
                &[view.data().len() as i64 / kind_in.elt_size_in_bytes() as i64],
                kind_in,
            )?;
            if stored.numel() as i64 != piece.len {
                return Err(fail(
                    path,
                    format!("{} holds {} elements, expected {}", piece.tensor, stored.numel(), piece.len),
                ));
            }
            out.f_narrow(0, lo - start, hi - lo)?.f_copy_(&stored.f_narrow(0, lo - piece.start, hi - lo)?)?;
            spans.push((lo, hi));
        }
        spans.sort_unstable();
        let (mut covered, mut reach) = (0, start);
        for (lo, hi) in spans {
            covered += (hi - lo.max(reach)).max(0);
            reach = reach.max(hi);
        }
        if covered != len {
            return Err(fail(
                &self.location,
                format!(
                    "{what} of unit {unit}: elements {start}..{} are not all stored (a rank's file is missing?)",
                    start + len
                ),
            ));
        }
        Ok(out)
    }

    /// Fails unless the checkpoint is of a model of `layout`, with `optimizer`'s kind.
    fn check_layout(&self, layout: &Layout, optimizer: &Optimizer, optimizer_name: &str) -> Result<()> {
        self.check_model(layout)?;
        let states = state_names(optimizer);
        if self.meta.optimizer != optimizer_name || self.meta.state_names != states {
            return Err(fail(
                &self.location,
                format!(
                    "saved with optimizer {} (states {:?}), this run uses {optimizer_name} (states {states:?})",
                    self.meta.optimizer, self.meta.state_names
                ),
            ));
        }
        Ok(())
    }

    /// Fails unless the checkpoint is of a model of `layout`.
    fn check_model(&self, layout: &Layout) -> Result<()> {
        let params = layout.params.clone();
        // Checkpoints that predate splits do not record them: splits are the model's own.
        let params: Vec<ParamEntry> = params
            .into_iter()
            .enumerate()
            .map(|(i, p)| match self.meta.params.get(i) {
                // What the checkpoint stores is its own: a run may train more or less of it.
                Some(saved) => ParamEntry { tp: saved.tp, frozen: saved.frozen, expert: saved.expert, ..p },
                None => p,
            })
            .collect();
        let err = |m: String| Err(fail(&self.location, m));
        if params.len() != self.meta.params.len() {
            return err(format!(
                "a checkpoint of another model: it has {} parameters, this model {}",
                self.meta.params.len(),
                params.len()
            ));
        }
        for (a, b) in params.iter().zip(&self.meta.params) {
            if a != b {
                return err(format!(
                    "a checkpoint of another model: it holds {} {:?} where this model has {} {:?}",
                    b.name, b.shape, a.name, a.shape
                ));
            }
        }
        let unit_numel = &layout.unit_numel;
        if self.meta.unit_numel != *unit_numel {
            return err(format!(
                "a checkpoint of another layout: units of {:?} elements, this model {unit_numel:?}",
                self.meta.unit_numel
            ));
        }
        Ok(())
    }

    /// Loads the parameters alone (evaluation, generation) into `engine`, of any strategy.
    pub fn restore_weights(&self, engine: &mut Engine) -> Result<()> {
        self.check_model(&Layout::of(engine))?;
        for k in 0..engine.spec().units.len() {
            let full = self.unit_params(engine, 0, k)?;
            engine.set_full_unit(k, &full)?;
        }
        Ok(())
    }

    /// Loads parameters and optimizer state into a run of any world size and strategy.
    pub fn restore(&self, engine: &mut Engine, optimizer: &mut Optimizer, optimizer_name: &str) -> Result<()> {
        let layout = Layout::of(engine);
        self.restore_parts(&layout, &mut [Part { engine, optimizer, first_unit: 0 }], optimizer_name)
    }

    /// [`Checkpoint::restore`] into the `parts` of a model of `layout` this rank holds (a
    /// pipeline rank's chunks).
    pub fn restore_parts(&self, layout: &Layout, parts: &mut [Part<'_>], optimizer_name: &str) -> Result<()> {
        // Nothing may overwrite what is restored here.
        for part in parts.iter_mut() {
            part.optimizer.settle(part.engine)?;
        }
        let Some(first) = parts.first() else { return Err(Error::Engine("a restore into no engine".into())) };
        self.check_layout(layout, first.optimizer, optimizer_name)?;
        for part in parts.iter_mut() {
            self.restore_part(part)?;
        }
        Ok(())
    }

    /// Unit `k` of `engine` (unit `first + k` of the model) in the engine's whole layout: the
    /// unit's own values, then those of other stages' weights it holds copies of. Parameters
    /// the checkpoint does not store take their values from `unstored` (the engine's whole
    /// unit as it stands), or zeros (optimizer states).
    fn unit_values(
        &self,
        engine: &Engine,
        (first, k): (usize, usize),
        what: &str,
        kind: Kind,
        unstored: Option<&Tensor>,
    ) -> Result<Tensor> {
        let u = first + k;
        let spec = engine.spec();
        let ids = &spec.units[k].params;
        if ids.iter().all(|id| self.stores(what, &self.meta.params[id.0])) {
            let mut pieces = vec![self.read_range(what, u, 0, self.meta.unit_numel[u], kind)?];
            for id in ids.iter().filter(|id| spec.copies.contains(id)) {
                let owner = &self.meta.params[id.0];
                pieces.push(self.read_range(what, owner.unit, owner.offset, owner.shape.iter().product(), kind)?);
            }
            return Ok(if pieces.len() == 1 { pieces.remove(0) } else { Tensor::f_cat(&pieces, 0)? });
        }
        let pieces = ids
            .iter()
            .map(|&id| {
                let entry = &self.meta.params[id.0];
                let numel = entry.shape.iter().product();
                match (!self.stores(what, entry), unstored) {
                    (false, _) => self.read_range(what, entry.unit, entry.offset, numel, kind),
                    (true, Some(values)) => Ok(values.f_narrow(0, engine.full_offset(id), numel)?.f_to_kind(kind)?),
                    (true, None) => Ok(Tensor::f_zeros([numel], (kind, tch::Device::Cpu))?),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::f_cat(&pieces, 0)?)
    }

    /// Unit `k` of `engine`'s parameters from the checkpoint, the unstored ones as they stand.
    fn unit_params(&self, engine: &mut Engine, first: usize, k: usize) -> Result<Tensor> {
        let some_unstored =
            engine.spec().units[k].params.iter().any(|id| !self.stores("param", &self.meta.params[id.0]));
        let unstored = match some_unstored {
            true => Some(engine.full_unit(k)?.f_to_device(tch::Device::Cpu)?),
            false => None,
        };
        self.unit_values(engine, (first, k), "param", engine.master_kind(), unstored.as_ref())
    }

    fn restore_part(&self, part: &mut Part<'_>) -> Result<()> {
        let (first, engine) = (part.first_unit, &mut *part.engine);
        for k in 0..engine.spec().units.len() {
            let full = self.unit_params(engine, first, k)?;
            engine.set_full_unit(k, &full)?;
        }
        for (k, state) in engine.fp8_states().iter().enumerate() {
            if let (Some(state), Some(Some(saved))) = (state, self.meta.fp8.get(first + k)) {
                state.lock().map_err(|e| Error::Engine(e.to_string()))?.restore(saved);
            }
        }
        // Optimizer states sit at offsets of this rank's layout: where that is not the whole
        // model's (split units, a pipeline stage), whole units are read and split for it (one
        // unit's at a time).
        let split = engine.tensor_parallel().is_some()
            || engine.holding().experts.is_some()
            || self.meta.tensor_size > 1
            || self.meta.expert_size > 1
            || first > 0
            || engine.spec().units.len() != self.meta.unit_numel.len();
        let engine = &*engine;
        let mut local: BTreeMap<(usize, String), Tensor> = BTreeMap::new();
        part.optimizer.load_state(self.meta.optimizer_steps.unwrap_or(self.meta.step), |unit, offset, name, dest| {
            let values = if split {
                local.retain(|(u, _), _| *u == unit);
                let key = (unit, name.to_string());
                if !local.contains_key(&key) {
                    let whole = self.unit_values(engine, (first, unit), name, dest.kind(), None)?;
                    local.insert(key.clone(), engine.split_unit(unit, &whole)?);
                }
                local[&key].f_narrow(0, offset, dest.numel() as i64)?
            } else {
                self.read_range(name, unit, offset, dest.numel() as i64, dest.kind())?
            };
            tch::no_grad(|| dest.shallow_clone().f_copy_(&values))?;
            Ok(())
        })
    }

    /// Writes the whole checkpoint as one safetensors file: parameters under their names
    /// (loadable as weights by PyTorch) and optimizer states as `optim.<state>.<name>`,
    /// with the description in the file's metadata. One parameter is in memory at a time.
    pub fn merge(&self, out: &Path) -> Result<()> {
        let mut layout = Vec::new();
        let mut jobs = Vec::new();
        for p in self.meta.params.iter().filter(|p| self.stores("param", p)) {
            layout.push((p.name.clone(), Kind::Float, p.shape.clone()));
            jobs.push(("param".to_string(), p));
            for s in self.meta.state_names.iter().filter(|_| !p.frozen) {
                layout.push((format!("optim.{s}.{}", p.name), Kind::Float, p.shape.clone()));
                jobs.push((s.clone(), p));
            }
        }
        let meta = Meta { files: vec![], tensor_size: 1, expert_size: 1, ..self.meta.clone() };
        let metadata = BTreeMap::from([
            ("format".to_string(), "pt".to_string()),
            (MERGED_KEY.to_string(), serde_json::to_string(&meta).map_err(|e| Error::Model(e.to_string()))?),
        ]);
        write_safetensors_streamed(out, &layout, &metadata, |i| {
            let (what, p) = &jobs[i];
            self.read_range(what, p.unit, p.offset, p.shape.iter().product(), Kind::Float)
        })
    }
}
