//! Strata trains neural networks by keeping the model definition apart from how it is
//! executed. A model is an ordered list of units declared through a [`model::Builder`];
//! the [`engine::Engine`] owns their storage and runs them unit by unit; the
//! [`optim::Optimizer`] updates the engine's flat buffers with fused kernels; [`data`]
//! produces batches; [`io`] reads and writes safetensors weights and Hugging Face model
//! folders; [`generate`] continues text from a trained model.
//!
//! Data flows one way: model spec → engine → training loop.
//!
//! ```no_run
//! use strata::{data, engine, model, optim, train};
//! # fn main() -> strata::Result<()> {
//! let cfg = model::GptConfig::new(256, 64, 2, 4, 128);
//! let mut b = model::Builder::new();
//! model::gpt(&cfg, &mut b)?;
//! let mut engine = engine::Engine::new(b.build()?, engine::EngineConfig::default())?;
//! let optimizer = optim::Optimizer::new(&mut engine, optim::OptimizerConfig::default(), &[])?;
//! let mut trainer = train::Trainer::new(engine, optimizer, optim::Schedule::Constant, Some(1.0));
//! let corpus = std::sync::Arc::new(data::SyntheticCorpus::default().generate());
//! let loader = data::DataLoader::new(corpus, data::LoaderConfig::new(64, 16), data::Order::Shuffled)?;
//! for step in loader.take(100) {
//!     let report = trainer.train_step(&step?)?;
//!     println!("step {} loss {:.4}", report.step, report.loss);
//! }
//! # Ok(()) }
//! ```

pub mod auto;
pub mod checkpoint;
pub mod comm;
pub mod compute;
pub mod data;
pub mod engine;
mod error;
mod fault;
pub mod generate;
pub mod io;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod patrickstar;
pub mod profile;
pub mod strategy;
pub mod train;

pub use error::{Error, Result};
