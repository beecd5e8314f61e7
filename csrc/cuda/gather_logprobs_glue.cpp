// gather_logprobs on CUDA: gather_logprobs_glue.h up to the launch, then one kernel launch on
// the current stream (kernels in gather_logprobs_kernel.cu).
//
// Host syncs: validating the labels needs their values on the host, so each call does one
// device-to-host sync (`bad.any().item()`), plus one more when the mask is a 0/1 number
// tensor rather than bool (args/common.h's as_bool_mask). An error costs a few more, only then.
#include "cuda/glue.h"
#include "gather_logprobs_glue.h"

#include <torch/library.h>

namespace pyppo {
namespace {

using namespace cuda_glue;

template <typename Params>
Params kernel_params(const GatherInputs& p, int64_t ignore_index, double temperature) {
  Params k;
  k.dtype = dtype_of(p.logits);
  fill_gather_rows(k, p, ignore_index, temperature);
  k.stream = current_stream();
  return k;
}

struct CudaKernels {
  static void fwd(const GatherInputs& p, int64_t ignore_index, double temperature, LogprobsOutputs& out,
                  bool return_entropy) {
    const c10::cuda::CUDAGuard guard(p.logits.device());
    auto k = kernel_params<cuda::GatherFwdParams>(p, ignore_index, temperature);
    k.logprobs = out.logprobs.mutable_data_ptr();
    k.entropy = return_entropy ? out.entropy.mutable_data_ptr() : nullptr;
    k.lse = out.lse.mutable_data_ptr();
    check_launch("gather_logprobs", cuda::launch_gather_logprobs_fwd(k));
  }

  static void bwd(const GatherBackwardInputs& b, int64_t ignore_index, double temperature, at::Tensor& grad) {
    const c10::cuda::CUDAGuard guard(b.fwd.logits.device());
    auto k = kernel_params<cuda::GatherBwdParams>(b.fwd, ignore_index, temperature);
    fill_gather_saved(k, b);
    k.grad_logits = grad.mutable_data_ptr();
    check_launch("gather_logprobs_backward", cuda::launch_gather_logprobs_bwd(k));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) {
  m.impl("gather_logprobs", &gather_logprobs_glue<CudaKernels>);
  m.impl("gather_logprobs_backward", &gather_logprobs_backward_glue<CudaKernels>);
}

}  // namespace pyppo
