//! Models as ordered lists of units.
//!
//! Owns: parameter specifications (names, shapes, init, dtype, tensor-parallel role), the
//! [`Builder`] that records them without allocating, the [`Unit`] trait (a forward from
//! activations to activations over borrowed parameters) and the reference models.
//! Must not own storage, placement or execution order: that is the engine's.

mod bert;
pub mod context;
mod cost;
pub mod dropout;
mod gpt;
pub mod head_loss;
pub mod hf;
pub mod latent;
pub mod layers;
pub mod linear;
mod llama;
pub mod mamba;
mod mlp;
pub mod moe;
pub mod presets;
pub mod rope;
pub mod selective;
pub mod short_conv;
mod t5;
pub mod tensor;

pub use bert::{bert, BertConfig, BertHead};
pub use context::{ContextParallel, SequencePiece};
pub use cost::{Kept, UnitCost};
pub use dropout::{DropoutDraw, DropoutRates, UnitDraw};
pub use gpt::{gpt, GptConfig};
pub use head_loss::HeadScoring;
pub use hf::{from_pretrained_dir, Family, GenerationDefaults, ModelDir};
pub use latent::LatentConfig;
pub use layers::NoTensorParallel;
pub use linear::LinearAttentionConfig;
pub use llama::{
    llama, Activation, DecoderHead, FullLayerHeads, LayerAttention, LlamaConfig, Multipliers, MupMultipliers, NormKind,
};
pub use mamba::{GatedNorm, StateSpaceConfig};
pub use mlp::{mlp, MlpConfig};
pub use moe::{
    BalanceReport, ExpertExchange, ExpertNames, GroupScore, LoadBalance, MoeConfig, Routed, RowSharers, Scoring,
};
pub use presets::{preset, preset_names};
pub use rope::{QueryScaling, Rope, RopeScaling, Rotation};
pub use selective::{InnerNorms, SelectiveScanConfig};
pub use short_conv::ShortConvConfig;
pub use t5::{t5, FeedForwardActivation, T5Config};
pub use tensor::{TensorParallel, TpRole, WholeSequence};

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// One of the built-in models with its configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "model", rename_all = "lowercase")]
// A configuration is made once a run and read by value in patterns: boxing the decoder's
// wider one would buy nothing and cost every match a dereference.
#[allow(clippy::large_enum_variant)]
pub enum ModelConfig {
    /// GPT-2's decoder ([`gpt`]).
    Gpt(GptConfig),
    /// BERT's encoder ([`bert`]).
    Bert(BertConfig),
    /// The decoder of LLaMA and its descendants ([`llama`]).
    Llama(LlamaConfig),
    /// The small residual MLP language model ([`mlp`]).
    Mlp(MlpConfig),
    /// T5's encoder–decoder ([`t5`]).
    T5(T5Config),
}

impl ModelConfig {
    /// The mixture of experts of a decoder that has one.
    pub fn moe(&self) -> Option<&MoeConfig> {
        match self {
            ModelConfig::Llama(c) => c.moe.as_ref(),
            _ => None,
        }
    }

    /// The mixture of experts of a decoder that has one, to change.
    pub fn moe_mut(&mut self) -> Option<&mut MoeConfig> {
        match self {
            ModelConfig::Llama(c) => c.moe.as_mut(),
            _ => None,
        }
    }

    /// The dropout rates of a model that has dropout sites (all but the MLP; the decoder
    /// reads only `attention`), to change.
    pub fn dropout_mut(&mut self) -> Option<&mut DropoutRates> {
        match self {
            ModelConfig::Gpt(c) => Some(&mut c.dropout),
            ModelConfig::Bert(c) => Some(&mut c.dropout),
            ModelConfig::T5(c) => Some(&mut c.dropout),
            ModelConfig::Llama(c) => Some(&mut c.dropout),
            ModelConfig::Mlp(_) => None,
        }
    }

    /// The model function of the configuration.
    pub fn build(&self, b: &mut Builder) -> Result<()> {
        match self {
            ModelConfig::Gpt(c) => gpt(c, b),
            ModelConfig::Bert(c) => bert(c, b),
            ModelConfig::Llama(c) => llama(c, b),
            ModelConfig::Mlp(c) => mlp(c, b),
            ModelConfig::T5(c) => t5(c, b),
        }
    }

    /// The whole model's description.
    pub fn spec(&self) -> Result<ModelSpec> {
        let mut b = Builder::new();
        self.build(&mut b)?;
        Ok(ModelSpec { family: Family::of(self).ok(), ..b.build()? })
    }

    /// How many token types (parts of a text pair) the model embeds, where it takes them.
    pub fn token_types(&self) -> Option<i64> {
        match self {
            ModelConfig::Bert(c) => Some(c.type_vocab),
            ModelConfig::Gpt(_) | ModelConfig::Llama(_) | ModelConfig::Mlp(_) | ModelConfig::T5(_) => None,
        }
    }

    /// Values the decoding cache holds for one row of `positions` tokens on one rank of a
    /// tensor group of `tensor`, layer by layer: its share of the key/value heads' keys and
    /// values (a sliding window's layers at most the window), a latent attention's latent
    /// and rotated key part (whole on every tensor rank, each expanding its heads from it),
    /// and 0 for a linear attention's state, which does not grow; `None` for a model that is
    /// not a decoder.
    pub fn cached_values(&self, positions: i64, tensor: i64) -> Option<Vec<i64>> {
        let tensor = tensor.max(1);
        match self {
            ModelConfig::Gpt(c) => Some(vec![2 * c.dim * positions / tensor; c.layers as usize]),
            ModelConfig::Llama(c) => Some(
                (0..c.layers as usize)
                    .map(|l| match &c.latent {
                        _ if c.is_linear(l) => 0,
                        Some(latent) => (latent.kv_rank + latent.rope_dim) * positions,
                        None => {
                            let kept = c.window(l).map_or(positions, |w| w.min(positions));
                            2 * c.key_value_heads_at(l) / tensor * c.head_width_at(l) * kept
                        }
                    })
                    .collect(),
            ),
            ModelConfig::Bert(_) | ModelConfig::Mlp(_) | ModelConfig::T5(_) => None,
        }
    }

    /// The longest sequence the model takes, where it has a limit.
    pub fn context(&self) -> Option<i64> {
        match self {
            ModelConfig::Gpt(c) => Some(c.ctx),
            ModelConfig::Bert(c) => Some(c.max_positions),
            ModelConfig::Llama(c) => Some(c.ctx),
            ModelConfig::Mlp(_) | ModelConfig::T5(_) => None,
        }
    }

