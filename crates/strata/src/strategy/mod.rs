//! Strategies: ordered lists of optimization methods, each a name or a (name, config)
//! pair, written as readable JSON in the list form of ATorch's `auto_accelerate`, e.g.
//! `[["fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}]]` or `["zero2"]`.
//!
//! Owns: the typed configuration of every method, with its defaults, parsing from JSON
//! text or values, validation (errors name the bad method or field and list what is
//! allowed) and serialisation back to the same form. Must not execute anything: the
//! `parallel` module turns a validated strategy into an engine.
mod lora;
mod offload;
mod parallel_mode;
mod shard;

pub(crate) use lora::{parameters_alone, stacked_factor};
pub use lora::{LoraConfig, Patterns, Targets};
pub use offload::{OffloadConfig, OffloadPolicy, OffloadTarget};
pub use parallel_mode::{Dim, ParallelMode};
pub use shard::{BackwardPrefetch, MixedPrecision, ShardConfig, ShardMethod, ShardingStrategy, Stage, Wrap};

use crate::compute::fp8::Fp8Config;
use crate::compute::replace::Replacements;
use crate::compute::scaler::GradScaling;
use crate::compute::scaler::{LossScaler, LossScalerConfig};
use crate::model::ModelSpec;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::Kind;

/// Method names this version understands.
pub const METHODS: [&str; 19] = [
    "parallel_mode",
    "amp_native",
    "half",
    "fp8",
    "checkpoint",
    "module_replace",
    "chunked_loss",
    "zero1",
    "zero2",
    "fsdp",
    "tensor_parallel",
    "pipeline_parallel",
    "mixed_parallel",
    "ds_3d_parallel",
    "expert_parallel",
    "context_parallel",
    "offload",
    "activation_offload",
    "lora",
];

/// A validated strategy: its methods in the order given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Strategy {
    /// The methods, in the order given.
    pub methods: Vec<Method>,
}

/// One optimization method with its configuration.
#[derive(Clone, Debug, PartialEq)]
pub enum Method {
    /// Data parallelism over every rank (the default when nothing else is chosen).
    ParallelMode(ParallelMode),
    /// Mixed precision: fp32 parameters, matrix products in a lower precision.
    AmpNative(AmpConfig),
    /// The whole model in a lower precision.
    Half(HalfConfig),
    /// FP8 matrix products in linear layers, with their scaling.
    Fp8(Fp8Config),
    /// Activation recomputation of the units named (kinds or names).
    Checkpoint(CheckpointConfig),
    /// Replacement pairs to apply (those applied by default when `None`).
    ModuleReplace(Option<Vec<String>>),
    /// The next-token loss computed in the output head, a chunk of positions at a time.
    ChunkedLoss(ChunkedLossConfig),
    /// ZeRO-1: optimizer states sharded.
    Zero1(ShardConfig),
    /// ZeRO-2: optimizer states and gradients sharded.
    Zero2(ShardConfig),
    /// FSDP: parameters sharded too, as its `sharding_strategy` says.
    Fsdp(ShardConfig),
    /// Units split Megatron-style over parallel_mode's tensor groups.
    TensorParallel(TensorParallelConfig),
    /// Contiguous unit ranges on parallel_mode's pipeline stages, run by a schedule.
    PipelineParallel(PipelineConfig),
    /// Tensor, pipeline and data parallelism together, at parallel_mode's sizes.
    MixedParallel(MixedConfig),
    /// A mixture of experts' experts split over groups of data-parallel ranks, tokens sent
    /// to their experts' ranks by all-to-all.
    ExpertParallel(ExpertParallelConfig),
    /// Each row's positions split over groups of ranks, attention exchanging keys and
    /// values (ring) or heads (all-to-all) between them.
    ContextParallel(ContextParallelConfig),
    /// As `mixed_parallel`, with ranks laid out in DeepSpeed's order: tensor fastest, then
    /// data, then pipeline, whatever order parallel_mode lists them in.
    Ds3dParallel(MixedConfig),
    /// Model states in host memory besides the device, placed by a plan.
    Offload(OffloadConfig),
    /// The values units keep for their backward in host memory between their forward and
    /// their backward.
    ActivationOffload(ActivationOffloadConfig),
    /// Low-rank adapters on the named linear layers; everything else frozen.
    Lora(LoraConfig),
}

/// `mixed_parallel`'s and `ds_3d_parallel`'s configuration: the pipeline's and tensor
/// parallelism's, together.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MixedConfig {
    /// The pipeline's schedule (default 1F1B).
    pub schedule: ScheduleKind,
    /// Chunks per rank (the interleaved schedule's; 1 otherwise).
    pub virtual_stages: usize,
    /// The stages' unit ranges `[start, end)` by hand; `None`: balanced as `balance` says.
    pub stages: Option<Vec<(usize, usize)>>,
    /// How stages are balanced where no split is given (default: measured).
    pub balance: Balance,
    /// Split the activations between split regions along the sequence as well (Megatron's
    /// sequence parallel).
    pub sequence_parallel: bool,
}

impl Default for MixedConfig {
    fn default() -> Self {
        let p = PipelineConfig::default();
        MixedConfig {
            schedule: p.schedule,
            virtual_stages: p.virtual_stages,
            stages: p.stages,
            balance: p.balance,
            sequence_parallel: false,
        }
    }
}

/// How stages are balanced where no split is given by hand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// From each unit's forward and backward seconds, measured on the run's first step
    /// before training, within the device budget (`--device-memory`) per rank.
    #[default]
    Measured,
    /// From each unit's parameter count.
    Parameters,
}

