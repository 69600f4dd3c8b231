//! A whole training run, as `strata train` does it: launch-aware rank set-up, the strategy
//! (given, searched by `auto_accelerate` or decided by PatrickStar), the rank's trainer
//! ([`parallel::build_trainer`]: one engine, or a pipeline's stages), initial weights,
//! resume, the steps with validation, periodic and final checkpoints, metrics (JSON lines,
//! TensorBoard), progress, profiles and saved weights.
//!
//! Owns the order of a run and what it writes beside its steps. Must not own a step itself
//! ([`crate::train`] does, with its step executors), parse command lines or read
//! files named by users into data (the caller hands over `TokenData`).
//!
//! ```no_run
//! use std::sync::Arc;
//! use strata::data::SyntheticCorpus;
//! use strata::model::{GptConfig, ModelConfig};
//! use strata::run::{self, Data, Model, RunConfig};
//! # fn main() -> strata::Result<()> {
//! let model = Model::from(ModelConfig::Gpt(GptConfig::new(256, 64, 2, 4, 64)));
//! let data = Data::new(SyntheticCorpus::default().generate());
//! let config = RunConfig { steps: 50, ..RunConfig::default() };
//! let summary = run::train(&model, &data, &config, &mut [])?;
//! println!("final loss {:.3}", summary.last.map_or(f64::NAN, |r| r.loss));
//! # Ok(()) }
//! ```
pub mod grpo;
mod observe;
pub mod tensorboard;

use crate::auto::bench::GenerationProbe;
use crate::auto::{self, AutoAccelerate, AutoOptions};
use crate::checkpoint::snapshot::SaveTimes;
use crate::checkpoint::{self, BaseRecord, Checkpoint, DataPosition, RunInfo};
use crate::comm::{init_from_env, launched_world_size, Comm, ProcessGroup, RankInfo};
use crate::data::{
    validation_steps, Batch, Batching, DataLoader, Dataset, LoaderConfig, Order, PreferenceSet, PromptSet, RowSet,
    Step, StoredReference, StoredSet,
};
use crate::engine::{Engine, EngineConfig, EventSink, EventSinks, UnitClock};
use crate::grpo::GrpoObjective;
use crate::io::{AdapterOut, FolderOut, WeightsTarget};
use crate::model::{Builder, DecoderHead, ModelConfig, ModelDir, ModelSpec};
use crate::optim::{LrSchedule, OptimizerConfig, OptimizerKind};
use crate::parallel::{self, DataParallelOptions, Mesh, TrainerSetup};
use crate::patrickstar::PatrickStarConfig;
use crate::preference::{PreferenceConfig, PreferenceObjective, ScoreFn, VocabularySplit};
use crate::profile::Profiler;
use crate::reward::{RewardConfig, RewardObjective};
use crate::strategy::{Dim, LoraConfig, Strategy};
use crate::train::{token_input, Feed, InputFn, KeptWeights, LoraReference, LossFn, StepReport, Trainer};
use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tracing::info;

/// A model function: declares a model's units through a [`Builder`].
pub type ModelFn = Arc<dyn Fn(&mut Builder) -> Result<()> + Send + Sync>;

/// The model a run trains: a function declaring its units, and its configuration where it
/// is one of Strata's (checkpoints record it; model folders are written from it).
#[derive(Clone)]
pub struct Model {
    build: ModelFn,
    config: Option<ModelConfig>,
}

impl Model {
    /// A model written as units by `build` (see [`crate::model::Builder`]).
    pub fn from_units(build: impl Fn(&mut Builder) -> Result<()> + Send + Sync + 'static) -> Model {
        Model { build: Arc::new(build), config: None }
    }

    /// The model's description with `lora`'s adapters joined (where the strategy trains
    /// adapters), then the parameters `freeze` names frozen.
    fn spec(&self, freeze: &[String], lora: Option<&LoraConfig>) -> Result<ModelSpec> {
        let mut b = Builder::new();
        (self.build)(&mut b)?;
        let mut spec = b.build()?;
        spec.family = self.config.as_ref().and_then(|c| crate::model::Family::of(c).ok());
        if let Some(lora) = lora {
            lora.apply(&mut spec)?;
        }
        spec.freeze(freeze)?;
        Ok(spec)
    }
}

impl From<ModelConfig> for Model {
    fn from(config: ModelConfig) -> Model {
        let declared = config.clone();
        Model { build: Arc::new(move |b: &mut Builder| declared.build(b)), config: Some(config) }
    }
}

/// The data a run trains on (a token stream or examples), and the data it validates on.
#[derive(Clone)]
pub struct Data {
    /// The data the run trains on.
    pub train: Arc<Dataset>,
    /// The data the run validates on, if any.
    pub validation: Option<Arc<Dataset>>,
}

impl Data {
    /// Training data with no validation set.
    pub fn new(train: impl Into<Dataset>) -> Data {
        Data { train: Arc::new(train.into()), validation: None }
    }

    /// Training and validation data.
    pub fn with_validation(train: impl Into<Dataset>, validation: impl Into<Dataset>) -> Data {
        Data { train: Arc::new(train.into()), validation: Some(Arc::new(validation.into())) }
    }
}

/// Where a run's strategy comes from.
#[derive(Clone, Debug)]
pub enum StrategySource {
    /// This strategy, as given.
    Given(Strategy),
    /// `auto_accelerate`'s choice: searched, or loaded and tuned
    /// ([`AutoOptions::load_strategy`], [`AutoOptions::finetune_strategy`]).
    Auto(AutoOptions),
    /// PatrickStar's configuration, which decides once the model and world size are known.
    PatrickStar(PatrickStarConfig),
}

impl Default for StrategySource {
    fn default() -> Self {
        StrategySource::Given(Strategy::default())
    }
}

/// Weights a run starts from, loaded in order after the engine is built.
#[derive(Clone, Debug)]
pub enum InitialWeights {
    /// A safetensors file under Strata's parameter names.
    File(PathBuf),
    /// A Hugging Face model folder.
    Folder(Box<ModelDir>),
    /// A peft adapter folder, loaded into a LoRA run's adapters (whose configuration it
    /// gives where the strategy has no `lora`).
    Adapter(PathBuf),
}

/// Which checkpoint a run continues from.
#[derive(Clone, Debug, PartialEq)]
pub enum Resume {
    /// This checkpoint (a folder, or a checkpoint root whose newest is taken).
    From(PathBuf),
    /// The newest complete checkpoint under [`Checkpoints::dir`], or a fresh start where
    /// there is none yet: what a job restarted after a failure wants.
    Latest,
}

/// Where and how often a run saves checkpoints.
#[derive(Clone, Debug)]
pub struct Checkpoints {
    /// The checkpoint root (`--save-checkpoint`): each save is a folder in it, `latest`
    /// names the newest.
    pub dir: PathBuf,
    /// Save after every this many steps too, beside after the last.
    pub every: Option<u64>,
    /// Keep this many newest checkpoints (0: all).
    pub keep: usize,
    /// Save asynchronously (`--checkpoint-async`): a snapshot in host memory, which a
    /// writer thread persists while training goes on, and from which a run restarted on the
    /// same node resumes ([`checkpoint::snapshot`]).
    pub asynchronous: bool,
}

/// What a run writes beside its checkpoints; every location is checked before the first
/// step. Errors name each by its command-line flag.
#[derive(Clone, Debug, Default)]
pub struct Outputs {
    /// The trained weights as one safetensors file (`--save-weights`).
    pub weights: Option<PathBuf>,
    /// The trained model as a Hugging Face folder (`--save-model-dir`), adapters merged.
    pub model_folder: Option<FolderOut>,
    /// A LoRA run's adapters as a peft folder (`--save-adapter-dir`).
    pub adapter_folder: Option<PathBuf>,
    /// One JSON line per step (`--metrics`).
    pub metrics: Option<PathBuf>,
    /// TensorBoard event files of the same series (`--tensorboard`).
    pub tensorboard: Option<PathBuf>,
    /// Each rank's profile (`--profile`).
    pub profile: Option<PathBuf>,
    /// The strategy the run trained with (`--save-strategy`).
    pub strategy: Option<PathBuf>,
    /// `auto_accelerate`'s search report (`--search-report`).
    pub search_report: Option<PathBuf>,
}

/// Eager steps a run takes before it captures its step as a CUDA graph (`cuda_graph`): the
/// first compiles kernels and allocates what every later step reuses; the second runs as
/// every later one will.
pub const CUDA_GRAPH_WARMUP: u64 = 2;

