"""Eager PPO policy loss from hidden states: the full-logits path a PPO trainer runs today."""

from __future__ import annotations

import torch


def linear_ppo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 0.2,
) -> torch.Tensor:
    """``lm_head`` logits, ``log_softmax().gather()``, then veRL's ``compute_policy_loss_vanilla``
    (``verl/trainer/ppo/core_algos.py``) without its dual clip: the log-ratio clamped to ±20, the
    clipped surrogate, a token mean over ``response_mask``. Autograd keeps the ``[B, T, V]`` logits'
    log-softmax for the backward and materialises its gradient there."""
    logits = hidden @ weight.T
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -20.0, 20.0))
    pg_losses = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange))
    m = response_mask.to(pg_losses.dtype)
    return (pg_losses * m).sum() / m.sum()
