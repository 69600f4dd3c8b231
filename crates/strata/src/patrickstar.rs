//! PatrickStar's face: `initialize_engine(model_func, local_rank, config)` with PatrickStar's
//! JSON configuration, returning a model engine and an optimizer driven by its loop
//! (`optimizer.zero_grad(); let loss = model.forward(&batch)?; model.backward(&loss)?;
//! optimizer.step()?`), per-rank state dictionaries, and Strata's checkpoints, synchronous
//! or persisted in the background ([`PatrickStarCheckpoints`]).
//!
//! Owns: the configuration's keys and their translation into a Strata strategy and
//! optimizer. Must not place or move anything itself: the `offload` method (one process)
//! or fsdp with its shards on the host (several ranks) does, through `parallel`.
use crate::checkpoint::snapshot::{self, AsyncSaver, Persisted, SaveTimes};
use crate::checkpoint::{self, DataPosition, Layout, Part, RunInfo};
use crate::comm::{Comm, ProcessGroup};
use crate::compute::scaler::LossScalerConfig;
use crate::data::{Batch, Step};
use crate::engine::{Engine, EngineConfig};
use crate::model::ModelSpec;
use crate::optim::{Optimizer, OptimizerConfig, OptimizerKind};
use crate::parallel::{build_engine, RankLayout};
use crate::strategy::{AmpConfig, Method, OffloadConfig, ShardConfig, Strategy};
use crate::train::{next_token_loss_of, Feed, GradScaling, HostUpdating, LossFn};
use crate::{Error, Result};
use serde::Deserialize;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;
use tch::{Device, Tensor};

/// PatrickStar's configuration, in its keys and with its defaults.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PatrickStarConfig {
    /// The `optimizer` section (Adam with PatrickStar's defaults where absent).
    pub optimizer: OptimizerSection,
    /// Loss scaling; absent: none.
    pub fp16: Option<Fp16Section>,
    /// Elements per PatrickStar chunk. Strata manages memory by units' flat buffers instead;
    /// the size must still hold the largest parameter, as PatrickStar requires.
    pub default_chunk_size: u64,
    /// Several ranks: keep every unit's whole parameters until initialisation ends, then
    /// release the parts other ranks own (true), or release each unit's as soon as it is
    /// initialised (false, what fsdp does). One process has no remote parts.
    pub release_after_init: bool,
    /// The embedding units' states live on the host and are updated there; in one process
    /// an untied embedding computes there too (`offload`'s `host_units`).
    pub use_cpu_embedding: bool,
}

impl Default for PatrickStarConfig {
    fn default() -> Self {
        PatrickStarConfig {
            optimizer: OptimizerSection::default(),
            fp16: None,
            default_chunk_size: 64 * 1024 * 1024,
            release_after_init: false,
            use_cpu_embedding: true,
        }
    }
}

/// The `optimizer` section: Adam's kind and hyper-parameters.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerSection {
    /// `Adam` or `AdamW`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The optimizer's hyper-parameters.
    pub params: AdamParams,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        OptimizerSection { kind: "Adam".into(), params: AdamParams::default() }
    }
}

/// The optimizer's `params`, with PatrickStar's defaults.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamParams {
    /// Learning rate; 1e-3 by default.
    pub lr: f64,
    /// Decay rates of the running averages of the gradient and of its square; (0.9, 0.999) by default.
    pub betas: (f64, f64),
    /// Term added to the denominator for stability; 1e-8 by default.
    pub eps: f64,
    /// Weight decay; 0 by default.
    pub weight_decay: f64,
    /// Update each unit's states where they live (device or host); false: every update on
    /// the host.
    pub use_hybrid_adam: bool,
}

impl Default for AdamParams {
    fn default() -> Self {
        AdamParams { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, use_hybrid_adam: true }
    }
}

/// The `fp16` section: fp16 computation with a loss scaler.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp16Section {
    /// Must be true; a configuration without fp16 leaves the section out.
    pub enabled: bool,
    /// 0 for a dynamic scale; any other value is a static scale (no overflow check).
    #[serde(default)]
    pub loss_scale: f64,
    /// A dynamic scale starts at 2^this.
    #[serde(default = "initial_scale_power")]
    pub initial_scale_power: u32,
    /// Steps without overflow before the scale doubles.
    #[serde(default = "loss_scale_window")]
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale halves.
    #[serde(default = "hysteresis")]
    pub hysteresis: u32,
    /// The floor a dynamic scale never halves below.
    #[serde(default = "min_loss_scale")]
    pub min_loss_scale: f64,
}

