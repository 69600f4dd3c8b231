//! ZeRO stages 1–3 (`zero1`, `zero2`, `fsdp`) as one engine schedule.
//!
//! Every unit's gradient span ([`UnitLayout`]: the parameters from its first trainable one
//! on) is padded to a multiple of the shard group's size and cut into equal shards; rank
//! `r` of the group owns shard `r` of every sharded unit's span:
//! - stage 1 keeps whole parameters and gradients, all-reduces gradients and updates only
//!   its shard, then all-gathers the updated parameters;
//! - stage 2 also reduce-scatters each unit's gradient as soon as its backward is done and
//!   frees the whole gradient, keeping only its shard;
//! - stage 3 also keeps only its parameter shard: a unit's flat buffer is all-gathered
//!   before its forward and backward and freed after (after forward only with
//!   `reshard_after_forward`, FSDP's FULL_SHARD). The engine knows the unit order, so
//!   the next unit's gather is started early (forward prefetch, backward PRE/POST).
//!
//! A frozen head ahead of the span (a LoRA run's base) has no gradient, master or
//! optimizer state; stage 3 cuts it into shards of its own, kept in `param_dtype` and
//! gathered beside the span's.
//!
//! With a mixed-precision policy the flat buffers hold `param_dtype` and the optimizer
//! updates fp32 masters; reduce-scattered gradients are reduced in `reduce_dtype` (stage
//! 1's and ignored units' all-reduces in the parameters' dtype). A hybrid layout
//! shards inside a group and all-reduces the shards across replica groups. Beside
//! `offload`, [`shard_homes`] places each unit's shard states on the device or the host.
//! Must not touch model definitions or optimizer policy: it manages buffers and
//! communication for the engine.
use super::ddp::{broadcast_from_first, start_average, ExpertReplicas};
use crate::comm::{all_reduce_values, ProcessGroup, ReduceOp, Work};
use crate::engine::offload::HostMemory;
use crate::engine::{
    memory, Category, Engine, EngineConfig, Event, EventSink, GradLayout, HeldStates, MemoryLedger, OptimizerView,
    Phase, Placement, ScheduleContext, UnitLayout, UnitSchedule, UnitStorage,
};
use crate::model::ModelSpec;
use crate::strategy::{BackwardPrefetch, Stage, Wrap};
use crate::{Error, Result};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// How a ZeRO stage shards a model and schedules its communication ([`Zero::build`]).
#[derive(Clone, Debug)]
pub struct ZeroOptions {
    /// What is sharded: optimizer states; and gradients; and parameters.
    pub stage: Stage,
    /// Free a unit's gathered parameters after its forward (stage 3).
    pub reshard_after_forward: bool,
    /// Keep gathered parameters through a step's micro-batches, freeing them only in the
    /// backward that completes the step's gradients (stage 3 in a pipeline, where the
    /// micro-batches' forwards and backwards interleave: one gather per unit and step, not
    /// one per micro-batch).
    pub keep_gathered_in_step: bool,
    /// When stage 3's backward starts gathering the next unit's parameters; `None`: only as
    /// each unit's backward needs them.
    pub backward_prefetch: Option<BackwardPrefetch>,
    /// Stage 3 starts gathering the next unit's parameters before a unit's forward (FSDP's
    /// `forward_prefetch`).
    pub forward_prefetch: bool,
    /// At most one gather runs ahead of the unit being computed; without it, two.
    pub limit_all_gathers: bool,
    /// A unit's gradient reduction may run during the next unit's backward, holding two
    /// whole gradients; without it the reduction completes before the next unit's whole
    /// gradient is allocated, so one exists at a time.
    pub overlap_comm: bool,
    /// Broadcast rank 0's initial parameters to every rank.
    pub sync_module_states: bool,
    /// Stage 3 releases the parameters other ranks own once the whole model is built, not
    /// unit by unit as each is made (PatrickStar's `release_after_init`).
    pub release_after_init: bool,
    /// Per unit, from the wrap policy.
    pub wrap: Vec<Wrap>,
    /// The dtype the flat buffers hold parameters in, the optimizer updating masters in the
    /// engine's dtype; `None`: the engine's dtype.
    pub param_dtype: Option<Kind>,
    /// The dtype gradients are reduced in; `None`: the parameters' (`param_dtype`).
    pub reduce_dtype: Option<Kind>,
    /// Master shards, reduced gradient shards and optimizer state of the sharded units it
    /// places on the host live in host memory and are updated there (ZeRO-Offload; with
    /// stage 3, FSDP's CPU offload): gradients are reduce-scattered as in stage 2, gathers
    /// and refreshes copy from the host.
    pub offload: Option<ShardOffload>,
}

/// `offload` beside a ZeRO stage: which sharded units keep their shard states (master
/// shard, gradient shard, optimizer state) in host memory.
#[derive(Clone, Debug)]
pub struct ShardOffload {
    /// Where the host buffers are made.
    pub memory: HostMemory,
    /// How [`shard_homes`] places the shard states.
    pub homes: ShardHomes,
    /// Per unit, whether its shard states always live on the host (`host_units`).
    pub forced: Vec<bool>,
    /// Optimizer state bytes per trainable element, which the plan counts before the
    /// optimizer exists.
    pub optimizer_bytes_per_element: u64,
}

/// How [`shard_homes`] places shard states.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ShardHomes {
    /// The first units covering `ratio` of the shard states' bytes go to the host.
    Static {
        /// Share of the shard states' bytes that goes to the host.
        ratio: f64,
    },
    /// Units stay on the device while their shard states fit in `room`: the device budget
    /// less what a step needs with every shard on the host (no limit when `None`); the
    /// others go to the host, largest first.
    Auto {
        /// Device bytes the shard states may hold; `None`: no limit.
        room: Option<u64>,
    },
}

/// Per unit, whether its shard states go to the host, from the device bytes they hold where
/// they stay (`states`; zero for units that are not sharded or not trained, which never
/// leave) and the units that must go (`forced`). Every unit can leave, so a plan always
/// exists: what cannot fit is the step itself, which the caller checks against the budget.
pub fn shard_homes(states: &[u64], forced: &[bool], homes: ShardHomes) -> Vec<bool> {
    let mut on_host: Vec<bool> = states.iter().zip(forced).map(|(&b, &f)| f && b > 0).collect();
    match homes {
        ShardHomes::Static { ratio } => {
            let total: u64 = states.iter().sum();
            let mut covered = 0u64;
            for (host, &b) in on_host.iter_mut().zip(states) {
                if b > 0 && (covered as f64) < ratio * total as f64 {
                    *host = true;
                }
                covered += b;
            }
        }
        ShardHomes::Auto { room } => {
            let Some(room) = room else { return on_host };
            let mut on_device: u64 = states.iter().zip(&on_host).filter(|(_, &h)| !h).map(|(&b, _)| b).sum();
            // Largest first, so the fewest units pay for copies; among equals the last.
            let mut order: Vec<usize> = (0..states.len()).filter(|&u| !on_host[u] && states[u] > 0).collect();
            order.sort_by_key(|&u| std::cmp::Reverse((states[u], u)));
            for u in order {
                if on_device <= room {
                    break;
                }
                on_host[u] = true;
                on_device -= states[u];
            }
        }
    }
    on_host
}

