//! The offload schedule: executes a [`Plan`] around every unit's forward and backward.
//!
//! Owns the host copies of the units whose states live on the host (their parameters,
//! which are the masters the optimizer updates there, and their gradients), the pool of
//! equal-size slots their device copies take ([`super::slots`], sized by the plan), and the
//! copies' comings and goings: before each moment the copies the plan does not keep return
//! their slots and those the moment reads are mapped and filled from the host; after a
//! unit's last backward its gradient is added into the host's and its slots returned.
//! Must not decide placement (that is [`super::placement`]'s) or update anything (the
//! optimizer updates each segment where [`OptimizerView::placement`] says it lives).
use super::placement::{self, moment_index, Home, HomePolicy, Moment, Plan, PlanInput, UnitStates};
use super::slots::{self, SlotPool, SlottedBuffer};
use super::{
    memory, Category, Engine, EngineConfig, Event, EventSink, GradLayout, HeldStates, MemoryLedger, OptimizerView,
    Phase, Placement, ScheduleContext, UnitLayout, UnitSchedule, UnitStorage,
};
use crate::model::ModelSpec;
use crate::{Error, Result};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use strata_ext::cuda;
use tch::{Device, Kind, Tensor};

/// How an offloading engine is built.
#[derive(Clone, Debug)]
pub struct OffloadOptions {
    /// How each unit's home is chosen.
    pub policy: HomePolicy,
    /// Bytes of optimizer state per parameter element (8 for Adam's two fp32 moments).
    pub optimizer_bytes_per_element: u64,
    /// How many moments ahead parameter copies start.
    pub prefetch: usize,
    /// Host buffers in page-locked memory, where the device is a GPU.
    pub pin_memory: bool,
    /// Per moment of a step, device bytes that are not model states (from a measured step);
    /// `None`: none are reserved.
    pub non_model: Option<Vec<u64>>,
    /// Per unit, whether its states live on the host whatever the policy says.
    pub on_host: Vec<bool>,
    /// Bytes of one slot of the device pool; `None`: chosen from the model's buffer sizes.
    pub slot_bytes: Option<u64>,
    /// The host's updates of a step run during the next step, which computes with the
    /// device's parameters from before them (units whose parameters stay on the device).
    pub delayed_update: bool,
}

/// One unit's host side and where its buffers are now.
struct UnitState {
    home: Home,
    /// The master parameters (homes whose gradient the device sends: a unit that computes
    /// on the host has its engine buffers there, the masters themselves).
    host_params: Option<Tensor>,
    /// The step's gradient, accumulated from each backward (homes whose gradient the device
    /// sends).
    host_grad: Option<Tensor>,
    /// The device copy of the parameters in the pool's slots (host homes); `None`: the
    /// engine's own buffer, always there.
    params_slots: Option<SlottedBuffer>,
    /// The device gradient in the pool's slots (homes other than the device).
    grad_slots: Option<SlottedBuffer>,
    trainable: bool,
    bytes: UnitStates,
}

impl UnitState {
    fn params_on_device(&self) -> bool {
        self.params_slots.as_ref().is_none_or(SlottedBuffer::is_mapped)
    }

    fn grads_on_device(&self) -> bool {
        self.trainable && self.grad_slots.as_ref().is_none_or(SlottedBuffer::is_mapped)
    }
}

/// A parameter copy started ahead and still running.
enum InFlight {
    /// On a thread of its own (the device is the CPU).
    Thread(std::thread::JoinHandle<Result<()>>),
    /// On the copy stream of GPU `device`: done when the event is.
    Stream { done: cuda::Event, device: usize },
}

