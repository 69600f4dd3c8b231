//! Ring collectives over a [`Transport`], run in order on one background thread per group
//! so callers get a [`Work`] handle at once and can overlap communication with compute.
//!
//! all-reduce = ring reduce-scatter then ring all-gather (each rank sends and receives
//! 2·(n−1)/n of the data); broadcast = a pipelined chain from the root (unless the
//! transport broadcasts natively, as it may also all-reduce, reduce-scatter and
//! all-gather); reduce = ring reduce-scatter then a gather of the blocks at the root;
//! all-to-all = n−1 pairwise exchanges; barrier = a one-byte all-gather.
//!
//! Owns the ring group ([`RingGroup`]): its work queue and the ring algorithms. Must not move
//! bytes between processes itself (the [`Transport`] does) nor take GPU tensors: a ring
//! backend named for `cuda` stages them through host memory before they reach it.
use super::elementwise::{check_reducible, divide, reduce_into, split};
use super::transport::{Block, ShmTransport, TcpTransport, Transport};
use super::{check_list, check_rank, comm_text, GroupSetup, ProcessGroup, ReduceOp, Store, Work};
use crate::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// Bytes of each piece of broadcast's pipeline.
const PIECE_BYTES: usize = 1 << 20;

type Job = Box<dyn FnOnce(&mut dyn Transport) -> Result<()> + Send>;

/// A group whose collectives run as ring algorithms over one transport.
pub struct RingGroup {
    rank: usize,
    size: usize,
    backend: &'static str,
    timeout: Duration,
    /// The transport lets peers read [`super::shared::Heap`] allocations in place.
    shares_memory: bool,
    jobs: Option<Sender<(Job, Work)>>,
    worker: Option<JoinHandle<()>>,
    /// Jobs submitted and not yet finished.
    in_flight: Arc<AtomicUsize>,
}

impl RingGroup {
    pub fn shm(setup: &GroupSetup) -> Result<RingGroup> {
        Self::start("shm", Box::new(ShmTransport::connect(setup)?), setup)
    }

    pub fn tcp(setup: &GroupSetup) -> Result<RingGroup> {
        Self::start("tcp", Box::new(TcpTransport::connect(setup)?), setup)
    }

    #[cfg(feature = "mpi")]
    pub fn mpi(setup: &GroupSetup) -> Result<RingGroup> {
        Self::start("mpi", Box::new(super::mpi::MpiTransport::connect(setup)?), setup)
    }

    fn start(backend: &'static str, mut transport: Box<dyn Transport>, setup: &GroupSetup) -> Result<RingGroup> {
        let (rank, size, timeout) = (transport.rank(), transport.size(), setup.timeout);
        let shares_memory = transport.shares_memory();
        let (store, failure_key) = (setup.store.clone(), format!("{}failure", setup.prefix));
        let (tx, rx) = channel::<(Job, Work)>();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let finished = in_flight.clone();
        let worker = std::thread::Builder::new()
            .name(format!("strata-{backend}-{rank}"))
            .spawn(move || {
                // After a failure the peers are out of step: every later call fails too.
                let mut broken: Option<String> = None;
                while let Some((job, work)) = next_job(&rx) {
                    let result = match &broken {
                        Some(first) => Err(Error::Comm(format!("group unusable after an earlier failure: {first}"))),
                        None => job(transport.as_mut()).map_err(|e| first_failure(&store, &failure_key, e)),
                    };
                    if let Err(e) = &result {
                        broken.get_or_insert_with(|| e.to_string());
                    }
                    finished.fetch_sub(1, Ordering::AcqRel);
                    work.finish(result);
                }
            })
            .map_err(|e| Error::Comm(format!("cannot start the {backend} thread: {e}")))?;
        Ok(RingGroup { rank, size, backend, timeout, shares_memory, jobs: Some(tx), worker: Some(worker), in_flight })
    }

    fn submit(&self, job: impl FnOnce(&mut dyn Transport) -> Result<()> + Send + 'static) -> Result<Work> {
        let work = Work::pending(self.timeout);
        let jobs = self.jobs.as_ref().ok_or_else(|| Error::Comm("group is shut down".into()))?;
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        if jobs.send((Box::new(job), work.clone())).is_err() {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Comm("group worker has stopped".into()));
        }
        Ok(work)
    }
}

