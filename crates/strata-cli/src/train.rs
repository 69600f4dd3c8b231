//! `strata train`: build the model, load data and weights, run the steps, report.
use crate::options::{DataChoice, ModelChoice, TrainSettings};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;
use strata::comm::{init_from_env, ProcessGroup};
use strata::data::{BatchOffsets, DataLoader, LoaderConfig, Order, SyntheticCorpus, TokenData, Tokenizer};
use strata::engine::{Engine, EngineConfig};
use strata::model::{self, Builder};
use strata::optim::Optimizer;
use strata::parallel::DataParallel;
use strata::train::{StepReport, Trainer};
use tracing::info;

/// Tokens to train on, and the best loss when it is known (the synthetic corpus).
pub fn load_data(settings: &TrainSettings) -> Result<(TokenData, Option<f64>, usize)> {
    Ok(match &settings.data {
        DataChoice::Synthetic => {
            let corpus = SyntheticCorpus::default();
            (corpus.generate(), Some(corpus.best_loss()), 256)
        }
        DataChoice::Text { path, tokenizer } => {
            let tokenizer = match tokenizer {
                Some(t) => Tokenizer::from_file(t)?,
                None => Tokenizer::Bytes,
            };
            let data = TokenData::from_text_file(path, &tokenizer)?;
            (data, None, tokenizer.vocab_size())
        }
        DataChoice::TokenFile(path) => {
            let data = TokenData::from_u16_file(path)?;
            let vocab = data.vocab_needed() as usize;
            (data, None, vocab)
        }
    })
}

pub fn build_engine(choice: &ModelChoice, config: EngineConfig) -> Result<Engine> {
    let mut b = Builder::new();
    match choice {
        ModelChoice::Gpt(c) => model::gpt(c, &mut b)?,
        ModelChoice::Llama(c) => model::llama(c, &mut b)?,
        ModelChoice::Mlp(c) => model::mlp(c, &mut b)?,
    }
    Ok(Engine::new(b.build()?, config)?)
}

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

pub fn run(settings: TrainSettings) -> Result<()> {
    if let Some(t) = settings.threads {
        tch::set_num_threads(t);
    }
    let (data, best_loss, data_vocab) = load_data(&settings)?;
    let vocab = settings.vocab.unwrap_or(data_vocab as i64);
    let choice = settings.model(vocab)?;
    let ctx = settings.ctx as usize;
    data.check_fits(ctx, vocab as usize)?;
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
    let engine_config = EngineConfig { device: settings.device, seed: settings.seed as i64, ..Default::default() };
    let mut engine = build_engine(&choice, engine_config)?;
    if let Some(path) = &settings.init_weights {
        strata::io::load_weights(&mut engine, path)?;
    }
    // Started as one of several ranks: train data parallel.
    let comm = match std::env::var("WORLD_SIZE").ok().and_then(|w| w.parse::<usize>().ok()) {
        Some(world) if world > 1 => {
            let spec = if settings.device.is_cuda() { "cpu:shm,cuda:nccl" } else { "cpu:shm" };
            let comm = init_from_env(spec, Duration::from_secs(300)).context("joining the data-parallel job")?;
            let group: Arc<dyn ProcessGroup> = Arc::from(comm.world()?);
            DataParallel::install(&mut engine, group, settings.bucket_bytes)?;
            Some(comm)
        }
        _ => None,
    };
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
    let leader = rank == 0;
    info!(
        model = settings.model_name,
        params = engine.spec().num_params(),
        units = engine.spec().units.len(),
        tokens = data.len(),
        source = data.source,
        "training"
    );
    let optimizer = Optimizer::new(&engine, settings.optimizer.clone(), &[])?;
    let mut trainer = Trainer::new(engine, optimizer, settings.schedule.clone(), settings.grad_clip);
    let loader_config = LoaderConfig {
        accumulation: settings.accumulation,
        rank,
        world,
        seed: settings.seed,
        device: settings.device,
        ..LoaderConfig::new(ctx, settings.batch_size)
    };
    let loader = DataLoader::new(Arc::new(data), loader_config, order)?;
    // Rank 0 speaks for the job: metrics, progress, saved weights.
    let mut metrics = match settings.metrics.as_ref().filter(|_| leader) {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("cannot create metrics file {}", path.display()))?,
        )),
        None => None,
    };
    let bar = if leader { ProgressBar::new(settings.steps) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}<{eta}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut last: Option<StepReport> = None;
    for step in loader.take(settings.steps as usize) {
        let report = trainer.train_step(&step?)?;
        if !report.loss.is_finite() {
            bail!("loss became {} at step {}", report.loss, report.step);
        }
        if let Some(m) = metrics.as_mut() {
            serde_json::to_writer(&mut *m, &report)?;
            m.write_all(b"\n")?;
        }
        bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | {}",
            report.loss,
            report.tokens_per_s,
            human_bytes(report.peak_bytes)
        ));
        bar.inc(1);
        if leader && report.step % settings.log_every == 0 {
            bar.suspend(|| {
                info!(
                    step = report.step,
                    loss = report.loss,
                    lr = report.lr,
                    tokens_per_s = report.tokens_per_s as u64,
                    "progress"
                )
            });
        }
        last = Some(report);
    }
    bar.finish_and_clear();
    if let Some(mut m) = metrics {
        m.flush().context("cannot write metrics")?;
    }
    if let Some(path) = settings.save_weights.as_ref().filter(|_| leader) {
        strata::io::save_weights(&trainer.engine, path)?;
        info!(path = %path.display(), "saved weights");
    }
    if let Some(r) = last.filter(|_| leader) {
        let mut line = format!("step {}: loss {:.4}", r.step, r.loss);
        if let Some(best) = best_loss {
            line += &format!(" (best possible on this corpus: {best:.4})");
        }
        line += &format!(", {:.0} tokens/s, peak {}", r.tokens_per_s, human_bytes(r.peak_bytes));
        println!("{line}");
    }
    Ok(())
}
