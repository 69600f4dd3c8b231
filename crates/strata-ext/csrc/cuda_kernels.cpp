// Strata's CUDA kernels (see cuda_kernels.h). The sources below are compiled by NVRTC, once
// per process for each device architecture and dtype combination, to a cubin loaded through
// the CUDA runtime's library API, so neither a CUDA compiler at build time nor the driver
// library at link time is needed. The kernels compute in fp32 whatever the storage dtype
// and include no CUDA header: bf16 and fp16 are converted with PTX instructions.
#include "cuda_kernels.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nvrtc.h>
#include <torch/csrc/autograd/custom_function.h>

#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace strata_cuda {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Storage types and their conversions to and from fp32, shared by every family.
const char* kPrelude = R"(
struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __uint_as_float(((unsigned int)x.bits) << 16); }
__device__ __forceinline__ float to_f(f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) {
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(x));
  return bf16{b};
}
template <> __device__ __forceinline__ f16 from_f<f16>(float x) {
  unsigned short b;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(x));
  return f16{b};
}
#define INF __int_as_float(0x7f800000)
typedef long long i64;

// N elements loaded or stored in one access.
template <class T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum of every thread's `v`, returned to all threads; `shared` holds 32 floats.
__device__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < warps ? shared[threadIdx.x] : 0.f;
  if (warp == 0) v = warp_sum(v);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  return shared[0];
}
)";

// Elementwise kernels over TX: GELU (tanh form), SwiGLU and rotary positions, each way.
// The elementwise ones read and write 16 bytes per access where `vec` says every pointer
// allows it, and the rest one by one.
const char* kElementwise = R"(
#define VEC (16 / (int)sizeof(TX))
typedef Pack<TX, VEC> PX;
#define K0 0.7978845608028654f
#define K1 0.044715f

// Calls `op(i)` for the packs (by VEC elements, `vec`) and the elements left of [0, n).
template <class Op> __device__ __forceinline__ void packs_then_rest(i64 n, int vec, Op op) {
  const i64 stride = (i64)gridDim.x * blockDim.x, first = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  const i64 packs = vec ? n / VEC : 0;
  for (i64 i = first; i < packs; i += stride) {
    PX in[4], out[2];
    op.load(i, in);
#pragma unroll
    for (int k = 0; k < VEC; ++k) op.at(in, out, k);
    op.store(i, out);
  }
  for (i64 i = packs * VEC + first; i < n; i += stride) op.one(i);
}

__device__ __forceinline__ float gelu(float v) { return 0.5f * v * (1.f + tanhf(K0 * (v + K1 * v * v * v))); }
__device__ __forceinline__ float gelu_grad(float v) {
  float t = tanhf(K0 * (v + K1 * v * v * v));
  return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * K0 * (1.f + 3.f * K1 * v * v);
}
__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

struct GeluForward {
  const TX* x; TX* y;
  __device__ void load(i64 i, PX* in) const { in[0] = ((const PX*)x)[i]; }
  __device__ void at(const PX* in, PX* out, int k) const { out[0].v[k] = from_f<TX>(gelu(to_f(in[0].v[k]))); }
  __device__ void store(i64 i, const PX* out) const { ((PX*)y)[i] = out[0]; }
  __device__ void one(i64 i) const { y[i] = from_f<TX>(gelu(to_f(x[i]))); }
};
extern "C" __global__ void gelu_forward(const TX* x, TX* y, i64 n, int vec) { packs_then_rest(n, vec, GeluForward{x, y}); }

struct GeluBackward {
  const TX* dy; const TX* x; TX* dx;
  __device__ void load(i64 i, PX* in) const { in[0] = ((const PX*)dy)[i]; in[1] = ((const PX*)x)[i]; }
  __device__ void at(const PX* in, PX* out, int k) const {
    out[0].v[k] = from_f<TX>(to_f(in[0].v[k]) * gelu_grad(to_f(in[1].v[k])));
  }
  __device__ void store(i64 i, const PX* out) const { ((PX*)dx)[i] = out[0]; }
  __device__ void one(i64 i) const { dx[i] = from_f<TX>(to_f(dy[i]) * gelu_grad(to_f(x[i]))); }
};
extern "C" __global__ void gelu_backward(const TX* dy, const TX* x, TX* dx, i64 n, int vec) {
  packs_then_rest(n, vec, GeluBackward{dy, x, dx});
}

struct SwigluForward {
  const TX* gate; const TX* up; TX* y;
  __device__ void load(i64 i, PX* in) const { in[0] = ((const PX*)gate)[i]; in[1] = ((const PX*)up)[i]; }
  __device__ void at(const PX* in, PX* out, int k) const {
    out[0].v[k] = from_f<TX>(silu(to_f(in[0].v[k])) * to_f(in[1].v[k]));
  }
  __device__ void store(i64 i, const PX* out) const { ((PX*)y)[i] = out[0]; }
  __device__ void one(i64 i) const { y[i] = from_f<TX>(silu(to_f(gate[i])) * to_f(up[i])); }
};
extern "C" __global__ void swiglu_forward(const TX* gate, const TX* up, TX* y, i64 n, int vec) {
  packs_then_rest(n, vec, SwigluForward{gate, up, y});
}

struct SwigluBackward {
  const TX* dy; const TX* gate; const TX* up; TX* dgate; TX* dup;
  __device__ void load(i64 i, PX* in) const {
    in[0] = ((const PX*)dy)[i]; in[1] = ((const PX*)gate)[i]; in[2] = ((const PX*)up)[i];
  }
  __device__ void grads(float d, float g, float u, float& dg, float& du) const {
    float s = 1.f / (1.f + expf(-g));
    dg = d * u * s * (1.f + g * (1.f - s));
    du = d * g * s;
  }
  __device__ void at(const PX* in, PX* out, int k) const {
    float dg, du;
    grads(to_f(in[0].v[k]), to_f(in[1].v[k]), to_f(in[2].v[k]), dg, du);
    out[0].v[k] = from_f<TX>(dg);
    out[1].v[k] = from_f<TX>(du);
  }
  __device__ void store(i64 i, const PX* out) const { ((PX*)dgate)[i] = out[0]; ((PX*)dup)[i] = out[1]; }
  __device__ void one(i64 i) const {
    float dg, du;
    grads(to_f(dy[i]), to_f(gate[i]), to_f(up[i]), dg, du);
    dgate[i] = from_f<TX>(dg);
    dup[i] = from_f<TX>(du);
  }
};
extern "C" __global__ void swiglu_backward(const TX* dy, const TX* gate, const TX* up, TX* dgate, TX* dup, i64 n,
                                           int vec) {
  packs_then_rest(n, vec, SwigluBackward{dy, gate, up, dgate, dup});
}

// Rotary positions of rows (b, h, p) of [B, H, T, D] tensors whose rows have the given
// strides and unit stride in D: forward y = x·cos + rotate_half(x)·sin; backward, its
// transpose, dx = dy·cos + (s₂·dy₂, −s₁·dy₁) with s = sin. Positions index the [T, D] tables.
// A block covers positions of one head of one batch entry (the grid's y and z: no index
// division), a thread G pairs (j .. j+G, j+half .. j+half+G), each G-element run one access.
template <int G>
__device__ __forceinline__ void rotate_pairs(const TX* x, const TX* c, const TX* s, TX* y, int j, int half,
                                             int backward) {
  typedef Pack<TX, G> P;
  const P x1 = *(const P*)(x + j), x2 = *(const P*)(x + j + half);
  const P c1 = *(const P*)(c + j), c2 = *(const P*)(c + j + half);
  const P s1 = *(const P*)(s + j), s2 = *(const P*)(s + j + half);
  P y1, y2;
#pragma unroll
  for (int k = 0; k < G; ++k) {
    const float a = to_f(x1.v[k]), b = to_f(x2.v[k]);
    if (backward) {
      y1.v[k] = from_f<TX>(a * to_f(c1.v[k]) + b * to_f(s2.v[k]));
      y2.v[k] = from_f<TX>(b * to_f(c2.v[k]) - a * to_f(s1.v[k]));
    } else {
      y1.v[k] = from_f<TX>(a * to_f(c1.v[k]) - b * to_f(s1.v[k]));
      y2.v[k] = from_f<TX>(b * to_f(c2.v[k]) + a * to_f(s2.v[k]));
    }
  }
  *(P*)(y + j) = y1;
  *(P*)(y + j + half) = y2;
}

extern "C" __global__ void rotary(const TX* in, const TX* cos, const TX* sin, TX* out, int t, int half, i64 ib,
                                  i64 ih, i64 it, i64 ob, i64 oh, i64 ot, int group, int backward) {
  const int p = blockIdx.x * blockDim.y + threadIdx.y;
  if (p >= t) return;
  const i64 b = blockIdx.z, h = blockIdx.y;
  const TX* x = in + b * ib + h * ih + p * it;
  TX* y = out + b * ob + h * oh + p * ot;
  const TX* c = cos + (i64)p * 2 * half;
  const TX* s = sin + (i64)p * 2 * half;
  for (int j = threadIdx.x * group; j < half; j += blockDim.x * group) {
    switch (group) {
      case 8: rotate_pairs<8>(x, c, s, y, j, half, backward); break;
      case 4: rotate_pairs<4>(x, c, s, y, j, half, backward); break;
      case 2: rotate_pairs<2>(x, c, s, y, j, half, backward); break;
      default: rotate_pairs<1>(x, c, s, y, j, half, backward);
    }
  }
}
)";

// Cross-entropy over rows of V logits of type TX, one block per row: the log-sum-exp in
// one pass (a running maximum and the sum scaled to it), and the gradient written from it;
// 16 bytes per access where `vec` says the rows allow it.
const char* kCrossEntropy = R"(
#define VEC (16 / (int)sizeof(TX))
typedef Pack<TX, VEC> PX;

__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  if (m2 == -INF) return;
  if (m == -INF) { m = m2; s = s2; return; }
  if (m2 > m) { s = s * expf(m - m2) + s2; m = m2; } else { s += s2 * expf(m2 - m); }
}

