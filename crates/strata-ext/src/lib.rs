//! Safe Rust over `csrc/strata_ext.cpp`: the libtorch features `tch` does not expose.
//!
//! Owns: backward and `grad` with given upstream gradients, setting `.grad`, tensor hooks,
//! saved-tensor hooks ([`saved_tensors`]),
//! autograd functions whose forward and backward are Rust closures, resizing (freeing and
//! re-filling) a tensor's storage, the fused Adam/AdamW/SGD kernels, CPU kernels for GELU,
//! RMSNorm, SwiGLU and rotary positions, oneDNN's inner product ([`onednn`]), libtorch's
//! Kineto traces ([`kernel_trace`]), counts of libtorch's CPU allocations ([`cpu_memory`]),
//! CUDA autocast ([`cuda_autocast`]), CUDA streams, events and allocator statistics
//! ([`cuda`]), NCCL's [`nccl::Communicator`] and PyTorch's c10d [`c10d::TcpStore`].
//! Must not hold policy: callers decide what to free, when to hook and how to update; this
//! crate only makes those calls possible and safe.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use tch::Tensor;
use torch_sys::C_tensor;

/// A failure reported by libtorch (or by a Rust callback run from inside it).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ExtError(pub String);

pub type Result<T> = std::result::Result<T, ExtError>;

type TensorPtr = *mut C_tensor;
type TensorCallback = extern "C" fn(*mut c_void, *const TensorPtr, usize, *mut c_void) -> c_int;

extern "C" {
    fn strata_last_error() -> *const c_char;
    fn strata_set_error(message: *const c_char);
    fn strata_tensor_list_push(list: *mut c_void, t: *const C_tensor);
    fn strata_backward(outputs: *const TensorPtr, grads: *const TensorPtr, n: usize, retain: c_int) -> c_int;
    fn strata_grad(
        outputs: *const TensorPtr,
        grads: *const TensorPtr,
        n_outputs: usize,
        inputs: *const TensorPtr,
        n_inputs: usize,
        retain: c_int,
        create: c_int,
        allow_unused: c_int,
        results: *mut TensorPtr,
    ) -> c_int;
    fn strata_set_grad(t: TensorPtr, grad: *const C_tensor) -> c_int;
    fn strata_copy_non_blocking(dst: TensorPtr, src: *const C_tensor) -> c_int;
    fn strata_register_hook(
        t: TensorPtr,
        cb: TensorCallback,
        data: *mut c_void,
        drop: extern "C" fn(*mut c_void),
        handle: *mut u64,
    ) -> c_int;
    fn strata_remove_hook(t: TensorPtr, handle: u64) -> c_int;
    fn strata_custom_function(
        inputs: *const TensorPtr,
        n: usize,
        fwd: TensorCallback,
        bwd: TensorCallback,
        data: *mut c_void,
        drop: extern "C" fn(*mut c_void),
        sink: extern "C" fn(*mut c_void, TensorPtr),
        list: *mut c_void,
    ) -> c_int;
    fn strata_storage_resize(t: TensorPtr, nbytes: usize) -> c_int;
    fn strata_storage_nbytes(t: *const C_tensor, nbytes: *mut usize) -> c_int;
    fn strata_storage_adopt(
        t: TensorPtr,
        data: *mut c_void,
        nbytes: usize,
        release: extern "C" fn(*mut c_void),
        context: *mut c_void,
    ) -> c_int;
    fn strata_storage_set_nbytes(t: TensorPtr, nbytes: usize) -> c_int;
    fn strata_storage_swap(a: TensorPtr, b: TensorPtr) -> c_int;
    fn strata_onednn_available(yes: *mut c_int) -> c_int;
    fn strata_grad_fn_name(t: *const C_tensor, name: *mut c_char, capacity: usize) -> c_int;
    fn strata_onednn_linear(x: *const C_tensor, w: *const C_tensor, b: *const C_tensor, out: *mut TensorPtr) -> c_int;
    fn strata_gelu_tanh(x: *const C_tensor, out: *mut TensorPtr) -> c_int;
    fn strata_swiglu(gate: *const C_tensor, up: *const C_tensor, out: *mut TensorPtr) -> c_int;
    fn strata_rms_norm(x: *const C_tensor, weight: *const C_tensor, eps: f64, out: *mut TensorPtr) -> c_int;
    fn strata_rotary(x: *const C_tensor, cos: *const C_tensor, sin: *const C_tensor, out: *mut TensorPtr) -> c_int;
    fn strata_cross_entropy(
        logits: *const C_tensor,
        targets: *const C_tensor,
        ignore: i64,
        out: *mut TensorPtr,
    ) -> c_int;
    fn strata_add_norm(
        x: *const C_tensor,
        r: *const C_tensor,
        weight: *const C_tensor,
        bias: *const C_tensor,
        eps: f64,
        out_kind: c_int,
        sum: *mut TensorPtr,
        out: *mut TensorPtr,
    ) -> c_int;
    fn strata_attention(
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        sinks: *const C_tensor,
        scale: f64,
        cap: f64,
        window: i64,
        out: *mut TensorPtr,
    ) -> c_int;
    fn strata_cuda_compile_kernels(arch: *const c_char) -> c_int;
    fn strata_fp8_cast(
        x: *const C_tensor,
        scale: f64,
        scale_at: *const C_tensor,
        row_scale: *const C_tensor,
        col_scale: *const C_tensor,
        e5m2: c_int,
        transposed: c_int,
        q: *mut TensorPtr,
        qt: *mut TensorPtr,
        amax: *mut TensorPtr,
    ) -> c_int;
    fn strata_row_col_amax(x: *const C_tensor, rows: *mut TensorPtr, cols: *mut TensorPtr) -> c_int;
    fn strata_linear_weight_grad(
        g: *const C_tensor,
        x: *const C_tensor,
        dw: *const C_tensor,
        db: *const C_tensor,
        accumulate: c_int,
        served: *mut c_int,
    ) -> c_int;
    fn strata_cpu_memory_account(bytes: i64) -> c_int;
    fn strata_from_blob(
        data: *mut c_void,
        numel: i64,
        dtype: c_int,
        release: extern "C" fn(*mut c_void),
        context: *mut c_void,
        out: *mut TensorPtr,
    ) -> c_int;
    fn strata_storage_id(t: *const C_tensor, id: *mut usize) -> c_int;
    fn strata_storage_use_count(t: *const C_tensor, count: *mut usize) -> c_int;
    fn strata_tensor_use_count(t: *const C_tensor, count: *mut usize) -> c_int;
    fn strata_saved_hooks_push(
        pack: extern "C" fn(*mut c_void, *const C_tensor, *mut u64) -> c_int,
        unpack: extern "C" fn(*mut c_void, u64, *mut c_void) -> c_int,
        data: *mut c_void,
        drop: extern "C" fn(*mut c_void),
    ) -> c_int;
    fn strata_saved_hooks_pop() -> c_int;
    fn strata_c10d_store_new(
        host: *const c_char,
        port: c_int,
        is_server: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
    ) -> c_int;
    fn strata_c10d_store_free(s: *mut c_void);
    fn strata_c10d_store_port(s: *mut c_void, port: *mut c_int) -> c_int;
    fn strata_free_bytes(p: *mut u8);
    fn strata_c10d_set(s: *mut c_void, key: *const c_char, klen: usize, v: *const u8, vlen: usize) -> c_int;
    fn strata_c10d_get(
        s: *mut c_void,
        key: *const c_char,
        klen: usize,
        timeout_ms: i64,
        out: *mut *mut u8,
        len: *mut usize,
    ) -> c_int;
    fn strata_c10d_add(s: *mut c_void, key: *const c_char, klen: usize, delta: i64, out: *mut i64) -> c_int;
    fn strata_c10d_compare_set(
        s: *mut c_void,
        key: *const c_char,
        klen: usize,
        e: *const u8,
        elen: usize,
        d: *const u8,
        dlen: usize,
        out: *mut *mut u8,
        len: *mut usize,
    ) -> c_int;
    fn strata_c10d_wait(
        s: *mut c_void,
        keys: *const *const c_char,
        lens: *const usize,
        n: usize,
        timeout_ms: i64,
    ) -> c_int;
    fn strata_c10d_check(
        s: *mut c_void,
        keys: *const *const c_char,
        lens: *const usize,
        n: usize,
        out: *mut c_int,
    ) -> c_int;
    fn strata_cpu_memory_track() -> c_int;
    fn strata_cuda_capability(device: c_int, major: *mut c_int, minor: *mut c_int) -> c_int;
    fn strata_cuda_device_name(device: c_int, name: *mut c_char, len: c_int) -> c_int;
    fn strata_cpu_memory_stats(current: *mut i64, peak: *mut i64) -> c_int;
    fn strata_cpu_memory_reset_peak() -> c_int;
    fn strata_autocast_set(device_type: c_int, enabled: c_int, dtype: c_int) -> c_int;
    fn strata_fused_adam(
        params: *const TensorPtr,
        grads: *const TensorPtr,
        exp_avgs: *const TensorPtr,
        exp_avg_sqs: *const TensorPtr,
        steps: *const TensorPtr,
        n: usize,
        lr: f64,
        lr_tensor: *const C_tensor,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        decoupled: c_int,
        maximize: c_int,
        grad_scale: *const C_tensor,
        found_inf: *const C_tensor,
    ) -> c_int;
    fn strata_fused_sgd(
        params: *const TensorPtr,
        grads: *const TensorPtr,
        momentum_buffers: *const TensorPtr,
        n: usize,
        n_buffers: usize,
        weight_decay: f64,
        momentum: f64,
        lr: f64,
        lr_tensor: *const C_tensor,
        dampening: f64,
        nesterov: c_int,
        maximize: c_int,
        is_first_step: c_int,
        grad_scale: *const C_tensor,
        found_inf: *const C_tensor,
    ) -> c_int;
    fn strata_cuda_is_built() -> c_int;
    fn strata_cuda_memory_stats(device: c_int, stats: *mut i64) -> c_int;
    fn strata_cuda_reset_peak_stats(device: c_int) -> c_int;
    fn strata_cuda_empty_cache() -> c_int;
    fn strata_cuda_host_register(data: *mut c_void, bytes: usize) -> c_int;
    fn strata_cuda_host_unregister(data: *mut c_void) -> c_int;
    fn strata_cuda_stream_from_pool(device: c_int, high_priority: c_int, packed: *mut i64) -> c_int;
    fn strata_cuda_current_stream(device: c_int, packed: *mut i64) -> c_int;
    fn strata_cuda_set_current_stream(packed: *const i64) -> c_int;
    fn strata_cuda_stream_synchronize(packed: *const i64) -> c_int;
    fn strata_cuda_event_new(enable_timing: c_int, event: *mut *mut c_void) -> c_int;
    fn strata_cuda_event_free(event: *mut c_void);
    fn strata_cuda_graph_begin(device: c_int, out: *mut *mut c_void) -> c_int;
    fn strata_cuda_graph_end(graph: *mut c_void, keep: c_int) -> c_int;
    fn strata_cuda_graph_replay(graph: *mut c_void) -> c_int;
    fn strata_cuda_graph_free(graph: *mut c_void);
    fn strata_cuda_event_record(event: *mut c_void, packed: *const i64) -> c_int;
    fn strata_cuda_event_wait(event: *mut c_void, packed: *const i64) -> c_int;
    fn strata_cuda_event_synchronize(event: *mut c_void) -> c_int;
    fn strata_cuda_event_elapsed_ms(start: *mut c_void, end: *mut c_void, ms: *mut f32) -> c_int;
    fn strata_cuda_event_query(event: *mut c_void, done: *mut c_int) -> c_int;
    fn strata_cuda_count_syncs(on: c_int) -> c_int;
    fn strata_kineto_start(cuda: c_int) -> c_int;
    fn strata_kineto_save(path: *const c_char) -> c_int;
    fn strata_cuda_syncs_counted() -> i64;
    fn strata_nccl_unique_id(id: *mut u8) -> c_int;
    fn strata_nccl_comm_init(id: *const u8, nranks: c_int, rank: c_int, device: c_int, comm: *mut *mut c_void)
        -> c_int;
    fn strata_nccl_comm_destroy(comm: *mut c_void);
    fn strata_nccl_collective(
        comm: *mut c_void,
        kind: c_int,
        tensors: *const TensorPtr,
        n: usize,
        op: c_int,
        peer: c_int,
        nranks: c_int,
        event: *mut *mut c_void,
    ) -> c_int;
}

