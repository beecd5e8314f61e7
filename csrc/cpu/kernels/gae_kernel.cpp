// Generalized Advantage Estimation: one right-to-left scan per row, rows in parallel; compiled
// once per instruction set. Each row is scanned by one thread in a fixed order, so its result
// depends neither on the thread count nor on the other rows. The advantages use the row's lam
// (row_lam[b], else lam); the returns use lam_critic when it differs, from a second running
// advantage in the same scan: the same operations as a call with lam = lam_critic, so the
// returns are that call's bits.
#include "cpu/kernels/kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

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

template <typename T>
void scan_rows(const GaeArgs& a) {
  const T* rp = static_cast<const T*>(a.rewards);
  const T* vp = static_cast<const T*>(a.values);
  const T* bp = static_cast<const T*>(a.last_values);
  T* ap = static_cast<T*>(a.advantages);
  T* op = static_cast<T*>(a.returns);
  const T g = static_cast<T>(a.gamma);
  const int64_t T_ = a.T;
  at::parallel_for(0, a.B, std::max<int64_t>(1, 65536 / std::max<int64_t>(T_, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      // gamma * lam in double, then rounded once: a row's lam from row_lam gives the bits a
      // call with that lam gives.
      const T gl = static_cast<T>(a.gamma * (a.row_lam ? a.row_lam[b] : a.lam));
      const T gl_c = a.has_lam_critic ? static_cast<T>(a.gamma * a.lam_critic) : gl;
      const int64_t o = b * T_;
      const T last = bp ? bp[b] : T(0);
      if (gl_c == gl)
        scan_row<T, false>(rp + o, vp + o, a.mask + o, last, g, gl, gl, ap + o, op + o, T_);
      else
        scan_row<T, true>(rp + o, vp + o, a.mask + o, last, g, gl, gl_c, ap + o, op + o, T_);
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
