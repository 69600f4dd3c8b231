//! Text files into one token file, streaming and in parallel: text is read in pieces cut at
//! line ends, a batch of pieces is encoded at once through the tokenizer's batch encoding
//! (which spreads the pieces over the cores), and the ids are written in order behind the
//! header that names their width. Memory holds one batch of pieces, whatever the corpus's
//! size.
//!
//! Pieces are encoded apart, so a tokenizer whose pre-tokenizer joins text across a line end
//! may cut a piece boundary differently from encoding the whole file at once; word-level,
//! whitespace-split and byte tokenizers give the same ids either way.
use super::{push_id, token_file_header, TokenWidth, Tokenizer};
use crate::{Error, Result};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How text is cut and ids are stored.
#[derive(Clone, Debug)]
pub struct TokenizeOptions {
    /// The ids' width; `None`: the narrowest that holds the tokenizer's vocabulary.
    pub width: Option<TokenWidth>,
    /// A piece ends at the first line end past this many bytes.
    pub piece_bytes: usize,
    /// Pieces encoded together (one batch over the cores).
    pub batch_pieces: usize,
}

impl Default for TokenizeOptions {
    fn default() -> Self {
        TokenizeOptions { width: None, piece_bytes: 64 << 10, batch_pieces: 64 }
    }
}

/// What a tokenization did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TokenizeReport {
    /// Text read from the inputs, in bytes.
    pub bytes: u64,
    /// Ids written.
    pub tokens: u64,
    /// The width the ids were written at.
    pub width: TokenWidth,
    /// Wall-clock time the tokenization took, in seconds.
    pub seconds: f64,
}

/// Tokenizes `inputs`, one after another, into the token file `output` (written beside it
/// and moved into place once complete, so a failure leaves no partial file). `progress`
/// hears the bytes read so far of the inputs' total.
pub fn tokenize_files(
    inputs: &[PathBuf],
    tokenizer: &Tokenizer,
    output: &Path,
    options: &TokenizeOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<TokenizeReport> {
    if options.piece_bytes == 0 || options.batch_pieces == 0 {
        return Err(Error::Config("tokenize: pieces and batches must hold something".into()));
    }
    let vocab = tokenizer.vocab_size() as u64;
    let width = options.width.unwrap_or(TokenWidth::for_vocab(vocab));
    if vocab > width.largest_vocab() {
        return Err(Error::Config(format!(
            "tokenize: the tokenizer's vocabulary of {vocab} does not fit {} ids",
            width.name()
        )));
    }
    let mut total = 0;
    for path in inputs {
        total += std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
    }
    let started = Instant::now();
    let (mut read, mut tokens) = (0u64, 0u64);
    crate::files::write_atomic_with(output, |file| {
        let mut out = std::io::BufWriter::new(file);
        let failed = |e: std::io::Error| Error::io(output, e);
        out.write_all(&token_file_header(width)).map_err(failed)?;
        for path in inputs {
            let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
            let mut pieces = Pieces { reader: BufReader::new(file), path, offset: 0, piece_bytes: options.piece_bytes };
            loop {
                let batch = pieces.next_batch(options.batch_pieces)?;
                if batch.is_empty() {
                    break;
                }
                read += batch.iter().map(|p| p.len() as u64).sum::<u64>();
                let mut bytes = Vec::new();
                for ids in tokenizer.encode_batch(batch)? {
                    tokens += ids.len() as u64;
                    for id in ids {
                        push_id(&mut bytes, id, width)?;
                    }
                }
                out.write_all(&bytes).map_err(failed)?;
                progress(read, total);
            }
        }
        out.flush().map_err(failed)
    })?;
    Ok(TokenizeReport { bytes: read, tokens, width, seconds: started.elapsed().as_secs_f64() })
}

/// A text file read as pieces that end at line ends.
struct Pieces<'a, R> {
    reader: R,
    path: &'a Path,
    /// Bytes read so far, for messages.
    offset: u64,
    piece_bytes: usize,
}

impl<R: BufRead> Pieces<'_, R> {
    /// Up to `count` pieces; none at the end of the file.
    fn next_batch(&mut self, count: usize) -> Result<Vec<String>> {
        let mut batch = Vec::with_capacity(count);
        while batch.len() < count {
            let mut piece = Vec::with_capacity(self.piece_bytes + 256);
            while piece.len() < self.piece_bytes {
                let n = self.reader.read_until(b'\n', &mut piece).map_err(|e| Error::io(self.path, e))?;
                if n == 0 {
                    break;
                }
            }
            if piece.is_empty() {
                break;
            }
            let text = String::from_utf8(piece).map_err(|e| {
                let at = self.offset + e.utf8_error().valid_up_to() as u64;
                Error::Data(format!("{}: not UTF-8 text at byte {at}", self.path.display()))
            })?;
            self.offset += text.len() as u64;
            batch.push(text);
        }
        Ok(batch)
    }
}
