//! The decoder that today's open checkpoints share, as one configurable model: LLaMA's
//! layout (RMSNorm, rotary positions, grouped-query attention, a gated feed-forward, no
//! biases, an output head of its own or tied to the token embedding) with the options its
//! descendants add, each a field of [`LlamaConfig`]:
//!
//! - attention biases (Qwen2 on the query, key and value projections; LLaMA's
//!   `attention_bias` on the output projection too);
//! - head widths independent of `dim / heads`, per-head RMSNorm of queries and keys (Qwen3,
//!   Gemma 3), a score scale of `query_pre_attn_scalar^-1/2` and soft-capped scores and
//!   logits (Gemma 2);
//! - rotary scaling (linear, dynamic NTK, YaRN, Llama 3) and a partial rotation
//!   ([`super::rope`]), and a second rotation for local layers (Gemma 3);
//! - sliding-window attention on every layer (Mistral) or on the layers `layer_types`
//!   marks (Qwen2/3, Gemma 2/3);
//! - Gemma's RMSNorm scaled by `1 + w`, GELU (tanh) gating, embeddings scaled by √dim and
//!   norms after attention and the feed-forward as well as before;
//! - Phi-3's fused `qkv_proj` and `gate_up_proj`;
//! - Granite's multipliers of the embeddings, of each sub-layer's output and of the scores,
//!   and its divisor of the logits; Falcon-H1's μP multipliers ([`MupMultipliers`]);
//! - recurrent mixers ([`super::linear`], [`super::mamba`], [`super::short_conv`]) in place
//!   of attention on the layers `layer_types` marks `linear`, or beside it on those it marks
//!   `hybrid` (Falcon-H1);
//! - Gemma 4's global layers with heads of their own (wider, fewer key/value heads, values
//!   from the key projection), a proportional rotation, values normed per head and a stored
//!   scale of each block's output;
//! - a mixture of experts in place of the feed-forward on some or all layers, or beside it
//!   ([`super::moe`]: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ERNIE 4.5; Gemma 4), OLMoE's query and key norms
//!   over whole projections and its clipped projections.
//!
//! Names follow the common `model.layers.{i}.self_attn.q_proj.weight` layout.
use super::gpt::divides_heads;
use super::head_loss::head_output;
use super::latent::{LatentAttention, LatentConfig};
use super::layers::{
    add_layer_norm, add_rms_norm, attend, attention, geglu, gelu_tanh, layer_norm, layer_norm_into_product,
    layer_norm_unbiased, linear, merge_heads, repeat_heads, rms_norm, rms_norm_into_product, rms_norm_plus_one,
    rms_norm_split, rms_norm_unweighted, split_heads, swiglu, AttentionOptions, Projected, ScoreTerms,
};
use super::linear::{GatedDeltaNet, LinearAttentionConfig};
use super::mamba::{Mamba2, StateSpaceConfig};
use super::moe::{LoadBalance, MoeConfig, SparseFeedForward};
use super::rope::{pairs_as_halves, Placed, QueryScaling, Rope, RopeScaling, Rotation};
use super::selective::{Mamba1, SelectiveScanConfig};
use super::short_conv::{ShortConv, ShortConvConfig};
use super::{
    default_norm_eps, positive, Builder, DecodeCache, DropoutRates, Init, Kept, ParamId, Params, TokenEmbedding,
    TpRole, Unit, UnitBuilder, UnitCost, DEFAULT_NORM_EPS, INIT_STD as STD,
};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tch::Tensor;

/// How the decoder's RMSNorms apply their weight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// `x / rms(x) · w`, `w` starting at one (LLaMA).
    #[default]
    Weighted,
    /// `x / rms(x) · (1 + w)` in fp32, `w` starting at zero (Gemma).
    PlusOne,
    /// `(x − mean(x)) / √var(x) · w` in fp32, `w` starting at one: without a bias (Cohere) or,
    /// with [`LlamaConfig::norm_bias`], `+ b` (StarCoder2).
    Layer,
    /// `(x − mean(x)) / √var(x) · (1 + w) + b`, `w` starting at zero (Nemotron's, with
    /// [`LlamaConfig::norm_bias`]).
    LayerPlusOne,
}

impl NormKind {
    /// Whether the norm centres its input (a layer norm, which may carry a bias).
    pub fn centred(self) -> bool {
        matches!(self, NormKind::Layer | NormKind::LayerPlusOne)
    }
}

/// The feed-forward's activation: of its gate, `down(act(gate(x)) · up(x))`, or of its up
/// projection alone where it has no gate, `down(act(up(x)))`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SwiGLU (LLaMA, Qwen, Mistral, Phi-3).
    #[default]
    Silu,
    /// GeGLU with GELU's tanh form (Gemma).
    GeluTanh,
    /// `relu(x)²` of the up projection, without a gate (Arcee, Nemotron).
    Relu2,
    /// GELU's tanh form of the up projection, without a gate (StarCoder2).
    UngatedGeluTanh,
    /// xIELU of the up projection, without a gate, with learned scales per layer (Apertus):
    /// `α_p·x² + β·x` for `x > 0`, else `α_n·(expm1(min(x, ε)) − x) + β·x`, where
    /// `α_p = softplus(a_p)` and `α_n = β + softplus(a_n)`; `a_p`, `a_n` train, `β` and `ε`
    /// are stored beside them.
    Xielu,
}

impl Activation {
    /// Whether the feed-forward has a gate projection.
    pub fn gated(self) -> bool {
        matches!(self, Activation::Silu | Activation::GeluTanh)
    }
}

/// Which positions a layer's attention reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerAttention {
    /// Every earlier position.
    Full,
    /// The `sliding_window` positions ending at the query.
    Sliding,
    /// A recurrent mixer in place of softmax attention: Gated DeltaNet linear attention
    /// ([`super::linear`]), a Mamba-2 or Mamba-1 mixer or a short convolution, whichever
    /// the decoder sizes.
    Linear,
    /// The earlier positions of the query's own chunk: positions fall into chunks of
    /// `attention_chunk` by their place in the row (Llama 4's chunked attention).
    Chunked,
    /// No token mixer: the block is its feed-forward alone, behind its input norm
    /// (Nemotron-H's `mlp` and `moe` layers).
    FeedForwardOnly,
    /// Attention over every earlier position and the recurrent mixer side by side: both read
    /// the input norm and their outputs are summed (Falcon-H1's layers).
    Hybrid,
}

/// The heads of the full-attention layers where they differ from the sliding layers' (Gemma
/// 4's global layers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FullLayerHeads {
    /// Width of each head.
    pub head_dim: i64,
    /// Key/value heads; `None`: the decoder's `kv_heads`.
    #[serde(default)]
    pub kv_heads: Option<i64>,
    /// The values are the key projection's output (the layers have no `v_proj`), normed and
    /// turned apart from the keys.
    #[serde(default)]
    pub values_from_keys: bool,
}

/// Granite's scalars ([`LlamaConfig::multipliers`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Multipliers {
    /// Of the token embeddings (`embedding_multiplier`).
    pub embeddings: f64,
    /// Of each sub-layer's output before its residual sum (`residual_multiplier`).
    pub residual: f64,
    /// Of the attention scores (`attention_multiplier`).
    pub scores: f64,
    /// The logits' divisor (`logits_scaling`).
    pub logits: f64,
}

/// Falcon-H1's μP multipliers ([`LlamaConfig::mup`]): fixed scalars where its training
/// scaled the activations, applied as they are so that the weights train as its files hold
/// them (folding them into the weights would change what an optimizer step does).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MupMultipliers {
    /// Of the token embeddings (`embedding_multiplier`).
    pub embeddings: f64,
    /// Of the logits (`lm_head_multiplier`).
    pub logits: f64,
    /// Of the keys (`key_multiplier`), applied as a factor of the score scale.
    pub keys: f64,
    /// Of attention's input (`attention_in_multiplier`).
    pub attention_in: f64,
    /// Of attention's output (`attention_out_multiplier`).
    pub attention_out: f64,
    /// Of the recurrent mixer's input (`ssm_in_multiplier`).
    pub recurrent_in: f64,
    /// Of the recurrent mixer's output (`ssm_out_multiplier`).
    pub recurrent_out: f64,
    /// Of a Mamba-2 input projection's parts `z`, `x`, `B`, `C` and `dt` (`ssm_multipliers`).
    pub recurrent_projection: [f64; 5],
    /// Of the feed-forward's gate before its activation (`mlp_multipliers`' first).
    pub gate: f64,
    /// Of the feed-forward's output (`mlp_multipliers`' second).
    pub down: f64,
}

impl MupMultipliers {
    fn all(&self) -> impl Iterator<Item = f64> + '_ {
        [
            self.embeddings,
            self.logits,
            self.keys,
            self.attention_in,
            self.attention_out,
            self.recurrent_in,
            self.recurrent_out,
            self.gate,
            self.down,
        ]
        .into_iter()
        .chain(self.recurrent_projection)
    }
}

