// ATen glue of gae on CUDA (kernels in gae_kernel.cu). No host sync, except the one common.h's
// as_bool_mask does for a response_mask that is a 0/1 number tensor rather than bool.
#include "cuda/glue.h"
#include "op_args.h"

#include <torch/library.h>

namespace pyppo {
namespace {

using namespace cuda_glue;

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                            const at::Tensor& response_mask, double gamma, double lam,
                                            const std::optional<at::Tensor>& last_values) {
  const char* op = "gae";
  check_gae_inputs(rewards, values, response_mask, gamma, lam, last_values);
  const int64_t B = rewards.size(0), T = rewards.size(1);
  const auto acc = out_dtype(rewards);
  const c10::cuda::CUDAGuard guard(rewards.device());
  at::Tensor r = rewards.to(acc).contiguous();
  at::Tensor v = values.to(acc).contiguous();
  at::Tensor mask = as_bool_mask(op, "response_mask", response_mask);
  at::Tensor boot;
  if (last_values.has_value() && last_values->defined()) boot = last_values->to(acc).contiguous();
  at::Tensor adv = at::empty({B, T}, r.options());
  at::Tensor ret = at::empty({B, T}, r.options());
  if (B > 0 && T > 0) {
    cuda::GAEParams k;
    k.is_double = acc == at::kDouble;
    k.B = B;
    k.T = T;
    k.rewards = r.const_data_ptr();
    k.values = v.const_data_ptr();
    k.mask = mask.const_data_ptr<bool>();
    k.last_values = boot.defined() ? boot.const_data_ptr() : nullptr;
    k.gamma = gamma;
    k.lam = lam;
    k.advantages = adv.mutable_data_ptr();
    k.returns = ret.mutable_data_ptr();
    k.stream = current_stream();
    check_launch(op, cuda::launch_gae(k));
  }
  return {adv, ret};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) { m.impl("gae", &gae_cuda); }

}  // namespace pyppo
