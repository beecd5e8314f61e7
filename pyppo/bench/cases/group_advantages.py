"""group_advantages against veRL's outcome estimators (:mod:`pyppo.bench.eager.group_advantages`):
GRPO (the Python loop veRL registers as ``grpo``, and its ``index_add_`` version), RLOO, and
REINFORCE++-baseline (pyppo: ``group_advantages`` then ``masked_whiten``).

Inputs: ``B / GROUP_SIZE`` prompts of ``GROUP_SIZE`` consecutive responses (veRL's rollout
layout), one score per response, a ``[B, T]`` mask with padding and holes. veRL gets what its
trainer has: ``token_level_rewards [B, T]`` holding the score at each row's last valid token and
``index``, one uid string per row; pyppo gets the scores and ``group_size``.
"""

from __future__ import annotations

import torch

from pyppo.ops import group_advantages, masked_whiten

from .. import eager
from ..case import Case, Inputs, Target
from ..floors import sum_each
from ..inputs import nbytes, response_mask

GROUP_SIZE = 8

#: veRL loops over the rows in Python: one kernel over the batch should leave it far behind
#: (64x measured on 1 thread of a loaded 2-core CPU; the bound leaves room for noise).
VS_LOOP = Target("group_advantages >= 30x veRL's Python loop", "speedup", ">=", 30.0)


def group_inputs(shape, dtype, device, seed) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    B, T = shape
    scores = torch.randn(B, generator=g).to(dtype)
    mask = response_mask(B, T, g)  # every row has a valid first position
    last = (mask * torch.arange(T)).argmax(1)
    rewards = torch.zeros(B, T, dtype=dtype)
    rewards[torch.arange(B), last] = scores
    # veRL's uids (a numpy array of strings there; a list here, as pyppo runs without numpy)
    index = [f"{seed}-{k:06d}" for k in range(B // GROUP_SIZE) for _ in range(GROUP_SIZE)]
    return {
        "scores": scores.to(device),
        "mask": mask.to(device),
        "token_level_rewards": rewards.to(device),
        "index": index,
    }


# Every row draws the same inputs, and its floor reads what pyppo's op reads.
_SHARED = {
    "op": "group_advantages",
    "make_inputs": group_inputs,
    "floor": sum_each("scores", "mask"),
    "floor_name": "sum of scores and mask",
    "tol": 1e-4,
    "input_bytes": nbytes("scores", "mask", "token_level_rewards"),
}


def _case(label: str, eager_name: str, shape, dtype, pyppo, verl_fn, targets=()) -> Case:
    """``verl_fn`` is called the way veRL's trainer calls its estimators."""
    return Case(
        **_SHARED,
        label=label,
        eager_name=eager_name,
        shape=tuple(shape),
        dtype=dtype,
        pyppo=pyppo,
        eager=lambda inp: verl_fn(inp["token_level_rewards"], inp["mask"], inp["index"]),
        targets=tuple(targets),
    )


def grpo_case(shape, dtype, *, vectorized: bool = False, targets: tuple[Target, ...] = ()) -> Case:
    if vectorized:
        name, fn = "verl compute_grpo_vectorized_outcome_advantage", eager.verl_grpo_vectorized
    else:
        name, fn = "verl compute_grpo_outcome_advantage", eager.verl_grpo
    return _case(
        "group_advantages grpo",
        name,
        shape,
        dtype,
        lambda inp: group_advantages(inp["scores"], inp["mask"], group_size=GROUP_SIZE),
        fn,
        targets,
    )


def rloo_case(shape, dtype) -> Case:
    return _case(
        "group_advantages rloo",
        "verl compute_rloo_outcome_advantage",
        shape,
        dtype,
        lambda inp: group_advantages(inp["scores"], inp["mask"], group_size=GROUP_SIZE, estimator="rloo"),
        eager.verl_rloo,
    )


def reinforce_pp_baseline_case(shape, dtype) -> Case:
    def pyppo(inp):
        adv = group_advantages(inp["scores"], inp["mask"], group_size=GROUP_SIZE, std_normalize=False)
        return masked_whiten(adv, inp["mask"])

    return _case(
        "group_advantages + masked_whiten",
        "verl compute_reinforce_plus_plus_baseline_outcome_advantage",
        shape,
        dtype,
        pyppo,
        eager.verl_reinforce_pp_baseline,
    )


def cases(shape, dtype, *, with_targets: bool = False) -> list[Case]:
    """Every row of the family: GRPO (loop and vectorized), RLOO, REINFORCE++-baseline."""
    return [
        grpo_case(shape, dtype, targets=(VS_LOOP,) if with_targets else ()),
        grpo_case(shape, dtype, vectorized=True),
        rloo_case(shape, dtype),
        reinforce_pp_baseline_case(shape, dtype),
    ]
