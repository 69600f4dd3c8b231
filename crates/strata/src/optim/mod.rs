//! Optimizers, parameter groups, gradient clipping and learning-rate schedules.
//!
//! Owns: optimizer state (its own buffers, one per segment of the engine's flat storage,
//! accounted in the memory ledger) and the update through libtorch's fused kernels.
//! Must not decide what is stored where or run the model: it updates the segments the
//! engine hands it, in place.

use crate::compute::scaler::clip_coefficient;
use crate::engine::{Category, Engine, MemoryLedger, Placement, Segment};
use crate::model::ParamSpec;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use strata_ext::{AdamStep, AdamTensors, DeviceInputs, SgdStep};
use tch::{Kind, Tensor};

/// The optimizer's update rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Adam with decoupled weight decay (the default).
    AdamW,
    /// Adam, the weight decay added to the gradient (L2).
    Adam,
    /// Stochastic gradient descent, with momentum where `momentum` is set.
    Sgd,
}

impl OptimizerKind {
    /// The rule's name as checkpoints record it (`adamw`, `adam`, `sgd`).
    pub fn name(self) -> String {
        format!("{self:?}").to_lowercase()
    }
}

impl std::str::FromStr for OptimizerKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "adamw" => Ok(OptimizerKind::AdamW),
            "adam" => Ok(OptimizerKind::Adam),
            "sgd" => Ok(OptimizerKind::Sgd),
            other => Err(Error::Config(format!("unknown optimizer {other:?}; expected adamw, adam or sgd"))),
        }
    }
}

/// Hyper-parameters with torch.optim's meanings and defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// The update rule; AdamW by default.
    pub kind: OptimizerKind,
    /// Base learning rate; 1e-3 by default.
    pub lr: f64,
    /// Adam's decay rates of the running averages of the gradient and of its square; (0.9, 0.999) by default.
    pub betas: (f64, f64),
    /// Adam's term added to the denominator for stability; 1e-8 by default.
    pub eps: f64,
    /// Applies to every parameter unless a group says otherwise, or
    /// `decay_norms_and_biases` is off.
    pub weight_decay: f64,
    /// Whether weight decay reaches normalisation layers and biases too (torchtitan's
    /// way, the default); off, they take none, as `transformers`' `Trainer` leaves out
    /// what [`ParamSpec::trainer_skips_decay`] names. A parameter a group rule names takes
    /// that group's decay (the optimizer's where the rule gives none) either way.
    pub decay_norms_and_biases: bool,
    /// SGD's momentum factor; 0 (none) by default.
    pub momentum: f64,
    /// SGD's dampening of the gradient added to the momentum; 0 by default.
    pub dampening: f64,
    /// SGD with Nesterov momentum (it needs a momentum and no dampening).
    pub nesterov: bool,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::AdamW,
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            decay_norms_and_biases: true,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
        }
    }
}

impl OptimizerConfig {
    /// Bytes of state kept per parameter element: fp32 moments (two for Adam, one for SGD
    /// with momentum), fp32 also for low-precision parameters.
    pub fn state_bytes_per_element(&self) -> u64 {
        match self.kind {
            OptimizerKind::Sgd if self.momentum == 0.0 => 0,
            OptimizerKind::Sgd => 4,
            OptimizerKind::Adam | OptimizerKind::AdamW => 8,
        }
    }

    /// Fails with the first hyper-parameter out of range: a negative learning rate, betas
    /// outside [0, 1), an eps that is not positive, negative decay or momentum, Nesterov
    /// momentum without a momentum or with dampening.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Config(what));
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad(format!("learning rate must be a non-negative number, got {}", self.lr));
        }
        let (b1, b2) = self.betas;
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            return bad(format!("betas must lie in [0, 1), got ({b1}, {b2})"));
        }
        if self.eps.is_nan() || self.eps <= 0.0 {
            return bad(format!("eps must be positive, got {}", self.eps));
        }
        let non_negative = |v: f64| v.is_finite() && v >= 0.0;
        if !non_negative(self.weight_decay) || !non_negative(self.momentum) || !non_negative(self.dampening) {
            return bad("weight decay and momentum must be non-negative".into());
        }
        if self.nesterov && (self.momentum == 0.0 || self.dampening != 0.0) {
            return bad("Nesterov momentum needs a momentum and zero dampening".into());
        }
        Ok(())
    }
}

/// A parameter group: parameters whose name contains any of `name_contains` take this
/// group's learning rate and weight decay (where set) instead of the optimizer's.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupRule {
    /// Substrings of parameter names that put a parameter in this group.
    pub name_contains: Vec<String>,
    /// The group's base learning rate; `None`: the optimizer's.
    pub lr: Option<f64>,
    /// The group's weight decay; `None`: the optimizer's.
    pub weight_decay: Option<f64>,
}

struct Group {
    lr: f64,
    weight_decay: f64,
    /// Unit and flat-layout offset of each segment (how checkpoints name its state).
    places: Vec<(usize, i64)>,
    /// Share of each segment's squared gradient norm this rank counts ([`Segment::norm_share`]).
    norm_shares: Vec<f64>,
    /// Where each segment lives (its state lives there too, and is charged there).
    placements: Vec<Placement>,
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    /// Adam: first and second moments; SGD: momentum buffers (empty without momentum).
    first: Vec<Tensor>,
    second: Vec<Tensor>,
    steps: Vec<Tensor>,
    /// The learning rate where the group's GPU parameters read it: a float on their device,
    /// rewritten every step, so a step captured as a CUDA graph replays with each step's rate.
    device_lr: Option<Tensor>,
}

