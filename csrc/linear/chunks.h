// The parts of a chunked pass over hidden states that linear_logprobs and linear_ppo_loss share:
// the chunk size, one chunk's logits GEMM, the softmax backward of a chunk's rows, and the GEMMs
// that turn a chunk's logits gradient into the gradients of hidden, weight and bias.
//
// Device-generic: the GEMMs go through ATen (BLAS / cuBLAS) and the softmax part through the
// pyppo::gather_logprobs kernels of the same device.
#pragma once

#include "checks/linear_logprobs.h"
#include "cpu/kernels/kernels.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <array>

namespace pyppo {
namespace linear_chunks {

// Chunk logits are kept to about this many bytes: large enough for efficient GEMMs (M of a few
// hundred tokens), small enough to stay a few % of what the full logits would take.
constexpr int64_t kChunkBytes = int64_t(128) << 20;

inline int64_t resolve_chunk(int64_t chunk_size, int64_t N, int64_t V) {
  if (chunk_size > 0) return chunk_size;
  return std::max<int64_t>(1, std::min<int64_t>(std::max<int64_t>(N, 1), kChunkBytes / (4 * std::max<int64_t>(V, 1))));
}

// The one [C, V] buffer every chunk's logits are written into (a fresh [C, V] allocation per
// chunk costs a page fault per 4 KiB).
inline at::Tensor chunk_buffer(const LinearInputs& f, int64_t C, const at::Tensor& hidden) {
  return at::empty({std::min(C, std::max<int64_t>(f.N, 1)), f.V}, hidden.options());
}

// Writes the logits of one chunk into the first rows of buf.
inline at::Tensor chunk_logits(at::Tensor& buf, const at::Tensor& h, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  at::Tensor out = buf.narrow(0, 0, h.size(0));
  if (bias.has_value() && bias->defined())
    at::addmm_out(out, *bias, h, weight.t());
  else
    at::mm_out(out, h, weight.t());
  return out;
}

inline std::optional<at::Tensor> slice_opt(const at::Tensor& t, int64_t a, int64_t b) {
  if (!t.defined()) return std::nullopt;
  return t.slice(0, a, b);
}

using GatherFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                const std::optional<at::Tensor>&, double, int64_t,
                                                                bool);
using GatherBwdFn = at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                               const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                               const std::optional<at::Tensor>&, double, int64_t);

// pyppo::gather_logprobs of rows [a, b): (logprobs, entropy, lse) of the chunk's logits.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_rows(const at::Tensor& logits, const LinearInputs& f,
                                                                  int64_t a, int64_t b, double temperature,
                                                                  int64_t ignore_index, bool return_entropy) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyppo::gather_logprobs", "").typed<GatherFn>();
  return op.call(logits, f.labels.slice(0, a, b), slice_opt(f.mask, a, b), temperature, ignore_index,
                 return_entropy);
}

// d loss / d logits of rows [a, b) from d loss / d (logprobs, entropy) of those rows ([b - a]
// each; g_ent and ent undefined when no entropy gradient flows). On CPU the gradient overwrites
// the chunk's logits in place (the row kernel reads each element before writing it), so a chunk
// holds one [C, V] buffer, not two; elsewhere the device's gather_logprobs_backward writes a
// fresh one.
inline at::Tensor logits_grad(const at::Tensor& logits, const LinearInputs& f, int64_t a, int64_t b,
                              const at::Tensor& g_lp, const at::Tensor& g_ent, const at::Tensor& lse,
                              const at::Tensor& ent, double temperature, int64_t ignore_index) {
  const bool has_ent = g_ent.defined();
  if (!logits.device().is_cpu()) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("pyppo::gather_logprobs_backward", "").typed<GatherBwdFn>();
    return op.call(g_lp, has_ent ? std::optional<at::Tensor>(g_ent) : std::nullopt, logits,
                   f.labels.slice(0, a, b), slice_opt(f.mask, a, b), lse,
                   has_ent ? std::optional<at::Tensor>(ent) : std::nullopt, temperature, ignore_index);
  }
  const auto acc = out_dtype(logits);
  const at::Tensor gl = g_lp.to(acc).contiguous(), l = lse.to(acc).contiguous();
  const at::Tensor ge = has_ent ? g_ent.to(acc).contiguous() : at::Tensor();
  const at::Tensor e = has_ent ? ent.to(acc).contiguous() : at::Tensor();
  GatherInputs rows;
  rows.labels = f.labels.slice(0, a, b);
  if (f.mask.defined()) rows.mask = f.mask.slice(0, a, b);
  rows.N = b - a;
  rows.V = f.V;
  set_logits_rows(rows, logits);  // a contiguous [C, V] chunk: read in place
  cpu::GatherBwdArgs ga;
  ga.dtype = logits.scalar_type();
  fill_gather_rows(ga, rows, ignore_index, temperature);
  ga.grad_logprobs = gl.const_data_ptr();
  ga.grad_entropy = has_ent ? ge.const_data_ptr() : nullptr;
  ga.lse = l.const_data_ptr();
  ga.entropy = has_ent ? e.const_data_ptr() : nullptr;
  ga.grad_logits = logits.data_ptr();
  cpu::cpu_kernels().gather_bwd(ga);
  return logits;
}

// grad_hidden, grad_weight and grad_bias, filled chunk by chunk; `want` says which are wanted.
class LinearGrads {
 public:
  LinearGrads(const LinearInputs& f, const at::Tensor& hidden, const at::Tensor& weight, bool has_bias,
              std::array<bool, 3> want)
      : acc_(out_dtype(weight)) {
    if (want[0]) hidden_ = at::empty({f.N, f.H}, hidden.options());
    // Accumulated over chunks in float32 (float64 for float64): a bf16 accumulator would lose
    // the small per-chunk contributions.
    if (want[1]) weight_ = at::zeros({f.V, f.H}, weight.options().dtype(acc_));
    if (want[2] && has_bias) bias_ = at::zeros({f.V}, weight.options().dtype(acc_));
  }

  bool any() const { return hidden_.defined() || weight_.defined() || bias_.defined(); }

  // g = d loss / d logits of rows [a, b), whose hidden states are h.
  void add_chunk(const at::Tensor& g, const at::Tensor& h, const at::Tensor& weight, int64_t a, int64_t b) {
    if (hidden_.defined()) {
      at::Tensor out = hidden_.slice(0, a, b);
      at::mm_out(out, g, weight);
    }
    if (weight_.defined()) weight_.addmm_(g.t().to(acc_), h.to(acc_));
    if (bias_.defined()) bias_.add_(g.sum(0, false, acc_));
  }

  // (grad_hidden in hidden's shape, grad_weight, grad_bias) in the inputs' dtypes; one that was
  // not wanted is an empty tensor (a schema output cannot be None).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> finish(const at::Tensor& hidden, const at::Tensor& weight) const {
    auto none = [&] { return at::empty({0}, hidden.options()); };
    return {hidden_.defined() ? hidden_.view(hidden.sizes()) : none(),
            weight_.defined() ? weight_.to(weight.scalar_type()) : none(),
            bias_.defined() ? bias_.to(weight.scalar_type()) : none()};
  }

 private:
  at::ScalarType acc_;
  at::Tensor hidden_, weight_, bias_;
};

}  // namespace linear_chunks
}  // namespace pyppo
