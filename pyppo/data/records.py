"""Prompt records checked: a ``"prompt"`` that is a string or chat messages, veRL's answer lifted,
the same fields in every record; and a ``datasets.Dataset`` given to the trainer, read as records."""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

from .files import Row, dataset_rows
from .messages import check_prompt
from .verl import lift_ground_truth

__all__ = ["checked_rows", "is_dataset", "prompt_list", "same_fields"]


def checked_rows(rows: Iterable[Row]) -> Iterator[Row]:
    """Each ``(where, record)`` with its ``"prompt"`` checked (:func:`pyppo.data.messages.check_prompt`)
    and, in veRL's layout, its ``ground_truth`` lifted (:func:`pyppo.data.verl.lift_ground_truth`).

    Raises:
        ValueError: a record without ``"prompt"`` (naming its keys), or a bad prompt, naming
            ``where``.
    """
    for where, record in rows:
        if "prompt" not in record:
            raise ValueError(f'{where}: missing key "prompt" (keys: {sorted(record)})')
        record = lift_ground_truth(record)
        record["prompt"] = check_prompt(record["prompt"], where)
        yield where, record


def _names(fields) -> str:
    return ", ".join(repr(f) for f in sorted(fields)) or "none"


def same_fields(rows: Iterable[Row]) -> List[Dict[str, Any]]:
    """The records of ``rows``, every one with the first one's fields (a reward receives each
    field as a column).

    Raises:
        ValueError: a record whose fields besides ``"prompt"`` differ from the first one's,
            naming both records and their fields.
    """
    records: List[Dict[str, Any]] = []
    first_where, first_fields = "", frozenset()
    for where, record in rows:
        fields = frozenset(record) - {"prompt"}
        if not records:
            first_where, first_fields = where, fields
        elif fields != first_fields:
            unit = "line" if re.search(r":\d+$", where) else "record"
            raise ValueError(
                f'{where}: its fields besides "prompt" are {_names(fields)}, but {first_where}\'s are '
                f"{_names(first_fields)}; every {unit} needs the same fields (a reward receives each "
                "as a column)"
            )
        records.append(record)
    return records


def is_dataset(prompts: Any) -> bool:
    """Whether ``prompts`` is a ``datasets.Dataset`` or ``DatasetDict`` (without importing
    ``datasets``: an object of it exists only when it was imported)."""
    module = type(prompts).__module__ or ""
    return module == "datasets" or module.startswith("datasets.")


def prompt_list(prompts: Any, what: str = "prompts") -> Optional[Sequence[Any]]:
    """The trainer's prompts: a ``datasets.Dataset`` (of a ``DatasetDict``, its ``"train"``
    split) read into checked records with the same fields, as a file of it would be; anything
    else as it is (``None``, a list of strings or records: the trainer checks those).

    Args:
        prompts: what ``PPOTrainer(prompts=...)`` or ``eval_prompts=`` was given.
        what: the argument's name, for the messages (``prompts[3]``).

    Raises:
        ValueError: as :func:`checked_rows` and :func:`same_fields`, naming ``what[i]``.
    """
    if not is_dataset(prompts):
        return prompts
    rows = ((f"{what}[{where.rpartition(' ')[2]}]", record) for where, record in dataset_rows(prompts, what))
    return same_fields(checked_rows(rows))
