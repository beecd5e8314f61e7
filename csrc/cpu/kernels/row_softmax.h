// Vectorised per-row softmax statistics and gradient. Included only by the per-ISA kernel
// files: everything here lives in namespace CPU_CAPABILITY (DEFAULT / AVX2 / AVX512), so the
// copies compiled for different instruction sets never merge at link time.
//
// Forward: a row is walked in blocks of kRowBlock elements small enough to stay in L1: each
// block is read from memory once (converted to float on the way for bf16/fp16), its maximum
// taken, the running sums rescaled once if the maximum grew (one scalar exp per block, not one
// per element as a per-element online softmax needs), then exp'd from L1. Backward: one pass,
// each element read, exp'd and its gradient stored. The logits cross the memory bus once per
// pass and nothing of size V is allocated.
//
// Every element of a row, the tail included, goes through the same vector arithmetic, and a
// row's sums are taken in an order fixed by V alone: a row's results depend neither on the
// other rows nor on the thread that reduced it.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// Bit pattern of 2^n, for the integer n held in the low mantissa bits of t = kRound + n.
inline at::vec::Vectorized<float> pow2_from_rounded(const at::vec::Vectorized<float>& t) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i b = _mm512_slli_epi32(_mm512_castps_si512(t), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(b, _mm512_set1_epi32(0x3f800000)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i b = _mm256_slli_epi32(_mm256_castps_si256(t), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(b, _mm256_set1_epi32(0x3f800000)));
#else
  using Vec = at::vec::Vectorized<float>;
  float lanes[Vec::size()];
  t.store(lanes);
  for (float& f : lanes) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    u = (u << 23) + 0x3f800000u;
    std::memcpy(&f, &u, sizeof u);
  }
  return Vec::loadu(lanes);
#endif
}

// e^d for the arguments of a softmax (d = x - max or x - lse, so d <= 0), in 13 vector
// operations where exp_u20 takes 17, and within 2.3 ulp instead of 20 (checked on every 7th
// float of [-87.3, 0] against double): Cody-Waite reduction d = n ln2 + r with ln2 in two
// parts, a degree-5 polynomial for e^r, and 2^n built from the bits of the rounded n. d below
// -87.68 (a -inf logit) gives exactly 0, e^0 is exactly 1, a NaN stays NaN. kAnySign: d above 0
// too (a caller's lse need not be its row's); past 88.38 that gives inf, where without it the
// exponent would wrap.
//
// `dc` receives d clamped to [-88, ...]: e * dc is the entropy's e^d * d, 0 (not 0 * -inf)
// for a -inf logit.
template <bool kAnySign = false>
inline at::vec::Vectorized<float> exp_softmax(const at::vec::Vectorized<float>& d, at::vec::Vectorized<float>& dc) {
  using Vec = at::vec::Vectorized<float>;
  // clamp_min(a, lo) is max(lo, a): a NaN a is returned, so it survives the clamp.
  dc = at::vec::clamp_min(d, Vec(-88.0f));
  Vec x = dc;
  // Up to 89, n = round(x log2 e) stays <= 128, whose 2^n bit pattern is +inf.
  if constexpr (kAnySign) x = at::vec::clamp_max(x, Vec(89.0f));
  // 1.5 * 2^23: adding it rounds x log2 e to an integer and leaves that integer in the low
  // mantissa bits.
  const Vec kRound(12582912.0f);
  const Vec t = at::vec::fmadd(x, Vec(1.44269504088896341f), kRound);
  const Vec n = t - kRound;
  // ln2 = 0.693359375 - 2.12194440e-4: the first part has 9 significant bits, so n * it is exact.
  Vec r = at::vec::fmadd(n, Vec(-0.693359375f), x);
  r = at::vec::fmadd(n, Vec(2.12194440e-4f), r);
  // e^r on |r| <= ln2 / 2, relative error 1.3e-7 (the coefficients of ATen's exp_u20); the
  // constant term is exactly 1.
  Vec p = at::vec::fmadd(r, Vec(0.00828929059f), Vec(0.0418978221f));
  p = at::vec::fmadd(p, r, Vec(0.166676521f));
  p = at::vec::fmadd(p, r, Vec(0.499991506f));
  p = at::vec::fmadd(p, r, Vec(0.999999701f));
  p = at::vec::fmadd(p, r, Vec(1.0f));
  // n = -127 (x < -87.68) gives the pattern of 0.0, so those lanes are exactly 0; n = 128 gives +inf.
  return p * pow2_from_rounded(t);
}

// The same contract for double, on ATen's exp (Sleef, 1 ulp): -inf gives 0, NaN stays NaN.
template <bool kAnySign = false>
inline at::vec::Vectorized<double> exp_softmax(const at::vec::Vectorized<double>& d,
                                               at::vec::Vectorized<double>& dc) {
  using Vec = at::vec::Vectorized<double>;
  dc = at::vec::clamp_min(d, Vec(std::numeric_limits<double>::lowest()));
  return d.exp_u20();
}