/// Everything about a run but its model and data. [`RunConfig::default`] is a short
/// single-process run on the CPU.
#[derive(Clone)]
pub struct RunConfig {
    /// Optimizer steps in all (a resumed run continues up to this count).
    pub steps: u64,
    /// How the data is cut into steps: rows per global batch, positions per row,
    /// micro-batches per step, the order and its seed (which also seeds the parameters),
    /// packing.
    pub batching: Batching,
    /// This process's device; launched ranks move to their local GPU.
    pub device: tch::Device,
    /// Compute threads; `None`: the ranks of a host share its cores.
    pub threads: Option<i32>,
    /// The optimizer's kind and hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// The learning rate's factor at each step (default: constant).
    pub schedule: LrSchedule,
    /// Clip the global gradient norm to this value (default 1.0; `None`: no clipping).
    pub grad_clip: Option<f64>,
    /// Parameters left out of training (name substrings).
    pub freeze: Vec<String>,
    /// The loss; `None`: next-token cross-entropy (vocabulary-parallel where split).
    pub loss: Option<LossFn>,
    /// What the model's first unit reads of each micro-batch (`prepare_input`); `None`: its
    /// token ids.
    pub prepare_input: Option<InputFn>,
    /// Where the run's strategy comes from (default: [`Strategy::default`]).
    pub strategy: StrategySource,
    /// How data-parallel ranks reduce gradients: bucket size, unused parameters.
    pub data_parallel: DataParallelOptions,
    /// Memory budgets of each rank's device and host.
    pub device_memory: Option<u64>,
    /// Bytes of host memory each rank may hold for model states; `None`: no limit.
    pub host_memory: Option<u64>,
    /// The communication backends of a launched job (default: chosen by placement), and
    /// how long a collective may wait.
    pub comm_backend: Option<String>,
    /// How long a collective may wait (default 300 s).
    pub comm_timeout: Duration,
    /// Weights the run starts from, loaded in order after the engine is built.
    pub init: Vec<InitialWeights>,
    /// Validate after every this many steps (and after the last, when validation data is
    /// given), on this many batches (`None`: as many as fit, at most 8).
    pub eval_every: Option<u64>,
    /// Validation batches each validation runs on (`None`: as many as fit, at most 8).
    pub eval_batches: Option<usize>,
    /// Where and how often the run saves checkpoints (`None`: it saves none).
    pub checkpoints: Option<Checkpoints>,
    /// The checkpoint the run continues from (`None`: a fresh start).
    pub resume: Option<Resume>,
    /// Resuming, read the data from its first step in this run's order (its seed, batch
    /// size and context, which may then differ from the checkpoint's), the weights,
    /// optimizer state, schedule and step count continuing — `transformers`' Trainer's
    /// `ignore_data_skip`. Otherwise a resume continues the saved run's data exactly and
    /// refuses settings that would change it.
    pub restart_data: bool,
    /// What the run writes beside its checkpoints.
    pub outputs: Outputs,
    /// Time each unit's forward and backward into the metrics (under a pipeline, each on
    /// the rank of its stage).
    pub unit_times: bool,
    /// Capture the training step as a CUDA graph after [`CUDA_GRAPH_WARMUP`] eager steps
    /// and replay it ([`crate::train::Trainer::capture_cuda_graph`]).
    pub cuda_graph: bool,
    /// A progress line in the log every this many steps.
    pub log_every: u64,
    /// A progress bar on standard error (rank 0).
    pub progress: bool,
    /// How preference pairs are scored, where the training data holds them (DPO's sigmoid
    /// loss at β = 0.1 by default).
    pub preference: PreferenceConfig,
    /// How a reward model's pairs are scored, where the model is a reward model.
    pub reward: RewardConfig,
    /// GRPO's parameters and reward, where the training data holds prompts alone.
    pub grpo: Option<grpo::GrpoRun>,
}

impl RunConfig {
    /// What the run feeds its model and scores it by.
    pub(crate) fn feed(&self) -> Feed {
        Feed { input: self.prepare_input.clone().unwrap_or_else(token_input), loss: self.loss.clone() }
    }
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            steps: 100,
            batching: Batching::default(),
            device: tch::Device::Cpu,
            threads: None,
            optimizer: OptimizerConfig::default(),
            schedule: LrSchedule::Constant,
            grad_clip: Some(1.0),
            freeze: vec![],
            loss: None,
            prepare_input: None,
            strategy: StrategySource::default(),
            data_parallel: DataParallelOptions::default(),
            device_memory: None,
            host_memory: None,
            comm_backend: None,
            comm_timeout: Duration::from_secs(300),
            init: vec![],
            eval_every: None,
            eval_batches: None,
            checkpoints: None,
            resume: None,
            restart_data: false,
            outputs: Outputs::default(),
            unit_times: false,
            cuda_graph: false,
            log_every: 10,
            progress: false,
            preference: PreferenceConfig::default(),
            reward: RewardConfig::default(),
            grpo: None,
        }
    }
}

impl RunConfig {
    /// Where this run's data stands before step `next_step`, as checkpoints record it.
    fn data_position(&self, next_step: u64) -> DataPosition {
        DataPosition {
            seed: self.batching.seed,
            batch_size: self.batching.batch_size,
            ctx: self.batching.ctx,
            next_step,
        }
    }

    /// Whether a checkpoint is saved after step `step` on the way (the last step's always is).
    fn checkpoint_due(&self, step: u64) -> bool {
        step < self.steps && self.checkpoints.as_ref().and_then(|c| c.every).is_some_and(|e| step.is_multiple_of(e))
    }

    /// Whether a validation runs after step `step`: every `eval_every` steps, and after the last.
    fn validation_due(&self, step: u64) -> bool {
        step == self.steps || self.eval_every.is_some_and(|every| step.is_multiple_of(every))
    }

    /// The checkpoint to continue from, refused if it would not continue this run's data,
    /// with where it lies (`"host memory"` or `"disk"`). Every rank of `world` calls it
    /// (`node_publisher`: the first of its node), as an asynchronous run's snapshot in host
    /// memory is chosen by all of them together.
    fn checkpoint_to_resume(
        &self,
        world: Option<&dyn ProcessGroup>,
        node_publisher: bool,
    ) -> Result<Option<(Checkpoint, &'static str)>> {
        let path = match &self.resume {
            None => return Ok(None),
            Some(Resume::From(path)) => path.clone(),
            Some(Resume::Latest) => {
                let c = self.checkpoints.as_ref().ok_or_else(|| {
                    Error::Config(
                        "resuming from the latest checkpoint needs a checkpoint folder (--save-checkpoint)".into(),
                    )
                })?;
                let newest = checkpoint::snapshot::newest(&c.dir, world, node_publisher, c.asynchronous)?;
                return newest.map(|(found, from)| self.continuing(found).map(|c| (c, from))).transpose();
            }
        };
        self.continuing(Checkpoint::open(&path)?).map(|c| Some((c, "disk")))
    }

    /// `ckpt`, refused if it would not continue this run's data.
    fn continuing(&self, ckpt: Checkpoint) -> Result<Checkpoint> {
        let differences = data_differences(&ckpt.meta.data, &self.data_position(ckpt.meta.data.next_step));
        if !differences.is_empty() && !self.restart_data {
            return Err(Error::Checkpoint(format!(
                "{}: this run's {} — it would not continue the saved run's data (--restart-data true reads the data from \
                 its start in this run's order, the weights, optimizer and step count continuing)",
                ckpt.location.display(),
                differences.join("; ")
            )));
        }
        Ok(ckpt)
    }

    /// The step of the data at which a run resumed from `resumed` (or starting fresh)
    /// begins: the saved run's next step, or its first where the data restarts.
    fn first_data_step(&self, resumed: Option<&Checkpoint>) -> u64 {
        match resumed {
            Some(ckpt) if !self.restart_data => ckpt.meta.data.next_step,
            _ => 0,
        }
    }

    /// Every output location is checked before the first step (and before any search), so
    /// a long run is never lost to a path that could not be written. Every rank checks:
    /// they all write into the checkpoint folder.
    fn check_outputs(&self, params: u64) -> Result<()> {
        use crate::io::{check_output, Output};
        let states = match self.optimizer.kind {
            OptimizerKind::Sgd if self.optimizer.momentum == 0.0 => 0,
            OptimizerKind::Sgd => 1,
            _ => 2,
        };
        let o = &self.outputs;
        // fp32 values: weights once; a checkpoint holds parameters and each optimizer state.
        let files = [
            ("--save-weights", &o.weights, params * 4),
            ("--metrics", &o.metrics, 0),
            ("--save-strategy", &o.strategy, 0),
            ("--search-report", &o.search_report, 0),
        ];
        for (flag, path, bytes) in files {
            if let Some(path) = path {
                check_output(flag, path, Output::File, bytes)?;
            }
        }
        let folders = [
            ("--save-checkpoint", self.checkpoints.as_ref().map(|c| &c.dir), params * 4 * (1 + states)),
            ("--save-model-dir", o.model_folder.as_ref().map(|f| &f.dir), params * 4),
            ("--save-adapter-dir", o.adapter_folder.as_ref(), 0),
            ("--tensorboard", o.tensorboard.as_ref(), 0),
        ];
        for (flag, dir, bytes) in folders {
            if let Some(dir) = dir {
                check_output(flag, dir, Output::Folder, bytes)?;
            }
        }
        Ok(())
    }

