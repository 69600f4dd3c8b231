//! An encoder through the strategies: a small BERT classifier trained on padded text pairs
//! (each batch's row layout carrying its padding and token types) by two ranks under fsdp
//! (full shard, backward prefetch; fp32 and bf16 mixed precision), zero2 and activation
//! checkpointing, against one process on the whole batch.

use crate::common::ranks;
use serde_json::json;
use strata::data::{Batch, Step};
use strata::engine::EngineConfig;
use strata::model::{BertConfig, BertHead, DropoutRates, ModelConfig, RowLayout};
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::parallel::{build_engine, RankLayout};
use strata::strategy::Strategy;
use strata::train::Trainer;
use tch::{Kind, Tensor};

const ROWS: i64 = 4;
const CTX: i64 = 10;

/// The classifier, with dropout at `dropout` at every site.
fn config(dropout: f64) -> ModelConfig {
    ModelConfig::Bert(BertConfig {
        vocab: 64,
        max_positions: 16,
        type_vocab: 2,
        layers: 2,
        heads: 2,
        dim: 16,
        ffn_dim: 32,
        norm_eps: 1e-12,
        padding: Some(0),
        head: BertHead::Classify { labels: vec!["a".into(), "b".into(), "c".into()] },
        dropout: DropoutRates::all(dropout),
    })
}

/// Three steps on one global batch of `ROWS` padded text pairs with a label each (so the
/// loss must fall); `rank` of two takes its half of the rows (the loss then weighs each row
/// of the global batch alike).
fn steps(rank: Option<usize>) -> Vec<Step> {
    (0..3)
        .map(|step| {
            let lengths: Vec<i64> = (0..ROWS).map(|r| 4 + (3 * r) % 7).collect();
            let row = |f: &dyn Fn(i64, i64, i64) -> i64| {
                let v: Vec<i64> = (0..ROWS)
                    .flat_map(|r| (0..CTX).map(move |t| (r, t)))
                    .map(|(r, t)| f(r, t, lengths[r as usize]))
                    .collect();
                Tensor::from_slice(&v).view([ROWS, CTX])
            };
            let tokens = row(&|r, t, n| if t < n { 1 + (7 * r + 5 * t) % 63 } else { 0 });
            let labels = Tensor::from_slice(&[0i64, 1, 2, 0]);
            let layout = RowLayout {
                positions: row(&|_, t, _| t),
                examples: row(&|_, t, n| i64::from(t >= n)),
                segments: Some(row(&|_, t, n| i64::from(t >= n / 2 && t < n))),
                source_len: None,
            };
            let (take, data_ranks) = match rank {
                Some(r) => ((2 * r as i64, 2), 2),
                None => ((0, ROWS), 1),
            };
            let pick = |t: &Tensor| t.narrow(0, take.0, take.1);
            let mut batch = Batch::new(pick(&tokens), pick(&labels)).unwrap();
            // Its rows' place in the global batch: they draw their dropout masks by it.
            batch.first_row = take.0 as usize;
            batch.layout = Some(RowLayout {
                positions: pick(&layout.positions),
                examples: pick(&layout.examples),
                segments: layout.segments.as_ref().map(pick),
                source_len: None,
            });
            Step { index: step, micro_batches: vec![batch], global_supervised: ROWS as u64, data_ranks }
        })
        .collect()
}

/// Weights in eight numbers (a rank's output stays short): their projections on seven
/// fixed random directions and their norm.
fn digest(weights: &Tensor) -> Vec<f64> {
    let n = weights.numel() as i64;
    let directions = strata::engine::with_seed(7, || Tensor::randn([7, n], (Kind::Double, tch::Device::Cpu)));
    let w = weights.to_kind(Kind::Double);
    let mut out: Vec<f64> = Vec::try_from(directions.matmul(&w)).unwrap();
    out.push(w.norm().double_value(&[]));
    out
}

