//! T5 as `transformers` defines it (`T5ForConditionalGeneration`): one embedding table for
//! both stacks, pre-norm blocks with T5's RMS norm (no mean, no bias), attention without the
//! 1/√d scale and with a relative position bias (buckets of the key's distance, a table held
//! by each stack's first block and read by all of its blocks), a decoder whose every block
//! also attends to the encoder's output, and an output head — tied to the embedding with the
//! √d down-scaling of T5 v1.0, or its own (v1.1).
//!
//! The encoder's output reaches the decoder by travelling with the activations: a row is its
//! source then its target (the [`RowLayout`]'s `source_len` says where the target starts),
//! every unit passes the whole `[B, S + T, D]` tensor on, encoder blocks transform the source
//! part and decoder blocks the target part, reading the source part (by then the encoder's
//! normed output) as their cross-attention's memory. So backward unit by unit, recomputation,
//! sharding, offload and pipeline stages need nothing of their own: the gradient of the
//! encoder's output is the sum of every decoder block's, as autograd adds it along the chain.
//!
//! Dropout, where the configuration asks for it, falls where `transformers` puts it; a
//! block's sites are `site`'s, the head's 0 is the decoder's final norm's output.
//!
//! Owns the T5 units and their declarations. Must not allocate or place weights: [`t5`]
//! records specifications in the [`Builder`], and the units compute with the parameters the
//! engine lends them.
use super::dropout::masked;
use super::layers::{
    attention, examples_differ, merge_heads, rms_norm, split_heads, vocab_logits, AttentionOptions, ScoreTerms,
};
use super::{
    positive, Builder, DecodeCache, DropoutRates, EncodedMemory, Init, Kept, ParamId, Params, RowLayout,
    TokenEmbedding, TpRole, Unit, UnitBuilder, UnitCost,
};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// The feed-forward layer's activation (`feed_forward_proj`: `relu`, `gelu`, `gelu_new`,
/// `silu`, each optionally `gated-`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FeedForwardActivation {
    /// ReLU (`relu`, T5 v1.0's).
    Relu,
    /// GELU in its exact form (`gelu`).
    Gelu,
    /// GELU in its tanh form (`gelu_new`, and `gated-gelu`, T5 v1.1's).
    GeluTanh,
    /// SiLU (`silu`).
    Silu,
}

impl FeedForwardActivation {
    fn apply(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            FeedForwardActivation::Relu => x.f_relu()?,
            FeedForwardActivation::Gelu => x.f_gelu("none")?,
            FeedForwardActivation::GeluTanh => x.f_gelu("tanh")?,
            FeedForwardActivation::Silu => x.f_silu()?,
        })
    }
}

/// T5's configuration, as its `config.json` gives it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct T5Config {
    /// Vocabulary size: rows of the shared embedding table (`vocab_size`).
    pub vocab: i64,
    /// The residual stream's width (`d_model`).
    pub dim: i64,
    /// Each head's width (`d_kv`): the attention's inner width is `heads · head_dim`.
    pub head_dim: i64,
    /// The feed-forward layer's width (`d_ff`).
    pub ffn_dim: i64,
    /// Blocks of the encoder stack (`num_layers`).
    pub encoder_layers: i64,
    /// Blocks of the decoder stack (`num_decoder_layers`).
    pub decoder_layers: i64,
    /// Attention heads of each layer (`num_heads`).
    pub heads: i64,
    /// Buckets of the relative position bias (`relative_attention_num_buckets`).
    pub buckets: i64,
    /// Distances at and past which keys share the last bucket (`relative_attention_max_distance`).
    pub max_distance: i64,
    /// The RMS norms' epsilon (`layer_norm_epsilon`).
    pub norm_eps: f64,
    /// The feed-forward layer's activation.
    pub activation: FeedForwardActivation,
    /// The feed-forward layer gates its activation with a second projection (`wi_0`, `wi_1`).
    pub gated: bool,
    /// The output head is the embedding table (v1.0); otherwise a weight of its own (v1.1).
    pub tied_head: bool,
    /// The decoder's output is multiplied by 1/√dim before the head (v1.0's
    /// `scale_decoder_outputs`).
    pub scale_output: bool,
    /// The padding token (`pad_token_id`).
    pub padding: i64,
    /// The token every target starts from (`decoder_start_token_id`).
    pub decoder_start: i64,
    /// Dropout on each stack's embedded input (`embedding`), on attention probabilities
    /// (`attention`), on each sub-layer's output and the final norms' (`residual`) and after
    /// the feed-forward activation (`inner`): `dropout_rate` at every site in T5's folders.
    #[serde(default)]
    pub dropout: DropoutRates,
}