fn initial_scale_power() -> u32 {
    LossScalerConfig::default().initial_scale_power
}
fn loss_scale_window() -> u64 {
    LossScalerConfig::default().loss_scale_window
}
fn hysteresis() -> u32 {
    LossScalerConfig::default().hysteresis
}
fn min_loss_scale() -> f64 {
    LossScalerConfig::default().min_loss_scale
}

impl PatrickStarConfig {
    /// Parses the configuration from JSON text (a file's contents), naming a bad key or
    /// value in one line.
    pub fn parse(text: &str) -> Result<PatrickStarConfig> {
        // Errors name the key they are about (`optimizer.params.lr: invalid type ...`).
        let config: PatrickStarConfig = serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
            .map_err(|e| Error::Config(format!("PatrickStar config: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    /// Reads and parses the configuration file at `path`.
    pub fn from_file(path: &std::path::Path) -> Result<PatrickStarConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("cannot read PatrickStar config {}: {e}", path.display())))?;
        PatrickStarConfig::parse(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    fn validate(&self) -> Result<()> {
        self.optimizer_config()?.validate()?;
        if let Some(fp16) = &self.fp16 {
            if !fp16.enabled {
                return Err(Error::Config(
                    "PatrickStar config: fp16.enabled must be true; drop the section for fp32".into(),
                ));
            }
            self.loss_scaler().into_iter().try_for_each(|c| c.validate())?;
        }
        if self.default_chunk_size == 0 {
            return Err(Error::Config("PatrickStar config: default_chunk_size must be positive".into()));
        }
        Ok(())
    }

    /// The optimizer the configuration asks for.
    pub fn optimizer_config(&self) -> Result<OptimizerConfig> {
        let kind = match self.optimizer.kind.as_str() {
            "Adam" => OptimizerKind::Adam,
            "AdamW" => OptimizerKind::AdamW,
            other => {
                return Err(Error::Config(format!(
                    "PatrickStar config: optimizer type {other:?}; expected Adam or AdamW"
                )))
            }
        };
        let p = &self.optimizer.params;
        Ok(OptimizerConfig {
            kind,
            lr: p.lr,
            betas: p.betas,
            eps: p.eps,
            weight_decay: p.weight_decay,
            ..OptimizerConfig::default()
        })
    }

    fn loss_scaler(&self) -> Option<LossScalerConfig> {
        self.fp16.as_ref().map(|f| LossScalerConfig {
            loss_scale: f.loss_scale,
            initial_scale_power: f.initial_scale_power,
            loss_scale_window: f.loss_scale_window,
            hysteresis: f.hysteresis,
            min_loss_scale: f.min_loss_scale,
        })
    }

    /// The Strata strategy for `spec` over `world` ranks: fp16 autocast with the loss
    /// scaler (`fp16`); in one process `offload`, planned against the budgets (`auto`) with
    /// the hybrid Adam, or every state on the host without it; over several ranks fsdp with
    /// every shard on the host (each rank holds 1/N of the model, as PatrickStar's chunks).
    pub fn strategy(&self, spec: &ModelSpec, world: usize) -> Result<Strategy> {
        let largest = spec.params.iter().map(|p| p.numel() as u64).max().unwrap_or(0);
        if largest > self.default_chunk_size {
            return Err(Error::Config(format!(
                "PatrickStar config: default_chunk_size {} is smaller than the largest parameter ({largest} elements)",
                self.default_chunk_size
            )));
        }
        let mut methods = vec![];
        if let Some(scaler) = self.loss_scaler() {
            methods.push(Method::AmpNative(AmpConfig { loss_scaler: Some(scaler), ..AmpConfig::default() }));
        }
        // The units that declare they look their weights up.
        let embeddings = spec.units.iter().filter(|u| u.looks_up()).map(|u| u.name.clone());
        let host_units = if self.use_cpu_embedding { embeddings.collect() } else { vec![] };
        let hybrid = OffloadConfig { host_units, ..OffloadConfig::default() };
        if world > 1 {
            methods
                .push(Method::Fsdp(ShardConfig { release_after_init: self.release_after_init, ..Default::default() }));
            methods.push(Method::Offload(hybrid.everything_on_host()));
        } else if self.optimizer.params.use_hybrid_adam {
            methods.push(Method::Offload(hybrid));
        } else {
            methods.push(Method::Offload(hybrid.everything_on_host()));
        }
        Ok(Strategy { methods })
    }
}

/// What the model engine and its optimizer share.
struct Session {
    engine: Engine,
    optimizer: Optimizer,
    scaling: GradScaling,
    loss: LossFn,
    /// The job's ranks, when there are several (joined from the launcher's environment).
    comm: Option<Comm>,
    /// Their group, made once (every rank makes it at initialisation).
    world: Option<Box<dyn ProcessGroup>>,
    /// The strategy in list form, as checkpoints record it.
    strategy: serde_json::Value,
    /// The optimizer's name, as checkpoints record it.
    optimizer_name: String,
    /// The rank's index on its node (its first rank publishes the node's snapshots).
    local_rank: usize,
}

/// Where a PatrickStar loop checkpoints. PatrickStar itself has only state dictionaries;
/// these are Strata's checkpoint folders (the model, the optimizer's states and step, the
/// loss scale; any world size resumes them), written synchronously or, asynchronously, as
/// a snapshot in host memory that a writer thread persists while the loop goes on
/// ([`crate::checkpoint::snapshot`]): states already on the host (the chunks offload
/// keeps there) are copied from where they lie, and the next update waits for that copy.
pub struct PatrickStarCheckpoints {
    root: PathBuf,
    keep: usize,
    saver: Option<AsyncSaver>,
}

/// Where a resumed loop continues from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resumed {
    /// Optimizer steps the checkpoint had taken.
    pub step: u64,
    /// `"host memory"` (an asynchronous save's snapshot) or `"disk"`.
    pub from: &'static str,
}

/// The model: `forward` gives the loss of a batch, `backward` runs backward from it.
pub struct PatrickStarEngine {
    session: Rc<RefCell<Session>>,
}

/// The optimizer: updates each state where it lives.
pub struct PatrickStarOptimizer {
    session: Rc<RefCell<Session>>,
}

/// Budgets and a sample step for [`initialize_engine_within`].
pub struct Budgets<'a> {
    /// Bytes the device may hold; `None` for no limit.
    pub device: Option<u64>,
    /// Bytes the host may hold; `None` for no limit.
    pub host: Option<u64>,
    /// A step of the run's shape, to measure what a step holds beside model states.
    pub sample: &'a Step,
}

/// Builds the model of `model_func` as `config` says, on `cuda:local_rank` where CUDA is
/// available (else the CPU), joining the job's other ranks when a launcher started several.
pub fn initialize_engine(
    model_func: impl Fn() -> Result<ModelSpec>,
    local_rank: usize,
    config: &PatrickStarConfig,
) -> Result<(PatrickStarEngine, PatrickStarOptimizer)> {
    initialize(model_func, local_rank, config, None)
}

/// [`initialize_engine`] with a device and host budget: the placement keeps room for what
/// `budgets.sample` holds beside model states, and a model that fits no placement is refused.
pub fn initialize_engine_within(
    model_func: impl Fn() -> Result<ModelSpec>,
    local_rank: usize,
    config: &PatrickStarConfig,
    budgets: Budgets<'_>,
) -> Result<(PatrickStarEngine, PatrickStarOptimizer)> {
    initialize(model_func, local_rank, config, Some(budgets))
}

fn initialize(
    model_func: impl Fn() -> Result<ModelSpec>,
    local_rank: usize,
    config: &PatrickStarConfig,
    budgets: Option<Budgets<'_>>,
) -> Result<(PatrickStarEngine, PatrickStarOptimizer)> {
    let mut device = if tch::Cuda::is_available() { Device::Cuda(local_rank) } else { Device::Cpu };
    // Launched as one of several ranks: join the job on the backends its hosts call for.
    // The rank on its node is the launcher's where one started several.
    let (comm, local_world_size, local_rank) = match crate::comm::launched_world_size() {
        Some(world) if world > 1 => {
            let info = crate::comm::RankInfo::from_env()?;
            let backends;
            (device, backends) = info.placement(device, tch::Cuda::device_count().max(0) as usize);
            let comm = crate::comm::init_from_env(&backends, std::time::Duration::from_secs(300))?;
            (Some(comm), info.local_world_size, info.local_rank)
        }
        _ => (None, 1, local_rank),
    };
    let world = comm.as_ref().map_or(1, Comm::size);
    let spec = model_func()?;
    let strategy = config.strategy(&spec, world)?;
    let optimizer_config = config.optimizer_config()?;
    let engine_config = EngineConfig {
        device,
        device_budget: budgets.as_ref().and_then(|b| b.device),
        host_budget: budgets.as_ref().and_then(|b| b.host),
        ..EngineConfig::default()
    };
    let mut at = RankLayout {
        comm: comm.as_ref(),
        local_world_size,
        optimizer_bytes_per_element: optimizer_config.state_bytes_per_element(),
        ..RankLayout::single()
    };
    if let Some(b) = &budgets {
        at = at.with_room_measured(model_func()?, &engine_config, &strategy, b.sample, &Feed::default())?;
    }
    let mut engine = build_engine(spec, engine_config, &strategy, &at)?;
    let optimizer_name = optimizer_config.kind.name();
    let optimizer = Optimizer::new(&mut engine, optimizer_config, &[])?;
    let world = comm.as_ref().map(Comm::world).transpose()?;
    let session = Session {
        world,
        loss: next_token_loss_of(&engine),
        scaling: strategy.grad_scaling()?,
        engine,
        optimizer,
        comm,
        strategy: strategy.to_value(),
        optimizer_name,
        local_rank,
    };
    let session = Rc::new(RefCell::new(session));
    Ok((PatrickStarEngine { session: session.clone() }, PatrickStarOptimizer { session }))
}

impl PatrickStarEngine {
    /// The mean next-token loss of `batch`.
    pub fn forward(&mut self, batch: &Batch) -> Result<Tensor> {
        let mut s = self.session.borrow_mut();
        // Drawn (from seed 0) for the optimizer's next update, which its state dict restores;
        // a skipped update's masks are drawn again.
        let dropout = crate::train::batch_draw(0, s.optimizer.steps_taken() + 1, batch);
        crate::train::set_rows(&mut s.engine, batch, Some(dropout));
        let output = s.engine.forward(&batch.inputs)?;
        crate::train::training_loss(&s.engine, &s.loss, &output, batch)
    }

