//! Hugging Face model folders against `transformers` itself (scripts/hf_reference.py, the
//! project's `.venv`): tiny random GPT-2, LLaMA (grouped-query attention, tied embeddings)
//! and Qwen2 (attention biases) models give the same logits in Strata, sharded folders
//! load, folders written back load in `transformers`, and cached decoding equals uncached.

use crate::hf_reference::{python, reference};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use strata::engine::{Engine, EngineConfig};
use strata::generate::{generate, generate_batch, generate_streams, GenerateConfig};
use strata::io::{load_model_dir, save_weights, write_weights, FolderOut, WeightsTarget};
use strata::model::{from_pretrained_dir, BertConfig, BertHead, Builder, GptConfig, LlamaConfig, ModelConfig};
use tch::{Kind, Tensor};

fn make(py: &Path, family: &str, dir: &Path, shard_bytes: Option<&str>) {
    let mut args = vec!["make", "--family", family, "--out", dir.to_str().unwrap()];
    if let Some(b) = shard_bytes {
        args.extend(["--shard-bytes", b]);
    }
    reference(py, &args);
}

const ROWS: [[i64; 12]; 2] =
    [[5, 17, 3, 88, 40, 41, 9, 0, 63, 12, 77, 2], [94, 1, 1, 30, 58, 6, 19, 71, 4, 95, 50, 33]];

fn transformers_logits(py: &Path, dir: &Path, work: &Path) -> Tensor {
    let out = work.join("logits.safetensors");
    let rows = serde_json::to_string(&ROWS).unwrap();
    reference(py, &["logits", "--dir", dir.to_str().unwrap(), "--tokens", &rows, "--out", out.to_str().unwrap()]);
    strata::io::read_safetensors(&out).unwrap().remove("logits").unwrap()
}

fn strata_engine(dir: &Path) -> Engine {
    let folder = from_pretrained_dir(dir).unwrap();
    let mut engine = Engine::new(folder.spec().unwrap(), EngineConfig::default()).unwrap();
    load_model_dir(&mut engine, &folder).unwrap();
    engine
}

fn strata_logits(engine: &mut Engine) -> Tensor {
    let rows: Vec<i64> = ROWS.iter().flatten().copied().collect();
    engine.evaluate(&Tensor::from_slice(&rows).view([2, 12])).unwrap()
}

/// Small random moves for the values of unit `k`, drawn from a seed under the process's
/// lock on seeded draws, so a test sampling on another thread draws what its seed says.
fn nudge(values: &Tensor, k: usize) -> Tensor {
    strata::engine::with_seed(1000 + k as i64, || Tensor::randn_like(values) * 0.02)
}

/// The largest difference of two logit tensors, after checking that they are not trivial
/// (a spread well above the tolerance, so agreement is not agreement of near-constants).
fn gap(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    assert!(a.std(true).double_value(&[]) > 0.05, "logits this flat compare nothing");
    (a - b).abs().max().to_kind(Kind::Double).double_value(&[])
}

fn logits_match(family: &str, shard_bytes: Option<&str>) {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join(family);
    make(&py, family, &dir, shard_bytes);
    let folder = from_pretrained_dir(&dir).unwrap();
    assert_eq!(folder.weights.len() > 1, shard_bytes.is_some(), "{:?}", folder.weights);
    let theirs = transformers_logits(&py, &dir, work.path());
    let ours = strata_logits(&mut strata_engine(&dir));
    let g = gap(&theirs, &ours);
    eprintln!("{family}: largest logit difference from transformers {g:.2e}");
    assert!(g < 1e-5, "{family}: logits differ from transformers' by {g}");
}

#[test]
fn gpt2_logits_equal_transformers() {
    logits_match("gpt2", None);
}

#[test]
fn llama_with_grouped_query_attention_and_tied_head_equals_transformers() {
    logits_match("llama", None);
}

#[test]
fn sharded_qwen2_with_attention_biases_equals_transformers() {
    logits_match("qwen2", Some("20000"));
}

/// The parameters Strata leaves out of weight decay when asked (`decay_norms_and_biases`
/// off) are those `transformers`' `Trainer` leaves out, family by family: LayerNorms named
/// anything (GPT-2's `ln_*`), RMSNorms, biases (T5's relative attention bias, Qwen3-Next's
/// `dt_bias`, DeepSeek's choice bias, Granite 4's Mamba-2 gated norm), but not gpt-oss's
/// sinks, Qwen3-Next's `A_log` or Mamba-2's `D`.
#[test]
fn the_parameters_left_out_of_weight_decay_are_those_the_trainer_leaves_out() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let families = [
        "gpt2",
        "llama",
        "qwen3",
        "gemma2",
        "olmoe",
        "deepseek-v3",
        "gpt-oss",
        "qwen3-next",
        "granite4-hybrid",
        "t5",
        "bert-mlm",
    ];
    for family in families {
        let dir = work.path().join(family);
        make(&py, family, &dir, None);
        let answer: serde_json::Value =
            serde_json::from_str(&reference(&py, &["decay-skipped", "--dir", dir.to_str().unwrap()])).unwrap();
        let listed = |key: &str| -> BTreeSet<String> {
            answer[key].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect()
        };
        let (names, skipped) = (listed("names"), listed("skipped"));
        let spec = from_pretrained_dir(&dir).unwrap().spec().unwrap();
        let ours: BTreeMap<&str, bool> =
            spec.params.iter().map(|p| (p.name.as_str(), p.trainer_skips_decay())).collect();
        let both: Vec<&str> = ours.keys().copied().filter(|n| names.contains(*n)).collect();
        // Stacked experts are named apart; everything else is named alike.
        let unmatched: Vec<&String> =
            skipped.iter().filter(|n| !n.contains(".experts.") && !ours.contains_key(n.as_str())).collect();
        assert!(unmatched.is_empty(), "{family}: {unmatched:?} are not Strata's names");
        assert!(both.len() * 4 >= names.len() * 3, "{family}: {} of {} names in common", both.len(), names.len());
        let differ: Vec<&&str> = both.iter().filter(|n| ours[**n] != skipped.contains(**n)).collect();
        assert!(differ.is_empty(), "{family}: weight decay differs for {differ:?}");
        assert!(!skipped.is_empty() && skipped.len() < names.len(), "{family}: {skipped:?}");
    }
}

/// A changed model written back (sharded, in the family's names and layouts) loads in
/// `transformers` with the logits Strata computes.
#[test]
fn folders_written_back_load_in_transformers() {
    let Some(py) = python() else { return };
    for family in ["gpt2", "qwen2"] {
        let work = tempfile::tempdir().unwrap();
        let (source, saved) = (work.path().join("source"), work.path().join("saved"));
        make(&py, family, &source, None);
        let mut engine = strata_engine(&source);
        let before = strata_logits(&mut engine);
        // Every parameter moves, so a name or layout lost on the way changes the logits.
        for k in 0..engine.spec().units.len() {
            let values = engine.full_unit(k).unwrap();
            let moved = &values + nudge(&values, k);
            engine.set_full_unit(k, &moved).unwrap();
        }
        let ours = strata_logits(&mut engine);
        assert!(gap(&before, &ours) > 1e-3, "{family}: the weights did not change");
        let mut out = FolderOut::like(&saved, &from_pretrained_dir(&source).unwrap());
        out.shard_bytes = 30_000;
        save_weights(&mut engine, WeightsTarget::Folder(&out), true).unwrap();
        let written = from_pretrained_dir(&saved).unwrap();
        assert!(written.weights.len() > 1, "{family}: expected shards, got {:?}", written.weights);
        assert!(written.tokenizer.is_some(), "the tokenizer is copied along");
        let theirs = transformers_logits(&py, &saved, work.path());
        let g = gap(&theirs, &ours);
        eprintln!("{family} written back: largest logit difference from transformers {g:.2e}");
        assert!(g < 1e-5, "{family}: the written folder's logits differ by {g}");
        // Written again unsharded, the stale shards and index go.
        out.shard_bytes = u64::MAX;
        save_weights(&mut engine, WeightsTarget::Folder(&out), true).unwrap();
        assert_eq!(from_pretrained_dir(&saved).unwrap().weights, vec![saved.join("model.safetensors")]);
        assert!(!saved.join("model.safetensors.index.json").exists());
    }
}

/// One position's logits shaped for choosing a token as `transformers`' own logits
/// processors shape them for the same generation settings: the repetition penalty over each
/// row's tokens (left padding not counted), alone when greedy, then temperature, top-k,
/// top-p (with a tie at its boundary) and min-p, the same tokens left out (−∞).
#[test]
fn sampling_scores_are_those_of_transformers_processors() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("llama");
    make(&py, "llama", &dir, None);
    let vocab = 24;
    let logits = strata::engine::with_seed(3, || Tensor::randn([3, vocab], (Kind::Float, tch::Device::Cpu)) * 2.0);
    // The last row's two best tokens tie, each half the mass: top-p 0.5 sits on the tie.
    let _ = logits.get(2).fill_(-30.0);
    let _ = logits.get(2).narrow(0, 4, 2).fill_(5.0);
    let ids = [vec![0i64, 0, 5, 6, 5, 9], vec![3, 4, 5, 6, 7, 21], vec![0, 4, 1, 1, 2, 8]];
    let mask: Vec<Vec<i64>> = ids
        .iter()
        .enumerate()
        .map(|(r, row)| {
            let pad = if r == 1 { 0 } else { 2 - r / 2 };
            (0..row.len()).map(|i| i64::from(i >= pad)).collect()
        })
        .collect();
    let seen: Vec<&[i64]> =
        ids.iter().zip(&mask).map(|(row, m)| &row[m.iter().filter(|&&v| v == 0).count()..]).collect();
    let cases = [
        (
            serde_json::json!({"do_sample": false, "repetition_penalty": 1.3}),
            GenerateConfig { repetition_penalty: 1.3, ..Default::default() },
        ),
        (
            serde_json::json!({"do_sample": true, "temperature": 0.7, "top_k": 5, "repetition_penalty": 1.2}),
            GenerateConfig { temperature: 0.7, top_k: Some(5), repetition_penalty: 1.2, ..Default::default() },
        ),
        (
            serde_json::json!({"do_sample": true, "temperature": 1.3, "top_k": 0, "top_p": 0.8, "min_p": 0.1}),
            GenerateConfig { temperature: 1.3, top_p: Some(0.8), min_p: Some(0.1), ..Default::default() },
        ),
        (
            serde_json::json!({"do_sample": true, "temperature": 1.0, "top_k": 0, "top_p": 0.5}),
            GenerateConfig { temperature: 1.0, top_p: Some(0.5), ..Default::default() },
        ),
    ];
    let rows = |t: &Tensor| serde_json::to_string(&Vec::<Vec<f32>>::try_from(t).unwrap()).unwrap();
    for (settings, config) in cases {
        let answer = reference(
            &py,
            &[
                "processors",
                "--dir",
                dir.to_str().unwrap(),
                "--logits",
                &rows(&logits),
                "--ids",
                &serde_json::to_string(&ids).unwrap(),
                "--mask",
                &serde_json::to_string(&mask).unwrap(),
                "--config",
                &settings.to_string(),
            ],
        );
        let theirs: Vec<Vec<Option<f64>>> = serde_json::from_str(&answer).unwrap();
        let ours =
            Vec::<Vec<f64>>::try_from(strata::generate::sampling_scores(&logits, &config, &seen).unwrap()).unwrap();
        let mut left_out = 0;
        for (r, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            for (v, (x, y)) in a.iter().zip(b).enumerate() {
                match y {
                    None => {
                        assert_eq!(*x, f64::NEG_INFINITY, "{settings}: row {r} token {v} is left out by transformers")
                    }
                    Some(y) => assert!(
                        (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                        "{settings}: row {r} token {v}: {x} against {y}"
                    ),
                }
                left_out += usize::from(y.is_none());
            }
        }
        let sampled = settings["do_sample"] == true;
        assert_eq!(left_out > 0, sampled, "{settings}: {left_out} left out");
    }
    // Greedy decoding with the penalty, prompt included, follows transformers' generate.
    let mut engine = strata_engine(&dir);
    let prompt = [7i64, 31, 3, 7, 7, 12];
    let config = GenerateConfig { max_new_tokens: 10, repetition_penalty: 4.0, ..Default::default() };
    let ours = generate(&mut engine, &prompt, &config, None).unwrap();
    let theirs: Vec<i64> = serde_json::from_str(&reference(
        &py,
        &[
            "generate",
            "--dir",
            dir.to_str().unwrap(),
            "--prompt",
            &serde_json::to_string(&prompt).unwrap(),
            "--max-new-tokens",
            "10",
            "--config",
            r#"{"repetition_penalty": 4.0}"#,
        ],
    ))
    .unwrap();
    assert_eq!(ours, theirs);
    let unpenalised =
        generate(&mut engine, &prompt, &GenerateConfig { repetition_penalty: 1.0, ..config }, None).unwrap();
    assert_ne!(ours, unpenalised, "the penalty changes nothing here");
}