    /// Vocabulary size: how many token ids the model embeds.
    pub fn vocab(&self) -> i64 {
        match self {
            ModelConfig::Gpt(c) => c.vocab,
            ModelConfig::Bert(c) => c.vocab,
            ModelConfig::Llama(c) => c.vocab,
            ModelConfig::Mlp(c) => c.vocab,
            ModelConfig::T5(c) => c.vocab,
        }
    }
}

/// What a unit keeps between the steps of token-by-token decoding: how many positions it
/// has seen and, for attention, their keys and values (`[B, H, T, D]`) and, where rows of
/// several lengths decode together, which example each held position belongs to (`[B, T]`:
/// 0 for a row's left padding, 1 for its text).
#[derive(Default)]
pub struct DecodeCache {
    position: i64,
    keys_values: Option<(Tensor, Tensor)>,
    examples: Option<Tensor>,
    encoded: Option<EncodedMemory>,
    recurrent: Option<linear::RecurrentState>,
}

/// What a decoder layer's cross-attention reads of the encoder's output, computed at the
/// first decoding step and kept for the others: its keys and values (`[B, H, S, D]`) and the
/// source positions hidden from every target (`[B, 1, 1, S]`, padding), where any are.
pub struct EncodedMemory {
    /// The keys of the encoder's output, `[B, H, S, D]`.
    pub keys: Tensor,
    /// The values of the encoder's output, `[B, H, S, D]`.
    pub values: Tensor,
    /// Source positions hidden from every target (`[B, 1, 1, S]`, padding), where any are.
    pub hidden: Option<Tensor>,
}

impl DecodeCache {
    /// Positions seen so far: the position of the next input's first token.
    pub fn position(&self) -> i64 {
        self.position
    }

    /// Moves past `len` new positions; returns the first of them.
    pub fn advance(&mut self, len: i64) -> i64 {
        self.position += len;
        self.position - len
    }

    /// Appends the new positions' keys and values (time is dimension 2) and returns all
    /// of them so far.
    pub fn extend(&mut self, keys: &Tensor, values: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = match &self.keys_values {
            Some((k0, v0)) => (Tensor::f_cat(&[k0, keys], 2)?, Tensor::f_cat(&[v0, values], 2)?),
            // Keys and values split from a fused projection are views of it: held as they
            // are, they would keep the queries' part alive beside them for the whole decode.
            None => (keys.f_contiguous()?, values.f_contiguous()?),
        };
        self.advance(keys.size()[2]);
        self.keys_values = Some((k.shallow_clone(), v.shallow_clone()));
        Ok((k, v))
    }

    /// Records which example each new position belongs to (`examples`, `[B, new]`, as
    /// [`RowLayout::examples`]) after those held, and returns the `[B, 1, new, held + new]`
    /// mask of the positions of another example than each new one's: what its attention must
    /// not read (a shorter row's left padding). Call it before [`DecodeCache::extend`] adds
    /// the same positions' keys and values.
    pub fn hide_other_examples(&mut self, examples: &Tensor) -> Result<Tensor> {
        let all = match &self.examples {
            Some(held) => Tensor::f_cat(&[held, examples], 1)?,
            None => examples.shallow_clone(),
        };
        self.examples = Some(all.shallow_clone());
        layers::examples_differ(examples, &all)
    }

    /// Forgets all but the last `keep` positions' keys, values and examples (a sliding
    /// window's attention never reads further back); positions still count from the first.
    pub fn keep_last(&mut self, keep: i64) -> Result<()> {
        let last = |t: &mut Tensor, dim: i64| -> Result<()> {
            let held = t.size()[dim as usize];
            if held > keep {
                *t = t.f_narrow(dim, held - keep, keep)?;
            }
            Ok(())
        };
        if let Some((k, v)) = &mut self.keys_values {
            last(k, 2)?;
            last(v, 2)?;
        }
        if let Some(examples) = &mut self.examples {
            last(examples, 1)?;
        }
        Ok(())
    }

    /// Keeps what the cross-attention reads of the encoder's output for the next steps.
    pub fn keep_encoded(&mut self, memory: EncodedMemory) {
        self.encoded = Some(memory);
    }

    /// The cross-attention's memory kept at the first step, where one was.
    pub fn encoded(&self) -> Option<&EncodedMemory> {
        self.encoded.as_ref()
    }

    /// Keeps a linear attention's convolution inputs and recurrent state for the next steps.
    pub fn keep_recurrent(&mut self, state: linear::RecurrentState) {
        self.recurrent = Some(state);
    }

    /// A linear attention's state after the positions seen so far, where one is kept.
    pub fn recurrent(&self) -> Option<&linear::RecurrentState> {
        self.recurrent.as_ref()
    }

    /// Positions whose keys and values are held.
    pub fn held(&self) -> i64 {
        self.keys_values.as_ref().map_or(0, |(k, _)| k.size()[2])
    }
}

/// Standard deviation of the normal initialisation of weights (GPT-2's, LLaMA's).
pub const INIT_STD: f64 = 0.02;

/// The epsilon of the built-in models' norms unless their config says otherwise (GPT-2's
/// `layer_norm_epsilon`, LLaMA's `rms_norm_eps`).
pub const DEFAULT_NORM_EPS: f64 = 1e-5;

/// Serde's default for configs saved before they carried an epsilon.
pub(crate) fn default_norm_eps() -> f64 {
    DEFAULT_NORM_EPS
}

/// Fails with the first of `values` (name, value) that is not positive.
/// Model sizes are positive and at most 2^31, so the builders' products of them (a
/// matrix's elements, a widened feed-forward) cannot overflow.
pub(crate) fn positive(values: &[(&str, i64)]) -> Result<()> {
    const LARGEST: i64 = 1 << 31;
    match values.iter().find(|(_, v)| *v <= 0 || *v > LARGEST) {
        Some((name, v)) if *v <= 0 => Err(Error::Config(format!("{name} must be positive, got {v}"))),
        Some((name, v)) => Err(Error::Config(format!("{name} = {v} is larger than a model size may be (2^31)"))),
        None => Ok(()),
    }
}

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with mean zero.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Uniform on `[-bound, bound]` (`nn.Linear`'s own draw, and LoRA's `A`).
    Uniform {
        /// Half the interval's width.
        bound: f64,
    },
    /// Every element `value`.
    Constant {
        /// The value.
        value: f64,
    },
}

