"""Putting a trainer together: the models as a config asks (reference, value model, LoRA,
dropout, checkpointing), their log-prob heads and distributed wrappers, the optimizers, the
tokenizer's padding, and the checks of the trainer's arguments."""

from __future__ import annotations

import copy
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
from torch import nn

from .. import distributed
from ..config import PPOConfig
from ..models import ValueModel, add_lora, make_reference, share_frozen_weights
from ..prompts import prompt_columns, prompt_fields
from ..rewards import SequenceClassifierReward, check_reward_fields
from ..rollout.tokens import check_prompt_lengths, prompt_token_limit
from ..run.export import check_exportable
from .logprob_head import AdaptersDisabled, LogprobHead

__all__ = ["check_arguments", "check_lora_exportable", "check_prompt_sets", "check_trainable", "disable_dropout",
           "enable_gradient_checkpointing", "logprob_modules", "make_adamw", "prepare_models", "prepare_tokenizer",
           "share_reward_weights"]

RewardFn = Callable[[List[str], List[str]], Sequence[float]]


def check_arguments(config: PPOConfig, ref_policy: Optional[nn.Module], tokenizer: Any, reward_fn: RewardFn,
                    eval_prompts: Optional[Sequence[Any]]) -> None:
    """The checks of :class:`~pyppo.trainer.PPOTrainer`'s arguments that need no model.

    Raises:
        ValueError: naming the bad argument.
    """
    if not isinstance(config, PPOConfig):
        raise ValueError(f"config must be a PPOConfig, got {type(config).__name__}")
    if not callable(reward_fn):
        raise ValueError("reward_fn must be callable (prompts, responses) -> scores")
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("tokenizer must have an eos_token_id")
    if config.lora_rank and ref_policy is not None:
        raise ValueError("ref_policy must be None with lora_rank > 0: the reference is the policy with its "
                         "adapters disabled")
    if config.eval_every and not eval_prompts:
        raise ValueError(f"eval_every = {config.eval_every} needs eval_prompts (a non-empty list of prompts)")
    if eval_prompts is not None and not all(
            isinstance(p, str) or (isinstance(p, Mapping) and isinstance(p.get("prompt"), str)) for p in eval_prompts):
        raise ValueError("eval_prompts must be a list of strings, or of records {'prompt': str, ...}")


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Left padding (prompts end where responses start); a missing pad token is taken to be EOS
    (padding is masked out everywhere)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def logprob_modules(c: PPOConfig, policy: nn.Module, ref_policy: Optional[nn.Module], value_model: Optional[nn.Module],
                    world: distributed.World, dtype: torch.dtype) -> dict:
    """The forwards of a step: ``policy_logprobs`` (the policy's :class:`LogprobHead`),
    ``policy_module`` and ``value_module`` (those DDP- or FSDP2-wrapped under torchrun),
    ``ref_logprobs`` (the reference's head, or the policy's with its adapters disabled under
    LoRA) and ``export_replica`` (FSDP2: rank 0's weightless copy of the policy's structure, to
    gather the weights into when exporting; else ``None``)."""
    head = LogprobHead(policy, temperature=c.temperature, from_hidden=c.logprobs_from_hidden, dtype=dtype)
    # FSDP2 shards the policy in place: the replica is taken before.
    replica = copy.deepcopy(policy).to("meta") if c.fsdp and world.active and world.is_main else None
    policy_module = distributed.wrap(head, world, fsdp=c.fsdp)
    value_module = distributed.wrap(value_model, world, fsdp=c.fsdp) if value_model is not None else None
    ref = (AdaptersDisabled(policy_module, head) if c.lora_rank else
           LogprobHead(ref_policy, temperature=c.temperature, from_hidden=c.logprobs_from_hidden, dtype=dtype))
    return {"policy_logprobs": head, "policy_module": policy_module, "value_module": value_module,
            "ref_logprobs": ref, "export_replica": replica}


def prepare_models(c: PPOConfig, policy: nn.Module, ref_policy: Optional[nn.Module], value_model: Optional[nn.Module],
                   device: torch.device) -> tuple:
    """``(policy, reference or None, value model or None)`` on ``device``, as ``c`` asks: the
    reference a frozen copy of the policy (none with LoRA: the adapters are disabled instead), the
    value model a copy of the policy's backbone with a scalar head (taken before any adapter is
    added; none for a critic-free ``advantage_estimator``), LoRA, dropout off, gradient
    checkpointing.

    Raises:
        ValueError: a ``value_model`` given to a critic-free estimator, which would not train it.
        ValueError: ``value_lora`` without a value model that has a ``.backbone``; a model that
            cannot checkpoint; ``lora_target_modules`` matching nothing.
    """
    policy = policy.to(device)
    ref = None
    if not c.lora_rank:
        ref = (ref_policy if ref_policy is not None else make_reference(policy)).to(device)
        ref.requires_grad_(False).eval()
    if not c.uses_critic:
        if value_model is not None:
            raise ValueError(f"value_model: advantage_estimator = {c.advantage_estimator!r} trains no value model; "
                             "pass value_model=None")
    else:
        value_model = (value_model if value_model is not None else ValueModel.from_causal_lm(policy)).to(device)
    if c.lora_rank:
        policy = add_lora(policy, rank=c.lora_rank, alpha=c.lora_alpha, targets=c.lora_target_modules)
    if c.value_lora:
        if not isinstance(getattr(value_model, "backbone", None), nn.Module):
            raise ValueError("value_lora needs a value model with a .backbone module (a pyppo ValueModel)")
        value_model.backbone = add_lora(value_model.backbone, rank=c.lora_rank, alpha=c.lora_alpha,
                                        targets=c.lora_target_modules)
    if c.disable_dropout:
        disable_dropout(policy)
        if value_model is not None:
            disable_dropout(value_model)
    if c.gradient_checkpointing:
        enable_gradient_checkpointing(policy, "policy")
        if value_model is not None:
            enable_gradient_checkpointing(getattr(value_model, "backbone", value_model), "value model")
    return policy, ref, value_model


