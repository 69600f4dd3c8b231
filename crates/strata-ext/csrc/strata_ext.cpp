// The one C++ file of Strata: the pieces of libtorch that tch does not expose.
// Every entry point is `extern "C"`, catches every C++ exception and reports it through
// `strata_last_error`, so no exception ever crosses into Rust. Tensors travel as
// `at::Tensor*`, the same handle tch's `C_tensor` points to.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/CPUAllocator.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "cuda_kernels.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#ifdef STRATA_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#endif

using at::Tensor;

namespace {

// Counts the bytes of every CPU allocation made through libtorch (current and peak), by
// wrapping the default allocator; memory allocated before it was installed is not counted.
// Allocations stay plain pointers (context == data, as some kernels require), so sizes and
// the wrapped deleters are kept in a table.
struct CountingAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::mutex lock;
  std::unordered_map<void*, std::pair<size_t, c10::DeleterFnPtr>> live;

  static CountingAllocator* instance;

  static void release(void* ptr) {
    CountingAllocator* self = instance;
    std::pair<size_t, c10::DeleterFnPtr> entry{0, nullptr};
    {
      std::lock_guard<std::mutex> guard(self->lock);
      auto it = self->live.find(ptr);
      if (it == self->live.end()) return;
      entry = it->second;
      self->live.erase(it);
    }
    self->current.fetch_sub(static_cast<int64_t>(entry.first));
    if (entry.second != nullptr) entry.second(ptr);
  }

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    c10::Device device = inner.device();
    c10::DeleterFnPtr deleter = inner.get_deleter();
    if (data == nullptr || inner.get_context() != data) return inner;  // not ours to count
    inner.release_context();
    {
      std::lock_guard<std::mutex> guard(lock);
      live[data] = {n, deleter};
    }
    add(static_cast<int64_t>(n));
    return c10::DataPtr(data, data, &CountingAllocator::release, device);
  }

  // Counts `n` more bytes (fewer when negative) and raises the peak to match.
  void add(int64_t n) {
    int64_t now = current.fetch_add(n) + n;
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &CountingAllocator::release;
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator* CountingAllocator::instance = nullptr;

CountingAllocator* counting_allocator = nullptr;

thread_local std::string last_error;

template <typename F>
int guarded(F&& body) {
  try {
    body();
    return 0;
  } catch (const c10::Error& e) {
    last_error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return 1;
}

std::vector<Tensor> to_vector(Tensor* const* tensors, size_t n) {
  std::vector<Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(*tensors[i]);
  return out;
}

std::optional<Tensor> optional_tensor(const Tensor* t) {
  if (t == nullptr) return std::nullopt;
  return *t;
}

// A Rust closure owned by C++: `drop` runs when the last reference goes, on whichever
// thread that happens (the Rust side only hands over `Send` closures).
struct RustClosure : torch::CustomClassHolder {
  void* data;
  void (*drop)(void*);
  RustClosure(void* d, void (*dr)(void*)) : data(d), drop(dr) {}
  ~RustClosure() override { drop(data); }
};

// Callback signature shared by hooks and custom functions: given input tensors, push the
// results into `out` (through `strata_tensor_list_push`) and return 0, or return non-zero
// after setting a message with `strata_set_error`.
using TensorCallback = int (*)(void* data, Tensor* const* inputs, size_t n, void* out);

std::vector<Tensor> call_rust(TensorCallback cb, void* data, const std::vector<Tensor>& inputs) {
  std::vector<Tensor*> ptrs;
  ptrs.reserve(inputs.size());
  for (auto& t : inputs) ptrs.push_back(const_cast<Tensor*>(&t));
  std::vector<Tensor> out;
  if (cb(data, ptrs.data(), ptrs.size(), &out) != 0) {
    throw std::runtime_error(last_error.empty() ? "Rust callback failed" : last_error);
  }
  return out;
}

// An autograd function whose forward and backward are Rust callbacks.
struct RustFunction : public torch::autograd::Function<RustFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                TensorCallback fwd, TensorCallback bwd,
                                                c10::intrusive_ptr<RustClosure> closure) {
    ctx->saved_data["closure"] = at::IValue::make_capsule(closure);
    ctx->saved_data["backward"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(bwd));
    return call_rust(fwd, closure->data, inputs.vec());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto capsule = ctx->saved_data["closure"].toCapsule();
    auto* closure = static_cast<RustClosure*>(capsule.get());
    auto bwd = reinterpret_cast<TensorCallback>(
        static_cast<intptr_t>(ctx->saved_data["backward"].toInt()));
    auto grad_inputs = call_rust(bwd, closure->data, grads);
    // One slot per forward argument: the tensors, then the three non-tensor arguments.
    grad_inputs.resize(grad_inputs.size() + 3);
    return grad_inputs;
  }
};

// ---- saved-tensor hooks ---------------------------------------------------------------
//
// libtorch asks its default autograd engine for the hooks of every tensor a node saves for
// backward; the base engine has none. `StrataEngine` answers with the innermost sink the
// calling thread pushed (none outside a push), so a Rust owner decides where each saved
// value lives between forward and backward (`torch.autograd.graph.saved_tensors_hooks`).

// Given a saved tensor, writes a ticket the sink will redeem it by, or 0 to have the tensor
// kept as it is.
using PackCallback = int (*)(void* data, const Tensor* t, uint64_t* ticket);
// Pushes the value of `ticket` into `out` (a `std::vector<Tensor>`, through
// `strata_tensor_list_push`).
using UnpackCallback = int (*)(void* data, uint64_t ticket, void* out);

struct SavedSink {
  PackCallback pack;
  UnpackCallback unpack;
  void* data;
  void (*drop)(void*);
  SavedSink(PackCallback p, UnpackCallback u, void* d, void (*dr)(void*)) : pack(p), unpack(u), data(d), drop(dr) {}
  ~SavedSink() { drop(data); }
};

thread_local std::vector<std::shared_ptr<SavedSink>> saved_sinks;
// Set while a sink's pack runs: what it computes is saved as usual.
thread_local bool packing = false;

struct RustSavedHooks final : torch::autograd::SavedVariableHooks {
  std::shared_ptr<SavedSink> sink;
  uint64_t ticket = 0;
  Tensor kept;
  explicit RustSavedHooks(std::shared_ptr<SavedSink> s) : sink(std::move(s)) {}

  void call_pack_hook(const Tensor& t) override {
    packing = true;
    int code = sink->pack(sink->data, &t, &ticket);
    packing = false;
    if (code != 0) throw std::runtime_error(last_error.empty() ? "saved-tensor pack failed" : last_error);
    // Detached: a node's own output kept with its graph would make a reference cycle.
    if (ticket == 0) kept = t.detach();
  }

  Tensor call_unpack_hook() override {
    if (ticket == 0) return kept;
    std::vector<Tensor> out;
    if (sink->unpack(sink->data, ticket, &out) != 0 || out.size() != 1) {
      throw std::runtime_error(last_error.empty() ? "saved-tensor unpack failed" : last_error);
    }
    return out[0];
  }
};

struct StrataEngine final : torch::autograd::Engine {
  ~StrataEngine() override { stop(); }
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (saved_sinks.empty() || packing) return nullptr;
    return std::make_unique<RustSavedHooks>(saved_sinks.back());
  }
};

torch::autograd::Engine& strata_engine() {
  static StrataEngine engine;
  return engine;
}

}  // namespace

