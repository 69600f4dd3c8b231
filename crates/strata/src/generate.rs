//! Text generation from a trained model: greedy decoding or sampling (temperature, top-k,
//! top-p, min-p, each as `transformers` applies it, after a repetition penalty) from a seed, with a key/value cache so each new token costs one position; one
//! prompt, or several decoded together (those of one length share a batch).
//!
//! Owns: the decoding loop and the choice of each next token, and what a model must do to
//! be decoded ([`Decoder`]). Must not own weights or tokenisation: it takes a decoder (an
//! engine holding a whole model or its tensor-parallel pieces, with where the vocabulary is
//! split, or a trainer whose pipeline stages each decode their units) and token ids.
use crate::engine::Engine;
use crate::model::{dropout, DecodeCache, RowLayout};
use crate::preference::{whole_logits, VocabularySplit};
use crate::{Error, Result};
use std::collections::BTreeMap;
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
    /// Sample among the tokens at least this fraction as likely as the most likely one
    /// (after top-k and top-p).
    pub min_p: Option<f64>,
    /// Every token already in a row (its prompt included) has its logit divided by this
    /// where positive and multiplied where negative, before anything else, greedy decoding
    /// too (`transformers`' `repetition_penalty`); 1 leaves the logits as they are.
    pub repetition_penalty: f64,
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
            min_p: None,
            repetition_penalty: 1.0,
            seed: 0,
            stop_tokens: vec![],
            cache: true,
        }
    }
}

impl GenerateConfig {
    /// Refuses a negative or non-finite temperature, a `top_k` of 0, a `top_p` outside
    /// (0, 1], a `min_p` outside [0, 1] and a repetition penalty that is not positive.
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
        if let Some(p) = self.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return Err(Error::Config(format!("min_p must lie in [0, 1], got {p}")));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(Error::Config(format!(
                "the repetition penalty must be positive, got {}",
                self.repetition_penalty
            )));
        }
        Ok(())
    }

    fn greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A model that continues rows a position at a time: an [`Engine`] holding every unit, or
/// a trainer whose parts (a pipeline's stages) each hold some, in which case the logits
/// exist on the last stage alone and the tokens chosen there reach every stage.
pub trait Decoder {
    /// Where the rows' token ids go.
    fn device(&self) -> tch::Device;

    /// Starts new rows (no training batch's layout applies to them): their empty key/value
    /// cache, a list per part with a cache per unit.
    fn start(&mut self) -> Vec<Vec<DecodeCache>>;

    /// The logits of `tokens` (`[rows, positions]` ids) following the positions `cache`
    /// holds, which it then holds too, placed as `rows` says where rows of several lengths
    /// decode together ([`RowLayout::left_padded`]); `None` where this rank computes no logits.
    fn decode(
        &mut self,
        tokens: &Tensor,
        rows: Option<&RowLayout>,
        cache: &mut [Vec<DecodeCache>],
    ) -> Result<Option<Tensor>>;

    /// The logits of `tokens` alone, with no cache.
    fn evaluate(&mut self, tokens: &Tensor) -> Result<Option<Tensor>> {
        let mut cache = self.start();
        self.decode(tokens, None, &mut cache)
    }

    /// The tokens chosen where the logits are (`chosen`, one for each of `rows` rows), on
    /// every rank decoding together.
    fn share(&self, chosen: Option<Vec<i64>>, _rows: usize) -> Result<Vec<i64>> {
        chosen.ok_or_else(|| Error::Engine("decoding computed no logits to choose tokens from".into()))
    }
}

impl Decoder for Engine {
    fn device(&self) -> tch::Device {
        self.config().device
    }

    fn start(&mut self) -> Vec<Vec<DecodeCache>> {
        self.set_layout(None);
        vec![(0..self.spec().units.len()).map(|_| DecodeCache::default()).collect()]
    }

    fn decode(
        &mut self,
        tokens: &Tensor,
        rows: Option<&RowLayout>,
        cache: &mut [Vec<DecodeCache>],
    ) -> Result<Option<Tensor>> {
        let [units] = cache else {
            return Err(Error::Engine(format!("one engine decodes with one cache, not {}", cache.len())));
        };
        self.set_layout(rows);
        let logits = Engine::decode(self, tokens, units);
        self.set_layout(None);
        logits.map(Some)
    }