/// Greedy decoding of `new_tokens` after a fixed prompt equals `transformers`'
/// generate(do_sample=False) token for token (which is told to run past the end token),
/// with and without the key/value cache.
fn greedy_generation_matches(py: &Path, family: &str, dir: &Path, engine: &mut Engine, new_tokens: usize) {
    let prompt = [7i64, 31, 3, 58, 12];
    let args = [
        "generate",
        "--dir",
        dir.to_str().unwrap(),
        "--prompt",
        &serde_json::to_string(&prompt).unwrap(),
        "--max-new-tokens",
        &new_tokens.to_string(),
    ];
    let theirs: Vec<i64> = serde_json::from_str(&reference(py, &args)).unwrap();
    let context = from_pretrained_dir(dir).unwrap().config.context();
    let config = GenerateConfig { max_new_tokens: new_tokens, ..Default::default() };
    let cached = generate(engine, &prompt, &config, context).unwrap();
    let uncached = generate(engine, &prompt, &GenerateConfig { cache: false, ..config }, context).unwrap();
    assert_eq!(cached, theirs, "{family}: greedy tokens differ from transformers'");
    assert_eq!(uncached, cached, "{family}: the cached path differs from the uncached one");
}

#[test]
fn greedy_generation_equals_transformers() {
    let Some(py) = python() else { return };
    for family in ["gpt2", "llama"] {
        let work = tempfile::tempdir().unwrap();
        let dir = work.path().join(family);
        make(&py, family, &dir, None);
        greedy_generation_matches(&py, family, &dir, &mut strata_engine(&dir), 20);
    }
}

/// Prompts decoded together give each the tokens it gets alone, greedy, with and without
/// the cache: with it, shorter prompts are padded on the left (in every attention kind:
/// plain, windowed and soft-capped, with sinks, latent, linear, Mamba-2's with its
/// convolution's bias, LFM2's short convolution with its projection's bias, Nemotron-H's
/// blocks of one sub-layer, Falcon-H1's Mamba-2 mixers beside attention, Jamba's Mamba-1
/// mixers), without it rows of one
/// length share a batch; a row that meets a stop token ends there while the others go on.
/// Sampled, each row draws from its own stream, the same alone or beside other prompts.
#[test]
fn batched_generation_equals_one_at_a_time() {
    let Some(py) = python() else { return };
    let families = [
        "gpt2",
        "llama",
        "gemma2",
        "gpt-oss",
        "deepseek-v3",
        "qwen3-next",
        "ministral3",
        "granite4-dense",
        "lfm2",
        "nemotron-h",
        "falcon-h1-ungated",
        "jamba",
    ];
    for family in families {
        let work = tempfile::tempdir().unwrap();
        let dir = work.path().join(family);
        make(&py, family, &dir, None);
        let mut engine = strata_engine(&dir);
        let context = from_pretrained_dir(&dir).unwrap().config.context();
        let prompts: Vec<Vec<i64>> =
            vec![vec![7, 31, 3], vec![5, 9, 40, 2], vec![11, 12, 13], vec![60, 1, 8], vec![3], vec![21, 22, 23, 24]];
        let greedy = GenerateConfig { max_new_tokens: 12, ..Default::default() };
        let alone: Vec<Vec<i64>> =
            prompts.iter().map(|p| generate(&mut engine, p, &greedy, context).unwrap()).collect();
        // The stop token is one row's fourth, so that row ends early and the others need not.
        let stop = alone[1][3];
        let stopping = GenerateConfig { stop_tokens: vec![stop], ..greedy.clone() };
        let alone_stopping: Vec<Vec<i64>> =
            prompts.iter().map(|p| generate(&mut engine, p, &stopping, context).unwrap()).collect();
        assert!(alone_stopping[1].len() <= 4 && alone_stopping.iter().any(|r| r.len() == 12), "{alone_stopping:?}");
        for config in [greedy.clone(), GenerateConfig { cache: false, ..greedy.clone() }, stopping] {
            let together = generate_batch(&mut engine, None, &prompts, &config, context).unwrap();
            let expected = if config.stop_tokens.is_empty() { &alone } else { &alone_stopping };
            assert_eq!(&together, expected, "{family}: batched decoding differs ({config:?})");
        }
        // Sampling repeats with its seed, rows of one prompt drawing differently.
        let sampling = GenerateConfig { temperature: 1.0, seed: 5, ..greedy };
        let copies = vec![prompts[0].clone(); 8];
        let a = generate_batch(&mut engine, None, &copies, &sampling, context).unwrap();
        assert_eq!(a, generate_batch(&mut engine, None, &copies, &sampling, context).unwrap());
        assert!(a.iter().any(|r| r != &a[0]), "{family}: every sampled row is the same: {a:?}");
        let streams: Vec<u64> = (0..prompts.len() as u64).collect();
        let mixed = generate_streams(&mut engine, None, &prompts, &streams, &sampling, context).unwrap();
        for (i, p) in prompts.iter().enumerate() {
            let own = generate_streams(&mut engine, None, std::slice::from_ref(p), &streams[i..=i], &sampling, context);
            assert_eq!(mixed[i], own.unwrap()[0], "{family}: prompt {i} sampled beside others differs from alone");
        }
    }
}

/// Sampling is reproducible from its seed; the cache agrees with recomputation past the
/// context too (the window slides).
#[test]
fn sampling_repeats_with_its_seed_and_windows_slide() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("gpt2");
    make(&py, "gpt2", &dir, None);
    let mut engine = strata_engine(&dir);
    let sampling = GenerateConfig {
        max_new_tokens: 24,
        temperature: 0.9,
        top_k: Some(40),
        top_p: Some(0.95),
        seed: 11,
        ..Default::default()
    };
    let a = generate(&mut engine, &[4, 9, 16], &sampling, Some(64)).unwrap();
    let b = generate(&mut engine, &[4, 9, 16], &sampling, Some(64)).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.len(), 24);
    // A context of 8 positions: past it both paths recompute the last 8.
    let greedy = GenerateConfig { max_new_tokens: 12, ..Default::default() };
    let cached = generate(&mut engine, &[4, 9, 16], &greedy, Some(8)).unwrap();
    let uncached = generate(&mut engine, &[4, 9, 16], &GenerateConfig { cache: false, ..greedy }, Some(8)).unwrap();
    assert_eq!(cached, uncached);
}

/// Every file of a folder and its bytes.
fn folder_contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect()
}

/// A model folder written over an earlier one replaces it whole: a write that fails midway
/// (here, the fifth parameter cannot be produced) leaves the earlier folder byte for byte,
/// with no staging folder beside it; a write that succeeds leaves the new weights and the
/// earlier folder's other files, and no weights of the earlier layout.
#[test]
fn a_folder_write_that_fails_midway_leaves_the_earlier_folder_whole() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("model");
    let config = ModelConfig::Gpt(GptConfig::new(64, 16, 2, 2, 32));
    let mut b = Builder::new();
    config.build(&mut b).unwrap();
    let mut engine = Engine::new(b.build().unwrap(), EngineConfig::default()).unwrap();
    let mut out = FolderOut::new(&dir, config).unwrap();
    out.shard_bytes = 20_000;
    save_weights(&mut engine, WeightsTarget::Folder(&out), true).unwrap();
    std::fs::write(dir.join("README.md"), "a model card").unwrap();
    let earlier = folder_contents(&dir);
    assert!(earlier.keys().filter(|n| n.ends_with(".safetensors")).count() > 1, "{:?}", earlier.keys());
    let layout: Vec<(String, Kind, Vec<i64>)> =
        engine.spec().params.iter().map(|p| (p.name.clone(), Kind::Float, p.shape.clone())).collect();
    let zeros = |i: usize| Ok(Tensor::zeros(layout[i].2.as_slice(), (Kind::Float, tch::Device::Cpu)));
    out.shard_bytes = u64::MAX;
    let failing = |i: usize| match i {
        4 => Err(strata::Error::Engine("the fifth parameter is lost".into())),
        _ => zeros(i),
    };
    let err = write_weights(WeightsTarget::Folder(&out), &layout, failing).unwrap_err();
    assert!(err.to_string().contains("fifth parameter"), "{err}");
    assert_eq!(folder_contents(&dir), earlier, "the earlier folder is untouched");
    let beside: Vec<_> = std::fs::read_dir(work.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(beside, vec![std::ffi::OsString::from("model")], "no staging folder is left");
    write_weights(WeightsTarget::Folder(&out), &layout, zeros).unwrap();
    let now = folder_contents(&dir);
    let names: Vec<&str> = now.keys().map(String::as_str).collect();
    assert_eq!(names, ["README.md", "config.json", "model.safetensors"]);
    assert_eq!(now["README.md"], b"a model card");
    let written = strata::io::read_safetensors(&dir.join("model.safetensors")).unwrap();
    assert!(written.values().all(|t| t.abs().sum(Kind::Double).double_value(&[]) == 0.0), "the new weights");
}

/// Token rows of a batch.
type Rows = Vec<Vec<i64>>;

/// Rows of 12 tokens for training: `count` batches of two rows, inputs and next-token
/// targets, drawn by a fixed generator below the tokenizer's 90 words.
fn training_batches(count: usize) -> Vec<(Rows, Rows)> {
    let mut x: u64 = 7;
    let mut draw = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((x >> 33) % 90) as i64
    };
    (0..count)
        .map(|_| {
            let rows: Vec<Vec<i64>> = (0..2).map(|_| (0..13).map(|_| draw()).collect()).collect();
            (rows.iter().map(|r| r[..12].to_vec()).collect(), rows.iter().map(|r| r[1..].to_vec()).collect())
        })
        .collect()
}

fn rows_tensor(rows: &[Vec<i64>]) -> Tensor {
    let flat: Vec<i64> = rows.iter().flatten().copied().collect();
    Tensor::from_slice(&flat).view([rows.len() as i64, -1])
}

/// Ten AdamW steps on the same batches in Strata and in `transformers` (torch.optim's
/// AdamW): each step's loss agrees within 1e-5 relative, and training lowers the loss of
/// the first batch.
fn training_tracks_transformers(py: &Path, dir: &Path, work: &Path) {
    use strata::data::{Batch, Step};
    use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
    let batches = training_batches(10);
    let file = work.join("batches.json");
    std::fs::write(&file, serde_json::to_string(&batches).unwrap()).unwrap();
    let lr = 5e-3;
    let theirs: Vec<f64> = serde_json::from_str(&reference(
        py,
        &["train", "--dir", dir.to_str().unwrap(), "--batches", file.to_str().unwrap(), "--lr", &lr.to_string()],
    ))
    .unwrap();
    let mut engine = strata_engine(dir);
    let config = OptimizerConfig { lr, ..Default::default() };
    let optimizer = Optimizer::new(&mut engine, config, &[]).unwrap();
    let mut trainer = strata::train::Trainer::new(engine, optimizer, LrSchedule::Constant, None);
    for (i, ((inputs, targets), theirs)) in batches.iter().zip(&theirs).enumerate() {
        let batch = Batch::new(rows_tensor(inputs), rows_tensor(targets)).unwrap();
        let ours = trainer.train_step(&Step::new(i, vec![batch])).unwrap().loss;
        let relative = (ours - theirs).abs() / theirs.abs();
        assert!(relative <= 1e-5, "{}: step {i}: loss {ours}, transformers {theirs}", dir.display());
    }
    let (inputs, targets) = &batches[0];
    let logits = trainer.engine_mut().evaluate(&rows_tensor(inputs)).unwrap();
    let after = strata::model::layers::cross_entropy(&logits, &rows_tensor(targets)).unwrap().double_value(&[]);
    assert!(after < theirs[0] - 0.05, "training did not lower the first batch's loss: {} then {after}", theirs[0]);
}

