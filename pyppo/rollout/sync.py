"""Keeping an engine that holds its own copy of the policy's weights
(:class:`~pyppo.rollout.vllm_engine.VLLMEngine`) up to date with the policy the trainer updates,
through its :meth:`~pyppo.rollout.RolloutEngine.sync_weights`."""

from __future__ import annotations

from torch import nn

from .engine import RolloutEngine

__all__ = ["EngineSync"]


class EngineSync:
    """Syncs an engine's weights when the policy changed since its last copy.

    The engine is built from the policy's weights, so it starts in sync. An applied optimizer
    step changes what requires grad (``trainable_only`` syncs); a loaded checkpoint may change any
    weight (:meth:`weights_loaded`: the next sync copies every weight). An engine that samples with
    the policy itself (``transformers.generate``) has nothing to copy: its ``sync_weights`` does
    nothing.
    """

    def __init__(self) -> None:
        self.synced_at = 0  # the applied optimizer steps whose weights the engine holds; -1: any may differ

    def weights_loaded(self) -> None:
        """The policy's weights were replaced (a checkpoint): the next sync copies all of them."""
        self.synced_at = -1

    def __call__(self, engine: RolloutEngine, policy: nn.Module, optimizer_steps: int) -> None:
        if self.synced_at != optimizer_steps:
            engine.sync_weights(policy, trainable_only=self.synced_at >= 0)
            self.synced_at = optimizer_steps