    /// Where the newest complete checkpoint of this run is, as a clause for a failed save.
    fn last_checkpoint(&self) -> String {
        let Some(c) = &self.checkpoints else { return String::new() };
        match checkpoint::latest(&c.dir) {
            Ok(dir) => format!(" (the newest complete checkpoint is {})", dir.display()),
            Err(_) => " (no checkpoint was completed)".into(),
        }
    }
}

/// Whether a run goes on after a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Go on to the next step.
    Continue,
    /// End the run after this step: validation, checkpoint and weights are saved as after
    /// the last step. Every rank stops when any rank's callback says so.
    Stop,
}

/// A user's hook into the loop: called on every rank after each step (with its validation,
/// where one ran), with the job's figures.
pub trait Callback {
    /// Called after each step with its report; [`Flow::Stop`] ends the run after it.
    fn on_step(&mut self, report: &StepReport) -> Result<Flow>;
}

impl<F: FnMut(&StepReport) -> Result<Flow>> Callback for F {
    fn on_step(&mut self, report: &StepReport) -> Result<Flow> {
        self(report)
    }
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// The last step's report (none when a resumed run had no step left).
    pub last: Option<StepReport>,
    /// The strategy the run trained with.
    pub strategy: Strategy,
    /// This process's rank and the job's size.
    pub rank: usize,
    /// Ranks in the whole job.
    pub world_size: usize,
}

impl RunSummary {
    /// Whether this process speaks for the job (rank 0).
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// The ranks of a job this process joined, or one process alone.
struct Ranks {
    comm: Option<Comm>,
    local_rank: usize,
    local_world_size: usize,
}

impl Ranks {
    fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, Comm::rank)
    }

    fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, Comm::size)
    }

    fn leader(&self) -> bool {
        self.rank() == 0
    }
}

/// Refuses a GPU the machine does not have, in words, before libtorch's first tensor there
/// would (with a message about drivers).
fn check_device(device: tch::Device) -> Result<()> {
    let tch::Device::Cuda(index) = device else { return Ok(()) };
    let visible = tch::Cuda::device_count().max(0) as usize;
    if visible == 0 {
        return Err(Error::Config("--device cuda: no GPU is present on this machine (torch sees none)".into()));
    }
    if index >= visible {
        return Err(Error::Config(format!(
            "--device cuda:{index}: this machine has {visible} GPU(s), numbered from 0"
        )));
    }
    Ok(())
}

