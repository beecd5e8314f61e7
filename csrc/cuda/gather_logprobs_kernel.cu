// gather_logprobs on CUDA: one block per row, the logits read once with an online logsumexp.
//
// Work split. A row of V elements is cut into chunks of kVec consecutive elements (16 bytes
// of logits). Chunk number k * kThreads + tid belongs to thread tid, so pass k of the block
// covers kThreads * kVec consecutive elements. Each thread folds its chunks into a running
// (m, s, t) in chunk order; then the block merges the kThreads triples through a fixed
// shuffle/shared-memory tree. The assignment of elements to threads and the order of every
// addition depend only on V, never on the row's address, the other rows or the grid size:
// results are deterministic and batch-invariant. 16-byte vector loads are used when the row
// is 16-byte aligned; otherwise the same elements are read one by one and the arithmetic is
// identical.
//
// The running state works in base 2 (as flash attention does): y = z * c with
// c = log2(e) / temperature, so exp(x - m) is one ex2 instruction:
//   m = max_j y_j, s = sum_j 2^(y_j - m), t = sum_j 2^(y_j - m) * (y_j - m)
//   lse = ln2 * (m + log2 s),  entropy = ln2 * (log2 s - t / s)
// (the CPU kernel's formula, entropy = log s - t / s, with every quantity scaled by log2 e).
// A NaN logit, or a +inf one (or an overflowing z / temperature), makes the row's results NaN
// as on CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.h"
#include "cuda/params.h"

