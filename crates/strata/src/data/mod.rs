//! Tokens in, batches out.
//!
//! Owns: tokenizers (bytes, or a Hugging Face `tokenizer.json`), token datasets (a text file,
//! a memory-mapped token file of `u16` or `u32` ids, or the embedded synthetic corpus),
//! example datasets (instruction and chat records rendered through chat templates, with the
//! tokens the loss learns flagged), the streaming, parallel tokenization of text into token
//! files, and the data loader (seeded shuffling, a global batch split into micro-batches for
//! gradient accumulation and across ranks, each micro-batch's share of the learned tokens,
//! background prefetch, or an exact replay of given offsets).
//! Must not touch models or the engine: a batch is plain token tensors (with, for packed
//! rows, the [`crate::model::RowLayout`] units read).

pub mod chat;
mod classify;
mod loader;
mod masked;
mod preference;
mod prompts;
pub mod records;
mod seq2seq;
mod synthetic;
mod tokenize;

pub use crate::model::layers::IGNORE;

/// The records `datasets`' `map` hands a batched function at once (its default batch size):
/// TRL packs and unpairs within runs of this many records, and so does Strata.
pub const DATASETS_MAP_BATCH: usize = 1000;
pub use classify::{predictions, read_labeled, scores, ClassifySet, LabeledText, Scores};
pub use loader::{
    best_fit_rows, validation_steps, Batch, BatchOffsets, Batching, DataLoader, LoaderConfig, Order, PackStrategy,
    RolloutScores, Step,
};
pub use masked::{MaskOptions, MaskedSet};
pub use preference::{PreferenceFormat, PreferencePair, PreferenceReport, PreferenceSet, StoredReference, StoredSet};
pub use prompts::{PromptFormat, PromptReport, PromptSet};
pub use records::{ExampleFormat, ExampleOptions, ExampleReport, ExampleSet};
pub use seq2seq::{read_source_target, rouge_l, Seq2SeqSet, SourceTarget};
pub use synthetic::SyntheticCorpus;
pub use tokenize::{tokenize_files, TokenizeOptions, TokenizeReport};

