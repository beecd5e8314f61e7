// gather_logprobs on CPU: per row, one read of the logits with a blocked online logsumexp,
// and a backward that writes the gradient in one pass.
//
// Each row is reduced by exactly one thread in a fixed order (block by block, lane by lane),
// so the result depends neither on the thread count nor on the other rows of the batch: the
// log-probs computed at rollout time and at training time agree bit for bit.
#include "common.h"
#include "cpu/row_softmax.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace pyppo {
namespace {

constexpr const char* kOp = "gather_logprobs";

struct Prepared {
  at::Tensor logits;  // [N, V], unit stride along V
  at::Tensor labels;  // [N] int64, contiguous
  at::Tensor mask;    // [N] bool or undefined
  int64_t N = 0, V = 0;
};

Prepared prepare(const at::Tensor& logits, const at::Tensor& labels, const std::optional<at::Tensor>& mask,
                 double temperature, int64_t ignore_index) {
  check_float(kOp, "logits", logits);
  TORCH_CHECK_VALUE(logits.dim() >= 1, "pyppo.gather_logprobs: logits must have shape [*, V], got a 0-d tensor");
  TORCH_CHECK_VALUE(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt,
                    "pyppo.gather_logprobs: labels must be int64 (or int32), got ", labels.scalar_type());
  TORCH_CHECK_VALUE(labels.sizes() == logits.sizes().slice(0, logits.dim() - 1),
                    "pyppo.gather_logprobs: labels has shape ", labels.sizes(), " but logits has shape ",
                    logits.sizes(), "; labels must be logits.shape[:-1]");
  check_same_device(kOp, "labels", labels, logits, "logits");
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0,
                    "pyppo.gather_logprobs: temperature must be a finite number > 0, got ", temperature);
  Prepared p;
  p.V = logits.size(-1);
  TORCH_CHECK_VALUE(p.V > 0, "pyppo.gather_logprobs: logits has an empty vocabulary dimension (V = 0)");
  p.N = labels.numel();
  p.logits = logits.reshape({p.N, p.V});
  if (p.V > 1 && p.logits.stride(1) != 1) p.logits = p.logits.contiguous();
  p.labels = labels.reshape({p.N}).to(at::kLong).contiguous();
  if (mask.has_value() && mask->defined()) {
    check_same_device(kOp, "mask", *mask, logits, "logits");
    TORCH_CHECK_VALUE(mask->sizes() == labels.sizes(), "pyppo.gather_logprobs: mask has shape ", mask->sizes(),
                      " but labels has shape ", labels.sizes(), "; they must match");
    p.mask = as_bool_mask(kOp, "mask", *mask).reshape({p.N});
  }
  // Checked up front and serially: an error thrown from inside a parallel region would name
  // an arbitrary one of several bad labels, and this scan over N integers costs nothing next to N*V.
  const int64_t* lab = p.labels.data_ptr<int64_t>();
  const bool* msk = p.mask.defined() ? p.mask.data_ptr<bool>() : nullptr;
  for (int64_t i = 0; i < p.N; ++i) {
    if ((msk && !msk[i]) || lab[i] == ignore_index) continue;
    TORCH_CHECK_VALUE(lab[i] >= 0 && lab[i] < p.V, "pyppo.gather_logprobs: labels[", i, "] = ", lab[i],
                      " is outside [0, V=", p.V, ") at an unmasked position (ignore_index is ", ignore_index, ")");
  }
  return p;
}

inline bool row_valid(const int64_t* lab, const bool* msk, int64_t i, int64_t ignore_index) {
  return (!msk || msk[i]) && lab[i] != ignore_index;
}

int64_t grain_for(int64_t V) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_logprobs_cpu(const at::Tensor& logits, const at::Tensor& labels,
                                                                  const std::optional<at::Tensor>& mask,
                                                                  double temperature, int64_t ignore_index,
                                                                  bool return_entropy) {
  Prepared p = prepare(logits, labels, mask, temperature, ignore_index);
  auto opts = logits.options().dtype(out_dtype(logits));
  at::Tensor logprobs = at::empty({p.N}, opts);
  at::Tensor lse = at::empty({p.N}, opts);
  at::Tensor entropy = return_entropy ? at::empty({p.N}, opts) : at::empty({0}, opts);
  if (p.N > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.logits.scalar_type(), "pyppo_gather_logprobs", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* z = p.logits.data_ptr<scalar_t>();
      const int64_t row_stride = p.logits.stride(0);
      const int64_t* lab = p.labels.data_ptr<int64_t>();
      const bool* msk = p.mask.defined() ? p.mask.data_ptr<bool>() : nullptr;
      acc_t* out_lp = logprobs.data_ptr<acc_t>();
      acc_t* out_lse = lse.data_ptr<acc_t>();
      acc_t* out_ent = return_entropy ? entropy.data_ptr<acc_t>() : nullptr;
      const acc_t inv_tau = acc_t(1) / acc_t(temperature);
      at::parallel_for(0, p.N, grain_for(p.V), [&](int64_t begin, int64_t end) {
        std::vector<acc_t> buf(kRowBlock);
        for (int64_t i = begin; i < end; ++i) {
          if (!row_valid(lab, msk, i, ignore_index)) {
            out_lp[i] = 0;
            out_lse[i] = 0;
            if (out_ent) out_ent[i] = 0;
            continue;
          }
          const scalar_t* row = z + i * row_stride;
          RowStats<acc_t> st = row_logsumexp<scalar_t, acc_t>(row, p.V, inv_tau, out_ent != nullptr, buf.data());
          out_lse[i] = st.lse;
          out_lp[i] = acc_t(row[lab[i]]) * inv_tau - st.lse;
          if (out_ent) out_ent[i] = st.entropy;
        }
      });
    });
  }
  auto shape = labels.sizes();
  return {logprobs.view(shape), return_entropy ? entropy.view(shape) : entropy, lse.view(shape)};
}

