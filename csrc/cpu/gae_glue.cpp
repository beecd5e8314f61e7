// Generalized Advantage Estimation on CPU: one right-to-left scan per row, rows in parallel.
#include "common.h"
#include "op_args.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                           const at::Tensor& response_mask, double gamma, double lam,
                                           const std::optional<at::Tensor>& last_values) {
  const char* op = "gae";
  check_gae_inputs(rewards, values, response_mask, gamma, lam, last_values);
  const int64_t B = rewards.size(0), T = rewards.size(1);
  const auto acc = out_dtype(rewards);
  at::Tensor r = rewards.to(acc).contiguous();
  at::Tensor v = values.to(acc).contiguous();
  at::Tensor mask = as_bool_mask(op, "response_mask", response_mask);
  at::Tensor boot;
  if (last_values.has_value() && last_values->defined()) boot = last_values->to(acc).contiguous();
  at::Tensor adv = at::empty({B, T}, r.options());
  at::Tensor ret = at::empty({B, T}, r.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "pyppo_gae", [&] {
    const scalar_t* rp = r.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const bool* mp = mask.data_ptr<bool>();
    const scalar_t* bp = boot.defined() ? boot.data_ptr<scalar_t>() : nullptr;
    scalar_t* ap = adv.data_ptr<scalar_t>();
    scalar_t* op_ = ret.data_ptr<scalar_t>();
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
  return {adv, ret};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) { m.impl("gae", &gae_cpu); }

}  // namespace pyppo
