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
* ``task``: the canonical spec that generated it (:func:`canonical_task_spec`), from which the
  scorer rebuilds the task with the same options.

``--reward reasoning-gym`` (:func:`reasoning_gym_reward`) scores each response with the task's own
``score_answer(answer, entry)``, the answer being the last ``<answer>...</answer>`` of the
response (``reasoning_gym.utils.extract_answer``; none: ``None``, which scores 0).

Seeds: reasoning-gym generates problem ``i`` of a set from the seed ``seed + i``, so ``seed=0`` and
``seed=1`` share all but one problem; a held-out set needs a seed at least ``seed + size`` of the
training set (:func:`check_held_out` refuses an overlap). Without ``seed`` the seed is
:data:`DEFAULT_SEED` (reasoning-gym's own default draws one at random: a run could not be
repeated, nor resumed).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
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
        close = difflib.get_close_matches(spec.task, DATASETS, n=3)
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


def canonical_task_spec(spec: str, flag: str = "--prompts") -> str:
    """The spec with every option explicit and sorted, ``size`` (the task's default when not
    given) and ``seed`` included: what a run records, so that a resumed run generates the same
    problems even if a default changes, and two spellings of one set compare equal.

    Raises:
        as :func:`parse_task_spec` and (the task and its options are checked) :func:`task_records`.
    """
    parsed = parse_task_spec(spec, flag)
    _, config_cls = _task_classes(parsed, f"{flag} {spec!r}")
    if parsed.size is None:
        parsed = dataclasses.replace(parsed, size=_default_size(config_cls))
    return parsed.text()


def _make_dataset(spec: TaskSpec, where: str, *, size: int):
    dataset_cls, config_cls = _task_classes(spec, where)
    try:
        config = config_cls(**dict(spec.options), seed=spec.seed, size=size)
        return dataset_cls(config=config)
    except (AssertionError, ValueError, TypeError, KeyError) as exc:  # the config's own validate()
        raise ValueError(f"{where}: task {spec.task!r} refuses its options: {type(exc).__name__}: {exc}") from None


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
        ValueError: a bad spec, an unknown task, option or system prompt, options the task's
            config refuses, or a problem its generator fails on; one line naming ``flag`` and the spec.
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
    dataset = _make_dataset(parsed, where, size=parsed.size)
    records = []
    for i in range(parsed.size):
        try:
            entry = dataset[i]
        except Exception as exc:  # the task's generator, on options its validate() let through
            raise ValueError(
                f"{where}: task {parsed.task!r} failed to generate problem {i} (seed {parsed.seed + i}): "
                f"{type(exc).__name__}: {exc}"
            ) from None
        question = entry["question"]
        if system is None:
            prompt: Any = f"{question}\n\n{ANSWER_INSTRUCTION}"
        else:
            prompt = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        records.append(
            {
                "prompt": prompt,
                "answer": entry["answer"],
                "question": question,
                "metadata": entry["metadata"],
                "task": canonical,
            }
        )
    return records


def check_held_out(prompts: Optional[str], eval_prompts: Optional[str]) -> None:
    """Refuse held-out problems that the training set also has: two canonical specs of one task
    with the same options whose seed ranges ``[seed, seed + size)`` overlap (reasoning-gym seeds
    problem ``i`` with ``seed + i``). Other sources pass.

    Raises:
        ValueError: naming both specs, how many problems they share and the first free seed.
    """
    if not (is_task_spec(prompts) and is_task_spec(eval_prompts)):
        return
    a, b = parse_task_spec(prompts), parse_task_spec(eval_prompts, "--eval-prompts")
    if (a.task, a.options) != (b.task, b.options) or a.size is None or b.size is None:
        return
    shared = min(a.seed + a.size, b.seed + b.size) - max(a.seed, b.seed)
    if shared > 0:
        below = a.seed - b.size  # the held-out set may also end before the training set starts
        raise ValueError(
            f"--eval-prompts {eval_prompts!r} shares {shared} of its {b.size} problems with --prompts {prompts!r} "
            f"(reasoning-gym generates problem i from seed + i): give the held-out set a seed >= "
            f"{a.seed + a.size}" + (f" (or <= {below})" if below >= 0 else "")
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
