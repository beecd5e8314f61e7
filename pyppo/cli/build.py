"""One way from (model, reward, prompts, config) to a :class:`~pyppo.trainer.PPOTrainer`, used
by ``pyppo train`` and ``pyppo profile`` alike."""

from __future__ import annotations

import inspect
from typing import Any, Callable, List, Optional, Sequence, Union

from .. import models, rewards
from .. import prompts as prompt_sets
from ..config import PPOConfig
from ..distributed import local_device
from ..reward_sum import load_rewards
from ..run.trainer import PPOTrainer
from ..tasks.reasoning_gym import is_task_spec

__all__ = ["check_sources", "build_trainer"]


def _load_prompts(source: Optional[str], flag: str, reward_fn, *, records: bool = False) -> Optional[List[dict]]:
    """The prompt set's records; for a reward that takes no field, only their prompts (so that
    lines may carry other keys that differ, as any metadata, as before rewards took fields);
    always the records with ``records`` (an environment's ``reset`` takes the fields)."""
    if not source:
        return None
    if records or reward_fn is None or rewards.reward_takes_fields(reward_fn):
        return prompt_sets.load_prompt_records(source, flag=flag)
    return [{"prompt": p} for p in prompt_sets.load_prompts(source, flag=flag)]


def _for_trainer(records: List[dict]) -> List[Union[str, dict]]:
    """The records when they have fields besides "prompt", else their strings (as before records)."""
    return records if prompt_sets.prompt_fields(records) else [r["prompt"] for r in records]


def _fits(reward_fn, set_name: str) -> bool:
    try:
        fields = prompt_sets.prompt_fields(prompt_sets.BUILTIN_PROMPT_SETS[set_name]())
        rewards.check_reward_fields(reward_fn, fields)
    except rewards.RewardError:
        return False
    return True


def _check_fields(
    reward_fn, records: Optional[List[dict]], source: Optional[str], flag: str, *, agent: bool = False
) -> None:
    """:func:`~pyppo.rewards.check_reward_fields` on one prompt set; when the prompts lack a field,
    the message names a built-in set that has what the reward needs."""
    where = f"{flag} {source!r}" if source else "the default prompts (no --prompts)"
    try:
        episode = rewards.EPISODE_FIELDS if agent else ()  # what an episode adds (a transcript)
        rewards.check_reward_fields(reward_fn, [*prompt_sets.prompt_fields(records or []), *episode], source=where)
    except rewards.RewardError as exc:
        eval_set = flag == "--eval-prompts"
        fitting = [
            name
            for name in prompt_sets.BUILTIN_PROMPT_SETS
            if name.endswith("-eval") == eval_set and name != source and _fits(reward_fn, name)
        ]
        hint = f"; the built-in set {flag} {fitting[0]} has what it needs" if fitting else ""
        if not fitting and _scores_reasoning_gym(reward_fn):
            hint = f"; give {flag} 'reasoning-gym:TASK' (`pyppo info` lists the tasks)"
        raise rewards.RewardError(f"{exc}{hint}", reward=exc.reward) from None


def _scores_reasoning_gym(reward_fn) -> bool:
    """Whether ``reward_fn`` is, or sums, ``--reward reasoning-gym``."""
    from ..tasks.reasoning_gym import reasoning_gym_reward

    return any(inspect.unwrap(fn) is reasoning_gym_reward for fn in getattr(reward_fn, "rewards", (reward_fn,)))