impl T5Config {
    /// Fails with the first value out of range: a size that is not positive, too few buckets
    /// for their distance, an epsilon that is not positive, a token outside the vocabulary.
    pub fn validate(&self) -> Result<()> {
        positive(&[
            ("vocab", self.vocab),
            ("dim", self.dim),
            ("head_dim", self.head_dim),
            ("ffn_dim", self.ffn_dim),
            ("encoder_layers", self.encoder_layers),
            ("decoder_layers", self.decoder_layers),
            ("heads", self.heads),
            ("buckets", self.buckets),
            ("max_distance", self.max_distance),
        ])?;
        // The encoder's half of the buckets needs exact ones and logarithmic ones, and the
        // logarithmic range must not be empty.
        if self.buckets < 4 || self.max_distance <= self.buckets / 2 {
            return Err(Error::Config(format!(
                "relative attention needs at least 4 buckets and a max distance above half of them, got {} and {}",
                self.buckets, self.max_distance
            )));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(Error::Config(format!("norm_eps must be positive, got {}", self.norm_eps)));
        }
        self.dropout.validate()?;
        for (name, token) in [("pad token", self.padding), ("decoder start token", self.decoder_start)] {
            if !(0..self.vocab).contains(&token) {
                return Err(Error::Config(format!("{name} {token} is outside the vocabulary of {}", self.vocab)));
            }
        }
        Ok(())
    }
}

/// The number of source positions leading each row of `total`, from the batch's layout
/// (which must be the layout of these rows).
fn source_len(layout: Option<&RowLayout>, total: i64) -> Result<Option<i64>> {
    if let Some(width) = layout.filter(|l| l.source_len.is_some()).map(|l| l.examples.size()[1]) {
        if width != total {
            return Err(Error::Model(format!(
                "the layout set is for rows of {width} positions, these rows hold {total}: set the layout of the \
                 batch that runs (Engine::set_layout)"
            )));
        }
    }
    match layout.and_then(|l| l.source_len) {
        Some(s) if (1..total).contains(&s) => Ok(Some(s)),
        Some(s) => Err(Error::Model(format!("a source of {s} positions in rows of {total}: no room for a target"))),
        None => Ok(None),
    }
}

/// [`source_len`], required: a training or evaluation forward always reads both parts.
fn required_source_len(p: &Params<'_>, total: i64) -> Result<i64> {
    if p.tp().sequence_parallel() {
        return Err(Error::Config("T5 rows hold a source and a target: sequence parallel would split them".into()));
    }
    source_len(p.layout(), total)?.ok_or_else(|| {
        Error::Model(
            "T5 rows hold a source then its target: the batch's layout must say where the target starts \
             (RowLayout::source_len)"
                .into(),
        )
    })
}

/// The `[B, 1, 1, S]` mask of the source positions hidden from every target position of a
/// row: those of another example than the target's (padding is an example of its own).
fn hidden_sources(layout: &RowLayout, sources: i64) -> Result<Tensor> {
    let source = layout.examples.f_narrow(1, 0, sources)?;
    examples_differ(&layout.examples.f_narrow(1, sources, 1)?, &source)
}

/// The `[B, 1, S, S]` mask of the source positions each source position may not see.
fn hidden_within_source(layout: &RowLayout, sources: i64) -> Result<Tensor> {
    let source = layout.examples.f_narrow(1, 0, sources)?;
    examples_differ(&source, &source)
}

/// How a stack's relative position bias is bucketed.
#[derive(Clone, Copy)]
struct Buckets {
    count: i64,
    max_distance: i64,
    /// Keys after the query get buckets of their own (the encoder); otherwise they share
    /// the bucket of distance 0 (the decoder, which never sees them).
    bidirectional: bool,
}

