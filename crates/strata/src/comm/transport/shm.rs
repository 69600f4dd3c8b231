//! The shared-memory transport between the processes of one host: one segment holds a
//! ring-buffer channel per ordered pair of ranks, each rank's progress counter and futex
//! doorbell, the arena's slots and the published locations of buffers peers read in place.
//! The collectives that use the arena and those locations are in [`collectives`].
mod collectives;
mod slot_stores;

use super::{peer_error, Block, Transport};
use crate::comm::shared::{Heap, Location, PeerMappings};
use crate::comm::{GroupSetup, ReduceOp};
use crate::{Error, Result};
use memmap2::MmapMut;
use slot_stores::{choice_index, measured, ArenaCollective, SlotStoreChoices, SlotStores, CHOICES};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::Kind;

/// Waiting for a peer in shared memory. A waiter spins for a few microseconds (a peer on
/// another core is usually about to arrive, and sleeping would add a wake-up's latency to
/// every collective), then sleeps in the kernel on its doorbell: a futex word that every
/// peer rings after writing anything the waiter may be waiting for (a barrier arrival,
/// bytes into its channel, room freed in one). So a rank waiting for a slower peer gives
/// its core to the ranks that compute.
struct Backoff {
    spins: u32,
    since: Instant,
    checked: Instant,
}

/// Spins before sleeping: about the cost of a futex round trip.
const SPIN_LIMIT: u32 = 2000;
/// Longest sleep before a waiter checks on its peers (alive? timed out?).
const SLEEP_SLICE: Duration = Duration::from_millis(5);

impl Backoff {
    fn new() -> Backoff {
        let now = Instant::now();
        Backoff { spins: 0, since: now, checked: now }
    }

    /// True at most once per sleep slice: time to check on the peers (reading /proc is
    /// too slow to do after every wake-up).
    fn check_due(&mut self) -> bool {
        let due = self.checked.elapsed() >= SLEEP_SLICE;
        if due {
            self.checked = Instant::now();
        }
        due
    }

    /// Spins once and returns true while the spinning phase lasts; then false, and the
    /// caller sleeps.
    fn spin(&mut self) -> bool {
        self.spins += 1;
        std::hint::spin_loop();
        self.spins <= SPIN_LIMIT
    }
}

/// Bytes of each one-way channel's ring buffer.
const CHANNEL_BYTES: usize = 4 << 20;
/// Head and tail counters, each on its own cache line.
const CHANNEL_HEADER: usize = 128;
const CHANNEL_STRIDE: usize = CHANNEL_HEADER + CHANNEL_BYTES;

/// Bytes of each rank's slot in the all-reduce arena (and of the shared result slot).
const SLOT_BYTES: usize = 1 << 21;
/// Bytes of one published location (allocation id, descriptor, offset).
const LOCATION_BYTES: usize = 24;
/// Per rank: its progress counter on one cache line, its doorbell and sleeper count on the
/// next. Rank 0's first line also holds the slot stores it chose for the arena
/// collectives' next calls.
const FLAG_STRIDE: usize = 128;
const DOORBELL_AT: usize = 64;
const CHOSEN_STORES_AT: usize = 8;

/// Broadcasts from this many bytes go through the arena or read the root's buffer in
/// place; smaller ones take the chain through the channels. Both copy the bytes twice (in
/// place, once), but the chain lets the root run ahead of its peers by a channel's size,
/// so back-to-back small broadcasts overlap, and a peer reads lines written a while ago
/// rather than lines still in the root's cache; from a few MiB the arena's choice of
/// slot stores and the direct form's single copy win.
const NATIVE_BROADCAST_FROM: usize = 4 << 20;

/// Creates a shared-memory segment of `bytes` readable and writable by this user only: the
/// job's gradients and parameters pass through it.
fn create_segment(path: &Path, bytes: usize) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let failed = |what: &str, e: std::io::Error| Error::Comm(format!("cannot {what} {}: {e}", path.display()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| failed("create", e))?;
    f.set_len(bytes as u64).map_err(|e| failed("size", e))?;
    Ok(f)
}

