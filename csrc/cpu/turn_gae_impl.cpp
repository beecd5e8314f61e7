// GAE over agent turns on CPU: the checks of checks/turn_gae.h, then the row loops of
// cpu/kernels/turn_gae_kernel.cpp, compiled once per instruction set.
#include "checks/turn_gae.h"
#include "cpu/kernels/kernels.h"

#include <torch/library.h>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor> turn_gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                                const at::Tensor& turn_ids, double gamma, double lam,
                                                const std::optional<at::Tensor>& last_values) {
  TurnGaeTensors t = prepare_turn_gae(rewards, values, turn_ids, gamma, lam, last_values);
  if (t.B > 0 && t.T > 0) {
    cpu::TurnGaeArgs a;
    a.dtype = t.rewards.scalar_type();
    a.B = t.B;
    a.T = t.T;
    a.rewards = t.rewards.const_data_ptr();
    a.values = t.values.const_data_ptr();
    a.turn_ids = t.turn_ids.const_data_ptr<int64_t>();
    a.last_values = t.last_values.defined() ? t.last_values.const_data_ptr() : nullptr;
    a.gamma = gamma;
    a.lam = lam;
    a.advantages = t.advantages.data_ptr();
    a.returns = t.returns.data_ptr();
    cpu::cpu_kernels().turn_gae(a);
  }
  return {t.advantages, t.returns};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) { m.impl("turn_gae", &turn_gae_cpu); }

}  // namespace pyppo
