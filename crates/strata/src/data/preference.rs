//! Preference pairs: records of JSON Lines or Parquet files holding a prompt with a chosen
//! and a rejected completion — as text (`{"prompt", "chosen", "rejected"}`, TRL's standard
//! format) or as lists of messages rendered through the chat template (its conversational
//! format); a record without `"prompt"` has the longest start its two completions share as
//! its prompt. Or unpaired preferences (KTO's `{"prompt", "completion", "label"}`): each
//! completion, desirable or not, beside a mismatched one for the KL estimate — the
//! completion of the record before it within its batch, as TRL pairs them. Tokenized as TRL's `DPOTrainer` does: the prompt alone, then the prompt with
//! each completion (a text completion ended with the end-of-sequence token), the completion
//! starting where the two tokenizations part; a record whose prompt fills the most length is
//! left out, and each row is cut to the most length when batched. A pair record may carry
//! its reference's scores (TRL's `ref_chosen_logps` and `ref_rejected_logps`); a run may
//! keep the scores it computed in a file ([`StoredReference`]) and read them back.
//!
//! Owns reading the records, their tokens, the reference log-probabilities attached to them,
//! and a batch's layout: a record's chosen row in the first half of the rows, its rejected
//! row at the same place in the second. Must not score rows (the preference loss does).
use super::chat::ChatTemplate;
use super::records::{common_prefix, messages_of, read_records, template_variables};
use super::{check_indices, Batch, RowSet, Tokenizer, DATASETS_MAP_BATCH, IGNORE};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;
use tch::{Kind, Tensor};

/// A record's tokens: its prompt, and the completions that follow it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreferencePair {
    /// The prompt's tokens (those the two tokenized texts share).
    pub prompt: Vec<u32>,
    /// The preferred completion's tokens.
    pub chosen: Vec<u32>,
    /// The other completion's tokens.
    pub rejected: Vec<u32>,
}

/// What reading a file's pairs kept and left out.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PreferenceReport {
    /// Records read.
    pub records: usize,
    /// Pairs kept.
    pub pairs: usize,
    /// Records whose prompt alone fills the most length, left out.
    pub dropped_long_prompt: usize,
    /// Kept rows (a chosen or a rejected one) cut to the most length.
    pub truncated_rows: usize,
    /// Records with a row longer than the most length, left out (where rows are not cut).
    pub dropped_long: usize,
}

/// Preference pairs, batched a pair a record: `n` records give `2n` rows, the chosen ones
/// first (unpaired: each record's completion, then its mismatched one).
#[derive(Clone, Debug)]
pub struct PreferenceSet {
    /// Each record's prompt with its two completions: chosen and rejected, or (unpaired)
    /// the record's own and the mismatched one of the KL estimate.
    pairs: Vec<PreferencePair>,
    /// Unpaired records: whether each completion is desirable.
    desirable: Option<Vec<bool>>,
    max_length: usize,
    /// Each pair's reference log-probabilities `[chosen, rejected]`, once computed.
    reference: Option<Vec<[f64; 2]>>,
    /// Each pair's margin, where the records give one (reward models).
    margins: Option<Vec<f64>>,
    /// The id rows are padded with.
    pad: u32,
    /// Where the pairs came from, for messages.
    pub source: String,
    /// What reading kept and left out.
    pub report: PreferenceReport,
}

/// One record, checked: text or messages, the prompt given or not.
enum Record {
    Text {
        prompt: String,
        chosen: String,
        rejected: String,
    },
    /// Messages, and the record's own variables of the chat template (its `tools` and
    /// `chat_template_kwargs`).
    Conversation {
        prompt: Vec<Value>,
        chosen: Vec<Value>,
        rejected: Vec<Value>,
        variables: serde_json::Map<String, Value>,
    },
    /// A completion alone, desirable or not: its rows are the prompt with the completion.
    Unpaired {
        record: Box<Record>,
        desirable: bool,
    },
}

