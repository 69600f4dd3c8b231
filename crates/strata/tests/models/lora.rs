//! LoRA against peft itself (scripts/hf_reference.py, the project's `.venv`): from the same
//! base folder and the same initial adapter, Strata's adapted model gives peft's logits, ten
//! AdamW steps on the same batches give peft's losses and adapter weights, the adapter
//! Strata writes loads in peft with Strata's logits, the merged folder loads in
//! `transformers` with them too, and the base never moves.
use crate::common::ranks;

use crate::hf_reference::{python, reference};
use serde_json::{json, Value};
use std::path::Path;
use strata::data::{Batch, Step};
use strata::engine::{Engine, EngineConfig};
use strata::io::{load_adapter, load_model_dir, read_safetensors, save_weights, AdapterOut, FolderOut, WeightsTarget};
use strata::model::from_pretrained_dir;
use strata::optim::{LrSchedule, Optimizer, OptimizerConfig};
use strata::strategy::{LoraConfig, Strategy};
use tch::{Kind, Tensor};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const ROWS: [[i64; 12]; 2] =
    [[5, 17, 3, 88, 40, 41, 9, 0, 63, 12, 77, 2], [94, 1, 1, 30, 58, 6, 19, 71, 4, 95, 50, 33]];

fn rows() -> Tensor {
    Tensor::from_slice(&ROWS.concat()).view([2, 12])
}

/// The logits of `transformers` for the folder, with the adapter folder if given.
fn reference_logits(py: &Path, dir: &Path, adapter: Option<&Path>, work: &Path) -> Tensor {
    let out = work.join("logits.safetensors");
    let tokens = serde_json::to_string(&ROWS).unwrap();
    let mut args = vec!["logits", "--dir", s(dir), "--tokens", &tokens, "--out", s(&out)];
    if let Some(a) = adapter {
        args.extend(["--adapter", s(a)]);
    }
    reference(py, &args);
    read_safetensors(&out).unwrap().remove("logits").unwrap()
}

fn largest_gap(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().to_kind(Kind::Double).double_value(&[])
}

type Rows = Vec<Vec<i64>>;

/// Ten steps' batches of two rows of 12 tokens and their next tokens: two batches drawn
/// from a seed, taken in turn (so training has something to learn).
fn batches() -> Vec<(Rows, Rows)> {
    let mut x: u64 = 11;
    let mut draw = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((x >> 33) % 90) as i64
    };
    let two: Vec<_> = (0..2)
        .map(|_| {
            let rows: Vec<Vec<i64>> = (0..2).map(|_| (0..13).map(|_| draw()).collect()).collect();
            (rows.iter().map(|r| r[..12].to_vec()).collect(), rows.iter().map(|r| r[1..].to_vec()).collect())
        })
        .collect();
    two.iter().cycle().take(10).cloned().collect()
}

fn tensor_of(rows: &[Vec<i64>]) -> Tensor {
    Tensor::from_slice(&rows.concat()).view([rows.len() as i64, -1])
}

/// The engine of the folder's model with `lora`'s adapters, base weights from the folder
/// and adapter from `adapter`.
fn adapted_engine(dir: &Path, lora: &LoraConfig, adapter: &Path) -> Engine {
    let folder = from_pretrained_dir(dir).unwrap();
    let mut spec = folder.spec().unwrap();
    lora.apply(&mut spec).unwrap();
    let mut engine = Engine::new(spec, EngineConfig::default()).unwrap();
    load_model_dir(&mut engine, &folder).unwrap();
    load_adapter(&mut engine, adapter, Some(folder.family)).unwrap();
    engine
}

/// The mean next-token loss of `engine` over `batches`, evaluated.
fn evaluated_loss(engine: &mut Engine, batches: &[(Rows, Rows)]) -> f64 {
    let losses = batches.iter().map(|(inputs, targets)| {
        let logits = engine.evaluate(&tensor_of(inputs)).unwrap();
        logits.flatten(0, 1).cross_entropy_for_logits(&tensor_of(targets).flatten(0, 1)).double_value(&[])
    });
    losses.sum::<f64>() / batches.len() as f64
}

fn lora_matches_peft(family: &str, peft_config: Value) {
    lora_matches_peft_merging_within(family, peft_config, 1e-5);
}

