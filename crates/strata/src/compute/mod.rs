//! Compute methods that act inside a rank, on a unit's forward: mixed precision
//! (`amp_native`), fp8 linear layers, replaced modules, activation recomputation; and the
//! loss scaler.
//!
//! Owns: each unit's [`UnitCompute`] policy and the context that carries it to the layer
//! functions of `model::layers` while the engine runs that unit (a thread-local, so units
//! stay plain functions of their parameters). Must not own storage or the execution order:
//! the engine sets the context around each unit's forward and recomputation.
pub mod deferred;
pub mod fp8;
pub mod replace;
pub mod scaler;
mod weight_cast;

use crate::Result;
use fp8::SharedFp8;
use replace::Replacements;
use std::cell::RefCell;
use std::sync::Arc;
use tch::{Kind, Tensor};

/// The values of one-element tensors on one GPU, being copied into page-locked host memory
/// behind the work queued so far: the host queues more (a step's update) and waits for the
/// copy alone, so the device still has work when the host starts the next step, where a
/// plain read would let it drain (as fp8's read of its amaxes after the update still does).
/// Elsewhere (the CPU, several devices, a build without CUDA) the values are
/// read when the read starts.
pub enum ScalarRead {
    /// The values, already read.
    Ready(Vec<f64>),
    /// A copy queued on the GPU's current stream.
    Queued {
        /// The f64 values in page-locked host memory, valid once `copied` has completed.
        host: Tensor,
        /// Recorded after the copy, to wait for it alone.
        copied: strata_ext::cuda::Event,
    },
}

impl ScalarRead {
    /// Starts reading `values`: queued behind the device's work when they all lie on one
    /// GPU of a CUDA build, read at once otherwise.
    pub fn start(values: &[Tensor]) -> Result<ScalarRead> {
        let device = values.first().map(Tensor::device);
        let (Some(tch::Device::Cuda(index)), true) =
            (device, strata_ext::cuda::is_built() && values.iter().all(|v| Some(v.device()) == device))
        else {
            return Ok(ScalarRead::Ready(read_scalars(values)?));
        };
        ScalarRead::start_stacked(&stack_scalars(values)?, index)
    }

    /// [`ScalarRead::start`] of values already stacked into one f64 tensor on GPU `index`.
    pub fn start_stacked(on_device: &Tensor, index: usize) -> Result<ScalarRead> {
        // A non-blocking copy to the CPU lands in page-locked memory; whatever reuses
        // `on_device`'s memory later runs on the same stream, after the copy.
        let host = on_device.f_to_device_(tch::Device::Cpu, Kind::Double, true, false)?;
        let copied = strata_ext::cuda::Event::new(false)?;
        copied.record(&strata_ext::cuda::Stream::current(index)?)?;
        Ok(ScalarRead::Queued { host, copied })
    }

    /// The values, once the device has copied them.
    pub fn finish(self) -> Result<Vec<f64>> {
        match self {
            ScalarRead::Ready(values) => Ok(values),
            ScalarRead::Queued { host, copied } => {
                copied.synchronize()?;
                Ok(Vec::<f64>::try_from(host)?)
            }
        }
    }
}

/// One-element tensors of one device as one f64 vector there, to be read in one transfer.
pub fn stack_scalars(values: &[Tensor]) -> Result<Tensor> {
    let rows =
        values.iter().map(|v| v.f_reshape([1])?.f_to_kind(Kind::Double)).collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Tensor::f_cat(&rows, 0)?)
}

/// The values of one-element tensors, read back in one transfer per device: each read
/// from a GPU waits for it to finish what was queued, so a step reads what it must at once.
pub fn read_scalars(values: &[Tensor]) -> Result<Vec<f64>> {
    let mut out = vec![0.0; values.len()];
    let mut done = vec![false; values.len()];
    for first in 0..values.len() {
        if done[first] {
            continue;
        }
        let device = values[first].device();
        let same: Vec<usize> = (first..values.len()).filter(|&i| !done[i] && values[i].device() == device).collect();
        let parts: Vec<Tensor> = same.iter().map(|&i| values[i].shallow_clone()).collect();
        let read = Vec::<f64>::try_from(stack_scalars(&parts)?.f_to_device(tch::Device::Cpu)?)?;
        for (&i, v) in same.iter().zip(read) {
            out[i] = v;
            done[i] = true;
        }
    }
    Ok(out)
}