impl InFlight {
    /// Waits for the copy: the host waits (`host_waits`, before the host writes the master
    /// the copy reads), or only the device's current stream does (before the device reads
    /// the copy or its memory is returned to the allocator), and then the copy's event is
    /// returned, for the host to wait on before it writes the master.
    fn finish(self, host_waits: bool) -> Result<Option<cuda::Event>> {
        match self {
            InFlight::Thread(copy) => {
                copy.join().map_err(|_| Error::Engine("a parameter copy to the device panicked".into()))??;
                Ok(None)
            }
            InFlight::Stream { done, .. } if host_waits => {
                done.synchronize()?;
                Ok(None)
            }
            InFlight::Stream { done, device } => {
                done.wait(&cuda::Stream::current(device)?)?;
                Ok(Some(done))
            }
        }
    }
}

/// The schedule that keeps host-homed units' states on the host and brings their copies to
/// the device and back as its [`Plan`] says.
pub struct Offload {
    plan: Plan,
    delayed_update: bool,
    pool: SlotPool,
    units: Vec<UnitState>,
    needs: Vec<Vec<usize>>,
    /// Per unit, the last unit whose backward reads it (itself, or the lowest borrower).
    last_reader: Vec<usize>,
    /// Parameter copies started ahead and still running, by unit.
    copying: Vec<(usize, InFlight)>,
    /// Per unit, the last of its copies on a GPU's copy stream that the compute stream
    /// waited for and the host has not: the host waits before it writes the master.
    device_waited: Vec<Option<cuda::Event>>,
    /// On a GPU, the stream copies started ahead run on, beside the compute stream.
    copy_stream: Option<cuda::Stream>,
    events: Option<Arc<dyn EventSink>>,
}

impl Drop for Offload {
    fn drop(&mut self) {
        // The copies write buffers they hold a reference to, from host memory this frees:
        // wait for them to end.
        for (_, copy) in self.copying.drain(..) {
            let _ = copy.finish(true);
        }
        for done in self.device_waited.iter_mut().filter_map(Option::take) {
            let _ = done.synchronize();
        }
    }
}

/// Copies `source` into `destination` (one of them on GPU `device`, the other in host
/// memory) on `stream`, after the work queued so far on the device's current stream (which
/// may still write the source or use the destination's memory), without the host waiting.
/// The event completes with the copy.
pub(super) fn copy_on_stream(
    stream: &cuda::Stream,
    device: usize,
    destination: &Tensor,
    source: &Tensor,
) -> Result<cuda::Event> {
    let compute = cuda::Stream::current(device)?;
    let queued = cuda::Event::new(false)?;
    queued.record(&compute)?;
    queued.wait(stream)?;
    stream.make_current()?;
    // SAFETY: the caller waits for `done` before the compute stream reads the destination,
    // before the host writes the source and before either is freed ([`InFlight::finish`]).
    let copied = unsafe { strata_ext::copy_non_blocking(destination, source) };
    // The compute stream is current again whatever the copy did.
    compute.make_current()?;
    copied?;
    let done = cuda::Event::new(false)?;
    done.record(stream)?;
    Ok(done)
}

/// Per unit, the bytes of its model states in `kind`, its buffers laid out as the engine
/// lays them out ([`UnitLayout`], padded to `pad_to`).
fn unit_states(spec: &ModelSpec, kind: Kind, pad_to: i64, optimizer_bytes_per_element: u64) -> Vec<UnitStates> {
    let esize = kind.elt_size_in_bytes() as u64;
    // The optimizer updates low-precision parameters through fp32 copies of the parameters
    // and gradients of one unit at a time.
    let scratch_per_element = if esize < 4 { 8 } else { 0 };
    spec.units
        .iter()
        .enumerate()
        .map(|(k, u)| {
            let layout = UnitLayout::of(spec, k, 1, pad_to);
            let trainable: u64 = u
                .params
                .iter()
                .filter(|id| spec.params[id.0].requires_grad)
                .map(|id| spec.params[id.0].numel() as u64)
                .sum();
            UnitStates {
                params: layout.len as u64 * esize,
                grads: layout.grad_len() as u64 * esize,
                optimizer: trainable * optimizer_bytes_per_element,
                update_scratch: trainable * scratch_per_element,
            }
        })
        .collect()
}

