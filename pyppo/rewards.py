"""Reward functions: ``(prompts, responses) -> one float per response``.

A reward is any callable ``reward_fn(prompts: list[str], responses: list[str]) -> list[float]``
(a list, tuple, 1-D numpy array or 1-D tensor of length ``B`` also works; a bool scores 1.0 or 0.0,
as TRL's float tensor of the outputs makes it). As in TRL, it may also
take the prompts' other fields (the keys of a prompts ``.jsonl`` line besides ``"prompt"``): a
parameter named like a field, ``reward_fn(prompts, responses, answer)``, receives that field's
values, one per prompt; ``**kwargs`` receives every field (:func:`score_responses`,
:func:`check_reward_fields`). A reward with a parameter named ``completions`` is called TRL's way,
with keywords: ``reward_fn(prompts=..., completions=..., **fields)`` (``prompts`` only when it
takes it), so ``def f(completions, **kwargs)`` works as written for TRL. A function with a
parameter named ``solution_str`` is veRL's ``compute_score(data_source, solution_str,
ground_truth, extra_info=None)``, called once per response (:mod:`pyppo.verl_reward`). A reward may
return ``None`` for a response it does not apply to (TRL's convention); several rewards with
weights are :class:`pyppo.reward_sum.RewardSum`. :func:`load_reward` turns a CLI spec into one:

* ``"sentiment"`` (the default): VADER compound sentiment of the response, in ``[-1, 1]``;
* ``"math"``: 1.0 when the response's final answer equals the prompt's ``answer`` field, else 0.0
  (:mod:`pyppo.math_reward`);
* ``"reasoning-gym"``: a reasoning-gym task's own ``score_answer`` of the response's
  ``<answer>`` (:mod:`pyppo.tasks.reasoning_gym`);
* ``"module:function"`` or ``"path/to/file.py:function"``: a Python function;
* a local directory holding a ``transformers`` sequence-classification model: its logit for the
  positive class (or its single logit, for a one-label reward model) of ``prompt + response``.

Every reward returned by :func:`load_reward` checks its output with :func:`validate_scores`, so a
reward that returns NaN, a string or the wrong number of scores fails at once with an error that
names the reward, the index and the value, instead of silently poisoning the advantages.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Collection, Dict, List, NamedTuple, Optional, Sequence

import torch

from .math_reward import math_reward
from .reward_classifier import SequenceClassifierReward
from .reward_code import function_hint, load_function
from .tasks.reasoning_gym import reasoning_gym_reward

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFn",
    "RewardOutput",
    "SequenceClassifierReward",
    "check_not_async",
    "check_reward_fields",
    "load_reward",
    "math_reward",
    "reward_name",
    "score_responses",
    "score_reward",
    "sentiment_reward",
    "validate_scores",
]

#: ``reward_fn(prompts, responses, **fields) -> scores``: the fields it names, if any (see the module).
RewardFn = Callable[..., Sequence[float]]


class RewardError(ValueError):
    """A reward function raised, or returned something other than one finite number per response.

    The message names the reward; ``reward``, ``index`` (the response/prompt index, when one
    element is at fault) and ``value`` (that element) say the same for programs. A ``ValueError``,
    so the CLI reports it as one line.
    """

    def __init__(self, message: str, *, reward: str | None = None, index: int | None = None, value=None):
        super().__init__(message)
        self.reward = reward
        self.index = index
        self.value = value


class RewardTypeError(RewardError, TypeError):
    """:class:`RewardError` for a reward output of the wrong type (also a ``TypeError``)."""


_analyzer = None
_analyzer_lock = threading.Lock()


def _sentiment_analyzer():
    """The one VADER analyzer, built on first use (it reads its lexicon from disk, ~0.1 s)."""
    global _analyzer
    if _analyzer is None:
        with _analyzer_lock:
            if _analyzer is None:
                from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

                _analyzer = SentimentIntensityAnalyzer()
    return _analyzer


def sentiment_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound sentiment of each response, in ``[-1, 1]`` (positive is higher).

    Only the response is scored: the prompt is fixed by the data set, so its sentiment would only
    add a per-prompt offset that the policy cannot change.

    Args:
        prompts: ``B`` prompt strings (unused, kept for the reward signature).
        responses: ``B`` response strings; an empty response scores 0.

    Returns:
        ``B`` floats.
    """
    analyzer = _sentiment_analyzer()
    return [float(analyzer.polarity_scores(r)["compound"]) for r in responses]


