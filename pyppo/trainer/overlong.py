"""What happens to responses that run long: DAPO's overlong reward shaping and its truncated-sample
masking (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", §3.4,
eq. 13; ``docs/trainer.md``, "DAPO's rollout rules")."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

__all__ = ["AllTruncatedWarning", "overlong_penalty", "mask_truncated"]


def overlong_penalty(lengths: torch.Tensor, max_new_tokens, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), to subtract from the scores.

    With ``L = max_new_tokens``, ``C = buffer`` and a response of ``l`` tokens (EOS included)::

        penalty(l) = 0                            l ≤ L − C
                     factor · (l − (L − C)) / C   L − C < l ≤ L

    so it rises linearly from 0 to ``factor`` over the last ``C`` tokens a response may take
    (veRL's DAPO reward manager: ``overlong_buffer.len``, ``penalty_factor``).

    Args:
        lengths: ``[B]`` int, response lengths in tokens.
        max_new_tokens: ``L``, the sampler's cap: an int, or ``[B]`` int per response (a multi-turn
            episode's room after its prompt, ``max_episode_tokens`` minus the prompt's tokens).
        buffer: ``C`` in ``[1, L]``. factor: ``>= 0``.

    Returns:
        ``[B]`` float32 on ``lengths``' device, ``>= 0``.

    Raises:
        ValueError: ``buffer`` outside ``[1, max_new_tokens]``.
    """
    least = int(max_new_tokens.min()) if isinstance(max_new_tokens, torch.Tensor) else max_new_tokens
    if not 1 <= buffer <= least:
        raise ValueError(f"overlong_buffer must be in [1, max_new_tokens = {least}], got {buffer}")
    if isinstance(max_new_tokens, torch.Tensor):
        max_new_tokens = max_new_tokens.to(lengths.device).float()
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(0, buffer)
    return factor * over / buffer


@torch.no_grad()
def mask_truncated(loss_mask: torch.Tensor, advantages: torch.Tensor, has_eos: torch.Tensor) -> int:
    """Take the responses without EOS (cut at ``max_new_tokens``) out of the loss, in place: their
    ``loss_mask`` rows become all false and their advantages 0 (DAPO's overlong filtering, §3.4).
    Their scores have already served their group's baseline. Their ``response_mask`` is left as
    it was: the tokens were sampled, and the forwards still attend to them.

    Args:
        loss_mask: ``[B, T]`` bool. advantages: ``[B, T]`` float. has_eos: ``[B]`` bool.

    Returns:
        how many rows were masked.
    """
    truncated = ~has_eos
    loss_mask[truncated] = False
    advantages[truncated] = 0.0
    return int(truncated.sum())


class AllTruncatedWarning:
    """The ``UserWarning`` for a step whose every response ``mask_truncated`` took out of the loss
    (none ended with EOS), which therefore trained nothing: said at the first such step, and again
    only when it recurs after a step that trained. The run loop's doctor turns ``say`` off while
    it runs and says it itself (``docs/trainer.md``, "Why isn't it learning").

    Args:
        max_new_tokens: the sampler's cap, named in the warning.
        episodes: multi-turn episodes, which ``max_episode_tokens`` and ``max_turns`` also cut.
        say: whether this process warns (rank 0 under ``torchrun``: the counts are global).
    """

    def __init__(self, max_new_tokens: int, *, episodes: bool = False, say: bool = True):
        self.max_new_tokens, self.episodes, self.say = max_new_tokens, episodes, say
        self.armed = True

    def __call__(self, masked: Optional[int], total: int, where: str) -> None:
        """``masked``: the step's ``truncated_masked`` over every rank (``None`` without
        ``mask_truncated``); ``total``: the step's responses; ``where`` names the step."""
        if masked is None or not self.say:
            return
        if masked < total:
            self.armed = True
            return
        if not self.armed:
            return
        self.armed = False
        warnings.warn(
            f"{where}: {self.describe(total)} (said again only after a step that trains)", UserWarning, stacklevel=3
        )

    @property
    def limits(self) -> str:
        """The knobs that cut a response, which a run whose every response is cut should raise."""
        return "max_episode_tokens, max_turns or max_new_tokens" if self.episodes else "max_new_tokens"

    def describe(self, total: int) -> str:
        """What a step of ``total`` responses, every one masked, did (the warning's text, which the
        run's doctor says in its place: :class:`pyppo.run.doctor.TruncationWarning`)."""
        return (
            f"all {total} responses were cut without EOS (max_new_tokens = {self.max_new_tokens}) and "
            f"mask_truncated took them out of the loss: the step trained nothing; raise {self.limits}, or turn "
            "mask_truncated off"
        )
