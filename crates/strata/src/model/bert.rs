//! BERT as `transformers` defines it (`BertForSequenceClassification`, `BertForMaskedLM`):
//! word, position and token-type embeddings summed and normed, post-norm encoder blocks
//! whose attention reads every position of its example in both directions, and a head — the
//! pooler (the first token through a dense layer and tanh) with a classifier, or the
//! masked-language-model transform with an output layer tied to the word embeddings.
//! Padding and packed examples reach the attention through the batch's [`RowLayout`]
//! (each position attends to its own example's), and token types through its `segments`.
//! Parameter names are `transformers`' own, so its folders load as they are.
//!
//! Dropout, where the configuration asks for it, falls where `transformers` puts it; its
//! sites ([`super::dropout`]): the embedding's 0 (after the norm); a block's 0 (attention
//! probabilities), 1 (attention output) and 2 (feed-forward output); the classifier
//! head's 0 (the pooled vector).
//!
//! Owns the BERT units and their declarations. Must not allocate or place weights: [`bert`]
//! records specifications in the [`Builder`], and the units compute with the parameters
//! the engine lends them.
use super::dropout::masked;
use super::gpt::{dense, norm};
use super::layers::{
    attention, gelu, layer_norm, merge_heads, other_examples, split_heads, vocab_embedding, vocab_logits,
    AttentionOptions, ScoreTerms,
};
use super::{
    positive, Builder, DropoutRates, Init, Kept, ParamId, Params, TpRole, Unit, UnitBuilder, UnitCost, INIT_STD as STD,
};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// What BERT's last unit computes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum BertHead {
    /// Logits over the classes `labels` names, in id order (`id2label`), from the pooled
    /// first token (`[B, classes]`).
    Classify {
        /// The class names, in id order.
        labels: Vec<String>,
    },
    /// Logits over the vocabulary at every position (`[B, T, vocab]`).
    MaskedLm,
}

/// The shape of a BERT model, in `transformers`' terms where it has them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    /// Words of the vocabulary (`vocab_size`).
    pub vocab: i64,
    /// Positions the learned position table holds (`max_position_embeddings`).
    pub max_positions: i64,
    /// Token types the type table holds (`type_vocab_size`).
    pub type_vocab: i64,
    /// Encoder blocks (`num_hidden_layers`).
    pub layers: i64,
    /// Attention heads per block (`num_attention_heads`).
    pub heads: i64,
    /// The hidden width (`hidden_size`).
    pub dim: i64,
    /// The feed-forward layer's width (`intermediate_size`).
    pub ffn_dim: i64,
    /// The LayerNorms' epsilon (`layer_norm_eps`).
    pub norm_eps: f64,
    /// The word whose look-ups get no gradient (`pad_token_id`).
    pub padding: Option<i64>,
    /// What the last unit computes.
    pub head: BertHead,
    /// Dropout after the embeddings (`embedding`), on attention probabilities
    /// (`attention`), on each sub-layer's output (`residual`) and before the classifier
    /// (`classifier`).
    #[serde(default)]
    pub dropout: DropoutRates,
}

impl BertConfig {
    /// Refuses sizes that are not positive, a `dim` that `heads` does not divide, a bad epsilon,
    /// a classifier without labels, bad dropout rates and a pad token outside the vocabulary.
    pub fn validate(&self) -> Result<()> {
        positive(&[
            ("vocab", self.vocab),
            ("max_positions", self.max_positions),
            ("type_vocab", self.type_vocab),
            ("layers", self.layers),
            ("heads", self.heads),
            ("dim", self.dim),
            ("ffn_dim", self.ffn_dim),
        ])?;
        if self.dim % self.heads != 0 {
            return Err(Error::Config(format!("dim {} is not divisible by heads {}", self.dim, self.heads)));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(Error::Config(format!("norm_eps must be positive, got {}", self.norm_eps)));
        }
        if let BertHead::Classify { labels } = &self.head {
            positive(&[("labels", labels.len() as i64)])?;
        }
        self.dropout.validate()?;
        if let Some(pad) = self.padding.filter(|p| !(0..self.vocab).contains(p)) {
            return Err(Error::Config(format!("pad token {pad} is outside the vocabulary of {}", self.vocab)));
        }
        Ok(())
    }
}

struct BertEmbedding {
    words: ParamId,
    positions: ParamId,
    types: ParamId,
    norm: (ParamId, ParamId),
    vocab: i64,
    max_positions: i64,
    type_vocab: i64,
    padding: Option<i64>,
    eps: f64,
    dropout: f64,
}