/// One of today's decoder families end to end against `transformers`: a random folder (every
/// weight moved off its initial value) gives transformers' logits; ten AdamW steps track
/// transformers' own; the model written back (every weight moved again) loads in
/// transformers with Strata's logits; greedy generation, cached and not, equals
/// transformers' generate for `new_tokens` tokens (past every sliding window).
fn family_matches_transformers(family: &str, new_tokens: usize) {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let (dir, saved) = (work.path().join(family), work.path().join("saved"));
    make(&py, family, &dir, None);
    let theirs = transformers_logits(&py, &dir, work.path());
    let mut engine = strata_engine(&dir);
    let g = gap(&theirs, &strata_logits(&mut engine));
    eprintln!("{family}: largest logit difference from transformers {g:.2e}");
    assert!(g <= 1e-5, "{family}: logits differ from transformers' by {g}");

    training_tracks_transformers(&py, &dir, work.path());

    for k in 0..engine.spec().units.len() {
        let values = engine.full_unit(k).unwrap();
        engine.set_full_unit(k, &(&values + nudge(&values, k))).unwrap();
    }
    let ours = strata_logits(&mut engine);
    save_weights(
        &mut engine,
        WeightsTarget::Folder(&FolderOut::like(&saved, &from_pretrained_dir(&dir).unwrap())),
        true,
    )
    .unwrap();
    let g = gap(&transformers_logits(&py, &saved, work.path()), &ours);
    eprintln!("{family} written back: largest logit difference from transformers {g:.2e}");
    assert!(g <= 1e-5, "{family}: the written folder's logits differ by {g}");

    greedy_generation_matches(&py, family, &saved, &mut engine, new_tokens);
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    family_matches_transformers("llama3", 48);
}

#[test]
fn linear_rope_scaling_with_an_untied_head_matches_transformers() {
    family_matches_transformers("llama-linear", 48);
}

/// Dynamic scaling recomputes its frequencies as the sequence passes 8 positions, at every
/// generated token; its context is four times that.
#[test]
fn dynamic_rope_scaling_matches_transformers() {
    family_matches_transformers("llama-dynamic", 24);
}

#[test]
fn yarn_rope_scaling_matches_transformers() {
    family_matches_transformers("llama-yarn", 48);
}

/// Qwen3: query/key norms, heads twice as wide as hidden / heads, the second layer sliding.
#[test]
fn qwen3_with_wide_heads_and_a_sliding_layer_matches_transformers() {
    family_matches_transformers("qwen3", 48);
}

#[test]
fn qwen3_with_a_tied_head_matches_transformers() {
    family_matches_transformers("qwen3-tied", 48);
}

/// Qwen2's `use_sliding_window` from `max_window_layers` on.
#[test]
fn qwen2_sliding_layers_match_transformers() {
    family_matches_transformers("qwen2-sliding", 48);
}

#[test]
fn mistral_with_a_window_shorter_than_its_sequences_matches_transformers() {
    family_matches_transformers("mistral", 48);
}

/// Gemma 2: (1 + w) norms around attention and feed-forward, GeGLU, √d embeddings, a score
/// scale from query_pre_attn_scalar, both soft-caps, local and global layers alternating.
#[test]
fn gemma2_matches_transformers() {
    family_matches_transformers("gemma2", 48);
}

/// Gemma 3: query/key norms, two local layers with their own base and a global layer with
/// linear scaling, one key/value head.
#[test]
fn gemma3_matches_transformers() {
    family_matches_transformers("gemma3", 48);
}

/// Gemma 4: norms weighted from one, unscaled scores, values normed per head, global layers
/// with wider heads and one key/value head whose values are the key projection's, turned
/// proportionally, sliding local layers, capped logits, stored block scalars.
#[test]
fn gemma4_matches_transformers() {
    family_matches_transformers("gemma4", 48);
}

/// Gemma 4's mixture of experts: on every layer GeGLU experts beside the dense feed-forward,
/// each with its own norms, the router norming the residual stream and scaling each expert's
/// weight, the experts stacked on disk.
#[test]
fn gemma4_moe_matches_transformers() {
    family_matches_transformers("gemma4-moe", 48);
}

/// EXAONE 4: norms after attention and the feed-forward alone, per-head query/key norms,
/// sliding layers and full ones that turn no position.
#[test]
fn exaone4_matches_transformers() {
    family_matches_transformers("exaone4", 48);
}

/// Seed-OSS: biases on the query, key, value and output projections.
#[test]
fn seed_oss_matches_transformers() {
    family_matches_transformers("seed-oss", 32);
}

/// ERNIE 4.5: each head turned as adjacent pairs, a tied head.
#[test]
fn ernie4_5_matches_transformers() {
    family_matches_transformers("ernie4.5", 32);
}

/// ERNIE 4.5's mixture of experts: experts chosen by softmax scores plus a choice bias and
/// weighted by the scores alone, a shared expert, the first layer dense, heads turned as
/// adjacent pairs.
#[test]
fn ernie4_5_moe_matches_transformers() {
    experts_match_transformers("ernie4.5-moe", 4, 32);
}

/// HunYuan: per-head query/key norms after the rotation, the base stretched by its alpha.
#[test]
fn hunyuan_matches_transformers() {
    family_matches_transformers("hunyuan", 32);
}

/// HunYuan-MoE: HunYuan's attention over every layer's 4 experts, top 2 renormalised (given
/// per layer), beside a shared expert; the router and shared expert under their own names.
/// Its class has no load-balancing loss.
#[test]
fn hunyuan_moe_matches_transformers() {
    family_matches_transformers("hunyuan-moe", 32);
}

/// Granite: multipliers of the embeddings, of each sub-layer's output and of the scores, and
/// a divisor of the logits, with a tied head.
#[test]
fn granite_matches_transformers() {
    family_matches_transformers("granite", 32);
}

/// Arcee: a feed-forward of ReLU² without a gate, biases on every attention projection,
/// YaRN's rotation.
#[test]
fn arcee_matches_transformers() {
    family_matches_transformers("arcee", 32);
}

/// StarCoder2: layer norms with biases, biases on every projection, GELU (tanh) without a
/// gate under `c_fc`/`c_proj`, every layer sliding, a tied head; ten steps with dropout after
/// the embeddings, of the scores and of each sub-layer's output (Strata's masks on both sides).
#[test]
fn starcoder2_matches_transformers() {
    family_matches_transformers("starcoder2", 32);
}

/// Nemotron: layer norms with biases scaled by `1 + w`, ReLU² without a gate, half of each
/// head turned, biases on the attention and the feed-forward.
#[test]
fn nemotron_matches_transformers() {
    family_matches_transformers("nemotron", 32);
}

/// Apertus: per-head query/key norms, xIELU without a gate (its scales trained, its beta and
/// eps stored), Llama 3's rotation, its block norms under their own names.
#[test]
fn apertus_matches_transformers() {
    family_matches_transformers("apertus", 32);
}

/// Llama 4's language model: heads turned as adjacent pairs and normed without a weight on
/// three layers of four, attending within chunks of 4 there; the fourth turning no position,
/// its queries scaled up with it; every other layer's experts (2 of 4) chosen by sigmoid
/// scores that scale their inputs, beside a shared expert; the experts stacked input-major.
#[test]
fn llama4_matches_transformers() {
    family_matches_transformers("llama4", 32);
}

/// Cohere's Command R: layer norms without a bias, attention and the feed-forward side by
/// side on one norm, heads turned as adjacent pairs, the logits scaled, a tied head.
#[test]
fn cohere_matches_transformers() {
    family_matches_transformers("cohere", 32);
}

/// Cohere 2 (Command R7B): Cohere's layers, three of four sliding and turning positions, the
/// fourth attending to all and turning none.
#[test]
fn cohere2_matches_transformers() {
    family_matches_transformers("cohere2", 32);
}

/// MiniMax-M2: Mixtral's experts and names (4, top 2) chosen by sigmoid scores plus a drawn
/// choice bias and weighted by the renormalised scores, its load-balancing loss over the
/// logits' softmax as its class computes it; query/key norms over whole projections, half of
/// each head turned (`rotary_dim`).
#[test]
fn minimax_m2_matches_transformers() {
    experts_match_transformers("minimax-m2", 4, 24);
}

/// Granite-MoE: Granite's multipliers over every layer's 4 experts, top 2 renormalised,
/// stacked in its files as `input_linear` and `output_linear`.
#[test]
fn granite_moe_matches_transformers() {
    experts_match_transformers("granite-moe", 4, 24);
}

/// LFM2: gated short convolutions with biases on three layers of four, attention with
/// per-head query/key norms on the other, under its own names, its feed-forward's width as
/// its class adjusts it.
#[test]
fn lfm2_matches_transformers() {
    family_matches_transformers("lfm2", 24);
}

/// LFM2-MoE: LFM2's layers, the first dense, the others' experts chosen by sigmoid scores
/// plus a choice bias, weighted by the renormalised scores (its own epsilon) times the
/// routed scale; no load-balancing loss.
#[test]
fn lfm2_moe_matches_transformers() {
    family_matches_transformers("lfm2-moe", 24);
}

/// Bamba: Mamba-2 mixers on three layers of four (biases on their projections), attention
/// turning half of each head on the other, its own norms' and feed-forward's names.
#[test]
fn bamba_matches_transformers() {
    family_matches_transformers("bamba", 24);
}

/// Granite 4's H models: Mamba-2 mixers (their scan over two chunks of the rows) on three
/// layers of four, attention turning no position on the other, every layer's 4 experts (top
/// 2) beside its `shared_mlp`, Granite's multipliers.
#[test]
fn granite4_hybrid_matches_transformers() {
    experts_match_transformers("granite4-hybrid", 4, 24);
}

/// Granite 4 without experts: the `shared_mlp` alone, rotated attention beside a Mamba-2
/// layer with biases on its projections and its step bounded, a tied head.
#[test]
fn granite4_dense_matches_transformers() {
    family_matches_transformers("granite4-dense", 24);
}

/// Solar Open: LLaMA's attention with biases on its query, key and value projections alone,
/// over DeepSeek-V3's grouped sigmoid routing on every layer beside a shared expert.
#[test]
fn solar_open_matches_transformers() {
    family_matches_transformers("solar-open", 24);
}

/// dots.llm1: Qwen3's attention, sliding on its last layer, over DeepSeek-V3's grouped
/// sigmoid routing with a choice bias, a shared expert and a dense first layer.
#[test]
fn dots1_matches_transformers() {
    family_matches_transformers("dots1", 24);
}

/// OLMo Hybrid as released: OLMo 3's attention turning no position beside Gated DeltaNet
/// layers with their projections apart and their betas doubled, each kind of layer normed
/// its own way.
#[test]
fn olmo_hybrid_matches_transformers() {
    family_matches_transformers("olmo-hybrid", 24);
}

/// Nemotron-H: each layer one sub-layer behind its norm (Mamba-2 mixers scanning two chunks,
/// attention turning no position, a ReLU² feed-forward, ReLU² experts without a gate chosen
/// within groups by biased sigmoid scores beside a shared one), under its `backbone.` names
/// with each layer's `mixer`.
#[test]
fn nemotron_h_matches_transformers() {
    family_matches_transformers("nemotron-h", 24);
}

