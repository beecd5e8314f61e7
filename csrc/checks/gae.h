// gae: argument checks and messages. See docs/ops.md#gae.
#pragma once

#include "checks/common.h"

#include <optional>

namespace pyppo {

// Everything gae checks without reading the data (the Meta kernel runs all of it). The one data
// check, row_lam's values in [0, 1], is check_gae_row_lam_values / fail_gae_row_lam below.
inline void check_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& response_mask,
                      double gamma, double lam, const std::optional<at::Tensor>& last_values,
                      std::optional<double> lam_critic, const std::optional<at::Tensor>& row_lam) {
  const char* op = "gae";
  check_float(op, "rewards", rewards);
  check_float(op, "values", values);
  check_2d(op, "rewards", rewards);
  check_like(op, "values", values, rewards, "rewards");
  check_like(op, "response_mask", response_mask, rewards, "rewards");
  check_mask_dtype(op, "response_mask", response_mask);
  TORCH_CHECK_VALUE(gamma >= 0 && gamma <= 1, "pyppo.gae: gamma must be in [0, 1], got ", gamma);
  TORCH_CHECK_VALUE(lam >= 0 && lam <= 1, "pyppo.gae: lam must be in [0, 1], got ", lam);
  if (lam_critic.has_value())
    TORCH_CHECK_VALUE(*lam_critic >= 0 && *lam_critic <= 1, "pyppo.gae: lam_critic must be in [0, 1], got ",
                      *lam_critic);
  if (last_values.has_value() && last_values->defined())
    check_per_row(op, "last_values", *last_values, rewards, "rewards");
  if (row_lam.has_value() && row_lam->defined()) check_per_row(op, "row_lam", *row_lam, rewards, "rewards");
}

// row_lam[row] = value is outside [0, 1] (or NaN): the data error of row_lam, raised by the CPU
// impl (a loop) and the CUDA impl (a device reduction read back once) alike.
[[noreturn]] inline void fail_gae_row_lam(int64_t row, double value) {
  TORCH_CHECK_VALUE(false, "pyppo.gae: row_lam (the per-row lam) must hold values in [0, 1], got row_lam[", row,
                    "] = ", value);
  __builtin_unreachable();
}

// gae's inputs as the kernels read them (contiguous, accumulation dtype, bool mask) and its
// outputs, allocated. row_lam is float64 whatever its dtype, so that each row's gamma * lam is
// the product a call with that row's lam as a Python float computes.
struct GaeTensors {
  int64_t B = 0, T = 0;
  at::Tensor rewards, values, mask, last_values;  // last_values undefined when not given
  at::Tensor row_lam;                             // [B] float64, undefined when not given
  at::Tensor advantages, returns;
};

inline GaeTensors prepare_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& response_mask,
                              double gamma, double lam, const std::optional<at::Tensor>& last_values,
                              std::optional<double> lam_critic, const std::optional<at::Tensor>& row_lam) {
  check_gae(rewards, values, response_mask, gamma, lam, last_values, lam_critic, row_lam);
  GaeTensors g;
  g.B = rewards.size(0);
  g.T = rewards.size(1);
  const auto acc = out_dtype(rewards);
  g.rewards = rewards.to(acc).contiguous();
  g.values = values.to(acc).contiguous();
  g.mask = as_bool_mask("gae", "response_mask", response_mask);
  if (last_values.has_value() && last_values->defined()) g.last_values = last_values->to(acc).contiguous();
  if (row_lam.has_value() && row_lam->defined()) g.row_lam = row_lam->to(at::kDouble).contiguous();
  g.advantages = at::empty({g.B, g.T}, g.rewards.options());
  g.returns = at::empty({g.B, g.T}, g.rewards.options());
  return g;
}

}  // namespace pyppo
