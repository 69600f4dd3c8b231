//! `strata train`: the flags' settings translated into the library's run
//! ([`strata::run::train`]), its data read from the files they name, its outcome printed.
use crate::options::{DataChoice, StrategyChoice, TrainSettings};
use crate::reward_command::command_reward;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::sync::Arc;
use strata::auto::AutoOptions;
use strata::data::chat::{self, ChatTemplate};
use strata::data::Batching;
use strata::data::{
    read_labeled, read_source_target, BatchOffsets, ClassifySet, Dataset, ExampleFormat, ExampleOptions, ExampleSet,
    MaskOptions, MaskedSet, Order, PreferenceFormat, PreferenceSet, PromptFormat, PromptSet, Seq2SeqSet,
    SyntheticCorpus, TokenData, Tokenizer,
};
use strata::io::FolderOut;
use strata::model::{BertConfig, BertHead, ModelConfig};
use strata::parallel::DataParallelOptions;
use strata::profile::human_bytes;
use strata::run::grpo::GrpoRun;
use strata::run::{self, Checkpoints, Data, InitialWeights, Outputs, RunConfig, StrategySource};

/// Data to train on, the best loss when it is known (the synthetic corpus), and the
/// vocabulary the data needs.
fn load_data(settings: &TrainSettings, choice: &DataChoice) -> Result<(Dataset, Option<f64>, usize)> {
    if let Some((folder, task)) = record_task(settings) {
        let path = match choice {
            DataChoice::Text(path) | DataChoice::Examples(path) => path,
            _ => bail!("{}: {}: give --data FILE{}", folder.display(), task.reads(), task.extensions()),
        };
        if settings.tokenizer.is_none() && settings.model_dir.as_ref().is_some_and(|m| m.tokenizer.is_none()) {
            bail!("{}: no tokenizer.json, which the records' texts need: give --tokenizer", folder.display());
        }
        if settings.pack
            || settings.chat_template.is_some()
            || !settings.chat_template_kwargs.is_empty()
            || settings.examples.as_ref().is_some_and(|e| e.train_on_prompt)
        {
            bail!(
                "--pack, --chat-template, --chat-template-kwargs and --train-on-prompt shape language-model examples, not {}",
                task.records()
            );
        }
        let tokenizer = crate::options::tokenizer(settings.tokenizer.as_deref(), settings.model_dir.as_ref())?;
        let (ctx, source) = (settings.ctx as usize, path.display().to_string());
        let set: Dataset = match task {
            RecordTask::Classify { labels, pad } => {
                ClassifySet::encode(&read_labeled(path, labels)?, &tokenizer, ctx, pad, source)?.into()
            }
            RecordTask::SourceTarget { pad, decoder_start } => {
                let records = read_source_target(path)?;
                Seq2SeqSet::encode(&records, &tokenizer, (ctx, ctx), (pad, decoder_start), source)?.into()
            }
            RecordTask::MaskedText => {
                let options = MaskOptions { seed: settings.seed, ..MaskOptions::default() };
                MaskedSet::from_text(path, &tokenizer, ctx, options)?.into()
            }
        };
        if let Some(rows) = set.row_set() {
            tracing::info!(source = %path.display(), records = rows.len(), tokens = rows.tokens(), longest = rows.longest(), "{}", task.records());
        }
        return Ok((set, None, tokenizer.vocab_size()));
    }
    Ok(match choice {
        DataChoice::Synthetic => {
            let corpus = SyntheticCorpus::default();
            (corpus.generate().into(), Some(corpus.best_loss()), 256)
        }
        DataChoice::Text(path) => {
            let tokenizer = crate::options::tokenizer(settings.tokenizer.as_deref(), settings.model_dir.as_ref())?;
            let data = TokenData::from_text_file(path, &tokenizer)?;
            (data.into(), None, tokenizer.vocab_size())
        }
        DataChoice::Examples(path) => {
            let tokenizer = crate::options::tokenizer(settings.tokenizer.as_deref(), settings.model_dir.as_ref())?;
            let set: Dataset = if PreferenceSet::holds_preferences(path)? {
                load_pairs(settings, path, &tokenizer)?.into()
            } else if PromptSet::holds_prompts(path)? {
                load_prompts(settings, path, &tokenizer)?.into()
            } else {
                load_examples(settings, path, &tokenizer)?.into()
            };
            (set, None, tokenizer.vocab_size())
        }
        DataChoice::TokenFile(path, width) => {
            let data = TokenData::open(path, *width)?;
            let vocab = data.vocab_needed() as usize;
            (data.into(), None, vocab)
        }
    })
}

