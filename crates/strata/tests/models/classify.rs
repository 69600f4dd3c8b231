//! A BERT classifier trained by the library's run (`strata::run::train`) on labeled texts:
//! records read and encoded, batched by the data loader with each row's padding and token
//! types, the loss falling and the held-out accuracy above chance.
use crate::common;

use strata::data::Batching;
use strata::data::{predictions, read_labeled, scores, ClassifySet, LabeledText, RowSet, Tokenizer};
use strata::engine::{Engine, EngineConfig};
use strata::model::{BertConfig, BertHead, ModelConfig};
use strata::run::{self, Data, Model, RunConfig};

/// Reviews of three to eight words, positive where "good" outnumbers "bad", from a small
/// linear congruential sequence; as JSON Lines.
fn reviews(count: usize, seed: u64) -> String {
    let mut state = seed;
    let mut draw = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let words = ["good", "bad", "film", "plot", "cast", "the"];
    (0..count)
        .map(|_| {
            let n = 3 + draw(6) as usize;
            let picked: Vec<&str> = (0..n).map(|_| words[draw(words.len() as u64) as usize]).collect();
            let (good, bad) =
                (picked.iter().filter(|w| **w == "good").count(), picked.iter().filter(|w| **w == "bad").count());
            let label = if good > bad { "positive" } else { "negative" };
            format!("{}\n", serde_json::json!({"text": picked.join(" "), "label": label}))
        })
        .collect()
}

#[test]
fn a_bert_classifier_learns_labeled_texts_through_the_library_run() {
    let dir = tempfile::tempdir().unwrap();
    let labels = vec!["negative".to_string(), "positive".to_string()];
    let set = |name: &str, count, seed| {
        let path = dir.path().join(name);
        std::fs::write(&path, reviews(count, seed)).unwrap();
        let records = read_labeled(&path, &labels).unwrap();
        ClassifySet::encode(&records, &Tokenizer::Bytes, 64, 0, name).unwrap()
    };
    let (train, validation) = (set("train.jsonl", 512, 1), set("val.jsonl", 64, 2));
    let config = BertConfig {
        vocab: 256,
        max_positions: 64,
        type_vocab: 2,
        layers: 2,
        heads: 2,
        dim: 32,
        ffn_dim: 64,
        norm_eps: 1e-12,
        padding: Some(0),
        head: BertHead::Classify { labels: labels.clone() },
        dropout: strata::model::DropoutRates::NONE,
    };
    let model = Model::from(ModelConfig::Bert(config.clone()));
    let saved = dir.path().join("trained.safetensors");
    let run_config = RunConfig {
        outputs: run::Outputs { weights: Some(saved.clone()), ..Default::default() },
        steps: 120,
        eval_every: Some(60),
        optimizer: strata::optim::OptimizerConfig { lr: 1e-3, ..Default::default() },
        batching: Batching { batch_size: 16, ctx: 64, ..Batching::default() },
        ..RunConfig::default()
    };
    let mut losses = vec![];
    let mut watch = |r: &strata::train::StepReport| {
        if let Some(v) = r.val_loss {
            losses.push(v);
        }
        Ok(run::Flow::Continue)
    };
    let held_out = validation.clone();
    run::train(&model, &Data::with_validation(train, validation), &run_config, &mut [&mut watch]).unwrap();
    assert_eq!(losses.len(), 2, "two evaluations");
    assert!(losses[1] < losses[0], "the validation loss falls: {losses:?}");
    // The trained weights, judged on the held-out texts.
    let mut engine = Engine::new(ModelConfig::Bert(config).spec().unwrap(), EngineConfig::default()).unwrap();
    strata::io::load_weights(&mut engine, &saved).unwrap();
    let batch = held_out.batch(&(0..held_out.len()).collect::<Vec<_>>()).unwrap();
    engine.set_layout(batch.layout.as_ref());
    let predicted = predictions(&engine.evaluate(&batch.inputs).unwrap()).unwrap();
    let s = scores(&predicted, held_out.labels(), 2);
    eprintln!("validation losses {losses:?}; held-out accuracy {:.3}, macro-F1 {:.3}", s.accuracy, s.macro_f1);
    assert!(s.accuracy > 0.75, "{s:?}");
}

