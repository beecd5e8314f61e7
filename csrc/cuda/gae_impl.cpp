// gae on CUDA (kernels in kernels/gae_kernel.cu): the checks of checks/gae.h, then one launch.
// No host sync, except the one checks/common.h's as_bool_mask does for a response_mask that is a
// 0/1 number tensor rather than bool.
#include "cuda/impl_common.h"
#include "checks/gae.h"

#include <torch/library.h>

namespace pyppo {
namespace {

using namespace cuda_impl;

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                            const at::Tensor& response_mask, double gamma, double lam,
                                            const std::optional<at::Tensor>& last_values) {
  GaeTensors t = prepare_gae(rewards, values, response_mask, gamma, lam, last_values);
  const c10::cuda::CUDAGuard guard(rewards.device());
  if (t.B > 0 && t.T > 0) {
    cuda::GaeArgs k;
    k.is_double = t.rewards.scalar_type() == at::kDouble;
    k.B = t.B;
    k.T = t.T;
    k.rewards = t.rewards.const_data_ptr();
    k.values = t.values.const_data_ptr();
    k.mask = t.mask.const_data_ptr<bool>();
    k.last_values = ptr_or_null(t.last_values);
    k.gamma = gamma;
    k.lam = lam;
    k.advantages = t.advantages.mutable_data_ptr();
    k.returns = t.returns.mutable_data_ptr();
    k.stream = current_stream();
    check_launch("gae", cuda::launch_gae(k));
  }
  return {t.advantages, t.returns};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) { m.impl("gae", &gae_cuda); }

}  // namespace pyppo
