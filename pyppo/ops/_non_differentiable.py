"""Autograd registration for the operators whose outputs are constants of the PPO update."""

from __future__ import annotations

import torch


def _setup_context(ctx, inputs, output):
    outs = output if isinstance(output, tuple) else (output,)
    ctx.mark_non_differentiable(*outs)
    ctx.n_inputs = len(inputs)


def _backward(ctx, *grads):
    return (None,) * ctx.n_inputs


def register_non_differentiable(*qualnames: str) -> None:
    """Mark every output of each operator non-differentiable (``requires_grad=False``).

    GAE advantages and returns, shaped rewards and whitened advantages are constants in PPO
    (Schulman et al. 2017, §5): gradients never flow through them.
    """
    for name in qualnames:
        torch.library.register_autograd(name, _backward, setup_context=_setup_context)
