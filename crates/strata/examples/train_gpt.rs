//! Trains a small GPT on the embedded synthetic corpus with the library API, writing the
//! loop out by hand: forward, loss, backward, clip, step.
//!
//! Run with: cargo run --release -p strata --example train_gpt
use std::sync::Arc;
use strata::data::{DataLoader, LoaderConfig, Order, SyntheticCorpus};
use strata::engine::{Engine, EngineConfig};
use strata::model::{self, layers::cross_entropy, Builder, GptConfig};
use strata::optim::{Optimizer, OptimizerConfig, Schedule};

fn main() -> strata::Result<()> {
    tch::set_num_threads(2);
    // 1. Describe the model: nothing is allocated yet.
    let config = GptConfig::new(256, 64, 2, 4, 128);
    let mut builder = Builder::new();
    model::gpt(&config, &mut builder)?;

    // 2. The engine allocates one flat buffer per unit and runs the units in order.
    let mut model = Engine::new(builder.build()?, EngineConfig::default())?;
    let mut optim = Optimizer::new(&mut model, OptimizerConfig { lr: 3e-3, ..Default::default() }, &[])?;
    let steps = 200;
    let schedule = Schedule::WarmupCosine { warmup: 10, total: steps, min_factor: 0.1 };

    // 3. Data: the synthetic corpus, whose best possible loss is known.
    let corpus = SyntheticCorpus::default();
    let loader = DataLoader::new(
        Arc::new(corpus.generate()),
        LoaderConfig { seed: 1, ..LoaderConfig::new(config.ctx as usize, 16) },
        Order::Shuffled,
    )?;

    // 4. The loop.
    for (step, data) in (0..steps).zip(loader) {
        let batch = &data?.micro_batches[0];
        optim.set_lr_factor(schedule.factor(step));
        let out = model.forward(&batch.inputs)?;
        let loss = cross_entropy(&out, &batch.targets)?;
        model.backward(&loss)?;
        optim.clip_grad_norm(1.0)?;
        optim.step()?;
        model.zero_grad()?;
        if (step + 1) % 50 == 0 {
            println!("step {:>3}  loss {:.4}  (optimum {:.4})", step + 1, loss.double_value(&[]), corpus.best_loss());
        }
    }
    let path = std::env::temp_dir().join("strata-gpt-example.safetensors");
    strata::io::save_weights(&mut model, strata::io::WeightsTarget::File(&path), true)?;
    println!("weights saved to {}", path.display());
    Ok(())
}
