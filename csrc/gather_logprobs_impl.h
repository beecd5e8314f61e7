// gather_logprobs and its backward up to the kernel launch, for every device: the checks and
// flattening of checks/gather_logprobs.h, the allocation of the outputs, and a call to
// Kernels::fwd / Kernels::bwd, which cpu/gather_logprobs_impl.cpp and cuda/gather_logprobs_impl.cpp
// define. One body serves both, so the devices cannot drift apart in what they accept or return.
// The logits are read in place through a RowLayout (no [N, V] copy of a view sliced along T).
#pragma once

#include "checks/gather_logprobs.h"

namespace pyppo {

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_logprobs_impl(const at::Tensor& logits, const at::Tensor& labels,
                                                                   const std::optional<at::Tensor>& mask,
                                                                   double temperature, int64_t ignore_index,
                                                                   bool return_entropy) {
  GatherInputs p = prepare_gather(logits, labels, mask, temperature, ignore_index);
  LogprobsOutputs out = alloc_logprobs_outputs(labels, out_options(logits), return_entropy);
  if (p.N > 0) Kernels::fwd(p, ignore_index, temperature, out, return_entropy);
  p.label_check.finish();  // a device's verdict on the labels, once the kernel is queued
  return out.tuple();
}

template <typename Kernels>
at::Tensor gather_logprobs_backward_impl(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                                         const at::Tensor& logits, const at::Tensor& labels,
                                         const std::optional<at::Tensor>& mask, const at::Tensor& lse,
                                         const std::optional<at::Tensor>& entropy, double temperature,
                                         int64_t ignore_index) {
  GatherBackwardInputs b =
      prepare_gather_backward(grad_logprobs, grad_entropy, logits, labels, mask, lse, entropy, temperature, ignore_index);
  // A fresh contiguous gradient whatever the logits' strides.
  at::Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  if (b.fwd.N > 0) Kernels::bwd(b, ignore_index, temperature, grad);
  b.fwd.label_check.finish();
  return grad;
}

}  // namespace pyppo