impl Offload {
    /// Plans where `spec`'s states live under `options` and builds the engine: each unit is
    /// initialised on the device and moved to its home before the next is allocated, so the
    /// device never holds more than the plan allows. Refuses, with the numbers, a model whose
    /// states fit no placement the policy allows.
    pub fn build(spec: ModelSpec, config: EngineConfig, options: OffloadOptions) -> Result<Engine> {
        if config.tensor.is_some() {
            return Err(Error::Config("offload does not combine with tensor parallelism yet".into()));
        }
        if options.slot_bytes.is_some() && !SlotPool::maps_slots(config.device) {
            return Err(Error::Config(format!(
                "offload: slot_bytes applies where copies take slots (the CPU), not on {:?}",
                config.device
            )));
        }
        let n = spec.units.len();
        let input = plan_input(&spec, &config, &options);
        let plan = placement::plan(&input, &options.policy)?;
        tracing::info!(homes = ?plan.homes, traffic = ?plan.traffic, device_peak = plan.device_peak(), "offload plan");
        if options.delayed_update && plan.homes.iter().any(|h| h.params_on_host()) {
            return Err(Error::Config(
                "offload: delayed_update computes a step with the device's parameters while the host updates the \
                 masters; parameters that live on the host cannot stay behind (use params \"none\")"
                    .into(),
            ));
        }
        let (needs, unit_bytes) = (input.needs, input.units);
        let mut last_reader: Vec<usize> = (0..n).collect();
        for (k, reads) in needs.iter().enumerate() {
            for &u in reads {
                last_reader[u] = last_reader[u].min(k);
            }
        }
        let slot_bytes = input.slot_bytes;
        let capacity = u32::try_from(plan.slot_peak.div_ceil(slot_bytes))
            .map_err(|_| Error::Config(format!("offload: {} bytes of slots of {slot_bytes}", plan.slot_peak)))?;
        let pool = SlotPool::on(config.device, slot_bytes, capacity)?;
        let copy_stream = match config.device {
            Device::Cuda(device) if options.prefetch > 0 => Some(cuda::Stream::from_pool(device, false)?),
            _ => None,
        };
        let host = HostMemory { device: config.device, pin: options.pin_memory };
        let mut units = Vec::with_capacity(n);
        let mut on_unit = |k: usize, s: &mut UnitStorage, _: &Tensor, ledger: &MemoryLedger| -> Result<()> {
            let home = plan.homes[k];
            let bytes = unit_bytes[k];
            let mut unit = UnitState {
                home,
                host_params: None,
                host_grad: None,
                params_slots: None,
                grad_slots: None,
                trainable: s.trainable,
                bytes,
            };
            // A unit that computes on the host has its engine buffers there: they are its master.
            if home.sends_grads() {
                ledger.alloc(Placement::Host, Category::Params, bytes.params)?;
                unit.host_params = Some(host.copy_of(&s.flat, ledger)?);
                if s.trainable {
                    ledger.alloc(Placement::Host, Category::Grads, bytes.grads)?;
                    unit.host_grad = Some(host.zeros_like(&s.grad, ledger)?);
                }
            }
            // The device gradient of a unit homed elsewhere exists only during its backwards,
            // in the pool's slots; a frozen unit's, never.
            if home.sends_grads() || !s.trainable {
                let held_at = if home == Home::HostCompute { Placement::Host } else { Placement::Device };
                ledger.free(held_at, Category::Grads, memory::tensor_bytes(&s.grad));
                if s.trainable {
                    // SAFETY: no backward has run; `ensure_grads` maps and zeroes it first.
                    unit.grad_slots = Some(unsafe { pool.adopt(&s.grad) }?);
                } else {
                    // SAFETY: a frozen unit's gradient is never read or written.
                    unsafe { memory::release_buffer(&s.grad) }?;
                }
            }
            if home == Home::Host {
                // SAFETY: nothing has run on the unit; the schedule maps and fills it before
                // any use.
                unit.params_slots = Some(unsafe { pool.adopt(&s.flat) }?);
                ledger.free(Placement::Device, Category::Params, memory::tensor_bytes(&s.flat));
            }
            units.push(unit);
            Ok(())
        };
        let host_compute = plan.homes.iter().map(|&h| h == Home::HostCompute).collect();
        let config = EngineConfig { grad_layout: GradLayout::PerUnit, host_compute, ..config };
        let mut engine = Engine::new_with(spec, config, &mut on_unit)?;
        let delayed_update = options.delayed_update;
        let offload = Offload {
            plan,
            delayed_update,
            pool,
            units,
            needs,
            last_reader,
            copying: vec![],
            device_waited: (0..n).map(|_| None).collect(),
            copy_stream,
            events: None,
        };
        engine.set_schedule(Box::new(offload));
        Ok(engine)
    }

