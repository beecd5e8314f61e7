// linear_ppo_loss: the PPO policy loss (clipped surrogate, optional dual clip, KL and entropy
// terms) straight from hidden states and the output embedding, with its gradients w.r.t. hidden,
// weight and bias computed in the same chunked pass.
//
// Each token's loss depends only on its own log-prob and entropy (the advantages, old and
// reference log-probs and the aggregation weights are known beforehand), so once a chunk's
// log-probs are known its logits gradient is too: the chunk's logits are computed once, turned
// into their gradient in place, and multiplied into grad_hidden and grad_weight. Three GEMMs per
// chunk and nothing of size [N, V]; the autograd backward only scales the gradients by the
// incoming scalar (pyppo/ops/linear_ppo_loss.py).
//
// The per-token part is ATen on [chunk] tensors, so one implementation serves every device
// (registered in cpu/linear_ppo_loss_impl.cpp and cuda/linear_ppo_loss_impl.cpp); it is O(N) next
// to the GEMMs' O(N·V·H).
#include "linear/linear_ppo_loss.h"

#include "checks/linear_ppo_loss.h"
#include "linear/chunks.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace pyppo {

using namespace linear_chunks;

namespace {

// One chunk's per-token inputs, [C] each.
struct ChunkTokens {
  at::Tensor lp, ent, mask, old_logprobs, advantages, weights, ref_logprobs;
};

// The chunk's share of the loss, Σ w·ℓ (0-d float64), and d loss / d logprobs and
// d loss / d entropy ([C], the log-probs' dtype; g_ent undefined without the entropy term).
struct TokenTerms {
  at::Tensor loss, g_lp, g_ent;
};

// ℓ = L_pg + kl_coef·kl − entropy_coef·H per token, and the derivatives that autograd takes
// through ppo_policy_loss, kl_penalty and aggregate_loss, including its conventions at the
// kinks: torch.maximum / torch.minimum give each side half the gradient at a tie (inside the clip
// range the two surrogate terms are equal and their halves add up to −A·r), torch.clamp passes
// the gradient on its bounds. Masked positions are selected away (never multiplied by 0), so
// garbage there (−inf old log-probs, NaN advantages) contributes nothing.
TokenTerms token_terms(const ChunkTokens& t, const PpoScalars& s, c10::string_view estimator, bool want_grad) {
  using KlFn = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, std::optional<double>,
                          std::optional<double>);
  using KlBwdFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                             std::optional<double>, std::optional<double>);
  static auto kl_op = c10::Dispatcher::singleton().findSchemaOrThrow("pyppo::kl_penalty", "").typed<KlFn>();
  static auto kl_bwd_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyppo::kl_penalty_backward", "").typed<KlBwdFn>();

  const at::Tensor& m = t.mask;
  const auto opts = t.old_logprobs.options();
  const at::Tensor zero = at::zeros({}, opts), half = at::full({}, 0.5, opts), one = at::ones({}, opts);
  // The share of the gradient of max(x, y) that goes to x.
  auto share = [&](const at::Tensor& x, const at::Tensor& y) {
    return at::where(x > y, one, at::where(x == y, half, zero));
  };

  // ppo_policy_loss, operation for operation, so that every comparison below sees its bits.
  const at::Tensor raw = t.lp.to(t.old_logprobs.scalar_type()) - t.old_logprobs;
  const at::Tensor log_ratio =
      at::where(m, at::clamp(raw, at::Scalar(-kLogRatioClamp), at::Scalar(kLogRatioClamp)), zero);
  const at::Tensor ratio = at::exp(log_ratio);
  const at::Tensor adv = at::where(m, t.advantages, zero);
  const at::Tensor nadv = adv.neg();
  const double lo = 1.0 - s.cliprange_low, hi = 1.0 + s.cliprange_high;
  const at::Tensor unclipped = nadv * ratio;
  const at::Tensor clipped = nadv * at::clamp(ratio, at::Scalar(lo), at::Scalar(hi));
  at::Tensor pg = at::maximum(unclipped, clipped);
  at::Tensor g_pg = t.weights;  // d loss / d L_pg
  if (s.dual_clip.has_value()) {
    const at::Tensor bound = nadv * *s.dual_clip;
    const at::Tensor neg = adv < 0;
    if (want_grad) g_pg = g_pg * at::where(neg, share(bound, pg), one);
    pg = at::where(neg, at::minimum(pg, bound), pg);
  }
  at::Tensor per_token = pg;
  at::Tensor g_lp, g_ent;
  if (want_grad) {
    const at::Tensor in_clip = at::logical_and(ratio >= lo, ratio <= hi);
    const at::Tensor in_range = at::logical_and(raw >= -kLogRatioClamp, raw <= kLogRatioClamp);
    const at::Tensor g_ratio = g_pg * (share(unclipped, clipped) + share(clipped, unclipped) * in_clip) * nadv;
    g_lp = at::where(in_range, g_ratio * ratio, zero).to(t.lp.scalar_type());
  }
  if (s.kl_coef > 0) {
    per_token = per_token + s.kl_coef * kl_op.call(t.lp, t.ref_logprobs, estimator, std::nullopt, std::nullopt);
    if (want_grad) {
      const at::Tensor g_kl = at::where(m, t.weights * s.kl_coef, zero);
      g_lp = g_lp + kl_bwd_op.call(g_kl, t.lp, t.ref_logprobs, estimator, std::nullopt, std::nullopt);
    }
  }
  if (s.entropy_coef > 0) {
    per_token = per_token - s.entropy_coef * t.ent;
    if (want_grad) g_ent = at::where(m, t.weights * -s.entropy_coef, zero).to(t.ent.scalar_type());
  }
  TokenTerms out;
  out.loss = at::where(m, t.weights * per_token, zero).sum(at::kDouble);
  if (want_grad) out.g_lp = at::where(m, g_lp, at::zeros({}, g_lp.options()));
  out.g_ent = g_ent;
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_ppo_loss_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& old_logprobs,
    const at::Tensor& advantages, const at::Tensor& response_mask, const at::Tensor& token_weights,
    const std::optional<at::Tensor>& ref_logprobs, const std::optional<at::Tensor>& bias, double temperature,
    int64_t ignore_index, double cliprange_low, double cliprange_high, std::optional<double> dual_clip,
    double kl_loss_coef, c10::string_view kl_loss_estimator, double entropy_coef, bool return_entropy,
    int64_t chunk_size, std::array<bool, 3> output_mask) {
  const PpoScalars s = check_linear_ppo_loss(hidden, weight, labels, old_logprobs, advantages, response_mask,
                                             token_weights, ref_logprobs, bias, temperature, cliprange_low,
                                             cliprange_high, dual_clip, kl_loss_coef, kl_loss_estimator,
                                             entropy_coef, chunk_size);
  LinearInputs f = flatten_linear("linear_ppo_loss", hidden, weight, labels, response_mask, ignore_index,
                                  "response_mask");
  const at::ScalarType dt = ppo_dtype(hidden, old_logprobs, advantages);
  const PpoTokens tok = flatten_ppo_tokens(dt, f.N, old_logprobs, advantages, token_weights, ref_logprobs,
                                           kl_loss_coef);
  const int64_t C = resolve_chunk(chunk_size, f.N, f.V);
  const bool need_ent = return_entropy || s.entropy_coef > 0;
  LogprobsOutputs out = alloc_logprobs_outputs(labels, out_options(hidden), need_ent);
  at::Tensor logprobs = out.logprobs.view({f.N});
  at::Tensor entropy = need_ent ? out.entropy.view({f.N}) : out.entropy;
  LinearGrads grads(f, hidden, weight, has(bias), output_mask);
  at::Tensor loss = at::zeros({}, hidden.options().dtype(at::kDouble));
  at::Tensor buf = chunk_buffer(f, C, hidden);
  const LabelsCheckedScope checked;
  for (int64_t a = 0; a < f.N; a += C) {
    const int64_t b = std::min(f.N, a + C);
    const at::Tensor h = f.hidden.slice(0, a, b);
    at::Tensor logits = chunk_logits(buf, h, weight, bias);
    auto [lp, ent, lse] = gather_rows(logits, f, a, b, temperature, ignore_index, need_ent);
    logprobs.slice(0, a, b).copy_(lp);
    if (need_ent) entropy.slice(0, a, b).copy_(ent);
    ChunkTokens t;
    t.lp = lp;
    t.ent = ent;
    t.mask = f.mask.slice(0, a, b);
    t.old_logprobs = tok.old_logprobs.slice(0, a, b);
    t.advantages = tok.advantages.slice(0, a, b);
    t.weights = tok.token_weights.slice(0, a, b);
    if (tok.ref_logprobs.defined()) t.ref_logprobs = tok.ref_logprobs.slice(0, a, b);
    const TokenTerms terms = token_terms(t, s, kl_loss_estimator, grads.any());
    loss.add_(terms.loss);
    if (!grads.any()) continue;
    const at::Tensor saved_ent = terms.g_ent.defined() ? ent : at::Tensor();
    at::Tensor g = logits_grad(logits, f, a, b, terms.g_lp, terms.g_ent, lse, saved_ent, temperature, ignore_index);
    grads.add_chunk(g, h, weight, a, b);
  }
  f.label_check.finish();
  auto [gh, gw, gb] = grads.finish(hidden, weight);
  return {loss.to(dt), out.logprobs, out.entropy, gh, gw, gb};
}

}  // namespace pyppo