def check_trainable(policy: nn.Module, value_model: Optional[nn.Module], c: PPOConfig) -> None:
    """Raises ValueError when the policy or the value model (if any) has no trainable parameter
    (LoRA targets that matched nothing)."""
    for what, model in (("policy", policy), ("value model", value_model)):
        if model is None:
            continue
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(f"the {what} has no trainable parameter (lora_target_modules = "
                             f"{c.lora_target_modules!r}, lora_rank = {c.lora_rank})")


def check_lora_exportable(policy: nn.Module, c: PPOConfig) -> None:
    """With LoRA, refuse now what :func:`pyppo.run.export.save_policy` would refuse after the last
    step (LoRA on a tied weight with ``merge_lora``, say), so that no run trains to the end and then
    cannot write its ``policy/``.

    Raises:
        ValueError: naming ``lora_target_modules`` and, where it helps, ``--no-merge-lora``.
    """
    if not c.lora_rank:
        return
    try:
        check_exportable(policy, merge_lora=c.merge_lora)
    except ValueError as exc:
        raise ValueError(f"lora_target_modules = {c.lora_target_modules!r}: the trained policy could not be "
                         f"exported: {exc}{' (--no-merge-lora)' if c.merge_lora else ''}") from None


def check_prompt_sets(c: PPOConfig, policy: nn.Module, tokenizer: Any, reward_fn: RewardFn,
                      sets: Mapping[str, Sequence[Any]]) -> Optional[int]:
    """Check, once and up front, every prompt set (``{"prompts": [...], "eval_prompts": [...]}``):
    the reward accepts its fields, and each prompt fits the context with ``max_new_tokens`` to
    spare (one that does not would make generation crawl past the model's positions).

    Returns:
        the prompt token limit of :func:`pyppo.rollout.tokens.prompt_token_limit`.

    Raises:
        ValueError: a field the reward lacks, or a prompt too long (naming the set).
    """
    limit, room = prompt_token_limit(policy, max_new_tokens=c.max_new_tokens, max_prompt_length=c.max_prompt_length)
    for what, records in sets.items():
        if records:  # no eval prompts: nothing to check
            check_reward_fields(reward_fn, prompt_fields(records), source=what)
        check_prompt_lengths(tokenizer, prompt_columns(records)[0], use_chat_template=c.use_chat_template, room=room,
                             max_new_tokens=c.max_new_tokens, max_prompt_length=c.max_prompt_length,
                             truncate=c.truncate_prompts, what=what)
    return limit


def make_adamw(model: nn.Module, lr: float, c: PPOConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters; the fused kernel where it applies (plain CPU
    or CUDA tensors): one pass over each parameter's state instead of the multi-tensor
    implementation's temporaries, each as large as the parameters (faster, and a smaller peak)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, eps=c.adam_eps, weight_decay=c.weight_decay, fused=fused or None)


def share_reward_weights(ref: Optional[nn.Module], reward_fn: RewardFn) -> int:
    """Bytes of a classifier reward model's weights now shared with the frozen reference (equal
    and frozen in both: :func:`pyppo.models.share_frozen_weights`); 0 for other rewards, or without
    a separate reference (LoRA)."""
    reward = getattr(reward_fn, "__wrapped__", reward_fn)  # load_reward's validating wrapper
    if ref is None or not isinstance(reward, SequenceClassifierReward):
        return 0
    return share_frozen_weights(ref, reward.model)


def enable_gradient_checkpointing(model: nn.Module, what: str) -> None:
    """Recompute ``model``'s block activations in the backward (transformers' own checkpointing,
    non-reentrant, so frozen inputs and LoRA need nothing more).

    Raises:
        ValueError: ``model`` is not a ``transformers`` model that supports it.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: the {what} ({type(model).__name__}) does not support it")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0 (modules and HF attention attributes)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # HF attention modules keep their dropout as a float applied only in train mode.
        for attr in ("attention_dropout", "attn_dropout", "dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
