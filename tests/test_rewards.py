"""pyppo.rewards: the sentiment reward, reward specs, output validation, classifier rewards, the
prompt fields a reward receives."""

from __future__ import annotations

import functools
import gc
import math
import textwrap
import warnings

import numpy as np
import pytest
import torch

import pyppo.rewards as rewards
from pyppo.rewards import (
    RewardError,
    SequenceClassifierReward,
    check_reward_fields,
    load_reward,
    score_responses,
    sentiment_reward,
    validate_scores,
)
from support.tiny_models import save_tiny_classifier


def test_sentiment_positive_beats_negative():
    scores = sentiment_reward(
        ["What do you think of libraries?"] * 3,
        ["I love them, they are wonderful and inspiring!", "A building.", "They are awful, boring and sad."],
    )
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)
    assert all(-1.0 <= s <= 1.0 for s in scores)
    assert scores[0] > 0.5 > scores[1] > -0.5 > scores[2]
    assert sentiment_reward(["p"], [""]) == [0.0]


def test_sentiment_analyzer_is_reused():
    sentiment_reward(["p"], ["good"])
    first = rewards._analyzer
    sentiment_reward(["p"], ["bad"])
    assert rewards._analyzer is first is not None


def test_load_reward_default_is_validated_sentiment():
    fn = load_reward()
    assert fn.reward_name == "sentiment"
    assert fn(["p", "q"], ["great!", "terrible."]) == sentiment_reward(["p", "q"], ["great!", "terrible."])
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        fn(["p", "q"], ["x"])


def _write_module(dir_, name, body):
    (dir_ / f"{name}.py").write_text(textwrap.dedent(body))


