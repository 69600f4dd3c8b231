//! Classification data: records of JSON Lines or CSV files with a `text`, an optional
//! `text_pair` (sentence-pair tasks) and a `label` — one of the model's label names, or its
//! id — encoded as the tokenizer pairs texts (its special tokens and token types), cut to a
//! most length, and batched as padded rows whose [`RowLayout`] carries each row's padding
//! (an example of its own, which no token attends to) and token types; and the accuracy
//! and macro-averaged F1 of predicted labels.
//!
//! Owns reading and checking such records, their encoding, batching and scores. Must not
//! know models beyond their label names.
use super::{check_indices, Batch, RowSet, Tokenizer};
use crate::model::RowLayout;
use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;
use tch::{Kind, Tensor};

/// A record: the text (and the second text of a pair) and its label's id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabeledText {
    /// The text to classify.
    pub text: String,
    /// The second text of a sentence pair (`text_pair`).
    pub pair: Option<String>,
    /// The label's id, its index among the model's label names.
    pub label: i64,
}

/// Reads the records of `path` — JSON Lines (one object a line; blank lines skipped) or,
/// for a `.csv` file, CSV with a header row — each label mapped to its id in `labels`
/// (a label given as a name must be one of them; one given as a number must be an id).
/// A record that breaks a rule is an error naming the file, its line and the rule.
pub fn read_labeled(path: &Path, labels: &[String]) -> Result<Vec<LabeledText>> {
    let csv = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv"));
    let fail = |line: usize, why: String| Error::Data(format!("{}:{line}: {why}", path.display()));
    let label_of = |line: usize, value: &Value| -> Result<i64> {
        let known = || labels.join(", ");
        match value {
            Value::String(name) => match labels.iter().position(|l| l == name) {
                Some(id) => Ok(id as i64),
                // A CSV cell holds ids as text too.
                None => match name.trim().parse::<i64>() {
                    Ok(id) if csv && (0..labels.len() as i64).contains(&id) => Ok(id),
                    _ => Err(fail(line, format!("label {name:?} is not one of the model's labels ({})", known()))),
                },
            },
            Value::Number(n) => match n.as_i64().filter(|id| (0..labels.len() as i64).contains(id)) {
                Some(id) => Ok(id),
                None => Err(fail(line, format!("label id {n} is outside the model's {} labels", labels.len()))),
            },
            other => Err(fail(line, format!("label {other} is neither a label name nor an id"))),
        }
    };
    let record = |line: usize, fields: &serde_json::Map<String, Value>| -> Result<LabeledText> {
        let text = |key: &str| match fields.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(fail(line, format!("\"{key}\" is not a string ({other})"))),
        };
        let label = fields.get("label").ok_or_else(|| fail(line, "no \"label\"".into()))?;
        Ok(LabeledText {
            text: text("text")?.ok_or_else(|| fail(line, "no \"text\"".into()))?,
            pair: text("text_pair")?,
            label: label_of(line, label)?,
        })
    };
    let read = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    if csv {
        let mut reader = csv::ReaderBuilder::new().from_reader(read.as_slice());
        let header = reader.headers().map_err(|e| fail(1, format!("not a CSV header ({e})")))?.clone();
        for (i, row) in reader.records().enumerate() {
            let row = row.map_err(|e| fail(i + 2, format!("not a CSV row ({e})")))?;
            // Quoted cells may span lines: the row's own first line.
            let line = row.position().map_or(i + 2, |p| p.line() as usize);
            // An empty cell is an absent field (a row with no second text).
            let fields = header
                .iter()
                .zip(&row)
                .filter(|(_, v)| !v.is_empty())
                .map(|(k, v)| (k.to_string(), Value::String(v.into())))
                .collect();
            out.push(record(line, &fields)?);
        }
    } else {
        let text = String::from_utf8(read).map_err(|_| fail(0, "not UTF-8 text".into()))?;
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let value: Value = serde_json::from_str(line).map_err(|e| fail(i + 1, format!("not JSON ({e})")))?;
            let fields = value.as_object().ok_or_else(|| fail(i + 1, "not a JSON object".into()))?;
            out.push(record(i + 1, fields)?);
        }
    }
    if out.is_empty() {
        return Err(Error::Data(format!("{}: no records", path.display())));
    }
    Ok(out)
}

/// Encoded records: each one's token ids and types, and its label; rows of a batch are
/// padded with `pad`.
#[derive(Clone, Debug)]
pub struct ClassifySet {
    ids: Vec<Vec<u32>>,
    types: Vec<Vec<u32>>,
    labels: Vec<i64>,
    pad: u32,
    /// Where the records came from, for messages.
    pub source: String,
}

