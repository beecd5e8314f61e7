"""What a PPO step returns: :class:`StepResult` (its metrics, :data:`METRIC_KEYS` at least, and
its batch) and, per micro-batch of the update, :class:`MicroStepResult`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, NamedTuple

import torch

from .buffer import RolloutBuffer
from .step_stats import PHASES

__all__ = ["METRIC_KEYS", "VALUE_METRIC_KEYS", "MicroStepResult", "StepResult"]

#: Keys the metrics of a step with a value model (``advantage_estimator = "gae"``) have, beside
#: :data:`METRIC_KEYS`; a critic-free step has none of them.
VALUE_METRIC_KEYS = ("value_loss", "explained_variance", "time_value_forward")

#: Keys every step's metrics have; diagnostics come on top (``step``, ``clipfrac_lower``,
#: ``ratio_mean``, ``ratio_max``, ``vf_clipfrac``, grad norms, ``eos_fraction``, ``first_*``...).
METRIC_KEYS = tuple(
    k
    for k in (
        "score_mean",
        "reward_mean",
        "kl_mean",
        "kl_coef",
        "entropy_mean",
        "policy_loss",
        "value_loss",
        "clipfrac",
        "approx_kl",
        "explained_variance",
        "response_length_mean",
        "step_seconds",
        *(f"time_{p}" for p in PHASES),
    )
    if k not in VALUE_METRIC_KEYS
)


@dataclass
class StepResult:
    """What :meth:`PPOTrainer.step` returns: its ``metrics`` (python numbers) and its ``batch``
    (prompts, responses, raw and final scores, and every per-token tensor of the step)."""

    metrics: Dict[str, float]
    batch: RolloutBuffer

    def __iter__(self):  # metrics, batch = trainer.step()
        return iter((self.metrics, self.batch))


class MicroStepResult(NamedTuple):
    """What :meth:`PPOTrainer.micro_step` returns, detached, each ``[b, T]``."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor
    loss_mask: torch.Tensor
    critic_mask: torch.Tensor
