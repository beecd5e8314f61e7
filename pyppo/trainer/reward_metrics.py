"""Each reward's share of a step's scores, as metrics: with several rewards
(:class:`pyppo.reward_sum.RewardSum`), ``reward/<name>_mean`` and ``reward/<name>_std`` over the
responses the reward applies to (not ``None``), and ``reward/unscored_fraction``, the responses no
reward applied to (scored 0.0); with veRL ``compute_score`` dicts, ``reward/<name>/<key>_mean``
of each other number they hold. ``score_mean`` stays the mean of the weighted sums.

The columns follow the step's batch through DAPO's group filter (:meth:`RewardColumns.select`),
so the metrics describe the responses trained on, as ``score_mean`` does; under ``torchrun`` they
are computed over every rank's responses (sums and counts summed), not averaged per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from .. import distributed
from ..reward_sum import RewardScores

__all__ = ["RewardColumns", "reward_metrics"]


def _column(values: Sequence) -> torch.Tensor:
    """``[B]`` float64, NaN where ``values`` holds ``None``."""
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)


@dataclass
class RewardColumns:
    """A batch's per-reward scores, rows aligned with the batch's: ``parts`` (several rewards:
    each one's ``[B]`` float64 scores by name, NaN where it does not apply), ``extras`` (``[B]``
    float64 by ``"<name>/<key>"``, NaN where absent) and ``unscored`` (``[B]`` bool). Empty for a
    batch scored by no reward function."""

    size: int
    several: bool = False
    parts: Dict[str, torch.Tensor] = field(default_factory=dict)
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)
    unscored: Optional[torch.Tensor] = None  # all False when not given

    def __post_init__(self):
        if self.unscored is None:
            self.unscored = torch.zeros(self.size, dtype=torch.bool)

    @classmethod
    def of(cls, scored: RewardScores, several: bool) -> "RewardColumns":
        """The columns of :func:`pyppo.reward_sum.score_rewards`' result."""
        return cls(
            len(scored.scores),
            several,
            {k: _column(v) for k, v in scored.parts.items()},
            {k: _column(v) for k, v in scored.extras.items()},
            torch.tensor(scored.unscored, dtype=torch.bool),
        )

    def select(self, index: torch.Tensor) -> "RewardColumns":
        """The rows ``index`` (as :meth:`~pyppo.trainer.buffer.RolloutBuffer.select`)."""
        return RewardColumns(
            len(index),
            self.several,
            {k: v[index] for k, v in self.parts.items()},
            {k: v[index] for k, v in self.extras.items()},
            self.unscored[index],
        )

    @classmethod
    def cat(cls, columns: List["RewardColumns"]) -> "RewardColumns":
        """The rows of ``columns`` one after the other; a key some lack is NaN in their rows."""
        keys = {what: sorted({k for c in columns for k in getattr(c, what)}) for what in ("parts", "extras")}

        def joined(what: str, key: str) -> torch.Tensor:
            nan = lambda c: torch.full((c.size,), math.nan, dtype=torch.float64)  # noqa: E731
            return torch.cat([getattr(c, what).get(key, nan(c)) for c in columns])

        return cls(
            sum(c.size for c in columns),
            any(c.several for c in columns),
            {k: joined("parts", k) for k in keys["parts"]},
            {k: joined("extras", k) for k in keys["extras"]},
            torch.cat([c.unscored for c in columns]),
        )


def reward_metrics(columns: RewardColumns, world: distributed.World) -> Dict[str, float]:
    """The step's per-reward metrics (module docstring), the same on every rank (a collective
    under ``torchrun``: every rank calls it). A mean over no applicable response is NaN, and so is
    a standard deviation (Bessel-corrected, as TRL's ``nanstd``) over fewer than two.

    Returns:
        ``{}`` for one reward that returned no dicts.
    """
    extras = sorted(columns.extras)
    if world.active:  # a key may come from one rank's responses only: every rank logs every key
        extras = sorted({k for keys in distributed.gather_objects(extras, world) for k in keys})
    parts = sorted(columns.parts)
    sums: List[float] = []
    for key in parts:
        x = columns.parts[key]
        ok = ~torch.isnan(x)
        sums += [float(x[ok].sum()), float((x[ok] ** 2).sum()), float(ok.sum())]
    for key in extras:
        x = columns.extras.get(key, torch.full((columns.size,), math.nan, dtype=torch.float64))
        ok = ~torch.isnan(x)
        sums += [float(x[ok].sum()), float(ok.sum())]
    sums += [float(columns.unscored.sum()), float(columns.size)]
    sums = distributed.all_sum(sums, world)
    out: Dict[str, float] = {}
    for j, key in enumerate(parts):
        s, ss, n = sums[3 * j : 3 * j + 3]
        out[f"reward/{key}_mean"] = s / n if n else math.nan
        out[f"reward/{key}_std"] = math.sqrt(max(ss - s * s / n, 0.0) / (n - 1)) if n > 1 else math.nan
    base = 3 * len(parts)
    for j, key in enumerate(extras):
        s, n = sums[base + 2 * j : base + 2 * j + 2]
        out[f"reward/{key}_mean"] = s / n if n else math.nan
    if columns.several:
        unscored, total = sums[-2:]
        out["reward/unscored_fraction"] = unscored / total if total else 0.0
    return out
