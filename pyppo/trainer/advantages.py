"""Advantage estimators: from a rollout's shaped per-token rewards (and values) to advantages and
returns, point 5 of a step (``docs/trainer.md``).

An estimator is a function ``(batch, config) -> (advantages [B, T], returns [B, T])``, float32,
0 at masked positions, registered by name in :data:`ADVANTAGE_ESTIMATORS`. It reads the batch's
``rewards`` (the score and the KL penalty already shaped in, :func:`pyppo.ops.shape_rewards`),
``values`` and ``response_mask``. Whitening over the whole batch (every rank's) is the trainer's,
after the estimator.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from ..config import PPOConfig
from ..ops import gae
from .buffer import RolloutBuffer

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "gae_advantages", "get_estimator"]

AdvantageEstimator = Callable[[RolloutBuffer, PPOConfig], Tuple[torch.Tensor, torch.Tensor]]


def gae_advantages(batch: RolloutBuffer, config: PPOConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation", eq. 16) over each response's valid tokens,
    with ``config.gamma`` and ``config.lam``; ``returns = advantages + values``
    (:func:`pyppo.ops.gae`)."""
    return gae(batch.rewards, batch.values, batch.response_mask, gamma=config.gamma, lam=config.lam)


#: Estimators by name.
ADVANTAGE_ESTIMATORS: Dict[str, AdvantageEstimator] = {"gae": gae_advantages}


def get_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``.

    Raises:
        ValueError: no estimator of that name (naming the known ones).
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is not one of {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]
