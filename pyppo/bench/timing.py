"""Seconds per call of several variants of one computation, measured in interleaved rounds.

Every variant runs once per round, the order rotated each round, so that load drifting on the
machine hits all variants alike; ratios are then taken round by round (:func:`paired_ratio`).
Calls rotate among several input sets when one set would fit in the cache, so that no variant
is timed on cache-resident inputs that a real training step would have to fetch.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["Clock", "HostClock", "CudaEventClock", "clock_for", "measure", "paired_ratio"]


class Clock:
    """Times ``iters`` consecutive calls; returns seconds per call."""

    #: The shortest sample worth timing: below it, the clock's own overhead dominates.
    min_sample_s = 0.0

    def time(self, fn: Callable, sets: Sequence[Any], start: int, iters: int) -> float:
        raise NotImplementedError


class HostClock(Clock):
    """``perf_counter`` around each call, one call per sample (CPU work is synchronous)."""

    def time(self, fn, sets, start, iters):
        t0 = time.perf_counter()
        for i in range(iters):
            out = fn(sets[(start + i) % len(sets)])
        dt = time.perf_counter() - t0
        del out
        return dt / iters


class CudaEventClock(Clock):
    """CUDA events around a batch of calls: kernels run asynchronously, and host timestamps of
    microsecond kernels would measure the launch, not the kernel."""

    min_sample_s = 1e-3

    def time(self, fn, sets, start, iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for i in range(iters):
            out = fn(sets[(start + i) % len(sets)])
        end.record()
        end.synchronize()
        del out
        return begin.elapsed_time(end) / 1e3 / iters


def clock_for(device: torch.device) -> Clock:
    return CudaEventClock() if device.type == "cuda" else HostClock()


def measure(
    variants: dict[str, Callable],
    sets: Sequence[Any],
    clock: Clock,
    *,
    warmup: int,
    min_reps: int,
    max_reps: int,
    budget_s: float,
) -> dict[str, list[float]]:
    """Seconds per call of each variant: ``warmup`` untimed samples each (they also size the
    samples and the number of rounds), then rounds in which every variant is timed once,
    order rotated each round, as many rounds as fit ``budget_s`` (within ``[min_reps, max_reps]``)."""
    names = list(variants)
    est: dict[str, float] = {}
    for name in names:
        for _ in range(max(1, warmup)):
            est[name] = clock.time(variants[name], sets, 0, 1)
    iters = {n: max(1, math.ceil(clock.min_sample_s / max(est[n], 1e-9))) for n in names}
    per_round = max(sum(est[n] * iters[n] for n in names), 1e-9)
    reps = int(min(max_reps, max(min_reps, budget_s / per_round)))
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(clock.time(variants[name], sets, r * iters[name], iters[name]))
    return times


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of ``num / den`` timed in the same round."""
    return statistics.median(a / b for a, b in zip(num, den) if b > 0)
