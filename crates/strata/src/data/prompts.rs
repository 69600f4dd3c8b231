//! Prompts for GRPO: records of JSON Lines or Parquet files holding a `"prompt"` — text
//! (TRL's standard format, tokenized with the tokenizer's own special tokens) or a list of
//! messages rendered through the chat template with the assistant's turn opened (its
//! conversational format). Every other field of a record is kept for the reward function
//! (an expected answer, a test case).
//!
//! Owns reading the records and their prompts' tokens. Must not generate nor reward.
use super::chat::ChatTemplate;
use super::records::{messages_of, read_records, ExampleSet};
use super::{check_indices, Batch, RowSet, Tokenizer, IGNORE};
use crate::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;
use tch::Tensor;

/// How a prompt file is read.
pub struct PromptFormat<'a> {
    /// Encodes the texts.
    pub tokenizer: &'a Tokenizer,
    /// The chat template conversations are rendered through; `None` refuses conversations.
    pub template: Option<&'a ChatTemplate>,
    /// The most tokens of a prompt: a longer one's record is left out (the context less the
    /// most completion tokens).
    pub max_prompt_length: usize,
}

/// What reading a prompt file kept and left out.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PromptReport {
    /// Records read.
    pub records: usize,
    /// Records whose prompt is longer than the most, left out.
    pub dropped_long: usize,
}

/// Prompts, each with its record's other fields.
#[derive(Clone, Debug)]
pub struct PromptSet {
    prompts: Vec<Vec<u32>>,
    /// Each record's prompt as given and its other fields, for the reward function.
    records: Vec<Map<String, Value>>,
    /// Where the prompts came from, for messages.
    pub source: String,
    /// What reading kept and left out.
    pub report: PromptReport,
}

impl PromptSet {
    /// Whether `path`'s first record is a prompt alone: it has `"prompt"` and no completion.
    pub fn holds_prompts(path: &Path) -> Result<bool> {
        let first = read_records(path)?.into_iter().next().and_then(|(_, r)| r.ok());
        let has = |v: &Value, key: &str| v.get(key).is_some();
        Ok(first.is_some_and(|v| {
            has(&v, "prompt")
                && !["chosen", "rejected", "completion", "response", "messages"].iter().any(|k| has(&v, k))
        }))
    }

    /// Reads and tokenizes every record of `path`; a bad record is an error naming the file
    /// and its line (or row).
    pub fn read(path: &Path, format: &PromptFormat) -> Result<PromptSet> {
        let all = read_records(path)?;
        let mut report = PromptReport { records: all.len(), ..Default::default() };
        let (mut prompts, mut records) = (vec![], vec![]);
        for (at, value) in all {
            let bad = |why: String| Error::Data(format!("{}{at}: {why}", path.display()));
            let Value::Object(fields) = value.map_err(bad)? else {
                return Err(bad("a record is a JSON object".into()));
            };
            let tokens = match fields.get("prompt") {
                Some(Value::String(text)) => format.tokenizer.encode_with_starts(vec![text.clone()], true),
                Some(messages @ Value::Array(_)) => {
                    let template = format.template.ok_or_else(|| {
                        bad("conversations need a chat template: the model folder has none (give --chat-template FILE)"
                            .into())
                    })?;
                    let messages = messages_of(messages.clone(), "prompt").map_err(bad)?;
                    let text = template.render(&messages, true).map_err(|e| bad(e.to_string()))?;
                    format.tokenizer.encode_with_starts(vec![text], false)
                }
                _ => return Err(bad("a prompt record needs \"prompt\": a string or a list of messages".into())),
            };
            let tokens = tokens.map_err(|e| bad(e.to_string()))?.remove(0).0;
            if tokens.is_empty() {
                return Err(bad("the prompt holds no tokens".into()));
            }
            if tokens.len() > format.max_prompt_length {
                report.dropped_long += 1;
                continue;
            }
            prompts.push(tokens);
            records.push(fields);
        }
        if prompts.is_empty() {
            return Err(Error::Data(format!(
                "{}: no prompt is left to train on ({} records, {} longer than {} tokens)",
                path.display(),
                report.records,
                report.dropped_long,
                format.max_prompt_length
            )));
        }
        Ok(PromptSet { prompts, records, source: path.display().to_string(), report })
    }

    /// Prompts already tokenized, each with no other field.
    pub fn from_prompts(prompts: Vec<Vec<u32>>, source: impl Into<String>) -> Result<PromptSet> {
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            return Err(Error::Data(format!("prompt {i} holds no tokens")));
        }
        let records = vec![Map::new(); prompts.len()];
        let report = PromptReport { records: prompts.len(), dropped_long: 0 };
        Ok(PromptSet { prompts, records, source: source.into(), report })
    }

    /// Prompt `i`'s tokens.
    pub fn prompt(&self, i: usize) -> Vec<i64> {
        self.prompts[i].iter().map(|&t| i64::from(t)).collect()
    }

    /// Record `i`'s fields as read (the prompt among them).
    pub fn record(&self, i: usize) -> &Map<String, Value> {
        &self.records[i]
    }

    /// Each prompt followed by a completion of `completion` tokens (the prompt's own,
    /// repeated), the completion learned: rows as long as GRPO trains on at their longest,
    /// for the dry runs of a strategy search.
    pub fn at_completion_length(&self, completion: usize) -> ExampleSet {
        let rows = self.prompts.iter().map(|p| {
            let ids: Vec<u32> = p.iter().copied().chain(p.iter().copied().cycle().take(completion)).collect();
            let learned = (0..ids.len()).map(|i| i >= p.len()).collect();
            (ids, learned)
        });
        ExampleSet::from_rows(self.source.clone(), rows)
    }
}

impl RowSet for PromptSet {
    fn len(&self) -> usize {
        self.prompts.len()
    }

    fn source(&self) -> &str {
        &self.source
    }

    fn tokens(&self) -> usize {
        self.prompts.iter().map(Vec::len).sum()
    }

    fn longest(&self) -> usize {
        self.prompts.iter().map(Vec::len).max().unwrap_or(0)
    }

    fn vocab_needed(&self) -> u32 {
        self.prompts.iter().flatten().copied().max().map_or(0, |m| m + 1)
    }

    /// Nothing: a prompt is generated from, not learned.
    fn supervised(&self, _row: usize) -> u64 {
        0
    }

    /// Prompts `rows`, padded with 0 on the right to the longest; no target is learned.
    fn batch(&self, rows: &[usize]) -> Result<Batch> {
        check_indices(rows, self.len())?;
        let width = rows.iter().map(|&r| self.prompts[r].len()).max().unwrap_or(0).max(1);
        let inputs: Vec<i64> = rows
            .iter()
            .flat_map(|&r| (0..width).map(move |t| self.prompts[r].get(t).map_or(0, |&id| i64::from(id))))
            .collect();
        let shape = [rows.len() as i64, width as i64];
        Batch::new(
            Tensor::f_from_slice(&inputs)?.f_view(shape)?,
            Tensor::f_full(shape, IGNORE, (tch::Kind::Int64, tch::Device::Cpu))?,
        )
    }
}