    /// Backward from `loss` (multiplied by the loss scale where `fp16` scales it); gradients
    /// accumulate until the optimizer's step.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let mut s = self.session.borrow_mut();
        let scale = s.scaling.scale();
        s.engine.backward(&loss.f_mul_scalar(scale)?)
    }

    /// The engine, for what the loop above does not cover (evaluation, the ledger).
    pub fn with_engine<R>(&self, f: impl FnOnce(&mut Engine) -> R) -> R {
        f(&mut self.session.borrow_mut().engine)
    }

    /// This rank's parameters by name: over several ranks each rank holds the units
    /// `u` with `u % world == rank` whole, so the ranks' dictionaries together are the
    /// model (merged by taking every entry). Every rank must call it.
    pub fn state_dict(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut s = self.session.borrow_mut();
        let (rank, world) = s.comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
        let mut out = BTreeMap::new();
        for u in 0..s.engine.spec().units.len() {
            let full = s.engine.full_unit(u)?;
            if u % world != rank {
                continue;
            }
            for &id in &s.engine.spec().units[u].params {
                let p = &s.engine.spec().params[id.0];
                let value = full.f_narrow(0, s.engine.full_offset(id), p.numel())?.f_view(p.shape.as_slice())?;
                out.insert(p.name.clone(), value.f_detach_copy()?);
            }
        }
        Ok(out)
    }

