"""The PPO hot paths as torch custom operators (``torch.ops.pyppo.*``).

Each function here wraps one compiled operator with keyword arguments and documentation; the
fake (meta) kernels that let ``torch.compile`` trace them and their autograd formulas are
registered next to each wrapper.
"""

from ._non_differentiable import register_non_differentiable, register_once_differentiable
from .gae import gae
from .gather_logprobs import gather_logprobs
from .kl import KL_ESTIMATORS, kl_penalty, shape_rewards
from .linear_logprobs import linear_logprobs
from .masked import masked_mean, masked_var, masked_whiten

# Outputs that PPO treats as constants: marked non-differentiable rather than left without an
# autograd kernel, so a requires_grad input gives a clean constant, not a deprecation warning.
register_non_differentiable("pyppo::gae", "pyppo::shape_rewards", "pyppo::masked_var", "pyppo::masked_whiten")
register_once_differentiable(
    "pyppo::gather_logprobs_backward", "pyppo::kl_penalty_backward", "pyppo::linear_logprobs_backward"
)

try:  # written by the trainer side; plain torch on top of the compiled ops
    from .losses import LOSS_AGG_MODES, aggregate_loss, ppo_policy_loss, ppo_value_loss
except ImportError:  # pragma: no cover
    pass

__all__ = [
    "gather_logprobs",
    "linear_logprobs",
    "kl_penalty",
    "shape_rewards",
    "gae",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "ppo_value_loss",
    "aggregate_loss",
    "KL_ESTIMATORS",
]