extern "C" __global__ void ce_forward(const TX* logits, const i64* targets, float* loss, float* lse, i64 v,
                                      i64 ignore, int vec) {
  __shared__ float ms[32], ss[32];
  const TX* x = logits + blockIdx.x * v;
  float m = -INF, s = 0.f;
  const i64 packs = vec ? v / VEC : 0;
  for (i64 k = threadIdx.x; k < packs; k += blockDim.x) {
    const PX a = ((const PX*)x)[k];
    float f[VEC], top = -INF;
#pragma unroll
    for (int e = 0; e < VEC; ++e) { f[e] = to_f(a.v[e]); top = fmaxf(top, f[e]); }
    if (top == -INF) continue;
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum += expf(f[e] - top);
    merge(m, s, top, sum);
  }
  for (i64 j = packs * VEC + threadIdx.x; j < v; j += blockDim.x) merge(m, s, to_f(x[j]), 1.f);
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  if (lane == 0) { ms[warp] = m; ss[warp] = s; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < warps; ++w) merge(ms[0], ss[0], ms[w], ss[w]);
    const float l = ms[0] + logf(ss[0]);
    const i64 target = targets[blockIdx.x];
    lse[blockIdx.x] = l;
    if (target == ignore) loss[blockIdx.x] = 0.f;
    else if (target < 0 || target >= v) loss[blockIdx.x] = __int_as_float(0x7fc00000);
    else loss[blockIdx.x] = l - to_f(x[target]);
  }
}

// grad = (softmax - onehot(target)) · scale, where `scale` (on the device) is the loss's
// gradient over the supervised count; rows whose target is `ignore` get zeros.
extern "C" __global__ void ce_backward(const TX* logits, const i64* targets, const float* lse, const float* scale,
                                       TX* grad, i64 v, i64 ignore, int vec) {
  const TX* x = logits + blockIdx.x * v;
  TX* g = grad + blockIdx.x * v;
  const i64 target = targets[blockIdx.x];
  const float k = target == ignore ? 0.f : *scale, l = lse[blockIdx.x];
  const i64 packs = vec ? v / VEC : 0;
  for (i64 i = threadIdx.x; i < packs; i += blockDim.x) {
    const PX a = ((const PX*)x)[i];
    PX out;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const i64 j = i * VEC + e;
      out.v[e] = from_f<TX>((expf(to_f(a.v[e]) - l) - (j == target ? 1.f : 0.f)) * k);
    }
    ((PX*)g)[i] = out;
  }
  for (i64 j = packs * VEC + threadIdx.x; j < v; j += blockDim.x) {
    g[j] = from_f<TX>((expf(to_f(x[j]) - l) - (j == target ? 1.f : 0.f)) * k);
  }
}
)";

// s = x + r (TX + TR into TS) and its norm (weight and bias of TS, output TY: the
// products' dtype under autocast, which would cast it so at once), one block per row;
// `rms` leaves out the mean and the bias. Without `r` (and `s`) the norm is x's own (TX is
// TS), written in TY.
const char* kAddNorm = R"(
extern "C" __global__ void add_norm_forward(const TX* x, const TR* r, const TS* w, const TS* b, TS* s, TY* y,
                                            float* mean, float* rstd, i64 d, float eps, int rms) {
  __shared__ float shared[32];
  const i64 row = blockIdx.x * d;
  const TS* sum_of = s ? s : (const TS*)x;
  float sum = 0.f;
  for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
    if (s) {
      // The norm sees s as stored.
      TS v = from_f<TS>(to_f(x[row + j]) + to_f(r[row + j]));
      s[row + j] = v;
      sum += to_f(v);
    } else {
      sum += to_f(sum_of[row + j]);
    }
  }
  const float mu = rms ? 0.f : block_sum(sum, shared) / d;
  float sq = 0.f;
  for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
    float c = to_f(sum_of[row + j]) - mu;
    sq += c * c;
  }
  const float inv = rsqrtf(block_sum(sq, shared) / d + eps);
  for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
    float out = (to_f(sum_of[row + j]) - mu) * inv * to_f(w[j]);
    if (!rms) out += to_f(b[j]);
    y[row + j] = from_f<TY>(out);
  }
  if (threadIdx.x == 0) {
    mean[blockIdx.x] = mu;
    rstd[blockIdx.x] = inv;
  }
}

#define MAX_PER_THREAD 32
// ds = rstd·(g − mean(g) − x̂·mean(g·x̂)) + gs with g = gy·w (RMS: no mean(g) term), into
// TS; each block takes rows blockIdx.x, blockIdx.x + gridDim.x, ... and sums its rows'
// weight (gy·x̂) and bias (gy) gradients into its own row of `dw` and `db`.
extern "C" __global__ void add_norm_backward(const TY* gy, const TS* gs, const TS* s, const TS* w, const float* mean,
                                             const float* rstd, TS* ds, float* dw, float* db, i64 rows, i64 d,
                                             int rms) {
  __shared__ float shared[32];
  float accw[MAX_PER_THREAD], accb[MAX_PER_THREAD];
  for (int k = 0; k < MAX_PER_THREAD; ++k) accw[k] = accb[k] = 0.f;
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const i64 row = r * d;
    const float mu = mean[r], inv = rstd[r];
    float sg = 0.f, sgx = 0.f;
    int k = 0;
    for (i64 j = threadIdx.x; j < d; j += blockDim.x, ++k) {
      float dy = to_f(gy[row + j]), xhat = (to_f(s[row + j]) - mu) * inv, g = dy * to_f(w[j]);
      sg += g;
      sgx += g * xhat;
      accw[k] += dy * xhat;
      accb[k] += dy;
    }
    const float cg = rms ? 0.f : block_sum(sg, shared) / d, cgx = block_sum(sgx, shared) / d;
    for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
      float xhat = (to_f(s[row + j]) - mu) * inv, g = to_f(gy[row + j]) * to_f(w[j]);
      float out = inv * (g - cg - xhat * cgx);
      if (gs) out += to_f(gs[row + j]);
      ds[row + j] = from_f<TS>(out);
    }
  }
  int k = 0;
  for (i64 j = threadIdx.x; j < d; j += blockDim.x, ++k) {
    dw[blockIdx.x * d + j] = accw[k];
    db[blockIdx.x * d + j] = accb[k];
  }
}
)";

const char* kAttention = R"(
// Fused attention (sm_80 and later: bf16/fp16 tensor-core products through `mma.sync`,
// m16n8k16, fp32 accumulation) for what libtorch's fused kernels decline: causal attention
// within a sliding window, soft-capped scores and per-head sink logits, with grouped-query
// heads. HD (the head width, 64 or 128) is bound at compile time. Queries, keys and values
// are read through their `[B, H, T, D]` strides (unit stride along D, the rest multiples of
// 8 elements); the output is written `[B, T, H, D]`. Each block of 128 threads (4 warps)
// takes 64 queries of one head forward and 64 keys of one key/value head backward; tiles
// are copied to shared memory asynchronously, the next while the current is computed on;
// scores stay in fp32 registers, and the softmax is taken online, FlashAttention-2's way,
// its log-sum-exp (the sink included) kept for backward.
#define BQ 64
#define BK 64
#define BQB 32
#define KSTEPS (HD / 16)
#define DTILES (HD / 8)
#define PAD 8
#define ROW (HD + PAD)

__device__ __forceinline__ unsigned shared_address(const void* p) {
  unsigned a;
  asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }" : "=r"(a) : "l"(p));
  return a;
}
// 16 bytes from global to shared memory without the registers; zeros where `real` is false.
__device__ __forceinline__ void copy16(void* dst, const void* src, bool real) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
               "r"(real ? 16 : 0));
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Rows `first`.. (`rows` of them, HD wide) of `src` (row `r` at `src + r·stride`, rows at
// or past `limit` as zeros) into the row-major tile `dst` (ROW elements per row).
__device__ __forceinline__ void copy_tile(TX* dst, const TX* src, i64 stride, int first, int limit, int rows) {
  for (int i = threadIdx.x; i < rows * (HD / 8); i += blockDim.x) {
    const int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
    const bool real = first + r < limit;
    copy16(dst + r * ROW + c, real ? src + (i64)(first + r) * stride + c : src, real);
  }
}

// Two values of a row as the one 32-bit register an mma operand takes.
__device__ __forceinline__ unsigned pair_at(const TX* p) { return *(const unsigned*)p; }
__device__ __forceinline__ unsigned pack(float lo, float hi) {
  Pack<TX, 2> v;
  v.v[0] = from_f<TX>(lo);
  v.v[1] = from_f<TX>(hi);
  return *(unsigned*)&v;
}

// One m16n8k16 product of `ty` (bf16 or f16) operands into fp32.
#define MMA_OF(ty)                                                                                        \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." #ty "." #ty ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
               "{%8,%9}, {%0,%1,%2,%3};"                                                                 \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <class T> struct Mma;
template <> struct Mma<bf16> {
  static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0, unsigned b1) { MMA_OF(bf16); }
};
template <> struct Mma<f16> {
  static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0, unsigned b1) { MMA_OF(f16); }
};
// c (16 × 8, fp32) += a (16 × 16) · b (16 × 8). In each lane (g = lane / 4, t = lane % 4):
// a holds rows g and g + 8 at columns 2t, 2t + 1 and 2t + 8, 2t + 9; b holds column g at
// rows 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1); c holds rows g (c0, c1) and g + 8 (c2, c3)
// at columns 2t, 2t + 1.
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) { Mma<TX>::run(c, a, b0, b1); }

// The A operand of rows `row`, `row + 8` and columns `col`.. of a row-major tile (`stride`
// elements per row), `col` = 16·step + 2t.
__device__ __forceinline__ void a_from(unsigned* a, const TX* tile, int stride, int row, int col) {
  a[0] = pair_at(tile + row * stride + col);
  a[1] = pair_at(tile + (row + 8) * stride + col);
  a[2] = pair_at(tile + row * stride + col + 8);
  a[3] = pair_at(tile + (row + 8) * stride + col + 8);
}