// x = z * inv_tau as acc_t for the kW elements at src: one acc_t vector (float, double) or
// two (bf16/fp16, whose vector holds twice as many). The _tail variants read or write only the
// first count elements; the lanes past them are `pad`.
template <typename scalar_t, typename acc_t>
struct RowLoad {
  using Vec = at::vec::Vectorized<acc_t>;
  static constexpr int64_t kW = is_reduced_v<scalar_t> ? 2 * Vec::size() : Vec::size();
  static_assert(at::vec::Vectorized<scalar_t>::size() == kW, "a reduced vector holds two float vectors");

  template <bool kScaled>
  static inline void load(const scalar_t* src, Vec inv_tau, Vec& a, Vec& b) {
    if constexpr (is_reduced_v<scalar_t>) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(at::vec::Vectorized<scalar_t>::loadu(src));
      a = lo;
      b = hi;
      if constexpr (kScaled) {
        a = a * inv_tau;
        b = b * inv_tau;
      }
    } else {
      a = Vec::loadu(src);
      if constexpr (kScaled) a = a * inv_tau;
    }
  }

  template <bool kScaled>
  static inline void load_tail(const scalar_t* src, int64_t count, acc_t inv_tau, acc_t pad, Vec& a, Vec& b) {
    acc_t lanes[kW];
    for (int64_t k = 0; k < kW; ++k)
      lanes[k] = k < count ? (kScaled ? static_cast<acc_t>(src[k]) * inv_tau : static_cast<acc_t>(src[k])) : pad;
    a = Vec::loadu(lanes);
    if constexpr (is_reduced_v<scalar_t>) b = Vec::loadu(lanes + Vec::size());
  }

  // Stores the kW (or count) values of a, b as scalar_t, each rounded once.
  static inline void store(scalar_t* dst, const Vec& a, const Vec& b) {
    if constexpr (is_reduced_v<scalar_t>) {
      at::vec::convert_from_float<scalar_t>(a, b).store(dst);
    } else {
      a.store(dst);
    }
  }

  static inline void store_tail(scalar_t* dst, int64_t count, const Vec& a, const Vec& b) {
    acc_t lanes[kW];
    a.store(lanes);
    if constexpr (is_reduced_v<scalar_t>) b.store(lanes + Vec::size());
    for (int64_t k = 0; k < count; ++k) dst[k] = static_cast<scalar_t>(lanes[k]);
  }
};

// max(acc, x) ignoring a NaN x (max(x, acc) keeps acc when either is NaN): one instruction,
// where a NaN-propagating maximum takes three. NaNs reach the sums through exp instead.
template <typename Vec>
inline Vec max_ignoring_nan(const Vec& acc, const Vec& x) {
  return at::vec::clamp_min(acc, x);
}

// The block [src, src + n) as acc_t x = z * inv_tau, and its maximum over the non-NaN values
// (-inf if none). A float row at temperature 1 is used in place; others are converted into buf.
template <typename scalar_t, typename acc_t, bool kScaled>
inline const acc_t* load_block(const scalar_t* src, int64_t n, acc_t inv_tau, acc_t* buf, acc_t* max_out) {
  using L = RowLoad<scalar_t, acc_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  constexpr acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  const Vec vtau(inv_tau);
  // Four chains: the max's latency, not its throughput, bounds one chain.
  Vec m0(ninf), m1(ninf), m2(ninf), m3(ninf);
  constexpr bool kInPlace = std::is_same_v<scalar_t, acc_t> && !kScaled;
  const acc_t* x = kInPlace ? reinterpret_cast<const acc_t*>(src) : buf;
  int64_t j = 0;
  if constexpr (kInPlace) {
    for (; j + 4 * W <= n; j += 4 * W) {
      m0 = max_ignoring_nan(m0, Vec::loadu(x + j));
      m1 = max_ignoring_nan(m1, Vec::loadu(x + j + W));
      m2 = max_ignoring_nan(m2, Vec::loadu(x + j + 2 * W));
      m3 = max_ignoring_nan(m3, Vec::loadu(x + j + 3 * W));
    }
    for (; j + W <= n; j += W) m0 = max_ignoring_nan(m0, Vec::loadu(x + j));
  } else {
    for (; j + 2 * L::kW <= n; j += 2 * L::kW) {
      Vec a, b, c, d;
      L::template load<kScaled>(src + j, vtau, a, b);
      L::template load<kScaled>(src + j + L::kW, vtau, c, d);
      a.store(buf + j);
      c.store(buf + j + L::kW);
      m0 = max_ignoring_nan(m0, a);
      m2 = max_ignoring_nan(m2, c);
      if constexpr (is_reduced_v<scalar_t>) {
        b.store(buf + j + W);
        d.store(buf + j + L::kW + W);
        m1 = max_ignoring_nan(m1, b);
        m3 = max_ignoring_nan(m3, d);
      }
    }
    for (int64_t k = j; k < n; ++k) buf[k] = kScaled ? static_cast<acc_t>(src[k]) * inv_tau : static_cast<acc_t>(src[k]);
    for (; j + W <= n; j += W) m0 = max_ignoring_nan(m0, Vec::loadu(buf + j));
  }
  m0 = max_ignoring_nan(max_ignoring_nan(m0, m1), max_ignoring_nan(m2, m3));
  acc_t m = at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return max_ignoring_nan(a, b); }, m0);
  for (int64_t k = j; k < n; ++k) m = x[k] > m ? x[k] : m;
  *max_out = m;
  return x;
}

