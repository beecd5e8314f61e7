"""gae against the reversed Python loop over T that veRL and TRL run."""

from __future__ import annotations

from pyppo.ops import gae

from .. import eager
from ..case import Case, Target
from .bt import bt_case

GAMMA, LAM = 1.0, 0.95

#: A loop over T launches a few ops per time step; one kernel over the whole batch should
#: leave it far behind, on masks with holes too.
VS_LOOP = Target("gae with holes >= 100x the Python loop", "speedup", ">=", 100.0)

LOOPS = {"verl loop": eager.gae_loop, "trl loop": eager.gae_loop_trl}


def case(shape, dtype, *, eager_name: str = "verl loop", targets: tuple[Target, ...] = ()) -> Case:
    loop = LOOPS[eager_name]
    return bt_case(
        "gae",
        "gae (mask with holes)",
        eager_name,
        shape,
        dtype,
        reads=("rewards", "values", "mask"),
        tol=1e-4,
        targets=targets,
        pyppo=lambda inp: gae(inp["rewards"], inp["values"], inp["mask"], gamma=GAMMA, lam=LAM),
        eager=lambda inp: loop(inp["rewards"], inp["values"], inp["mask"], GAMMA, LAM),
        # TRL's loop does not skip holes: check pyppo against the hole-aware veRL loop.
        compare_eager=lambda inp: eager.gae_loop(inp["rewards"], inp["values"], inp["mask"], GAMMA, LAM),
    )