/// Index of a parameter in its [`ModelSpec`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub usize);

/// One parameter as the model declares it; nothing is allocated.
#[derive(Clone, Debug)]
pub struct ParamSpec {
    /// Hierarchical name as in PyTorch state dicts, e.g. `transformer.h.0.attn.c_attn.weight`.
    pub name: String,
    /// The whole tensor's shape.
    pub shape: Vec<i64>,
    /// How the parameter is initialised.
    pub init: Init,
    /// A fixed dtype, or `None` to follow the model's dtype.
    pub kind: Option<Kind>,
    /// How tensor parallelism splits it; `shape` is always the whole tensor's.
    pub tp: TpRole,
    /// Index of the unit that owns (stores) this parameter.
    pub unit: usize,
    /// Whether the parameter trains (off once frozen, [`ModelSpec::freeze`]).
    pub requires_grad: bool,
    /// Whether it is the `[out, in]` weight of a linear layer its unit applies through
    /// [`Params::linear`] or [`Params::row_linear`]: what a low-rank adapter may join.
    pub linear: bool,
    /// For a routed expert's weight or bias, which expert of its layer it belongs to: what
    /// expert parallelism stores on the rank computing that expert alone.
    pub expert: Option<ExpertSlot>,
    /// Whether it belongs to a normalisation layer ([`UnitBuilder::norm`]), whatever its name.
    pub norm: bool,
}

/// A routed expert's place among its sparse layer's experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExpertSlot {
    /// The expert's index in its layer.
    pub index: i64,
    /// Routed experts in the layer.
    pub of: i64,
}

impl ExpertSlot {
    /// The rank of an expert group of `size` ranks that computes this expert (each rank
    /// computes an equal run of consecutive experts, [`ExpertExchange`]).
    pub fn owner(self, size: i64) -> i64 {
        self.index / (self.of / size).max(1)
    }
}

impl ParamSpec {
    /// Elements of the whole tensor.
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    /// The shape of one rank's piece when split over `tp` tensor ranks.
    pub fn local_shape(&self, tp: i64) -> Vec<i64> {
        self.tp.local_shape(&self.shape, tp)
    }

    /// Whether `transformers`' `Trainer` leaves it out of weight decay: a normalisation
    /// layer's parameter, or one whose lower-cased name holds `bias`, `layernorm` or
    /// `rmsnorm`, or a part `norm` or ending in `_norm` (its `get_decay_parameter_names`).
    pub fn trainer_skips_decay(&self) -> bool {
        let name = self.name.to_lowercase();
        self.norm
            || ["bias", "layernorm", "rmsnorm"].iter().any(|n| name.contains(n))
            || name.split('.').any(|part| part == "norm" || part.ends_with("_norm"))
    }
}

/// A unit's side input where a batch's rows hold several examples (packing) or an example
/// and padding, both `[rows, ctx]` int64: each position's place within its example
/// (positions restart at every example) and the example it belongs to, numbered within its
/// row (the padding after the last example is one more). Units read positions from it and
/// let a position attend only to positions of its example (earlier ones, in a decoder).
/// `segments`, where given, is the part of a text pair each position belongs to (BERT's
/// token types: 0 for the first text, 1 for the second). `source_len`, where given, says
/// that every row holds a source and then its target (an encoder–decoder's input, T5's): its
/// first `source_len` positions are the encoder's, the rest the decoder's.
#[derive(Debug)]
pub struct RowLayout {
    /// Each position's place within its example.
    pub positions: Tensor,
    /// The example each position belongs to, numbered within its row.
    pub examples: Tensor,
    /// The part of a text pair each position belongs to (BERT's token types), where given.
    pub segments: Option<Tensor>,
    /// Where every row holds a source and then its target: how many positions the source takes.
    pub source_len: Option<i64>,
}

impl RowLayout {
    /// The same tensors, shared.
    pub fn shallow_clone(&self) -> RowLayout {
        RowLayout {
            positions: self.positions.shallow_clone(),
            examples: self.examples.shallow_clone(),
            segments: self.segments.as_ref().map(Tensor::shallow_clone),
            source_len: self.source_len,
        }
    }

    /// The layout of encoder–decoder rows of `sources` source positions then `targets`
    /// target positions, row `r`'s source `source_lengths[r]` long and padded after: positions
    /// count from 0 in each part; the padding of a source is an example of its own (hidden
    /// from every other position), a target's is not (its loss is masked and causal
    /// attention keeps it from the positions before it).
    pub fn encoder_decoder(source_lengths: &[i64], sources: i64, targets: i64) -> Result<RowLayout> {
        if let Some(bad) = source_lengths.iter().find(|&&n| n < 1 || n > sources) {
            return Err(Error::Data(format!("a source of {bad} tokens in rows of {sources} source positions")));
        }
        let grid = |cell: &dyn Fn(i64, i64) -> i64| -> Result<Tensor> {
            let width = sources + targets;
            let v: Vec<i64> =
                source_lengths.iter().flat_map(|&n| (0..width).map(move |t| (n, t))).map(|(n, t)| cell(n, t)).collect();
            Ok(Tensor::f_from_slice(&v)?.f_view([source_lengths.len() as i64, width])?)
        };
        Ok(RowLayout {
            positions: grid(&|_, t| if t < sources { t } else { t - sources })?,
            examples: grid(&|n, t| i64::from(t >= n && t < sources))?,
            segments: None,
            source_len: Some(sources),
        })
    }

    /// The layout of positions `span` of rows decoded together from prompts of several
    /// lengths, row `r` left-padded by `padding[r]` positions: each position's place counts
    /// from its row's first token (padding's is 0), and the padding is example 0, the text
    /// example 1, so the text never reads the padding ([`DecodeCache::hide_other_examples`]).
    pub fn left_padded(padding: &[i64], span: std::ops::Range<i64>) -> Result<RowLayout> {
        let grid = |cell: &dyn Fn(i64, i64) -> i64| -> Result<Tensor> {
            let v: Vec<i64> = padding.iter().flat_map(|&pad| span.clone().map(move |t| cell(pad, t))).collect();
            Ok(Tensor::f_from_slice(&v)?.f_view([padding.len() as i64, span.end - span.start])?)
        };
        Ok(RowLayout {
            positions: grid(&|pad, t| (t - pad).max(0))?,
            examples: grid(&|pad, t| i64::from(t >= pad))?,
            segments: None,
            source_len: None,
        })
    }