impl Record {
    fn parse(value: Value) -> std::result::Result<Record, String> {
        let Value::Object(mut fields) = value else { return Err("a record is a JSON object".into()) };
        let variables = template_variables(&mut fields)?;
        if let Some(label) = fields.remove("label") {
            // 1 and 0 as well, as Python reads them (datasets often store labels so).
            let desirable = match label {
                Value::Bool(b) => b,
                Value::Number(n) if matches!(n.as_u64(), Some(0 | 1)) => n.as_u64() == Some(1),
                _ => return Err("\"label\" must be true or false (or 1 or 0)".into()),
            };
            let record = match (fields.remove("prompt"), fields.remove("completion")) {
                (Some(Value::String(prompt)), Some(Value::String(completion))) => {
                    Record::Text { prompt, chosen: completion, rejected: String::new() }
                }
                (Some(p @ Value::Array(_)), Some(c @ Value::Array(_))) => Record::Conversation {
                    prompt: messages_of(p, "prompt")?,
                    chosen: messages_of(c, "completion")?,
                    rejected: vec![],
                    variables,
                },
                _ => {
                    return Err("an unpaired record needs \"prompt\" and \"completion\", both strings or both lists \
                                of messages"
                        .into())
                }
            };
            return Ok(Record::Unpaired { record: Box::new(record), desirable });
        }
        let (chosen, rejected) = match (fields.remove("chosen"), fields.remove("rejected")) {
            (Some(c), Some(r)) => (c, r),
            _ => {
                return Err(
                    "a preference record needs \"chosen\" and \"rejected\" (or \"completion\" and \"label\")".into()
                )
            }
        };
        match (fields.remove("prompt"), chosen, rejected) {
            (Some(Value::String(prompt)), Value::String(chosen), Value::String(rejected)) => {
                Ok(Record::Text { prompt, chosen, rejected })
            }
            (None, Value::String(chosen), Value::String(rejected)) => {
                let (prompt, chosen, rejected) = split_text_prompt(&chosen, &rejected);
                Ok(Record::Text { prompt, chosen, rejected })
            }
            (Some(p @ Value::Array(_)), c @ Value::Array(_), r @ Value::Array(_)) => Ok(Record::Conversation {
                prompt: messages_of(p, "prompt")?,
                chosen: messages_of(c, "chosen")?,
                rejected: messages_of(r, "rejected")?,
                variables,
            }),
            // A text prompt beside conversations: the prompt is within them (TRL's reading).
            (None | Some(Value::String(_)), c @ Value::Array(_), r @ Value::Array(_)) => {
                let (chosen, rejected) = (messages_of(c, "chosen")?, messages_of(r, "rejected")?);
                let shared = chosen.iter().zip(&rejected).take_while(|(a, b)| a == b).count();
                if shared == 0 {
                    return Err("\"chosen\" and \"rejected\" share no first message to take as the prompt".into());
                }
                Ok(Record::Conversation {
                    prompt: chosen[..shared].to_vec(),
                    chosen: chosen[shared..].to_vec(),
                    rejected: rejected[shared..].to_vec(),
                    variables,
                })
            }
            _ => Err("\"prompt\", \"chosen\" and \"rejected\" must all be strings or all lists of messages".into()),
        }
    }

