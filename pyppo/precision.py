"""The mixed-precision context every forward of a run shares: the rollout's sampling, its
log-prob forwards and the training passes all run under the same autocast, so that they compute
the same numbers (the first PPO ratio is exactly 1 in bfloat16 too)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["autocast", "autocast_dtype"]


def autocast(device: torch.device, dtype: torch.dtype):
    """The precision context of every model forward: ``torch.autocast`` to ``dtype`` (bfloat16),
    or nothing for float32. Parameters stay float32 either way (the master weights)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast is running in on ``device`` now, or ``None`` outside autocast."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None
