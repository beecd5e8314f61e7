"""Eager turn-level GAE: a Python loop over the turns, a few ``[B]`` tensor ops per turn, as one
writes it on top of veRL's token-level loop (which has no per-turn estimator)."""

from __future__ import annotations

import torch


def turn_gae_loop(rewards, values, turn_ids, gamma: float = 1.0, lam: float = 0.95, last_values=None):
    """GAE over each row's agent turns (docs/ops.md#turn_gae) with torch ops and a loop over turns.

    The turns' first positions (an agent position whose id differs from the previous agent
    position's), each position's turn index by a cumulative sum, each turn's reward by a
    ``scatter_add`` and its value by a ``scatter`` from its first position; then the GAE recursion runs
    right to left over the turn index ``k = K-1 .. 0`` on ``[B]`` tensors (rows with fewer turns
    carry their state through), and the turns' advantages are gathered back onto the positions.
    Reads one value back (the most turns in a row: the loop's length).
    """
    B, T = turn_ids.shape
    acc = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r, v = rewards.to(acc), values.to(acc)
    agent = turn_ids >= 0
    pos = torch.arange(T, device=turn_ids.device).expand(B, T)
    last_at = torch.where(agent, pos, torch.full_like(pos, -1)).cummax(dim=1).values
    prev = torch.cat([torch.full_like(last_at[:, :1], -1), last_at[:, :-1]], dim=1)
    start = agent & ((prev < 0) | (turn_ids.gather(1, prev.clamp(min=0)) != turn_ids))
    k = start.long().cumsum(1) - 1  # each position's turn, -1 before the first
    n_turns = start.sum(1)
    K = int(n_turns.max()) if B else 0
    slot = torch.where(agent, k, torch.full_like(k, K))  # slot K collects what is not a turn's
    R = torch.zeros(B, K + 1, dtype=acc, device=r.device).scatter_add_(1, slot, torch.where(agent, r, 0))[:, :K]
    first = torch.where(start, k, torch.full_like(k, K))
    V = torch.zeros(B, K + 1, dtype=acc, device=r.device).scatter_(1, first, torch.where(start, v, 0))[:, :K]
    next_v = last_values.to(acc) if last_values is not None else r.new_zeros(B)
    next_a = r.new_zeros(B)
    A = r.new_zeros(B, K)
    for j in reversed(range(K)):
        has = j < n_turns
        a = R[:, j] + gamma * next_v - V[:, j] + gamma * lam * next_a
        next_a = torch.where(has, a, next_a)
        next_v = torch.where(has, V[:, j], next_v)
        A[:, j] = torch.where(has, a, 0)
    if K == 0:
        return r.new_zeros(B, T), r.new_zeros(B, T)
    at = k.clamp(0, K - 1)
    adv = torch.where(agent, A.gather(1, at), 0)
    ret = torch.where(agent, (A + V).gather(1, at), 0)
    return adv, ret
