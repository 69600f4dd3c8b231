//! Communication between ranks.
//!
//! Owns: the [`ProcessGroup`] trait (collectives on tensors, each returning a [`Work`]
//! handle), the built-in backends (`shm` between processes of one host, `tcp` between
//! hosts, and `mpi` with the cargo feature of that name, each a byte [`transport`] under the
//! shared ring algorithms, which a transport may replace with its own collectives: shm
//! all-reduces, reduce-scatters, all-gathers and broadcasts (from 4 MiB) its own way, MPI
//! all-reduces; and `nccl` for CUDA tensors), the backend
//! registry and per-device dispatch (`"cpu:shm,cuda:nccl"`; a ring backend named for `cuda`
//! stages GPU tensors through pinned host memory), the rendezvous [`store`], and reading a
//! rank's identity from the environment (`strata launch`, torchrun, Slurm, Open MPI). Must
//! not know about models or strategies: it moves and reduces tensors.

mod algorithms;
mod auth;
mod elementwise;
mod env;
#[cfg(feature = "mpi")]
mod mpi;
mod nccl;
mod shared;
mod staged;
pub mod store;
pub mod transport;

pub use env::{init_from_env, launched_world_size, RankInfo, Rendezvous};

/// Releases what the backends hold for the whole process and would otherwise release in
/// its exit handlers (MPI's finalisation), for a process about to end without running them
/// (`_exit`). Every group must be gone by then.
pub fn finish_process() {
    #[cfg(feature = "mpi")]
    mpi::finalize_at_exit();
}
pub use store::{Store, StoreServer};

use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// How `all_reduce`, `reduce` and `reduce_scatter` combine values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Sum divided by the group size (floating-point tensors only).
    Avg,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
}

/// Nanoseconds the threads of this process have spent blocked in [`Work::wait`]: the
/// communication that computation did not hide.
static WAITED_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Time this process has spent waiting for collectives to complete, in total. The
/// difference over a training step is its exposed communication.
pub fn time_waited() -> Duration {
    Duration::from_nanos(WAITED_NS.load(std::sync::atomic::Ordering::Relaxed))
}

/// A collective as observed: the operation, its group, the bytes it moves or reduces (the
/// larger side: every rank's pieces of a gather or a reduce-scatter), when it was issued and
/// when it finished (for a CUDA collective: when a wait first saw it done).
#[derive(Clone, Debug)]
pub struct Collective {
    /// The operation's name (e.g. `all_reduce`).
    pub op: &'static str,
    /// The group's name in observations.
    pub group: Arc<str>,
    /// Bytes moved or reduced, the larger side.
    pub bytes: u64,
    /// When the collective was issued.
    pub issued: Instant,
    /// When it finished (for a CUDA collective: when a wait first saw it done).
    pub finished: Instant,
}

/// A thread blocked on a collective from `began` to `ended`.
#[derive(Clone, Debug)]
pub struct Waited {
    /// The operation's name (e.g. `all_reduce`).
    pub op: &'static str,
    /// The group's name in observations.
    pub group: Arc<str>,
    /// When the wait began.
    pub began: Instant,
    /// When the wait ended.
    pub ended: Instant,
}

/// Receives every collective of a [`Comm`]'s groups as it finishes, and every wait that
/// blocked on one ([`Comm::observe`]); from whichever thread finished or waited.
pub trait CommObserver: Send + Sync {
    /// Called once per collective, when it finishes.
    fn collective(&self, collective: &Collective);
    /// Called for every wait that blocked on a collective.
    fn waited(&self, waited: &Waited);
}

/// The observer a [`Comm`] and every group it made share, settable after they exist.
type ObserverSlot = Arc<std::sync::RwLock<Option<Arc<dyn CommObserver>>>>;

/// One observed operation: reported once, when it finishes.
struct Watch {
    observer: Arc<dyn CommObserver>,
    op: &'static str,
    group: Arc<str>,
    bytes: u64,
    issued: Instant,
    reported: std::sync::atomic::AtomicBool,
}