impl Buckets {
    /// The bucket of each `key − query` distance of `queries` queries, the first at position
    /// `first_query`, over `keys` keys from position 0: `[Tq, Tk]` int64.
    fn of(&self, queries: i64, keys: i64, first_query: i64, device: tch::Device) -> Result<Tensor> {
        let query =
            Tensor::f_arange_start(first_query, first_query + queries, (Kind::Int64, device))?.f_unsqueeze(1)?;
        let key = Tensor::f_arange(keys, (Kind::Int64, device))?.f_unsqueeze(0)?;
        let distance = key.f_sub(&query)?;
        let (count, offset, distance) = if self.bidirectional {
            let half = self.count / 2;
            (half, distance.f_gt(0)?.f_to_kind(Kind::Int64)?.f_mul_scalar(half)?, distance.f_abs()?)
        } else {
            (self.count, distance.f_zeros_like()?, distance.f_clamp_max(0)?.f_neg()?)
        };
        // Half of the buckets are single distances; the rest widen logarithmically up to
        // `max_distance`, computed in fp32 as the reference does, so each falls in the same bucket.
        let exact = count / 2;
        let widened = distance
            .f_to_kind(Kind::Float)?
            .f_div_scalar(exact as f64)?
            .f_log()?
            .f_div_scalar((self.max_distance as f64 / exact as f64).ln())?
            .f_mul_scalar((count - exact) as f64)?
            .f_to_kind(Kind::Int64)?
            .f_add_scalar(exact)?
            .f_clamp_max(count - 1)?;
        Ok(offset.f_add(&distance.f_where_self(&distance.f_lt(exact)?, &widened)?)?)
    }

    /// The bias `[1, H, Tq, Tk]` of this rank's heads from `table` (`[buckets, H]`).
    fn bias(&self, table: &Tensor, queries: i64, keys: i64, first_query: i64) -> Result<Tensor> {
        let buckets = self.of(queries, keys, first_query, table.device())?;
        Ok(Tensor::f_embedding(table, &buckets, -1, false, false)?.f_permute([2, 0, 1])?.f_unsqueeze(0)?)
    }
}

/// One attention's projections (`q`, `k`, `v` `[H·D, dim]`, `o` `[dim, H·D]`, no biases).
#[derive(Clone, Copy)]
struct Projections {
    q: ParamId,
    k: ParamId,
    v: ParamId,
    o: ParamId,
}

impl Projections {
    fn declare(u: &mut UnitBuilder<'_>, prefix: &str, dim: i64, inner: i64, head_dim: i64) -> Projections {
        let normal = |std: f64| Init::Normal { std };
        let d = dim as f64;
        Projections {
            q: u.linear(
                format!("{prefix}.q.weight"),
                &[inner, dim],
                normal((d * head_dim as f64).powf(-0.5)),
                TpRole::COLUMN,
            ),
            k: u.linear(format!("{prefix}.k.weight"), &[inner, dim], normal(d.powf(-0.5)), TpRole::COLUMN),
            v: u.linear(format!("{prefix}.v.weight"), &[inner, dim], normal(d.powf(-0.5)), TpRole::COLUMN),
            o: u.linear(format!("{prefix}.o.weight"), &[dim, inner], normal((inner as f64).powf(-0.5)), TpRole::Row),
        }
    }

    /// `[B, T, dim]` through projection `w` into this rank's `heads` heads, `[B, H, T, D]`.
    fn heads(&self, p: &Params<'_>, x: &Tensor, w: ParamId, heads: i64) -> Result<Tensor> {
        split_heads(&p.linear(x, w, None)?, heads)
    }
}

/// The feed-forward layer's weights.
#[derive(Clone, Copy)]
struct FeedForward {
    norm: ParamId,
    /// `wi`, or `wi_0` (through the activation) and `wi_1` (its gate) where gated.
    wi: (ParamId, Option<ParamId>),
    wo: ParamId,
    activation: FeedForwardActivation,
}

/// An encoder or decoder block; the first of a stack owns the stack's bias table, the last
/// of the encoder also its final norm.
struct T5Block {
    self_norm: ParamId,
    self_attention: Projections,
    /// The decoder's cross-attention: its norm and projections.
    cross: Option<(ParamId, Projections)>,
    feed_forward: FeedForward,
    bias_table: ParamId,
    buckets: Buckets,
    /// The encoder's final norm, applied by its last block.
    final_norm: Option<ParamId>,
    /// The first block of its stack drops the stack's embedded input.
    first: bool,
    heads: i64,
    eps: f64,
    dropout: DropoutRates,
}

