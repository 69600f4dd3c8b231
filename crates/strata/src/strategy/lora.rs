//! `lora`: low-rank adapters in peft's terms. The named linear layers gain trainable `A`
//! `[r, in]` and `B` `[out, r]` factors beside their weight, every other parameter is frozen
//! (no gradient, master or optimizer state) except those of `modules_to_save`, and a layer
//! computes `x·Wᵀ + (alpha / r)·(x·Aᵀ)·Bᵀ` (`alpha / √r` with `use_rslora`).

use crate::model::{Adapter, Init, ModelSpec, ParamId, ParamSpec, TpRole};
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
    pub r: i64,
    #[serde(alias = "lora_alpha")]
    pub alpha: f64,
    #[serde(alias = "lora_dropout")]
    pub dropout: f64,
    pub target_modules: Targets,
    /// Modules trained whole beside the adapters (a new classifier head, say).
    pub modules_to_save: Vec<String>,
    pub use_rslora: bool,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            r: 8,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: Targets::Names(vec!["q_proj".into(), "v_proj".into()]),
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

impl LoraConfig {
    /// The configuration a strategy's `["lora", config]` gives (the defaults where `config`
    /// is absent), validated.
    pub fn from_value(config: Option<&serde_json::Value>) -> Result<LoraConfig> {
        let c: LoraConfig = super::parse_config("lora", config)?;
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
        if self.dropout != 0.0 {
            return bad(format!(
                "dropout {} is not supported: Strata trains without dropout (set it to 0.0)",
                self.dropout
            ));
        }
        match &self.target_modules {
            Targets::Names(list) if list.is_empty() => bad("target_modules is empty".into()),
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
            && set(&self.modules_to_save) == set(&other.modules_to_save)
    }

    /// The targets as one line.
    pub fn targets_text(&self) -> String {
        match &self.target_modules {
            Targets::Names(list) => list.join(", "),
            Targets::Pattern(p) => p.clone(),
        }
    }

    /// Joins an adapter to every targeted linear layer of `spec` and freezes every other
    /// parameter but those of `modules_to_save` (a name matching no module is an error).
    /// `A` draws as `nn.Linear` would for its input width and `B` starts at zero, so the
    /// model computes what it did before training.
    pub fn apply(&self, spec: &mut ModelSpec) -> Result<()> {
        self.validate()?;
        let targets = self.targets(spec)?;
        for name in &self.modules_to_save {
            if !spec.params.iter().any(|p| names(module_of(&p.name), name)) {
                return Err(Error::Config(format!("lora: modules_to_save {name:?} names no module of this model")));
            }
        }
        for p in spec.params.iter_mut() {
            p.requires_grad = self.saves(&p.name);
        }
        for w in targets {
            let adapter = self.join(spec, w)?;
            spec.adapters.insert(w, adapter);
        }
        Ok(())
    }

    /// Declares the factors of weight `w`'s adapter in its unit, split over the tensor
    /// group as the weight is: beside a column split, `B` splits its rows and `A` is whole
    /// (each rank's gradient covering its outputs only, so it is summed over the group);
    /// beside a row split, `A` splits its columns and `B` is whole (its gradient likewise
    /// summed).
    fn join(&self, spec: &mut ModelSpec, w: ParamId) -> Result<Adapter> {
        let weight = spec.params[w.0].clone();
        let [out, inp] = weight.shape[..] else {
            return Err(Error::Config(format!("lora: {} is not a matrix", weight.name)));
        };
        let (a_role, b_role) = match weight.tp {
            TpRole::Row => (TpRole::Row, TpRole::PartialGradient),
            role if role.is_split() => (TpRole::PartialGradient, role),
            _ => (TpRole::Replicated, TpRole::Replicated),
        };
        let module = module_of(&weight.name);
        let bound = 1.0 / (inp as f64).sqrt();
        let factor = |part: &str, shape: Vec<i64>, init, tp| ParamSpec {
            name: format!("{module}.lora_{part}.weight"),
            shape,
            init,
            kind: weight.kind,
            tp,
            unit: weight.unit,
            requires_grad: true,
            linear: false,
        };
        let mut declare = |p: ParamSpec| {
            let id = ParamId(spec.params.len());
            if spec.find(&p.name).is_some() {
                return Err(Error::Config(format!("lora: the model already has a parameter {}", p.name)));
            }
            if let Some(unit) = spec.units.get_mut(p.unit) {
                unit.params.push(id);
            }
            spec.params.push(p);
            Ok(id)
        };
        let a = declare(factor("A", vec![self.r, inp], Init::Uniform { bound }, a_role))?;
        let b = declare(factor("B", vec![out, self.r], Init::Zeros, b_role))?;
        Ok(Adapter { a, b, scale: self.scale() })
    }
}
