"""Eager-PyTorch references: what a user of TRL / OpenRLHF / veRL computes today.

One module per op family, named as its ``pyppo/ops`` module. Each function mirrors the peers'
formulas (cited in its docstring), with the one change needed to compare outputs with pyppo's
ops: positions pyppo defines as 0 (masked) are zeroed the way those trainers zero them afterwards
(``masked_fill`` / ``* mask``).
"""

from .gae import gae_loop, gae_loop_trl
from .gather_logprobs import logprobs_and_entropy, logsoftmax_gather, selective_log_softmax
from .group_advantages import verl_grpo, verl_grpo_vectorized, verl_reinforce_pp_baseline, verl_rloo
from .kl import compute_approx_kl, compute_reward, shape_rewards
from .linear_logprobs import linear_logsoftmax_gather
from .linear_ppo_loss import linear_ppo_loss
from .masked import masked_mean, masked_var, masked_whiten, masked_whiten_fill
from .turn_gae import turn_gae_loop

__all__ = [
    "logsoftmax_gather",
    "selective_log_softmax",
    "logprobs_and_entropy",
    "linear_logsoftmax_gather",
    "linear_ppo_loss",
    "gae_loop",
    "gae_loop_trl",
    "turn_gae_loop",
    "verl_grpo",
    "verl_grpo_vectorized",
    "verl_rloo",
    "verl_reinforce_pp_baseline",
    "compute_approx_kl",
    "compute_reward",
    "shape_rewards",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "masked_whiten_fill",
]
