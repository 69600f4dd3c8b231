//! Every strategy end to end on several ranks: compute methods, offload, ZeRO, tensor and
//! pipeline parallelism, and the search.

mod auto;
#[path = "../common/mod.rs"]
mod common;
mod methods;
mod offload;
mod pipeline;
mod tensor;
mod zero;
