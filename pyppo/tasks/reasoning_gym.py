"""reasoning-gym's procedural tasks as prompt sets, and their own scorers as a reward.

``--prompts reasoning-gym:TASK?size=N&seed=S&<option>=<value>...`` generates ``N`` problems of the
task with ``reasoning_gym.create_dataset(TASK, size=N, seed=S, <option>=<value>, ...)`` (the
options are the fields of the task's config class; a value is read as JSON, else kept as a
string: ``min_terms=2``, ``allow_negation=false``, ``operators=["+","-"]``, ``format_style=natural``).
Each problem becomes a record:

* ``prompt``: the question and :data:`ANSWER_INSTRUCTION` (the answer between ``<answer>`` tags,
  as reasoning-gym's own system prompts ask, ``reasoning_gym.utils.SYSTEM_PROMPTS``); with
  ``system_prompt=NAME`` instead the messages ``[{"role": "system", "content":
  SYSTEM_PROMPTS[NAME]}, {"role": "user", "content": question}]``, as reasoning-gym's examples
  prompt a chat model;
* ``answer``, ``question``, ``metadata``: the problem's entry as reasoning-gym gives it;
* ``task``: the canonical spec that generated it (:func:`canonical_task_spec`: options sorted,
  those at the task's default left out), from which the scorer rebuilds the task with the same
  options.

``--reward reasoning-gym`` (:func:`reasoning_gym_reward`) scores each response with the task's own
``score_answer(answer, entry)``, the answer being the last ``<answer>...</answer>`` of the
response (``reasoning_gym.utils.extract_answer``; none: ``None``, which scores 0).

Seeds: reasoning-gym generates problem ``i`` of a set from the seed ``seed + i``, so ``seed=0`` and
``seed=1`` share all but one problem; a held-out set needs a seed at least ``seed + size`` of the
training set (:func:`check_held_out` refuses an overlap, and a held-out set of the same task
whose questions repeat training questions word for word). Without ``seed`` the seed is
:data:`DEFAULT_SEED` (reasoning-gym's own default draws one at random: a run could not be
repeated, nor resumed).
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import difflib
import functools
import json
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import quote, unquote

__all__ = [
    "ANSWER_INSTRUCTION",
    "DEFAULT_SEED",
    "PREFIX",
    "TaskSpec",
    "canonical_task_spec",
    "check_held_out",
    "is_task_spec",
    "parse_task_spec",
    "reasoning_gym_reward",
    "task_names",
    "task_records",
    "task_version",
]

#: What starts a reasoning-gym spec.
PREFIX = "reasoning-gym:"

#: The seed of a spec that names none.
DEFAULT_SEED = 0

#: The options a spec takes besides the task's config: not passed to its config class.
RESERVED = ("size", "seed", "system_prompt")

#: The instruction after each question: reasoning-gym's scorers read the answer between tags.
ANSWER_INSTRUCTION = (
    "Give only the final answer between <answer> and </answer> tags, in the format the question asks for."
)

_EXTRA = "pip install 'pyppo[reasoning-gym]'"


@dataclass(frozen=True)
class TaskSpec:
    """A parsed ``reasoning-gym:TASK?...`` spec.

    Attributes:
        task: the task's name (a key of ``reasoning_gym.factory.DATASETS``).
        size: problems to generate; ``None`` = the task config's default.
        seed: the first problem's seed (problem ``i`` has ``seed + i``).
        system_prompt: a key of ``reasoning_gym.utils.SYSTEM_PROMPTS``, or ``None`` (a string prompt).
        options: the task config's fields, as ``(name, value)`` pairs sorted by name.
    """

    task: str
    size: Optional[int]
    seed: int
    system_prompt: Optional[str]
    options: Tuple[Tuple[str, Any], ...]

    def text(self) -> str:
        """The spec written back: ``reasoning-gym:TASK?`` and the options, sorted by name, with
        ``seed`` and ``size`` when known."""
        pairs = dict(self.options)
        pairs["seed"] = self.seed
        if self.size is not None:
            pairs["size"] = self.size
        if self.system_prompt is not None:
            pairs["system_prompt"] = self.system_prompt
        query = "&".join(f"{k}={quote(_value_text(v), safe='')}" for k, v in sorted(pairs.items()))
        return f"{PREFIX}{self.task}?{query}"


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) and _parse_value(value) == value else json.dumps(value)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def is_task_spec(source: Any) -> bool:
    """Whether ``source`` is a ``reasoning-gym:...`` spec (a string with :data:`PREFIX`)."""
    return isinstance(source, str) and source.startswith(PREFIX)


def parse_task_spec(spec: str, flag: str = "--prompts") -> TaskSpec:
    """Read ``reasoning-gym:TASK?key=value&...`` (values percent-decoded, then read as JSON or
    kept as strings). Needs no reasoning-gym.

    Raises:
        ValueError: naming ``flag`` and the spec: no task, an option without ``=``, one given
            twice, a ``size`` that is not an int >= 1, a ``seed`` that is not an int >= 0, a
            ``system_prompt`` that is not a string.
    """
    where = f"{flag} {spec!r}"
    if not is_task_spec(spec):
        raise ValueError(f"{where}: expected {PREFIX}TASK[?option=value&...]")
    task, _, query = spec[len(PREFIX) :].partition("?")
    if not task:
        raise ValueError(f"{where}: no task name after {PREFIX!r} (pyppo info lists the tasks)")
    options: Dict[str, Any] = {}
    for part in query.split("&") if query else []:
        key, eq, text = part.partition("=")
        key = unquote(key)
        if not eq or not key:
            raise ValueError(f"{where}: option {part!r} is not key=value")
        if key in options:
            raise ValueError(f"{where}: option {key!r} is given twice")
        options[key] = _parse_value(unquote(text))
    size, seed = options.pop("size", None), options.pop("seed", DEFAULT_SEED)
    system_prompt = options.pop("system_prompt", None)
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"{where}: size must be an int >= 1, got {size!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"{where}: seed must be an int >= 0, got {seed!r}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"{where}: system_prompt must be the name of one of reasoning-gym's system prompts")
    return TaskSpec(task, size, seed, system_prompt, tuple(sorted(options.items())))


def _package(why: str):
    """``reasoning_gym``, or a one-line error naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"{why}: the reasoning-gym package is not installed ({_EXTRA}): {exc}", name="reasoning_gym"
        ) from exc
    return reasoning_gym


