// kl_penalty (and its backward): argument checks and messages, and the parsing of the estimator
// name and the clamp bounds, which shape_rewards shares. See docs/ops.md#kl_penalty.
#pragma once

#include "args/common.h"
#include "kl_estimators.h"

#include <c10/util/string_view.h>

#include <cmath>
#include <optional>

namespace pyppo {

// arg is the estimator's argument name in the op's messages.
inline KLEstimator parse_estimator(const char* op, c10::string_view name, const char* arg = "estimator") {
  if (name == "k1") return KLEstimator::K1;
  if (name == "k2") return KLEstimator::K2;
  if (name == "k3") return KLEstimator::K3;
  if (name == "abs") return KLEstimator::Abs;
  TORCH_CHECK_VALUE(false, "pyppo.", op, ": ", arg, " must be one of 'k1', 'k2', 'k3', 'abs', got '",
                    std::string(name.data(), name.size()), "'");
}

inline KLClamp make_clamp(const char* op, std::optional<double> lo, std::optional<double> hi) {
  KLClamp c;
  if (lo.has_value()) {
    TORCH_CHECK_VALUE(!std::isnan(*lo), "pyppo.", op, ": clamp lower bound is NaN");
    c.has_lo = true;
    c.lo = *lo;
  }
  if (hi.has_value()) {
    TORCH_CHECK_VALUE(!std::isnan(*hi), "pyppo.", op, ": clamp upper bound is NaN");
    c.has_hi = true;
    c.hi = *hi;
  }
  TORCH_CHECK_VALUE(!(c.has_lo && c.has_hi) || c.lo <= c.hi, "pyppo.", op, ": clamp must be (lo, hi) with lo <= hi, got (",
                    c.lo, ", ", c.hi, ")");
  return c;
}

// logprobs and ref_logprobs: float, one shape, one device.
inline void check_kl_inputs(const char* op, const at::Tensor& logprobs, const at::Tensor& ref_logprobs) {
  check_float(op, "logprobs", logprobs);
  check_float(op, "ref_logprobs", ref_logprobs);
  check_like(op, "ref_logprobs", ref_logprobs, logprobs, "logprobs");
}

struct KLArgsParsed {
  KLEstimator estimator;
  KLClamp clamp;
};

inline KLArgsParsed check_kl_penalty(const at::Tensor& logprobs, const at::Tensor& ref_logprobs,
                                     c10::string_view estimator, std::optional<double> clamp_min,
                                     std::optional<double> clamp_max) {
  const char* op = "kl_penalty";
  check_kl_inputs(op, logprobs, ref_logprobs);
  return {parse_estimator(op, estimator), make_clamp(op, clamp_min, clamp_max)};
}

inline KLArgsParsed check_kl_penalty_backward(const at::Tensor& grad_kl, const at::Tensor& logprobs,
                                              const at::Tensor& ref_logprobs, c10::string_view estimator,
                                              std::optional<double> clamp_min, std::optional<double> clamp_max) {
  const char* op = "kl_penalty_backward";
  check_kl_inputs(op, logprobs, ref_logprobs);
  check_like(op, "grad_kl", grad_kl, logprobs, "logprobs");
  return {parse_estimator(op, estimator), make_clamp(op, clamp_min, clamp_max)};
}

// logprobs and ref_logprobs as the kernels read them: contiguous, in the accumulation dtype.
struct KLTensors {
  at::ScalarType acc;
  at::Tensor lp, ref;
};

inline KLTensors kl_tensors(const at::Tensor& logprobs, const at::Tensor& ref_logprobs) {
  const auto acc = out_dtype(logprobs);
  return {acc, logprobs.to(acc).contiguous(), ref_logprobs.to(acc).contiguous()};
}

}  // namespace pyppo
