// shape_rewards: argument checks and messages. The two that read the data (a valid position in
// every row, finite scores) are found differently on CPU (a loop) and CUDA (device reductions
// and one sync); both raise them through the functions here. See docs/ops.md#shape_rewards.
#pragma once

#include "args/kl_penalty.h"

namespace pyppo {

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
