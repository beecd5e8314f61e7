// gather_logprobs (and its backward): argument checks and messages, and the flattening of the
// inputs to [N, V] / [N]. The label half (labels, mask, the range of the labels) is shared with
// linear_logprobs, which takes the same labels against hidden states. See docs/ops.md#gather_logprobs.
#pragma once

#include "checks/common.h"

#include "row_layout.h"

#include <cmath>
#include <memory>
#include <optional>
#include <utility>

namespace pyppo {

// A label-range check that a device queued instead of finishing on the spot (see
// check_label_range): finish() waits for its verdict and raises the CPU's error.
struct PendingLabelCheck {
  virtual ~PendingLabelCheck() = default;
  virtual void finish() = 0;
};

// check_label_range's outcome. On CPU the check is over when it returns (finish() does
// nothing); on CUDA it runs on the device and the op calls finish() once its kernels are
// queued, so the host waits for the verdict once per call, never per chunk.
struct LabelCheck {
  std::shared_ptr<PendingLabelCheck> pending;
  void finish() const {
    if (pending) pending->finish();
  }
};

struct GatherInputs {
  at::Tensor logits;  // [*, V] with unit stride along V, read where `rows` says (undefined for linear_logprobs)
  RowLayout rows;
  at::Tensor labels;  // [N] int64, contiguous
  at::Tensor mask;    // [N] bool, contiguous, or undefined
  int64_t N = 0, V = 0;
  LabelCheck label_check;
};

inline bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

inline void check_temperature(const char* op, double temperature) {
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0, "pyppo.", op,
                    ": temperature must be a finite number > 0, got ", temperature);
}

// labels [*] (int64 or int32) and mask [*] (optional, labels' shape), on like's device.
// mask_name is the mask's argument name in the op's messages.
inline void check_labels(const char* op, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
                         const at::Tensor& like, const char* like_name, const char* mask_name = "mask") {
  TORCH_CHECK_VALUE(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt, "pyppo.", op,
                    ": labels must be int64 (or int32), got ", labels.scalar_type());
  check_same_device(op, "labels", labels, like, like_name);
  if (has(mask)) {
    check_same_device(op, mask_name, *mask, like, like_name);
    check_same_shape(op, mask_name, *mask, labels, "labels");
    check_mask_dtype(op, mask_name, *mask);
  }
}

// labels [*] and mask [*] -> flat contiguous [N] int64 / bool (after check_labels).
inline void flatten_labels(const char* op, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
                           GatherInputs& g, const char* mask_name = "mask") {
  g.N = labels.numel();
  g.labels = labels.reshape({g.N}).to(at::kLong).contiguous();
  if (has(mask)) g.mask = as_bool_mask(op, mask_name, *mask).reshape({g.N});
}

[[noreturn]] inline void fail_label_range(const char* op, int64_t i, int64_t v, int64_t V, int64_t ignore_index) {
  TORCH_CHECK_VALUE(false, "pyppo.", op, ": labels[", i, "] = ", v, " is outside [0, V=", V,
                    ") at an unmasked position (ignore_index is ", ignore_index, ")");
  __builtin_unreachable();
}

// How a device other than the CPU checks the label range without reading the labels back
// first: set by the CUDA impl when the library loads (cuda/gather_logprobs_impl.cpp). It queues
// the check on the device and returns the pending verdict, or nullptr when nothing can be
// read back (a CUDA graph being captured: there the kernels give a bad label's row NaN).
using DeviceLabelCheckFn = std::shared_ptr<PendingLabelCheck> (*)(const char* op, const GatherInputs& g,
                                                                   int64_t ignore_index);
inline DeviceLabelCheckFn& device_label_check() {
  static DeviceLabelCheckFn fn = nullptr;
  return fn;
}

// While one is alive on this thread, prepare_gather skips the label check: linear_logprobs and
// linear_ppo_loss check every label once per call, then run gather_logprobs chunk by chunk.
class LabelsCheckedScope {
 public:
  LabelsCheckedScope() : prev_(active()) { active() = true; }
  ~LabelsCheckedScope() { active() = prev_; }
  LabelsCheckedScope(const LabelsCheckedScope&) = delete;
  LabelsCheckedScope& operator=(const LabelsCheckedScope&) = delete;
  static bool& active() {
    thread_local bool on = false;
    return on;
  }

 private:
  bool prev_;
};

