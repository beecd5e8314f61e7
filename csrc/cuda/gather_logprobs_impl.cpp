// gather_logprobs on CUDA: gather_logprobs_impl.h up to the launch, then one kernel launch on
// the current stream (kernels in kernels/gather_logprobs_kernel.cu), and the device side of the label
// range check that checks/gather_logprobs.h runs for every op taking labels.
//
// Host syncs. The label check is a few small device ops queued before the op's kernels, whose
// verdict (the first bad label's index) is copied into pinned host memory behind an event; the
// op waits for that event once, after queuing all its work (LabelCheck::finish), so the host
// never waits for the op's own kernels, and linear_logprobs / linear_ppo_loss wait once per
// call, not per chunk. While the stream is being captured into a CUDA graph nothing is read
// back: the kernels give a row with a bad label NaN outputs instead of reading out of bounds.
// A mask that is a 0/1 number tensor rather than bool costs one more sync
// (checks/common.h's as_bool_mask), and cannot be captured.
#include "cuda/impl_common.h"
#include "gather_logprobs_impl.h"

#include <torch/library.h>

namespace pyppo {
namespace {

using namespace cuda_impl;

class CudaLabelCheck final : public PendingLabelCheck {
 public:
  CudaLabelCheck(const char* op, const GatherInputs& g, int64_t ignore_index, cudaStream_t stream)
      : op_(op), labels_(g.labels), N_(g.N), V_(g.V), ignore_index_(ignore_index) {
    at::Tensor active = g.labels.ne(ignore_index);
    if (g.mask.defined()) active = active.logical_and(g.mask);
    const at::Tensor bad = g.labels.lt(0).logical_or(g.labels.ge(g.V)).logical_and(active);
    // The first bad index, or N when there is none.
    const at::Tensor first = at::where(bad, at::arange(g.N, g.labels.options()), g.N).amin();
    host_ = at::empty({}, g.labels.options().device(at::kCPU).pinned_memory(true));
    host_.copy_(first, /*non_blocking=*/true);
    check_launch(op, cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    check_launch(op, cudaEventRecord(done_, stream));
  }
  ~CudaLabelCheck() override {
    if (done_ != nullptr) cudaEventDestroy(done_);
  }

  void finish() override {
    const cudaError_t err = cudaEventSynchronize(done_);
    TORCH_CHECK(err == cudaSuccess, "pyppo.", op_, ": waiting for the label check failed: ", cudaGetErrorString(err));
    const int64_t i = host_.const_data_ptr<int64_t>()[0];
    if (i < N_) fail_label_range(op_, i, labels_[i].item<int64_t>(), V_, ignore_index_);
  }

 private:
  const char* op_;
  at::Tensor labels_, host_;
  int64_t N_, V_, ignore_index_;
  cudaEvent_t done_ = nullptr;
};

std::shared_ptr<PendingLabelCheck> cuda_label_check(const char* op, const GatherInputs& g, int64_t ignore_index) {
  const c10::cuda::CUDAGuard guard(g.labels.device());
  const cudaStream_t stream = current_stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_launch(op, cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) return nullptr;
  return std::make_shared<CudaLabelCheck>(op, g, ignore_index, stream);
}

// Installed when the library loads, before any op can run.
[[maybe_unused]] const bool kLabelCheckInstalled = (device_label_check() = &cuda_label_check, true);

template <typename Args>
Args kernel_args(const GatherInputs& p, int64_t ignore_index, double temperature) {
  Args k;
  k.dtype = dtype_of(p.logits);
  fill_gather_rows(k, p, ignore_index, temperature);
  k.stream = current_stream();
  return k;
}

struct CudaKernels {
  static void fwd(const GatherInputs& p, int64_t ignore_index, double temperature, LogprobsOutputs& out,
                  bool return_entropy) {
    const c10::cuda::CUDAGuard guard(p.logits.device());
    auto k = kernel_args<cuda::GatherFwdArgs>(p, ignore_index, temperature);
    k.logprobs = out.logprobs.mutable_data_ptr();
    k.entropy = return_entropy ? out.entropy.mutable_data_ptr() : nullptr;
    k.lse = out.lse.mutable_data_ptr();
    check_launch("gather_logprobs", cuda::launch_gather_logprobs_fwd(k));
  }

  static void bwd(const GatherBackwardInputs& b, int64_t ignore_index, double temperature, at::Tensor& grad) {
    const c10::cuda::CUDAGuard guard(b.fwd.logits.device());
    auto k = kernel_args<cuda::GatherBwdArgs>(b.fwd, ignore_index, temperature);
    fill_gather_saved(k, b);
    k.grad_logits = grad.mutable_data_ptr();
    check_launch("gather_logprobs_backward", cuda::launch_gather_logprobs_bwd(k));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) {
  m.impl("gather_logprobs", &gather_logprobs_impl<CudaKernels>);
  m.impl("gather_logprobs_backward", &gather_logprobs_backward_impl<CudaKernels>);
}

}  // namespace pyppo
