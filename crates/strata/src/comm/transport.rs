//! Byte transports between the ranks of a group: TCP sockets (any hosts) and shared-memory
//! ring buffers (one host). Collectives are written once, over [`Transport`].
//!
//! Every blocking call gives up after the group's timeout, and a peer that went away is
//! reported by rank (a closed socket, or a process that no longer exists).
use super::auth;
use super::elementwise::{combine_into, divide, reduce_into, split};
use super::shared::{Heap, Location, PeerMappings};
use super::{GroupSetup, ReduceOp};
use crate::{Error, Result};
use memmap2::MmapMut;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
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

    /// Copies this block's bytes to `dst` (at least as long).
    fn copy_to(self, dst: *mut u8) {
        if self.len > 0 {
            // SAFETY: callers pass a destination of at least `len` bytes that does not
            // overlap the block (a shared slot, or another tensor of the collective).
            unsafe { std::ptr::copy_nonoverlapping(self.ptr, dst, self.len) }
        }
    }
}

/// Point-to-point byte movement between the ranks of one group.
pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Sends `out` to rank `to` while receiving exactly `inp.len()` bytes from rank `from`
    /// (`to` and `from` may be the same rank). Either side may be empty.
    fn exchange(&mut self, to: usize, out: &[u8], from: usize, inp: &mut [u8]) -> Result<()>;

    fn send(&mut self, to: usize, out: &[u8]) -> Result<()> {
        self.exchange(to, out, to, &mut [])
    }

    /// Whether peers can read this process's [`Heap`] allocations in place.
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
    fn recv(&mut self, from: usize, inp: &mut [u8]) -> Result<()> {
        self.exchange(from, &[], from, inp)
    }
}

fn peer_error(peer: usize, what: impl std::fmt::Display) -> Error {
    Error::Comm(format!("rank {peer}: {what}"))
}

// ---- TCP ------------------------------------------------------------------------------

/// Mesh handshakes running at once; later connections wait in the listen backlog.
const MAX_HANDSHAKES: usize = 64;

/// A full mesh of TCP connections. Sends run on a scoped thread while the caller receives,
/// so two ranks sending to each other never wait on each other's buffers.
pub struct TcpTransport {
    rank: usize,
    size: usize,
    readers: Vec<Option<TcpStream>>,
    writers: Vec<Option<TcpStream>>,
}

