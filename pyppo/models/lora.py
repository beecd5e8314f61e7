"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") with
``peft``: ``W x + (alpha / r) · B A x``, only ``A`` and ``B`` trained.

The adapters' dropout is 0: with dropout the rollout's log-probs (eval mode) and the training
forward's (train mode) would differ, and the first PPO ratio would no longer be exactly 1. ``B``
starts at 0 (peft's default), so the adapted model starts equal to its base and the reference, the
same model with its adapters disabled, gives a step-1 KL of exactly 0.
"""

from __future__ import annotations

import warnings

from torch import nn

__all__ = ["add_lora", "is_lora", "target_modules"]


def target_modules(spec: str):
    """``PPOConfig.lora_target_modules`` as peft takes it: ``"all-linear"`` (every linear layer
    but the output head) or a list of module names."""
    return spec if spec == "all-linear" else [name.strip() for name in spec.split(",") if name.strip()]


def add_lora(model: nn.Module, *, rank: int, alpha: float, targets: str) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with rank-``rank`` LoRA adapters on ``targets``;
    every other weight is frozen. Works on a causal LM (the policy) and on a bare backbone (the
    value model's).

    Raises:
        ImportError: ``peft`` is not installed (the message gives the pip command).
        ValueError: ``rank < 1``, or ``targets`` matches no module of ``model``.
    """
    if rank < 1:
        raise ValueError(f"lora_rank must be >= 1 to add adapters, got {rank}")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is a dependency
        raise ImportError("LoRA needs peft: pip install peft") from exc
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=target_modules(targets), bias="none")
    try:
        with warnings.catch_warnings():
            # peft asks transformers a deprecated question about checkpointing; nothing for the user.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        raise ValueError(f"lora_target_modules {targets!r}: {exc}") from None


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft`` model (so it has adapters to disable)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)
