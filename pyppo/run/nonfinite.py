"""The last guard before a checkpoint: trained weights that are NaN/inf are never written over the
last good checkpoint. (The step's own guards, a skipped update and a non-finite rollout, are
:mod:`pyppo.trainer.guards`.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import distributed
from ..trainer.guards import NonFiniteRolloutError, NonFiniteUpdateError

if TYPE_CHECKING:
    from ..trainer import PPOTrainer

__all__ = ["NonFiniteUpdateError", "NonFiniteRolloutError", "check_weights_finite"]


def check_weights_finite(trainer: PPOTrainer, where: str) -> None:
    """Raise :class:`NonFiniteUpdateError` when a trained weight (``requires_grad``) of
    the policy or the value model is NaN/inf on any rank (each rank counts its
    FSDP2 shard; a collective). Called before a checkpoint is written: one of non-finite weights
    would replace the last good one. An optimizer step with finite gradients can still overflow
    a weight (a huge ``lr``), which the skip rule does not see."""
    counts = []
    for model in trainer.models.trained_models():
        for p in model.parameters():
            if p.requires_grad:
                local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 DTensor's shard
                counts.append(torch.count_nonzero(~torch.isfinite(local.detach())))
    bad = int(torch.stack(counts).sum()) if counts else 0
    bad = int(distributed.all_sum([bad], trainer.world)[0])
    if bad:
        raise NonFiniteUpdateError(
            f"{where}: {bad} trained weights are NaN/inf: the model diverged (try a lower lr, "
            "a max_grad_norm, or lr_warmup_steps); they are not checkpointed"
        )