/// Losses of the steps and the whole weights after them, under `strategy` at `at`, with
/// dropout at `dropout`.
fn train(strategy: &str, at: &RankLayout<'_>, rank: Option<usize>, dropout: f64) -> (Vec<f64>, Tensor) {
    let strategy = Strategy::parse(strategy).unwrap();
    let config_of = EngineConfig { seed: 3, ..EngineConfig::default() };
    let mut engine = build_engine(config(dropout).spec().unwrap(), config_of, &strategy, at).unwrap();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig { lr: 1e-2, ..Default::default() }, &[]).unwrap();
    let mut trainer = Trainer::new(engine, optimizer, LrSchedule::Constant, Some(1.0));
    let losses = steps(rank).iter().map(|s| trainer.train_step(s).unwrap().loss).collect();
    let units = trainer.engine().spec().units.len();
    let weights = Tensor::cat(&(0..units).map(|k| trainer.engine_mut().full_unit(k).unwrap()).collect::<Vec<_>>(), 0);
    (losses, weights.to_kind(Kind::Float))
}

/// Strategies with the bounds of their weights' gap to one process: below the first, and
/// (bf16 parameters, which must round) above the second.
const STRATEGIES: [(&str, f64, f64); 3] = [
    (r#"[["fsdp", {"sharding_strategy": "FULL_SHARD", "backward_prefetch": "BACKWARD_PRE"}]]"#, 1e-5, 0.0),
    (r#"["zero2", ["checkpoint", ["BertBlock"]]]"#, 1e-5, 0.0),
    (r#"[["fsdp", {"mixed_precision": {"param_dtype": "bf16"}}]]"#, 2e-2, 1e-4),
];

/// One rank of two: the steps under the strategy the scenario names, losses and weights
/// printed.
#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var("STRATA_TEST_SCENARIO") else { return };
    let strategy = STRATEGIES[scenario.parse::<usize>().unwrap()].0;
    let comm = ranks::connect();
    let at = RankLayout { comm: Some(&comm), local_world_size: 2, ..RankLayout::single() };
    let (losses, weights) = train(strategy, &at, Some(comm.rank()), DROPOUT);
    println!("RESULT {}", json!({"losses": losses, "weights": digest(&weights)}));
    println!("RANK-OK");
}

/// Dropout at every site of the classifier: each rank must draw its rows' masks, the
/// recomputed blocks the masks of their first forward.
const DROPOUT: f64 = 0.1;

/// Two ranks under each strategy train the classifier, with dropout, as one process does
/// on the whole batch: the ranks' mean loss per step and the final weights (their digest)
/// within the strategy's bound (fp32: 1e-5; bf16 parameters: 2e-2, and at least 1e-4 off),
/// and the model learns. Dropout changes the losses (its masks are drawn at all).
#[test]
fn a_bert_classifier_at_two_ranks_trains_as_one_process() {
    let (single, weights) = train("[]", &RankLayout::single(), None, DROPOUT);
    assert!(single[2] < single[0], "the loss falls: {single:?}");
    let (undropped, _) = train("[]", &RankLayout::single(), None, 0.0);
    assert!((single[0] - undropped[0]).abs() > 1e-4, "dropout changes the loss: {single:?} {undropped:?}");
    for (i, (strategy, bound, lower)) in STRATEGIES.iter().enumerate() {
        let outputs = ranks::run_ranks(2, "tcp", &i.to_string());
        ranks::assert_all_ok(&outputs);
        let results: Vec<serde_json::Value> = outputs
            .iter()
            .map(|o| {
                let text = String::from_utf8_lossy(&o.stdout);
                let line = text.lines().find_map(|l| l.split_once("RESULT ").map(|(_, r)| r)).expect("a result line");
                serde_json::from_str(line).unwrap()
            })
            .collect();
        let losses: Vec<f64> =
            (0..3).map(|s| results.iter().map(|r| r["losses"][s].as_f64().unwrap()).sum::<f64>() / 2.0).collect();
        let theirs: Vec<f64> = serde_json::from_value(results[0]["weights"].clone()).unwrap();
        let ours = digest(&weights);
        let loss_gap = losses.iter().zip(&single).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
        let scale = ours.iter().fold(0.0, |m: f64, v| m.max(v.abs()));
        let weight_gap = theirs.iter().zip(&ours).map(|(a, b)| (a - b).abs() / scale).fold(0.0, f64::max);
        eprintln!("{strategy}: losses {losses:?} against {single:?}: gap {loss_gap:.2e}; weights {weight_gap:.2e}");
        assert!(loss_gap < *bound && weight_gap < *bound, "{strategy}: loss gap {loss_gap:e}, weights {weight_gap:e}");
        assert!(weight_gap >= *lower, "{strategy}: bf16 parameters changed nothing ({weight_gap:e})");
    }
}
