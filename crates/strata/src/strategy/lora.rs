//! `lora`: low-rank adapters in peft's terms. The named linear layers gain trainable `A`
//! `[r, in]` and `B` `[out, r]` factors beside their weight, every other parameter is frozen
//! (no gradient, master or optimizer state) except those of `modules_to_save`, and a layer
//! computes `x·Wᵀ + (alpha / r)·(x·Aᵀ)·Bᵀ` (`alpha / √r` with `use_rslora`).
//!
//! A mixture of experts' routed experts are not linear layers in peft's eyes but the
//! stacked parameters of one module (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`),
//! which `target_parameters` names. peft gives each one pair of factors for all its
//! experts (`A` `[r·E, in]` holding expert `e`'s `[r, in]` in rows `e·r ..`, `B`
//! `[out, r·E]` its `[out, r]` in columns `e, e + E, ...`); here each expert's pair is its
//! own parameters, placed with its weights (stored by the rank of an expert group that
//! computes it), and peft's folders stack them ([`expert_factor_name`]).

use crate::model::dropout::adapter_site;
use crate::model::{Adapter, ExpertSet, Family, Init, ModelSpec, ParamId, ParamSpec, TpRole};
use crate::{Error, Result};
use regex::Regex;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Which linear layers an adapter joins, as peft names them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Targets {
    /// Module names: a layer is adapted where its name is one of them or ends with
    /// `.` and one of them (`q_proj` adapts `model.layers.3.self_attn.q_proj`).
    Names(Vec<String>),
    /// `"all-linear"`: every linear layer (the output head is not one); any other text is
    /// a regular expression a layer's whole name must match.
    Pattern(String),
}

/// `lora`'s configuration (peft's `LoraConfig` fields; `lora_alpha` and `lora_dropout`
/// are read as `alpha` and `dropout` too, so a peft `adapter_config.json` parses).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// The adapters' rank: the inner size of the `A` and `B` factors (default 8).
    pub r: i64,
    /// Scales the adapters' output by `alpha / r` (default 8).
    #[serde(alias = "lora_alpha")]
    pub alpha: f64,
    /// The share of each adapter's input dropped in training (0 by default; not with
    /// `target_parameters`, as peft).
    #[serde(alias = "lora_dropout")]
    pub dropout: f64,
    /// The linear layers adapted (default `q_proj` and `v_proj`).
    pub target_modules: Targets,
    /// Stacked expert parameters, as `transformers` names them
    /// (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`): a parameter is adapted where
    /// its name is one of them or ends with `.` and one of them. Given without
    /// `target_modules`, no linear layer is adapted.
    pub target_parameters: Vec<String>,
    /// Modules trained whole beside the adapters (a new classifier head, say).
    pub modules_to_save: Vec<String>,
    /// Scale by `alpha / √r` instead of `alpha / r` (rank-stabilized LoRA).
    pub use_rslora: bool,
    /// Ranks of their own (peft's `rank_pattern`): an adapted layer, or a stacked expert
    /// parameter, takes the rank of the first key, in the order given, that its whole name
    /// matches as the regular expression `(.*\.)?(key)`.
    pub rank_pattern: Patterns<i64>,
    /// Alphas of their own, keyed as `rank_pattern` (peft's `alpha_pattern`).
    pub alpha_pattern: Patterns<f64>,
    /// Where given and not empty, a layer that a name of `target_modules` ends is adapted
    /// only in the blocks of these indices (peft's `layers_to_transform`: one index or a list).
    #[serde(deserialize_with = "maybe_one_or_many")]
    pub layers_to_transform: Option<Vec<i64>>,
    /// The block lists whose index `layers_to_transform` reads (`layers`, `h`); where empty,
    /// the first numbered part of a name after its second (peft's `layers_pattern`).
    #[serde(deserialize_with = "one_or_many")]
    pub layers_pattern: Vec<String>,
    /// Layers never adapted (peft's `exclude_modules`): names, matched as `target_modules`'
    /// are, or a regular expression a whole module name matches.
    pub exclude_modules: Option<Targets>,
}

