"""The op families' files against CONTRIBUTING.md's table of them ("Op families").

One family, one stem: its files in every layer (checks, CPU, CUDA, fake kernels, Python wrapper,
tests, bench case, eager reference) are named after it. Fails when a file under csrc/,
pyppo/ops/, tests/ops/, pyppo/bench/cases/ or pyppo/bench/eager/ is missing from the table, when
the table names a file that does not exist or puts it in the wrong layer or family, and when an
operator schema of csrc/ops.cpp belongs to no family.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
HEADING = "## Op families"

# Column -> the folder its files live in (a file in no other column's folder may also be named in
# "shared by devices", which is free-form).
LAYERS = {
    "checks": "csrc/checks/",
    "CPU": "csrc/cpu/",
    "CUDA": "csrc/cuda/",
    "fake (Meta)": "csrc/meta/",
    "Python": "pyppo/ops/",
    "tests": "tests/ops/",
    "bench case": "pyppo/bench/cases/",
    "eager reference": "pyppo/bench/eager/",
}
SHARED = "shared by devices"
# The trees the table must cover, file by file.
COVERED = [
    ("csrc", "**/*"),
    ("pyppo/ops", "*.py"),
    ("tests/ops", "*.py"),
    ("pyppo/bench/cases", "*.py"),
    ("pyppo/bench/eager", "*.py"),
]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table() -> tuple[list[str], list[dict[str, list[str]]]]:
    """The table under HEADING: its column names and, per row, column -> backticked names."""
    lines = CONTRIBUTING.read_text().splitlines()
    start = lines.index(HEADING)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append(_cells(line))
        elif rows:
            break
    header, body = rows[0], rows[2:]  # rows[1] is the |---| separator
    assert all(len(r) == len(header) for r in body), "a row of the op-families table has the wrong number of cells"
    # A cell's names are its backticked words outside parentheses (the notes).
    return header, [
        {col: re.findall(r"`([^`]+)`", re.sub(r"\([^()]*\)", "", cell)) for col, cell in zip(header, r)} for r in body
    ]


HEADER, ROWS = _table()
FAMILIES = {row["family"][0]: row for row in ROWS if row["family"]}
# The one row without a family: the files every family shares.
COMMON = [row for row in ROWS if not row["family"]]


def _named(row: dict[str, list[str]]) -> list[str]:
    return [p for col, names in row.items() if col not in ("family", "ops") for p in names]


def test_the_table_has_every_layer():
    assert HEADER[:2] == ["family", "ops"], HEADER
    assert set(LAYERS) | {SHARED} == set(HEADER[2:]), HEADER
    assert len(COMMON) == 1 and not COMMON[0]["ops"], "one row of files shared by every family, with no ops"
    assert len(FAMILIES) == sum(1 for row in ROWS if row["family"]), "a family has two rows"


def test_every_named_file_exists():
    missing = [p for row in ROWS for p in _named(row) if not (ROOT / p).is_file()]
    assert not missing, f"CONTRIBUTING.md's op-families table names files that do not exist: {missing}"


@pytest.mark.parametrize("top,pattern", COVERED, ids=[t for t, _ in COVERED])
def test_every_file_is_in_the_table(top, pattern):
    named = {p for row in ROWS for p in _named(row)}
    files = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / top).glob(pattern)
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert files, f"nothing under {top}"
    outside = [f for f in files if f not in named]
    assert not outside, f"files missing from CONTRIBUTING.md's op-families table ({HEADING!r}): {outside}"


def test_each_file_sits_in_its_layer():
    wrong = [
        (col, p)
        for row in ROWS
        for col, names in row.items()
        if col in LAYERS
        for p in names
        if not p.startswith(LAYERS[col])
    ]
    assert not wrong, f"files in the wrong column of the op-families table: {wrong}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_has_one_stem(family):
    """Every file of a family's layers is named <family>..., tests test_<family>...."""
    row = FAMILIES[family]
    bad = []
    for col in LAYERS:
        for p in row[col]:
            name = Path(p).name
            if col == "tests":
                name = name[len("test_") :] if name.startswith("test_") else "?"
            if not name.startswith(family):
                bad.append(p)
    assert not bad, f"files of the {family} family not named after it: {bad}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_compiled_family_is_in_every_layer(family):
    row = FAMILIES[family]
    if not any(p.startswith("csrc/") for p in _named(row)):
        assert row["Python"] and row["tests"], family  # plain PyTorch on top of the ops (losses)
        return
    for col in ("checks", "CPU", "CUDA", "fake (Meta)", "Python", "tests"):
        assert row[col], f"the {family} family has no {col} file"
    assert len(row["Python"]) == 1, f"one pyppo/ops module per family, {family} has {row['Python']}"


def test_every_schema_belongs_to_one_family():
    schemas = re.findall(r'm\.def\("(\w+)\(', (ROOT / "csrc" / "ops.cpp").read_text())
    assert schemas
    compiled = [op for row in FAMILIES.values() if any(p.startswith("csrc/") for p in _named(row)) for op in row["ops"]]
    assert sorted(compiled) == sorted(schemas), "the ops column of the compiled families vs csrc/ops.cpp's schemas"


def test_every_family_is_exported_from_pyppo_ops():
    import pyppo.ops

    for family, row in FAMILIES.items():
        public = [op for op in row["ops"] if not op.endswith("_backward")]
        module = __import__(f"pyppo.ops.{Path(row['Python'][0]).stem}", fromlist=["_"])
        for op in public:
            assert op in pyppo.ops.__all__, (family, op)
            assert getattr(pyppo.ops, op) is getattr(module, op), (family, op)