    fn evaluate(&mut self, tokens: &Tensor) -> Result<Option<Tensor>> {
        Engine::evaluate(self, tokens).map(Some)
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
    let mut all = generate_batch(engine, None, std::slice::from_ref(&prompt.to_vec()), config, context)?;
    Ok(all.pop().unwrap_or_default())
}

/// The continuations of several prompts, in their order, decoded together, each row
/// sampling its own stream drawn from `config.seed` ([`generate_streams`] with every row in
/// that one stream). `vocabulary`: where a tensor group splits the head's columns (each rank
/// of the group then gathers the whole logits and makes the same choices).
pub fn generate_batch(
    model: &mut dyn Decoder,
    vocabulary: Option<&VocabularySplit>,
    prompts: &[Vec<i64>],
    config: &GenerateConfig,
    context: Option<i64>,
) -> Result<Vec<Vec<i64>>> {
    generate_streams(model, vocabulary, prompts, &vec![config.seed; prompts.len()], config, context)
}

/// The continuations of several prompts, in their order, decoded together. With the cache,
/// where the window never slides, every prompt shares one batch: shorter prompts are
/// padded on the left, and their padding is hidden from the text and their positions
/// counted from their first token ([`RowLayout::left_padded`]). Otherwise prompts of one
/// length share a batch. Either way each row's tokens are those it would get alone, and a
/// batch decodes until every row has met a stop token or the count; a row that stopped
/// early keeps its stop token last.
///
/// Sampling: the `i`-th row of seed `streams[r]` (counting the rows of that seed in order)
/// draws each token from a hash of its seed, its number and the token's place, not from
/// libtorch's generator, so what a row samples does not depend on the rows decoded beside
/// it (a GRPO group draws the same alone or among other prompts', on one rank or several).
pub fn generate_streams(
    model: &mut dyn Decoder,
    vocabulary: Option<&VocabularySplit>,
    prompts: &[Vec<i64>],
    streams: &[u64],
    config: &GenerateConfig,
    context: Option<i64>,
) -> Result<Vec<Vec<i64>>> {
    config.validate()?;
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(Error::Config(format!("prompt {i} holds no tokens")));
    }
    if streams.len() != prompts.len() {
        return Err(Error::Config(format!("{} sampling streams for {} prompts", streams.len(), prompts.len())));
    }
    let mut members: BTreeMap<u64, u32> = BTreeMap::new();
    let rows_of_streams: Vec<(u64, u32)> = streams
        .iter()
        .map(|&s| {
            let member = members.entry(s).or_default();
            *member += 1;
            (s, *member - 1)
        })
        .collect();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let window = context.unwrap_or(i64::MAX) as usize;
    let together = config.cache && longest.saturating_add(config.max_new_tokens) <= window;
    let mut batches: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, p) in prompts.iter().enumerate() {
        batches.entry(if together { 0 } else { p.len() }).or_default().push(i);
    }
    let device = model.device();
    let mut out = vec![vec![]; prompts.len()];
    for rows in batches.values() {
        let longest = rows.iter().map(|&i| prompts[i].len()).max().unwrap_or(0);
        let padding: Vec<i64> = rows.iter().map(|&i| (longest - prompts[i].len()) as i64).collect();
        let padded = padding.iter().any(|&p| p > 0);
        let mut tokens: Vec<Vec<i64>> =
            rows.iter().zip(&padding).map(|(&i, &pad)| [&vec![0; pad as usize][..], &prompts[i]].concat()).collect();
        // The cache holds the positions decoded so far; `None` once the window slides
        // (never where rows are padded). No layout from a training batch applies.
        let mut caches = Some(model.start()).filter(|_| config.cache);
        let mut seen = 0;
        let mut produced = 0u64;
        let step = |chosen: &[i64]| -> Result<Vec<i64>> {
            for (row, token) in tokens.iter_mut().zip(chosen) {
                row.push(*token);
            }
            let len = tokens[0].len();
            if caches.is_some() && len > window {
                caches = None;
            }
            let logits = match caches.as_mut() {
                Some(c) => {
                    let span = seen..len;
                    let placed = match padded {
                        true => Some(RowLayout::left_padded(&padding, seen as i64..len as i64)?.to_device(device)?),
                        false => None,
                    };
                    model.decode(&rows_of(&tokens, span, device)?, placed.as_ref(), c)?
                }
                None => model.evaluate(&rows_of(&tokens, len.saturating_sub(window)..len, device)?)?,
            };
            seen = len;
            let logits = logits.map(|l| whole_logits(vocabulary, &l)).transpose()?;
            let draws: Vec<u32> = rows.iter().map(|&i| draw_key(rows_of_streams[i], produced)).collect();
            produced += 1;
            let so_far: Vec<&[i64]> = tokens.iter().zip(&padding).map(|(t, &pad)| &t[pad as usize..]).collect();
            model.share(choose_last(logits.as_ref(), config, &draws, &so_far)?, rows.len())
        };
        for (&i, completion) in rows.iter().zip(produce(config, rows.len(), step)?) {
            out[i] = completion;
        }
    }
    Ok(out)
}

