//! Example data: records of JSON Lines or Parquet files — `{"text"}`, `{"prompt",
//! "completion"}` or `{"messages": [{"role", "content"}, ...]}` — turned into token ids with
//! a flag per token saying whether the loss learns it (what the assistant says, the
//! completion, or all of a text), cut to a most length, and cached on disk keyed by the
//! file's content, the tokenizer, the template and the options.
//!
//! Owns reading and checking records, rendering conversations through a [`ChatTemplate`],
//! the learned-token flags and the cache. Must not batch (the loader does) nor know models.
use super::chat::ChatTemplate;
use super::Tokenizer;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// How records become examples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExampleOptions {
    /// The most tokens of an example.
    pub max_length: usize,
    /// Drop an example longer than `max_length` instead of truncating it.
    pub drop_long: bool,
    /// Learn prompts (user and system turns, the prompt of a completion) too.
    pub train_on_prompt: bool,
}

/// What turns text into examples: the tokenizer, the chat template for conversations, and
/// the text that ends a plain text or a completion (the folder's end-of-sequence token).
pub struct ExampleFormat<'a> {
    /// Encodes the rendered texts.
    pub tokenizer: &'a Tokenizer,
    /// The chat template conversations are rendered through; `None` refuses conversations.
    pub template: Option<&'a ChatTemplate>,
    /// Appended to a plain text or a completion (the folder's end-of-sequence token).
    pub end_of_text: Option<String>,
}

/// What preparing a file's examples kept, cut and left out.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExampleReport {
    /// Records read.
    pub records: usize,
    /// Examples kept.
    pub examples: usize,
    /// Kept examples cut to the most length.
    pub truncated: usize,
    /// Examples longer than the most length, left out (`drop_long`).
    pub dropped_long: usize,
    /// Examples with no learned token within the most length, left out.
    pub dropped_unlearned: usize,
    /// Tokens of the kept examples, and how many of them the loss learns.
    pub tokens: u64,
    /// How many of those tokens the loss learns.
    pub learned_tokens: u64,
}

/// Token ids of examples, each token flagged where the loss learns it.
#[derive(Clone, Debug)]
pub struct ExampleSet {
    ids: Vec<u32>,
    learned: Vec<bool>,
    /// Example `i` is `starts[i] .. starts[i + 1]`.
    starts: Vec<usize>,
    /// Where the examples came from, for messages.
    pub source: String,
    /// What preparing the examples kept, cut and left out.
    pub report: ExampleReport,
    /// Whether the examples came from the cache.
    pub cached: bool,
}

/// One record of a file, checked.
enum Record {
    Text(String),
    Completion {
        prompt: String,
        completion: String,
    },
    /// A conversation, the first message whose assistant turns are learned (0, or the first
    /// completion message of a conversational prompt and completion), and the record's own
    /// variables of the chat template (its `tools` and `chat_template_kwargs`).
    Conversation {
        messages: Vec<Value>,
        first_learned: usize,
        variables: serde_json::Map<String, Value>,
    },
}

impl Record {
    fn parse(value: Value) -> std::result::Result<Record, String> {
        let Value::Object(mut fields) = value else { return Err("a record is a JSON object".into()) };
        let variables = template_variables(&mut fields)?;
        if let Some(messages) = fields.remove("messages") {
            return Ok(Record::Conversation {
                messages: messages_of(messages, "messages")?,
                first_learned: 0,
                variables,
            });
        }
        match (fields.remove("prompt"), fields.remove("completion"), fields.remove("text")) {
            (Some(Value::String(prompt)), Some(Value::String(completion)), _) => {
                Ok(Record::Completion { prompt, completion })
            }
            (Some(prompt @ Value::Array(_)), Some(completion @ Value::Array(_)), _) => {
                let mut messages = messages_of(prompt, "prompt")?;
                let first_learned = messages.len();
                messages.extend(messages_of(completion, "completion")?);
                Ok(Record::Conversation { messages, first_learned, variables })
            }
            (Some(_), Some(_), _) => {
                Err("\"prompt\" and \"completion\" must both be strings or both lists of messages".into())
            }
            (None, None, Some(Value::String(text))) => Ok(Record::Text(text)),
            (None, None, Some(_)) => Err("\"text\" must be a string".into()),
            _ => Err("a record needs \"text\", \"prompt\" and \"completion\", or \"messages\"".into()),
        }
    }

