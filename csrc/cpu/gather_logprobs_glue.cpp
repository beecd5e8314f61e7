// gather_logprobs on CPU: the checks of args/gather_logprobs.h and the allocation. The row loops
// live in cpu/kernels/gather_logprobs_kernel.cpp, compiled once per instruction set.
#include "args/gather_logprobs.h"
#include "cpu/kernels/kernels.h"

#include <torch/library.h>

namespace pyppo {
namespace {

template <typename Args>
Args gather_kernel_args(const GatherInputs& p, int64_t ignore_index, double temperature) {
  Args a;
  a.dtype = p.logits.scalar_type();
  fill_gather_rows(a, p, ignore_index, temperature);
  return a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_logprobs_cpu(const at::Tensor& logits, const at::Tensor& labels,
                                                                  const std::optional<at::Tensor>& mask,
                                                                  double temperature, int64_t ignore_index,
                                                                  bool return_entropy) {
  GatherInputs p = prepare_gather(logits, labels, mask, temperature, ignore_index);
  LogprobsOutputs out = alloc_logprobs_outputs(labels, out_options(logits), return_entropy);
  if (p.N > 0) {
    auto a = gather_kernel_args<cpu::GatherFwdArgs>(p, ignore_index, temperature);
    a.logprobs = out.logprobs.data_ptr();
    a.lse = out.lse.data_ptr();
    a.entropy = return_entropy ? out.entropy.data_ptr() : nullptr;
    cpu::cpu_kernels().gather_fwd(a);
  }
  return out.tuple();
}

at::Tensor gather_logprobs_backward_cpu(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                                        const at::Tensor& logits, const at::Tensor& labels,
                                        const std::optional<at::Tensor>& mask, const at::Tensor& lse,
                                        const std::optional<at::Tensor>& entropy, double temperature,
                                        int64_t ignore_index) {
  GatherBackwardInputs b =
      prepare_gather_backward(grad_logprobs, grad_entropy, logits, labels, mask, lse, entropy, temperature, ignore_index);
  const GatherInputs& p = b.fwd;
  at::Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  if (p.N > 0) {
    auto a = gather_kernel_args<cpu::GatherBwdArgs>(p, ignore_index, temperature);
    a.grad_logprobs = b.grad_logprobs.const_data_ptr();
    a.grad_entropy = b.grad_entropy.defined() ? b.grad_entropy.const_data_ptr() : nullptr;
    a.lse = b.lse.const_data_ptr();
    a.entropy = b.entropy.defined() ? b.entropy.const_data_ptr() : nullptr;
    a.grad_logits = grad.data_ptr();
    cpu::cpu_kernels().gather_bwd(a);
  }
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("gather_logprobs", &gather_logprobs_cpu);
  m.impl("gather_logprobs_backward", &gather_logprobs_backward_cpu);
}

}  // namespace pyppo