def test_module_function_spec(tmp_path, monkeypatch):
    _write_module(
        tmp_path,
        "pyppo_test_reward_mod",
        """
        def length(prompts, responses):
            return [float(len(r)) for r in responses]
        class Scorers:
            @staticmethod
            def ones(prompts, responses):
                return [1] * len(responses)
        NOT_CALLABLE = 3
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("pyppo_test_reward_mod:length")(["a", "b"], ["xy", ""]) == [2.0, 0.0]
    assert load_reward("pyppo_test_reward_mod:Scorers.ones")(["a"], ["b"]) == [1.0]
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        load_reward("pyppo_test_reward_mod:missing")
    with pytest.raises(TypeError, match="'NOT_CALLABLE' is an int, not a function"):
        load_reward("pyppo_test_reward_mod:NOT_CALLABLE")
    with pytest.raises(ModuleNotFoundError, match="pyppo_no_such_module"):
        load_reward("pyppo_no_such_module:fn")


def test_file_function_spec(tmp_path):
    _write_module(
        tmp_path,
        "my_reward",
        """
        def score(prompts, responses):
            return [0.5 for _ in responses]
        """,
    )
    assert load_reward(f"{tmp_path / 'my_reward.py'}:score")(["a"], ["b"]) == [0.5]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward(f"{tmp_path / 'nope.py'}:score")


UNKNOWN = (
    "is not 'sentiment', 'math', 'reasoning-gym', an existing model directory, 'module:function' or 'file.py:function'"
)


def test_unknown_spec():
    with pytest.raises(ValueError) as caught:
        load_reward("positivity")
    assert str(caught.value) == f"reward 'positivity' {UNKNOWN}"


def test_a_python_file_without_its_function_suggests_the_functions_it_defines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.py").write_text(
        "import sys\nraise SystemExit('never imported')\n\n"
        "def some_none(prompts, responses):\n    return [None] * len(responses)\n\n"
        "async def later(completions, **kwargs):\n    return []\n\n"
        "def _helper():\n    pass\n\nclass Scorer:\n    def method(self):\n        pass\n"
    )
    for spec in ("r.py", str(tmp_path / "r.py")):
        with pytest.raises(ValueError) as caught:
            load_reward(spec)
        assert str(caught.value) == (
            f"reward {spec!r} {UNKNOWN}; did you mean '{spec}:FUNCTION'? (its functions: some_none, later)"
        )
    (tmp_path / "empty.py").write_text("X = 1\n")
    (tmp_path / "broken.py").write_text("def r(:\n")
    (tmp_path / "many.py").write_text("".join(f"def f{i}(p, r):\n    return r\n" for i in range(10)))
    for spec, tail in [
        ("empty.py", "; did you mean 'empty.py:FUNCTION'? ('empty.py' defines no top-level function)"),
        ("broken.py", "; did you mean 'broken.py:FUNCTION'?"),  # not parsed: no list
        ("many.py", "; did you mean 'many.py:FUNCTION'? (its functions: f0, f1, f2, f3, f4, f5, f6, f7 and 2 more)"),
        ("nope.py", "; did you mean 'nope.py:FUNCTION'? (there is no file 'nope.py')"),
    ]:
        with pytest.raises(ValueError) as caught:
            load_reward(spec)
        assert str(caught.value) == f"reward {spec!r} {UNKNOWN}{tail}"
        assert "\n" not in str(caught.value)


def test_builtin_names_come_before_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "math").mkdir()  # not a reward model: the name still means the built-in reward
    assert load_reward("math").__wrapped__ is rewards.math_reward
    assert load_reward("sentiment").__wrapped__ is sentiment_reward


@pytest.mark.parametrize(
    "bad, exc, pattern",
    [
        ([1.0, float("nan"), 0.0], ValueError, r"'bad' returned a non-finite score at index 1: nan"),
        ([1.0, 2.0, float("inf")], ValueError, r"index 2: inf"),
        ([1.0, "high", 0.0], TypeError, r"non-number at index 1: 'high'"),
        ([{"score": 1.0}, 1.0, 0.0], TypeError, r"index 0: \{'score': 1.0\} \(dict\); expected a number, or None"),
        ([1.0, 2.0], ValueError, r"returned 2 scores for 3 responses"),
        (0.5, TypeError, r"returned float; expected a list of 3 floats"),
        (torch.zeros(3, 1), ValueError, r"shape \(3, 1\)"),
    ],
)
def test_bad_reward_outputs_raise_with_name_and_index(bad, exc, pattern):
    fn = load_reward(lambda prompts, responses: bad)
    fn.reward_name  # every loaded reward carries its name
    with pytest.raises(exc, match=pattern.replace("'bad'", "'<lambda>'")):
        fn(["a", "b", "c"], ["x", "y", "z"])
    with pytest.raises(exc, match=pattern):
        validate_scores(bad, 3, "bad")


def trl_bool(completions, **kwargs):  # TRL makes a float32 tensor of this: 1.0 / 0.0
    return [len(c) > 2 for c in completions]


@pytest.mark.parametrize(
    "fn",
    [
        trl_bool,
        lambda prompts, responses: [len(r) > 2 for r in responses],
        lambda prompts, responses: np.array([len(r) > 2 for r in responses]),
        lambda prompts, responses: [np.bool_(len(r) > 2) for r in responses],
        lambda prompts, responses: torch.tensor([len(r) > 2 for r in responses]),
        lambda prompts, responses: [torch.tensor(len(r) > 2) for r in responses],
        lambda data_source, solution_str, ground_truth: len(solution_str) > 2,  # veRL's compute_score
    ],
    ids=["trl", "list", "numpy", "numpy-scalars", "tensor", "tensor-scalars", "verl"],
)
def test_bools_score_one_and_zero_in_every_convention(fn):
    fields = {"data_source": ["d", "d", "d"], "ground_truth": ["x", "x", "x"]}
    assert score_responses(fn, ["a", "b", "c"], ["yes", "no", "maybe"], where="s", fields=fields) == [1.0, 0.0, 1.0]
    scores = score_responses(load_reward(fn), ["a", "b", "c"], ["yes", "no", "maybe"], where="s", fields=fields)
    assert scores == [1.0, 0.0, 1.0] and all(type(x) is float for x in scores)
    assert validate_scores([True, None, np.bool_(False)], 3, "r") == [1.0, None, 0.0]


def test_array_and_tensor_scores_accepted():
    assert validate_scores(np.array([1, 2], dtype=np.float32), 2, "r") == [1.0, 2.0]
    assert validate_scores(torch.tensor([0.5, -0.5], dtype=torch.bfloat16), 2, "r") == [0.5, -0.5]
    assert validate_scores([torch.tensor(1.5), np.float64(2.0)], 2, "r") == [1.5, 2.0]


def test_classifier_reward_single_logit(tmp_path):
    path = save_tiny_classifier(tmp_path / "rm", num_labels=1)
    fn = load_reward(str(path))
    scores = fn(["Q: hi ", "Q: a much longer prompt "], ["good", "bad answer"])
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores)
    assert scores[0] != scores[1]
    # Scores do not depend on batching (the pad token is masked out of the pooled position).
    one = SequenceClassifierReward(path, batch_size=1)
    assert one(["Q: hi ", "Q: a much longer prompt "], ["good", "bad answer"]) == pytest.approx(scores, abs=1e-5)


def test_classifier_reward_picks_positive_class(tmp_path):
    path = save_tiny_classifier(tmp_path / "rm2", num_labels=3, id2label={0: "NEGATIVE", 1: "NEUTRAL", 2: "POSITIVE"})
    rm = SequenceClassifierReward(path)
    assert rm.index == 2
    enc = rm.tokenizer(["p r"], return_tensors="pt")
    with torch.no_grad():
        expected = rm.model(**enc).logits[0, 2].item()
    assert rm(["p "], ["r"]) == pytest.approx([expected], abs=1e-6)
    assert SequenceClassifierReward(path, label="NEUTRAL").index == 1
    with pytest.raises(ValueError, match="unknown label 'joy'"):
        SequenceClassifierReward(path, label="joy")


def test_classifier_reward_ambiguous_classes(tmp_path):
    path = save_tiny_classifier(tmp_path / "rm3", num_labels=3, id2label={0: "a", 1: "b", 2: "c"})
    with pytest.raises(ValueError, match="none is named positive"):
        SequenceClassifierReward(path)


def test_a_causal_lm_is_not_a_reward_model(tmp_path):
    from support.tiny_models import save_tiny_causal_lm

    path = save_tiny_causal_lm(tmp_path / "lm")
    with pytest.raises(ValueError, match="not a sequence-classification model.*LlamaForCausalLM"):
        load_reward(str(path))


def test_a_checkpoint_without_the_score_head_is_not_a_reward_model(tmp_path):
    # A causal LM whose config names no architecture loads as a classifier with a random head.
    import json

    from support.tiny_models import save_tiny_causal_lm

    path = save_tiny_causal_lm(tmp_path / "lm")
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no weights for score\.weight; they would be initialised at random"):
        load_reward(str(path))


# ----------------------------------------------------------------------------- prompt fields


FIELDS = {"answer": ["5", "7"], "level": [1, 2]}


def takes_answer(prompts, responses, answer):
    return [float(r == a) for r, a in zip(responses, answer)]


def takes_kwargs(prompts, responses, **kwargs):
    assert sorted(kwargs) == ["answer", "level"] and all(type(v) is list for v in kwargs.values())
    return [float(level) for level in kwargs["level"]]


def takes_neither(prompts, responses):
    return [float(len(r)) for r in responses]


def takes_optional(p, r, *, level=None, hint="none"):  # any names for the first two; fields by keyword
    return [-1.0] * len(r) if level is None else [float(x) for x in level]


def trl_kwargs(completions, **kwargs):  # TRL's convention: keywords, prompts= among them
    assert sorted(kwargs) == ["answer", "level", "prompts"] and kwargs["prompts"] == ["p", "q"]
    return [float(len(c)) for c in completions]


def trl_named(completions, answer, prompts=None, hint=0):
    assert prompts == ["p", "q"]
    return [float(c == a) for c, a in zip(completions, answer)]


class Scorer:
    def __init__(self, bonus):
        self.bonus = bonus

    def __call__(self, prompts, responses, answer):
        return [self.bonus + (r == a) for r, a in zip(responses, answer)]

    def method(self, prompts, responses, level, **extra):
        assert extra == {"answer": ["5", "7"]}
        return [self.bonus * x for x in level]


@pytest.mark.parametrize("wrap", [False, True], ids=["callable", "load_reward"])
@pytest.mark.parametrize(
    "fn, expected, passed",
    [
        (takes_answer, [1.0, 0.0], ["answer"]),
        (takes_kwargs, [1.0, 2.0], ["answer", "level"]),
        (takes_neither, [1.0, 1.0], []),
        (takes_optional, [1.0, 2.0], ["level"]),
        (Scorer(0.5), [1.5, 0.5], ["answer"]),
        (Scorer(3.0).method, [3.0, 6.0], ["answer", "level"]),
        (trl_kwargs, [1.0, 1.0], ["answer", "level"]),
        (trl_named, [1.0, 0.0], ["answer"]),
    ],
)
def test_rewards_receive_the_fields_they_take(fn, expected, passed, wrap):
    reward_fn = load_reward(fn) if wrap else fn
    assert check_reward_fields(reward_fn, FIELDS) == passed
    assert score_responses(reward_fn, ["p", "q"], ["5", "8"], where="step 1", fields=FIELDS) == expected


def test_without_fields_every_reward_is_called_as_before():
    assert score_responses(takes_neither, ["p"], ["abc"], where="s") == [3.0]
    assert score_responses(takes_optional, ["p"], ["abc"], where="s", fields={}) == [-1.0]
    assert check_reward_fields(load_reward("sentiment"), ["answer"]) == []
    assert score_responses(
        load_reward("sentiment"), ["p"], ["great!"], where="s", fields={"answer": ["x"]}
    ) == sentiment_reward(["p"], ["great!"])


def test_a_missing_field_is_named_early_and_when_scoring():
    with pytest.raises(
        RewardError,
        match=r"^reward 'takes_answer' needs the prompt field 'answer', missing from "
        r"--prompts 'p\.jsonl', whose fields besides \"prompt\" are: 'id', 'level'$",
    ):
        check_reward_fields(takes_answer, ["level", "id"], source="--prompts 'p.jsonl'")

    def two(prompts, responses, answer, solution, level=0):
        return [0.0] * len(responses)

    with pytest.raises(
        ValueError,
        match=r"needs the prompt fields 'answer', 'solution', missing from the prompts, "
        r"whose fields besides \"prompt\" are: none$",
    ) as info:
        check_reward_fields(load_reward(two), [])
    assert info.value.reward == "two"
    with pytest.raises(RewardError, match=r"'takes_answer' needs the prompt field 'answer'.*: 'level' \(step 4\)"):
        score_responses(takes_answer, ["p", "q"], ["5", "7"], where="step 4", fields={"level": [1, 2]})
    with pytest.raises(RewardError, match=r"needs the prompt field 'answer'.*are: none \(step 4\)"):
        score_responses(load_reward(takes_answer), ["p"], ["5"], where="step 4")


def test_a_field_column_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"field 'answer' has 1 values for 2 prompts \(step 2\)"):
        score_responses(takes_answer, ["p", "q"], ["5", "7"], where="step 2", fields={"answer": ["5"]})


def test_field_names_like_the_first_two_parameters_are_not_passed():
    def reward(prompts, responses, **kwargs):
        return [float(len(kwargs))] * len(responses)

    # A field called "prompts" would collide with the reward's own first parameter.
    fields = {"prompts": ["x"], "answer": ["1"]}
    assert check_reward_fields(reward, fields) == ["answer"]
    assert score_responses(reward, ["p"], ["r"], where="s", fields=fields) == [1.0]


def test_the_signature_is_read_once_per_function(monkeypatch):
    reads = []
    real = rewards._read_field_params
    monkeypatch.setattr(rewards, "_read_field_params", lambda fn: reads.append(fn) or real(fn))

    def fresh(prompts, responses, answer):
        return [0.0] * len(responses)

    class Fresh(Scorer):
        def method(self, prompts, responses, level, **extra):
            return super().method(prompts, responses, level, **extra)

    scorer = Fresh(1.0)
    for _ in range(3):
        score_responses(fresh, ["p", "q"], ["5", "7"], where="s", fields=FIELDS)
        score_responses(scorer.method, ["p", "q"], ["5", "7"], where="s", fields=FIELDS)  # a new bound method each time
    score_responses(Fresh(2.0).method, ["p", "q"], ["5", "7"], where="s", fields=FIELDS)  # another instance
    assert reads == [fresh, Fresh.method.__get__(scorer)]  # one read each


def trl_kwargs_any(completions, **kwargs):
    return [1.0 + len(c) for c in completions]


def test_a_trl_reward_trains_and_one_that_fits_no_convention_is_refused_before_the_model_loads(tmp_path, capsys):
    from pyppo import cli
    from support.tiny_models import save_tiny_causal_lm
    from support.trainer_fixture import make_trainer, small_config

    result = make_trainer(small_config(steps=1, ppo_epochs=1), reward=trl_kwargs_any).step()
    assert math.isfinite(result.metrics["score_mean"]) and result.metrics["score_mean"] > 0

    _write_module(tmp_path, "one_arg", "def score(responses):\n    return [0.0] * len(responses)\n")
    model = save_tiny_causal_lm(tmp_path / "model")
    argv = [
        "train",
        "--model",
        str(model),
        "--reward",
        f"{tmp_path / 'one_arg.py'}:score",
        "--output",
        str(tmp_path / "run"),
    ]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"pyppo: error: reward '{tmp_path / 'one_arg.py'}:score' takes (responses); a reward is called as "
        "reward(prompts, responses, **fields); TRL's way, as reward(prompts=..., completions=..., **fields) "
        "when it has a parameter named completions; or veRL's, once per response, as compute_score("
        "data_source=..., solution_str=..., ground_truth=..., extra_info=...) when it has one named solution_str "
        "(docs/rewards.md)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "source, line, statement, error",
    [
        ("import os\nimport not_a_pkg\n", 2, "import not_a_pkg", "ModuleNotFoundError: No module named 'not_a_pkg'"),
        ("x = 1\ny = 1 / 0\n", 2, "y = 1 / 0", "ZeroDivisionError: division by zero"),
        ("def r(p, q:\n    pass\n", 1, "def r(p, q:", "SyntaxError: '(' was never closed"),
    ],
    ids=["missing-import", "raises", "syntax"],
)
def test_a_reward_module_whose_own_code_fails_names_its_file_and_line(
    source, line, statement, error, tmp_path, monkeypatch
):
    path = tmp_path / "broken_reward.py"
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in (f"{path}:r", "broken_reward:r"):
        with pytest.raises(ImportError) as info:  # ImportError: the CLI says it in one line
            load_reward(spec)
        assert str(info.value).startswith(
            f"reward {spec!r}: importing it failed at {path}, line {line} ({statement}): {error}"
        ), str(info.value)
    assert isinstance(info.value, ModuleNotFoundError) == error.startswith("ModuleNotFoundError")


# ----------------------------------------------------------------------------- None and veRL's compute_score


def test_none_means_does_not_apply_and_nan_stays_refused():
    assert validate_scores([None, 1.0, np.float32(2)], 3, "r") == [None, 1.0, 2.0]
    assert validate_scores(np.array([None, 0.5], dtype=object), 2, "r") == [None, 0.5]

    def half(prompts, responses):
        return [None if i % 2 else 1.0 for i in range(len(responses))]

    assert score_responses(load_reward(half), ["p", "q"], ["a", "b"], where="s") == [1.0, None]
    with pytest.raises(RewardError, match=r"non-finite score at index 1: nan"):
        validate_scores([None, math.nan], 2, "r")


CALLS = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    given = dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth)
    CALLS.append({**given, "extra_info": dict(extra_info)})
    extra_info["num_turns"] = None  # as veRL's reward manager writes into it
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth, "pred": solution_str}


VERL_FIELDS = {"data_source": ["gsm8k", "gsm8k"], "ground_truth": ["5", "7"], "id": [1, 2]}


@pytest.mark.parametrize("wrap", [False, True], ids=["callable", "load_reward"])
def test_a_verl_compute_score_is_called_per_response_with_its_columns(wrap):
    reward_fn = load_reward(compute_score) if wrap else compute_score
    assert check_reward_fields(reward_fn, [*VERL_FIELDS, "extra_info"]) == ["data_source", "extra_info", "ground_truth"]
    CALLS.clear()
    out = rewards.score_reward(reward_fn, ["p", "q"], ["5", "8"], where="step 1", fields=VERL_FIELDS)
    assert out.scores == [1.0, 0.0] and out.extras == {"acc": [1.0, 0.0]}  # "pred" holds no number
    # veRL's keywords; extra_info is {} for a record without one (veRL: non_tensor_batch.get("extra_info", {}))
    assert CALLS == [
        dict(data_source="gsm8k", solution_str="5", ground_truth="5", extra_info={}),
        dict(data_source="gsm8k", solution_str="8", ground_truth="7", extra_info={}),
    ]
    records = [{"level": 1}, {"level": 2}]
    fields = {**VERL_FIELDS, "extra_info": records}
    assert score_responses(reward_fn, ["p", "q"], ["5", "7"], where="s", fields=fields) == [1.0, 1.0]
    assert CALLS[-1]["extra_info"] == {"level": 2} and records[1] == {"level": 2}  # given a copy


def test_a_verl_compute_score_needs_its_columns_and_returns_a_score():
    with pytest.raises(
        RewardError,
        match=r"^reward 'compute_score' needs the prompt fields 'data_source', 'ground_truth', missing from "
        r"--prompts 'p.jsonl', whose fields besides \"prompt\" are: 'answer'$",
    ):
        check_reward_fields(compute_score, ["answer"], source="--prompts 'p.jsonl'")

    def no_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    with pytest.raises(
        RewardError,
        match=r"^reward 'no_score' returned a dict without a 'score' key at index 0 \(its keys: 'acc'\); veRL's "
        r"compute_score returns a number or \{'score': number, \.\.\.\} \(step 2; prompt 0: 'p', response: '5'\)$",
    ):
        score_responses(no_score, ["p", "q"], ["5", "7"], where="step 2", fields=VERL_FIELDS)

    def flags(solution_str, **kwargs):  # only solution_str: **kwargs gets the columns, extra_info {}
        assert kwargs["extra_info"] == {} and kwargs["ground_truth"] in ("5", "7")
        return [True, None][int(kwargs["id"]) - 1]  # a bool is a score (veRL's default_compute_score)

    assert score_responses(flags, ["p", "q"], ["5", "7"], where="s", fields=VERL_FIELDS) == [1.0, None]

    def fails(data_source, solution_str, ground_truth):
        return 1 / int(solution_str)

    with pytest.raises(
        RewardError, match=r"^reward 'fails' raised ZeroDivisionError at index 1: division by zero \(s; prompt 1: 'q'"
    ):
        score_responses(fails, ["p", "q"], ["5", "0"], where="s", fields=VERL_FIELDS)

    def positional_only(data_source, /, solution_str, ground_truth):  # veRL passes keywords: it cannot be called
        return 0.0

    with pytest.raises(RewardError, match=r"or veRL's, once per response, as compute_score\(data_source=\.\.\."):
        check_reward_fields(positional_only, VERL_FIELDS)


def test_a_verl_compute_score_file_spec(tmp_path):
    _write_module(
        tmp_path,
        "verl_reward_file",
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0 if solution_str.strip() == ground_truth else 0.0
        """,
    )
    fn = load_reward(f"{tmp_path / 'verl_reward_file.py'}:compute_score")
    assert fn(["p", "q"], ["5", "6"], data_source=["a", "b"], ground_truth=["5", "7"]) == [1.0, 0.0]
    assert score_responses(fn, ["p", "q"], [" 7", "7"], where="s", fields=VERL_FIELDS) == [0.0, 1.0]


