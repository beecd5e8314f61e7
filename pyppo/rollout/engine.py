"""What a rollout engine is: prompts in; token ids, masks and the sampler's own log-probs out.

The trainer asks an engine for one response per prompt and trains on what it returns. An engine
may sample with the policy itself (:class:`~pyppo.rollout.hf_generate.HFGenerateEngine`, through
``transformers.generate``) or with a separate inference engine holding a copy of its weights; the
trainer computes its own ``old_logprobs`` either way, and ``rollout_logprobs`` says how far the
sampler's distribution was from the one PPO trains against.

Shapes: ``B`` prompts, ``P`` prompt tokens (left-padded), ``T`` response tokens (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence

import torch

__all__ = ["Rollout", "RolloutEngine"]


@dataclass
class Rollout:
    """One response per prompt, as an engine returns them.

    Attributes:
        query_ids: ``[B, P]`` int64, the prompts' tokens, left-padded.
        query_mask: ``[B, P]`` bool, 1 at real prompt tokens.
        response_ids: ``[B, T]`` int64, the sampled tokens up to the first EOS, then the pad id.
        response_mask: ``[B, T]`` bool, 1 up to and including the first EOS
            (:func:`pyppo.rollout.tokens.response_mask_from_eos`).
        has_eos: ``[B]`` bool, whether the response ended with EOS (else it hit the length limit).
        prompts: the ``B`` prompt strings.
        responses: the ``B`` decoded responses (special tokens skipped).
        rollout_logprobs: ``[B, T]`` float32, the sampler's log-probability of each sampled token
            (0 where masked), or ``None`` when the engine does not report them.
    """

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    has_eos: torch.Tensor
    prompts: List[str]
    responses: List[str]
    rollout_logprobs: Optional[torch.Tensor] = None


class RolloutEngine(Protocol):
    """Samples one response to each prompt from the current policy."""

    def generate(self, prompts: Sequence[str]) -> Rollout:
        """One :class:`Rollout` row per prompt, in the prompts' order."""
        ...
