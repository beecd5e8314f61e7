// gather_logprobs on the Meta device: what torch.compile and FakeTensorMode run to learn the
// outputs' shapes (pyppo registers no Python fake kernels). The checks are the CPU and CUDA
// impls', from checks/gather_logprobs.h, so a bad input raises the same error when traced; the
// checks that read data (the label range, 0/1 mask values) cannot run here.
#include "checks/gather_logprobs.h"

#include <torch/library.h>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_logprobs_meta(const at::Tensor& logits, const at::Tensor& labels,
                                                                   const std::optional<at::Tensor>& mask,
                                                                   double temperature, int64_t /*ignore_index*/,
                                                                   bool return_entropy) {
  check_gather_logprobs(logits, labels, mask, temperature);
  return alloc_logprobs_outputs(labels, out_options(logits), return_entropy).tuple();
}

at::Tensor gather_logprobs_backward_meta(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                                         const at::Tensor& logits, const at::Tensor& labels,
                                         const std::optional<at::Tensor>& mask, const at::Tensor& lse,
                                         const std::optional<at::Tensor>& entropy, double temperature,
                                         int64_t /*ignore_index*/) {
  check_gather_logprobs_backward(grad_logprobs, grad_entropy, logits, labels, mask, lse, entropy, temperature);
  // A fresh contiguous gradient whatever the logits' strides, as the kernels write it.
  return at::empty_symint(logits.sym_sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, Meta, m) {
  m.impl("gather_logprobs", &gather_logprobs_meta);
  m.impl("gather_logprobs_backward", &gather_logprobs_backward_meta);
}

}  // namespace pyppo
