// Group-relative advantages (GRPO, Dr. GRPO, RLOO) on CUDA. One warp per row b, kGroupAdvWarps
// rows per block; every lane of the warp adds the row's group's scores one by one in row order,
// exactly as the CPU kernel's serial loops do:
//   pass 1: count, sum, min, max;   mean = sum / n;
//   pass 2: sum of squared deviations (s_j - mean)^2;
// then the row's advantage (docs/ops.md#group_advantages), written at the row's valid positions.
// With group_size the members are the rows [b - b % n, b - b % n + n), read directly. With
// group_ids the block walks the batch's ids in tiles of kGroupAdvTile rows (staged in shared
// memory, with the scores as double); in each tile every warp takes a ballot of the rows whose id
// equals its row's and visits them in increasing row order: O(B^2 / 32) warp steps per pass,
// meant for the few thousand responses of a GRPO batch.
// Every float64 operation is an explicit IEEE one (no fma contraction), so the results are the
// CPU's bits; there are no atomics, and a group's result depends only on its members' scores and
// their order (deterministic and batch-invariant). tests/ops/cuda_emulation.py replays this kernel
// on the CPU.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/launch.h"
#include "cuda/kernels/kernels.h"

namespace pyppo {
namespace cuda {
namespace {

constexpr int kWarps = kGroupAdvWarps;
constexpr int kThreads = kGroupAdvTile;
constexpr unsigned kFull = 0xffffffffu;

// The CPU kernel's group_advantage, one IEEE operation at a time.
__device__ __forceinline__ double group_advantage(double s, int64_t n, double mean, double sq_dev, bool all_equal,
                                                  const GroupAdvantagesArgs& p) {
  if (n == 1) return (p.std_normalize && !p.rloo) ? __ddiv_rn(s, add_rn(1.0, p.eps)) : s;
  if (all_equal) return 0.0;
  const double d = sub_rn(s, mean);
  if (p.rloo) return mul_rn(d, __ddiv_rn(static_cast<double>(n), static_cast<double>(n - 1)));
  if (!p.std_normalize) return d;
  return __ddiv_rn(d, add_rn(__dsqrt_rn(__ddiv_rn(sq_dev, static_cast<double>(n - 1))), p.eps));
}

// f(score) for every row j with group_ids[j] == g, in increasing j, on every lane of the warp
// (when `active`; the block's threads all stage the tiles).
template <typename T, typename F>
__device__ __forceinline__ void for_each_member(const GroupAdvantagesArgs& p, int64_t g, bool active, int64_t* sh_id,
                                                double* sh_s, F&& f) {
  const T* sp = static_cast<const T*>(p.scores);
  const int lane = threadIdx.x & 31;
  for (int64_t base = 0; base < p.B; base += kThreads) {
    const int64_t j = base + threadIdx.x;
    __syncthreads();  // every warp is done with the previous tile
    sh_id[threadIdx.x] = j < p.B ? p.group_ids[j] : 0;
    sh_s[threadIdx.x] = j < p.B ? static_cast<double>(sp[j]) : 0.0;
    __syncthreads();
    if (!active) continue;
    for (int k0 = 0; k0 < kThreads; k0 += 32) {
      const bool match = base + k0 + lane < p.B && sh_id[k0 + lane] == g;
      unsigned bits = __ballot_sync(kFull, match);
      while (bits) {
        const int k = __ffs(bits) - 1;
        bits &= bits - 1;
        f(sh_s[k0 + k]);
      }
    }
  }
}

// A group's running statistics on one lane, added in row order with the CPU kernel's operations.
struct GroupStats {
  int64_t n = 0;
  double sum = 0.0, lo = 0.0, hi = 0.0, sq = 0.0;
  __device__ __forceinline__ void add(double v) {
    if (n++ == 0) {
      lo = hi = v;
    } else {
      lo = v < lo ? v : lo;  // std::min(lo, v)
      hi = hi < v ? v : hi;  // std::max(hi, v)
    }
    sum = add_rn(sum, v);
  }
  __device__ __forceinline__ double mean() const { return n > 0 ? __ddiv_rn(sum, static_cast<double>(n)) : 0.0; }
  __device__ __forceinline__ void add_sq(double v, double mean) {
    const double d = sub_rn(v, mean);
    sq = add_rn(sq, mul_rn(d, d));
  }
};

// Row b's advantage from its group's statistics, written at the row's valid positions by the warp.
template <typename T>
__device__ __forceinline__ void write_row(const GroupAdvantagesArgs& p, int64_t b, const GroupStats& st, double mean) {
  const T* sp = static_cast<const T*>(p.scores);
  const int lane = threadIdx.x & 31;
  const T a = static_cast<T>(group_advantage(static_cast<double>(sp[b]), st.n, mean, st.sq, st.lo == st.hi, p));
  const bool* m = p.mask + b * p.T;
  T* out = static_cast<T*>(p.advantages) + b * p.T;
  for (int64_t t = lane; t < p.T; t += 32) out[t] = m[t] ? a : T(0);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) group_advantages_kernel(const GroupAdvantagesArgs p) {
  __shared__ int64_t sh_id[kThreads];
  __shared__ double sh_s[kThreads];
  // Row blocks in a grid-stride loop whose trip count is the same for every thread of a block
  // (the tiles are staged with __syncthreads).
  for (int64_t rb = blockIdx.x; rb * kWarps < p.B; rb += gridDim.x) {
    const int64_t b = rb * kWarps + (threadIdx.x >> 5);
    const bool active = b < p.B;
    const int64_t g = active ? p.group_ids[b] : 0;

    GroupStats st;
    for_each_member<T>(p, g, active, sh_id, sh_s, [&](double v) { st.add(v); });
    const double mean = st.mean();
    for_each_member<T>(p, g, active, sh_id, sh_s, [&](double v) { st.add_sq(v, mean); });
    if (active) write_row<T>(p, b, st, mean);
  }
}

// group_size: the members of row b's group are the n rows from b - b % n, read in order.
template <typename T>
__global__ void __launch_bounds__(kThreads) group_advantages_sized_kernel(const GroupAdvantagesArgs p) {
  const T* sp = static_cast<const T*>(p.scores);
  const int64_t n = p.group_size;
  for (int64_t b = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); b < p.B; b += int64_t(gridDim.x) * kWarps) {
    const T* s = sp + (b - b % n);
    GroupStats st;
    for (int64_t j = 0; j < n; ++j) st.add(static_cast<double>(s[j]));
    const double mean = st.mean();
    for (int64_t j = 0; j < n; ++j) st.add_sq(static_cast<double>(s[j]), mean);
    write_row<T>(p, b, st, mean);
  }
}

}  // namespace

cudaError_t launch_group_advantages(const GroupAdvantagesArgs& p) {
  if (p.B <= 0) return cudaSuccess;
  const int grid = grid_for(p.B, kWarps, int64_t(1) << 20);
  return launch_for_acc(p.is_double, [&](auto t) {
    if (p.group_size > 0) {
      group_advantages_sized_kernel<decltype(t)><<<grid, kThreads, 0, p.stream>>>(p);
    } else {
      group_advantages_kernel<decltype(t)><<<grid, kThreads, 0, p.stream>>>(p);
    }
  });
}

}  // namespace cuda
}  // namespace pyppo