    /// The same layout on `device`.
    pub fn to_device(&self, device: tch::Device) -> Result<RowLayout> {
        let on = |t: &Tensor| t.f_to_device(device);
        Ok(RowLayout {
            positions: on(&self.positions)?,
            examples: on(&self.examples)?,
            segments: self.segments.as_ref().map(on).transpose()?,
            source_len: self.source_len,
        })
    }
}

/// The parameters a unit's forward reads, by [`ParamId`], and the tensor group it runs in.
pub struct Params<'a> {
    tensors: &'a [Tensor],
    tp: &'a dyn TensorParallel,
    layout: Option<&'a RowLayout>,
    adapters: Option<&'a Adapters>,
    experts: Option<&'a std::sync::Arc<dyn ExpertExchange>>,
    context: Option<&'a std::sync::Arc<dyn ContextParallel>>,
    padding: Option<&'a Tensor>,
    dropout: Option<&'a UnitDraw>,
    scoring: Option<&'a HeadScoring>,
}

/// A low-rank adapter (LoRA) joined to a linear layer: the layer computes
/// `x·Wᵀ + scale·(x·Aᵀ)·Bᵀ`, with `A` `[r, in]` and `B` `[out, r]` parameters of the
/// weight's unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adapter {
    /// The `[r, in]` factor `A`.
    pub a: ParamId,
    /// The `[out, r]` factor `B`.
    pub b: ParamId,
    /// The factor of the adapter's product (`alpha / r`, or `alpha / √r` with `use_rslora`).
    pub scale: f64,
    /// The share of the adapter's input dropped in training (peft's `lora_dropout`), at
    /// site `dropout_site` of its unit ([`dropout::adapter_site`]).
    pub dropout: f64,
    /// Where its masks are drawn within its unit.
    pub dropout_site: u32,
    /// The rows of `B` this weight takes, where one `B` serves two weights: an expert's
    /// gate and up projections, which peft adapts as one stacked matrix (gate rows first).
    pub rows: Option<(i64, i64)>,
}

impl Adapter {
    /// The `[r, in]` and `[out, r]` factors this adapter's weight uses, from its
    /// parameters' tensors `a` and `b` (a view of `b`'s rows, where it serves two weights).
    pub fn factors(&self, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
        let b = match self.rows {
            Some((first, len)) => b.f_narrow(0, first, len)?,
            None => b.shallow_clone(),
        };
        Ok((a.shallow_clone(), b))
    }
}

/// The adapters of a model, by the weight of the linear layer each joins.
pub type Adapters = std::collections::BTreeMap<ParamId, Adapter>;

impl<'a> Params<'a> {
    /// Parameters of a unit that runs whole on one rank.
    pub fn new(tensors: &'a [Tensor]) -> Self {
        Params {
            tensors,
            tp: &NoTensorParallel,
            layout: None,
            adapters: None,
            experts: None,
            context: None,
            padding: None,
            dropout: None,
            scoring: None,
        }
    }

    /// Parameters holding this rank's pieces, for a unit split over `tp`.
    pub fn split(tensors: &'a [Tensor], tp: &'a dyn TensorParallel) -> Self {
        Params { tp, ..Params::new(tensors) }
    }

    /// The tensor group the unit runs in (one rank unless the strategy splits it).
    pub fn tp(&self) -> &dyn TensorParallel {
        self.tp
    }

    /// The same parameters for rows laid out as `layout` says.
    pub fn with_layout(self, layout: Option<&'a RowLayout>) -> Self {
        Params { layout, ..self }
    }

    /// The same parameters for a rank of an expert group: sparse layers compute their share
    /// of the experts for the whole group's tokens.
    pub fn with_experts(self, experts: Option<&'a std::sync::Arc<dyn ExpertExchange>>) -> Self {
        Params { experts: experts.filter(|e| e.size() > 1), ..self }
    }

    /// The same parameters for a rank of a context group: the rows hold its piece of each
    /// row's positions, and attention reaches the others' through the group.
    pub fn with_context(self, context: Option<&'a std::sync::Arc<dyn ContextParallel>>) -> Self {
        Params { context: context.filter(|c| c.size() > 1), ..self }
    }

    /// The context group, where rows' positions are split over ranks.
    pub fn context(&self) -> Option<&dyn ContextParallel> {
        self.context.map(|c| c.as_ref())
    }

    /// The same parameters for rows whose positions `padding` (`[rows, ctx]` bool) marks as
    /// padding after their examples.
    pub fn with_padding(self, padding: Option<&'a Tensor>) -> Self {
        Params { padding, ..self }
    }

    /// The same parameters for a forward whose output head scores its rows against
    /// `scoring`'s targets rather than return logits (the `chunked_loss` method; heads that
    /// cannot, [`Unit::scores_in_chunks`], are never given it).
    pub fn with_scoring(self, scoring: Option<&'a HeadScoring>) -> Self {
        Params { scoring, ..self }
    }

    /// What the output head scores against, where it returns the loss.
    pub fn scoring(&self) -> Option<&HeadScoring> {
        self.scoring
    }

    /// Which positions of the rows are padding (`[rows, ctx]` bool), where some are.
    pub fn padding(&self) -> Option<&Tensor> {
        self.padding
    }

    /// The same parameters for a training forward that draws its dropout masks from `draw`
    /// (`None`: the forward does not train, and no site drops anything).
    pub fn with_dropout(self, dropout: Option<&'a UnitDraw>) -> Self {
        Params { dropout, ..self }
    }