    /// The plan [`Offload::build`] would execute for `spec` under `config`'s budgets.
    pub fn plan_for(spec: &ModelSpec, config: &EngineConfig, options: &OffloadOptions) -> Result<Plan> {
        placement::plan(&plan_input(spec, config, options), &options.policy)
    }

    /// Starts copying unit `u`'s parameters from the host into its device buffer: with
    /// `ahead`, on a thread of its own where the device is the CPU, or on the copy stream
    /// where it is a GPU (so the copy overlaps the units computing meanwhile); here
    /// otherwise. [`Offload::finish_fetch`] waits for it.
    fn start_fetch(&mut self, u: usize, ahead: bool, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        let (pool, unit) = (&mut self.pool, &mut self.units[u]);
        let (Some(host), Some(slots)) = (unit.host_params.as_ref(), unit.params_slots.as_mut()) else { return Ok(()) };
        if slots.is_mapped() {
            return Ok(());
        }
        ledger.alloc(Placement::Device, Category::Params, slots.slot_bytes_held(pool))?;
        let started = Instant::now();
        // Filled below, before any use.
        pool.map(slots)?;
        let bytes = unit.bytes.params;
        // Written through a tensor with a version counter of its own: autograd's saved views
        // of these parameters see the values they saw in forward, with no version change.
        let (destination, source) = (storage[u].flat.f_data()?, host.shallow_clone());
        let copy = move || -> Result<()> {
            tch::no_grad(|| destination.shallow_clone().f_copy_(&source))?;
            Ok(())
        };
        let begun = match (ahead, storage[u].flat.device(), &self.copy_stream) {
            (true, Device::Cpu, _) => {
                self.copying.push((u, InFlight::Thread(std::thread::spawn(copy))));
                Ok(())
            }
            (true, Device::Cuda(device), Some(stream)) => storage[u]
                .flat
                .f_data()
                .map_err(Error::from)
                .and_then(|destination| copy_on_stream(stream, device, &destination, host))
                .map(|done| self.copying.push((u, InFlight::Stream { done, device }))),
            _ => copy().map(|()| self.waited_for_copy(ledger, u, Placement::Device, bytes, started)),
        };
        if let Err(e) = begun {
            // The buffer holds nothing usable: it goes back once nothing can write it any
            // more, so that its next use maps and fills it again.
            if let Some(stream) = &self.copy_stream {
                let _ = stream.synchronize();
            }
            let _ = self.evict(u, ledger);
            return Err(e);
        }
        self.record(Event::Copied { unit: u, to: Placement::Device, bytes });
        Ok(())
    }

    /// Waits for unit `u`'s copy started ahead, if one is in flight: the device's compute
    /// stream waits, and the host too where `host_waits` ([`InFlight::finish`]).
    fn finish_fetch(&mut self, u: usize, ledger: &MemoryLedger, host_waits: bool) -> Result<()> {
        let Some(i) = self.copying.iter().position(|(v, _)| *v == u) else { return Ok(()) };
        let (_, copy) = self.copying.swap_remove(i);
        let started = Instant::now();
        let copied = copy.finish(host_waits);
        self.waited_for_copy(ledger, u, Placement::Device, self.units[u].bytes.params, started);
        // A later copy of the unit follows this one on the stream: its event covers both.
        if let Some(done) = copied? {
            self.device_waited[u] = Some(done);
        }
        Ok(())
    }

