// Argument checks of kl_penalty, shape_rewards, gae and the masked statistics, and the parsing
// of the KL estimator name and clamp bounds, shared by the CPU and CUDA glue so both raise the
// same errors.
#pragma once

#include "common.h"
#include "kl_estimators.h"

#include <c10/util/string_view.h>

#include <cmath>
#include <optional>

namespace pyppo {

inline KLEstimator parse_estimator(const char* op, c10::string_view name) {
  if (name == "k1") return KLEstimator::K1;
  if (name == "k2") return KLEstimator::K2;
  if (name == "k3") return KLEstimator::K3;
  if (name == "abs") return KLEstimator::Abs;
  TORCH_CHECK_VALUE(false, "pyppo.", op, ": estimator must be one of 'k1', 'k2', 'k3', 'abs', got '",
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

// kl_penalty's inputs: logprobs and ref_logprobs, float, same shape and device.
inline void check_kl_inputs(const char* op, const at::Tensor& logprobs, const at::Tensor& ref_logprobs) {
  check_float(op, "logprobs", logprobs);
  check_float(op, "ref_logprobs", ref_logprobs);
  check_same_shape(op, "ref_logprobs", ref_logprobs, logprobs, "logprobs");
  check_same_device(op, "ref_logprobs", ref_logprobs, logprobs, "logprobs");
}

// shape_rewards' inputs, everything but the per-row checks (a valid position in every row,
// finite scores), which read the data.
inline void check_shape_rewards_inputs(const at::Tensor& scores, const at::Tensor& logprobs,
                                       const at::Tensor& ref_logprobs, const at::Tensor& response_mask, double kl_coef,
                                       std::optional<double> score_clip) {
  const char* op = "shape_rewards";
  check_kl_inputs(op, logprobs, ref_logprobs);
  check_float(op, "scores", scores);
  as_2d(op, "logprobs", logprobs);
  check_same_shape(op, "response_mask", response_mask, logprobs, "logprobs");
  TORCH_CHECK_VALUE(scores.dim() == 1 && scores.size(0) == logprobs.size(0), "pyppo.shape_rewards: scores must have shape [B] = [",
                    logprobs.size(0), "], got ", scores.sizes());
  check_same_device(op, "response_mask", response_mask, logprobs, "logprobs");
  check_same_device(op, "scores", scores, logprobs, "logprobs");
  TORCH_CHECK_VALUE(std::isfinite(kl_coef) && kl_coef >= 0, "pyppo.shape_rewards: kl_coef must be a finite number >= 0, got ",
                    kl_coef);
  TORCH_CHECK_VALUE(!score_clip.has_value() || (*score_clip > 0 && !std::isnan(*score_clip)),
                    "pyppo.shape_rewards: score_clip must be > 0 (or None), got ", score_clip.value_or(0));
}

// gae's inputs; last_values, when given, must be [B] float on the same device.
inline void check_gae_inputs(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& response_mask,
                             double gamma, double lam, const std::optional<at::Tensor>& last_values) {
  const char* op = "gae";
  check_float(op, "rewards", rewards);
  check_float(op, "values", values);
  as_2d(op, "rewards", rewards);
  check_same_shape(op, "values", values, rewards, "rewards");
  check_same_shape(op, "response_mask", response_mask, rewards, "rewards");
  check_same_device(op, "values", values, rewards, "rewards");
  check_same_device(op, "response_mask", response_mask, rewards, "rewards");
  TORCH_CHECK_VALUE(gamma >= 0 && gamma <= 1, "pyppo.gae: gamma must be in [0, 1], got ", gamma);
  TORCH_CHECK_VALUE(lam >= 0 && lam <= 1, "pyppo.gae: lam must be in [0, 1], got ", lam);
  if (last_values.has_value() && last_values->defined()) {
    check_float(op, "last_values", *last_values);
    check_same_device(op, "last_values", *last_values, rewards, "rewards");
    TORCH_CHECK_VALUE(last_values->dim() == 1 && last_values->size(0) == rewards.size(0),
                      "pyppo.gae: last_values must have shape [B] = [", rewards.size(0), "], got ", last_values->sizes());
  }
}

// masked_mean / masked_var / masked_whiten: x and its mask, contiguous, x in the accumulation dtype.
struct MaskedInputs {
  at::Tensor x;     // contiguous, accumulation dtype
  at::Tensor mask;  // contiguous bool
};

inline MaskedInputs prepare_masked(const char* op, const at::Tensor& x, const at::Tensor& mask) {
  check_float(op, "x", x);
  check_same_shape(op, "mask", mask, x, "x");
  check_same_device(op, "mask", mask, x, "x");
  return {x.to(out_dtype(x)).contiguous(), as_bool_mask(op, "mask", mask)};
}

// Too few masked-in elements is an error, not a NaN: none for a mean, fewer than 2 for an
// unbiased variance.
inline void check_masked_count(const char* op, int64_t count, bool need_var, bool unbiased) {
  TORCH_CHECK_VALUE(count > 0, "pyppo.", op, ": mask selects no element of x (all masked)");
  TORCH_CHECK_VALUE(!need_var || !unbiased || count > 1, "pyppo.", op,
                    ": the unbiased variance needs at least 2 valid elements, mask selects ", count);
}

}  // namespace pyppo
