"""Autograd registration for the operators whose outputs are constants of the PPO update, and
for the gradients that must not be differentiated again."""

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

    GAE and group-relative advantages, returns, shaped rewards and whitened advantages are
    constants in PPO (Schulman et al. 2017, §5) and GRPO: gradients never flow through them.
    """
    for name in qualnames:
        torch.library.register_autograd(name, _backward, setup_context=_setup_context)


def _second_derivative_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"{name} is not differentiable: pyppo's ops support first derivatives only "
        "(backward with create_graph=True, then a second backward, is not supported)"
    )


def register_once_differentiable(*qualnames: str) -> None:
    """Make differentiating a backward operator an error instead of a silent zero.

    The gradient kernels (``*_backward``) have no derivative of their own; without an autograd
    registration, ``create_graph=True`` would record nothing and a second derivative (e.g.
    ``torch.autograd.gradgradcheck``, Hessian-vector products) would come back as zeros.
    """

    for name in qualnames:

        def _raise(ctx, *grads, _name=name):
            raise _second_derivative_error(_name)

        torch.library.register_autograd(name, _raise, setup_context=lambda ctx, inputs, output: None)


class _FirstDerivativeOnly(torch.autograd.Function):
    # The identity on a gradient, made a function of the op's input too, whose own backward
    # raises: the second derivative of an op whose backward is plain torch fails as those of the
    # compiled backward operators do, instead of being whatever autograd makes of the formula.
    @staticmethod
    def forward(ctx, grad, name, graph_input):
        ctx.name = name
        return grad.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise _second_derivative_error(ctx.name)


def first_derivative_only(name: str, grad: torch.Tensor, graph_input: torch.Tensor) -> torch.Tensor:
    """``grad``, which a second backward (through ``grad`` or ``graph_input``) refuses to differentiate.

    For an autograd formula written in torch ops. It costs nothing in an ordinary backward,
    which runs without grad mode; only ``create_graph=True`` records the node.
    """
    if not torch.is_grad_enabled():
        return grad
    return _FirstDerivativeOnly.apply(grad, name, graph_input)