/// [`lora_matches_peft`], the merged folder's logits within `merged_bound` of the adapted model's
/// (merging rounds each weight once more, and some families carry that further).
fn lora_matches_peft_merging_within(family: &str, peft_config: Value, merged_bound: f64) {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let (dir, initial, theirs, ours, merged) =
        (w.join(family), w.join("initial"), w.join("peft-trained"), w.join("strata-trained"), w.join("merged"));
    reference(py.as_path(), &["make", "--family", family, "--out", s(&dir)]);
    reference(&py, &["lora-init", "--dir", s(&dir), "--config", &peft_config.to_string(), "--out", s(&initial)]);

    // The strategy's lora method reads peft's own configuration (fan_in_fan_out aside, which
    // Strata knows from the family).
    let mut fields = peft_config.clone();
    fields.as_object_mut().unwrap().remove("fan_in_fan_out");
    let strategy = Strategy::from_value(&json!([["lora", fields]])).unwrap();
    let lora = strategy.lora().unwrap().clone();
    let mut engine = adapted_engine(&dir, &lora, &initial);
    let base = reference_logits(&py, &dir, None, w);
    let start = engine.evaluate(&rows()).unwrap();
    let g = largest_gap(&reference_logits(&py, &dir, Some(&initial), w), &start);
    eprintln!("{family}: with peft's initial adapter, largest logit difference {g:.2e}");
    assert!(g <= 1e-5, "{family}: logits with the initial adapter differ from peft's by {g}");
    assert!(largest_gap(&base, &start) > 1e-3, "{family}: the initial adapter changes nothing");
    refuses_an_adapter_lacking_a_factor(family, &dir, &lora, &initial, w);

    let data = batches();
    let file = w.join("batches.json");
    std::fs::write(&file, serde_json::to_string(&data).unwrap()).unwrap();
    let lr = 2e-3;
    let args = ["train", "--dir", s(&dir), "--batches", s(&file), "--lr", "0.002"];
    let extra = ["--adapter", s(&initial), "--save-adapter", s(&theirs)];
    let peft_losses: Vec<f64> = serde_json::from_str(&reference(&py, &[&args[..], &extra].concat())).unwrap();
    let untrained = evaluated_loss(&mut engine, &data);
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig { lr, ..Default::default() }, &[]).unwrap();
    let mut trainer = strata::train::Trainer::new(engine, optimizer, LrSchedule::Constant, None);
    for (i, ((inputs, targets), theirs)) in data.iter().zip(&peft_losses).enumerate() {
        let batch = Batch::new(tensor_of(inputs), tensor_of(targets)).unwrap();
        let loss = trainer.train_step(&Step::new(i, vec![batch])).unwrap().loss;
        let relative = (loss - theirs).abs() / theirs.abs();
        assert!(relative <= 1e-5, "{family}: step {i}: loss {loss}, peft {theirs}");
    }
    let mut engine = trainer.into_parts().remove(0).engine;
    // Evaluated, without the noise of dropout (GPT-2's folders ask for some).
    let trained = evaluated_loss(&mut engine, &data);
    assert!(trained < untrained - 0.02, "{family}: training went nowhere: {untrained} -> {trained}");

    let out = AdapterOut {
        dir: ours.clone(),
        config: lora.clone(),
        base_model: None,
        fan_in_fan_out: family == "gpt2",
        classifier: false,
        release: from_pretrained_dir(&dir).unwrap().release.is_some(),
        family: Some(from_pretrained_dir(&dir).unwrap().family),
    };
    save_weights(&mut engine, WeightsTarget::Adapter(&out), true).unwrap();
    let (mine, peft_trained, first) =
        [&ours, &theirs, &initial].map(|d| read_safetensors(&d.join("adapter_model.safetensors")).unwrap()).into();
    assert_eq!(mine.keys().collect::<Vec<_>>(), peft_trained.keys().collect::<Vec<_>>(), "{family}: adapter keys");
    for (key, t) in &mine {
        let g = largest_gap(t, &peft_trained[key]);
        eprintln!("{key}: {g:.2e} of {:.2e}", t.abs().max().double_value(&[]));
        assert!(g <= 1e-5, "{family}: {key} differs from peft's by {g}");
        assert!(largest_gap(t, &first[key]) > 1e-3, "{family}: {key} did not train");
    }

    let trained = engine.evaluate(&rows()).unwrap();
    let g = largest_gap(&reference_logits(&py, &dir, Some(&ours), w), &trained);
    eprintln!("{family}: Strata's adapter in peft, largest logit difference {g:.2e}");
    assert!(g <= 1e-5, "{family}: Strata's adapter loads in peft with logits {g} away");

    save_weights(
        &mut engine,
        WeightsTarget::Folder(&FolderOut::like(&merged, &from_pretrained_dir(&dir).unwrap())),
        true,
    )
    .unwrap();
    let g = largest_gap(&reference_logits(&py, &merged, None, w), &trained);
    eprintln!("{family}: merged folder in transformers, largest logit difference {g:.2e}");
    assert!(g <= merged_bound, "{family}: the merged folder's logits differ by {g}");

    // The base stayed as it was: the folder's weights, the adapter removed, give its logits.
    let mut base_again =
        Engine::new(from_pretrained_dir(&dir).unwrap().spec().unwrap(), EngineConfig::default()).unwrap();
    load_model_dir(&mut base_again, &from_pretrained_dir(&dir).unwrap()).unwrap();
    let mut adapters_off = engine;
    let zero_b: std::collections::BTreeMap<_, _> = adapters_off
        .spec()
        .adapters
        .values()
        .map(|a| {
            (a.b, Tensor::zeros(adapters_off.spec().params[a.b.0].shape.as_slice(), (Kind::Float, tch::Device::Cpu)))
        })
        .collect();
    adapters_off.set_params(&zero_b).unwrap();
    let unsaved = lora.modules_to_save.is_empty();
    let g = largest_gap(&adapters_off.evaluate(&rows()).unwrap(), &base_again.evaluate(&rows()).unwrap());
    if unsaved {
        assert_eq!(g, 0.0, "{family}: the frozen base moved");
    } else {
        assert!(g > 1e-4, "{family}: the modules saved whole did not train");
    }
}

