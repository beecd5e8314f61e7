// Generalized Advantage Estimation on CPU: the checks of args/gae.h, then one right-to-left scan
// per row, rows in parallel.
#include "args/gae.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                           const at::Tensor& response_mask, double gamma, double lam,
                                           const std::optional<at::Tensor>& last_values) {
  GaeTensors t = prepare_gae(rewards, values, response_mask, gamma, lam, last_values);
  const int64_t B = t.B, T = t.T;
  AT_DISPATCH_FLOATING_TYPES(t.rewards.scalar_type(), "pyppo_gae", [&] {
    const scalar_t* rp = t.rewards.data_ptr<scalar_t>();
    const scalar_t* vp = t.values.data_ptr<scalar_t>();
    const bool* mp = t.mask.data_ptr<bool>();
    const scalar_t* bp = t.last_values.defined() ? t.last_values.data_ptr<scalar_t>() : nullptr;
    scalar_t* ap = t.advantages.data_ptr<scalar_t>();
    scalar_t* op_ = t.returns.data_ptr<scalar_t>();
    const scalar_t g = static_cast<scalar_t>(gamma);
    const scalar_t gl = static_cast<scalar_t>(gamma * lam);
    at::parallel_for(0, B, std::max<int64_t>(1, 65536 / std::max<int64_t>(T, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        // next_value / next_adv belong to the next *valid* position: a masked position in the
        // middle of a row (a tool output, an observation) is skipped without breaking the chain.
        scalar_t next_value = bp ? bp[b] : scalar_t(0);
        scalar_t next_adv = 0;
        for (int64_t t = T - 1; t >= 0; --t) {
          const int64_t i = b * T + t;
          if (!mp[i]) {
            ap[i] = 0;
            op_[i] = 0;
            continue;
          }
          const scalar_t delta = rp[i] + g * next_value - vp[i];
          next_adv = delta + gl * next_adv;
          next_value = vp[i];
          ap[i] = next_adv;
          op_[i] = next_adv + vp[i];
        }
      }
    });
  });
  return {t.advantages, t.returns};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) { m.impl("gae", &gae_cpu); }

}  // namespace pyppo