extern "C" {

const char* strata_last_error() { return last_error.c_str(); }

void strata_set_error(const char* message) { last_error = message; }

void strata_tensor_list_push(void* list, const Tensor* t) {
  static_cast<std::vector<Tensor>*>(list)->push_back(t == nullptr ? Tensor() : *t);
}

// ---- autograd -------------------------------------------------------------------------

int strata_backward(Tensor* const* outputs, Tensor* const* grads, size_t n, int retain_graph) {
  return guarded([&] {
    auto outs = to_vector(outputs, n);
    std::vector<Tensor> gs;
    gs.reserve(n);
    for (size_t i = 0; i < n; ++i) gs.push_back(grads[i] == nullptr ? Tensor() : *grads[i]);
    torch::autograd::backward(outs, gs, retain_graph != 0, false);
  });
}

// Results are written into `results[0..n_inputs]` as new tensors (undefined where an input
// got no gradient and `allow_unused` is set).
int strata_grad(Tensor* const* outputs, Tensor* const* grads, size_t n_outputs,
                Tensor* const* inputs, size_t n_inputs, int retain_graph, int create_graph,
                int allow_unused, Tensor** results) {
  return guarded([&] {
    auto outs = to_vector(outputs, n_outputs);
    std::vector<Tensor> gs;
    for (size_t i = 0; i < n_outputs; ++i) gs.push_back(grads[i] == nullptr ? Tensor() : *grads[i]);
    auto ins = to_vector(inputs, n_inputs);
    auto res = torch::autograd::grad(outs, ins, gs, retain_graph != 0, create_graph != 0,
                                     allow_unused != 0);
    for (size_t i = 0; i < n_inputs; ++i) results[i] = new Tensor(res[i]);
  });
}

// Makes `grad` (or no gradient, when null) the `.grad` of `t`; autograd then accumulates
// into it in place, which is how parameter gradients land in flat buffers.
int strata_set_grad(Tensor* t, const Tensor* grad) {
  return guarded([&] { t->mutable_grad() = grad == nullptr ? Tensor() : *grad; });
}

int strata_copy_non_blocking(Tensor* dst, const Tensor* src) {
  return guarded([&] { dst->copy_(*src, /*non_blocking=*/true); });
}

int strata_register_hook(Tensor* t, TensorCallback cb, void* data, void (*drop)(void*),
                         uint64_t* handle) {
  auto closure = std::make_shared<RustClosure>(data, drop);
  return guarded([&] {
    *handle = t->register_hook([closure, cb](const Tensor& grad) -> Tensor {
      auto out = call_rust(cb, closure->data, {grad});
      return out.empty() ? Tensor() : out[0];
    });
  });
}

// The name of the autograd node that made `t` (empty for a leaf or a tensor without one),
// written into `name` (at most `capacity` bytes with the terminating zero).
int strata_grad_fn_name(const Tensor* t, char* name, size_t capacity) {
  return guarded([&] {
    std::string n = t->grad_fn() ? t->grad_fn()->name() : std::string();
    std::snprintf(name, capacity, "%s", n.c_str());
  });
}

int strata_remove_hook(Tensor* t, uint64_t handle) {
  return guarded([&] { t->remove_hook(handle); });
}

// Results are handed to `sink` one by one as new tensors owned by the receiver.
int strata_custom_function(Tensor* const* inputs, size_t n, TensorCallback fwd,
                           TensorCallback bwd, void* data, void (*drop)(void*),
                           void (*sink)(void*, Tensor*), void* list) {
  auto closure = c10::make_intrusive<RustClosure>(data, drop);
  return guarded([&] {
    auto args = to_vector(inputs, n);
    auto results = RustFunction::apply(at::TensorList(args), fwd, bwd, closure);
    for (auto& r : results) sink(list, new Tensor(r));
  });
}

// Makes the calling thread's saved tensors go through `pack` and `unpack` until the
// matching `strata_saved_hooks_pop`; `drop(data)` runs once no saved tensor needs it.
int strata_saved_hooks_push(PackCallback pack, UnpackCallback unpack, void* data, void (*drop)(void*)) {
  auto sink = std::make_shared<SavedSink>(pack, unpack, data, drop);
  return guarded([&] {
    static std::once_flag installed;
    std::call_once(installed, [] { torch::autograd::set_default_engine_stub(strata_engine); });
    saved_sinks.push_back(std::move(sink));
  });
}

int strata_saved_hooks_pop() {
  return guarded([&] {
    TORCH_CHECK(!saved_sinks.empty(), "no saved-tensor hooks to pop");
    saved_sinks.pop_back();
  });
}

// ---- storage --------------------------------------------------------------------------

// Releases the memory behind `t` (and every view sharing its storage) while keeping the
// tensor objects alive; `strata_storage_resize` gives it memory again.
int strata_storage_resize(Tensor* t, size_t nbytes) {
  return guarded([&] {
    auto storage = t->storage();
    auto* impl = storage.unsafeGetStorageImpl();
    auto* allocator = impl->allocator();
    TORCH_CHECK(allocator != nullptr, "storage has no allocator to resize with");
    impl->set_data_ptr_noswap(allocator->allocate(nbytes));
    impl->set_nbytes(nbytes);
  });
}

// Points the storage behind `t` (and every view sharing it) at `data`, memory the caller
// owns, counting `nbytes` of it; what the storage held is freed. `release(context)` runs
// once the storage itself goes.
int strata_storage_adopt(Tensor* t, void* data, size_t nbytes, void (*release)(void*), void* context) {
  return guarded([&] {
    auto* impl = t->storage().unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(c10::DataPtr(data, context, release, impl->device()));
    impl->set_nbytes(nbytes);
  });
}

// Exchanges the memory behind two storages of the same size and device: every view of
// `a` then reads what `b`'s views read before, and the other way round.
int strata_storage_swap(Tensor* a, Tensor* b) {
  return guarded([&] {
    auto* x = a->storage().unsafeGetStorageImpl();
    auto* y = b->storage().unsafeGetStorageImpl();
    TORCH_CHECK(x->nbytes() == y->nbytes() && x->device() == y->device(),
                "storages to swap differ in size or device");
    c10::DataPtr held = x->set_data_ptr(c10::DataPtr(nullptr, x->device()));
    x->set_data_ptr_noswap(y->set_data_ptr(std::move(held)));
  });
}

// The bytes the storage behind `t` claims to hold, its memory unchanged.
int strata_storage_set_nbytes(Tensor* t, size_t nbytes) {
  return guarded([&] { t->storage().unsafeGetStorageImpl()->set_nbytes(nbytes); });
}

// A 1-D CPU tensor over `numel` elements at `data`, memory the caller owns:
// `release(context)` runs once the last tensor sharing the storage is gone. Such a storage
// has no allocator, so `strata_storage_resize` refuses it.
int strata_from_blob(void* data, int64_t numel, int dtype, void (*release)(void*), void* context, Tensor** out) {
  return guarded([&] {
    auto options = at::TensorOptions().dtype(static_cast<c10::ScalarType>(dtype)).device(at::kCPU);
    *out = new Tensor(at::from_blob(data, {numel}, [release, context](void*) { release(context); }, options));
  });
}

int strata_storage_nbytes(const Tensor* t, size_t* nbytes) {
  return guarded([&] { *nbytes = t->storage().nbytes(); });
}

// How many tensors (and other holders) share the storage behind `t`.
int strata_storage_use_count(const Tensor* t, size_t* count) {
  return guarded([&] { *count = t->storage().use_count(); });
}

// How many handles (and autograd nodes) hold the tensor `t` is a handle of.
int strata_tensor_use_count(const Tensor* t, size_t* count) {
  return guarded([&] { *count = t->use_count(); });
}

// Identity of the storage behind `t`: views of one buffer share it.
int strata_storage_id(const Tensor* t, uintptr_t* id) {
  return guarded([&] { *id = reinterpret_cast<uintptr_t>(t->storage().unsafeGetStorageImpl()); });
}

// ---- fused optimizers -----------------------------------------------------------------

// Adam or AdamW over lists of tensors. `steps` holds one float scalar tensor per parameter;
// it is incremented here before the update, as torch.optim does. `lr_tensor`, where given
// (a float scalar on the parameters' device), is read there instead of `lr`.
int strata_fused_adam(Tensor* const* params, Tensor* const* grads, Tensor* const* exp_avgs,
                      Tensor* const* exp_avg_sqs, Tensor* const* steps, size_t n, double lr,
                      const Tensor* lr_tensor, double beta1, double beta2, double weight_decay,
                      double eps, int decoupled, int maximize, const Tensor* grad_scale,
                      const Tensor* found_inf) {
  return guarded([&] {
    auto p = to_vector(params, n), g = to_vector(grads, n), m = to_vector(exp_avgs, n),
         v = to_vector(exp_avg_sqs, n), s = to_vector(steps, n);
    at::_foreach_add_(s, 1);
    auto update = [&](const auto& rate) {
      if (decoupled) {
        at::_fused_adamw_(p, g, m, v, {}, s, rate, beta1, beta2, weight_decay, eps, false,
                          maximize != 0, optional_tensor(grad_scale), optional_tensor(found_inf));
      } else {
        at::_fused_adam_(p, g, m, v, {}, s, rate, beta1, beta2, weight_decay, eps, false,
                         maximize != 0, optional_tensor(grad_scale), optional_tensor(found_inf));
      }
    };
    if (lr_tensor != nullptr) {
      update(*lr_tensor);
    } else {
      update(lr);
    }
  });
}

// SGD with momentum and Nesterov. `momentum_buffers` may be empty (n_buffers == 0) when
// momentum is zero.
int strata_fused_sgd(Tensor* const* params, Tensor* const* grads,
                     Tensor* const* momentum_buffers, size_t n, size_t n_buffers,
                     double weight_decay, double momentum, double lr, const Tensor* lr_tensor,
                     double dampening, int nesterov, int maximize, int is_first_step,
                     const Tensor* grad_scale, const Tensor* found_inf) {
  return guarded([&] {
    auto p = to_vector(params, n), g = to_vector(grads, n), b = to_vector(momentum_buffers, n_buffers);
    auto update = [&](const auto& rate) {
      at::_fused_sgd_(p, g, b, weight_decay, momentum, rate, dampening, nesterov != 0,
                      maximize != 0, is_first_step != 0, optional_tensor(grad_scale),
                      optional_tensor(found_inf));
    };
    if (lr_tensor != nullptr) {
      update(*lr_tensor);
    } else {
      update(lr);
    }
  });
}

// ---- oneDNN ---------------------------------------------------------------------------

// oneDNN's inner product as libtorch registers it for its CPU graph compiler
// (`mkldnn::_linear_pointwise`), called on plain strided tensors; null when this libtorch
// has no oneDNN or does not register the op.
const c10::OperatorHandle* onednn_linear_op() {
  static const std::optional<c10::OperatorHandle> op = []() -> std::optional<c10::OperatorHandle> {
    if (!at::hasMKLDNN()) return std::nullopt;
    return c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  }();
  return op ? &*op : nullptr;
}

int strata_onednn_available(int* yes) {
  return guarded([&] { *yes = onednn_linear_op() != nullptr; });
}

// `x @ w.T + b` through oneDNN; `w` may be any strided `[out, in]` matrix (a transposed
// view included), `b` null for none.
int strata_onednn_linear(const Tensor* x, const Tensor* w, const Tensor* b, Tensor** out) {
  return guarded([&] {
    const c10::OperatorHandle* op = onednn_linear_op();
    TORCH_CHECK(op != nullptr, "this libtorch has no oneDNN linear");
    torch::jit::Stack stack;
    stack.emplace_back(*x);
    stack.emplace_back(*w);
    stack.emplace_back(b == nullptr ? c10::IValue() : c10::IValue(*b));
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<std::optional<c10::Scalar>>());
    stack.emplace_back(c10::IValue());
    op->callBoxed(&stack);
    *out = new Tensor(stack.at(0).toTensor());
  });
}

