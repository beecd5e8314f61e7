// group_advantages: argument checks and messages, the parsing of the estimator name, and the
// inputs as the kernels read them. The two checks that read the data (every group id in
// [0, B), every score finite) are found differently on CPU (a loop) and CUDA (device
// reductions and one sync); both raise them through the functions here. See
// docs/ops.md#group_advantages.
#pragma once

#include "checks/common.h"

#include <c10/util/string_view.h>

#include <cmath>
#include <string>

namespace pyppo {

// The estimators the op accepts; GroupAdvantagesArgs carries the choice as `rloo`.
enum class GroupEstimator { Grpo, Rloo };

inline GroupEstimator parse_group_estimator(c10::string_view name) {
  if (name == "grpo") return GroupEstimator::Grpo;
  if (name == "rloo") return GroupEstimator::Rloo;
  TORCH_CHECK_VALUE(false, "pyppo.group_advantages: estimator must be one of 'grpo', 'rloo', got '",
                    std::string(name.data(), name.size()), "'");
}

// Everything group_advantages checks without reading data (the Meta kernel's checks).
inline GroupEstimator check_group_advantages(const at::Tensor& scores, const at::Tensor& response_mask,
                                             const at::Tensor& group_ids, c10::string_view estimator,
                                             double eps) {
  const char* op = "group_advantages";
  check_2d(op, "response_mask", response_mask);
  check_mask_dtype(op, "response_mask", response_mask);
  check_per_row(op, "scores", scores, response_mask, "response_mask");
  TORCH_CHECK_VALUE(group_ids.scalar_type() == at::kLong, "pyppo.group_advantages: group_ids must be int64, got ",
                    group_ids.scalar_type());
  check_same_device(op, "group_ids", group_ids, response_mask, "response_mask");
  TORCH_CHECK_VALUE(group_ids.dim() == 1 && group_ids.sym_size(0) == response_mask.sym_size(0),
                    "pyppo.group_advantages: group_ids must have shape [B] = [", response_mask.sym_size(0), "], got ",
                    group_ids.sym_sizes());
  TORCH_CHECK_VALUE(eps >= 0 && std::isfinite(eps), "pyppo.group_advantages: eps must be a finite number >= 0, got ",
                    eps);
  return parse_group_estimator(estimator);
}

[[noreturn]] inline void fail_group_id_range(int64_t row, int64_t id, int64_t B) {
  TORCH_CHECK_VALUE(false, "pyppo.group_advantages: group_ids[", row, "] = ", id, " is outside [0, B) = [0, ", B,
                    "); number the groups 0, 1, ... (torch.unique(..., return_inverse=True) does)");
  __builtin_unreachable();
}

[[noreturn]] inline void fail_non_finite_group_score(int64_t row, double score) {
  TORCH_CHECK_VALUE(false, "pyppo.group_advantages: scores[", row, "] = ", score, " is not finite");
  __builtin_unreachable();
}

// group_advantages' inputs as the kernels read them (contiguous; scores in the accumulation
// dtype; a bool mask) and its output, allocated.
struct GroupAdvantagesTensors {
  int64_t B = 0, T = 0;
  bool rloo = false;
  at::Tensor scores, mask, group_ids;
  at::Tensor advantages;
};

inline GroupAdvantagesTensors prepare_group_advantages(const at::Tensor& scores, const at::Tensor& response_mask,
                                                       const at::Tensor& group_ids, c10::string_view estimator,
                                                       double eps) {
  const GroupEstimator est = check_group_advantages(scores, response_mask, group_ids, estimator, eps);
  GroupAdvantagesTensors g;
  g.B = response_mask.size(0);
  g.T = response_mask.size(1);
  g.rloo = est == GroupEstimator::Rloo;
  g.scores = scores.to(out_dtype(scores)).contiguous();
  g.mask = as_bool_mask("group_advantages", "response_mask", response_mask);
  g.group_ids = group_ids.contiguous();
  g.advantages = at::empty({g.B, g.T}, g.scores.options());
  return g;
}

}  // namespace pyppo
