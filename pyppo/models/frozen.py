"""A frozen model's linear weights held in the precision autocast multiplies them in.

Under ``torch.autocast(dtype=torch.bfloat16)`` every ``nn.Linear`` casts its float32 weight (and
bias) to bfloat16 before the product, and nothing else of the model reads them. A frozen copy (the
reference) whose linear weights are stored as those same bfloat16 values therefore computes
exactly the same numbers, from half the bytes, without the cast on every forward; its norms,
embeddings and everything else autocast leaves in float32 stay float32. See docs/performance.md
("Memory").
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["hold_linear_weights"]


def _plain(t: torch.Tensor) -> bool:
    # Plain float32 tensors only: not FSDP's DTensors, not quantised or already-cast weights.
    return type(t.data) is torch.Tensor and t.dtype == torch.float32


def hold_linear_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the weight and bias of every frozen float32 ``nn.Linear`` of ``model`` in ``dtype``.

    The values are ``weight.to(dtype)``, the rounding autocast applies (round to nearest even), so
    a forward under ``torch.autocast(dtype=dtype)`` gives the same bits as before. A linear weight
    tied to another module (an LM head tied to the input embeddings) gets its own ``dtype`` copy
    and the other module keeps the float32 tensor: an embedding lookup is not autocast, and must
    keep reading float32.

    Use it only on a model that runs under that autocast and is never trained: outside autocast,
    a float32 input to these layers raises a dtype mismatch.

    Args:
        model: a frozen module (every parameter ``requires_grad=False``).
        dtype: ``torch.bfloat16`` or ``torch.float16``, the autocast dtype.

    Returns:
        the bytes no longer held (the float32 tensors freed, less the copies untied weights need).

    Raises:
        ValueError: ``dtype`` not bfloat16 or float16, or a parameter of ``model`` that requires grad.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"hold_linear_weights: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    if trained:
        raise ValueError(f"hold_linear_weights: the model must be frozen; {trained[0]} requires grad")
    before = _bytes(model)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, nn.Linear):
                continue
            for name in ("weight", "bias"):
                param = getattr(module, name)
                if isinstance(param, nn.Parameter) and _plain(param):
                    setattr(module, name, nn.Parameter(param.detach().to(dtype), requires_grad=False))
    return before - _bytes(model)


def _bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
