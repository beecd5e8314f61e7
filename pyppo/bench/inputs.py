"""Random benchmark inputs: logits, ``[B, T]`` rollout tensors with realistic masks, hidden states.

Every maker is ``make(shape, dtype, device, seed) -> dict`` and draws on the CPU from its own
seeded generator, so the inputs are the same on every device and in every run.
"""

from __future__ import annotations

from typing import Callable

import torch

from pyppo.ops import linear_logprobs

from .case import Inputs

__all__ = ["LOGITS", "LOGITS_GRAD", "bt_inputs", "linear_inputs", "linear_ppo_inputs", "response_mask", "nbytes"]


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _logits_inputs(requires_grad: bool):
    def make(shape, dtype, device, seed) -> Inputs:
        g = _gen(seed)
        *lead, V = shape
        logits = (torch.randn(shape, generator=g) * 2.0).to(dtype)
        labels = torch.randint(0, V, tuple(lead), generator=g)
        inp = {"labels": labels.to(device)}
        logits = logits.to(device)
        if requires_grad:
            logits.requires_grad_(True)
            inp["grad"] = torch.randn(tuple(lead), generator=g).to(device)
        inp["logits"] = logits
        return inp

    return make


LOGITS = _logits_inputs(False)
LOGITS_GRAD = _logits_inputs(True)


def response_mask(B: int, T: int, g: torch.Generator, holes: float = 0.1) -> torch.Tensor:
    """Right-padded rows (lengths uniform in ``[T/4, T]``) with ``holes`` of the valid positions
    after the first masked out (tool outputs / observations in the middle of a row)."""
    lengths = torch.randint(max(1, T // 4), T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    hole = torch.rand(B, T, generator=g) < holes
    hole[:, 0] = False
    return mask & ~hole


def bt_inputs(shape, dtype, device, seed) -> Inputs:
    g = _gen(seed)
    B, T = shape
    logprobs = -torch.rand(B, T, generator=g) * 5.0
    ref_logprobs = logprobs + 0.3 * torch.randn(B, T, generator=g)
    inp = {
        "logprobs": logprobs,
        "ref_logprobs": ref_logprobs,
        "rewards": 0.1 * torch.randn(B, T, generator=g),
        "values": torch.randn(B, T, generator=g),
        "x": torch.randn(B, T, generator=g) * 3.0 + 1.0,
        "scores": torch.randn(B, generator=g),
        "mask": response_mask(B, T, g),
    }
    return {k: (v.to(dtype) if v.is_floating_point() else v).to(device) for k, v in inp.items()}


def linear_inputs(shape, dtype, device, seed) -> Inputs:
    """Hidden states ``[N, H]`` and an output embedding ``[V, H]``, both requiring grad."""
    g = _gen(seed)
    N, H, V = shape
    return {
        "hidden": (torch.randn(N, H, generator=g) * 0.5).to(dtype).to(device).requires_grad_(True),
        "weight": (torch.randn(V, H, generator=g) * 0.05).to(dtype).to(device).requires_grad_(True),
        "labels": torch.randint(0, V, (N,), generator=g).to(device),
        "grad": torch.randn(N, generator=g).to(device),
    }


def linear_ppo_inputs(shape, dtype, device, seed) -> Inputs:
    """A PPO micro-batch from hidden states: ``[B, T, H]`` hidden states and a ``[V, H]`` head
    (both requiring grad), labels, a response mask, advantages, and old log-probs within a
    log-ratio of about ±0.2 of the current ones (so that some tokens are clipped, as in an epoch
    after the first)."""
    g = _gen(seed)
    B, T, H, V = shape
    hidden = (torch.randn(B, T, H, generator=g) * 0.5).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.05).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        logprobs = linear_logprobs(hidden, weight, labels)
    inp = {
        "labels": labels,
        "response_mask": response_mask(B, T, g),
        "advantages": torch.randn(B, T, generator=g),
        "old_logprobs": logprobs + 0.2 * torch.randn(B, T, generator=g),
    }
    inp = {k: v.to(device) for k, v in inp.items()}
    inp["hidden"] = hidden.to(device).requires_grad_(True)
    inp["weight"] = weight.to(device).requires_grad_(True)
    return inp


def nbytes(*names: str) -> Callable[[Inputs], int]:
    """The bytes of the named inputs."""
    return lambda inp: sum(inp[n].numel() * inp[n].element_size() for n in names)
