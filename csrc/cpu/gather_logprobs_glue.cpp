// gather_logprobs on CPU: argument checks and allocation. The row loops live in
// cpu/kernels/gather_logprobs_kernel.cpp, compiled once per instruction set.
#include "common.h"
#include "gather_args.h"
#include "cpu/kernels/kernels.h"

#include <torch/library.h>

#include <cmath>
#include <limits>

namespace pyppo {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_logprobs_cpu(const at::Tensor& logits, const at::Tensor& labels,
                                                                  const std::optional<at::Tensor>& mask,
                                                                  double temperature, int64_t ignore_index,
                                                                  bool return_entropy) {
  GatherInputs p = prepare_gather(logits, labels, mask, temperature, ignore_index);
  auto opts = logits.options().dtype(out_dtype(logits));
  at::Tensor logprobs = at::empty({p.N}, opts);
  at::Tensor lse = at::empty({p.N}, opts);
  at::Tensor entropy = return_entropy ? at::empty({p.N}, opts) : at::empty({0}, opts);
  if (p.N > 0) {
    cpu::GatherFwdArgs a;
    a.dtype = p.logits.scalar_type();
    a.logits = p.logits.const_data_ptr();
    a.row_stride = p.logits.stride(0);
    a.N = p.N;
    a.V = p.V;
    a.labels = p.labels.const_data_ptr<int64_t>();
    a.mask = p.mask.defined() ? p.mask.const_data_ptr<bool>() : nullptr;
    a.ignore_index = ignore_index;
    a.temperature = temperature;
    a.logprobs = logprobs.data_ptr();
    a.lse = lse.data_ptr();
    a.entropy = return_entropy ? entropy.data_ptr() : nullptr;
    cpu::cpu_kernels().gather_fwd(a);
  }
  auto shape = labels.sizes();
  return {logprobs.view(shape), return_entropy ? entropy.view(shape) : entropy, lse.view(shape)};
}

at::Tensor gather_logprobs_backward_cpu(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                                        const at::Tensor& logits, const at::Tensor& labels,
                                        const std::optional<at::Tensor>& mask, const at::Tensor& lse,
                                        const std::optional<at::Tensor>& entropy, double temperature,
                                        int64_t ignore_index) {
  GatherBackwardInputs b =
      prepare_gather_backward(grad_logprobs, grad_entropy, logits, labels, mask, lse, entropy, temperature, ignore_index);
  const GatherInputs& p = b.fwd;
  at::Tensor grad = at::empty({p.N, p.V}, logits.options().memory_format(at::MemoryFormat::Contiguous));
  if (p.N > 0) {
    cpu::GatherBwdArgs a;
    a.dtype = p.logits.scalar_type();
    a.logits = p.logits.const_data_ptr();
    a.row_stride = p.logits.stride(0);
    a.N = p.N;
    a.V = p.V;
    a.labels = p.labels.const_data_ptr<int64_t>();
    a.mask = p.mask.defined() ? p.mask.const_data_ptr<bool>() : nullptr;
    a.ignore_index = ignore_index;
    a.temperature = temperature;
    a.grad_logprobs = b.grad_logprobs.const_data_ptr();
    a.grad_entropy = b.grad_entropy.defined() ? b.grad_entropy.const_data_ptr() : nullptr;
    a.lse = b.lse.const_data_ptr();
    a.entropy = b.entropy.defined() ? b.entropy.const_data_ptr() : nullptr;
    a.grad_logits = grad.data_ptr();
    cpu::cpu_kernels().gather_bwd(a);
  }
  return grad.view(logits.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("gather_logprobs", &gather_logprobs_cpu);
  m.impl("gather_logprobs_backward", &gather_logprobs_backward_cpu);
}

}  // namespace pyppo
