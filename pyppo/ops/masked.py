"""Statistics over the masked-in elements of a tensor (docs/ops.md#masked_whiten covers all three)."""

from __future__ import annotations

import torch

from ._non_differentiable import first_derivative_only

__all__ = ["masked_mean", "masked_var", "masked_whiten"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is true.

    Args:
        x: ``[*]`` float tensor.
        mask: bool or 0/1 tensor of ``x``'s shape.
        dim: reduce over this dimension only (the result drops it); ``None`` reduces everything.

    Returns:
        0-d tensor (``dim=None``) or ``x``'s shape without ``dim``; float32 (float64 for float64
        input). Summed in float64 blocks in a fixed order: deterministic for any thread count.
        Differentiable w.r.t. ``x``.

    Raises:
        ValueError: the mask selects nothing (over the whole tensor, or in some slice along
            ``dim``): the mean of nothing is an error here, not a NaN. Shape/dtype mismatches.
    """
    return torch.ops.pyppo.masked_mean.default(x, mask, dim)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the positions where ``mask`` is true (two-pass, float64 sums).

    Args:
        x: ``[*]`` float tensor; mask: bool or 0/1 of the same shape.
        unbiased: divide by ``n − 1`` (Bessel) instead of ``n``.

    Returns:
        0-d float32 tensor (float64 for float64 input).

    Raises:
        ValueError: the mask selects nothing, or fewer than 2 elements with ``unbiased=True``.
    """
    return torch.ops.pyppo.masked_var.default(x, mask, bool(unbiased))


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    r"""Normalise ``x`` to zero mean and unit variance over its masked-in elements.

    .. math:: \hat x = (x - \mu) / \sqrt{\sigma^2 + \epsilon} \;(+\,\mu \text{ if not shift\_mean})

    with μ, σ² over every masked-in element of the whole tensor (advantage normalisation:
    "The 37 Implementation Details of PPO" #7; Huang et al. 2024, "N+ implementation details of
    RLHF with PPO"). Masked positions are 0.

    Args:
        x: ``[*]`` float tensor; mask: bool or 0/1 of the same shape.
        shift_mean: if false the mean is added back (scale only).
        unbiased: Bessel-corrected variance.
        eps: added to the variance, ``≥ 0``.

    Returns:
        Tensor of ``x``'s shape, float32 (float64 for float64 input). Not differentiable.

    Raises:
        ValueError: fewer than 1 (2 with ``unbiased``) masked-in elements; ``var + eps == 0``.
    """
    return torch.ops.pyppo.masked_whiten.default(x, mask, bool(shift_mean), bool(unbiased), float(eps))


def _mean_setup_context(ctx, inputs, output):
    x, mask, dim = inputs
    # x is saved only to tie the gradient to it, so that a second derivative raises (the mean is
    # linear: its gradient does not depend on x).
    ctx.save_for_backward(mask, x)
    ctx.dim = dim
    ctx.x_dtype = x.dtype


def _mean_backward(ctx, grad):
    mask, x = ctx.saved_tensors
    m = (mask != 0).to(grad.dtype)
    if ctx.dim is None:
        g = grad * m / m.sum()
    else:
        g = grad.unsqueeze(ctx.dim) * m / m.sum(ctx.dim, keepdim=True)
    return first_derivative_only("pyppo::masked_mean", g.to(ctx.x_dtype), x), None, None


torch.library.register_autograd("pyppo::masked_mean", _mean_backward, setup_context=_mean_setup_context)
