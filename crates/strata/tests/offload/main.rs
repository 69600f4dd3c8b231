//! Model states between device and host: offload's plans and PatrickStar's face.

#[path = "../common/mod.rs"]
mod common;
mod offload;
mod patrickstar;
