"""How far the rollout engine's log-probs are from the trainer's, and the importance-sampling
correction of that mismatch (``docs/trainer.md``, "Sampler mismatch").

An inference engine (vLLM) samples with kernels, precision and batching of its own, so the
distribution it sampled from, ``pi_rollout``, is not exactly the trainer's ``pi_old`` even at the
same weights. pyppo's PPO ratio stays its own (``old_logprobs`` come from the trainer's forward, so
the first ratio is exactly 1); the samples are still drawn from ``pi_rollout``. The per-token weight
``w = pi_old / pi_rollout = exp(old_logprobs - rollout_logprobs)``, truncated (TIS: Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training") or masked outside
``[1/cap, cap]`` (masked IS, as IcePop: Ling Team 2025, "Every Step Evolves"), re-weights each
token's policy-gradient loss towards ``pi_old``.

The sequence modes use one weight per response, ``exp(mean_t log w_t)`` over its response tokens:
the geometric mean of the token ratios. The product (``exp(sum_t log w_t)``), which veRL 0.9.1's
``rollout_is = "sequence"`` uses, grows with the response length, so a fixed cap would truncate or
mask almost every long response.

Tensors are ``[B, T]`` on the response positions; the mask is the batch's ``loss_mask`` (the
policy's own tokens), ``[B, T]`` bool. Every function returns new tensors except
:func:`correct_for_sampler`, the step's stage, which folds the weights into ``batch.advantages``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .. import distributed
from ..config import ROLLOUT_CORRECTIONS
from ..ops.losses import LOG_RATIO_CLAMP

__all__ = [
    "ROLLOUT_CORRECTIONS",
    "correct_for_sampler",
    "MISMATCH_RATIO_BAND",
    "check_rollout_logprobs",
    "rollout_log_ratio",
    "rollout_is_weights",
    "mismatch_metrics",
]

#: A token counts in ``mismatch_ratio_outside_fraction`` when ``pi_old / pi_rollout`` leaves this band.
MISMATCH_RATIO_BAND = (0.5, 2.0)


def check_rollout_logprobs(rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` (the engine) if ``rollout_logprobs`` is not a float
    ``[B, T]`` tensor like ``response_mask``, or is NaN, +inf or positive at a response token (a
    sampled token has a probability in (0, 1])."""
    if not isinstance(rollout_logprobs, torch.Tensor) or not rollout_logprobs.is_floating_point():
        raise ValueError(
            f"{where}: rollout_logprobs must be a float tensor, got {type(rollout_logprobs).__name__}"
            + (f" of {rollout_logprobs.dtype}" if isinstance(rollout_logprobs, torch.Tensor) else "")
        )
    if rollout_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"{where}: rollout_logprobs has shape {tuple(rollout_logprobs.shape)}, expected "
            f"{tuple(response_mask.shape)} (the response's)"
        )
    valid = rollout_logprobs[response_mask]
    bad = ~(torch.isfinite(valid) & (valid <= 1e-4))  # a little above 0: the engine's rounding
    if bool(bad.any()):
        raise ValueError(
            f"{where}: rollout_logprobs has {int(bad.sum())} response token(s) that are not a finite "
            f"log-probability <= 0 (first: {float(valid[bad][0])})"
        )