/// What a unit's forward computes with.
#[derive(Clone, Default)]
pub struct UnitCompute {
    /// `amp_native`: matrix products and attention in this dtype; norms, softmax and the
    /// loss in fp32; parameters stay as they are (fp32 masters).
    pub autocast: Option<Kind>,
    /// The unit runs on CUDA: autocast is libtorch's, not the layers' own casts.
    pub device_autocast: bool,
    /// `module_replace`: implementations used instead of the reference composites.
    pub replacements: Replacements,
    /// `fp8`: the unit's delayed-scaling state.
    pub fp8: Option<SharedFp8>,
    /// `checkpoint`: keep no activations in forward; recompute them in backward.
    pub recompute: bool,
}

impl UnitCompute {
    /// Whether the policy changes nothing.
    pub fn is_plain(&self) -> bool {
        self.autocast.is_none() && self.fp8.is_none() && !self.recompute && self.replacements.is_empty()
    }
}

/// The policy of the unit running now, with what its forward has done so far.
struct Active {
    policy: Arc<UnitCompute>,
    recomputing: bool,
    /// fp8 linear layers called so far in this forward (their slot in the unit's state).
    fp8_calls: usize,
    /// Storage addresses of the weights this unit computes in fp8.
    fp8_weights: Vec<usize>,
    /// The slots of the unit's weights in its flat gradient buffer, by storage address.
    grad_slots: Vec<(usize, Tensor)>,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// What the engine tells a unit's forward about its weights: the storage addresses of
/// those computed in fp8 (those fp8's include/exclude and shape rules admit), and the slots
/// in the flat gradient buffer of those whose gradients may be converted into place there
/// ([`weight_for_product`]), each by its weight's storage address.
#[derive(Default)]
pub struct UnitWeights {
    /// Storage addresses of the weights computed in fp8.
    pub fp8: Vec<usize>,
    /// Each weight's slot in the flat gradient buffer, by the weight's storage address.
    pub grad_slots: Vec<(usize, Tensor)>,
}

/// Runs `f` (a unit's forward) under `policy`; `recomputing` marks the second forward of a
/// checkpointed unit, which must not record fp8 statistics again.
pub fn run<R>(
    policy: &Arc<UnitCompute>,
    weights: UnitWeights,
    recomputing: bool,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let device_autocast = policy.autocast.filter(|_| policy.device_autocast);
    if let Some(kind) = device_autocast {
        strata_ext::cuda_autocast(true, kind)?;
    }
    let active = Active {
        policy: policy.clone(),
        recomputing,
        fp8_calls: 0,
        fp8_weights: weights.fp8,
        grad_slots: weights.grad_slots,
    };
    let previous = ACTIVE.with(|a| a.borrow_mut().replace(active));
    let result = f();
    ACTIVE.with(|a| *a.borrow_mut() = previous);
    if let Some(kind) = device_autocast {
        strata_ext::cuda_autocast(false, kind)?;
    }
    result
}

fn with_active<R>(f: impl FnOnce(Option<&mut Active>) -> R) -> R {
    ACTIVE.with(|a| f(a.borrow_mut().as_mut()))
}

/// The dtype the layers themselves cast matrix products to (CPU `amp_native`).
pub fn autocast_kind() -> Option<Kind> {
    with_active(|a| a.and_then(|a| a.policy.autocast.filter(|_| !a.policy.device_autocast)))
}

/// `x` in `kind`, if one is given and `x` is not in it already.
pub fn cast(x: &Tensor, kind: Option<Kind>) -> Result<Tensor> {
    Ok(match kind {
        Some(k) if x.kind() != k => x.f_to_kind(k)?,
        _ => x.shallow_clone(),
    })
}

/// Weight `w` of a matrix product in `kind`, the dtype products compute in. An fp32 master
/// weight with a slot in the running unit's gradient buffer is cast by a node whose
/// backward converts its gradient straight into the slot (`weight_cast`). A slot serves one
/// cast per forward: autograd sums a weight's gradients from all its uses before it keeps
/// one, so a second node writing the same slot would overwrite the first's; later uses get
/// the plain cast, whose gradients autograd adds to the slot's.
pub fn weight_for_product(w: &Tensor, kind: Kind) -> Result<Tensor> {
    match grad_slot(w, kind) {
        Some(slot) => weight_cast::CastWeight::apply(w, kind, slot),
        None => cast(w, Some(kind)),
    }
}

/// The slot in the running unit's gradient buffer of fp32 master weight `w`, computing in
/// `kind`, given away once per forward (see [`weight_for_product`]).
fn grad_slot(w: &Tensor, kind: Kind) -> Option<Tensor> {
    if w.kind() != Kind::Float || kind == Kind::Float || !w.requires_grad() || !w.is_leaf() {
        return None;
    }
    let address = w.data_ptr() as usize;
    with_active(|a| {
        let slots = &mut a?.grad_slots;
        let at = slots.iter().position(|(at, s)| *at == address && s.size() == w.size())?;
        Some(slots.swap_remove(at).1)
    })
}

/// `x @ w.T + b` for an fp32 master weight (and bias) on a GPU, computing in `kind` under
/// the device's autocast, where the running unit has `FusedLinearGrad` for `kind`: one node
/// whose backward writes the weight's gradient in fp32 (into its slot where fresh) and the
/// bias's in one product (`weight_cast::ProductLinear`); `None` where it does not apply.
pub fn product_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, kind: Kind) -> Option<Result<Tensor>> {
    let master = |t: &Tensor| t.kind() == Kind::Float && t.device() == x.device();
    let applies = x.device().is_cuda()
        && master(w)
        && w.dim() == 2
        && w.requires_grad()
        && w.is_leaf()
        && b.is_none_or(|b| master(b) && b.dim() == 1)
        && replaced(|r| r.linear_grad(kind).then_some(())).is_some();
    applies.then(|| weight_cast::ProductLinear::apply(x, w, b, kind, grad_slot(w, kind)))
}

