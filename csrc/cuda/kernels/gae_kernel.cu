// Generalized Advantage Estimation on CUDA, right to left over the valid positions of a row:
//   delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next,   R_t = A_t + V_t
// where "next" is the next *valid* position (a masked position is skipped without breaking
// the chain), V_next after the last valid position is last_values[b] (or 0), A_next there is 0.
//
// One warp per row, one algorithm for every T. The row is walked right to left in tiles of
// kGaeTile positions that start at multiples of kGaeTile (cuda/kernels/kernels.h); lane l of the warp
// owns the kGaeSegment consecutive positions [l * kGaeSegment, (l + 1) * kGaeSegment) of a
// tile. Per tile, from the carry (V_next, A_next) at the tile's right edge:
//   1. each lane finds the value at its segment's first valid position; a suffix scan over
//      the lanes (a selection, exact) gives each lane V_next at its segment's right edge;
//   2. each lane composes its segment's affine maps A -> delta + c * A into one (C, D)
//      (A_left = D + C * A_right; the identity where nothing is valid), and a suffix scan of
//      the compositions over the lanes (a fixed shuffle tree) gives each lane A at its
//      segment's right edge;
//   3. each lane reruns the recurrence over its segment from that edge, writing the outputs;
//      lane 0's final state is the carry into the next tile to the left.
// A tile with no valid position is skipped (zeros written, carry untouched), so the extra
// masked tiles of a longer padded batch compose as the exact identity and a row's bits do not
// depend on T, and the split inside a tile is fixed by absolute positions alone: deterministic
// and batch-invariant. Every product and sum is an explicit IEEE operation (no fma
// contraction), so tests/ops/cuda_emulation.py replays the kernel bit for bit in numpy float32.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/launch.h"
#include "cuda/kernels/kernels.h"

namespace pyppo {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 4;  // rows per block
constexpr unsigned kFull = 0xffffffffu;

// The TD error at a valid position, in the CPU kernel's order: (r + g * v_next) - v.
template <typename T>
__device__ __forceinline__ T td_error(T r, T v, T v_next, T g) {
  return sub_rn(add_rn(r, mul_rn(g, v_next)), v);
}

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) gae_warp_kernel(const GaeArgs p) {
  constexpr int S = kGaeSegment;
  const T* bp = static_cast<const T*>(p.last_values);
  const T g = static_cast<T>(p.gamma);
  const T gl = static_cast<T>(p.gamma * p.lam);
  const int lane = threadIdx.x & 31;
  const int64_t T_ = p.T;
  const int64_t num_tiles = (T_ + kGaeTile - 1) / kGaeTile;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;

  for (int64_t b = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); b < p.B; b += warps) {
    const T* rp = static_cast<const T*>(p.rewards) + b * T_;
    const T* vp = static_cast<const T*>(p.values) + b * T_;
    const bool* mp = p.mask + b * T_;
    T* ap = static_cast<T*>(p.advantages) + b * T_;
    T* op = static_cast<T*>(p.returns) + b * T_;
    T carry_v = bp ? bp[b] : T(0);  // V_next at the current tile's right edge
    T carry_a = T(0);               // A_next there

    for (int64_t tile = num_tiles - 1; tile >= 0; --tile) {
      const int64_t base = tile * kGaeTile + int64_t(lane) * S;
      T r[S], v[S];
      bool m[S];
#pragma unroll
      for (int k = 0; k < S; ++k) {
        const int64_t t = base + k;
        m[k] = t < T_ && mp[t];
        r[k] = m[k] ? rp[t] : T(0);
        v[k] = m[k] ? vp[t] : T(0);
      }
      bool has = false;
      T first_v = T(0);
#pragma unroll
      for (int k = S - 1; k >= 0; --k)
        if (m[k]) {
          has = true;
          first_v = v[k];
        }
      if (!__any_sync(kFull, has)) {  // nothing valid in the tile: the identity
#pragma unroll
        for (int k = 0; k < S; ++k)
          if (base + k < T_) {
            ap[base + k] = T(0);
            op[base + k] = T(0);
          }
        continue;
      }

      // 1. V_next at each segment's right edge: the first valid value of the nearest lane to
      //    the right that has one, else the carry.
      bool sh = has;
      T sv = first_v;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const bool oh = __shfl_down_sync(kFull, int(sh), off) != 0;
        const T ov = __shfl_down_sync(kFull, sv, off);
        if (lane + off < 32 && !sh) {
          sh = oh;
          sv = ov;
        }
      }
      const bool right_h = __shfl_down_sync(kFull, int(sh), 1) != 0;
      const T right_v = __shfl_down_sync(kFull, sv, 1);
      const T v_edge = (lane < 31 && right_h) ? right_v : carry_v;

      // 2. The segment's map A_left = D + C * A_right, then the suffix compositions.
      T C = T(1), D = T(0);
      {
        T nv = v_edge;
#pragma unroll
        for (int k = S - 1; k >= 0; --k)
          if (m[k]) {
            D = add_rn(td_error(r[k], v[k], nv, g), mul_rn(gl, D));
            C = mul_rn(gl, C);
            nv = v[k];
          }
      }
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const T oC = __shfl_down_sync(kFull, C, off);
        const T oD = __shfl_down_sync(kFull, D, off);
        if (lane + off < 32) {  // (C, D) <- (C, D) o (oC, oD)
          D = add_rn(D, mul_rn(C, oD));
          C = mul_rn(C, oC);
        }
      }
      const T right_C = __shfl_down_sync(kFull, C, 1);
      const T right_D = __shfl_down_sync(kFull, D, 1);
      const T a_edge = lane < 31 ? add_rn(right_D, mul_rn(right_C, carry_a)) : carry_a;

      // 3. The CPU loop over the segment from its right edge, writing the outputs.
      T nv = v_edge, na = a_edge;
#pragma unroll
      for (int k = S - 1; k >= 0; --k) {
        const int64_t t = base + k;
        if (t >= T_) continue;
        if (!m[k]) {
          ap[t] = T(0);
          op[t] = T(0);
          continue;
        }
        na = add_rn(td_error(r[k], v[k], nv, g), mul_rn(gl, na));
        nv = v[k];
        ap[t] = na;
        op[t] = add_rn(na, v[k]);
      }
      carry_v = __shfl_sync(kFull, nv, 0);
      carry_a = __shfl_sync(kFull, na, 0);
    }
  }
}

template <typename T>
cudaError_t launch_typed(const GaeArgs& p) {
  const int64_t blocks = (p.B + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int grid = static_cast<int>(blocks < (int64_t(1) << 20) ? blocks : (int64_t(1) << 20));
  gae_warp_kernel<T><<<grid, kWarpsPerBlock * 32, 0, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gae(const GaeArgs& p) {
  if (p.B <= 0 || p.T <= 0) return cudaSuccess;
  return p.is_double ? launch_typed<double>(p) : launch_typed<float>(p);
}

}  // namespace cuda
}  // namespace pyppo