    /// Loads parameters by name: each unit takes the values of the rank that holds it in
    /// [`PatrickStarEngine::state_dict`] (where that rank's dictionary has them; a merged
    /// dictionary on every rank works too). Every rank must call it.
    pub fn load_state_dict(&mut self, values: &BTreeMap<String, Tensor>) -> Result<()> {
        let mut s = self.session.borrow_mut();
        // An asynchronous save's writer may still read the parameters where they lie.
        s.optimizer.wait_for_readers();
        // By parameter, whichever name (or alias) the dictionary uses.
        let mut by_id = BTreeMap::new();
        for (name, value) in values {
            let id = s
                .engine
                .spec()
                .find(name)
                .ok_or_else(|| Error::Model(format!("state dict: {name} names no parameter of this model")))?;
            by_id.insert(id, value);
        }
        for u in 0..s.engine.spec().units.len() {
            let full = s.engine.full_unit(u)?.f_detach_copy()?;
            for &id in &s.engine.spec().units[u].params {
                if let Some(v) = by_id.get(&id) {
                    s.engine.write_param(&full, id, v)?;
                }
            }
            if let Some(g) = s.world.as_deref() {
                g.broadcast(&full, u % g.size())?.wait()?;
            }
            s.engine.set_full_unit(u, &full)?;
        }
        Ok(())
    }

