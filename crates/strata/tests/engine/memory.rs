//! Memory as the allocator sees it, against the ledger, for every strategy on two ranks
//! (threads with a TCP mesh of their own): at every phase of every unit the ledger's
//! parameter and gradient bytes equal what the storages of those buffers hold; FULL_SHARD
//! frees what it gathered; and FSDP's prefetch options order the gathers as documented.
use std::sync::Arc;
use std::time::Duration;
use strata::comm::{Comm, Store, StoreServer};
use strata::data::{Batch, Step};
use strata::engine::{with_seed, Category, EngineConfig, Event, EventLog, Phase};
use strata::model::{self, Builder, GptConfig, MlpConfig, ModelSpec};
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::parallel::{build_engine, RankLayout};
use strata::strategy::Strategy;
use strata::train::Trainer;
use tch::{Device, Kind, Tensor};

/// Embedding, four layers, head: six units, none borrowing another's parameters.
const MLP: MlpConfig = MlpConfig { vocab: 32, layers: 4, dim: 24 };

/// A GPT's head borrows the embedding's weight: its gathers and gradients reach two units.
const GPT: GptConfig = GptConfig::new(32, 8, 2, 2, 16);

fn spec() -> ModelSpec {
    let mut b = Builder::new();
    model::mlp(&MLP, &mut b).unwrap();
    b.build().unwrap()
}

fn gpt_spec() -> ModelSpec {
    let mut b = Builder::new();
    model::gpt(&GPT, &mut b).unwrap();
    b.build().unwrap()
}

fn step(rank: usize) -> Step {
    // Drawn under the engine's lock: reseeding the process's one generator unlocked could
    // land between another test's seeding and its engine's initial draws.
    let tokens = with_seed(rank as i64, || Tensor::randint(32, [2, 9], (Kind::Int64, Device::Cpu)));
    Step::new(0, vec![Batch::new(tokens.narrow(1, 0, 8), tokens.narrow(1, 1, 8)).unwrap()])
}

/// Runs `f` as rank 0 and rank 1 of a two-rank job; rank 0's result.
fn two_ranks<T: Send>(f: impl Fn(&Comm, usize) -> T + Sync) -> T {
    two_ranks_on("cpu:tcp", f)
}

fn two_ranks_on<T: Send>(backend: &str, f: impl Fn(&Comm, usize) -> T + Sync) -> T {
    let token = "memory-test";
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), token).unwrap();
    let addr = server.addr();
    let mut server = Some(server);
    let hosted: Vec<Option<StoreServer>> = vec![server.take(), None];
    std::thread::scope(|scope| {
        let handles: Vec<_> = hosted
            .into_iter()
            .enumerate()
            .map(|(rank, hosted)| {
                let f = &f;
                scope.spawn(move || {
                    let store = Store::connect(addr, token, Duration::from_secs(30)).unwrap();
                    let comm = Comm::new(store, hosted, rank, 2, backend, Duration::from_secs(60)).unwrap();
                    f(&comm, rank)
                })
            })
            .collect();
        let mut results: Vec<T> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        results.swap_remove(0)
    })
}

/// Two steps of `strategy` on two ranks with every event of rank 0 recorded; the events,
/// and the optimizer's state bytes as its buffers hold them and as the ledger counts them.
fn trained(strategy: &str) -> (Vec<Event>, u64, u64) {
    trained_on(spec, strategy)
}

fn trained_on(model: fn() -> ModelSpec, strategy: &str) -> (Vec<Event>, u64, u64) {
    let strategy = Strategy::parse(strategy).unwrap();
    two_ranks(|comm, rank| {
        let placement = RankLayout { comm: Some(comm), local_world_size: 2, ..RankLayout::single() };
        let mut engine = build_engine(model(), EngineConfig::default(), &strategy, &placement).unwrap();
        let log = Arc::new(EventLog::default());
        engine.set_event_sink(log.clone());
        let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
        let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
        for _ in 0..2 {
            trainer.train_step(&step(rank)).unwrap();
        }
        let held: u64 =
            trainer.optimizer().state().iter().map(|(_, _, _, t)| strata_ext::storage_nbytes(t).unwrap() as u64).sum();
        let report = trainer.engine().ledger().report();
        let ledger = report.values().filter_map(|r| r.by_category.get(&Category::OptimizerState)).sum();
        (log.take(), held, ledger)
    })
}

