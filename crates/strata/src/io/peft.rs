//! peft's adapter folders: `adapter_config.json` (a `LoraConfig`) and
//! `adapter_model.safetensors`, whose keys are the model's own parameter names under
//! `base_model.model.` (`...q_proj.lora_A.weight`, and the whole parameters of
//! `modules_to_save`). Written from a LoRA run's adapters, read back into one.
use super::{load_named, read_safetensors, write_atomic, write_weights, WeightsTarget};
use crate::engine::Engine;
use crate::model::hf::{language_model_name, release_module_name};
use crate::model::{Adapter, Adapters, Family, ModelSpec, ParamId};
use crate::strategy::{stacked_factor, LoraConfig, Targets};
use crate::{Error, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// The file of a peft folder holding its configuration.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The file of a peft folder holding its tensors.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The prefix peft gives the model's parameter names.
const PREFIX: &str = "base_model.model.";

/// An adapter folder to write.
#[derive(Clone, Debug)]
pub struct AdapterOut {
    /// The folder to write, made where missing.
    pub dir: PathBuf,
    /// The adapters' configuration, written as peft's `adapter_config.json`.
    pub config: LoraConfig,
    /// `base_model_name_or_path` (the model folder trained from, where there is one).
    pub base_model: Option<String>,
    /// Whether the adapted layers store their weights `[in, out]` (GPT-2's `Conv1D`), which
    /// peft records as `fan_in_fan_out`.
    pub fan_in_fan_out: bool,
    /// Whether the model is a sequence classifier (a reward model): peft's `SEQ_CLS` task,
    /// else `CAUSAL_LM`.
    pub classifier: bool,
    /// Whether the base is the language model of a release that holds an image model
    /// beside it (Gemma 3's, Mistral 3's, Qwen3.5's): peft names its layers as the
    /// release's model holds them, under `model.language_model.`.
    pub release: bool,
    /// The family of the model folder trained from, whose module names peft's keys take
    /// (`None`: Strata's own names).
    pub family: Option<Family>,
}

impl AdapterOut {
    fn config_json(&self) -> Value {
        let c = &self.config;
        let targets = match &c.target_modules {
            Targets::Names(list) => json!(list),
            Targets::Pattern(p) => json!(p),
        };
        json!({
            "peft_type": "LORA",
            "task_type": if self.classifier { "SEQ_CLS" } else { "CAUSAL_LM" },
            "base_model_name_or_path": self.base_model,
            "r": c.r,
            "lora_alpha": c.alpha,
            "lora_dropout": c.dropout,
            "target_modules": targets,
            "target_parameters": if c.target_parameters.is_empty() { Value::Null } else { json!(c.target_parameters) },
            "modules_to_save": if c.modules_to_save.is_empty() { Value::Null } else { json!(c.modules_to_save) },
            "use_rslora": c.use_rslora,
            "rank_pattern": c.rank_pattern,
            "alpha_pattern": c.alpha_pattern,
            "layers_to_transform": c.layers_to_transform,
            "layers_pattern": if c.layers_pattern.is_empty() { Value::Null } else { json!(c.layers_pattern) },
            "exclude_modules": c.exclude_modules,
            "fan_in_fan_out": self.fan_in_fan_out,
            "bias": "none",
            "inference_mode": true,
        })
    }

    /// Writes the folder: the configuration, then the tensors `layout` names (already under
    /// peft's names), each file atomically.
    pub(super) fn write(
        &self,
        layout: &[(String, Kind, Vec<i64>)],
        fetch: impl FnMut(usize) -> Result<Tensor>,
    ) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        write_weights(WeightsTarget::File(&self.dir.join(ADAPTER_WEIGHTS)), layout, fetch)?;
        let text = serde_json::to_vec_pretty(&self.config_json()).map_err(|e| Error::Config(e.to_string()))?;
        write_atomic(&self.dir.join(ADAPTER_CONFIG), &text)
    }

    /// Whether parameter `name` goes into the folder: an adapter's factor or a parameter of
    /// a module saved whole.
    pub(super) fn holds(&self, name: &str, factor: bool) -> bool {
        factor || self.config.saves_in(name, self.family)
    }

    /// The name a parameter takes in the folder.
    pub(super) fn key(&self, name: &str) -> String {
        let held = self.family.map_or_else(|| name.to_string(), |f| f.memory_name(name));
        peft_key(&held, self.release)
    }
}

