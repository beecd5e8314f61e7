// group_advantages on CPU, both overloads: the checks of checks/group_advantages.h (the group ids'
// range in a loop here, the scores' finiteness in the kernel's first pass), then the per-group
// statistics and the broadcast of cpu/kernels/group_advantages_kernel.cpp, compiled once per
// instruction set.
#include "checks/group_advantages.h"
#include "cpu/kernels/kernels.h"

#include <torch/library.h>

namespace pyppo {
namespace {

at::Tensor run_group_advantages(const GroupAdvantagesTensors& t, double eps, bool std_normalize) {
  cpu::GroupAdvantagesArgs a;
  a.dtype = t.scores.scalar_type();
  a.B = t.B;
  a.T = t.T;
  a.scores = t.scores.const_data_ptr();
  a.group_size = t.group_size;
  a.group_ids = t.group_ids.defined() ? t.group_ids.const_data_ptr<int64_t>() : nullptr;
  a.mask = t.mask.const_data_ptr<bool>();
  a.rloo = t.rloo;
  a.std_normalize = std_normalize;
  a.eps = eps;
  a.advantages = t.advantages.data_ptr();
  const int64_t bad = cpu::cpu_kernels().group_advantages(a);
  if (bad >= 0) {
    const double score = a.dtype == at::kDouble ? t.scores.const_data_ptr<double>()[bad]
                                                : static_cast<double>(t.scores.const_data_ptr<float>()[bad]);
    fail_non_finite_group_score(bad, score);
  }
  return t.advantages;
}

at::Tensor group_advantages_cpu(const at::Tensor& scores, const at::Tensor& response_mask,
                                const at::Tensor& group_ids, c10::string_view estimator, double eps,
                                bool std_normalize) {
  GroupAdvantagesTensors t = prepare_group_advantages(scores, response_mask, group_ids, estimator, eps);
  // Validated before any work, so the error names the first bad row; ids first, then scores.
  const int64_t* ids = t.group_ids.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < t.B; ++b)
    if (ids[b] < 0 || ids[b] >= t.B) fail_group_id_range(b, ids[b], t.B);
  return run_group_advantages(t, eps, std_normalize);
}

at::Tensor group_advantages_size_cpu(const at::Tensor& scores, const at::Tensor& response_mask, int64_t group_size,
                                     c10::string_view estimator, double eps, bool std_normalize) {
  return run_group_advantages(prepare_group_advantages(scores, response_mask, group_size, estimator, eps), eps,
                              std_normalize);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("group_advantages", &group_advantages_cpu);
  m.impl("group_advantages.group_size", &group_advantages_size_cpu);
}

}  // namespace pyppo