/// One-way channels between every ordered pair of ranks, in one shared-memory segment.
/// Channel (i → j) is a ring buffer: the writer advances `head`, the reader `tail`.
///
/// After the channels the segment holds an all-reduce arena: a progress counter per rank,
/// a slot per rank and one result slot. All-reduce then costs each rank one copy in, a
/// reduction of its share, and one copy out, piece by piece so the data stays in cache —
/// instead of the ring's 2·(n−1) messages through the channels.
pub struct ShmTransport {
    rank: usize,
    size: usize,
    map: MmapMut,
    pids: Vec<i32>,
    timeout: Duration,
    /// Arena phases this rank has completed (every rank moves through the same ones).
    phase: u64,
    heap: Arc<Heap>,
    /// Whether every rank of the group can map every other's heap allocations.
    shares_memory: bool,
    peer_maps: PeerMappings,
    /// How the arena all-reduce, reduce-scatter, all-gather and broadcast write their slots, from
    /// what each choice measured here (their rates differ by collective).
    slot_stores: SlotStoreChoices,
}

impl ShmTransport {
    /// Rank 0 creates the segment; everyone maps it; it is unlinked once all have, so
    /// nothing is left behind however the processes end.
    pub fn connect(setup: &GroupSetup) -> Result<ShmTransport> {
        let (rank, size) = (setup.rank, setup.size);
        // Before any exchange with the peers, so that a bad setting fails at once.
        let slot_stores = SlotStoreChoices::from_env()?;
        let key = |k: &str| format!("{}shm/{k}", setup.prefix);
        let bytes = Self::locations_offset(size) + size * Self::locations_stride(size);
        let path = if rank == 0 {
            let id = crate::comm::store::random_token()?;
            let path = format!("/dev/shm/strata-{id}");
            create_segment(Path::new(&path), bytes)?;
            setup.store.set(&key("path"), path.as_bytes())?;
            path
        } else {
            String::from_utf8_lossy(&setup.get(&key("path"))?).into_owned()
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::Comm(format!("cannot open {path}: {e}")))?;
        // A segment shorter than the group's layout would fault on first use instead.
        let held = file.metadata().map_err(|e| Error::Comm(format!("{path}: {e}")))?.len();
        if held < bytes as u64 {
            return Err(Error::Comm(format!("{path} holds {held} bytes, the group's segment {bytes}")));
        }
        // SAFETY: the file is a shared-memory segment of the right size, used only through
        // the atomics and byte copies below.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| Error::Comm(format!("cannot map {path}: {e}")))?;
        setup.store.set(&key(&format!("pid/{rank}")), std::process::id().to_string().as_bytes())?;
        let mut pids = Vec::with_capacity(size);
        for peer in 0..size {
            let text = String::from_utf8_lossy(&setup.get(&key(&format!("pid/{peer}")))?).into_owned();
            pids.push(text.parse().map_err(|_| peer_error(peer, "published no process id"))?);
        }
        // Every rank has mapped the segment once all pids are in; then it can go.
        if rank == 0 {
            let _ = std::fs::remove_file(&path);
        }
        let mut transport = ShmTransport {
            rank,
            size,
            map,
            pids,
            timeout: setup.timeout,
            phase: 0,
            heap: Heap::get(),
            shares_memory: false,
            peer_maps: PeerMappings::default(),
            slot_stores,
        };
        transport.shares_memory = transport.probe_sharing(setup)?;
        Ok(transport)
    }