    /// Site `site`'s dropout at `rate`, for a layer to apply inside its computation; `None`
    /// where nothing is dropped. `offsets`: where this rank's piece of each dimension after
    /// the rows starts ([`UnitDraw::dropped`]).
    pub fn dropping(&self, rate: f64, site: u32, offsets: &[i64]) -> Option<dropout::Dropping<'_>> {
        let draw = self.dropout.filter(|_| rate > 0.0)?;
        Some(dropout::Dropping { draw, rate, site, offsets: offsets.to_vec() })
    }

    /// Site `site`'s dropout of attention probabilities `[B, H, Tq, Tk]` over this rank's
    /// `heads` heads (its piece of the model's, under tensor parallel).
    pub fn dropping_heads(&self, rate: f64, site: u32, heads: i64) -> Option<dropout::Dropping<'_>> {
        self.dropping(rate, site, &[self.tp.rank() * heads])
    }

    /// `x` through site `site`'s dropout at `rate` ([`Params::dropping`]); `x` itself where
    /// nothing is dropped.
    pub fn dropout(&self, x: &Tensor, rate: f64, site: u32, offsets: &[i64]) -> Result<Tensor> {
        match self.dropping(rate, site, offsets) {
            Some(d) => d.apply(x),
            None => Ok(x.shallow_clone()),
        }
    }

    /// The expert group, where experts are split over ranks.
    pub fn experts(&self) -> Option<&std::sync::Arc<dyn ExpertExchange>> {
        self.experts
    }

    /// The same parameters with the model's low-rank adapters joined to their layers.
    pub fn with_adapters(self, adapters: &'a Adapters) -> Self {
        Params { adapters: Some(adapters).filter(|a| !a.is_empty()), ..self }
    }

    /// Weight `w`'s adapter, where one is joined to it, for input `x`: under a row split
    /// (`row_split`) this rank's piece of the layer's features, whose dropout mask is that
    /// piece of the whole input's (the positions are whole: adapters' dropout is refused
    /// beside sequence and context parallelism).
    fn adapter(&self, w: ParamId, x: &Tensor, row_split: bool) -> Result<Option<layers::LowRank<'_>>> {
        let Some(adapter) = self.adapters.and_then(|all| all.get(&w)) else { return Ok(None) };
        let (a, b) = adapter.factors(&self[adapter.a], &self[adapter.b])?;
        let dropout = match self.dropout.filter(|_| adapter.dropout > 0.0) {
            Some(_) => {
                let mut offsets = vec![0; x.dim().saturating_sub(2)];
                offsets.push(if row_split { self.tp.rank() * x.size().last().copied().unwrap_or(0) } else { 0 });
                self.dropping(adapter.dropout, adapter.dropout_site, &offsets)
            }
            None => None,
        };
        Ok(Some(layers::LowRank { a, b, scale: adapter.scale, dropout }))
    }

    /// Whether a low-rank adapter is joined to weight `w`.
    pub(crate) fn has_adapter(&self, w: ParamId) -> bool {
        self.adapters.is_some_and(|all| all.get(&w).is_some())
    }

    /// The linear layer of weight `w` and bias `b` ([`layers::linear`]), with its adapter
    /// where one is joined to it.
    pub fn linear(&self, x: &Tensor, w: ParamId, b: Option<ParamId>) -> Result<Tensor> {
        let y = layers::linear(x, &self[w], b.map(|b| &self[b]))?;
        match self.adapter(w, x, false)? {
            Some(adapter) => Ok(y.f_add(&adapter.delta(x)?)?),
            None => Ok(y),
        }
    }

    /// The row-parallel linear layer of weight `w` and bias `b` ([`layers::row_linear`]),
    /// with its adapter where one is joined to it.
    pub fn row_linear(&self, x: &Tensor, w: ParamId, b: Option<ParamId>) -> Result<Tensor> {
        layers::row_linear(x, &self[w], b.map(|b| &self[b]), self.adapter(w, x, true)?, self.tp)
    }

    /// Where the rows hold packed examples: each position's place in its example and the
    /// example it belongs to. Units that see positions read them here.
    pub fn layout(&self) -> Option<&RowLayout> {
        self.layout
    }
}

impl std::ops::Index<ParamId> for Params<'_> {
    type Output = Tensor;
    fn index(&self, id: ParamId) -> &Tensor {
        &self.tensors[id.0]
    }
}

/// A step of a model: a forward from one activation tensor to the next.
pub trait Unit: Send + Sync {
    /// Stable public kind name (`GptBlock`, `LlamaBlock`, ...) by which strategies select units.
    fn kind(&self) -> &'static str;
    /// The unit's output for `input`, reading its weights from `params`.
    fn forward(&self, params: &Params<'_>, input: &Tensor) -> Result<Tensor>;

    /// Whether each position's output depends on that position's input alone (norms,
    /// feed-forward layers, output heads): such a unit decodes by its plain forward.
    fn position_wise(&self) -> bool {
        false
    }

    /// The forward of the next positions of a sequence whose earlier positions this unit
    /// saw through the same `cache` (decoding with a key/value cache: each new token costs
    /// one position). A layout in `params` ([`RowLayout::left_padded`]) places the new
    /// positions of rows decoded together from prompts of several lengths and marks each
    /// row's left padding, which no text position may read. The default refuses for units
    /// that are not position-wise, and
    /// generation passes the refusal up: such a model generates only with the cache off
    /// (`cache: false`, `--no-cache`), each token then recomputing its whole window.
    fn decode(&self, params: &Params<'_>, input: &Tensor, cache: &mut DecodeCache) -> Result<Tensor> {
        if self.position_wise() {
            return self.forward(params, input);
        }
        let _ = cache;
        Err(Error::Model(format!("{} units cannot decode with a key/value cache (Unit::decode)", self.kind())))
    }

    /// Whether the unit is a vocabulary head that returns the mean next-token loss when its
    /// parameters carry [`Params::scoring`] (the `chunked_loss` method), computing the logits
    /// a chunk of positions at a time.
    fn scores_in_chunks(&self) -> bool {
        false
    }

    /// Checks that the unit's forward can run on a piece of each row's positions (context
    /// parallelism), its attention reaching the rest through [`Params::context`];
    /// `split_heads`: the ways its heads are split where the group exchanges heads (tensor
    /// ranks × context ranks under all-to-all). Position-wise units can; others refuse
    /// unless they say how.
    fn check_context_parallel(&self, split_heads: Option<i64>) -> Result<()> {
        let _ = split_heads;
        match self.position_wise() {
            true => Ok(()),
            false => Err(Error::Config(format!("{} units do not run on pieces of rows", self.kind()))),
        }
    }

    /// Checks that the unit's forward can run split over `tp` ranks (heads divisible by
    /// `tp`, say). A unit runs under tensor parallelism only where it says how: the default
    /// refuses.
    fn check_tensor_parallel(&self, tp: i64) -> Result<()> {
        Err(Error::Config(format!(
            "{} units do not say how they run split over {tp} tensor ranks (Unit::check_tensor_parallel)",
            self.kind()
        )))
    }
}

/// Token ids `[B, T]` to vectors `[B, T, D]` by table look-up, multiplied by `scale` where
/// the model says (Gemma's √dim, rounded to the vectors' dtype as `transformers` does);
/// `kind` names the model's unit.
pub(crate) struct TokenEmbedding {
    pub(crate) table: ParamId,
    pub(crate) vocab: i64,
    pub(crate) scale: Option<f64>,
    /// The row whose look-ups give it no gradient (`padding_idx`).
    pub(crate) padding: Option<i64>,
    /// Dropout of the embedded tokens (site 0; StarCoder2's `embedding_dropout`).
    pub(crate) dropout: f64,
    pub(crate) kind: &'static str,
}

impl Unit for TokenEmbedding {
    fn kind(&self) -> &'static str {
        self.kind
    }
    fn forward(&self, p: &Params<'_>, tokens: &Tensor) -> Result<Tensor> {
        let vectors = layers::vocab_embedding(&p[self.table], tokens, self.vocab, self.padding, p.tp())?;
        let vectors = match self.scale {
            Some(scale) => {
                let scale = Tensor::from(scale).f_to_kind(vectors.kind())?.f_to_device(vectors.device())?;
                vectors.f_mul(&scale)?
            }
            None => vectors,
        };
        // Under sequence parallel the vectors are this rank's piece of the sequence.
        let start = p.tp().sequence_range(tokens.size().last().copied().unwrap_or(0)).0;
        p.dropout(&vectors, self.dropout, 0, &[start])
    }
    fn decode(&self, p: &Params<'_>, tokens: &Tensor, cache: &mut DecodeCache) -> Result<Tensor> {
        cache.advance(tokens.size().last().copied().unwrap_or(0));
        self.forward(p, tokens)
    }
    fn check_tensor_parallel(&self, _tp: i64) -> Result<()> {
        Ok(())
    }
    fn check_context_parallel(&self, _split_heads: Option<i64>) -> Result<()> {
        Ok(())
    }
}

