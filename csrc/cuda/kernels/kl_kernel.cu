// kl_penalty (forward and backward) and shape_rewards on CUDA. The per-token math is
// kl_estimators.h, shared with the CPU kernels; every element is computed by one thread with
// no reduction, so results are deterministic and batch-invariant by construction (the only
// reduction, the last valid index of a row, is an exact integer max).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/launch.h"
#include "cuda/kernels/kernels.h"

namespace pyppo {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) kl_fwd_kernel(const KLArgs p) {
  const T* a = static_cast<const T*>(p.logprobs);
  const T* b = static_cast<const T*>(p.ref_logprobs);
  T* o = static_cast<T*>(p.out);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += stride) {
    bool sat;
    o[i] = kl_value<T>(p.estimator, a[i], b[i], p.clamp, &sat);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) kl_bwd_kernel(const KLArgs p) {
  const T* g = static_cast<const T*>(p.grad_kl);
  const T* a = static_cast<const T*>(p.logprobs);
  const T* b = static_cast<const T*>(p.ref_logprobs);
  T* o = static_cast<T*>(p.out);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += stride) {
    // A zero upstream gradient stays zero even where the local derivative is infinite.
    const T gi = g[i];
    o[i] = gi == T(0) ? T(0) : gi * kl_grad<T>(p.estimator, a[i], b[i], p.clamp);
  }
}

// One block per row: the row's last valid index (an integer max, exact), then every position.
template <typename T>
__global__ void __launch_bounds__(kThreads) shape_rewards_kernel(const ShapeRewardsArgs p) {
  __shared__ long long sh_last[kThreads / 32];
  const T* lp = static_cast<const T*>(p.logprobs);
  const T* ref = static_cast<const T*>(p.ref_logprobs);
  const T* scores = static_cast<const T*>(p.scores);
  T* rw = static_cast<T*>(p.rewards);
  T* kl = static_cast<T*>(p.kl);
  const T coef = static_cast<T>(p.kl_coef);
  const KLClamp no_clamp;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t T_ = p.T;

  for (int64_t b = blockIdx.x; b < p.B; b += gridDim.x) {
    const bool* m = p.mask + b * T_;
    long long last = -1;
    for (int64_t t = tid; t < T_; t += kThreads)
      if (m[t]) last = t;  // t increases, so this is the thread's max
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const long long o = __shfl_down_sync(0xffffffffu, last, off);
      last = o > last ? o : last;
    }
    if (lane == 0) sh_last[warp] = last;
    __syncthreads();
    last = -1;
    for (int w = 0; w < kThreads / 32; ++w) last = sh_last[w] > last ? sh_last[w] : last;
    __syncthreads();  // sh_last is rewritten by the next row

    T score = scores[b];
    if (p.has_score_clip) {
      const T c = static_cast<T>(p.score_clip);
      score = score < -c ? -c : score;  // std::max(score, -c)
      score = c < score ? c : score;    // std::min(score, c)
    }
    for (int64_t t = tid; t < T_; t += kThreads) {
      const int64_t i = b * T_ + t;
      if (!m[t]) {
        kl[i] = T(0);
        rw[i] = T(0);
        continue;
      }
      bool sat;
      const T k = kl_value<T>(p.estimator, lp[i], ref[i], no_clamp, &sat);
      kl[i] = k;
      // kl_coef = 0 switches the penalty off even where the estimate overflowed (0 * inf = NaN).
      T r = coef == T(0) ? T(0) : -coef * k;
      if (t == last) r += score;  // as the CPU kernel: rewards[last] = -coef * kl + score
      rw[i] = r;
    }
  }
}

}  // namespace

cudaError_t launch_kl_penalty_fwd(const KLArgs& p) {
  if (p.n <= 0) return cudaSuccess;
  return launch_for_acc(p.is_double, [&](auto t) {
    kl_fwd_kernel<decltype(t)><<<grid_for(p.n, kThreads), kThreads, 0, p.stream>>>(p);
  });
}

cudaError_t launch_kl_penalty_bwd(const KLArgs& p) {
  if (p.n <= 0) return cudaSuccess;
  return launch_for_acc(p.is_double, [&](auto t) {
    kl_bwd_kernel<decltype(t)><<<grid_for(p.n, kThreads), kThreads, 0, p.stream>>>(p);
  });
}

cudaError_t launch_shape_rewards(const ShapeRewardsArgs& p) {
  if (p.B <= 0 || p.T <= 0) return cudaSuccess;
  // One block per row (capped; the kernel loops over rows).
  return launch_for_acc(p.is_double, [&](auto t) {
    shape_rewards_kernel<decltype(t)><<<grid_for(p.B, 1, int64_t(1) << 20), kThreads, 0, p.stream>>>(p);
  });
}

}  // namespace cuda
}  // namespace pyppo
