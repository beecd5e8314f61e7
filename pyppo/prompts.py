"""Prompt sets (the built-in ones, files, ``reasoning-gym:`` specs) and the seeded order they are
sampled in.

A prompt set is a list of records, ``{"prompt": str | [messages], <other fields>}``: a file's
records (JSON Lines, JSON, Parquet, CSV, a saved ``datasets`` dataset: :mod:`pyppo.data`), a
built-in set (:data:`BUILTIN_PROMPT_SETS`) or a reasoning-gym task's problems
(:mod:`pyppo.tasks.reasoning_gym`). The fields besides ``"prompt"`` (an ``"answer"``, say) reach
the reward as columns (:func:`pyppo.rewards.score_responses`).

The default prompts (:data:`DEFAULT_PROMPTS`) are short and open-ended, inviting an opinion or a
description, so that the default sentiment reward has room to move: a response about a rainy
afternoon can be gloomy or cheerful, and PPO learns which one scores. The ``arithmetic`` set
(:func:`arithmetic_prompts`) has an answer to check, for ``--reward math``.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from .data import check_prompt, checked_rows, is_prompt, read_rows, same_fields
from .data.files import MissingPackage
from .tasks.reasoning_gym import canonical_task_spec, is_task_spec, task_records

if TYPE_CHECKING:  # numpy only where prompts are sampled: `pyppo info` runs without it (the wheel needs torch alone)
    import numpy as np

__all__ = [
    "ARITHMETIC_EVAL_SIZE",
    "BUILTIN_PROMPT_SETS",
    "DEFAULT_PROMPTS",
    "PromptSampler",
    "arithmetic_prompts",
    "load_prompt_records",
    "load_prompts",
    "prompt_columns",
    "prompt_fields",
    "resolve_prompt_source",
    "shared_prompts",
    "warn_shared_prompts",
]

DEFAULT_PROMPTS: list[str] = [
    # Descriptions
    "Describe a rainy afternoon in the city.",
    "Describe the first day of spring.",
    "Describe a busy train station in the morning.",
    "Describe the view from a mountain top.",
    "Describe a walk along the beach at sunset.",
    "Describe your ideal weekend.",
    "Describe a small village in winter.",
    "Describe the smell of fresh bread.",
    "Describe a crowded farmers' market.",
    "Describe an old bookshop.",
    "Describe a thunderstorm at night.",
    "Describe a quiet morning at home.",
    "Describe a long road trip.",
    "Describe a football match from the stands.",
    "Describe a forest in autumn.",
    "Describe the last day of school.",
    "Describe a family dinner.",
    "Describe a neighbourhood cafe.",
    "Describe a snowy street at dawn.",
    "Describe a visit to the dentist.",
    "Describe a city park on a Sunday.",
    "Describe a hospital waiting room.",
    "Describe a concert in a small club.",
    "Describe moving into a new flat.",
    "Describe a day without electricity.",
    "Describe a garden after the rain.",
    "Describe a late-night bus ride.",
    "Describe your favourite meal.",
    "Describe an airport during a delay.",
    "Describe a lake in the early morning.",
    "Describe the first day at a new job.",
    "Describe a museum on a weekday.",
    # Opinions
    "What do you think of public libraries?",
    "What do you think of working from home?",
    "What is your opinion of modern architecture?",
    "How do you feel about Mondays?",
    "What do you think of social media?",
    "What is your view on homework for children?",
    "What do you think of electric cars?",
    "How do you feel about long winters?",
    "What do you think of fast food?",
    "What is your opinion of reality television?",
    "What do you think of learning a second language?",
    "How do you feel about living in a big city?",
    "What do you think of online shopping?",
    "What is your opinion of open-plan offices?",
    "What do you think of public transport?",
    "How do you feel about getting older?",
    "What do you think of video games?",
    "What is your opinion of camping?",
    "What do you think of self-driving cars?",
    "How do you feel about rainy days?",
    "What do you think of tax returns?",
    "What is your opinion of school uniforms?",
    "What do you think of smartphones?",
    "How do you feel about traffic jams?",
    "What do you think of classical music?",
    "What is your opinion of remote meetings?",
    "What do you think of cooking at home?",
    "How do you feel about moving to another country?",
    "What do you think of modern art?",
    "What is your opinion of early mornings?",
    "What do you think of team sports?",
    "How do you feel about the news these days?",
    "Write a short review of a movie you remember.",
    "Write a short review of a restaurant you visited.",
    "Tell me about your neighbours.",
    "Tell me about a recent trip.",
]


#: Prompts the ``arithmetic-eval`` set holds back from ``arithmetic``.
ARITHMETIC_EVAL_SIZE = 64


def arithmetic_prompts(split: str = "train", *, seed: int = 0) -> list[dict]:
    """The built-in arithmetic problems: ``{"prompt": "What is 7 + 12? Give the answer as a number.",
    "answer": "19"}``.

    Every sum ``a + b`` and every difference ``a - b >= 0`` of two numbers from 1 to 20 (610
    problems), small enough that a 135M instruct model solves some of them, so that RL with
    ``--reward math`` has something to improve. ``"eval"`` is :data:`ARITHMETIC_EVAL_SIZE` of them,
    chosen by a hash of ``seed`` and the question (the same on every machine and Python version);
    ``"train"`` is the rest. Both are in the order ``+`` before ``-``, then by ``a``, then ``b``.

    Args:
        split: ``"train"`` (``--prompts arithmetic``) or ``"eval"`` (``--eval-prompts arithmetic-eval``).
        seed: which problems are held out.

    Returns:
        New dicts, one per problem; ``"answer"`` is the result as a string.

    Raises:
        ValueError: an unknown split.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"arithmetic_prompts: split must be 'train' or 'eval', got {split!r}")
    problems = [(a, op, b) for op in "+-" for a in range(1, 21) for b in range(1, 21) if op == "+" or a >= b]

    def question(a: int, op: str, b: int) -> str:
        return f"What is {a} {op} {b}? Give the answer as a number."

    def rank(problem) -> bytes:
        return hashlib.sha256(f"{seed}:{question(*problem)}".encode()).digest()

    held_out = set(sorted(problems, key=rank)[:ARITHMETIC_EVAL_SIZE])
    return [
        {"prompt": question(a, op, b), "answer": str(a + b if op == "+" else a - b)}
        for a, op, b in problems
        if ((a, op, b) in held_out) == (split == "eval")
    ]