/// Which schedule runs the micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Every forward, then every backward (GPipe).
    Gpipe,
    /// One forward, one backward once the pipeline is full (PipeDream-Flush, Megatron's
    /// default): a stage holds at most as many micro-batches as stages after it, plus one.
    #[serde(rename = "1f1b")]
    OneForwardOneBackward,
    /// 1F1B over several chunks per rank (Megatron's interleaved schedule): a smaller bubble
    /// for more communication.
    Interleaved,
    /// Zero-bubble ZB-H1: backward split into the input gradient, which the previous stage
    /// waits for, and the weight gradient, which fills what would be bubbles; stage r holds
    /// at most 1F1B's p − r micro-batches.
    ZeroBubble,
    /// Zero-bubble ZB-H2: as ZB-H1, with stage r holding up to 2(p − r) − 1 micro-batches,
    /// so that extra warm-up forwards fill what a weight gradient cheaper than an input
    /// gradient leaves idle.
    #[serde(rename = "zero_bubble_h2")]
    ZeroBubbleH2,
}

impl ScheduleKind {
    /// Whether the schedule splits each backward into an input gradient and a weight
    /// gradient computed later.
    pub fn splits_backward(self) -> bool {
        matches!(self, ScheduleKind::ZeroBubble | ScheduleKind::ZeroBubbleH2)
    }
}

/// `pipeline_parallel`'s configuration; the number of stages is parallel_mode's
/// `("pipeline", p)`, the micro-batches per step the run's gradient accumulation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineConfig {
    /// The schedule that runs the micro-batches (default 1F1B).
    pub schedule: ScheduleKind,
    /// Chunks per rank (the interleaved schedule's; 1 otherwise).
    pub virtual_stages: usize,
    /// The stages' unit ranges `[start, end)` by hand; `None`: balanced as `balance` says.
    pub stages: Option<Vec<(usize, usize)>>,
    /// How stages are balanced where no split is given (default: measured).
    pub balance: Balance,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            schedule: ScheduleKind::OneForwardOneBackward,
            virtual_stages: 1,
            stages: None,
            balance: Balance::Measured,
        }
    }
}

/// `expert_parallel`'s configuration: the size of the expert groups, here or as
/// parallel_mode's `("expert", k)`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExpertParallelConfig {
    /// Ranks per expert group (`None`: parallel_mode's `("expert", k)`).
    pub size: Option<usize>,
}

/// `context_parallel`'s configuration: the size of the context groups, here or as
/// parallel_mode's `("context", k)`, and how their attention exchanges its inputs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContextParallelConfig {
    /// Ranks per context group (`None`: parallel_mode's `("context", k)`).
    pub size: Option<usize>,
    /// How attention reaches the positions other ranks hold.
    pub kind: ContextKind,
}

/// How context parallelism's attention reaches the positions other ranks hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextKind {
    /// Keys and values pass around the ring of ranks, each block's partial attention merged
    /// through its log-sum-exp; each rank holds an early and a late piece of every row, so
    /// that causal attention costs every rank the same.
    #[default]
    Ring,
    /// An all-to-all turns each rank's positions of every head into every position of its
    /// share of the heads, and back after attention (DeepSpeed-Ulysses); the heads (after
    /// tensor parallelism's split) must divide over the group.
    AllToAll,
}

/// `tensor_parallel`'s configuration; the tensor size is parallel_mode's `("tensor", k)`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TensorParallelConfig {
    /// Split the activations between split regions (norms, residuals, dropout) along the
    /// sequence as well (Megatron's sequence parallel).
    pub sequence_parallel: bool,
}

/// `amp_native`'s configuration: the compute dtype, the loss scaler (fp16 defaults to a
/// dynamic one, bf16 to none) and whether non-finite gradients skip the step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AmpConfig {
    /// The compute dtype: `"fp16"` (default) or `"bf16"`.
    pub dtype: String,
    /// Default: true with a dynamic loss scale, false otherwise.
    pub skip_if_nonfinite: Option<bool>,
    /// The loss scaler (`None`: a dynamic one for fp16, none for bf16).
    pub loss_scaler: Option<LossScalerConfig>,
}

impl Default for AmpConfig {
    fn default() -> Self {
        AmpConfig { dtype: "fp16".into(), skip_if_nonfinite: None, loss_scaler: None }
    }
}

impl AmpConfig {
    /// The compute dtype; fp32 is an error.
    pub fn kind(&self) -> Result<Kind> {
        match parse_dtype(&self.dtype)? {
            Kind::Float => Err(Error::Config("amp_native: dtype must be fp16 or bf16".into())),
            k => Ok(k),
        }
    }

    /// The loss scaling this configuration asks for.
    pub fn grad_scaling(&self) -> Result<GradScaling> {
        let scaler = match (&self.loss_scaler, self.kind()?) {
            (Some(c), _) => Some(LossScaler::new(c.clone())?),
            (None, Kind::Half) => Some(LossScaler::new(LossScalerConfig::default())?),
            (None, _) => None,
        };
        let dynamic = scaler.as_ref().is_some_and(LossScaler::is_dynamic);
        Ok(GradScaling { scaler, skip_if_nonfinite: self.skip_if_nonfinite.unwrap_or(dynamic) })
    }
}

/// `half`: `"fp16"` (default) or `"bf16"`, or `{"dtype": ...}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HalfConfig {
    /// `"fp16"` (default) or `"bf16"`.
    pub dtype: String,
}

impl Default for HalfConfig {
    fn default() -> Self {
        HalfConfig { dtype: "fp16".into() }
    }
}

/// `checkpoint`: a list of unit kinds or names, or `{"wrap_class": [...]}`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Unit kinds or names whose forwards are recomputed in backward.
    pub wrap_class: Vec<String>,
}

/// `activation_offload`: `{"wrap_class": [...], "min_bytes": 1024, "pin_memory": true}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActivationOffloadConfig {
    /// Unit kinds or names whose kept values go to the host (empty: every unit).
    pub wrap_class: Vec<String>,
    /// Values whose storage is smaller than this many bytes stay where they are: their
    /// copies would cost more than they free.
    pub min_bytes: u64,
    /// Host copies in page-locked memory where the device is a GPU (copies overlap compute).
    pub pin_memory: bool,
}