/// Trains `model` on `data` as `config` says, calling `callbacks` after every step.
///
/// Started by a launcher (`strata launch`, `torchrun`: `WORLD_SIZE` > 1), the process joins
/// the job first and trains its share; every rank calls this with the same arguments.
pub fn train(
    model: &Model,
    data: &Data,
    config: &RunConfig,
    callbacks: &mut [&mut dyn Callback],
) -> Result<RunSummary> {
    // Count every CPU allocation from here on (activation memory in the metrics).
    strata_ext::cpu_memory::track()?;
    let mut config = config.clone();
    let launched = match launched_world_size() {
        Some(world) if world > 1 => Some(RankInfo::from_env()?),
        _ => None,
    };
    let backends = match &launched {
        Some(info) => {
            let (device, backends) = info.placement(config.device, tch::Cuda::device_count() as usize);
            config.device = device;
            config.comm_backend.clone().unwrap_or(backends)
        }
        None => String::new(),
    };
    if let Some(t) = config.threads {
        tch::set_num_threads(t);
    }
    check_device(config.device)?;
    check_data(model, data, &config)?;
    // The base model: initial weights hold no adapters.
    let spec = model.spec(&config.freeze, None)?;
    let params = spec.num_params();
    config.check_outputs(params as u64)?;
    // Initial weights or a checkpoint that cannot load are refused before any search or
    // step (the checkpoint is restored once the engine exists).
    for init in &config.init {
        match init {
            InitialWeights::File(path) => crate::io::check_weights_file(&spec, path)?,
            InitialWeights::Adapter(dir) => drop(crate::io::read_adapter_config(dir)?),
            InitialWeights::Folder(_) => {}
        }
    }
    let ranks = match &launched {
        Some(info) => Ranks {
            comm: Some(init_from_env(&backends, config.comm_timeout)?),
            local_rank: info.local_rank,
            local_world_size: info.local_world_size,
        },
        None => Ranks { comm: None, local_rank: 0, local_world_size: 1 },
    };
    // Every rank: checkpoints are written, losses agreed and callbacks' stops shared over it.
    let world_group: Option<Arc<dyn ProcessGroup>> = ranks.comm.as_ref().map(|c| c.world()).transpose()?.map(Arc::from);
    let (resume, source) = config.checkpoint_to_resume(world_group.as_deref(), ranks.local_rank == 0)?.unzip();
    // A frozen base loaded from a model folder or weights file is left out of checkpoints
    // and loaded again on resume.
    let base_in_init = config.init.iter().any(|i| matches!(i, InitialWeights::File(_) | InitialWeights::Folder(_)));
    if let Some(ckpt) = resume.as_ref().filter(|c| !c.holds_every_parameter() && !base_in_init) {
        return Err(Error::Checkpoint(format!(
            "{}: the checkpoint holds what its run trained, not the frozen base it started from: give that base \
             (--model-dir or --init-weights) again",
            ckpt.location.display()
        )));
    }
    // Recorded in the checkpoints that leave it out, and checked against the one resumed.
    let base = match base_in_init && (config.checkpoints.is_some() || resume.is_some()) {
        true => Some(base_record(&config.init)?),
        false => None,
    };
    if let (Some(ckpt), Some(given)) = (resume.as_ref().filter(|c| !c.holds_every_parameter()), &base) {
        if let Some(saved) = &ckpt.meta.base {
            saved.check(given, &ckpt.location)?;
        }
    }
    share_cores(config.threads, ranks.local_world_size);
    let objective = objective_of(data, &mut config, model)?;
    let preference = objective.as_ref().and_then(Objective::preference);
    let engine_config = engine_config_of(&config);
    let (strategy, data_parallel) = choose_strategy(model, data, &config, &ranks, &engine_config)?;
    let mut strategy = with_adapter_config(strategy, &config.init)?;
    if let Some(o) = &objective {
        check_objective_strategy(o, &strategy, &config)?;
    }
    if let Some(Objective::Reward(_)) = &objective {
        train_score_head(&mut strategy);
    }
    if config.outputs.adapter_folder.is_some() && strategy.lora().is_none() {
        return Err(Error::Config(
            "--save-adapter-dir saves a LoRA run's adapters: the strategy has no lora method".into(),
        ));
    }
    if let Some(path) = config.outputs.strategy.as_ref().filter(|_| ranks.leader()) {
        strategy.save(path)?;
    }
    let mesh = parallel::mesh_of(&strategy, ranks.comm.as_ref(), ranks.local_world_size)?;
    let (data_rank, data_world) = mesh.batch_shard();
    let context = parallel::rows_piece(&mesh, &strategy);
    let loader_config = LoaderConfig {
        rank: data_rank,
        world: data_world,
        context,
        device: config.device,
        ..LoaderConfig::new(config.batching.clone())
    };
    let spec = || model.spec(&config.freeze, strategy.lora());
    // What is measured before training (offload's room, a pipeline's unit costs) is
    // measured on the run's first step, loaded where it is needed.
    let first = std::cell::OnceCell::new();
    let first_step = || -> Result<&Step> {
        if let Some(step) = first.get() {
            return Ok(step);
        }
        let step = DataLoader::new(data.train.clone(), loader_config.clone())?
            .next()
            .ok_or_else(|| Error::Data("the data holds no step to measure on".into()))??;
        Ok(first.get_or_init(|| step))
    };
    let mut trainer = parallel::build_trainer(&TrainerSetup {
        spec: &spec,
        engine: engine_config.clone(),
        strategy: &strategy,
        comm: ranks.comm.as_ref(),
        local_world_size: ranks.local_world_size,
        data_parallel,
        optimizer: config.optimizer.clone(),
        rules: &[],
        schedule: config.schedule.clone(),
        grad_clip: config.grad_clip,
        micro_batches: config.batching.accumulation,
        feed: config.feed(),
        first_step: Some(&first_step),
        report_over: world_group.clone(),
    })?;
    drop(first);
    trainer.set_dropout_seed(config.batching.seed);
    for part in trainer.parts_mut() {
        load_initial_weights(&config.init, &mut part.engine)?;
    }
    // LoRA's reference model is the model as it starts, kept before any step or resume.
    let reference_scores_live = match &objective {
        Some(Objective::Preference(p)) => p.config().live(),
        Some(Objective::Grpo(g)) => g.config().beta != 0.0,
        _ => false,
    };
    let mut lora_reference = match strategy.lora().filter(|_| reference_scores_live) {
        Some(lora) => {
            let mut changed = false;
            for init in &config.init {
                if let InitialWeights::Adapter(dir) = init {
                    changed |= !crate::io::adapter_changes_nothing(dir)?;
                }
            }
            Some(LoraReference::of(&mut trainer, lora, changed)?)
        }
        None => None,
    };
    // Preference pairs and GRPO score whole logits: where a tensor group splits the head's
    // columns, each rank of it gathers the others'.
    let vocabulary = match (trainer.parts().iter().find_map(|part| part.engine.tensor_parallel().cloned()), &objective)
    {
        (Some(group), Some(o @ (Objective::Preference(_) | Objective::Grpo(_)))) => match model.config.as_ref() {
            Some(c) => Some(VocabularySplit { group, vocab: c.vocab() }),
            None => {
                return Err(Error::Config(format!(
                    "{} under tensor parallelism need the model's vocabulary: a model from a configuration or folder",
                    o.data()
                )))
            }
        },
        _ => None,
    };
    // What spans every data-parallel rank's rows, on a group of its own: KTO's KL estimate,
    // GRPO's generation batches (whose ranks read different prompts).
    let kto = config.preference.losses.iter().any(|(l, _)| *l == crate::preference::PreferenceLoss::Kto);
    let spans_ranks = matches!(objective, Some(Objective::Grpo(_))) || (preference.is_some() && kto);
    let batch_group = match ranks.comm.as_ref().filter(|_| spans_ranks && data_world > 1) {
        Some(comm) => parallel::my_group(comm, &mesh.groups(&Mesh::DATA_PARALLEL))?,
        None => None,
    };
    match &objective {
        Some(Objective::Preference(p)) => {
            p.set_vocabulary_split(vocabulary);
            p.set_batch_group(batch_group.clone());
        }
        Some(Objective::Grpo(g)) => g.set_vocabulary_split(vocabulary),
        _ => {}
    }
    let rows = LoaderConfig::new(config.batching.clone()).micro_batch_rows()?;
    let data = &match preference.as_ref() {
        // Reference-free losses (CPO, SimPO, ORPO) read no reference scores, and a live
        // reference scores each step's pairs as they come.
        Some(p) if !p.config().reference_free() && !p.config().live() => {
            attach_references(&mut trainer, data, &config, rows, p.vocabulary_split(), world_group.as_deref())?
        }
        _ => data.clone(),
    };
    let live_preference = preference.as_ref().filter(|p| p.config().live());
    if let (Some(_), Dataset::Preference(pairs)) = (live_preference, data.train.as_ref()) {
        if pairs.reference().is_some() {
            return Err(Error::Config(format!(
                "{}: the records give their own reference scores, which a live reference would not read",
                pairs.source
            )));
        }
    }
    let live = match live_preference {
        Some(p) if strategy.lora().is_some() => Some(LiveReference::Lora {
            reference: lora_reference.take().ok_or_else(|| Error::Config("a live reference without LoRA's".into()))?,
            feed: config.feed(),
            split: p.vocabulary_split(),
        }),
        // Pipeline stages keep their units' starting weights (the trainer holds them now).
        Some(p) if strategy.pipeline_parallel().is_some() => Some(LiveReference::Kept {
            weights: KeptWeights::of(&mut trainer)?,
            sync: p.config().reference_sync,
            feed: config.feed(),
            split: p.vocabulary_split(),
        }),
        Some(p) => {
            // A whole copy split as the trainer's model is, over the same tensor group.
            let tensor = trainer.engine().tensor_parallel().cloned();
            let config_of_copy = EngineConfig { tensor, ..engine_config.clone() };
            let copy = Box::new(reference_copy(spec()?, &config_of_copy, &config.init)?);
            Some(LiveReference::Copy { copy, sync: p.config().reference_sync, split: p.vocabulary_split() })
        }
        None => None,
    };
    let live = live.map(std::cell::RefCell::new);
    // GRPO's KL term without LoRA beside pipeline stages reads the weights the stages start
    // with, kept before a checkpoint replaces them.
    let mut kept_reference = match &objective {
        Some(Objective::Grpo(g))
            if g.config().beta != 0.0 && strategy.lora().is_none() && strategy.pipeline_parallel().is_some() =>
        {
            Some(KeptWeights::of(&mut trainer)?)
        }
        _ => None,
    };
    if config.cuda_graph {
        trainer.capture_cuda_graph(CUDA_GRAPH_WARMUP)?;
    }
    info!(
        params,
        tokens = data.train.tokens(),
        source = data.train.source(),
        strategy = %strategy.to_value(),
        %mesh,
        "training"
    );
    let clock = config.unit_times.then(|| Arc::new(UnitClock::default()));
    let profiler = config.outputs.profile.as_ref().map(|_| trainer.profiler(ranks.rank(), ranks.world()));
    if let (Some(c), Some(p)) = (&ranks.comm, &profiler) {
        c.observe(Some(p.clone()));
    }
    let sinks: Vec<Arc<dyn EventSink>> = clock
        .iter()
        .map(|c| c.clone() as Arc<dyn EventSink>)
        .chain(profiler.iter().map(|p| p.clone() as Arc<dyn EventSink>))
        .collect();
    if !sinks.is_empty() {
        trainer.set_event_sink(Arc::new(EventSinks(sinks)));
    }
    if let Some(c) = &clock {
        c.take(); // the first step's clock starts here
    }
    let optimizer_name = config.optimizer.kind.name();
    if let Some(ckpt) = &resume {
        if let Some(g) = world_group.as_deref() {
            // Each rank chose its checkpoint alone (memory or disk): they must be of one step.
            let step = ckpt.meta.step as f64;
            let most = crate::comm::all_reduce_values(g, &[step, -step], crate::comm::ReduceOp::Max)?;
            if most[0] != -most[1] {
                return Err(Error::Checkpoint(format!(
                    "the ranks found checkpoints of different steps ({} to {}) to resume from",
                    -most[1], most[0]
                )));
            }
        }
        let began = std::time::Instant::now();
        trainer.restore(ckpt, &optimizer_name)?;
        let restore_s = began.elapsed().as_secs_f64();
        info!(
            step = ckpt.meta.step,
            from = %ckpt.location.display(),
            source = source.unwrap_or_default(),
            restore_s,
            saved_world_size = ckpt.meta.world_size,
            "resumed"
        );
    }
    let start = trainer.step();
    // Where the data stands at `start`: each step reads the data's next step.
    let data_start = config.first_data_step(resume.as_ref());
    if start > config.steps {
        return Err(Error::Checkpoint(format!(
            "the checkpoint is at step {start}, past the run's {} steps",
            config.steps
        )));
    }
    let loader_config = LoaderConfig { start_step: data_start as usize, ..loader_config };
    let mut val_steps =
        data.validation.as_ref().map(|v| validation_steps(v, &loader_config, config.eval_batches, 8)).transpose()?;
    // Rows of one micro-batch on this rank (GRPO's completions).
    let rank_rows = loader_config.micro_batch_rows()?;
    let loader = DataLoader::new(data.train.clone(), loader_config)?;
    let saver = match &config.checkpoints {
        Some(c) if c.asynchronous => {
            let mut saver = checkpoint::snapshot::AsyncSaver::new(&c.dir, ranks.local_rank == 0)?;
            if let Some(ckpt) = &resume {
                saver.persist_resumed(ckpt, world_group.as_deref(), c.keep)?;
            }
            Some(saver)
        }
        _ => None,
    };
    let saver = std::cell::RefCell::new(saver);
    // The save after a step, reported with the next step.
    let saved = std::cell::Cell::new(None);
    let save_checkpoint = |trainer: &mut Trainer| -> Result<()> {
        let Some(c) = &config.checkpoints else { return Ok(()) };
        let run = RunInfo {
            step: trainer.step(),
            world_size: ranks.world(),
            strategy: strategy.to_value(),
            optimizer: optimizer_name.clone(),
            data: config.data_position(data_start + trainer.step() - start),
            loss_scaler: trainer.scaling.scaler.clone(),
            model: model.config.clone(),
            base: base.clone(),
        };
        let failed = |e: Error| {
            Error::Checkpoint(format!("saving a checkpoint in {}: {e}{}", c.dir.display(), config.last_checkpoint()))
        };
        let began = std::time::Instant::now();
        let times = match saver.borrow_mut().as_mut() {
            Some(saver) => {
                let times =
                    trainer.save_checkpoint_async(saver, &run, world_group.as_deref(), c.keep).map_err(failed)?;
                if ranks.leader() {
                    info!(step = run.step, blocked_s = times.blocked_s, "snapshot taken; persisting in the background");
                }
                times
            }
            None => {
                let dir = trainer.save_checkpoint(&c.dir, &run, world_group.as_deref(), c.keep).map_err(failed)?;
                if ranks.leader() {
                    info!(path = %dir.display(), "saved checkpoint");
                }
                SaveTimes { blocked_s: began.elapsed().as_secs_f64(), ..Default::default() }
            }
        };
        if let Some(p) = &profiler {
            p.checkpoint_saved(run.step, began, times.blocked_s, times.waited_s, times.persisted_s);
        }
        saved.set(Some(times));
        Ok(())
    };
    let mut observers = observe::Observers::open(&config, ranks.leader(), start)?;
    let mut last: Option<StepReport> = None;
    let readers = data_world * mesh.size(Dim::Context);
    // What every step's report goes through, whichever loop took the step: validation,
    // unit times, metrics, callbacks and periodic checkpoints.
    let mut after_step = |trainer: &mut Trainer, mut report: StepReport| -> Result<Flow> {
        // The trainer reports the job's loss; every data rank's tokens count, and each
        // context rank's piece of them.
        report.tokens *= readers as u64;
        report.tokens_per_s *= readers as f64;
        let updates_waited_s = trainer.take_readers_wait();
        report.checkpoint = saved.take().map(|times| SaveTimes { updates_waited_s, ..times });
        // TR-DPO's sync follows the update, before validation reads the reference.
        if let Some(live) = live.as_ref() {
            live.borrow_mut().follow(trainer, report.step)?;
        }
        if let Some(steps) = val_steps.as_mut().filter(|_| config.validation_due(report.step)) {
            if let Some(live) = live.as_ref() {
                let mut live = live.borrow_mut();
                steps.iter_mut().try_for_each(|step| live.score(trainer, &mut step.micro_batches))?;
            }
            report.set_validation(trainer.evaluate(steps)?);
            if objective.is_some() {
                // A mean over pairs of a preference or reward loss has no perplexity.
                report.val_perplexity = None;
            }
        }
        // After the loss's all-reduce, so the next step's units wait for nothing of this one.
        report.unit_times = clock.as_ref().map(|c| trainer.unit_times(c.take())).transpose()?;
        if !report.loss.is_finite() {
            return Err(Error::Engine(format!("loss became {} at step {}", report.loss, report.step)));
        }
        observers.step(&report)?;
        let mut stop = false;
        for callback in callbacks.iter_mut() {
            stop |= callback.on_step(&report)? == Flow::Stop;
        }
        if let Some(g) = world_group.as_deref().filter(|_| !callbacks.is_empty()) {
            // One rank's stop ends every rank's run, at the same step.
            stop = crate::comm::all_reduce_values(g, &[stop as u8 as f64], crate::comm::ReduceOp::Max)?[0] > 0.0;
        }
        if config.checkpoint_due(report.step) && !stop {
            observers.suspend(|| save_checkpoint(trainer))?;
        }
        let done = stop || report.step >= config.steps;
        last = Some(report);
        Ok(if done { Flow::Stop } else { Flow::Continue })
    };
    match (&objective, data.train.as_ref(), &config.grpo) {
        (Some(Objective::Grpo(g)), Dataset::Prompts(prompts), Some(run)) if start < config.steps => {
            // Context parallelism is refused; the ranks of a tensor group, and a pipeline's
            // stages, generate and train on the same prompts.
            let setup = grpo::Setup {
                prompts,
                run,
                accumulation: config.batching.accumulation,
                micro_rows: rank_rows,
                data_rank,
                data_world,
                group: batch_group.as_deref(),
                world: world_group.as_deref(),
                seed: config.batching.seed,
            };
            let reference = match (g.config().beta != 0.0, strategy.lora().is_some(), kept_reference.take()) {
                (false, _, _) => grpo::ReferenceModel::None,
                (true, true, _) => grpo::ReferenceModel::Lora(
                    lora_reference.take().ok_or_else(|| Error::Config("grpo: a reference without LoRA's".into()))?,
                ),
                (true, false, Some(weights)) => grpo::ReferenceModel::Kept(weights),
                (true, false, None) => {
                    // Split as the trainer's model is, over the same tensor group.
                    let tensor = trainer.engine().tensor_parallel().cloned();
                    let config_of_copy = EngineConfig { tensor, ..engine_config.clone() };
                    grpo::ReferenceModel::Copy(Box::new(reference_copy(spec()?, &config_of_copy, &config.init)?))
                }
            };
            grpo::train(&mut trainer, g, &setup, reference, &mut after_step)?;
        }
        _ => {
            for step in loader.take((config.steps - start) as usize) {
                if let Some(o) = &objective {
                    o.reset();
                }
                let mut step = step?;
                if let Some(live) = live.as_ref() {
                    live.borrow_mut().score(&mut trainer, &mut step.micro_batches)?;
                }
                let mut report = trainer.train_step(&step)?;
                match &objective {
                    Some(Objective::Preference(p)) => report.preference = p.take_metrics(world_group.as_deref())?,
                    Some(Objective::Reward(r)) => report.reward = r.take_metrics(world_group.as_deref())?,
                    _ => {}
                }
                if after_step(&mut trainer, report)? == Flow::Stop {
                    break;
                }
            }
        }
    }
    observers.finish()?;
    // What is saved below reads the model after the last step's update.
    trainer.settle_updates()?;
    if let (Some(dir), Some(profiler)) = (&config.outputs.profile, &profiler) {
        save_profile(profiler, dir, ranks.rank())?;
        if let Some(g) = world_group.as_deref() {
            // Every rank's file is written before rank 0 draws them.
            crate::comm::all_reduce_values(g, &[0.0], crate::comm::ReduceOp::Sum)?;
        }
        observers.attach_profile(dir)?;
    }
    save_checkpoint(&mut trainer)?;
    if let Some(saver) = saver.into_inner() {
        let persisted = saver
            .close(world_group.as_deref())
            .map_err(|e| Error::Checkpoint(format!("saving the last checkpoint: {e}{}", config.last_checkpoint())))?;
        if ranks.leader() {
            info!(persisted_s = persisted.map(|p| p.seconds), "checkpoints persisted");
        }
    }
    let leader = ranks.leader();
    if let Some(path) = &config.outputs.weights {
        // Every rank takes part in gathering the units; rank 0 writes them.
        trainer.save_weights(WeightsTarget::File(path), leader).map_err(|e| {
            Error::Checkpoint(format!("saving the weights to {}: {e}{}", path.display(), config.last_checkpoint()))
        })?;
        if leader {
            info!(path = %path.display(), "saved weights");
        }
    }
    if let (Some(dir), Some(lora)) = (&config.outputs.adapter_folder, strategy.lora()) {
        let out = AdapterOut {
            dir: dir.clone(),
            config: lora.clone(),
            base_model: config.init.iter().find_map(|i| match i {
                InitialWeights::Folder(m) => Some(m.dir.display().to_string()),
                _ => None,
            }),
            fan_in_fan_out: matches!(model.config, Some(ModelConfig::Gpt(_))),
            classifier: matches!(&model.config, Some(ModelConfig::Llama(c)) if c.head == DecoderHead::Reward),
            release: config.init.iter().any(|i| matches!(i, InitialWeights::Folder(m) if m.release.is_some())),
            family: config.init.iter().find_map(|i| match i {
                InitialWeights::Folder(m) => Some(m.family),
                _ => None,
            }),
        };
        trainer
            .save_weights(WeightsTarget::Adapter(&out), leader)
            .map_err(|e| Error::Checkpoint(format!("saving the adapter folder {}: {e}", dir.display())))?;
        if leader {
            info!(path = %dir.display(), "saved adapter folder");
        }
    }
    if let Some(out) = &config.outputs.model_folder {
        trainer
            .save_weights(WeightsTarget::Folder(out), leader)
            .map_err(|e| Error::Checkpoint(format!("saving the model folder {}: {e}", out.dir.display())))?;
        if leader {
            info!(path = %out.dir.display(), "saved model folder");
        }
    }
    Ok(RunSummary { last, strategy, rank: ranks.rank(), world_size: ranks.world() })
}

