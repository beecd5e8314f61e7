"""The policy losses beyond PPO's token-level clipped ratio: GSPO's sequence-level ratio and
CISPO's clipped importance weight, and the registry of every policy loss by name.

Same conventions as :func:`~pyppo.ops.ppo_policy_loss` (``docs/ops.md``, sections ``gspo`` and
``cispo``): right-padded ``[B, T]`` inputs and a ``response_mask``, arithmetic in float32 (float64
for float64 inputs), the ±20 token log-ratio clamp, the same ``loss_agg`` modes and the same
statistics. Each loss's ratio is exactly 1 when ``logprobs == old_logprobs`` (the first minibatch
of a pyppo step), so its first update is the on-policy gradient.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from .losses import Stats, _clipped_surrogate, _policy_loss, named_errors, ppo_policy_loss

__all__ = [
    "GSPO_LOG_RATIO_MAX",
    "POLICY_LOSSES",
    "cispo_policy_loss",
    "gspo_policy_loss",
    "policy_loss_fn",
    "sequence_log_ratio",
]

# Upper bound on GSPO's sequence log-ratio before the exp, as veRL 0.9.1 bounds it: e^10 ≈ 2.2e4 is
# far past any clip range, so only a sequence the policy has left entirely loses its gradient.
GSPO_LOG_RATIO_MAX = 10.0

PolicyLossFn = Callable[..., Tuple[torch.Tensor, Stats]]


def sequence_log_ratio(log_ratio: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """GSPO's ``log s_i`` before its upper bound: the mean of row ``i``'s clamped token
    log-ratios over its valid tokens (0 for a row without one), broadcast to ``[B, T]``.
    ``log_ratio`` is 0 at masked positions. Detached: the loss passes the gradient through each
    token's own log-prob."""
    n = m.sum(dim=-1, keepdim=True).clamp_min(1).to(log_ratio.dtype)
    return (log_ratio.detach().sum(dim=-1, keepdim=True) / n).expand_as(log_ratio)


def _gspo_token_loss(logprobs, zero, m, log_ratio, adv, cliprange_low, cliprange_high):
    """:func:`gspo_policy_loss`'s per-token terms, as :func:`~pyppo.ops.losses._policy_loss` takes them."""
    lp = logprobs.to(zero.dtype)
    # lp − sg(lp) is exactly 0 for finite lp: the value is log s_i, the gradient that of lp.
    log_r = torch.where(m, lp - lp.detach(), zero) + sequence_log_ratio(log_ratio, m)
    ratio = torch.exp(torch.clamp(log_r, max=GSPO_LOG_RATIO_MAX))
    pg_loss, clipped = _clipped_surrogate(adv, ratio, cliprange_low, cliprange_high)
    return pg_loss, ratio, clipped, torch.zeros_like(m)


def _cispo_token_loss(logprobs, zero, m, log_ratio, adv, cliprange_low, cliprange_high):
    """:func:`cispo_policy_loss`'s per-token terms, as :func:`~pyppo.ops.losses._policy_loss` takes them."""
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high).detach()
    loss_mat = -weight * adv * torch.where(m, logprobs.to(zero.dtype), zero)
    return loss_mat, ratio, ratio != weight, torch.zeros_like(m)


def _policy_loss_without_dual_clip(name: str, token_loss: Callable[..., tuple], doc: str) -> PolicyLossFn:
    """The public policy loss ``name``, documented by ``doc``: :data:`POLICY_LOSSES`' signature
    without ``dual_clip``, computed by :func:`~pyppo.ops.losses._policy_loss` around
    ``token_loss``, its errors named as :func:`~pyppo.ops.losses.named_errors` names them."""

    def loss_fn(
        logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
        cliprange_low: float = 0.2, cliprange_high: float = 0.2,
        loss_agg: str = "token-mean", loss_agg_norm: Optional[float] = None, normalizer: Optional[float] = None,
    ) -> Tuple[torch.Tensor, Stats]:  # fmt: skip
        clip, agg = (cliprange_low, cliprange_high, None), (loss_agg, loss_agg_norm, normalizer)
        return _policy_loss(token_loss, logprobs, old_logprobs, advantages, response_mask, clip, agg)

    loss_fn.__name__ = loss_fn.__qualname__ = name
    loss_fn.__doc__ = doc
    return named_errors(loss_fn)


