//! A small residual MLP language model (each position predicts the next token from its own
//! token only): the quickest model to test engine and strategy machinery with.
//!
//! Owns the MLP units and their parameter declarations. Must not allocate or place weights:
//! [`mlp`] records specifications in the [`Builder`], and the units compute with the
//! parameters the engine lends them.
use super::layers::{gelu_tanh, vocab_logits};
use super::{positive, Builder, Init, Kept, ParamId, Params, TokenEmbedding, TpRole, Unit, UnitCost, INIT_STD as STD};
use crate::Result;
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// The MLP model's configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MlpConfig {
    /// Vocabulary size: rows of the embedding and of the output head.
    pub vocab: i64,
    /// Number of residual layers between the embedding and the head.
    pub layers: i64,
    /// Width of the token vectors and of each layer's square weight.
    pub dim: i64,
}

struct MlpLayer {
    weight: ParamId,
    bias: ParamId,
    dim: i64,
}

impl Unit for MlpLayer {
    fn kind(&self) -> &'static str {
        "MlpLayer"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        // Split over the tensor group, the layer is row-parallel: this rank multiplies its
        // columns of the input, and the sums meet before the activation.
        let tp = p.tp();
        let piece = self.dim / tp.size();
        let h = tp.enter(x)?.f_narrow(-1, tp.rank() * piece, piece)?;
        Ok(x.f_add(&gelu_tanh(&p.row_linear(&h, self.weight, Some(self.bias))?)?)?)
    }
    fn position_wise(&self) -> bool {
        true
    }
    fn check_tensor_parallel(&self, _tp: i64) -> Result<()> {
        Ok(())
    }
}

struct MlpHead {
    weight: ParamId,
    bias: ParamId,
    vocab: i64,
}

impl Unit for MlpHead {
    fn kind(&self) -> &'static str {
        "MlpHead"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> Result<Tensor> {
        vocab_logits(x, &p[self.weight], Some(&p[self.bias]), self.vocab, None, p.tp())
    }
    fn position_wise(&self) -> bool {
        true
    }
    fn check_tensor_parallel(&self, _tp: i64) -> Result<()> {
        Ok(())
    }
}

/// The MLP model function: units `embedding`, `layers.{i}`, `head`.
pub fn mlp(cfg: &MlpConfig, b: &mut Builder) -> Result<()> {
    positive(&[("vocab", cfg.vocab), ("layers", cfg.layers), ("dim", cfg.dim)])?;
    let normal = Init::Normal { std: STD };
    let mut u = b.unit("embedding");
    let embed = u.param("embed.weight", &[cfg.vocab, cfg.dim], normal, TpRole::Vocab);
    u.declare_cost(UnitCost::looking_up(Kept::ids(cfg.dim)));
    u.finish(TokenEmbedding {
        table: embed,
        vocab: cfg.vocab,
        scale: None,
        padding: None,
        dropout: 0.0,
        kind: "MlpEmbedding",
    });
    for i in 0..cfg.layers {
        let mut u = b.unit(format!("layers.{i}"));
        let weight = u.linear(format!("layers.{i}.fc.weight"), &[cfg.dim, cfg.dim], normal, TpRole::Row);
        let bias = u.param(format!("layers.{i}.fc.bias"), &[cfg.dim], Init::Zeros, TpRole::SequenceReplicated);
        u.declare_cost(UnitCost::keeping(Kept::block(2.0 * cfg.dim as f64, 0, cfg.dim)));
        u.finish(MlpLayer { weight, bias, dim: cfg.dim });
    }
    let mut u = b.unit("head");
    let weight = u.param("head.weight", &[cfg.vocab, cfg.dim], normal, TpRole::Vocab);
    let bias = u.param("head.bias", &[cfg.vocab], Init::Zeros, TpRole::Vocab);
    u.declare_cost(UnitCost::keeping(Kept::head(2.0 * cfg.dim as f64 + 13.0, cfg.vocab)));
    u.finish(MlpHead { weight, bias, vocab: cfg.vocab });
    Ok(())
}
