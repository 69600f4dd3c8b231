//! Strata trains neural networks by keeping the model definition apart from how it is
//! executed. A model is an ordered list of units declared through a [`model::Builder`]; a
//! [`strategy::Strategy`] says how to train it; [`parallel`] turns the two into an
//! [`engine::Engine`] that owns their storage and runs them unit by unit; the
//! [`train::Trainer`] drives the engine and the [`optim::Optimizer`] step by step.
//!
//! Data flows one way: model spec → strategy → engine → training loop. The modules, from
//! the ground up:
//! - [`comm`]: process groups, their collectives and backends, rendezvous;
//! - [`compute`]: per-unit compute methods (mixed precision, fp8, replaced modules,
//!   recomputation) and the loss scaler;
//! - [`model`]: parameter specifications, units and the reference models;
//! - [`engine`]: parameter storage, placement, the memory ledger and unit-by-unit execution;
//! - [`optim`]: optimizers over the engine's flat buffers, clipping and learning-rate
//!   schedules;
//! - [`io`]: safetensors weights and Hugging Face model folders;
//! - [`data`]: tokenizers, token datasets and the data loader;
//! - [`checkpoint`]: sharded training checkpoints, exact resume and merging;
//! - [`train`]: one optimizer step over a step's micro-batches;
//! - [`generate`]: text continued from a trained model;
//! - [`strategy`]: typed, serialisable strategies and their validation;
//! - [`parallel`]: data, ZeRO, tensor and pipeline parallelism as engine schedules;
//! - [`auto`]: `auto_accelerate` and the strategy search;
//! - [`patrickstar`]: PatrickStar's `initialize_engine` face;
//! - [`preference`]: DPO and its family of losses over preference pairs, with TRL's metrics;
//! - [`reward`]: reward models' Bradley–Terry loss over preference pairs, with TRL's metrics;
//! - [`profile`]: recorded profiles, Chrome traces, summaries and plots;
//! - [`run`]: a whole training run as `strata train` does it, with its outputs.
//!
//! This root only declares the modules and re-exports [`Error`] and [`Result`]; it holds no
//! logic of its own.
//!
//! ```no_run
//! use strata::{data, engine, model, optim, train};
//! # fn main() -> strata::Result<()> {
//! let cfg = model::GptConfig::new(256, 64, 2, 4, 128);
//! let mut b = model::Builder::new();
//! model::gpt(&cfg, &mut b)?;
//! let mut engine = engine::Engine::new(b.build()?, engine::EngineConfig::default())?;
//! let optimizer = optim::Optimizer::new(&mut engine, optim::OptimizerConfig::default(), &[])?;
//! let mut trainer = train::Trainer::new(engine, optimizer, optim::LrSchedule::Constant, Some(1.0));
//! let corpus = std::sync::Arc::new(data::SyntheticCorpus::default().generate().into());
//! let loader = data::DataLoader::new(corpus, data::LoaderConfig::new(data::Batching::new(64, 16)))?;
//! for step in loader.take(100) {
//!     let report = trainer.train_step(&step?)?;
//!     println!("step {} loss {:.4}", report.step, report.loss);
//! }
//! # Ok(()) }
//! ```
// Every public item says what it is: the crate is read as a guide.
#![warn(missing_docs)]

pub mod auto;
pub mod checkpoint;
pub mod comm;
pub mod compute;
pub mod data;
pub mod engine;
mod error;
mod fault;
pub mod files;
pub mod generate;
pub mod grpo;
pub mod io;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod patrickstar;
pub mod preference;
pub mod profile;
pub mod reward;
pub mod run;
pub mod strategy;
pub mod tasks;
pub mod train;

pub use error::{Error, Result};

/// The README's and the library guide's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
#[doc = include_str!("../../../docs/library.md")]
pub struct DocumentedExamples;
