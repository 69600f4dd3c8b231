//! GPT-2 in nanoGPT's layout: learned positions, pre-LayerNorm blocks, GELU (tanh), and an
//! output head tied to the token embedding. Parameter names and `[out, in]` layouts are
//! nanoGPT's, so its safetensors files load as they are.
//!
//! Dropout, where the configuration asks for it, falls where GPT-2 puts it; its sites
//! ([`super::dropout`]): the embedding's 0 (the summed embeddings); a block's 0 (attention
//! probabilities), 1 (attention output) and 2 (MLP output).
//!
//! Owns the GPT units and their parameter declarations. Must not allocate or place weights:
//! [`gpt`] records specifications in the [`Builder`], and the units compute with the
//! parameters the engine lends them.
use super::dropout::masked;
use super::head_loss::head_output;
use super::layers::{
    add_layer_norm, attend, attention, gelu_tanh, layer_norm_into_product, merge_heads, split_heads, vocab_embedding,
    AttentionOptions, ScoreTerms,
};
use super::{
    default_norm_eps, positive, Builder, DecodeCache, DropoutRates, Init, Kept, ParamId, Params, TpRole, Unit,
    UnitCost, DEFAULT_NORM_EPS, INIT_STD as STD,
};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// The shape of a GPT-2 model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Tokens of the vocabulary.
    pub vocab: i64,
    /// The most positions of a sequence: the learned position table's length.
    pub ctx: i64,
    /// Transformer blocks.
    pub layers: i64,
    /// Attention heads per block.
    pub heads: i64,
    /// The hidden width.
    pub dim: i64,
    /// The LayerNorms' epsilon.
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Dropout after the embeddings (`embedding`), on attention probabilities
    /// (`attention`) and on each sub-layer's output (`residual`): GPT-2's `embd_pdrop`,
    /// `attn_pdrop` and `resid_pdrop`.
    #[serde(default)]
    pub dropout: DropoutRates,
}

impl GptConfig {
    /// A configuration of these sizes with the default epsilon and no dropout.
    pub const fn new(vocab: i64, ctx: i64, layers: i64, heads: i64, dim: i64) -> Self {
        GptConfig { vocab, ctx, layers, heads, dim, norm_eps: DEFAULT_NORM_EPS, dropout: DropoutRates::NONE }
    }

    /// Refuses sizes that are not positive, a `dim` that `heads` does not divide, a bad epsilon
    /// and bad dropout rates.
    pub fn validate(&self) -> Result<()> {
        positive(&[
            ("vocab", self.vocab),
            ("ctx", self.ctx),
            ("layers", self.layers),
            ("heads", self.heads),
            ("dim", self.dim),
        ])?;
        if self.dim % self.heads != 0 {
            return Err(Error::Config(format!("dim {} is not divisible by heads {}", self.dim, self.heads)));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(Error::Config(format!("norm_eps must be positive, got {}", self.norm_eps)));
        }
        self.dropout.validate()
    }
}

struct GptEmbedding {
    wte: ParamId,
    wpe: ParamId,
    ctx: i64,
    vocab: i64,
    dropout: f64,
}

impl Unit for GptEmbedding {
    fn kind(&self) -> &'static str {
        "GptEmbedding"
    }
    fn forward(&self, p: &Params<'_>, tokens: &Tensor) -> Result<Tensor> {
        let t = tokens.size().last().copied().unwrap_or(0);
        self.check_length(t)?;
        let tp = p.tp();
        if tp.sequence_parallel() && t % tp.size() != 0 {
            return Err(Error::Model(format!(
                "sequence parallel splits {t} positions over {} ranks: the length must be a multiple",
                tp.size()
            )));
        }
        // Under sequence parallel this rank's vectors are its piece of the sequence.
        let (start, len) = tp.sequence_range(t);
        // Packed examples each start again at position 0.
        let pos = match p.layout() {
            Some(layout) => layout.positions.f_narrow(1, start, len)?,
            None => Tensor::f_arange_start(start, start + len, (tch::Kind::Int64, tokens.device()))?,
        };
        let tok = vocab_embedding(&p[self.wte], tokens, self.vocab, None, tp)?;
        let embedded = tok.f_add(&Tensor::f_embedding(&p[self.wpe], &pos, -1, false, false)?)?;
        p.dropout(&embedded, self.dropout, 0, &[start])
    }
    fn decode(&self, p: &Params<'_>, tokens: &Tensor, cache: &mut DecodeCache) -> Result<Tensor> {
        let t = tokens.size().last().copied().unwrap_or(0);
        self.check_length(cache.position() + t)?;
        let start = cache.advance(t);
        // Rows decoded together after left padding each count from their first token.
        let pos = match p.layout() {
            Some(layout) => layout.positions.shallow_clone(),
            None => Tensor::f_arange_start(start, start + t, (tch::Kind::Int64, tokens.device()))?,
        };
        let tok = Tensor::f_embedding(&p[self.wte], tokens, -1, false, false)?;
        Ok(tok.f_add(&Tensor::f_embedding(&p[self.wpe], &pos, -1, false, false)?)?)
    }
    fn check_tensor_parallel(&self, _tp: i64) -> Result<()> {
        Ok(())
    }
    fn check_context_parallel(&self, _split_heads: Option<i64>) -> Result<()> {
        Ok(())
    }
}

