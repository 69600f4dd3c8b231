//! Weight gradients of linear layers computed after the input gradient (the zero-bubble
//! pipeline schedules): while a [`WeightGrads`] queue is active, a linear layer's backward
//! returns its input's (and bias's) gradient at once and queues what its weight's needs;
//! [`WeightGrads::run`] later adds `gᵀx` into the weight's `.grad` (the flat gradient
//! buffer), so the previous stage's wait is only the input gradient. Under autocast the
//! product runs in the autocast dtype and is added to the fp32 `.grad` as the cast's
//! backward would. Where the running unit replaces its linear layers (`module_replace`,
//! e.g. `OneDnnLinear`), the replacement computes the forward and the input gradient (a
//! linear layer without autograd is the product `a @ bᵀ`); the weight gradient stays an
//! in-place `addmm_` into `.grad`, which measured faster on the CPU than oneDNN's product
//! plus the add it needs.
//!
//! Owns the queue. Must not decide when the queued gradients run: the pipeline executor
//! runs them where its schedule places each weight-gradient operation.
use super::replace::LinearFn;
use crate::error::text;
use crate::{Error, Result};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// A linear layer's queued weight gradient: output gradient and input, both `[rows, ·]` in
/// the dtype the product ran in, and the weight whose `.grad` takes `gᵀx`.
struct Job {
    grad_out: Tensor,
    input: Tensor,
    weight: Tensor,
}

/// Queued weight gradients, by micro-batch.
#[derive(Default)]
pub struct WeightGrads {
    queued: Mutex<BTreeMap<usize, Vec<Job>>>,
}

impl WeightGrads {
    /// An empty queue, shareable between the pipeline executor and the layers.
    pub fn new() -> Arc<WeightGrads> {
        Arc::new(WeightGrads::default())
    }

    fn push(&self, micro: usize, job: Job) -> std::result::Result<(), String> {
        self.queued.lock().map_err(|e| e.to_string())?.entry(micro).or_default().push(job);
        Ok(())
    }

    /// Computes micro-batch `micro`'s queued weight gradients into the weights' `.grad`.
    pub fn run(&self, micro: usize) -> Result<()> {
        self.run_each(micro, |_| Ok(()))
    }

    /// The weights of micro-batch `micro`'s queued gradients, in the order they run.
    pub fn weights(&self, micro: usize) -> Result<Vec<Tensor>> {
        let queued = self.queued.lock().map_err(|e| Error::Engine(e.to_string()))?;
        Ok(queued.get(&micro).map_or_else(Vec::new, |jobs| jobs.iter().map(|j| j.weight.shallow_clone()).collect()))
    }

    /// [`WeightGrads::run`], calling `before(i)` ahead of the `i`-th gradient (in the order of
    /// [`WeightGrads::weights`]).
    pub fn run_each(&self, micro: usize, mut before: impl FnMut(usize) -> Result<()>) -> Result<()> {
        let jobs = self.queued.lock().map_err(|e| Error::Engine(e.to_string()))?.remove(&micro).unwrap_or_default();
        tch::no_grad(|| -> Result<()> {
            for (i, job) in jobs.into_iter().enumerate() {
                before(i)?;
                let mut grad = job.weight.grad();
                if job.input.kind() == grad.kind() {
                    let _ = grad.f_addmm_(&job.grad_out.f_tr()?, &job.input)?;
                } else {
                    let product = job.grad_out.f_tr()?.f_mm(&job.input)?;
                    let _ = grad.f_add_(&product.f_to_kind(grad.kind())?)?;
                }
            }
            Ok(())
        })
    }

    /// Weight gradients queued and not yet computed.
    pub fn pending(&self) -> usize {
        self.queued.lock().map_or(0, |q| q.values().map(Vec::len).sum())
    }
}

thread_local! {
    static ACTIVE: RefCell<Option<(Arc<WeightGrads>, usize)>> = const { RefCell::new(None) };
}

/// Whether linear layers' weight gradients are being queued ([`deferring`]).
pub fn active() -> bool {
    ACTIVE.with(|a| a.borrow().is_some())
}

