// turn_gae on CUDA (kernel in kernels/turn_gae_kernel.cu): the checks of checks/turn_gae.h, then
// one launch. No host sync (no check reads the data), so it can be captured in a CUDA graph.
#include "cuda/impl_common.h"
#include "checks/turn_gae.h"

#include <torch/library.h>

namespace pyppo {
namespace {

using namespace cuda_impl;

std::tuple<at::Tensor, at::Tensor> turn_gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                                 const at::Tensor& turn_ids, double gamma, double lam,
                                                 const std::optional<at::Tensor>& last_values) {
  TurnGaeTensors t = prepare_turn_gae(rewards, values, turn_ids, gamma, lam, last_values);
  const c10::cuda::CUDAGuard guard(rewards.device());
  if (t.B > 0 && t.T > 0) {
    cuda::TurnGaeArgs k;
    k.is_double = t.rewards.scalar_type() == at::kDouble;
    k.B = t.B;
    k.T = t.T;
    k.rewards = t.rewards.const_data_ptr();
    k.values = t.values.const_data_ptr();
    k.turn_ids = t.turn_ids.const_data_ptr<int64_t>();
    k.last_values = ptr_or_null(t.last_values);
    k.gamma = gamma;
    k.lam = lam;
    k.advantages = t.advantages.mutable_data_ptr();
    k.returns = t.returns.mutable_data_ptr();
    k.stream = current_stream();
    check_launch("turn_gae", cuda::launch_turn_gae(k));
  }
  return {t.advantages, t.returns};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) { m.impl("turn_gae", &turn_gae_cuda); }

}  // namespace pyppo
