//! `strata train`: build the model, load data and weights, run the steps, report.
use crate::options::{StrategyChoice, TrainSettings};
use crate::run_io::{
    checkpoint_due, checkpoint_to_resume, data_position, load_data, load_initial_weights, load_validation,
    log_progress, model_folder, optimizer_name, validation_due,
};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::sync::Arc;
use strata::auto::{self, AutoAccelerate, AutoOptions, DataloaderArgs};
use strata::checkpoint::{self, RunInfo};
use strata::comm::{all_reduce_values, init_from_env, launched_world_size, RankInfo, ReduceOp};
use strata::data::{validation_steps, BatchOffsets, DataLoader, LoaderConfig, Order};
use strata::engine::{EngineConfig, EventSink, EventSinks, UnitClock};
use strata::io::WeightsTarget;
use strata::model::Builder;
use strata::optim::{Optimizer, OptimizerKind};
use strata::parallel::{self, DataParallelOptions, Placement};
use strata::profile::Profiler;
use strata::train::{StepReport, Trainer};
use tracing::info;

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", UNITS[i])
}

/// Where the newest complete checkpoint of this run is, as a clause for a failed save.
fn last_checkpoint(settings: &TrainSettings) -> String {
    let Some(root) = &settings.save_checkpoint else { return String::new() };
    match checkpoint::latest(root) {
        Ok(dir) => format!(" (the newest complete checkpoint is {})", dir.display()),
        Err(_) => " (no checkpoint was completed)".into(),
    }
}

/// Every output location is checked before the first step (and before any search), so a
/// long run is never lost to a path that could not be written. Every rank checks: they all
/// write into the checkpoint folder, and a rank that stops here stops before joining.
fn check_outputs(settings: &TrainSettings, params: u64) -> Result<()> {
    use strata::io::{check_output, Output};
    let states = match settings.optimizer.kind {
        OptimizerKind::Sgd if settings.optimizer.momentum == 0.0 => 0,
        OptimizerKind::Sgd => 1,
        _ => 2,
    };
    // fp32 values: weights once; a checkpoint holds parameters and each optimizer state.
    let files = [
        ("--save-weights", &settings.save_weights, params * 4),
        ("--metrics", &settings.metrics, 0),
        ("--save-strategy", &settings.save_strategy, 0),
        ("--search-report", &settings.search_report, 0),
    ];
    for (flag, path, bytes) in files {
        if let Some(path) = path {
            check_output(flag, path, Output::File, bytes)?;
        }
    }
    if let Some(dir) = &settings.save_checkpoint {
        check_output("--save-checkpoint", dir, Output::Folder, params * 4 * (1 + states))?;
    }
    if let Some(dir) = &settings.save_model_dir {
        check_output("--save-model-dir", dir, Output::Folder, params * 4)?;
    }
    Ok(())
}

/// Without `--threads` (or `OMP_NUM_THREADS`), the ranks of one host split its cores
/// between them, as torchrun's one thread per rank does for its default: libtorch would
/// otherwise give every rank a thread per core, and the ranks would take turns on them.
fn share_cores(threads: Option<i32>, local_world_size: usize) {
    if threads.is_some() || local_world_size < 2 || std::env::var_os("OMP_NUM_THREADS").is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let share = (cores / local_world_size).max(1);
    tch::set_num_threads(share as i32);
    info!(threads = share, cores, ranks = local_world_size, "compute threads per rank (--threads sets them)");
}

