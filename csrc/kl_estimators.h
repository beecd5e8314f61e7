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

// The functions below are compiled into the per-ISA CPU kernels too (cpu/kernels/, built with
// -mavx2 / -mavx512f): an inline namespace per instruction set keeps those copies from being
// merged by the linker with the baseline one, which would run AVX-512 code on any CPU.
#if defined(CPU_CAPABILITY)
#define PYPPO_KL_ISA_NS CPU_CAPABILITY
#else
#define PYPPO_KL_ISA_NS baseline
#endif
inline namespace PYPPO_KL_ISA_NS {

// k3 = exp(x) - 1 - x, x = ref - lp, is x^2 * P(x) with P(x) = sum_k x^k / (k+2)!. Evaluating
// it as written rounds at the scale of 1 (exp(x) ~ 1), which for small |x| is most of k3 (or all
// of it). So on |x| <= 1 pyppo sums the series (relative error a few ulps, like a product;
// terms up to x^kLast, the first one left out under 6e-9 (float) / 1.2e-18 (double) of
// P(x) >= 1/e), and beyond evaluates expm1(x) - x in double (the CPU kernels' vector code:
// exp(x) - 1 - x, as exact there), where the cancellation costs at most a factor of about 4:
// float results there are rounded once from a nearly exact value.
template <typename T>
struct K3Series;
template <>
struct K3Series<float> {
  static constexpr int kLast = 9;
};
template <>
struct K3Series<double> {
  static constexpr int kLast = 17;
};

// 1/n! (exact n! for n <= 20, one rounding): the same constant on every device.
PYPPO_HD constexpr double inv_factorial(int n) {
  double f = 1.0;
  for (int i = 2; i <= n; ++i) f *= i;
  return 1.0 / f;
}

// A multiply and an add that nvcc may not fuse into an FMA: the series then rounds the same way
// on the GPU as in the CPU kernels (built with -ffp-contract=off), bit for bit.
template <typename T>
PYPPO_HD T mul_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == sizeof(float)) return __fmul_rn(a, b);
  else return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
template <typename T>
PYPPO_HD T add_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == sizeof(float)) return __fadd_rn(a, b);
  else return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// exp(x) - 1 to within an ulp: CUDA's expm1, the C library's on the host.
PYPPO_HD double expm1_of(double x) {
#if defined(__CUDA_ARCH__)
  return ::expm1(x);
#else
  return std::expm1(x);
#endif
}

// A double rounded to T (float or double), +inf where it rounds past T's range: IEEE's rounding,
// which a plain conversion of an out-of-range double to float leaves undefined in C++.
template <typename T>
PYPPO_HD T round_to(double v) {
  if constexpr (sizeof(T) == sizeof(double)) {
    return v;
  } else {
    // FLT_MAX plus half its ulp: the first double that rounds to +inf.
    return v >= 0x1.ffffffp+127 ? std::numeric_limits<T>::infinity() : T(v);
  }
}

// Horner's steps p = p * x + 1/(k+2)! for k = K, K-1, ..., 0, each constant folded at compile
// time (a loop over k leaves nvcc computing the factorials at run time).
template <int K, typename T>
PYPPO_HD T k3_horner(T p, T x) {
  constexpr double c = inv_factorial(K + 2);
  p = add_rn(mul_rn(p, x), T(c));
  if constexpr (K == 0) {
    return p;
  } else {
    return k3_horner<K - 1>(p, x);
  }
}

// x^2 * P(x) by Horner, for |x| <= 1. The CPU kernels' vector copy performs the same operations
// in the same order.
template <typename T>
PYPPO_HD T k3_series(T x) {
  constexpr int kLast = K3Series<T>::kLast;
  constexpr double c_last = inv_factorial(kLast + 2);
  const T p = k3_horner<kLast - 1>(T(c_last), x);
  return mul_rn(mul_rn(x, x), p);
}

// k3 = exp(x) - 1 - x (returned) and exp(x) - 1 (*em1: minus k3's derivative in logprobs) at
// x = ref - lp, both within a few ulps of their values at the exact difference of the inputs.
// Where |x| <= 1 the rounding of ref - lp itself is put back: the difference is exactly
// x + x_lo (Knuth's TwoSum), and k3(x + x_lo) = k3(x) + (exp(x) - 1) x_lo to far below an ulp.
// Past exp's range (x > 88.72 in float, 709.78 in double) both are +inf, never inf - inf = NaN;
// x = -inf (ref = -inf) gives +inf and -1, the right limits; NaN stays NaN. lp == ref (both -inf
// included: a token impossible under both policies) gives 0.
template <typename T>
PYPPO_HD T k3_value(T lp, T ref, T* em1) {
  if (lp == ref) {
    *em1 = T(0);
    return T(0);
  }
  const T x = ref - lp;
  if (x >= T(-1) && x <= T(1)) {
    const T z = x - ref;
    const T x_lo = (ref - (x - z)) + ((T(0) - lp) - z);
    const T f = k3_series(x);
    const T e = add_rn(x, f);
    *em1 = add_rn(e, mul_rn(add_rn(e, T(1)), x_lo));
    return add_rn(f, mul_rn(e, x_lo));
  }
  // In double, where the difference of two floats is exact (of two doubles: one rounding).
  const double xd = double(ref) - double(lp);
  const double e = expm1_of(xd);
  *em1 = round_to<T>(e);
  return round_to<T>(e == std::numeric_limits<double>::infinity() ? e : e - xd);
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
      T em1;
      v = k3_value<T>(lp, ref, &em1);
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
      // 1 - exp(x) = -expm1(x): no rounding at the scale of 1 for small |x|.
      T em1;
      k3_value<T>(lp, ref, &em1);
      return T(0) - em1;
    }
  }
}

}  // inline namespace PYPPO_KL_ISA_NS
}  // namespace pyppo