    /// The prompt's tokens and those of the prompt followed by each completion (an unpaired
    /// record's second is empty), and whether the record is unpaired and desirable.
    fn tokenize(
        self,
        tokenizer: &Tokenizer,
        template: Option<&ChatTemplate>,
        end_of_text: &str,
    ) -> std::result::Result<([Vec<u32>; 3], Option<bool>), String> {
        if let Record::Unpaired { record, desirable } = self {
            let ([prompt, completion, _], _) = record.tokenize(tokenizer, template, end_of_text)?;
            return Ok(([prompt, completion, vec![]], Some(desirable)));
        }
        let special = matches!(self, Record::Text { .. });
        let texts = match self {
            Record::Text { prompt, chosen, rejected } => {
                // A completion ends with the end-of-sequence token once.
                let ended = |c: String| match c.is_empty() || c.ends_with(end_of_text) {
                    true => c,
                    false => c + end_of_text,
                };
                let (chosen, rejected) = (ended(chosen), ended(rejected));
                [prompt.clone(), format!("{prompt}{chosen}"), format!("{prompt}{rejected}")]
            }
            Record::Conversation { prompt, chosen, rejected, variables } => {
                let template = template.ok_or(
                    "conversations need a chat template: the model folder has none (give --chat-template FILE)",
                )?;
                let whole = |c: &[Value]| -> std::result::Result<String, String> {
                    template.render_with(&[prompt.as_slice(), c].concat(), false, &variables).map_err(|e| e.to_string())
                };
                let rejected = match rejected.is_empty() {
                    true => String::new(),
                    false => whole(&rejected)?,
                };
                let prompt = template.render_with(&prompt, true, &variables).map_err(|e| e.to_string())?;
                [prompt, whole(&chosen)?, rejected]
            }
            Record::Unpaired { .. } => unreachable!("tokenized above"),
        };
        // Text records take the tokenizer's own special tokens, as `tokenizer(text)` does; a
        // chat template writes its own.
        let mut encoded = tokenizer.encode_with_starts(texts.to_vec(), special).map_err(|e| e.to_string())?;
        let take = |e: &mut Vec<(Vec<u32>, Vec<usize>)>| std::mem::take(&mut e.remove(0).0);
        Ok(([take(&mut encoded), take(&mut encoded), take(&mut encoded)], None))
    }
}

/// A text record's implicit prompt, as TRL's `extract_prompt` finds it: the characters the
/// two completions share, less a space that ends them.
fn split_text_prompt(chosen: &str, rejected: &str) -> (String, String, String) {
    let mut cut = chosen
        .char_indices()
        .zip(rejected.chars())
        .find(|((_, a), b)| a != b)
        .map_or(chosen.len().min(rejected.len()), |((i, _), _)| i);
    if cut > 0 && chosen[..cut].ends_with(' ') {
        cut -= 1;
    }
    (chosen[..cut].to_string(), chosen[cut..].to_string(), rejected[cut..].to_string())
}

/// A record read: its prompt's tokens and those of the prompt with each
/// completion, whether it is unpaired and desirable, its margin and reference scores.
type ReadRecord = ([Vec<u32>; 3], Option<bool>, Option<f64>, Option<[f64; 2]>);

/// Pairs as unpaired completions, in TRL's order: of each run of [`DATASETS_MAP_BATCH`] pairs,
/// every chosen completion, then every rejected one.
fn unpair(pairs: Vec<ReadRecord>) -> Vec<ReadRecord> {
    let mut out = Vec::with_capacity(2 * pairs.len());
    for run in pairs.chunks(DATASETS_MAP_BATCH) {
        for desirable in [true, false] {
            out.extend(run.iter().map(|([prompt, chosen, rejected], ..)| {
                let completion = if desirable { chosen } else { rejected };
                ([prompt.clone(), completion.clone(), vec![]], Some(desirable), None, None)
            }));
        }
    }
    out
}

/// What turns preference records into pairs.
pub struct PreferenceFormat<'a> {
    /// Encodes the texts.
    pub tokenizer: &'a Tokenizer,
    /// The chat template conversations are rendered through; `None` refuses conversations.
    pub template: Option<&'a ChatTemplate>,
    /// Ends each text completion (the folder's end-of-sequence token).
    pub end_of_text: Option<String>,
    /// The most tokens of a row (a prompt with one completion).
    pub max_length: usize,
    /// Unpaired records: the records of one micro-batch (over every data-parallel rank),
    /// within which each record's KL completion is the one before it (TRL's
    /// `per_device_train_batch_size` on one process).
    pub kl_batch: usize,
    /// Leave out a record with a row longer than `max_length` rather than cut the row (how
    /// TRL's `RewardTrainer` keeps rows whole).
    pub drop_long: bool,
    /// The id rows are padded with (a reward model finds each row's last token by it).
    pub pad: u32,
    /// Read pairs as unpaired completions, as TRL's `KTOTrainer` reads a paired dataset
    /// (`unpair_preference_dataset`): of each run of [`DATASETS_MAP_BATCH`] records, every
    /// chosen completion (desirable), then every rejected one (undesirable).
    pub unpair: bool,
}

