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
//
// Decoupled lambda (the returns' lam_critic given): steps 2 and 3 run a second composition and a
// second recurrence with gamma * lam_critic beside the first, on the same TD errors; each is,
// operation for operation, the one a call with that lam runs, so the returns are the bits of
// gae(..., lam=lam_critic)'s returns. A per-row lam (row_lam) only changes which gamma * lam a
// warp uses: gamma * row_lam[b] in double, rounded once, as a call with lam = row_lam[b] has it.
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

// The suffix composition of the lanes' maps (C, D) over the warp, then A at this lane's
// segment's right edge given A = carry at the tile's right edge.
template <typename T>
__device__ __forceinline__ T compose_to_edge(T C, T D, T carry, int lane) {
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
  return lane < 31 ? add_rn(right_D, mul_rn(right_C, carry)) : carry;
}

// Two: the returns have their own lambda (gamma * lam_critic), composed beside the advantages'.
template <typename T, bool Two>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) gae_warp_kernel(const GaeArgs p) {
  constexpr int S = kGaeSegment;
  const T* bp = static_cast<const T*>(p.last_values);
  const T g = static_cast<T>(p.gamma);
  const T gl_critic = static_cast<T>(p.gamma * p.lam_critic);
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
    // gamma * lam in double, rounded once; a row_lam outside [0, 1] (or NaN) gives NaN.
    T gl = static_cast<T>(p.gamma * p.lam);
    if (p.row_lam) {
      const double lam_b = p.row_lam[b];
      const double nan = __longlong_as_double(0x7ff8000000000000ll);
      gl = static_cast<T>(lam_b >= 0 && lam_b <= 1 ? p.gamma * lam_b : nan);
    }
    const T gl_c = Two ? gl_critic : gl;
    T carry_v = bp ? bp[b] : T(0);  // V_next at the current tile's right edge
    T carry_a = T(0);               // A_next there
    T carry_c = T(0);               // the returns' A_next there (Two)

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

      // 2. The segment's map A_left = D + C * A_right (and the returns' (Cc, Dc) with gl_c),
      //    then the suffix compositions.
      T C = T(1), D = T(0), Cc = T(1), Dc = T(0);
      {
        T nv = v_edge;
#pragma unroll
        for (int k = S - 1; k >= 0; --k)
          if (m[k]) {
            const T delta = td_error(r[k], v[k], nv, g);
            D = add_rn(delta, mul_rn(gl, D));
            C = mul_rn(gl, C);
            if (Two) {
              Dc = add_rn(delta, mul_rn(gl_c, Dc));
              Cc = mul_rn(gl_c, Cc);
            }
            nv = v[k];
          }
      }
      const T a_edge = compose_to_edge(C, D, carry_a, lane);
      const T c_edge = Two ? compose_to_edge(Cc, Dc, carry_c, lane) : T(0);

      // 3. The CPU loop over the segment from its right edge, writing the outputs.
      T nv = v_edge, na = a_edge, nc = c_edge;
#pragma unroll
      for (int k = S - 1; k >= 0; --k) {
        const int64_t t = base + k;
        if (t >= T_) continue;
        if (!m[k]) {
          ap[t] = T(0);
          op[t] = T(0);
          continue;
        }
        const T delta = td_error(r[k], v[k], nv, g);
        na = add_rn(delta, mul_rn(gl, na));
        if (Two) nc = add_rn(delta, mul_rn(gl_c, nc));
        nv = v[k];
        ap[t] = na;
        op[t] = add_rn(Two ? nc : na, v[k]);
      }
      carry_v = __shfl_sync(kFull, nv, 0);
      carry_a = __shfl_sync(kFull, na, 0);
      if (Two) carry_c = __shfl_sync(kFull, nc, 0);
    }
  }
}

template <typename T>
cudaError_t launch_typed(const GaeArgs& p) {
  const int64_t blocks = (p.B + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int grid = static_cast<int>(blocks < (int64_t(1) << 20) ? blocks : (int64_t(1) << 20));
  if (p.has_lam_critic)
    gae_warp_kernel<T, true><<<grid, kWarpsPerBlock * 32, 0, p.stream>>>(p);
  else
    gae_warp_kernel<T, false><<<grid, kWarpsPerBlock * 32, 0, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gae(const GaeArgs& p) {
  if (p.B <= 0 || p.T <= 0) return cudaSuccess;
  return p.is_double ? launch_typed<double>(p) : launch_typed<float>(p);
}

}  // namespace cuda
}  // namespace pyppo