impl Watch {
    fn finished(&self, at: Instant) {
        if !self.reported.swap(true, std::sync::atomic::Ordering::AcqRel) {
            let (op, group, bytes, issued) = (self.op, self.group.clone(), self.bytes, self.issued);
            self.observer.collective(&Collective { op, group, bytes, issued, finished: at });
        }
    }
}

/// Completion of an asynchronous collective.
#[derive(Default)]
struct Completion {
    result: Mutex<Option<(std::result::Result<(), String>, Instant)>>,
    done: Condvar,
    /// Told when the result arrives; attached after the operation was queued, so whichever
    /// of attaching and finishing comes second reports (see [`Work::finish`]).
    watch: Mutex<Option<Arc<Watch>>>,
}

/// Where an operation runs: on a host thread of the group, or queued on a CUDA stream.
#[derive(Clone)]
enum Pending {
    Host(Arc<Completion>),
    Device(Arc<strata_ext::cuda::Event>),
}

/// Handle of an operation that may still be running. The tensors it was given must not be
/// read or written until it has completed.
#[derive(Clone)]
pub struct Work {
    pending: Pending,
    timeout: Duration,
    watch: Option<Arc<Watch>>,
    given_up: Option<Arc<GivenUp>>,
}

/// Where the job records that it gave up on an attempt ([`Attempt::give_up`]): a wait on
/// the work of a group the attempt made, or for a peer making one, looks there once it has
/// lasted `GIVEN_UP_POLL`, so the ranks a failed rank leaves waiting fail at once instead
/// of at the group's timeout.
#[derive(Clone)]
pub struct GivenUp {
    store: Arc<Store>,
    key: String,
}

/// How often a blocked wait looks whether the job gave up on its group.
const GIVEN_UP_POLL: Duration = Duration::from_secs(1);

/// A wait's looks at whether the job gave up: at most one a [`GIVEN_UP_POLL`], the first
/// once the wait has lasted that long, none where nothing can be given up.
pub(crate) struct GivenUpLooks<'a> {
    given_up: Option<&'a GivenUp>,
    next: Instant,
}

impl<'a> GivenUpLooks<'a> {
    pub(crate) fn new(given_up: Option<&'a GivenUp>) -> Self {
        GivenUpLooks { given_up, next: Instant::now() + GIVEN_UP_POLL }
    }

    /// Fails, naming why, where a look is due and finds that the job gave up.
    pub(crate) fn look(&mut self, now: Instant) -> Result<()> {
        match self.given_up {
            Some(given_up) if now >= self.next => {
                self.next = now + GIVEN_UP_POLL;
                given_up.check()
            }
            _ => Ok(()),
        }
    }

    /// How long to block before the next look, at most `left`.
    fn slice(&self, left: Duration) -> Duration {
        if self.given_up.is_some() {
            left.min(GIVEN_UP_POLL)
        } else {
            left
        }
    }
}

impl GivenUp {
    /// An error naming why, where the job gave up.
    fn check(&self) -> Result<()> {
        match self.reason()? {
            Some(why) => Err(Error::Comm(format!("the job gave up on this group: {why}"))),
            None => Ok(()),
        }
    }

    /// The reason the job gave up, if it did.
    fn reason(&self) -> Result<Option<String>> {
        if !self.store.check(&[&self.key])? {
            return Ok(None);
        }
        Ok(Some(String::from_utf8_lossy(&self.store.get(&self.key)?).into_owned()))
    }
}

impl Work {
    fn pending(timeout: Duration) -> Work {
        Work { pending: Pending::Host(Arc::default()), timeout, watch: None, given_up: None }
    }

    /// A handle of work already done (an operation that needed no communication).
    pub fn done() -> Work {
        let w = Work::pending(Duration::ZERO);
        w.finish(Ok(()));
        w
    }

    /// Completes when the device reaches `event`.
    fn on_device(event: strata_ext::cuda::Event, timeout: Duration) -> Work {
        Work { pending: Pending::Device(Arc::new(event)), timeout, watch: None, given_up: None }
    }