def task_names() -> List[str]:
    """The names of reasoning-gym's tasks, sorted.

    Raises:
        ModuleNotFoundError: reasoning-gym is not installed (naming the extra).
    """
    _package("the reasoning-gym tasks")
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def task_version() -> Optional[str]:
    """The installed reasoning-gym's version (its package metadata), or ``None``."""
    from importlib import metadata

    try:
        return metadata.version("reasoning-gym")
    except metadata.PackageNotFoundError:
        return None


def _task_classes(spec: TaskSpec, where: str):
    """``(dataset class, config class)`` of the spec's task, its options checked against the
    config's fields.

    Raises:
        ModuleNotFoundError: reasoning-gym is not installed. ValueError: an unknown task (with
            the closest names) or option (with the config's fields), or a reserved field.
    """
    _package(where)
    from reasoning_gym.factory import DATASETS

    if spec.task not in DATASETS:
        lower = {name.lower(): name for name in DATASETS}
        close = [lower[spec.task.lower()]] if spec.task.lower() in lower else []
        close += [lower[n] for n in difflib.get_close_matches(spec.task.lower(), lower, n=3) if lower[n] not in close]
        close = close[:3]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise ValueError(
            f"{where}: reasoning-gym has no task {spec.task!r}{hint}; `pyppo info` lists its {len(DATASETS)} tasks"
        )
    dataset_cls, config_cls = DATASETS[spec.task]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("size", "seed")]
    unknown = [k for k, _ in spec.options if k not in fields]
    if unknown:
        raise ValueError(
            f"{where}: task {spec.task!r} has no option {unknown[0]!r}; its options are "
            f"{', '.join(fields + list(RESERVED))}"
        )
    return dataset_cls, config_cls


def _default_size(config_cls) -> int:
    for f in dataclasses.fields(config_cls):
        if f.name == "size" and isinstance(f.default, int):
            return f.default
    return 500


_NO_DEFAULT = object()


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        try:
            return field.default_factory()
        except Exception:  # a factory that needs more than nothing: no default to compare with
            return _NO_DEFAULT
    return _NO_DEFAULT


def _hints(config_cls) -> Dict[str, Any]:
    try:
        return typing.get_type_hints(config_cls)
    except Exception:  # an annotation that does not resolve: no types to check
        return {}


