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
use crate::model::{Adapter, ExpertSet, Init, ModelSpec, ParamId, ParamSpec, TpRole};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

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
}

/// The two stacked parameters of a sparse layer's experts, in the order `transformers`
/// declares them (which is the order peft nests its adapters of both in).
const EXPERT_PARAMETERS: [&str; 2] = ["gate_up_proj", "down_proj"];

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
        match &self.target_modules {
            Targets::Names(list) if list.is_empty() && self.target_parameters.is_empty() => {
                bad("target_modules is empty".into())
            }
            Targets::Pattern(p) if p != "all-linear" => {
                regex::Regex::new(p).map(|_| ()).map_err(|e| Error::Config(format!("lora: target_modules: {e}")))
            }
            _ => Ok(()),
        }
    }

    /// Whether parameter `name` belongs to a module of `modules_to_save`.
    pub fn saves(&self, name: &str) -> bool {
        self.modules_to_save.iter().any(|m| names(module_of(name), m))
    }

    /// The factor of the adapters' product.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// The linear weights of `spec` the targets name, in declaration order; a name (or the
    /// pattern) that names no linear layer is an error listing the model's linear layers.
    pub fn targets(&self, spec: &ModelSpec) -> Result<Vec<ParamId>> {
        let linear: Vec<(ParamId, &str)> = spec
            .params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.linear)
            .map(|(i, p)| (ParamId(i), module_of(&p.name)))
            .collect();
        let unmatched = |what: String| {
            let mut short: Vec<&str> = linear.iter().map(|(_, m)| m.rsplit('.').next().unwrap_or(m)).collect();
            short.sort_unstable();
            short.dedup();
            Error::Config(format!(
                "lora: target_modules {what} names no linear layer of this model; its linear layers are {}",
                if short.is_empty() { "none".to_string() } else { short.join(", ") }
            ))
        };
        let chosen: Vec<ParamId> = match &self.target_modules {
            Targets::Names(list) if list.is_empty() => return Ok(vec![]),
            Targets::Names(list) => {
                if let Some(t) = list.iter().find(|t| !linear.iter().any(|(_, m)| names(m, t))) {
                    return Err(unmatched(format!("{t:?}")));
                }
                linear.iter().filter(|(_, m)| list.iter().any(|t| names(m, t))).map(|(id, _)| *id).collect()
            }
            Targets::Pattern(p) if p == "all-linear" => linear.iter().map(|(id, _)| *id).collect(),
            Targets::Pattern(p) => {
                let whole = regex::Regex::new(&format!("^(?:{p})$"))
                    .map_err(|e| Error::Config(format!("lora: target_modules: {e}")))?;
                linear.iter().filter(|(_, m)| whole.is_match(m)).map(|(id, _)| *id).collect()
            }
        };
        if chosen.is_empty() {
            return Err(unmatched(format!("{:?}", self.targets_text())));
        }
        Ok(chosen)
    }

    /// Whether `other` declares the same adapters: rank, scale, targets and saved modules
    /// (what a folder's tensors must fit). Lists compare as sets (peft writes its target names
    /// in no set order).
    pub fn same_adapters(&self, other: &LoraConfig) -> bool {
        fn set(names: &[String]) -> std::collections::BTreeSet<&str> {
            names.iter().map(String::as_str).collect()
        }
        let same_targets = match (&self.target_modules, &other.target_modules) {
            (Targets::Names(a), Targets::Names(b)) => set(a) == set(b),
            (a, b) => a == b,
        };
        self.r == other.r
            && self.scale() == other.scale()
            && same_targets
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
    /// ([`EXPERT_PARAMETERS`]) `target_parameters` names; a name that names none of the
    /// model's is an error listing them.
    fn expert_targets(&self, spec: &ModelSpec) -> Result<Vec<[bool; 2]>> {
        let named = |set: &ExpertSet, part: &str| {
            let key = format!("{}.{part}", set.module);
            self.target_parameters.iter().any(|t| names(&key, t))
        };
        if let Some(t) = self.target_parameters.iter().find(|t| {
            !spec
                .expert_sets
                .iter()
                .any(|set| EXPERT_PARAMETERS.iter().any(|part| names(&format!("{}.{part}", set.module), t)))
        }) {
            let known = match spec.expert_sets.is_empty() {
                true => "none: it has no experts".to_string(),
                false => EXPERT_PARAMETERS.map(|p| format!("mlp.experts.{p}")).join(", "),
            };
            return Err(Error::Config(format!(
                "lora: target_parameters {t:?} names no parameter of this model; its expert parameters are {known}"
            )));
        }
        if let Some(set) =
            spec.expert_sets.iter().find(|set| !set.peft_layout && EXPERT_PARAMETERS.iter().any(|p| named(set, p)))
        {
            return Err(Error::Config(format!(
                "lora: target_parameters cannot adapt {}: its family stacks the experts in another layout than peft's",
                set.module
            )));
        }
        Ok(spec.expert_sets.iter().map(|set| EXPERT_PARAMETERS.map(|part| named(set, part))).collect())
    }

    /// Joins an adapter to every targeted linear layer of `spec` and freezes every other
    /// parameter but those of `modules_to_save` (a name matching no module is an error, but
    /// for one of peft's classifier heads, `classifier` and `score`, named together).
    /// `A` draws as `nn.Linear` would for its input width and `B` starts at zero, so the
    /// model computes what it did before training.
    pub fn apply(&self, spec: &mut ModelSpec) -> Result<()> {
        self.validate()?;
        let targets = self.targets(spec)?;
        let present = |name: &str| spec.params.iter().any(|p| names(module_of(&p.name), name));
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
            p.requires_grad = self.saves(&p.name);
        }
        // Adapters' dropout draws masks by step, as the model's own sites do.
        spec.dropout |= self.dropout > 0.0;
        let expert_targets = self.expert_targets(spec)?;
        for w in targets {
            let adapter = self.join(spec, w)?;
            spec.adapters.insert(w, adapter);
        }
        for (set, parts) in spec.expert_sets.clone().iter().zip(expert_targets) {
            for (part, _) in EXPERT_PARAMETERS.iter().zip(parts).filter(|(_, named)| *named) {
                // peft nests its adapters of both parameters, the first declared inside.
                let module = match (*part, parts) {
                    ("gate_up_proj", [true, true]) => format!("{}.base_layer", set.module),
                    _ => set.module.clone(),
                };
                self.join_experts(spec, set, part, &module)?;
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
            _ => vec![&set.down],
        };
        for e in 0..set.gate.len() {
            let first = spec.params[weights[0][e].0].clone();
            let [rows, inp] = first.shape[..] else {
                return Err(Error::Config(format!("lora: {} is not a matrix", first.name)));
            };
            let out = rows * weights.len() as i64;
            let bound = 1.0 / (inp as f64).sqrt();
            let name = |part| expert_factor_name(module, part, e as i64);
            let a = declare(spec, &first, name("A"), vec![self.r, inp], Init::Uniform { bound }, first.tp)?;
            let b = declare(spec, &first, name("B"), vec![out, self.r], Init::Zeros, first.tp)?;
            for (stacked, ids) in weights.iter().enumerate() {
                let w = ids[e];
                let dropout_site = adapter_site(&spec.params[w.0].name);
                let rows = (weights.len() > 1).then_some((stacked as i64 * rows, rows));
                let adapter = Adapter { a, b, scale: self.scale(), dropout: self.dropout, dropout_site, rows };
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
        let bound = 1.0 / (inp as f64).sqrt();
        let name = |part| format!("{module}.lora_{part}.weight");
        let a = declare(spec, &weight, name("A"), vec![self.r, inp], Init::Uniform { bound }, a_role)?;
        let b = declare(spec, &weight, name("B"), vec![out, self.r], Init::Zeros, b_role)?;
        let dropout_site = adapter_site(&weight.name);
        Ok(Adapter { a, b, scale: self.scale(), dropout: self.dropout, dropout_site, rows: None })
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