/// Keys, each with its value, in the order written: a JSON object read without reordering
/// (which key matches first decides).
#[derive(Clone, Debug, PartialEq)]
pub struct Patterns<T>(pub Vec<(String, T)>);

impl<T> Default for Patterns<T> {
    fn default() -> Self {
        Patterns(vec![])
    }
}

impl<T> Patterns<T> {
    /// Whether there is no key.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The keys, in order.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(k, _)| k)
    }
}

impl<T: Serialize> Serialize for Patterns<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Patterns<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct InOrder<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for InOrder<T> {
            type Value = Patterns<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of patterns and their values")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Patterns<T>, A::Error> {
                let mut entries = vec![];
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(Patterns(entries))
            }
        }
        d.deserialize_map(InOrder(std::marker::PhantomData))
    }
}

/// A value or a list of them, read as a list; null as none given.
fn maybe_one_or_many<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> std::result::Result<Option<Vec<T>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany<T> {
        One(T),
        Many(Vec<T>),
    }
    Ok(Option::<OneOrMany<T>>::deserialize(d)?.map(|given| match given {
        OneOrMany::One(t) => vec![t],
        OneOrMany::Many(v) => v,
    }))
}

/// A value or a list of them, read as a list (null as none), as peft's fields take either.
fn one_or_many<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> std::result::Result<Vec<T>, D::Error> {
    Ok(maybe_one_or_many(d)?.unwrap_or_default())
}

/// The two stacked parameters of a sparse layer's experts, in the order `transformers`
/// declares them (which is the order peft nests its adapters of both in): `up_proj` in
/// place of `gate_up_proj` where the experts have no gate.
fn expert_parameters(set: &ExpertSet) -> [&'static str; 2] {
    match set.gate.is_empty() {
        true => ["up_proj", "down_proj"],
        false => ["gate_up_proj", "down_proj"],
    }
}

/// Where a configuration names `target_parameters` and no `target_modules`, it adapts no
/// linear layer (peft's reading), not the default ones: the targets are made explicit.
pub(crate) fn parameters_alone(config: &mut serde_json::Value) {
    let Some(fields) = config.as_object_mut() else { return };
    let parameters =
        fields.get("target_parameters").and_then(serde_json::Value::as_array).is_some_and(|p| !p.is_empty());
    if parameters && fields.get("target_modules").is_none_or(serde_json::Value::is_null) {
        fields.insert("target_modules".into(), serde_json::json!([]));
    }
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            r: 8,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: Targets::Names(vec!["q_proj".into(), "v_proj".into()]),
            target_parameters: vec![],
            modules_to_save: vec![],
            use_rslora: false,
            rank_pattern: Patterns::default(),
            alpha_pattern: Patterns::default(),
            layers_to_transform: None,
            layers_pattern: vec![],
            exclude_modules: None,
        }
    }
}

/// A parameter's module: its name without the last part (`.weight`, `.bias`).
fn module_of(name: &str) -> &str {
    name.rsplit_once('.').map_or(name, |(module, _)| module)
}

/// Whether `module` is `target` or ends with `.target` (peft's rule for names).
fn names(module: &str, target: &str) -> bool {
    module == target || module.strip_suffix(target).is_some_and(|head| head.ends_with('.'))
}

/// The compiled `pattern` (which the caller wraps), or the configuration error naming `field`.
fn regex(field: &str, pattern: String) -> Result<Regex> {
    Regex::new(&pattern).map_err(|e| Error::Config(format!("lora: {field}: {e}")))
}

/// Whether `name` matches the regular expression `pattern`; one that does not compile
/// (which [`LoraConfig::validate`] refuses first) matches nothing.
fn matches(pattern: &str, name: &str) -> bool {
    Regex::new(pattern).is_ok_and(|re| re.is_match(name))
}

/// The pattern of names that `pattern` matches as a whole.
fn whole(pattern: &str) -> String {
    format!("^(?:{pattern})$")
}

