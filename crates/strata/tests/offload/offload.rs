//! Offload: model states placed between device and host train exactly as when every state
//! stays on the device, within the device and host budgets, moving the bytes the plan says.

use crate::common::tied_gpt::{model_state_bytes, spec, step, trainer, trainer_of};
use std::sync::Arc;
use strata::engine::offload::{Offload, OffloadOptions};
use strata::engine::placement::{Home, HomePolicy};
use strata::engine::{EngineConfig, Event, EventLog, Placement as Where};
use strata::model::{self, Builder, LlamaConfig, ModelSpec};
use strata::parallel::{build_engine, measure_non_model, RankLayout};
use strata::profile::{Profiler, Record, SpanKind};
use strata::strategy::{Method, Strategy};
use strata::train::{Feed, StepReport, Trainer};
use tch::Tensor;

/// `steps` steps of `strategy` under `budget` bytes of device, with the room beside model
/// states measured on the first step; the reports.
fn train(strategy: &str, budget: Option<u64>, steps: usize) -> Vec<StepReport> {
    let mut trainer = trainer_within(spec, strategy, budget);
    (0..steps).map(|i| trainer.train_step(&step(i)).unwrap()).collect()
}

/// A trainer of the model `spec` makes under `strategy` and `budget` bytes of device, with
/// the room beside model states measured on the first step.
fn trainer_within(spec: fn() -> ModelSpec, strategy: &str, budget: Option<u64>) -> Trainer {
    let config = EngineConfig { device_budget: budget, ..EngineConfig::default() };
    let mut at = RankLayout::single();
    let strategy = Strategy::parse(strategy).unwrap();
    if strategy.offload().is_some() {
        at.non_model =
            Some(measure_non_model(spec(), config.clone(), &strategy, &at, &step(0), &Feed::default()).unwrap());
    }
    trainer_of(spec(), &strategy, &config, &at).unwrap()
}

const OPTIMIZER_ONLY: &str = r#"[["offload", {"params": "none", "optimizer": "cpu", "policy": "static"}]]"#;
const FULL: &str = r#"[["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]]"#;
const AUTO: &str = r#"["offload"]"#;

#[test]
fn offloaded_runs_give_the_losses_of_the_run_that_keeps_everything_on_the_device() {
    let reference: Vec<f64> = train("[]", None, 20).iter().map(|r| r.loss).collect();
    assert!(reference[19] < reference[0] - 0.05, "the model learns: {reference:?}");
    let budget = model_state_bytes() * 4 / 10;
    // With only the optimizer on the host the device keeps parameters and gradients, half
    // of the model states: it trains under 60% of them, not 40%.
    let optimizer_budget = model_state_bytes() * 6 / 10;
    for (strategy, budget) in [
        (OPTIMIZER_ONLY, None),
        (OPTIMIZER_ONLY, Some(optimizer_budget)),
        (FULL, None),
        (FULL, Some(budget)),
        (AUTO, Some(budget)),
    ] {
        let reports = train(strategy, budget, 20);
        for (i, (r, expected)) in reports.iter().zip(&reference).enumerate() {
            assert!((r.loss - expected).abs() <= 1e-6, "{strategy} step {i}: {} against {expected}", r.loss);
            let peak = r.memory[&Where::Device].peak;
            assert!(budget.is_none_or(|b| peak <= b), "{strategy} step {i}: device peak {peak} over {budget:?}");
        }
        let host = &reports[19].memory[&Where::Host];
        assert!(host.current > 0, "{strategy}: states live on the host: {host:?}");
        assert_eq!(host.pinned, 0, "{strategy}: nothing is page-locked without a GPU");
    }
}

/// A LLaMA: its head has a weight of its own, so no other unit reads the embedding's.
fn llama() -> ModelSpec {
    let mut b = Builder::new();
    model::llama(&LlamaConfig::new(64, 16, 4, 2, 32), &mut b).unwrap();
    b.build().unwrap()
}