at::Tensor gather_logprobs_backward_cpu(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                                        const at::Tensor& logits, const at::Tensor& labels,
                                        const std::optional<at::Tensor>& mask, const at::Tensor& lse,
                                        const std::optional<at::Tensor>& entropy, double temperature,
                                        int64_t ignore_index) {
  Prepared p = prepare(logits, labels, mask, temperature, ignore_index);
  TORCH_CHECK_VALUE(grad_logprobs.sizes() == labels.sizes(), "pyppo.gather_logprobs_backward: grad_logprobs has shape ",
                    grad_logprobs.sizes(), ", expected ", labels.sizes());
  TORCH_CHECK_VALUE(lse.sizes() == labels.sizes(), "pyppo.gather_logprobs_backward: lse has shape ", lse.sizes(),
                    ", expected ", labels.sizes());
  const bool has_ent_grad = grad_entropy.has_value() && grad_entropy->defined();
  if (has_ent_grad) {
    TORCH_CHECK_VALUE(grad_entropy->sizes() == labels.sizes(), "pyppo.gather_logprobs_backward: grad_entropy has shape ",
                      grad_entropy->sizes(), ", expected ", labels.sizes());
    TORCH_CHECK_VALUE(entropy.has_value() && entropy->defined() && entropy->sizes() == labels.sizes(),
                      "pyppo.gather_logprobs_backward: grad_entropy given but entropy (the forward's output) is missing");
  }
  const auto acc_dtype = out_dtype(logits);
  at::Tensor g_lp = grad_logprobs.to(acc_dtype).reshape({p.N}).contiguous();
  at::Tensor lse_c = lse.to(acc_dtype).reshape({p.N}).contiguous();
  at::Tensor g_ent, ent_c;
  if (has_ent_grad) {
    g_ent = grad_entropy->to(acc_dtype).reshape({p.N}).contiguous();
    ent_c = entropy->to(acc_dtype).reshape({p.N}).contiguous();
  }
  at::Tensor grad = at::empty({p.N, p.V}, logits.options());
  if (p.N > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.logits.scalar_type(), "pyppo_gather_logprobs_bwd", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* z = p.logits.data_ptr<scalar_t>();
      const int64_t row_stride = p.logits.stride(0);
      scalar_t* gz = grad.data_ptr<scalar_t>();
      const int64_t* lab = p.labels.data_ptr<int64_t>();
      const bool* msk = p.mask.defined() ? p.mask.data_ptr<bool>() : nullptr;
      const acc_t* glp = g_lp.data_ptr<acc_t>();
      const acc_t* l = lse_c.data_ptr<acc_t>();
      const acc_t* ge = has_ent_grad ? g_ent.data_ptr<acc_t>() : nullptr;
      const acc_t* h = has_ent_grad ? ent_c.data_ptr<acc_t>() : nullptr;
      const acc_t inv_tau = acc_t(1) / acc_t(temperature);
      at::parallel_for(0, p.N, grain_for(p.V), [&](int64_t begin, int64_t end) {
        std::vector<acc_t> buf(kRowBlock);
        for (int64_t i = begin; i < end; ++i) {
          scalar_t* out = gz + i * p.V;
          if (!row_valid(lab, msk, i, ignore_index)) {
            std::fill(out, out + p.V, scalar_t(0));
            continue;
          }
          row_softmax_grad<scalar_t, acc_t>(z + i * row_stride, out, p.V, inv_tau, l[i], glp[i], ge ? ge[i] : acc_t(0),
                                            h ? h[i] : acc_t(0), lab[i], buf.data());
        }
      });
    });
  }
  return grad.view(logits.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("gather_logprobs", &gather_logprobs_cpu);
  m.impl("gather_logprobs_backward", &gather_logprobs_backward_cpu);
}

}  // namespace pyppo