/// The decoder's configuration: LLaMA's layout and the options its descendants add
/// (see the module's documentation).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size: rows of the token embedding and of the output head.
    pub vocab: i64,
    /// The longest sequence the model takes (`max_position_embeddings`).
    pub ctx: i64,
    /// Number of decoder layers.
    pub layers: i64,
    /// Query heads of each layer's attention.
    pub heads: i64,
    /// Width of the residual stream (`hidden_size`).
    pub dim: i64,
    /// Hidden size of the SwiGLU feed-forward; `None` means 8/3 · dim rounded up to 32.
    pub ffn_dim: Option<i64>,
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Key/value heads (grouped-query attention); `None` means one per query head.
    #[serde(default)]
    pub kv_heads: Option<i64>,
    /// The RMSNorms' epsilon.
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// The output head reads the token embedding's weight (`lm_head.weight` names it too).
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Biases on the query, key and value projections (Qwen2's).
    #[serde(default)]
    pub qkv_bias: bool,
    /// A bias on the attention's output projection.
    #[serde(default)]
    pub o_bias: bool,
    /// Biases on the feed-forward's projections (`mlp_bias`).
    #[serde(default)]
    pub mlp_bias: bool,
    /// A bias on every layer norm ([`NormKind::Layer`], [`NormKind::LayerPlusOne`]).
    #[serde(default)]
    pub norm_bias: bool,
    /// The feed-forward's projections named `c_fc` and `c_proj` (StarCoder2's) in place of
    /// `up_proj` and `down_proj`; a feed-forward without a gate alone.
    #[serde(default)]
    pub fc_names: bool,
    /// Width of an attention head; `None` means `dim / heads`.
    #[serde(default)]
    pub head_dim: Option<i64>,
    /// How the rotary frequencies are scaled.
    #[serde(default)]
    pub rope_scaling: RopeScaling,
    /// The share of each head's dimensions the rotation turns.
    #[serde(default = "whole_rotation")]
    pub partial_rotary: f64,
    /// The global rotation's share is of each head's pairs ([`Rope::proportional`]).
    #[serde(default)]
    pub proportional_rotary: bool,
    /// The full-attention layers' own heads, where they differ (Gemma 4).
    #[serde(default)]
    pub full_layer_heads: Option<FullLayerHeads>,
    /// Values RMS-normed per head without a weight (Gemma 4's `v_norm`).
    #[serde(default)]
    pub value_norm: bool,
    /// Each block's output multiplied by a stored scalar that takes no gradient (Gemma 4's
    /// `layer_scalar` buffer).
    #[serde(default)]
    pub layer_scalar: bool,
    /// Granite's scalars: token embeddings times `embeddings`, each sub-layer's output times
    /// `residual` before its residual sum, attention scores times `scores` (in place of
    /// `head_dim^-1/2`), logits divided by `logits`.
    #[serde(default)]
    pub multipliers: Option<Multipliers>,
    /// Falcon-H1's μP multipliers.
    #[serde(default)]
    pub mup: Option<MupMultipliers>,
    /// The rotation of sliding-window layers where it differs from the others' (Gemma 3's
    /// local base).
    #[serde(default)]
    pub local_rope: Option<Rope>,
    /// How the RMSNorms apply their weight.
    #[serde(default)]
    pub norm: NormKind,
    /// The feed-forward's activation, and whether it has a gate.
    #[serde(default)]
    pub activation: Activation,
    /// Per-head RMSNorm of queries and keys before the rotation.
    #[serde(default)]
    pub qk_norm: bool,
    /// The query and key norms span each projection whole rather than each head (OLMoE).
    #[serde(default)]
    pub qk_norm_whole: bool,
    /// The per-head query and key norms apply after the rotation, not before (HunYuan).
    #[serde(default)]
    pub qk_norm_after_rotation: bool,
    /// Query, key and value projections clamped to ± this (OLMoE's `clip_qkv`).
    #[serde(default)]
    pub clip_qkv: Option<f64>,
    /// Attention and the feed-forward both read the block's input norm, and the block adds
    /// both outputs to its input (Cohere's parallel block): no norm between them.
    #[serde(default)]
    pub parallel_block: bool,
    /// The logits times this (Cohere's `logit_scale`).
    #[serde(default)]
    pub logit_scale: Option<f64>,
    /// Norms after attention and after the feed-forward too (before the residual add).
    #[serde(default)]
    pub sandwich_norms: bool,
    /// Norms after attention and after the feed-forward (before the residual add) and none
    /// before them (OLMo 2 and 3).
    #[serde(default)]
    pub post_norms: bool,
    /// With `post_norms`, the layers with a recurrent mixer norm their inputs as LLaMA's
    /// do instead: `input_layernorm` before the mixer, `post_attention_layernorm` before the
    /// feed-forward (OLMo Hybrid's linear-attention layers beside OLMo 3's).
    #[serde(default)]
    pub recurrent_pre_norms: bool,
    /// Layers whose attention turns no position (no rotary embedding: SmolLM3's NoPE layers).
    #[serde(default)]
    pub unrotated_layers: Vec<i64>,
    /// Queries scaled up with their position (Ministral 3, Mistral 4; Llama 4 on the layers
    /// that turn no position).
    #[serde(default)]
    pub query_scaling: Option<QueryScaling>,
    /// Queries and keys RMS-normed per head without a weight after the rotation, on the
    /// layers that turn positions (Llama 4's `use_qk_norm`).
    #[serde(default)]
    pub qk_l2_norm: bool,
    /// Width of the chunks the `chunked` layers attend within (`attention_chunk_size`).
    #[serde(default)]
    pub attention_chunk: Option<i64>,
    /// Token embeddings multiplied by √dim.
    #[serde(default)]
    pub scale_embeddings: bool,
    /// Attention scores scaled by `query_pre_attn_scalar^-1/2` instead of `head_dim^-1/2`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// Attention scores soft-capped at ± this.
    #[serde(default)]
    pub attn_softcap: Option<f64>,
    /// Output logits soft-capped at ± this.
    #[serde(default)]
    pub logit_softcap: Option<f64>,
    /// Width of the sliding window of the layers that have one.
    #[serde(default)]
    pub sliding_window: Option<i64>,
    /// Each layer's attention; `None`: every layer slides where a window is set.
    #[serde(default)]
    pub layer_types: Option<Vec<LayerAttention>>,
    /// Query, key and value projections in one `qkv_proj`, gate and up in one `gate_up_proj`.
    #[serde(default)]
    pub fused_projections: bool,
    /// Gate and up in one `gate_up_proj`, the attention's projections apart (GLM-4).
    #[serde(default)]
    pub fused_gate_up: bool,
    /// The rotated dimensions of each head come as adjacent pairs (GLM's layout), not halves.
    #[serde(default)]
    pub interleaved_rotation: bool,
    /// The token whose embedding row its look-ups leave untrained (`pad_token_id`, as
    /// `transformers`' embeddings treat it).
    #[serde(default)]
    pub padding_token: Option<i64>,
    /// Experts in place of the feed-forward on the layers it makes sparse.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// A learned logit per head that joins each softmax as a key attended to nothing
    /// (gpt-oss's attention sinks, `self_attn.sinks`).
    #[serde(default)]
    pub attention_sinks: bool,
    /// The sizes of the linear attention of the layers `layer_types` marks `linear`
    /// (Qwen3-Next's Gated DeltaNet).
    #[serde(default)]
    pub linear_attention: Option<LinearAttentionConfig>,
    /// The sizes of the Mamba-2 mixer of the layers `layer_types` marks `linear` (Granite
    /// 4's `mamba` layers), in place of [`LlamaConfig::linear_attention`].
    #[serde(default)]
    pub state_space: Option<StateSpaceConfig>,
    /// The sizes of Mamba's (Mamba-1's) mixer of the layers `layer_types` marks `linear`
    /// (Mamba's, Falcon Mamba's and Jamba's), in place of [`LlamaConfig::linear_attention`].
    #[serde(default)]
    pub selective_scan: Option<SelectiveScanConfig>,
    /// The short convolution of the layers `layer_types` marks `linear` (LFM2's `conv`
    /// layers), in place of [`LlamaConfig::linear_attention`].
    #[serde(default)]
    pub short_conv: Option<ShortConvConfig>,
    /// Each block with a token mixer has no feed-forward: every layer is one sub-layer behind
    /// its input norm, its mixer or (on the layers `layer_types` marks `feed_forward_only`)
    /// its feed-forward (Nemotron-H).
    #[serde(default)]
    pub mixer_alone: bool,
    /// Granite 4's feed-forward: one gated network named `shared_mlp` (`input_linear`, the
    /// gate's rows before the up's, and `output_linear`), `ffn_dim` wide, the only one of a
    /// dense model and summed with the experts' output beside experts, without norms.
    #[serde(default)]
    pub shared_mlp: bool,
    /// Each head's attention output is scaled by the sigmoid of a gate the query projection
    /// gives beside the query (`q_proj` twice as wide: per head its query, then its gate;
    /// Qwen3-Next's full attention).
    #[serde(default)]
    pub attention_output_gate: bool,
    /// DeepSeek's latent attention in place of query, key and value heads ([`super::latent`]):
    /// `head_dim`, `kv_heads`, fused projections and query/key norms then do not apply,
    /// and `qkv_bias` puts biases on its down projections.
    #[serde(default)]
    pub latent: Option<LatentConfig>,
    /// Dropout in training: attention probabilities at `attention`'s rate (the folders'
    /// `attention_dropout`) and each sub-layer's output before its residual sum at
    /// `residual`'s (Phi-3's `resid_pdrop`); the other sites are not the decoder's.
    #[serde(default)]
    pub dropout: DropoutRates,
    /// What the last unit gives: next-token logits, or a reward model's score per position.
    #[serde(default)]
    pub head: DecoderHead,
}

/// The decoder's output head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecoderHead {
    /// Next-token logits from `lm_head` (or the tied embedding): `[rows, ctx, vocab]`.
    #[default]
    LanguageModel,
    /// A reward model (`transformers`' `ForSequenceClassification` with one label): a scalar
    /// per position from `score.weight`, `[rows, ctx, 1]`; the reward loss reads each row's
    /// at its last token.
    Reward,
}

fn whole_rotation() -> f64 {
    1.0
}

impl LlamaConfig {
    /// A LLaMA decoder of these sizes with every option off: rotary base 10 000, the default
    /// feed-forward width, one key/value head per query head and an untied output head.
    pub fn new(vocab: i64, ctx: i64, layers: i64, heads: i64, dim: i64) -> Self {
        LlamaConfig {
            vocab,
            ctx,
            layers,
            heads,
            dim,
            ffn_dim: None,
            rope_theta: 10_000.0,
            kv_heads: None,
            norm_eps: DEFAULT_NORM_EPS,
            tie_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            norm_bias: false,
            fc_names: false,
            head_dim: None,
            rope_scaling: RopeScaling::None,
            partial_rotary: 1.0,
            proportional_rotary: false,
            full_layer_heads: None,
            value_norm: false,
            layer_scalar: false,
            multipliers: None,
            mup: None,
            local_rope: None,
            norm: NormKind::Weighted,
            activation: Activation::Silu,
            qk_norm: false,
            qk_norm_whole: false,
            qk_norm_after_rotation: false,
            clip_qkv: None,
            sandwich_norms: false,
            post_norms: false,
            recurrent_pre_norms: false,
            unrotated_layers: vec![],
            query_scaling: None,
            qk_l2_norm: false,
            attention_chunk: None,
            parallel_block: false,
            logit_scale: None,
            scale_embeddings: false,
            query_pre_attn_scalar: None,
            attn_softcap: None,
            logit_softcap: None,
            sliding_window: None,
            layer_types: None,
            fused_projections: false,
            fused_gate_up: false,
            interleaved_rotation: false,
            padding_token: None,
            moe: None,
            attention_sinks: false,
            linear_attention: None,
            state_space: None,
            selective_scan: None,
            short_conv: None,
            mixer_alone: false,
            shared_mlp: false,
            attention_output_gate: false,
            latent: None,
            dropout: DropoutRates::NONE,
            head: DecoderHead::LanguageModel,
        }
    }

    /// Whether layer `layer`'s attention turns its queries and keys by position.
    pub fn rotates(&self, layer: i64) -> bool {
        !self.unrotated_layers.contains(&layer)
    }

    /// Width of one attention head (of the sliding layers where full layers differ).
    pub fn head_width(&self) -> i64 {
        self.head_dim.unwrap_or(self.dim / self.heads.max(1))
    }

    /// The heads of layer `layer` where they differ from the others' (a full-attention
    /// layer beside sliding ones, [`FullLayerHeads`]).
    pub fn full_heads_at(&self, layer: usize) -> Option<&FullLayerHeads> {
        self.full_layer_heads.as_ref().filter(|_| self.window(layer).is_none() && !self.is_linear(layer))
    }

    /// Width of layer `layer`'s attention heads.
    pub fn head_width_at(&self, layer: usize) -> i64 {
        self.full_heads_at(layer).map_or(self.head_width(), |f| f.head_dim)
    }

