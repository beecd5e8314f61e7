"""kl_penalty against OpenRLHF's ``compute_approx_kl`` (a chain of elementwise ops)."""

from __future__ import annotations

from pyppo.ops import kl_penalty

from .. import eager
from ..case import Case
from .bt import bt_case

CLAMP = (-10.0, 10.0)  # OpenRLHF's clamp


def case(shape, dtype, estimator: str = "k3") -> Case:
    return bt_case(
        "kl_penalty", f"kl_penalty {estimator}", "openrlhf compute_approx_kl", shape, dtype,
        reads=("logprobs", "ref_logprobs"), tol=1e-5,
        pyppo=lambda inp: kl_penalty(inp["logprobs"], inp["ref_logprobs"], estimator=estimator, clamp=CLAMP),
        eager=lambda inp: eager.compute_approx_kl(inp["logprobs"], inp["ref_logprobs"], estimator, clamp=CLAMP),
    )