/// Falcon-H1 (its larger releases' mixers): on every layer a Mamba-2 mixer 48 wide (not a
/// multiple of the hidden size), gated then normed, beside attention with heads of their own
/// width, under Bamba's names; every μP multiplier (embeddings, keys, each mixer's input and
/// output, the mixer's five projected parts, the feed-forward's gate and output, the logits)
/// away from one.
#[test]
fn falcon_h1_matches_transformers() {
    family_matches_transformers("falcon-h1", 24);
}

/// Jamba: Mamba-1 mixers (each state value decaying at its own rate, the step, `B` and `C`
/// normed with weights, biases on the projections) on even layers, attention turning no
/// position on odd ones, four experts (top 2, weights unrenormalised) on every other layer
/// beside dense networks on the others; its load-balancing loss.
#[test]
fn jamba_matches_transformers() {
    experts_match_transformers("jamba", 4, 24);
}

/// Mamba and Falcon Mamba: every layer a Mamba-1 mixer alone behind its norm under
/// `backbone.` (Falcon Mamba's step, `B` and `C` normed without a weight).
#[test]
fn mamba_and_falcon_mamba_match_transformers() {
    family_matches_transformers("mamba", 24);
    family_matches_transformers("falcon-mamba", 24);
}

/// Falcon-H1's other mixer outputs: gated without a norm (its 0.5B model's, beside a tied
/// head), and normed before the gate (its class's order where `mamba_rms_norm` alone is set).
#[test]
fn falcon_h1_mixer_norms_match_transformers() {
    logits_match("falcon-h1-ungated", None);
    logits_match("falcon-h1-norm-first", None);
}

/// Phi-3.5 and Phi-4-mini's LongRoPE: short factors within the original context, long ones
/// past it, the cosines and sines scaled: rows of 24 positions (long factors) give
/// transformers' logits; greedy generation runs four tokens past the original context (the
/// tiny model's top two logits lie within 1e-3 at some later steps, where rounding decides).
#[test]
fn phi3_longrope_matches_transformers() {
    family_matches_transformers("phi3-longrope", 14);
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("phi3-longrope");
    make(&py, "phi3-longrope", &dir, None);
    let rows: Vec<Vec<i64>> = (0..2).map(|r| (0..24).map(|t| (7 * t + 13 * r + 5) % 90).collect()).collect();
    let out = work.path().join("long.safetensors");
    let tokens = serde_json::to_string(&rows).unwrap();
    reference(&py, &["logits", "--dir", dir.to_str().unwrap(), "--tokens", &tokens, "--out", out.to_str().unwrap()]);
    let theirs = strata::io::read_safetensors(&out).unwrap().remove("logits").unwrap();
    let ours = strata_engine(&dir).evaluate(&rows_tensor(&rows)).unwrap();
    let g = gap(&theirs, &ours);
    eprintln!("phi3-longrope: 24 positions, largest logit difference {g:.2e}");
    assert!(g <= 1e-5, "phi3-longrope: past the original context the logits differ by {g}");
}

/// Phi-3: fused qkv_proj and gate_up_proj, a half-width rotation, a sliding window.
#[test]
fn phi3_matches_transformers() {
    family_matches_transformers("phi3", 48);
}

/// A mixture of experts' load-balancing loss over the test rows, Strata's against
/// `transformers`' (within 1e-6 relative), with the experts' loads it reports; then the
/// family end to end (logits, training with the loss, the folder written back, `new_tokens`
/// of greedy generation).
fn experts_match_transformers(family: &str, experts: i64, new_tokens: usize) {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join(family);
    make(&py, family, &dir, None);
    let out = work.path().join("logits.safetensors");
    let rows = serde_json::to_string(&ROWS).unwrap();
    reference(&py, &["logits", "--dir", dir.to_str().unwrap(), "--tokens", &rows, "--out", out.to_str().unwrap()]);
    let theirs = strata::io::read_safetensors(&out).unwrap().remove("aux_loss").unwrap().double_value(&[0]);
    let mut engine = strata_engine(&dir);
    let flat: Vec<i64> = ROWS.iter().flatten().copied().collect();
    let _logits = engine.forward(&Tensor::from_slice(&flat).view([2, 12])).unwrap();
    let report = engine.routed().expect("a mixture of experts reports its routing").report;
    let relative = (report.aux_loss - theirs).abs() / theirs.abs();
    eprintln!("{family}: load-balancing loss {} (transformers {theirs}), relative gap {relative:.1e}", report.aux_loss);
    assert!(relative <= 1e-6, "{family}: load-balancing loss {} against transformers' {theirs}", report.aux_loss);
    // Balanced routing gives 1 (per layer, k slots spread evenly); the tiny random routers
    // send some experts more than others.
    assert!(report.aux_loss > 0.5 && report.aux_loss < experts as f64, "{family}: {report:?}");
    assert!(report.max_expert_tokens > report.min_expert_tokens, "{family}: {report:?}");
    padding_is_left_out_as_transformers_leaves_it_out(&py, family, &dir, work.path(), report.aux_loss);
    family_matches_transformers(family, new_tokens);
}

/// With the second row's last five positions padding (`transformers`' `attention_mask`, a
/// batch's `padding` here), a training step's load-balancing loss equals `transformers`'
/// (1e-6 relative), which leaves padding out of the routing statistics, and differs from
/// the unpadded rows' `unpadded`.
fn padding_is_left_out_as_transformers_leaves_it_out(py: &Path, family: &str, dir: &Path, work: &Path, unpadded: f64) {
    let mask: Vec<Vec<i64>> = (0..2).map(|r| (0..12).map(|t| i64::from(r == 0 || t < 7)).collect()).collect();
    let out = work.join("padded.safetensors");
    let (rows, masks) = (serde_json::to_string(&ROWS).unwrap(), serde_json::to_string(&mask).unwrap());
    let args = ["logits", "--dir", dir.to_str().unwrap(), "--tokens", &rows, "--mask", &masks];
    reference(py, &[&args[..], &["--out", out.to_str().unwrap()]].concat());
    let theirs = strata::io::read_safetensors(&out).unwrap().remove("aux_loss").unwrap().double_value(&[0]);
    use strata::data::{Batch, Step};
    use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
    let mut engine = strata_engine(dir);
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    let mut trainer = strata::train::Trainer::new(engine, optimizer, LrSchedule::Constant, None);
    let flat: Vec<i64> = ROWS.iter().flatten().copied().collect();
    let tokens = Tensor::from_slice(&flat).view([2, 12]);
    let mut batch = Batch::new(tokens.shallow_clone(), tokens.roll([-1], [1])).unwrap();
    let padding: Vec<bool> = mask.iter().flatten().map(|&m| m == 0).collect();
    batch.padding = Some(Tensor::from_slice(&padding).view([2, 12]));
    let report = trainer.train_step(&Step::new(0, vec![batch])).unwrap();
    let ours = report.experts.expect("a mixture of experts reports its routing").aux_loss;
    let relative = (ours - theirs).abs() / theirs.abs();
    eprintln!("{family}: padded rows' load-balancing loss {ours} (transformers {theirs}), relative gap {relative:.1e}");
    assert!(relative <= 1e-6, "{family}: padded load-balancing loss {ours} against transformers' {theirs}");
    assert!((ours - unpadded).abs() > 1e-4, "{family}: padding changed nothing ({ours} and {unpadded})");
}

/// Mixtral: every layer's 4 experts under Mixtral's names, top 2 renormalised.
#[test]
fn mixtral_matches_transformers() {
    experts_match_transformers("mixtral", 4, 24);
}

/// Qwen2-MoE: a gated shared expert beside the routed ones, unnormalised top-k weights,
/// attention biases, a dense layer among the sparse ones (`mlp_only_layers`).
#[test]
fn qwen2_moe_matches_transformers() {
    experts_match_transformers("qwen2-moe", 4, 24);
}

/// Qwen3-MoE: 16 experts, top 4 renormalised, per-head query/key norms, every other layer
/// sparse (`decoder_sparse_step`).
#[test]
fn qwen3_moe_matches_transformers() {
    experts_match_transformers("qwen3-moe", 16, 24);
}

/// The router z-loss (a folder's `router_z_loss_coef`) trains the routers beside the
/// load-balancing loss: ten AdamW steps track the reference's autograd through both, and
/// the forward reports it.
#[test]
fn the_router_z_loss_trains_as_autograd_computes_it() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("qwen3-moe-z");
    make(&py, "qwen3-moe-z", &dir, None);
    training_tracks_transformers(&py, &dir, work.path());
    let mut engine = strata_engine(&dir);
    let flat: Vec<i64> = ROWS.iter().flatten().copied().collect();
    let _logits = engine.forward(&Tensor::from_slice(&flat).view([2, 12])).unwrap();
    let report = engine.routed().unwrap().report;
    // Two sparse layers of 16 experts: each mean of logsumexp² lies near (ln 16)² ≈ 7.7.
    assert!(report.z_loss > 2.0 && report.z_loss < 40.0, "{report:?}");
}

/// OLMoE: query and key norms over whole projections, clipped projections, 8 experts.
#[test]
fn olmoe_matches_transformers() {
    experts_match_transformers("olmoe", 8, 24);
}

/// FlexOlmo: OLMo 2's norms after attention and the feed-forward, 6 experts.
#[test]
fn flex_olmo_matches_transformers() {
    experts_match_transformers("flex-olmo", 6, 24);
}

/// DeepSeek-V2 (V2-Lite's shape): latent attention with whole queries, rotated pairs
/// turned as complex numbers, YaRN's mscale; experts chosen greedily by softmax, weighted
/// unrenormalised times the routed scale, beside a shared expert, a dense first layer.
#[test]
fn deepseek_v2_matches_transformers() {
    family_matches_transformers("deepseek-v2", 24);
}

/// DeepSeek-V3: latent attention (low-rank queries, interleaved rotated pairs, YaRN's
/// mscale on the rotation and on the scores) and sigmoid routing with a choice bias among
/// groups, two shared experts and a dense first layer: logits, ten training steps, the
/// folder written back, and greedy generation from a cache of latents.
#[test]
fn deepseek_v3_matches_transformers() {
    family_matches_transformers("deepseek-v3", 32);
}

/// A released DeepSeek-V3 folder stores its multi-token prediction layer past the last
/// (`model.layers.61` at full size): Strata leaves it out, as `transformers` does, and
/// reads the same model; a tensor past a LLaMA's last layer is still refused by name.
#[test]
fn multi_token_prediction_layers_are_left_out_where_the_family_stores_them() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let with_extra = |family: &str| {
        let dir = work.path().join(family);
        make(&py, family, &dir, None);
        let file = dir.join("model.safetensors");
        let mut tensors = strata::io::read_safetensors(&file).unwrap();
        let layers = (0..).take_while(|i| tensors.keys().any(|k| k.starts_with(&format!("model.layers.{i}.")))).count();
        let extra = format!("model.layers.{layers}.eh_proj.weight");
        tensors.insert(extra.clone(), Tensor::ones([4, 4], (tch::Kind::Float, tch::Device::Cpu)));
        std::fs::write(&file, strata::io::to_safetensors(tensors.iter().map(|(n, t)| (n.as_str(), t))).unwrap())
            .unwrap();
        (dir, extra)
    };
    let (deepseek, _) = with_extra("deepseek-v3");
    let g = gap(&transformers_logits(&py, &deepseek, work.path()), &strata_logits(&mut strata_engine(&deepseek)));
    assert!(g <= 1e-5, "deepseek-v3 beside its prediction layer: logits differ by {g}");
    let (llama, extra) = with_extra("llama3");
    let folder = from_pretrained_dir(&llama).unwrap();
    let mut engine = Engine::new(folder.spec().unwrap(), EngineConfig::default()).unwrap();
    let refused = load_model_dir(&mut engine, &folder).unwrap_err().to_string();
    assert!(refused.contains(&format!("unknown tensor {extra:?}")), "{refused}");
}

