//! Hugging Face model folders: a folder's `config.json` read into a built-in model's
//! configuration (GPT-2 for `gpt2`; the LLaMA model for `llama`, `mistral` and `qwen2`) and
//! written back from one, and each family's parameter names and layouts.
//!
//! Owns: the families, their config keys (each key that changes the computation is honoured
//! or refused by name), a folder's file list (one safetensors file or the shards an index
//! names, the tokenizer) and the mapping of names. Must not read tensors or touch an
//! engine: `io` loads and saves weights through [`Family::strata_name`] and [`Family::hf_name`].
use super::{GptConfig, LlamaConfig, ModelConfig, ModelSpec};
use crate::{Error, Result};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

/// The single weights file of a model folder.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index naming the shards of a sharded model folder.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Files describing a folder's tokenizer, copied along when a model is written back.
pub const TOKENIZER_FILES: [&str; 4] =
    ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"];
/// Config keys naming special tokens, carried from a read folder to a written one.
const TOKEN_KEYS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

/// A model family as Hugging Face `transformers` names it (`model_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Gpt2,
    Llama,
    Mistral,
    Qwen2,
}

/// GPT-2's `Conv1D` layers keep their weights as `[in, out]`; Strata's are `[out, in]`.
const CONV1D_WEIGHTS: [&str; 4] = ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"];

impl Family {
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
        }
    }

    fn architecture(self) -> &'static str {
        match self {
            Family::Gpt2 => "GPT2LMHeadModel",
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    fn from_model_type(name: &str) -> Option<Family> {
        [Family::Gpt2, Family::Llama, Family::Mistral, Family::Qwen2].into_iter().find(|f| f.model_type() == name)
    }

    /// The family a built-in model is written as: GPT as GPT-2; the LLaMA model as Qwen2
    /// where only its query, key and value projections have biases, else as LLaMA.
    pub fn of(config: &ModelConfig) -> Result<Family> {
        match config {
            ModelConfig::Gpt(_) => Ok(Family::Gpt2),
            ModelConfig::Llama(c) if c.qkv_bias && !c.o_bias => Ok(Family::Qwen2),
            ModelConfig::Llama(c) if c.qkv_bias == c.o_bias => Ok(Family::Llama),
            ModelConfig::Llama(_) => Err(Error::Config(
                "no model family has a bias on the attention output alone: it cannot be written".into(),
            )),
            ModelConfig::Mlp(_) => {
                Err(Error::Config("the mlp model has no Hugging Face family to be written as".into()))
            }
        }
    }

    /// The name a family's files give a Strata parameter, and whether they hold its matrix
    /// transposed.
    pub fn hf_name(self, name: &str) -> (String, bool) {
        let transposed = self == Family::Gpt2 && CONV1D_WEIGHTS.iter().any(|w| name.ends_with(w));
        (name.to_string(), transposed)
    }

    /// The Strata parameter a tensor of a family's file holds, and whether it is stored
    /// transposed; `None` for buffers the family saves that are not parameters (GPT-2's
    /// attention masks, older LLaMAs' rotary frequencies).
    pub fn strata_name(self, name: &str) -> Option<(String, bool)> {
        match self {
            Family::Gpt2 => {
                if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
                    return None;
                }
                // A bare `GPT2Model` saves its parameters without the `transformer.` prefix.
                let bare = ["wte.", "wpe.", "h.", "ln_f."].iter().any(|p| name.starts_with(p));
                let full = if bare { format!("transformer.{name}") } else { name.to_string() };
                let transposed = self.hf_name(&full).1;
                Some((full, transposed))
            }
            _ if name.ends_with("rotary_emb.inv_freq") => None,
            _ => Some((name.to_string(), false)),
        }
    }

    /// The `config.json` of `config` written as this family, with `special_tokens` (the
    /// read folder's `bos_token_id`, ...) carried along.
    pub fn config_json(self, config: &ModelConfig, special_tokens: &Map<String, Value>) -> Result<Value> {
        let mut out = match (self, config) {
            (Family::Gpt2, ModelConfig::Gpt(c)) => json!({
                "n_embd": c.dim,
                "n_layer": c.layers,
                "n_head": c.heads,
                "n_positions": c.ctx,
                "vocab_size": c.vocab,
                "layer_norm_epsilon": c.norm_eps,
                "activation_function": "gelu_new",
                "n_inner": null,
                "tie_word_embeddings": true,
                // Strata trains without dropout.
                "attn_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "resid_pdrop": 0.0,
            }),
            (Family::Llama | Family::Mistral | Family::Qwen2, ModelConfig::Llama(c)) => {
                let mut v = json!({
                    "hidden_size": c.dim,
                    "intermediate_size": c.hidden(),
                    "num_hidden_layers": c.layers,
                    "num_attention_heads": c.heads,
                    "num_key_value_heads": c.key_value_heads(),
                    "head_dim": c.dim / c.heads,
                    "max_position_embeddings": c.ctx,
                    "vocab_size": c.vocab,
                    "rms_norm_eps": c.norm_eps,
                    "hidden_act": "silu",
                    "tie_word_embeddings": c.tie_embeddings,
                    "rope_theta": c.rope_theta,
                    "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
                    "attention_dropout": 0.0,
                });
                if self == Family::Qwen2 {
                    v["use_sliding_window"] = json!(false);
                    v["sliding_window"] = Value::Null;
                } else {
                    v["attention_bias"] = json!(c.o_bias);
                    v["mlp_bias"] = json!(false);
                }
                v
            }
            (family, _) => {
                return Err(Error::Config(format!("this model cannot be written as a {} model", family.model_type())))
            }
        };
        out["model_type"] = json!(self.model_type());
        out["architectures"] = json!([self.architecture()]);
        out["dtype"] = json!("float32");
        for (key, value) in special_tokens {
            out[key] = value.clone();
        }
        Ok(out)
    }
}

