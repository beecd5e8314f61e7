// GAE over agent turns on CUDA: one thread per row runs the CPU kernel's two loops
// (cpu/kernels/turn_gae_kernel.cpp) with the same operations in the same order:
//   1. right to left over the agent positions (turn_ids >= 0): a turn is a maximal run of agent
//      positions with one id (environment positions between them skipped); its reward R is the
//      sum of its agent positions' rewards (right to left), its value V the value at its first
//      position, and
//        delta = (R + gamma * V_next) - V,   A = delta + gamma * lam * A_next
//      (V_next, A_next: the next turn's, or last_values[b] / 0 after the last turn); A and A + V
//      are stored at the turn's first position;
//   2. left to right, each agent position gets its turn's A and A + V, every other position 0.
// Every product and sum is an explicit IEEE operation (no fma contraction): the CPU's bits, and a
// row's result depends on that row alone (deterministic, batch-invariant). A thread walks its row
// serially (O(T) dependent steps): meant for the few hundred rows of a rollout batch, whose cost
// is small next to the model's; a warp per row would read the rows coalesced.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/launch.h"
#include "cuda/kernels/kernels.h"

namespace pyppo {
namespace cuda {
namespace {

constexpr int kThreads = 128;  // rows per block

template <typename T>
__global__ void __launch_bounds__(kThreads) turn_gae_kernel(const TurnGaeArgs p) {
  const T* bp = static_cast<const T*>(p.last_values);
  const T g = static_cast<T>(p.gamma);
  const T gl = static_cast<T>(p.gamma * p.lam);
  const int64_t T_ = p.T;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t b = int64_t(blockIdx.x) * kThreads + threadIdx.x; b < p.B; b += stride) {
    const T* rp = static_cast<const T*>(p.rewards) + b * T_;
    const T* vp = static_cast<const T*>(p.values) + b * T_;
    const int64_t* ip = p.turn_ids + b * T_;
    T* ap = static_cast<T*>(p.advantages) + b * T_;
    T* op = static_cast<T*>(p.returns) + b * T_;

    // 1. The turns, right to left.
    T next_value = bp ? bp[b] : T(0), next_adv = T(0);
    bool open = false;
    int64_t id = 0, start = 0;
    T reward = T(0);
    for (int64_t t = T_ - 1; t >= -1; --t) {
      const int64_t i = t >= 0 ? ip[t] : int64_t(-1);
      if (t >= 0 && i < 0) continue;
      if (open && (t < 0 || i != id)) {  // the open turn began at `start`
        const T v = vp[start];
        const T delta = sub_rn(add_rn(reward, mul_rn(g, next_value)), v);
        next_adv = add_rn(delta, mul_rn(gl, next_adv));
        next_value = v;
        ap[start] = next_adv;
        op[start] = add_rn(next_adv, v);
        open = false;
      }
      if (t < 0) break;
      if (open) {
        reward = add_rn(reward, rp[t]);
      } else {
        open = true;
        id = i;
        reward = rp[t];
      }
      start = t;
    }

    // 2. Each turn's A and A + V onto its agent positions.
    bool seen = false;
    T a = T(0), r = T(0);
    for (int64_t t = 0; t < T_; ++t) {
      const int64_t i = ip[t];
      if (i < 0) {
        ap[t] = T(0);
        op[t] = T(0);
        continue;
      }
      if (!seen || i != id) {
        seen = true;
        id = i;
        a = ap[t];
        r = op[t];
      }
      ap[t] = a;
      op[t] = r;
    }
  }
}

}  // namespace

cudaError_t launch_turn_gae(const TurnGaeArgs& p) {
  if (p.B <= 0 || p.T <= 0) return cudaSuccess;
  const int grid = grid_for(p.B, kThreads);
  return launch_for_acc(p.is_double, [&](auto zero) {
    using T = decltype(zero);
    turn_gae_kernel<T><<<grid, kThreads, 0, p.stream>>>(p);
  });
}

}  // namespace cuda
}  // namespace pyppo