// ---- kernel traces ---------------------------------------------------------------------

namespace {
namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;
}  // namespace

// Starts libtorch's Kineto profiler on the calling thread: operators with their inputs'
// shapes and strides, and with `cuda` the device's kernels, copies and runtime calls
// (through CUPTI).
int strata_kineto_start(int cuda) {
  return guarded([&] {
    ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/true);
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda) activities.insert(ActivityType::CUDA);
    kineto::prepareProfiler(config, activities);
    kineto::enableProfiler(config, activities);
  });
}

// Stops the profiler started on this thread and writes its Chrome trace to `path`.
int strata_kineto_save(const char* path) {
  return guarded([&] {
    auto result = kineto::disableProfiler();
    TORCH_CHECK(result != nullptr, "no kernel trace was being recorded");
    result->save(path);
  });
}

// ---- CUDA -----------------------------------------------------------------------------

#ifdef STRATA_CUDA
// Also initialises libtorch's CUDA state (its caching allocator among it) as a first
// tensor on the device would, so statistics can be read before any allocation.
#define STRATA_REQUIRE_CUDA()                                               \
  TORCH_CHECK(c10::cuda::device_count() > 0, "no CUDA device is visible"); \
  at::globalContext().lazyInitDevice(at::kCUDA)
#else
#define STRATA_REQUIRE_CUDA() \
  TORCH_CHECK(false, "Strata was built against a libtorch without CUDA: scripts/setup.sh installs PyPI's CUDA torch and its nvidia headers, then rebuild")
#endif

#ifdef STRATA_CUDA
namespace {
// Counts the warnings libtorch's sync debug mode raises on a thread where counting is on:
// one per host-device synchronisation (copies to pageable host memory, `.item()`, stream
// and device synchronisations). Other warnings go on to the handler that was there before.
std::atomic<int64_t> syncs_counted{0};
struct SyncCounter final : c10::WarningHandler {
  c10::WarningHandler* previous = nullptr;
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("synchronizing CUDA operation") != std::string::npos) {
      syncs_counted.fetch_add(1, std::memory_order_relaxed);
    } else if (previous != nullptr) {
      previous->process(warning);
    }
  }
};
thread_local SyncCounter sync_counter;
}  // namespace
#endif

int strata_cuda_is_built() {
#ifdef STRATA_CUDA
  return 1;
#else
  return 0;
#endif
}

int strata_cuda_capability(int device, int* major, int* minor) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    int count = 0;
    cudaGetDeviceCount(&count);
    if (device < 0 || device >= count) throw std::runtime_error("no such CUDA device");
    cudaDeviceProp props;
    if (cudaGetDeviceProperties(&props, device) != cudaSuccess) throw std::runtime_error("cudaGetDeviceProperties failed");
    *major = props.major;
    *minor = props.minor;
#else
    (void)device;
    (void)major;
    (void)minor;
#endif
  });
}

// Writes the device's name, NUL-terminated and cut to `len` bytes.
int strata_cuda_device_name(int device, char* name, int len) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    cudaDeviceProp props;
    if (cudaGetDeviceProperties(&props, device) != cudaSuccess) throw std::runtime_error("no such CUDA device");
    std::snprintf(name, static_cast<size_t>(len), "%s", props.name);
#else
    (void)device;
    (void)name;
    (void)len;
#endif
  });
}

// stats: allocated current, allocated peak, reserved current, reserved peak (bytes).
int strata_cuda_memory_stats(int device, int64_t* stats) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
    constexpr size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    stats[0] = s.allocated_bytes[all].current;
    stats[1] = s.allocated_bytes[all].peak;
    stats[2] = s.reserved_bytes[all].current;
    stats[3] = s.reserved_bytes[all].peak;
#else
    (void)device;
    (void)stats;
#endif
  });
}

// Page-locks `bytes` of host memory from `data` (memory the caller maps and keeps), so that
// copies between it and any GPU go directly, not staged through a pinned buffer.
int strata_cuda_host_register(void* data, size_t bytes) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    C10_CUDA_CHECK(cudaHostRegister(data, bytes, cudaHostRegisterPortable));
#else
    (void)data;
    (void)bytes;
#endif
  });
}

// Undoes strata_cuda_host_register for the memory starting at `data`.
int strata_cuda_host_unregister(void* data) {
  return guarded([&] {
#ifdef STRATA_CUDA
    C10_CUDA_CHECK(cudaHostUnregister(data));
#else
    (void)data;
#endif
  });
}

