"""The mixed-precision context every forward of a run shares: the rollout's sampling, its
log-prob forwards and the training passes all run under the same autocast, so that they compute
the same numbers (the first PPO ratio is exactly 1 in bfloat16 too).

``dtype = "auto"`` (:func:`resolve_dtype`) picks bfloat16 where the hardware multiplies it
natively, a CUDA GPU with bf16 support or a CPU with AVX512_BF16 or AMX, and float32 elsewhere:
on a CPU with AVX2 only, oneDNN emulates bf16 and the step is slower than in float32
(docs/performance.md has the measurements).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

__all__ = ["autocast", "autocast_dtype", "native_bf16", "resolve_dtype"]


def autocast(device: torch.device, dtype: torch.dtype):
    """The precision context of every model forward: ``torch.autocast`` to ``dtype`` (bfloat16),
    or nothing for float32. Parameters stay float32 either way (the master weights)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast is running in on ``device`` now, or ``None`` outside autocast."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _cpu_flag(name: str) -> bool:
    # torch.cpu's ISA probes (cpuinfo, as oneDNN's dispatch sees the CPU) are underscored: a torch
    # without one reads as "no", which only costs the bf16 speed-up.
    probe = getattr(torch.cpu, name, None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


#: oneDNN's CPU ISA caps (``ONEDNN_MAX_CPU_ISA``) below AVX512_CORE_BF16: under one of them
#: oneDNN emulates bf16 whatever the CPU has.
_ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def _onednn_cap() -> Optional[str]:
    """The ISA oneDNN is capped at (``ONEDNN_MAX_CPU_ISA``, or its older name ``DNNL_MAX_CPU_ISA``)
    when that cap leaves out the bf16 instructions, else ``None``."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        cap = os.environ.get(var, "").strip().upper()
        if cap:
            return f"{var}={cap}" if cap in _ONEDNN_ISAS_WITHOUT_BF16 else None
    return None


def native_bf16(device: torch.device) -> Tuple[bool, str]:
    """Whether ``device`` multiplies bfloat16 natively, and what says so (for the run's log).

    CUDA: ``torch.cuda.is_bf16_supported()`` (compute capability 8.0 or later). CPU: the
    AVX512_BF16 or AMX-BF16 instructions oneDNN's bf16 GEMMs use; AVX2 and plain AVX-512 CPUs
    convert to float32 for every multiply and so run bf16 slower than float32. A CPU that has
    them counts as without when ``ONEDNN_MAX_CPU_ISA`` caps oneDNN below them (``AVX2``, say:
    how an AVX2-only machine is emulated on a newer one).
    """
    if device.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "CUDA"
        return ok, f"{name} {'supports' if ok else 'lacks'} bf16"
    if device.type == "cpu":
        cap = _onednn_cap()
        if cap is not None:
            return False, f"{cap} keeps oneDNN from this CPU's bf16 instructions"
        isas = [
            n
            for n, flag in (("AMX", "_is_amx_tile_supported"), ("AVX512_BF16", "_is_avx512_bf16_supported"))
            if _cpu_flag(flag)
        ]
        if isas:
            return True, f"this CPU has {' and '.join(isas)}"
        return False, f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16 matmul"
    return False, f"{device.type} is not known to pyppo to compute bf16 natively"


def resolve_dtype(dtype: str, device: torch.device) -> Tuple[str, str]:
    """The compute dtype a config's ``dtype`` means on ``device``, and why.

    Args:
        dtype: ``"auto"``, ``"float32"`` or ``"bfloat16"`` (``PPOConfig.dtype``).
        device: where the models run.

    Returns:
        ``(name, reason)``: ``name`` is ``"float32"`` or ``"bfloat16"``; ``reason`` says how
        ``auto`` chose it (empty for an explicit dtype).

    Raises:
        ValueError: ``dtype`` is none of the three.
    """
    if dtype in ("float32", "bfloat16"):
        return dtype, ""
    if dtype != "auto":
        raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
    ok, why = native_bf16(device)
    return ("bfloat16" if ok else "float32"), why