impl ClassifySet {
    /// `records` encoded by `tokenizer` ([`Tokenizer::encode_pairs`]), each cut to
    /// `max_length` ids; `pad` fills the rows of a batch after their texts.
    pub fn encode(
        records: &[LabeledText],
        tokenizer: &Tokenizer,
        max_length: usize,
        pad: u32,
        source: impl Into<String>,
    ) -> Result<ClassifySet> {
        if max_length == 0 {
            return Err(Error::Config("the most length of an example must be positive".into()));
        }
        let texts: Vec<(&str, Option<&str>)> = records.iter().map(|r| (r.text.as_str(), r.pair.as_deref())).collect();
        let (ids, types) = tokenizer.encode_pairs(&texts, max_length)?.into_iter().unzip();
        let labels = records.iter().map(|r| r.label).collect();
        Ok(ClassifySet { ids, types, labels, pad, source: source.into() })
    }

    /// Each record's label id, in record order.
    pub fn labels(&self) -> &[i64] {
        &self.labels
    }

    /// Refuses texts whose token types (the parts of a pair, as the tokenizer numbers them)
    /// reach past the `types` a model embeds: checked here on the host once, where the
    /// model's forward on a GPU would only stop at the embedding's bound.
    pub fn check_token_types(&self, types: i64) -> Result<()> {
        let Some(largest) = self.types.iter().flatten().copied().max() else { return Ok(()) };
        if i64::from(largest) >= types {
            return Err(Error::Data(format!(
                "{} holds token type {largest} (a text pair's second part) but the model has {types} token type{}",
                self.source,
                if types == 1 { "" } else { "s" }
            )));
        }
        Ok(())
    }
}

impl RowSet for ClassifySet {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn source(&self) -> &str {
        &self.source
    }

    /// Tokens of every text.
    fn tokens(&self) -> usize {
        self.ids.iter().map(Vec::len).sum()
    }