const STRATEGIES: [&str; 10] = [
    "[]",
    r#"["zero1"]"#,
    r#"["zero2"]"#,
    r#"["fsdp"]"#,
    r#"[["fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}]]"#,
    r#"[["zero2", {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}]]"#,
    r#"[["fsdp", {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}]]"#,
    r#"[["fsdp", {"mixed_precision": {"param_dtype": "bf16"}, "atorch_ignored_cls": ["MlpEmbedding"]}]]"#,
    r#"["zero2", ["offload", {"params": "none", "optimizer": "cpu", "policy": "static"}]]"#,
    r#"[["fsdp", {"mixed_precision": {"param_dtype": "bf16"}}], ["offload", {"params": "cpu", "optimizer": "cpu", "policy": "static"}]]"#,
];

#[test]
fn the_ledger_counts_exactly_what_the_model_state_buffers_hold_at_every_unit_boundary() {
    let mlp = STRATEGIES.iter().map(|s| (spec as fn() -> ModelSpec, 6, *s));
    let tied = [r#"["fsdp"]"#, r#"[["zero2", {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}]]"#];
    for (model, units, strategy) in mlp.chain(tied.map(|s| (gpt_spec as fn() -> ModelSpec, 4, s))) {
        let (events, optimizer_held, optimizer_ledger) = trained_on(model, strategy);
        let phases: Vec<(Phase, usize, u64, u64)> = events
            .iter()
            .filter_map(|e| match *e {
                Event::Phase { phase, unit, ledger_bytes, storage_bytes } => {
                    Some((phase, unit, ledger_bytes, storage_bytes))
                }
                _ => None,
            })
            .collect();
        assert_eq!(phases.len(), 2 * 4 * units, "{strategy}: two steps, four phases of every unit");
        for (phase, unit, ledger, held) in phases {
            assert_eq!(ledger, held, "{strategy}: {phase:?} of unit {unit}: ledger {ledger}, buffers hold {held}");
        }
        assert_eq!(optimizer_ledger, optimizer_held, "{strategy}: optimizer states");
    }
}

/// A gather of a unit, and the phase (of which unit) the schedule was running when it began.
type Gather = (usize, Phase, usize);

/// When each gather started.
fn gathers(events: &[Event]) -> Vec<Gather> {
    let mut out = Vec::new();
    let mut waiting = Vec::new();
    for e in events {
        match *e {
            Event::GatherStarted { unit } => waiting.push(unit),
            Event::Phase { phase, unit: during, .. } => {
                out.extend(waiting.drain(..).map(|u| (u, phase, during)));
            }
            _ => {}
        }
    }
    out
}

/// The first step's gathers of one strategy, split into forward and backward.
fn first_step_gathers(strategy: &str) -> (Vec<Gather>, Vec<Gather>) {
    let (events, _, _) = trained(strategy);
    let all = gathers(&events);
    // Six forward gathers (one per unit), then five in backward (the head stays gathered).
    let (forward, backward) = all.split_at(6);
    (forward.to_vec(), backward[..5].to_vec())
}

#[test]
fn fsdp_prefetch_options_order_the_gathers_as_documented() {
    use Phase::*;
    // Without forward prefetch each unit is gathered as it is about to run.
    let (forward, _) = first_step_gathers(r#"["fsdp"]"#);
    assert_eq!(forward, (0..6).map(|k| (k, BeforeForward, k)).collect::<Vec<_>>());
    // With it, the next unit's gather starts before this one computes: one ahead with
    // limit_all_gathers, two without.
    let (forward, _) = first_step_gathers(r#"[["fsdp", {"forward_prefetch": true}]]"#);
    let one_ahead = [(0, BeforeForward, 0), (1, BeforeForward, 0), (2, BeforeForward, 1), (3, BeforeForward, 2)];
    assert_eq!(forward[..4], one_ahead);
    let (forward, _) = first_step_gathers(r#"[["fsdp", {"forward_prefetch": true, "limit_all_gathers": false}]]"#);
    let two_ahead = [(0, BeforeForward, 0), (1, BeforeForward, 0), (2, BeforeForward, 0), (3, BeforeForward, 1)];
    assert_eq!(forward[..4], two_ahead);
    // Backward PRE: unit k-1's gather starts before unit k's backward computes; POST: after
    // it, once k's parameters are freed.
    let (_, backward) = first_step_gathers(r#"["fsdp"]"#);
    assert_eq!(backward, (0..5).rev().map(|k| (k, BeforeBackward, k + 1)).collect::<Vec<_>>());
    let (_, backward) = first_step_gathers(r#"[["fsdp", {"backward_prefetch": "BACKWARD_POST"}]]"#);
    assert_eq!(backward, (0..5).rev().map(|k| (k, AfterBackward, k + 1)).collect::<Vec<_>>());
}

#[test]
fn full_shard_frees_every_unit_after_its_forward_and_shard_grad_op_keeps_them() {
    for (strategy, freed) in [(r#"["fsdp"]"#, true), (r#"[["fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}]]"#, false)] {
        let strategy = Strategy::parse(strategy).unwrap();
        let held = two_ranks(|comm, rank| {
            let placement = RankLayout { comm: Some(comm), local_world_size: 2, ..RankLayout::single() };
            let mut engine = build_engine(spec(), EngineConfig::default(), &strategy, &placement).unwrap();
            let s = step(rank);
            let _ = engine.forward(&s.micro_batches[0].inputs).unwrap();
            engine.storage().iter().map(|u| strata_ext::storage_nbytes(&u.flat).unwrap()).collect::<Vec<_>>()
        });
        let (before_head, head) = held.split_at(5);
        assert!(head[0] > 0, "the last unit stays gathered for its backward");
        if freed {
            assert!(before_head.iter().all(|&b| b == 0), "{held:?}");
        } else {
            assert!(before_head.iter().all(|&b| b > 0), "{held:?}");
        }
    }
}

/// The model-state peak of rank 0 over two fp32 steps of `strategy` on the MLP, and each
/// unit's padded flat length.
fn model_state_peak(strategy: &str) -> (u64, Vec<u64>) {
    let strategy = Strategy::parse(strategy).unwrap();
    two_ranks(|comm, rank| {
        let placement = RankLayout { comm: Some(comm), local_world_size: 2, ..RankLayout::single() };
        let mut engine = build_engine(spec(), EngineConfig::default(), &strategy, &placement).unwrap();
        // The padded length: a sharded unit's flat buffer holds nothing between uses.
        let lens: Vec<u64> = engine.storage().iter().map(|s| s.grad.numel() as u64).collect();
        let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
        let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
        for _ in 0..2 {
            trainer.train_step(&step(rank)).unwrap();
        }
        (trainer.engine().ledger().model_state_peak(), lens)
    })
}

#[test]
fn sharded_model_states_peak_at_the_formula_plus_the_units_in_use() {
    // fp32 with Adam on two ranks: every rank keeps half of each unit's gradient and
    // moments (4 + 8 bytes per element of its shard).
    let shards = |lens: &[u64]| lens.iter().map(|l| l / 2 * 12).sum::<u64>();
    // zero2 keeps whole parameters and, without overlap_comm, one whole gradient at a time.
    let (peak, lens) = model_state_peak(r#"["zero2"]"#);
    let params: u64 = lens.iter().map(|l| l * 4).sum();
    let largest = lens.iter().max().unwrap() * 4;
    assert_eq!(peak, params + shards(&lens) + largest, "zero2");
    // With overlap_comm, a unit's reduction overlaps the next unit's backward: two whole
    // gradients at once.
    let (unlimited, _) = model_state_peak(r#"[["zero2", {"overlap_comm": true}]]"#);
    let adjacent = lens.windows(2).map(|w| (w[0] + w[1]) * 4).max().unwrap();
    assert_eq!(unlimited, params + shards(&lens) + adjacent, "zero2 with overlap_comm");
    // fsdp: parameter shards too; in the backward of unit k, its parameters and whole
    // gradient and the parameters of unit k - 1 (prefetched) are whole.
    let (peak, lens) = model_state_peak(r#"["fsdp"]"#);
    let param_shards: u64 = lens.iter().map(|l| l / 2 * 4).sum();
    let in_use = (0..lens.len()).map(|k| (2 * lens[k] + if k > 0 { lens[k - 1] } else { 0 }) * 4).max().unwrap();
    assert_eq!(peak, param_shards + shards(&lens) + in_use, "fsdp");
}

/// With shm, zero2's and fsdp's whole gradients live, from a unit's backward until its
/// reduce-scatter completes, in memory the shard group reads in place; over tcp they
/// cannot; both train alike, and give the memory back after each backward. Beside offload
/// (here `auto` keeping every unit on the device) they take memory of their own: the
/// shared slots stay allocated for the run, which the step's floor does not count.
#[test]
fn sharded_whole_gradients_live_where_shm_reads_them_in_place() {
    // Tokens from each rank's own formula: the ranks share the process's generator.
    let tokens = |rank: i64| (Tensor::arange(18, (Kind::Int64, Device::Cpu)) * (rank + 3) + 5 * rank).remainder(32);
    let offloaded = r#"["zero2", ["offload", {"params": "none", "optimizer": "auto", "policy": "auto"}]]"#;
    for (strategy, in_place) in [(r#"["zero2"]"#, true), (r#"["fsdp"]"#, true), (offloaded, false)] {
        let parsed = Strategy::parse(strategy).unwrap();
        let run = |backend: &str| {
            two_ranks_on(backend, |comm, rank| {
                let placement = RankLayout { comm: Some(comm), local_world_size: 2, ..RankLayout::single() };
                let mut engine = build_engine(spec(), EngineConfig::default(), &parsed, &placement).unwrap();
                let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
                let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
                let t = tokens(rank as i64).view([2, 9]);
                let (inputs, targets) = (t.narrow(1, 0, 8), t.narrow(1, 1, 8));
                let batch = Batch::new(inputs.shallow_clone(), targets.shallow_clone()).unwrap();
                let step = Step::new(0, vec![batch]);
                let losses: Vec<f64> = (0..3).map(|_| trainer.train_step(&step).unwrap().loss).collect();
                // The first unit's gradient is the last reduced: in flight when backward ends.
                // Twice, in the same memory: each unit gives its slot back for the next.
                let engine = trainer.engine_mut();
                let mut lent = Vec::new();
                for _ in 0..2 {
                    let out = engine.forward(&inputs).unwrap();
                    engine.backward(&model::layers::cross_entropy(&out, &targets).unwrap()).unwrap();
                    let grad = &engine.storage()[0].grad;
                    lent.push((strata::comm::in_shared_memory(grad), grad.data_ptr() as usize));
                    engine.finish_grads().unwrap();
                }
                let held: Vec<usize> =
                    engine.storage().iter().map(|s| strata_ext::storage_nbytes(&s.grad).unwrap()).collect();
                (lent, held, losses)
            })
        };
        let (lent, held, losses) = run("cpu:shm");
        assert!(lent.iter().all(|l| l.0 == in_place), "{strategy}: the gradient being reduced is in shared memory");
        if in_place {
            assert_eq!(lent[0].1, lent[1].1, "{strategy}: one slot serves every unit in turn");
        }
        assert!(held.iter().all(|&b| b == 0), "{strategy}: given back after backward: {held:?}");
        let (lent, _, reference) = run("cpu:tcp");
        assert!(lent.iter().all(|l| !l.0), "{strategy} over tcp");
        for (a, b) in losses.iter().zip(&reference) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{strategy}: loss {a} with shm, {b} with tcp");
        }
    }
}

/// With shm, data parallelism's gradient buffer lives in memory the peers read in place,
/// and stays there through training (autograd accumulates into it); over tcp it cannot.
#[test]
fn data_parallel_gradients_live_where_shm_reads_them_in_place() {
    for (backend, shared) in [("cpu:shm", true), ("cpu:tcp", false)] {
        let placed = two_ranks_on(backend, |comm, rank| {
            let placement = RankLayout { comm: Some(comm), local_world_size: 2, ..RankLayout::single() };
            let strategy = Strategy::parse("[]").unwrap();
            let mut engine = build_engine(spec(), EngineConfig::default(), &strategy, &placement).unwrap();
            let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
            let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
            trainer.train_step(&step(rank)).unwrap();
            // Every unit's gradient is a slice of the one buffer.
            let units = trainer.engine().storage().iter().all(|s| strata::comm::in_shared_memory(&s.grad));
            let grad_of_first = trainer.engine().named_params().next().unwrap().1.grad();
            (units, strata::comm::in_shared_memory(&grad_of_first))
        });
        assert_eq!(placed, (shared, shared), "{backend}");
    }
}
