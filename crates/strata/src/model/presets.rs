//! Well-known model sizes by name, for estimates and plans of models one does not have at
//! hand: the published shapes of GPT-2, of the LLaMA families (vocabulary, context,
//! layers, heads, width, key/value heads, feed-forward width, rotary base) and of three
//! mixtures of experts (Mixtral 8×7B, Qwen3-30B-A3B, OLMoE-1B-7B).
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

/// The names [`preset`] knows.
pub fn preset_names() -> Vec<&'static str> {
    GPT2.iter().chain(LLAMA.iter()).chain(MOE.iter().map(|m| &m.0)).map(|s| s.0).collect()
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
        for (name, total, active) in
            [("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3), ("olmoe-1b-7b", 6.9, 1.3)]
        {
            let spec = preset(name).unwrap().spec().unwrap();
            let (all, used) = (spec.num_params() as f64 / 1e9, spec.active_params().unwrap() as f64 / 1e9);
            assert!((all / total - 1.0).abs() < 0.02, "{name}: {all:.2}B against {total}B");
            assert!((used / active - 1.0).abs() < 0.05, "{name}: {used:.2}B active against {active}B");
        }
    }
}
