//! Model families and adapters against `transformers` and `peft`, and classifiers and encoders
//! through the library's run.

mod classify;
#[path = "../common/mod.rs"]
mod common;
mod encoder;
mod hf;
#[path = "../common/hf_reference.rs"]
mod hf_reference;
mod lora;
