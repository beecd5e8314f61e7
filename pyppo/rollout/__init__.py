"""Rollouts: the interface of a rollout engine (:mod:`.engine`), what every engine shares
(prompt encoding and the response mask, :mod:`.tokens`), the engine that samples with the
policy through ``transformers.generate`` (:mod:`.hf_generate`), the one that samples with an
in-process vLLM copy of it (:mod:`.vllm_engine`, imported on use: vLLM is optional), the choice
between them (:mod:`.build`), and keeping an engine's copy of the weights current (:mod:`.sync`)."""

from .build import make_engine
from .engine import Rollout, RolloutEngine
from .hf_generate import HFGenerateEngine
from .sync import EngineSync

__all__ = ["EngineSync", "HFGenerateEngine", "Rollout", "RolloutEngine", "make_engine"]