    /// Key/value heads of layer `layer`.
    pub fn key_value_heads_at(&self, layer: usize) -> i64 {
        self.full_heads_at(layer).and_then(|f| f.kv_heads).unwrap_or(self.key_value_heads())
    }

    /// The rotation of global layers.
    pub fn rope(&self) -> Rope {
        Rope {
            theta: self.rope_theta,
            scaling: self.rope_scaling.clone(),
            partial: self.partial_rotary,
            proportional: self.proportional_rotary,
        }
    }

    /// Whether layer `layer` runs a recurrent mixer (linear attention, a state space or a
    /// short convolution) in place of softmax attention.
    pub fn is_linear(&self, layer: usize) -> bool {
        self.recurrent_mixers() > 0
            && self.layer_types.as_ref().is_some_and(|t| t.get(layer) == Some(&LayerAttention::Linear))
    }

    /// Whether layer `layer` runs a recurrent mixer beside attention
    /// ([`LayerAttention::Hybrid`]).
    pub fn is_hybrid(&self, layer: usize) -> bool {
        self.recurrent_mixers() > 0
            && self.layer_types.as_ref().is_some_and(|t| t.get(layer) == Some(&LayerAttention::Hybrid))
    }

    /// Whether layer `layer` mixes positions (every layer but those `layer_types` marks
    /// [`LayerAttention::FeedForwardOnly`]).
    pub fn has_mixer(&self, layer: usize) -> bool {
        self.layer_types.as_ref().is_none_or(|t| t.get(layer) != Some(&LayerAttention::FeedForwardOnly))
    }

    /// Whether layer `layer` has a feed-forward (every layer but those with a mixer where
    /// [`LlamaConfig::mixer_alone`] is set).
    pub fn has_feed_forward(&self, layer: usize) -> bool {
        !self.mixer_alone || !self.has_mixer(layer)
    }

    /// How many kinds of recurrent mixer the configuration sizes (one at most is valid).
    fn recurrent_mixers(&self) -> usize {
        [
            self.linear_attention.is_some(),
            self.state_space.is_some(),
            self.selective_scan.is_some(),
            self.short_conv.is_some(),
        ]
        .into_iter()
        .filter(|&given| given)
        .count()
    }

    /// Layer `layer`'s sliding window, if it has one.
    pub fn window(&self, layer: usize) -> Option<i64> {
        let sliding = match &self.layer_types {
            Some(types) => types.get(layer) == Some(&LayerAttention::Sliding),
            None => true,
        };
        self.sliding_window.filter(|_| sliding)
    }

    /// The module of each dense feed-forward's projections: `mlp`, or `feed_forward` where
    /// the experts are named so (Llama 4's) or beside Mamba-1 mixers (Jamba's, with or without
    /// experts).
    pub fn feed_forward_module(&self) -> &'static str {
        match &self.moe {
            _ if self.shared_mlp => "shared_mlp",
            _ if self.selective_scan.is_some() => "feed_forward",
            Some(m) if m.names == super::moe::ExpertNames::FeedForward => "feed_forward",
            _ => "mlp",
        }
    }

    /// The chunk width of layer `layer`'s attention, where it is chunked.
    pub fn chunk(&self, layer: usize) -> Option<i64> {
        let chunked = self.layer_types.as_ref().is_some_and(|t| t.get(layer) == Some(&LayerAttention::Chunked));
        self.attention_chunk.filter(|_| chunked)
    }

    /// Key/value heads: `kv_heads`, else one per query head.
    pub fn key_value_heads(&self) -> i64 {
        self.kv_heads.unwrap_or(self.heads)
    }

    /// Hidden size of the feed-forward: `ffn_dim`, else 8/3 · dim rounded up to 32.
    pub fn hidden(&self) -> i64 {
        self.ffn_dim.unwrap_or_else(|| (self.dim.saturating_mul(8) / 3 + 31) / 32 * 32)
    }

    /// Fails with the first size or option that does not fit: a size that is not positive,
    /// key/value heads that do not divide the query heads, an odd head width, layer types
    /// that do not match the layers, options that exclude each other, ...
    pub fn validate(&self) -> Result<()> {
        positive(&[
            ("vocab", self.vocab),
            ("ctx", self.ctx),
            ("layers", self.layers),
            ("heads", self.heads),
            ("dim", self.dim),
            ("ffn_dim", self.hidden()),
            ("kv_heads", self.key_value_heads()),
        ])?;
        self.dropout.validate()?;
        if let Some(l) = self.unrotated_layers.iter().find(|&&l| !(0..self.layers).contains(&l)) {
            return Err(Error::Config(format!("unrotated layer {l} is not one of the {} layers", self.layers)));
        }
        if let Some(scaling) = &self.query_scaling {
            scaling.validate()?;
        }
        if let Some(c) = self.attention_chunk.filter(|&c| c <= 0) {
            return Err(Error::Config(format!("attention_chunk must be positive, got {c}")));
        }
        let chunked = self.layer_types.as_ref().is_some_and(|t| t.contains(&LayerAttention::Chunked));
        if chunked && self.attention_chunk.is_none() {
            return Err(Error::Config("chunked layers need attention_chunk, the width of their chunks".into()));
        }
        if self.qk_l2_norm && (self.qk_norm || self.qk_norm_whole) {
            return Err(Error::Config("qk_l2_norm and qk_norm are two norms of the same queries and keys".into()));
        }
        if self.parallel_block && (self.sandwich_norms || self.post_norms) {
            return Err(Error::Config("a parallel block has its input norm alone".into()));
        }
        let single =
            self.mixer_alone || self.layer_types.as_ref().is_some_and(|t| t.contains(&LayerAttention::FeedForwardOnly));
        if single && (self.parallel_block || self.sandwich_norms || self.post_norms || self.layer_scalar) {
            return Err(Error::Config(
                "a block of one sub-layer has its input norm alone: no parallel block, post norms or scalar".into(),
            ));
        }
        // With a mixer alone on every layer `layer_types` does not mark, experts need it.
        let layers_with_feed_forward = self.layer_types.as_ref().map_or(0, Vec::len);
        if let Some(moe) = self.moe.as_ref().filter(|_| self.mixer_alone) {
            let listed = (0..layers_with_feed_forward as i64).filter(|&l| moe.is_sparse(l));
            if let Some(l) = listed.clone().find(|&l| !self.has_feed_forward(l as usize)) {
                return Err(Error::Config(format!("layer {l} is its mixer alone: it has no experts")));
            }
            if listed.count() == 0 {
                return Err(Error::Config("experts take layers that layer_types marks feed_forward_only".into()));
            }
        }
        if self.recurrent_pre_norms && !self.post_norms {
            return Err(Error::Config("recurrent_pre_norms makes exceptions to post_norms, which is off".into()));
        }
        if self.sandwich_norms && self.post_norms {
            return Err(Error::Config("sandwich_norms and post_norms are two placements of the same norms".into()));
        }
        for kv_heads in
            [Some(self.key_value_heads()), self.full_layer_heads.and_then(|f| f.kv_heads)].into_iter().flatten()
        {
            if kv_heads <= 0 || self.heads % kv_heads != 0 {
                return Err(Error::Config(format!(
                    "kv_heads {kv_heads} must divide the {} query heads (each key/value head serves a whole group)",
                    self.heads
                )));
            }
        }
        if let Some(full) = &self.full_layer_heads {
            if full.head_dim <= 0 || full.head_dim % 2 != 0 || full.head_dim > 1 << 20 {
                return Err(Error::Config(format!(
                    "the full layers' head_dim must be positive and even, got {}",
                    full.head_dim
                )));
            }
            if self.latent.is_some() || self.fused_projections || self.attention_output_gate {
                return Err(Error::Config(
                    "full layers' own heads take apart projections of query, key and value heads".into(),
                ));
            }
        }
        match self.head_dim {
            None if self.dim % self.heads != 0 || (self.dim / self.heads) % 2 != 0 => {
                return Err(Error::Config(format!(
                    "dim {} must split into {} heads of even size",
                    self.dim, self.heads
                )))
            }
            Some(h) if h <= 0 || h % 2 != 0 || h > 1 << 20 => {
                return Err(Error::Config(format!("head_dim must be positive and even, got {h}")))
            }
            _ => {}
        }
        match &self.latent {
            Some(latent) => {
                latent.validate()?;
                self.rope().validate(latent.rope_dim)?;
                if self.fused_projections || self.qk_norm || self.clip_qkv.is_some() || self.partial_rotary != 1.0 {
                    return Err(Error::Config(
                        "latent attention takes no fused projections, query/key norms, clipping or partial rotation"
                            .into(),
                    ));
                }
            }
            None => {
                // The global rotation turns the full layers' heads, and the sliding ones' where
                // they have none of their own.
                if let Some(full) = &self.full_layer_heads {
                    self.rope().validate(full.head_dim)?;
                }
                if self.full_layer_heads.is_none() || self.local_rope.is_none() {
                    self.rope().validate(self.head_width())?;
                }
            }
        }
        if let Some(local) = &self.local_rope {
            local.validate(self.head_width())?;
        }
        if let Some(w) = self.sliding_window.filter(|&w| w <= 0) {
            return Err(Error::Config(format!("sliding_window must be positive, got {w}")));
        }
        if let Some(types) = self.layer_types.as_ref().filter(|t| t.len() as i64 != self.layers) {
            return Err(Error::Config(format!("layer_types names {} layers of {}", types.len(), self.layers)));
        }
        for (name, value) in [
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("attn_logit_softcapping", self.attn_softcap),
            ("final_logit_softcapping", self.logit_softcap),
        ] {
            if let Some(v) = value.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(Error::Config(format!("{name} must be positive, got {v}")));
            }
        }
        if let Some(t) = self.padding_token.filter(|t| !(0..self.vocab).contains(t)) {
            return Err(Error::Config(format!("the padding token {t} is outside the vocabulary of {}", self.vocab)));
        }
        if self.fused_projections && (self.qkv_bias || self.o_bias) {
            return Err(Error::Config("fused projections carry no attention biases".into()));
        }
        if !self.activation.gated() && (self.fused_projections || self.fused_gate_up) {
            return Err(Error::Config("a feed-forward without a gate has no fused gate_up_proj".into()));
        }
        if self.shared_mlp
            && (!self.activation.gated()
                || self.fc_names
                || self.fused_projections
                || self.fused_gate_up
                || self.moe.as_ref().is_some_and(|m| m.beside_dense || m.shared_expert_dim.is_some()))
        {
            return Err(Error::Config(
                "a shared_mlp is one gated network of its own names beside the experts, without shared experts".into(),
            ));
        }
        if self.fc_names && self.activation.gated() {
            return Err(Error::Config("c_fc and c_proj name a feed-forward without a gate".into()));
        }
        if self.norm_bias && !self.norm.centred() {
            return Err(Error::Config("an RMS norm has no bias: norm_bias takes a layer norm".into()));
        }
        if self.norm_bias && self.qk_norm {
            return Err(Error::Config("query/key norms carry no bias".into()));
        }
        if self.mlp_bias && self.moe.is_some() {
            return Err(Error::Config("mlp_bias puts biases on dense feed-forwards, and experts carry none".into()));
        }
        if let Some(moe) = &self.moe {
            moe.validate()?;
            if self.fused_projections || self.fused_gate_up {
                return Err(Error::Config("a mixture of experts has no fused gate_up_proj".into()));
            }
        }
        if let Some(linear) = &self.linear_attention {
            linear.validate()?;
        }
        if let Some(state_space) = &self.state_space {
            state_space.validate()?;
        }
        if let Some(short_conv) = &self.short_conv {
            short_conv.validate()?;
        }
        if let Some(selective) = &self.selective_scan {
            selective.validate()?;
        }
        let linear_layers = self
            .layer_types
            .as_ref()
            .is_some_and(|t| t.iter().any(|k| matches!(k, LayerAttention::Linear | LayerAttention::Hybrid)));
        if usize::from(linear_layers) != self.recurrent_mixers() {
            return Err(Error::Config(
                "linear attention needs one kind's sizes (a Gated DeltaNet's, a Mamba-2 or Mamba-1 mixer's or a \
                 short convolution's) and the layers layer_types marks linear or hybrid"
                    .into(),
            ));
        }
        if self.attention_output_gate && (self.fused_projections || self.latent.is_some()) {
            return Err(Error::Config("an attention output gate takes separate query projections".into()));
        }
        if (self.qk_norm_whole || self.qk_norm_after_rotation) && !self.qk_norm {
            return Err(Error::Config(
                "qk_norm_whole and qk_norm_after_rotation say how query/key norms apply, and qk_norm is off".into(),
            ));
        }
        if self.qk_norm_whole && self.qk_norm_after_rotation {
            return Err(Error::Config("query/key norms over whole projections apply before the heads turn".into()));
        }
        if let Some(c) = self.clip_qkv.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return Err(Error::Config(format!("clip_qkv must be positive, got {c}")));
        }
        if let Some(m) = &self.multipliers {
            if ![m.embeddings, m.residual, m.scores, m.logits].iter().all(|v| v.is_finite() && *v != 0.0) {
                return Err(Error::Config(format!("multipliers must be finite and nonzero, got {m:?}")));
            }
            if self.scale_embeddings || self.query_pre_attn_scalar.is_some() || self.latent.is_some() {
                return Err(Error::Config("multipliers take the place of scaled embeddings and score scales".into()));
            }
        }
        if let Some(m) = &self.mup {
            if !m.all().all(|v| v.is_finite() && v != 0.0) {
                return Err(Error::Config(format!("μP multipliers must be finite and nonzero, got {m:?}")));
            }
            let elsewhere = self.multipliers.is_some()
                || self.scale_embeddings
                || self.logit_scale.is_some()
                || self.query_pre_attn_scalar.is_some()
                || self.latent.is_some();
            if elsewhere {
                return Err(Error::Config(
                    "μP multipliers take the place of other multipliers, scaled embeddings, logits and score scales"
                        .into(),
                ));
            }
            if self.moe.is_some() || !self.activation.gated() {
                return Err(Error::Config("μP multipliers scale a gated feed-forward, not experts".into()));
            }
            if !(0..self.layers as usize).all(|l| self.is_hybrid(l)) {
                return Err(Error::Config(
                    "μP multipliers scale layers whose recurrent mixer runs beside attention (hybrid), on every layer"
                        .into(),
                ));
            }
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(Error::Config(format!("norm_eps must be positive, got {}", self.norm_eps)));
        }
        Ok(())
    }
}

