// kl_penalty (and its backward) and shape_rewards on CPU: the checks of checks/kl.h, then the
// per-ISA KL kernel (cpu/kernels/kl_kernel.cpp).
#include "checks/kl.h"
#include "cpu/kernels/kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace pyppo {
namespace {

// Elements per task: calls smaller than this stay on one thread, since waking the pool costs
// more than they do.
constexpr int64_t kGrain = 65536;

cpu::KLArgs kl_args(at::ScalarType acc, KLEstimator est, const KLClamp& c, const at::Tensor& lp, const at::Tensor& ref,
                    at::Tensor& out) {
  cpu::KLArgs k;
  k.dtype = acc;
  k.estimator = static_cast<int32_t>(est);
  k.has_lo = c.has_lo;
  k.has_hi = c.has_hi;
  k.lo = c.lo;
  k.hi = c.hi;
  k.logprobs = lp.const_data_ptr();
  k.ref_logprobs = ref.const_data_ptr();
  k.out = out.data_ptr();
  k.n = lp.numel();
  return k;
}

at::Tensor kl_penalty_cpu(const at::Tensor& logprobs, const at::Tensor& ref_logprobs, c10::string_view estimator,
                          std::optional<double> clamp_min, std::optional<double> clamp_max) {
  const KLOptions a = check_kl_penalty(logprobs, ref_logprobs, estimator, clamp_min, clamp_max);
  const KLTensors t = kl_tensors(logprobs, ref_logprobs);
  at::Tensor out = at::empty(logprobs.sizes(), t.lp.options());
  cpu::cpu_kernels().kl_fwd(kl_args(t.acc, a.estimator, a.clamp, t.lp, t.ref, out));
  return out;
}

at::Tensor kl_penalty_backward_cpu(const at::Tensor& grad_kl, const at::Tensor& logprobs,
                                   const at::Tensor& ref_logprobs, c10::string_view estimator,
                                   std::optional<double> clamp_min, std::optional<double> clamp_max) {
  const KLOptions a = check_kl_penalty_backward(grad_kl, logprobs, ref_logprobs, estimator, clamp_min, clamp_max);
  const KLTensors t = kl_tensors(logprobs, ref_logprobs);
  at::Tensor g = grad_kl.to(t.acc).contiguous();
  at::Tensor out = at::empty(logprobs.sizes(), t.lp.options());
  cpu::KLArgs k = kl_args(t.acc, a.estimator, a.clamp, t.lp, t.ref, out);
  k.grad = g.const_data_ptr();
  cpu::cpu_kernels().kl_bwd(k);
  return out.to(logprobs.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> shape_rewards_cpu(const at::Tensor& scores, const at::Tensor& logprobs,
                                                     const at::Tensor& ref_logprobs, const at::Tensor& response_mask,
                                                     double kl_coef, c10::string_view estimator,
                                                     std::optional<double> score_clip) {
  const KLEstimator est =
      check_shape_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef, estimator, score_clip);
  const int64_t B = logprobs.size(0), T = logprobs.size(1);
  const KLTensors t = kl_tensors(logprobs, ref_logprobs);
  const auto acc = t.acc;
  at::Tensor sc = scores.to(acc).contiguous();
  at::Tensor mask = as_bool_mask("shape_rewards", "response_mask", response_mask);
  at::Tensor rewards = at::empty({B, T}, t.lp.options());
  at::Tensor kl = at::empty({B, T}, t.lp.options());

  // Validated before any work so the error names the first bad row, not whichever a thread hit.
  std::vector<int64_t> last(B, -1);
  const bool* m = mask.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = T - 1; t >= 0; --t)
      if (m[b * T + t]) {
        last[b] = t;
        break;
      }
    if (last[b] < 0) fail_row_without_valid_position(b);
  }
  // The per-token estimate for every position (the vectorised kernel of kl_penalty, so the two
  // ops agree bit for bit), then one pass per row masking, scaling and adding the score.
  cpu::cpu_kernels().kl_fwd(kl_args(acc, est, KLClamp{}, t.lp, t.ref, kl));
  AT_DISPATCH_FLOATING_TYPES(acc, "pyppo_shape_rewards", [&] {
    const scalar_t* s = sc.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b)
      if (!std::isfinite(s[b])) fail_non_finite_score(b, static_cast<double>(s[b]));
    scalar_t* rw = rewards.data_ptr<scalar_t>();
    scalar_t* k = kl.data_ptr<scalar_t>();
    const scalar_t coef = static_cast<scalar_t>(kl_coef);
    at::parallel_for(0, B, std::max<int64_t>(1, kGrain / std::max<int64_t>(T, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t t = 0; t < T; ++t) {
          const int64_t i = b * T + t;
          if (!m[i]) {
            k[i] = 0;
            rw[i] = 0;
            continue;
          }
          // kl_coef = 0 switches the penalty off even where the estimate overflowed (0 * inf = NaN).
          rw[i] = coef == scalar_t(0) ? scalar_t(0) : -coef * k[i];
        }
        scalar_t score = s[b];
        if (score_clip.has_value()) {
          const scalar_t c = static_cast<scalar_t>(*score_clip);
          score = std::min(std::max(score, -c), c);
        }
        rw[b * T + last[b]] += score;
      }
    });
  });
  return {rewards, kl};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, CPU, m) {
  m.impl("kl_penalty", &kl_penalty_cpu);
  m.impl("kl_penalty_backward", &kl_penalty_backward_cpu);
  m.impl("shape_rewards", &shape_rewards_cpu);
}

}  // namespace pyppo
