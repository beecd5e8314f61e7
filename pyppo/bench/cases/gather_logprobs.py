"""gather_logprobs against ``log_softmax().gather()`` and TRL's ``selective_log_softmax``:
the forward, the forward with entropy, and the forward+backward."""

from __future__ import annotations

import torch

from pyppo.ops import gather_logprobs

from .. import eager, floors
from ..case import Case, Target
from ..inputs import LOGITS, LOGITS_GRAD, nbytes

# One pass over the logits (an online logsumexp) against log_softmax's three passes and its
# [*, V] temporary: these bounds are what that design should reach on a CPU.
SPEED = Target("gather_logprobs fwd >= 4x eager", "speedup", ">=", 4.0)
NEAR_FLOOR = Target("gather_logprobs fwd <= 3x floor (goal 2x)", "floor_ratio", "<=", 3.0, goal=2.0)
NO_TEMPORARY = Target("gather_logprobs fwd extra peak <= 1% of logits", "pyppo_extra_pct", "<=", 1.0)
FWD_BWD_SPEED = Target("gather_logprobs fwd+bwd fp32 >= 2.5x eager", "speedup", ">=", 2.5)
# On a GPU the forward is one streaming read: it should run near copy bandwidth, and never
# lose to the peers' memory-saving loop.
COPY_BANDWIDTH = Target("gather_logprobs fwd reads the logits at >= 80% of copy bandwidth", "bandwidth_pct", ">=", 80.0)
NOT_SLOWER_THAN_TRL = Target("gather_logprobs fwd no slower than trl selective_log_softmax", "speedup", ">=", 1.0)

EAGER = {
    "log_softmax.gather": lambda inp: eager.logsoftmax_gather(inp["logits"], inp["labels"]),
    "trl selective_log_softmax": lambda inp: eager.selective_log_softmax(inp["logits"], inp["labels"]),
}

# (floor, its name, bytes it moves per byte of logits)
FLOORS = {"read": (floors.read_logits, "logits.amax(-1)", 1), "copy": (floors.copy_logits, "logits.clone()", 2)}

_logits_bytes = nbytes("logits")


def _tol(dtype: torch.dtype, fp32: float) -> float:
    # The eager log_softmax of bf16 logits rounds its output to bf16 (~0.4% of |logprob|).
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else fp32


def _pyppo(inp):
    return gather_logprobs(inp["logits"], inp["labels"])


def _pyppo_entropy(inp):
    return gather_logprobs(inp["logits"], inp["labels"], return_entropy=True)


def _fwd_bwd(fn):
    def run(inp):
        x = inp["logits"]
        fn(x, inp["labels"]).backward(inp["grad"])
        grad, x.grad = x.grad, None
        return grad

    return run


def _shared(shape, dtype, fp32_tol: float) -> dict:
    """The fields every row has alike: the op, its size, and the logits as what its extra memory
    is relative to."""
    return {
        "op": "gather_logprobs",
        "shape": tuple(shape),
        "dtype": dtype,
        "tol": _tol(dtype, fp32_tol),
        "input_bytes": _logits_bytes,
    }


def fwd(
    shape, dtype, *, eager_name: str = "log_softmax.gather", floor: str = "read", targets: tuple[Target, ...] = ()
) -> Case:
    floor_fn, floor_name, floor_passes = FLOORS[floor]
    return Case(
        **_shared(shape, dtype, 1e-4),
        label="gather_logprobs fwd",
        eager_name=eager_name,
        make_inputs=LOGITS,
        pyppo=_pyppo,
        eager=EAGER[eager_name],
        floor=floor_fn,
        floor_name=floor_name,
        targets=tuple(targets),
        bytes_moved=_logits_bytes,
        floor_bytes_moved=lambda inp: floor_passes * _logits_bytes(inp),
    )


def fwd_entropy(shape, dtype) -> Case:
    return Case(
        **_shared(shape, dtype, 1e-4),
        label="gather_logprobs+entropy fwd",
        eager_name="log_softmax.gather, -(softmax*log_softmax).sum",
        make_inputs=LOGITS,
        pyppo=_pyppo_entropy,
        eager=lambda inp: eager.logprobs_and_entropy(inp["logits"], inp["labels"]),
        floor=floors.read_logits,
        floor_name="logits.amax(-1)",
    )


def fwd_bwd(shape, dtype, *, targets: tuple[Target, ...] = ()) -> Case:
    return Case(
        **_shared(shape, dtype, 1e-5),
        label="gather_logprobs fwd+bwd",
        eager_name="autograd of log_softmax.gather",
        make_inputs=LOGITS_GRAD,
        pyppo=_fwd_bwd(gather_logprobs),
        eager=_fwd_bwd(eager.logsoftmax_gather),
        floor=floors.fwd_bwd_logits,
        floor_name="logits.amax(-1) + logits.clone()",
        targets=tuple(targets),
    )