/// Each of `rows` rows' tokens, one position after another as `next_tokens` chooses them
/// given the tokens chosen at the previous position (none at the first), until a row meets
/// a stop token or the count; decoding ends when every row has. Rows that stopped still feed a token (their
/// last) so the batch stays whole; what they are given after is not kept.
fn produce(
    config: &GenerateConfig,
    rows: usize,
    mut next_tokens: impl FnMut(&[i64]) -> Result<Vec<i64>>,
) -> Result<Vec<Vec<i64>>> {
    let mut produced: Vec<Vec<i64>> = vec![Vec::with_capacity(config.max_new_tokens); rows];
    let mut stopped = vec![false; rows];
    let mut chosen: Vec<i64> = vec![];
    for _ in 0..config.max_new_tokens {
        chosen = next_tokens(&chosen)?;
        if chosen.len() != rows {
            return Err(Error::Engine(format!("{} tokens chosen for {rows} rows", chosen.len())));
        }
        for ((row, done), token) in produced.iter_mut().zip(&mut stopped).zip(&mut chosen) {
            match *done {
                true => *token = row.last().copied().unwrap_or(*token),
                false => {
                    row.push(*token);
                    *done = config.stop_tokens.contains(token);
                }
            }
        }
        if stopped.iter().all(|&d| d) {
            break;
        }
    }
    Ok(produced)
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
    let next = |chosen: &[i64]| {
        target.extend(chosen.first());
        let draw = draw_key((config.seed, 0), target.len() as u64 - 1);
        let logits = match caches.as_mut() {
            Some(c) if chosen.is_empty() => {
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
        }?;
        Ok(choose_last(Some(&logits), config, &[draw], &[&target[..]])?.unwrap_or_default())
    };
    let result = produce(config, 1, next);
    engine.set_layout(None);
    Ok(result?.pop().unwrap_or_default())
}

/// The key of the draw of token `produced` (counting from 0) of row `member` of the rows
/// sampling stream `stream`.
fn draw_key((stream, member): (u64, u32), produced: u64) -> u32 {
    dropout::key_of(&[stream as u32, (stream >> 32) as u32, member, produced as u32, (produced >> 32) as u32])
}

/// A batch of one sequence.
fn row(tokens: &[i64], device: tch::Device) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(tokens)?.f_unsqueeze(0)?.f_to_device(device)?)
}

/// A batch of the positions `span` of each of `rows` (all of one length).
fn rows_of(rows: &[Vec<i64>], span: std::ops::Range<usize>, device: tch::Device) -> Result<Tensor> {
    let flat: Vec<i64> = rows.iter().flat_map(|r| r[span.clone()].iter().copied()).collect();
    Ok(Tensor::f_from_slice(&flat)?.f_view([rows.len() as i64, span.len() as i64])?.f_to_device(device)?)
}

/// Each row's next token from the last position of `logits` (`[rows, positions, V]`),
/// where this rank holds them; `draws`: each row's key of its sampling draw; `seen`: each
/// row's tokens so far.
fn choose_last(
    logits: Option<&Tensor>,
    config: &GenerateConfig,
    draws: &[u32],
    seen: &[&[i64]],
) -> Result<Option<Vec<i64>>> {
    logits.map(|l| choose(&l.f_select(1, -1)?, config, draws, seen)).transpose()
}