    /// Waits, on the host, for every copy in flight or only waited for by the device: none
    /// reads a master the host writes next.
    fn finish_fetches(&mut self, ledger: &MemoryLedger) -> Result<()> {
        while let Some(&(u, _)) = self.copying.first() {
            self.finish_fetch(u, ledger, true)?;
        }
        for done in self.device_waited.iter_mut().filter_map(Option::take) {
            // Mostly long done: a query does not stall the host.
            if !done.query()? {
                done.synchronize()?;
            }
        }
        Ok(())
    }

    /// Releases the device copy of a host-homed unit's parameters.
    fn evict(&mut self, u: usize, ledger: &MemoryLedger) -> Result<()> {
        if !self.units[u].params_slots.as_ref().is_some_and(SlottedBuffer::is_mapped) {
            return Ok(());
        }
        // A copy still filling the buffer completes before its memory goes.
        self.finish_fetch(u, ledger, false)?;
        let (pool, unit) = (&mut self.pool, &mut self.units[u]);
        let Some(slots) = unit.params_slots.as_mut() else { return Ok(()) };
        ledger.free(Placement::Device, Category::Params, slots.slot_bytes_held(pool));
        // SAFETY: the unit's forward or backward that read the copy is over (the engine runs
        // one moment at a time) and the copy is filled again before its next use.
        unsafe { pool.unmap(slots) }?;
        self.record(Event::Evicted { unit: u });
        Ok(())
    }

    fn record(&self, event: Event) {
        if let Some(sink) = &self.events {
            sink.record(event);
        }
    }

    /// Counts a copy of `unit`'s states the engine's thread waited for since `began`.
    fn waited_for_copy(&self, ledger: &MemoryLedger, unit: usize, to: Placement, bytes: u64, began: Instant) {
        ledger.record_transfer(to, bytes, began.elapsed());
        self.record(Event::CopyWaited { unit, began });
    }

    /// Makes the device hold what moment `t`, which reads `reads`, needs: copies the plan
    /// does not keep leave first, then the missing ones come.
    fn prepare(&mut self, t: usize, reads: &[usize], storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        let keep = &self.plan.resident[t];
        let leaving: Vec<usize> = (0..self.units.len()).filter(|u| !keep.contains(u) && !reads.contains(u)).collect();
        for u in leaving {
            self.evict(u, ledger)?;
        }
        for &u in reads {
            self.start_fetch(u, false, storage, ledger)?;
            self.finish_fetch(u, ledger, false)?;
        }
        for u in self.plan.prefetch[t].clone() {
            self.start_fetch(u, true, storage, ledger)?;
        }
        Ok(())
    }

    /// Gives unit `u` a zeroed device gradient if it has none.
    fn ensure_grads(&mut self, u: usize, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        let (pool, unit) = (&mut self.pool, &mut self.units[u]);
        let Some(slots) = unit.grad_slots.as_mut().filter(|b| !b.is_mapped()) else { return Ok(()) };
        ledger.alloc(Placement::Device, Category::Grads, slots.slot_bytes_held(pool))?;
        // Zeroed next, before the backward accumulates into it.
        pool.map(slots)?;
        let _ = storage[u].grad.shallow_clone().f_zero_()?;
        Ok(())
    }

