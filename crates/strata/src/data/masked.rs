//! Masked-language-model data (BERT's pretraining): text encoded a line at a time with the
//! tokenizer's special tokens, the lines joined and cut into rows of the context's length
//! (`transformers`' `run_mlm` groups texts so), and in each row a share of the tokens that
//! are not special chosen for prediction — of those, eight in ten replaced by the mask
//! token, one in ten by a random token, one in ten kept — with the chosen tokens as the
//! labels and every other position taking no loss.
//!
//! The choice is drawn from the run's seed and the row's index, so a row is masked the same
//! way in every epoch and under every rank layout (static masking, as BERT's own data was
//! prepared), and a run is reproducible. Owns the rows and their masking. Must not know
//! models beyond the vocabulary's size.
use super::synthetic::SplitMix64;
use super::{check_indices, Batch, RowSet, Tokenizer, IGNORE};
use crate::{Error, Result};
use std::path::Path;
use tch::Tensor;

/// How tokens are chosen and replaced.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskOptions {
    /// The share of a row's tokens (special ones aside) that are predicted.
    pub probability: f64,
    /// Seeds the choice.
    pub seed: u64,
}

impl Default for MaskOptions {
    fn default() -> Self {
        MaskOptions { probability: 0.15, seed: 0 }
    }
}

/// Rows of text tokens and how they are masked.
#[derive(Clone, Debug)]
pub struct MaskedSet {
    rows: Vec<Vec<u32>>,
    /// Tokens never chosen: those the tokenizer adds around a text.
    special: Vec<u32>,
    mask: u32,
    vocab: u32,
    options: MaskOptions,
    /// Where the text came from, for messages.
    pub source: String,
}

impl MaskedSet {
    /// The text of `path`, a line a text (blank lines skipped), encoded by `tokenizer` with
    /// its special tokens and cut into rows of `ctx` tokens (a shorter remainder dropped).
    /// The tokenizer must have a `[MASK]` (or `<mask>`) token.
    pub fn from_text(path: &Path, tokenizer: &Tokenizer, ctx: usize, options: MaskOptions) -> Result<MaskedSet> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let lines: Vec<(&str, Option<&str>)> =
            text.lines().filter(|l| !l.trim().is_empty()).map(|l| (l, None)).collect();
        let encoded = tokenizer.encode_pairs(&lines, usize::MAX)?;
        let stream: Vec<u32> = encoded.into_iter().flat_map(|(ids, _)| ids).collect();
        MaskedSet::from_ids(&stream, tokenizer, ctx, options, path.display().to_string())
    }

    /// Ids already made (each text with its special tokens), cut into rows of `ctx`.
    pub fn from_ids(
        stream: &[u32],
        tokenizer: &Tokenizer,
        ctx: usize,
        options: MaskOptions,
        source: impl Into<String>,
    ) -> Result<MaskedSet> {
        let source = source.into();
        if !(options.probability > 0.0 && options.probability <= 1.0) {
            return Err(Error::Config(format!(
                "the masking probability must lie in (0, 1], got {}",
                options.probability
            )));
        }
        if ctx == 0 {
            return Err(Error::Config("rows of masked text need a positive context".into()));
        }
        let mask = ["[MASK]", "<mask>"]
            .iter()
            .find_map(|t| tokenizer.token_id(t))
            .ok_or_else(|| Error::Data(format!("{source}: the tokenizer has no mask token ([MASK] or <mask>)")))?;
        // What the tokenizer adds around an empty text is what it adds around every text.
        let special = tokenizer.encode_pairs(&[("", None)], usize::MAX)?.remove(0).0;
        let rows: Vec<Vec<u32>> = stream.chunks_exact(ctx).map(<[u32]>::to_vec).collect();
        if rows.is_empty() {
            return Err(Error::Data(format!("{source}: {} tokens do not fill one row of {ctx}", stream.len())));
        }
        let vocab = tokenizer.vocab_size() as u32;
        Ok(MaskedSet { rows, special, mask, vocab, options, source })
    }

    /// Row `r` as the model reads it and its labels.
    fn masked_row(&self, r: usize) -> (Vec<i64>, Vec<i64>) {
        // Each row's draws start from a hash of the seed and the row, not from a nearby state:
        // the generator's states advance by a constant, so rows seeded a step apart would
        // draw the same sequence shifted by one.
        let start = SplitMix64::new(self.options.seed.rotate_left(32) ^ r as u64).next_u64();
        let mut draws = SplitMix64::new(start);
        let mut uniform = move || (draws.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        self.rows[r]
            .iter()
            .map(|&token| {
                let chosen = !self.special.contains(&token) && uniform() < self.options.probability;
                if !chosen {
                    return (i64::from(token), IGNORE);
                }
                let how = uniform();
                let shown = if how < 0.8 {
                    self.mask
                } else if how < 0.9 {
                    (uniform() * f64::from(self.vocab)) as u32 % self.vocab
                } else {
                    token
                };
                (i64::from(shown), i64::from(token))
            })
            .unzip()
    }
}