/// A unit with its name and the parameters it owns or borrows from another unit.
pub struct UnitSpec {
    /// The name the model function gave the unit ([`Builder::unit`]).
    pub name: String,
    /// Parameters stored with this unit, in creation order.
    pub params: Vec<ParamId>,
    /// Parameters of other units this one reads (tied weights); they must be present too.
    pub borrowed: Vec<ParamId>,
    /// The unit's forward.
    pub body: Box<dyn Unit>,
    /// What the unit costs per token, as its family declared it (`None`: not declared).
    pub cost: Option<UnitCost>,
}

impl UnitSpec {
    /// The kind name of the unit's body ([`Unit::kind`]).
    pub fn kind(&self) -> &'static str {
        self.body.kind()
    }

    /// Whether the unit declares that it looks its weights up (an embedding) rather than
    /// multiplying by them.
    pub fn looks_up(&self) -> bool {
        self.cost.is_some_and(|c| c.looks_up)
    }

    /// The unit's declared cost; refused by name where its family declared none.
    pub fn declared_cost(&self) -> Result<UnitCost> {
        self.cost.ok_or_else(|| {
            Error::Config(format!(
                "unit {} ({}) declares no cost per token (UnitBuilder::declare_cost): the estimate and the \
                 search cannot count it",
                self.name,
                self.kind()
            ))
        })
    }
}

/// Everything the model function declared: units in execution order and their parameters.
pub struct ModelSpec {
    /// The units in execution order.
    pub units: Vec<UnitSpec>,
    /// Every parameter, indexed by [`ParamId`].
    pub params: Vec<ParamSpec>,
    /// Extra names under which a parameter is known (`lm_head.weight` for a tied embedding).
    pub aliases: Vec<(String, ParamId)>,
    /// Parameters this spec holds as copies of another pipeline stage's (a tied weight read
    /// by units on both): their gradients are summed with the owner's, and the owner alone
    /// counts them in gradient norms. Empty for a whole model.
    pub copies: Vec<ParamId>,
    /// Low-rank adapters joined to linear layers (a LoRA strategy adds them).
    pub adapters: Adapters,
    /// The routing of a mixture of experts' sparse layers, gathered for its load-balancing
    /// loss; `None` for a model without experts.
    pub load_balance: Option<std::sync::Arc<LoadBalance>>,
    /// The routed experts of each sparse layer, in layer order.
    pub expert_sets: Vec<ExpertSet>,
    /// Some unit drops activations when it trains (its configuration's dropout rates are
    /// not all zero).
    pub dropout: bool,
    /// The Hugging Face family the model is written as, whose module names (as
    /// `transformers` holds them) a LoRA strategy's targets may use beside Strata's; `None`
    /// for a model of units alone.
    pub family: Option<Family>,
}

/// A sparse layer's routed experts as `transformers` stacks them in one module
/// (`{module}.gate_up_proj` `[E, 2F, D]`, each expert's gate rows then its up rows, and
/// `{module}.down_proj` `[E, D, F]`), which is what peft's `target_parameters` name: each
/// expert's gate, up and down weights.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertSet {
    /// `model.layers.{i}.mlp.experts`, whatever the family calls the weights on disk.
    pub module: String,
    /// Each expert's gate weight, in expert order; empty where the experts have no gate.
    pub gate: Vec<ParamId>,
    /// Each expert's up weight, in expert order.
    pub up: Vec<ParamId>,
    /// Each expert's down weight, in expert order.
    pub down: Vec<ParamId>,
    /// Experts each token is routed to.
    pub top_k: i64,
    /// The family's files stack the experts as described here, so peft's
    /// `target_parameters` adapt them; `false` for another stacking (gpt-oss's).
    pub peft_layout: bool,
}

impl ModelSpec {
    /// The unit kinds that repeat (the blocks, what `checkpoint` recomputes), sorted.
    pub fn block_kinds(&self) -> Vec<String> {
        let mut kinds: Vec<String> = self
            .units
            .iter()
            .map(|u| u.kind())
            .filter(|k| self.units.iter().filter(|u| u.kind() == *k).count() > 1)
            .map(String::from)
            .collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }

    /// How many units are blocks (of a kind that repeats).
    pub fn block_count(&self) -> usize {
        let kinds = self.block_kinds();
        self.units.iter().filter(|u| kinds.iter().any(|k| k == u.kind())).count()
    }

    /// How many elements the parameters hold together.
    pub fn num_params(&self) -> i64 {
        self.params.iter().map(ParamSpec::numel).sum()
    }