// Hands the caching allocator's unused blocks back to the driver, for other processes.
int strata_cuda_empty_cache() {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  });
}

int strata_cuda_reset_peak_stats(int device) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    c10::cuda::CUDACachingAllocator::resetPeakStats(device);
#else
    (void)device;
#endif
  });
}

// Streams are identified by their packed c10 representation, which is plain data.
#ifdef STRATA_CUDA
static void pack_stream(const c10::cuda::CUDAStream& stream, int64_t* packed) {
  auto p = stream.pack3();
  packed[0] = p.stream_id;
  packed[1] = p.device_index;
  packed[2] = static_cast<int64_t>(p.device_type);
}

static c10::cuda::CUDAStream unpack_stream(const int64_t* packed) {
  return c10::cuda::CUDAStream::unpack3(packed[0], static_cast<c10::DeviceIndex>(packed[1]),
                                        static_cast<c10::DeviceType>(packed[2]));
}
#endif

int strata_cuda_stream_from_pool(int device, int high_priority, int64_t* packed) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    pack_stream(c10::cuda::getStreamFromPool(high_priority != 0, device), packed);
#else
    (void)device;
    (void)high_priority;
    (void)packed;
#endif
  });
}

int strata_cuda_current_stream(int device, int64_t* packed) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    pack_stream(c10::cuda::getCurrentCUDAStream(device), packed);
#else
    (void)device;
    (void)packed;
#endif
  });
}

int strata_cuda_set_current_stream(const int64_t* packed) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    c10::cuda::setCurrentCUDAStream(unpack_stream(packed));
#else
    (void)packed;
#endif
  });
}

int strata_cuda_stream_synchronize(const int64_t* packed) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    unpack_stream(packed).synchronize();
#else
    (void)packed;
#endif
  });
}

int strata_cuda_event_new(int enable_timing, void** event) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    *event = new at::cuda::CUDAEvent(enable_timing ? cudaEventDefault : cudaEventDisableTiming);
#else
    (void)enable_timing;
    (void)event;
#endif
  });
}

void strata_cuda_event_free(void* event) {
#ifdef STRATA_CUDA
  delete static_cast<at::cuda::CUDAEvent*>(event);
#else
  (void)event;
#endif
}

int strata_cuda_event_record(void* event, const int64_t* packed) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    static_cast<at::cuda::CUDAEvent*>(event)->record(unpack_stream(packed));
#else
    (void)event;
    (void)packed;
#endif
  });
}

int strata_cuda_event_wait(void* event, const int64_t* packed) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    static_cast<at::cuda::CUDAEvent*>(event)->block(unpack_stream(packed));
#else
    (void)event;
    (void)packed;
#endif
  });
}

int strata_cuda_event_synchronize(void* event) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    if (c10::WarningUtils::get_warning_handler() == &sync_counter) {
      syncs_counted.fetch_add(1, std::memory_order_relaxed);
    }
    static_cast<at::cuda::CUDAEvent*>(event)->synchronize();
#else
    (void)event;
#endif
  });
}

// A CUDA graph captured from the work queued between begin and end on one device. Capture
// runs on a stream of the pool (a graph cannot be captured on the default stream), which
// first waits for the stream that was current; end makes that stream current again and
// orders it after the capture. Replays run on the stream current then.
#ifdef STRATA_CUDA
namespace {
struct Capture {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream previous;
  c10::cuda::CUDAStream capturing;
  explicit Capture(c10::DeviceIndex device)
      : previous(c10::cuda::getCurrentCUDAStream(device)),
        capturing(c10::cuda::getStreamFromPool(false, device)) {}
  // Back to the stream that was current, after everything the capture stream queued.
  void restore() {
    at::cuda::CUDAEvent done;
    done.record(capturing);
    c10::cuda::setCurrentCUDAStream(previous);
    done.block(previous);
  }
};
}  // namespace
#endif

int strata_cuda_graph_begin(int device, void** out) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    auto capture = std::make_unique<Capture>(static_cast<c10::DeviceIndex>(device));
    at::cuda::CUDAEvent ready;
    ready.record(capture->previous);
    ready.block(capture->capturing);
    c10::cuda::setCurrentCUDAStream(capture->capturing);
    try {
      capture->graph.capture_begin();
    } catch (...) {
      c10::cuda::setCurrentCUDAStream(capture->previous);
      throw;
    }
    *out = capture.release();
#else
    (void)device;
    (void)out;
#endif
  });
}

#ifdef STRATA_CUDA
namespace {
// After a capture_end that failed or never ran: ends the capture whatever its state, drops
// what was captured, gives the graph's memory pool back to the allocator, and makes the
// stream that was current before the capture current again.
void abandon(Capture* capture) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(capture->capturing.stream(), &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    cudaGraph_t dropped = nullptr;
    cudaStreamEndCapture(capture->capturing.stream(), &dropped);
    if (dropped != nullptr) cudaGraphDestroy(dropped);
  }
  (void)cudaGetLastError();
  auto device = capture->capturing.device_index();
  // Either may already be done, by a capture_end that failed after it.
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device, capture->graph.pool());
  } catch (...) {
  }
  try {
    c10::cuda::CUDACachingAllocator::releasePool(device, capture->graph.pool());
  } catch (...) {
  }
  c10::cuda::setCurrentCUDAStream(capture->previous);
}
}  // namespace
#endif

// Ends the capture (once). With `keep` false (the captured work failed on the host) the
// capture is ended and dropped whatever state it is in, and no error is reported for it.
int strata_cuda_graph_end(void* handle, int keep) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    auto* capture = static_cast<Capture*>(handle);
    try {
      capture->graph.capture_end();
    } catch (...) {
      abandon(capture);
      if (keep) throw;
      return;
    }
    if (keep) {
      capture->restore();
    } else {
      // Work that failed on the host: its graph is dropped with the capture.
      c10::cuda::setCurrentCUDAStream(capture->previous);
    }
#else
    (void)handle;
    (void)keep;
#endif
  });
}

int strata_cuda_graph_replay(void* handle) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    static_cast<Capture*>(handle)->graph.replay();
#else
    (void)handle;
#endif
  });
}

void strata_cuda_graph_free(void* handle) {
#ifdef STRATA_CUDA
  delete static_cast<Capture*>(handle);
#else
  (void)handle;
#endif
}

int strata_cuda_count_syncs(int on) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    bool counting = c10::WarningUtils::get_warning_handler() == &sync_counter;
    if (on && !counting) {
      sync_counter.previous = c10::WarningUtils::get_warning_handler();
      c10::WarningUtils::set_warning_handler(&sync_counter);
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    } else if (!on && counting) {
      c10::WarningUtils::set_warning_handler(sync_counter.previous);
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    }
#else
    (void)on;
#endif
  });
}

int64_t strata_cuda_syncs_counted() {
#ifdef STRATA_CUDA
  return syncs_counted.load(std::memory_order_relaxed);
#else
  return 0;
#endif
}

int strata_cuda_event_query(void* event, int* done) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    *done = static_cast<at::cuda::CUDAEvent*>(event)->query() ? 1 : 0;
#else
    (void)event;
    (void)done;
#endif
  });
}

int strata_cuda_event_elapsed_ms(void* start, void* end, float* ms) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    *ms = static_cast<at::cuda::CUDAEvent*>(start)->elapsed_time(
        *static_cast<at::cuda::CUDAEvent*>(end));
#else
    (void)start;
    (void)end;
    (void)ms;
#endif
  });
}

// ---- NCCL ------------------------------------------------------------------------------
// Collectives enqueued on torch's current stream of the tensors' device, each followed by a
// recorded event the caller waits on, so they are ordered with the compute around them.