/// A T5 block's dropout sites ([`super::dropout`]).
mod site {
    pub const INPUT: u32 = 0;
    pub const SELF_PROBABILITIES: u32 = 1;
    pub const SELF_OUTPUT: u32 = 2;
    pub const CROSS_PROBABILITIES: u32 = 3;
    pub const CROSS_OUTPUT: u32 = 4;
    pub const INNER: u32 = 5;
    pub const FEED_FORWARD_OUTPUT: u32 = 6;
    pub const FINAL_NORM: u32 = 7;
}

impl Unit for T5Block {
    fn kind(&self) -> &'static str {
        if self.cross.is_some() {
            "T5DecoderBlock"
        } else {
            "T5EncoderBlock"
        }
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let total = x.size()[1];
        let sources = required_source_len(p, total)?;
        let layout = p.layout().ok_or_else(|| Error::Engine("a source length without a layout".into()))?;
        let (source, target) = (x.f_narrow(1, 0, sources)?, x.f_narrow(1, sources, total - sources)?);
        if self.cross.is_none() {
            let encoded = self.encode(p, &source, Some(&hidden_within_source(layout, sources)?))?;
            return Ok(Tensor::f_cat(&[&encoded, &target], 1)?);
        }
        let memory = self.memory(p, &source, Some(hidden_sources(layout, sources)?))?;
        let decoded = self.decode_target(p, &target, &memory, None)?;
        Ok(Tensor::f_cat(&[&source, &decoded], 1)?)
    }
    fn decode(&self, p: &Params<'_>, x: &Tensor, cache: &mut DecodeCache) -> Result<Tensor> {
        let total = x.size()[1];
        let sources = source_len(p.layout(), total)?;
        match (self.cross.is_some(), sources) {
            // The first step: the encoder runs once, over the whole source.
            (false, Some(s)) => {
                let out = self.forward(p, x)?;
                cache.advance(s);
                Ok(out)
            }
            (false, None) if cache.position() > 0 => Ok(x.shallow_clone()),
            (false, None) => Err(Error::Model("T5 decoding starts from a source (RowLayout::source_len)".into())),
            (true, Some(s)) => {
                let layout = p.layout().ok_or_else(|| Error::Engine("a source length without a layout".into()))?;
                let source = x.f_narrow(1, 0, s)?;
                cache.keep_encoded(self.memory(p, &source, Some(hidden_sources(layout, s)?))?);
                let target = x.f_narrow(1, s, total - s)?;
                let memory = self.kept_memory(cache)?;
                let decoded = self.decode_target(p, &target, &memory, Some(cache))?;
                Ok(Tensor::f_cat(&[&source, &decoded], 1)?)
            }
            (true, None) => {
                let memory = self.kept_memory(cache)?;
                self.decode_target(p, x, &memory, Some(cache))
            }
        }
    }
    fn check_tensor_parallel(&self, tp: i64) -> Result<()> {
        super::gpt::divides_heads(tp, "heads", self.heads)
    }
}

impl T5Block {
    /// The encoder block over the source `[B, S, dim]`; the last one also norms its output.
    fn encode(&self, p: &Params<'_>, x: &Tensor, hidden: Option<&Tensor>) -> Result<Tensor> {
        let x = self.stack_input(p, x)?;
        let x = self.self_attend(p, &x, hidden, None)?;
        let x = self.feed_forward(p, &x)?;
        match self.final_norm {
            Some(w) => p.dropout(&rms_norm(&x, &p[w], self.eps)?, self.dropout.residual, site::FINAL_NORM, &[]),
            None => Ok(x),
        }
    }

    /// The stack's embedded input, dropped where this block is the stack's first.
    fn stack_input(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        match self.first {
            true => p.dropout(x, self.dropout.embedding, site::INPUT, &[]),
            false => Ok(x.shallow_clone()),
        }
    }

    /// The decoder block over target positions, attending causally to the target (through
    /// `cache` where decoding) and to the encoder's output through `memory`.
    fn decode_target(
        &self,
        p: &Params<'_>,
        x: &Tensor,
        memory: &EncodedMemory,
        cache: Option<&mut DecodeCache>,
    ) -> Result<Tensor> {
        let x = self.stack_input(p, x)?;
        let x = self.self_attend(p, &x, None, cache)?;
        let Some((norm, cross)) = &self.cross else { return Err(Error::Engine("an encoder block decodes".into())) };
        let heads = self.heads / p.tp().size();
        let h = p.tp().enter(&rms_norm(&x, &p[*norm], self.eps)?)?;
        let q = cross.heads(p, &h, cross.q, heads)?;
        let options = AttentionOptions { scale: Some(1.0), bidirectional: true, ..AttentionOptions::default() };
        let probs = p.dropping_heads(self.dropout.attention, site::CROSS_PROBABILITIES, heads);
        let attended = attention(
            &q,
            &memory.keys,
            &memory.values,
            &options,
            memory.hidden.as_ref(),
            ScoreTerms::default(),
            probs.as_ref(),
        )?;
        let attended = p.row_linear(&merge_heads(&attended)?, cross.o, None)?;
        let x = x.f_add(&p.dropout(&attended, self.dropout.residual, site::CROSS_OUTPUT, &[])?)?;
        self.feed_forward(p, &x)
    }