/// The name peft gives a parameter of its base model, the language model of a release
/// where `release`.
fn peft_key(name: &str, release: bool) -> String {
    match release {
        true => format!("{PREFIX}{}", release_module_name(name)),
        false => format!("{PREFIX}{name}"),
    }
}

/// The fields of peft's `LoraConfig` that, set, make an adapter compute something else than
/// plain LoRA's product (or add tensors of its own).
const CHANGE_THE_PRODUCT: [&str; 11] = [
    "use_dora",
    "lora_bias",
    "use_qalora",
    "layer_replication",
    "alora_invocation_tokens",
    "trainable_token_indices",
    "velora_config",
    "monteclora_config",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
];

/// The values of `init_lora_weights` (or their beginnings) whose initialisation changes the
/// base's weights too: an adapter saved so holds its change against that changed base.
const CHANGE_THE_BASE: [&str; 5] = ["pissa", "olora", "corda", "loftq", "lora_ga"];

/// Reads the LoRA configuration of the peft folder `dir`; a folder of another method
/// (`peft_type` other than `LORA`) or with options Strata does not compute is refused.
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(ADAPTER_CONFIG);
    let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let err = |why: String| Error::Config(format!("{}: {why}", path.display()));
    let mut value: Value = serde_json::from_slice(&bytes).map_err(|e| err(format!("not JSON: {e}")))?;
    let fields = value.as_object_mut().ok_or_else(|| err("not a JSON object".into()))?;
    match fields.get("peft_type").and_then(Value::as_str) {
        Some("LORA") | None => {}
        Some(other) => return Err(err(format!("a {other} adapter; Strata reads LoRA adapters"))),
    }
    if let Some(bias) = fields.get("bias").and_then(Value::as_str).filter(|b| *b != "none") {
        return Err(err(format!("bias {bias:?}: Strata's adapters train no biases (\"none\")")));
    }
    let set = |v: &Value| !(v.is_null() || v == &json!(false) || v == &json!([]) || v == &json!({}));
    if let Some(field) = CHANGE_THE_PRODUCT.iter().find(|f| fields.get(**f).is_some_and(set)) {
        return Err(err(format!("{field}: a variant of LoRA; Strata computes plain LoRA")));
    }
    let init = fields.get("init_lora_weights").and_then(Value::as_str).map(str::to_lowercase);
    if let Some(init) = init.filter(|i| CHANGE_THE_BASE.iter().any(|b| i.starts_with(b))) {
        return Err(err(format!(
            "init_lora_weights {init:?}: the adapter belongs to the base its initialisation changed; save it \
             with peft's path_initial_model_for_weight_conversion to read it over the original base"
        )));
    }
    let known = [
        "r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "target_parameters",
        "modules_to_save",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        "layers_to_transform",
        "layers_pattern",
        "exclude_modules",
    ];
    fields.retain(|k, v| known.contains(&k.as_str()) && !v.is_null());
    crate::strategy::parameters_alone(&mut value);
    let config: LoraConfig = serde_json::from_value(value).map_err(|e| err(e.to_string()))?;
    config.validate().map_err(|e| err(e.to_string()))?;
    Ok(config)
}

/// Loads the adapter of the peft folder `dir` into `engine`, built with the folder's
/// LoRA configuration: every factor of the model's adapters must be in the file, in its
/// shape, and every tensor of the file must name one (or a parameter of a module saved
/// whole); its keys are `family`'s module names where the base is a folder of one.
pub fn load_adapter(engine: &mut Engine, dir: &Path, family: Option<Family>) -> Result<()> {
    let path = dir.join(ADAPTER_WEIGHTS);
    let err = |message: String| Error::Weights { path: path.clone(), message };
    let (mut named, mut release) = (vec![], false);
    for (key, t) in read_safetensors(&path)? {
        let held = key.strip_prefix(PREFIX).ok_or_else(|| err(format!("{key:?} is not under {PREFIX:?}")))?;
        // A release's language model is read alone: its image model's factors change none
        // of its text's outputs.
        let Some(name) = language_model_name(held) else { continue };
        release |= name != held;
        // peft's files written with an adapter name keep it before `.weight`.
        let name = name.replace(".default.weight", ".weight");
        let name = match family {
            Some(family) => family.from_memory_name(&name).unwrap_or(name),
            None => name,
        };
        named.push((name, key, t));
    }
    let spec = engine.spec();
    let factors = factor_ids(&spec.adapters);
    let named = unstack_factors(spec, &factors, named).map_err(err)?;
    for id in &factors {
        let name = &spec.params[id.0].name;
        if !named.iter().any(|(n, _, _)| n == name) {
            // An expert's part is missing when peft's stacked factor holding it is.
            let entry = stacked_factor(name).map_or_else(|| name.clone(), |(whole, _, _)| whole);
            let held = family.map_or_else(|| entry.clone(), |f| f.memory_name(&entry));
            return Err(err(format!("missing {:?}", peft_key(&held, release))));
        }
    }
    load_named(engine, &path, named.into_iter(), &|id| !factors.contains(&id))
}

