"""Exporting a trainer's policy as a Hugging Face model directory: the model format is
:mod:`pyppo.models.export`'s; what this adds is gathering FSDP2-sharded weights onto rank 0."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from .. import distributed
from ..models.export import save_policy

if TYPE_CHECKING:
    from ..trainer import PPOTrainer

__all__ = ["export_trainer_policy"]


def export_trainer_policy(trainer: PPOTrainer, directory: str | os.PathLike) -> Optional[Path]:
    """Write the policy as a Hugging Face model directory (``save_pretrained`` and the
    tokenizer; with LoRA the merged model, or the adapter when ``merge_lora`` is false),
    swapped in atomically (:func:`save_policy`). Every rank calls it (FSDP2
    gathers the weights onto rank 0's CPU copy of the model's structure); rank 0 writes and
    gets the directory, the others ``None``."""
    models = trainer.models
    model = models.policy
    if distributed.is_sharded(models.policy_module):
        state = distributed.full_state_dict(models.policy_module, prefix="model.")  # every rank
        if not trainer.world.is_main:
            return None
        model = models.export_replica
        model.load_state_dict(state, assign=True)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.tie_weights()  # assign=True gave the tied head its own tensor
    elif not trainer.world.is_main:
        return None
    try:
        return save_policy(
            model,
            trainer.tokenizer,
            directory,
            merge_lora=trainer.config.merge_lora,
            base_model=trainer.base_model_source,
        )
    finally:
        if models.export_replica is not None:
            models.export_replica.to("meta")  # drop the gathered weights
