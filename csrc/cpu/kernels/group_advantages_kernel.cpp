// Group-relative advantages (GRPO, Dr. GRPO, RLOO): per-group statistics in float64, each
// group's scores added one by one in row order, then one advantage per row broadcast onto its
// valid positions; compiled once per instruction set. A group's advantages depend only on its
// members' scores and their order, never on the thread count or the other groups; the CUDA
// kernel (cuda/kernels/group_advantages_kernel.cu) performs the same float64 operations in the
// same order and gives the same bits.
//
// Two layouts of the groups:
// - group_size (a rollout's n consecutive responses per prompt): a group is its own run of rows,
//   so each group is one pass over its n scores (count, sum, min, max), one over their squared
//   deviations, then its rows are written, eight groups interleaved; past kGrainElements, blocks
//   of eight groups run in parallel, each block whole on one thread, so the thread count does
//   not change a bit.
// - group_ids (any sizes, rows in any order): one serial pass over the B scores accumulates every
//   group's statistics (indexed by id) in row order, a second their squared deviations; then each
//   row's advantage, and the broadcast onto [B, T] in parallel over rows.
#include "cpu/kernels/kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace pyppo {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// Elements (scores read plus advantages written) below which a batch of groups stays on one
// thread: a GRPO batch's statistics take tens of microseconds, less than waking a second thread
// can cost on a loaded machine (measured: 8x slower with 2 threads on a busy 2-core VM).
constexpr int64_t kGrainElements = int64_t(1) << 18;
// Rows of a group whose advantages are computed together before the broadcast, when T > 1.
constexpr int64_t kChunk = 64;

// How a group maps a member's score s to its advantage (docs/ops.md#group_advantages): 0 when
// the group's scores are all equal (and it has more than one), else (s - center) / divisor or
// (s - center) * scale. A group of one has baseline 0 and std 1 (veRL's convention): center 0,
// and s - 0.0 is s exactly, as is a product by 1.0. These are the float64 operations of the CUDA
// kernel's group_advantage, one advantage at a time, so the bits are the same.
struct GroupMap {
  double center = 0.0, divisor = 1.0, scale = 1.0;
  bool zero = false, divide = false;
};

GroupMap group_map(int64_t n, double mean, double sq_dev, bool all_equal, const GroupAdvantagesArgs& a) {
  GroupMap m;
  if (n == 1) {
    m.divide = a.std_normalize && !a.rloo;
    m.divisor = 1.0 + a.eps;
    return m;
  }
  if (all_equal) {
    m.zero = true;
    return m;
  }
  m.center = mean;
  if (a.rloo) {
    m.scale = static_cast<double>(n) / static_cast<double>(n - 1);
  } else if (a.std_normalize) {
    m.divide = true;
    m.divisor = std::sqrt(sq_dev / static_cast<double>(n - 1)) + a.eps;
  }
  return m;
}

inline double advantage(const GroupMap& m, double s) {
  if (m.zero) return 0.0;
  const double d = s - m.center;
  return m.divide ? d / m.divisor : d * m.scale;
}

// v[i] = advantage(m, s[i]) for n scores, the branch taken once per group so the loop vectorises.
template <typename T>
void group_values(const GroupMap& m, const T* __restrict s, int64_t n, T* __restrict v) {
  if (m.zero) {
    std::fill(v, v + n, T(0));
    return;
  }
  const double c = m.center;
  if (m.divide) {
    const double q = m.divisor;
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<T>((static_cast<double>(s[i]) - c) / q);
  } else {
    const double k = m.scale;
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<T>((static_cast<double>(s[i]) - c) * k);
  }
}

// The unsigned integer of T's width: the masks below act on a value's bits.
template <typename T>
using Bits = std::conditional_t<sizeof(T) == sizeof(uint32_t), uint32_t, uint64_t>;

// o[t] = m[t] ? v : +0.0 for a row, without a branch (a random mask mispredicts) and without
// v * mask (NaN for an infinite v): v's bits ANDed with all ones or zero, which vectorises.
template <typename T>
void fill_row(T v, const bool* m, T* o, int64_t n) {
  using U = Bits<T>;
  U vb;
  std::memcpy(&vb, &v, sizeof vb);
  const uint8_t* __restrict mb = reinterpret_cast<const uint8_t*>(m);
  T* __restrict out = o;
  for (int64_t t = 0; t < n; ++t) {
    const U bits = vb & (U(0) - static_cast<U>(mb[t]));
    T x;
    std::memcpy(&x, &bits, sizeof x);
    out[t] = x;
  }
}

