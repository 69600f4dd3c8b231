//! The shm transport's collectives: all-reduce, reduce-scatter, all-gather and broadcast
//! staged piece by piece through the arena's slots, and their direct forms, which read
//! buffers every rank holds in its [`Heap`](crate::comm::shared::Heap) in place.
//!
//! Owns the collectives' algorithms over the arena and the heaps. Must not choose between
//! the staged and the direct form or between slot stores: the [`ShmTransport`]'s `native_*`
//! hooks do, per call.
use super::{ShmTransport, SlotStores, LOCATION_BYTES, SLOT_BYTES};
use crate::comm::elementwise::{
    combine_into, copy_bytes, copy_twice, divide, reduce_into, reduce_streamed, split, streams,
};
use crate::comm::shared::Location;
use crate::comm::transport::Block;
use crate::comm::ReduceOp;
use crate::Result;
use tch::Kind;

impl ShmTransport {
    /// Where `blocks` live in this process's heap, if all of them do and peers can map it.
    pub(super) fn locate(&self, blocks: &[Block]) -> Option<Vec<Location>> {
        if !self.shares_memory {
            return None;
        }
        blocks.iter().map(|b| self.heap.locate(b.ptr, b.len)).collect()
    }

    /// Publishes this rank's locations for the peers to read after the next barrier.
    fn publish(&self, locations: &[Location]) {
        let base = Self::locations_offset(self.size) + self.rank * Self::locations_stride(self.size);
        for (i, l) in locations.iter().enumerate() {
            // SAFETY: entry i < size of this rank's own area, written only by this rank and
            // read by peers after the barrier that follows.
            unsafe {
                let at = self.map.as_ptr().add(base + i * LOCATION_BYTES) as *mut u64;
                at.write(l.id);
                at.add(1).write(l.fd as u64);
                at.add(2).write(l.offset);
            }
        }
    }

    /// The address in this process of `len` bytes of rank `peer`'s published block `i`.
    fn peer_block(&mut self, peer: usize, i: usize, len: usize) -> Result<*mut u8> {
        let base = Self::locations_offset(self.size) + peer * Self::locations_stride(self.size);
        // SAFETY: entry i of the peer's area, published before the barrier just passed.
        let (id, fd, offset) = unsafe {
            let at = self.map.as_ptr().add(base + i * LOCATION_BYTES) as *const u64;
            (at.read(), at.add(1).read(), at.add(2).read())
        };
        self.peer_maps.resolve(self.pids[peer], Location { id, fd: fd as i32, offset }, len)
    }

    /// All-reduce of a buffer every rank holds in its heap: after a barrier, each rank
    /// reduces its own share reading the peers' shares in place; after a second, it copies
    /// the other shares from their owners; a third keeps every buffer untouched until all
    /// have read it. Nothing passes through the arena.
    pub(super) fn direct_all_reduce(&mut self, buf: Block, at: Location, kind: Kind, op: ReduceOp) -> Result<()> {
        let (n, r, esize) = (self.size, self.rank, kind.elt_size_in_bytes());
        self.publish(&[at]);
        self.arena_barrier()?;
        let mut peers = Vec::with_capacity(n);
        for p in 0..n {
            peers.push(if p == r { buf.ptr } else { self.peer_block(p, 0, buf.len)? });
        }
        let shares = split(buf.len / esize, n, esize);
        let stream = streams(buf.len);
        let mine = buf.piece(shares[r].start, shares[r].len());
        for p in (0..n).filter(|&p| p != r) {
            // SAFETY: peer p's buffer has the same length; its share r is not written
            // until the next barrier.
            let theirs = unsafe { std::slice::from_raw_parts(peers[p].add(shares[r].start), mine.len) };
            reduce_into(kind, op, mine.bytes_mut(), theirs);
        }
        if op == ReduceOp::Avg {
            divide(kind, mine.bytes_mut(), n);
        }
        self.arena_barrier()?;
        for p in (0..n).filter(|&p| p != r) {
            let s = shares[p].clone();
            // SAFETY: share p of peer p's buffer is final and stays so until the barrier below.
            unsafe { copy_bytes(buf.ptr.add(s.start), peers[p].add(s.start), s.len(), stream) };
        }
        self.arena_barrier()
    }

