// Argument checks shared by every kernel's ATen glue. Each message names the argument, so a
// user sees "pyppo.gae: response_mask must ..." instead of an index error deep in a kernel.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

namespace pyppo {

inline bool is_float_like(const at::Tensor& t) {
  auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf || s == at::kDouble;
}

// Accumulation and output dtype: float32 for every floating input but float64, which stays
// float64 so that gradcheck can run on the real kernels.
inline at::ScalarType out_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(is_float_like(t), "pyppo.", op, ": ", name,
                    " must be float32, bfloat16, float16 or float64, got ", t.scalar_type());
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "pyppo.", op, ": ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device(), "; move them to one device");
}

inline void check_same_shape(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                             const char* ref_name) {
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), "pyppo.", op, ": ", name, " has shape ", t.sizes(), " but ",
                    ref_name, " has shape ", ref.sizes(), "; they must match");
}

// Masks are bool or 0/1 numbers. Returns a contiguous bool tensor; a number other than 0 or 1
// is rejected rather than read as "valid", since a float weight passed as a mask is a bug.
inline at::Tensor as_bool_mask(const char* op, const char* name, const at::Tensor& mask) {
  if (mask.scalar_type() == at::kBool) return mask.contiguous();
  TORCH_CHECK_VALUE(!at::isComplexType(mask.scalar_type()), "pyppo.", op, ": ", name,
                    " must be bool or hold 0/1 values, got ", mask.scalar_type());
  if (mask.numel() > 0) {
    bool ok = at::logical_or(mask == 0, mask == 1).all().item<bool>();
    TORCH_CHECK_VALUE(ok, "pyppo.", op, ": ", name, " must be bool or hold only 0 and 1, got other values");
  }
  return (mask != 0).contiguous();
}

inline at::Tensor as_2d(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() == 2, "pyppo.", op, ": ", name, " must be 2-D [B, T], got shape ", t.sizes());
  return t;
}

}  // namespace pyppo
