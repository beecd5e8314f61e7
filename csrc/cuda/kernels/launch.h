// Helpers shared by the kernel files (csrc/cuda/kernels/*_kernel.cu): launch sizes and the rounding of
// single operations; CUDA headers only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pyppo {
namespace cuda {

// Blocks for n items at per_block items a block, at least 1 and capped: the kernels loop over
// the grid (grid-stride), and each item's result does not depend on which block handles it.
inline int grid_for(int64_t n, int64_t per_block, int64_t cap = int64_t(1) << 16) {
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<int>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

// One IEEE operation each, rounded to nearest, never contracted into an fma by the compiler:
// what the kernels use where a result's bits must not depend on how the code around it was
// compiled (and where tests/ops/cuda_emulation.py replays them in numpy).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

// f(T{}) with T the accumulation type (double for float64 inputs, else float), which launches
// the kernel for T; returns the launch's error.
template <typename F>
cudaError_t launch_for_acc(bool is_double, F&& f) {
  if (is_double)
    f(double{});
  else
    f(float{});
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace pyppo