impl Unit for BertEmbedding {
    fn kind(&self) -> &'static str {
        "BertEmbedding"
    }
    fn forward(&self, p: &Params<'_>, tokens: &Tensor) -> Result<Tensor> {
        let t = tokens.size().last().copied().unwrap_or(0);
        if t > self.max_positions {
            return Err(Error::Model(format!(
                "sequence of {t} tokens is longer than the {} positions",
                self.max_positions
            )));
        }
        let layout = p.layout();
        let positions = match layout {
            Some(layout) => layout.positions.shallow_clone(),
            None => Tensor::f_arange(t, (Kind::Int64, tokens.device()))?,
        };
        let types = match layout.and_then(|l| l.segments.as_ref()) {
            // Checked here where the types live on the host; on a GPU the read would make the
            // host wait for the device mid-forward, so data is checked before it gets there
            // (`Dataset::check_token_types`) and the embedding itself bounds its index.
            Some(segments) if segments.numel() > 0 => {
                if segments.device() == Device::Cpu {
                    let (low, high) = (segments.f_min()?.f_int64_value(&[])?, segments.f_max()?.f_int64_value(&[])?);
                    if low < 0 || high >= self.type_vocab {
                        return Err(Error::Model(format!(
                            "token types {low}..={high} outside the {} the model has",
                            self.type_vocab
                        )));
                    }
                }
                segments.shallow_clone()
            }
            _ => tokens.f_zeros_like()?,
        };
        let words = vocab_embedding(&p[self.words], tokens, self.vocab, self.padding, p.tp())?;
        let summed = words
            .f_add(&Tensor::f_embedding(&p[self.types], &types, -1, false, false)?)?
            .f_add(&Tensor::f_embedding(&p[self.positions], &positions, -1, false, false)?)?;
        p.dropout(&layer_norm(&summed, &p[self.norm.0], &p[self.norm.1], self.eps)?, self.dropout, 0, &[])
    }
}

struct BertBlock {
    query: (ParamId, ParamId),
    key: (ParamId, ParamId),
    value: (ParamId, ParamId),
    attention_out: (ParamId, ParamId),
    attention_norm: (ParamId, ParamId),
    intermediate: (ParamId, ParamId),
    output: (ParamId, ParamId),
    output_norm: (ParamId, ParamId),
    heads: i64,
    eps: f64,
    dropout: DropoutRates,
}

impl Unit for BertBlock {
    fn kind(&self) -> &'static str {
        "BertBlock"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let project =
            |(w, b): (ParamId, ParamId)| -> Result<Tensor> { split_heads(&p.linear(x, w, Some(b))?, self.heads) };
        let (q, k, v) = (project(self.query)?, project(self.key)?, project(self.value)?);
        let options = AttentionOptions { bidirectional: true, ..AttentionOptions::default() };
        let hidden = other_examples(p.layout())?;
        let probs = p.dropping_heads(self.dropout.attention, 0, self.heads);
        let attended =
            merge_heads(&attention(&q, &k, &v, &options, hidden.as_ref(), ScoreTerms::default(), probs.as_ref())?)?;
        let attended = p.linear(&attended, self.attention_out.0, Some(self.attention_out.1))?;
        let attended = p.dropout(&attended, self.dropout.residual, 1, &[])?;
        // Post-norm: the normed sum is the residual stream itself.
        let (w, b) = self.attention_norm;
        let x = layer_norm(&x.f_add(&attended)?, &p[w], &p[b], self.eps)?;
        let h = gelu(&p.linear(&x, self.intermediate.0, Some(self.intermediate.1))?)?;
        let h = p.dropout(&p.linear(&h, self.output.0, Some(self.output.1))?, self.dropout.residual, 2, &[])?;
        let (w, b) = self.output_norm;
        layer_norm(&x.f_add(&h)?, &p[w], &p[b], self.eps)
    }
}

struct BertClassifierHead {
    pooler: (ParamId, ParamId),
    classifier: (ParamId, ParamId),
    dropout: f64,
}

impl Unit for BertClassifierHead {
    fn kind(&self) -> &'static str {
        "BertClassifierHead"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        // The first token of each row (`[CLS]`) stands for the whole text.
        let first = x.f_select(1, 0)?;
        let pooled = p.linear(&first, self.pooler.0, Some(self.pooler.1))?.f_tanh()?;
        p.linear(&p.dropout(&pooled, self.dropout, 0, &[])?, self.classifier.0, Some(self.classifier.1))
    }
}

struct BertMaskedLmHead {
    transform: (ParamId, ParamId),
    norm: (ParamId, ParamId),
    words: ParamId,
    bias: ParamId,
    vocab: i64,
    eps: f64,
}

impl Unit for BertMaskedLmHead {
    fn kind(&self) -> &'static str {
        "BertMaskedLmHead"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        let h = gelu(&p.linear(x, self.transform.0, Some(self.transform.1))?)?;
        let h = layer_norm(&h, &p[self.norm.0], &p[self.norm.1], self.eps)?;
        vocab_logits(&h, &p[self.words], Some(&p[self.bias]), self.vocab, None, p.tp())
    }
    fn position_wise(&self) -> bool {
        true
    }
}

