//! `strata eval` and `strata generate`: a trained model (a Hugging Face model folder or a
//! checkpoint of `strata train`) in one process, evaluated on validation data (a language
//! model's loss and perplexity; a classifier's loss, accuracy and F1; an encoder–decoder's
//! loss and ROUGE-L) or asked to continue a prompt (an encoder–decoder: to write a target for
//! it).
//!
//! Owns loading the model and turning flags into the library's settings. Must not decode or
//! evaluate itself: `strata::generate`, `strata::train::evaluate` and `strata::tasks` do.
use crate::options::DataChoice;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use strata::checkpoint::{BaseRecord, Checkpoint};
use strata::data::chat::ChatTemplate;
use strata::data::Batching;
use strata::data::{
    read_labeled, read_source_target, validation_steps, ClassifySet, Dataset, ExampleOptions, LoaderConfig,
    MaskOptions, MaskedSet, Seq2SeqSet, TokenData, TokenWidth, Tokenizer,
};
use strata::engine::{Engine, EngineConfig};
use strata::generate::{generate, generate_from_source, GenerateConfig};
use strata::model::{BertConfig, BertHead, ModelConfig, ModelDir};

/// Where the model comes from, and where it runs.
#[derive(Args, Debug)]
pub struct ModelSource {
    /// A Hugging Face model folder (config.json, safetensors weights, tokenizer.json).
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// A checkpoint of `strata train` (its folder, one step's folder or a merged file); with
    /// --model-dir, it replaces what it holds (a LoRA run's adapters) of that model.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Hugging Face tokenizer.json (default: the model folder's, else one token per byte).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Compute device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// CPU threads for libtorch.
    #[arg(long)]
    threads: Option<i32>,
}

/// A model loaded whole into one engine, with its tokenizer.
struct Loaded {
    engine: Engine,
    config: ModelConfig,
    tokenizer: Tokenizer,
    folder: Option<ModelDir>,
}

impl Loaded {
    /// The tokenizer for text in and out: refused where it has more tokens than the model's
    /// vocabulary; the byte tokenizer for a larger vocabulary is said in a warning.
    fn text_tokenizer(&self) -> Result<&Tokenizer> {
        let (tokens, vocab) = (self.tokenizer.vocab_size(), self.config.vocab());
        if tokens as i64 > vocab {
            bail!("the tokenizer has {tokens} tokens, the model's vocabulary {vocab}: give its own (--tokenizer)");
        }
        if matches!(self.tokenizer, Tokenizer::Bytes) && vocab > 256 {
            let note = "text is read as bytes for a larger vocabulary: give --tokenizer if the model learned other ids";
            tracing::warn!(vocab, "{note}");
        }
        Ok(&self.tokenizer)
    }
}

impl Loaded {
    /// The tokens that end a generated text: the folder's `eos_token_id`s
    /// ([`ModelDir::eos_tokens`]); without a folder, an encoder–decoder's `</s>` where its
    /// tokenizer has one.
    fn stop_tokens(&self) -> Result<Vec<i64>> {
        Ok(match (&self.folder, &self.config) {
            (Some(folder), _) => folder.eos_tokens()?,
            (None, ModelConfig::T5(_)) => self.tokenizer.token_id("</s>").map(i64::from).into_iter().collect(),
            (None, _) => vec![],
        })
    }
}