impl ZeroOptions {
    /// Whether each unit's gradient is reduced into a shard and freed (stages 2 and 3, and
    /// any stage whose shards the host may update).
    fn shards_grads(&self) -> bool {
        self.stage >= Stage::Gradients || self.offload.is_some()
    }

    /// Per unit of `spec` sharded over `n` ranks (of this tensor rank's pieces, of `tp`),
    /// the device bytes its shard states hold where they stay on the device: a master shard
    /// where one is kept apart from the parameters, the gradient shard and the optimizer
    /// state.
    fn shard_state_bytes(
        &self,
        spec: &ModelSpec,
        (n, tp): (i64, i64),
        kinds: [Kind; 3],
        optimizer_bytes: u64,
    ) -> Vec<u64> {
        let [master_kind, param_kind, reduce_kind] = kinds;
        let separate_master = (self.stage == Stage::Parameters && n > 1) || param_kind != master_kind;
        self.wrap
            .iter()
            .enumerate()
            .map(|(k, wrap)| {
                let span = UnitLayout::of(spec, k, tp, n).grad_len();
                if *wrap == Wrap::Ignored || span == 0 {
                    return 0;
                }
                let shard = span / n;
                let master = if separate_master { bytes(shard, master_kind) } else { 0 };
                master + bytes(shard, reduce_kind) + shard as u64 * optimizer_bytes
            })
            .collect()
    }
}

/// The process groups of a sharded run. `shard` is `None` when every rank holds whole
/// states (a shard group of one, e.g. NO_SHARD); `replicate` is `None` unless shard groups
/// are replicated (HYBRID_SHARD, NO_SHARD); `world` spans every rank that holds this
/// rank's tensor-parallel piece (every rank without tensor parallelism).
#[derive(Clone)]
pub struct ShardGroups {
    /// The ranks that split each unit's states; `None` where every rank holds them whole.
    pub shard: Option<Arc<dyn ProcessGroup>>,
    /// This shard's replicas in the other shard groups; `None` unless shard groups are replicated.
    pub replicate: Option<Arc<dyn ProcessGroup>>,
    /// Every rank that holds this rank's tensor-parallel piece; `None` where no other does.
    pub world: Option<Arc<dyn ProcessGroup>>,
    /// Where expert groups store their experts apart, the ranks of `replicate` and of
    /// `world` that store this rank's experts: they average and broadcast the experts'
    /// runs of each unit in place of those groups.
    pub experts: Option<ApartExperts>,
}

/// The groups that stand for [`ShardGroups::replicate`] and [`ShardGroups::world`] for the
/// runs of a unit holding this rank's experts, where expert groups store them apart.
#[derive(Clone)]
pub struct ApartExperts {
    /// Among `replicate`'s ranks, those storing this rank's experts.
    pub replicate: ExpertReplicas,
    /// Among `world`'s ranks, those storing this rank's experts.
    pub world: ExpertReplicas,
}

impl ShardGroups {
    fn shard_size(&self) -> usize {
        self.shard.as_ref().map_or(1, |g| g.size())
    }

    fn shard_rank(&self) -> usize {
        self.shard.as_ref().map_or(0, |g| g.rank())
    }
}

/// What this rank keeps of one unit beyond the engine's buffers.
struct Sharded {
    wrap: Wrap,
    trainable: bool,
    /// Length of the flat buffer, where its gradient span begins, and one shard of that
    /// span.
    len: i64,
    grad_start: i64,
    shard_len: i64,
    /// One shard of the frozen head `0..grad_start` (a whole number of them covers it),
    /// and the shard itself in the parameters' dtype where stage 3 frees the flat buffer.
    frozen_len: i64,
    frozen: Option<Tensor>,
    /// The master shard of the span when it is not a view of the flat buffer (stage 3, or
    /// a mixed-precision policy).
    master: Option<Tensor>,
    /// The reduced gradient shard (stages 2 and 3).
    grad_shard: Option<Tensor>,
    params_resident: bool,
    grads_resident: bool,
    /// Whether its whole gradient borrows a [`SharedGradSlots`] slot from its backward until
    /// its reduce-scatter completes.
    borrows_grad_slot: bool,
    gathering: Option<Gather>,
    /// Whether its shard states live in host memory (and are updated there).
    host: bool,
}

impl Sharded {
    fn grad_len(&self) -> i64 {
        self.len - self.grad_start
    }
}

/// Memory for whole gradients that the shard group reads in place (`shm`): buffers the size
/// of the largest such gradient, each lent to one unit from the backward that completes the
/// step's gradients until its reduce-scatter has completed, so that the reduce-scatter reads
/// the peers' gradients directly instead of staging them through the group's arena. A slot
/// is made when none is free, so there are as many as units are reduced at once (one, or
/// two with `overlap_comm` or a borrowed weight), and kept for the run: peers keep their
/// mappings of it, and its pages stay in place from step to step. The ledger counts a slot
/// while a unit holds it, at the unit's bytes.
struct SharedGradSlots {
    group: Arc<dyn ProcessGroup>,
    numel: i64,
    kind: Kind,
    free: Arc<Mutex<Vec<Tensor>>>,
}

impl SharedGradSlots {
    /// Slots of `numel` elements of `kind` from `group`, where it hands out shared memory.
    fn new(group: &Arc<dyn ProcessGroup>, numel: i64, kind: Kind, device: tch::Device) -> Result<Option<Self>> {
        Ok(group.alloc(numel, kind, device)?.map(|first| SharedGradSlots {
            group: group.clone(),
            numel,
            kind,
            free: Arc::new(Mutex::new(vec![first])),
        }))
    }

    /// Points the storage of `grad` (and every view of it) at a slot, which goes back to
    /// the free ones when the storage lets go of it ([`memory::release_buffer`]). Its
    /// values are what the slot last held.
    fn lend(&self, grad: &Tensor) -> Result<()> {
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let slot = match free {
            Some(slot) => slot,
            None => self
                .group
                .alloc(self.numel, self.kind, grad.device())?
                .ok_or_else(|| Error::Comm("the shard group no longer hands out shared memory".into()))?,
        };
        let data = slot.data_ptr();
        let free = self.free.clone();
        let give_back = Box::new(move || free.lock().unwrap_or_else(|e| e.into_inner()).push(slot));
        // SAFETY: the slot holds at least the gradient's elements in its dtype and lives
        // until the storage gives it back.
        unsafe { strata_ext::adopt_storage(grad, data, bytes(grad.numel() as i64, self.kind) as usize, give_back) }?;
        Ok(())
    }
}

