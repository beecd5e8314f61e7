"""Peak memory a call needs beyond what exists before it, and a quiet stderr for the profiler.

Methods (``peak_extra_bytes``):

* ``rss`` (CPU, Linux): growth of the process's resident-set high-water mark. Freed heap is
  handed back to the OS (``malloc_trim(0)``), the mark is reset (``/proc/self/clear_refs`` <- 5),
  the call runs, and ``VmHWM - VmRSS(before)`` is read. Counts every page the call touches:
  tensors, a kernel's private scratch, allocations on worker threads; page granular, so
  allocations of a few KiB that fit in already-resident heap pages are missed, and ~1 MiB of
  noise is possible. Resetting the mark in-process is what lets one process measure variants
  one after another: a variant's freed memory cannot hide the next one's peak.
* ``alloc`` (CPU): the peak of the running sum of allocations minus frees through torch's CPU
  allocator during the call, from ``torch.profiler(profile_memory=True)``. Exact for tensors,
  blind to memory a kernel gets from ``malloc``/``new`` directly.
* ``both``: rss and alloc.
* on CUDA: ``torch.cuda.max_memory_allocated()`` growth after ``reset_peak_memory_stats()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from typing import Callable, Iterator

import torch

__all__ = ["quiet_stderr", "rss_available", "peak_extra_bytes"]


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for the duration: kineto prints profiler_start / profiler_stop
    lines there from C++, which ``sys.stderr`` redirection cannot catch."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:  # pragma: no cover - no fd 2 to silence
        saved = None
    try:
        yield
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)


def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_available() -> bool:
    try:
        _proc_status_kb("VmHWM")
        _reset_hwm()
        return True
    except (OSError, KeyError):
        return False


_LIBC = None


def _malloc_trim() -> None:
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def _peak_rss(fn: Callable, inp) -> int:
    _malloc_trim()
    base = _proc_status_kb("VmRSS")
    _reset_hwm()
    out = fn(inp)
    hwm = _proc_status_kb("VmHWM")
    del out
    return max(0, hwm - base) * 1024


def _peak_alloc(fn: Callable, inp) -> int:
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(inp)
        del out
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    )
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return int(peak)


def _peak_cuda(fn: Callable, inp) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(inp)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def peak_extra_bytes(fn: Callable, inp, device: torch.device, method: str) -> dict[str, int]:
    """Peak bytes ``fn(inp)`` needs beyond what is allocated before it, outputs included, as
    ``{method: bytes}`` for each method used (see the module doc; ``"off"``: ``{}``)."""
    if method == "off":
        return {}
    gc.collect()
    if device.type == "cuda":
        return {"cuda": _peak_cuda(fn, inp)}
    if method not in ("rss", "alloc", "both"):
        raise ValueError(f"unknown memory method {method!r}")
    out: dict[str, int] = {}
    if method in ("rss", "both"):
        out["rss"] = _peak_rss(fn, inp)
    if method in ("alloc", "both"):
        gc.collect()
        out["alloc"] = _peak_alloc(fn, inp)
    return out