/// An optimizer over an engine's parameters.
pub struct Optimizer {
    config: OptimizerConfig,
    groups: Vec<Group>,
    lr_factor: f64,
    steps_taken: u64,
    /// Every gradient is divided by this device value in the next update, inside the fused
    /// kernel (clipping decided on the device: [`Optimizer::clip_grad_norm_on_device`]).
    grad_divisor: Option<Tensor>,
    ledger: Arc<MemoryLedger>,
    /// State bytes charged to the ledger, per placement.
    state_bytes: BTreeMap<Placement, u64>,
    delayed: DelayedHostUpdates,
    /// Set while another thread reads the states where they lie: the next update of any
    /// of them waits until it opens ([`Optimizer::hold_updates`]).
    readers: Option<Arc<Fence>>,
    /// Seconds updates waited at fences since [`Optimizer::take_readers_wait`] last read them.
    readers_waited_s: f64,
}

/// A point updates wait at while another thread reads the states they would change where
/// those lie (an asynchronous checkpoint's writer copying host-resident units into its
/// snapshot, during the next step's forward and backward). Opened once, by its
/// [`FenceOpener`], whose drop opens it whatever happened to the reader.
#[derive(Default)]
pub struct Fence {
    open: Mutex<bool>,
    opened: std::sync::Condvar,
    /// Threads that have waited here, and their seconds.
    waits: Mutex<(usize, f64)>,
}

impl Fence {
    /// A closed fence and what opens it.
    pub fn closed() -> (Arc<Fence>, FenceOpener) {
        let fence = Arc::new(Fence::default());
        (fence.clone(), FenceOpener(fence))
    }

    /// Blocks until the fence is open.
    pub fn wait(&self) {
        let began = std::time::Instant::now();
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let arrived = !*open;
        if arrived {
            self.waits.lock().unwrap_or_else(|e| e.into_inner()).0 += 1;
        }
        while !*open {
            open = self.opened.wait(open).unwrap_or_else(|e| e.into_inner());
        }
        if arrived {
            self.waits.lock().unwrap_or_else(|e| e.into_inner()).1 += began.elapsed().as_secs_f64();
        }
    }

