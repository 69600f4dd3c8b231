//! Text generation from a trained model: greedy decoding or sampling (temperature, top-k,
//! top-p) from a seed, with a key/value cache so each new token costs one position.
//!
//! Owns: the decoding loop and the choice of each next token. Must not own weights or
//! tokenisation: it takes an engine holding a whole model and token ids.
use crate::engine::{with_seed, Engine};
use crate::model::{DecodeCache, RowLayout};
use crate::{Error, Result};
use tch::{Kind, Tensor};

/// How tokens are chosen and when generation stops.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateConfig {
    /// The most tokens generated after the prompt.
    pub max_new_tokens: usize,
    /// Divides the logits before sampling; 0 chooses the most likely token (greedy).
    pub temperature: f64,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities first reach `p` together.
    pub top_p: Option<f64>,
    /// Seed of the sampling draws.
    pub seed: u64,
    /// Tokens that end the text (the one produced is kept, as `transformers` keeps it).
    pub stop_tokens: Vec<i64>,
    /// Decode with a key/value cache; without, each token recomputes the whole window.
    pub cache: bool,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        GenerateConfig {
            max_new_tokens: 64,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            stop_tokens: vec![],
            cache: true,
        }
    }
}

impl GenerateConfig {
    /// Refuses a negative or non-finite temperature, a `top_k` of 0 and a `top_p` outside (0, 1].
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::Config(format!("temperature must be 0 (greedy) or positive, got {}", self.temperature)));
        }
        if self.top_k == Some(0) {
            return Err(Error::Config("top_k must be at least 1".into()));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(Error::Config(format!("top_p must lie in (0, 1], got {p}")));
        }
        Ok(())
    }

    fn greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// The tokens `engine` continues `prompt` with (the prompt not included). `context` is the
/// longest sequence the model takes: past it, the window slides and is recomputed whole.
pub fn generate(
    engine: &mut Engine,
    prompt: &[i64],
    config: &GenerateConfig,
    context: Option<i64>,
) -> Result<Vec<i64>> {
    config.validate()?;
    if prompt.is_empty() {
        return Err(Error::Config("the prompt holds no tokens".into()));
    }
    let device = engine.config().device;
    let units = engine.spec().units.len();
    let window = context.unwrap_or(i64::MAX) as usize;
    // One plain row: no layout from a training batch applies.
    engine.set_layout(None);
    let mut tokens = prompt.to_vec();
    // The cache holds the positions decoded so far; `None` once the window slides.
    let mut caches: Option<Vec<DecodeCache>> =
        config.cache.then(|| (0..units).map(|_| DecodeCache::default()).collect());
    produce(config, |produced| {
        tokens.extend(produced.last());
        if caches.is_some() && tokens.len() > window {
            caches = None;
        }
        match caches.as_mut() {
            Some(c) => {
                let seen = c[0].position() as usize;
                engine.decode(&row(&tokens[seen..], device)?, c)
            }
            None => engine.evaluate(&row(&tokens[tokens.len().saturating_sub(window)..], device)?),
        }
    })
}

/// The tokens chosen one after another from the logits `next_logits` gives for the tokens
/// chosen so far (its output's last position), under `config`'s seed, until its count or a
/// stop token.
fn produce(config: &GenerateConfig, mut next_logits: impl FnMut(&[i64]) -> Result<Tensor>) -> Result<Vec<i64>> {
    with_seed(config.seed as i64, || {
        let mut produced = Vec::with_capacity(config.max_new_tokens);
        while produced.len() < config.max_new_tokens {
            let logits = next_logits(&produced)?;
            let next = choose(&logits.f_select(1, -1)?.f_select(0, 0)?, config)?;
            produced.push(next);
            if config.stop_tokens.contains(&next) {
                break;
            }
        }
        Ok(produced)
    })
}

