"""pyppo.prompts: the built-in prompt sets, .jsonl loading (records with fields, message prompts), the
sources a run records, and the sampler (the other formats: tests/test_prompt_files.py)."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from pyppo.prompts import (
    ARITHMETIC_EVAL_SIZE,
    BUILTIN_PROMPT_SETS,
    DEFAULT_PROMPTS,
    PromptSampler,
    arithmetic_prompts,
    load_prompt_records,
    load_prompts,
    prompt_columns,
    prompt_fields,
    resolve_prompt_source,
    shared_prompts,
    warn_shared_prompts,
)

#: The first held-out arithmetic problems and the hash of all of them: a change to the set changes
#: every run that uses it, so it must be deliberate (update these with it).
PINNED_EVAL_HEAD = [
    {"prompt": "What is 1 + 1? Give the answer as a number.", "answer": "2"},
    {"prompt": "What is 1 + 12? Give the answer as a number.", "answer": "13"},
    {"prompt": "What is 1 + 13? Give the answer as a number.", "answer": "14"},
]
PINNED_EVAL_SHA256 = "d005f380852556999259ab9fde2bc6c4f13c2abd300f670a2775f14c45c25aba"


def test_default_prompts():
    assert len(DEFAULT_PROMPTS) >= 64
    assert len(set(DEFAULT_PROMPTS)) == len(DEFAULT_PROMPTS)
    assert all(isinstance(p, str) and 10 <= len(p) <= 80 and p.strip() == p for p in DEFAULT_PROMPTS)


def test_load_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "Describe a cat."})
        + "\n\n"
        + json.dumps({"prompt": "Héllo, wörld?", "id": 7}, ensure_ascii=False)
        + "\n"
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
        ('{"prompt": " ", "id": 1}', r':2: "prompt" must be a non-empty string'),
        ('{"prompt": ["x"]}', r':2: "prompt" message 0 must be a mapping \{"role": ..., "content": ...\}, got \'x\''),
        ('{"prompt": []}', r':2: "prompt" must be a non-empty string, got \[\] \(or a list of chat messages'),
        ('{"prompt": {"role": "user"}}', r':2: "prompt" must be a non-empty string, got \{\'role\': \'user\'\}'),
        (
            '{"prompt": [{"role": "bot", "content": "x"}]}',
            r":2: \"prompt\" message 0: \"role\" must be one of 'system', 'user', 'assistant', got 'bot'",
        ),
        (
            '{"prompt": [{"role": "user", "content": 3}]}',
            r':2: "prompt" message 0 \(user\): "content" must be a str, got 3$',
        ),
        ('{"prompt": [{"role": "user"}]}', r':2: "prompt" message 0 \(user\): "content" must be a str, got None'),
        ('{"prompt": "a", "prompt": "b"}', r":2: key 'prompt' appears more than once in the object"),
        ('{"prompt": "a", "meta": {"k": 1, "k": 2}}', r":2: key 'k' appears more than once"),
    ],
)
@pytest.mark.parametrize("loader", [load_prompts, load_prompt_records])
def test_bad_lines_name_the_line(tmp_path, line, pattern, loader):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=pattern):
        loader(path)


def test_a_repeated_key_is_named_with_its_line_after_a_byte_order_mark_and_blank_lines(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_bytes('\ufeff{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": 1, "answer": 2}\n'.encode())
    with pytest.raises(ValueError) as info:
        load_prompt_records(path)
    assert str(info.value) == (
        f"{path}:3: key 'answer' appears more than once in the object; each key must appear once "
        "(JSON keeps only one of the values)"
    )


@pytest.mark.parametrize("loader", [load_prompts, load_prompt_records])
def test_missing_and_empty_files(tmp_path, loader):
    with pytest.raises(FileNotFoundError, match=r"^--eval-prompts '.*none\.jsonl' does not exist"):
        loader(tmp_path / "none.jsonl", flag="--eval-prompts")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        loader(tmp_path / "empty.jsonl")


# ----------------------------------------------------------------------------- records with fields


def _write_lines(path, *objects):
    path.write_text("\n".join(json.dumps(o) for o in objects) + "\n")
    return path


def test_load_prompt_records_keeps_the_fields(tmp_path):
    path = _write_lines(
        tmp_path / "p.jsonl",
        {"prompt": "What is 2+3?", "answer": "5", "meta": {"level": 1, "tags": ["add"]}},
        {"prompt": "What is 2/4?", "answer": 0.5, "meta": None},
    )
    records = load_prompt_records(path)
    assert records == [
        {"prompt": "What is 2+3?", "answer": "5", "meta": {"level": 1, "tags": ["add"]}},
        {"prompt": "What is 2/4?", "answer": 0.5, "meta": None},
    ]
    assert prompt_fields(records) == ["answer", "meta"]
    assert load_prompts(path) == ["What is 2+3?", "What is 2/4?"]
    texts, columns = prompt_columns(records)
    assert texts == ["What is 2+3?", "What is 2/4?"]
    assert columns == {"answer": ["5", 0.5], "meta": [{"level": 1, "tags": ["add"]}, None]}


def test_records_without_fields(tmp_path):
    path = _write_lines(tmp_path / "p.jsonl", {"prompt": "a"}, {"prompt": "b"})
    assert load_prompt_records(path) == [{"prompt": "a"}, {"prompt": "b"}]
    assert prompt_fields(load_prompt_records(path)) == []
    assert prompt_columns(load_prompt_records(path)) == (["a", "b"], None)
    assert prompt_columns(["a", "b"]) == (["a", "b"], None)
    assert prompt_fields(["a"]) == [] and prompt_fields([]) == []


@pytest.mark.parametrize(
    "second, pattern",
    [
        ({"prompt": "b"}, r"p\.jsonl:3: its fields besides \"prompt\" are none, but .*p\.jsonl:1's are 'answer'"),
        (
            {"prompt": "b", "answer": "1", "id": 2},
            r":3: its fields besides \"prompt\" are 'answer', 'id', but .*:1's are 'answer'; every line needs the "
            r"same fields \(a reward receives each as a column\)",
        ),
        (
            {"prompt": "b", "solution": "1"},
            r":3: its fields besides \"prompt\" are 'solution', but .*:1's are 'answer'",
        ),
    ],
)
def test_records_with_other_fields_than_the_first_line_are_refused(tmp_path, second, pattern):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "0"}) + "\n\n" + json.dumps(second) + "\n")
    with pytest.raises(ValueError, match=pattern):
        load_prompt_records(path)
    assert load_prompts(path) == ["a", "b"]  # the strings alone: other keys are ignored, as before


def test_prompt_columns_needs_every_field():
    with pytest.raises(ValueError, match=r"prompts\[1\] has no field 'answer', which prompts\[0\] has"):
        prompt_columns([{"prompt": "a", "answer": "1"}, {"prompt": "b"}])


def test_sampler_takes_records():
    records = [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)]
    strings = PromptSampler([r["prompt"] for r in records], seed=3).sample(12)
    sampled = PromptSampler(records, seed=3).sample(12)
    assert [r["prompt"] for r in sampled] == strings  # the same order as the strings'
    assert all(r["answer"] == r["prompt"][1:] for r in sampled)
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a str, a list of chat messages, or a mapping .*dict"):
        PromptSampler(["a", {"answer": "1"}], seed=0)
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a str, .* got int"):
        PromptSampler([3], seed=0)


# ----------------------------------------------------------------------------- the arithmetic set


def _evaluate(prompt: str) -> int:
    match = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\? Give the answer as a number\.", prompt)
    assert match, prompt
    a, op, b = match.groups()
    return eval(f"{a} {op} {b}")  # the expression as written in the prompt


def test_arithmetic_set():
    train, held_out = arithmetic_prompts("train"), arithmetic_prompts("eval")
    assert len(held_out) == ARITHMETIC_EVAL_SIZE and len(train) + len(held_out) == 610
    for records in (train, held_out):
        assert all(set(r) == {"prompt", "answer"} and isinstance(r["answer"], str) for r in records)
        assert all(r["answer"] == str(_evaluate(r["prompt"])) for r in records)  # every answer is right
        assert all(0 <= int(r["answer"]) <= 40 for r in records)
    prompts, eval_prompts = [r["prompt"] for r in train], [r["prompt"] for r in held_out]
    assert len(set(prompts)) == len(prompts) and len(set(eval_prompts)) == len(eval_prompts)
    assert not set(prompts) & set(eval_prompts)  # disjoint
    assert {
        "What is 7 + 12? Give the answer as a number.",
        "What is 20 - 20? Give the answer as a number.",
        "What is 1 + 1? Give the answer as a number.",
    } <= set(prompts) | set(eval_prompts)
    assert "What is 3 - 5? Give the answer as a number." not in set(prompts) | set(eval_prompts)  # no negatives
    assert {p.split()[3] for p in eval_prompts} == {"+", "-"}  # both operations held out
    # Deterministic: the same every time, new dicts each time; another seed holds out others.
    assert arithmetic_prompts("train") == train and arithmetic_prompts("train") is not train
    other = arithmetic_prompts("eval", seed=1)
    assert len(other) == ARITHMETIC_EVAL_SIZE and other != held_out
    with pytest.raises(ValueError, match="split must be 'train' or 'eval', got 'test'"):
        arithmetic_prompts("test")


def test_arithmetic_set_is_pinned():
    # The held-out problems depend only on sha256, so they are the same on every machine.
    digest = hashlib.sha256(json.dumps(arithmetic_prompts("eval")).encode()).hexdigest()
    assert arithmetic_prompts("eval")[:3] == PINNED_EVAL_HEAD and digest == PINNED_EVAL_SHA256


def test_builtin_sets_by_name(tmp_path, monkeypatch):
    assert set(BUILTIN_PROMPT_SETS) == {"arithmetic", "arithmetic-eval"}
    assert load_prompt_records("arithmetic") == arithmetic_prompts("train")
    assert load_prompt_records("arithmetic-eval", flag="--eval-prompts") == arithmetic_prompts("eval")
    assert load_prompts("arithmetic") == [r["prompt"] for r in arithmetic_prompts("train")]
    # The name wins over a file of that name in the working directory; a path reaches the file.
    monkeypatch.chdir(tmp_path)
    _write_lines(tmp_path / "arithmetic", {"prompt": "from the file"})
    assert load_prompt_records("arithmetic") == arithmetic_prompts("train")
    assert load_prompt_records("./arithmetic") == [{"prompt": "from the file"}]
    with pytest.raises(FileNotFoundError, match="'arithmetics' does not exist"):
        load_prompt_records("arithmetics")


# ----------------------------------------------------------------------- sources as a run records them


def test_resolve_prompt_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_lines(tmp_path / "p.jsonl", {"prompt": "a"})
    assert resolve_prompt_source("arithmetic") == "arithmetic"  # a name stays a name
    assert resolve_prompt_source("p.jsonl") == str((tmp_path / "p.jsonl").resolve())
    (tmp_path / "saved").mkdir()
    assert resolve_prompt_source("./saved", flag="--eval-prompts") == str((tmp_path / "saved").resolve())
    with pytest.raises(FileNotFoundError, match=r"^--eval-prompts 'none\.jsonl': no such file or directory$"):
        resolve_prompt_source("none.jsonl", flag="--eval-prompts")


def test_a_jsonl_file_of_message_prompts(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?", "name": "u"}]
    path = _write_lines(tmp_path / "m.jsonl", {"prompt": messages, "answer": "1"}, {"prompt": "plain", "answer": "2"})
    assert load_prompt_records(path) == [{"prompt": messages, "answer": "1"}, {"prompt": "plain", "answer": "2"}]
    assert load_prompts(path) == [messages, "plain"]


def test_held_out_prompts_that_are_training_prompts_are_counted_and_warned_of():
    messages = [{"role": "user", "content": "Say hi."}]
    train = [{"prompt": "Say hi.", "answer": "1"}, {"prompt": messages, "answer": "2"}]
    held_out = ["Describe rain.", [dict(m) for m in messages], "Say hi.", "Say hi!"]
    assert shared_prompts(train, held_out) == [1, 2]  # the message list by its messages, records by their prompt
    with pytest.warns(
        UserWarning,
        match=r"^--eval-prompts 'e\.jsonl': 2 of its 4 prompts are also in --prompts 'p\.jsonl' \(the first: prompt 1",
    ):
        assert (
            warn_shared_prompts(train, held_out, source="--prompts 'p.jsonl'", eval_source="--eval-prompts 'e.jsonl'")
            == 2
        )
    # The built-in sets are disjoint: no warning.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            warn_shared_prompts(
                BUILTIN_PROMPT_SETS["arithmetic"](),
                BUILTIN_PROMPT_SETS["arithmetic-eval"](),
                source="a",
                eval_source="b",
            )
            == 0
        )
