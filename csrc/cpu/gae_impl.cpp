// Generalized Advantage Estimation on CPU: the checks of checks/gae.h (row_lam's values in a
// loop here), then the row scan of cpu/kernels/gae_kernel.cpp, compiled once per instruction set.
#include "checks/gae.h"
#include "cpu/kernels/kernels.h"

#include <torch/library.h>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                           const at::Tensor& response_mask, double gamma, double lam,
                                           const std::optional<at::Tensor>& last_values,
                                           std::optional<double> lam_critic,
                                           const std::optional<at::Tensor>& row_lam) {
  GaeTensors t = prepare_gae(rewards, values, response_mask, gamma, lam, last_values, lam_critic, row_lam);
  const double* row_lam_p = t.row_lam.defined() ? t.row_lam.const_data_ptr<double>() : nullptr;
  if (row_lam_p)
    for (int64_t b = 0; b < t.B; ++b)
      if (!(row_lam_p[b] >= 0 && row_lam_p[b] <= 1)) fail_gae_row_lam(b, row_lam_p[b]);
  if (t.B > 0 && t.T > 0) {
    cpu::GaeArgs a;
    a.dtype = t.rewards.scalar_type();
    a.B = t.B;
    a.T = t.T;
    a.rewards = t.rewards.const_data_ptr();
    a.values = t.values.const_data_ptr();
    a.mask = t.mask.const_data_ptr<bool>();
    a.last_values = t.last_values.defined() ? t.last_values.const_data_ptr() : nullptr;
    a.gamma = gamma;
    a.lam = lam;
    a.row_lam = row_lam_p;
    a.has_lam_critic = lam_critic.has_value();
    a.lam_critic = lam_critic.value_or(0.0);
    a.advantages = t.advantages.data_ptr();
    a.returns = t.returns.data_ptr();
    cpu::cpu_kernels().gae(a);
  }
  return {t.advantages, t.returns};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) { m.impl("gae", &gae_cpu); }

}  // namespace pyppo