def validate_scores(scores, n: int, name: str) -> List[Optional[float]]:
    """Check that ``scores`` holds exactly ``n`` finite real numbers or ``None`` and return them
    as floats (and ``None``). A bool (Python's, numpy's ``bool_``, a bool tensor's) is 1.0 or 0.0,
    as TRL's ``torch.tensor(output, dtype=torch.float32)`` and veRL make it.

    ``None`` is TRL's "this reward does not apply to this response" (a math reward on a prompt
    without an answer): :mod:`pyppo.reward_sum` leaves it out of the weighted sum of the rewards.
    NaN is not a way to say it: a NaN or infinite score is a bug in the reward, refused here.

    Args:
        scores: what a reward returned: list/tuple of numbers or ``None``, 1-D numpy array or
            1-D tensor.
        n: the number of responses it was given.
        name: the reward's name, used in the error messages.

    Raises:
        RewardTypeError (a TypeError and a RewardError): ``scores`` is not a sequence, or an
            element is neither a real number, a bool nor ``None``; or a coroutine (an async
            reward), which is closed first, so that Python prints no "never awaited" warning.
        RewardError (a ValueError): wrong length or shape, or an element is NaN or infinite.
    """
    try:
        return _validated_scores(scores, n, name)
    except RewardError:
        # An async reward that got past check_not_async returned a coroutine (or a list of them):
        # never awaited, each is closed, so that Python does not print a RuntimeWarning for it.
        _close_coroutines(scores)
        raise


def _validated_scores(scores, n: int, name: str) -> List[Optional[float]]:
    if inspect.iscoroutine(scores):
        raise RewardTypeError(f"reward {name!r} returned a coroutine; {_sync_only()}", reward=name)
    if isinstance(scores, torch.Tensor):
        if scores.dim() != 1:
            raise RewardError(
                f"reward {name!r} returned a tensor of shape {tuple(scores.shape)}; expected [{n}]", reward=name
            )
        scores = scores.detach().cpu().tolist()
    elif hasattr(scores, "tolist") and hasattr(scores, "ndim"):  # numpy arrays, without importing numpy
        if scores.ndim != 1:
            raise RewardError(
                f"reward {name!r} returned an array of shape {tuple(scores.shape)}; expected ({n},)", reward=name
            )
        scores = scores.tolist()
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence):
        raise RewardTypeError(
            f"reward {name!r} returned {type(scores).__name__}; expected a list of {n} floats (one per response)",
            reward=name,
        )
    if len(scores) != n:
        raise RewardError(f"reward {name!r} returned {len(scores)} scores for {n} responses", reward=name)
    out: List[Optional[float]] = []
    for i, value in enumerate(scores):
        if value is None:
            out.append(None)
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if _is_bool(value):  # TRL makes a float tensor of the outputs: True is 1.0, as in veRL
            out.append(float(value))
            continue
        if inspect.iscoroutine(value):  # e.g. an async veRL compute_score, called per response
            raise RewardTypeError(
                f"reward {name!r} returned a coroutine at index {i}; {_sync_only()}", reward=name, index=i
            )
        if not isinstance(value, numbers.Real):
            raise RewardTypeError(
                f"reward {name!r} returned a non-number at index {i}: {value!r} ({type(value).__name__}); "
                "expected a number, or None where the reward does not apply",
                reward=name,
                index=i,
                value=value,
            )
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(
                f"reward {name!r} returned a non-finite score at index {i}: {value!r}",
                reward=name,
                index=i,
                value=value,
            )
        out.append(value)
    return out


