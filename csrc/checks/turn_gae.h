// turn_gae: argument checks and messages. See docs/ops.md#turn_gae.
#pragma once

#include "checks/common.h"

#include <optional>

namespace pyppo {

// Everything turn_gae checks; none of it reads the data (every turn_ids value has a meaning), so
// the Meta kernel runs all of it.
inline void check_turn_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& turn_ids,
                           double gamma, double lam, const std::optional<at::Tensor>& last_values) {
  const char* op = "turn_gae";
  check_float(op, "rewards", rewards);
  check_float(op, "values", values);
  check_2d(op, "rewards", rewards);
  check_like(op, "values", values, rewards, "rewards");
  TORCH_CHECK_VALUE(at::isIntegralType(turn_ids.scalar_type(), /*includeBool=*/false),
                    "pyppo.turn_gae: turn_ids must be an integer tensor (int64; the turn index at agent positions, "
                    "-1 elsewhere), got ",
                    turn_ids.scalar_type());
  check_like(op, "turn_ids", turn_ids, rewards, "rewards");
  TORCH_CHECK_VALUE(gamma >= 0 && gamma <= 1, "pyppo.turn_gae: gamma must be in [0, 1], got ", gamma);
  TORCH_CHECK_VALUE(lam >= 0 && lam <= 1, "pyppo.turn_gae: lam must be in [0, 1], got ", lam);
  if (last_values.has_value() && last_values->defined())
    check_per_row(op, "last_values", *last_values, rewards, "rewards");
}

// turn_gae's inputs as the kernels read them (contiguous, accumulation dtype, int64 turn ids) and
// its outputs, allocated.
struct TurnGaeTensors {
  int64_t B = 0, T = 0;
  at::Tensor rewards, values, turn_ids, last_values;  // last_values undefined when not given
  at::Tensor advantages, returns;
};

inline TurnGaeTensors prepare_turn_gae(const at::Tensor& rewards, const at::Tensor& values,
                                       const at::Tensor& turn_ids, double gamma, double lam,
                                       const std::optional<at::Tensor>& last_values) {
  check_turn_gae(rewards, values, turn_ids, gamma, lam, last_values);
  TurnGaeTensors g;
  g.B = rewards.size(0);
  g.T = rewards.size(1);
  const auto acc = out_dtype(rewards);
  g.rewards = rewards.to(acc).contiguous();
  g.values = values.to(acc).contiguous();
  g.turn_ids = turn_ids.to(at::kLong).contiguous();
  if (last_values.has_value() && last_values->defined()) g.last_values = last_values->to(acc).contiguous();
  g.advantages = at::empty({g.B, g.T}, g.rewards.options());
  g.returns = at::empty({g.B, g.T}, g.rewards.options());
  return g;
}

}  // namespace pyppo