/// Whether the adapter folder `dir` changes nothing of its base yet: it holds low-rank
/// factors alone (no module saved whole) and every `B` is zero, as peft draws a new adapter.
pub fn adapter_changes_nothing(dir: &Path) -> Result<bool> {
    for (key, t) in read_safetensors(&dir.join(ADAPTER_WEIGHTS))? {
        let zero = || -> Result<bool> { Ok(t.f_count_nonzero(None)?.int64_value(&[]) == 0) };
        let changes = match (key.contains(".lora_A."), key.contains(".lora_B.")) {
            (true, _) => false,
            (_, true) => !zero()?,
            _ => true,
        };
        if changes {
            return Ok(false);
        }
    }
    Ok(true)
}

/// `named` (parameter name, key, tensor) with each of peft's stacked expert factors taken
/// apart into the experts' parts that `factors` hold ([`stacked_factor`]): `A`'s rows
/// `e·r ..` and `B`'s columns `e, e + E, ...` for expert `e`.
fn unstack_factors(
    spec: &ModelSpec,
    factors: &[ParamId],
    named: Vec<(String, String, Tensor)>,
) -> std::result::Result<Vec<(String, String, Tensor)>, String> {
    // Each stacked factor: whether it is a `B`, and its experts' parts.
    let mut parts: BTreeMap<String, (bool, Vec<(i64, String)>)> = BTreeMap::new();
    for id in factors {
        let name = &spec.params[id.0].name;
        if let Some((whole, is_b, e)) = stacked_factor(name) {
            parts.entry(whole).or_insert((is_b, vec![])).1.push((e, name.clone()));
        }
    }
    let mut out = vec![];
    for (name, key, t) in named {
        let Some((is_b, experts)) = parts.get_mut(&name) else {
            out.push((name, key, t));
            continue;
        };
        let is_b = *is_b;
        experts.sort();
        let count = experts.len() as i64;
        let size = t.size();
        let stacked_dim = usize::from(is_b);
        if size.len() != 2 || size[stacked_dim] % count != 0 {
            return Err(format!("{key:?} of shape {size:?} does not stack {count} experts' factors"));
        }
        let r = size[stacked_dim] / count;
        for (e, part) in experts.iter() {
            let piece = match is_b {
                false => t.f_narrow(0, e * r, r),
                true => t.f_view([size[0], r, count]).and_then(|v| v.f_select(2, *e)),
            };
            let piece = piece.and_then(|p| p.f_contiguous()).map_err(|e| format!("{key:?}: {e}"))?;
            out.push((part.clone(), key.clone(), piece));
        }
    }
    Ok(out)
}

/// The parameters that are adapters' factors (once each, where experts share them).
pub(crate) fn factor_ids(adapters: &Adapters) -> Vec<ParamId> {
    let ids: std::collections::BTreeSet<ParamId> = adapters.values().flat_map(|a| [a.a, a.b]).collect();
    ids.into_iter().collect()
}

/// A tensor as written: its name there, dtype and shape.
type Written = (String, Kind, Vec<i64>);

/// Where one entry of a written model comes from: a parameter as it is, a weight merged
/// with its adapter, or the experts' parts of one of peft's stacked factors (by expert).
enum Source {
    Plain(usize),
    Merged { weight: usize, a: usize, b: usize, adapter: Adapter },
    Stacked { parts: Vec<(i64, usize)>, is_b: bool },
}