def _sync_only(fn: Any = None) -> str:
    """What the errors about an async reward ``fn`` add: how to make it a plain one."""
    fn = getattr(fn, "_unchecked", fn)
    name = getattr(fn, "__name__", "") if inspect.isroutine(fn) else ""
    call = f"{name}(...)" if name.isidentifier() else "the_async_reward(...)"
    return (
        "pyppo calls rewards synchronously: wrap it (asyncio.run) in a plain def with the same "
        f"parameters that returns asyncio.run({call})"
    )


def _is_bool(value: Any) -> bool:
    """A Python bool or a numpy ``bool_`` (``numpy.bool`` in numpy 2), without importing numpy."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"))


def _close_coroutines(values: Any) -> None:
    """Close ``values`` if it is a coroutine, or every coroutine in it (a list or tuple): none was
    awaited, and an unclosed one makes Python print a ``RuntimeWarning`` when it is freed."""
    for value in values if isinstance(values, (list, tuple)) else (values,):
        if inspect.iscoroutine(value):
            value.close()


def _is_async(fn: Any) -> bool:
    """Whether calling ``fn`` makes a coroutine: an ``async def`` function or method, a
    ``functools.partial`` of one, or an object whose ``__call__`` is one."""
    fn = getattr(fn, "_unchecked", fn)  # load_reward's wrapper is a plain def
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)
    return not inspect.isroutine(fn) and call is not None and inspect.iscoroutinefunction(call)


def check_not_async(reward_fn: Any, name: Optional[str] = None) -> None:
    """Refuse an ``async def`` reward (or a callable object with an ``async def __call__``) up
    front: pyppo calls rewards synchronously, and the coroutine it would get is no score.

    Raises:
        RewardTypeError (a TypeError and a ValueError): one line naming the reward.
    """
    if _is_async(reward_fn):
        name = name or reward_name(reward_fn)
        raise RewardTypeError(f"reward {name!r} is an async function; {_sync_only(reward_fn)}", reward=name)


def reward_name(fn: Any) -> str:
    """How errors name a reward: its ``reward_name``, ``__name__`` or type name."""
    name = getattr(fn, "reward_name", None) or getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


def _clip_text(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


class _FieldParams(NamedTuple):
    """The prompt fields a reward takes, and how it is called, read from its signature."""

    named: frozenset  # parameters after (prompts, responses) that can be passed by keyword
    required: frozenset  # those of them without a default
    any: bool  # a **kwargs parameter: every field
    positional: frozenset  # the names of its (prompts, responses) parameters: never passed as fields
    trl: bool = False  # TRL's convention: called with keywords, prompts= (if it takes it) and completions=
    takes_pair: bool = True  # it can be called as (prompts, responses): two positional parameters or *args
    verl: bool = False  # veRL's compute_score: called per response, solution_str= and the fields by keyword


_NO_FIELDS = _FieldParams(frozenset(), frozenset(), False, frozenset())
#: The parameters of a reward in TRL's convention that are not prompt fields.
_TRL_ARGS = frozenset({"prompts", "completions"})
#: The parameter that makes a function veRL's ``compute_score(data_source, solution_str,
#: ground_truth, extra_info=None)`` (:mod:`pyppo.verl_reward`).
_VERL_RESPONSE = "solution_str"
# Per function, so the signature is read once, not at every step; weak, so that a dropped reward
# (and the model it holds) is freed. A bound method is keyed by its function: every instance
# takes the same fields.
_field_params_cache: "weakref.WeakKeyDictionary[Any, _FieldParams]" = weakref.WeakKeyDictionary()


def _read_field_params(fn: Callable) -> _FieldParams:
    try:
        params = inspect.signature(fn).parameters.values()  # follows __wrapped__ (load_reward's wrapper)
    except (TypeError, ValueError):  # a builtin without a signature: (prompts, responses) only
        return _NO_FIELDS
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    trl = any(p.name == "completions" and p.kind in by_keyword for p in params)
    verl = not trl and any(p.name == _VERL_RESPONSE and p.kind in by_keyword for p in params)
    named, required, positional, any_field = set(), set(), [], False
    for p in params:
        if (trl and p.name in _TRL_ARGS) or (verl and p.name == _VERL_RESPONSE):
            positional.append(p.name)
        elif not (trl or verl) and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and len(positional) < 2:
            positional.append(p.name)
        elif p.kind == p.VAR_KEYWORD:
            any_field = True
        elif p.kind in by_keyword:
            named.add(p.name)
            # veRL's reward managers always pass extra_info ({} when the row has none): never missing.
            if p.default is p.empty and not (verl and p.name == "extra_info"):
                required.add(p.name)
    if verl:  # called with keywords only: a positional-only parameter without a default cannot be given
        takes_pair = not any(p.kind == p.POSITIONAL_ONLY and p.default is p.empty for p in params)
    else:
        takes_pair = trl or len(positional) == 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
    return _FieldParams(frozenset(named), frozenset(required), any_field, frozenset(positional), trl, takes_pair, verl)


def _field_params(fn: Callable) -> _FieldParams:
    key = fn.__func__ if inspect.ismethod(fn) else fn
    try:
        return _field_params_cache[key]
    except (KeyError, TypeError):  # TypeError: not weakly referable, read every time
        pass
    params = _read_field_params(fn)
    try:
        _field_params_cache[key] = params
    except TypeError:
        pass
    return params


def reward_takes_fields(reward_fn: RewardFn) -> bool:
    """Whether the reward takes any prompt field: a parameter after ``(prompts, responses)`` or
    ``**kwargs`` (:func:`check_reward_fields`); for several rewards
    (:class:`~pyppo.reward_sum.RewardSum`), whether one of them does."""
    from .reward_sum import RewardSum  # it builds on this module

    if isinstance(reward_fn, RewardSum):
        return any(reward_takes_fields(fn) for fn in reward_fn.rewards)
    params = _field_params(reward_fn)
    return params.any or bool(params.named)


def check_reward_fields(reward_fn: RewardFn, field_names: Collection[str], *, source: str = "the prompts") -> List[str]:
    """Check, before anything is loaded, that the prompts have every field the reward requires.

    A reward requires a field when it has a parameter of that name, after ``(prompts,
    responses)``, without a default; it receives the fields it names (with or without a default)
    and, with ``**kwargs``, all of them. The signature is read once per function. veRL's
    ``compute_score`` (a parameter named ``solution_str``) requires the fields named like its
    other parameters without a default (``data_source``, ``ground_truth``), but never
    ``extra_info`` (``{}`` when the prompts have none, as veRL passes it). Several rewards
    (:class:`~pyppo.reward_sum.RewardSum`) are checked one by one; they receive the union.

    Args:
        reward_fn: the reward (a :func:`load_reward` result or any callable).
        field_names: the prompts' fields besides ``"prompt"`` (:func:`pyppo.prompts.prompt_fields`).
        source: how the message names the prompts, e.g. ``"--prompts 'data.jsonl'"``.

    Returns:
        The sorted names of the fields that :func:`score_responses` will pass it.

    Raises:
        RewardError (a ValueError): a required field is missing; the message names the reward,
            the field and the fields the prompts have. Or the reward cannot be called in any
            convention (fewer than two positional parameters and none named ``completions`` or
            ``solution_str``), naming its signature and the three conventions.
        RewardTypeError (a RewardError): the reward is an ``async def`` function
            (:func:`check_not_async`).
    """
    from .reward_sum import RewardSum  # it builds on this module

    if isinstance(reward_fn, RewardSum):
        taken = [check_reward_fields(fn, field_names, source=source) for fn in reward_fn.rewards]
        return sorted(set().union(*taken))
    check_not_async(reward_fn)
    params = _field_params(reward_fn)
    if not params.takes_pair:
        name = reward_name(reward_fn)
        raise RewardError(
            f"reward {name!r} takes {_signature_text(reward_fn)}; a reward is called as reward(prompts, "
            "responses, **fields); TRL's way, as reward(prompts=..., completions=..., **fields) when it has "
            "a parameter named completions; or veRL's, once per response, as compute_score(data_source=..., "
            "solution_str=..., ground_truth=..., extra_info=...) when it has one named solution_str "
            "(docs/rewards.md)",
            reward=name,
        )
    names = set(field_names)
    missing = sorted(params.required - names)
    if missing:
        name = reward_name(reward_fn)
        what = f"field {missing[0]!r}" if len(missing) == 1 else f"fields {', '.join(map(repr, missing))}"
        raise RewardError(
            f"reward {name!r} needs the prompt {what}, missing from {source}, whose fields besides "
            f'"prompt" are: {", ".join(map(repr, sorted(names))) or "none"}',
            reward=name,
        )
    return sorted(names - params.positional if params.any else names & params.named)


def _signature_text(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _call_reward(reward_fn: RewardFn, prompts: list, responses: list, fields: Dict[str, list], name: str):
    """``reward_fn(prompts, responses, **fields)``, or in TRL's convention (a parameter named
    ``completions``) ``reward_fn(prompts=prompts, completions=responses, **fields)``, ``prompts``
    only when it takes it; or, veRL's ``compute_score`` (a parameter named ``solution_str``), once
    per response (:func:`pyppo.verl_reward.call_compute_score`: a list of its returns)."""
    params = _field_params(reward_fn)
    if params.verl:
        from .verl_reward import call_compute_score  # it builds on this module

        return call_compute_score(reward_fn, responses, fields, name=name, extra_info=_takes(params, "extra_info"))
    if not params.trl:
        return reward_fn(prompts, responses, **fields)
    given = {"prompts": prompts} if params.any or "prompts" in params.positional else {}
    return reward_fn(**given, completions=responses, **fields)


def _takes(params: _FieldParams, field: str) -> bool:
    return params.any or field in params.named


def _outputs(reward_fn: RewardFn, raw, n: int, name: str) -> "RewardOutput":
    """``raw`` (what :func:`_call_reward` returned) checked: one score or ``None`` per response,
    and, for veRL's ``compute_score``, the numbers of its dict returns (``extras``)."""
    extras: Dict[str, List[Optional[float]]] = {}
    if _field_params(reward_fn).verl:
        from .verl_reward import split_scores  # it builds on this module

        raw, extras = split_scores(raw, name)
    return RewardOutput(validate_scores(raw, n, name), extras)