/// A collective in flight and the copy it reads from, if it needed one (a cast master, a
/// gradient in the reduction dtype): the copy is charged to the ledger until it completes.
struct InFlight {
    work: Work,
    copy: Option<Tensor>,
    category: Category,
}

impl InFlight {
    /// Starts a collective that reads `source` in `kind` on `device`: where the dtypes or
    /// devices differ (a cast master, one in host memory) a copy is made, charged to
    /// `category` before it is allocated. If the collective does not start, the charge is
    /// undone.
    fn start(
        source: &Tensor,
        (kind, device): (Kind, tch::Device),
        category: Category,
        ledger: &MemoryLedger,
        launch: impl FnOnce(&Tensor) -> Result<Work>,
    ) -> Result<InFlight> {
        let needs_copy = source.kind() != kind || source.device() != device;
        let copy_bytes = if needs_copy { bytes(source.numel() as i64, kind) } else { 0 };
        ledger.alloc(Placement::Device, category, copy_bytes)?;
        let started = (|| {
            let copy = needs_copy.then(|| source.f_to(device)?.f_to_kind(kind)).transpose()?;
            let work = launch(copy.as_ref().unwrap_or(source))?;
            Ok(InFlight { work, copy, category })
        })();
        if started.is_err() {
            ledger.free(Placement::Device, category, copy_bytes);
        }
        started
    }

    /// Waits for the collective, then stops counting its copy — also after a failed wait:
    /// the worker's own handle keeps the copy's memory alive for as long as it reads it.
    fn finish(self, ledger: &MemoryLedger, what: &str) -> Result<()> {
        let waited = self.work.wait().map_err(comm_failed(what));
        if let Some(c) = self.copy {
            ledger.free(Placement::Device, self.category, memory::tensor_bytes(&c));
        }
        waited
    }
}

/// A unit's parameter gather: the collectives of its frozen head and its span, and the
/// scratch shards of the head that reach past it, whose leading elements are copied into
/// place once the gather completes.
#[derive(Default)]
struct Gather {
    parts: Vec<InFlight>,
    /// (scratch, where its leading elements go, what the scratch was charged).
    tails: Vec<(Tensor, Tensor, u64)>,
}

impl Gather {
    /// Waits for every part (all of them, even after one fails, so nothing still writes
    /// the buffers when this returns), then copies the tails into place.
    fn finish(self, ledger: &MemoryLedger, what: &str) -> Result<()> {
        let mut waited = Ok(());
        for part in self.parts {
            let done = part.finish(ledger, what);
            if waited.is_ok() {
                waited = done;
            }
        }
        for (scratch, into, charged) in self.tails {
            if waited.is_ok() {
                let have = into.numel() as i64;
                waited = tch::no_grad(|| Ok(into.shallow_clone().f_copy_(&scratch.f_narrow(0, 0, have)?).map(drop)?));
            }
            ledger.free(Placement::Device, Category::Params, charged);
        }
        waited
    }
}

/// Starts gathering the shards `frozen` of a frozen head into the first `head` elements of
/// `buffer` (in its dtype) over `g`: each rank's shard lands in a view of `buffer` where it
/// lies inside the head, else in a scratch shard (charged to the ledger) whose leading
/// elements [`Gather::finish`] copies in. The collective and the scratch go into `gather`.
fn gather_head(
    g: &Arc<dyn ProcessGroup>,
    frozen: &Tensor,
    (buffer, head): (&Tensor, i64),
    gather: &mut Gather,
    ledger: &MemoryLedger,
) -> Result<()> {
    let shard = frozen.numel() as i64;
    let mut outputs = Vec::with_capacity(g.size());
    for r in 0..g.size() as i64 {
        let start = r * shard;
        if start + shard <= head {
            outputs.push(buffer.f_narrow(0, start, shard)?);
            continue;
        }
        let charged = bytes(shard, buffer.kind());
        ledger.alloc(Placement::Device, Category::Params, charged)?;
        let scratch = Tensor::f_empty([shard], (buffer.kind(), buffer.device()))?;
        let into = buffer.f_narrow(0, start.min(head), (head - start).max(0))?;
        gather.tails.push((scratch.shallow_clone(), into, charged));
        outputs.push(scratch);
    }
    let target = (buffer.kind(), buffer.device());
    let part = InFlight::start(frozen, target, Category::Params, ledger, |input| g.all_gather(&outputs, input))?;
    gather.parts.push(part);
    Ok(())
}

/// A shard holding `values` in `kind` on `device`: in memory `group` reads in place where
/// one is given and hands it out, else in host memory where `host` says, else a copy of its
/// own.
fn shard_of(
    values: &Tensor,
    (kind, device): (Kind, tch::Device),
    group: Option<&Arc<dyn ProcessGroup>>,
    host: Option<&HostMemory>,
    ledger: &MemoryLedger,
) -> Result<Tensor> {
    let shared = match group {
        Some(g) => g.alloc(values.numel() as i64, kind, device)?,
        None => None,
    };
    Ok(match (shared, host) {
        (Some(t), _) => {
            tch::no_grad(|| t.shallow_clone().f_copy_(values))?;
            t
        }
        (None, Some(host)) => host.copy_of(&values.f_to_kind(kind)?, ledger)?,
        (None, None) => values.f_to_kind(kind)?.f_to_device(device)?.f_detach_copy()?,
    })
}

/// Elements `start..start + count` of the flat `values`, zeros past its end.
fn padded_slice(values: &Tensor, start: i64, count: i64) -> Result<Tensor> {
    let have = (values.numel() as i64 - start).clamp(0, count);
    if have == count {
        return Ok(values.f_narrow(0, start, count)?);
    }
    let out = Tensor::f_zeros([count], (values.kind(), values.device()))?;
    if have > 0 {
        tch::no_grad(|| out.f_narrow(0, 0, have)?.f_copy_(&values.f_narrow(0, start, have)?))?;
    }
    Ok(out)
}

