//! Sequence-to-sequence data for an encoder–decoder (T5): JSON Lines records of a `source`
//! and a `target` text, each encoded by the tokenizer (its special tokens, T5's closing
//! `</s>`) and cut to a most length, batched as rows of the padded source then the decoder's
//! input — the target shifted right behind the start token — with the target as the labels
//! (padding takes no loss) and a [`RowLayout`] that hides the source's padding from
//! attention; and ROUGE-L, the score of a generated text against its reference.
//!
//! Owns reading and checking such records, their encoding, batching and the score. Must not
//! know models beyond their pad and start tokens.
use super::{check_indices, Batch, RowSet, Tokenizer, IGNORE};
use crate::model::RowLayout;
use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;
use tch::Tensor;

/// A record: the text to read and the text to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTarget {
    /// The text to read.
    pub source: String,
    /// The text to write.
    pub target: String,
}

/// Reads the records of the JSON Lines file `path` (one object a line with string fields
/// `source` and `target`; blank lines skipped). A record that breaks a rule is an error
/// naming the file, its line and the rule.
pub fn read_source_target(path: &Path) -> Result<Vec<SourceTarget>> {
    let fail = |line: usize, why: String| Error::Data(format!("{}:{line}: {why}", path.display()));
    let read = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let text = String::from_utf8(read).map_err(|_| fail(0, "not UTF-8 text".into()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let value: Value = serde_json::from_str(line).map_err(|e| fail(i + 1, format!("not JSON ({e})")))?;
        let fields = value.as_object().ok_or_else(|| fail(i + 1, "not a JSON object".into()))?;
        let field = |key: &str| match fields.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            None | Some(Value::Null) => Err(fail(i + 1, format!("no \"{key}\""))),
            Some(other) => Err(fail(i + 1, format!("\"{key}\" is not a string ({other})"))),
        };
        out.push(SourceTarget { source: field("source")?, target: field("target")? });
    }
    if out.is_empty() {
        return Err(Error::Data(format!("{}: no records", path.display())));
    }
    Ok(out)
}

/// Encoded records: each one's source and target ids.
#[derive(Clone, Debug)]
pub struct Seq2SeqSet {
    sources: Vec<Vec<u32>>,
    targets: Vec<Vec<u32>>,
    /// Each target's text as read, where the set was encoded from records: what a written
    /// target is scored against, whole where its ids were cut.
    references: Option<Vec<String>>,
    pad: i64,
    decoder_start: i64,
    /// Where the records came from, for messages.
    pub source: String,
}

impl Seq2SeqSet {
    /// `records` encoded by `tokenizer`, sources cut to `max_source` ids and targets to
    /// `max_target` (as `transformers` truncates, the special tokens kept); `pad` fills the
    /// rows of a batch and `decoder_start` leads every decoder input.
    pub fn encode(
        records: &[SourceTarget],
        tokenizer: &Tokenizer,
        (max_source, max_target): (usize, usize),
        (pad, decoder_start): (i64, i64),
        source: impl Into<String>,
    ) -> Result<Seq2SeqSet> {
        if max_source == 0 || max_target == 0 {
            return Err(Error::Config("the most lengths of a source and a target must be positive".into()));
        }
        let encode = |texts: Vec<(&str, Option<&str>)>, most: usize| -> Result<Vec<Vec<u32>>> {
            Ok(tokenizer.encode_pairs(&texts, most)?.into_iter().map(|(ids, _)| ids).collect())
        };
        let sources = encode(records.iter().map(|r| (r.source.as_str(), None)).collect(), max_source)?;
        let targets = encode(records.iter().map(|r| (r.target.as_str(), None)).collect(), max_target)?;
        let set = Seq2SeqSet::from_ids(sources, targets, (pad, decoder_start), source)?;
        Ok(Seq2SeqSet { references: Some(records.iter().map(|r| r.target.clone()).collect()), ..set })
    }