/// The target an encoder–decoder (T5) writes for `source`, starting from `decoder_start`
/// (the start token not included). The encoder runs once; with the cache each new target
/// token then costs one decoder position, without it the whole target is decoded again.
pub fn generate_from_source(
    engine: &mut Engine,
    source: &[i64],
    decoder_start: i64,
    config: &GenerateConfig,
) -> Result<Vec<i64>> {
    config.validate()?;
    if source.is_empty() {
        return Err(Error::Config("the source holds no tokens".into()));
    }
    let device = engine.config().device;
    let sources = source.len() as i64;
    let mut target = vec![decoder_start];
    let layout = |targets: usize| -> Result<RowLayout> {
        RowLayout::encoder_decoder(&[sources], sources, targets as i64)?.to_device(device)
    };
    let mut caches: Option<Vec<DecodeCache>> =
        config.cache.then(|| (0..engine.spec().units.len()).map(|_| DecodeCache::default()).collect());
    let result = produce(config, |produced| {
        target.extend(produced.last());
        match caches.as_mut() {
            Some(c) if produced.is_empty() => {
                engine.set_layout(Some(&layout(1)?));
                engine.decode(&row(&[source, &target[..]].concat(), device)?, c)
            }
            Some(c) => {
                engine.set_layout(None);
                engine.decode(&row(&target[target.len() - 1..], device)?, c)
            }
            None => {
                engine.set_layout(Some(&layout(target.len())?));
                engine.evaluate(&row(&[source, &target[..]].concat(), device)?)
            }
        }
    });
    engine.set_layout(None);
    result
}

/// A batch of one sequence.
fn row(tokens: &[i64], device: tch::Device) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(tokens)?.f_unsqueeze(0)?.f_to_device(device)?)
}

/// The next token from one position's logits `[V]`.
fn choose(logits: &Tensor, config: &GenerateConfig) -> Result<i64> {
    let logits = logits.f_to_kind(Kind::Float)?;
    if config.greedy() {
        return Ok(logits.f_argmax(0, false)?.f_int64_value(&[])?);
    }
    let mut scores = logits.f_div_scalar(config.temperature)?;
    let vocab = scores.size()[0];
    if let Some(k) = config.top_k.filter(|&k| (k as i64) < vocab) {
        let kth = scores.f_topk(k as i64, 0, true, true)?.0.f_select(0, k as i64 - 1)?;
        scores = scores.f_masked_fill(&scores.f_lt_tensor(&kth)?, f64::NEG_INFINITY)?;
    }
    if let Some(p) = config.top_p.filter(|&p| p < 1.0) {
        let (sorted, order) = scores.f_sort(0, true)?;
        let probs = sorted.f_softmax(0, Kind::Float)?;
        // A token is dropped when the more likely ones already reach `p`; the first never is.
        let before = probs.f_cumsum(0, Kind::Float)?.f_sub(&probs)?;
        let dropped_sorted = before.f_gt(p)?;
        let dropped = dropped_sorted.f_scatter(0, &order, &dropped_sorted)?;
        scores = scores.f_masked_fill(&dropped, f64::NEG_INFINITY)?;
    }
    let probs = scores.f_softmax(0, Kind::Float)?;
    Ok(probs.f_multinomial(1, false)?.f_int64_value(&[0])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_many(logits: &[f32], config: &GenerateConfig, draws: usize) -> std::collections::BTreeSet<i64> {
        let t = Tensor::from_slice(logits);
        with_seed(7, || (0..draws).map(|_| choose(&t, config).unwrap()).collect())
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let t = Tensor::from_slice(&[0.1f32, 2.0, -1.0, 1.9]);
        assert_eq!(choose(&t, &GenerateConfig::default()).unwrap(), 1);
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_likely_tokens() {
        let logits = [3.0f32, 2.9, 0.0, -1.0, 2.8];
        let sampling = GenerateConfig { temperature: 1.0, ..Default::default() };
        // Without a cut every token turns up in enough draws.
        assert_eq!(sample_many(&logits, &GenerateConfig { temperature: 5.0, ..sampling.clone() }, 400).len(), 5);
        let top2 = GenerateConfig { top_k: Some(2), ..sampling.clone() };
        assert_eq!(sample_many(&logits, &top2, 200).into_iter().collect::<Vec<_>>(), vec![0, 1]);
        // Probabilities ≈ 0.36, 0.32, 0.02, 0.007, 0.29 by token: 0.5 needs tokens 0 and 1.
        let nucleus = GenerateConfig { top_p: Some(0.5), ..sampling };
        assert_eq!(sample_many(&logits, &nucleus, 200).into_iter().collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn bad_settings_are_refused() {
        for bad in [
            GenerateConfig { temperature: -1.0, ..Default::default() },
            GenerateConfig { top_k: Some(0), ..Default::default() },
            GenerateConfig { top_p: Some(1.5), ..Default::default() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