/// The entries of `layout` (parameter, name, dtype, shape) as `target` receives them: a
/// model (file or folder) gets every weight merged with its adapter and no factors; an
/// adapter folder gets the factors and the parameters of modules saved whole, under peft's
/// names.
fn selection(
    target: &WeightsTarget<'_>,
    adapters: &Adapters,
    layout: &[(ParamId, String, Kind, Vec<i64>)],
) -> Result<(Vec<Written>, Vec<Source>)> {
    let index: BTreeMap<ParamId, usize> = layout.iter().enumerate().map(|(i, e)| (e.0, i)).collect();
    let factors = factor_ids(adapters);
    let position = |id: &ParamId| {
        index
            .get(id)
            .copied()
            .ok_or_else(|| Error::Model(format!("an adapter's factor (parameter {}) is not among those written", id.0)))
    };
    let mut out: Vec<(Written, Source)> = vec![];
    // Where each stacked factor's entry is: at its first expert's part.
    let mut stacks: BTreeMap<String, usize> = BTreeMap::new();
    for (i, (id, name, kind, shape)) in layout.iter().enumerate() {
        let factor = factors.contains(id);
        match target {
            WeightsTarget::Adapter(folder) => match stacked_factor(name).filter(|_| factor) {
                Some((whole, is_b, e)) => match stacks.get(&whole) {
                    Some(&at) => {
                        let ((_, _, stacked_shape), Source::Stacked { parts, .. }) = &mut out[at] else {
                            return Err(Error::Model(format!("{whole} is written as one tensor and as parts")));
                        };
                        stacked_shape[usize::from(is_b)] += shape[usize::from(is_b)];
                        parts.push((e, i));
                    }
                    None => {
                        stacks.insert(whole.clone(), out.len());
                        let entry = (folder.key(&whole), *kind, shape.clone());
                        out.push((entry, Source::Stacked { parts: vec![(e, i)], is_b }));
                    }
                },
                None if folder.holds(name, factor) => {
                    out.push(((folder.key(name), *kind, shape.clone()), Source::Plain(i)));
                }
                None => {}
            },
            _ if factor => {}
            _ => {
                let source = match adapters.get(id) {
                    Some(adapter) => Source::Merged {
                        weight: i,
                        a: position(&adapter.a)?,
                        b: position(&adapter.b)?,
                        adapter: *adapter,
                    },
                    None => Source::Plain(i),
                };
                out.push(((name.clone(), *kind, shape.clone()), source));
            }
        }
    }
    Ok(out.into_iter().unzip())
}

/// Fetches entries in order, holding those fetched ahead of their turn (and factors, which
/// experts' weights may share, until the end).
struct Ahead<F> {
    fetch: F,
    next: usize,
    held: BTreeMap<usize, Tensor>,
}

impl<F: FnMut(usize) -> Result<Tensor>> Ahead<F> {
    fn fetch_to(&mut self, i: usize) -> Result<()> {
        while self.next <= i {
            self.held.insert(self.next, (self.fetch)(self.next)?);
            self.next += 1;
        }
        Ok(())
    }

    fn take(&mut self, i: usize) -> Result<Tensor> {
        self.fetch_to(i)?;
        self.held.remove(&i).ok_or_else(|| Error::Model(format!("entry {i} of the weights was read twice")))
    }

    fn factor(&mut self, i: usize) -> Result<Tensor> {
        self.fetch_to(i)?;
        let t = self.held.get(&i).ok_or_else(|| Error::Model(format!("factor {i} of the weights is gone")))?;
        Ok(t.f_to_kind(Kind::Float)?)
    }

    fn produce(&mut self, source: &Source) -> Result<Tensor> {
        match *source {
            Source::Plain(i) => self.take(i),
            Source::Merged { weight, a, b, adapter } => {
                let w = self.take(weight)?;
                let (a, b) = adapter.factors(&self.factor(a)?, &self.factor(b)?)?;
                let merged = w.f_to_kind(Kind::Float)?.f_add(&b.f_matmul(&a)?.f_mul_scalar(adapter.scale)?)?;
                Ok(merged.f_to_kind(w.kind())?)
            }
            Source::Stacked { ref parts, is_b } => {
                let mut parts = parts.clone();
                parts.sort_unstable();
                let pieces = parts.iter().map(|&(_, i)| self.take(i)).collect::<Result<Vec<_>>>()?;
                match is_b {
                    false => Ok(Tensor::f_cat(&pieces, 0)?),
                    true => {
                        let [out, r] = pieces[0].size()[..] else {
                            return Err(Error::Model("an expert's B factor is not a matrix".into()));
                        };
                        Ok(Tensor::f_stack(&pieces, 2)?.f_reshape([out, r * pieces.len() as i64])?)
                    }
                }
            }
        }
    }
}

