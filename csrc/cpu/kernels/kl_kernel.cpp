// kl_penalty forward and backward over a flat float array; compiled once per instruction set.
//
// Every element, the last partial vector included (a masked load), goes through the same
// vector code, so an element's result never depends on where it sits in the tensor: the
// estimate of a row is the same alone or inside any batch. float64 takes the scalar
// definitions of kl_estimators.h.
#include "cpu/kernels/kernels.h"
#include "cpu/kernels/row_softmax.h"
#include "kl_estimators.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <limits>

namespace pyppo {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrain = 65536;

// The estimate and a mask of the lanes where the clamp saturates.
inline Vec kl_vec(KLEstimator est, const Vec& a, const Vec& b, const KLArgs& k, Vec* saturated) {
  const Vec zero(0.f);
  // lp == ref (both -inf included) contributes 0, as in kl_value.
  const Vec d = Vec::blendv(a - b, zero, a == b);
  Vec v;
  switch (est) {
    case KLEstimator::K1: v = d; break;
    case KLEstimator::K2: v = Vec(0.5f) * d * d; break;
    case KLEstimator::Abs: v = d.abs(); break;
    case KLEstimator::K3:
    default: {
      const Vec r = zero - d;
      const Vec bound(k3_exp_bound<float>());
      // Past the bound exp(r) overflows: +inf (never inf - inf); below it the ordinary formula.
      v = vexp(at::vec::minimum(r, bound)) - r - Vec(1.f);
      v = Vec::blendv(v, Vec(std::numeric_limits<float>::infinity()), r > bound);
    }
  }
  Vec sat(0.f);
  if (k.has_lo) {
    const Vec lo(static_cast<float>(k.lo));
    sat = sat | (v < lo);
    v = Vec::blendv(v, lo, v < lo);
  }
  if (k.has_hi) {
    const Vec hi(static_cast<float>(k.hi));
    sat = sat | (v > hi);
    v = Vec::blendv(v, hi, v > hi);
  }
  *saturated = sat;
  return v;
}

inline Vec kl_grad_vec(KLEstimator est, const Vec& a, const Vec& b, const KLArgs& k) {
  const Vec zero(0.f), one(1.f);
  Vec sat;
  kl_vec(est, a, b, k, &sat);
  const Vec d = Vec::blendv(a - b, zero, a == b);
  Vec g;
  switch (est) {
    case KLEstimator::K1: g = one; break;
    case KLEstimator::K2: g = d; break;
    case KLEstimator::Abs: g = Vec::blendv(Vec::blendv(zero, one, d > zero), Vec(-1.f), d < zero); break;
    case KLEstimator::K3:
    default: {
      const Vec r = zero - d;
      const Vec bound(k3_exp_bound<float>());
      g = one - vexp(at::vec::minimum(r, bound));
      g = Vec::blendv(g, Vec(-std::numeric_limits<float>::infinity()), r > bound);
    }
  }
  return Vec::blendv(g, zero, sat);
}

template <typename F>
void for_each_vec(int64_t n, F&& f) {
  constexpr int64_t W = Vec::size();
  at::parallel_for(0, (n + W - 1) / W, kGrain / W, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) f(v * W, std::min<int64_t>(W, n - v * W));
  });
}

KLClamp clamp_of(const KLArgs& k) {
  KLClamp c;
  c.has_lo = k.has_lo, c.has_hi = k.has_hi, c.lo = k.lo, c.hi = k.hi;
  return c;
}

// float64 takes the scalar definitions, element by element: o[i] = f(i, logprobs[i], ref[i]).
template <typename F>
void for_each_double(const KLArgs& k, F&& f) {
  const double* a = static_cast<const double*>(k.logprobs);
  const double* b = static_cast<const double*>(k.ref_logprobs);
  double* o = static_cast<double*>(k.out);
  at::parallel_for(0, k.n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = f(i, a[i], b[i]);
  });
}

}  // namespace

void kl_fwd(const KLArgs& k) {
  const auto est = static_cast<KLEstimator>(k.estimator);
  if (k.dtype == c10::ScalarType::Double) {
    const KLClamp c = clamp_of(k);
    for_each_double(k, [&](int64_t, double a, double b) {
      bool sat;
      return kl_value<double>(est, a, b, c, &sat);
    });
    return;
  }
  TORCH_CHECK(k.dtype == c10::ScalarType::Float, "pyppo.kl_penalty: unsupported accumulation dtype ", k.dtype);
  const float* a = static_cast<const float*>(k.logprobs);
  const float* b = static_cast<const float*>(k.ref_logprobs);
  float* o = static_cast<float*>(k.out);
  for_each_vec(k.n, [&](int64_t i, int64_t cnt) {
    Vec sat;
    kl_vec(est, Vec::loadu(a + i, cnt), Vec::loadu(b + i, cnt), k, &sat).store(o + i, cnt);
  });
}

void kl_bwd(const KLArgs& k) {
  const auto est = static_cast<KLEstimator>(k.estimator);
  if (k.dtype == c10::ScalarType::Double) {
    const KLClamp c = clamp_of(k);
    const double* g = static_cast<const double*>(k.grad);
    for_each_double(k, [&](int64_t i, double a, double b) {
      return g[i] == 0.0 ? 0.0 : g[i] * kl_grad<double>(est, a, b, c);
    });
    return;
  }
  TORCH_CHECK(k.dtype == c10::ScalarType::Float, "pyppo.kl_penalty_backward: unsupported accumulation dtype ", k.dtype);
  const float* g = static_cast<const float*>(k.grad);
  const float* a = static_cast<const float*>(k.logprobs);
  const float* b = static_cast<const float*>(k.ref_logprobs);
  float* o = static_cast<float*>(k.out);
  const Vec zero(0.f);
  for_each_vec(k.n, [&](int64_t i, int64_t cnt) {
    const Vec gv = Vec::loadu(g + i, cnt);
    // A zero upstream gradient stays zero even where the local derivative is infinite.
    Vec::blendv(gv * kl_grad_vec(est, Vec::loadu(a + i, cnt), Vec::loadu(b + i, cnt), k), zero, gv == zero)
        .store(o + i, cnt);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace pyppo
