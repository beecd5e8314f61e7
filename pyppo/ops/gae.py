"""Generalized Advantage Estimation over the valid positions of each row (docs/ops.md#gae), with
a separate λ for the value targets (VC-PPO) and a λ per row (VAPO's length-adaptive GAE)."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["gae", "length_adaptive_lam"]


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
    last_values: torch.Tensor | None = None,
    lam_critic: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Advantages and returns by GAE(γ, λ), one right-to-left scan per row.

    .. math::
        \delta_t = r_t + \gamma V_{t'} - V_t, \qquad A_t = \delta_t + \gamma\lambda A_{t'}, \qquad
        R_t = A^{\lambda_c}_t + V_t

    (Schulman et al. 2015, "High-Dimensional Continuous Control Using GAE", eq. 16), where
    ``t'`` is the next **valid** position of the row: a masked position in the middle of a row
    (a tool output, an observation) is skipped, neither adding a TD term nor breaking the chain.
    After the last valid position the episode ends (``V = 0``, ``A = 0``) unless
    ``last_values`` bootstraps a truncated row.

    The returns (value targets) are :math:`A^{\lambda_c} + V`, where :math:`A^{\lambda_c}` is the
    same recursion with ``lam_critic`` in place of λ, run beside the advantages' one in the same
    scan: decoupled λ (VC-PPO, Yuan et al. 2025, "What's Behind PPO's Collapse in Long-CoT?",
    which uses ``lam_critic = 1``). Without ``lam_critic`` the returns use the advantages' λ,
    ``R = A + V``. The advantages are the bits of a call with ``lam`` alone and the returns those
    of a call with ``lam = lam_critic``.

    A tensor ``lam`` gives each row its own λ for the advantages, e.g. VAPO's length-adaptive
    :math:`\lambda = 1 - 1/(\alpha l)` (Yue et al. 2025, "VAPO", from :func:`length_adaptive_lam`);
    row ``b`` then gets the bits of a call with ``lam=float(lam[b])``.

    Args:
        rewards: ``[B, T]`` float, per-token rewards (e.g. from :func:`shape_rewards`).
        values: ``[B, T]`` float, value estimates at the same positions.
        response_mask: ``[B, T]`` bool or 0/1, valid positions.
        gamma: discount γ in ``[0, 1]``.
        lam: GAE λ in ``[0, 1]``: a float, or a ``[B]`` float tensor (any float dtype, on the
            inputs' device) of per-row values in ``[0, 1]``.
        last_values: optional ``[B]`` float, value of the state after each row's last valid position.
        lam_critic: optional λ of the returns in ``[0, 1]``; ``None``: the advantages' λ (per row
            when ``lam`` is a tensor).

    Returns:
        ``(advantages [B, T], returns [B, T])``, float32 (float64 for float64 input), 0 at
        masked positions. Not differentiable (PPO treats them as constants).

    Raises:
        ValueError: shape or dtype mismatches, ``gamma``, ``lam`` (a value of a tensor ``lam``:
            the op's ``row_lam``) or ``lam_critic`` outside ``[0, 1]``, a tensor ``lam`` that is
            not ``[B]`` float.
        RuntimeError: inputs on different devices.
    """
    if isinstance(lam, torch.Tensor):
        row_lam, lam = lam, 1.0  # the op's lam is unused when row_lam is given
    else:
        row_lam = None
    return torch.ops.pyppo.gae.default(
        rewards,
        values,
        response_mask,
        float(gamma),
        float(lam),
        last_values,
        None if lam_critic is None else float(lam_critic),
        row_lam,
    )


def length_adaptive_lam(loss_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    r"""The λ of each row by VAPO's Length-Adaptive GAE (Yue et al. 2025, "VAPO"):

    .. math::
        \lambda_b = \operatorname{clamp}\left(1 - \frac{1}{\alpha\, l_b},\ 0,\ 1\right)

    with :math:`l_b` the number of valid positions of row ``b`` (a row with none gets 0). Longer
    responses get a λ closer to 1, so the advantage of an early token is not dominated by the
    value model's bias. Pass the result as ``gae(..., lam=...)``.

    Args:
        loss_mask: ``[B, T]`` bool or 0/1 (the positions the loss trains on).
        alpha: ``α > 0``.

    Returns:
        ``[B]`` float32 on ``loss_mask``'s device, in ``[0, 1]``.

    Raises:
        ValueError: ``alpha`` not a finite number ``> 0``; ``loss_mask`` not a 2-D tensor.
    """
    a = float(alpha) if isinstance(alpha, numbers.Real) and not isinstance(alpha, bool) else math.nan
    if not 0 < a < math.inf:
        raise ValueError(f"length_adaptive_lam: alpha must be a finite number > 0, got {alpha!r}")
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.dim() != 2:
        shape = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise ValueError(f"length_adaptive_lam: loss_mask must be a 2-D [B, T] tensor, got {shape}")
    lengths = (loss_mask != 0).sum(-1, dtype=torch.float64)
    # l = 0 gives 1 - 1/0 = -inf, clamped to 0.
    lam = 1.0 - 1.0 / (a * lengths)
    return lam.clamp(0.0, 1.0).to(torch.float32)