    /// Checkpoints under `root`, keeping the `keep` newest (0: all); `asynchronous` for
    /// saves that persist in the background. Every rank calls it.
    pub fn checkpoints(&self, root: &Path, keep: usize, asynchronous: bool) -> Result<PatrickStarCheckpoints> {
        let saver = match asynchronous {
            true => Some(AsyncSaver::new(root, self.session.borrow().local_rank == 0)?),
            false => None,
        };
        Ok(PatrickStarCheckpoints { root: root.to_path_buf(), keep, saver })
    }

    /// Saves a checkpoint of the model and its optimizer after the optimizer's last step;
    /// returns how long the loop stood still for it. Every rank calls it.
    pub fn save_checkpoint(&mut self, checkpoints: &mut PatrickStarCheckpoints) -> Result<SaveTimes> {
        let began = Instant::now();
        let mut guard = self.session.borrow_mut();
        let s = &mut *guard;
        let world = s.world.as_deref();
        let step = s.optimizer.steps_taken();
        let run = RunInfo {
            step,
            world_size: world.map_or(1, |g| g.size()),
            strategy: s.strategy.clone(),
            optimizer: s.optimizer_name.clone(),
            // The loop feeds its own batches: where they stand is the steps taken.
            data: DataPosition { seed: 0, batch_size: 0, ctx: 0, next_step: step },
            loss_scaler: s.scaling.scaler.clone(),
            model: None,
            base: None,
        };
        let layout = Layout::of(&s.engine);
        let mut parts = [Part { engine: &mut s.engine, optimizer: &mut s.optimizer, first_unit: 0 }];
        match checkpoints.saver.as_mut() {
            Some(saver) => saver.save(&layout, &mut parts, &run, world, checkpoints.keep),
            None => {
                checkpoint::save_parts(&checkpoints.root, &layout, &mut parts, &run, world, checkpoints.keep)?;
                Ok(SaveTimes { blocked_s: began.elapsed().as_secs_f64(), ..SaveTimes::default() })
            }
        }
    }

    /// Restores the newest checkpoint of `checkpoints` (an asynchronous save's snapshot in
    /// host memory where every rank's part of it is complete and no older than the disk's,
    /// else the disk's `latest`): the model, the optimizer's states and step, and the loss
    /// scale. `None` where there is none. Every rank calls it.
    pub fn resume(&mut self, checkpoints: &PatrickStarCheckpoints) -> Result<Option<Resumed>> {
        let mut guard = self.session.borrow_mut();
        let s = &mut *guard;
        let asynchronous = checkpoints.saver.is_some();
        let newest = snapshot::newest(&checkpoints.root, s.world.as_deref(), s.local_rank == 0, asynchronous)?;
        let Some((found, from)) = newest else { return Ok(None) };
        found.restore(&mut s.engine, &mut s.optimizer, &s.optimizer_name)?;
        s.scaling.resume_from(found.meta.loss_scaler.as_ref())?;
        Ok(Some(Resumed { step: found.meta.step, from }))
    }

    /// Waits until an asynchronous save still persisting is on disk on every rank; returns
    /// what its writer spent (`None`: none was in flight). Every rank calls it.
    pub fn wait_checkpoints(&mut self, checkpoints: &mut PatrickStarCheckpoints) -> Result<Option<Persisted>> {
        let Some(saver) = checkpoints.saver.as_mut() else { return Ok(None) };
        saver.wait(self.session.borrow().world.as_deref())
    }

    /// Waits for an asynchronous save still persisting and removes the snapshot from host
    /// memory: the loop ended cleanly, its checkpoints are on disk. Every rank calls it.
    pub fn close_checkpoints(&mut self, checkpoints: PatrickStarCheckpoints) -> Result<()> {
        let Some(saver) = checkpoints.saver else { return Ok(()) };
        saver.close(self.session.borrow().world.as_deref())?;
        Ok(())
    }
}

