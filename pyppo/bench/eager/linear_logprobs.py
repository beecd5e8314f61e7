"""Eager log-probs from hidden states: the full-logits path every PPO trainer runs today."""

from __future__ import annotations

import torch

from .gather_logprobs import logsoftmax_gather


def linear_logsoftmax_gather(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T).gather(labels)``: the model's ``lm_head`` materialises
    ``[N, V]`` logits, ``log_softmax`` a second copy, and autograd keeps both for the backward."""
    return logsoftmax_gather(hidden @ weight.T, labels)