    /// Adds unit `u`'s device gradient into its host gradient and releases it. On a GPU the
    /// host waits for the gradient's copy, so the compute stream has run the unit's
    /// backward and, before it, the wait for the unit's parameter copy: no copy still reads
    /// the master the host's update may write next.
    fn send_grads(&mut self, u: usize, storage: &[UnitStorage], ledger: &MemoryLedger) -> Result<()> {
        let (pool, unit) = (&mut self.pool, &mut self.units[u]);
        let Some(host) = unit.host_grad.as_ref().filter(|_| unit.grads_on_device()) else { return Ok(()) };
        let started = Instant::now();
        let grad = &storage[u].grad;
        tch::no_grad(|| -> Result<()> {
            let arrived = if grad.device() == host.device() { grad.shallow_clone() } else { grad.f_to(host.device())? };
            let _ = host.shallow_clone().f_add_(&arrived)?;
            Ok(())
        })?;
        let bytes = unit.bytes.grads;
        if let Some(slots) = unit.grad_slots.as_mut() {
            ledger.free(Placement::Device, Category::Grads, slots.slot_bytes_held(pool));
            // SAFETY: the unit's last backward of this micro-batch is over and its gradient
            // was read above; `ensure_grads` maps it again before the next backward.
            unsafe { pool.unmap(slots) }?;
        }
        self.waited_for_copy(ledger, u, Placement::Host, bytes, started);
        self.record(Event::Copied { unit: u, to: Placement::Host, bytes });
        Ok(())
    }
}

/// What the plan of `spec` under `config` and `options` is made from.
fn plan_input(spec: &ModelSpec, config: &EngineConfig, options: &OffloadOptions) -> PlanInput {
    let units = unit_states(spec, config.kind, config.pad_to, options.optimizer_bytes_per_element);
    let buffers: Vec<u64> = units.iter().flat_map(|u| [u.params, u.grads]).filter(|&b| b > 0).collect();
    PlanInput {
        slot_bytes: match SlotPool::maps_slots(config.device) {
            true => options.slot_bytes.unwrap_or_else(|| slots::choose_slot_bytes(&buffers, slots::granularity())),
            false => 1,
        },
        units,
        needs: spec.units_read(),
        non_model: options.non_model.clone().unwrap_or_else(|| vec![0; 2 * spec.units.len() + 1]),
        device_budget: config.device_budget,
        host_budget: config.host_budget,
        prefetch: options.prefetch,
        on_host: options.on_host.clone(),
        delayed_update: options.delayed_update,
    }
}

/// Records, per moment of a step, the most device bytes beside model states: where the
/// allocator is tracked, its peak between consecutive phase events minus the fewer model
/// states held at either end (activations and every temporary, the loss's between the last
/// forward and the first backward included), counted for the moments at both ends; and at
/// least the activations the ledger counts; and per moment the most model-state bytes the
/// ledger held on the device at either end. Installed as an engine's event sink for a step
/// (or two, with an update between them), it measures what an offload plan must leave room
/// for, and the device's peak ([`NonModelTrace::device_peak`]).
pub struct NonModelTrace {
    ledger: Arc<MemoryLedger>,
    units: usize,
    device: Device,
    state: Mutex<TraceState>,
}

struct TraceState {
    peaks: Vec<u64>,
    /// Per moment, the most model-state bytes the ledger held on the device at either end.
    device_states: Vec<u64>,
    previous_on_device: u64,
    /// The previous event's moment and the model-state bytes then.
    previous: Option<(usize, u64)>,
}

impl NonModelTrace {
    /// A trace for `engine`'s units, with nothing measured yet.
    pub fn new(engine: &Engine) -> NonModelTrace {
        let units = engine.spec().units.len();
        NonModelTrace {
            ledger: engine.ledger().clone(),
            units,
            device: engine.config().device,
            state: Mutex::new(TraceState {
                peaks: vec![0; 2 * units + 1],
                device_states: vec![0; 2 * units + 1],
                previous_on_device: 0,
                previous: None,
            }),
        }
    }

    /// Model-state bytes the device's allocator holds now (on the CPU it also holds the
    /// host's), and those the ledger places on the device.
    fn model_state_bytes(&self) -> (u64, u64) {
        let report = self.ledger.report();
        let states = |r: &memory::PlacementReport| -> u64 {
            r.by_category.iter().filter(|(c, _)| c.is_model_state()).map(|(_, &b)| b).sum()
        };
        let on_device = report.get(&Placement::Device).map_or(0, states);
        let allocated = match self.device {
            Device::Cpu => report.values().map(states).sum(),
            _ => on_device,
        };
        (allocated, on_device)
    }