fn check(code: c_int) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: the C++ side always returns a valid NUL-terminated thread-local string.
    let message = unsafe { CStr::from_ptr(strata_last_error()) };
    Err(ExtError(message.to_string_lossy().into_owned()))
}

fn ptrs<T: std::borrow::Borrow<Tensor>>(tensors: &[T]) -> Vec<TensorPtr> {
    tensors.iter().map(|t| t.borrow().as_ptr() as TensorPtr).collect()
}

fn optional_ptr(t: Option<&Tensor>) -> *const C_tensor {
    t.map_or(std::ptr::null(), |t| t.as_ptr())
}

/// Runs backward from `outputs`, seeding each with the matching upstream gradient, and
/// accumulates into the `.grad` of every leaf reached (`torch.autograd.backward`).
pub fn backward(outputs: &[&Tensor], grads: &[&Tensor], retain_graph: bool) -> Result<()> {
    if outputs.len() != grads.len() {
        return Err(ExtError(format!("backward: {} outputs but {} gradients", outputs.len(), grads.len())));
    }
    let (o, g) = (ptrs(outputs), ptrs(grads));
    // SAFETY: the pointers come from live tensors borrowed for the duration of the call.
    check(unsafe { strata_backward(o.as_ptr(), g.as_ptr(), o.len(), retain_graph as c_int) })
}

/// Options of [`grad`], as in `torch.autograd.grad`.
#[derive(Clone, Copy, Debug, Default)]
pub struct GradOptions {
    pub retain_graph: bool,
    pub create_graph: bool,
    pub allow_unused: bool,
}

/// Gradients of `outputs` (seeded with `grads`) with respect to `inputs`, returned rather
/// than accumulated. `None` for an input that got no gradient when `allow_unused` is set.
pub fn grad(
    outputs: &[&Tensor],
    grads: &[&Tensor],
    inputs: &[&Tensor],
    options: GradOptions,
) -> Result<Vec<Option<Tensor>>> {
    if outputs.len() != grads.len() {
        return Err(ExtError(format!("grad: {} outputs but {} gradients", outputs.len(), grads.len())));
    }
    let (o, g, i) = (ptrs(outputs), ptrs(grads), ptrs(inputs));
    let mut results: Vec<TensorPtr> = vec![std::ptr::null_mut(); i.len()];
    // SAFETY: live borrowed tensors; `results` has one slot per input, filled with owned
    // heap tensors that we take over below.
    check(unsafe {
        strata_grad(
            o.as_ptr(),
            g.as_ptr(),
            o.len(),
            i.as_ptr(),
            i.len(),
            options.retain_graph as c_int,
            options.create_graph as c_int,
            options.allow_unused as c_int,
            results.as_mut_ptr(),
        )
    })?;
    Ok(results
        .into_iter()
        .map(|p| {
            // SAFETY: each pointer is a fresh `new at::Tensor` owned by nobody else.
            let t = unsafe { Tensor::from_ptr(p) };
            t.defined().then_some(t)
        })
        .collect())
}

/// Makes `grad` the `.grad` of `tensor` (or clears it). Autograd accumulates into an
/// existing `.grad` in place, so a view into a flat buffer keeps receiving gradients.
pub fn set_grad(tensor: &Tensor, grad: Option<&Tensor>) -> Result<()> {
    // SAFETY: both tensors are live for the call; the C++ side copies the handle.
    check(unsafe { strata_set_grad(tensor.as_ptr() as TensorPtr, optional_ptr(grad)) })
}

/// Writes `src` into `dst` without the host waiting where the copy runs on a GPU stream
/// (from page-locked host memory, or between devices): libtorch queues it on the current
/// stream of the GPU and returns.
///
/// # Safety
/// Until that stream has run the copy, nothing may write `src` or read or write `dst`
/// other than work queued after it on that stream (or made to wait for it), and neither
/// buffer may be freed.
pub unsafe fn copy_non_blocking(dst: &Tensor, src: &Tensor) -> Result<()> {
    // SAFETY: both tensors are live for the call; what happens after is the caller's
    // contract.
    check(unsafe { strata_copy_non_blocking(dst.as_ptr() as TensorPtr, src.as_ptr()) })
}

/// Resizes the storage behind `tensor` to `nbytes`. With 0 the memory is released while
/// the tensor (and all views of the same storage) stay valid objects; a later resize to the
/// full size gives fresh, uninitialised memory that the caller must fill before use.
///
/// # Safety
/// libtorch does not check a view's extent against its storage on access. Until the
/// storage holds at least the bytes every live view of it spans, no view may be read or
/// written (by any thread, or by an operation still in flight such as a collective).
pub unsafe fn resize_storage(tensor: &Tensor, nbytes: usize) -> Result<()> {
    // SAFETY: the tensor is live; the C++ side swaps the storage's data pointer. What the
    // views may do afterwards is the caller's contract.
    check(unsafe { strata_storage_resize(tensor.as_ptr() as TensorPtr, nbytes) })
}

/// Points the storage behind `tensor` (and every view of it) at memory the caller owns,
/// counting `nbytes` of it, and frees what it held; `release` runs once the storage goes.
///
/// # Safety
/// `data` must stay valid until `release` runs, and no view may be read or written beyond
/// the bytes the caller has made accessible there (libtorch does not check on access).
pub unsafe fn adopt_storage(tensor: &Tensor, data: *mut c_void, nbytes: usize, release: Release) -> Result<()> {
    let context = Box::into_raw(Box::new(release)) as *mut c_void;
    // SAFETY: the tensor is live; `context` is handed to `run_release` exactly once.
    let code = unsafe { strata_storage_adopt(tensor.as_ptr() as TensorPtr, data, nbytes, run_release, context) };
    if code != 0 {
        // The storage never took the memory: release it here.
        run_release(context);
        check(code)?;
    }
    Ok(())
}