/// What a run scores its model by beyond next-token prediction: a language model's
/// preferences (DPO and its family, KTO), a reward model's pairs, or GRPO's completions.
enum Objective {
    Preference(Arc<PreferenceObjective>),
    Reward(Arc<RewardObjective>),
    Grpo(Arc<GrpoObjective>),
}

impl Objective {
    fn preference(&self) -> Option<Arc<PreferenceObjective>> {
        match self {
            Objective::Preference(p) => Some(p.clone()),
            _ => None,
        }
    }

    fn loss_fn(&self) -> ScoreFn {
        match self {
            Objective::Preference(p) => p.loss_fn(),
            Objective::Reward(r) => r.loss_fn(),
            Objective::Grpo(g) => g.loss_fn(),
        }
    }

    fn reset(&self) {
        match self {
            Objective::Preference(p) => p.reset(),
            Objective::Reward(r) => r.reset(),
            Objective::Grpo(g) => g.reset(),
        }
    }

    /// What the data is called in messages.
    fn data(&self) -> &'static str {
        match self {
            Objective::Grpo(_) => "GRPO",
            Objective::Preference(_) | Objective::Reward(_) => "preference pairs",
        }
    }
}

/// The objective the training data asks for, its loss made the run's: GRPO where the data
/// holds prompts alone, a reward model's scoring where it holds pairs and the model is one,
/// else the preference loss; refused beside a loss of the caller's own.
fn objective_of(data: &Data, config: &mut RunConfig, model: &Model) -> Result<Option<Objective>> {
    let objective = if matches!(data.train.as_ref(), Dataset::Prompts(_)) {
        let Some(run) = &config.grpo else {
            return Err(Error::Config(format!(
                "{}: prompts alone are trained on by GRPO, which needs a reward (a function, or --reward-command)",
                data.train.source()
            )));
        };
        if data.validation.is_some() {
            return Err(Error::Config(
                "GRPO trains on prompts and has no validation loss: give no validation data".into(),
            ));
        }
        Some(Objective::Grpo(GrpoObjective::new(run.config.clone())?))
    } else if config.grpo.is_some() {
        return Err(Error::Config(format!(
            "{}: GRPO trains on records of a \"prompt\" alone (no completion)",
            data.train.source()
        )));
    } else {
        pair_objective(data, config, model)?
    };
    if let Some(o) = &objective {
        if config.loss.is_some() {
            return Err(Error::Config(format!("{}: scored by its own loss, not by a loss_func", o.data())));
        }
        config.loss = Some(o.loss_fn());
    }
    Ok(objective)
}

