//! Every strategy end to end on several ranks: compute methods, offload, ZeRO, tensor and
//! pipeline parallelism, and the search.

#[path = "../common/mod.rs"]
mod common;
mod methods;
mod offload;
mod zero;
mod tensor;
mod pipeline;
mod auto;
