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


def fwd(shape, dtype) -> Case:
    return Case(
        op="linear_logprobs", label="linear_logprobs fwd (no grad)", eager_name="h @ W.T, log_softmax.gather",
        shape=tuple(shape), dtype=dtype, make_inputs=linear_inputs,
        pyppo=_no_grad(linear_logprobs), eager=_no_grad(eager.linear_logsoftmax_gather),
        floor=_logits_gemm, floor_name="the logits GEMM alone", tol=1e-4, input_bytes=_inputs_bytes,
    )


def fwd_bwd(shape, dtype) -> Case:
    return Case(
        op="linear_logprobs", label="linear_logprobs fwd+bwd", eager_name="h @ W.T, log_softmax.gather, autograd",
        shape=tuple(shape), dtype=dtype, make_inputs=linear_inputs,
        pyppo=_fwd_bwd(linear_logprobs), eager=_fwd_bwd(eager.linear_logsoftmax_gather),
        floor=floors.linear_gemms, floor_name="the 3 GEMMs alone", tol=1e-4, input_bytes=_inputs_bytes,
    )
