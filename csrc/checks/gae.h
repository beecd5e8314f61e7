// gae: argument checks and messages. See docs/ops.md#gae.
#pragma once

#include "checks/common.h"

#include <optional>

namespace pyppo {

// Everything gae checks; none of it reads the data, so the Meta kernel runs all of it.
inline void check_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& response_mask,
                      double gamma, double lam, const std::optional<at::Tensor>& last_values) {
  const char* op = "gae";
  check_float(op, "rewards", rewards);
  check_float(op, "values", values);
  check_2d(op, "rewards", rewards);
  check_like(op, "values", values, rewards, "rewards");
  check_like(op, "response_mask", response_mask, rewards, "rewards");
  check_mask_dtype(op, "response_mask", response_mask);
  TORCH_CHECK_VALUE(gamma >= 0 && gamma <= 1, "pyppo.gae: gamma must be in [0, 1], got ", gamma);
  TORCH_CHECK_VALUE(lam >= 0 && lam <= 1, "pyppo.gae: lam must be in [0, 1], got ", lam);
  if (last_values.has_value() && last_values->defined())
    check_per_row(op, "last_values", *last_values, rewards, "rewards");
}

// gae's inputs as the kernels read them (contiguous, accumulation dtype, bool mask) and its
// outputs, allocated.
struct GaeTensors {
  int64_t B = 0, T = 0;
  at::Tensor rewards, values, mask, last_values;  // last_values undefined when not given
  at::Tensor advantages, returns;
};

inline GaeTensors prepare_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& response_mask,
                              double gamma, double lam, const std::optional<at::Tensor>& last_values) {
  check_gae(rewards, values, response_mask, gamma, lam, last_values);
  GaeTensors g;
  g.B = rewards.size(0);
  g.T = rewards.size(1);
  const auto acc = out_dtype(rewards);
  g.rewards = rewards.to(acc).contiguous();
  g.values = values.to(acc).contiguous();
  g.mask = as_bool_mask("gae", "response_mask", response_mask);
  if (last_values.has_value() && last_values->defined()) g.last_values = last_values->to(acc).contiguous();
  g.advantages = at::empty({g.B, g.T}, g.rewards.options());
  g.returns = at::empty({g.B, g.T}, g.rewards.options());
  return g;
}

}  // namespace pyppo