impl RowSet for MaskedSet {
    fn len(&self) -> usize {
        self.rows.len()
    }

    fn source(&self) -> &str {
        &self.source
    }

    fn tokens(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }

    fn longest(&self) -> usize {
        self.rows.first().map_or(0, Vec::len)
    }

    /// The tokenizer's whole vocabulary: a chosen token may be shown as any of its ids.
    fn vocab_needed(&self) -> u32 {
        self.rows.iter().flatten().copied().chain([self.mask]).max().map_or(0, |m| m + 1).max(self.vocab)
    }

    fn supervised(&self, row: usize) -> u64 {
        self.masked_row(row).1.iter().filter(|&&l| l != IGNORE).count() as u64
    }

    fn batch(&self, rows: &[usize]) -> Result<Batch> {
        check_indices(rows, self.len())?;
        let (inputs, labels): (Vec<Vec<i64>>, Vec<Vec<i64>>) = rows.iter().map(|&r| self.masked_row(r)).unzip();
        let shape = [rows.len() as i64, self.longest() as i64];
        let tensor = |v: Vec<Vec<i64>>| -> Result<Tensor> { Ok(Tensor::f_from_slice(&v.concat())?.f_view(shape)?) };
        Batch::new(tensor(inputs)?, tensor(labels)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn word_tokenizer(dir: &Path) -> Tokenizer {
        let mut vocab = serde_json::Map::new();
        for (i, w) in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"].iter().chain(&["a", "b", "c", "d"]).enumerate() {
            vocab.insert(w.to_string(), serde_json::json!(i));
        }
        let body = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                                   "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, body.to_string()).unwrap();
        Tokenizer::from_file(&path).unwrap()
    }

    #[test]
    fn a_share_of_the_plain_tokens_is_masked_and_labeled_the_special_ones_never() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = word_tokenizer(dir.path());
        let path = dir.path().join("text.txt");
        let line = "a b c d ".repeat(25);
        std::fs::write(&path, format!("{line}\n\n{line}\n").repeat(20)).unwrap();
        let set = MaskedSet::from_text(&path, &tokenizer, 51, MaskOptions::default()).unwrap();
        // 40 lines of [CLS] + 100 words + [SEP]: 4080 tokens, 80 rows of 51.
        assert_eq!(set.len(), 80);
        let batch = set.batch(&(0..set.len()).collect::<Vec<_>>()).unwrap();
        let inputs: Vec<i64> = Vec::try_from(batch.inputs.flatten(0, -1)).unwrap();
        let labels: Vec<i64> = Vec::try_from(batch.targets.flatten(0, -1)).unwrap();
        let originals: Vec<i64> = set.rows.concat().into_iter().map(i64::from).collect();
        let chosen: Vec<usize> = (0..labels.len()).filter(|&i| labels[i] != IGNORE).collect();
        let plain = originals.iter().filter(|&&t| t >= 5).count();
        let share = chosen.len() as f64 / plain as f64;
        assert!((0.13..0.17).contains(&share), "{share}");
        assert!(chosen.iter().all(|&i| labels[i] == originals[i] && originals[i] >= 5), "special tokens chosen");
        let masked = chosen.iter().filter(|&&i| inputs[i] == 4).count() as f64 / chosen.len() as f64;
        let kept = chosen.iter().filter(|&&i| inputs[i] == originals[i]).count() as f64 / chosen.len() as f64;
        assert!((0.75..0.85).contains(&masked) && (0.06..0.16).contains(&kept), "{masked} {kept}");
        // Rows choose independently: a generator seeded a step further on for each row would
        // make each row's first choice fall one position before the previous row's.
        let first = |r: usize| (0..51).find(|&t| labels[r * 51 + t] != IGNORE);
        let shifted = (0..79).filter(|&r| matches!((first(r), first(r + 1)), (Some(a), Some(b)) if b + 1 == a)).count();
        assert!(shifted < 20, "{shifted} of 79 rows choose as their neighbour does, a position early");
        // Unchosen positions are shown as they are; the same rows mask the same way again.
        assert!((0..labels.len()).filter(|&i| labels[i] == IGNORE).all(|i| inputs[i] == originals[i]));
        let again = set.batch(&[5, 6]).unwrap();
        assert!(again.inputs.equal(&batch.inputs.narrow(0, 5, 2)));
        assert_eq!(batch.supervised, chosen.len() as u64);
        assert_eq!(set.supervised(5) + set.supervised(6), again.supervised);
    }

    #[test]
    fn a_tokenizer_without_a_mask_token_is_refused() {
        let err = MaskedSet::from_ids(&[1; 64], &Tokenizer::Bytes, 8, MaskOptions::default(), "bytes").unwrap_err();
        assert!(err.to_string().contains("the tokenizer has no mask token"), "{err}");
    }
}
