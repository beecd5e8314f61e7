"""Eager KL family: the per-token KL estimators, a chain of elementwise ops (OpenRLHF / TRL), and
the KL-shaped rewards of OpenRLHF's ``compute_reward`` (TRL's ``compute_rewards`` is alike)."""

from __future__ import annotations

import torch


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_estimator: str = "k1",
    clamp: tuple[float, float] | None = (-10.0, 10.0),
) -> torch.Tensor:
    """OpenRLHF's ``compute_approx_kl`` (``openrlhf/models/utils.py``): k1/k2/k3 of
    ``log_probs - log_probs_base`` in float32, clamped to ``[-10, 10]`` as OpenRLHF does (TRL's
    ``compute_rewards`` uses the same k1 / k3 formulas without the clamp: ``clamp=None``).
    """
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k1":
        kl = log_ratio
    elif kl_estimator == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_estimator == "k3":
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    elif kl_estimator == "abs":
        kl = log_ratio.abs()
    else:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}")
    if clamp is not None:
        kl = kl.clamp(min=clamp[0], max=clamp[1])
    return kl


def compute_reward(
    r: torch.Tensor,
    kl_coef: float,
    kl: torch.Tensor,
    action_mask: torch.Tensor,
    reward_clip_range: tuple[float, float] | None = None,
) -> torch.Tensor:
    """OpenRLHF's ``compute_reward`` (``openrlhf/models/utils.py``): ``-kl_coef * kl`` plus the
    score scattered at the last valid position, found by ``fliplr().argmax``."""
    if kl_coef <= 0.0:
        kl_coef = 0.0
    if reward_clip_range:
        r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    kl_reward = -kl_coef * kl
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + kl_reward


def shape_rewards(
    scores,
    logprobs,
    ref_logprobs,
    response_mask,
    kl_coef: float,
    estimator: str = "k1",
    score_clip: float | None = None,
):
    """The OpenRLHF experience-maker chain: ``kl = compute_approx_kl(...) * action_mask`` (no
    clamp, to match pyppo's unclamped ``shape_rewards``), then :func:`compute_reward`."""
    mask = response_mask.to(torch.float32)
    kl = compute_approx_kl(logprobs, ref_logprobs, estimator, clamp=None) * mask
    clip = None if score_clip is None else (-score_clip, score_clip)
    rewards = compute_reward(scores.float(), kl_coef, kl, response_mask, clip)
    return rewards, kl