    fn finish(&self, result: Result<()>) {
        if let Pending::Host(c) = &self.pending {
            let now = Instant::now();
            // Finishing and attaching (`watched`) each hold the watch's lock while they look
            // at the result, so exactly one of them reports; finishing reports before the
            // result is visible, so whoever waited finds the collective already reported.
            let mut watch = c.watch.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(w) = watch.take() {
                w.finished(now);
            }
            *c.result.lock().unwrap_or_else(|e| e.into_inner()) = Some((result.map_err(comm_text), now));
            drop(watch);
            c.done.notify_all();
        }
    }

    /// This work, reporting to `watch` when it finishes and when a wait blocks on it.
    fn watched(mut self, watch: Watch) -> Work {
        let watch = Arc::new(watch);
        if let Pending::Host(c) = &self.pending {
            let mut slot = c.watch.lock().unwrap_or_else(|e| e.into_inner());
            match c.result.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                Some((_, at)) => watch.finished(*at),
                None => *slot = Some(watch.clone()),
            }
        }
        self.watch = Some(watch);
        self
    }

    /// Whether the work has finished, without waiting.
    pub fn is_completed(&self) -> bool {
        match &self.pending {
            Pending::Host(c) => c.result.lock().unwrap_or_else(|e| e.into_inner()).is_some(),
            Pending::Device(e) => e.query().unwrap_or(true),
        }
    }

    /// Waits for completion up to the group's timeout.
    pub fn wait(&self) -> Result<()> {
        self.wait_timeout(self.timeout)
    }

    /// Waits for completion up to `timeout`.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        // Only an observed wait needs to know whether it blocked.
        let blocks = self.watch.is_some() && !self.is_completed();
        let result = self.block_until_done(timeout);
        let end = Instant::now();
        WAITED_NS.fetch_add((end - start).as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        if let Some(w) = &self.watch {
            if matches!(self.pending, Pending::Device(_)) && result.is_ok() {
                w.finished(end);
            }
            if blocks {
                let (op, group) = (w.op, w.group.clone());
                w.observer.waited(&Waited { op, group, began: start, ended: end });
            }
        }
        result
    }

    fn block_until_done(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut looks = GivenUpLooks::new(self.given_up.as_deref());
        let completion = match &self.pending {
            Pending::Host(c) => c,
            Pending::Device(event) => {
                while !event.query()? {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Error::Comm(format!("device collective did not complete within {timeout:?}")));
                    }
                    looks.look(now)?;
                    std::thread::sleep(Duration::from_micros(50));
                }
                return Ok(());
            }
        };
        let mut slot = completion.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some((r, _)) = slot.as_ref() {
                return r.clone().map_err(Error::Comm);
            }
            let now = Instant::now();
            let Some(left) = deadline.checked_duration_since(now) else {
                return Err(Error::Comm(format!("collective did not complete within {timeout:?}")));
            };
            looks.look(now)?;
            slot = completion.done.wait_timeout(slot, looks.slice(left)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// Whether `t`'s bytes lie in memory a group allocated for its peers to read in place
/// ([`ProcessGroup::alloc`]).
pub fn in_shared_memory(t: &Tensor) -> bool {
    t.device() == Device::Cpu && shared::Heap::get().locate(t.data_ptr() as *const u8, bytes_of(t) as usize).is_some()
}

/// Copies `src` into `dst` as the shm collectives write large outputs (all but the arena
/// reduce-scatter's, which uses ordinary stores): with streaming stores that bypass the
/// cache. `strata bench comm` measures it beside memcpy, as the fastest a copy gets on the
/// machine. Panics, like `copy_from_slice`, if the lengths differ.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: slices of different lengths");
    // SAFETY: two distinct slices (one borrowed mutably) of the same length.
    unsafe { elementwise::copy_bytes(dst.as_mut_ptr(), src.as_ptr(), src.len(), true) }
}

/// All-reduces a few host numbers over `group` and waits: agreement on flags, norms,
/// timings and statistics rather than tensor data.
pub fn all_reduce_values(group: &dyn ProcessGroup, values: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
    let t = Tensor::from_slice(values);
    group.all_reduce(&t, op)?.wait()?;
    Ok(Vec::<f64>::try_from(&t)?)
}