// An unmasked label outside [0, V) is an error (the CPU kernels index logits[label]). Its index
// in the error is its position in the flattened labels. On CPU a serial scan of N integers
// (nothing next to N * V), done when this returns. On CUDA a few small device ops whose verdict
// the op reads back after queuing its kernels (LabelCheck::finish). Elsewhere ATen ops and a
// host sync.
inline LabelCheck check_label_range(const char* op, const GatherInputs& g, int64_t ignore_index) {
  if (g.N == 0) return {};
  if (g.labels.device().is_cpu()) {
    const int64_t* lab = g.labels.const_data_ptr<int64_t>();
    const bool* msk = g.mask.defined() ? g.mask.const_data_ptr<bool>() : nullptr;
    for (int64_t i = 0; i < g.N; ++i) {
      if ((msk && !msk[i]) || lab[i] == ignore_index) continue;
      if (lab[i] < 0 || lab[i] >= g.V) fail_label_range(op, i, lab[i], g.V, ignore_index);
    }
    return {};
  }
  if (g.labels.device().is_cuda() && device_label_check() != nullptr) return {device_label_check()(op, g, ignore_index)};
  at::Tensor active = g.labels.ne(ignore_index);
  if (g.mask.defined()) active = active.logical_and(g.mask);
  at::Tensor bad = g.labels.lt(0).logical_or(g.labels.ge(g.V)).logical_and(active);
  if (bad.any().item<bool>()) {
    const int64_t i = bad.nonzero().select(1, 0)[0].item<int64_t>();
    fail_label_range(op, i, g.labels[i].item<int64_t>(), g.V, ignore_index);
  }
  return {};
}

// logits [*, V] as the kernels read it, in place whenever its V dimension has unit stride and
// its leading dims collapse into two (row_layout.h); otherwise (a strided V, or leading dims
// sliced in three or more places) one contiguous copy.
inline void set_logits_rows(GatherInputs& g, const at::Tensor& logits) {
  at::Tensor x = logits;
  if (g.V > 1 && x.stride(-1) != 1) x = x.contiguous();
  // The leading dims, outermost first, size-1 dims dropped and nested neighbours merged.
  std::pair<int64_t, int64_t> dims[2];
  int n = 0;
  bool fits = true;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    const int64_t size = x.size(d), stride = x.stride(d);
    if (size == 1) continue;
    if (n > 0 && dims[n - 1].second == size * stride) {
      dims[n - 1] = {dims[n - 1].first * size, stride};
    } else if (n < 2) {
      dims[n++] = {size, stride};
    } else {
      fits = false;
      break;
    }
  }
  if (!fits) {
    x = x.contiguous();
    n = 1;
    dims[0] = {g.N, g.V};
  }
  g.logits = x;
  g.rows = RowLayout{};
  if (n == 1) {
    g.rows.rows_inner = dims[0].first;
    g.rows.row_stride = dims[0].second;
  } else if (n == 2) {
    g.rows.rows_inner = dims[1].first;
    g.rows.row_stride = dims[1].second;
    g.rows.outer_stride = dims[0].second;
  }
  if (g.rows.rows_inner <= 0) g.rows.rows_inner = 1;  // N = 0: no row is ever read
}

// Everything gather_logprobs checks without reading data (the Meta kernel's checks).
inline void check_gather_logprobs(const at::Tensor& logits, const at::Tensor& labels,
                                  const std::optional<at::Tensor>& mask, double temperature) {
  const char* op = "gather_logprobs";
  check_float(op, "logits", logits);
  TORCH_CHECK_VALUE(logits.dim() >= 1, "pyppo.gather_logprobs: logits must have shape [*, V], got a 0-d tensor");
  TORCH_CHECK_VALUE(labels.sym_sizes() == logits.sym_sizes().slice(0, logits.dim() - 1),
                    "pyppo.gather_logprobs: labels has shape ", labels.sym_sizes(), " but logits has shape ",
                    logits.sym_sizes(), "; labels must be logits.shape[:-1]");
  check_temperature(op, temperature);
  TORCH_CHECK_VALUE(logits.sym_size(-1) > 0, "pyppo.gather_logprobs: logits has an empty vocabulary dimension (V = 0)");
  check_labels(op, labels, mask, logits, "logits");
}

// check_gather_logprobs, then the label range (unless a LabelsCheckedScope is active), with the
// logits' rows laid out for the kernels.
inline GatherInputs prepare_gather(const at::Tensor& logits, const at::Tensor& labels,
                                   const std::optional<at::Tensor>& mask, double temperature, int64_t ignore_index) {
  const char* op = "gather_logprobs";
  check_gather_logprobs(logits, labels, mask, temperature);
  GatherInputs g;
  g.V = logits.size(-1);
  flatten_labels(op, labels, mask, g);
  set_logits_rows(g, logits);
  if (!LabelsCheckedScope::active()) g.label_check = check_label_range(op, g, ignore_index);
  return g;
}

// A gradient or saved output of the forward: labels' shape, like's device.
inline void check_saved(const char* op, const char* name, const at::Tensor& t, const at::Tensor& labels,
                        const at::Tensor& like, const char* like_name) {
  TORCH_CHECK_VALUE(t.sym_sizes() == labels.sym_sizes(), "pyppo.", op, ": ", name, " has shape ", t.sym_sizes(),
                    ", expected ", labels.sym_sizes());
  check_same_device(op, name, t, like, like_name);
}