/// Where `key` is a key of `rank_pattern` or `alpha_pattern`: the pattern a name must match.
fn pattern_key(key: &str) -> String {
    format!(r"^(?:.*\.)?(?:{key})$")
}

/// The names module `module` (or a stacked parameter) answers to: Strata's, then the one
/// `family`'s model holds it under in `transformers`, where that differs.
fn module_names(family: Option<Family>, module: &str) -> Vec<String> {
    let mut known = vec![module.to_string()];
    if let Some(family) = family {
        let held = family.memory_name(&format!("{module}.weight"));
        let held = held.strip_suffix(".weight").unwrap_or(&held);
        if held != module {
            known.push(held.to_string());
        }
    }
    known
}

/// The value of the first key of `patterns` that `name` matches (peft's `get_pattern_key`).
fn first_match<T: Copy>(patterns: &Patterns<T>, name: &str) -> Option<T> {
    patterns.0.iter().find(|(key, _)| matches(&pattern_key(key), name)).map(|(_, v)| *v)
}

/// Where `saved` names a module of `modules_to_save`: the pattern of the names of the
/// layers peft leaves unadapted for it, that module and everything inside it.
fn saved_module(saved: &str) -> String {
    format!(r"^(?:.*\.)?(?:{saved})(?:\..*)?$")
}

/// Whether `module` lies in a module `saved` names as peft's wrapping reads the name: the
/// module itself or one it lies in has a name ending with `saved`, as text.
fn saved_by(saved: &str, module: &str) -> bool {
    let mut ends = module.match_indices('.').map(|(i, _)| i).chain([module.len()]);
    ends.any(|end| module[..end].ends_with(saved))
}

/// The pattern whose first group is a name's block index (peft's): after the list `list`,
/// or, with none, after the first name's second part.
fn layer_index_pattern(list: Option<&str>) -> String {
    match list {
        Some(list) => format!(r"^(?:.*?\.)??(?:{list})\.(\d+)\."),
        None => r"^.*?\.[^.]*\.(\d+)\.".to_string(),
    }
}

/// The block index `pattern` ([`layer_index_pattern`]) reads in `module`.
fn block_index(pattern: &str, module: &str) -> Option<i64> {
    Regex::new(pattern).ok()?.captures(module)?.get(1)?.as_str().parse().ok()
}

/// The adapters' product's factor for rank `r`.
fn scale(r: i64, alpha: f64, rslora: bool) -> f64 {
    match rslora {
        true => alpha / (r as f64).sqrt(),
        false => alpha / r as f64,
    }
}

/// The heads peft names together among every sequence classifier's `modules_to_save`,
/// whichever of them the model has: named together, one of them may match nothing.
const CLASSIFIER_HEADS: [&str; 2] = ["classifier", "score"];

impl LoraConfig {
    /// The configuration a strategy's `["lora", config]` gives (the defaults where `config`
    /// is absent), validated.
    pub fn from_value(config: Option<&serde_json::Value>) -> Result<LoraConfig> {
        let mut config = config.cloned();
        if let Some(c) = config.as_mut() {
            parameters_alone(c);
        }
        let c: LoraConfig = super::parse_config("lora", config.as_ref())?;
        c.validate()?;
        Ok(c)
    }