    /// How many threads have found the fence closed, and the seconds they waited in all.
    pub fn waits(&self) -> (usize, f64) {
        *self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Opens its [`Fence`] when told, or when dropped.
pub struct FenceOpener(Arc<Fence>);

impl FenceOpener {
    /// Opens the fence: every update waiting there goes on.
    pub fn open(self) {
        drop(self);
    }
}

impl Drop for FenceOpener {
    fn drop(&mut self) {
        *self.0.open.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.0.opened.notify_all();
    }
}

/// Host updates that run during the next step ([`Optimizer::start_delayed_host_updates`]).
#[derive(Default)]
struct DelayedHostUpdates {
    /// Per storage of host gradients, a view spanning it and a twin of its size: the two
    /// exchange their memory when an update starts, so the update reads the step's
    /// gradients from the twin while the next step's backward accumulates into the
    /// original.
    twins: Vec<(Tensor, Tensor)>,
    /// Per host segment (group, index), its gradient's place in its storage's twin.
    grads: BTreeMap<(usize, usize), Tensor>,
    /// Bytes of the twins, charged to the host, and of those page-locked.
    bytes: u64,
    pinned: u64,
    running: Option<HostUpdates>,
}

impl Optimizer {
    /// Builds the optimizer and its state for `engine`'s parameters, grouped by `rules`
    /// (first matching rule wins; the rest form the default group, less the normalisation
    /// layers and biases where those take no decay, which form a last group).
    pub fn new(engine: &mut Engine, config: OptimizerConfig, rules: &[GroupRule]) -> Result<Optimizer> {
        config.validate()?;
        let undecayed = rules.len() + 1;
        let group_of = |p: &ParamSpec| match rules
            .iter()
            .position(|r| r.name_contains.iter().any(|s| p.name.contains(s.as_str())))
        {
            Some(i) => i + 1,
            None if !config.decay_norms_and_biases && p.trainer_skips_decay() => undecayed,
            None => 0,
        };
        let mut groups: Vec<Group> = std::iter::once((config.lr, config.weight_decay))
            .chain(rules.iter().map(|r| (r.lr.unwrap_or(config.lr), r.weight_decay.unwrap_or(config.weight_decay))))
            .chain(std::iter::once((config.lr, 0.0)))
            .map(|(lr, weight_decay)| Group {
                lr,
                weight_decay,
                places: vec![],
                norm_shares: vec![],
                placements: vec![],
                params: vec![],
                grads: vec![],
                first: vec![],
                second: vec![],
                steps: vec![],
                device_lr: None,
            })
            .collect();
        let ledger = engine.ledger().clone();
        let mut state_bytes = BTreeMap::new();
        for Segment { param, grad, group, unit, offset, norm_share, placement } in engine.segments(group_of)? {
            let g = &mut groups[group];
            // States of low-precision parameters are fp32: g² of a small gradient would
            // underflow in fp16, and an update divided by it blow up.
            let state_kind = if is_low_precision(param.kind()) { Kind::Float } else { param.kind() };
            let bytes = (param.numel() * state_kind.elt_size_in_bytes()) as u64;
            let states = match config.kind {
                OptimizerKind::Sgd if config.momentum == 0.0 => 0,
                OptimizerKind::Sgd => 1,
                _ => 2,
            };
            ledger.alloc(placement, Category::OptimizerState, bytes * states)?;
            *state_bytes.entry(placement).or_default() += bytes * states;
            if states >= 1 {
                g.first.push(Tensor::f_zeros([param.numel() as i64], (state_kind, param.device()))?);
            }
            if states == 2 {
                g.second.push(Tensor::f_zeros([param.numel() as i64], (state_kind, param.device()))?);
                g.steps.push(Tensor::f_zeros([], (Kind::Float, param.device()))?);
            }
            g.places.push((unit, offset));
            g.norm_shares.push(norm_share);
            g.placements.push(placement);
            g.params.push(param);
            g.grads.push(grad);
        }
        groups.retain(|g| !g.params.is_empty());
        for g in &mut groups {
            if let Some(gpu) = g.params.iter().map(Tensor::device).find(|d| d.is_cuda()) {
                g.device_lr = Some(Tensor::f_full([], g.lr, (Kind::Float, gpu))?);
            }
        }
        Ok(Optimizer {
            config,
            groups,
            lr_factor: 1.0,
            steps_taken: 0,
            grad_divisor: None,
            ledger,
            state_bytes,
            delayed: DelayedHostUpdates::default(),
            readers: None,
            readers_waited_s: 0.0,
        })
    }

    /// Has every update from now on wait until `fence` opens: another thread reads the
    /// parameters and states where they lie until then.
    pub fn hold_updates(&mut self, fence: Arc<Fence>) {
        self.readers = Some(fence);
    }

    /// Waits for the fence set by [`Optimizer::hold_updates`], where one is, and clears it,
    /// counting the seconds every update waited at it (the host updates' threads' too).
    pub fn wait_for_readers(&mut self) {
        if let Some(fence) = self.readers.take() {
            fence.wait();
            self.readers_waited_s += fence.waits().1;
        }
    }

    /// The seconds updates waited at fences since the last call.
    pub fn take_readers_wait(&mut self) -> f64 {
        std::mem::take(&mut self.readers_waited_s)
    }

    /// Scales every group's learning rate (set each step from a [`LrSchedule`]).
    pub fn set_lr_factor(&mut self, factor: f64) -> Result<()> {
        self.lr_factor = factor;
        for g in &self.groups {
            if let Some(lr) = &g.device_lr {
                let _ = lr.shallow_clone().f_fill_(g.lr * factor)?;
            }
        }
        Ok(())
    }

    /// The default group's current learning rate.
    pub fn lr(&self) -> f64 {
        self.config.lr * self.lr_factor
    }

    /// Updates made so far, counting from a restored checkpoint's count.
    pub fn steps_taken(&self) -> u64 {
        self.steps_taken
    }

    /// Counts an update made by a replay of a captured step, which runs no host code.
    pub(crate) fn count_replayed_step(&mut self) {
        self.steps_taken += 1;
    }

    /// Applies one update to every parameter from its gradient. A gradient held in another
    /// dtype than its parameter (a low-precision shard against an fp32 master), or a
    /// low-precision parameter (updated in fp32 against its fp32 states), is converted one
    /// segment at a time, so only one segment's fp32 copy exists at once.
    pub fn step(&mut self) -> Result<()> {
        self.step_except(&BTreeSet::new())
    }

    /// [`Optimizer::step`] for every segment but those of the units in `updated` (their
    /// update already ran: [`HostUpdates`]).
    pub fn step_except(&mut self, updated: &BTreeSet<usize>) -> Result<()> {
        self.wait_for_readers();
        let divisor = self.grad_divisor.take();
        for g in &self.groups {
            let pending: Vec<usize> = (0..g.params.len()).filter(|&i| !updated.contains(&g.places[i].0)).collect();
            let rule = self.rule(g);
            let direct = |&i: &usize| g.params[i].kind() == g.grads[i].kind() && !is_low_precision(g.params[i].kind());
            if pending.is_empty() {
                continue;
            }
            if pending.iter().all(direct) {
                let pick = |v: &[Tensor]| -> Vec<Tensor> {
                    if v.is_empty() {
                        vec![]
                    } else {
                        pending.iter().map(|&i| v[i].shallow_clone()).collect()
                    }
                };
                let (first, second, steps) = (pick(&g.first), pick(&g.second), pick(&g.steps));
                rule.apply(&pick(&g.params), &pick(&g.grads), &first, &second, &steps, divisor.as_ref())?;
                continue;
            }
            for i in pending {
                let (param, grad) = (&g.params[i], &g.grads[i]);
                let low = is_low_precision(param.kind());
                let kind = if low { Kind::Float } else { param.kind() };
                let bytes = (param.numel() * kind.elt_size_in_bytes()) as u64 * (1 + u64::from(low));
                self.ledger.alloc(g.placements[i], Category::Grads, bytes)?;
                let result = (|| -> Result<()> {
                    let work = if low { param.f_to_kind(kind)? } else { param.shallow_clone() };
                    let one = |v: &[Tensor]| v.get(i).map(|t| vec![t.shallow_clone()]).unwrap_or_default();
                    rule.apply(
                        &[work.shallow_clone()],
                        &[grad.f_to_kind(kind)?],
                        &one(&g.first),
                        &one(&g.second),
                        &one(&g.steps),
                        divisor.as_ref(),
                    )?;
                    if low {
                        tch::no_grad(|| param.shallow_clone().f_copy_(&work))?;
                    }
                    Ok(())
                })();
                self.ledger.free(g.placements[i], Category::Grads, bytes);
                result?;
            }
        }
        self.steps_taken += 1;
        Ok(())
    }

    /// The update rule of group `g` at this step.
    fn rule(&self, g: &Group) -> UpdateRule {
        UpdateRule {
            config: self.config.clone(),
            lr: g.lr * self.lr_factor,
            device_lr: g.device_lr.as_ref().map(Tensor::shallow_clone),
            weight_decay: g.weight_decay,
            first_step: self.steps_taken == 0,
        }
    }

    /// This step's updates of the segments that live on the host, by unit, to be started as
    /// each unit's gradient is complete ([`HostUpdates::start`]), while the rest of backward
    /// runs. Low-precision segments (updated through fp32 copies) are left to
    /// [`Optimizer::step_except`].
    pub fn host_updates(&self) -> HostUpdates {
        self.host_updates_reading(|gi, i| self.groups[gi].grads[i].shallow_clone())
    }

    /// The segments (group, index) updated on the host in their own kind.
    fn host_segments(&self) -> Vec<(usize, usize)> {
        let mut out = vec![];
        for (gi, g) in self.groups.iter().enumerate() {
            for (i, (param, grad)) in g.params.iter().zip(&g.grads).enumerate() {
                if g.placements[i] == Placement::Host && param.kind() == grad.kind() && !is_low_precision(param.kind())
                {
                    out.push((gi, i));
                }
            }
        }
        out
    }

    /// [`Optimizer::host_updates`] reading each segment's gradient from `grad_of(group,
    /// index)`.
    fn host_updates_reading(&self, grad_of: impl Fn(usize, usize) -> Tensor) -> HostUpdates {
        let mut by_unit: BTreeMap<usize, Vec<SegmentUpdate>> = BTreeMap::new();
        for (gi, i) in self.host_segments() {
            let g = &self.groups[gi];
            let one = |v: &[Tensor]| v.get(i).map(Tensor::shallow_clone);
            by_unit.entry(g.places[i].0).or_default().push(SegmentUpdate {
                rule: self.rule(g),
                param: g.params[i].shallow_clone(),
                grad: grad_of(gi, i),
                first: one(&g.first),
                second: one(&g.second),
                step: one(&g.steps),
            });
        }
        HostUpdates {
            by_unit: Mutex::new(by_unit),
            running: Mutex::new(vec![]),
            ledger: self.ledger.clone(),
            readers: self.readers.clone(),
        }
    }

    /// Starts this step's updates of the host segments on threads that run on during the
    /// next step (ZeRO-Offload's delayed parameter update); the units started, whose
    /// segments [`Optimizer::step_except`] leaves out. The gradients go with the update:
    /// each storage of host gradients exchanges its memory with a twin, so the engine's
    /// next backward accumulates into zeroed memory while the update reads this step's.
    /// [`Optimizer::settle`] waits for the update, before anything reads the masters.
    pub fn start_delayed_host_updates(&mut self) -> Result<BTreeSet<usize>> {
        self.wait_for_readers();
        if self.delayed.running.is_some() {
            return Err(Error::Engine("a delayed host update is still running: settle it first".into()));
        }
        if self.delayed.twins.is_empty() {
            self.make_twins()?;
        }
        for (original, twin) in &self.delayed.twins {
            // SAFETY: no update is running (checked above) and the engine's backward is
            // over: nothing reads or writes either storage.
            unsafe { strata_ext::swap_storages(original, twin) }?;
        }
        let updates = self.host_updates_reading(|gi, i| self.delayed.grads[&(gi, i)].shallow_clone());
        let started = updates.start_all();
        self.delayed.running = Some(updates);
        Ok(started)
    }

    /// A twin for every storage of host gradients, and each host segment's place in it.
    fn make_twins(&mut self) -> Result<()> {
        // Per storage: a view spanning it (its first element's address) and its twin.
        let mut pairs: BTreeMap<usize, (Tensor, Tensor)> = BTreeMap::new();
        for (gi, i) in self.host_segments() {
            let grad = &self.groups[gi].grads[i];
            let id = strata_ext::storage_id(grad)?;
            let (span, twin) = match pairs.entry(id) {
                std::collections::btree_map::Entry::Occupied(pair) => pair.into_mut(),
                std::collections::btree_map::Entry::Vacant(slot) => {
                    let bytes = strata_ext::storage_nbytes(grad)?;
                    let numel = (bytes / grad.kind().elt_size_in_bytes()) as i64;
                    self.ledger.alloc(Placement::Host, Category::Grads, bytes as u64)?;
                    self.delayed.bytes += bytes as u64;
                    let mut twin = Tensor::f_zeros([numel], (grad.kind(), grad.device()))?;
                    // Page-locked like the storage it exchanges memory with, so the GPU's
                    // copies from it stay direct whichever of the two it holds (page-locked
                    // memory serves every GPU: the index only names the kind of device).
                    let gpu = tch::Device::Cuda(0);
                    if tch::Cuda::is_available() && grad.f_is_pinned(gpu).unwrap_or(false) {
                        twin = twin.f_pin_memory(gpu)?;
                        self.ledger.record_pinned(bytes as u64);
                        self.delayed.pinned += bytes as u64;
                    }
                    slot.insert((grad.f_as_strided([numel], [1], 0)?, twin))
                }
            };
            let offset = (grad.data_ptr() as usize - span.data_ptr() as usize) / grad.kind().elt_size_in_bytes();
            let place = twin.f_as_strided(grad.size(), grad.stride(), offset as i64)?;
            self.delayed.grads.insert((gi, i), place);
        }
        self.delayed.twins = pairs.into_values().collect();
        Ok(())
    }

    /// Waits for those reading the states ([`Optimizer::hold_updates`]) and for a delayed
    /// host update still running, and has `engine` publish the update
    /// (`Engine::after_update`: the masters reach the device); nothing without one.
    pub fn settle(&mut self, engine: &mut Engine) -> Result<()> {
        self.wait_for_readers();
        let Some(running) = self.delayed.running.take() else { return Ok(()) };
        running.finish()?;
        engine.after_update()
    }
    /// Names of the per-element state tensors this optimizer keeps (torch.optim's names).
    pub fn state_names(&self) -> &'static [&'static str] {
        match self.config.kind {
            OptimizerKind::Sgd if self.config.momentum == 0.0 => &[],
            OptimizerKind::Sgd => &["momentum_buffer"],
            _ => &["exp_avg", "exp_avg_sq"],
        }
    }

    /// Every state tensor with its place: (unit, offset in the unit's flat layout, state
    /// name, tensor). Offsets are those of [`crate::engine::Segment`].
    pub fn state(&self) -> Vec<(usize, i64, &'static str, &Tensor)> {
        let names = self.state_names();
        let mut out = Vec::new();
        for g in &self.groups {
            for (i, &(unit, offset)) in g.places.iter().enumerate() {
                for (name, v) in names.iter().zip([&g.first, &g.second]) {
                    out.push((unit, offset, *name, &v[i]));
                }
            }
        }
        out
    }

    /// Restores the state: `fill(unit, offset, name, destination)` writes each state
    /// tensor's saved values; the step count continues from `steps_taken`.
    pub fn load_state(
        &mut self,
        steps_taken: u64,
        mut fill: impl FnMut(usize, i64, &str, &Tensor) -> Result<()>,
    ) -> Result<()> {
        self.wait_for_readers();
        for (unit, offset, name, t) in self.state() {
            fill(unit, offset, name, t)?;
        }
        for g in &self.groups {
            for s in &g.steps {
                let _ = s.shallow_clone().f_fill_(steps_taken as f64)?;
            }
        }
        self.steps_taken = steps_taken;
        Ok(())
    }

    /// [`Optimizer::clip_grad_norm`] computed where the gradients are, when they all live on
    /// one GPU and their norm is this rank's own: nothing is read back (a read would wait
    /// for the device), the norm comes back as a tensor there, and the clipping itself
    /// happens inside the next [`Optimizer::step`]'s fused kernels (no pass of its own over
    /// the gradients). `None` elsewhere.
    pub fn clip_grad_norm_on_device(&mut self, max_norm: f64) -> Result<Option<Tensor>> {
        let grads: Vec<&Tensor> = self.groups.iter().flat_map(|g| g.grads.iter()).collect();
        let device = match grads.first() {
            Some(g) if g.device().is_cuda() && grads.iter().all(|x| x.device() == g.device()) => g.device(),
            _ => return Ok(None),
        };
        let mut sq = Tensor::f_zeros([], (Kind::Double, device))?;
        for g in &self.groups {
            for (grad, share) in g.grads.iter().zip(&g.norm_shares) {
                sq = sq.f_add(&l2_norm(grad)?.f_square()?.f_mul_scalar(*share)?)?;
            }
        }
        let norm = sq.f_sqrt()?;
        // The inverse of clip_coefficient's factor, in f64 on the device.
        let divisor = norm.f_add_scalar(1e-6)?.f_div_scalar(max_norm)?.f_clamp_min(1.0)?;
        self.grad_divisor = Some(divisor.f_to_kind(Kind::Float)?);
        Ok(Some(norm))
    }

    /// Scales all gradients so their global L2 norm is at most `max_norm`
    /// (`torch.nn.utils.clip_grad_norm_`); returns the norm before clipping.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        let total = self.grad_sq_per_unit()?.iter().map(|(_, x)| x).sum::<f64>().sqrt();
        let coef = clip_coefficient(max_norm, total);
        if coef < 1.0 {
            self.scale_grads(coef)?;
        }
        Ok(total)
    }