    /// `x` plus its self-attention, with the stack's relative position bias; decoding, the
    /// keys and values of earlier positions come from `cache`.
    fn self_attend(
        &self,
        p: &Params<'_>,
        x: &Tensor,
        hidden: Option<&Tensor>,
        cache: Option<&mut DecodeCache>,
    ) -> Result<Tensor> {
        let tp = p.tp();
        let heads = self.heads / tp.size();
        let h = tp.enter(&rms_norm(x, &p[self.self_norm], self.eps)?)?;
        let a = &self.self_attention;
        let (q, k, v) = (a.heads(p, &h, a.q, heads)?, a.heads(p, &h, a.k, heads)?, a.heads(p, &h, a.v, heads)?);
        let first_query = cache.as_ref().map_or(0, |c| c.position());
        let (k, v) = match cache {
            Some(c) => c.extend(&k, &v)?,
            None => (k, v),
        };
        let bias = self.buckets.bias(&p[self.bias_table], q.size()[2], k.size()[2], first_query)?;
        let options = AttentionOptions {
            scale: Some(1.0),
            bidirectional: self.buckets.bidirectional,
            ..AttentionOptions::default()
        };
        let probs = p.dropping_heads(self.dropout.attention, site::SELF_PROBABILITIES, heads);
        let attended =
            attention(&q, &k, &v, &options, hidden, ScoreTerms { bias: Some(&bias), sinks: None }, probs.as_ref())?;
        let attended = p.row_linear(&merge_heads(&attended)?, a.o, None)?;
        Ok(x.f_add(&p.dropout(&attended, self.dropout.residual, site::SELF_OUTPUT, &[])?)?)
    }

    fn feed_forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let f = &self.feed_forward;
        let h = p.tp().enter(&rms_norm(x, &p[f.norm], self.eps)?)?;
        let activated = f.activation.apply(&p.linear(&h, f.wi.0, None)?)?;
        let h = match f.wi.1 {
            Some(gate) => activated.f_mul(&p.linear(&h, gate, None)?)?,
            None => activated,
        };
        // This rank's piece of the inner width, under tensor parallel.
        let h = p.dropout(&h, self.dropout.inner, site::INNER, &[0, p.tp().rank() * h.size()[2]])?;
        let out = p.row_linear(&h, f.wo, None)?;
        Ok(x.f_add(&p.dropout(&out, self.dropout.residual, site::FEED_FORWARD_OUTPUT, &[])?)?)
    }

    /// The cross-attention's keys and values of the encoder's output `[B, S, dim]`.
    fn memory(&self, p: &Params<'_>, encoded: &Tensor, hidden: Option<Tensor>) -> Result<EncodedMemory> {
        let Some((_, cross)) = &self.cross else { return Err(Error::Engine("an encoder block has no memory".into())) };
        let heads = self.heads / p.tp().size();
        let encoded = p.tp().enter(encoded)?;
        let keys = cross.heads(p, &encoded, cross.k, heads)?;
        let values = cross.heads(p, &encoded, cross.v, heads)?;
        Ok(EncodedMemory { keys, values, hidden })
    }

    fn kept_memory(&self, cache: &DecodeCache) -> Result<EncodedMemory> {
        let kept = cache.encoded().ok_or_else(|| Error::Model("T5 decoding starts from a source".into()))?;
        Ok(EncodedMemory {
            keys: kept.keys.shallow_clone(),
            values: kept.values.shallow_clone(),
            hidden: kept.hidden.as_ref().map(Tensor::shallow_clone),
        })
    }
}

