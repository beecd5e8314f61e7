"""What happens to responses that run long: DAPO's overlong reward shaping and its truncated-sample
masking (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", §3.4,
eq. 13; ``docs/trainer.md``, "DAPO's rollout rules")."""

from __future__ import annotations

import torch

__all__ = ["overlong_penalty", "mask_truncated"]


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
