// Vectorised per-row softmax statistics and gradient. Included only by the per-ISA kernel
// files: everything here lives in namespace CPU_CAPABILITY (DEFAULT / AVX2 / AVX512), so the
// copies compiled for different instruction sets never merge at link time.
//
// A row is walked in blocks of kRowBlock elements small enough to stay in L1: each block is
// read from memory once (converted to float on the way for bf16/fp16), its maximum taken,
// the running sums rescaled once if the maximum grew (one scalar exp per block, not one per
// element as a per-element online softmax needs), then exp'd from L1. The logits cross the
// memory bus once and nothing of size V is allocated.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace pyppo {
namespace cpu {
namespace CPU_CAPABILITY {

constexpr int64_t kRowBlock = 2048;

template <typename acc_t>
struct RowStats {
  acc_t lse;      // logsumexp(z / tau)
  acc_t entropy;  // -sum p log p, p = softmax(z / tau); only when asked for
};

template <typename T>
constexpr bool is_reduced_v = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// exp with <= 20 ulp error (what ATen's own softmax uses on AVX2/AVX512); exact std::exp on
// the generic path. The error is far below the float32 rounding of a log-prob.
template <typename Vec>
inline Vec vexp(const Vec& x) {
  return x.exp_u20();
}

template <typename acc_t>
inline acc_t nan_max(acc_t a, acc_t b) {
  return (std::isnan(a) || a > b) ? a : b;
}

// Loads n elements of a row (scaled by inv_tau) as acc_t and, if max_out is given, their max.
// For an acc_t row at temperature 1 the memory is used in place instead of copied into buf.
template <typename scalar_t, typename acc_t>
inline const acc_t* load_block(const scalar_t* src, int64_t n, acc_t inv_tau, acc_t* buf, acc_t* max_out) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const Vec vtau(inv_tau);
  Vec vm(-std::numeric_limits<acc_t>::infinity());
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  const acc_t* out = buf;
  int64_t j = 0;
  if constexpr (is_reduced_v<scalar_t>) {
    using RVec = at::vec::Vectorized<scalar_t>;
    static_assert(RVec::size() == 2 * W, "reduced vector holds two float vectors");
    for (; j + 2 * W <= n; j += 2 * W) {
      auto [a, b] = at::vec::convert_to_float<scalar_t>(RVec::loadu(src + j));
      a = a * vtau;
      b = b * vtau;
      a.store(buf + j);
      b.store(buf + j + W);
      vm = at::vec::maximum(vm, at::vec::maximum(a, b));
    }
    // j stays at the tail's start: the max over the tail is taken below, as for the other paths.
    for (int64_t k = j; k < n; ++k) buf[k] = static_cast<acc_t>(src[k]) * inv_tau;
  } else {
    if (inv_tau == acc_t(1)) {
      out = reinterpret_cast<const acc_t*>(src);
      if (!max_out) return out;
      for (; j + W <= n; j += W) vm = at::vec::maximum(vm, Vec::loadu(out + j));
    } else {
      for (; j + W <= n; j += W) {
        Vec a = Vec::loadu(src + j) * vtau;
        a.store(buf + j);
        vm = at::vec::maximum(vm, a);
      }
      for (int64_t k = j; k < n; ++k) buf[k] = static_cast<acc_t>(src[k]) * inv_tau;
    }
  }
  if (!max_out) return out;
  m = at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, vm);
  for (int64_t k = j; k < n; ++k) m = nan_max(out[k], m);
  *max_out = m;
  return out;
}

// log p = x - lse can be -inf (a -inf logit); p * log p must then be 0, not 0 * -inf = NaN.
template <typename acc_t>
constexpr acc_t finite_floor() {
  return std::numeric_limits<acc_t>::lowest();
}

