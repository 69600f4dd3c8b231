//! Hugging Face model folders: a folder's `config.json` read into a built-in model's
//! configuration (GPT-2 for `gpt2`; the decoder of [`super::llama`] for `llama`, `arcee`, `apertus`, `cohere`, `cohere2`,
//! `starcoder2`, `nemotron`, `mistral`,
//! `ministral3`, `qwen2`, `qwen3`, `gemma2`, `gemma3_text`, `gemma4_text` (optionally with its
//! experts' block), `phi3`, `exaone4`, `seed_oss`, `ernie4_5`, `hunyuan_v1_dense`, `granite`, `glm4`,
//! `olmo2`, `olmo3` and `smollm3`, and with experts
//! ([`super::moe`]) for `mixtral`, `minimax_m2`, `qwen2_moe`, `qwen3_moe`, `olmoe`, `flex_olmo`, `ernie4_5_moe`, `granitemoe`, `hunyuan_v1_moe`, `glm4_moe` and `gpt_oss` (with
//! attention sinks) and `qwen3_next` (with Gated DeltaNet linear attention); with linear
//! attention for `qwen3_5_text`, and with experts too for `qwen3_5_moe_text`; and with latent
//! attention ([`super::latent`]) too for `deepseek_v3` and `glm4_moe_lite`; [`super::bert`] for `bert`, as a
//! sequence classifier or a masked language model by its architecture; [`super::t5`] for
//! `t5`) and written back from one, and each family's parameter names and layouts.
//!
//! Owns: the families, their config keys (each key that changes the computation is honoured
//! or refused by name), a folder's file list (one safetensors file or the shards an index
//! names, the tokenizer) and the mapping of names. Must not read tensors or touch an
//! engine: `io` loads and saves weights through [`Family::strata_name`] and [`Family::hf_name`].
use super::latent::LatentConfig;
use super::linear::LinearAttentionConfig;
use super::llama::{Activation, DecoderHead, FullLayerHeads, LayerAttention, Multipliers, MupMultipliers, NormKind};
use super::mamba::{GatedNorm, StateSpaceConfig};
use super::moe::{ExpertActivation, ExpertNames, GroupScore, MoeConfig, Scoring};
use super::rope::{QueryScaling, Rope, RopeScaling};
use super::selective::{InnerNorms, SelectiveScanConfig};
use super::short_conv::ShortConvConfig;
use super::{
    BertConfig, BertHead, DropoutRates, FeedForwardActivation, GptConfig, LlamaConfig, ModelConfig, ModelSpec, T5Config,
};
use crate::{Error, Result};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

/// The single weights file of a model folder.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index naming the shards of a sharded model folder.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Files describing a folder's tokenizer, copied along when a model is written back.
pub const TOKENIZER_FILES: [&str; 5] =
    ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", GENERATION_CONFIG, "chat_template.jinja"];
/// Config keys naming special tokens, carried from a read folder to a written one.
const TOKEN_KEYS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

/// A model family as Hugging Face `transformers` names it (`model_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// GPT-2 (`gpt2`).
    Gpt2,
    /// LLaMA (`llama`).
    Llama,
    /// Arcee (`arcee`): LLaMA's decoder with a feed-forward of ReLU² and no gate.
    Arcee,
    /// Cohere's Command R (`cohere`): LLaMA's decoder with layer norms without a bias,
    /// attention and feed-forward side by side on one norm, heads turned as adjacent pairs,
    /// the logits scaled.
    Cohere,
    /// Cohere 2 (`cohere2`: Command R7B, Command A): Cohere's layers, three of four sliding
    /// and turning positions, the fourth attending to all and turning none.
    Cohere2,
    /// Apertus (`apertus`): LLaMA's decoder with per-head query/key norms, a feed-forward of
    /// xIELU and no gate, and its norms under their own names.
    Apertus,
    /// StarCoder2 (`starcoder2`): layer norms with biases, biases on every projection, a
    /// feed-forward of GELU and no gate named `c_fc`/`c_proj`, optionally a sliding window.
    Starcoder2,
    /// Nemotron (`nemotron`): layer norms with biases scaled by `1 + w`, a feed-forward of
    /// ReLU² and no gate, half of each head turned by default.
    Nemotron,
    /// Mistral (`mistral`): the decoder, optionally with a sliding window.
    Mistral,
    /// Ministral 3 (`ministral3`): Mistral's decoder with queries scaled up by position.
    Ministral3,
    /// Qwen2 (`qwen2`): the decoder with biases on the query, key and value projections.
    Qwen2,
    /// Qwen2.5-VL's language model (`qwen2_5_vl_text`): Qwen2's layers, its rotation
    /// sectioned by axis for images (for text, one rotation).
    Qwen2_5Vl,
    /// Qwen3 (`qwen3`): the decoder with query/key norms.
    Qwen3,
    /// Qwen3-VL's language model (`qwen3_vl_text`): Qwen3's layers without a window, its
    /// rotation sectioned by axis for images (for text, one rotation).
    Qwen3Vl,
    /// Gemma 2 (`gemma2`): the decoder with Gemma's norms.
    Gemma2,
    /// Gemma 3's text model (`gemma3_text`).
    Gemma3,
    /// Gemma 4's text model (`gemma4_text`): Gemma 3's layers with norms weighted from one,
    /// unscaled scores, values normed per head, global layers with heads of their own (wider,
    /// optionally fewer key/value heads whose values are the key projection's) turned
    /// proportionally, and a stored scale of each block's output.
    Gemma4,
    /// Phi-3 (`phi3`): the decoder with fused projections.
    Phi3,
    /// GLM-4 (`glm4`): LLaMA's decoder with sandwich norms under GLM's names, a fused
    /// `gate_up_proj`, half of each head turned as adjacent pairs, and biases on the query,
    /// key and value projections.
    Glm4,
    /// SmolLM3 (`smollm3`): LLaMA's decoder with some layers turning no position (NoPE),
    /// optionally sliding there.
    SmolLm3,
    /// EXAONE 4 (`exaone4`): OLMo 2's norms after attention and the feed-forward alone, with
    /// per-head query/key norms, sliding layers and global layers that turn no position.
    Exaone4,
    /// Seed-OSS (`seed_oss`): LLaMA's decoder with biases on the query, key and value
    /// projections and (optionally) the output projection, and dropout of each sub-layer's output.
    SeedOss,
    /// ERNIE 4.5 (`ernie4_5`): LLaMA's decoder with each head turned as adjacent pairs.
    Ernie4_5,
    /// Granite (`granite`): LLaMA's decoder with multipliers of the embeddings, of each
    /// sub-layer's output and of the scores, and a divisor of the logits.
    Granite,
    /// HunYuan (`hunyuan_v1_dense`): LLaMA's decoder with per-head query/key norms after the
    /// rotation, under their own names, and a fixed NTK stretch of the rotation's base.
    HunYuanDense,
    /// HunYuan's mixture of experts (`hunyuan_v1_moe`): its layers with experts on every
    /// layer, renormalised softmax weights and a shared expert of the experts' width, the
    /// router and shared expert under their own names.
    HunYuanMoe,
    /// ERNIE 4.5's mixture of experts (`ernie4_5_moe`): its layers with experts chosen by
    /// softmax scores plus a choice bias and weighted by the scores alone, shared experts,
    /// dense layers outside a span.
    Ernie4_5Moe,
    /// Granite-MoE (`granitemoe`): Granite's decoder with experts on every layer, stacked in
    /// its files under their own names.
    GraniteMoe,
    /// Bamba (`bamba`): Mamba-2 mixers beside attention on the layers `attn_layer_indices`
    /// names, half of each head turned, under its own norms' and feed-forward's names.
    Bamba,
    /// Falcon-H1 (`falcon_h1`): on every layer a Mamba-2 mixer and attention side by side
    /// over the same normed input, μP multipliers throughout, under Bamba's names.
    FalconH1,
    /// Mamba (`mamba`): every layer a Mamba-1 mixer alone behind its norm, under `backbone.`
    /// with each layer's `mixer`.
    Mamba,
    /// Falcon Mamba (`falcon_mamba`): Mamba's layers, the step, `B` and `C` RMS-normed
    /// without a weight.
    FalconMamba,
    /// Jamba (`jamba`): Mamba-1 mixers with normed steps, `B` and `C` beside attention that
    /// turns no position, every `attn_layer_period`-th layer from `attn_layer_offset`; experts
    /// every `expert_layer_period`-th from `expert_layer_offset`; under Bamba's names.
    Jamba,
    /// LFM2 (`lfm2`): gated short convolutions on the layers `layer_types` marks `conv`,
    /// attention with per-head query/key norms on the others, under its own names.
    Lfm2,
    /// LFM2's mixture of experts (`lfm2_moe`): its layers, the first ones dense, the others
    /// with experts chosen by sigmoid scores plus a choice bias and weighted by the
    /// renormalised scores, without a load-balancing loss.
    Lfm2Moe,
    /// Granite 4 (`granitemoehybrid`): Granite's multipliers, Mamba-2 mixers on the layers
    /// `layer_types` marks (the others attention, turning positions or none), and on every
    /// layer its `shared_mlp`, beside Granite-MoE's experts where it has experts.
    GraniteMoeHybrid,
    /// OLMo Hybrid (`olmo_hybrid`): OLMo 3's attention layers (norms after each sub-layer,
    /// query/key norms over whole projections, turning no position where `rope_parameters`
    /// names no base) beside Gated DeltaNet layers normed as LLaMA's, their projections
    /// apart and their betas doubled.
    OlmoHybrid,
    /// Nemotron-H (`nemotron_h`): each layer one sub-layer behind its norm, of the kind
    /// `layers_block_type` names: a Mamba-2 mixer, attention turning no position, a ReLU²
    /// feed-forward without a gate, or experts without a gate chosen as DeepSeek-V3 chooses
    /// them beside a shared one; under its own names (`backbone.`, each layer's `mixer`).
    NemotronH,
    /// Llama 4's language model (`llama4_text`): heads turned as adjacent pairs on three
    /// layers of four, attending within chunks there, their queries and keys normed without
    /// a weight; the others turning no position, their queries scaled up with it; experts
    /// chosen by sigmoid scores that scale their inputs, beside a shared expert.
    Llama4,
    /// Mixtral (`mixtral`): Mistral's decoder with experts under their block-sparse names.
    Mixtral,
    /// MiniMax-M2 (`minimax_m2`): Mixtral's experts and names, chosen by sigmoid scores plus
    /// a choice bias and weighted by the renormalised scores, query/key norms over whole
    /// projections, part of each head turned (`rotary_dim`).
    MiniMaxM2,
    /// Qwen2-MoE (`qwen2_moe`): Qwen2's decoder with experts and, optionally, a shared expert.
    Qwen2Moe,
    /// dots.llm1 (`dots1`): Qwen3's attention (windows from `max_window_layers` on, where
    /// a window is set) over DeepSeek-V3's experts, shared experts and routing.
    Dots1,
    /// Qwen3-MoE (`qwen3_moe`): Qwen3's decoder with experts.
    Qwen3Moe,
    /// Qwen3-VL-MoE's language model (`qwen3_vl_moe_text`): Qwen3-VL's layers with experts,
    /// their weights always renormalised, stacked in its files (input-major as released).
    Qwen3VlMoe,
    /// OLMoE (`olmoe`): LLaMA's decoder with experts and norms over whole projections.
    Olmoe,
    /// FlexOlmo (`flex_olmo`): OLMo 2's decoder (norms after attention and the
    /// feed-forward alone, norms over whole projections) with OLMoE's experts.
    FlexOlmo,
    /// OLMo 2 (`olmo2`): LLaMA's decoder with norms after attention and the feed-forward
    /// alone, and query/key norms over whole projections.
    Olmo2,
    /// OLMo 3 (`olmo3`): OLMo 2's decoder with sliding-window layers (every fourth full by
    /// default), each kind of layer with its own rotation.
    Olmo3,
    /// DeepSeek-V3 (`deepseek_v3`): latent attention, sigmoid routing with a choice bias
    /// among groups of experts, shared experts, the first layers dense.
    DeepseekV3,
    /// DeepSeek-V2 (`deepseek_v2`): DeepSeek-V3's latent attention, each head's rotated
    /// part turned as adjacent pairs; experts chosen greedily by their softmax scores (within
    /// the groups whose best scores are highest, as the larger models choose) and weighted
    /// by them unrenormalised, times the routed scale,
    /// beside shared experts, the first layers dense.
    DeepseekV2,
    /// GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's latent attention and routing (one
    /// group by default), its dense layers named by `mlp_layer_types`.
    Glm4MoeLite,
    /// Mistral 4 (`mistral4`): DeepSeek-V3's latent attention with the queries scaled by
    /// position (as Ministral 3's), softmax routing without a choice bias, shared experts,
    /// the experts stacked on disk.
    Mistral4,
    /// Solar Open (`solar_open`): LLaMA's attention (biases on the query, key and value
    /// projections alone, by `attention_bias`) over GLM-4.5's experts on every layer.
    SolarOpen,
    /// GLM-4.5 (`glm4_moe`): DeepSeek-V3's routing and shared experts under grouped-query
    /// attention with a partial rotation, biases on the query, key and value projections
    /// and optional query/key norms.
    Glm4Moe,
    /// gpt-oss (`gpt_oss`): attention sinks and biases, alternating sliding and full
    /// layers, YaRN, experts with biases and a clamped SwiGLU, stacked on disk.
    GptOss,
    /// Qwen3-Next (`qwen3_next`): Gated DeltaNet linear attention on most layers, gated
    /// full attention on the others, zero-centred norms, Qwen2-MoE's experts.
    Qwen3Next,
    /// Qwen3.5's text model (`qwen3_5_text`): Qwen3-Next's layers with the linear
    /// attention's projections apart, and a dense feed-forward.
    Qwen3_5,
    /// Qwen3.5's text model with experts (`qwen3_5_moe_text`): Qwen3.5's layers with
    /// Qwen3-Next's experts on every layer, their routing weights renormalised.
    Qwen3_5Moe,
    /// BERT (`bert`), as a sequence classifier or a masked language model.
    Bert,
    /// T5 (`t5`): the encoder–decoder of [`super::t5`].
    T5,
}

/// A block's sandwich norms as Strata names them (Gemma's names) and as GLM-4's folders do:
/// after attention, before the feed-forward, after it.
/// HunYuan's query and key norms' names, beside Strata's.
const HUNYUAN_NORMS: [(&str, &str); 2] = [
    ("self_attn.q_norm.weight", "self_attn.query_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attn.key_layernorm.weight"),
];

/// Apertus's block norms' names, beside Strata's.
const APERTUS_NORMS: [(&str, &str); 2] = [
    ("input_layernorm.weight", "attention_layernorm.weight"),
    ("post_attention_layernorm.weight", "feedforward_layernorm.weight"),
];

/// Granite-MoE's stacked experts' names, beside the stacked names `io` takes apart.
const GRANITE_MOE_STACKS: [(&str, &str); 2] = [
    ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
    ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
];

/// LFM2's names of Strata's parameters (its final norm `embedding_norm`).
const LFM2_NAMES: [(&str, &str); 9] = [
    ("input_layernorm.weight", "operator_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.o_proj.weight", "self_attn.out_proj.weight"),
    ("self_attn.q_norm.weight", "self_attn.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attn.k_layernorm.weight"),
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
    ("model.norm.weight", "model.embedding_norm.weight"),
];

/// Attention on the layers `attending` lists, a recurrent mixer on the others.
fn attending_on(attending: &[i64], layers: i64) -> Vec<LayerAttention> {
    (0..layers).map(|i| if attending.contains(&i) { LayerAttention::Full } else { LayerAttention::Linear }).collect()
}

/// LFM2's names of its layers' kinds in `layer_types`.
const LFM2_LAYER_NAMES: [(&str, LayerAttention); 2] =
    [("conv", LayerAttention::Linear), ("full_attention", LayerAttention::Full)];

/// OLMo Hybrid's names of Strata's block norms (on its attention layers the first norms
/// attention's output, on the others the feed-forward's input).
const OLMO_HYBRID_NAMES: [(&str, &str); 2] = [
    ("input_layernorm.weight", "attention_layer_norm.weight"),
    ("post_attention_layernorm.weight", "feedforward_layer_norm.weight"),
];

/// OLMo Hybrid's block norms as `transformers` renames them in memory (Strata's names).
const OLMO_HYBRID_NAMES_IN_MEMORY: [(&str, &str); 2] =
    [(".attention_layer_norm.", ".input_layernorm."), (".feedforward_layer_norm.", ".post_attention_layernorm.")];

/// Bamba's names of Strata's parameters (its final norm `final_layernorm`).
const BAMBA_NAMES: [(&str, &str); 5] = [
    ("post_attention_layernorm.weight", "pre_ff_layernorm.weight"),
    ("mlp.gate_proj.weight", "feed_forward.gate_proj.weight"),
    ("mlp.up_proj.weight", "feed_forward.up_proj.weight"),
    ("mlp.down_proj.weight", "feed_forward.down_proj.weight"),
    ("model.norm.weight", "model.final_layernorm.weight"),
];

/// Jamba's names of Strata's norms (Bamba's; its feed-forwards are `feed_forward` in
/// Strata too, [`LlamaConfig::feed_forward_module`]).
const JAMBA_NAMES: [(&str, &str); 2] = [
    ("post_attention_layernorm.weight", "pre_ff_layernorm.weight"),
    ("model.norm.weight", "model.final_layernorm.weight"),
];

const GLM4_NORMS: [(&str, &str); 3] = [
    ("post_attention_layernorm.weight", "post_self_attn_layernorm.weight"),
    ("pre_feedforward_layernorm.weight", "post_attention_layernorm.weight"),
    ("post_feedforward_layernorm.weight", "post_mlp_layernorm.weight"),
];

/// How a family's files stack a sparse layer's experts ([`Family::expert_stacking`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertStacking {
    /// gpt-oss: each expert's matrices input-major, gate and up columns interleaved.
    Interleaved,
    /// Mistral 4: each expert's matrices output-major, the gate's rows before the up's.
    Concatenated,
    /// Llama 4: each expert's matrices input-major, the gate's columns before the up's.
    InputMajor,
}

/// Llama 4's attention options and dense width, as its keys give them ([`Keys::llama4_attention`]).
struct Llama4Attention {
    chunk: i64,
    layer_types: Vec<LayerAttention>,
    qk_l2_norm: bool,
    query_scaling: Option<QueryScaling>,
    /// `intermediate_size_mlp`: the dense layers' feed-forward width.
    dense_width: i64,
}

/// What a decoder family's configuration class gives where a folder leaves its keys out
/// (folders written by hand, trimmed, or by older code do).
struct ClassDefaults {
    /// `max_position_embeddings`.
    positions: i64,
    /// `rms_norm_eps`.
    norm_eps: f64,
    /// `rope_theta` (the families with a rotation per kind of layer have their own).
    rope_theta: f64,
    /// `head_dim`; `None`: the hidden size over the heads.
    head_dim: Option<i64>,
    /// `sliding_window`, where the family's layers slide (Qwen's where asked).
    window: Option<i64>,
    /// `num_key_value_heads`; `None`: one for each query head.
    kv_heads: Option<i64>,
}

/// `name` with its ending replaced where the first pair of `renames` (from, to) whose `from`
/// is the whole name, or ends it after a dot, names it.
fn renamed<'a>(name: &str, mut renames: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    renames
        .find_map(|(from, to)| {
            // A whole name, or the end of one after a dot.
            let block = name.strip_suffix(from).filter(|b| b.is_empty() || b.ends_with('.'))?;
            Some(format!("{block}{to}"))
        })
        .unwrap_or_else(|| name.to_string())
}

/// A LoRA factor's name split into its adapted module's and the factor's own part
/// (`.lora_A.weight`, `.lora_embedding_B`, ...); a parameter's whole name, and nothing.
fn split_factor(name: &str) -> (&str, &str) {
    match name.find(".lora_") {
        Some(at) => name.split_at(at),
        None => (name, ""),
    }
}

/// GPT-2's `Conv1D` layers keep their weights as `[in, out]`; Strata's are `[out, in]`.
const CONV1D_WEIGHTS: [&str; 4] = ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"];

const FAMILIES: [Family; 61] = [
    Family::Gpt2,
    Family::Llama,
    Family::Arcee,
    Family::Apertus,
    Family::Starcoder2,
    Family::Nemotron,
    Family::Cohere,
    Family::Cohere2,
    Family::Mistral,
    Family::Ministral3,
    Family::Qwen2,
    Family::Qwen2_5Vl,
    Family::Qwen3,
    Family::Qwen3Vl,
    Family::Gemma2,
    Family::Gemma3,
    Family::Gemma4,
    Family::Phi3,
    Family::Glm4,
    Family::SmolLm3,
    Family::Exaone4,
    Family::SeedOss,
    Family::Ernie4_5,
    Family::Ernie4_5Moe,
    Family::HunYuanDense,
    Family::HunYuanMoe,
    Family::Granite,
    Family::GraniteMoe,
    Family::GraniteMoeHybrid,
    Family::NemotronH,
    Family::Lfm2,
    Family::Lfm2Moe,
    Family::Bamba,
    Family::FalconH1,
    Family::Jamba,
    Family::Mamba,
    Family::FalconMamba,
    Family::Llama4,
    Family::Mixtral,
    Family::MiniMaxM2,
    Family::Qwen2Moe,
    Family::Qwen3Moe,
    Family::Dots1,
    Family::Qwen3VlMoe,
    Family::Olmoe,
    Family::FlexOlmo,
    Family::Olmo2,
    Family::Olmo3,
    Family::OlmoHybrid,
    Family::DeepseekV3,
    Family::DeepseekV2,
    Family::Glm4MoeLite,
    Family::Mistral4,
    Family::Glm4Moe,
    Family::SolarOpen,
    Family::GptOss,
    Family::Qwen3Next,
    Family::Qwen3_5,
    Family::Qwen3_5Moe,
    Family::Bert,
    Family::T5,
];

impl Family {
    /// The `model_type` that names this family in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
            Family::Arcee => "arcee",
            Family::Apertus => "apertus",
            Family::Starcoder2 => "starcoder2",
            Family::Nemotron => "nemotron",
            Family::Cohere => "cohere",
            Family::Cohere2 => "cohere2",
            Family::Mistral => "mistral",
            Family::Ministral3 => "ministral3",
            Family::Qwen2 => "qwen2",
            Family::Qwen2_5Vl => "qwen2_5_vl_text",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Vl => "qwen3_vl_text",
            Family::Gemma2 => "gemma2",
            Family::Gemma3 => "gemma3_text",
            Family::Gemma4 => "gemma4_text",
            Family::Phi3 => "phi3",
            Family::Glm4 => "glm4",
            Family::SmolLm3 => "smollm3",
            Family::Exaone4 => "exaone4",
            Family::SeedOss => "seed_oss",
            Family::Ernie4_5 => "ernie4_5",
            Family::Ernie4_5Moe => "ernie4_5_moe",
            Family::HunYuanDense => "hunyuan_v1_dense",
            Family::HunYuanMoe => "hunyuan_v1_moe",
            Family::Granite => "granite",
            Family::GraniteMoe => "granitemoe",
            Family::GraniteMoeHybrid => "granitemoehybrid",
            Family::Lfm2 => "lfm2",
            Family::Bamba => "bamba",
            Family::FalconH1 => "falcon_h1",
            Family::Jamba => "jamba",
            Family::Mamba => "mamba",
            Family::FalconMamba => "falcon_mamba",
            Family::Lfm2Moe => "lfm2_moe",
            Family::Llama4 => "llama4_text",
            Family::Mixtral => "mixtral",
            Family::MiniMaxM2 => "minimax_m2",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Dots1 => "dots1",
            Family::Qwen3VlMoe => "qwen3_vl_moe_text",
            Family::Olmoe => "olmoe",
            Family::FlexOlmo => "flex_olmo",
            Family::Olmo2 => "olmo2",
            Family::Olmo3 => "olmo3",
            Family::OlmoHybrid => "olmo_hybrid",
            Family::DeepseekV3 => "deepseek_v3",
            Family::Glm4MoeLite => "glm4_moe_lite",
            Family::Mistral4 => "mistral4",
            Family::DeepseekV2 => "deepseek_v2",
            Family::NemotronH => "nemotron_h",
            Family::Glm4Moe => "glm4_moe",
            Family::SolarOpen => "solar_open",
            Family::GptOss => "gpt_oss",
            Family::Qwen3Next => "qwen3_next",
            Family::Qwen3_5 => "qwen3_5_text",
            Family::Qwen3_5Moe => "qwen3_5_moe_text",
            Family::Bert => "bert",
            Family::T5 => "t5",
        }
    }

    /// The `transformers` class of `config` in this family: a decoder's causal language
    /// model, or its sequence classifier where the head is a reward model's.
    fn architecture(self, config: &ModelConfig) -> String {
        let causal = match self {
            Family::Bert => {
                return match config {
                    ModelConfig::Bert(BertConfig { head: BertHead::Classify { .. }, .. }) => {
                        "BertForSequenceClassification"
                    }
                    _ => "BertForMaskedLM",
                }
                .into()
            }
            Family::Gpt2 => return "GPT2LMHeadModel".into(),
            Family::T5 => return "T5ForConditionalGeneration".into(),
            Family::Llama => "Llama",
            Family::Arcee => "Arcee",
            Family::Apertus => "Apertus",
            Family::Starcoder2 => "Starcoder2",
            Family::Nemotron => "Nemotron",
            Family::Cohere => "Cohere",
            Family::Cohere2 => "Cohere2",
            Family::Mistral => "Mistral",
            Family::Ministral3 => "Ministral3",
            Family::Qwen2 => "Qwen2",
            Family::Qwen2_5Vl => "Qwen2_5_VLText",
            Family::Qwen3 => "Qwen3",
            Family::Qwen3Vl => "Qwen3VLText",
            Family::Gemma2 => "Gemma2",
            Family::Gemma3 => "Gemma3",
            Family::Gemma4 => "Gemma4",
            Family::Phi3 => "Phi3",
            Family::Glm4 => "Glm4",
            Family::SmolLm3 => "SmolLM3",
            Family::Exaone4 => "Exaone4",
            Family::SeedOss => "SeedOss",
            Family::Ernie4_5 => "Ernie4_5",
            Family::Ernie4_5Moe => "Ernie4_5_Moe",
            Family::HunYuanDense => "HunYuanDenseV1",
            Family::HunYuanMoe => "HunYuanMoEV1",
            Family::Granite => "Granite",
            Family::GraniteMoe => "GraniteMoe",
            Family::GraniteMoeHybrid => "GraniteMoeHybrid",
            Family::NemotronH => "NemotronH",
            Family::Lfm2 => "Lfm2",
            Family::Bamba => "Bamba",
            Family::FalconH1 => "FalconH1",
            Family::Jamba => "Jamba",
            Family::Mamba => "Mamba",
            Family::FalconMamba => "FalconMamba",
            Family::Lfm2Moe => "Lfm2Moe",
            Family::Llama4 => "Llama4",
            Family::Mixtral => "Mixtral",
            Family::MiniMaxM2 => "MiniMaxM2",
            Family::Qwen2Moe => "Qwen2Moe",
            Family::Qwen3Moe => "Qwen3Moe",
            Family::Dots1 => "Dots1",
            Family::Qwen3VlMoe => "Qwen3VLMoeText",
            Family::Olmoe => "Olmoe",
            Family::FlexOlmo => "FlexOlmo",
            Family::Olmo2 => "Olmo2",
            Family::Olmo3 => "Olmo3",
            Family::OlmoHybrid => "OlmoHybrid",
            Family::DeepseekV3 => "DeepseekV3",
            Family::Glm4MoeLite => "Glm4MoeLite",
            Family::Mistral4 => "Mistral4",
            Family::DeepseekV2 => "DeepseekV2",
            Family::Glm4Moe => "Glm4Moe",
            Family::SolarOpen => "SolarOpen",
            Family::GptOss => "GptOss",
            Family::Qwen3Next => "Qwen3Next",
            Family::Qwen3_5 => "Qwen3_5",
            Family::Qwen3_5Moe => "Qwen3_5Moe",
        };
        match config {
            ModelConfig::Llama(LlamaConfig { head: DecoderHead::Reward, .. }) => {
                // Gemma 3's and Qwen3.5's text-only classifiers are classes of their own.
                let text = if matches!(self, Family::Gemma3 | Family::Qwen3_5) { "Text" } else { "" };
                format!("{causal}{text}ForSequenceClassification")
            }
            _ => format!("{causal}ForCausalLM"),
        }
    }

    /// Whether `transformers` has a sequence classifier (a reward model's class) of the family.
    fn classifies_sequences(self) -> bool {
        !matches!(
            self,
            Family::Gpt2
                | Family::T5
                | Family::Olmoe
                | Family::FlexOlmo
                | Family::Glm4Moe
                | Family::Qwen3_5Moe
                | Family::Gemma4
                | Family::Ernie4_5Moe
                | Family::Granite
                | Family::GraniteMoe
                | Family::GraniteMoeHybrid
                | Family::NemotronH
                | Family::SolarOpen
                | Family::Dots1
                | Family::OlmoHybrid
                | Family::Lfm2
                | Family::Lfm2Moe
                | Family::Bamba
                | Family::FalconH1
                | Family::Mamba
                | Family::FalconMamba
                | Family::Apertus
                | Family::Llama4
                | Family::Cohere
                | Family::Cohere2
                | Family::MiniMaxM2
                | Family::Glm4MoeLite
                | Family::Qwen3Vl
                | Family::Qwen3VlMoe
                | Family::Qwen2_5Vl
        )
    }

    fn from_model_type(name: &str) -> Option<Family> {
        FAMILIES.into_iter().find(|f| f.model_type() == name)
    }

    fn is_gemma(self) -> bool {
        matches!(self, Family::Gemma2 | Family::Gemma3 | Family::Gemma4)
    }

    /// What this family's configuration class gives where a folder leaves its keys out.
    fn class_defaults(self) -> ClassDefaults {
        use Family::*;
        ClassDefaults {
            positions: match self {
                Gemma2 => 8192,
                Gemma3 | Gemma4 | Mistral | Mixtral | Glm4 | Glm4Moe | GptOss | Ernie4_5 | Ernie4_5Moe | Llama4 => {
                    131_072
                }
                Qwen2 | Qwen2_5Vl | Qwen3 | Qwen2Moe | Qwen3Moe | Qwen3Next | Qwen3_5 | Qwen3_5Moe | SmolLm3 => 32_768,
                Ministral3 => 262_144,
                Qwen3Vl | Qwen3VlMoe | Lfm2 | Lfm2Moe => 128_000,
                MiniMaxM2 => 196_608,
                SolarOpen => 131_072,
                Glm4MoeLite => 202_752,
                Apertus | OlmoHybrid => 65_536,
                Phi3 | Olmoe | FlexOlmo | DeepseekV3 | Arcee | Starcoder2 | Nemotron | NemotronH => 4096,
                Cohere | Cohere2 | FalconH1 => 8192,
                SeedOss => 524_288,
                Mistral4 => 1_048_576,
                Bamba | Jamba => 262_144,
                _ => 2048,
            },
            norm_eps: match self {
                Glm4 => 1.5625e-7,
                Ministral3 | Phi3 | Mixtral | Olmoe | Olmo2 | Olmo3 | Glm4Moe | GptOss | Exaone4 | Ernie4_5
                | Ernie4_5Moe | HunYuanDense | HunYuanMoe | Arcee | Apertus | Llama4 | Cohere | Cohere2
                | Starcoder2 | Nemotron | Glm4MoeLite | Qwen2_5Vl | Lfm2 | Lfm2Moe | Bamba | NemotronH | SolarOpen
                | FalconH1 => 1e-5,
                _ => 1e-6,
            },
            rope_theta: match self {
                Mixtral | Qwen2_5Vl | Lfm2 | Lfm2Moe => 1e6,
                SmolLm3 => 2e6,
                GptOss => 150_000.0,
                Ernie4_5 | Ernie4_5Moe | Llama4 | Cohere | Qwen3Vl | Qwen3VlMoe | FlexOlmo => 500_000.0,
                Apertus => 12_000_000.0,
                MiniMaxM2 => 5_000_000.0,
                SolarOpen => 1_000_000.0,
                _ => 10_000.0,
            },
            head_dim: match self {
                Gemma2 | Gemma3 | Gemma4 | Qwen3Next | Qwen3_5 | Qwen3_5Moe => Some(256),
                Qwen3 | Qwen3Vl | Glm4 | Ministral3 | SeedOss | Ernie4_5 | Llama4 | MiniMaxM2 | NemotronH
                | SolarOpen => Some(128),
                GptOss => Some(64),
                _ => None,
            },
            window: match self {
                Mistral | Qwen2 | Qwen2_5Vl | Qwen3 | Qwen2Moe | Qwen3Moe | Dots1 | Gemma2 | Gemma3 | Olmo3
                | Exaone4 | Cohere2 => Some(4096),
                GptOss => Some(128),
                Gemma4 => Some(512),
                _ => None,
            },
            kv_heads: match self {
                Starcoder2 | Ernie4_5 | Glm4 | Qwen3Next | Qwen3_5Moe => Some(2),
                Ernie4_5Moe | Gemma2 | Gemma3 | Gemma4 | SmolLm3 | Qwen3Moe | Qwen3_5 => Some(4),
                MiniMaxM2 | Llama4 | SeedOss | Mistral | Ministral3 | Mixtral | Glm4Moe | GptOss | Qwen2_5Vl | Lfm2
                | Lfm2Moe | Bamba | NemotronH | SolarOpen | FalconH1 | Jamba => Some(8),
                Qwen2Moe | Qwen3VlMoe => Some(16),
                Exaone4 | Qwen2 | Qwen3 | Qwen3Vl | Dots1 => Some(32),
                _ => None,
            },
        }
    }

    /// Whether the family's class reads `mlp_bias` (StarCoder2's names it `use_bias`).
    fn reads_mlp_bias(self) -> bool {
        matches!(
            self,
            Family::Llama | Family::Arcee | Family::Granite | Family::SeedOss | Family::SmolLm3 | Family::Nemotron
        )
    }

    /// The `config.json` key of the norms' epsilon.
    fn norm_eps_key(self) -> &'static str {
        match self {
            Family::Cohere | Family::Cohere2 => "layer_norm_eps",
            Family::Starcoder2 => "norm_epsilon",
            Family::NemotronH => "layer_norm_epsilon",
            Family::Nemotron | Family::Lfm2 | Family::Lfm2Moe => "norm_eps",
            _ => "rms_norm_eps",
        }
    }

    /// Whether the dense family's class always norms each head's queries and keys.
    fn norms_queries_and_keys(self) -> bool {
        matches!(
            self,
            Family::Qwen3
                | Family::Qwen3Vl
                | Family::Gemma3
                | Family::Gemma4
                | Family::Exaone4
                | Family::HunYuanDense
                | Family::Apertus
                | Family::Lfm2
        )
    }

    /// Whether the family is Cohere's (layer norms, the parallel block, scaled logits).
    fn is_cohere(self) -> bool {
        matches!(self, Family::Cohere | Family::Cohere2)
    }

    /// Whether the family is OLMo 2's (norms after attention and the feed-forward alone).
    fn is_olmo(self) -> bool {
        matches!(self, Family::Olmo2 | Family::Olmo3 | Family::OlmoHybrid | Family::FlexOlmo)
    }

    /// The dense family whose attention, windows and keys a mixture of experts shares
    /// (Mixtral is Mistral's, Qwen2/3-MoE Qwen2/3's, OLMoE, DeepSeek-V3 and GLM-4.5
    /// LLaMA's but for their own options); a dense family is its own.
    fn dense(self) -> Family {
        match self {
            Family::Mixtral => Family::Mistral,
            Family::Qwen2Moe => Family::Qwen2,
            Family::Qwen3Moe | Family::Dots1 => Family::Qwen3,
            Family::Qwen3VlMoe => Family::Qwen3Vl,
            Family::Qwen3_5Moe => Family::Qwen3_5,
            Family::Ernie4_5Moe => Family::Ernie4_5,
            Family::GraniteMoe | Family::GraniteMoeHybrid => Family::Granite,
            Family::HunYuanMoe => Family::HunYuanDense,
            Family::Lfm2Moe => Family::Lfm2,
            Family::FlexOlmo => Family::Olmo2,
            Family::Olmoe
            | Family::MiniMaxM2
            | Family::DeepseekV3
            | Family::DeepseekV2
            | Family::Glm4MoeLite
            | Family::Mistral4
            | Family::Glm4Moe
            | Family::SolarOpen
            | Family::GptOss
            | Family::Llama4
            | Family::Qwen3Next => Family::Llama,
            dense => dense,
        }
    }

    /// How the family's files stack each sparse layer's experts into one tensor per
    /// projection (gpt-oss, Mistral 4, Gemma 4, Granite-MoE), which `io` takes apart on load
    /// and stacks again on save; `None` where each expert's weights lie apart.
    pub fn expert_stacking(self) -> Option<ExpertStacking> {
        match self {
            Family::GptOss => Some(ExpertStacking::Interleaved),
            Family::Mistral4 | Family::Gemma4 | Family::GraniteMoe | Family::GraniteMoeHybrid => {
                Some(ExpertStacking::Concatenated)
            }
            Family::Llama4 => Some(ExpertStacking::InputMajor),
            // Released input-major, saved by `transformers` 5 output-major: `io` reads either.
            Family::Qwen3VlMoe => Some(ExpertStacking::Concatenated),
            _ => None,
        }
    }

    /// Whether the family's files stack experts input-major or output-major, told apart by
    /// shape (Qwen3-VL-MoE's releases, and what `transformers` 5 saves of them); written
    /// output-major, as [`Family::expert_stacking`] says.
    pub fn stacks_either_major(self) -> bool {
        self == Family::Qwen3VlMoe
    }

    /// Whether the family routes as DeepSeek-V3 does (sigmoid scores, a choice bias,
    /// groups, a routed scale, shared experts without a gate, the first layers dense).
    fn routes_like_deepseek(self) -> bool {
        matches!(
            self,
            Family::DeepseekV3
                | Family::DeepseekV2
                | Family::Glm4MoeLite
                | Family::Mistral4
                | Family::Glm4Moe
                | Family::Dots1
                | Family::SolarOpen
        )
    }

    /// Whether the family attends through DeepSeek's latent attention.
    fn has_latent_attention(self) -> bool {
        matches!(self, Family::DeepseekV3 | Family::DeepseekV2 | Family::Glm4MoeLite | Family::Mistral4)
    }

    fn has_experts(self) -> bool {
        self.dense() != self
    }

    /// Whether the family's layers are Qwen3-Next's: Gated DeltaNet linear attention beside
    /// gated full attention with query/key norms and a partial rotation, zero-centred norms.
    fn linear_attention_family(self) -> bool {
        matches!(self, Family::Qwen3Next | Family::Qwen3_5 | Family::Qwen3_5Moe)
    }

    /// Whether the family is Qwen3.5's (the linear attention's projections apart).
    fn is_qwen3_5(self) -> bool {
        matches!(self, Family::Qwen3_5 | Family::Qwen3_5Moe)
    }

    /// The family a built-in model is written as, by the options it uses, the first that
    /// applies: GPT as GPT-2; Falcon Mamba and Mamba (Mamba-1 mixers alone, with norms inside
    /// them or without); Jamba (Mamba-1 mixers beside attention); Nemotron-H (blocks of one
    /// sub-layer); Granite 4 (its `shared_mlp`); Falcon-H1 (μP multipliers); Bamba (Mamba-2 mixers without experts); a decoder with experts as LFM2-MoE (its names), Gemma 4 (block scalars, or experts
    /// beside the dense feed-forward), ERNIE 4.5-MoE (its names), Mistral 4 (latent
    /// attention with queries scaled by position), DeepSeek-V2 (latent attention with softmax
    /// scores), GLM-4.7-Flash (latent attention with dense
    /// layers other than the first ones), DeepSeek-V3 (latent attention),
    /// Qwen3.5-MoE or Qwen3-Next (their linear attention), gpt-oss (stacked names), MiniMax-M2
    /// (Mixtral's names with DeepSeek's routing), dots.llm1 (DeepSeek's routing under
    /// Qwen3's attention), Solar Open (DeepSeek's routing on every layer under LLaMA's
    /// attention), GLM-4.5
    /// (DeepSeek's routing), Mixtral or Granite-MoE (their names), OLMoE (norms over whole projections),
    /// Qwen3-MoE (per-head norms), else Qwen2-MoE; a dense one as LFM2 (short convolutions),
    /// OLMo Hybrid (linear attention's projections apart), Qwen3.5 (linear
    /// attention), Nemotron (layer norms scaled by `1 + w`), StarCoder2 (`c_fc`/`c_proj`, or
    /// layer norms with biases), Cohere 2 and Cohere (layer norms without a bias, or the
    /// parallel block; Cohere 2 with a window), Arcee (ReLU²), Apertus (xIELU), EXAONE 4 (post
    /// norms, per-head query/key norms), OLMo 3 (post norms with
    /// windows or a local rotation), OLMo 2 (post norms), SmolLM3 (unrotated layers),
    /// Ministral 3 (queries scaled by position), GLM-4 (a fused gate_up_proj), HunYuan
    /// (query/key norms after the rotation), Granite (multipliers), ERNIE 4.5 (heads turned
    /// as adjacent pairs), Phi-3
    /// (fused projections), Gemma 4 (block scalars, value norms or global heads), Gemma 3
    /// (Gemma's norms with query/key norms), Gemma 2 (Gemma's norms), Qwen3 (query/key
    /// norms), Qwen2 (biases on the query, key and value projections alone), Mistral (a
    /// window on every layer), else LLaMA.
    pub fn of(config: &ModelConfig) -> Result<Family> {
        let c = match config {
            ModelConfig::Gpt(_) => return Ok(Family::Gpt2),
            ModelConfig::Bert(_) => return Ok(Family::Bert),
            ModelConfig::T5(_) => return Ok(Family::T5),
            ModelConfig::Mlp(_) => {
                return Err(Error::Config("the mlp model has no Hugging Face family to be written as".into()))
            }
            ModelConfig::Llama(c) => c,
        };
        if c.latent.is_some() && c.moe.is_none() {
            return Err(Error::Config("latent attention without experts has no family to be written as".into()));
        }
        match (&c.selective_scan, c.mixer_alone) {
            (Some(s), true) if s.inner_norms.is_some() => return Ok(Family::FalconMamba),
            (Some(_), true) => return Ok(Family::Mamba),
            (Some(_), false) => return Ok(Family::Jamba),
            (None, true) => return Ok(Family::NemotronH),
            (None, false) => {}
        }
        if c.shared_mlp {
            return Ok(Family::GraniteMoeHybrid);
        }
        if c.mup.is_some() {
            return Ok(Family::FalconH1);
        }
        if c.state_space.is_some() && c.moe.is_none() {
            return Ok(Family::Bamba);
        }
        if let Some(moe) = &c.moe {
            return Ok(match c {
                _ if moe.names == ExpertNames::FeedForwardW => Family::Lfm2Moe,
                c if c.layer_scalar || moe.beside_dense => Family::Gemma4,
                _ if moe.names == ExpertNames::FeedForward => Family::Llama4,
                _ if moe.names == ExpertNames::MlpStatics => Family::Ernie4_5Moe,
                c if c.latent.is_some() && c.query_scaling.is_some() => Family::Mistral4,
                // Softmax scores, without Mistral 4's query scaling (the rest checked by
                // `cannot_write`).
                c if c.latent.is_some() && moe.scoring == Scoring::Softmax => Family::DeepseekV2,
                // Dense layers other than the first ones: GLM-4.7-Flash names each layer's kind.
                c if c.latent.is_some() && !dense_layers_lead(moe) => Family::Glm4MoeLite,
                c if c.latent.is_some() => Family::DeepseekV3,
                c if c.linear_attention.as_ref().is_some_and(|l| l.split_projections) => Family::Qwen3_5Moe,
                c if c.linear_attention.is_some() => Family::Qwen3Next,
                _ if moe.names == ExpertNames::Stacked => Family::GptOss,
                _ if moe.names == ExpertNames::BlockSparse && deepseek_routing(moe) => Family::MiniMaxM2,
                // Qwen3's attention (per-head norms, whole heads turned, no biases).
                c if deepseek_routing(moe)
                    && c.qk_norm
                    && !c.qk_norm_whole
                    && c.partial_rotary == 1.0
                    && !c.qkv_bias =>
                {
                    Family::Dots1
                }
                // No query/key norms, no dense layers, whole heads turned.
                c if deepseek_routing(moe) && !c.qk_norm && moe.dense_layers.is_empty() && c.partial_rotary == 1.0 => {
                    Family::SolarOpen
                }
                _ if deepseek_routing(moe) => Family::Glm4Moe,
                _ if moe.names == ExpertNames::BlockSparse => Family::Mixtral,
                _ if moe.names == ExpertNames::InputOutputLinear => Family::GraniteMoe,
                // OLMo 2's norms after attention and the feed-forward.
                c if c.post_norms => Family::FlexOlmo,
                c if c.qk_norm_whole => Family::Olmoe,
                _ if moe.names == ExpertNames::SharedMlp => Family::HunYuanMoe,
                c if c.qk_norm => Family::Qwen3Moe,
                _ => Family::Qwen2Moe,
            });
        }
        Ok(match c {
            c if c.short_conv.is_some() => Family::Lfm2,
            c if c.linear_attention.as_ref().is_some_and(|l| l.apart_projections) => Family::OlmoHybrid,
            c if c.linear_attention.is_some() => Family::Qwen3_5,
            c if c.norm == NormKind::LayerPlusOne => Family::Nemotron,
            c if c.fc_names || c.norm_bias => Family::Starcoder2,
            c if (c.parallel_block || c.norm == NormKind::Layer) && c.sliding_window.is_some() => Family::Cohere2,
            c if c.parallel_block || c.norm == NormKind::Layer => Family::Cohere,
            c if c.activation == Activation::Relu2 => Family::Arcee,
            c if c.activation == Activation::Xielu => Family::Apertus,
            c if c.post_norms && !c.qk_norm_whole => Family::Exaone4,
            c if c.post_norms && (c.sliding_window.is_some() || c.local_rope.is_some()) => Family::Olmo3,
            c if c.post_norms => Family::Olmo2,
            c if !c.unrotated_layers.is_empty() => Family::SmolLm3,
            c if c.query_scaling.is_some() => Family::Ministral3,
            c if c.fused_gate_up => Family::Glm4,
            c if c.qk_norm_after_rotation => Family::HunYuanDense,
            c if c.multipliers.is_some() => Family::Granite,
            c if c.interleaved_rotation => Family::Ernie4_5,
            c if c.fused_projections => Family::Phi3,
            c if c.layer_scalar || c.value_norm || c.full_layer_heads.is_some() => Family::Gemma4,
            c if c.norm == NormKind::PlusOne && c.qk_norm => Family::Gemma3,
            c if c.norm == NormKind::PlusOne => Family::Gemma2,
            c if c.qk_norm => Family::Qwen3,
            c if c.qkv_bias && !c.o_bias => Family::Qwen2,
            c if c.qkv_bias != c.o_bias => {
                return Err(Error::Config(
                    "no model family has a bias on the attention output alone: it cannot be written".into(),
                ))
            }
            c if c.sliding_window.is_some() && c.layer_types.is_none() => Family::Mistral,
            _ => Family::Llama,
        })
    }

    /// What of `config` this family's files cannot say, if anything.
    fn cannot_write(self, c: &LlamaConfig) -> Option<String> {
        if self == Family::NemotronH {
            return nemotron_h_cannot_hold(c).map(|what| format!("a nemotron_h model cannot hold {what}"));
        }
        if self == Family::Jamba {
            return jamba_cannot_hold(c).map(|what| format!("a jamba model cannot hold {what}"));
        }
        if matches!(self, Family::Mamba | Family::FalconMamba) {
            let falcon = self == Family::FalconMamba;
            return mamba_cannot_hold(c, falcon)
                .map(|what| format!("a {} model cannot hold {what}", self.model_type()));
        }
        if c.selective_scan.is_some() {
            return Some(format!("a {} model cannot hold Mamba-1 mixers", self.model_type()));
        }
        let gemma = self.is_gemma();
        let olmoe = self == Family::Olmoe;
        let moe = c.moe.as_ref();
        let single =
            c.mixer_alone || c.layer_types.as_ref().is_some_and(|t| t.contains(&LayerAttention::FeedForwardOnly));
        let experts = [
            (single, "layers of one sub-layer (a mixer or a feed-forward alone)"),
            (moe.is_some_and(|m| !m.activation.gated()), "experts without a gate"),
            (moe.is_some_and(|m| m.latent_dim.is_some()), "experts in a latent space"),
            // Gemma 4's and Granite 4's experts are an option of their layers.
            (
                moe.is_some() != self.has_experts() && !matches!(self, Family::Gemma4 | Family::GraniteMoeHybrid),
                "experts",
            ),
            (
                moe.is_some_and(|m| {
                    let block = [
                        m.beside_dense,
                        m.router_norm,
                        m.expert_scales,
                        m.names == ExpertNames::Layer,
                        m.activation == ExpertActivation::GeluTanh,
                    ];
                    if self != Family::Gemma4 {
                        return block.contains(&true);
                    }
                    let routing = m.scoring == Scoring::Softmax
                        && m.norm_topk
                        && m.shared_expert_dim.is_none()
                        && !deepseek_routing(m)
                        && m.sparse_step == 1
                        && m.dense_layers.is_empty();
                    !routing || block.contains(&false)
                }),
                "Gemma 4's experts' block (beside the dense feed-forward, every layer, its router normed and \
                 scaled per expert, renormalised softmax weights)",
            ),
            (
                moe.is_some_and(|m| m.shared_expert_dim.is_some())
                    && !(matches!(
                        self,
                        Family::Qwen2Moe
                            | Family::Qwen3Next
                            | Family::Qwen3_5Moe
                            | Family::Ernie4_5Moe
                            | Family::HunYuanMoe
                            | Family::Llama4
                    ) || self.routes_like_deepseek()),
                "a shared expert",
            ),
            (
                moe.is_some_and(|m| {
                    (m.names == ExpertNames::BlockSparse) != matches!(self, Family::Mixtral | Family::MiniMaxM2)
                }),
                "Mixtral's names",
            ),
            (
                moe.is_some_and(|m| {
                    let routing = m.scoring == Scoring::Sigmoid
                        && m.choice_bias
                        && m.norm_topk
                        && m.groups == 1
                        && m.routed_scale == 1.0
                        && m.shared_expert_dim.is_none()
                        && m.sparse_step == 1
                        && m.dense_layers.is_empty()
                        && m.balance_over_softmax;
                    if self == Family::MiniMaxM2 {
                        !routing
                    } else {
                        m.balance_over_softmax
                    }
                }),
                "MiniMax-M2's experts (sigmoid scores with a choice bias, renormalised, every layer sparse, no \
                 shared expert, a load-balancing loss over the logits' softmax)",
            ),
            ((c.qkv_bias || c.o_bias) && self == Family::MiniMaxM2, "attention biases"),
            (
                moe.is_some_and(|m| m.shared_expert_dim.is_none())
                    && matches!(self, Family::Qwen3Next | Family::Qwen3_5Moe),
                "experts without a shared expert",
            ),
            (
                moe.is_some_and(|m| {
                    let routing = m.scoring == Scoring::Softmax
                        && m.norm_topk
                        && !m.choice_bias
                        && m.groups == 1
                        && m.routed_scale == 1.0
                        && m.names == ExpertNames::SharedMlp
                        && m.shared_expert_dim == Some(m.expert_ffn_dim)
                        && !m.shared_gate
                        && m.sparse_step == 1
                        && m.dense_layers.is_empty();
                    if self == Family::HunYuanMoe {
                        !routing
                    } else {
                        m.names == ExpertNames::SharedMlp
                    }
                }),
                "HunYuan's experts (every layer sparse, renormalised softmax weights, one shared expert of the \
                 experts' width without a gate)",
            ),
            (
                moe.is_some_and(|m| {
                    let routing = m.scoring == Scoring::Sigmoid
                        && m.scale_inputs
                        && !m.norm_topk
                        && !m.choice_bias
                        && m.groups == 1
                        && m.routed_scale == 1.0
                        && m.names == ExpertNames::FeedForward
                        && m.shared_expert_dim == Some(m.expert_ffn_dim)
                        && !m.shared_gate;
                    if self == Family::Llama4 {
                        !routing
                    } else {
                        m.scale_inputs || m.names == ExpertNames::FeedForward
                    }
                }),
                "Llama 4's experts (sigmoid scores scaling each expert's input, one shared expert of the \
                 experts' width without a gate)",
            ),
            (
                moe.is_some_and(|m| {
                    (m.names == ExpertNames::InputOutputLinear)
                        != matches!(self, Family::GraniteMoe | Family::GraniteMoeHybrid)
                }),
                "Granite-MoE's names",
            ),
            (
                moe.is_some_and(|m| !m.norm_topk)
                    && matches!(
                        self,
                        Family::Mixtral
                            | Family::Qwen3_5Moe
                            | Family::GraniteMoe
                            | Family::GraniteMoeHybrid
                            | Family::Qwen3VlMoe
                    ),
                "routing weights that are not renormalised",
            ),
            (
                moe.is_some_and(|m| m.sparse_step != 1 || !m.dense_layers.is_empty())
                    && matches!(
                        self,
                        Family::Mixtral
                            | Family::Olmoe
                            | Family::FlexOlmo
                            | Family::Qwen3_5Moe
                            | Family::GraniteMoe
                            | Family::GraniteMoeHybrid
                    ),
                "dense layers among sparse ones",
            ),
            (
                c.qk_norm_whole != (olmoe || self.is_olmo() || self == Family::MiniMaxM2)
                    || c.clip_qkv.is_some() && !olmoe,
                "query/key norms over whole projections, or clipping",
            ),
            (
                c.post_norms != (self.is_olmo() || self == Family::Exaone4),
                "norms after attention and the feed-forward alone",
            ),
            (
                !c.unrotated_layers.is_empty()
                    && !matches!(
                        self,
                        Family::SmolLm3
                            | Family::Exaone4
                            | Family::Llama4
                            | Family::Cohere2
                            | Family::GraniteMoeHybrid
                            | Family::OlmoHybrid
                    ),
                "layers that turn no position",
            ),
            // Granite 4's and OLMo Hybrid's attention turns positions on every layer or none.
            (
                matches!(self, Family::GraniteMoeHybrid | Family::OlmoHybrid)
                    && !c.unrotated_layers.is_empty()
                    && c.unrotated_layers.len() as i64 != c.layers,
                "layers that turn no position beside layers that do",
            ),
            (c.short_conv.is_some() != (self.dense() == Family::Lfm2), "LFM2's short convolutions"),
            (
                moe.is_some_and(|m| {
                    m.norm_topk && m.norm_topk_epsilon != if self == Family::Lfm2Moe { 1e-6 } else { 1e-20 }
                }),
                "the epsilon of the routing weights' renormalisation (1e-6 for LFM2-MoE, 1e-20 elsewhere)",
            ),
            // Bamba's class turns half of each head, and has no biases on its feed-forward.
            (
                self == Family::Bamba && (c.partial_rotary != 0.5 || c.mlp_bias || c.state_space.is_none()),
                "Bamba's half-turned heads beside Mamba-2 mixers, its feed-forward without biases",
            ),
            (
                moe.is_some_and(|m| {
                    if self != Family::Lfm2Moe {
                        return m.names == ExpertNames::FeedForwardW;
                    }
                    let routing = m.names == ExpertNames::FeedForwardW
                        && m.scoring == Scoring::Sigmoid
                        && m.groups == 1
                        && m.sparse_step == 1
                        && dense_layers_lead(m)
                        && m.aux_loss_coef == 0.0;
                    !routing
                }),
                "LFM2-MoE's experts (sigmoid scores, the first layers dense, no load-balancing loss)",
            ),
            (
                c.shared_mlp != (self == Family::GraniteMoeHybrid)
                    || c.state_space.as_ref().is_some_and(|m| match self {
                        Family::GraniteMoeHybrid | Family::Bamba => m.inner() % c.dim != 0,
                        // Falcon-H1's width is a key of its own.
                        Family::FalconH1 => false,
                        _ => true,
                    }),
                "Granite 4's shared_mlp and Mamba-2 layers (their width a whole multiple of the hidden size)",
            ),
            (c.mup.is_some() != (self == Family::FalconH1), "Falcon-H1's μP multipliers"),
            (
                (0..c.layers as usize).any(|i| c.is_hybrid(i)) != (self == Family::FalconH1)
                    || self == Family::FalconH1
                        && (c.state_space.is_none() || !(0..c.layers as usize).all(|i| c.is_hybrid(i)) || c.mlp_bias),
                "Mamba-2 mixers beside attention (Falcon-H1's, on every layer, its feed-forward without biases)",
            ),
            (
                c.state_space.as_ref().is_some_and(|m| m.gated_norm != GatedNorm::GateThenNorm)
                    && self != Family::FalconH1,
                "a Mamba-2 mixer normed before its gate, or without a norm",
            ),
            // EXAONE 4 turns no position on exactly its full layers, where it has a window.
            (
                self == Family::Exaone4 && c.unrotated_layers != exaone4_unrotated(c),
                "layers that turn no position other than the full layers beside sliding ones",
            ),
            // Cohere 2 turns positions on exactly its sliding layers.
            (
                self == Family::Cohere2 && c.unrotated_layers != cohere2_unrotated(c),
                "layers that turn no position other than those that do not slide",
            ),
            (
                c.query_scaling.is_some_and(|q| !q.from_one && !q.unrotated_only)
                    != matches!(self, Family::Ministral3 | Family::Mistral4),
                "queries scaled by position",
            ),
            (
                c.query_scaling.is_some_and(|q| q.from_one || q.unrotated_only)
                    && (self != Family::Llama4 || c.query_scaling.is_some_and(|q| !(q.from_one && q.unrotated_only))),
                "Llama 4's attention temperature (positions from one, on the layers that turn none)",
            ),
            (
                (c.qk_l2_norm || c.attention_chunk.is_some()) && self != Family::Llama4,
                "query/key norms without a weight, or chunked attention",
            ),
            (c.fused_gate_up != (self == Family::Glm4), "a fused gate_up_proj beside apart attention projections"),
            (c.qk_norm_after_rotation != (self.dense() == Family::HunYuanDense), "query/key norms after the rotation"),
            (c.multipliers.is_some() && self.dense() != Family::Granite, "Granite's multipliers"),
            (
                [Some(c.rope()), c.local_rope.clone()]
                    .iter()
                    .flatten()
                    .any(|r| matches!(r.scaling, RopeScaling::NtkAlpha { .. }))
                    && self.dense() != Family::HunYuanDense,
                "a fixed NTK stretch of the rotation (a dynamic one with an alpha)",
            ),
            (
                c.interleaved_rotation
                    != (matches!(self.dense(), Family::Glm4 | Family::Ernie4_5)
                        || self.is_cohere()
                        || self == Family::Llama4),
                "heads turned as adjacent pairs",
            ),
            (c.latent.is_some() != self.has_latent_attention(), "latent attention"),
            (
                self == Family::DeepseekV2 && c.latent.as_ref().is_some_and(|l| !l.interleaved),
                "DeepSeek-V2's rotation of adjacent pairs",
            ),
            // Mistral 4's routing is pinned by the scoring rule below, shared experts or not;
            // ERNIE 4.5's, HunYuan's and Llama 4's by their own rules above.
            (
                moe.is_some_and(|m| deepseek_routing(m) != self.routes_like_deepseek())
                    && !matches!(
                        self,
                        Family::Mistral4
                            | Family::DeepseekV2
                            | Family::Lfm2Moe
                            | Family::Ernie4_5Moe
                            | Family::HunYuanMoe
                            | Family::Llama4
                            | Family::MiniMaxM2
                    ),
                "DeepSeek's routing",
            ),
            // ERNIE 4.5's routing, names and sparse span are pinned whole.
            (
                moe.is_some_and(|m| {
                    let ernie = m.names == ExpertNames::MlpStatics;
                    if self != Family::Ernie4_5Moe {
                        return ernie;
                    }
                    let routing = m.scoring == Scoring::Softmax
                        && m.choice_bias
                        && m.norm_topk
                        && m.groups == 1
                        && m.routed_scale == 1.0
                        && (m.shared_expert_dim.is_none() || !m.shared_gate)
                        && m.expert_ffn_dim > 0
                        && m.sparse_step > 0
                        && m.shared_expert_dim.is_none_or(|w| w % m.expert_ffn_dim == 0)
                        && ernie_span_holds(c.layers, m);
                    !(ernie && routing)
                }),
                "ERNIE 4.5's experts (softmax scores with a choice bias, shared experts of their width, \
                 dense layers outside one span)",
            ),
            (
                moe.is_some_and(|m| {
                    let scored = match self {
                        Family::Mistral4 => m.scoring == Scoring::Softmax && !m.choice_bias,
                        // DeepSeek-V2's greedy choice (within groups scored by their best
                        // expert, where there are groups), its weights never renormalised.
                        Family::DeepseekV2 => {
                            m.scoring == Scoring::Softmax
                                && !m.choice_bias
                                && !m.norm_topk
                                && (m.groups == 1 || m.group_score == GroupScore::Best)
                        }
                        _ => m.scoring == Scoring::Sigmoid && m.choice_bias,
                    };
                    let grouped_as_v3 = m.groups == 1 || m.group_score == GroupScore::TopTwoSum;
                    self.routes_like_deepseek() && !(scored && (self == Family::DeepseekV2 || grouped_as_v3))
                }),
                "DeepSeek-V3's sigmoid scores with a choice bias (groups scored by their two best), or \
                 Mistral 4's softmax ones without, or DeepSeek-V2's chosen greedily (groups scored by their \
                 best) and not renormalised",
            ),
            (
                moe.is_some_and(|m| self.routes_like_deepseek() && m.shared_expert_dim.is_some() && m.shared_gate),
                "a shared expert behind a gate beside DeepSeek's routing",
            ),
            (
                moe.is_some_and(|m| {
                    self.routes_like_deepseek()
                        && (m.sparse_step != 1
                            || self != Family::Glm4MoeLite && !dense_layers_lead(m)
                            || m.shared_expert_dim.is_some_and(|w| w % m.expert_ffn_dim != 0))
                }),
                "dense layers other than the first ones, or shared experts of another width",
            ),
            (
                matches!(
                    self,
                    Family::DeepseekV3
                        | Family::DeepseekV2
                        | Family::Glm4MoeLite
                        | Family::Mistral4
                        | Family::GptOss
                        | Family::Nemotron
                        | Family::Dots1
                        | Family::OlmoHybrid
                ) && c.qkv_bias != c.o_bias,
                "a bias on some attention projections alone",
            ),
            (
                matches!(self, Family::Glm4Moe | Family::Glm4 | Family::SolarOpen) && c.o_bias,
                "a bias on the attention output",
            ),
            (
                self == Family::SolarOpen && moe.is_some_and(|m| !m.dense_layers.is_empty()),
                "dense layers among sparse ones",
            ),
            (c.attention_sinks != (self == Family::GptOss), "attention sinks"),
            (
                moe.is_some_and(|m| {
                    (m.names == ExpertNames::Stacked
                        || m.router_bias
                        || m.expert_bias
                        || matches!(m.activation, ExpertActivation::ClampedSwiglu { .. }))
                        != (self == Family::GptOss)
                }),
                "gpt-oss's experts",
            ),
            (
                c.linear_attention.is_some() != (self.linear_attention_family() || self == Family::OlmoHybrid)
                    || c.attention_output_gate != self.linear_attention_family(),
                "linear attention and gated attention outputs",
            ),
            (
                c.linear_attention.as_ref().is_some_and(|l| {
                    let olmo = (l.apart_projections, l.gate_norm_eps) == (true, Some(1e-5));
                    let qwen = (l.apart_projections, l.doubled_beta, l.gate_norm_eps) == (false, false, None);
                    if self == Family::OlmoHybrid {
                        !olmo
                    } else {
                        !qwen
                    }
                }) || c.recurrent_pre_norms != (self == Family::OlmoHybrid),
                "OLMo Hybrid's linear attention (projections apart, doubled betas, its own norm epsilon, LLaMA's \
                 norms)",
            ),
            (
                self == Family::OlmoHybrid
                    && c.layer_types
                        .as_ref()
                        .is_none_or(|t| !t.contains(&LayerAttention::Linear) || !t.contains(&LayerAttention::Full)),
                "OLMo Hybrid's layers without a linear_attention or a full_attention one",
            ),
            (
                c.linear_attention.as_ref().is_some_and(|l| l.split_projections != self.is_qwen3_5()),
                "this layout of the linear attention's projections",
            ),
            (
                (c.full_layer_heads.is_some()
                    || c.proportional_rotary
                    || c.local_rope.as_ref().is_some_and(|r| r.proportional))
                    && self != Family::Gemma4,
                "global layers' own heads or a proportional rotation",
            ),
            (
                self == Family::Gemma4
                    && [Some(&c.rope()), c.local_rope.as_ref()]
                        .into_iter()
                        .flatten()
                        .any(|r| r.partial != 1.0 && !r.proportional),
                "a partial rotation other than a proportional one",
            ),
            (
                c.full_layer_heads.is_some_and(|f| f.kv_heads.is_some() && !f.values_from_keys),
                "global layers' own key/value heads without their values from the keys",
            ),
            (
                (c.layer_scalar, c.value_norm, c.query_pre_attn_scalar, c.attn_softcap)
                    != (true, true, Some(1.0), None)
                    && self == Family::Gemma4
                    || (c.layer_scalar || c.value_norm) && self != Family::Gemma4,
                "Gemma 4's block scalars, value norms and unscaled, uncapped scores",
            ),
        ];
        // The attention's options as the dense family it is built like allows them.
        let dense = self.dense();
        let next = self.linear_attention_family();
        let qk_norm_family =
            dense.norms_queries_and_keys() || olmoe || next || self.is_olmo() || self == Family::MiniMaxM2;
        let gemma4 = self == Family::Gemma4;
        let glm = self == Family::Glm4Moe;
        let (starcoder2, nemotron) = (self == Family::Starcoder2, self == Family::Nemotron);
        let needs = [
            (c.fused_projections != (dense == Family::Phi3), "fused projections"),
            ((c.norm == NormKind::PlusOne) != (gemma && !gemma4 || next), "zero-centred norms"),
            (
                (c.norm == NormKind::Layer && !c.norm_bias, c.parallel_block) != (self.is_cohere(), self.is_cohere())
                    || c.logit_scale.is_some() && !self.is_cohere(),
                "layer norms without a bias, a parallel block or scaled logits (Cohere's)",
            ),
            ((c.norm == NormKind::Layer && c.norm_bias) != starcoder2, "layer norms with biases"),
            (
                (c.norm == NormKind::LayerPlusOne) != nemotron || nemotron && !c.norm_bias,
                "layer norms with biases scaled by 1 + w (Nemotron's)",
            ),
            ((c.activation == Activation::GeluTanh) != gemma, "GELU gating"),
            (
                (c.activation == Activation::UngatedGeluTanh, c.fc_names) != (starcoder2, starcoder2),
                "a GELU feed-forward without a gate, or c_fc and c_proj",
            ),
            (
                starcoder2 && !(c.qkv_bias == c.o_bias && c.o_bias == c.mlp_bias),
                "biases on some projections alone (its use_bias puts them on all)",
            ),
            (c.mlp_bias && !self.reads_mlp_bias() && !starcoder2, "biases on the feed-forward"),
            (
                (c.activation == Activation::Relu2) != matches!(self, Family::Arcee | Family::Nemotron),
                "a ReLU² feed-forward without a gate",
            ),
            ((c.activation == Activation::Xielu) != (self == Family::Apertus), "an xIELU feed-forward without a gate"),
            (c.sandwich_norms != (gemma || self == Family::Glm4), "sandwich norms"),
            (c.scale_embeddings != gemma, "scaled embeddings"),
            (c.qk_norm != qk_norm_family && !glm, "query/key norms"),
            (
                c.local_rope.is_some() && !matches!(dense, Family::Gemma3 | Family::Gemma4 | Family::Olmo3),
                "a local rotation",
            ),
            (
                (c.attn_softcap.is_some() || c.logit_softcap.is_some() || c.query_pre_attn_scalar.is_some()) && !gemma,
                "soft-capping or query_pre_attn_scalar",
            ),
            (
                c.qkv_bias
                    && !matches!(
                        dense,
                        Family::Llama
                            | Family::Arcee
                            | Family::Apertus
                            | Family::Cohere
                            | Family::Cohere2
                            | Family::Qwen2
                            | Family::Qwen2_5Vl
                            | Family::Qwen3
                            | Family::Qwen3Vl
                            | Family::Gemma2
                            | Family::Gemma3
                            | Family::Gemma4
                            | Family::Qwen3_5
                            | Family::Olmo2
                            | Family::Olmo3
                            | Family::OlmoHybrid
                            | Family::SmolLm3
                            | Family::Glm4
                            | Family::SeedOss
                            | Family::HunYuanDense
                            | Family::Granite
                            | Family::Starcoder2
                            | Family::Nemotron
                            | Family::FalconH1
                    ),
                "attention biases",
            ),
            (
                c.partial_rotary != 1.0
                    && !matches!(dense, Family::Phi3 | Family::Glm4 | Family::Gemma4 | Family::Nemotron)
                    && !glm
                    && !next
                    && !matches!(self, Family::MiniMaxM2 | Family::Bamba | Family::SolarOpen),
                "a partial rotation",
            ),
            (
                c.sliding_window.is_some()
                    && matches!(
                        dense,
                        Family::Llama
                            | Family::Arcee
                            | Family::Apertus
                            | Family::Cohere
                            | Family::Qwen3_5
                            | Family::Qwen3Vl
                            | Family::Olmo2
                            | Family::SeedOss
                            | Family::Ernie4_5
                            | Family::HunYuanDense
                            | Family::Granite
                            | Family::Nemotron
                    )
                    && self != Family::GptOss,
                "a sliding window",
            ),
            (
                c.layer_types.as_ref().is_some_and(|t| t.windows(2).any(|w| w[0] != w[1]))
                    && matches!(dense, Family::Mistral | Family::Ministral3 | Family::Phi3 | Family::Starcoder2),
                "layers of different attention",
            ),
        ];
        experts
            .iter()
            .chain(&needs)
            .find(|(bad, _)| *bad)
            .map(|(_, what)| format!("a {} model cannot hold {what}", self.model_type()))
    }

    /// The name a family's files give a Strata parameter, and whether they hold its matrix
    /// transposed.
    pub fn hf_name(self, name: &str) -> (String, bool) {
        if matches!(self, Family::NemotronH | Family::Mamba | Family::FalconMamba) {
            return (nemotron_h_name(name), false);
        }
        let transposed = self == Family::Gpt2 && CONV1D_WEIGHTS.iter().any(|w| name.ends_with(w));
        (renamed(name, self.renames()), transposed)
    }

    /// The name `transformers` holds a Strata parameter under in memory, which peft names
    /// its adapters' tensors by: the name in the family's files as `transformers` renames it
    /// on reading (its conversion mapping), a LoRA factor's (`{module}.lora_A.weight`,
    /// ...) after its adapted module's.
    pub fn memory_name(self, name: &str) -> String {
        let (module, factor) = split_factor(name);
        let held = match factor {
            "" => self.hf_name(name).0,
            _ => {
                let weight = self.hf_name(&format!("{module}.weight")).0;
                weight.strip_suffix(".weight").unwrap_or(&weight).to_string()
            }
        };
        self.renamed_in_memory(&format!("{held}{factor}"))
    }

    /// A name of the family's files as `transformers` renames it on reading.
    fn renamed_in_memory(self, name: &str) -> String {
        self.memory_renames().iter().fold(name.to_string(), |held, (file, memory)| held.replacen(file, memory, 1))
    }

    /// The Strata parameter a name [`Family::memory_name`] gives stands for; `None` for a
    /// buffer of the family's that is no parameter.
    pub fn from_memory_name(self, name: &str) -> Option<String> {
        let name = self.memory_renames().iter().fold(name.to_string(), |n, (file, memory)| n.replacen(memory, file, 1));
        let (module, factor) = split_factor(&name);
        match factor {
            "" => self.strata_name(module).map(|(n, _)| n),
            _ => {
                let (weight, _) = self.strata_name(&format!("{module}.weight"))?;
                Some(format!("{}{factor}", weight.strip_suffix(".weight").unwrap_or(&weight)))
            }
        }
    }

    /// What `transformers` 5 renames in the family's file names as it reads them (its
    /// conversion mapping), each (in the files, in memory).
    fn memory_renames(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Family::Mixtral | Family::MiniMaxM2 => &[(".block_sparse_moe.", ".mlp.")],
            Family::GraniteMoe | Family::GraniteMoeHybrid => &[(".router.layer.", ".router.")],
            Family::OlmoHybrid => &OLMO_HYBRID_NAMES_IN_MEMORY,
            Family::NemotronH => &[("backbone.", "model.")],
            _ => &[],
        }
    }

    /// Strata's names of the parameters the family's files name otherwise, and theirs.
    fn renames(self) -> impl Iterator<Item = (&'static str, &'static str)> {
        let lists: &[&[(&str, &str)]] = match self {
            Family::Glm4 => &[&GLM4_NORMS],
            Family::HunYuanDense | Family::HunYuanMoe => &[&HUNYUAN_NORMS],
            Family::Apertus => &[&APERTUS_NORMS],
            Family::GraniteMoe | Family::GraniteMoeHybrid => &[&GRANITE_MOE_STACKS],
            Family::Lfm2 | Family::Lfm2Moe => &[&LFM2_NAMES],
            Family::Bamba | Family::FalconH1 => &[&BAMBA_NAMES],
            Family::Jamba => &[&JAMBA_NAMES],
            Family::OlmoHybrid => &[&OLMO_HYBRID_NAMES],
            _ => &[],
        };
        lists.iter().flat_map(|list| list.iter().copied())
    }

    /// The Strata parameter a tensor of a family's file holds, and whether it is stored
    /// transposed; `None` for buffers the family saves that are not parameters (GPT-2's
    /// attention masks, older LLaMAs' rotary frequencies).
    pub fn strata_name(self, name: &str) -> Option<(String, bool)> {
        match self {
            Family::Gpt2 => {
                if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
                    return None;
                }
                // A bare `GPT2Model` saves its parameters without the `transformer.` prefix.
                let bare = ["wte.", "wpe.", "h.", "ln_f."].iter().any(|p| name.starts_with(p));
                let full = if bare { format!("transformer.{name}") } else { name.to_string() };
                let transposed = self.hf_name(&full).1;
                Some((full, transposed))
            }
            // Buffers of ids BERT's embeddings keep for inputs that come without them.
            Family::Bert
                if name.ends_with("embeddings.position_ids") || name.ends_with("embeddings.token_type_ids") =>
            {
                None
            }
            _ if name.ends_with("rotary_emb.inv_freq") => None,
            _ => Some((self.renamed_from_disk(&language_model_name(name)?), false)),
        }
    }

    /// `name` as the family's files give it, with the parts the family names otherwise
    /// renamed to Strata's (its stacked experts' names among them, before `io` takes them apart).
    pub(crate) fn renamed_from_disk(self, name: &str) -> String {
        match self {
            Family::NemotronH => return strata_name_of_backbone(name, nemotron_h_sub_layer),
            // Every mixer is a Mamba-1 mixer.
            Family::Mamba | Family::FalconMamba => return strata_name_of_backbone(name, |_| "mamba"),
            _ => {}
        }
        renamed(name, self.renames().map(|(strata, hf)| (hf, strata)))
    }

    /// The `config.json` of `config` written as this family, with `special_tokens` (the
    /// read folder's `bos_token_id`, ...) carried along.
    pub fn config_json(self, config: &ModelConfig, special_tokens: &Map<String, Value>) -> Result<Value> {
        let mut out = match (self, config) {
            (Family::Gpt2, ModelConfig::Gpt(c)) => json!({
                "n_embd": c.dim,
                "n_layer": c.layers,
                "n_head": c.heads,
                "n_positions": c.ctx,
                "vocab_size": c.vocab,
                "layer_norm_epsilon": c.norm_eps,
                "activation_function": "gelu_new",
                "n_inner": null,
                "tie_word_embeddings": true,
                "attn_pdrop": c.dropout.attention,
                "embd_pdrop": c.dropout.embedding,
                "resid_pdrop": c.dropout.residual,
            }),
            (Family::Bert, ModelConfig::Bert(c)) => bert_json(c),
            (Family::T5, ModelConfig::T5(c)) => t5_json(c)?,
            (family, ModelConfig::Llama(c)) if !matches!(family, Family::Gpt2 | Family::Bert | Family::T5) => {
                if let Some(why) = family.cannot_write(c) {
                    return Err(Error::Config(why));
                }
                if c.head == DecoderHead::Reward && !family.classifies_sequences() {
                    return Err(Error::Config(format!(
                        "a reward model cannot be written as {}: it has no sequence classifier",
                        family.model_type()
                    )));
                }
                decoder_json(family, c)
            }
            (family, _) => {
                return Err(Error::Config(format!("this model cannot be written as a {} model", family.model_type())))
            }
        };
        out["model_type"] = json!(self.model_type());
        out["architectures"] = json!([self.architecture(config)]);
        if let ModelConfig::Llama(LlamaConfig { head: DecoderHead::Reward, .. }) = config {
            out["id2label"] = json!({"0": "LABEL_0"});
            out["label2id"] = json!({"LABEL_0": 0});
        }
        out["dtype"] = json!("float32");
        for (key, value) in special_tokens {
            out[key] = value.clone();
        }
        Ok(out)
    }
}

/// `config.json` keys of a BERT model.
fn bert_json(c: &BertConfig) -> Value {
    let mut out = json!({
        "vocab_size": c.vocab,
        "hidden_size": c.dim,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "intermediate_size": c.ffn_dim,
        "hidden_act": "gelu",
        "max_position_embeddings": c.max_positions,
        "type_vocab_size": c.type_vocab,
        "layer_norm_eps": c.norm_eps,
        "position_embedding_type": "absolute",
        "pad_token_id": c.padding,
        "hidden_dropout_prob": c.dropout.residual,
        "attention_probs_dropout_prob": c.dropout.attention,
        "classifier_dropout": c.dropout.classifier,
    });
    if let BertHead::Classify { labels } = &c.head {
        let ids: Map<String, Value> = labels.iter().enumerate().map(|(i, l)| (i.to_string(), json!(l))).collect();
        let names: Map<String, Value> = labels.iter().enumerate().map(|(i, l)| (l.clone(), json!(i))).collect();
        out["id2label"] = Value::Object(ids);
        out["label2id"] = Value::Object(names);
    }
    out
}

/// `config.json` keys of a T5 model.
fn t5_json(c: &T5Config) -> Result<Value> {
    let activation = match c.activation {
        FeedForwardActivation::Relu => "relu",
        FeedForwardActivation::Gelu => "gelu",
        FeedForwardActivation::GeluTanh => "gelu_new",
        FeedForwardActivation::Silu => "silu",
    };
    // transformers spells T5 v1.1's gated tanh GELU `gated-gelu`, and reads `gated-gelu` so
    // whatever is written: a gated exact GELU has no spelling.
    let feed_forward = match (c.gated, c.activation) {
        (true, FeedForwardActivation::GeluTanh) => "gated-gelu".to_string(),
        (true, FeedForwardActivation::Gelu) => {
            return Err(Error::Config(
                "a T5 feed-forward gated by exact GELU cannot be written: transformers reads \
                 gated-gelu as GELU's tanh form"
                    .into(),
            ))
        }
        (true, _) => format!("gated-{activation}"),
        (false, _) => activation.to_string(),
    };
    Ok(json!({
        "vocab_size": c.vocab,
        "d_model": c.dim,
        "d_kv": c.head_dim,
        "d_ff": c.ffn_dim,
        "num_layers": c.encoder_layers,
        "num_decoder_layers": c.decoder_layers,
        "num_heads": c.heads,
        "relative_attention_num_buckets": c.buckets,
        "relative_attention_max_distance": c.max_distance,
        "layer_norm_epsilon": c.norm_eps,
        "feed_forward_proj": feed_forward,
        "tie_word_embeddings": c.tied_head,
        "scale_decoder_outputs": c.scale_output,
        "pad_token_id": c.padding,
        "decoder_start_token_id": c.decoder_start,
        "is_encoder_decoder": true,
        "dropout_rate": c.dropout.residual,
    }))
}

/// Gemma 4's global layers' heads, `None` where they are the sliding layers' (`base`).
fn full_heads_or_none(
    base: i64,
    head_dim: i64,
    kv_heads: Option<i64>,
    values_from_keys: bool,
) -> Option<FullLayerHeads> {
    Some(FullLayerHeads { head_dim, kv_heads, values_from_keys })
        .filter(|_| head_dim != base || kv_heads.is_some() || values_from_keys)
}

/// Whether ERNIE 4.5's keys can say which of `layers` layers `moe` makes sparse: every
/// `sparse_step`-th layer of one span (its first sparse layer to its last).
fn ernie_span_holds(layers: i64, moe: &MoeConfig) -> bool {
    let sparse: Vec<i64> = (0..layers).filter(|&l| moe.is_sparse(l)).collect();
    let (first, last) = (sparse.first().copied().unwrap_or(layers), sparse.last().copied().unwrap_or(-1));
    sparse == (first..=last).filter(|l| (l + 1) % moe.sparse_step == 0).collect::<Vec<_>>()
}

/// EXAONE 4's layers that turn no position: the full ones, where a window is set; none
/// without one.
fn exaone4_unrotated(c: &LlamaConfig) -> Vec<i64> {
    match c.sliding_window {
        Some(_) => (0..c.layers).filter(|&l| c.window(l as usize).is_none()).collect(),
        None => vec![],
    }
}

/// Cohere 2's layers that turn no position: those without a window (every layer where
/// none is set).
fn cohere2_unrotated(c: &LlamaConfig) -> Vec<i64> {
    (0..c.layers).filter(|&l| c.window(l as usize).is_none()).collect()
}

/// Whether `moe` routes as only DeepSeek-V3 and GLM-4.5 can say: sigmoid scores, a choice
/// bias, groups, a routed scale or shared experts without a gate.
fn deepseek_routing(m: &MoeConfig) -> bool {
    m.scoring == Scoring::Sigmoid
        || m.choice_bias
        || m.groups > 1
        || m.routed_scale != 1.0
        || (m.shared_expert_dim.is_some() && !m.shared_gate)
}

/// Whether `m`'s dense layers are the first ones (DeepSeek's `first_k_dense_replace`).
fn dense_layers_lead(m: &MoeConfig) -> bool {
    m.dense_layers.iter().enumerate().all(|(i, &l)| l == i as i64)
}

/// Nemotron-H's modules under a layer's `mixer`, by their first name: attention's, and the
/// Mamba-2 mixer's; the others are the feed-forward's and the experts'.
const NEMOTRON_H_ATTENTION: [&str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];
const NEMOTRON_H_MAMBA: [&str; 7] = ["in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj"];

/// Nemotron-H's names of Strata's embedding and final norm.
const NEMOTRON_H_WHOLE: [(&str, &str); 2] =
    [("model.embed_tokens.weight", "backbone.embeddings.weight"), ("model.norm.weight", "backbone.norm_f.weight")];

/// A Strata parameter's name in Nemotron-H's files: under `backbone.`, each layer's norm
/// `norm` and its one sub-layer (attention, Mamba-2 mixer, feed-forward or experts) `mixer`.
fn nemotron_h_name(name: &str) -> String {
    if let Some((_, hf)) = NEMOTRON_H_WHOLE.iter().find(|(strata, _)| *strata == name) {
        return hf.to_string();
    }
    let Some((layer, rest)) = name.strip_prefix("model.layers.").and_then(|r| r.split_once('.')) else {
        return name.to_string();
    };
    let (module, tail) = rest.split_once('.').unwrap_or((rest, ""));
    let module = match module {
        "input_layernorm" => "norm",
        "self_attn" | "mamba" | "mlp" => "mixer",
        other => other,
    };
    format!("backbone.layers.{layer}.{module}.{tail}")
}

/// The sub-layer a Nemotron-H `mixer` is, by its first module's name.
fn nemotron_h_sub_layer(first: &str) -> &'static str {
    match first {
        _ if NEMOTRON_H_ATTENTION.contains(&first) => "self_attn",
        _ if NEMOTRON_H_MAMBA.contains(&first) => "mamba",
        _ => "mlp",
    }
}

/// The Strata parameter a name of files under `backbone.` (Nemotron-H's and Mamba's; or
/// `model.` as `transformers` holds Nemotron-H's) names: `sub_layer` tells which sub-layer a
/// `mixer` is by its first module's name.
fn strata_name_of_backbone(name: &str, sub_layer: impl Fn(&str) -> &'static str) -> String {
    let Some(bare) = name.strip_prefix("backbone.").or(name.strip_prefix("model.")) else {
        return name.to_string();
    };
    if let Some((strata, _)) = NEMOTRON_H_WHOLE.iter().find(|(_, hf)| hf.strip_prefix("backbone.") == Some(bare)) {
        return strata.to_string();
    }
    let Some((layer, rest)) = bare.strip_prefix("layers.").and_then(|r| r.split_once('.')) else {
        return name.to_string();
    };
    let (module, tail) = rest.split_once('.').unwrap_or((rest, ""));
    let first = tail.split('.').next().unwrap_or_default();
    let module = match module {
        "norm" => "input_layernorm",
        "mixer" => sub_layer(first),
        other => other,
    };
    format!("model.layers.{layer}.{module}.{tail}")
}

/// Whether `c`'s attention is more than grouped heads without biases or norms.
fn beyond_plain_heads(c: &LlamaConfig) -> bool {
    c.qkv_bias
        || c.o_bias
        || c.qk_norm
        || c.clip_qkv.is_some()
        || c.attention_sinks
        || c.attention_output_gate
        || c.value_norm
        || c.full_layer_heads.is_some()
        || c.latent.is_some()
}

/// Whether `c`'s scores are windowed, chunked, soft-capped or scaled otherwise than by
/// `head_dim^-1/2`.
fn beyond_plain_scores(c: &LlamaConfig) -> bool {
    c.sliding_window.is_some()
        || c.attention_chunk.is_some()
        || c.attn_softcap.is_some()
        || c.logit_softcap.is_some()
        || c.query_pre_attn_scalar.is_some()
}

/// What of `c` Nemotron-H's files cannot say, if anything.
fn nemotron_h_cannot_hold(c: &LlamaConfig) -> Option<&'static str> {
    let attending = (0..c.layers).filter(|&l| c.has_mixer(l as usize) && !c.is_linear(l as usize));
    let experts_fit = c.moe.as_ref().is_none_or(|m| {
        m.names == ExpertNames::Mlp
            && m.scoring == Scoring::Sigmoid
            && m.choice_bias
            && m.shared_expert_dim.is_some()
            && !m.shared_gate
            && m.activation == ExpertActivation::UngatedRelu2
            && m.aux_loss_coef == 0.0
            && m.z_loss_coef == 0.0
            && m.norm_topk_epsilon == 1e-20
            && m.sparse_step == 1
            && !(m.router_bias
                || m.expert_bias
                || m.router_norm
                || m.expert_scales
                || m.beside_dense
                || m.scale_inputs
                || m.balance_over_softmax)
    });
    [
        (!c.mixer_alone, "layers of both a mixer and a feed-forward"),
        (c.norm != NormKind::Weighted || c.norm_bias, "norms other than RMS norms"),
        (
            c.activation != Activation::Relu2 || c.fc_names || c.fused_projections || c.fused_gate_up,
            "a feed-forward other than ReLU² without a gate",
        ),
        (beyond_plain_heads(c), "attention other than grouped heads without biases or norms"),
        (
            attending.clone().any(|l| c.rotates(l)) || c.query_scaling.is_some() || c.qk_l2_norm,
            "attention that turns positions",
        ),
        (beyond_plain_scores(c), "windows, chunks, soft-capping or other score scales"),
        (
            c.linear_attention.is_some() || c.short_conv.is_some() || c.selective_scan.is_some() || c.shared_mlp,
            "mixers other than Mamba-2",
        ),
        (
            c.state_space
                .as_ref()
                .is_some_and(|m| m.time_step_max.is_some() || m.gated_norm != GatedNorm::GateThenNorm),
            "a step bounded above, or a mixer normed before its gate or without a norm",
        ),
        ((0..c.layers as usize).any(|l| c.is_hybrid(l)), "Mamba-2 mixers beside attention"),
        (
            c.multipliers.is_some()
                || c.mup.is_some()
                || c.scale_embeddings
                || c.logit_scale.is_some()
                || c.padding_token.is_some(),
            "scaled embeddings or logits, or an untrained padding row",
        ),
        (c.dropout.residual > 0.0 || c.dropout.embedding > 0.0, "dropout other than the attention's"),
        (
            !experts_fit,
            "experts other than its own (sigmoid scores with a choice bias, a shared expert, ReLU² without a \
             gate, no load-balancing loss)",
        ),
    ]
    .into_iter()
    .find_map(|(bad, what)| bad.then_some(what))
}

/// The context Strata gives Mamba's models, which have no limit of their own.
const MAMBA_CONTEXT: i64 = 1 << 20;

/// What of `c` Mamba's or (`falcon`) Falcon Mamba's files cannot say, if anything: every
/// layer a Mamba-1 mixer alone, normed inside as the family norms it.
fn mamba_cannot_hold(c: &LlamaConfig, falcon: bool) -> Option<&'static str> {
    let mixer_fits = c.selective_scan.as_ref().is_some_and(|s| {
        s.inner % c.dim == 0 && s.inner_norms.is_some() == falcon && s.inner_norms.is_none_or(|n| !n.weighted)
    });
    let plain = LlamaConfig {
        vocab: c.vocab,
        ctx: MAMBA_CONTEXT,
        layers: c.layers,
        heads: 1,
        dim: c.dim,
        norm_eps: c.norm_eps,
        tie_embeddings: c.tie_embeddings,
        selective_scan: c.selective_scan.clone(),
        dropout: DropoutRates { attention: c.dropout.attention, ..DropoutRates::NONE },
        head: c.head,
        ..LlamaConfig::new(c.vocab, MAMBA_CONTEXT, c.layers, 1, c.dim)
    };
    [
        (!mixer_fits, "mixers other than Mamba-1's, a whole multiple wide, normed inside as the family norms them"),
        (
            !c.mixer_alone || !(0..c.layers as usize).all(|l| c.is_linear(l)),
            "layers other than a Mamba-1 mixer alone behind its norm",
        ),
        (
            LlamaConfig { mixer_alone: true, layer_types: c.layer_types.clone(), ..plain } != *c,
            "options other than Mamba's (its norms, mixers and head; embeddings that train every row; no \
             attention heads; no context limit)",
        ),
    ]
    .into_iter()
    .find_map(|(bad, what)| bad.then_some(what))
}

/// Mamba's or (`falcon`) Falcon Mamba's `config.json` keys of `c` (checked by
/// [`mamba_cannot_hold`]).
fn mamba_json(c: &LlamaConfig, falcon: bool) -> Value {
    let mut v = json!({
        "vocab_size": c.vocab,
        "hidden_size": c.dim,
        "num_hidden_layers": c.layers,
        "layer_norm_epsilon": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "hidden_act": "silu",
    });
    if let Some(s) = &c.selective_scan {
        v["expand"] = json!(s.inner / c.dim);
        v["state_size"] = json!(s.state);
        v["conv_kernel"] = json!(s.conv_kernel);
        v["time_step_rank"] = json!(s.time_step_rank);
        v["use_conv_bias"] = json!(s.conv_bias);
        v["use_bias"] = json!(s.proj_bias);
        if let Some(n) = s.inner_norms.filter(|_| falcon) {
            v["mixer_rms_eps"] = json!(n.eps);
        }
    }
    v
}

/// The period and offset of the layers `flags` marks (every `period`-th from `offset`), the
/// shortest that gives them; `None` where no period does. None marked is an offset past the
/// last layer.
fn layer_period(flags: &[bool]) -> Option<(i64, i64)> {
    let n = flags.len() as i64;
    (1..=n + 1)
        .flat_map(|p| (0..p).map(move |o| (p, o)))
        .find(|&(p, o)| flags.iter().enumerate().all(|(i, &marked)| (i as i64 % p == o) == marked))
}

/// What of `c` Jamba's files cannot say, if anything: its attention and experts recur with
/// a period, its mixers are Mamba-1's with weighted norms, its experts are Jamba's.
fn jamba_cannot_hold(c: &LlamaConfig) -> Option<&'static str> {
    let attending: Vec<bool> = (0..c.layers as usize).map(|l| !c.is_linear(l)).collect();
    let experts_fit = c.moe.as_ref().is_none_or(|m| {
        let sparse: Vec<bool> = (0..c.layers).map(|l| m.is_sparse(l)).collect();
        MoeConfig {
            dense_layers: m.dense_layers.clone(),
            sparse_step: m.sparse_step,
            aux_loss_coef: m.aux_loss_coef,
            names: ExpertNames::FeedForward,
            ..MoeConfig::new(m.experts, m.top_k, c.hidden())
        } == *m
            && m.experts > 1
            && layer_period(&sparse).is_some()
    });
    let mixer_fits = c
        .selective_scan
        .as_ref()
        .is_some_and(|s| s.inner % c.dim == 0 && s.inner_norms == Some(InnerNorms { eps: c.norm_eps, weighted: true }));
    [
        (!mixer_fits, "mixers other than Mamba-1's with weighted norms at its epsilon, a whole multiple wide"),
        (layer_period(&attending).is_none(), "attention layers other than every period-th from an offset"),
        ((0..c.layers).any(|l| c.rotates(l)), "attention that turns positions"),
        (
            c.norm != NormKind::Weighted
                || c.norm_bias
                || c.activation != Activation::Silu
                || c.mlp_bias
                || c.fc_names
                || c.fused_projections
                || c.fused_gate_up,
            "norms other than RMS norms, or a feed-forward other than SwiGLU without biases",
        ),
        (
            beyond_plain_heads(c) || c.query_scaling.is_some() || c.qk_l2_norm,
            "attention other than grouped heads without biases or norms",
        ),
        (
            beyond_plain_scores(c)
                || c.sandwich_norms
                || c.post_norms
                || c.parallel_block
                || c.mixer_alone
                || c.layer_types
                    .as_ref()
                    .is_some_and(|t| t.iter().any(|k| !matches!(k, LayerAttention::Full | LayerAttention::Linear))),
            "windows, chunks, soft-capping, other score scales or other blocks",
        ),
        (
            c.multipliers.is_some() || c.mup.is_some() || c.scale_embeddings || c.logit_scale.is_some(),
            "scaled embeddings or logits",
        ),
        (c.layer_scalar, "block scalars"),
        (
            c.linear_attention.is_some() || c.state_space.is_some() || c.short_conv.is_some() || c.shared_mlp,
            "mixers other than Mamba-1's",
        ),
        (c.dropout.residual > 0.0 || c.dropout.embedding > 0.0, "dropout other than the attention's"),
        (
            !experts_fit,
            "experts other than its own (softmax scores weighting unrenormalised, as wide as the dense \
             feed-forward, on every period-th layer, no shared expert)",
        ),
    ]
    .into_iter()
    .find_map(|(bad, what)| bad.then_some(what))
}

/// Jamba's own `config.json` keys of `c` (checked by [`jamba_cannot_hold`]): its layers'
/// periods and its mixers' sizes, in place of the rotation and biases it has no keys for.
fn jamba_json(c: &LlamaConfig, v: &mut Value) {
    let attending: Vec<bool> = (0..c.layers as usize).map(|l| !c.is_linear(l)).collect();
    let (period, offset) = layer_period(&attending).unwrap_or((1, 0));
    v["attn_layer_period"] = json!(period);
    v["attn_layer_offset"] = json!(offset);
    if c.moe.is_none() {
        v["num_experts"] = json!(1);
    }
    if let Some(s) = &c.selective_scan {
        v["mamba_expand"] = json!(s.inner / c.dim);
        v["mamba_d_state"] = json!(s.state);
        v["mamba_d_conv"] = json!(s.conv_kernel);
        v["mamba_dt_rank"] = json!(s.time_step_rank);
        v["mamba_conv_bias"] = json!(s.conv_bias);
        v["mamba_proj_bias"] = json!(s.proj_bias);
    }
    if let Some(keys) = v.as_object_mut() {
        for key in ["rope_parameters", "attention_bias", "mlp_bias"] {
            keys.remove(key);
        }
    }
}

/// Nemotron-H's `config.json` keys of `c` (checked by [`nemotron_h_cannot_hold`]).
fn nemotron_h_json(c: &LlamaConfig) -> Value {
    let kinds: Vec<&str> = (0..c.layers as usize)
        .map(|l| match () {
            _ if c.is_linear(l) => "linear_attention",
            _ if c.has_mixer(l) => "full_attention",
            _ if c.moe.as_ref().is_some_and(|m| m.is_sparse(l as i64)) => "moe",
            _ => "mlp",
        })
        .collect();
    let mut v = json!({
        "vocab_size": c.vocab,
        "hidden_size": c.dim,
        "layers_block_type": kinds,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.key_value_heads(),
        "head_dim": c.head_width(),
        "max_position_embeddings": c.ctx,
        "intermediate_size": c.hidden(),
        "mlp_hidden_act": "relu2",
        "mlp_bias": c.mlp_bias,
        "layer_norm_epsilon": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": c.dropout.attention,
    });
    if let Some(m) = &c.state_space {
        v["mamba_num_heads"] = json!(m.heads);
        v["mamba_head_dim"] = json!(m.head_dim);
        v["n_groups"] = json!(m.groups);
        v["ssm_state_size"] = json!(m.state);
        v["conv_kernel"] = json!(m.conv_kernel);
        v["chunk_size"] = json!(m.chunk);
        v["use_conv_bias"] = json!(m.conv_bias);
        v["use_bias"] = json!(m.proj_bias);
        v["time_step_min"] = json!(m.time_step_min);
    }
    if let Some(m) = &c.moe {
        v["n_routed_experts"] = json!(m.experts);
        v["num_experts_per_tok"] = json!(m.top_k);
        v["moe_intermediate_size"] = json!(m.expert_ffn_dim);
        v["moe_shared_expert_intermediate_size"] = json!(m.shared_expert_dim);
        v["n_shared_experts"] = json!(1);
        v["routed_scaling_factor"] = json!(m.routed_scale);
        v["n_group"] = json!(m.groups);
        v["topk_group"] = json!(m.top_groups);
        v["norm_topk_prob"] = json!(m.norm_topk);
        v["moe_latent_size"] = json!(m.latent_dim);
    }
    v
}

/// `config.json` keys of a decoder written as `family` (checked by [`Family::cannot_write`]).
fn decoder_json(family: Family, c: &LlamaConfig) -> Value {
    match family {
        Family::NemotronH => return nemotron_h_json(c),
        Family::Mamba | Family::FalconMamba => return mamba_json(c, family == Family::FalconMamba),
        _ => {}
    }
    // Dynamic scaling reads the context it was trained at from max_position_embeddings.
    let max_positions = match c.rope_scaling {
        RopeScaling::Dynamic { original_context, .. } => original_context,
        _ => c.ctx,
    };
    let mut v = json!({
        "hidden_size": c.dim,
        "intermediate_size": c.hidden(),
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.key_value_heads(),
        "head_dim": c.head_width(),
        "max_position_embeddings": max_positions,
        "vocab_size": c.vocab,
        family.norm_eps_key(): c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": c.dropout.attention,
    });
    let rope = |r: &Rope| {
        let mut p = json!({"rope_theta": r.theta});
        let extra = match &r.scaling {
            // Validated: a proportional rotation's scaling is linear or none.
            _ if r.proportional => {
                let factor = match r.scaling {
                    RopeScaling::Linear { factor } => factor,
                    _ => 1.0,
                };
                json!({"rope_type": "proportional", "factor": factor, "partial_rotary_factor": r.partial})
            }
            RopeScaling::None => json!({"rope_type": "default"}),
            RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Dynamic { factor, .. } => json!({"rope_type": "dynamic", "factor": factor}),
            // HunYuan's class reads a dynamic rotation with an alpha as its fixed stretch.
            RopeScaling::NtkAlpha { alpha } => json!({"rope_type": "dynamic", "alpha": alpha, "factor": 1.0}),
            RopeScaling::LongRope { short, long, original_context, attention_factor } => json!({
                "rope_type": "longrope", "short_factor": short, "long_factor": long,
                "original_max_position_embeddings": original_context, "attention_factor": attention_factor,
            }),
            RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, attention_factor, truncate } => json!({
                "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original_context,
                "beta_fast": beta_fast, "beta_slow": beta_slow, "attention_factor": attention_factor, "truncate": truncate,
            }),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_context } => json!({
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor, "original_max_position_embeddings": original_context,
            }),
        };
        for (key, value) in extra.as_object().into_iter().flatten() {
            p[key] = value.clone();
        }
        // GLM-4.5 and Nemotron turn half of each head where their keys say nothing.
        if r.partial != 1.0
            || matches!(family, Family::Glm4Moe | Family::Glm4 | Family::Nemotron)
            || family.linear_attention_family()
        {
            p["partial_rotary_factor"] = json!(r.partial);
        }
        if let Some(latent) = c.latent.as_ref().filter(|l| l.mscale_all_dim > 0.0) {
            p["mscale_all_dim"] = json!(latent.mscale_all_dim);
        }
        // Mistral's query scaling lives in its rotation's keys (Llama 4's has keys of its own).
        if let Some(q) = c.query_scaling.filter(|_| family != Family::Llama4) {
            p["llama_4_scaling_beta"] = json!(q.beta);
            p["original_max_position_embeddings"] = json!(q.every);
        }
        p
    };
    v["rope_parameters"] = match (&c.local_rope, family) {
        (Some(local), Family::Gemma3) => json!({"full_attention": rope(&c.rope()), "sliding_attention": rope(local)}),
        (local, Family::Gemma4) => json!({
            "full_attention": rope(&c.rope()),
            "sliding_attention": rope(local.as_ref().unwrap_or(&c.rope())),
        }),
        // OLMo 3 names a rotation for each kind of layer, the same one where it has one.
        (local, Family::Olmo3) => json!({
            "full_attention": rope(&c.rope()),
            "sliding_attention": rope(local.as_ref().unwrap_or(&c.rope())),
        }),
        // OLMo Hybrid's attention turns no position where its base is null.
        (_, Family::OlmoHybrid) if !c.unrotated_layers.is_empty() => {
            json!({"rope_type": "default", "rope_theta": null})
        }
        _ => rope(&c.rope()),
    };
    let layer_types: Vec<&str> = (0..c.layers as usize)
        .map(|i| if c.window(i).is_some() { "sliding_attention" } else { "full_attention" })
        .collect();
    let sliding = layer_types.contains(&"sliding_attention");
    let window = if sliding { json!(c.sliding_window) } else { Value::Null };
    match family.dense() {
        Family::Qwen2 | Family::Qwen2_5Vl | Family::Qwen3 => {
            // Qwen slides the layers from max_window_layers on.
            let first = layer_types.iter().position(|t| *t == "sliding_attention").unwrap_or(layer_types.len());
            v["use_sliding_window"] = json!(sliding);
            v["sliding_window"] = window;
            v["max_window_layers"] = json!(first);
            v["layer_types"] = json!(layer_types);
            if family.dense() == Family::Qwen3 {
                v["attention_bias"] = json!(c.qkv_bias);
            }
        }
        Family::Gemma4 => {
            v["hidden_activation"] = json!("gelu_pytorch_tanh");
            v["final_logit_softcapping"] = json!(c.logit_softcap);
            v["sliding_window"] = json!(c.sliding_window.unwrap_or(512));
            v["layer_types"] = json!(layer_types);
            v["attention_bias"] = json!(c.qkv_bias);
            // The global layers' heads: the class reads the same heads where they are given
            // as the others'.
            let full = c.full_layer_heads.unwrap_or(FullLayerHeads {
                head_dim: c.head_width(),
                kv_heads: None,
                values_from_keys: false,
            });
            v["global_head_dim"] = json!(full.head_dim);
            v["attention_k_eq_v"] = json!(full.values_from_keys);
            v["num_global_key_value_heads"] = json!(full.kv_heads.filter(|_| full.values_from_keys));
            // What Strata's Gemma 4 does not hold: per-layer embeddings, key/value sharing
            // and the experts' block.
            v["hidden_size_per_layer_input"] = json!(0);
            v["num_kv_shared_layers"] = json!(0);
            v["enable_moe_block"] = json!(c.moe.is_some());
        }
        Family::Gemma2 | Family::Gemma3 => {
            v["hidden_activation"] = json!("gelu_pytorch_tanh");
            // An integer in transformers' config class.
            let scalar = c.query_pre_attn_scalar.unwrap_or(c.head_width() as f64);
            v["query_pre_attn_scalar"] = if scalar.fract() == 0.0 { json!(scalar as i64) } else { json!(scalar) };
            v["attn_logit_softcapping"] = json!(c.attn_softcap);
            v["final_logit_softcapping"] = json!(c.logit_softcap);
            v["sliding_window"] = window;
            v["layer_types"] = json!(layer_types);
            v["attention_bias"] = json!(c.qkv_bias);
        }
        Family::Mistral | Family::Ministral3 => v["sliding_window"] = window,
        Family::SmolLm3 => {
            v["no_rope_layers"] = json!((0..c.layers).map(|i| i64::from(c.rotates(i))).collect::<Vec<_>>());
            v["use_sliding_window"] = json!(sliding);
            v["sliding_window"] = window;
            v["layer_types"] = json!(layer_types);
            v["attention_bias"] = json!(c.qkv_bias);
            v["mlp_bias"] = json!(c.mlp_bias);
        }
        Family::Exaone4 => {
            // Its full layers turn no position wherever a window is set, sliding layers or not.
            v["sliding_window"] = json!(c.sliding_window);
            v["layer_types"] = json!(layer_types);
        }
        Family::Granite => {
            let m = c.multipliers.unwrap_or(Multipliers { embeddings: 1.0, residual: 1.0, scores: 1.0, logits: 1.0 });
            v["embedding_multiplier"] = json!(m.embeddings);
            v["residual_multiplier"] = json!(m.residual);
            v["attention_multiplier"] = json!(m.scores);
            v["logits_scaling"] = json!(m.logits);
            v["attention_bias"] = json!(c.o_bias || c.qkv_bias);
            v["mlp_bias"] = json!(c.mlp_bias);
        }
        // Its use_bias would put biases on the feed-forward too, which Strata's decoder has not.
        Family::Ernie4_5 => v["use_bias"] = json!(false),
        // The mixtures of experts write their own keys below.
        Family::SeedOss => {
            v["attention_bias"] = json!(c.qkv_bias);
            v["attention_out_bias"] = json!(c.o_bias);
            v["residual_dropout"] = json!(c.dropout.residual);
            v["mlp_bias"] = json!(c.mlp_bias);
        }
        Family::Starcoder2 => {
            v["use_bias"] = json!(c.mlp_bias);
            v["sliding_window"] = window;
            v["residual_dropout"] = json!(c.dropout.residual);
            v["embedding_dropout"] = json!(c.dropout.embedding);
        }
        Family::Olmo3 => {
            // An integer in transformers' config class, read by sliding layers alone.
            v["sliding_window"] = json!(c.sliding_window.unwrap_or(4096));
            v["layer_types"] = json!(layer_types);
            v["attention_bias"] = json!(c.qkv_bias);
        }
        Family::Phi3 => {
            v["sliding_window"] = window;
            v["resid_pdrop"] = json!(c.dropout.residual);
        }
        // Its class has no mlp_bias.
        Family::OlmoHybrid => v["attention_bias"] = json!(c.qkv_bias),
        // GPT-2, BERT and T5 never reach here (`Family::config_json`); the mixtures of
        // experts are their dense families here.
        _ => {
            v["attention_bias"] = json!(c.o_bias || c.qkv_bias);
            v["mlp_bias"] = json!(c.mlp_bias);
        }
    }
    if family == Family::Glm4Moe {
        v["use_qk_norm"] = json!(c.qk_norm);
    }
    if family == Family::GptOss {
        v["sliding_window"] = json!(c.sliding_window.filter(|_| sliding));
        v["layer_types"] = json!(layer_types);
    }
    if family.is_cohere() {
        v["logit_scale"] = json!(c.logit_scale.unwrap_or(1.0));
    }
    match family {
        Family::Cohere => v["use_qk_norm"] = json!(false),
        Family::Cohere2 => {
            v["sliding_window"] = json!(c.sliding_window);
            v["layer_types"] = json!(layer_types);
        }
        _ => {}
    }
    if family == Family::Llama4 {
        let chunked: Vec<&str> = (0..c.layers as usize)
            .map(|i| if c.chunk(i).is_some() { "chunked_attention" } else { "full_attention" })
            .collect();
        v["layer_types"] = json!(chunked);
        v["attention_chunk_size"] = json!(c.attention_chunk);
        v["no_rope_layers"] = json!((0..c.layers).map(|i| i64::from(c.rotates(i))).collect::<Vec<_>>());
        v["use_qk_norm"] = json!(c.qk_l2_norm);
        v["attn_temperature_tuning"] = json!(c.query_scaling.is_some());
        if let Some(q) = c.query_scaling {
            v["attn_scale"] = json!(q.beta);
            v["floor_scale"] = json!(q.every);
        }
        v["intermediate_size_mlp"] = json!(c.hidden());
    }
    if let Some(l) = &c.linear_attention {
        let types: Vec<&str> = (0..c.layers as usize)
            .map(|i| if c.is_linear(i) { "linear_attention" } else { "full_attention" })
            .collect();
        v["layer_types"] = json!(types);
        v["linear_num_key_heads"] = json!(l.key_heads);
        v["linear_num_value_heads"] = json!(l.value_heads);
        v["linear_key_head_dim"] = json!(l.key_dim);
        v["linear_value_head_dim"] = json!(l.value_dim);
        v["linear_conv_kernel_dim"] = json!(l.conv_kernel);
        if family == Family::OlmoHybrid {
            v["linear_allow_neg_eigval"] = json!(l.doubled_beta);
        }
    }
    if let Some(conv) = &c.short_conv {
        let types: Vec<&str> =
            (0..c.layers as usize).map(|i| if c.is_linear(i) { "conv" } else { "full_attention" }).collect();
        v["layer_types"] = json!(types);
        v["conv_L_cache"] = json!(conv.kernel);
        v["conv_bias"] = json!(conv.bias);
        // The width as it is, not adjusted by the class.
        v["block_auto_adjust_ff_dim"] = json!(false);
    }
    if family == Family::GraniteMoeHybrid {
        // The names Granite 4's releases use, which every version of its class reads.
        let types: Vec<&str> =
            (0..c.layers as usize).map(|i| if c.is_linear(i) { "mamba" } else { "attention" }).collect();
        v["layer_types"] = json!(types);
        // Sizes its class checks even where no layer is a Mamba-2 mixer (Granite 4 Micro's).
        v["mamba_n_heads"] = json!(1);
        v["mamba_expand"] = json!(1);
        v["mamba_d_head"] = json!(c.dim);
        v["position_embedding_type"] = json!(if c.unrotated_layers.is_empty() { "rope" } else { "nope" });
        v["shared_intermediate_size"] = json!(c.hidden());
        // Without experts, none; with them, `experts_json` below names them.
        v["num_local_experts"] = json!(0);
    }
    if family == Family::Bamba {
        let attending: Vec<i64> = (0..c.layers).filter(|&i| !c.is_linear(i as usize)).collect();
        v["attn_layer_indices"] = json!(attending);
    }
    if let Some(m) = &c.state_space {
        match family {
            Family::FalconH1 => {
                v["mamba_d_ssm"] = json!(m.inner());
                v["mamba_rms_norm"] = json!(m.gated_norm != GatedNorm::GateAlone);
                v["mamba_norm_before_gate"] = json!(m.gated_norm == GatedNorm::NormThenGate);
                v["projectors_bias"] = json!(m.proj_bias);
            }
            // A whole multiple ([`Family::cannot_write`]).
            _ => v["mamba_expand"] = json!(m.inner() / c.dim),
        }
        v["mamba_n_heads"] = json!(m.heads);
        v["mamba_d_head"] = json!(m.head_dim);
        v["mamba_n_groups"] = json!(m.groups);
        v["mamba_d_state"] = json!(m.state);
        v["mamba_d_conv"] = json!(m.conv_kernel);
        v["mamba_chunk_size"] = json!(m.chunk);
        v["mamba_conv_bias"] = json!(m.conv_bias);
        v["mamba_proj_bias"] = json!(m.proj_bias);
        // The class's default (0, infinity) left out; an unbounded step otherwise as
        // `transformers` 5 tags infinity, which JSON has no number for.
        if m.time_step_min != 0.0 || m.time_step_max.is_some() {
            let max = m.time_step_max.map_or(json!({"__float__": PYTHON_INFINITY}), |max| json!(max));
            v["time_step_limit"] = json!([m.time_step_min, max]);
        }
    }
    if let Some(m) = &c.mup {
        v["embedding_multiplier"] = json!(m.embeddings);
        v["lm_head_multiplier"] = json!(m.logits);
        v["key_multiplier"] = json!(m.keys);
        v["attention_in_multiplier"] = json!(m.attention_in);
        v["attention_out_multiplier"] = json!(m.attention_out);
        v["ssm_in_multiplier"] = json!(m.recurrent_in);
        v["ssm_out_multiplier"] = json!(m.recurrent_out);
        v["ssm_multipliers"] = json!(m.recurrent_projection);
        v["mlp_multipliers"] = json!([m.gate, m.down]);
    }
    if let Some(l) = &c.latent {
        v["q_lora_rank"] = json!(l.q_rank);
        v["kv_lora_rank"] = json!(l.kv_rank);
        v["qk_nope_head_dim"] = json!(l.nope_dim);
        v["qk_rope_head_dim"] = json!(l.rope_dim);
        v["v_head_dim"] = json!(l.value_dim);
        v["rope_interleave"] = json!(l.interleaved);
        // transformers gives DeepSeek's heads the rotated width as head_dim, Mistral 4's their
        // whole query width.
        v["head_dim"] = json!(if family == Family::Mistral4 { l.query_dim() } else { l.rope_dim });
        v["num_key_value_heads"] = json!(c.heads);
    }
    if let Some(moe) = &c.moe {
        experts_json(family, c, moe, &mut v);
    }
    if family == Family::Jamba {
        jamba_json(c, &mut v);
    }
    // Keys Solar Open's class does not have.
    if let (Family::SolarOpen, Some(keys)) = (family, v.as_object_mut()) {
        keys.remove("intermediate_size");
        keys.remove("first_k_dense_replace");
    }
    match c.activation {
        Activation::Silu => v["hidden_act"] = json!("silu"),
        Activation::Relu2 => v["hidden_act"] = json!("relu2"),
        Activation::UngatedGeluTanh => v["hidden_act"] = json!("gelu_pytorch_tanh"),
        Activation::Xielu => v["hidden_act"] = json!("xielu"),
        // Gemma's classes name it hidden_activation, written with their keys.
        Activation::GeluTanh => {}
    }
    // Null where the model has none: a missing key would give the class's default padding
    // row (Gemma's, Jamba's, Cohere's ...), which `transformers` would leave untrained.
    v["pad_token_id"] = json!(c.padding_token);
    v
}

/// The `config.json` keys of a mixture of experts written as `family`.
fn experts_json(family: Family, c: &LlamaConfig, moe: &MoeConfig, v: &mut Value) {
    if family == Family::Ernie4_5Moe {
        let sparse: Vec<i64> = (0..c.layers).filter(|&l| moe.is_sparse(l)).collect();
        v["moe_num_experts"] = json!(moe.experts);
        v["moe_k"] = json!(moe.top_k);
        v["moe_intermediate_size"] = json!(moe.expert_ffn_dim);
        v["moe_num_shared_experts"] =
            json!(moe.shared_expert_dim.map_or(0, |w| w.checked_div(moe.expert_ffn_dim).unwrap_or(0)));
        v["moe_layer_start_index"] = json!(sparse.first().copied().unwrap_or(c.layers));
        v["moe_layer_end_index"] = json!(sparse.last().copied().unwrap_or(-1));
        v["moe_layer_interval"] = json!(moe.sparse_step);
        v["router_aux_loss_coef"] = json!(moe.aux_loss_coef);
        return;
    }
    // Llama 4's class names the sparse layers, its experts and shared expert as wide as its
    // intermediate_size, and has no load-balancing loss: its router_aux_loss_coef (0.001 by
    // default) is read by nothing, so Strata neither reads nor writes one.
    if family == Family::Llama4 {
        v["num_local_experts"] = json!(moe.experts);
        v["num_experts_per_tok"] = json!(moe.top_k);
        v["intermediate_size"] = json!(moe.expert_ffn_dim);
        v["moe_layers"] = json!((0..c.layers).filter(|&l| moe.is_sparse(l)).collect::<Vec<_>>());
        return;
    }
    // HunYuan-MoE's and Gemma 4's classes name their own keys (HunYuan-MoE's experts and
    // shared expert as wide as its intermediate_size), and have no load-balancing loss (a
    // weight Strata trains with is kept where set).
    let own_keys = match family {
        Family::HunYuanMoe => Some(("num_experts", "moe_topk", "intermediate_size")),
        Family::Gemma4 => Some(("num_experts", "top_k_experts", "moe_intermediate_size")),
        _ => None,
    };
    if let Some((count, top_k, width)) = own_keys {
        v[count] = json!(moe.experts);
        v[top_k] = json!(moe.top_k);
        v[width] = json!(moe.expert_ffn_dim);
        if moe.aux_loss_coef != 0.0 {
            v["router_aux_loss_coef"] = json!(moe.aux_loss_coef);
        }
        return;
    }
    v["num_experts_per_tok"] = json!(moe.top_k);
    // DeepSeek-V3's and GLM-4.5's classes train with no load-balancing loss: the key is
    // theirs only where one is set.
    if moe.aux_loss_coef != 0.0 || !(family.routes_like_deepseek() || family == Family::Lfm2Moe) {
        v["router_aux_loss_coef"] = json!(moe.aux_loss_coef);
    }
    match family {
        family if family.routes_like_deepseek() => {
            v["n_routed_experts"] = json!(moe.experts);
            v["moe_intermediate_size"] = json!(moe.expert_ffn_dim);
            v["n_shared_experts"] = json!(moe.shared_expert_dim.map_or(0, |w| w / moe.expert_ffn_dim));
            v["routed_scaling_factor"] = json!(moe.routed_scale);
            v["n_group"] = json!(moe.groups);
            v["topk_group"] = json!(moe.top_groups);
            v["norm_topk_prob"] = json!(moe.norm_topk);
            if family == Family::DeepseekV2 && moe.groups > 1 {
                v["topk_method"] = json!("group_limited_greedy");
            }
            if family == Family::Glm4MoeLite {
                let kinds: Vec<&str> =
                    (0..c.layers).map(|l| if moe.is_sparse(l) { "sparse" } else { "dense" }).collect();
                v["mlp_layer_types"] = json!(kinds);
            } else {
                v["first_k_dense_replace"] = json!(moe.dense_layers.len());
            }
        }
        // Qwen3.5's experts route every layer, their weights renormalised.
        Family::Qwen3_5Moe => {
            v["num_experts"] = json!(moe.experts);
            v["moe_intermediate_size"] = json!(moe.expert_ffn_dim);
            v["shared_expert_intermediate_size"] = json!(moe.shared_expert_dim.unwrap_or(0));
        }
        // Mixtral's, Granite-MoE's and OLMoE's experts are intermediate_size wide, and every
        // layer is sparse.
        Family::Mixtral | Family::MiniMaxM2 => {
            v["num_local_experts"] = json!(moe.experts);
            v["intermediate_size"] = json!(moe.expert_ffn_dim);
            v["router_jitter_noise"] = json!(0.0);
        }
        Family::GraniteMoe | Family::GraniteMoeHybrid => {
            v["num_local_experts"] = json!(moe.experts);
            v["intermediate_size"] = json!(moe.expert_ffn_dim);
        }
        // Checked by [`jamba_cannot_hold`]: its sparse layers recur with a period.
        Family::Jamba => {
            v["num_experts"] = json!(moe.experts);
            let sparse: Vec<bool> = (0..c.layers).map(|l| moe.is_sparse(l)).collect();
            let (period, offset) = layer_period(&sparse).unwrap_or((1, 0));
            v["expert_layer_period"] = json!(period);
            v["expert_layer_offset"] = json!(offset);
        }
        Family::Lfm2Moe => {
            v["num_experts"] = json!(moe.experts);
            v["moe_intermediate_size"] = json!(moe.expert_ffn_dim);
            v["num_dense_layers"] = json!(moe.dense_layers.len());
            v["use_expert_bias"] = json!(moe.choice_bias);
            v["routed_scaling_factor"] = json!(moe.routed_scale);
            v["norm_topk_prob"] = json!(moe.norm_topk);
        }
        Family::GptOss => {
            v["num_local_experts"] = json!(moe.experts);
            v["intermediate_size"] = json!(moe.expert_ffn_dim);
            if let ExpertActivation::ClampedSwiglu { alpha, limit } = moe.activation {
                v["swiglu_alpha"] = json!(alpha);
                v["swiglu_limit"] = json!(limit);
            }
        }
        Family::Olmoe | Family::FlexOlmo => {
            v["num_experts"] = json!(moe.experts);
            v["intermediate_size"] = json!(moe.expert_ffn_dim);
            v["norm_topk_prob"] = json!(moe.norm_topk);
            if family == Family::Olmoe {
                v["clip_qkv"] = json!(c.clip_qkv);
            }
            v["attention_bias"] = json!(c.qkv_bias);
        }
        _ => {
            v["num_experts"] = json!(moe.experts);
            v["moe_intermediate_size"] = json!(moe.expert_ffn_dim);
            if family != Family::Qwen3VlMoe {
                v["norm_topk_prob"] = json!(moe.norm_topk);
            }
            v["decoder_sparse_step"] = json!(moe.sparse_step);
            v["mlp_only_layers"] = json!(moe.dense_layers);
            if family == Family::Qwen2Moe {
                v["qkv_bias"] = json!(c.qkv_bias);
            }
            if matches!(family, Family::Qwen2Moe | Family::Qwen3Next) {
                v["shared_expert_intermediate_size"] = json!(moe.shared_expert_dim.unwrap_or(0));
            }
        }
    }
}

/// A Hugging Face model folder, read: the model it describes and where its files are.
#[derive(Clone, Debug)]
pub struct ModelDir {
    /// The folder's path.
    pub dir: PathBuf,
    /// The family the folder's `model_type` names.
    pub family: Family,
    /// The model `config.json` describes, as a built-in model's configuration.
    pub config: ModelConfig,
    /// The safetensors files holding the weights, in the index's order of first use.
    pub weights: Vec<PathBuf>,
    /// The folder's `tokenizer.json`, if it has one.
    pub tokenizer: Option<PathBuf>,
    /// `bos_token_id`, `eos_token_id` and `pad_token_id` as the config gives them.
    pub special_tokens: Map<String, Value>,
    /// A release's whole `config.json`, where the folder holds an image model beside the
    /// language model read (Gemma 3's, Mistral 3's, Qwen3.5's): a folder written back keeps
    /// both.
    pub release: Option<Map<String, Value>>,
    /// How the folder's weights are quantized, where they are (read back into floats).
    pub quantization: Option<Quantization>,
}

impl ModelDir {
    /// Whether the folder's tensor `name` belongs to the multi-token prediction its family's
    /// released folders store beside the model, which `transformers` does not load and
    /// Strata does not train: DeepSeek-V3's, GLM-4.5's, GLM-4.7-Flash's and MiniMax-M2's layers
    /// past the last
    /// (`model.layers.{num_hidden_layers}` and on), ERNIE 4.5's `mtp` tensors.
    pub fn is_multi_token_prediction(&self, name: &str) -> bool {
        let ModelConfig::Llama(c) = &self.config else { return false };
        match self.family {
            Family::DeepseekV3 | Family::Glm4MoeLite | Family::Glm4Moe | Family::MiniMaxM2 => name
                .strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next()?.parse::<i64>().ok())
                .is_some_and(|layer| layer >= c.layers),
            Family::Ernie4_5Moe => name.contains("mtp"),
            _ => false,
        }
    }

    /// The model function of the folder's model.
    pub fn build(&self, b: &mut super::Builder) -> Result<()> {
        self.config.build(b)
    }

    /// The whole description of the folder's model (units and parameters), without weights.
    pub fn spec(&self) -> Result<ModelSpec> {
        self.config.spec()
    }

    /// The token ids that end a generated text (`eos_token_id`: one id or a list), as
    /// `generate` reads them: `generation_config.json`'s where it names some, else
    /// `config.json`'s.
    pub fn eos_tokens(&self) -> Result<Vec<i64>> {
        let ids = |v: Option<&Value>| match v {
            Some(Value::Number(n)) => n.as_i64().into_iter().collect(),
            Some(Value::Array(ids)) => ids.iter().filter_map(Value::as_i64).collect(),
            _ => vec![],
        };
        Ok(match ids(self.generation_defaults()?.eos_token_id.as_ref()) {
            given if !given.is_empty() => given,
            _ => ids(self.special_tokens.get("eos_token_id")),
        })
    }

    /// What the folder's `generation_config.json` asks of decoding (empty without one).
    pub fn generation_defaults(&self) -> Result<GenerationDefaults> {
        let path = self.dir.join(GENERATION_CONFIG);
        if !path.is_file() {
            return Ok(GenerationDefaults::default());
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        serde_json::from_str(&text)
            .map_err(|e| Error::Weights { path, message: format!("not a generation configuration: {e}") })
    }
}

/// The file of a model folder holding its decoding defaults.
const GENERATION_CONFIG: &str = "generation_config.json";

/// Decoding defaults a model folder's `generation_config.json` gives, as `transformers`'
/// `generate` takes them where its caller does not say; each field absent (or null) where
/// the file leaves it out.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
pub struct GenerationDefaults {
    /// Whether to sample rather than take the most likely token.
    pub do_sample: Option<bool>,
    /// The sampling temperature.
    pub temperature: Option<f64>,
    /// Sample among the k most likely tokens (0: all).
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities reach p together.
    pub top_p: Option<f64>,
    /// Sample among the tokens at least this fraction as likely as the most likely.
    pub min_p: Option<f64>,
    /// The repetition penalty (1: none).
    pub repetition_penalty: Option<f64>,
    /// The most tokens generated.
    pub max_new_tokens: Option<usize>,
    /// The most tokens of the prompt with what is generated.
    pub max_length: Option<usize>,
    /// The tokens that end a text: one id or a list.
    pub eos_token_id: Option<Value>,
}

/// How a folder's weights are quantized, as its `config.json`'s `quantization_config` says:
/// they are read back into the floats they encode (exactly, in fp32), and a folder written
/// holds floats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Quantization {
    /// gpt-oss's MXFP4 expert stacks (`quant_method: "mxfp4"`).
    Mxfp4,
    /// Fine-grained fp8 (`quant_method: "fp8"`), as DeepSeek-V3's, Qwen3's, MiniMax-M2's and
    /// GLM's fp8 releases hold it: E4M3 weights, each beside its `weight_scale_inv`, one
    /// scale per tile of `block` (rows, columns; `weight_block_size`, 128 × 128 where left
    /// out); `None` where it is null (the tiles are what the scales divide evenly).
    Fp8 {
        /// The tile one scale restores.
        block: Option<[i64; 2]>,
    },
}

impl Quantization {
    /// The quantization `cfg`'s `quantization_config` names; `None` for floats. A scheme
    /// Strata does not read is refused by name.
    pub(crate) fn of(cfg: &Map<String, Value>) -> KeyResult<Option<Quantization>> {
        let Some(q) = cfg.get("quantization_config").filter(|q| !q.is_null()) else { return Ok(None) };
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unnamed");
        let block = match q.get("weight_block_size") {
            None => Some([128, 128]),
            Some(Value::Null) => None,
            Some(b) => match b.as_array().map(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<_>>>()) {
                Some(Some(v)) if v.len() == 2 && v.iter().all(|&n| n > 0) => Some([v[0], v[1]]),
                _ => return Err(format!("config.json: weight_block_size {b} is not two positive sizes")),
            },
        };
        match method {
            "mxfp4" => Ok(Some(Quantization::Mxfp4)),
            "fp8" => Ok(Some(Quantization::Fp8 { block })),
            other => Err(format!(
                "config.json: quantized weights ({other}) are not read; give a folder of floating-point or fine-grained fp8 weights"
            )),
        }
    }
}

/// Reads the Hugging Face model folder `dir`: its `config.json`, the weight files it holds
/// (checked to exist) and its tokenizer. Architectures and config keys Strata cannot
/// honour are refused by name.
pub fn from_pretrained_dir(dir: &Path) -> Result<ModelDir> {
    let (family, config, raw, outer) = read_config(&dir.join("config.json"))?;
    let special_tokens = TOKEN_KEYS.iter().filter_map(|&k| Some((k.to_string(), raw.get(k)?.clone()))).collect();
    let tokenizer = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());
    let release = Some(outer).filter(|o| release_of(o).is_some());
    let weights = weight_files(dir)?;
    let quantization = Quantization::of(&raw).map_err(|message| Error::Weights { path: dir.to_path_buf(), message })?;
    Ok(ModelDir { dir: dir.to_path_buf(), family, config, weights, tokenizer, special_tokens, release, quantization })
}

/// The model a Hugging Face `config.json` describes (`path` is the file or its folder),
/// without weights: what estimates and plans need.
pub fn config_of(path: &Path) -> Result<ModelConfig> {
    if !path.exists() {
        return Err(Error::Weights { path: path.to_path_buf(), message: "no such folder or file".into() });
    }
    let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    Ok(read_config(&file)?.1)
}

/// A `config.json`'s family, model and its language model's keys, checked, and the file's
/// own keys.
type ReadConfig = (Family, ModelConfig, Map<String, Value>, Map<String, Value>);

/// How Python's `json` writes an infinite float (Granite 4's `time_step_limit`).
const PYTHON_INFINITY: &str = "Infinity";

/// `text` with the words Python's `json` writes for numbers JSON has none for
/// (`Infinity`, `-Infinity`, `NaN`) quoted as strings, so that the keys that take them
/// read them, where serde_json would refuse the whole file.
fn quote_python_numbers(text: &str) -> std::borrow::Cow<'_, str> {
    const WORDS: [&str; 3] = ["-Infinity", "Infinity", "NaN"];
    if !WORDS.iter().any(|w| text.contains(w)) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if !in_string {
            if let Some(word) = WORDS.iter().find(|w| rest.starts_with(**w)) {
                out.push_str(&format!("\"{word}\""));
                rest = &rest[word.len()..];
                continue;
            }
        }
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            _ => {}
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out.into()
}

/// A `config.json`'s family, model and keys ([`ReadConfig`]), checked.
fn read_config(config_path: &Path) -> Result<ReadConfig> {
    let dir = config_path.parent().unwrap_or(Path::new("."));
    let fail = |message: String| Error::Weights { path: dir.to_path_buf(), message };
    if !config_path.is_file() {
        return Err(fail("no config.json: not a model folder".into()));
    }
    let text = std::fs::read_to_string(config_path).map_err(|e| Error::io(config_path, e))?;
    let raw: Value = serde_json::from_str(&quote_python_numbers(&text))
        .map_err(|e| fail(format!("config.json is not valid JSON ({e})")))?;
    let cfg = raw.as_object().ok_or_else(|| fail("config.json is not a JSON object".into()))?;
    let stores_head =
        || stored_names(dir).iter().any(|n| n == "lm_head.weight" || n == "language_model.lm_head.weight");
    let keys = language_model_keys(cfg, &stores_head).map_err(fail)?;
    let (family, config) = config_from_keys(&keys).map_err(fail)?;
    Ok((family, config, keys, cfg.clone()))
}

/// A release whose folder holds an image model beside its language model, read as the
/// language model alone and written back whole.
struct Release {
    /// The release's `model_type`.
    model_type: &'static str,
    /// The language model's, where its `text_config` names none.
    text_type: &'static str,
    /// How the head is tied: by the outer class's own flag, with this default
    /// (`Gemma3ForConditionalGeneration`, `Mistral3ForConditionalGeneration`), or (`None`)
    /// by the text model's (Qwen3.5, which `AutoModelForCausalLM` builds from its
    /// `text_config` alone).
    outer_tie: Option<bool>,
    /// Where `save_pretrained` writes the language model's weights.
    names: ReleaseNames,
    /// Whether the outer class gives the language head's logits uncapped, whatever the text
    /// model's `final_logit_softcapping` says (Gemma 3's).
    uncapped_logits: bool,
    /// Whether a `config.json` without a `text_config` holds the language model's keys at
    /// its top level, beside `vision_config` (Qwen2.5-VL's releases on the Hub), and a tie
    /// flag in `text_config` ties the head whatever the outer one says (Qwen2.5-VL's class).
    flat_text: bool,
}

/// Where a release's `save_pretrained` writes its language model's weights.
#[derive(Clone, Copy, PartialEq)]
enum ReleaseNames {
    /// Under `model.language_model.`, the head under `lm_head.`.
    Modern,
    /// Under `language_model.model.`, the head under `language_model.lm_head.`.
    Legacy,
    /// Under `model.` and `lm_head.`, as a language model alone (Qwen2.5-VL's, the image
    /// model under `visual.`).
    Plain,
}

/// The releases read ([`Release`]).
const RELEASES: [Release; 9] = [
    Release {
        model_type: "qwen3_5",
        text_type: "qwen3_5_text",
        outer_tie: None,
        names: ReleaseNames::Modern,
        uncapped_logits: false,
        flat_text: false,
    },
    Release {
        model_type: "qwen3_5_moe",
        text_type: "qwen3_5_moe_text",
        outer_tie: None,
        names: ReleaseNames::Modern,
        uncapped_logits: false,
        flat_text: false,
    },
    Release {
        model_type: "gemma3",
        text_type: "gemma3_text",
        outer_tie: Some(true),
        names: ReleaseNames::Legacy,
        uncapped_logits: true,
        flat_text: false,
    },
    Release {
        model_type: "gemma4",
        text_type: "gemma4_text",
        outer_tie: Some(true),
        names: ReleaseNames::Modern,
        uncapped_logits: false,
        flat_text: false,
    },
    Release {
        model_type: "llama4",
        text_type: "llama4_text",
        outer_tie: None,
        names: ReleaseNames::Legacy,
        uncapped_logits: false,
        flat_text: false,
    },
    Release {
        model_type: "qwen3_vl",
        text_type: "qwen3_vl_text",
        outer_tie: Some(false),
        names: ReleaseNames::Modern,
        uncapped_logits: false,
        flat_text: false,
    },
    Release {
        model_type: "qwen3_vl_moe",
        text_type: "qwen3_vl_moe_text",
        outer_tie: Some(false),
        names: ReleaseNames::Modern,
        uncapped_logits: false,
        flat_text: false,
    },
    Release {
        model_type: "qwen2_5_vl",
        text_type: "qwen2_5_vl_text",
        outer_tie: Some(false),
        names: ReleaseNames::Plain,
        uncapped_logits: false,
        flat_text: true,
    },
    Release {
        model_type: "mistral3",
        text_type: "mistral",
        outer_tie: Some(true),
        names: ReleaseNames::Legacy,
        uncapped_logits: false,
        flat_text: false,
    },
];

/// The release a `config.json` is, if it is one.
fn release_of(cfg: &Map<String, Value>) -> Option<&'static Release> {
    let model_type = cfg.get("model_type").and_then(Value::as_str)?;
    RELEASES.iter().find(|r| r.model_type == model_type)
}

/// The keys of a folder's language model: a release of [`RELEASES`] is read as its
/// `text_config` (its weights renamed by [`language_model_name`]), any other folder as it
/// is. `stores_head` says whether the folder's weights hold a language head.
fn language_model_keys(cfg: &Map<String, Value>, stores_head: &dyn Fn() -> bool) -> KeyResult<Map<String, Value>> {
    let Some(release) = release_of(cfg) else { return Ok(cfg.clone()) };
    let mut text = match cfg.get("text_config") {
        Some(Value::Object(text)) => text.clone(),
        None if release.flat_text => {
            let mut text = cfg.clone();
            for key in ["model_type", "vision_config"] {
                text.remove(key);
            }
            text
        }
        _ => return Err(format!("config.json: a {} folder without a text_config object", release.model_type)),
    };
    text.entry("model_type").or_insert_with(|| json!(release.text_type));
    // What the outer configuration says of the whole model: its quantization (which
    // `transformers` hands the text model), its class and labels (a classifier's) and the
    // tokens that begin and end its texts (the padding token is the text model's own).
    let carried = ["quantization_config", "architectures", "num_labels", "id2label", "label2id"];
    for key in carried.into_iter().chain(["bos_token_id", "eos_token_id"]) {
        if let Some(value) = cfg.get(key) {
            text.entry(key).or_insert_with(|| value.clone());
        }
    }
    // Where the folder stores a head of its own, `transformers` keeps it apart from the
    // embedding whatever the flag says.
    let inner = text.get("tie_word_embeddings").and_then(Value::as_bool);
    let flag = match release.outer_tie {
        // Qwen2.5-VL's class also ties where `text_config` says so (saves before
        // `transformers` 5 left the outer flag out and put it there).
        Some(default) => Some(
            cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(default)
                || (release.flat_text && inner == Some(true)),
        ),
        None => inner,
    };
    let stored = stores_head();
    if flag.is_some() || stored {
        text.insert("tie_word_embeddings".into(), json!(flag.unwrap_or(false) && !stored));
    }
    if release.uncapped_logits {
        text.insert("final_logit_softcapping".into(), Value::Null);
    }
    Ok(text)
}

/// A release folder's weight name as its language model's ([`RELEASES`]): the language
/// model's weights under `model.language_model.` or `language_model.model.` (and, as some
/// `transformers` versions saved them, with a `model.` more) read as `model.`,
/// `language_model.lm_head.` as `lm_head.`, and any other `language_model.` as `model.`;
/// the image model's, its projector's and the multi-token prediction's are left out. Other
/// names read as they are.
pub(crate) fn language_model_name(name: &str) -> Option<String> {
    const LEFT_OUT: [&str; 11] = [
        "mtp.",
        "vision_model.",
        "model.visual.",
        "visual.",
        "model.vision_tower.",
        "vision_tower.",
        "model.multi_modal_projector.",
        "multi_modal_projector.",
        "model.audio_tower.",
        "model.embed_vision.",
        "model.embed_audio.",
    ];
    const RENAMED: [(&str, &str); 6] = [
        ("model.language_model.model.", "model."),
        ("language_model.model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("language_model.", "model."),
    ];
    if LEFT_OUT.iter().any(|p| name.starts_with(p)) {
        return None;
    }
    let renamed = RENAMED.iter().find_map(|(from, to)| Some(format!("{to}{}", name.strip_prefix(from)?)));
    Some(renamed.unwrap_or_else(|| name.to_string()))
}

/// A language model's parameter name as a release's model holds it in `transformers` 5
/// (and peft names its adapters): `model.` under `model.language_model.`.
pub(crate) fn release_module_name(name: &str) -> String {
    match name.strip_prefix("model.") {
        Some(inner) => format!("model.language_model.{inner}"),
        None => name.to_string(),
    }
}

/// A language model's weight name as the release `release` (its `config.json`) holds it,
/// as `save_pretrained` writes it ([`ReleaseNames`]).
pub(crate) fn release_name(release: &Map<String, Value>, name: &str) -> String {
    match release_of(release).map(|r| r.names) {
        Some(ReleaseNames::Legacy) => match name.strip_prefix("model.") {
            Some(inner) => format!("language_model.model.{inner}"),
            None => format!("language_model.{name}"),
        },
        Some(ReleaseNames::Plain) => name.to_string(),
        _ => release_module_name(name),
    }
}

/// The `config.json` of a release written back: its own keys (`release`), the language
/// model's (`text`, as its family writes them) as its `text_config`, and the head tied as
/// the language model ties it.
pub(crate) fn release_config(release: &Map<String, Value>, mut text: Value) -> Value {
    let tied = text.get("tie_word_embeddings").cloned().unwrap_or(json!(false));
    if let Some(text) = text.as_object_mut() {
        // The class is the release's own.
        text.remove("architectures");
        // The rotation's keys Strata does not read, for the image model's positions (Qwen's
        // sections per axis), as the release gives them for the same rotation (under
        // `rope_scaling` where it was saved before `transformers` 5, at the top level where it
        // holds its language model's keys there; Qwen2-VL's `mrope` is the default rotation).
        let source = release.get("text_config").map_or(Some(release), Value::as_object);
        let given = ["rope_parameters", "rope_scaling"]
            .into_iter()
            .find_map(|key| source.and_then(|t| t.get(key)).and_then(Value::as_object));
        fn kind(rope: &Map<String, Value>) -> Option<&str> {
            let kind = rope.get("rope_type").or_else(|| rope.get("type")).and_then(Value::as_str);
            kind.map(|k| if k == "mrope" { "default" } else { k })
        }
        if let (Some(Value::Object(written)), Some(given)) = (text.get_mut("rope_parameters"), given) {
            if written.contains_key("rope_type") && kind(written) == kind(given) {
                for (key, value) in given.iter().filter(|(key, _)| *key != "type") {
                    written.entry(key.clone()).or_insert_with(|| value.clone());
                }
            }
        }
    }
    let mut out = release.clone();
    // Written in floats.
    out.remove("quantization_config");
    // A release that held its language model's keys at the top level holds them in
    // `text_config` alone now.
    if !release.contains_key("text_config") && release_of(release).is_some_and(|r| r.flat_text) {
        let moved: Vec<String> = text.as_object().map(|t| t.keys().cloned().collect()).unwrap_or_default();
        for key in moved.iter().map(String::as_str).chain(["rope_scaling", "rope_theta"]) {
            if !matches!(key, "model_type" | "tie_word_embeddings" | "bos_token_id" | "eos_token_id") {
                out.remove(key);
            }
        }
    }
    out.insert("text_config".into(), text);
    out.insert("tie_word_embeddings".into(), tied);
    Value::Object(out)
}

/// The family and model a `config.json`'s keys describe, checked; the error is the line to
/// report.
pub(crate) fn config_from_keys(cfg: &Map<String, Value>) -> KeyResult<(Family, ModelConfig)> {
    let keys = Keys { cfg, prefix: String::new() };
    let model_type = keys.text("model_type")?.unwrap_or_default();
    let family = Family::from_model_type(&model_type).ok_or_else(|| {
        let known: Vec<&str> = FAMILIES.iter().map(|f| f.model_type()).collect();
        format!("config.json: model_type {model_type:?} is not a family Strata has ({})", known.join(", "))
    })?;
    match (Quantization::of(cfg)?, family) {
        (Some(Quantization::Mxfp4), f) if f != Family::GptOss => {
            return Err("config.json: MXFP4 weights are read as gpt-oss's experts alone".into())
        }
        (Some(Quantization::Fp8 { .. }), Family::Gpt2 | Family::Bert | Family::T5) => {
            return Err(format!(
                "config.json: fp8 weights are read for the decoder families, not {}",
                family.model_type()
            ))
        }
        _ => {}
    }
    let config = match family {
        Family::Gpt2 => ModelConfig::Gpt(keys.gpt2()?),
        Family::Bert => ModelConfig::Bert(keys.bert()?),
        Family::T5 => ModelConfig::T5(keys.t5()?),
        _ => ModelConfig::Llama(keys.decoder(family)?),
    };
    match &config {
        ModelConfig::Gpt(c) => c.validate(),
        ModelConfig::Bert(c) => c.validate(),
        ModelConfig::Llama(c) => c.validate(),
        ModelConfig::T5(c) => c.validate(),
        ModelConfig::Mlp(_) => Ok(()),
    }
    .map_err(|e| match e {
        Error::Config(why) => format!("config.json: {why}"),
        other => other.to_string(),
    })?;
    Ok((family, config))
}

/// The safetensors files of a folder: the shards its index names, or its single file.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let fail = |message: String| Error::Weights { path: dir.to_path_buf(), message };
    let index = dir.join(INDEX_FILE);
    if !index.is_file() {
        let single = dir.join(WEIGHTS_FILE);
        if single.is_file() {
            return Ok(vec![single]);
        }
        return Err(fail(format!("holds neither {WEIGHTS_FILE} nor {INDEX_FILE} (only safetensors weights are read)")));
    }
    let map = weight_map(&index).map_err(fail)?;
    let mut files: Vec<PathBuf> = vec![];
    for (tensor, file) in &map {
        let name = file.as_str().ok_or_else(|| fail(format!("{INDEX_FILE}: {tensor} names no file")))?;
        // Shards sit beside the index: a name that leaves the folder is not one.
        if name.contains('/') || name.contains('\\') || name == ".." {
            return Err(fail(format!("{INDEX_FILE}: shard name {name:?} is not a file of the folder")));
        }
        let path = dir.join(name);
        if !files.contains(&path) {
            if !path.is_file() {
                return Err(fail(format!("missing shard {name} (named by {INDEX_FILE} for {tensor})")));
            }
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(fail(format!("{INDEX_FILE} names no shards")));
    }
    Ok(files)
}

/// The `weight_map` of a folder's index (weight name to shard).
fn weight_map(index: &Path) -> std::result::Result<Map<String, Value>, String> {
    let text = std::fs::read_to_string(index).map_err(|e| format!("{INDEX_FILE} cannot be read ({e})"))?;
    let parsed: Value = serde_json::from_str(&text).map_err(|e| format!("{INDEX_FILE} is not valid JSON ({e})"))?;
    match parsed.get("weight_map") {
        Some(Value::Object(map)) => Ok(map.clone()),
        _ => Err(format!("{INDEX_FILE} has no weight_map object")),
    }
}

/// The weight names a folder stores, as its index or its single file's header lists them;
/// none where neither can be read (a folder of a `config.json` alone, which an estimate
/// reads). Loading the weights reports what is wrong with them.
fn stored_names(dir: &Path) -> Vec<String> {
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        return weight_map(&index).map(|map| map.keys().cloned().collect()).unwrap_or_default();
    }
    // A safetensors file opens with its header's length (8 bytes, little-endian), then the
    // header: a JSON object keyed by the tensors' names (and `__metadata__`), at most 100 MB.
    let header = || -> std::io::Result<Map<String, Value>> {
        use std::io::Read;
        let mut file = std::fs::File::open(dir.join(WEIGHTS_FILE))?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len).min(100_000_000);
        let mut text = vec![];
        file.take(len).read_to_end(&mut text)?;
        Ok(serde_json::from_slice(&text).unwrap_or_default())
    };
    header().map(|h| h.keys().filter(|k| *k != "__metadata__").cloned().collect()).unwrap_or_default()
}

/// Typed reads of a config's keys; errors are the message for the folder's error.
struct Keys<'a> {
    cfg: &'a Map<String, Value>,
    /// Where the keys sit (`rope_parameters.` for a nested dict), for messages.
    prefix: String,
}

type KeyResult<T> = std::result::Result<T, String>;

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.cfg.get(key).filter(|v| !v.is_null())
    }

    fn int(&self, key: &str) -> KeyResult<Option<i64>> {
        self.get(key)
            .map(|v| v.as_i64().ok_or_else(|| format!("config.json: {}{key} is not an integer ({v})", self.prefix)))
            .transpose()
    }

    /// `num_key_value_heads`, `None` meaning one for each query head: what a null key means
    /// to every class that loads with one (the others refuse it), while a missing key takes
    /// the class's default.
    fn kv_heads(&self, class_default: Option<i64>) -> KeyResult<Option<i64>> {
        match self.cfg.get("num_key_value_heads") {
            Some(Value::Null) => Ok(None),
            _ => Ok(self.int("num_key_value_heads")?.or(class_default)),
        }
    }

    fn required(&self, key: &str) -> KeyResult<i64> {
        self.int(key)?.ok_or_else(|| format!("config.json: {}{key} is missing", self.prefix))
    }

    fn float(&self, key: &str) -> KeyResult<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| format!("config.json: {}{key} is not a number ({v})", self.prefix)))
            .transpose()
    }

    fn flag(&self, key: &str) -> KeyResult<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| format!("config.json: {}{key} is not true or false ({v})", self.prefix)))
            .transpose()
    }

    fn text(&self, key: &str) -> KeyResult<Option<String>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .map(String::from)
                    .ok_or_else(|| format!("config.json: {}{key} is not a string ({v})", self.prefix))
            })
            .transpose()
    }

    /// Refuses `key` unless it is absent or one of `allowed`; `why` says what Strata does.
    fn only(&self, key: &str, allowed: &[Value], why: &str) -> KeyResult<()> {
        match self.get(key) {
            Some(v) if !allowed.contains(v) => {
                Err(format!("config.json: {}{key} = {v} is not supported ({why})", self.prefix))
            }
            _ => Ok(()),
        }
    }

    /// Dropout changes only training, and Strata's decoder families train without it:
    /// said, not refused.
    fn note_dropout(&self, keys: &[&str]) -> KeyResult<()> {
        for key in keys {
            if let Some(p) = self.float(key)?.filter(|&p| p > 0.0) {
                tracing::warn!(key, p, "the model folder asks for dropout; this family trains without dropout");
            }
        }
        Ok(())
    }

    /// A dropout probability, `transformers`' class default where the key is absent (its
    /// folders leave out what equals the default).
    fn rate(&self, key: &str, default: f64) -> KeyResult<f64> {
        Ok(self.float(key)?.unwrap_or(default))
    }

    fn gpt2(&self) -> KeyResult<GptConfig> {
        let dim = self.required("n_embd")?;
        self.only("activation_function", &[json!("gelu_new"), json!("gelu_pytorch_tanh")], "GPT-2 runs GELU (tanh)")?;
        if let Some(inner) = self.int("n_inner")?.filter(|&n| Some(n) != dim.checked_mul(4)) {
            return Err(format!("config.json: n_inner = {inner} is not supported (GPT-2's MLP is 4 · n_embd wide)"));
        }
        self.only("scale_attn_weights", &[json!(true)], "attention scores are scaled by 1/√head size")?;
        self.only("scale_attn_by_inverse_layer_idx", &[json!(false)], "no per-layer attention scaling")?;
        self.only("reorder_and_upcast_attn", &[json!(false)], "attention computes in the model's dtype")?;
        self.only("add_cross_attention", &[json!(false)], "Strata's GPT-2 is a decoder only")?;
        self.only("tie_word_embeddings", &[json!(true)], "GPT-2's output head is its token embedding")?;
        let dropout = DropoutRates {
            embedding: self.rate("embd_pdrop", 0.1)?,
            attention: self.rate("attn_pdrop", 0.1)?,
            residual: self.rate("resid_pdrop", 0.1)?,
            ..DropoutRates::NONE
        };
        let ctx = match self.int("n_positions")? {
            Some(n) => n,
            None => self.required("n_ctx")?,
        };
        Ok(GptConfig {
            norm_eps: self.float("layer_norm_epsilon")?.unwrap_or(1e-5),
            dropout,
            ..GptConfig::new(
                self.required("vocab_size")?,
                ctx,
                self.required("n_layer")?,
                self.required("n_head")?,
                dim,
            )
        })
    }

    /// BERT ([`super::bert`]): a sequence classifier over the folder's `id2label` or a
    /// masked language model, by the folder's architecture.
    fn bert(&self) -> KeyResult<BertConfig> {
        // The task first: a folder of another class is refused for that, whatever its keys.
        let architectures = self.get("architectures").and_then(Value::as_array);
        let architecture = architectures.and_then(|a| a.first()).and_then(Value::as_str);
        let head = match architecture {
            Some("BertForSequenceClassification") => BertHead::Classify { labels: self.labels()? },
            Some("BertForMaskedLM") | None => BertHead::MaskedLm,
            Some(other) => {
                return Err(format!(
                    "config.json: architecture {other} has no task Strata runs \
                     (BertForSequenceClassification, BertForMaskedLM)"
                ))
            }
        };
        self.only("hidden_act", &[json!("gelu")], "BERT's feed-forward runs GELU in its exact form")?;
        self.only("position_embedding_type", &[json!("absolute")], "positions are a learned table")?;
        self.only("is_decoder", &[json!(false)], "Strata's BERT is an encoder")?;
        self.only("add_cross_attention", &[json!(false)], "Strata's BERT is an encoder")?;
        let single = "a classifier's loss is the cross-entropy over its labels";
        self.only("problem_type", &[json!("single_label_classification")], single)?;
        let hidden = self.rate("hidden_dropout_prob", 0.1)?;
        let dropout = DropoutRates {
            embedding: hidden,
            attention: self.rate("attention_probs_dropout_prob", 0.1)?,
            residual: hidden,
            classifier: self.rate("classifier_dropout", hidden)?,
            ..DropoutRates::NONE
        };
        Ok(BertConfig {
            vocab: self.required("vocab_size")?,
            max_positions: self.required("max_position_embeddings")?,
            type_vocab: self.int("type_vocab_size")?.unwrap_or(2),
            layers: self.required("num_hidden_layers")?,
            heads: self.required("num_attention_heads")?,
            dim: self.required("hidden_size")?,
            ffn_dim: self.required("intermediate_size")?,
            norm_eps: self.float("layer_norm_eps")?.unwrap_or(1e-12),
            // transformers' BertConfig pads with 0 unless told otherwise.
            padding: Some(self.int("pad_token_id")?.unwrap_or(0)),
            head,
            dropout,
        })
    }

    /// T5 ([`super::t5`]): `T5ForConditionalGeneration`, v1.0 (ReLU, a tied head scaled by
    /// 1/√d_model) or v1.1 (gated GELU, a head of its own), as the keys say.
    fn t5(&self) -> KeyResult<T5Config> {
        let architectures = self.get("architectures").and_then(Value::as_array);
        match architectures.and_then(|a| a.first()).and_then(Value::as_str) {
            // `T5WithLMHeadModel` is the same class's older name (t5-small's own folder).
            Some("T5ForConditionalGeneration" | "T5WithLMHeadModel") | None => {}
            Some(other) => {
                return Err(format!(
                    "config.json: architecture {other} has no task Strata runs (T5ForConditionalGeneration)"
                ))
            }
        }
        let proj = self.text("feed_forward_proj")?.unwrap_or_else(|| "relu".into());
        let (gated, name) = match proj.split_once('-') {
            Some(("gated", name)) => (true, name),
            Some(_) => return Err(format!("config.json: feed_forward_proj = {proj:?} is neither ACT nor gated-ACT")),
            None => (false, proj.as_str()),
        };
        let activation = match name {
            "relu" => FeedForwardActivation::Relu,
            // transformers runs `gated-gelu` with GELU's tanh form.
            "gelu" if gated => FeedForwardActivation::GeluTanh,
            "gelu" => FeedForwardActivation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => FeedForwardActivation::GeluTanh,
            "silu" | "swish" => FeedForwardActivation::Silu,
            other => {
                return Err(format!(
                    "config.json: feed_forward_proj activation {other:?} is not supported (relu, gelu, gelu_new, silu)"
                ))
            }
        };
        let dropout = DropoutRates { classifier: 0.0, ..DropoutRates::all(self.rate("dropout_rate", 0.1)?) };
        let layers = self.required("num_layers")?;
        let tied_head = self.flag("tie_word_embeddings")?.unwrap_or(true);
        let padding = self.int("pad_token_id")?.unwrap_or(0);
        Ok(T5Config {
            vocab: self.required("vocab_size")?,
            dim: self.required("d_model")?,
            head_dim: self.required("d_kv")?,
            ffn_dim: self.required("d_ff")?,
            encoder_layers: layers,
            decoder_layers: self.int("num_decoder_layers")?.unwrap_or(layers),
            heads: self.required("num_heads")?,
            buckets: self.int("relative_attention_num_buckets")?.unwrap_or(32),
            max_distance: self.int("relative_attention_max_distance")?.unwrap_or(128),
            norm_eps: self.float("layer_norm_epsilon")?.unwrap_or(1e-6),
            activation,
            gated,
            tied_head,
            // Folders written before the key existed scale exactly where the head is tied.
            scale_output: self.flag("scale_decoder_outputs")?.unwrap_or(tied_head),
            padding,
            decoder_start: self.int("decoder_start_token_id")?.unwrap_or(padding),
            dropout,
        })
    }

    /// A classifier's label names in id order, from `id2label` (`transformers`' default
    /// when absent: two labels, `LABEL_0` and `LABEL_1`).
    fn labels(&self) -> KeyResult<Vec<String>> {
        let Some(map) = self.get("id2label") else { return Ok(vec!["LABEL_0".into(), "LABEL_1".into()]) };
        let map = map.as_object().ok_or_else(|| format!("config.json: id2label is not an object ({map})"))?;
        let mut labels = vec![None; map.len()];
        for (id, name) in map {
            let at = id.parse::<usize>().ok().filter(|&i| i < labels.len());
            let name = name.as_str();
            match (at, name) {
                (Some(i), Some(name)) if labels[i].is_none() => labels[i] = Some(name.to_string()),
                _ => return Err(format!("config.json: id2label must map the ids 0..{} to names", map.len())),
            }
        }
        if labels.len() < 2 {
            return Err("config.json: id2label names one label: a single output is a regression, which Strata's \
                        classifier does not train"
                .into());
        }
        Ok(labels.into_iter().flatten().collect())
    }

    /// The decoder of `family` ([`super::llama`]); keys that change the computation and
    /// that it cannot honour are refused by name.
    fn decoder(&self, family: Family) -> KeyResult<LlamaConfig> {
        let head = self.decoder_head(family)?;
        if family == Family::NemotronH {
            return self.nemotron_h(head);
        }
        if matches!(family, Family::Mamba | Family::FalconMamba) {
            return self.mamba(family == Family::FalconMamba, head);
        }
        let moe = self.experts(family)?;
        let olmoe = family == Family::Olmoe;
        let olmo = family.is_olmo();
        let smollm3 = family == Family::SmolLm3;
        let exaone4 = family == Family::Exaone4;
        let seed = family == Family::SeedOss;
        let ernie = family.dense() == Family::Ernie4_5;
        let hunyuan = family.dense() == Family::HunYuanDense;
        let llama4 = family == Family::Llama4;
        let minimax = family == Family::MiniMaxM2;
        let cohere = family.is_cohere();
        let granite4 = family == Family::GraniteMoeHybrid;
        let lfm2 = family.dense() == Family::Lfm2;
        let bamba = family == Family::Bamba;
        let falcon_h1 = family == Family::FalconH1;
        let jamba = family == Family::Jamba;
        if jamba {
            self.only("attention_bias", &[json!(false)], "Jamba's attention has no biases")?;
        }
        if bamba {
            self.only("z_loss_coefficient", &[json!(0), json!(0.0)], "a z-loss on the logits is not applied")?;
            self.only("mlp_bias", &[json!(false)], "Bamba's feed-forward has no biases here")?;
        }
        if family == Family::Cohere {
            self.only("use_qk_norm", &[json!(false)], "Command R+'s per-head query/key layer norms are not read")?;
        }
        // Granite's class scales its scores by attention_multiplier alone (1 by default).
        let multipliers = match family.dense() {
            Family::Granite => Some(Multipliers {
                embeddings: self.float("embedding_multiplier")?.unwrap_or(1.0),
                residual: self.float("residual_multiplier")?.unwrap_or(1.0),
                scores: self.float("attention_multiplier")?.unwrap_or(1.0),
                logits: self.float("logits_scaling")?.unwrap_or(1.0),
            }),
            _ => None,
        };
        if ernie {
            self.only(
                "use_bias",
                &[json!(false)],
                "ERNIE 4.5's use_bias puts biases on the feed-forward, which has none",
            )?;
        }
        let class_rope = self.class_rope(family);
        let glm4 = family == Family::Glm4;
        let glm = family == Family::Glm4Moe || glm4;
        // Solar Open's output projection has no bias, whatever attention_bias says.
        let solar = family == Family::SolarOpen;
        // Each configuration class's padding token where the key is absent.
        let default_padding = match family {
            Family::Gemma2
            | Family::Gemma3
            | Family::Gemma4
            | Family::Ernie4_5
            | Family::Ernie4_5Moe
            | Family::HunYuanDense
            | Family::HunYuanMoe
            | Family::Cohere
            | Family::Cohere2 => Some(0),
            Family::Apertus => Some(3),
            Family::Olmo2 | Family::Olmo3 | Family::Olmoe | Family::SeedOss => Some(1),
            Family::OlmoHybrid | Family::FlexOlmo => Some(100_277),
            Family::Lfm2 | Family::Lfm2Moe | Family::Bamba | Family::FalconH1 | Family::Jamba => Some(0),
            Family::Ministral3 | Family::Mistral4 => Some(11),
            Family::Phi3 => Some(32000),
            Family::SmolLm3 => Some(128_004),
            Family::Glm4 => Some(151_329),
            _ => None,
        };
        let (class, defaults) = (family, family.class_defaults());
        let query_scaling = match &class_rope {
            Some((_, rope)) if matches!(family, Family::Ministral3 | Family::Mistral4) => {
                self.query_scaling(rope, defaults.positions)?
            }
            _ => None,
        };
        let gpt_oss = family == Family::GptOss;
        let next = family.linear_attention_family();
        let olmo_hybrid = family == Family::OlmoHybrid;
        let split_projections = family.is_qwen3_5();
        let qwen3_5_moe = family == Family::Qwen3_5Moe;
        let latent = match family.has_latent_attention() {
            true => Some(self.latent(family, class_rope.as_ref().map(|(key, p)| (*key, p)))?),
            false => None,
        };
        // A mixture of experts' attention and windows are those of the family it grew from.
        let family = family.dense();
        let qwen2 = matches!(family, Family::Qwen2 | Family::Qwen2_5Vl);
        let (dim, heads) = (self.required("hidden_size")?, self.required("num_attention_heads")?);
        let layers = self.required("num_hidden_layers")?;
        let unrotated_layers = match () {
            _ if smollm3 || llama4 => self.unrotated_layers(layers)?,
            _ if granite4 => self.granite4_unrotated(layers)?,
            _ if olmo_hybrid => self.olmo_hybrid_unrotated(layers)?,
            // Jamba's attention turns no position.
            _ if jamba => (0..layers).collect(),
            _ => vec![],
        };
        let llama4_attention = if llama4 { Some(self.llama4_attention(layers, &unrotated_layers)?) } else { None };
        let gemma = family.is_gemma();
        let (activation, accepted, named): (_, &[&str], _) = match family {
            _ if gemma => (Activation::GeluTanh, &["gelu_pytorch_tanh", "gelu_tanh"], "gates with gelu_pytorch_tanh"),
            Family::Arcee | Family::Nemotron => (Activation::Relu2, &["relu2"], "has no gate and runs relu2"),
            Family::Starcoder2 => {
                (Activation::UngatedGeluTanh, &["gelu_pytorch_tanh"], "has no gate and runs gelu_pytorch_tanh")
            }
            Family::Apertus => (Activation::Xielu, &["xielu"], "has no gate and runs xielu"),
            _ => (Activation::Silu, &["silu"], "gates with silu"),
        };
        let given = self.text("hidden_activation")?.or(self.text("hidden_act")?);
        if let Some(other) = given.filter(|g| !accepted.contains(&g.as_str())) {
            return Err(format!(
                "config.json: hidden_act {other:?} is not supported (the {} feed-forward {named})",
                family.model_type(),
            ));
        }
        // StarCoder2's use_bias puts biases on every projection.
        let (starcoder2, nemotron) = (family == Family::Starcoder2, family == Family::Nemotron);
        let use_bias = if starcoder2 { self.flag("use_bias")?.unwrap_or(true) } else { false };
        let mlp_bias = match class {
            _ if class.reads_mlp_bias() => self.flag("mlp_bias")?.unwrap_or(false),
            Family::Starcoder2 => use_bias,
            _ => {
                self.only("mlp_bias", &[json!(false)], "the feed-forward has no biases")?;
                false
            }
        };
        // Gemma 4's "vision" makes image tokens alone attend both ways.
        let causal: &[Value] =
            if family == Family::Gemma4 { &[json!(false), json!("vision")] } else { &[json!(false)] };
        self.only("use_bidirectional_attention", causal, "attention is causal")?;
        let gemma4 = family == Family::Gemma4;
        if gemma4 {
            self.gemma4_refusals()?;
        }
        let attention_bias = match starcoder2 {
            true => use_bias,
            false => self.flag("attention_bias")?.unwrap_or(glm4 || gpt_oss || seed),
        };
        if family == Family::Phi3 && attention_bias {
            return Err(
                "config.json: attention_bias = true is not supported (Phi-3's fused projections have none)".into()
            );
        }
        let head_dim = match self.int("head_dim")? {
            // DeepSeek's head_dim names its rotated width alone.
            _ if latent.is_some() => None,
            Some(h) => Some(h),
            None => defaults.head_dim,
        };
        let max_positions = self.int("max_position_embeddings")?.unwrap_or(defaults.positions);
        let (rope, local_rope) = match (family, self.get("rope_parameters")) {
            (Family::Gemma3, _) => {
                let (full, local) =
                    self.ropes_by_layer_kind(1_000_000.0, Some("rope_local_base_freq"), 10_000.0, max_positions)?;
                (full, Some(local))
            }
            (Family::Olmo3, _) => {
                let (full, local) = self.ropes_by_layer_kind(500_000.0, None, 500_000.0, max_positions)?;
                (full, Some(local))
            }
            (Family::Gemma4, params) => {
                // The class's rotations where the folder names none: a quarter of each global
                // head's pairs turned proportionally at base 10^6, the sliding heads plainly at 10^4.
                let class = json!({
                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                });
                let params = params.unwrap_or(&class);
                let kind = |key: &'static str, layer: &str| match params.get(layer).filter(|v| !v.is_null()) {
                    Some(p) => Ok((key, p)),
                    None => Err(format!("config.json: {key} is missing")),
                };
                let full = self.rope(
                    Some(kind("rope_parameters.full_attention", "full_attention")?),
                    None,
                    1e6,
                    max_positions,
                )?;
                let sliding = kind("rope_parameters.sliding_attention", "sliding_attention")?;
                (full, Some(self.rope(Some(sliding), None, 1e4, max_positions)?))
            }
            // The families whose classes turn by a rotation of their own where a folder names
            // none read it in place of rope_parameters; the older rope_scaling, where a folder
            // gives it beside rope_parameters, is what the configuration classes read.
            (_, params) => {
                let older = self.get("rope_scaling").filter(|s| s.as_object().is_some_and(|m| !m.is_empty()));
                let params = class_rope
                    .as_ref()
                    .map(|(key, p)| (*key, p))
                    .or(older.map(|p| ("rope_scaling", p)))
                    .or(params.map(|p| ("rope_parameters", p)));
                // Qwen2-VL's and Qwen2.5-VL's classes alone read `mrope` as the default rotation.
                let kind = params.and_then(|(_, p)| p.get("rope_type").or(p.get("type"))).and_then(Value::as_str);
                if kind == Some("mrope") && family != Family::Qwen2_5Vl {
                    return Err(format!(
                        "config.json: rope type \"mrope\" is not supported ({} has no multimodal rotation)",
                        family.model_type()
                    ));
                }
                let rope = self.rope(params, Some("rope_theta"), defaults.rope_theta, max_positions)?;
                // HunYuan's class reads a dynamic rotation with an alpha as a fixed stretch of its base.
                let alpha = match params {
                    Some((key, Value::Object(map))) if hunyuan => {
                        Keys { cfg: map, prefix: format!("{key}.") }.float("alpha")?
                    }
                    _ => None,
                };
                match (&rope.scaling, alpha) {
                    (RopeScaling::Dynamic { .. }, Some(alpha)) => {
                        (Rope { scaling: RopeScaling::NtkAlpha { alpha }, ..rope }, None)
                    }
                    _ => (rope, None),
                }
            }
        };
        // A proportional rotation turns whole heads at frequencies some of which are zero:
        // Gemma 4's classes alone read it so (others turn part of each head their own way).
        if !gemma4 && [Some(&rope), local_rope.as_ref()].into_iter().flatten().any(|r| r.proportional) {
            return Err(
                "config.json: rope_type proportional is Gemma 4's rotation: not supported for this family".into()
            );
        }
        // GLM-4.5 turns half of each head where its keys say nothing.
        let partial_given = self.cfg.contains_key("partial_rotary_factor")
            || self.get("rope_parameters").and_then(|p| p.get("partial_rotary_factor")).is_some();
        let partial = match (glm, next) {
            // Latent attention turns its qk_rope_head_dim, the share of each head Mistral 4's
            // partial_rotary_factor names.
            _ if latent.is_some() => 1.0,
            // StarCoder2's class turns whole heads whatever partial_rotary_factor says.
            _ if starcoder2 => 1.0,
            // Bamba's turns half of each, whatever it says.
            _ if bamba => 0.5,
            _ if partial_given => rope.partial,
            // MiniMax-M2's folders name the turned width of each head.
            _ if minimax => match self.int("rotary_dim")? {
                Some(turned) => turned as f64 / head_dim.unwrap_or(dim / heads) as f64,
                None => 1.0,
            },
            (true, _) => 0.5,
            _ if nemotron => 0.5,
            (_, true) => 0.25,
            _ => rope.partial,
        };
        let rope = Rope { partial, ..rope };
        // Dynamic scaling stretches the context it was trained at by its factor.
        let ctx = match rope.scaling {
            RopeScaling::Dynamic { factor, .. } if factor > 1.0 => (max_positions as f64 * factor) as i64,
            _ => max_positions,
        };
        let (sliding_window, layer_types) = match (&llama4_attention, next) {
            (_, true) => (None, Some(self.linear_layers(layers)?)),
            _ if granite4 => (None, Some(self.granite4_layers(layers)?)),
            // LFM2-MoE's class reads layer_types alone.
            _ if class == Family::Lfm2Moe => (None, Some(self.layer_kinds_required(&LFM2_LAYER_NAMES)?)),
            _ if lfm2 => (None, Some(self.lfm2_layers(layers)?)),
            _ if bamba => (None, Some(self.bamba_layers(layers)?)),
            // Its class names every layer hybrid whatever the folder says.
            _ if falcon_h1 => (None, Some(vec![LayerAttention::Hybrid; layers as usize])),
            _ if jamba => {
                let (period, offset) = self.period("attn_layer_period", 8, "attn_layer_offset", 4)?;
                if period == 1 {
                    return Err("config.json: attn_layer_period 1 makes every layer attend: a Jamba model \
                                without a Mamba layer is not supported"
                        .into());
                }
                let attending: Vec<i64> = (0..layers).filter(|i| i % period == offset).collect();
                (None, Some(attending_on(&attending, layers)))
            }
            _ if olmo_hybrid => (None, Some(self.olmo_hybrid_layers(layers)?)),
            (Some(l), _) => (None, Some(l.layer_types.clone())),
            _ => self.windows(class, layers, &unrotated_layers)?,
        };
        // Phi-3 drops each sub-layer's output (`resid_pdrop`); `transformers` reads no
        // `embd_pdrop`, nor the other families either key.
        let residual = match family {
            Family::Phi3 => self.rate("resid_pdrop", 0.0)?,
            Family::SeedOss => self.rate("residual_dropout", 0.1)?,
            Family::Starcoder2 => self.rate("residual_dropout", 0.0)?,
            _ => {
                self.note_dropout(&["resid_pdrop"])?;
                0.0
            }
        };
        self.note_dropout(&["embd_pdrop"])?;
        let embedding = if starcoder2 { self.rate("embedding_dropout", 0.0)? } else { 0.0 };
        let softcap = |key: &str, default: Option<f64>| -> KeyResult<Option<f64>> {
            Ok(if self.cfg.contains_key(key) { self.float(key)? } else { default })
        };
        let gemma2 = family == Family::Gemma2;
        let recurrent_layers = layer_types.as_ref().is_some_and(|t| t.contains(&LayerAttention::Linear));
        let full_layer_heads = match gemma4 {
            true => self.gemma4_full_heads(layers, head_dim.unwrap_or(256), layer_types.as_deref())?,
            false => None,
        };
        let config = LlamaConfig {
            ffn_dim: Some(match (self.int("intermediate_size")?, &moe) {
                // Granite 4's dense network is its shared_mlp (its experts intermediate_size wide).
                _ if granite4 => self.int("shared_intermediate_size")?.unwrap_or(1024),
                _ if class == Family::Lfm2 => self.lfm2_width()?,
                // LFM2-MoE's dense layers are as wide as it says.
                _ if lfm2 => self.int("intermediate_size")?.unwrap_or(7168),
                (Some(d), _) => d,
                // Qwen3.5's experts route every layer, so no dense feed-forward has a width.
                (None, Some(m)) if qwen3_5_moe => m.expert_ffn_dim,
                // Solar Open's experts route every layer; its class has no intermediate_size.
                (_, Some(m)) if solar => m.expert_ffn_dim,
                (None, _) => self.required("intermediate_size")?,
            }),
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            partial_rotary: rope.partial,
            proportional_rotary: rope.proportional,
            full_layer_heads,
            value_norm: gemma4,
            layer_scalar: gemma4,
            local_rope,
            kv_heads: match latent {
                Some(_) => None,
                None => self.kv_heads(defaults.kv_heads)?,
            },
            norm_eps: self.float(family.norm_eps_key())?.unwrap_or(defaults.norm_eps),
            tie_embeddings: match if lfm2 { self.flag("tie_embedding")? } else { None } {
                // LFM2's class reads its older key over the newer one.
                Some(tied) => tied,
                None => self.flag("tie_word_embeddings")?.unwrap_or(
                    gemma || smollm3 || ernie || cohere || starcoder2 || lfm2 || class == Family::Qwen3VlMoe,
                ),
            },
            qkv_bias: (qwen2 && self.flag("qkv_bias")?.unwrap_or(true)) || attention_bias,
            o_bias: match family {
                Family::SeedOss => self.flag("attention_out_bias")?.unwrap_or(false),
                _ => !qwen2 && !glm && !solar && attention_bias,
            },
            mlp_bias,
            head_dim,
            norm: match () {
                _ if gemma && !gemma4 || next => NormKind::PlusOne,
                _ if cohere || starcoder2 => NormKind::Layer,
                _ if nemotron => NormKind::LayerPlusOne,
                _ => NormKind::Weighted,
            },
            norm_bias: starcoder2 || nemotron,
            fc_names: starcoder2,
            parallel_block: cohere,
            logit_scale: if cohere { Some(self.float("logit_scale")?.unwrap_or(0.0625)) } else { None },
            activation,
            qk_norm: family.norms_queries_and_keys()
                || olmoe
                || olmo
                || next
                || minimax
                || (glm && self.flag("use_qk_norm")?.unwrap_or(false)),
            qk_norm_whole: olmoe || olmo || minimax,
            qk_norm_after_rotation: hunyuan,
            multipliers,
            clip_qkv: if olmoe { self.float("clip_qkv")? } else { None },
            sandwich_norms: gemma || glm4,
            post_norms: olmo || exaone4,
            unrotated_layers,
            query_scaling,
            scale_embeddings: gemma,
            // Gemma 4's scores are unscaled (its query and key norms set their size).
            query_pre_attn_scalar: match () {
                _ if gemma4 => Some(1.0),
                _ if gemma => Some(self.float("query_pre_attn_scalar")?.unwrap_or(256.0)),
                _ => None,
            },
            attn_softcap: if gemma && !gemma4 {
                softcap("attn_logit_softcapping", gemma2.then_some(50.0))?
            } else {
                None
            },
            logit_softcap: if gemma { softcap("final_logit_softcapping", gemma2.then_some(30.0))? } else { None },
            sliding_window,
            layer_types,
            fused_projections: family == Family::Phi3,
            fused_gate_up: glm4,
            interleaved_rotation: glm4 || ernie || cohere,
            padding_token: match self.cfg.get("pad_token_id") {
                Some(_) => self.int("pad_token_id")?,
                None => default_padding,
            },
            moe,
            attention_sinks: gpt_oss,
            attention_output_gate: next,
            linear_attention: match () {
                _ if next => Some(self.linear_attention(split_projections)?),
                _ if olmo_hybrid => Some(self.olmo_hybrid_linear_attention(dim, heads)?),
                _ => None,
            },
            recurrent_pre_norms: olmo_hybrid,
            // Granite 4's and LFM2's mixers where some layer has one (Granite 4 Micro's attend
            // on every layer).
            state_space: match () {
                _ if falcon_h1 => Some(self.falcon_h1_state_space(dim)?),
                _ if (granite4 || bamba) && recurrent_layers => Some(self.state_space(dim)?),
                _ => None,
            },
            mup: if falcon_h1 { Some(self.falcon_h1_multipliers()?) } else { None },
            selective_scan: if jamba && recurrent_layers { Some(self.jamba_mixer(dim)?) } else { None },
            shared_mlp: granite4,
            short_conv: match lfm2 && recurrent_layers {
                true => Some(ShortConvConfig {
                    kernel: self.int("conv_L_cache")?.unwrap_or(3),
                    bias: self.flag("conv_bias")?.unwrap_or(false),
                }),
                false => None,
            },
            latent,
            // The decoder families' own default is no dropout (Seed-OSS's 0.1).
            dropout: DropoutRates {
                attention: self.rate("attention_dropout", if seed { 0.1 } else { 0.0 })?,
                residual,
                embedding,
                ..DropoutRates::NONE
            },
            head,
            ..LlamaConfig::new(self.required("vocab_size")?, ctx, layers, heads, dim)
        };
        Ok(match (exaone4, llama4_attention) {
            (true, _) => LlamaConfig { unrotated_layers: exaone4_unrotated(&config), ..config },
            _ if class == Family::Cohere2 => LlamaConfig { unrotated_layers: cohere2_unrotated(&config), ..config },
            (_, Some(l)) => LlamaConfig {
                ffn_dim: Some(l.dense_width),
                attention_chunk: Some(l.chunk),
                qk_l2_norm: l.qk_l2_norm,
                query_scaling: l.query_scaling,
                interleaved_rotation: true,
                ..config
            },
            _ => config,
        })
    }

    /// A decoder's head by its `architectures`: a sequence classifier of one label
    /// (`num_labels = 1`, what TRL's reward models are) is a reward model; others are refused.
    fn decoder_head(&self, family: Family) -> KeyResult<DecoderHead> {
        let architectures = self.get("architectures").and_then(Value::as_array);
        let Some(class) = architectures.and_then(|a| a.first()).and_then(Value::as_str) else {
            return Ok(DecoderHead::LanguageModel);
        };
        if !class.ends_with("ForSequenceClassification") {
            return Ok(DecoderHead::LanguageModel);
        }
        if !family.classifies_sequences() {
            return Err(format!("config.json: {class}: {} has no sequence classifier", family.model_type()));
        }
        let labels = match (self.int("num_labels")?, self.get("id2label").and_then(Value::as_object)) {
            (Some(n), _) => n as usize,
            (None, Some(map)) => map.len(),
            // transformers' default.
            (None, None) => 2,
        };
        if labels != 1 {
            return Err(format!(
                "config.json: {class} with {labels} labels: a decoder's sequence classifier trains as a reward \
                 model, with one label (num_labels = 1)"
            ));
        }
        Ok(DecoderHead::Reward)
    }

    /// Qwen3-Next's or (`split_projections`) Qwen3.5's Gated DeltaNet sizes (with
    /// `transformers`' defaults).
    fn linear_attention(&self, split_projections: bool) -> KeyResult<LinearAttentionConfig> {
        Ok(LinearAttentionConfig {
            split_projections,
            key_heads: self.int("linear_num_key_heads")?.unwrap_or(16),
            value_heads: self.int("linear_num_value_heads")?.unwrap_or(32),
            key_dim: self.int("linear_key_head_dim")?.unwrap_or(128),
            value_dim: self.int("linear_value_head_dim")?.unwrap_or(128),
            conv_kernel: self.int("linear_conv_kernel_dim")?.unwrap_or(4),
            apart_projections: false,
            doubled_beta: false,
            gate_norm_eps: None,
        })
    }

    /// Granite 4's Mamba-2 sizes (with `transformers`' defaults; a head's width by default
    /// `mamba_expand · hidden_size` over the heads).
    fn state_space(&self, dim: i64) -> KeyResult<StateSpaceConfig> {
        let expand = self.int("mamba_expand")?.unwrap_or(2);
        self.mamba2_sizes(expand.saturating_mul(dim), &format!("mamba_expand {expand} times hidden_size {dim}"))
    }

    /// The Mamba-2 sizes of Granite 4's keys around an inner width `inner` (which `width`
    /// names for messages), with `transformers`' defaults; a head's width by default the
    /// inner width over the heads.
    fn mamba2_sizes(&self, inner: i64, width: &str) -> KeyResult<StateSpaceConfig> {
        let heads = self.int("mamba_n_heads")?.unwrap_or(128);
        let head_dim = match self.get("mamba_d_head") {
            Some(Value::String(auto)) if auto == "auto" => inner / heads.max(1),
            _ => self.int("mamba_d_head")?.unwrap_or(inner / heads.max(1)),
        };
        if inner != heads.saturating_mul(head_dim) {
            return Err(format!("config.json: mamba_n_heads {heads} of mamba_d_head {head_dim} are not {width}"));
        }
        let (time_step_min, time_step_max) = match self.get("time_step_limit") {
            None => (0.0, None),
            Some(Value::Array(limits)) if limits.len() == 2 => {
                // Infinities as Python's json writes them (quoted on reading), or as
                // `transformers` 5 tags them (`{"__float__": "Infinity"}`).
                let bound = |v: &Value| {
                    let word = match v {
                        Value::String(word) => Some(word.as_str()),
                        Value::Object(tagged) => tagged.get("__float__").and_then(Value::as_str),
                        _ => None,
                    };
                    match word {
                        Some(PYTHON_INFINITY) => Ok(f64::INFINITY),
                        Some(w) if w.strip_prefix('-') == Some(PYTHON_INFINITY) => Ok(f64::NEG_INFINITY),
                        _ => v.as_f64().ok_or_else(|| format!("config.json: time_step_limit holds {v}")),
                    }
                };
                // The step is a softplus, never below 0: a lower bound under it bounds nothing.
                let (lower, upper) = (bound(&limits[0])?, bound(&limits[1])?);
                if lower == f64::INFINITY || upper == f64::NEG_INFINITY {
                    return Err(format!("config.json: time_step_limit ({lower}, {upper}) bounds every step away"));
                }
                (lower.max(0.0), upper.is_finite().then_some(upper))
            }
            Some(other) => return Err(format!("config.json: time_step_limit is not a pair of numbers ({other})")),
        };
        Ok(StateSpaceConfig {
            heads,
            head_dim,
            groups: self.int("mamba_n_groups")?.unwrap_or(1),
            state: self.int("mamba_d_state")?.unwrap_or(256),
            conv_kernel: self.int("mamba_d_conv")?.unwrap_or(4),
            chunk: self.int("mamba_chunk_size")?.unwrap_or(256),
            conv_bias: self.flag("mamba_conv_bias")?.unwrap_or(true),
            proj_bias: self.flag("mamba_proj_bias")?.unwrap_or(false),
            time_step_min,
            time_step_max,
            gated_norm: GatedNorm::GateThenNorm,
        })
    }

    /// Falcon-H1's Mamba-2 sizes: Granite 4's keys with the width its own (`mamba_d_ssm`,
    /// else `mamba_expand · hidden_size`), and its mixers' norm (none unless `mamba_rms_norm`,
    /// then before the gate unless `mamba_norm_before_gate` says otherwise). Its class reads
    /// the output projection's bias from `projectors_bias` and the input's from
    /// `mamba_proj_bias`: Strata's mixer has both or neither.
    fn falcon_h1_state_space(&self, dim: i64) -> KeyResult<StateSpaceConfig> {
        let (inner, width) = match self.cfg.get("mamba_d_ssm") {
            Some(Value::Null) => {
                let expand = self.int("mamba_expand")?.unwrap_or(2);
                (expand.saturating_mul(dim), format!("mamba_expand {expand} times hidden_size {dim}"))
            }
            _ => {
                let inner = self.int("mamba_d_ssm")?.unwrap_or(1024);
                (inner, format!("mamba_d_ssm {inner}"))
            }
        };
        let (input_bias, output_bias) =
            (self.flag("mamba_proj_bias")?.unwrap_or(false), self.flag("projectors_bias")?.unwrap_or(false));
        if input_bias != output_bias {
            return Err(format!(
                "config.json: mamba_proj_bias = {input_bias} beside projectors_bias = {output_bias} is not supported \
                 (the Mamba-2 mixer's projections have biases on both or on neither)"
            ));
        }
        let gated_norm = match (self.flag("mamba_rms_norm")?, self.flag("mamba_norm_before_gate")?) {
            (None | Some(false), _) => GatedNorm::GateAlone,
            (Some(true), None | Some(true)) => GatedNorm::NormThenGate,
            (Some(true), Some(false)) => GatedNorm::GateThenNorm,
        };
        Ok(StateSpaceConfig { gated_norm, ..self.mamba2_sizes(inner, &width)? })
    }

    /// A layer period and offset (`period_key`, `offset_key`, with their class defaults): the
    /// offset must fall within the period.
    fn period(&self, period_key: &str, period: i64, offset_key: &str, offset: i64) -> KeyResult<(i64, i64)> {
        let (period, offset) = (self.int(period_key)?.unwrap_or(period), self.int(offset_key)?.unwrap_or(offset));
        if period < 1 || !(0..period).contains(&offset) {
            return Err(format!("config.json: {offset_key} {offset} is not within {period_key} {period}"));
        }
        Ok((period, offset))
    }

    /// Jamba's Mamba-1 mixers (with its class's defaults): `mamba_expand · hidden_size` wide,
    /// a step of rank `mamba_dt_rank` (`⌈hidden_size / 16⌉` where `auto`), its step, `B` and
    /// `C` RMS-normed with weights at `rms_norm_eps`.
    fn jamba_mixer(&self, dim: i64) -> KeyResult<SelectiveScanConfig> {
        Ok(SelectiveScanConfig {
            inner: self.int("mamba_expand")?.unwrap_or(2).saturating_mul(dim),
            state: self.int("mamba_d_state")?.unwrap_or(16),
            conv_kernel: self.int("mamba_d_conv")?.unwrap_or(4),
            time_step_rank: self.time_step_rank("mamba_dt_rank", dim)?,
            conv_bias: self.flag("mamba_conv_bias")?.unwrap_or(true),
            proj_bias: self.flag("mamba_proj_bias")?.unwrap_or(false),
            inner_norms: Some(InnerNorms { eps: self.float("rms_norm_eps")?.unwrap_or(1e-6), weighted: true }),
        })
    }

    /// A Mamba-1 step's rank by `key`: `⌈dim / 16⌉` where it is `auto` or absent.
    fn time_step_rank(&self, key: &str, dim: i64) -> KeyResult<i64> {
        Ok(match self.get(key) {
            Some(Value::String(auto)) if auto == "auto" => None,
            _ => self.int(key)?,
        }
        .unwrap_or((dim + 15) / 16))
    }

    /// Jamba's experts (with its class's defaults): on the layers every
    /// `expert_layer_period`-th from `expert_layer_offset`, `num_experts_per_tok` of
    /// `num_experts` (2 of 16) as wide as `intermediate_size`, chosen by their softmax
    /// scores and weighted by them unrenormalised; none where `num_experts` is 1.
    fn jamba_experts(&self) -> KeyResult<Option<MoeConfig>> {
        let experts = match self.int("num_local_experts")? {
            Some(n) => n,
            None => self.int("num_experts")?.unwrap_or(16),
        };
        if experts == 1 {
            return Ok(None);
        }
        let layers = self.required("num_hidden_layers")?;
        let (period, offset) = self.period("expert_layer_period", 2, "expert_layer_offset", 1)?;
        Ok(Some(MoeConfig {
            names: ExpertNames::FeedForward,
            dense_layers: (0..layers).filter(|i| i % period != offset).collect(),
            aux_loss_coef: self.float("router_aux_loss_coef")?.unwrap_or(0.001),
            ..MoeConfig::new(
                experts,
                self.int("num_experts_per_tok")?.unwrap_or(2),
                self.required("intermediate_size")?,
            )
        }))
    }

    /// Falcon-H1's μP multipliers, 1 where a key is absent.
    fn falcon_h1_multipliers(&self) -> KeyResult<MupMultipliers> {
        let one = |key: &str| Ok::<_, String>(self.float(key)?.unwrap_or(1.0));
        let list = |key: &str, out: &mut [f64]| -> KeyResult<()> {
            let Some(given) = self.get(key) else { return Ok(()) };
            let values = given
                .as_array()
                .filter(|v| v.len() == out.len())
                .ok_or_else(|| format!("config.json: {key} is not a list of {} numbers ({given})", out.len()))?;
            for (slot, v) in out.iter_mut().zip(values) {
                *slot = v.as_f64().ok_or_else(|| format!("config.json: {key} holds {v}, not a number"))?;
            }
            Ok(())
        };
        let (mut projection, mut mlp) = ([1.0; 5], [1.0; 2]);
        list("ssm_multipliers", &mut projection)?;
        list("mlp_multipliers", &mut mlp)?;
        Ok(MupMultipliers {
            embeddings: one("embedding_multiplier")?,
            logits: one("lm_head_multiplier")?,
            keys: one("key_multiplier")?,
            attention_in: one("attention_in_multiplier")?,
            attention_out: one("attention_out_multiplier")?,
            recurrent_in: one("ssm_in_multiplier")?,
            recurrent_out: one("ssm_out_multiplier")?,
            recurrent_projection: projection,
            gate: mlp[0],
            down: mlp[1],
        })
    }

    /// Mamba's or (`falcon`) Falcon Mamba's decoder (with their class's defaults): every layer
    /// a Mamba-1 mixer alone behind its norm, `expand · hidden_size` wide, a step of rank
    /// `time_step_rank` (`⌈hidden_size / 16⌉` where `auto`); Falcon Mamba's step, `B` and `C`
    /// normed without a weight at `mixer_rms_eps`. Their models turn no position and have no
    /// context limit (Strata bounds it at 2²⁰ positions), and their embeddings leave no row
    /// untrained.
    fn mamba(&self, falcon: bool, head: DecoderHead) -> KeyResult<LlamaConfig> {
        self.only("hidden_act", &[json!("silu")], "its convolutions run silu")?;
        let dim = self.required("hidden_size")?;
        let layers = self.int("num_hidden_layers")?.unwrap_or(32);
        let mixer = SelectiveScanConfig {
            inner: (self.float("expand")?.unwrap_or(2.0) * dim as f64) as i64,
            state: self.int("state_size")?.unwrap_or(16),
            conv_kernel: self.int("conv_kernel")?.unwrap_or(4),
            time_step_rank: self.time_step_rank("time_step_rank", dim)?,
            conv_bias: self.flag("use_conv_bias")?.unwrap_or(true),
            proj_bias: self.flag("use_bias")?.unwrap_or(false),
            inner_norms: match falcon {
                true => Some(InnerNorms { eps: self.float("mixer_rms_eps")?.unwrap_or(1e-6), weighted: false }),
                false => None,
            },
        };
        Ok(LlamaConfig {
            norm_eps: self.float("layer_norm_epsilon")?.unwrap_or(1e-5),
            tie_embeddings: self.flag("tie_word_embeddings")?.unwrap_or(true),
            layer_types: Some(vec![LayerAttention::Linear; layers as usize]),
            mixer_alone: true,
            // Its embeddings train every row, the padding token's too.
            selective_scan: Some(mixer),
            head,
            ..LlamaConfig::new(self.int("vocab_size")?.unwrap_or(50_280), MAMBA_CONTEXT, layers, 1, dim)
        })
    }

    /// Nemotron-H's decoder: each layer one sub-layer behind its norm; attention turning no
    /// position and without biases; Mamba-2 mixers; ReLU² feed-forwards and experts without
    /// a gate (with its class's defaults).
    fn nemotron_h(&self, head: DecoderHead) -> KeyResult<LlamaConfig> {
        self.only("mlp_hidden_act", &[json!("relu2")], "its feed-forwards and experts run relu2 without a gate")?;
        self.only("mamba_hidden_act", &[json!("silu")], "its Mamba-2 convolutions run silu")?;
        let kinds = self.nemotron_h_kinds()?;
        let layers = kinds.len() as i64;
        let heads = self.required("num_attention_heads")?;
        let layer_types = kinds
            .iter()
            .map(|kind| match *kind {
                "linear_attention" => LayerAttention::Linear,
                "full_attention" => LayerAttention::Full,
                _ => LayerAttention::FeedForwardOnly,
            })
            .collect();
        let state_space = match kinds.contains(&"linear_attention") {
            true => Some(self.nemotron_h_state_space()?),
            false => None,
        };
        let moe = match kinds.contains(&"moe") {
            true => Some(self.nemotron_h_experts(&kinds)?),
            false => None,
        };
        if moe.is_some() {
            self.only("mlp_bias", &[json!(false)], "biases on the experts' projections are not supported")?;
        }
        Ok(LlamaConfig {
            ffn_dim: Some(self.int("intermediate_size")?.unwrap_or(21504)),
            kv_heads: Some(self.kv_heads(Some(8))?.unwrap_or(heads)),
            head_dim: Some(self.int("head_dim")?.unwrap_or(128)),
            norm_eps: self.float("layer_norm_epsilon")?.unwrap_or(1e-5),
            tie_embeddings: self.flag("tie_word_embeddings")?.unwrap_or(false),
            mlp_bias: self.flag("mlp_bias")?.unwrap_or(false),
            activation: Activation::Relu2,
            unrotated_layers: (0..layers).collect(),
            layer_types: Some(layer_types),
            mixer_alone: true,
            state_space,
            moe,
            dropout: DropoutRates { attention: self.rate("attention_dropout", 0.0)?, ..DropoutRates::NONE },
            head,
            ..LlamaConfig::new(
                self.required("vocab_size")?,
                self.int("max_position_embeddings")?.unwrap_or(4096),
                layers,
                heads,
                self.required("hidden_size")?,
            )
        })
    }

    /// Nemotron-H's layer kinds (`linear_attention`, `full_attention`, `mlp` or `moe`): its
    /// alias `layer_types` (which its class sets last, over the others), else
    /// `layers_block_type` (either with the older `mamba` and `attention`), else the older
    /// `hybrid_override_pattern` (`M`, `*`, `-` and `E`), else its class's four layers.
    fn nemotron_h_kinds(&self) -> KeyResult<Vec<&'static str>> {
        const NAMES: [(&str, &str); 6] = [
            ("linear_attention", "linear_attention"),
            ("mamba", "linear_attention"),
            ("full_attention", "full_attention"),
            ("attention", "full_attention"),
            ("mlp", "mlp"),
            ("moe", "moe"),
        ];
        const PATTERN: [(char, &str); 4] =
            [('M', "linear_attention"), ('*', "full_attention"), ('-', "mlp"), ('E', "moe")];
        for key in ["layer_types", "layers_block_type"] {
            match self.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::Array(kinds)) => {
                    let read = |kind: &Value| {
                        let named = NAMES.iter().find(|(name, _)| kind.as_str() == Some(*name));
                        named.map(|(_, canonical)| *canonical).ok_or_else(|| {
                            format!("config.json: {key} holds {kind}, not linear_attention, full_attention, mlp or moe")
                        })
                    };
                    return kinds.iter().map(read).collect();
                }
                Some(other) => return Err(format!("config.json: {key} is not a list ({other})")),
            }
        }
        match self.text("hybrid_override_pattern")? {
            Some(pattern) => pattern
                .chars()
                .map(|c| {
                    let named = PATTERN.iter().find(|(letter, _)| *letter == c);
                    named.map(|(_, kind)| *kind).ok_or_else(|| {
                        format!("config.json: hybrid_override_pattern holds {c:?}, not one of M, *, - and E")
                    })
                })
                .collect(),
            None => Ok(vec!["linear_attention", "moe", "full_attention", "mlp"]),
        }
    }

    /// Nemotron-H's Mamba-2 sizes, the older `mamba_`-named keys read over the newer ones
    /// as its class reads them; the step bounded below at `time_step_min` and never above,
    /// as its mixers bound it whatever `time_step_limit` says.
    fn nemotron_h_state_space(&self) -> KeyResult<StateSpaceConfig> {
        let key = |older: &'static str, newer: &'static str| if self.cfg.contains_key(older) { older } else { newer };
        Ok(StateSpaceConfig {
            heads: self.int("mamba_num_heads")?.unwrap_or(128),
            head_dim: self.int("mamba_head_dim")?.unwrap_or(64),
            groups: self.int(key("mamba_n_groups", "n_groups"))?.unwrap_or(8),
            state: self.int("ssm_state_size")?.unwrap_or(128),
            conv_kernel: self.int(key("mamba_d_conv", "conv_kernel"))?.unwrap_or(4),
            chunk: self.int(key("mamba_chunk_size", "chunk_size"))?.unwrap_or(128),
            conv_bias: self.flag(key("mamba_conv_bias", "use_conv_bias"))?.unwrap_or(true),
            proj_bias: self.flag("use_bias")?.unwrap_or(false),
            time_step_min: self.float(key("mamba_dt_min", "time_step_min"))?.unwrap_or(0.001).max(0.0),
            time_step_max: None,
            gated_norm: GatedNorm::GateThenNorm,
        })
    }

    /// Nemotron-H's experts on its `moe` layers: `num_experts_per_tok` of `n_routed_experts`
    /// (2 of 8 by default), ReLU² without a gate, chosen by sigmoid scores plus the choice
    /// bias within groups as DeepSeek-V3 chooses, weighted by the renormalised scores times
    /// `routed_scaling_factor`, beside one shared expert, in a latent space `moe_latent_size`
    /// wide where it names one; its class has no load-balancing loss.
    fn nemotron_h_experts(&self, kinds: &[&str]) -> KeyResult<MoeConfig> {
        // Its class sets the alias num_local_experts last, over n_routed_experts.
        let experts = match self.int("num_local_experts")? {
            Some(n) => n,
            None => self.int("n_routed_experts")?.unwrap_or(8),
        };
        Ok(MoeConfig {
            norm_topk: self.flag("norm_topk_prob")?.unwrap_or(true),
            shared_expert_dim: Some(self.int("moe_shared_expert_intermediate_size")?.unwrap_or(7688)),
            shared_gate: false,
            scoring: Scoring::Sigmoid,
            choice_bias: true,
            groups: self.int("n_group")?.unwrap_or(1),
            top_groups: self.int("topk_group")?.unwrap_or(1),
            routed_scale: self.float("routed_scaling_factor")?.unwrap_or(1.0),
            activation: ExpertActivation::UngatedRelu2,
            dense_layers: (0..kinds.len()).filter(|&l| kinds[l] != "moe").map(|l| l as i64).collect(),
            latent_dim: self.int("moe_latent_size")?,
            ..MoeConfig::new(
                experts,
                self.int("num_experts_per_tok")?.unwrap_or(2),
                self.int("moe_intermediate_size")?.unwrap_or(7688),
            )
        })
    }

    /// LFM2's layer kinds: `conv` or `full_attention` each, as `layer_types` lists them,
    /// else the layers `full_attn_idxs` names attending and the others convolving (every
    /// layer attending where neither is given, as its class has it).
    fn lfm2_layers(&self, layers: i64) -> KeyResult<Vec<LayerAttention>> {
        if let Some(types) = self.listed_layer_kinds("layer_types", &LFM2_LAYER_NAMES)? {
            return Ok(types);
        }
        let attending = self.layer_numbers("full_attn_idxs")?.unwrap_or_else(|| (0..layers).collect());
        Ok(attending_on(&attending, layers))
    }

    /// LFM2's feed-forward width: `intermediate_size` (or `block_ff_dim`, which its class
    /// reads over it), which its class adjusts where `block_auto_adjust_ff_dim` is on (the
    /// default): two thirds of it, times `block_ffn_dim_multiplier`, rounded up to a
    /// multiple of `block_multiple_of`.
    fn lfm2_width(&self) -> KeyResult<i64> {
        let given = match self.int("block_ff_dim")? {
            Some(width) => width,
            None => self.int("intermediate_size")?.unwrap_or(12288),
        };
        if !self.flag("block_auto_adjust_ff_dim")?.unwrap_or(true) {
            return Ok(given);
        }
        let two_thirds = (2.0 * given as f64 / 3.0) as i64;
        // The class leaves the width at two thirds where the multiplier is null.
        if self.cfg.get("block_ffn_dim_multiplier").is_some_and(Value::is_null) {
            return Ok(two_thirds);
        }
        let scaled = (self.float("block_ffn_dim_multiplier")?.unwrap_or(1.0) * two_thirds as f64) as i64;
        let multiple = self.int("block_multiple_of")?.unwrap_or(256).max(1);
        Ok(multiple * ((scaled + multiple - 1) / multiple))
    }

    /// LFM2-MoE's experts: `num_experts_per_tok` of `num_experts` (4 of 32 by default),
    /// `moe_intermediate_size` wide, chosen by their sigmoid scores plus the choice bias
    /// `expert_bias` (where `use_expert_bias`), weighted by their scores renormalised with
    /// an epsilon of 1e-6 (where `norm_topk_prob`) times `routed_scaling_factor`, sparse
    /// past the first `num_dense_layers`; its class has no load-balancing loss.
    fn lfm2_moe_experts(&self) -> KeyResult<MoeConfig> {
        let dense = self.int("num_dense_layers")?.unwrap_or(2).max(0);
        Ok(MoeConfig {
            names: ExpertNames::FeedForwardW,
            scoring: Scoring::Sigmoid,
            choice_bias: self.flag("use_expert_bias")?.unwrap_or(true),
            norm_topk: self.flag("norm_topk_prob")?.unwrap_or(true),
            norm_topk_epsilon: 1e-6,
            routed_scale: self.float("routed_scaling_factor")?.unwrap_or(1.0),
            dense_layers: (0..dense).collect(),
            aux_loss_coef: 0.0,
            ..MoeConfig::new(
                self.int("num_experts")?.unwrap_or(32),
                self.int("num_experts_per_tok")?.unwrap_or(4),
                self.int("moe_intermediate_size")?.unwrap_or(1792),
            )
        })
    }

    /// Bamba's layer kinds: attention on the layers `attn_layer_indices` lists, a Mamba-2
    /// mixer on the others (on every layer where it lists none).
    fn bamba_layers(&self, layers: i64) -> KeyResult<Vec<LayerAttention>> {
        let attending = self.layer_numbers("attn_layer_indices")?.unwrap_or_default();
        Ok(attending_on(&attending, layers))
    }

    /// The layer numbers `key` lists; `None` where it is absent (or null).
    fn layer_numbers(&self, key: &str) -> KeyResult<Option<Vec<i64>>> {
        match self.get(key) {
            Some(Value::Array(list)) => list
                .iter()
                .map(|l| l.as_i64().ok_or_else(|| format!("config.json: {key} holds {l}, not a layer number")))
                .collect::<KeyResult<Vec<i64>>>()
                .map(Some),
            Some(other) => Err(format!("config.json: {key} is not a list ({other})")),
            None => Ok(None),
        }
    }

    /// Granite 4's layer kinds (`layer_types`, or `layers_block_type`, which its class reads
    /// over it): `mamba` (or `linear_attention`) and `attention` (or `full_attention`); every
    /// layer a Mamba-2 mixer where neither key is given.
    fn granite4_layers(&self, layers: i64) -> KeyResult<Vec<LayerAttention>> {
        let names = [
            ("mamba", LayerAttention::Linear),
            ("linear_attention", LayerAttention::Linear),
            ("attention", LayerAttention::Full),
            ("full_attention", LayerAttention::Full),
        ];
        for key in ["layers_block_type", "layer_types"] {
            if let Some(types) = self.listed_layer_kinds(key, &names)? {
                return Ok(types);
            }
        }
        Ok((0..layers).map(|_| LayerAttention::Linear).collect())
    }

    /// OLMo Hybrid's layer kinds: `layer_types` (`linear_attention` or `full_attention`),
    /// else every fourth layer full and the others linear, the last full where that makes
    /// none, as its class has it.
    fn olmo_hybrid_layers(&self, layers: i64) -> KeyResult<Vec<LayerAttention>> {
        if let Some(types) = self.layer_types(&["linear_attention", "full_attention"])? {
            if !types.contains(&LayerAttention::Linear) || !types.contains(&LayerAttention::Full) {
                return Err("config.json: layer_types: OLMo Hybrid's class needs a linear_attention layer and a \
                            full_attention one"
                    .into());
            }
            return Ok(types);
        }
        let mut types: Vec<LayerAttention> =
            (0..layers).map(|i| if i % 4 == 3 { LayerAttention::Full } else { LayerAttention::Linear }).collect();
        if let Some(last) = types.last_mut().filter(|_| layers < 4) {
            *last = LayerAttention::Full;
        }
        Ok(types)
    }

    /// OLMo Hybrid's attention turns positions unless its base is null (`rope_parameters`'
    /// `rope_theta`, or the older top-level key), as its released models have it: then
    /// every layer is unrotated.
    fn olmo_hybrid_unrotated(&self, layers: i64) -> KeyResult<Vec<i64>> {
        // Its class fills a base rope_parameters lacks from the top-level key.
        let base = match self.get("rope_parameters") {
            Some(Value::Object(params)) if params.contains_key("rope_theta") => params.get("rope_theta"),
            _ => self.cfg.get("rope_theta"),
        };
        Ok(if base.is_some_and(Value::is_null) { (0..layers).collect() } else { vec![] })
    }

    /// OLMo Hybrid's Gated DeltaNet sizes, with its class's defaults: as many key and value
    /// heads as attention heads, keys `0.75 · hidden_size` over the key heads wide, values
    /// twice that; its projections apart, its betas doubled unless
    /// `linear_allow_neg_eigval` is off, its gated norm's epsilon 1e-5.
    fn olmo_hybrid_linear_attention(&self, dim: i64, heads: i64) -> KeyResult<LinearAttentionConfig> {
        let key_heads = self.int("linear_num_key_heads")?.unwrap_or(heads);
        let key_dim = self.int("linear_key_head_dim")?.unwrap_or((0.75 * dim as f64 / key_heads.max(1) as f64) as i64);
        Ok(LinearAttentionConfig {
            key_heads,
            value_heads: self.int("linear_num_value_heads")?.unwrap_or(heads),
            key_dim,
            value_dim: self.int("linear_value_head_dim")?.unwrap_or(2 * key_dim),
            conv_kernel: self.int("linear_conv_kernel_dim")?.unwrap_or(4),
            split_projections: false,
            apart_projections: true,
            doubled_beta: self.flag("linear_allow_neg_eigval")?.unwrap_or(true),
            gate_norm_eps: Some(1e-5),
        })
    }

    /// Granite 4's attention turns positions where `position_embedding_type` is `rope`, and
    /// none otherwise (its class's default `nope`, or any other value, as its class reads
    /// them): every layer, or none, unrotated.
    fn granite4_unrotated(&self, layers: i64) -> KeyResult<Vec<i64>> {
        match self.text("position_embedding_type")?.as_deref() {
            Some("rope") => Ok(vec![]),
            _ => Ok((0..layers).collect()),
        }
    }

    /// The layers `mlp_layer_types` marks `dense` (the others `sparse`); the first `first`
    /// where the key is absent.
    fn mlp_layer_types(&self, first: i64) -> KeyResult<Vec<i64>> {
        let Some(kinds) = self.get("mlp_layer_types").filter(|v| !v.is_null()) else {
            return Ok((0..first).collect());
        };
        let kinds = kinds.as_array().ok_or_else(|| format!("config.json: mlp_layer_types is not a list ({kinds})"))?;
        let mut dense = vec![];
        for (layer, kind) in kinds.iter().enumerate() {
            match kind.as_str() {
                Some("dense") => dense.push(layer as i64),
                Some("sparse") => {}
                _ => return Err(format!("config.json: mlp_layer_types holds {kind}, not \"dense\" or \"sparse\"")),
            }
        }
        let layers = self.required("num_hidden_layers")?;
        if kinds.len() as i64 != layers {
            return Err(format!("config.json: mlp_layer_types names {} layers of {layers}", kinds.len()));
        }
        Ok(dense)
    }

    /// Qwen3-Next's layer types: `linear_attention` or `full_attention` each, as listed or,
    /// where absent, every `full_attention_interval`-th layer full (4 by default).
    fn linear_layers(&self, layers: i64) -> KeyResult<Vec<LayerAttention>> {
        if let Some(types) = self.layer_types(&["linear_attention", "full_attention"])? {
            return Ok(types);
        }
        let every = self.int("full_attention_interval")?.unwrap_or(4).max(1);
        Ok((0..layers)
            .map(|i| if (i + 1) % every == 0 { LayerAttention::Full } else { LayerAttention::Linear })
            .collect())
    }

    /// `layer_types` as listed, each one of `allowed` (`full_attention`,
    /// `sliding_attention`, `linear_attention`); `None` where the key is absent.
    fn layer_types(&self, allowed: &[&str]) -> KeyResult<Option<Vec<LayerAttention>>> {
        let names: Vec<(&str, LayerAttention)> = [
            ("full_attention", LayerAttention::Full),
            ("sliding_attention", LayerAttention::Sliding),
            ("linear_attention", LayerAttention::Linear),
        ]
        .into_iter()
        .filter(|(name, _)| allowed.contains(name))
        .collect();
        self.listed_layer_kinds("layer_types", &names)
    }

    /// `layer_types`, each entry one of `names`' kinds, refused where absent.
    fn layer_kinds_required(&self, names: &[(&str, LayerAttention)]) -> KeyResult<Vec<LayerAttention>> {
        self.listed_layer_kinds("layer_types", names)?.ok_or_else(|| "config.json: layer_types is missing".to_string())
    }

    /// The list under `key`, each entry one of `names`' kinds; `None` where the key is absent
    /// (its length is checked with the rest of the model's configuration).
    fn listed_layer_kinds(
        &self,
        key: &str,
        names: &[(&str, LayerAttention)],
    ) -> KeyResult<Option<Vec<LayerAttention>>> {
        let types = match self.get(key) {
            Some(Value::Array(types)) => types,
            Some(other) => return Err(format!("config.json: {key} is not a list ({other})")),
            None => return Ok(None),
        };
        let read = |t: &Value| {
            let kind = names.iter().find(|(name, _)| t.as_str() == Some(*name)).map(|(_, kind)| *kind);
            kind.ok_or_else(|| {
                let listed: Vec<&str> = names.iter().map(|(name, _)| *name).collect();
                format!("config.json: {key} holds {t}, not supported ({})", listed.join(" or "))
            })
        };
        types.iter().map(read).collect::<KeyResult<Vec<_>>>().map(Some)
    }

    /// DeepSeek-V3's and Mistral 4's latent attention, as its keys name it (and each class
    /// defaults them); the rotation keys are `class_rope` where the family's class has its own.
    fn latent(&self, family: Family, class_rope: Option<(&str, &Value)>) -> KeyResult<LatentConfig> {
        let (key, params) = match (class_rope, self.get("rope_parameters")) {
            (Some((key, p)), _) => (key, Some(p)),
            (None, Some(p)) => ("rope_parameters", Some(p)),
            (None, None) => ("rope_scaling", self.get("rope_scaling")),
        };
        let mscale_all_dim = match params.and_then(Value::as_object) {
            Some(map) => Keys { cfg: map, prefix: format!("{key}.") }.float("mscale_all_dim")?.unwrap_or(0.0),
            None => 0.0,
        };
        // Each class's sizes where the keys are absent.
        let (q_rank, kv_rank, nope_dim, value_dim) = match family {
            Family::Mistral4 => (1024, 256, 64, 128),
            Family::Glm4MoeLite => (768, 512, 192, 256),
            _ => (1536, 512, 128, 128),
        };
        Ok(LatentConfig {
            q_rank: if self.cfg.contains_key("q_lora_rank") { self.int("q_lora_rank")? } else { Some(q_rank) },
            kv_rank: self.int("kv_lora_rank")?.unwrap_or(kv_rank),
            nope_dim: self.int("qk_nope_head_dim")?.unwrap_or(nope_dim),
            rope_dim: self.int("qk_rope_head_dim")?.unwrap_or(64),
            value_dim: self.int("v_head_dim")?.unwrap_or(value_dim),
            // DeepSeek-V2's class always turns adjacent pairs.
            interleaved: family == Family::DeepseekV2 || self.flag("rope_interleave")?.unwrap_or(true),
            mscale_all_dim,
        })
    }

    /// The experts of a mixture-of-experts family, as its keys name them; `None` for a
    /// dense family.
    fn experts(&self, family: Family) -> KeyResult<Option<MoeConfig>> {
        if family == Family::Gemma4 {
            return self.gemma4_experts();
        }
        if family == Family::Ernie4_5Moe {
            return self.ernie_experts().map(Some);
        }
        if family == Family::HunYuanMoe {
            return self.hunyuan_experts().map(Some);
        }
        if family == Family::Llama4 {
            return self.llama4_experts().map(Some);
        }
        if family == Family::Lfm2Moe {
            return self.lfm2_moe_experts().map(Some);
        }
        if family == Family::Jamba {
            return self.jamba_experts();
        }
        // Granite 4's layers hold experts where it has some.
        if !family.has_experts() || family == Family::GraniteMoeHybrid && self.int("num_local_experts")? == Some(0) {
            return Ok(None);
        }
        if family.routes_like_deepseek() {
            return self.deepseek_experts(family).map(Some);
        }
        // Noise on the router's input in training: a regulariser Strata does not apply.
        self.only("router_jitter_noise", &[json!(0), json!(0.0)], "routing takes no noise")?;
        // Each configuration class's defaults: how many experts, how many a token takes, and
        // (where they have a width of their own) how wide they are.
        let (default_experts, default_top_k, default_width) = match family {
            Family::Mixtral | Family::GraniteMoe | Family::GraniteMoeHybrid => (8, 2, None),
            Family::MiniMaxM2 => (256, 8, None),
            Family::Olmoe => (64, 8, None),
            Family::FlexOlmo => (7, 5, None),
            Family::GptOss => (128, 4, None),
            Family::Qwen2Moe | Family::Qwen3VlMoe => (60, 4, Some(1408)),
            Family::Qwen3Moe => (128, 8, Some(768)),
            Family::Qwen3Next => (512, 10, Some(512)),
            _ => (256, 8, Some(512)),
        };
        let experts = match self.int("num_experts")? {
            Some(n) => n,
            None => self.int("num_local_experts")?.unwrap_or(default_experts),
        };
        let expert_ffn_dim = match default_width {
            Some(width) => self.int("moe_intermediate_size")?.unwrap_or(width),
            None => self.required("intermediate_size")?,
        };
        let norm_topk = match family {
            // gpt-oss's and Granite-MoE's softmax over the top-k logits is the renormalised
            // top-k softmax; Qwen3.5's and Qwen3-VL-MoE's routers always renormalise (their
            // configurations have no such key).
            Family::Mixtral
            | Family::GptOss
            | Family::Qwen3_5Moe
            | Family::Qwen3VlMoe
            | Family::GraniteMoe
            | Family::GraniteMoeHybrid
            | Family::MiniMaxM2 => true,
            Family::Qwen3Next => self.flag("norm_topk_prob")?.unwrap_or(true),
            _ => self.flag("norm_topk_prob")?.unwrap_or(false),
        };
        let qwen = matches!(family, Family::Qwen2Moe | Family::Qwen3Moe | Family::Qwen3VlMoe | Family::Qwen3Next);
        let minimax = family == Family::MiniMaxM2;
        let dense_layers = match qwen {
            true => self.layer_numbers("mlp_only_layers")?.unwrap_or_default(),
            false => vec![],
        };
        let shared_expert_dim = match family {
            // Each configuration class's default where the key is absent.
            Family::Qwen2Moe => Some(self.int("shared_expert_intermediate_size")?.unwrap_or(5632)).filter(|&d| d > 0),
            Family::Qwen3Next | Family::Qwen3_5Moe => {
                Some(self.int("shared_expert_intermediate_size")?.unwrap_or(512)).filter(|&d| d > 0)
            }
            _ => None,
        };
        Ok(Some(MoeConfig {
            norm_topk,
            shared_expert_dim,
            sparse_step: if qwen { self.int("decoder_sparse_step")?.unwrap_or(1) } else { 1 },
            dense_layers,
            aux_loss_coef: self
                .float("router_aux_loss_coef")?
                .unwrap_or(if matches!(family, Family::Olmoe | Family::FlexOlmo) { 0.01 } else { 0.001 }),
            z_loss_coef: self.float("router_z_loss_coef")?.unwrap_or(0.0),
            names: match family {
                Family::Mixtral | Family::MiniMaxM2 => ExpertNames::BlockSparse,
                Family::GptOss => ExpertNames::Stacked,
                Family::GraniteMoe | Family::GraniteMoeHybrid => ExpertNames::InputOutputLinear,
                _ => ExpertNames::Mlp,
            },
            router_bias: family == Family::GptOss,
            expert_bias: family == Family::GptOss,
            // MiniMax-M2 chooses by sigmoid scores plus a choice bias, and its class's loss
            // reads a softmax of the logits.
            scoring: if minimax { Scoring::Sigmoid } else { Scoring::Softmax },
            choice_bias: minimax,
            balance_over_softmax: minimax,
            activation: match family {
                Family::GptOss => ExpertActivation::ClampedSwiglu {
                    alpha: self.float("swiglu_alpha")?.unwrap_or(1.702),
                    limit: self.float("swiglu_limit")?.unwrap_or(7.0),
                },
                _ => ExpertActivation::Silu,
            },
            ..MoeConfig::new(experts, self.int("num_experts_per_tok")?.unwrap_or(default_top_k), expert_ffn_dim)
        }))
    }

    /// Llama 4's experts: `num_experts_per_tok` of `num_local_experts` (1 of 16 by default),
    /// `intermediate_size` wide, chosen by their sigmoid scores, each score scaling its
    /// expert's input; a shared expert of their width without a gate; sparse on the layers
    /// `moe_layers` lists, else every `interleave_moe_layer_step`-th; no load-balancing loss
    /// (its class has none).
    fn llama4_experts(&self) -> KeyResult<MoeConfig> {
        let layers = self.required("num_hidden_layers")?;
        let sparse: Vec<i64> = match self.layer_numbers("moe_layers")? {
            Some(listed) => listed,
            None => {
                let step = self.int("interleave_moe_layer_step")?.unwrap_or(1).max(1);
                (step - 1..layers).step_by(step as usize).collect()
            }
        };
        let width = self.required("intermediate_size")?;
        Ok(MoeConfig {
            shared_expert_dim: Some(width),
            shared_gate: false,
            scoring: Scoring::Sigmoid,
            scale_inputs: true,
            names: ExpertNames::FeedForward,
            dense_layers: (0..layers).filter(|l| !sparse.contains(l)).collect(),
            aux_loss_coef: 0.0,
            ..MoeConfig::new(
                self.int("num_local_experts")?.unwrap_or(16),
                self.int("num_experts_per_tok")?.unwrap_or(1),
                width,
            )
        })
    }

    /// Llama 4's attention: chunks of `attention_chunk_size` (8192 by default) on the layers `layer_types` marks `chunked_attention`, by default those that
    /// turn positions; queries and keys normed without a weight there (`use_qk_norm`); the
    /// others' queries scaled up with their position (`attn_temperature_tuning`, by
    /// `attn_scale` every `floor_scale` positions).
    fn llama4_attention(&self, layers: i64, unrotated: &[i64]) -> KeyResult<Llama4Attention> {
        // Its class builds chunked masks whatever the size: a null one does not run there.
        let chunk = match self.cfg.get("attention_chunk_size") {
            Some(Value::Null) => {
                return Err("config.json: attention_chunk_size is null, with which Llama 4's class cannot attend".into())
            }
            _ => self.int("attention_chunk_size")?.unwrap_or(8192),
        };
        let read = |t: &Value| match t.as_str() {
            Some("chunked_attention") => Ok(LayerAttention::Chunked),
            Some("full_attention") => Ok(LayerAttention::Full),
            _ => Err(format!("config.json: layer_types holds {t}, not chunked_attention or full_attention")),
        };
        let layer_types = match self.get("layer_types") {
            Some(Value::Array(types)) => types.iter().map(read).collect::<KeyResult<Vec<_>>>()?,
            Some(Value::Null) | None => (0..layers)
                .map(|i| match unrotated.contains(&i) {
                    true => LayerAttention::Full,
                    false => LayerAttention::Chunked,
                })
                .collect(),
            Some(other) => return Err(format!("config.json: layer_types is not a list ({other})")),
        };
        let temperature = self.flag("attn_temperature_tuning")?.unwrap_or(true);
        Ok(Llama4Attention {
            chunk,
            layer_types,
            qk_l2_norm: self.flag("use_qk_norm")?.unwrap_or(true),
            query_scaling: match temperature {
                true => Some(QueryScaling {
                    beta: self.float("attn_scale")?.unwrap_or(0.1),
                    every: self.int("floor_scale")?.unwrap_or(8192),
                    from_one: true,
                    unrotated_only: true,
                }),
                false => None,
            },
            dense_width: self.int("intermediate_size_mlp")?.unwrap_or(16384),
        })
    }

    /// HunYuan-MoE's experts: on every layer, `moe_topk` of `num_experts` (a number, or one
    /// per layer, all equal), weighted by their renormalised softmax scores, beside a shared
    /// expert without a gate; the experts and the shared expert `intermediate_size` wide, as
    /// its class builds them; no load-balancing loss (its class has none).
    fn hunyuan_experts(&self) -> KeyResult<MoeConfig> {
        let uniform = |key: &str| -> KeyResult<i64> {
            let values = match self.get(key) {
                None => return Ok(1),
                Some(Value::Array(per_layer)) => per_layer.iter().map(Value::as_i64).collect::<Option<Vec<i64>>>(),
                Some(v) => v.as_i64().map(|n| vec![n]),
            };
            match values.as_deref() {
                Some([first, rest @ ..]) if rest.iter().all(|n| n == first) => Ok(*first),
                _ => Err(format!("config.json: {key} must be a number, or one per layer all equal")),
            }
        };
        let width = self.required("intermediate_size")?;
        // Its class also reads the counts under the other families' names.
        let count = |key: &str, alias: &str| -> KeyResult<i64> {
            match (self.cfg.contains_key(key), self.cfg.contains_key(alias)) {
                (false, true) => uniform(alias),
                _ => uniform(key),
            }
        };
        Ok(MoeConfig {
            norm_topk: true,
            shared_expert_dim: Some(width),
            shared_gate: false,
            names: ExpertNames::SharedMlp,
            aux_loss_coef: self.float("router_aux_loss_coef")?.unwrap_or(0.0),
            ..MoeConfig::new(
                count("num_experts", "num_local_experts")?,
                count("moe_topk", "num_experts_per_tok")?,
                width,
            )
        })
    }

    /// DeepSeek-V3's and GLM-4.5's experts: sigmoid scores with a choice bias, groups, a
    /// routed scale, plain shared experts, the first layers dense (with `transformers`'
    /// defaults for each family where a key is absent).
    fn deepseek_experts(&self, family: Family) -> KeyResult<MoeConfig> {
        let (mistral4, v2) = (family == Family::Mistral4, family == Family::DeepseekV2);
        // Mistral 4's and DeepSeek-V2's routers score by softmax and choose by those scores.
        let softmax = mistral4 || v2;
        // DeepSeek-V2 chooses greedily, or within the groups whose best expert scores highest.
        let group_limited = v2 && self.text("topk_method")?.is_some_and(|m| m == "group_limited_greedy");
        if v2 {
            self.only("scoring_func", &[json!("softmax")], "DeepSeek-V2's router scores by softmax")?;
            self.only(
                "topk_method",
                &[json!("greedy"), json!("group_limited_greedy")],
                "DeepSeek-V2's experts are chosen greedily, or greedily within the best groups",
            )?;
        } else if !mistral4 {
            self.only("scoring_func", &[json!("sigmoid")], "the router scores by sigmoid")?;
            self.only("topk_method", &[json!("noaux_tc")], "experts are chosen by their biased scores within groups")?;
        }
        self.only("moe_layer_freq", &[json!(1)], "every layer past the first dense ones is sparse")?;
        // Each class's defaults: experts, how many a token takes, their width, the dense
        // layers first, groups and how many are chosen, the routed scale.
        let (experts, top_k, width, first_dense, groups, top_groups, routed_scale) = match family {
            Family::DeepseekV3 => (256, 8, 2048, 3, 8, 4, 2.5),
            Family::Glm4MoeLite => (64, 4, 1536, 1, 1, 1, 1.8),
            Family::Mistral4 => (128, 4, 2048, 0, 1, 1, 1.0),
            Family::DeepseekV2 => (64, 6, 1407, 0, 1, 1, 1.0),
            Family::Dots1 => (0, 0, 1408, 0, 1, 1, 1.0),
            Family::SolarOpen => (128, 8, 1280, 0, 1, 1, 1.0),
            _ => (128, 8, 1408, 1, 1, 1, 1.0),
        };
        // dots.llm1's class has no counts of its own: a folder names them.
        let dots1 = family == Family::Dots1;
        let width = self.int("moe_intermediate_size")?.unwrap_or(width);
        let shared = match dots1 {
            true => self.required("n_shared_experts")?,
            false => self.int("n_shared_experts")?.unwrap_or(if v2 { 2 } else { 1 }),
        };
        // GLM-4.7-Flash names each layer dense or sparse (the first dense by default).
        let dense_layers = match family {
            Family::Glm4MoeLite => self.mlp_layer_types(first_dense)?,
            // Solar Open's class has no dense layers (nor the key).
            Family::SolarOpen => vec![],
            _ => (0..self.int("first_k_dense_replace")?.unwrap_or(first_dense).max(0)).collect(),
        };
        Ok(MoeConfig {
            // DeepSeek-V2's router never renormalises, whatever norm_topk_prob says.
            norm_topk: !v2 && self.flag("norm_topk_prob")?.unwrap_or(!dots1),
            shared_expert_dim: (shared > 0).then_some(shared * width),
            shared_gate: false,
            scoring: if softmax { Scoring::Softmax } else { Scoring::Sigmoid },
            choice_bias: !softmax,
            // DeepSeek-V2's greedy choice reads no groups; its class has no default for them.
            groups: match (v2, group_limited) {
                (true, false) => 1,
                (true, true) => self.required("n_group")?,
                (false, _) => self.int("n_group")?.unwrap_or(groups),
            },
            top_groups: match (v2, group_limited) {
                (true, false) => 1,
                (true, true) => self.required("topk_group")?,
                (false, _) => self.int("topk_group")?.unwrap_or(top_groups),
            },
            group_score: if v2 { GroupScore::Best } else { GroupScore::TopTwoSum },
            routed_scale: self.float("routed_scaling_factor")?.unwrap_or(routed_scale),
            dense_layers,
            aux_loss_coef: self.float("router_aux_loss_coef")?.unwrap_or(0.0),
            z_loss_coef: self.float("router_z_loss_coef")?.unwrap_or(0.0),
            ..MoeConfig::new(
                self.deepseek_expert_count(family, experts)?,
                // DeepSeek-V2's class has no count of its own: a folder names it.
                if v2 || dots1 {
                    self.required("num_experts_per_tok")?
                } else {
                    self.int("num_experts_per_tok")?.unwrap_or(top_k)
                },
                width,
            )
        })
    }

    /// How many routed experts a DeepSeek-style family's folder names: `n_routed_experts`,
    /// with each class's alias (DeepSeek-V2's `num_experts` and dots.llm1's and Solar Open's
    /// `num_local_experts`, which those classes set over it; Mistral 4's `num_local_experts`
    /// where it is absent), else `default` (dots.llm1's class has none: a folder names it).
    fn deepseek_expert_count(&self, family: Family, default: i64) -> KeyResult<i64> {
        let (routed, local) = (self.int("n_routed_experts")?, self.int("num_local_experts")?);
        let given = match family {
            Family::DeepseekV2 => self.int("num_experts")?.or(routed),
            Family::Dots1 | Family::SolarOpen => local.or(routed),
            Family::Mistral4 => routed.or(local),
            _ => routed,
        };
        match given {
            Some(n) => Ok(n),
            None if family == Family::Dots1 => self.required("n_routed_experts"),
            None => Ok(default),
        }
    }

    /// The sliding window and which layers it applies to: Mistral's and Phi-3's
    /// `sliding_window` on every layer; Qwen's from `use_sliding_window` on the layers from
    /// `max_window_layers` on; Gemma's on the layers `layer_types` marks (every other layer
    /// for Gemma 2, five of six for Gemma 3, where the list is absent). An explicit
    /// `layer_types` is honoured wherever it is given. LLaMA attends to every earlier
    /// position whatever its config says, as `transformers`' LLaMA does.
    fn windows(
        &self,
        family: Family,
        layers: i64,
        unrotated: &[i64],
    ) -> KeyResult<(Option<i64>, Option<Vec<LayerAttention>>)> {
        use Family::*;
        let window = match family {
            Llama | Arcee | Apertus | Cohere | Gpt2 | Olmo2 | Olmoe | DeepseekV3 | Glm4MoeLite | Mistral4 | Glm4Moe
            | SeedOss | Ernie4_5 | HunYuanDense | HunYuanMoe | Granite | GraniteMoe | Nemotron | MiniMaxM2
            | Qwen3Vl | Qwen3VlMoe | OlmoHybrid | FlexOlmo => return Ok((None, None)),
            Qwen2 | Qwen2_5Vl | Qwen3 | Qwen2Moe | Qwen3Moe | SmolLm3
                if !self.flag("use_sliding_window")?.unwrap_or(false) =>
            {
                None
            }
            _ if !self.cfg.contains_key("sliding_window") => family.class_defaults().window,
            _ => self.int("sliding_window")?,
        };
        let given = self.layer_types(&["full_attention", "sliding_attention"])?;
        let derived = |sliding: &dyn Fn(i64) -> bool| {
            (0..layers).map(|i| if sliding(i) { LayerAttention::Sliding } else { LayerAttention::Full }).collect()
        };
        let types = match (given, family) {
            // These classes slide every layer where a window is set, whatever layer_types says.
            (_, Mistral | Ministral3 | Mixtral | Qwen3Moe | Starcoder2) => None,
            // Five sliding layers of six, and (given or not) the last layer full.
            (types, Gemma4) => {
                let mut types = types.unwrap_or_else(|| derived(&|i| (i + 1) % 6 != 0));
                if let Some(last) = types.last_mut() {
                    *last = LayerAttention::Full;
                }
                Some(types)
            }
            (Some(types), _) => Some(types),
            // dots.llm1 slides from max_window_layers on where a window is set.
            (None, Dots1) => {
                let first = self.int("max_window_layers")?.unwrap_or(62);
                Some(derived(&|i| window.is_some() && i >= first))
            }
            (None, Qwen2 | Qwen2_5Vl | Qwen3) => {
                let first = self.int("max_window_layers")?.unwrap_or(if family == Qwen2_5Vl { 80 } else { 28 });
                Some(derived(&|i| window.is_some() && i >= first))
            }
            // Qwen2-MoE slides every other layer below max_window_layers.
            (None, Qwen2Moe) => {
                let last = self.int("max_window_layers")?.unwrap_or(28);
                Some(derived(&|i| window.is_some() && (i + 1) % 2 != 0 && i < last))
            }
            (None, Gemma2 | GptOss) => Some(derived(&|i| (i + 1) % 2 != 0)),
            (None, Gemma3) => {
                let pattern = self.int("sliding_window_pattern")?.unwrap_or(6).max(1);
                Some(derived(&|i| (i + 1) % pattern != 0))
            }
            (None, Olmo3) => Some(derived(&|i| (i + 1) % 4 != 0)),
            // Every sliding_window_pattern-th layer full (4 by default); none slides without a window.
            (None, Exaone4 | Cohere2) => {
                let pattern = self.int("sliding_window_pattern")?.unwrap_or(4).max(1);
                Some(derived(&|i| window.is_some() && (i + 1) % pattern != 0))
            }
            // SmolLM3 slides the layers that turn no position.
            (None, SmolLm3) => Some(derived(&|i| window.is_some() && unrotated.contains(&i))),
            (None, _) => None,
        };
        if window.is_none() && types.as_ref().is_some_and(|t| t.contains(&LayerAttention::Sliding)) {
            return Err("config.json: layer_types has sliding_attention layers but sliding_window is not set".into());
        }
        Ok((window, types))
    }

    /// ERNIE 4.5's experts: `moe_num_experts` of them `moe_intermediate_size` wide, `moe_k`
    /// per token chosen by their softmax scores plus the choice bias and weighted by the
    /// scores renormalised; `moe_num_shared_experts` of their width every token passes
    /// through; the layers from `moe_layer_start_index` to `moe_layer_end_index` (the last
    /// by default) sparse, every `moe_layer_interval`-th; the load-balancing loss weighted
    /// by `router_aux_loss_coef` (each class's default where a key is absent).
    fn ernie_experts(&self) -> KeyResult<MoeConfig> {
        let layers = self.required("num_hidden_layers")?;
        let width = self.int("moe_intermediate_size")?.unwrap_or(1536);
        let count = |key: &str, alias: &str, default: i64| -> KeyResult<i64> {
            Ok(match self.int(key)? {
                Some(n) => n,
                None => self.int(alias)?.unwrap_or(default),
            })
        };
        let shared = self.int("moe_num_shared_experts")?.unwrap_or(2);
        let shared_width = shared
            .checked_mul(width)
            .ok_or_else(|| format!("config.json: {shared} shared experts {width} wide are too many"))?;
        let start = self.int("moe_layer_start_index")?.unwrap_or(1);
        let end = match self.int("moe_layer_end_index")?.unwrap_or(-1) {
            -1 => layers - 1,
            end => end,
        };
        let mut moe = MoeConfig {
            norm_topk: true,
            shared_expert_dim: (shared > 0).then_some(shared_width),
            shared_gate: false,
            choice_bias: true,
            sparse_step: self.int("moe_layer_interval")?.unwrap_or(1).max(1),
            aux_loss_coef: self.float("router_aux_loss_coef")?.unwrap_or(0.001),
            z_loss_coef: self.float("router_z_loss_coef")?.unwrap_or(0.0),
            names: ExpertNames::MlpStatics,
            ..MoeConfig::new(
                count("moe_num_experts", "num_experts", 64)?,
                count("moe_k", "num_experts_per_tok", 6)?,
                width,
            )
        };
        // The layers the step would make sparse outside the span.
        moe.dense_layers = (0..layers).filter(|&l| (l < start || l > end) && (l + 1) % moe.sparse_step == 0).collect();
        Ok(moe)
    }

    /// What of Gemma 4 Strata does not hold, refused by name: the per-layer embeddings and
    /// key/value sharing of its small models (E2B, E4B; `hidden_size_per_layer_input`, on by
    /// default).
    fn gemma4_refusals(&self) -> KeyResult<()> {
        if self.int("hidden_size_per_layer_input")?.unwrap_or(256) != 0 {
            return Err("config.json: hidden_size_per_layer_input is not 0: Gemma 4's per-layer embeddings (E2B, \
                        E4B) are not supported"
                .into());
        }
        self.only("num_kv_shared_layers", &[json!(0)], "every layer projects its own keys and values")?;
        Ok(())
    }

    /// Gemma 4's experts' block (`enable_moe_block`): on every layer beside the dense
    /// feed-forward, `num_experts` GeGLU experts `moe_intermediate_size` wide, `top_k_experts`
    /// of them per token by a renormalised softmax of a router that norms its input, each
    /// weight scaled per expert; its class trains with no load-balancing loss.
    fn gemma4_experts(&self) -> KeyResult<Option<MoeConfig>> {
        if !self.flag("enable_moe_block")?.unwrap_or(false) {
            return Ok(None);
        }
        let needed = |key: &str| self.required(key).map_err(|e| format!("{e} (enable_moe_block needs it)"));
        Ok(Some(MoeConfig {
            norm_topk: true,
            activation: ExpertActivation::GeluTanh,
            names: ExpertNames::Layer,
            router_norm: true,
            expert_scales: true,
            beside_dense: true,
            aux_loss_coef: self.float("router_aux_loss_coef")?.unwrap_or(0.0),
            ..MoeConfig::new(needed("num_experts")?, needed("top_k_experts")?, needed("moe_intermediate_size")?)
        }))
    }

    /// Gemma 4's global layers' heads: `per_layer_config`'s overrides (the same for every
    /// full layer, and none for a sliding one) where given, else `global_head_dim` (512 by
    /// default) and, where the values are the keys' (`attention_k_eq_v`),
    /// `num_global_key_value_heads`.
    fn gemma4_full_heads(
        &self,
        layers: i64,
        base_head_dim: i64,
        types: Option<&[LayerAttention]>,
    ) -> KeyResult<Option<FullLayerHeads>> {
        let values_from_keys = self.flag("attention_k_eq_v")?.unwrap_or(false);
        let full = |i: usize| types.is_none_or(|t| t.get(i) == Some(&LayerAttention::Full));
        let Some(given) = self.get("per_layer_config") else {
            let kv_heads = if values_from_keys { self.int("num_global_key_value_heads")? } else { None };
            let head_dim = self.int("global_head_dim")?.unwrap_or(512);
            return Ok(full_heads_or_none(base_head_dim, head_dim, kv_heads, values_from_keys));
        };
        let given =
            given.as_object().ok_or_else(|| format!("config.json: per_layer_config is not an object ({given})"))?;
        let mut heads: Option<(Option<i64>, Option<i64>)> = None;
        for (layer, overrides) in given {
            let at = layer.parse::<usize>().ok().filter(|&i| (i as i64) < layers && full(i));
            let overrides =
                overrides.as_object().filter(|o| o.keys().all(|k| k == "head_dim" || k == "num_key_value_heads"));
            let (Some(_), Some(overrides)) = (at, overrides) else {
                return Err(format!(
                    "config.json: per_layer_config.{layer} is not supported (the full layers' head_dim and \
                     num_key_value_heads, the same for each)"
                ));
            };
            let keys = Keys { cfg: overrides, prefix: format!("per_layer_config.{layer}.") };
            let these = (keys.int("head_dim")?, keys.int("num_key_value_heads")?);
            if heads.is_some_and(|h| h != these) {
                return Err("config.json: per_layer_config gives full layers different heads: not supported".into());
            }
            heads = Some(these);
        }
        let covered = (0..layers as usize).filter(|&i| full(i)).all(|i| given.contains_key(&i.to_string()));
        if heads.is_some() && !covered {
            return Err(
                "config.json: per_layer_config gives some full layers other heads than the rest: not supported".into(),
            );
        }
        let (head_dim, kv_heads) = heads.unwrap_or((None, None));
        if kv_heads.is_some() && !values_from_keys {
            return Err("config.json: per_layer_config gives full layers their own num_key_value_heads without \
                        attention_k_eq_v: not supported"
                .into());
        }
        Ok(full_heads_or_none(base_head_dim, head_dim.unwrap_or(base_head_dim), kv_heads, values_from_keys))
    }

    /// The rotation keys of a family whose class turns by a rotation of its own where a
    /// folder names none: the keys given (the older `rope_scaling` first, as these classes
    /// read them), else the class's: Ministral 3's YaRN by 16 from 16,384 positions and
    /// Mistral 4's by 128 from 8,192, both with the queries scaled by position, gpt-oss's
    /// YaRN by 32 from 4,096. `None` for the other families.
    fn class_rope(&self, family: Family) -> Option<(&'static str, Value)> {
        // YaRN with Mistral's query scaling, from `original` positions by `factor`.
        let scaled_yarn = |theta: f64, factor: f64, original: i64| {
            json!({
                "rope_type": "yarn", "rope_theta": theta, "factor": factor,
                "original_max_position_embeddings": original, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
            })
        };
        let class = match family {
            Family::Ministral3 => scaled_yarn(1_000_000.0, 16.0, 16384),
            Family::Mistral4 => scaled_yarn(10_000.0, 128.0, 8192),
            Family::Apertus => json!({
                "rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            }),
            Family::GptOss => json!({
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
                "original_max_position_embeddings": 4096,
            }),
            _ => return None,
        };
        let given = |key: &'static str| Some((key, self.get(key)?.clone()));
        Some(given("rope_scaling").or_else(|| given("rope_parameters")).unwrap_or(("rope_parameters", class)))
    }

    /// The rotations of a family that names one for each kind of layer (Gemma 3, OLMo 3):
    /// `rope_parameters`' `full_attention` and `sliding_attention`. Where a folder has the
    /// older top-level keys instead, `rope_scaling` and `rope_theta` are the full layers'
    /// alone, as `transformers` reads them, and the sliding layers turn plainly at the base
    /// `local_theta_key` gives (else `local_theta`).
    fn ropes_by_layer_kind(
        &self,
        full_theta: f64,
        local_theta_key: Option<&str>,
        local_theta: f64,
        max_positions: i64,
    ) -> KeyResult<(Rope, Rope)> {
        let params = self.get("rope_parameters");
        let nested = |layer: &'static str| {
            let key = if layer == "full_attention" {
                "rope_parameters.full_attention"
            } else {
                "rope_parameters.sliding_attention"
            };
            Some((key, params?.get(layer).filter(|v| !v.is_null())?))
        };
        let full = self.rope(nested("full_attention"), Some("rope_theta"), full_theta, max_positions)?;
        let local = match nested("sliding_attention") {
            Some(p) => self.rope(Some(p), local_theta_key, local_theta, max_positions)?,
            None => Rope::new(match local_theta_key {
                Some(key) => self.float(key)?.unwrap_or(local_theta),
                None => local_theta,
            }),
        };
        Ok((full, local))
    }

    /// Ministral 3's and Mistral 4's scale of their queries by position: their rotation keys'
    /// ([`Self::class_rope`]) `llama_4_scaling_beta`, stepping every
    /// `original_max_position_embeddings` positions.
    /// `transformers` takes the top-level `original_max_position_embeddings` over the
    /// rotation keys' own, and for YaRN the context (`max_position_embeddings`, else the
    /// class's `default_positions`) without either.
    fn query_scaling(&self, rope: &Value, default_positions: i64) -> KeyResult<Option<QueryScaling>> {
        let Value::Object(params) = rope else { return Ok(None) };
        let p = Keys { cfg: params, prefix: "rope_parameters.".into() };
        let Some(beta) = p.float("llama_4_scaling_beta")? else { return Ok(None) };
        let yarn = p.text("rope_type")?.or(p.text("type")?).as_deref() == Some("yarn");
        let every = match (self.int("original_max_position_embeddings")?, p.int("original_max_position_embeddings")?) {
            (Some(every), _) | (None, Some(every)) => every,
            (None, None) if yarn => self.int("max_position_embeddings")?.unwrap_or(default_positions),
            (None, None) => {
                return Err(
                    "config.json: rope_parameters.llama_4_scaling_beta needs original_max_position_embeddings".into()
                )
            }
        };
        Ok(Some(QueryScaling { beta, every, from_one: false, unrotated_only: false }))
    }

    /// SmolLM3's layers that turn no position: the zeros of `no_rope_layers` (one flag per
    /// layer), or where absent every `no_rope_layer_interval`-th layer (4 by default).
    fn unrotated_layers(&self, layers: i64) -> KeyResult<Vec<i64>> {
        match self.get("no_rope_layers") {
            Some(Value::Array(flags)) if flags.len() == layers as usize => flags
                .iter()
                .enumerate()
                .filter_map(|(i, f)| match f.as_i64() {
                    Some(0) => Some(Ok(i as i64)),
                    Some(1) => None,
                    _ => Some(Err(format!("config.json: no_rope_layers holds {f}, not 0 or 1"))),
                })
                .collect(),
            Some(Value::Null) | None => {
                let every = self.int("no_rope_layer_interval")?.unwrap_or(4).max(1);
                Ok((0..layers).filter(|i| (i + 1) % every == 0).collect())
            }
            Some(other) => Err(format!("config.json: no_rope_layers is not a list of {layers} flags ({other})")),
        }
    }

    /// A rotation from a `rope_parameters` dict (transformers 5) or the older top-level
    /// `theta_key` with `rope_scaling`; `max_positions` is the context the scaling keys
    /// default to. Types other than default, linear, dynamic, yarn, llama3, longrope and proportional are refused
    /// by name.
    fn rope(
        &self,
        params: Option<(&str, &Value)>,
        theta_key: Option<&str>,
        theta: f64,
        max_positions: i64,
    ) -> KeyResult<Rope> {
        let (key, params) = match params {
            Some((key, p)) => (key, Some(p)),
            None => ("rope_scaling", self.get("rope_scaling")),
        };
        let empty = Map::new();
        let map = match params {
            Some(Value::Object(m)) => m,
            Some(other) => return Err(format!("config.json: {key} is not an object ({other})")),
            None => &empty,
        };
        let p = Keys { cfg: map, prefix: format!("{key}.") };
        let theta = match (p.float("rope_theta")?, theta_key) {
            (Some(t), _) => t,
            (None, Some(key)) => self.float(key)?.unwrap_or(theta),
            (None, None) => theta,
        };
        let partial = match p.float("partial_rotary_factor")? {
            Some(f) => f,
            None => self.float("partial_rotary_factor")?.unwrap_or(1.0),
        };
        let kind = match p.text("rope_type")? {
            Some(t) => t,
            None => p.text("type")?.unwrap_or_else(|| "default".into()),
        };
        let factor = || p.float("factor")?.ok_or_else(|| format!("config.json: {key}.factor is missing"));
        // The context the checkpoint was trained at: Phi-3 keeps it at the top level.
        let original = || -> KeyResult<i64> {
            Ok(match self.int("original_max_position_embeddings")? {
                Some(n) => n,
                None => p.int("original_max_position_embeddings")?.unwrap_or(max_positions),
            })
        };
        let proportional = kind == "proportional";
        let scaling = match kind.as_str() {
            // Qwen2-VL's sections per axis: one rotation where every axis is the text position.
            "default" | "mrope" => RopeScaling::None,
            "proportional" => match p.float("factor")?.unwrap_or(1.0) {
                1.0 => RopeScaling::None,
                factor => RopeScaling::Linear { factor },
            },
            "linear" => RopeScaling::Linear { factor: factor()? },
            "dynamic" => RopeScaling::Dynamic { factor: factor()?, original_context: max_positions },
            "yarn" => {
                let original_context = original()?;
                let factor = match p.float("factor")? {
                    Some(f) => f,
                    None => max_positions as f64 / original_context as f64,
                };
                let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let attention_factor = match (p.float("attention_factor")?, p.float("mscale")?, p.float("mscale_all_dim")?) {
                    (Some(a), ..) => a,
                    (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(factor, m) / mscale(factor, all),
                    _ => mscale(factor, 1.0),
                };
                RopeScaling::Yarn {
                    factor,
                    original_context,
                    beta_fast: p.float("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
                    beta_slow: p.float("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
                    attention_factor,
                    truncate: p.flag("truncate")?.unwrap_or(true),
                }
            }
            "longrope" => {
                let factors = |key: &str| -> KeyResult<Vec<f64>> {
                    match p.get(key) {
                        Some(Value::Array(values)) => values
                            .iter()
                            .map(|v| v.as_f64().ok_or_else(|| format!("config.json: {key}s are not all numbers")))
                            .collect(),
                        _ => Err(format!("config.json: rope_parameters.{key} is missing or not a list")),
                    }
                };
                let original_context = original()?;
                let factor = match p.float("factor")? {
                    Some(f) => f,
                    None => max_positions as f64 / original_context as f64,
                };
                let attention_factor = match p.float("attention_factor")? {
                    Some(a) => a,
                    None if factor <= 1.0 => 1.0,
                    None => (1.0 + factor.ln() / (original_context as f64).ln()).sqrt(),
                };
                RopeScaling::LongRope {
                    short: factors("short_factor")?,
                    long: factors("long_factor")?,
                    original_context,
                    attention_factor,
                }
            }
            "llama3" => RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: p.float("low_freq_factor")?.ok_or(format!("config.json: {key}.low_freq_factor is missing"))?,
                high_freq_factor: p
                    .float("high_freq_factor")?
                    .ok_or(format!("config.json: {key}.high_freq_factor is missing"))?,
                original_context: original()?,
            },
            other => {
                return Err(format!(
                    "config.json: {key} type {other:?} is not supported (Strata scales rotary embeddings as default, linear, dynamic, yarn, llama3, longrope or proportional)"
                ))
            }
        };
        Ok(Rope { theta, scaling, partial, proportional })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decoder a `config.json` of `family` with these keys (beside a small base) reads as.
    fn read(family: Family, keys: Value) -> KeyResult<LlamaConfig> {
        let mut cfg = json!({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "num_hidden_layers": 3, "intermediate_size": 48, "vocab_size": 96});
        for (k, v) in keys.as_object().into_iter().flatten() {
            cfg[k] = v.clone();
        }
        Keys { cfg: cfg.as_object().unwrap(), prefix: String::new() }.decoder(family)
    }

    #[test]
    fn windows_apply_where_each_family_says() {
        let window = json!({"sliding_window": 4});
        let llama = read(Family::Llama, window.clone()).unwrap();
        assert_eq!((llama.sliding_window, llama.layer_types), (None, None), "LLaMA has no window");
        let mistral = read(Family::Mistral, window.clone()).unwrap();
        assert_eq!((0..3).map(|i| mistral.window(i)).collect::<Vec<_>>(), [Some(4); 3]);
        assert_eq!(read(Family::Qwen2, window).unwrap().sliding_window, None, "without use_sliding_window");
        let qwen =
            read(Family::Qwen3, json!({"sliding_window": 4, "use_sliding_window": true, "max_window_layers": 1}))
                .unwrap();
        assert_eq!((0..3).map(|i| qwen.window(i)).collect::<Vec<_>>(), [None, Some(4), Some(4)]);
        let gemma2 = read(Family::Gemma2, json!({"sliding_window": 4})).unwrap();
        assert_eq!((0..3).map(|i| gemma2.window(i)).collect::<Vec<_>>(), [Some(4), None, Some(4)]);
        assert_eq!((gemma2.attn_softcap, gemma2.logit_softcap), (Some(50.0), Some(30.0)), "Gemma 2's defaults");
        // The mixtures of experts by their own classes: Qwen2-MoE slides every other layer below
        // max_window_layers, Qwen3-MoE every layer, both 4096 positions unless told.
        let asked = json!({"use_sliding_window": true, "max_window_layers": 3, "num_hidden_layers": 4});
        let qwen2_moe = read(Family::Qwen2Moe, asked.clone()).unwrap();
        assert_eq!((0..4).map(|i| qwen2_moe.window(i)).collect::<Vec<_>>(), [Some(4096), None, Some(4096), None]);
        let qwen3_moe = read(Family::Qwen3Moe, asked).unwrap();
        assert_eq!((0..4).map(|i| qwen3_moe.window(i)).collect::<Vec<_>>(), [Some(4096); 4]);
        let full = json!(["full_attention", "full_attention", "full_attention"]);
        let mixtral = read(Family::Mixtral, json!({"sliding_window": 4, "layer_types": full})).unwrap();
        assert_eq!(mixtral.window(1), Some(4), "Mixtral slides every layer where a window is set");
        let long = read(Family::Mistral, json!({"sliding_window": 4, "max_position_embeddings": 64})).unwrap();
        assert_eq!(long.ctx, 64, "a window is no cap on the context");
    }

    #[test]
    fn rotations_come_from_either_format_and_gemma3_nests_them_by_layer_type() {
        let llama3 = json!({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16});
        let new = read(Family::Llama, json!({"rope_parameters": llama3.clone()})).unwrap();
        let mut old_scaling = llama3;
        old_scaling.as_object_mut().unwrap().remove("rope_theta");
        let old = read(Family::Llama, json!({"rope_scaling": old_scaling, "rope_theta": 5e5})).unwrap();
        assert_eq!(new.rope(), old.rope());
        assert!(matches!(new.rope_scaling, RopeScaling::Llama3 { original_context: 16, .. }));
        // Both given: the configuration classes read rope_scaling (with the top-level
        // rope_theta), and its keys are named in errors.
        let both = json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 5e5,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}});
        let both = read(Family::Llama, both).unwrap();
        assert_eq!(both.rope(), Rope { scaling: RopeScaling::Linear { factor: 2.0 }, ..Rope::new(5e5) });
        let broken = json!({"rope_scaling": {"rope_type": "linear"}, "rope_parameters": {"rope_type": "default"}});
        assert!(read(Family::Llama, broken).unwrap_err().contains("rope_scaling.factor is missing"));
        let gemma3 = read(
            Family::Gemma3,
            json!({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
        )
        .unwrap();
        assert_eq!(gemma3.rope(), Rope { scaling: RopeScaling::Linear { factor: 2.0 }, ..Rope::new(1e6) });
        assert_eq!(gemma3.local_rope, Some(Rope::new(1e4)));
        let dynamic = read(
            Family::Llama,
            json!({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0},
                                                 "max_position_embeddings": 8}),
        )
        .unwrap();
        assert_eq!(dynamic.ctx, 32, "dynamic scaling stretches the context by its factor");
    }

    /// GLM-4's sandwich norms go by GLM's names in its folders and by Strata's (Gemma's) in
    /// the model, each way; its other names, and other families' norms, are as they are.
    #[test]
    fn glm4_norms_take_glm_names_both_ways() {
        let glm = [
            ("post_attention_layernorm", "post_self_attn_layernorm"),
            ("pre_feedforward_layernorm", "post_attention_layernorm"),
            ("post_feedforward_layernorm", "post_mlp_layernorm"),
        ];
        for (strata, hf) in glm {
            let (strata, hf) = (format!("model.layers.3.{strata}.weight"), format!("model.layers.3.{hf}.weight"));
            assert_eq!(Family::Glm4.hf_name(&strata).0, hf);
            assert_eq!(Family::Glm4.strata_name(&hf).unwrap().0, strata);
            assert_eq!(Family::Gemma2.hf_name(&strata).0, strata);
        }
        for same in
            ["model.layers.0.input_layernorm.weight", "model.norm.weight", "model.layers.1.mlp.gate_up_proj.weight"]
        {
            assert_eq!(
                (Family::Glm4.hf_name(same).0, Family::Glm4.strata_name(same).unwrap().0),
                (same.into(), same.into())
            );
        }
    }

    /// Older keys the classes read over the newer ones, and the options Strata refuses by
    /// name rather than reading otherwise than the classes do.
    #[test]
    fn older_keys_win_and_unread_options_are_named() {
        let lfm2 = read(
            Family::Lfm2,
            json!({"tie_word_embeddings": true, "tie_embedding": false, "block_ff_dim": 96,
                   "block_auto_adjust_ff_dim": false, "layer_types": ["conv", "full_attention", "conv"]}),
        )
        .unwrap();
        assert_eq!((lfm2.tie_embeddings, lfm2.ffn_dim), (false, Some(96)));
        let granite = read(
            Family::GraniteMoeHybrid,
            json!({"num_local_experts": 0, "mamba_n_heads": 4, "layer_types": ["attention", "attention", "attention"],
                   "layers_block_type": ["mamba", "attention", "mamba"]}),
        )
        .unwrap();
        assert_eq!((0..3).map(|l| granite.is_linear(l)).collect::<Vec<_>>(), [true, false, true]);
        let v2 = read(Family::DeepseekV2, json!({"num_experts": 6, "n_routed_experts": 4, "num_experts_per_tok": 2}));
        assert_eq!(v2.unwrap().moe.map(|m| m.experts), Some(6));
        // dots.llm1's class leaves its routing weights as they are unless asked.
        let dots1 =
            read(Family::Dots1, json!({"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1}));
        let moe = dots1.unwrap().moe.unwrap();
        assert_eq!((moe.norm_topk, moe.shared_expert_dim, moe.dense_layers.len()), (false, Some(1408), 0));
        // Solar Open's class has no dense layers and no bias on the attention's output.
        let solar = read(
            Family::SolarOpen,
            json!({"first_k_dense_replace": 2, "attention_bias": true, "n_routed_experts": 16, "num_local_experts": 8}),
        )
        .unwrap();
        let moe = solar.moe.as_ref().unwrap();
        assert_eq!((moe.dense_layers.len(), moe.norm_topk, solar.qkv_bias, solar.o_bias), (0, true, true, false));
        assert_eq!(moe.experts, 8, "its class sets num_local_experts over n_routed_experts");
        let refused = [
            (Family::DeepseekV2, json!({}), "num_experts_per_tok is missing"),
            (
                Family::DeepseekV2,
                json!({"num_experts_per_tok": 2, "topk_method": "group_limited_greedy"}),
                "n_group is missing",
            ),
            (Family::DeepseekV2, json!({"num_experts_per_tok": 2, "topk_method": "noaux_tc"}), "noaux_tc"),
            (Family::Bamba, json!({"mamba_n_heads": 4, "z_loss_coefficient": 0.1}), "z-loss"),
            (Family::Lfm2Moe, json!({"num_experts": 4, "num_experts_per_tok": 2}), "layer_types is missing"),
            (Family::Dots1, json!({"num_experts_per_tok": 2, "n_shared_experts": 1}), "n_routed_experts is missing"),
            (Family::Dots1, json!({"n_routed_experts": 4, "num_experts_per_tok": 2}), "n_shared_experts is missing"),
            (
                Family::GraniteMoeHybrid,
                json!({"num_local_experts": 0, "mamba_n_heads": 4, "time_step_limit": ["Infinity", 1.0]}),
                "bounds every step away",
            ),
        ];
        for (family, keys, why) in refused {
            let error = read(family, keys).unwrap_err();
            assert!(error.contains(why), "{family:?}: {error}");
        }
    }

    /// Nemotron-H's layer kinds as its class reads them: its alias `layer_types` over
    /// `layers_block_type` (with the older `mamba` and `attention`), over the older
    /// `hybrid_override_pattern`; `num_local_experts` over `n_routed_experts`; the older `mamba_`-named sizes over the newer ones; the step
    /// bounded below at `time_step_min` whatever `time_step_limit` says; what it cannot run
    /// refused by name.
    #[test]
    fn nemotron_h_kinds_and_older_keys_read_as_its_class_reads_them() {
        use LayerAttention::{FeedForwardOnly as Ffn, Full, Linear};
        let kinds = |keys: Value| read(Family::NemotronH, keys).map(|c| c.layer_types.unwrap_or_default());
        let pattern = json!({"hybrid_override_pattern": "M-*E", "n_routed_experts": 4, "num_experts_per_tok": 2});
        assert_eq!(kinds(pattern.clone()).unwrap(), [Linear, Ffn, Full, Ffn]);
        let alias = json!({"layer_types": ["mamba", "mlp", "attention"], "hybrid_override_pattern": "M-*E"});
        assert_eq!(kinds(alias).unwrap(), [Linear, Ffn, Full]);
        let both = json!({"layers_block_type": ["full_attention", "mlp"], "layer_types": ["mamba"]});
        assert_eq!(kinds(both).unwrap(), [Linear]);
        // Its class's four layers where nothing names them.
        assert_eq!(kinds(json!({"n_routed_experts": 4})).unwrap(), [Linear, Ffn, Full, Ffn]);
        let c = read(
            Family::NemotronH,
            json!({"hybrid_override_pattern": "M-*E", "n_routed_experts": 6, "num_local_experts": 4, "num_experts_per_tok": 2,
                   "mamba_num_heads": 4, "n_groups": 1, "mamba_n_groups": 2, "mamba_dt_min": 0.02,
                   "time_step_min": 0.5, "time_step_limit": [0.0, 1.0], "use_bias": true, "moe_latent_size": 16}),
        )
        .unwrap();
        let mamba = c.state_space.unwrap();
        assert_eq!((mamba.groups, mamba.time_step_min, mamba.time_step_max, mamba.proj_bias), (2, 0.02, None, true));
        let moe = c.moe.unwrap();
        assert_eq!((0..4).map(|l| moe.is_sparse(l)).collect::<Vec<_>>(), [false, false, false, true]);
        assert_eq!((moe.latent_dim, moe.experts), (Some(16), 4));
        assert_eq!((c.mixer_alone, c.unrotated_layers.len(), c.padding_token), (true, 4, None));
        let refused = [
            (json!({"hybrid_override_pattern": "M-X"}), "holds 'X'"),
            (json!({"layers_block_type": ["mamba", "sliding_attention"]}), "not linear_attention"),
            (json!({"mlp_hidden_act": "silu"}), "mlp_hidden_act = \"silu\" is not supported"),
            (json!({"mlp_bias": true, "n_routed_experts": 4}), "biases on the experts' projections"),
        ];
        for (keys, why) in refused {
            let error = read(Family::NemotronH, keys).unwrap_err();
            assert!(error.contains(why), "{error}");
        }
    }

    /// Falcon-H1's keys as its class reads them: every layer hybrid; the mixer's width from
    /// `mamba_d_ssm` (1024 by default), from `mamba_expand` where that is null; its norm none
    /// unless `mamba_rms_norm`, then before the gate unless `mamba_norm_before_gate` is
    /// false; its μP multipliers 1 where absent; what it cannot run refused by name.
    #[test]
    fn falcon_h1_reads_its_mixers_and_multipliers_as_its_class_reads_them() {
        let c = read(Family::FalconH1, json!({})).unwrap();
        assert_eq!(c.layer_types.as_deref(), Some(&[LayerAttention::Hybrid; 3][..]));
        assert!((0..3).all(|l| c.is_hybrid(l) && !c.is_linear(l)));
        let m = c.state_space.as_ref().unwrap();
        assert_eq!((m.inner(), m.heads, m.head_dim, m.gated_norm), (1024, 128, 8, GatedNorm::GateAlone));
        let mup = c.mup.unwrap();
        assert!(mup.recurrent_projection.iter().chain(&[mup.embeddings, mup.keys, mup.gate]).all(|&v| v == 1.0));
        let norm = |keys: Value| read(Family::FalconH1, keys).unwrap().state_space.unwrap().gated_norm;
        assert_eq!(norm(json!({"mamba_rms_norm": true})), GatedNorm::NormThenGate);
        let after = json!({"mamba_rms_norm": true, "mamba_norm_before_gate": false});
        assert_eq!(norm(after), GatedNorm::GateThenNorm);
        let c = read(
            Family::FalconH1,
            json!({"mamba_d_ssm": null, "mamba_expand": 3, "mamba_n_heads": 4, "ssm_multipliers": [1, 2, 3, 4, 5],
                   "mlp_multipliers": [0.5, 0.25], "key_multiplier": 0.7, "lm_head_multiplier": 0.1}),
        )
        .unwrap();
        assert_eq!((c.state_space.unwrap().inner(), c.mup.unwrap().recurrent_projection), (96, [1., 2., 3., 4., 5.]));
        let mup = c.mup.unwrap();
        assert_eq!((mup.gate, mup.down, mup.keys, mup.logits), (0.5, 0.25, 0.7, 0.1));
        let refused = [
            (json!({"mamba_proj_bias": true}), "on both or on neither"),
            (json!({"mlp_multipliers": [1.0]}), "mlp_multipliers is not a list of 2 numbers"),
            (json!({"ssm_multipliers": [1, 1, 1, 1, "x"]}), "holds \"x\""),
            (json!({"mamba_d_ssm": 100, "mamba_n_heads": 8}), "are not mamba_d_ssm 100"),
        ];
        for (keys, why) in refused {
            let error = read(Family::FalconH1, keys).unwrap_err();
            assert!(error.contains(why), "{error}");
        }
    }

    /// Jamba's keys as its class reads them: attention every `attn_layer_period`-th layer
    /// from `attn_layer_offset` (8 and 4), turning no position; experts every
    /// `expert_layer_period`-th from `expert_layer_offset` (2 and 1), none where
    /// `num_experts` is 1; the step's rank `⌈hidden_size / 16⌉` where `auto`; a layer period
    /// that cannot hold its offset refused; written back, the periods found again.
    #[test]
    fn jamba_reads_its_layer_periods_and_mixers_as_its_class_reads_them() {
        use LayerAttention::{Full, Linear};
        let c = read(Family::Jamba, json!({"num_hidden_layers": 10})).unwrap();
        let kinds = [Linear, Linear, Linear, Linear, Full, Linear, Linear, Linear, Linear, Linear];
        assert_eq!(c.layer_types.as_deref(), Some(&kinds[..]));
        assert_eq!(c.unrotated_layers, (0..10).collect::<Vec<_>>());
        let moe = c.moe.as_ref().unwrap();
        let sparse: Vec<i64> = (0..10).filter(|&l| moe.is_sparse(l)).collect();
        assert_eq!((moe.experts, moe.top_k, moe.norm_topk, sparse), (16, 2, false, vec![1, 3, 5, 7, 9]));
        let s = c.selective_scan.as_ref().unwrap();
        assert_eq!((s.inner, s.state, s.time_step_rank), (64, 16, 2));
        assert_eq!(s.inner_norms, Some(InnerNorms { eps: 1e-6, weighted: true }));
        assert_eq!(c.feed_forward_module(), "feed_forward");
        let json = Family::Jamba.config_json(&ModelConfig::Llama(c.clone()), &Map::new()).unwrap();
        let keys = ["attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset"];
        assert_eq!(keys.map(|k| json[k].as_i64()), [Some(6), Some(4), Some(2), Some(1)]);
        let back = read(Family::Jamba, json).unwrap();
        assert_eq!(
            (&back.layer_types, &back.moe, &back.selective_scan, &back.unrotated_layers),
            (&c.layer_types, &c.moe, &c.selective_scan, &c.unrotated_layers),
            "written back, read the same"
        );
        let dense = read(Family::Jamba, json!({"num_experts": 1, "attn_layer_period": 3, "attn_layer_offset": 0}));
        let dense = dense.unwrap();
        assert_eq!((dense.moe.is_none(), dense.layer_types.unwrap()), (true, vec![Full, Linear, Linear]));
        let error = read(Family::Jamba, json!({"expert_layer_period": 2, "expert_layer_offset": 2})).unwrap_err();
        assert!(error.contains("expert_layer_offset 2 is not within expert_layer_period 2"), "{error}");
    }

    /// OLMo Hybrid's class's defaults: every fourth layer full (the last where that makes
    /// none), linear attention with its sizes from the heads and hidden size, betas doubled;
    /// its attention turns positions unless the base is null.
    #[test]
    fn olmo_hybrid_reads_its_class_defaults() {
        use LayerAttention::{Full, Linear};
        let c = read(Family::OlmoHybrid, json!({})).unwrap();
        assert_eq!(c.layer_types.as_deref(), Some(&[Linear, Linear, Full][..]));
        let l = c.linear_attention.as_ref().unwrap();
        assert_eq!((l.key_heads, l.value_heads, l.key_dim, l.value_dim), (4, 4, 6, 12));
        assert_eq!((l.apart_projections, l.doubled_beta, l.gate_norm_eps), (true, true, Some(1e-5)));
        assert_eq!((c.recurrent_pre_norms, c.post_norms, c.qk_norm_whole), (true, true, true));
        assert!(c.unrotated_layers.is_empty(), "its class's default base turns positions");
        for nope in [
            json!({"rope_parameters": {"rope_type": "default", "rope_theta": null}}),
            json!({"rope_theta": null}),
            json!({"rope_parameters": {"rope_type": "default"}, "rope_theta": null}),
        ] {
            assert_eq!(read(Family::OlmoHybrid, nope).unwrap().unrotated_layers, [0, 1, 2]);
        }
        let kept = read(Family::OlmoHybrid, json!({"linear_allow_neg_eigval": false, "num_hidden_layers": 8})).unwrap();
        assert!(!kept.linear_attention.unwrap().doubled_beta);
        assert_eq!(kept.layer_types.unwrap().iter().filter(|&&t| t == Full).count(), 2);
        let all_linear = read(
            Family::OlmoHybrid,
            json!({"layer_types": ["linear_attention", "linear_attention", "linear_attention"]}),
        )
        .unwrap_err();
        assert!(all_linear.contains("needs a linear_attention layer and a full_attention one"), "{all_linear}");
    }

    /// peft names adapters as `transformers` holds the modules in memory: the family's file
    /// names as its conversion renames them on reading; a LoRA strategy's targets may use
    /// those names beside Strata's.
    #[test]
    fn adapters_take_the_names_transformers_holds_modules_by() {
        let pairs = [
            (
                Family::NemotronH,
                "model.layers.0.mamba.in_proj.lora_A.weight",
                "model.layers.0.mixer.in_proj.lora_A.weight",
            ),
            (Family::NemotronH, "model.embed_tokens.weight", "model.embeddings.weight"),
            (
                Family::Lfm2,
                "model.layers.1.mlp.gate_proj.lora_B.weight",
                "model.layers.1.feed_forward.w1.lora_B.weight",
            ),
            (Family::Mixtral, "model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.mlp.gate.weight"),
            (
                Family::Mixtral,
                "model.layers.0.block_sparse_moe.experts.base_layer.lora_A.weight",
                "model.layers.0.mlp.experts.base_layer.lora_A.weight",
            ),
            (
                Family::GraniteMoe,
                "model.layers.2.block_sparse_moe.router.layer.weight",
                "model.layers.2.block_sparse_moe.router.weight",
            ),
            (Family::OlmoHybrid, "model.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight"),
            (
                Family::Llama,
                "model.layers.0.self_attn.q_proj.lora_A.weight",
                "model.layers.0.self_attn.q_proj.lora_A.weight",
            ),
        ];
        for (family, strata, held) in pairs {
            assert_eq!(family.memory_name(strata), held, "{family:?}");
            assert_eq!(family.from_memory_name(held).as_deref(), Some(strata), "{family:?}");
        }
        let lfm2 = read(
            Family::Lfm2,
            json!({"layer_types": ["conv", "full_attention", "conv"], "block_auto_adjust_ff_dim": false}),
        )
        .unwrap();
        let mut spec = ModelConfig::Llama(lfm2).spec().unwrap();
        let lora = json!([["lora", {"r": 2, "alpha": 2, "target_modules": ["w1", "out_proj"],
                                    "modules_to_save": ["embedding_norm"], "alpha_pattern": {"feed_forward.w1": 8}}]]);
        crate::strategy::Strategy::from_value(&lora).unwrap().lora().unwrap().apply(&mut spec).unwrap();
        let trained: Vec<&str> = spec
            .params
            .iter()
            .filter(|p| p.requires_grad && !p.name.contains("lora_"))
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(trained, ["model.norm.weight"], "LFM2's final norm is its embedding_norm");
        let scale =
            |name: &str| spec.adapters.iter().find(|(w, _)| spec.params[w.0].name == name).map(|(_, a)| a.scale);
        assert_eq!(scale("model.layers.0.mlp.gate_proj.weight"), Some(4.0), "alpha_pattern by LFM2's name");
        assert_eq!(scale("model.layers.1.self_attn.o_proj.weight"), Some(1.0));
        // Nemotron-H's stacked experts by its own name (`mixer.experts`): found, and refused
        // as experts without a gate.
        let nemotron = read(
            Family::NemotronH,
            json!({"n_routed_experts": 4, "num_experts_per_tok": 2, "mamba_num_heads": 4, "mamba_head_dim": 8,
                   "n_groups": 1, "ssm_state_size": 4, "moe_intermediate_size": 8, "head_dim": 8,
                   "moe_shared_expert_intermediate_size": 8}),
        )
        .unwrap();
        let mut experts = ModelConfig::Llama(nemotron).spec().unwrap();
        let lora = json!([["lora", {"r": 2, "target_parameters": ["mixer.experts.up_proj"]}]]);
        let refused = crate::strategy::Strategy::from_value(&lora).unwrap().lora().unwrap().apply(&mut experts);
        let refused = refused.unwrap_err().to_string();
        assert!(refused.contains("stacks the experts in another layout"), "{refused}");
        let mut adapted: Vec<&str> = spec.adapters.keys().map(|w| spec.params[w.0].name.as_str()).collect();
        adapted.sort_unstable();
        assert_eq!(
            adapted,
            [
                "model.layers.0.conv.out_proj.weight",
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.1.mlp.gate_proj.weight",
                "model.layers.1.self_attn.o_proj.weight",
                "model.layers.2.conv.out_proj.weight",
                "model.layers.2.mlp.gate_proj.weight",
            ]
        );
    }

    /// Nemotron-H's names: everything under `backbone.`, each layer's norm `norm` and its one
    /// sub-layer `mixer`, told apart on reading by the mixer's modules (`transformers`' own
    /// `model.` names read alike).
    #[test]
    fn nemotron_h_names_tell_each_mixer_by_its_modules() {
        let pairs = [
            ("model.embed_tokens.weight", "backbone.embeddings.weight"),
            ("model.norm.weight", "backbone.norm_f.weight"),
            ("lm_head.weight", "lm_head.weight"),
            ("model.layers.0.input_layernorm.weight", "backbone.layers.0.norm.weight"),
            ("model.layers.0.mamba.norm.weight", "backbone.layers.0.mixer.norm.weight"),
            ("model.layers.0.mamba.A_log", "backbone.layers.0.mixer.A_log"),
            ("model.layers.2.self_attn.o_proj.weight", "backbone.layers.2.mixer.o_proj.weight"),
            ("model.layers.3.mlp.up_proj.weight", "backbone.layers.3.mixer.up_proj.weight"),
            ("model.layers.1.mlp.gate.e_score_correction_bias", "backbone.layers.1.mixer.gate.e_score_correction_bias"),
            ("model.layers.11.mlp.experts.3.down_proj.weight", "backbone.layers.11.mixer.experts.3.down_proj.weight"),
            (
                "model.layers.1.mlp.shared_experts.up_proj.weight",
                "backbone.layers.1.mixer.shared_experts.up_proj.weight",
            ),
        ];
        for (strata, hf) in pairs {
            assert_eq!(Family::NemotronH.hf_name(strata), (hf.to_string(), false));
            assert_eq!(Family::NemotronH.strata_name(hf), Some((strata.to_string(), false)));
        }
        let internal = Family::NemotronH.strata_name("model.layers.4.mixer.in_proj.weight");
        assert_eq!(internal, Some(("model.layers.4.mamba.in_proj.weight".to_string(), false)));
    }

    /// `mrope` is the default rotation for Qwen2.5-VL's language model alone, as in
    /// `transformers`; another family naming it is refused.
    #[test]
    fn mrope_is_read_for_qwen2_5_vl_alone() {
        let keys = json!({"rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}});
        assert_eq!(read(Family::Qwen2_5Vl, keys.clone()).unwrap().rope_scaling, RopeScaling::None);
        let refused = read(Family::Qwen3, keys).unwrap_err();
        assert!(refused.contains("rope type \"mrope\" is not supported (qwen3"), "{refused}");
    }

    /// Qwen2.5-VL's Hub configs hold the language model's keys at the top level, its
    /// rotation named `mrope`: read as the text model, Qwen2's biases and defaults.
    #[test]
    fn a_flat_qwen2_5_vl_release_reads_as_its_text_model() {
        let cfg = json!({"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                         "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 96,
                         "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
                         "tie_word_embeddings": true, "vision_config": {"depth": 1}});
        let keys = language_model_keys(cfg.as_object().unwrap(), &|| false).unwrap();
        assert!(!keys.contains_key("vision_config"));
        let (family, config) = config_from_keys(&keys).unwrap();
        let ModelConfig::Llama(c) = config else { panic!("{family:?} is not a decoder") };
        assert_eq!(family, Family::Qwen2_5Vl);
        assert_eq!((c.qkv_bias, c.o_bias, c.rope_theta, c.tie_embeddings), (true, false, 1e6, true));
        assert_eq!((c.rope_scaling, c.sliding_window, c.norm_eps), (RopeScaling::None, None, 1e-5));
        // Saved before transformers 5: the tie flag in text_config alone, no stored head.
        let mut nested_tie = cfg.clone();
        nested_tie.as_object_mut().unwrap().remove("tie_word_embeddings");
        nested_tie["text_config"] = json!({"tie_word_embeddings": true});
        for (key, value) in cfg
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| !["model_type", "vision_config", "tie_word_embeddings"].contains(&k.as_str()))
        {
            nested_tie["text_config"][key] = value.clone();
        }
        let keys = language_model_keys(nested_tie.as_object().unwrap(), &|| false).unwrap();
        assert_eq!(keys["tie_word_embeddings"], json!(true), "text_config's flag ties the head");
        let nested = json!({"model_type": "qwen3_vl", "hidden_size": 32});
        let why = language_model_keys(nested.as_object().unwrap(), &|| false).unwrap_err();
        assert!(why.contains("a qwen3_vl folder without a text_config object"), "{why}");
    }

    /// A release written back keeps the rotation's keys Strata does not read where the
    /// rotation is the same, saved either way; never for another rotation.
    #[test]
    fn a_release_written_back_keeps_its_rotation_s_sections() {
        let sections = json!({"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": true});
        let written = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 5e6}});
        for key in ["rope_parameters", "rope_scaling"] {
            let release = json!({"model_type": "qwen3_vl", "text_config": {key: sections}});
            let out = release_config(release.as_object().unwrap(), written.clone());
            let rope = &out["text_config"]["rope_parameters"];
            assert_eq!((&rope["mrope_section"], &rope["rope_theta"]), (&json!([24, 20, 20]), &json!(5e6)), "{key}");
        }
        // Qwen2.5-VL's Hub configs: the language model's keys at the top, its rotation `mrope`.
        let flat =
            json!({"model_type": "qwen2_5_vl", "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}});
        let out = release_config(flat.as_object().unwrap(), written.clone());
        assert_eq!((&out["model_type"], &out["rope_scaling"]), (&json!("qwen2_5_vl"), &Value::Null), "moved");
        let rope = &out["text_config"]["rope_parameters"];
        assert_eq!(
            (&rope["mrope_section"], &rope["rope_type"], &rope["type"]),
            (&json!([16, 24, 24]), &json!("default"), &Value::Null)
        );
        let yarn = json!({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}});
        let release = json!({"model_type": "qwen3_vl", "text_config": {"rope_parameters": sections}});
        let out = release_config(release.as_object().unwrap(), yarn.clone());
        assert_eq!(out["text_config"], yarn, "another rotation takes nothing of the release's");
    }

    /// A Qwen3.5 release reads as its text model with what the outer configuration says of
    /// the whole: its quantization (a scheme Strata does not read refused), a one-label
    /// classifier is a reward model.
    #[test]
    fn qwen3_5_releases_read_as_their_text_model_with_the_outer_keys() {
        let text = json!({"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 4, "head_dim": 16,
                          "intermediate_size": 48, "vocab_size": 96, "linear_num_key_heads": 2,
                          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8});
        let release = |outer: Value| {
            let mut cfg = json!({"model_type": "qwen3_5", "text_config": text.clone()});
            for (k, v) in outer.as_object().into_iter().flatten() {
                cfg[k] = v.clone();
            }
            config_from_keys(&language_model_keys(cfg.as_object().unwrap(), &|| false)?)
        };
        let (family, config) = release(json!({"architectures": ["Qwen3_5ForConditionalGeneration"]})).unwrap();
        assert!(
            family == Family::Qwen3_5
                && matches!(config, ModelConfig::Llama(LlamaConfig { head: DecoderHead::LanguageModel, .. }))
        );
        let quantized = release(json!({"quantization_config": {"quant_method": "awq"}})).unwrap_err();
        assert!(quantized.contains("quantized weights (awq) are not read"), "{quantized}");
        let reward = release(json!({"architectures": ["Qwen3_5ForSequenceClassification"], "num_labels": 1})).unwrap();
        assert!(matches!(reward.1, ModelConfig::Llama(LlamaConfig { head: DecoderHead::Reward, .. })));
        // AutoModelForCausalLM builds Qwen3.5's text model from its text_config alone: the
        // text model's flag ties the head, not the release's.
        let mut tied = json!({"model_type": "qwen3_5", "tie_word_embeddings": false, "text_config": text.clone()});
        tied["text_config"]["tie_word_embeddings"] = json!(true);
        let keys = language_model_keys(tied.as_object().unwrap(), &|| false).unwrap();
        assert_eq!(keys["tie_word_embeddings"], json!(true));
        assert_eq!(
            language_model_keys(tied.as_object().unwrap(), &|| true).unwrap()["tie_word_embeddings"],
            json!(false)
        );
        let bare =
            language_model_keys(json!({"model_type": "qwen3_5_moe"}).as_object().unwrap(), &|| false).unwrap_err();
        assert!(bare.contains("a qwen3_5_moe folder without a text_config object"), "{bare}");
    }

    /// Gemma 3's and Mistral 3's releases read as their text models: the outer class's
    /// flag ties the head unless the folder stores one, Gemma 3's logits go uncapped, the
    /// outer special tokens are carried where the text model names none, and Mistral 3's
    /// text model is Mistral's where it names no type. The weights' names lose the
    /// release's prefixes, both as `transformers` 5 saves them and as releases before it did.
    #[test]
    fn gemma4_reads_its_class_defaults_its_global_heads_and_refuses_what_strata_lacks() {
        let plain = json!({"hidden_size_per_layer_input": 0, "num_hidden_layers": 7});
        let c = read(Family::Gemma4, plain.clone()).unwrap();
        // Five sliding layers of six, and the last full whatever the pattern says.
        let full: Vec<usize> = (0..7).filter(|&i| c.window(i).is_none()).collect();
        assert_eq!((full, c.sliding_window), (vec![5, 6], Some(512)));
        let global = FullLayerHeads { head_dim: 512, kv_heads: None, values_from_keys: false };
        assert_eq!(
            (c.head_width(), c.full_layer_heads, c.head_width_at(6), c.head_width_at(0)),
            (256, Some(global), 512, 256)
        );
        assert_eq!(c.rope(), Rope { partial: 0.25, proportional: true, ..Rope::new(1e6) });
        assert_eq!(c.local_rope, Some(Rope::new(1e4)));
        let gemma4 = (c.norm, c.query_pre_attn_scalar, c.attn_softcap, c.logit_softcap, c.layer_scalar, c.value_norm);
        assert_eq!(gemma4, (NormKind::Weighted, Some(1.0), None, None, true, true));
        assert_eq!((c.tie_embeddings, c.padding_token, c.activation), (true, Some(0), Activation::GeluTanh));
        // The values from the keys, with the global key/value heads those alone bring.
        let shared = json!({"hidden_size_per_layer_input": 0, "attention_k_eq_v": true, "global_head_dim": 16,
                            "num_global_key_value_heads": 1, "num_key_value_heads": 2});
        let c = read(Family::Gemma4, shared).unwrap();
        assert_eq!(
            c.full_heads_at(2),
            Some(&FullLayerHeads { head_dim: 16, kv_heads: Some(1), values_from_keys: true })
        );
        assert_eq!((c.key_value_heads_at(2), c.key_value_heads_at(0), c.full_heads_at(0)), (1, 2, None));
        let unshared = json!({"hidden_size_per_layer_input": 0, "num_global_key_value_heads": 1});
        assert_eq!(read(Family::Gemma4, unshared).unwrap().key_value_heads_at(2), 2, "the layers' own heads");
        // transformers' own spelling of the same heads, layer by layer.
        let layered = |overrides: Value| {
            json!({"hidden_size_per_layer_input": 0, "attention_k_eq_v": true, "num_hidden_layers": 4, "head_dim": 8,
                   "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                   "per_layer_config": overrides})
        };
        let same = json!({"head_dim": 16, "num_key_value_heads": 1});
        let c = read(Family::Gemma4, layered(json!({"1": same, "3": same}))).unwrap();
        assert_eq!(
            c.full_layer_heads,
            Some(FullLayerHeads { head_dim: 16, kv_heads: Some(1), values_from_keys: true })
        );
        for (overrides, why) in [
            (json!({"1": same, "3": {"head_dim": 32}}), "different heads"),
            (json!({"1": same}), "other heads than the rest"),
            (json!({"0": same, "1": same, "3": same}), "per_layer_config.0"),
            (json!({"1": {"sliding_window": 2}, "3": {"sliding_window": 2}}), "per_layer_config.1"),
        ] {
            let refused = read(Family::Gemma4, layered(overrides)).unwrap_err();
            assert!(refused.contains(why), "{refused}");
        }
        for (keys, why) in [
            (json!({}), "per-layer embeddings"),
            (json!({"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 2}), "num_kv_shared_layers"),
            (json!({"hidden_size_per_layer_input": 0, "enable_moe_block": true}), "enable_moe_block needs it"),
            (json!({"hidden_size_per_layer_input": 0, "use_bidirectional_attention": "all"}), "causal"),
        ] {
            let refused = read(Family::Gemma4, keys).unwrap_err();
            assert!(refused.contains(why), "{refused}");
        }
        // The experts' block: beside the dense network on every layer, stacked on disk.
        let block = json!({"hidden_size_per_layer_input": 0, "enable_moe_block": true, "num_experts": 8,
                           "top_k_experts": 2, "moe_intermediate_size": 12});
        let c = read(Family::Gemma4, block).unwrap();
        let moe = c.moe.clone().unwrap();
        assert!(moe.beside_dense && moe.router_norm && moe.expert_scales && moe.norm_topk);
        assert_eq!((moe.experts, moe.top_k, moe.expert_ffn_dim, moe.aux_loss_coef), (8, 2, 12, 0.0));
        assert_eq!((moe.names, moe.activation), (ExpertNames::Layer, ExpertActivation::GeluTanh));
        assert_eq!(Family::Gemma4.expert_stacking(), Some(ExpertStacking::Concatenated));
        let model = ModelConfig::Llama(LlamaConfig { kv_heads: Some(c.key_value_heads()), ..c.clone() });
        assert_eq!(Family::of(&model).unwrap(), Family::Gemma4);
        let written = Family::Gemma4.config_json(&model, &Map::new()).unwrap();
        assert!(written.get("router_aux_loss_coef").is_none() && written.get("num_experts_per_tok").is_none());
        assert_eq!(config_from_keys(written.as_object().unwrap()).unwrap(), (Family::Gemma4, model));
        for other in [Family::Qwen3Moe, Family::Mixtral] {
            assert!(other.cannot_write(&c).is_some_and(|why| why.contains("Gemma 4's experts")), "{other:?}");
        }
        let vision = json!({"hidden_size_per_layer_input": 0, "use_bidirectional_attention": "vision"});
        assert!(read(Family::Gemma4, vision).is_ok(), "text attends causally under vision's bidirection");
        // Written back as Gemma 4 alone, and read again as it was.
        let c = read(Family::Gemma4, plain).unwrap();
        let model = ModelConfig::Llama(LlamaConfig { kv_heads: Some(c.key_value_heads()), ..c.clone() });
        assert_eq!(Family::of(&model).unwrap(), Family::Gemma4);
        assert!(Family::Gemma3.cannot_write(&c).is_some());
        let written = Family::Gemma4.config_json(&model, &Map::new()).unwrap();
        let (family, again) = config_from_keys(written.as_object().unwrap()).unwrap();
        assert_eq!((family, again), (Family::Gemma4, model));
    }

    #[test]
    fn exaone4_turns_no_position_on_its_full_layers_beside_sliding_ones_alone() {
        let c = read(Family::Exaone4, json!({"num_hidden_layers": 4})).unwrap();
        assert_eq!((c.sliding_window, c.unrotated_layers.clone(), c.window(3)), (Some(4096), vec![3], None));
        assert!(c.post_norms && c.qk_norm && !c.qk_norm_whole);
        let model = ModelConfig::Llama(LlamaConfig { kv_heads: Some(4), head_dim: Some(8), ..c.clone() });
        assert_eq!(Family::of(&model).unwrap(), Family::Exaone4);
        let written = Family::Exaone4.config_json(&model, &Map::new()).unwrap();
        assert_eq!(config_from_keys(written.as_object().unwrap()).unwrap(), (Family::Exaone4, model));
        let unwindowed = read(Family::Exaone4, json!({"sliding_window": null})).unwrap();
        assert_eq!(
            (unwindowed.sliding_window, unwindowed.unrotated_layers),
            (None, vec![]),
            "every layer full, turned"
        );
        let other = LlamaConfig { unrotated_layers: vec![0], ..c };
        assert!(Family::Exaone4.cannot_write(&other).is_some_and(|why| why.contains("turn no position")));
        let seed = read(Family::SeedOss, json!({})).unwrap();
        assert_eq!(
            (seed.qkv_bias, seed.o_bias, seed.dropout.attention, seed.dropout.residual),
            (true, false, 0.1, 0.1)
        );
        assert_eq!((seed.head_width(), seed.padding_token, seed.ctx), (128, Some(1), 524_288));
    }

    /// Apertus's rotation keys without a base take its class's base, 1.2·10⁷.
    #[test]
    fn apertus_rotation_without_a_base_takes_its_class_base() {
        let c = read(Family::Apertus, json!({"rope_parameters": {"rope_type": "default"}})).unwrap();
        assert_eq!(c.rope_theta, 12_000_000.0);
    }

    /// StarCoder2's use_bias sets every projection's bias at once, and a folder of it cannot
    /// be written with some alone; Nemotron's feed-forward biases are its own key, its
    /// rotation half of each head unless told, and the families tell their norms apart.
    #[test]
    fn starcoder2_and_nemotron_read_their_biases_and_norms() {
        let unbiased = read(Family::Starcoder2, json!({"use_bias": false})).unwrap();
        assert_eq!(
            (unbiased.qkv_bias, unbiased.o_bias, unbiased.mlp_bias, unbiased.norm_bias),
            (false, false, false, true)
        );
        let biased = read(Family::Starcoder2, json!({})).unwrap();
        assert!(biased.qkv_bias && biased.o_bias && biased.mlp_bias && biased.fc_names && biased.tie_embeddings);
        let some = LlamaConfig { mlp_bias: false, ..biased.clone() };
        assert!(Family::Starcoder2.cannot_write(&some).is_some_and(|why| why.contains("some projections alone")));
        assert_eq!(Family::of(&ModelConfig::Llama(biased)).unwrap(), Family::Starcoder2);
        let nemotron = read(Family::Nemotron, json!({"mlp_bias": true})).unwrap();
        assert!(nemotron.mlp_bias && !nemotron.qkv_bias && nemotron.partial_rotary == 0.5);
        assert_eq!((nemotron.norm, nemotron.activation), (NormKind::LayerPlusOne, Activation::Relu2));
        let whole = read(Family::Nemotron, json!({"partial_rotary_factor": 1.0})).unwrap();
        assert_eq!(whole.partial_rotary, 1.0);
        assert_eq!(Family::of(&ModelConfig::Llama(nemotron.clone())).unwrap(), Family::Nemotron);
        assert!(Family::Arcee.cannot_write(&nemotron).is_some_and(|why| why.contains("Nemotron's")));
        // Refused by name where the class has no such biases: a mixture of experts built like
        // LLaMA's layers among them.
        for family in [Family::Qwen3, Family::Olmoe] {
            let refused = read(family, json!({"mlp_bias": true})).unwrap_err();
            assert!(refused.contains("mlp_bias = true is not supported"), "{family:?}: {refused}");
        }
        // StarCoder2's class turns whole heads whatever the key says.
        let whole = read(Family::Starcoder2, json!({"partial_rotary_factor": 0.5})).unwrap();
        assert_eq!(whole.partial_rotary, 1.0);
    }

    /// HunYuan-MoE's per-layer counts are read when all equal (under either name) and
    /// refused otherwise; its experts and shared expert take intermediate_size. Llama 4's
    /// null chunk size, which its class cannot run, is refused.
    #[test]
    fn hunyuan_experts_take_one_count_for_every_layer() {
        let moe = |keys| read(Family::HunYuanMoe, keys).map(|c| c.moe.unwrap());
        let even = moe(json!({"num_experts": [4, 4, 4], "moe_topk": [2, 2, 2]})).unwrap();
        assert_eq!((even.experts, even.top_k, even.expert_ffn_dim, even.shared_expert_dim), (4, 2, 48, Some(48)));
        assert!(!even.shared_gate && even.norm_topk && even.aux_loss_coef == 0.0);
        let uneven = moe(json!({"num_experts": 4, "moe_topk": [2, 1, 2]})).unwrap_err();
        assert!(uneven.contains("moe_topk must be a number, or one per layer all equal"), "{uneven}");
        let aliased = moe(json!({"num_local_experts": 6, "num_experts_per_tok": 3})).unwrap();
        assert_eq!((aliased.experts, aliased.top_k), (6, 3), "the class's other names of the counts");
        let null = read(Family::Llama4, json!({"attention_chunk_size": null})).unwrap_err();
        assert!(null.contains("attention_chunk_size is null"), "{null}");
        let written = Family::HunYuanMoe
            .config_json(
                &ModelConfig::Llama(read(Family::HunYuanMoe, json!({"num_experts": 4, "moe_topk": 2})).unwrap()),
                &Map::new(),
            )
            .unwrap();
        assert_eq!((written["num_experts"].clone(), written["moe_topk"].clone()), (json!(4), json!(2)));
    }

    #[test]
    fn ernie4_5_experts_route_by_biased_softmax_over_one_span_of_layers() {
        let keys = json!({"num_hidden_layers": 6, "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 12,
                          "moe_layer_start_index": 1, "moe_layer_end_index": 4, "moe_layer_interval": 1});
        let c = read(Family::Ernie4_5Moe, keys).unwrap();
        let moe = c.moe.clone().unwrap();
        assert_eq!(
            (moe.dense_layers.clone(), moe.shared_expert_dim, moe.names),
            (vec![0, 5], Some(24), ExpertNames::MlpStatics)
        );
        assert!(moe.choice_bias && moe.scoring == Scoring::Softmax && moe.norm_topk && !moe.shared_gate);
        assert!(c.interleaved_rotation && c.tie_embeddings);
        let model = ModelConfig::Llama(LlamaConfig { kv_heads: Some(4), head_dim: Some(8), ..c.clone() });
        assert_eq!(Family::of(&model).unwrap(), Family::Ernie4_5Moe);
        let written = Family::Ernie4_5Moe.config_json(&model, &Map::new()).unwrap();
        assert_eq!((&written["moe_layer_start_index"], &written["moe_layer_end_index"]), (&json!(1), &json!(4)));
        assert_eq!(config_from_keys(written.as_object().unwrap()).unwrap(), (Family::Ernie4_5Moe, model));
        // A dense layer inside the span has no spelling.
        let holed = LlamaConfig { moe: Some(MoeConfig { dense_layers: vec![0, 2, 5], ..moe }), ..c };
        assert!(Family::Ernie4_5Moe.cannot_write(&holed).is_some_and(|why| why.contains("ERNIE 4.5's experts")));
        let every = read(Family::Ernie4_5Moe, json!({"num_hidden_layers": 4, "moe_layer_start_index": 0})).unwrap();
        assert_eq!(every.moe.unwrap().dense_layers, Vec::<i64>::new(), "moe_layer_end_index -1 is the last layer");
    }

    #[test]
    fn each_class_s_own_rules_survive_a_round_trip() {
        let round_trip = |family: Family, keys: Value| {
            let c = read(family, keys).unwrap();
            let model = ModelConfig::Llama(LlamaConfig {
                kv_heads: Some(c.key_value_heads()),
                head_dim: Some(c.head_width()),
                ..c
            });
            let written = family.config_json(&model, &Map::new()).unwrap();
            let (_, again) = config_from_keys(written.as_object().unwrap()).unwrap();
            assert_eq!(again, model, "{family:?}");
            model
        };
        // Gemma 4's class makes its last layer full, whatever layer_types says.
        let types = json!(["full_attention", "sliding_attention", "sliding_attention"]);
        let ModelConfig::Llama(gemma4) =
            round_trip(Family::Gemma4, json!({"hidden_size_per_layer_input": 0, "layer_types": types}))
        else {
            unreachable!()
        };
        assert_eq!((gemma4.window(0), gemma4.window(1), gemma4.window(2)), (None, Some(512), None));
        // EXAONE 4 without sliding layers still turns no position on its full ones.
        let all_full = json!({"layer_types": ["full_attention", "full_attention", "full_attention"]});
        let ModelConfig::Llama(exaone) = round_trip(Family::Exaone4, all_full) else { unreachable!() };
        assert_eq!((exaone.sliding_window, exaone.unrotated_layers), (Some(4096), vec![0, 1, 2]));
        // A class with a padding row by default keeps none where the model has none.
        let ModelConfig::Llama(unpadded) = round_trip(Family::Gemma2, json!({"pad_token_id": null})) else {
            unreachable!()
        };
        assert_eq!(unpadded.padding_token, None);
        // ERNIE 4.5's every second layer from the first: the span its keys write says the same.
        let stepped = json!({"moe_layer_start_index": 0, "moe_layer_interval": 2, "num_hidden_layers": 5});
        round_trip(Family::Ernie4_5Moe, stepped);
        // The classes built on LLaMA's attention slide no layer, whatever sliding_window says.
        for family in [Family::SeedOss, Family::Ernie4_5, Family::HunYuanDense] {
            assert_eq!(read(family, json!({"sliding_window": 4})).unwrap().sliding_window, None, "{family:?}");
        }
        let proportional = json!({"rope_parameters": {"rope_type": "proportional", "partial_rotary_factor": 0.5}});
        assert!(read(Family::Llama, proportional).unwrap_err().contains("Gemma 4's rotation"));
    }

    #[test]
    fn gemma3_and_mistral3_releases_read_as_their_text_models() {
        let text = json!({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "num_hidden_layers": 2, "head_dim": 8, "intermediate_size": 48, "vocab_size": 96});
        let read = |outer: Value, stores_head: bool| {
            let mut cfg = outer;
            cfg["text_config"] = text.clone();
            let keys = language_model_keys(cfg.as_object().unwrap(), &|| stores_head).unwrap();
            let (family, config) = config_from_keys(&keys).unwrap();
            let ModelConfig::Llama(c) = config else { panic!("{family:?} is not a decoder") };
            (family, c, keys)
        };
        let (family, c, keys) = read(json!({"model_type": "gemma3", "eos_token_id": [1, 106]}), false);
        assert_eq!((family, c.tie_embeddings, c.logit_softcap), (Family::Gemma3, true, None));
        assert_eq!(keys["eos_token_id"], json!([1, 106]));
        let (_, untied, _) = read(json!({"model_type": "gemma3"}), true);
        assert!(!untied.tie_embeddings, "a stored head is the head");
        let (_, unflagged, _) = read(json!({"model_type": "gemma3", "tie_word_embeddings": false}), false);
        assert!(!unflagged.tie_embeddings, "the outer flag decides");
        let (family, c, _) = read(json!({"model_type": "mistral3"}), false);
        assert_eq!((family, c.tie_embeddings), (Family::Mistral, true));
        let mut capped = json!({"model_type": "gemma3"});
        capped["text_config"] = json!({"model_type": "gemma3_text", "final_logit_softcapping": 30.0, "vocab_size": 96,
                                       "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
                                       "intermediate_size": 48});
        let keys = language_model_keys(capped.as_object().unwrap(), &|| false).unwrap();
        assert_eq!(keys["final_logit_softcapping"], Value::Null);
        for (stored, read) in [
            ("model.language_model.layers.0.mlp.up_proj.weight", Some("model.layers.0.mlp.up_proj.weight")),
            ("language_model.model.embed_tokens.weight", Some("model.embed_tokens.weight")),
            ("language_model.lm_head.weight", Some("lm_head.weight")),
            ("model.language_model.model.norm.weight", Some("model.norm.weight")),
            ("language_model.layers.1.mlp.up_proj.weight", Some("model.layers.1.mlp.up_proj.weight")),
            ("lm_head.weight", Some("lm_head.weight")),
            ("model.norm.weight", Some("model.norm.weight")),
            ("vision_tower.vision_model.post_layernorm.weight", None),
            ("model.multi_modal_projector.mm_input_projection_weight", None),
            ("mtp.fc.weight", None),
        ] {
            assert_eq!(Family::Gemma3.strata_name(stored).map(|(n, _)| n).as_deref(), read, "{stored}");
        }
    }

    /// Gemma 3 and OLMo 3 given the older top-level keys scale the full layers' rotation
    /// alone; the sliding layers turn plainly (Gemma 3 at rope_local_base_freq).
    #[test]
    fn older_rotation_keys_reach_the_full_layers_alone() {
        let yarn = json!({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16});
        let olmo3 = read(Family::Olmo3, json!({"rope_scaling": yarn.clone(), "rope_theta": 5e5})).unwrap();
        assert!(matches!(olmo3.rope_scaling, RopeScaling::Yarn { factor: 8.0, .. }) && olmo3.rope_theta == 5e5);
        assert_eq!(olmo3.local_rope, Some(Rope::new(500_000.0)));
        let gemma3 = read(Family::Gemma3, json!({"rope_scaling": yarn, "rope_local_base_freq": 1e4})).unwrap();
        assert!(matches!(gemma3.rope_scaling, RopeScaling::Yarn { .. }));
        assert_eq!(gemma3.local_rope, Some(Rope::new(1e4)));
    }

    /// SmolLM3's layers without rotation come from `no_rope_layers` or, absent, every fourth
    /// layer; where it slides, it slides those layers alone.
    #[test]
    fn smollm3_turns_no_position_on_its_nope_layers_and_slides_there() {
        let derived = read(
            Family::SmolLm3,
            json!({"num_hidden_layers": 8, "use_sliding_window": true,
                                                   "sliding_window": 4}),
        )
        .unwrap();
        assert_eq!(derived.unrotated_layers, [3, 7]);
        let windows: Vec<_> = (0..8).map(|i| derived.window(i)).collect();
        assert_eq!(windows, [None, None, None, Some(4), None, None, None, Some(4)]);
        assert!((0..8).all(|i| derived.rotates(i) != [3, 7].contains(&i)));
        let listed = read(Family::SmolLm3, json!({"no_rope_layers": [1, 0, 1], "sliding_window": 4})).unwrap();
        assert_eq!((listed.unrotated_layers.clone(), listed.sliding_window), (vec![1], None), "no use_sliding_window");
        assert_eq!((listed.rope_theta, listed.tie_embeddings, listed.ctx), (2e6, true, 32768), "SmolLM3's defaults");
        let bad = read(Family::SmolLm3, json!({"no_rope_layers": [1, 2, 1]})).unwrap_err();
        assert!(bad.contains("no_rope_layers holds 2, not 0 or 1"), "{bad}");
        let short = read(Family::SmolLm3, json!({"no_rope_layers": [1, 0]})).unwrap_err();
        assert!(short.contains("no_rope_layers is not a list of 3 flags"), "{short}");
    }

    #[test]
    fn a_null_key_value_head_count_means_one_per_query_head_and_a_missing_one_the_class_default() {
        for family in [Family::Qwen2, Family::Qwen3, Family::Ernie4_5, Family::SeedOss, Family::SmolLm3] {
            let null = read(family, json!({"num_key_value_heads": null})).unwrap();
            assert_eq!(null.key_value_heads(), 4, "{family:?}: one per query head");
            let cfg = json!({"hidden_size": 64, "num_attention_heads": 32, "num_hidden_layers": 3,
                             "intermediate_size": 48, "vocab_size": 96});
            let missing = Keys { cfg: cfg.as_object().unwrap(), prefix: String::new() }.decoder(family).unwrap();
            assert_eq!(missing.kv_heads, family.class_defaults().kv_heads, "{family:?}: its class's default");
        }
    }

    /// Keys a Qwen3-Next or Qwen3.5 folder leaves out take `transformers`' defaults for
    /// those classes (head_dim 256, a context of 32,768, the linear attention's sizes, a
    /// quarter of each head turned), not the plain decoder's.
    #[test]
    fn linear_attention_families_default_as_transformers_does() {
        for family in [Family::Qwen3Next, Family::Qwen3_5, Family::Qwen3_5Moe] {
            let experts = json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8});
            let c = read(family, if family.has_experts() { experts } else { json!({}) }).unwrap();
            assert_eq!((c.head_width(), c.ctx, c.partial_rotary), (256, 32768, 0.25), "{family:?}");
            let l = c.linear_attention.unwrap();
            assert_eq!((l.key_heads, l.value_heads, l.key_dim, l.value_dim, l.conv_kernel), (16, 32, 128, 128, 4));
            assert_eq!(l.split_projections, family != Family::Qwen3Next, "{family:?}");
        }
        let moe = read(
            Family::Qwen3_5Moe,
            json!({"num_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 8, "norm_topk_prob": false}),
        )
        .unwrap()
        .moe
        .unwrap();
        assert!(moe.norm_topk, "Qwen3.5's router renormalises whatever the key says");
    }

    #[test]
    fn keys_without_a_meaning_here_are_refused_by_name() {
        let axial = read(Family::Phi3, json!({"rope_parameters": {"rope_type": "axial"}})).unwrap_err();
        assert!(axial.contains("rope_parameters type \"axial\" is not supported"), "{axial}");
        let longrope = read(Family::Phi3, json!({"rope_parameters": {"rope_type": "longrope"}})).unwrap_err();
        assert!(longrope.contains("rope_parameters.short_factor is missing"), "{longrope}");
        let both_ways = read(Family::Gemma3, json!({"use_bidirectional_attention": true})).unwrap_err();
        assert!(both_ways.contains("use_bidirectional_attention = true is not supported"), "{both_ways}");
        let act = read(Family::Qwen3, json!({"hidden_act": "gelu"})).unwrap_err();
        assert!(act.contains("hidden_act \"gelu\" is not supported"), "{act}");
        let types =
            read(Family::Gemma2, json!({"layer_types": ["chunked_attention", "full_attention", "full_attention"]}))
                .unwrap_err();
        assert!(types.contains("layer_types holds \"chunked_attention\""), "{types}");
    }

    #[test]
    fn t5_reads_its_versions_and_writes_back_only_what_transformers_reads_alike() {
        let read = |cfg: Value| Keys { cfg: cfg.as_object().unwrap(), prefix: String::new() }.t5();
        let sizes = json!({"vocab_size": 32, "d_model": 8, "d_kv": 4, "d_ff": 16, "num_layers": 2, "num_heads": 2});
        let with = |extra: Value| {
            let mut cfg = sizes.clone();
            cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            read(cfg)
        };
        // t5-small's own folder names the class by its older name.
        let v10 = with(json!({"architectures": ["T5WithLMHeadModel"]})).unwrap();
        assert!(v10.tied_head && v10.scale_output && !v10.gated && v10.activation == FeedForwardActivation::Relu);
        assert_eq!((v10.decoder_layers, v10.decoder_start), (2, 0));
        let v11 = with(json!({"feed_forward_proj": "gated-gelu", "tie_word_embeddings": false})).unwrap();
        assert!(!v11.tied_head && !v11.scale_output && v11.gated && v11.activation == FeedForwardActivation::GeluTanh);
        let err = with(json!({"architectures": ["T5EncoderModel"]})).unwrap_err();
        assert!(err.contains("architecture T5EncoderModel has no task"), "{err}");
        let err = with(json!({"feed_forward_proj": "gated-mish"})).unwrap_err();
        assert!(err.contains("activation \"mish\" is not supported"), "{err}");
        // Written back, each reads as it was; a gated exact GELU would read as the tanh form.
        for c in [v10, v11.clone()] {
            let written = Family::T5.config_json(&ModelConfig::T5(c.clone()), &Map::new()).unwrap();
            assert_eq!(read(written).unwrap(), c);
        }
        let exact = T5Config { activation: FeedForwardActivation::Gelu, ..v11 };
        let err = Family::T5.config_json(&ModelConfig::T5(exact), &Map::new()).unwrap_err().to_string();
        assert!(err.contains("gated by exact GELU cannot be written"), "{err}");
    }

    #[test]
    fn bert_reads_its_task_from_its_architecture_and_refuses_what_it_cannot_run() {
        let read = |keys: Value| {
            let mut cfg = json!({"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
                                 "intermediate_size": 48, "vocab_size": 96, "max_position_embeddings": 64});
            for (k, v) in keys.as_object().into_iter().flatten() {
                cfg[k] = v.clone();
            }
            Keys { cfg: cfg.as_object().unwrap(), prefix: String::new() }.bert()
        };
        let classifier = read(json!({"architectures": ["BertForSequenceClassification"],
                                     "id2label": {"1": "yes", "0": "no"}}))
        .unwrap();
        assert_eq!(classifier.head, BertHead::Classify { labels: vec!["no".into(), "yes".into()] });
        let default_labels = read(json!({"architectures": ["BertForSequenceClassification"]})).unwrap();
        assert_eq!(default_labels.head, BertHead::Classify { labels: vec!["LABEL_0".into(), "LABEL_1".into()] });
        assert_eq!(read(json!({})).unwrap().head, BertHead::MaskedLm);
        let pretraining = read(json!({"architectures": ["BertForPreTraining"]})).unwrap_err();
        assert!(pretraining.contains("architecture BertForPreTraining has no task"), "{pretraining}");
        let gap = read(json!({"architectures": ["BertForSequenceClassification"], "id2label": {"0": "a", "2": "c"}}));
        assert!(gap.unwrap_err().contains("id2label must map the ids 0..2"));
        let relative = read(json!({"position_embedding_type": "relative_key"})).unwrap_err();
        assert!(relative.contains("position_embedding_type = \"relative_key\" is not supported"), "{relative}");
        let multi = read(json!({"problem_type": "multi_label_classification"})).unwrap_err();
        assert!(multi.contains("problem_type"), "{multi}");
    }

    /// Python's words for numbers JSON has none for are quoted where they stand as values,
    /// and left alone inside strings.
    #[test]
    fn python_s_infinities_read_as_strings() {
        let text = r#"{"a": [0.0, Infinity], "b": "Infinity \" NaN", "c": -Infinity, "d": NaN}"#;
        let v: Value = serde_json::from_str(&quote_python_numbers(text)).unwrap();
        assert_eq!(v, json!({"a": [0.0, "Infinity"], "b": "Infinity \" NaN", "c": "-Infinity", "d": "NaN"}));
        let plain = r#"{"a": 1}"#;
        assert!(matches!(quote_python_numbers(plain), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn a_decoder_is_written_as_the_family_its_options_name() {
        let families = [
            (Family::Llama, json!({})),
            (Family::Mistral, json!({"sliding_window": 4})),
            (Family::Qwen2, json!({})),
            (Family::Qwen3, json!({})),
            (Family::Gemma2, json!({})),
            (Family::Gemma3, json!({})),
            (Family::Phi3, json!({})),
            (Family::Mixtral, json!({"num_local_experts": 4, "num_experts_per_tok": 2})),
            (
                Family::MiniMaxM2,
                json!({"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8, "rotary_dim": 4}),
            ),
            (Family::Starcoder2, json!({})),
            (Family::Nemotron, json!({})),
            (Family::Glm4MoeLite, json!({"mlp_layer_types": ["sparse", "dense", "sparse"]})),
            (
                Family::Qwen2Moe,
                json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                       "shared_expert_intermediate_size": 16, "mlp_only_layers": [1]}),
            ),
            (
                Family::Qwen3Moe,
                json!({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "decoder_sparse_step": 2}),
            ),
            (Family::Olmoe, json!({"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0})),
            (Family::FlexOlmo, json!({"num_experts": 4, "num_experts_per_tok": 2})),
            (Family::Olmo2, json!({})),
            (Family::Olmo3, json!({})),
            (Family::Qwen3Next, json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8})),
            (Family::Qwen3_5, json!({})),
            (Family::Qwen3_5Moe, json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8})),
            (Family::SmolLm3, json!({"no_rope_layers": [1, 0, 1]})),
            (Family::Glm4, json!({})),
            (
                Family::Ministral3,
                json!({"rope_parameters": {"llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 16}}),
            ),
            (
                Family::GraniteMoeHybrid,
                json!({"num_local_experts": 0, "mamba_n_heads": 4, "position_embedding_type": "rope",
                       "layer_types": ["mamba", "attention", "mamba"]}),
            ),
            (Family::GraniteMoeHybrid, json!({"num_local_experts": 4, "num_experts_per_tok": 2, "mamba_n_heads": 4})),
            // Granite 4 Micro attends on every layer.
            (
                Family::GraniteMoeHybrid,
                json!({"num_local_experts": 0, "position_embedding_type": "rope",
                       "layer_types": ["attention", "attention", "attention"]}),
            ),
            (Family::Lfm2, json!({"layer_types": ["conv", "full_attention", "conv"]})),
            (Family::Bamba, json!({"attn_layer_indices": [1], "mamba_n_heads": 4})),
            (Family::Mamba, json!({"state_size": 4})),
            (Family::FalconMamba, json!({"state_size": 4})),
            (Family::Jamba, json!({"attn_layer_period": 3, "attn_layer_offset": 1, "num_experts": 4})),
            (Family::FalconH1, json!({"mamba_n_heads": 4, "mamba_d_ssm": 48, "mamba_rms_norm": true})),
        ];
        for (family, keys) in families {
            let c = read(family, keys).unwrap();
            assert_eq!(Family::of(&ModelConfig::Llama(c.clone())).unwrap(), family);
            assert_eq!(family.cannot_write(&c), None, "{family:?}");
        }
        // Qwen3-VL's language model slides no layer; a model like it is written as Qwen3, as
        // Qwen3-VL's only where its release is.
        let vl = read(Family::Qwen3Vl, json!({"sliding_window": 4, "use_sliding_window": true})).unwrap();
        assert_eq!((vl.sliding_window, vl.qk_norm, Family::Qwen3Vl.cannot_write(&vl)), (None, true, None));
        assert_eq!(Family::of(&ModelConfig::Llama(vl)).unwrap(), Family::Qwen3);
        let mut windowed = read(Family::Llama, json!({})).unwrap();
        windowed.sliding_window = Some(4);
        windowed.layer_types = Some(vec![LayerAttention::Full, LayerAttention::Sliding, LayerAttention::Full]);
        let why = Family::Llama.cannot_write(&windowed).unwrap();
        assert!(why.contains("a llama model cannot hold a sliding window"), "{why}");
        let gemma = read(Family::Gemma2, json!({})).unwrap();
        assert!(Family::Qwen3.cannot_write(&gemma).is_some());
        let dense = read(Family::Qwen3, json!({})).unwrap();
        assert!(Family::Qwen3Moe.cannot_write(&dense).unwrap().contains("cannot hold experts"));
        let post_norms = LlamaConfig { post_norms: true, ..read(Family::Llama, json!({})).unwrap() };
        let why = Family::Llama.cannot_write(&post_norms).unwrap();
        assert!(why.contains("norms after attention and the feed-forward alone"), "{why}");
        let olmo3 = read(Family::Olmo3, json!({"sliding_window": 4})).unwrap();
        assert_eq!((0..3).map(|i| olmo3.window(i)).collect::<Vec<_>>(), [Some(4), Some(4), Some(4)]);
        let windows_alone = LlamaConfig { local_rope: None, ..olmo3.clone() };
        assert!(Family::Olmo2.cannot_write(&windows_alone).unwrap().contains("a sliding window"));
        assert!(Family::Olmo2.cannot_write(&olmo3).unwrap().contains("a local rotation"));
        let unscaled = read(Family::Ministral3, json!({"rope_parameters": {"llama_4_scaling_beta": 0.1}})).unwrap_err();
        assert!(unscaled.contains("llama_4_scaling_beta needs original_max_position_embeddings"), "{unscaled}");
        // Mistral 4 routes by softmax scores without a choice bias, shared experts or not.
        let mistral4 = read(Family::Mistral4, json!({"n_shared_experts": 0})).unwrap();
        assert_eq!(Family::of(&ModelConfig::Llama(mistral4.clone())).unwrap(), Family::Mistral4);
        assert_eq!(Family::Mistral4.cannot_write(&mistral4), None);
        let mut sigmoid = mistral4.clone();
        sigmoid.moe.as_mut().unwrap().scoring = Scoring::Sigmoid;
        assert!(Family::Mistral4.cannot_write(&sigmoid).unwrap().contains("Mistral 4's softmax ones without"));
        let mut gated = read(Family::DeepseekV3, json!({})).unwrap();
        gated.moe.as_mut().unwrap().shared_gate = true;
        assert!(Family::DeepseekV3.cannot_write(&gated).unwrap().contains("a shared expert behind a gate"));
        // YaRN's keys without an original context take the model's, the top-level key first.
        let yarn = json!({"rope_type": "yarn", "factor": 4.0, "llama_4_scaling_beta": 0.1});
        let from_context = read(Family::Ministral3, json!({"rope_parameters": yarn, "max_position_embeddings": 64}));
        assert_eq!(from_context.unwrap().query_scaling.map(|q| q.every), Some(64));
        let top = json!({"rope_parameters": yarn, "original_max_position_embeddings": 8});
        assert_eq!(read(Family::Ministral3, top).unwrap().query_scaling.map(|q| q.every), Some(8));
        // Without rotation keys, Ministral 3's configuration class's own: YaRN with the queries
        // scaled; the older rope_scaling is its rotation, query scale included.
        let plain = read(Family::Ministral3, json!({})).unwrap();
        assert_eq!(
            plain.query_scaling,
            Some(QueryScaling { beta: 0.1, every: 16384, from_one: false, unrotated_only: false })
        );
        assert!(matches!(plain.rope_scaling, RopeScaling::Yarn { factor: 16.0, original_context: 16384, .. }));
        assert_eq!(
            (plain.rope_theta, plain.head_width(), plain.ctx, plain.padding_token),
            (1e6, 128, 262_144, Some(11))
        );
        let older = json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                            "llama_4_scaling_beta": 0.2}});
        assert_eq!(
            read(Family::Ministral3, older.clone()).unwrap().query_scaling,
            Some(QueryScaling { beta: 0.2, every: 32, from_one: false, unrotated_only: false })
        );
        // Both given: the older key is read, as its class reads it.
        let both = json!({"rope_scaling": older["rope_scaling"], "rope_parameters": {"rope_type": "default"}});
        assert_eq!(
            read(Family::Ministral3, both).unwrap().query_scaling,
            Some(QueryScaling { beta: 0.2, every: 32, from_one: false, unrotated_only: false })
        );
        assert_eq!(
            read(Family::Olmoe, json!({"num_experts": 4, "num_experts_per_tok": 2})).unwrap().padding_token,
            Some(1)
        );
        let qwen3_5 = read(Family::Qwen3_5, json!({})).unwrap();
        assert!(Family::Qwen3Next.cannot_write(&qwen3_5).is_some());
    }

    #[test]
    fn deepseek_and_glm_read_their_routing_with_their_own_defaults() {
        let experts = json!({"moe_intermediate_size": 8, "n_routed_experts": 8, "num_experts_per_tok": 2});
        // DeepSeek-V3's defaults: groups 8 and 4 (too many for 8 experts, refused by name),
        // a routed scale of 2.5, one shared expert, the first three layers dense.
        let ds = read(Family::DeepseekV3, experts.clone()).unwrap();
        let moe = ds.moe.as_ref().unwrap();
        assert_eq!((moe.groups, moe.top_groups, moe.routed_scale), (8, 4, 2.5));
        assert_eq!((moe.shared_expert_dim, moe.shared_gate, moe.dense_layers.clone()), (Some(8), false, vec![0, 1, 2]));
        assert!(moe.scoring == Scoring::Sigmoid && moe.choice_bias && moe.norm_topk && moe.aux_loss_coef == 0.0);
        assert!(ds.validate().unwrap_err().to_string().contains("n_group 8 must split the 8 experts"));
        let latent = ds.latent.as_ref().unwrap();
        assert_eq!((latent.q_rank, latent.kv_rank, latent.rope_dim, latent.interleaved), (Some(1536), 512, 64, true));
        assert_eq!((ds.head_dim, ds.kv_heads), (None, None), "head_dim and kv heads are not DeepSeek's");
        let plain = read(
            Family::DeepseekV3,
            json!({"q_lora_rank": null, "n_group": 2, "topk_group": 1,
                                                      "moe_intermediate_size": 8, "n_routed_experts": 8}),
        )
        .unwrap();
        assert_eq!(plain.latent.unwrap().q_rank, None);
        let softmax = read(Family::DeepseekV3, json!({"moe_intermediate_size": 8, "scoring_func": "softmax"}));
        assert!(softmax.unwrap_err().contains("scoring_func"));
        // GLM-4.5's: no groups, no scaling, one dense layer, half of each head turned, biases
        // on the query/key/value projections alone.
        let glm = read(
            Family::Glm4Moe,
            json!({"moe_intermediate_size": 8, "n_routed_experts": 8,
                                                "attention_bias": true, "use_qk_norm": true}),
        )
        .unwrap();
        let moe = glm.moe.as_ref().unwrap();
        assert_eq!((moe.groups, moe.routed_scale, moe.dense_layers.clone()), (1, 1.0, vec![0]));
        assert!(glm.partial_rotary == 0.5 && glm.qkv_bias && !glm.o_bias && glm.qk_norm && glm.latent.is_none());
        // Each is written back as itself, and read again as it was written.
        let ds = read(
            Family::DeepseekV3,
            json!({"n_group": 2, "topk_group": 1, "moe_intermediate_size": 8,
                                                 "n_routed_experts": 8, "attention_bias": true}),
        )
        .unwrap();
        for (c, family) in [(glm, Family::Glm4Moe), (ds, Family::DeepseekV3)] {
            let c = ModelConfig::Llama(c);
            assert_eq!(Family::of(&c).unwrap(), family);
            let written = family.config_json(&c, &Map::new()).unwrap();
            let again = ModelConfig::Llama(read(family, written.clone()).unwrap());
            assert_eq!(family.config_json(&again, &Map::new()).unwrap(), written);
        }
    }

    #[test]
    fn experts_are_read_as_each_family_names_them() {
        let qwen2 = read(
            Family::Qwen2Moe,
            json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                   "shared_expert_intermediate_size": 16, "mlp_only_layers": [1], "router_aux_loss_coef": 0.02}),
        )
        .unwrap();
        let moe = qwen2.moe.as_ref().unwrap();
        assert_eq!((moe.experts, moe.top_k, moe.expert_ffn_dim, moe.shared_expert_dim), (4, 2, 8, Some(16)));
        assert_eq!((0..3).map(|i| moe.is_sparse(i)).collect::<Vec<_>>(), [true, false, true]);
        assert!(qwen2.qkv_bias && !moe.norm_topk && moe.aux_loss_coef == 0.02);
        // Mixtral's experts are intermediate_size wide and always renormalised.
        let mixtral = read(Family::Mixtral, json!({"num_local_experts": 4, "num_experts_per_tok": 2})).unwrap();
        let moe = mixtral.moe.unwrap();
        assert_eq!((moe.expert_ffn_dim, moe.norm_topk, moe.names), (48, true, ExpertNames::BlockSparse));
        assert_eq!(moe.aux_loss_coef, 0.001, "transformers' default coefficient");
        let olmoe = read(Family::Olmoe, json!({"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0})).unwrap();
        assert!(olmoe.qk_norm && olmoe.qk_norm_whole && olmoe.clip_qkv == Some(8.0));
        let jitter = read(
            Family::Mixtral,
            json!({"num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.1}),
        );
        assert!(jitter.unwrap_err().contains("router_jitter_noise = 0.1 is not supported"));
        let too_many = read(Family::Olmoe, json!({"num_experts": 2, "num_experts_per_tok": 3})).unwrap();
        assert!(too_many
            .validate()
            .unwrap_err()
            .to_string()
            .contains("num_experts_per_tok 3 is more than the 2 experts"));
    }
}