/// Sets the bytes the storage behind `tensor` claims to hold, leaving its memory as it is.
///
/// # Safety
/// As [`resize_storage`]: no view may be used beyond what the memory really holds.
pub unsafe fn set_storage_nbytes(tensor: &Tensor, nbytes: usize) -> Result<()> {
    // SAFETY: the tensor is live; only the storage's byte count changes.
    check(unsafe { strata_storage_set_nbytes(tensor.as_ptr() as TensorPtr, nbytes) })
}

/// Exchanges the memory behind the storages of `a` and `b` (of one size and device):
/// every view of `a` then reads what the views of `b` read before, and the other way round.
///
/// # Safety
/// No operation may be reading or writing either storage (on any thread) during the call.
pub unsafe fn swap_storages(a: &Tensor, b: &Tensor) -> Result<()> {
    // SAFETY: both tensors are live; the caller keeps every other user away.
    check(unsafe { strata_storage_swap(a.as_ptr() as TensorPtr, b.as_ptr() as TensorPtr) })
}

/// An identity of the storage behind `tensor`, shared by all views of it (for counting a
/// buffer's bytes once however many views reach it).
pub fn storage_id(tensor: &Tensor) -> Result<usize> {
    let mut id = 0usize;
    // SAFETY: the tensor is live for the call; only the storage's address is read.
    check(unsafe { strata_storage_id(tensor.as_ptr(), &mut id) })?;
    Ok(id)
}

/// libtorch's `c10::ScalarType` code of `kind`.
fn scalar_type(kind: tch::Kind) -> Result<c_int> {
    use tch::Kind::*;
    Ok(match kind {
        Uint8 => 0,
        Int8 => 1,
        Int16 => 2,
        Int => 3,
        Int64 => 4,
        Half => 5,
        Float => 6,
        Double => 7,
        Bool => 11,
        BFloat16 => 15,
        other => return Err(ExtError(format!("no scalar type code for {other:?} here"))),
    })
}

type Release = Box<dyn FnOnce() + Send>;

extern "C" fn run_release(context: *mut c_void) {
    // SAFETY: `context` is the box `from_blob` leaked, handed back exactly once.
    let release = unsafe { Box::from_raw(context as *mut Release) };
    release();
}

/// A 1-D CPU tensor of `numel` elements of `kind` over memory at `data` that the caller
/// owns; `release` runs once the last tensor sharing its storage is dropped.
///
/// # Safety
/// `data` must point to at least `numel` elements of `kind`, suitably aligned, valid and
/// used by nothing else until `release` runs.
pub unsafe fn from_blob(data: *mut c_void, numel: i64, kind: tch::Kind, release: Release) -> Result<Tensor> {
    let dtype = scalar_type(kind)?;
    let context = Box::into_raw(Box::new(release)) as *mut c_void;
    let mut out: TensorPtr = std::ptr::null_mut();
    // SAFETY: the caller vouches for `data`; `context` is handed to `run_release` once.
    let code = unsafe { strata_from_blob(data, numel, dtype, run_release, context, &mut out) };
    if code != 0 {
        // libtorch never took the memory: release it here.
        run_release(context);
        check(code)?;
    }
    // SAFETY: a fresh `new at::Tensor` owned by nobody else.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// The name of the autograd node that made `tensor` (`AddmmBackward0`, a custom
/// function's type, …); `None` for leaves and tensors outside any graph.
pub fn grad_fn_name(tensor: &Tensor) -> Result<Option<String>> {
    let mut name = [0 as c_char; 256];
    // SAFETY: the tensor is live; the name is written, zero-terminated, within `name`.
    check(unsafe { strata_grad_fn_name(tensor.as_ptr(), name.as_mut_ptr(), name.len()) })?;
    // SAFETY: zero-terminated by snprintf.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    Ok((!name.is_empty()).then_some(name))
}

/// Bytes currently allocated to the storage behind `tensor`.
pub fn storage_nbytes(tensor: &Tensor) -> Result<usize> {
    let mut n = 0usize;
    // SAFETY: the tensor is live for the call.
    check(unsafe { strata_storage_nbytes(tensor.as_ptr(), &mut n) })?;
    Ok(n)
}

/// How many tensors (and other holders, such as autograd's saved values) share the storage
/// behind `tensor`, this one included.
pub fn storage_use_count(tensor: &Tensor) -> Result<usize> {
    let mut n = 0usize;
    // SAFETY: the tensor is live for the call.
    check(unsafe { strata_storage_use_count(tensor.as_ptr(), &mut n) })?;
    Ok(n)
}

/// How many handles (this one included) and autograd nodes hold the tensor `tensor` is a
/// handle of; views and detached tensors are other tensors ([`storage_use_count`]).
pub fn tensor_use_count(tensor: &Tensor) -> Result<usize> {
    let mut n = 0usize;
    // SAFETY: the tensor is live for the call.
    check(unsafe { strata_tensor_use_count(tensor.as_ptr(), &mut n) })?;
    Ok(n)
}

/// Saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`): where the values autograd
/// saves for backward live between a forward and its backward.
pub mod saved_tensors {
    use super::*;
    use std::marker::PhantomData;
    use std::num::NonZeroU64;
    use std::sync::Arc;

    /// What [`SavedTensorHooks::pack`] did with a saved tensor.
    pub enum Packed {
        /// Keep the tensor itself (detached from its graph).
        Keep,
        /// The hooks hold its value; [`SavedTensorHooks::unpack`] gives it back for this ticket.
        Ticket(NonZeroU64),
    }

    /// Where saved values go. `pack` runs on the thread that pushed the hooks, during
    /// forward, with gradients off; `unpack` runs wherever backward runs (libtorch's device
    /// threads for a GPU), possibly more than once per ticket.
    pub trait SavedTensorHooks: Send + Sync + 'static {
        fn pack(&self, tensor: &Tensor) -> std::result::Result<Packed, String>;
        fn unpack(&self, ticket: NonZeroU64) -> std::result::Result<Tensor, String>;
    }

    type Shared = Arc<dyn SavedTensorHooks>;

    /// Saved tensors of this thread go through the hooks until this is dropped.
    pub struct Scope {
        /// Popped on the thread that pushed.
        _thread_bound: PhantomData<*const ()>,
    }

    impl Drop for Scope {
        fn drop(&mut self) {
            // SAFETY: pops the entry this scope pushed on this thread (scopes nest).
            let _ = unsafe { strata_saved_hooks_pop() };
        }
    }

    /// Routes this thread's saved tensors through `hooks` while the returned scope lives.
    pub fn push(hooks: Shared) -> Result<Scope> {
        let data = Box::into_raw(Box::new(hooks)) as *mut c_void;
        // SAFETY: ownership of `data` passes to the C++ sink, which calls `drop_boxed` once.
        check(unsafe { strata_saved_hooks_push(pack, unpack, data, drop_boxed::<Shared>) })?;
        Ok(Scope { _thread_bound: PhantomData })
    }

    fn report(message: String) -> c_int {
        let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
        // SAFETY: a valid C string, copied by the callee.
        unsafe { strata_set_error(c.as_ptr()) };
        1
    }

    extern "C" fn pack(data: *mut c_void, tensor: *const C_tensor, ticket: *mut u64) -> c_int {
        // SAFETY: `data` is the live `Shared` of `push`; `tensor` is valid for the call and
        // the clone takes its own reference; `ticket` is writable.
        let hooks = unsafe { &*(data as *const Shared) };
        let t = unsafe { Tensor::clone_from_ptr(tensor as TensorPtr) };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hooks.pack(&t))) {
            Ok(Ok(packed)) => {
                let code = match packed {
                    Packed::Keep => 0,
                    Packed::Ticket(n) => n.get(),
                };
                unsafe { *ticket = code };
                0
            }
            Ok(Err(message)) => report(message),
            Err(_) => report("saved-tensor pack hook panicked".into()),
        }
    }

    extern "C" fn unpack(data: *mut c_void, ticket: u64, out: *mut c_void) -> c_int {
        // SAFETY: as in `pack`; `out` is the C++ vector the value is pushed into.
        let hooks = unsafe { &*(data as *const Shared) };
        let Some(ticket) = NonZeroU64::new(ticket) else { return report("saved-tensor ticket 0".into()) };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hooks.unpack(ticket))) {
            Ok(Ok(t)) => {
                // SAFETY: `out` is the caller's vector; the push copies the handle.
                unsafe { strata_tensor_list_push(out, t.as_ptr()) };
                0
            }
            Ok(Err(message)) => report(message),
            Err(_) => report("saved-tensor unpack hook panicked".into()),
        }
    }
}

// ---- Rust closures called from libtorch ------------------------------------------------

