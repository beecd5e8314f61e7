"""Putting a trainer together: the models as a config asks (reference, value model, LoRA,
dropout, checkpointing), their log-prob heads and distributed wrappers, the value model's
optimizer and :class:`~pyppo.trainer.critic.Critic`, all in one frozen :class:`StepModels`
(:func:`assemble_models`); the policy's optimizer, the tokenizer's padding, and the checks of the
trainer's arguments."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from .. import distributed
from ..config import PPOConfig
from ..data.messages import is_prompt
from ..models import (
    ValueModel,
    add_lora,
    hold_linear_weights,
    load_model_and_tokenizer,
    make_reference,
    resolve_model_source,
    share_frozen_weights,
)
from ..models.export import check_exportable
from ..prompts import prompt_columns, prompt_fields
from ..reward_sum import reward_parts
from ..rewards import EPISODE_FIELDS, SequenceClassifierReward, check_reward_fields
from ..rollout.tokens import check_prompt_lengths, prompt_token_limit
from .critic import Critic
from .logprob_head import AdaptersDisabled, LogprobHead

__all__ = [
    "StepModels",
    "assemble_models",
    "check_arguments",
    "check_lora_exportable",
    "check_prompt_sets",
    "check_trainable",
    "disable_dropout",
    "enable_gradient_checkpointing",
    "load_policy",
    "make_adamw",
    "prepare_models",
    "prepare_tokenizer",
    "share_reward_weights",
]

RewardFn = Callable[[List[str], List[str]], Sequence[float]]
MaybeModel = Optional[nn.Module]


#: The knobs of multi-turn episodes, refused without an environment.
EPISODE_KNOBS = ("max_turns", "max_episode_tokens")


def check_episode_knobs(config: PPOConfig, agent: bool) -> None:
    """Refuse :data:`EPISODE_KNOBS` away from their defaults without multi-turn episodes.

    Raises:
        ValueError: naming the knobs and what they need.
    """
    defaults = PPOConfig.__dataclass_fields__
    episodic = [f"{k} = {getattr(config, k)!r}" for k in EPISODE_KNOBS if getattr(config, k) != defaults[k].default]
    if episodic and not agent:
        raise ValueError(
            f"{', '.join(episodic)} has no effect here: it needs multi-turn episodes (an environment or tools)"
        )


def check_arguments(
    config: PPOConfig,
    policy: Union[nn.Module, str, os.PathLike],
    ref_policy: Optional[nn.Module],
    value_model: Optional[nn.Module],
    tokenizer: Any,
    reward_fn: RewardFn,
    eval_prompts: Optional[Sequence[Any]],
    *,
    agent: bool = False,
) -> None:
    """The checks of :class:`~pyppo.trainer.PPOTrainer`'s arguments that load no model (a model
    source given as ``policy`` is checked to exist); ``agent``: an environment or tools were given
    (the reward may then be ``None``: the environment pays).

    Raises:
        TypeError: ``policy``, ``ref_policy`` or ``value_model`` of another type, naming it and
            what to pass.
        ValueError: naming the bad argument.
        FileNotFoundError, ModuleNotFoundError: as :func:`pyppo.models.resolve_model_source`,
            for a model source ``policy``.
    """
    if not isinstance(config, PPOConfig):
        raise ValueError(f"config must be a PPOConfig, got {type(config).__name__}")
    source = isinstance(policy, (str, os.PathLike))
    if source:
        resolve_model_source(policy)
    elif not isinstance(policy, nn.Module):
        raise TypeError(
            "policy must be a transformers causal LM (an nn.Module) or a model source (a local Hugging Face "
            f"model directory, a .gguf file or an embedded model's name), got {type(policy).__name__}"
        )
    for name, model, default in (
        ("ref_policy", ref_policy, "a frozen copy of the policy"),
        ("value_model", value_model, "built from the policy"),
    ):
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"{name} must be an nn.Module, or None ({default}), got {type(model).__name__}")
    if not callable(reward_fn) and not (agent and reward_fn is None):
        raise ValueError(
            "reward_fn must be callable (prompts, responses) -> scores, or a list of them"
            + (" or None (the environment pays alone)" if agent else "")
        )
    if tokenizer is None and not source:
        raise ValueError("tokenizer is None: pass the policy's tokenizer (only a model source policy loads its own)")
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("tokenizer must have an eos_token_id")
    check_episode_knobs(config, agent)
    if config.lora_rank and ref_policy is not None:
        raise ValueError(
            "ref_policy must be None with lora_rank > 0: the reference is the policy with its adapters disabled"
        )
    if config.eval_every and not eval_prompts:
        raise ValueError(f"eval_every = {config.eval_every} needs eval_prompts (a non-empty list of prompts)")
    if eval_prompts is not None and not all(
        is_prompt(p.get("prompt") if isinstance(p, Mapping) else p) for p in eval_prompts
    ):
        raise ValueError(
            "eval_prompts must be a list of strings or chat-message lists, or of records {'prompt': ..., ...}"
        )


def load_policy(policy: Any, tokenizer: Any, base_model_source: Optional[str]) -> tuple:
    """``(policy, tokenizer, base_model_source)``, with a model source ``policy`` (a ``str`` or
    path) loaded on the CPU as ``pyppo train --model`` loads it
    (:func:`pyppo.models.load_model_and_tokenizer`): the tokenizer is its own unless one is given,
    and ``base_model_source`` (the run's recorded model) is the source, absolute when a path,
    unless one is given. A module ``policy`` is returned with the others unchanged.

    Raises:
        FileNotFoundError, ModuleNotFoundError, ValueError: as ``load_model_and_tokenizer``.
    """
    if not isinstance(policy, (str, os.PathLike)):
        return policy, tokenizer, base_model_source
    path = Path(policy).expanduser()
    source = str(path.resolve()) if path.exists() else os.fspath(policy)
    model, loaded = load_model_and_tokenizer(source)
    return model, loaded if tokenizer is None else tokenizer, base_model_source or source


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Left padding (prompts end where responses start); a missing pad token is taken to be EOS
    (padding is masked out everywhere)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class TrainedPart(NamedTuple):
    """A trained model as a checkpoint holds it (``PPOTrainer.checkpoint_parts``): the module as
    the forwards call it (DDP- or FSDP2-wrapped), its optimizer, and the prefix its weight names
    carry there (``"model."`` of a log-prob head)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    prefix: str


@dataclass(frozen=True)
class StepModels:
    """The models of a step, as :func:`assemble_models` put them together.

    Attributes:
        policy: the policy (the ``peft`` model under LoRA), trained in place.
        policy_logprobs: its :class:`~pyppo.trainer.logprob_head.LogprobHead`.
        policy_module: ``policy_logprobs`` as the forwards call it (DDP- or FSDP2-wrapped under
            ``torchrun``, else the head itself).
        reference: the frozen reference model; ``None`` under LoRA, whose reference is the policy
            with its adapters disabled.
        ref_logprobs: the reference's log-prob head (a ``LogprobHead``, or
            :class:`~pyppo.trainer.logprob_head.AdaptersDisabled` under LoRA).
        critic: the value model, its module and its optimizer
            (:class:`~pyppo.trainer.critic.Critic`); ``None`` for a critic-free estimator.
        export_replica: FSDP2 only, on rank 0: a weightless copy of the policy's structure that the
            export gathers the weights into; else ``None``.
        device, dtype: where the models are, and the compute dtype their forwards run under
            (:func:`pyppo.precision.autocast`).
    """

    policy: nn.Module
    policy_logprobs: LogprobHead
    policy_module: nn.Module
    reference: Optional[nn.Module]
    ref_logprobs: Union[LogprobHead, AdaptersDisabled]
    critic: Optional[Critic]
    export_replica: Optional[nn.Module]
    device: torch.device
    dtype: torch.dtype

    def forward_models(self) -> List[nn.Module]:
        """The models whose forwards a step runs: the policy, the reference, the value model."""
        return [m for m in (self.policy, self.reference, self.critic.model if self.critic else None) if m is not None]

    def trained_models(self) -> List[nn.Module]:
        """The models an update changes: the policy and the value model."""
        return [m for m in (self.policy, self.critic.model if self.critic else None) if m is not None]


def assemble_models(
    c: PPOConfig,
    policy: nn.Module,
    ref_policy: MaybeModel,
    value_model: MaybeModel,
    world: distributed.World,
    dtype: torch.dtype,
) -> StepModels:
    """The models of a run with config ``c``, on ``world.device`` (:func:`prepare_models`), checked
    (:func:`check_lora_exportable`, :func:`check_trainable`), with their log-prob heads, their
    DDP / FSDP2 wrappers under ``torchrun``, and the value model's AdamW inside its
    :class:`~pyppo.trainer.critic.Critic`. ``dtype`` is the compute dtype the heads' probe runs
    under.

    Raises:
        ValueError: as :func:`prepare_models`, :func:`check_lora_exportable` and
            :func:`check_trainable`.
    """
    policy, ref, value_model = prepare_models(c, policy, ref_policy, value_model, world.device)
    if ref is not None and ref_policy is None and dtype != torch.float32:
        # The reference pyppo copied runs only under this autocast: its linear weights in the
        # autocast dtype are the operands autocast would cast them to (the same KL), at half the
        # bytes. A reference the caller passed is theirs, and is left as it is.
        hold_linear_weights(ref, dtype)
    check_lora_exportable(policy, c)
    check_trainable(policy, value_model, c)
    head = LogprobHead(policy, temperature=c.temperature, from_hidden=c.logprobs_from_hidden, dtype=dtype)
    # FSDP2 shards the policy in place: the replica is taken before.
    replica = copy.deepcopy(policy).to("meta") if c.fsdp and world.active and world.is_main else None
    policy_module = distributed.wrap(head, world, fsdp=c.fsdp)
    critic = None
    if value_model is not None:
        value_module = distributed.wrap(value_model, world, fsdp=c.fsdp)
        critic = Critic(
            value_model,
            value_module,
            make_adamw(value_model, c.effective_value_lr, c),
            c,
            device=world.device,
            dtype=dtype,
        )
    ref_logprobs = (
        AdaptersDisabled(policy_module, head)
        if c.lora_rank
        else LogprobHead(ref, temperature=c.temperature, from_hidden=c.logprobs_from_hidden, dtype=dtype)
    )
    return StepModels(policy, head, policy_module, ref, ref_logprobs, critic, replica, world.device, dtype)


def prepare_models(
    c: PPOConfig, policy: nn.Module, ref_policy: MaybeModel, value_model: MaybeModel, device: torch.device
) -> tuple:
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
            raise ValueError(
                f"value_model: advantage_estimator = {c.advantage_estimator!r} trains no value model; "
                "pass value_model=None"
            )
    else:
        value_model = (value_model if value_model is not None else ValueModel.from_causal_lm(policy)).to(device)
    if c.lora_rank:
        policy = add_lora(policy, rank=c.lora_rank, alpha=c.lora_alpha, targets=c.lora_target_modules)
    if c.value_lora:
        if not isinstance(getattr(value_model, "backbone", None), nn.Module):
            raise ValueError("value_lora needs a value model with a .backbone module (a pyppo ValueModel)")
        value_model.backbone = add_lora(
            value_model.backbone, rank=c.lora_rank, alpha=c.lora_alpha, targets=c.lora_target_modules
        )
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
            raise ValueError(
                f"the {what} has no trainable parameter (lora_target_modules = "
                f"{c.lora_target_modules!r}, lora_rank = {c.lora_rank})"
            )


def check_lora_exportable(policy: nn.Module, c: PPOConfig) -> None:
    """With LoRA, refuse now what :func:`pyppo.models.export.save_policy` would refuse after the last
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
        raise ValueError(
            f"lora_target_modules = {c.lora_target_modules!r}: the trained policy could not be "
            f"exported: {exc}{' (--no-merge-lora)' if c.merge_lora else ''}"
        ) from None


def check_prompt_sets(
    c: PPOConfig,
    policy: nn.Module,
    tokenizer: Any,
    reward_fn: RewardFn,
    sets: Mapping[str, Sequence[Any]],
    *,
    agent: bool = False,
) -> Optional[int]:
    """Check, once and up front, every prompt set (``{"prompts": [...], "eval_prompts": [...]}``):
    the reward accepts its fields (with ``agent``, an episode's ``transcript`` too), and each
    prompt fits the context with ``max_new_tokens`` to spare (one that does not would make
    generation crawl past the model's positions).

    Returns:
        the prompt token limit of :func:`pyppo.rollout.tokens.prompt_token_limit`.

    Raises:
        ValueError: a field the reward lacks, or a prompt too long (naming the set).
    """
    limit, room = prompt_token_limit(policy, max_new_tokens=c.max_new_tokens, max_prompt_length=c.max_prompt_length)
    for what, records in sets.items():
        if records and reward_fn is not None:  # no eval prompts, or no reward function: nothing to check
            episode = EPISODE_FIELDS if agent else ()  # what an episode adds (a transcript)
            check_reward_fields(reward_fn, [*prompt_fields(records), *episode], source=what)
        check_prompt_lengths(
            tokenizer,
            prompt_columns(records)[0],
            use_chat_template=c.use_chat_template,
            room=room,
            max_new_tokens=c.max_new_tokens,
            max_prompt_length=c.max_prompt_length,
            truncate=c.truncate_prompts,
            what=what,
        )
    return limit


def make_adamw(model: nn.Module, lr: float, c: PPOConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters; the fused kernel where it applies (plain CPU
    or CUDA tensors): one pass over each parameter's state instead of the multi-tensor
    implementation's temporaries, each as large as the parameters (faster, and a smaller peak)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, eps=c.adam_eps, weight_decay=c.weight_decay, fused=fused or None)


def share_reward_weights(ref: Optional[nn.Module], reward_fn: RewardFn, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the classifier reward models' weights no longer held: each computes in the run's
    ``dtype`` (:meth:`~pyppo.rewards.SequenceClassifierReward.compute_in`: under bf16 autocast its
    linear weights are held in bf16, as the reference's are), then shares the tensors that are
    equal and frozen in it and the reference (:func:`pyppo.models.share_frozen_weights`); 0 for
    other rewards."""
    shared = 0
    for part in reward_parts(reward_fn):  # each of several rewards
        reward = getattr(part, "__wrapped__", part)  # load_reward's validating wrapper
        if isinstance(reward, SequenceClassifierReward):
            shared += reward.compute_in(dtype)
            if ref is not None:
                shared += share_frozen_weights(ref, reward.model)
    return shared


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