/// The dtype matrix products compute in under either autocast (the layers' own or
/// libtorch's on a device); `None` without one.
pub fn product_kind() -> Option<Kind> {
    with_active(|a| a.and_then(|a| a.policy.autocast))
}

/// Whether any autocast (the layers' own or libtorch's) is on: norms and the loss then
/// compute in fp32.
pub fn autocast_on() -> bool {
    with_active(|a| a.is_some_and(|a| a.policy.autocast.is_some()))
}

/// The running unit's replacement that `pick` selects (none outside a unit or without
/// `module_replace`).
pub fn replaced<T>(pick: impl FnOnce(&Replacements) -> Option<T>) -> Option<T> {
    with_active(|a| a.and_then(|a| pick(&a.policy.replacements)))
}

/// Whether the running unit computes products of weight `w` in fp8.
pub fn computes_in_fp8(w: &Tensor) -> bool {
    with_active(|a| a.is_some_and(|a| a.policy.fp8.is_some() && a.fp8_weights.contains(&(w.data_ptr() as usize))))
}

/// `x @ w.T + b` in fp8 when the running unit computes this weight in fp8; `None` when not.
pub fn fp8_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Option<Result<Tensor>> {
    let (state, slot, record) = with_active(|a| {
        let a = a?;
        let state = a.policy.fp8.clone()?;
        if !a.fp8_weights.contains(&(w.data_ptr() as usize)) {
            return None;
        }
        a.fp8_calls += 1;
        Some((state, a.fp8_calls - 1, !a.recomputing))
    })?;
    let out_kind = autocast_kind().unwrap_or(x.kind());
    Some(fp8::linear(&state, slot, record, x, w, b, out_kind))
}