    /// Sums of squared gradients this rank holds, one per segment: (unit, sum), each
    /// weighted by its [`Segment::norm_share`].
    pub fn grad_sq_per_unit(&self) -> Result<Vec<(usize, f64)>> {
        let mut segments = Vec::new();
        let mut norms = Vec::new();
        for g in &self.groups {
            for ((grad, &(unit, _)), &share) in g.grads.iter().zip(&g.places).zip(&g.norm_shares) {
                segments.push((unit, share));
                norms.push(l2_norm(grad)?);
            }
        }
        let norms = crate::compute::read_scalars(&norms)?;
        Ok(segments.into_iter().zip(norms).map(|((unit, share), norm)| (unit, norm * norm * share)).collect())
    }

    /// Multiplies every gradient by `factor` (unscaling, clipping).
    pub fn scale_grads(&mut self, factor: f64) -> Result<()> {
        for grad in self.groups.iter().flat_map(|g| g.grads.iter()) {
            let _ = grad.shallow_clone().f_mul_scalar_(factor)?;
        }
        Ok(())
    }
}

/// `grad`'s L2 norm, an f64 scalar on its device. Gradients of a lower precision than f64
/// are reduced with fp32 accumulation, as `clip_grad_norm_` reduces them: libtorch asked
/// for f64 from fp32 first writes an f64 copy of the whole gradient, twice its bytes (on
/// the CPU, 6 ms of a 130 ms step of the 4-layer GPT of `bench dist`, traced).
fn l2_norm(grad: &Tensor) -> Result<Tensor> {
    let accumulate = if grad.kind() == Kind::Double { Kind::Double } else { Kind::Float };
    Ok(grad.f_norm_scalaropt_dtype(2.0, accumulate)?.f_to_kind(Kind::Double)?)
}

