"""The masked family: ``masked_whiten`` against TRL's ``masked_whiten`` followed by the
``masked_fill`` its trainer does."""

from __future__ import annotations

from pyppo.ops import masked_whiten

from .. import eager
from ..case import Case
from .bt import bt_case


def masked_whiten_case(shape, dtype) -> Case:
    return bt_case(
        "masked_whiten",
        "masked_whiten",
        "trl masked_whiten + masked_fill",
        shape,
        dtype,
        reads=("x", "mask"),
        tol=1e-4,
        pyppo=lambda inp: masked_whiten(inp["x"], inp["mask"]),
        eager=lambda inp: eager.masked_whiten_fill(inp["x"], inp["mask"]),
    )
