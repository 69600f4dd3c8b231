//! The one thing a run's loop drives: a trainer over one engine, or a pipeline rank's
//! trainer over its stages. Both report the job's figures after a step, so the loop reads
//! them alike.
use super::{InitialWeights, Model, RunConfig};
use crate::checkpoint::{Checkpoint, RunInfo};
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp};
use crate::compute::scaler::LossScaler;
use crate::data::{DataLoader, Dataset, LoaderConfig, Step};
use crate::engine::{Engine, EngineConfig, EventSink};
use crate::io::WeightsTarget;
use crate::optim::Optimizer;
use crate::parallel::pipeline::{partition, PipelineSetup, PipelineTrainer};
use crate::parallel::{self, DataParallelOptions, RankLayout};
use crate::profile::Profiler;
use crate::strategy::{Balance, Strategy};
use crate::train::{StepReport, Trainer};
use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tracing::info;

/// What building either trainer needs.
pub(super) struct Setup<'a> {
    pub model: &'a Model,
    pub data: &'a Arc<Dataset>,
    pub config: &'a RunConfig,
    pub engine: EngineConfig,
    pub strategy: &'a Strategy,
    pub ranks: &'a super::Ranks,
    pub data_parallel: DataParallelOptions,
    pub loader: &'a LoaderConfig,
}

impl Setup<'_> {
    /// The run's first step, for measurements taken before training.
    fn first_step(&self) -> Result<Step> {
        DataLoader::new(self.data.clone(), self.loader.clone(), self.config.order.clone())?
            .next()
            .ok_or_else(|| Error::Data("the data holds no step to measure on".into()))?
    }
}

pub(super) enum Runner {
    Plain(Box<Trainer>),
    Pipeline(Box<PipelineTrainer>),
}

/// Loads the run's initial weights into `engine`, in order.
fn load_initial_weights(init: &[InitialWeights], engine: &mut Engine) -> Result<()> {
    for weights in init {
        match weights {
            InitialWeights::File(path) => crate::io::load_weights(engine, path)?,
            InitialWeights::Folder(dir) => crate::io::load_model_dir(engine, dir)?,
            InitialWeights::Adapter(dir) => crate::io::load_adapter(engine, dir)?,
        }
    }
    Ok(())
}

impl Runner {
    /// A trainer over one engine built for the strategy.
    pub fn plain(s: &Setup<'_>, spec: crate::model::ModelSpec) -> Result<Runner> {
        let c = s.config;
        let mut placement = RankLayout {
            comm: s.ranks.comm.as_ref(),
            local_world_size: s.ranks.local_world_size,
            data_parallel: s.data_parallel,
            stage: false,
            optimizer_bytes_per_element: c.optimizer.state_bytes_per_element(),
            non_model: None,
            shard_floor: None,
        };
        if s.strategy.offload().is_some() || s.engine.device_budget.is_some() {
            // Offload's plan leaves room for what a step holds beside model states (beside a
            // ZeRO stage, for the step itself), measured on a step of the run's own shape; a
            // run that keeps every state on the device is refused if its step cannot fit.
            let first = s.first_step()?;
            placement = placement.with_room_measured(
                s.model.spec(&c.freeze, s.strategy.lora())?,
                &s.engine,
                s.strategy,
                &first,
                &c.feed(),
            )?;
        }
        let mut engine = parallel::build_engine(spec, s.engine.clone(), s.strategy, &placement)?;
        load_initial_weights(&c.init, &mut engine)?;
        let optimizer = Optimizer::new(&mut engine, c.optimizer.clone(), &[])?;
        let mut trainer = Trainer::new(engine, optimizer, c.schedule.clone(), c.grad_clip);
        trainer.set_feed(&c.feed());
        trainer.scaling = s.strategy.grad_scaling()?;
        if c.cuda_graph {
            trainer.capture_cuda_graph(super::CUDA_GRAPH_WARMUP)?;
        }
        Ok(Runner::Plain(Box::new(trainer)))
    }

    /// A pipeline rank's trainer, its stages balanced by measured unit costs where the
    /// strategy asks for that.
    pub fn pipeline(s: &Setup<'_>) -> Result<Runner> {
        let c = s.config;
        let spec = || s.model.spec(&c.freeze, s.strategy.lora());
        let setup = |split| PipelineSetup {
            spec: &spec,
            engine: s.engine.clone(),
            strategy: s.strategy,
            comm: s.ranks.comm.as_ref(),
            local_world_size: s.ranks.local_world_size,
            data_parallel: s.data_parallel,
            optimizer: c.optimizer.clone(),
            schedule: c.schedule.clone(),
            grad_clip: c.grad_clip,
            micro_batches: c.accumulation,
            split,
        };
        // The unit costs are measured as the run feeds and scores its model.
        let mut trainer = PipelineTrainer::new(setup(None))?;
        trainer.set_feed(&c.feed());
        let pipeline = s.strategy.pipeline_parallel().unwrap_or_default();
        if pipeline.stages.is_none() && pipeline.balance == Balance::Measured {
            // The run's first step times the units.
            let first = s.first_step()?;
            let (before, stages, ranks) =
                (trainer.ranges().to_vec(), trainer.ranges().len(), trainer.pipeline().stages);
            let held = trainer.most_held()?;
            let costs = trainer.measure_units(&first)?;
            let split = partition::balance(&costs, stages, ranks, s.engine.device_budget, &held)?;
            if s.ranks.leader() {
                let ms: Vec<String> = costs.iter().map(|c| format!("{:.1}", c.seconds * 1e3)).collect();
                let kept: Vec<String> = costs.iter().map(|c| crate::profile::human_bytes(c.activation_bytes)).collect();
                info!(
                    by_parameters = ?before,
                    measured = ?split,
                    unit_ms = ms.join(" "),
                    unit_activations = kept.join(", "),
                    "balanced the stages"
                );
            }
            trainer = PipelineTrainer::new(setup(Some(split)))?;
            trainer.set_feed(&c.feed());
        }
        for engine in trainer.engines() {
            load_initial_weights(&c.init, engine)?;
        }
        Ok(Runner::Pipeline(Box::new(trainer)))
    }