async def async_reward(prompts, responses):
    return [1.0] * len(responses)


class AsyncCall:
    async def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)


async def async_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


SYNC_ONLY = "pyppo calls rewards synchronously: wrap it (asyncio.run) in a plain def with the same parameters"


@pytest.mark.parametrize(
    "fn, call",
    [
        (async_reward, "async_reward(...)"),
        (AsyncCall(), "the_async_reward(...)"),
        (async_compute_score, "async_compute_score(...)"),
        (functools.partial(async_reward), "the_async_reward(...)"),
    ],
    ids=["function", "callable-object", "verl", "partial"],
)
def test_an_async_reward_is_refused_when_it_is_loaded_or_checked(fn, call, recwarn):
    tail = f" is an async function; {SYNC_ONLY} that returns asyncio.run({call})"
    with pytest.raises(rewards.RewardTypeError) as caught:
        load_reward(fn)
    assert str(caught.value) == f"reward {getattr(fn, '__name__', repr(fn))!r}{tail}"  # load_reward's name
    with pytest.raises(RewardError) as caught:
        check_reward_fields(fn, ["data_source", "ground_truth"])
    assert str(caught.value) == f"reward {rewards.reward_name(fn)!r}{tail}"
    gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]  # nothing was called


def test_an_async_reward_in_a_file_is_refused_when_loaded(tmp_path):
    _write_module(tmp_path, "async_file", "async def async_r(prompts, responses):\n    return [1.0]\n")
    spec = f"{tmp_path / 'async_file.py'}:async_r"
    with pytest.raises(ValueError, match=r"^reward '.*async_file.py:async_r' is an async function; pyppo calls"):
        load_reward(spec)


