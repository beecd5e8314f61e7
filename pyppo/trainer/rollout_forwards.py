"""Point 4 of a step (``docs/trainer.md``): the forwards over the rollout that fill its
``old_logprobs``, ``entropy``, ``ref_logprobs`` and ``values``, run on exactly the micro-batches
the first epoch trains on, so that the first training forward repeats them bit for bit (the
first ratio is exactly 1)."""

from __future__ import annotations

from typing import Tuple

import torch

from ..precision import autocast
from .buffer import RolloutBuffer
from .step_stats import PhaseTimer

__all__ = ["rollout_forwards", "first_policy_forward"]


@torch.no_grad()
def rollout_forwards(trainer, batch: RolloutBuffer, first_perm: torch.Tensor, timer: PhaseTimer, *,
                     first_policy: bool = True) -> None:
    """Fill ``batch``'s ``old_logprobs``, ``entropy``, ``ref_logprobs`` and ``values`` (``[B, T]``
    float32, 0 where masked; ``values`` stays 0 without a value model) without gradients, with
    ``trainer``'s modules, on the micro-batches of ``first_perm``, the first epoch's row order.
    ``first_policy=False`` leaves the first micro-batch's ``old_logprobs`` and ``entropy`` to
    :func:`first_policy_forward`."""
    B, T = len(batch), batch.response_length
    for name in ("old_logprobs", "entropy", "ref_logprobs", "values"):
        setattr(batch, name, torch.zeros(B, T, device=trainer.device))
    if trainer.critic is not None:
        trainer.critic.train(False)
    for i, idx in enumerate(first_perm.split(trainer.micro_batch_size)):
        mb, ix = batch.select(idx), idx.to(trainer.device)
        with autocast(trainer.device, trainer.dtype):
            if first_policy or i > 0:
                with timer.phase("policy_forward"):
                    batch.old_logprobs[ix], batch.entropy[ix] = trainer.policy_module(mb, return_entropy=True)
            with timer.phase("ref_forward"):
                batch.ref_logprobs[ix] = trainer.ref_logprobs(mb)[0]
            if trainer.critic is not None:
                with timer.phase("value_forward"):
                    batch.values[ix] = trainer.critic.values(mb)


def first_policy_forward(trainer, batch: RolloutBuffer, first_perm: torch.Tensor,
                         timer: PhaseTimer) -> Tuple[torch.Tensor, torch.Tensor]:
    """The policy forward of the first micro-batch, with grad, in training mode (dropout is off:
    ``PPOTrainer.first_pass_is_rollout_pass``). Its detached log-probs and entropy become the
    rollout's for those rows; the live ``(logprobs, entropy)``, ``[b, T]``, are returned for the
    first ``micro_step``, before any optimizer step, so that forward does not run twice."""
    rows = first_perm[:trainer.micro_batch_size]
    trainer.policy.train()
    with timer.phase("policy_forward"), autocast(trainer.device, trainer.dtype):
        logprobs, entropy = trainer.policy_module(batch.select(rows), return_entropy=True)
    ix = rows.to(trainer.device)
    batch.old_logprobs[ix], batch.entropy[ix] = logprobs.detach(), entropy.detach()
    return logprobs, entropy