/// GLM-4.7-Flash: DeepSeek-V3's latent attention and routing in one group with a shared
/// expert, a dense layer after a sparse one as `mlp_layer_types` names them.
#[test]
fn glm4_moe_lite_matches_transformers() {
    family_matches_transformers("glm4-moe-lite", 32);
}

/// Mistral 4: DeepSeek-V3's latent attention with the queries scaled up by position (in
/// generation too), softmax routing among groups without a choice bias, a shared expert,
/// the experts stacked on disk (taken apart on load and stacked again on save).
#[test]
fn mistral4_matches_transformers() {
    family_matches_transformers("mistral4", 32);
}

/// DeepSeek-V3 with one query projection, rotated halves, unscaled rotation, a tied head,
/// every layer sparse and unnormalised routing weights.
#[test]
fn deepseek_v3_with_one_query_projection_matches_transformers() {
    logits_match("deepseek-v3-plain", None);
}

/// GLM-4.5: DeepSeek's routing (groups, routed scale, a shared expert) under grouped-query
/// attention with half-turned heads, query/key norms and query/key/value biases.
#[test]
fn glm4_moe_matches_transformers() {
    family_matches_transformers("glm4-moe", 32);
}

/// gpt-oss: attention sinks, biases everywhere, sliding and full layers alternating, YaRN,
/// experts with biases and a clamped SwiGLU, stacked on disk (taken apart on load and
/// stacked again on save).
#[test]
fn gpt_oss_matches_transformers() {
    experts_match_transformers("gpt-oss", 4, 32);
}

/// Qwen3-Next: Gated DeltaNet linear attention on half the layers (a short causal
/// convolution, the gated delta rule in chunks, a gated norm), gated full attention with a
/// quarter of each head turned on the others, zero-centred norms, experts beside a gated
/// shared expert; generation carries the convolution's inputs and the recurrent state.
#[test]
fn qwen3_next_matches_transformers() {
    experts_match_transformers("qwen3-next", 4, 32);
}

/// OLMo 2: no norm before attention or the feed-forward, one after each; query and key
/// norms over each projection whole.
#[test]
fn olmo2_matches_transformers() {
    family_matches_transformers("olmo2", 32);
}

/// OLMo 3: OLMo 2's layers, three of four sliding, YaRN on the full layer and another base
/// on the sliding ones, a tied head.
#[test]
fn olmo3_matches_transformers() {
    family_matches_transformers("olmo3", 32);
}

/// GLM-4: norms after attention and the feed-forward beside those before them, under GLM's
/// names; a fused gate and up projection; half of each head turned as adjacent pairs.
#[test]
fn glm4_matches_transformers() {
    family_matches_transformers("glm4", 32);
}

/// Ministral 3: queries scaled up by position past every fourth (and, in generation, at
/// each decoded position), YaRN, a window on every layer.
#[test]
fn ministral3_matches_transformers() {
    family_matches_transformers("ministral3", 32);
}

/// SmolLM3: two of four layers turn no position (NoPE) and attend through a sliding window.
#[test]
fn smollm3_matches_transformers() {
    family_matches_transformers("smollm3", 32);
}

/// Qwen3.5: Qwen3-Next's layers with the linear attention's queries, keys and values, gates,
/// betas and decays each projected apart, a dense feed-forward and a tied head.
#[test]
fn qwen3_5_matches_transformers() {
    family_matches_transformers("qwen3.5", 32);
}

/// Qwen3.5's mixture of experts: every layer sparse beside a gated shared expert, the
/// routing weights renormalised though its configuration names no `norm_topk_prob`.
#[test]
fn qwen3_5_moe_matches_transformers() {
    experts_match_transformers("qwen3.5-moe", 4, 32);
}

/// Gemma 3 as released: the language model of a folder that holds an image model and its
/// projector beside it, under the names releases are saved with, its head tied by the outer
/// configuration; written back whole.
#[test]
fn gemma3_release_matches_transformers() {
    release_matches_transformers("gemma3-release", "gemma3");
}

/// Gemma 4 as released: its language model (the global layers' values projected apart)
/// beside an image model and its embedder, under `model.language_model.`; written back whole.
#[test]
fn gemma4_release_matches_transformers() {
    release_matches_transformers("gemma4-release", "gemma4");
}

/// Llama 4 as released (Scout, Maverick): its language model beside an image model and its
/// projector, under `language_model.`; written back whole.
#[test]
fn llama4_release_matches_transformers() {
    release_matches_transformers("llama4-release", "llama4");
}

/// Mistral 3 as released before `transformers` 5 (Mistral Small 3.1): the language model
/// beside an image model, a stored head kept apart from the embedding though the outer
/// configuration's default ties them, as `transformers` keeps it.
#[test]
fn mistral3_release_matches_transformers() {
    release_matches_transformers("mistral3-release", "mistral3");
}

/// Qwen2.5-VL as released: Qwen2's layers beside an image model, read as the language model
/// and written back under the names `save_pretrained` gives them (`model.`, `visual.`), its
/// rotation's sections per axis kept.
#[test]
fn qwen2_5_vl_release_matches_transformers() {
    release_matches_transformers("qwen2.5-vl-release", "qwen2_5_vl");
}

/// Qwen3-VL as released: Qwen3's layers beside an image model (its features entering early
/// layers), read as the language model, as `transformers` runs it on text; written back, the
/// rotation's sections per axis, which the image positions need, are the release's.
#[test]
fn qwen3_vl_release_matches_transformers() {
    release_matches_transformers("qwen3-vl-release", "qwen3_vl");
}

/// Qwen3-VL-MoE as released: its experts (two of four per token, the first layer dense)
/// stacked output-major, as `transformers` 5 saves them, and the same folder with its stacks
/// input-major, as the releases hold them, give one model.
#[test]
fn qwen3_vl_moe_release_matches_transformers() {
    release_matches_transformers("qwen3-vl-moe-release", "qwen3_vl_moe");
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let (dir, released) = (work.path().join("saved"), work.path().join("released"));
    make(&py, "qwen3-vl-moe-release", &dir, None);
    std::fs::create_dir(&released).unwrap();
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(dir.join(file), released.join(file)).unwrap();
    }
    let tensors = strata::io::read_safetensors(&dir.join("model.safetensors")).unwrap();
    let input_major: Vec<(String, Tensor)> = tensors
        .into_iter()
        .map(|(name, t)| match name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj") {
            true => (name, t.transpose(1, 2).contiguous()),
            false => (name, t),
        })
        .collect();
    let bytes = strata::io::to_safetensors(input_major.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    std::fs::write(released.join("model.safetensors"), bytes).unwrap();
    let g = gap(&strata_logits(&mut strata_engine(&dir)), &strata_logits(&mut strata_engine(&released)));
    assert_eq!(g, 0.0, "the stacks read otherwise input-major");
}

/// Mistral Small 4 as released: Mistral 4's text model (its experts stacked on disk) inside
/// Mistral 3's release.
#[test]
fn mistral4_release_matches_transformers() {
    release_matches_transformers("mistral4-release", "mistral3");
}

/// A release's language model matches `transformers` ([`family_matches_transformers`], its
/// written folder read as the release), and a folder written back is the release whole:
/// its `config.json` the release's around the trained language model's, its other parts'
/// tensors the source's as they were, every tensor under the source's name.
fn release_matches_transformers(family: &str, model_type: &str) {
    family_matches_transformers(family, 32);
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let (dir, saved) = (work.path().join(family), work.path().join("saved"));
    make(&py, family, &dir, None);
    std::fs::write(dir.join("preprocessor_config.json"), r#"{"image_seq_length": 4}"#).unwrap();
    std::fs::create_dir(dir.join("additional_chat_templates")).unwrap();
    std::fs::write(dir.join("additional_chat_templates/tool_use.jinja"), "{{ messages }}").unwrap();
    let source = from_pretrained_dir(&dir).unwrap();
    save_weights(&mut strata_engine(&dir), WeightsTarget::Folder(&FolderOut::like(&saved, &source)), true).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], model_type);
    let release = source.release.as_ref().expect("a release");
    assert_eq!(config["text_config"]["num_hidden_layers"], release["text_config"]["num_hidden_layers"]);
    for key in ["mrope_section", "mrope_interleaved"] {
        let given = &release["text_config"]["rope_parameters"][key];
        assert_eq!(&config["text_config"]["rope_parameters"][key], given, "{key}");
    }
    let before = strata::io::read_safetensors(&source.weights[0]).unwrap();
    let after = strata::io::read_safetensors(&saved.join("model.safetensors")).unwrap();
    let other = |t: &BTreeMap<String, Tensor>| {
        t.keys().filter(|n| !n.contains("language_model") && !n.starts_with("lm_head")).cloned().collect::<Vec<_>>()
    };
    assert!(!other(&before).is_empty() && other(&before) == other(&after), "{:?}", other(&after));
    for name in other(&before) {
        assert!(before[&name].equal(&after[&name]), "{name} changed");
    }
    // The language model's under the names save_pretrained gives them, as in the source.
    assert!(before.keys().eq(after.keys()), "{:?}", after.keys());
    assert!(saved.join("preprocessor_config.json").is_file(), "the processor's files go along");
    let template = std::fs::read_to_string(saved.join("additional_chat_templates/tool_use.jinja")).unwrap();
    assert_eq!(template, "{{ messages }}", "the tokenizer's named chat templates go along");
}

/// gpt-oss's released MXFP4 experts: a folder whose expert stacks are MXFP4 blocks and
/// scales loads as the folder holding `transformers`' own dequantization of them, and its
/// logits are `transformers`' on that folder; quantizing moved them off the original
/// folder's. A folder quantized another way is refused in one line.
#[test]
fn gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let (source, quantized, dequantized) = (work.path().join("gpt-oss"), work.path().join("q"), work.path().join("d"));
    make(&py, "gpt-oss", &source, None);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    reference(&py, &["mxfp4", "--dir", &s(&source), "--quantized", &s(&quantized), "--dequantized", &s(&dequantized)]);
    let ours = strata_logits(&mut strata_engine(&quantized));
    let g = gap(&ours, &strata_logits(&mut strata_engine(&dequantized)));
    assert_eq!(g, 0.0, "MXFP4 dequantized unlike transformers (largest logit difference {g})");
    let g = gap(&ours, &transformers_logits(&py, &dequantized, work.path()));
    assert!(g < 1e-5, "logits differ from transformers' by {g}");
    let moved = gap(&ours, &strata_logits(&mut strata_engine(&source)));
    assert!(moved > 1e-3, "quantizing changed no logit ({moved})");
    let config = quantized.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap().replace("\"mxfp4\"", "\"bitsandbytes\"");
    std::fs::write(&config, text).unwrap();
    let refused = from_pretrained_dir(&quantized).unwrap_err().to_string();
    assert!(refused.contains("quantized weights (bitsandbytes) are not read"), "{refused}");
}