impl ModelSource {
    fn load(&self) -> Result<Loaded> {
        if let Some(t) = self.threads {
            if t <= 0 {
                bail!("--threads must be positive");
            }
            tch::set_num_threads(t);
        }
        let device = crate::options::parse_device(&self.device)?;
        let config = EngineConfig { device, ..Default::default() };
        let checkpoint = self.resume.as_deref().map(Checkpoint::open).transpose()?;
        let folder = self.model_dir.as_deref().map(strata::model::from_pretrained_dir).transpose()?;
        let (model, mut spec) = match (&folder, &checkpoint) {
            (Some(folder), _) => (folder.config.clone(), folder.spec()?),
            (None, Some(ckpt)) => match &ckpt.meta.model {
                Some(model) => (model.clone(), model.spec()?),
                None => bail!("{}: the checkpoint does not record its model", ckpt.location.display()),
            },
            (None, None) => bail!("name the model: --model-dir DIR or --resume CHECKPOINT"),
        };
        // A LoRA run's checkpoint holds its adapters (and, unless it froze them whole, not
        // the base, which comes from --model-dir).
        if let Some(ckpt) = &checkpoint {
            if let Some(lora) = strata::strategy::Strategy::from_value(&ckpt.meta.strategy)?.lora() {
                lora.apply(&mut spec)?;
            }
            if folder.is_none() && !ckpt.holds_every_parameter() {
                bail!(
                    "{}: the checkpoint holds what its run trained, not the frozen base: give the base with --model-dir DIR",
                    ckpt.location.display()
                );
            }
            // The base beside it must be the one it was trained on.
            if let (Some(folder), Some(saved)) = (&folder, &ckpt.meta.base) {
                if !ckpt.holds_every_parameter() {
                    let given = BaseRecord::of(vec![folder.dir.display().to_string()], &folder.weights)?;
                    saved.check(&given, &ckpt.location)?;
                }
            }
        }
        let mut engine = Engine::new(spec, config)?;
        if let Some(folder) = &folder {
            strata::io::load_model_dir(&mut engine, folder)?;
        }
        if let Some(ckpt) = &checkpoint {
            ckpt.restore_weights(&mut engine)?;
        }
        let tokenizer = crate::options::tokenizer(self.tokenizer.as_deref(), folder.as_ref())?;
        Ok(Loaded { engine, config: model, tokenizer, folder })
    }
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    source: ModelSource,
    /// Validation data, read as `strata train` reads it: text tokenised with the model's
    /// tokenizer, or examples when it ends in .jsonl or .parquet (records of "text",
    /// "prompt" and "completion", or "messages" rendered with the chat template, prompts
    /// masked out of the loss); records for T5 and BERT.
    #[arg(long)]
    val_data: Option<PathBuf>,
    /// Examples: the Jinja chat template (default: the model folder's).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Examples: a JSON object of variables every rendering gets, as training gave them.
    #[arg(long)]
    chat_template_kwargs: Option<String>,
    /// Examples: longest example in tokens, longer ones cut (default: --ctx).
    #[arg(long)]
    max_length: Option<usize>,
    /// Examples: score the prompts' tokens too, as a run with --train-on-prompt learned them.
    #[arg(long)]
    train_on_prompt: bool,
    /// Validation tokens: a token file (`strata tokenize`'s, or raw little-endian ids).
    #[arg(long)]
    val_token_file: Option<PathBuf>,
    /// Width of a raw token file's ids: u16 (nanoGPT's .bin, the default) or u32; a file
    /// written by `strata tokenize` says its own.
    #[arg(long)]
    token_width: Option<TokenWidth>,
    /// Context of each window, in tokens.
    #[arg(long, default_value_t = 64)]
    ctx: usize,
    /// Windows per batch.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Batches, consecutive windows from the start of the data (default: all that fit).
    #[arg(long)]
    eval_batches: Option<usize>,
    /// An encoder–decoder's targets written for ROUGE-L: tokens at most each.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// Scores a classifier, an encoder–decoder or a masked language model on the records (or
/// text) of --val-data; `false` where the model is a language model of next tokens.
fn eval_records(args: &EvalArgs, loaded: &mut Loaded) -> Result<bool> {
    let task_reads_records = matches!(&loaded.config, ModelConfig::T5(_) | ModelConfig::Bert(_));
    if !task_reads_records {
        return Ok(false);
    }
    let path = match (&args.val_data, &args.val_token_file) {
        (Some(path), None) => path,
        _ => bail!("this model's task reads records: give them with --val-data FILE"),
    };
    if args.ctx == 0 || args.batch_size == 0 || args.eval_batches == Some(0) {
        bail!("--ctx, --batch-size and --eval-batches must be positive");
    }
    let scoring = strata::tasks::Scoring { rows: args.batch_size, batches: args.eval_batches };
    loaded.text_tokenizer()?;
    let tokenizer = &loaded.tokenizer;
    let source = path.display().to_string();
    let (json, line) = match &loaded.config {
        ModelConfig::T5(c) => {
            let set = Seq2SeqSet::encode(
                &read_source_target(path)?,
                tokenizer,
                (args.ctx, args.ctx),
                (c.padding, c.decoder_start),
                source,
            )?;
            let stop_tokens = loaded.stop_tokens()?;
            let generation = GenerateConfig { max_new_tokens: args.max_new_tokens, stop_tokens, ..Default::default() };
            let r = strata::tasks::seq2seq(&mut loaded.engine, &set, scoring, tokenizer, &generation)?;
            let line = format!("validation loss {:.6}, ROUGE-L {:.4} ({} records)", r.loss, r.rouge_l, r.records);
            (serde_json::to_value(r)?, line)
        }
        ModelConfig::Bert(BertConfig { head: BertHead::MaskedLm, .. }) => {
            let set = MaskedSet::from_text(path, tokenizer, args.ctx, MaskOptions::default())?;
            let r = strata::tasks::masked_lm(&mut loaded.engine, &set, scoring)?;
            let line = format!("validation loss {:.6} on {} masked tokens", r.loss, r.masked_tokens);
            (serde_json::to_value(r)?, line)
        }
        ModelConfig::Bert(BertConfig { head: BertHead::Classify { labels }, padding, type_vocab, .. }) => {
            let pad = padding.unwrap_or(0) as u32;
            let set = ClassifySet::encode(&read_labeled(path, labels)?, tokenizer, args.ctx, pad, source)?;
            set.check_token_types(*type_vocab)?;
            let r = strata::tasks::classify(&mut loaded.engine, &set, scoring, labels.len())?;
            let line = format!(
                "validation loss {:.6}, accuracy {:.4}, macro-F1 {:.4} ({} texts)",
                r.loss, r.accuracy, r.macro_f1, r.texts
            );
            (serde_json::to_value(r)?, line)
        }
        _ => return Ok(false),
    };
    println!("{}", if args.json { json.to_string() } else { line });
    Ok(true)
}

pub fn eval(args: EvalArgs) -> Result<()> {
    let mut loaded = args.source.load()?;
    if eval_records(&args, &mut loaded)? {
        return Ok(());
    }
    if args.ctx == 0 || args.batch_size == 0 || args.eval_batches == Some(0) {
        bail!("--ctx, --batch-size and --eval-batches must be positive");
    }
    let examples =
        args.val_data.as_ref().filter(|p| matches!(DataChoice::of_file(p.to_path_buf()), DataChoice::Examples(_)));
    let given = args.chat_template.is_some() || args.chat_template_kwargs.is_some() || args.max_length.is_some();
    if examples.is_none() && (given || args.train_on_prompt) {
        bail!("--chat-template, --chat-template-kwargs, --max-length and --train-on-prompt shape examples: give --val-data FILE.jsonl or FILE.parquet");
    }
    let template_arguments = crate::options::template_arguments(args.chat_template_kwargs.as_deref())?;
    let data: Dataset = match (&args.val_data, &args.val_token_file) {
        (Some(path), None) if examples.is_some() => {
            let max_length = args.max_length.unwrap_or(args.ctx);
            if max_length == 0 || max_length > args.ctx {
                bail!("--max-length {max_length} must be positive and within --ctx {}", args.ctx);
            }
            let options = ExampleOptions { max_length, drop_long: false, train_on_prompt: args.train_on_prompt };
            let sources = crate::train::ExampleSources {
                tokenizer_file: args.source.tokenizer.as_deref(),
                model_dir: args.source.model_dir.as_deref(),
                chat_template: args.chat_template.as_deref(),
                template_arguments: &template_arguments,
            };
            crate::train::read_examples(path, loaded.text_tokenizer()?, sources, &options)?.into()
        }
        (Some(path), None) => TokenData::from_text_file(path, loaded.text_tokenizer()?)?.into(),
        (None, Some(path)) => TokenData::open(path, args.token_width)?.into(),
        (Some(_), Some(_)) => bail!("give either --val-data or --val-token-file, not both"),
        (None, None) => bail!("name the validation data: --val-data or --val-token-file"),
    };
    if let Some(context) = loaded.config.context().filter(|&c| args.ctx as i64 > c) {
        bail!("--ctx {} is longer than the model's context of {context} positions", args.ctx);
    }
    data.check_fits(args.ctx, loaded.config.vocab() as usize)?;
    let device = loaded.engine.config().device;
    let loader = LoaderConfig { device, ..LoaderConfig::new(Batching::new(args.ctx, args.batch_size)) };
    let steps = validation_steps(&data, &loader, args.eval_batches, usize::MAX)?;
    let tokens: i64 = steps.iter().flat_map(|s| &s.micro_batches).map(|b| b.supervised as i64).sum();
    let mut engine = loaded.engine;
    let loss = strata::train::evaluate(&mut engine, &steps)?;
    if args.json {
        let out = serde_json::json!({"val_loss": loss, "val_perplexity": loss.exp(), "tokens": tokens, "batches": steps.len()});
        println!("{out}");
    } else {
        println!(
            "validation loss {loss:.6}, perplexity {:.4} ({tokens} tokens in {} batches)",
            loss.exp(),
            steps.len()
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    source: ModelSource,
    /// The text to continue.
    #[arg(long)]
    prompt: String,
    /// Tokens to generate at most (default: the folder's generation_config.json, else 64).
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// Sampling temperature; 0 takes the most likely token each time (default: greedy,
    /// unless the folder's generation_config.json samples).
    #[arg(long)]
    temperature: Option<f64>,
    /// Sample among the K most likely tokens; 0: all (default: the folder's, else 50, as
    /// transformers).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities reach P together.
    #[arg(long)]
    top_p: Option<f64>,
    /// Sample among the tokens at least this fraction as likely as the most likely.
    #[arg(long)]
    min_p: Option<f64>,
    /// Divide the logits of tokens already in the text by this (multiply where negative),
    /// greedy or sampled (default: the folder's, else 1: none).
    #[arg(long)]
    repetition_penalty: Option<f64>,
    /// Seed of the sampling draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Recompute the whole window for each token instead of using a key/value cache.
    #[arg(long)]
    no_cache: bool,
    /// Print the prompt's and the new tokens' ids as JSON instead of text.
    #[arg(long)]
    ids: bool,
    /// Ask as a user of the chat template: the prompt is rendered as one user turn with the
    /// assistant's turn opened, generation stops at the template's end token, and only the
    /// answer is printed.
    #[arg(long)]
    chat: bool,
    /// The Jinja chat template for --chat (default: the model folder's).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// A JSON object of variables the --chat rendering gets ({"enable_thinking": false}).
    #[arg(long)]
    chat_template_kwargs: Option<String>,
}

/// The prompt's ids as --chat renders it, and the id of the template's end token.
fn chat_prompt(args: &GenerateArgs, loaded: &Loaded) -> Result<(Vec<u32>, Option<i64>)> {
    let folder = crate::options::tokenizer_folder(
        args.source.tokenizer.as_deref(),
        loaded.folder.as_ref().map(|m| m.dir.as_path()),
    );
    let template = ChatTemplate::choose(args.chat_template.as_deref(), folder)?
        .context("--chat needs a chat template: the model folder has none (give --chat-template FILE)")?
        .with_arguments(crate::options::template_arguments(args.chat_template_kwargs.as_deref())?);
    let turn = serde_json::json!({"role": "user", "content": args.prompt});
    let text = template.render(&[turn], true)?;
    let tokenizer = loaded.text_tokenizer()?;
    let ids = tokenizer.encode_with_starts(vec![text], false)?.remove(0).0;
    // The end token where it is one token of the vocabulary.
    let end = match template.special_token("eos_token") {
        Some(eos) => match tokenizer.encode_with_starts(vec![eos.to_string()], false)?.remove(0).0[..] {
            [id] => Some(i64::from(id)),
            _ => None,
        },
        None => None,
    };
    Ok((ids, end))
}

pub fn run_generate(args: GenerateArgs) -> Result<()> {
    let mut loaded = args.source.load()?;
    if matches!(&loaded.config, ModelConfig::Llama(c) if c.head == strata::model::DecoderHead::Reward) {
        bail!("the model is a reward model (a sequence classifier): it scores texts, it does not write them");
    }
    if args.chat && matches!(loaded.config, ModelConfig::T5(_)) {
        bail!("--chat renders a conversation for a decoder; an encoder-decoder reads the prompt as its source");
    }
    if !args.chat && (args.chat_template.is_some() || args.chat_template_kwargs.is_some()) {
        bail!("--chat-template and --chat-template-kwargs render the prompt as a conversation: give --chat");
    }
    // A plain prompt takes the tokenizer's special tokens (a Llama tokenizer's
    // begin-of-text), as `transformers`' tokenizers give them by default, and is printed as
    // given, without them; a chat prints the answer alone.
    let (prompt, shown, chat_end) = match args.chat {
        true => {
            let (prompt, end) = chat_prompt(&args, &loaded)?;
            (prompt, vec![], end)
        }
        false => {
            let tokenizer = loaded.text_tokenizer()?;
            let read = tokenizer.encode_with_starts(vec![args.prompt.clone()], true)?.remove(0).0;
            (read, tokenizer.encode(&args.prompt)?, None)
        }
    };
    let prompt: Vec<i64> = prompt.into_iter().map(i64::from).collect();
    let shown: Vec<i64> = shown.into_iter().map(i64::from).collect();
    let vocab = loaded.config.vocab();
    if let Some(bad) = prompt.iter().find(|&&t| t >= vocab) {
        bail!("the prompt holds token {bad}, outside the model's vocabulary of {vocab}");
    }
    let config = GenerateConfig {
        stop_tokens: loaded.stop_tokens()?.into_iter().chain(chat_end).collect(),
        // An encoder–decoder's `max_length` counts its target, the start token in it.
        ..decoding(&args, &loaded, if matches!(loaded.config, ModelConfig::T5(_)) { 1 } else { prompt.len() })?
    };
    let new = match &loaded.config {
        // An encoder–decoder writes a target for the prompt, which it reads whole (with the
        // tokenizer's closing token); the target is printed alone.
        ModelConfig::T5(c) => {
            let source = loaded.text_tokenizer()?.encode_pairs(&[(args.prompt.as_str(), None)], usize::MAX)?;
            let source: Vec<i64> = source[0].0.iter().map(|&t| i64::from(t)).collect();
            let new = generate_from_source(&mut loaded.engine, &source, c.decoder_start, &config)?;
            return print_generated(&args, &loaded, &config, &source, &[], &new);
        }
        _ => generate(&mut loaded.engine, &prompt, &config, loaded.config.context())?,
    };
    print_generated(&args, &loaded, &config, &prompt, &shown, &new)
}

/// How `strata generate` decodes: each setting its flag's, else the model folder's
/// `generation_config.json`'s, else `transformers`' default (greedy; sampling among the 50
/// most likely tokens) or Strata's (64 new tokens); no stop tokens yet.
fn decoding(args: &GenerateArgs, loaded: &Loaded, prompt: usize) -> Result<GenerateConfig> {
    let folder = loaded.folder.as_ref().map(ModelDir::generation_defaults).transpose()?.unwrap_or_default();
    let temperature = match (args.temperature, folder.do_sample) {
        (Some(t), _) => t,
        (None, Some(true)) => folder.temperature.unwrap_or(1.0),
        (None, _) => 0.0,
    };
    let sampling = temperature > 0.0;
    if !sampling && (args.top_k.is_some() || args.top_p.is_some() || args.min_p.is_some()) {
        bail!("--top-k, --top-p and --min-p shape sampling: give --temperature above 0");
    }
    let max_new_tokens = match (args.max_new_tokens.or(folder.max_new_tokens), folder.max_length) {
        (Some(n), _) => n,
        (None, Some(total)) if total <= prompt => bail!(
            "generation_config.json's max_length {total} leaves no room after the prompt's {prompt} tokens: give --max-new-tokens"
        ),
        (None, Some(total)) => total - prompt,
        (None, None) => 64,
    };
    Ok(GenerateConfig {
        max_new_tokens,
        temperature,
        top_k: args.top_k.or(folder.top_k).or(Some(50)).filter(|&k| sampling && k > 0),
        top_p: args.top_p.or(folder.top_p).filter(|_| sampling),
        min_p: args.min_p.or(folder.min_p).filter(|_| sampling),
        repetition_penalty: args.repetition_penalty.or(folder.repetition_penalty).unwrap_or(1.0),
        seed: args.seed,
        stop_tokens: vec![],
        cache: !args.no_cache,
    })
}

/// The ids as JSON (the prompt's as the model read them), or the text: the prompt's `shown`
/// tokens and the new tokens, decoded whole, without a closing stop token.
fn print_generated(
    args: &GenerateArgs,
    loaded: &Loaded,
    config: &GenerateConfig,
    prompt: &[i64],
    shown: &[i64],
    new: &[i64],
) -> Result<()> {
    if args.ids {
        println!("{}", serde_json::json!({"prompt": prompt, "new": new}));
        return Ok(());
    }
    // The end token is kept in the ids (as transformers keeps it), not shown in the text.
    let answer = match new.last() {
        Some(t) if config.stop_tokens.contains(t) => &new[..new.len() - 1],
        _ => new,
    };
    // Decoded whole, so the tokenizer spaces the prompt and the new text as it spaces words;
    // a chat prints the answer alone.
    let ids: Vec<u32> =
        shown.iter().chain(answer).map(|&t| u32::try_from(t)).collect::<Result<_, _>>().context("token id")?;
    println!("{}", loaded.tokenizer.decode(&ids)?);
    Ok(())
}