def _fits(value: Any, hint: Any) -> Optional[bool]:
    """Whether a spec's value (read as JSON) fits the config field's annotation ``hint``: True,
    False, or None where the annotation is not one of JSON's types (a class, an enum, a date)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin is typing.Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        answers = [_fits(value, arg) for arg in args]
        return True if True in answers else (False if all(a is False for a in answers) else None)
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    sequence = (list, tuple, collections.abc.Sequence)
    if hint in sequence or origin in sequence:
        if not isinstance(value, list):  # JSON has lists only: a tuple field takes one too
            return False
        if origin is tuple and args and args[-1] is not Ellipsis and len(args) != len(value):
            return None if any(_fits(v, a) is None for v, a in zip(value, args)) else False
        inner = [a for a in args if a is not Ellipsis]
        if len(inner) == 1 or (origin is tuple and inner and all(a == inner[0] for a in inner)):
            answers = [_fits(v, inner[0]) for v in value]
            return False if False in answers else (None if None in answers else True)
        if origin is tuple and len(inner) == len(value):
            answers = [_fits(v, a) for v, a in zip(value, inner)]
            return False if False in answers else (None if None in answers else True)
        return None if args else True
    return None


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin is typing.Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    names = {bool: "true or false", int: "an int", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if hint in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
        inner = {a for a in args if a is not Ellipsis}
        plural = {int: " of ints", float: " of numbers", str: " of strings"}
        return "a JSON list" + (plural.get(next(iter(inner)), "") if len(inner) == 1 else "")
    return getattr(hint, "__name__", str(hint))


def _hint_text(hint: Any) -> str:
    text = getattr(hint, "__name__", None) if typing.get_origin(hint) is None else None
    return text or str(hint).replace("typing.", "")


def _check_types(spec: TaskSpec, config_cls, where: str) -> None:
    """Refuse an option whose value does not fit its config field's annotation, naming the option,
    the type it takes and its default (before the config's own checks, which say less)."""
    hints = _hints(config_cls)
    defaults = {f.name: _field_default(f) for f in dataclasses.fields(config_cls)}
    for name, value in spec.options:
        hint = hints.get(name)
        if hint is None:
            default = defaults.get(name, _NO_DEFAULT)
            hint = type(default) if type(default) in (bool, int, float, str) else None
        if hint is None or _fits(value, hint) is not False:
            continue
        default = defaults.get(name, _NO_DEFAULT)
        shown = "" if default is _NO_DEFAULT else f", default {_value_text(_plain(default))}"
        quoted = ' (a string that is JSON needs its quotes: name="...")' if hint is str else ""
        raise ValueError(
            f"{where}: option {name}={_value_text(value)} must be {_describe(hint)}{quoted} "
            f"({config_cls.__name__}.{name}: {_hint_text(hint)}{shown})"
        )


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples as lists), where it is JSON; else as it is."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return value


def _same(value: Any, default: Any) -> bool:
    """Whether a spec's value is the field's default: the same JSON text (so ``true`` is not
    ``1``), a number of a float field compared as a float."""
    if default is _NO_DEFAULT:
        return False
    try:
        return json.dumps(value, sort_keys=True) == json.dumps(_plain(default), sort_keys=True)
    except (TypeError, ValueError):
        return False


def _is_float_field(hint: Any) -> bool:
    return hint is float or (typing.get_origin(hint) is typing.Union and float in typing.get_args(hint))


def canonical_task_spec(spec: str, flag: str = "--prompts") -> str:
    """The spec in one spelling: the task's options sorted, those equal to the task's default left
    out (``min_terms=2`` of ``chain_sum`` is ``chain_sum`` itself; an int of a float field is
    written as a float), ``size`` (the task's default when not given) and ``seed`` always
    written. It is what a run records, and two spellings of one set compare equal.

    Raises:
        as :func:`parse_task_spec` and (the task and its options are checked: names and the types
        of their config fields) :func:`task_records`.
    """
    where = f"{flag} {spec!r}"
    parsed = parse_task_spec(spec, flag)
    _, config_cls = _task_classes(parsed, where)
    _check_types(parsed, config_cls, where)
    hints = _hints(config_cls)
    defaults = {f.name: _field_default(f) for f in dataclasses.fields(config_cls)}
    options = []
    for name, value in parsed.options:
        if _is_float_field(hints.get(name)) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not _same(value, defaults.get(name, _NO_DEFAULT)):
            options.append((name, value))
    size = parsed.size if parsed.size is not None else _default_size(config_cls)
    return dataclasses.replace(parsed, size=size, options=tuple(options)).text()