// The A operand (16 rows × 16 columns) from two accumulators side by side (columns 16j..).
__device__ __forceinline__ void a_from_acc(unsigned* a, const float* left, const float* right) {
  a[0] = pack(left[0], left[1]);
  a[1] = pack(left[2], left[3]);
  a[2] = pack(right[0], right[1]);
  a[3] = pack(right[2], right[3]);
}

// The B operands of two neighbouring 8-column tiles (columns `col`.. and `col + 8`..) over
// rows `row`..`row + 15` of a row-major tile, read transposed by `ldmatrix`: a product
// along the tile's rows (keys or queries) takes them without a transposed copy.
__device__ __forceinline__ void b_pair_along_rows(unsigned* b, const TX* tile, int row, int col) {
  const int lane = threadIdx.x & 31;
  const TX* p = tile + (row + (lane & 15)) * ROW + col + (lane >> 4) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(shared_address(p)));
}

struct Mask {
  int t, window;
  // Whether query `q` sees key `k`: both real positions, causal, within the window.
  __device__ __forceinline__ bool sees(int q, int k) const {
    return q < t && k < t && k <= q && (window <= 0 || q - k < window);
  }
};

// The score of a raw product `x`: scaled, then soft-capped where `cap` > 0; `slope` gets the
// cap's derivative (1 − tanh²).
__device__ __forceinline__ float score(float x, float scale, float cap, float* slope) {
  x *= scale;
  if (cap > 0.f) {
    float th = tanhf(x / cap);
    *slope = 1.f - th * th;
    return cap * th;
  }
  *slope = 1.f;
  return x;
}

// Forward: grid (query blocks, heads, batch), shared memory from the launch (two stages of
// a key and a value tile). `lse` [B, H, T]; `sinks` [H] fp32 or null.
extern "C" __global__ void __launch_bounds__(128) attention_forward(
    const TX* q, const TX* k, const TX* v, TX* o, float* lse, const float* sinks, int t, int heads, int kv_heads,
    i64 qb, i64 qh, i64 qt, i64 kb, i64 kh, i64 kt, i64 vb, i64 vh, i64 vt, float scale, float cap, int window) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  TX* tiles = (TX*)shared_bytes;
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / (heads / kv_heads);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int q0 = blockIdx.x * BQ, r0 = q0 + warp * 16 + g;
  const Mask mask{t, window};
  const TX* qp = q + b * qb + h * qh;
  const TX* kp = k + b * kb + kvh * kh;
  const TX* vp = v + b * vb + kvh * vh;
  const int last = min(t, q0 + BQ);
  const int first = window > 0 ? max(0, q0 - window + 1) / BK * BK : 0;
  // Stage s holds keys at tiles + 2s·BK·ROW and values after them.
  auto fetch = [&](int stage, int k0) {
    copy_tile(tiles + 2 * stage * BK * ROW, kp, kt, k0, t, BK);
    copy_tile(tiles + (2 * stage + 1) * BK * ROW, vp, vt, k0, t, BK);
    copies_commit();
  };
  if (first < last) fetch(0, first);
  // This warp's 16 queries as A operands, one per step along D.
  unsigned qa[KSTEPS][4];
#pragma unroll
  for (int s = 0; s < KSTEPS; ++s) {
    const int c = s * 16 + tq * 2;
    const bool in0 = r0 < t, in1 = r0 + 8 < t;
    qa[s][0] = in0 ? pair_at(qp + r0 * qt + c) : 0u;
    qa[s][1] = in1 ? pair_at(qp + (r0 + 8) * qt + c) : 0u;
    qa[s][2] = in0 ? pair_at(qp + r0 * qt + c + 8) : 0u;
    qa[s][3] = in1 ? pair_at(qp + (r0 + 8) * qt + c + 8) : 0u;
  }
  float acc[DTILES][4];
#pragma unroll
  for (int d = 0; d < DTILES; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;
  float m[2] = {-INF, -INF}, l[2] = {0.f, 0.f};
  int stage = 0;
  for (int k0 = first; k0 < last; k0 += BK, stage ^= 1) {
    if (k0 + BK < last) {
      fetch(stage ^ 1, k0 + BK);
      copies_wait<1>();
    } else {
      copies_wait<0>();
    }
    __syncthreads();
    const TX* ks = tiles + 2 * stage * BK * ROW;
    const TX* vs = ks + BK * ROW;
    float s[BK / 8][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int st = 0; st < KSTEPS; ++st) {
        const TX* kr = ks + (n * 8 + g) * ROW + st * 16 + tq * 2;
        mma(s[n], qa[st], pair_at(kr), pair_at(kr + 8));
      }
    }
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = r0 + (e >> 1) * 8, key = k0 + n * 8 + tq * 2 + (e & 1);
        float slope;
        const float x = score(s[n][e], scale, cap, &slope);
        s[n][e] = mask.sees(row, key) ? x : -INF;
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = -INF;
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][half * 2], s[n][half * 2 + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float top = fmaxf(m[half], mx);
      // A row that has seen no key yet keeps zeros: no inf − inf.
      const float base = top == -INF ? 0.f : top;
      const float rescale = expf(m[half] - base);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
        s[n][half * 2] = expf(s[n][half * 2] - base);
        s[n][half * 2 + 1] = expf(s[n][half * 2 + 1] - base);
        sum += s[n][half * 2] + s[n][half * 2 + 1];
      }
      l[half] = l[half] * rescale + sum;
      m[half] = top;
#pragma unroll
      for (int d = 0; d < DTILES; ++d) {
        acc[d][half * 2] *= rescale;
        acc[d][half * 2 + 1] *= rescale;
      }
    }
#pragma unroll
    for (int j = 0; j < BK / 16; ++j) {
      unsigned pa[4];
      a_from_acc(pa, s[2 * j], s[2 * j + 1]);
#pragma unroll
      for (int d = 0; d < DTILES; d += 2) {
        unsigned bv[4];
        b_pair_along_rows(bv, vs, j * 16, d * 8);
        mma(acc[d], pa, bv[0], bv[1]);
        mma(acc[d + 1], pa, bv[2], bv[3]);
      }
    }
    // The next fetch overwrites the stage just read.
    __syncthreads();
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = r0 + half * 8;
    float total = l[half];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    // The sink joins the softmax as one more logit attended to nothing.
    const float sink = sinks ? sinks[h] : -INF;
    const float top = fmaxf(m[half], sink);
    const float kept = expf(m[half] - top);
    const float denom = total * kept + (sinks ? expf(sink - top) : 0.f);
    const float factor = kept / denom;
    if (row < t) {
      TX* out = o + (((i64)b * t + row) * heads + h) * HD;
#pragma unroll
      for (int d = 0; d < DTILES; ++d) {
        *(unsigned*)(out + d * 8 + tq * 2) = pack(acc[d][half * 2] * factor, acc[d][half * 2 + 1] * factor);
      }
      if (tq == 0) lse[((i64)b * heads + h) * t + row] = top + logf(denom);
    }
  }
}

// Backward: grid (key blocks, key/value heads, batch), 128 threads, shared memory from the
// launch: the block's key and value tiles, two stages of a query and an output-gradient
// tile, and dS. Each block takes 64 keys of one key/value head through every query head
// that reads them and every block of 32 queries that sees them: dV and dK accumulate in
// registers (each warp 16 keys), dQ is added in fp32 into `dq` ([B, T, H, D], zeroed).
// `delta` [B, H, T]: each query's dO·O; `do_` [B, T, H, D] contiguous.
extern "C" __global__ void __launch_bounds__(128) attention_backward(
    const TX* q, const TX* k, const TX* v, const TX* do_, const float* lse, const float* delta, float* dq, TX* dk,
    TX* dv, int t, int heads, int kv_heads, i64 qb, i64 qh, i64 qt, i64 kb, i64 kh, i64 kt, i64 vb, i64 vh, i64 vt,
    float scale, float cap, int window) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  TX* ks = (TX*)shared_bytes;        // [BK][ROW]
  TX* vs = ks + BK * ROW;            // [BK][ROW]
  TX* stages = vs + BK * ROW;        // 2 × ([BQB][ROW] queries, [BQB][ROW] output gradients)
  TX* dss = stages + 4 * BQB * ROW;  // [BQB][BK + PAD]
  const int kvh = blockIdx.y, b = blockIdx.z, group = heads / kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int k0 = blockIdx.x * BK, key_row = warp * 16 + g;
  const Mask mask{t, window};
  copy_tile(ks, k + b * kb + kvh * kh, kt, k0, t, BK);
  copy_tile(vs, v + b * vb + kvh * vh, vt, k0, t, BK);
  copies_commit();
  float dk_acc[DTILES][4], dv_acc[DTILES][4];
#pragma unroll
  for (int d = 0; d < DTILES; ++d) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[d][e] = dv_acc[d][e] = 0.f;
  }
  // Queries that see these keys: from the first key on, within the window of the last;
  // the steps run over every query head of the group and those blocks of queries.
  const int q_first = k0 / BQB * BQB;
  const int q_end = window > 0 ? min(t, k0 + BK - 1 + window) : t;
  const int blocks = (q_end - q_first + BQB - 1) / BQB, steps = group * blocks;
  auto fetch = [&](int step) {
    const int h = kvh * group + step / blocks, q0 = q_first + (step % blocks) * BQB;
    TX* into = stages + (step & 1) * 2 * BQB * ROW;
    copy_tile(into, q + b * qb + h * qh, qt, q0, t, BQB);
    copy_tile(into + BQB * ROW, do_ + ((i64)b * t * heads + h) * HD, (i64)heads * HD, q0, t, BQB);
    copies_commit();
  };
  if (steps > 0) fetch(0);
  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) {
      fetch(step + 1);
      copies_wait<1>();
    } else {
      copies_wait<0>();
    }
    __syncthreads();
    const int h = kvh * group + step / blocks, q0 = q_first + (step % blocks) * BQB;
    const TX* qs = stages + (step & 1) * 2 * BQB * ROW;
    const TX* dos = qs + BQB * ROW;
    const float* lse_h = lse + ((i64)b * heads + h) * t;
    const float* delta_h = delta + ((i64)b * heads + h) * t;
    // Sᵀ (this warp's 16 keys × 32 queries) = K Qᵀ, and dPᵀ = V dOᵀ.
    float p[BQB / 8][4], dp[BQB / 8][4];