    /// Checks the sizes; errors name the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Config(format!("lora: {why}")));
        if self.r <= 0 {
            return bad(format!("r must be positive, got {}", self.r));
        }
        if !self.alpha.is_finite() || self.alpha <= 0.0 {
            return bad(format!("alpha must be positive, got {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("dropout {} is outside [0, 1)", self.dropout));
        }
        if self.dropout > 0.0 && !self.target_parameters.is_empty() {
            return bad(format!(
                "dropout {} does not apply to target_parameters' stacked experts (peft refuses it too)",
                self.dropout
            ));
        }
        if let Some((key, r)) = self.rank_pattern.0.iter().find(|(_, r)| *r <= 0) {
            return bad(format!("rank_pattern {key:?}: a rank must be positive, got {r}"));
        }
        if let Some((key, a)) = self.alpha_pattern.0.iter().find(|(_, a)| !a.is_finite() || *a <= 0.0) {
            return bad(format!("alpha_pattern {key:?}: an alpha must be positive, got {a}"));
        }
        if !self.layers_pattern.is_empty() && self.layers_to_transform.is_none() {
            return bad("layers_pattern reads the indices of layers_to_transform, which is not given".into());
        }
        if self.layers_to_transform.is_some() && matches!(self.target_modules, Targets::Pattern(_)) {
            return bad("layers_to_transform needs target_modules as names, not one pattern (as peft)".into());
        }
        let mut patterns = vec![];
        if let Targets::Pattern(p) = &self.target_modules {
            if p != "all-linear" {
                patterns.push(("target_modules", whole(p)));
            }
        }
        if let Some(Targets::Pattern(p)) = &self.exclude_modules {
            patterns.push(("exclude_modules", whole(p)));
        }
        patterns.extend(self.rank_pattern.keys().map(|k| ("rank_pattern", pattern_key(k))));
        patterns.extend(self.alpha_pattern.keys().map(|k| ("alpha_pattern", pattern_key(k))));
        patterns.extend(self.layers_pattern.iter().map(|p| ("layers_pattern", layer_index_pattern(Some(p)))));
        patterns.extend(self.modules_to_save.iter().map(|m| ("modules_to_save", saved_module(m))));
        for (field, pattern) in patterns {
            regex(field, pattern)?;
        }
        match &self.target_modules {
            Targets::Names(list) if list.is_empty() && self.target_parameters.is_empty() => {
                bad("target_modules is empty".into())
            }
            _ => Ok(()),
        }
    }

    /// Whether parameter `name` belongs to a module of `modules_to_save`, or lies inside one.
    pub fn saves(&self, name: &str) -> bool {
        self.modules_to_save.iter().any(|m| saved_by(m, module_of(name)))
    }

    /// [`Self::saves`], by Strata's name or by `family`'s module names as `transformers`
    /// holds them.
    pub fn saves_in(&self, name: &str, family: Option<Family>) -> bool {
        let known = module_names(family, module_of(name));
        self.modules_to_save.iter().any(|m| known.iter().any(|module| saved_by(m, module)))
    }

    /// The rank and the product's factor of the adapter of `key` (a layer's module name, or
    /// a stacked expert parameter's name): `r` and `alpha` unless a pattern names it, by
    /// Strata's name or by `family`'s as `transformers` holds it.
    fn rank_and_scale(&self, key: &str, family: Option<Family>) -> (i64, f64) {
        let names = module_names(family, key);
        let r = names.iter().find_map(|n| first_match(&self.rank_pattern, n)).unwrap_or(self.r);
        let alpha = names.iter().find_map(|n| first_match(&self.alpha_pattern, n)).unwrap_or(self.alpha);
        (r, scale(r, alpha, self.use_rslora))
    }

    /// The blocks `layers_to_transform` keeps alone, where it chooses some (an empty list,
    /// as none, keeps every block).
    fn kept_layers(&self) -> Option<&[i64]> {
        self.layers_to_transform.as_deref().filter(|l| !l.is_empty())
    }

    /// Whether `module` is in a block that `layers_to_transform` keeps (every block where it
    /// chooses none); a name with no block index is in none.
    fn in_kept_layer(&self, module: &str) -> bool {
        let Some(kept) = self.kept_layers() else { return true };
        let index = match self.layers_pattern.is_empty() {
            true => block_index(&layer_index_pattern(None), module),
            false => self.layers_pattern.iter().find_map(|p| block_index(&layer_index_pattern(Some(p)), module)),
        };
        index.is_some_and(|i| kept.contains(&i))
    }

    /// Whether `module` is never adapted: `exclude_modules` names it, or it lies in a module
    /// of `modules_to_save` (as peft's pattern reads the names there).
    fn excludes(&self, module: &str) -> bool {
        let excluded = match &self.exclude_modules {
            None => false,
            Some(Targets::Names(list)) => list.iter().any(|t| names(module, t)),
            Some(Targets::Pattern(p)) => matches(&whole(p), module),
        };
        excluded || self.modules_to_save.iter().any(|m| matches(&saved_module(m), module))
    }

    /// The linear weights of `spec` the targets name, in declaration order, less those
    /// excluded (by `exclude_modules`, or inside a module of `modules_to_save`) and, for a name a layer's name ends with, those outside
    /// `layers_to_transform` (as peft, a layer named whole is kept); a name (or the pattern)
    /// that names no linear layer is an error listing the model's linear layers, and so is a
    /// choice that leaves none.
    pub fn targets(&self, spec: &ModelSpec) -> Result<Vec<ParamId>> {
        // Each linear layer by Strata's module name and, where it differs, its family's.
        let linear: Vec<(ParamId, Vec<String>)> = spec
            .params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.linear)
            .map(|(i, p)| (ParamId(i), module_names(spec.family, module_of(&p.name))))
            .collect();
        let any = |known: &[String], test: &dyn Fn(&str) -> bool| known.iter().any(|m| test(m));
        let unmatched = |what: String| {
            let mut short: Vec<&str> =
                linear.iter().flat_map(|(_, known)| known).map(|m| m.rsplit('.').next().unwrap_or(m)).collect();
            short.sort_unstable();
            short.dedup();
            Error::Config(format!(
                "lora: target_modules {what} names no linear layer of this model; its linear layers are {}",
                if short.is_empty() { "none".to_string() } else { short.join(", ") }
            ))
        };
        let chosen: Vec<&(ParamId, Vec<String>)> = match &self.target_modules {
            Targets::Names(list) if list.is_empty() => return Ok(vec![]),
            Targets::Names(list) => {
                if let Some(t) = list.iter().find(|t| !linear.iter().any(|(_, known)| any(known, &|m| names(m, t)))) {
                    return Err(unmatched(format!("{t:?}")));
                }
                let named = |m: &str| {
                    list.iter().any(|t| t == m) || (list.iter().any(|t| names(m, t)) && self.in_kept_layer(m))
                };
                linear.iter().filter(|(_, known)| any(known, &named)).collect()
            }
            Targets::Pattern(p) if p == "all-linear" => linear.iter().collect(),
            Targets::Pattern(p) => {
                let pattern = regex("target_modules", whole(p))?;
                linear.iter().filter(|(_, known)| any(known, &|m| pattern.is_match(m))).collect()
            }
        };
        if let Some(kept) = self.kept_layers().filter(|_| chosen.is_empty()) {
            return Err(Error::Config(format!(
                "lora: layers_to_transform {kept:?} keeps none of the layers target_modules names"
            )));
        }
        if chosen.is_empty() {
            return Err(unmatched(format!("{:?}", self.targets_text())));
        }
        let kept: Vec<ParamId> =
            chosen.iter().filter(|(_, known)| !any(known, &|m| self.excludes(m))).map(|(id, _)| *id).collect();
        if kept.is_empty() && self.target_parameters.is_empty() {
            return Err(Error::Config(format!(
                "lora: exclude_modules and modules_to_save leave none of the {} layers target_modules names",
                chosen.len()
            )));
        }
        if self.exclude_modules.is_some() && kept.len() == chosen.len() {
            tracing::warn!("lora: exclude_modules excludes none of the layers target_modules names");
        }
        Ok(kept)
    }