/// The next token of each row from one position's logits `[rows, V]`, its tokens so far
/// `seen[r]`: the most likely of its [`sampling_scores`], or a sample drawn by the
/// Gumbel-max rule (the largest of the scores plus −ln(−ln u), `u` each token's uniform draw
/// from its row's key `draws[r]`), which picks each token with its softmax probability.
fn choose(logits: &Tensor, config: &GenerateConfig, draws: &[u32], seen: &[&[i64]]) -> Result<Vec<i64>> {
    let scores = sampling_scores(logits, config, seen)?;
    let tokens = |t: Tensor| -> Result<Vec<i64>> {
        Ok(Vec::<i64>::try_from(t.f_reshape([-1])?.f_to_device(tch::Device::Cpu)?)?)
    };
    if config.greedy() {
        return tokens(scores.f_argmax(-1, false)?);
    }
    let noise = dropout::uniforms(draws, scores.size()[1], scores.device())?.f_log()?.f_neg()?.f_log()?.f_neg()?;
    tokens(scores.f_to_kind(Kind::Double)?.f_add(&noise)?.f_argmax(-1, false)?)
}

/// The fp32 scores `[rows, V]` the next tokens are chosen from, given one position's
/// `logits` and each row's tokens so far `seen[r]`, shaped as `transformers`' logits
/// processors shape them and in their order: the repetition penalty, then (sampling only)
/// the temperature, top-k, top-p and min-p, each leaving out tokens as −∞.
pub fn sampling_scores(logits: &Tensor, config: &GenerateConfig, seen: &[&[i64]]) -> Result<Tensor> {
    let logits = match config.repetition_penalty == 1.0 {
        true => logits.f_to_kind(Kind::Float)?,
        false => penalize_repeats(&logits.f_to_kind(Kind::Float)?, seen, config.repetition_penalty)?,
    };
    if config.greedy() {
        return Ok(logits);
    }
    let mut scores = logits.f_div_scalar(config.temperature)?;
    let vocab = scores.size()[1];
    if let Some(k) = config.top_k.filter(|&k| (k as i64) < vocab) {
        let kth = scores.f_topk(k as i64, -1, true, true)?.0.f_narrow(-1, k as i64 - 1, 1)?;
        scores = scores.f_masked_fill(&scores.f_lt_tensor(&kth)?, f64::NEG_INFINITY)?;
    }
    if let Some(p) = config.top_p.filter(|&p| p < 1.0) {
        // From the least likely up, a token is dropped while it and those below it hold no
        // more than 1 − p, summed in that order (as `transformers` sums, so ties fall alike);
        // the most likely never is.
        let (sorted, order) = scores.f_sort(-1, false)?;
        let below = sorted.f_softmax(-1, Kind::Float)?.f_cumsum(-1, Kind::Float)?;
        let dropped_sorted = below.f_le(1.0 - p)?;
        let _ = dropped_sorted.f_narrow(-1, vocab - 1, 1)?.f_fill_(0)?;
        let dropped = dropped_sorted.f_scatter(-1, &order, &dropped_sorted)?;
        scores = scores.f_masked_fill(&dropped, f64::NEG_INFINITY)?;
    }
    if let Some(m) = config.min_p {
        let probs = scores.f_softmax(-1, Kind::Float)?;
        let floor = probs.f_amax([-1], true)?.f_mul_scalar(m)?;
        scores = scores.f_masked_fill(&probs.f_lt_tensor(&floor)?, f64::NEG_INFINITY)?;
    }
    Ok(scores)
}