pub fn run(mut settings: TrainSettings) -> Result<()> {
    // Count every CPU allocation from here on (activation memory in the metrics).
    strata_ext::cpu_memory::track()?;
    let launched = match launched_world_size() {
        Some(world) if world > 1 => Some(RankInfo::from_env().context("joining the job")?),
        _ => None,
    };
    let backends = match &launched {
        Some(info) => {
            let (device, backends) = info.placement(settings.device, tch::Cuda::device_count() as usize);
            settings.device = device;
            settings.comm_backend.clone().unwrap_or(backends)
        }
        None => String::new(),
    };
    if let Some(t) = settings.threads {
        tch::set_num_threads(t);
    }
    let (data, best_loss, data_vocab) = load_data(&settings)?;
    let choice = settings.model(settings.vocab.unwrap_or(data_vocab as i64))?;
    let vocab = choice.vocab() as usize;
    let ctx = settings.ctx as usize;
    data.check_fits(ctx, vocab)?;
    let val = load_validation(&settings)?;
    if let Some(v) = &val {
        v.check_fits(ctx, vocab)?;
    }
    let order = match &settings.batch_offsets {
        Some(path) => {
            let offsets = BatchOffsets::from_file(path)?;
            if (offsets.offsets.len() as u64) < settings.steps {
                bail!(
                    "{} holds {} steps of offsets, fewer than --steps {}",
                    path.display(),
                    offsets.offsets.len(),
                    settings.steps
                );
            }
            Order::Offsets(offsets)
        }
        None => Order::Shuffled,
    };
    let engine_config = EngineConfig {
        device: settings.device,
        seed: settings.seed as i64,
        device_budget: settings.device_memory,
        host_budget: settings.host_memory,
        ..Default::default()
    };
    let data = Arc::new(data);
    let model_spec = || -> Result<strata::model::ModelSpec> {
        let mut spec = choice.spec()?;
        spec.freeze(&settings.freeze)?;
        Ok(spec)
    };
    let spec = model_spec()?;
    check_outputs(&settings, spec.num_params() as u64)?;
    // Initial weights or a checkpoint that cannot load are refused before any search or
    // step (the checkpoint is opened again, and restored, once the engine exists).
    if let Some(path) = &settings.init_weights {
        strata::io::check_weights_file(&spec, path)?;
    }
    checkpoint_to_resume(&settings)?;
    // Started as one of several ranks: join the job.
    let (comm, local_world_size) = match &launched {
        Some(info) => {
            let comm = init_from_env(&backends, settings.comm_timeout).context("joining the job")?;
            (Some(comm), info.local_world_size)
        }
        None => (None, 1),
    };
    share_cores(settings.threads, local_world_size);
    let data_parallel = DataParallelOptions {
        bucket_bytes: settings.bucket_bytes,
        find_unused_parameters: settings.find_unused_parameters,
    };
    let leader = comm.as_ref().is_none_or(|c| c.rank() == 0);
    let (strategy, data_parallel) = match &settings.strategy {
        _ if settings.patrickstar.is_some() => {
            let world = comm.as_ref().map_or(1, |c| c.size());
            let config = settings.patrickstar.as_ref().context("PatrickStar configuration")?;
            (config.strategy(&model_spec()?, world)?, data_parallel)
        }
        StrategyChoice::Given(s) if !settings.finetune_strategy => (s.clone(), data_parallel),
        given => {
            let model_fn = |b: &mut Builder| choice.build(b);
            let dataloader_args = DataloaderArgs {
                ctx,
                batch_size: settings.batch_size,
                accumulation: settings.accumulation,
                seed: settings.seed,
                order: order.clone(),
            };
            let mut job = AutoAccelerate::new(&model_fn, data.clone(), dataloader_args);
            job.freeze = settings.freeze.clone();
            job.optim = settings.optimizer.clone();
            job.lr_scheduler = settings.schedule.clone();
            job.grad_clip = settings.grad_clip;
            job.engine = engine_config.clone();
            job.comm = comm.as_ref();
            job.local_world_size = local_world_size;
            job.options = AutoOptions {
                excluded: settings.excluded.clone(),
                included: settings.included.clone(),
                load_strategy: match given {
                    StrategyChoice::Given(s) => Some(s.clone().into()),
                    StrategyChoice::Auto => None,
                },
                finetune_strategy: settings.finetune_strategy,
                verbose: true,
                time_limit: settings.time_limit,
                find_unused_parameters: settings.find_unused_parameters,
                search: settings.search,
                dry_run_steps: settings.dry_run_steps,
                ..Default::default()
            };
            let choice = auto::choose_strategy(&job)?;
            if leader {
                eprint!("{}", choice.report.table());
                info!(
                    strategy = %choice.strategy.to_value(),
                    dry_runs = choice.report.dry_runs,
                    seconds = format!("{:.1}", choice.report.seconds),
                    "chose a strategy"
                );
                if let Some(path) = &settings.search_report {
                    let text = serde_json::to_vec_pretty(&choice.report)?;
                    strata::io::write_atomic(path, &text)?;
                }
            }
            (choice.strategy, DataParallelOptions { bucket_bytes: choice.bucket_bytes, ..data_parallel })
        }
    };
    if let Some(path) = settings.save_strategy.as_ref().filter(|_| leader) {
        strategy.save(path)?;
    }
    let world_size = comm.as_ref().map_or(1, |c| c.size());
    if strategy.parallel_mode().size("pipeline", world_size)? > 1 {
        return crate::train_pipeline::run(crate::train_pipeline::PipelineRun {
            settings: &settings,
            choice: &choice,
            engine: engine_config,
            strategy: &strategy,
            comm: comm.as_ref(),
            local_world_size,
            data_parallel,
            data,
            val,
            order,
            leader,
        });
    }
    let world_group = comm.as_ref().map(|c| c.world()).transpose()?;
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
    // The ranks of one tensor group read the same batches.
    let (data_rank, data_world) = parallel::batch_shard(&strategy.parallel_mode(), rank, world)?;
    let loader_config = |start_step: u64| LoaderConfig {
        accumulation: settings.accumulation,
        rank: data_rank,
        world: data_world,
        seed: settings.seed,
        device: settings.device,
        start_step: start_step as usize,
        ..LoaderConfig::new(ctx, settings.batch_size)
    };
    let mut placement = Placement {
        comm: comm.as_ref(),
        local_world_size,
        data_parallel,
        stage: false,
        optimizer_bytes_per_element: settings.optimizer.state_bytes_per_element(),
        non_model: None,
        shard_floor: None,
    };
    if strategy.offload().is_some() || engine_config.device_budget.is_some() {
        // Offload's plan leaves room for what a step holds beside model states (beside a
        // ZeRO stage, for the step itself), measured on a step of the run's own shape; a
        // run that keeps every state on the device is refused if its step cannot fit.
        let first = DataLoader::new(data.clone(), loader_config(0), order.clone())?
            .next()
            .ok_or_else(|| anyhow::anyhow!("the data holds no step to measure offload's room on"))??;
        placement = placement
            .with_room_measured(model_spec()?, &engine_config, &strategy, &first)
            .context("measuring what a step holds beside model states")?;
    }
    let mut engine = parallel::build_engine(spec, engine_config, &strategy, &placement)?;
    load_initial_weights(&settings, &mut engine)?;
    info!(
        model = settings.model_name,
        params = engine.spec().num_params(),
        units = engine.spec().units.len(),
        tokens = data.len(),
        source = data.source,
        strategy = %strategy.to_value(),
        "training"
    );
    let optimizer = Optimizer::new(&mut engine, settings.optimizer.clone(), &[])?;
    let mut trainer = Trainer::new(engine, optimizer, settings.schedule.clone(), settings.grad_clip);
    let clock = settings.unit_times.then(|| Arc::new(UnitClock::default()));
    let profiler = settings.profile.as_ref().map(|_| Profiler::new(&trainer.engine, rank, world));
    if let (Some(c), Some(p)) = (&comm, &profiler) {
        c.observe(Some(p.clone()));
    }
    let sinks: Vec<Arc<dyn EventSink>> = clock
        .iter()
        .map(|c| c.clone() as Arc<dyn EventSink>)
        .chain(profiler.iter().map(|p| p.clone() as Arc<dyn EventSink>))
        .collect();
    if !sinks.is_empty() {
        trainer.engine.set_event_sink(Arc::new(EventSinks(sinks)));
    }
    if let Some(c) = &clock {
        c.take(); // the first step's clock starts here
    }
    trainer.scaling = strategy.grad_scaling()?;
    let optimizer_name = optimizer_name(&settings);
    let data_position = |next_step: u64| data_position(&settings, next_step);
    if let Some(ckpt) = checkpoint_to_resume(&settings)? {
        ckpt.restore(&mut trainer.engine, &mut trainer.optimizer, &optimizer_name)?;
        trainer.set_step(ckpt.meta.step);
        if let (Some(saved), Some(scaler)) = (&ckpt.meta.loss_scaler, &mut trainer.scaling.scaler) {
            scaler.resume_from(saved)?;
        }
        info!(step = ckpt.meta.step, from = %ckpt.location.display(), saved_world_size = ckpt.meta.world_size, "resumed");
    }
    let start = trainer.step();
    if start > settings.steps {
        bail!("the checkpoint is at step {start}, past --steps {}", settings.steps);
    }
    let loader_config = loader_config(start);
    let val_steps = val.as_ref().map(|v| validation_steps(v, &loader_config, settings.eval_batches, 8)).transpose()?;
    let loader = DataLoader::new(data, loader_config, order)?;
    let save_checkpoint = |trainer: &mut Trainer| -> Result<()> {
        let Some(root) = &settings.save_checkpoint else { return Ok(()) };
        let run = RunInfo {
            step: trainer.step(),
            world_size: world,
            strategy: strategy.to_value(),
            optimizer: optimizer_name.clone(),
            data: data_position(trainer.step()),
            loss_scaler: trainer.scaling.scaler.clone(),
            model: Some(choice.clone()),
        };
        let group = world_group.as_deref();
        let dir =
            checkpoint::save(root, &mut trainer.engine, &mut trainer.optimizer, &run, group, settings.keep_checkpoints)
                .with_context(|| format!("saving a checkpoint in {}{}", root.display(), last_checkpoint(&settings)))?;
        if leader {
            info!(path = %dir.display(), "saved checkpoint");
        }
        Ok(())
    };
    // Rank 0 speaks for the job: metrics, progress, saved weights.
    let mut metrics = match settings.metrics.as_ref().filter(|_| leader) {
        Some(path) => Some(crate::run_io::open_metrics(path, start)?),
        None => None,
    };
    let bar = if leader { ProgressBar::new(settings.steps) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}<{eta}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut last: Option<StepReport> = None;
    bar.set_position(start);
    for step in loader.take((settings.steps - start) as usize) {
        let mut report = trainer.train_step(&step?)?;
        if let Some(g) = &world_group {
            // Report the job, not this rank: the loss over the global batch, all tokens.
            report.loss = all_reduce_values(g.as_ref(), &[report.loss], ReduceOp::Avg)?[0];
            report.tokens *= data_world as u64;
            report.tokens_per_s *= data_world as f64;
        }
        if let Some(steps) = val_steps.as_ref().filter(|_| validation_due(&settings, report.step)) {
            let loss = trainer.evaluate(steps)?;
            // Each data rank evaluated its rows of the same batches.
            let loss = match &world_group {
                Some(g) => all_reduce_values(g.as_ref(), &[loss], ReduceOp::Avg)?[0],
                None => loss,
            };
            report.set_validation(loss);
        }
        // After the loss's all-reduce, so the next step's units wait for nothing of this one.
        report.unit_times = clock.as_ref().map(|c| c.take());
        if !report.loss.is_finite() {
            bail!("loss became {} at step {}", report.loss, report.step);
        }
        if let Some(m) = metrics.as_mut() {
            serde_json::to_writer(&mut *m, &report)?;
            // A line per step reaches the file even if the run dies later.
            m.write_all(b"\n")?;
            m.flush().context("cannot write metrics")?;
        }
        bar.set_message(format!(
            "loss {:.4}{} | {:.0} tok/s | {}",
            report.loss,
            report.val_loss.map_or(String::new(), |v| format!(" val {v:.4}")),
            report.tokens_per_s,
            human_bytes(report.peak_bytes)
        ));
        bar.inc(1);
        if leader {
            bar.suspend(|| log_progress(&settings, &report));
        }
        if checkpoint_due(&settings, report.step) {
            bar.suspend(|| save_checkpoint(&mut trainer))?;
        }
        last = Some(report);
    }
    bar.finish_and_clear();
    // What is saved below reads the model after the last step's update.
    trainer.settle_updates()?;
    if let (Some(dir), Some(profiler)) = (&settings.profile, &profiler) {
        crate::run_io::save_profile(profiler, dir, rank)?;
    }
    save_checkpoint(&mut trainer)?;
    if let Some(mut m) = metrics {
        m.flush().context("cannot write metrics")?;
    }
    if let Some(path) = &settings.save_weights {
        // Every rank takes part in gathering the units; rank 0 writes them.
        strata::io::save_weights(&mut trainer.engine, WeightsTarget::File(path), leader)
            .with_context(|| format!("saving the weights to {}{}", path.display(), last_checkpoint(&settings)))?;
        if leader {
            info!(path = %path.display(), "saved weights");
        }
    }
    if let Some(out) = model_folder(&settings, &choice)? {
        strata::io::save_weights(&mut trainer.engine, WeightsTarget::Folder(&out), leader)
            .with_context(|| format!("saving the model folder {}", out.dir.display()))?;
        if leader {
            info!(path = %out.dir.display(), "saved model folder");
        }
    }
    if let Some(r) = last.filter(|_| leader) {
        let mut line = format!("step {}: loss {:.4}", r.step, r.loss);
        if let Some(v) = r.val_loss {
            line += &format!(", validation loss {v:.4} (perplexity {:.2})", v.exp());
        }
        if let Some(best) = best_loss {
            line += &format!(" (best possible on this corpus: {best:.4})");
        }
        line += &format!(", {:.0} tokens/s, peak {}", r.tokens_per_s, human_bytes(r.peak_bytes));
        println!("{line}");
    }
    Ok(())
}
