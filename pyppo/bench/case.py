"""What one benchmark row is: a :class:`Case`, the :class:`Target` it is held to, and a
:class:`Sweep` of cases over one size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["Inputs", "Target", "RowLabels", "Case", "Sweep"]

Inputs = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """A performance target: the row field ``metric`` compared with ``bound`` by ``cmp``.

    ``name`` says what the target is and why in a few words, as the table prints it."""

    name: str
    metric: str  # a row field: "speedup", "floor_ratio", "bandwidth_pct", "pyppo_extra_pct"
    cmp: str  # ">=" | "<="
    bound: float
    goal: float | None = None  # a stretch goal, reported, not required

    def _holds(self, value: float, bound: float) -> bool:
        return value >= bound if self.cmp == ">=" else value <= bound

    def met(self, value: float) -> bool:
        return self._holds(value, self.bound)

    def goal_met(self, value: float) -> bool | None:
        return None if self.goal is None else self._holds(value, self.goal)


class RowLabels:
    """How a row with ``shape`` and ``dtype`` fields names them in the table (``4x512x49152``,
    ``bfloat16``); shared by :class:`Case` and the peer rows."""

    @property
    def shape_str(self) -> str:
        return "x".join(str(s) for s in self.shape)

    @property
    def dtype_str(self) -> str:
        return str(self.dtype).replace("torch.", "")


@dataclass
class Case(RowLabels):
    """One table row: one op, one shape and dtype, three callables over the same inputs.

    ``pyppo`` is the compiled op, ``eager`` the PyTorch a user of the peers writes today
    (:mod:`pyppo.bench.eager`), ``floor`` the least work any implementation must do (usually one
    read of the inputs: the memory-bandwidth floor)."""

    op: str  # pyppo op name
    label: str  # table "op" column
    eager_name: str  # which eager formula
    shape: tuple[int, ...]
    dtype: torch.dtype
    make_inputs: Callable[[tuple[int, ...], torch.dtype, torch.device, int], Inputs]
    pyppo: Callable[[Inputs], Any]
    eager: Callable[[Inputs], Any]
    floor: Callable[[Inputs], Any]
    floor_name: str
    tol: float  # max |pyppo - eager| / max(1, max |eager|) allowed
    input_bytes: Callable[[Inputs], int]  # what "extra memory %" is relative to
    targets: tuple[Target, ...] = ()
    compare_eager: Callable[[Inputs], Any] | None = None  # numerical check against this instead
    # The fewest bytes pyppo's op and the floor must move through memory: with both set, the
    # row reports achieved bandwidth and pyppo's share of the floor's.
    bytes_moved: Callable[[Inputs], int] | None = None
    floor_bytes_moved: Callable[[Inputs], int] | None = None


@dataclass
class Sweep:
    """Cases over one size (V for the log-prob ops, T for the ``[B, T]`` ops), plotted against it."""

    name: str
    axis: str
    cases: list[Case] = field(default_factory=list)
    values: list[int] = field(default_factory=list)