#pragma unroll
    for (int n = 0; n < BQB / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.f;
#pragma unroll
      for (int st = 0; st < KSTEPS; ++st) {
        unsigned a[4];
        a_from(a, ks, ROW, key_row, st * 16 + tq * 2);
        const TX* qr = qs + (n * 8 + g) * ROW + st * 16 + tq * 2;
        mma(p[n], a, pair_at(qr), pair_at(qr + 8));
        a_from(a, vs, ROW, key_row, st * 16 + tq * 2);
        const TX* dr = dos + (n * 8 + g) * ROW + st * 16 + tq * 2;
        mma(dp[n], a, pair_at(dr), pair_at(dr + 8));
      }
    }
    // Pᵀ from the forward's log-sum-exp, and dSᵀ = Pᵀ ∘ (dPᵀ − δ) through the cap and the
    // scale to the raw products.
    float ds[BQB / 8][4];
#pragma unroll
    for (int n = 0; n < BQB / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + key_row + (e >> 1) * 8, query = q0 + n * 8 + tq * 2 + (e & 1);
        float slope;
        const float x = score(p[n][e], scale, cap, &slope);
        const bool seen = mask.sees(query, key);
        const float prob = seen ? expf(x - lse_h[query]) : 0.f;
        p[n][e] = prob;
        ds[n][e] = seen ? prob * (dp[n][e] - delta_h[query]) * slope * scale : 0.f;
      }
    }
    // dV += Pᵀ dO and dK += dSᵀ Q, along the queries.
#pragma unroll
    for (int j = 0; j < BQB / 16; ++j) {
      unsigned pa[4], sa[4];
      a_from_acc(pa, p[2 * j], p[2 * j + 1]);
      a_from_acc(sa, ds[2 * j], ds[2 * j + 1]);
#pragma unroll
      for (int d = 0; d < DTILES; d += 2) {
        unsigned bo[4], bq[4];
        b_pair_along_rows(bo, dos, j * 16, d * 8);
        mma(dv_acc[d], pa, bo[0], bo[1]);
        mma(dv_acc[d + 1], pa, bo[2], bo[3]);
        b_pair_along_rows(bq, qs, j * 16, d * 8);
        mma(dk_acc[d], sa, bq[0], bq[1]);
        mma(dk_acc[d + 1], sa, bq[2], bq[3]);
      }
    }
    // dS (queries × keys) to shared memory for dQ = dS K.
#pragma unroll
    for (int n = 0; n < BQB / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dss[(n * 8 + tq * 2 + (e & 1)) * (BK + PAD) + key_row + (e >> 1) * 8] = from_f<TX>(ds[n][e]);
      }
    }
    __syncthreads();
    // Each warp: 16 of the 32 queries, half of D.
    {
      const int qrow = (warp & 1) * 16 + g, d_first = (warp >> 1) * (DTILES / 2);
      float dq_acc[DTILES / 2][4];
#pragma unroll
      for (int d = 0; d < DTILES / 2; ++d) dq_acc[d][0] = dq_acc[d][1] = dq_acc[d][2] = dq_acc[d][3] = 0.f;
#pragma unroll
      for (int j = 0; j < BK / 16; ++j) {
        unsigned a[4];
        a_from(a, dss, BK + PAD, qrow, j * 16 + tq * 2);
#pragma unroll
        for (int d = 0; d < DTILES / 2; d += 2) {
          unsigned bk[4];
          b_pair_along_rows(bk, ks, j * 16, (d_first + d) * 8);
          mma(dq_acc[d], a, bk[0], bk[1]);
          mma(dq_acc[d + 1], a, bk[2], bk[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = q0 + qrow + half * 8;
        if (row < t) {
          float* out = dq + (((i64)b * t + row) * heads + h) * HD;
#pragma unroll
          for (int d = 0; d < DTILES / 2; ++d) {
            atomicAdd(out + (d_first + d) * 8 + tq * 2, dq_acc[d][half * 2]);
            atomicAdd(out + (d_first + d) * 8 + tq * 2 + 1, dq_acc[d][half * 2 + 1]);
          }
        }
      }
    }
    // The next fetch overwrites the stage just read, and the next dS this one.
    __syncthreads();
  }
  // This block's keys' gradients, summed over every query head of the group.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = k0 + key_row + half * 8;
    if (key < t) {
      const i64 at = (((i64)b * t + key) * kv_heads + kvh) * HD;
#pragma unroll
      for (int d = 0; d < DTILES; ++d) {
        *(unsigned*)(dk + at + d * 8 + tq * 2) = pack(dk_acc[d][half * 2], dk_acc[d][half * 2 + 1]);
        *(unsigned*)(dv + at + d * 8 + tq * 2) = pack(dv_acc[d][half * 2], dv_acc[d][half * 2 + 1]);
      }
    }
  }
}
)";

// fp8 casts (sm_89 and later): x·scale saturated to the format's largest finite value, in
// 64 × 64 tiles of 256 threads, each thread taking 4 consecutive elements of 4 rows, written
// row-major and, where `qt` is given, transposed through shared memory (4 bytes per access
// in whole tiles), with |x|'s maximum taken into `amax` (NaN ignored) in the same pass. The
// scale is read from `scale_at` where given (computed on the device, current scaling), or
// per row from `row_scale` for the row-major copy and per column from `col_scale` for the
// transpose (rowwise scaling: each copy scaled along the dimension its product sums over).
// `row_col_amax` takes each row's and each column's maximum in one read, for those scales.
const char* kFp8Cast = R"(
__device__ __forceinline__ unsigned int to_fp8(float v, int e5m2) {
  unsigned short pair;
  if (e5m2) asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(v));
  else asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(v));
  return pair & 0xffu;
}

// Non-negative floats order as their bit patterns do.
__device__ __forceinline__ void atomic_max_of_magnitudes(float* at, float v) { atomicMax((int*)at, __float_as_int(v)); }

// The tile's element (r0 + ty + 16k, c0 + 4tx + e) of a thread, or `whole` tiles' 4 at once.
#define TILE_SETUP                                                                                  \
  const i64 r0 = (i64)blockIdx.y * 64, c0 = (i64)blockIdx.x * 64;                                   \
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;                                           \
  const bool whole = r0 + 64 <= rows && c0 + 64 <= cols && (cols & 3) == 0 && (rows & 3) == 0;

// Four elements of row `r` from column `c`, zero where outside the tensor.
__device__ __forceinline__ void load4(const TX* x, i64 r, i64 c, i64 rows, i64 cols, bool whole, float* v) {
  if (whole) {
    const Pack<TX, 4> a = *(const Pack<TX, 4>*)(x + r * cols + c);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = to_f(a.v[e]);
  } else {
    for (int e = 0; e < 4; ++e) v[e] = r < rows && c + e < cols ? to_f(x[r * cols + c + e]) : 0.f;
  }
}

extern "C" __global__ void fp8_cast_transpose(const TX* x, float given_scale, const float* scale_at,
                                              const float* row_scale, const float* col_scale, unsigned char* q,
                                              unsigned char* qt, float* amax, i64 rows, i64 cols, int e5m2) {
  __shared__ unsigned int tile[64][17];
  const float scale = scale_at ? *scale_at : given_scale;
  TILE_SETUP
  float column[4] = {scale, scale, scale, scale};
  if (col_scale) {
    for (int e = 0; e < 4; ++e) column[e] = c0 + 4 * tx + e < cols ? col_scale[c0 + 4 * tx + e] : 0.f;
  }
  float m = 0.f;
  for (int k = 0; k < 4; ++k) {
    const int lr = ty + 16 * k;
    const i64 r = r0 + lr, c = c0 + 4 * tx;
    const float s = row_scale && r < rows ? row_scale[r] : scale;
    float v[4];
    load4(x, r, c, rows, cols, whole, v);
    unsigned int packed = 0, packed_t = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      m = fmaxf(m, fabsf(v[e]));
      packed |= to_fp8(v[e] * s, e5m2) << (8 * e);
      if (col_scale) packed_t |= to_fp8(v[e] * column[e], e5m2) << (8 * e);
    }
    if (whole) {
      *(unsigned int*)(q + r * cols + c) = packed;
    } else {
      for (int e = 0; e < 4; ++e) {
        if (r < rows && c + e < cols) q[r * cols + c + e] = (unsigned char)(packed >> (8 * e));
      }
    }
    tile[lr][tx] = col_scale ? packed_t : packed;
  }
  if (qt) {
    __syncthreads();
    for (int k = 0; k < 4; ++k) {
      const int lc = ty + 16 * k;
      const i64 c = c0 + lc, r = r0 + 4 * tx;
      unsigned int packed = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) packed |= ((tile[4 * tx + e][lc >> 2] >> (8 * (lc & 3))) & 0xffu) << (8 * e);
      if (whole) {
        *(unsigned int*)(qt + c * rows + r) = packed;
      } else {
        for (int e = 0; e < 4; ++e) {
          if (c < cols && r + e < rows) qt[c * rows + r + e] = (unsigned char)(packed >> (8 * e));
        }
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) atomic_max_of_magnitudes(amax, m);
}

// Each row's and each column's largest magnitude (NaN ignored) into `row_amax` and
// `col_amax`, which start at zero, over the same tiles.
extern "C" __global__ void row_col_amax(const TX* x, float* row_amax, float* col_amax, i64 rows, i64 cols) {
  __shared__ float tile_columns[64];
  TILE_SETUP
  if (threadIdx.x < 64) tile_columns[threadIdx.x] = 0.f;
  __syncthreads();
  float column[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k = 0; k < 4; ++k) {
    const i64 r = r0 + ty + 16 * k;
    float v[4];
    load4(x, r, c0 + 4 * tx, rows, cols, whole, v);
    float row = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      row = fmaxf(row, fabsf(v[e]));
      column[e] = fmaxf(column[e], fabsf(v[e]));
    }
    // A row's 16 threads are one half of a warp.
    for (int o = 8; o > 0; o >>= 1) row = fmaxf(row, __shfl_xor_sync(0xffffffffu, row, o));
    if (tx == 0 && r < rows) atomic_max_of_magnitudes(row_amax + r, row);
  }
  // The warp's two halves hold the same columns.
