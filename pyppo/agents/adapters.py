"""Adapters from the environment conventions users write to :class:`~pyppo.agents.types.Environment`.

Two conventions, told apart by one rule (:func:`environment_factory`): an instance whose class
defines ``step`` is a *text environment*, any other a *tool environment*.

- Tool environment, TRL's ``GRPOTrainer(environment_factory=...)`` convention: a class with
  ``reset(**row) -> str | None``, public methods that are the model's tools (each with type hints
  and a Google-style docstring), and optionally ``get_reward() -> float`` (sync or async) that pays
  the episode from the environment's state once it ended. Plain tool functions may come with it or
  alone. :class:`ToolEnvironment`.
- Text environment, the SkyRL / OpenRLHF convention: ``reset(**row) -> str | None`` and
  ``step(action: str) -> (observation, reward, done)`` (or with a fourth ``info`` item, ignored):
  the agent's whole turn is the action, the observation the next user message. :class:`TextEnvironment`.

Consequently a tool environment cannot have a tool named ``step`` (TRL's examples sometimes do):
rename the method, e.g. to ``act`` or ``send``.
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .tools import ToolCallParser, call_tools, run_awaitable, tool_schemas
from .types import Environment, EnvironmentContractError, TurnResult

__all__ = [
    "EnvironmentFactory",
    "TextEnvironment",
    "ToolEnvironment",
    "environment_factory",
    "environment_methods",
    "tool_list",
]

# TRL's reserved names: called by the trainer, never offered to the model as tools.
_RESERVED = ("reset", "get_reward")


def environment_methods(instance: Any) -> List[Callable]:
    """The tool methods of a TRL-convention environment, bound to ``instance``, by name.

    TRL's rule (``GRPOTrainer``'s probing): the functions found on the *class* by
    ``inspect.getmembers(type(instance), inspect.isfunction)`` (so inherited methods and static
    methods count, class methods and properties do not), except ``reset``, ``get_reward`` and
    names starting with ``_``.
    """
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in _RESERVED and not name.startswith("_")
    ]


def _reset_arguments(instance: Any, row: Mapping[str, Any], seed: int) -> Dict[str, Any]:
    """The keyword arguments of ``instance.reset`` for the prompt record ``row`` and episode ``seed``.

    Every field when ``reset`` takes ``**kwargs`` (TRL passes the whole row), else only the fields
    it names (so ``reset(self, answer)`` works with a record that also has a ``prompt``); plus
    ``seed=seed`` when ``reset`` names a ``seed`` parameter and the row has no ``seed`` field.
    """
    name = type(instance).__name__
    try:
        signature = inspect.signature(instance.reset)
    except (TypeError, ValueError):
        return dict(row)
    parameters = signature.parameters
    named = {
        p.name for p in parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
    }
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    kwargs = dict(row) if takes_any else {k: v for k, v in row.items() if k in named}
    if "seed" in named and "seed" not in row:
        kwargs["seed"] = seed
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise EnvironmentContractError(
            f"environment {name}: reset{signature} cannot take the prompt record's fields {sorted(row)}: {exc}"
        ) from exc
    return kwargs


def _call_reset(instance: Any, row: Mapping[str, Any], seed: int) -> Optional[str]:
    result = instance.reset(**_reset_arguments(instance, row, seed))
    if inspect.isawaitable(result):
        result = run_awaitable(result)
    if result is not None and not isinstance(result, str):
        raise EnvironmentContractError(
            f"environment {type(instance).__name__}: reset() must return a str or None, got {result!r}"
        )
    return result


def _reward(value: Any, where: str) -> float:
    """``value`` as a finite float, else a ValueError naming ``where``."""
    if not isinstance(value, numbers.Real):
        raise ValueError(f"{where} must be a number, got {type(value).__name__} {value!r}")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"{where} must be finite, got {reward}")
    return reward


def _is_bool(flag: Any) -> bool:
    """A ``bool`` or a numpy boolean (``numpy.bool_``, named ``bool`` in numpy 2); numpy is looked
    up only where it was imported already (a numpy boolean implies it was)."""
    if isinstance(flag, bool):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(flag, numpy.bool_)


def _require_reset(instance: Any) -> None:
    if not callable(getattr(instance, "reset", None)):
        raise ValueError(
            f"environment {type(instance).__name__} must define a callable reset(**row) -> str | None "
            "(TRL's environment_factory convention), called at the start of every episode"
        )


class ToolEnvironment:
    """A tool environment: the model's turns call tools until a turn calls none.

    Args:
        instance: a TRL-convention environment (see the module docstring), or ``None`` for
            standalone tools only (then :meth:`reset` does nothing and nothing pays at the end).
        tools: standalone tool functions (sync or async), offered besides the instance's methods.
        parser: reads each turn's tool calls.

    Attributes:
        tools: the JSON schemas of the instance's tool methods (:func:`environment_methods`), then
            of the standalone tools.

    Raises:
        ValueError: ``instance`` has no callable ``reset``; a tool that cannot be described
            (:func:`~pyppo.agents.tools.tool_schemas`); two tools of one name.
    """

    def __init__(self, instance: Any, tools: Sequence[Callable], parser: ToolCallParser):
        if instance is not None:
            _require_reset(instance)
        self.instance = instance
        functions = (environment_methods(instance) if instance is not None else []) + list(tools)
        self.tools: List[Dict[str, Any]] = tool_schemas(functions)
        self._registry: Dict[str, Callable] = {}
        for function, schema in zip(functions, self.tools):
            name = schema["function"]["name"]
            if name in self._registry:
                raise ValueError(f"{self._where()}: two tools are named {name!r}; the model calls tools by name")
            self._registry[name] = function
        self.parser = parser
        cls = type(instance) if instance is not None else None
        self._get_reward = getattr(instance, "get_reward", None) if callable(getattr(cls, "get_reward", None)) else None

    def _where(self) -> str:
        return f"environment {type(self.instance).__name__}" if self.instance is not None else "tools"

    def reset(self, row: Mapping[str, Any], seed: int) -> Optional[str]:
        """``instance.reset(**row)`` (see :func:`_reset_arguments` for which fields and ``seed``);
        its text (appended to the prompt) or ``None``. Raises EnvironmentContractError: the record's
        fields do not fit ``reset``'s signature, or ``reset`` returned neither a str nor None."""
        if self.instance is None:
            return None
        return _call_reset(self.instance, row, seed)

    def turn(self, text: str, ids: Sequence[int], ended_with_eos: bool) -> TurnResult:
        """Runs the turn's tool calls (a turn a limit cut included, so the state matches what the
        model wrote); a turn with no call, well-formed or not, ends the episode."""
        calls, errors = self.parser(text, ids)
        if not calls and not errors:
            return TurnResult(done=True)
        reply, n_calls, n_errors = call_tools(calls, errors, self._registry)
        return TurnResult(reply=reply, tool_calls=n_calls, tool_errors=n_errors)

    def final_reward(self) -> Optional[float]:
        """``instance.get_reward()`` (awaited when async) where the class defines it, else None.
        Raises ValueError (naming the class): the reward is not a finite number."""
        if self._get_reward is None:
            return None
        value = self._get_reward()
        if inspect.isawaitable(value):
            value = run_awaitable(value)
        return _reward(value, f"{self._where()}: get_reward()")