type Callback<'a> = dyn FnMut(&[Tensor]) -> std::result::Result<Vec<Tensor>, String> + Send + 'a;
type BoxedFn = Box<Callback<'static>>;

extern "C" fn drop_boxed<T>(data: *mut c_void) {
    // SAFETY: `data` was produced by `Box::into_raw(Box<T>)` and is dropped exactly once,
    // by the C++ holder's destructor.
    drop(unsafe { Box::from_raw(data as *mut T) });
}

/// Runs `f` on the tensors libtorch hands over and pushes its results back. Panics and
/// errors become a C++ exception on the other side, never an unwind across the boundary.
fn run_callback(f: &mut Callback<'_>, inputs: *const TensorPtr, n: usize, out: *mut c_void) -> c_int {
    // SAFETY: libtorch passes `n` live tensor pointers that stay valid during the call;
    // shallow clones take their own reference.
    let tensors: Vec<Tensor> = (0..n).map(|i| unsafe { Tensor::clone_from_ptr(*inputs.add(i)) }).collect();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&tensors)));
    let message = match result {
        Ok(Ok(outputs)) => {
            for t in &outputs {
                // SAFETY: `out` is the C++ vector the caller passed; the push copies the handle.
                unsafe { strata_tensor_list_push(out, t.as_ptr()) };
            }
            return 0;
        }
        Ok(Err(message)) => message,
        Err(_) => "Rust callback panicked".to_string(),
    };
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: a valid C string, copied by the callee.
    unsafe { strata_set_error(c.as_ptr()) };
    1
}

extern "C" fn call_boxed(data: *mut c_void, inputs: *const TensorPtr, n: usize, out: *mut c_void) -> c_int {
    // SAFETY: `data` points at a live `BoxedFn` owned by the C++ holder.
    let f = unsafe { &mut *(data as *mut BoxedFn) };
    run_callback(f.as_mut(), inputs, n, out)
}

/// A hook registered on a tensor; remove it with [`Hook::remove`].
#[derive(Debug)]
pub struct Hook {
    handle: u64,
}

impl Hook {
    pub fn remove(self, tensor: &Tensor) -> Result<()> {
        // SAFETY: the tensor is live for the call.
        check(unsafe { strata_remove_hook(tensor.as_ptr() as TensorPtr, self.handle) })
    }
}

/// Registers `f` to run on the gradient of `tensor` when backward reaches it
/// (`Tensor.register_hook`). Returning `Some(g)` replaces the gradient with `g`.
pub fn register_hook<F>(tensor: &Tensor, mut f: F) -> Result<Hook>
where
    F: FnMut(&Tensor) -> Option<Tensor> + Send + 'static,
{
    let boxed: BoxedFn = Box::new(move |grads: &[Tensor]| Ok(f(&grads[0]).into_iter().collect()));
    let data = Box::into_raw(Box::new(boxed)) as *mut c_void;
    let mut handle = 0u64;
    // SAFETY: ownership of `data` passes to the C++ holder, which calls `drop_boxed` once.
    check(unsafe {
        strata_register_hook(tensor.as_ptr() as TensorPtr, call_boxed, data, drop_boxed::<BoxedFn>, &mut handle)
    })?;
    Ok(Hook { handle })
}

/// Forward and backward of an autograd function written in Rust (`torch.autograd.Function`).
/// Forward runs without recording a graph; backward receives one gradient per output and
/// returns one per input (an undefined tensor, `Tensor::new()`, where there is none).
pub trait Function: Send + 'static {
    fn forward(&mut self, inputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String>;
    fn backward(&mut self, grad_outputs: &[Tensor]) -> std::result::Result<Vec<Tensor>, String>;
}

/// Runs `F::forward` or (with `BACKWARD`) `F::backward` for libtorch.
extern "C" fn call_function<F: Function, const BACKWARD: bool>(
    data: *mut c_void,
    inputs: *const TensorPtr,
    n: usize,
    out: *mut c_void,
) -> c_int {
    // SAFETY: `data` points at a live `F` owned by the C++ holder; libtorch runs the
    // forward and the backward of one node one after the other, never at once.
    let function = unsafe { &mut *(data as *mut F) };
    if BACKWARD {
        run_callback(&mut |t: &[Tensor]| function.backward(t), inputs, n, out)
    } else {
        run_callback(&mut |t: &[Tensor]| function.forward(t), inputs, n, out)
    }
}

/// Applies `function` to `inputs`, recording one autograd node whose backward calls
/// `function.backward`.
pub fn apply_function<F: Function>(function: F, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let data = Box::into_raw(Box::new(function)) as *mut c_void;
    let p = ptrs(inputs);
    let mut out: Vec<Tensor> = Vec::new();
    // SAFETY: ownership of `data` passes to the C++ holder; `sink_into_vec` receives owned
    // tensors and `out` outlives the call.
    check(unsafe {
        strata_custom_function(
            p.as_ptr(),
            p.len(),
            call_function::<F, false>,
            call_function::<F, true>,
            data,
            drop_boxed::<F>,
            sink_into_vec,
            &mut out as *mut Vec<Tensor> as *mut c_void,
        )
    })?;
    Ok(out)
}

extern "C" fn sink_into_vec(list: *mut c_void, owned: TensorPtr) {
    // SAFETY: `list` is the `Vec<Tensor>` of `apply_function`; `owned` is a fresh heap tensor.
    let list = unsafe { &mut *(list as *mut Vec<Tensor>) };
    list.push(unsafe { Tensor::from_ptr(owned) });
}

// ---- CPU kernels for activations, RMSNorm and rotary positions --------------------------

/// Strata's kernels, each recorded for autograd as one node whose backward is not itself
/// differentiable (asking for a second derivative through it is an error): vectorised CPU
/// kernels for fp32 CPU tensors and, where the build carries CUDA, CUDA kernels for
/// fp32, bf16 and fp16 GPU tensors, compiled at run time by NVRTC for the device at hand
/// (once per process for each dtype). Each returns `None` for inputs it does not serve, for
/// the caller's own composite.
pub mod kernels {
    use super::{
        check, optional_ptr, scalar_type, strata_add_norm, strata_attention, strata_cross_entropy, strata_fp8_cast,
        strata_gelu_tanh, strata_linear_weight_grad, strata_rms_norm, strata_rotary, strata_row_col_amax,
        strata_swiglu, Result, TensorPtr,
    };
    use tch::Tensor;

    /// Takes the result of a call that leaves null where its kernel does not serve.
    fn served(call: impl FnOnce(&mut TensorPtr) -> std::os::raw::c_int) -> Result<Option<Tensor>> {
        let mut out: TensorPtr = std::ptr::null_mut();
        check(call(&mut out))?;
        // SAFETY: null or a fresh `new at::Tensor` owned by nobody else.
        Ok((!out.is_null()).then(|| unsafe { Tensor::from_ptr(out) }))
    }

    /// GELU in its tanh form (`gelu(x, "tanh")`, GPT-2's activation), computed as
    /// `x·σ(2u)`, an exact rewrite of `x/2·(1 + tanh(u))` that needs one exponential and does
    /// not cancel where tanh(u) nears −1. Any shape.
    pub fn gelu_tanh(x: &Tensor) -> Result<Option<Tensor>> {
        // SAFETY: `x` is live for the call.
        served(|out| unsafe { strata_gelu_tanh(x.as_ptr(), out) })
    }