def _pair_signature(fn: Callable) -> Optional[inspect.Signature]:
    """A TRL- or veRL-convention ``fn``'s signature as its :func:`_checked` wrapper takes it:
    ``(prompts, responses, *, <its fields>)``; ``None`` for any other ``fn`` (the wrapper has its
    signature)."""
    params = _field_params(fn)
    if not (params.trl or params.verl):
        return None
    P = inspect.Parameter
    kept = [
        p.replace(kind=P.KEYWORD_ONLY) if p.kind == P.POSITIONAL_OR_KEYWORD else p
        for p in inspect.signature(fn).parameters.values()
        if p.name not in params.positional and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY, P.VAR_KEYWORD)
    ]
    if params.verl:  # the wrapper's extra_info is as optional as veRL makes it
        kept = [p.replace(default=None) if p.name == "extra_info" and p.default is p.empty else p for p in kept]
    pair = [P("prompts", P.POSITIONAL_OR_KEYWORD), P("responses", P.POSITIONAL_OR_KEYWORD)]
    return inspect.signature(fn).replace(parameters=pair + kept)


class RewardOutput(NamedTuple):
    """One reward's checked output for ``B`` responses (:func:`score_reward`)."""

    #: ``B`` floats, ``None`` where the reward does not apply (TRL's convention).
    scores: List[Optional[float]]
    #: veRL's ``compute_score`` returning dicts: each other key's numbers (``B`` floats or
    #: ``None`` where a dict lacks the key or holds no number there), by key; else empty.
    extras: Dict[str, List[Optional[float]]]


