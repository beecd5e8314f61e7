// group_advantages: argument checks and messages, the parsing of the estimator name, and the
// inputs as the kernels read them. The two checks that read the data (every group id in
// [0, B), every score finite) are found differently on CPU (a loop) and CUDA (device
// reductions and one sync); both raise them through the functions here. See
// docs/ops.md#group_advantages.
#pragma once

#include "checks/common.h"

#include <c10/util/string_view.h>

#include <cmath>
#include <optional>
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

// The checks both overloads share, split where the ids overload checks group_ids in between:
// the mask and the scores, then eps and the estimator.
inline void check_group_rows(const at::Tensor& scores, const at::Tensor& response_mask) {
  const char* op = "group_advantages";
  check_2d(op, "response_mask", response_mask);
  check_mask_dtype(op, "response_mask", response_mask);
  check_per_row(op, "scores", scores, response_mask, "response_mask");
}

inline GroupEstimator check_group_options(c10::string_view estimator, double eps) {
  TORCH_CHECK_VALUE(eps >= 0 && std::isfinite(eps), "pyppo.group_advantages: eps must be a finite number >= 0, got ",
                    eps);
  return parse_group_estimator(estimator);
}

// Everything group_advantages checks without reading data (the Meta kernel's checks).
inline GroupEstimator check_group_advantages(const at::Tensor& scores, const at::Tensor& response_mask,
                                             const at::Tensor& group_ids, c10::string_view estimator,
                                             double eps) {
  const char* op = "group_advantages";
  check_group_rows(scores, response_mask);
  TORCH_CHECK_VALUE(group_ids.scalar_type() == at::kLong, "pyppo.group_advantages: group_ids must be int64, got ",
                    group_ids.scalar_type());
  check_same_device(op, "group_ids", group_ids, response_mask, "response_mask");
  TORCH_CHECK_VALUE(group_ids.dim() == 1 && group_ids.sym_size(0) == response_mask.sym_size(0),
                    "pyppo.group_advantages: group_ids must have shape [B] = [", response_mask.sym_size(0), "], got ",
                    group_ids.sym_sizes());
  return check_group_options(estimator, eps);
}

// The same for the group_size overload (groups of group_size consecutive rows). group_size is
// checked first and B's divisibility right after the mask's rank: the order in which the Python
// wrapper raised them before the overload existed. With a symbolic B (torch.compile, dynamic
// shapes) the divisibility is left to the CPU and CUDA kernels, which see the real B.
inline GroupEstimator check_group_advantages(const at::Tensor& scores, const at::Tensor& response_mask,
                                             int64_t group_size, c10::string_view estimator, double eps) {
  TORCH_CHECK_VALUE(group_size >= 1, "pyppo.group_advantages: group_size must be an int >= 1, got ", group_size);
  check_2d("group_advantages", "response_mask", response_mask);
  if (const std::optional<int64_t> B = response_mask.sym_size(0).maybe_as_int())
    TORCH_CHECK_VALUE(*B % group_size == 0, "pyppo.group_advantages: B = ", *B,
                      " rows are not a whole number of groups of group_size = ", group_size,
                      "; pass group_ids for groups of unequal sizes");
  check_group_rows(scores, response_mask);
  return check_group_options(estimator, eps);
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
// dtype; a bool mask) and its output, allocated. Either group_ids is defined (the ids overload)
// or group_size > 0 (groups of group_size consecutive rows).
struct GroupAdvantagesTensors {
  int64_t B = 0, T = 0;
  int64_t group_size = 0;
  bool rloo = false;
  at::Tensor scores, mask, group_ids;
  at::Tensor advantages;
};

namespace detail {
// No copy when the inputs already are what the kernels read: a float64 or float32 contiguous
// score vector and a contiguous bool mask pass through as they are.
inline GroupAdvantagesTensors group_inputs(GroupEstimator est, const at::Tensor& scores,
                                           const at::Tensor& response_mask) {
  GroupAdvantagesTensors g;
  g.B = response_mask.size(0);
  g.T = response_mask.size(1);
  g.rloo = est == GroupEstimator::Rloo;
  const at::ScalarType acc = out_dtype(scores);
  g.scores = scores.scalar_type() == acc ? scores.contiguous() : scores.to(acc).contiguous();
  g.mask = as_bool_mask("group_advantages", "response_mask", response_mask);
  g.advantages = at::empty({g.B, g.T}, g.scores.options());
  return g;
}
}  // namespace detail

inline GroupAdvantagesTensors prepare_group_advantages(const at::Tensor& scores, const at::Tensor& response_mask,
                                                       const at::Tensor& group_ids, c10::string_view estimator,
                                                       double eps) {
  const GroupEstimator est = check_group_advantages(scores, response_mask, group_ids, estimator, eps);
  GroupAdvantagesTensors g = detail::group_inputs(est, scores, response_mask);
  g.group_ids = group_ids.contiguous();
  return g;
}

inline GroupAdvantagesTensors prepare_group_advantages(const at::Tensor& scores, const at::Tensor& response_mask,
                                                       int64_t group_size, c10::string_view estimator, double eps) {
  const GroupEstimator est = check_group_advantages(scores, response_mask, group_size, estimator, eps);
  GroupAdvantagesTensors g = detail::group_inputs(est, scores, response_mask);
  g.group_size = group_size;
  return g;
}

}  // namespace pyppo
