// Launch helpers shared by the kernel files (csrc/cuda/*_kernel.cu); CUDA headers only.
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