#: The prompt sets ``--prompts`` and ``--eval-prompts`` know by name (a file of that name needs a
#: path such as ``./arithmetic``).
BUILTIN_PROMPT_SETS: Dict[str, Callable[[], List[dict]]] = {
    "arithmetic": lambda: arithmetic_prompts("train"),
    "arithmetic-eval": lambda: arithmetic_prompts("eval"),
}


def _checked_records(source: str | os.PathLike, flag: str) -> Iterator[Tuple[str, dict]]:
    """``(where, record)`` for each prompt of a built-in set, a ``reasoning-gym:`` spec or a file,
    its ``"prompt"`` checked (:func:`pyppo.data.checked_rows`); ``where`` names the record
    (``path:line``, ``path: row 3``) for messages."""
    if isinstance(source, str) and source in BUILTIN_PROMPT_SETS:
        for i, record in enumerate(BUILTIN_PROMPT_SETS[source]()):
            yield f"{flag} {source!r}, prompt {i}", record
        return
    if is_task_spec(source):
        rows = ((f"{flag} {source!r}, prompt {i}", r) for i, r in enumerate(task_records(source, flag)))
        yield from checked_rows(rows)
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{flag} {str(path)!r} does not exist")
    empty = True
    try:
        for where, record in checked_rows(read_rows(path)):
            empty = False
            yield where, record
    except MissingPackage as exc:  # one line naming the flag, the file and the extra to install
        raise ModuleNotFoundError(f"{flag} {str(path)!r}: {exc.why}", name=exc.name) from None
    if empty:
        raise ValueError(f'{flag} {str(path)!r}: the file holds no prompt (one {{"prompt": ...}} per record)')


