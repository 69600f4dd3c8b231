//! The model and steps the offload tests train: a four-layer GPT whose head borrows the
//! embedding's weight (tied), so one unit's gradient comes from two backwards.
use strata::data::{Batch, Step};
use strata::engine::{with_seed, EngineConfig};
use strata::model::{self, Builder, GptConfig, ModelSpec};
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::parallel::{build_engine, RankLayout};
use strata::strategy::Strategy;
use strata::train::Trainer;
use tch::{Device, Kind, Tensor};

const GPT: GptConfig = GptConfig::new(64, 16, 4, 2, 32);

pub fn spec() -> ModelSpec {
    let mut b = Builder::new();
    model::gpt(&GPT, &mut b).unwrap();
    b.build().unwrap()
}

/// Step `index`: two micro-batches (gradients accumulate) of two sequences, each counting
/// up by three from a random start (a pattern the model can learn).
pub fn step(index: usize) -> Step {
    let batch = |i: i64| {
        // Tests run on several threads: the draw holds libtorch's generator.
        let starts = with_seed(1000 + 2 * index as i64 + i, || Tensor::randint(64, [2, 1], (Kind::Int64, Device::Cpu)));
        let tokens = (starts + Tensor::arange(17, (Kind::Int64, Device::Cpu)) * 3).remainder(64);
        Batch::new(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16)).unwrap()
    };
    Step::new(index, vec![batch(0), batch(1)])
}

/// Bytes of the model's states in fp32 with Adam: 16 per parameter.
pub fn model_state_bytes() -> u64 {
    spec().num_params() as u64 * 16
}

/// A trainer of `strategy` with AdamW, a constant rate, gradients clipped at 0.5 and the
/// strategy's loss scaling.
pub fn trainer(strategy: &Strategy, config: &EngineConfig, at: &RankLayout) -> strata::Result<Trainer> {
    trainer_of(spec(), strategy, config, at)
}

/// [`trainer`] of another model.
pub fn trainer_of(
    spec: ModelSpec,
    strategy: &Strategy,
    config: &EngineConfig,
    at: &RankLayout,
) -> strata::Result<Trainer> {
    let mut engine = build_engine(spec, config.clone(), strategy, at)?;
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[])?;
    let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(0.5));
    trainer.scaling = strategy.grad_scaling()?;
    Ok(trainer)
}