    /// The most tokens of one text.
    fn longest(&self) -> usize {
        self.ids.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The largest token id (the padding's included) plus one.
    fn vocab_needed(&self) -> u32 {
        self.ids.iter().flatten().copied().chain([self.pad]).max().map_or(0, |m| m + 1)
    }

    /// A label a row.
    fn supervised(&self, _row: usize) -> u64 {
        1
    }

    /// The examples `rows` as one batch: ids padded to the longest of them, the labels as
    /// targets, and the layout — positions from 0, the padding after each text an example
    /// of its own, the token types as segments.
    fn batch(&self, rows: &[usize]) -> Result<Batch> {
        check_indices(rows, self.len())?;
        let width = rows.iter().map(|&r| self.ids[r].len()).max().unwrap_or(0).max(1);
        let grid = |cell: &dyn Fn(usize, usize) -> i64| -> Tensor {
            let v: Vec<i64> = rows.iter().flat_map(|&r| (0..width).map(move |t| cell(r, t))).collect();
            Tensor::from_slice(&v).view([rows.len() as i64, width as i64])
        };
        let inside = |r: usize, t: usize| t < self.ids[r].len();
        let tokens = grid(&|r, t| i64::from(if inside(r, t) { self.ids[r][t] } else { self.pad }));
        let labels: Vec<i64> = rows.iter().map(|&r| self.labels[r]).collect();
        let mut batch = Batch::new(tokens, Tensor::from_slice(&labels))?;
        batch.layout = Some(RowLayout {
            positions: grid(&|_, t| t as i64),
            examples: grid(&|r, t| i64::from(!inside(r, t))),
            segments: Some(grid(&|r, t| if inside(r, t) { i64::from(self.types[r][t]) } else { 0 })),
            source_len: None,
        });
        Ok(batch)
    }
}

/// How well predicted labels match the true ones.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Scores {
    /// The fraction of predictions that equal the true label.
    pub accuracy: f64,
    /// The mean over the classes that occur or are predicted of each one's F1, the harmonic
    /// mean of its precision and recall.
    pub macro_f1: f64,
}

/// The scores of `predicted` against `truth` over `classes` classes; a class that neither
/// occurs nor is predicted is left out of the macro average.
pub fn scores(predicted: &[i64], truth: &[i64], classes: usize) -> Scores {
    let n = predicted.len().min(truth.len());
    let right = predicted.iter().zip(truth).filter(|(p, t)| p == t).count();
    let mut f1s = Vec::new();
    for c in 0..classes as i64 {
        let hit = predicted.iter().zip(truth).filter(|&(&p, &t)| p == c && t == c).count() as f64;
        let said = predicted.iter().filter(|&&p| p == c).count() as f64;
        let there = truth.iter().filter(|&&t| t == c).count() as f64;
        if said + there > 0.0 {
            f1s.push(2.0 * hit / (said + there));
        }
    }
    Scores {
        accuracy: if n == 0 { 0.0 } else { right as f64 / n as f64 },
        macro_f1: if f1s.is_empty() { 0.0 } else { f1s.iter().sum::<f64>() / f1s.len() as f64 },
    }
}

/// Each row's predicted label: the largest of its `[B, classes]` logits.
pub fn predictions(logits: &Tensor) -> Result<Vec<i64>> {
    Ok(Vec::try_from(logits.f_argmax(-1, false)?.f_to_kind(Kind::Int64)?.f_flatten(0, -1)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels() -> Vec<String> {
        vec!["negative".into(), "positive".into()]
    }

    fn file(name: &str, text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn records_come_from_json_lines_and_csv_with_names_or_ids() {
        let (_d, jsonl) = file(
            "d.jsonl",
            "{\"text\": \"good\", \"label\": \"positive\"}\n\n{\"text\": \"a\", \"text_pair\": \"b\", \"label\": 0}\n",
        );
        let read = read_labeled(&jsonl, &labels()).unwrap();
        assert_eq!(
            read,
            vec![
                LabeledText { text: "good".into(), pair: None, label: 1 },
                LabeledText { text: "a".into(), pair: Some("b".into()), label: 0 },
            ]
        );
        let (_d, csv) = file("d.csv", "label,text,text_pair\nnegative,\"bad, very\",\n1,fine,\"and, so\"\n");
        let read = read_labeled(&csv, &labels()).unwrap();
        assert_eq!(read[0], LabeledText { text: "bad, very".into(), pair: None, label: 0 });
        assert_eq!(read[1].label, 1);
        assert_eq!(read[1].pair.as_deref(), Some("and, so"));
    }

    #[test]
    fn bad_records_are_named_by_file_line_and_rule() {
        for (text, expected) in [
            (
                "{\"text\": \"x\", \"label\": \"neutral\"}",
                ":1: label \"neutral\" is not one of the model's labels (negative, positive)",
            ),
            ("{\"text\": \"x\", \"label\": 2}", ":1: label id 2 is outside the model's 2 labels"),
            ("{\"text\": \"x\"}\n", ":1: no \"label\""),
            ("\n{\"label\": 1}", ":2: no \"text\""),
            ("{\"text\": 3, \"label\": 1}", ":1: \"text\" is not a string (3)"),
            ("[1, 2]", ":1: not a JSON object"),
            ("{\"text\": ", ":1: not JSON"),
            ("\n\n", ": no records"),
        ] {
            let (_d, path) = file("bad.jsonl", text);
            let err = read_labeled(&path, &labels()).unwrap_err().to_string();
            assert!(err.contains(expected), "{text:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
        let (_d, path) = file("bad.csv", "text,label\n\"two\nlines\",1\nx,7\n");
        let err = read_labeled(&path, &labels()).unwrap_err().to_string();
        assert!(err.contains("bad.csv:4: label \"7\" is not one of the model's labels"), "{err}");
    }

    #[test]
    fn batches_pad_each_row_as_an_example_of_its_own_and_carry_the_types() {
        let records = vec![
            LabeledText { text: "abc".into(), pair: Some("de".into()), label: 1 },
            LabeledText { text: "xy".into(), pair: None, label: 0 },
        ];
        let set = ClassifySet::encode(&records, &Tokenizer::Bytes, 4, 0, "two texts").unwrap();
        let batch = set.batch(&[0, 1]).unwrap();
        // The longer text gives way first: "ab" + "de".
        assert_eq!(Vec::<i64>::try_from(batch.inputs.flatten(0, -1)).unwrap(), [97, 98, 100, 101, 120, 121, 0, 0]);
        let layout = batch.layout.as_ref().unwrap();
        assert_eq!(Vec::<i64>::try_from(layout.examples.flatten(0, -1)).unwrap(), [0, 0, 0, 0, 0, 0, 1, 1]);
        let segments = layout.segments.as_ref().unwrap();
        assert_eq!(Vec::<i64>::try_from(segments.flatten(0, -1)).unwrap(), [0, 0, 1, 1, 0, 0, 0, 0]);
        assert_eq!(Vec::<i64>::try_from(batch.targets.shallow_clone()).unwrap(), [1, 0]);
        assert_eq!(batch.supervised, 2);
        assert!(set.batch(&[2]).is_err());
        assert_eq!((set.tokens(), set.longest(), set.vocab_needed()), (6, 4, 122));
        // A pair's second part is type 1: a model of one token type cannot take it.
        assert!(set.check_token_types(2).is_ok());
        let err = set.check_token_types(1).unwrap_err().to_string();
        assert!(err.contains("two texts holds token type 1") && err.contains("the model has 1 token type"), "{err}");
    }

    #[test]
    fn scores_count_right_answers_and_average_f1_over_classes() {
        let s = scores(&[0, 1, 1, 2], &[0, 1, 2, 2], 4);
        assert_eq!(s.accuracy, 0.75);
        // Class 0: 1; class 1: 2·1/(2+1); class 2: 2·1/(1+2); class 3 neither: left out.
        assert!((s.macro_f1 - (1.0 + 2.0 / 3.0 + 2.0 / 3.0) / 3.0).abs() < 1e-12);
        assert_eq!(predictions(&Tensor::from_slice(&[0.1f32, 0.9, 2.0, -1.0]).view([2, 2])).unwrap(), [1, 0]);
    }
}