/// The library run feeds the model through the `prepare_input` it is given and takes the
/// loss from its `loss`, in the run itself, in the measurements before it and in the
/// search's dry runs; what the input function returns is what the model reads.
#[test]
fn a_run_reads_its_input_and_loss_from_the_functions_it_is_given() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let labels = vec!["negative".to_string(), "positive".to_string()];
    let path = dir.path().join("train.jsonl");
    std::fs::write(&path, reviews(64, 1)).unwrap();
    let set = ClassifySet::encode(&read_labeled(&path, &labels).unwrap(), &Tokenizer::Bytes, 64, 0, "train").unwrap();
    let model = Model::from(ModelConfig::Bert(common::tiny_bert_classifier(64, 2, &["negative", "positive"])));
    // Calls of prepare_input and of the loss in a run under `strategy`.
    let calls = |strategy: run::StrategySource| {
        let (inputs, losses) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (counted_inputs, counted_losses) = (inputs.clone(), losses.clone());
        let config = RunConfig {
            steps: 4,
            prepare_input: Some(Arc::new(move |b: &strata::data::Batch| {
                counted_inputs.fetch_add(1, Ordering::Relaxed);
                Ok(b.inputs.shallow_clone())
            })),
            loss: Some(Arc::new(move |logits: &tch::Tensor, b: &strata::data::Batch| {
                counted_losses.fetch_add(1, Ordering::Relaxed);
                strata::model::layers::cross_entropy(logits, &b.targets)
            })),
            strategy,
            batching: Batching { batch_size: 16, ctx: 64, ..Batching::default() },
            ..RunConfig::default()
        };
        run::train(&model, &Data::new(set.clone()), &config, &mut []).unwrap();
        (inputs.load(Ordering::Relaxed), losses.load(Ordering::Relaxed))
    };
    let given = strata::strategy::Strategy::parse("[]").unwrap();
    assert_eq!(calls(run::StrategySource::Given(given)), (4, 4), "a micro-batch a step, each read and scored once");
    // Offload measures the room a step needs beside model states before it trains: on a
    // micro-batch fed and scored as the run's own.
    let offload = r#"[["offload", {"params": "none", "optimizer": "cpu", "policy": "static"}]]"#;
    let offload = strata::strategy::Strategy::parse(offload).unwrap();
    assert_eq!(calls(run::StrategySource::Given(offload)), (5, 5), "the measurement's micro-batch, then the run's");
    let auto = run::StrategySource::Auto(strata::auto::AutoOptions { dry_run_steps: 1, ..Default::default() });
    let (inputs, losses) = calls(auto);
    assert!(inputs > 4 && losses > 4, "the search's dry runs call them too: {inputs}, {losses}");
    // What prepare_input returns is what the model reads: ids past the vocabulary fail.
    let config = RunConfig {
        steps: 1,
        prepare_input: Some(Arc::new(|b: &strata::data::Batch| Ok(b.inputs.f_add_scalar(10_000)?))),
        batching: Batching { batch_size: 16, ctx: 64, ..Batching::default() },
        ..RunConfig::default()
    };
    assert!(run::train(&model, &Data::new(set.clone()), &config, &mut []).is_err(), "the input went unread");
}

/// Texts in pairs carry token type 1 for their second part: a run of a model with one
/// token type refuses them before it trains (on the host, where a GPU's forward would only
/// meet the embedding's bound), naming the data.
#[test]
fn text_pairs_are_refused_before_training_by_a_model_of_one_token_type() {
    let records = vec![
        LabeledText { text: "good film".into(), pair: Some("good cast".into()), label: 1 },
        LabeledText { text: "bad plot".into(), pair: None, label: 0 },
    ];
    let set = ClassifySet::encode(&records, &Tokenizer::Bytes, 32, 0, "pairs.jsonl").unwrap();
    let run_config = RunConfig {
        steps: 1,
        batching: Batching { batch_size: 2, ctx: 32, ..Batching::default() },
        ..RunConfig::default()
    };
    let model = Model::from(ModelConfig::Bert(common::tiny_bert_classifier(32, 1, &["negative", "positive"])));
    let err = run::train(&model, &Data::new(set), &run_config, &mut []).unwrap_err().to_string();
    assert!(err.contains("pairs.jsonl holds token type 1"), "{err}");
    assert!(err.contains("the model has 1 token type"), "{err}");
}
