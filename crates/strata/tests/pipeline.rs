//! A pipeline's unit measurement, in one process (one stage): every unit is timed, and
//! its model-state bytes are those its buffers hold, so a balance over them is a balance
//! of what the stages really carry.
use std::sync::Arc;
use strata::data::{validation_steps, LoaderConfig, TokenData};
use strata::engine::EngineConfig;
use strata::model::{GptConfig, ModelConfig};
use strata::optim::{OptimizerConfig, Schedule};
use strata::parallel::pipeline::{partition, PipelineSetup, PipelineTrainer};
use strata::parallel::DataParallelOptions;
use strata::strategy::Strategy;

#[test]
fn measured_units_are_timed_and_weighed_by_their_buffers() {
    let model = ModelConfig::Gpt(GptConfig::new(300, 16, 3, 2, 32));
    let spec = || model.spec();
    let strategy = Strategy::default();
    let setup = PipelineSetup {
        spec: &spec,
        engine: EngineConfig::default(),
        strategy: &strategy,
        comm: None,
        local_world_size: 1,
        data_parallel: DataParallelOptions::default(),
        optimizer: OptimizerConfig::default(),
        schedule: Schedule::Constant,
        grad_clip: None,
        micro_batches: 2,
        split: None,
    };
    let trainer = PipelineTrainer::new(setup).unwrap();
    let data = Arc::new(TokenData::new((0..2000).map(|i| (i * 7 % 300) as u32).collect(), "tokens"));
    let config = LoaderConfig { accumulation: 2, ..LoaderConfig::new(16, 4) };
    let step = validation_steps(&data, &config, Some(1), 1).unwrap().remove(0);
    let costs = trainer.measure_units(&step).unwrap();
    let whole = model.spec().unwrap();
    assert_eq!(costs.len(), whole.units.len());
    for (k, (cost, unit)) in costs.iter().zip(&whole.units).enumerate() {
        let numel: i64 = unit.params.iter().map(|id| whole.params[id.0].numel()).sum();
        // fp32 parameters, gradients and AdamW's two moments.
        assert_eq!(cost.bytes, numel as u64 * 4 * 4, "unit {k}");
        assert!(cost.seconds > 0.0, "unit {k} was not timed");
    }
    // A budget below the embedding's states alone leaves no split; at the whole model's,
    // any split fits.
    let total: u64 = costs.iter().map(|c| c.bytes).sum();
    assert!(partition::balance(&costs, 2, Some(costs[0].bytes - 1)).is_err());
    assert_eq!(partition::balance(&costs, 2, Some(total)).unwrap().len(), 2);
}