#[test]
fn an_embedding_kept_on_the_host_computes_there_and_its_states_never_move() {
    let mut plain = trainer_within(llama, "[]", None);
    let reference: Vec<f64> = (0..8).map(|i| plain.train_step(&step(i)).unwrap().loss).collect();
    assert!(reference[7] < reference[0] - 0.05, "the model learns: {reference:?}");
    let budget = llama().num_params() as u64 * 16 * 4 / 10;
    let full =
        r#"[["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static", "host_units": ["embedding"]}]]"#;
    let auto = r#"[["offload", {"host_units": ["embedding"]}]]"#;
    for strategy in [full, auto] {
        let mut trainer = trainer_within(llama, strategy, Some(budget));
        let log = Arc::new(EventLog::default());
        trainer.engine_mut().set_event_sink(log.clone());
        for (i, want) in reference.iter().enumerate() {
            let r = trainer.train_step(&step(i)).unwrap();
            assert!((r.loss - want).abs() <= 1e-6, "{strategy} step {i}: {} against {want}", r.loss);
            let peak = r.memory[&Where::Device].peak;
            assert!(peak <= budget, "{strategy} step {i}: device peak {peak} over {budget}");
        }
        let (mut moved, mut embedding_moved) = (0, 0);
        for event in log.take() {
            if let Event::Copied { unit, .. } | Event::Evicted { unit } = event {
                moved += 1;
                embedding_moved += usize::from(unit == 0);
            }
        }
        assert_eq!(embedding_moved, 0, "{strategy}: the embedding's parameters and gradient stay on the host");
        assert!(moved > 0, "{strategy}: the other units on the host move");
    }
    // Without clipping a host update starts as soon as its unit's gradient is complete: with
    // no budget only the embedding lives on the host, and its update runs during backward.
    let unclipped = |strategy: &str| -> Vec<StepReport> {
        let mut trainer = trainer_within(llama, strategy, None);
        trainer.grad_clip = None;
        (0..4).map(|i| trainer.train_step(&step(i)).unwrap()).collect()
    };
    let (plain, offloaded) = (unclipped("[]"), unclipped(auto));
    for (i, (got, want)) in offloaded.iter().zip(&plain).enumerate() {
        assert!((got.loss - want.loss).abs() <= 1e-6, "step {i}: {} against {}", got.loss, want.loss);
        assert_eq!(got.transfers.updated_during_backward, 1, "step {i}: the embedding's update");
        assert_eq!(got.transfers.to_device + got.transfers.to_host, 0, "step {i}: nothing moves");
    }
}

/// `auto` beside a ZeRO stage under a budget needs the step's floor, which
/// `RankLayout::with_room_measured` measures; an engine built without it is refused.
#[test]
fn auto_beside_a_zero_stage_under_a_budget_is_refused_without_the_measured_floor() {
    let strategy = r#"["zero2", ["offload", {"params": "none", "optimizer": "auto", "policy": "auto"}]]"#;
    let strategy = Strategy::parse(strategy).unwrap();
    let config = EngineConfig { device_budget: Some(model_state_bytes()), ..EngineConfig::default() };
    let err = build_engine(spec(), config.clone(), &strategy, &RankLayout::single()).err().expect("refused");
    assert!(err.to_string().contains("needs the step's floor"), "{err}");
    let at = RankLayout::single().with_room_measured(spec(), &config, &strategy, &step(0), &Feed::default()).unwrap();
    assert!(at.shard_floor.is_some_and(|f| f > 0), "measured: {:?}", at.shard_floor);
    build_engine(spec(), config, &strategy, &at).unwrap();
}

#[test]
fn copies_split_into_slots_of_any_size_train_alike_within_the_budget() {
    let reference: Vec<f64> = train("[]", None, 6).iter().map(|r| r.loss).collect();
    let budget = model_state_bytes() * 4 / 10;
    let page = strata::engine::slots::granularity();
    // One page splits every block's parameters (13 KiB) and the embedding's into pieces;
    // four pages hold a block in one slot with a quarter of it wasted.
    for slot_bytes in [Some(page), Some(4 * page), None] {
        let strategy = format!(
            r#"[["offload", {{"params": "cpu", "optimizer": "cpu", "policy": "static", "slot_bytes": {}}}]]"#,
            slot_bytes.map_or("null".to_string(), |b| b.to_string())
        );
        let reports = train(&strategy, Some(budget), 6);
        for (i, (r, want)) in reports.iter().zip(&reference).enumerate() {
            assert!((r.loss - want).abs() <= 1e-6, "{strategy} step {i}: {} against {want}", r.loss);
            let device = &r.memory[&Where::Device];
            assert!(device.peak <= budget, "{strategy}: device peak {} over {budget}", device.peak);
        }
    }
}

