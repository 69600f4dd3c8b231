//! `strata train` with a pipeline (`parallel_mode`'s `("pipeline", p)`): each rank trains its
//! stages with [`PipelineTrainer`]; metrics and saved weights speak for the whole model.
use crate::options::TrainSettings;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::sync::Arc;
use strata::checkpoint::RunInfo;
use strata::comm::Comm;
use strata::data::{DataLoader, LoaderConfig, Order, TokenData};
use strata::engine::EngineConfig;
use strata::io::WeightsTarget;
use strata::model::ModelSpec;
use strata::parallel::pipeline::{partition, PipelineSetup, PipelineTrainer};
use strata::profile::Profiler;
use strata::strategy::{Balance, Strategy};
use tracing::info;

/// What the pipeline run needs from `strata train`'s set-up.
pub struct PipelineRun<'a> {
    pub settings: &'a TrainSettings,
    pub choice: &'a strata::model::ModelConfig,
    pub engine: EngineConfig,
    pub strategy: &'a Strategy,
    pub comm: Option<&'a Comm>,
    pub local_world_size: usize,
    pub data_parallel: strata::parallel::DataParallelOptions,
    pub data: Arc<TokenData>,
    pub val: Option<TokenData>,
    pub order: Order,
    pub leader: bool,
}

