"""The shape shared by the cases of the ``[B, T]`` rollout ops: inputs from
:func:`~pyppo.bench.inputs.bt_inputs`, and a floor that reads each input the op reads once."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..case import Case, Inputs, Target
from ..floors import sum_each
from ..inputs import bt_inputs, nbytes


def bt_case(
    op: str,
    label: str,
    eager_name: str,
    shape,
    dtype: torch.dtype,
    *,
    reads: tuple[str, ...],
    pyppo: Callable[[Inputs], Any],
    eager: Callable[[Inputs], Any],
    tol: float,
    targets: tuple[Target, ...] = (),
    compare_eager: Callable[[Inputs], Any] | None = None,
) -> Case:
    """A case over ``[B, T]`` inputs; ``reads`` are the inputs the op reads (the floor reads
    each once, and the extra-memory % is relative to their bytes)."""
    return Case(
        op=op,
        label=label,
        eager_name=eager_name,
        shape=tuple(shape),
        dtype=dtype,
        make_inputs=bt_inputs,
        pyppo=pyppo,
        eager=eager,
        floor=sum_each(*reads),
        floor_name="sum of each input",
        tol=tol,
        input_bytes=nbytes(*reads),
        targets=tuple(targets),
        compare_eager=compare_eager,
    )
