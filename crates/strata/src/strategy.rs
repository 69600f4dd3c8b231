//! Strategies: ordered lists of optimization methods, each a name or a (name, config)
//! pair, written as readable JSON in the list form of ATorch's `auto_accelerate`, e.g.
//! `[["fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}]]` or `["zero2"]`.
//!
//! Owns: the typed configuration of every method, with its defaults, parsing from JSON
//! text or values, validation (errors name the bad method or field and list what is
//! allowed) and serialisation back to the same form. Must not execute anything: the
//! `parallel` module turns a validated strategy into an engine.
use crate::model::ModelSpec;
use crate::parallel::zero::{BackwardPrefetch, Stage, Wrap};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::Kind;

/// Method names this version understands.
pub const METHODS: [&str; 4] = ["parallel_mode", "zero1", "zero2", "fsdp"];

/// A validated strategy: its methods in the order given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Strategy {
    pub methods: Vec<Method>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Method {
    /// Data parallelism over every rank (the default when nothing else is chosen).
    ParallelMode(ParallelMode),
    Zero1(ShardConfig),
    Zero2(ShardConfig),
    Fsdp(ShardConfig),
}

/// `parallel_mode`: `[[[name, size], ...], rank_order]`. Only the `data` dimension exists
/// in this version; its size follows the world size.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ParallelMode(pub Vec<(String, usize)>, pub Option<Vec<usize>>);

/// FSDP's sharding strategies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ShardingStrategy {
    FullShard,
    ShardGradOp,
    NoShard,
    HybridShard,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackwardPrefetchName {
    #[serde(rename = "BACKWARD_PRE")]
    Pre,
    #[serde(rename = "BACKWARD_POST")]
    Post,
}

/// FSDP's `MixedPrecision`: dtypes by name (`"bf16"`, `"fp16"`, `"fp32"`); unset ones
/// leave that data in the model's dtype.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MixedPrecision {
    pub param_dtype: Option<String>,
    pub reduce_dtype: Option<String>,
    /// The reference models hold no buffers; a set value is validated and recorded.
    pub buffer_dtype: Option<String>,
}

/// Configuration of `zero1`, `zero2` and `fsdp`, with FSDP's argument names and defaults
/// and ATorch's wrap arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShardConfig {
    /// fsdp only (default FULL_SHARD).
    pub sharding_strategy: Option<ShardingStrategy>,
    pub backward_prefetch: Option<BackwardPrefetchName>,
    pub forward_prefetch: bool,
    pub limit_all_gathers: bool,
    pub sync_module_states: bool,
    pub mixed_precision: Option<MixedPrecision>,
    /// Unit kinds or names wrapped on their own; other units join the outermost wrap.
    pub atorch_wrap_cls: Vec<String>,
    /// Units with at least this many parameters are wrapped on their own.
    pub atorch_size_based_min_num_params: Option<u64>,
    /// Unit kinds or names left unsharded (replicated).
    pub atorch_ignored_cls: Vec<String>,
    /// Units holding trainable parameters join the outermost wrap.
    pub wrap_trainable_outmost: bool,
    /// Ranks per shard group with HYBRID_SHARD (default: the ranks of one node).
    pub hybrid_shard_size: Option<usize>,
    /// Parameter groups select parameters by name whatever this says.
    pub use_orig_params: bool,
}

impl Default for ShardConfig {
    fn default() -> Self {
        ShardConfig {
            sharding_strategy: None,
            backward_prefetch: Some(BackwardPrefetchName::Pre),
            forward_prefetch: false,
            limit_all_gathers: true,
            sync_module_states: false,
            mixed_precision: None,
            atorch_wrap_cls: vec![],
            atorch_size_based_min_num_params: None,
            atorch_ignored_cls: vec![],
            wrap_trainable_outmost: false,
            hybrid_shard_size: None,
            use_orig_params: false,
        }
    }
}

/// Parses a dtype name as strategies write it.
pub fn parse_dtype(name: &str) -> Result<Kind> {
    match name.to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        "fp16" | "float16" | "half" => Ok(Kind::Half),
        "fp32" | "float32" | "float" => Ok(Kind::Float),
        other => Err(Error::Config(format!("unknown dtype {other:?}; allowed: bf16, fp16, fp32"))),
    }
}

impl MixedPrecision {
    pub fn kinds(&self) -> Result<(Option<Kind>, Option<Kind>, Option<Kind>)> {
        let parse = |v: &Option<String>| v.as_deref().map(parse_dtype).transpose();
        Ok((parse(&self.param_dtype)?, parse(&self.reduce_dtype)?, parse(&self.buffer_dtype)?))
    }
}

