//! Activation offload: the values a unit's forward keeps for its backward wait in host
//! memory between the two.
//!
//! Owns: a unit's shelf for one micro-batch — the pack and unpack of autograd's saved
//! tensors (through [`strata_ext::saved_tensors`]) and of a recomputed unit's input, their
//! host copies, the copies' stream, the wait for a unit's copies to land and the fetch of
//! its values back before its backward; and which values stay on the device (parameters,
//! values too small to pay for their copies, values on another device). Must not decide
//! which units offload (the strategy's) or when (the engine's loop calls
//! the shelf's `settle`, `fetch` and `clear` at its moments).
use super::offload::copy_on_stream;
use crate::{Error, Result};
use std::collections::{HashMap, HashSet};
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex, MutexGuard};
use strata_ext::cuda;
use strata_ext::saved_tensors::{Packed, SavedTensorHooks};
use tch::{Device, Kind, Tensor};

/// How a unit's kept values are offloaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationOffload {
    /// Values whose storage is smaller than this many bytes stay on the device.
    pub min_bytes: u64,
    /// Host copies in page-locked memory (a GPU only).
    pub pin_memory: bool,
}

/// What every shelf of an engine shares: the device, the stream the copies run on (a GPU),
/// and the storages of the engine's parameters, which stay where they are.
pub(crate) struct ShelfContext {
    pub device: Device,
    pub stream: Option<cuda::Stream>,
    pub parameters: HashSet<usize>,
}

/// One unit's offloaded values of one micro-batch; shared with the saved tensors' hooks,
/// which autograd keeps until it frees the unit's graph.
#[derive(Clone)]
pub(crate) struct Shelf(Arc<ShelfInner>);

struct ShelfInner {
    settings: ActivationOffload,
    context: Arc<ShelfContext>,
    state: Mutex<ShelfState>,
}

