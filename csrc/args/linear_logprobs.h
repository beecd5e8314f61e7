// linear_logprobs (and its backward): argument checks and messages, and the flattening of the
// inputs to [N, H] / [N]. The labels are checked as gather_logprobs checks them. See
// docs/ops.md#linear_logprobs.
#pragma once

#include "args/gather_logprobs.h"

namespace pyppo {

struct LinearInputs {
  at::Tensor hidden;  // [N, H]
  at::Tensor labels;  // [N] int64, contiguous
  at::Tensor mask;    // [N] bool, contiguous, or undefined
  int64_t N = 0, H = 0, V = 0;
};

// Everything linear_logprobs checks without reading data (the Meta kernel's checks).
// chunk_size 0 means "chosen from N and V".
inline void check_linear_logprobs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                  const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                                  double temperature, int64_t chunk_size) {
  const char* op = "linear_logprobs";
  check_float(op, "hidden", hidden);
  check_float(op, "weight", weight);
  TORCH_CHECK_VALUE(hidden.dim() >= 1, "pyppo.linear_logprobs: hidden must have shape [*, H], got a 0-d tensor");
  TORCH_CHECK_VALUE(weight.dim() == 2, "pyppo.linear_logprobs: weight must have shape [V, H], got ", weight.sym_sizes());
  TORCH_CHECK_VALUE(weight.sym_size(1) == hidden.sym_size(-1), "pyppo.linear_logprobs: weight has shape ",
                    weight.sym_sizes(), " but hidden has H = ", hidden.sym_size(-1), "; weight must be [V, H]");
  TORCH_CHECK_VALUE(weight.scalar_type() == hidden.scalar_type(), "pyppo.linear_logprobs: weight is ",
                    weight.scalar_type(), " but hidden is ", hidden.scalar_type(), "; they must match");
  check_temperature(op, temperature);
  TORCH_CHECK_VALUE(weight.sym_size(0) > 0, "pyppo.linear_logprobs: weight has an empty vocabulary dimension (V = 0)");
  TORCH_CHECK_VALUE(labels.sym_sizes() == hidden.sym_sizes().slice(0, hidden.dim() - 1),
                    "pyppo.linear_logprobs: labels has shape ", labels.sym_sizes(), " but hidden has shape ",
                    hidden.sym_sizes(), "; labels must be hidden.shape[:-1]");
  check_same_device(op, "weight", weight, hidden, "hidden");
  if (has(bias)) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0),
                      "pyppo.linear_logprobs: bias must have shape [V] = [", weight.sym_size(0), "], got ",
                      bias->sym_sizes());
    TORCH_CHECK_VALUE(bias->scalar_type() == hidden.scalar_type(), "pyppo.linear_logprobs: bias is ",
                      bias->scalar_type(), " but hidden is ", hidden.scalar_type());
    check_same_device(op, "bias", *bias, hidden, "hidden");
  }
  check_labels(op, labels, mask, hidden, "hidden");
  TORCH_CHECK_VALUE(chunk_size >= 0, "pyppo.linear_logprobs: chunk_size must be > 0 (or None for automatic), got ",
                    chunk_size);
}

inline void check_linear_logprobs_backward(const at::Tensor& grad_logprobs,
                                           const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
                                           const at::Tensor& weight, const at::Tensor& labels,
                                           const std::optional<at::Tensor>& mask,
                                           const std::optional<at::Tensor>& bias, const at::Tensor& lse,
                                           const std::optional<at::Tensor>& entropy, double temperature,
                                           int64_t chunk_size) {
  check_linear_logprobs(hidden, weight, labels, mask, bias, temperature, chunk_size);
  check_logprobs_backward("linear_logprobs_backward", grad_logprobs, grad_entropy, labels, lse, entropy, hidden,
                          "hidden");
}

// check_linear_logprobs, then the label range, checked once over all tokens so that an error
// gives the label's index in the whole input rather than in whichever chunk held it.
inline LinearInputs prepare_linear(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                   const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                                   double temperature, int64_t ignore_index, int64_t chunk_size) {
  const char* op = "linear_logprobs";
  check_linear_logprobs(hidden, weight, labels, mask, bias, temperature, chunk_size);
  GatherInputs g;
  g.V = weight.size(0);
  flatten_labels(op, labels, mask, g);
  check_label_range(op, g, ignore_index);
  LinearInputs f;
  f.H = hidden.size(-1);
  f.V = g.V;
  f.N = g.N;
  f.hidden = hidden.reshape({f.N, f.H});
  f.labels = g.labels;
  f.mask = g.mask;
  return f;
}

}  // namespace pyppo