/// Gives each unpaired record, as its second completion, the completion of the record before
/// it within consecutive runs of `batch` records (the first takes the run's last): TRL's
/// mismatched pairs for the KL estimate.
fn mismatch_completions(pairs: &mut [PreferencePair], batch: usize) {
    for run in pairs.chunks_mut(batch) {
        let completions: Vec<Vec<u32>> = run.iter().map(|p| p.chosen.clone()).collect();
        for (i, pair) in run.iter_mut().enumerate() {
            pair.rejected = completions[(i + completions.len() - 1) % completions.len()].clone();
        }
    }
}

impl PreferenceSet {
    /// Whether `path`'s first record is a preference: a pair (it has `"chosen"` and
    /// `"rejected"`) or an unpaired completion with its `"label"`; how a records file says
    /// which kind of training it is for.
    pub fn holds_preferences(path: &Path) -> Result<bool> {
        let first = read_records(path)?.into_iter().next().and_then(|(_, r)| r.ok());
        let has = |v: &Value, key: &str| v.get(key).is_some();
        Ok(first.is_some_and(|v| has(&v, "chosen") && has(&v, "rejected") || has(&v, "completion") && has(&v, "label")))
    }

    /// Whether the records are unpaired completions (KTO's), each with its label.
    pub fn is_unpaired(&self) -> bool {
        self.desirable.is_some()
    }

    /// Reads and tokenizes every record of `path`; a bad record is an error naming the file
    /// and its line (or row).
    pub fn read(path: &Path, format: &PreferenceFormat) -> Result<PreferenceSet> {
        let records = read_records(path)?;
        let end = format.end_of_text.as_deref().unwrap_or("");
        let mut pairs = Vec::with_capacity(records.len());
        let (mut labels, mut unpaired, mut margins) = (vec![], None, vec![]);
        let (mut margined, mut scored, mut reference) = (None, None, vec![]);
        let mut report = PreferenceReport { records: records.len(), ..Default::default() };
        let mut read = Vec::with_capacity(records.len());
        for (at, value) in records {
            let bad = |why: String| Error::Data(format!("{}{at}: {why}", path.display()));
            let mut value = value.map_err(bad)?;
            let margin = match value.as_object_mut().and_then(|v| v.remove("margin")) {
                Some(m) => Some(m.as_f64().ok_or_else(|| bad(format!("\"margin\" must be a number, not {m}")))?),
                None => None,
            };
            if *margined.get_or_insert(margin.is_some()) != margin.is_some() {
                return Err(bad("either every record gives a \"margin\" or none does".into()));
            }
            let scores = given_reference(&mut value).map_err(bad)?;
            if *scored.get_or_insert(scores.is_some()) != scores.is_some() {
                return Err(bad(format!("either every record gives {} or none does", REFERENCE_FIELDS.join(" and "))));
            }
            let ([prompt, chosen, rejected], desirable) =
                Record::parse(value).map_err(bad)?.tokenize(format.tokenizer, format.template, end).map_err(bad)?;
            if *unpaired.get_or_insert(desirable.is_some()) != desirable.is_some() {
                return Err(bad("a file holds pairs or unpaired completions, not both".into()));
            }
            if (desirable.is_some() || format.unpair) && scores.is_some() {
                return Err(bad(format!(
                    "{} are a pair's: an unpaired completion's mismatched one is chosen when batched",
                    REFERENCE_FIELDS.join(" and ")
                )));
            }
            if format.unpair && margin.is_some() {
                return Err(bad("a \"margin\" is a pair's: unpaired completions take none".into()));
            }
            read.push(([prompt, chosen, rejected], desirable, margin, scores));
        }
        if format.unpair && unpaired == Some(false) {
            read = unpair(read);
        }
        for ([prompt, chosen, rejected], desirable, margin, scores) in read {
            let shared = match desirable {
                Some(_) => common_prefix(&prompt, &chosen),
                None => common_prefix(&prompt, &chosen).min(common_prefix(&prompt, &rejected)),
            };
            if shared >= format.max_length {
                report.dropped_long_prompt += 1;
                continue;
            }
            if format.drop_long && (chosen.len() > format.max_length || rejected.len() > format.max_length) {
                report.dropped_long += 1;
                continue;
            }
            labels.extend(desirable);
            margins.extend(margin);
            reference.extend(scores);
            report.truncated_rows += [&chosen, &rejected].iter().filter(|c| c.len() > format.max_length).count();
            pairs.push(PreferencePair {
                prompt: prompt[..shared].to_vec(),
                chosen: chosen[shared..].to_vec(),
                rejected: rejected.get(shared..).unwrap_or_default().to_vec(),
            });
        }
        report.pairs = pairs.len();
        if pairs.is_empty() {
            return Err(Error::Data(format!(
                "{}: no pair is left to train on ({} records, {} whose prompt fills {} tokens)",
                path.display(),
                report.records,
                report.dropped_long_prompt,
                format.max_length
            )));
        }
        let desirable = (!labels.is_empty()).then(|| {
            mismatch_completions(&mut pairs, format.kl_batch.max(1));
            labels
        });
        Ok(PreferenceSet {
            pairs,
            desirable,
            max_length: format.max_length,
            reference: scored.unwrap_or(false).then_some(reference),
            margins: margined.unwrap_or(false).then_some(margins),
            pad: format.pad,
            source: path.display().to_string(),
            report,
        })
    }

