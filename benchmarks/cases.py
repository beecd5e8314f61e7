"""The cases ``pyppo bench`` runs: shapes, dtypes, the eager baseline, the floor, the targets.

A :class:`Case` is one table row: one op, one shape and dtype, three callables over the same
inputs — ``pyppo`` (the compiled op), ``eager`` (the PyTorch a user writes today, from
:mod:`.eager`) and ``floor`` (a single read of the same inputs: the memory-bandwidth floor no
implementation can beat by much) — plus the issue-3 targets that apply to it.

A :class:`Sweep` is a series of cases over one size (V for ``gather_logprobs``, T for the
``[B, T]`` ops), plotted against that size.

Suites (``sizes``): ``"full"`` (the issue's sizes and wide sweeps; peak memory stays under
~3 GiB, well inside 24 GiB), ``"quick"`` (the issue's target shapes, short sweeps: about a
minute on 2 cores), ``"tiny"`` (seconds; for tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import eager

Inputs = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """An issue-3 target: ``metric`` (a row field) compared with ``bound`` by ``cmp``."""

    name: str
    metric: str  # "speedup" | "floor_ratio" | "pyppo_extra_pct"
    cmp: str  # ">=" | "<="
    bound: float
    goal: float | None = None  # stretch goal, reported, not required

    def met(self, value: float) -> bool:
        return value >= self.bound if self.cmp == ">=" else value <= self.bound

    def goal_met(self, value: float) -> bool | None:
        if self.goal is None:
            return None
        return value >= self.goal if self.cmp == ">=" else value <= self.goal


@dataclass
class Case:
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

    @property
    def shape_str(self) -> str:
        return "x".join(str(s) for s in self.shape)

    @property
    def dtype_str(self) -> str:
        return str(self.dtype).replace("torch.", "")


@dataclass
class Sweep:
    name: str  # "gather_logprobs vs V"
    axis: str  # "V" or "T"
    cases: list[Case] = field(default_factory=list)
    values: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# inputs


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


_LOGITS = _logits_inputs(False)
_LOGITS_GRAD = _logits_inputs(True)


def response_mask(B: int, T: int, g: torch.Generator, holes: float = 0.1) -> torch.Tensor:
    """Right-padded rows (lengths uniform in ``[T/4, T]``) with ``holes`` of the valid positions
    after the first masked out (tool outputs / observations in the middle of a row)."""
    lengths = torch.randint(max(1, T // 4), T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    hole = torch.rand(B, T, generator=g) < holes
    hole[:, 0] = False
    return mask & ~hole


def _bt_inputs(shape, dtype, device, seed) -> Inputs:
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


def _nbytes(*names: str) -> Callable[[Inputs], int]:
    return lambda inp: sum(inp[n].numel() * inp[n].element_size() for n in names)


def _sum_floor(*names: str) -> Callable[[Inputs], Any]:
    """One read of each named input (a reduction: reads every byte once, writes a scalar)."""
    return lambda inp: [inp[n].sum() for n in names]


# ---------------------------------------------------------------------------------------------
# gather_logprobs


def _gl_pyppo(inp):
    from pyppo.ops import gather_logprobs

    return gather_logprobs(inp["logits"], inp["labels"])


def _gl_entropy_pyppo(inp):
    from pyppo.ops import gather_logprobs

    return gather_logprobs(inp["logits"], inp["labels"], return_entropy=True)


def _gl_fwd_bwd_pyppo(inp):
    from pyppo.ops import gather_logprobs

    x = inp["logits"]
    gather_logprobs(x, inp["labels"]).backward(inp["grad"])
    grad, x.grad = x.grad, None
    return grad


def _gl_fwd_bwd_eager(inp):
    x = inp["logits"]
    eager.logsoftmax_gather(x, inp["labels"]).backward(inp["grad"])
    grad, x.grad = x.grad, None
    return grad


def _amax_floor(inp):
    return inp["logits"].amax(-1)


def _fwd_bwd_floor(inp):
    # The fewest passes a separate forward and backward can make: the forward reads the logits
    # once, the backward reads them again and writes a fresh [*, V] gradient.
    x = inp["logits"].detach()
    return x.amax(-1), x.clone()


GL_SPEED = Target("gather_logprobs fwd >= 4x eager", "speedup", ">=", 4.0)
GL_FLOOR = Target("gather_logprobs fwd <= 3x floor (goal 2x)", "floor_ratio", "<=", 3.0, goal=2.0)
GL_MEM = Target("gather_logprobs fwd extra peak <= 1% of logits", "pyppo_extra_pct", "<=", 1.0)
GL_BWD = Target("gather_logprobs fwd+bwd fp32 >= 2.5x eager", "speedup", ">=", 2.5)
GAE_SPEED = Target("gae with holes >= 100x the Python loop", "speedup", ">=", 100.0)


def gather_logprobs_fwd(shape, dtype, *, eager_name="log_softmax.gather", targets=()) -> Case:
    if eager_name == "log_softmax.gather":
        fn = lambda inp: eager.logsoftmax_gather(inp["logits"], inp["labels"])  # noqa: E731
    elif eager_name == "trl selective_log_softmax":
        fn = lambda inp: eager.selective_log_softmax(inp["logits"], inp["labels"])  # noqa: E731
    else:  # pragma: no cover
        raise ValueError(eager_name)
    low = dtype in (torch.bfloat16, torch.float16)
    return Case(
        op="gather_logprobs", label="gather_logprobs fwd", eager_name=eager_name,
        shape=tuple(shape), dtype=dtype, make_inputs=_LOGITS,
        pyppo=_gl_pyppo, eager=fn, floor=_amax_floor, floor_name="logits.amax(-1)",
        # The eager log_softmax of bf16 logits rounds its output to bf16 (~0.4% of |logprob|).
        tol=2e-2 if low else 1e-4, input_bytes=_nbytes("logits"), targets=tuple(targets),
    )


def gather_logprobs_entropy(shape, dtype) -> Case:
    low = dtype in (torch.bfloat16, torch.float16)
    return Case(
        op="gather_logprobs", label="gather_logprobs+entropy fwd",
        eager_name="log_softmax.gather, -(softmax*log_softmax).sum", shape=tuple(shape), dtype=dtype,
        make_inputs=_LOGITS, pyppo=_gl_entropy_pyppo,
        eager=lambda inp: eager.logprobs_and_entropy(inp["logits"], inp["labels"]),
        floor=_amax_floor, floor_name="logits.amax(-1)", tol=2e-2 if low else 1e-4,
        input_bytes=_nbytes("logits"),
    )


def gather_logprobs_fwd_bwd(shape, dtype, targets=()) -> Case:
    low = dtype in (torch.bfloat16, torch.float16)
    return Case(
        op="gather_logprobs", label="gather_logprobs fwd+bwd", eager_name="autograd of log_softmax.gather",
        shape=tuple(shape), dtype=dtype, make_inputs=_LOGITS_GRAD,
        pyppo=_gl_fwd_bwd_pyppo, eager=_gl_fwd_bwd_eager, floor=_fwd_bwd_floor,
        floor_name="logits.amax(-1) + logits.clone()", tol=2e-2 if low else 1e-5,
        input_bytes=_nbytes("logits"), targets=tuple(targets),
    )


# ---------------------------------------------------------------------------------------------
# linear_logprobs: log-probs from hidden states [N, H] and the output embedding [V, H]


def _linear_inputs(shape, dtype, device, seed) -> Inputs:
    g = _gen(seed)
    N, H, V = shape
    return {
        "hidden": (torch.randn(N, H, generator=g) * 0.5).to(dtype).to(device).requires_grad_(True),
        "weight": (torch.randn(V, H, generator=g) * 0.05).to(dtype).to(device).requires_grad_(True),
        "labels": torch.randint(0, V, (N,), generator=g).to(device),
        "grad": torch.randn(N, generator=g).to(device),
    }


def _linear_fwd_bwd(fn):
    def run(inp):
        h, w = inp["hidden"], inp["weight"]
        fn(h, w, inp["labels"]).backward(inp["grad"])
        grads = (h.grad, w.grad)
        h.grad = w.grad = None
        return grads[0]  # compared against eager; grad_weight is checked by tests/test_linear_logprobs.py

    return run


def _linear_pyppo(h, w, labels):
    from pyppo.ops import linear_logprobs

    return linear_logprobs(h, w, labels)


def _gemm_floor(inp):
    # The GEMMs any forward+backward must run (logits, grad_hidden, grad_weight), without softmax.
    h, w = inp["hidden"].detach(), inp["weight"].detach()
    logits = h @ w.T
    return logits @ w, logits.T @ h


def linear_logprobs_fwd_bwd(shape, dtype) -> Case:
    return Case(
        op="linear_logprobs", label="linear_logprobs fwd+bwd", eager_name="h @ W.T, log_softmax.gather, autograd",
        shape=tuple(shape), dtype=dtype, make_inputs=_linear_inputs,
        pyppo=_linear_fwd_bwd(_linear_pyppo), eager=_linear_fwd_bwd(eager.linear_logsoftmax_gather),
        floor=_gemm_floor, floor_name="the 3 GEMMs alone", tol=1e-4,
        input_bytes=_nbytes("hidden", "weight"),
    )


# ---------------------------------------------------------------------------------------------
# [B, T] ops


def kl_penalty_case(shape, dtype, estimator="k3") -> Case:
    from pyppo.ops import kl_penalty

    return Case(
        op="kl_penalty", label=f"kl_penalty {estimator}", eager_name="openrlhf compute_approx_kl",
        shape=tuple(shape), dtype=dtype, make_inputs=_bt_inputs,
        pyppo=lambda inp: kl_penalty(inp["logprobs"], inp["ref_logprobs"], estimator=estimator, clamp=(-10.0, 10.0)),
        eager=lambda inp: eager.compute_approx_kl(inp["logprobs"], inp["ref_logprobs"], estimator, clamp=(-10.0, 10.0)),
        floor=_sum_floor("logprobs", "ref_logprobs"), floor_name="sum of each input",
        tol=1e-5, input_bytes=_nbytes("logprobs", "ref_logprobs"),
    )


def shape_rewards_case(shape, dtype) -> Case:
    from pyppo.ops import shape_rewards

    return Case(
        op="shape_rewards", label="shape_rewards k1", eager_name="openrlhf compute_reward",
        shape=tuple(shape), dtype=dtype, make_inputs=_bt_inputs,
        pyppo=lambda inp: shape_rewards(inp["scores"], inp["logprobs"], inp["ref_logprobs"], inp["mask"], kl_coef=0.05),
        eager=lambda inp: eager.shape_rewards(inp["scores"], inp["logprobs"], inp["ref_logprobs"], inp["mask"], 0.05),
        floor=_sum_floor("scores", "logprobs", "ref_logprobs", "mask"), floor_name="sum of each input",
        tol=1e-5, input_bytes=_nbytes("scores", "logprobs", "ref_logprobs", "mask"),
    )


def gae_case(shape, dtype, targets=(), eager_name="verl loop") -> Case:
    from pyppo.ops import gae

    loop = eager.gae_loop if eager_name == "verl loop" else eager.gae_loop_trl
    return Case(
        op="gae", label="gae (mask with holes)", eager_name=eager_name,
        shape=tuple(shape), dtype=dtype, make_inputs=_bt_inputs,
        pyppo=lambda inp: gae(inp["rewards"], inp["values"], inp["mask"], gamma=1.0, lam=0.95),
        eager=lambda inp: loop(inp["rewards"], inp["values"], inp["mask"], 1.0, 0.95),
        floor=_sum_floor("rewards", "values", "mask"), floor_name="sum of each input",
        tol=1e-4, input_bytes=_nbytes("rewards", "values", "mask"), targets=tuple(targets),
        # TRL's loop does not skip holes: check pyppo against the hole-aware veRL loop.
        compare_eager=lambda inp: eager.gae_loop(inp["rewards"], inp["values"], inp["mask"], 1.0, 0.95),
    )


def masked_whiten_case(shape, dtype) -> Case:
    from pyppo.ops import masked_whiten

    return Case(
        op="masked_whiten", label="masked_whiten", eager_name="trl masked_whiten + masked_fill",
        shape=tuple(shape), dtype=dtype, make_inputs=_bt_inputs,
        pyppo=lambda inp: masked_whiten(inp["x"], inp["mask"]),
        eager=lambda inp: eager.masked_whiten_fill(inp["x"], inp["mask"]),
        floor=_sum_floor("x", "mask"), floor_name="sum of each input",
        tol=1e-4, input_bytes=_nbytes("x", "mask"),
    )


# ---------------------------------------------------------------------------------------------
# suites

F32, BF16 = torch.float32, torch.bfloat16
TARGET_LOGITS = (4, 512, 49152)
TARGET_BT = (64, 1024)


def _main_cases(logits_shape, bt_shape, with_targets: bool, linear_shape=(2048, 576, 49152)) -> list[Case]:
    t = (lambda *xs: xs) if with_targets else (lambda *xs: ())
    return [
        gather_logprobs_fwd(logits_shape, F32, targets=t(GL_SPEED, GL_FLOOR, GL_MEM)),
        gather_logprobs_fwd(logits_shape, F32, eager_name="trl selective_log_softmax"),
        gather_logprobs_entropy(logits_shape, F32),
        gather_logprobs_fwd(logits_shape, BF16, targets=t(GL_SPEED, GL_FLOOR, GL_MEM)),
        gather_logprobs_fwd(logits_shape, BF16, eager_name="trl selective_log_softmax"),
        gather_logprobs_fwd_bwd(logits_shape, F32, targets=t(GL_BWD)),
        linear_logprobs_fwd_bwd(linear_shape, F32),
        kl_penalty_case(bt_shape, F32, "k3"),
        shape_rewards_case(bt_shape, F32),
        gae_case(bt_shape, F32, targets=t(GAE_SPEED)),
        gae_case(bt_shape, F32, eager_name="trl loop"),
        masked_whiten_case(bt_shape, F32),
    ]


def _sweeps(bt_lead: tuple[int, int], vs: list[int], B: int, ts: list[int]) -> list[Sweep]:
    sweeps = [Sweep("gather_logprobs fwd fp32", "V", [gather_logprobs_fwd((*bt_lead, v), F32) for v in vs], vs)]
    for name, make in (("gae (holes) fp32", gae_case), ("shape_rewards fp32", shape_rewards_case),
                       ("masked_whiten fp32", masked_whiten_case)):
        sweeps.append(Sweep(name, "T", [make((B, t), F32) for t in ts], ts))
    return sweeps


def suite(sizes: str) -> tuple[list[Case], list[Sweep]]:
    """``(cases, sweeps)`` of a suite: ``"full"``, ``"quick"`` or ``"tiny"``."""
    if sizes == "full":
        return (_main_cases(TARGET_LOGITS, TARGET_BT, True),
                _sweeps((4, 512), [4096, 16384, 32768, 49152, 65536, 131072, 152064], 64,
                        [64, 128, 256, 512, 1024, 2048, 4096]))
    if sizes == "quick":
        return (_main_cases(TARGET_LOGITS, TARGET_BT, True, linear_shape=(1024, 576, 49152)),
                _sweeps((2, 256), [4096, 32768, 131072], 64, [128, 512, 2048]))
    if sizes == "tiny":
        return (_main_cases((2, 8, 1000), (4, 32), False, linear_shape=(16, 8, 1000)),
                _sweeps((2, 8), [256, 1024], 4, [16, 64]))
    raise ValueError(f"sizes must be 'full', 'quick' or 'tiny', got {sizes!r}")