impl GptEmbedding {
    /// Positions past the learned table have no embedding.
    fn check_length(&self, t: i64) -> Result<()> {
        if t > self.ctx {
            return Err(Error::Model(format!("sequence of {t} tokens is longer than the context {}", self.ctx)));
        }
        Ok(())
    }
}

struct GptBlock {
    ln_1: (ParamId, ParamId),
    c_attn: (ParamId, ParamId),
    attn_proj: (ParamId, ParamId),
    ln_2: (ParamId, ParamId),
    c_fc: (ParamId, ParamId),
    mlp_proj: (ParamId, ParamId),
    heads: i64,
    dim: i64,
    eps: f64,
    dropout: DropoutRates,
}

impl Unit for GptBlock {
    fn kind(&self) -> &'static str {
        "GptBlock"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        self.run(p, x, None)
    }
    fn decode(&self, p: &Params<'_>, x: &Tensor, cache: &mut DecodeCache) -> Result<Tensor> {
        self.run(p, x, Some(cache))
    }
    fn check_tensor_parallel(&self, tp: i64) -> Result<()> {
        divides_heads(tp, "heads", self.heads)
    }
    fn check_context_parallel(&self, split_heads: Option<i64>) -> Result<()> {
        split_heads.map_or(Ok(()), |ways| divides_heads(ways, "heads", self.heads))
    }
}

impl GptBlock {
    /// The block over new positions; with a cache, their attention also reads the keys and
    /// values of the positions before them.
    fn run(&self, p: &Params<'_>, x: &Tensor, cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        // Split over the tensor group, this rank computes its heads and its piece of the MLP.
        let tp = p.tp();
        let (heads, dim) = (self.heads / tp.size(), self.dim / tp.size());
        let h = tp.enter(&layer_norm_into_product(x, &p[self.ln_1.0], &p[self.ln_1.1], self.eps)?)?;
        let qkv = p.linear(&h, self.c_attn.0, Some(self.c_attn.1))?;
        let parts = qkv.f_split(dim, 2)?;
        let (q, k, v) =
            (split_heads(&parts[0], heads)?, split_heads(&parts[1], heads)?, split_heads(&parts[2], heads)?);
        let probs = p.dropping_heads(self.dropout.attention, 0, heads);
        let options = AttentionOptions::default();
        let y = match cache {
            Some(c) => {
                // Decoding, the layout marks left padding the cache must keep hidden.
                let hidden = p.layout().map(|l| c.hide_other_examples(&l.examples)).transpose()?;
                let (k, v) = c.extend(&k, &v)?;
                attention(&q, &k, &v, &options, hidden.as_ref(), ScoreTerms::default(), probs.as_ref())?
            }
            None => attend(p, &q, &k, &v, &options, p.layout(), ScoreTerms::default(), probs.as_ref())?,
        };
        let y = merge_heads(&y)?;
        let attended = p.row_linear(&y, self.attn_proj.0, Some(self.attn_proj.1))?;
        // Where the residual stream holds this rank's piece of the sequence (sequence parallel).
        let piece = [tp.sequence_range(x.size()[1] * tp.size()).0];
        let attended = p.dropout(&attended, self.dropout.residual, 1, &piece)?;
        let (x, h) = add_layer_norm(x, &attended, &p[self.ln_2.0], &p[self.ln_2.1], self.eps)?;
        let h = tp.enter(&h)?;
        let h = gelu_tanh(&p.linear(&h, self.c_fc.0, Some(self.c_fc.1))?)?;
        let out = p.row_linear(&h, self.mlp_proj.0, Some(self.mlp_proj.1))?;
        Ok(x.f_add(&p.dropout(&out, self.dropout.residual, 2, &piece)?)?)
    }
}

/// Refuses a tensor size that does not split `count` heads (named `what`) evenly.
pub(crate) fn divides_heads(tp: i64, what: &str, count: i64) -> Result<()> {
    if count % tp != 0 {
        return Err(Error::Config(format!("tensor size {tp} does not divide the {count} {what}")));
    }
    Ok(())
}