/// What a shelf holds: copies of storages (each once, however many saved tensors view it),
/// and the saved tensors as views of them.
#[derive(Default)]
struct ShelfState {
    copies: Vec<Copy>,
    /// A copy's place by what it copies: a storage whole, or one view of it.
    by_source: HashMap<Source, usize>,
    /// Per ticket (from 1): the copy, and the view of it the saved tensor was.
    views: Vec<(usize, View)>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Source {
    Storage(usize, Kind),
    View(usize, View),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct View {
    kind: Kind,
    size: Vec<i64>,
    stride: Vec<i64>,
    offset: i64,
}

struct Copy {
    /// The values, flat on the host; `None` once the shelf is cleared.
    host: Option<Tensor>,
    /// Whether `host` holds the storage whole (views keep their offsets and strides) or
    /// one view's elements in order.
    whole: bool,
    /// The device values, held until the shelf settles: their copy to the host has
    /// completed (a GPU), and their storage's identity cannot be reused meanwhile.
    source: Option<Tensor>,
    /// Completes with the copy to the host.
    stored: Option<cuda::Event>,
    /// The values fetched back to the device, and the event their copy completes with.
    fetched: Option<(Tensor, Option<cuda::Event>)>,
}

impl Shelf {
    pub fn new(settings: ActivationOffload, context: Arc<ShelfContext>) -> Shelf {
        Shelf(Arc::new(ShelfInner { settings, context, state: Mutex::new(ShelfState::default()) }))
    }

    fn state(&self) -> Result<MutexGuard<'_, ShelfState>> {
        self.0.state.lock().map_err(|_| Error::Engine("an activation shelf's lock is poisoned".into()))
    }

    /// Routes the calling thread's saved tensors to this shelf while the scope lives.
    pub fn hooks(&self) -> Result<strata_ext::saved_tensors::Scope> {
        Ok(strata_ext::saved_tensors::push(Arc::new(self.clone()))?)
    }

    /// Bytes this shelf holds on the host.
    pub fn host_bytes(&self) -> Result<u64> {
        Ok(self.state()?.copies.iter().filter_map(|c| c.host.as_ref()).map(super::memory::tensor_bytes).sum())
    }

    /// Copies `t`'s values to the host (its storage whole, where `t` covers most of it and
    /// the storage is not on the shelf already) and returns its ticket.
    pub fn store(&self, t: &Tensor) -> Result<NonZeroU64> {
        let kind = t.kind();
        let esize = kind.elt_size_in_bytes() as i64;
        let storage_len = strata_ext::storage_nbytes(t)? as i64 / esize;
        let base = t.f_as_strided([storage_len], [1], Some(0))?;
        let offset = (t.data_ptr() as i64 - base.data_ptr() as i64) / esize;
        let view = View { kind, size: t.size(), stride: t.stride(), offset };
        let id = strata_ext::storage_id(t)?;
        let mut state = self.state()?;
        let whole_key = Source::Storage(id, kind);
        let key = if state.by_source.contains_key(&whole_key) || 2 * t.numel() as i64 >= storage_len {
            whole_key
        } else {
            Source::View(id, view.clone())
        };
        let copy = match state.by_source.get(&key) {
            Some(&at) => at,
            None => {
                let whole = matches!(key, Source::Storage(..));
                let values = if whole { base } else { t.shallow_clone() };
                let copy = self.copy_out(&values, whole)?;
                state.copies.push(copy);
                let at = state.copies.len() - 1;
                state.by_source.insert(key, at);
                at
            }
        };
        state.views.push((copy, view));
        NonZeroU64::new(state.views.len() as u64).ok_or_else(|| Error::Engine("no ticket".into()))
    }

    /// Starts copying `values` to the host.
    fn copy_out(&self, values: &Tensor, whole: bool) -> Result<Copy> {
        let context = &self.0.context;
        let (host, source, stored) = match (values.device(), context.stream) {
            (Device::Cuda(device), Some(stream)) => {
                let mut host = Tensor::f_empty([values.numel() as i64], (values.kind(), Device::Cpu))?;
                if self.0.settings.pin_memory {
                    host = host.f_pin_memory(values.device())?;
                }
                let flat = host.f_view(values.size().as_slice())?;
                let done = copy_on_stream(&stream, device, &flat, values)?;
                (host, Some(values.shallow_clone()), Some(done))
            }
            // Held all the same: a storage freed now could come back under the same
            // identity and be taken for one on the shelf.
            _ => (outside_the_allocator(values)?, Some(values.shallow_clone()), None),
        };
        Ok(Copy { host: Some(host), whole, source, stored, fetched: None })
    }

    /// The value of `ticket` on the device, from the copy [`Shelf::fetch`] brought back
    /// (fetched now where it has not).
    pub fn take(&self, ticket: NonZeroU64) -> Result<Tensor> {
        let device = self.0.context.device;
        let mut state = self.state()?;
        let (at, view) = state
            .views
            .get(ticket.get() as usize - 1)
            .cloned()
            .ok_or_else(|| Error::Engine(format!("activation ticket {ticket} names nothing stored")))?;
        let copy = &mut state.copies[at];
        let fetched = match copy.fetched.take() {
            Some(fetched) => fetched,
            None => self.copy_in(copy)?,
        };
        let (values, copied) = copy.fetched.insert(fetched);
        if let (Some(copied), Device::Cuda(d)) = (copied, device) {
            copied.wait(&cuda::Stream::current(d)?)?;
        }
        let value = if copy.whole {
            values.f_as_strided(view.size.as_slice(), view.stride.as_slice(), Some(view.offset))?
        } else {
            values.f_view(view.size.as_slice())?
        };
        Ok(value)
    }

    /// Starts bringing `copy`'s values back to the device (on the copy stream, a GPU).
    fn copy_in(&self, copy: &Copy) -> Result<(Tensor, Option<cuda::Event>)> {
        let context = &self.0.context;
        let host = copy
            .host
            .as_ref()
            .ok_or_else(|| Error::Engine("an offloaded value read after its unit's backward".into()))?;
        Ok(match (context.device, context.stream) {
            (Device::Cuda(device), Some(stream)) => {
                let values = Tensor::f_empty(host.size(), (host.kind(), context.device))?;
                let copied = copy_on_stream(&stream, device, &values, host)?;
                (values, Some(copied))
            }
            (device, _) => (copy_to(host, device)?, None),
        })
    }

    /// Waits for the copies to the host and lets go of the device values they read; the
    /// shelf takes no more values after.
    pub fn settle(&self) -> Result<()> {
        let mut state = self.state()?;
        for copy in state.copies.iter_mut() {
            if let Some(stored) = copy.stored.take() {
                stored.synchronize()?;
            }
            copy.source = None;
        }
        // Storages let go of may come back under the same identities.
        state.by_source.clear();
        Ok(())
    }

    /// Starts copying every value back to the device, so that the unit's backward finds
    /// them there.
    pub fn fetch(&self) -> Result<()> {
        let mut state = self.state()?;
        for copy in state.copies.iter_mut().filter(|c| c.fetched.is_none() && c.host.is_some()) {
            copy.fetched = Some(self.copy_in(copy)?);
        }
        Ok(())
    }

    /// Frees everything the shelf holds once its unit's backward is done, after the copies
    /// still in flight (the device's stream waits for those that bring values back).
    pub fn clear(&self) -> Result<()> {
        let mut state = self.state()?;
        after_copies(self.0.context.device, &mut state.copies)?;
        *state = ShelfState::default();
        Ok(())
    }

    /// Whether `t` stays on the device.
    fn stays(&self, t: &Tensor) -> Result<bool> {
        let context = &self.0.context;
        Ok(t.device() != context.device
            || (strata_ext::storage_nbytes(t)? as u64) < self.0.settings.min_bytes
            || context.parameters.contains(&strata_ext::storage_id(t)?))
    }
}

/// Orders the freeing of `copies`' device values after the copies still in flight that
/// read or write them: the device's current stream waits for those bringing values back, and
/// the host for those to the host. Their events are used up.
fn after_copies(device: Device, copies: &mut [Copy]) -> Result<()> {
    let Device::Cuda(d) = device else { return Ok(()) };
    let compute = cuda::Stream::current(d)?;
    for copy in copies {
        if let Some(copied) = copy.fetched.as_mut().and_then(|(_, event)| event.take()) {
            copied.wait(&compute)?;
        }
        if let Some(stored) = copy.stored.take() {
            stored.synchronize()?;
        }
    }
    Ok(())
}

/// A shelf let go of before its unit's backward cleared it (a backward that failed part way,
/// whose caller went on) still frees its device values only after their copies.
impl Drop for ShelfInner {
    fn drop(&mut self) {
        let copies = match self.state.get_mut() {
            Ok(state) => &mut state.copies,
            Err(poisoned) => &mut poisoned.into_inner().copies,
        };
        if let Err(e) = after_copies(self.context.device, copies) {
            tracing::warn!("an activation shelf let go of mid-copy: {e}");
        }
    }
}

impl SavedTensorHooks for Shelf {
    fn pack(&self, t: &Tensor) -> std::result::Result<Packed, String> {
        let packed = || -> Result<Packed> {
            if self.stays(t)? {
                return Ok(Packed::Keep);
            }
            Ok(Packed::Ticket(self.store(t)?))
        };
        packed().map_err(|e| e.to_string())
    }