/// ZeRO as an engine's schedule: this rank's shards of each unit, and the gathers,
/// reductions and updates around their forward and backward ([`Zero::build`]).
pub struct Zero {
    options: ZeroOptions,
    groups: ShardGroups,
    /// Per unit, the runs of its flat layout holding this rank's experts stored apart.
    expert_stretches: Vec<Vec<(i64, i64)>>,
    units: Vec<Sharded>,
    /// Units each unit reads: itself and the owners of parameters it borrows.
    needs: Vec<Vec<usize>>,
    param_kind: Kind,
    master_kind: Kind,
    reduce_kind: Kind,
    /// Gradient reduce-scatters in flight, oldest first, with the device buffer each lands
    /// in when its shard lives in host memory.
    reducing: VecDeque<(usize, InFlight, Option<Tensor>)>,
    /// All-reduces in flight (replicas, stage 1, ignored units).
    all_reducing: Vec<Work>,
    /// Where whole gradients go while the shard group reads them in place, if it can.
    grad_slots: Option<SharedGradSlots>,
    events: Option<Arc<dyn EventSink>>,
}

/// Where a unit's master and gradient shards live.
fn placement_of(host: Option<&HostMemory>) -> Placement {
    if host.is_some() {
        Placement::Host
    } else {
        Placement::Device
    }
}

fn bytes(numel: i64, kind: Kind) -> u64 {
    numel as u64 * kind.elt_size_in_bytes() as u64
}

fn comm_failed(what: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| Error::Comm(format!("{what} failed: {e}"))
}

impl Zero {
    /// Builds the model of `spec` sharded over `groups`: each unit is initialised, its
    /// shard kept and the rest freed before the next unit is allocated, so no rank ever
    /// holds the whole model (with stage 3).
    pub fn build(spec: ModelSpec, config: EngineConfig, groups: ShardGroups, options: ZeroOptions) -> Result<Engine> {
        if options.wrap.len() != spec.units.len() {
            return Err(Error::Config(format!(
                "the wrap policy covers {} units but the model has {}",
                options.wrap.len(),
                spec.units.len()
            )));
        }
        let master_kind = config.kind;
        let param_kind = options.param_dtype.unwrap_or(master_kind);
        let shards_grads = options.shards_grads();
        let reduce_kind = options.reduce_dtype.unwrap_or(param_kind);
        let n = groups.shard_size() as i64;
        let rank = groups.shard_rank() as i64;
        let config = EngineConfig { kind: param_kind, pad_to: n, grad_layout: GradLayout::PerUnit, ..config };
        let needs = spec.units_read();
        if groups.experts.is_some() != config.holding().experts.is_some() {
            return Err(Error::Config("ZeRO reduces experts stored apart over their replicas, and only those".into()));
        }
        let expert_stretches: Vec<Vec<(i64, i64)>> =
            (0..spec.units.len()).map(|k| config.holding().expert_stretches(&spec, k)).collect();
        let on_host = match &options.offload {
            Some(o) => {
                let kinds = [master_kind, param_kind, reduce_kind];
                let tp = config.tensor.as_ref().map_or(1, |t| t.size());
                let states = options.shard_state_bytes(&spec, (n, tp), kinds, o.optimizer_bytes_per_element);
                let on_host = shard_homes(&states, &o.forced, o.homes);
                let moved: u64 = states.iter().zip(&on_host).filter(|(_, &h)| h).map(|(b, _)| b).sum();
                tracing::info!(
                    units_on_host = on_host.iter().filter(|&&h| h).count(),
                    device_bytes_moved = moved,
                    device_bytes_kept = states.iter().sum::<u64>() - moved,
                    homes = ?o.homes,
                    "offload beside a ZeRO stage: shard states placed"
                );
                on_host
            }
            None => vec![false; spec.units.len()],
        };
        let mut units = Vec::with_capacity(spec.units.len());
        let mut on_unit = |k: usize, s: &mut UnitStorage, initial: &Tensor, ledger: &MemoryLedger| -> Result<()> {
            if options.sync_module_states && (groups.world.is_some() || groups.experts.is_some()) {
                let experts = groups.experts.as_ref().map(|e| &e.world);
                broadcast_from_first(initial, &expert_stretches[k], groups.world.as_ref(), experts)
                    .map_err(comm_failed("sync_module_states broadcast"))?;
                if initial.kind() != s.flat.kind() {
                    tch::no_grad(|| s.flat.shallow_clone().f_copy_(initial))?;
                }
            }
            let wrap = options.wrap[k];
            let (len, grad_start) = (s.flat.numel() as i64, s.grad_start);
            let shard_len = (len - grad_start) / n;
            let mut unit = Sharded {
                wrap,
                trainable: s.trainable,
                len,
                grad_start,
                shard_len,
                frozen_len: (grad_start + n - 1) / n,
                frozen: None,
                master: None,
                grad_shard: None,
                params_resident: true,
                grads_resident: true,
                borrows_grad_slot: false,
                gathering: None,
                host: false,
            };
            let sharded = wrap != Wrap::Ignored;
            let frees_params = options.stage == Stage::Parameters && groups.shard.is_some();
            let host = options.offload.as_ref().filter(|_| sharded && s.trainable && on_host[k]).map(|o| &o.memory);
            // Stage 3 keeps a shard of the frozen head to gather it from.
            if sharded && frees_params && grad_start > 0 {
                let count = unit.frozen_len;
                let values = padded_slice(initial, rank * count, count)?;
                let frozen = shard_of(&values, (param_kind, s.flat.device()), groups.shard.as_ref(), None, ledger)?;
                ledger.alloc(Placement::Device, Category::Params, bytes(count, param_kind))?;
                unit.frozen = Some(frozen);
            }
            // A master of what this rank updates: its shard of the span, or all of an
            // ignored unit's span.
            if s.trainable && ((sharded && frees_params) || param_kind != master_kind || host.is_some()) {
                let (start, count) =
                    if sharded { (grad_start + rank * shard_len, shard_len) } else { (grad_start, len - grad_start) };
                // Gathers read the master of a sharded unit when it is in the parameters'
                // dtype: there it goes where the shard group reads it in place.
                let read_in_place = sharded && master_kind == param_kind && host.is_none();
                let group = groups.shard.as_ref().filter(|_| read_in_place);
                let values = initial.f_narrow(0, start, count)?;
                let master = shard_of(&values, (master_kind, s.flat.device()), group, host, ledger)?;
                ledger.alloc(placement_of(host), Category::Params, bytes(count, master_kind))?;
                unit.master = Some(master);
            }
            // Parameters are freed only when other ranks hold the rest: a shard group of
            // one keeps them (refilling them would also bump autograd's version counters).
            if sharded && frees_params && !options.release_after_init {
                // SAFETY: nothing has run on the unit yet; it is gathered before any use.
                unsafe { memory::release_buffer(&s.flat) }?;
                ledger.free(Placement::Device, Category::Params, bytes(len, param_kind));
                unit.params_resident = false;
            }
            // A whole gradient reduce-scattered as it is (no cast, no host shard) can be read
            // in place by the shard group's peers. Not beside offload: slots stay allocated
            // for the run, which the step's floor, measured with every shard on the host and
            // so with no slots, would not count.
            unit.borrows_grad_slot =
                options.offload.is_none() && s.trainable && sharded && shards_grads && reduce_kind == param_kind;
            // Frozen units never need gradients; stages 2 and 3 hold only a shard between steps.
            if !s.trainable || (sharded && shards_grads) {
                // SAFETY: no backward has run; `ensure_grads` restores it before one does.
                unsafe { memory::release_buffer(&s.grad) }?;
                ledger.free(Placement::Device, Category::Grads, bytes(s.grad.numel() as i64, param_kind));
                unit.grads_resident = false;
            }
            if s.trainable && sharded && shards_grads {
                ledger.alloc(placement_of(host), Category::Grads, bytes(shard_len, reduce_kind))?;
                let zeros = Tensor::f_zeros([shard_len], (reduce_kind, s.flat.device()))?;
                unit.grad_shard = Some(match host {
                    Some(host) => host.zeros_like(&zeros, ledger)?,
                    None => zeros,
                });
            }
            unit.host = host.is_some();
            units.push(unit);
            Ok(())
        };
        let device = config.device;
        let mut engine = Engine::new_with(spec, config, &mut on_unit)?;
        if options.release_after_init && options.stage == Stage::Parameters && groups.shard.is_some() {
            for (unit, storage) in units.iter_mut().zip(engine.storage()).filter(|(u, _)| u.wrap != Wrap::Ignored) {
                // SAFETY: nothing has run on the unit yet; it is gathered before any use.
                unsafe { memory::release_buffer(&storage.flat) }?;
                engine.ledger().free(Placement::Device, Category::Params, bytes(unit.len, param_kind));
                unit.params_resident = false;
            }
        }
        let largest_borrowed = units.iter().filter(|u| u.borrows_grad_slot).map(Sharded::grad_len).max();
        let grad_slots = match (&groups.shard, largest_borrowed) {
            (Some(g), Some(numel)) => SharedGradSlots::new(g, numel, param_kind, device)?,
            _ => None,
        };
        let zero = Zero {
            options,
            groups,
            expert_stretches,
            units,
            needs,
            param_kind,
            master_kind,
            reduce_kind,
            reducing: VecDeque::new(),
            all_reducing: Vec::new(),
            grad_slots,
            events: None,
        };
        engine.set_schedule(Box::new(zero));
        Ok(engine)
    }

