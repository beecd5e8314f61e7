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
// identical. Rows are found through a RowLayout (row_layout.h), so a view sliced along T is
// read in place.
//
// The running state is in natural units, x = z / temperature rounded as the CPU rounds it:
//   m = max_j x_j, s = sum_j e^(x_j - m), t = sum_j e^(x_j - m) * (x_j - m)
//   lse = m + ln s,  entropy = ln s - t / s,  logprob = (x_label - m) - ln s
// with each e^d computed as one ex2 instruction, 2^(d * log2 e). The max and the label term
// are the same rounded product z * (1 / temperature), so a label at the max gives
// x_label - m = 0 exactly, and the max's own term is 2^0 = 1, so s >= 1 and ln s >= 0: the
// log-prob is <= 0, and exactly 0 for V = 1 and for one-hot rows (a final min with 0 guards
// the bound against the approximate ex2/lg2 of other terms). Scaling by log2 e only after the
// subtraction keeps every finite z / temperature finite (huge logits stay finite, as on CPU).
// A NaN logit, or a +inf one (or an overflowing z / temperature), makes the row's results NaN
// as on CPU. tests/ops/cuda_emulation.py replays these operations in float32 on the CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/launch.h"
#include "cuda/kernels/kernels.h"

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
__device__ __forceinline__ float fmax_acc(float a, float b) { return ::fmaxf(a, b); }
__device__ __forceinline__ double fmax_acc(double a, double b) { return ::fmax(a, b); }
__device__ __forceinline__ float fma_acc(float a, float b, float c) { return ::fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return ::fma(a, b, c); }
// Products and sums go through mul_rn / add_rn / sub_rn (cuda/launch.h), never contracted into
// an fma: the chunk fold is inlined twice (vector and scalar loads), and both copies must round
// identically so that a row's bits do not depend on its alignment. Where an fma is wanted it is
// written out.

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

// Running softmax statistics of one thread (or, after merging, of the block), x = z / temperature.
template <typename acc>
struct State {
  acc m;  // max of x so far (-inf: nothing but -inf seen yet)
  acc s;  // sum e^(x - m)
  acc t;  // sum e^(x - m) * (x - m)   (only with entropy)
};