    /// A profiler of this rank's engines.
    pub fn profiler(
        &self,
        model: &Model,
        config: &RunConfig,
        strategy: &Strategy,
        engine: &EngineConfig,
        rank: usize,
        world: usize,
    ) -> Result<Arc<Profiler>> {
        Ok(match self {
            Runner::Plain(t) => Profiler::new(&t.engine, rank, world),
            Runner::Pipeline(t) => {
                Profiler::of_model(&model.spec(&config.freeze, strategy.lora())?, engine, t.ledgers(), rank, world)
            }
        })
    }

    pub fn set_event_sink(&mut self, sink: Arc<dyn EventSink>) {
        match self {
            Runner::Plain(t) => t.engine.set_event_sink(sink),
            Runner::Pipeline(t) => t.set_event_sink(sink),
        }
    }

    pub fn restore(&mut self, checkpoint: &Checkpoint, optimizer_name: &str) -> Result<()> {
        match self {
            Runner::Plain(t) => {
                checkpoint.restore(&mut t.engine, &mut t.optimizer, optimizer_name)?;
                t.set_step(checkpoint.meta.step);
                if let (Some(saved), Some(scaler)) = (&checkpoint.meta.loss_scaler, &mut t.scaling.scaler) {
                    scaler.resume_from(saved)?;
                }
                Ok(())
            }
            Runner::Pipeline(t) => t.restore(checkpoint, optimizer_name),
        }
    }

    pub fn step(&self) -> u64 {
        match self {
            Runner::Plain(t) => t.step(),
            Runner::Pipeline(t) => t.step(),
        }
    }

    pub fn scaler(&self) -> Option<LossScaler> {
        match self {
            Runner::Plain(t) => t.scaling.scaler.clone(),
            Runner::Pipeline(t) => t.scaling.scaler.clone(),
        }
    }

    /// One step, reported for the job: the loss over the global batch, every data rank's
    /// tokens.
    pub fn train_step(
        &mut self,
        step: &Step,
        world: Option<&dyn ProcessGroup>,
        data_world: usize,
    ) -> Result<StepReport> {
        let mut report = match self {
            Runner::Plain(t) => {
                let mut report = t.train_step(step)?;
                if let Some(g) = world {
                    report.loss = all_reduce_values(g, &[report.loss], ReduceOp::Avg)?[0];
                }
                report
            }
            // The pipeline's report already speaks for every stage and replica.
            Runner::Pipeline(t) => t.train_step(step)?,
        };
        report.tokens *= data_world as u64;
        report.tokens_per_s *= data_world as f64;
        Ok(report)
    }

    /// The validation loss over `steps`, for the job.
    pub fn evaluate(&mut self, steps: &[Step], world: Option<&dyn ProcessGroup>) -> Result<f64> {
        match self {
            Runner::Plain(t) => {
                let loss = t.evaluate(steps)?;
                // Each data rank evaluated its rows of the same batches.
                match world {
                    Some(g) => Ok(all_reduce_values(g, &[loss], ReduceOp::Avg)?[0]),
                    None => Ok(loss),
                }
            }
            Runner::Pipeline(t) => t.evaluate(steps),
        }
    }

    /// Waits for updates still running from the last step: before reading or saving.
    pub fn settle(&mut self) -> Result<()> {
        match self {
            Runner::Plain(t) => t.settle_updates(),
            Runner::Pipeline(_) => Ok(()),
        }
    }

    pub fn save_checkpoint(
        &mut self,
        root: &Path,
        run: &RunInfo,
        world: Option<&dyn ProcessGroup>,
        keep: usize,
    ) -> Result<PathBuf> {
        match self {
            Runner::Plain(t) => crate::checkpoint::save(root, &mut t.engine, &mut t.optimizer, run, world, keep),
            Runner::Pipeline(t) => t.save_checkpoint(root, run, world, keep),
        }
    }

    /// Every rank takes part in gathering the units; those with `write` write them.
    pub fn save_weights(&mut self, target: WeightsTarget<'_>, write: bool) -> Result<()> {
        match self {
            Runner::Plain(t) => crate::io::save_weights(&mut t.engine, target, write),
            Runner::Pipeline(t) => t.save_weights(target, write),
        }
    }
}
