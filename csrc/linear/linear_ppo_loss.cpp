// linear_ppo_loss: the policy loss (PPO's clipped surrogate with optional dual clip, GSPO or CISPO;
// KL and entropy terms) straight from hidden states and the output embedding, with its gradients w.r.t. hidden,
// weight and bias computed in the same chunked pass.
//
// Each token's loss depends only on its own log-prob and entropy (the advantages, old and
// reference log-probs and the aggregation weights are known beforehand; GSPO's sequence ratio
// too, once a first pass has the log-probs), so once a chunk's log-probs are known its logits
// gradient is too: the chunk's logits are computed once, turned
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

// One chunk's per-token inputs, [C] each (seq_log_ratio: GSPO only).
struct ChunkTokens {
  at::Tensor lp, ent, mask, old_logprobs, advantages, weights, ref_logprobs, seq_log_ratio;
};

// The chunk's share of the loss, Σ w·ℓ (0-d float64), and d loss / d logprobs and
// d loss / d entropy ([C], the log-probs' dtype; g_ent undefined without the entropy term).
struct TokenTerms {
  at::Tensor loss, g_lp, g_ent;
};

// The policy term of each token, and d loss / d logprobs through it (undefined without want_grad).
struct PolicyTerms {
  at::Tensor per_token, g_lp;
};

// The clipped token ratio and its derivatives, as ppo_policy_loss (pyppo/ops/losses.py) and
// gspo_policy_loss (pyppo/ops/policy_losses.py) compute them, with autograd's conventions at the
// kinks: torch.maximum / torch.minimum give each side half the gradient at a tie (inside the clip
// range the two surrogate terms are equal and their halves add up to −A·r), torch.clamp passes
// the gradient on its bounds. PPO's ratio is the token's own; GSPO's has the sequence's value
// and the token's own log-prob gradient (lp − sg(lp) + sg(log s_i)).
PolicyTerms clipped_ratio_terms(const ChunkTokens& t, const PpoScalars& s, const at::Tensor& raw,
                                const at::Tensor& log_ratio, const at::Tensor& adv, bool want_grad) {
  const at::Tensor& m = t.mask;
  const auto opts = t.old_logprobs.options();
  const at::Tensor zero = at::zeros({}, opts), half = at::full({}, 0.5, opts), one = at::ones({}, opts);
  // The share of the gradient of max(x, y) that goes to x.
  auto share = [&](const at::Tensor& x, const at::Tensor& y) {
    return at::where(x > y, one, at::where(x == y, half, zero));
  };
  at::Tensor ratio, passes;  // passes: where d log r / d lp is 1 (else 0)
  if (s.loss == PolicyLoss::GSPO) {
    const at::Tensor lp = t.lp.to(t.old_logprobs.scalar_type());
    const at::Tensor log_r = at::where(m, lp - lp, zero) + t.seq_log_ratio;
    ratio = at::exp(at::clamp_max(log_r, kGspoLogRatioMax));
    if (want_grad) passes = log_r <= kGspoLogRatioMax;
  } else {
    ratio = at::exp(log_ratio);
    if (want_grad) passes = at::logical_and(raw >= -kLogRatioClamp, raw <= kLogRatioClamp);
  }
  const at::Tensor nadv = adv.neg();
  const double lo = 1.0 - s.cliprange_low, hi = 1.0 + s.cliprange_high;
  const at::Tensor unclipped = nadv * ratio;
  const at::Tensor clipped = nadv * at::clamp(ratio, at::Scalar(lo), at::Scalar(hi));
  PolicyTerms out;
  out.per_token = at::maximum(unclipped, clipped);
  at::Tensor g_pg = t.weights;  // d loss / d L_pg
  if (s.dual_clip.has_value()) {
    const at::Tensor bound = nadv * *s.dual_clip;
    const at::Tensor neg = adv < 0;
    if (want_grad) g_pg = g_pg * at::where(neg, share(bound, out.per_token), one);
    out.per_token = at::where(neg, at::minimum(out.per_token, bound), out.per_token);
  }
  if (want_grad) {
    const at::Tensor in_clip = at::logical_and(ratio >= lo, ratio <= hi);
    const at::Tensor g_ratio = g_pg * (share(unclipped, clipped) + share(clipped, unclipped) * in_clip) * nadv;
    out.g_lp = at::where(passes, g_ratio * ratio, zero).to(t.lp.scalar_type());
  }
  return out;
}

// CISPO, as cispo_policy_loss computes it: −sg(clip(r)) · A · lp, whose gradient is the constant
// −sg(clip(r)) · A per token.
PolicyTerms cispo_terms(const ChunkTokens& t, const PpoScalars& s, const at::Tensor& log_ratio,
                        const at::Tensor& adv, bool want_grad) {
  const at::Tensor zero = at::zeros({}, t.old_logprobs.options());
  const at::Tensor coef = at::clamp(at::exp(log_ratio), at::Scalar(1.0 - s.cliprange_low),
                                    at::Scalar(1.0 + s.cliprange_high)).neg() * adv;
  PolicyTerms out;
  out.per_token = coef * at::where(t.mask, t.lp.to(t.old_logprobs.scalar_type()), zero);
  if (want_grad) out.g_lp = (t.weights * coef).to(t.lp.scalar_type());
  return out;
}