    fn shard_rank(&self) -> i64 {
        self.groups.shard_rank() as i64
    }

    /// Starts gathering unit `u`'s parameters into its flat buffer (stage 3).
    fn start_gather(&mut self, u: usize, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        let unit = &self.units[u];
        if unit.params_resident || unit.gathering.is_some() || unit.wrap == Wrap::Ignored {
            return Ok(());
        }
        let flat = &storage[u].flat;
        let flat_bytes = bytes(unit.len, self.param_kind);
        ledger.alloc(Placement::Device, Category::Params, flat_bytes)?;
        let mut gather = Gather::default();
        let started = (|| -> Result<()> {
            // SAFETY: the engine's flat buffer spans its storage.
            unsafe { memory::restore_buffer(flat) }?;
            let g =
                self.groups.shard.as_ref().ok_or_else(|| Error::Engine("gathering without a shard group".into()))?;
            let n = g.size() as i64;
            let target = (self.param_kind, flat.device());
            // The collectives write the memory directly: autograd's saved views of these
            // parameters see the same values they saw in forward, with no version change.
            if let Some(frozen) = &unit.frozen {
                gather_head(g, frozen, (flat, unit.grad_start), &mut gather, ledger)?;
            }
            if unit.trainable {
                let master = unit.master.as_ref().ok_or_else(|| Error::Engine("a stage-3 unit has no shard".into()))?;
                let span = flat.f_narrow(0, unit.grad_start, unit.grad_len())?;
                let part = InFlight::start(master, target, Category::Params, ledger, |input| {
                    g.all_gather(&span.f_chunk(n, 0)?, input)
                })?;
                gather.parts.push(part);
            }
            Ok(())
        })();
        if let Err(e) = started {
            // Nothing reads or writes the buffer once what started of the gather is over.
            let _ = gather.finish(ledger, "parameter all-gather");
            // SAFETY: as above.
            let _ = unsafe { memory::release_buffer(flat) };
            ledger.free(Placement::Device, Category::Params, flat_bytes);
            return Err(e);
        }
        let unit = &mut self.units[u];
        unit.gathering = Some(gather);
        unit.params_resident = true;
        if let Some(sink) = &self.events {
            sink.record(Event::GatherStarted { unit: u });
        }
        Ok(())
    }

    /// Makes the parameters of every unit in `units` usable now.
    fn ensure_params(&mut self, units: &[usize], storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        for &u in units {
            self.start_gather(u, storage, ledger)?;
        }
        for &u in units {
            if let Some(gather) = self.units[u].gathering.take() {
                gather.finish(ledger, "parameter all-gather")?;
            }
        }
        Ok(())
    }

    /// Starts gathering the units after `k` in execution order (`step` is +1 forward, -1
    /// backward), as many as the gather limit allows.
    fn prefetch(&mut self, k: usize, step: isize, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        let depth = if self.options.limit_all_gathers { 1 } else { 2 };
        for d in 1..=depth {
            let next = k as isize + step * d;
            if next < 0 || next as usize >= self.units.len() {
                break;
            }
            for u in self.needs[next as usize].clone() {
                self.start_gather(u, storage, ledger)?;
            }
        }
        Ok(())
    }

    /// Frees the gathered parameters of the units in `units` that `keep` does not need
    /// (units of the outermost wrap stay for the whole step).
    fn free_params(
        &mut self,
        units: &[usize],
        keep: &[usize],
        storage: &[UnitStorage],
        ledger: &MemoryLedger,
    ) -> Result<()> {
        for &u in units {
            if self.units[u].wrap == Wrap::Own && !keep.contains(&u) {
                self.free_unit_params(u, &storage[u], ledger)?;
            }
        }
        Ok(())
    }

    fn free_all_params(&mut self, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        for (u, s) in storage.iter().enumerate() {
            if self.units[u].wrap != Wrap::Ignored {
                self.free_unit_params(u, s, ledger)?;
            }
        }
        Ok(())
    }

    fn free_unit_params(&mut self, u: usize, storage: &UnitStorage, ledger: &MemoryLedger) -> Result<()> {
        let unit = &mut self.units[u];
        if !unit.params_resident {
            return Ok(());
        }
        if let Some(gather) = unit.gathering.take() {
            gather.finish(ledger, "parameter all-gather")?;
        }
        // SAFETY: the schedule frees a unit after its forward or backward is done and its
        // gather has completed (waited above); the next use gathers it first.
        unsafe { memory::release_buffer(&storage.flat) }?;
        ledger.free(Placement::Device, Category::Params, bytes(unit.len, self.param_kind));
        unit.params_resident = false;
        if let Some(sink) = &self.events {
            sink.record(Event::ParamsFreed { unit: u });
        }
        Ok(())
    }

