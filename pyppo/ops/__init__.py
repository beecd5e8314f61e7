"""The PPO hot paths as torch custom operators (``torch.ops.pyppo.*``).

One module per op family (``kl``: ``kl_penalty`` and ``shape_rewards``; ``masked``: ``masked_mean``,
``masked_var`` and ``masked_whiten``; one op each for the others), named as the family's files in
``csrc/`` (CONTRIBUTING.md lists them). Each function wraps one compiled operator with keyword
arguments and documentation; its autograd formula is registered next to the wrapper
(``losses`` is plain PyTorch). Semantics, shapes and formulas: ``docs/ops.md``.

There are no Python fake kernels. ``torch.compile`` and ``FakeTensorMode`` trace the operators
through C++ fake kernels registered for the Meta device (``csrc/meta/<family>_fake.cpp``), which
run the same argument checks as the CPU and CUDA kernels (``csrc/checks/<family>.h``) and
allocate the outputs: a bad input raises the same exception with the same message on every path,
and no message is written twice.
"""

from ._non_differentiable import register_non_differentiable, register_once_differentiable
from .gae import gae, length_adaptive_lam
from .gather_logprobs import gather_logprobs
from .group_advantages import GROUP_ESTIMATORS, group_advantages
from .kl import KL_ESTIMATORS, kl_penalty, shape_rewards
from .linear_logprobs import linear_logprobs
from .linear_ppo_loss import linear_ppo_loss
from .losses import LOSS_AGG_MODES, aggregate_loss, loss_token_weights, ppo_policy_loss, ppo_value_loss
from .masked import masked_mean, masked_var, masked_whiten
from .policy_losses import POLICY_LOSSES, cispo_policy_loss, gspo_policy_loss
from .turn_gae import turn_gae, turn_start_mask

# Outputs that PPO treats as constants: marked non-differentiable rather than left without an
# autograd kernel, so a requires_grad input gives a clean constant, not a deprecation warning.
# group_advantages' two overloads get the same kernel in C++ (csrc/ops.cpp: it is called on small
# inputs, where the Python kernel's round trip was a fifth of its time).
register_non_differentiable(
    "pyppo::gae", "pyppo::turn_gae", "pyppo::shape_rewards", "pyppo::masked_var", "pyppo::masked_whiten"
)
register_once_differentiable(
    "pyppo::gather_logprobs_backward", "pyppo::kl_penalty_backward", "pyppo::linear_logprobs_backward"
)


__all__ = [
    "gather_logprobs",
    "linear_logprobs",
    "linear_ppo_loss",
    "kl_penalty",
    "shape_rewards",
    "gae",
    "length_adaptive_lam",
    "turn_gae",
    "turn_start_mask",
    "group_advantages",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "cispo_policy_loss",
    "ppo_value_loss",
    "aggregate_loss",
    "loss_token_weights",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "POLICY_LOSSES",
]
