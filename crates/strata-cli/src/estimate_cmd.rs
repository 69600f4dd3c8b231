//! `strata estimate`: will a model fit? Per layout (sharding, recomputation, offload,
//! tensor and pipeline sizes, LoRA), the peak bytes each rank needs on its device and its
//! host, split by what holds them, from the model's configuration alone, and whether they
//! fit the device and host given.
//!
//! Owns the command's flags and its table. Must not compute bytes (`strata::auto::estimate`
//! does) or allocate the model.
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::PathBuf;
use strata::auto::candidate::{Layout, Precision, Sharding};
use strata::auto::estimate::{self, DeviceKind, Estimate, ExpertPlacement, Generation, Machine, Workload};
use strata::model::{GptConfig, LlamaConfig, MlpConfig, ModelConfig, ModelSpec};
use strata::profile::human_bytes;
use strata::strategy::{ContextKind, LoraConfig, ScheduleKind, Targets};

/// The model an estimate or a plan is for: a folder's `config.json`, a preset, or a
/// built-in family with its sizes.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A Hugging Face model folder or its config.json (weights are not read).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// A known model: gpt2, gpt2-medium, gpt2-large, gpt2-xl, tinyllama-1.1b, llama-2-7b,
    /// llama-2-13b, llama-2-70b, llama-3-8b, llama-3-70b, llama-3.1-405b, mixtral-8x7b,
    /// qwen3-30b-a3b, olmoe-1b-7b, deepseek-v3, glm-4.5, glm-4.5-air, qwen3-next-80b-a3b,
    /// gpt-oss-20b, gpt-oss-120b.
    #[arg(long)]
    pub preset: Option<String>,
    /// A built-in family sized by the flags below: gpt, llama or mlp.
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, default_value_t = 12)]
    pub layers: i64,
    #[arg(long, default_value_t = 12)]
    pub heads: i64,
    #[arg(long, default_value_t = 768)]
    pub dim: i64,
    #[arg(long, default_value_t = 50257)]
    pub vocab: i64,
    /// Feed-forward width (llama; default 8/3 of the width, rounded up to 32).
    #[arg(long)]
    pub ffn_dim: Option<i64>,
    /// Key/value heads (llama; default: as many as heads).
    #[arg(long)]
    pub kv_heads: Option<i64>,
    /// Tokens per sequence (default: the model's context, capped at 4096).
    #[arg(long)]
    pub ctx: Option<i64>,
}

impl ModelArgs {
    /// The model and the sequence length to run it at.
    pub fn resolve(&self) -> Result<(ModelConfig, i64)> {
        let given = [self.model_dir.is_some(), self.preset.is_some(), self.model.is_some()];
        if given.iter().filter(|&&g| g).count() != 1 {
            bail!("give exactly one of --model-dir, --preset and --model");
        }
        let config = if let Some(dir) = &self.model_dir {
            strata::model::hf::config_of(dir).context("--model-dir")?
        } else if let Some(name) = &self.preset {
            strata::model::preset(name)?
        } else {
            let ctx = self.ctx.unwrap_or(2048);
            let (l, h, d, v) = (self.layers, self.heads, self.dim, self.vocab);
            match self.model.as_deref().unwrap_or_default() {
                "gpt" => ModelConfig::Gpt(GptConfig::new(v, ctx, l, h, d)),
                "llama" => ModelConfig::Llama(LlamaConfig {
                    ffn_dim: self.ffn_dim,
                    kv_heads: self.kv_heads,
                    ..LlamaConfig::new(v, ctx, l, h, d)
                }),
                "mlp" => ModelConfig::Mlp(MlpConfig { vocab: v, layers: l, dim: d }),
                other => bail!("unknown model {other:?}; expected gpt, llama or mlp"),
            }
        };
        let ctx = match (self.ctx, config.context()) {
            (Some(t), Some(limit)) if t > limit => bail!("--ctx {t} is longer than the model's context of {limit}"),
            (Some(t), _) => t,
            (None, Some(limit)) => limit.min(4096),
            (None, None) => 512,
        };
        if ctx < 1 {
            bail!("--ctx must be positive");
        }
        Ok((config, ctx))
    }
}

/// How the numbers are computed, as the flags name it.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum PrecisionArg {
    Fp32,
    AmpBf16,
    HalfBf16,
    Fp8,
}