// Re-bases `a` (max a.m) to max mn >= a.m: s scales by r = e^(a.m - mn), and t, being relative
// to the max, becomes r * (t + (a.m - mn) * s). Where r underflows to 0 (a.m - mn may even be
// -inf, when huge logits of both signs overflow the difference), a's terms vanish: 0, not
// 0 * -inf.
template <typename acc, bool kEntropy>
__device__ __forceinline__ void rebase(State<acc>& a, acc mn) {
  const acc diff = sub_rn(a.m, mn);
  const acc r = ex2(mul_rn(diff, Consts<acc>::kLog2e));
  if (kEntropy) a.t = r == acc(0) ? acc(0) : mul_rn(r, fma_acc(diff, a.s, a.t));
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

// Folds one chunk of raw values z (already converted to acc; -inf for positions past V) into
// the thread's state. inv_tau = 1 / temperature > 0; kScaled is false at temperature 1, where
// the product would be exact anyway.
template <typename acc, int kVec, bool kEntropy, bool kScaled>
__device__ __forceinline__ void fold_chunk(const acc (&z)[kVec], acc inv_tau, State<acc>& st, bool& bad) {
  const acc ninf = -Consts<acc>::inf();
  acc cm = z[0];
#pragma unroll
  for (int j = 1; j < kVec; ++j) cm = fmax_acc(cm, z[j]);  // ignores NaN (caught below)
  // inv_tau > 0 and rounding is monotone, so the scaled maximum is the maximum of the scaled
  // values, rounded the same way as each of them.
  const acc cmx = kScaled ? mul_rn(cm, inv_tau) : cm;
  if (cmx > st.m) {
    if (st.m != ninf) rebase<acc, kEntropy>(st, cmx);
    st.m = cmx;
  }
  if (st.m == ninf) {
    // Only -inf or NaN so far: nothing to add, but a NaN must poison the row. Once the max is
    // finite a NaN reaches s through its own term.
#pragma unroll
    for (int j = 0; j < kVec; ++j) bad |= (z[j] != z[j]);
    return;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const acc x = kScaled ? mul_rn(z[j], inv_tau) : z[j];
    const acc d = sub_rn(x, st.m);  // <= 0; exactly 0 at the max
    const acc e = ex2(mul_rn(d, Consts<acc>::kLog2e));
    st.s = add_rn(st.s, e);
    // d = -inf gives e = 0, and 0 * lowest = 0 where 0 * -inf would be NaN.
    if (kEntropy) st.t = fma_acc(e, fmax_acc(d, Consts<acc>::lowest()), st.t);
  }
}

template <typename acc>
__device__ __forceinline__ acc shfl_down(acc v, int off) {
  return __shfl_down_sync(0xffffffffu, v, off);
}

// The label's row is valid but its label is outside [0, V): NaN outputs, nothing indexed (the
// impl raises the error from its own check of the labels).
__device__ __forceinline__ bool label_out_of_range(int64_t label, int64_t V) {
  return static_cast<uint64_t>(label) >= static_cast<uint64_t>(V);
}

template <typename E, bool kEntropy, bool kScaled>
__global__ void __launch_bounds__(kThreads) gather_fwd_kernel(const GatherFwdArgs p) {
  using acc = typename E::acc;
  using st_t = typename E::storage;
  constexpr int kVec = E::kVec;
  constexpr int64_t kPass = int64_t(kThreads) * kVec;
  __shared__ acc sh_m[kWarps], sh_s[kWarps], sh_t[kWarps];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const acc ninf = -Consts<acc>::inf();
  const acc inv_tau = acc(1) / static_cast<acc>(p.temperature);  // as the CPU kernel computes it
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
    if (!valid || label_out_of_range(label, V)) {  // the same for every thread of the block
      if (tid == 0) {
        const acc v = valid ? Consts<acc>::nan() : acc(0);
        out_lp[row] = v;
        out_lse[row] = v;
        if (kEntropy) out_ent[row] = v;
      }
      continue;
    }
    const st_t* z = logits + row_offset(p.rows, row);
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
          fold_chunk<acc, kVec, kEntropy, kScaled>(x, inv_tau, st, bad);
        }
      }
      for (; k < num_full; ++k) {
        acc x[kVec];
        E::unpack(__ldg(reinterpret_cast<const uint4*>(z + (k * kThreads + tid) * kVec)), x);
        fold_chunk<acc, kVec, kEntropy, kScaled>(x, inv_tau, st, bad);
      }
    }
    // Unaligned rows, and the last partial pass: the same chunks, element by element.
    for (; k < num_pass; ++k) {
      const int64_t j0 = (k * kThreads + tid) * kVec;
      acc x[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] = (j0 + j < V) ? E::to_acc(__ldg(z + j0 + j)) : ninf;
      fold_chunk<acc, kVec, kEntropy, kScaled>(x, inv_tau, st, bad);
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
        acc lse, ent, lp;
        if (bad) {
          lse = ent = lp = Consts<acc>::nan();
        } else {
          // All logits -inf: s = 0, lse = -inf and the entropy NaN, as on CPU.
          const acc ln_s = mul_rn(Consts<acc>::kLn2, lg2(w.s));
          lse = add_rn(w.m, ln_s);
          ent = sub_rn(ln_s, w.t / w.s);
          const acc x_label = kScaled ? mul_rn(E::to_acc(z[label]), inv_tau) : E::to_acc(z[label]);
          lp = sub_rn(sub_rn(x_label, w.m), ln_s);
          lp = lp > acc(0) ? acc(0) : lp;  // keeps a NaN
        }
        out_lse[row] = lse;
        out_lp[row] = lp;
        if (kEntropy) out_ent[row] = ent;
      }
    }
    __syncthreads();  // sh_* is reused by the next row
  }
}