    /// All-gather of inputs every rank holds in its heap: each rank copies the peers'
    /// inputs straight into its outputs, between two barriers.
    pub(super) fn direct_all_gather(&mut self, outputs: &[Block], input: Block, at: Location) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let stream = streams(outputs.iter().map(|b| b.len).sum());
        if outputs[r].ptr != input.ptr {
            input.copy_to(outputs[r].ptr, stream);
        }
        self.publish(&[at]);
        self.arena_barrier()?;
        for p in (0..n).filter(|&p| p != r) {
            let src = self.peer_block(p, 0, outputs[p].len)?;
            // SAFETY: peer p's input holds outputs[p].len bytes, unchanged until the barrier.
            unsafe { copy_bytes(outputs[p].ptr, src, outputs[p].len, stream) };
        }
        self.arena_barrier()
    }

    /// Broadcast of a buffer every rank holds in its heap: each rank other than `root`
    /// copies the root's buffer, read in place, between two barriers.
    pub(super) fn direct_broadcast(&mut self, buf: Block, at: Location, root: usize) -> Result<()> {
        if self.rank == root {
            self.publish(&[at]);
        }
        self.arena_barrier()?;
        if self.rank != root {
            let src = self.peer_block(root, 0, buf.len)?;
            // SAFETY: the root's buffer holds buf.len bytes, unchanged until the barrier.
            unsafe { copy_bytes(buf.ptr, src, buf.len, streams(buf.len)) };
        }
        self.arena_barrier()
    }

    /// Reduce-scatter of inputs every rank holds in its heap: each rank reduces its block
    /// of every peer's input, read in place, straight into its output, between two barriers.
    pub(super) fn direct_reduce_scatter(
        &mut self,
        inputs: &[Block],
        out: Block,
        at: &[Location],
        kind: Kind,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        self.publish(at);
        self.arena_barrier()?;
        let mut theirs = Vec::with_capacity(n - 1);
        for p in (0..n).filter(|&p| p != r) {
            let block = self.peer_block(p, r, out.len)?;
            // SAFETY: peer p's block r holds out.len bytes, unchanged until the barrier.
            theirs.push(unsafe { std::slice::from_raw_parts(block, out.len) });
        }
        reduce_own_block(kind, op, n, inputs[r], out, theirs, streams(out.len));
        self.arena_barrier()
    }

    /// Piece by piece: copy in the shares the other ranks reduce, barrier, reduce this
    /// rank's share in place (its own values never leave its buffer) and publish it,
    /// barrier, copy in the other shares' results. The next piece's first barrier also
    /// guarantees that everyone has read the previous results before they are overwritten.
    pub(super) fn arena_all_reduce(
        &mut self,
        buf: &mut [u8],
        kind: Kind,
        op: ReduceOp,
        stores: SlotStores,
    ) -> Result<()> {
        let (n, r, esize) = (self.size, self.rank, kind.elt_size_in_bytes());
        let stream_slots = stores == SlotStores::Streaming;
        let piece_bytes = SLOT_BYTES / esize * esize;
        let stream = streams(buf.len());
        for piece in buf.chunks_mut(piece_bytes) {
            let shares = split(piece.len() / esize, n, esize);
            let share = |p: usize| shares[p].clone();
            // SAFETY (all copies below): slots hold SLOT_BYTES >= piece_bytes; a rank writes
            // only its own slot and its own share of the result slot, and only between
            // barriers at which nobody reads them.
            for p in (0..n).filter(|&p| p != r) {
                let s = share(p);
                unsafe { copy_bytes(self.slot(r).add(s.start), piece[s.clone()].as_ptr(), s.len(), stream_slots) };
            }
            self.arena_barrier()?;
            let mine = share(r);
            for p in (0..n).filter(|&p| p != r) {
                let theirs = unsafe { std::slice::from_raw_parts(self.slot(p).add(mine.start), mine.len()) };
                reduce_into(kind, op, &mut piece[mine.clone()], theirs);
            }
            if op == ReduceOp::Avg {
                divide(kind, &mut piece[mine.clone()], n);
            }
            unsafe { copy_bytes(self.slot(n).add(mine.start), piece[mine.clone()].as_ptr(), mine.len(), stream_slots) };
            self.arena_barrier()?;
            for p in (0..n).filter(|&p| p != r) {
                let s = share(p);
                unsafe { copy_bytes(piece[s.clone()].as_mut_ptr(), self.slot(n).add(s.start), s.len(), stream) };
            }
        }
        Ok(())
    }

    /// Half `h` of rank `p`'s slot. Reduce-scatter and all-gather alternate halves piece by
    /// piece, so one barrier per piece suffices: a half is written again only after every
    /// rank has passed the barrier that follows its last reading.
    fn half(&self, p: usize, h: usize) -> *mut u8 {
        // SAFETY: both halves lie inside slot `p`.
        unsafe { self.slot(p).add(h * (SLOT_BYTES / 2)) }
    }

    /// Piece by piece: copy into this rank's slot the pieces of the inputs the other ranks
    /// own, barrier, then reduce this rank's own input piece with the peers' copies of it
    /// straight into the output. Each input byte is read once and copied at most once;
    /// nothing the size of the whole input is staged. A closing barrier leaves the slots
    /// free for the next collective.
    ///
    /// The output is written with ordinary stores, not streamed as other large outputs
    /// are: here ordinary stores measured faster at large sizes, while all-gather's output
    /// and the direct reduce-scatter measured faster streamed, so they stream.
    pub(super) fn arena_reduce_scatter(
        &mut self,
        inputs: &[Block],
        out: Block,
        kind: Kind,
        op: ReduceOp,
        stores: SlotStores,
    ) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let stream_slots = stores == SlotStores::Streaming;
        // Cache-line multiples, so every region is aligned for every dtype.
        let region = SLOT_BYTES / 2 / n / 64 * 64;
        let longest = inputs.iter().map(|b| b.len).max().unwrap_or(0);
        for (c, at) in (0..longest).step_by(region).enumerate() {
            let h = c % 2;
            for p in (0..n).filter(|&p| p != r) {
                // SAFETY: region p of this rank's half holds `region` bytes.
                inputs[p].piece(at, region).copy_to(unsafe { self.half(r, h).add(p * region) }, stream_slots);
            }
            self.arena_barrier()?;
            let dst = out.piece(at, region);
            // SAFETY: peer p wrote its region r before the barrier and leaves it alone until
            // the next one.
            let theirs = (0..n)
                .filter(|&p| p != r)
                .map(|p| unsafe { std::slice::from_raw_parts(self.half(p, h).add(r * region), dst.len) });
            reduce_own_block(kind, op, n, inputs[r].piece(at, region), dst, theirs, false);
        }
        self.arena_barrier()
    }

    /// Piece by piece: copy this rank's input piece into its slot (and into its own output
    /// while the piece is in cache), barrier, copy every peer's piece out of its slot.
    pub(super) fn arena_all_gather(&mut self, outputs: &[Block], input: Block, stores: SlotStores) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let stream_slots = stores == SlotStores::Streaming;
        let region = SLOT_BYTES / 2;
        let longest = outputs.iter().map(|b| b.len).max().unwrap_or(0);
        let stream = streams(outputs.iter().map(|b| b.len).sum());
        for (c, at) in (0..longest).step_by(region).enumerate() {
            let h = c % 2;
            let piece = input.piece(at, region);
            let own = outputs[r].piece(at, region);
            if own.ptr != piece.ptr && stream {
                // SAFETY: the half holds `region` >= piece.len bytes; `own` is this rank's
                // output piece, as long as the piece and apart from it and from the slot.
                unsafe { copy_twice(self.half(r, h), stream_slots, own.ptr, piece.ptr, piece.len) };
            } else {
                piece.copy_to(self.half(r, h), stream_slots);
                if own.ptr != piece.ptr {
                    piece.copy_to(own.ptr, false);
                }
            }
            self.arena_barrier()?;
            for p in (0..n).filter(|&p| p != r) {
                let dst = outputs[p].piece(at, region);
                // SAFETY: peer p's half holds its piece until the next barrier.
                unsafe { copy_bytes(dst.ptr, self.half(p, h), dst.len, stream) };
            }
        }
        self.arena_barrier()
    }

    /// Piece by piece: the root copies its piece into a half of the arena, barrier, every
    /// other rank copies it out (while the root fills the other half). Only the root
    /// writes, so it uses every slot, the result slot included: larger pieces, fewer
    /// barriers.
    pub(super) fn arena_broadcast(&mut self, buf: Block, root: usize, stores: SlotStores) -> Result<()> {
        let stream_slots = stores == SlotStores::Streaming;
        let region = (self.size + 1) * SLOT_BYTES / 2 / 64 * 64;
        let stream = streams(buf.len);
        for (c, at) in (0..buf.len).step_by(region).enumerate() {
            // SAFETY: slots 0 to size lie one after another, 2 · region bytes in all. The
            // first half ends before slot `size`, the result slot that peers may still be
            // reading after an arena all-reduce (it has no closing barrier); the second is
            // written only past this broadcast's first barrier.
            let half = unsafe { self.slot(0).add(c % 2 * region) };
            let piece = buf.piece(at, region);
            if self.rank == root {
                piece.copy_to(half, stream_slots);
            }
            self.arena_barrier()?;
            if self.rank != root {
                // SAFETY: the half holds the root's piece until the next barrier.
                unsafe { copy_bytes(piece.ptr, half, piece.len, stream) };
            }
        }
        self.arena_barrier()
    }
}