    fn unpack(&self, ticket: NonZeroU64) -> std::result::Result<Tensor, String> {
        self.take(ticket).map_err(|e| e.to_string())
    }
}

/// A copy of `t` on `device` in memory of the device's allocator (a new tensor, even where
/// `t` already lives there).
fn copy_to(t: &Tensor, device: Device) -> Result<Tensor> {
    let mut copy = Tensor::f_empty(t.size(), (t.kind(), device))?;
    tch::no_grad(|| copy.f_copy_(t))?;
    Ok(copy)
}

/// A flat copy of the CPU tensor `t`'s elements in memory libtorch's allocator does not
/// serve, so that the allocator's counts (the CPU's device memory) see them leave.
fn outside_the_allocator(t: &Tensor) -> Result<Tensor> {
    let bytes = t.numel() * t.kind().elt_size_in_bytes();
    // Words, so that every element kind is aligned.
    let mut words = vec![0u64; bytes.div_ceil(8)].into_boxed_slice();
    let data = words.as_mut_ptr() as *mut libc::c_void;
    // SAFETY: `words` spans `bytes` bytes, 8-aligned, and moves into the release closure, so
    // it lives exactly as long as the storage.
    let flat = unsafe { strata_ext::from_blob(data, t.numel() as i64, t.kind(), Box::new(move || drop(words))) }?;
    let mut copy = flat.f_view(t.size().as_slice())?;
    tch::no_grad(|| copy.f_copy_(t))?;
    Ok(flat)
}