/// Writes a model's parameters to `target` as `selection` chooses them. `fetch(i)`
/// produces entry `i` of `layout` and is called once for every entry, in order, whatever
/// is written (so ranks that gather together stay in step); only the entries still needed
/// are held.
pub fn write_model_weights(
    target: WeightsTarget<'_>,
    adapters: &Adapters,
    layout: &[(ParamId, String, Kind, Vec<i64>)],
    fetch: impl FnMut(usize) -> Result<Tensor>,
) -> Result<()> {
    let (written, sources) = selection(&target, adapters, layout)?;
    let mut ahead = Ahead { fetch, next: 0, held: BTreeMap::new() };
    write_weights(target, &written, |j| ahead.produce(&sources[j]))?;
    // The entries after the last one written are fetched too, as the other ranks fetch them.
    while ahead.next < layout.len() {
        let last = ahead.next;
        drop(ahead.take(last)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What peft 0.21's `LoraConfig(...).to_dict()` writes for plain LoRA with its defaults
    /// (a few fields left out), with `fields` set over it.
    fn config_with(fields: Value) -> Result<LoraConfig> {
        let mut config = json!({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "target_modules": ["q_proj"],
            "exclude_modules": null, "lora_alpha": 8, "lora_dropout": 0.0, "fan_in_fan_out": false,
            "bias": "none", "use_rslora": false, "modules_to_save": null, "init_lora_weights": true,
            "layers_to_transform": null, "layers_pattern": null, "rank_pattern": {}, "alpha_pattern": {},
            "megatron_config": null, "megatron_core": "megatron.core", "trainable_token_indices": null,
            "loftq_config": {}, "use_dora": false, "alora_invocation_tokens": null, "use_qalora": false,
            "qalora_group_size": 16, "layer_replication": null, "lora_bias": false, "target_parameters": null,
            "use_bdlora": null, "arrow_config": null, "kasa_config": null, "ensure_weight_tying": false
        });
        for (k, v) in fields.as_object().into_iter().flatten() {
            config[k] = v.clone();
        }
        let dir = tempfile::tempdir().map_err(|e| Error::io(Path::new("tempdir"), e))?;
        std::fs::write(dir.path().join(ADAPTER_CONFIG), config.to_string()).map_err(|e| Error::io(dir.path(), e))?;
        read_adapter_config(dir.path())
    }

    /// peft's defaults read as plain LoRA; its layer choices and per-layer ranks are read in
    /// the order written; a variant that computes another product is refused by name.
    #[test]
    fn peft_configurations_read_as_plain_lora_or_are_refused_by_field() {
        assert_eq!(
            config_with(json!({})).unwrap(),
            LoraConfig { target_modules: Targets::Names(vec!["q_proj".into()]), ..LoraConfig::default() }
        );
        let patterned = config_with(json!({
            "rank_pattern": {"v_proj": 2, "q_proj": 4}, "alpha_pattern": {"o_proj": 3.5},
            "layers_to_transform": 1, "layers_pattern": ["layers", "h"], "exclude_modules": "lm_head"
        }))
        .unwrap();
        assert_eq!(patterned.rank_pattern.0, [("v_proj".to_string(), 2), ("q_proj".to_string(), 4)]);
        assert_eq!(patterned.alpha_pattern.0, [("o_proj".to_string(), 3.5)]);
        assert_eq!(patterned.layers_to_transform, Some(vec![1]));
        assert_eq!(patterned.layers_pattern, ["layers", "h"]);
        assert_eq!(patterned.exclude_modules, Some(Targets::Pattern("lm_head".into())));
        let refused = [
            ("use_dora", json!(true)),
            ("lora_bias", json!(true)),
            ("layer_replication", json!([[0, 2], [1, 2]])),
            ("alora_invocation_tokens", json!([5])),
            ("trainable_token_indices", json!({"embed_tokens": [3]})),
        ];
        for (field, value) in refused {
            let err = config_with(json!({field: value})).unwrap_err().to_string();
            assert!(err.contains(&format!("{field}: a variant of LoRA")), "{err}");
        }
        for init in ["pissa", "pissa_niter_4", "olora", "loftq"] {
            let err = config_with(json!({"init_lora_weights": init})).unwrap_err().to_string();
            assert!(err.contains("the adapter belongs to the base its initialisation changed"), "{err}");
        }
        for init in [json!(false), json!("gaussian"), json!("mica")] {
            assert!(config_with(json!({"init_lora_weights": init})).is_ok());
        }
    }
}