impl PrecisionArg {
    pub fn precision(self) -> Precision {
        match self {
            PrecisionArg::Fp32 => Precision::Fp32,
            PrecisionArg::AmpBf16 => Precision::AmpBf16,
            PrecisionArg::HalfBf16 => Precision::HalfBf16,
            PrecisionArg::Fp8 => Precision::Fp8,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct EstimateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Ranks (devices) in all.
    #[arg(long, default_value_t = 1)]
    nproc: usize,
    /// Ranks per node: they share the node's host memory.
    #[arg(long)]
    gpus_per_node: Option<usize>,
    /// The device kind: h100-80gb, h200, a100-80gb, a100-40gb or cpu (this machine).
    #[arg(long, default_value = "h100-80gb")]
    device: String,
    /// Bytes of each device (default: the kind's).
    #[arg(long)]
    device_memory: Option<u64>,
    /// Bytes of host memory per node (default: the device kind's usual server; this
    /// machine's for the cpu).
    #[arg(long)]
    host_memory: Option<u64>,
    /// Rows of one micro-batch per data-parallel group.
    #[arg(long, default_value_t = 1)]
    micro_batch: usize,
    /// Micro-batches per step (gradient accumulation; a pipeline's micro-batches).
    #[arg(long, default_value_t = 1)]
    accumulation: usize,
    /// Precision (default: amp-bf16 on a GPU, fp32 on the CPU).
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
    /// Tensor sizes to show, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    tensor: Vec<usize>,
    /// Pipeline sizes to show, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pipeline: Vec<usize>,
    /// The pipeline's schedule: 1f1b, gpipe, interleaved, zero_bubble or zero_bubble_h2.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Chunks per rank of the interleaved schedule.
    #[arg(long, default_value_t = 1)]
    virtual_stages: usize,
    /// A mixture of experts: expert-parallel sizes to show each layout at (each rank of a
    /// group storing its share of the experts), with their placement and all-to-all bytes,
    /// comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    expert_parallel: Vec<usize>,
    /// Context-parallel sizes to show each layout at, comma-separated: each row's positions
    /// split over that many ranks (which must divide what tensor and pipeline leave).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    context_parallel: Vec<usize>,
    /// How context parallelism's attention reaches the other ranks' positions: ring or
    /// all_to_all.
    #[arg(long, default_value = "ring")]
    context_kind: String,
    /// Also show each layout training LoRA adapters of this rank on every linear layer.
    #[arg(long)]
    lora_rank: Option<i64>,
    /// Every layout with the next-token loss computed in the output head, this many
    /// positions' logits at a time (the chunked_loss method; 1024 where no value is given):
    /// the micro-batch's logits never exist.
    #[arg(long, num_args = 0..=1, default_missing_value = "1024")]
    chunked_loss: Option<i64>,
    /// Every layout with the values units keep for backward in host memory (the
    /// activation_offload method), recomputed blocks' inputs with them.
    #[arg(long)]
    activation_offload: bool,
    /// GRPO with groups of this many completions: every layout also decoding a rank's
    /// generation batch (--micro-batch × --accumulation completions of --ctx positions)
    /// before its step (the key/value cache counted beside the step's activations).
    #[arg(long)]
    num_generations: Option<usize>,
    /// GRPO: the most tokens of a completion; a prompt takes the rest of --ctx, and its
    /// prefill (every row's prompt through the model at once) is counted beside the cache.
    #[arg(long, default_value_t = 512)]
    max_completion_length: i64,
    /// A frozen whole copy of the model as the reference: GRPO's at --beta above 0 without
    /// LoRA (LoRA rows read their base instead), or TR-DPO's (--sync-reference-every).
    #[arg(long)]
    reference_copy: bool,
    /// Count asynchronous checkpoints' snapshot in host memory: each rank's checkpoint file.
    #[arg(long)]
    checkpoint_async: bool,
    /// Optimizer: adamw (8 bytes of state per trained element) or sgd (4, with momentum).
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    lora: bool,
    #[serde(flatten)]
    estimate: Estimate,
}

#[derive(Serialize)]
struct Report {
    params: i64,
    /// The parameters a token is multiplied by (a mixture of experts: the experts it is
    /// routed to).
    active_params: i64,
    device: DeviceKind,
    device_bytes: u64,
    host_bytes: u64,
    workload: Workload,
    rows: Vec<Row>,
    /// A mixture of experts at each expert-parallel size asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    experts: Vec<ExpertPlacement>,
    /// GRPO's generation, where it is counted.
    #[serde(skip_serializing_if = "Option::is_none")]
    generation: Option<Generation>,
}

/// The bytes of optimizer state per trained element of `name`.
pub fn optimizer_state_bytes(name: &str) -> Result<u64> {
    match name {
        "adamw" | "adam" => Ok(8),
        "sgd" => Ok(4),
        other => bail!("unknown optimizer {other:?}; expected adamw, adam or sgd"),
    }
}

pub fn run(a: EstimateArgs) -> Result<()> {
    let (config, ctx) = a.model.resolve()?;
    let kind = estimate::device_kind(&a.device)?;
    if a.nproc == 0 || a.micro_batch == 0 || a.accumulation == 0 {
        bail!("--nproc, --micro-batch and --accumulation must be positive");
    }
    let per_node = a.gpus_per_node.unwrap_or(a.nproc).clamp(1, a.nproc) as u64;
    let machine = Machine {
        device_bytes: a.device_memory.unwrap_or(kind.memory_bytes),
        host_bytes: a.host_memory.map_or(kind.host_bytes_per_device, |node| node / per_node),
        device: kind.clone(),
    };
    let precision = a.precision.map(PrecisionArg::precision).unwrap_or(if kind.name == "cpu" {
        Precision::Fp32
    } else {
        Precision::AmpBf16
    });
    let work = Workload {
        ranks: a.nproc,
        micro_batch: a.micro_batch,
        ctx,
        micro_batches: a.accumulation,
        optimizer_state_bytes: optimizer_state_bytes(&a.optimizer)?,
    };
    let spec = config.spec()?;
    let schedule: ScheduleKind =
        serde_json::from_value(serde_json::Value::String(a.schedule.clone())).map_err(|_| {
            anyhow::anyhow!(
                "unknown schedule {:?}; expected 1f1b, gpipe, interleaved, zero_bubble or zero_bubble_h2",
                a.schedule
            )
        })?;
    let mut layouts =
        estimate::layouts(&spec, a.nproc, precision, &a.tensor, &a.pipeline, (schedule, a.virtual_stages));
    if let Some(positions) = a.chunked_loss {
        if positions < 1 {
            bail!("--chunked-loss: positions must be positive, got {positions}");
        }
        if !spec.scores_in_chunks() {
            bail!("--chunked-loss: the model has no output head that computes the next-token loss in chunks");
        }
        layouts.iter_mut().for_each(|l| l.candidate.chunked_loss = Some(positions));
    }
    if a.activation_offload {
        layouts.iter_mut().for_each(|l| l.candidate.activation_offload = true);
    }
    let context_kind: ContextKind = serde_json::from_value(serde_json::Value::String(a.context_kind.clone()))
        .map_err(|_| anyhow::anyhow!("unknown context kind {:?}; expected ring or all_to_all", a.context_kind))?;
    if a.context_parallel.contains(&0) {
        bail!("--context-parallel: sizes must be positive");
    }
    if a.expert_parallel.contains(&0) {
        bail!("--expert-parallel: sizes must be positive");
    }
    if spec.expert_sets.is_empty() && a.expert_parallel.iter().any(|&s| s > 1) {
        bail!("--expert-parallel places a mixture of experts: the model has no experts");
    }
    let mut experts = vec![];
    for &size in &a.expert_parallel {
        experts.extend(estimate::expert_placement(&spec, &work, precision, size)?);
    }
    // Each layout at each context size that divides the ranks its tensor and pipeline
    // leave and each expert group size that divides its data ranks, sharded only where
    // ranks remain to shard over.
    let layouts: Vec<Layout> = layouts
        .iter()
        .flat_map(|l| a.context_parallel.iter().map(move |&c| l.with_context(c, context_kind)))
        .filter(|l| l.data_ranks(a.nproc) * l.context * l.pipeline * l.candidate.tensor.max(1) == a.nproc)
        .flat_map(|l| a.expert_parallel.iter().map(move |&e| l.with_experts(e)))
        .filter(|l| l.data_ranks(a.nproc).is_multiple_of(l.experts))
        .filter(|l| l.candidate.sharding == Sharding::None || l.shard_ranks(a.nproc) > 1)
        .collect();
    if layouts.is_empty() {
        bail!(
            "no layout: the tensor, pipeline, context and expert sizes given do not divide {} ranks or the model",
            a.nproc
        );
    }
    // A reference copy alone (TR-DPO's) decodes nothing.
    let decoded = a.micro_batch * a.accumulation;
    if let Some(group) = a.num_generations.filter(|&g| g == 0 || !decoded.is_multiple_of(g)) {
        bail!(
            "--num-generations {group}: a rank's generation batch of {decoded} completions is not whole groups of it"
        );
    }
    if a.num_generations.is_some() && !(1..ctx).contains(&a.max_completion_length) {
        bail!("--ctx {ctx} leaves no room for a prompt beside --max-completion-length {}", a.max_completion_length);
    }
    let generation = match (a.num_generations, a.reference_copy) {
        (None, false) => None,
        (group, reference_copy) => Some(Generation {
            rows: group.map_or(0, |_| decoded),
            positions: ctx,
            prompt: ctx - a.max_completion_length,
            reference_copy,
        }),
    };
    // GRPO's generation where it is asked for (under LoRA the base is the reference), and
    // asynchronous checkpoints' snapshot.
    let generating = |e: Estimate, layout: &Layout, spec: &ModelSpec, lora: bool| -> Result<Estimate> {
        let e = match a.checkpoint_async {
            true => estimate::with_snapshot(e, &work, &machine),
            false => e,
        };
        Ok(match generation {
            Some(g) => {
                let g = Generation { reference_copy: g.reference_copy && !lora, ..g };
                estimate::with_generation(e, (&config, spec), layout, &g, &machine)?
            }
            None => e,
        })
    };
    let mut rows = vec![];
    for layout in &layouts {
        let e = generating(estimate::estimate_spec(&spec, layout, &work, &machine)?, layout, &spec, false)?;
        rows.push(Row { lora: false, estimate: e });
    }
    if let Some(r) = a.lora_rank {
        let lora = LoraConfig {
            r,
            alpha: 2.0 * r as f64,
            target_modules: Targets::Pattern("all-linear".into()),
            ..LoraConfig::default()
        };
        let mut adapted = config.spec()?;
        lora.apply(&mut adapted)?;
        for layout in &layouts {
            let e = generating(estimate::estimate_spec(&adapted, layout, &work, &machine)?, layout, &adapted, true)?;
            rows.push(Row { lora: true, estimate: e });
        }
    }
    let report = Report {
        experts,
        params: spec.num_params(),
        active_params: spec.active_params()?,
        device: kind,
        device_bytes: machine.device_bytes,
        host_bytes: machine.host_bytes,
        workload: work,
        rows,
        generation,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let active = match report.active_params < report.params {
        true => format!(" ({:.3}B active per token)", report.active_params as f64 / 1e9),
        false => String::new(),
    };
    println!(
        "{:.3}B parameters{active}; {} rank(s) of {} ({} each, {} of host per rank); {} × {} tokens per micro-batch, {} micro-batch(es)",
        report.params as f64 / 1e9,
        a.nproc,
        report.device.name,
        human_bytes(report.device_bytes),
        human_bytes(report.host_bytes),
        a.micro_batch,
        ctx,
        a.accumulation
    );
    match &report.generation {
        Some(g) if g.rows > 0 => {
            let copy = if g.reference_copy { ", a frozen copy of the model as the reference" } else { "" };
            println!(
                "GRPO: decoding {} completions of {} positions ({}-token prompts) before each step{copy}",
                g.rows, g.positions, g.prompt
            );
        }
        Some(_) => println!("a frozen copy of the model as the reference"),
        None => {}
    }
    let label = |r: &Row| if r.lora { format!("{} + lora", r.estimate.layout) } else { r.estimate.layout.clone() };
    let w = report.rows.iter().map(|r| label(r).chars().count()).max().unwrap_or(6);
    println!(
        "{:<w$} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}  fits",
        "layout", "params", "grads", "optimizer", "activ.", "comm", "overhead", "device", "host"
    );
    for r in &report.rows {
        let d = &r.estimate.device;
        println!(
            "{:<w$} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}  {}",
            label(r),
            human_bytes(d.params),
            human_bytes(d.grads),
            human_bytes(d.optimizer),
            human_bytes(d.activations),
            human_bytes(d.comm),
            human_bytes(d.overhead),
            human_bytes(d.total()),
            human_bytes(r.estimate.host.total()),
            if r.estimate.fits { "yes" } else { "no" }
        );
    }
    if !report.experts.is_empty() {
        println!(
            "\n{:<16} {:>17} {:>22} {:>28}",
            "expert parallel", "experts per rank", "their weights stored", "all-to-all per step and rank"
        );
        for e in &report.experts {
            println!(
                "{:<16} {:>17} {:>22} {:>28}",
                e.size,
                e.experts_per_rank,
                human_bytes(e.expert_bytes_per_rank),
                human_bytes(e.all_to_all_bytes)
            );
        }
    }
    Ok(())
}