impl Default for ActivationOffloadConfig {
    fn default() -> Self {
        ActivationOffloadConfig { wrap_class: vec![], min_bytes: 1024, pin_memory: true }
    }
}

/// `chunked_loss`: the output head computes the next-token loss itself, `positions`
/// positions' logits at a time, so that the `[tokens, vocabulary]` logits and their
/// gradient never exist at once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChunkedLossConfig {
    /// Positions whose logits exist at once (default 1024).
    pub positions: i64,
}

impl Default for ChunkedLossConfig {
    fn default() -> Self {
        ChunkedLossConfig { positions: 1024 }
    }
}

/// Marks the units named by `list` (kind or name); a name matching no unit is an error
/// naming `field` and listing the model's unit kinds.
pub fn select_units(spec: &ModelSpec, list: &[String], field: &str) -> Result<Vec<bool>> {
    if let Some(unknown) = list.iter().find(|c| !spec.units.iter().any(|u| u.kind() == *c || u.name == **c)) {
        let mut kinds: Vec<&str> = spec.units.iter().map(|u| u.kind()).collect();
        kinds.dedup();
        return Err(Error::Config(format!(
            "{field}: {unknown:?} names no unit of this model; its unit kinds are {}",
            kinds.join(", ")
        )));
    }
    Ok(spec.units.iter().map(|u| list.iter().any(|c| c == u.kind() || c == &u.name)).collect())
}

/// Parses a dtype name as strategies write it.
pub fn parse_dtype(name: &str) -> Result<Kind> {
    match name.to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        "fp16" | "float16" | "half" => Ok(Kind::Half),
        "fp32" | "float32" | "float" => Ok(Kind::Float),
        other => Err(Error::Config(format!("unknown dtype {other:?}; allowed: bf16, fp16, fp32"))),
    }
}

/// A group size a method gives must be positive.
fn positive_size(name: &str, size: Option<usize>) -> Result<()> {
    match size {
        Some(0) => Err(Error::Config(format!("{name}: size must be positive"))),
        _ => Ok(()),
    }
}

/// A method's configuration from JSON (its defaults when absent).
fn parse_config<T: serde::de::DeserializeOwned + Default>(name: &str, config: Option<&Value>) -> Result<T> {
    match config {
        None | Some(Value::Null) => Ok(T::default()),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| Error::Config(format!("{name}: {e}"))),
    }
}

