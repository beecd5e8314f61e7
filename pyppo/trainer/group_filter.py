"""Sampling a step's batch: prompts, responses and scores, with DAPO's dynamic sampling
(``filter_groups``; Yu et al. 2025, "DAPO", §3.2): groups whose responses all scored the same
carry no signal for a group baseline (every advantage is 0), so they are dropped and more prompts
are sampled until the batch is full, up to ``filter_groups_max_tries`` rollouts a step
(``docs/trainer.md``, "DAPO's rollout rules")."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .. import distributed
from ..prompts import prompt_columns
from .buffer import RolloutBuffer

__all__ = ["sample_scored_batch", "varied_groups"]


def varied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B / group_size]`` bool: whether group ``g`` (rows ``g·n .. g·n + n − 1``) has two
    different scores. ``scores`` is ``[B]``; NaN scores never reach here (the reward's check)."""
    g = scores.reshape(-1, group_size)
    return (g != g[:, :1]).any(dim=1)


def sample_scored_batch(trainer, timer) -> Tuple[RolloutBuffer, Dict[str, float]]:
    """This rank's batch of the step, scored, and the sampling metrics.

    Without ``filter_groups``: one draw of ``batch_size / samples_per_prompt`` prompts (this rank's
    share), sampled and scored. With it: draws repeat until this rank holds ``batch_size /
    world_size`` responses in groups with varied scores, or ``filter_groups_max_tries`` draws were
    made; then the batch is the varied groups in the order sampled, filled up, if short, with
    groups whose scores were all equal. Every rank draws as long as any rank is short (sampling
    may be a collective: FSDP gathers the weights). Groups are never split, across draws or ranks.

    Metrics (with ``filter_groups``): ``filter_groups_tries`` (draws this step),
    ``filter_groups_dropped`` (all-equal groups sampled and dropped, over every draw),
    ``filter_groups_filled`` (all-equal groups kept to fill the batch: > 0 means the tries ran
    out).
    """
    c, world = trainer.config, trainer.world
    n, need = c.samples_per_prompt, c.batch_size // world.size
    kept: List[RolloutBuffer] = []
    equal: List[RolloutBuffer] = []
    n_kept = tries = 0
    while True:
        tries += 1
        prompts, fields = prompt_columns(trainer.sampler.sample_groups(c.batch_size, n, world.rank, world.size))
        with timer.phase("generate"):
            batch = trainer.rollout(prompts)
        with timer.phase("score"):
            batch.raw_scores, batch.scores = trainer.score(batch, fields)
        if not c.filter_groups:
            return batch, {}
        rows = varied_groups(batch.scores, n).repeat_interleave(n).cpu()
        kept.append(batch.select(torch.nonzero(rows).flatten()))
        equal.append(batch.select(torch.nonzero(~rows).flatten()))
        n_kept += int(rows.sum())
        short = distributed.all_sum([int(n_kept < need)], world)[0]
        if not short or tries == c.filter_groups_max_tries:
            break
    dropped = sum(len(b) for b in equal) // n
    filled = max(0, need - n_kept) // n
    batch = RolloutBuffer.cat([b for b in kept + equal if len(b)])
    batch = batch.select(torch.arange(need))
    return batch, {"filter_groups_tries": float(tries), "filter_groups_dropped": float(dropped - filled),
                   "filter_groups_filled": float(filled)}
