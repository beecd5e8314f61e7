"""Eager per-token KL estimators: a chain of elementwise ops (OpenRLHF / TRL)."""

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
