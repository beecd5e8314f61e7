"""pyppo.rewards: the sentiment reward, reward specs, output validation, classifier rewards."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
import torch

import pyppo.rewards as rewards
from pyppo.rewards import SequenceClassifierReward, load_reward, sentiment_reward, validate_scores
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
    _write_module(tmp_path, "pyppo_test_reward_mod", """
        def length(prompts, responses):
            return [float(len(r)) for r in responses]
        class Scorers:
            @staticmethod
            def ones(prompts, responses):
                return [1] * len(responses)
        NOT_CALLABLE = 3
        """)
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
    _write_module(tmp_path, "my_reward", """
        def score(prompts, responses):
            return [0.5 for _ in responses]
        """)
    assert load_reward(f"{tmp_path / 'my_reward.py'}:score")(["a"], ["b"]) == [0.5]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward(f"{tmp_path / 'nope.py'}:score")


def test_unknown_spec():
    with pytest.raises(ValueError, match="'positivity' is not 'sentiment'"):
        load_reward("positivity")


@pytest.mark.parametrize(
    "bad, exc, pattern",
    [
        ([1.0, float("nan"), 0.0], ValueError, r"'bad' returned a non-finite score at index 1: nan"),
        ([1.0, 2.0, float("inf")], ValueError, r"index 2: inf"),
        ([1.0, "high", 0.0], TypeError, r"non-number at index 1: 'high'"),
        ([None, 1.0, 0.0], TypeError, r"index 0: None"),
        ([True, 1.0, 0.0], TypeError, r"index 0: True"),
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