impl ShardConfig {
    fn validate(&self, method: &str) -> Result<()> {
        let bad = |what: String| Err(Error::Config(format!("{method}: {what}")));
        if method != "fsdp" && self.sharding_strategy.is_some() {
            return bad("sharding_strategy belongs to fsdp (zero1 and zero2 fix their own)".into());
        }
        if !self.atorch_wrap_cls.is_empty() && self.atorch_size_based_min_num_params.is_some() {
            return bad("atorch_wrap_cls and atorch_size_based_min_num_params exclude each other".into());
        }
        if self.hybrid_shard_size == Some(0) {
            return bad("hybrid_shard_size must be positive".into());
        }
        if self.hybrid_shard_size.is_some() && self.sharding_strategy != Some(ShardingStrategy::HybridShard) {
            return bad("hybrid_shard_size needs sharding_strategy HYBRID_SHARD".into());
        }
        if let Some(mp) = &self.mixed_precision {
            if let Err(e) = mp.kinds() {
                return bad(e.to_string().trim_start_matches("invalid configuration: ").to_string());
            }
        }
        Ok(())
    }

    /// The ZeRO stage and whether parameters are freed after forward.
    pub fn stage(&self, method: &str) -> (Stage, bool) {
        match (method, self.sharding_strategy) {
            ("zero1", _) | (_, Some(ShardingStrategy::NoShard)) => (Stage::Optimizer, false),
            ("zero2", _) => (Stage::Gradients, false),
            (_, Some(ShardingStrategy::ShardGradOp)) => (Stage::Parameters, false),
            _ => (Stage::Parameters, true),
        }
    }

    pub fn backward_prefetch(&self) -> Option<BackwardPrefetch> {
        self.backward_prefetch.map(|b| match b {
            BackwardPrefetchName::Pre => BackwardPrefetch::Pre,
            BackwardPrefetchName::Post => BackwardPrefetch::Post,
        })
    }

    /// Applies the wrap policy to `spec`'s units. A name in a list must match some unit's
    /// kind or name.
    pub fn wrap(&self, spec: &ModelSpec) -> Result<Vec<Wrap>> {
        let matches = |list: &[String], k: usize| {
            let u = &spec.units[k];
            list.iter().any(|c| c == u.kind() || c == &u.name)
        };
        for (field, list) in
            [("atorch_wrap_cls", &self.atorch_wrap_cls), ("atorch_ignored_cls", &self.atorch_ignored_cls)]
        {
            if let Some(unknown) = list.iter().find(|c| !spec.units.iter().any(|u| u.kind() == *c || u.name == **c)) {
                let mut kinds: Vec<&str> = spec.units.iter().map(|u| u.kind()).collect();
                kinds.dedup();
                return Err(Error::Config(format!(
                    "{field}: {unknown:?} names no unit of this model; its unit kinds are {}",
                    kinds.join(", ")
                )));
            }
        }
        Ok((0..spec.units.len())
            .map(|k| {
                let numel: i64 = spec.units[k].params.iter().map(|id| spec.params[id.0].numel()).sum();
                let trainable = spec.units[k].params.iter().any(|id| spec.params[id.0].requires_grad);
                if matches(&self.atorch_ignored_cls, k) {
                    Wrap::Ignored
                } else if self.wrap_trainable_outmost && trainable {
                    Wrap::Root
                } else if !self.atorch_wrap_cls.is_empty() {
                    if matches(&self.atorch_wrap_cls, k) {
                        Wrap::Own
                    } else {
                        Wrap::Root
                    }
                } else if let Some(min) = self.atorch_size_based_min_num_params {
                    if numel as u64 >= min {
                        Wrap::Own
                    } else {
                        Wrap::Root
                    }
                } else {
                    Wrap::Own
                }
            })
            .collect())
    }
}

impl Method {
    pub fn name(&self) -> &'static str {
        match self {
            Method::ParallelMode(_) => "parallel_mode",
            Method::Zero1(_) => "zero1",
            Method::Zero2(_) => "zero2",
            Method::Fsdp(_) => "fsdp",
        }
    }

    fn parse(name: &str, config: Option<&Value>) -> Result<Method> {
        let shard = || -> Result<ShardConfig> {
            let c: ShardConfig = match config {
                None | Some(Value::Null) => ShardConfig::default(),
                Some(v) => serde_json::from_value(v.clone()).map_err(|e| Error::Config(format!("{name}: {e}")))?,
            };
            c.validate(name)?;
            Ok(c)
        };
        Ok(match name {
            "parallel_mode" => {
                let mode: ParallelMode = match config {
                    None | Some(Value::Null) => ParallelMode(vec![("data".into(), 0)], None),
                    Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
                        Error::Config(format!("parallel_mode: {e}; expected [[[\"data\", size]], null]"))
                    })?,
                };
                if let Some((other, _)) = mode.0.iter().find(|(n, _)| n != "data") {
                    return Err(Error::Config(format!(
                        "parallel_mode: dimension {other:?} is not available; allowed: data"
                    )));
                }
                Method::ParallelMode(mode)
            }
            "zero1" => Method::Zero1(shard()?),
            "zero2" => Method::Zero2(shard()?),
            "fsdp" => Method::Fsdp(shard()?),
            other => return Err(Error::Config(format!("unknown method {other:?}; allowed: {}", METHODS.join(", ")))),
        })
    }

    /// The sharding method's configuration, if this is one.
    pub fn shard_config(&self) -> Option<&ShardConfig> {
        match self {
            Method::Zero1(c) | Method::Zero2(c) | Method::Fsdp(c) => Some(c),
            Method::ParallelMode(_) => None,
        }
    }

    fn to_value(&self) -> Value {
        let config = match self {
            Method::ParallelMode(m) => serde_json::to_value(m),
            Method::Zero1(c) | Method::Zero2(c) | Method::Fsdp(c) => serde_json::to_value(c),
        };
        Value::Array(vec![Value::String(self.name().into()), config.unwrap_or(Value::Null)])
    }
}

