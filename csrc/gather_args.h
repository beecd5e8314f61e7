// Argument checks and flattening of gather_logprobs, shared by its CPU and CUDA glue and by
// linear_logprobs, so that every path gives the same errors.
#pragma once

#include "common.h"

#include <cmath>
#include <optional>

namespace pyppo {

struct GatherInputs {
  at::Tensor logits;  // [N, V], unit stride along V (undefined for linear_logprobs)
  at::Tensor labels;  // [N] int64, contiguous
  at::Tensor mask;    // [N] bool, contiguous, or undefined
  int64_t N = 0, V = 0;
};

inline void check_temperature(const char* op, double temperature) {
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0, "pyppo.", op,
                    ": temperature must be a finite number > 0, got ", temperature);
}

// labels [*] (int64 or int32) and mask [*] (optional) -> flat contiguous [N] int64 / bool.
inline void flatten_labels(const char* op, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
                           const at::Tensor& like, const char* like_name, GatherInputs& g) {
  TORCH_CHECK_VALUE(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt, "pyppo.", op,
                    ": labels must be int64 (or int32), got ", labels.scalar_type());
  check_same_device(op, "labels", labels, like, like_name);
  g.N = labels.numel();
  g.labels = labels.reshape({g.N}).to(at::kLong).contiguous();
  if (mask.has_value() && mask->defined()) {
    check_same_device(op, "mask", *mask, like, like_name);
    TORCH_CHECK_VALUE(mask->sizes() == labels.sizes(), "pyppo.", op, ": mask has shape ", mask->sizes(),
                      " but labels has shape ", labels.sizes(), "; they must match");
    g.mask = as_bool_mask(op, "mask", *mask).reshape({g.N});
  }
}

// An unmasked label outside [0, V) is an error (the kernels index logits[label]). Its index in
// the error is its position in the flattened labels. On CPU a serial scan of N integers (nothing
// next to N * V); elsewhere ATen ops and one host sync to read the verdict back.
inline void check_label_range(const char* op, const GatherInputs& g, int64_t ignore_index) {
  if (g.N == 0) return;
  auto fail = [&](int64_t i, int64_t v) {
    TORCH_CHECK_VALUE(false, "pyppo.", op, ": labels[", i, "] = ", v, " is outside [0, V=", g.V,
                      ") at an unmasked position (ignore_index is ", ignore_index, ")");
  };
  if (g.labels.device().is_cpu()) {
    const int64_t* lab = g.labels.const_data_ptr<int64_t>();
    const bool* msk = g.mask.defined() ? g.mask.const_data_ptr<bool>() : nullptr;
    for (int64_t i = 0; i < g.N; ++i) {
      if ((msk && !msk[i]) || lab[i] == ignore_index) continue;
      if (lab[i] < 0 || lab[i] >= g.V) fail(i, lab[i]);
    }
    return;
  }
  at::Tensor active = g.labels.ne(ignore_index);
  if (g.mask.defined()) active = active.logical_and(g.mask);
  at::Tensor bad = g.labels.lt(0).logical_or(g.labels.ge(g.V)).logical_and(active);
  if (bad.any().item<bool>()) {
    const int64_t i = bad.nonzero().select(1, 0)[0].item<int64_t>();
    fail(i, g.labels[i].item<int64_t>());
  }
}

// Everything gather_logprobs (and its backward) checks, with logits flattened to [N, V].
inline GatherInputs prepare_gather(const at::Tensor& logits, const at::Tensor& labels,
                                   const std::optional<at::Tensor>& mask, double temperature, int64_t ignore_index) {
  const char* op = "gather_logprobs";
  check_float(op, "logits", logits);
  TORCH_CHECK_VALUE(logits.dim() >= 1, "pyppo.gather_logprobs: logits must have shape [*, V], got a 0-d tensor");
  TORCH_CHECK_VALUE(labels.sizes() == logits.sizes().slice(0, logits.dim() - 1), "pyppo.gather_logprobs: labels has shape ",
                    labels.sizes(), " but logits has shape ", logits.sizes(), "; labels must be logits.shape[:-1]");
  check_temperature(op, temperature);
  GatherInputs g;
  g.V = logits.size(-1);
  TORCH_CHECK_VALUE(g.V > 0, "pyppo.gather_logprobs: logits has an empty vocabulary dimension (V = 0)");
  flatten_labels(op, labels, mask, logits, "logits", g);
  g.logits = logits.reshape({g.N, g.V});
  if (g.V > 1 && g.logits.stride(1) != 1) g.logits = g.logits.contiguous();
  check_label_range(op, g, ignore_index);
  return g;
}

// gather_logprobs_backward's inputs: the forward's checks, then the gradients and saved outputs
// checked against labels and flattened to contiguous [N] tensors of the accumulation dtype.
struct GatherBackwardInputs {
  GatherInputs fwd;
  at::Tensor grad_logprobs, lse;   // [N]
  at::Tensor grad_entropy, entropy;  // [N], or undefined when no entropy gradient flows
};

inline GatherBackwardInputs prepare_gather_backward(const at::Tensor& grad_logprobs,
                                                    const std::optional<at::Tensor>& grad_entropy,
                                                    const at::Tensor& logits, const at::Tensor& labels,
                                                    const std::optional<at::Tensor>& mask, const at::Tensor& lse,
                                                    const std::optional<at::Tensor>& entropy, double temperature,
                                                    int64_t ignore_index) {
  const char* op = "gather_logprobs_backward";
  GatherBackwardInputs b;
  b.fwd = prepare_gather(logits, labels, mask, temperature, ignore_index);
  TORCH_CHECK_VALUE(grad_logprobs.sizes() == labels.sizes(), "pyppo.gather_logprobs_backward: grad_logprobs has shape ",
                    grad_logprobs.sizes(), ", expected ", labels.sizes());
  TORCH_CHECK_VALUE(lse.sizes() == labels.sizes(), "pyppo.gather_logprobs_backward: lse has shape ", lse.sizes(),
                    ", expected ", labels.sizes());
  check_same_device(op, "grad_logprobs", grad_logprobs, logits, "logits");
  check_same_device(op, "lse", lse, logits, "logits");
  const int64_t N = b.fwd.N;
  const auto acc = out_dtype(logits);
  b.grad_logprobs = grad_logprobs.to(acc).reshape({N}).contiguous();
  b.lse = lse.to(acc).reshape({N}).contiguous();
  if (grad_entropy.has_value() && grad_entropy->defined()) {
    TORCH_CHECK_VALUE(grad_entropy->sizes() == labels.sizes(), "pyppo.gather_logprobs_backward: grad_entropy has shape ",
                      grad_entropy->sizes(), ", expected ", labels.sizes());
    TORCH_CHECK_VALUE(entropy.has_value() && entropy->defined() && entropy->sizes() == labels.sizes(),
                      "pyppo.gather_logprobs_backward: grad_entropy given but entropy (the forward's output) is missing");
    check_same_device(op, "grad_entropy", *grad_entropy, logits, "logits");
    check_same_device(op, "entropy", *entropy, logits, "logits");
    b.grad_entropy = grad_entropy->to(acc).reshape({N}).contiguous();
    b.entropy = entropy->to(acc).reshape({N}).contiguous();
  }
  return b;
}

}  // namespace pyppo
