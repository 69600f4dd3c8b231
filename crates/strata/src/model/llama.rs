//! A LLaMA-style decoder: RMSNorm, rotary position embeddings (half-rotation convention),
//! grouped-query attention (`kv_heads` key/value heads, each shared by `heads / kv_heads`
//! query heads), SwiGLU feed-forward, no biases, and an output head that is its own
//! weight or, with `tie_embeddings`, the token embedding's. Optional attention biases cover
//! Qwen2 (on the query, key and value projections) and LLaMA's `attention_bias` (on the
//! output projection too). Names follow the common `model.layers.{i}.self_attn.q_proj.weight`
//! layout.
use super::gpt::divides_heads;
use super::layers::{
    causal_attention, linear, merge_heads, rms_norm, rotary, row_linear, split_heads, swiglu, vocab_logits,
};
use super::{
    default_norm_eps, positive, Builder, DecodeCache, Init, ParamId, Params, TokenEmbedding, TpRole, Unit,
    DEFAULT_NORM_EPS, INIT_STD as STD,
};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub vocab: i64,
    pub ctx: i64,
    pub layers: i64,
    pub heads: i64,
    pub dim: i64,
    /// Hidden size of the SwiGLU feed-forward; `None` means 8/3 · dim rounded up to 32.
    pub ffn_dim: Option<i64>,
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
}

impl LlamaConfig {
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
        }
    }

    pub fn key_value_heads(&self) -> i64 {
        self.kv_heads.unwrap_or(self.heads)
    }

    pub fn hidden(&self) -> i64 {
        self.ffn_dim.unwrap_or_else(|| (self.dim.saturating_mul(8) / 3 + 31) / 32 * 32)
    }

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
        if self.heads % self.key_value_heads() != 0 {
            return Err(Error::Config(format!(
                "kv_heads {} must divide the {} query heads (each key/value head serves a whole group)",
                self.key_value_heads(),
                self.heads
            )));
        }
        if self.dim % self.heads != 0 || (self.dim / self.heads) % 2 != 0 {
            return Err(Error::Config(format!("dim {} must split into {} heads of even size", self.dim, self.heads)));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(Error::Config(format!("rope_theta must be positive, got {}", self.rope_theta)));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(Error::Config(format!("norm_eps must be positive, got {}", self.norm_eps)));
        }
        Ok(())
    }
}

/// A projection's weight and optional bias.
type Dense = (ParamId, Option<ParamId>);

struct LlamaBlock {
    input_norm: ParamId,
    q: Dense,
    k: Dense,
    v: Dense,
    o: Dense,
    post_norm: ParamId,
    gate: ParamId,
    up: ParamId,
    down: ParamId,
    heads: i64,
    kv_heads: i64,
    rope_theta: f64,
    eps: f64,
}

/// Rotates `[B, H, T, D]`, whose first position is `start`, by position.
fn rotate_by_position(x: &Tensor, theta: f64, start: i64) -> Result<Tensor> {
    let (_, _, t, d) = x.size4()?;
    let opts = (Kind::Float, x.device());
    let inv_freq = Tensor::f_arange_start_step(0, d, 2, opts)?
        .f_div_scalar(d as f64)?
        .f_neg()?
        .f_mul_scalar(theta.ln())?
        .f_exp()?;
    let freqs = Tensor::f_arange_start(start, start + t, opts)?.f_outer(&inv_freq)?;
    let angles = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_to_kind(x.kind())?;
    rotary(x, &angles.f_cos()?, &angles.f_sin()?)
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
    fn check_tensor_parallel(&self, tp: i64) -> Result<()> {
        divides_heads(tp, "heads", self.heads)?;
        divides_heads(tp, "key/value heads", self.kv_heads)
    }
}

impl LlamaBlock {
    /// The block over new positions; with a cache, they follow the positions it holds and
    /// their attention also reads those positions' keys and values.
    fn run(&self, p: &Params<'_>, x: &Tensor, cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        // Split over the tensor group, this rank holds whole query heads and the key/value
        // heads they read, and its piece of the feed-forward.
        let tp = p.tp();
        let (heads, kv_heads) = (self.heads / tp.size(), self.kv_heads / tp.size());
        let dense = |h: &Tensor, (w, b): Dense| linear(h, &p[w], b.map(|b| &p[b]));
        let start = cache.as_ref().map_or(0, |c| c.position());
        let h = tp.enter(&rms_norm(x, &p[self.input_norm], self.eps)?)?;
        let q = rotate_by_position(&split_heads(&dense(&h, self.q)?, heads)?, self.rope_theta, start)?;
        let k = rotate_by_position(&split_heads(&dense(&h, self.k)?, kv_heads)?, self.rope_theta, start)?;
        let v = split_heads(&dense(&h, self.v)?, kv_heads)?;
        let (k, v) = match cache {
            Some(c) => c.extend(&k, &v)?,
            None => (k, v),
        };
        // Each key/value head serves `heads / kv_heads` adjacent query heads.
        let group = self.heads / self.kv_heads;
        let (k, v) = if group > 1 {
            (k.f_repeat_interleave_self_int(group, 1, None)?, v.f_repeat_interleave_self_int(group, 1, None)?)
        } else {
            (k, v)
        };
        let y = merge_heads(&causal_attention(&q, &k, &v)?)?;
        let x = x.f_add(&row_linear(&y, &p[self.o.0], self.o.1.map(|b| &p[b]), tp)?)?;
        let h = tp.enter(&rms_norm(&x, &p[self.post_norm], self.eps)?)?;
        let gated = swiglu(&linear(&h, &p[self.gate], None)?, &linear(&h, &p[self.up], None)?)?;
        Ok(x.f_add(&row_linear(&gated, &p[self.down], None, tp)?)?)
    }
}

