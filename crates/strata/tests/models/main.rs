//! Model families and adapters against `transformers` and `peft`, and classifiers and encoders
//! through the library's run.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/hf_reference.rs"]
mod hf_reference;
mod hf;
mod lora;
mod classify;
mod encoder;