/// One step's update of a group: the rule and its hyper-parameters at that step.
struct UpdateRule {
    config: OptimizerConfig,
    lr: f64,
    /// `lr` on the GPU, read there by the updates of parameters on that device.
    device_lr: Option<Tensor>,
    weight_decay: f64,
    first_step: bool,
}

impl Clone for UpdateRule {
    fn clone(&self) -> UpdateRule {
        UpdateRule {
            device_lr: self.device_lr.as_ref().map(Tensor::shallow_clone),
            config: self.config.clone(),
            ..*self
        }
    }
}

impl UpdateRule {
    /// Updates `params` with `grads` and the states (each list empty where the rule keeps
    /// none) through libtorch's fused kernels.
    fn apply(
        &self,
        params: &[Tensor],
        grads: &[Tensor],
        first: &[Tensor],
        second: &[Tensor],
        steps: &[Tensor],
        grad_divisor: Option<&Tensor>,
    ) -> Result<()> {
        // A fused update takes tensors of one device, the divisor too (it lives where the
        // gradient norm was reduced): parameters on several devices (a unit kept on the host
        // beside a GPU) update device by device, each with the divisor there.
        let mut devices: Vec<tch::Device> = Vec::new();
        for device in params.iter().map(Tensor::device) {
            if !devices.contains(&device) {
                devices.push(device);
            }
        }
        let divisor_elsewhere = grad_divisor.is_some_and(|d| devices.iter().any(|&device| device != d.device()));
        if devices.len() > 1 || divisor_elsewhere {
            for device in devices {
                let on: Vec<usize> = (0..params.len()).filter(|&i| params[i].device() == device).collect();
                let pick = |v: &[Tensor]| -> Vec<Tensor> {
                    on.iter().filter_map(|&i| v.get(i)).map(Tensor::shallow_clone).collect()
                };
                let divisor = grad_divisor.map(|d| d.f_to_device(device)).transpose()?;
                let (p, g) = (pick(params), pick(grads));
                self.apply(&p, &g, &pick(first), &pick(second), &pick(steps), divisor.as_ref())?;
            }
            return Ok(());
        }
        let c = &self.config;
        let lr = self.device_lr.as_ref().filter(|lr| params.first().is_some_and(|p| p.device() == lr.device()));
        let inputs = DeviceInputs { lr, grad_scale: grad_divisor, found_inf: None };
        match c.kind {
            OptimizerKind::Adam | OptimizerKind::AdamW => strata_ext::fused_adam(
                &AdamTensors { params, grads, exp_avgs: first, exp_avg_sqs: second, steps },
                AdamStep {
                    lr: self.lr,
                    beta1: c.betas.0,
                    beta2: c.betas.1,
                    eps: c.eps,
                    weight_decay: self.weight_decay,
                    decoupled: c.kind == OptimizerKind::AdamW,
                    maximize: false,
                },
                inputs,
            )?,
            OptimizerKind::Sgd => strata_ext::fused_sgd(
                params,
                grads,
                first,
                SgdStep {
                    lr: self.lr,
                    momentum: c.momentum,
                    dampening: c.dampening,
                    weight_decay: self.weight_decay,
                    nesterov: c.nesterov,
                    maximize: false,
                    is_first_step: self.first_step,
                },
                inputs,
            )?,
        }
        Ok(())
    }
}