impl Strategy {
    /// Parses the list form from JSON text.
    pub fn parse(text: &str) -> Result<Strategy> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| Error::Config(format!("a strategy must be JSON: {e}")))?;
        Strategy::from_value(&value)
    }

    /// Parses the list form: each item is `"name"` or `["name", config]`.
    pub fn from_value(value: &Value) -> Result<Strategy> {
        let items = value
            .as_array()
            .ok_or_else(|| Error::Config("a strategy is a JSON list of methods, e.g. [\"zero2\"]".into()))?;
        let mut methods = Vec::new();
        for item in items {
            let method = match item {
                Value::String(name) => Method::parse(name, None)?,
                Value::Array(pair) if (1..=2).contains(&pair.len()) && pair[0].is_string() => {
                    Method::parse(pair[0].as_str().unwrap_or_default(), pair.get(1))?
                }
                other => {
                    return Err(Error::Config(format!(
                        "strategy item {other} is neither a method name nor a [name, config] pair"
                    )))
                }
            };
            if methods.iter().any(|m: &Method| m.name() == method.name()) {
                return Err(Error::Config(format!("method {} appears twice", method.name())));
            }
            methods.push(method);
        }
        let sharding: Vec<&str> = methods.iter().filter(|m| m.shard_config().is_some()).map(Method::name).collect();
        if sharding.len() > 1 {
            return Err(Error::Config(format!(
                "{} cannot be combined: choose one of zero1, zero2, fsdp",
                sharding.join(" and ")
            )));
        }
        Ok(Strategy { methods })
    }

    /// The list form, every config written out with its defaults.
    pub fn to_value(&self) -> Value {
        Value::Array(self.methods.iter().map(Method::to_value).collect())
    }

    /// The sharding method, if any: (name, config).
    pub fn sharding(&self) -> Option<(&'static str, &ShardConfig)> {
        self.methods.iter().find_map(|m| m.shard_config().map(|c| (m.name(), c)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_forms_parse_and_round_trip() {
        for text in [
            r#"["zero2"]"#,
            r#"[["fsdp", {"sharding_strategy": "SHARD_GRAD_OP", "forward_prefetch": true}]]"#,
            r#"["parallel_mode", ["zero1", {"mixed_precision": {"param_dtype": "bf16"}}]]"#,
            r#"[["parallel_mode", [[["data", 4]], null]], ["fsdp", {"atorch_wrap_cls": ["GptBlock"]}]]"#,
            "[]",
        ] {
            let s = Strategy::parse(text).unwrap();
            assert_eq!(Strategy::from_value(&s.to_value()).unwrap(), s, "{text}");
        }
        let s =
            Strategy::parse(r#"[["fsdp", {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}]]"#).unwrap();
        let (name, c) = s.sharding().unwrap();
        assert_eq!((name, c.stage(name)), ("fsdp", (Stage::Parameters, true)));
        assert_eq!(c.backward_prefetch(), Some(BackwardPrefetch::Pre), "FSDP's default");
    }

    #[test]
    fn bad_strategies_name_the_problem_and_what_is_allowed() {
        for (text, expected) in [
            ("zero2", "must be JSON"),
            (r#"{"zero2": {}}"#, "JSON list"),
            (r#"["zero4"]"#, "allowed: parallel_mode, zero1, zero2, fsdp"),
            (r#"[["fsdp", {"sharding": 1}]]"#, "unknown field `sharding`"),
            (r#"[["fsdp", {"sharding_strategy": "HALF_SHARD"}]]"#, "FULL_SHARD"),
            (r#"[["zero2", {"sharding_strategy": "FULL_SHARD"}]]"#, "belongs to fsdp"),
            (r#"["zero1", "fsdp"]"#, "cannot be combined"),
            (r#"["zero1", "zero1"]"#, "twice"),
            (r#"[["fsdp", {"mixed_precision": {"param_dtype": "int8"}}]]"#, "allowed: bf16, fp16, fp32"),
            (r#"[["parallel_mode", [[["tensor", 2]], null]]]"#, "allowed: data"),
            (r#"[["fsdp", {"atorch_wrap_cls": ["X"], "atorch_size_based_min_num_params": 5}]]"#, "exclude each other"),
        ] {
            let err = Strategy::parse(text).unwrap_err().to_string();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }
}
