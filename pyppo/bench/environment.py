"""What a benchmark ran on: versions, CPU, threads, kernel ISA, devices, cache sizes."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

__all__ = ["environment", "default_devices", "cuda_usable", "cache_bytes", "load_average"]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cuda_usable() -> bool:
    """A CUDA device is present and pyppo was built with its CUDA kernels."""
    from pyppo import _C

    return torch.cuda.is_available() and bool(getattr(_C, "with_cuda", False))


def default_devices() -> list[torch.device]:
    return [torch.device("cpu")] + ([torch.device("cuda")] if cuda_usable() else [])


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def cache_bytes(device: torch.device) -> int:
    """The largest cache in front of the device's memory (CUDA: L2; CPU: the last level)."""
    if device.type == "cuda":
        # 50 MiB, an H100's L2, where this torch's properties do not say.
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20))
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            sizes.append(_parse_size(f.read_text()))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 * 2**20)  # a common last-level size, when sysfs says nothing


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:  # pragma: no cover - no getloadavg on this platform
        return None


def environment(devices: list[torch.device]) -> dict:
    import pyppo
    from pyppo import _C

    env = {
        "pyppo": getattr(pyppo, "__version__", "unknown"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "pyppo_threads": int(_C.num_threads()),
        "cpu_capability": _C.cpu_capability(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "pyppo_cuda": bool(_C.with_cuda),
        "devices": [str(d) for d in devices],
        "cache_bytes": {str(d): cache_bytes(d) for d in devices},
        "load_average": load_average(),
    }
    if any(d.type == "cuda" for d in devices):
        props = torch.cuda.get_device_properties(0)
        env.update(
            cuda_device=props.name,
            cuda_sm=f"{props.major}{props.minor}",
            cuda_memory_bytes=int(props.total_memory),
            cuda_version=torch.version.cuda,
            pyppo_cuda_archs=_C.cuda_archs,
        )
    return env