impl PatrickStarOptimizer {
    /// Clears the gradients.
    pub fn zero_grad(&mut self) -> Result<()> {
        self.session.borrow_mut().engine.zero_grad()
    }

    /// Unscales and checks the gradients (with `fp16`), then updates every state where it
    /// lives, or skips the update when the gradients are not finite.
    pub fn step(&mut self) -> Result<()> {
        let mut guard = self.session.borrow_mut();
        let s = &mut *guard;
        s.engine.finish_grads()?;
        let scale = s.scaling.scale();
        let (engine, optimizer) = (&s.engine, &s.optimizer);
        let decision = s.scaling.decide(None, scale, || engine.grad_sq_sum(&optimizer.grad_sq_per_unit()?))?;
        decision.apply(&mut s.engine, &mut s.optimizer, HostUpdating::Done(&Default::default()))
    }

    /// This rank's optimizer state: `unit{U}.{OFFSET}.{exp_avg|exp_avg_sq}` per segment and
    /// `step`; it loads back into the same model, strategy and world size.
    pub fn state_dict(&self) -> Result<BTreeMap<String, Tensor>> {
        let s = self.session.borrow();
        let mut out: BTreeMap<String, Tensor> = s
            .optimizer
            .state()
            .into_iter()
            .map(|(unit, offset, name, t)| Ok((format!("unit{unit}.{offset}.{name}"), t.f_detach_copy()?)))
            .collect::<Result<_>>()?;
        out.insert("step".into(), Tensor::from(s.optimizer.steps_taken() as i64));
        Ok(out)
    }

    /// Restores the state [`PatrickStarOptimizer::state_dict`] gave; entries that do not match
    /// this optimizer's (another model, strategy or world size) are refused.
    pub fn load_state_dict(&mut self, values: &BTreeMap<String, Tensor>) -> Result<()> {
        let mut s = self.session.borrow_mut();
        let step = values
            .get("step")
            .ok_or_else(|| Error::Model("optimizer state dict: no step".into()))?
            .f_int64_value(&[])?;
        let expected = s.optimizer.state().len() + 1;
        if values.len() != expected {
            return Err(Error::Model(format!(
                "optimizer state dict: {} entries, this optimizer keeps {expected} (another model, strategy or world size?)",
                values.len()
            )));
        }
        let step = u64::try_from(step).map_err(|_| Error::Model(format!("optimizer state dict: step {step}")))?;
        s.optimizer.load_state(step, |unit, offset, name, t| {
            let key = format!("unit{unit}.{offset}.{name}");
            let v = values.get(&key).ok_or_else(|| Error::Model(format!("optimizer state dict: no {key}")))?;
            if v.size() != t.size() {
                return Err(Error::Model(format!(
                    "optimizer state dict: {key} has shape {:?}, not {:?}",
                    v.size(),
                    t.size()
                )));
            }
            tch::no_grad(|| t.shallow_clone().f_copy_(v))?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{gpt, GptConfig};
    use crate::optim::Fence;

    /// Loading parameters waits while an asynchronous save's writer may still read them
    /// where they lie (the fence it leaves on the updates), then loads them.
    #[test]
    fn loading_a_state_dict_waits_for_a_snapshot_s_readers() {
        let config =
            PatrickStarConfig::parse(r#"{"optimizer": {"type": "Adam"}, "default_chunk_size": 4096}"#).unwrap();
        let spec = || {
            let mut b = crate::model::Builder::new();
            gpt(&GptConfig::new(32, 8, 1, 2, 16), &mut b)?;
            b.build()
        };
        let (mut model, _optimizer) = initialize_engine(spec, 0, &config).unwrap();
        let mut weights = model.state_dict().unwrap();
        let (name, first) = weights.iter_mut().next().unwrap();
        let (name, loaded) = (name.clone(), first.ones_like());
        *first = loaded.shallow_clone();
        let (fence, opener) = Fence::closed();
        model.session.borrow_mut().optimizer.hold_updates(fence.clone());
        // Opens the fence once the load waits there; a load that did not wait leaves it
        // closed until the deadline, and the test fails.
        let opener = std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            while fence.waits().0 == 0 && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            let waited = fence.waits().0 > 0;
            opener.open();
            waited
        });
        model.load_state_dict(&weights).unwrap();
        assert!(opener.join().unwrap(), "the load did not wait for the snapshot's readers");
        assert!(model.state_dict().unwrap()[&name].equal(&loaded), "{name} was not loaded");
    }
}
