// Vectorised per-row softmax statistics and gradient, shared by the CPU kernels that reduce
// over a vocabulary row (gather_logprobs today).
//
// The row is walked in blocks of kRowBlock elements small enough to stay in L1: each block is
// read from memory once, its maximum taken, the running sums rescaled once if the maximum
// grew (one scalar exp per block, not one per element as a per-element online softmax needs),
// then exp'd from L1. So the logits cross the memory bus exactly once and nothing of size V
// is allocated.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace pyppo {

constexpr int64_t kRowBlock = 2048;

template <typename acc_t>
struct RowStats {
  acc_t lse;      // logsumexp(z / tau)
  acc_t entropy;  // -sum p log p, p = softmax(z / tau); only when asked for
};

// Converts (and scales by inv_tau) one block into buf. For an acc_t row at temperature 1 the
// block is used in place instead.
template <typename scalar_t, typename acc_t>
inline const acc_t* load_block(const scalar_t* src, int64_t n, acc_t inv_tau, acc_t* buf) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (inv_tau == acc_t(1)) return src;
  }
  for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<acc_t>(src[j]) * inv_tau;
  return buf;
}

template <typename acc_t>
inline acc_t block_max(const acc_t* x, int64_t n) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  int64_t j = 0;
  if (n >= W) {
    Vec vm = Vec::loadu(x);
    for (j = W; j + W <= n; j += W) vm = at::vec::maximum(vm, Vec::loadu(x + j));
    m = at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; j < n; ++j) m = (std::isnan(x[j]) || x[j] > m) ? x[j] : m;
  return m;
}

// log p = x - lse can be -inf (a -inf logit); p * log p must then be 0, not 0 * -inf = NaN.
template <typename acc_t>
inline acc_t finite_floor() {
  return std::numeric_limits<acc_t>::lowest();
}

template <typename scalar_t, typename acc_t>
RowStats<acc_t> row_logsumexp(const scalar_t* row, int64_t V, acc_t inv_tau, bool want_entropy, acc_t* buf) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  acc_t m = ninf;  // running max
  acc_t s = 0;     // sum exp(x - m)
  acc_t t = 0;     // sum exp(x - m) * (x - m): entropy = log s - t / s
  const Vec floor_v(finite_floor<acc_t>());
  for (int64_t b0 = 0; b0 < V; b0 += kRowBlock) {
    const int64_t n = std::min<int64_t>(kRowBlock, V - b0);
    const acc_t* x = load_block<scalar_t, acc_t>(row + b0, n, inv_tau, buf);
    const acc_t bm = block_max(x, n);
    if (std::isnan(bm)) return {bm, bm};
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
    if (m == std::numeric_limits<acc_t>::infinity()) {
      const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
      return {nan, nan};
    }
    const Vec vm(m);
    Vec vs(acc_t(0)), vt(acc_t(0));
    int64_t j = 0;
    if (want_entropy) {
      for (; j + W <= n; j += W) {
        Vec d = Vec::loadu(x + j) - vm;
        Vec e = d.exp();
        vs = vs + e;
        vt = at::vec::fmadd(e, at::vec::maximum(d, floor_v), vt);
      }
    } else {
      for (; j + W <= n; j += W) vs = vs + (Vec::loadu(x + j) - vm).exp();
    }
    acc_t bs = at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return a + b; }, vs);
    acc_t bt = want_entropy ? at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return a + b; }, vt) : acc_t(0);
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
template <typename scalar_t, typename acc_t>
void row_softmax_grad(const scalar_t* row, scalar_t* out, int64_t V, acc_t inv_tau, acc_t lse, acc_t g_lp, acc_t g_ent,
                      acc_t H, int64_t label, acc_t* buf) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const Vec vlse(lse), vglp(g_lp), vgent(g_ent), vH(H), vtau(inv_tau), floor_v(finite_floor<acc_t>());
  const bool with_ent = g_ent != acc_t(0);
  for (int64_t b0 = 0; b0 < V; b0 += kRowBlock) {
    const int64_t n = std::min<int64_t>(kRowBlock, V - b0);
    const acc_t* x = load_block<scalar_t, acc_t>(row + b0, n, inv_tau, buf);
    // The gradient is staged in buf (in acc_t) so the label's one-hot term is added before the
    // single rounding to scalar_t; when x aliases the input, buf is still free to hold it.
    acc_t* g = buf;
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      Vec d = Vec::loadu(x + j) - vlse;
      Vec p = d.exp();
      Vec gv = Vec(acc_t(0)) - vglp * p;
      if (with_ent) gv = gv - vgent * p * (at::vec::maximum(d, floor_v) + vH);
      (gv * vtau).store(g + j);
    }
    for (; j < n; ++j) {
      const acc_t d = x[j] - lse;
      const acc_t p = std::exp(d);
      acc_t gv = -g_lp * p;
      if (with_ent) gv -= g_ent * p * (std::max(d, finite_floor<acc_t>()) + H);
      g[j] = gv * inv_tau;
    }
    if (label >= b0 && label < b0 + n) g[label - b0] += g_lp * inv_tau;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      std::copy(g, g + n, out + b0);
    } else {
      for (int64_t k = 0; k < n; ++k) out[b0 + k] = static_cast<scalar_t>(g[k]);
    }
  }
}

}  // namespace pyppo
