//! Your own data and your own loss in a library run.
//!
//! The data is token ids the program makes itself — here, sentences of a tiny arithmetic
//! language (`a + b = c ;` over digits) — handed over as [`TokenData`]. The loss is
//! cross-entropy with label smoothing, given as the run's `loss`: the run calls it with the
//! model's output and each micro-batch.
//!
//! cargo run --release -p strata --example custom_data_loss
use std::sync::Arc;
use strata::data::Batching;
use strata::data::{Batch, TokenData};
use strata::model::{GptConfig, ModelConfig};
use strata::run::{self, Data, Flow, Model, RunConfig};
use strata::train::StepReport;
use tch::{Kind, Tensor};

/// Token ids: the digits 0–9 are themselves, then `+`, `=` and `;`.
const PLUS: u32 = 10;
const EQUALS: u32 = 11;
const END: u32 = 12;
const VOCAB: i64 = 13;

/// `count` sums of two digits, from a small linear congruential sequence (reproducible,
/// and enough variety for the example).
fn sums(count: usize) -> Vec<u32> {
    let mut state = 12345u64;
    let mut digit = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) % 10) as u32
    };
    let mut ids = Vec::with_capacity(count * 7);
    for _ in 0..count {
        let (a, b) = (digit(), digit());
        let c = a + b;
        ids.extend([a, PLUS, b, EQUALS]);
        if c >= 10 {
            ids.push(c / 10);
        }
        ids.extend([c % 10, END]);
    }
    ids
}

/// Cross-entropy against targets smoothed by `epsilon` over the vocabulary.
fn smoothed_cross_entropy(epsilon: f64) -> strata::train::LossFn {
    Arc::new(move |logits: &Tensor, batch: &Batch| {
        let log_probs = logits.f_log_softmax(-1, Kind::Float)?;
        let picked = log_probs.f_gather(-1, &batch.targets.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
        let uniform = log_probs.f_mean_dim(-1, false, Kind::Float)?;
        let per_token = picked.f_mul_scalar(1.0 - epsilon)?.f_add(&uniform.f_mul_scalar(epsilon)?)?;
        Ok(per_token.f_mean(Kind::Float)?.f_neg()?)
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let train = TokenData::new(sums(40_000), "two-digit sums");
    let validation = TokenData::new(sums(2_000), "two-digit sums, held out");
    let data = Data::with_validation(train, validation);
    let model = Model::from(ModelConfig::Gpt(GptConfig::new(VOCAB, 32, 2, 4, 64)));
    let config = RunConfig {
        steps: 60,
        eval_every: Some(20),
        loss: Some(smoothed_cross_entropy(0.1)),
        batching: Batching { batch_size: 16, ctx: 32, ..Batching::default() },
        ..RunConfig::default()
    };
    let mut first_loss = None;
    let mut watch = |r: &StepReport| {
        first_loss.get_or_insert(r.loss);
        if let Some(v) = r.val_loss {
            println!("step {}: loss {:.4}, validation {:.4}", r.step, r.loss, v);
        }
        Ok(Flow::Continue)
    };
    let summary = run::train(&model, &data, &config, &mut [&mut watch])?;
    let (first, last) = (first_loss.ok_or("no step ran")?, summary.last.ok_or("no step ran")?);
    if last.loss >= first * 0.8 {
        return Err(format!("the loss went from {first:.3} to {:.3} only", last.loss).into());
    }
    Ok(())
}
