// linear_logprobs: log-probs straight from hidden states and the output embedding, chunk by
// chunk over tokens, so the [N, V] logits never exist at once (forward or backward).
//
// Device-generic (linear/chunks.h): one implementation serves CPU and CUDA, registered for each in
// cpu/linear_logprobs_impl.cpp and cuda/linear_logprobs_impl.cpp.
#include "linear/linear_logprobs.h"

#include "checks/linear_logprobs.h"
#include "linear/chunks.h"

#include <ATen/ATen.h>

namespace pyppo {

using namespace linear_chunks;

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprobs_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index, bool return_entropy,
    int64_t chunk_size) {
  LinearInputs f = prepare_linear(hidden, weight, labels, mask, bias, temperature, ignore_index, chunk_size);
  const int64_t C = resolve_chunk(chunk_size, f.N, f.V);
  LogprobsOutputs out = alloc_logprobs_outputs(labels, out_options(hidden), return_entropy);
  at::Tensor logprobs = out.logprobs.view({f.N}), lse = out.lse.view({f.N});
  at::Tensor entropy = return_entropy ? out.entropy.view({f.N}) : out.entropy;
  at::Tensor buf = chunk_buffer(f, C, hidden);
  const LabelsCheckedScope checked;
  for (int64_t a = 0; a < f.N; a += C) {
    const int64_t b = std::min(f.N, a + C);
    at::Tensor logits = chunk_logits(buf, f.hidden.slice(0, a, b), weight, bias);
    auto [lp, ent, l] = gather_rows(logits, f, a, b, temperature, ignore_index, return_entropy);
    logprobs.slice(0, a, b).copy_(lp);
    lse.slice(0, a, b).copy_(l);
    if (return_entropy) entropy.slice(0, a, b).copy_(ent);
  }
  f.label_check.finish();
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
  const bool has_ent = grad_entropy.has_value() && grad_entropy->defined();
  const auto acc = out_dtype(hidden);
  const at::Tensor g_lp = flat_acc(grad_logprobs, acc, f.N), l = flat_acc(lse, acc, f.N);
  const at::Tensor g_ent = has_ent ? flat_acc(*grad_entropy, acc, f.N) : at::Tensor();
  const at::Tensor ent = has_ent ? flat_acc(*entropy, acc, f.N) : at::Tensor();
  LinearGrads grads(f, hidden, weight, has(bias), output_mask);
  at::Tensor buf = chunk_buffer(f, C, hidden);
  const LabelsCheckedScope checked;
  for (int64_t a = 0; a < f.N; a += C) {
    const int64_t b = std::min(f.N, a + C);
    const at::Tensor h = f.hidden.slice(0, a, b);
    at::Tensor g = chunk_logits(buf, h, weight, bias);  // recomputed, never saved
    g = logits_grad(g, f, a, b, g_lp.slice(0, a, b), has_ent ? g_ent.slice(0, a, b) : g_ent, l.slice(0, a, b),
                    has_ent ? ent.slice(0, a, b) : ent, temperature, ignore_index);
    grads.add_chunk(g, h, weight, a, b);
  }
  f.label_check.finish();
  return grads.finish(hidden, weight);
}

}  // namespace pyppo