namespace pyppo {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread in the aligned main loop

// ---- element types: storage in memory, accumulation type, 16-byte unpack/pack ----

// float and double accumulate in their own type: storage and accumulation are the same.
template <typename T, int kVecT>
struct NativeBase {
  using storage = T;
  using acc = T;
  static constexpr int kVec = kVecT;
  static __device__ __forceinline__ acc to_acc(storage v) { return v; }
  static __device__ __forceinline__ storage from_acc(acc v) { return v; }
};

struct F32 : NativeBase<float, 4> {
  static __device__ __forceinline__ void unpack(const uint4& u, acc (&x)[kVec]) {
    x[0] = __uint_as_float(u.x);
    x[1] = __uint_as_float(u.y);
    x[2] = __uint_as_float(u.z);
    x[3] = __uint_as_float(u.w);
  }
  static __device__ __forceinline__ uint4 pack(const acc (&x)[kVec]) {
    return make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
  }
};

// 16-bit types: two elements per 32-bit word, the lower-addressed element in the low half.
template <typename Derived>
struct Half16Base {
  using storage = unsigned short;
  using acc = float;
  static constexpr int kVec = 8;
  static __device__ __forceinline__ void unpack(const uint4& u, acc (&x)[kVec]) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[2 * k] = Derived::to_acc(static_cast<unsigned short>(w[k] & 0xffffu));
      x[2 * k + 1] = Derived::to_acc(static_cast<unsigned short>(w[k] >> 16));
    }
  }
  static __device__ __forceinline__ uint4 pack(const acc (&x)[kVec]) {
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = static_cast<unsigned>(Derived::from_acc(x[2 * k])) |
             (static_cast<unsigned>(Derived::from_acc(x[2 * k + 1])) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

struct F16 : Half16Base<F16> {
  static __device__ __forceinline__ float to_acc(unsigned short v) { return __half2float(__ushort_as_half(v)); }
  static __device__ __forceinline__ unsigned short from_acc(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

struct BF16 : Half16Base<BF16> {
  // bfloat16 is the upper half of a float32: the conversion up is exact.
  static __device__ __forceinline__ float to_acc(unsigned short v) {
    return __uint_as_float(static_cast<unsigned>(v) << 16);
  }
  static __device__ __forceinline__ unsigned short from_acc(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

struct F64 : NativeBase<double, 2> {
  static __device__ __forceinline__ void unpack(const uint4& u, acc (&x)[kVec]) {
    x[0] = __hiloint2double(static_cast<int>(u.y), static_cast<int>(u.x));
    x[1] = __hiloint2double(static_cast<int>(u.w), static_cast<int>(u.z));
  }
  static __device__ __forceinline__ uint4 pack(const acc (&x)[kVec]) {
    return make_uint4(static_cast<unsigned>(__double2loint(x[0])), static_cast<unsigned>(__double2hiint(x[0])),
                      static_cast<unsigned>(__double2loint(x[1])), static_cast<unsigned>(__double2hiint(x[1])));
  }
};

// ---- math in the accumulation type ----

__device__ __forceinline__ float ex2(float x) {
  // 2^x, flushing denormal results to 0 (they cannot matter: s >= 1 once the max is in).
  // ex2(-inf) = 0, ex2(NaN) = NaN.
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ double ex2(double x) { return ::exp2(x); }
__device__ __forceinline__ float lg2(float x) { return ::log2f(x); }
__device__ __forceinline__ double lg2(double x) { return ::log2(x); }
__device__ __forceinline__ float exp_acc(float x) { return ::expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return ::exp(x); }
__device__ __forceinline__ float fmax_acc(float a, float b) { return ::fmaxf(a, b); }
__device__ __forceinline__ double fmax_acc(double a, double b) { return ::fmax(a, b); }
__device__ __forceinline__ float fma_acc(float a, float b, float c) { return ::fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return ::fma(a, b, c); }
// Products and sums that the compiler must not contract into an fma: the chunk fold is
// inlined twice (vector and scalar loads), and both copies must round identically so that a
// row's bits do not depend on its alignment. Where an fma is wanted it is written out.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

template <typename acc>
struct Consts;
template <>
struct Consts<float> {
  static __device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }
  static __device__ __forceinline__ float nan() { return __int_as_float(0x7fffffff); }
  static __device__ __forceinline__ float lowest() { return -3.402823466e+38f; }
  static constexpr float kLog2e = 1.4426950408889634f;
  static constexpr float kLn2 = 0.6931471805599453f;
};
template <>
struct Consts<double> {
  static __device__ __forceinline__ double inf() { return __longlong_as_double(0x7ff0000000000000ll); }
  static __device__ __forceinline__ double nan() { return __longlong_as_double(0x7fffffffffffffffll); }
  static __device__ __forceinline__ double lowest() { return -1.7976931348623157e+308; }
  static constexpr double kLog2e = 1.4426950408889634;
  static constexpr double kLn2 = 0.6931471805599453;
};

// Running softmax statistics of one thread (or, after merging, of the block), base 2.
template <typename acc>
struct State {
  acc m;  // max of y so far (-inf: nothing but -inf seen yet)
  acc s;  // sum 2^(y - m)
  acc t;  // sum 2^(y - m) * (y - m)   (only with entropy)
};

// Re-bases `a` (max a.m) to max mn >= a.m: s scales by r = 2^(a.m - mn), and t, being relative to
// the max, becomes r * (t + (a.m - mn) * s).
template <typename acc, bool kEntropy>
__device__ __forceinline__ void rebase(State<acc>& a, acc mn) {
  const acc diff = sub_rn(a.m, mn);
  const acc r = ex2(diff);
  if (kEntropy) a.t = mul_rn(r, fma_acc(diff, a.s, a.t));
  a.s = mul_rn(a.s, r);
  a.m = mn;
}

// a <- merge(a, b). An empty side (m = -inf, s = t = 0) is the identity.
template <typename acc, bool kEntropy>
__device__ __forceinline__ void merge(State<acc>& a, State<acc> b) {
  const acc ninf = -Consts<acc>::inf();
  if (b.m == ninf) return;
  if (a.m == ninf) {
    a = b;
    return;
  }
  const acc mn = fmax_acc(a.m, b.m);
  rebase<acc, kEntropy>(a, mn);
  rebase<acc, kEntropy>(b, mn);
  a.s = add_rn(a.s, b.s);
  if (kEntropy) a.t = add_rn(a.t, b.t);
}

// Folds one chunk of raw values x (already converted to acc; -inf for positions past V) into
// the thread's state. c = log2(e) / temperature > 0.
template <typename acc, int kVec, bool kEntropy>
__device__ __forceinline__ void fold_chunk(const acc (&x)[kVec], acc c, State<acc>& st, bool& bad) {
  const acc ninf = -Consts<acc>::inf();
  acc cm = x[0];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    bad |= (x[j] != x[j]);  // NaN
    cm = fmax_acc(cm, x[j]);
  }
  // c > 0, so the scaled maximum is the maximum of the scaled values.
  const acc cm2 = mul_rn(cm, c);
  if (cm2 > st.m) {
    if (st.m != ninf) rebase<acc, kEntropy>(st, cm2);
    st.m = cm2;
  }
  if (st.m == ninf) return;  // only -inf (or NaN, flagged) so far: nothing to add
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const acc d = fma_acc(x[j], c, -st.m);  // y_j - m, in one rounding
    const acc e = ex2(d);
    st.s = add_rn(st.s, e);
    // d = -inf gives e = 0, and 0 * lowest = 0 where 0 * -inf would be NaN.
    if (kEntropy) st.t = fma_acc(e, fmax_acc(d, Consts<acc>::lowest()), st.t);
  }
}

template <typename acc>
__device__ __forceinline__ acc shfl_down(acc v, int off) {
  return __shfl_down_sync(0xffffffffu, v, off);
}

template <typename E, bool kEntropy>
__global__ void __launch_bounds__(kThreads) gather_fwd_kernel(const GatherFwdParams p) {
  using acc = typename E::acc;
  using st_t = typename E::storage;
  constexpr int kVec = E::kVec;
  constexpr int64_t kPass = int64_t(kThreads) * kVec;
  __shared__ acc sh_m[kWarps], sh_s[kWarps], sh_t[kWarps];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const acc ninf = -Consts<acc>::inf();
  const acc inv_tau = acc(1) / static_cast<acc>(p.temperature);  // as the CPU kernel computes it
  const acc c = inv_tau * Consts<acc>::kLog2e;
  const st_t* logits = static_cast<const st_t*>(p.logits);
  acc* out_lp = static_cast<acc*>(p.logprobs);
  acc* out_ent = static_cast<acc*>(p.entropy);
  acc* out_lse = static_cast<acc*>(p.lse);
  const int64_t V = p.V;
  const int64_t num_full = V / kPass;                 // passes where every chunk is inside the row
  const int64_t num_pass = (V + kPass - 1) / kPass;   // all passes

  for (int64_t row = blockIdx.x; row < p.N; row += gridDim.x) {
    const int64_t label = p.labels[row];
    const bool valid = (p.mask == nullptr || p.mask[row]) && label != p.ignore_index;
    if (!valid) {  // the same for every thread of the block
      if (tid == 0) {
        out_lp[row] = acc(0);
        out_lse[row] = acc(0);
        if (kEntropy) out_ent[row] = acc(0);
      }
      continue;
    }
    const st_t* z = logits + row * p.row_stride;
    const bool aligned = (reinterpret_cast<uintptr_t>(z) & 15u) == 0;
    State<acc> st{ninf, acc(0), acc(0)};
    bool bad = false;
    int64_t k = 0;
    if (aligned) {
      for (; k + kUnroll <= num_full; k += kUnroll) {
        uint4 u[kUnroll];
#pragma unroll
        for (int q = 0; q < kUnroll; ++q)
          u[q] = __ldg(reinterpret_cast<const uint4*>(z + ((k + q) * kThreads + tid) * kVec));
#pragma unroll
        for (int q = 0; q < kUnroll; ++q) {
          acc x[kVec];
          E::unpack(u[q], x);
          fold_chunk<acc, kVec, kEntropy>(x, c, st, bad);
        }
      }
      for (; k < num_full; ++k) {
        acc x[kVec];
        E::unpack(__ldg(reinterpret_cast<const uint4*>(z + (k * kThreads + tid) * kVec)), x);
        fold_chunk<acc, kVec, kEntropy>(x, c, st, bad);
      }
    }
    // Unaligned rows, and the last partial pass: the same chunks, element by element.
    for (; k < num_pass; ++k) {
      const int64_t j0 = (k * kThreads + tid) * kVec;
      acc x[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] = (j0 + j < V) ? E::to_acc(__ldg(z + j0 + j)) : ninf;
      fold_chunk<acc, kVec, kEntropy>(x, c, st, bad);
    }
    // +inf (a +inf logit, or z / temperature overflowing) is NaN on CPU too.
    bad = bad || st.m == Consts<acc>::inf();
    bad = __syncthreads_or(bad) != 0;

    // Warp tree, then the warps' results in a fixed tree in warp 0.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      State<acc> o{shfl_down(st.m, off), shfl_down(st.s, off), kEntropy ? shfl_down(st.t, off) : acc(0)};
      merge<acc, kEntropy>(st, o);
    }
    if (lane == 0) {
      sh_m[warp] = st.m;
      sh_s[warp] = st.s;
      sh_t[warp] = st.t;
    }
    __syncthreads();
    if (warp == 0) {
      State<acc> w{ninf, acc(0), acc(0)};
      if (lane < kWarps) w = State<acc>{sh_m[lane], sh_s[lane], sh_t[lane]};
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        State<acc> o{shfl_down(w.m, off), shfl_down(w.s, off), kEntropy ? shfl_down(w.t, off) : acc(0)};
        merge<acc, kEntropy>(w, o);
      }
      if (lane == 0) {
        acc lse, ent;
        if (bad) {
          lse = Consts<acc>::nan();
          ent = Consts<acc>::nan();
        } else {
          // All logits -inf: s = 0, lse = -inf and the entropy NaN, as on CPU.
          const acc log2s = lg2(w.s);
          lse = Consts<acc>::kLn2 * (w.m + log2s);
          ent = Consts<acc>::kLn2 * (log2s - w.t / w.s);
        }
        out_lse[row] = lse;
        out_lp[row] = sub_rn(mul_rn(E::to_acc(z[label]), inv_tau), lse);
        if (kEntropy) out_ent[row] = ent;
      }
    }
    __syncthreads();  // sh_* is reused by the next row
  }
}

// d/dz_j = (g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)) / temperature, with
// x = z / temperature, log p_j = x_j - lse: the CPU kernel's formula, element by element.
template <typename acc>
__device__ __forceinline__ acc grad_elem(acc x, acc lse, acc g_lp, acc g_ent, acc H, acc inv_tau, bool with_ent,
                                         bool is_label) {
  const acc d = sub_rn(x, lse);
  const acc pj = exp_acc(d);
  acc gv = -mul_rn(g_lp, pj);
  if (with_ent) gv = sub_rn(gv, mul_rn(mul_rn(g_ent, pj), add_rn(fmax_acc(d, Consts<acc>::lowest()), H)));
  gv = mul_rn(gv, inv_tau);
  if (is_label) gv = add_rn(gv, mul_rn(g_lp, inv_tau));
  return gv;
}

template <typename E>
__global__ void __launch_bounds__(kThreads) gather_bwd_kernel(const GatherBwdParams p) {
  using acc = typename E::acc;
  using st_t = typename E::storage;
  constexpr int kVec = E::kVec;
  constexpr int64_t kPass = int64_t(kThreads) * kVec;
  const int tid = threadIdx.x;
  const acc inv_tau = acc(1) / static_cast<acc>(p.temperature);
  const st_t* logits = static_cast<const st_t*>(p.logits);
  st_t* grad = static_cast<st_t*>(p.grad_logits);
  const acc* g_lp_p = static_cast<const acc*>(p.grad_logprobs);
  const acc* g_ent_p = static_cast<const acc*>(p.grad_entropy);
  const acc* lse_p = static_cast<const acc*>(p.lse);
  const acc* ent_p = static_cast<const acc*>(p.entropy);
  const int64_t V = p.V;
  const int64_t num_full = V / kPass;
  const int64_t num_pass = (V + kPass - 1) / kPass;

  for (int64_t row = blockIdx.x; row < p.N; row += gridDim.x) {
    const int64_t label = p.labels[row];
    const bool valid = (p.mask == nullptr || p.mask[row]) && label != p.ignore_index;
    st_t* out = grad + row * V;
    const st_t* z = logits + row * p.row_stride;
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(z) | reinterpret_cast<uintptr_t>(out)) & 15u) == 0;
    const acc lse = valid ? lse_p[row] : acc(0);
    const acc g_lp = valid ? g_lp_p[row] : acc(0);
    const acc g_ent = (valid && g_ent_p != nullptr) ? g_ent_p[row] : acc(0);
    const acc H = (valid && g_ent_p != nullptr) ? ent_p[row] : acc(0);
    const bool with_ent = g_ent != acc(0);
    int64_t k = 0;
    if (aligned) {
      for (; k < num_full; ++k) {
        const int64_t j0 = (k * kThreads + tid) * kVec;
        acc g[kVec];
        if (valid) {
          acc x[kVec];
          E::unpack(__ldg(reinterpret_cast<const uint4*>(z + j0)), x);
#pragma unroll
          for (int j = 0; j < kVec; ++j)
            g[j] = grad_elem<acc>(mul_rn(x[j], inv_tau), lse, g_lp, g_ent, H, inv_tau, with_ent, j0 + j == label);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) g[j] = acc(0);
        }
        *reinterpret_cast<uint4*>(out + j0) = E::pack(g);
      }
    }
    for (; k < num_pass; ++k) {
      const int64_t j0 = (k * kThreads + tid) * kVec;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int64_t idx = j0 + j;
        if (idx < V) {
          acc g = acc(0);
          if (valid) g = grad_elem<acc>(mul_rn(E::to_acc(z[idx]), inv_tau), lse, g_lp, g_ent, H, inv_tau, with_ent, idx == label);
          out[idx] = E::from_acc(g);
        }
      }
    }
  }
}

