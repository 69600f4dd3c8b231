//! Activation offload: the values units keep for backward wait on the host, and training
//! stays bit for bit what it is without. (What it saves at the allocator's peak is measured
//! against the estimate by the CLI's tests, each run a process of its own.)
use strata::data::{Batch, Step};
use strata::engine::{Category, EngineConfig, Placement};
use strata::model::{self, Builder, LlamaConfig, ModelSpec};
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::parallel::{build_engine, RankLayout};
use strata::strategy::Strategy;
use strata::train::Trainer;
use tch::{Device, Kind, Tensor};

fn llama() -> ModelSpec {
    let cfg = LlamaConfig { kv_heads: Some(2), ffn_dim: Some(96), ..LlamaConfig::new(64, 64, 3, 4, 32) };
    let mut b = Builder::new();
    model::llama(&cfg, &mut b).unwrap();
    b.build().unwrap()
}

/// Step `i`'s rows, drawn without libtorch's generator (which tests on other threads seed).
fn step(i: i64) -> Step {
    let tokens = Tensor::arange(4 * 65, (Kind::Int64, Device::Cpu)).view([4, 65]);
    let tokens = (&tokens * (7 + 2 * i) + i * 13 + tokens.pow_tensor_scalar(2) / 5).remainder(64).to_kind(Kind::Int64);
    Step::new(i as usize, vec![Batch::new(tokens.narrow(1, 0, 64), tokens.narrow(1, 1, 64)).unwrap()])
}

/// Three steps of `strategy`: the losses, the weights after, and the bytes the ledger
/// counted on the host and on the device for activations at the last forward's end.
fn trained(strategy: &str) -> (Vec<f64>, Vec<Tensor>, (u64, u64)) {
    let strategy = Strategy::parse(strategy).unwrap();
    let mut engine = build_engine(llama(), EngineConfig::default(), &strategy, &RankLayout::single()).unwrap();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
    let losses = (0..3).map(|i| trainer.train_step(&step(i)).unwrap().loss).collect();
    let weights = trainer.engine().named_params().map(|(_, t)| t.copy()).collect();
    let engine = trainer.engine_mut();
    let out = engine.forward(&step(3).micro_batches[0].inputs).unwrap();
    let report = engine.ledger().report();
    let activations = |p: Placement| report.get(&p).and_then(|r| r.by_category.get(&Category::Activations)).copied();
    let held = (activations(Placement::Host).unwrap_or(0), activations(Placement::Device).unwrap_or(0));
    drop(out);
    (losses, weights, held)
}

/// Offloaded alone and beside recomputation, three steps of a LLaMA give the same losses
/// and weights to the bit; the host holds the blocks' kept values (or, recomputed, their
/// inputs) and the device keeps no block's input.
#[test]
fn offloaded_activations_train_bit_for_bit() {
    let (losses, weights, (host, device)) = trained("[]");
    assert_eq!(host, 0);
    // Four rows of 64 positions: one block's input or output.
    let hidden = 4 * 64 * 32 * 4;
    for (strategy, least_on_host) in [
        (r#"["activation_offload"]"#, 3 * 10 * hidden),
        (r#"[["checkpoint", ["LlamaBlock"]], "activation_offload"]"#, 3 * hidden),
    ] {
        let (l, w, (on_host, on_device)) = trained(strategy);
        assert_eq!(l, losses, "{strategy}");
        for (a, b) in weights.iter().zip(&w) {
            assert!(a.equal(b), "{strategy}: weights differ");
        }
        eprintln!("{strategy}: {on_host} bytes on the host, {on_device} on the device against {device}");
        assert!(on_host >= least_on_host, "{strategy}: {on_host} bytes on the host");
        // The blocks' three inputs leave the device; the head's input and the logits stay.
        assert_eq!(device - on_device, 3 * hidden, "{strategy}");
    }
}