/// A Hugging Face model folder, read: the model it describes and where its files are.
#[derive(Clone, Debug)]
pub struct ModelDir {
    pub dir: PathBuf,
    pub family: Family,
    pub config: ModelConfig,
    /// The safetensors files holding the weights, in the index's order of first use.
    pub weights: Vec<PathBuf>,
    /// The folder's `tokenizer.json`, if it has one.
    pub tokenizer: Option<PathBuf>,
    /// `bos_token_id`, `eos_token_id` and `pad_token_id` as the config gives them.
    pub special_tokens: Map<String, Value>,
}

impl ModelDir {
    /// The model function of the folder's model.
    pub fn build(&self, b: &mut super::Builder) -> Result<()> {
        self.config.build(b)
    }

    pub fn spec(&self) -> Result<ModelSpec> {
        self.config.spec()
    }

    /// The token ids that end a generated text (`eos_token_id`: one id or a list).
    pub fn eos_tokens(&self) -> Vec<i64> {
        match self.special_tokens.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_i64().into_iter().collect(),
            Some(Value::Array(ids)) => ids.iter().filter_map(Value::as_i64).collect(),
            _ => vec![],
        }
    }
}

/// Reads the Hugging Face model folder `dir`: its `config.json`, the weight files it holds
/// (checked to exist) and its tokenizer. Architectures and config keys Strata cannot
/// honour are refused by name.
pub fn from_pretrained_dir(dir: &Path) -> Result<ModelDir> {
    let fail = |message: String| Error::Weights { path: dir.to_path_buf(), message };
    let config_path = dir.join("config.json");
    if !config_path.is_file() {
        return Err(fail("no config.json: not a model folder".into()));
    }
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    let raw: Value = serde_json::from_str(&text).map_err(|e| fail(format!("config.json is not valid JSON ({e})")))?;
    let cfg = raw.as_object().ok_or_else(|| fail("config.json is not a JSON object".into()))?;
    let keys = Keys { cfg };
    let model_type = keys.text("model_type").map_err(fail)?.unwrap_or_default();
    let family = Family::from_model_type(&model_type).ok_or_else(|| {
        fail(format!("config.json: model_type {model_type:?} is not a family Strata has (gpt2, llama, mistral, qwen2)"))
    })?;
    let config = match family {
        Family::Gpt2 => ModelConfig::Gpt(keys.gpt2().map_err(fail)?),
        _ => ModelConfig::Llama(keys.llama(family).map_err(fail)?),
    };
    match &config {
        ModelConfig::Gpt(c) => c.validate(),
        ModelConfig::Llama(c) => c.validate(),
        ModelConfig::Mlp(_) => Ok(()),
    }
    .map_err(|e| match e {
        Error::Config(why) => fail(format!("config.json: {why}")),
        other => other,
    })?;
    let special_tokens = TOKEN_KEYS.iter().filter_map(|&k| Some((k.to_string(), cfg.get(k)?.clone()))).collect();
    let tokenizer = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());
    Ok(ModelDir { dir: dir.to_path_buf(), family, config, weights: weight_files(dir)?, tokenizer, special_tokens })
}