    /// The parameters a token is multiplied by (or looks up): all of them but the experts
    /// its routers pass over, as the units declare ([`UnitCost::idle_weights`]).
    pub fn active_params(&self) -> Result<i64> {
        let mut idle = 0.0;
        for u in &self.units {
            idle += u.declared_cost()?.idle_weights;
        }
        Ok(self.num_params() - idle as i64)
    }

    /// For each unit, the units whose parameters it reads: itself, then the owners of the
    /// parameters it borrows (tied weights).
    pub fn units_read(&self) -> Vec<Vec<usize>> {
        self.units
            .iter()
            .enumerate()
            .map(|(k, u)| {
                let mut v = vec![k];
                for owner in u.borrowed.iter().map(|id| self.params[id.0].unit) {
                    if !v.contains(&owner) {
                        v.push(owner);
                    }
                }
                v
            })
            .collect()
    }

    /// For each unit, whether another unit reads its parameters (a tied weight): its whole
    /// gradient lives from the first backward that adds to it to the last.
    pub fn lent_units(&self) -> Vec<bool> {
        let mut lent = vec![false; self.units.len()];
        for (reader, read) in self.units_read().iter().enumerate() {
            for &owner in read.iter().filter(|&&owner| owner != reader) {
                lent[owner] = true;
            }
        }
        lent
    }

    /// Turns gradients off for every parameter whose name contains one of `patterns`
    /// (fine-tuning only part of a model); a pattern that matches nothing is an error.
    pub fn freeze(&mut self, patterns: &[String]) -> Result<()> {
        for pattern in patterns {
            let mut hit = false;
            for p in self.params.iter_mut().filter(|p| p.name.contains(pattern.as_str())) {
                p.requires_grad = false;
                hit = true;
            }
            if !hit {
                return Err(Error::Config(format!("freeze: no parameter name contains {pattern:?}")));
            }
        }
        if self.params.iter().all(|p| !p.requires_grad) {
            return Err(Error::Config("freeze: every parameter would be frozen".into()));
        }
        Ok(())
    }

    /// Checks that every parameter and unit splits over `tp` tensor ranks.
    pub fn check_tensor_parallel(&self, tp: i64) -> Result<()> {
        for p in &self.params {
            p.tp.check(&p.name, &p.shape, tp)?;
        }
        self.check_units("", |u| u.check_tensor_parallel(tp))
    }

    /// Checks that every unit runs on pieces of rows ([`Unit::check_context_parallel`]).
    pub fn check_context_parallel(&self, split_heads: Option<i64>) -> Result<()> {
        self.check_units("context_parallel: ", |u| u.check_context_parallel(split_heads))
    }

    /// The expert group sizes above 1 that divide `ranks` and every sparse layer's routed
    /// experts, smallest first; none for a model without experts.
    pub fn expert_group_sizes(&self, ranks: usize) -> Vec<usize> {
        if self.expert_sets.is_empty() {
            return vec![];
        }
        (2..=ranks)
            .filter(|&e| ranks.is_multiple_of(e) && self.expert_sets.iter().all(|s| s.up.len().is_multiple_of(e)))
            .collect()
    }

    /// `check` of every unit, a refusal naming the unit after `prefix`.
    fn check_units(&self, prefix: &str, check: impl Fn(&dyn Unit) -> Result<()>) -> Result<()> {
        for u in &self.units {
            check(u.body.as_ref()).map_err(|e| match e {
                Error::Config(why) => Error::Config(format!("{prefix}unit {}: {why}", u.name)),
                other => other,
            })?;
        }
        Ok(())
    }

    /// The units `start..end` alone (a pipeline stage): parameters of other units stay
    /// declared but belong to no unit here, and a parameter a kept unit borrows from a unit
    /// not kept becomes the borrower's own, as a copy ([`ModelSpec::copies`]).
    pub fn stage(mut self, start: usize, end: usize) -> Result<ModelSpec> {
        if start >= end || end > self.units.len() {
            return Err(Error::Config(format!("stage [{start}, {end}) of a model of {} units", self.units.len())));
        }
        let owner: Vec<usize> = self.params.iter().map(|p| p.unit).collect();
        let mut units: Vec<UnitSpec> = self.units.drain(start..end).collect();
        // A parameter of another stage that several of this stage's units read is copied
        // once, into the first of them; the others borrow the copy.
        let mut copied = std::collections::BTreeSet::new();
        for (k, u) in units.iter_mut().enumerate() {
            for id in &u.params {
                self.params[id.0].unit = k;
            }
            let (kept, elsewhere): (Vec<ParamId>, Vec<ParamId>) =
                u.borrowed.iter().partition(|id| (start..end).contains(&owner[id.0]) || copied.contains(*id));
            copied.extend(elsewhere.iter().copied());
            u.borrowed = kept;
            for id in elsewhere {
                self.params[id.0].unit = k;
                u.params.push(id);
                self.copies.push(id);
            }
        }
        self.units = units;
        Ok(self)
    }

    /// Whether some unit is an output head that computes the next-token loss in chunks
    /// ([`Unit::scores_in_chunks`]).
    pub fn scores_in_chunks(&self) -> bool {
        self.units.iter().any(|u| u.body.scores_in_chunks())
    }

    /// Whether a unit of this spec stores parameter `id` (a stage holds only its units').
    pub fn holds(&self, id: ParamId) -> bool {
        self.units.iter().any(|u| u.params.contains(&id))
    }

    /// The parameter named `name`, or known by it as an alias.
    pub fn find(&self, name: &str) -> Option<ParamId> {
        self.params
            .iter()
            .position(|p| p.name == name)
            .map(ParamId)
            .or_else(|| self.aliases.iter().find(|(a, _)| a == name).map(|(_, id)| *id))
    }
}

/// Records units and parameter specs; `model_fn(&mut Builder)` describes a model with it.
#[derive(Default)]
pub struct Builder {
    units: Vec<UnitSpec>,
    params: Vec<ParamSpec>,
    aliases: Vec<(String, ParamId)>,
    names: HashMap<String, ParamId>,
    load_balance: Option<std::sync::Arc<LoadBalance>>,
    expert_sets: Vec<ExpertSet>,
    dropout: bool,
    error: Option<Error>,
}