/// Every rank's few host numbers (as many on each), in rank order, waited for.
pub fn all_gather_values(group: &dyn ProcessGroup, values: &[f64]) -> Result<Vec<f64>> {
    let t = Tensor::from_slice(values);
    let outputs = (0..group.size()).map(|_| t.f_empty_like()).collect::<std::result::Result<Vec<_>, _>>()?;
    group.all_gather(&outputs, &t)?.wait()?;
    let mut all = Vec::with_capacity(values.len() * group.size());
    for o in &outputs {
        all.extend(Vec::<f64>::try_from(o)?);
    }
    Ok(all)
}

/// An error's message without the "communication:" prefix it would get again when it is
/// wrapped back into [`Error::Comm`].
fn comm_text(e: Error) -> String {
    match e {
        Error::Comm(m) => m,
        other => other.to_string(),
    }
}

/// Checks that rank `r` (a root or peer) exists in a group of `size`.
fn check_rank(size: usize, what: &str, r: usize) -> Result<()> {
    if r >= size {
        return Err(Error::Comm(format!("{what} {r} is outside a group of {size}")));
    }
    Ok(())
}

/// Checks that a per-rank tensor list has one tensor per rank.
fn check_list(size: usize, what: &str, list: &[Tensor]) -> Result<()> {
    if list.len() != size {
        return Err(Error::Comm(format!("{what} has {} tensors for a group of {size}", list.len())));
    }
    Ok(())
}

fn unsupported(backend: &str, op: &str) -> Error {
    Error::Comm(format!("backend {backend} does not support {op}"))
}

/// Collectives over a fixed set of ranks. Every rank of the group must issue the same
/// operations in the same order. A backend implements what it supports; the rest report
/// that clearly.
pub trait ProcessGroup: Send + Sync {
    /// This process's rank within the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// The backend's registered name.
    fn backend(&self) -> &str;

    /// Combines `tensor` across ranks, in place on every rank.
    fn all_reduce(&self, _tensor: &Tensor, _op: ReduceOp) -> Result<Work> {
        Err(unsupported(self.backend(), "all_reduce"))
    }
    /// Fills `outputs[r]` with rank r's `input` (sizes may differ between ranks).
    fn all_gather(&self, _outputs: &[Tensor], _input: &Tensor) -> Result<Work> {
        Err(unsupported(self.backend(), "all_gather"))
    }
    /// Reduces `inputs[r]` of every rank into `output` of rank r.
    fn reduce_scatter(&self, _output: &Tensor, _inputs: &[Tensor], _op: ReduceOp) -> Result<Work> {
        Err(unsupported(self.backend(), "reduce_scatter"))
    }
    /// Copies `tensor` of rank `root` to every rank.
    fn broadcast(&self, _tensor: &Tensor, _root: usize) -> Result<Work> {
        Err(unsupported(self.backend(), "broadcast"))
    }
    /// Combines `tensor` across ranks into rank `root`'s; the others' stay unchanged.
    fn reduce(&self, _tensor: &Tensor, _root: usize, _op: ReduceOp) -> Result<Work> {
        Err(unsupported(self.backend(), "reduce"))
    }
    /// Sends `tensor` to rank `peer` of the group.
    fn send(&self, _tensor: &Tensor, _peer: usize) -> Result<Work> {
        Err(unsupported(self.backend(), "send"))
    }
    /// Receives rank `peer`'s tensor into `tensor`.
    fn recv(&self, _tensor: &Tensor, _peer: usize) -> Result<Work> {
        Err(unsupported(self.backend(), "recv"))
    }
    /// Sends `inputs[r]` to rank r and receives rank r's piece into `outputs[r]`.
    fn all_to_all(&self, _outputs: &[Tensor], _inputs: &[Tensor]) -> Result<Work> {
        Err(unsupported(self.backend(), "all_to_all"))
    }
    /// Completes once every rank of the group has reached it.
    fn barrier(&self) -> Result<Work> {
        Err(unsupported(self.backend(), "barrier"))
    }
    /// A zeroed 1-D tensor on `device` placed where this group's collectives move it
    /// cheapest (the `shm` backend: host memory its peers read in place, so a collective
    /// whose buffers all live there stages nothing), or `None` where nothing beats ordinary
    /// memory on that device. Every rank must place a collective's buffers alike. Meant
    /// for buffers that live as long as training: peers keep what they mapped until the
    /// group goes.
    fn alloc(&self, _numel: i64, _kind: Kind, _device: Device) -> Result<Option<Tensor>> {
        Ok(None)
    }
}