/// The decoder's final norm and the output head over the target positions: `[B, T, vocab]`.
struct T5Head {
    norm: ParamId,
    table: ParamId,
    vocab: i64,
    /// 1/√dim where the outputs are scaled (v1.0).
    scale: Option<f64>,
    eps: f64,
    /// Dropout of the final norm's output (site 0).
    dropout: f64,
}

impl Unit for T5Head {
    fn kind(&self) -> &'static str {
        "T5Head"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let total = x.size()[1];
        let sources = required_source_len(p, total)?;
        self.logits(p, &x.f_narrow(1, sources, total - sources)?)
    }
    fn decode(&self, p: &Params<'_>, x: &Tensor, cache: &mut DecodeCache) -> Result<Tensor> {
        let total = x.size()[1];
        let target = match source_len(p.layout(), total)? {
            Some(s) => x.f_narrow(1, s, total - s)?,
            None => x.shallow_clone(),
        };
        cache.advance(target.size()[1]);
        self.logits(p, &target)
    }
    fn check_tensor_parallel(&self, _tp: i64) -> Result<()> {
        Ok(())
    }
}

impl T5Head {
    fn logits(&self, p: &Params<'_>, target: &Tensor) -> Result<Tensor> {
        let h = p.dropout(&rms_norm(target, &p[self.norm], self.eps)?, self.dropout, 0, &[])?;
        let h = match self.scale {
            Some(scale) => h.f_mul_scalar(scale)?,
            None => h,
        };
        vocab_logits(&h, &p[self.table], None, self.vocab, None, p.tp())
    }
}