// One block per row: rows are independent, so any grid size gives the same bits; cap it and loop.
int grid_for_rows(int64_t rows) { return grid_for(rows, 1, int64_t(1) << 20); }

template <typename E>
cudaError_t fwd_typed(const GatherFwdParams& p) {
  if (p.entropy != nullptr)
    gather_fwd_kernel<E, true><<<grid_for_rows(p.N), kThreads, 0, p.stream>>>(p);
  else
    gather_fwd_kernel<E, false><<<grid_for_rows(p.N), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

template <typename E>
cudaError_t bwd_typed(const GatherBwdParams& p) {
  gather_bwd_kernel<E><<<grid_for_rows(p.N), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

// f(E{}) with E the element type of the logits' dtype.
template <typename F>
cudaError_t for_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: return f(F32{});
    case DType::Float16: return f(F16{});
    case DType::BFloat16: return f(BF16{});
    case DType::Float64: return f(F64{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_gather_logprobs_fwd(const GatherFwdParams& p) {
  if (p.N <= 0) return cudaSuccess;
  return for_dtype(p.dtype, [&](auto e) { return fwd_typed<decltype(e)>(p); });
}

cudaError_t launch_gather_logprobs_bwd(const GatherBwdParams& p) {
  if (p.N <= 0) return cudaSuccess;
  return for_dtype(p.dtype, [&](auto e) { return bwd_typed<decltype(e)>(p); });
}

}  // namespace cuda
}  // namespace pyppo