/// fp8 releases: a folder whose linear layers are E4M3, with a scale per tile beside each
/// (DeepSeek-V3's and MiniMax-M2's fine-grained fp8) or one per weight (Mistral 3's, image
/// model and all), gives the logits `transformers` gives loading the same folder (it
/// dequantizes where no GPU runs fp8), quantizing having moved them off the original
/// folder's. Written back, the release holds floats, its image model's dequantized too,
/// without a `quantization_config`, and `transformers` reads the same logits from it.
#[test]
fn fp8_releases_load_as_transformers_dequantizes_them() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    // Tiles that divide each fixture's widths, as transformers asks.
    for (family, block) in [("deepseek-v3", "4"), ("minimax-m2", "8"), ("mistral3-release", "0")] {
        let (source, quantized) = (work.path().join(family), work.path().join(format!("{family}-fp8")));
        make(&py, family, &source, None);
        reference(&py, &["fp8", "--dir", &s(&source), "--quantized", &s(&quantized), "--block", block]);
        let mut engine = strata_engine(&quantized);
        let ours = strata_logits(&mut engine);
        let g = gap(&ours, &transformers_logits(&py, &quantized, work.path()));
        eprintln!("{family} in fp8: largest logit difference from transformers {g:.2e}");
        assert!(g < 1e-5, "{family}: logits differ from transformers' by {g}");
        let moved = gap(&ours, &strata_logits(&mut strata_engine(&source)));
        assert!(moved > 1e-3, "{family}: quantizing changed no logit ({moved})");
        if block == "0" {
            let saved = work.path().join("saved");
            let folder = from_pretrained_dir(&quantized).unwrap();
            save_weights(&mut engine, WeightsTarget::Folder(&FolderOut::like(&saved, &folder)), true).unwrap();
            let config = std::fs::read_to_string(saved.join("config.json")).unwrap();
            assert!(!config.contains("quantization_config"), "{config}");
            let written = strata::io::read_safetensors(&saved.join("model.safetensors")).unwrap();
            let (names, kinds): (Vec<_>, Vec<_>) = written.iter().map(|(n, t)| (n.as_str(), t.kind())).unzip();
            assert!(names.iter().any(|n| n.contains("vision_tower")), "{names:?}");
            assert!(names.iter().all(|n| !n.ends_with("_scale_inv")), "{names:?}");
            assert!(kinds.iter().all(|k| *k == Kind::Float), "{kinds:?}");
            let g = gap(&ours, &transformers_logits(&py, &saved, work.path()));
            assert!(g < 1e-5, "the written folder's logits differ by {g}");
        }
    }
}

/// Examples packed two rows of 12: each row's examples one after another, then padding.
const PACKED: [&[&[i64]]; 2] =
    [&[&[5, 17, 3, 88, 40], &[41, 9, 0, 63], &[12, 77]], &[&[94, 1, 1, 30, 58, 6, 19], &[71, 4, 95, 50, 33]]];

/// The packed rows' ids and layout (positions restart per example; the padding is one more
/// example of its own).
fn packed_rows(rows: &[&[&[i64]]]) -> (Tensor, strata::model::RowLayout) {
    let (mut ids, mut positions, mut examples) = (vec![], vec![], vec![]);
    for row in rows {
        let used: usize = row.iter().map(|e| e.len()).sum();
        for (n, example) in row.iter().chain(std::iter::once(&&[0i64; 12][..12 - used])).enumerate() {
            ids.extend_from_slice(example);
            positions.extend(0..example.len() as i64);
            examples.extend(std::iter::repeat_n(n as i64, example.len()));
        }
    }
    let shape = [rows.len() as i64, 12];
    let t = |v: &[i64]| Tensor::from_slice(v).view(shape);
    (
        t(&ids),
        strata::model::RowLayout { positions: t(&positions), examples: t(&examples), segments: None, source_len: None },
    )
}

/// Each packed example's logits, in order.
fn packed_logits(engine: &mut Engine, rows: &[&[&[i64]]]) -> Vec<Tensor> {
    let (ids, layout) = packed_rows(rows);
    engine.set_layout(Some(&layout));
    let logits = engine.evaluate(&ids).unwrap();
    engine.set_layout(None);
    let mut out = vec![];
    for (r, row) in rows.iter().enumerate() {
        let mut start = 0;
        for example in row.iter() {
            out.push(logits.get(r as i64).narrow(0, start, example.len() as i64));
            start += example.len() as i64;
        }
    }
    out
}

/// A packed row gives each example the logits it has alone in `transformers` (so the same
/// loss under any labels), and changing one example changes no other's logits at all.
fn packing_matches(family: &str) {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join(family);
    make(&py, family, &dir, None);
    let mut engine = strata_engine(&dir);
    let ours = packed_logits(&mut engine, &PACKED);
    let examples: Vec<&[i64]> = PACKED.iter().flat_map(|r| r.iter().copied()).collect();
    for (example, ours) in examples.iter().zip(&ours) {
        let out = work.path().join("alone.safetensors");
        let rows = serde_json::to_string(&[example]).unwrap();
        reference(&py, &["logits", "--dir", dir.to_str().unwrap(), "--tokens", &rows, "--out", out.to_str().unwrap()]);
        let theirs = strata::io::read_safetensors(&out).unwrap().remove("logits").unwrap().get(0);
        let g = gap(&theirs, ours);
        // The loss with the first token's prediction ignored where more follow (a prompt), as
        // labels of -100 say; the last token predicts nothing.
        let next = |j: usize| if j == 0 && example.len() > 2 { -100 } else { example[j + 1] };
        let labels: Vec<i64> = (0..example.len() - 1).map(next).chain([-100]).collect();
        let labels = Tensor::from_slice(&labels);
        let loss = |l: &Tensor| {
            l.cross_entropy_loss::<&Tensor>(&labels, None, tch::Reduction::Mean, -100, 0.0).double_value(&[])
        };
        let loss_gap = (loss(&theirs) - loss(ours)).abs();
        eprintln!(
            "{family}: example of {} tokens packed: logits within {g:.2e}, loss within {loss_gap:.2e}",
            example.len()
        );
        assert!(
            g < 1e-5 && loss_gap < 1e-5,
            "{family}: a packed example's logits differ by {g}, its loss by {loss_gap}"
        );
    }
    // The second example of the first row changed: the first and third read nothing of it.
    let mut changed: Vec<Vec<Vec<i64>>> = PACKED.iter().map(|r| r.iter().map(|e| e.to_vec()).collect()).collect();
    changed[0][1] = vec![2, 2, 2, 2];
    let changed: Vec<Vec<&[i64]>> = changed.iter().map(|r| r.iter().map(Vec::as_slice).collect()).collect();
    let changed: Vec<&[&[i64]]> = changed.iter().map(Vec::as_slice).collect();
    let after = packed_logits(&mut engine, &changed);
    for k in [0, 2, 3, 4] {
        assert!(after[k].equal(&ours[k]), "{family}: example {k} changed with another example of its row");
    }
    assert!(!after[1].equal(&ours[1]));
}

#[test]
fn packed_gpt2_examples_equal_each_alone_in_transformers() {
    packing_matches("gpt2");
}

/// Ministral 3, a LLaMA with a window: each packed example's positions start again for its
/// rotation and its queries' scale.
#[test]
fn packed_ministral3_examples_equal_each_alone_in_transformers() {
    packing_matches("ministral3");
}

/// Two rows of a BERT batch: the first a full text pair (types 0 then 1), the second a
/// shorter pair padded with token 0 after its eighth token.
const ENCODER_ROWS: [[i64; 12]; 2] =
    [[2, 17, 3, 88, 40, 41, 9, 5, 63, 12, 77, 3], [2, 1, 30, 58, 3, 19, 71, 3, 0, 0, 0, 0]];
const ENCODER_TYPES: [[i64; 12]; 2] = [[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]];
const ENCODER_LENGTHS: [i64; 2] = [12, 8];

/// BERT's logits and loss in `transformers` for the encoder rows and `labels`.
fn transformers_encoder(py: &Path, dir: &Path, work: &Path, labels: &str) -> (Tensor, f64) {
    let out = work.join("encoder.safetensors");
    let mask: Vec<Vec<i64>> = ENCODER_LENGTHS.iter().map(|&n| (0..12).map(|i| i64::from(i < n)).collect()).collect();
    let tokens = serde_json::to_string(&ENCODER_ROWS).unwrap();
    let (types, mask) = (serde_json::to_string(&ENCODER_TYPES).unwrap(), serde_json::to_string(&mask).unwrap());
    let dir = dir.to_str().unwrap();
    let args = ["encoder", "--dir", dir, "--tokens", &tokens, "--types", &types, "--mask", &mask, "--labels", labels];
    reference(py, &[&args[..], &["--out", out.to_str().unwrap()]].concat());
    let mut read = strata::io::read_safetensors(&out).unwrap();
    (read.remove("logits").unwrap(), read.remove("loss").unwrap().double_value(&[0]))
}

/// The rows' layout: positions counted from 0, each row's padding an example of its own
/// (so no token attends to it), and the token types as segments.
fn encoder_layout() -> strata::model::RowLayout {
    let rows = |f: &dyn Fn(usize, i64) -> i64| {
        let v: Vec<i64> = (0..2).flat_map(|r| (0..12).map(move |i| (r, i))).map(|(r, i)| f(r, i)).collect();
        Tensor::from_slice(&v).view([2, 12])
    };
    strata::model::RowLayout {
        positions: rows(&|_, i| i),
        examples: rows(&|r, i| i64::from(i >= ENCODER_LENGTHS[r])),
        segments: Some(rows(&|r, i| ENCODER_TYPES[r][i as usize])),
        source_len: None,
    }
}

/// Per-position logits at the positions of tokens only (a padding position's output
/// differs, and is nobody's); per-row logits as they are.
fn of_tokens(logits: &Tensor) -> Tensor {
    if logits.dim() < 3 {
        return logits.shallow_clone();
    }
    Tensor::cat(&[logits.get(0), logits.get(1).narrow(0, 0, ENCODER_LENGTHS[1])], 0)
}

/// Tiny random BERT folders — a sequence classifier over three named labels and a masked
/// language model, every weight moved off its initial value — give `transformers`' logits
/// (every position of a token; padding positions are nobody's output) and losses, for a
/// text pair beside a padded shorter one.
#[test]
fn bert_classifier_and_masked_lm_equal_transformers() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    for family in ["bert-classifier", "bert-mlm"] {
        let dir = work.path().join(family);
        make(&py, family, &dir, None);
        let folder = from_pretrained_dir(&dir).unwrap();
        let mut engine = strata_engine(&dir);
        engine.set_layout(Some(&encoder_layout()));
        let tokens = Tensor::from_slice(&ENCODER_ROWS.concat()).view([2, 12]);
        let ours = engine.evaluate(&tokens).unwrap();
        let (labels, targets) = match &folder.config {
            ModelConfig::Bert(BertConfig { head: BertHead::Classify { labels }, .. }) => {
                assert_eq!(labels, &["negative", "neutral", "positive"], "id2label is read in id order");
                ("[2, 0]".to_string(), Tensor::from_slice(&[2i64, 0]))
            }
            _ => {
                // Three masked positions carry labels; the rest (and the padding) none.
                let mut rows = [[-100i64; 12]; 2];
                (rows[0][3], rows[0][9], rows[1][5]) = (88, 12, 19);
                (serde_json::to_string(&rows).unwrap(), Tensor::from_slice(&rows.concat()).view([2, 12]))
            }
        };
        let (theirs, their_loss) = transformers_encoder(&py, &dir, work.path(), &labels);
        assert_eq!(ours.size(), theirs.size(), "{family}");
        let g = gap(&of_tokens(&theirs), &of_tokens(&ours));
        let our_loss = strata::model::layers::cross_entropy(&ours, &targets).unwrap().double_value(&[]);
        eprintln!("{family}: largest logit difference {g:.2e}; loss {our_loss} against {their_loss}");
        assert!(g < 1e-5, "{family}: logits differ from transformers' by {g}");
        assert!((our_loss - their_loss).abs() < 1e-5, "{family}: loss {our_loss} against {their_loss}");
        // Without the layout every position attends to the padding too, and the second
        // row's logits move: the mask is what makes them agree.
        engine.set_layout(None);
        let unmasked = engine.evaluate(&tokens).unwrap();
        assert!(gap(&ours.get(1), &unmasked.get(1)) > 1e-3, "{family}: the padding changes nothing");
        // Moved and written back, the folder loads in transformers (head, labels and tied
        // decoder included) and gives the moved model's logits.
        for k in 0..engine.spec().units.len() {
            let values = engine.full_unit(k).unwrap();
            engine.set_full_unit(k, &(&values + nudge(&values, k))).unwrap();
        }
        engine.set_layout(Some(&encoder_layout()));
        let moved = engine.evaluate(&tokens).unwrap();
        let saved = work.path().join(format!("{family}-saved"));
        save_weights(&mut engine, WeightsTarget::Folder(&FolderOut::like(&saved, &folder)), true).unwrap();
        assert_eq!(from_pretrained_dir(&saved).unwrap().config, folder.config, "{family}: config.json round trip");
        let (written, _) = transformers_encoder(&py, &saved, work.path(), &labels);
        let g = gap(&of_tokens(&written), &of_tokens(&moved));
        assert!(g < 1e-5, "{family}: the written folder's logits differ by {g}");
    }
}