class TextEnvironment:
    """A text environment (the SkyRL / OpenRLHF convention): the agent's turn is the action, the
    observation the next user message.

    The instance defines ``reset(**row) -> str | None`` and ``step(action: str) -> (observation:
    str | None, reward: float, done: bool)``; a fourth item (an ``info`` dict) is ignored, and a
    gymnasium-style five ``(observation, reward, terminated, truncated, info)`` ends the episode on
    either flag. Either method may be async. Each step's reward pays that turn; there is no final
    reward. A step that is not ``done`` must return an observation: the episode cannot go on
    without a reply (an empty string is a valid one).

    Attributes:
        tools: ``[]``.

    Raises:
        ValueError: the instance lacks a callable ``reset`` or ``step``.
    """

    def __init__(self, instance: Any):
        _require_reset(instance)
        if not callable(getattr(instance, "step", None)):
            raise ValueError(
                f"environment {type(instance).__name__} must define step(action: str) -> (observation, reward, done)"
            )
        self.instance = instance
        self.tools: List[Dict[str, Any]] = []

    def reset(self, row: Mapping[str, Any], seed: int) -> Optional[str]:
        """``instance.reset(**row)``, as :meth:`ToolEnvironment.reset`."""
        return _call_reset(self.instance, row, seed)

    def turn(self, text: str, ids: Sequence[int], ended_with_eos: bool) -> TurnResult:
        """``instance.step(text)``: its reward and done, and its observation as a user message
        unless done or ``None``.

        Raises:
            EnvironmentContractError: step returned something else than the tuples above, or items
                of the wrong type (naming the class and what it returned).
            ValueError: a non-finite reward; no observation (``None``) for a step that is not done.
        """
        result = self.instance.step(text)
        if inspect.isawaitable(result):
            result = run_awaitable(result)
        observation, reward, done = self._unpack(result)
        reply = [] if done or observation is None else [{"role": "user", "content": observation}]
        return TurnResult(reply=reply, reward=reward, done=done)

    def _unpack(self, result: Any) -> Tuple[Optional[str], float, bool]:
        name = type(self.instance).__name__
        if not isinstance(result, (tuple, list)) or len(result) not in (3, 4, 5):
            hint = ""
            if isinstance(result, str):
                hint = (
                    " (a str: if step is meant as a tool, rename it; an environment whose class defines step "
                    "is a text environment)"
                )
            raise EnvironmentContractError(
                f"environment {name}: step() must return (observation, reward, done) or (observation, reward, "
                f"done, info), got {type(result).__name__} {result!r:.200}{hint}"
            )
        observation, reward = result[0], result[1]
        flags = result[2:4] if len(result) == 5 else result[2:3]
        if observation is not None and not isinstance(observation, str):
            raise EnvironmentContractError(
                f"environment {name}: step()'s observation must be a str or None, got {type(observation).__name__} "
                f"{observation!r:.200} (the return was {result!r:.200})"
            )
        if not isinstance(reward, numbers.Real):
            hint = " (a tensor or array: return float(reward))" if hasattr(reward, "item") else ""
            raise EnvironmentContractError(
                f"environment {name}: step()'s reward must be a number, got {type(reward).__name__} "
                f"{reward!r:.200} (the return was {result!r:.200}){hint}"
            )
        # An int (0/1) would hide a swapped (reward, done) order.
        for what, flag in zip(("terminated", "truncated") if len(result) == 5 else ("done",), flags):
            if not _is_bool(flag):
                raise EnvironmentContractError(
                    f"environment {name}: step()'s {what} must be a bool (Python's or numpy's), got "
                    f"{type(flag).__name__} {flag!r:.200} (the return was {result!r:.200})"
                )
        done = any(bool(flag) for flag in flags)
        reward = _reward(reward, f"environment {name}: step()'s reward")
        if not done and observation is None:
            raise ValueError(
                f"environment {name}: step() returned observation None for a step that is not done; the episode "
                "cannot go on without a reply (return a str, or done=True)"
            )
        return observation, reward, done

    def final_reward(self) -> Optional[float]:
        """``None``: a text environment pays through its steps."""
        return None