#ifdef STRATA_CUDA
#define STRATA_NCCL(call)                                                                \
  do {                                                                                   \
    ncclResult_t r = (call);                                                             \
    TORCH_CHECK(r == ncclSuccess, "NCCL: ", ncclGetErrorString(r), " (in " #call ")"); \
  } while (0)

static ncclDataType_t nccl_type(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: TORCH_CHECK(false, "NCCL cannot move ", t.scalar_type(), " tensors");
  }
}

static ncclRedOp_t nccl_op(int op) {
  switch (op) {
    case 0: return ncclSum;
    case 1: return ncclAvg;
    case 2: return ncclMax;
    case 3: return ncclMin;
    default: TORCH_CHECK(false, "unknown reduce op ", op);
  }
}
#endif

// The 128-byte id rank 0 makes and every rank needs to join.
int strata_nccl_unique_id(char* id) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    static_assert(sizeof(ncclUniqueId) == 128, "NCCL unique id is 128 bytes");
    ncclUniqueId u;
    STRATA_NCCL(ncclGetUniqueId(&u));
    std::memcpy(id, &u, sizeof(u));
#else
    (void)id;
#endif
  });
}

int strata_nccl_comm_init(const char* id, int nranks, int rank, int device, void** comm) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    ncclUniqueId u;
    std::memcpy(&u, id, sizeof(u));
    ncclComm_t c;
    STRATA_NCCL(ncclCommInitRank(&c, nranks, u, rank));
    *comm = c;
#else
    (void)id;
    (void)nranks;
    (void)rank;
    (void)device;
    (void)comm;
#endif
  });
}

void strata_nccl_comm_destroy(void* comm) {
#ifdef STRATA_CUDA
  if (comm != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm));
#else
  (void)comm;
#endif
}

// kind: 0 all_reduce(t[0]), 1 broadcast(t[0], root), 2 reduce(t[0], root), 3 send(t[0], peer),
// 4 recv(t[0], peer), 5 all_gather(outputs t[0..n-1], input t[n-1]), 6 reduce_scatter(output
// t[0], inputs t[1..n]), 7 all_to_all(outputs t[0..m], inputs t[m..2m]).
// On success *event is a new CUDA event recorded after the operation (free it with
// strata_cuda_event_free).
int strata_nccl_collective(void* comm, int kind, Tensor* const* tensors, size_t n, int op, int peer, int nranks,
                           void** event) {
  return guarded([&] {
    STRATA_REQUIRE_CUDA();
#ifdef STRATA_CUDA
    auto c = static_cast<ncclComm_t>(comm);
    TORCH_CHECK(n > 0, "NCCL collective without tensors");
    const Tensor& first = *tensors[0];
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(tensors[i]->is_cuda() && tensors[i]->is_contiguous(), "NCCL needs contiguous CUDA tensors");
      TORCH_CHECK(tensors[i]->device() == first.device(), "NCCL tensors must share one device");
    }
    c10::cuda::CUDAGuard guard(first.device());
    auto stream = c10::cuda::getCurrentCUDAStream(first.device().index());
    switch (kind) {
      case 0:
        STRATA_NCCL(ncclAllReduce(first.data_ptr(), first.data_ptr(), first.numel(), nccl_type(first), nccl_op(op), c, stream));
        break;
      case 1:
        STRATA_NCCL(ncclBroadcast(first.data_ptr(), first.data_ptr(), first.numel(), nccl_type(first), peer, c, stream));
        break;
      case 2:
        STRATA_NCCL(ncclReduce(first.data_ptr(), first.data_ptr(), first.numel(), nccl_type(first), nccl_op(op), peer, c, stream));
        break;
      case 3:
        STRATA_NCCL(ncclSend(first.data_ptr(), first.numel(), nccl_type(first), peer, c, stream));
        break;
      case 4:
        STRATA_NCCL(ncclRecv(first.data_ptr(), first.numel(), nccl_type(first), peer, c, stream));
        break;
      case 5: {
        // Uneven sizes: one broadcast per rank, rooted at the rank that owns the piece.
        const Tensor& input = *tensors[n - 1];
        STRATA_NCCL(ncclGroupStart());
        for (int r = 0; r < nranks; ++r) {
          const Tensor& out = *tensors[r];
          const void* send = r == peer ? input.data_ptr() : out.data_ptr();
          STRATA_NCCL(ncclBroadcast(send, out.data_ptr(), out.numel(), nccl_type(out), r, c, stream));
        }
        STRATA_NCCL(ncclGroupEnd());
        break;
      }
      case 6: {
        std::vector<Tensor> inputs;
        for (size_t i = 1; i < n; ++i) inputs.push_back(*tensors[i]);
        auto flat = at::cat(inputs);
        STRATA_NCCL(ncclReduceScatter(flat.data_ptr(), first.data_ptr(), first.numel(), nccl_type(first), nccl_op(op), c, stream));
        // Keep the concatenation alive until the stream is done with it.
        flat.record_stream(stream);
        break;
      }
      case 7: {
        size_t m = n / 2;
        STRATA_NCCL(ncclGroupStart());
        for (size_t r = 0; r < m; ++r) {
          const Tensor& out = *tensors[r];
          const Tensor& in = *tensors[m + r];
          STRATA_NCCL(ncclSend(in.data_ptr(), in.numel(), nccl_type(in), static_cast<int>(r), c, stream));
          STRATA_NCCL(ncclRecv(out.data_ptr(), out.numel(), nccl_type(out), static_cast<int>(r), c, stream));
        }
        STRATA_NCCL(ncclGroupEnd());
        break;
      }
      default:
        TORCH_CHECK(false, "unknown NCCL collective ", kind);
    }
    auto* done = new at::cuda::CUDAEvent(cudaEventDisableTiming);
    done->record(stream);
    *event = done;
#else
    (void)comm;
    (void)kind;
    (void)tensors;
    (void)n;
    (void)op;
    (void)peer;
    (void)nranks;
    (void)event;
#endif
  });
}

int strata_cpu_memory_track() {
  return guarded([&] {
    if (counting_allocator != nullptr) return;
    auto* counter = new CountingAllocator();
    counter->base = c10::GetDefaultCPUAllocator();
    CountingAllocator::instance = counter;
    c10::SetCPUAllocator(counter, /*priority=*/1);
    counting_allocator = counter;
  });
}

int strata_cpu_memory_stats(int64_t* current, int64_t* peak) {
  return guarded([&] {
    if (counting_allocator == nullptr) throw std::runtime_error("CPU memory tracking is not on");
    *current = counting_allocator->current.load();
    *peak = counting_allocator->peak.load();
  });
}

// Counts host memory libtorch did not allocate (shared buffers made by the caller) in the
// statistics, `bytes` more or, negative, fewer; nothing while tracking is off.
int strata_cpu_memory_account(int64_t bytes) {
  return guarded([&] {
    if (counting_allocator != nullptr) counting_allocator->add(bytes);
  });
}

int strata_cpu_memory_reset_peak() {
  return guarded([&] {
    if (counting_allocator == nullptr) throw std::runtime_error("CPU memory tracking is not on");
    counting_allocator->peak.store(counting_allocator->current.load());
  });
}

// libtorch's autocast on one device type (CUDA: 1); `dtype` is a c10::ScalarType code.
int strata_autocast_set(int device_type, int enabled, int dtype) {
  return guarded([&] {
    auto device = static_cast<at::DeviceType>(device_type);
    at::autocast::set_autocast_enabled(device, enabled != 0);
    if (enabled != 0) {
      at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(dtype));
      at::autocast::increment_nesting();
    } else if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
  });
}

// ---- c10d's TCPStore (the store torchrun's agent hosts) ----------------------------------

using StoreHandle = c10::intrusive_ptr<c10d::Store>;

static c10d::Store& store_of(void* s) { return **static_cast<StoreHandle*>(s); }

static uint8_t* copy_out(const std::vector<uint8_t>& v, size_t* len) {
  *len = v.size();
  auto* out = static_cast<uint8_t*>(std::malloc(v.empty() ? 1 : v.size()));
  if (out == nullptr) throw std::bad_alloc();
  if (!v.empty()) std::memcpy(out, v.data(), v.size());
  return out;
}

