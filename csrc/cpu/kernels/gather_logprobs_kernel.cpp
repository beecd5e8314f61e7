// gather_logprobs forward and backward row loops; compiled once per instruction set.
//
// Each row is reduced by exactly one thread in a fixed order, so the result depends neither on
// the thread count nor on the other rows of the batch: log-probs computed at rollout time and
// at training time agree bit for bit.
#include "cpu/kernels/kernels.h"
#include "cpu/kernels/row_softmax.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <vector>

namespace pyppo {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// Rows per task: at least ~64K elements, so small calls stay on one thread (waking the pool
// costs more than they do).
int64_t grain_for(int64_t V) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(V, 1)); }

// task(begin, end) over [0, N) in tasks of grain_for(V) rows, handed out from a shared counter
// instead of cut into one equal share per thread up front: on a shared machine a thread that
// loses its core for a while no longer holds the whole call back, the others take its rows.
// Which thread reduces a row never changes that row's bits.
template <typename Task>
void parallel_rows(int64_t N, int64_t V, const Task& task) {
  const int64_t grain = grain_for(V);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) return task(0, N);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(grain); b < N; b = next.fetch_add(grain)) task(b, std::min(N, b + grain));
  });
}

inline bool row_valid(const int64_t* lab, const bool* msk, int64_t i, int64_t ignore_index) {
  return (!msk || msk[i]) && lab[i] != ignore_index;
}

template <typename scalar_t, typename acc_t>
void fwd(const GatherFwdArgs& a) {
  const scalar_t* z = static_cast<const scalar_t*>(a.logits);
  acc_t* out_lp = static_cast<acc_t*>(a.logprobs);
  acc_t* out_lse = static_cast<acc_t*>(a.lse);
  acc_t* out_ent = static_cast<acc_t*>(a.entropy);
  const acc_t inv_tau = acc_t(1) / static_cast<acc_t>(a.temperature);
  parallel_rows(a.N, a.V, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(kRowBlock);
    for (int64_t i = begin; i < end; ++i) {
      if (!row_valid(a.labels, a.mask, i, a.ignore_index)) {
        out_lp[i] = 0;
        out_lse[i] = 0;
        if (out_ent) out_ent[i] = 0;
        continue;
      }
      const scalar_t* row = z + row_offset(a.rows, i);
      RowStats<acc_t> st = row_logsumexp<scalar_t, acc_t>(row, a.V, inv_tau, out_ent != nullptr, buf.data());
      out_lse[i] = st.lse;
      // log p <= 0 exactly (the max's exp is exactly 1, so lse >= max); the min is a guard that
      // keeps a NaN row NaN.
      const acc_t lp = static_cast<acc_t>(row[a.labels[i]]) * inv_tau - st.lse;
      out_lp[i] = lp > acc_t(0) ? acc_t(0) : lp;
      if (out_ent) out_ent[i] = st.entropy;
    }
  });
}

template <typename scalar_t, typename acc_t>
void bwd(const GatherBwdArgs& a) {
  const scalar_t* z = static_cast<const scalar_t*>(a.logits);
  scalar_t* gz = static_cast<scalar_t*>(a.grad_logits);
  const acc_t* glp = static_cast<const acc_t*>(a.grad_logprobs);
  const acc_t* ge = static_cast<const acc_t*>(a.grad_entropy);
  const acc_t* lse = static_cast<const acc_t*>(a.lse);
  const acc_t* h = static_cast<const acc_t*>(a.entropy);
  const acc_t inv_tau = acc_t(1) / static_cast<acc_t>(a.temperature);
  parallel_rows(a.N, a.V, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      scalar_t* out = gz + i * a.V;
      if (!row_valid(a.labels, a.mask, i, a.ignore_index)) {
        std::fill(out, out + a.V, scalar_t(0));
        continue;
      }
      row_softmax_grad<scalar_t, acc_t>(z + row_offset(a.rows, i), out, a.V, inv_tau, lse[i], glp[i],
                                        ge ? ge[i] : acc_t(0), h ? h[i] : acc_t(0), a.labels[i]);
    }
  });
}

// f(scalar_t{}, acc_t{}) for the logits' dtype: float32 and the half types accumulate in float.
template <typename F>
void by_dtype(c10::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float: return f(float{}, float{});
    case c10::ScalarType::Double: return f(double{}, double{});
    case c10::ScalarType::BFloat16: return f(c10::BFloat16{}, float{});
    case c10::ScalarType::Half: return f(c10::Half{}, float{});
    default: TORCH_CHECK(false, "pyppo.", op, ": unsupported dtype ", dtype);
  }
}

}  // namespace

void gather_fwd(const GatherFwdArgs& a) {
  by_dtype(a.dtype, "gather_logprobs", [&](auto s, auto acc) { fwd<decltype(s), decltype(acc)>(a); });
}

void gather_bwd(const GatherBwdArgs& a) {
  by_dtype(a.dtype, "gather_logprobs_backward", [&](auto s, auto acc) { bwd<decltype(s), decltype(acc)>(a); });
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace pyppo