    /// SwiGLU's `silu(gate) * up` for two tensors of one shape: one pass for the product,
    /// one for both gradients, and only the two inputs kept for backward (libtorch's ops
    /// also keep `silu(gate)`).
    pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
        // SAFETY: the tensors are live for the call.
        served(|out| unsafe { strata_swiglu(gate.as_ptr(), up.as_ptr(), out) })
    }

    /// RMSNorm over the last dimension, `x / √(mean(x²) + eps) · weight`, for a weight of
    /// that dimension's size: one pass per row each way, keeping the input and each row's
    /// scale for backward (libtorch's composite runs five operators forward and also keeps
    /// the normalised input).
    pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Option<Tensor>> {
        // SAFETY: the tensors are live for the call.
        served(|out| unsafe { strata_rms_norm(x.as_ptr(), weight.as_ptr(), eps, out) })
    }

    /// Rotary positions, `x·cos + rotate_half(x)·sin`, for `[B, H, T, D]` `x` (even D, any
    /// strides) and contiguous `[T, D]` tables that take no gradient; the backward keeps
    /// only the tables.
    pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
        // SAFETY: the tensors are live for the call.
        served(|out| unsafe { strata_rotary(x.as_ptr(), cos.as_ptr(), sin.as_ptr(), out) })
    }

    /// The mean cross-entropy of `[..., V]` logits against integer targets of their leading
    /// shape, over the targets other than `ignore` (their count at least 1), on a GPU: one
    /// pass over each row for its log-sum-exp forward and one writing its gradient backward,
    /// in fp32 from the logits' dtype, so neither fp32 logits nor log-probabilities are ever
    /// written; backward keeps the logits and one float per row.
    pub fn cross_entropy(logits: &Tensor, targets: &Tensor, ignore: i64) -> Result<Option<Tensor>> {
        // SAFETY: the tensors are live for the call.
        served(|out| unsafe { strata_cross_entropy(logits.as_ptr(), targets.as_ptr(), ignore, out) })
    }

    /// Causal attention on a GPU (sm_80 or later) for what libtorch's fused kernels decline:
    /// `[B, H, T, D]` bf16 or fp16 queries over `[B, H_kv, T, D]` keys and values (H a
    /// multiple of H_kv: grouped-query heads, read in place without repeating them; D 64 or
    /// 128), scores scaled by `scale` and soft-capped to ±`softcap` where given, each query
    /// seeing the `window` positions up to itself where given, and `sinks` (`[H]`) joining
    /// each head's softmax as one more logit attended to nothing. One kernel each way, on
    /// tensor cores, keeping no scores: backward recomputes them from each query's log-sum-exp.
    /// The output is `[B, H, T, D]`, a view of a `[B, T, H, D]` tensor (heads merge without a
    /// copy). `None` where the kernel does not serve the inputs.
    pub fn attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        scale: f64,
        softcap: Option<f64>,
        window: Option<i64>,
    ) -> Result<Option<Tensor>> {
        let (cap, window) = (softcap.unwrap_or(0.0), window.unwrap_or(0));
        // SAFETY: the tensors are live for the call.
        served(|out| unsafe {
            strata_attention(q.as_ptr(), k.as_ptr(), v.as_ptr(), optional_ptr(sinks), scale, cap, window, out)
        })
    }

    /// The scale an fp8 cast multiplies by.
    #[derive(Clone, Copy)]
    pub enum Fp8Scale<'a> {
        /// One scale for the tensor, known on the host.
        Given(f64),
        /// One scale for the tensor, the one float this tensor holds on `x`'s GPU (computed
        /// there: nothing is read on the host).
        At(&'a Tensor),
        /// One scale per row for the row-major copy and one per column for the transpose
        /// (floats on `x`'s GPU, `[rows]` and `[cols]`): each copy scaled along the
        /// dimension its product sums over.
        Rowwise { rows: &'a Tensor, cols: &'a Tensor },
    }

    /// `x · scale` saturated to the fp8 format's largest finite value and cast to it (E4M3,
    /// or E5M2 where `e5m2`), for a contiguous 2-D `x` on a GPU with fp8 conversions
    /// (sm_89 and later): one pass that writes the cast row-major and, where `transposed`,
    /// its contiguous transpose (the column-major operand a scaled product wants), and takes
    /// the largest magnitude of `x` (NaN left out) into a float scalar on the device.
    pub fn fp8_cast(
        x: &Tensor,
        scale: Fp8Scale<'_>,
        e5m2: bool,
        transposed: bool,
    ) -> Result<Option<(Tensor, Option<Tensor>, Tensor)>> {
        let (given, at, rows, cols) = match scale {
            Fp8Scale::Given(v) => (v, None, None, None),
            Fp8Scale::At(t) => (1.0, Some(t), None, None),
            Fp8Scale::Rowwise { rows, cols } => (1.0, None, Some(rows), Some(cols)),
        };
        let mut out: [TensorPtr; 3] = [std::ptr::null_mut(); 3];
        let [q, qt, amax] = &mut out;
        let (at, rows, cols) = (optional_ptr(at), optional_ptr(rows), optional_ptr(cols));
        // SAFETY: `x` and the scales are live for the call; the three outputs are written.
        check(unsafe {
            strata_fp8_cast(x.as_ptr(), given, at, rows, cols, e5m2.into(), transposed.into(), q, qt, amax)
        })?;
        if out[0].is_null() || out[2].is_null() {
            return Ok(None);
        }
        // SAFETY: fresh `new at::Tensor`s (or null for the transpose) owned by nobody else.
        Ok(Some(unsafe {
            let qt = (!out[1].is_null()).then(|| Tensor::from_ptr(out[1]));
            (Tensor::from_ptr(out[0]), qt, Tensor::from_ptr(out[2]))
        }))
    }

    /// Each row's and each column's largest magnitude of a contiguous 2-D `x` on a GPU (NaN
    /// left out), as fp32 `[rows]` and `[cols]` there, in one read of `x`: what rowwise fp8
    /// scales come from.
    pub fn row_col_amax(x: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        let mut out: [TensorPtr; 2] = [std::ptr::null_mut(); 2];
        let [rows, cols] = &mut out;
        // SAFETY: `x` is live for the call; both outputs are written.
        check(unsafe { strata_row_col_amax(x.as_ptr(), rows, cols) })?;
        if out.iter().any(|p| p.is_null()) {
            return Ok(None);
        }
        // SAFETY: fresh `new at::Tensor`s owned by nobody else.
        Ok(Some(unsafe { (Tensor::from_ptr(out[0]), Tensor::from_ptr(out[1])) }))
    }

    /// The residual sum `s = x + r` and its norm over the last dimension, in one pass per
    /// row each way on a GPU: layer norm with `bias`, RMS norm without. `s` takes the
    /// weight's dtype, which must be the promotion of `x`'s and `r`'s, and the norm `out`
    /// (the weight's where `None`); the width at most 8,192. Without `r`, the norm of `x`
    /// (of the weight's dtype) in `out`, returned beside `x` itself.
    pub fn add_norm(
        x: &Tensor,
        r: Option<&Tensor>,
        weight: &Tensor,
        bias: Option<&Tensor>,
        eps: f64,
        out: Option<tch::Kind>,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let out_kind = out.map(scalar_type).transpose()?.unwrap_or(-1);
        let (mut sum, mut normed): (TensorPtr, TensorPtr) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: the tensors are live for the call; both outputs are written.
        check(unsafe {
            strata_add_norm(
                x.as_ptr(),
                optional_ptr(r),
                weight.as_ptr(),
                optional_ptr(bias),
                eps,
                out_kind,
                &mut sum,
                &mut normed,
            )
        })?;
        if sum.is_null() || normed.is_null() {
            return Ok(None);
        }
        // SAFETY: fresh `new at::Tensor`s owned by nobody else.
        Ok(Some(unsafe { (Tensor::from_ptr(sum), Tensor::from_ptr(normed)) }))
    }

    /// A linear layer's weight gradient `gᵀ·x` for `[rows, out]` `g` and `[rows, in]` `x`
    /// (contiguous, one dtype of fp32, bf16 and fp16) written into `dw` (`[out, in]`, that
    /// dtype or fp32; added to what it holds where `accumulate`), and, where `db` is given,
    /// the bias gradient (`g`'s column sums, in `dw`'s dtype) written into it by the same
    /// cuBLASLt product on a GPU, whose epilogue reduces `g` as the product reads it: no
    /// pass of its own over `g`, and no gradient in the products' dtype to widen after.
    /// False, with nothing written, where it does not serve.
    pub fn linear_weight_grad(
        g: &Tensor,
        x: &Tensor,
        dw: &Tensor,
        db: Option<&Tensor>,
        accumulate: bool,
    ) -> Result<bool> {
        let mut served = 0;
        // SAFETY: the tensors are live for the call, which writes into `dw` and `db` only.
        check(unsafe {
            strata_linear_weight_grad(
                g.as_ptr(),
                x.as_ptr(),
                dw.as_ptr(),
                optional_ptr(db),
                accumulate.into(),
                &mut served,
            )
        })?;
        Ok(served != 0)
    }
}

// ---- oneDNN ----------------------------------------------------------------------------

/// oneDNN's inner product (the matrix-product kernels libtorch's CPU graph compiler calls),
/// usable on plain tensors: on CPUs where libtorch's BLAS is not tuned for the machine it
/// is several times faster than `Tensor::linear`.
pub mod onednn {
    use super::{check, optional_ptr, strata_onednn_available, strata_onednn_linear, Result, TensorPtr};
    use std::os::raw::c_int;
    use std::sync::OnceLock;
    use tch::Tensor;

    /// Whether this libtorch has oneDNN and registers its linear op.
    pub fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            let mut yes: c_int = 0;
            // SAFETY: writes one int.
            check(unsafe { strata_onednn_available(&mut yes) }).is_ok() && yes != 0
        })
    }

    /// `x @ w.T + b` for CPU tensors of fp32 or bf16; `w` is `[out, in]`, any strides (a
    /// transposed view included). No autograd graph is recorded.
    pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        let mut out: TensorPtr = std::ptr::null_mut();
        // SAFETY: the tensors are live for the call; the result is a fresh heap tensor.
        check(unsafe { strata_onednn_linear(x.as_ptr(), w.as_ptr(), optional_ptr(b), &mut out) })?;
        // SAFETY: a fresh `new at::Tensor` owned by nobody else.
        Ok(unsafe { Tensor::from_ptr(out) })
    }
}

/// libtorch's Kineto profiler, as `torch.profiler` drives it: a Chrome trace of the operators
/// a thread runs and, on a GPU, of the device's kernels and copies.
pub mod kernel_trace {
    use super::{check, strata_kineto_save, strata_kineto_start, ExtError, Result};
    use std::ffi::CString;
    use std::os::raw::c_int;
    use std::path::Path;