#pragma unroll
  for (int e = 0; e < 4; ++e) column[e] = fmaxf(column[e], __shfl_xor_sync(0xffffffffu, column[e], 16));
  if ((threadIdx.x & 31) < 16) {
    for (int e = 0; e < 4; ++e) atomic_max_of_magnitudes(&tile_columns[4 * tx + e], column[e]);
  }
  __syncthreads();
  if (threadIdx.x < 64 && c0 + threadIdx.x < cols) atomic_max_of_magnitudes(col_amax + c0 + threadIdx.x, tile_columns[threadIdx.x]);
}
)";

constexpr int kMaxPerThread = 32;

const char* type_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float";
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "f16";
    default: return nullptr;
  }
}

bool served_dtype(const Tensor& t) { return type_name(t.scalar_type()) != nullptr; }

#define NVRTC_CHECK(call)                                                                   \
  do {                                                                                      \
    nvrtcResult status_ = (call);                                                           \
    TORCH_CHECK(status_ == NVRTC_SUCCESS, "NVRTC: ", nvrtcGetErrorString(status_), " in " #call); \
  } while (0)

#define CUDA_CHECK(call)                                                                           \
  do {                                                                                             \
    cudaError_t status_ = (call);                                                                  \
    TORCH_CHECK(status_ == cudaSuccess, "CUDA: ", cudaGetErrorString(status_), " in " #call);     \
  } while (0)

// NVRTC opens its builtins library by name when it compiles, which the loader finds only on
// its own search path: a runpath reaches direct dependencies alone. Loading it first from the
// folder libnvrtc came from lets NVRTC's open find it loaded (a failure here leaves NVRTC to
// report the library by name).
void load_nvrtc_builtins() {
  static std::once_flag once;
  std::call_once(once, [] {
    Dl_info info;
    int major = 0, minor = 0;
    if (!dladdr(reinterpret_cast<void*>(&nvrtcCreateProgram), &info) || info.dli_fname == nullptr ||
        nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) {
      return;
    }
    const std::string path = info.dli_fname;
    const auto slash = path.rfind('/');
    if (slash == std::string::npos) return;
    const std::string builtins =
        path.substr(0, slash) + "/libnvrtc-builtins.so." + std::to_string(major) + "." + std::to_string(minor);
    dlopen(builtins.c_str(), RTLD_NOW | RTLD_GLOBAL);
  });
}

// A family's source with its type parameters bound, compiled for `arch` to a cubin.
std::vector<char> compile(const char* family, const std::string& types, const std::string& arch) {
  load_nvrtc_builtins();
  const std::string source = kPrelude + types + family;
  nvrtcProgram program;
  NVRTC_CHECK(nvrtcCreateProgram(&program, source.c_str(), "strata_kernels.cu", 0, nullptr, nullptr));
  const std::string gpu = "--gpu-architecture=" + arch;
  const char* options[] = {gpu.c_str(), "--std=c++17"};
  nvrtcResult compiled = nvrtcCompileProgram(program, 2, options);
  if (compiled != NVRTC_SUCCESS) {
    size_t size = 0;
    nvrtcGetProgramLogSize(program, &size);
    std::string log(size, '\0');
    nvrtcGetProgramLog(program, log.data());
    nvrtcDestroyProgram(&program);
    TORCH_CHECK(false, "NVRTC could not compile Strata's kernels for ", arch, ": ", log);
  }
  size_t size = 0;
  NVRTC_CHECK(nvrtcGetCUBINSize(program, &size));
  std::vector<char> cubin(size);
  NVRTC_CHECK(nvrtcGetCUBIN(program, cubin.data()));
  nvrtcDestroyProgram(&program);
  return cubin;
}

std::string bind(const std::vector<std::pair<const char*, at::ScalarType>>& params) {
  std::string out;
  for (const auto& [name, type] : params) out += std::string("typedef ") + type_name(type) + " " + name + ";\n";
  return out;
}

// ATen caches each device's properties.
std::string device_arch(int device) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
  return "sm_" + std::to_string(props->major) + std::to_string(props->minor);
}

// The kernel `name` of `family` with `params` bound, for the current device: compiled and
// loaded on first use, then cached for the process.
cudaKernel_t kernel(const char* family, const std::vector<std::pair<const char*, at::ScalarType>>& params,
                    const char* name, const std::string& defines = "") {
  static std::mutex lock;
  static std::unordered_map<std::string, cudaLibrary_t> libraries;
  static std::unordered_map<std::string, cudaKernel_t> kernels;
  const int device = c10::cuda::current_device();
  const std::string types = bind(params) + defines;
  const std::string arch = device_arch(device);
  const std::string library_key = arch + "\n" + std::to_string(reinterpret_cast<uintptr_t>(family)) + "\n" + types;
  const std::string kernel_key = library_key + name;
  std::lock_guard<std::mutex> guard(lock);
  if (auto found = kernels.find(kernel_key); found != kernels.end()) return found->second;
  auto library = libraries.find(library_key);
  if (library == libraries.end()) {
    std::vector<char> cubin = compile(family, types, arch);
    cudaLibrary_t loaded;
    CUDA_CHECK(cudaLibraryLoadData(&loaded, cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0));
    library = libraries.emplace(library_key, loaded).first;
  }
  cudaKernel_t k;
  CUDA_CHECK(cudaLibraryGetKernel(&k, library->second, name));
  kernels.emplace(kernel_key, k);
  return k;
}

// Launches `k` on the current stream; an empty grid launches nothing.
void launch(cudaKernel_t k, dim3 grid, dim3 block, std::vector<void*> args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(k), grid, block, args.data(), 0,
                              at::cuda::getCurrentCUDAStream()));
}

// Launches `k` with `shared` bytes of dynamic shared memory, past the default 48 KiB where
// the device allows.
void launch(cudaKernel_t k, dim3 grid, dim3 block, size_t shared, std::vector<void*> args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  const int device = c10::cuda::current_device();
  CUDA_CHECK(cudaKernelSetAttributeForDevice(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared),
                                             device));
  CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(k), grid, block, args.data(), shared,
                              at::cuda::getCurrentCUDAStream()));
}

void launch(cudaKernel_t k, int64_t blocks, int threads, std::vector<void*> args) {
  launch(k, dim3(static_cast<unsigned>(blocks)), dim3(threads), std::move(args));
}

// Blocks for a grid-stride loop over n elements: enough to fill the device, no more.
int64_t elementwise_blocks(int64_t n, int threads) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return std::min<int64_t>((n + threads - 1) / threads, sms * 16);
}

constexpr int kThreads = 256;

using strata_kernels::first_order_only;

Tensor empty_as(const Tensor& like) { return at::empty(like.sizes(), like.options()); }

// Whether every tensor's data starts on a boundary of `bytes`, for accesses that wide.
bool aligned(std::initializer_list<const Tensor*> tensors, int64_t bytes) {
  for (const Tensor* t : tensors) {
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % bytes != 0) return false;
  }
  return true;
}

// Launches an elementwise kernel of kElementwise over `n` elements of `kind`, with 16-byte
// accesses where `tensors` allow them; `args` are the kernel's pointers, followed here by
// the count and the flag.
void elementwise(const char* name, at::ScalarType kind, int64_t n, std::initializer_list<const Tensor*> tensors,
                 std::vector<void*> args) {
  int vec = aligned(tensors, 16);
  const int64_t per_access = vec ? 16 / static_cast<int64_t>(c10::elementSize(kind)) : 1;
  args.push_back(&n);
  args.push_back(&vec);
  launch(kernel(kElementwise, {{"TX", kind}}, name), elementwise_blocks((n + per_access - 1) / per_access, kThreads),
         kThreads, args);
}

struct GeluTanh : public torch::autograd::Function<GeluTanh> {
  static Tensor forward(AutogradContext* ctx, const Tensor& input) {
    Tensor x = input.contiguous(), y = empty_as(x);
    void *xp = x.data_ptr(), *yp = y.data_ptr();
    elementwise("gelu_forward", x.scalar_type(), x.numel(), {&x, &y}, {&xp, &yp});
    ctx->save_for_backward({x});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    first_order_only("CUDA GELU");
    Tensor x = ctx->get_saved_variables()[0], dy = grads[0].to(x.scalar_type()).contiguous(), dx = empty_as(x);
    void *dyp = dy.data_ptr(), *xp = x.data_ptr(), *dxp = dx.data_ptr();
    elementwise("gelu_backward", x.scalar_type(), x.numel(), {&dy, &x, &dx}, {&dyp, &xp, &dxp});
    return {dx};
  }
};

struct SwiGlu : public torch::autograd::Function<SwiGlu> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up) {
    Tensor g = gate.contiguous(), u = up.contiguous(), y = empty_as(g);
    void *gp = g.data_ptr(), *up_ = u.data_ptr(), *yp = y.data_ptr();
    elementwise("swiglu_forward", g.scalar_type(), g.numel(), {&g, &u, &y}, {&gp, &up_, &yp});
    ctx->save_for_backward({g, u});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    first_order_only("CUDA SwiGLU");
    auto saved = ctx->get_saved_variables();
    const Tensor &g = saved[0], &u = saved[1];
    Tensor dy = grads[0].to(g.scalar_type()).contiguous(), dg = empty_as(g), du = empty_as(u);
    void *dyp = dy.data_ptr(), *gp = g.data_ptr(), *up_ = u.data_ptr(), *dgp = dg.data_ptr(), *dup = du.data_ptr();
    elementwise("swiglu_backward", g.scalar_type(), g.numel(), {&dy, &g, &u, &dg, &du}, {&dyp, &gp, &up_, &dgp, &dup});
    return {dg, du};
  }
};