    /// Whether `other` declares the same adapters: ranks, scales, targets and saved modules
    /// (what a folder's tensors must fit). Lists compare as sets (peft writes its target names
    /// in no set order).
    pub fn same_adapters(&self, other: &LoraConfig) -> bool {
        fn set<T: Ord>(items: &[T]) -> std::collections::BTreeSet<&T> {
            items.iter().collect()
        }
        let same = |a: &Targets, b: &Targets| match (a, b) {
            (Targets::Names(a), Targets::Names(b)) => set(a) == set(b),
            (a, b) => a == b,
        };
        let patterned = !(self.rank_pattern.is_empty() && self.alpha_pattern.is_empty());
        self.r == other.r
            && scale(self.r, self.alpha, self.use_rslora) == scale(other.r, other.alpha, other.use_rslora)
            && self.rank_pattern == other.rank_pattern
            && self.alpha_pattern == other.alpha_pattern
            && (!patterned || self.use_rslora == other.use_rslora)
            && same(&self.target_modules, &other.target_modules)
            && self.kept_layers().map(set) == other.kept_layers().map(set)
            && set(&self.layers_pattern) == set(&other.layers_pattern)
            && match (&self.exclude_modules, &other.exclude_modules) {
                (Some(a), Some(b)) => same(a, b),
                (a, b) => a == b,
            }
            && set(&self.target_parameters) == set(&other.target_parameters)
            && set(&self.modules_to_save) == set(&other.modules_to_save)
    }