/// Runs `f` (a micro-batch's forward or input-gradient backward) with linear layers'
/// weight gradients queued on `queue` under micro-batch `micro`.
pub fn deferring<R>(queue: &Arc<WeightGrads>, micro: usize, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let previous = ACTIVE.with(|a| a.borrow_mut().replace((queue.clone(), micro)));
    let result = f();
    ACTIVE.with(|a| *a.borrow_mut() = previous);
    result
}

struct DeferredLinear {
    queue: Arc<WeightGrads>,
    micro: usize,
    /// The weight leaf whose `.grad` the queued job fills.
    weight: Tensor,
    /// The autocast dtype the product runs in, if any.
    product_kind: Option<Kind>,
    /// The unit's replacement linear (without autocast), which computes the forward and
    /// the input gradient.
    product: Option<LinearFn>,
    /// The dtypes of the input and the bias, which their gradients take.
    input_kind: Kind,
    bias_kind: Option<Kind>,
    saved: Option<(Tensor, Tensor)>,
}

impl strata_ext::Function for DeferredLinear {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let in_kind = |t: &Tensor| super::cast(t, self.product_kind).map_err(text);
        let (x, w) = (in_kind(&inputs[0])?, in_kind(&inputs[1])?);
        let b = inputs.get(2).map(in_kind).transpose()?;
        let out = match &self.product {
            Some(product) => tch::no_grad(|| product(&x, &w, b.as_ref())).map_err(text)?,
            None => x.f_linear(&w, b.as_ref()).map_err(text)?,
        };
        self.saved = Some((x, w));
        Ok(vec![out])
    }

    fn backward(&mut self, grads: &[Tensor]) -> std::result::Result<Vec<Tensor>, String> {
        let (x, w) = self.saved.take().ok_or("deferred linear: backward twice")?;
        // oneDNN reads the gradient as rows; it nearly always comes contiguous.
        let g = &grads[0].f_contiguous().map_err(text)?;
        let grad_x = match &self.product {
            Some(product) => tch::no_grad(|| Ok::<_, Error>(product(g, &w.f_tr()?, None)?.f_to_kind(self.input_kind)?)),
            None => g.f_matmul(&w).and_then(|t| t.f_to_kind(self.input_kind)).map_err(Error::from),
        }
        .map_err(text)?;
        let (rows_out, rows_in) = (*g.size().last().unwrap_or(&1), *x.size().last().unwrap_or(&1));
        let job = Job {
            grad_out: g.f_reshape([-1, rows_out]).map_err(text)?,
            input: x.f_reshape([-1, rows_in]).map_err(text)?,
            weight: self.weight.shallow_clone(),
        };
        self.queue.push(self.micro, job)?;
        let mut out = vec![grad_x, Tensor::new()];
        if let Some(kind) = self.bias_kind {
            let dims: Vec<i64> = (0..g.dim() as i64 - 1).collect();
            out.push(
                g.f_sum_dim_intlist(dims.as_slice(), false, g.kind()).and_then(|t| t.f_to_kind(kind)).map_err(text)?,
            );
        }
        Ok(out)
    }
}

/// `x @ w.T + b` with `w`'s gradient queued, when a queue is active and `w` is a leaf that
/// takes a gradient; `None` otherwise.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Option<Result<Tensor>> {
    let (queue, micro) = ACTIVE.with(|a| a.borrow().clone())?;
    if !w.requires_grad() || !w.is_leaf() || !w.grad().defined() {
        return None;
    }
    let product_kind = crate::compute::product_kind();
    let f = DeferredLinear {
        queue,
        micro,
        weight: w.shallow_clone(),
        product_kind,
        // As `layers::linear` has it: replacements run where no autocast does.
        product: product_kind.is_none().then(|| crate::compute::replaced(|r| r.linear(x.kind()))).flatten(),
        input_kind: x.kind(),
        bias_kind: b.map(Tensor::kind),
        saved: None,
    };
    let mut inputs = vec![x, w];
    inputs.extend(b);
    Some(strata_ext::apply_function(f, &inputs).map(|mut v| v.remove(0)).map_err(Error::from))
}