    /// Starts recording on the calling thread; with `cuda`, the GPU's activity too.
    pub fn start(cuda: bool) -> Result<()> {
        // SAFETY: a plain call.
        check(unsafe { strata_kineto_start(c_int::from(cuda)) })
    }

    /// Stops the recording this thread started and writes it to `path` (Chrome trace JSON).
    pub fn save(path: &Path) -> Result<()> {
        let path = path.to_str().ok_or_else(|| ExtError(format!("{} is not UTF-8", path.display())))?;
        let path = CString::new(path).map_err(|e| ExtError(e.to_string()))?;
        // SAFETY: a NUL-terminated string, live for the call.
        check(unsafe { strata_kineto_save(path.as_ptr()) })
    }
}

// ---- fused optimizer kernels -----------------------------------------------------------

/// Hyper-parameters of one fused Adam/AdamW call.
#[derive(Clone, Copy, Debug)]
pub struct AdamStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW (decoupled weight decay) when true, Adam (L2 added to the gradient) when false.
    pub decoupled: bool,
    pub maximize: bool,
}

/// Tensors of one fused optimizer call; every list is as long as `params`.
pub struct AdamTensors<'a> {
    pub params: &'a [Tensor],
    pub grads: &'a [Tensor],
    pub exp_avgs: &'a [Tensor],
    pub exp_avg_sqs: &'a [Tensor],
    /// One float scalar per parameter, incremented by the call before the update.
    pub steps: &'a [Tensor],
}

/// Optional inputs the fused kernels read on the device: the learning rate (a float scalar,
/// in place of the step's `lr`: a captured CUDA graph replays with whatever it holds), and
/// loss scaling's (gradients divided by `grad_scale`, the whole update skipped where
/// `found_inf` is non-zero).
#[derive(Clone, Copy, Default)]
pub struct DeviceInputs<'a> {
    pub lr: Option<&'a Tensor>,
    pub grad_scale: Option<&'a Tensor>,
    pub found_inf: Option<&'a Tensor>,
}

fn same_lengths(what: &str, lengths: &[usize]) -> Result<()> {
    if lengths.windows(2).all(|w| w[0] == w[1]) {
        Ok(())
    } else {
        Err(ExtError(format!("{what}: tensor lists of different lengths {lengths:?}")))
    }
}

/// One Adam/AdamW update through `at::_fused_adam_` / `at::_fused_adamw_`.
pub fn fused_adam(t: &AdamTensors<'_>, h: AdamStep, inputs: DeviceInputs<'_>) -> Result<()> {
    same_lengths("fused_adam", &[t.params.len(), t.grads.len(), t.exp_avgs.len(), t.exp_avg_sqs.len(), t.steps.len()])?;
    let (p, g, m, v, s) = (ptrs(t.params), ptrs(t.grads), ptrs(t.exp_avgs), ptrs(t.exp_avg_sqs), ptrs(t.steps));
    // SAFETY: all lists hold live tensors of equal length, borrowed for the call.
    check(unsafe {
        strata_fused_adam(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            p.len(),
            h.lr,
            optional_ptr(inputs.lr),
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
            h.decoupled as c_int,
            h.maximize as c_int,
            optional_ptr(inputs.grad_scale),
            optional_ptr(inputs.found_inf),
        )
    })
}

/// Hyper-parameters of one fused SGD call.
#[derive(Clone, Copy, Debug)]
pub struct SgdStep {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
    pub maximize: bool,
    /// On the first step the momentum buffer is set to the gradient instead of blended.
    pub is_first_step: bool,
}

/// One SGD update through `at::_fused_sgd_`. `momentum_buffers` is empty when
/// `momentum == 0`, otherwise as long as `params`.
pub fn fused_sgd(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_buffers: &[Tensor],
    h: SgdStep,
    inputs: DeviceInputs<'_>,
) -> Result<()> {
    same_lengths("fused_sgd", &[params.len(), grads.len()])?;
    if !momentum_buffers.is_empty() {
        same_lengths("fused_sgd", &[params.len(), momentum_buffers.len()])?;
    }
    let (p, g, b) = (ptrs(params), ptrs(grads), ptrs(momentum_buffers));
    // SAFETY: live tensors borrowed for the call, lengths checked above.
    check(unsafe {
        strata_fused_sgd(
            p.as_ptr(),
            g.as_ptr(),
            b.as_ptr(),
            p.len(),
            b.len(),
            h.weight_decay,
            h.momentum,
            h.lr,
            optional_ptr(inputs.lr),
            h.dampening,
            h.nesterov as c_int,
            h.maximize as c_int,
            h.is_first_step as c_int,
            optional_ptr(inputs.grad_scale),
            optional_ptr(inputs.found_inf),
        )
    })
}

// ---- CUDA -----------------------------------------------------------------------------

/// Byte counts of libtorch's CPU allocations: current and peak, from the moment
/// [`cpu_memory::track`] installs a counting wrapper around the default allocator (what
/// CUDA's caching allocator reports for a GPU).
pub mod cpu_memory {
    use super::*;

    /// Starts counting (idempotent). Memory allocated earlier is not counted.
    pub fn track() -> Result<()> {
        // SAFETY: a plain call; the allocator lives for the rest of the process.
        check(unsafe { strata_cpu_memory_track() })
    }

    /// (current, peak) bytes allocated through libtorch on the CPU since [`track`].
    pub fn stats() -> Result<(i64, i64)> {
        let (mut current, mut peak) = (0i64, 0i64);
        // SAFETY: both pointers are live for the call.
        check(unsafe { strata_cpu_memory_stats(&mut current, &mut peak) })?;
        Ok((current, peak))
    }

    /// Starts a new peak from the bytes held now.
    pub fn reset_peak() -> Result<()> {
        // SAFETY: a plain call.
        check(unsafe { strata_cpu_memory_reset_peak() })
    }

    /// Counts `bytes` of host memory libtorch did not allocate (negative: no longer held)
    /// in these statistics, so buffers a program maps itself show in the peaks too;
    /// nothing while tracking is off.
    pub fn account(bytes: i64) -> Result<()> {
        // SAFETY: a plain call.
        check(unsafe { strata_cpu_memory_account(bytes) })
    }
}

/// Turns libtorch's CUDA autocast on (in `kind`) or off for the calling thread. Calls nest:
/// each `true` needs its `false`.
pub fn cuda_autocast(enabled: bool, kind: tch::Kind) -> Result<()> {
    const CUDA: c_int = 1;
    if !matches!(kind, tch::Kind::Half | tch::Kind::BFloat16) {
        return Err(ExtError(format!("autocast computes in f16 or bf16, not {kind:?}")));
    }
    let code = scalar_type(kind)?;
    // SAFETY: a plain call with a scalar-type code.
    check(unsafe { strata_autocast_set(CUDA, c_int::from(enabled), code) })
}

/// CUDA streams, events and caching-allocator statistics. Every call returns an error
/// (never panics) when the crate was built against a libtorch without CUDA or no GPU is visible.
pub mod cuda {
    use super::*;

    /// Whether this build carries the CUDA code paths (its libtorch carried CUDA).
    pub fn is_built() -> bool {
        // SAFETY: a pure query.
        unsafe { strata_cuda_is_built() != 0 }
    }

