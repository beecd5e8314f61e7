"""shape_rewards against OpenRLHF's experience-maker chain (``compute_approx_kl`` then
``compute_reward``)."""

from __future__ import annotations

from pyppo.ops import shape_rewards

from .. import eager
from ..case import Case
from .bt import bt_case

KL_COEF = 0.05


def case(shape, dtype) -> Case:
    return bt_case(
        "shape_rewards", "shape_rewards k1", "openrlhf compute_reward", shape, dtype,
        reads=("scores", "logprobs", "ref_logprobs", "mask"), tol=1e-5,
        pyppo=lambda inp: shape_rewards(inp["scores"], inp["logprobs"], inp["ref_logprobs"], inp["mask"],
                                        kl_coef=KL_COEF),
        eager=lambda inp: eager.shape_rewards(inp["scores"], inp["logprobs"], inp["ref_logprobs"], inp["mask"],
                                              KL_COEF),
    )