#[test]
fn the_device_stays_within_its_budget_and_a_run_without_offload_is_refused_when_built() {
    let budget = model_state_bytes() * 4 / 10;
    for strategy in [FULL, AUTO] {
        for r in train(strategy, Some(budget), 3) {
            let device = &r.memory[&Where::Device];
            assert!(device.peak <= budget, "{strategy}: device peak {} over {budget}", device.peak);
            assert!(device.peak > budget / 4, "{strategy}: the device is used: {}", device.peak);
        }
    }
    let config = EngineConfig { device_budget: Some(budget), ..EngineConfig::default() };
    let err = trainer(&Strategy::default(), &config, &RankLayout::single()).err().expect("refused").to_string();
    assert!(err.contains("out of memory on device"), "{err}");
    // Where the states fit but not beside what a step holds, the room measured on one step
    // refuses the run too.
    let plain = Strategy::default();
    let room =
        measure_non_model(spec(), EngineConfig::default(), &plain, &RankLayout::single(), &step(0), &Feed::default())
            .unwrap();
    let budget = model_state_bytes() + room.iter().max().unwrap() / 2;
    let config = EngineConfig { device_budget: Some(budget), ..EngineConfig::default() };
    assert!(trainer(&plain, &config, &RankLayout::single()).is_ok(), "the states alone fit");
    let at = RankLayout::single().with_room_measured(spec(), &config, &plain, &step(0), &Feed::default()).unwrap();
    assert_eq!(at.non_model, Some(room));
    let err = trainer(&plain, &config, &at).err().expect("refused").to_string();
    assert!(err.contains("do not fit") && err.contains("offload"), "{err}");
}

#[test]
fn auto_keeps_on_the_device_what_fits_and_moves_only_the_rest() {
    let config = EngineConfig { device_budget: None, ..EngineConfig::default() };
    let options = |policy| OffloadOptions {
        policy,
        optimizer_bytes_per_element: 8,
        prefetch: 0,
        pin_memory: false,
        non_model: None,
        on_host: vec![],
        slot_bytes: None,
        delayed_update: false,
    };
    let auto = HomePolicy::Auto { params_may_leave: true };
    let unlimited = Offload::plan_for(&spec(), &config, &options(auto.clone())).unwrap();
    assert!(unlimited.homes.iter().all(|&h| h == Home::Device));
    assert_eq!(unlimited.traffic.total(), 0, "nothing moves when everything fits");
    let tight = EngineConfig { device_budget: Some(model_state_bytes() * 4 / 10), ..config };
    let planned = Offload::plan_for(&spec(), &tight, &options(auto)).unwrap();
    let full =
        Offload::plan_for(&spec(), &tight, &options(HomePolicy::Static { params: 1.0, optimizer: 1.0 })).unwrap();
    assert!(planned.homes.contains(&Home::Device), "{:?}", planned.homes);
    assert!(planned.traffic.total() < full.traffic.total(), "{:?} against {:?}", planned.traffic, full.traffic);
}

