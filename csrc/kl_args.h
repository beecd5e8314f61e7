// Parsing of the estimator name and clamp bounds, shared by the CPU and CUDA glue.
#pragma once

#include "common.h"
#include "kl_estimators.h"

#include <c10/util/string_view.h>

#include <cmath>
#include <optional>

namespace pyppo {

inline KLEstimator parse_estimator(const char* op, c10::string_view name) {
  if (name == "k1") return KLEstimator::K1;
  if (name == "k2") return KLEstimator::K2;
  if (name == "k3") return KLEstimator::K3;
  if (name == "abs") return KLEstimator::Abs;
  TORCH_CHECK_VALUE(false, "pyppo.", op, ": estimator must be one of 'k1', 'k2', 'k3', 'abs', got '",
                    std::string(name.data(), name.size()), "'");
}

inline KLClamp make_clamp(const char* op, std::optional<double> lo, std::optional<double> hi) {
  KLClamp c;
  if (lo.has_value()) {
    TORCH_CHECK_VALUE(!std::isnan(*lo), "pyppo.", op, ": clamp lower bound is NaN");
    c.has_lo = true;
    c.lo = *lo;
  }
  if (hi.has_value()) {
    TORCH_CHECK_VALUE(!std::isnan(*hi), "pyppo.", op, ": clamp upper bound is NaN");
    c.has_hi = true;
    c.hi = *hi;
  }
  TORCH_CHECK_VALUE(!(c.has_lo && c.has_hi) || c.lo <= c.hi, "pyppo.", op, ": clamp must be (lo, hi) with lo <= hi, got (",
                    c.lo, ", ", c.hi, ")");
  return c;
}

}  // namespace pyppo