/// `y` times `by`, where there is a multiplier.
fn times(y: Tensor, by: Option<f64>) -> Result<Tensor> {
    match by {
        Some(m) => Ok(y.f_mul_scalar(m)?),
        None => Ok(y),
    }
}

/// A projection's weight and optional bias.
type Dense = (ParamId, Option<ParamId>);

/// The attention's input projections: apart (the values without one of their own where
/// they are the key projection's output), or fused into one `[q; k; v]` weight.
enum QkvProjection {
    Apart { q: Dense, k: Dense, v: Option<Dense> },
    Fused(ParamId),
}

/// The feed-forward's gate and up projections: apart, or fused into one `[gate; up]`.
enum GateUpProjection {
    Apart {
        gate: Dense,
        up: Dense,
    },
    Fused(Dense),
    /// No gate: the up projection alone, through its activation.
    UpAlone {
        up: Dense,
        activation: Ungated,
    },
}

/// The activation of a feed-forward without a gate.
enum Ungated {
    Relu2,
    GeluTanh,
    Xielu(Xielu),
}

/// One feed-forward network.
struct DenseFeedForward {
    gate_up: GateUpProjection,
    down: Dense,
}

/// A norm's weight, and its bias where the layer norms carry one.
#[derive(Clone, Copy)]
struct Norm {
    weight: ParamId,
    bias: Option<ParamId>,
}

/// xIELU's parameters in one block ([`Activation::Xielu`]): `mlp.act_fn.alpha_p` and
/// `alpha_n` (`[1]`, trained), `beta` and `eps` (scalars, stored and never trained).
struct Xielu {
    alpha_p: ParamId,
    alpha_n: ParamId,
    beta: ParamId,
    eps: ParamId,
}

impl Xielu {
    /// Declares block `block`'s xIELU, starting where its class starts: `α_p = α_n = 0.8`,
    /// `β = 0.5`, `ε = −1e-6`.
    fn declare(u: &mut UnitBuilder<'_>, block: &str) -> Xielu {
        let (alpha, beta, eps) = (0.8f64, 0.5, -1e-6);
        // softplus⁻¹(y) = ln(expm1(y)).
        let inverse_softplus = |y: f64| y.exp_m1().ln();
        // Each tensor rank sees its columns of the up projection: the scales' gradients are
        // partial sums over the tensor group.
        let mut scale = |what: &str, value: f64| {
            u.param(format!("{block}.mlp.act_fn.{what}"), &[1], Init::Constant { value }, TpRole::PartialGradient)
        };
        let alpha_p = scale("alpha_p", inverse_softplus(alpha));
        let alpha_n = scale("alpha_n", inverse_softplus(alpha - beta));
        let mut stored = |what: &str, value: f64| {
            u.frozen_param(format!("{block}.mlp.act_fn.{what}"), &[], Init::Constant { value }, TpRole::Replicated)
        };
        Xielu { alpha_p, alpha_n, beta: stored("beta", beta), eps: stored("eps", eps) }
    }

    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        // In the activations' dtype: fp32 scales would widen bf16 activations.
        let scalar = |id: ParamId| p[id].f_to_kind(x.kind());
        let beta = scalar(self.beta)?;
        let alpha_p = scalar(self.alpha_p)?.f_softplus()?;
        let alpha_n = scalar(self.alpha_n)?.f_softplus()?.f_add(&beta)?;
        let linear = x.f_mul(&beta)?;
        let positive = x.f_mul(&alpha_p)?.f_mul(x)?.f_add(&linear)?;
        let negative = x.f_minimum(&scalar(self.eps)?)?.f_expm1()?.f_sub(x)?.f_mul(&alpha_n)?.f_add(&linear)?;
        Ok(positive.f_where_self(&x.f_gt(0.0)?, &negative)?)
    }
}

/// A block's feed-forward: one gated network, experts a router chooses among, or both side
/// by side (Gemma 4's with norms of their own, Granite 4's summed as they are).
enum FeedForward {
    Dense(DenseFeedForward),
    Sparse(Box<SparseFeedForward>),
    /// Granite 4's `shared_mlp` over the same normed input as the experts, the two summed.
    BesideShared {
        shared: DenseFeedForward,
        sparse: Box<SparseFeedForward>,
    },
    Both(Box<DenseAndSparse>),
}

/// Gemma 4's feed-forward: the dense network over the normed input, normed after it; beside
/// it the experts over the residual stream normed their own way (the router reading the
/// residual stream itself), normed after them; the two summed.
struct DenseAndSparse {
    dense: DenseFeedForward,
    sparse: SparseFeedForward,
    /// `post_feedforward_layernorm_1`, `pre_feedforward_layernorm_2` and
    /// `post_feedforward_layernorm_2`.
    after_dense: Norm,
    before_experts: Norm,
    after_experts: Norm,
}

impl DenseFeedForward {
    /// The network over the normed hidden states `h`, entering and leaving the tensor group;
    /// its gate times `gate_scale` before the activation, where given.
    fn forward(&self, p: &Params<'_>, h: &Tensor, kinds: &Kinds, gate_scale: Option<f64>) -> Result<Tensor> {
        let h = p.tp().enter(h)?;
        let dense = |(w, b): Dense| p.linear(&h, w, b);
        let gated = match self.gate_up {
            GateUpProjection::Apart { gate, up } => kinds.gate(&times(dense(gate)?, gate_scale)?, &dense(up)?)?,
            GateUpProjection::Fused(both) => {
                let halves = dense(both)?.f_chunk(2, -1)?;
                kinds.gate(&times(halves[0].shallow_clone(), gate_scale)?, &halves[1])?
            }
            GateUpProjection::UpAlone { up, ref activation } => {
                let up = dense(up)?;
                match activation {
                    Ungated::Relu2 => up.f_relu()?.f_square()?,
                    Ungated::GeluTanh => gelu_tanh(&up)?,
                    Ungated::Xielu(xielu) => xielu.forward(p, &up)?,
                }
            }
        };
        p.row_linear(&gated, self.down.0, self.down.1)
    }
}

/// How the decoder's norms and gate compute (shared by its blocks and head).
#[derive(Clone, Copy)]
struct Kinds {
    norm: NormKind,
    activation: Activation,
    eps: f64,
}

impl Kinds {
    /// The scale a layer norm applies: its weight, or `1 + w` (Nemotron's).
    fn layer_scale(&self, p: &Params<'_>, n: Norm) -> Result<Tensor> {
        match self.norm {
            NormKind::LayerPlusOne => Ok(p[n.weight].f_add_scalar(1.0)?),
            _ => Ok(p[n.weight].shallow_clone()),
        }
    }

    fn norm(&self, p: &Params<'_>, x: &Tensor, n: Norm) -> Result<Tensor> {
        match (self.norm, n.bias) {
            // Validated: RMS norms carry no bias.
            (NormKind::Weighted, _) => rms_norm(x, &p[n.weight], self.eps),
            (NormKind::PlusOne, _) => rms_norm_plus_one(x, &p[n.weight], self.eps),
            (NormKind::Layer | NormKind::LayerPlusOne, None) => {
                layer_norm_unbiased(x, &self.layer_scale(p, n)?, self.eps)
            }
            (NormKind::Layer | NormKind::LayerPlusOne, Some(b)) => {
                layer_norm(x, &self.layer_scale(p, n)?, &p[b], self.eps)
            }
        }
    }

    /// The norm of a projection whole, which tensor ranks split in columns (validated: an
    /// RMS norm where they do).
    fn whole_projection_norm(&self, p: &Params<'_>, x: &Tensor, n: Norm) -> Result<Tensor> {
        match p.tp().size() {
            1 => self.norm(p, x, n),
            _ => rms_norm_split(x, &p[n.weight], self.eps, p.tp()),
        }
    }

