// The reductions and the elementwise pass of masked_mean, masked_var and masked_whiten;
// compiled once per instruction set.
//
// Whole-tensor reductions are summed in fixed blocks of kBlock elements whose partial sums are
// then added in block order, in double: the result is the same bits whatever the thread count.
#include "cpu/kernels/kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace pyppo {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kBlock = 4096;
// Blocks per task: tensors under ~64K elements are summed on one thread.
constexpr int64_t kBlocksPerTask = 16;

// f(x, m, n) with x typed as the accumulation dtype (float or double).
template <typename F>
auto typed(const MaskedArgs& a, const char* op, F&& f) {
  if (a.dtype == c10::ScalarType::Double) return f(static_cast<const double*>(a.x));
  TORCH_CHECK(a.dtype == c10::ScalarType::Float, "pyppo.", op, ": unsupported accumulation dtype ", a.dtype);
  return f(static_cast<const float*>(a.x));
}

// v where b, else +0.0, without a branch (a random mask mispredicts half the time: 4x slower) and
// without multiplying by the mask (NaN * 0 is NaN): the bits are ANDed with all-ones or zero.
inline double keep_if(bool b, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits &= 0 - static_cast<uint64_t>(b);
  std::memcpy(&v, &bits, sizeof bits);
  return v;
}

// Sum of term(x[i]) and count over the masked-in i of [i0, e). kLanes independent accumulators,
// each taking every kLanes-th element, added in lane order at the end, so the compiler can
// vectorise the loop, and since the order is written out (no -ffast-math reassociation) every
// instruction set gives the same bits.
constexpr int kLanes = 8;

template <typename T, typename Term>
inline std::pair<double, int64_t> lane_sum(const T* x, const bool* m, int64_t i0, int64_t e, Term term) {
  double acc[kLanes] = {};
  int64_t cnt[kLanes] = {};
  int64_t i = i0;
  for (; i + kLanes <= e; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const bool b = m[i + j];
      acc[j] += keep_if(b, term(static_cast<double>(x[i + j])));
      cnt[j] += b;
    }
  for (int j = 0; i < e; ++i, ++j)
    if (m[i]) {
      acc[j] += term(static_cast<double>(x[i]));
      ++cnt[j];
    }
  double s = 0;
  int64_t c = 0;
  for (int j = 0; j < kLanes; ++j) {
    s += acc[j];
    c += cnt[j];
  }
  return {s, c};
}

// One double per block (and a count), then the blocks in order.
template <typename T, typename Term>
std::vector<double> block_sums(const T* x, const bool* m, int64_t n, Term term, std::vector<int64_t>* counts) {
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  std::vector<double> sums(nblocks, 0.0);
  if (counts) counts->assign(nblocks, 0);
  at::parallel_for(0, nblocks, kBlocksPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      auto [s, c] = lane_sum(x, m, k * kBlock, std::min(n, (k + 1) * kBlock), term);
      sums[k] = s;
      if (counts) (*counts)[k] = c;
    }
  });
  return sums;
}

}  // namespace

MaskedMoments masked_sum(const MaskedArgs& a) {
  return typed(a, "masked_sum", [&](const auto* x) {
    std::vector<int64_t> counts;
    std::vector<double> sums = block_sums(x, a.mask, a.n, [](double v) { return v; }, &counts);
    MaskedMoments out;
    for (size_t k = 0; k < sums.size(); ++k) {
      out.sum += sums[k];
      out.count += counts[k];
    }
    return out;
  });
}

double masked_sq_dev(const MaskedArgs& a, double mean) {
  return typed(a, "masked_var", [&](const auto* x) {
    std::vector<double> sums = block_sums(x, a.mask, a.n, [mean](double v) {
      const double d = v - mean;
      return d * d;
    }, nullptr);
    double out = 0;
    for (double s : sums) out += s;
    return out;
  });
}

void masked_whiten(const MaskedArgs& a, double mean, double inv_std, double add_back, void* out) {
  typed(a, "masked_whiten", [&](const auto* x) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(x)>>;
    T* o = static_cast<T*>(out);
    const bool* mp = a.mask;
    at::parallel_for(0, a.n, 65536, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        o[i] = static_cast<T>(keep_if(mp[i], (static_cast<double>(x[i]) - mean) * inv_std + add_back));
    });
    return 0;
  });
}

int64_t masked_mean_rows(const MaskedArgs& a, int64_t L, void* out) {
  return typed(a, "masked_mean", [&](const auto* x) -> int64_t {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(x)>>;
    const int64_t R = L == 0 ? 0 : a.n / L;
    const bool* mp = a.mask;
    // Validated before any work so the error names the first empty slice, not whichever a
    // thread hit.
    for (int64_t r = 0; r < R; ++r) {
      int64_t c = 0;
      for (int64_t j = 0; j < L; ++j) c += mp[r * L + j];
      if (c == 0) return r;
    }
    T* o = static_cast<T*>(out);
    at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(L, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        auto [s, c] = lane_sum(x + r * L, mp + r * L, 0, L, [](double v) { return v; });
        o[r] = static_cast<T>(s / static_cast<double>(c));
      }
    });
    return -1;
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace pyppo
