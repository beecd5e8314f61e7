"""pyppo.prompts: the built-in prompt set and .jsonl loading."""

from __future__ import annotations

import json

import pytest

from pyppo.prompts import DEFAULT_PROMPTS, load_prompts


def test_default_prompts():
    assert len(DEFAULT_PROMPTS) >= 64
    assert len(set(DEFAULT_PROMPTS)) == len(DEFAULT_PROMPTS)
    assert all(isinstance(p, str) and 10 <= len(p) <= 80 and p.strip() == p for p in DEFAULT_PROMPTS)


def test_load_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "Describe a cat."}) + "\n\n"
        + json.dumps({"prompt": "Héllo, wörld?", "id": 7}, ensure_ascii=False) + "\n"
    )
    assert load_prompts(path) == ["Describe a cat.", "Héllo, wörld?"]


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("not json", r":2: not valid JSON"),
        ('["a list"]', r":2: expected a JSON object"),
        ('{"text": "x"}', r':2: missing key "prompt"'),
        ('{"prompt": ""}', r':2: "prompt" must be a non-empty string'),
        ('{"prompt": 3}', r':2: "prompt" must be a non-empty string, got 3'),
    ],
)
def test_bad_lines_name_the_line(tmp_path, line, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=pattern):
        load_prompts(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        load_prompts(tmp_path / "empty.jsonl")