// A client of the TCPStore at host:port (or, with is_server, one hosting it; port 0 picks
// one). Every call waits at most timeout_ms.
int strata_c10d_store_new(const char* host, int port, int is_server, int64_t timeout_ms, void** out) {
  return guarded([&] {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(port);
    o.isServer = is_server != 0;
    o.waitWorkers = false;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    *out = new StoreHandle(c10::make_intrusive<c10d::TCPStore>(std::string(host), o));
  });
}

void strata_c10d_store_free(void* s) { delete static_cast<StoreHandle*>(s); }

int strata_c10d_store_port(void* s, int* port) {
  return guarded([&] { *port = static_cast<c10d::TCPStore&>(store_of(s)).getPort(); });
}

void strata_free_bytes(uint8_t* p) { std::free(p); }

int strata_c10d_set(void* s, const char* key, size_t klen, const uint8_t* v, size_t vlen) {
  return guarded([&] { store_of(s).set(std::string(key, klen), std::vector<uint8_t>(v, v + vlen)); });
}

int strata_c10d_get(void* s, const char* key, size_t klen, int64_t timeout_ms, uint8_t** out, size_t* len) {
  return guarded([&] {
    std::string k(key, klen);
    store_of(s).wait({k}, std::chrono::milliseconds(timeout_ms));
    *out = copy_out(store_of(s).get(k), len);
  });
}

int strata_c10d_add(void* s, const char* key, size_t klen, int64_t delta, int64_t* out) {
  return guarded([&] { *out = store_of(s).add(std::string(key, klen), delta); });
}

int strata_c10d_compare_set(void* s, const char* key, size_t klen, const uint8_t* e, size_t elen, const uint8_t* d,
                            size_t dlen, uint8_t** out, size_t* len) {
  return guarded([&] {
    auto now = store_of(s).compareSet(std::string(key, klen), std::vector<uint8_t>(e, e + elen),
                                      std::vector<uint8_t>(d, d + dlen));
    *out = copy_out(now, len);
  });
}

static std::vector<std::string> keys_of(const char* const* keys, const size_t* lens, size_t n) {
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) out.emplace_back(keys[i], lens[i]);
  return out;
}

int strata_c10d_wait(void* s, const char* const* keys, const size_t* lens, size_t n, int64_t timeout_ms) {
  return guarded([&] { store_of(s).wait(keys_of(keys, lens, n), std::chrono::milliseconds(timeout_ms)); });
}

int strata_c10d_check(void* s, const char* const* keys, const size_t* lens, size_t n, int* out) {
  return guarded([&] { *out = store_of(s).check(keys_of(keys, lens, n)) ? 1 : 0; });
}

}  // extern "C"

// ---- CPU kernels: GELU (tanh form), SwiGLU, RMSNorm, rotary positions ------------------

namespace {
// GELU's tanh form, x/2 · (1 + tanh(u)) with u = √(2/π)·(x + 0.044715·x³), equals
// x · σ(2u) = x / (1 + e^(−2u)) exactly. Written that way it needs one exponential, keeps
// its relative precision where tanh(u) nears −1 (where 1 + tanh(u) cancels), and
// vectorises; libtorch's kernel evaluates tanh itself, several times slower on one core.
constexpr float kGeluScale = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluCubic = 0.044715f;

// e^t to about one ulp for t in [−87, 88.37], +∞ above (n = 128 makes the exponent bits
// +∞) and 0 below −87 (σ needs no more range): t = n·ln2 + r, |r| ≤ ln2/2, a degree-7
// Taylor polynomial in r, and 2^n made from exponent bits. Free of branches and calls so
// that the loops below vectorise. NaN gives a finite value: callers' results stay NaN
// through their other operand. Needs IEEE arithmetic (no -ffast-math, which would fold the
// rounding below away).
inline __attribute__((always_inline)) float exp_clamped(float t) {
  // In range or at an end, NaN included, so the conversion to an integer below is defined.
  const float c = t > -87.0f ? (t < 89.0f ? t : 89.0f) : -87.0f;
  // Adding and taking away 1.5·2^23 rounds to the nearest integer in any rounding of the sum.
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = std::fma(n, -0.693145751953125f, c);  // ln2's leading bits: n·hi is exact
  r = std::fma(n, -1.428606765330187e-06f, r);    // and the rest of ln2
  float p = 1.0f / 5040;
  p = std::fma(p, r, 1.0f / 720);
  p = std::fma(p, r, 1.0f / 120);
  p = std::fma(p, r, 1.0f / 24);
  p = std::fma(p, r, 1.0f / 6);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return t < -87.0f ? 0.0f : p * scale;
}

// σ = 1/(1 + e) for e = e^(−z), and 1 − σ as e·σ rather than a difference that cancels where
// σ nears 1; where e is +∞, σ is 0 and 1 − σ is 1.
struct Sigmoid {
  float s, one_minus_s;
};
inline __attribute__((always_inline)) Sigmoid sigmoid_of_exp(float e) {
  const float s = 1.0f / (1.0f + e);
  return {s, e == std::numeric_limits<float>::infinity() ? 1.0f : e * s};
}

// One clone per x86-64 level (GCC 12 or newer), chosen once at load time by the CPU's
// features, so one binary runs everywhere and uses AVX-512 or AVX2 with FMA where the CPU
// has them. build.rs compiles this file at -O3, which vectorises the loops.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define STRATA_VECTOR_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define STRATA_VECTOR_KERNEL
#endif

STRATA_VECTOR_KERNEL void gelu_tanh_forward(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = kGeluScale * std::fma(kGeluCubic * v * v, v, v);
    y[i] = v / (1.0f + exp_clamped(-2.0f * u));
  }
}

// d/dx x·σ(2u) = σ + x·σ·(1 − σ)·2u'.
STRATA_VECTOR_KERNEL void gelu_tanh_backward(const float* g, const float* x, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float v2 = v * v;
    const float u = kGeluScale * std::fma(kGeluCubic * v2, v, v);
    const Sigmoid sg = sigmoid_of_exp(exp_clamped(-2.0f * u));
    const float du = 2.0f * kGeluScale * std::fma(3.0f * kGeluCubic, v2, 1.0f);
    dx[i] = g[i] * std::fma(v * sg.one_minus_s * sg.s, du, sg.s);
  }
}

// SwiGLU, silu(g)·u = g·σ(g)·u, in one pass over both inputs (libtorch makes silu(g) and
// keeps it for the product's backward: a third tensor of the gate's size).
STRATA_VECTOR_KERNEL void swiglu_forward(const float* gate, const float* up, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + exp_clamped(-g)) * up[i];
  }
}

// d/dg = dy·u·σ·(1 + g·(1 − σ)) and d/du = dy·g·σ.
STRATA_VECTOR_KERNEL void swiglu_backward(const float* dy, const float* gate, const float* up, float* dgate,
                                          float* dup, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const Sigmoid sg = sigmoid_of_exp(exp_clamped(-g));
    dup[i] = dy[i] * (g * sg.s);
    dgate[i] = dy[i] * up[i] * sg.s * std::fma(g, sg.one_minus_s, 1.0f);
  }
}

// Σ term(i) for i < n in 16 interleaved partial sums, which the vectoriser keeps in one
// register: a single running sum would wait on its own previous addition every time (and
// the compiler may not reorder float additions to split it).
template <typename Term>
inline __attribute__((always_inline)) float sum16(int64_t n, const Term& term) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += term(i + j);
  }
  float sum = 0.0f;
  for (; i < n; ++i) sum += term(i);
  for (int j = 0; j < 16; ++j) sum += acc[j];
  return sum;
}

// RMSNorm of one row of `d` features, y = x·r·w with r = 1/√(mean(x²) + eps); returns r.
STRATA_VECTOR_KERNEL float rms_norm_row(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ y, int64_t d, float eps) {
  const float squares = sum16(d, [&](int64_t i) { return x[i] * x[i]; });
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * r * w[i];
  return r;
}

