"""Prompt files in the formats people have them, read into records ``(where, dict)``.

``where`` names the record for error messages: ``path:line`` (JSON Lines, CSV), ``path: record
i`` (a JSON document), ``path: row i`` (Parquet, a saved ``datasets`` dataset). The records are
what the file holds; :mod:`pyppo.data.records` checks their prompts and fields.

=========================================  ====================================================
file                                        read as
=========================================  ====================================================
``.jsonl``, ``.ndjson``, no suffix          JSON Lines: one object per line, blank lines skipped
``.json``                                   a list of records; an object of columns (lists, or
                                            pandas' ``to_json()`` default of index-keyed
                                            objects); pandas' ``orient="split"`` / ``"index"``;
                                            or JSON Lines (``datasets``' ``to_json()``)
``.parquet``                                ``pyarrow.parquet`` (veRL's data files, ``to_parquet``)
``.csv``                                    Python's ``csv``: a header row, every value a string
a directory                                 ``datasets.load_from_disk`` (``save_to_disk``); of a
                                            ``DatasetDict``, its ``"train"`` split
=========================================  ====================================================

Every reader refuses what it cannot read with one line naming the file and, where it is one
record's fault, the record: not UTF-8, not JSON, not Parquet, a repeated key or column, a CSV row
with the wrong number of cells, an unknown suffix.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Tuple

from ..jsonl import read_objects

__all__ = ["DATA_EXTRA", "JSON_LINES_SUFFIXES", "SUFFIXES", "MissingPackage", "dataset_rows", "read_rows"]

#: What installs the packages that Parquet files and saved datasets need.
DATA_EXTRA = "pip install 'pyppo[data]'"


class MissingPackage(ModuleNotFoundError):
    """A file format's package is not installed: ``str()`` is ``"PATH: WHY"``; ``why`` says which
    package, and the extra that installs it, for a message that names the file its own way."""

    def __init__(self, path: Path, why: str, name: str):
        super().__init__(f"{path}: {why}", name=name)
        self.path, self.why = path, why


def _require(path: Path, module: str, package: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackage(path, f"{what} needs the {package} package ({DATA_EXTRA})", package) from None


#: The suffixes read as JSON Lines (a file without a suffix is too).
JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")

#: Every suffix a prompt file may have, and what it is read as.
SUFFIXES = {
    ".jsonl": "JSON Lines",
    ".ndjson": "JSON Lines",
    ".json": "JSON (records, columns, or JSON Lines)",
    ".parquet": "Parquet",
    ".csv": "CSV with a header row",
}

Row = Tuple[str, Dict[str, Any]]


def read_rows(path: Path) -> Iterator[Row]:
    """``(where, record)`` for each record of the prompt file or saved dataset ``path``.

    Args:
        path: an existing file (its suffix picks the format: :data:`SUFFIXES`) or a directory
            written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.

    Raises:
        ValueError: an unknown suffix, a directory that is not a saved dataset, a ``DatasetDict``
            without a ``"train"`` split (naming the splits), or the file's content (see the module).
        MissingPackage: a Parquet file without ``pyarrow`` installed, or a directory without
            ``datasets`` (both: the extra ``pyppo[data]``).
    """
    if path.is_dir():
        yield from _saved_dataset(path)
        return
    suffix = path.suffix.lower()
    if suffix in JSON_LINES_SUFFIXES or not suffix:
        yield from _json_lines(path)
    elif suffix == ".json":
        yield from _json_document(path)
    elif suffix == ".parquet":
        yield from _parquet(path)
    elif suffix == ".csv":
        yield from _csv(path)
    else:
        known = ", ".join(SUFFIXES)
        raise ValueError(
            f"{path}: unknown prompt file suffix {path.suffix!r}; expected one of {known}, no suffix "
            "(JSON Lines), or a directory written by datasets' save_to_disk"
        )


# ------------------------------------------------------------------------------------- JSON Lines


class _RepeatedKey(ValueError):
    pass


def _unique_pairs(pairs: list) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen.add(key)
    return dict(pairs)


def _repeated(where: str, key: str) -> ValueError:
    return ValueError(
        f"{where}: key {key!r} appears more than once in the object; each key must appear once "
        "(JSON keeps only one of the values)"
    )


def _json_lines(path: Path) -> Iterator[Row]:
    # json.loads keeps the last of a repeated key: each line is parsed again to refuse one.
    lines = path.read_bytes().split(b"\n")
    for where, obj in read_objects(path, expected='a JSON object {"prompt": ...}'):
        line = lines[int(where.rpartition(":")[2]) - 1]
        try:
            json.loads(line.decode("utf-8-sig"), object_pairs_hook=_unique_pairs)
        except _RepeatedKey as exc:
            raise _repeated(where, exc.args[0]) from None
        yield where, obj


# ------------------------------------------------------------------------------------------- JSON

_FORMS = (
    'expected a list of records [{"prompt": ...}, ...], an object of columns {"prompt": [...], ...}, '
    "pandas' to_json() (orient columns, split or index), or JSON Lines"
)


def _json_document(path: Path) -> Iterator[Row]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        byte = f"byte 0x{raw[exc.start]:02x} at byte {exc.start + 1}"
        raise ValueError(f"{path}: not UTF-8 ({byte}); save it as UTF-8") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # one value per line: JSON Lines with a .json suffix
            yield from _json_lines(path)
            return
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if isinstance(value, list):
        yield from _json_list(path, text)
    elif isinstance(value, dict):
        _check_unique_keys(path, text)
        yield from _json_object(path, value)
    else:
        raise ValueError(f"{path}: holds a JSON {type(value).__name__}; {_FORMS}")


def _check_unique_keys(path: Path, text: str) -> None:
    try:
        json.loads(text, object_pairs_hook=_unique_pairs)
    except _RepeatedKey as exc:
        raise _repeated(str(path), exc.args[0]) from None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _json_list(path: Path, text: str) -> Iterator[Row]:
    """The records of a JSON array (already parsed once, so valid), each parsed on its own to
    name it, its line and a repeated key in it."""
    decoder = json.JSONDecoder(object_pairs_hook=_unique_pairs)
    i = _skip_space(text, _skip_space(text, 0) + 1)  # past "["
    index = 0
    while text[i] != "]":
        where = f"{path}: record {index} (line {text.count(chr(10), 0, i) + 1})"
        try:
            record, end = decoder.raw_decode(text, i)
        except _RepeatedKey as exc:
            raise _repeated(where, exc.args[0]) from None
        if not isinstance(record, dict):
            raise ValueError(f'{where}: expected a JSON object {{"prompt": ...}}, got {type(record).__name__}')
        yield where, record
        i = _skip_space(text, end)
        if text[i] == ",":
            i = _skip_space(text, i + 1)
        index += 1


def _json_object(path: Path, obj: Dict[str, Any]) -> Iterator[Row]:
    if {"columns", "data"} <= set(obj) <= {"columns", "data", "index"}:  # pandas orient="split"
        columns, data = obj["columns"], obj["data"]
        if not isinstance(columns, list) or not isinstance(data, list):
            raise ValueError(f'{path}: "columns" and "data" must be lists (pandas orient="split")')
        for i, row in enumerate(data):
            where = f"{path}: record {i}"
            if not isinstance(row, list) or len(row) != len(columns):
                raise ValueError(f"{where}: expected a list of {len(columns)} values (one per column), got {row!r:.80}")
            yield where, dict(zip(columns, row))
        return
    if "prompt" in obj:
        prompt = obj["prompt"]
        if isinstance(prompt, dict):  # pandas' default orient="columns": {column: {index: value}}
            yield from _columns(path, {name: _index_keyed(path, name, col, prompt) for name, col in obj.items()})
        elif isinstance(prompt, list) and not all(isinstance(p, Mapping) for p in prompt):
            yield from _columns(path, obj)  # {column: [values]}; a list of mappings is one message prompt
        else:
            yield f"{path}: record 0", obj  # one record (a JSON Lines file of one line)
        return
    if obj and all(isinstance(v, dict) and "prompt" in v for v in obj.values()):  # pandas orient="index"
        for key, record in obj.items():
            yield f"{path}: record {key!r}", record
        return
    raise ValueError(f'{path}: no "prompt" key at the top level (keys: {sorted(obj)[:8]}); {_FORMS}')


def _index_keyed(path: Path, name: str, column: Any, prompt: Dict[str, Any]) -> List[Any]:
    if not isinstance(column, dict) or column.keys() != prompt.keys():
        raise ValueError(
            f'{path}: column {name!r} must be an object with the same keys as column "prompt" '
            "(pandas' to_json() with orient columns)"
        )
    return [column[key] for key in prompt]


def _columns(path: Path, columns: Dict[str, Any]) -> Iterator[Row]:
    n = None
    for name, values in columns.items():
        if not isinstance(values, list):
            raise ValueError(f'{path}: column {name!r} must be a list, one value per prompt, like column "prompt"')
        if n is None:
            n = len(values)
        elif len(values) != n:
            first = next(iter(columns))
            raise ValueError(f"{path}: column {name!r} has {len(values)} values, column {first!r} {n}")
    for i in range(n or 0):
        yield f"{path}: record {i}", {name: values[i] for name, values in columns.items()}


# ---------------------------------------------------------------------------------- tables (Arrow)


def _without_null_keys(record: Dict[str, Any]) -> Dict[str, Any]:
    """``record`` with its message prompt's ``None`` keys dropped: Arrow stores messages as
    structs of every key any message of the column has, ``None`` where a message had none (a
    ``tool_calls`` of ``None`` would reach the chat template)."""
    prompt = record.get("prompt")
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        record["prompt"] = [{k: v for k, v in m.items() if v is not None or k in ("role", "content")} for m in prompt]
    return record


def _check_unique_columns(where: str, names: List[str]) -> None:
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{where}: column {repeated[0]!r} appears more than once; each column must appear once")


def _table_rows(where: str, names: List[str], rows: List[Dict[str, Any]]) -> Iterator[Row]:
    _check_unique_columns(where, names)
    for i, row in enumerate(rows):
        yield f"{where}: row {i}", _without_null_keys(row)


def _parquet(path: Path) -> Iterator[Row]:
    pa = _require(path, "pyarrow", "pyarrow", "reading Parquet")
    pq = _require(path, "pyarrow.parquet", "pyarrow", "reading Parquet")

    try:
        # The schema first: a repeated column is refused by its name (read_table would fail on
        # the ambiguous name with Arrow's own message).
        names = list(pq.read_schema(path).names)
        _check_unique_columns(str(path), names)
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: not a readable Parquet file ({first})") from None
    yield from _table_rows(str(path), list(table.column_names), table.to_pylist())


def _saved_dataset(path: Path) -> Iterator[Row]:
    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise ValueError(
            f"{path}: a directory, but not one written by datasets' save_to_disk (no state.json or "
            "dataset_dict.json in it); give a prompt file or such a directory"
        )
    datasets = _require(path, "datasets", "datasets", "reading a dataset saved by save_to_disk")
    try:
        loaded = datasets.load_from_disk(os.fspath(path))
    except Exception as exc:  # datasets raises its own errors for a damaged directory
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: datasets.load_from_disk cannot read it ({type(exc).__name__}: {first})") from None
    if isinstance(loaded, Mapping) and "train" not in loaded and loaded:
        # save_to_disk wrote each split to a directory of its own, which is a saved Dataset.
        split = next(iter(loaded))
        hint = f"give the split's directory instead, as in --prompts {str(path / split)!r}"
    else:
        hint = None
    yield from dataset_rows(loaded, str(path), hint=hint)


def dataset_rows(dataset: Any, where: str, *, hint: str | None = None) -> Iterator[Row]:
    """``(where, record)`` for each row of a ``datasets.Dataset`` (of a ``DatasetDict``: its
    ``"train"`` split), messages without Arrow's ``None`` keys.

    Args:
        dataset: the ``Dataset`` or ``DatasetDict``.
        where: what names it in the messages (a directory, ``prompts``).
        hint: what to do about a ``DatasetDict`` without ``"train"``; by default, to pass the
            split (``prompts=dataset["validation"]``).

    Raises:
        ValueError: a ``DatasetDict`` without a ``"train"`` split (naming its splits), or another
            object.
    """
    if isinstance(dataset, Mapping):  # a DatasetDict
        if "train" not in dataset:
            split = next(iter(dataset), "validation")
            raise ValueError(
                f"{where}: a DatasetDict without a 'train' split (splits: {', '.join(map(repr, dataset))}); "
                + (hint or f"pass the split to use ({where}={where}[{split!r}])")
            )
        dataset, where = dataset["train"], f"{where} ['train']"
    if not (hasattr(dataset, "column_names") and hasattr(dataset, "to_list")):
        raise ValueError(f"{where}: expected a datasets.Dataset or DatasetDict, got {type(dataset).__name__}")
    yield from _table_rows(where, list(dataset.column_names), dataset.to_list())


# -------------------------------------------------------------------------------------------- CSV


def _csv(path: Path) -> Iterator[Row]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                return
            where = f"{path}:1"
            repeated = sorted({n for n in header if header.count(n) > 1})
            if repeated:
                raise ValueError(f"{where}: column {repeated[0]!r} appears more than once in the header row")
            start = reader.line_num + 1
            for cells in reader:
                where, start = f"{path}:{start}", reader.line_num + 1
                if not cells:
                    continue
                if len(cells) != len(header):
                    raise ValueError(
                        f"{where}: {len(cells)} values for the {len(header)} columns of the header row "
                        f"({', '.join(map(repr, header))})"
                    )
                yield where, dict(zip(header, cells))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 (byte 0x{exc.object[exc.start]:02x}); save it as UTF-8") from None
    except csv.Error as exc:
        raise ValueError(f"{path}: not a readable CSV file ({exc})") from None