// Rotary positions of `[B, H, T, D]` `in` (unit stride in D, any other strides) into a new
// tensor of the same layout (the queries' `[B, T, H, D]` memory stays so, with no copy
// before attention), forward or (`backward`) transposed.
Tensor rotate(const Tensor& input, const Tensor& cos, const Tensor& sin, int backward) {
  Tensor x = input.stride(3) == 1 ? input : input.contiguous();
  Tensor y = at::empty_like(x);
  const int64_t batch = x.size(0), heads = x.size(1);
  int t = static_cast<int>(x.size(2)), half = static_cast<int>(x.size(3) / 2);
  int64_t ib = x.stride(0), ih = x.stride(1), it = x.stride(2), ob = y.stride(0), oh = y.stride(1), ot = y.stride(2);
  TORCH_CHECK(y.stride(3) == 1, "rotary: the output's last dimension is not dense");
  TORCH_CHECK(batch <= 65535 && heads <= 65535, "rotary: at most 65535 batch entries and heads");
  if (half == 0) return y;
  // The widest run of pairs every row and table start allows, at most 16 bytes.
  const int64_t esize = x.element_size();
  int group = static_cast<int>(16 / esize);
  auto fits = [&](int g) {
    bool strides = ib % g == 0 && ih % g == 0 && it % g == 0 && ob % g == 0 && oh % g == 0 && ot % g == 0;
    bool starts = aligned({&x, &y, &cos, &sin}, g * esize);
    return half % g == 0 && strides && starts;
  };
  while (group > 1 && !fits(group)) group /= 2;
  const int across = std::max(1, std::min(half / group, kThreads)), down = std::max(1, kThreads / across);
  void *xp = x.data_ptr(), *cp = cos.data_ptr(), *sp = sin.data_ptr(), *yp = y.data_ptr();
  launch(kernel(kElementwise, {{"TX", x.scalar_type()}}, "rotary"),
         dim3(static_cast<unsigned>((t + down - 1) / down), static_cast<unsigned>(heads), static_cast<unsigned>(batch)),
         dim3(across, down), {&xp, &cp, &sp, &yp, &t, &half, &ib, &ih, &it, &ob, &oh, &ot, &group, &backward});
  return y;
}

struct Rotary : public torch::autograd::Function<Rotary> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotate(x, cos, sin, 0);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    first_order_only("CUDA rotary");
    auto saved = ctx->get_saved_variables();
    return {rotate(grads[0].to(saved[0].scalar_type()), saved[0], saved[1], 1), Tensor(), Tensor()};
  }
};

constexpr int kRowThreads = 512;

// Whether every row of contiguous `[rows, V]` `x` starts on a 16-byte boundary.
bool rows_take_packs(const Tensor& x) {
  return aligned({&x}, 16) && (x.size(1) * static_cast<int64_t>(x.element_size())) % 16 == 0;
}

struct CrossEntropy : public torch::autograd::Function<CrossEntropy> {
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, const Tensor& targets, int64_t ignore) {
    int64_t v = logits.size(-1);
    Tensor x = logits.reshape({-1, v}).contiguous(), t = targets.reshape({-1}).to(at::kLong).contiguous();
    int64_t rows = x.size(0);
    auto floats = x.options().dtype(at::kFloat);
    Tensor loss = at::empty({rows}, floats), lse = at::empty({rows}, floats);
    void *xp = x.data_ptr(), *tp = t.data_ptr(), *lp = loss.data_ptr(), *sp = lse.data_ptr();
    int vec = rows_take_packs(x);
    launch(kernel(kCrossEntropy, {{"TX", x.scalar_type()}}, "ce_forward"), rows, kRowThreads,
           {&xp, &tp, &lp, &sp, &v, &ignore, &vec});
    Tensor count = t.ne(ignore).sum(at::kFloat).clamp_min(1);
    ctx->save_for_backward({x, t, lse, count});
    ctx->saved_data["ignore"] = ignore;
    ctx->saved_data["shape"] = logits.sizes().vec();
    return loss.sum().div(count);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    first_order_only("CUDA cross-entropy");
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &t = saved[1], &lse = saved[2], &count = saved[3];
    int64_t ignore = ctx->saved_data["ignore"].toInt(), v = x.size(1), rows = x.size(0);
    Tensor scale = grads[0].to(at::kFloat).div(count).contiguous(), grad = empty_as(x);
    void *xp = x.data_ptr(), *tp = t.data_ptr(), *sp = lse.data_ptr(), *kp = scale.data_ptr(), *gp = grad.data_ptr();
    int vec = rows_take_packs(x) && aligned({&grad}, 16);
    launch(kernel(kCrossEntropy, {{"TX", x.scalar_type()}}, "ce_backward"), rows, kRowThreads,
           {&xp, &tp, &sp, &kp, &gp, &v, &ignore, &vec});
    return {grad.view(ctx->saved_data["shape"].toIntVector()), Tensor(), Tensor()};
  }
};

// The sum and the norm of `x + r` (see kAddNorm); `bias` undefined for RMS norm, `r_in`
// for a norm of `x` alone (of the weight's dtype: the sum is `x`, neither written nor
// returned).
variable_list add_norm_forward(AutogradContext* ctx, const Tensor& x_in, const Tensor& r_in, const Tensor& weight,
                               const Tensor& bias, double eps, at::ScalarType ty) {
  const bool rms = !bias.defined(), summed = r_in.defined();
  const at::ScalarType ts = weight.scalar_type();
  Tensor x = x_in.contiguous(), w = weight.contiguous();
  Tensor r = summed ? r_in.contiguous() : Tensor();
  Tensor b = rms ? w : bias.contiguous();
  int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  Tensor s = summed ? at::empty(x.sizes(), x.options().dtype(ts)) : x;
  Tensor y = at::empty(x.sizes(), x.options().dtype(ty));
  auto floats = x.options().dtype(at::kFloat);
  Tensor mean = at::empty({rows}, floats), rstd = at::empty({rows}, floats);
  float epsf = static_cast<float>(eps);
  int rms_flag = rms;
  void *xp = x.data_ptr(), *rp = summed ? r.data_ptr() : nullptr, *wp = w.data_ptr(), *bp = b.data_ptr();
  void *sp = summed ? s.data_ptr() : nullptr, *yp = y.data_ptr(), *mp = mean.data_ptr(), *ip = rstd.data_ptr();
  const at::ScalarType tr = summed ? r.scalar_type() : x.scalar_type();
  launch(kernel(kAddNorm, {{"TX", x.scalar_type()}, {"TR", tr}, {"TS", ts}, {"TY", ty}}, "add_norm_forward"), rows,
         kThreads, {&xp, &rp, &wp, &bp, &sp, &yp, &mp, &ip, &d, &epsf, &rms_flag});
  ctx->save_for_backward({s, w, mean, rstd});
  ctx->saved_data["rms"] = rms;
  ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(x_in.scalar_type()),
                                                   static_cast<int64_t>(tr), static_cast<int64_t>(ty)};
  if (!summed) return {y};
  return {s, y};
}

// The gradients of x, r (where summed), the weight and (layer norm) the bias from those
// of the sum (undefined where nobody used it) and the norm.
variable_list add_norm_backward(AutogradContext* ctx, const Tensor& grad_sum, const Tensor& grad_norm, bool summed) {
  first_order_only("CUDA add-and-norm");
  auto saved = ctx->get_saved_variables();
  const Tensor &s = saved[0], &w = saved[1], &mean = saved[2], &rstd = saved[3];
  const bool rms = ctx->saved_data["rms"].toBool();
  const at::ScalarType ts = s.scalar_type();
  int64_t d = s.size(-1), rows = d == 0 ? 0 : s.numel() / d;
  const at::ScalarType ty = static_cast<at::ScalarType>(ctx->saved_data["dtypes"].toIntVector()[2]);
  Tensor gy = grad_norm.defined() ? grad_norm.to(ty).contiguous() : at::zeros(s.sizes(), s.options().dtype(ty));
  Tensor gs = grad_sum.defined() ? grad_sum.to(ts).contiguous() : Tensor();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, sms * 8));
  Tensor ds = empty_as(s);
  auto floats = s.options().dtype(at::kFloat);
  Tensor dw = at::zeros({blocks, d}, floats), db = at::zeros({blocks, d}, floats);
  int rms_flag = rms;
  void *gyp = gy.data_ptr(), *gsp = gs.defined() ? gs.data_ptr() : nullptr, *sp = s.data_ptr();
  void *wp = w.data_ptr(), *mp = mean.data_ptr(), *ip = rstd.data_ptr(), *dsp = ds.data_ptr();
  void *dwp = dw.data_ptr(), *dbp = db.data_ptr();
  launch(kernel(kAddNorm, {{"TX", ts}, {"TR", ts}, {"TS", ts}, {"TY", ty}}, "add_norm_backward"), rows ? blocks : 0,
         kThreads,
         {&gyp, &gsp, &sp, &wp, &mp, &ip, &dsp, &dwp, &dbp, &rows, &d, &rms_flag});
  auto dtypes = ctx->saved_data["dtypes"].toIntVector();
  variable_list out{ds.to(static_cast<at::ScalarType>(dtypes[0]))};
  if (summed) out.push_back(ds.to(static_cast<at::ScalarType>(dtypes[1])));
  out.push_back(dw.sum(0).to(w.scalar_type()));
  if (!rms) out.push_back(db.sum(0).to(w.scalar_type()));
  // None for eps and the output dtype.
  out.push_back(Tensor());
  out.push_back(Tensor());
  return out;
}

// Autograd takes no undefined inputs here: one node with a bias, one without, each with a
// residual sum or without.
struct AddLayerNorm : public torch::autograd::Function<AddLayerNorm> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& weight,
                               const Tensor& bias, double eps, int64_t out) {
    return add_norm_forward(ctx, x, r, weight, bias, eps, static_cast<at::ScalarType>(out));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return add_norm_backward(ctx, grads[0], grads[1], true);
  }
};

struct AddRmsNorm : public torch::autograd::Function<AddRmsNorm> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& weight,
                               double eps, int64_t out) {
    return add_norm_forward(ctx, x, r, weight, Tensor(), eps, static_cast<at::ScalarType>(out));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return add_norm_backward(ctx, grads[0], grads[1], true);
  }
};

struct LayerNormTo : public torch::autograd::Function<LayerNormTo> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                               double eps, int64_t out) {
    return add_norm_forward(ctx, x, Tensor(), weight, bias, eps, static_cast<at::ScalarType>(out));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return add_norm_backward(ctx, Tensor(), grads[0], false);
  }
};