impl Method {
    /// The method's name in a strategy.
    pub fn name(&self) -> &'static str {
        match self {
            Method::ParallelMode(_) => "parallel_mode",
            Method::AmpNative(_) => "amp_native",
            Method::Half(_) => "half",
            Method::Fp8(_) => "fp8",
            Method::Checkpoint(_) => "checkpoint",
            Method::ModuleReplace(_) => "module_replace",
            Method::ChunkedLoss(_) => "chunked_loss",
            Method::Zero1(_) => "zero1",
            Method::Zero2(_) => "zero2",
            Method::Fsdp(_) => "fsdp",
            Method::TensorParallel(_) => "tensor_parallel",
            Method::PipelineParallel(_) => "pipeline_parallel",
            Method::MixedParallel(_) => "mixed_parallel",
            Method::Ds3dParallel(_) => "ds_3d_parallel",
            Method::ExpertParallel(_) => "expert_parallel",
            Method::ContextParallel(_) => "context_parallel",
            Method::Offload(_) => "offload",
            Method::ActivationOffload(_) => "activation_offload",
            Method::Lora(_) => "lora",
        }
    }

    fn parse(name: &str, config: Option<&Value>) -> Result<Method> {
        let shard = || -> Result<ShardConfig> {
            let c: ShardConfig = parse_config(name, config)?;
            c.validate(name)?;
            Ok(c)
        };
        Ok(match name {
            "parallel_mode" => {
                let mode: ParallelMode = match config {
                    None | Some(Value::Null) => ParallelMode::default(),
                    Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
                        Error::Config(format!(
                            "parallel_mode: {e}; expected [[[\"data\", size], ...], rank_order or null]"
                        ))
                    })?,
                };
                mode.validate()?;
                Method::ParallelMode(mode)
            }
            "amp_native" => {
                let c: AmpConfig = match config {
                    Some(Value::String(dtype)) => AmpConfig { dtype: dtype.clone(), ..Default::default() },
                    other => parse_config(name, other)?,
                };
                c.grad_scaling()?;
                Method::AmpNative(c)
            }
            "half" => {
                let c = match config {
                    Some(Value::String(d)) => HalfConfig { dtype: d.clone() },
                    other => parse_config(name, other)?,
                };
                if parse_dtype(&c.dtype)? == Kind::Float {
                    return Err(Error::Config("half: dtype must be fp16 or bf16".into()));
                }
                Method::Half(c)
            }
            "fp8" => {
                let c: Fp8Config = parse_config(name, config)?;
                c.validate()?;
                Method::Fp8(c)
            }
            "checkpoint" => {
                let c = match config {
                    Some(Value::Array(_)) => CheckpointConfig { wrap_class: parse_config(name, config)? },
                    Some(Value::Object(_)) => parse_config(name, config)?,
                    _ => {
                        return Err(Error::Config(
                            "checkpoint: give the units to recompute, e.g. [\"checkpoint\", [\"GptBlock\"]]".into(),
                        ))
                    }
                };
                if c.wrap_class.is_empty() {
                    return Err(Error::Config("checkpoint: the list of units is empty".into()));
                }
                Method::Checkpoint(c)
            }
            "module_replace" => {
                let names: Option<Vec<String>> = match config {
                    None | Some(Value::Null) => None,
                    Some(v) => Some(parse_config(name, Some(v))?),
                };
                Replacements::select(names.as_deref())?;
                Method::ModuleReplace(names)
            }
            "chunked_loss" => {
                let c: ChunkedLossConfig = parse_config(name, config)?;
                if c.positions < 1 {
                    return Err(Error::Config(format!(
                        "chunked_loss: positions must be positive, got {}",
                        c.positions
                    )));
                }
                Method::ChunkedLoss(c)
            }
            "zero1" => Method::Zero1(shard()?),
            "zero2" => Method::Zero2(shard()?),
            "fsdp" => Method::Fsdp(shard()?),
            "tensor_parallel" => Method::TensorParallel(parse_config(name, config)?),
            "pipeline_parallel" => Method::PipelineParallel(parse_config(name, config)?),
            "mixed_parallel" => Method::MixedParallel(parse_config(name, config)?),
            "ds_3d_parallel" => Method::Ds3dParallel(parse_config(name, config)?),
            "expert_parallel" => {
                let c: ExpertParallelConfig = parse_config(name, config)?;
                positive_size(name, c.size)?;
                Method::ExpertParallel(c)
            }
            "context_parallel" => {
                let c: ContextParallelConfig = parse_config(name, config)?;
                positive_size(name, c.size)?;
                Method::ContextParallel(c)
            }
            "offload" => {
                let c: OffloadConfig = parse_config(name, config)?;
                c.home_policy()?;
                Method::Offload(c)
            }
            "activation_offload" => Method::ActivationOffload(parse_config(name, config)?),
            "lora" => Method::Lora(LoraConfig::from_value(config)?),
            other => return Err(Error::Config(format!("unknown method {other:?}; allowed: {}", METHODS.join(", ")))),
        })
    }

    /// The sharding method and its configuration, if this is one.
    pub fn shard_config(&self) -> Option<(ShardMethod, &ShardConfig)> {
        match self {
            Method::Zero1(c) => Some((ShardMethod::Zero1, c)),
            Method::Zero2(c) => Some((ShardMethod::Zero2, c)),
            Method::Fsdp(c) => Some((ShardMethod::Fsdp, c)),
            _ => None,
        }
    }

    fn to_value(&self) -> Value {
        let config = match self {
            Method::ParallelMode(m) => serde_json::to_value(m),
            Method::AmpNative(c) => serde_json::to_value(c),
            Method::Half(c) => serde_json::to_value(c),
            Method::Fp8(c) => serde_json::to_value(c),
            Method::Checkpoint(c) => serde_json::to_value(c),
            Method::ModuleReplace(c) => serde_json::to_value(c),
            Method::ChunkedLoss(c) => serde_json::to_value(c),
            Method::Zero1(c) | Method::Zero2(c) | Method::Fsdp(c) => serde_json::to_value(c),
            Method::TensorParallel(c) => serde_json::to_value(c),
            Method::PipelineParallel(c) => serde_json::to_value(c),
            Method::MixedParallel(c) | Method::Ds3dParallel(c) => serde_json::to_value(c),
            Method::ExpertParallel(c) => serde_json::to_value(c),
            Method::ContextParallel(c) => serde_json::to_value(c),
            Method::Offload(c) => serde_json::to_value(c),
            Method::ActivationOffload(c) => serde_json::to_value(c),
            Method::Lora(c) => serde_json::to_value(c),
        };
        Value::Array(vec![Value::String(self.name().into()), config.unwrap_or(Value::Null)])
    }
}

/// Where a strategy comes from (`load_strategy`): JSON text, its bytes, a file holding it,
/// the list form as a JSON value, or a strategy already made.
#[derive(Clone, Debug)]
pub enum StrategySource {
    /// JSON text in list form.
    Text(String),
    /// UTF-8 JSON bytes.
    Bytes(Vec<u8>),
    /// A JSON file in list form.
    File(std::path::PathBuf),
    /// The list form as a JSON value.
    List(Value),
    /// A strategy already made (validated again on loading).
    Strategy(Strategy),
}

impl StrategySource {
    /// The strategy, parsed and validated.
    pub fn load(&self) -> Result<Strategy> {
        match self {
            StrategySource::Text(t) => Strategy::parse(t),
            StrategySource::Bytes(b) => Strategy::from_bytes(b),
            StrategySource::File(p) => Strategy::from_file(p),
            StrategySource::List(v) => Strategy::from_value(v),
            StrategySource::Strategy(s) => Strategy::from_value(&s.to_value()),
        }
    }
}

impl From<Strategy> for StrategySource {
    fn from(s: Strategy) -> Self {
        StrategySource::Strategy(s)
    }
}

impl std::str::FromStr for Strategy {
    type Err = Error;
    fn from_str(text: &str) -> Result<Strategy> {
        Strategy::parse(text)
    }
}