    /// The peaks so far, one per moment of [`placement::step_moments`].
    pub fn peaks(&self) -> Vec<u64> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).peaks.clone()
    }

    /// The most device bytes of any moment so far: its peak beside model states plus the
    /// model states the ledger held on the device then.
    pub fn device_peak(&self) -> u64 {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.peaks.iter().zip(&state.device_states).map(|(p, d)| p + d).max().unwrap_or(0)
    }
}

impl EventSink for NonModelTrace {
    fn record(&self, event: Event) {
        let Event::Phase { phase, unit, .. } = event else { return };
        let moment = match phase {
            Phase::BeforeForward | Phase::AfterForward => Moment::Forward(unit),
            Phase::BeforeBackward | Phase::AfterBackward => Moment::Backward(unit),
        };
        let now = moment_index(self.units, moment);
        let held = self.ledger.held(Placement::Device, Category::Activations);
        let (model, on_device) = self.model_state_bytes();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // What the device held between the two events, counted for both moments.
        let window_states = on_device.max(state.previous_on_device);
        state.previous_on_device = on_device;
        let (before, model_before) = state.previous.unwrap_or((now, model));
        let window = memory::allocator_peak(self.device).unwrap_or(0).saturating_sub(model.min(model_before));
        for m in [before, now] {
            state.peaks[m] = state.peaks[m].max(window);
            state.device_states[m] = state.device_states[m].max(window_states);
        }
        state.peaks[now] = state.peaks[now].max(held);
        state.previous = Some((now, model));
        memory::reset_allocator_peak(self.device);
    }
}

/// Where host buffers are made: the CPU, page-locked when the device is a GPU.
#[derive(Clone, Debug)]
pub struct HostMemory {
    /// The compute device the host buffers serve.
    pub device: Device,
    /// Whether host buffers are page-locked where the device is a GPU.
    pub pin: bool,
}

impl HostMemory {
    /// `t` in page-locked memory where the device is a GPU and pinning is on (counted in
    /// `ledger`), as it is otherwise.
    fn place(&self, t: Tensor, ledger: &MemoryLedger) -> Result<Tensor> {
        Ok(match self.device {
            Device::Cuda(_) if self.pin => {
                let pinned = t.f_pin_memory(self.device)?;
                ledger.record_pinned(memory::tensor_bytes(&pinned));
                pinned
            }
            _ => t,
        })
    }

    /// A host copy of `t`, in `t`'s dtype.
    pub fn copy_of(&self, t: &Tensor, ledger: &MemoryLedger) -> Result<Tensor> {
        self.place(t.f_to_device(Device::Cpu)?.f_detach_copy()?, ledger)
    }

    /// Host zeros of `t`'s shape and dtype.
    pub fn zeros_like(&self, t: &Tensor, ledger: &MemoryLedger) -> Result<Tensor> {
        self.place(Tensor::f_zeros(t.size().as_slice(), (t.kind(), Device::Cpu))?, ledger)
    }
}

impl UnitSchedule for Offload {
    fn on(&mut self, phase: Phase, ctx: ScheduleContext<'_>) -> Result<()> {
        let (k, storage, ledger) = (ctx.unit, &*ctx.storage, ctx.ledger);
        let n = self.units.len();
        let reads = self.needs[k].clone();
        match phase {
            Phase::BeforeForward => self.prepare(moment_index(n, Moment::Forward(k)), &reads, storage, ledger),
            Phase::BeforeBackward => {
                self.prepare(moment_index(n, Moment::Backward(k)), &reads, storage, ledger)?;
                for &u in &reads {
                    if self.units[u].home.sends_grads() {
                        self.ensure_grads(u, storage, ledger)?;
                    }
                }
                Ok(())
            }
            Phase::AfterBackward => {
                for u in reads {
                    if self.last_reader[u] == k {
                        self.send_grads(u, storage, ledger)?;
                        if let (true, Some(ready), true) =
                            (ctx.sync_grads, ctx.grad_ready, self.units[u].home != Home::Device)
                        {
                            ready(u);
                        }
                    }
                }
                Ok(())
            }
            Phase::AfterForward => Ok(()),
        }
    }

