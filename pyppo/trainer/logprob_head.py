"""The model forwards of a PPO step: response log-probs (and entropies) and values.

Log-probs come from the last hidden states through :func:`pyppo.ops.linear_logprobs` (the
``[B, T, V]`` logits never exist) when the model's logits are a plain linear map of those hidden
states; otherwise from the full logits through :func:`pyppo.ops.gather_logprobs`. Which one is
decided once per model by :class:`LogprobHead`, with one short forward: some families transform
the logits after the LM head (Gemma 2's soft-capping, Cohere's ``logit_scale``, Granite's
``logits_scaling``...), and only the full logits are what ``generate()`` samples from.

Alignment: the batch is a left-padded prompt of ``P`` positions then ``T`` response positions;
the logit at position ``P - 1 + t`` scores response token ``t``, and the value at that position is
the value of the state before token ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from ..ops import aggregate_loss, gather_logprobs, kl_penalty, linear_logprobs
from ..ops.policy_losses import policy_loss_fn
from ..precision import autocast, autocast_dtype
from .buffer import RolloutBuffer

__all__ = ["LogprobHead", "AdaptersDisabled", "PolicyObjective", "policy_objective", "response_values"]

# The head path is kept when it reproduces model(...).logits to float32 rounding (relative to the
# logits' scale); a transform after the head (scale, soft-cap) is far outside this.
_HEAD_RTOL = 1e-5


def _linear_head_candidate(model: nn.Module) -> Optional[Tuple[nn.Module, nn.Linear]]:
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    # Soft-capping can be numerically invisible on a probe with small logits: trust the config.
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        return None
    try:
        backbone, head = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if backbone is None or backbone is model or not isinstance(head, nn.Linear):
        return None
    return backbone, head


@torch.no_grad()
def _head_matches_logits(model: nn.Module, backbone: nn.Module, head: nn.Linear, dtype: torch.dtype) -> bool:
    device = head.weight.device
    V = head.weight.shape[0]
    ids = (torch.arange(8, device=device) * 7919 % V).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        with autocast(device, dtype):  # the same precision as the rollout and training passes
            hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state
            via_head = head(hidden).float()
            logits = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        model.train(was_training)
    if via_head.shape != logits.shape:
        return False
    scale = max(1.0, float(logits.abs().max()))
    return bool((via_head - logits).abs().max() <= _HEAD_RTOL * scale)


@dataclass(frozen=True)
class PolicyObjective:
    """The loss settings of :class:`~pyppo.config.PPOConfig` that a micro-batch's policy loss
    needs besides its log-probs and the rollout's ``old_logprobs``, ``advantages`` and
    ``ref_logprobs`` (``docs/trainer.md``, the update). Built once per run
    (:meth:`from_config`); the minibatch's normaliser comes with each call."""

    cliprange_low: float
    cliprange_high: float
    dual_clip: Optional[float]
    loss_agg: str
    loss_agg_norm: Optional[float]
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    fused: bool = True
    policy_loss: str = "ppo"

    @classmethod
    def from_config(cls, c) -> "PolicyObjective":
        """The objective of a run with config ``c`` (a :class:`~pyppo.config.PPOConfig`)."""
        return cls(
            cliprange_low=c.cliprange,
            cliprange_high=c.effective_cliprange_high,
            dual_clip=c.dual_clip,
            loss_agg=c.loss_agg,
            loss_agg_norm=c.effective_loss_agg_norm,
            entropy_coef=c.entropy_coef,
            kl_loss_coef=c.kl_loss_coef,
            kl_loss_estimator=c.kl_loss_estimator,
            fused=c.fused_policy_loss,
            policy_loss=c.policy_loss,
        )

    def loss_args(self, normalizer: Optional[float], *, fused: bool = False) -> dict:
        """The keyword arguments of the policy loss (``dual_clip`` for ``ppo`` only), with the
        minibatch's ``normalizer`` (:func:`~pyppo.ops.losses.loss_normalizer`); ``fused`` adds
        the terms :func:`~pyppo.ops.linear_ppo_loss` computes in the same pass."""
        names = ["cliprange_low", "cliprange_high", "loss_agg", "loss_agg_norm"]
        names += ["dual_clip"] if self.policy_loss == "ppo" else []
        names += ["kl_loss_coef", "kl_loss_estimator", "entropy_coef", "policy_loss"] if fused else []
        return {**{name: getattr(self, name) for name in names}, "normalizer": normalizer}