    /// The norm of `x` where a matrix product alone reads it.
    fn norm_into_product(&self, p: &Params<'_>, x: &Tensor, n: Norm) -> Result<Tensor> {
        match (self.norm, n.bias) {
            (NormKind::Weighted, _) => rms_norm_into_product(x, &p[n.weight], self.eps),
            (NormKind::Layer | NormKind::LayerPlusOne, Some(b)) => {
                layer_norm_into_product(x, &self.layer_scale(p, n)?, &p[b], self.eps)
            }
            _ => self.norm(p, x, n),
        }
    }

    /// The residual sum `x + r` and its norm.
    fn add_norm(&self, p: &Params<'_>, x: &Tensor, r: &Tensor, n: Norm) -> Result<(Tensor, Tensor)> {
        match (self.norm, n.bias) {
            (NormKind::Weighted, _) => add_rms_norm(x, r, &p[n.weight], self.eps),
            (NormKind::Layer | NormKind::LayerPlusOne, Some(b)) => {
                add_layer_norm(x, r, &self.layer_scale(p, n)?, &p[b], self.eps)
            }
            _ => {
                let s = x.f_add(r)?;
                let normed = self.norm(p, &s, n)?;
                Ok((s, normed))
            }
        }
    }

    fn gate(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self.activation {
            Activation::Silu => swiglu(gate, up),
            Activation::GeluTanh => geglu(gate, up),
            ungated @ (Activation::Relu2 | Activation::UngatedGeluTanh | Activation::Xielu) => {
                Err(Error::Model(format!("the {ungated:?} feed-forward has no gate")))
            }
        }
    }
}

/// How a block's attention makes its queries, keys and values.
enum HeadInputs {
    /// Query heads and grouped key/value heads, each projected from the hidden states.
    Grouped(GroupedHeads),
    /// DeepSeek's latent attention ([`super::latent`]).
    Latent(LatentAttention),
}

/// Query heads sharing key/value heads in groups: projections, optional query/key norms
/// and clipping, and the rotation.
struct GroupedHeads {
    qkv: QkvProjection,
    /// Norms of the queries and of the keys: per head, or over whole projections.
    qk_norms: Option<(Norm, Norm)>,
    qk_norm_whole: bool,
    /// The per-head norms apply after the rotation.
    norms_after_rotation: bool,
    clip_qkv: Option<f64>,
    kv_heads: i64,
    head_dim: i64,
    /// The turn by position, where the layer has one.
    rotation: Option<Rotation>,
    /// The turned dimensions come as adjacent pairs.
    interleaved_rotation: bool,
    /// The queries' scale by position, where the family has one.
    query_scaling: Option<QueryScaling>,
    /// Queries and keys RMS-normed per head without a weight after the rotation.
    l2_norm: bool,
    kinds: Kinds,
    /// The query projection gives each head's output gate after its query.
    output_gate: bool,
    /// Values RMS-normed per head without a weight.
    value_norm: bool,
}

/// A block's softmax attention: how it makes queries, keys and values, its output
/// projection, sinks and options.
struct AttentionMixer {
    inputs: HeadInputs,
    o: Dense,
    /// Each head's sink logit, where the family has them.
    sinks: Option<ParamId>,
    options: AttentionOptions,
    /// Dropout of the attention probabilities (site 0).
    dropout: f64,
}

/// What mixes a block's positions: softmax attention or a recurrent mixer.
enum Mixer {
    Attention(Box<AttentionMixer>),
    Linear(Box<Recurrent>),
}

/// A block's recurrent mixer, whose state runs along the row: Qwen3-Next's Gated DeltaNet,
/// Granite 4's Mamba-2, Jamba's Mamba-1 or LFM2's short convolution.
enum Recurrent {
    DeltaNet(GatedDeltaNet),
    StateSpace(Mamba2),
    Selective(Mamba1),
    ShortConv(ShortConv),
}

impl Recurrent {
    /// Declares layer `name`'s recurrent mixer, where `cfg` gives it one.
    fn declare(u: &mut UnitBuilder<'_>, name: &str, cfg: &LlamaConfig) -> Option<Recurrent> {
        let d = cfg.dim;
        match (&cfg.linear_attention, &cfg.state_space, &cfg.selective_scan, &cfg.short_conv) {
            (Some(l), ..) => Some(Recurrent::DeltaNet(GatedDeltaNet::declare(u, name, l, d, cfg.norm_eps))),
            (_, Some(s), ..) => {
                let scales = cfg.mup.map(|m| m.recurrent_projection);
                Some(Recurrent::StateSpace(Mamba2::declare(u, name, s, (d, cfg.norm_eps), scales)))
            }
            (_, _, Some(s), _) => Some(Recurrent::Selective(Mamba1::declare(u, name, s, d))),
            (.., Some(c)) => Some(Recurrent::ShortConv(ShortConv::declare(u, name, c, d))),
            (None, None, None, None) => None,
        }
    }

    /// Values a token keeps for the backward, beyond the block's residual stream.
    fn kept_per_token(cfg: &LlamaConfig) -> f64 {
        let d = cfg.dim;
        match (&cfg.linear_attention, &cfg.state_space, &cfg.selective_scan, &cfg.short_conv) {
            (Some(l), ..) => l.kept_per_token(d) as f64,
            (_, Some(s), ..) => s.kept_per_token(d) as f64,
            (_, _, Some(s), _) => s.kept_per_token(d) as f64,
            (.., Some(c)) => c.kept_per_token(d) as f64,
            (None, None, None, None) => 0.0,
        }
    }

    /// The mixer over `h`, `keep` marking a decoded row's tokens (0 for its padding).
    fn forward(
        &self,
        p: &Params<'_>,
        h: &Tensor,
        cache: Option<&mut DecodeCache>,
        keep: Option<&Tensor>,
    ) -> Result<Tensor> {
        match self {
            Recurrent::DeltaNet(net) => net.forward(p, h, cache),
            Recurrent::StateSpace(mamba) => mamba.forward(p, h, cache, keep),
            Recurrent::Selective(mamba) => mamba.forward(p, h, cache, keep),
            Recurrent::ShortConv(conv) => conv.forward(p, h, cache, keep),
        }
    }
}

struct LlamaBlock {
    /// Norm of the attention's input (none with post norms alone).
    input_norm: Option<Norm>,
    /// `None`: the block is its feed-forward alone ([`LayerAttention::FeedForwardOnly`]).
    mixer: Option<Mixer>,
    /// Norm of the attention's output before the residual add (sandwich or post norms).
    post_attention_norm: Option<Norm>,
    /// Norm of the feed-forward's input (none with post norms alone).
    feed_forward_norm: Option<Norm>,
    /// `None`: the block is its mixer alone ([`LlamaConfig::mixer_alone`]).
    feed_forward: Option<FeedForward>,
    post_feed_forward_norm: Option<Norm>,
    heads: i64,
    kinds: Kinds,
    /// Dropout of each sub-layer's output before its residual sum (Phi-3's `resid_pdrop`).
    residual_dropout: f64,
    /// The stored scalar the block's output is multiplied by, where the family has one.
    scalar: Option<ParamId>,
    /// Each sub-layer's output's multiplier before its residual sum (Granite's).
    residual_multiplier: Option<f64>,
    /// The feed-forward reads the input norm beside attention ([`LlamaConfig::parallel_block`]).
    parallel: bool,
    /// A recurrent mixer beside attention over the same normed input ([`LayerAttention::Hybrid`]).
    beside: Option<Recurrent>,
    /// The multipliers of the mixers' inputs and outputs and of the feed-forward's output
    /// (Falcon-H1's).
    mup: Option<MupMultipliers>,
}

impl Unit for LlamaBlock {
    fn kind(&self) -> &'static str {
        "LlamaBlock"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        self.run(p, x, None)
    }
    fn decode(&self, p: &Params<'_>, x: &Tensor, cache: &mut DecodeCache) -> Result<Tensor> {
        self.run(p, x, Some(cache))
    }
    fn check_context_parallel(&self, split_heads: Option<i64>) -> Result<()> {
        if matches!(self.mixer, Some(Mixer::Linear(_))) || self.beside.is_some() {
            return Err(Error::Config(
                "linear attention's state runs along the whole row: it does not split over context ranks".into(),
            ));
        }
        split_heads.map_or(Ok(()), |ways| divides_heads(ways, "heads", self.heads))
    }
    fn check_tensor_parallel(&self, tp: i64) -> Result<()> {
        divides_heads(tp, "heads", self.heads)?;
        if self.beside.is_some() && tp > 1 {
            return Err(Error::Config("a recurrent mixer beside attention does not split over tensor ranks".into()));
        }
        match &self.mixer {
            Some(Mixer::Linear(_)) if tp > 1 => {
                Err(Error::Config("linear attention does not split over tensor ranks".into()))
            }
            Some(Mixer::Linear(_)) | None => Ok(()),
            Some(Mixer::Attention(a)) => match &a.inputs {
                HeadInputs::Grouped(g) if g.qk_norm_whole && g.kinds.norm != NormKind::Weighted && tp > 1 => {
                    Err(Error::Config(
                        "query/key norms over whole projections split over tensor ranks as RMS norms alone".into(),
                    ))
                }
                HeadInputs::Grouped(g) => divides_heads(tp, "key/value heads", g.kv_heads),
                HeadInputs::Latent(_) => Ok(()),
            },
        }
    }
}

impl GroupedHeads {
    /// This rank's queries, keys and values `[B, H, T, D]` of the normed input `h`, and the
    /// heads' output gates `[B, T, H·D]` where the queries' projection gives them.
    fn project(&self, p: &Params<'_>, h: &Tensor, heads: i64, kv_heads: i64) -> Result<Projected> {
        let dense = |(w, b): Dense| p.linear(h, w, b);
        let keys_values = |k: Dense, v: Option<Dense>| -> Result<(Tensor, Tensor)> {
            let k = dense(k)?;
            let v = match v {
                Some(v) => dense(v)?,
                None => k.shallow_clone(),
            };
            Ok((k, v))
        };
        let mut gate = None;
        let (q, k, v) = match self.qkv {
            QkvProjection::Apart { q, k, v } if self.output_gate => {
                let both = dense(q)?;
                let (b, t) = (both.size()[0], both.size()[1]);
                let both = both.f_view([b, t, heads, 2 * self.head_dim])?;
                gate = Some(both.f_narrow(-1, self.head_dim, self.head_dim)?.f_reshape([b, t, -1])?);
                let (k, v) = keys_values(k, v)?;
                (both.f_narrow(-1, 0, self.head_dim)?.f_reshape([b, t, -1])?, k, v)
            }
            QkvProjection::Apart { q, k, v } => {
                let (k, v) = keys_values(k, v)?;
                (dense(q)?, k, v)
            }
            QkvProjection::Fused(w) => {
                let (q, kv) = (heads * self.head_dim, kv_heads * self.head_dim);
                let parts = p.linear(h, w, None)?.f_split_with_sizes([q, kv, kv], -1)?;
                let [q, k, v] = <[Tensor; 3]>::try_from(parts).map_err(|_| Error::Model("qkv_proj split".into()))?;
                (q, k, v)
            }
        };
        let (q, k) = match self.qk_norms {
            Some((qn, kn)) if self.qk_norm_whole => {
                (self.kinds.whole_projection_norm(p, &q, qn)?, self.kinds.whole_projection_norm(p, &k, kn)?)
            }
            _ => (q, k),
        };
        let clip = |t: Tensor| -> Result<Tensor> {
            match self.clip_qkv {
                Some(c) => Ok(t.f_clamp(-c, c)?),
                None => Ok(t),
            }
        };
        let (q, k, v) =
            (split_heads(&clip(q)?, heads)?, split_heads(&clip(k)?, kv_heads)?, split_heads(&clip(v)?, kv_heads)?);
        let v = if self.value_norm { rms_norm_unweighted(&v, self.kinds.eps)? } else { v };
        match self.qk_norms {
            Some(norms) if !self.qk_norm_whole && !self.norms_after_rotation => {
                let (q, k) = self.per_head_norms(p, norms, q, k)?;
                Ok((q, k, v, gate))
            }
            _ => Ok((q, k, v, gate)),
        }
    }