// The gradients of one row: dx = r·(w·dy − x·r²·mean(w·dy·x)), and the row's share of the
// weight's, dw += dy·x·r, summed in f64 so that the error of a sum over many rows does not
// grow with their number.
STRATA_VECTOR_KERNEL void rms_norm_row_backward(const float* __restrict__ dy, const float* __restrict__ x,
                                                const float* __restrict__ w, float r, float* __restrict__ dx,
                                                double* __restrict__ dw, int64_t d) {
  const float dot = sum16(d, [&](int64_t i) { return w[i] * dy[i] * x[i]; });
  const float k = r * r * dot / static_cast<float>(d);
  for (int64_t i = 0; i < d; ++i) {
    dx[i] = r * (w[i] * dy[i] - x[i] * k);
    dw[i] += static_cast<double>(dy[i] * x[i] * r);
  }
}

// Rotary positions for one row of `d` (even) features: x·cos + rotate_half(x)·sin, where
// rotate_half(x) = (−x₂, x₁) for the halves x₁, x₂; `x` may be a strided row.
STRATA_VECTOR_KERNEL void rotary_row(const float* __restrict__ x, const float* __restrict__ cos,
                                     const float* __restrict__ sin, float* __restrict__ y, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    y[i] = x[i] * cos[i] - x[i + h] * sin[i];
    y[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h];
  }
}

// Its transpose, the input's gradient: dy·cos + (s₂·dy₂, −s₁·dy₁) with s = sin.
STRATA_VECTOR_KERNEL void rotary_row_backward(const float* __restrict__ dy, const float* __restrict__ cos,
                                              const float* __restrict__ sin, float* __restrict__ dx, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    dx[i] = dy[i] * cos[i] + dy[i + h] * sin[i + h];
    dx[i + h] = dy[i + h] * cos[i + h] - dy[i] * sin[i];
  }
}

// Runs `kernel(begin, end)` over [0, n) on libtorch's intra-op threads, with libtorch's
// grain for elementwise kernels (below it one thread does the whole range).
template <typename Kernel>
void over_elements(int64_t n, const Kernel& kernel) {
  at::parallel_for(0, n, at::internal::GRAIN_SIZE, kernel);
}

using strata_kernels::first_order_only;

// A new contiguous tensor of `like`'s shape, dtype and device.
Tensor empty_as(const Tensor& like) { return at::empty(like.sizes(), like.options()); }

struct GeluTanh : public torch::autograd::Function<GeluTanh> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x) {
    Tensor input = x.contiguous();
    Tensor y = empty_as(input);
    float* out = y.mutable_data_ptr<float>();
    const float* in = input.const_data_ptr<float>();
    over_elements(input.numel(), [&](int64_t begin, int64_t end) {
      gelu_tanh_forward(in + begin, out + begin, end - begin);
    });
    ctx->save_for_backward({input});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    first_order_only("GELU");
    Tensor x = ctx->get_saved_variables()[0];
    Tensor g = grads[0].contiguous();
    Tensor dx = empty_as(x);
    float* out = dx.mutable_data_ptr<float>();
    const float* gp = g.const_data_ptr<float>();
    const float* xp = x.const_data_ptr<float>();
    over_elements(x.numel(), [&](int64_t begin, int64_t end) {
      gelu_tanh_backward(gp + begin, xp + begin, out + begin, end - begin);
    });
    return {dx};
  }
};

struct SwiGlu : public torch::autograd::Function<SwiGlu> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& gate, const Tensor& up) {
    Tensor g = gate.contiguous(), u = up.contiguous();
    Tensor y = empty_as(g);
    float* out = y.mutable_data_ptr<float>();
    const float* gp = g.const_data_ptr<float>();
    const float* up_data = u.const_data_ptr<float>();
    over_elements(g.numel(), [&](int64_t begin, int64_t end) {
      swiglu_forward(gp + begin, up_data + begin, out + begin, end - begin);
    });
    ctx->save_for_backward({g, u});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    first_order_only("SwiGLU");
    auto saved = ctx->get_saved_variables();
    const Tensor &g = saved[0], &u = saved[1];
    Tensor dy = grads[0].contiguous();
    Tensor dgate = empty_as(g), dup = empty_as(u);
    float* dg = dgate.mutable_data_ptr<float>();
    float* du = dup.mutable_data_ptr<float>();
    const float* dyp = dy.const_data_ptr<float>();
    const float* gp = g.const_data_ptr<float>();
    const float* up_data = u.const_data_ptr<float>();
    over_elements(g.numel(), [&](int64_t begin, int64_t end) {
      swiglu_backward(dyp + begin, gp + begin, up_data + begin, dg + begin, du + begin, end - begin);
    });
    return {dgate, dup};
  }
};

// RMSNorm over the last dimension with a weight, keeping the input and each row's r for
// backward (libtorch's composite keeps the input, its square's mean and r·x).
struct RmsNorm : public torch::autograd::Function<RmsNorm> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps) {
    Tensor input = x.contiguous(), w = weight.contiguous();
    const int64_t d = input.size(-1), rows = d == 0 ? 0 : input.numel() / d;
    Tensor y = empty_as(input), r = at::empty({rows}, input.options());
    const float *in = input.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
    float *out = y.mutable_data_ptr<float>(), *rp = r.mutable_data_ptr<float>();
    at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(d, 1)),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t row = begin; row < end; ++row) {
                         rp[row] = rms_norm_row(in + row * d, wp, out + row * d, d, static_cast<float>(eps));
                       }
                     });
    ctx->save_for_backward({input, w, r});
    return y;
  }

  // Rows are split over threads; each thread sums its rows' weight gradients into its own
  // f64 row of `partial`, and the rows of `partial` are summed at the end.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    first_order_only("RMSNorm");
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &r = saved[2];
    Tensor dy = grads[0].contiguous();
    const int64_t d = x.size(-1), rows = r.numel();
    Tensor dx = empty_as(x);
    Tensor partial = at::zeros({at::get_num_threads(), d}, x.options().dtype(at::kDouble));
    const float *dyp = dy.const_data_ptr<float>(), *xp = x.const_data_ptr<float>();
    const float *wp = w.const_data_ptr<float>(), *rp = r.const_data_ptr<float>();
    float* dxp = dx.mutable_data_ptr<float>();
    double* pp = partial.mutable_data_ptr<double>();
    at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(d, 1)),
                     [&](int64_t begin, int64_t end) {
                       double* dw = pp + at::get_thread_num() * d;
                       for (int64_t row = begin; row < end; ++row) {
                         rms_norm_row_backward(dyp + row * d, xp + row * d, wp, rp[row], dxp + row * d, dw, d);
                       }
                     });
    return {dx, partial.sum(0).to(at::kFloat), Tensor()};
  }
};

// Applies `row(in, cos, sin, out, d)` to every row of `[B, H, T, D]` `x` (rows of D features
// with unit stride, others any), with the tables' row of the row's position, into a new
// contiguous tensor.
template <typename Row>
Tensor by_rows(const Tensor& x, const Tensor& cos, const Tensor& sin, const Row& row) {
  const int64_t heads = x.size(1), t = x.size(2), d = x.size(3);
  Tensor y = empty_as(x);
  if (y.numel() == 0) return y;
  const float* in = x.const_data_ptr<float>();
  const float *c = cos.const_data_ptr<float>(), *s = sin.const_data_ptr<float>();
  float* out = y.mutable_data_ptr<float>();
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  at::parallel_for(0, x.numel() / d, std::max<int64_t>(1, at::internal::GRAIN_SIZE / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / (heads * t), hh = r / t % heads, p = r % t;
      row(in + b * sb + hh * sh + p * st, c + p * d, s + p * d, out + r * d, d);
    }
  });
  return y;
}