class EnvironmentFactory:
    """A fresh :class:`~pyppo.agents.types.Environment` per call, one environment instance per
    episode (:func:`environment_factory` builds it).

    Attributes:
        tools: the tools' JSON schemas, the same for every episode (``[]`` for a text environment),
            for the prompt's renderer.
        kind: ``"tool"`` or ``"text"``.
        name: the environment's class name, or ``"tools"`` for standalone tools only.
    """

    def __init__(self, env: Any = None, tools: Optional[Sequence[Callable]] = None, tokenizer: Any = None):
        tools = tool_list(tools)
        if env is None and not tools:
            raise ValueError("environment_factory: give an environment (a class or a zero-argument factory) or tools")
        if env is not None and not callable(env):
            raise EnvironmentContractError(
                f"environment_factory: env must be a class or a zero-argument callable that returns an environment "
                f"instance, got {type(env).__name__} {env!r:.200} (pass the class, not an instance)"
            )
        if env is not None:
            _check_zero_arguments(env)
        self._env, self._standalone, self._tokenizer = env, tools, tokenizer
        probe = self._instance()
        if probe is not None:
            _require_reset(probe)
        self.name = type(probe).__name__ if probe is not None else "tools"
        self.kind = "text" if probe is not None and callable(getattr(probe, "step", None)) else "tool"
        if self.kind == "text" and tools:
            raise ValueError(
                f"environment {self.name} is a text environment (it defines step), which takes no tools; "
                f"got {len(tools)} tool(s). A tool environment cannot have a method named step."
            )
        if self.kind == "text" and callable(getattr(probe, "get_reward", None)):
            warnings.warn(
                f"environment {self.name} is a text environment (it defines step): its steps' rewards pay it, "
                "and its get_reward is never called; pay the final reward from the last step",
                UserWarning,
                stacklevel=2,
            )
        self._parser: Optional[ToolCallParser] = None
        if self.kind == "tool":
            schemas = tool_schemas((environment_methods(probe) if probe is not None else []) + tools)
            self._parser = ToolCallParser(tokenizer, schemas)
        self._first: Optional[Environment] = self._wrap(probe)
        self.tools: List[Dict[str, Any]] = list(self._first.tools)

    def _wrap(self, instance: Any) -> Environment:
        if self.kind == "text":
            return TextEnvironment(instance)
        return ToolEnvironment(instance, self._standalone, self._parser)

    def __call__(self) -> Environment:
        first, self._first = self._first, None
        if first is not None:
            return first  # the probed instance serves the first episode instead of being wasted
        return self._wrap(self._instance())

    def _instance(self) -> Any:
        if self._env is None:
            return None
        instance = self._env()
        if instance is None:
            raise EnvironmentContractError(
                f"environment_factory: {self._env!r:.200}() returned None, not an environment instance"
            )
        return instance


