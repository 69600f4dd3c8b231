//! Well-known model sizes by name, for estimates and plans of models one does not have at
//! hand: the published shapes of GPT-2, of the LLaMA families (vocabulary, context,
//! layers, heads, width, key/value heads, feed-forward width, rotary base), of three
//! mixtures of experts (Mixtral 8×7B, Qwen3-30B-A3B, OLMoE-1B-7B), and of the frontier
//! families as their published `config.json` keys say (DeepSeek-V3, GLM-4.5 and its Air,
//! Qwen3-Next-80B-A3B, gpt-oss 20B and 120B), read as a folder's would be.
//!
//! Owns the table. Must not read files or allocate: a preset is a configuration only.
use super::{ExpertNames, GptConfig, LlamaConfig, ModelConfig, MoeConfig};
use crate::{Error, Result};

/// (name, vocabulary, context, layers, heads, width, key/value heads, feed-forward width,
/// rotary base); GPT-2's sizes have no key/value heads or feed-forward width of their own.
type Shape = (&'static str, i64, i64, i64, i64, i64, Option<i64>, Option<i64>, f64);

const GPT2: [Shape; 4] = [
    ("gpt2", 50257, 1024, 12, 12, 768, None, None, 0.0),
    ("gpt2-medium", 50257, 1024, 24, 16, 1024, None, None, 0.0),
    ("gpt2-large", 50257, 1024, 36, 20, 1280, None, None, 0.0),
    ("gpt2-xl", 50257, 1024, 48, 25, 1600, None, None, 0.0),
];

const LLAMA: [Shape; 7] = [
    ("tinyllama-1.1b", 32000, 2048, 22, 32, 2048, Some(4), Some(5632), 10_000.0),
    ("llama-2-7b", 32000, 4096, 32, 32, 4096, None, Some(11008), 10_000.0),
    ("llama-2-13b", 32000, 4096, 40, 40, 5120, None, Some(13824), 10_000.0),
    ("llama-2-70b", 32000, 4096, 80, 64, 8192, Some(8), Some(28672), 10_000.0),
    ("llama-3-8b", 128256, 8192, 32, 32, 4096, Some(8), Some(14336), 500_000.0),
    ("llama-3-70b", 128256, 8192, 80, 64, 8192, Some(8), Some(28672), 500_000.0),
    ("llama-3.1-405b", 128256, 131072, 126, 128, 16384, Some(8), Some(53248), 500_000.0),
];

/// Mixtures of experts: the decoder's shape as above, then (experts, experts per token,
/// expert width, renormalised top-k, per-head or whole-projection query/key norms).
type Experts = (Shape, i64, i64, i64, bool, Option<bool>);

const MOE: [Experts; 3] = [
    (("mixtral-8x7b", 32000, 32768, 32, 32, 4096, Some(8), Some(14336), 1e6), 8, 2, 14336, true, None),
    (("qwen3-30b-a3b", 151936, 40960, 48, 32, 2048, Some(4), Some(6144), 1e6), 128, 8, 768, true, Some(false)),
    (("olmoe-1b-7b", 50304, 4096, 16, 16, 2048, None, Some(1024), 10_000.0), 64, 8, 1024, false, Some(true)),
];

/// Models whose shapes take more than a table row: the keys of their published
/// `config.json` that shape them (the rest keep `transformers`' defaults).
const FOLDERS: [(&str, &str); 6] = [
    (
        "deepseek-v3",
        r#"{"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
            "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
            "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
            "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "norm_topk_prob": true, "max_position_embeddings": 163840,
            "rope_parameters": {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "rope_theta": 10000}}"#,
    ),
    (
        "glm-4.5",
        r#"{"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120, "intermediate_size": 12288,
            "moe_intermediate_size": 1536, "num_hidden_layers": 92, "num_attention_heads": 96,
            "num_key_value_heads": 8, "head_dim": 128, "n_shared_experts": 1, "n_routed_experts": 160,
            "num_experts_per_tok": 8, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
            "attention_bias": true, "use_qk_norm": true, "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000, "partial_rotary_factor": 0.5}}"#,
    ),
    (
        "glm-4.5-air",
        r#"{"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
            "num_key_value_heads": 8, "head_dim": 128, "n_shared_experts": 1, "n_routed_experts": 128,
            "num_experts_per_tok": 8, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
            "attention_bias": true, "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000, "partial_rotary_factor": 0.5}}"#,
    ),
    (
        "qwen3-next-80b-a3b",
        r#"{"model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
            "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
            "norm_topk_prob": true, "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}}"#,
    ),
    (
        "gpt-oss-20b",
        r#"{"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
            "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": false, "original_max_position_embeddings": 4096, "rope_theta": 150000}}"#,
    ),
    (
        "gpt-oss-120b",
        r#"{"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
            "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": false, "original_max_position_embeddings": 4096, "rope_theta": 150000}}"#,
    ),
];