/// The safetensors files of a folder: the shards its index names, or its single file.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let fail = |message: String| Error::Weights { path: dir.to_path_buf(), message };
    let index = dir.join(INDEX_FILE);
    if !index.is_file() {
        let single = dir.join(WEIGHTS_FILE);
        if single.is_file() {
            return Ok(vec![single]);
        }
        return Err(fail(format!("holds neither {WEIGHTS_FILE} nor {INDEX_FILE} (only safetensors weights are read)")));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
    let parsed: Value =
        serde_json::from_str(&text).map_err(|e| fail(format!("{INDEX_FILE} is not valid JSON ({e})")))?;
    let map = parsed
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| fail(format!("{INDEX_FILE} has no weight_map object")))?;
    let mut files: Vec<PathBuf> = vec![];
    for (tensor, file) in map {
        let name = file.as_str().ok_or_else(|| fail(format!("{INDEX_FILE}: {tensor} names no file")))?;
        // Shards sit beside the index: a name that leaves the folder is not one.
        if name.contains('/') || name.contains('\\') || name == ".." {
            return Err(fail(format!("{INDEX_FILE}: shard name {name:?} is not a file of the folder")));
        }
        let path = dir.join(name);
        if !files.contains(&path) {
            if !path.is_file() {
                return Err(fail(format!("missing shard {name} (named by {INDEX_FILE} for {tensor})")));
            }
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(fail(format!("{INDEX_FILE} names no shards")));
    }
    Ok(files)
}

/// Typed reads of a config's keys; errors are the message for the folder's error.
struct Keys<'a> {
    cfg: &'a Map<String, Value>,
}

