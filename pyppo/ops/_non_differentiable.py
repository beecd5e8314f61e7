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


def register_once_differentiable(*qualnames: str) -> None:
    """Make differentiating a backward operator an error instead of a silent zero.

    The gradient kernels (``*_backward``) have no derivative of their own; without an autograd
    registration, ``create_graph=True`` would record nothing and a second derivative (e.g.
    ``torch.autograd.gradgradcheck``, Hessian-vector products) would come back as zeros.
    """

    for name in qualnames:

        def _raise(ctx, *grads, _name=name):
            raise RuntimeError(
                f"{_name} is not differentiable: pyppo's ops support first derivatives only "
                "(backward with create_graph=True, then a second backward, is not supported)"
            )

        torch.library.register_autograd(name, _raise, setup_context=lambda ctx, inputs, output: None)