// o[i] = m[i] ? o[i] : +0.0 in place: the T = 1 broadcast, on values already written.
template <typename T>
void mask_in_place(T* o, const bool* m, int64_t n) {
  using U = Bits<T>;
  const uint8_t* __restrict mb = reinterpret_cast<const uint8_t*>(m);
  T* __restrict out = o;
  for (int64_t i = 0; i < n; ++i) {
    U bits;
    std::memcpy(&bits, &out[i], sizeof bits);
    bits &= U(0) - static_cast<U>(mb[i]);
    std::memcpy(&out[i], &bits, sizeof bits);
  }
}

// The first non-finite score, or -1: a branch-free pass per block (it vectorises), the element
// looked for only in a block that has one.
template <typename T>
int64_t first_non_finite(const T* s, int64_t B) {
  constexpr int64_t kBlock = 1024;
  for (int64_t b0 = 0; b0 < B; b0 += kBlock) {
    const int64_t b1 = std::min(B, b0 + kBlock);
    int bad = 0;
    for (int64_t b = b0; b < b1; ++b) bad |= !(std::fabs(s[b]) <= std::numeric_limits<T>::max());
    if (bad)
      for (int64_t b = b0; b < b1; ++b)
        if (!std::isfinite(s[b])) return b;
  }
  return -1;
}

// With group_size every group has n members, so what group_map decides from n and the options is
// decided once per call; a group adds only its center, its divisor (std_normalize) and whether its
// scores are all equal: block_maps gives group_map's maps, with group_map's operations.
struct SizedMode {
  bool single;       // n == 1: center 0, no equal-scores rule
  bool std_divisor;  // the divisor is the group's sqrt(sq / (n - 1)) + eps
  bool divide;
  double divisor, scale;  // when not per group
};

SizedMode sized_mode(int64_t n, const GroupAdvantagesArgs& a) {
  SizedMode m;
  m.single = n == 1;
  m.std_divisor = !m.single && !a.rloo && a.std_normalize;
  m.divide = m.single ? a.std_normalize && !a.rloo : m.std_divisor;
  m.divisor = 1.0 + a.eps;
  m.scale = !m.single && a.rloo ? static_cast<double>(n) / static_cast<double>(n - 1) : 1.0;
  return m;
}

// The maps of a block of K consecutive groups of n rows from s. Each group's scores are added one
// by one in row order; lane k is group k, so the K groups' dependency chains (n adds, a divide,
// n squared deviations, a square root) interleave instead of running one after another, which is
// where a small group's time goes. Each lane performs its group's operations in the order a lone
// group would: K changes no bit.
template <int K, typename T>
void block_maps(const T* s, int64_t n, const SizedMode& mode, double eps, GroupMap* maps) {
  for (int k = 0; k < K; ++k) {
    maps[k] = GroupMap();
    maps[k].divisor = mode.divisor;
    maps[k].scale = mode.scale;
    maps[k].divide = mode.divide;
  }
  if (mode.single) return;  // center 0, no equal-scores rule
  double sum[K], lo[K], hi[K];
  for (int k = 0; k < K; ++k) {
    sum[k] = 0.0;
    lo[k] = hi[k] = static_cast<double>(s[k * n]);
  }
  for (int64_t i = 0; i < n; ++i)
    for (int k = 0; k < K; ++k) {
      const double v = static_cast<double>(s[k * n + i]);
      lo[k] = std::min(lo[k], v);
      hi[k] = std::max(hi[k], v);
      sum[k] += v;
    }
  double mean[K];
  for (int k = 0; k < K; ++k) {
    mean[k] = sum[k] / static_cast<double>(n);
    maps[k].center = mean[k];
    maps[k].zero = lo[k] == hi[k];
  }
  if (!mode.std_divisor) return;  // the squared deviations are not used
  double sq[K];
  for (int k = 0; k < K; ++k) sq[k] = 0.0;
  for (int64_t i = 0; i < n; ++i)
    for (int k = 0; k < K; ++k) {
      const double d = static_cast<double>(s[k * n + i]) - mean[k];
      sq[k] += d * d;  // -ffp-contract=off: a multiply, then an add, as on CUDA
    }
  // ATen's vectors: their sqrt is the instruction (IEEE, the bits of std::sqrt) without std::sqrt's
  // errno check, which keeps the compiler from vectorising the lanes' divide-sqrt-add chains.
  using VecD = at::vec::Vectorized<double>;
  double divisor[K];
  for (int k = 0; k < K; k += VecD::size()) {
    const int count = std::min<int>(VecD::size(), K - k);
    const VecD var = VecD::loadu(sq + k, count) / VecD(static_cast<double>(n - 1));
    (var.sqrt() + VecD(eps)).store(divisor + k, count);
  }
  for (int k = 0; k < K; ++k) maps[k].divisor = divisor[k];
}