/// peft's folder `adapter` without one of its factors (an experts' stacked one where the
/// model has them) is refused, naming the entry peft's file lacks.
fn refuses_an_adapter_lacking_a_factor(family: &str, dir: &Path, lora: &LoraConfig, adapter: &Path, work: &Path) {
    let mut factors = read_safetensors(&adapter.join("adapter_model.safetensors")).unwrap();
    let key = factors.keys().find(|k| k.contains(".experts.")).or(factors.keys().next()).unwrap().clone();
    factors.remove(&key);
    let lacking = work.join("lacking");
    std::fs::create_dir_all(&lacking).unwrap();
    std::fs::copy(adapter.join("adapter_config.json"), lacking.join("adapter_config.json")).unwrap();
    let bytes = strata::io::to_safetensors(factors.iter().map(|(k, t)| (k.as_str(), t))).unwrap();
    std::fs::write(lacking.join("adapter_model.safetensors"), bytes).unwrap();
    let folder = from_pretrained_dir(dir).unwrap();
    let mut spec = folder.spec().unwrap();
    lora.apply(&mut spec).unwrap();
    let mut engine = Engine::new(spec, EngineConfig::default()).unwrap();
    let err = load_adapter(&mut engine, &lacking, Some(folder.family)).unwrap_err().to_string();
    assert!(err.contains(&format!("missing {key:?}")), "{family}: {err}");
}

/// Each adapter's input dropped at 0.1 (peft's `lora_dropout`, with Strata's masks); ranks
/// and alphas of their own where a pattern names a layer (the first key matching winning),
/// and a layer excluded by name.
#[test]
fn llama_lora_matches_peft() {
    lora_matches_peft(
        "llama",
        json!({"r": 4, "lora_alpha": 8, "lora_dropout": 0.1,
               "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"],
               "rank_pattern": {"layers.1.self_attn.v_proj": 6, "v_proj": 2},
               "alpha_pattern": {"o_proj": 3},
               "exclude_modules": ["model.layers.0.mlp.down_proj"]}),
    );
}

#[test]
fn gpt2_lora_with_a_module_saved_whole_matches_peft() {
    lora_matches_peft(
        "gpt2",
        json!({"r": 4, "lora_alpha": 16, "use_rslora": true, "target_modules": ["c_attn", "c_proj"],
               "modules_to_save": ["ln_f"], "fan_in_fan_out": true,
               "alpha_pattern": {"mlp.c_proj": 2}, "exclude_modules": r"transformer\.h\.0\.attn\.c_attn"}),
    );
}

