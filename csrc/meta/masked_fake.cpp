// masked_mean, masked_var and masked_whiten on the Meta device (see meta/gather_logprobs_fake.cpp
// for why): the checks of checks/masked.h and the outputs' shapes. The counts of valid elements
// need the data, so "all masked" is raised only when the op runs.
#include "checks/masked.h"

#include <torch/library.h>

namespace pyppo {
namespace {

at::Tensor masked_mean_meta(const at::Tensor& x, const at::Tensor& mask, std::optional<int64_t> dim) {
  const std::optional<int64_t> d = check_masked_mean(x, mask, dim);
  if (!d.has_value()) return at::empty({}, out_options(x));
  return at::empty_symint(masked_mean_out_shape(x, *d), out_options(x));
}

at::Tensor masked_var_meta(const at::Tensor& x, const at::Tensor& mask, bool /*unbiased*/) {
  check_masked("masked_var", x, mask);
  return at::empty({}, out_options(x));
}

at::Tensor masked_whiten_meta(const at::Tensor& x, const at::Tensor& mask, bool /*shift_mean*/, bool /*unbiased*/,
                              double eps) {
  check_whiten_eps(eps);
  check_masked("masked_whiten", x, mask);
  return at::empty_symint(x.sym_sizes(), out_options(x));
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, Meta, m) {
  m.impl("masked_mean", &masked_mean_meta);
  m.impl("masked_var", &masked_var_meta);
  m.impl("masked_whiten", &masked_whiten_meta);
}

}  // namespace pyppo
