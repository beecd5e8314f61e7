// ATen glue of gather_logprobs on CUDA: the checks of args/gather_logprobs.h, then one kernel
// launch on the current stream (kernels in gather_logprobs_kernel.cu).
//
// Host syncs: validating the labels needs their values on the host, so each call does one
// device-to-host sync (`bad.any().item()`), plus one more when the mask is a 0/1 number
// tensor rather than bool (args/common.h's as_bool_mask). An error costs a few more, only then.
#include "cuda/glue.h"
#include "args/gather_logprobs.h"

#include <torch/library.h>

namespace pyppo {
namespace {

using namespace cuda_glue;

template <typename Params>
Params gather_params(const GatherInputs& p, int64_t ignore_index, double temperature) {
  Params k;
  k.dtype = dtype_of(p.logits);
  fill_gather_rows(k, p, ignore_index, temperature);
  k.stream = current_stream();
  return k;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_logprobs_cuda(const at::Tensor& logits, const at::Tensor& labels,
                                                                   const std::optional<at::Tensor>& mask,
                                                                   double temperature, int64_t ignore_index,
                                                                   bool return_entropy) {
  GatherInputs p = prepare_gather(logits, labels, mask, temperature, ignore_index);
  const c10::cuda::CUDAGuard guard(logits.device());
  LogprobsOutputs out = alloc_logprobs_outputs(labels, out_options(logits), return_entropy);
  if (p.N > 0) {
    auto k = gather_params<cuda::GatherFwdParams>(p, ignore_index, temperature);
    k.logprobs = out.logprobs.mutable_data_ptr();
    k.entropy = return_entropy ? out.entropy.mutable_data_ptr() : nullptr;
    k.lse = out.lse.mutable_data_ptr();
    check_launch("gather_logprobs", cuda::launch_gather_logprobs_fwd(k));
  }
  return out.tuple();
}

at::Tensor gather_logprobs_backward_cuda(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                                         const at::Tensor& logits, const at::Tensor& labels,
                                         const std::optional<at::Tensor>& mask, const at::Tensor& lse,
                                         const std::optional<at::Tensor>& entropy, double temperature,
                                         int64_t ignore_index) {
  GatherBackwardInputs b =
      prepare_gather_backward(grad_logprobs, grad_entropy, logits, labels, mask, lse, entropy, temperature, ignore_index);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  if (b.fwd.N > 0) {
    auto k = gather_params<cuda::GatherBwdParams>(b.fwd, ignore_index, temperature);
    k.grad_logprobs = b.grad_logprobs.const_data_ptr();
    k.grad_entropy = ptr_or_null(b.grad_entropy);
    k.lse = b.lse.const_data_ptr();
    k.entropy = ptr_or_null(b.entropy);
    k.grad_logits = grad.mutable_data_ptr();
    check_launch("gather_logprobs_backward", cuda::launch_gather_logprobs_bwd(k));
  }
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) {
  m.impl("gather_logprobs", &gather_logprobs_cuda);
  m.impl("gather_logprobs_backward", &gather_logprobs_backward_cuda);
}

}  // namespace pyppo