impl TcpTransport {
    /// Listens on the interface that reaches the store, publishes the address, connects to
    /// lower ranks and accepts higher ones. Every connection is authenticated with the
    /// job's token and names its group and rank; a connection that fails is dropped and the
    /// mesh keeps accepting until every expected rank has joined or the timeout passes.
    pub fn connect(setup: &GroupSetup) -> Result<TcpTransport> {
        let (rank, size) = (setup.rank, setup.size);
        let ip = setup.store.local_ip()?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::Comm(format!("cannot listen on {ip}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| Error::Comm(e.to_string()))?;
        setup.store.set(&format!("{}tcp/{rank}", setup.prefix), addr.to_string().as_bytes())?;
        let token = setup.store.token();
        let context = |r: usize| [setup.prefix.as_bytes(), &(r as u64).to_le_bytes()].concat();
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let io = |peer: usize| move |e: std::io::Error| peer_error(peer, format!("connection failed: {e}"));
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            let text = String::from_utf8_lossy(&setup.store.get(&format!("{}tcp/{peer}", setup.prefix))?).into_owned();
            let peer_addr: SocketAddr = text.parse().map_err(|_| peer_error(peer, format!("bad address {text:?}")))?;
            let mut s = TcpStream::connect_timeout(&peer_addr, setup.timeout).map_err(io(peer))?;
            auth::connect(&mut s, token, &context(rank), &format!("rank {peer}"))?;
            *slot = Some(s);
        }
        listener.set_nonblocking(true).map_err(|e| Error::Comm(e.to_string()))?;
        let deadline = Instant::now() + setup.timeout;
        // Handshakes run on threads of their own, so a peer that stalls holds up no other;
        // a slot is claimed when a peer proves who it is, before it is told it may join.
        let claimed: Arc<Mutex<Vec<bool>>> = Arc::new(Mutex::new(vec![false; size]));
        let expected: Vec<(usize, Vec<u8>)> = (rank + 1..size).map(|p| (p, context(p))).collect();
        let (joined, arrivals) = std::sync::mpsc::channel();
        let mut in_flight = 0usize;
        while streams.iter().skip(rank + 1).any(Option::is_none) {
            while let Ok(arrival) = arrivals.try_recv() {
                in_flight -= 1;
                if let Some((peer, s)) = arrival {
                    streams[peer] = Some(s);
                }
            }
            if streams.iter().skip(rank + 1).all(Option::is_some) {
                break;
            }
            if Instant::now() >= deadline {
                return Err(Error::Comm(format!(
                    "rank {rank}: higher ranks did not connect within {:?}",
                    setup.timeout
                )));
            }
            if in_flight >= MAX_HANDSHAKES {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            let mut s = match listener.accept() {
                Ok((s, _)) => s,
                // Nothing yet, or a transient failure (out of descriptors): wait and retry.
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
            };
            let (token, joined, claimed, expected) =
                (token.to_vec(), joined.clone(), claimed.clone(), expected.clone());
            let handshake = move || {
                let mut peer = None;
                let admit = |claim: &[u8]| {
                    let mut slots = claimed.lock().unwrap_or_else(|e| e.into_inner());
                    peer = expected.iter().find(|(p, c)| c == claim && !slots[*p]).map(|(p, _)| *p);
                    peer.inspect(|&p| slots[p] = true).is_some()
                };
                let admitted = s.set_nonblocking(false).is_ok() && auth::accept(&mut s, &token, admit).is_ok();
                if !admitted {
                    tracing::warn!("refused a mesh connection that did not authenticate as an expected peer");
                }
                let _ = joined.send(peer.filter(|_| admitted).map(|p| (p, s)));
            };
            match std::thread::Builder::new().name("strata-mesh-handshake".into()).spawn(handshake) {
                Ok(_) => in_flight += 1,
                Err(e) => tracing::warn!(rank, "cannot start a handshake thread ({e}); the connection is dropped"),
            }
        }
        let mut readers = Vec::with_capacity(size);
        let mut writers = Vec::with_capacity(size);
        for (peer, s) in streams.into_iter().enumerate() {
            match s {
                Some(s) => {
                    s.set_nodelay(true).map_err(io(peer))?;
                    s.set_read_timeout(Some(setup.timeout)).map_err(io(peer))?;
                    s.set_write_timeout(Some(setup.timeout)).map_err(io(peer))?;
                    writers.push(Some(s.try_clone().map_err(io(peer))?));
                    readers.push(Some(s));
                }
                None => {
                    readers.push(None);
                    writers.push(None);
                }
            }
        }
        Ok(TcpTransport { rank, size, readers, writers })
    }

    fn stream(streams: &mut [Option<TcpStream>], peer: usize) -> Result<&mut TcpStream> {
        streams.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| peer_error(peer, "no connection to this rank"))
    }
}

fn io_failure(peer: usize, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => peer_error(peer, "timed out"),
        std::io::ErrorKind::UnexpectedEof => peer_error(peer, "closed the connection (the process exited?)"),
        _ => peer_error(peer, format!("connection lost ({e})")),
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, to: usize, out: &[u8], from: usize, inp: &mut [u8]) -> Result<()> {
        let writer = if out.is_empty() { None } else { Some(Self::stream(&mut self.writers, to)?) };
        let reader = if inp.is_empty() { None } else { Some(Self::stream(&mut self.readers, from)?) };
        std::thread::scope(|scope| {
            let sending = writer.map(|w| scope.spawn(move || w.write_all(out).map_err(|e| io_failure(to, e))));
            let received = reader.map_or(Ok(()), |r| r.read_exact(inp).map_err(|e| io_failure(from, e)));
            let sent =
                sending.map_or(Ok(()), |h| h.join().unwrap_or_else(|_| Err(peer_error(to, "send thread panicked"))));
            received.and(sent)
        })
    }
}

// ---- shared memory --------------------------------------------------------------------

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
/// next.
const FLAG_STRIDE: usize = 128;
const DOORBELL_AT: usize = 64;

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
/// reduction of its share, and one copy out, chunk by chunk so the data stays in cache —
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
}

