//! Fine-tuning end to end: data formats, Hugging Face folders against `transformers`,
//! encoder-decoders, preference optimisation against TRL.

#[path = "../common/mod.rs"]
mod common;
mod finetune;
mod grpo;
mod hf;
#[path = "../../../strata/tests/common/hf_reference.rs"]
mod hf_reference;
mod preference;
mod reward;
mod seq2seq;
mod walkthroughs;

/// Two ranks splitting each unit Megatron-style.
const TENSOR: &str = r#"[["parallel_mode", [[["tensor", 2]], null]], "tensor_parallel"]"#;
/// The same, the activations between split regions split along the sequence too.
const TENSOR_AND_SEQUENCE: &str =
    r#"[["parallel_mode", [[["tensor", 2]], null]], ["tensor_parallel", {"sequence_parallel": true}]]"#;
