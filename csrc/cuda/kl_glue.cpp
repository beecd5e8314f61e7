// ATen glue of kl_penalty (and its backward) and shape_rewards on CUDA (kernels in kl_kernel.cu).
//
// Host syncs: kl_penalty has none. shape_rewards needs two facts on the host before its kernel
// runs, to raise the CPU kernel's errors: every row has a valid position, every score is
// finite. Both are computed on the device and read back together (one sync), plus one more
// when response_mask is a 0/1 number tensor rather than bool (common.h's as_bool_mask).
#include "cuda/glue.h"
#include "op_args.h"

#include <torch/library.h>

#include <cmath>

namespace pyppo {
namespace {

using namespace cuda_glue;

at::Tensor kl_penalty_cuda(const at::Tensor& logprobs, const at::Tensor& ref_logprobs, c10::string_view estimator,
                           std::optional<double> clamp_min, std::optional<double> clamp_max) {
  const char* op = "kl_penalty";
  check_kl_inputs(op, logprobs, ref_logprobs);
  const KLEstimator est = parse_estimator(op, estimator);
  const KLClamp c = make_clamp(op, clamp_min, clamp_max);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const auto acc = out_dtype(logprobs);
  at::Tensor lp = logprobs.to(acc).contiguous();
  at::Tensor ref = ref_logprobs.to(acc).contiguous();
  at::Tensor out = at::empty(logprobs.sizes(), lp.options());
  cuda::KLParams k;
  k.is_double = acc == at::kDouble;
  k.n = lp.numel();
  k.logprobs = lp.const_data_ptr();
  k.ref_logprobs = ref.const_data_ptr();
  k.out = out.mutable_data_ptr();
  k.estimator = est;
  k.clamp = c;
  k.stream = current_stream();
  check_launch(op, cuda::launch_kl_penalty_fwd(k));
  return out;
}

at::Tensor kl_penalty_backward_cuda(const at::Tensor& grad_kl, const at::Tensor& logprobs,
                                    const at::Tensor& ref_logprobs, c10::string_view estimator,
                                    std::optional<double> clamp_min, std::optional<double> clamp_max) {
  const char* op = "kl_penalty_backward";
  check_same_shape(op, "grad_kl", grad_kl, logprobs, "logprobs");
  check_same_shape(op, "ref_logprobs", ref_logprobs, logprobs, "logprobs");
  check_same_device(op, "grad_kl", grad_kl, logprobs, "logprobs");
  check_same_device(op, "ref_logprobs", ref_logprobs, logprobs, "logprobs");
  const KLEstimator est = parse_estimator(op, estimator);
  const KLClamp c = make_clamp(op, clamp_min, clamp_max);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const auto acc = out_dtype(logprobs);
  at::Tensor g = grad_kl.to(acc).contiguous();
  at::Tensor lp = logprobs.to(acc).contiguous();
  at::Tensor ref = ref_logprobs.to(acc).contiguous();
  at::Tensor out = at::empty(logprobs.sizes(), lp.options());
  cuda::KLParams k;
  k.is_double = acc == at::kDouble;
  k.n = lp.numel();
  k.logprobs = lp.const_data_ptr();
  k.ref_logprobs = ref.const_data_ptr();
  k.grad_kl = g.const_data_ptr();
  k.out = out.mutable_data_ptr();
  k.estimator = est;
  k.clamp = c;
  k.stream = current_stream();
  check_launch(op, cuda::launch_kl_penalty_bwd(k));
  return out.to(logprobs.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> shape_rewards_cuda(const at::Tensor& scores, const at::Tensor& logprobs,
                                                      const at::Tensor& ref_logprobs, const at::Tensor& response_mask,
                                                      double kl_coef, c10::string_view estimator,
                                                      std::optional<double> score_clip) {
  const char* op = "shape_rewards";
  check_shape_rewards_inputs(scores, logprobs, ref_logprobs, response_mask, kl_coef, score_clip);
  const KLEstimator est = parse_estimator(op, estimator);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const int64_t B = logprobs.size(0), T = logprobs.size(1);
  const auto acc = out_dtype(logprobs);
  at::Tensor lp = logprobs.to(acc).contiguous();
  at::Tensor ref = ref_logprobs.to(acc).contiguous();
  at::Tensor sc = scores.to(acc).contiguous();
  at::Tensor mask = as_bool_mask(op, "response_mask", response_mask);
  at::Tensor rewards = at::empty({B, T}, lp.options());
  at::Tensor kl = at::empty({B, T}, lp.options());

  // The CPU kernel's two input errors, in its order; one sync reads both flags.
  if (B > 0) {
    at::Tensor row_has_valid = mask.any(1);
    at::Tensor finite = at::isfinite(sc);
    at::Tensor flags = at::stack({row_has_valid.all(), finite.all()}).cpu();
    const bool* f = flags.const_data_ptr<bool>();
    if (!f[0]) {
      const int64_t b = row_has_valid.logical_not().nonzero().select(1, 0)[0].item<int64_t>();
      TORCH_CHECK_VALUE(false, "pyppo.shape_rewards: row ", b,
                        " of response_mask has no valid position; every response needs at least one token to carry its score");
    }
    if (!f[1]) {
      const int64_t b = finite.logical_not().nonzero().select(1, 0)[0].item<int64_t>();
      TORCH_CHECK_VALUE(false, "pyppo.shape_rewards: scores[", b, "] = ", sc[b].item<double>(), " is not finite");
    }
  }
  if (B > 0 && T > 0) {
    cuda::ShapeRewardsParams k;
    k.is_double = acc == at::kDouble;
    k.B = B;
    k.T = T;
    k.scores = sc.const_data_ptr();
    k.logprobs = lp.const_data_ptr();
    k.ref_logprobs = ref.const_data_ptr();
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