/// The scoring of preference pairs where the training data holds them: a reward model's
/// where the model is one, else the preference loss.
fn pair_objective(data: &Data, config: &RunConfig, model: &Model) -> Result<Option<Objective>> {
    let pairs = |d: &Dataset| matches!(d, Dataset::Preference(_));
    if !pairs(&data.train) {
        if data.validation.as_deref().is_some_and(pairs) {
            return Err(Error::Config("the validation data holds preference pairs, the training data does not".into()));
        }
        return Ok(None);
    }
    if data.validation.as_deref().is_some_and(|v| !pairs(v)) {
        return Err(Error::Config("the training data holds preference pairs, the validation data does not".into()));
    }
    let Dataset::Preference(set) = data.train.as_ref() else { return Ok(None) };
    let reward_model = match model.config.as_ref() {
        Some(ModelConfig::Llama(c)) if c.head == DecoderHead::Reward => Some(c),
        _ => None,
    };
    let objective = match reward_model {
        Some(c) => {
            if set.is_unpaired() {
                return Err(Error::Config(format!(
                    "{}: a reward model trains on pairs of a chosen and a rejected completion, not on labelled \
                     completions",
                    set.source
                )));
            }
            let pad = config.reward.pad_token.or(c.padding_token).ok_or_else(|| {
                Error::Config(
                    "a reward model reads each row's reward at its last token before the padding: give the \
                     padding token (the folder's pad_token_id, or the reward configuration's pad_token)"
                        .into(),
                )
            })?;
            Objective::Reward(RewardObjective::new(config.reward.clone(), pad)?)
        }
        None => {
            let unpaired_loss = config.preference.losses.iter().any(|(l, _)| l.unpaired());
            match (set.is_unpaired(), unpaired_loss) {
                (true, false) => {
                    return Err(Error::Config(format!(
                        "{}: unpaired completions (records with a \"label\") are scored by kto or apo_zero_unpaired",
                        set.source
                    )))
                }
                (false, true) => {
                    return Err(Error::Config(format!(
                        "{}: kto and apo_zero_unpaired score unpaired completions (records of \"completion\" and \
                         \"label\"), not pairs (read pairs with PreferenceFormat::unpair to unpair them)",
                        set.source
                    )))
                }
                _ => {}
            }
            // Each record's KL completion is the one before it in its micro-batch, as TRL's is.
            let kto = config.preference.losses.iter().any(|(l, _)| *l == crate::preference::PreferenceLoss::Kto);
            let micro_batch = config.batching.batch_size / config.batching.accumulation.max(1);
            if kto && micro_batch < 2 {
                return Err(Error::Config(format!(
                    "kto: a micro-batch of {micro_batch} record (--batch-size / --accumulation) makes each record's \
                     KL completion its own, and the KL estimate its own reward: give 2 or more"
                )));
            }
            Objective::Preference(PreferenceObjective::new(config.preference.clone())?)
        }
    };
    Ok(Some(objective))
}

/// Refuses what a preference or GRPO run cannot take, in one line naming why: the loss
/// scores a whole row's logits over the whole vocabulary, and a synced reference follows
/// the whole model.
fn check_objective_strategy(objective: &Objective, strategy: &Strategy, config: &RunConfig) -> Result<()> {
    let synced = objective.preference().is_some_and(|p| p.config().reference_sync.is_some());
    let why = if strategy.context_parallel().is_some() {
        Some("context parallelism splits a completion's tokens over ranks")
    } else if strategy.chunked_loss().is_some() {
        Some("chunked_loss gives a next-token loss, not the logits a completion's score sums")
    } else if config.cuda_graph {
        Some("a captured step cannot read the completions' metrics")
    } else if synced && strategy.lora().is_some() {
        Some("a synced reference is a copy of the whole model; LoRA's reference is the model as it started")
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::Config(format!("{}: {why}", objective.data()))),
        None => Ok(()),
    }
}

/// Pairs `indices` of `pairs` scored by the trainer's model as it is (each rank all of them,
/// so every rank runs the same forwards) in batches of `rows` pairs: each pair's summed
/// log-probabilities `[chosen, rejected]`. `None` on ranks that score nothing (a pipeline's
/// earlier stages). `split`: where a tensor-parallel group splits the logits' vocabulary.
fn score_pairs(
    trainer: &mut Trainer,
    pairs: &PreferenceSet,
    indices: &[usize],
    config: &RunConfig,
    rows: usize,
    split: Option<VocabularySplit>,
) -> Result<Option<Vec<[f64; 2]>>> {
    let chunks: Vec<&[usize]> = indices.chunks(rows.max(1)).collect();
    let steps = chunks
        .iter()
        .enumerate()
        .map(|(i, chunk)| Ok(Step::new(i, vec![pairs.batch(chunk)?.to_device(config.device)?])))
        .collect::<Result<Vec<_>>>()?;
    let recorded = record_scores(trainer, &steps, &config.feed(), split)?;
    if recorded.is_empty() {
        return Ok(None);
    }
    // Each batch's rows are its pairs' chosen rows, then their rejected ones.
    let mut scores = Vec::with_capacity(indices.len());
    let mut at = 0;
    for chunk in chunks {
        let n = chunk.len();
        let batch = recorded
            .get(at..at + 2 * n)
            .ok_or_else(|| Error::Engine(format!("{} reference scores for {} pairs", recorded.len(), indices.len())))?;
        scores.extend((0..n).map(|i| [batch[i], batch[n + i]]));
        at += 2 * n;
    }
    Ok(Some(scores))
}

/// A frozen whole copy's logits of `batch`'s rows, forward only: a reference's.
fn copy_logits(copy: &mut Engine, batch: &Batch) -> Result<tch::Tensor> {
    crate::train::set_rows(copy, batch, None);
    let logits = copy.evaluate(&batch.inputs);
    copy.set_targets(None);
    logits
}

/// A step of each of `batches`, on `device`: what a trainer evaluates them as, one by one.
fn steps_of(batches: &[Batch], device: tch::Device) -> Result<Vec<Step>> {
    batches.iter().enumerate().map(|(i, b)| Ok(Step::new(i, vec![b.to_device(device)?]))).collect()
}