// The gradients and saved outputs a *_logprobs_backward gets next to the forward's inputs.
inline void check_logprobs_backward(const char* op, const at::Tensor& grad_logprobs,
                                    const std::optional<at::Tensor>& grad_entropy, const at::Tensor& labels,
                                    const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
                                    const at::Tensor& like, const char* like_name) {
  check_saved(op, "grad_logprobs", grad_logprobs, labels, like, like_name);
  check_saved(op, "lse", lse, labels, like, like_name);
  if (has(grad_entropy)) {
    check_saved(op, "grad_entropy", *grad_entropy, labels, like, like_name);
    TORCH_CHECK_VALUE(has(entropy), "pyppo.", op, ": grad_entropy given but entropy (the forward's output) is missing");
    check_saved(op, "entropy", *entropy, labels, like, like_name);
  }
}

inline void check_gather_logprobs_backward(const at::Tensor& grad_logprobs,
                                           const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
                                           const at::Tensor& labels, const std::optional<at::Tensor>& mask,
                                           const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
                                           double temperature) {
  check_gather_logprobs(logits, labels, mask, temperature);
  check_logprobs_backward("gather_logprobs_backward", grad_logprobs, grad_entropy, labels, lse, entropy, logits,
                          "logits");
}

// gather_logprobs_backward's inputs: the forward's, and the gradients and saved outputs
// flattened to contiguous [N] tensors of the accumulation dtype.
struct GatherBackwardInputs {
  GatherInputs fwd;
  at::Tensor grad_logprobs, lse;     // [N]
  at::Tensor grad_entropy, entropy;  // [N], or undefined when no entropy gradient flows
};

inline at::Tensor flat_acc(const at::Tensor& t, at::ScalarType acc, int64_t N) {
  return t.to(acc).reshape({N}).contiguous();
}

inline GatherBackwardInputs prepare_gather_backward(const at::Tensor& grad_logprobs,
                                                    const std::optional<at::Tensor>& grad_entropy,
                                                    const at::Tensor& logits, const at::Tensor& labels,
                                                    const std::optional<at::Tensor>& mask, const at::Tensor& lse,
                                                    const std::optional<at::Tensor>& entropy, double temperature,
                                                    int64_t ignore_index) {
  check_gather_logprobs_backward(grad_logprobs, grad_entropy, logits, labels, mask, lse, entropy, temperature);
  GatherBackwardInputs b;
  b.fwd = prepare_gather(logits, labels, mask, temperature, ignore_index);
  const int64_t N = b.fwd.N;
  const auto acc = out_dtype(logits);
  b.grad_logprobs = flat_acc(grad_logprobs, acc, N);
  b.lse = flat_acc(lse, acc, N);
  if (has(grad_entropy)) {
    b.grad_entropy = flat_acc(*grad_entropy, acc, N);
    b.entropy = flat_acc(*entropy, acc, N);
  }
  return b;
}

// The row fields every gather kernel's argument struct has (cpu::Gather*Args, cuda::Gather*Args),
// all but the dtype, whose type differs between the two.
template <typename Args>
void fill_gather_rows(Args& a, const GatherInputs& p, int64_t ignore_index, double temperature) {
  a.logits = p.logits.const_data_ptr();
  a.rows = p.rows;
  a.N = p.N;
  a.V = p.V;
  a.labels = p.labels.const_data_ptr<int64_t>();
  a.mask = p.mask.defined() ? p.mask.const_data_ptr<bool>() : nullptr;
  a.ignore_index = ignore_index;
  a.temperature = temperature;
}

// The backward's per-row inputs, into a cpu::GatherBwdArgs or a cuda::GatherBwdArgs.
template <typename Args>
void fill_gather_saved(Args& a, const GatherBackwardInputs& b) {
  a.grad_logprobs = b.grad_logprobs.const_data_ptr();
  a.grad_entropy = b.grad_entropy.defined() ? b.grad_entropy.const_data_ptr() : nullptr;
  a.lse = b.lse.const_data_ptr();
  a.entropy = b.entropy.defined() ? b.entropy.const_data_ptr() : nullptr;
}

// The forward's outputs, as every device (and the Meta kernel) allocates them: logprobs and lse
// of labels' shape, entropy too or [0] when it is not asked for; contiguous, so the kernels
// write them as flat [N] arrays.
struct LogprobsOutputs {
  at::Tensor logprobs, entropy, lse;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> tuple() const { return {logprobs, entropy, lse}; }
};

inline LogprobsOutputs alloc_logprobs_outputs(const at::Tensor& labels, const at::TensorOptions& opts,
                                              bool return_entropy) {
  LogprobsOutputs o;
  o.logprobs = at::empty_symint(labels.sym_sizes(), opts);
  o.lse = at::empty_symint(labels.sym_sizes(), opts);
  o.entropy = return_entropy ? at::empty_symint(labels.sym_sizes(), opts) : at::empty({0}, opts);
  return o;
}

}  // namespace pyppo