    /// Pairs already tokenized, rows cut to `max_length`.
    pub fn from_pairs(
        pairs: Vec<PreferencePair>,
        max_length: usize,
        source: impl Into<String>,
    ) -> Result<PreferenceSet> {
        if let Some(i) = pairs.iter().position(|p| p.prompt.len() >= max_length) {
            return Err(Error::Data(format!("pair {i}: its prompt fills the most length of {max_length} tokens")));
        }
        let report = PreferenceReport { records: pairs.len(), pairs: pairs.len(), ..Default::default() };
        Ok(PreferenceSet {
            pairs,
            desirable: None,
            max_length,
            reference: None,
            margins: None,
            pad: 0,
            source: source.into(),
            report,
        })
    }

    /// Pair `i`.
    pub fn pair(&self, i: usize) -> &PreferencePair {
        &self.pairs[i]
    }

    /// The rows of pair `i` as batched: the prompt with each completion, cut to the most
    /// length, and where its completion starts.
    fn rows(&self, i: usize) -> [(Vec<u32>, usize); 2] {
        let p = &self.pairs[i];
        let row = |c: &[u32]| {
            let mut ids = [p.prompt.as_slice(), c].concat();
            ids.truncate(self.max_length);
            (ids, p.prompt.len())
        };
        [row(&p.chosen), row(&p.rejected)]
    }

    /// Attaches each pair's reference log-probabilities `[chosen, rejected]`, which batches
    /// then carry.
    pub fn set_reference(&mut self, reference: Vec<[f64; 2]>) -> Result<()> {
        if reference.len() != self.pairs.len() {
            return Err(Error::Data(format!(
                "{}: {} reference log-probabilities for {} pairs",
                self.source,
                reference.len(),
                self.pairs.len()
            )));
        }
        self.reference = Some(reference);
        Ok(())
    }

    /// The attached reference log-probabilities.
    pub fn reference(&self) -> Option<&[[f64; 2]]> {
        self.reference.as_deref()
    }

    /// A digest of every row as batched (its tokens, where its completion starts, and the
    /// padding id): two sets of one digest are scored alike by any model.
    pub fn rows_digest(&self) -> String {
        let mut hash = Sha256::new();
        hash.update(self.pad.to_le_bytes());
        for (ids, start) in (0..self.len()).flat_map(|i| self.rows(i)) {
            hash.update((ids.len() as u64).to_le_bytes());
            hash.update((start as u64).to_le_bytes());
            ids.iter().for_each(|t| hash.update(t.to_le_bytes()));
        }
        format!("{:x}", hash.finalize())
    }
}

