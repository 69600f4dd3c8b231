//! Tokens in, batches out.
//!
//! Owns: tokenizers (bytes, or a Hugging Face `tokenizer.json`), token datasets (a text file,
//! a raw little-endian `u16` token file, or the embedded synthetic corpus), and the data
//! loader (seeded shuffling, a global batch split into micro-batches for gradient
//! accumulation and across ranks, background prefetch, or an exact replay of given offsets).
//! Must not touch models or the engine: a batch is plain token tensors.

mod loader;
mod synthetic;

pub use loader::{validation_steps, Batch, BatchOffsets, DataLoader, LoaderConfig, Order, Step};
pub use synthetic::SyntheticCorpus;

use crate::{Error, Result};
use std::path::Path;

/// Turns text into token ids.
pub enum Tokenizer {
    /// One token per byte (vocabulary 256).
    Bytes,
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Data(format!("{}: not a usable tokenizer.json: {e}", path.display())))?;
        Ok(Tokenizer::HuggingFace(Box::new(t)))
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::HuggingFace(t) => t.get_vocab_size(true),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::HuggingFace(t) => {
                Ok(t.encode(text, false).map_err(|e| Error::Data(format!("tokenizer failed: {e}")))?.get_ids().to_vec())
            }
        }
    }

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

/// A stream of token ids to cut training windows from.
#[derive(Clone, Debug)]
pub struct TokenData {
    pub tokens: Vec<u32>,
    /// Where the tokens came from, for messages.
    pub source: String,
}

impl TokenData {
    pub fn new(tokens: Vec<u32>, source: impl Into<String>) -> TokenData {
        TokenData { tokens, source: source.into() }
    }

    /// Tokenises a UTF-8 text file.
    pub fn from_text_file(path: &Path, tokenizer: &Tokenizer) -> Result<TokenData> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Ok(TokenData::new(tokenizer.encode(&text)?, path.display().to_string()))
    }

    /// Reads a raw file of little-endian `u16` token ids (the nanoGPT `.bin` format).
    pub fn from_u16_file(path: &Path) -> Result<TokenData> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        if bytes.len() % 2 != 0 {
            return Err(Error::Data(format!(
                "{}: {} bytes is not a whole number of u16 tokens",
                path.display(),
                bytes.len()
            )));
        }
        let tokens = bytes.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))).collect();
        Ok(TokenData::new(tokens, path.display().to_string()))
    }

    /// Writes the tokens as little-endian `u16` (fails if an id does not fit).
    pub fn write_u16_file(&self, path: &Path) -> Result<()> {
        let mut bytes = Vec::with_capacity(self.tokens.len() * 2);
        for &t in &self.tokens {
            let t = u16::try_from(t).map_err(|_| Error::Data(format!("token id {t} does not fit in u16")))?;
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        crate::io::write_atomic(path, &bytes)
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The largest token id plus one.
    pub fn vocab_needed(&self) -> u32 {
        self.tokens.iter().max().map_or(0, |m| m + 1)
    }

    /// Checks that windows of `ctx` inputs (plus one target) fit and ids are below `vocab`.
    pub fn check_fits(&self, ctx: usize, vocab: usize) -> Result<()> {
        if self.tokens.len() < ctx + 1 {
            return Err(Error::Data(format!(
                "{} has {} tokens, fewer than the {} a context of {ctx} needs",
                self.source,
                self.tokens.len(),
                ctx + 1
            )));
        }
        if self.vocab_needed() as usize > vocab {
            return Err(Error::Data(format!(
                "{} holds token id {} but the model's vocabulary is {vocab}",
                self.source,
                self.vocab_needed() - 1
            )));
        }
        Ok(())
    }
}