/// A task whose data is records, a record a row, as the model folder's architecture says.
#[derive(Clone, Copy)]
enum RecordTask<'a> {
    /// A BERT classifier: labeled texts, labels named by the folder's `id2label`.
    Classify { labels: &'a [String], pad: u32 },
    /// T5: sources with their targets.
    SourceTarget { pad: i64, decoder_start: i64 },
    /// A BERT masked language model: text, its tokens masked for prediction.
    MaskedText,
}

impl RecordTask<'_> {
    fn records(self) -> &'static str {
        match self {
            RecordTask::Classify { .. } => "labeled texts",
            RecordTask::SourceTarget { .. } => "sources with targets",
            RecordTask::MaskedText => "masked text",
        }
    }

    fn reads(self) -> &'static str {
        match self {
            RecordTask::Classify { .. } => "a classifier trains on labeled records",
            RecordTask::SourceTarget { .. } => "an encoder-decoder trains on records of a source and a target",
            RecordTask::MaskedText => "a masked language model trains on text, a line a text",
        }
    }

    fn extensions(self) -> &'static str {
        match self {
            RecordTask::Classify { .. } => ".jsonl or FILE.csv",
            RecordTask::SourceTarget { .. } => ".jsonl",
            RecordTask::MaskedText => ".txt",
        }
    }
}

/// Where the run starts from the folder of a model whose task reads records a row each (a
/// BERT classifier, T5, a BERT masked language model): the folder and the task.
fn record_task(settings: &TrainSettings) -> Option<(&Path, RecordTask<'_>)> {
    let folder = settings.model_dir.as_ref()?;
    let task = match &folder.config {
        ModelConfig::Bert(BertConfig { head: BertHead::Classify { labels }, padding, .. }) => {
            RecordTask::Classify { labels, pad: padding.unwrap_or(0) as u32 }
        }
        ModelConfig::T5(c) => RecordTask::SourceTarget { pad: c.padding, decoder_start: c.decoder_start },
        ModelConfig::Bert(BertConfig { head: BertHead::MaskedLm, .. }) => RecordTask::MaskedText,
        _ => return None,
    };
    Some((folder.dir.as_path(), task))
}

/// The examples of `path`, rendered with the chat template of --chat-template or the model
/// folder, ended with the folder's end-of-sequence token, cached for the next run.
fn load_examples(settings: &TrainSettings, path: &Path, tokenizer: &Tokenizer) -> Result<ExampleSet> {
    let options = settings.examples.clone().context("example options are set for example data")?;
    read_examples(path, tokenizer, ExampleSources::of(settings), &options)
}

/// The preference pairs of `path`, rendered and ended as examples are, each row cut to
/// --max-length.
fn load_pairs(settings: &TrainSettings, path: &Path, tokenizer: &Tokenizer) -> Result<PreferenceSet> {
    let options = settings.examples.clone().context("example options are set for example data")?;
    if options.drop_long || options.train_on_prompt || settings.pack {
        bail!("{}: --drop-long, --train-on-prompt and --pack shape examples, not preference pairs", path.display());
    }
    let (template, end_of_text) = ExampleSources::of(settings).rendering(tokenizer)?;
    // Each record's mismatched completion comes from its micro-batch's records over every
    // data-parallel rank (whose KL estimate the ranks share), as TRL's come from one
    // process's batch: the number of ranks changes nothing.
    let kl_batch = settings.batch_size / settings.accumulation.max(1);
    // A reward model's rows stay whole, as TRL's RewardTrainer keeps them, and are padded
    // with the token its rewards are found by.
    let reward_pad = settings.reward.as_ref().map(|r| r.pad_token.unwrap_or(0));
    let format = PreferenceFormat {
        tokenizer,
        template: template.as_ref(),
        end_of_text,
        max_length: options.max_length,
        kl_batch: kl_batch.max(1),
        drop_long: reward_pad.is_some(),
        pad: u32::try_from(reward_pad.unwrap_or(0)).context("the padding token")?,
        // Pairs scored by an unpaired loss (kto) are unpaired as TRL's KTOTrainer unpairs them.
        unpair: settings.reward.is_none() && settings.preference.losses.iter().any(|(l, _)| l.unpaired()),
    };
    let set = PreferenceSet::read(path, &format)?;
    let r = &set.report;
    tracing::info!(
        source = %path.display(),
        records = r.records,
        pairs = r.pairs,
        dropped_long_prompt = r.dropped_long_prompt,
        truncated_rows = r.truncated_rows,
        dropped_long = r.dropped_long,
        "preference pairs"
    );
    Ok(set)
}