/// What a backend factory receives to build a group.
pub struct GroupSetup {
    /// The job's rendezvous store.
    pub store: Arc<Store>,
    /// Store keys of this group start with it; unique per group.
    pub prefix: String,
    /// This process's rank within the group.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
    /// The group's members as ranks of the whole job, in group order.
    pub ranks: Vec<usize>,
    /// Ranks in the whole job.
    pub world_size: usize,
    /// Timeout of every wait.
    pub timeout: Duration,
    /// Where the job says it gave up on the work making this group (`None`: work it
    /// never gives up on).
    pub given_up: Option<GivenUp>,
}

impl GroupSetup {
    /// The value of `key`, waiting for a peer to set it as [`Store::get`] does; an error
    /// within `GIVEN_UP_POLL` where the job gives up on the work making this group.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let Some(given_up) = &self.given_up else { return self.store.get(key) };
        let deadline = Instant::now() + self.store.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.store.check(&[key])? {
                return self.store.get_timeout(key, left);
            }
            given_up.check()?;
            // A timeout here is the poll's; the next round tells.
            let _ = self.store.wait(&[key], left.min(GIVEN_UP_POLL));
        }
    }

    /// Looks at whether the job gave up on the work making this group, for a wait of the
    /// backend's own (at most once a poll).
    pub(crate) fn given_up_looks(&self) -> GivenUpLooks<'_> {
        GivenUpLooks::new(self.given_up.as_ref())
    }
}

/// Builds a backend's group.
pub type BackendFactory = Arc<dyn Fn(&GroupSetup) -> Result<Box<dyn ProcessGroup>> + Send + Sync>;

fn registry() -> &'static Mutex<HashMap<String, BackendFactory>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, BackendFactory>>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut m: HashMap<String, BackendFactory> = HashMap::new();
        m.insert(
            "shm".into(),
            Arc::new(|s: &GroupSetup| Ok(Box::new(algorithms::RingGroup::shm(s)?) as Box<dyn ProcessGroup>)),
        );
        m.insert(
            "tcp".into(),
            Arc::new(|s: &GroupSetup| Ok(Box::new(algorithms::RingGroup::tcp(s)?) as Box<dyn ProcessGroup>)),
        );
        m.insert(
            "nccl".into(),
            Arc::new(|s: &GroupSetup| Ok(Box::new(nccl::NcclGroup::connect(s)?) as Box<dyn ProcessGroup>)),
        );
        #[cfg(feature = "mpi")]
        m.insert(
            "mpi".into(),
            Arc::new(|s: &GroupSetup| Ok(Box::new(algorithms::RingGroup::mpi(s)?) as Box<dyn ProcessGroup>)),
        );
        Mutex::new(m)
    })
}

/// Makes a backend available by name (to spec strings such as `"cpu:mine"`).
pub fn register_backend(name: &str, factory: BackendFactory) {
    registry().lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), factory);
}

fn factory(name: &str) -> Result<BackendFactory> {
    let reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    reg.get(name).cloned().ok_or_else(|| {
        let mut known: Vec<&String> = reg.keys().collect();
        known.sort();
        Error::Comm(format!("unknown backend {name:?}; registered: {known:?}"))
    })
}

