// Generalized Advantage Estimation: one right-to-left scan per row, rows in parallel; compiled
// once per instruction set. Each row is scanned by one thread in a fixed order, so its result
// depends neither on the thread count nor on the other rows.
#include "cpu/kernels/kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace pyppo {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename T>
void scan_rows(const GaeArgs& a) {
  const T* rp = static_cast<const T*>(a.rewards);
  const T* vp = static_cast<const T*>(a.values);
  const bool* mp = a.mask;
  const T* bp = static_cast<const T*>(a.last_values);
  T* ap = static_cast<T*>(a.advantages);
  T* op = static_cast<T*>(a.returns);
  const T g = static_cast<T>(a.gamma);
  const T gl = static_cast<T>(a.gamma * a.lam);
  const int64_t T_ = a.T;
  at::parallel_for(0, a.B, std::max<int64_t>(1, 65536 / std::max<int64_t>(T_, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      // next_value / next_adv belong to the next *valid* position: a masked position in the
      // middle of a row (a tool output, an observation) is skipped without breaking the chain.
      T next_value = bp ? bp[b] : T(0);
      T next_adv = 0;
      for (int64_t t = T_ - 1; t >= 0; --t) {
        const int64_t i = b * T_ + t;
        if (!mp[i]) {
          ap[i] = 0;
          op[i] = 0;
          continue;
        }
        const T delta = rp[i] + g * next_value - vp[i];
        next_adv = delta + gl * next_adv;
        next_value = vp[i];
        ap[i] = next_adv;
        op[i] = next_adv + vp[i];
      }
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
