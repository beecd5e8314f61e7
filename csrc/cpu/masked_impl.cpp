// masked_mean, masked_var and masked_whiten on CPU: the checks of checks/masked.h, then the
// reductions of cpu/kernels/masked_kernel.cpp, compiled once per instruction set.
#include "checks/masked.h"
#include "cpu/kernels/kernels.h"

#include <torch/library.h>

namespace pyppo {
namespace {

cpu::MaskedArgs kernel_args(const at::Tensor& x, const at::Tensor& mask) {
  return {x.scalar_type(), x.const_data_ptr(), mask.const_data_ptr<bool>(), x.numel()};
}

// Mean and variance of the masked-in elements; errors (not NaN) when there are too few.
std::pair<double, double> mean_var(const char* op, const MaskedInputs& p, bool unbiased) {
  const cpu::MaskedArgs a = kernel_args(p.x, p.mask);
  const cpu::MaskedMoments mo = cpu::cpu_kernels().masked_sum(a);
  check_masked_count(op, mo.count, true, unbiased);
  const double mean = mo.sum / static_cast<double>(mo.count);
  const double var =
      cpu::cpu_kernels().masked_sq_dev(a, mean) / static_cast<double>(unbiased ? mo.count - 1 : mo.count);
  return {mean, var};
}

at::Tensor masked_mean_cpu(const at::Tensor& x, const at::Tensor& mask, std::optional<int64_t> dim) {
  const char* op = "masked_mean";
  const std::optional<int64_t> d = check_masked_mean(x, mask, dim);
  MaskedInputs p = prepare_masked(op, x, mask);
  if (!d.has_value()) {
    const cpu::MaskedMoments mo = cpu::cpu_kernels().masked_sum(kernel_args(p.x, p.mask));
    check_masked_count(op, mo.count, false, false);
    return at::full({}, mo.sum / static_cast<double>(mo.count), p.x.options());
  }
  MeanDimInputs md = prepare_mean_dim(p, x, *d);
  if (md.R > 0) {
    const int64_t empty = cpu::cpu_kernels().masked_mean_rows(kernel_args(md.x, md.mask), md.L, md.out.data_ptr());
    if (empty >= 0) fail_all_masked_slice(empty, *d);
  }
  return md.out;
}

at::Tensor masked_var_cpu(const at::Tensor& x, const at::Tensor& mask, bool unbiased) {
  MaskedInputs p = prepare_masked("masked_var", x, mask);
  return at::full({}, mean_var("masked_var", p, unbiased).second, p.x.options());
}

at::Tensor masked_whiten_cpu(const at::Tensor& x, const at::Tensor& mask, bool shift_mean, bool unbiased, double eps) {
  const char* op = "masked_whiten";
  check_whiten_eps(eps);
  MaskedInputs p = prepare_masked(op, x, mask);
  auto [mean, var] = mean_var(op, p, unbiased);
  const double inv_std = whiten_inv_std(var, eps);
  at::Tensor out = at::empty(x.sizes(), p.x.options());
  cpu::cpu_kernels().masked_whiten(kernel_args(p.x, p.mask), mean, inv_std, shift_mean ? 0.0 : mean, out.data_ptr());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("masked_mean", &masked_mean_cpu);
  m.impl("masked_var", &masked_var_cpu);
  m.impl("masked_whiten", &masked_whiten_cpu);
}

}  // namespace pyppo