    /// Gives unit `u` a zeroed whole gradient buffer if it has none (stages 2 and 3): a
    /// shared slot where this backward completes the step's gradients (`reduced_after`), so
    /// that no more slots are kept than units reduced at once; otherwise (accumulating
    /// micro-batches keep every unit's gradient) memory of its own.
    fn ensure_grads(
        &mut self,
        u: usize,
        storage: &[UnitStorage],
        ledger: &MemoryLedger,
        reduced_after: bool,
    ) -> Result<()> {
        let unit = &mut self.units[u];
        if unit.grads_resident || !unit.trainable {
            return Ok(());
        }
        let charged = bytes(unit.grad_len(), self.param_kind);
        ledger.alloc(Placement::Device, Category::Grads, charged)?;
        let given = match (&self.grad_slots, unit.borrows_grad_slot && reduced_after) {
            (Some(slots), true) => slots.lend(&storage[u].grad),
            // SAFETY: the engine's gradient buffer spans its storage.
            _ => unsafe { memory::restore_buffer(&storage[u].grad) },
        };
        if let Err(e) = given.and_then(|()| Ok(storage[u].grad.shallow_clone().f_zero_().map(|_| ())?)) {
            ledger.free(Placement::Device, Category::Grads, charged);
            return Err(e);
        }
        unit.grads_resident = true;
        Ok(())
    }

    /// Starts averaging unit `u`'s completed gradient across the data-parallel ranks.
    fn reduce_grads(&mut self, u: usize, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        let unit = &self.units[u];
        if !unit.trainable {
            return Ok(());
        }
        let grad = &storage[u].grad;
        let Some(shard) = unit.grad_shard.as_ref() else {
            // Stage 1 and ignored units keep whole gradients: all-reduce over every rank.
            let experts = self.groups.experts.as_ref().map(|e| &e.world);
            let stretches = &self.expert_stretches[u];
            let started = start_average(grad, unit.grad_start, stretches, self.groups.world.as_ref(), experts)?;
            self.all_reducing.extend(started);
            return Ok(());
        };
        // A shard in host memory is reduced on the device, then copied over.
        let landing = (shard.device() != grad.device())
            .then(|| -> Result<Tensor> {
                ledger.alloc(Placement::Device, Category::Grads, memory::tensor_bytes(shard))?;
                Ok(Tensor::f_empty([shard.numel() as i64], (shard.kind(), grad.device()))?)
            })
            .transpose()?;
        let target = landing.as_ref().unwrap_or(shard);
        let reduction = InFlight::start(grad, (self.reduce_kind, grad.device()), Category::Grads, ledger, |input| {
            match &self.groups.shard {
                Some(g) => g.reduce_scatter(target, &input.f_chunk(g.size() as i64, 0)?, ReduceOp::Avg),
                None => {
                    tch::no_grad(|| target.shallow_clone().f_copy_(input))?;
                    Ok(Work::done())
                }
            }
        });
        let reduction = match reduction {
            Ok(r) => r,
            Err(e) => {
                if let Some(t) = &landing {
                    ledger.free(Placement::Device, Category::Grads, memory::tensor_bytes(t));
                }
                return Err(e);
            }
        };
        self.reducing.push_back((u, reduction, landing));
        // Bound the whole gradients alive: finish the older reduction before going on.
        while self.reducing.len() > 1 {
            self.complete_oldest_reduction(storage, ledger)?;
        }
        Ok(())
    }

    fn complete_oldest_reduction(&mut self, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        let Some((u, reduction, landing)) = self.reducing.pop_front() else { return Ok(()) };
        reduction.finish(ledger, "gradient reduce-scatter")?;
        if let (Some(landed), Some(shard)) = (landing, &self.units[u].grad_shard) {
            tch::no_grad(|| shard.shallow_clone().f_copy_(&landed))?;
            ledger.free(Placement::Device, Category::Grads, memory::tensor_bytes(&landed));
        }
        let unit = &mut self.units[u];
        // SAFETY: the reduce-scatter reading it has completed (waited above), and the
        // unit's backward, which wrote it, is over; `ensure_grads` restores it.
        unsafe { memory::release_buffer(&storage[u].grad) }?;
        ledger.free(Placement::Device, Category::Grads, bytes(unit.grad_len(), self.param_kind));
        unit.grads_resident = false;
        if let Some(shard) = &unit.grad_shard {
            let at = unit.grad_start + self.groups.shard_rank() as i64 * unit.shard_len;
            let experts = self.groups.experts.as_ref().map(|e| &e.replicate);
            let stretches = &self.expert_stretches[u];
            let started = start_average(shard, at, stretches, self.groups.replicate.as_ref(), experts)?;
            self.all_reducing.extend(started);
        }
        Ok(())
    }

    /// Completes every reduce-scatter in flight, freeing the whole gradients they read.
    fn drain_gradient_reductions(&mut self, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        while !self.reducing.is_empty() {
            self.complete_oldest_reduction(storage, ledger)?;
        }
        Ok(())
    }

    /// Completes every gradient reduction in flight.
    fn drain_reductions(&mut self, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        self.drain_gradient_reductions(storage, ledger)?;
        for w in self.all_reducing.drain(..) {
            w.wait().map_err(comm_failed("gradient all-reduce"))?;
        }
        Ok(())
    }

    /// The range of unit `u`'s flat layout this rank updates: its shard of the span, or all
    /// of an ignored (replicated) unit's span.
    fn master_range(&self, u: usize) -> (i64, i64) {
        let unit = &self.units[u];
        match unit.wrap {
            Wrap::Ignored => (unit.grad_start, unit.grad_len()),
            _ => (unit.grad_start + self.shard_rank() * unit.shard_len, unit.shard_len),
        }
    }

    /// Whether parameters live as shards between uses (stage 3 over more than one rank).
    fn shards_params(&self) -> bool {
        self.options.stage == Stage::Parameters && self.groups.shard.is_some()
    }

    fn is_sharded(&self, u: usize) -> bool {
        self.units[u].wrap != Wrap::Ignored
    }
}

