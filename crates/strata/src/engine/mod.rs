//! The engine: owns parameter storage and runs a model unit by unit.
//!
//! Owns: one flat parameter buffer and one flat gradient buffer per unit (every parameter is
//! a view at an offset into them; on the device, or on the host for a unit that computes
//! there), the forward pass in unit order, the backward pass in
//! reverse order seeded with each unit's upstream gradient, and the [`MemoryLedger`] entries
//! for what it holds. Must not own optimisation policy (that is the optimizer's), data, or
//! what a strategy does to a unit: strategies plug in through [`UnitSchedule`], which the
//! engine calls around every unit's forward and backward — the seam where sharding
//! (gather before, free after), prefetch, recompute and offload go.

pub mod activations;
pub mod events;
pub mod memory;
pub mod offload;
pub mod placement;
mod schedule;
pub mod slots;

use crate::comm::ProcessGroup;
use crate::compute::fp8::Fp8Scaling;
use crate::compute::{self, UnitCompute};
use crate::model::{
    ContextParallel, DecodeCache, DropoutDraw, ExpertExchange, HeadScoring, Init, ModelSpec, ParamId, ParamSpec,
    Params, Routed, RowLayout, RowSharers, TensorParallel, TpRole, WholeSequence,
};
use crate::{Error, Result};
pub use activations::ActivationOffload;
use activations::{Shelf, ShelfContext};
pub use events::{Event, EventLog, EventSink, EventSinks, UnitClock, UnitTime};
pub use memory::{Category, MemoryLedger, Placement};
pub use schedule::{GradReady, HeldStates, OptimizerView, Phase, Resident, ScheduleContext, UnitSchedule};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// Where a micro-batch's backward starts.
pub enum Upstream<'a> {
    /// A scalar loss computed from the output.
    Loss(&'a Tensor),
    /// The gradient of the output.
    Grad(&'a Tensor),
}

/// How backward walks the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardMode {
    /// Each unit's graph is cut at its input; backward runs unit by unit in reverse with the
    /// upstream gradient, so the engine acts between units (the mode strategies build on).
    UnitByUnit,
    /// One autograd graph over the whole model and one backward call (a reference).
    WholeGraph,
}

/// How an engine stores and runs a model.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The compute device: where units compute and their buffers live (save those of `host_compute`).
    pub device: Device,
    /// dtype of parameters whose spec does not fix one.
    pub kind: Kind,
    /// Seed of parameter initialisation.
    pub seed: i64,
    /// How backward walks the model.
    pub backward: BackwardMode,
    /// Bytes the compute device may hold; `None` for no limit.
    pub device_budget: Option<u64>,
    /// Bytes of host memory the engine and optimizer may hold for model states.
    pub host_budget: Option<u64>,
    /// Each unit's gradient span ([`UnitLayout`]) is padded to a multiple of this many
    /// elements, so that a sharded strategy cuts it into equal shards.
    pub pad_to: i64,
    /// Where gradients live: one buffer for all units, or one per unit.
    pub grad_layout: GradLayout,
    /// The tensor group this rank's units are split over (`None`: whole units). Each
    /// parameter then holds this rank's piece, as its [`TpRole`] says.
    pub tensor: Option<Arc<dyn TensorParallel>>,
    /// The expert group this rank's sparse layers exchange tokens over (`None`: each rank
    /// computes every expert for its own tokens).
    pub experts: Option<Arc<dyn ExpertExchange>>,
    /// With an expert group, whether this rank stores only the routed experts it computes
    /// ([`Holding`]); otherwise every rank stores every expert (a sharded strategy then
    /// shards them with the rest).
    pub experts_apart: bool,
    /// The context group this rank's attention reaches the rest of its rows' positions
    /// through (`None`: the rows are whole).
    pub context: Option<Arc<dyn ContextParallel>>,
    /// Per unit, whether it computes on the host (empty: none): its buffers live there, its
    /// input comes to the host and its output goes to `device`. Needs per-unit gradients.
    pub host_compute: Vec<bool>,
}

/// Where gradients live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradLayout {
    /// One buffer for all units, unit after unit: a run of adjacent units is one slice
    /// (data-parallel buckets need no copy).
    Contiguous,
    /// One buffer per unit, so that a sharded strategy can free each after reducing it.
    PerUnit,
}

impl EngineConfig {
    /// What a rank of this configuration stores of each parameter.
    pub fn holding(&self) -> Holding {
        let experts = self.experts.as_ref().filter(|_| self.experts_apart);
        Holding {
            tensor: self.tensor.as_ref().map_or(1, |t| t.size()),
            experts: experts.map(|g| (g.size() as i64, g.rank() as i64)),
        }
    }

    /// Whether unit `k` computes on the host ([`EngineConfig::host_compute`]).
    pub fn computes_on_host(&self, k: usize) -> bool {
        self.host_compute.get(k).copied().unwrap_or(false)
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            device: Device::Cpu,
            kind: Kind::Float,
            seed: 0,
            backward: BackwardMode::UnitByUnit,
            device_budget: None,
            host_budget: None,
            pad_to: 1,
            grad_layout: GradLayout::Contiguous,
            tensor: None,
            experts: None,
            experts_apart: false,
            context: None,
            host_compute: vec![],
        }
    }
}

/// Where a unit's parameters lie in its flat buffer: `numel` elements of parameters in
/// declaration order; the gradient span from `grad_start` (the first parameter that takes a
/// gradient; `numel` for a unit frozen whole) on, padded to a multiple of
/// [`EngineConfig::pad_to`]; `len` elements in all. The parameters before `grad_start` (a
/// frozen base ahead of a LoRA run's adapters) have no gradient, master or optimizer state
/// under any strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitLayout {
    /// Elements of the unit's parameters.
    pub numel: i64,
    /// Where the gradient span begins.
    pub grad_start: i64,
    /// Elements in all: the parameters, then the gradient span's padding.
    pub len: i64,
}

/// What of each parameter a rank stores: its tensor rank's piece ([`TpRole`]) and, where an
/// expert group stores its routed experts apart, nothing of the experts the group's other
/// ranks compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Holding {
    /// Ranks of the tensor group.
    pub tensor: i64,
    /// The expert group's (size, this rank) where each rank stores only its own experts.
    pub experts: Option<(i64, i64)>,
}

impl Holding {
    /// Tensor rank pieces over `tensor` ranks, every expert stored.
    pub fn tensor(tensor: i64) -> Holding {
        Holding { tensor, experts: None }
    }

    /// Whether this rank stores any of `p`.
    pub fn holds(&self, p: &ParamSpec) -> bool {
        match (p.expert, self.experts) {
            (Some(slot), Some((size, rank))) => slot.owner(size) == rank,
            _ => true,
        }
    }

    /// The shape of what this rank stores of `p`: a first dimension of 0 where it stores none.
    pub fn shape(&self, p: &ParamSpec) -> Vec<i64> {
        let mut shape = p.local_shape(self.tensor);
        if !self.holds(p) {
            if let Some(rows) = shape.first_mut() {
                *rows = 0;
            }
        }
        shape
    }

    /// Elements this rank stores of `p`.
    pub fn numel(&self, p: &ParamSpec) -> i64 {
        self.shape(p).iter().product()
    }

    /// Where the expert group stores its experts apart, the runs (start, length) of unit
    /// `unit`'s flat layout that hold this rank's routed experts; empty otherwise.
    pub fn expert_stretches(&self, spec: &ModelSpec, unit: usize) -> Vec<(i64, i64)> {
        let mut runs: Vec<(i64, i64)> = Vec::new();
        if self.experts.is_none() {
            return runs;
        }
        let mut offset = 0;
        for &id in &spec.units[unit].params {
            let p = &spec.params[id.0];
            let numel = self.numel(p);
            if p.expert.is_some() && numel > 0 {
                match runs.last_mut() {
                    Some((s, len)) if *s + *len == offset => *len += numel,
                    _ => runs.push((offset, numel)),
                }
            }
            offset += numel;
        }
        runs
    }
}

/// `(start, len)` cut into runs `(start, len, in_spans)` by `spans` (sorted, disjoint): what
/// one group reduces and what another.
pub fn cut(start: i64, len: i64, spans: &[(i64, i64)]) -> Vec<(i64, i64, bool)> {
    let (end, mut at, mut runs) = (start + len, start, Vec::new());
    for &(s, l) in spans {
        let (s, e) = (s.max(at), (s + l).min(end));
        if s >= e {
            continue;
        }
        if at < s {
            runs.push((at, s - at, false));
        }
        runs.push((s, e - s, true));
        at = e;
    }
    if at < end {
        runs.push((at, end - at, false));
    }
    runs
}

impl UnitLayout {
    /// The layout of unit `unit` of `spec` holding tensor rank pieces of `tp`.
    pub fn of(spec: &ModelSpec, unit: usize, tp: i64, pad_to: i64) -> UnitLayout {
        UnitLayout::held(spec, unit, Holding::tensor(tp), pad_to)
    }

    /// The layout of unit `unit` of `spec` storing what `holding` says.
    pub fn held(spec: &ModelSpec, unit: usize, holding: Holding, pad_to: i64) -> UnitLayout {
        let (mut numel, mut grad_start) = (0, None);
        for id in &spec.units[unit].params {
            let p = &spec.params[id.0];
            if p.requires_grad {
                grad_start.get_or_insert(numel);
            }
            numel += holding.numel(p);
        }
        let grad_start = grad_start.unwrap_or(numel);
        let pad_to = pad_to.max(1);
        let span = (numel - grad_start + pad_to - 1) / pad_to * pad_to;
        UnitLayout { numel, grad_start, len: grad_start + span }
    }

    /// Elements of the gradient span (0 for a unit frozen whole).
    pub fn grad_len(&self) -> i64 {
        self.len - self.grad_start
    }
}

/// A unit's contiguous storage, laid out as its [`UnitLayout`] says.
pub struct UnitStorage {
    /// All parameters the unit owns, concatenated in declaration order, then padding.
    pub flat: Tensor,
    /// Their gradients, laid out as `flat` from `grad_start` on; autograd accumulates into
    /// it.
    pub grad: Tensor,
    /// Where in `flat` the gradient buffer begins ([`UnitLayout::grad_start`]).
    pub grad_start: i64,
    /// Elements that belong to parameters (the rest of `flat` is padding).
    pub numel: i64,
    /// Whether any of the unit's parameters takes a gradient.
    pub trainable: bool,
}