/// Parses `"cpu:shm,cuda:nccl"` (or a bare backend name, meaning CPU) into
/// (device type, backend) pairs.
pub fn parse_backend_spec(spec: &str) -> Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (device, backend) = part.split_once(':').unwrap_or(("cpu", part));
        if !matches!(device, "cpu" | "cuda") {
            return Err(Error::Comm(format!(
                "unknown device type {device:?} in backend spec {spec:?}; expected cpu or cuda"
            )));
        }
        if out.iter().any(|(d, _)| d == device) {
            return Err(Error::Comm(format!("device type {device} named twice in backend spec {spec:?}")));
        }
        out.push((device.to_string(), backend.to_string()));
    }
    if out.is_empty() {
        return Err(Error::Comm("empty backend spec".into()));
    }
    Ok(out)
}

/// Routes each call to the backend of its tensors' device type.
struct DeviceDispatch {
    name: String,
    by_device: Vec<(String, Box<dyn ProcessGroup>)>,
    /// How observed collectives name this group.
    label: Arc<str>,
    observer: ObserverSlot,
    given_up: Option<Arc<GivenUp>>,
}

impl DeviceDispatch {
    fn pick(&self, t: &Tensor) -> Result<&dyn ProcessGroup> {
        let device = match t.device() {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
            other => return Err(Error::Comm(format!("no backend for tensors on {other:?}"))),
        };
        self.by_device
            .iter()
            .find(|(d, _)| d == device)
            .map(|(_, g)| g.as_ref())
            .ok_or_else(|| Error::Comm(format!("backend spec {:?} has no backend for {device} tensors", self.name)))
    }

    fn first(&self) -> &dyn ProcessGroup {
        self.by_device[0].1.as_ref()
    }

    /// Runs `call` (issuing `op` over `bytes`), its work watched by the observer if any.
    fn observed(&self, op: &'static str, bytes: u64, call: impl FnOnce() -> Result<Work>) -> Result<Work> {
        let observer = self.observer.read().unwrap_or_else(|e| e.into_inner()).clone();
        let issued = Instant::now();
        let mut work = call()?;
        work.given_up = self.given_up.clone();
        Ok(match observer {
            Some(observer) => work.watched(Watch {
                observer,
                op,
                group: self.label.clone(),
                bytes,
                issued,
                reported: Default::default(),
            }),
            None => work,
        })
    }
}

fn bytes_of(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

fn bytes_of_all(list: &[Tensor]) -> u64 {
    list.iter().map(bytes_of).sum()
}

impl ProcessGroup for DeviceDispatch {
    fn rank(&self) -> usize {
        self.first().rank()
    }
    fn size(&self) -> usize {
        self.first().size()
    }
    fn backend(&self) -> &str {
        &self.name
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        self.observed("all_reduce", bytes_of(t), || self.pick(t)?.all_reduce(t, op))
    }
    fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        self.observed("all_gather", bytes_of_all(outputs), || self.pick(input)?.all_gather(outputs, input))
    }
    fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        self.observed("reduce_scatter", bytes_of_all(inputs), || self.pick(output)?.reduce_scatter(output, inputs, op))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Work> {
        self.observed("broadcast", bytes_of(t), || self.pick(t)?.broadcast(t, root))
    }
    fn reduce(&self, t: &Tensor, root: usize, op: ReduceOp) -> Result<Work> {
        self.observed("reduce", bytes_of(t), || self.pick(t)?.reduce(t, root, op))
    }
    fn send(&self, t: &Tensor, peer: usize) -> Result<Work> {
        self.observed("send", bytes_of(t), || self.pick(t)?.send(t, peer))
    }
    fn recv(&self, t: &Tensor, peer: usize) -> Result<Work> {
        self.observed("recv", bytes_of(t), || self.pick(t)?.recv(t, peer))
    }
    fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor]) -> Result<Work> {
        self.observed("all_to_all", bytes_of_all(inputs), || match inputs.first() {
            Some(t) => self.pick(t)?.all_to_all(outputs, inputs),
            None => self.first().all_to_all(outputs, inputs),
        })
    }
    fn barrier(&self) -> Result<Work> {
        self.observed("barrier", 0, || self.first().barrier())
    }
    fn alloc(&self, numel: i64, kind: Kind, device: Device) -> Result<Option<Tensor>> {
        let wanted = if device.is_cuda() { "cuda" } else { "cpu" };
        match self.by_device.iter().find(|(d, _)| d == wanted) {
            Some((_, g)) => g.alloc(numel, kind, device),
            None => Ok(None),
        }
    }
}

