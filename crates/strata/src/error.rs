//! The library's one error type. Every fallible public function returns [`Result`].
//!
//! Owns the kinds of failure, their messages and the conversions from libtorch's and the
//! extension's errors. Must not decide what a failure means for a run: callers stop, skip or
//! report (the CLI prints one line).
use std::path::PathBuf;

/// Every way a call into the library can fail, each with its message.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A libtorch operation failed, with libtorch's message (its C++ backtrace dropped).
    #[error("libtorch: {0}")]
    Torch(String),
    /// Strata's libtorch extension failed.
    #[error("libtorch extension: {0}")]
    Ext(#[from] strata_ext::ExtError),
    /// A file or folder could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What the operating system said.
        error: std::io::Error,
    },
    /// A setting, or a combination of settings, that cannot be used.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A model that cannot be built or cannot run what was asked of it.
    #[error("model: {0}")]
    Model(String),
    /// A model's weights that cannot be read or do not fit the model.
    #[error("{path}: {message}")]
    Weights {
        /// The weights' file or folder.
        path: PathBuf,
        /// What is wrong with them.
        message: String,
    },
    /// A dataset, tokenizer or record that cannot be read or used.
    #[error("data: {0}")]
    Data(String),
    /// An allocation refused because it would pass the placement's budget.
    #[error("out of memory on {placement}: {requested} bytes requested, {in_use} of {budget} in use")]
    OutOfMemory {
        /// Where the bytes were asked for (`device` or `host`).
        placement: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes held there already.
        in_use: u64,
        /// Bytes the placement may hold.
        budget: u64,
    },
    /// A checkpoint that cannot be read, does not fit the run, or could not be saved.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The engine or a schedule was used in a way it cannot serve, or failed while running.
    #[error("engine: {0}")]
    Engine(String),
    /// A collective or a message between ranks failed.
    #[error("communication: {0}")]
    Comm(String),
    /// A picture that cannot be drawn or written, or a font that cannot be read.
    #[error("drawing: {0}")]
    Plot(String),
}

/// The result of every fallible call into the library.
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