use crate::{Error, Result};
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// Turns text into token ids.
pub enum Tokenizer {
    /// One token per byte (vocabulary 256).
    Bytes,
    /// A Hugging Face tokenizer, loaded from a `tokenizer.json`.
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`, without the truncation and padding it may carry
    /// (`transformers` switches them off for every call it does not ask them of: the loader
    /// cuts and pads rows itself).
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let unusable =
            |e: tokenizers::Error| Error::Data(format!("{}: not a usable tokenizer.json: {e}", path.display()));
        let mut t = tokenizers::Tokenizer::from_file(path).map_err(unusable)?;
        t.with_truncation(None).map_err(unusable)?;
        t.with_padding(None);
        Ok(Tokenizer::HuggingFace(Box::new(t)))
    }

    /// `ids` as text without the tokenizer's special tokens (`</s>`, `<pad>`, `[CLS]`): what a
    /// metric over written text reads, as `transformers`' `skip_special_tokens` decodes.
    pub fn decode_text(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Bytes => self.decode(ids),
            Tokenizer::HuggingFace(t) => t.decode(ids, true).map_err(|e| Error::Data(format!("tokenizer failed: {e}"))),
        }
    }

    /// The text of token `id` where it is one of the tokenizer's special added tokens (such
    /// as GPT-2's `<|endoftext|>`): what a text spells it as.
    pub fn special_token_text(&self, id: u32) -> Option<String> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::HuggingFace(t) => {
                t.get_added_tokens_decoder().get(&id).filter(|token| token.special).map(|token| token.content.clone())
            }
        }
    }

    /// The id of `token` in the vocabulary, where it is one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::HuggingFace(t) => t.token_to_id(token),
        }
    }

    /// Ids in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::HuggingFace(t) => t.get_vocab_size(true),
        }
    }

    /// Encodes `text` without adding the tokenizer's special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::HuggingFace(t) => {
                Ok(t.encode(text, false).map_err(|e| Error::Data(format!("tokenizer failed: {e}")))?.get_ids().to_vec())
            }
        }
    }

    /// Encodes several texts at once, spread over the cores (the byte tokenizer needs no
    /// spreading).
    pub fn encode_batch(&self, texts: Vec<String>) -> Result<Vec<Vec<u32>>> {
        match self {
            Tokenizer::Bytes => texts.iter().map(|t| self.encode(t)).collect(),
            Tokenizer::HuggingFace(t) => Ok(t
                .encode_batch(texts, false)
                .map_err(|e| Error::Data(format!("tokenizer failed: {e}")))?
                .into_iter()
                .map(|e| e.get_ids().to_vec())
                .collect()),
        }
    }

    /// Encodes `texts` (with the tokenizer's own special tokens where `special` says, as
    /// `transformers`' `add_special_tokens`), each id with the byte offset in its text where
    /// the token starts.
    pub fn encode_with_starts(&self, texts: Vec<String>, special: bool) -> Result<Vec<(Vec<u32>, Vec<usize>)>> {
        match self {
            Tokenizer::Bytes => {
                Ok(texts.iter().map(|t| (t.bytes().map(u32::from).collect(), (0..t.len()).collect())).collect())
            }
            Tokenizer::HuggingFace(t) => Ok(t
                .encode_batch(texts, special)
                .map_err(|e| Error::Data(format!("tokenizer failed: {e}")))?
                .into_iter()
                .map(|e| (e.get_ids().to_vec(), e.get_offsets().iter().map(|o| o.0).collect()))
                .collect()),
        }
    }

    /// Encodes texts, each alone or with a second text (a sentence pair), as a model of the
    /// tokenizer reads them: with the tokenizer's special tokens (`[CLS] a [SEP] b [SEP]`
    /// for BERT's) and each id's token type (0 in the first text, 1 in the second), cut to
    /// `max_length` ids by taking from the longer text first. The byte tokenizer has no
    /// special tokens.
    pub fn encode_pairs(&self, texts: &[(&str, Option<&str>)], max_length: usize) -> Result<Vec<(Vec<u32>, Vec<u32>)>> {
        match self {
            Tokenizer::Bytes => Ok(texts
                .iter()
                .map(|(a, b)| {
                    let (mut a, mut b) = (a.as_bytes(), b.map_or(&[][..], str::as_bytes));
                    while a.len() + b.len() > max_length {
                        if a.len() > b.len() {
                            a = &a[..a.len() - 1];
                        } else {
                            b = &b[..b.len() - 1];
                        }
                    }
                    let ids = a.iter().chain(b).map(|&c| u32::from(c)).collect();
                    (ids, [vec![0; a.len()], vec![1; b.len()]].concat())
                })
                .collect()),
            Tokenizer::HuggingFace(t) => {
                let mut cut = t.as_ref().clone();
                let params = tokenizers::TruncationParams { max_length, ..Default::default() };
                let failed = |e: tokenizers::Error| Error::Data(format!("tokenizer failed: {e}"));
                cut.with_truncation(Some(params)).map_err(failed)?;
                // Rows are padded by the batch (the layout keeps padding apart), never here.
                cut.with_padding(None);
                texts
                    .iter()
                    .map(|&(a, b)| {
                        let encoded = match b {
                            Some(b) => cut.encode((a, b), true),
                            None => cut.encode(a, true),
                        }
                        .map_err(failed)?;
                        Ok((encoded.get_ids().to_vec(), encoded.get_type_ids().to_vec()))
                    })
                    .collect()
            }
        }
    }

    /// A text that differs between tokenizers that encode differently (for cache keys).
    pub fn fingerprint(&self) -> Result<String> {
        match self {
            Tokenizer::Bytes => Ok("bytes".into()),
            Tokenizer::HuggingFace(t) => serde_json::to_string(t.as_ref())
                .map_err(|e| Error::Data(format!("tokenizer cannot be described: {e}"))),
        }
    }

    /// `ids` as text, special tokens included; the byte tokenizer refuses an id above 255.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Bytes => {
                let bytes = ids.iter().map(|&i| {
                    u8::try_from(i).map_err(|_| {
                        Error::Data(format!("token {i} is no byte: these ids need the tokenizer that made them"))
                    })
                });
                Ok(String::from_utf8_lossy(&bytes.collect::<Result<Vec<u8>>>()?).into_owned())
            }
            Tokenizer::HuggingFace(t) => {
                t.decode(ids, false).map_err(|e| Error::Data(format!("tokenizer failed: {e}")))
            }
        }
    }
}

/// What a run trains on: a stream of tokens cut into windows (pretraining), or examples
/// each in a row of its own with only their learned tokens as targets (fine-tuning).
#[derive(Clone, Debug)]
pub enum Dataset {
    /// A stream of tokens cut into windows (pretraining).
    Tokens(TokenData),
    /// Examples each in a row of their own, only their learned tokens as targets (fine-tuning).
    Examples(ExampleSet),
    /// Texts (or text pairs) each with a label, a row each (classification).
    Labeled(ClassifySet),
    /// Sources each with its target, a row each (an encoder–decoder's task).
    SourceTarget(Seq2SeqSet),
    /// Rows of text with tokens masked for prediction (masked-language pretraining).
    Masked(MaskedSet),
    /// Prompts each with a chosen and a rejected completion, two rows a pair (preference
    /// optimisation).
    Preference(PreferenceSet),
    /// Prompts alone, each completed by the model as it trains (GRPO).
    Prompts(PromptSet),
}

/// Records batched a record a row, each batch padded to its longest record (labeled texts,
/// source–target pairs): the loader takes its rows' indices and the set builds the batch.
pub trait RowSet {
    /// Records held.
    fn len(&self) -> usize;
    /// Whether no record is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the records came from, for messages.
    fn source(&self) -> &str;
    /// Tokens of every record.
    fn tokens(&self) -> usize;
    /// The most positions of one row.
    fn longest(&self) -> usize;
    /// The largest token id plus one.
    fn vocab_needed(&self) -> u32;
    /// The targets record `row` supervises.
    fn supervised(&self, row: usize) -> u64;
    /// Records `rows` as one batch on the host.
    fn batch(&self, rows: &[usize]) -> Result<Batch>;
}

/// Refuses a row index past a set of `len` records.
fn check_indices(rows: &[usize], len: usize) -> Result<()> {
    match rows.iter().find(|&&r| r >= len) {
        Some(bad) => Err(Error::Data(format!("record {bad} of {len}"))),
        None => Ok(()),
    }
}

impl From<ClassifySet> for Dataset {
    fn from(data: ClassifySet) -> Dataset {
        Dataset::Labeled(data)
    }
}

impl From<MaskedSet> for Dataset {
    fn from(data: MaskedSet) -> Dataset {
        Dataset::Masked(data)
    }
}

impl From<Seq2SeqSet> for Dataset {
    fn from(data: Seq2SeqSet) -> Dataset {
        Dataset::SourceTarget(data)
    }
}

impl From<PreferenceSet> for Dataset {
    fn from(data: PreferenceSet) -> Dataset {
        Dataset::Preference(data)
    }
}

impl From<PromptSet> for Dataset {
    fn from(data: PromptSet) -> Dataset {
        Dataset::Prompts(data)
    }
}

impl From<TokenData> for Dataset {
    fn from(data: TokenData) -> Dataset {
        Dataset::Tokens(data)
    }
}

impl From<ExampleSet> for Dataset {
    fn from(data: ExampleSet) -> Dataset {
        Dataset::Examples(data)
    }
}

impl Dataset {
    /// The records batched a record a row, where the data is such a set.
    pub fn row_set(&self) -> Option<&dyn RowSet> {
        match self {
            Dataset::Labeled(l) => Some(l),
            Dataset::SourceTarget(s) => Some(s),
            Dataset::Masked(m) => Some(m),
            Dataset::Preference(p) => Some(p),
            Dataset::Prompts(p) => Some(p),
            Dataset::Tokens(_) | Dataset::Examples(_) => None,
        }
    }

    /// Where the data came from, for messages.
    pub fn source(&self) -> &str {
        match self {
            Dataset::Tokens(t) => &t.source,
            Dataset::Examples(e) => &e.source,
            Dataset::Labeled(_)
            | Dataset::SourceTarget(_)
            | Dataset::Masked(_)
            | Dataset::Preference(_)
            | Dataset::Prompts(_) => self.row_set().map_or("", |r| r.source()),
        }
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        match (self, self.row_set()) {
            (_, Some(rows)) => rows.tokens(),
            (Dataset::Tokens(t), None) => t.len(),
            (Dataset::Examples(e), None) => e.report.tokens as usize,
            (_, None) => 0,
        }
    }

    /// The largest token id plus one.
    pub fn vocab_needed(&self) -> u32 {
        match (self, self.row_set()) {
            (_, Some(rows)) => rows.vocab_needed(),
            (Dataset::Tokens(t), None) => t.vocab_needed(),
            (Dataset::Examples(e), None) => e.vocab_needed(),
            (_, None) => 0,
        }
    }

    /// Checks that every text's token types are below `types` (labeled texts carry them;
    /// other data has none).
    pub fn check_token_types(&self, types: i64) -> Result<()> {
        match self {
            Dataset::Labeled(l) => l.check_token_types(types),
            _ => Ok(()),
        }
    }

    /// Checks that rows of `ctx` positions can be cut (windows, or the longest example fits
    /// in one) and that every id is below `vocab`.
    pub fn check_fits(&self, ctx: usize, vocab: usize) -> Result<()> {
        match self {
            Dataset::Tokens(t) => t.check_fits(ctx, vocab),
            Dataset::Examples(e) => {
                let hint = ": give a --max-length within it";
                check_rows(&e.source, ("an example", e.longest()), ctx, hint)?;
                check_vocab(&e.source, e.vocab_needed(), vocab)
            }
            Dataset::Labeled(l) => {
                check_rows(&l.source, ("a text", l.longest()), ctx, "")?;
                check_vocab(&l.source, l.vocab_needed(), vocab)
            }
            // The context bounds a source and a target each.
            Dataset::SourceTarget(s) => {
                check_rows(&s.source, ("a source or target", s.longest_part()), ctx, "")?;
                check_vocab(&s.source, s.vocab_needed(), vocab)
            }
            Dataset::Masked(m) => {
                check_rows(&m.source, ("a row", m.longest()), ctx, "")?;
                check_vocab(&m.source, m.vocab_needed(), vocab)
            }
            Dataset::Preference(p) => {
                check_rows(&p.source, ("a prompt with a completion", p.longest()), ctx, "")?;
                check_vocab(&p.source, p.vocab_needed(), vocab)
            }
            Dataset::Prompts(p) => {
                check_rows(&p.source, ("a prompt", p.longest()), ctx, "")?;
                check_vocab(&p.source, p.vocab_needed(), vocab)
            }
        }
    }
}

/// Refuses data whose longest row (`what`, of `longest` tokens) does not fit `ctx`.
fn check_rows(source: &str, (what, longest): (&str, usize), ctx: usize, hint: &str) -> Result<()> {
    if longest > ctx {
        return Err(Error::Data(format!(
            "{source} holds {what} of {longest} tokens, longer than the context of {ctx}{hint}"
        )));
    }
    Ok(())
}

/// How many bytes a token file spends on each id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenWidth {
    /// Ids below 65,536 (GPT-2's vocabulary, nanoGPT's `.bin` files).
    U16,
    /// Any id of today's vocabularies (Llama 3's 128,256, Qwen's 151,936, Gemma's 262,144).
    U32,
}

impl TokenWidth {
    /// Bytes per id.
    pub fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }

    /// The largest vocabulary whose ids this width holds.
    pub fn largest_vocab(self) -> u64 {
        match self {
            TokenWidth::U16 => 1 << 16,
            TokenWidth::U32 => 1 << 32,
        }
    }

    /// The narrowest width that holds every id of a vocabulary of `vocab`.
    pub fn for_vocab(vocab: u64) -> TokenWidth {
        if vocab <= TokenWidth::U16.largest_vocab() {
            TokenWidth::U16
        } else {
            TokenWidth::U32
        }
    }

    /// The width's name as written in configurations and messages (`u16`, `u32`).
    pub fn name(self) -> &'static str {
        match self {
            TokenWidth::U16 => "u16",
            TokenWidth::U32 => "u32",
        }
    }
}

impl std::str::FromStr for TokenWidth {
    type Err = Error;
    fn from_str(s: &str) -> Result<TokenWidth> {
        match s {
            "u16" => Ok(TokenWidth::U16),
            "u32" => Ok(TokenWidth::U32),
            other => Err(Error::Config(format!("token width {other:?}: give u16 or u32"))),
        }
    }
}

/// The first bytes of a token file that says its own width: this magic, then the width in
/// bytes and a format version, each a little-endian `u32`. Files without it are raw ids.
const TOKEN_FILE_MAGIC: &[u8; 8] = b"STRATOKS";
const TOKEN_FILE_HEADER: usize = 16;
const TOKEN_FILE_VERSION: u32 = 1;

/// The ids of a token dataset: in memory, or in a memory-mapped file that every process
/// reading it shares through the page cache (a corpus larger than memory trains; ranks on
/// one host hold one copy).
#[derive(Clone, Debug)]
enum Ids {
    Owned(Vec<u32>),
    Mapped {
        map: Arc<memmap2::Mmap>,
        start: usize,
        width: TokenWidth,
    },
    /// A token file of no ids (nothing to map), of the width it was read at.
    EmptyFile(TokenWidth),
}

/// A stream of token ids to cut training windows from.
#[derive(Clone, Debug)]
pub struct TokenData {
    ids: Ids,
    /// The largest id plus one, found on first use (a scan of the whole file).
    vocab_needed: OnceLock<u32>,
    /// Where the tokens came from, for messages.
    pub source: String,
}

impl TokenData {
    /// A stream of `tokens` held in memory, `source` naming it in messages.
    pub fn new(tokens: Vec<u32>, source: impl Into<String>) -> TokenData {
        TokenData { ids: Ids::Owned(tokens), vocab_needed: OnceLock::new(), source: source.into() }
    }

    /// Tokenises a UTF-8 text file.
    pub fn from_text_file(path: &Path, tokenizer: &Tokenizer) -> Result<TokenData> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Ok(TokenData::new(tokenizer.encode(&text)?, path.display().to_string()))
    }

    /// Maps a token file: one that starts with Strata's header says its width (and `width`,
    /// when given, must agree); a raw file of little-endian ids is read at `width` (`u16`,
    /// nanoGPT's `.bin`, unless given).
    pub fn open(path: &Path, width: Option<TokenWidth>) -> Result<TokenData> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let bad = |why: String| Error::Data(format!("{}: {why}", path.display()));
        let size = file.metadata().map_err(|e| Error::io(path, e))?.len() as usize;
        let map = if size == 0 {
            None
        } else {
            // SAFETY: the map is read only; a file changed under a running job is the caller's
            // to avoid, as with any input (the ids read are then what the file holds).
            Some(unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?)
        };
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let (start, width) = match bytes.strip_prefix(TOKEN_FILE_MAGIC.as_slice()) {
            Some(rest) if rest.len() >= TOKEN_FILE_HEADER - TOKEN_FILE_MAGIC.len() => {
                let word = |at: usize| u32::from_le_bytes([rest[at], rest[at + 1], rest[at + 2], rest[at + 3]]);
                let said = match (word(0), word(4)) {
                    (2, TOKEN_FILE_VERSION) => TokenWidth::U16,
                    (4, TOKEN_FILE_VERSION) => TokenWidth::U32,
                    (w, v) => {
                        return Err(bad(format!(
                            "a token file header of width {w} and version {v} is not one Strata writes"
                        )))
                    }
                };
                if let Some(asked) = width.filter(|&w| w != said) {
                    return Err(bad(format!(
                        "holds {} ids (its header says so) but {} ids were asked for",
                        said.name(),
                        asked.name()
                    )));
                }
                (TOKEN_FILE_HEADER, said)
            }
            Some(_) => return Err(bad("ends inside its header".into())),
            None => (0, width.unwrap_or(TokenWidth::U16)),
        };
        let body = size - start;
        if !body.is_multiple_of(width.bytes()) {
            return Err(bad(format!("{body} bytes is not a whole number of {} tokens", width.name())));
        }
        let ids = match map {
            Some(map) => Ids::Mapped { map: Arc::new(map), start, width },
            None => Ids::EmptyFile(width),
        };
        Ok(TokenData { ids, vocab_needed: OnceLock::new(), source: path.display().to_string() })
    }

    /// Writes the ids as a raw little-endian `u16` file (nanoGPT's `.bin`; fails if an id
    /// does not fit).
    pub fn write_u16_file(&self, path: &Path) -> Result<()> {
        crate::files::write_atomic(path, &self.encode(TokenWidth::U16, false)?)
    }

    /// Writes the ids at `width` behind the header that names it.
    pub fn write_token_file(&self, path: &Path, width: TokenWidth) -> Result<()> {
        crate::files::write_atomic(path, &self.encode(width, true)?)
    }

    /// The file bytes of the ids at `width`, behind the header where `header` says.
    fn encode(&self, width: TokenWidth, header: bool) -> Result<Vec<u8>> {
        let mut bytes = Vec::with_capacity(TOKEN_FILE_HEADER + self.len() * width.bytes());
        if header {
            bytes.extend_from_slice(&token_file_header(width));
        }
        for id in self.ids(0, self.len()) {
            push_id(&mut bytes, id, width)?;
        }
        Ok(bytes)
    }

    /// Ids in the stream.
    pub fn len(&self) -> usize {
        match &self.ids {
            Ids::Owned(ids) => ids.len(),
            Ids::Mapped { map, start, width } => (map.len() - start) / width.bytes(),
            Ids::EmptyFile(_) => 0,
        }
    }

    /// Whether the stream holds no id.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The width of the file the ids are read from (`None` for ids in memory).
    pub fn width(&self) -> Option<TokenWidth> {
        match &self.ids {
            Ids::Owned(_) => None,
            Ids::Mapped { width, .. } | Ids::EmptyFile(width) => Some(*width),
        }
    }

    /// Ids `first .. first + count` (within [`TokenData::len`]), decoded as they are read.
    fn ids(&self, first: usize, count: usize) -> Box<dyn Iterator<Item = u32> + '_> {
        match &self.ids {
            Ids::Owned(ids) => Box::new(ids[first..first + count].iter().copied()),
            Ids::EmptyFile(_) => Box::new(std::iter::empty()),
            Ids::Mapped { map, start, width } => {
                let bytes = &map[start + first * width.bytes()..start + (first + count) * width.bytes()];
                match width {
                    TokenWidth::U16 => {
                        Box::new(bytes.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))))
                    }
                    TokenWidth::U32 => {
                        Box::new(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    }
                }
            }
        }
    }

    /// Id `i` (below [`TokenData::len`]).
    pub fn get(&self, i: usize) -> u32 {
        self.ids(i, 1).next().unwrap_or_default()
    }

    /// Appends ids `start .. start + count` to `out`.
    pub fn extend_window(&self, out: &mut Vec<i64>, start: usize, count: usize) {
        out.extend(self.ids(start, count).map(i64::from));
    }

    /// Every id, copied.
    pub fn to_vec(&self) -> Vec<u32> {
        self.ids(0, self.len()).collect()
    }

    /// The largest token id plus one.
    pub fn vocab_needed(&self) -> u32 {
        *self.vocab_needed.get_or_init(|| self.ids(0, self.len()).max().map_or(0, |m| m + 1))
    }

    /// Checks that windows of `ctx` inputs (plus one target) fit.
    pub fn check_length(&self, ctx: usize) -> Result<()> {
        if self.len() < ctx + 1 {
            return Err(Error::Data(format!(
                "{} has {} tokens, fewer than the {} a context of {ctx} needs",
                self.source,
                self.len(),
                ctx + 1
            )));
        }
        Ok(())
    }

    /// Checks that windows of `ctx` fit, that the file's width can hold a vocabulary of
    /// `vocab` (a `u16` file cannot carry ids past 65,535: a model that has them was given
    /// ids cut short) and that every id is below `vocab`.
    pub fn check_fits(&self, ctx: usize, vocab: usize) -> Result<()> {
        self.check_length(ctx)?;
        if let Some(width) = self.width().filter(|w| vocab as u64 > w.largest_vocab()) {
            return Err(Error::Data(format!(
                "{} holds {} ids, too narrow for the model's vocabulary of {vocab}: tokenize it as u32 (strata tokenize --width u32)",
                self.source,
                width.name()
            )));
        }
        check_vocab(&self.source, self.vocab_needed(), vocab)
    }
}

/// Refuses data from `source` whose ids need a vocabulary of `needed` where the model has
/// `vocab`.
fn check_vocab(source: &str, needed: u32, vocab: usize) -> Result<()> {
    if needed as usize > vocab {
        return Err(Error::Data(format!(
            "{source} holds token id {} but the model's vocabulary is {vocab}",
            needed - 1
        )));
    }
    Ok(())
}

/// The header of a token file of `width`.
pub(crate) fn token_file_header(width: TokenWidth) -> [u8; TOKEN_FILE_HEADER] {
    let mut header = [0u8; TOKEN_FILE_HEADER];
    header[..8].copy_from_slice(TOKEN_FILE_MAGIC);
    header[8..12].copy_from_slice(&(width.bytes() as u32).to_le_bytes());
    header[12..].copy_from_slice(&TOKEN_FILE_VERSION.to_le_bytes());
    header
}

/// Appends `id` at `width`, little-endian; an id the width cannot hold is an error.
pub(crate) fn push_id(out: &mut Vec<u8>, id: u32, width: TokenWidth) -> Result<()> {
    match width {
        TokenWidth::U16 => {
            let id = u16::try_from(id).map_err(|_| Error::Data(format!("token id {id} does not fit in u16")))?;
            out.extend_from_slice(&id.to_le_bytes());
        }
        TokenWidth::U32 => out.extend_from_slice(&id.to_le_bytes()),
    }
    Ok(())
}