/// The fields a pair record gives its reference's scores in, by TRL's names: the summed
/// log-probabilities of its chosen and of its rejected completion.
const REFERENCE_FIELDS: [&str; 2] = ["\"ref_chosen_logps\"", "\"ref_rejected_logps\""];

/// The reference's scores a record gives, taken out of it.
fn given_reference(value: &mut Value) -> std::result::Result<Option<[f64; 2]>, String> {
    let Some(fields) = value.as_object_mut() else { return Ok(None) };
    let [chosen, rejected] = ["ref_chosen_logps", "ref_rejected_logps"].map(|k| fields.remove(k));
    match (chosen, rejected) {
        (None, None) => Ok(None),
        (Some(c), Some(r)) => match (c.as_f64(), r.as_f64()) {
            (Some(c), Some(r)) if c.is_finite() && r.is_finite() => Ok(Some([c, r])),
            _ => Err(format!("{} must be finite numbers, not {c} and {r}", REFERENCE_FIELDS.join(" and "))),
        },
        _ => Err(format!("a record gives both {} or neither", REFERENCE_FIELDS.join(" and "))),
    }
}

/// The reference's scores of a run's pair sets (`"train"`, `"validation"`), kept in a JSON
/// file between runs so that a run on the same pairs from the same model reads them instead
/// of scoring every pair again; each set's scores stand beside the digest of the rows they
/// score ([`PreferenceSet::rows_digest`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StoredReference {
    sets: BTreeMap<String, StoredScores>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct StoredScores {
    rows_sha256: String,
    /// Each pair's `[chosen, rejected]` summed log-probabilities, in the set's order.
    scores: Vec<[f64; 2]>,
}

/// What a stored file holds for one set.
pub enum StoredSet<'a> {
    /// No scores of a set of that name.
    Absent,
    /// The scores of these very rows.
    Scores(&'a [[f64; 2]]),
    /// The scores of other rows under that name.
    OtherRows,
}

impl StoredReference {
    /// Reads `path`; `None` where no file is there. A file that does not parse is an error.
    pub fn read(path: &Path) -> Result<Option<StoredReference>> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(path, e)),
        };
        let stored: StoredReference = serde_json::from_slice(&bytes)
            .map_err(|e| Error::Data(format!("{}: not a file of reference scores: {e}", path.display())))?;
        Ok(Some(stored))
    }

    /// What the file holds for set `name`, checked against `set`'s rows.
    pub fn set(&self, name: &str, set: &PreferenceSet) -> StoredSet<'_> {
        match self.sets.get(name) {
            None => StoredSet::Absent,
            Some(s) if s.rows_sha256 == set.rows_digest() && s.scores.len() == set.len() => {
                StoredSet::Scores(&s.scores)
            }
            Some(_) => StoredSet::OtherRows,
        }
    }

    /// Keeps `set`'s reference scores under `name`.
    pub fn insert(&mut self, name: &str, set: &PreferenceSet) -> Result<()> {
        let scores = set
            .reference()
            .ok_or_else(|| Error::Data(format!("{}: no reference scores to keep", set.source)))?
            .to_vec();
        self.sets.insert(name.to_string(), StoredScores { rows_sha256: set.rows_digest(), scores });
        Ok(())
    }

    /// Writes the file whole, replacing `path` atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        let bytes = serde_json::to_vec(self).map_err(|e| Error::Data(format!("{}: {e}", path.display())))?;
        crate::files::write_atomic(path, &bytes)
    }
}

impl RowSet for PreferenceSet {
    fn len(&self) -> usize {
        self.pairs.len()
    }

    fn source(&self) -> &str {
        &self.source
    }

    /// Tokens of both rows of every pair, as batched.
    fn tokens(&self) -> usize {
        (0..self.len()).flat_map(|i| self.rows(i)).map(|(ids, _)| ids.len()).sum()
    }

