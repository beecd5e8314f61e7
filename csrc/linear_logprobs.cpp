// linear_logprobs: log-probs straight from hidden states and the output embedding, chunk by
// chunk over tokens, so the [N, V] logits never exist at once (forward or backward).
//
// Device-generic: the GEMMs go through ATen (BLAS / cuBLAS) and the softmax part through the
// pyppo::gather_logprobs kernels of the same device, so one implementation serves CPU and CUDA.
#include "args/linear_logprobs.h"
#include "cpu/kernels/kernels.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace pyppo {
namespace {

// Chunk logits are kept to about this many bytes: large enough for efficient GEMMs (M of a few
// hundred tokens), small enough to stay a few % of what the full logits would take.
constexpr int64_t kChunkBytes = int64_t(128) << 20;

int64_t resolve_chunk(int64_t chunk_size, int64_t N, int64_t V) {
  if (chunk_size > 0) return chunk_size;
  return std::max<int64_t>(1, std::min<int64_t>(std::max<int64_t>(N, 1), kChunkBytes / (4 * std::max<int64_t>(V, 1))));
}

// Writes the logits of one chunk into the first rows of buf (allocated once per call and
// reused by every chunk: a fresh [C, V] allocation per chunk costs a page fault per 4 KiB).
at::Tensor chunk_logits(at::Tensor& buf, const at::Tensor& h, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  at::Tensor out = buf.narrow(0, 0, h.size(0));
  if (bias.has_value() && bias->defined())
    at::addmm_out(out, *bias, h, weight.t());
  else
    at::mm_out(out, h, weight.t());
  return out;
}

std::optional<at::Tensor> slice_opt(const at::Tensor& t, int64_t a, int64_t b) {
  if (!t.defined()) return std::nullopt;
  return t.slice(0, a, b);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprobs_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index, bool return_entropy,
    int64_t chunk_size) {
  LinearInputs f = prepare_linear(hidden, weight, labels, mask, bias, temperature, ignore_index, chunk_size);
  const int64_t C = resolve_chunk(chunk_size, f.N, f.V);
  static auto gather = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("pyppo::gather_logprobs", "")
                           .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                               const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, int64_t,
                               bool)>();
  LogprobsOutputs out = alloc_logprobs_outputs(labels, out_options(hidden), return_entropy);
  at::Tensor logprobs = out.logprobs.view({f.N}), lse = out.lse.view({f.N});
  at::Tensor entropy = return_entropy ? out.entropy.view({f.N}) : out.entropy;
  at::Tensor buf = at::empty({std::min(C, f.N), f.V}, hidden.options());
  for (int64_t a = 0; a < f.N; a += C) {
    const int64_t b = std::min(f.N, a + C);
    at::Tensor logits = chunk_logits(buf, f.hidden.slice(0, a, b), weight, bias);
    auto [lp, ent, l] = gather.call(logits, f.labels.slice(0, a, b), slice_opt(f.mask, a, b), temperature,
                                    ignore_index, return_entropy);
    logprobs.slice(0, a, b).copy_(lp);
    lse.slice(0, a, b).copy_(l);
    if (return_entropy) entropy.slice(0, a, b).copy_(ent);
  }
  return out.tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprobs_backward_impl(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
    double temperature, int64_t ignore_index, int64_t chunk_size, std::array<bool, 3> output_mask) {
  check_linear_logprobs_backward(grad_logprobs, grad_entropy, hidden, weight, labels, mask, bias, lse, entropy,
                                 temperature, chunk_size);
  LinearInputs f = prepare_linear(hidden, weight, labels, mask, bias, temperature, ignore_index, chunk_size);
  const int64_t C = resolve_chunk(chunk_size, f.N, f.V);
  static auto gather_bwd = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("pyppo::gather_logprobs_backward", "")
                               .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                                 const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                                 const std::optional<at::Tensor>&, double, int64_t)>();
  const bool has_ent = grad_entropy.has_value() && grad_entropy->defined();
  at::Tensor g_lp = grad_logprobs.reshape({f.N});
  at::Tensor l = lse.reshape({f.N});
  at::Tensor g_ent = has_ent ? grad_entropy->reshape({f.N}) : at::Tensor();
  at::Tensor ent = has_ent ? entropy->reshape({f.N}) : at::Tensor();
  const bool has_bias = bias.has_value() && bias->defined();
  const auto wacc = out_dtype(weight);
  at::Tensor grad_hidden = output_mask[0] ? at::empty({f.N, f.H}, hidden.options()) : at::Tensor();
  // Accumulated over chunks in float32 (float64 for float64): a bf16 accumulator would lose
  // the small per-chunk contributions.
  at::Tensor grad_weight = output_mask[1] ? at::zeros({f.V, f.H}, weight.options().dtype(wacc)) : at::Tensor();
  at::Tensor grad_bias = (output_mask[2] && has_bias) ? at::zeros({f.V}, weight.options().dtype(wacc)) : at::Tensor();
  // On CPU the gradient overwrites the chunk's logits in place (the row kernel reads each
  // element before writing it), so the backward holds one [C, V] buffer, not two.
  const bool cpu_inplace = hidden.device().is_cpu();
  at::Tensor g_lp_c, lse_c, g_ent_c, ent_c;
  if (cpu_inplace) {
    const auto acc = out_dtype(hidden);
    g_lp_c = g_lp.to(acc).contiguous();
    lse_c = l.to(acc).contiguous();
    if (has_ent) {
      g_ent_c = g_ent.to(acc).contiguous();
      ent_c = ent.to(acc).contiguous();
    }
  }
  at::Tensor buf = at::empty({std::min(C, std::max<int64_t>(f.N, 1)), f.V}, hidden.options());
  for (int64_t a = 0; a < f.N; a += C) {
    const int64_t b = std::min(f.N, a + C);
    at::Tensor h = f.hidden.slice(0, a, b);
    at::Tensor g = chunk_logits(buf, h, weight, bias);  // recomputed, never saved
    if (cpu_inplace) {
      GatherInputs rows;
      rows.logits = g;
      rows.labels = f.labels.slice(0, a, b);
      if (f.mask.defined()) rows.mask = f.mask.slice(0, a, b);
      rows.N = b - a;
      rows.V = f.V;
      cpu::GatherBwdArgs ga;
      ga.dtype = g.scalar_type();
      fill_gather_rows(ga, rows, ignore_index, temperature);
      ga.grad_logprobs = g_lp_c.slice(0, a, b).const_data_ptr();
      ga.grad_entropy = has_ent ? g_ent_c.slice(0, a, b).const_data_ptr() : nullptr;
      ga.lse = lse_c.slice(0, a, b).const_data_ptr();
      ga.entropy = has_ent ? ent_c.slice(0, a, b).const_data_ptr() : nullptr;
      ga.grad_logits = g.data_ptr();
      cpu::cpu_kernels().gather_bwd(ga);
    } else {
      g = gather_bwd.call(g_lp.slice(0, a, b), slice_opt(g_ent, a, b), g, f.labels.slice(0, a, b),
                          slice_opt(f.mask, a, b), l.slice(0, a, b), slice_opt(ent, a, b), temperature, ignore_index);
    }
    if (output_mask[0]) {
      at::Tensor out = grad_hidden.slice(0, a, b);
      at::mm_out(out, g, weight);
    }
    if (output_mask[1]) {
      grad_weight.addmm_(g.t().to(wacc), h.to(wacc));
    }
    if (grad_bias.defined()) grad_bias.add_(g.sum(0, false, wacc));
  }
  // Gradients that were not asked for come back as empty tensors (a schema output cannot be None).
  auto none = [&] { return at::empty({0}, hidden.options()); };
  return {output_mask[0] ? grad_hidden.view(hidden.sizes()) : none(),
          grad_weight.defined() ? grad_weight.to(weight.scalar_type()) : none(),
          grad_bias.defined() ? grad_bias.to(weight.scalar_type()) : none()};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("linear_logprobs", &linear_logprobs_impl);
  m.impl("linear_logprobs_backward", &linear_logprobs_backward_impl);
}
#ifdef PYPPO_WITH_CUDA
TORCH_LIBRARY_IMPL(pyppo, CUDA, m) {
  m.impl("linear_logprobs", &linear_logprobs_impl);
  m.impl("linear_logprobs_backward", &linear_logprobs_backward_impl);
}
#endif

}  // namespace pyppo