/// One segment's update, holding what it reads and writes, so that it runs on a thread of
/// its own.
struct SegmentUpdate {
    rule: UpdateRule,
    param: Tensor,
    grad: Tensor,
    first: Option<Tensor>,
    second: Option<Tensor>,
    step: Option<Tensor>,
}

impl SegmentUpdate {
    fn run(&self) -> Result<()> {
        let list = |t: &Option<Tensor>| t.iter().map(Tensor::shallow_clone).collect::<Vec<_>>();
        let (first, second, step) = (list(&self.first), list(&self.second), list(&self.step));
        self.rule.apply(&[self.param.shallow_clone()], &[self.grad.shallow_clone()], &first, &second, &step, None)
    }
}

/// A step's host updates ([`Optimizer::host_updates`]): each unit's starts on a thread as
/// soon as [`HostUpdates::start`] is called for it (its gradient is complete), so the host
/// updates while the device computes the rest of backward.
pub struct HostUpdates {
    by_unit: Mutex<BTreeMap<usize, Vec<SegmentUpdate>>>,
    running: Mutex<Vec<UpdateThread>>,
    ledger: Arc<MemoryLedger>,
    /// Where the updates wait first ([`Optimizer::hold_updates`]), on their own threads.
    readers: Option<Arc<Fence>>,
}

/// A thread updating `units` in turn; it returns the seconds it took.
struct UpdateThread {
    units: Vec<usize>,
    handle: std::thread::JoinHandle<Result<f64>>,
}

impl HostUpdates {
    /// Starts every unit's host updates on one thread, in turn (they are all due: one
    /// thread leaves the other cores to the device's work); the units started.
    pub fn start_all(&self) -> BTreeSet<usize> {
        let units: BTreeSet<usize> = self.by_unit.lock().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
        self.spawn(units.iter().copied().collect());
        units
    }

    /// Starts unit `unit`'s host updates (none if it has none, or they started already).
    pub fn start(&self, unit: usize) {
        self.spawn(vec![unit]);
    }

    /// Updates the `units` not started yet on a thread of their own, one after another.
    fn spawn(&self, units: Vec<usize>) {
        let mut by_unit = self.by_unit.lock().unwrap_or_else(|e| e.into_inner());
        let work: Vec<(usize, Vec<SegmentUpdate>)> =
            units.into_iter().filter_map(|u| by_unit.remove(&u).map(|segments| (u, segments))).collect();
        drop(by_unit);
        if work.is_empty() {
            return;
        }
        let units = work.iter().map(|(u, _)| *u).collect();
        let readers = self.readers.clone();
        let handle = std::thread::spawn(move || -> Result<f64> {
            if let Some(fence) = readers {
                fence.wait();
            }
            let started = std::time::Instant::now();
            for s in work.iter().flat_map(|(_, segments)| segments) {
                s.run()?;
            }
            Ok(started.elapsed().as_secs_f64())
        });
        self.running.lock().unwrap_or_else(|e| e.into_inner()).push(UpdateThread { units, handle });
    }

    /// Waits for every update started; the units updated. Their seconds go into the
    /// ledger's host-update time.
    pub fn finish(self) -> Result<BTreeSet<usize>> {
        let mut done = BTreeSet::new();
        for UpdateThread { units, handle } in self.running.into_inner().unwrap_or_else(|e| e.into_inner()) {
            let seconds =
                handle.join().map_err(|_| Error::Engine(format!("the host update of units {units:?} panicked")))??;
            self.ledger.record_host_updates(units.len() as u64, std::time::Duration::from_secs_f64(seconds));
            done.extend(units);
        }
        Ok(done)
    }
}

fn is_low_precision(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16)
}

impl Drop for Optimizer {
    fn drop(&mut self) {
        // An update still running writes tensors it holds: it ends before they go.
        if let Some(running) = self.delayed.running.take() {
            let _ = running.finish();
        }
        self.ledger.free(Placement::Host, Category::Grads, self.delayed.bytes);
        self.ledger.release_pinned(self.delayed.pinned);
        for (&placement, &bytes) in &self.state_bytes {
            self.ledger.free(placement, Category::OptimizerState, bytes);
        }
    }
}

