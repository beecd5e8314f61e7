"""Which rollout engine a run samples with: :func:`make_engine` builds the one
``PPOConfig.rollout_engine`` names (and, for ``transformers``, its ``GenerationConfig``), once,
from the policy as it is when the trainer is built."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .. import distributed
from .engine import RolloutEngine
from .hf_generate import HFGenerateEngine, generation_config

__all__ = ["make_engine"]


def make_engine(
    config: Any,
    *,
    policy: nn.Module,
    policy_module: nn.Module,
    tokenizer: Any,
    device: torch.device,
    dtype: torch.dtype,
    max_prompt_tokens: Optional[int],
    sharded: Optional[bool] = None,
) -> RolloutEngine:
    """The engine ``config.rollout_engine`` names.

    Args:
        config: the run's :class:`~pyppo.config.PPOConfig`.
        policy: the policy (a ``transformers`` causal LM, or the ``peft`` model wrapping it);
            the vLLM engine copies its weights, adapters merged.
        policy_module: the policy's log-prob head as the trainer calls it (DDP/FSDP2-wrapped
            under torchrun); ``transformers`` samples through it.
        tokenizer: the policy's tokenizer, with its EOS and pad tokens set (the trainer's
            ``prepare_tokenizer``); generation stops at its EOS.
        device, dtype: the trainer's device and compute dtype.
        max_prompt_tokens: from :func:`~pyppo.rollout.tokens.prompt_token_limit`.
        sharded: the policy is FSDP2-sharded (``transformers`` then samples with ``synced_gpus``;
            the vLLM engine gathers each weight to sync it); ``None`` = as ``policy_module`` is.

    Under ``torchrun`` each rank builds an engine of its own on its own device (vLLM with
    tensor-parallel size 1, sampling that rank's share of the prompts).

    Raises:
        ImportError: ``rollout_engine = "vllm"`` without vLLM installed (the message says what
            to install).
    """
    if sharded is None:
        sharded = distributed.is_sharded(policy_module)
    if config.rollout_engine == "transformers":
        gen_config = generation_config(
            config, eos_token_id=int(tokenizer.eos_token_id), pad_token_id=int(tokenizer.pad_token_id)
        )
        return HFGenerateEngine(
            policy_module,
            tokenizer,
            gen_config,
            device=device,
            dtype=dtype,
            max_prompt_tokens=max_prompt_tokens,
            use_chat_template=config.use_chat_template,
            synced_gpus=sharded,
        )
    if config.rollout_engine != "vllm":  # PPOConfig's check makes this unreachable from a config
        raise ValueError(f"rollout_engine must be 'transformers' or 'vllm', got {config.rollout_engine!r}")
    from .vllm_engine import VLLMEngine

    return VLLMEngine(
        policy,
        tokenizer,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        max_prompt_tokens=max_prompt_tokens,
        use_chat_template=config.use_chat_template,
        seed=config.seed,
        device=device,
        dtype=dtype,
        kv_cache_gib=config.vllm_kv_cache_gib,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
    )