/// Ten training losses of `family` in Strata, each within `bound` relative of
/// `transformers'` at the same step, and falling.
fn assert_tracks(family: &str, ours: &[f64], theirs: &[f64], bound: f64) {
    eprintln!("{family}: Strata {ours:?}\ntransformers {theirs:?}");
    for (i, (ours, theirs)) in ours.iter().zip(theirs).enumerate() {
        let relative = (ours - theirs).abs() / theirs.abs();
        assert!(relative <= bound, "{family}: step {i}: loss {ours}, transformers {theirs}");
    }
    let (first, last) = (ours[..3].iter().sum::<f64>(), ours[7..].iter().sum::<f64>());
    assert!(last < first, "{family}: the losses did not fall: {ours:?}");
}

/// One BERT batch as both sides read it: two rows of 12 token ids (a `[CLS]`-like 2, then
/// words, then padding 0 after each row's length), their token types (the second half of
/// each text 1), attention mask, and labels (a class per row, or three masked positions'
/// words).
#[derive(serde::Serialize)]
struct EncoderBatch {
    tokens: Vec<Vec<i64>>,
    types: Vec<Vec<i64>>,
    mask: Vec<Vec<i64>>,
    labels: serde_json::Value,
}

fn encoder_batches(count: usize, classifier: bool) -> Vec<EncoderBatch> {
    let mut x: u64 = 11;
    let mut draw = move |n: u64| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((x >> 33) % n) as i64
    };
    (0..count)
        .map(|_| {
            let lengths: Vec<i64> = (0..2).map(|_| 6 + draw(7)).collect();
            let row = |f: &mut dyn FnMut(i64, i64) -> i64| -> Vec<Vec<i64>> {
                lengths.iter().map(|&n| (0..12).map(|i| f(i, n)).collect()).collect()
            };
            let tokens = row(&mut |i, n| match i {
                0 => 2,
                i if i < n => 4 + draw(86),
                _ => 0,
            });
            let types = row(&mut |i, n| i64::from(i >= n / 2 && i < n));
            let mask = row(&mut |i, n| i64::from(i < n));
            let labels = if classifier {
                serde_json::json!([draw(3), draw(3)])
            } else {
                let mut labels = vec![vec![-100i64; 12]; 2];
                for (r, &n) in lengths.iter().enumerate() {
                    for _ in 0..3 {
                        let at = 1 + draw(n as u64 - 1) as usize;
                        labels[r][at] = tokens[r][at];
                    }
                }
                serde_json::json!(labels)
            };
            EncoderBatch { tokens, types, mask, labels }
        })
        .collect()
}

/// Ten AdamW steps of a BERT classifier and a masked language model on padded text pairs,
/// in Strata (each batch's layout from its mask and token types) and in `transformers`: each
/// step's loss agrees within 1e-5 relative, and the losses fall.
#[test]
fn bert_training_tracks_transformers() {
    use strata::data::{Batch, Step};
    use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    for (family, classifier) in [("bert-classifier", true), ("bert-mlm", false)] {
        let dir = work.path().join(family);
        make(&py, family, &dir, None);
        let batches = encoder_batches(10, classifier);
        let file = work.path().join(format!("{family}.json"));
        std::fs::write(&file, serde_json::to_string(&batches).unwrap()).unwrap();
        let lr = 5e-3;
        let args = ["encoder-train", "--dir", dir.to_str().unwrap(), "--batches", file.to_str().unwrap()];
        let theirs: Vec<f64> =
            serde_json::from_str(&reference(&py, &[&args[..], &["--lr", &lr.to_string()]].concat())).unwrap();
        let mut engine = strata_engine(&dir);
        let optimizer = Optimizer::new(&mut engine, OptimizerConfig { lr, ..Default::default() }, &[]).unwrap();
        let mut trainer = strata::train::Trainer::new(engine, optimizer, LrSchedule::Constant, None);
        let mut ours = vec![];
        for (i, b) in batches.iter().enumerate() {
            let labels: Vec<i64> = match &b.labels {
                serde_json::Value::Array(rows) => rows
                    .iter()
                    .flat_map(|r| match r {
                        serde_json::Value::Array(v) => v.iter().map(|x| x.as_i64().unwrap()).collect(),
                        x => vec![x.as_i64().unwrap()],
                    })
                    .collect(),
                other => panic!("labels {other}"),
            };
            let targets = Tensor::from_slice(&labels);
            let targets = if classifier { targets } else { targets.view([2, 12]) };
            let mut batch = Batch::new(rows_tensor(&b.tokens), targets).unwrap();
            let examples: Vec<Vec<i64>> = b.mask.iter().map(|r| r.iter().map(|m| 1 - m).collect()).collect();
            batch.layout = Some(strata::model::RowLayout {
                positions: Tensor::arange(12, (Kind::Int64, tch::Device::Cpu)).repeat([2, 1]),
                examples: rows_tensor(&examples),
                segments: Some(rows_tensor(&b.types)),
                source_len: None,
            });
            ours.push(trainer.train_step(&Step::new(i, vec![batch])).unwrap().loss);
        }
        assert_tracks(family, &ours, &theirs, 1e-5);
    }
}

/// `texts` (single or paired) encoded by the folder's tokenizer and cut to `max_length`,
/// checked equal to what `transformers`' tokenizer of `dir` gives (ids and token types).
fn encode_pairs_as_transformers(
    py: &Path,
    dir: &Path,
    tokenizer: &strata::data::Tokenizer,
    texts: &[(&str, Option<&str>)],
    max_length: usize,
) -> Vec<(Vec<u32>, Vec<u32>)> {
    let json = serde_json::to_string(texts).unwrap();
    let args = ["encode-pairs", "--dir", dir.to_str().unwrap(), "--texts", &json, "--max-length"];
    let theirs: Vec<(Vec<u32>, Vec<u32>)> =
        serde_json::from_str(&reference(py, &[&args[..], &[&max_length.to_string()]].concat())).unwrap();
    let ours = tokenizer.encode_pairs(texts, max_length).unwrap();
    assert_eq!(ours, theirs, "max length {max_length}");
    ours
}

/// A BERT folder's WordPiece tokenizer pairs texts as `transformers`' does: the same ids
/// (`[CLS] a [SEP] b [SEP]`, words split into pieces, unknown words `[UNK]`) and token
/// types, cut to a most length from the longer text first.
#[test]
fn bert_text_pairs_encode_as_transformers_encodes_them() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("bert");
    make(&py, "bert-classifier", &dir, None);
    let tokenizer = strata::data::Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let texts: Vec<(&str, Option<&str>)> = vec![
        ("The movie was good!", None),
        ("The plot is dull, but the acting...", Some("Not very fun, and the story drags.")),
        ("Playing", Some("played playfully quizzically")),
        ("a b c d e f g h i j k l m n o p", Some("q r s")),
    ];
    for max_length in [64, 9] {
        let ours = encode_pairs_as_transformers(&py, &dir, &tokenizer, &texts, max_length);
        assert!(ours.iter().all(|(ids, _)| ids.len() <= max_length && ids[0] == 2 && *ids.last().unwrap() == 3));
        assert!(ours[1].1.contains(&1), "the second text's types are 1");
    }
}

/// Two T5 records: a source closed by `</s>` (1) beside a shorter one padded after it, and
/// targets of unequal lengths.
fn t5_records() -> strata::data::Seq2SeqSet {
    let sources = vec![vec![15, 53, 57, 3, 17, 19, 4, 21, 16, 58, 1], vec![3, 40, 22, 1]];
    let targets = vec![vec![17, 19, 21, 1], vec![30, 44, 12, 61, 70, 1]];
    strata::data::Seq2SeqSet::from_ids(sources, targets, (0, 0), "records").unwrap()
}

/// The batch of `rows` as `transformers` takes it: padded sources, their attention mask,
/// and the labels (the decoder's input is the labels shifted right, in the model).
fn t5_reference_batch(set: &strata::data::Seq2SeqSet, rows: &[usize]) -> serde_json::Value {
    use strata::data::RowSet;
    let batch = set.batch(rows).unwrap();
    let width = batch.layout.as_ref().unwrap().source_len.unwrap() as usize;
    let sources: Vec<Vec<i64>> = rows
        .iter()
        .map(|&r| {
            let ids = set.source_ids(r);
            ids.iter().map(|&t| i64::from(t)).chain(std::iter::repeat_n(0, width - ids.len())).collect()
        })
        .collect();
    let mask: Vec<Vec<i64>> = sources
        .iter()
        .zip(rows)
        .map(|(row, &r)| (0..row.len()).map(|i| i64::from(i < set.source_ids(r).len())).collect())
        .collect();
    let labels: Vec<Vec<i64>> = (0..rows.len()).map(|i| Vec::try_from(batch.targets.get(i as i64)).unwrap()).collect();
    serde_json::json!({"sources": sources, "mask": mask, "labels": labels})
}

fn transformers_seq2seq(py: &Path, dir: &Path, work: &Path, batch: &serde_json::Value) -> (Tensor, f64) {
    let out = work.join("seq2seq.safetensors");
    let (dir, batch) = (dir.to_str().unwrap(), batch.to_string());
    reference(py, &["seq2seq", "--dir", dir, "--batch", &batch, "--out", out.to_str().unwrap()]);
    let mut read = strata::io::read_safetensors(&out).unwrap();
    (read.remove("logits").unwrap(), read.remove("loss").unwrap().double_value(&[0]))
}

/// The logits `[N, V]` of the batch's supervised positions: after a target's end the
/// decoder reads padding, where `transformers` shifts the end token in (nobody's output).
fn supervised(logits: &Tensor, batch: &strata::data::Batch) -> Tensor {
    logits.index(&[Some(batch.targets.ne(strata::data::IGNORE))])
}

/// Strata's logits and loss for a T5 batch.
fn strata_seq2seq(engine: &mut Engine, batch: &strata::data::Batch) -> (Tensor, f64) {
    engine.set_layout(batch.layout.as_ref());
    let logits = engine.evaluate(&batch.inputs).unwrap();
    let loss = strata::model::layers::cross_entropy(&logits, &batch.targets).unwrap().double_value(&[]);
    (logits, loss)
}