def score_reward(
    reward_fn: RewardFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    where: str,
    fields: Optional[Dict[str, List[Any]]] = None,
) -> RewardOutput:
    """Call one reward and check its output: one finite float, or ``None`` (does not apply), per
    (prompt, response); with veRL's ``compute_score`` also the numbers its dict returns hold.

    The reward is called as ``reward_fn(prompts, responses, **{name: column})`` with the columns
    of ``fields`` that it takes (:func:`check_reward_fields`): a parameter of that name, or
    ``**kwargs``; a reward that takes only ``(prompts, responses)`` is called with those. One with
    a parameter named ``completions`` is called TRL's way: ``reward_fn(prompts=prompts,
    completions=responses, **{name: column})``, ``prompts`` only when it names it or has
    ``**kwargs``. One with a parameter named ``solution_str`` is veRL's ``compute_score``, called
    once per response as veRL's reward managers call it (:mod:`pyppo.verl_reward`). A
    :func:`load_reward` result is checked here once, not twice.

    Args:
        prompts: ``B`` prompt strings.
        responses: ``B`` response strings.
        where: context for error messages, e.g. ``"step 3"``.
        fields: the prompts' other fields, one list of ``B`` values per field name, aligned with
            ``prompts`` (:func:`pyppo.prompts.prompt_columns`); None = no fields.

    Raises:
        RewardError: the reward raised, returned bad scores, or requires a field that ``fields``
            lacks; the message names the reward, ``where`` and, for one bad element, the prompt
            and response at fault.
        ValueError: a column of ``fields`` is not ``B`` long, or ``prompts`` is not.
    """
    name = reward_name(reward_fn)
    fields = fields or {}
    if len(prompts) != len(responses):
        raise ValueError(f"score_reward: {len(prompts)} prompts but {len(responses)} responses ({where})")
    for field, column in fields.items():
        if len(column) != len(prompts):
            raise ValueError(
                f"score_reward: field {field!r} has {len(column)} values for {len(prompts)} prompts ({where})"
            )
    # load_reward's wrapper would check the scores and drop a compute_score's extras: its function
    # is called, and checked, here.
    fn = getattr(reward_fn, "_unchecked", reward_fn)
    try:
        passed = {field: list(fields[field]) for field in check_reward_fields(reward_fn, fields)}
        raw = _call_reward(fn, list(prompts), list(responses), passed, name)
        return _outputs(fn, raw, len(responses), name)
    except RewardError as exc:
        # Also catches a load_reward wrapper's error: add the pair at fault, don't wrap twice.
        detail = where
        if exc.index is not None and 0 <= exc.index < len(responses):
            i = exc.index
            detail += f"; prompt {i}: {_clip_text(str(prompts[i]))!r}, response: {_clip_text(responses[i])!r}"
        raise RewardError(f"{exc} ({detail})", reward=exc.reward, index=exc.index, value=exc.value) from exc
    except Exception as exc:
        raise RewardError(
            f"reward {name!r} raised {type(exc).__name__}: {exc} ({where}, scoring {len(responses)} responses)",
            reward=name,
        ) from exc


