"""Eager masked whitening: TRL's ``masked_mean`` / ``masked_var`` / ``masked_whiten``."""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """TRL ``trl/trainer/utils.py``."""
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """TRL ``trl/trainer/utils.py`` (note the host sync in the ``mask_sum == 0`` check)."""
    mean = masked_mean(values, mask)
    centered_values = values - mean
    variance = masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("The sum of the mask is zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """TRL ``trl/trainer/utils.py``: masked positions are left un-zeroed."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def masked_whiten_fill(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """What TRL's PPO trainer does with advantages: ``masked_whiten`` then
    ``masked_fill(~mask, 0)`` (pyppo's ``masked_whiten`` returns 0 at masked positions)."""
    m = mask.bool()
    return torch.masked_fill(masked_whiten(values, m, shift_mean), ~m, 0)