    /// Queries and keys `[B, H, T, D]` each RMS-normed per head by its norm's weight.
    fn per_head_norms(&self, p: &Params<'_>, (qn, kn): (Norm, Norm), q: Tensor, k: Tensor) -> Result<(Tensor, Tensor)> {
        Ok((self.kinds.norm(p, &q, qn)?, self.kinds.norm(p, &k, kn)?))
    }

    /// This rank's queries (`heads` of them) and its keys and values repeated for each
    /// query head they serve, rotated where `placed` says; with a cache, the keys and values
    /// of every position it holds (no further back than a sliding `window` reads again).
    /// Under context parallelism they stay unrepeated: the context group exchanges them
    /// so, and repeats them where it attends.
    fn queries_keys_values(
        &self,
        p: &Params<'_>,
        h: &Tensor,
        heads: i64,
        placed: Placed<'_>,
        cache: Option<&mut DecodeCache>,
        window: Option<i64>,
    ) -> Result<Projected> {
        let kv_heads = self.kv_heads / p.tp().size();
        let (q, k, v, gate) = self.project(p, h, heads, kv_heads)?;
        let (q, k) = match &self.rotation {
            Some(rotation) if self.interleaved_rotation => {
                let dims = rotation.rotated_dims(self.head_dim);
                let (q, k) = pairs_as_halves(&q, &k, dims)?;
                rotation.rotate_placed(&q, &k, placed)?
            }
            Some(rotation) => rotation.rotate_placed(&q, &k, placed)?,
            None => (q, k),
        };
        let (q, k) = match self.qk_norms.filter(|_| self.norms_after_rotation) {
            Some(norms) => self.per_head_norms(p, norms, q, k)?,
            None if self.l2_norm => {
                (rms_norm_unweighted(&q, self.kinds.eps)?, rms_norm_unweighted(&k, self.kinds.eps)?)
            }
            None => (q, k),
        };
        let q = match &self.query_scaling {
            Some(scaling) => scaling.apply(&q, placed)?,
            None => q,
        };
        let cached = cache.is_some();
        let (k, v) = match cache {
            Some(c) => {
                let all = c.extend(&k, &v)?;
                if let Some(w) = window {
                    c.keep_last(w - 1)?;
                }
                all
            }
            None => (k, v),
        };
        // Each key/value head serves `heads / kv_heads` adjacent query heads.
        let exchanged_unrepeated = p.context().is_some() && !cached;
        let times = if exchanged_unrepeated { 1 } else { heads / kv_heads };
        Ok((q, repeat_heads(&k, times)?, repeat_heads(&v, times)?, gate))
    }
}

impl LlamaBlock {
    /// The block over new positions; with a cache, they follow the positions it holds and
    /// their attention also reads those positions' keys and values.
    fn run(&self, p: &Params<'_>, x: &Tensor, cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        // Split over the tensor group, this rank holds whole query heads and the key/value
        // heads they read, and its piece of the feed-forward.
        let tp = p.tp();
        let heads = self.heads / tp.size();
        let start = cache.as_ref().map_or(0, |c| c.position());
        let normed = match self.input_norm {
            Some(n) => self.kinds.norm_into_product(p, x, n)?,
            None => x.shallow_clone(),
        };
        let attended = match (&self.mixer, cache) {
            (None, _) => None,
            (Some(mixer), mut cache) => {
                let h = tp.enter(&normed)?;
                // The mixer beside attention first: attention's cache moves past the positions.
                let beside = match &self.beside {
                    Some(recurrent) => {
                        let h = times(h.shallow_clone(), self.mup.map(|m| m.recurrent_in))?;
                        let y = self.recurrent_mix(p, recurrent, h, cache.as_deref_mut())?;
                        Some(times(y, self.mup.map(|m| m.recurrent_out))?)
                    }
                    None => None,
                };
                // Validated: μP multipliers come with hybrid layers alone, whose mixer attends.
                let h = times(h, self.mup.map(|m| m.attention_in))?;
                let y = times(self.mix(p, mixer, h, heads, start, cache)?, self.mup.map(|m| m.attention_out))?;
                Some(match beside {
                    Some(beside) => y.f_add(&beside)?,
                    None => y,
                })
            }
        };
        // Where the residual stream holds this rank's piece of the sequence (sequence parallel).
        let piece = [tp.sequence_range(x.size()[1] * tp.size()).0];
        let (x, h) = match attended {
            // A block without a mixer feeds its input norm forward.
            None => (x.shallow_clone(), normed),
            Some(attended) => {
                let attended = self.post_norm(p, self.post_attention_norm, attended)?;
                let attended = self.scaled(attended)?;
                let attended = p.dropout(&attended, self.residual_dropout, 1, &piece)?;
                match (self.parallel, self.feed_forward_norm) {
                    // The feed-forward reads what attention read.
                    (true, _) => (x.f_add(&attended)?, normed),
                    (false, Some(n)) => self.kinds.add_norm(p, x, &attended, n)?,
                    (false, None) => {
                        let x = x.f_add(&attended)?;
                        (x.shallow_clone(), x)
                    }
                }
            }
        };
        let y = match &self.feed_forward {
            None => x,
            Some(feed_forward) => {
                let fed = match feed_forward {
                    FeedForward::Dense(dense) => {
                        let fed = dense.forward(p, &h, &self.kinds, self.mup.map(|m| m.gate))?;
                        times(fed, self.mup.map(|m| m.down))?
                    }
                    FeedForward::Sparse(experts) => experts.forward(p, &h, None)?,
                    FeedForward::BesideShared { shared, sparse } => {
                        sparse.forward(p, &h, None)?.f_add(&shared.forward(p, &h, &self.kinds, None)?)?
                    }
                    FeedForward::Both(both) => {
                        let dense =
                            self.kinds.norm(p, &both.dense.forward(p, &h, &self.kinds, None)?, both.after_dense)?;
                        let experts_input = self.kinds.norm(p, &x, both.before_experts)?;
                        let routed = both.sparse.forward(p, &experts_input, Some(&x))?;
                        dense.f_add(&self.kinds.norm(p, &routed, both.after_experts)?)?
                    }
                };
                let fed = self.scaled(self.post_norm(p, self.post_feed_forward_norm, fed)?)?;
                x.f_add(&p.dropout(&fed, self.residual_dropout, 2, &piece)?)?
            }
        };
        match self.scalar {
            Some(s) => Ok(y.f_mul(&p[s].f_to_kind(y.kind())?)?),
            None => Ok(y),
        }
    }

    /// The mixer's output over the normed input `h` (this rank's `heads` where attention
    /// splits over the tensor group), its positions following `start` cached ones.
    fn mix(
        &self,
        p: &Params<'_>,
        mixer: &Mixer,
        h: Tensor,
        heads: i64,
        start: i64,
        cache: Option<&mut DecodeCache>,
    ) -> Result<Tensor> {
        Ok(match (mixer, cache) {
            (Mixer::Linear(linear), mut cache) => {
                let t = h.size()[1];
                let y = self.recurrent_mix(p, linear, h, cache.as_deref_mut())?;
                if let Some(cache) = cache {
                    cache.advance(t);
                }
                y
            }
            (Mixer::Attention(a), mut cache) => {
                let placed = match p.layout() {
                    Some(layout) => Placed::Packed(&layout.positions, start + h.size()[1]),
                    None => Placed::After(start),
                };
                // Decoding, the layout marks left padding the cache must keep hidden.
                let hidden = match (cache.as_deref_mut(), p.layout()) {
                    (Some(c), Some(layout)) => Some(c.hide_other_examples(&layout.examples)?),
                    _ => None,
                };
                let packed = p.layout().filter(|_| cache.is_none());
                let (q, k, v, gate) = match &a.inputs {
                    HeadInputs::Grouped(g) => g.queries_keys_values(p, &h, heads, placed, cache, a.options.window)?,
                    HeadInputs::Latent(l) => l.queries_keys_values(p, &h, heads, placed, cache)?,
                };
                let probs = p.dropping_heads(a.dropout, 0, heads);
                let terms = ScoreTerms { bias: None, sinks: a.sinks.map(|s| &p[s]) };
                let y = match &hidden {
                    Some(mask) => attention(&q, &k, &v, &a.options, Some(mask), terms, probs.as_ref())?,
                    None => attend(p, &q, &k, &v, &a.options, packed, terms, probs.as_ref())?,
                };
                let y = merge_heads(&y)?;
                let y = match gate {
                    Some(gate) => y.f_mul(&gate.f_sigmoid()?)?,
                    None => y,
                };
                p.row_linear(&y, a.o.0, a.o.1)?
            }
        })
    }

    /// A recurrent mixer's output over the normed input `h`, continuing from and leaving its
    /// state in `cache` without moving the cache's position.
    fn recurrent_mix(
        &self,
        p: &Params<'_>,
        recurrent: &Recurrent,
        h: Tensor,
        cache: Option<&mut DecodeCache>,
    ) -> Result<Tensor> {
        let keep = match (p.layout(), &cache) {
            (Some(_), None) => {
                return Err(Error::Config(
                    "a recurrent mixer (linear attention, Mamba, a short convolution) takes no packed rows: its \
                     state would carry from one example to the next"
                        .into(),
                ))
            }
            (Some(layout), Some(_)) => Some(layout.examples.f_ne(0)?.f_to_kind(h.kind())?),
            (None, _) => None,
        };
        // A decoded row's left padding enters as zeros, and the mixers zero what their
        // biases make of it, which leaves the convolution's inputs and the recurrent
        // state as they start: the text follows as if alone.
        let h = match &keep {
            Some(keep) => h.f_mul(&keep.f_unsqueeze(-1)?)?,
            None => h,
        };
        recurrent.forward(p, &h, cache, keep.as_ref())
    }

    /// A sub-layer's output times the residual multiplier, where there is one.
    fn scaled(&self, y: Tensor) -> Result<Tensor> {
        times(y, self.residual_multiplier)
    }