    fn finish_grads(&mut self, ctx: ScheduleContext<'_>) -> Result<()> {
        // No copy may read a master while the optimizer writes it.
        self.finish_fetches(ctx.ledger)
    }

    fn after_update(&mut self, ctx: ScheduleContext<'_>) -> Result<()> {
        let (storage, ledger) = (&*ctx.storage, ctx.ledger);
        self.finish_fetches(ledger)?;
        for (u, flat) in storage.iter().map(|s| &s.flat).enumerate() {
            match self.units[u].home {
                Home::Device | Home::HostCompute => {}
                // The device copy is stale: the next use fetches the updated master.
                Home::Host => self.evict(u, ledger)?,
                Home::OptimizerOnHost => {
                    let Some(host) = &self.units[u].host_params else { continue };
                    let started = Instant::now();
                    tch::no_grad(|| flat.shallow_clone().f_copy_(host))?;
                    self.waited_for_copy(ledger, u, Placement::Device, self.units[u].bytes.params, started);
                }
            }
        }
        Ok(())
    }

    fn attach_events(&mut self, sink: Arc<dyn EventSink>) {
        self.events = Some(sink);
    }

    fn zero_grads(&mut self, ctx: ScheduleContext<'_>) -> Result<()> {
        for (unit, s) in self.units.iter().zip(ctx.storage.iter()) {
            if unit.grads_on_device() {
                let _ = s.grad.shallow_clone().f_zero_()?;
            }
            if let Some(g) = &unit.host_grad {
                let _ = g.shallow_clone().f_zero_()?;
            }
        }
        Ok(())
    }
}

impl HeldStates for Offload {
    fn optimizer_view(&self, ctx: ScheduleContext<'_>) -> Result<OptimizerView> {
        let (unit, s) = (&self.units[ctx.unit], &ctx.storage[ctx.unit]);
        let placement = if unit.home == Home::Device { Placement::Device } else { Placement::Host };
        // The master where there is one apart; a unit that computes on the host has its
        // engine buffers there.
        let param = unit.host_params.as_ref().unwrap_or(&s.flat);
        let grad = unit.host_grad.as_ref().unwrap_or(&s.grad);
        Ok(OptimizerView {
            param: param.f_narrow(0, s.grad_start, grad.numel() as i64)?,
            grad: grad.shallow_clone(),
            offset: s.grad_start,
            placement,
        })
    }

    fn delays_host_updates(&self) -> bool {
        self.delayed_update
    }

    fn capture_obstacle(&self) -> Option<String> {
        Some("offload: each step waits for copies between host and device and updates on the host".into())
    }

    fn held_tensors(&self) -> Vec<Tensor> {
        let host = self.units.iter().flat_map(|u| [u.host_params.as_ref(), u.host_grad.as_ref()]);
        host.flatten().map(Tensor::shallow_clone).collect()
    }

    fn full_unit(&mut self, ctx: ScheduleContext<'_>) -> Result<Tensor> {
        self.finish_fetches(ctx.ledger)?;
        let (unit, s) = (&self.units[ctx.unit], &ctx.storage[ctx.unit]);
        let master = unit.host_params.as_ref().unwrap_or(&s.flat);
        Ok(master.f_narrow(0, 0, s.numel)?)
    }

    fn set_full_unit(&mut self, ctx: ScheduleContext<'_>, values: &Tensor) -> Result<()> {
        self.finish_fetches(ctx.ledger)?;
        let (unit, s) = (&self.units[ctx.unit], &ctx.storage[ctx.unit]);
        if let Some(host) = &unit.host_params {
            tch::no_grad(|| host.f_narrow(0, 0, s.numel)?.f_copy_(values))?;
        }
        if unit.params_on_device() {
            tch::no_grad(|| s.flat.f_narrow(0, 0, s.numel)?.f_copy_(values))?;
        }
        Ok(())
    }
}