def _make_dataset(spec: TaskSpec, where: str, *, size: int):
    dataset_cls, config_cls = _task_classes(spec, where)
    try:
        config = config_cls(**dict(spec.options), seed=spec.seed, size=size)
        return dataset_cls(config=config)
    except (AssertionError, ValueError, TypeError, KeyError) as exc:  # the config's own validate()
        raise ValueError(f"{where}: task {spec.task!r} refuses its options: {type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=8)
def _problems(canonical: str, where: str) -> Tuple[Tuple[str, Any, Any], ...]:
    """``(question, answer, metadata)`` of each problem of a canonical spec (its system prompt
    aside), kept for the next call: :func:`check_held_out` and the run's loading read the same
    sets. The callers copy ``metadata``."""
    parsed = parse_task_spec(canonical)
    dataset = _make_dataset(parsed, where, size=parsed.size)
    problems = []
    for i in range(parsed.size):
        try:
            entry = dataset[i]
        except Exception as exc:  # the task's generator, on options its validate() let through
            raise ValueError(
                f"{where}: task {parsed.task!r} failed to generate problem {i} (seed {parsed.seed + i}): "
                f"{type(exc).__name__}: {exc}"
            ) from None
        problems.append((entry["question"], entry["answer"], entry["metadata"]))
    return tuple(problems)


def _questions(spec: TaskSpec, where: str) -> List[str]:
    return [q for q, _, _ in _problems(dataclasses.replace(spec, system_prompt=None).text(), where)]


def task_records(spec: str, flag: str = "--prompts") -> List[Dict[str, Any]]:
    """The prompt records of a ``reasoning-gym:...`` spec (see the module).

    Args:
        spec: ``reasoning-gym:TASK?size=N&seed=S&...``.
        flag: the option that named it, for the messages.

    Returns:
        ``size`` dicts ``{"prompt", "answer", "question", "metadata", "task"}``, in reasoning-gym's
        order; the same every time for the same spec and reasoning-gym version.

    Raises:
        ModuleNotFoundError: reasoning-gym is not installed (naming the extra ``reasoning-gym``).
        ValueError: a bad spec, an unknown task, option or system prompt, an option whose value
            is not of its config field's type, options the task's config refuses, or a problem
            its generator fails on; one line naming ``flag`` and the spec.
    """
    where = f"{flag} {spec!r}"
    canonical = canonical_task_spec(spec, flag)
    parsed = parse_task_spec(canonical, flag)
    system = None
    if parsed.system_prompt is not None:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if parsed.system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(
                f"{where}: system_prompt must be one of {', '.join(map(repr, SYSTEM_PROMPTS))}, "
                f"got {parsed.system_prompt!r}"
            )
        system = SYSTEM_PROMPTS[parsed.system_prompt]
    records = []
    for question, answer, metadata in _problems(dataclasses.replace(parsed, system_prompt=None).text(), where):
        if system is None:
            prompt: Any = f"{question}\n\n{ANSWER_INSTRUCTION}"
        else:
            prompt = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        records.append(
            {
                "prompt": prompt,
                "answer": copy.deepcopy(answer),
                "question": question,
                "metadata": copy.deepcopy(metadata),
                "task": canonical,
            }
        )
    return records


#: How many other seeds :func:`check_held_out` tries for a held-out set free of training questions.
FREE_SEED_TRIES = 8


def check_held_out(prompts: Optional[str], eval_prompts: Optional[str]) -> None:
    """Refuse held-out problems that the training set also has, where both sets are reasoning-gym
    specs of one task (other sources pass; the specs are canonicalised, so an option written at
    its default is no other set):

    * the same options, and seed ranges ``[seed, seed + size)`` that overlap (reasoning-gym seeds
      problem ``i`` with ``seed + i``): the problems shared, and the first free seed;
    * otherwise (other options, or seeds apart) the generated questions are compared: a held-out
      question that is word for word a training question is refused, with how many there are
      and a seed whose set has none (other options draw the same numbers from the same seed, and
      a task with few distinct questions repeats some).

    Raises:
        ValueError: naming both specs, how many problems they share and a seed that shares none.
        ModuleNotFoundError: reasoning-gym is not installed.
    """
    if not (is_task_spec(prompts) and is_task_spec(eval_prompts)):
        return
    a = parse_task_spec(canonical_task_spec(prompts))
    b = parse_task_spec(canonical_task_spec(eval_prompts, "--eval-prompts"), "--eval-prompts")
    if a.task != b.task:
        return
    heading = f"--eval-prompts {eval_prompts!r} shares"
    if a.options == b.options:
        shared = min(a.seed + a.size, b.seed + b.size) - max(a.seed, b.seed)
        if shared > 0:
            below = a.seed - b.size  # the held-out set may also end before the training set starts
            raise ValueError(
                f"{heading} {shared} of its {b.size} problems with --prompts {prompts!r} "
                f"(reasoning-gym generates problem i from seed + i): give the held-out set a seed >= "
                f"{a.seed + a.size}" + (f" (or <= {below})" if below >= 0 else "")
            )
    training = set(_questions(a, f"--prompts {prompts!r}"))
    held_out = _questions(b, f"--eval-prompts {eval_prompts!r}")
    shared_at = [i for i, q in enumerate(held_out) if q in training]
    if not shared_at:
        return
    first = " ".join(held_out[shared_at[0]].split())
    first = first if len(first) <= 60 else "..." + first[-57:]  # its end: questions share a preamble
    message = (
        f"{heading} {len(shared_at)} of its {b.size} questions word for word with --prompts {prompts!r} "
        f"(problem {shared_at[0]}: {first!r})"
    )
    # A free seed: past the training seeds where the ranges meet (the same seed draws the same
    # numbers under other options), then past each repeat found.
    seed = a.seed + a.size if b.seed < a.seed + a.size and a.seed < b.seed + b.size else b.seed + shared_at[-1] + 1
    for _ in range(FREE_SEED_TRIES):
        candidate = dataclasses.replace(b, seed=seed)
        questions = _questions(candidate, f"--eval-prompts {candidate.text()!r}")
        repeats = [i for i, q in enumerate(questions) if q in training]
        if not repeats:
            raise ValueError(f"{message}: give the held-out set another seed (seed={seed} shares none)")
        seed += repeats[-1] + 1
    # No seed gives a set without them: the task has few distinct questions with these options, so
    # no held-out set can avoid every training question; said, not refused (it is the task's nature).
    warnings.warn(
        f"{message}, and so do the sets of the next {FREE_SEED_TRIES} seeds tried (up to seed={seed}): with "
        "these options the task has few distinct questions, so the evaluation partly measures training "
        "questions; hold out fewer problems, train on fewer, or use other options for a set that shares none",
        UserWarning,
        stacklevel=2,
    )


# ------------------------------------------------------------------------------------- the reward


@functools.lru_cache(maxsize=64)
def _scorer(task: str) -> Callable[..., float]:
    """The ``score_answer`` of a canonical spec's task (its options, as generated), or of a task
    name (its default options)."""
    where = f"reward 'reasoning-gym': task {task!r}"
    spec = parse_task_spec(task, where) if is_task_spec(task) else TaskSpec(task, 1, DEFAULT_SEED, None, ())
    return _make_dataset(spec, where, size=1).score_answer


_warned: set = set()


def reasoning_gym_reward(
    prompts: Sequence[Any],
    responses: Sequence[str],
    answer: Sequence[Any],
    metadata: Sequence[Dict[str, Any]],
    question: Optional[Sequence[str]] = None,
    task: Optional[Sequence[Optional[str]]] = None,
) -> List[float]:
    """``--reward reasoning-gym``: each response scored by its task's own ``score_answer(answer,
    entry)`` (reasoning-gym's scores: 1.0 for a right answer, less for a wrong or partial one,
    0.0 for none).

    The answer is the content of the response's last ``<answer>...</answer>``
    (``reasoning_gym.utils.extract_answer``), ``None`` without one. The entry is rebuilt from the
    record's fields: ``{"question", "answer", "metadata"}``. The task is the record's ``task``
    (its options as generated) or, without one, ``metadata["source_dataset"]`` with its default
    options. A scorer that raises on a response's answer (some parse it) scores it 0.0, with a
    warning once per task naming the error.

    Args:
        prompts: ``B`` prompts (unused). responses: ``B`` strings.
        answer, metadata: the records' fields (:func:`task_records`), ``B`` each.
        question, task: the records' fields, when they have them.

    Raises:
        ModuleNotFoundError: reasoning-gym is not installed.
        ValueError: a record whose task is unknown, or without ``task`` and whose metadata names
            no ``source_dataset``.
    """
    _package("reward 'reasoning-gym'")
    from reasoning_gym.utils import extract_answer

    scores = []
    for i, response in enumerate(responses):
        name = task[i] if task is not None and task[i] else (metadata[i] or {}).get("source_dataset")
        if not name:
            raise ValueError(f"reasoning_gym_reward: prompt {i} has no task field and its metadata no source_dataset")
        asked = question[i] if question is not None else None
        entry = {"question": asked, "answer": answer[i], "metadata": metadata[i]}
        score_answer = _scorer(name)
        try:
            score = score_answer(answer=extract_answer(response), entry=entry)
        except Exception as exc:  # a scorer's parse of a malformed answer: a wrong answer
            if name not in _warned:
                _warned.add(name)
                warnings.warn(
                    f"reasoning-gym task {name!r}: score_answer raised {type(exc).__name__}: {exc}; such "
                    "answers score 0.0 (said once per task)",
                    UserWarning,
                    stacklevel=2,
                )
            score = 0.0
        scores.append(float(score))
    return scores