def resolve_prompt_source(source: str, *, flag: str = "--prompts") -> str:
    """``source`` as a run records it, so that ``--resume`` reads the same prompts from any
    directory: a built-in set's name as it is, a ``reasoning-gym:`` spec in its canonical
    spelling (:func:`pyppo.tasks.reasoning_gym.canonical_task_spec`: options sorted, those at the
    task's default left out, ``size`` and ``seed`` written), a file or directory as its absolute
    path.

    Raises:
        FileNotFoundError: no such set, spec, file or directory (naming ``flag``).
        ValueError, ModuleNotFoundError: a bad ``reasoning-gym:`` spec, or reasoning-gym missing.
    """
    if source in BUILTIN_PROMPT_SETS:
        return source
    if is_task_spec(source):
        return canonical_task_spec(source, flag)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{flag} {source!r}: no such file or directory")
    return str(path.resolve())


def load_prompt_records(source: str | os.PathLike, *, flag: str = "--prompts") -> list[dict]:
    """Read a prompt set: a file (JSON Lines, JSON, Parquet, CSV: :data:`pyppo.data.SUFFIXES`), a
    directory written by ``datasets``' ``save_to_disk``, the name of a built-in set
    (:data:`BUILTIN_PROMPT_SETS`: ``"arithmetic"``, ``"arithmetic-eval"``), or a
    ``reasoning-gym:TASK?...`` spec (:func:`pyppo.tasks.reasoning_gym.task_records`).

    Each record's ``"prompt"`` is a non-empty string or a list of chat messages
    (:mod:`pyppo.data.messages`). The other fields are kept as the file gave them (veRL's
    ``reward_model.ground_truth`` also as ``ground_truth`` and ``answer``:
    :mod:`pyppo.data.verl`); a reward receives each as a column
    (:func:`pyppo.rewards.score_responses`), so every record must have the same ones.

    Args:
        source: the file or directory, a built-in set's name or a spec (matched before any file).
        flag: the option that named it (``--prompts``, ``--eval-prompts``), for the messages.

    Returns:
        One dict per prompt, in the source's order.

    Raises:
        FileNotFoundError: ``source`` is neither a built-in set, a spec nor an existing path.
        ValueError: one line naming the file, the record and the column: an unreadable file or
            unknown suffix, a record without a good ``"prompt"``, fields besides ``"prompt"``
            that differ from the first record's (both records and their fields named), or no
            prompt at all.
        ModuleNotFoundError: a ``reasoning-gym:`` spec without reasoning-gym installed.
    """
    return same_fields(_checked_records(source, flag))


def load_prompts(path: str | os.PathLike, *, flag: str = "--prompts") -> list:
    """The prompts (strings or message lists) of a prompt set, as :func:`load_prompt_records`
    reads them; other fields are ignored, and need not be the same in every record.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_prompt_records`, but for differing fields.
    """
    return [record["prompt"] for _, record in _checked_records(path, flag)]


def prompt_fields(prompts: Sequence[Any]) -> list[str]:
    """The sorted field names besides ``"prompt"`` of a prompt list's first record (none for
    prompts given bare: strings or message lists)."""
    first = prompts[0] if len(prompts) else None
    return sorted(set(first) - {"prompt"}) if isinstance(first, Mapping) else []


def prompt_columns(prompts: Sequence[Any]) -> Tuple[List[Any], Optional[Dict[str, list]]]:
    """Split prompts (strings, message lists, or records as :func:`load_prompt_records` gives
    them) into the prompts themselves and one column per field, as
    :func:`pyppo.rewards.score_responses` takes them.

    Returns:
        ``(prompts, fields)``: each prompt a string or a list of messages; ``fields`` maps each
        field name of the first record to the values of every prompt in order; ``None`` when the
        prompts are given bare or have no other field.

    Raises:
        ValueError: a record lacks a field the first one has.
    """
    texts = [p["prompt"] if isinstance(p, Mapping) else p for p in prompts]
    names = prompt_fields(prompts)
    if not names:
        return texts, None
    columns: Dict[str, list] = {name: [] for name in names}
    for i, p in enumerate(prompts):
        for name in names:
            if not isinstance(p, Mapping) or name not in p:
                raise ValueError(f"prompts[{i}] has no field {name!r}, which prompts[0] has")
            columns[name].append(p[name])
    return texts, columns