def score_responses(
    reward_fn: RewardFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    where: str,
    fields: Optional[Dict[str, List[Any]]] = None,
) -> List[Optional[float]]:
    """The scores of :func:`score_reward`: one finite float per (prompt, response), or ``None``
    where the reward does not apply. Several rewards (:class:`~pyppo.reward_sum.RewardSum`): their
    weighted sum (:func:`pyppo.reward_sum.score_rewards`), a float for every response.

    Raises:
        as :func:`score_reward`.
    """
    from .reward_sum import RewardSum, score_rewards  # it builds on this module

    if isinstance(reward_fn, RewardSum):
        return list(score_rewards(reward_fn, prompts, responses, where=where, fields=fields).scores)
    return score_reward(reward_fn, prompts, responses, where=where, fields=fields).scores


def _checked(fn: Callable, name: str) -> RewardFn:
    """Wrap ``fn`` so that every call validates its output (see :func:`validate_scores`). The
    wrapper is called as ``(prompts, responses, **fields)`` and calls ``fn`` in its convention
    (TRL's keywords, veRL's per response, or pyppo's); its signature is ``fn``'s (``__wrapped__``;
    for TRL's and veRL's conventions :func:`_pair_signature`), so :func:`score_responses` gives it
    the fields ``fn`` takes. Its ``_unchecked`` is ``fn``, which :func:`score_reward` calls
    itself (so as to keep a ``compute_score``'s extras).

    Raises:
        RewardTypeError: ``fn`` is an ``async def`` function (:func:`check_not_async`).
    """
    check_not_async(fn, name)

    @functools.wraps(fn)
    def reward(prompts: list[str], responses: list[str], **fields) -> List[Optional[float]]:
        if len(prompts) != len(responses):
            raise RewardError(
                f"reward {name!r}: got {len(prompts)} prompts but {len(responses)} responses", reward=name
            )
        raw = _call_reward(fn, list(prompts), list(responses), fields, name)
        return _outputs(fn, raw, len(responses), name).scores

    reward.reward_name = name
    reward._unchecked = fn
    pair = _pair_signature(fn)
    if pair is not None:  # the wrapper is called as (prompts, responses), whatever fn's convention
        reward.__signature__ = pair
    return reward