template <typename scalar_t, typename acc_t>
RowStats<acc_t> row_logsumexp(const scalar_t* row, int64_t V, acc_t inv_tau, bool want_entropy, acc_t* buf) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  constexpr acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  constexpr acc_t pinf = std::numeric_limits<acc_t>::infinity();
  acc_t m = ninf;  // running max
  acc_t s = 0;     // sum exp(x - m)
  acc_t t = 0;     // sum exp(x - m) * (x - m): entropy = log s - t / s
  const Vec floor_v(finite_floor<acc_t>());
  for (int64_t b0 = 0; b0 < V; b0 += kRowBlock) {
    const int64_t n = std::min<int64_t>(kRowBlock, V - b0);
    acc_t bm;
    const acc_t* x = load_block<scalar_t, acc_t>(row + b0, n, inv_tau, buf, &bm);
    if (std::isnan(bm) || bm == pinf) {
      const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
      return {nan, nan};
    }
    if (bm > m) {
      if (m != ninf) {
        // Re-base s and t from max m to bm: t is relative to the max, so it shifts by (m - bm) * s.
        const acc_t r = std::exp(m - bm);
        t = r * (t + (m - bm) * s);
        s = s * r;
      }
      m = bm;
    }
    if (m == ninf) continue;  // every logit so far is -inf: nothing to add
    const Vec vm(m);
    // One summation order whether or not the entropy is wanted, so that asking for it never
    // changes a log-prob's bits. Two accumulators hide the add latency behind the next exp.
    Vec vs(acc_t(0)), vs2(acc_t(0)), vt(acc_t(0)), vt2(acc_t(0));
    int64_t j = 0;
    for (; j + 2 * W <= n; j += 2 * W) {
      const Vec d0 = Vec::loadu(x + j) - vm;
      const Vec d1 = Vec::loadu(x + j + W) - vm;
      const Vec e0 = vexp(d0);
      const Vec e1 = vexp(d1);
      vs = vs + e0;
      vs2 = vs2 + e1;
      if (want_entropy) {
        vt = at::vec::fmadd(e0, at::vec::maximum(d0, floor_v), vt);
        vt2 = at::vec::fmadd(e1, at::vec::maximum(d1, floor_v), vt2);
      }
    }
    for (; j + W <= n; j += W) {
      const Vec d = Vec::loadu(x + j) - vm;
      const Vec e = vexp(d);
      vs = vs + e;
      if (want_entropy) vt = at::vec::fmadd(e, at::vec::maximum(d, floor_v), vt);
    }
    vs = vs + vs2;
    vt = vt + vt2;
    acc_t bs = at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return a + b; }, vs);
    acc_t bt = want_entropy ? at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return a + b; }, vt)
                            : acc_t(0);
    for (; j < n; ++j) {
      const acc_t d = x[j] - m;
      const acc_t e = std::exp(d);
      bs += e;
      if (want_entropy) bt += e * std::max(d, finite_floor<acc_t>());
    }
    s += bs;
    t += bt;
  }
  const acc_t log_s = std::log(s);
  return {m + log_s, want_entropy ? log_s - t / s : acc_t(0)};
}

// d/dz_j of (g_lp * logprob[label] + g_ent * entropy), with x = z * inv_tau, p = exp(x - lse):
//   (g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)) * inv_tau
// The gradient is computed in acc_t and rounded once when stored.
template <typename scalar_t, typename acc_t>
void row_softmax_grad(const scalar_t* row, scalar_t* out, int64_t V, acc_t inv_tau, acc_t lse, acc_t g_lp, acc_t g_ent,
                      acc_t H, int64_t label, acc_t* buf) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const Vec vlse(lse), vH(H), floor_v(finite_floor<acc_t>());
  // Both coefficients carry the 1/tau factor, so the inner loop is two FMAs per vector.
  const Vec vglp(-g_lp * inv_tau), vgent(-g_ent * inv_tau);
  const bool with_ent = g_ent != acc_t(0);
  for (int64_t b0 = 0; b0 < V; b0 += kRowBlock) {
    const int64_t n = std::min<int64_t>(kRowBlock, V - b0);
    const acc_t* x = load_block<scalar_t, acc_t>(row + b0, n, inv_tau, buf, nullptr);
    // A float row's gradient is written straight to the output. A bf16/fp16 one is staged in buf
    // so the one-hot term is added before its single rounding; when x aliases buf each element
    // is read before it is overwritten.
    acc_t* g;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      g = out + b0;
    } else {
      g = buf;
    }
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      Vec d = Vec::loadu(x + j) - vlse;
      Vec p = vexp(d);
      Vec gv = vglp * p;
      if (with_ent) gv = at::vec::fmadd(vgent * p, at::vec::maximum(d, floor_v) + vH, gv);
      gv.store(g + j);
    }
    for (; j < n; ++j) {
      const acc_t d = x[j] - lse;
      const acc_t p = std::exp(d);
      acc_t gv = -g_lp * p;
      if (with_ent) gv -= g_ent * p * (std::max(d, finite_floor<acc_t>()) + H);
      g[j] = gv * inv_tau;
    }
    if (label >= b0 && label < b0 + n) g[label - b0] += g_lp * inv_tau;
    if constexpr (is_reduced_v<scalar_t>) {
      int64_t k = 0;
      for (; k + 2 * W <= n; k += 2 * W)
        at::vec::convert_from_float<scalar_t>(Vec::loadu(g + k), Vec::loadu(g + k + W)).store(out + b0 + k);
      for (; k < n; ++k) out[b0 + k] = static_cast<scalar_t>(g[k]);
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace pyppo