/// Tiny random T5 folders — v1.0 (ReLU, a tied head scaled by 1/√d) and v1.1 (gated GELU, a
/// head of its own), every weight moved off its initial value, an attention width unlike
/// the model's, distances past the exact buckets — give `transformers`' logits and loss for
/// a padded source beside a longer one; the source's padding must be hidden to agree; and
/// a folder written back loads in `transformers` with the moved model's logits.
#[test]
fn t5_v10_and_v11_equal_transformers() {
    use strata::data::RowSet;
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let set = t5_records();
    let batch = set.batch(&[0, 1]).unwrap();
    let reference_batch = t5_reference_batch(&set, &[0, 1]);
    for family in ["t5", "t5-v11"] {
        let dir = work.path().join(family);
        make(&py, family, &dir, None);
        let folder = from_pretrained_dir(&dir).unwrap();
        let ModelConfig::T5(config) = &folder.config else { panic!("{family}: {:?}", folder.config) };
        assert_eq!(
            (config.tied_head, config.scale_output, config.gated),
            (family == "t5", family == "t5", family != "t5")
        );
        let mut engine = strata_engine(&dir);
        let (ours, our_loss) = strata_seq2seq(&mut engine, &batch);
        let (theirs, their_loss) = transformers_seq2seq(&py, &dir, work.path(), &reference_batch);
        let g = gap(&supervised(&theirs, &batch), &supervised(&ours, &batch));
        eprintln!("{family}: largest logit difference {g:.2e}; loss {our_loss} against {their_loss}");
        assert!(g < 1e-5, "{family}: logits differ from transformers' by {g}");
        assert!((our_loss - their_loss).abs() < 1e-5, "{family}: loss {our_loss} against {their_loss}");
        // With the source's padding visible the padded row's logits move.
        let mut seen = strata::data::Batch::new(batch.inputs.shallow_clone(), batch.targets.shallow_clone()).unwrap();
        let mut layout = batch.layout.as_ref().unwrap().shallow_clone();
        layout.examples = layout.examples.zeros_like();
        seen.layout = Some(layout);
        let (unmasked, _) = strata_seq2seq(&mut engine, &seen);
        assert!(gap(&ours.get(1), &unmasked.get(1)) > 1e-3, "{family}: the padding changes nothing");
        for k in 0..engine.spec().units.len() {
            let values = engine.full_unit(k).unwrap();
            engine.set_full_unit(k, &(&values + nudge(&values, k))).unwrap();
        }
        let (moved, _) = strata_seq2seq(&mut engine, &batch);
        let saved = work.path().join(format!("{family}-saved"));
        save_weights(&mut engine, WeightsTarget::Folder(&FolderOut::like(&saved, &folder)), true).unwrap();
        assert_eq!(from_pretrained_dir(&saved).unwrap().config, folder.config, "{family}: config.json round trip");
        let (written, _) = transformers_seq2seq(&py, &saved, work.path(), &reference_batch);
        let g = gap(&supervised(&written, &batch), &supervised(&moved, &batch));
        assert!(g < 1e-5, "{family}: the written folder's logits differ by {g}");
    }
}

/// Ten AdamW steps of both T5 versions on batches of two records each, in Strata and in
/// `transformers`: each step's loss agrees within 3e-5 relative, and the losses fall.
#[test]
fn t5_training_tracks_transformers() {
    use strata::data::{RowSet, Step};
    use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let mut x: u64 = 5;
    let mut draw = move |n: u64| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) % n
    };
    let mut text = |len: u64| -> Vec<u32> {
        let n = 2 + draw(len);
        (0..n).map(|_| 3 + draw(90) as u32).chain([1]).collect()
    };
    let (sources, targets): (Vec<_>, Vec<_>) = (0..20).map(|_| (text(9), text(6))).unzip();
    let set = strata::data::Seq2SeqSet::from_ids(sources, targets, (0, 0), "records").unwrap();
    let pairs: Vec<[usize; 2]> = (0..10).map(|i| [2 * i, 2 * i + 1]).collect();
    let reference_batches: Vec<serde_json::Value> = pairs.iter().map(|p| t5_reference_batch(&set, p)).collect();
    let file = work.path().join("t5-batches.json");
    std::fs::write(&file, serde_json::to_string(&reference_batches).unwrap()).unwrap();
    for family in ["t5", "t5-v11"] {
        let dir = work.path().join(family);
        make(&py, family, &dir, None);
        let lr = 5e-3;
        let args = ["seq2seq-train", "--dir", dir.to_str().unwrap(), "--batches", file.to_str().unwrap()];
        let theirs: Vec<f64> =
            serde_json::from_str(&reference(&py, &[&args[..], &["--lr", &lr.to_string()]].concat())).unwrap();
        let mut engine = strata_engine(&dir);
        let optimizer = Optimizer::new(&mut engine, OptimizerConfig { lr, ..Default::default() }, &[]).unwrap();
        let mut trainer = strata::train::Trainer::new(engine, optimizer, LrSchedule::Constant, None);
        let ours: Vec<f64> = pairs
            .iter()
            .enumerate()
            .map(|(i, p)| trainer.train_step(&Step::new(i, vec![set.batch(p).unwrap()])).unwrap().loss)
            .collect();
        // Each step's batch is new and the rate high enough for the losses to fall in ten
        // steps, so the steps amplify rounding: the first agree within 1e-6, the fifth
        // within 1.2e-5 on some CPUs.
        assert_tracks(family, &ours, &theirs, 3e-5);
    }
}

/// Greedy T5 generation — the encoder once, the decoder a position a step with its cache,
/// and again recomputing the whole target each step — writes `transformers`' `generate`.
/// The weights are moved further first (and the folder written back for `transformers`),
/// so that greedy decoding does not settle on one token.
#[test]
fn t5_greedy_generation_equals_transformers() {
    use strata::generate::generate_from_source;
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let source: Vec<i64> = t5_records().source_ids(0).iter().map(|&t| i64::from(t)).collect();
    for family in ["t5", "t5-v11"] {
        let dir = work.path().join(family);
        make(&py, family, &dir, None);
        let mut engine = strata_engine(&dir);
        for k in 0..engine.spec().units.len() {
            let values = engine.full_unit(k).unwrap();
            engine.set_full_unit(k, &(&values + nudge(&values, k) * 30.0)).unwrap();
        }
        let moved = work.path().join(format!("{family}-moved"));
        let folder = from_pretrained_dir(&dir).unwrap();
        save_weights(&mut engine, WeightsTarget::Folder(&FolderOut::like(&moved, &folder)), true).unwrap();
        let args = ["seq2seq-generate", "--dir", moved.to_str().unwrap(), "--max-new-tokens", "12", "--source"];
        let theirs: Vec<i64> =
            serde_json::from_str(&reference(&py, &[&args[..], &[&serde_json::to_string(&source).unwrap()]].concat()))
                .unwrap();
        for cache in [true, false] {
            let config = GenerateConfig { max_new_tokens: 12, cache, ..Default::default() };
            let ours = generate_from_source(&mut engine, &source, 0, &config).unwrap();
            assert_eq!(ours, theirs, "{family}: cache {cache}");
        }
        let distinct = theirs.iter().collect::<std::collections::BTreeSet<_>>().len();
        assert!(distinct > 3, "{family}: a generation this repetitive compares little: {theirs:?}");
    }
}

/// A T5 folder's Unigram tokenizer encodes as `transformers`' does: pieces chosen by their
/// scores (whole words before their letters), the metaspace before each word, unknown
/// characters as `<unk>`, `</s>` closing each text, cut to a most length with `</s>` kept.
#[test]
fn t5_unigram_tokenizer_encodes_as_transformers_does() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("t5");
    make(&py, "t5", &dir, None);
    let tokenizer = strata::data::Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let texts: Vec<(&str, Option<&str>)> = vec![
        ("summarize: it was the best of times, it was the worst of times.", None),
        ("The Queens said: playing is fun!", None),
        ("kings summarized stories", Some("it was the age of wisdom")),
        ("zebra quartz 123", None),
    ];
    for max_length in [64, 6] {
        let ours = encode_pairs_as_transformers(&py, &dir, &tokenizer, &texts, max_length);
        assert!(ours.iter().all(|(ids, _)| ids.len() <= max_length && ids.last() == Some(&1)));
    }
    assert!(tokenizer.encode_pairs(&texts[3..], 64).unwrap()[0].0.contains(&2), "unknown characters are <unk>");
}

/// Keys a folder leaves out take its configuration class's defaults: for every decoder
/// family, a `config.json` of the sizes alone reads as the whole configuration
/// `transformers` makes of those keys (every default written out). Folders written by
/// hand, trimmed, or by older code leave keys out.
#[test]
fn left_out_keys_take_each_configuration_class_defaults() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let read = |keys: &serde_json::Value, name: &str| {
        let path = work.path().join(name);
        std::fs::write(&path, keys.to_string()).unwrap();
        // The head width and key-value heads as used: a head_dim equal to the hidden size over
        // the heads is none, as is a key-value head for each query head.
        strata::model::hf::config_of(&path).map(|c| match c {
            ModelConfig::Llama(c) => serde_json::to_value(LlamaConfig {
                head_dim: Some(c.head_width()),
                kv_heads: c.latent.is_none().then(|| c.key_value_heads()),
                ..c
            })
            .unwrap(),
            other => serde_json::to_value(other).unwrap(),
        })
    };
    let mut differences = vec![];
    // With the key-value heads given, then left out: 640 query heads are a multiple of every
    // class's default count.
    for (model_type, kv_heads) in DECODER_TYPES.into_iter().flat_map(|t| [(t, Some(2)), (t, None)]) {
        let heads = if kv_heads.is_some() { 4 } else { 640 };
        let mut sizes = serde_json::json!({"model_type": model_type, "hidden_size": 8 * heads,
                                       "num_attention_heads": heads, "num_hidden_layers": 4,
                                       "intermediate_size": 48,
                                       // Large enough for every class's default padding token.
                                       "vocab_size": 160_000});
        if let Some(kv_heads) = kv_heads {
            sizes["num_key_value_heads"] = kv_heads.into();
        }
        // Gemma 4's per-layer embeddings (on by default) are refused, with or without the key.
        if model_type == "gemma4_text" {
            sizes["hidden_size_per_layer_input"] = 0.into();
        }
        // Granite 4's 128 Mamba-2 heads by default share twice the hidden size: more than 64.
        // Keys these classes have no default for: their models cannot be built without them.
        if model_type == "lfm2_moe" {
            sizes["layer_types"] = serde_json::json!(["conv", "full_attention", "conv", "conv"]);
        }
        if model_type == "deepseek_v2" {
            sizes["num_experts_per_tok"] = 2.into();
        }
        if model_type == "dots1" {
            for (key, value) in [("num_experts_per_tok", 2), ("n_routed_experts", 4), ("n_shared_experts", 1)] {
                sizes[key] = value.into();
            }
        }
        if matches!(model_type, "granitemoehybrid" | "bamba") && heads == 4 {
            sizes["mamba_n_heads"] = 4.into();
        }
        let whole: serde_json::Value =
            serde_json::from_str(&reference(&py, &["full-config", "--keys", &sizes.to_string()])).unwrap();
        match (read(&sizes, "sizes.json"), read(&whole, "whole.json")) {
            (Ok(ours), Ok(theirs)) => {
                let (ours, theirs) = (flat(&ours), flat(&theirs));
                for key in ours.keys().chain(theirs.keys()).collect::<BTreeSet<_>>() {
                    if ours.get(key) != theirs.get(key) {
                        differences.push(format!(
                            "{model_type} ({heads} heads): {key}: {:?} without the key, {:?} with transformers' default",
                            ours.get(key),
                            theirs.get(key)
                        ));
                    }
                }
            }
            (a, b) => differences.push(format!("{model_type} ({heads} heads): {:?} / {:?}", a.err(), b.err())),
        }
    }
    assert!(differences.is_empty(), "{}", differences.join("\n"));
}

/// The decoder families' `model_type`s.
const DECODER_TYPES: [&str; 58] = [
    "llama",
    "mamba",
    "falcon_mamba",
    "jamba",
    "falcon_h1",
    "solar_open",
    "dots1",
    "nemotron_h",
    "olmo_hybrid",
    "bamba",
    "lfm2_moe",
    "deepseek_v2",
    "lfm2",
    "granitemoehybrid",
    "qwen2_5_vl_text",
    "qwen3_vl_moe_text",
    "qwen3_vl_text",
    "glm4_moe_lite",
    "minimax_m2",
    "starcoder2",
    "nemotron",
    "cohere2",
    "cohere",
    "llama4_text",
    "apertus",
    "hunyuan_v1_moe",
    "arcee",
    "granite",
    "granitemoe",
    "hunyuan_v1_dense",
    "ernie4_5_moe",
    "ernie4_5",
    "exaone4",
    "seed_oss",
    "mistral",
    "ministral3",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "gemma4_text",
    "phi3",
    "glm4",
    "smollm3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "flex_olmo",
    "olmo2",
    "olmo3",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "mistral4",
];

/// A JSON value's leaves by their paths (`rope_scaling.factor`).
fn flat(value: &serde_json::Value) -> BTreeMap<String, serde_json::Value> {
    let mut out = BTreeMap::new();
    fn walk(prefix: String, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    walk(if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, v, out);
                }
            }
            leaf => {
                out.insert(prefix, leaf.clone());
            }
        }
    }
    walk(String::new(), value, &mut out);
    out
}
