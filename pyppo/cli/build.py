"""One way from (model, reward, prompts, config) to a :class:`~pyppo.trainer.PPOTrainer`, used
by ``pyppo train`` and ``pyppo profile`` alike."""

from __future__ import annotations

from typing import Callable, Optional

from .. import models, prompts as prompt_sets, rewards
from ..config import PPOConfig
from ..distributed import local_device
from ..trainer import PPOTrainer

__all__ = ["check_sources", "build_trainer"]


def check_sources(model: str, reward: str, prompts: Optional[str], device: str):
    """The cheap checks, before anything large is loaded: the model source exists, the prompts
    parse, the reward loads. Returns ``(reward_fn, prompt list)``.

    Raises:
        FileNotFoundError, ModuleNotFoundError, ValueError: a bad source, naming it.
    """
    models.resolve_model_source(model)
    prompt_list = prompt_sets.load_prompts(prompts) if prompts else list(prompt_sets.DEFAULT_PROMPTS)
    try:
        reward_fn = rewards.load_reward(reward, device=local_device(device))
    except (AttributeError, TypeError) as exc:  # "module:function" naming a missing or non-callable attribute
        raise ValueError(str(exc)) from None
    return reward_fn, prompt_list


def build_trainer(config: PPOConfig, *, model: str = models.DEFAULT_MODEL, reward: str = "sentiment",
                  prompts: Optional[str] = None, eval_prompts: Optional[str] = None,
                  before_loading: Optional[Callable[[], None]] = None) -> PPOTrainer:
    """Load everything a run needs and build its trainer.

    Args:
        config: the run's settings (``config.device`` places the models).
        model: ``"smollm2-135m-instruct"``, a local Hugging Face model directory or a ``.gguf`` file;
            also the reference (a frozen copy) and the value model's backbone (a trainable copy).
        reward: a :func:`pyppo.rewards.load_reward` spec.
        prompts: a ``.jsonl`` file of ``{"prompt": ...}`` lines; ``None`` = the built-in prompts.
        eval_prompts: held-out prompts in the same format, for ``eval_every``; ``None`` = none.
        before_loading: called after the cheap checks, before the model loads (e.g. to say so).

    Raises:
        as :func:`check_sources` and :func:`pyppo.models.load_model_and_tokenizer`.
    """
    reward_fn, prompt_list = check_sources(model, reward, prompts, config.device)
    eval_list = prompt_sets.load_prompts(eval_prompts, flag="--eval-prompts") if eval_prompts else None
    if before_loading is not None:
        before_loading()
    # Loaded on the CPU: the trainer places it (under torchrun, on this rank's device).
    policy, tokenizer = models.load_model_and_tokenizer(model)
    # An exported adapter names `model` as its base.
    return PPOTrainer(config, policy, None, None, tokenizer, reward_fn, prompt_list, eval_prompts=eval_list,
                      base_model_source=model)
