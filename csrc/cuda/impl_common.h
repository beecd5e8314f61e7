// Helpers shared by the CUDA impls (csrc/cuda/<family>_impl.cpp, the ATen side of the CUDA
// kernels): dtype mapping, the current stream, launch error checks. An impl runs the argument
// checks of checks/<family>.h (the same as the CPU impl's) and the conversions; the kernels
// behind cuda/kernels/kernels.h see raw pointers only.
//
// Only c10/cuda headers are used (the same stream as at::cuda::getCurrentCUDAStream(), which
// is an alias of c10::cuda::getCurrentCUDAStream): ATen/cuda/CUDAContext.h would also pull in
// cuBLAS/cuSPARSE/cuSOLVER headers that the impls do not need.
#pragma once

#include "checks/common.h"
#include "cuda/kernels/kernels.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace pyppo {
namespace cuda_impl {

inline cuda::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::DType::Float32;
    case at::kHalf: return cuda::DType::Float16;
    case at::kBFloat16: return cuda::DType::BFloat16;
    case at::kDouble: return cuda::DType::Float64;
    default: TORCH_CHECK(false, "pyppo: no CUDA kernel for dtype ", t.scalar_type());
  }
}

// The stream of the current device (the impl sets the device with a CUDAGuard first).
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "pyppo.", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

inline const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

}  // namespace cuda_impl
}  // namespace pyppo
