"""linear_logprobs (log-probs from hidden states ``[N, H]`` and the output embedding ``[V, H]``)
against the full-logits path every PPO trainer runs today: the forward at rollout time, and the
forward+backward of the update."""

from __future__ import annotations

import torch

from pyppo.ops import linear_logprobs

from .. import eager, floors
from ..case import Case
from ..inputs import linear_inputs, nbytes

_inputs_bytes = nbytes("hidden", "weight")


def _no_grad(fn):
    def run(inp):
        with torch.no_grad():
            return fn(inp["hidden"], inp["weight"], inp["labels"])

    return run


def _fwd_bwd(fn):
    def run(inp):
        h, w = inp["hidden"], inp["weight"]
        fn(h, w, inp["labels"]).backward(inp["grad"])
        grad_hidden = h.grad
        h.grad = w.grad = None
        return grad_hidden  # grad_weight is checked by the op's own tests

    return run


def _logits_gemm(inp):
    with torch.no_grad():
        return inp["hidden"] @ inp["weight"].T


# mode: how pyppo's op and the eager formula are both run, the row's label, the eager formula,
# and the least work either must do (the floor and its name).
_MODES = {
    "fwd": (
        _no_grad,
        "linear_logprobs fwd (no grad)",
        "h @ W.T, log_softmax.gather",
        _logits_gemm,
        "the logits GEMM alone",
    ),
    "fwd+bwd": (
        _fwd_bwd,
        "linear_logprobs fwd+bwd",
        "h @ W.T, log_softmax.gather, autograd",
        floors.linear_gemms,
        "the 3 GEMMs alone",
    ),
}


def _case(mode: str, shape, dtype) -> Case:
    run, label, eager_name, floor, floor_name = _MODES[mode]
    return Case(
        op="linear_logprobs",
        label=label,
        eager_name=eager_name,
        shape=tuple(shape),
        dtype=dtype,
        make_inputs=linear_inputs,
        pyppo=run(linear_logprobs),
        eager=run(eager.linear_logsoftmax_gather),
        floor=floor,
        floor_name=floor_name,
        tol=1e-4,
        input_bytes=_inputs_bytes,
    )


def fwd(shape, dtype) -> Case:
    return _case("fwd", shape, dtype)


def fwd_bwd(shape, dtype) -> Case:
    return _case("fwd+bwd", shape, dtype)
