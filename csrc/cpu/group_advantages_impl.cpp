// group_advantages on CPU: the checks of checks/group_advantages.h (the two that read the data
// in one loop here), then the per-group statistics and the broadcast of
// cpu/kernels/group_advantages_kernel.cpp, compiled once per instruction set.
#include "checks/group_advantages.h"
#include "cpu/kernels/kernels.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>

namespace pyppo {
namespace {

at::Tensor group_advantages_cpu(const at::Tensor& scores, const at::Tensor& response_mask,
                                const at::Tensor& group_ids, c10::string_view estimator, double eps,
                                bool std_normalize) {
  GroupAdvantagesTensors t = prepare_group_advantages(scores, response_mask, group_ids, estimator, eps);
  // Validated before any work, so the error names the first bad row; ids first, then scores.
  const int64_t* ids = t.group_ids.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < t.B; ++b)
    if (ids[b] < 0 || ids[b] >= t.B) fail_group_id_range(b, ids[b], t.B);
  AT_DISPATCH_FLOATING_TYPES(t.scores.scalar_type(), "pyppo_group_advantages", [&] {
    const scalar_t* s = t.scores.const_data_ptr<scalar_t>();
    for (int64_t b = 0; b < t.B; ++b)
      if (!std::isfinite(s[b])) fail_non_finite_group_score(b, static_cast<double>(s[b]));
  });
  if (t.B > 0) {
    cpu::GroupAdvantagesArgs a;
    a.dtype = t.scores.scalar_type();
    a.B = t.B;
    a.T = t.T;
    a.scores = t.scores.const_data_ptr();
    a.group_ids = ids;
    a.mask = t.mask.const_data_ptr<bool>();
    a.rloo = t.rloo;
    a.std_normalize = std_normalize;
    a.eps = eps;
    a.advantages = t.advantages.data_ptr();
    cpu::cpu_kernels().group_advantages(a);
  }
  return t.advantages;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) { m.impl("group_advantages", &group_advantages_cpu); }

}  // namespace pyppo
