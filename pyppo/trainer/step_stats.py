"""Running statistics of a PPO update, wall time per phase of a step, and the step's rollout and ratio statistics.

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

from .. import distributed
from ..ops import masked_mean
from ..ops.losses import LOG_RATIO_CLAMP

__all__ = [
    "PHASES",
    "RunningStats",
    "PhaseTimer",
    "current_phase",
    "ratio_stats",
    "record_token_stats",
    "rollout_metrics",
]

#: The phases of a step, each a ``record_function("pyppo/<phase>")`` range and a ``time_<phase>`` metric.
PHASES = ("weight_sync", "generate", "policy_forward", "ref_forward", "value_forward", "score", "advantages", "update")

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

    def means(self, world: Optional[distributed.World] = None) -> Dict[str, float]:
        """Every key's weighted mean (``nan`` for a zero total weight), and every maximum. With an
        active ``world``, over what every rank added (a collective: each rank's sums, weights and
        maxima are gathered), so that a token-weighted mean weighs each rank by its tokens."""
        if world is not None and world.active:
            total = RunningStats()
            for rank_stats in distributed.gather_objects(self, world):
                total.merge(rank_stats)
            return total.means()
        out = {k: (s / self._weights[k] if self._weights[k] else math.nan) for k, s in self._sums.items()}
        out.update(self._maxima)
        return out


class PhaseTimer:
    """Seconds per phase, each phase also marked for ``torch.profiler``; ``absent`` phases
    (``value_forward`` without a value model) are not reported."""

    def __init__(self, absent: tuple = ()) -> None:
        self.seconds = {p: 0.0 for p in PHASES if p not in absent}
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


def rollout_metrics(batch, world=None) -> Dict[str, float]:
    """What the rollout alone says: scores, shaped reward, the entropy over ``loss_mask``, the
    response lengths (``response_mask``), the fraction that ended with EOS. The per-response
    means are this rank's (every rank holds as many responses, so their mean over ranks is the
    global one); the entropy is the mean over every rank's tokens (``world``, a
    :class:`~pyppo.distributed.World`; ``None``: this process's only), since the ranks' token
    counts differ. Called by every rank together when ``world`` is active."""
    if world is None:
        entropy = float(masked_mean(batch.entropy, batch.loss_mask))
    else:
        mask = batch.loss_mask.bool()
        total, n = distributed.all_sum([float(batch.entropy.double()[mask].sum()), int(mask.sum())], world)
        entropy = total / n if n else float("nan")
    return {
        "score_mean": float(batch.raw_scores.mean()),
        "reward_mean": float(batch.rewards.sum(dim=1).mean()),
        "entropy_mean": entropy,
        "response_length_mean": float(batch.response_mask.sum(dim=1).float().mean()),
        "eos_fraction": float(batch.has_eos.float().mean()),
    }


def record_token_stats(stats: RunningStats, op_stats: Dict[str, torch.Tensor], n_tokens: int) -> None:
    """Add a micro-batch's loss statistics to ``stats``, weighted by its valid tokens (the
    maximum as a maximum; explained variance is computed once over the whole update)."""
    stats.add(
        {k: float(v) for k, v in op_stats.items() if k not in ("ratio_max", "explained_variance")}, weight=n_tokens
    )
    if "ratio_max" in op_stats:  # absent while the critic warms up: no policy loss
        stats.add_max("ratio_max", float(op_stats["ratio_max"]))


def ratio_stats(seen: list, world=None) -> Dict[str, float]:
    """Ratio statistics over the micro-batches ``seen`` so far (``micro_step`` results): in the
    first minibatch of a step, before any optimizer step, the ratio must be exactly 1.

    ``ratio_mean`` and ``approx_kl`` are means over every rank's tokens (``world``; ``None``: this
    process's only; every rank calls this together); the extremes are this rank's, which
    :func:`~pyppo.distributed.reduce_metrics` takes over the ranks by their names. A rank whose
    share of the minibatch holds no token reports neutral extremes (``ratio_min`` inf, the others 0)."""
    logratio = torch.cat([(s.logprobs - s.old_logprobs)[s.loss_mask] for s in seen]).double()
    max_abs = float(logratio.abs().max()) if logratio.numel() else 0.0
    logratio = logratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # as the loss does: exp stays finite
    ratio = torch.exp(logratio)
    sums = [int(ratio.numel()), float(ratio.sum()), float((ratio - 1 - logratio).sum())]
    n, ratio_sum, kl_sum = distributed.all_sum(sums, world) if world is not None else sums
    return {
        "max_abs_logratio": max_abs,
        "ratio_min": float(ratio.min()) if ratio.numel() else math.inf,
        "ratio_max": float(ratio.max()) if ratio.numel() else 0.0,
        "ratio_mean": ratio_sum / n if n else math.nan,
        "approx_kl": kl_sum / n if n else math.nan,
    }
