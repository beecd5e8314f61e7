"""The KL family against OpenRLHF: ``kl_penalty`` against ``compute_approx_kl`` (a chain of
elementwise ops), ``shape_rewards`` against the experience-maker chain (``compute_approx_kl``
then ``compute_reward``)."""

from __future__ import annotations

from pyppo import ops

from .. import eager
from ..case import Case
from .bt import bt_case

CLAMP = (-10.0, 10.0)  # OpenRLHF's clamp
KL_COEF = 0.05


def kl_penalty_case(shape, dtype, estimator: str = "k3") -> Case:
    return bt_case(
        "kl_penalty",
        f"kl_penalty {estimator}",
        "openrlhf compute_approx_kl",
        shape,
        dtype,
        reads=("logprobs", "ref_logprobs"),
        tol=1e-5,
        pyppo=lambda inp: ops.kl_penalty(inp["logprobs"], inp["ref_logprobs"], estimator=estimator, clamp=CLAMP),
        eager=lambda inp: eager.compute_approx_kl(inp["logprobs"], inp["ref_logprobs"], estimator, clamp=CLAMP),
    )


def shape_rewards_case(shape, dtype) -> Case:
    return bt_case(
        "shape_rewards",
        "shape_rewards k1",
        "openrlhf compute_reward",
        shape,
        dtype,
        reads=("scores", "logprobs", "ref_logprobs", "mask"),
        tol=1e-5,
        pyppo=lambda inp: ops.shape_rewards(
            inp["scores"], inp["logprobs"], inp["ref_logprobs"], inp["mask"], kl_coef=KL_COEF
        ),
        eager=lambda inp: eager.shape_rewards(
            inp["scores"], inp["logprobs"], inp["ref_logprobs"], inp["mask"], KL_COEF
        ),
    )