template <typename acc_t>
inline bool any_nan(const acc_t* x, int64_t n) {
  for (int64_t k = 0; k < n; ++k)
    if (std::isnan(x[k])) return true;
  return false;
}

template <typename scalar_t, typename acc_t, bool kEntropy, bool kScaled>
RowStats<acc_t> row_logsumexp_impl(const scalar_t* row, int64_t V, acc_t inv_tau, acc_t* buf) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  constexpr acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  constexpr acc_t pinf = std::numeric_limits<acc_t>::infinity();
  constexpr acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  acc_t m = ninf;  // running max
  acc_t s = 0;     // sum exp(x - m)
  acc_t t = 0;     // sum exp(x - m) * (x - m): entropy = log s - t / s
  for (int64_t b0 = 0; b0 < V; b0 += kRowBlock) {
    const int64_t n = std::min<int64_t>(kRowBlock, V - b0);
    acc_t bm;
    const acc_t* x = load_block<scalar_t, acc_t, kScaled>(row + b0, n, inv_tau, buf, &bm);
    if (bm == pinf) return {nan, nan};
    if (bm > m) {
      if (m != ninf) {
        // Re-base s and t from max m to bm: t is relative to the max, so it shifts by (m - bm) * s.
        const acc_t r = std::exp(m - bm);
        t = r * (t + (m - bm) * s);
        s = s * r;
      }
      m = bm;
    }
    if (m == ninf) {
      // Every logit so far is -inf or NaN: nothing to add, but a NaN must poison the row.
      if (any_nan(x, n)) return {nan, nan};
      continue;
    }
    const Vec vm(m);
    // Two accumulators hide the add latency behind the next exp.
    Vec vs(acc_t(0)), vs2(acc_t(0)), vt(acc_t(0)), vt2(acc_t(0));
    // While this block is exp'd from L1, the next one (past the row's end: the next row's start,
    // for contiguous rows) is fetched, so the memory bus is never idle during the arithmetic.
    // A prefetch never faults, whatever the address. (1.5x faster on [2048, 49152] float32.)
    const uintptr_t next = reinterpret_cast<uintptr_t>(row + b0 + n);
    int64_t j = 0;
    for (; j + 2 * W <= n; j += 2 * W) {
      __builtin_prefetch(reinterpret_cast<const void*>(next + j * sizeof(scalar_t)));
      Vec c0, c1;
      const Vec e0 = exp_softmax(Vec::loadu(x + j) - vm, c0);
      const Vec e1 = exp_softmax(Vec::loadu(x + j + W) - vm, c1);
      vs = vs + e0;
      vs2 = vs2 + e1;
      if constexpr (kEntropy) {
        vt = at::vec::fmadd(e0, c0, vt);
        vt2 = at::vec::fmadd(e1, c1, vt2);
      }
    }
    if (j < n) {
      // The rest (under 2W) as up to two vectors, the lanes past the end -inf (exp gives 0).
      acc_t lanes[2 * W];
      for (int64_t k = 0; k < 2 * W; ++k) lanes[k] = j + k < n ? x[j + k] : ninf;
      Vec c0, c1;
      const Vec e0 = exp_softmax(Vec::loadu(lanes) - vm, c0);
      const Vec e1 = exp_softmax(Vec::loadu(lanes + W) - vm, c1);
      vs = vs + e0;
      vs2 = vs2 + e1;
      if constexpr (kEntropy) {
        vt = at::vec::fmadd(e0, c0, vt);
        vt2 = at::vec::fmadd(e1, c1, vt2);
      }
    }
    vs = vs + vs2;
    s += at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return a + b; }, vs);
    if constexpr (kEntropy) {
      vt = vt + vt2;
      t += at::vec::vec_reduce_all<acc_t>([](const Vec& a, const Vec& b) { return a + b; }, vt);
    }
  }
  const acc_t log_s = std::log(s);
  return {m + log_s, kEntropy ? log_s - t / s : acc_t(0)};
}