    /// The record as it is tokenized: its text and what of it the loss learns. A text or
    /// completion ends with the end-of-sequence text once, as TRL's end it.
    fn render(self, format: &ExampleFormat, train_on_prompt: bool) -> std::result::Result<Rendered, String> {
        let end = format.end_of_text.as_deref().unwrap_or("");
        let ended = |t: String| match t.ends_with(end) {
            true => t,
            false => t + end,
        };
        let (text, learned, special) = match self {
            Record::Text(text) => {
                let text = ended(text);
                let all = std::iter::once(0..text.len()).collect();
                (text, all, true)
            }
            Record::Completion { prompt, completion } => {
                let text = format!("{prompt}{}", ended(completion));
                // Learned from where the prompt's tokens and the whole text's part (TRL's
                // rule): a token merged across the boundary is the completion's.
                if !train_on_prompt {
                    return Ok(Rendered { text, learned: Learned::AfterPrompt(prompt), special: true });
                }
                (text, vec![], true)
            }
            Record::Conversation { messages, first_learned, variables } => {
                let template = format.template.ok_or(
                    "conversations need a chat template: the model folder has none (give --chat-template FILE)",
                )?;
                let (text, turns) =
                    template.render_with_turns(&messages, first_learned, &variables).map_err(|e| match e {
                        // Said again with the file and line in front.
                        Error::Data(why) => why,
                        other => other.to_string(),
                    })?;
                (text, turns, false)
            }
        };
        let learned = if train_on_prompt { std::iter::once(0..text.len()).collect() } else { learned };
        Ok(Rendered { text, learned: Learned::Bytes(learned), special })
    }
}

/// A record as it is tokenized.
struct Rendered {
    text: String,
    learned: Learned,
    /// Whether the tokenizer adds its special tokens (a chat template writes them itself).
    special: bool,
}

/// What of a rendered record's tokens the loss learns.
enum Learned {
    /// Those that start inside these byte ranges of the text.
    Bytes(Vec<Range<usize>>),
    /// Those from the first where the text's tokens and this prompt's alone differ.
    AfterPrompt(String),
}

/// How many first tokens `a` and `b` share.
pub(super) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A record's own variables of the chat template, taken out of its fields: its `tools` (a
/// list, or the JSON text of one as datasets often store them, which TRL reads so) and the
/// entries of its `chat_template_kwargs` (`enable_thinking`), as `apply_chat_template` takes them.
pub(super) fn template_variables(
    fields: &mut serde_json::Map<String, Value>,
) -> std::result::Result<serde_json::Map<String, Value>, String> {
    let mut variables = serde_json::Map::new();
    let tools = match fields.remove("tools") {
        Some(Value::String(text)) => {
            Some(serde_json::from_str(&text).map_err(|e| format!("\"tools\" is text but not JSON ({e})"))?)
        }
        other => other.filter(|t| !t.is_null()),
    };
    if let Some(tools) = tools {
        variables.insert("tools".into(), tools);
    }
    match fields.remove("chat_template_kwargs") {
        Some(Value::Object(kwargs)) => variables.extend(kwargs),
        None | Some(Value::Null) => {}
        Some(_) => return Err("\"chat_template_kwargs\" must be an object".into()),
    }
    Ok(variables)
}

/// Messages: a list of objects, each with a string `role` (a tool's turn is a message like
/// any other, and `content` may be text, a list of parts or absent beside `tool_calls`: the
/// template decides how each reads; [`ChatTemplate::render_with`] passes them as
/// `apply_chat_template` does).
pub(super) fn messages_of(value: Value, field: &str) -> std::result::Result<Vec<Value>, String> {
    let Value::Array(messages) = value else { return Err(format!("\"{field}\" must be a list of messages")) };
    if messages.is_empty() {
        return Err(format!("\"{field}\" holds no message"));
    }
    for (k, m) in messages.iter().enumerate() {
        if !m.get("role").is_some_and(Value::is_string) {
            return Err(format!("message {} of \"{field}\" is not an object with a string \"role\"", k + 1));
        }
    }
    Ok(messages)
}