struct Rotary : public torch::autograd::Function<Rotary> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& cos,
                        const Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return by_rows(x.stride(3) == 1 ? x : x.contiguous(), cos, sin, rotary_row);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    first_order_only("rotary");
    auto saved = ctx->get_saved_variables();
    Tensor dy = grads[0].contiguous();
    return {by_rows(dy, saved[0], saved[1], rotary_row_backward), Tensor(), Tensor()};
  }
};

bool own_kernel_serves(const Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; }

// Wraps a served result (or none) for the Rust side.
[[maybe_unused]] Tensor* owned(std::optional<Tensor> result) {
  return result ? new Tensor(std::move(*result)) : nullptr;
}
}  // namespace

extern "C" {

// The kernels below leave `*out` null where they do not serve the inputs, for the caller's
// own composite: the vectorised kernels serve fp32 CPU tensors, and, in a build with the
// CUDA build, the CUDA kernels (cuda_kernels.h) serve fp32, bf16 and fp16 GPU tensors.
// Each records a backward without a second derivative.

// GELU, tanh form, of any shape.
int strata_gelu_tanh(const Tensor* x, Tensor** out) {
  return guarded([&] {
    if (own_kernel_serves(*x)) {
      *out = new Tensor(GeluTanh::apply(*x));
      return;
    }
#ifdef STRATA_CUDA
    *out = owned(strata_cuda::gelu_tanh(*x));
#else
    *out = nullptr;
#endif
  });
}

// Rotary positions of `[B, H, T, D]` `x` (even D) with contiguous `[T, D]` tables that take
// no gradient.
int strata_rotary(const Tensor* x, const Tensor* cos, const Tensor* sin, Tensor** out) {
  return guarded([&] {
    const bool tables = cos->dim() == 2 && cos->sizes() == sin->sizes() && cos->is_contiguous() &&
                        sin->is_contiguous() && !cos->requires_grad() && !sin->requires_grad();
    const bool own = own_kernel_serves(*x) && own_kernel_serves(*cos) && own_kernel_serves(*sin) && tables &&
                     x->dim() == 4 && x->size(2) == cos->size(0) && x->size(3) == cos->size(1) &&
                     x->size(3) % 2 == 0;
    if (own) {
      *out = new Tensor(Rotary::apply(*x, *cos, *sin));
      return;
    }
#ifdef STRATA_CUDA
    *out = owned(strata_cuda::rotary(*x, *cos, *sin));
#else
    *out = nullptr;
#endif
  });
}

// RMSNorm over the last dimension of `x` with a weight of that size.
int strata_rms_norm(const Tensor* x, const Tensor* weight, double eps, Tensor** out) {
  return guarded([&] {
    const bool own = own_kernel_serves(*x) && own_kernel_serves(*weight) && x->dim() >= 1 && weight->dim() == 1 &&
                     weight->size(0) == x->size(-1);
    *out = own ? new Tensor(RmsNorm::apply(*x, *weight, eps)) : nullptr;
  });
}

// SwiGLU's `silu(gate) * up` for two tensors of one shape.
int strata_swiglu(const Tensor* gate, const Tensor* up, Tensor** out) {
  return guarded([&] {
    if (own_kernel_serves(*gate) && own_kernel_serves(*up) && gate->sizes() == up->sizes()) {
      *out = new Tensor(SwiGlu::apply(*gate, *up));
      return;
    }
#ifdef STRATA_CUDA
    *out = owned(strata_cuda::swiglu(*gate, *up));
#else
    *out = nullptr;
#endif
  });
}

// The mean cross-entropy of logits against targets, over the targets other than `ignore`
// (GPU only).
int strata_cross_entropy(const Tensor* logits, const Tensor* targets, int64_t ignore, Tensor** out) {
  return guarded([&] {
#ifdef STRATA_CUDA
    *out = owned(strata_cuda::cross_entropy(*logits, *targets, ignore));
#else
    *out = nullptr;
#endif
  });
}

// Causal attention within a window (`window` ≤ 0: none), its scores soft-capped (`cap` ≤ 0:
// none), with per-head sinks (null: none); see cuda_kernels.h (GPU only).
int strata_attention(const Tensor* q, const Tensor* k, const Tensor* v, const Tensor* sinks, double scale,
                     double cap, int64_t window, Tensor** out) {
  return guarded([&] {
#ifdef STRATA_CUDA
    *out = owned(strata_cuda::attention(*q, *k, *v, optional_tensor(sinks), scale, cap, window));
#else
    *out = nullptr;
#endif
  });
}

// `s = x + r` and the layer norm (with `bias`) or RMS norm (`bias` null) of s (GPU only),
// the norm in scalar type `out_kind` (-1: the weight's); with `r` null the norm of `x`
// alone, `*sum` then `x` itself; `*sum` and `*out` both null where not served.
int strata_add_norm(const Tensor* x, const Tensor* r, const Tensor* weight, const Tensor* bias, double eps,
                    int out_kind, Tensor** sum, Tensor** out) {
  return guarded([&] {
    *sum = nullptr;
    *out = nullptr;
#ifdef STRATA_CUDA
    std::optional<at::ScalarType> kind;
    if (out_kind >= 0) kind = static_cast<at::ScalarType>(out_kind);
    if (auto served = strata_cuda::add_norm(*x, optional_tensor(r), *weight, optional_tensor(bias), eps, bias == nullptr, kind)) {
      *sum = new Tensor(std::move(served->first));
      *out = new Tensor(std::move(served->second));
    }
#endif
  });
}

// An fp8 cast of `x` (see cuda_kernels.h), scaled by `scale`, or by `scale_at` where not
// null, or by `row_scale` and `col_scale` where not null; all three outputs null where not
// served, `*qt` null where not asked for.
int strata_fp8_cast(const Tensor* x, double scale, const Tensor* scale_at, const Tensor* row_scale,
                    const Tensor* col_scale, int e5m2, int transposed, Tensor** q, Tensor** qt, Tensor** amax) {
  return guarded([&] {
    *q = *qt = *amax = nullptr;
#ifdef STRATA_CUDA
    const strata_cuda::Fp8Scales scales{scale, scale_at, row_scale, col_scale};
    if (auto cast = strata_cuda::fp8_cast(*x, scales, e5m2 != 0, transposed != 0)) {
      *q = new Tensor(std::move(cast->q));
      *qt = cast->qt.defined() ? new Tensor(std::move(cast->qt)) : nullptr;
      *amax = new Tensor(std::move(cast->amax));
    }
#endif
  });
}

// Each row's and column's largest magnitude of `x` (see cuda_kernels.h); both null where
// not served.
int strata_row_col_amax(const Tensor* x, Tensor** rows, Tensor** cols) {
  return guarded([&] {
    *rows = *cols = nullptr;
#ifdef STRATA_CUDA
    if (auto amax = strata_cuda::row_col_amax(*x)) {
      *rows = new Tensor(std::move(amax->first));
      *cols = new Tensor(std::move(amax->second));
    }
#endif
  });
}

// A linear layer's weight (and bias) gradient in one cuBLASLt product (see cuda_kernels.h);
// `*served` 0 where it does not serve.
int strata_linear_weight_grad(const Tensor* g, const Tensor* x, const Tensor* dw, const Tensor* db, int accumulate,
                              int* served) {
  return guarded([&] {
    *served = 0;
#ifdef STRATA_CUDA
    *served = strata_cuda::linear_weight_grad(*g, *x, *dw, db, accumulate != 0);
#endif
  });
}

// Compiles every CUDA kernel for `arch` without a device (an error in a build without CUDA).
int strata_cuda_compile_kernels(const char* arch) {
  return guarded([&] {
#ifdef STRATA_CUDA
    strata_cuda::compile_all(arch);
#else
    TORCH_CHECK(false, "Strata was built against a libtorch without CUDA: scripts/setup.sh installs PyPI's CUDA torch and its nvidia headers, then rebuild");
#endif
  });
}

}  // extern "C"