struct RmsNormTo : public torch::autograd::Function<RmsNormTo> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps, int64_t out) {
    return add_norm_forward(ctx, x, Tensor(), weight, Tensor(), eps, static_cast<at::ScalarType>(out));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return add_norm_backward(ctx, Tensor(), grads[0], false);
  }
};

bool on_gpu(const Tensor& t) { return t.defined() && t.is_cuda() && served_dtype(t); }

}  // namespace

namespace {

// A grid of 64 × 64 tiles over `x`, for the fp8 kernels.
dim3 fp8_tiles(const Tensor& x) {
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK((rows + 63) / 64 <= 65535, "fp8 cast: too many rows for one grid (", rows, ")");
  return dim3(static_cast<unsigned>((cols + 63) / 64), static_cast<unsigned>((rows + 63) / 64));
}

// Whether `v` is one float per element of `n` on `x`'s GPU.
bool floats_for(const Tensor& v, const Tensor& x, int64_t n) {
  return v.device() == x.device() && v.scalar_type() == at::kFloat && v.is_contiguous() && v.numel() == n;
}

}  // namespace

std::optional<Fp8Cast> fp8_cast(const Tensor& x, const Fp8Scales& scales, bool e5m2, bool transposed) {
  if (!on_gpu(x) || x.dim() != 2 || !x.is_contiguous()) return std::nullopt;
  int64_t rows = x.size(0), cols = x.size(1);
  if (scales.at != nullptr) {
    TORCH_CHECK(floats_for(*scales.at, x, 1), "fp8 cast: a device scale must be one float on the tensor's GPU");
  }
  TORCH_CHECK((scales.rows == nullptr) == (scales.cols == nullptr), "fp8 cast: row scales come with column scales");
  if (scales.rows != nullptr) {
    TORCH_CHECK(floats_for(*scales.rows, x, rows) && floats_for(*scales.cols, x, cols),
                "fp8 cast: rowwise scales must be one float per row and per column on the tensor's GPU");
  }
  c10::cuda::CUDAGuard guard(x.device());
  auto kind = x.options().dtype(e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
  Tensor q = at::empty({rows, cols}, kind);
  Tensor qt = transposed ? at::empty({cols, rows}, kind) : Tensor();
  Tensor amax = at::zeros({}, x.options().dtype(at::kFloat));
  if (x.numel() > 0) {
    float scalef = static_cast<float>(scales.given);
    int e5m2_flag = e5m2;
    void *xp = x.data_ptr(), *qp = q.data_ptr(), *qtp = transposed ? qt.data_ptr() : nullptr, *ap = amax.data_ptr();
    auto pointer = [](const Tensor* t) { return t != nullptr ? t->data_ptr() : nullptr; };
    void *sp = pointer(scales.at), *rp = pointer(scales.rows), *cp = pointer(scales.cols);
    launch(kernel(kFp8Cast, {{"TX", x.scalar_type()}}, "fp8_cast_transpose"), fp8_tiles(x), dim3(256),
           {&xp, &scalef, &sp, &rp, &cp, &qp, &qtp, &ap, &rows, &cols, &e5m2_flag});
  }
  return Fp8Cast{q, qt, amax};
}

std::optional<std::pair<Tensor, Tensor>> row_col_amax(const Tensor& x) {
  if (!on_gpu(x) || x.dim() != 2 || !x.is_contiguous()) return std::nullopt;
  c10::cuda::CUDAGuard guard(x.device());
  int64_t rows = x.size(0), cols = x.size(1);
  auto floats = x.options().dtype(at::kFloat);
  Tensor row_amax = at::zeros({rows}, floats), col_amax = at::zeros({cols}, floats);
  if (x.numel() > 0) {
    void *xp = x.data_ptr(), *rp = row_amax.data_ptr(), *cp = col_amax.data_ptr();
    launch(kernel(kFp8Cast, {{"TX", x.scalar_type()}}, "row_col_amax"), fp8_tiles(x), dim3(256),
           {&xp, &rp, &cp, &rows, &cols});
  }
  return std::make_pair(row_amax, col_amax);
}

std::optional<Tensor> gelu_tanh(const Tensor& x) {
  if (!on_gpu(x)) return std::nullopt;
  c10::cuda::CUDAGuard guard(x.device());
  return GeluTanh::apply(x);
}

std::optional<Tensor> swiglu(const Tensor& gate, const Tensor& up) {
  if (!on_gpu(gate) || !on_gpu(up) || gate.sizes() != up.sizes() || gate.scalar_type() != up.scalar_type()) {
    return std::nullopt;
  }
  c10::cuda::CUDAGuard guard(gate.device());
  return SwiGlu::apply(gate, up);
}

std::optional<Tensor> rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const bool tables = on_gpu(cos) && on_gpu(sin) && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                      cos.is_contiguous() && sin.is_contiguous() && !cos.requires_grad() && !sin.requires_grad() &&
                      cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type();
  if (!on_gpu(x) || !tables || x.dim() != 4 || x.size(2) != cos.size(0) || x.size(3) != cos.size(1) ||
      x.size(3) % 2 != 0) {
    return std::nullopt;
  }
  c10::cuda::CUDAGuard guard(x.device());
  return Rotary::apply(x, cos, sin);
}

std::optional<Tensor> cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore) {
  const bool shapes = logits.dim() >= 1 && targets.numel() * logits.size(-1) == logits.numel() &&
                      logits.size(-1) > 0 && targets.is_cuda() && !at::isFloatingType(targets.scalar_type());
  if (!on_gpu(logits) || !shapes) return std::nullopt;
  c10::cuda::CUDAGuard guard(logits.device());
  return CrossEntropy::apply(logits, targets, ignore);
}

std::optional<std::pair<Tensor, Tensor>> add_norm(const Tensor& x, const std::optional<Tensor>& r,
                                                  const Tensor& weight, const std::optional<Tensor>& bias, double eps,
                                                  bool rms, std::optional<at::ScalarType> out) {
  const at::ScalarType ts = weight.scalar_type();
  const int64_t d = x.dim() >= 1 ? x.size(-1) : 0;
  const bool summand = r ? on_gpu(*r) && x.sizes() == r->sizes() &&
                               at::promote_types(x.scalar_type(), r->scalar_type()) == ts
                         : x.scalar_type() == ts;
  const bool served = on_gpu(x) && summand && on_gpu(weight) && weight.dim() == 1 && weight.size(0) == d && d > 0 &&
                      d <= kMaxPerThread * kThreads &&
                      (rms || (bias && on_gpu(*bias) && bias->scalar_type() == ts && bias->sizes() == weight.sizes()));
  if (!served) return std::nullopt;
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t ty = static_cast<int64_t>(out.value_or(ts));
  if (type_name(static_cast<at::ScalarType>(ty)) == nullptr) return std::nullopt;
  if (!r) {
    auto normed = rms ? RmsNormTo::apply(x, weight, eps, ty) : LayerNormTo::apply(x, weight, *bias, eps, ty);
    return std::make_pair(x, normed[0]);
  }
  auto sum_and_norm =
      rms ? AddRmsNorm::apply(x, *r, weight, eps, ty) : AddLayerNorm::apply(x, *r, weight, *bias, eps, ty);
  return std::make_pair(sum_and_norm[0], sum_and_norm[1]);
}

namespace {

cudaDataType_t blas_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: return CUDA_R_8I;  // not served; checked by the caller
  }
}

void blas_check(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "cuBLASLt ", what, ": status ", static_cast<int>(status));
}

// The largest power of two up to 256 that divides the address: what cuBLASLt may assume.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

template <class T, cublasStatus_t (*Destroy)(T)>
struct Owned {
  T handle = nullptr;
  ~Owned() {
    if (handle != nullptr) Destroy(handle);
  }
};

}  // namespace

bool linear_weight_grad(const Tensor& g, const Tensor& x, const Tensor& dw, const Tensor* db, bool accumulate) {
  const at::ScalarType in = g.scalar_type(), out = dw.scalar_type();
  const bool types = (in == at::kFloat || in == at::kBFloat16 || in == at::kHalf) && x.scalar_type() == in &&
                     (out == in || out == at::kFloat) && (db == nullptr || db->scalar_type() == out);
  const bool on_device = g.is_cuda() && x.device() == g.device() && dw.device() == g.device() &&
                         (db == nullptr || db->device() == g.device());
  if (!types || !on_device || g.dim() != 2 || x.dim() != 2 || g.size(0) != x.size(0)) return false;
  const int64_t rows = g.size(0), outs = g.size(1), ins = x.size(1);
  const bool layouts = g.is_contiguous() && x.is_contiguous() && dw.is_contiguous() &&
                       dw.sizes() == at::IntArrayRef({outs, ins}) &&
                       (db == nullptr || (db->is_contiguous() && db->dim() == 1 && db->size(0) == outs));
  if (!layouts || outs == 0 || ins == 0) return false;
  c10::cuda::CUDAGuard guard(g.device());
  if (rows == 0) {
    if (!accumulate) dw.zero_();
    if (db != nullptr) db->zero_();
    return true;
  }
  // Column-major, as cuBLAS reads: x is `[in, rows]` (A, as is), g `[out, rows]` (B,
  // transposed to `[rows, out]`), dw `[in, out]`: D = A·op(B) = xᵀ·g, which row-major is gᵀ·x;
  // BGRADB sums op(B) over k (the rows) into one value per column of D (per output).
  Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> desc;
  blas_check(cublasLtMatmulDescCreate(&desc.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F), "descriptor");
  const cublasOperation_t no = CUBLAS_OP_N, yes = CUBLAS_OP_T;
  blas_check(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_TRANSA, &no, sizeof(no)), "transa");
  blas_check(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_TRANSB, &yes, sizeof(yes)), "transb");
  if (db != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BGRADB;
    const void* bias = db->data_ptr();
    blas_check(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
               "epilogue");
    blas_check(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
               "bias");
  }
  Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> a, b, d;
  blas_check(cublasLtMatrixLayoutCreate(&a.handle, blas_type(in), ins, rows, ins), "layout of x");
  blas_check(cublasLtMatrixLayoutCreate(&b.handle, blas_type(in), outs, rows, outs), "layout of g");
  blas_check(cublasLtMatrixLayoutCreate(&d.handle, blas_type(out), ins, outs, ins), "layout of dw");
  Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> preference;
  blas_check(cublasLtMatmulPreferenceCreate(&preference.handle), "preference");
  uint64_t workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  blas_check(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &workspace_bytes, sizeof(workspace_bytes)),
             "workspace");
  const std::pair<cublasLtMatmulPreferenceAttributes_t, const void*> aligned[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, x.data_ptr()},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, g.data_ptr()},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, dw.data_ptr()},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, dw.data_ptr()}};
  for (const auto& [attribute, pointer] : aligned) {
    const uint32_t bytes = alignment(pointer);
    blas_check(cublasLtMatmulPreferenceSetAttribute(preference.handle, attribute, &bytes, sizeof(bytes)), "alignment");
  }
  cublasLtHandle_t lt = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t found{};
  int count = 0;
  const cublasStatus_t searched = cublasLtMatmulAlgoGetHeuristic(lt, desc.handle, a.handle, b.handle, d.handle,
                                                                 d.handle, preference.handle, 1, &found, &count);
  if (searched != CUBLAS_STATUS_SUCCESS || count == 0) return false;
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  blas_check(cublasLtMatmul(lt, desc.handle, &one, x.data_ptr(), a.handle, g.data_ptr(), b.handle, &beta,
                            dw.data_ptr(), d.handle, dw.data_ptr(), d.handle, &found.algo,
                            at::cuda::getCUDABlasLtWorkspace(), workspace_bytes, at::cuda::getCurrentCUDAStream()),
             "product");
  return true;
}

