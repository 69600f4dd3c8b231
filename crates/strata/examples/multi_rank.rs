//! A run over several ranks: every rank runs this program, started by a launcher, and
//! `strata::run::train` joins the job from the launcher's variables. Rank 0 writes the
//! metrics and the trained weights.
//!
//! cargo build --release -p strata --example multi_rank
//! strata launch --nproc-per-node 2 -- target/release/examples/multi_rank STRATEGY FOLDER
//!
//! STRATEGY is a strategy's JSON (e.g. `[["parallel_mode", [[["pipeline", 2]], null]]]` or
//! `["fsdp"]`); FOLDER receives `weights.safetensors` and `metrics.jsonl`.
use std::path::PathBuf;
use strata::data::Batching;
use strata::data::SyntheticCorpus;
use strata::model::{GptConfig, ModelConfig};
use strata::optim::{LrSchedule, OptimizerConfig};
use strata::run::{self, Data, Model, Outputs, RunConfig, StrategySource};
use strata::strategy::Strategy;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(strategy), Some(dir)) = (args.next(), args.next().map(PathBuf::from)) else {
        return Err("usage: multi_rank STRATEGY FOLDER".into());
    };
    let model = Model::from(ModelConfig::Gpt(GptConfig::new(256, 32, 2, 4, 64)));
    let data = Data::new(SyntheticCorpus::default().generate());
    let config = RunConfig {
        steps: 6,
        optimizer: OptimizerConfig { lr: 3e-3, ..OptimizerConfig::default() },
        schedule: LrSchedule::Constant,
        strategy: StrategySource::Given(Strategy::parse(&strategy)?),
        outputs: Outputs {
            weights: Some(dir.join("weights.safetensors")),
            metrics: Some(dir.join("metrics.jsonl")),
            ..Outputs::default()
        },
        batching: Batching { batch_size: 8, ctx: 32, accumulation: 2, ..Batching::default() },
        ..RunConfig::default()
    };
    let summary = run::train(&model, &data, &config, &mut [])?;
    if let Some(last) = summary.last.as_ref().filter(|_| summary.is_leader()) {
        println!("{} ranks, step {}: loss {:.4}", summary.world_size, last.step, last.loss);
    }
    Ok(())
}