/// Work whose groups the job gives up on together where it fails on a rank
/// ([`Comm::attempt`]): a dry run of a search.
pub struct Attempt<'a> {
    comm: &'a Comm,
    given_up: GivenUp,
}

impl Attempt<'_> {
    /// Records, for every rank, that the job gave up on this attempt because of `why` (it
    /// failed here): ranks waiting in its groups' collectives, or for a peer making one of
    /// them, fail within a second with `why` instead of at the timeout. The first reason
    /// given stays. The attempt's groups are not to be used again.
    pub fn give_up(&self, why: &str) -> Result<()> {
        let reason = format!("rank {}: {why}", self.comm.rank);
        self.given_up.store.compare_set(&self.given_up.key, b"", reason.as_bytes()).map(drop)
    }
}

impl Drop for Attempt<'_> {
    /// Groups made from here on belong to no attempt.
    fn drop(&mut self) {
        *self.comm.attempt.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// This process's membership in a job: the store, its rank, and how to make groups.
pub struct Comm {
    store: Arc<Store>,
    rank: usize,
    size: usize,
    spec: String,
    timeout: Duration,
    groups_made: Mutex<usize>,
    /// Attempts begun (every rank begins the same ones, in the same order), and where the
    /// one under way keeps its word on giving up.
    attempts: Mutex<usize>,
    attempt: Mutex<Option<GivenUp>>,
    observer: ObserverSlot,
    /// Kept alive on the rank that hosts the store.
    _server: Option<StoreServer>,
}

impl Comm {
    /// Joins a job through `store`, with backends chosen by `spec` (`"cpu:shm,cuda:nccl"`).
    pub fn new(
        store: Store,
        server: Option<StoreServer>,
        rank: usize,
        size: usize,
        spec: &str,
        timeout: Duration,
    ) -> Result<Comm> {
        if size == 0 || rank >= size {
            return Err(Error::Comm(format!("rank {rank} is outside a world of {size}")));
        }
        parse_backend_spec(spec)?;
        Ok(Comm {
            store: Arc::new(store),
            rank,
            size,
            spec: spec.to_string(),
            timeout,
            groups_made: Mutex::new(0),
            attempts: Mutex::new(0),
            attempt: Mutex::new(None),
            observer: ObserverSlot::default(),
            _server: server,
        })
    }

    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The job's rendezvous store, shared by every group made.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// How long a collective of this job's groups waits for the other ranks.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Reports every collective of this job's groups (those made already included) and
    /// every wait that blocks on one to `observer`, or to none.
    pub fn observe(&self, observer: Option<Arc<dyn CommObserver>>) {
        *self.observer.write().unwrap_or_else(|e| e.into_inner()) = observer;
    }

    /// Brings every rank's count of groups made to the largest over `group` (all ranks of
    /// the job). Groups are named by that count, so every rank must have made the same
    /// number: after work that failed on some ranks part-way through making its groups,
    /// this puts the next group made under one name everywhere again.
    pub fn align_groups(&self, group: &dyn ProcessGroup) -> Result<()> {
        let made = *self.groups_made.lock().unwrap_or_else(|e| e.into_inner());
        let most = all_reduce_values(group, &[made as f64], ReduceOp::Max)?[0] as usize;
        let mut made = self.groups_made.lock().unwrap_or_else(|e| e.into_inner());
        *made = (*made).max(most);
        Ok(())
    }

    /// Begins work whose groups the job gives up on together where it fails on some rank
    /// ([`Attempt::give_up`]); it ends when the attempt is dropped. Every rank begins the
    /// same attempts in the same order (an attempt is named by their count).
    pub fn attempt(&self) -> Attempt<'_> {
        let mut count = self.attempts.lock().unwrap_or_else(|e| e.into_inner());
        *count += 1;
        let given_up = GivenUp { store: self.store.clone(), key: format!("attempt{count}/given-up") };
        *self.attempt.lock().unwrap_or_else(|e| e.into_inner()) = Some(given_up.clone());
        Attempt { comm: self, given_up }
    }

    /// The group of all ranks.
    pub fn world(&self) -> Result<Box<dyn ProcessGroup>> {
        self.world_waiting(self.timeout)
    }

    /// The group of all ranks, its collectives waiting up to `timeout` (a group that must
    /// outlast the timeouts of the others, as an agreement after they failed does).
    pub fn world_waiting(&self, timeout: Duration) -> Result<Box<dyn ProcessGroup>> {
        let all: Vec<usize> = (0..self.size).collect();
        self.make_group(&all, &self.spec, timeout)?.ok_or_else(|| Error::Comm("this rank is not in the world".into()))
    }

    /// A group of the given global ranks (in that order). Every rank of the job must call
    /// it with the same list, in the same order as other `new_group` calls; ranks outside
    /// the list get `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        self.new_group_with(ranks, &self.spec)
    }

    /// As [`Comm::new_group`], with backends chosen by `spec` instead of the job's.
    pub fn new_group_with(&self, ranks: &[usize], spec: &str) -> Result<Option<Box<dyn ProcessGroup>>> {
        self.make_group(ranks, spec, self.timeout)
    }

    fn make_group(&self, ranks: &[usize], spec: &str, timeout: Duration) -> Result<Option<Box<dyn ProcessGroup>>> {
        let mut made = self.groups_made.lock().unwrap_or_else(|e| e.into_inner());
        *made += 1;
        let id = *made;
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.size) {
            return Err(Error::Comm(format!("group lists rank {bad}, outside a world of {}", self.size)));
        }
        let mut seen = ranks.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ranks.len() || ranks.is_empty() {
            return Err(Error::Comm(format!("group ranks {ranks:?} must be distinct and non-empty")));
        }
        let Some(local) = ranks.iter().position(|&r| r == self.rank) else { return Ok(None) };
        let given_up = self.attempt.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut by_device = Vec::new();
        for (device, backend) in parse_backend_spec(spec)? {
            let setup = GroupSetup {
                store: self.store.clone(),
                prefix: format!("group{id}/{device}/"),
                rank: local,
                size: ranks.len(),
                ranks: ranks.to_vec(),
                world_size: self.size,
                timeout,
                given_up: given_up.clone(),
            };
            let mut group = factory(&backend)?(&setup)?;
            // The built-in ring backends move host memory: GPU tensors go through it.
            if device == "cuda" && matches!(backend.as_str(), "shm" | "tcp" | "mpi") {
                group = Box::new(staged::HostStaged::new(group, timeout));
            }
            by_device.push((device, group));
        }
        let label = format!("group {id} {ranks:?} {spec}").into();
        Ok(Some(Box::new(DeviceDispatch {
            name: spec.to_string(),
            by_device,
            label,
            observer: self.observer.clone(),
            given_up: given_up.map(Arc::new),
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_specs_parse_per_device_and_refuse_nonsense() {
        assert_eq!(parse_backend_spec("shm").unwrap(), vec![("cpu".into(), "shm".into())]);
        assert_eq!(
            parse_backend_spec("cpu:shm, cuda:nccl").unwrap(),
            vec![("cpu".into(), "shm".into()), ("cuda".into(), "nccl".into())]
        );
        assert!(parse_backend_spec("tpu:x").is_err());
        assert!(parse_backend_spec("cpu:a,cpu:b").is_err());
        assert!(parse_backend_spec("").is_err());
        assert!(factory("nope").err().unwrap().to_string().contains("registered"));
    }

    #[test]
    fn work_reports_completion_and_times_out() {
        let w = Work::pending(Duration::from_millis(50));
        assert!(!w.is_completed());
        assert!(w.wait().unwrap_err().to_string().contains("did not complete"));
        w.finish(Err(Error::Comm("rank 2 exited".into())));
        assert!(w.is_completed());
        assert!(w.wait().unwrap_err().to_string().contains("rank 2"));
    }
}
