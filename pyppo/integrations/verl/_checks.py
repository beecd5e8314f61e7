"""Checks and dtype bookkeeping shared by the veRL adapters (:mod:`.core_algos`, :mod:`.torch_functional`).

The dtype veRL's eager expression would produce is worked out from torch's type promotion rules
rather than by running it; the argument checks raise with the adapter's name and the argument's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# ----------------------------------------------------------------------------------------------
# dtype bookkeeping


def _promote(*dtypes: torch.dtype) -> torch.dtype:
    return functools.reduce(torch.promote_types, dtypes)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype pyppo computes in for a result of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mean_dtype(values_dtype: torch.dtype, mask_dtype: torch.dtype) -> torch.dtype:
    # veRL: (where(mask.bool(), values, 0.0) * mask).sum() / (mask.sum() + 1e-8). The numerator
    # promotes values with the mask; an integer/bool mask's count plus 1e-8 is the default float
    # dtype, and the division promotes both (they have the same number of dimensions).
    v = values_dtype if values_dtype.is_floating_point else torch.get_default_dtype()
    den = mask_dtype if mask_dtype.is_floating_point else torch.get_default_dtype()
    return _promote(v, mask_dtype, den)


# ----------------------------------------------------------------------------------------------
# argument checks


def _tensor(fn: str, name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _float_tensor(fn: str, name: str, x: Any) -> torch.Tensor:
    _tensor(fn, name, x)
    if not x.is_floating_point():
        raise ValueError(f"{fn}: {name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def _real_tensor(fn: str, name: str, x: Any) -> torch.Tensor:
    """A float, integer or bool tensor: where veRL promotes integer rewards with float values or
    statistics and computes, so do the adapters."""
    _tensor(fn, name, x)
    if x.is_complex():
        raise ValueError(f"{fn}: {name} must be a real (float, integer or bool) tensor, got dtype {x.dtype}")
    return x


def _bool_mask(fn: str, name: str, mask: Any, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool tensor of ``like``'s shape. A non-bool mask is checked to hold only 0
    and 1 (one host sync; an integer mask in one ``aminmax`` pass) and converted once, so the
    pyppo ops below get a bool mask and skip their own check."""
    _tensor(fn, name, mask)
    if mask.shape != like.shape:
        raise ValueError(f"{fn}: {name} has shape {tuple(mask.shape)} but the values have shape {tuple(like.shape)}")
    if mask.device != like.device:
        raise ValueError(f"{fn}: {name} is on {mask.device} but the values are on {like.device}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{fn}: {name} must be bool or hold only 0 and 1, got dtype {mask.dtype}")
    if mask.numel():
        if mask.is_floating_point():
            ok = ((mask == 0) | (mask == 1)).all()
        else:
            # An integer is 0 or 1 iff it lies in [0, 1]: one pass instead of three.
            lo, hi = torch.aminmax(mask)
            ok = (lo >= 0) & (hi <= 1)
        if not bool(ok):
            raise ValueError(f"{fn}: {name} must be bool or hold only 0 and 1, got other values")
    return mask.bool()