    /// Whether every rank can map the others' heap allocations (a sandbox may forbid
    /// opening another process's descriptors): each maps a small allocation of each peer
    /// and all agree through the store. Without it, collectives stage through the arena.
    fn probe_sharing(&mut self, setup: &GroupSetup) -> Result<bool> {
        if self.size == 1 {
            return Ok(false);
        }
        let key = |k: String| format!("{}shm/{k}", setup.prefix);
        let probe = self.heap.alloc(1, Kind::Int)?;
        let here = self.heap.locate(probe.data_ptr() as *const u8, 4);
        let here = here.ok_or_else(|| Error::Comm("a shared allocation is not in the heap".into()))?;
        setup.store.set(&key(format!("probe/{}", self.rank)), format!("{} {}", here.id, here.fd).as_bytes())?;
        let mut ok = true;
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            let text = String::from_utf8_lossy(&setup.get(&key(format!("probe/{peer}")))?).into_owned();
            let mut parts = text.split(' ').map(str::parse::<u64>);
            let (Some(Ok(id)), Some(Ok(fd))) = (parts.next(), parts.next()) else {
                return Err(peer_error(peer, format!("published a bad probe {text:?}")));
            };
            let at = Location { id, fd: fd as i32, offset: 0 };
            if let Err(e) = self.peer_maps.resolve(self.pids[peer], at, 4) {
                tracing::debug!("shm: collectives stage through the arena: {e}");
                ok = false;
            }
        }
        setup.store.set(&key(format!("probe-ok/{}", self.rank)), if ok { b"1" } else { b"0" })?;
        for peer in 0..self.size {
            ok &= setup.get(&key(format!("probe-ok/{peer}")))? == b"1";
        }
        Ok(ok)
    }

    fn arena_offset(size: usize) -> usize {
        size * size * CHANNEL_STRIDE
    }

    fn locations_offset(size: usize) -> usize {
        Self::arena_offset(size) + size * FLAG_STRIDE + (size + 1) * SLOT_BYTES
    }

    /// Room for one location per rank (a reduce-scatter's inputs), in whole cache lines.
    fn locations_stride(size: usize) -> usize {
        (size * LOCATION_BYTES).div_ceil(64) * 64
    }

    /// Rank `rank`'s progress counter.
    fn flag(&self, rank: usize) -> &AtomicU64 {
        // SAFETY: an 8-byte-aligned counter inside the mapping, shared across processes.
        unsafe {
            AtomicU64::from_ptr(self.map.as_ptr().add(Self::arena_offset(self.size) + rank * FLAG_STRIDE) as *mut u64)
        }
    }

    /// Where rank 0 publishes the stores of measured call `call` of choice `index`
    /// ([`choice_index`]): one byte per choice and parity of the call, as it writes call
    /// k + 1's while a peer may still read call k's.
    fn chosen_stores(&self, index: usize, call: u64) -> &AtomicU8 {
        const _: () = assert!(CHOSEN_STORES_AT + 2 * CHOICES <= DOORBELL_AT);
        let at = Self::arena_offset(self.size) + CHOSEN_STORES_AT + 2 * index + (call % 2) as usize;
        // SAFETY: a byte of rank 0's first flag line, past its counter, inside the mapping.
        unsafe { AtomicU8::from_ptr(self.map.as_ptr().add(at) as *mut u8) }
    }

    /// Rank `rank`'s doorbell (a futex word) and the number of its threads asleep on it.
    fn doorbell(&self, rank: usize) -> (&AtomicU32, &AtomicU32) {
        let at = Self::arena_offset(self.size) + rank * FLAG_STRIDE + DOORBELL_AT;
        // SAFETY: two 4-byte-aligned u32 words inside the mapping, shared across processes.
        unsafe {
            let base = self.map.as_ptr().add(at) as *mut u32;
            (AtomicU32::from_ptr(base), AtomicU32::from_ptr(base.add(1)))
        }
    }

    /// Tells `rank` that something it may wait for has changed, waking it if it sleeps.
    /// Sequentially consistent with [`ShmTransport::doze`]: either the sleeper sees the
    /// new doorbell value and does not sleep, or this sees the sleeper and wakes it.
    fn ring(&self, rank: usize) {
        let (bell, sleepers) = self.doorbell(rank);
        bell.fetch_add(1, Ordering::SeqCst);
        if sleepers.load(Ordering::SeqCst) > 0 {
            // SAFETY: a live, aligned u32 of a shared mapping; a shared (not private) futex,
            // since waker and sleeper are different processes.
            unsafe { libc::syscall(libc::SYS_futex, bell.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
        }
    }

    /// This rank's doorbell value, read before looking at what it waits for.
    fn bell(&self) -> u32 {
        self.doorbell(self.rank).0.load(Ordering::SeqCst)
    }

    /// Sleeps until the doorbell moves from `seen` (or a time slice passes).
    fn doze(&self, seen: u32) {
        let (bell, sleepers) = self.doorbell(self.rank);
        sleepers.fetch_add(1, Ordering::SeqCst);
        let ts = libc::timespec {
            tv_sec: SLEEP_SLICE.as_secs() as libc::time_t,
            tv_nsec: SLEEP_SLICE.subsec_nanos() as libc::c_long,
        };
        // SAFETY: as in `ring`. A spurious or early return is harmless: callers re-check.
        unsafe { libc::syscall(libc::SYS_futex, bell.as_ptr(), libc::FUTEX_WAIT, seen, &ts as *const libc::timespec) };
        sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Slot `i` of the arena; slot `size` is the shared result.
    fn slot(&self, i: usize) -> *mut u8 {
        let base = Self::arena_offset(self.size) + self.size * FLAG_STRIDE;
        // SAFETY: inside the mapping by construction of its size.
        unsafe { self.map.as_ptr().add(base + i * SLOT_BYTES) as *mut u8 }
    }

    /// Runs arena collective `which`, moving `bytes` bytes, with the slot stores of this
    /// call. A rank with fixed stores uses them. Otherwise a measured call uses the stores
    /// rank 0 published at the previous one (the first one's follow from no timing):
    /// rank 0 publishes the next call's before this call's first barrier, past which
    /// every peer reads, and times this call for the decisions after it.
    fn arena(
        &mut self,
        which: ArenaCollective,
        bytes: usize,
        collective: impl FnOnce(&mut Self, SlotStores) -> Result<()>,
    ) -> Result<()> {
        let (rank, index) = (self.rank, choice_index(which, bytes));
        let (choice, calls) = self.slot_stores.of(index);
        if !measured(bytes) {
            let stores = choice.fixed().unwrap_or(SlotStores::Cached);
            return collective(self, stores);
        }
        let call = *calls;
        *calls += 1;
        let (fixed, first, next) = (choice.fixed(), choice.decide(0), choice.decide(call + 1));
        let stores = match fixed {
            Some(stores) => stores,
            None if call == 0 => first,
            None => SlotStores::from_code(self.chosen_stores(index, call).load(Ordering::Relaxed)),
        };
        if rank != 0 {
            return collective(self, stores);
        }
        self.chosen_stores(index, call + 1).store(next.code(), Ordering::Relaxed);
        let start = Instant::now();
        collective(self, stores)?;
        self.slot_stores.of(index).0.record(stores, bytes, start.elapsed().as_secs_f64());
        Ok(())
    }

    /// Announces that this rank reached the next phase and waits until every rank has.
    fn arena_barrier(&mut self) -> Result<()> {
        self.phase += 1;
        self.flag(self.rank).store(self.phase, Ordering::SeqCst);
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            self.ring(peer);
        }
        let mut backoff = Backoff::new();
        for peer in 0..self.size {
            loop {
                let seen = self.bell();
                if self.flag(peer).load(Ordering::Acquire) >= self.phase {
                    break;
                }
                if !backoff.spin() {
                    self.doze(seen);
                    if backoff.check_due() {
                        self.check_peers(&[peer], peer, &backoff)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn channel(&self, from: usize, to: usize) -> *mut u8 {
        // SAFETY: the offset lies inside the mapping (from, to < size).
        unsafe { self.map.as_ptr().add((from * self.size + to) * CHANNEL_STRIDE) as *mut u8 }
    }

    /// Head and tail counters of the channel at `base`, borrowed from the mapping.
    fn counters(&self, base: *mut u8) -> (&AtomicU64, &AtomicU64) {
        // SAFETY: the header holds two 8-byte-aligned u64 counters inside the mapping,
        // shared across processes, and they live as long as `self` holds the mapping.
        unsafe { (AtomicU64::from_ptr(base as *mut u64), AtomicU64::from_ptr(base.add(64) as *mut u64)) }
    }

    /// Writes as much of `data` as fits into channel (self → to); returns bytes written.
    fn push(&self, to: usize, data: &[u8]) -> usize {
        let base = self.channel(self.rank, to);
        let (head, tail) = self.counters(base);
        let h = head.load(Ordering::Relaxed);
        let free = CHANNEL_BYTES - (h - tail.load(Ordering::Acquire)) as usize;
        let n = free.min(data.len());
        let at = h as usize % CHANNEL_BYTES;
        let first = n.min(CHANNEL_BYTES - at);
        // SAFETY: both ranges lie in this channel's ring and are owned by the writer until
        // `head` is published.
        unsafe {
            let ring = base.add(CHANNEL_HEADER);
            std::ptr::copy_nonoverlapping(data.as_ptr(), ring.add(at), first);
            std::ptr::copy_nonoverlapping(data.as_ptr().add(first), ring, n - first);
        }
        head.store(h + n as u64, Ordering::Release);
        if n > 0 {
            self.ring(to);
        }
        n
    }

    /// Reads what is available from channel (from → self) into `buf`; returns bytes read.
    fn pull(&self, from: usize, buf: &mut [u8]) -> usize {
        let base = self.channel(from, self.rank);
        let (head, tail) = self.counters(base);
        let t = tail.load(Ordering::Relaxed);
        let avail = (head.load(Ordering::Acquire) - t) as usize;
        let n = avail.min(buf.len());
        let at = t as usize % CHANNEL_BYTES;
        let first = n.min(CHANNEL_BYTES - at);
        // SAFETY: the writer published these bytes with `head` and will not touch them
        // until `tail` moves past them.
        unsafe {
            let ring = base.add(CHANNEL_HEADER);
            std::ptr::copy_nonoverlapping(ring.add(at), buf.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(ring, buf.as_mut_ptr().add(first), n - first);
        }
        tail.store(t + n as u64, Ordering::Release);
        if n > 0 {
            self.ring(from);
        }
        n
    }

    /// Fails if one of `peers` has exited, or if nothing has moved for the timeout.
    fn check_peers(&self, peers: &[usize], waiting_on: usize, backoff: &Backoff) -> Result<()> {
        if let Some(&dead) = peers.iter().find(|&&p| !self.alive(p)) {
            return Err(peer_error(dead, format!("process {} has exited", self.pids[dead])));
        }
        if backoff.since.elapsed() > self.timeout {
            return Err(peer_error(waiting_on, format!("timed out after {:?}", self.timeout)));
        }
        Ok(())
    }

    fn alive(&self, peer: usize) -> bool {
        let pid = self.pids[peer];
        // SAFETY: signal 0 only checks that the process exists.
        let exists = unsafe { libc::kill(pid, 0) == 0 || *libc::__errno_location() != libc::ESRCH };
        // A process that ended but was not yet reaped by its parent is a zombie ('Z').
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()))
            .is_some_and(|state| state == 'Z' || state == 'X');
        exists && !zombie
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn shares_memory(&self) -> bool {
        self.shares_memory
    }

    fn native_all_reduce(&mut self, buf: &mut [u8], kind: Kind, op: ReduceOp) -> Option<Result<()>> {
        let block = Block { ptr: buf.as_mut_ptr(), len: buf.len() };
        if let Some(at) = self.locate(&[block]) {
            return Some(self.direct_all_reduce(block, at[0], kind, op));
        }
        Some(self.arena(ArenaCollective::AllReduce, buf.len(), |t, stores| t.arena_all_reduce(buf, kind, op, stores)))
    }

    fn native_reduce_scatter(&mut self, inputs: &[Block], out: Block, kind: Kind, op: ReduceOp) -> Option<Result<()>> {
        if let Some(at) = self.locate(inputs) {
            return Some(self.direct_reduce_scatter(inputs, out, &at, kind, op));
        }
        let bytes = inputs.iter().map(|b| b.len).sum();
        Some(self.arena(ArenaCollective::ReduceScatter, bytes, |t, stores| {
            t.arena_reduce_scatter(inputs, out, kind, op, stores)
        }))
    }

    fn native_all_gather(&mut self, outputs: &[Block], input: Block) -> Option<Result<()>> {
        if let Some(at) = self.locate(&[input]) {
            return Some(self.direct_all_gather(outputs, input, at[0]));
        }
        let bytes = outputs.iter().map(|b| b.len).sum();
        Some(self.arena(ArenaCollective::AllGather, bytes, |t, stores| t.arena_all_gather(outputs, input, stores)))
    }

    fn native_broadcast(&mut self, buf: &mut [u8], root: usize) -> Option<Result<()>> {
        if buf.len() < NATIVE_BROADCAST_FROM {
            return None;
        }
        let block = Block { ptr: buf.as_mut_ptr(), len: buf.len() };
        if let Some(at) = self.locate(&[block]) {
            return Some(self.direct_broadcast(block, at[0], root));
        }
        Some(self.arena(ArenaCollective::Broadcast, buf.len(), |t, stores| t.arena_broadcast(block, root, stores)))
    }

    fn exchange(&mut self, to: usize, out: &[u8], from: usize, inp: &mut [u8]) -> Result<()> {
        for peer in [to, from] {
            if peer >= self.size || peer == self.rank {
                return Err(peer_error(
                    peer,
                    format!("is not a peer of rank {} in a group of {}", self.rank, self.size),
                ));
            }
        }
        let (mut sent, mut got) = (0, 0);
        let mut backoff = Backoff::new();
        while sent < out.len() || got < inp.len() {
            let seen = self.bell();
            let pushed = self.push(to, &out[sent..]);
            let pulled = self.pull(from, &mut inp[got..]);
            sent += pushed;
            got += pulled;
            if pushed + pulled > 0 {
                backoff = Backoff::new();
            } else if !backoff.spin() {
                self.doze(seen);
                if backoff.check_due() {
                    self.check_peers(&[to, from], if got < inp.len() { from } else { to }, &backoff)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Runs `body` as ranks 0 and 1 of a group, threads of this process, each with its
    /// connected transport.
    fn on_two_ranks<T: Send + 'static>(body: impl Fn(usize, ShmTransport) -> T + Send + Clone + 'static) -> [T; 2] {
        use crate::comm::{Store, StoreServer};
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t").unwrap();
        let addr = server.addr();
        let ranks = (0..2).map(|rank| {
            let body = body.clone();
            std::thread::spawn(move || {
                let store = Store::connect(addr, "t", Duration::from_secs(10)).unwrap();
                let setup = GroupSetup {
                    store: Arc::new(store),
                    prefix: "shm-test/".into(),
                    rank,
                    size: 2,
                    ranks: vec![0, 1],
                    world_size: 2,
                    timeout: Duration::from_secs(30),
                    given_up: None,
                };
                body(rank, ShmTransport::connect(&setup).unwrap())
            })
        });
        let [zero, one]: [_; 2] = ranks.collect::<Vec<_>>().try_into().unwrap();
        [zero.join().unwrap(), one.join().unwrap()]
    }

    /// The stores two ranks used on 40 arena all-gathers, every fifth one small, with each
    /// rank's slot store setting.
    fn stores_used(settings: [Option<&'static str>; 2]) -> [Vec<SlotStores>; 2] {
        on_two_ranks(move |rank, mut t| {
            t.slot_stores = SlotStoreChoices::from_setting(settings[rank].map(std::ffi::OsStr::new)).unwrap();
            let mut used = Vec::new();
            for call in 0..40 {
                let bytes = if call % 5 == 4 { 4096 } else { 64 << 20 };
                t.arena(ArenaCollective::AllGather, bytes, |t, stores| {
                    used.push(stores);
                    t.arena_barrier()
                })
                .unwrap();
            }
            used
        })
    }

    /// Bytes that differ from one piece of a copy to the next (251 is prime).
    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn broadcasts_from_4_mib_are_native_and_smaller_ones_left_to_the_chain() {
        // Private buffers (not in the heap): the native broadcast runs through the arena,
        // in several halves and a partial last one, from rank 1.
        let len = NATIVE_BROADCAST_FROM + 5 * SLOT_BYTES + 3;
        let [zero, one] = on_two_ranks(move |rank, mut t| {
            let mut small = vec![0u8; NATIVE_BROADCAST_FROM - 1];
            let small_native = t.native_broadcast(&mut small, 1).is_some();
            let mut buf = if rank == 1 { pattern(len) } else { vec![0; len] };
            let done = t.native_broadcast(&mut buf, 1).map(|r| r.map_err(|e| e.to_string()));
            (small_native, done, buf)
        });
        for (small_native, done, buf) in [zero, one] {
            assert!(!small_native, "a broadcast below 4 MiB is left to the chain");
            assert_eq!(done, Some(Ok(())));
            assert!(buf == pattern(len), "every rank holds the root's bytes");
        }
    }

    #[test]
    fn every_rank_writes_its_slots_with_the_stores_rank_0_chose() {
        use SlotStores::{Cached, Streaming};
        // Whatever rank 0's timings make it choose after its first tries, rank 1 uses the
        // same stores on every call; small calls stay cached and are not counted.
        let [zero, one] = stores_used([None, None]);
        assert_eq!(zero, one);
        let measured: Vec<SlotStores> = zero.iter().enumerate().filter(|(i, _)| i % 5 != 4).map(|(_, &s)| s).collect();
        assert_eq!(&measured[..6], &[Cached, Streaming, Cached, Streaming, Cached, Streaming]);
        assert!(zero.iter().skip(4).step_by(5).all(|&s| s == Cached), "{zero:?}");
        // A rank 0 with fixed streaming stores publishes them: rank 1 follows from its
        // second measured call (its first follows from no timing), small calls aside.
        let [zero, one] = stores_used([Some("streaming"), None]);
        assert_eq!(zero, vec![Streaming; 40]);
        let expected: Vec<SlotStores> =
            (0..40).map(|i| if i == 0 || i % 5 == 4 { Cached } else { Streaming }).collect();
        assert_eq!(one, expected);
    }

    #[test]
    fn the_shared_segment_is_private_to_its_user() {
        let dir = std::env::temp_dir().join(format!("strata-seg-{}", std::process::id()));
        create_segment(&dir, 4096).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(mode, 0o600);
    }
}
