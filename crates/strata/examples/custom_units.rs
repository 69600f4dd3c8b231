//! A model of your own, written as units, trained by `auto_accelerate`'s choice of strategy.
//!
//! The model is a token embedding, residual feed-forward blocks and an output head. Each
//! parameter says how it splits over a tensor group (its [`TpRole`]), and each unit's forward
//! says how it computes on its piece, so the search may consider tensor parallelism for it as
//! for Strata's own models; the strategy search, dry runs and the run itself are the library's.
//!
//! cargo run --release -p strata --example custom_units
//! strata launch --nproc-per-node 2 -- target/release/examples/custom_units
use strata::auto::AutoOptions;
use strata::data::Batching;
use strata::data::SyntheticCorpus;
use strata::model::layers::{gelu_tanh, vocab_embedding, vocab_logits};
use strata::model::{Builder, Init, ParamId, Params, TpRole, Unit};
use strata::run::{self, Data, Model, RunConfig, StrategySource};
use tch::Tensor;

const VOCAB: i64 = 256;
const DIM: i64 = 64;
const HIDDEN: i64 = 256;

struct Embedding {
    table: ParamId,
}

impl Unit for Embedding {
    fn kind(&self) -> &'static str {
        "Embedding"
    }
    fn forward(&self, p: &Params<'_>, tokens: &Tensor) -> strata::Result<Tensor> {
        vocab_embedding(&p[self.table], tokens, VOCAB, None, p.tp())
    }
    fn position_wise(&self) -> bool {
        true
    }
    fn check_tensor_parallel(&self, _tp: i64) -> strata::Result<()> {
        Ok(())
    }
}

/// `x + down(gelu(up(x)))`: `up` split by output rows (column parallel), `down` by input
/// columns (row parallel), so each rank computes its slice of the hidden layer and one sum
/// over the group joins them. Declared as linear layers and applied through `Params`, they
/// take low-rank adapters where a strategy's `lora` names them.
struct FeedForward {
    up: ParamId,
    down: ParamId,
}

impl Unit for FeedForward {
    fn kind(&self) -> &'static str {
        "FeedForward"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> strata::Result<Tensor> {
        let hidden = gelu_tanh(&p.linear(&p.tp().enter(x)?, self.up, None)?)?;
        Ok(x.f_add(&p.row_linear(&hidden, self.down, None)?)?)
    }
    fn position_wise(&self) -> bool {
        true
    }
    fn check_tensor_parallel(&self, tp: i64) -> strata::Result<()> {
        match HIDDEN % tp {
            0 => Ok(()),
            _ => Err(strata::Error::Config(format!("{HIDDEN} hidden features do not split over {tp} ranks"))),
        }
    }
}

struct Head {
    weight: ParamId,
}

impl Unit for Head {
    fn kind(&self) -> &'static str {
        "Head"
    }
    fn forward(&self, p: &Params<'_>, x: &Tensor) -> strata::Result<Tensor> {
        vocab_logits(x, &p[self.weight], None, VOCAB, None, p.tp())
    }
    fn position_wise(&self) -> bool {
        true
    }
    fn check_tensor_parallel(&self, _tp: i64) -> strata::Result<()> {
        Ok(())
    }
}

/// The model function: what each unit holds, declared before anything is allocated.
fn feed_forward_lm(b: &mut Builder) -> strata::Result<()> {
    let normal = Init::Normal { std: 0.02 };
    let mut u = b.unit("embedding");
    let table = u.param("embed.weight", &[VOCAB, DIM], normal, TpRole::Vocab);
    u.finish(Embedding { table });
    for i in 0..4 {
        let mut u = b.unit(format!("blocks.{i}"));
        let up = u.linear(format!("blocks.{i}.up.weight"), &[HIDDEN, DIM], normal, TpRole::Column { parts: 1 });
        let down = u.linear(format!("blocks.{i}.down.weight"), &[DIM, HIDDEN], normal, TpRole::Row);
        u.finish(FeedForward { up, down });
    }
    let mut u = b.unit("head");
    let weight = u.param("head.weight", &[VOCAB, DIM], normal, TpRole::Vocab);
    u.finish(Head { weight });
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = Data::new(SyntheticCorpus::default().generate());
    let config = RunConfig {
        steps: 30,
        strategy: StrategySource::Auto(AutoOptions { dry_run_steps: 2, ..AutoOptions::default() }),
        batching: Batching { batch_size: 16, ctx: 32, ..Batching::default() },
        ..RunConfig::default()
    };
    let summary = run::train(&Model::from_units(feed_forward_lm), &data, &config, &mut [])?;
    let last = summary.last.as_ref().ok_or("the run trained no step")?;
    if !summary.is_leader() {
        return Ok(());
    }
    println!("strategy {}; step {}: loss {:.4}", summary.strategy.to_value(), last.step, last.loss);
    // The corpus's tokens are uniform at first sight (loss ln 256 = 5.55); learning shows.
    if last.loss >= 5.0 {
        return Err(format!("the loss stayed at {:.3}", last.loss).into());
    }
    Ok(())
}