impl Drop for RingGroup {
    /// Waits for the worker where it is idle. A job still running (a peer that failed or
    /// went away, and the job gave up on the group) is left to end at its timeout on its
    /// own: the worker then finds no more jobs and stops, and nobody waits for it here.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(w) = self.worker.take() {
            if self.in_flight.load(Ordering::Acquire) == 0 {
                let _ = w.join();
            }
        }
    }
}

/// How long a group's worker spins for its next job before it blocks: a blocked thread's
/// wake-up costs tens of microseconds, more than a small collective takes, while spinning
/// longer would take a core from the ranks computing.
const SPIN_BEFORE_BLOCKING: Duration = Duration::from_micros(50);

/// The next job, spinning briefly first: collectives usually come in quick succession.
fn next_job(rx: &Receiver<(Job, Work)>) -> Option<(Job, Work)> {
    let start = Instant::now();
    while start.elapsed() < SPIN_BEFORE_BLOCKING {
        match rx.try_recv() {
            Ok(next) => return Some(next),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => std::hint::spin_loop(),
        }
    }
    rx.recv().ok()
}

/// Names the root cause of a failure. When a peer dies, its neighbours fail first and exit,
/// and ranks further along then see those neighbours go. The first failure of the group is
/// recorded in the store (first writer wins), and every later one reports it.
fn first_failure(store: &Store, key: &str, mine: Error) -> Error {
    let text = comm_text(mine);
    match store.compare_set(key, b"", text.as_bytes()) {
        Ok(first) if first != text.as_bytes() => {
            Error::Comm(format!("{} (reported first; here: {text})", String::from_utf8_lossy(&first)))
        }
        _ => Error::Comm(text),
    }
}

/// A contiguous CPU tensor's memory, kept alive by a shallow clone.
struct Buffer {
    _tensor: Tensor,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is into a tensor kept alive by `_tensor`; the caller of a collective
// promises not to touch the tensor until the work completes.
unsafe impl Send for Buffer {}

impl Buffer {
    fn of(t: &Tensor, backend: &str) -> Result<Buffer> {
        if t.device() != Device::Cpu || !t.is_contiguous() {
            return Err(Error::Comm(format!("backend {backend} needs contiguous CPU tensors, got {:?}", t.device())));
        }
        let len = t.numel() * t.kind().elt_size_in_bytes();
        let ptr = t.data_ptr() as *mut u8;
        if ptr.is_null() && len > 0 {
            return Err(Error::Comm(format!("backend {backend}: a tensor of {len} bytes has no memory (released)")));
        }
        Ok(Buffer { _tensor: t.shallow_clone(), ptr, len })
    }

    fn block(&self, range: std::ops::Range<usize>) -> Block {
        debug_assert!(range.end <= self.len);
        // SAFETY: the range lies within the buffer.
        Block { ptr: unsafe { self.ptr.add(range.start) }, len: range.len() }
    }

