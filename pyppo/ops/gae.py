"""Generalized Advantage Estimation over the valid positions of each row (docs/ops.md#gae)."""

from __future__ import annotations

import torch

__all__ = ["gae"]


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    last_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Advantages and returns by GAE(γ, λ), one right-to-left scan per row.

    .. math::
        \delta_t = r_t + \gamma V_{t'} - V_t, \qquad A_t = \delta_t + \gamma\lambda A_{t'}, \qquad R_t = A_t + V_t

    (Schulman et al. 2015, "High-Dimensional Continuous Control Using GAE", eq. 16), where
    ``t'`` is the next **valid** position of the row: a masked position in the middle of a row
    (a tool output, an observation) is skipped, neither adding a TD term nor breaking the chain.
    After the last valid position the episode ends (``V = 0``, ``A = 0``) unless
    ``last_values`` bootstraps a truncated row.

    Args:
        rewards: ``[B, T]`` float, per-token rewards (e.g. from :func:`shape_rewards`).
        values: ``[B, T]`` float, value estimates at the same positions.
        response_mask: ``[B, T]`` bool or 0/1, valid positions.
        gamma: discount γ in ``[0, 1]``.
        lam: GAE λ in ``[0, 1]``.
        last_values: optional ``[B]`` float, value of the state after each row's last valid position.

    Returns:
        ``(advantages [B, T], returns [B, T])``, float32 (float64 for float64 input), 0 at
        masked positions. Not differentiable (PPO treats them as constants).

    Raises:
        ValueError: shape or dtype mismatches, ``gamma``/``lam`` outside ``[0, 1]``.
        RuntimeError: inputs on different devices.
    """
    return torch.ops.pyppo.gae.default(rewards, values, response_mask, float(gamma), float(lam), last_values)