/// The BERT model function: units `embedding`, `bert.encoder.layer.{i}`, `head`.
pub fn bert(cfg: &BertConfig, b: &mut Builder) -> Result<()> {
    cfg.validate()?;
    b.dropout(&cfg.dropout);
    let d = cfg.dim;
    let mut u = b.unit("embedding");
    let prefix = "bert.embeddings";
    let normal = Init::Normal { std: STD };
    let words = u.param(format!("{prefix}.word_embeddings.weight"), &[cfg.vocab, d], normal, TpRole::Vocab);
    let positions =
        u.param(format!("{prefix}.position_embeddings.weight"), &[cfg.max_positions, d], normal, TpRole::Replicated);
    let types =
        u.param(format!("{prefix}.token_type_embeddings.weight"), &[cfg.type_vocab, d], normal, TpRole::Replicated);
    let embedding_norm = norm(&mut u, &format!("{prefix}.LayerNorm"), d);
    // The ids and the three looked-up vectors' sum (the norm's input).
    let kept = Kept { values: 4.0 + 3.0 * d as f64, ..Kept::ids(d) };
    u.declare_cost(UnitCost::looking_up(kept.with_dropout(masked(cfg.dropout.embedding, d), false)));
    u.finish(BertEmbedding {
        words,
        positions,
        types,
        norm: embedding_norm,
        vocab: cfg.vocab,
        max_positions: cfg.max_positions,
        type_vocab: cfg.type_vocab,
        padding: cfg.padding,
        eps: cfg.norm_eps,
        dropout: cfg.dropout.embedding,
    });
    for i in 0..cfg.layers {
        let name = format!("bert.encoder.layer.{i}");
        let mut u = b.unit(name.clone());
        let linear = |u: &mut UnitBuilder<'_>, part: &str, out: i64, inp: i64, tp| {
            dense(u, &format!("{name}.{part}"), out, inp, STD, tp)
        };
        // In `transformers`' order of declaration.
        let query = linear(&mut u, "attention.self.query", d, d, TpRole::COLUMN);
        let key = linear(&mut u, "attention.self.key", d, d, TpRole::COLUMN);
        let value = linear(&mut u, "attention.self.value", d, d, TpRole::COLUMN);
        let attention_out = linear(&mut u, "attention.output.dense", d, d, TpRole::Row);
        let attention_norm = norm(&mut u, &format!("{name}.attention.output.LayerNorm"), d);
        let intermediate = linear(&mut u, "intermediate.dense", cfg.ffn_dim, d, TpRole::COLUMN);
        let output = linear(&mut u, "output.dense", d, cfg.ffn_dim, TpRole::Row);
        let output_norm = norm(&mut u, &format!("{name}.output.LayerNorm"), d);
        // Post-norm: as GPT's block with the feed-forward width given.
        let kept = Kept::block(11.0 * d as f64 + 2.0 * cfg.ffn_dim as f64 + 3.0, cfg.heads, d)
            .with_dropout(masked(cfg.dropout.residual, 2 * d), cfg.dropout.attention > 0.0);
        u.declare_cost(UnitCost::attending(kept, d));
        let block = BertBlock {
            query,
            key,
            value,
            attention_out,
            attention_norm,
            intermediate,
            output,
            output_norm,
            heads: cfg.heads,
            eps: cfg.norm_eps,
            dropout: cfg.dropout,
        };
        u.finish(block);
    }
    let mut u = b.unit("head");
    match &cfg.head {
        BertHead::Classify { labels } => {
            let pooler = dense(&mut u, "bert.pooler.dense", d, d, STD, TpRole::Replicated);
            let classifier = dense(&mut u, "classifier", labels.len() as i64, d, STD, TpRole::Replicated);
            u.declare_cost(UnitCost::keeping(Kept { values: 2.0, ..Kept::ids(d) }));
            u.finish(BertClassifierHead { pooler, classifier, dropout: cfg.dropout.classifier });
        }
        BertHead::MaskedLm => {
            let transform = dense(&mut u, "cls.predictions.transform.dense", d, d, STD, TpRole::Replicated);
            let transform_norm = norm(&mut u, "cls.predictions.transform.LayerNorm", d);
            let bias = u.param("cls.predictions.bias", &[cfg.vocab], Init::Zeros, TpRole::Vocab);
            let tied = u.borrow(&format!("{prefix}.word_embeddings.weight"));
            u.declare_cost(UnitCost::keeping(Kept::head(4.0 * d as f64 + 13.0, cfg.vocab)));
            u.finish(BertMaskedLmHead {
                transform,
                norm: transform_norm,
                words: tied,
                bias,
                vocab: cfg.vocab,
                eps: cfg.norm_eps,
            });
            b.alias("cls.predictions.decoder.weight", words);
            b.alias("cls.predictions.decoder.bias", bias);
        }
    }
    Ok(())
}
