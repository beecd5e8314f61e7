"""Rollouts: the interface of a rollout engine (:mod:`.engine`), what every engine shares
(prompt encoding and the response mask, :mod:`.tokens`), and the engine that samples with the
policy through ``transformers.generate`` (:mod:`.hf_generate`)."""

from .engine import Rollout, RolloutEngine
from .hf_generate import HFGenerateEngine

__all__ = ["HFGenerateEngine", "Rollout", "RolloutEngine"]