    fn whole(&self) -> Block {
        self.block(0..self.len)
    }
}

/// Scratch memory aligned for every element type.
fn scratch(bytes: usize) -> Vec<u64> {
    vec![0u64; bytes.div_ceil(8)]
}

fn scratch_block(v: &mut [u64], len: usize) -> Block {
    Block { ptr: v.as_mut_ptr() as *mut u8, len }
}

/// Ring reduce-scatter: afterwards block `rank` holds the reduction of every rank's block.
fn reduce_scatter_ring(tr: &mut dyn Transport, blocks: &[Block], kind: Kind, op: ReduceOp) -> Result<()> {
    let (r, n) = (tr.rank(), tr.size());
    if n == 1 {
        return Ok(());
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut tmp = scratch(blocks.iter().map(|b| b.len).max().unwrap_or(0));
    for s in 0..n - 1 {
        let (send, recv) = ((r + 2 * n - s - 1) % n, (r + 2 * n - s - 2) % n);
        let incoming = scratch_block(&mut tmp, blocks[recv].len);
        tr.exchange(next, blocks[send].bytes(), prev, incoming.bytes_mut())?;
        reduce_into(kind, op, blocks[recv].bytes_mut(), incoming.bytes());
    }
    Ok(())
}

/// Ring all-gather: block `rank` of every rank ends up in every rank's blocks.
fn all_gather_ring(tr: &mut dyn Transport, blocks: &[Block]) -> Result<()> {
    let (r, n) = (tr.rank(), tr.size());
    if n == 1 {
        return Ok(());
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let (send, recv) = ((r + n - s) % n, (r + 2 * n - s - 1) % n);
        tr.exchange(next, blocks[send].bytes(), prev, blocks[recv].bytes_mut())?;
    }
    Ok(())
}

impl ProcessGroup for RingGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &str {
        self.backend
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let kind = tensor.kind();
        check_reducible(kind, op)?;
        let buf = Buffer::of(tensor, self.backend)?;
        let ranges = split(tensor.numel(), self.size, kind.elt_size_in_bytes());
        self.submit(move |tr| {
            if let Some(done) = tr.native_all_reduce(buf.whole().bytes_mut(), kind, op) {
                return done;
            }
            let blocks: Vec<Block> = ranges.iter().map(|r| buf.block(r.clone())).collect();
            reduce_scatter_ring(tr, &blocks, kind, op)?;
            if op == ReduceOp::Avg {
                divide(kind, blocks[tr.rank()].bytes_mut(), tr.size());
            }
            all_gather_ring(tr, &blocks)
        })
    }

    fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        check_list(self.size, "all_gather outputs", outputs)?;
        let mine = &outputs[self.rank];
        if mine.numel() != input.numel() || mine.kind() != input.kind() {
            return Err(Error::Comm(format!(
                "all_gather: output {} holds {} {:?} elements but the input has {} {:?}",
                self.rank,
                mine.numel(),
                mine.kind(),
                input.numel(),
                input.kind()
            )));
        }
        let outs = outputs.iter().map(|t| Buffer::of(t, self.backend)).collect::<Result<Vec<_>>>()?;
        let inp = Buffer::of(input, self.backend)?;
        let rank = self.rank;
        self.submit(move |tr| {
            let blocks: Vec<Block> = outs.iter().map(Buffer::whole).collect();
            if let Some(done) = tr.native_all_gather(&blocks, inp.whole()) {
                return done;
            }
            // In place when the input already is this rank's output (a shard of the buffer).
            if outs[rank].ptr != inp.ptr {
                outs[rank].whole().bytes_mut().copy_from_slice(inp.whole().bytes());
            }
            all_gather_ring(tr, &blocks)
        })
    }

    fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        check_list(self.size, "reduce_scatter inputs", inputs)?;
        let kind = output.kind();
        check_reducible(kind, op)?;
        if inputs.iter().any(|t| t.kind() != kind) || inputs[self.rank].numel() != output.numel() {
            return Err(Error::Comm(format!(
                "reduce_scatter: inputs must be {kind:?} and input {} must match the output's {} elements",
                self.rank,
                output.numel()
            )));
        }
        let ins = inputs.iter().map(|t| Buffer::of(t, self.backend)).collect::<Result<Vec<_>>>()?;
        let out = Buffer::of(output, self.backend)?;
        self.submit(move |tr| {
            let inputs: Vec<Block> = ins.iter().map(Buffer::whole).collect();
            if let Some(done) = tr.native_reduce_scatter(&inputs, out.whole(), kind, op) {
                return done;
            }
            // The inputs stay untouched: reduce in a scratch copy.
            let total: usize = ins.iter().map(|b| b.len).sum();
            let mut work = scratch(total);
            let mut blocks = Vec::with_capacity(ins.len());
            let mut at = 0;
            for b in &ins {
                let block = Block { ptr: unsafe { (work.as_mut_ptr() as *mut u8).add(at) }, len: b.len };
                block.bytes_mut().copy_from_slice(b.whole().bytes());
                blocks.push(block);
                at += b.len;
            }
            reduce_scatter_ring(tr, &blocks, kind, op)?;
            let mine = blocks[tr.rank()];
            if op == ReduceOp::Avg {
                divide(kind, mine.bytes_mut(), tr.size());
            }
            out.whole().bytes_mut().copy_from_slice(mine.bytes());
            Ok(())
        })
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        check_rank(self.size, "broadcast root", root)?;
        let buf = Buffer::of(tensor, self.backend)?;
        self.submit(move |tr| {
            if let Some(done) = tr.native_broadcast(buf.whole().bytes_mut(), root) {
                return done;
            }
            let (r, n) = (tr.rank(), tr.size());
            let pos = (r + n - root) % n;
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            for piece in buf.whole().bytes_mut().chunks_mut(PIECE_BYTES) {
                if pos > 0 {
                    tr.recv(prev, piece)?;
                }
                if pos + 1 < n {
                    tr.send(next, piece)?;
                }
            }
            Ok(())
        })
    }

    fn reduce(&self, tensor: &Tensor, root: usize, op: ReduceOp) -> Result<Work> {
        check_rank(self.size, "reduce root", root)?;
        let kind = tensor.kind();
        check_reducible(kind, op)?;
        let buf = Buffer::of(tensor, self.backend)?;
        let ranges = split(tensor.numel(), self.size, kind.elt_size_in_bytes());
        self.submit(move |tr| {
            let (r, n) = (tr.rank(), tr.size());
            let mut copy = scratch(buf.len);
            let base = copy.as_mut_ptr() as *mut u8;
            base_copy(base, &buf);
            let blocks: Vec<Block> =
                ranges.iter().map(|g| Block { ptr: unsafe { base.add(g.start) }, len: g.len() }).collect();
            reduce_scatter_ring(tr, &blocks, kind, op)?;
            if op == ReduceOp::Avg {
                divide(kind, blocks[r].bytes_mut(), n);
            }
            if r != root {
                return tr.send(root, blocks[r].bytes());
            }
            for (p, range) in ranges.iter().enumerate() {
                let target = buf.block(range.clone()).bytes_mut();
                if p == root {
                    target.copy_from_slice(blocks[p].bytes());
                } else {
                    tr.recv(p, target)?;
                }
            }
            Ok(())
        })
    }

    fn send(&self, tensor: &Tensor, peer: usize) -> Result<Work> {
        check_rank(self.size, "send peer", peer)?;
        let buf = Buffer::of(tensor, self.backend)?;
        self.submit(move |tr| tr.send(peer, buf.whole().bytes()))
    }

    fn recv(&self, tensor: &Tensor, peer: usize) -> Result<Work> {
        check_rank(self.size, "recv peer", peer)?;
        let buf = Buffer::of(tensor, self.backend)?;
        self.submit(move |tr| tr.recv(peer, buf.whole().bytes_mut()))
    }

    fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor]) -> Result<Work> {
        check_list(self.size, "all_to_all outputs", outputs)?;
        check_list(self.size, "all_to_all inputs", inputs)?;
        let r = self.rank;
        if outputs[r].numel() != inputs[r].numel() || outputs[r].kind() != inputs[r].kind() {
            return Err(Error::Comm(format!("all_to_all: output {r} and input {r} differ in size or dtype")));
        }
        let outs = outputs.iter().map(|t| Buffer::of(t, self.backend)).collect::<Result<Vec<_>>>()?;
        let ins = inputs.iter().map(|t| Buffer::of(t, self.backend)).collect::<Result<Vec<_>>>()?;
        self.submit(move |tr| {
            let n = tr.size();
            outs[r].whole().bytes_mut().copy_from_slice(ins[r].whole().bytes());
            for s in 1..n {
                let (to, from) = ((r + s) % n, (r + n - s) % n);
                tr.exchange(to, ins[to].whole().bytes(), from, outs[from].whole().bytes_mut())?;
            }
            Ok(())
        })
    }

    fn alloc(&self, numel: i64, kind: Kind, device: Device) -> Result<Option<Tensor>> {
        if !self.shares_memory || device != Device::Cpu {
            return Ok(None);
        }
        super::shared::Heap::get().alloc(numel, kind).map(Some)
    }

    fn barrier(&self) -> Result<Work> {
        self.submit(|tr| {
            let mut marks = vec![0u8; tr.size()];
            let base = marks.as_mut_ptr();
            let blocks: Vec<Block> = (0..tr.size()).map(|i| Block { ptr: unsafe { base.add(i) }, len: 1 }).collect();
            all_gather_ring(tr, &blocks)
        })
    }
}

fn base_copy(dst: *mut u8, src: &Buffer) {
    if src.len == 0 {
        return;
    }
    // SAFETY: `dst` is scratch of at least `src.len` bytes, distinct from the tensor.
    unsafe { std::ptr::copy_nonoverlapping(src.ptr, dst, src.len) }
}
