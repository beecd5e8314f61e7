"""linear_ppo_loss (the PPO policy loss and its gradients from hidden states ``[B, T, H]`` and the
output embedding ``[V, H]``, fused) against the full-logits path every PPO trainer runs today,
and against pyppo's unfused path (``linear_logprobs`` + ``ppo_policy_loss``): forward+backward
of the update, w.r.t. hidden states and head."""

from __future__ import annotations

from pyppo.ops import linear_logprobs, linear_ppo_loss, ppo_policy_loss

from .. import eager, floors
from ..case import Case, Target
from ..inputs import linear_ppo_inputs, nbytes

# Three GEMMs (logits, grad_hidden, grad_weight) like the eager path's, and one pass over each
# chunk's logits instead of log_softmax, its backward and the gather's scatter over [N, V].
SPEED = Target("linear_ppo_loss fwd+bwd no slower than eager", "speedup", ">=", 1.0)
# The eager peak is the [N, V] logits' log-softmax and gradients; pyppo's is one chunk of
# logits and the gradients themselves. Both count grad_weight ([V, H]: 9% of the eager peak at
# SmolLM2's 2048 x 576 x 49152), so the 5% goal is out of reach of this accounting; the bound
# holds the design to one chunk and the gradients (21% there).
MEMORY = Target("linear_ppo_loss fwd+bwd peak <= 25% of eager's (goal 5%)", "memory_ratio", "<=", 0.25, goal=0.05)

_inputs_bytes = nbytes("hidden", "weight")


def _fused(inp):
    return linear_ppo_loss(
        inp["hidden"], inp["weight"], inp["labels"], inp["old_logprobs"], inp["advantages"], inp["response_mask"]
    )[0]


def _unfused(inp):
    lp = linear_logprobs(inp["hidden"], inp["weight"], inp["labels"], inp["response_mask"])
    return ppo_policy_loss(lp, inp["old_logprobs"], inp["advantages"], inp["response_mask"])[0]


def _eager(inp):
    return eager.linear_ppo_loss(
        inp["hidden"], inp["weight"], inp["labels"], inp["old_logprobs"], inp["advantages"], inp["response_mask"]
    )


EAGER = {
    "h @ W.T, log_softmax.gather, clipped surrogate, autograd": _eager,
    "pyppo linear_logprobs + ppo_policy_loss": _unfused,
}


def _fwd_bwd(loss_fn):
    def run(inp):
        h, w = inp["hidden"], inp["weight"]
        loss = loss_fn(inp)
        loss.backward()
        out = (loss.detach(), h.grad, w.grad)
        h.grad = w.grad = None
        return out

    return run


def _floor(inp):
    return floors.linear_gemms({"hidden": inp["hidden"].flatten(0, 1), "weight": inp["weight"]})


def fwd_bwd(shape, dtype, *, eager_name: str = next(iter(EAGER)), targets: tuple[Target, ...] = ()) -> Case:
    """``shape`` is ``(B, T, H, V)``."""
    return Case(
        op="linear_ppo_loss",
        label="linear_ppo_loss fwd+bwd",
        eager_name=eager_name,
        shape=tuple(shape),
        dtype=dtype,
        make_inputs=linear_ppo_inputs,
        pyppo=_fwd_bwd(_fused),
        eager=_fwd_bwd(EAGER[eager_name]),
        floor=_floor,
        floor_name="the 3 GEMMs alone",
        tol=1e-4,
        input_bytes=_inputs_bytes,
        targets=tuple(targets),
    )