// The head widths the attention kernels are compiled for, as the define that binds one.
std::string head_width(int64_t d) { return "#define HD " + std::to_string(d) + "\n"; }

// `x` (`[B, H, T, D]`) as the attention kernels read it in place: unit stride along D, the
// other strides multiples of 8 elements, a 16-byte aligned start; a contiguous copy where not.
Tensor readable(const Tensor& x) {
  const bool in_place = x.stride(3) == 1 && x.stride(0) % 8 == 0 && x.stride(1) % 8 == 0 && x.stride(2) % 8 == 0 &&
                        aligned({&x}, 16);
  return in_place ? x : x.contiguous();
}

constexpr int kAttentionThreads = 128, kAttentionKeys = 64, kAttentionQueries = 64, kBackwardQueries = 32;
constexpr int kPad = 8;

// Shared memory of the forward for head width `d`: two stages of a key and a value tile.
size_t forward_shared_bytes(int64_t d, size_t element) {
  return static_cast<size_t>(4 * kAttentionKeys * (d + kPad)) * element;
}

// Shared memory of the backward for head width `d` (see attention_backward's layout).
size_t backward_shared_bytes(int64_t d, size_t element) {
  const int64_t k = kAttentionKeys, q = kBackwardQueries, row = d + kPad;
  return static_cast<size_t>(2 * k * row + 4 * q * row + q * (k + kPad)) * element;
}

struct Attention : public torch::autograd::Function<Attention> {
  // `sinks`: `[H]`, or empty for none; `cap` ≤ 0: no soft-capping; `window` ≤ 0: none.
  static Tensor forward(AutogradContext* ctx, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                        const Tensor& sinks, double scale, double cap, int64_t window) {
    Tensor q = readable(q_in), k = readable(k_in), v = readable(v_in);
    const int64_t batch = q.size(0), d = q.size(3);
    int t = static_cast<int>(q.size(2)), heads = static_cast<int>(q.size(1)), kv_heads = static_cast<int>(k.size(1));
    Tensor o = at::empty({batch, t, heads, d}, q.options());
    Tensor lse = at::empty({batch, heads, t}, q.options().dtype(at::kFloat));
    Tensor sink = sinks.numel() ? sinks.to(at::kFloat).contiguous() : Tensor();
    int64_t qb = q.stride(0), qh = q.stride(1), qt = q.stride(2), kb = k.stride(0), kh = k.stride(1),
            kt = k.stride(2), vb = v.stride(0), vh = v.stride(1), vt = v.stride(2);
    float scalef = static_cast<float>(scale), capf = static_cast<float>(cap);
    int windowi = static_cast<int>(std::max<int64_t>(window, 0));
    void *qp = q.data_ptr(), *kp = k.data_ptr(), *vp = v.data_ptr(), *op = o.data_ptr(), *lp = lse.data_ptr();
    void* sp = sink.defined() ? sink.data_ptr() : nullptr;
    launch(kernel(kAttention, {{"TX", q.scalar_type()}}, "attention_forward", head_width(d)),
           dim3(static_cast<unsigned>((t + kAttentionQueries - 1) / kAttentionQueries), heads,
                static_cast<unsigned>(batch)),
           dim3(kAttentionThreads), forward_shared_bytes(d, q.element_size()),
           {&qp, &kp, &vp, &op, &lp, &sp, &t, &heads, &kv_heads, &qb, &qh, &qt, &kb, &kh, &kt, &vb, &vh, &vt, &scalef,
            &capf, &windowi});
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->saved_data["sinks"] = sinks.numel() ? sinks : Tensor();
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["cap"] = cap;
    ctx->saved_data["window"] = window;
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    first_order_only("CUDA attention");
    auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const int64_t batch = q.size(0), d = q.size(3);
    int t = static_cast<int>(q.size(2)), heads = static_cast<int>(q.size(1)), kv_heads = static_cast<int>(k.size(1));
    Tensor dout = grads[0].to(q.scalar_type()).contiguous();
    // Each query's dO·O (the sink's share included in O): the softmax's backward term.
    Tensor delta = dout.to(at::kFloat).mul(o.to(at::kFloat)).sum(-1).permute({0, 2, 1}).contiguous();
    Tensor dq = at::zeros({batch, t, heads, d}, q.options().dtype(at::kFloat));
    Tensor dk = at::empty({batch, t, kv_heads, d}, q.options()), dv = at::empty_like(dk);
    int64_t qb = q.stride(0), qh = q.stride(1), qt = q.stride(2), kb = k.stride(0), kh = k.stride(1),
            kt = k.stride(2), vb = v.stride(0), vh = v.stride(1), vt = v.stride(2);
    float scalef = static_cast<float>(ctx->saved_data["scale"].toDouble());
    float capf = static_cast<float>(ctx->saved_data["cap"].toDouble());
    int windowi = static_cast<int>(std::max<int64_t>(ctx->saved_data["window"].toInt(), 0));
    void *qp = q.data_ptr(), *kp = k.data_ptr(), *vp = v.data_ptr(), *dop = dout.data_ptr(), *lp = lse.data_ptr();
    void *ep = delta.data_ptr(), *dqp = dq.data_ptr(), *dkp = dk.data_ptr(), *dvp = dv.data_ptr();
    launch(kernel(kAttention, {{"TX", q.scalar_type()}}, "attention_backward", head_width(d)),
           dim3(static_cast<unsigned>((t + kAttentionKeys - 1) / kAttentionKeys), kv_heads,
                static_cast<unsigned>(batch)),
           dim3(kAttentionThreads), backward_shared_bytes(d, q.element_size()),
           {&qp, &kp, &vp, &dop, &lp, &ep, &dqp, &dkp, &dvp, &t, &heads, &kv_heads, &qb, &qh, &qt, &kb, &kh, &kt, &vb,
            &vh, &vt, &scalef, &capf, &windowi});
    // A sink's gradient: −Σ over queries of its probability times the query's dO·O.
    Tensor dsinks;
    const Tensor sinks = ctx->saved_data["sinks"].toTensor();
    if (sinks.defined()) {
      Tensor share = sinks.to(at::kFloat).view({1, heads, 1}).sub(lse).exp();
      dsinks = share.mul(delta).sum(at::IntArrayRef{0, 2}).neg().to(sinks.scalar_type());
    }
    return {dq.to(q.scalar_type()).transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), dsinks, Tensor(), Tensor(),
            Tensor()};
  }
};

std::optional<Tensor> attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& sinks,
                                double scale, double cap, int64_t window) {
  const auto kind = q.scalar_type();
  const bool shapes = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                      q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3) && k.size(1) > 0 &&
                      q.size(1) % k.size(1) == 0 && (q.size(3) == 64 || q.size(3) == 128) &&
                      q.size(0) <= 65535 && q.size(1) <= 65535 && q.size(2) < (int64_t{1} << 30);
  const bool types = q.is_cuda() && (kind == at::kBFloat16 || kind == at::kHalf) && k.scalar_type() == kind &&
                     v.scalar_type() == kind && k.device() == q.device() && v.device() == q.device();
  if (!shapes || !types) return std::nullopt;
  if (sinks && (sinks->dim() != 1 || sinks->size(0) != q.size(1) || sinks->device() != q.device())) return std::nullopt;
  c10::cuda::CUDAGuard guard(q.device());
  // Tensor-core products of bf16 (mma.sync m16n8k16) need sm_80 or later.
  if (at::cuda::getCurrentDeviceProperties()->major < 8) return std::nullopt;
  const Tensor none = at::empty({0}, q.options().dtype(at::kFloat));
  return Attention::apply(q, k, v, sinks ? *sinks : none, scale, cap, window).transpose(1, 2);
}

void compile_all(const std::string& arch) {
  const at::ScalarType types[] = {at::kFloat, at::kBFloat16, at::kHalf};
  for (auto t : types) {
    compile(kElementwise, bind({{"TX", t}}), arch);
    compile(kCrossEntropy, bind({{"TX", t}}), arch);
    compile(kFp8Cast, bind({{"TX", t}}), arch);
    if (t != at::kFloat) {
      for (int64_t d : {64, 128}) compile(kAttention, bind({{"TX", t}}) + head_width(d), arch);
    }
    for (auto r : types) {
      for (auto y : types) compile(kAddNorm, bind({{"TX", t}, {"TR", r}, {"TS", at::promote_types(t, r)}, {"TY", y}}), arch);
    }
  }
}

}  // namespace strata_cuda