/// A contiguous slice of one unit's buffers in which every parameter belongs to the same
/// optimizer group: the optimizer updates it as one tensor.
pub struct Segment {
    /// The parameters' elements, a view of the buffer the optimizer updates.
    pub param: Tensor,
    /// Their gradients, laid out as `param`.
    pub grad: Tensor,
    /// The optimizer group of its parameters.
    pub group: usize,
    /// The unit whose buffers the slice is of.
    pub unit: usize,
    /// Position of the first element in the unit's flat layout.
    pub offset: i64,
    /// The share of this segment's squared gradient norm this rank counts: 1, or 1/tp for
    /// parameters every tensor rank holds whole, so a sum over the tensor group counts
    /// them once.
    pub norm_share: f64,
    /// Where `param` and `grad` live.
    pub placement: Placement,
}

struct Boundary {
    /// The leaf that cut the graph at this unit's input (unit-by-unit mode, units after the first).
    input: Option<Tensor>,
    output: Tensor,
    /// For a recomputed unit, the input to run its forward again from in backward.
    recompute_from: Option<RecomputeFrom>,
    /// Where the values the unit keeps for its backward wait, where they are offloaded.
    shelf: Option<Shelf>,
}

/// Where a recomputed unit's input waits for its backward.
enum RecomputeFrom {
    /// On the device: the cut leaf itself.
    Device(Tensor),
    /// On the unit's shelf, by ticket.
    Shelved(std::num::NonZeroU64),
}

/// Autograd nodes whose backward never reads the values of the tensor they made.
const NODES_NOT_READING_THEIR_OUTPUT: [&str; 2] = ["AddBackward0", "EmbeddingBackward0"];

struct ForwardRecord {
    boundaries: Vec<Boundary>,
    out: Tensor,
    activation_bytes: u64,
    /// Bytes its units' shelves hold on the host.
    shelved_bytes: u64,
    /// What the forward's rows carried, for units recomputed in backward.
    rows: RowContext,
}

/// What a forward's rows carry beside their tokens: their layout where they hold packed
/// examples, which positions are padding, and in training the draw of their dropout masks.
#[derive(Default)]
struct RowContext {
    layout: Option<RowLayout>,
    padding: Option<Tensor>,
    dropout: Option<DropoutDraw>,
    /// The next token at each position, which a head that scores in chunks reads.
    targets: Option<Tensor>,
}

impl RowContext {
    /// The same tensors, shared.
    fn shallow_clone(&self) -> RowContext {
        RowContext {
            layout: self.layout.as_ref().map(RowLayout::shallow_clone),
            padding: self.padding.as_ref().map(Tensor::shallow_clone),
            dropout: self.dropout,
            targets: self.targets.as_ref().map(Tensor::shallow_clone),
        }
    }

    /// The same rows in a forward that does not train: nothing is dropped.
    fn evaluated(&self) -> RowContext {
        RowContext { dropout: None, ..self.shallow_clone() }
    }
}

/// Called by `Engine::new_with` for each unit once it is initialised.
pub type UnitInitHook<'a> = dyn FnMut(usize, &mut UnitStorage, &Tensor, &MemoryLedger) -> Result<()> + 'a;

/// Holds a model's parameters as each unit's flat buffers and runs its forward and backward
/// unit by unit, calling the schedule around each.
pub struct Engine {
    spec: ModelSpec,
    config: EngineConfig,
    /// What this rank stores of each parameter.
    holding: Holding,
    /// Whether the model's low-rank adapters join their layers ([`Engine::set_adapters_enabled`]).
    adapters_on: bool,
    /// Every unit's gradient buffer, concatenated in unit order ([`GradLayout::Contiguous`]).
    grads: Option<Tensor>,
    /// Per unit: its gradients were zeroed and its first backward since then has not run,
    /// so that backward may hand its own parameters' gradients over as computed
    /// ([`Engine::release_fresh_grads`]).
    fresh_grads: Vec<bool>,
    /// Parameters some unit reads from another unit (tied weights): their gradients arrive
    /// in several units' backward and accumulate.
    borrowed: std::collections::BTreeSet<ParamId>,
    storage: Vec<UnitStorage>,
    /// Leaf views into `storage[unit].flat`, indexed by `ParamId`.
    params: Vec<Tensor>,
    /// Offset of each parameter within its unit's flat buffer.
    offsets: Vec<i64>,
    /// Offset of each parameter within its unit's whole (unsplit) layout.
    full_offsets: Vec<i64>,
    ledger: Arc<MemoryLedger>,
    schedule: Box<dyn UnitSchedule>,
    /// What each micro-batch's forward kept for its backward, by micro-batch.
    records: std::collections::BTreeMap<usize, ForwardRecord>,
    /// What the coming forward's rows carry.
    rows: RowContext,
    sync_grads: bool,
    /// Each unit's compute policy.
    compute: Vec<Arc<UnitCompute>>,
    /// What the loss runs under: the last unit's replacements alone.
    loss_compute: Arc<UnitCompute>,
    /// Per unit, the weights it computes in fp8.
    fp8_weights: Vec<Vec<ParamId>>,
    /// Positions whose logits the output head computes at once where it scores the rows
    /// itself ([`Engine::set_chunked_loss`]).
    loss_chunk: Option<i64>,
    /// Every rank of the job, where something of a step must agree over all of them: fp8's
    /// maxima, the experts' loads that move the choice biases.
    job_group: Option<Arc<dyn ProcessGroup>>,
    events: Option<Arc<dyn EventSink>>,
    grad_ready: Option<Arc<GradReady>>,
    /// What the latest forward's sparse layers routed (a mixture of experts).
    routed: Option<Routed>,
    /// Per unit, how the values it keeps for backward are offloaded (`None`: they stay).
    activation_offload: Vec<Option<ActivationOffload>>,
    /// What the shelves of offloaded units share.
    shelves: Option<Arc<ShelfContext>>,
}

/// Held while libtorch's one random generator is seeded and drawn from.
static SEEDED_DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `draw` with libtorch's random generator seeded with `seed`, and no other seeded
/// draw of this process between the two (engines and batches made on several threads).
pub fn with_seed<R>(seed: i64, draw: impl FnOnce() -> R) -> R {
    let _drawing = SEEDED_DRAW.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(seed);
    draw()
}

/// Makes the slice of `unit_grad` at `offset`, shaped like `param`, the parameter's `.grad`,
/// so autograd accumulates into the unit's flat gradient buffer.
fn attach_grad(param: &Tensor, unit_grad: &Tensor, offset: i64) -> Result<()> {
    let g = unit_grad.f_narrow(0, offset, param.numel() as i64)?.f_view(param.size().as_slice())?;
    Ok(strata_ext::set_grad(param, Some(&g))?)
}

impl Engine {
    /// Allocates and initialises the model described by `spec`, each unit laid out as its
    /// [`UnitLayout`] says.
    pub fn new(spec: ModelSpec, config: EngineConfig) -> Result<Engine> {
        Engine::new_with(spec, config, &mut |_, _, _, _| Ok(()))
    }