template <typename T>
void contiguous_groups(const GroupAdvantagesArgs& a) {
  constexpr int kLanes = 8;
  const T* sp = static_cast<const T*>(a.scores);
  const bool* mp = a.mask;
  T* op = static_cast<T*>(a.advantages);
  const int64_t n = a.group_size, T_ = a.T, n_groups = a.B / n;
  const SizedMode mode = sized_mode(n, a);
  // Whole blocks of kLanes groups per task (a block is computed together, whatever the split).
  const int64_t blocks = (n_groups + kLanes - 1) / kLanes;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (kLanes * n * (T_ + 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t k0, int64_t k1) {
    T chunk[kChunk];
    GroupMap maps[kLanes];
    for (int64_t g0 = k0 * kLanes; g0 < std::min(n_groups, k1 * kLanes); g0 += kLanes) {
      const int64_t lanes = std::min<int64_t>(kLanes, n_groups - g0);
      if (lanes == kLanes) {
        block_maps<kLanes>(sp + g0 * n, n, mode, a.eps, maps);
      } else {
        for (int64_t k = 0; k < lanes; ++k) block_maps<1>(sp + (g0 + k) * n, n, mode, a.eps, maps + k);
      }
      if (T_ == 1) {
        // The block's rows are contiguous: each group's values (a loop of doubles only, which
        // vectorises whole for a small n), then the mask over the block at once (a loop with
        // bytes in it vectorises 32 or 64 elements at a time: per group of 8 it would not).
        T* o = op + g0 * n;
        for (int64_t k = 0; k < lanes; ++k) group_values(maps[k], sp + (g0 + k) * n, n, o + k * n);
        mask_in_place(o, mp + g0 * n, lanes * n);
        continue;
      }
      for (int64_t k = 0; k < lanes; ++k) {
        const int64_t first = (g0 + k) * n;
        for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
          const int64_t rows = std::min(kChunk, n - i0);
          group_values(maps[k], sp + first + i0, rows, chunk);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t b = first + i0 + r;
            fill_row(chunk[r], mp + b * T_, op + b * T_, T_);
          }
        }
      }
    }
  });
}

template <typename T>
void id_groups(const GroupAdvantagesArgs& a) {
  const T* sp = static_cast<const T*>(a.scores);
  const int64_t* ids = a.group_ids;
  const int64_t B = a.B, T_ = a.T;
  // Indexed by group id (in [0, B)), accumulated in row order; one allocation for all of it.
  struct Group {
    int64_t n = 0;
    double sum = 0.0, lo = 0.0, hi = 0.0, sq = 0.0, mean = 0.0;
    GroupMap map;
  };
  std::vector<Group> groups(B);
  for (int64_t b = 0; b < B; ++b) {
    Group& g = groups[ids[b]];
    const double v = static_cast<double>(sp[b]);
    if (g.n++ == 0) {
      g.lo = g.hi = v;
    } else {
      g.lo = std::min(g.lo, v);
      g.hi = std::max(g.hi, v);
    }
    g.sum += v;
  }
  for (Group& g : groups)
    if (g.n > 0) g.mean = g.sum / static_cast<double>(g.n);
  for (int64_t b = 0; b < B; ++b) {
    Group& g = groups[ids[b]];
    const double d = static_cast<double>(sp[b]) - g.mean;
    g.sq += d * d;  // -ffp-contract=off: a multiply, then an add, as on CUDA
  }
  for (Group& g : groups)
    if (g.n > 0) g.map = group_map(g.n, g.mean, g.sq, g.lo == g.hi, a);

  const bool* mp = a.mask;
  T* op = static_cast<T*>(a.advantages);
  if (T_ == 1) {
    for (int64_t b = 0; b < B; ++b) op[b] = static_cast<T>(advantage(groups[ids[b]].map, static_cast<double>(sp[b])));
    mask_in_place(op, mp, B);
    return;
  }
  std::vector<T> row(B);
  for (int64_t b = 0; b < B; ++b) row[b] = static_cast<T>(advantage(groups[ids[b]].map, static_cast<double>(sp[b])));
  at::parallel_for(0, B, std::max<int64_t>(1, 65536 / std::max<int64_t>(T_, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) fill_row(row[b], mp + b * T_, op + b * T_, T_);
  });
}

template <typename T>
int64_t advantages(const GroupAdvantagesArgs& a) {
  const int64_t bad = first_non_finite(static_cast<const T*>(a.scores), a.B);
  if (bad >= 0 || a.B == 0 || a.T == 0) return bad;
  if (a.group_size > 0) {
    contiguous_groups<T>(a);
  } else {
    id_groups<T>(a);
  }
  return -1;
}

}  // namespace

int64_t group_advantages(const GroupAdvantagesArgs& a) {
  if (a.dtype == c10::ScalarType::Double) return advantages<double>(a);
  TORCH_CHECK(a.dtype == c10::ScalarType::Float, "pyppo.group_advantages: unsupported accumulation dtype ", a.dtype);
  return advantages<float>(a);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace pyppo
