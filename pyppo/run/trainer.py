"""The trainer with its run: :class:`PPOTrainer` is the algorithm of :mod:`pyppo.trainer` (one
step at a time) plus the run around the steps, as thin calls into this package: the loop with its
logs, cadences and signals (:mod:`.loop`), held-out evaluation (:mod:`.evaluate`), checkpoints
(:mod:`.checkpoint`) and the exported policy (:mod:`.export`). It is ``pyppo.PPOTrainer``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..trainer import ppo
from . import checkpoint, evaluate, export, loop
from .stopping import GracefulStop

__all__ = ["PPOTrainer"]


class PPOTrainer(ppo.PPOTrainer):
    """PPO for a causal LM policy, and the run around its steps. Built with the arguments of
    :class:`pyppo.trainer.PPOTrainer` (the algorithm: :meth:`step`, its state and its models),
    whose docstring describes them; this class adds :meth:`train`, :meth:`evaluate_prompts`,
    :meth:`save_checkpoint`, :meth:`load_checkpoint`, :meth:`load_value_model` and
    :meth:`export_policy`."""

    def train(
        self, output_dir: str | os.PathLike, *, progress: bool = True, stop: Optional[GracefulStop] = None
    ) -> List[Dict[str, float]]:
        """Run steps ``step_count + 1 … config.steps``, logging to ``output_dir``: see
        :func:`pyppo.run.loop.train`."""
        return loop.train(self, output_dir, progress=progress, stop=stop)

    def evaluate_prompts(self, prompts: Optional[Sequence[str]] = None) -> Tuple[Dict[str, float], List[dict]]:
        """Held-out evaluation (``eval_prompts`` by default): see :func:`pyppo.run.evaluate.evaluate_prompts`."""
        return evaluate.evaluate_prompts(self, prompts)

    def save_checkpoint(self, directory: str | os.PathLike) -> Optional[Path]:
        """Write everything needed to resume exactly: see :func:`pyppo.run.checkpoint.save_trainer`."""
        return checkpoint.save_trainer(self, directory)

    def load_checkpoint(self, directory: str | os.PathLike) -> Path:
        """Restore a checkpoint of :meth:`save_checkpoint`: see :func:`pyppo.run.checkpoint.load_trainer`."""
        return checkpoint.load_trainer(self, directory)

    def load_value_model(self, directory: str | os.PathLike) -> Path:
        """Start the value model from an earlier run's checkpoint (a warm start, before the first
        step): see :func:`pyppo.run.checkpoint.load_trained_value_model`."""
        return checkpoint.load_trained_value_model(self, directory)

    def export_policy(self, directory: str | os.PathLike) -> Optional[Path]:
        """Write the policy as a Hugging Face model directory: see :func:`pyppo.run.export.export_trainer_policy`."""
        return export.export_trainer_policy(self, directory)
