//! Pipelines in the library: the unit measurement, in one process (one stage), where every
//! unit is timed and weighed by the model-state bytes its buffers hold and the activation
//! bytes its forward keeps; and fsdp beside a
//! pipeline, on 4 ranks, gathering each unit once per step however many micro-batches run;
//! and `auto::prepare`'s trainer under a pipeline on 2 ranks, following one process.

use crate::common::ranks::{assert_all_ok, connect, run_ranks};
use std::sync::Arc;
use strata::data::Batching;
use strata::data::{validation_steps, LoaderConfig, TokenData};
use strata::engine::EngineConfig;
use strata::engine::{Event, EventLog};
use strata::model::ModelSpec;
use strata::model::{GptConfig, LlamaConfig, ModelConfig};
use strata::optim::{LrSchedule, OptimizerConfig};
use strata::parallel::pipeline::schedule::{self, Pipeline, ScheduleKind};
use strata::parallel::pipeline::{partition, PipelineExecutor};
use strata::parallel::{build_trainer, DataParallelOptions, TrainerSetup};
use strata::strategy::Strategy;
use strata::Result;

/// A pipeline's setup, with nothing measured before training (stages balanced by the
/// strategy or by parameters).
fn setup<'a>(
    spec: &'a dyn Fn() -> Result<ModelSpec>,
    strategy: &'a Strategy,
    comm: Option<&'a strata::comm::Comm>,
    micro_batches: usize,
) -> TrainerSetup<'a> {
    TrainerSetup {
        spec,
        engine: EngineConfig::default(),
        strategy,
        comm,
        local_world_size: comm.map_or(1, |c| c.size()),
        data_parallel: DataParallelOptions::default(),
        optimizer: OptimizerConfig::default(),
        rules: &[],
        schedule: LrSchedule::Constant,
        grad_clip: None,
        micro_batches,
        feed: Default::default(),
        first_step: None,
        report_over: None,
    }
}

#[test]
fn measured_units_are_timed_and_weighed_by_their_buffers() {
    let model = ModelConfig::Gpt(GptConfig::new(300, 16, 3, 2, 32));
    let spec = || model.spec();
    let strategy = Strategy::default();
    let (executor, parts) = PipelineExecutor::build(&setup(&spec, &strategy, None, 2), None).unwrap();
    let data = TokenData::new((0..2000).map(|i| (i * 7 % 300) as u32).collect(), "tokens").into();
    let config = LoaderConfig::new(Batching { accumulation: 2, ..Batching::new(16, 4) });
    let step = validation_steps(&data, &config, Some(1), 1).unwrap().remove(0);
    let held = executor.most_held().unwrap();
    assert_eq!(held, [1], "one stage under 1F1B runs each micro-batch's backward before the next forward");
    strata_ext::cpu_memory::track().unwrap();
    let costs = executor.measure_units(parts, &step, &Default::default()).unwrap();
    let whole = model.spec().unwrap();
    assert_eq!(costs.len(), whole.units.len());
    for (k, (cost, unit)) in costs.iter().zip(&whole.units).enumerate() {
        let numel: i64 = unit.params.iter().map(|id| whole.params[id.0].numel()).sum();
        // fp32 parameters, gradients and AdamW's two moments.
        assert_eq!(cost.bytes, numel as u64 * 4 * 4, "unit {k}");
        assert!(cost.seconds > 0.0, "unit {k} was not timed");
        // A unit's forward keeps at least its output: a micro-batch of 2 rows × 16 positions
        // × width 32 in fp32.
        assert!(cost.activation_bytes >= 2 * 16 * 32 * 4, "unit {k} keeps {} bytes", cost.activation_bytes);
    }
    // A budget below the embedding's states alone leaves no split; at the whole model's,
    // any split fits.
    let total: u64 = costs.iter().map(|c| c.bytes).sum();
    // Split in two under 1F1B with 2 micro-batches, the first stage holds both.
    let two = Pipeline { stages: 2, micro_batches: 2, virtual_stages: 1 };
    let held = schedule::most_held(ScheduleKind::OneForwardOneBackward, two).unwrap();
    assert_eq!(held, [2, 1]);
    assert!(partition::balance(&costs, 2, 2, Some(costs[0].bytes - 1), &held).is_err());
    let activations: u64 = costs.iter().map(|c| c.activation_bytes).sum();
    assert_eq!(partition::balance(&costs, 2, 2, Some(total + 2 * activations), &held).unwrap().len(), 2);
    // The least budget any split fits in grows by the activations the stages hold.
    let least_budget = |held: &[u64]| {
        let (mut low, mut high) = (0, total + 2 * activations);
        while low < high {
            let mid = (low + high) / 2;
            if partition::balance(&costs, 2, 2, Some(mid), held).is_ok() {
                high = mid;
            } else {
                low = mid + 1;
            }
        }
        low
    };
    assert!(least_budget(&held) > least_budget(&[0, 0]), "activations count against the budget");
}

