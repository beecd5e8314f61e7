"""Point 3 of the PPO step: the reward's scores of a rollout, and the shaping of the scores
before the KL penalty (clipping, the missing-EOS penalty, DAPO's overlong penalty)."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from .. import distributed
from ..config import PPOConfig
from ..rewards import score_responses
from .buffer import RolloutBuffer
from .overlong import overlong_penalty

__all__ = ["score_batch"]


def score_batch(batch: RolloutBuffer, reward_fn: Callable, c: PPOConfig, world: distributed.World,
                device: torch.device, *, where: str,
                fields: Optional[Dict[str, list]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(raw_scores [B], scores [B])`` float32 on ``device``: the reward's scores (given
    the prompts' ``fields``, a column each, :func:`pyppo.rewards.score_responses`), then clipped to
    ``score_clip``, lowered by ``missing_eos_penalty`` where the response has no EOS and by DAPO's
    overlong penalty over the last ``overlong_buffer`` tokens (Yu et al. 2025, eq. 13).

    Under ``torchrun`` a reward that fails on one rank raises its error on every rank
    (:func:`~pyppo.distributed.on_every_rank`), so that rank 0 reports it and the ranks stop
    together.

    Raises:
        whatever the reward raises (``where`` names the step in pyppo's own errors).
    """
    raw = torch.tensor(distributed.on_every_rank(score_responses, world, reward_fn, batch.prompts, batch.responses,
                                                 where=where, fields=fields),
                       dtype=torch.float32, device=device)
    scores = raw if c.score_clip is None else raw.clamp(-c.score_clip, c.score_clip)
    if c.missing_eos_penalty is not None:
        scores = scores - c.missing_eos_penalty * (~batch.has_eos).float()
    if c.overlong_buffer:
        scores = scores - overlong_penalty(batch.response_mask.sum(dim=1), c.max_new_tokens, c.overlong_buffer,
                                           c.overlong_penalty)
    return raw, scores