/// Each row's summed completion log-probability under the trainer's model as it is, over
/// every micro-batch of `steps` in order (forward only); none on ranks that score nothing (a
/// pipeline's earlier stages).
fn record_scores(
    trainer: &mut Trainer,
    steps: &[Step],
    feed: &Feed,
    split: Option<VocabularySplit>,
) -> Result<Vec<f64>> {
    let recorded = Arc::new(std::sync::Mutex::new(vec![]));
    trainer.set_feed(&Feed {
        loss: Some(crate::preference::reference_recorder(recorded.clone(), split)),
        input: feed.input.clone(),
    });
    let scored = trainer.evaluate(steps);
    trainer.set_feed(feed);
    scored?;
    let recorded = std::mem::take(&mut *recorded.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(recorded)
}

/// How far a stored score may be from the same pair's score now and still be taken for the
/// same model's: a layout or thread count changes the sums' rounding, not their leading digits.
fn same_score(stored: f64, now: f64) -> bool {
    (stored - now).abs() <= 1e-4 * (1.0 + now.abs())
}

/// The run's pair sets with their reference scores attached, each set's taken from its
/// records where they give them, else from the file `store` names where it holds the
/// scores of the same rows, else scored by the trainer's model (and written to `store`).
/// Every rank comes to the same choice over `world`, so all run the same forwards; a file
/// holding other rows' scores under a set's name, or scores the model does not give its
/// first pairs, is refused in one line.
fn attach_references(
    trainer: &mut Trainer,
    data: &Data,
    config: &RunConfig,
    rows: usize,
    split: Option<VocabularySplit>,
    world: Option<&dyn ProcessGroup>,
) -> Result<Data> {
    let store = config.preference.reference_scores.as_deref();
    let mut stored = match store {
        Some(path) => StoredReference::read(path)?,
        None => None,
    };
    let mut changed = false;
    let mut attach = |name: &str, set: &Arc<Dataset>| -> Result<Arc<Dataset>> {
        let Dataset::Preference(pairs) = set.as_ref() else { return Ok(set.clone()) };
        if pairs.reference().is_some() {
            if let Some(path) = store {
                return Err(Error::Config(format!(
                    "{}: the records give their own reference scores, which {} would not keep",
                    pairs.source,
                    path.display()
                )));
            }
            return Ok(set.clone());
        }
        // 0: to score, 1: read from the file, 2: the file holds other rows' scores.
        let (state, found) = match stored.as_ref().map(|s| s.set(name, pairs)) {
            Some(StoredSet::Scores(scores)) => (1.0, Some(scores.to_vec())),
            Some(StoredSet::OtherRows) => (2.0, None),
            Some(StoredSet::Absent) | None => (0.0, None),
        };
        let [most, least] = match world {
            Some(g) => {
                let m = crate::comm::all_reduce_values(g, &[state, -state], crate::comm::ReduceOp::Max)?;
                [m[0], -m[1]]
            }
            None => [state, state],
        };
        let path = store.map(|p| p.display().to_string()).unwrap_or_default();
        if most == 2.0 {
            return Err(Error::Data(format!(
                "{path} holds reference scores of other {name} pairs than {}: remove it or name another file",
                pairs.source
            )));
        }
        let mut pairs = pairs.clone();
        match (least == 1.0, found) {
            (true, Some(scores)) => {
                // The stored scores must be the model's own: its first pairs scored again.
                let first: Vec<usize> = (0..rows.clamp(1, pairs.len())).collect();
                let now = score_pairs(trainer, &pairs, &first, config, rows, split.clone())?;
                let differ = now.as_ref().and_then(|now| {
                    now.iter()
                        .zip(&scores)
                        .enumerate()
                        .find(|(_, (a, b))| !(same_score(b[0], a[0]) && same_score(b[1], a[1])))
                });
                let mine = differ.map(|(i, (now, was))| (i, now[0], was[0]));
                let any = match world {
                    Some(g) => {
                        let flag = mine.is_some() as u8 as f64;
                        crate::comm::all_reduce_values(g, &[flag], crate::comm::ReduceOp::Max)?[0] > 0.0
                    }
                    None => mine.is_some(),
                };
                if any {
                    let detail = mine.map_or(String::new(), |(i, now, was)| {
                        format!(" (pair {i}'s chosen completion: {was} stored, {now} now)")
                    });
                    return Err(Error::Data(format!(
                        "{path}: its {name} reference scores are not this model's{detail}: remove it or name another file"
                    )));
                }
                info!(pairs = pairs.len(), from = %path, set = name, "reference scores read");
                pairs.set_reference(scores)?;
            }
            _ => {
                let all: Vec<usize> = (0..pairs.len()).collect();
                // Ranks that score nothing keep the set as it is: they never read its scores.
                let Some(scores) = score_pairs(trainer, &pairs, &all, config, rows, split.clone())? else {
                    return Ok(set.clone());
                };
                pairs.set_reference(scores)?;
                if store.is_some() {
                    stored.get_or_insert_with(StoredReference::default).insert(name, &pairs)?;
                    changed = true;
                }
            }
        }
        Ok(Arc::new(Dataset::Preference(pairs)))
    };
    let train = attach("train", &data.train)?;
    let validation = data.validation.as_ref().map(|v| attach("validation", v)).transpose()?;
    // The file is written by the first rank that holds every set's scores.
    if let (Some(path), Some(stored)) = (store, stored.as_ref()) {
        let holds = changed as u8 as f64;
        let rank = world.map_or(0, |g| g.rank()) as f64;
        let writer = match world {
            Some(g) => -crate::comm::all_reduce_values(
                g,
                &[if holds > 0.0 { -rank } else { f64::MIN }],
                crate::comm::ReduceOp::Max,
            )?[0],
            None => rank,
        };
        if changed && writer == rank {
            stored.write(path)?;
            info!(path = %path.display(), "reference scores written");
        }
    }
    Ok(Data { train, validation })
}

/// A reference that scores each micro-batch's pairs just before the policy trains on them
/// (or before validation reads them).
enum LiveReference {
    /// LoRA's model as it started, laid out as the trainer's model is.
    Lora { reference: LoraReference, feed: Feed, split: Option<VocabularySplit> },
    /// The weights the trainer's parts started with, swapped in while they score: the frozen
    /// model where pipeline stages split it. TR-DPO's follows the policy every `sync.every`
    /// steps.
    Kept {
        weights: KeptWeights,
        sync: Option<crate::preference::ReferenceSync>,
        feed: Feed,
        split: Option<VocabularySplit>,
    },
    /// A whole copy of the model, split over the trainer's tensor group; TR-DPO's follows the
    /// policy every `sync.every` steps.
    Copy { copy: Box<Engine>, sync: Option<crate::preference::ReferenceSync>, split: Option<VocabularySplit> },
}

impl LiveReference {
    /// Gives each of `batches` its rows' reference scores, where this rank scores them.
    fn score(&mut self, trainer: &mut Trainer, batches: &mut [Batch]) -> Result<()> {
        let steps = || steps_of(batches, trainer.engine().config().device);
        let recorded = match self {
            LiveReference::Lora { reference, feed, split } => {
                let steps = steps()?;
                reference.scoring(trainer, |t| record_scores(t, &steps, feed, split.clone()))?
            }
            LiveReference::Kept { weights, feed, split, .. } => {
                let steps = steps()?;
                weights.scoring(trainer, |t| record_scores(t, &steps, feed, split.clone()))?
            }
            LiveReference::Copy { copy, split, .. } => {
                for batch in batches {
                    let logits = copy_logits(copy, batch)?;
                    batch.reference = Some(crate::preference::row_scores(&logits, batch, split.as_ref())?);
                }
                return Ok(());
            }
        };
        if recorded.is_empty() {
            return Ok(());
        }
        let mut at = 0;
        for batch in batches {
            let rows = batch.inputs.size()[0] as usize;
            let scores = recorded
                .get(at..at + rows)
                .ok_or_else(|| Error::Engine(format!("{} reference scores for a step's rows", recorded.len())))?;
            batch.reference = Some(tch::Tensor::f_from_slice(scores)?);
            at += rows;
        }
        Ok(())
    }

    /// After optimizer step `step`: TR-DPO's reference, where its sync is due, moves each of
    /// its parameters to `mixup` of the trainer's and the rest of its own (every rank
    /// together: the trainer's units are gathered whole).
    fn follow(&mut self, trainer: &mut Trainer, step: u64) -> Result<()> {
        let (Self::Copy { sync: Some(sync), .. } | Self::Kept { sync: Some(sync), .. }) = self else { return Ok(()) };
        if !step.is_multiple_of(sync.every) {
            return Ok(());
        }
        let mixup = sync.mixup;
        match self {
            LiveReference::Kept { weights, .. } => weights.follow(trainer, mixup),
            LiveReference::Copy { copy, .. } => {
                trainer.settle_updates()?;
                for unit in 0..copy.spec().units.len() {
                    let policy = trainer.engine_mut().full_unit(unit)?;
                    let mixed = crate::train::synced(&copy.full_unit(unit)?, &policy, mixup)?;
                    copy.set_full_unit(unit, &mixed)?;
                }
                Ok(())
            }
            LiveReference::Lora { .. } => Ok(()),
        }
    }
}

/// A frozen whole copy of the model as `init` starts it: GRPO's reference at `beta > 0`
/// where no LoRA base serves.
fn reference_copy(spec: ModelSpec, config: &EngineConfig, init: &[InitialWeights]) -> Result<Engine> {
    let mut engine = Engine::new(spec, config.clone())?;
    load_initial_weights(init, &mut engine)?;
    Ok(engine)
}

/// The record of the base weights among `init` (weights files and model folders), in order.
fn base_record(init: &[InitialWeights]) -> Result<BaseRecord> {
    let (mut sources, mut files) = (vec![], vec![]);
    for weights in init {
        match weights {
            InitialWeights::File(path) => {
                sources.push(path.display().to_string());
                files.push(path.clone());
            }
            InitialWeights::Folder(dir) => {
                sources.push(dir.dir.display().to_string());
                files.extend(dir.weights.iter().cloned());
            }
            InitialWeights::Adapter(_) => {}
        }
    }
    BaseRecord::of(sources, &files)
}

/// Loads the run's initial weights into `engine` (one part of the model: each takes the
/// parameters it holds), in order.
fn load_initial_weights(init: &[InitialWeights], engine: &mut Engine) -> Result<()> {
    // An adapter's keys are its base folder's module names.
    let family = init.iter().find_map(|i| match i {
        InitialWeights::Folder(m) => Some(m.family),
        _ => None,
    });
    for weights in init {
        match weights {
            InitialWeights::File(path) => crate::io::load_weights(engine, path)?,
            InitialWeights::Folder(dir) => crate::io::load_model_dir(engine, dir)?,
            InitialWeights::Adapter(dir) => crate::io::load_adapter(engine, dir, family)?,
        }
    }
    Ok(())
}

/// What of this run's data settings differ from the saved run's, each with what it changes.
fn data_differences(saved: &DataPosition, here: &DataPosition) -> Vec<String> {
    let mut differences = vec![];
    if saved.seed != here.seed {
        differences.push(format!(
            "seed {} (saved: {}) draws another order of the rows and other dropout masks",
            here.seed, saved.seed
        ));
    }
    if saved.batch_size != here.batch_size {
        differences.push(format!(
            "batch size {} (saved: {}) puts other rows into step {}",
            here.batch_size, saved.batch_size, saved.next_step
        ));
    }
    if saved.ctx != here.ctx {
        differences.push(format!("ctx {} (saved: {}) cuts other rows", here.ctx, saved.ctx));
    }
    differences
}

/// Each rank's engine: device, seed and memory budgets.
fn engine_config_of(config: &RunConfig) -> EngineConfig {
    EngineConfig {
        device: config.device,
        seed: config.batching.seed as i64,
        device_budget: config.device_memory,
        host_budget: config.host_memory,
        ..Default::default()
    }
}

/// Checks the data against the model and the run before anything is built.
fn check_data(model: &Model, data: &Data, config: &RunConfig) -> Result<()> {
    if config.cuda_graph {
        let host_side = [
            (config.batching.pack, "packed rows (--pack) are laid out on the host for each step"),
            (
                config.unit_times,
                "unit times (--unit-times) are host clocks around each unit, which a replay runs none of",
            ),
            (
                config.outputs.profile.is_some(),
                "a profile (--profile) records each unit's phases on the host, which a replay runs none of",
            ),
        ];
        if let Some((_, why)) = host_side.iter().find(|(applies, _)| *applies) {
            return Err(Error::Config(format!("cuda_graph: {why}")));
        }
    }
    if config.batching.pack && !matches!(data.train.as_ref(), Dataset::Examples(_)) {
        return Err(Error::Config("packing joins examples into rows: train on example data".into()));
    }
    if let Some(model) = &model.config {
        for set in std::iter::once(&data.train).chain(&data.validation) {
            set.check_fits(config.batching.ctx, model.vocab() as usize)?;
            if let Some(types) = model.token_types() {
                set.check_token_types(types)?;
            }
        }
    }
    if let Order::Offsets(offsets) = &config.batching.order {
        if (offsets.offsets.len() as u64) < config.steps {
            return Err(Error::Data(format!(
                "the batch offsets hold {} steps, fewer than the run's {}",
                offsets.offsets.len(),
                config.steps
            )));
        }
    }
    Ok(())
}

/// `strategy` with the LoRA configuration of an adapter folder the run starts from, where
/// it has none; one that differs from the folder's is refused.
fn with_adapter_config(mut strategy: Strategy, init: &[InitialWeights]) -> Result<Strategy> {
    for dir in adapter_folders(init) {
        let folder = crate::io::read_adapter_config(dir)?;
        match strategy.lora() {
            None => strategy.methods.push(crate::strategy::Method::Lora(folder)),
            Some(given) if given.same_adapters(&folder) => {}
            Some(given) => {
                return Err(Error::Config(format!(
                    "the adapter folder {} holds r={} alpha={} on {}; the strategy's lora asks for r={} alpha={} on {} \
                     (ranks, scales, patterns, targets, layer choices and saved modules must all agree)",
                    dir.display(),
                    folder.r,
                    folder.alpha,
                    folder.targets_text(),
                    given.r,
                    given.alpha,
                    given.targets_text()
                )))
            }
        }
    }
    Ok(strategy)
}

/// Under LoRA, a reward model's score head trains whole beside the adapters (it starts
/// untrained), as peft's sequence-classification task keeps `score` among `modules_to_save`.
fn train_score_head(strategy: &mut Strategy) {
    for method in &mut strategy.methods {
        if let crate::strategy::Method::Lora(lora) = method {
            if !lora.modules_to_save.iter().any(|m| m == "score") {
                lora.modules_to_save.push("score".into());
            }
        }
    }
}

fn adapter_folders(init: &[InitialWeights]) -> impl Iterator<Item = &PathBuf> {
    init.iter().filter_map(|i| match i {
        InitialWeights::Adapter(dir) => Some(dir),
        _ => None,
    })
}

/// The strategy the run trains with, and data parallelism's options (buckets tuned by a
/// search).
fn choose_strategy(
    model: &Model,
    data: &Data,
    config: &RunConfig,
    ranks: &Ranks,
    engine: &EngineConfig,
) -> Result<(Strategy, DataParallelOptions)> {
    let options = match &config.strategy {
        StrategySource::Given(s) => return Ok((s.clone(), config.data_parallel)),
        StrategySource::PatrickStar(p) => {
            return Ok((p.strategy(&model.spec(&config.freeze, None)?, ranks.world())?, config.data_parallel))
        }
        StrategySource::Auto(options) => options,
    };
    let build = |b: &mut Builder| (model.build)(b);
    let mut job = AutoAccelerate::new(&build, data.train.clone(), config.batching.clone());
    job.freeze = config.freeze.clone();
    job.optim = config.optimizer.clone();
    job.lr_scheduler = config.schedule.clone();
    job.grad_clip = config.grad_clip;
    job.loss_func = config.loss.clone();
    if let Some(input) = &config.prepare_input {
        job.prepare_input = input.clone();
    }
    job.engine = engine.clone();
    if let (Some(run), Dataset::Prompts(prompts)) = (&config.grpo, data.train.as_ref()) {
        grpo_dry_runs(&mut job, run, prompts, model, config)?;
    }
    job.comm = ranks.comm.as_ref();
    job.local_world_size = ranks.local_world_size;
    // A run that starts from an adapter folder trains adapters wherever full fine-tuning
    // does not fit.
    let lora = match (&options.lora, adapter_folders(&config.init).next()) {
        (None, Some(dir)) => Some(Box::new(crate::io::read_adapter_config(dir)?)),
        (given, _) => given.clone(),
    };
    job.options =
        AutoOptions { find_unused_parameters: config.data_parallel.find_unused_parameters, lora, ..options.clone() };
    let choice = auto::choose_strategy(&job)?;
    if ranks.leader() {
        if options.verbose {
            eprint!("{}", choice.report.table());
        }
        info!(
            strategy = %choice.strategy.to_value(),
            dry_runs = choice.report.dry_runs,
            seconds = format!("{:.1}", choice.report.seconds),
            "chose a strategy"
        );
        if let Some(path) = &config.outputs.search_report {
            let text = serde_json::to_vec_pretty(&choice.report).map_err(|e| Error::Config(e.to_string()))?;
            crate::io::write_atomic(path, &text)?;
        }
    }
    Ok((choice.strategy, DataParallelOptions { bucket_bytes: choice.bucket_bytes, ..config.data_parallel }))
}

/// GRPO's search: its dry runs train on rows as long as its training rows at their longest
/// (each prompt and a whole completion, the next-token loss standing for GRPO's, which
/// reads the same logits), each first decodes a rank's generation batch as generation does, and
/// where the KL term reads a frozen copy of the model (no LoRA) each dry run's peak counts
/// the rank's share of its fp32 weights.
fn grpo_dry_runs(
    job: &mut AutoAccelerate<'_>,
    run: &grpo::GrpoRun,
    prompts: &PromptSet,
    model: &Model,
    config: &RunConfig,
) -> Result<()> {
    let c = &run.config;
    let longest = (0..prompts.len()).max_by_key(|&i| prompts.prompt(i).len());
    let prompt = longest.map(|i| prompts.prompt(i)).ok_or_else(|| Error::Data("no prompt to search with".into()))?;
    job.dataset = Arc::new(Dataset::Examples(prompts.at_completion_length(c.max_completion_length)));
    job.loss_func = None;
    job.generation = Some(GenerationProbe {
        prompt,
        micro_batches: c.steps_per_generation,
        new_tokens: c.max_completion_length,
        vocab: model.config.as_ref().map(|m| m.vocab()),
        reference_copy: c.beta != 0.0 && job.options.lora.is_none() && adapter_folders(&config.init).next().is_none(),
    });
    Ok(())
}

/// Without a thread count (or `OMP_NUM_THREADS`), the ranks of one host split its cores
/// between them, as torchrun's one thread per rank does for its default: libtorch would
/// otherwise give every rank a thread per core, and the ranks would take turns on them.
fn share_cores(threads: Option<i32>, local_world_size: usize) {
    if threads.is_some() || local_world_size < 2 || std::env::var_os("OMP_NUM_THREADS").is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let share = (cores / local_world_size).max(1);
    tch::set_num_threads(share as i32);
    info!(threads = share, cores, ranks = local_world_size, "compute threads per rank (threads sets them)");
}

/// Stops `profiler` and writes this rank's file into `dir`.
fn save_profile(profiler: &Profiler, dir: &Path, rank: usize) -> Result<()> {
    profiler.end();
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    profiler.save(&Profiler::rank_file(dir, rank))
}