impl Strategy {
    /// Parses UTF-8 JSON bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Strategy> {
        let text =
            std::str::from_utf8(bytes).map_err(|e| Error::Config(format!("a strategy must be UTF-8 JSON: {e}")))?;
        Strategy::parse(text)
    }

    /// Reads a strategy file (JSON in list form); errors name the file.
    pub fn from_file(path: &std::path::Path) -> Result<Strategy> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Strategy::from_bytes(&bytes).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Writes the strategy as readable JSON, every config with its defaults (atomically).
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        crate::files::write_atomic(path, self.to_json().as_bytes())
    }

    /// The list form as pretty JSON text.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(&self.to_value()).unwrap_or_else(|_| "[]".into())
    }

    /// Parses the list form from JSON text.
    pub fn parse(text: &str) -> Result<Strategy> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| Error::Config(format!("a strategy must be JSON: {e}")))?;
        Strategy::from_value(&value)
    }

    /// Parses the list form: each item is `"name"` or `["name", config]`.
    pub fn from_value(value: &Value) -> Result<Strategy> {
        let items = value
            .as_array()
            .ok_or_else(|| Error::Config("a strategy is a JSON list of methods, e.g. [\"zero2\"]".into()))?;
        let mut methods = Vec::new();
        for item in items {
            let method = match item {
                Value::String(name) => Method::parse(name, None)?,
                Value::Array(pair) if (1..=2).contains(&pair.len()) && pair[0].is_string() => {
                    Method::parse(pair[0].as_str().unwrap_or_default(), pair.get(1))?
                }
                other => {
                    return Err(Error::Config(format!(
                        "strategy item {other} is neither a method name nor a [name, config] pair"
                    )))
                }
            };
            if methods.iter().any(|m: &Method| m.name() == method.name()) {
                return Err(Error::Config(format!("method {} appears twice", method.name())));
            }
            methods.push(method);
        }
        let sharding: Vec<&str> = methods.iter().filter(|m| m.shard_config().is_some()).map(Method::name).collect();
        if sharding.len() > 1 {
            return Err(Error::Config(format!(
                "{} cannot be combined: choose one of zero1, zero2, fsdp",
                sharding.join(" and ")
            )));
        }
        let layouts: Vec<&str> = methods
            .iter()
            .filter(|m| {
                matches!(
                    m,
                    Method::TensorParallel(_)
                        | Method::PipelineParallel(_)
                        | Method::MixedParallel(_)
                        | Method::Ds3dParallel(_)
                )
            })
            .map(Method::name)
            .collect();
        let mixed = layouts.iter().any(|n| *n == "mixed_parallel" || *n == "ds_3d_parallel");
        if mixed && layouts.len() > 1 {
            return Err(Error::Config(format!(
                "{} cannot be combined: mixed_parallel and ds_3d_parallel already run tensor and pipeline parallelism",
                layouts.join(" and ")
            )));
        }
        let strategy = Strategy { methods };
        let named = |dim: Dim| strategy.parallel_mode().0.iter().any(|(n, _)| *n == dim);
        if layouts.contains(&"pipeline_parallel") && !named(Dim::Pipeline) {
            return Err(Error::Config(
                "pipeline_parallel: give the number of stages in parallel_mode, e.g. [\"parallel_mode\", [[[\"pipeline\", 2]], null]]"
                    .into(),
            ));
        }
        let expert = strategy.expert_parallel().map(|c| c.size);
        strategy.check_sized_dimension("expert_parallel", Dim::Expert, expert, "expert group")?;
        let context = strategy.context_parallel().map(|c| c.size);
        strategy.check_sized_dimension("context_parallel", Dim::Context, context, "context group")?;
        if layouts.contains(&"tensor_parallel") && !named(Dim::Tensor) {
            return Err(Error::Config(
                "tensor_parallel: give the tensor size in parallel_mode, e.g. [\"parallel_mode\", [[[\"tensor\", 2]], null]]"
                    .into(),
            ));
        }
        if strategy.half().is_some() {
            if strategy.amp().is_some() {
                return Err(Error::Config(
                    "half and amp_native cannot be combined: half stores the whole model in low precision, amp_native keeps fp32 parameters; choose one".into(),
                ));
            }
            if strategy.sharding().is_some_and(|(_, c)| c.mixed_precision.is_some()) {
                return Err(Error::Config(
                    "half and a mixed_precision policy cannot be combined: half already sets every dtype".into(),
                ));
            }
        }
        Ok(strategy)
    }

    /// The list form, every config written out with its defaults.
    pub fn to_value(&self) -> Value {
        Value::Array(self.methods.iter().map(Method::to_value).collect())
    }

    /// `amp_native`'s configuration, if the strategy has it.
    pub fn amp(&self) -> Option<&AmpConfig> {
        self.methods.iter().find_map(|m| if let Method::AmpNative(c) = m { Some(c) } else { None })
    }

    /// `half`'s dtype, if the strategy has it.
    pub fn half(&self) -> Option<Kind> {
        self.methods.iter().find_map(|m| if let Method::Half(c) = m { parse_dtype(&c.dtype).ok() } else { None })
    }

    /// `fp8`'s configuration, if the strategy has it.
    pub fn fp8(&self) -> Option<&Fp8Config> {
        self.methods.iter().find_map(|m| if let Method::Fp8(c) = m { Some(c) } else { None })
    }

    /// `activation_offload`'s configuration, if the strategy has it.
    pub fn activation_offload(&self) -> Option<&ActivationOffloadConfig> {
        self.methods.iter().find_map(|m| if let Method::ActivationOffload(c) = m { Some(c) } else { None })
    }

    /// `checkpoint`'s configuration, if the strategy has it.
    pub fn checkpoint(&self) -> Option<&CheckpointConfig> {
        self.methods.iter().find_map(|m| if let Method::Checkpoint(c) = m { Some(c) } else { None })
    }

    /// `chunked_loss`'s configuration, if the strategy has it.
    pub fn chunked_loss(&self) -> Option<&ChunkedLossConfig> {
        self.methods.iter().find_map(|m| if let Method::ChunkedLoss(c) = m { Some(c) } else { None })
    }

    /// `module_replace`'s pair names: `Some(None)` for the pairs applied by default.
    pub fn module_replace(&self) -> Option<Option<&[String]>> {
        self.methods.iter().find_map(|m| if let Method::ModuleReplace(c) = m { Some(c.as_deref()) } else { None })
    }

    /// The loss scaling `amp_native` asks for (none without it).
    pub fn grad_scaling(&self) -> Result<GradScaling> {
        self.amp().map(AmpConfig::grad_scaling).transpose().map(Option::unwrap_or_default)
    }

    /// The rank layout (data parallel over every rank when not given).
    pub fn parallel_mode(&self) -> ParallelMode {
        let mut mode = self
            .methods
            .iter()
            .find_map(|m| if let Method::ParallelMode(p) = m { Some(p.clone()) } else { None })
            .unwrap_or_default();
        if self.methods.iter().any(|m| matches!(m, Method::Ds3dParallel(_))) {
            // DeepSpeed's topology: tensor ranks adjacent, then data, then pipeline.
            if !mode.0.iter().any(|(n, _)| *n == Dim::Data) {
                mode.0.push((Dim::Data, 0));
            }
            let order = |n: Dim| [Dim::Tensor, Dim::Zero, Dim::Data, Dim::Pipeline].iter().position(|d| *d == n);
            mode.0.sort_by_key(|(n, _)| order(*n));
        }
        // expert_parallel's and context_parallel's sizes, where parallel_mode does not give
        // them: groups of adjacent ranks (context innermost), carved out of the data ranks.
        let sized = [
            (Dim::Expert, self.expert_parallel().and_then(|c| c.size)),
            (Dim::Context, self.context_parallel().and_then(|c| c.size)),
        ];
        for (dim, size) in sized {
            if let Some(size) = size.filter(|_| !mode.0.iter().any(|(n, _)| *n == dim)) {
                mode.0.insert(0, (dim, size));
            }
        }
        mode
    }

    /// A method's dimension `dim` is sized once, by the method (`method`'s size, `None`
    /// where the strategy lacks the method) or by parallel_mode, and named only with it.
    fn check_sized_dimension(&self, name: &str, dim: Dim, method: Option<Option<usize>>, group: &str) -> Result<()> {
        let given = self.methods.iter().find_map(|m| match m {
            Method::ParallelMode(p) => p.0.iter().find(|(n, _)| *n == dim).map(|(_, s)| *s),
            _ => None,
        });
        match (method, given) {
            (None, Some(_)) => {
                Err(Error::Config(format!("parallel_mode: the {dim} dimension needs the {name} method")))
            }
            (Some(None), None) => Err(Error::Config(format!(
                "{name}: give the {group} size, as its size or as parallel_mode's (\"{dim}\", k)"
            ))),
            (Some(Some(a)), Some(b)) if a != b => Err(Error::Config(format!(
                "{name}: size {a} differs from parallel_mode's {dim} size {b}; give it once"
            ))),
            _ => Ok(()),
        }
    }

    /// `context_parallel`'s configuration, if rows' positions are split over ranks.
    pub fn context_parallel(&self) -> Option<ContextParallelConfig> {
        self.methods.iter().find_map(|m| match m {
            Method::ContextParallel(c) => Some(c.clone()),
            _ => None,
        })
    }

    /// `expert_parallel`'s configuration, if experts are split over ranks.
    pub fn expert_parallel(&self) -> Option<ExpertParallelConfig> {
        self.methods.iter().find_map(|m| match m {
            Method::ExpertParallel(c) => Some(c.clone()),
            _ => None,
        })
    }

    /// The pipeline's configuration: `pipeline_parallel`'s, or that of `mixed_parallel` or
    /// `ds_3d_parallel`.
    pub fn pipeline_parallel(&self) -> Option<PipelineConfig> {
        self.methods.iter().find_map(|m| match m {
            Method::PipelineParallel(c) => Some(c.clone()),
            Method::MixedParallel(c) | Method::Ds3dParallel(c) => Some(PipelineConfig {
                schedule: c.schedule,
                virtual_stages: c.virtual_stages,
                stages: c.stages.clone(),
                balance: c.balance,
            }),
            _ => None,
        })
    }

    /// Tensor parallelism's configuration: `tensor_parallel`'s, or that of `mixed_parallel`
    /// or `ds_3d_parallel`.
    pub fn tensor_parallel(&self) -> Option<TensorParallelConfig> {
        self.methods.iter().find_map(|m| match m {
            Method::TensorParallel(c) => Some(c.clone()),
            Method::MixedParallel(c) | Method::Ds3dParallel(c) => {
                Some(TensorParallelConfig { sequence_parallel: c.sequence_parallel })
            }
            _ => None,
        })
    }

    /// `lora`'s configuration, if the strategy trains adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.methods.iter().find_map(|m| match m {
            Method::Lora(c) => Some(c),
            _ => None,
        })
    }

    /// `offload`'s configuration, if any.
    pub fn offload(&self) -> Option<&OffloadConfig> {
        self.methods.iter().find_map(|m| match m {
            Method::Offload(c) => Some(c),
            _ => None,
        })
    }

    /// `offload` placed unit by unit by a plan in one process (without a ZeRO stage, beside
    /// which it places whole units' shard states instead).
    pub fn offload_plan(&self) -> Option<&OffloadConfig> {
        self.offload().filter(|_| self.sharding().is_none())
    }

    /// The sharding method the strategy resolves to, with its configuration.
    pub fn sharding(&self) -> Option<(ShardMethod, &ShardConfig)> {
        self.methods.iter().find_map(Method::shard_config)
    }

    /// The strategy for one pipeline stage (`stage`, a part of `whole`): the units
    /// `checkpoint` recomputes and the sharding method ignores are checked against the
    /// whole model, and keep only the kinds and names the stage has (an empty list selects
    /// none of its units).
    pub fn for_stage(&self, whole: &ModelSpec, stage: &ModelSpec) -> Result<Strategy> {
        let mut out = self.clone();
        let keep = |list: &mut Vec<String>, field: &str| -> Result<()> {
            select_units(whole, list, field)?;
            list.retain(|name| stage.units.iter().any(|u| u.kind() == name || u.name == *name));
            Ok(())
        };
        for m in &mut out.methods {
            match m {
                Method::Checkpoint(c) => keep(&mut c.wrap_class, "checkpoint")?,
                Method::ActivationOffload(c) if !c.wrap_class.is_empty() => {
                    keep(&mut c.wrap_class, "activation_offload")?
                }
                Method::Zero1(c) | Method::Zero2(c) | Method::Fsdp(c) => {
                    keep(&mut c.atorch_ignored_cls, "atorch_ignored_cls")?;
                    if !c.atorch_wrap_cls.is_empty() {
                        keep(&mut c.atorch_wrap_cls, "atorch_wrap_cls")?;
                        // A stage holding none of the named units wraps none of its own on
                        // its own, as the whole model would; an empty list would wrap every
                        // unit, so the stage says it as a size no unit reaches.
                        if c.atorch_wrap_cls.is_empty() {
                            c.atorch_size_based_min_num_params = Some(u64::MAX);
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// This strategy with the units named `units` kept whole by its sharding method (added to
    /// `atorch_ignored_cls`): replicated, their gradients all-reduced whole.
    pub fn with_ignored_units(&self, units: &[String]) -> Strategy {
        let mut out = self.clone();
        for m in &mut out.methods {
            if let Method::Zero1(c) | Method::Zero2(c) | Method::Fsdp(c) = m {
                for name in units {
                    if !c.atorch_ignored_cls.contains(name) {
                        c.atorch_ignored_cls.push(name.clone());
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stage keeps the units of the lists it has; names are checked against the whole
    /// model, so a stage without blocks is not refused for recomputing or wrapping them, and
    /// each stage wraps its units as the whole model does.
    #[test]
    fn a_stage_s_strategy_keeps_its_own_units_of_the_lists() {
        let model = crate::model::ModelConfig::Gpt(crate::model::GptConfig::new(64, 16, 2, 2, 16));
        let whole = model.spec().unwrap();
        let text = r#"[["checkpoint", ["GptBlock"]], ["fsdp", {"atorch_ignored_cls": ["GptHead"]}]]"#;
        let strategy = Strategy::from_value(&serde_json::from_str(text).unwrap()).unwrap();
        let first = model.spec().unwrap().stage(0, 1).unwrap();
        let staged = strategy.for_stage(&whole, &first).unwrap();
        assert!(staged.checkpoint().unwrap().wrap_class.is_empty());
        let (_, fsdp) = staged.sharding().unwrap();
        assert!(fsdp.atorch_ignored_cls.is_empty());
        let blocks = model.spec().unwrap().stage(1, 3).unwrap();
        assert_eq!(strategy.for_stage(&whole, &blocks).unwrap().checkpoint().unwrap().wrap_class, ["GptBlock"]);
        let unknown = Strategy::from_value(&serde_json::json!([["checkpoint", ["Nope"]]])).unwrap();
        assert!(unknown.for_stage(&whole, &first).is_err(), "a name no unit of the model has");
        let wrapped = Strategy::parse(r#"[["fsdp", {"atorch_wrap_cls": ["GptBlock"]}]]"#).unwrap();
        let roles = |strategy: &Strategy, spec: &ModelSpec| strategy.sharding().unwrap().1.wrap(spec).unwrap();
        let mut staged = vec![];
        for (start, end) in [(0, 1), (1, 3), (3, 4)] {
            let stage = model.spec().unwrap().stage(start, end).unwrap();
            staged.extend(roles(&wrapped.for_stage(&whole, &stage).unwrap(), &stage));
        }
        assert_eq!(staged, roles(&wrapped, &whole), "embedding and head at the root, blocks on their own");
        assert_eq!(staged, [Wrap::Root, Wrap::Own, Wrap::Own, Wrap::Root]);
    }

    #[test]
    fn list_forms_parse_and_round_trip() {
        for text in [
            r#"["zero2"]"#,
            r#"[["fsdp", {"sharding_strategy": "SHARD_GRAD_OP", "forward_prefetch": true}]]"#,
            r#"["parallel_mode", ["zero1", {"mixed_precision": {"param_dtype": "bf16"}}]]"#,
            r#"[["parallel_mode", [[["data", 4]], null]], ["fsdp", {"atorch_wrap_cls": ["GptBlock"]}]]"#,
            r#"[["amp_native", {"dtype": "bf16", "skip_if_nonfinite": true}], ["checkpoint", ["GptBlock"]], "module_replace"]"#,
            r#"[["half", "bf16"], ["fp8", {"fp8_format": "E4M3", "amax_compute_algo": "most_recent"}], ["checkpoint", {"wrap_class": ["GptBlock"]}]]"#,
            r#"[["amp_native", {"loss_scaler": {"loss_scale": 1024}}], ["module_replace", ["FlashAttention"]], "zero2"]"#,
            r#"["parallel_mode", ["amp_native", "bf16"]]"#,
            r#"[["parallel_mode", [[["zero", 2], ["data", 2]], null]], "fsdp"]"#,
            r#"[["offload", {"params": "none", "optimizer": "cpu", "policy": "static"}], ["checkpoint", ["GptBlock"]]]"#,
            r#"["offload"]"#,
            "[]",
        ] {
            let s = Strategy::parse(text).unwrap();
            assert_eq!(Strategy::from_value(&s.to_value()).unwrap(), s, "{text}");
        }
        let s =
            Strategy::parse(r#"[["fsdp", {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}]]"#).unwrap();
        let (name, c) = s.sharding().unwrap();
        assert_eq!((name, c.stage(name)), (ShardMethod::Fsdp, (Stage::Parameters, true)));
        assert_eq!(c.backward_prefetch, Some(BackwardPrefetch::Pre), "FSDP's default");
        // fp16 amp scales dynamically and checks; bf16 neither, unless asked.
        let fp16 = Strategy::parse(r#"["amp_native"]"#).unwrap().grad_scaling().unwrap();
        assert!(fp16.scaler.as_ref().is_some_and(|s| s.is_dynamic() && s.scale == 65536.0) && fp16.skip_if_nonfinite);
        let bf16 = Strategy::parse(r#"[["amp_native", {"dtype": "bf16"}]]"#).unwrap().grad_scaling().unwrap();
        assert!(bf16.scaler.is_none() && !bf16.skip_if_nonfinite);
        let checked = r#"[["amp_native", {"dtype": "bf16", "skip_if_nonfinite": true}]]"#;
        assert!(Strategy::parse(checked).unwrap().grad_scaling().unwrap().skip_if_nonfinite);
        assert_eq!(Strategy::parse(r#"["half"]"#).unwrap().half(), Some(Kind::Half));
    }

    #[test]
    fn mixed_layouts_run_tensor_and_pipeline_parallelism_in_their_rank_order() {
        let mode = r#"["parallel_mode", [[["pipeline", 2], ["tensor", 2]], null]]"#;
        let mixed =
            Strategy::parse(&format!(r#"[{mode}, ["mixed_parallel", {{"sequence_parallel": true}}]]"#)).unwrap();
        assert!(mixed.tensor_parallel().is_some_and(|t| t.sequence_parallel));
        assert_eq!(mixed.pipeline_parallel(), Some(PipelineConfig::default()));
        // mixed_parallel keeps parallel_mode's order; ds_3d_parallel lays ranks out as
        // DeepSpeed does: tensor, then data, then pipeline.
        let order = |s: &Strategy| s.parallel_mode().0.iter().map(|(n, _)| *n).collect::<Vec<_>>();
        assert_eq!(order(&mixed), [Dim::Pipeline, Dim::Tensor]);
        let ds = Strategy::parse(&format!(r#"[{mode}, "ds_3d_parallel"]"#)).unwrap();
        assert_eq!(order(&ds), [Dim::Tensor, Dim::Data, Dim::Pipeline]);
        let both = Strategy::parse(r#"["mixed_parallel", "pipeline_parallel"]"#).unwrap_err().to_string();
        assert!(both.contains("cannot be combined"), "{both}");
    }

    #[test]
    fn every_source_form_gives_the_same_strategy() {
        let text = r#"["parallel_mode", ["amp_native", "bf16"], ["checkpoint", ["GptBlock"]], "zero2"]"#;
        let s = Strategy::parse(text).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.json");
        s.save(&file).unwrap();
        let value: Value = serde_json::from_str(text).unwrap();
        for source in [
            StrategySource::Text(text.into()),
            StrategySource::Bytes(text.as_bytes().to_vec()),
            StrategySource::File(file.clone()),
            StrategySource::List(value),
            StrategySource::from(s.clone()),
        ] {
            assert_eq!(source.load().unwrap(), s, "{source:?}");
        }
        assert_eq!(s.to_json().parse::<Strategy>().unwrap(), s, "the saved JSON reads back");
        std::fs::write(&file, b"not json").unwrap();
        let err = Strategy::from_file(&file).unwrap_err().to_string();
        assert!(err.contains("s.json") && err.contains("must be JSON"), "{err}");
        assert!(Strategy::from_bytes(&[0xff, 0xfe]).unwrap_err().to_string().contains("UTF-8"));
    }

    #[test]
    fn bad_strategies_name_the_problem_and_what_is_allowed() {
        for (text, expected) in [
            ("zero2", "must be JSON"),
            (r#"{"zero2": {}}"#, "JSON list"),
            (r#"["zero4"]"#, "allowed: parallel_mode, amp_native, half, fp8, checkpoint, module_replace, chunked_loss"),
            (r#"[["chunked_loss", {"positions": 0}]]"#, "positions must be positive"),
            (r#"[["chunked_loss", {"chunk": 8}]]"#, "unknown field `chunk`"),
            (r#"[["fsdp", {"sharding": 1}]]"#, "unknown field `sharding`"),
            (r#"[["fsdp", {"sharding_strategy": "HALF_SHARD"}]]"#, "FULL_SHARD"),
            (r#"[["zero2", {"sharding_strategy": "FULL_SHARD"}]]"#, "belongs to fsdp"),
            (r#"["zero1", "fsdp"]"#, "cannot be combined"),
            (r#"["zero1", "zero1"]"#, "twice"),
            (r#"[["fsdp", {"mixed_precision": {"param_dtype": "int8"}}]]"#, "allowed: bf16, fp16, fp32"),
            (
                r#"[["parallel_mode", [[["sequence", 2]], null]]]"#,
                "unknown variant `sequence`, expected one of `data`, `zero`, `tensor`, `pipeline`",
            ),
            (
                r#"[["parallel_mode", [[["expert", 2]], null]]]"#,
                "the expert dimension needs the expert_parallel method",
            ),
            (r#"["expert_parallel"]"#, "give the expert group size"),
            (r#"["context_parallel"]"#, "give the context group size"),
            (r#"[["context_parallel", {"size": 2, "kind": "tree"}]]"#, "expected `ring` or `all_to_all`"),
            (
                r#"[["parallel_mode", [[["context", 2]], null]]]"#,
                "the context dimension needs the context_parallel method",
            ),
            (r#"[["parallel_mode", [[["expert", 2]], null]], ["expert_parallel", {"size": 4}]]"#, "give it once"),
            (r#"[["fsdp", {"atorch_wrap_cls": ["X"], "atorch_size_based_min_num_params": 5}]]"#, "exclude each other"),
            (r#"["checkpoint"]"#, "give the units to recompute"),
            (r#"[["checkpoint", []]]"#, "list of units is empty"),
            (r#"[["amp_native", {"dtype": "fp32"}]]"#, "fp16 or bf16"),
            (r#"["half", ["fsdp", {"mixed_precision": {"param_dtype": "bf16"}}]]"#, "half and a mixed_precision"),
            (r#"[["fp8", {"interval": 0}]]"#, "interval and amax_history_len must be positive"),
        ] {
            let err = Strategy::parse(text).unwrap_err().to_string();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }
}