/// A mixture of experts' attention and routed experts (peft's `target_parameters`: one pair
/// of factors for each layer's stacked gate and up weights, one for its down weights); the
/// attention adapted in the first and last blocks alone (which leaves the experts in every
/// block, as peft does), the down weights' factors of a rank of their own.
#[test]
fn qwen3_moe_lora_of_attention_and_experts_matches_peft() {
    lora_matches_peft(
        "qwen3-moe",
        json!({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "o_proj"],
               "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
               "layers_to_transform": [0, 2], "layers_pattern": "layers",
               "rank_pattern": {"mlp.experts.down_proj": 3}}),
    );
}

/// Mistral 4's latent attention and its experts, stacked on disk as in peft's
/// `target_parameters`: one pair of factors for each layer's stacked gate and up weights.
#[test]
fn mistral4_lora_of_latent_attention_and_experts_matches_peft() {
    lora_matches_peft(
        "mistral4",
        json!({"r": 2, "lora_alpha": 4, "target_modules": ["q_b_proj", "kv_b_proj", "o_proj"],
               "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}),
    );
}

/// Nemotron-H, whose files and modules name every sub-layer `mixer`: LoRA on attention,
/// the Mamba-2 mixers' projections (named as peft names them, `mixer.in_proj`) and the
/// feed-forwards (the shared experts' among them) reads peft's adapter under those names
/// and writes one peft reads.
#[test]
fn nemotron_h_lora_of_its_mixers_matches_peft() {
    lora_matches_peft(
        "nemotron-h",
        json!({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "mixer.in_proj", "up_proj", "down_proj"]}),
    );
}

/// Gemma 4's global layers, whose values are their key projection's output: an adapter on
/// `k_proj` moves keys and values alike, as peft's wrapped projection does. Merged, the
/// logits move by rounding alone, but further than other families' (peft's own
/// `merge_and_unload` moves this fixture's by 2.3e-5 with random adapters on these modules,
/// Gemma 3's by 6e-6).
#[test]
fn gemma4_lora_of_keys_that_are_values_matches_peft() {
    let config = json!({"r": 2, "lora_alpha": 4, "target_modules": ["k_proj", "o_proj", "up_proj"]});
    lora_matches_peft_merging_within("gemma4", config, 5e-5);
}

/// Gemma 4's experts' block: its stacked experts under the layer (`experts.gate_up_proj`,
/// `experts.down_proj`) beside adapters on the dense feed-forward, which `gate_proj` names
/// alone (the experts are no linear modules).
#[test]
fn gemma4_lora_of_experts_beside_the_dense_feed_forward_matches_peft() {
    lora_matches_peft(
        "gemma4-moe",
        json!({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "gate_proj"],
               "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}),
    );
}

/// Llama 4's dense feed-forward and shared expert take adapters under its own names, as
/// peft names them (`feed_forward.gate_proj`, `feed_forward.shared_expert.gate_proj`).
#[test]
fn llama4_lora_of_its_feed_forward_matches_peft() {
    lora_matches_peft("llama4", json!({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "gate_proj"]}));
}

/// StarCoder2's biased feed-forward takes adapters under its own names (`c_fc`, `c_proj`), as
/// peft names them; its dropout draws the same masks on both sides.
#[test]
fn starcoder2_lora_of_c_fc_and_c_proj_matches_peft() {
    lora_matches_peft("starcoder2", json!({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "c_fc", "c_proj"]}));
}

/// A release's language model (Gemma 3's, beside its image model) takes adapters under the
/// release's names, as peft names them: the layers adapted are the text model's alone.
#[test]
fn lora_on_a_release_matches_peft() {
    lora_matches_peft(
        "gemma3-release",
        json!({"r": 4, "lora_alpha": 8, "target_modules": ["o_proj", "gate_proj", "down_proj"]}),
    );
}

/// The feed-forward width of [`tiny_llama_spec`].
const FFN: i64 = 64;

/// Two layers of width 32, four heads, a vocabulary of 64.
fn tiny_llama_spec() -> strata::model::ModelSpec {
    let config = strata::model::LlamaConfig { ffn_dim: Some(FFN), ..strata::model::LlamaConfig::new(64, 16, 2, 4, 32) };
    strata::model::ModelConfig::Llama(config).spec().unwrap()
}

fn lora_of(config: Value) -> LoraConfig {
    Strategy::from_value(&json!([["lora", config]])).unwrap().lora().unwrap().clone()
}