type KeyResult<T> = std::result::Result<T, String>;

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.cfg.get(key).filter(|v| !v.is_null())
    }

    fn int(&self, key: &str) -> KeyResult<Option<i64>> {
        self.get(key)
            .map(|v| v.as_i64().ok_or_else(|| format!("config.json: {key} is not an integer ({v})")))
            .transpose()
    }

    fn required(&self, key: &str) -> KeyResult<i64> {
        self.int(key)?.ok_or_else(|| format!("config.json: {key} is missing"))
    }

    fn float(&self, key: &str) -> KeyResult<Option<f64>> {
        self.get(key).map(|v| v.as_f64().ok_or_else(|| format!("config.json: {key} is not a number ({v})"))).transpose()
    }

    fn flag(&self, key: &str) -> KeyResult<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| format!("config.json: {key} is not true or false ({v})")))
            .transpose()
    }

    fn text(&self, key: &str) -> KeyResult<Option<String>> {
        self.get(key)
            .map(|v| v.as_str().map(String::from).ok_or_else(|| format!("config.json: {key} is not a string ({v})")))
            .transpose()
    }

    /// Refuses `key` unless it is absent or one of `allowed`; `why` says what Strata does.
    fn only(&self, key: &str, allowed: &[Value], why: &str) -> KeyResult<()> {
        match self.get(key) {
            Some(v) if !allowed.contains(v) => Err(format!("config.json: {key} = {v} is not supported ({why})")),
            _ => Ok(()),
        }
    }

    /// Dropout changes only training, and Strata trains without it: said, not refused.
    fn note_dropout(&self, keys: &[&str]) -> KeyResult<()> {
        for key in keys {
            if let Some(p) = self.float(key)?.filter(|&p| p > 0.0) {
                tracing::warn!(key, p, "the model folder asks for dropout; Strata trains without dropout");
            }
        }
        Ok(())
    }

    fn gpt2(&self) -> KeyResult<GptConfig> {
        let dim = self.required("n_embd")?;
        self.only("activation_function", &[json!("gelu_new"), json!("gelu_pytorch_tanh")], "GPT-2 runs GELU (tanh)")?;
        if let Some(inner) = self.int("n_inner")?.filter(|&n| Some(n) != dim.checked_mul(4)) {
            return Err(format!("config.json: n_inner = {inner} is not supported (GPT-2's MLP is 4 · n_embd wide)"));
        }
        self.only("scale_attn_weights", &[json!(true)], "attention scores are scaled by 1/√head size")?;
        self.only("scale_attn_by_inverse_layer_idx", &[json!(false)], "no per-layer attention scaling")?;
        self.only("reorder_and_upcast_attn", &[json!(false)], "attention computes in the model's dtype")?;
        self.only("add_cross_attention", &[json!(false)], "Strata's GPT-2 is a decoder only")?;
        self.only("tie_word_embeddings", &[json!(true)], "GPT-2's output head is its token embedding")?;
        self.note_dropout(&["attn_pdrop", "embd_pdrop", "resid_pdrop"])?;
        let ctx = match self.int("n_positions")? {
            Some(n) => n,
            None => self.required("n_ctx")?,
        };
        Ok(GptConfig {
            norm_eps: self.float("layer_norm_epsilon")?.unwrap_or(1e-5),
            ..GptConfig::new(
                self.required("vocab_size")?,
                ctx,
                self.required("n_layer")?,
                self.required("n_head")?,
                dim,
            )
        })
    }

    fn llama(&self, family: Family) -> KeyResult<LlamaConfig> {
        let (dim, heads) = (self.required("hidden_size")?, self.required("num_attention_heads")?);
        self.only("hidden_act", &[json!("silu")], "the feed-forward is SwiGLU")?;
        self.only("mlp_bias", &[json!(false)], "the feed-forward has no biases")?;
        if let Some(head_dim) = self.int("head_dim")?.filter(|&h| heads > 0 && h.checked_mul(heads) != Some(dim)) {
            return Err(format!(
                "config.json: head_dim = {head_dim} is not supported (heads are hidden_size / num_attention_heads = {} wide)",
                dim / heads.max(1)
            ));
        }
        let rope_theta = self.rope_theta()?;
        let mut ctx = self.int("max_position_embeddings")?.unwrap_or(2048);
        if family == Family::Qwen2 {
            self.only("use_sliding_window", &[json!(false)], "attention is full causal")?;
            if let Some(types) = self.get("layer_types").and_then(Value::as_array) {
                if let Some(other) = types.iter().find(|t| *t != "full_attention") {
                    return Err(format!(
                        "config.json: layer_types holds {other}, not supported (attention is full causal)"
                    ));
                }
            }
        }
        if family == Family::Mistral {
            // Within the window a sliding window is full causal attention: the context stops there.
            if let Some(window) = self.int("sliding_window")? {
                ctx = ctx.min(window);
            }
        }
        self.note_dropout(&["attention_dropout"])?;
        let attention_bias = self.flag("attention_bias")?.unwrap_or(false);
        Ok(LlamaConfig {
            ffn_dim: Some(self.required("intermediate_size")?),
            rope_theta,
            kv_heads: self.int("num_key_value_heads")?,
            norm_eps: self.float("rms_norm_eps")?.unwrap_or(1e-6),
            tie_embeddings: self.flag("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias: family == Family::Qwen2 || attention_bias,
            o_bias: family != Family::Qwen2 && attention_bias,
            ..LlamaConfig::new(self.required("vocab_size")?, ctx, self.required("num_hidden_layers")?, heads, dim)
        })
    }

    /// The rotary base, from `rope_parameters` (transformers 5) or `rope_theta` with
    /// `rope_scaling` (earlier); only the unscaled rotation is honoured.
    fn rope_theta(&self) -> KeyResult<f64> {
        let (params, scaling) = (self.get("rope_parameters"), self.get("rope_scaling"));
        for (key, p) in [("rope_parameters", params), ("rope_scaling", scaling)] {
            let Some(p) = p else { continue };
            let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
            if kind != "default" {
                return Err(format!(
                    "config.json: {key} type {kind:?} is not supported (Strata's rotary embedding is unscaled)"
                ));
            }
        }
        match params.and_then(|p| p.get("rope_theta")) {
            Some(v) => {
                v.as_f64().ok_or_else(|| format!("config.json: rope_parameters.rope_theta is not a number ({v})"))
            }
            None => Ok(self.float("rope_theta")?.unwrap_or(10_000.0)),
        }
    }
}