struct GptHead {
    eps: f64,
    vocab: i64,
    ln_f: (ParamId, ParamId),
    wte: ParamId,
}

impl Unit for GptHead {
    fn kind(&self) -> &'static str {
        "GptHead"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let h = layer_norm_into_product(x, &p[self.ln_f.0], &p[self.ln_f.1], self.eps)?;
        head_output(&h, &p[self.wte], self.vocab, None, p)
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

/// Declares a weight/bias pair `{prefix}.weight` `[out, in]` and `{prefix}.bias` `[out]`.
pub(crate) fn dense(
    u: &mut super::UnitBuilder<'_>,
    prefix: &str,
    out: i64,
    inp: i64,
    std: f64,
    tp: TpRole,
) -> (ParamId, ParamId) {
    // A column layer's bias splits with its outputs; a row layer's is added after the sum.
    let bias_tp = if tp == TpRole::Row { TpRole::SequenceReplicated } else { tp };
    (
        u.linear(format!("{prefix}.weight"), &[out, inp], Init::Normal { std }, tp),
        u.param(format!("{prefix}.bias"), &[out], Init::Zeros, bias_tp),
    )
}

pub(crate) fn norm(u: &mut super::UnitBuilder<'_>, prefix: &str, dim: i64) -> (ParamId, ParamId) {
    (
        u.norm(format!("{prefix}.weight"), &[dim], Init::Ones, TpRole::SequenceReplicated),
        u.norm(format!("{prefix}.bias"), &[dim], Init::Zeros, TpRole::SequenceReplicated),
    )
}

/// The GPT model function: units `embedding`, `transformer.h.{i}`, `head`.
pub fn gpt(cfg: &GptConfig, b: &mut Builder) -> Result<()> {
    cfg.validate()?;
    b.dropout(&cfg.dropout);
    let d = cfg.dim;
    let mut u = b.unit("embedding");
    let wte = u.param("transformer.wte.weight", &[cfg.vocab, d], Init::Normal { std: STD }, TpRole::Vocab);
    // Added to this rank's piece of the sequence under sequence parallel.
    let wpe = u.param("transformer.wpe.weight", &[cfg.ctx, d], Init::Normal { std: STD }, TpRole::SequenceReplicated);
    u.declare_cost(UnitCost::looking_up(Kept::ids(cfg.dim).with_dropout(masked(cfg.dropout.embedding, d), false)));
    u.finish(GptEmbedding { wte, wpe, ctx: cfg.ctx, vocab: cfg.vocab, dropout: cfg.dropout.embedding });
    // Residual projections are scaled down so the residual stream's variance stays bounded.
    let proj_std = STD / (2.0 * cfg.layers as f64).sqrt();
    for i in 0..cfg.layers {
        let name = format!("transformer.h.{i}");
        let mut u = b.unit(name.clone());
        let block = GptBlock {
            ln_1: norm(&mut u, &format!("{name}.ln_1"), d),
            c_attn: dense(&mut u, &format!("{name}.attn.c_attn"), 3 * d, d, STD, TpRole::Column { parts: 3 }),
            attn_proj: dense(&mut u, &format!("{name}.attn.c_proj"), d, d, proj_std, TpRole::Row),
            ln_2: norm(&mut u, &format!("{name}.ln_2"), d),
            c_fc: dense(&mut u, &format!("{name}.mlp.c_fc"), 4 * d, d, STD, TpRole::COLUMN),
            mlp_proj: dense(&mut u, &format!("{name}.mlp.c_proj"), d, 4 * d, proj_std, TpRole::Row),
            heads: cfg.heads,
            dim: d,
            eps: cfg.norm_eps,
            dropout: cfg.dropout,
        };
        // The block's input (norm), q, k, v, attention output, projection input, residual,
        // second norm input, MLP input; the GELU's input and output are 4·D each.
        let kept = Kept::block(19.0 * d as f64 + 3.0, cfg.heads, d)
            .with_dropout(masked(cfg.dropout.residual, 2 * d), cfg.dropout.attention > 0.0);
        u.declare_cost(UnitCost::attending(kept, d));
        u.finish(block);
    }
    let mut u = b.unit("head");
    let ln_f = norm(&mut u, "transformer.ln_f", d);
    let tied = u.borrow("transformer.wte.weight");
    u.declare_cost(UnitCost::keeping(Kept::head(4.0 * cfg.dim as f64 + 13.0, cfg.vocab)));
    u.finish(GptHead { eps: cfg.norm_eps, vocab: cfg.vocab, ln_f, wte: tied });
    b.alias("lm_head.weight", wte);
    Ok(())
}