/// Learning-rate schedule, as a factor of the base rate at each step (0-based).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LrSchedule {
    /// The base rate at every step.
    Constant,
    /// Linear warm-up from 1/warmup to 1, then the base rate (`transformers`'
    /// `constant_with_warmup`).
    WarmupConstant {
        /// Steps of warm-up.
        warmup: u64,
    },
    /// Linear warm-up from 1/warmup to 1, then cosine decay to `min_factor` at `total`.
    WarmupCosine {
        /// Steps of warm-up (0: none).
        warmup: u64,
        /// The step at which the factor reaches `min_factor`.
        total: u64,
        /// The factor at `total` and after.
        min_factor: f64,
    },
    /// Multiply by `gamma` every `every` steps.
    Step {
        /// Steps between multiplications.
        every: u64,
        /// The factor applied every `every` steps.
        gamma: f64,
    },
    /// Linear warm-up from 1/warmup to 1, then a straight line down to `min_factor` at `total`.
    Linear {
        /// Steps of warm-up (0: none).
        warmup: u64,
        /// The step at which the factor reaches `min_factor`.
        total: u64,
        /// The factor at `total` and after.
        min_factor: f64,
    },
    /// Warm-up, stable, decay: linear warm-up to 1, 1 until `decay_start`, then down to
    /// `min_factor` over `decay_steps` steps along `shape`. A run kept stable can be cooled
    /// down from any of its checkpoints by resuming with the decay started there.
    WarmupStableDecay {
        /// Steps of warm-up (0: none).
        warmup: u64,
        /// The step the decay starts at.
        decay_start: u64,
        /// Steps the decay takes.
        decay_steps: u64,
        /// The factor the decay ends at.
        min_factor: f64,
        /// How the decay falls.
        shape: DecayShape,
    },
}

/// How a warm-up–stable–decay schedule falls from 1 to its floor, as a function of the
/// share `p` of the decay done.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecayShape {
    /// `1 - p`.
    Linear,
    /// `1 - sqrt(p)`: falls fast at first, as the WSD studies found best.
    OneMinusSqrt,
    /// `(1 + cos(πp)) / 2`: `transformers`' default decay of its WSD schedule.
    Cosine,
}

impl std::str::FromStr for DecayShape {
    type Err = Error;
    fn from_str(s: &str) -> Result<DecayShape> {
        match s {
            "linear" => Ok(DecayShape::Linear),
            "1-sqrt" => Ok(DecayShape::OneMinusSqrt),
            "cosine" => Ok(DecayShape::Cosine),
            other => Err(Error::Config(format!("decay shape {other:?}: give linear, 1-sqrt or cosine"))),
        }
    }
}

