//! Well-known model sizes by name, for estimates and plans of models one does not have at
//! hand: the published shapes of GPT-2 and of the LLaMA families (vocabulary, context,
//! layers, heads, width, key/value heads, feed-forward width, rotary base).
//!
//! Owns the table. Must not read files or allocate: a preset is a configuration only.
use super::{GptConfig, LlamaConfig, ModelConfig};
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

/// The names [`preset`] knows.
pub fn preset_names() -> Vec<&'static str> {
    GPT2.iter().chain(LLAMA.iter()).map(|s| s.0).collect()
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
}
