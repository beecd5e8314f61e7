// linear_ppo_loss on the Meta device (see meta/gather_logprobs_fake.cpp for why): the checks of
// checks/linear_ppo_loss.h and the outputs' shapes and dtypes.
#include "checks/linear_ppo_loss.h"

#include <torch/library.h>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_ppo_loss_meta(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& old_logprobs,
    const at::Tensor& advantages, const at::Tensor& response_mask, const at::Tensor& token_weights,
    const std::optional<at::Tensor>& ref_logprobs, const std::optional<at::Tensor>& bias, double temperature,
    int64_t /*ignore_index*/, double cliprange_low, double cliprange_high, std::optional<double> dual_clip,
    double kl_loss_coef, c10::string_view kl_loss_estimator, double entropy_coef, bool return_entropy,
    int64_t chunk_size, std::array<bool, 3> output_mask, c10::string_view policy_loss) {
  const PpoScalars s = check_linear_ppo_loss(hidden, weight, labels, old_logprobs, advantages, response_mask,
                                             token_weights, ref_logprobs, bias, temperature, cliprange_low,
                                             cliprange_high, dual_clip, kl_loss_coef, kl_loss_estimator,
                                             entropy_coef, chunk_size, policy_loss);
  LogprobsOutputs out = alloc_logprobs_outputs(labels, out_options(hidden), return_entropy || s.entropy_coef > 0);
  auto none = [&] { return at::empty({0}, hidden.options()); };
  return {at::empty({}, hidden.options().dtype(ppo_dtype(hidden, old_logprobs, advantages))),
          out.logprobs,
          out.entropy,
          output_mask[0] ? at::empty_symint(hidden.sym_sizes(), hidden.options()) : none(),
          output_mask[1] ? at::empty_symint(weight.sym_sizes(), weight.options()) : none(),
          output_mask[2] && has(bias) ? at::empty_symint(bias->sym_sizes(), weight.options()) : none()};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, Meta, m) { m.impl("linear_ppo_loss", &linear_ppo_loss_meta); }

}  // namespace pyppo
