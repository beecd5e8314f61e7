// Generalized Advantage Estimation on CUDA, right to left over the valid positions of a row:
//   delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next,   R_t = A_t + V_t
// where "next" is the next *valid* position (a masked position is skipped without breaking
// the chain), V_next after the last valid position is last_values[b] (or 0), A_next there is 0.
//
// Two kernels, chosen by T alone (so a row's bits never depend on the batch size):
//  * T < kGaeBlockScanMinT: one thread per row, the CPU kernel's loop verbatim.
//  * T >= kGaeBlockScanMinT: one block per row. The row is cut into kThreads contiguous
//    segments, one per thread, and the recurrence, an affine map A -> delta + c * A per
//    position (c = gamma * lam at a valid position; the identity, delta = 0 and c = 1, at a
//    masked one), is solved in three passes:
//      1. each thread finds the value at its segment's first valid position; thread 0 walks
//         the segments right to left to give each one V_next at its right edge;
//      2. each thread composes its segment's maps into one (C, D): A_left = D + C * A_right;
//         thread 0 walks the segments right to left applying them to get A at each edge;
//      3. each thread reruns its segment from its right edge's (V_next, A) writing outputs.
//    Every order is fixed, so the result is deterministic.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/params.h"

namespace pyppo {
namespace cuda {
namespace {

constexpr int kRowThreads = 128;  // threads per block of the one-thread-per-row kernel
constexpr int kThreads = 256;     // threads per block (= segments per row) of the block kernel

// The recurrence over positions [t_begin, t_end) of one row (pointers at the row's start), right
// to left from (next_value, next_adv) at the segment's right edge; both kernels run it.
template <typename T>
__device__ __forceinline__ void scan_segment(const T* rp, const T* vp, const bool* mp, T* ap, T* op, int64_t t_begin,
                                             int64_t t_end, T g, T gl, T next_value, T next_adv) {
  for (int64_t t = t_end - 1; t >= t_begin; --t) {
    if (!mp[t]) {
      ap[t] = T(0);
      op[t] = T(0);
      continue;
    }
    const T v = vp[t];
    const T delta = rp[t] + g * next_value - v;
    next_adv = delta + gl * next_adv;
    next_value = v;
    ap[t] = next_adv;
    op[t] = next_adv + v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads) gae_rows_kernel(const GAEParams p) {
  const T* rp = static_cast<const T*>(p.rewards);
  const T* vp = static_cast<const T*>(p.values);
  const T* bp = static_cast<const T*>(p.last_values);
  T* ap = static_cast<T*>(p.advantages);
  T* op = static_cast<T*>(p.returns);
  const T g = static_cast<T>(p.gamma);
  const T gl = static_cast<T>(p.gamma * p.lam);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < p.B; b += stride) {
    const int64_t row = b * p.T;
    scan_segment(rp + row, vp + row, p.mask + row, ap + row, op + row, 0, p.T, g, gl, bp ? bp[b] : T(0), T(0));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) gae_block_kernel(const GAEParams p) {
  __shared__ T sh_a[kThreads];   // pass 1: first valid value of the segment; then V_next at its right edge
  __shared__ T sh_b[kThreads];   // pass 2: C of the segment; then A at its right edge
  __shared__ T sh_c[kThreads];   // pass 2: D of the segment
  __shared__ bool sh_has[kThreads];

  const T* bp = static_cast<const T*>(p.last_values);
  const T g = static_cast<T>(p.gamma);
  const T gl = static_cast<T>(p.gamma * p.lam);
  const int tid = threadIdx.x;
  const int64_t T_ = p.T;
  const int64_t seg = (T_ + kThreads - 1) / kThreads;  // segment length; depends on T only
  const int64_t t_begin = tid * seg < T_ ? tid * seg : T_;
  const int64_t t_end = t_begin + seg < T_ ? t_begin + seg : T_;

  for (int64_t b = blockIdx.x; b < p.B; b += gridDim.x) {
    const T* rp = static_cast<const T*>(p.rewards) + b * T_;
    const T* vp = static_cast<const T*>(p.values) + b * T_;
    const bool* mp = p.mask + b * T_;
    T* ap = static_cast<T*>(p.advantages) + b * T_;
    T* op = static_cast<T*>(p.returns) + b * T_;

    // Pass 1: the value at the segment's first (leftmost) valid position.
    bool has = false;
    T first_v = T(0);
    for (int64_t t = t_end - 1; t >= t_begin; --t)
      if (mp[t]) {
        has = true;
        first_v = vp[t];
      }
    sh_has[tid] = has;
    sh_a[tid] = first_v;
    __syncthreads();
    if (tid == 0) {
      T carry = bp ? bp[b] : T(0);
      for (int k = kThreads - 1; k >= 0; --k) {
        const bool hk = sh_has[k];
        const T fk = sh_a[k];
        sh_a[k] = carry;  // V_next at segment k's right edge
        if (hk) carry = fk;
      }
    }
    __syncthreads();
    const T v_next_edge = sh_a[tid];

    // Pass 2: the segment's composed map A_left = D + C * A_right.
    T C = T(1), D = T(0);
    {
      T next_value = v_next_edge;
      for (int64_t t = t_end - 1; t >= t_begin; --t) {
        if (!mp[t]) continue;
        const T v = vp[t];
        const T delta = rp[t] + g * next_value - v;
        D = delta + gl * D;
        C = gl * C;
        next_value = v;
      }
    }
    sh_b[tid] = C;
    sh_c[tid] = D;
    __syncthreads();
    if (tid == 0) {
      T a = T(0);  // A after the row's last valid position
      for (int k = kThreads - 1; k >= 0; --k) {
        const T Ck = sh_b[k];
        const T Dk = sh_c[k];
        sh_b[k] = a;  // A at segment k's right edge
        a = Dk + Ck * a;
      }
    }
    __syncthreads();
    const T a_edge = sh_b[tid];

    // Pass 3: the CPU loop over the segment, started from the right edge's state.
    scan_segment(rp, vp, mp, ap, op, t_begin, t_end, g, gl, v_next_edge, a_edge);
    __syncthreads();  // shared arrays are rewritten by the next row
  }
}

template <typename T>
cudaError_t launch_typed(const GAEParams& p) {
  if (p.T >= kGaeBlockScanMinT) {
    const int grid = static_cast<int>(p.B < (int64_t(1) << 20) ? p.B : (int64_t(1) << 20));
    gae_block_kernel<T><<<grid, kThreads, 0, p.stream>>>(p);
  } else {
    const int64_t blocks = (p.B + kRowThreads - 1) / kRowThreads;
    const int grid = static_cast<int>(blocks < (int64_t(1) << 20) ? blocks : (int64_t(1) << 20));
    gae_rows_kernel<T><<<grid, kRowThreads, 0, p.stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gae(const GAEParams& p) {
  if (p.B <= 0 || p.T <= 0) return cudaSuccess;
  return p.is_double ? launch_typed<double>(p) : launch_typed<float>(p);
}

}  // namespace cuda
}  // namespace pyppo