    /// Records already encoded: each source's and target's ids.
    pub fn from_ids(
        sources: Vec<Vec<u32>>,
        targets: Vec<Vec<u32>>,
        (pad, decoder_start): (i64, i64),
        source: impl Into<String>,
    ) -> Result<Seq2SeqSet> {
        let source = source.into();
        if sources.len() != targets.len() {
            return Err(Error::Data(format!("{source}: {} sources for {} targets", sources.len(), targets.len())));
        }
        if let Some(at) = sources.iter().zip(&targets).position(|(s, t)| s.is_empty() || t.is_empty()) {
            return Err(Error::Data(format!("{source}: record {} holds no tokens", at + 1)));
        }
        Ok(Seq2SeqSet { sources, targets, references: None, pad, decoder_start, source })
    }

    /// Record `r`'s source ids.
    pub fn source_ids(&self, r: usize) -> &[u32] {
        &self.sources[r]
    }

    /// Record `r`'s target ids.
    pub fn target_ids(&self, r: usize) -> &[u32] {
        &self.targets[r]
    }

    /// Record `r`'s target text as read, where the set was encoded from records.
    pub fn reference(&self, r: usize) -> Option<&str> {
        self.references.as_ref().map(|t| t[r].as_str())
    }

    /// The most tokens of one source or one target.
    pub fn longest_part(&self) -> usize {
        self.sources.iter().chain(&self.targets).map(Vec::len).max().unwrap_or(0)
    }

    /// The token that leads every decoder input, ahead of the target shifted right.
    pub fn decoder_start(&self) -> i64 {
        self.decoder_start
    }
}

impl RowSet for Seq2SeqSet {
    fn len(&self) -> usize {
        self.sources.len()
    }

    fn source(&self) -> &str {
        &self.source
    }

    fn tokens(&self) -> usize {
        self.sources.iter().chain(&self.targets).map(Vec::len).sum()
    }

    /// A row holds a source and its target.
    fn longest(&self) -> usize {
        self.sources.iter().zip(&self.targets).map(|(s, t)| s.len() + t.len()).max().unwrap_or(0)
    }

    /// The padding and the start token included: both are looked up.
    fn vocab_needed(&self) -> u32 {
        let ids = self.sources.iter().chain(&self.targets).flatten().map(|&t| i64::from(t));
        ids.chain([self.pad, self.decoder_start]).max().map_or(0, |m| (m + 1) as u32)
    }

    fn supervised(&self, r: usize) -> u64 {
        self.targets[r].len() as u64
    }

    /// Records `rows` as one batch: each row its source padded to the longest source, then
    /// the start token and its target but the last token, padded to the longest target; the
    /// labels its target, padding [`IGNORE`]d.
    fn batch(&self, rows: &[usize]) -> Result<Batch> {
        check_indices(rows, self.len())?;
        let sources = rows.iter().map(|&r| self.sources[r].len()).max().unwrap_or(0).max(1);
        let targets = rows.iter().map(|&r| self.targets[r].len()).max().unwrap_or(0).max(1);
        let (mut inputs, mut labels) = (Vec::new(), Vec::new());
        for &r in rows {
            let (source, target) = (&self.sources[r], &self.targets[r]);
            let pad = |to: usize, from: usize| std::iter::repeat_n(self.pad, to - from);
            inputs.extend(source.iter().map(|&t| i64::from(t)).chain(pad(sources, source.len())));
            inputs.push(self.decoder_start);
            inputs.extend(target[..target.len() - 1].iter().map(|&t| i64::from(t)).chain(pad(targets, target.len())));
            labels.extend(target.iter().map(|&t| i64::from(t)));
            labels.extend(std::iter::repeat_n(IGNORE, targets - target.len()));
        }
        let n = rows.len() as i64;
        let inputs = Tensor::f_from_slice(&inputs)?.f_view([n, (sources + targets) as i64])?;
        let mut batch = Batch::new(inputs, Tensor::f_from_slice(&labels)?.f_view([n, targets as i64])?)?;
        let lengths: Vec<i64> = rows.iter().map(|&r| self.sources[r].len() as i64).collect();
        batch.layout = Some(RowLayout::encoder_decoder(&lengths, sources as i64, targets as i64)?);
        Ok(batch)
    }
}