#[test]
fn bytes_moved_per_step_are_those_the_plan_computed_and_the_ledger_counts_what_buffers_hold() {
    let budget = model_state_bytes() * 4 / 10;
    let config = EngineConfig { device_budget: Some(budget), ..EngineConfig::default() };
    // One micro-batch a step: every step starts with no copy on the device.
    let single = |i: usize| {
        let mut s = step(i);
        s.micro_batches.truncate(1);
        s
    };
    for (strategy, prefetch) in [(AUTO, 2), (FULL, 2), (FULL, 0), (OPTIMIZER_ONLY, 2)] {
        let mut parsed = Strategy::parse(strategy).unwrap();
        for method in &mut parsed.methods {
            if let Method::Offload(c) = method {
                c.prefetch = prefetch;
            }
        }
        let mut at = RankLayout::single();
        let non_model = measure_non_model(spec(), config.clone(), &parsed, &at, &single(0), &Feed::default()).unwrap();
        at.non_model = Some(non_model.clone());
        let options = OffloadOptions {
            policy: parsed.offload().unwrap().home_policy().unwrap(),
            optimizer_bytes_per_element: 8,
            prefetch,
            pin_memory: false,
            non_model: Some(non_model),
            on_host: vec![],
            slot_bytes: None,
            delayed_update: false,
        };
        let plan = Offload::plan_for(&spec(), &config, &options).unwrap();
        let mut trainer = trainer(&parsed, &config, &at).unwrap();
        let log = Arc::new(EventLog::default());
        trainer.engine_mut().set_event_sink(log.clone());
        for i in 0..3 {
            let before = trainer.engine().ledger().transfers();
            trainer.train_step(&single(i)).unwrap();
            let after = trainer.engine().ledger().transfers();
            assert_eq!(after.to_host - before.to_host, plan.traffic.to_host, "{strategy} prefetch {prefetch} step {i}");
            assert_eq!(
                after.to_device - before.to_device,
                plan.traffic.to_device,
                "{strategy} prefetch {prefetch} step {i}"
            );
        }
        assert!(plan.traffic.to_device > 0, "{strategy}");
        let mut phases = 0;
        for event in log.take() {
            if let Event::Phase { phase, unit, ledger_bytes, storage_bytes } = event {
                assert_eq!(ledger_bytes, storage_bytes, "{strategy}: {phase:?} of unit {unit}");
                phases += 1;
            }
        }
        assert_eq!(phases, 3 * 4 * spec().units.len(), "{strategy}");
    }
}

#[test]
fn offload_composes_with_recomputation_and_mixed_precision() {
    let budget = Some(model_state_bytes() * 4 / 10);
    // fp16 with a dynamic loss scale from 2^24: its first steps overflow and are skipped,
    // which must leave the host's masters and moments as the device's.
    let scaled = r#"["amp_native", {"loss_scaler": {"initial_scale_power": 24, "loss_scale_window": 3}}]"#;
    // Within 1e-6: the tied embedding's gradient from two micro-batches is summed on the
    // host in another order than on the device. Under `half` that sum is rounded to bf16
    // (8 bits), so the order moves the loss by a few 1e-5 within 8 steps: 2e-4.
    let half = r#"["half", "bf16"]"#;
    for methods in [r#"["checkpoint", ["GptBlock"]]"#, r#"["amp_native", {"dtype": "bf16"}]"#, scaled, half] {
        let bound = if methods == half { 2e-4 } else { 1e-6 };
        let plain = train(&format!("[{methods}]"), None, 8);
        for offload in [FULL, AUTO] {
            let strategy = format!("[{methods}, {}]", &offload[1..offload.len() - 1]);
            let reports = train(&strategy, budget, 8);
            for (i, (got, want)) in reports.iter().zip(&plain).enumerate() {
                assert!(
                    (got.loss - want.loss).abs() <= bound,
                    "{strategy} step {i}: {} against {}",
                    got.loss,
                    want.loss
                );
                assert_eq!(got.skipped, want.skipped, "{strategy} step {i}");
            }
            let skipped = reports.iter().filter(|r| r.skipped).count();
            assert_eq!(skipped > 0, methods == scaled, "{strategy}: {skipped} steps skipped");
        }
    }
}