/// A LoRA engine's model states, as the allocator holds them and the ledger counts them:
/// the base's values alone, and values, gradients and AdamW's two states for the adapters;
/// steps move the adapters and nothing of the base.
#[test]
fn a_lora_engine_holds_the_base_and_the_adapters_states_alone() {
    use strata::engine::{Category, Placement};
    let mut spec = tiny_llama_spec();
    let base = spec.num_params();
    lora_of(json!({"r": 2, "target_modules": "all-linear"})).apply(&mut spec).unwrap();
    let adapters = spec.num_params() - base;
    // q, k, v, o, gate, up and down in two layers: (in + out)·r each.
    let (d, kv, f) = (32, 32, FFN);
    let per_layer = 2 * ((d + d) + (d + kv) + (d + kv) + (d + d) + (d + f) + (d + f) + (f + d));
    assert_eq!(adapters, 2 * per_layer, "adapter parameters");
    let mut engine = Engine::new(spec, EngineConfig::default()).unwrap();
    let f32 = 4u64;
    let held = engine.model_state_storage_bytes().unwrap();
    assert_eq!(held, (base + 2 * adapters) as u64 * f32, "bytes the allocator holds for values and gradients");
    let ledger = engine.ledger().clone();
    assert_eq!(ledger.held(Placement::Device, Category::Grads), adapters as u64 * f32);
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    assert_eq!(ledger.held(Placement::Device, Category::OptimizerState), 2 * adapters as u64 * f32);

    let before: Vec<Tensor> = (0..engine.spec().units.len()).map(|k| engine.full_unit(k).unwrap().copy()).collect();
    let mut trainer = strata::train::Trainer::new(engine, optimizer, LrSchedule::Constant, None);
    let tokens = Tensor::arange(2 * 17, (Kind::Int64, tch::Device::Cpu)).remainder(64).view([2, 17]);
    // B starts at zero, so A's gradient is zero until B has moved once.
    for step in 0..2 {
        let batch = Batch::new(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16)).unwrap();
        trainer.train_step(&Step::new(step, vec![batch])).unwrap();
    }
    let engine = trainer.engine_mut();
    let factors: Vec<_> = engine.spec().adapters.values().flat_map(|a| [a.a, a.b]).collect();
    let mut moved = 0;
    for (k, unit_before) in before.iter().enumerate() {
        let after = engine.full_unit(k).unwrap();
        let unit = &engine.spec().units[k];
        for &id in &unit.params {
            let (at, n) = (engine.full_offset(id), engine.spec().params[id.0].numel());
            let changed = largest_gap(&after.narrow(0, at, n), &unit_before.narrow(0, at, n)) > 0.0;
            let name = &engine.spec().params[id.0].name;
            assert_eq!(changed, factors.contains(&id), "{name}: moved {changed}");
            moved += changed as usize;
        }
    }
    assert_eq!(moved, factors.len());
}

