// kl_penalty (and its backward) and shape_rewards on the Meta device (see
// meta/gather_logprobs_fake.cpp for why): the checks of checks/kl.h, and the outputs' shapes.
#include "checks/kl.h"

#include <torch/library.h>

namespace pyppo {
namespace {

at::Tensor kl_penalty_meta(const at::Tensor& logprobs, const at::Tensor& ref_logprobs, c10::string_view estimator,
                           std::optional<double> clamp_min, std::optional<double> clamp_max) {
  check_kl_penalty(logprobs, ref_logprobs, estimator, clamp_min, clamp_max);
  return at::empty_symint(logprobs.sym_sizes(), out_options(logprobs));
}

at::Tensor kl_penalty_backward_meta(const at::Tensor& grad_kl, const at::Tensor& logprobs,
                                    const at::Tensor& ref_logprobs, c10::string_view estimator,
                                    std::optional<double> clamp_min, std::optional<double> clamp_max) {
  check_kl_penalty_backward(grad_kl, logprobs, ref_logprobs, estimator, clamp_min, clamp_max);
  return at::empty_symint(logprobs.sym_sizes(), logprobs.options());
}

std::tuple<at::Tensor, at::Tensor> shape_rewards_meta(const at::Tensor& scores, const at::Tensor& logprobs,
                                                      const at::Tensor& ref_logprobs, const at::Tensor& response_mask,
                                                      double kl_coef, c10::string_view estimator,
                                                      std::optional<double> score_clip) {
  check_shape_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef, estimator, score_clip);
  return {at::empty_symint(logprobs.sym_sizes(), out_options(logprobs)),
          at::empty_symint(logprobs.sym_sizes(), out_options(logprobs))};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, Meta, m) {
  m.impl("kl_penalty", &kl_penalty_meta);
  m.impl("kl_penalty_backward", &kl_penalty_backward_meta);
  m.impl("shape_rewards", &shape_rewards_meta);
}

}  // namespace pyppo