def rollout_log_ratio(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``log(pi_old / pi_rollout)`` per token, ``[B, T]`` float32, 0 where ``response_mask`` is 0."""
    d = old_logprobs.float() - rollout_logprobs.float()
    return torch.where(response_mask, d, torch.zeros((), dtype=d.dtype, device=d.device))


def rollout_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, *, mode: str, cap: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The detached importance weight of each response token (module docstring).

    Args:
        old_logprobs, rollout_logprobs: ``[B, T]`` float, the trainer's and the engine's log-probs of
            the sampled tokens.
        response_mask: ``[B, T]`` bool.
        mode: one of :data:`ROLLOUT_CORRECTIONS` other than ``"none"``. With ``r`` the token's ratio
            ``exp(old - rollout)`` (``token_*``) or the response's ``exp(mean_t (old - rollout))``
            (``sequence_*``): ``*_truncate``: ``min(r, cap)``; ``*_mask``: ``r`` inside
            ``[1/cap, cap]``, else 0.
        cap: ``>= 1``.

    Returns:
        ``(weights, corrected)``: ``weights [B, T]`` float32 (0 at masked positions), ``corrected
        [B, T]`` bool, the response tokens whose weight was truncated or masked.

    Raises:
        ValueError: an unknown ``mode``, or ``cap < 1``.
    """
    if mode not in ROLLOUT_CORRECTIONS[1:]:
        raise ValueError(f"mode must be one of {ROLLOUT_CORRECTIONS[1:]}, got {mode!r}")
    if not cap >= 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    log_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs, response_mask)
    if mode.startswith("sequence"):
        n = response_mask.sum(dim=1, keepdim=True).clamp_min(1)
        log_ratio = (log_ratio.sum(dim=1, keepdim=True) / n).expand_as(log_ratio)
    # exp stays finite; a clamped ratio is far beyond any useful cap either way.
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode.endswith("truncate"):
        corrected = ratio > cap
        weights = ratio.clamp(max=cap)
    else:
        corrected = (ratio > cap) | (ratio < 1.0 / cap)
        weights = torch.where(corrected, torch.zeros((), dtype=ratio.dtype, device=ratio.device), ratio)
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    return torch.where(response_mask, weights, zero).detach(), corrected & response_mask


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    world: Optional[distributed.World] = None,
) -> Dict[str, float]:
    """How far the engine's log-probs are from the trainer's, over every rank's response tokens.

    Returns:
        ``mismatch_logprob_diff_mean`` / ``mismatch_logprob_diff_max``: mean and max of
        ``|old_logprobs - rollout_logprobs|`` (nats); ``mismatch_kl_k3``: the k3 estimate (Schulman
        2020, "Approximating KL divergence") of ``KL(pi_rollout || pi_old)`` per token, nats, from
        the engine's samples: ``mean(r - 1 - log r)`` with ``r = pi_old / pi_rollout``;
        ``mismatch_ratio_outside_fraction``: the fraction of tokens whose ``r`` leaves
        :data:`MISMATCH_RATIO_BAND`. All 0 when no token is valid.
    """
    log_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs, response_mask)[response_mask].double()
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    lo, hi = MISMATCH_RATIO_BAND
    outside = (clamped < torch.log(torch.tensor(lo, dtype=torch.float64))) | (
        clamped > torch.log(torch.tensor(hi, dtype=torch.float64))
    )
    sums = [
        float(log_ratio.numel()),
        float(log_ratio.abs().sum()),
        float((torch.expm1(clamped) - clamped).sum()),
        float(outside.sum()),
    ]
    if world is not None:
        sums = distributed.all_sum(sums, world)
    n, abs_sum, k3_sum, outside_sum = sums
    n = max(n, 1.0)
    return {
        "mismatch_logprob_diff_mean": abs_sum / n,
        "mismatch_logprob_diff_max": float(log_ratio.abs().max()) if log_ratio.numel() else 0.0,
        "mismatch_kl_k3": k3_sum / n,
        "mismatch_ratio_outside_fraction": outside_sum / n,
    }


@torch.no_grad()
def correct_for_sampler(batch, mode: str, cap: float, world, engine_name: str) -> Dict[str, float]:
    """A PPO step's sampler-mismatch stage: when the engine reported ``rollout_logprobs``, the
    :func:`mismatch_metrics` and, with a correction ``mode`` (``PPOConfig.rollout_correction``,
    cap ``cap``), each token's :func:`rollout_is_weights` folded into ``batch.advantages``
    (in place), plus ``rollout_corrected_fraction``. The clipped PPO token loss (dual clip
    included) is positively homogeneous in the advantage, so for a weight ``w >= 0`` the loss of
    ``w * A`` is ``w`` times the loss of ``A``: the eager loss and ``linear_ppo_loss`` both weight
    each token's policy-gradient loss by ``w`` that way, with the ratio, the clip fraction and the
    value loss untouched.

    Args:
        batch: the step's :class:`~pyppo.trainer.buffer.RolloutBuffer`, advantages filled.
        world: the :class:`~pyppo.distributed.World` the counts are summed over.
        engine_name: the engine, for the error.

    Raises:
        ValueError: a correction ``mode`` with an engine that reports no log-probs.
    """
    if batch.rollout_logprobs is None:
        # PPOConfig refuses a correction without the vLLM engine; an engine put in by hand may
        # still report no log-probs.
        if mode != "none":
            raise ValueError(
                f"rollout_correction={mode!r} needs the rollout engine's own log-probs, and {engine_name} returns "
                'none (rollout_logprobs is None); set rollout_correction = "none" or use an engine that reports them'
            )
        return {}
    metrics = mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, world)
    if mode != "none":
        weights, corrected = rollout_is_weights(
            batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, mode=mode, cap=cap
        )
        batch.advantages = batch.advantages * weights
        n, k = distributed.all_sum([int(batch.loss_mask.sum()), int(corrected.sum())], world)
        metrics["rollout_corrected_fraction"] = k / max(n, 1)
    return metrics