/// 2 stages × 2 fsdp shards; 4 micro-batches per step under 1F1B.
#[test]
fn fsdp_in_a_pipeline_gathers_each_unit_once_per_step() {
    assert_all_ok(&run_ranks(4, "shm", "pipeline-fsdp"));
}

/// `auto_accelerate`'s prepared trainer (the ATorch-shaped call) under a pipeline strategy
/// holds this rank's stage and trains as the prepared trainer of one process does.
#[test]
fn a_prepared_trainer_runs_a_pipeline_as_one_process_runs_the_model() {
    assert_all_ok(&run_ranks(2, "shm", "prepared-pipeline"));
}

/// Losses of 3 steps of `auto::prepare`'s trainer for `strategy` over `comm`'s ranks (none:
/// one process), with the first unit of this rank's part.
fn prepared_losses(strategy: &str, comm: Option<&strata::comm::Comm>) -> (Vec<f64>, usize) {
    let model = ModelConfig::Gpt(GptConfig::new(64, 16, 3, 2, 32));
    let build = |b: &mut strata::model::Builder| model.build(b);
    let data = Arc::new(TokenData::new((0..4000).map(|i| (i * 13 % 64) as u32).collect(), "tokens").into());
    let batching = Batching { accumulation: 2, seed: 5, ..Batching::new(16, 8) };
    let mut job = strata::auto::AutoAccelerate::new(&build, data, batching);
    job.comm = comm;
    job.local_world_size = comm.map_or(1, |c| c.size());
    job.grad_clip = Some(0.5);
    let strategy = Strategy::parse(strategy).unwrap();
    let mut prepared = strata::auto::prepare(&job, &strategy, strata::parallel::DEFAULT_BUCKET_BYTES).unwrap();
    let losses = (0..3)
        .map(|_| {
            let step = prepared.loader.next().unwrap().unwrap();
            prepared.trainer.train_step(&step).unwrap().loss
        })
        .collect();
    (losses, prepared.trainer.parts()[0].first_unit)
}

#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var("STRATA_TEST_SCENARIO") else { return };
    let comm = connect();
    if scenario == "prepared-pipeline" {
        let pipeline =
            r#"[["parallel_mode", [[["pipeline", 2]], null]], ["pipeline_parallel", {"balance": "parameters"}]]"#;
        let (staged, first_unit) = prepared_losses(pipeline, Some(&comm));
        // Stage 1 starts past the embedding and the first blocks.
        assert_eq!(first_unit > 0, comm.rank() == 1, "rank {} holds units from {first_unit}", comm.rank());
        let (one, _) = prepared_losses("[]", None);
        for (step, (a, b)) in one.iter().zip(&staged).enumerate() {
            assert!(((a - b) / a).abs() < 1e-5, "step {step}: the pipeline's loss {b}, one process's {a}");
        }
        println!("RANK-OK");
        return;
    }
    assert_eq!(scenario, "pipeline-fsdp");
    let model = ModelConfig::Llama(LlamaConfig::new(64, 16, 4, 2, 32));
    let spec = || model.spec();
    let strategy =
        Strategy::parse(r#"[["parallel_mode", [[["pipeline", 2], ["data", 2]], null]], ["pipeline_parallel", {"balance": "parameters"}], "fsdp"]"#)
            .unwrap();
    let micro_batches = 4;
    let mut trainer = build_trainer(&setup(&spec, &strategy, Some(&comm), micro_batches)).unwrap();
    let logs: Vec<Arc<EventLog>> = trainer
        .parts_mut()
        .iter_mut()
        .map(|part| {
            let log = Arc::new(EventLog::default());
            part.engine.set_event_sink(log.clone());
            log
        })
        .collect();
    let data = TokenData::new((0..4000).map(|i| (i * 13 % 64) as u32).collect(), "tokens").into();
    // The replica group's rank: the data dimension is the second.
    let config = LoaderConfig {
        rank: comm.rank() / 2,
        world: 2,
        ..LoaderConfig::new(Batching { accumulation: micro_batches, ..Batching::new(16, 8) })
    };
    let steps = validation_steps(&data, &config, Some(2), 2).unwrap();
    for step in &steps {
        trainer.train_step(step).unwrap();
        for log in &logs {
            let events = log.take();
            let units: std::collections::BTreeSet<usize> = events
                .iter()
                .filter_map(|e| if let Event::Phase { unit, .. } = e { Some(*unit) } else { None })
                .collect();
            assert!(!units.is_empty(), "every stage's engine ran its units");
            for &u in &units {
                let gathers = events.iter().filter(|e| **e == Event::GatherStarted { unit: u }).count();
                let freed = events.iter().filter(|e| **e == Event::ParamsFreed { unit: u }).count();
                // Gathered for the first forward, freed after the backward that completes
                // the step's gradients: not once per micro-batch.
                assert_eq!((gathers, freed), (1, 1), "unit {u} of this stage over {micro_batches} micro-batches");
            }
        }
    }
    println!("RANK-OK");
}
