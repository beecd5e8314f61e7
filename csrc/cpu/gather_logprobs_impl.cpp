// gather_logprobs on CPU: gather_logprobs_impl.h up to the launch, then the row loops of
// cpu/kernels/gather_logprobs_kernel.cpp, compiled once per instruction set.
#include "gather_logprobs_impl.h"
#include "cpu/kernels/kernels.h"

#include <torch/library.h>

namespace pyppo {
namespace {

template <typename Args>
Args kernel_args(const GatherInputs& p, int64_t ignore_index, double temperature) {
  Args a;
  a.dtype = p.logits.scalar_type();
  fill_gather_rows(a, p, ignore_index, temperature);
  return a;
}

struct CpuKernels {
  static void fwd(const GatherInputs& p, int64_t ignore_index, double temperature, LogprobsOutputs& out,
                  bool return_entropy) {
    auto a = kernel_args<cpu::GatherFwdArgs>(p, ignore_index, temperature);
    a.logprobs = out.logprobs.data_ptr();
    a.lse = out.lse.data_ptr();
    a.entropy = return_entropy ? out.entropy.data_ptr() : nullptr;
    cpu::cpu_kernels().gather_fwd(a);
  }

  static void bwd(const GatherBackwardInputs& b, int64_t ignore_index, double temperature, at::Tensor& grad) {
    auto a = kernel_args<cpu::GatherBwdArgs>(b.fwd, ignore_index, temperature);
    fill_gather_saved(a, b);
    a.grad_logits = grad.data_ptr();
    cpu::cpu_kernels().gather_bwd(a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("gather_logprobs", &gather_logprobs_impl<CpuKernels>);
  m.impl("gather_logprobs_backward", &gather_logprobs_backward_impl<CpuKernels>);
}

}  // namespace pyppo