/// GRPO's prompts of `path`, conversations rendered with the assistant's turn opened, a
/// prompt leaving room for the most completion tokens within --ctx.
fn load_prompts(settings: &TrainSettings, path: &Path, tokenizer: &Tokenizer) -> Result<PromptSet> {
    let Some(grpo) = &settings.grpo else {
        bail!(
            "{}: records of a \"prompt\" alone are trained on by GRPO: give --reward-command (and --model-dir)",
            path.display()
        );
    };
    let completion = grpo.config.max_completion_length;
    let Some(max_prompt_length) = (settings.ctx as usize).checked_sub(completion).filter(|&m| m > 0) else {
        bail!("--ctx {} leaves no room for a prompt beside --max-completion-length {completion}", settings.ctx);
    };
    let (template, _) = ExampleSources::of(settings).rendering(tokenizer)?;
    let format = PromptFormat { tokenizer, template: template.as_ref(), max_prompt_length };
    let set = PromptSet::read(path, &format)?;
    tracing::info!(source = %path.display(), records = set.report.records, dropped_long = set.report.dropped_long, "prompts");
    Ok(set)
}

/// Where examples' rendering comes from: the tokenizer file and model folder given (the
/// folder holding `tokenizer_config.json` gives the chat template and end token) and a
/// chat template file that replaces the folder's.
#[derive(Clone, Copy)]
pub struct ExampleSources<'a> {
    pub tokenizer_file: Option<&'a Path>,
    pub model_dir: Option<&'a Path>,
    pub chat_template: Option<&'a Path>,
    /// Variables every rendering gets (`--chat-template-kwargs`).
    pub template_arguments: &'a serde_json::Map<String, serde_json::Value>,
}

