// linear_ppo_loss: argument checks and messages, and the flattening of the per-token inputs to
// contiguous [N] tensors. Hidden states, head and labels are checked as linear_logprobs checks
// them. See docs/ops.md#linear_ppo_loss.
#pragma once

#include "checks/kl.h"
#include "checks/linear_logprobs.h"

#include <cmath>
#include <optional>

namespace pyppo {

// The log-ratio bound of ppo_policy_loss (LOG_RATIO_CLAMP in pyppo/ops/losses.py).
constexpr double kLogRatioClamp = 20.0;

// GSPO's upper bound on the sequence log-ratio (GSPO_LOG_RATIO_MAX in pyppo/ops/policy_losses.py).
constexpr double kGspoLogRatioMax = 10.0;

// The policy losses of pyppo/ops/policy_losses.py (POLICY_LOSSES).
enum class PolicyLoss { PPO, GSPO, CISPO };

inline PolicyLoss parse_policy_loss(c10::string_view name) {
  if (name == "ppo") return PolicyLoss::PPO;
  if (name == "gspo") return PolicyLoss::GSPO;
  if (name == "cispo") return PolicyLoss::CISPO;
  TORCH_CHECK_VALUE(false, "pyppo.linear_ppo_loss: policy_loss must be one of 'ppo', 'gspo', 'cispo', got '",
                    std::string(name.data(), name.size()), "'");
}

struct PpoScalars {
  PolicyLoss loss = PolicyLoss::PPO;
  double cliprange_low = 0, cliprange_high = 0;
  std::optional<double> dual_clip;
  double kl_coef = 0, entropy_coef = 0;
};

// The dtype of the per-token surrogate arithmetic, and of the loss: float64 when hidden (hence the
// log-probs), old_logprobs or advantages is float64, else float32, as ppo_policy_loss computes it.
inline at::ScalarType ppo_dtype(const at::Tensor& hidden, const at::Tensor& old_logprobs,
                                const at::Tensor& advantages) {
  const bool f64 = hidden.scalar_type() == at::kDouble || old_logprobs.scalar_type() == at::kDouble ||
                   advantages.scalar_type() == at::kDouble;
  return f64 ? at::kDouble : at::kFloat;
}

// Everything linear_ppo_loss checks without reading data (the Meta kernel's checks).
inline PpoScalars check_linear_ppo_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                        const at::Tensor& old_logprobs, const at::Tensor& advantages,
                                        const at::Tensor& response_mask, const at::Tensor& token_weights,
                                        const std::optional<at::Tensor>& ref_logprobs,
                                        const std::optional<at::Tensor>& bias, double temperature,
                                        double cliprange_low, double cliprange_high, std::optional<double> dual_clip,
                                        double kl_loss_coef, c10::string_view kl_loss_estimator, double entropy_coef,
                                        int64_t chunk_size, c10::string_view policy_loss) {
  const char* op = "linear_ppo_loss";
  check_linear_inputs(op, hidden, weight, labels, response_mask, bias, temperature, chunk_size, "response_mask");
  check_2d(op, "labels", labels);
  auto per_token = [&](const char* name, const at::Tensor& t) {
    check_float(op, name, t);
    check_like(op, name, t, labels, "labels");
  };
  per_token("old_logprobs", old_logprobs);
  per_token("advantages", advantages);
  per_token("token_weights", token_weights);
  TORCH_CHECK_VALUE(std::isfinite(kl_loss_coef) && kl_loss_coef >= 0,
                    "pyppo.linear_ppo_loss: kl_loss_coef must be a finite number >= 0, got ", kl_loss_coef);
  if (kl_loss_coef > 0) {
    TORCH_CHECK_VALUE(has(ref_logprobs), "pyppo.linear_ppo_loss: ref_logprobs is required when kl_loss_coef > 0");
    per_token("ref_logprobs", *ref_logprobs);
  }
  parse_estimator(op, kl_loss_estimator, "kl_loss_estimator");
  TORCH_CHECK_VALUE(std::isfinite(entropy_coef) && entropy_coef >= 0,
                    "pyppo.linear_ppo_loss: entropy_coef must be a finite number >= 0, got ", entropy_coef);
  TORCH_CHECK_VALUE(cliprange_low >= 0 && cliprange_low < 1,
                    "pyppo.linear_ppo_loss: cliprange_low must be in [0, 1), got ", cliprange_low);
  TORCH_CHECK_VALUE(std::isfinite(cliprange_high) && cliprange_high > 0,
                    "pyppo.linear_ppo_loss: cliprange_high must be a finite number > 0, got ", cliprange_high);
  TORCH_CHECK_VALUE(!dual_clip.has_value() || (std::isfinite(*dual_clip) && *dual_clip > 1),
                    "pyppo.linear_ppo_loss: dual_clip must be a finite number > 1 or None, got ",
                    dual_clip.value_or(0.0));
  PpoScalars s;
  s.loss = parse_policy_loss(policy_loss);
  TORCH_CHECK_VALUE(s.loss == PolicyLoss::PPO || !dual_clip.has_value(),
                    "pyppo.linear_ppo_loss: dual_clip applies to policy_loss 'ppo' only, got policy_loss '",
                    std::string(policy_loss.data(), policy_loss.size()), "' with dual_clip ", dual_clip.value_or(0.0));
  s.cliprange_low = cliprange_low;
  s.cliprange_high = cliprange_high;
  s.dual_clip = dual_clip;
  s.kl_coef = kl_loss_coef;
  s.entropy_coef = entropy_coef;
  return s;
}

// The per-token inputs as the chunk loop reads them: [N], contiguous; old_logprobs, advantages
// and token_weights in ppo_dtype, ref_logprobs as given (kl_penalty converts it) or undefined
// when the KL term is off.
struct PpoTokens {
  at::Tensor old_logprobs, advantages, token_weights, ref_logprobs;
};

inline PpoTokens flatten_ppo_tokens(at::ScalarType dt, int64_t N, const at::Tensor& old_logprobs,
                                    const at::Tensor& advantages, const at::Tensor& token_weights,
                                    const std::optional<at::Tensor>& ref_logprobs, double kl_loss_coef) {
  PpoTokens t;
  t.old_logprobs = flat_acc(old_logprobs, dt, N);
  t.advantages = flat_acc(advantages, dt, N);
  t.token_weights = flat_acc(token_weights, dt, N);
  if (kl_loss_coef > 0) t.ref_logprobs = ref_logprobs->reshape({N}).contiguous();
  return t;
}

}  // namespace pyppo
