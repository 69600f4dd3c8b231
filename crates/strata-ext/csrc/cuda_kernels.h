// Strata's CUDA kernels (in a build with the cuda feature), compiled at run time by NVRTC for the device at hand and recorded
// for autograd as one node each. Every function returns nullopt where its kernel does not
// serve the inputs (not on a GPU, a dtype or shape it does not handle), for the caller's
// own composite.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <optional>
#include <string>
#include <utility>

namespace strata_kernels {

// The kernels' backwards write through raw pointers and record nothing: refuse a backward
// asked to build a graph for a second derivative rather than return a wrong one.
inline void first_order_only(const char* kernel) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "Strata's ", kernel,
              " kernel has no second derivative: leave its pair out of module_replace to differentiate twice");
}

}  // namespace strata_kernels

namespace strata_cuda {

// GELU in its tanh form, any shape.
std::optional<at::Tensor> gelu_tanh(const at::Tensor& x);

// `silu(gate) * up` for two tensors of one shape and dtype.
std::optional<at::Tensor> swiglu(const at::Tensor& gate, const at::Tensor& up);

// Rotary positions of `[B, H, T, D]` `x` by `[T, D]` tables of x's dtype.
std::optional<at::Tensor> rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The mean cross-entropy of `[..., V]` logits against targets of their leading shape, over
// the targets other than `ignore`.
std::optional<at::Tensor> cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore);

// `s = x + r` and the norm of `s` over its last dimension (layer norm with `bias`, or RMS
// norm where `rms`), as the pair (s, norm); the norm in `out` (default: the weight's dtype).
// Without `r`, the norm of `x` (of the weight's dtype), returned beside `x` itself.
std::optional<std::pair<at::Tensor, at::Tensor>> add_norm(const at::Tensor& x, const std::optional<at::Tensor>& r,
                                                          const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias, double eps,
                                                          bool rms, std::optional<at::ScalarType> out);

// An fp8 cast: the tensor row-major, its transpose (contiguous; undefined where not asked
// for), and the largest magnitude of the input (a float scalar on the device).
struct Fp8Cast {
  at::Tensor q, qt, amax;
};

// The scales of an fp8 cast: `given`, or the one float `at` points to on the device where
// given (current scaling), or per row (`rows`, for the row-major copy) and per column
// (`cols`, for the transpose) where both are given (rowwise scaling).
struct Fp8Scales {
  double given = 1.0;
  const at::Tensor* at = nullptr;
  const at::Tensor* rows = nullptr;
  const at::Tensor* cols = nullptr;
};

// `x · scale` saturated and cast to E4M3 (E5M2 where `e5m2`), for a contiguous 2-D `x`,
// in one pass that also writes the transpose where `transposed` and takes the amax.
std::optional<Fp8Cast> fp8_cast(const at::Tensor& x, const Fp8Scales& scales, bool e5m2, bool transposed);

// Each row's and each column's largest magnitude of a contiguous 2-D `x` (NaN ignored), as
// floats on the device, in one pass.
std::optional<std::pair<at::Tensor, at::Tensor>> row_col_amax(const at::Tensor& x);

// The weight and bias gradients of a linear layer `y = x·wᵀ + b` from the output's gradient:
// `dw (+)= gᵀ·x` for 2-D `g` `[rows, out]` and `x` `[rows, in]` of one dtype, written into
// (or, where `accumulate`, added to) `dw` `[out, in]` (that dtype or fp32), and, where `db`
// is given, `g`'s column sums into it (`dw`'s dtype), in one cuBLASLt product whose epilogue
// reduces the bias gradient as it reads `g`. False where that does not serve (not on a GPU,
// dtypes or layouts it does not take, no cuBLASLt algorithm for the case), with nothing
// written.
bool linear_weight_grad(const at::Tensor& g, const at::Tensor& x, const at::Tensor& dw, const at::Tensor* db,
                        bool accumulate);

// Causal attention of `[B, H, T, D]` queries over `[B, H_kv, T, D]` keys and values (H a
// multiple of H_kv: grouped-query heads), bf16 or fp16, D 64 or 128, on a GPU of sm_80 or
// later: scores scaled by `scale`, soft-capped to ±`cap` where `cap` > 0, each query seeing
// the `window` positions up to itself where `window` > 0, and `sinks` (`[H]`), where given,
// joining each head's softmax as one more logit attended to nothing. The output is
// `[B, H, T, D]` (a view of a `[B, T, H, D]` tensor).
std::optional<at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& sinks, double scale, double cap, int64_t window);

// Compiles every kernel for every dtype they serve for `arch` (such as "sm_90"), without a
// device: a check that the sources compile.
void compile_all(const std::string& arch);

}  // namespace strata_cuda