#: The rewards ``--reward`` knows by name (matched before any directory of that name).
BUILTIN_REWARDS: Dict[str, RewardFn] = {
    "sentiment": sentiment_reward,
    "math": math_reward,
    "reasoning-gym": reasoning_gym_reward,  # pyppo.tasks.reasoning_gym: the task's own scorer
}

#: The fields a multi-turn episode gives a reward besides its prompt record's: ``transcript``,
#: each episode's ``[{"role": "agent" | "environment", "turn": k, "text": str}, ...]``
#: (``docs/agents.md``).
EPISODE_FIELDS = ("transcript",)


def load_reward(spec: str | Callable = "sentiment", *, device: str | torch.device = "cpu") -> RewardFn:
    """Turn a reward spec into a validated ``reward_fn(prompts, responses) -> list[float]``.

    Args:
        spec: ``"sentiment"``, ``"math"`` or ``"reasoning-gym"`` (:data:`BUILTIN_REWARDS`); a local directory with a
            sequence-classification model; ``"module:function"`` / ``"file.py:function"``; or a
            callable (wrapped as is). A function may take prompt fields (see :func:`score_responses`).
        device: device of a classifier reward model.

    Returns:
        A callable whose every output is checked by :func:`validate_scores`; its ``reward_name``
        attribute is the spec, and its signature the function's (so it takes the same fields).

    Raises:
        ValueError: the spec matches none of the forms (for a ``.py`` file without
            ``:function``, the message suggests its top-level functions).
        RewardTypeError (a TypeError and a ValueError): the function is ``async def``.
        FileNotFoundError, ModuleNotFoundError, AttributeError, TypeError: the named model, file,
            module or function cannot be used; the message names the spec.
    """
    if callable(spec):
        return _checked(spec, getattr(spec, "__name__", repr(spec)))
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return _checked(BUILTIN_REWARDS[spec], spec)
    path = Path(spec).expanduser()
    # A path is checked before "module:function", so that a directory whose name has a colon in it
    # (or a Windows drive letter) still works.
    if path.is_dir():
        return _checked(SequenceClassifierReward(path, device=device), spec)
    if ":" in spec:
        return _checked(load_function(spec), spec)
    builtin = ", ".join(repr(name) for name in BUILTIN_REWARDS)
    raise ValueError(
        f"reward {spec!r} is not {builtin}, an existing model directory, 'module:function' or "
        f"'file.py:function'{function_hint(spec)}"
    )