#[test]
fn host_updates_start_during_backward_where_nothing_can_stop_them_and_change_nothing() {
    let budget = Some(model_state_bytes() * 4 / 10);
    let run = |strategy: &str, budget: Option<u64>| -> Vec<StepReport> {
        let config = EngineConfig { device_budget: budget, ..EngineConfig::default() };
        let strategy = Strategy::parse(strategy).unwrap();
        let mut at = RankLayout::single();
        if strategy.offload().is_some() {
            at.non_model =
                Some(measure_non_model(spec(), config.clone(), &strategy, &at, &step(0), &Feed::default()).unwrap());
        }
        let mut trainer = trainer(&strategy, &config, &at).unwrap();
        // No clipping and no loss scaling: an update cannot be called off once it is due.
        trainer.grad_clip = None;
        (0..10).map(|i| trainer.train_step(&step(i)).unwrap()).collect()
    };
    let reference: Vec<f64> = run("[]", None).iter().map(|r| r.loss).collect();
    for strategy in [FULL, AUTO, OPTIMIZER_ONLY] {
        let reports = run(strategy, if strategy == OPTIMIZER_ONLY { None } else { budget });
        for (i, (r, want)) in reports.iter().zip(&reference).enumerate() {
            assert!((r.loss - want).abs() <= 1e-6, "{strategy} step {i}: {} against {want}", r.loss);
        }
        assert!(
            reports.iter().all(|r| r.transfers.updated_during_backward > 0 && r.transfers.host_update_s > 0.0),
            "{strategy}: the host updated during backward, and its seconds are counted"
        );
    }
}

/// Losses of `steps` steps where each step's gradient is computed at the parameters from
/// before the previous step's update (the first at the initial ones), and each update is
/// clipped and applied as the trainer does: a delayed update's trajectory, built from a
/// plain engine that computes gradients and a plain trainer's optimizer that applies them;
/// and that trainer, holding the parameters after the last update.
fn one_step_stale_losses(steps: usize, grad_clip: f64) -> (Vec<f64>, Trainer) {
    let config = EngineConfig::default();
    let plain = Strategy::default();
    let mut master = trainer(&plain, &config, &RankLayout::single()).unwrap();
    let mut stale_engine = build_engine(spec(), config, &plain, &RankLayout::single()).unwrap();
    let flats = |t: &Trainer| -> Vec<Tensor> { t.engine().storage().iter().map(|s| s.flat.copy()).collect() };
    let mut stale = flats(&master);
    let loss_of = strata::train::next_token_loss();
    let mut losses = vec![];
    for i in 0..steps {
        let s = step(i);
        tch::no_grad(|| {
            for (unit, values) in stale_engine.storage().iter().zip(&stale) {
                unit.flat.shallow_clone().copy_(values);
            }
        });
        stale_engine.zero_grad().unwrap();
        let mut total = 0.0;
        for batch in &s.micro_batches {
            let output = stale_engine.forward(&batch.inputs).unwrap();
            let loss = loss_of(&output, batch).unwrap();
            stale_engine.backward(&(&loss / s.micro_batches.len() as f64)).unwrap();
            total += loss.double_value(&[]);
        }
        losses.push(total / s.micro_batches.len() as f64);
        let before = flats(&master);
        tch::no_grad(|| {
            for (to, from) in master.engine().storage().iter().zip(stale_engine.storage()) {
                to.grad.shallow_clone().copy_(&from.grad);
            }
        });
        master.optimizer_mut().clip_grad_norm(grad_clip).unwrap();
        master.optimizer_mut().step().unwrap();
        stale = before;
    }
    (losses, master)
}

