"""The trainer's multi-turn engine, built once from its arguments (``docs/agents.md``)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .. import distributed
from ..rollout import RolloutEngine
from .episodes import AgentEngine, EpisodeLimits

__all__ = ["make_agent_engine", "episode_token_limit"]


def episode_token_limit(max_episode_tokens: Optional[int], model: Any) -> int:
    """``max_episode_tokens``, or the model's context (``config.max_position_embeddings``) when
    ``None``.

    Raises:
        ValueError: ``None`` and the model states no context; or more than the model's context.
    """
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    context = context if isinstance(context, int) and context > 0 else None
    if max_episode_tokens is None:
        if context is None:
            raise ValueError("max_episode_tokens: the model states no context length; set max_episode_tokens")
        return context
    if context is not None and max_episode_tokens > context:
        raise ValueError(
            f"max_episode_tokens ({max_episode_tokens}) is more than the model's context of {context} positions"
        )
    return int(max_episode_tokens)


def make_agent_engine(
    config: Any,
    engine: RolloutEngine,
    environment: Any,
    tools: Optional[Sequence[Callable]],
    models: Any,
    tokenizer: Any,
    world: distributed.World,
) -> AgentEngine:
    """The :class:`~pyppo.agents.episodes.AgentEngine` of a run: ``engine`` samples each turn,
    one ``environment`` per episode (a class, a zero-argument factory, or a name / ``module:Class``
    / ``file.py:Class`` for :func:`~pyppo.agents.registry.load_environment`), with ``tools``.

    Args:
        config: the run's :class:`~pyppo.config.PPOConfig` (``max_turns``, ``max_new_tokens`` per
            turn, ``max_episode_tokens``, ``use_chat_template``).
        models: the step's :class:`~pyppo.trainer.assemble.StepModels` (the policy's context, and
            whether sampling is a collective: FSDP2).

    Raises:
        ValueError, TypeError: a bad environment or tool (naming it; ``tools`` not a list of
            functions), or limits the model cannot hold; a broken environment contract is an
            :class:`~pyppo.agents.types.EnvironmentContractError` (a TypeError).
    """
    from .adapters import environment_factory
    from .registry import load_environment
    from .render import ChatRenderer

    spec = environment if isinstance(environment, str) else _importable_name(environment)
    if isinstance(environment, str):
        environment = load_environment(environment)
    make_env = environment_factory(environment, tools, tokenizer)  # tools checked there (tool_list)
    renderer = ChatRenderer(tokenizer, use_chat_template=config.use_chat_template, tools=make_env.tools)
    base = getattr(models.policy, "get_base_model", lambda: models.policy)()
    limits = EpisodeLimits(
        max_turns=config.max_turns,
        max_new_tokens=config.max_new_tokens,
        max_episode_tokens=episode_token_limit(config.max_episode_tokens, base),
    )
    agent = AgentEngine(
        engine,
        renderer,
        make_env,
        limits,
        tokenizer,
        world=world,
        collective=distributed.is_sharded(models.policy_module),
        device=models.device,
    )
    agent.spec = None if tools else spec  # standalone tools cannot be named on the command line
    return agent


def _importable_name(environment: Any) -> Optional[str]:
    """``"module:Class"`` for a class importable by that name (not ``__main__``, not local)."""
    module, name = getattr(environment, "__module__", None), getattr(environment, "__qualname__", "")
    if not isinstance(environment, type) or not module or module == "__main__" or "<locals>" in name:
        return None
    return f"{module}:{name}"