/// Reads `path`'s records with where each came from (`:LINE`, or `: row N`): JSON Lines, or
/// Parquet when the name ends in `.parquet`.
pub(super) fn read_records(path: &Path) -> Result<Vec<(String, std::result::Result<Value, String>)>> {
    if path.extension().is_some_and(|e| e == "parquet") {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let bad = |e: parquet::errors::ParquetError| {
            Error::Data(format!("{}: not a readable Parquet file ({e})", path.display()))
        };
        let reader = SerializedFileReader::new(file).map_err(bad)?;
        let rows = reader.get_row_iter(None).map_err(bad)?;
        rows.enumerate()
            .map(|(i, row)| Ok((format!(": row {}", i + 1), Ok(row.map_err(bad)?.to_json_value()))))
            .collect()
    } else {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Ok(text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| (format!(":{}", i + 1), serde_json::from_str(l).map_err(|e| format!("not JSON ({e})"))))
            .collect())
    }
}

impl ExampleSet {
    /// Reads and tokenizes every record of `path` (no cache). Any bad record is an error
    /// naming the file and its line (or row).
    pub fn prepare(path: &Path, format: &ExampleFormat, options: &ExampleOptions) -> Result<ExampleSet> {
        let records = read_records(path)?;
        let progress =
            indicatif::ProgressBar::new(records.len() as u64).with_message(format!("tokenizing {}", path.display()));
        progress.set_style(
            indicatif::ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} records")
                .map_err(|e| Error::Data(e.to_string()))?,
        );
        let mut set = ExampleSet {
            ids: vec![],
            learned: vec![],
            starts: vec![0],
            source: path.display().to_string(),
            report: ExampleReport { records: records.len(), ..Default::default() },
            cached: false,
        };
        // Records are rendered here and tokenized a chunk at a time on every core.
        for chunk in records.chunks(1024) {
            let rendered = chunk
                .iter()
                .map(|(at, value)| {
                    let bad = |why: String| Error::Data(format!("{}{at}: {why}", path.display()));
                    Record::parse(value.clone().map_err(bad)?)
                        .map_err(bad)?
                        .render(format, options.train_on_prompt)
                        .map_err(bad)
                })
                .collect::<Result<Vec<_>>>()?;
            // A run of records is tokenized with one setting of the special tokens.
            for run in rendered.chunk_by(|a, b| a.special == b.special) {
                set.push_tokenized(format.tokenizer, run, options)?;
            }
            progress.inc(chunk.len() as u64);
        }
        progress.finish_and_clear();
        if set.is_empty() {
            return Err(Error::Data(format!(
                "{}: no example is left to train on ({} records: {} longer than {} tokens, {} with nothing to learn within them)",
                set.source, set.report.records, set.report.dropped_long, options.max_length, set.report.dropped_unlearned
            )));
        }
        Ok(set)
    }

    /// Tokenizes rendered records (whether the tokenizer adds its special tokens the same for
    /// all), flags the tokens they learn, cuts each to the most length, and keeps those with
    /// something to learn.
    fn push_tokenized(&mut self, tokenizer: &Tokenizer, rendered: &[Rendered], options: &ExampleOptions) -> Result<()> {
        let Some(special) = rendered.first().map(|r| r.special) else { return Ok(()) };
        let texts = rendered.iter().map(|r| r.text.clone()).collect();
        let prompts: Vec<String> = rendered
            .iter()
            .filter_map(|r| match &r.learned {
                Learned::AfterPrompt(prompt) => Some(prompt.clone()),
                Learned::Bytes(_) => None,
            })
            .collect();
        let mut prompts = tokenizer.encode_with_starts(prompts, special)?.into_iter();
        for ((mut ids, starts), r) in tokenizer.encode_with_starts(texts, special)?.into_iter().zip(rendered) {
            let mut learned: Vec<bool> = match &r.learned {
                Learned::Bytes(spans) => starts.iter().map(|s| spans.iter().any(|r| r.contains(s))).collect(),
                Learned::AfterPrompt(_) => {
                    let (prompt, _) = prompts.next().ok_or_else(|| Error::Data("a prompt left untokenized".into()))?;
                    let first = common_prefix(&ids, &prompt);
                    (0..ids.len()).map(|i| i >= first).collect()
                }
            };
            if ids.len() > options.max_length {
                if options.drop_long {
                    self.report.dropped_long += 1;
                    continue;
                }
                ids.truncate(options.max_length);
                learned.truncate(options.max_length);
                self.report.truncated += 1;
            }
            // The first token is never a target: something after it must be learned.
            let learned_count = learned.iter().skip(1).filter(|&&l| l).count() as u64;
            if learned_count == 0 {
                self.report.dropped_unlearned += 1;
                continue;
            }
            self.report.examples += 1;
            self.report.tokens += ids.len() as u64;
            self.report.learned_tokens += learned_count;
            self.ids.extend(ids);
            self.learned.extend(learned);
            self.starts.push(self.ids.len());
        }
        Ok(())
    }

    /// The examples of `path`, from the cache in `cache_dir` where an earlier run (or
    /// another rank) prepared them with the same file content, tokenizer, template and
    /// options; prepared and cached otherwise. Ranks on one host prepare a file once: the
    /// first holds a lock on its cache entry while the others wait for it.
    pub fn load(
        path: &Path,
        format: &ExampleFormat,
        options: &ExampleOptions,
        cache_dir: Option<&Path>,
    ) -> Result<ExampleSet> {
        let Some(dir) = cache_dir else { return ExampleSet::prepare(path, format, options) };
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let key = cache_key(path, format, options)?;
        let entry = dir.join(format!("{key}.examples"));
        let lock_path = dir.join(format!("{key}.lock"));
        let lock = std::fs::File::create(&lock_path).map_err(|e| Error::io(&lock_path, e))?;
        lock.lock().map_err(|e| Error::io(&lock_path, e))?;
        if let Ok(bytes) = std::fs::read(&entry) {
            match ExampleSet::decode(&bytes, path) {
                Ok(set) => return Ok(set),
                Err(e) => tracing::warn!(entry = %entry.display(), "rebuilding a damaged example cache: {e}"),
            }
        }
        let set = ExampleSet::prepare(path, format, options)?;
        crate::files::write_atomic(&entry, &set.encode()?)?;
        Ok(set)
    }

    /// Examples given as rows of ids, each id learned or not, from `source`.
    pub fn from_rows(source: impl Into<String>, rows: impl IntoIterator<Item = (Vec<u32>, Vec<bool>)>) -> ExampleSet {
        let (mut ids, mut learned, mut starts) = (vec![], vec![], vec![0]);
        for (row_ids, row_learned) in rows {
            ids.extend(row_ids);
            learned.extend(row_learned);
            starts.push(ids.len());
        }
        let report = ExampleReport {
            records: starts.len() - 1,
            examples: starts.len() - 1,
            tokens: ids.len() as u64,
            learned_tokens: learned.iter().filter(|&&l| l).count() as u64,
            ..ExampleReport::default()
        };
        ExampleSet { ids, learned, starts, source: source.into(), report, cached: false }
    }

    /// Examples held.
    pub fn len(&self) -> usize {
        self.starts.len() - 1
    }

    /// Whether no example is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Example `i`'s ids and learned flags.
    pub fn example(&self, i: usize) -> (&[u32], &[bool]) {
        let r = self.starts[i]..self.starts[i + 1];
        (&self.ids[r.clone()], &self.learned[r])
    }

    /// The longest example, in tokens.
    pub fn longest(&self) -> usize {
        self.starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
    }

    /// The largest id plus one.
    pub fn vocab_needed(&self) -> u32 {
        self.ids.iter().max().map_or(0, |m| m + 1)
    }

    fn encode(&self) -> Result<Vec<u8>> {
        let header = serde_json::to_vec(&self.report).map_err(|e| Error::Data(e.to_string()))?;
        let mut out = Vec::with_capacity(32 + header.len() + self.ids.len() * 5 + self.starts.len() * 8);
        out.extend_from_slice(CACHE_MAGIC);
        out.extend_from_slice(&(header.len() as u64).to_le_bytes());
        out.extend_from_slice(&header);
        out.extend_from_slice(&(self.len() as u64).to_le_bytes());
        for s in &self.starts {
            out.extend_from_slice(&(*s as u64).to_le_bytes());
        }
        for id in &self.ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out.extend(self.learned.iter().map(|&l| l as u8));
        Ok(out)
    }

    fn decode(bytes: &[u8], source: &Path) -> std::result::Result<ExampleSet, String> {
        let mut at = 0;
        let mut take = |n: usize| -> std::result::Result<&[u8], String> {
            let piece = bytes.get(at..at + n).ok_or("ends early")?;
            at += n;
            Ok(piece)
        };
        if take(CACHE_MAGIC.len())? != CACHE_MAGIC {
            return Err("not an example cache".into());
        }
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default()) as usize;
        let header_len = word(take(8)?);
        let report: ExampleReport = serde_json::from_slice(take(header_len)?).map_err(|e| e.to_string())?;
        let count = word(take(8)?);
        let starts: Vec<usize> = take(count.checked_add(1).and_then(|n| n.checked_mul(8)).ok_or("too long")?)?
            .chunks_exact(8)
            .map(word)
            .collect();
        let tokens = *starts.last().ok_or("no starts")?;
        if starts.windows(2).any(|w| w[0] > w[1]) || starts[0] != 0 || report.examples != count {
            return Err("inconsistent offsets".into());
        }
        let ids = take(tokens.checked_mul(4).ok_or("too long")?)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let learned = take(tokens)?.iter().map(|&b| b != 0).collect();
        if at != bytes.len() {
            return Err("trailing bytes".into());
        }
        Ok(ExampleSet { ids, learned, starts, source: source.display().to_string(), report, cached: true })
    }
}

