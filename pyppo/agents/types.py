"""What the episode runner drives: one environment instance per episode, behind one interface.

Users write environments in either of two conventions (``docs/agents.md``): TRL's
``environment_factory`` class (``reset(**row)``, public methods as tools, optional
``get_reward()``), or plain tool functions; or a text environment (``reset(**row)``,
``step(action) -> (observation, reward, done)``). :mod:`pyppo.agents.adapters` wraps each into an
:class:`Environment`, which is all :mod:`pyppo.agents.episodes` knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence

__all__ = ["Environment", "EnvironmentContractError", "TurnResult"]


class EnvironmentContractError(TypeError):
    """An environment (or its class, or a factory of it) breaks the contract of ``docs/agents.md``:
    ``reset`` or ``step`` returned the wrong thing, the class cannot be called with no arguments,
    ``default_prompts`` is not a class method returning prompt records, and so on. The message names
    the environment and what was expected. A ``TypeError``, so ``except TypeError`` still catches
    it; the command line prints it as one line (``pyppo.cli.flags.USER_ERRORS``)."""


@dataclass
class TurnResult:
    """The environment's answer to one agent turn.

    Attributes:
        reply: the chat messages the environment answers with, in order (``{"role": "tool",
            "name": ..., "content": str}`` for tool results, ``{"role": "user", "content": str}``
            for a text environment's observation); ``[]`` when nothing follows (``done``).
        reward: paid for this turn (float; 0 when the environment pays only at the end).
        done: the episode ended (the environment's ``done``, or an agent turn without a tool call).
        tool_calls: tool calls parsed from this turn's text (0 for a text environment).
        tool_errors: those of them that failed (malformed, unknown tool, bad arguments, raised):
            each became an error message in ``reply`` instead of a crash.
    """

    reply: List[Dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(Protocol):
    """One episode's environment, as the episode runner drives it.

    Attributes:
        tools: the JSON schemas (``transformers.utils.get_json_schema``) of the tools the model may
            call; ``[]`` for a text environment.
    """

    tools: List[Dict[str, Any]]

    def reset(self, row: Mapping[str, Any], seed: int) -> Optional[str]:
        """Start an episode for the prompt record ``row`` (its fields, ``prompt`` included);
        ``seed`` is the episode group's seed (the same for every sample of one prompt record).
        Returns text to append to the prompt's user message, or ``None``."""
        ...

    def turn(self, text: str, ids: Sequence[int], ended_with_eos: bool) -> TurnResult:
        """The agent's turn: ``ids``, the sampled token ids (EOS included when sampled), and
        ``text``, them decoded with special tokens skipped (for parsing; never re-encoded);
        ``ended_with_eos``: the turn ended with the EOS token (else a limit cut it)."""
        ...

    def final_reward(self) -> Optional[float]:
        """The episode's reward from the environment's state once it ended (TRL's
        ``get_reward()``), or ``None`` when the environment pays through :meth:`turn` only."""
        ...
