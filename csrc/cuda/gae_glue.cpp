// ATen glue of gae on CUDA (kernels in gae.cu). No host sync, except the one common.h's
// as_bool_mask does for a response_mask that is a 0/1 number tensor rather than bool.
#include "cuda/glue.h"

#include <torch/library.h>

namespace pyppo {
namespace {

using namespace cuda_glue;

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                            const at::Tensor& response_mask, double gamma, double lam,
                                            const std::optional<at::Tensor>& last_values) {
  const char* op = "gae";
  check_float(op, "rewards", rewards);
  check_float(op, "values", values);
  as_2d(op, "rewards", rewards);
  check_same_shape(op, "values", values, rewards, "rewards");
  check_same_shape(op, "response_mask", response_mask, rewards, "rewards");
  check_same_device(op, "values", values, rewards, "rewards");
  check_same_device(op, "response_mask", response_mask, rewards, "rewards");
  TORCH_CHECK_VALUE(gamma >= 0 && gamma <= 1, "pyppo.gae: gamma must be in [0, 1], got ", gamma);
  TORCH_CHECK_VALUE(lam >= 0 && lam <= 1, "pyppo.gae: lam must be in [0, 1], got ", lam);
  const int64_t B = rewards.size(0), T = rewards.size(1);
  const auto acc = out_dtype(rewards);
  const c10::cuda::CUDAGuard guard(rewards.device());
  at::Tensor r = rewards.to(acc).contiguous();
  at::Tensor v = values.to(acc).contiguous();
  at::Tensor mask = as_bool_mask(op, "response_mask", response_mask);
  at::Tensor boot;
  if (last_values.has_value() && last_values->defined()) {
    check_float(op, "last_values", *last_values);
    check_same_device(op, "last_values", *last_values, rewards, "rewards");
    TORCH_CHECK_VALUE(last_values->dim() == 1 && last_values->size(0) == B, "pyppo.gae: last_values must have shape [B] = [",
                      B, "], got ", last_values->sizes());
    boot = last_values->to(acc).contiguous();
  }
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
