// GAE over agent turns: per row, one right-to-left loop over the turns computes each turn's
// advantage and return (stored at the turn's first position), then one left-to-right loop
// broadcasts them onto the turn's agent positions. Rows in parallel, each row by one thread in a
// fixed order, so a row's result depends neither on the thread count nor on the other rows;
// compiled once per instruction set. cuda/kernels/turn_gae_kernel.cu runs the same operations in
// the same order.
#include "cpu/kernels/kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace pyppo {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename T>
void turn_row(const T* rp, const T* vp, const int64_t* ip, T next_value, T g, T gl, T* ap, T* op, int64_t T_) {
  // 1. Right to left over the agent positions (turn_ids >= 0). A turn is a maximal run of agent
  //    positions with one id, environment positions between them skipped: the open turn closes
  //    at an agent position whose id differs, and its first position is the last agent position
  //    visited before it. Its reward is the sum of its agent positions' rewards (right to left),
  //    its value the value at its first position.
  T next_adv = 0;
  auto close = [&](int64_t start, T reward) {
    const T v = vp[start];
    const T delta = reward + g * next_value - v;
    next_adv = delta + gl * next_adv;
    next_value = v;
    ap[start] = next_adv;
    op[start] = next_adv + v;
  };
  bool open = false;
  int64_t id = 0, start = 0;
  T reward = 0;
  for (int64_t t = T_ - 1; t >= 0; --t) {
    const int64_t i = ip[t];
    if (i < 0) continue;
    if (open && i != id) {
      close(start, reward);
      open = false;
    }
    if (open) {
      reward = reward + rp[t];
    } else {
      open = true;
      id = i;
      reward = rp[t];
    }
    start = t;
  }
  if (open) close(start, reward);
  // 2. Left to right: a turn starts where the id differs from the previous agent position's (the
  //    same positions as above); its advantage and return were stored there.
  bool seen = false;
  T a = 0, r = 0;
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t i = ip[t];
    if (i < 0) {
      ap[t] = 0;
      op[t] = 0;
      continue;
    }
    if (!seen || i != id) {
      seen = true;
      id = i;
      a = ap[t];
      r = op[t];
    }
    ap[t] = a;
    op[t] = r;
  }
}

template <typename T>
void turn_rows(const TurnGaeArgs& a) {
  const T* rp = static_cast<const T*>(a.rewards);
  const T* vp = static_cast<const T*>(a.values);
  const T* bp = static_cast<const T*>(a.last_values);
  T* ap = static_cast<T*>(a.advantages);
  T* op = static_cast<T*>(a.returns);
  const T g = static_cast<T>(a.gamma);
  const T gl = static_cast<T>(a.gamma * a.lam);  // in double, rounded once, as gae has it
  const int64_t T_ = a.T;
  at::parallel_for(0, a.B, std::max<int64_t>(1, 65536 / std::max<int64_t>(T_, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o = b * T_;
      turn_row<T>(rp + o, vp + o, a.turn_ids + o, bp ? bp[b] : T(0), g, gl, ap + o, op + o, T_);
    }
  });
}

}  // namespace

void turn_gae(const TurnGaeArgs& a) {
  if (a.dtype == c10::ScalarType::Double) return turn_rows<double>(a);
  TORCH_CHECK(a.dtype == c10::ScalarType::Float, "pyppo.turn_gae: unsupported accumulation dtype ", a.dtype);
  turn_rows<float>(a);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace pyppo