// d/dz_j = (g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)) / temperature, with
// x = z / temperature, log p_j = x_j - lse: the CPU kernel's formula, element by element, less
// the onehot term, which the caller adds to the label's element only.
template <typename acc, bool kEntropy, bool kScaled>
__device__ __forceinline__ acc grad_elem(acc z, acc lse, acc g_lp, acc g_ent, acc H, acc inv_tau) {
  const acc x = kScaled ? mul_rn(z, inv_tau) : z;
  const acc d = sub_rn(x, lse);
  const acc pj = ex2(mul_rn(d, Consts<acc>::kLog2e));
  acc gv = -mul_rn(g_lp, pj);
  if (kEntropy) gv = sub_rn(gv, mul_rn(mul_rn(g_ent, pj), add_rn(fmax_acc(d, Consts<acc>::lowest()), H)));
  return kScaled ? mul_rn(gv, inv_tau) : gv;
}

// The gradients of one chunk of kVec elements starting at column j0, the label's onehot term
// added when the label falls in the chunk (one test per chunk, not per element).
template <typename acc, int kVec, bool kEntropy, bool kScaled>
__device__ __forceinline__ void grad_chunk(const acc (&z)[kVec], acc (&g)[kVec], int64_t j0, int64_t label, acc lse,
                                           acc g_lp, acc g_ent, acc H, acc inv_tau) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) g[j] = grad_elem<acc, kEntropy, kScaled>(z[j], lse, g_lp, g_ent, H, inv_tau);
  const uint64_t rel = static_cast<uint64_t>(label - j0);
  if (rel < static_cast<uint64_t>(kVec)) {
    const acc onehot = kScaled ? mul_rn(g_lp, inv_tau) : g_lp;
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (rel == static_cast<uint64_t>(j)) g[j] = add_rn(g[j], onehot);
  }
}

// Row out[0, V) of the gradient := v, with 16-byte stores where the row is aligned.
template <typename E>
__device__ __forceinline__ void fill_row(typename E::storage* out, int64_t V, typename E::acc v) {
  constexpr int kVec = E::kVec;
  int64_t j = threadIdx.x;
  if ((reinterpret_cast<uintptr_t>(out) & 15u) == 0) {
    typename E::acc x[kVec];
#pragma unroll
    for (int q = 0; q < kVec; ++q) x[q] = v;
    const uint4 u = E::pack(x);
    const int64_t chunks = V / kVec;
    for (int64_t c = threadIdx.x; c < chunks; c += kThreads) *reinterpret_cast<uint4*>(out + c * kVec) = u;
    j = chunks * kVec + threadIdx.x;
  }
  for (; j < V; j += kThreads) out[j] = E::from_acc(v);
}