/// `logits` (`[rows, V]`, fp32) with each row's logits of the tokens in `seen[r]` divided
/// by `penalty` where positive and multiplied by it where negative: one mask of the tokens
/// seen, made by one scatter, whatever the rows.
fn penalize_repeats(logits: &Tensor, seen: &[&[i64]], penalty: f64) -> Result<Tensor> {
    let [rows, vocab] = logits.size()[..] else {
        return Err(Error::Engine(format!("logits of shape {:?}, not [rows, vocabulary]", logits.size())));
    };
    if seen.len() as i64 != rows {
        return Err(Error::Engine(format!("{rows} rows of logits for {} rows of tokens", seen.len())));
    }
    // Rows padded to one width with an extra column past the vocabulary, cut off after.
    let width = seen.iter().map(|r| r.len()).max().unwrap_or(0).max(1);
    let ids: Vec<i64> =
        seen.iter().flat_map(|r| r.iter().copied().chain(std::iter::repeat(vocab)).take(width)).collect();
    let ids = Tensor::f_from_slice(&ids)?.f_view([rows, width as i64])?.f_to_device(logits.device())?;
    let mask = Tensor::f_zeros([rows, vocab + 1], (Kind::Bool, logits.device()))?.f_scatter_value(1, &ids, 1)?;
    let penalised = logits.f_mul_scalar(penalty)?.f_where_self(&logits.f_lt(0.0)?, &logits.f_div_scalar(penalty)?)?;
    Ok(penalised.f_where_self(&mask.f_narrow(1, 0, vocab)?, logits)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How often each token is drawn in `draws` rows of `logits`, each row its own key.
    fn counts(logits: &[f32], config: &GenerateConfig, draws: usize) -> BTreeMap<i64, usize> {
        let t = Tensor::from_slice(logits).unsqueeze(0).expand([draws as i64, -1], false);
        let keys: Vec<u32> = (0..draws as u32).map(|i| dropout::key_of(&[7, i])).collect();
        let mut counts = BTreeMap::new();
        for token in choose(&t, config, &keys, &[]).unwrap() {
            *counts.entry(token).or_default() += 1;
        }
        counts
    }

    fn sample_many(logits: &[f32], config: &GenerateConfig, draws: usize) -> Vec<i64> {
        counts(logits, config, draws).into_keys().collect()
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let t = Tensor::from_slice(&[0.1f32, 2.0, -1.0, 1.9, 0.0, 3.0, 0.5, 0.2]).view([2, 4]);
        assert_eq!(choose(&t, &GenerateConfig::default(), &[0, 0], &[]).unwrap(), vec![1, 1]);
    }

    /// Drawn by the Gumbel-max rule from hashed uniforms, each token turns up with its
    /// softmax probability; the same key draws the same token again.
    #[test]
    fn samples_follow_the_softmax_and_their_keys() {
        let logits = [1.0f32, 0.0, -1.0, 0.5];
        let sampling = GenerateConfig { temperature: 1.0, ..Default::default() };
        let draws = 20_000;
        let probs = Vec::<f64>::try_from(Tensor::from_slice(&logits).softmax(0, Kind::Double)).unwrap();
        let seen = counts(&logits, &sampling, draws);
        for (token, p) in probs.iter().enumerate() {
            let share = *seen.get(&(token as i64)).unwrap_or(&0) as f64 / draws as f64;
            // Four standard deviations of a share of 20,000 draws is at most 0.014.
            assert!((share - p).abs() < 0.014, "token {token}: drawn {share:.4}, probability {p:.4}");
        }
        let t = Tensor::from_slice(&logits).unsqueeze(0).expand([64, -1], false);
        let keys: Vec<u32> = (0..64).map(|i| dropout::key_of(&[3, i])).collect();
        let once = choose(&t, &sampling, &keys, &[]).unwrap();
        assert_eq!(once, choose(&t, &sampling, &keys, &[]).unwrap());
        let halves = [
            choose(&t.narrow(0, 0, 32), &sampling, &keys[..32], &[]).unwrap(),
            choose(&t.narrow(0, 32, 32), &sampling, &keys[32..], &[]).unwrap(),
        ];
        assert_eq!(once, halves.concat(), "a row's draw depends on its key alone");
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_likely_tokens() {
        let logits = [3.0f32, 2.9, 0.0, -1.0, 2.8];
        let sampling = GenerateConfig { temperature: 1.0, ..Default::default() };
        // Without a cut every token turns up in enough draws.
        assert_eq!(sample_many(&logits, &GenerateConfig { temperature: 5.0, ..sampling.clone() }, 400).len(), 5);
        let top2 = GenerateConfig { top_k: Some(2), ..sampling.clone() };
        assert_eq!(sample_many(&logits, &top2, 200), vec![0, 1]);
        // Probabilities ≈ 0.36, 0.32, 0.02, 0.007, 0.29 by token: 0.5 needs tokens 0 and 1.
        let nucleus = GenerateConfig { top_p: Some(0.5), ..sampling };
        assert_eq!(sample_many(&logits, &nucleus, 200), vec![0, 1]);
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