    /// The targets as one line.
    pub fn targets_text(&self) -> String {
        let modules = match &self.target_modules {
            Targets::Names(list) => list.join(", "),
            Targets::Pattern(p) => p.clone(),
        };
        [modules, self.target_parameters.join(", ")]
            .into_iter()
            .filter(|t| !t.is_empty())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// For each sparse layer of `spec`, which of its stacked parameters
    /// ([`expert_parameters`]) `target_parameters` names; a name that names none of the
    /// model's is an error listing them.
    fn expert_targets(&self, spec: &ModelSpec) -> Result<Vec<[bool; 2]>> {
        // Whether target `t` names a stacked parameter, by Strata's name or as `transformers`
        // holds it.
        let named_by = |set: &ExpertSet, part: &str, t: &str| {
            module_names(spec.family, &format!("{}.{part}", set.module)).iter().any(|key| names(key, t))
        };
        let named = |set: &ExpertSet, part: &str| self.target_parameters.iter().any(|t| named_by(set, part, t));
        if let Some(t) = self.target_parameters.iter().find(|t| {
            !spec.expert_sets.iter().any(|set| expert_parameters(set).iter().any(|part| named_by(set, part, t)))
        }) {
            let known = match spec.expert_sets.first() {
                None => "none: it has no experts".to_string(),
                Some(set) => {
                    // The module under its layer (`model.layers.{i}.`).
                    let module = set.module.splitn(4, '.').nth(3).unwrap_or(&set.module);
                    expert_parameters(set).map(|p| format!("{module}.{p}")).join(", ")
                }
            };
            return Err(Error::Config(format!(
                "lora: target_parameters {t:?} names no parameter of this model; its expert parameters are {known}"
            )));
        }
        if let Some(set) =
            spec.expert_sets.iter().find(|set| !set.peft_layout && expert_parameters(set).iter().any(|p| named(set, p)))
        {
            return Err(Error::Config(format!(
                "lora: target_parameters cannot adapt {}: its family stacks the experts in another layout than peft's",
                set.module
            )));
        }
        Ok(spec.expert_sets.iter().map(|set| expert_parameters(set).map(|part| named(set, part))).collect())
    }

    /// Joins an adapter to every targeted linear layer of `spec` and freezes every other
    /// parameter but those of `modules_to_save` (a name matching no module is an error, but
    /// for one of peft's classifier heads, `classifier` and `score`, named together).
    /// `A` draws as `nn.Linear` would for its input width and `B` starts at zero, so the
    /// model computes what it did before training.
    pub fn apply(&self, spec: &mut ModelSpec) -> Result<()> {
        self.validate()?;
        let targets = self.targets(spec)?;
        let present = |name: &str| {
            spec.params.iter().any(|p| module_names(spec.family, module_of(&p.name)).iter().any(|m| saved_by(name, m)))
        };
        // peft names both classifier heads; one of them is the model's.
        let both_heads = CLASSIFIER_HEADS.iter().all(|h| self.modules_to_save.iter().any(|m| m == h));
        let a_head_present = CLASSIFIER_HEADS.iter().any(|h| present(h));
        for name in &self.modules_to_save {
            let head = both_heads && a_head_present && CLASSIFIER_HEADS.contains(&name.as_str());
            if !head && !present(name) {
                return Err(Error::Config(format!("lora: modules_to_save {name:?} names no module of this model")));
            }
        }
        for p in spec.params.iter_mut() {
            p.requires_grad = self.saves_in(&p.name, spec.family);
        }
        // Adapters' dropout draws masks by step, as the model's own sites do.
        spec.dropout |= self.dropout > 0.0;
        let expert_targets = self.expert_targets(spec)?;
        // By Strata's names and the family's, which patterns may use.
        let mut adapted: Vec<String> =
            targets.iter().flat_map(|w| module_names(spec.family, module_of(&spec.params[w.0].name))).collect();
        for w in targets {
            let adapter = self.join(spec, w)?;
            spec.adapters.insert(w, adapter);
        }
        for (set, parts) in spec.expert_sets.clone().iter().zip(expert_targets) {
            for (part, _) in expert_parameters(set).iter().zip(parts).filter(|(_, named)| *named) {
                // peft nests its adapters of both parameters, the first declared inside.
                let module = match (*part, parts) {
                    ("gate_up_proj", [true, true]) => format!("{}.base_layer", set.module),
                    _ => set.module.clone(),
                };
                self.join_experts(spec, set, part, &module)?;
                adapted.push(format!("{}.{part}", set.module));
            }
        }
        let keys = self.rank_pattern.keys().map(|k| ("rank_pattern", k));
        for (field, key) in keys.chain(self.alpha_pattern.keys().map(|k| ("alpha_pattern", k))) {
            if !adapted.iter().any(|name| matches(&pattern_key(key), name)) {
                tracing::warn!("lora: {field} {key:?} names none of the adapted layers");
            }
        }
        Ok(())
    }

    /// Declares each expert's pair of factors for a stacked parameter of `set`'s experts
    /// (`A` `[r, in]`, `B` `[out, r]`, the parts of peft's factors of `module`) and joins
    /// the expert's weights of it to them (a gate and an up projection share one `B`, whose
    /// rows they split). Whole on every tensor rank, as the experts are (their gradients
    /// summed where sequence parallel splits the tokens).
    fn join_experts(&self, spec: &mut ModelSpec, set: &ExpertSet, part: &str, module: &str) -> Result<()> {
        let weights: Vec<&[ParamId]> = match part {
            "gate_up_proj" => vec![&set.gate, &set.up],
            "up_proj" => vec![&set.up],
            _ => vec![&set.down],
        };
        // peft's key of a stacked parameter: its module's name, unwrapped, and its own.
        let (r, scale) = self.rank_and_scale(&format!("{}.{part}", set.module), spec.family);
        for e in 0..set.down.len() {
            let first = spec.params[weights[0][e].0].clone();
            let [rows, inp] = first.shape[..] else {
                return Err(Error::Config(format!("lora: {} is not a matrix", first.name)));
            };
            let out = rows * weights.len() as i64;
            let bound = 1.0 / (inp as f64).sqrt();
            let name = |part| expert_factor_name(module, part, e as i64);
            let a = declare(spec, &first, name("A"), vec![r, inp], Init::Uniform { bound }, first.tp)?;
            let b = declare(spec, &first, name("B"), vec![out, r], Init::Zeros, first.tp)?;
            for (stacked, ids) in weights.iter().enumerate() {
                let w = ids[e];
                let dropout_site = adapter_site(&spec.params[w.0].name);
                let rows = (weights.len() > 1).then_some((stacked as i64 * rows, rows));
                let adapter = Adapter { a, b, scale, dropout: self.dropout, dropout_site, rows };
                spec.adapters.insert(w, adapter);
            }
        }
        Ok(())
    }

    /// Declares the factors of weight `w`'s adapter in its unit, split over the tensor
    /// group as the weight is: beside a column split, `B` splits its rows and `A` is whole
    /// (each rank's gradient covering its outputs only, so it is summed over the group);
    /// beside a row split, `A` splits its columns and `B` is whole (its gradient likewise
    /// summed); beside a whole weight, both are held as it is.
    fn join(&self, spec: &mut ModelSpec, w: ParamId) -> Result<Adapter> {
        let weight = spec.params[w.0].clone();
        let [out, inp] = weight.shape[..] else {
            return Err(Error::Config(format!("lora: {} is not a matrix", weight.name)));
        };
        let (a_role, b_role) = match weight.tp {
            TpRole::Row => (TpRole::Row, TpRole::PartialGradient),
            role if role.is_split() => (TpRole::PartialGradient, role),
            role => (role, role),
        };
        let module = module_of(&weight.name);
        let (r, scale) = self.rank_and_scale(module, spec.family);
        let bound = 1.0 / (inp as f64).sqrt();
        let name = |part| format!("{module}.lora_{part}.weight");
        let a = declare(spec, &weight, name("A"), vec![r, inp], Init::Uniform { bound }, a_role)?;
        let b = declare(spec, &weight, name("B"), vec![out, r], Init::Zeros, b_role)?;
        let dropout_site = adapter_site(&weight.name);
        Ok(Adapter { a, b, scale, dropout: self.dropout, dropout_site, rows: None })
    }
}

/// The name of expert `e`'s part of factor `part` (`A` or `B`) of peft's adapter of the
/// stacked expert parameter under `module` (whose factor peft names
/// `{module}.lora_{part}.weight`).
pub(crate) fn expert_factor_name(module: &str, part: &str, e: i64) -> String {
    format!("{module}.lora_{part}.{e}.weight")
}

/// Where `name` is an expert's part of one of peft's stacked factors
/// ([`expert_factor_name`]): that factor's name, whether it is a `B`, and the expert.
pub(crate) fn stacked_factor(name: &str) -> Option<(String, bool, i64)> {
    let (stem, expert) = name.strip_suffix(".weight")?.rsplit_once('.')?;
    let expert = expert.parse().ok()?;
    let is_b = match stem.rsplit_once('.')?.1 {
        "lora_A" => false,
        "lora_B" => true,
        _ => return None,
    };
    Some((format!("{stem}.weight"), is_b, expert))
}

/// Declares a factor of an adapter of `weight`, named `name`, in `weight`'s unit and
/// dtype, placed with it among an expert group's ranks.
fn declare(
    spec: &mut ModelSpec,
    weight: &ParamSpec,
    name: String,
    shape: Vec<i64>,
    init: Init,
    tp: TpRole,
) -> Result<ParamId> {
    let p = ParamSpec {
        name,
        shape,
        init,
        kind: weight.kind,
        tp,
        unit: weight.unit,
        requires_grad: true,
        linear: false,
        expert: weight.expert,
        norm: false,
    };
    if spec.find(&p.name).is_some() {
        return Err(Error::Config(format!("lora: the model already has a parameter {}", p.name)));
    }
    let id = ParamId(spec.params.len());
    if let Some(unit) = spec.units.get_mut(p.unit) {
        unit.params.push(id);
    }
    spec.params.push(p);
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// An expert's factor name gives back its stacked factor, part and expert; a plain
        /// adapter's factor and the model's own weights are none.
        #[test]
        fn expert_factor_names_read_back(module in "[a-z_]{1,8}(\\.[a-z0-9_]{1,8}){0,5}", e in 0i64..100_000, b: bool) {
            let part = if b { "B" } else { "A" };
            let name = expert_factor_name(&module, part, e);
            prop_assert_eq!(stacked_factor(&name), Some((format!("{module}.lora_{part}.weight"), b, e)));
            prop_assert_eq!(stacked_factor(&format!("{module}.lora_{part}.weight")), None);
            prop_assert_eq!(stacked_factor(&format!("{module}.{e}.weight")), None);
        }
    }
}
