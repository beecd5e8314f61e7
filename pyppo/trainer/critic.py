"""The value model's share of a PPO step (the critic of actor-critic PPO), kept apart from the
policy's so that a critic-free estimator (``grpo``, ``rloo``, ``reinforce_pp*``) builds none: no
value model is loaded, trained, checkpointed or exported, and no value metric is logged.

:class:`Critic` is what the trainer calls for the value model at points 4 and 6 of a step
(``docs/trainer.md``): its rollout values, its clipped value loss and backward, its optimizer.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Tuple

import torch
from torch import nn

from .. import distributed
from ..config import PPOConfig
from ..ops.losses import ppo_value_loss
from ..precision import autocast
from .buffer import RolloutBuffer
from .logprob_head import response_values

__all__ = ["Critic"]


class Critic:
    """The value model of a run, as a step uses it: the only holder of the value model, its
    wrapped module and its optimizer (the trainer reaches them as ``trainer.critic.model``,
    ``.module``, ``.optimizer``).

    Args:
        model: the value model, ``forward(input_ids, attention_mask, position_ids) -> [B, L]``.
        module: ``model`` as the forwards call it (DDP- or FSDP2-wrapped under ``torchrun``).
        optimizer: its AdamW.
        config: the run's config (``vf_coef``, ``cliprange_value``, ``loss_agg``,
            ``effective_value_lr``).
    """

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: PPOConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.model, self.module, self.optimizer, self.config = model, module, optimizer, config
        self.device, self.dtype = device, dtype

    def train(self, mode: bool = True) -> None:
        """The value model in training (``True``) or eval mode."""
        self.model.train(mode)

    def zero_grad(self) -> None:
        """Free the value model's gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def values(self, mb: RolloutBuffer) -> torch.Tensor:
        """``[b, T]`` float32 values of ``mb``'s response positions (:func:`response_values`);
        under the caller's autocast and grad mode."""
        return response_values(self.module, mb)

    def loss_backward(
        self, mu: RolloutBuffer, normalizer: float
    ) -> Tuple[float, Dict[str, torch.Tensor], torch.Tensor]:
        """Forward the value model on a micro-batch (under the trainer's autocast), then backward
        ``vf_coef`` times its clipped value loss (:func:`pyppo.ops.ppo_value_loss` over the
        micro-batch's ``critic_mask``, divided by the minibatch's ``normalizer``, the count of
        that mask). Returns ``(value_loss, its token statistics, values [b, T] detached)``."""
        c = self.config
        with autocast(self.device, self.dtype):
            values = self.values(mu)
        vf_loss, vf_stats = ppo_value_loss(
            values,
            mu.values,
            mu.returns,
            mu.critic_mask,
            cliprange_value=c.cliprange_value,
            loss_agg=c.loss_agg,
            loss_agg_norm=c.effective_loss_agg_norm,
            normalizer=normalizer,
        )
        (c.vf_coef * vf_loss).backward()
        return float(vf_loss.detach()), vf_stats, values.detach()

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """:func:`pyppo.distributed.gradient_sync` of the value model's module."""
        return distributed.gradient_sync(self.module, enabled)

    def set_lr_scale(self, scale: float) -> None:
        """The next optimizer step's learning rate: ``effective_value_lr * scale`` (the warm-up)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.effective_value_lr * scale

    def step(self) -> None:
        """One AdamW step of the value model."""
        self.optimizer.step()
