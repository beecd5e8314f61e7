"""Keeping an engine that holds its own copy of the policy's weights (one with
``sync_weights(model, trainable_only=...)``, as :class:`~pyppo.rollout.vllm_engine.VLLMEngine`)
up to date with the policy the trainer updates."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["EngineSync"]


class EngineSync:
    """Syncs an engine's weights when the policy changed since its last copy.

    The engine is built from the policy's weights, so it starts in sync. An applied optimizer
    step changes what requires grad (``trainable_only`` syncs); a loaded checkpoint may change any
    weight (:meth:`weights_loaded`: the next sync copies every weight). An engine without
    ``sync_weights`` (``transformers.generate`` samples with the policy itself) is left alone.
    """

    def __init__(self) -> None:
        self.synced_at = 0  # the applied optimizer steps whose weights the engine holds; -1: any may differ

    def weights_loaded(self) -> None:
        """The policy's weights were replaced (a checkpoint): the next sync copies all of them."""
        self.synced_at = -1

    def __call__(self, engine: Any, policy: nn.Module, optimizer_steps: int) -> None:
        sync = getattr(engine, "sync_weights", None)
        if callable(sync) and self.synced_at != optimizer_steps:
            sync(policy, trainable_only=self.synced_at >= 0)
            self.synced_at = optimizer_steps
