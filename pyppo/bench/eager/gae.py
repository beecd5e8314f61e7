"""Eager GAE: the reversed Python loop over T that TRL, veRL and OpenRLHF use."""

from __future__ import annotations

import torch


def gae_loop(rewards, values, response_mask, gamma: float = 1.0, lam: float = 0.95):
    """veRL's ``compute_gae_advantage_return`` (``verl/trainer/ppo/core_algos.py``).

    A loop over ``t = T-1 .. 0`` with a handful of ``[B]`` tensor ops per step; masked positions
    (observation / tool tokens, padding) neither add a TD term nor break the chain: ``nextvalues``
    and ``lastgaelam`` are carried across them through ``mask`` blends. This is the hole-aware
    formula pyppo's ``gae`` computes (docs/ops.md), so its advantages equal pyppo's at valid positions. Masked outputs
    are zeroed at the end (veRL leaves them for ``masked_whiten`` to ignore).
    """
    mask = response_mask.to(values.dtype)
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    gen_len = rewards.shape[-1]
    for t in reversed(range(gen_len)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        # skip values and TD-error on masked (observation) tokens
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages * mask, returns * mask


def gae_loop_trl(rewards, values, response_mask, gamma: float = 1.0, lam: float = 0.95):
    """TRL's PPO trainer GAE (``trl/trainer/ppo_trainer.py``), masks as TRL handles them.

    Rewards and values are zeroed at masked positions first (``masked_fill(..., padding_mask,
    0)``), then the plain loop runs over every position and the outputs are masked. With only
    right padding this equals :func:`gae_loop`; a hole in the middle of a row is *not* skipped
    (it contributes ``-V`` = 0 and decays the chain by γλ), so with holes it differs from pyppo.
    Kept for timing comparisons; the numerical check uses :func:`gae_loop`.
    """
    m = response_mask.bool()
    values = values.masked_fill(~m, 0)
    rewards = rewards.masked_fill(~m, 0)
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages.masked_fill(~m, 0), returns.masked_fill(~m, 0)
