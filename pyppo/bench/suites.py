"""The suites ``pyppo bench --suite`` runs, each at three sizes (``full``, ``quick``, ``tiny``).

* ``ops``: every op against its eager peers and its floor, at the shapes of a SmolLM2-sized PPO
  step (logits ``[4, 512, 49152]``, rollouts ``[64, 1024]``; the group advantages on a GRPO batch
  of 512 prompts x 8 responses, ``[4096, 256]``), with sweeps over V and T; on the CPU, and on
  CUDA too when present. ``full`` keeps peak memory under ~3 GiB; ``quick`` is about
  a minute on 2 cores; ``tiny`` takes seconds (for tests).
* ``gpu``: CUDA only, at GPU-sized batches (rollouts ``[256, 4096]``), the log-prob forward
  against a device-to-device copy (copy bandwidth is the bar), timed with CUDA events.
* ``memory``: peak memory of the log-prob ops from hidden states and from logits, forward and
  forward+backward, over N, and of the fused PPO loss from hidden states: the eager path's peak
  grows with ``N * V`` (whole ``[N, V]`` logits and their softmax), pyppo's stops growing once N
  fills one chunk of logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .case import Case, Sweep
from .cases import gae, gather_logprobs, group_advantages, kl, linear_logprobs, linear_ppo_loss, masked, turn_gae

__all__ = ["Timing", "Suite", "SUITES", "SIZES", "suite"]

F32, BF16 = torch.float32, torch.bfloat16
SIZES = ("full", "quick", "tiny")


@dataclass(frozen=True)
class Timing:
    """How long to time each case: untimed warm-up samples, rounds, seconds of rounds (the
    keyword arguments of :func:`~pyppo.bench.timing.measure`, which it is passed as)."""

    warmup: int
    min_reps: int
    max_reps: int
    budget_s: float


@dataclass
class Suite:
    name: str
    cases: list[Case]
    timing: Timing
    sweeps: list[Sweep] = field(default_factory=list)
    cuda_only: bool = False


_TIMING = {"full": Timing(2, 5, 50, 6.0), "quick": Timing(1, 3, 20, 1.5), "tiny": Timing(1, 2, 3, 0.05)}


def _ppo_shape(linear_shape) -> tuple[int, int, int, int]:
    """(N, H, V) as a PPO micro-batch (B, T, H, V) of 4 rows (1 when N is not a multiple of 4)."""
    N, H, V = linear_shape
    B = 4 if N % 4 == 0 else 1
    return B, N // B, H, V


#: B = 512 prompts x 8 responses (group_advantages.GROUP_SIZE), T = 256.
GROUP_SHAPE = {"full": (4096, 256), "quick": (4096, 256), "tiny": (16, 8)}


def _op_cases(logits_shape, bt_shape, linear_shape, group_shape, with_targets: bool) -> list[Case]:
    t = (lambda *xs: xs) if with_targets else (lambda *xs: ())
    gl, lp = gather_logprobs, linear_ppo_loss
    return [
        gl.fwd(logits_shape, F32, targets=t(gl.SPEED, gl.NEAR_FLOOR, gl.NO_TEMPORARY)),
        gl.fwd(logits_shape, F32, eager_name="trl selective_log_softmax"),
        gl.fwd_entropy(logits_shape, F32),
        gl.fwd(logits_shape, BF16, targets=t(gl.SPEED, gl.NEAR_FLOOR, gl.NO_TEMPORARY)),
        gl.fwd(logits_shape, BF16, eager_name="trl selective_log_softmax"),
        gl.fwd_bwd(logits_shape, F32, targets=t(gl.FWD_BWD_SPEED)),
        linear_logprobs.fwd_bwd(linear_shape, F32),
        lp.fwd_bwd(_ppo_shape(linear_shape), F32, targets=t(lp.SPEED, lp.MEMORY)),
        lp.fwd_bwd(_ppo_shape(linear_shape), F32, eager_name="pyppo linear_logprobs + ppo_policy_loss"),
        kl.kl_penalty_case(bt_shape, F32, "k3"),
        kl.shape_rewards_case(bt_shape, F32),
        gae.case(bt_shape, F32, targets=t(gae.VS_LOOP)),
        gae.case(bt_shape, F32, eager_name="trl loop"),
        turn_gae.case(bt_shape, F32, targets=t(turn_gae.VS_LOOP)),
        turn_gae.case(bt_shape, F32, eager_name="pyppo gae (token level)"),
        masked.masked_whiten_case(bt_shape, F32),
        *group_advantages.cases(group_shape, F32, with_targets=with_targets),
    ]


def _sweeps(logits_lead: tuple[int, int], vs: list[int], B: int, ts: list[int]) -> list[Sweep]:
    sweeps = [Sweep("gather_logprobs fwd fp32", "V", [gather_logprobs.fwd((*logits_lead, v), F32) for v in vs], vs)]
    for name, make in (
        ("gae (holes) fp32", gae.case),
        ("turn_gae fp32", turn_gae.case),
        ("shape_rewards fp32", kl.shape_rewards_case),
        ("masked_whiten fp32", masked.masked_whiten_case),
    ):
        sweeps.append(Sweep(name, "T", [make((B, t), F32) for t in ts], ts))
    return sweeps


def _ops(sizes: str) -> Suite:
    if sizes == "full":
        return Suite(
            "ops",
            _op_cases((4, 512, 49152), (64, 1024), (2048, 576, 49152), GROUP_SHAPE[sizes], True),
            _TIMING[sizes],
            _sweeps(
                (4, 512), [4096, 16384, 32768, 49152, 65536, 131072, 152064], 64, [64, 128, 256, 512, 1024, 2048, 4096]
            ),
        )
    if sizes == "quick":
        return Suite(
            "ops",
            _op_cases((4, 512, 49152), (64, 1024), (1024, 576, 49152), GROUP_SHAPE[sizes], True),
            _TIMING[sizes],
            _sweeps((2, 256), [4096, 32768, 131072], 64, [128, 512, 2048]),
        )
    return Suite(
        "ops",
        _op_cases((2, 8, 1000), (4, 32), (16, 8, 1000), GROUP_SHAPE[sizes], False),
        _TIMING[sizes],
        _sweeps((2, 8), [256, 1024], 4, [16, 64]),
    )


def _gpu(sizes: str) -> Suite:
    gl = gather_logprobs
    big = sizes != "tiny"
    logits, bt, linear = (
        ((4, 512, 49152), (256, 4096), (8192, 576, 49152)) if big else ((2, 8, 1000), (4, 32), (16, 8, 1000))
    )
    t = (lambda *xs: xs) if big else (lambda *xs: ())
    cases = []
    for dtype in (F32, BF16):
        cases.append(gl.fwd(logits, dtype, floor="copy", targets=t(gl.COPY_BANDWIDTH)))
        cases.append(
            gl.fwd(
                logits, dtype, eager_name="trl selective_log_softmax", floor="copy", targets=t(gl.NOT_SLOWER_THAN_TRL)
            )
        )
    cases += [
        gl.fwd_entropy(logits, F32),
        gl.fwd_bwd(logits, F32),
        linear_logprobs.fwd_bwd(linear, F32),
        linear_ppo_loss.fwd_bwd(_ppo_shape(linear), F32),
        kl.kl_penalty_case(bt, F32, "k3"),
        kl.shape_rewards_case(bt, F32),
        gae.case(bt, F32, targets=t(gae.VS_LOOP)),
        # one thread per row, not yet timed on a GPU: no target
        turn_gae.case(bt, F32),
        turn_gae.case(bt, F32, eager_name="pyppo gae (token level)"),
        masked.masked_whiten_case(bt, F32),
        group_advantages.grpo_case(GROUP_SHAPE[sizes], F32, targets=t(group_advantages.VS_LOOP)),
        group_advantages.grpo_case(GROUP_SHAPE[sizes], F32, vectorized=True),
    ]
    timing = {"full": Timing(3, 10, 100, 2.0), "quick": Timing(2, 5, 30, 0.5), "tiny": _TIMING["tiny"]}[sizes]
    return Suite("gpu", cases, timing, cuda_only=True)


def _memory(sizes: str) -> Suite:
    gl = gather_logprobs
    if sizes == "tiny":
        ns, logits, H, V = [16, 64], (2, 8, 1000), 8, 1000
    else:
        ns, logits, H, V = ([2048, 8192] if sizes == "full" else [256, 1024]), (4, 512, 49152), 576, 49152
    cases = [linear_logprobs.fwd((ns[-1], H, V), F32)]
    cases += [linear_logprobs.fwd_bwd((n, H, V), F32) for n in ns]
    cases += [linear_ppo_loss.fwd_bwd(_ppo_shape((ns[-1], H, V)), F32)]
    cases += [gl.fwd(logits, F32), gl.fwd_bwd(logits, F32)]
    # Few rounds: peak memory is the point, and on a CPU the eager path at N = 8192 takes
    # seconds a call.
    timing = _TIMING["tiny"] if sizes == "tiny" else Timing(1, 1, 5, 1.0)
    return Suite("memory", cases, timing)


SUITES = {"ops": _ops, "gpu": _gpu, "memory": _memory}


def suite(name: str, sizes: str) -> Suite:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    if sizes not in SIZES:
        raise ValueError(f"sizes must be one of {', '.join(SIZES)}, got {sizes!r}")
    return SUITES[name](sizes)