pub fn run(r: PipelineRun<'_>) -> Result<()> {
    let s = r.settings;
    let make = || -> strata::Result<ModelSpec> {
        let mut spec = r.choice.spec()?;
        spec.freeze(&s.freeze)?;
        Ok(spec)
    };
    let setup = |split| PipelineSetup {
        spec: &make,
        engine: r.engine.clone(),
        strategy: r.strategy,
        comm: r.comm,
        local_world_size: r.local_world_size,
        data_parallel: r.data_parallel,
        optimizer: s.optimizer.clone(),
        schedule: s.schedule.clone(),
        grad_clip: s.grad_clip,
        micro_batches: s.accumulation,
        split,
    };
    let (rank, world) = r.comm.map_or((0, 1), |c| (c.rank(), c.size()));
    let (data_rank, data_world) = strata::parallel::batch_shard(&r.strategy.parallel_mode(), rank, world)?;
    let loader_config = LoaderConfig {
        accumulation: s.accumulation,
        rank: data_rank,
        world: data_world,
        seed: s.seed,
        device: s.device,
        ..LoaderConfig::new(s.ctx as usize, s.batch_size)
    };
    let mut trainer = PipelineTrainer::new(setup(None))?;
    let config = r.strategy.pipeline_parallel().unwrap_or_default();
    if config.stages.is_none() && config.balance == Balance::Measured {
        // The run's first step times the units.
        let mut loader = DataLoader::new(r.data.clone(), loader_config.clone(), r.order.clone())?;
        let first = loader.next().ok_or_else(|| anyhow::anyhow!("the data gives no step to time the stages on"))??;
        drop(loader);
        let (before, stages, ranks) = (trainer.ranges().to_vec(), trainer.ranges().len(), trainer.pipeline().stages);
        let held = trainer.most_held()?;
        let costs = trainer.measure_units(&first)?;
        let split = partition::balance(&costs, stages, ranks, r.engine.device_budget, &held)?;
        if r.leader {
            let seconds: Vec<String> = costs.iter().map(|c| format!("{:.1}", c.seconds * 1e3)).collect();
            let kept: Vec<String> = costs.iter().map(|c| format!("{:.2}", c.activation_bytes as f64 / 1e6)).collect();
            info!(
                by_parameters = ?before,
                measured = ?split,
                unit_ms = seconds.join(" "),
                unit_activation_mb = kept.join(" "),
                "balanced the stages"
            );
        }
        trainer = PipelineTrainer::new(setup(Some(split)))?;
    }
    for engine in trainer.engines() {
        crate::run_io::load_initial_weights(s, engine)?;
    }
    let optimizer_name = crate::run_io::optimizer_name(s);
    if let Some(ckpt) = crate::run_io::checkpoint_to_resume(s)? {
        trainer.restore(&ckpt, &optimizer_name)?;
        info!(step = ckpt.meta.step, from = %ckpt.location.display(), "resumed");
    }
    let start = trainer.step();
    if start > s.steps {
        bail!("the checkpoint is at step {start}, past --steps {}", s.steps);
    }
    let profiler = match &s.profile {
        Some(_) => {
            let profiler = Profiler::of_model(&make()?, &r.engine, trainer.ledgers(), rank, world);
            trainer.set_event_sink(profiler.clone());
            if let Some(c) = r.comm {
                c.observe(Some(profiler.clone()));
            }
            Some(profiler)
        }
        None => None,
    };
    let world_group = r.comm.map(|c| c.world()).transpose()?;
    let save_checkpoint = |trainer: &mut PipelineTrainer| -> Result<()> {
        let Some(root) = &s.save_checkpoint else { return Ok(()) };
        let run = RunInfo {
            step: trainer.step(),
            world_size: world,
            strategy: r.strategy.to_value(),
            optimizer: optimizer_name.clone(),
            data: crate::run_io::data_position(s, trainer.step()),
            loss_scaler: trainer.scaling.scaler.clone(),
            model: Some(r.choice.clone()),
        };
        let dir = trainer
            .save_checkpoint(root, &run, world_group.as_deref(), s.keep_checkpoints)
            .with_context(|| format!("saving a checkpoint in {}", root.display()))?;
        if r.leader {
            info!(path = %dir.display(), "saved checkpoint");
        }
        Ok(())
    };
    let config = LoaderConfig { start_step: start as usize, ..loader_config };
    let val_steps =
        r.val.as_ref().map(|v| strata::data::validation_steps(v, &config, s.eval_batches, 8)).transpose()?;
    let loader = DataLoader::new(r.data, config, r.order)?;
    let mut metrics = match s.metrics.as_ref().filter(|_| r.leader) {
        Some(path) => Some(crate::run_io::open_metrics(path, start)?),
        None => None,
    };
    let mut last = None;
    for step in loader.take((s.steps - start) as usize) {
        let mut report = trainer.train_step(&step?)?;
        report.tokens *= data_world as u64;
        report.tokens_per_s *= data_world as f64;
        if !report.loss.is_finite() {
            bail!("loss became {} at step {}", report.loss, report.step);
        }
        if let Some(steps) = val_steps.as_ref().filter(|_| crate::run_io::validation_due(s, report.step)) {
            report.set_validation(trainer.evaluate(steps)?);
        }
        if let Some(m) = metrics.as_mut() {
            serde_json::to_writer(&mut *m, &report)?;
            writeln!(m)?;
            m.flush()?;
        }
        if r.leader {
            crate::run_io::log_progress(s, &report);
        }
        if crate::run_io::checkpoint_due(s, report.step) {
            save_checkpoint(&mut trainer)?;
        }
        last = Some(report);
    }
    if let (Some(dir), Some(profiler)) = (&s.profile, &profiler) {
        crate::run_io::save_profile(profiler, dir, rank)?;
    }
    save_checkpoint(&mut trainer)?;
    if let Some(path) = &s.save_weights {
        trainer
            .save_weights(WeightsTarget::File(path), r.leader)
            .with_context(|| format!("saving the weights to {}", path.display()))?;
    }
    if let Some(out) = crate::run_io::model_folder(s, r.choice)? {
        trainer
            .save_weights(WeightsTarget::Folder(&out), r.leader)
            .with_context(|| format!("saving the model folder {}", out.dir.display()))?;
    }
    if let Some(report) = last.filter(|_| r.leader) {
        let validation = report.val_loss.map_or(String::new(), |v| format!(", validation loss {v:.4}"));
        println!("step {}: loss {:.4}{validation}, {:.0} tokens/s", report.step, report.loss, report.tokens_per_s);
    }
    Ok(())
}