struct LlamaHead {
    norm: ParamId,
    lm_head: ParamId,
    eps: f64,
    vocab: i64,
}

impl Unit for LlamaHead {
    fn kind(&self) -> &'static str {
        "LlamaHead"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        vocab_logits(&rms_norm(x, &p[self.norm], self.eps)?, &p[self.lm_head], None, self.vocab, p.tp())
    }
    fn position_wise(&self) -> bool {
        true
    }
    fn check_tensor_parallel(&self, _tp: i64) -> Result<()> {
        Ok(())
    }
}

/// The LLaMA model function: units `embedding`, `model.layers.{i}`, `head`.
pub fn llama(cfg: &LlamaConfig, b: &mut Builder) -> Result<()> {
    cfg.validate()?;
    let (d, f) = (cfg.dim, cfg.hidden());
    let kv = cfg.key_value_heads() * (d / cfg.heads);
    let normal = Init::Normal { std: STD };
    let mut u = b.unit("embedding");
    let embed = u.param("model.embed_tokens.weight", &[cfg.vocab, d], normal, TpRole::Vocab);
    u.finish(TokenEmbedding { table: embed, vocab: cfg.vocab, kind: "LlamaEmbedding" });
    for i in 0..cfg.layers {
        let name = format!("model.layers.{i}");
        let mut u = b.unit(name.clone());
        let mut w = |suffix: &str, shape: &[i64], tp| u.param(format!("{name}.{suffix}"), shape, normal, tp);
        let (q, k, v) = (
            w("self_attn.q_proj.weight", &[d, d], TpRole::COLUMN),
            w("self_attn.k_proj.weight", &[kv, d], TpRole::COLUMN),
            w("self_attn.v_proj.weight", &[kv, d], TpRole::COLUMN),
        );
        let o = w("self_attn.o_proj.weight", &[d, d], TpRole::Row);
        let (gate, up) =
            (w("mlp.gate_proj.weight", &[f, d], TpRole::COLUMN), w("mlp.up_proj.weight", &[f, d], TpRole::COLUMN));
        let down = w("mlp.down_proj.weight", &[d, f], TpRole::Row);
        // A column projection's bias splits with its outputs; the output projection's is
        // added once after the row-parallel sum.
        let mut bias = |proj: &str, out: i64, tp, given: bool| {
            given.then(|| u.param(format!("{name}.self_attn.{proj}.bias"), &[out], Init::Zeros, tp))
        };
        let (q_bias, k_bias, v_bias) = (
            bias("q_proj", d, TpRole::COLUMN, cfg.qkv_bias),
            bias("k_proj", kv, TpRole::COLUMN, cfg.qkv_bias),
            bias("v_proj", kv, TpRole::COLUMN, cfg.qkv_bias),
        );
        let o_bias = bias("o_proj", d, TpRole::SequenceReplicated, cfg.o_bias);
        let norm = TpRole::SequenceReplicated;
        let input_norm = u.param(format!("{name}.input_layernorm.weight"), &[d], Init::Ones, norm);
        let post_norm = u.param(format!("{name}.post_attention_layernorm.weight"), &[d], Init::Ones, norm);
        u.finish(LlamaBlock {
            input_norm,
            q: (q, q_bias),
            k: (k, k_bias),
            v: (v, v_bias),
            o: (o, o_bias),
            post_norm,
            gate,
            up,
            down,
            heads: cfg.heads,
            kv_heads: cfg.key_value_heads(),
            rope_theta: cfg.rope_theta,
            eps: cfg.norm_eps,
        });
    }
    let mut u = b.unit("head");
    let norm = u.param("model.norm.weight", &[d], Init::Ones, TpRole::SequenceReplicated);
    if cfg.tie_embeddings {
        let lm_head = u.borrow("model.embed_tokens.weight");
        u.finish(LlamaHead { norm, lm_head, eps: cfg.norm_eps, vocab: cfg.vocab });
        b.alias("lm_head.weight", embed);
    } else {
        let lm_head = u.param("lm_head.weight", &[cfg.vocab, d], normal, TpRole::Vocab);
        u.finish(LlamaHead { norm, lm_head, eps: cfg.norm_eps, vocab: cfg.vocab });
    }
    Ok(())
}