def test_a_coroutine_returned_anyway_is_closed_and_refused():
    made = []

    def make(*args):
        made.append(async_reward(*args))
        return made[-1]

    def returns_one(prompts, responses):
        return make(prompts, responses)

    def returns_a_list(prompts, responses):
        return [make(prompts, responses) for _ in responses]

    def verl_returns_one(data_source, solution_str, ground_truth):
        return make([], [])

    fields = {"data_source": ["d", "d"], "ground_truth": ["x", "x"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "never awaited" RuntimeWarning would be an error
        for fn, pattern in [
            (returns_one, r"^reward 'returns_one' returned a coroutine; pyppo calls rewards synchronously: .* \(s\)$"),
            (returns_a_list, r"^reward 'returns_a_list' returned a coroutine at index 0; pyppo calls rewards"),
            (load_reward(returns_a_list), r"^reward 'returns_a_list' returned a coroutine at index 0;"),
            (verl_returns_one, r"^reward 'verl_returns_one' returned a coroutine at index 0; pyppo calls rewards"),
        ]:
            made.clear()
            with pytest.raises(RewardError, match=pattern):
                score_responses(fn, ["p", "q"], ["a", "b"], where="s", fields=fields)
            assert made and all(c.cr_frame is None for c in made)  # every one closed, none awaited
            made.clear()
            gc.collect()
        with pytest.raises(RewardError, match=r"returned a coroutine at index 1"):
            validate_scores([1.0, async_reward([], []), async_reward([], [])], 3, "r")
        gc.collect()
