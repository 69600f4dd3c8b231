//! Model states between device and host: offload's plans, the room they leave, and
//! PatrickStar's face.

#[path = "../common/mod.rs"]
mod common;
mod offload;
mod offload_room;
mod patrickstar;
