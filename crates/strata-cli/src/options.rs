//! Options of `strata train`: the same fields from flags and from a TOML file (flags win),
//! resolved into the library's typed configurations with defaults and validation.
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use strata::auto::SearchMode;
use strata::data::{ExampleOptions, PackStrategy, TokenWidth, Tokenizer};
use strata::grpo::GrpoConfig;
use strata::model::{
    DecoderHead, DropoutRates, GptConfig, LlamaConfig, MlpConfig, ModelConfig, ModelDir, MoeConfig, DEFAULT_NORM_EPS,
};
use strata::optim::{LrSchedule, OptimizerConfig, OptimizerKind};
use strata::patrickstar::PatrickStarConfig;
use strata::preference::{FDivergence, PreferenceConfig, PreferenceLoss, ReferenceSync};
use strata::reward::RewardConfig;
use strata::run::Resume;
use strata::strategy::Strategy;

/// Declares the option struct once for clap and serde, and its merge.
macro_rules! train_options {
    ($($(#[$doc:meta])* $field:ident : $ty:ty),* $(,)?) => {
        #[derive(Args, Deserialize, Debug, Default, Clone)]
        #[serde(deny_unknown_fields, rename_all = "kebab-case")]
        pub struct TrainOptions {
            /// TOML file with any of these options (keys as the flags, without dashes).
            #[arg(long)]
            #[serde(skip)]
            pub config: Option<PathBuf>,
            $($(#[$doc])* #[arg(long, allow_negative_numbers = true)] pub $field: Option<$ty>,)*
        }

        impl TrainOptions {
            /// Each field from `self` if given there, else from `fallback`.
            fn or(self, fallback: TrainOptions) -> TrainOptions {
                TrainOptions { config: self.config, $($field: self.$field.or(fallback.$field),)* }
            }
        }
    };
}

train_options! {
    /// Model: gpt, llama or mlp.
    model: String,
    /// Start from a Hugging Face model folder (config.json, safetensors weights, tokenizer.json):
    /// its model, weights and tokenizer.
    model_dir: PathBuf,
    /// Write the trained model as a Hugging Face model folder (config, safetensors, tokenizer).
    save_model_dir: PathBuf,
    /// Start a LoRA run's adapters from a peft adapter folder (adapter_config.json,
    /// adapter_model.safetensors); its configuration is the lora method where the strategy
    /// names none.
    init_adapter: PathBuf,
    /// Write a LoRA run's adapters as a peft adapter folder (--save-model-dir writes the
    /// model with them merged).
    save_adapter_dir: PathBuf,
    /// Largest safetensors file of --save-model-dir, in bytes (default 5 GB); larger models
    /// are sharded with an index.
    max_shard_size: u64,
    /// Number of units between embedding and head (transformer blocks or MLP layers).
    layers: i64,
    /// Attention heads.
    heads: i64,
    /// Model width.
    dim: i64,
    /// Context length in tokens.
    ctx: i64,
    /// LLaMA: hidden size of the SwiGLU feed-forward (default 8/3 · dim rounded up to 32).
    ffn_dim: i64,
    /// LLaMA: base of the rotary position embedding (default 10000).
    rope_theta: f64,
    /// LLaMA: key/value heads of grouped-query attention (default: one per query head).
    kv_heads: i64,
    /// LLaMA: a mixture of this many experts in place of every layer's feed-forward, each as
    /// wide as --ffn-dim says (routing as Qwen3-MoE's, with its load-balancing loss).
    experts: i64,
    /// LLaMA with --experts: experts each token is sent to (default 2).
    experts_per_token: i64,
    /// A mixture of experts: each expert takes at most ⌈F · tokens · experts per token /
    /// experts⌉ of a layer's token slots, those of highest routing weight; the others are
    /// dropped (default: none is).
    expert_capacity: f64,
    /// A mixture of experts: the weight of the load-balancing loss (default: the folder's
    /// router_aux_loss_coef, else its family's, 0.001 for most); 0 trains without it, as
    /// transformers does unless output_router_logits is set.
    router_aux_loss: f64,
    /// A mixture of experts: the weight of the router z-loss, the mean over tokens of
    /// logsumexp(router logits)² summed over sparse layers (default: the folder's
    /// router_z_loss_coef, else 0).
    router_z_loss: f64,
    /// DeepSeek-style routing: after each step, each layer's choice bias
    /// (e_score_correction_bias) moves by this rate towards its underloaded experts,
    /// auxiliary-loss-free balancing (default 0: the bias stays as loaded).
    router_bias_rate: f64,
    /// Dropout at every site the model has (the decoder's: its attention probabilities;
    /// default: the model folder's rates, none for a model from shape flags); 0 turns it
    /// off. Masks follow the seed, the step and each element's place in the global batch,
    /// so any layout draws the same.
    dropout: f64,
    /// GPT and LLaMA: the norms' epsilon (default 1e-5).
    norm_eps: f64,
    /// LLaMA: the output head reads the token embedding's weight (GPT's always does).
    tie_embeddings: bool,
    /// Vocabulary size (default: the tokenizer's, or what the token file needs).
    vocab: i64,
    /// Train on this file: UTF-8 text (tokenised with --tokenizer, bytes by default), or
    /// examples when it ends in .jsonl or .parquet (records of "text", "prompt" and
    /// "completion", or "messages" rendered with the chat template).
    data: PathBuf,
    /// Examples: the most tokens of one (default --ctx, which it also sets when --ctx is not given).
    max_length: usize,
    /// Examples: leave out those longer than --max-length instead of truncating them.
    drop_long: bool,
    /// Examples: learn the prompts (system and user turns, a completion's prompt) too.
    train_on_prompt: bool,
    /// Preference pairs (--data records of "prompt", "chosen" and "rejected"): the loss types,
    /// comma-separated, by TRL's DPO names — sigmoid (the default), hinge, ipo, exo_pair,
    /// nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down,
    /// discopop, sft, sigmoid_norm; the reference-free cpo, simpo and orpo (TRL's CPOTrainer
    /// and ORPOTrainer); for unpaired records ("completion" and "label"), kto or
    /// apo_zero_unpaired.
    preference_loss: String,
    /// Preference pairs: each loss type's weight, comma-separated (default 1 each).
    preference_loss_weights: String,
    /// Preference pairs: how far the policy may move from the reference (default 0.1; IPO's τ).
    beta: f64,
    /// Preference pairs: robust's label-flip rate, exo_pair's ε, aot's smoothing (default 0).
    label_smoothing: f64,
    /// Preference pairs: discopop's temperature (default 0.05).
    discopop_tau: f64,
    /// Preference pairs: the f-divergence of the scores — reverse_kl (the default),
    /// forward_kl, js_divergence or alpha_divergence (with --f-alpha, default 0.5).
    f_divergence: String,
    /// Preference pairs: the α of --f-divergence alpha_divergence.
    f_alpha: f64,
    /// Unpaired preferences (records of "prompt", "completion" and "label", scored by
    /// --preference-loss kto or apo_zero_unpaired): the weight of desirable completions'
    /// losses (default 1).
    desirable_weight: f64,
    /// Unpaired preferences: the weight of undesirable completions' losses (default 1).
    undesirable_weight: f64,
    /// Preference pairs under --preference-loss simpo: the target margin of the averaged
    /// scores, over --beta (default 0.5).
    simpo_gamma: f64,
    /// Preference pairs under --preference-loss cpo or simpo: the weight of the chosen
    /// completions' token loss (default 1 for cpo, 0 for simpo).
    cpo_alpha: f64,
    /// Preference pairs: keep the reference's scores in this JSON file — read back where it
    /// holds the same pairs scored by the same model, else computed before the first step
    /// and written there.
    reference_scores: PathBuf,
    /// Preference pairs: score each step's pairs with the reference as they come (TRL's
    /// default) instead of every pair before the first step — under LoRA the model as it
    /// started, else a frozen copy of the model.
    live_reference: bool,
    /// Preference pairs: TR-DPO — the reference is a frozen copy of the model that scores
    /// each step's pairs and moves towards the policy after every this many steps (TRL's
    /// ref_model_sync_steps with sync_ref_model).
    sync_reference_every: u64,
    /// Preference pairs under --sync-reference-every: the policy's share of each synced
    /// reference parameter (default 0.6, TRL's ref_model_mixup_alpha).
    reference_mixup: f64,
    /// Train the --model-dir decoder as a reward model on preference pairs, as TRL's
    /// RewardTrainer does: its language head gives way to a fresh score head of one output
    /// (a folder that is already a sequence classifier of one label is a reward model
    /// without this flag).
    reward_model: bool,
    /// Reward models: add this times the mean squared sum of each pair's rewards, which
    /// keeps the rewards centred on zero (default: nothing added).
    center_rewards_coefficient: f64,
    /// GRPO (--data records of "prompt" alone): the shell command that rewards each
    /// generation batch — it reads one JSON line per completion on its standard input (the
    /// record's fields, with "completion": the text generated) and writes one reward per
    /// line (a number, or null where none can be given).
    reward_command: String,
    /// GRPO: completions generated for each prompt, one group (default 8).
    num_generations: usize,
    /// GRPO: the most tokens of a completion (default 256).
    max_completion_length: usize,
    /// GRPO: how the per-token losses become one, by TRL's names — dapo (the default), grpo,
    /// bnpo, dr_grpo, cispo, sapo, luspo or vespo.
    grpo_loss: String,
    /// GRPO: the ratio's lower clip, 1 − ε (default 0.2).
    epsilon: f64,
    /// GRPO: the ratio's upper clip, 1 + ε_high (default --epsilon; cispo: its clip of the weight).
    epsilon_high: f64,
    /// GRPO: clip the unclipped ratio from above at this value too (two-sided GRPO).
    delta: f64,
    /// GRPO: token (the default) or sequence (GSPO): one ratio per token or per completion.
    importance_sampling_level: String,
    /// GRPO: what rewards are scaled by after their group's mean is taken away — group (its
    /// standard deviation, the default), batch or none.
    scale_rewards: String,
    /// GRPO: updates on each generation batch (default 1).
    num_iterations: usize,
    /// GRPO: micro-batches one generation batch is cut into (default --accumulation).
    steps_per_generation: usize,
    /// GRPO: leave completions cut at --max-completion-length out of the loss.
    mask_truncated_completions: bool,
    /// GRPO: sampling temperature; the log-probabilities are of the logits divided by it (default 1).
    temperature: f64,
    /// GRPO: sample among the k most likely tokens only (0: all, the default).
    top_k: usize,
    /// GRPO: sample among the most likely tokens whose probabilities first reach p together.
    top_p: f64,
    /// GRPO: sample among the tokens at least this fraction as likely as the most likely.
    min_p: f64,
    /// GRPO: divide the logits of tokens already in the row by this (multiply where
    /// negative) before sampling (default 1: none).
    repetition_penalty: f64,
    /// Examples: pack several into each row of --ctx tokens, each attending only to itself
    /// and with positions starting again at 0.
    pack: bool,
    /// Examples: how --pack fills rows: in-order (each epoch's shuffled examples in turn,
    /// the default) or bfd (TRL's best-fit decreasing, rows made once and shuffled).
    packing_strategy: String,
    /// Examples: the Jinja chat template that renders conversations (default: the model
    /// folder's chat_template.jinja or tokenizer_config.json's chat_template).
    chat_template: PathBuf,
    /// Examples, pairs and prompts: a JSON object of variables every chat-template rendering
    /// gets, beneath a record's own (TRL's chat_template_kwargs: {"enable_thinking": false}).
    chat_template_kwargs: String,
    /// Hugging Face tokenizer.json for --data.
    tokenizer: PathBuf,
    /// Train on this token file (`strata tokenize`'s, or raw little-endian ids), memory-mapped.
    token_file: PathBuf,
    /// Width of a raw token file's ids: u16 (nanoGPT's .bin, the default) or u32; a file
    /// written by `strata tokenize` says its own.
    token_width: String,
    /// Validation text or examples (read as --data): its loss and perplexity go to the metrics.
    val_data: PathBuf,
    /// Validation tokens as a token file (as --token-file).
    val_token_file: PathBuf,
    /// Steps between validations (default: at the end only).
    eval_every: u64,
    /// Global batches of each validation, consecutive windows from the start of the
    /// validation data (default: as many as fit, at most 8).
    eval_batches: usize,
    /// Replay the batches of another run: JSON {"ctx", "batch", "offsets": [[o, ...], ...]}.
    batch_offsets: PathBuf,
    /// Load initial weights from this safetensors file.
    init_weights: PathBuf,
    /// Save the trained weights to this safetensors file.
    save_weights: PathBuf,
    /// Optimizer: adamw, adam or sgd.
    optimizer: String,
    /// Peak learning rate.
    lr: f64,
    /// Adam betas, as B1,B2.
    betas: String,
    /// Adam epsilon.
    eps: f64,
    /// Weight decay (to every parameter unless --decay-norms-and-biases false).
    weight_decay: f64,
    /// Whether weight decay reaches normalisation layers and biases (default true);
    /// false leaves them out as `transformers`' Trainer does.
    decay_norms_and_biases: bool,
    /// SGD momentum.
    momentum: f64,
    /// SGD Nesterov momentum.
    nesterov: bool,
    /// Clip the global gradient norm to this value (default 1; 0 turns clipping off).
    grad_clip: f64,
    /// Learning-rate schedule: constant (after a warm-up where --warmup is given), cosine
    /// (linear warm-up then cosine), linear (warm-up then a straight line down), wsd
    /// (warm-up, stable, decay) or step.
    schedule: String,
    /// Warm-up steps of the constant, cosine, linear and wsd schedules.
    warmup: u64,
    /// Final learning rate of the cosine, linear and wsd schedules, as a fraction of --lr.
    min_lr_factor: f64,
    /// Step where the wsd schedule's decay starts (default: --steps less --decay-steps).
    decay_start: u64,
    /// Steps of the wsd schedule's decay (default a fifth of --steps).
    decay_steps: u64,
    /// Shape of the wsd schedule's decay: linear, 1-sqrt or cosine.
    decay_shape: String,
    /// Steps between learning-rate drops of the step schedule.
    step_every: u64,
    /// Factor of each drop of the step schedule.
    step_gamma: f64,
    /// Optimizer steps (0 just initialises, and saves with --save-weights).
    steps: u64,
    /// Rows per optimizer step (global batch).
    batch_size: usize,
    /// Micro-batches per step (gradient accumulation).
    accumulation: usize,
    /// Seed of initialisation and data order.
    seed: u64,
    /// CPU threads for libtorch.
    threads: i32,
    /// Compute device: cpu, cuda or cuda:N.
    device: String,
    /// Write one JSON object per step to this file.
    metrics: PathBuf,
    /// Write TensorBoard event files into this folder: the metrics file's scalars per step
    /// and, with --profile, the profile's pictures.
    tensorboard: PathBuf,
    /// Time every unit's forward and backward and the communication waited for around
    /// them, into the metrics (`unit_times`).
    unit_times: bool,
    /// On a GPU: capture the training step as a CUDA graph after two eager steps and replay
    /// it for every later step of the same shapes.
    cuda_graph: bool,
    /// Record a profile of the run into this folder (one file per rank): every unit's phases,
    /// gathers, copies and the ledger's bytes over time (`strata profile trace|summary`).
    profile: PathBuf,
    /// Train data parallel on this many local ranks (started through `strata launch`).
    nproc: usize,
    /// Gradient bucket size of data-parallel training, in bytes (default 25 MiB).
    bucket_bytes: usize,
    /// Data parallel: parameters may get no gradient in a step (otherwise an error).
    find_unused_parameters: bool,
    /// Optimization strategy: JSON in list form (e.g. '["zero2"]'), a file holding it, or
    /// auto (searched by dry runs).
    strategy: String,
    /// With --strategy auto: methods no candidate may use (comma-separated).
    excluded: String,
    /// With --strategy auto: methods every candidate must use (comma-separated).
    included: String,
    /// With --strategy auto: seconds the search may take.
    time_limit: f64,
    /// With --strategy auto: guided (a few dry runs) or exhaustive (every candidate).
    search: String,
    /// With --strategy auto: LoRA adapters to train where full fine-tuning fits no
    /// candidate, as lora's JSON configuration (e.g. '{"r": 16, "target_modules": "all-linear"}').
    auto_lora: String,
    /// Timed steps of each dry run (after one warm-up step).
    dry_run_steps: usize,
    /// With --strategy auto: dry runs more of each finalist within 15% of the fastest
    /// (0: one measurement decides).
    confirm_runs: usize,
    /// Tune the given strategy's knobs (prefetch, bucket size) with short dry runs.
    finetune_strategy: bool,
    /// Train as PatrickStar's JSON configuration says (optimizer, fp16 loss scaler, chunk
    /// size, CPU embedding): states placed between device and host against the budgets;
    /// instead of --strategy and the optimizer flags.
    patrickstar_config: PathBuf,
    /// Write the strategy used to this file (JSON, loadable with --strategy).
    save_strategy: PathBuf,
    /// Write the search's report (every candidate, its outcome) to this JSON file.
    search_report: PathBuf,
    /// Bytes each rank's device may hold: dry runs over it are out, the engine refuses more.
    device_memory: u64,
    /// Bytes of host memory each rank may hold for model states the offload method places
    /// there: a plan over it is refused when the engine is built.
    host_memory: u64,
    /// Freeze parameters whose name contains any of these comma-separated substrings.
    freeze: String,
    /// Save sharded checkpoints into this folder (at the end, and every --checkpoint-every).
    save_checkpoint: PathBuf,
    /// Steps between checkpoints (default: only at the end).
    checkpoint_every: u64,
    /// Checkpoints kept in --save-checkpoint's folder (default 2).
    keep_checkpoints: usize,
    /// Save checkpoints asynchronously: a snapshot in host memory, persisted by a writer
    /// thread while training goes on; a restarted job resumes from the snapshot.
    checkpoint_async: bool,
    /// Resume from a checkpoint: a checkpoint folder, one step's folder or a merged file; or
    /// auto: from --save-checkpoint's newest checkpoint if it has one (a restarted job),
    /// else from the start.
    resume: PathBuf,
    /// With --resume: read the data from its start in this run's order, so --seed,
    /// --batch-size and --ctx may differ from the checkpoint's; the weights, optimizer state,
    /// schedule and step count continue.
    restart_data: bool,
    /// Seconds to wait for the other ranks and the store (joining, every collective).
    comm_timeout: f64,
    /// Backends of the ranks' collectives, per device type ("cpu:shm,cuda:nccl"). Default:
    /// shm between the ranks of one host, else tcp; on GPUs nccl, or the host-staged ring
    /// where ranks share a GPU.
    comm_backend: String,
    /// Log a line every this many steps.
    log_every: u64,
}

/// Where tokens come from.
#[derive(Clone, Debug)]
pub enum DataChoice {
    Synthetic,
    /// A UTF-8 text file, tokenised with the run's tokenizer.
    Text(PathBuf),
    /// Examples in a JSON Lines or Parquet file.
    Examples(PathBuf),
    /// A token file, with the width of its ids where it is raw and a flag gave one.
    TokenFile(PathBuf, Option<TokenWidth>),
}

impl DataChoice {
    /// A file named by --data or --val-data: examples by their extension, else text.
    pub fn of_file(path: PathBuf) -> DataChoice {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl" | "parquet") => DataChoice::Examples(path),
            _ => DataChoice::Text(path),
        }
    }
}

/// The first of `flags` (name, whether given) that was given.
fn first_given(flags: &[(&'static str, bool)]) -> Option<&'static str> {
    flags.iter().find(|(_, given)| *given).map(|(flag, _)| *flag)
}

/// The example options and the context: --max-length and --ctx give each other's default
/// (64 without either); the example flags are refused where no data is examples.
fn example_options(
    o: &TrainOptions,
    data: &DataChoice,
    val: Option<&DataChoice>,
) -> Result<(Option<ExampleOptions>, i64)> {
    let is_examples = |d: &DataChoice| matches!(d, DataChoice::Examples(_));
    if !is_examples(data) && !val.is_some_and(is_examples) {
        let given = [
            ("--max-length", o.max_length.is_some()),
            ("--drop-long", o.drop_long.is_some()),
            ("--train-on-prompt", o.train_on_prompt.is_some()),
            ("--pack", o.pack.is_some()),
            ("--packing-strategy", o.packing_strategy.is_some()),
            ("--chat-template", o.chat_template.is_some()),
            ("--chat-template-kwargs", o.chat_template_kwargs.is_some()),
        ];
        if let Some(flag) = first_given(&given) {
            bail!("{flag} shapes examples: give --data FILE.jsonl or FILE.parquet");
        }
        return Ok((None, o.ctx.unwrap_or(64)));
    }
    let ctx = o.ctx.or(o.max_length.map(|m| m as i64)).unwrap_or(64);
    let max_length = o.max_length.unwrap_or(ctx as usize);
    if max_length == 0 || max_length as i64 > ctx {
        bail!("--max-length {max_length} must be positive and within --ctx {ctx}");
    }
    let drop_long = o.drop_long.unwrap_or(false);
    let train_on_prompt = o.train_on_prompt.unwrap_or(false);
    Ok((Some(ExampleOptions { max_length, drop_long, train_on_prompt }), ctx))
}

/// How preference pairs are scored, from the preference flags (TRL's defaults where none is
/// given), and which of them were given.
fn preference_options(o: &TrainOptions) -> Result<(PreferenceConfig, Vec<&'static str>)> {
    let given = [
        ("--preference-loss", o.preference_loss.is_some()),
        ("--preference-loss-weights", o.preference_loss_weights.is_some()),
        ("--beta", o.beta.is_some()),
        ("--label-smoothing", o.label_smoothing.is_some()),
        ("--discopop-tau", o.discopop_tau.is_some()),
        ("--f-divergence", o.f_divergence.is_some()),
        ("--f-alpha", o.f_alpha.is_some()),
        ("--desirable-weight", o.desirable_weight.is_some()),
        ("--undesirable-weight", o.undesirable_weight.is_some()),
        ("--simpo-gamma", o.simpo_gamma.is_some()),
        ("--cpo-alpha", o.cpo_alpha.is_some()),
        ("--reference-scores", o.reference_scores.is_some()),
        ("--live-reference", o.live_reference.is_some()),
        ("--sync-reference-every", o.sync_reference_every.is_some()),
        ("--reference-mixup", o.reference_mixup.is_some()),
    ];
    let flags = given.iter().filter(|(_, g)| *g).map(|(f, _)| *f).collect();
    let defaults = PreferenceConfig::default();
    let kinds: Vec<PreferenceLoss> = match &o.preference_loss {
        Some(names) => names.split(',').map(|n| n.trim().parse()).collect::<strata::Result<_>>()?,
        None => defaults.losses.iter().map(|(k, _)| *k).collect(),
    };
    let weights: Vec<f64> = match &o.preference_loss_weights {
        Some(w) => {
            w.split(',').map(|x| x.trim().parse().context("--preference-loss-weights")).collect::<Result<_>>()?
        }
        None => vec![1.0; kinds.len()],
    };
    if weights.len() != kinds.len() {
        bail!("--preference-loss-weights gives {} weights for {} loss types", weights.len(), kinds.len());
    }
    if o.reference_mixup.is_some() && o.sync_reference_every.is_none() {
        bail!("--reference-mixup weighs the policy in a synced reference: give --sync-reference-every too");
    }
    let config = PreferenceConfig {
        losses: kinds.into_iter().zip(weights).collect(),
        beta: o.beta.unwrap_or(defaults.beta),
        label_smoothing: o.label_smoothing.unwrap_or(defaults.label_smoothing),
        discopop_tau: o.discopop_tau.unwrap_or(defaults.discopop_tau),
        f_divergence: FDivergence::parse(o.f_divergence.as_deref().unwrap_or("reverse_kl"), o.f_alpha.unwrap_or(0.5))?,
        desirable_weight: o.desirable_weight.unwrap_or(defaults.desirable_weight),
        undesirable_weight: o.undesirable_weight.unwrap_or(defaults.undesirable_weight),
        simpo_gamma: o.simpo_gamma.unwrap_or(defaults.simpo_gamma),
        cpo_alpha: o.cpo_alpha,
        reference_scores: o.reference_scores.clone(),
        live_reference: o.live_reference.unwrap_or(false),
        reference_sync: o
            .sync_reference_every
            .map(|every| ReferenceSync { every, mixup: o.reference_mixup.unwrap_or(0.6) }),
    };
    config.validate()?;
    Ok((config, flags))
}

/// A reward model's scoring where the run trains one (the folder a reward model, or turned
/// into one by --reward-model), its padding token taken as TRL takes it: the tokenizer's
/// padding token, else its end token; else the folder's `pad_token_id`, else its
/// `eos_token_id`.
fn reward_options(o: &TrainOptions, mut model_dir: Option<&mut ModelDir>) -> Result<Option<RewardConfig>> {
    let turn = o.reward_model.unwrap_or(false);
    if let Some(ModelConfig::Llama(c)) = model_dir.as_deref_mut().map(|d| &mut d.config) {
        if turn {
            c.head = DecoderHead::Reward;
        }
    }
    let decoder_head = |d: &ModelDir| match &d.config {
        ModelConfig::Llama(c) => Some(c.head),
        _ => None,
    };
    let folder = model_dir.as_deref();
    let Some(dir) = folder.filter(|d| decoder_head(d) == Some(DecoderHead::Reward)) else {
        if turn {
            bail!("--reward-model turns a decoder's model folder into a reward model: give --model-dir of one");
        }
        if o.center_rewards_coefficient.is_some() {
            bail!("--center-rewards-coefficient scores a reward model's pairs: give --reward-model true");
        }
        return Ok(None);
    };
    Ok(Some(RewardConfig {
        center_rewards_coefficient: o.center_rewards_coefficient,
        pad_token: padding_token(o, dir)?,
    }))
}

/// The token rows are padded with, as TRL takes it: the tokenizer's padding token, else its
/// end token; else the folder's `pad_token_id`, else its `eos_token_id`.
fn padding_token(o: &TrainOptions, dir: &ModelDir) -> Result<Option<i64>> {
    let token = tokenizer_special(o, dir)?;
    let folder_pad = match &dir.config {
        ModelConfig::Llama(c) => c.padding_token,
        _ => None,
    };
    match token("pad_token").or_else(|| token("eos_token")).or(folder_pad) {
        Some(pad) => Ok(Some(pad)),
        None => Ok(dir.eos_tokens()?.first().copied()),
    }
}

/// The id of a special token the tokenizer's configuration names (`pad_token`,
/// `eos_token`), where it names one the tokenizer has.
fn tokenizer_special(o: &TrainOptions, dir: &ModelDir) -> Result<impl Fn(&str) -> Option<i64>> {
    let tokenizer = tokenizer(o.tokenizer.as_deref(), Some(dir))?;
    let folder = tokenizer_folder(o.tokenizer.as_deref(), Some(dir.dir.as_path()));
    let special = match folder {
        Some(f) => strata::data::chat::tokenizer_config(f)?,
        None => serde_json::Value::Null,
    };
    Ok(move |key: &str| {
        let text = strata::data::chat::special_token(&special, key)?;
        tokenizer.token_id(&text).map(i64::from)
    })
}

/// GRPO's settings where --reward-command is given: TRL's defaults where no flag says
/// otherwise, completions ended by the folder's and the tokenizer's end tokens.
fn grpo_options(o: &TrainOptions, model_dir: Option<&ModelDir>) -> Result<Option<GrpoSettings>> {
    let given = [
        ("--num-generations", o.num_generations.is_some()),
        ("--max-completion-length", o.max_completion_length.is_some()),
        ("--grpo-loss", o.grpo_loss.is_some()),
        ("--epsilon", o.epsilon.is_some()),
        ("--epsilon-high", o.epsilon_high.is_some()),
        ("--delta", o.delta.is_some()),
        ("--importance-sampling-level", o.importance_sampling_level.is_some()),
        ("--scale-rewards", o.scale_rewards.is_some()),
        ("--num-iterations", o.num_iterations.is_some()),
        ("--steps-per-generation", o.steps_per_generation.is_some()),
        ("--mask-truncated-completions", o.mask_truncated_completions.is_some()),
        ("--temperature", o.temperature.is_some()),
        ("--top-k", o.top_k.is_some()),
        ("--top-p", o.top_p.is_some()),
        ("--min-p", o.min_p.is_some()),
        ("--repetition-penalty", o.repetition_penalty.is_some()),
    ];
    let Some(command) = &o.reward_command else {
        if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
            bail!("{flag} shapes GRPO: give --reward-command and --data records of \"prompt\" alone");
        }
        return Ok(None);
    };
    let Some(dir) = model_dir else {
        bail!("GRPO generates with a tokenizer and ends completions at its end token: give --model-dir");
    };
    let d = GrpoConfig::default();
    let config = GrpoConfig {
        num_generations: o.num_generations.unwrap_or(d.num_generations),
        max_completion_length: o.max_completion_length.unwrap_or(d.max_completion_length),
        temperature: o.temperature.unwrap_or(d.temperature),
        top_k: o.top_k.filter(|&k| k > 0),
        top_p: o.top_p,
        min_p: o.min_p,
        repetition_penalty: o.repetition_penalty.unwrap_or(d.repetition_penalty),
        loss: o.grpo_loss.as_deref().map(str::parse).transpose()?.unwrap_or(d.loss),
        beta: o.beta.unwrap_or(d.beta),
        epsilon: o.epsilon.unwrap_or(d.epsilon),
        epsilon_high: o.epsilon_high,
        delta: o.delta,
        importance_sampling: o
            .importance_sampling_level
            .as_deref()
            .map(str::parse)
            .transpose()?
            .unwrap_or(d.importance_sampling),
        scale_rewards: o.scale_rewards.as_deref().map(str::parse).transpose()?.unwrap_or(d.scale_rewards),
        num_iterations: o.num_iterations.unwrap_or(d.num_iterations),
        steps_per_generation: o.steps_per_generation,
        mask_truncated_completions: o.mask_truncated_completions.unwrap_or(false),
        ..d
    };
    config.validate()?;
    let eos = tokenizer_special(o, dir)?("eos_token");
    let mut stop_tokens = dir.eos_tokens()?;
    stop_tokens.extend(eos.filter(|e| !stop_tokens.contains(e)));
    let pad = padding_token(o, dir)?
        .context("GRPO pads rows with the tokenizer's padding or end token: the folder names neither")?;
    Ok(Some(GrpoSettings { config, reward_command: command.clone(), stop_tokens, pad }))
}

/// GRPO's settings: TRL's configuration, the reward command and the tokenizer's tokens.
#[derive(Clone, Debug)]
pub struct GrpoSettings {
    pub config: GrpoConfig,
    /// The shell command that rewards a generation batch's completions.
    pub reward_command: String,
    /// Tokens that end a completion.
    pub stop_tokens: Vec<i64>,
    /// The token rows are padded with.
    pub pad: i64,
}

/// Everything `strata train` needs, resolved and validated (except the vocabulary, which
/// may depend on the data: `vocab` is `None` when it is to be taken from there).
#[derive(Clone, Debug)]
pub struct TrainSettings {
    pub model_name: String,
    pub model_dir: Option<ModelDir>,
    /// The model-shape flags given (refused beside --model-dir).
    pub shape_flags: Vec<&'static str>,
    pub save_model_dir: Option<PathBuf>,
    pub init_adapter: Option<PathBuf>,
    pub save_adapter_dir: Option<PathBuf>,
    pub max_shard_size: u64,
    pub val: Option<DataChoice>,
    /// How example data is cut and learned (set when the data is examples).
    pub examples: Option<ExampleOptions>,
    /// How preference pairs are scored, where the data holds them.
    pub preference: PreferenceConfig,
    /// The preference flags given (refused where the data holds no pairs).
    pub preference_flags: Vec<&'static str>,
    /// How a reward model's pairs are scored, where the model is a reward model.
    pub reward: Option<RewardConfig>,
    /// GRPO's settings, where a reward command is given.
    pub grpo: Option<GrpoSettings>,
    /// Pack several examples into each row.
    pub pack: bool,
    /// How packed rows are filled.
    pub pack_strategy: PackStrategy,
    pub chat_template: Option<PathBuf>,
    /// Variables every chat-template rendering gets.
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Hugging Face tokenizer.json for text data (default: the model folder's, else bytes).
    pub tokenizer: Option<PathBuf>,
    pub eval_every: Option<u64>,
    pub eval_batches: Option<usize>,
    pub layers: i64,
    pub ffn_dim: Option<i64>,
    pub rope_theta: Option<f64>,
    pub kv_heads: Option<i64>,
    /// Experts and experts per token of a mixture of experts.
    pub experts: Option<(i64, i64)>,
    /// A mixture of experts' capacity factor and its losses' weights.
    pub expert_capacity: Option<f64>,
    pub router_aux_loss: Option<f64>,
    pub router_z_loss: Option<f64>,
    /// The choice biases' update rate.
    pub router_bias_rate: Option<f64>,
    /// Dropout at every site, in place of the model's rates.
    pub dropout: Option<f64>,
    pub norm_eps: Option<f64>,
    pub tie_embeddings: Option<bool>,
    pub heads: i64,
    pub dim: i64,
    pub ctx: i64,
    pub vocab: Option<i64>,
    pub data: DataChoice,
    pub batch_offsets: Option<PathBuf>,
    pub init_weights: Option<PathBuf>,
    pub save_weights: Option<PathBuf>,
    pub optimizer: OptimizerConfig,
    pub grad_clip: Option<f64>,
    pub schedule: LrSchedule,
    pub steps: u64,
    pub batch_size: usize,
    pub accumulation: usize,
    pub seed: u64,
    pub threads: Option<i32>,
    pub device: tch::Device,
    pub metrics: Option<PathBuf>,
    pub tensorboard: Option<PathBuf>,
    pub unit_times: bool,
    pub cuda_graph: bool,
    pub profile: Option<PathBuf>,
    pub log_every: u64,
    pub nproc: usize,
    pub bucket_bytes: usize,
    pub find_unused_parameters: bool,
    pub strategy: StrategyChoice,
    /// PatrickStar's configuration, which decides the strategy once the model and the world
    /// size are known.
    pub patrickstar: Option<strata::patrickstar::PatrickStarConfig>,
    pub excluded: Vec<String>,
    pub included: Vec<String>,
    pub time_limit: Option<std::time::Duration>,
    pub search: SearchMode,
    pub finetune_strategy: bool,
    pub dry_run_steps: usize,
    pub confirm_runs: usize,
    pub auto_lora: Option<strata::strategy::LoraConfig>,
    pub save_strategy: Option<PathBuf>,
    pub search_report: Option<PathBuf>,
    pub device_memory: Option<u64>,
    pub host_memory: Option<u64>,
    pub freeze: Vec<String>,
    pub save_checkpoint: Option<PathBuf>,
    pub checkpoint_every: Option<u64>,
    pub keep_checkpoints: usize,
    pub checkpoint_async: bool,
    pub resume: Option<Resume>,
    pub restart_data: bool,
    pub comm_timeout: std::time::Duration,
    pub comm_backend: Option<String>,
}

/// A given strategy, or one to search for.
#[derive(Clone, Debug)]
pub enum StrategyChoice {
    Given(Strategy),
    Auto,
}

fn list(text: Option<String>) -> Vec<String> {
    text.map(|f| f.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()).unwrap_or_default()
}

/// A strategy from JSON text, or from the file a path names.
pub fn parse_strategy(text: &str) -> Result<Strategy> {
    let trimmed = text.trim_start();
    if trimmed.starts_with('[') || trimmed.starts_with('{') || trimmed.starts_with('"') {
        return Ok(Strategy::parse(text)?);
    }
    let path = Path::new(text);
    let body =
        std::fs::read_to_string(path).with_context(|| format!("cannot read strategy file {}", path.display()))?;
    Strategy::parse(&body).with_context(|| format!("strategy file {}", path.display()))
}

/// The tokenizer a model folder or `--tokenizer` names, bytes otherwise; checked to fit in a
/// model of `vocab` tokens where that is known.
pub fn tokenizer(given: Option<&Path>, model_dir: Option<&ModelDir>) -> Result<Tokenizer> {
    let path = given.or_else(|| model_dir.and_then(|m| m.tokenizer.as_deref()));
    let tokenizer = match path {
        Some(p) => Tokenizer::from_file(p)?,
        None => Tokenizer::Bytes,
    };
    if let Some(m) = model_dir {
        let (size, vocab) = (tokenizer.vocab_size(), m.config.vocab());
        if size as i64 > vocab {
            let name = path.map_or("the byte tokenizer".to_string(), |p| p.display().to_string());
            bail!("{name}: the tokenizer has {size} tokens, more than the {vocab} of the model folder's config.json (vocab_size)");
        }
    }
    Ok(tokenizer)
}

/// The folder whose `tokenizer_config.json` names the special tokens and chat template: the
/// model folder, else the folder of a given `tokenizer.json` where it has one.
pub fn tokenizer_folder<'a>(tokenizer: Option<&'a Path>, model_dir: Option<&'a Path>) -> Option<&'a Path> {
    model_dir.or_else(|| tokenizer.and_then(Path::parent).filter(|d| d.join("tokenizer_config.json").is_file()))
}

impl TrainSettings {
    pub fn model(&self, vocab: i64) -> Result<ModelConfig> {
        let mut config = self.shaped_model(vocab)?;
        let routing = [
            ("--expert-capacity", self.expert_capacity.is_some()),
            ("--router-aux-loss", self.router_aux_loss.is_some()),
            ("--router-z-loss", self.router_z_loss.is_some()),
            ("--router-bias-rate", self.router_bias_rate.is_some()),
        ];
        if let Some(flag) = first_given(&routing) {
            let Some(moe) = config.moe_mut() else {
                bail!("{flag} routes a mixture of experts: the model has no experts")
            };
            moe.capacity_factor = self.expert_capacity.or(moe.capacity_factor);
            moe.aux_loss_coef = self.router_aux_loss.unwrap_or(moe.aux_loss_coef);
            moe.z_loss_coef = self.router_z_loss.unwrap_or(moe.z_loss_coef);
            moe.bias_update_rate = self.router_bias_rate.unwrap_or(moe.bias_update_rate);
            moe.validate()?;
        }
        if let Some(rate) = self.dropout {
            let Some(rates) = config.dropout_mut() else { bail!("--dropout: the MLP model has no dropout sites") };
            *rates = DropoutRates::all(rate);
            rates.validate().context("--dropout")?;
        }
        Ok(config)
    }

    /// The model the shape flags or the model folder describe.
    fn shaped_model(&self, vocab: i64) -> Result<ModelConfig> {
        if let Some(dir) = &self.model_dir {
            if let Some(flag) = self.shape_flags.first() {
                bail!("{flag} is set by the model folder's config.json; --model-dir takes no model-shape flags");
            }
            if let Some(context) = dir.config.context().filter(|&c| self.ctx > c) {
                bail!("--ctx {} is longer than the model folder's context of {context} positions", self.ctx);
            }
            // A tokenizer the model cannot take is refused whatever the data.
            if self.tokenizer.is_some() || dir.tokenizer.is_some() {
                tokenizer(self.tokenizer.as_deref(), Some(dir))?;
            }
            return Ok(dir.config.clone());
        }
        let (layers, heads, dim, ctx) = (self.layers, self.heads, self.dim, self.ctx);
        let llama_only = [
            ("--ffn-dim", self.ffn_dim.is_some()),
            ("--rope-theta", self.rope_theta.is_some()),
            ("--kv-heads", self.kv_heads.is_some()),
            ("--tie-embeddings", self.tie_embeddings.is_some()),
            ("--experts", self.experts.is_some()),
        ];
        if let Some(flag) = first_given(&llama_only).filter(|_| self.model_name != "llama") {
            bail!("{flag} belongs to --model llama: the {} model has no such part", self.model_name);
        }
        if self.norm_eps.is_some() && self.model_name == "mlp" {
            bail!("--norm-eps belongs to --model gpt or llama: the mlp model has no norms");
        }
        Ok(match self.model_name.as_str() {
            "gpt" => ModelConfig::Gpt(GptConfig {
                norm_eps: self.norm_eps.unwrap_or(DEFAULT_NORM_EPS),
                ..GptConfig::new(vocab, ctx, layers, heads, dim)
            }),
            "llama" => {
                let defaults = LlamaConfig::new(vocab, ctx, layers, heads, dim);
                let rope_theta = self.rope_theta.unwrap_or(defaults.rope_theta);
                ModelConfig::Llama(LlamaConfig {
                    ffn_dim: self.ffn_dim,
                    rope_theta,
                    kv_heads: self.kv_heads,
                    norm_eps: self.norm_eps.unwrap_or(DEFAULT_NORM_EPS),
                    tie_embeddings: self.tie_embeddings.unwrap_or(false),
                    moe: self.experts.map(|(experts, top_k)| MoeConfig {
                        norm_topk: true,
                        aux_loss_coef: 0.001,
                        ..MoeConfig::new(experts, top_k, self.ffn_dim.unwrap_or_else(|| defaults.hidden()))
                    }),
                    ..defaults
                })
            }
            "mlp" => ModelConfig::Mlp(MlpConfig { vocab, layers, dim }),
            other => bail!("unknown model {other:?}; expected gpt, llama or mlp"),
        })
    }
}

fn read_config(path: &Path) -> Result<TrainOptions> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.message()))
}

pub fn parse_device(s: &str) -> Result<tch::Device> {
    match s {
        "cpu" => Ok(tch::Device::Cpu),
        "cuda" => Ok(tch::Device::Cuda(0)),
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Ok(tch::Device::Cuda(i)),
            _ => bail!("unknown device {s:?}; expected cpu, cuda or cuda:N"),
        },
    }
}

/// `--auto-lora`'s JSON: a configuration of the `lora` method.
fn parse_lora(text: &str) -> Result<strata::strategy::LoraConfig> {
    let config: serde_json::Value =
        serde_json::from_str(text).context("--auto-lora takes lora's configuration as JSON")?;
    strata::strategy::LoraConfig::from_value(Some(&config)).context("--auto-lora")
}

fn parse_betas(s: &str) -> Result<(f64, f64)> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    match parts.as_slice() {
        [a, b] => Ok((a.parse().context("--betas")?, b.parse().context("--betas")?)),
        _ => bail!("--betas takes two numbers as B1,B2, got {s:?}"),
    }
}

/// Options that would change nothing with the rest of the command are refused by name.
fn refuse_idle_options(o: &TrainOptions, strategy: &StrategyChoice) -> Result<()> {
    let auto = matches!(strategy, StrategyChoice::Auto);
    let finetune = o.finetune_strategy == Some(true);
    let searched_only = [
        ("--excluded", o.excluded.is_some()),
        ("--included", o.included.is_some()),
        ("--time-limit", o.time_limit.is_some()),
        ("--search", o.search.is_some()),
        ("--auto-lora", o.auto_lora.is_some()),
        ("--confirm-runs", o.confirm_runs.is_some()),
    ];
    if let Some(flag) = first_given(&searched_only).filter(|_| !auto) {
        bail!("{flag} shapes the automatic search: it needs --strategy auto");
    }
    let dry_run_only = [("--dry-run-steps", o.dry_run_steps.is_some()), ("--search-report", o.search_report.is_some())];
    if let Some(flag) = first_given(&dry_run_only).filter(|_| !auto && !finetune) {
        bail!("{flag} needs dry runs: give --strategy auto or --finetune-strategy");
    }
    if auto && finetune {
        bail!("--finetune-strategy tunes a given strategy; --strategy auto searches one instead");
    }
    if let (Some(_), StrategyChoice::Given(s)) = (o.bucket_bytes, strategy) {
        if let Some((name, _)) = s.sharding() {
            bail!("--bucket-bytes sizes data parallel's gradient buckets; {name} reduces unit by unit without them");
        }
        // A rank of a launched job sees the job's size, not --nproc (the launcher drops it).
        let world = o.nproc.or_else(strata::comm::launched_world_size);
        if world.unwrap_or(1) == 1 {
            bail!("--bucket-bytes sizes data parallel's gradient buckets; one rank reduces nothing");
        }
    }
    Ok(())
}

impl TrainOptions {
    /// Merges the config file (if any) under the flags and applies defaults.
    pub fn resolve(self) -> Result<TrainSettings> {
        let o = match &self.config {
            Some(path) => {
                let file = read_config(path)?;
                self.or(file)
            }
            None => self,
        };
        let strategy = match o.strategy.as_deref() {
            Some("auto") => StrategyChoice::Auto,
            Some(text) => StrategyChoice::Given(parse_strategy(text)?),
            None => StrategyChoice::Given(Strategy::default()),
        };
        refuse_idle_options(&o, &strategy)?;
        let patrickstar = o.patrickstar_config.as_deref().map(PatrickStarConfig::from_file).transpose()?;
        if patrickstar.is_some() {
            let given = [
                ("--strategy", o.strategy.is_some()),
                ("--optimizer", o.optimizer.is_some()),
                ("--lr", o.lr.is_some()),
                ("--betas", o.betas.is_some()),
                ("--eps", o.eps.is_some()),
                ("--weight-decay", o.weight_decay.is_some()),
                ("--decay-norms-and-biases", o.decay_norms_and_biases.is_some()),
            ];
            if let Some(flag) = first_given(&given) {
                bail!("{flag} conflicts with --patrickstar-config, whose configuration sets it");
            }
        }
        let defaults = OptimizerConfig::default();
        let kind: OptimizerKind = o.optimizer.as_deref().unwrap_or("adamw").parse()?;
        let lr = o.lr.unwrap_or(3e-3);
        let steps = o.steps.unwrap_or(300);
        let schedule = match o.schedule.as_deref().unwrap_or("cosine") {
            "constant" => match o.warmup {
                Some(warmup) if warmup > 0 => LrSchedule::WarmupConstant { warmup },
                _ => LrSchedule::Constant,
            },
            "cosine" => LrSchedule::WarmupCosine {
                warmup: o.warmup.unwrap_or((steps / 20).max(1)),
                total: steps,
                min_factor: o.min_lr_factor.unwrap_or(0.1),
            },
            "step" => LrSchedule::Step {
                every: o.step_every.unwrap_or((steps / 3).max(1)),
                gamma: o.step_gamma.unwrap_or(0.1),
            },
            "linear" => LrSchedule::Linear {
                warmup: o.warmup.unwrap_or((steps / 20).max(1)),
                total: steps,
                min_factor: o.min_lr_factor.unwrap_or(0.0),
            },
            "wsd" => {
                let decay_steps = o.decay_steps.unwrap_or((steps / 5).max(1));
                LrSchedule::WarmupStableDecay {
                    warmup: o.warmup.unwrap_or((steps / 20).max(1)),
                    decay_start: o.decay_start.unwrap_or(steps.saturating_sub(decay_steps)),
                    decay_steps,
                    min_factor: o.min_lr_factor.unwrap_or(0.0),
                    shape: o.decay_shape.as_deref().unwrap_or("linear").parse()?,
                }
            }
            other => bail!("unknown schedule {other:?}; expected constant, cosine, linear, wsd or step"),
        };
        // A flag the chosen schedule has no use for is refused rather than ignored.
        let (wsd, step, constant) = (
            matches!(schedule, LrSchedule::WarmupStableDecay { .. }),
            matches!(schedule, LrSchedule::Step { .. }),
            matches!(schedule, LrSchedule::Constant | LrSchedule::WarmupConstant { .. }),
        );
        let unused = [
            ("--decay-start", o.decay_start.is_some() && !wsd, "the wsd schedule"),
            ("--decay-steps", o.decay_steps.is_some() && !wsd, "the wsd schedule"),
            ("--decay-shape", o.decay_shape.is_some() && !wsd, "the wsd schedule"),
            ("--step-every", o.step_every.is_some() && !step, "the step schedule"),
            ("--step-gamma", o.step_gamma.is_some() && !step, "the step schedule"),
            ("--warmup", o.warmup.is_some() && step, "the constant, cosine, linear and wsd schedules"),
            (
                "--min-lr-factor",
                o.min_lr_factor.is_some() && (step || constant),
                "the cosine, linear and wsd schedules",
            ),
        ];
        if let Some((flag, _, schedules)) = unused.iter().find(|(_, given, _)| *given) {
            bail!("{flag} shapes {schedules}: give --schedule accordingly");
        }
        schedule.validate()?;
        let optimizer = OptimizerConfig {
            kind,
            lr,
            betas: o.betas.as_deref().map(parse_betas).transpose()?.unwrap_or(defaults.betas),
            eps: o.eps.unwrap_or(defaults.eps),
            weight_decay: o.weight_decay.unwrap_or(if kind == OptimizerKind::Sgd { 0.0 } else { 0.1 }),
            decay_norms_and_biases: o.decay_norms_and_biases.unwrap_or(true),
            momentum: o.momentum.unwrap_or(0.0),
            dampening: 0.0,
            nesterov: o.nesterov.unwrap_or(false),
        };
        let optimizer = match &patrickstar {
            Some(c) => c.optimizer_config()?,
            None => optimizer,
        };
        optimizer.validate()?;
        let width: Option<TokenWidth> = o.token_width.as_deref().map(str::parse).transpose()?;
        if width.is_some() && o.token_file.is_none() && o.val_token_file.is_none() {
            bail!("--token-width reads token files: give --token-file or --val-token-file");
        }
        let val = match (o.val_data.clone(), o.val_token_file.clone()) {
            (Some(_), Some(_)) => bail!("give either --val-data or --val-token-file, not both"),
            (Some(path), None) => Some(DataChoice::of_file(path)),
            (None, Some(path)) => Some(DataChoice::TokenFile(path, width)),
            (None, None) => None,
        };
        if val.is_none() {
            if let Some(flag) =
                first_given(&[("--eval-every", o.eval_every.is_some()), ("--eval-batches", o.eval_batches.is_some())])
            {
                bail!("{flag} shapes validation: give --val-data or --val-token-file");
            }
        }
        let text_val = matches!(val, Some(DataChoice::Text(_) | DataChoice::Examples(_)));
        let data = match (o.data.clone(), o.token_file.clone()) {
            (Some(_), Some(_)) => bail!("give either --data or --token-file, not both"),
            (Some(path), None) => DataChoice::of_file(path),
            (None, Some(path)) => DataChoice::TokenFile(path, width),
            (None, None) if o.tokenizer.is_some() && !text_val => bail!("--tokenizer needs --data or --val-data"),
            (None, None) => DataChoice::Synthetic,
        };
        let shape_flags: Vec<&'static str> = [
            ("--model", o.model.is_some()),
            ("--layers", o.layers.is_some()),
            ("--heads", o.heads.is_some()),
            ("--dim", o.dim.is_some()),
            ("--vocab", o.vocab.is_some()),
            ("--ffn-dim", o.ffn_dim.is_some()),
            ("--rope-theta", o.rope_theta.is_some()),
            ("--kv-heads", o.kv_heads.is_some()),
            ("--experts", o.experts.is_some()),
            ("--experts-per-token", o.experts_per_token.is_some()),
            ("--norm-eps", o.norm_eps.is_some()),
            ("--tie-embeddings", o.tie_embeddings.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect();
        if o.model_dir.is_some() && o.init_weights.is_some() {
            bail!("--init-weights and --model-dir both give the initial weights: choose one");
        }
        if o.max_shard_size.is_some() && o.save_model_dir.is_none() {
            bail!("--max-shard-size sizes the files of --save-model-dir: give --save-model-dir");
        }
        let mut model_dir = o.model_dir.as_deref().map(strata::model::from_pretrained_dir).transpose()?;
        let reward = reward_options(&o, model_dir.as_mut())?;
        let grpo = grpo_options(&o, model_dir.as_ref())?;
        let grad_clip = match o.grad_clip.unwrap_or(1.0) {
            0.0 => None,
            c if c > 0.0 => Some(c),
            c => bail!("--grad-clip must be positive (or 0 for none), got {c}"),
        };
        let threads = o.threads;
        if threads.is_some_and(|t| t <= 0) {
            bail!("--threads must be positive");
        }
        // The data's windows are cut to the context before any model checks its shape.
        if let Some(ctx) = o.ctx.filter(|&c| c <= 0) {
            bail!("--ctx must be positive, got {ctx}");
        }
        let (examples, ctx) = example_options(&o, &data, val.as_ref())?;
        let (preference, preference_flags) = preference_options(&o)?;
        // A restarted job (torchrun --max-restarts) continues from its newest checkpoint.
        let resume = match o.resume {
            Some(path) if path.as_os_str() == "auto" => match &o.save_checkpoint {
                Some(_) => Some(Resume::Latest),
                None => bail!("--resume auto resumes from --save-checkpoint's folder: give --save-checkpoint"),
            },
            other => other.map(Resume::From),
        };
        Ok(TrainSettings {
            model_name: match &model_dir {
                Some(m) => m.family.model_type().to_string(),
                None => o.model.unwrap_or_else(|| "gpt".into()),
            },
            model_dir,
            shape_flags,
            save_model_dir: o.save_model_dir,
            init_adapter: o.init_adapter,
            save_adapter_dir: o.save_adapter_dir,
            max_shard_size: match o.max_shard_size {
                Some(0) => bail!("--max-shard-size must be positive"),
                size => size.unwrap_or(strata::io::DEFAULT_SHARD_BYTES),
            },
            val,
            tokenizer: o.tokenizer,
            eval_every: match o.eval_every {
                Some(0) => bail!("--eval-every must be positive"),
                every => every,
            },
            eval_batches: match o.eval_batches {
                Some(0) => bail!("--eval-batches must be positive"),
                count => count,
            },
            layers: o.layers.unwrap_or(2),
            ffn_dim: o.ffn_dim,
            rope_theta: o.rope_theta,
            kv_heads: o.kv_heads,
            experts: match (o.experts, o.experts_per_token) {
                (Some(e), k) => Some((e, k.unwrap_or(2))),
                (None, Some(_)) => bail!("--experts-per-token needs --experts"),
                (None, None) => None,
            },
            expert_capacity: o.expert_capacity,
            router_aux_loss: o.router_aux_loss,
            router_z_loss: o.router_z_loss,
            router_bias_rate: o.router_bias_rate,
            dropout: o.dropout,
            norm_eps: o.norm_eps,
            tie_embeddings: o.tie_embeddings,
            heads: o.heads.unwrap_or(4),
            dim: o.dim.unwrap_or(128),
            ctx,
            examples,
            preference,
            preference_flags,
            reward,
            grpo,
            pack: o.pack.unwrap_or(false),
            pack_strategy: match (&o.packing_strategy, o.pack) {
                (Some(_), Some(false) | None) => bail!("--packing-strategy fills packed rows: give --pack true"),
                (strategy, _) => strategy.as_deref().map(str::parse).transpose()?.unwrap_or_default(),
            },
            chat_template: o.chat_template,
            chat_template_kwargs: template_arguments(o.chat_template_kwargs.as_deref())?,
            vocab: o.vocab,
            data,
            batch_offsets: o.batch_offsets,
            init_weights: o.init_weights,
            save_weights: o.save_weights,
            optimizer,
            grad_clip,
            schedule,
            steps,
            batch_size: o.batch_size.unwrap_or(16),
            accumulation: o.accumulation.unwrap_or(1),
            seed: o.seed.unwrap_or(0),
            threads,
            device: parse_device(o.device.as_deref().unwrap_or("cpu"))?,
            metrics: o.metrics,
            tensorboard: o.tensorboard,
            unit_times: o.unit_times.unwrap_or(false),
            cuda_graph: o.cuda_graph.unwrap_or(false),
            profile: o.profile,
            log_every: o.log_every.unwrap_or(50).max(1),
            nproc: match o.nproc {
                Some(0) => bail!("--nproc must be at least 1"),
                n => n.unwrap_or(1),
            },
            bucket_bytes: match o.bucket_bytes {
                Some(0) => bail!("--bucket-bytes must be positive"),
                b => b.unwrap_or(strata::parallel::DEFAULT_BUCKET_BYTES),
            },
            find_unused_parameters: o.find_unused_parameters.unwrap_or(false),
            strategy,
            patrickstar,
            excluded: list(o.excluded),
            included: list(o.included),
            time_limit: o.time_limit.map(|t| seconds("--time-limit", t, true)).transpose()?,
            search: match o.search.as_deref() {
                None | Some("guided") => SearchMode::Guided,
                Some("exhaustive") => SearchMode::Exhaustive,
                Some(other) => bail!("unknown search {other:?}; expected guided or exhaustive"),
            },
            finetune_strategy: o.finetune_strategy.unwrap_or(false),
            auto_lora: o.auto_lora.as_deref().map(parse_lora).transpose()?,
            dry_run_steps: match o.dry_run_steps {
                Some(0) => bail!("--dry-run-steps must be positive"),
                n => n.unwrap_or(3),
            },
            confirm_runs: o.confirm_runs.unwrap_or(2),
            save_strategy: o.save_strategy,
            search_report: o.search_report,
            device_memory: match o.device_memory {
                Some(0) => bail!("--device-memory must be positive"),
                m => m,
            },
            host_memory: match o.host_memory {
                Some(0) => bail!("--host-memory must be positive"),
                m => m,
            },
            freeze: list(o.freeze),
            checkpoint_async: match (o.checkpoint_async.unwrap_or(false), &o.save_checkpoint) {
                (true, None) => bail!("--checkpoint-async saves checkpoints asynchronously: give --save-checkpoint"),
                (asynchronous, _) => asynchronous,
            },
            save_checkpoint: o.save_checkpoint,
            checkpoint_every: match o.checkpoint_every {
                Some(0) => bail!("--checkpoint-every must be positive"),
                every => every,
            },
            keep_checkpoints: match o.keep_checkpoints {
                Some(0) => bail!("--keep-checkpoints must be at least 1 (the checkpoint just saved)"),
                k => k.unwrap_or(2),
            },
            restart_data: match (o.restart_data.unwrap_or(false), &resume) {
                (true, None) => bail!("--restart-data restarts a resumed run's data: give --resume"),
                (restart, _) => restart,
            },
            resume,
            comm_backend: o.comm_backend,
            comm_timeout: match o.comm_timeout {
                Some(t) => seconds("--comm-timeout", t, true)?,
                None => std::time::Duration::from_secs(300),
            },
        })
    }
}

/// A flag's seconds as a duration: finite, positive (or zero where `positive` is false),
/// and at most a year, so that a deadline counted from now cannot overflow.
pub fn seconds(flag: &str, t: f64, positive: bool) -> Result<std::time::Duration> {
    const YEAR: f64 = 365.0 * 24.0 * 3600.0;
    let least = if positive { "a positive" } else { "a" };
    if !(t.is_finite() && (t > 0.0 || !positive && t == 0.0)) {
        bail!("{flag} must be {least} number of seconds, got {t}");
    }
    if t > YEAR {
        bail!("{flag} {t} is more seconds than a run can wait (at most a year, {YEAR})");
    }
    Ok(std::time::Duration::from_secs_f64(t))
}

/// The variables `--chat-template-kwargs` gives every chat-template rendering: a JSON object.
pub fn template_arguments(text: Option<&str>) -> Result<serde_json::Map<String, serde_json::Value>> {
    match text.map(serde_json::from_str::<serde_json::Value>) {
        None => Ok(serde_json::Map::new()),
        Some(Ok(serde_json::Value::Object(arguments))) => Ok(arguments),
        Some(Ok(other)) => bail!("--chat-template-kwargs must be a JSON object, not {other}"),
        Some(Err(e)) => bail!("--chat-template-kwargs is not JSON: {e}"),
    }
}