/// Writes into `dst` the reduction of this rank's block `mine` with the peers' copies of it
/// (`theirs`), divided by `n` for avg. Out of place, `mine` is never copied first: the
/// first peer's copy is combined with it straight into `dst` (or, with `stream`, every copy
/// piece by piece and streamed out). In place (`dst` is `mine`), every copy is reduced into
/// it; with no peers, `mine` is copied over.
fn reduce_own_block<'a>(
    kind: Kind,
    op: ReduceOp,
    n: usize,
    mine: Block,
    dst: Block,
    theirs: impl IntoIterator<Item = &'a [u8]>,
    stream: bool,
) {
    if stream && mine.ptr != dst.ptr {
        let theirs: Vec<&[u8]> = theirs.into_iter().collect();
        return reduce_streamed(kind, op, dst.bytes_mut(), mine.bytes(), &theirs);
    }
    let mut first = mine.ptr != dst.ptr;
    for peer in theirs {
        if std::mem::take(&mut first) {
            combine_into(kind, op, dst.bytes_mut(), mine.bytes(), peer);
        } else {
            reduce_into(kind, op, dst.bytes_mut(), peer);
        }
    }
    if first {
        mine.copy_to(dst.ptr, false);
    }
    if op == ReduceOp::Avg {
        divide(kind, dst.bytes_mut(), n);
    }
}