// logsumexp(row / tau) and, if asked, the entropy of softmax(row / tau). Asking for the entropy
// never changes the logsumexp's bits: both variants sum in the same order.
template <typename scalar_t, typename acc_t>
RowStats<acc_t> row_logsumexp(const scalar_t* row, int64_t V, acc_t inv_tau, bool want_entropy, acc_t* buf) {
  const bool scaled = inv_tau != acc_t(1);
  if (want_entropy)
    return scaled ? row_logsumexp_impl<scalar_t, acc_t, true, true>(row, V, inv_tau, buf)
                  : row_logsumexp_impl<scalar_t, acc_t, true, false>(row, V, inv_tau, buf);
  return scaled ? row_logsumexp_impl<scalar_t, acc_t, false, true>(row, V, inv_tau, buf)
                : row_logsumexp_impl<scalar_t, acc_t, false, false>(row, V, inv_tau, buf);
}

// The gradient (without the label's onehot term) of each lane of x = z * inv_tau.
template <typename acc_t, bool kEntropy>
struct GradMath {
  using Vec = at::vec::Vectorized<acc_t>;
  Vec lse, H, c_lp, c_ent;
  inline Vec operator()(const Vec& x) const {
    Vec dc;
    const Vec d = x - lse;
    const Vec p = exp_softmax<true>(d, dc);
    Vec g = c_lp * p;
    if constexpr (kEntropy) g = at::vec::fmadd(c_ent * p, dc + H, g);
    return g;
  }
};

template <typename scalar_t, typename acc_t, bool kEntropy, bool kScaled>
void row_softmax_grad_impl(const scalar_t* row, scalar_t* out, int64_t V, acc_t inv_tau, acc_t lse, acc_t g_lp,
                           acc_t g_ent, acc_t H, int64_t label) {
  using L = RowLoad<scalar_t, acc_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t K = L::kW;
  // Both coefficients carry the 1/tau factor, so the inner loop is two FMAs per vector.
  const GradMath<acc_t, kEntropy> f{Vec(lse), Vec(H), Vec(-g_lp * inv_tau), Vec(-g_ent * inv_tau)};
  const Vec vtau(inv_tau);
  // out may be row itself (an in-place caller): every element is read before it is written,
  // the label's first of all, as its gradient is finished after the loop.
  const acc_t x_label = kScaled ? static_cast<acc_t>(row[label]) * inv_tau : static_cast<acc_t>(row[label]);
  int64_t j = 0;
  for (; j + K <= V; j += K) {
    Vec a, b;
    L::template load<kScaled>(row + j, vtau, a, b);
    a = f(a);
    if constexpr (is_reduced_v<scalar_t>) b = f(b);
    L::store(out + j, a, b);
  }
  if (j < V) {
    Vec a, b;
    L::template load_tail<kScaled>(row + j, V - j, inv_tau, acc_t(0), a, b);
    a = f(a);
    if constexpr (is_reduced_v<scalar_t>) b = f(b);
    L::store_tail(out + j, V - j, a, b);
  }
  // The label's onehot term, added before the one rounding: the same vector math as the loop
  // gave that element (every lane is computed alike), plus g_lp / tau.
  acc_t lanes[W];
  f(Vec(x_label)).store(lanes);
  out[label] = static_cast<scalar_t>(lanes[0] + g_lp * inv_tau);
}

// d/dz_j of (g_lp * logprob[label] + g_ent * entropy), with x = z * inv_tau, p = exp(x - lse):
//   (g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)) * inv_tau
// computed in acc_t and rounded once when stored.
template <typename scalar_t, typename acc_t>
void row_softmax_grad(const scalar_t* row, scalar_t* out, int64_t V, acc_t inv_tau, acc_t lse, acc_t g_lp, acc_t g_ent,
                      acc_t H, int64_t label) {
  const bool scaled = inv_tau != acc_t(1);
  if (g_ent != acc_t(0))
    return scaled ? row_softmax_grad_impl<scalar_t, acc_t, true, true>(row, out, V, inv_tau, lse, g_lp, g_ent, H, label)
                  : row_softmax_grad_impl<scalar_t, acc_t, true, false>(row, out, V, inv_tau, lse, g_lp, g_ent, H, label);
  return scaled ? row_softmax_grad_impl<scalar_t, acc_t, false, true>(row, out, V, inv_tau, lse, g_lp, g_ent, H, label)
                : row_softmax_grad_impl<scalar_t, acc_t, false, false>(row, out, V, inv_tau, lse, g_lp, g_ent, H, label);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace pyppo