const CACHE_MAGIC: &[u8; 8] = b"STRATEX3";

/// The cache entry's name: a hash of everything the examples depend on.
fn cache_key(path: &Path, format: &ExampleFormat, options: &ExampleOptions) -> Result<String> {
    let mut hash = Sha256::new();
    let mut part = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    part(CACHE_MAGIC);
    part(&std::fs::read(path).map_err(|e| Error::io(path, e))?);
    part(path.extension().map_or(b"".as_slice(), |e| e.as_encoded_bytes()));
    part(format.tokenizer.fingerprint()?.as_bytes());
    part(format.template.map_or(String::new(), ChatTemplate::identity).as_bytes());
    part(format.end_of_text.as_ref().map_or("\u{0}", |t| t.as_str()).as_bytes());
    part(format!("{} {} {}", options.max_length, options.drop_long, options.train_on_prompt).as_bytes());
    Ok(hash.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect())
}

/// Where prepared examples are cached: `$STRATA_CACHE/examples`, else
/// `~/.cache/strata/examples`; `None` without either variable.
pub fn default_cache_dir() -> Option<PathBuf> {
    let root = std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/strata")))?;
    Some(root.join("examples"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn options(max_length: usize) -> ExampleOptions {
        ExampleOptions { max_length, drop_long: false, train_on_prompt: false }
    }

    fn prepare(lines: &[&str], options: &ExampleOptions) -> Result<ExampleSet> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, lines.join("\n")).unwrap();
        let template = ChatTemplate::new(CHATML.into(), Default::default(), "test").unwrap();
        let format =
            ExampleFormat { tokenizer: &Tokenizer::Bytes, template: Some(&template), end_of_text: Some("#".into()) };
        ExampleSet::prepare(&path, &format, options)
    }

    /// The learned bytes of example `i`, as text.
    fn learned(set: &ExampleSet, i: usize) -> String {
        let (ids, flags) = set.example(i);
        ids.iter().zip(flags).filter(|(_, &l)| l).map(|(&t, _)| t as u8 as char).collect()
    }

    /// A Parquet file (snappy pages) of prompt and completion columns.
    fn write_parquet(path: &Path, rows: &[(&str, &str)]) {
        use parquet::data_type::{ByteArray, ByteArrayType};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        let schema = "message examples { REQUIRED BYTE_ARRAY prompt (UTF8); REQUIRED BYTE_ARRAY completion (UTF8); }";
        let schema = std::sync::Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
        let props = WriterProperties::builder().set_compression(parquet::basic::Compression::SNAPPY).build();
        let mut writer = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props.into()).unwrap();
        let mut group = writer.next_row_group().unwrap();
        for column in [0, 1] {
            let values: Vec<ByteArray> =
                rows.iter().map(|r| ByteArray::from(if column == 0 { r.0 } else { r.1 })).collect();
            let mut col = group.next_column().unwrap().unwrap();
            col.typed::<ByteArrayType>().write_batch(&values, None, None).unwrap();
            col.close().unwrap();
        }
        group.close().unwrap();
        writer.close().unwrap();
    }

    /// A byte-level BPE whose only merge joins a space to the `b` after it, carrying the
    /// truncation to 2 tokens and padding to 8 that a `tokenizer.json` may hold.
    fn merging_tokenizer(dir: &Path) -> Tokenizer {
        let path = dir.join("tokenizer.json");
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
            "padding": {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null,
                        "pad_id": 0, "pad_type_id": 0, "pad_token": "a"},
            "added_tokens": [], "normalizer": null, "post_processor": null, "decoder": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "vocab": {"a": 0, "\u{120}": 1, "b": 2, "\u{120}b": 3, "#": 4}, "merges": ["\u{120} b"]}
        });
        std::fs::write(&path, json.to_string()).unwrap();
        Tokenizer::from_file(&path).unwrap()
    }

    /// A prompt ending in a space before its completion: the token that merges the two is
    /// learned, as TRL learns from where the prompt's own tokens and the whole text's part;
    /// a completion that ends with the end token takes it once; and the file's truncation and
    /// padding are switched off.
    #[test]
    fn a_token_merged_across_the_prompt_s_end_is_the_completion_s() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = merging_tokenizer(dir.path());
        let path = dir.path().join("d.jsonl");
        let records = [r#"{"prompt": "a ", "completion": "b"}"#, r#"{"prompt": "a ", "completion": "b#"}"#];
        std::fs::write(&path, records.join("\n")).unwrap();
        let format = ExampleFormat { tokenizer: &tokenizer, template: None, end_of_text: Some("#".into()) };
        let set = ExampleSet::prepare(&path, &format, &options(100)).unwrap();
        assert_eq!(set.len(), 2);
        for i in 0..2 {
            let (ids, flags) = set.example(i);
            assert_eq!((ids, flags), (&[0, 3, 4][..], &[false, true, true][..]), "record {i}");
        }
    }

    /// A conversation's `tools` and `chat_template_kwargs` reach the chat template.
    #[test]
    fn a_conversation_s_tools_and_template_arguments_reach_the_template() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        let record = serde_json::json!({
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}],
            "tools": [{"name": "add"}, {"name": "sub"}],
            "chat_template_kwargs": {"enable_thinking": true}
        });
        // The same tools as a JSON text, as datasets often store them.
        let mut as_text = record.clone();
        as_text["tools"] = serde_json::json!(record["tools"].to_string());
        std::fs::write(&path, format!("{record}\n{as_text}")).unwrap();
        let source = format!("{{% if tools %}}[{{{{ tools | length }}}} tools]{{% endif %}}{{% if enable_thinking %}}[think]{{% endif %}}{CHATML}");
        let template = ChatTemplate::new(source, Default::default(), "test").unwrap();
        let format = ExampleFormat { tokenizer: &Tokenizer::Bytes, template: Some(&template), end_of_text: None };
        let set = ExampleSet::prepare(&path, &format, &options(200)).unwrap();
        assert_eq!(set.len(), 2);
        for i in 0..2 {
            let text: String = set.example(i).0.iter().map(|&t| t as u8 as char).collect();
            assert!(text.starts_with("[2 tools][think]<|im_start|>user"), "record {i}: {text}");
            assert_eq!(learned(&set, i), "r<|im_end|>\n");
        }
    }

    #[test]
    fn parquet_rows_are_the_same_examples_as_json_lines() {
        let dir = tempfile::tempdir().unwrap();
        let rows = [("2+2=", "4"), ("10+5=", "15"), ("a long prompt, ", "and its completion")];
        let parquet = dir.path().join("d.parquet");
        write_parquet(&parquet, &rows);
        let jsonl = dir.path().join("d.jsonl");
        let lines: Vec<String> =
            rows.iter().map(|(p, c)| serde_json::json!({"prompt": p, "completion": c}).to_string()).collect();
        std::fs::write(&jsonl, lines.join("\n")).unwrap();
        let format = ExampleFormat { tokenizer: &Tokenizer::Bytes, template: None, end_of_text: None };
        let (a, b) = (
            ExampleSet::prepare(&parquet, &format, &options(100)).unwrap(),
            ExampleSet::prepare(&jsonl, &format, &options(100)).unwrap(),
        );
        assert_eq!(a.len(), 3);
        assert_eq!((&a.ids, &a.learned, &a.starts), (&b.ids, &b.learned, &b.starts));
        assert_eq!(learned(&a, 2), "and its completion");
        // A row without the fields is named by its number.
        let bad = dir.path().join("bad.parquet");
        let schema = "message m { REQUIRED BYTE_ARRAY question (UTF8); }";
        let schema = std::sync::Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
        let mut writer = parquet::file::writer::SerializedFileWriter::new(
            std::fs::File::create(&bad).unwrap(),
            schema,
            Default::default(),
        )
        .unwrap();
        let mut group = writer.next_row_group().unwrap();
        let mut col = group.next_column().unwrap().unwrap();
        col.typed::<parquet::data_type::ByteArrayType>().write_batch(&["x".into()], None, None).unwrap();
        col.close().unwrap();
        group.close().unwrap();
        writer.close().unwrap();
        let err = ExampleSet::prepare(&bad, &format, &options(100)).unwrap_err().to_string();
        assert!(err.contains("bad.parquet: row 1: a record needs"), "{err}");
    }

    #[test]
    fn the_cache_returns_what_was_prepared_and_a_damaged_entry_is_prepared_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, "{\"text\": \"abc\"}\n{\"prompt\": \"p\", \"completion\": \"q\"}").unwrap();
        let format = ExampleFormat { tokenizer: &Tokenizer::Bytes, template: None, end_of_text: None };
        let cache = dir.path().join("cache");
        let first = ExampleSet::load(&path, &format, &options(100), Some(&cache)).unwrap();
        let again = ExampleSet::load(&path, &format, &options(100), Some(&cache)).unwrap();
        assert!(!first.cached && again.cached);
        assert_eq!(
            (&first.ids, &first.learned, &first.starts, &first.report),
            (&again.ids, &again.learned, &again.starts, &again.report)
        );
        // Other options are another entry.
        assert!(!ExampleSet::load(&path, &format, &options(2), Some(&cache)).unwrap().cached);
        // A truncated entry is prepared again, not trusted.
        for entry in std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "examples"))
        {
            let bytes = std::fs::read(&entry).unwrap();
            std::fs::write(&entry, &bytes[..bytes.len() - 3]).unwrap();
        }
        let rebuilt = ExampleSet::load(&path, &format, &options(100), Some(&cache)).unwrap();
        assert!(!rebuilt.cached);
        assert_eq!(rebuilt.ids, first.ids);
    }

    #[test]
    fn each_record_form_learns_what_it_should() {
        let set = prepare(
            &[
                r#"{"text": "plain"}"#,
                r#"{"prompt": "2+2=", "completion": "4"}"#,
                r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#,
            ],
            &options(100),
        )
        .unwrap();
        assert_eq!(set.len(), 3);
        assert_eq!(learned(&set, 0), "plain#");
        assert_eq!(learned(&set, 1), "4#");
        assert_eq!(learned(&set, 2), "yo<|im_end|>\n");
        let all = prepare(
            &[r#"{"prompt": "2+2=", "completion": "4"}"#],
            &ExampleOptions { train_on_prompt: true, ..options(100) },
        )
        .unwrap();
        assert_eq!(learned(&all, 0), "2+2=4#");
    }
}