impl UnitSchedule for Zero {
    fn on(&mut self, phase: Phase, ctx: ScheduleContext<'_>) -> Result<()> {
        let (k, storage, ledger) = (ctx.unit, &*ctx.storage, ctx.ledger);
        let last = self.units.len() - 1;
        let stage3 = self.shards_params();
        let needs = self.needs[k].clone();
        match phase {
            Phase::BeforeForward => {
                if stage3 {
                    if k == 0 {
                        let roots: Vec<usize> =
                            (0..self.units.len()).filter(|&u| self.units[u].wrap == Wrap::Root).collect();
                        self.ensure_params(&roots, storage, ledger)?;
                    }
                    self.ensure_params(&needs, storage, ledger)?;
                    if self.options.forward_prefetch {
                        self.prefetch(k, 1, storage, ledger)?;
                    }
                }
            }
            Phase::AfterForward => {
                let keep_all = self.options.keep_gathered_in_step;
                if stage3 && self.options.reshard_after_forward && !keep_all && k != last {
                    let keep = self.needs[k + 1].clone();
                    self.free_params(&needs, &keep, storage, ledger)?;
                }
            }
            Phase::BeforeBackward => {
                if stage3 {
                    self.ensure_params(&needs, storage, ledger)?;
                    if self.options.backward_prefetch == Some(BackwardPrefetch::Pre) && k > 0 {
                        self.prefetch(k, -1, storage, ledger)?;
                    }
                }
                if self.options.shards_grads() {
                    if !self.options.overlap_comm {
                        self.drain_gradient_reductions(storage, ledger)?;
                    }
                    for &u in &needs {
                        if self.is_sharded(u) {
                            self.ensure_grads(u, storage, ledger, ctx.sync_grads)?;
                        }
                    }
                }
            }
            Phase::AfterBackward => {
                if ctx.sync_grads {
                    if self.units[k].wrap != Wrap::Root {
                        self.reduce_grads(k, storage, ledger)?;
                    }
                    if k == 0 {
                        let roots: Vec<usize> =
                            (0..self.units.len()).filter(|&u| self.units[u].wrap == Wrap::Root).collect();
                        for u in roots.into_iter().rev() {
                            self.reduce_grads(u, storage, ledger)?;
                        }
                    }
                }
                // An earlier micro-batch's backward: later ones still need the parameters.
                let held_for_step = self.options.keep_gathered_in_step && !ctx.sync_grads;
                if stage3 && !held_for_step {
                    if k == 0 {
                        self.free_all_params(storage, ledger)?;
                    } else {
                        let keep = self.needs[k - 1].clone();
                        self.free_params(&needs, &keep, storage, ledger)?;
                        // POST: the next unit's gather starts once this one's is freed, so one
                        // unit fewer is gathered than with PRE.
                        if self.options.backward_prefetch == Some(BackwardPrefetch::Post) {
                            self.prefetch(k, -1, storage, ledger)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn finish_grads(&mut self, ctx: ScheduleContext<'_>) -> Result<()> {
        self.drain_reductions(ctx.storage, ctx.ledger)
    }

    fn attach_events(&mut self, sink: Arc<dyn EventSink>) {
        self.events = Some(sink);
    }

    fn after_update(&mut self, ctx: ScheduleContext<'_>) -> Result<()> {
        let (storage, ledger) = (&*ctx.storage, ctx.ledger);
        let stage3 = self.shards_params();
        if stage3 {
            // Anything still gathered is stale now; the next use gathers the new shards.
            self.free_all_params(storage, ledger)?;
        }
        let mut works = Vec::new();
        for (u, unit) in self.units.iter().enumerate() {
            // Sharded stage-3 units are gathered from their masters when next used; the rest
            // (stages 1 and 2, ignored units) hold whole parameters to refresh now.
            if !unit.trainable || (stage3 && unit.wrap != Wrap::Ignored) {
                continue;
            }
            let (offset, count) = self.master_range(u);
            let mine = storage[u].flat.f_narrow(0, offset, count)?;
            if let Some(master) = &unit.master {
                tch::no_grad(|| mine.shallow_clone().f_copy_(master))?;
            }
            if let (Some(g), true) = (&self.groups.shard, unit.wrap != Wrap::Ignored) {
                let span = storage[u].flat.f_narrow(0, unit.grad_start, unit.grad_len())?;
                works.push(g.all_gather(&span.f_chunk(g.size() as i64, 0)?, &mine)?);
            }
        }
        for w in works {
            w.wait().map_err(comm_failed("updated parameter all-gather"))?;
        }
        Ok(())
    }

    fn zero_grads(&mut self, ctx: ScheduleContext<'_>) -> Result<()> {
        self.drain_reductions(ctx.storage, ctx.ledger)?;
        for (u, unit) in self.units.iter().enumerate() {
            if unit.grads_resident && unit.trainable {
                let _ = ctx.storage[u].grad.shallow_clone().f_zero_()?;
            }
            if let Some(g) = &unit.grad_shard {
                let _ = g.shallow_clone().f_zero_()?;
            }
        }
        Ok(())
    }
}

impl HeldStates for Zero {
    fn capture_obstacle(&self) -> Option<String> {
        let groups = [&self.groups.shard, &self.groups.replicate, &self.groups.world];
        let ranks = groups.iter().filter_map(|g| g.as_ref().map(|g| g.size())).max().unwrap_or(1);
        (ranks > 1).then(|| super::collectives_obstacle(ranks))
    }

    fn held_tensors(&self) -> Vec<Tensor> {
        let per_unit = self.units.iter().flat_map(|u| [u.frozen.as_ref(), u.master.as_ref(), u.grad_shard.as_ref()]);
        let gathers = self.units.iter().filter_map(|u| u.gathering.as_ref()).flat_map(|g| {
            let copies = g.parts.iter().filter_map(|p| p.copy.as_ref());
            copies.chain(g.tails.iter().map(|(scratch, _, _)| scratch))
        });
        let reductions = self.reducing.iter().flat_map(|(_, r, landing)| [r.copy.as_ref(), landing.as_ref()]);
        per_unit.flatten().chain(gathers).chain(reductions.flatten()).map(Tensor::shallow_clone).collect()
    }

    fn optimizer_view(&self, ctx: ScheduleContext<'_>) -> Result<OptimizerView> {
        let (u, s) = (ctx.unit, &ctx.storage[ctx.unit]);
        let unit = &self.units[u];
        let (offset, count) = self.master_range(u);
        let param = match &unit.master {
            Some(m) => m.shallow_clone(),
            None => s.flat.f_narrow(0, offset, count)?,
        };
        if unit.wrap == Wrap::Ignored {
            return Ok(OptimizerView { param, grad: s.grad.shallow_clone(), offset, placement: Placement::Device });
        }
        let grad = match &unit.grad_shard {
            Some(g) => g.shallow_clone(),
            None => s.grad.f_narrow(0, offset - unit.grad_start, unit.shard_len)?,
        };
        let placement = if unit.host { Placement::Host } else { Placement::Device };
        Ok(OptimizerView { param, grad, offset, placement })
    }

    fn grad_norm_is_local(&self) -> bool {
        self.groups.shard.is_none()
    }

    fn grad_sq_sum(&self, per_unit: &[(usize, f64)]) -> Result<f64> {
        // Shards add up over the shard group; replicated (ignored) units count once.
        let (sharded, replicated): (Vec<_>, Vec<_>) = per_unit.iter().partition(|(u, _)| self.is_sharded(*u));
        let local: f64 = sharded.iter().map(|(_, x)| x).sum();
        let whole: f64 = replicated.iter().map(|(_, x)| x).sum();
        let Some(g) = &self.groups.shard else { return Ok(local + whole) };
        let total =
            all_reduce_values(g.as_ref(), &[local], ReduceOp::Sum).map_err(comm_failed("gradient norm all-reduce"))?;
        Ok(total[0] + whole)
    }

    fn checkpoint_writer(&self) -> bool {
        // Replica groups hold identical shards: the first replica writes them (of each
        // expert rank, where experts are stored apart).
        match &self.groups.experts {
            Some(experts) => experts.replicate.group.as_ref().is_none_or(|g| g.rank() == 0),
            None => self.groups.replicate.as_ref().is_none_or(|g| g.rank() == 0),
        }
    }

    fn writes_frozen_heads(&self) -> bool {
        self.checkpoint_writer() && self.shard_rank() == 0
    }

    fn master_kind(&self) -> Option<Kind> {
        Some(self.master_kind)
    }

    fn full_unit(&mut self, ctx: ScheduleContext<'_>) -> Result<Tensor> {
        let (u, s) = (ctx.unit, &ctx.storage[ctx.unit]);
        if let Some(gather) = self.units[u].gathering.take() {
            gather.finish(ctx.ledger, "parameter all-gather")?;
        }
        let unit = &self.units[u];
        let device = s.flat.device();
        let full = Tensor::f_zeros([unit.len], (self.master_kind, device))?;
        let group = self.groups.shard.as_ref().filter(|_| unit.wrap != Wrap::Ignored);
        // The frozen head: from the parameters where they are here, else from its shards.
        match (&unit.frozen, group) {
            (Some(frozen), Some(g)) if !unit.params_resident => {
                let mut gather = Gather::default();
                let started = gather_head(g, frozen, (&full, unit.grad_start), &mut gather, ctx.ledger);
                let finished = gather.finish(ctx.ledger, "parameter all-gather");
                started.and(finished)?;
            }
            _ => {
                let head = s.flat.f_narrow(0, 0, unit.grad_start)?;
                tch::no_grad(|| full.f_narrow(0, 0, unit.grad_start)?.f_copy_(&head))?;
            }
        }
        if unit.trainable {
            let (offset, count) = self.master_range(u);
            // A shard in host memory is gathered on the device.
            let mine = match &unit.master {
                Some(m) => m.f_to_device(device)?.f_to_kind(self.master_kind)?,
                None => s.flat.f_narrow(0, offset, count)?.f_to_kind(self.master_kind)?,
            };
            let span = full.f_narrow(0, unit.grad_start, unit.grad_len())?;
            match group {
                Some(g) => g
                    .all_gather(&span.f_chunk(g.size() as i64, 0)?, &mine)?
                    .wait()
                    .map_err(comm_failed("parameter all-gather"))?,
                None => tch::no_grad(|| span.shallow_clone().f_copy_(&mine).map(drop))?,
            }
        }
        Ok(full.f_narrow(0, 0, s.numel)?)
    }

    fn set_full_unit(&mut self, ctx: ScheduleContext<'_>, values: &Tensor) -> Result<()> {
        let (u, s) = (ctx.unit, &ctx.storage[ctx.unit]);
        if let Some(gather) = self.units[u].gathering.take() {
            gather.finish(ctx.ledger, "parameter all-gather")?;
        }
        let unit = &self.units[u];
        let padded = padded_slice(&values.f_to_kind(self.master_kind)?.f_to_device(s.flat.device())?, 0, unit.len)?;
        if unit.params_resident {
            tch::no_grad(|| s.flat.shallow_clone().f_copy_(&padded))?;
        }
        if let Some(frozen) = &unit.frozen {
            let mine = padded_slice(&padded, self.shard_rank() * unit.frozen_len, unit.frozen_len)?;
            tch::no_grad(|| frozen.shallow_clone().f_copy_(&mine))?;
        }
        let (offset, count) = self.master_range(u);
        if let Some(master) = &unit.master {
            tch::no_grad(|| master.shallow_clone().f_copy_(&padded.f_narrow(0, offset, count)?))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shard state bytes of six units: the second is frozen (nothing to place).
    const STATES: [u64; 6] = [40, 0, 30, 30, 20, 10];

    fn homes(homes: ShardHomes, forced: &[bool]) -> Vec<bool> {
        shard_homes(&STATES, forced, homes)
    }

    #[test]
    fn static_sends_the_first_units_covering_the_ratio() {
        let none = [false; 6];
        assert_eq!(homes(ShardHomes::Static { ratio: 1.0 }, &none), [true, false, true, true, true, true]);
        // 50% of 130 bytes: the first unit (40) covers less, the next with states reaches it.
        assert_eq!(homes(ShardHomes::Static { ratio: 0.5 }, &none), [true, false, true, false, false, false]);
        assert_eq!(homes(ShardHomes::Static { ratio: 0.2 }, &none), [true, false, false, false, false, false]);
        // Units that exactly cover the ratio are enough: the next one stays.
        let exact = shard_homes(&[1, 1, 2], &[false; 3], ShardHomes::Static { ratio: 0.5 });
        assert_eq!(exact, [true, true, false]);
    }

    #[test]
    fn auto_keeps_what_fits_and_sends_the_largest_first() {
        let none = [false; 6];
        assert_eq!(homes(ShardHomes::Auto { room: None }, &none), [false; 6], "no budget: all stay");
        assert_eq!(homes(ShardHomes::Auto { room: Some(130) }, &none), [false; 6], "all fit");
        // 129 of 130: the largest leaves.
        assert_eq!(homes(ShardHomes::Auto { room: Some(129) }, &none), [true, false, false, false, false, false]);
        // 60 left: 40 and then the later of the two 30s leave.
        assert_eq!(homes(ShardHomes::Auto { room: Some(60) }, &none), [true, false, false, true, false, false]);
        assert_eq!(homes(ShardHomes::Auto { room: Some(0) }, &none), [true, false, true, true, true, true]);
        // A unit forced to the host counts as gone; the frozen one never moves.
        let forced = [false, true, false, false, false, true];
        assert_eq!(homes(ShardHomes::Auto { room: Some(120) }, &forced), [false, false, false, false, false, true]);
        assert_eq!(homes(ShardHomes::Auto { room: Some(90) }, &forced), [true, false, false, false, false, true]);
    }
}