def _prompt_key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def shared_prompts(prompts: Sequence[Any], eval_prompts: Sequence[Any]) -> List[int]:
    """The indices of the held-out prompts that are word for word training prompts (strings as
    they are, message lists message by message; records by their ``"prompt"``)."""
    seen = {_prompt_key(p["prompt"] if isinstance(p, Mapping) else p) for p in prompts}
    return [i for i, p in enumerate(eval_prompts) if _prompt_key(p["prompt"] if isinstance(p, Mapping) else p) in seen]


def warn_shared_prompts(prompts: Sequence[Any], eval_prompts: Sequence[Any], *, source: str, eval_source: str) -> int:
    """Warn (a ``UserWarning``, once) when held-out prompts are also training prompts: the
    evaluation then measures, in part, what was trained on. Only a warning: a file may repeat a
    prompt with another answer, or hold some back on purpose (reasoning-gym specs of one task are
    refused instead: :func:`pyppo.tasks.reasoning_gym.check_held_out`).

    Args:
        prompts, eval_prompts: the two sets (strings, message lists or records).
        source, eval_source: how they are named in the warning (``--prompts 'train.jsonl'``).

    Returns:
        How many held-out prompts are training prompts.
    """
    shared = shared_prompts(prompts, eval_prompts)
    if shared:
        warnings.warn(
            f"{eval_source}: {len(shared)} of its {len(eval_prompts)} prompts are also in {source} (the first: "
            f"prompt {shared[0]}), so the evaluation {'' if len(shared) == len(eval_prompts) else 'partly '}"
            "measures the training prompts",
            UserWarning,
            stacklevel=2,
        )
    return len(shared)


class PromptSampler:
    """Prompts in a seeded random order, epoch after epoch (each epoch a fresh permutation).

    Epoch ``e``'s order is ``numpy.random.default_rng([seed, e]).permutation(N)``, a pure function
    of ``(seed, e)``, so the state is just ``(epoch, position)``. The prompts are strings, lists of
    chat messages, or records (mappings whose ``"prompt"`` is either, as
    :func:`load_prompt_records` gives them); :meth:`sample` returns them as given.

    Raises:
        ValueError: an empty prompt list, or a prompt that is none of those (a message list is
            checked in full: :func:`pyppo.data.check_prompt`).
    """

    def __init__(self, prompts: Sequence[Union[str, Mapping[str, Any]]], seed: int):
        if len(prompts) == 0:
            raise ValueError("prompts must not be empty")
        for i, p in enumerate(prompts):
            prompt = p.get("prompt") if isinstance(p, Mapping) else p
            if not is_prompt(prompt):
                raise ValueError(
                    f'prompts[{i}] must be a str, a list of chat messages, or a mapping with such a "prompt", '
                    f"got {type(p).__name__}"
                )
            if not isinstance(prompt, str):
                check_prompt(prompt, f"prompts[{i}]")
        self.prompts = list(prompts)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._perm: Optional[np.ndarray] = None
        self._perm_epoch = -1

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            import numpy as np

            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.prompts))
            self._perm_epoch = self.epoch
        return self._perm

    def sample(self, k: int) -> list:
        """The next ``k`` prompts (crossing into the next epoch's permutation when needed)."""
        out: list = []
        n = len(self.prompts)
        while len(out) < k:
            perm = self._permutation()
            take = min(k - len(out), n - self.position)
            out.extend(self.prompts[i] for i in perm[self.position : self.position + take])
            self.position += take
            if self.position == n:
                self.epoch += 1
                self.position = 0
        return out

    def sample_groups(self, batch_size: int, group_size: int, rank: int = 0, world_size: int = 1) -> list:
        """One rank's prompts of a step of ``batch_size`` responses, each ``group_size`` times in a
        row (a group): the next ``batch_size / group_size`` prompts are drawn (every rank draws the
        same ones) and rank ``rank`` of ``world_size`` takes its consecutive share, whole groups
        only. Both divisions must be exact (``PPOConfig`` checks them)."""
        per_rank = batch_size // world_size // group_size
        prompts = self.sample(batch_size // group_size)[rank * per_rank : (rank + 1) * per_rank]
        return [prompt for prompt in prompts for _ in range(group_size)]

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": len(self.prompts)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if state["n"] != len(self.prompts):
            raise ValueError(f"state: the checkpoint had {state['n']} prompts, this sampler has {len(self.prompts)}")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