    fn longest(&self) -> usize {
        (0..self.len()).flat_map(|i| self.rows(i)).map(|(ids, _)| ids.len()).max().unwrap_or(0)
    }

    fn vocab_needed(&self) -> u32 {
        let p = self.pairs.iter().flat_map(|p| p.prompt.iter().chain(&p.chosen).chain(&p.rejected));
        p.copied().max().map_or(0, |m| m + 1)
    }

    /// A pair: the preference loss is a mean over pairs.
    fn supervised(&self, _row: usize) -> u64 {
        1
    }

    /// Pairs `rows` as `2 × rows` rows padded to the longest: the chosen rows, then
    /// the rejected ones in the same order. A position's target is the next token where
    /// that token belongs to the completion, else [`IGNORE`]; `supervised` counts pairs.
    fn batch(&self, rows: &[usize]) -> Result<Batch> {
        check_indices(rows, self.len())?;
        let all: Vec<(Vec<u32>, usize)> = [0, 1]
            .iter()
            .flat_map(|&side| rows.iter().map(move |&r| (r, side)))
            .map(|(r, side)| self.rows(r)[side].clone())
            .collect();
        let width = all.iter().map(|(ids, _)| ids.len()).max().unwrap_or(0).max(1);
        let (mut inputs, mut targets, mut padding) = (vec![], vec![], vec![]);
        for (ids, start) in &all {
            for t in 0..width {
                inputs.push(i64::from(*ids.get(t).unwrap_or(&self.pad)));
                targets.push(match ids.get(t + 1) {
                    Some(&next) if t + 1 >= *start => i64::from(next),
                    _ => IGNORE,
                });
                padding.push(t >= ids.len());
            }
        }
        let shape = [all.len() as i64, width as i64];
        let mut batch =
            Batch::new(Tensor::f_from_slice(&inputs)?.f_view(shape)?, Tensor::f_from_slice(&targets)?.f_view(shape)?)?;
        batch.supervised = rows.len() as u64;
        if padding.iter().any(|&p| p) {
            batch.padding = Some(Tensor::f_from_slice(&padding)?.f_view(shape)?);
        }
        if let Some(desirable) = &self.desirable {
            let labels: Vec<bool> = rows.iter().map(|&r| desirable[r]).collect();
            batch.desirable = Some(Tensor::f_from_slice(&labels)?);
        }
        if let Some(margins) = &self.margins {
            let values: Vec<f32> = rows.iter().map(|&r| margins[r] as f32).collect();
            batch.margin = Some(Tensor::f_from_slice(&values)?);
        }
        if let Some(reference) = &self.reference {
            let values: Vec<f64> =
                [0, 1].iter().flat_map(|&side| rows.iter().map(move |&r| reference[r][side])).collect();
            batch.reference = Some(Tensor::f_from_slice(&values)?.f_to_kind(Kind::Double)?);
        }
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A conversation's `tools` (a list or its JSON text) and `chat_template_kwargs` reach the
    /// chat template in its prompt and in both completions, paired or not, as TRL's
    /// `DPOTrainer` and `KTOTrainer` pass them to `apply_chat_template`.
    #[test]
    fn a_conversation_s_tools_and_template_arguments_reach_every_rendering() {
        let source = "{% if tools %}[{{ tools | length }} tools]{% endif %}{% if enable_thinking %}[think]{% endif %}\
                      {% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\
                      {% if add_generation_prompt %}<assistant>{% endif %}";
        let template = ChatTemplate::new(source.into(), Default::default(), "test").unwrap();
        let user = serde_json::json!([{"role": "user", "content": "q"}]);
        let says = |text: &str| serde_json::json!([{"role": "assistant", "content": text}]);
        let variables = serde_json::json!({"tools": [{"name": "add"}, {"name": "sub"}],
                                           "chat_template_kwargs": {"enable_thinking": true}});
        let with = |mut record: Value, tools_as_text: bool| {
            record.as_object_mut().unwrap().extend(variables.as_object().unwrap().clone());
            if tools_as_text {
                record["tools"] = Value::String(variables["tools"].to_string());
            }
            record
        };
        let implicit = [user.as_array().unwrap().clone(), says("y").as_array().unwrap().clone()].concat();
        let implicit_rejected = [user.as_array().unwrap().clone(), says("n").as_array().unwrap().clone()].concat();
        let records = [
            with(serde_json::json!({"prompt": user, "chosen": says("y"), "rejected": says("n")}), false),
            with(serde_json::json!({"prompt": user, "chosen": says("y"), "rejected": says("n")}), true),
            with(serde_json::json!({"chosen": implicit, "rejected": implicit_rejected}), false),
            with(serde_json::json!({"prompt": user, "completion": says("y"), "label": true}), true),
        ];
        for (i, record) in records.into_iter().enumerate() {
            let (rows, _) = Record::parse(record).unwrap().tokenize(&Tokenizer::Bytes, Some(&template), "").unwrap();
            let texts: Vec<String> = rows.iter().map(|r| r.iter().map(|&t| t as u8 as char).collect()).collect();
            assert_eq!(texts[0], "[2 tools][think]<user>q<assistant>", "record {i}");
            assert_eq!(texts[1], "[2 tools][think]<user>q<assistant>y", "record {i}");
            let rejected = if i == 3 { "" } else { "[2 tools][think]<user>q<assistant>n" };
            assert_eq!(texts[2], rejected, "record {i}");
        }
    }

    /// A label is true or false, or 1 or 0 as datasets store it; nothing else.
    #[test]
    fn a_label_is_a_truth_value_or_one_or_zero() {
        let label = |l: Value| Record::parse(json!({"prompt": "p", "completion": "c", "label": l}));
        for (given, desirable) in [(json!(true), true), (json!(1), true), (json!(false), false), (json!(0), false)] {
            let Ok(Record::Unpaired { desirable: read, .. }) = label(given.clone()) else { panic!("{given} refused") };
            assert_eq!(read, desirable, "{given}");
        }
        for bad in [json!(2), json!(-1), json!(0.5), json!("yes")] {
            assert!(label(bad.clone()).is_err_and(|e| e.contains("1 or 0")), "{bad} accepted");
        }
    }

    #[test]
    fn an_implicit_text_prompt_is_what_both_completions_start_with_less_a_space() {
        let (p, c, r) = split_text_prompt("Q: sky? A: blue", "Q: sky? A: green");
        assert_eq!((p.as_str(), c.as_str(), r.as_str()), ("Q: sky? A:", " blue", " green"));
    }

    #[test]
    fn a_batch_holds_chosen_rows_then_rejected_with_targets_on_completions_only() {
        let pair =
            |p: &[u32], c: &[u32], r: &[u32]| PreferencePair { prompt: p.into(), chosen: c.into(), rejected: r.into() };
        let mut set =
            PreferenceSet::from_pairs(vec![pair(&[1, 2, 3], &[4, 5], &[6]), pair(&[7, 8], &[9], &[10, 11])], 4, "t")
                .expect("prompts fit");
        set.set_reference(vec![[-1.0, -2.0], [-3.0, -4.0]]).expect("one per pair");
        let b = set.batch(&[0, 1]).expect("a batch");
        let rows = |t: &Tensor| Vec::<Vec<i64>>::try_from(t).expect("2-d");
        assert_eq!(rows(&b.inputs), [[1, 2, 3, 4], [7, 8, 9, 0], [1, 2, 3, 6], [7, 8, 10, 11]]);
        let i = IGNORE;
        // The chosen row of pair 0 is cut at 4 tokens: its last completion token is gone.
        assert_eq!(rows(&b.targets), [[i, i, 4, i], [i, 9, i, i], [i, i, 6, i], [i, 10, 11, i]]);
        assert_eq!(b.supervised, 2);
        assert_eq!(
            Vec::<f64>::try_from(b.reference.as_ref().expect("attached")).expect("1-d"),
            [-1.0, -3.0, -2.0, -4.0]
        );
    }
}
