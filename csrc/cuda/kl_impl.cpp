// kl_penalty (and its backward) and shape_rewards on CUDA (kernels in kernels/kl_kernel.cu).
//
// Host syncs: kl_penalty has none. shape_rewards needs two facts on the host before its kernel
// runs, to raise the errors of checks/kl.h: every row has a valid position, every score is
// finite. Both are computed on the device and read back together (one sync), plus one more
// when response_mask is a 0/1 number tensor rather than bool (checks/common.h's as_bool_mask).
#include "cuda/impl_common.h"
#include "checks/kl.h"

#include <torch/library.h>

namespace pyppo {
namespace {

using namespace cuda_impl;

// The fields the forward and backward launches share.
cuda::KLArgs kl_args(const KLOptions& a, const KLTensors& t, at::Tensor& out) {
  cuda::KLArgs k;
  k.is_double = t.acc == at::kDouble;
  k.n = t.lp.numel();
  k.logprobs = t.lp.const_data_ptr();
  k.ref_logprobs = t.ref.const_data_ptr();
  k.out = out.mutable_data_ptr();
  k.estimator = a.estimator;
  k.clamp = a.clamp;
  k.stream = current_stream();
  return k;
}

at::Tensor kl_penalty_cuda(const at::Tensor& logprobs, const at::Tensor& ref_logprobs, c10::string_view estimator,
                           std::optional<double> clamp_min, std::optional<double> clamp_max) {
  const KLOptions a = check_kl_penalty(logprobs, ref_logprobs, estimator, clamp_min, clamp_max);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const KLTensors t = kl_tensors(logprobs, ref_logprobs);
  at::Tensor out = at::empty(logprobs.sizes(), t.lp.options());
  check_launch("kl_penalty", cuda::launch_kl_penalty_fwd(kl_args(a, t, out)));
  return out;
}

at::Tensor kl_penalty_backward_cuda(const at::Tensor& grad_kl, const at::Tensor& logprobs,
                                    const at::Tensor& ref_logprobs, c10::string_view estimator,
                                    std::optional<double> clamp_min, std::optional<double> clamp_max) {
  const KLOptions a = check_kl_penalty_backward(grad_kl, logprobs, ref_logprobs, estimator, clamp_min, clamp_max);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const KLTensors t = kl_tensors(logprobs, ref_logprobs);
  at::Tensor g = grad_kl.to(t.acc).contiguous();
  at::Tensor out = at::empty(logprobs.sizes(), t.lp.options());
  cuda::KLArgs k = kl_args(a, t, out);
  k.grad_kl = g.const_data_ptr();
  check_launch("kl_penalty_backward", cuda::launch_kl_penalty_bwd(k));
  return out.to(logprobs.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> shape_rewards_cuda(const at::Tensor& scores, const at::Tensor& logprobs,
                                                      const at::Tensor& ref_logprobs, const at::Tensor& response_mask,
                                                      double kl_coef, c10::string_view estimator,
                                                      std::optional<double> score_clip) {
  const char* op = "shape_rewards";
  const KLEstimator est =
      check_shape_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef, estimator, score_clip);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const int64_t B = logprobs.size(0), T = logprobs.size(1);
  const KLTensors t = kl_tensors(logprobs, ref_logprobs);
  const auto acc = t.acc;
  at::Tensor sc = scores.to(acc).contiguous();
  at::Tensor mask = as_bool_mask(op, "response_mask", response_mask);
  at::Tensor rewards = at::empty({B, T}, t.lp.options());
  at::Tensor kl = at::empty({B, T}, t.lp.options());

  // The CPU impl's two data errors, in its order; one sync reads both flags.
  if (B > 0) {
    at::Tensor row_has_valid = mask.any(1);
    at::Tensor finite = at::isfinite(sc);
    at::Tensor flags = at::stack({row_has_valid.all(), finite.all()}).cpu();
    const bool* f = flags.const_data_ptr<bool>();
    if (!f[0]) fail_row_without_valid_position(row_has_valid.logical_not().nonzero().select(1, 0)[0].item<int64_t>());
    if (!f[1]) {
      const int64_t b = finite.logical_not().nonzero().select(1, 0)[0].item<int64_t>();
      fail_non_finite_score(b, sc[b].item<double>());
    }
  }
  if (B > 0 && T > 0) {
    cuda::ShapeRewardsArgs k;
    k.is_double = acc == at::kDouble;
    k.B = B;
    k.T = T;
    k.scores = sc.const_data_ptr();
    k.logprobs = t.lp.const_data_ptr();
    k.ref_logprobs = t.ref.const_data_ptr();
    k.mask = mask.const_data_ptr<bool>();
    k.kl_coef = kl_coef;
    k.estimator = est;
    k.has_score_clip = score_clip.has_value();
    k.score_clip = score_clip.value_or(0);
    k.rewards = rewards.mutable_data_ptr();
    k.kl = kl.mutable_data_ptr();
    k.stream = current_stream();
    check_launch(op, cuda::launch_shape_rewards(k));
  }
  return {rewards, kl};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) {
  m.impl("kl_penalty", &kl_penalty_cuda);
  m.impl("kl_penalty_backward", &kl_penalty_backward_cuda);
  m.impl("shape_rewards", &shape_rewards_cuda);
}

}  // namespace pyppo