template <typename E, bool kEntropy, bool kScaled>
__global__ void __launch_bounds__(kThreads) gather_bwd_kernel(const GatherBwdArgs p) {
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
    if (!valid || label_out_of_range(label, V)) {
      // Zeros for a skipped row, NaN for a bad label's (the impl raises its error).
      fill_row<E>(out, V, valid ? Consts<acc>::nan() : acc(0));
      continue;
    }
    const st_t* z = logits + row_offset(p.rows, row);
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(z) | reinterpret_cast<uintptr_t>(out)) & 15u) == 0;
    const acc lse = lse_p[row];
    const acc g_lp = g_lp_p[row];
    const acc g_ent = g_ent_p != nullptr ? g_ent_p[row] : acc(0);
    const acc H = g_ent_p != nullptr ? ent_p[row] : acc(0);
    int64_t k = 0;
    if (aligned) {
      // kUnroll 16-byte loads in flight per thread, then their gradients.
      for (; k + kUnroll <= num_full; k += kUnroll) {
        uint4 u[kUnroll];
#pragma unroll
        for (int q = 0; q < kUnroll; ++q)
          u[q] = __ldg(reinterpret_cast<const uint4*>(z + ((k + q) * kThreads + tid) * kVec));
#pragma unroll
        for (int q = 0; q < kUnroll; ++q) {
          const int64_t j0 = ((k + q) * kThreads + tid) * kVec;
          acc x[kVec], g[kVec];
          E::unpack(u[q], x);
          grad_chunk<acc, kVec, kEntropy, kScaled>(x, g, j0, label, lse, g_lp, g_ent, H, inv_tau);
          *reinterpret_cast<uint4*>(out + j0) = E::pack(g);
        }
      }
      for (; k < num_full; ++k) {
        const int64_t j0 = (k * kThreads + tid) * kVec;
        acc x[kVec], g[kVec];
        E::unpack(__ldg(reinterpret_cast<const uint4*>(z + j0)), x);
        grad_chunk<acc, kVec, kEntropy, kScaled>(x, g, j0, label, lse, g_lp, g_ent, H, inv_tau);
        *reinterpret_cast<uint4*>(out + j0) = E::pack(g);
      }
    }
    // Unaligned rows, and the last partial pass: the same arithmetic, element by element.
    for (; k < num_pass; ++k) {
      const int64_t j0 = (k * kThreads + tid) * kVec;
      acc x[kVec], g[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] = (j0 + j < V) ? E::to_acc(__ldg(z + j0 + j)) : acc(0);
      grad_chunk<acc, kVec, kEntropy, kScaled>(x, g, j0, label, lse, g_lp, g_ent, H, inv_tau);
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        if (j0 + j < V) out[j0 + j] = E::from_acc(g[j]);
    }
  }
}

// One block per row: rows are independent, so any grid size gives the same bits; cap it and loop.
int grid_for_rows(int64_t rows) { return grid_for(rows, 1, int64_t(1) << 20); }

template <typename E, bool kEntropy, bool kScaled>
void fwd_launch(const GatherFwdArgs& p) {
  gather_fwd_kernel<E, kEntropy, kScaled><<<grid_for_rows(p.N), kThreads, 0, p.stream>>>(p);
}

template <typename E>
cudaError_t fwd_typed(const GatherFwdArgs& p) {
  const bool scaled = p.temperature != 1.0;
  const bool ent = p.entropy != nullptr;
  if (ent)
    scaled ? fwd_launch<E, true, true>(p) : fwd_launch<E, true, false>(p);
  else
    scaled ? fwd_launch<E, false, true>(p) : fwd_launch<E, false, false>(p);
  return cudaGetLastError();
}

template <typename E, bool kEntropy, bool kScaled>
void bwd_launch(const GatherBwdArgs& p) {
  gather_bwd_kernel<E, kEntropy, kScaled><<<grid_for_rows(p.N), kThreads, 0, p.stream>>>(p);
}

template <typename E>
cudaError_t bwd_typed(const GatherBwdArgs& p) {
  const bool scaled = p.temperature != 1.0;
  // Without an entropy gradient the entropy term is skipped whole (g_ent = 0 would add -0).
  const bool ent = p.grad_entropy != nullptr;
  if (ent)
    scaled ? bwd_launch<E, true, true>(p) : bwd_launch<E, true, false>(p);
  else
    scaled ? bwd_launch<E, false, true>(p) : bwd_launch<E, false, false>(p);
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

cudaError_t launch_gather_logprobs_fwd(const GatherFwdArgs& p) {
  if (p.N <= 0) return cudaSuccess;
  return for_dtype(p.dtype, [&](auto e) { return fwd_typed<decltype(e)>(p); });
}

cudaError_t launch_gather_logprobs_bwd(const GatherBwdArgs& p) {
  if (p.N <= 0) return cudaSuccess;
  return for_dtype(p.dtype, [&](auto e) { return bwd_typed<decltype(e)>(p); });
}

}  // namespace cuda
}  // namespace pyppo
