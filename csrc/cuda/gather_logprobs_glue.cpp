// ATen glue of gather_logprobs on CUDA: the CPU kernel's checks and messages, then one kernel
// launch on the current stream (kernels in gather_logprobs_kernel.cu).
//
// Host syncs: validating the labels needs their values on the host, so each call does one
// device-to-host sync (`bad.any().item()`), plus one more when the mask is a 0/1 number
// tensor rather than bool (common.h's as_bool_mask). An error costs a few more, only then.
#include "cuda/glue.h"
#include "gather_args.h"

#include <torch/library.h>

#include <cmath>

namespace pyppo {
namespace {

using namespace cuda_glue;

constexpr const char* kOp = "gather_logprobs";

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_logprobs_cuda(const at::Tensor& logits, const at::Tensor& labels,
                                                                   const std::optional<at::Tensor>& mask,
                                                                   double temperature, int64_t ignore_index,
                                                                   bool return_entropy) {
  GatherInputs p = prepare_gather(logits, labels, mask, temperature, ignore_index);
  const c10::cuda::CUDAGuard guard(logits.device());
  auto opts = logits.options().dtype(out_dtype(logits));
  at::Tensor logprobs = at::empty({p.N}, opts);
  at::Tensor lse = at::empty({p.N}, opts);
  at::Tensor entropy = return_entropy ? at::empty({p.N}, opts) : at::empty({0}, opts);
  if (p.N > 0) {
    cuda::GatherFwdParams k;
    k.logits = p.logits.const_data_ptr();
    k.dtype = dtype_of(p.logits);
    k.N = p.N;
    k.V = p.V;
    k.row_stride = p.logits.stride(0);
    k.labels = p.labels.const_data_ptr<int64_t>();
    k.mask = ptr_or_null<bool>(p.mask);
    k.ignore_index = ignore_index;
    k.temperature = temperature;
    k.logprobs = logprobs.mutable_data_ptr();
    k.entropy = return_entropy ? entropy.mutable_data_ptr() : nullptr;
    k.lse = lse.mutable_data_ptr();
    k.stream = current_stream();
    check_launch(kOp, cuda::launch_gather_logprobs_fwd(k));
  }
  auto shape = labels.sizes();
  return {logprobs.view(shape), return_entropy ? entropy.view(shape) : entropy, lse.view(shape)};
}

at::Tensor gather_logprobs_backward_cuda(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                                         const at::Tensor& logits, const at::Tensor& labels,
                                         const std::optional<at::Tensor>& mask, const at::Tensor& lse,
                                         const std::optional<at::Tensor>& entropy, double temperature,
                                         int64_t ignore_index) {
  GatherBackwardInputs b =
      prepare_gather_backward(grad_logprobs, grad_entropy, logits, labels, mask, lse, entropy, temperature, ignore_index);
  const GatherInputs& p = b.fwd;
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor grad = at::empty({p.N, p.V}, logits.options());
  if (p.N > 0) {
    cuda::GatherBwdParams k;
    k.logits = p.logits.const_data_ptr();
    k.dtype = dtype_of(p.logits);
    k.N = p.N;
    k.V = p.V;
    k.row_stride = p.logits.stride(0);
    k.labels = p.labels.const_data_ptr<int64_t>();
    k.mask = ptr_or_null<bool>(p.mask);
    k.ignore_index = ignore_index;
    k.temperature = temperature;
    k.grad_logprobs = b.grad_logprobs.const_data_ptr();
    k.grad_entropy = b.grad_entropy.defined() ? b.grad_entropy.const_data_ptr() : nullptr;
    k.lse = b.lse.const_data_ptr();
    k.entropy = b.entropy.defined() ? b.entropy.const_data_ptr() : nullptr;
    k.grad_logits = grad.mutable_data_ptr();
    k.stream = current_stream();
    check_launch("gather_logprobs_backward", cuda::launch_gather_logprobs_bwd(k));
  }
  return grad.view(logits.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) {
  m.impl("gather_logprobs", &gather_logprobs_cuda);
  m.impl("gather_logprobs_backward", &gather_logprobs_backward_cuda);
}

}  // namespace pyppo