impl ShmTransport {
    /// Rank 0 creates the segment; everyone maps it; it is unlinked once all have, so
    /// nothing is left behind however the processes end.
    pub fn connect(setup: &GroupSetup) -> Result<ShmTransport> {
        let (rank, size) = (setup.rank, setup.size);
        let key = |k: &str| format!("{}shm/{k}", setup.prefix);
        let bytes = Self::locations_offset(size) + size * Self::locations_stride(size);
        let path = if rank == 0 {
            let id = super::store::random_token()?;
            let path = format!("/dev/shm/strata-{id}");
            create_segment(Path::new(&path), bytes)?;
            setup.store.set(&key("path"), path.as_bytes())?;
            path
        } else {
            String::from_utf8_lossy(&setup.store.get(&key("path"))?).into_owned()
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::Comm(format!("cannot open {path}: {e}")))?;
        // SAFETY: the file is a shared-memory segment of the right size, used only through
        // the atomics and byte copies below.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| Error::Comm(format!("cannot map {path}: {e}")))?;
        setup.store.set(&key(&format!("pid/{rank}")), std::process::id().to_string().as_bytes())?;
        let mut pids = Vec::with_capacity(size);
        for peer in 0..size {
            let text = String::from_utf8_lossy(&setup.store.get(&key(&format!("pid/{peer}")))?).into_owned();
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
            let text = String::from_utf8_lossy(&setup.store.get(&key(format!("probe/{peer}")))?).into_owned();
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
            ok &= setup.store.get(&key(format!("probe-ok/{peer}")))? == b"1";
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

    /// Where `blocks` live in this process's heap, if all of them do and peers can map it.
    fn locate(&self, blocks: &[Block]) -> Option<Vec<Location>> {
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
    fn direct_all_reduce(&mut self, buf: Block, at: Location, kind: Kind, op: ReduceOp) -> Result<()> {
        let (n, r, esize) = (self.size, self.rank, kind.elt_size_in_bytes());
        self.publish(&[at]);
        self.arena_barrier()?;
        let mut peers = Vec::with_capacity(n);
        for p in 0..n {
            peers.push(if p == r { buf.ptr } else { self.peer_block(p, 0, buf.len)? });
        }
        let shares = split(buf.len / esize, n, esize);
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
            unsafe { std::ptr::copy_nonoverlapping(peers[p].add(s.start), buf.ptr.add(s.start), s.len()) };
        }
        self.arena_barrier()
    }

    /// All-gather of inputs every rank holds in its heap: each rank copies the peers'
    /// inputs straight into its outputs, between two barriers.
    fn direct_all_gather(&mut self, outputs: &[Block], input: Block, at: Location) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        if outputs[r].ptr != input.ptr {
            input.copy_to(outputs[r].ptr);
        }
        self.publish(&[at]);
        self.arena_barrier()?;
        for p in (0..n).filter(|&p| p != r) {
            let src = self.peer_block(p, 0, outputs[p].len)?;
            // SAFETY: peer p's input holds outputs[p].len bytes, unchanged until the barrier.
            unsafe { std::ptr::copy_nonoverlapping(src, outputs[p].ptr, outputs[p].len) };
        }
        self.arena_barrier()
    }

    /// Reduce-scatter of inputs every rank holds in its heap: each rank reduces its block
    /// of every peer's input, read in place, straight into its output, between two barriers.
    fn direct_reduce_scatter(
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
        let mine = inputs[r];
        let mut first = mine.ptr != out.ptr;
        for p in (0..n).filter(|&p| p != r) {
            let theirs = self.peer_block(p, r, out.len)?;
            // SAFETY: peer p's block r holds out.len bytes, unchanged until the barrier.
            let theirs = unsafe { std::slice::from_raw_parts(theirs, out.len) };
            if std::mem::take(&mut first) {
                combine_into(kind, op, out.bytes_mut(), mine.bytes(), theirs);
            } else {
                reduce_into(kind, op, out.bytes_mut(), theirs);
            }
        }
        if n == 1 && first {
            mine.copy_to(out.ptr);
        }
        if op == ReduceOp::Avg {
            divide(kind, out.bytes_mut(), n);
        }
        self.arena_barrier()
    }

    /// Rank `rank`'s progress counter.
    fn flag(&self, rank: usize) -> &AtomicU64 {
        // SAFETY: an 8-byte-aligned counter inside the mapping, shared across processes.
        unsafe {
            AtomicU64::from_ptr(self.map.as_ptr().add(Self::arena_offset(self.size) + rank * FLAG_STRIDE) as *mut u64)
        }
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

    /// Chunk by chunk: copy in the shares the other ranks reduce, barrier, reduce this
    /// rank's share in place (its own values never leave its buffer) and publish it,
    /// barrier, copy in the other shares' results. The next chunk's first barrier also
    /// guarantees that everyone has read the previous results before they are overwritten.
    fn arena_all_reduce(&mut self, buf: &mut [u8], kind: Kind, op: ReduceOp) -> Result<()> {
        let (n, r, esize) = (self.size, self.rank, kind.elt_size_in_bytes());
        let chunk = SLOT_BYTES / esize * esize;
        for piece in buf.chunks_mut(chunk) {
            let shares = split(piece.len() / esize, n, esize);
            let share = |p: usize| shares[p].clone();
            // SAFETY (all copies below): slots hold SLOT_BYTES >= chunk bytes; a rank writes
            // only its own slot and its own share of the result slot, and only between
            // barriers at which nobody reads them.
            for p in (0..n).filter(|&p| p != r) {
                let s = share(p);
                unsafe { std::ptr::copy_nonoverlapping(piece[s.clone()].as_ptr(), self.slot(r).add(s.start), s.len()) };
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
            unsafe {
                std::ptr::copy_nonoverlapping(piece[mine.clone()].as_ptr(), self.slot(n).add(mine.start), mine.len())
            };
            self.arena_barrier()?;
            for p in (0..n).filter(|&p| p != r) {
                let s = share(p);
                unsafe {
                    std::ptr::copy_nonoverlapping(self.slot(n).add(s.start), piece[s.clone()].as_mut_ptr(), s.len())
                };
            }
        }
        Ok(())
    }

    /// Half `h` of rank `p`'s slot. Reduce-scatter and all-gather alternate halves chunk by
    /// chunk, so one barrier per chunk suffices: a half is written again only after every
    /// rank has passed the barrier that follows its last reading.
    fn half(&self, p: usize, h: usize) -> *mut u8 {
        // SAFETY: both halves lie inside slot `p`.
        unsafe { self.slot(p).add(h * (SLOT_BYTES / 2)) }
    }

    /// Chunk by chunk: copy into this rank's slot the pieces of the inputs the other ranks
    /// own, barrier, then reduce this rank's own input piece with the peers' copies of it
    /// straight into the output. Each input byte is read once and copied at most once;
    /// nothing the size of the whole input is staged. A closing barrier leaves the slots
    /// free for the next collective.
    fn arena_reduce_scatter(&mut self, inputs: &[Block], out: Block, kind: Kind, op: ReduceOp) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        // Cache-line multiples, so every region is aligned for every dtype.
        let region = SLOT_BYTES / 2 / n / 64 * 64;
        let longest = inputs.iter().map(|b| b.len).max().unwrap_or(0);
        for (c, at) in (0..longest).step_by(region).enumerate() {
            let h = c % 2;
            for p in (0..n).filter(|&p| p != r) {
                // SAFETY: region p of this rank's half holds `region` bytes.
                inputs[p].piece(at, region).copy_to(unsafe { self.half(r, h).add(p * region) });
            }
            self.arena_barrier()?;
            let (mine, dst) = (inputs[r].piece(at, region), out.piece(at, region));
            let mut first = mine.ptr != dst.ptr; // in place, the output already holds mine
            if n == 1 && first {
                mine.copy_to(dst.ptr);
            }
            for p in (0..n).filter(|&p| p != r) {
                // SAFETY: peer p wrote this region before the barrier and leaves it alone
                // until the next one.
                let theirs = unsafe { std::slice::from_raw_parts(self.half(p, h).add(r * region), dst.len) };
                if std::mem::take(&mut first) {
                    combine_into(kind, op, dst.bytes_mut(), mine.bytes(), theirs);
                } else {
                    reduce_into(kind, op, dst.bytes_mut(), theirs);
                }
            }
            if op == ReduceOp::Avg {
                divide(kind, dst.bytes_mut(), n);
            }
        }
        self.arena_barrier()
    }

    /// Chunk by chunk: copy this rank's input piece into its slot (and into its own output
    /// while the piece is in cache), barrier, copy every peer's piece out of its slot.
    fn arena_all_gather(&mut self, outputs: &[Block], input: Block) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let region = SLOT_BYTES / 2;
        let longest = outputs.iter().map(|b| b.len).max().unwrap_or(0);
        for (c, at) in (0..longest).step_by(region).enumerate() {
            let h = c % 2;
            let piece = input.piece(at, region);
            piece.copy_to(self.half(r, h));
            let own = outputs[r].piece(at, region);
            if own.ptr != piece.ptr {
                piece.copy_to(own.ptr);
            }
            self.arena_barrier()?;
            for p in (0..n).filter(|&p| p != r) {
                let dst = outputs[p].piece(at, region);
                // SAFETY: peer p's half holds its piece until the next barrier.
                unsafe { std::ptr::copy_nonoverlapping(self.half(p, h), dst.ptr, dst.len) };
            }
        }
        self.arena_barrier()
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
        Some(self.arena_all_reduce(buf, kind, op))
    }

    fn native_reduce_scatter(&mut self, inputs: &[Block], out: Block, kind: Kind, op: ReduceOp) -> Option<Result<()>> {
        if let Some(at) = self.locate(inputs) {
            return Some(self.direct_reduce_scatter(inputs, out, &at, kind, op));
        }
        Some(self.arena_reduce_scatter(inputs, out, kind, op))
    }

    fn native_all_gather(&mut self, outputs: &[Block], input: Block) -> Option<Result<()>> {
        if let Some(at) = self.locate(&[input]) {
            return Some(self.direct_all_gather(outputs, input, at[0]));
        }
        Some(self.arena_all_gather(outputs, input))
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
    use crate::comm::{Store, StoreServer};
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;

    #[test]
    fn the_shared_segment_is_private_to_its_user() {
        let dir = std::env::temp_dir().join(format!("strata-seg-{}", std::process::id()));
        create_segment(&dir, 4096).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(mode, 0o600);
    }

    fn setup(store: Store, rank: usize) -> GroupSetup {
        GroupSetup {
            store: Arc::new(store),
            prefix: "mesh-test/".into(),
            rank,
            size: 2,
            ranks: vec![0, 1],
            world_size: 2,
            timeout: Duration::from_secs(30),
        }
    }

    #[test]
    fn the_mesh_refuses_a_peer_without_the_token_and_the_job_proceeds() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "job-token").unwrap();
        let addr = server.addr();
        let connect = move || Store::connect(addr, "job-token", Duration::from_secs(10)).unwrap();
        let rank0 = std::thread::spawn(move || TcpTransport::connect(&setup(connect(), 0)));
        // An intruder learns rank 0's address (it is no secret) and claims to be rank 1, with
        // a guessed token, then one that stalls, before the real rank 1 arrives.
        let watcher = connect();
        let listen: SocketAddr = String::from_utf8(watcher.get("mesh-test/tcp/0").unwrap()).unwrap().parse().unwrap();
        let mut intruder = TcpStream::connect(listen).unwrap();
        let claim = [&b"mesh-test/"[..], &1u64.to_le_bytes()].concat();
        let refused = auth::connect(&mut intruder, b"guess", &claim, "rank 0").unwrap_err();
        assert!(refused.to_string().contains("token"), "{refused}");
        let mut staller = TcpStream::connect(listen).unwrap();
        staller.write_all(&[200, 0]).unwrap();
        let mut rank1 = TcpTransport::connect(&setup(connect(), 1)).unwrap();
        let mut rank0 = rank0.join().unwrap().unwrap();
        let sender = std::thread::spawn(move || rank1.send(0, b"hello").map(|_| rank1));
        let mut got = [0u8; 5];
        rank0.recv(1, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        sender.join().unwrap().unwrap();
    }
}
