// Every pyppo operator schema, in one place. Each op family registers its implementations per
// dispatch key: CPU in cpu/<family>_impl.cpp, CUDA in cuda/<family>_impl.cpp, and the fake kernels
// that torch.compile and FakeTensorMode trace on the Meta device in meta/<family>_fake.cpp (all
// three run the checks of checks/<family>.h); autograd formulas are registered from Python
// (pyppo/ops/<family>.py), except group_advantages' (below). Semantics: docs/ops.md; every
// family's files: CONTRIBUTING.md.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

TORCH_LIBRARY(pyppo, m) {
  // logits [*, V], labels [*] int64, mask [*] bool (or undefined) ->
  // (logprobs [*], entropy [*] or [0] when return_entropy is false, lse [*]: logsumexp(z/T), saved for backward)
  m.def("gather_logprobs(Tensor logits, Tensor labels, Tensor? mask, float temperature, int ignore_index, "
        "bool return_entropy) -> (Tensor, Tensor, Tensor)");
  m.def("gather_logprobs_backward(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, Tensor labels, "
        "Tensor? mask, Tensor lse, Tensor? entropy, float temperature, int ignore_index) -> Tensor");

  // hidden [*, H], weight [V, H], labels [*] -> as gather_logprobs(hidden @ weight.T + bias, ...),
  // computed in chunks of chunk_size tokens (0: chosen from N and V).
  m.def("linear_logprobs(Tensor hidden, Tensor weight, Tensor labels, Tensor? mask, Tensor? bias, float temperature, "
        "int ignore_index, bool return_entropy, int chunk_size) -> (Tensor, Tensor, Tensor)");
  // -> (grad_hidden, grad_weight, grad_bias); output_mask says which are wanted.
  m.def("linear_logprobs_backward(Tensor grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
        "Tensor labels, Tensor? mask, Tensor? bias, Tensor lse, Tensor? entropy, float temperature, int ignore_index, "
        "int chunk_size, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");

  // hidden [B, T, H], weight [V, H], labels and the per-token inputs [B, T] -> (loss [], logprobs [B, T],
  // entropy [B, T] or [0] when neither return_entropy nor entropy_coef > 0, grad_hidden, grad_weight,
  // grad_bias): loss = sum(token_weights * per-token policy loss), its gradients computed in the same
  // chunked pass (output_mask says which; one not wanted is [0]). policy_loss: "ppo", "gspo" (one
  // more logits GEMM per chunk when the tokens take more than one chunk) or "cispo".
  m.def("linear_ppo_loss(Tensor hidden, Tensor weight, Tensor labels, Tensor old_logprobs, Tensor advantages, "
        "Tensor response_mask, Tensor token_weights, Tensor? ref_logprobs, Tensor? bias, float temperature, "
        "int ignore_index, float cliprange_low, float cliprange_high, float? dual_clip, float kl_loss_coef, "
        "str kl_loss_estimator, float entropy_coef, bool return_entropy, int chunk_size, bool[3] output_mask, "
        "str policy_loss=\"ppo\") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");

  m.def("kl_penalty(Tensor logprobs, Tensor ref_logprobs, str estimator, float? clamp_min, float? clamp_max) -> Tensor");
  m.def("kl_penalty_backward(Tensor grad_kl, Tensor logprobs, Tensor ref_logprobs, str estimator, "
        "float? clamp_min, float? clamp_max) -> Tensor");

  // -> (rewards [B, T], kl [B, T])
  m.def("shape_rewards(Tensor scores, Tensor logprobs, Tensor ref_logprobs, Tensor response_mask, float kl_coef, "
        "str estimator, float? score_clip) -> (Tensor, Tensor)");

  // -> (advantages [B, T], returns [B, T]). row_lam [B]: each row's lam, replacing lam for the
  // advantages; lam_critic: the returns' lam (None: the advantages' lam, per row with row_lam).
  m.def("gae(Tensor rewards, Tensor values, Tensor response_mask, float gamma, float lam, Tensor? last_values, "
        "float? lam_critic=None, Tensor? row_lam=None) -> (Tensor, Tensor)");

  // turn_ids [B, T] integer (the agent turn of a position, negative where no agent token) ->
  // (advantages [B, T], returns [B, T]): GAE over each row's agent turns, broadcast onto the
  // turn's agent positions.
  m.def("turn_gae(Tensor rewards, Tensor values, Tensor turn_ids, float gamma, float lam, Tensor? last_values) "
        "-> (Tensor, Tensor)");

  // scores [B], response_mask [B, T], group_ids [B] int64 in [0, B) -> advantages [B, T]: each
  // score against its group's ("grpo": mean, divided by std + eps when std_normalize; "rloo":
  // leave-one-out mean), broadcast onto the row's valid positions. The group_size overload:
  // B / group_size groups of group_size consecutive rows, the bits of the ids arange(B) // group_size.
  m.def("group_advantages(Tensor scores, Tensor response_mask, Tensor group_ids, str estimator, float eps, "
        "bool std_normalize) -> Tensor");
  m.def("group_advantages.group_size(Tensor scores, Tensor response_mask, int group_size, str estimator, float eps, "
        "bool std_normalize) -> Tensor");

  m.def("masked_mean(Tensor x, Tensor mask, int? dim) -> Tensor");
  m.def("masked_var(Tensor x, Tensor mask, bool unbiased) -> Tensor");
  m.def("masked_whiten(Tensor x, Tensor mask, bool shift_mean, bool unbiased, float eps) -> Tensor");
}

namespace {

// The autograd kernel of an op whose outputs are constants of the PPO update: the op runs below
// autograd, so its outputs come back without a graph (requires_grad=False), as the Python
// registration of pyppo/ops/_non_differentiable.py makes them. Registered here, in C++, for
// group_advantages, which is called on a few thousand scores at a time: the Python kernel's
// round trip (about 5 us a call) was a fifth of its time at 512 prompts x 8 responses.
void run_below_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView guard;
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyppo, Autograd, m) {
  m.impl("group_advantages", torch::CppFunction::makeFromBoxedFunction<&run_below_autograd>());
  m.impl("group_advantages.group_size", torch::CppFunction::makeFromBoxedFunction<&run_below_autograd>());
}
