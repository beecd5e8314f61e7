// group_advantages on CUDA, both overloads (kernels in kernels/group_advantages_kernel.cu): the
// checks of checks/group_advantages.h, then one launch.
//
// Host syncs: the two data errors of checks/group_advantages.h (a group id outside [0, B), a
// non-finite score) are found by device reductions read back together (one sync), plus one
// more when response_mask is a 0/1 number tensor rather than bool (checks/common.h's
// as_bool_mask). While the stream is being captured into a CUDA graph nothing is read back:
// the kernel only compares ids (an out-of-range id is then just a group label) and a
// non-finite score makes its group's advantages non-finite.
#include "cuda/impl_common.h"
#include "checks/group_advantages.h"

#include <torch/library.h>

#include <vector>

namespace pyppo {
namespace {

using namespace cuda_impl;

// The CPU impl's data errors, in its order: ids first (with the ids overload), then scores.
void check_group_data(const GroupAdvantagesTensors& t) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_launch("group_advantages", cudaStreamIsCapturing(current_stream(), &status));
  if (status != cudaStreamCaptureStatusNone || t.B == 0) return;
  const bool with_ids = t.group_ids.defined();
  const at::Tensor finite = at::isfinite(t.scores);
  at::Tensor bad_id;
  std::vector<at::Tensor> parts{finite.all()};
  if (with_ids) {
    bad_id = t.group_ids.lt(0).logical_or(t.group_ids.ge(t.B));
    parts.push_back(bad_id.any());
  }
  const at::Tensor flags = at::stack(parts).cpu();
  const bool* f = flags.const_data_ptr<bool>();
  if (with_ids && f[1]) {
    const int64_t b = bad_id.nonzero().select(1, 0)[0].item<int64_t>();
    fail_group_id_range(b, t.group_ids[b].item<int64_t>(), t.B);
  }
  if (!f[0]) {
    const int64_t b = finite.logical_not().nonzero().select(1, 0)[0].item<int64_t>();
    fail_non_finite_group_score(b, t.scores[b].item<double>());
  }
}

at::Tensor run_group_advantages(const GroupAdvantagesTensors& t, const at::Device device, double eps,
                                bool std_normalize) {
  const c10::cuda::CUDAGuard guard(device);
  check_group_data(t);
  if (t.B > 0) {
    cuda::GroupAdvantagesArgs k;
    k.is_double = t.scores.scalar_type() == at::kDouble;
    k.B = t.B;
    k.T = t.T;
    k.scores = t.scores.const_data_ptr();
    k.group_size = t.group_size;
    k.group_ids = t.group_ids.defined() ? t.group_ids.const_data_ptr<int64_t>() : nullptr;
    k.mask = t.mask.const_data_ptr<bool>();
    k.rloo = t.rloo;
    k.std_normalize = std_normalize;
    k.eps = eps;
    k.advantages = t.advantages.mutable_data_ptr();
    k.stream = current_stream();
    check_launch("group_advantages", cuda::launch_group_advantages(k));
  }
  return t.advantages;
}

at::Tensor group_advantages_cuda(const at::Tensor& scores, const at::Tensor& response_mask,
                                 const at::Tensor& group_ids, c10::string_view estimator, double eps,
                                 bool std_normalize) {
  return run_group_advantages(prepare_group_advantages(scores, response_mask, group_ids, estimator, eps),
                              response_mask.device(), eps, std_normalize);
}

at::Tensor group_advantages_size_cuda(const at::Tensor& scores, const at::Tensor& response_mask, int64_t group_size,
                                      c10::string_view estimator, double eps, bool std_normalize) {
  return run_group_advantages(prepare_group_advantages(scores, response_mask, group_size, estimator, eps),
                              response_mask.device(), eps, std_normalize);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) {
  m.impl("group_advantages", &group_advantages_cuda);
  m.impl("group_advantages.group_size", &group_advantages_size_cuda);
}

}  // namespace pyppo
