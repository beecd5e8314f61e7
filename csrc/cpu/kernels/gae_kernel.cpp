// Generalized Advantage Estimation: one right-to-left scan per row, compiled once per
// instruction set. Each row's operations run in a fixed order, the same whichever path and
// thread scans it, so its result depends neither on the thread count nor on the other rows. The
// advantages use the row's lam (row_lam[b], else lam); the returns use lam_critic when it
// differs, from a second running advantage in the same scan: the same operations as a call with
// lam = lam_critic, so the returns are that call's bits.
//
// The scan of a row is a chain of dependent operations, so one row at a time leaves the core
// waiting on their latency. With AVX2 (and in the AVX-512 build) blocks of 8 float (4 double)
// rows are scanned together, one row per vector lane: the lanes run scan_row's operations in its
// order (a masked position keeps the lane's state and writes 0, as scan_row's branch does), so
// a row gets the same bits in a block or alone. The rows left over are scanned one at a time.
#include "cpu/kernels/kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define PYPPO_GAE_LANES 1
#endif

namespace pyppo {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// One row. Two: the returns have their own lambda (gl_c), so a second accumulator runs beside
// the advantages' one; otherwise returns = advantages + values.
template <typename T, bool Two>
void scan_row(const T* rp, const T* vp, const bool* mp, T next_value, T g, T gl, T gl_c, T* ap, T* op,
              int64_t T_) {
  // next_value / next_adv belong to the next *valid* position: a masked position in the
  // middle of a row (a tool output, an observation) is skipped without breaking the chain.
  T next_adv = 0, next_adv_c = 0;
  for (int64_t t = T_ - 1; t >= 0; --t) {
    if (!mp[t]) {
      ap[t] = 0;
      op[t] = 0;
      continue;
    }
    const T delta = rp[t] + g * next_value - vp[t];
    next_adv = delta + gl * next_adv;
    if constexpr (Two) next_adv_c = delta + gl_c * next_adv_c;
    next_value = vp[t];
    ap[t] = next_adv;
    op[t] = (Two ? next_adv_c : next_adv) + vp[t];
  }
}

#ifdef PYPPO_GAE_LANES

// The 256-bit operations a block needs, for float (8 lanes) and double (4 lanes). A block is L
// rows by L steps: a square tile, transposed in registers so that a vector holds one step of
// the L rows.
struct F8 {
  using T = float;
  using V = __m256;
  static constexpr int L = 8;
  using MaskWord = uint64_t;  // the L mask bytes of a row's tile
  static constexpr MaskWord kAllValid = 0x0101010101010101ull;
  static V load(const T* p) { return _mm256_loadu_ps(p); }
  static void store(T* p, V x) { _mm256_storeu_ps(p, x); }
  static V set1(T x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V pick(V a, V b, V m) { return _mm256_blendv_ps(a, b, m); }  // m ? b : a
  static V andnot(V m, V x) { return _mm256_andnot_ps(m, x); }      // m ? +0 : x
  // L mask bytes as L integer lanes (0 or 1), in a float vector's bits (transposed as floats).
  static V load_mask(const bool* p) {
    return _mm256_castsi256_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V is_zero(V x) {
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_castps_si256(x), _mm256_setzero_si256()));
  }
  static void transpose(V* r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
  }
};

struct D4 {
  using T = double;
  using V = __m256d;
  static constexpr int L = 4;
  using MaskWord = uint32_t;
  static constexpr MaskWord kAllValid = 0x01010101u;
  static V load(const T* p) { return _mm256_loadu_pd(p); }
  static void store(T* p, V x) { _mm256_storeu_pd(p, x); }
  static V set1(T x) { return _mm256_set1_pd(x); }
  static V zero() { return _mm256_setzero_pd(); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V sub(V a, V b) { return _mm256_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V pick(V a, V b, V m) { return _mm256_blendv_pd(a, b, m); }
  static V andnot(V m, V x) { return _mm256_andnot_pd(m, x); }
  static V load_mask(const bool* p) {
    int32_t w;
    std::memcpy(&w, p, sizeof(w));
    return _mm256_castsi256_pd(_mm256_cvtepu8_epi64(_mm_cvtsi32_si128(w)));
  }
  static V is_zero(V x) {
    return _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_castpd_si256(x), _mm256_setzero_si256()));
  }
  static void transpose(V* r) {
    const __m256d t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
    const __m256d t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
    r[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
    r[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
    r[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
    r[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
  }
};

// A block's running state, lane i = row i: gamma, gamma * lam, gamma * lam_critic, and the next
// valid position's value and advantage(s) (scan_row's next_value, next_adv, next_adv_c).
template <class S>
struct Lanes {
  typename S::V g, gl, gl_c, nv, na, nc;
};

// One step of the block's rows; z: the lanes whose position is masked.
template <class S, bool Two>
inline void masked_step(Lanes<S>& s, typename S::V r, typename S::V v, typename S::V z, typename S::V& a,
                        typename S::V& o) {
  const auto delta = S::sub(S::add(r, S::mul(s.g, s.nv)), v);
  s.na = S::pick(S::add(delta, S::mul(s.gl, s.na)), s.na, z);
  if constexpr (Two) s.nc = S::pick(S::add(delta, S::mul(s.gl_c, s.nc)), s.nc, z);
  s.nv = S::pick(v, s.nv, z);
  a = S::andnot(z, s.na);
  o = S::andnot(z, S::add(Two ? s.nc : s.na, v));
}

// Steps [t0, t0 + L) of the block: rewards, values and outputs at row stride ld, the mask at
// row stride ms from column mt0.
template <class S, bool Two>
inline void tile(Lanes<S>& s, const typename S::T* rp, const typename S::T* vp, const bool* mp, typename S::T* ap,
                 typename S::T* op, int64_t ld, int64_t ms, int64_t t0, int64_t mt0) {
  using V = typename S::V;
  constexpr int L = S::L;
  V r[L], v[L], a[L], o[L];
  typename S::MaskWord all = S::kAllValid;
  for (int i = 0; i < L; ++i) {
    r[i] = S::load(rp + i * ld + t0);
    v[i] = S::load(vp + i * ld + t0);
    typename S::MaskWord w;
    std::memcpy(&w, mp + i * ms + mt0, L);
    all &= w;
  }
  S::transpose(r);
  S::transpose(v);
  if (all == S::kAllValid) {
    // Every position valid (the common case): masked_step without its selects.
    for (int k = L - 1; k >= 0; --k) {
      const V delta = S::sub(S::add(r[k], S::mul(s.g, s.nv)), v[k]);
      s.na = S::add(delta, S::mul(s.gl, s.na));
      if constexpr (Two) s.nc = S::add(delta, S::mul(s.gl_c, s.nc));
      s.nv = v[k];
      a[k] = s.na;
      o[k] = S::add(Two ? s.nc : s.na, v[k]);
    }
  } else {
    V m[L];
    for (int i = 0; i < L; ++i) m[i] = S::load_mask(mp + i * ms + mt0);
    S::transpose(m);
    for (int k = L - 1; k >= 0; --k) masked_step<S, Two>(s, r[k], v[k], S::is_zero(m[k]), a[k], o[k]);
  }
  S::transpose(a);
  S::transpose(o);
  for (int i = 0; i < L; ++i) {
    S::store(ap + i * ld + t0, a[i]);
    S::store(op + i * ld + t0, o[i]);
  }
}

// L whole rows from rp, vp, mp (row stride T_); gl: the rows' gamma * lam.
template <class S, bool Two>
void scan_block(const typename S::T* rp, const typename S::T* vp, const bool* mp, typename S::V last,
                typename S::T g, typename S::V gl, typename S::T gl_c, typename S::T* ap, typename S::T* op,
                int64_t T_) {
  using T = typename S::T;
  using V = typename S::V;
  constexpr int L = S::L;
  Lanes<S> s{S::set1(g), gl, S::set1(gl_c), last, S::zero(), S::zero()};
  const int64_t tail = T_ % L;
  if (tail) {
    // The last T_ % L steps, transposed through memory.
    const int64_t t0 = T_ - tail;
    alignas(32) T rb[L][L], vb[L][L], ab[L][L], ob[L][L];
    alignas(32) std::conditional_t<sizeof(T) == 4, int32_t, int64_t> mb[L][L];
    for (int i = 0; i < L; ++i)
      for (int64_t k = 0; k < tail; ++k) {
        rb[k][i] = rp[i * T_ + t0 + k];
        vb[k][i] = vp[i * T_ + t0 + k];
        mb[k][i] = mp[i * T_ + t0 + k];
      }
    for (int64_t k = tail - 1; k >= 0; --k) {
      V a, o;
      masked_step<S, Two>(s, S::load(rb[k]), S::load(vb[k]), S::is_zero(S::load(reinterpret_cast<const T*>(mb[k]))),
                          a, o);
      S::store(ab[k], a);
      S::store(ob[k], o);
    }
    for (int i = 0; i < L; ++i)
      for (int64_t k = 0; k < tail; ++k) {
        ap[i * T_ + t0 + k] = ab[k][i];
        op[i * T_ + t0 + k] = ob[k][i];
      }
  }
  // The rest in segments of kSeg steps, copied row by row into local [L, kSeg] tiles and back.
  // Read in place, a tile's L rows are T_ elements apart: for the usual power-of-two T_ their
  // lines all fall in one set of the L1 cache, which then thrashes (2x slower at [64, 1024]).
  constexpr int64_t kSeg = 128, kLd = kSeg + 64 / sizeof(T);
  alignas(64) T rb[L * kLd], vb[L * kLd], ab[L * kLd], ob[L * kLd];
  for (int64_t hi = T_ - tail; hi > 0; hi -= kSeg) {
    const int64_t lo = std::max<int64_t>(0, hi - kSeg), n = hi - lo;
    for (int i = 0; i < L; ++i) {
      std::memcpy(rb + i * kLd, rp + i * T_ + lo, n * sizeof(T));
      std::memcpy(vb + i * kLd, vp + i * T_ + lo, n * sizeof(T));
    }
    for (int64_t t0 = n - L; t0 >= 0; t0 -= L) tile<S, Two>(s, rb, vb, mp, ab, ob, kLd, T_, t0, lo + t0);
    for (int i = 0; i < L; ++i) {
      std::memcpy(ap + i * T_ + lo, ab + i * kLd, n * sizeof(T));
      std::memcpy(op + i * T_ + lo, ob + i * kLd, n * sizeof(T));
    }
  }
}

template <typename T>
using LanesOf = std::conditional_t<std::is_same_v<T, float>, F8, D4>;
constexpr int64_t lanes_of(size_t bytes) { return bytes == 4 ? F8::L : D4::L; }

#else

constexpr int64_t lanes_of(size_t) { return 1; }

#endif  // PYPPO_GAE_LANES

// Steps per parallel task: about 0.5-1 ms of scanning in blocks (3 ms one row at a time). A
// second thread only pays off when its share is long next to the wait for a core that another
// process holds: on a busy 2-core machine, [256, 2048] (2^19 steps) split into 2^16-step tasks
// took 8 ms at 2 threads against 0.5 ms at 1.
constexpr int64_t kGrainSteps = 1 << 20;

template <typename T>
void scan_rows(const GaeArgs& a) {
  const T* rp = static_cast<const T*>(a.rewards);
  const T* vp = static_cast<const T*>(a.values);
  const T* bp = static_cast<const T*>(a.last_values);
  T* ap = static_cast<T*>(a.advantages);
  T* op = static_cast<T*>(a.returns);
  const T g = static_cast<T>(a.gamma);
  const int64_t T_ = a.T;
  // gamma * lam in double, then rounded once: a row's lam from row_lam gives the bits a call
  // with that lam gives.
  auto gl_of = [&](int64_t b) { return static_cast<T>(a.gamma * (a.row_lam ? a.row_lam[b] : a.lam)); };
  auto gl_c_of = [&](T gl) { return a.has_lam_critic ? static_cast<T>(a.gamma * a.lam_critic) : gl; };
  auto one_row = [&](int64_t b) {
    const T gl = gl_of(b), gl_c = gl_c_of(gl);
    const int64_t o = b * T_;
    const T last = bp ? bp[b] : T(0);
    if (gl_c == gl)
      scan_row<T, false>(rp + o, vp + o, a.mask + o, last, g, gl, gl, ap + o, op + o, T_);
    else
      scan_row<T, true>(rp + o, vp + o, a.mask + o, last, g, gl, gl_c, ap + o, op + o, T_);
  };
  // Units of work: the blocks of L rows, then the rows left over one by one. A row's unit
  // depends on B alone, never on the split into tasks.
  constexpr int64_t L = lanes_of(sizeof(T));
  const int64_t blocks = L > 1 ? a.B / L : 0, units = blocks + (a.B - blocks * L);
  const int64_t grain = std::max<int64_t>(1, kGrainSteps / (L * std::max<int64_t>(T_, 1)));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      if (u >= blocks) {
        one_row(blocks * L + (u - blocks));
        continue;
      }
#ifdef PYPPO_GAE_LANES
      using S = LanesOf<T>;
      const int64_t b0 = u * L, o = b0 * T_;
      alignas(32) T gl[L], last[L];
      bool two = false;
      for (int64_t i = 0; i < L; ++i) {
        gl[i] = gl_of(b0 + i);
        two |= gl_c_of(gl[i]) != gl[i];
        last[i] = bp ? bp[b0 + i] : T(0);
      }
      // two: lam_critic was given and differs from some lane's lam. In a lane where it does not,
      // the second accumulator repeats the first's operations: the same returns, bit for bit.
      if (two)
        scan_block<S, true>(rp + o, vp + o, a.mask + o, S::load(last), g, S::load(gl),
                            static_cast<T>(a.gamma * a.lam_critic), ap + o, op + o, T_);
      else
        scan_block<S, false>(rp + o, vp + o, a.mask + o, S::load(last), g, S::load(gl), 0, ap + o, op + o, T_);
#endif
    }
  });
}

}  // namespace

void gae(const GaeArgs& a) {
  if (a.dtype == c10::ScalarType::Double) return scan_rows<double>(a);
  TORCH_CHECK(a.dtype == c10::ScalarType::Float, "pyppo.gae: unsupported accumulation dtype ", a.dtype);
  scan_rows<float>(a);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace pyppo