    /// Like [`Engine::new`], calling `on_unit(unit, storage, initial, ledger)` as soon as
    /// each unit is initialised, before the next is allocated: a sharded strategy keeps its
    /// shard and frees the rest there, so the whole model never exists at once. `initial`
    /// holds the initial values in at least fp32 precision, laid out as `storage.flat`.
    pub(crate) fn new_with(spec: ModelSpec, config: EngineConfig, on_unit: &mut UnitInitHook<'_>) -> Result<Engine> {
        let ledger = Arc::new(MemoryLedger::new());
        if let Some(budget) = config.device_budget {
            ledger.set_budget(Placement::Device, budget);
        }
        if let Some(budget) = config.host_budget {
            ledger.set_budget(Placement::Host, budget);
        }
        if spec.load_balance.as_ref().is_some_and(|b| b.adds_loss()) && config.backward == BackwardMode::WholeGraph {
            return Err(Error::Config(
                "a mixture of experts' load-balancing loss reaches its layers through the unit-by-unit backward".into(),
            ));
        }
        if spec.params.iter().any(|p| p.kind.is_some_and(|k| k != config.kind)) {
            return Err(Error::Model("parameters with their own dtype are not supported yet".into()));
        }
        if config.pad_to < 1 {
            return Err(Error::Config(format!("pad_to must be positive, got {}", config.pad_to)));
        }
        let (tp, tp_rank) = config.tensor.as_ref().map_or((1, 0), |t| (t.size(), t.rank()));
        if tp > 1 {
            spec.check_tensor_parallel(tp)?;
        }
        let holding = config.holding();
        if let Some((size, _)) = holding.experts {
            if let Some(slot) = spec.params.iter().filter_map(|p| p.expert).find(|s| s.of % size != 0) {
                return Err(Error::Config(format!(
                    "expert_parallel: {} experts do not split over {size} ranks",
                    slot.of
                )));
            }
        }
        if config.host_compute.iter().any(|&h| h) && config.grad_layout == GradLayout::Contiguous {
            return Err(Error::Config("units that compute on the host need per-unit gradient buffers".into()));
        }
        let esize = config.kind.elt_size_in_bytes() as u64;
        let layouts: Vec<UnitLayout> =
            (0..spec.units.len()).map(|k| UnitLayout::held(&spec, k, holding, config.pad_to)).collect();
        let mut offsets = vec![0; spec.params.len()];
        let mut full_offsets = vec![0; spec.params.len()];
        for unit in &spec.units {
            let mut offset = 0;
            for id in &unit.params {
                full_offsets[id.0] = offset;
                offset += spec.params[id.0].numel();
            }
        }
        let mut params: Vec<Option<Tensor>> = (0..spec.params.len()).map(|_| None).collect();
        let mut storage = Vec::with_capacity(spec.units.len());
        let grads = match config.grad_layout {
            GradLayout::Contiguous => {
                let total: i64 = layouts.iter().map(UnitLayout::grad_len).sum();
                ledger.alloc(Placement::Device, Category::Grads, total as u64 * esize)?;
                Some(Tensor::f_zeros([total], (config.kind, config.device))?)
            }
            GradLayout::PerUnit => None,
        };
        let mut grads_used = 0;
        for (k, unit) in spec.units.iter().enumerate() {
            let UnitLayout { numel, grad_start, len } = layouts[k];
            let (device, placement) = match config.computes_on_host(k) {
                true => (Device::Cpu, Placement::Host),
                false => (config.device, Placement::Device),
            };
            let opts = (config.kind, device);
            ledger.alloc(placement, Category::Params, len as u64 * esize)?;
            let flat = Tensor::f_zeros([len], opts)?;
            let grad_len = layouts[k].grad_len();
            let grad = match &grads {
                Some(all) => all.f_narrow(0, grads_used, grad_len)?,
                None => {
                    ledger.alloc(placement, Category::Grads, grad_len as u64 * esize)?;
                    Tensor::f_zeros([grad_len], opts)?
                }
            };
            grads_used += grad_len;
            // Values are drawn in fp32 whatever the storage dtype, so a low-precision model
            // starts from the rounded values of the fp32 one (and its fp32 master from them),
            // and on the compute device wherever the unit computes, so that they are the
            // same wherever it does (each device has its own random generator).
            let low_precision = config.kind.elt_size_in_bytes() < 4;
            let drawn_apart = low_precision || device != config.device;
            let initial = if drawn_apart {
                Tensor::f_zeros([len], (if low_precision { Kind::Float } else { config.kind }, config.device))?
            } else {
                flat.shallow_clone()
            };
            let mut offset = 0;
            for &id in &unit.params {
                let p = &spec.params[id.0];
                let (shape, numel) = (holding.shape(p), holding.numel(p));
                let view = flat.f_narrow(0, offset, numel)?.f_view(shape.as_slice())?;
                // Each parameter draws from its own seed, so a rank can initialise any unit
                // alone and get the values every other rank gets; a split one draws the
                // whole tensor and keeps its piece, as one process would have it.
                let target = initial.f_narrow(0, offset, numel)?;
                with_seed(config.seed.wrapping_add(7919 * id.0 as i64), || -> Result<()> {
                    if numel == 0 {
                        return Ok(());
                    }
                    if tp > 1 && p.tp.is_split() {
                        let whole = Tensor::f_empty(p.shape.as_slice(), (initial.kind(), config.device))?;
                        tch::no_grad(|| init(&whole, p.init))?;
                        let piece = p.tp.shard(&whole, tp, tp_rank)?;
                        tch::no_grad(|| target.shallow_clone().f_copy_(&piece.f_reshape([-1])?))?;
                    } else {
                        tch::no_grad(|| init(&target, p.init))?;
                    }
                    Ok(())
                })?;
                let leaf = view.f_detach()?.f_set_requires_grad(p.requires_grad)?;
                if p.requires_grad {
                    attach_grad(&leaf, &grad, offset - grad_start)?;
                }
                offsets[id.0] = offset;
                params[id.0] = Some(leaf);
                offset += numel;
            }
            if drawn_apart {
                tch::no_grad(|| flat.shallow_clone().f_copy_(&initial))?;
            }
            let trainable = grad_len > 0;
            let mut unit_storage = UnitStorage { flat, grad, grad_start, numel, trainable };
            on_unit(k, &mut unit_storage, &initial, &ledger)?;
            storage.push(unit_storage);
        }
        // A moving choice bias is written where the optimizer writes: it must lie in its
        // unit's gradient span, not in a frozen head (LoRA's base, frozen layers).
        let moving = spec.load_balance.as_ref().map(|b| b.moving_biases()).unwrap_or_default();
        if let Some(&(_, id)) =
            moving.iter().find(|(_, id)| spec.holds(*id) && offsets[id.0] < storage[spec.params[id.0].unit].grad_start)
        {
            return Err(Error::Config(format!(
                "{} cannot move: it is frozen with the weights before it (a LoRA run's base, --freeze); \
                 train without the choice bias's update",
                spec.params[id.0].name
            )));
        }
        // Parameters of units another pipeline stage holds stay undefined here.
        let params = params.into_iter().map(|p| p.unwrap_or_else(Tensor::new)).collect();
        let units = spec.units.len();
        tracing::debug!(units, params = spec.num_params(), device = ?config.device, "engine allocated");
        let borrowed = spec.units.iter().flat_map(|u| u.borrowed.iter().copied()).collect();
        Ok(Engine {
            spec,
            config,
            holding,
            adapters_on: true,
            grads,
            fresh_grads: vec![false; units],
            borrowed,
            storage,
            params,
            offsets,
            full_offsets,
            ledger,
            schedule: Box::new(Resident),
            records: Default::default(),
            rows: RowContext::default(),
            sync_grads: true,
            compute: (0..units).map(|_| Arc::new(UnitCompute::default())).collect(),
            loss_compute: Arc::new(UnitCompute::default()),
            fp8_weights: vec![vec![]; units],
            job_group: None,
            loss_chunk: None,
            events: None,
            grad_ready: None,
            routed: None,
            activation_offload: vec![None; units],
            shelves: None,
        })
    }

    /// Replaces the per-unit policy (strategies install theirs here).
    pub fn set_schedule(&mut self, schedule: Box<dyn UnitSchedule>) {
        self.schedule = schedule;
        if let Some(sink) = &self.events {
            self.schedule.attach_events(sink.clone());
        }
    }

    /// Reports this engine's events (and its schedule's) to `sink`.
    pub fn set_event_sink(&mut self, sink: Arc<dyn EventSink>) {
        self.schedule.attach_events(sink.clone());
        self.events = Some(sink);
    }

    /// Bytes the allocator holds for the buffers of parameters and gradients: the engine's
    /// and its schedule's, each storage counted once.
    pub fn model_state_storage_bytes(&self) -> Result<u64> {
        let mut seen = std::collections::HashSet::new();
        let mut total = 0u64;
        let held = self.schedule.held_tensors();
        let engine_buffers = self.storage.iter().flat_map(|s| [&s.flat, &s.grad]);
        for t in engine_buffers.chain(held.iter()) {
            if seen.insert(strata_ext::storage_id(t)?) {
                total += strata_ext::storage_nbytes(t)? as u64;
            }
        }
        Ok(total)
    }

