//! PatrickStar's face: a seed-format configuration file and the seed's loop train a GPT and
//! a LLaMA with their states placed between device and host, exactly as the plain trainer
//! does with everything on the device; state dictionaries resume a run; bad keys and values
//! are refused in one line; launched as two ranks, the seed's loop trains as one process
//! does on both ranks' batches.

use crate::common::ranks::{assert_all_ok, run_ranks_with};
use std::collections::BTreeMap;
use strata::data::{Batch, Step};
use strata::engine::{with_seed, EngineConfig, Placement as Where};
use strata::model::{self, Builder, GptConfig, LlamaConfig, ModelSpec};
use strata::optim::{LrSchedule, Optimizer};
use strata::parallel::{build_engine, RankLayout};
use strata::patrickstar::{initialize_engine, initialize_engine_within, Budgets, PatrickStarConfig, Resumed};
use strata::strategy::{Method, Strategy};
use strata::train::Trainer;
use tch::{Device, Kind, Tensor};

/// The seed's configuration, as a file would hold it.
const CONFIG: &str = r#"{
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 0.003, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "use_hybrid_adam": true}
    },
    "default_chunk_size": 65536,
    "release_after_init": false,
    "use_cpu_embedding": true
}"#;

fn gpt() -> strata::Result<ModelSpec> {
    let mut b = Builder::new();
    model::gpt(&GptConfig::new(64, 16, 3, 2, 32), &mut b)?;
    b.build()
}

fn llama() -> strata::Result<ModelSpec> {
    let mut b = Builder::new();
    model::llama(&LlamaConfig::new(64, 16, 3, 2, 32), &mut b)?;
    b.build()
}

/// Two sequences counting up by three from random starts (a pattern the model learns).
fn batch(index: usize) -> Batch {
    let starts = with_seed(500 + index as i64, || Tensor::randint(64, [2, 1], (Kind::Int64, Device::Cpu)));
    let tokens = (starts + Tensor::arange(17, (Kind::Int64, Device::Cpu)) * 3).remainder(64);
    Batch::new(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16)).unwrap()
}

fn step(index: usize) -> Step {
    Step::new(index, vec![batch(index)])
}

fn config() -> PatrickStarConfig {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, CONFIG).unwrap();
    PatrickStarConfig::from_file(&path).unwrap()
}

/// The plain trainer's losses for the same model, optimizer and batches, all on the device.
fn reference(model: fn() -> strata::Result<ModelSpec>, steps: usize) -> Vec<f64> {
    let c = config();
    let mut engine =
        build_engine(model().unwrap(), EngineConfig::default(), &Strategy::default(), &RankLayout::single()).unwrap();
    let optimizer = Optimizer::new(&mut engine, c.optimizer_config().unwrap(), &[]).unwrap();
    let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, None);
    (0..steps).map(|i| trainer.train_step(&step(i)).unwrap().loss).collect()
}

#[test]
fn the_seeds_loop_trains_a_gpt_and_a_llama_as_the_plain_trainer_does() {
    for (name, model) in [("gpt", gpt as fn() -> strata::Result<ModelSpec>), ("llama", llama)] {
        let expected = reference(model, 12);
        assert!(expected[11] < expected[0] - 0.1, "{name} learns: {expected:?}");
        let states = model().unwrap().num_params() as u64 * 16;
        let budgets = Budgets { device: Some(states / 2), host: None, sample: &step(0) };
        let (mut model, mut optimizer) = initialize_engine_within(model, 0, &config(), budgets).unwrap();
        for (i, expected) in expected.iter().enumerate() {
            optimizer.zero_grad().unwrap();
            let loss = model.forward(&batch(i)).unwrap();
            model.backward(&loss).unwrap();
            optimizer.step().unwrap();
            let loss = loss.double_value(&[]);
            assert!((loss - expected).abs() <= 1e-6, "{name} step {i}: {loss} against {expected}");
        }
        let report = model.with_engine(|e| e.ledger().report());
        assert!(report[&Where::Device].peak <= states / 2, "{name}: {report:?}");
        assert!(report[&Where::Host].current > 0, "{name}: the embedding and more live on the host");
    }
}

