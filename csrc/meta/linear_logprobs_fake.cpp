// linear_logprobs on the Meta device (see meta/gather_logprobs_fake.cpp for why): the checks of
// checks/linear_logprobs.h and the outputs' shapes.
#include "checks/linear_logprobs.h"

#include <torch/library.h>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprobs_meta(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, double temperature, int64_t /*ignore_index*/, bool return_entropy,
    int64_t chunk_size) {
  check_linear_logprobs(hidden, weight, labels, mask, bias, temperature, chunk_size);
  return alloc_logprobs_outputs(labels, out_options(hidden), return_entropy).tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprobs_backward_meta(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
    double temperature, int64_t /*ignore_index*/, int64_t chunk_size, std::array<bool, 3> output_mask) {
  check_linear_logprobs_backward(grad_logprobs, grad_entropy, hidden, weight, labels, mask, bias, lse, entropy,
                                 temperature, chunk_size);
  // Fresh contiguous gradients; one not asked for is an empty tensor (a schema output cannot be None).
  auto none = [&] { return at::empty({0}, hidden.options()); };
  return {output_mask[0] ? at::empty_symint(hidden.sym_sizes(), hidden.options()) : none(),
          output_mask[1] ? at::empty_symint(weight.sym_sizes(), weight.options()) : none(),
          output_mask[2] && has(bias) ? at::empty_symint(bias->sym_sizes(), weight.options()) : none()};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, Meta, m) {
  m.impl("linear_logprobs", &linear_logprobs_meta);
  m.impl("linear_logprobs_backward", &linear_logprobs_backward_meta);
}

}  // namespace pyppo