/// The T5 model function: units `embedding`, `encoder.block.{i}`, `decoder.block.{i}`,
/// `head`. A unit's input and output are whole rows, source then target.
pub fn t5(cfg: &T5Config, b: &mut Builder) -> Result<()> {
    cfg.validate()?;
    b.dropout(&cfg.dropout);
    let (d, inner) = (cfg.dim, cfg.heads * cfg.head_dim);
    let mut u = b.unit("embedding");
    let shared = u.param("shared.weight", &[cfg.vocab, d], Init::Normal { std: 1.0 }, TpRole::Vocab);
    u.declare_cost(UnitCost::looking_up(Kept::ids(cfg.dim)));
    u.finish(TokenEmbedding {
        table: shared,
        vocab: cfg.vocab,
        scale: None,
        padding: None,
        dropout: 0.0,
        kind: "T5Embedding",
    });
    b.alias("encoder.embed_tokens.weight", shared);
    b.alias("decoder.embed_tokens.weight", shared);
    for (stack, layers) in [("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)] {
        let decoder = stack == "decoder";
        let table_name = format!("{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight");
        for i in 0..layers {
            let name = format!("{stack}.block.{i}");
            let mut u = b.unit(name.clone());
            let ones = |u: &mut UnitBuilder<'_>, part: &str| {
                u.norm(format!("{name}.{part}.layer_norm.weight"), &[d], Init::Ones, TpRole::Replicated)
            };
            // In `transformers`' order of declaration.
            let self_attention =
                Projections::declare(&mut u, &format!("{name}.layer.0.SelfAttention"), d, inner, cfg.head_dim);
            // Split with the heads, as the projections are.
            let bias_table = if i == 0 {
                let std = (d as f64).powf(-0.5);
                u.param(table_name.clone(), &[cfg.buckets, cfg.heads], Init::Normal { std }, TpRole::Row)
            } else {
                u.borrow(&table_name)
            };
            let self_norm = ones(&mut u, "layer.0");
            let cross = decoder.then(|| {
                let projections =
                    Projections::declare(&mut u, &format!("{name}.layer.1.EncDecAttention"), d, inner, cfg.head_dim);
                (ones(&mut u, "layer.1"), projections)
            });
            let ff = format!("{name}.layer.{}.DenseReluDense", if decoder { 2 } else { 1 });
            let into = Init::Normal { std: (d as f64).powf(-0.5) };
            let wi = if cfg.gated {
                let w0 = u.linear(format!("{ff}.wi_0.weight"), &[cfg.ffn_dim, d], into, TpRole::COLUMN);
                (w0, Some(u.linear(format!("{ff}.wi_1.weight"), &[cfg.ffn_dim, d], into, TpRole::COLUMN)))
            } else {
                (u.linear(format!("{ff}.wi.weight"), &[cfg.ffn_dim, d], into, TpRole::COLUMN), None)
            };
            let out = Init::Normal { std: (cfg.ffn_dim as f64).powf(-0.5) };
            let wo = u.linear(format!("{ff}.wo.weight"), &[d, cfg.ffn_dim], out, TpRole::Row);
            let ff_norm = ones(&mut u, if decoder { "layer.2" } else { "layer.1" });
            let final_norm = (!decoder && i + 1 == layers)
                .then(|| u.norm("encoder.final_layer_norm.weight", &[d], Init::Ones, TpRole::Replicated));
            // A decoder block adds cross-attention (its norm, queries, output: 4 widths of the
            // inner width) and carries the encoder's output within its own.
            let ffn = if cfg.gated { 4.0 } else { 2.0 } * cfg.ffn_dim as f64;
            let (d, inner) = (d as f64, inner as f64);
            let (kept, attentions) = match decoder {
                false => (Kept::block(4.0 * d + 4.0 * inner + ffn + 4.0, cfg.heads, cfg.dim), 1),
                true => (Kept::block(6.0 * d + 8.0 * inner + ffn + 6.0, 2 * cfg.heads, cfg.dim), 2),
            };
            let rates = &cfg.dropout;
            let masks = masked(rates.residual, (1 + attentions) * cfg.dim)
                + masked(rates.inner, cfg.ffn_dim)
                + masked(if i == 0 { rates.embedding } else { 0.0 }, cfg.dim);
            let kept = kept.with_dropout(masks, rates.attention > 0.0);
            u.declare_cost(UnitCost::attending(kept, attentions * cfg.heads * cfg.head_dim));
            u.finish(T5Block {
                self_norm,
                self_attention,
                cross,
                feed_forward: FeedForward { norm: ff_norm, wi, wo, activation: cfg.activation },
                bias_table,
                buckets: Buckets { count: cfg.buckets, max_distance: cfg.max_distance, bidirectional: !decoder },
                final_norm,
                first: i == 0,
                heads: cfg.heads,
                eps: cfg.norm_eps,
                dropout: cfg.dropout,
            });
        }
    }
    let mut u = b.unit("head");
    let norm = u.norm("decoder.final_layer_norm.weight", &[d], Init::Ones, TpRole::Replicated);
    let table = if cfg.tied_head {
        u.borrow("shared.weight")
    } else {
        u.linear("lm_head.weight", &[cfg.vocab, d], Init::Normal { std: 1.0 }, TpRole::Vocab)
    };
    let scale = cfg.scale_output.then(|| (d as f64).powf(-0.5));
    let kept = Kept::head(3.0 * cfg.dim as f64 + 13.0, cfg.vocab).with_dropout(masked(cfg.dropout.residual, d), false);
    u.declare_cost(UnitCost::keeping(kept));
    let dropout = cfg.dropout.residual;
    u.finish(T5Head { norm, table, vocab: cfg.vocab, scale, eps: cfg.norm_eps, dropout });
    if cfg.tied_head {
        b.alias("lm_head.weight", shared);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, EngineConfig};
    use crate::model::ModelConfig;

    fn tiny() -> T5Config {
        T5Config {
            vocab: 16,
            dim: 8,
            head_dim: 4,
            ffn_dim: 12,
            encoder_layers: 1,
            decoder_layers: 1,
            heads: 2,
            buckets: 8,
            max_distance: 16,
            norm_eps: 1e-6,
            activation: FeedForwardActivation::Relu,
            gated: false,
            tied_head: true,
            scale_output: true,
            padding: 0,
            decoder_start: 0,
            dropout: DropoutRates::default(),
        }
    }

    #[test]
    fn a_forward_reads_the_layout_of_its_own_rows_and_no_other() {
        let mut engine = Engine::new(ModelConfig::T5(tiny()).spec().unwrap(), EngineConfig::default()).unwrap();
        let rows = |width: i64| Tensor::arange(width, (Kind::Int64, tch::Device::Cpu)).remainder(16).view([1, width]);
        let err = engine.evaluate(&rows(5)).unwrap_err().to_string();
        assert!(err.contains("must say where the target starts"), "{err}");
        engine.set_layout(Some(&RowLayout::encoder_decoder(&[3], 3, 2).unwrap()));
        assert_eq!(engine.evaluate(&rows(5)).unwrap().size(), [1, 2, 16], "logits of the target's positions");
        let err = engine.evaluate(&rows(6)).unwrap_err().to_string();
        assert!(err.contains("the layout set is for rows of 5 positions, these rows hold 6"), "{err}");
    }
}