#[test]
fn state_dicts_resume_the_run() {
    let expected = reference(gpt, 6);
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let first = seed_loop(&mut model, &mut optimizer, 3, batch);
    let (weights, states): (BTreeMap<String, Tensor>, BTreeMap<String, Tensor>) =
        (model.state_dict().unwrap(), optimizer.state_dict().unwrap());
    assert!(weights.contains_key("transformer.wte.weight") && states.contains_key("step"));
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    model.load_state_dict(&weights).unwrap();
    optimizer.load_state_dict(&states).unwrap();
    let rest = seed_loop(&mut model, &mut optimizer, 3, |i| batch(3 + i));
    let all: Vec<f64> = first.into_iter().chain(rest).collect();
    for (i, (got, want)) in all.iter().zip(&expected).enumerate() {
        assert!((got - want).abs() <= 1e-6, "step {i}: {got} against {want}");
    }
    let mut bad = weights;
    bad.insert("transformer.nope".into(), Tensor::zeros([1], (Kind::Float, Device::Cpu)));
    assert!(model.load_state_dict(&bad).unwrap_err().to_string().contains("names no parameter"));
}

#[test]
fn the_configuration_maps_to_strategies_and_bad_keys_are_one_line() {
    let spec = gpt().unwrap();
    let strategy = config().strategy(&spec, 1).unwrap();
    let Method::Offload(offload) = &strategy.methods[0] else { panic!("{strategy:?}") };
    assert_eq!(offload.host_units, ["embedding"], "use_cpu_embedding keeps the embedding on the host");
    let fp16 = PatrickStarConfig::parse(r#"{"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 8}}"#)
        .unwrap()
        .strategy(&spec, 1)
        .unwrap();
    assert_eq!(fp16.grad_scaling().unwrap().scaler.map(|s| s.scale), Some(256.0));
    let ranks = config().strategy(&spec, 2).unwrap();
    assert!(ranks.sharding().is_some() && ranks.offload().is_some(), "{ranks:?}");
    for (text, expected) in [
        (r#"{"zero_optimization": {}}"#, "unknown field `zero_optimization`"),
        (r#"{"optimizer": {"type": "SGD"}}"#, "expected Adam or AdamW"),
        (r#"{"optimizer": {"params": {"lr": -1}}}"#, "learning rate"),
        (r#"{"fp16": {"enabled": false}}"#, "fp16.enabled must be true"),
        (r#"{"release_after_init": 1}"#, "release_after_init: invalid type"),
        (r#"{"optimizer": {"params": {"lr": "fast"}}}"#, "optimizer.params.lr: invalid type"),
        (r#"{"fp16": {"enabled": true, "hysteresis": 2, "window": 3}}"#, "unknown field `window`"),
        (r#"{"default_chunk_size": 0}"#, "default_chunk_size must be positive"),
        ("not json", "PatrickStar config"),
    ] {
        let err = PatrickStarConfig::parse(text).unwrap_err().to_string();
        assert!(err.contains(expected) && !err.contains('\n'), "{text}: {err}");
    }
    let small = PatrickStarConfig::parse(r#"{"default_chunk_size": 100}"#).unwrap().strategy(&spec, 1);
    assert!(small.unwrap_err().to_string().contains("smaller than the largest parameter"));
}

/// Strata's checkpoints through PatrickStar's face, the states offloaded by the hybrid Adam:
/// saved after every step in the background, the loop ends bit-identical to one without
/// them; a loop started afresh after a stop past step 3's save resumes from host memory and ends
/// bit-identical too; once the snapshot is removed (a clean end) the disk's checkpoint
/// serves; a synchronous save resumes alike.
#[test]
fn checkpoints_persist_in_the_background_and_resume_from_memory_or_disk() {
    let identical = |a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>| {
        a.len() == b.len() && a.iter().all(|(name, t)| b.get(name).is_some_and(|u| t.equal(u)))
    };
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let expected = seed_loop(&mut model, &mut optimizer, 6, batch);
    let weights = model.state_dict().unwrap();
    // Saving after each of `steps` steps from step `from` on.
    let saving = |model: &mut strata::patrickstar::PatrickStarEngine,
                  optimizer: &mut strata::patrickstar::PatrickStarOptimizer,
                  checkpoints: &mut strata::patrickstar::PatrickStarCheckpoints,
                  (from, steps): (usize, usize)| {
        (from..from + steps)
            .map(|i| {
                let loss = seed_loop(model, optimizer, 1, |_| batch(i))[0];
                let times = model.save_checkpoint(checkpoints).unwrap();
                assert!(times.blocked_s > 0.0);
                loss
            })
            .collect::<Vec<f64>>()
    };
    let dir = tempfile::tempdir().unwrap();
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let mut checkpoints = model.checkpoints(dir.path(), 0, true).unwrap();
    assert_eq!(model.resume(&checkpoints).unwrap(), None, "nothing to resume yet");
    let losses = saving(&mut model, &mut optimizer, &mut checkpoints, (0, 6));
    assert_eq!(losses, expected, "saving changes no loss");
    assert!(identical(&model.state_dict().unwrap(), &weights), "saving changes no weight");
    model.close_checkpoints(checkpoints).unwrap();

    // Stopped during step 5, step 3's save on disk and its snapshot left in memory.
    let dir = tempfile::tempdir().unwrap();
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let mut checkpoints = model.checkpoints(dir.path(), 0, true).unwrap();
    saving(&mut model, &mut optimizer, &mut checkpoints, (0, 3));
    seed_loop(&mut model, &mut optimizer, 1, |_| batch(3));
    assert!(model.wait_checkpoints(&mut checkpoints).unwrap().is_some(), "step 3's save was persisting");
    drop((model, optimizer, checkpoints));
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let mut checkpoints = model.checkpoints(dir.path(), 0, true).unwrap();
    let resumed = model.resume(&checkpoints).unwrap();
    assert_eq!(resumed, Some(Resumed { step: 3, from: "host memory" }));
    let rest = saving(&mut model, &mut optimizer, &mut checkpoints, (3, 3));
    assert_eq!(rest, expected[3..], "the resumed loop's losses");
    assert!(identical(&model.state_dict().unwrap(), &weights), "resumed from memory");
    model.close_checkpoints(checkpoints).unwrap();
    let (mut model, _optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let checkpoints = model.checkpoints(dir.path(), 0, true).unwrap();
    assert_eq!(model.resume(&checkpoints).unwrap(), Some(Resumed { step: 6, from: "disk" }));
    assert!(identical(&model.state_dict().unwrap(), &weights), "resumed from disk");
    model.close_checkpoints(checkpoints).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let mut checkpoints = model.checkpoints(dir.path(), 1, false).unwrap();
    saving(&mut model, &mut optimizer, &mut checkpoints, (0, 2));
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let mut checkpoints = model.checkpoints(dir.path(), 1, false).unwrap();
    assert_eq!(model.resume(&checkpoints).unwrap(), Some(Resumed { step: 2, from: "disk" }));
    assert_eq!(saving(&mut model, &mut optimizer, &mut checkpoints, (2, 4)), expected[2..]);
    assert!(identical(&model.state_dict().unwrap(), &weights), "resumed from a synchronous save");
}

/// The losses of `steps` steps of the seed's loop, on batch `batch_of(step)`.
fn seed_loop(
    model: &mut strata::patrickstar::PatrickStarEngine,
    optimizer: &mut strata::patrickstar::PatrickStarOptimizer,
    steps: usize,
    batch_of: impl Fn(usize) -> Batch,
) -> Vec<f64> {
    (0..steps)
        .map(|i| {
            optimizer.zero_grad().unwrap();
            let loss = model.forward(&batch_of(i)).unwrap();
            model.backward(&loss).unwrap();
            optimizer.step().unwrap();
            loss.double_value(&[])
        })
        .collect()
}

/// Rank `rank`'s half of batch `index` (one of its two sequences).
fn half_batch(index: usize, rank: usize) -> Batch {
    let b = batch(index);
    Batch::new(b.inputs.narrow(0, rank as i64, 1), b.targets.narrow(0, rank as i64, 1)).unwrap()
}

/// One of two ranks started by [`two_ranks_train_as_one_process_on_both_batches`]: it joins
/// the job from the launcher's variables and prints its losses.
#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var("STRATA_TEST_SCENARIO") else { return };
    assert_eq!(scenario, "patrickstar");
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let root = std::path::PathBuf::from(std::env::var("STRATA_TEST_CHECKPOINTS").unwrap());
    let mut checkpoints = model.checkpoints(&root, 0, true).unwrap();
    let mut losses = seed_loop(&mut model, &mut optimizer, 2, |i| half_batch(i, rank));
    model.save_checkpoint(&mut checkpoints).unwrap();
    losses.extend(seed_loop(&mut model, &mut optimizer, 2, |i| half_batch(2 + i, rank)));
    model.close_checkpoints(checkpoints).unwrap();
    println!("LOSSES {}", serde_json::to_string(&losses).unwrap());
    println!("RANK-OK");
}

/// Launched as two ranks on one host (`RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, the store
/// at `MASTER_ADDR:MASTER_PORT`), `initialize_engine` joins the job, and each step's mean
/// loss over the ranks is the loss one process computes on both ranks' sequences. The
/// checkpoint both ranks save in the background after step 2 resumes in one process at the
/// weights one process reaches.
#[test]
fn two_ranks_train_as_one_process_on_both_batches() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let port: &'static str = Box::leak(port.to_string().into_boxed_str());
    let dir = tempfile::tempdir().unwrap();
    let root: &'static str = Box::leak(dir.path().to_str().unwrap().to_string().into_boxed_str());
    let vars = move |_| {
        let place = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port), ("LOCAL_WORLD_SIZE", "2")];
        [&place[..], &[("STRATA_TEST_CHECKPOINTS", root)]].concat()
    };
    let outputs = run_ranks_with(2, "shm", "patrickstar", vars);
    assert_all_ok(&outputs);
    let losses: Vec<Vec<f64>> = outputs
        .iter()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout);
            let line = text.lines().find_map(|l| l.split_once("LOSSES ").map(|(_, r)| r)).expect(&text);
            serde_json::from_str(line).unwrap()
        })
        .collect();
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    let whole = seed_loop(&mut model, &mut optimizer, 4, batch);
    for (i, want) in whole.iter().enumerate() {
        let got = (losses[0][i] + losses[1][i]) / 2.0;
        assert!((got - want).abs() <= 1e-5, "step {i}: the ranks' mean {got} against {want}");
    }
    assert!(losses[0] != losses[1], "each rank trained on its own sequence");
    let (mut model, mut optimizer) = initialize_engine(gpt, 0, &config()).unwrap();
    seed_loop(&mut model, &mut optimizer, 2, batch);
    let (mut resumed, _) = initialize_engine(gpt, 0, &config()).unwrap();
    let checkpoints = resumed.checkpoints(dir.path(), 0, true).unwrap();
    assert_eq!(resumed.resume(&checkpoints).unwrap(), Some(Resumed { step: 2, from: "disk" }));
    let (theirs, ours) = (resumed.state_dict().unwrap(), model.state_dict().unwrap());
    for (name, t) in &ours {
        let gap = (t - &theirs[name]).abs().max().double_value(&[]);
        assert!(gap <= 1e-5, "{name}: resumed {gap:e} from one process's");
    }
    resumed.close_checkpoints(checkpoints).unwrap();
}
