//! What a training run reads and writes beside its steps, shared by the one-engine loop
//! (`train.rs`) and the pipeline loop (`train_pipeline.rs`): data, initial weights, the
//! checkpoint to resume, when to validate, and the model folder to write.
use crate::options::{DataChoice, TrainSettings};
use anyhow::{bail, Result};
use strata::checkpoint::{Checkpoint, DataPosition};
use strata::data::{SyntheticCorpus, TokenData};
use strata::engine::Engine;
use strata::io::FolderOut;
use strata::model::ModelConfig;
use strata::train::StepReport;

/// Tokens to train on, and the best loss when it is known (the synthetic corpus).
pub fn load_data(settings: &TrainSettings) -> Result<(TokenData, Option<f64>, usize)> {
    load_tokens(settings, &settings.data)
}

/// The validation tokens, if the run has any.
pub fn load_validation(settings: &TrainSettings) -> Result<Option<TokenData>> {
    settings.val.as_ref().map(|v| load_tokens(settings, v).map(|(data, ..)| data)).transpose()
}

fn load_tokens(settings: &TrainSettings, choice: &DataChoice) -> Result<(TokenData, Option<f64>, usize)> {
    Ok(match choice {
        DataChoice::Synthetic => {
            let corpus = SyntheticCorpus::default();
            (corpus.generate(), Some(corpus.best_loss()), 256)
        }
        DataChoice::Text(path) => {
            let tokenizer = crate::options::tokenizer(settings.tokenizer.as_deref(), settings.model_dir.as_ref())?;
            let data = TokenData::from_text_file(path, &tokenizer)?;
            (data, None, tokenizer.vocab_size())
        }
        DataChoice::TokenFile(path, width) => {
            let data = TokenData::open(path, *width)?;
            let vocab = data.vocab_needed() as usize;
            (data, None, vocab)
        }
    })
}

/// Loads the run's initial weights into `engine`: --init-weights', or --model-dir's.
pub fn load_initial_weights(settings: &TrainSettings, engine: &mut Engine) -> Result<()> {
    if let Some(path) = &settings.init_weights {
        strata::io::load_weights(engine, path)?;
    }
    if let Some(dir) = &settings.model_dir {
        strata::io::load_model_dir(engine, dir)?;
    }
    Ok(())
}

/// The folder --save-model-dir writes: the model folder's family, special tokens and
/// tokenizer files when the run started from one; the run's tokenizer where it gave one.
pub fn model_folder(settings: &TrainSettings, model: &ModelConfig) -> Result<Option<FolderOut>> {
    let Some(dir) = &settings.save_model_dir else { return Ok(None) };
    let mut out = match &settings.model_dir {
        Some(source) => FolderOut::like(dir, source),
        None => FolderOut::new(dir, model.clone())?,
    };
    if let Some(t) = &settings.tokenizer {
        out.tokenizer_files.retain(|(name, _)| name != "tokenizer.json");
        out.tokenizer_files.push(("tokenizer.json".into(), t.clone()));
    }
    out.shard_bytes = settings.max_shard_size;
    Ok(Some(out))
}

/// The optimizer's name as checkpoints record it.
pub fn optimizer_name(settings: &TrainSettings) -> String {
    format!("{:?}", settings.optimizer.kind).to_lowercase()
}

/// Where this run's data stands before step `next_step`, as checkpoints record it.
pub fn data_position(settings: &TrainSettings, next_step: u64) -> DataPosition {
    DataPosition { seed: settings.seed, batch_size: settings.batch_size, ctx: settings.ctx as usize, next_step }
}

/// The checkpoint `--resume` names, refused if it would not continue this run's data.
pub fn checkpoint_to_resume(settings: &TrainSettings) -> Result<Option<Checkpoint>> {
    let Some(path) = &settings.resume else { return Ok(None) };
    let ckpt = Checkpoint::open(path)?;
    let saved = &ckpt.meta.data;
    let here = data_position(settings, saved.next_step);
    if *saved != here {
        bail!(
            "{}: saved with seed {}, batch size {}, ctx {}; this run has seed {}, batch size {}, ctx {}: it would not continue the same run",
            ckpt.location.display(), saved.seed, saved.batch_size, saved.ctx, here.seed, here.batch_size, here.ctx
        );
    }
    Ok(Some(ckpt))
}

/// Whether a checkpoint is saved after step `step` on the way (the last step's always is).
pub fn checkpoint_due(settings: &TrainSettings, step: u64) -> bool {
    step < settings.steps && settings.checkpoint_every.is_some_and(|every| step.is_multiple_of(every))
}

/// The progress line of a step, every --log-every steps.
pub fn log_progress(settings: &TrainSettings, report: &StepReport) {
    if report.step.is_multiple_of(settings.log_every) {
        tracing::info!(
            step = report.step,
            loss = report.loss,
            val_loss = report.val_loss,
            lr = report.lr,
            tokens_per_s = report.tokens_per_s as u64,
            "progress"
        );
    }
}

/// Whether a validation runs after step `step`: every --eval-every steps, and after the last.
pub fn validation_due(settings: &TrainSettings, step: u64) -> bool {
    step == settings.steps || settings.eval_every.is_some_and(|every| step.is_multiple_of(every))
}

/// Stops `profiler` and writes this rank's file into `dir`.
pub fn save_profile(profiler: &strata::profile::Profiler, dir: &std::path::Path, rank: usize) -> Result<()> {
    use anyhow::Context;
    profiler.end();
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create profile folder {}", dir.display()))?;
    profiler.save(&strata::profile::Profiler::rank_file(dir, rank)).context("saving the profile")
}

/// The --metrics file, one JSON line per step, opened for the steps after `start`: a new
/// run starts it afresh; a resumed one keeps the lines of the steps up to its checkpoint
/// (rewritten atomically, without the lines of steps that run again) and appends after them.
pub fn open_metrics(path: &std::path::Path, start: u64) -> Result<std::io::BufWriter<std::fs::File>> {
    use anyhow::Context;
    let cannot = || format!("cannot open metrics file {}", path.display());
    if start > 0 && path.exists() {
        let old = std::fs::read_to_string(path).with_context(cannot)?;
        let done = |line: &&str| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= start)
        };
        let kept: String = old.lines().filter(done).flat_map(|l| [l, "\n"]).collect();
        strata::io::write_atomic(path, kept.as_bytes()).with_context(cannot)?;
    }
    let mut options = std::fs::OpenOptions::new();
    match start {
        0 => options.write(true).create(true).truncate(true),
        _ => options.append(true).create(true),
    };
    Ok(std::io::BufWriter::new(options.open(path).with_context(cannot)?))
}
