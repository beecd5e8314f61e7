// masked_mean, masked_var and masked_whiten on CUDA (kernels in kernels/masked_kernel.cu), after
// the checks of checks/masked.h.
//
// Host syncs: the reductions run entirely on the device (mean and variance never leave it:
// masked_whiten reads them there). One device-to-host copy per call brings back what the data
// errors of checks/masked.h need (the count of valid elements, and for masked_whiten the variance), after
// every kernel is queued; plus one when the mask is a 0/1 number tensor rather than bool
// (checks/common.h's as_bool_mask). On an error the queued results are discarded.
#include "cuda/impl_common.h"
#include "checks/masked.h"

#include <torch/library.h>

#include <cmath>
#include <vector>

namespace pyppo {
namespace {

using namespace cuda_impl;

// Queues the sum/count (and, if with_var, the variance) kernels; returns stats[4] on the device.
at::Tensor queue_stats(const char* op, const MaskedInputs& p, bool with_var, bool unbiased) {
  const int64_t n = p.x.numel();
  auto dopts = p.x.options().dtype(at::kDouble);
  at::Tensor stats = at::empty({4}, dopts);
  at::Tensor partials = at::zeros({2 * cuda::masked_num_partials(n)}, dopts);
  cuda::MaskedStatsArgs k;
  k.is_double = p.x.scalar_type() == at::kDouble;
  k.n = n;
  k.x = p.x.const_data_ptr();
  k.mask = p.mask.const_data_ptr<bool>();
  k.partials = partials.mutable_data_ptr<double>();
  k.stats = stats.mutable_data_ptr<double>();
  k.unbiased = unbiased;
  k.stream = current_stream();
  check_launch(op, cuda::launch_masked_sum_count(k));
  if (with_var) check_launch(op, cuda::launch_masked_variance(k));
  return stats;
}

at::Tensor masked_mean_cuda(const at::Tensor& x, const at::Tensor& mask, std::optional<int64_t> dim) {
  const char* op = "masked_mean";
  const std::optional<int64_t> dd = check_masked_mean(x, mask, dim);
  MaskedInputs p = prepare_masked(op, x, mask);
  const c10::cuda::CUDAGuard guard(x.device());
  if (!dd.has_value()) {
    at::Tensor stats = queue_stats(op, p, /*with_var=*/false, /*unbiased=*/false);
    at::Tensor host = stats.cpu();  // the one sync
    check_masked_count(op, static_cast<int64_t>(host.const_data_ptr<double>()[1]), false, false);
    return stats.select(0, 2).to(p.x.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  }
  const int64_t d = *dd;
  MeanDimInputs md = prepare_mean_dim(p, x, d);
  const int64_t R = md.R;
  if (R > 0) {
    at::Tensor counts = at::empty({R}, p.x.options().dtype(at::kLong));
    cuda::MaskedMeanDimArgs k;
    k.is_double = p.x.scalar_type() == at::kDouble;
    k.R = R;
    k.L = md.L;
    k.x = md.x.const_data_ptr();
    k.mask = md.mask.const_data_ptr<bool>();
    k.out = md.out.mutable_data_ptr();
    k.counts = counts.mutable_data_ptr<int64_t>();
    k.stream = current_stream();
    check_launch(op, cuda::launch_masked_mean_dim(k));
    at::Tensor empty_slice = counts.eq(0);
    if (empty_slice.any().item<bool>()) {  // the one sync
      fail_all_masked_slice(empty_slice.nonzero().select(1, 0)[0].item<int64_t>(), d);
    }
  }
  return md.out;
}

at::Tensor masked_var_cuda(const at::Tensor& x, const at::Tensor& mask, bool unbiased) {
  const char* op = "masked_var";
  MaskedInputs p = prepare_masked(op, x, mask);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor stats = queue_stats(op, p, /*with_var=*/true, unbiased);
  at::Tensor host = stats.cpu();  // the one sync
  check_masked_count(op, static_cast<int64_t>(host.const_data_ptr<double>()[1]), true, unbiased);
  return stats.select(0, 3).to(p.x.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor masked_whiten_cuda(const at::Tensor& x, const at::Tensor& mask, bool shift_mean, bool unbiased, double eps) {
  const char* op = "masked_whiten";
  check_whiten_eps(eps);
  MaskedInputs p = prepare_masked(op, x, mask);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor stats = queue_stats(op, p, /*with_var=*/true, unbiased);
  at::Tensor out = at::empty(x.sizes(), p.x.options());
  cuda::MaskedWhitenArgs k;
  k.is_double = p.x.scalar_type() == at::kDouble;
  k.n = p.x.numel();
  k.x = p.x.const_data_ptr();
  k.mask = p.mask.const_data_ptr<bool>();
  k.stats = stats.const_data_ptr<double>();
  k.shift_mean = shift_mean;
  k.eps = eps;
  k.out = out.mutable_data_ptr();
  k.stream = current_stream();
  check_launch(op, cuda::launch_masked_whiten(k));
  at::Tensor host = stats.cpu();  // the one sync
  const double* h = host.const_data_ptr<double>();
  check_masked_count(op, static_cast<int64_t>(h[1]), true, unbiased);
  whiten_inv_std(h[3], eps);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CUDA, m) {
  m.impl("masked_mean", &masked_mean_cuda);
  m.impl("masked_var", &masked_var_cuda);
  m.impl("masked_whiten", &masked_whiten_cuda);
}

}  // namespace pyppo