    /// The model the engine runs.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The configuration the engine was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The ledger of the bytes the engine and its optimizer hold.
    pub fn ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }

    /// Each unit's flat buffers, in unit order.
    pub fn storage(&self) -> &[UnitStorage] {
        &self.storage
    }

    /// All gradients in one buffer (with [`GradLayout::Contiguous`]); unit `k`'s `grad` is
    /// the slice after units `0..k`'s.
    pub(crate) fn grads(&self) -> Option<&Tensor> {
        self.grads.as_ref()
    }

    /// Moves the contiguous gradient buffer into `buffer` (same length, dtype and device;
    /// memory a backend's collectives read in place, say): its values are copied, and every
    /// unit's gradient slice and every parameter's `.grad` become views of the new buffer.
    pub(crate) fn place_grads(&mut self, buffer: Tensor) -> Result<()> {
        let Some(old) = &self.grads else {
            return Err(Error::Engine("only the contiguous gradient layout has one buffer to move".into()));
        };
        if buffer.size() != old.size() || buffer.kind() != old.kind() || buffer.device() != old.device() {
            return Err(Error::Engine(format!(
                "a gradient buffer of {:?} {:?} on {:?} cannot replace one of {:?} {:?} on {:?}",
                buffer.size(),
                buffer.kind(),
                buffer.device(),
                old.size(),
                old.kind(),
                old.device()
            )));
        }
        tch::no_grad(|| buffer.shallow_clone().f_copy_(old))?;
        let mut start = 0;
        for (unit, storage) in self.spec.units.iter().zip(&mut self.storage) {
            let len = storage.grad.numel() as i64;
            storage.grad = buffer.f_narrow(0, start, len)?;
            for &id in &unit.params {
                let p = &self.params[id.0];
                if p.requires_grad() {
                    attach_grad(p, &storage.grad, self.offsets[id.0] - storage.grad_start)?;
                }
            }
            start += len;
        }
        self.grads = Some(buffer);
        Ok(())
    }

    /// Position of parameter `id` in its unit's whole layout ([`Engine::full_unit`]'s).
    pub fn full_offset(&self, id: ParamId) -> i64 {
        self.full_offsets[id.0]
    }

    /// The tensor group the units are split over, if they are.
    pub(crate) fn tensor_parallel(&self) -> Option<&Arc<dyn TensorParallel>> {
        self.config.tensor.as_ref().filter(|t| t.size() > 1)
    }

    /// The parameter tensor (a leaf view into its unit's flat buffer).
    pub fn param(&self, id: ParamId) -> &Tensor {
        &self.params[id.0]
    }

    /// The parameter called `name` (aliases included).
    pub fn param_by_name(&self, name: &str) -> Option<&Tensor> {
        self.spec.find(name).map(|id| &self.params[id.0])
    }

    /// Parameters with their canonical names, in declaration order (those this engine's
    /// units hold).
    pub fn named_params(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.spec.params.iter().map(|p| p.name.as_str()).zip(self.params.iter()).filter(|(_, t)| t.defined())
    }

    /// The schedule and what it may act on for `unit`.
    fn schedule_for(&mut self, unit: usize) -> (&mut dyn UnitSchedule, ScheduleContext<'_>) {
        let ctx = ScheduleContext {
            unit,
            spec: &self.spec,
            storage: &mut self.storage,
            ledger: &self.ledger,
            sync_grads: self.sync_grads,
            grad_ready: self.grad_ready.as_deref(),
        };
        (self.schedule.as_mut(), ctx)
    }

    /// The schedule's work for `phase` of `unit`, with nothing recorded.
    fn schedule_on(&mut self, phase: Phase, unit: usize) -> Result<()> {
        let (schedule, ctx) = self.schedule_for(unit);
        schedule.on(phase, ctx)
    }

    /// The schedule's work for `phase` of `unit`, recorded as that phase.
    fn run_schedule(&mut self, phase: Phase, unit: usize) -> Result<()> {
        self.schedule_on(phase, unit)?;
        if let Some(sink) = &self.events {
            let by_category = self.ledger.report().into_values().flat_map(|r| r.by_category);
            let ledger_bytes =
                by_category.filter(|(c, _)| matches!(c, Category::Params | Category::Grads)).map(|(_, b)| b).sum();
            let storage_bytes = self.model_state_storage_bytes()?;
            sink.record(Event::Phase { phase, unit, ledger_bytes, storage_bytes });
        }
        Ok(())
    }

    /// After the optimizer's update: the schedule publishes it (e.g. gathers updated shards).
    pub(crate) fn after_update(&mut self) -> Result<()> {
        let (schedule, ctx) = self.schedule_for(0);
        schedule.after_update(ctx)
    }

    /// Why a training step of this engine cannot be captured as a CUDA graph, if it cannot:
    /// a step captured runs no host code when replayed, so nothing in it may wait for the
    /// device or decide on the host from what the device computed.
    pub(crate) fn capture_obstacle(&self) -> Option<String> {
        if !self.config.device.is_cuda() || !strata_ext::cuda::is_built() {
            return Some(format!(
                "it needs a CUDA device and a build with CUDA; this engine runs on {:?}",
                self.config.device
            ));
        }
        if self.spec.load_balance.is_some() {
            return Some(
                "a mixture of experts sends each expert as many tokens as it routes there, step by step".into(),
            );
        }
        if let Some(tp) = self.tensor_parallel() {
            return Some(format!(
                "tensor parallelism over {} ranks: its collectives are waited for by the host",
                tp.size()
            ));
        }
        if self.config.host_compute.iter().any(|&h| h) {
            return Some("units computed on the host".into());
        }
        if self.spec.dropout {
            return Some(
                "dropout draws each step's masks from the step's number, which a replay would not change".into(),
            );
        }
        let delayed = |s: &compute::fp8::SharedFp8| s.lock().map_or(true, |s| s.config.scaling == Fp8Scaling::Delayed);
        if self.compute.iter().filter_map(|c| c.fp8.as_ref()).any(delayed) {
            return Some(
                "fp8's delayed scaling reads every step's maxima on the host (current or rowwise scaling reads none)"
                    .into(),
            );
        }
        self.schedule.capture_obstacle()
    }

    /// Ends a step, whether it updated or was skipped: fp8 scaling takes in the step's
    /// statistics, so none leak into the next step.
    pub(crate) fn end_step(&mut self) -> Result<()> {
        // Each unit has an fp8 state of its own; they end the step together.
        let mut states = Vec::new();
        for state in self.compute.iter().filter_map(|p| p.fp8.as_ref()) {
            states.push(state.lock().map_err(|e| Error::Engine(e.to_string()))?);
        }
        let mut units: Vec<&mut compute::fp8::Fp8Unit> = states.iter_mut().map(|s| &mut **s).collect();
        compute::fp8::end_steps(&mut units, self.job_group.as_deref())?;
        if let Some(sink) = &self.events {
            sink.record(Event::Update { done: true });
        }
        Ok(())
    }

    /// Whether the global gradient norm is this rank's own (nothing sharded or split over
    /// other ranks).
    pub(crate) fn grad_norm_is_local(&self) -> bool {
        self.tensor_parallel().is_none() && self.holding.experts.is_none() && self.schedule.grad_norm_is_local()
    }

    /// The global sum of squared gradients from this rank's per-unit sums (unit, sum).
    pub(crate) fn grad_sq_sum(&self, per_unit: &[(usize, f64)]) -> Result<f64> {
        let mut sum = self.schedule.grad_sq_sum(per_unit)?;
        // Each tensor rank holds its pieces (and a 1/tp share of what they all hold whole),
        // each expert rank its experts (and a share of the rest, [`Engine::segments`]).
        if let Some(tp) = self.tensor_parallel() {
            sum = tp.sum_values(&[sum])?[0];
        }
        if let Some(group) = self.apart_experts() {
            sum = group.sum_values(&[sum])?[0];
        }
        Ok(sum)
    }

    /// dtype of the values the optimizer updates and checkpoints hold.
    pub(crate) fn master_kind(&self) -> Kind {
        self.schedule.master_kind().unwrap_or(self.config.kind)
    }

    /// What the schedule keeps of the model states (shards, masters, host copies), to be
    /// asked of them directly.
    pub(crate) fn held_states(&self) -> &dyn HeldStates {
        self.schedule.as_ref()
    }

    /// Per unit, the range (start, length) of its flat layout whose master values and
    /// optimizer state this rank keeps (all of it without sharding; padding excluded).
    pub(crate) fn shard_ranges(&mut self) -> Result<Vec<(i64, i64)>> {
        (0..self.spec.units.len())
            .map(|unit| {
                let numel = self.storage[unit].numel;
                let (schedule, ctx) = self.schedule_for(unit);
                let view = schedule.optimizer_view(ctx)?;
                let start = view.offset.min(numel);
                Ok((start, (view.param.numel() as i64).min(numel - start)))
            })
            .collect()
    }

    /// The master values of this rank's range of unit `unit` (see [`Engine::shard_ranges`]),
    /// padding included at the end.
    pub(crate) fn local_params(&mut self, unit: usize) -> Result<Tensor> {
        let (schedule, ctx) = self.schedule_for(unit);
        Ok(schedule.optimizer_view(ctx)?.param)
    }

    /// Unit `unit`'s parameters, whole and unpadded, in `Engine::master_kind`, laid out
    /// at [`Engine::full_offset`]s; with a sharded strategy every rank of the shard group
    /// (and of the tensor group, and of an expert group storing its experts apart) must call
    /// this together.
    pub fn full_unit(&mut self, unit: usize) -> Result<Tensor> {
        let (schedule, ctx) = self.schedule_for(unit);
        let local = schedule.full_unit(ctx)?;
        let tensor_whole = match self.tensor_parallel().cloned() {
            Some(tp) => self.join_tensor_pieces(unit, &local, tp.as_ref())?,
            None => local,
        };
        match self.apart_experts() {
            Some(group) => self.join_expert_pieces(unit, &tensor_whole, group.as_ref()),
            None => Ok(tensor_whole),
        }
    }

    /// Unit `unit`'s parameters this rank stores, each whole over the tensor group, from
    /// this rank's pieces `local` (in its own layout).
    fn join_tensor_pieces(&self, unit: usize, local: &Tensor, tp: &dyn TensorParallel) -> Result<Tensor> {
        let pieces = tp.gather(local)?;
        let mut whole = Vec::new();
        for &id in &self.spec.units[unit].params {
            let p = &self.spec.params[id.0];
            if !self.holding.holds(p) {
                continue;
            }
            let shape = self.holding.shape(p);
            let numel = shape.iter().product::<i64>();
            let of_param = pieces
                .iter()
                .map(|t| t.f_narrow(0, self.offsets[id.0], numel)?.f_view(shape.as_slice()))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            // Every tensor rank updates its copy of a whole parameter alike; a copy that
            // drifted would make the ranks compute different models.
            if !p.tp.is_split() && of_param.iter().skip(1).any(|t| !t.equal(&of_param[0])) {
                return Err(Error::Engine(format!(
                    "{} differs between the tensor ranks that each hold it whole",
                    p.name
                )));
            }
            whole.push(p.tp.unshard(&of_param, &p.shape)?.f_reshape([-1])?);
        }
        Ok(Tensor::f_cat(&whole, 0)?)
    }

    /// Unit `unit`'s whole parameters from `mine`, those this rank stores (whole over the
    /// tensor group): each routed expert from the rank of the expert group that stores it,
    /// the rest from this rank. Every rank stores as many elements, so one gather serves.
    fn join_expert_pieces(&self, unit: usize, mine: &Tensor, group: &dyn ExpertExchange) -> Result<Tensor> {
        let (size, rank) = (group.size(), group.rank());
        let pieces = group.gather(mine)?;
        let mut read = vec![0; size];
        let mut whole = Vec::new();
        for &id in &self.spec.units[unit].params {
            let p = &self.spec.params[id.0];
            let numel = p.numel();
            match p.expert {
                Some(slot) => {
                    let owner = slot.owner(size as i64) as usize;
                    whole.push(pieces[owner].f_narrow(0, read[owner], numel)?);
                    read[owner] += numel;
                }
                None => {
                    whole.push(mine.f_narrow(0, read[rank], numel)?);
                    read.iter_mut().for_each(|at| *at += numel);
                }
            }
        }
        Ok(Tensor::f_cat(&whole, 0)?)
    }

    /// Replaces unit `unit`'s parameters with `values` (whole and unpadded, laid out as
    /// [`Engine::full_unit`] returns them, converted as needed).
    pub fn set_full_unit(&mut self, unit: usize, values: &Tensor) -> Result<()> {
        let expected: i64 = self.spec.units[unit].params.iter().map(|id| self.spec.params[id.0].numel()).sum();
        if values.numel() as i64 != expected {
            return Err(Error::Model(format!(
                "unit {} holds {expected} elements, got {}",
                self.spec.units[unit].name,
                values.numel()
            )));
        }
        let local = self.split_unit(unit, values)?;
        let (schedule, ctx) = self.schedule_for(unit);
        schedule.set_full_unit(ctx, &local)
    }

    /// This rank's pieces of unit `unit`'s whole flat layout `values`, in its own layout
    /// ([`Engine::offset`]s; unpadded); `values` itself where this rank stores everything whole.
    pub(crate) fn split_unit(&self, unit: usize, values: &Tensor) -> Result<Tensor> {
        let tp = self.tensor_parallel();
        if tp.is_none() && self.holding.experts.is_none() {
            return Ok(values.shallow_clone());
        }
        let mut pieces = Vec::new();
        for &id in &self.spec.units[unit].params {
            let p = &self.spec.params[id.0];
            if !self.holding.holds(p) {
                continue;
            }
            let whole = values.f_narrow(0, self.full_offsets[id.0], p.numel())?.f_view(p.shape.as_slice())?;
            let piece = match tp {
                Some(tp) => p.tp.shard(&whole, tp.size(), tp.rank())?,
                None => whole,
            };
            pieces.push(piece.f_reshape([-1])?);
        }
        Ok(Tensor::f_cat(&pieces, 0)?)
    }

    /// What this rank stores of each parameter.
    pub fn holding(&self) -> Holding {
        self.holding
    }

    /// The expert group, where it stores its routed experts apart.
    fn apart_experts(&self) -> Option<Arc<dyn ExpertExchange>> {
        self.config.experts.clone().filter(|_| self.holding.experts.is_some())
    }

    /// Where the expert group stores its experts apart, the runs (start, length) of unit
    /// `unit`'s flat layout that hold this rank's routed experts; empty otherwise.
    pub(crate) fn expert_stretches(&self, unit: usize) -> Vec<(i64, i64)> {
        self.holding.expert_stretches(&self.spec, unit)
    }

    /// Calls `ready` with each unit whose gradient the step's completing backward has made
    /// final where the optimizer updates it on the host (`None`: nobody is told).
    pub(crate) fn set_grad_ready(&mut self, ready: Option<Arc<GradReady>>) {
        self.grad_ready = ready;
    }

    /// Says whether the next backward completes the step's gradients (default true); with
    /// gradient accumulation, only the last micro-batch's should.
    pub fn set_grad_sync(&mut self, sync: bool) {
        self.sync_grads = sync;
    }

    /// Runs the schedule's gradient synchronisation for unit `k`, as the end of the backward
    /// that completes a step's gradients would; for gradients completed after their
    /// backward (the zero-bubble schedules' deferred weight gradients). Call it for every
    /// unit, last first, each once nothing left to compute adds to its gradients.
    pub(crate) fn sync_unit_grads_now(&mut self, k: usize) -> Result<()> {
        let previous = std::mem::replace(&mut self.sync_grads, true);
        // No unit's backward ends here, so no phase event is recorded.
        let result = self.schedule_on(Phase::AfterBackward, k);
        self.sync_grads = previous;
        result
    }

    /// The unit whose parameter buffer holds `t` (a parameter, or a view of one).
    pub(crate) fn unit_holding(&self, t: &Tensor) -> Result<usize> {
        let id = strata_ext::storage_id(t)?;
        for (k, s) in self.storage.iter().enumerate() {
            if strata_ext::storage_id(&s.flat)? == id {
                return Ok(k);
            }
        }
        Err(Error::Engine("a tensor that belongs to no unit's parameters".into()))
    }

    /// Waits for the schedule's work on the gradients; call before the optimizer step.
    pub fn finish_grads(&mut self) -> Result<()> {
        let (schedule, ctx) = self.schedule_for(0);
        schedule.finish_grads(ctx)?;
        if let Some(sink) = &self.events {
            sink.record(Event::Update { done: false });
        }
        Ok(())
    }

    /// Sets the layout of the rows the next forwards run on (each until it is set again):
    /// where rows hold packed examples, units read positions from it and attend within an
    /// example; `None` for plain rows. Other rows than the last ones: their padding and
    /// dropout draw are forgotten too.
    pub fn set_layout(&mut self, layout: Option<&RowLayout>) {
        self.rows = RowContext { layout: layout.map(RowLayout::shallow_clone), ..RowContext::default() };
    }

    /// Switches the model's low-rank adapters out of (or back into) every later forward: off,
    /// a LoRA model computes as its frozen base does: the reference model of preference and
    /// GRPO training, without a second copy, where the adapters start at zero. On by default.
    pub fn set_adapters_enabled(&mut self, on: bool) {
        self.adapters_on = on;
    }

    /// The adapters forwards join to their layers: none while they are switched off.
    fn joined_adapters(&self) -> &crate::model::Adapters {
        static NONE: crate::model::Adapters = crate::model::Adapters::new();
        match self.adapters_on {
            true => &self.spec.adapters,
            false => &NONE,
        }
    }

    /// Sets which positions of the rows the next training forwards run on are padding
    /// (`[rows, ctx]` bool; `None`: none is), which a mixture of experts' routing statistics
    /// leave out.
    pub(crate) fn set_padding(&mut self, padding: Option<&Tensor>) {
        self.rows.padding = padding.map(Tensor::shallow_clone);
    }

    /// Sets the next tokens of the rows the next forwards run on (`[rows, ctx]`; `None`:
    /// unknown): under [`Engine::set_chunked_loss`] the output head returns the mean loss
    /// against them instead of logits.
    pub fn set_targets(&mut self, targets: Option<&Tensor>) {
        self.rows.targets = targets.map(Tensor::shallow_clone);
    }

    /// Has the output head compute the next-token loss itself, `positions` at a time, in
    /// every forward whose rows carry targets ([`Engine::set_targets`]): its output is then
    /// that loss, a scalar, and the `[tokens, vocabulary]` logits never exist at once. `None`:
    /// the head returns logits. A head split over tensor ranks scores its columns (a
    /// pipeline stage without the head takes it and does nothing).
    pub fn set_chunked_loss(&mut self, positions: Option<i64>) -> Result<()> {
        if let Some(n) = positions.filter(|&n| n < 1) {
            return Err(Error::Config(format!("chunked_loss: positions must be positive, got {n}")));
        }
        self.loss_chunk = positions;
        Ok(())
    }

    /// Sets the draw of the dropout masks of the next forwards, until the rows change
    /// ([`Engine::set_layout`]; `None`: nothing is dropped): a loop of your own calls it
    /// before each training forward, as the trainer does. [`Engine::evaluate`] never drops.
    pub fn set_dropout(&mut self, dropout: Option<DropoutDraw>) {
        self.rows.dropout = dropout;
    }

    /// Runs every unit in order and returns the last unit's output. In unit-by-unit mode the
    /// output is a leaf: compute the loss from it, then call [`Engine::backward`].
    pub fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        self.release_records();
        self.forward_micro(0, input)
    }

    /// [`Engine::forward`] of micro-batch `micro`, keeping its records beside those of other
    /// micro-batches until [`Engine::backward_micro`] consumes them (a pipeline stage holds
    /// several). An input that requires a gradient (an activation from an earlier stage) gets
    /// one: backward returns it.
    pub fn forward_micro(&mut self, micro: usize, input: &Tensor) -> Result<Tensor> {
        if let Some(old) = self.records.remove(&micro) {
            self.forget(&old);
        }
        let unit_by_unit = self.config.backward == BackwardMode::UnitByUnit;
        let input_grad = input.requires_grad();
        let mut x = input.shallow_clone();
        if let Some(balance) = &self.spec.load_balance {
            balance.open(micro);
        }
        let mut boundaries = Vec::with_capacity(self.spec.units.len());
        let (mut activation_bytes, mut shelved_bytes) = (0, 0);
        for k in 0..self.spec.units.len() {
            self.run_schedule(Phase::BeforeForward, k)?;
            let cut = (unit_by_unit && (k > 0 || input_grad)).then(|| x.detach().set_requires_grad(true));
            let unit_input = cut.as_ref().unwrap_or(&x).shallow_clone();
            // A recomputed unit keeps nothing of its forward but its input.
            let recompute = self.compute[k].recompute;
            let shelf = self.new_shelf(k);
            let rows = &self.rows;
            let y = if recompute {
                tch::no_grad(|| self.unit_forward(k, &unit_input, false, rows))?
            } else {
                let _offloading = shelf.as_ref().map(Shelf::hooks).transpose()?;
                self.unit_forward(k, &unit_input, false, rows)?
            };
            let bytes = memory::tensor_bytes(&y);
            self.ledger.alloc(Placement::Device, Category::Activations, bytes)?;
            activation_bytes += bytes;
            let recompute_from = match (recompute, &shelf) {
                (false, _) => None,
                (true, Some(shelf)) => Some(RecomputeFrom::Shelved(shelf.store(&unit_input)?)),
                (true, None) => Some(RecomputeFrom::Device(unit_input)),
            };
            if let Some(shelf) = &shelf {
                let bytes = shelf.host_bytes()?;
                self.ledger.alloc(Placement::Host, Category::Activations, bytes)?;
                shelved_bytes += bytes;
            }
            boundaries.push(Boundary { input: cut, output: y.shallow_clone(), recompute_from, shelf });
            self.run_schedule(Phase::AfterForward, k)?;
            x = y;
            // The unit before this one has had a unit's compute to copy its values out.
            if k > 0 {
                activation_bytes -= self.settle_shelf(&boundaries, k - 1)?;
            }
        }
        if let Some(last) = boundaries.len().checked_sub(1) {
            activation_bytes -= self.settle_shelf(&boundaries, last)?;
        }
        let out = if unit_by_unit { x.detach().set_requires_grad(true) } else { x };
        self.close_routing(micro, None)?;
        if let Some(balance) = &self.spec.load_balance {
            let spec = &self.spec;
            balance.count_step(micro, |id| spec.holds(id))?;
        }
        let record = ForwardRecord {
            boundaries,
            out: out.shallow_clone(),
            activation_bytes,
            shelved_bytes,
            rows: self.rows.shallow_clone(),
        };
        self.records.insert(micro, record);
        Ok(out)
    }

    /// Frees the values of micro-batch `micro`'s output, which a pipeline stage has sent on
    /// (Megatron-LM's `deallocate_output_tensor`): backward keeps the tensor and its node,
    /// not the values, where the node that made it never reads them and no other tensor
    /// shares their storage. Returns whether they were freed; the caller must not read the
    /// output again.
    pub(crate) fn free_output_values(&mut self, micro: usize) -> Result<bool> {
        let Some(record) = self.records.get_mut(&micro) else { return Ok(false) };
        let Some(last) = record.boundaries.last() else { return Ok(false) };
        let y = &last.output;
        let bytes = memory::tensor_bytes(y);
        let owns_storage = bytes > 0 && y.is_contiguous() && strata_ext::storage_nbytes(y)? as u64 == bytes;
        let node = strata_ext::grad_fn_name(y)?.unwrap_or_default();
        if !owns_storage || !NODES_NOT_READING_THEIR_OUTPUT.iter().any(|n| node.ends_with(n)) {
            return Ok(false);
        }
        // SAFETY: the node that made `y` does not read its values in backward, no other
        // tensor shares the storage (the detached output, which shares it, is not read
        // again: the caller's contract), and nothing is in flight on it.
        unsafe { memory::release_buffer(y) }?;
        record.activation_bytes = record.activation_bytes.saturating_sub(bytes);
        self.ledger.free(Placement::Device, Category::Activations, bytes);
        // What the storage now holds, not what was asked of it.
        Ok(strata_ext::storage_nbytes(y)? == 0)
    }

    /// Forward without recording anything for backward (evaluation).
    pub fn evaluate(&mut self, input: &Tensor) -> Result<Tensor> {
        self.release_records();
        self.routed = None;
        let mut x = input.shallow_clone();
        let rows = self.rows.evaluated();
        for k in 0..self.spec.units.len() {
            self.run_schedule(Phase::BeforeForward, k)?;
            x = tch::no_grad(|| self.unit_forward(k, &x, false, &rows))?;
            self.run_schedule(Phase::AfterForward, k)?;
        }
        Ok(x)
    }

    /// Forward of the next positions of sequences whose earlier positions went through the
    /// same `caches` (one per unit, each [`DecodeCache::default`] at the start): decoding with
    /// a key/value cache, recording nothing for backward. Units read the layout set by
    /// [`Engine::set_layout`] (an encoder–decoder's first step names its source there). Each
    /// unit runs as declared, without the strategy's compute policy. Units split over a
    /// tensor group decode their pieces as their forward does (the output then holds this
    /// rank's columns of a split head), with the new positions whole on every rank even
    /// under sequence parallel. A vocabulary head that ends the units reads the last
    /// position alone, as decoding chooses from it (`transformers`' `logits_to_keep = 1`):
    /// a prompt's prefill never holds logits for all its positions.
    pub fn decode(&mut self, input: &Tensor, caches: &mut [DecodeCache]) -> Result<Tensor> {
        if caches.len() != self.spec.units.len() {
            return Err(Error::Engine(format!("{} decode caches for {} units", caches.len(), self.spec.units.len())));
        }
        if self.holding.experts.is_some() {
            return Err(Error::Config(
                "expert_parallel: decoding computes every expert on each rank, which stores only its own; \
                 generate from the saved folder, or train without expert_parallel"
                    .into(),
            ));
        }
        self.release_records();
        let mut x = input.shallow_clone();
        let last = caches.len().saturating_sub(1);
        for (k, cache) in caches.iter_mut().enumerate() {
            self.run_schedule(Phase::BeforeForward, k)?;
            let positions = x.size().get(1).copied().unwrap_or(1);
            if k == last && self.spec.units[k].body.scores_in_chunks() && positions > 1 {
                x = x.f_narrow(1, positions - 1, 1)?;
            }
            let input = self.where_unit_computes(k, &x)?;
            let moved = self.layout_on_host(k, self.rows.layout.as_ref())?;
            let layout = moved.as_ref().or(self.rows.layout.as_ref());
            let whole = self.config.tensor.as_deref().map(WholeSequence);
            let params = match &whole {
                Some(tp) => Params::split(&self.params, tp),
                None => Params::new(&self.params),
            }
            .with_adapters(self.joined_adapters())
            .with_layout(layout);
            let y = tch::no_grad(|| self.spec.units[k].body.decode(&params, &input, cache))?;
            x = self.on_the_device(k, y)?;
            self.run_schedule(Phase::AfterForward, k)?;
        }
        Ok(x)
    }

    /// Backward from `loss`, a scalar computed from the last [`Engine::forward`]'s output.
    /// Parameter gradients accumulate into the flat gradient buffers.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        self.backward_micro(0, Upstream::Loss(loss)).map(|_| ())
    }

    /// Backward of micro-batch `micro` from a loss computed from its output, or from the
    /// gradient of its output (received from the next pipeline stage). Returns the gradient
    /// of its input, where the input took one.
    pub fn backward_micro(&mut self, micro: usize, upstream: Upstream<'_>) -> Result<Option<Tensor>> {
        let record =
            self.records.remove(&micro).ok_or_else(|| Error::Engine("backward called without a forward".into()))?;
        if let Some(balance) = &self.spec.load_balance {
            balance.select(micro);
        }
        let result = self.backward_from(upstream, &record);
        self.forget(&record);
        result
    }

    fn backward_from(&mut self, seed: Upstream<'_>, record: &ForwardRecord) -> Result<Option<Tensor>> {
        let units = self.spec.units.len();
        let result = self.backward_units(seed, record);
        // Units the gradient did not reach got none this time: zeros, as accumulation gives.
        for k in 0..units {
            let released = self.release_fresh_grads(k)?;
            self.land_grads(k, &released)?;
        }
        result
    }

    fn backward_units(&mut self, seed: Upstream<'_>, record: &ForwardRecord) -> Result<Option<Tensor>> {
        let mut upstream = match seed {
            Upstream::Loss(loss) => {
                if loss.numel() != 1 {
                    return Err(Error::Engine(format!("backward needs a scalar loss, got shape {:?}", loss.size())));
                }
                let ones = loss.f_ones_like()?;
                if self.config.backward == BackwardMode::WholeGraph {
                    let released =
                        (0..self.spec.units.len()).map(|k| self.release_fresh_grads(k)).collect::<Result<Vec<_>>>()?;
                    strata_ext::backward(&[loss], &[&ones], false)?;
                    for (k, released) in released.iter().enumerate() {
                        self.land_grads(k, released)?;
                    }
                    return Ok(None);
                }
                strata_ext::backward(&[loss], &[&ones], false)?;
                record.out.grad()
            }
            Upstream::Grad(_) if self.config.backward == BackwardMode::WholeGraph => {
                return Err(Error::Engine("a gradient from another stage needs the unit-by-unit backward".into()))
            }
            Upstream::Grad(g) => g.shallow_clone(),
        };
        if !upstream.defined() {
            return Err(Error::Engine("the loss does not depend on the model's output".into()));
        }
        for k in (0..self.spec.units.len()).rev() {
            self.run_schedule(Phase::BeforeBackward, k)?;
            let b = &record.boundaries[k];
            // This unit's values come back now if they have not yet; the next unit's start
            // coming while this one computes.
            for shelf in [Some(b), k.checked_sub(1).map(|j| &record.boundaries[j])].into_iter().flatten() {
                shelf.shelf.as_ref().map(Shelf::fetch).transpose()?;
            }
            let began = self.events.as_ref().map(|_| std::time::Instant::now());
            // The cut leaf itself, or a shelved input back as a leaf of its own, which then
            // takes the input's gradient.
            let recompute_input = match (&b.recompute_from, &b.shelf) {
                (Some(RecomputeFrom::Device(input)), _) => Some(input.shallow_clone()),
                (Some(RecomputeFrom::Shelved(ticket)), Some(shelf)) => {
                    Some(shelf.take(*ticket)?.set_requires_grad(b.input.is_some()))
                }
                (Some(RecomputeFrom::Shelved(_)), None) => {
                    return Err(Error::Engine(format!("unit {k}'s input is shelved without a shelf")))
                }
                (None, _) => None,
            };
            let recomputed =
                recompute_input.as_ref().map(|input| self.unit_forward(k, input, true, &record.rows)).transpose()?;
            if let (Some(sink), Some(began), Some(_)) = (&self.events, began, &recomputed) {
                sink.record(Event::Recomputed { unit: k, began });
            }
            let output = recomputed.as_ref().unwrap_or(&b.output);
            let released = self.release_fresh_grads(k)?;
            if output.requires_grad() {
                strata_ext::backward(&[output], &[&upstream], false)?;
            }
            self.land_grads(k, &released)?;
            b.shelf.as_ref().map(Shelf::clear).transpose()?;
            self.run_schedule(Phase::AfterBackward, k)?;
            match recompute_input.as_ref().or(b.input.as_ref()) {
                Some(input) if input.grad().defined() => {
                    upstream = input.grad();
                    // The next unit's backward is its only reader: the cut leaf lets go.
                    strata_ext::set_grad(input, None)?;
                }
                _ => return Ok(None),
            }
        }
        // The loop ended at the first unit with the gradient of a cut input.
        Ok(Some(upstream))
    }

    /// Parameter `id`'s slice of its unit's flat gradient buffer, shaped as the parameter.
    fn grad_view(&self, id: ParamId) -> Result<Tensor> {
        let p = &self.params[id.0];
        let storage = &self.storage[self.spec.params[id.0].unit];
        let at = self.offsets[id.0] - storage.grad_start;
        Ok(storage.grad.f_narrow(0, at, p.numel() as i64)?.f_view(p.size().as_slice())?)
    }

    /// Before unit `k`'s first backward since its gradients were zeroed: its own trainable
    /// parameters that no other unit borrows give up their `.grad` view, so autograd hands
    /// the new gradient over as computed instead of adding it to zeros, and
    /// [`Engine::land_grads`] copies it into the flat buffer: one pass over the gradients
    /// where zeroing and accumulating take two, writing three times. Returns them.
    fn release_fresh_grads(&mut self, k: usize) -> Result<Vec<ParamId>> {
        if !std::mem::take(&mut self.fresh_grads[k]) {
            return Ok(Vec::new());
        }
        let mut released = Vec::new();
        for &id in &self.spec.units[k].params {
            let p = &self.params[id.0];
            if p.requires_grad() && !self.borrowed.contains(&id) {
                strata_ext::set_grad(p, None)?;
                released.push(id);
            }
        }
        Ok(released)
    }

    /// Puts the gradients of `released` parameters (zeros where none came) into their
    /// slices of the flat buffer and makes those slices their `.grad` again.
    fn land_grads(&self, k: usize, released: &[ParamId]) -> Result<()> {
        for &id in released {
            let (p, mut view) = (&self.params[id.0], self.grad_view(id)?);
            let g = p.grad();
            tch::no_grad(|| if g.defined() { view.f_copy_(&g) } else { view.f_zero_().map(|_| ()) })?;
            attach_grad(p, &self.storage[k].grad, self.offsets[id.0] - self.storage[k].grad_start)?;
        }
        Ok(())
    }

    /// Unit `k`'s forward under its compute policy, where the unit computes: a unit that
    /// computes on the host takes its input there and hands its output to the device (both
    /// moves are recorded, so backward moves the gradients back). `rows`: what the rows
    /// carry beside their tokens.
    fn unit_forward(&self, k: usize, input: &Tensor, recomputing: bool, rows: &RowContext) -> Result<Tensor> {
        let unit = &self.spec.units[k];
        let policy = &self.compute[k];
        let wrapped = self.unit_params(k)?;
        let moved = self.layout_on_host(k, rows.layout.as_ref())?;
        let layout = moved.as_ref().or(rows.layout.as_ref());
        let padding = rows.padding.as_ref().map(|p| self.where_unit_computes(k, p)).transpose()?;
        let dropout = rows.dropout.map(|draw| draw.unit(&unit.name));
        let scoring = match (self.loss_chunk, &rows.targets) {
            (Some(positions), Some(targets)) if unit.body.scores_in_chunks() => {
                Some(HeadScoring { targets: targets.shallow_clone(), positions })
            }
            _ => None,
        };
        let params = match &self.config.tensor {
            Some(tp) => Params::split(wrapped.as_deref().unwrap_or(&self.params), tp.as_ref()),
            None => Params::new(&self.params),
        }
        .with_layout(layout)
        .with_padding(padding.as_ref())
        .with_dropout(dropout.as_ref())
        .with_scoring(scoring.as_ref())
        .with_adapters(self.joined_adapters())
        .with_experts(self.config.experts.as_ref())
        .with_context(self.config.context.as_ref());
        let input = self.where_unit_computes(k, input)?;
        let output = if policy.is_plain() {
            unit.body.forward(&params, &input)?
        } else {
            // Addresses change when a sharded unit is gathered again: taken at each forward.
            let fp8 = self.fp8_weights[k].iter().map(|id| self.params[id.0].data_ptr() as usize).collect();
            let weights = compute::UnitWeights { fp8, grad_slots: self.grad_slots(k)? };
            compute::run(policy, weights, recomputing, || unit.body.forward(&params, &input))?
        };
        self.on_the_device(k, output)
    }

    /// For a unit that computes on the host, `layout` moved there (`None`: it reads `layout`
    /// where it is).
    fn layout_on_host(&self, k: usize, layout: Option<&RowLayout>) -> Result<Option<RowLayout>> {
        match layout {
            Some(l) if self.config.computes_on_host(k) && l.positions.device() != Device::Cpu => {
                Ok(Some(l.to_device(Device::Cpu)?))
            }
            _ => Ok(None),
        }
    }

    /// `x` where unit `k` computes: on the host for a unit that computes there.
    fn where_unit_computes(&self, k: usize, x: &Tensor) -> Result<Tensor> {
        let host = self.config.computes_on_host(k) && x.device() != Device::Cpu;
        Ok(if host { x.f_to_device(Device::Cpu)? } else { x.shallow_clone() })
    }

    /// Unit `k`'s output `y` on the device.
    fn on_the_device(&self, k: usize, y: Tensor) -> Result<Tensor> {
        let elsewhere = self.config.computes_on_host(k) && y.device() != self.config.device;
        Ok(if elsewhere { y.f_to_device(self.config.device)? } else { y })
    }

    /// The slots in unit `k`'s flat gradient buffer that its weights' casts may convert
    /// their gradients into, by storage address: where the unit's gradients are landed as
    /// computed ([`Engine::release_fresh_grads`]) and a cast happens (`amp_native`), for the
    /// unit's own parameters whole on this rank beside their buffer.
    fn grad_slots(&self, k: usize) -> Result<Vec<(usize, Tensor)>> {
        let eligible = self.compute[k].autocast.is_some()
            && self.grads.is_some()
            && self.config.tensor.is_none()
            && self.schedule.accepts_copied_grads();
        if !eligible {
            return Ok(Vec::new());
        }
        let mut slots = Vec::new();
        for &id in &self.spec.units[k].params {
            let p = &self.params[id.0];
            if p.requires_grad() && !self.borrowed.contains(&id) && p.device() == self.storage[k].grad.device() {
                slots.push((p.data_ptr() as usize, self.grad_view(id)?));
            }
        }
        Ok(slots)
    }

    /// Under tensor parallel, the parameters unit `k` reads with those whose gradient each
    /// rank computes only in part passed through the tensor group's `copy_in`, so backward
    /// sums them: per-head parameters (each rank applies them to its own heads) and, under
    /// sequence parallel, sequence-replicated ones (each rank's piece of the sequence).
    /// `None`: the parameters as they are.
    fn unit_params(&self, k: usize) -> Result<Option<Vec<Tensor>>> {
        let Some(tp) = self.tensor_parallel() else { return Ok(None) };
        let partial = |role: TpRole| match role {
            TpRole::PartialGradient => true,
            TpRole::SequenceReplicated => tp.sequence_parallel(),
            _ => false,
        };
        let unit = &self.spec.units[k];
        let summed: Vec<ParamId> = unit
            .params
            .iter()
            .chain(&unit.borrowed)
            .copied()
            .filter(|id| partial(self.spec.params[id.0].tp) && self.params[id.0].requires_grad())
            .collect();
        if summed.is_empty() {
            return Ok(None);
        }
        let mut params: Vec<Tensor> = self.params.iter().map(Tensor::shallow_clone).collect();
        for id in summed {
            params[id.0] = tp.copy_in(&self.params[id.0])?;
        }
        Ok(Some(params))
    }

    /// Sets each unit's compute policy (one per unit, in order).
    pub fn set_compute(&mut self, policies: Vec<UnitCompute>) -> Result<()> {
        if policies.len() != self.spec.units.len() {
            return Err(Error::Config(format!(
                "{} compute policies for {} units",
                policies.len(),
                self.spec.units.len()
            )));
        }
        if self.config.backward == BackwardMode::WholeGraph && policies.iter().any(|p| p.recompute) {
            return Err(Error::Config("recomputation needs the unit-by-unit backward".into()));
        }
        // Which weights each unit computes in fp8 is fixed by their names (aliases too) and
        // shapes: decided once here.
        self.fp8_weights = policies
            .iter()
            .zip(&self.spec.units)
            .map(|(policy, unit)| {
                let Some(config) = policy.fp8.as_ref().and_then(|s| s.lock().ok().map(|s| s.config.clone())) else {
                    return vec![];
                };
                let named: Vec<(ParamId, String)> = unit
                    .params
                    .iter()
                    .chain(&unit.borrowed)
                    .map(|&id| {
                        let aliases = self.spec.aliases.iter().filter(|(_, a)| *a == id).map(|(n, _)| n.as_str());
                        let names: Vec<&str> =
                            std::iter::once(self.spec.params[id.0].name.as_str()).chain(aliases).collect();
                        (id, names.join(" "))
                    })
                    .collect();
                let weights: Vec<(&str, &[i64])> =
                    named.iter().map(|(id, n)| (n.as_str(), self.spec.params[id.0].shape.as_slice())).collect();
                // Said where the size rule keeps a weight in bf16, so the choice is seen.
                if weights.iter().any(|(_, shape)| shape.len() == 2 && config.too_small(shape)) {
                    tracing::info!("{}: {}", unit.name, config.describe(&weights));
                }
                named
                    .iter()
                    .filter(|(id, n)| config.applies_to(n, &self.spec.params[id.0].shape))
                    .map(|(id, _)| *id)
                    .collect()
            })
            .collect();
        let replacements = policies.last().map(|p| p.replacements.clone()).unwrap_or_default();
        self.loss_compute = Arc::new(UnitCompute { replacements, ..Default::default() });
        self.compute = policies.into_iter().map(Arc::new).collect();
        Ok(())
    }

    /// Runs `loss` (computed from this engine's output) with the `module_replace` selection
    /// of the unit that made the output, and nothing else of its policy: a fused
    /// cross-entropy where one is selected, the loss's own precision otherwise.
    /// Closes micro-batch `micro`'s load-balancing loss (a mixture of experts) over this
    /// part's sparse layers and, in a pipeline, the `earlier` stages' routing sums: what
    /// [`Engine::routed`] then gives, `None` while some sparse layer has not routed.
    pub(crate) fn close_routing(&mut self, micro: usize, earlier: Option<Vec<f64>>) -> Result<()> {
        let Some(balance) = &self.spec.load_balance else { return Ok(()) };
        if let Some(earlier) = earlier {
            balance.receive_sums(micro, earlier)?;
        }
        // Under sequence parallel each tensor rank routed its part of the sequence, under
        // context parallelism each context rank its piece of the rows.
        let sharers = RowSharers {
            sequence: self.config.tensor.as_deref().filter(|t| t.sequence_parallel()),
            context: self.config.context.as_deref(),
        };
        self.routed = balance.close(micro, true, sharers)?;
        Ok(())
    }

    /// What the latest training forward's sparse layers routed (a mixture of experts): the
    /// load-balancing loss and the experts' loads, and the term the training loss must
    /// include for the routers to learn from it (their backward fails without it).
    pub fn routed(&self) -> Option<&Routed> {
        self.routed.as_ref()
    }

    /// Runs `loss` (what follows the last unit) with the last unit's module replacements.
    pub fn compute_loss<R>(&self, loss: impl FnOnce() -> Result<R>) -> Result<R> {
        compute::run(&self.loss_compute, Default::default(), false, loss)
    }

    /// Each unit's fp8 state, where the unit computes in fp8.
    pub fn fp8_states(&self) -> Vec<Option<compute::fp8::SharedFp8>> {
        self.compute.iter().map(|p| p.fp8.clone()).collect()
    }

    /// Every rank of the job (fp8's maxima and the choice biases' loads agree over it).
    pub(crate) fn set_job_group(&mut self, group: Option<Arc<dyn ProcessGroup>>) {
        self.job_group = group;
    }

    /// Moves the choice biases of this engine's sparse layers by the step's expert loads,
    /// summed over every rank ([`crate::model::MoeConfig::bias_update_rate`]); with `skipped`,
    /// only forgets the loads. Runs after the optimizer's update and before the schedule
    /// publishes it: the step is written where the optimizer writes (the fp32 master, this
    /// rank's shard, the host copy), so every strategy carries it as it carries an update.
    /// Every rank calls it, with the same `skipped`.
    pub(crate) fn move_choice_biases(&mut self, skipped: bool) -> Result<()> {
        let Some(balance) = self.spec.load_balance.clone().filter(|b| !b.moving_biases().is_empty()) else {
            return Ok(());
        };
        let spec = &self.spec;
        let mut loads = balance.take_step_loads(|id| spec.holds(id))?;
        if skipped {
            return Ok(());
        }
        if let Some(group) = &self.job_group {
            loads = crate::comm::all_reduce_values(group.as_ref(), &loads, crate::comm::ReduceOp::Sum)?;
        }
        for (id, steps) in balance.bias_steps(&loads, |id| spec.holds(id)) {
            let (unit, start) = (self.spec.params[id.0].unit, self.offsets[id.0]);
            let (schedule, ctx) = self.schedule_for(unit);
            let view = schedule.optimizer_view(ctx)?;
            // This rank's share of the bias: where its elements meet what the optimizer updates.
            let end = start + steps.len() as i64;
            let (from, to) = (start.max(view.offset), end.min(view.offset + view.param.numel() as i64));
            if from >= to {
                continue;
            }
            let step = Tensor::f_from_slice(&steps[(from - start) as usize..(to - start) as usize])?
                .f_to_device(view.param.device())?
                .f_to_kind(view.param.kind())?;
            let _ = tch::no_grad(|| view.param.f_narrow(0, from - view.offset, to - from)?.f_add_(&step))?;
        }
        Ok(())
    }

    fn release_records(&mut self) {
        for r in std::mem::take(&mut self.records).into_values() {
            self.forget(&r);
        }
    }

    /// Takes a forward record's bytes off the ledger.
    fn forget(&self, record: &ForwardRecord) {
        self.ledger.free(Placement::Device, Category::Activations, record.activation_bytes);
        self.ledger.free(Placement::Host, Category::Activations, record.shelved_bytes);
    }

    /// Offloads the values units keep for their backward to host memory, for the units
    /// given a setting (one entry per unit). A unit's values are copied out as its forward
    /// saves them and fetched back one unit ahead of its backward; its input's values go
    /// too where nothing on the device reads them any more. A recomputed unit offloads the
    /// input it recomputes from. Needs the unit-by-unit backward.
    pub fn set_activation_offload(&mut self, per_unit: Vec<Option<ActivationOffload>>) -> Result<()> {
        if per_unit.len() != self.spec.units.len() {
            return Err(Error::Config(format!(
                "{} activation offload settings for {} units",
                per_unit.len(),
                self.spec.units.len()
            )));
        }
        let any = per_unit.iter().any(Option::is_some);
        if any && self.config.backward == BackwardMode::WholeGraph {
            return Err(Error::Config("activation_offload needs the unit-by-unit backward".into()));
        }
        self.shelves = if any {
            let device = self.config.device;
            // Every parameter is a view of its unit's flat buffer.
            let parameters =
                self.storage.iter().map(|s| strata_ext::storage_id(&s.flat)).collect::<std::result::Result<_, _>>()?;
            let stream = match device {
                Device::Cuda(d) => Some(strata_ext::cuda::Stream::from_pool(d, false)?),
                _ => None,
            };
            Some(Arc::new(ShelfContext { device, stream, parameters }))
        } else {
            None
        };
        self.activation_offload = per_unit;
        Ok(())
    }

    /// A new shelf for unit `k`'s values, where they are offloaded.
    fn new_shelf(&self, k: usize) -> Option<Shelf> {
        let context = self.shelves.as_ref()?;
        self.activation_offload[k].map(|settings| Shelf::new(settings, context.clone()))
    }

    /// Once unit `j`'s copies to the host have landed, frees the values of its input where
    /// nothing reads them any more: the shelf holds what its backward reads, the node that
    /// made them reads them through its own unit's shelf or not at all, and no tensor,
    /// view or autograd function but the cut and the output holds their storage. Returns
    /// the device bytes freed.
    fn settle_shelf(&self, boundaries: &[Boundary], j: usize) -> Result<u64> {
        let Some(shelf) = &boundaries[j].shelf else { return Ok(0) };
        shelf.settle()?;
        let (Some(leaf), Some(before)) = (&boundaries[j].input, j.checked_sub(1).map(|i| &boundaries[i].output)) else {
            return Ok(0);
        };
        let bytes = memory::tensor_bytes(before);
        let unheld = bytes > 0
            && strata_ext::storage_nbytes(before)? as u64 == bytes
            && strata_ext::storage_use_count(before)? == 2
            && strata_ext::tensor_use_count(before)? == 1
            // The cut's own handle and the node accumulating its gradient.
            && strata_ext::tensor_use_count(leaf)? <= 2
            && (boundaries[j - 1].shelf.is_some() || boundaries[j - 1].recompute_from.is_some());
        if !unheld {
            return Ok(0);
        }
        // SAFETY: no reader is left (above); the copies that read them have landed (settle).
        unsafe { memory::release_buffer(before) }?;
        // What the storage gave back, not what was asked of it.
        let freed = bytes.saturating_sub(strata_ext::storage_nbytes(before)? as u64);
        self.ledger.free(Placement::Device, Category::Activations, freed);
        Ok(freed)
    }

    /// Sets every gradient to zero (where the schedule lets a unit's first backward copy its
    /// gradients in, only those of parameters other units borrow are written now).
    pub fn zero_grad(&mut self) -> Result<()> {
        if let Some(all) = &self.grads {
            if self.schedule.accepts_copied_grads() {
                for &id in &self.borrowed {
                    if self.params[id.0].requires_grad() {
                        let _ = self.grad_view(id)?.f_zero_()?;
                    }
                }
                self.fresh_grads.fill(true);
            } else {
                let _ = all.shallow_clone().f_zero_()?;
            }
            return Ok(());
        }
        let (schedule, ctx) = self.schedule_for(0);
        schedule.zero_grads(ctx)
    }

    /// Splits what the optimizer updates into contiguous runs of parameters of the same
    /// optimizer group, as chosen by `group_of`. Parameters that take no gradient are left
    /// out; with a sharded strategy only this rank's share appears.
    pub fn segments(&mut self, group_of: impl Fn(&ParamSpec) -> usize) -> Result<Vec<Segment>> {
        let mut out = Vec::new();
        for unit in 0..self.spec.units.len() {
            let tp = self.tensor_parallel().map_or(1, |t| t.size());
            let mut runs: Vec<(usize, f64, i64, i64)> = Vec::new(); // (group, norm share, start, end)
            for &id in &self.spec.units[unit].params {
                let p = &self.spec.params[id.0];
                if !p.requires_grad {
                    continue;
                }
                let (group, start) = (group_of(p), self.offsets[id.0]);
                let tensor_share = if p.tp.is_split() { 1.0 } else { 1.0 / tp as f64 };
                // What every rank of an expert group storing its experts apart holds alike.
                let expert_share = match (p.expert, self.holding.experts) {
                    (None, Some((size, _))) => 1.0 / size as f64,
                    _ => 1.0,
                };
                let share = match self.spec.copies.contains(&id) {
                    true => 0.0,
                    false => tensor_share * expert_share,
                };
                let end = start + self.holding.numel(p);
                match runs.last_mut() {
                    Some((g, s, _, e)) if *g == group && *s == share && *e == start => *e = end,
                    _ => runs.push((group, share, start, end)),
                }
            }
            if runs.is_empty() {
                continue;
            }
            let (schedule, ctx) = self.schedule_for(unit);
            let view = schedule.optimizer_view(ctx)?;
            let (lo, hi) = (view.offset, view.offset + view.param.numel() as i64);
            for (group, norm_share, start, end) in runs {
                let (start, end) = (start.max(lo), end.min(hi));
                if start < end {
                    out.push(Segment {
                        param: view.param.f_narrow(0, start - lo, end - start)?,
                        grad: view.grad.f_narrow(0, start - lo, end - start)?,
                        group,
                        unit,
                        offset: start,
                        norm_share,
                        placement: view.placement,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Writes `value` as parameter `id` into `full`, its unit's whole layout (as
    /// [`Engine::full_unit`] returns it), after checking its shape.
    pub(crate) fn write_param(&self, full: &Tensor, id: ParamId, value: &Tensor) -> Result<()> {
        let p = &self.spec.params[id.0];
        if value.size() != p.shape {
            return Err(Error::Model(format!(
                "{}: shape {:?} does not match the model's {:?}",
                p.name,
                value.size(),
                p.shape
            )));
        }
        tch::no_grad(|| full.f_narrow(0, self.full_offsets[id.0], p.numel())?.f_copy_(&value.f_reshape([-1])?))?;
        Ok(())
    }

    /// Copies `values` into the parameters they name, unit by unit through the schedule
    /// (so that a sharded rank keeps only its share); units not named keep their values.
    pub fn set_params(&mut self, values: &std::collections::BTreeMap<ParamId, Tensor>) -> Result<()> {
        for unit in 0..self.spec.units.len() {
            let ids: Vec<ParamId> =
                self.spec.units[unit].params.iter().copied().filter(|id| values.contains_key(id)).collect();
            if ids.is_empty() {
                continue;
            }
            let full = self.full_unit(unit)?.f_detach_copy()?;
            for id in ids {
                self.write_param(&full, id, &values[&id])?;
            }
            self.set_full_unit(unit, &full)?;
        }
        Ok(())
    }
}

fn init(t: &Tensor, how: Init) -> Result<()> {
    let mut t = t.shallow_clone();
    let _ = match how {
        Init::Normal { std } => t.f_normal_(0.0, std)?,
        Init::Zeros => t.f_zero_()?,
        Init::Ones => t.f_fill_(1.0)?,
        Init::Uniform { bound } => t.f_uniform_(-bound, bound)?,
        Init::Constant { value } => t.f_fill_(value)?,
    };
    Ok(())
}
