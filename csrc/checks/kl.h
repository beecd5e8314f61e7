// The KL family: kl_penalty (and its backward) and shape_rewards. Argument checks and messages,
// the parsing of the estimator name and the clamp bounds (shared by both ops), and the inputs as
// the kernels read them. The two shape_rewards checks that read the data (a valid position in
// every row, finite scores) are found differently on CPU (a loop) and CUDA (device reductions
// and one sync); both raise them through the functions here. See docs/ops.md#kl_penalty and
// docs/ops.md#shape_rewards.
#pragma once

#include "checks/common.h"
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

struct KLOptions {
  KLEstimator estimator;
  KLClamp clamp;
};

inline KLOptions check_kl_penalty(const at::Tensor& logprobs, const at::Tensor& ref_logprobs,
                                     c10::string_view estimator, std::optional<double> clamp_min,
                                     std::optional<double> clamp_max) {
  const char* op = "kl_penalty";
  check_kl_inputs(op, logprobs, ref_logprobs);
  return {parse_estimator(op, estimator), make_clamp(op, clamp_min, clamp_max)};
}

inline KLOptions check_kl_penalty_backward(const at::Tensor& grad_kl, const at::Tensor& logprobs,
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

// ---- shape_rewards ----

// Everything shape_rewards checks without reading data (the Meta kernel's checks).
inline KLEstimator check_shape_rewards(const at::Tensor& scores, const at::Tensor& logprobs,
                                       const at::Tensor& ref_logprobs, const at::Tensor& response_mask,
                                       double kl_coef, c10::string_view estimator, std::optional<double> score_clip) {
  const char* op = "shape_rewards";
  check_kl_inputs(op, logprobs, ref_logprobs);
  check_2d(op, "logprobs", logprobs);
  check_like(op, "response_mask", response_mask, logprobs, "logprobs");
  check_mask_dtype(op, "response_mask", response_mask);
  check_per_row(op, "scores", scores, logprobs, "logprobs");
  TORCH_CHECK_VALUE(std::isfinite(kl_coef) && kl_coef >= 0, "pyppo.shape_rewards: kl_coef must be a finite number >= 0, got ",
                    kl_coef);
  TORCH_CHECK_VALUE(!score_clip.has_value() || (*score_clip > 0 && !std::isnan(*score_clip)),
                    "pyppo.shape_rewards: score_clip must be > 0 (or None), got ", score_clip.value_or(0));
  return parse_estimator(op, estimator);
}

[[noreturn]] inline void fail_row_without_valid_position(int64_t row) {
  TORCH_CHECK_VALUE(false, "pyppo.shape_rewards: row ", row,
                    " of response_mask has no valid position; every response needs at least one token to carry its score");
  __builtin_unreachable();
}

[[noreturn]] inline void fail_non_finite_score(int64_t row, double score) {
  TORCH_CHECK_VALUE(false, "pyppo.shape_rewards: scores[", row, "] = ", score, " is not finite");
  __builtin_unreachable();
}

}  // namespace pyppo
