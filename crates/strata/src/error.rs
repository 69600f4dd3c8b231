//! The library's one error type. Every fallible public function returns [`Result`].
//!
//! Owns the kinds of failure, their messages and the conversions from libtorch's and the
//! extension's errors. Must not decide what a failure means for a run: callers stop, skip or
//! report (the CLI prints one line).
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("libtorch: {0}")]
    Torch(String),
    #[error("libtorch extension: {0}")]
    Ext(#[from] strata_ext::ExtError),
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("model: {0}")]
    Model(String),
    #[error("{path}: {message}")]
    Weights { path: PathBuf, message: String },
    #[error("data: {0}")]
    Data(String),
    #[error("out of memory on {placement}: {requested} bytes requested, {in_use} of {budget} in use")]
    OutOfMemory { placement: String, requested: u64, in_use: u64, budget: u64 },
    /// A checkpoint that cannot be read, does not fit the run, or could not be saved.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("engine: {0}")]
    Engine(String),
    #[error("communication: {0}")]
    Comm(String),
    #[error("drawing: {0}")]
    Plot(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// An error as the text that crosses libtorch's autograd (Rust autograd functions fail
/// with a message, raised there as an exception).
pub(crate) fn text(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Error {
        Error::Io { path: path.into(), error }
    }
}

impl From<tch::TchError> for Error {
    /// Keeps libtorch's message and drops the C++ backtrace it appends.
    fn from(e: tch::TchError) -> Error {
        let text = match e {
            tch::TchError::Torch(m) => m,
            other => other.to_string(),
        };
        let first = text.split("\nException raised from").next().unwrap_or(&text);
        Error::Torch(first.trim().to_string())
    }
}
