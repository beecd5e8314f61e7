// masked_mean, masked_var and masked_whiten: argument checks and messages, and masked_mean's
// reduced dim and output shape. See docs/ops.md#masked_whiten, which covers all three.
#pragma once

#include "checks/common.h"

#include <c10/core/SymInt.h>
#include <c10/util/DimVector.h>

#include <cmath>
#include <optional>

namespace pyppo {

// x and its mask: x float, mask of x's shape on x's device.
inline void check_masked(const char* op, const at::Tensor& x, const at::Tensor& mask) {
  check_float(op, "x", x);
  check_like(op, "mask", mask, x, "x");
  check_mask_dtype(op, "mask", mask);
}

// masked_mean's dim, wrapped into [0, x.dim()). An out-of-range dim is a ValueError that names
// the valid range (ATen's maybe_wrap_dim would raise an IndexError without the op's name).
inline int64_t masked_mean_dim(const at::Tensor& x, int64_t dim) {
  TORCH_CHECK_VALUE(x.dim() > 0, "pyppo.masked_mean: dim given for a 0-d x");
  TORCH_CHECK_VALUE(dim >= -x.dim() && dim < x.dim(), "pyppo.masked_mean: dim must be in [", -x.dim(), ", ",
                    x.dim() - 1, "] for a ", x.dim(), "-d x, got ", dim);
  return dim < 0 ? dim + x.dim() : dim;
}

// x's shape without dim d; a slice of length 0 along d is an error unless there is no slice.
inline c10::SymDimVector masked_mean_out_shape(const at::Tensor& x, int64_t d) {
  c10::SymDimVector shape;
  c10::SymInt slices = 1;
  for (int64_t i = 0; i < x.dim(); ++i)
    if (i != d) {
      shape.push_back(x.sym_size(i));
      slices = slices * x.sym_size(i);
    }
  TORCH_CHECK_VALUE(x.sym_size(d) > 0 || slices == 0, "pyppo.masked_mean: x has size 0 along dim ", d);
  return shape;
}

// Everything masked_mean checks without reading data; returns the wrapped dim (or nullopt).
inline std::optional<int64_t> check_masked_mean(const at::Tensor& x, const at::Tensor& mask,
                                                std::optional<int64_t> dim) {
  check_masked("masked_mean", x, mask);
  if (!dim.has_value()) return std::nullopt;
  const int64_t d = masked_mean_dim(x, *dim);
  masked_mean_out_shape(x, d);
  return d;
}

inline void check_whiten_eps(double eps) {
  TORCH_CHECK_VALUE(eps >= 0 && std::isfinite(eps), "pyppo.masked_whiten: eps must be a finite number >= 0, got ", eps);
}

// x in the accumulation dtype and its mask as bool, both contiguous (reads the mask's values).
struct MaskedInputs {
  at::Tensor x;
  at::Tensor mask;
};

inline MaskedInputs prepare_masked(const char* op, const at::Tensor& x, const at::Tensor& mask) {
  check_masked(op, x, mask);
  return {x.to(out_dtype(x)).contiguous(), as_bool_mask(op, "mask", mask)};
}

// masked_mean along dim d as the kernels read it: x and mask with d moved last, [R, L]
// contiguous, and the output allocated.
struct MeanDimInputs {
  at::Tensor x, mask, out;
  int64_t R = 0, L = 0;
};

inline MeanDimInputs prepare_mean_dim(const MaskedInputs& p, const at::Tensor& x, int64_t d) {
  MeanDimInputs m;
  m.x = p.x.movedim(d, -1).contiguous();
  m.mask = p.mask.movedim(d, -1).contiguous();
  m.L = x.size(d);
  m.R = m.L == 0 ? 0 : m.x.numel() / m.L;
  m.out = at::empty_symint(masked_mean_out_shape(x, d), p.x.options());
  return m;
}

// Too few masked-in elements is an error, not a NaN: none for a mean, fewer than 2 for an
// unbiased variance.
inline void check_masked_count(const char* op, int64_t count, bool need_var, bool unbiased) {
  TORCH_CHECK_VALUE(count > 0, "pyppo.", op, ": mask selects no element of x (all masked)");
  TORCH_CHECK_VALUE(!need_var || !unbiased || count > 1, "pyppo.", op,
                    ": the unbiased variance needs at least 2 valid elements, mask selects ", count);
}

[[noreturn]] inline void fail_all_masked_slice(int64_t slice, int64_t d) {
  TORCH_CHECK_VALUE(false, "pyppo.masked_mean: slice ", slice, " along dim ", d, " is all masked");
  __builtin_unreachable();
}

// masked_whiten divides by sqrt(var + eps): a constant input with eps = 0 has nothing to divide by.
inline double whiten_inv_std(double var, double eps) {
  const double inv_std = 1.0 / std::sqrt(var + eps);
  TORCH_CHECK_VALUE(std::isfinite(inv_std), "pyppo.masked_whiten: the masked variance is ", var, " and eps is ", eps,
                    "; their sum must be > 0 (pass eps > 0 for constant inputs)");
  return inv_std;
}

}  // namespace pyppo