    /// Bytes held by libtorch's caching allocator on one device.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct MemoryStats {
        pub allocated: i64,
        pub allocated_peak: i64,
        pub reserved: i64,
        pub reserved_peak: i64,
    }

    pub fn memory_stats(device: usize) -> Result<MemoryStats> {
        let mut s = [0i64; 4];
        // SAFETY: `s` has the four slots the C++ side writes.
        check(unsafe { strata_cuda_memory_stats(device as c_int, s.as_mut_ptr()) })?;
        Ok(MemoryStats { allocated: s[0], allocated_peak: s[1], reserved: s[2], reserved_peak: s[3] })
    }

    /// Compiles every CUDA kernel of [`kernels`] for `arch` (such as
    /// `sm_90`) with NVRTC, without loading them: needs no device, so a machine without a
    /// GPU can check that the sources compile.
    pub fn compile_kernels(arch: &str) -> Result<()> {
        let arch = std::ffi::CString::new(arch).map_err(|e| ExtError(e.to_string()))?;
        // SAFETY: a NUL-terminated string live for the call.
        check(unsafe { strata_cuda_compile_kernels(arch.as_ptr()) })
    }

    /// The device's compute capability (major, minor), e.g. (9, 0) for an H100.
    pub fn compute_capability(device: usize) -> Result<(i32, i32)> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both pointers are live for the call.
        check(unsafe { strata_cuda_capability(device as c_int, &mut major, &mut minor) })?;
        Ok((major, minor))
    }

    /// Counts, on the calling thread, every host-device synchronisation libtorch's sync debug
    /// mode sees (copies to pageable host memory, `.item()`, stream and device
    /// synchronisations) plus every [`Event::synchronize`], into [`syncs_counted`]. Libtorch's
    /// mode is process-wide: other threads' synchronisations print a warning while it is on.
    pub fn count_syncs(on: bool) -> Result<()> {
        // SAFETY: a plain call.
        check(unsafe { strata_cuda_count_syncs(c_int::from(on)) })
    }

    /// Synchronisations counted so far by [`count_syncs`] (across threads, since the start).
    pub fn syncs_counted() -> u64 {
        // SAFETY: a pure query.
        unsafe { strata_cuda_syncs_counted() as u64 }
    }

    /// The device's name, as `nvidia-smi` shows it (e.g. "NVIDIA H100 80GB HBM3").
    pub fn device_name(device: usize) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the C++ side writes at most `buf.len()` bytes, NUL included.
        check(unsafe { strata_cuda_device_name(device as c_int, buf.as_mut_ptr(), buf.len() as c_int) })?;
        // SAFETY: the buffer is NUL-terminated (zeroed, and snprintf terminates).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    pub fn reset_peak_stats(device: usize) -> Result<()> {
        // SAFETY: a plain call with a device index.
        check(unsafe { strata_cuda_reset_peak_stats(device as c_int) })
    }

    /// Gives the caching allocator's unused device memory back to the driver, so that
    /// another process can have it (what the allocator keeps cached is otherwise this
    /// process's until it exits).
    pub fn empty_cache() -> Result<()> {
        // SAFETY: a plain call.
        check(unsafe { strata_cuda_empty_cache() })
    }

    /// Host memory page-locked for every GPU's copies while this lives: a copy between it
    /// and a device goes directly, not staged through a pinned buffer of libtorch's.
    #[derive(Debug)]
    pub struct HostRegistration {
        data: *mut c_void,
        bytes: usize,
    }

    // SAFETY: a registration is a plain address range; the driver's calls on it may come
    // from any thread.
    unsafe impl Send for HostRegistration {}

    impl HostRegistration {
        /// Page-locks `bytes` bytes from `data`.
        ///
        /// # Safety
        /// The memory must stay mapped until the registration is dropped.
        pub unsafe fn new(data: *mut u8, bytes: usize) -> Result<HostRegistration> {
            // SAFETY: the caller keeps the range mapped for the registration's life.
            check(unsafe { strata_cuda_host_register(data as *mut c_void, bytes) })?;
            Ok(HostRegistration { data: data as *mut c_void, bytes })
        }

        /// The bytes locked.
        pub fn bytes(&self) -> usize {
            self.bytes
        }
    }

    impl Drop for HostRegistration {
        fn drop(&mut self) {
            // SAFETY: the range registered in `new`, still mapped (the caller's promise).
            // A failure (the driver already torn down at exit) leaves nothing to undo.
            let _ = check(unsafe { strata_cuda_host_unregister(self.data) });
        }
    }

    /// A CUDA stream of libtorch's pool (plain data: libtorch owns the stream itself).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Stream([i64; 3]);

    impl Stream {
        /// A stream from libtorch's pool on `device`.
        pub fn from_pool(device: usize, high_priority: bool) -> Result<Stream> {
            let mut p = [0i64; 3];
            // SAFETY: `p` has the three slots the C++ side writes.
            check(unsafe { strata_cuda_stream_from_pool(device as c_int, high_priority as c_int, p.as_mut_ptr()) })?;
            Ok(Stream(p))
        }

        /// The stream libtorch currently enqueues kernels on for `device`.
        pub fn current(device: usize) -> Result<Stream> {
            let mut p = [0i64; 3];
            // SAFETY: as above.
            check(unsafe { strata_cuda_current_stream(device as c_int, p.as_mut_ptr()) })?;
            Ok(Stream(p))
        }

        /// Makes this the current stream of its device for the calling thread.
        pub fn make_current(&self) -> Result<()> {
            // SAFETY: reads three plain integers.
            check(unsafe { strata_cuda_set_current_stream(self.0.as_ptr()) })
        }

        pub fn synchronize(&self) -> Result<()> {
            // SAFETY: reads three plain integers.
            check(unsafe { strata_cuda_stream_synchronize(self.0.as_ptr()) })
        }
    }

    /// A CUDA event, for ordering streams and timing.
    pub struct Event(*mut c_void);

    // SAFETY: CUDA events may be recorded, queried and waited on from any host thread.
    unsafe impl Send for Event {}
    unsafe impl Sync for Event {}

    impl Event {
        pub(crate) fn from_raw(event: *mut c_void) -> Event {
            Event(event)
        }

        pub fn new(enable_timing: bool) -> Result<Event> {
            let mut e = std::ptr::null_mut();
            // SAFETY: the C++ side writes a fresh heap event into `e`.
            check(unsafe { strata_cuda_event_new(enable_timing as c_int, &mut e) })?;
            Ok(Event(e))
        }

        pub fn record(&self, stream: &Stream) -> Result<()> {
            // SAFETY: a live event and plain stream data.
            check(unsafe { strata_cuda_event_record(self.0, stream.0.as_ptr()) })
        }

        /// Makes `stream` wait (on the device) until this event has completed.
        pub fn wait(&self, stream: &Stream) -> Result<()> {
            // SAFETY: as above.
            check(unsafe { strata_cuda_event_wait(self.0, stream.0.as_ptr()) })
        }

        pub fn synchronize(&self) -> Result<()> {
            // SAFETY: a live event.
            check(unsafe { strata_cuda_event_synchronize(self.0) })
        }

        /// Whether the work recorded before this event has finished.
        pub fn query(&self) -> Result<bool> {
            let mut done = 0;
            // SAFETY: a live event.
            check(unsafe { strata_cuda_event_query(self.0, &mut done) })?;
            Ok(done != 0)
        }

        /// Milliseconds from `self` to `end`; both must have been created with timing.
        pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
            let mut ms = 0f32;
            // SAFETY: two live events.
            check(unsafe { strata_cuda_event_elapsed_ms(self.0, end.0, &mut ms) })?;
            Ok(ms)
        }
    }

    impl Drop for Event {
        fn drop(&mut self) {
            // SAFETY: the event was created by `strata_cuda_event_new` and is freed once.
            unsafe { strata_cuda_event_free(self.0) }
        }
    }

    /// A CUDA graph: what one piece of host code queued on a device, captured once and
    /// replayed by one launch.
    pub struct Graph(*mut c_void);

    // SAFETY: a captured graph may be replayed and freed from any host thread.
    unsafe impl Send for Graph {}

    impl Graph {
        /// Runs `queue` with the kernels and copies it queues on `device` captured instead
        /// of run: nothing of it runs until [`Graph::replay`]. What the captured work
        /// allocates comes from a memory pool of the graph's own, kept while it lives, so the
        /// tensors `queue` returns stay valid and each replay rewrites them. Work that makes
        /// the host wait for the device (reading a value, a copy to pageable memory) fails
        /// the capture; so does an error of `queue`, whose error is returned.
        pub fn capture<T, E: From<ExtError>>(
            device: usize,
            queue: impl FnOnce() -> std::result::Result<T, E>,
        ) -> std::result::Result<(Graph, T), E> {
            let mut raw = std::ptr::null_mut();
            // SAFETY: the C++ side writes a fresh capture into `raw`.
            check(unsafe { strata_cuda_graph_begin(device as c_int, &mut raw) })?;
            let graph = Graph(raw);
            match queue() {
                Ok(value) => {
                    // SAFETY: a live capture, ended once.
                    check(unsafe { strata_cuda_graph_end(graph.0, 1) })?;
                    Ok((graph, value))
                }
                Err(e) => {
                    // SAFETY: as above; the capture is dropped whatever state it is in.
                    let _ = unsafe { strata_cuda_graph_end(graph.0, 0) };
                    Err(e)
                }
            }
        }

        /// Launches the captured work on the device's current stream.
        pub fn replay(&self) -> Result<()> {
            // SAFETY: a capture ended by `capture`.
            check(unsafe { strata_cuda_graph_replay(self.0) })
        }
    }

    impl Drop for Graph {
        fn drop(&mut self) {
            // SAFETY: created by `strata_cuda_graph_begin`, freed once.
            unsafe { strata_cuda_graph_free(self.0) }
        }
    }
}

/// NCCL communicators and collectives, enqueued on torch's current stream of the tensors'
/// device. In a build without CUDA every call returns an error.
pub mod nccl {
    use super::*;