/// ROUGE-L of `candidate` against `reference`: the F-measure of the precision and recall of
/// their longest common subsequence of words. Words are the runs of ASCII letters and digits
/// of the lower-cased text (anything else separates them), as the reference implementation
/// (Google's `rouge_score`) tokenizes without stemming; 0 where either has none.
pub fn rouge_l(candidate: &str, reference: &str) -> f64 {
    let words = |text: &str| -> Vec<String> {
        let lower = text.to_lowercase();
        lower.split(|c: char| !c.is_ascii_alphanumeric()).filter(|w| !w.is_empty()).map(String::from).collect()
    };
    let (c, r) = (words(candidate), words(reference));
    if c.is_empty() || r.is_empty() {
        return 0.0;
    }
    // One row of the longest-common-subsequence table at a time.
    let mut previous = vec![0usize; r.len() + 1];
    for word in &c {
        let mut row = vec![0usize; r.len() + 1];
        for (j, other) in r.iter().enumerate() {
            row[j + 1] = if word == other { previous[j] + 1 } else { row[j].max(previous[j + 1]) };
        }
        previous = row;
    }
    let common = previous[r.len()] as f64;
    if common == 0.0 {
        return 0.0;
    }
    let (precision, recall) = (common / c.len() as f64, common / r.len() as f64);
    2.0 * precision * recall / (precision + recall)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rouge_l_is_the_f_measure_of_the_longest_common_subsequence() {
        // In common, in order: the, cat, on, the, mat (5 of 6 candidate words, 5 of 7).
        let score = rouge_l("The cat sat on the mat.", "the cat was on the red mat");
        let (p, r) = (5.0 / 6.0, 5.0 / 7.0);
        assert!((score - 2.0 * p * r / (p + r)).abs() < 1e-12, "{score}");
        assert_eq!(rouge_l("a b c", "a b c"), 1.0);
        assert_eq!(rouge_l("x y", "a b"), 0.0);
        assert_eq!(rouge_l("", "a"), 0.0);
        // Letters outside ASCII separate words, as rouge_score's tokenizer treats them.
        assert_eq!(rouge_l("Café au lait", "caf au lait"), 1.0);
        // Order matters: a reversed text shares one word in sequence.
        assert!((rouge_l("c b a", "a b c") - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn records_without_a_source_or_target_are_refused_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pairs.jsonl");
        std::fs::write(&path, "{\"source\": \"a\", \"target\": \"b\"}\n\n{\"target\": \"c\"}\n").unwrap();
        let err = read_source_target(&path).unwrap_err().to_string();
        assert!(err.ends_with("pairs.jsonl:3: no \"source\""), "{err}");
        std::fs::write(&path, "{\"source\": \"a\", \"target\": 3}\n").unwrap();
        let err = read_source_target(&path).unwrap_err().to_string();
        assert!(err.ends_with(":1: \"target\" is not a string (3)"), "{err}");
        std::fs::write(&path, "{\"source\": \"a\", \"target\": \"b\"}\n").unwrap();
        assert_eq!(read_source_target(&path).unwrap(), vec![SourceTarget { source: "a".into(), target: "b".into() }]);
    }

    #[test]
    fn a_batch_is_the_padded_source_then_the_target_shifted_right() {
        let set =
            Seq2SeqSet::from_ids(vec![vec![5, 6, 1], vec![7, 1]], vec![vec![8, 1], vec![9, 10, 11, 1]], (0, 3), "test")
                .unwrap();
        let batch = set.batch(&[0, 1]).unwrap();
        let inputs: Vec<i64> = Vec::try_from(batch.inputs.flatten(0, -1)).unwrap();
        assert_eq!(inputs, [5, 6, 1, 3, 8, 0, 0, 7, 1, 0, 3, 9, 10, 11]);
        let labels: Vec<i64> = Vec::try_from(batch.targets.flatten(0, -1)).unwrap();
        assert_eq!(labels, [8, 1, IGNORE, IGNORE, 9, 10, 11, 1]);
        assert_eq!(batch.supervised, 6);
        let layout = batch.layout.unwrap();
        assert_eq!(layout.source_len, Some(3));
        let examples: Vec<i64> = Vec::try_from(layout.examples.flatten(0, -1)).unwrap();
        assert_eq!(examples, [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0], "only a source's padding is apart");
    }
}