// ℓ = L_pg + kl_coef·kl − entropy_coef·H per token, and the derivatives that autograd takes
// through the policy loss, kl_penalty and aggregate_loss. Masked positions are selected away
// (never multiplied by 0), so garbage there (−inf old log-probs, NaN advantages) contributes
// nothing.
TokenTerms token_terms(const ChunkTokens& t, const PpoScalars& s, c10::string_view estimator, bool want_grad) {
  using KlFn = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, std::optional<double>,
                          std::optional<double>);
  using KlBwdFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                             std::optional<double>, std::optional<double>);
  static auto kl_op = c10::Dispatcher::singleton().findSchemaOrThrow("pyppo::kl_penalty", "").typed<KlFn>();
  static auto kl_bwd_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyppo::kl_penalty_backward", "").typed<KlBwdFn>();

  const at::Tensor& m = t.mask;
  const at::Tensor zero = at::zeros({}, t.old_logprobs.options());
  // The losses' own operations, so that every comparison sees their bits.
  const at::Tensor raw = t.lp.to(t.old_logprobs.scalar_type()) - t.old_logprobs;
  const at::Tensor log_ratio =
      at::where(m, at::clamp(raw, at::Scalar(-kLogRatioClamp), at::Scalar(kLogRatioClamp)), zero);
  const at::Tensor adv = at::where(m, t.advantages, zero);
  const PolicyTerms pg = s.loss == PolicyLoss::CISPO ? cispo_terms(t, s, log_ratio, adv, want_grad)
                                                     : clipped_ratio_terms(t, s, raw, log_ratio, adv, want_grad);
  at::Tensor per_token = pg.per_token;
  at::Tensor g_lp = pg.g_lp, g_ent;
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

// GSPO's log s_i before its bound, per token ([N], the old log-probs' dtype): the mean of each
// row's clamped token log-ratios over its valid tokens, as sequence_log_ratio computes it.
at::Tensor sequence_log_ratio(const at::Tensor& logprobs, const PpoTokens& tok, const at::Tensor& mask,
                              int64_t B, int64_t T) {
  const at::Tensor zero = at::zeros({}, tok.old_logprobs.options());
  const at::Tensor raw = logprobs.to(tok.old_logprobs.scalar_type()) - tok.old_logprobs;
  const at::Tensor log_ratio =
      at::where(mask, at::clamp(raw, at::Scalar(-kLogRatioClamp), at::Scalar(kLogRatioClamp)), zero).view({B, T});
  const at::Tensor n = mask.view({B, T}).sum(-1, true).clamp_min(1).to(log_ratio.scalar_type());
  return (log_ratio.sum(-1, true) / n).expand({B, T}).reshape({B * T});
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_ppo_loss_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& old_logprobs,
    const at::Tensor& advantages, const at::Tensor& response_mask, const at::Tensor& token_weights,
    const std::optional<at::Tensor>& ref_logprobs, const std::optional<at::Tensor>& bias, double temperature,
    int64_t ignore_index, double cliprange_low, double cliprange_high, std::optional<double> dual_clip,
    double kl_loss_coef, c10::string_view kl_loss_estimator, double entropy_coef, bool return_entropy,
    int64_t chunk_size, std::array<bool, 3> output_mask, c10::string_view policy_loss) {
  const PpoScalars s = check_linear_ppo_loss(hidden, weight, labels, old_logprobs, advantages, response_mask,
                                             token_weights, ref_logprobs, bias, temperature, cliprange_low,
                                             cliprange_high, dual_clip, kl_loss_coef, kl_loss_estimator,
                                             entropy_coef, chunk_size, policy_loss);
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
  // GSPO's ratio needs every token of a row before any token's gradient: when the tokens take
  // more than one chunk, a first pass computes the log-probs alone (one GEMM per chunk); in one
  // chunk they are the chunk's.
  const bool gspo = s.loss == PolicyLoss::GSPO;
  const int64_t B = labels.size(0), T = labels.size(1);
  at::Tensor seq_log_ratio;
  if (gspo && C < f.N) {
    for (int64_t a = 0; a < f.N; a += C) {
      const int64_t b = std::min(f.N, a + C);
      at::Tensor logits = chunk_logits(buf, f.hidden.slice(0, a, b), weight, bias);
      logprobs.slice(0, a, b).copy_(std::get<0>(gather_rows(logits, f, a, b, temperature, ignore_index, false)));
    }
    seq_log_ratio = sequence_log_ratio(logprobs, tok, f.mask, B, T);
  }
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
    if (gspo) {
      if (!seq_log_ratio.defined()) seq_log_ratio = sequence_log_ratio(logprobs, tok, f.mask, B, T);
      t.seq_log_ratio = seq_log_ratio.slice(0, a, b);
    }
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
