"""Point 4 of a step (``docs/trainer.md``): the forwards over the rollout that fill its
``old_logprobs``, ``entropy``, ``ref_logprobs`` and ``values``, run on exactly the micro-batches
the first epoch trains on, so that the first training forward repeats them bit for bit (the
first ratio is exactly 1)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import torch

from ..precision import autocast
from .buffer import RolloutBuffer
from .step_stats import PhaseTimer

if TYPE_CHECKING:
    from .assemble import StepModels

__all__ = ["rollout_forwards", "first_policy_forward"]


@torch.no_grad()
def rollout_forwards(
    models: StepModels,
    batch: RolloutBuffer,
    first_perm: torch.Tensor,
    micro_batch_size: int,
    timer: PhaseTimer,
    *,
    first_policy: bool = True,
) -> None:
    """Fill ``batch``'s ``old_logprobs``, ``entropy``, ``ref_logprobs`` and ``values`` (``[B, T]``
    float32 on ``models.device``, 0 outside ``loss_mask``; ``values`` stays 0 without a critic)
    without gradients, under ``models.dtype``'s autocast, on the micro-batches of ``micro_batch_size`` rows of
    ``first_perm``, the first epoch's row order. ``first_policy=False`` leaves the first
    micro-batch's ``old_logprobs`` and ``entropy`` to :func:`first_policy_forward`."""
    B, T = len(batch), batch.response_length
    for name in ("old_logprobs", "entropy", "ref_logprobs", "values"):
        setattr(batch, name, torch.zeros(B, T, device=models.device))
    if models.critic is not None:
        models.critic.train(False)
    for i, idx in enumerate(first_perm.split(micro_batch_size)):
        mb, ix = batch.select(idx), idx.to(models.device)
        with autocast(models.device, models.dtype):
            if first_policy or i > 0:
                with timer.phase("policy_forward"):
                    batch.old_logprobs[ix], batch.entropy[ix] = models.policy_module(mb, return_entropy=True)
            with timer.phase("ref_forward"):
                batch.ref_logprobs[ix] = models.ref_logprobs(mb)[0]
            if models.critic is not None:
                with timer.phase("value_forward"):
                    batch.values[ix] = models.critic.values(mb)


def first_policy_forward(
    models: StepModels, batch: RolloutBuffer, first_perm: torch.Tensor, micro_batch_size: int, timer: PhaseTimer
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The policy forward of the first micro-batch, with grad, in training mode (dropout is off:
    ``PPOTrainer.first_pass_is_rollout_pass``). Its detached log-probs and entropy become the
    rollout's for those rows; the live ``(logprobs, entropy)``, ``[b, T]``, are returned for the
    first ``micro_step``, before any optimizer step, so that forward does not run twice."""
    rows = first_perm[:micro_batch_size]
    models.policy.train()
    with timer.phase("policy_forward"), autocast(models.device, models.dtype):
        logprobs, entropy = models.policy_module(batch.select(rows), return_entropy=True)
    ix = rows.to(models.device)
    batch.old_logprobs[ix], batch.entropy[ix] = logprobs.detach(), entropy.detach()
    return logprobs, entropy