gspo_policy_loss = _policy_loss_without_dual_clip(
    "gspo_policy_loss",
    _gspo_token_loss,
    """GSPO's clipped surrogate with a sequence-level ratio (Zheng et al. 2025, "Group Sequence
    Policy Optimization", eq. 5-7, in its GSPO-token form, eq. 13-14).

    Per sequence ``i`` with valid tokens ``t`` (``n_i`` of them), ``δ_t = clamp(logprobs −
    old_logprobs, −20, 20)`` and ``s_i = exp(min(Σ_t δ_t / n_i, 10))``, the geometric mean of the
    token ratios; per valid token::

        r_t = sg(s_i) · π_θ(y_t) / sg(π_θ(y_t))        (value s_i, gradient s_i · ∇ log π_θ(y_t))
        L_t = max(−A_t · r_t, −A_t · clip(r_t, 1 − cliprange_low, 1 + cliprange_high))

    reduced with ``loss_agg``. With the same advantage on every token of a sequence (the group
    estimators) this is the paper's sequence-level objective; ``loss_agg="seq-mean-token-mean"``
    is the paper's aggregation (veRL's and pyppo's default is ``token-mean``). The clip applies
    per sequence: every token of a clipped sequence has no gradient. GSPO's clip ranges are far
    narrower than PPO's (the paper uses 3e-4 and 4e-4).

    Same value and gradient as veRL 0.9.1's ``compute_policy_loss_gspo`` where every
    ``|logprobs − old_logprobs| ≤ 20`` (veRL averages unclamped token log-ratios).

    Args:
        logprobs, old_logprobs, advantages, response_mask: as :func:`~pyppo.ops.ppo_policy_loss`
            (``[B, T]``; nats; gradients flow through ``logprobs``).
        cliprange_low: ε_low in ``[0, 1)``. cliprange_high: ε_high ``> 0``.
        loss_agg, loss_agg_norm, normalizer: see :func:`~pyppo.ops.aggregate_loss`.

    Returns:
        ``(loss, stats)`` as :func:`~pyppo.ops.ppo_policy_loss`: ``clipfrac`` counts tokens whose
        sequence is clipped, ``ratio_mean`` / ``ratio_max`` are of ``s_i`` over valid tokens,
        ``approx_kl`` and ``logratio_clampfrac`` are of the token log-ratios, ``clipfrac_lower``
        is 0.

    Raises:
        ValueError: as :func:`~pyppo.ops.ppo_policy_loss` (there is no ``dual_clip``).
    """,
)

cispo_policy_loss = _policy_loss_without_dual_clip(
    "cispo_policy_loss",
    _cispo_token_loss,
    """CISPO: REINFORCE with a clipped, detached importance weight (MiniMax 2025, "MiniMax-M1",
    eq. 4-5).

    Per valid token, with ``r_t = exp(clamp(logprobs − old_logprobs, −20, 20))``::

        L_t = −sg(clip(r_t, 1 − cliprange_low, 1 + cliprange_high)) · A_t · log π_θ(y_t)

    reduced with ``loss_agg``. Unlike PPO's clip, no token loses its gradient: the weight is
    bounded instead (MiniMax set no lower bound, ``cliprange_low`` close to 1, and
    ``cliprange_high`` of a few units). The loss value is ``−w·A·log π``, not a surrogate near
    ``−A``: compare its gradient, not its value, with PPO's. Same value and gradient as veRL
    0.9.1's ``compute_policy_loss_cispo``.

    Args, Returns and Raises: as :func:`gspo_policy_loss`, with ``clipfrac`` the fraction of
    tokens whose weight was clipped (``r_t ≠ clip(r_t)``, as veRL counts it) and ``ratio_mean``
    / ``ratio_max`` of ``r_t``.
    """,
)


#: Every policy loss by name, as ``PPOConfig.policy_loss`` and ``linear_ppo_loss`` take it. Each is
#: ``fn(logprobs, old_logprobs, advantages, response_mask, *, cliprange_low, cliprange_high,
#: loss_agg, loss_agg_norm, normalizer) -> (loss, stats)``; ``"ppo"`` also takes ``dual_clip``.
POLICY_LOSSES: Dict[str, PolicyLossFn] = {"ppo": ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}


def policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name`` in :data:`POLICY_LOSSES`.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return POLICY_LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"policy_loss must be one of {tuple(POLICY_LOSSES)}, got {name!r}") from None
