// The checks every op's argument checks are built from. Each message names the op and the
// argument, so a user sees "pyppo.gae: response_mask must ..." instead of an index error deep
// in a kernel.
//
// csrc/checks/<family>.h owns the checks and messages of one op family. Three callers share them:
// the CPU impl (cpu/<family>_impl.cpp), the CUDA impl (cuda/<family>_impl.cpp) and the fake
// kernels (meta/<family>_fake.cpp, registered for the Meta device) that torch.compile and
// FakeTensorMode trace through, so a bad input raises the same exception
// with the same message on every path. The shape checks read sym_sizes() so that they also run
// on tensors with symbolic sizes (torch.compile with dynamic shapes); the checks that need the
// data (label ranges, 0/1 mask values, empty rows) run only where there is data.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <utility>
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
  TORCH_CHECK_VALUE(t.sym_sizes() == ref.sym_sizes(), "pyppo.", op, ": ", name, " has shape ", t.sym_sizes(),
                    " but ", ref_name, " has shape ", ref.sym_sizes(), "; they must match");
}

// t has ref's shape and device: the usual pairing of an op's inputs.
inline void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                       const char* ref_name) {
  check_same_shape(op, name, t, ref, ref_name);
  check_same_device(op, name, t, ref, ref_name);
}

// Masks are bool or 0/1 numbers; this half of the check needs only the dtype.
inline void check_mask_dtype(const char* op, const char* name, const at::Tensor& mask) {
  TORCH_CHECK_VALUE(!at::isComplexType(mask.scalar_type()), "pyppo.", op, ": ", name,
                    " must be bool or hold 0/1 values, got ", mask.scalar_type());
}

namespace detail {
// The mask as bool and whether every value was 0 or 1, in one pass over a CPU tensor (ATen's
// `== 0`, `== 1`, `or`, `all`, `!= 0` is five passes and four temporaries: most of the time of
// a masked mean with a float mask). NaN is neither 0 nor 1.
inline std::pair<at::Tensor, bool> cpu_bool_mask(const at::Tensor& mask) {
  const at::Tensor src = mask.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(at::kBool));
  // Written as byte arithmetic: with bools the compiler branches per element (10x slower).
  uint8_t* o = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  std::atomic<bool> bad{false};
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "pyppo_as_bool_mask", [&] {
    const scalar_t* p = src.const_data_ptr<scalar_t>();
    at::parallel_for(0, src.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      // Local copies: a byte store may alias the captured pointers themselves, which would make
      // the compiler reload them every element and give up on vectorising.
      const scalar_t* __restrict in = p;
      uint8_t* __restrict res = o;
      uint8_t chunk_bad = 0;
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t v = in[i];
        const uint8_t zero = v == scalar_t(0), one = v == scalar_t(1);
        chunk_bad |= static_cast<uint8_t>((zero | one) ^ 1);
        res[i] = static_cast<uint8_t>(zero ^ 1);
      }
      if (chunk_bad) bad.store(true, std::memory_order_relaxed);
    });
  });
  return {out, !bad.load()};
}
}  // namespace detail

// Returns a contiguous bool tensor. A number other than 0 or 1 is rejected rather than read as
// "valid", since a float weight passed as a mask is a bug. Reads the data (one host sync on a
// device tensor), so it is not part of the Meta kernels' checks.
inline at::Tensor as_bool_mask(const char* op, const char* name, const at::Tensor& mask) {
  if (mask.scalar_type() == at::kBool) return mask.contiguous();
  check_mask_dtype(op, name, mask);
  const at::ScalarType t = mask.scalar_type();
  const bool dispatched = t == at::kByte || t == at::kChar || t == at::kShort || t == at::kInt || t == at::kLong ||
                          t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
  if (mask.device().is_cpu() && dispatched) {
    auto [out, ok] = detail::cpu_bool_mask(mask);
    TORCH_CHECK_VALUE(ok, "pyppo.", op, ": ", name, " must be bool or hold only 0 and 1, got other values");
    return out;
  }
  if (mask.numel() > 0) {
    bool ok = at::logical_or(mask == 0, mask == 1).all().item<bool>();
    TORCH_CHECK_VALUE(ok, "pyppo.", op, ": ", name, " must be bool or hold only 0 and 1, got other values");
  }
  return (mask != 0).contiguous();
}

inline void check_2d(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() == 2, "pyppo.", op, ": ", name, " must be 2-D [B, T], got shape ", t.sym_sizes());
}

// A per-row input (scores, last_values): [B], float, on rows' device.
inline void check_per_row(const char* op, const char* name, const at::Tensor& t, const at::Tensor& rows,
                          const char* rows_name) {
  check_float(op, name, t);
  check_same_device(op, name, t, rows, rows_name);
  TORCH_CHECK_VALUE(t.dim() == 1 && t.sym_size(0) == rows.sym_size(0), "pyppo.", op, ": ", name,
                    " must have shape [B] = [", rows.sym_size(0), "], got ", t.sym_sizes());
}

// Output dtype options of an op whose outputs follow `t` (float32, or float64 for float64).
inline at::TensorOptions out_options(const at::Tensor& t) { return t.options().dtype(out_dtype(t)); }

}  // namespace pyppo