/// The names [`preset`] knows.
pub fn preset_names() -> Vec<&'static str> {
    let tables = GPT2.iter().chain(LLAMA.iter()).chain(MOE.iter().map(|m| &m.0)).map(|s| s.0);
    tables.chain(FOLDERS.iter().map(|f| f.0)).collect()
}

/// The configuration of the model called `name` (`gpt2`, `llama-3-8b`, …).
pub fn preset(name: &str) -> Result<ModelConfig> {
    let find = |table: &[Shape]| table.iter().find(|s| s.0.eq_ignore_ascii_case(name)).copied();
    if let Some((_, vocab, ctx, layers, heads, dim, ..)) = find(&GPT2) {
        return Ok(ModelConfig::Gpt(GptConfig::new(vocab, ctx, layers, heads, dim)));
    }
    if let Some((_, vocab, ctx, layers, heads, dim, kv_heads, ffn_dim, rope_theta)) = find(&LLAMA) {
        return Ok(ModelConfig::Llama(LlamaConfig {
            kv_heads,
            ffn_dim,
            rope_theta,
            ..LlamaConfig::new(vocab, ctx, layers, heads, dim)
        }));
    }
    if let Some(&(shape, experts, top_k, width, norm_topk, qk_norm)) =
        MOE.iter().find(|m| m.0 .0.eq_ignore_ascii_case(name))
    {
        let (_, vocab, ctx, layers, heads, dim, kv_heads, ffn_dim, rope_theta) = shape;
        let qwen = qk_norm == Some(false);
        return Ok(ModelConfig::Llama(LlamaConfig {
            kv_heads,
            ffn_dim,
            rope_theta,
            // Qwen3's heads are 128 wide whatever the width.
            head_dim: qwen.then_some(128),
            qk_norm: qk_norm.is_some(),
            qk_norm_whole: qk_norm == Some(true),
            moe: Some(MoeConfig {
                norm_topk,
                aux_loss_coef: 0.001,
                names: if qk_norm.is_none() { ExpertNames::BlockSparse } else { ExpertNames::Mlp },
                ..MoeConfig::new(experts, top_k, width)
            }),
            ..LlamaConfig::new(vocab, ctx, layers, heads, dim)
        }));
    }
    if let Some((_, keys)) = FOLDERS.iter().find(|f| f.0.eq_ignore_ascii_case(name)) {
        let keys: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(keys).map_err(|e| Error::Model(format!("preset {name}: {e}")))?;
        return super::hf::config_from_keys(&keys).map(|(_, config)| config).map_err(Error::Config);
    }
    Err(Error::Config(format!("no model preset {name:?}; known: {}", preset_names().join(", "))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The presets' parameter counts are the published ones.
    #[test]
    fn presets_have_their_published_sizes() {
        for (name, billions) in [
            ("gpt2", 0.124),
            ("tinyllama-1.1b", 1.10),
            ("llama-2-7b", 6.74),
            ("llama-3-8b", 8.03),
            ("llama-3-70b", 70.6),
        ] {
            let params = preset(name).unwrap().spec().unwrap().num_params() as f64 / 1e9;
            assert!((params / billions - 1.0).abs() < 0.01, "{name}: {params:.3}B against {billions}B");
        }
        assert!(preset("llama-9").unwrap_err().to_string().contains("llama-3-8b"));
    }

    /// A mixture of experts' presets hold their published total and active sizes.
    #[test]
    fn mixtures_of_experts_count_total_and_active_parameters() {
        for (name, total, active) in [
            ("mixtral-8x7b", 46.7, 12.9),
            ("qwen3-30b-a3b", 30.5, 3.3),
            ("olmoe-1b-7b", 6.9, 1.3),
            ("deepseek-v3", 671.0, 37.0),
            // GLM's published active sizes (32B, 12B) leave out the embedding and the
            // head (1.6B, 1.2B).
            ("glm-4.5", 355.0, 33.6),
            ("glm-4.5-air", 106.0, 13.4),
            // OpenAI's active sizes (3.6B, 5.1B) leave out the embedding (0.6B).
            ("gpt-oss-20b", 20.9, 4.2),
            ("gpt-oss-120b", 116.8, 5.7),
        ] {
            let spec = preset(name).unwrap().spec().unwrap();
            let (all, used) = (spec.num_params() as f64 / 1e9, spec.active_params().unwrap() as f64 / 1e9);
            assert!((all / total - 1.0).abs() < 0.02, "{name}: {all:.2}B against {total}B");
            assert!((used / active - 1.0).abs() < 0.05, "{name}: {used:.2}B active against {active}B");
        }
    }
}