    fn post_norm(&self, p: &Params<'_>, norm: Option<Norm>, y: Tensor) -> Result<Tensor> {
        match norm {
            Some(n) => self.kinds.norm(p, &y, n),
            None => Ok(y),
        }
    }
}

struct LlamaHead {
    norm: Norm,
    lm_head: ParamId,
    kinds: Kinds,
    vocab: i64,
    softcap: Option<f64>,
    /// The logits' divisor (Granite's), applied to the normed states the product reads.
    divisor: Option<f64>,
    /// The logits' scale (Cohere's), applied alike.
    scale: Option<f64>,
}

impl Unit for LlamaHead {
    fn kind(&self) -> &'static str {
        "LlamaHead"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let h = self.kinds.norm_into_product(p, x, self.norm)?;
        let h = match self.divisor {
            Some(d) => h.f_div_scalar(d)?,
            None => h,
        };
        let h = match self.scale {
            Some(s) => h.f_mul_scalar(s)?,
            None => h,
        };
        head_output(&h, &p[self.lm_head], self.vocab, self.softcap, p)
    }
    fn position_wise(&self) -> bool {
        true
    }
    fn scores_in_chunks(&self) -> bool {
        true
    }
    fn check_tensor_parallel(&self, _tp: i64) -> Result<()> {
        Ok(())
    }
}

/// A reward model's head: the final norm, then one score per position. Under tensor
/// parallelism every rank computes the same scores from the whole sequence, and only the
/// first rank's product carries a nonzero gradient, so that the group's sums of the input's
/// and the weight's gradients (`PartialGradient`) count it once.
struct RewardHead {
    norm: Norm,
    score: ParamId,
    kinds: Kinds,
}

impl Unit for RewardHead {
    fn kind(&self) -> &'static str {
        "LlamaRewardHead"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let h = self.kinds.norm(p, x, self.norm)?;
        let tp = p.tp();
        if tp.size() == 1 {
            return linear(&h, &p[self.score], None);
        }
        let scores = linear(&tp.enter(&h)?, &p[self.score], None)?;
        match tp.rank() {
            0 => Ok(scores),
            // The same values with a zero gradient, which still passes back through the
            // group's collectives as every rank's does.
            _ => Ok(scores.f_detach()?.f_add(&scores.f_mul_scalar(0.0)?)?),
        }
    }
    fn position_wise(&self) -> bool {
        true
    }
    fn check_tensor_parallel(&self, _tp: i64) -> Result<()> {
        Ok(())
    }
}

