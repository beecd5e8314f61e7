// linear_logprobs (and its backward): argument checks and messages, and the flattening of the
// inputs to [N, H] / [N]. The labels are checked as gather_logprobs checks them. linear_ppo_loss
// takes the same hidden states, head and labels, so these checks take the op's name (and the
// mask's argument name) for their messages. See docs/ops.md#linear_logprobs.
#pragma once

#include "checks/gather_logprobs.h"

namespace pyppo {

struct LinearInputs {
  at::Tensor hidden;  // [N, H]
  at::Tensor labels;  // [N] int64, contiguous
  at::Tensor mask;    // [N] bool, contiguous, or undefined
  int64_t N = 0, H = 0, V = 0;
  // The range check of every label, once per call: call label_check.finish() after the chunk
  // loop, which runs under a LabelsCheckedScope (no check per chunk).
  LabelCheck label_check;
};

// hidden [*, H], weight [V, H], bias [V], labels/mask [*], temperature, chunk_size: everything
// checked without reading data (the Meta kernels' checks). chunk_size 0 means "chosen from N and V".
inline void check_linear_inputs(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& labels, const std::optional<at::Tensor>& mask,
                                const std::optional<at::Tensor>& bias, double temperature, int64_t chunk_size,
                                const char* mask_name = "mask") {
  check_float(op, "hidden", hidden);
  check_float(op, "weight", weight);
  TORCH_CHECK_VALUE(hidden.dim() >= 1, "pyppo.", op, ": hidden must have shape [*, H], got a 0-d tensor");
  TORCH_CHECK_VALUE(weight.dim() == 2, "pyppo.", op, ": weight must have shape [V, H], got ", weight.sym_sizes());
  TORCH_CHECK_VALUE(weight.sym_size(1) == hidden.sym_size(-1), "pyppo.", op, ": weight has shape ",
                    weight.sym_sizes(), " but hidden has H = ", hidden.sym_size(-1), "; weight must be [V, H]");
  TORCH_CHECK_VALUE(weight.scalar_type() == hidden.scalar_type(), "pyppo.", op, ": weight is ",
                    weight.scalar_type(), " but hidden is ", hidden.scalar_type(), "; they must match");
  check_temperature(op, temperature);
  TORCH_CHECK_VALUE(weight.sym_size(0) > 0, "pyppo.", op, ": weight has an empty vocabulary dimension (V = 0)");
  TORCH_CHECK_VALUE(labels.sym_sizes() == hidden.sym_sizes().slice(0, hidden.dim() - 1), "pyppo.", op,
                    ": labels has shape ", labels.sym_sizes(), " but hidden has shape ", hidden.sym_sizes(),
                    "; labels must be hidden.shape[:-1]");
  check_same_device(op, "weight", weight, hidden, "hidden");
  if (has(bias)) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), "pyppo.", op,
                      ": bias must have shape [V] = [", weight.sym_size(0), "], got ", bias->sym_sizes());
    TORCH_CHECK_VALUE(bias->scalar_type() == hidden.scalar_type(), "pyppo.", op, ": bias is ",
                      bias->scalar_type(), " but hidden is ", hidden.scalar_type());
    check_same_device(op, "bias", *bias, hidden, "hidden");
  }
  check_labels(op, labels, mask, hidden, "hidden", mask_name);
  TORCH_CHECK_VALUE(chunk_size >= 0, "pyppo.", op, ": chunk_size must be > 0 (or None for automatic), got ",
                    chunk_size);
}

inline void check_linear_logprobs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                  const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                                  double temperature, int64_t chunk_size) {
  check_linear_inputs("linear_logprobs", hidden, weight, labels, mask, bias, temperature, chunk_size);
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

// The flattening after the checks, and the label range, checked once over all tokens so that an
// error gives the label's index in the whole input rather than in whichever chunk held it (on
// CUDA the verdict comes back in label_check.finish()).
inline LinearInputs flatten_linear(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                                   const at::Tensor& labels, const std::optional<at::Tensor>& mask,
                                   int64_t ignore_index, const char* mask_name = "mask") {
  GatherInputs g;
  g.V = weight.size(0);
  flatten_labels(op, labels, mask, g, mask_name);
  LinearInputs f;
  f.label_check = check_label_range(op, g, ignore_index);
  f.H = hidden.size(-1);
  f.V = g.V;
  f.N = g.N;
  f.hidden = hidden.reshape({f.N, f.H});
  f.labels = g.labels;
  f.mask = g.mask;
  return f;
}

inline LinearInputs prepare_linear(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                   const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                                   double temperature, int64_t ignore_index, int64_t chunk_size) {
  check_linear_logprobs(hidden, weight, labels, mask, bias, temperature, chunk_size);
  return flatten_linear("linear_logprobs", hidden, weight, labels, mask, ignore_index);
}

}  // namespace pyppo
