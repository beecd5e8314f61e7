// Per-token estimators of KL(pi || pi_ref) from the sampled token's log-probs
// (J. Schulman, "Approximating KL Divergence", 2020), with their derivative in logprobs.
// Plain C++ so the CPU and CUDA kernels share one definition.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#if defined(__CUDACC__)
#define PYPPO_HD __host__ __device__ __forceinline__
#else
#define PYPPO_HD inline
#endif

namespace pyppo {

enum class KLEstimator : int32_t { K1 = 0, K2 = 1, K3 = 2, Abs = 3 };

// Above this r, exp(r) overflows the type (exp(88.72) = FLT_MAX, exp(709.78) = DBL_MAX).
// The functions below are compiled into the per-ISA CPU kernels too (cpu/kernels/, built with
// -mavx2 / -mavx512f): an inline namespace per instruction set keeps those copies from being
// merged by the linker with the baseline one, which would run AVX-512 code on any CPU.
#if defined(CPU_CAPABILITY)
#define PYPPO_KL_ISA_NS CPU_CAPABILITY
#else
#define PYPPO_KL_ISA_NS baseline
#endif
inline namespace PYPPO_KL_ISA_NS {

template <typename T>
PYPPO_HD constexpr T k3_exp_bound() {
  return sizeof(T) == sizeof(double) ? T(709.0) : T(88.0);
}

struct KLClamp {
  bool has_lo = false, has_hi = false;
  double lo = 0, hi = 0;
};

template <typename T>
PYPPO_HD T kl_value(KLEstimator est, T lp, T ref, const KLClamp& c, bool* saturated) {
  // lp == ref (both -inf included: a token impossible under both policies) contributes 0.
  const T diff = lp == ref ? T(0) : lp - ref;
  T v;
  switch (est) {
    case KLEstimator::K1: v = diff; break;
    case KLEstimator::K2: v = T(0.5) * diff * diff; break;
    case KLEstimator::Abs: v = diff < T(0) ? -diff : diff; break;
    case KLEstimator::K3:
    default: {
      const T r = -diff;
      if (r > k3_exp_bound<T>()) {
        // exp(r) - r - 1 overflows the type: it is +inf (never inf - inf = NaN), which any
        // finite upper clamp saturates.
        v = std::numeric_limits<T>::infinity();
      } else {
        // r = -inf (ref = -inf) gives exp(r) - r = +inf, which is the right limit.
        v = std::exp(r) - r - T(1);
      }
    }
  }
  *saturated = false;
  if (c.has_lo && v < T(c.lo)) {
    *saturated = true;
    return T(c.lo);
  }
  if (c.has_hi && v > T(c.hi)) {
    *saturated = true;
    return T(c.hi);
  }
  return v;
}

// d kl / d logprobs; zero where the clamp saturates (as torch.clamp's gradient is).
template <typename T>
PYPPO_HD T kl_grad(KLEstimator est, T lp, T ref, const KLClamp& c) {
  bool sat = false;
  kl_value<T>(est, lp, ref, c, &sat);
  if (sat) return T(0);
  const T diff = lp == ref ? T(0) : lp - ref;
  switch (est) {
    case KLEstimator::K1: return T(1);
    case KLEstimator::K2: return diff;
    case KLEstimator::Abs: return diff > T(0) ? T(1) : (diff < T(0) ? T(-1) : T(0));
    case KLEstimator::K3:
    default: {
      const T r = -diff;
      if (r > k3_exp_bound<T>()) return -std::numeric_limits<T>::infinity();
      return T(1) - std::exp(r);
    }
  }
}

}  // inline namespace PYPPO_KL_ISA_NS
}  // namespace pyppo
