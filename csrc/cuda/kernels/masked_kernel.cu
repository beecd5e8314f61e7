// masked_mean, masked_var and masked_whiten on CUDA.
//
// Whole-tensor moments are reduced in two deterministic stages, in double as on CPU:
//   stage 1: block k sums the valid elements of chunk k (kMaskedChunk elements) in a fixed
//            order (thread tid takes elements tid, tid + kThreads, ...; then a fixed shared
//            memory tree) and writes partial k;
//   stage 2: one block adds the partials in a fixed order (strided per thread, then the tree).
// No atomics, so the same input gives the same bits on every run. The results stay on the
// device (stats[4], see kernels.h): the impl reads them back once, for the error checks.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/launch.h"
#include "cuda/kernels/kernels.h"

namespace pyppo {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ double nan_d() { return __longlong_as_double(0x7ff8000000000000ll); }

// Fixed-shape tree over kThreads values in shared memory; the result is in sh[0] for everyone.
__device__ __forceinline__ double block_sum(double v, double* sh) {
  const int tid = threadIdx.x;
  sh[tid] = v;
  __syncthreads();
#pragma unroll
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (tid < stride) sh[tid] = sh[tid] + sh[tid + stride];
    __syncthreads();
  }
  const double out = sh[0];
  __syncthreads();  // sh may be reused right after
  return out;
}

// Stage 1. kSquares: sum of (x - mean)^2 with mean = stats[2]; else sum of x and the count.
template <typename T, bool kSquares>
__global__ void __launch_bounds__(kThreads) partials_kernel(const MaskedStatsArgs p) {
  __shared__ double sh[kThreads];
  const T* x = static_cast<const T*>(p.x);
  const int64_t P = masked_num_partials(p.n);
  const int64_t begin = int64_t(blockIdx.x) * kMaskedChunk;
  const int64_t end = begin + kMaskedChunk < p.n ? begin + kMaskedChunk : p.n;
  const double mean = kSquares ? p.stats[2] : 0.0;
  double s = 0.0, c = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    if (!p.mask[i]) continue;
    const double xi = static_cast<double>(x[i]);
    if (kSquares) {
      const double d = xi - mean;
      s += d * d;
    } else {
      s += xi;
      c += 1.0;
    }
  }
  s = block_sum(s, sh);
  if (!kSquares) c = block_sum(c, sh);
  if (threadIdx.x == 0) {
    p.partials[blockIdx.x] = s;
    if (!kSquares) p.partials[P + blockIdx.x] = c;
  }
}

// Stage 2, one block.
template <bool kSquares>
__global__ void __launch_bounds__(kThreads) finish_kernel(const MaskedStatsArgs p) {
  __shared__ double sh[kThreads];
  const int64_t P = masked_num_partials(p.n);
  double s = 0.0, c = 0.0;
  for (int64_t k = threadIdx.x; k < P; k += kThreads) {
    s += p.partials[k];
    if (!kSquares) c += p.partials[P + k];
  }
  s = block_sum(s, sh);
  if (!kSquares) c = block_sum(c, sh);
  if (threadIdx.x == 0) {
    if (kSquares) {
      const double count = p.stats[1];
      const double denom = p.unbiased ? count - 1.0 : count;
      p.stats[3] = denom > 0.0 ? s / denom : nan_d();  // the impl raises when denom <= 0
    } else {
      p.stats[0] = s;
      p.stats[1] = c;
      p.stats[2] = c > 0.0 ? s / c : nan_d();
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) whiten_kernel(const MaskedWhitenArgs p) {
  const T* x = static_cast<const T*>(p.x);
  T* o = static_cast<T*>(p.out);
  const double mean = p.stats[2];
  const double var = p.stats[3];
  const double inv_std = 1.0 / sqrt(var + p.eps);  // IEEE division and sqrt, as on CPU
  const double add_back = p.shift_mean ? 0.0 : mean;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += stride)
    o[i] = p.mask[i] ? static_cast<T>(__dadd_rn(__dmul_rn(static_cast<double>(x[i]) - mean, inv_std), add_back)) : T(0);
}

// One warp per slice: lanes take elements lane, lane + 32, ... in order, then a fixed shuffle tree.
template <typename T>
__global__ void __launch_bounds__(kThreads) mean_dim_kernel(const MaskedMeanDimArgs p) {
  const T* x = static_cast<const T*>(p.x);
  T* o = static_cast<T*>(p.out);
  const int lane = threadIdx.x & 31;
  const int64_t warps_per_grid = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t r = int64_t(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5); r < p.R; r += warps_per_grid) {
    double s = 0.0;
    long long c = 0;
    for (int64_t j = lane; j < p.L; j += 32) {
      const int64_t i = r * p.L + j;
      if (p.mask[i]) {
        s += static_cast<double>(x[i]);
        ++c;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      s += __shfl_down_sync(0xffffffffu, s, off);
      c += __shfl_down_sync(0xffffffffu, c, off);
    }
    if (lane == 0) {
      o[r] = c > 0 ? static_cast<T>(s / static_cast<double>(c)) : static_cast<T>(nan_d());
      p.counts[r] = c;
    }
  }
}

// The per-chunk partial sums (of x, or of squared deviations when kVar), one block a chunk.
template <bool kVar>
cudaError_t launch_partials(const MaskedStatsArgs& p) {
  const int64_t P = masked_num_partials(p.n);
  if (P > (int64_t(1) << 31) - 1) return cudaErrorInvalidValue;
  return launch_for_acc(p.is_double, [&](auto t) {
    partials_kernel<decltype(t), kVar><<<static_cast<unsigned>(P), kThreads, 0, p.stream>>>(p);
  });
}

// The partials, then one block adding them in order. With no element the impl passes a zeroed
// workspace, so the sums are 0, the count 0 and the mean NaN.
template <bool kVar>
cudaError_t launch_stats(const MaskedStatsArgs& p) {
  if (p.n > 0) {
    const cudaError_t err = launch_partials<kVar>(p);
    if (err != cudaSuccess) return err;
  }
  finish_kernel<kVar><<<1, kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_masked_sum_count(const MaskedStatsArgs& p) { return launch_stats<false>(p); }

cudaError_t launch_masked_variance(const MaskedStatsArgs& p) { return launch_stats<true>(p); }

cudaError_t launch_masked_whiten(const MaskedWhitenArgs& p) {
  if (p.n <= 0) return cudaSuccess;
  return launch_for_acc(p.is_double, [&](auto t) {
    whiten_kernel<decltype(t)><<<grid_for(p.n, kThreads), kThreads, 0, p.stream>>>(p);
  });
}

cudaError_t launch_masked_mean_dim(const MaskedMeanDimArgs& p) {
  if (p.R <= 0) return cudaSuccess;
  return launch_for_acc(p.is_double, [&](auto t) {
    mean_dim_kernel<decltype(t)><<<grid_for(p.R, kThreads / 32), kThreads, 0, p.stream>>>(p);
  });
}

}  // namespace cuda
}  // namespace pyppo