impl<'a> ExampleSources<'a> {
    /// The sources `strata train`'s flags name.
    fn of(settings: &'a TrainSettings) -> ExampleSources<'a> {
        ExampleSources {
            tokenizer_file: settings.tokenizer.as_deref(),
            model_dir: settings.model_dir.as_ref().map(|m| m.dir.as_path()),
            chat_template: settings.chat_template.as_deref(),
            template_arguments: &settings.chat_template_kwargs,
        }
    }

    /// The chat template conversations are rendered through, and the end-of-sequence text
    /// that ends a plain text or a completion: the tokenizer's configured end token, else
    /// the model folder's first `eos_token_id` where the tokenizer holds it as a special
    /// token (GPT-2's folder names its end token nowhere else).
    fn rendering(self, tokenizer: &Tokenizer) -> Result<(Option<ChatTemplate>, Option<String>)> {
        let folder = crate::options::tokenizer_folder(self.tokenizer_file, self.model_dir);
        let template = ChatTemplate::choose(self.chat_template, folder)?
            .map(|t| t.with_arguments(self.template_arguments.clone()));
        let configured = match folder {
            Some(dir) => chat::special_token(&chat::tokenizer_config(dir)?, "eos_token"),
            None => None,
        };
        let end_of_text = match (configured, self.model_dir) {
            (Some(end), _) => Some(end),
            (None, Some(dir)) => {
                let path = dir.join("config.json");
                let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
                let config: serde_json::Value =
                    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
                let first = match &config["eos_token_id"] {
                    serde_json::Value::Array(ids) => ids.first().and_then(serde_json::Value::as_u64),
                    id => id.as_u64(),
                };
                first.and_then(|id| tokenizer.special_token_text(u32::try_from(id).ok()?))
            }
            (None, None) => None,
        };
        Ok((template, end_of_text))
    }
}

/// The examples of `path` (JSONL or Parquet records) as training reads them: rendered with
/// the chat template, ended with the folder's end-of-sequence token, cut and masked as
/// `options` say, cached for the next run.
pub fn read_examples(
    path: &Path,
    tokenizer: &Tokenizer,
    sources: ExampleSources<'_>,
    options: &ExampleOptions,
) -> Result<ExampleSet> {
    let (template, end_of_text) = sources.rendering(tokenizer)?;
    let format = ExampleFormat { tokenizer, template: template.as_ref(), end_of_text };
    let set = ExampleSet::load(path, &format, options, strata::data::records::default_cache_dir().as_deref())?;
    let r = &set.report;
    tracing::info!(
        source = %path.display(),
        records = r.records,
        examples = r.examples,
        truncated = r.truncated,
        dropped_long = r.dropped_long,
        dropped_unlearned = r.dropped_unlearned,
        tokens = r.tokens,
        learned_tokens = r.learned_tokens,
        cached = set.cached,
        "examples"
    );
    if r.truncated > 0 {
        tracing::warn!(
            "{} of {} examples of {} were cut to --max-length {} tokens: their ends are not learned",
            r.truncated,
            r.examples,
            path.display(),
            options.max_length
        );
    }
    Ok(set)
}

/// The folder --save-model-dir writes: the model folder's family, special tokens and
/// tokenizer files when the run started from one; the run's tokenizer where it gave one.
fn model_folder(settings: &TrainSettings, model: &ModelConfig) -> Result<Option<FolderOut>> {
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
    // transformers finds a reward model's last token by its pad_token_id.
    if let Some(pad) = settings.reward.as_ref().and_then(|r| r.pad_token) {
        out.special_tokens.insert("pad_token_id".into(), pad.into());
    }
    Ok(Some(out))
}

/// Where the strategy comes from: PatrickStar's configuration, the one given, or a search
/// (which a given strategy seeds when --finetune-strategy tunes it).
fn strategy_source(s: &TrainSettings) -> StrategySource {
    if let Some(p) = &s.patrickstar {
        return StrategySource::PatrickStar(p.clone());
    }
    match &s.strategy {
        StrategyChoice::Given(given) if !s.finetune_strategy => StrategySource::Given(given.clone()),
        choice => StrategySource::Auto(AutoOptions {
            excluded: s.excluded.clone(),
            included: s.included.clone(),
            load_strategy: match choice {
                StrategyChoice::Given(given) => Some(given.clone().into()),
                StrategyChoice::Auto => None,
            },
            finetune_strategy: s.finetune_strategy,
            verbose: true,
            time_limit: s.time_limit,
            search: s.search,
            dry_run_steps: s.dry_run_steps,
            confirm_runs: s.confirm_runs,
            lora: s.auto_lora.clone().map(Box::new),
            ..Default::default()
        }),
    }
}

fn run_config(s: &TrainSettings, model: &ModelConfig) -> Result<RunConfig> {
    let order = match &s.batch_offsets {
        Some(path) => Order::Offsets(BatchOffsets::from_file(path)?),
        None => Order::Shuffled,
    };
    let mut init: Vec<InitialWeights> = s.init_weights.iter().cloned().map(InitialWeights::File).collect();
    init.extend(s.model_dir.iter().map(|dir| InitialWeights::Folder(Box::new(dir.clone()))));
    init.extend(s.init_adapter.iter().cloned().map(InitialWeights::Adapter));
    Ok(RunConfig {
        steps: s.steps,
        device: s.device,
        threads: s.threads,
        optimizer: s.optimizer.clone(),
        schedule: s.schedule.clone(),
        grad_clip: s.grad_clip,
        freeze: s.freeze.clone(),
        loss: None,
        prepare_input: None,
        strategy: strategy_source(s),
        data_parallel: DataParallelOptions {
            bucket_bytes: s.bucket_bytes,
            find_unused_parameters: s.find_unused_parameters,
        },
        device_memory: s.device_memory,
        host_memory: s.host_memory,
        comm_backend: s.comm_backend.clone(),
        comm_timeout: s.comm_timeout,
        init,
        eval_every: s.eval_every,
        eval_batches: s.eval_batches,
        checkpoints: s.save_checkpoint.clone().map(|dir| Checkpoints {
            dir,
            every: s.checkpoint_every,
            keep: s.keep_checkpoints,
            asynchronous: s.checkpoint_async,
        }),
        resume: s.resume.clone(),
        restart_data: s.restart_data,
        preference: s.preference.clone(),
        reward: s.reward.clone().unwrap_or_default(),
        grpo: None,
        outputs: Outputs {
            weights: s.save_weights.clone(),
            model_folder: model_folder(s, model)?,
            adapter_folder: s.save_adapter_dir.clone(),
            metrics: s.metrics.clone(),
            tensorboard: s.tensorboard.clone(),
            profile: s.profile.clone(),
            strategy: s.save_strategy.clone(),
            search_report: s.search_report.clone(),
        },
        unit_times: s.unit_times,
        cuda_graph: s.cuda_graph,
        log_every: s.log_every,
        progress: true,
        batching: Batching {
            batch_size: s.batch_size,
            ctx: s.ctx as usize,
            accumulation: s.accumulation,
            seed: s.seed,
            order,
            pack: s.pack,
            pack_strategy: s.pack_strategy,
        },
    })
}

pub fn run(settings: TrainSettings) -> Result<()> {
    let (train, best_loss, data_vocab) = load_data(&settings, &settings.data)?;
    // GRPO takes --beta too, as the coefficient of its KL term.
    let preference_flag = settings.preference_flags.iter().find(|f| !(settings.grpo.is_some() && **f == "--beta"));
    if let Some(flag) = preference_flag.filter(|_| !matches!(train, Dataset::Preference(_))) {
        bail!("{flag} scores preference pairs: give --data records of \"prompt\", \"chosen\" and \"rejected\"");
    }
    if let Some(flag) = settings.preference_flags.first().filter(|_| settings.reward.is_some()) {
        bail!("{flag} scores a language model's preferences: a reward model takes --center-rewards-coefficient");
    }
    if settings.reward.is_some() && !matches!(train, Dataset::Preference(_)) {
        bail!("a reward model trains on preference pairs: give --data records of \"chosen\" and \"rejected\"");
    }
    if settings.grpo.is_some() && !matches!(train, Dataset::Prompts(_)) {
        bail!("--reward-command rewards GRPO's completions: give --data records of \"prompt\" alone");
    }
    let validation = match &settings.val {
        Some(v) => Some(Arc::new(load_data(&settings, v)?.0)),
        None => None,
    };
    let model = settings.model(settings.vocab.unwrap_or(data_vocab as i64))?;
    let mut config = run_config(&settings, &model)?;
    if let (Dataset::Prompts(prompts), Some(g)) = (&train, &settings.grpo) {
        let tokenizer = crate::options::tokenizer(settings.tokenizer.as_deref(), settings.model_dir.as_ref())?;
        config.grpo = Some(GrpoRun {
            config: g.config.clone(),
            reward: command_reward(g.reward_command.clone(), Arc::new(prompts.clone()), Arc::new(tokenizer)),
            stop_tokens: g.stop_tokens.clone(),
            pad: g.pad,
        });
    }
    let data = Data { train: Arc::new(train), validation };
    let summary = run::train(&model.into(), &data, &config, &mut [])?;
    let leader = summary.is_leader();
    if let Some(r) = summary.last.filter(|_| leader) {
        let mut line = format!("step {}: loss {:.4}", r.step, r.loss);
        match (r.val_loss, r.val_perplexity) {
            (Some(v), Some(p)) => line += &format!(", validation loss {v:.4} (perplexity {p:.2})"),
            (Some(v), None) => line += &format!(", validation loss {v:.4}"),
            _ => {}
        }
        if let Some(best) = best_loss {
            line += &format!(" (best possible on this corpus: {best:.4})");
        }
        line += &format!(", {:.0} tokens/s, peak {}", r.tokens_per_s, human_bytes(r.peak_bytes));
        println!("{line}");
    }
    Ok(())
}