impl LrSchedule {
    /// Refuses factors that would train backwards or stop: a cosine floor outside [0, 1], a
    /// step factor that is not positive, a step every 0 steps.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("learning-rate schedule: {m}")));
        match *self {
            LrSchedule::Constant | LrSchedule::WarmupConstant { .. } => Ok(()),
            LrSchedule::WarmupCosine { min_factor, .. }
            | LrSchedule::Linear { min_factor, .. }
            | LrSchedule::WarmupStableDecay { min_factor, .. }
                if !(0.0..=1.0).contains(&min_factor) =>
            {
                bad(format!("the floor factor must lie in [0, 1], got {min_factor}"))
            }
            LrSchedule::Step { gamma, .. } if !(gamma.is_finite() && gamma > 0.0) => {
                bad(format!("the step factor must be positive, got {gamma}"))
            }
            LrSchedule::Step { every: 0, .. } => bad("a step every 0 steps".into()),
            _ => Ok(()),
        }
    }

    /// The factor of the base learning rate at step `step` (0-based).
    pub fn factor(&self, step: u64) -> f64 {
        // Linear warm-up from 1/warmup to 1, shared by the schedules that have one.
        let warming = |warmup: u64| (step < warmup).then(|| (step + 1) as f64 / warmup as f64);
        // From 1 at `from` to `min_factor` `steps` later, along `fall` of the share done.
        let falling = |from: u64, steps: u64, min_factor: f64, fall: &dyn Fn(f64) -> f64| {
            let done = (step.saturating_sub(from) as f64 / steps.max(1) as f64).min(1.0);
            min_factor + (1.0 - min_factor) * fall(done)
        };
        let cosine = |p: f64| 0.5 * (1.0 + (std::f64::consts::PI * p).cos());
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::WarmupConstant { warmup } => warming(warmup).unwrap_or(1.0),
            LrSchedule::WarmupCosine { warmup, total, min_factor } => {
                warming(warmup).unwrap_or_else(|| falling(warmup, total.saturating_sub(warmup), min_factor, &cosine))
            }
            LrSchedule::Step { every, gamma } => gamma.powi((step / every.max(1)) as i32),
            LrSchedule::Linear { warmup, total, min_factor } => warming(warmup)
                .unwrap_or_else(|| falling(warmup, total.saturating_sub(warmup), min_factor, &|p| 1.0 - p)),
            LrSchedule::WarmupStableDecay { warmup, decay_start, decay_steps, min_factor, shape } => warming(warmup)
                .unwrap_or_else(|| match shape {
                    DecayShape::Linear => falling(decay_start, decay_steps, min_factor, &|p| 1.0 - p),
                    DecayShape::OneMinusSqrt => falling(decay_start, decay_steps, min_factor, &|p| 1.0 - p.sqrt()),
                    DecayShape::Cosine => falling(decay_start, decay_steps, min_factor, &cosine),
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An update waits at a closed fence, changing nothing, and goes on once it opens; the
    /// wait is counted.
    #[test]
    fn updates_wait_at_a_closed_fence_and_go_on_once_it_opens() {
        let mut b = crate::model::Builder::new();
        crate::model::mlp(&crate::model::MlpConfig { vocab: 11, layers: 1, dim: 8 }, &mut b).unwrap();
        let mut engine = Engine::new(b.build().unwrap(), crate::engine::EngineConfig::default()).unwrap();
        let mut optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
        let first = crate::model::ParamId(0);
        let before = engine.param(first).copy();
        let (fence, opener) = Fence::closed();
        optimizer.hold_updates(fence.clone());
        let update = std::thread::spawn(move || {
            optimizer.step().unwrap();
            optimizer
        });
        // Either the update waits at the fence or it ran through it: whichever comes first.
        while fence.waits().0 == 0 && !update.is_finished() {
            std::thread::yield_now();
        }
        assert!(!update.is_finished(), "the update did not wait for the fence");
        assert!(engine.param(first).equal(&before), "the update changed a parameter before the fence opened");
        opener.open();
        let mut optimizer = update.join().unwrap();
        // AdamW's decay moves every weight even without a gradient.
        assert!(!engine.param(first).equal(&before), "the update did not run once the fence opened");
        assert!(optimizer.take_readers_wait() > 0.0);
        assert_eq!(optimizer.take_readers_wait(), 0.0, "read once");
    }

    /// Host updates, started while backward runs, wait at a closed fence on their own
    /// threads, and run once it opens.
    #[test]
    fn host_updates_wait_at_a_closed_fence_on_their_threads() {
        let mut b = crate::model::Builder::new();
        crate::model::mlp(&crate::model::MlpConfig { vocab: 11, layers: 1, dim: 8 }, &mut b).unwrap();
        // Every unit's parameters and optimizer state live on the host (static offload).
        let options = crate::engine::offload::OffloadOptions {
            policy: crate::engine::placement::HomePolicy::Static { params: 1.0, optimizer: 1.0 },
            optimizer_bytes_per_element: 8,
            prefetch: 1,
            pin_memory: false,
            non_model: None,
            on_host: vec![],
            slot_bytes: None,
            delayed_update: false,
        };
        let config = crate::engine::EngineConfig::default();
        let mut engine = crate::engine::offload::Offload::build(b.build().unwrap(), config, options).unwrap();
        let mut optimizer = Optimizer::new(&mut engine, OptimizerConfig::default(), &[]).unwrap();
        // The host's copy of the first segment, which the update writes.
        let host = optimizer.groups[0].params[0].shallow_clone();
        let before = host.copy();
        let (fence, opener) = Fence::closed();
        optimizer.hold_updates(fence.clone());
        let updates = optimizer.host_updates();
        assert!(!updates.start_all().is_empty(), "the units update on the host");
        // Either an update's thread waits at the fence or it changes the parameter first.
        while fence.waits().0 == 0 {
            assert!(host.equal(&before), "a host update ran before the fence opened");
            std::thread::yield_now();
        }
        opener.open();
        updates.finish().unwrap();
        assert!(!host.equal(&before), "the host update did not run once the fence opened");
    }

    #[test]
    fn warmup_cosine_rises_linearly_then_decays_to_the_floor() {
        let s = LrSchedule::WarmupCosine { warmup: 4, total: 14, min_factor: 0.1 };
        assert_eq!(s.factor(0), 0.25);
        assert_eq!(s.factor(3), 1.0);
        assert!((s.factor(4) - 1.0).abs() < 1e-12);
        assert!((s.factor(9) - 0.55).abs() < 1e-12);
        assert_eq!(s.factor(100), 0.1);
        let st = LrSchedule::Step { every: 10, gamma: 0.5 };
        assert_eq!((st.factor(9), st.factor(10), st.factor(25)), (1.0, 0.5, 0.25));
    }

    #[test]
    fn linear_and_warmup_stable_decay_fall_where_they_should() {
        let l = LrSchedule::Linear { warmup: 2, total: 12, min_factor: 0.0 };
        assert_eq!((l.factor(0), l.factor(1), l.factor(2)), (0.5, 1.0, 1.0));
        assert!((l.factor(7) - 0.5).abs() < 1e-12);
        assert_eq!((l.factor(12), l.factor(50)), (0.0, 0.0));
        let wsd = |shape| LrSchedule::WarmupStableDecay {
            warmup: 2,
            decay_start: 10,
            decay_steps: 4,
            min_factor: 0.2,
            shape,
        };
        let w = wsd(DecayShape::Linear);
        assert_eq!((w.factor(0), w.factor(5), w.factor(10)), (0.5, 1.0, 1.0));
        assert!((w.factor(12) - 0.6).abs() < 1e-12);
        assert!((w.factor(14) - 0.2).abs() < 1e-12 && (w.factor(99) - 0.2).abs() < 1e-12);
        // 1 - sqrt falls faster at first: a quarter of the way down, half of the fall is done.
        assert!((wsd(DecayShape::OneMinusSqrt).factor(11) - 0.6).abs() < 1e-12);
        // The cosine is half-way down half-way through, and barely moved a quarter in.
        let c = wsd(DecayShape::Cosine);
        assert!((c.factor(12) - 0.6).abs() < 1e-12 && (c.factor(14) - 0.2).abs() < 1e-12);
        assert!((c.factor(11) - (0.2 + 0.8 * 0.5 * (1.0 + std::f64::consts::FRAC_1_SQRT_2))).abs() < 1e-12);
        let warm = LrSchedule::WarmupConstant { warmup: 4 };
        assert_eq!((warm.factor(0), warm.factor(2), warm.factor(3), warm.factor(50)), (0.25, 0.75, 1.0, 1.0));
    }

    #[test]
    fn invalid_hyperparameters_are_refused() {
        for bad in [
            OptimizerConfig { lr: -1.0, ..Default::default() },
            OptimizerConfig { betas: (1.0, 0.9), ..Default::default() },
            OptimizerConfig { eps: 0.0, ..Default::default() },
            OptimizerConfig { kind: OptimizerKind::Sgd, nesterov: true, ..Default::default() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!("lion".parse::<OptimizerKind>().is_err());
        for bad in [
            LrSchedule::WarmupCosine { warmup: 1, total: 10, min_factor: -0.5 },
            LrSchedule::WarmupCosine { warmup: 1, total: 10, min_factor: f64::NAN },
            LrSchedule::Step { every: 3, gamma: 0.0 },
            LrSchedule::Step { every: 0, gamma: 0.5 },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(LrSchedule::Step { every: 3, gamma: 2.0 }.validate().is_ok());
    }
}