#[test]
fn delayed_updates_compute_each_step_at_the_parameters_before_the_last_update() {
    let delayed =
        r#"[["offload", {"params": "none", "optimizer": "cpu", "policy": "static", "delayed_update": true}]]"#;
    let mut delayed_run =
        trainer(&Strategy::parse(delayed).unwrap(), &EngineConfig::default(), &RankLayout::single()).unwrap();
    let reports: Vec<StepReport> = (0..8).map(|i| delayed_run.train_step(&step(i)).unwrap()).collect();
    let (expected, mut master) = one_step_stale_losses(8, 0.5);
    let current: Vec<f64> = train("[]", None, 8).iter().map(|r| r.loss).collect();
    for (i, (r, want)) in reports.iter().zip(&expected).enumerate() {
        assert!((r.loss - want).abs() <= 1e-6, "step {i}: {} against {want}", r.loss);
        // The first two steps compute at the initial parameters; later ones lag behind.
        if i >= 2 {
            assert!((r.loss - current[i]).abs() > 1e-4, "step {i} lags: {} against {}", r.loss, current[i]);
        }
    }
    assert!(reports.iter().skip(1).all(|r| r.transfers.updated_during_backward > 0), "updates ran during steps");
    // Evaluation waits for the last update and sees its parameters.
    let held_out = [step(100)];
    let (got, want) = (delayed_run.evaluate(&held_out).unwrap(), master.evaluate(&held_out).unwrap());
    assert!((got - want).abs() <= 1e-6, "evaluated {got} against {want}");
    // A configuration whose parameters live on the host cannot leave them behind.
    let config = EngineConfig::default();
    let on_host = r#"[["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static", "delayed_update": true}]]"#;
    let err = trainer(&Strategy::parse(on_host).unwrap(), &config, &RankLayout::single()).err().expect("refused");
    assert!(err.to_string().contains("delayed_update"), "{err}");
}

#[test]
fn a_profile_of_an_offloaded_run_records_every_copy_the_ledger_counts() {
    let budget = model_state_bytes() * 4 / 10;
    let config = EngineConfig { device_budget: Some(budget), ..EngineConfig::default() };
    let strategy = Strategy::parse(FULL).unwrap();
    let at = RankLayout {
        non_model: Some(
            measure_non_model(spec(), config.clone(), &strategy, &RankLayout::single(), &step(0), &Feed::default())
                .unwrap(),
        ),
        ..RankLayout::single()
    };
    let mut trainer = trainer(&strategy, &config, &at).unwrap();
    let profiler = Profiler::start(trainer.engine_mut(), 0, 1);
    for i in 0..3 {
        trainer.train_step(&step(i)).unwrap();
    }
    profiler.end();
    let dir = tempfile::tempdir().unwrap();
    let path = Profiler::rank_file(dir.path(), 0);
    profiler.save(&path).unwrap();
    let profile = strata::profile::read(&path).unwrap();
    let copied = |to: Where| -> u64 {
        profile
            .records
            .iter()
            .map(|r| match r {
                Record::Copy { to: t, bytes, .. } if *t == to => *bytes,
                _ => 0,
            })
            .sum()
    };
    let moved = trainer.engine().ledger().transfers();
    assert_eq!((copied(Where::Device), copied(Where::Host)), (moved.to_device, moved.to_host));
    assert!(profile.records.iter().any(|r| matches!(r, Record::Evict { .. })));
    // A gradient's copy to the host is made on the engine's thread, which waits for it: each
    // is recorded as a copy-wait of its unit just before the copy itself.
    let to_host: Vec<usize> = profile
        .records
        .iter()
        .enumerate()
        .filter(|(_, r)| matches!(r, Record::Copy { to: Where::Host, .. }))
        .map(|(i, _)| i)
        .collect();
    assert!(!to_host.is_empty());
    for i in to_host {
        let (Record::Copy { unit, .. }, Record::CopyWait { unit: waited, .. }) =
            (&profile.records[i], &profile.records[i - 1])
        else {
            panic!("no copy-wait before {:?}", profile.records[i]);
        };
        assert_eq!(unit, waited);
    }
    // Prefetched copies start in the moment of a unit that does not read them.
    let reads = spec().units_read();
    let prefetched = profile
        .records
        .iter()
        .enumerate()
        .filter(|(i, r)| {
            let Record::Copy { to: Where::Device, unit, .. } = r else { return false };
            let next = profile.records[i + 1..].iter().find_map(|r| match r {
                Record::Phase { unit, .. } => Some(*unit),
                _ => None,
            });
            next.is_some_and(|k| !reads[k].contains(unit))
        })
        .count();
    assert!(prefetched > 0, "copies are started ahead of the moments that read them");
    let units = spec().units.len();
    let spans = profile.spans();
    assert_eq!(spans.iter().filter(|s| matches!(s.kind, SpanKind::Forward(_))).count(), 3 * 2 * units);
    assert_eq!(spans.iter().filter(|s| s.kind == SpanKind::Update).count(), 3);
}