def policy_objective(
    logprobs: torch.Tensor,
    entropy: Optional[torch.Tensor],
    mb: RolloutBuffer,
    objective: PolicyObjective,
    normalizer: Optional[float] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The policy's loss from its log-probs: ``policy_loss + kl_loss_coef · kl_loss −
    entropy_coef · entropy_loss``, each term aggregated with ``loss_agg`` over ``mb``'s
    ``loss_mask``, divided by the minibatch's ``normalizer`` (``policy_loss`` from
    :data:`~pyppo.ops.POLICY_LOSSES`: the clipped
    surrogate of Schulman et al. 2017, eq. 7, :func:`~pyppo.ops.ppo_policy_loss`, or GSPO or
    CISPO; the KL term is veRL's ``use_kl_loss``: the
    ``kl_loss_estimator`` of ``logprobs`` against ``ref_logprobs``, in the loss instead of, or as
    well as, in the reward).

    Args:
        logprobs: ``[b, T]`` float32, differentiable. entropy: ``[b, T]`` or ``None`` (needed
            when ``entropy_coef > 0``).

    Returns:
        ``(loss 0-d float32, stats)``: the policy loss's statistics plus
        ``policy_loss`` and, when on, ``kl_loss`` and ``entropy_loss`` (detached).
    """
    o, m = objective, mb.loss_mask
    pg_loss, stats = policy_loss_fn(o.policy_loss)(
        logprobs, mb.old_logprobs, mb.advantages, m, **o.loss_args(normalizer)
    )
    agg = dict(loss_agg=o.loss_agg, loss_agg_norm=o.loss_agg_norm, normalizer=normalizer)
    loss, stats = pg_loss, {**stats, "policy_loss": pg_loss.detach()}
    if o.kl_loss_coef > 0:
        kl_loss = aggregate_loss(kl_penalty(logprobs, mb.ref_logprobs, estimator=o.kl_loss_estimator), m, **agg)
        loss, stats["kl_loss"] = loss + o.kl_loss_coef * kl_loss, kl_loss.detach()
    if o.entropy_coef > 0:
        entropy_loss = aggregate_loss(entropy, m, **agg)
        loss, stats["entropy_loss"] = loss - o.entropy_coef * entropy_loss, entropy_loss.detach()
    return loss, stats


class LogprobHead(nn.Module):
    """Response log-probs of one causal LM, from hidden states when that is exact.

    A module, so that DDP or FSDP2 can wrap it: the whole computation, the op included, is then
    one ``forward`` of the wrapped module.

    Args:
        model: a ``transformers`` causal LM, or a ``peft`` model wrapping one.
        temperature: ``τ``; log-probs are of ``softmax(logits / τ)``, the sampling distribution.
        from_hidden: try the hidden-state path (``PPOConfig.logprobs_from_hidden``); it is used
            only when one probe forward shows ``head(backbone(x)) == model(x).logits``.
        dtype: the compute dtype the probe runs under (``torch.float32`` or ``torch.bfloat16``).

    Attributes:
        uses_hidden: whether the hidden-state path was chosen.
    """

    def __init__(
        self, model: nn.Module, *, temperature: float, from_hidden: bool = True, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.model = model
        self.temperature = temperature
        head = _linear_head_candidate(model) if from_hidden else None
        if head is not None and not _head_matches_logits(model, *head, dtype):
            head = None
        self.uses_hidden = head is not None
        self._head = head  # a tuple: not registered again as submodules (the model owns them)

    def forward(
        self,
        mb: Optional[RolloutBuffer],
        return_entropy: bool = False,
        reference: bool = False,
        *,
        sample: Optional[tuple] = None,
        objective: Optional[PolicyObjective] = None,
        normalizer: Optional[float] = None,
    ):
        """``(logprobs [b, T], entropy [b, T] or None)`` float32, 0 outside ``mb.loss_mask``.

        ``reference=True`` runs a ``peft`` model with its adapters disabled: the frozen base, which
        is the reference policy of a LoRA run. ``sample=(query_ids, query_mask, generation_config,
        kwargs)`` instead returns :func:`pyppo.rollout.hf_generate.generate`'s sequences: sampling also goes
        through this ``forward``, so that FSDP2 gathers the weights it owns (embeddings, head)
        for it as it does for the training passes.

        ``objective`` instead returns ``(loss, stats, logprobs, entropy)``: the policy loss of
        :func:`policy_objective` on ``mb`` with the minibatch's ``normalizer`` (log-probs and
        entropy detached). On the hidden-state
        path with ``objective.fused`` it comes from :func:`pyppo.ops.linear_ppo_loss`, which
        computes the loss's gradient w.r.t. the hidden states and the head inside its forward
        (no ``[b, T, V]`` logits, no recompute in the backward); otherwise from the log-probs.
        """
        if sample is not None:
            from ..rollout.hf_generate import generate

            query_ids, query_mask, gen_config, kwargs = sample
            return generate(self.model, query_ids, query_mask, gen_config, **kwargs)
        if reference:
            with self.model.disable_adapter():
                return self._logprobs(mb, return_entropy)
        if objective is not None:
            return self._objective(mb, objective, normalizer, return_entropy)
        return self._logprobs(mb, return_entropy)

    def _inputs(self, mb: RolloutBuffer) -> dict:
        return dict(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False
        )

    def _hidden_and_head(self, mb: RolloutBuffer):
        backbone, head = self._head
        hidden = backbone(**self._inputs(mb)).last_hidden_state[:, -(mb.response_length + 1) : -1]
        weight, bias = head.weight, head.bias
        low = autocast_dtype(hidden.device)
        if low is not None:
            # The head's GEMM in the autocast dtype, as the sampler's lm_head call; the ops
            # accumulate in float32 and keep the logits unrounded.
            hidden, weight = hidden.to(low), weight.to(low)
            bias = None if bias is None else bias.to(low)
        return hidden, weight, bias

    def _logprobs(self, mb: RolloutBuffer, return_entropy: bool):
        T = mb.response_length
        kwargs = dict(temperature=self.temperature, return_entropy=return_entropy)
        if self._head is not None:
            hidden, weight, bias = self._hidden_and_head(mb)
            out = linear_logprobs(hidden, weight, mb.response_ids, mb.loss_mask, bias=bias, **kwargs)
        else:
            # Slicing from the end works whether or not the model honours logits_to_keep.
            logits = self.model(**self._inputs(mb), logits_to_keep=T + 1).logits[:, -(T + 1) : -1]
            out = gather_logprobs(logits, mb.response_ids, mb.loss_mask, **kwargs)
        return out if return_entropy else (out, None)

    def _objective(self, mb: RolloutBuffer, o: PolicyObjective, normalizer: Optional[float], return_entropy: bool):
        want_entropy = return_entropy or o.entropy_coef > 0
        if self._head is not None and o.fused:
            from ..ops import linear_ppo_loss

            hidden, weight, bias = self._hidden_and_head(mb)
            tokens = (mb.response_ids, mb.old_logprobs, mb.advantages, mb.loss_mask)
            terms = dict(ref_logprobs=mb.ref_logprobs, temperature=self.temperature, return_entropy=want_entropy)
            return linear_ppo_loss(hidden, weight, *tokens, bias=bias, **terms, **o.loss_args(normalizer, fused=True))
        logprobs, entropy = self._logprobs(mb, want_entropy)
        loss, stats = policy_objective(logprobs, entropy, mb, o, normalizer)
        return loss, stats, logprobs.detach(), None if entropy is None else entropy.detach()


class AdaptersDisabled:
    """The reference policy of a LoRA run: the (possibly DDP- or FSDP-wrapped) ``module``, a
    :class:`LogprobHead` over a ``peft`` model, called with its adapters disabled. No second copy
    of the model exists."""

    def __init__(self, module: nn.Module, head: LogprobHead):
        self.module = module
        self.uses_hidden, self.temperature = head.uses_hidden, head.temperature

    def __call__(self, mb: RolloutBuffer, return_entropy: bool = False):
        return self.module(mb, return_entropy, True)


def response_values(value_model: nn.Module, mb: RolloutBuffer) -> torch.Tensor:
    """Values at response positions, ``[b, T]`` float32, 0 outside ``loss_mask`` (the value of
    the state before each of the policy's tokens).

    ``value_model(input_ids, attention_mask, position_ids) -> [b, P + T]`` (a
    :class:`pyppo.models.ValueModel`).
    """
    P, T = mb.prompt_length, mb.response_length
    v = value_model(mb.input_ids, mb.attention_mask, mb.position_ids)[:, P - 1 : P + T - 1].float()
    return torch.where(mb.loss_mask, v, torch.zeros((), dtype=v.dtype, device=v.device))
