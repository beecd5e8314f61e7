// Group-relative advantages (GRPO, Dr. GRPO, RLOO): per-group statistics in float64, each
// group's scores added one by one in row order, then one advantage per row broadcast onto its
// valid positions (rows in parallel); compiled once per instruction set. The statistics are one
// serial pass over the B scores (a few thousand), so a group's advantages depend only on its
// members' scores and their order, never on the thread count or the other groups; the CUDA
// kernel (cuda/kernels/group_advantages_kernel.cu) performs the same float64 operations in the
// same order and gives the same bits.
#include "cpu/kernels/kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace pyppo {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// The advantage of a score s in a group of n with mean `mean` and sum of squared deviations
// sq_dev (docs/ops.md#group_advantages). A group of one has baseline 0 and std 1 (veRL's
// convention); a group whose scores are all equal gets exactly 0.
double group_advantage(double s, int64_t n, double mean, double sq_dev, bool all_equal,
                       const GroupAdvantagesArgs& a) {
  if (n == 1) return (a.std_normalize && !a.rloo) ? s / (1.0 + a.eps) : s;
  if (all_equal) return 0.0;
  const double d = s - mean;
  if (a.rloo) return d * (static_cast<double>(n) / static_cast<double>(n - 1));
  if (!a.std_normalize) return d;
  return d / (std::sqrt(sq_dev / static_cast<double>(n - 1)) + a.eps);
}

// o[t] = m[t] ? v : +0.0 for a row, without a branch (a random mask mispredicts) and without
// v * mask (NaN for an infinite v): v's bits ANDed with all ones or zero, which vectorises.
template <typename T>
void fill_row(T v, const bool* m, T* o, int64_t n) {
  using U = std::conditional_t<sizeof(T) == sizeof(uint32_t), uint32_t, uint64_t>;
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

template <typename T>
void advantages(const GroupAdvantagesArgs& a) {
  const T* sp = static_cast<const T*>(a.scores);
  const int64_t* ids = a.group_ids;
  const int64_t B = a.B, T_ = a.T;
  // Indexed by group id (in [0, B)), accumulated in row order.
  std::vector<int64_t> count(B, 0);
  std::vector<double> sum(B, 0.0), lo(B, 0.0), hi(B, 0.0), mean(B, 0.0), sq(B, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t g = ids[b];
    const double v = static_cast<double>(sp[b]);
    if (count[g]++ == 0) {
      lo[g] = hi[g] = v;
    } else {
      lo[g] = std::min(lo[g], v);
      hi[g] = std::max(hi[g], v);
    }
    sum[g] += v;
  }
  for (int64_t g = 0; g < B; ++g)
    if (count[g] > 0) mean[g] = sum[g] / static_cast<double>(count[g]);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t g = ids[b];
    const double d = static_cast<double>(sp[b]) - mean[g];
    sq[g] += d * d;  // -ffp-contract=off: a multiply, then an add, as on CUDA
  }
  std::vector<T> row(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t g = ids[b];
    row[b] = static_cast<T>(
        group_advantage(static_cast<double>(sp[b]), count[g], mean[g], sq[g], lo[g] == hi[g], a));
  }

  const bool* mp = a.mask;
  T* op = static_cast<T*>(a.advantages);
  at::parallel_for(0, B, std::max<int64_t>(1, 65536 / std::max<int64_t>(T_, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) fill_row(row[b], mp + b * T_, op + b * T_, T_);
  });
}

}  // namespace

void group_advantages(const GroupAdvantagesArgs& a) {
  if (a.dtype == c10::ScalarType::Double) return advantages<double>(a);
  TORCH_CHECK(a.dtype == c10::ScalarType::Float, "pyppo.group_advantages: unsupported accumulation dtype ", a.dtype);
  advantages<float>(a);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace pyppo
