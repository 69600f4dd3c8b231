//! Byte transports between the ranks of a group: TCP sockets (any hosts) and shared-memory
//! ring buffers (one host) here, and MPI's point-to-point in `comm::mpi` (`MpiTransport`).
//! The ring collectives are written once, over [`Transport`]; a transport may run a
//! collective its own way through the `native_*` hooks instead (shm all four of them,
//! broadcast from 4 MiB; MPI its all-reduce).
//!
//! Owns point-to-point byte movement and the shm transport's collectives. Must not know
//! tensors or [`Work`](super::Work) handles: it moves and reduces bytes of a given dtype,
//! and the ring algorithms and backends above it queue the work.
//!
//! Every blocking call gives up after the group's timeout, and a peer that went away is
//! reported by rank (a closed socket, or a process that no longer exists).
mod shm;
mod tcp;

pub use shm::ShmTransport;
pub use tcp::TcpTransport;

use super::elementwise::copy_bytes;
use super::ReduceOp;
use crate::{Error, Result};
use tch::Kind;

/// A byte range of a tensor or scratch buffer that a collective hands to its transport.
/// Blocks of one collective never overlap unless they are the same block, so a shared and
/// a mutable view of two different blocks may coexist.
#[derive(Clone, Copy)]
pub struct Block {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

impl Block {
    pub(super) fn bytes<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[]; // empty tensors may have no storage at all
        }
        // SAFETY: blocks point into memory the collective keeps alive for its duration.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    #[allow(clippy::mut_from_ref)]
    pub(super) fn bytes_mut<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as above, and no other view of this block is alive while it is written.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Up to `max` bytes from offset `at` (empty past the end).
    fn piece(self, at: usize, max: usize) -> Block {
        let at = at.min(self.len);
        // SAFETY: `at` lies within the block.
        Block { ptr: unsafe { self.ptr.add(at) }, len: max.min(self.len - at) }
    }

    /// Copies this block's bytes to `dst` (at least as long), with streaming stores when
    /// `stream` (see [`copy_bytes`]).
    fn copy_to(self, dst: *mut u8, stream: bool) {
        if self.len > 0 {
            // SAFETY: callers pass a destination of at least `len` bytes that does not
            // overlap the block (a shared slot, or another tensor of the collective).
            unsafe { copy_bytes(dst, self.ptr, self.len, stream) }
        }
    }
}

/// Point-to-point byte movement between the ranks of one group.
pub trait Transport: Send {
    /// This process's rank within the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Sends `out` to rank `to` while receiving exactly `inp.len()` bytes from rank `from`
    /// (`to` and `from` may be the same rank). Either side may be empty.
    fn exchange(&mut self, to: usize, out: &[u8], from: usize, inp: &mut [u8]) -> Result<()>;

    /// Sends `out` to rank `to`.
    fn send(&mut self, to: usize, out: &[u8]) -> Result<()> {
        self.exchange(to, out, to, &mut [])
    }

    /// Whether peers can read this process's `Heap` allocations in place.
    fn shares_memory(&self) -> bool {
        false
    }

    /// An all-reduce of `buf` done natively by the transport, or `None` to use the ring.
    fn native_all_reduce(&mut self, _buf: &mut [u8], _kind: Kind, _op: ReduceOp) -> Option<Result<()>> {
        None
    }
    /// A reduce-scatter done natively: `out` receives the reduction of every rank's
    /// `inputs[rank]`, the inputs stay unchanged; `None` to use the ring.
    fn native_reduce_scatter(
        &mut self,
        _inputs: &[Block],
        _out: Block,
        _kind: Kind,
        _op: ReduceOp,
    ) -> Option<Result<()>> {
        None
    }
    /// An all-gather done natively: every rank's `input` lands in its block of `outputs`
    /// (this rank's may be the input itself); `None` to use the ring.
    fn native_all_gather(&mut self, _outputs: &[Block], _input: Block) -> Option<Result<()>> {
        None
    }
    /// A broadcast of rank `root`'s `buf` into every other rank's done natively; `None`
    /// to use the pipelined chain.
    fn native_broadcast(&mut self, _buf: &mut [u8], _root: usize) -> Option<Result<()>> {
        None
    }
    /// Receives exactly `inp.len()` bytes from rank `from`.
    fn recv(&mut self, from: usize, inp: &mut [u8]) -> Result<()> {
        self.exchange(from, &[], from, inp)
    }
}

fn peer_error(peer: usize, what: impl std::fmt::Display) -> Error {
    Error::Comm(format!("rank {peer}: {what}"))
}