/// Targets that name no linear layer, modules that name nothing, and options Strata does
/// not compute are refused, each in one message that says what the model has.
#[test]
fn lora_refuses_what_it_cannot_adapt() {
    let refuse = |config: Value, expected: &str| {
        let parsed = Strategy::from_value(&json!([["lora", config]]));
        let err = match parsed {
            Ok(s) => s.lora().unwrap().apply(&mut tiny_llama_spec()).unwrap_err(),
            Err(e) => e,
        };
        assert!(err.to_string().contains(expected), "{err}");
    };
    refuse(
        json!({"target_modules": ["q_proj", "c_attn"]}),
        "target_modules \"c_attn\" names no linear layer of this model; its linear layers are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj",
    );
    refuse(json!({"target_modules": "lm_head"}), "names no linear layer");
    refuse(json!({"target_modules": ["embed_tokens"]}), "names no linear layer");
    refuse(json!({"modules_to_save": ["score"]}), "modules_to_save \"score\" names no module");
    refuse(json!({"r": 0}), "r must be positive");
    refuse(json!({"dropout": 1.0}), "dropout 1 is outside [0, 1)");
    let stacked = json!({"dropout": 0.1, "target_parameters": ["mlp.experts.down_proj"]});
    refuse(stacked, "dropout 0.1 does not apply to target_parameters' stacked experts");
    refuse(json!({"rank": 8}), "unknown field `rank`");
    refuse(json!({"rank_pattern": {"v_proj": 0}}), "rank_pattern \"v_proj\": a rank must be positive");
    refuse(json!({"alpha_pattern": {"(": 4}}), "lora: alpha_pattern: regex parse error");
    refuse(json!({"layers_pattern": "layers"}), "layers_pattern reads the indices of layers_to_transform");
    refuse(
        json!({"target_modules": "all-linear", "layers_to_transform": 1}),
        "layers_to_transform needs target_modules as names",
    );
    refuse(json!({"layers_to_transform": [5]}), "layers_to_transform [5] keeps none of the layers");
    refuse(json!({"exclude_modules": "model.*"}), "exclude_modules and modules_to_save leave none of the 4 layers");
    // A folder's configuration matches the strategy's whatever order it lists names in.
    let given = lora_of(json!({"r": 8, "target_modules": ["q_proj", "v_proj"]}));
    assert!(given.same_adapters(&lora_of(json!({"r": 8, "target_modules": ["v_proj", "q_proj"]}))));
    assert!(!given.same_adapters(&lora_of(json!({"r": 4, "target_modules": ["q_proj", "v_proj"]}))));
    assert!(!given.same_adapters(&lora_of(json!({"r": 8, "target_modules": ["q_proj"]}))));
    let excluding = lora_of(json!({"r": 8, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["a", "b"]}));
    assert!(!given.same_adapters(&excluding));
    let reordered = lora_of(json!({"r": 8, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["b", "a"]}));
    assert!(excluding.same_adapters(&reordered));
    let every_block = lora_of(json!({"r": 8, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": []}));
    assert!(given.same_adapters(&every_block), "an empty layers_to_transform is none");
    assert!(!given
        .same_adapters(&lora_of(json!({"r": 8, "target_modules": ["q_proj", "v_proj"], "rank_pattern": {"q": 2}}))));
    // A pattern matches whole names, as peft's does.
    let mut spec = tiny_llama_spec();
    lora_of(json!({"target_modules": r"model\.layers\.1\.self_attn\.(q|v)_proj"})).apply(&mut spec).unwrap();
    let adapted: Vec<&str> = spec.adapters.keys().map(|id| spec.params[id.0].name.as_str()).collect();
    assert_eq!(adapted, ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"]);
    // A name given whole is adapted outside layers_to_transform too (peft's reading); a layer
    // inside a module saved whole is not adapted; a rank pattern's first match wins.
    let mut spec = tiny_llama_spec();
    let config = json!({"target_modules": ["q_proj", "v_proj", "model.layers.0.self_attn.o_proj", "up_proj"],
                        "layers_to_transform": 1, "modules_to_save": ["layers.1.mlp"],
                        "rank_pattern": {"q_proj": 3, "layers.1.self_attn.q_proj": 5, "o_": 7, ".*o_proj": 2}});
    lora_of(config).apply(&mut spec).unwrap();
    let adapted: Vec<(&str, i64)> =
        spec.adapters.iter().map(|(id, a)| (spec.params[id.0].name.as_str(), spec.params[a.a.0].shape[0])).collect();
    assert_eq!(
        adapted,
        [
            ("model.layers.0.self_attn.o_proj.weight", 2),
            ("model.layers.1.self_attn.q_proj.weight", 3),
            ("model.layers.1.self_attn.v_proj.weight", 8)
        ]
    );
    let trained: Vec<&str> =
        spec.params.iter().filter(|p| p.requires_grad && !p.name.contains("lora_")).map(|p| p.name.as_str()).collect();
    assert_eq!(trained.len(), 3, "layer 1's three feed-forward weights train whole: {trained:?}");
    assert!(trained.iter().all(|n| n.starts_with("model.layers.1.mlp.")), "{trained:?}");
    // An empty layers_to_transform keeps every block, beside a layers_pattern too (peft's
    // reading); a saved module is matched by the end of its name, as peft wraps it.
    let mut spec = tiny_llama_spec();
    lora_of(json!({"layers_to_transform": [], "layers_pattern": "layers", "modules_to_save": ["head"]}))
        .apply(&mut spec)
        .unwrap();
    assert_eq!(spec.adapters.len(), 4, "q_proj and v_proj of both blocks");
    let saved: Vec<&str> =
        spec.params.iter().filter(|p| p.requires_grad && !p.name.contains("lora_")).map(|p| p.name.as_str()).collect();
    assert_eq!(saved, ["lm_head.weight"]);
}

/// One rank of fsdp over two ranks with bf16 parameters and fp32 masters, training LoRA
/// adapters: what it holds, then two steps.
#[test]
fn rank_entry() {
    use strata::engine::{Category, Placement, UnitLayout};
    let Ok(scenario) = std::env::var("STRATA_TEST_SCENARIO") else { return };
    assert_eq!(scenario, "lora-fsdp");
    let comm = ranks::connect();
    let at = strata::parallel::RankLayout {
        comm: Some(&comm),
        local_world_size: 2,
        ..strata::parallel::RankLayout::single()
    };
    let strategy = Strategy::from_value(&json!([
        ["fsdp", {"mixed_precision": {"param_dtype": "bf16"}}],
        ["lora", {"r": 2, "target_modules": "all-linear"}]
    ]))
    .unwrap();
    let mut spec = tiny_llama_spec();
    let base = spec.num_params();
    strategy.lora().unwrap().apply(&mut spec).unwrap();
    let adapters = spec.num_params() - base;
    // Per unit: a shard of its frozen head and one of its gradient span, over two ranks.
    let layouts: Vec<UnitLayout> = (0..spec.units.len()).map(|k| UnitLayout::of(&spec, k, 1, 2)).collect();
    let head: i64 = layouts.iter().map(|l| (l.grad_start + 1) / 2).sum();
    let span: i64 = layouts.iter().map(|l| l.grad_len() / 2).sum();
    assert!(2 * head >= base && 2 * head <= base + spec.units.len() as i64, "the base is halved");
    assert!(2 * span >= adapters && 2 * span <= adapters + 2 * spec.units.len() as i64, "the adapters are halved");
    let mut engine = strata::parallel::build_engine(spec, EngineConfig::default(), &strategy, &at).unwrap();
    let ledger = engine.ledger().clone();
    // The base in bf16 with no master or gradient; the adapters with fp32 masters and bf16
    // gradient shards.
    let (bf16, f32) = (2u64, 4u64);
    let held = engine.model_state_storage_bytes().unwrap();
    assert_eq!(held, head as u64 * bf16 + span as u64 * (f32 + bf16), "bytes the allocator holds");
    assert_eq!(ledger.held(Placement::Device, Category::Params), (head as u64) * bf16 + span as u64 * f32);
    assert_eq!(ledger.held(Placement::Device, Category::Grads), span as u64 * bf16);
    let before: Vec<Tensor> = (0..engine.spec().units.len()).map(|k| engine.full_unit(k).unwrap().copy()).collect();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    let states = ledger.held(Placement::Device, Category::OptimizerState);
    assert!(states <= 2 * f32 * span as u64, "optimizer state for this rank's adapter shard alone: {states}");
    let mut trainer = strata::train::Trainer::new(engine, optimizer, LrSchedule::Constant, None);
    let rank = comm.rank() as i64;
    let tokens = (Tensor::arange(2 * 17, (Kind::Int64, tch::Device::Cpu)) * (rank + 1)).remainder(64).view([2, 17]);
    let mut losses = vec![];
    for step in 0..2 {
        let batch = Batch::new(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16)).unwrap();
        losses.push(trainer.train_step(&Step::new(step, vec![batch])).unwrap().loss);
    }
    let engine = trainer.engine_mut();
    let factors: Vec<_> = engine.spec().adapters.values().flat_map(|a| [a.a, a.b]).collect();
    for (k, unit_before) in before.iter().enumerate() {
        let after = engine.full_unit(k).unwrap();
        for &id in &engine.spec().units[k].params.clone() {
            let (at, n) = (engine.full_offset(id), engine.spec().params[id.0].numel());
            let changed = largest_gap(&after.narrow(0, at, n), &unit_before.narrow(0, at, n)) > 0.0;
            let moves = factors.contains(&id) && engine.spec().params[id.0].name.contains("lora_B");
            // A's gradient is zero until B has moved, so only B moves in two steps.
            if !factors.contains(&id) || moves {
                assert_eq!(changed, moves, "{}: moved {changed}", engine.spec().params[id.0].name);
            }
        }
    }
    println!("LOSSES {}", serde_json::to_string(&losses).unwrap());
    println!("RANK-OK");
}

/// fsdp at two ranks holds half the LoRA base each, in bf16, and no gradient, master or
/// optimizer state for it; the adapters' states are sharded too; the ranks step alike.
#[test]
fn fsdp_halves_the_lora_base_and_keeps_states_for_the_adapters_alone() {
    let outputs = ranks::run_ranks(2, "tcp", "lora-fsdp");
    ranks::assert_all_ok(&outputs);
    for o in &outputs {
        let text = String::from_utf8_lossy(&o.stdout);
        let line = text.lines().find_map(|l| l.split_once("LOSSES ").map(|(_, r)| r)).expect(&text);
        let losses: Vec<f64> = serde_json::from_str(line).unwrap();
        assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0), "{losses:?}");
    }
}

/// A LoRA engine of `seed` after two steps, with its optimizer.
fn trained_lora_engine(seed: i64) -> (Engine, Optimizer) {
    let mut spec = tiny_llama_spec();
    lora_of(json!({"r": 2, "target_modules": ["q_proj", "down_proj"]})).apply(&mut spec).unwrap();
    let mut engine = Engine::new(spec, EngineConfig { seed, ..Default::default() }).unwrap();
    let optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
    let mut trainer = strata::train::Trainer::new(engine, optimizer, LrSchedule::Constant, None);
    let tokens = Tensor::arange(2 * 17, (Kind::Int64, tch::Device::Cpu)).remainder(64).view([2, 17]);
    for step in 0..2 {
        let batch = Batch::new(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16)).unwrap();
        trainer.train_step(&Step::new(step, vec![batch])).unwrap();
    }
    let part = trainer.into_parts().remove(0);
    (part.engine, part.optimizer)
}

