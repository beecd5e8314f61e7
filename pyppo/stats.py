"""Running statistics of a PPO update and wall time per phase of a step.

:class:`RunningStats` keeps weighted sums and divides once at the end, so a logged mean is the
mean over everything the update saw (tokens, or minibatches), whatever the micro-batch sizes.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterator, Mapping, Optional

import torch

__all__ = ["PHASES", "RunningStats", "PhaseTimer", "current_phase"]

#: The phases of a step, each a ``record_function("pyppo/<phase>")`` range and a ``time_<phase>`` metric.
PHASES = ("generate", "policy_forward", "ref_forward", "value_forward", "score", "advantages", "update")

_CURRENT_PHASE: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("pyppo_phase", default=None)


def current_phase() -> Optional[str]:
    """The phase a :class:`PhaseTimer` is timing now (``None`` outside every phase), so that a
    model hook can say which phase its call belongs to (``pyppo profile``'s FLOP count)."""
    return _CURRENT_PHASE.get()


class RunningStats:
    """Weighted means and maxima, accumulated in float64 and divided once by :meth:`means`."""

    def __init__(self) -> None:
        self._sums: Dict[str, float] = defaultdict(float)
        self._weights: Dict[str, float] = defaultdict(float)
        self._maxima: Dict[str, float] = {}

    def add(self, values: Mapping[str, float], weight: float = 1.0) -> None:
        """Add each ``value`` with ``weight`` (e.g. a micro-batch's mean with its token count)."""
        for key, value in values.items():
            self._sums[key] += float(value) * weight
            self._weights[key] += weight

    def add_max(self, key: str, value: float) -> None:
        self._maxima[key] = max(self._maxima.get(key, -math.inf), float(value))

    def merge(self, other: "RunningStats") -> None:
        for key in other._sums:
            self._sums[key] += other._sums[key]
            self._weights[key] += other._weights[key]
        for key, value in other._maxima.items():
            self.add_max(key, value)

    def total(self, key: str) -> float:
        """The weighted sum of ``key`` (``nan`` when nothing was added)."""
        return self._sums[key] if self._weights.get(key) else math.nan

    def means(self) -> Dict[str, float]:
        """Every key's weighted mean (``nan`` for a zero total weight), and every maximum."""
        out = {k: (s / self._weights[k] if self._weights[k] else math.nan) for k, s in self._sums.items()}
        out.update(self._maxima)
        return out


class PhaseTimer:
    """Seconds per phase, each phase also marked for ``torch.profiler``."""

    def __init__(self) -> None:
        self.seconds = {p: 0.0 for p in PHASES}
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        token = _CURRENT_PHASE.set(name)
        try:
            with torch.profiler.record_function(f"pyppo/{name}"):
                yield
        finally:
            _CURRENT_PHASE.reset(token)
        self.seconds[name] += time.perf_counter() - start

    def metrics(self) -> Dict[str, float]:
        """``time_<phase>`` for every phase and ``step_seconds`` since the timer was made."""
        out = {f"time_{p}": s for p, s in self.seconds.items()}
        out["step_seconds"] = time.perf_counter() - self._start
        return out