    /// Which collective [`Communicator::collective`] runs; the tensor list it takes is
    /// described per variant.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Collective {
        /// `[t]`, in place.
        AllReduce = 0,
        /// `[t]` from rank `peer`.
        Broadcast = 1,
        /// `[t]` into rank `peer`.
        Reduce = 2,
        /// `[t]` to rank `peer`.
        Send = 3,
        /// `[t]` from rank `peer`.
        Recv = 4,
        /// `[out_0, .., out_{n-1}, input]`, `peer` = this rank.
        AllGather = 5,
        /// `[output, in_0, .., in_{n-1}]`.
        ReduceScatter = 6,
        /// `[out_0, .., out_{n-1}, in_0, .., in_{n-1}]`.
        AllToAll = 7,
    }

    /// The id rank 0 creates and shares (through the store) so every rank can join.
    pub fn unique_id() -> Result<[u8; 128]> {
        let mut id = [0u8; 128];
        // SAFETY: the C++ side writes exactly 128 bytes.
        check(unsafe { strata_nccl_unique_id(id.as_mut_ptr()) })?;
        Ok(id)
    }

    pub struct Communicator {
        comm: *mut c_void,
        nranks: usize,
    }

    // SAFETY: an NCCL communicator may move to another thread. It is not `Sync`: NCCL allows
    // one call at a time, so a shared communicator needs a lock.
    unsafe impl Send for Communicator {}

    /// Checks a collective's tensor list against what [`Collective`] documents, so that NCCL
    /// never reads or writes past a tensor: the number of tensors for `nranks` ranks, `peer`
    /// among them, one dtype, and the element counts each operation needs to agree.
    pub fn check_collective(what: Collective, tensors: &[&Tensor], peer: usize, nranks: usize) -> Result<()> {
        let bad = |m: String| Err(ExtError(format!("nccl {what:?}: {m}")));
        let expected = match what {
            Collective::AllGather | Collective::ReduceScatter => nranks + 1,
            Collective::AllToAll => 2 * nranks,
            _ => 1,
        };
        if tensors.len() != expected {
            return bad(format!("{} tensors for {nranks} ranks, expected {expected}", tensors.len()));
        }
        if peer >= nranks {
            return bad(format!("rank {peer} outside a group of {nranks}"));
        }
        if let Some(t) = tensors.iter().find(|t| t.kind() != tensors[0].kind()) {
            return bad(format!("mixed dtypes {:?} and {:?}", tensors[0].kind(), t.kind()));
        }
        let numel = |i: usize| tensors[i].numel();
        let mismatch = match what {
            // The piece this rank contributes is its own slot's size.
            Collective::AllGather => (numel(peer) != numel(nranks)).then_some((peer, nranks)),
            // Every input is as long as the output shard.
            Collective::ReduceScatter => (1..=nranks).find(|&i| numel(i) != numel(0)).map(|i| (i, 0)),
            // What goes to rank r is as long as what comes back from it.
            Collective::AllToAll => (0..nranks).find(|&r| numel(r) != numel(nranks + r)).map(|r| (r, nranks + r)),
            _ => None,
        };
        match mismatch {
            Some((a, b)) => bad(format!("tensor {a} holds {} elements, tensor {b} {}", numel(a), numel(b))),
            None => Ok(()),
        }
    }

    impl Communicator {
        /// Joins the communicator `id` as `rank` of `nranks`, on CUDA device `device`.
        pub fn init(id: &[u8; 128], nranks: usize, rank: usize, device: usize) -> Result<Communicator> {
            let mut comm = std::ptr::null_mut();
            // SAFETY: `id` holds 128 bytes; the C++ side writes a new communicator.
            check(unsafe {
                strata_nccl_comm_init(id.as_ptr(), nranks as c_int, rank as c_int, device as c_int, &mut comm)
            })?;
            Ok(Communicator { comm, nranks })
        }

        /// Enqueues `what` and returns an event recorded after it on the same stream.
        /// `op`: 0 sum, 1 avg, 2 max, 3 min.
        pub fn collective(&self, what: Collective, tensors: &[&Tensor], op: i32, peer: usize) -> Result<cuda::Event> {
            check_collective(what, tensors, peer, self.nranks)?;
            if !(0..=3).contains(&op) {
                return Err(ExtError(format!("nccl {what:?}: unknown reduction {op}")));
            }
            let p = ptrs(tensors);
            let mut event = std::ptr::null_mut();
            // SAFETY: live tensors borrowed for the call; the event is a fresh heap object
            // whose ownership passes to the returned `Event`.
            check(unsafe {
                strata_nccl_collective(
                    self.comm,
                    what as c_int,
                    p.as_ptr(),
                    p.len(),
                    op,
                    peer as c_int,
                    self.nranks as c_int,
                    &mut event,
                )
            })?;
            Ok(cuda::Event::from_raw(event))
        }
    }

    impl Drop for Communicator {
        fn drop(&mut self) {
            // SAFETY: destroyed once, by its owner.
            unsafe { strata_nccl_comm_destroy(self.comm) }
        }
    }
}

/// A client (or host) of PyTorch's c10d `TCPStore`, the store torchrun's agent runs: the
/// wheel's own implementation, so the protocol is exactly PyTorch's.
pub mod c10d {
    use super::*;
    use std::time::Duration;

    pub struct TcpStore(*mut c_void);

    // SAFETY: the store may move to another thread. It is not `Sync`: callers that share it
    // hold it behind a lock.
    unsafe impl Send for TcpStore {}

    fn ms(d: Duration) -> i64 {
        i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
    }

    /// Takes ownership of a buffer the C++ side allocated.
    fn bytes(ptr: *mut u8, len: usize) -> Vec<u8> {
        // SAFETY: the C++ side returned `len` readable bytes at `ptr` (malloc'd, never null
        // on success); they are copied, then freed once.
        let v = unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec();
        unsafe { strata_free_bytes(ptr) };
        v
    }

    fn key_parts(keys: &[&str]) -> (Vec<*const c_char>, Vec<usize>) {
        (keys.iter().map(|k| k.as_ptr() as *const c_char).collect(), keys.iter().map(|k| k.len()).collect())
    }

    impl TcpStore {
        /// Connects to the store at `host:port`, or hosts it with `serve` (port 0: any free
        /// port, see [`TcpStore::port`]); every call waits at most `timeout`.
        pub fn new(host: &str, port: u16, serve: bool, timeout: Duration) -> Result<TcpStore> {
            let host = std::ffi::CString::new(host).map_err(|_| ExtError("store host holds a NUL byte".into()))?;
            let mut out = std::ptr::null_mut();
            // SAFETY: a valid C string; the C++ side writes a new heap handle into `out`.
            check(unsafe {
                strata_c10d_store_new(host.as_ptr(), c_int::from(port), c_int::from(serve), ms(timeout), &mut out)
            })?;
            Ok(TcpStore(out))
        }

        /// The port the store listens on.
        pub fn port(&self) -> Result<u16> {
            let mut port: c_int = 0;
            // SAFETY: a live handle.
            check(unsafe { strata_c10d_store_port(self.0, &mut port) })?;
            u16::try_from(port).map_err(|_| ExtError(format!("store port {port}")))
        }

        pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
            // SAFETY: a live handle; key and value are borrowed for the call.
            check(unsafe {
                strata_c10d_set(self.0, key.as_ptr() as *const c_char, key.len(), value.as_ptr(), value.len())
            })
        }

        /// The value of `key`, waiting up to `timeout` for it to be set.
        pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
            let (mut ptr, mut len) = (std::ptr::null_mut(), 0usize);
            // SAFETY: as above; on success the C++ side hands over a malloc'd buffer.
            check(unsafe {
                strata_c10d_get(self.0, key.as_ptr() as *const c_char, key.len(), ms(timeout), &mut ptr, &mut len)
            })?;
            Ok(bytes(ptr, len))
        }

        pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
            let mut out = 0i64;
            // SAFETY: as above.
            check(unsafe { strata_c10d_add(self.0, key.as_ptr() as *const c_char, key.len(), delta, &mut out) })?;
            Ok(out)
        }

        /// Sets `key` to `desired` if it holds `expected` (empty: if unset); the value after.
        pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
            let (mut ptr, mut len) = (std::ptr::null_mut(), 0usize);
            // SAFETY: as above.
            check(unsafe {
                strata_c10d_compare_set(
                    self.0,
                    key.as_ptr() as *const c_char,
                    key.len(),
                    expected.as_ptr(),
                    expected.len(),
                    desired.as_ptr(),
                    desired.len(),
                    &mut ptr,
                    &mut len,
                )
            })?;
            Ok(bytes(ptr, len))
        }

        /// Waits until every key is set, up to `timeout`.
        pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
            let (ptrs, lens) = key_parts(keys);
            // SAFETY: `keys.len()` pointer and length pairs, borrowed for the call.
            check(unsafe { strata_c10d_wait(self.0, ptrs.as_ptr(), lens.as_ptr(), keys.len(), ms(timeout)) })
        }

        pub fn check(&self, keys: &[&str]) -> Result<bool> {
            let (ptrs, lens) = key_parts(keys);
            let mut out: c_int = 0;
            // SAFETY: as above.
            check(unsafe { strata_c10d_check(self.0, ptrs.as_ptr(), lens.as_ptr(), keys.len(), &mut out) })?;
            Ok(out != 0)
        }
    }

    impl Drop for TcpStore {
        fn drop(&mut self) {
            // SAFETY: the handle was made by `strata_c10d_store_new` and is freed once.
            unsafe { strata_c10d_store_free(self.0) }
        }
    }
}