impl Builder {
    /// A builder with nothing recorded.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts the next unit; declare its parameters, then [`UnitBuilder::finish`] it.
    pub fn unit(&mut self, name: impl Into<String>) -> UnitBuilder<'_> {
        UnitBuilder {
            index: self.units.len(),
            name: name.into(),
            builder: self,
            owned: vec![],
            borrowed: vec![],
            cost: None,
        }
    }

    /// Makes `alias` another name of `id` (for tied weights saved under both names).
    pub fn alias(&mut self, alias: impl Into<String>, id: ParamId) {
        self.aliases.push((alias.into(), id));
    }

    /// The finished description; fails on duplicate names or an empty model.
    pub fn build(self) -> Result<ModelSpec> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if self.units.is_empty() {
            return Err(Error::Model("the model function declared no units".into()));
        }
        Ok(ModelSpec {
            units: self.units,
            params: self.params,
            aliases: self.aliases,
            copies: vec![],
            adapters: Adapters::new(),
            load_balance: self.load_balance,
            expert_sets: self.expert_sets,
            dropout: self.dropout,
            family: None,
        })
    }

    /// Records that the model's units drop activations at `rates` when they train.
    pub fn dropout(&mut self, rates: &DropoutRates) {
        self.dropout |= rates.any();
    }

    /// The balance the model's sparse layers record their routing in.
    pub fn load_balance(&mut self, balance: std::sync::Arc<LoadBalance>) {
        self.load_balance = Some(balance);
    }

    fn fail(&mut self, message: String) {
        self.error.get_or_insert(Error::Model(message));
    }
}

/// Declares the parameters of one unit.
pub struct UnitBuilder<'a> {
    builder: &'a mut Builder,
    index: usize,
    name: String,
    owned: Vec<ParamId>,
    borrowed: Vec<ParamId>,
    cost: Option<UnitCost>,
}

impl UnitBuilder<'_> {
    /// Declares a parameter stored with this unit.
    pub fn param(&mut self, name: impl Into<String>, shape: &[i64], init: Init, tp: TpRole) -> ParamId {
        let name = name.into();
        let id = ParamId(self.builder.params.len());
        if self.builder.names.insert(name.clone(), id).is_some() {
            self.builder.fail(format!("parameter name {name:?} declared twice"));
        }
        if shape.iter().any(|&d| d <= 0) {
            self.builder.fail(format!("parameter {name:?} has a non-positive dimension in {shape:?}"));
        } else if shape.iter().try_fold(1i64, |n, &d| n.checked_mul(d)).is_none() {
            self.builder.fail(format!("parameter {name:?} of shape {shape:?} has more elements than an i64 counts"));
        }
        self.builder.params.push(ParamSpec {
            name,
            shape: shape.to_vec(),
            init,
            kind: None,
            tp,
            unit: self.index,
            requires_grad: true,
            linear: false,
            expert: None,
            norm: false,
        });
        self.owned.push(id);
        id
    }

    /// Declares a normalisation layer's weight or bias.
    pub fn norm(&mut self, name: impl Into<String>, shape: &[i64], init: Init, tp: TpRole) -> ParamId {
        let id = self.param(name, shape, init, tp);
        self.builder.params[id.0].norm = true;
        id
    }

    /// Declares a tensor stored with this unit that trains by no gradient (a buffer
    /// `transformers` saves beside the parameters, such as a router's choice bias).
    pub fn frozen_param(&mut self, name: impl Into<String>, shape: &[i64], init: Init, tp: TpRole) -> ParamId {
        let id = self.param(name, shape, init, tp);
        self.builder.params[id.0].requires_grad = false;
        id
    }

    /// Declares the `[out, in]` weight of a linear layer the unit applies through
    /// [`Params::linear`] or [`Params::row_linear`] (so a LoRA strategy may adapt it).
    pub fn linear(&mut self, name: impl Into<String>, shape: &[i64], init: Init, tp: TpRole) -> ParamId {
        let id = self.param(name, shape, init, tp);
        self.builder.params[id.0].linear = true;
        id
    }

    /// Declares parameter `name` of routed expert `slot`: whole on every tensor rank, and
    /// under expert parallelism stored by the rank computing the expert.
    pub fn expert_param(&mut self, name: impl Into<String>, shape: &[i64], init: Init, slot: ExpertSlot) -> ParamId {
        let id = self.param(name, shape, init, TpRole::SequenceReplicated);
        self.builder.params[id.0].expert = Some(slot);
        id
    }

    /// Records the routed experts of a sparse layer this unit declares.
    pub fn expert_set(&mut self, set: ExpertSet) {
        self.builder.expert_sets.push(set);
    }

    /// Reads a parameter declared by an earlier unit (a tied weight).
    pub fn borrow(&mut self, name: &str) -> ParamId {
        match self.builder.names.get(name) {
            Some(&id) => {
                self.borrowed.push(id);
                id
            }
            None => {
                self.builder.fail(format!("unit {:?} borrows unknown parameter {name:?}", self.name));
                ParamId(0)
            }
        }
    }

    /// Declares what the unit costs per token: what it keeps for its backward and the
    /// attention it runs, counted from the family's configuration beside its forward.
    pub fn declare_cost(&mut self, cost: UnitCost) {
        self.cost = Some(cost);
    }

    /// Ends the unit: records it with `body` as its forward and the parameters declared for it.
    pub fn finish(self, body: impl Unit + 'static) {
        self.builder.units.push(UnitSpec {
            name: self.name,
            params: self.owned,
            borrowed: self.borrowed,
            body: Box::new(body),
            cost: self.cost,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys and values split from a fused projection are held in storage of their own: the
    /// cache does not keep the whole projection alive.
    #[test]
    fn a_cache_holds_its_own_copy_of_keys_split_from_a_fused_projection() {
        let qkv = Tensor::randn([2, 5, 3 * 8], (tch::Kind::Float, tch::Device::Cpu));
        let parts = qkv.split(8, 2);
        let heads = |t: &Tensor| t.view([2, 5, 2, 4]).transpose(1, 2);
        let (k, v) = (heads(&parts[1]), heads(&parts[2]));
        let mut cache = DecodeCache::default();
        let (held_k, held_v) = cache.extend(&k, &v).unwrap();
        for (held, given) in [(&held_k, &k), (&held_v, &v)] {
            assert!(held.equal(given));
            let own = held.numel() * held.kind().elt_size_in_bytes();
            assert_eq!(strata_ext::storage_nbytes(held).unwrap(), own, "the cache holds the whole projection");
        }
    }
}
