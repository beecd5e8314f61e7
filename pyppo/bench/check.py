"""The numerical check run before timing: a speed-up is only meaningful between two callables
that compute the same thing, so pyppo's outputs are compared with the eager reference's."""

from __future__ import annotations

import torch

__all__ = ["max_error"]


def _flat_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def max_error(a, b) -> float:
    """max |a - b| / max(1, max |b|) over corresponding output tensors (NaN counts as inf)."""
    worst = 0.0
    ta, tb = _flat_outputs(a), _flat_outputs(b)
    if len(ta) != len(tb):
        return float("inf")
    for x, y in zip(ta, tb):
        if x.shape != y.shape:
            return float("inf")
        x, y = x.detach().double().cpu(), y.detach().double().cpu()
        if x.numel() == 0:
            continue
        diff = (x - y).abs()
        if not bool(torch.isfinite(diff).all()):
            return float("inf")
        worst = max(worst, float(diff.max()) / max(1.0, float(y.abs().max())))
    return worst