/// The decoder's model function: units `embedding`, `model.layers.{i}`, `head`.
pub fn llama(cfg: &LlamaConfig, b: &mut Builder) -> Result<()> {
    cfg.validate()?;
    let rates = &cfg.dropout;
    b.dropout(&DropoutRates {
        embedding: rates.embedding,
        attention: rates.attention,
        residual: rates.residual,
        ..DropoutRates::NONE
    });
    let (d, f, heads) = (cfg.dim, cfg.hidden(), cfg.heads);
    let normal = Init::Normal { std: STD };
    // Gemma's norms scale by 1 + w, so theirs start at zero.
    let norm_init = match cfg.norm {
        NormKind::Weighted | NormKind::Layer => Init::Ones,
        NormKind::PlusOne | NormKind::LayerPlusOne => Init::Zeros,
    };
    // A norm of `module` over `width`: its weight, and its bias where the layer norms have one
    // (held and trained as the weight is).
    let declare_norm = |u: &mut UnitBuilder<'_>, module: &str, width: i64, tp: TpRole| Norm {
        weight: u.norm(format!("{module}.weight"), &[width], norm_init, tp),
        bias: cfg.norm_bias.then(|| u.norm(format!("{module}.bias"), &[width], Init::Zeros, tp)),
    };
    let kinds = Kinds { norm: cfg.norm, activation: cfg.activation, eps: cfg.norm_eps };
    let mut u = b.unit("embedding");
    let embed = u.param("model.embed_tokens.weight", &[cfg.vocab, d], normal, TpRole::Vocab);
    let scale = match (cfg.multipliers, cfg.mup) {
        (Some(m), _) => Some(m.embeddings),
        (None, Some(m)) => Some(m.embeddings),
        (None, None) => cfg.scale_embeddings.then(|| (d as f64).sqrt()),
    };
    u.declare_cost(UnitCost::looking_up(Kept::ids(d).with_dropout(super::dropout::masked(rates.embedding, d), false)));
    u.finish(TokenEmbedding {
        table: embed,
        vocab: cfg.vocab,
        scale,
        padding: cfg.padding_token,
        dropout: rates.embedding,
        kind: "LlamaEmbedding",
    });
    // One balance over every sparse layer: its loss couples them.
    let sparse_layers = cfg.moe.as_ref().map_or(0, |m| (0..cfg.layers).filter(|&i| m.is_sparse(i)).count());
    let balance = cfg.moe.as_ref().filter(|_| sparse_layers > 0).map(|m| {
        let balance = Arc::new(LoadBalance::new(m, sparse_layers));
        b.load_balance(Arc::clone(&balance));
        balance
    });
    let mut sparse_seen = 0;
    for i in 0..cfg.layers {
        let name = format!("model.layers.{i}");
        let mut u = b.unit(name.clone());
        let layer = i as usize;
        let (hd, kv_heads) = (cfg.head_width_at(layer), cfg.key_value_heads_at(layer));
        let (q_out, kv_out) = (heads * hd, kv_heads * hd);
        let values_from_keys = cfg.full_heads_at(layer).is_some_and(|f| f.values_from_keys);
        // A block may be one of its sub-layers alone.
        let (mixes, feeds) = (cfg.has_mixer(layer), cfg.has_feed_forward(layer));
        // Linear and latent attention declare their own projections; the others project
        // whole heads (with each head's output gate beside its query where there is one).
        let (linear, latent, attended_width) = match &cfg.latent {
            _ if !mixes => (None, None, 0),
            _ if cfg.is_linear(layer) => (Recurrent::declare(&mut u, &name, cfg), None, 0),
            Some(l) => {
                let attention = LatentAttention::declare(&mut u, &name, l, d, heads, cfg.qkv_bias, cfg.rope())
                    .with_query_scaling(cfg.query_scaling);
                (None, Some(attention), heads * l.value_dim)
            }
            _ => (None, None, q_out),
        };
        let beside = cfg.is_hybrid(layer).then(|| Recurrent::declare(&mut u, &name, cfg)).flatten();
        let grouped = mixes && linear.is_none() && latent.is_none();
        let q_rows = if cfg.attention_output_gate { 2 * q_out } else { q_out };
        let sparse = cfg.moe.as_ref().filter(|m| feeds && m.is_sparse(i)).zip(balance.as_ref());
        let beside_dense = sparse.is_some_and(|(moe, _)| moe.beside_dense);
        // A dense feed-forward's activation without a gate, declared before the projections
        // borrow the unit (xIELU's scales are parameters of its own).
        let ungated = match cfg.activation {
            Activation::Relu2 => Some(Ungated::Relu2),
            Activation::UngatedGeluTanh => Some(Ungated::GeluTanh),
            Activation::Xielu if feeds && (sparse.is_none() || beside_dense) => {
                Some(Ungated::Xielu(Xielu::declare(&mut u, &name)))
            }
            _ => None,
        };
        let mut w = |suffix: &str, shape: &[i64], tp| u.linear(format!("{name}.{suffix}"), shape, normal, tp);
        let qkv = grouped.then(|| {
            if cfg.fused_projections {
                let role = TpRole::QueryKeyValue { heads, kv_heads };
                QkvProjection::Fused(w("self_attn.qkv_proj.weight", &[q_out + 2 * kv_out, d], role))
            } else {
                let (q, k) = (
                    w("self_attn.q_proj.weight", &[q_rows, d], TpRole::COLUMN),
                    w("self_attn.k_proj.weight", &[kv_out, d], TpRole::COLUMN),
                );
                let v = (!values_from_keys).then(|| (w("self_attn.v_proj.weight", &[kv_out, d], TpRole::COLUMN), None));
                QkvProjection::Apart { q: (q, None), k: (k, None), v }
            }
        });
        let o = (mixes && linear.is_none()).then(|| w("self_attn.o_proj.weight", &[d, attended_width], TpRole::Row));
        let dense = (feeds && (sparse.is_none() || beside_dense || cfg.shared_mlp)).then(|| {
            let module = cfg.feed_forward_module();
            let (gate_up_name, up_name, down_name) = match () {
                _ if cfg.shared_mlp => ("input_linear", "up_proj", "output_linear"),
                _ if cfg.fc_names => ("gate_up_proj", "c_fc", "c_proj"),
                _ => ("gate_up_proj", "up_proj", "down_proj"),
            };
            // A column projection's bias splits with its outputs; the down projection's is
            // added once after the row-parallel sum.
            let mut projection = |proj: &str, shape: [i64; 2], tp, bias_tp| -> Dense {
                let at = format!("{name}.{module}.{proj}");
                let weight = u.linear(format!("{at}.weight"), &shape, normal, tp);
                (weight, cfg.mlp_bias.then(|| u.param(format!("{at}.bias"), &shape[..1], Init::Zeros, bias_tp)))
            };
            let gate_up = if let Some(activation) = ungated {
                GateUpProjection::UpAlone {
                    up: projection(up_name, [f, d], TpRole::COLUMN, TpRole::COLUMN),
                    activation,
                }
            } else if cfg.fused_projections || cfg.fused_gate_up || cfg.shared_mlp {
                let parts = TpRole::Column { parts: 2 };
                GateUpProjection::Fused(projection(gate_up_name, [2 * f, d], parts, parts))
            } else {
                let gate = projection("gate_proj", [f, d], TpRole::COLUMN, TpRole::COLUMN);
                GateUpProjection::Apart { gate, up: projection(up_name, [f, d], TpRole::COLUMN, TpRole::COLUMN) }
            };
            let down = projection(down_name, [d, f], TpRole::Row, TpRole::SequenceReplicated);
            DenseFeedForward { gate_up, down }
        });
        let experts = sparse.map(|(moe, balance)| {
            sparse_seen += 1;
            SparseFeedForward::declare(&mut u, moe, &name, (d, cfg.norm_eps), sparse_seen - 1, balance)
        });
        // A column projection's bias splits with its outputs; the output projection's is
        // added once after the row-parallel sum.
        let mut bias = |proj: &str, out: i64, tp, given: bool| {
            given.then(|| u.param(format!("{name}.self_attn.{proj}.bias"), &[out], Init::Zeros, tp))
        };
        let qkv = qkv.map(|qkv| match qkv {
            QkvProjection::Apart { q, k, v } => QkvProjection::Apart {
                q: (q.0, bias("q_proj", q_rows, TpRole::COLUMN, cfg.qkv_bias)),
                k: (k.0, bias("k_proj", kv_out, TpRole::COLUMN, cfg.qkv_bias)),
                v: v.map(|v| (v.0, bias("v_proj", kv_out, TpRole::COLUMN, cfg.qkv_bias))),
            },
            fused => fused,
        });
        let o_bias = bias("o_proj", d, TpRole::SequenceReplicated, cfg.o_bias && o.is_some());
        // One per head: split with the heads.
        let sinks = (cfg.attention_sinks && o.is_some())
            .then(|| u.param(format!("{name}.self_attn.sinks"), &[heads], normal, TpRole::COLUMN));
        let mut norm = |module: &str, width: i64, tp| declare_norm(&mut u, &format!("{name}.{module}"), width, tp);
        // Norms before the sub-layers (LLaMA's), or after them alone.
        let pre_normed = !cfg.post_norms || cfg.recurrent_pre_norms && cfg.is_linear(layer);
        let input_norm = pre_normed.then(|| norm("input_layernorm", d, TpRole::SequenceReplicated));
        // Per head, each rank's applied to its own heads; or (OLMoE) over each projection
        // whole, split in columns with it.
        let (q_width, k_width, qk_role) = match cfg.qk_norm_whole {
            true => (q_out, kv_out, TpRole::COLUMN),
            false => (hd, hd, TpRole::PartialGradient),
        };
        let qk_norms = (cfg.qk_norm && qkv.is_some())
            .then(|| (norm("self_attn.q_norm", q_width, qk_role), norm("self_attn.k_norm", k_width, qk_role)));
        // With sandwich norms `post_attention_layernorm` norms the attention's output and
        // `pre_feedforward_layernorm` the feed-forward's input; with post norms alone there is
        // no input norm; with neither, `post_attention_layernorm` is the feed-forward's input
        // norm.
        let residual = TpRole::SequenceReplicated;
        let (post_attention_norm, feed_forward_norm, post_feed_forward_norm) = match () {
            _ if cfg.sandwich_norms || !pre_normed => (
                Some(norm("post_attention_layernorm", d, residual)),
                pre_normed.then(|| norm("pre_feedforward_layernorm", d, residual)),
                Some(norm("post_feedforward_layernorm", d, residual)),
            ),
            // A block of one sub-layer reads its input norm alone.
            _ if cfg.parallel_block || !mixes || !feeds => (None, None, None),
            _ => (None, Some(norm("post_attention_layernorm", d, residual)), None),
        };
        let feed_forward = match (dense, experts) {
            (Some(dense), None) => Some(FeedForward::Dense(dense)),
            (Some(shared), Some(sparse)) if cfg.shared_mlp => {
                Some(FeedForward::BesideShared { shared, sparse: Box::new(sparse) })
            }
            (None, Some(sparse)) => Some(FeedForward::Sparse(Box::new(sparse))),
            (Some(dense), Some(sparse)) => Some(FeedForward::Both(Box::new(DenseAndSparse {
                dense,
                sparse,
                after_dense: norm("post_feedforward_layernorm_1", d, residual),
                before_experts: norm("pre_feedforward_layernorm_2", d, residual),
                after_experts: norm("post_feedforward_layernorm_2", d, residual),
            }))),
            (None, None) if !feeds => None,
            (None, None) => return Err(Error::Model(format!("{name}: a block without a feed-forward"))),
        };
        let window = cfg.window(layer);
        let rope = match (&cfg.local_rope, window) {
            (Some(local), Some(_)) => local.clone(),
            _ => cfg.rope(),
        };
        // RMS norms keep their input and one statistic; SwiGLU keeps gate, up, the gate's
        // activation and their product (4·F), ReLU² and an ungated GELU the up projection and
        // its activation (2·F),
        // xIELU its input, the scaled input, the exponential, the branch mask and its output
        // (about 4·F); rotary embedding keeps nothing extra. A token
        // of a sparse layer keeps that for each of its k experts (and the shared one), its
        // routing probabilities, and its input again per slot (the grouped copy); it
        // multiplies by the router and its experts' weights alone.
        let (feed_forward_kept, idle_weights) = match cfg.moe.as_ref().filter(|m| m.is_sparse(i)) {
            _ if !feeds => (0.0, 0.0),
            Some(m) => {
                // An expert without a gate keeps its up projection and its activation (2·F)
                // and holds two matrices.
                let (kept, matrices) = if m.activation.gated() { (4, 3) } else { (2, 2) };
                // Experts in a latent space read and give its width, and the projections
                // into and out of it keep a token's input and the weighted sum.
                let width = m.latent_dim.unwrap_or(d);
                let latent = m.latent_dim.map_or(0, |l| d + l);
                let routed = (m.top_k * (kept * m.expert_ffn_dim + 2 * width) + latent) as f64 + 2.0 * m.experts as f64;
                let shared = m.shared_expert_dim.map_or(0.0, |s| (kept * s) as f64 + 1.0);
                // Beside a dense network: its 4·F, and (Gemma 4's) the three norms' inputs and
                // statistics.
                let dense = match () {
                    _ if m.beside_dense => 4.0 * cfg.hidden() as f64 + 3.0 * (d + 1) as f64,
                    _ if cfg.shared_mlp => 4.0 * cfg.hidden() as f64,
                    _ => 0.0,
                };
                (routed + shared + dense, ((m.experts - m.top_k) * matrices * width * m.expert_ffn_dim) as f64)
            }
            None => {
                let per_width = match cfg.activation {
                    Activation::Relu2 | Activation::UngatedGeluTanh => 2.0,
                    _ => 4.0,
                };
                (per_width * cfg.hidden() as f64, 0.0)
            }
        };
        let (attention_kept, attention_width, scale) = match &cfg.latent {
            _ if !mixes => (0.0, 0, None),
            // A recurrent mixer attends over no sequence.
            _ if linear.is_some() => (Recurrent::kept_per_token(cfg), 0, None),
            // Latent attention keeps, beyond the residual stream's norms and sums, its
            // low-rank queries and their norm, the latent and its norm, the expanded keys and
            // values and the whole queries; its scores read the queries' width, its weighted
            // sum the values'.
            Some(l) => {
                let low = 2 * l.q_rank.unwrap_or(0) + 2 * l.kv_rank + 2 * l.rope_dim;
                let heads_kept = cfg.heads * (3 * l.query_dim() + l.nope_dim + 2 * l.value_dim);
                (
                    (4 * d + low + heads_kept) as f64,
                    cfg.heads * (l.query_dim() + l.value_dim) / 2,
                    Some(l.score_scale(&rope)),
                )
            }
            _ => {
                let gate = if cfg.attention_output_gate { 2.0 * q_out as f64 } else { 0.0 };
                (10.0 * d as f64 + gate, cfg.heads * hd, cfg.query_pre_attn_scalar.map(|s| s.powf(-0.5)))
            }
        };
        let attends = mixes && linear.is_none();
        // A mixer beside attention keeps its own values too.
        let beside_kept = if beside.is_some() { Recurrent::kept_per_token(cfg) } else { 0.0 };
        let kept =
            Kept::block(attention_kept + beside_kept + feed_forward_kept + 7.0, if attends { cfg.heads } else { 0 }, d)
                .with_dropout(
                    super::dropout::masked(cfg.dropout.residual, 2 * d),
                    cfg.dropout.attention > 0.0 && attends,
                );
        u.declare_cost(UnitCost { idle_weights, ..UnitCost::attending(kept, attention_width) });
        let attention = |inputs, o| {
            Mixer::Attention(Box::new(AttentionMixer {
                inputs,
                o: (o, o_bias),
                sinks,
                options: AttentionOptions {
                    scale: match (cfg.multipliers, cfg.mup) {
                        (Some(m), _) => Some(m.scores),
                        // Keys times a multiplier: the scores times it.
                        (None, Some(m)) => Some(m.keys * scale.unwrap_or((hd as f64).powf(-0.5))),
                        (None, None) => scale,
                    },
                    window,
                    softcap: cfg.attn_softcap,
                    bidirectional: false,
                    chunk: cfg.chunk(layer),
                },
                dropout: cfg.dropout.attention,
            }))
        };
        let mixer = match (linear, latent, qkv, o) {
            (Some(linear), ..) => Some(Mixer::Linear(Box::new(linear))),
            (None, Some(latent), _, Some(o)) => Some(attention(HeadInputs::Latent(latent), o)),
            (None, None, Some(qkv), Some(o)) => Some(attention(
                HeadInputs::Grouped(GroupedHeads {
                    qkv,
                    qk_norms,
                    qk_norm_whole: cfg.qk_norm_whole,
                    norms_after_rotation: cfg.qk_norm_after_rotation,
                    clip_qkv: cfg.clip_qkv,
                    kv_heads,
                    head_dim: hd,
                    rotation: cfg.rotates(layer as i64).then(|| Rotation::new(rope)),
                    query_scaling: cfg.query_scaling.filter(|s| !s.unrotated_only || !cfg.rotates(layer as i64)),
                    l2_norm: cfg.qk_l2_norm && cfg.rotates(layer as i64),
                    interleaved_rotation: cfg.interleaved_rotation,
                    kinds,
                    output_gate: cfg.attention_output_gate,
                    value_norm: cfg.value_norm,
                }),
                o,
            )),
            (None, None, None, None) if !mixes => None,
            _ => return Err(Error::Model(format!("{name}: a block without a token mixer"))),
        };
        // A buffer of the family's files: stored and loaded, never trained.
        let scalar = cfg
            .layer_scalar
            .then(|| u.frozen_param(format!("{name}.layer_scalar"), &[1], Init::Ones, TpRole::Replicated));
        u.finish(LlamaBlock {
            input_norm,
            mixer,
            post_attention_norm,
            feed_forward_norm,
            feed_forward,
            post_feed_forward_norm,
            heads,
            kinds,
            residual_dropout: cfg.dropout.residual,
            scalar,
            residual_multiplier: cfg.multipliers.map(|m| m.residual),
            parallel: cfg.parallel_block,
            beside,
            mup: cfg.mup,
        });
    }
    let mut u = b.unit("head");
    let norm = declare_norm(&mut u, "model.norm", d, TpRole::SequenceReplicated);
    if cfg.head == DecoderHead::Reward {
        u.declare_cost(UnitCost::keeping(Kept::head(3.0 * d as f64 + 2.0, 1)));
        let score = u.param("score.weight", &[1, d], normal, TpRole::PartialGradient);
        u.finish(RewardHead { norm, score, kinds });
        return Ok(());
    }
    u.declare_cost(UnitCost::keeping(Kept::head(3.0 * d as f64 + 13.0, cfg.vocab)));
    let divisor = cfg.multipliers.map(|m| m.logits);
    let head = |lm_head| LlamaHead {
        norm,
        lm_head,
        kinds,
        vocab: cfg.vocab,
        softcap: cfg.logit_softcap,
        divisor,
        scale: cfg.logit_scale.or(cfg.mup.map(|m| m.logits)),
    };
    if cfg.tie_embeddings {
        let lm_head = u.borrow("model.embed_tokens.weight");
        u.finish(head(lm_head));
        b.alias("lm_head.weight", embed);
    } else {
        let lm_head = u.param("lm_head.weight", &[cfg.vocab, d], normal, TpRole::Vocab);
        u.finish(head(lm_head));
    }
    Ok(())
}
