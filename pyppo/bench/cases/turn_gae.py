"""turn_gae against a Python loop over the turns (:mod:`pyppo.bench.eager.turn_gae`), and against
token-level ``gae`` over the agent tokens of the same ``[B, T]`` (what a turn costs next to a token).

Inputs: rows of agent turns (8 to 64 tokens) and environment spans (8 to 64 tokens) alternating,
then right padding; ``turn_ids`` numbers each row's turns, -1 elsewhere.
"""

from __future__ import annotations

import torch

from pyppo.ops import gae, turn_gae

from .. import eager
from ..case import Case, Inputs, Target
from ..floors import sum_each
from ..inputs import nbytes

GAMMA, LAM = 1.0, 0.95

#: The eager path loops over the turns with a few [B] ops each; one kernel over the batch should
#: leave it far behind.
VS_LOOP = Target("turn_gae >= 10x the Python loop over turns", "speedup", ">=", 10.0)


def turn_inputs(shape, dtype, device, seed) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    B, T = shape
    ids = torch.full((B, T), -1, dtype=torch.int64)
    lengths = torch.randint(max(1, T // 4), T + 1, (B,), generator=g).tolist()
    spans = torch.randint(8, 65, (B, T // 16 + 1, 2), generator=g).tolist()  # (agent, environment) lengths
    for b in range(B):
        t = 0
        for k, (n, gap) in enumerate(spans[b]):
            if t >= lengths[b]:
                break
            ids[b, t : min(t + n, lengths[b])] = k
            t += n + gap
    inp = {
        "rewards": (0.1 * torch.randn(B, T, generator=g)).to(dtype),
        "values": torch.randn(B, T, generator=g).to(dtype),
        "turn_ids": ids,
        "mask": ids >= 0,
    }
    return {k: v.to(device) for k, v in inp.items()}


def _pyppo(inp: Inputs):
    return turn_gae(inp["rewards"], inp["values"], inp["turn_ids"], gamma=GAMMA, lam=LAM)


def _loop(inp: Inputs):
    return eager.turn_gae_loop(inp["rewards"], inp["values"], inp["turn_ids"], GAMMA, LAM)


def _token_gae(inp: Inputs):
    return gae(inp["rewards"], inp["values"], inp["mask"], gamma=GAMMA, lam=LAM)


EAGER = {"python turn loop": _loop, "pyppo gae (token level)": _token_gae}


def case(shape, dtype, *, eager_name: str = "python turn loop", targets: tuple[Target, ...] = ()) -> Case:
    return Case(
        op="turn_gae",
        label="turn_gae (agent turns)",
        shape=tuple(shape),
        dtype=dtype,
        make_inputs=turn_inputs,
        eager_name=eager_name,
        pyppo=_pyppo,
        eager=EAGER[eager_name],
        floor=sum_each("rewards", "values", "turn_ids"),
        floor_name="sum of each input",
        tol=1e-4,
        input_bytes=nbytes("rewards", "values", "turn_ids"),
        targets=tuple(targets),
        # token-level gae computes another quantity: check against the loop over turns.
        compare_eager=_loop,
    )
