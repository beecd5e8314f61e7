// gae on CUDA (kernels in kernels/gae_kernel.cu): the checks of checks/gae.h, then one launch.
// No host sync, except the one checks/common.h's as_bool_mask does for a response_mask that is a
// 0/1 number tensor rather than bool, and one when row_lam is given: its values are checked to lie
// in [0, 1] by a device reduction read back once (not while a CUDA graph is being captured; there
// the kernel gives a row whose lam is out of range NaN advantages).
#include "cuda/impl_common.h"
#include "checks/gae.h"

#include <torch/library.h>

namespace pyppo {
namespace {

using namespace cuda_impl;

// The CPU impl's data error: the first row_lam outside [0, 1] (NaN included).
void check_row_lam_values(const at::Tensor& row_lam) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_launch("gae", cudaStreamIsCapturing(current_stream(), &status));
  if (status != cudaStreamCaptureStatusNone || row_lam.numel() == 0) return;
  const at::Tensor ok = row_lam.ge(0).logical_and(row_lam.le(1));  // false for NaN
  if (ok.all().item<bool>()) return;
  const int64_t b = ok.logical_not().nonzero().select(1, 0)[0].item<int64_t>();
  fail_gae_row_lam(b, row_lam[b].item<double>());
}

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                            const at::Tensor& response_mask, double gamma, double lam,
                                            const std::optional<at::Tensor>& last_values,
                                            std::optional<double> lam_critic,
                                            const std::optional<at::Tensor>& row_lam) {
  GaeTensors t = prepare_gae(rewards, values, response_mask, gamma, lam, last_values, lam_critic, row_lam);
  const c10::cuda::CUDAGuard guard(rewards.device());
  if (t.row_lam.defined()) check_row_lam_values(t.row_lam);
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
    k.row_lam = t.row_lam.defined() ? t.row_lam.const_data_ptr<double>() : nullptr;
    k.has_lam_critic = lam_critic.has_value();
    k.lam_critic = lam_critic.value_or(0.0);
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