def tool_list(tools: Any) -> List[Callable]:
    """``tools`` (``None``, or a list of functions: any iterable but a string or a mapping) as a list.

    Raises:
        TypeError: ``tools`` is a single function, or not a list (naming ``tools`` and what was
            given).
    """
    if tools is None:
        return []
    if callable(tools) or isinstance(tools, (str, bytes, Mapping)) or not hasattr(tools, "__iter__"):
        name = getattr(tools, "__name__", None)
        hint = f" (tools=[{name}])" if callable(tools) and name else ""
        raise TypeError(f"tools must be a list of functions{hint}, got {type(tools).__name__} {tools!r:.200}")
    return list(tools)


def _check_zero_arguments(env: Callable) -> None:
    """Raises :class:`EnvironmentContractError` when ``env`` (a class or factory) cannot be called
    with no arguments, as pyppo calls it once per episode; one whose signature cannot be read is
    called as it is."""
    try:
        signature = inspect.signature(env)
    except (TypeError, ValueError):
        return
    try:
        signature.bind()
    except TypeError as exc:
        name = getattr(env, "__qualname__", None) or f"{env!r:.200}"
        if isinstance(env, type):
            what = f"{name}.__init__{signature} needs arguments ({exc})"
            fix = f"give __init__ defaults, or pass a zero-argument factory such as functools.partial({name}, ...)"
        else:
            what = f"{name}{signature} needs arguments ({exc})"
            fix = "pass the environment's class (module:Class, not a method of it) or a zero-argument factory"
        raise EnvironmentContractError(
            f"environment {name}: pyppo makes one instance per episode by calling it with no arguments, but {what}; "
            f"{fix}"
        ) from None


def environment_factory(
    env: Any = None, tools: Optional[Sequence[Callable]] = None, tokenizer: Any = None
) -> EnvironmentFactory:
    """A factory of per-episode environments from what the user gave (TRL's ``environment_factory``
    and ``tools``, or a SkyRL/OpenRLHF text environment).

    Args:
        env: a class, or a zero-argument callable returning an instance (``functools.partial(Cls,
            max_attempts=5)``), called once per episode; ``None`` with ``tools`` for standalone
            tools only. An instance whose class defines ``step`` is a text environment, any other a
            tool environment (so no tool can be named ``step``).
        tools: standalone tool functions, a list (tool environments only).
        tokenizer: reads the tool calls (:class:`~pyppo.agents.tools.ToolCallParser`); ``None``
            reads ``<tool_call>`` blocks only.

    Returns:
        An :class:`EnvironmentFactory`: each call gives a fresh environment around a fresh instance.
        One instance is made here to validate the class and serves the first episode.

    Raises:
        ValueError: neither ``env`` nor ``tools``; the instance lacks a callable ``reset``; a text
            environment with tools; a tool without type hints or docstring; two tools of one name.
        EnvironmentContractError (a TypeError): ``env`` is not callable (an instance was passed),
            needs arguments, or returned ``None``.
        TypeError: ``tools`` is not a list (a single function: ``tools=[add]``).
    """
    return EnvironmentFactory(env, tools, tokenizer)