fn units(engine: &mut Engine) -> Vec<Tensor> {
    (0..engine.spec().units.len()).map(|k| engine.full_unit(k).unwrap().copy()).collect()
}

/// A LoRA run's checkpoint holds its frozen base only where the run did not load it from
/// initial weights: without it, a restore keeps the loading engine's base and takes the
/// adapters and their optimizer state; with it, everything.
#[test]
fn lora_checkpoints_hold_the_base_only_where_asked() {
    use strata::checkpoint::{self, Checkpoint, DataPosition, RunInfo};
    let (mut engine, mut optimizer) = trained_lora_engine(1);
    let saved = units(&mut engine);
    let factors: Vec<_> = engine.spec().adapters.values().flat_map(|a| [a.a, a.b]).collect();
    for saves_frozen in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let run = RunInfo {
            step: 2,
            world_size: 1,
            strategy: json!([]),
            optimizer: "adamw".into(),
            data: DataPosition { seed: 0, batch_size: 2, ctx: 16, next_step: 2 },
            loss_scaler: None,
            model: None,
            base: (!saves_frozen).then(|| checkpoint::BaseRecord { sources: vec!["base".into()], digest: "0".into() }),
        };
        let path = checkpoint::save(dir.path(), &mut engine, &mut optimizer, &run, None, 1).unwrap();
        let ckpt = Checkpoint::open(&path).unwrap();
        assert_eq!(ckpt.holds_every_parameter(), saves_frozen);
        // Another engine of another seed: another base, other adapters.
        let (mut other, mut other_optimizer) = trained_lora_engine(2);
        let base = units(&mut other);
        ckpt.restore(&mut other, &mut other_optimizer, "adamw").unwrap();
        let restored = units(&mut other);
        for k in 0..restored.len() {
            for &id in &other.spec().units[k].params {
                let (at, n) = (other.full_offset(id), other.spec().params[id.0].numel());
                let value = restored[k].narrow(0, at, n);
                let frozen_head = !factors.contains(&id);
                let want = if frozen_head && !saves_frozen { &base[k] } else { &saved[k] };
                let name = &other.spec().params[id.0].name;
                assert_eq!(largest_gap(&value, &want.narrow(0, at, n)), 0.0, "{name}, base saved {saves_frozen}");
            }
        }
        let moments = |o: &Optimizer| -> Vec<Tensor> { o.state().into_iter().map(|(_, _, _, t)| t.copy()).collect() };
        let (want, got) = (moments(&optimizer), moments(&other_optimizer));
        assert!(!want.is_empty() && want.len() == got.len());
        for (a, b) in want.iter().zip(&got) {
            assert_eq!(largest_gap(a, b), 0.0, "optimizer state");
        }
    }
}
