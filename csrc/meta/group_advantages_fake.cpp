// group_advantages on the Meta device, both overloads (see meta/gather_logprobs_fake.cpp for why):
// the checks of checks/group_advantages.h that need no data, and the output's shape.
#include "checks/group_advantages.h"

#include <torch/library.h>

namespace pyppo {
namespace {

at::Tensor group_advantages_meta(const at::Tensor& scores, const at::Tensor& response_mask,
                                 const at::Tensor& group_ids, c10::string_view estimator, double eps,
                                 bool /*std_normalize*/) {
  check_group_advantages(scores, response_mask, group_ids, estimator, eps);
  return at::empty_symint(response_mask.sym_sizes(), out_options(scores));
}

at::Tensor group_advantages_size_meta(const at::Tensor& scores, const at::Tensor& response_mask, int64_t group_size,
                                      c10::string_view estimator, double eps, bool /*std_normalize*/) {
  check_group_advantages(scores, response_mask, group_size, estimator, eps);
  return at::empty_symint(response_mask.sym_sizes(), out_options(scores));
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, Meta, m) {
  m.impl("group_advantages", &group_advantages_meta);
  m.impl("group_advantages.group_size", &group_advantages_size_meta);
}

}  // namespace pyppo
