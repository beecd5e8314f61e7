"""GAE over the agent turns of multi-turn episodes (docs/ops.md#turn_gae)."""

from __future__ import annotations

import torch

__all__ = ["turn_gae", "turn_start_mask"]


def turn_start_mask(turn_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: True at the first position of each turn of :func:`turn_gae` (an agent
    position whose id differs from the previous agent position's, or the row's first agent
    position), where its ``V_k`` is read and where a value loss on its returns trains.

    Raises:
        ValueError: ``turn_ids`` not a 2-D integer tensor.
    """
    if not isinstance(turn_ids, torch.Tensor) or turn_ids.dim() != 2:
        shape = tuple(turn_ids.shape) if isinstance(turn_ids, torch.Tensor) else type(turn_ids).__name__
        raise ValueError(f"turn_start_mask: turn_ids must be a 2-D [B, T] tensor, got {shape}")
    if turn_ids.is_floating_point() or turn_ids.is_complex() or turn_ids.dtype == torch.bool:
        raise ValueError(f"turn_start_mask: turn_ids must be an integer tensor (int64), got {turn_ids.dtype}")
    ids = turn_ids.long()
    agent = ids >= 0
    B, T = ids.shape
    if B == 0 or T == 0:
        return agent
    pos = torch.arange(T, device=ids.device).expand(B, T)
    # The last agent position before t (-1: none): a running max of the agent positions, shifted.
    last_at = torch.where(agent, pos, torch.full_like(pos, -1)).cummax(dim=1).values
    prev = torch.cat([torch.full_like(last_at[:, :1], -1), last_at[:, :-1]], dim=1)
    prev_id = ids.gather(1, prev.clamp(min=0))
    return agent & ((prev < 0) | (prev_id != ids))


def turn_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    turn_ids: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    last_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Advantages and returns by GAE(γ, λ) over each row's agent turns, one action per turn.

    ``turn_ids[b, t] >= 0`` marks an agent position (its value is the turn's index), a negative
    value an environment or padding position. A turn is a maximal run of agent positions with
    one id, the positions between them that are not agent positions skipped: a turn starts at
    each agent position whose id differs from the previous agent position's id (or that has no
    previous agent position). So ``[0, 0, -1, 0, 1]`` holds two turns, ``{0, 1, 3}`` and ``{4}``,
    and ``[0, 1, 0]`` three; the ids' values matter only through that comparison. For turn
    ``k`` with first position ``s_k``, ``V_k = values[b, s_k]`` (the state before the turn) and
    ``R_k`` the sum of ``rewards`` over its agent positions:

    .. math::
        \delta_k = R_k + \gamma V_{k+1} - V_k, \qquad A_k = \delta_k + \gamma\lambda A_{k+1}

    (Schulman et al. 2015, eq. 16, with a turn as the time step), where ``V`` after the last
    turn is ``last_values[b]`` (0 without it) and ``A`` there is 0. Each agent position of turn
    ``k`` gets ``A_k`` and the return ``A_k + V_k``; every other position 0, and a row without
    an agent position is all zeros. Rewards at non-agent positions and values other than at a
    turn's first position are never read (NaN there cannot leak). The value loss trains at the
    turns' first positions: :func:`turn_start_mask`.

    A row whose response is one turn gets the bandit estimate ``A = R − V`` (``V`` at the
    response's first token); a row of one-token turns gets what :func:`gae` gives on its agent
    positions.

    Args:
        rewards: ``[B, T]`` float, per-token rewards (a turn's reward is their sum).
        values: ``[B, T]`` float, value estimates (read at each turn's first position).
        turn_ids: ``[B, T]`` integer (int64), the agent turn of each position, ``-1`` elsewhere.
        gamma: discount γ in ``[0, 1]``, per turn.
        lam: GAE λ in ``[0, 1]``, per turn.
        last_values: optional ``[B]`` float, the value of the state after each row's last turn.

    Returns:
        ``(advantages [B, T], returns [B, T])``, float32 (float64 for float64 input), 0 at
        non-agent positions. Not differentiable (PPO treats them as constants).

    Raises:
        ValueError: ``turn_ids`` not an integer tensor, shape or dtype mismatches, ``gamma`` or
            ``lam`` outside ``[0, 1]``.
        RuntimeError: inputs on different devices.
    """
    return torch.ops.pyppo.turn_gae.default(rewards, values, turn_ids, float(gamma), float(lam), last_values)
