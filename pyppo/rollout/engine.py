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
from typing import Any, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

__all__ = ["Continuation", "Rollout", "RolloutEngine"]

#: One sampled continuation: the token ids (up to and including the first EOS, or ``max_new_tokens``
#: of them) and the sampler's log-prob of each (``None`` when the engine does not report them).
Continuation = Tuple[List[int], Optional[List[float]]]


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
        loss_mask: ``[B, T]`` bool, 1 at the policy's own tokens (within ``response_mask``: an
            environment's reply between turns is in the sequence but is no action); ``None`` =
            every response token is the policy's (one sampled response).
        turn_ids: ``[B, T]`` int64, the agent turn each response token was sampled in (0, 1, ...),
            -1 at an environment's tokens and at padding; ``None`` for one sampled response.
        turn_rewards: ``[B, T]`` float32, the rewards an environment paid, each on the last token of
            the agent turn it answered (0 elsewhere); ``None`` without an environment.
        episodes: per row, what a multi-turn episode recorded (its transcript with turn
            boundaries, turns, tool calls: :class:`pyppo.agents.episodes.EpisodeRecord`);
            ``None`` for one sampled response.
    """

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    has_eos: torch.Tensor
    prompts: List[str]
    responses: List[str]
    rollout_logprobs: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    turn_ids: Optional[torch.Tensor] = None
    turn_rewards: Optional[torch.Tensor] = None
    episodes: Optional[List[Any]] = None


class RolloutEngine(Protocol):
    """Samples one response to each prompt from the current policy.

    :meth:`generate` is what every engine defines. :meth:`sync_weights` and :meth:`close` are for
    an engine that holds a copy of the policy's weights of its own (vLLM); an engine that samples
    with the policy itself subclasses this protocol and keeps their defaults, which do nothing.
    """

    def generate(self, prompts: Sequence[str]) -> Rollout:
        """One :class:`Rollout` row per prompt, in the prompts' order."""
        ...

    def sample_continuations(self, sequences: Sequence[Sequence[int]], max_new_tokens: int) -> List[Continuation]:
        """Continue each token-id sequence (a whole context: prompt, earlier turns, replies) with
        up to ``max_new_tokens`` sampled tokens, stopping after EOS; the multi-turn episodes of
        :mod:`pyppo.agents` sample their turns through it, so that no sampled id is ever decoded
        and re-encoded. One :data:`Continuation` per sequence, in order.

        Raises:
            NotImplementedError: the engine samples from text prompts only (the default).
        """
        raise NotImplementedError(
            f"rollout engine {type(self).__name__} cannot continue token-id sequences "
            "(sample_continuations), which multi-turn episodes need"
        )

    def sync_weights(self, model: nn.Module, *, trainable_only: bool = True) -> None:
        """Give the engine ``model``'s current weights (:class:`~pyppo.rollout.EngineSync` calls it
        after the policy changed): only those that require grad with ``trainable_only``, else
        every weight (after a checkpoint was loaded). Default: nothing to copy."""

    def close(self) -> None:
        """Release what the engine holds (memory, process groups); idempotent. Default: nothing."""