def check_sources(
    model: str,
    reward: Union[str, Sequence[str]],
    prompts: Optional[str],
    device: str,
    eval_prompts: Optional[str] = None,
    env: Optional[str] = None,
    env_eval: bool = False,
    reward_weights: Optional[Sequence[float]] = None,
):
    """The cheap checks, before anything large is loaded: the model source exists, the prompts
    parse, the reward loads (several: their :class:`~pyppo.reward_sum.RewardSum`, weighted by
    ``reward_weights``) and the prompts have the fields it requires. Returns ``(reward_fn,
    prompts, eval prompts or None)``, the prompts as the trainer takes them: strings, or records
    (dicts) when the set has fields besides ``"prompt"``.

    With an environment ``env`` (:func:`pyppo.agents.registry.load_environment`), ``reward``
    may be ``"none"`` (``reward_fn`` is then ``None``: the environment pays alone), the prompts
    default to the environment's ``default_prompts`` and are records (its ``reset`` takes them);
    with ``env_eval`` (the run evaluates: ``eval_every > 0``) the eval prompts default to its
    ``default_eval_prompts``. An environment that declares no prompts (or an empty list) needs
    ``prompts``.

    Raises:
        FileNotFoundError, ModuleNotFoundError, ValueError: a bad source, naming it (an invalid
            ``default_reward`` of the environment is named as such).
        EnvironmentContractError: the environment's ``default_prompts`` / ``default_eval_prompts``
            is not a class method returning prompt records.
    """
    models.resolve_model_source(model)
    env_class = None
    if env is not None:
        from ..agents.registry import declared_prompts, load_environment

        env_class = load_environment(env)
    specs = [reward] if isinstance(reward, str) else list(reward)
    if "none" in specs and (len(specs) > 1 or reward_weights is not None):
        raise ValueError("--reward none (the environment pays alone) takes no other reward and no --reward-weights")
    if specs == ["none"]:
        if env_class is None:
            raise ValueError("--reward none needs --env: without an environment nothing would pay the responses")
        reward_fn = None
    else:
        try:
            reward_fn = load_rewards(specs, reward_weights, device=local_device(device))
        except (AttributeError, TypeError) as exc:  # "module:function" naming a missing or non-callable attribute
            raise ValueError(str(exc)) from None
        except (OSError, ValueError, ImportError) as exc:
            if env_class is not None and reward == getattr(env_class, "default_reward", None):
                # No --reward: the environment's own default_reward was loaded (pyppo train's rule).
                name = getattr(env_class, "__qualname__", None) or type(env_class).__name__
                raise ValueError(
                    f"--env {env}: environment {name}'s default_reward {reward!r} is invalid: {exc}"
                ) from exc
            raise
    agent = env_class is not None
    records = _load_prompts(prompts, "--prompts", reward_fn, records=agent)
    eval_records = _load_prompts(eval_prompts, "--eval-prompts", reward_fn, records=agent)
    if records is None and env_class is not None:
        records = declared_prompts(env_class)
        if not records:
            raise ValueError(f"--env {env} declares no prompts (default_prompts); pass --prompts FILE.jsonl")
    if eval_records is None and env_eval and env_class is not None:
        eval_records = declared_prompts(env_class, "default_eval_prompts")
    if reward_fn is not None:
        _check_fields(reward_fn, records, prompts, "--prompts", agent=agent)
        if eval_records is not None:
            _check_fields(reward_fn, eval_records, eval_prompts, "--eval-prompts", agent=agent)
    if records and eval_records and not (is_task_spec(prompts) and is_task_spec(eval_prompts)):
        # reasoning-gym's sets are checked (and refused) when they are made; a file may repeat a prompt on purpose
        prompt_sets.warn_shared_prompts(
            records, eval_records, source=f"--prompts {prompts!r}", eval_source=f"--eval-prompts {eval_prompts!r}"
        )
    prompt_list: List[Any] = _for_trainer(records) if records else list(prompt_sets.DEFAULT_PROMPTS)
    return reward_fn, prompt_list, _for_trainer(eval_records) if eval_records else None


def build_trainer(
    config: PPOConfig,
    *,
    model: str = models.DEFAULT_MODEL,
    reward: Union[str, Sequence[str]] = "sentiment",
    reward_weights: Optional[Sequence[float]] = None,
    prompts: Optional[str] = None,
    eval_prompts: Optional[str] = None,
    env: Optional[str] = None,
    value_model: Optional[str] = None,
    before_loading: Optional[Callable[[], None]] = None,
) -> PPOTrainer:
    """Load everything a run needs and build its trainer.

    Args:
        config: the run's settings (``config.device`` places the models).
        model: ``"smollm2-135m-instruct"``, a local Hugging Face model directory or a ``.gguf`` file;
            also the reference (a frozen copy) and the value model's backbone (a trainable copy).
        reward: a :func:`pyppo.rewards.load_reward` spec, or a list of them (several rewards,
            whose weighted sum is the score: :class:`pyppo.reward_sum.RewardSum`).
        reward_weights: one weight per reward; ``None``: 1.0 each.
        prompts: a ``.jsonl`` file of ``{"prompt": ..., <fields>}`` lines or a built-in set's name
            (:func:`pyppo.prompts.load_prompt_records`); ``None`` = the default prompts. With
            fields besides ``"prompt"`` the trainer gets the records (dicts), else the strings.
        eval_prompts: held-out prompts in the same forms, for ``eval_every``; ``None`` = none, or
            with ``env`` and ``eval_every``, the environment's ``default_eval_prompts``.
        env: multi-turn episodes with this environment (``pyppo train --env``); ``None`` = none.
        value_model: an earlier run's directory (or its ``checkpoint/``) whose trained value model
            this one starts from (:meth:`~pyppo.run.trainer.PPOTrainer.load_value_model`);
            ``None`` = the value model starts from ``model`` with a new head.
        before_loading: called after the cheap checks, before the model loads (e.g. to say so).

    Raises:
        as :func:`check_sources`, :func:`pyppo.models.load_model_and_tokenizer` and, with
        ``value_model``, :func:`pyppo.run.checkpoint.load_trained_value_model`.
    """
    reward_fn, prompt_list, eval_list = check_sources(
        model,
        reward,
        prompts,
        config.device,
        eval_prompts,
        env,
        env_eval=bool(config.eval_every),
        reward_weights=reward_weights,
    )
    if not config.use_chat_template:  # message prompts cannot be rendered: known before loading
        from ..data.messages import check_renderable

        for source, flag, records in ((prompts, "--prompts", prompt_list), (eval_prompts, "--eval-prompts", eval_list)):
            prompt_texts = [r["prompt"] if isinstance(r, dict) else r for r in records or ()]
            check_renderable(prompt_texts, uses_template=False, source=f"{flag} {source!r}")
    if before_loading is not None:
        before_loading()
    # Loaded on the CPU: the trainer places it (under torchrun, on this rank's device).
    policy, tokenizer = models.load_model_and_tokenizer(model)
    # An exported adapter names `model` as its base.
    trainer = PPOTrainer(
        config,
        policy,
        None,
        None,
        tokenizer,
        reward_fn,
        prompt_list,
        eval_prompts=eval_list,
        base_model_source=model,
        environment=env,
    )
    if value_model is not None:
        trainer.load_value_model(value_model)
    return trainer
