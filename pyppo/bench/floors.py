"""Floors: the least memory traffic (or arithmetic) any implementation of an op must do,
run on the same inputs, so that "x floor" says how far an op is from the best it could be."""

from __future__ import annotations

from typing import Any, Callable

from .case import Inputs

__all__ = ["read_logits", "copy_logits", "fwd_bwd_logits", "sum_each", "linear_gemms"]


def read_logits(inp: Inputs):
    """One read of the logits (a reduction writes next to nothing)."""
    return inp["logits"].amax(-1)


def copy_logits(inp: Inputs):
    """A device-to-device copy of the logits: a read and a write of each byte, what GPU copy
    bandwidth is measured by. (On CPU a fresh ``[*, V]`` buffer costs page faults too; use
    :func:`read_logits` there.)"""
    return inp["logits"].detach().clone()


def fwd_bwd_logits(inp: Inputs):
    """The fewest passes a separate forward and backward can make: the forward reads the logits
    once, the backward reads them again and writes a fresh ``[*, V]`` gradient."""
    x = inp["logits"].detach()
    return x.amax(-1), x.clone()


def sum_each(*names: str) -> Callable[[Inputs], Any]:
    """One read of each named input."""
    return lambda inp: [inp[n].sum() for n in names]


def linear_gemms(inp: Inputs):
    """The GEMMs any forward+backward from hidden states must run (logits, grad_hidden,
    grad_weight), without the softmax."""
    h, w = inp["hidden"].detach(), inp["weight"].detach()
    logits = h @ w.T
    return logits @ w, logits.T @ h
