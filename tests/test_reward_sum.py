"""pyppo.reward_sum: several rewards with weights (TRL's reward_funcs / reward_weights), None for
"does not apply", each reward's metrics in a step and in metrics.jsonl, and veRL's compute_score
in a run."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from pyppo.distributed import World
from pyppo.reward_sum import (
    RewardSum,
    UnscoredWarning,
    as_reward,
    check_reward_weights,
    load_rewards,
    reward_metric_name,
    score_rewards,
)
from pyppo.rewards import RewardError, check_reward_fields, load_reward, reward_takes_fields, score_responses
from pyppo.trainer.reward_metrics import RewardColumns, reward_metrics
from support.trainer_fixture import PROMPTS, make_trainer, small_config

PROMPTS3 = ["p", "q", "r"]
RESPONSES3 = ["a", "bb", "ccc"]


def first(prompts, responses):
    return [1.0, 2.0, 3.0]


def second(prompts, responses):
    return [4.0, None, -2.0]


def nothing_for_the_second(prompts, responses):
    return [0.25, None, 0.5]


def test_the_score_is_the_weighted_sum_of_the_rewards_that_apply():
    both = RewardSum([first, second], [1.0, 0.5])
    out = score_rewards(both, PROMPTS3, RESPONSES3, where="step 1")
    # 1 + 0.5*4, 2 (the second does not apply), 3 + 0.5*(-2)
    assert out.scores == [3.0, 2.0, 2.0]
    assert out.parts == {"first": [1.0, 2.0, 3.0], "second": [4.0, None, -2.0]}
    assert out.unscored == [False, False, False]
    assert score_responses(both, PROMPTS3, RESPONSES3, where="s") == [3.0, 2.0, 2.0]
    assert both(PROMPTS3, RESPONSES3) == [3.0, 2.0, 2.0]  # a RewardSum is a reward too
    assert RewardSum([first, second]).weights == (1.0, 1.0)  # TRL's default weights
    assert score_rewards(RewardSum([first, second]), PROMPTS3, RESPONSES3, where="s").scores == [5.0, 2.0, 1.0]
    # negative and zero weights are weights (TRL allows them)
    assert score_rewards(RewardSum([first, second], [-1, 0]), PROMPTS3, RESPONSES3, where="s").scores == [-1, -2, -3]


def test_one_reward_keeps_its_scores_and_has_no_parts():
    out = score_rewards(first, PROMPTS3, RESPONSES3, where="s")
    assert out.scores == [1.0, 2.0, 3.0] and out.parts == {} and out.extras == {}
    # a weight on one reward scales it, and makes it a RewardSum
    scaled = as_reward(first, [2.0])
    assert isinstance(scaled, RewardSum) and scaled(PROMPTS3, RESPONSES3) == [2.0, 4.0, 6.0]
    assert as_reward(first) is first and as_reward(None) is None


def test_a_response_no_reward_applies_to_scores_zero_with_a_warning():
    both = RewardSum([nothing_for_the_second, second], [1.0, 2.0])
    with pytest.warns(UnscoredWarning) as caught:
        out = score_rewards(both, PROMPTS3, RESPONSES3, where="step 7")
    assert out.scores == [8.25, 0.0, -3.5] and out.unscored == [False, True, False]
    (warning,) = caught
    assert str(warning.message) == (
        "no reward applied to 1 of 3 responses (step 7; the first: prompt 1: 'q', response: 'bb'): each scores 0.0, "
        "as in TRL. Return a number for every response some reward applies to"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every response scored by some reward: no warning
        score_rewards(RewardSum([first, second]), PROMPTS3, RESPONSES3, where="s")


def _unscored_message(fn, where="step 1", n=4):
    prompts, responses = [f"p{i}" for i in range(n)], [f"r{i}" for i in range(n)]
    with pytest.warns(UnscoredWarning) as caught:
        score_rewards(fn, prompts, responses, where=where)
    (warning,) = caught
    return str(warning.message)


def test_one_reward_that_returns_none_did_not_apply_says_so():
    # The words say what happened: it did NOT apply (it returned None), not "applied to".
    assert score_responses(second, PROMPTS3, RESPONSES3, where="s") == [4.0, None, -2.0]  # its None, no warning
    with pytest.warns(UnscoredWarning) as caught:
        assert score_rewards(second, PROMPTS3, RESPONSES3, where="s").scores == [4.0, 0.0, -2.0]
    assert [str(w.message) for w in caught] == [
        "reward 'second' did not apply to 1 of 3 responses (returned None; s; the first: prompt 1: 'q', "
        "response: 'bb'): each scores 0.0, as in TRL. Return a number for every response it should score"
    ]

    def some_none(prompts, responses):
        return [None if i % 2 else 1.0 for i in range(len(responses))]

    def all_none(prompts, responses):
        return [None] * len(responses)

    assert _unscored_message(load_reward(some_none)) == (
        "reward 'some_none' did not apply to 2 of 4 responses (returned None; step 1; the first: prompt 1: 'p1', "
        "response: 'r1'): each scores 0.0, as in TRL. Return a number for every response it should score"
    )
    assert _unscored_message(all_none).startswith(
        "reward 'all_none' did not apply to 4 of 4 responses (returned None; step 1; the first: prompt 0: 'p0',"
    )
    # Several rewards, none of which applies anywhere: "no reward applied to".
    assert _unscored_message(RewardSum([all_none, load_reward(all_none)]), where="step 2") == (
        "no reward applied to 4 of 4 responses (step 2; the first: prompt 0: 'p0', response: 'r0'): each scores "
        "0.0, as in TRL. Return a number for every response some reward applies to"
    )
    for message in (_unscored_message(some_none), _unscored_message(RewardSum([some_none, all_none]))):
        assert " applied to 2 of 4" not in message.replace("no reward applied", "")


def test_nan_is_still_refused_naming_the_reward_of_the_sum():
    def nan_at_2(prompts, responses):
        return [0.0, 1.0, math.nan]

    with pytest.raises(RewardError, match=r"^reward 'nan_at_2' returned a non-finite score at index 2: nan \(step 2; "):
        score_rewards(RewardSum([first, nan_at_2]), PROMPTS3, RESPONSES3, where="step 2")

    def huge(prompts, responses):
        return [1e308, 0.0, 0.0]

    with pytest.raises(RewardError, match=r"the weighted sum at index 0 is inf \(step 2\)"):
        score_rewards(RewardSum([huge], [10.0]), PROMPTS3, RESPONSES3, where="step 2")


class _Named:
    """A reward known by a spec, as load_reward names a classifier directory's."""

    def __init__(self, reward_name):
        self.reward_name = reward_name

    def __call__(self, prompts, responses):
        return [0.0] * len(responses)


def test_reward_names_are_short_and_unique(tmp_path):
    source = "def compute_score(data_source, solution_str, ground_truth):\n    return 1\n"
    for name in ("my_rewards.py", "other.py"):
        (tmp_path / name).write_text(source)
    rewards = [
        load_reward("math"),
        load_reward(f"{tmp_path / 'my_rewards.py'}:compute_score"),
        load_reward(f"{tmp_path / 'other.py'}:compute_score"),
        _Named(str(tmp_path / "rm dir")),
        lambda p, r: [0.0] * len(r),
        first,
    ]
    both = RewardSum(rewards, [1, 2, 3, 4, 5, 6])
    assert both.names == ("math", "compute_score", "compute_score_2", "rm_dir", "lambda", "first")
    assert both.reward_name == "math + 2*compute_score + 3*compute_score_2 + 4*rm_dir + 5*lambda + 6*first"
    assert reward_metric_name(load_reward("sentiment")) == "sentiment"


@pytest.mark.parametrize(
    "weights, error, message",
    [
        ([1.0, 2.0, 3.0], ValueError, r"^reward_weights has 3 values for 2 rewards; give one weight per reward"),
        ([1.0], ValueError, r"^reward_weights has 1 value for 2 rewards"),
        ([1.0, math.nan], ValueError, r"^reward_weights\[1\] must be a finite number, got nan$"),
        ([1.0, math.inf], ValueError, r"^reward_weights\[1\] must be a finite number, got inf$"),
        ([True, 1.0], ValueError, r"^reward_weights\[0\] must be a finite number, got True$"),
        ("1 2", ValueError, r"^reward_weights must be a list of numbers, one per reward, got '1 2'$"),
    ],
)
def test_bad_weights_are_one_line(weights, error, message):
    with pytest.raises(error, match=message):
        RewardSum([first, second], weights)


def test_bad_reward_lists():
    with pytest.raises(ValueError, match="reward_fn is an empty list"):
        RewardSum([])
    with pytest.raises(TypeError, match=r"^reward_fn\[1\] must be a reward function .* got str$"):
        RewardSum([first, "math"])
    with pytest.raises(ValueError, match=r"reward_weights \[1.0\] given with no reward_fn"):
        as_reward(None, [1.0])
    with pytest.raises(ValueError, match="given with a RewardSum, which has its own weights"):
        as_reward(RewardSum([first]), [1.0])
    assert check_reward_weights((1, 2.5), 2, what="--reward-weights") == [1.0, 2.5]
    with pytest.raises(ValueError, match=r"^--reward-weights has 3 values for 2 rewards"):
        check_reward_weights([1, 2, 3], 2, what="--reward-weights")


def takes_answer(prompts, responses, answer):
    return [float(r == a) for r, a in zip(responses, answer)]


def takes_level(completions, level=0, **kwargs):
    return [float(x) for x in level]


def test_each_reward_gets_its_fields_and_a_missing_one_names_that_reward():
    both = RewardSum([takes_answer, takes_level, first])
    fields = {"answer": ["a", "x", "ccc"], "level": [1, 2, 3], "id": [7, 8, 9]}
    assert check_reward_fields(both, fields) == ["answer", "id", "level"]
    assert reward_takes_fields(both) and not reward_takes_fields(RewardSum([first]))
    assert score_rewards(both, PROMPTS3, RESPONSES3, where="s", fields=fields).scores == [3.0, 4.0, 7.0]
    with pytest.raises(RewardError, match=r"^reward 'takes_answer' needs the prompt field 'answer', missing from --pr"):
        check_reward_fields(both, ["level"], source="--prompts 'p.jsonl'")


def test_load_rewards_one_spec_or_several():
    one = load_rewards("math")
    assert one.reward_name == "math" and not isinstance(one, RewardSum)
    assert load_rewards(["math"]).reward_name == "math"
    several = load_rewards(["math", "sentiment"], [1.0, 0.5])
    assert isinstance(several, RewardSum) and several.names == ("math", "sentiment")
    assert several.weights == (1.0, 0.5)


def test_a_classifier_among_several_rewards_shares_its_backbone_with_the_reference(tmp_path):
    from transformers import LlamaForSequenceClassification

    from pyppo.trainer.assemble import share_reward_weights
    from support.tiny_models import save_tiny_causal_lm, tiny_causal_lm, tiny_tokenizer

    base = save_tiny_causal_lm(tmp_path / "base")
    LlamaForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(tmp_path / "rm")
    tiny_tokenizer().save_pretrained(tmp_path / "rm")
    classifier = load_reward(str(tmp_path / "rm"))
    ref = type(tiny_causal_lm()).from_pretrained(base).requires_grad_(False)  # the frozen reference
    assert share_reward_weights(ref, RewardSum([first, classifier])) > 0
    assert classifier.__wrapped__.model.model.norm.weight.data_ptr() == ref.model.norm.weight.data_ptr()


# ----------------------------------------------------------------------------- metrics


def test_reward_columns_follow_a_selection_and_give_the_metrics():
    out = score_rewards(RewardSum([first, second], [1.0, 0.5]), PROMPTS3, RESPONSES3, where="s")
    columns = RewardColumns.of(out, several=True)
    world = World(rank=0, size=1, device=torch.device("cpu"))
    m = reward_metrics(columns, world)
    assert m["reward/first_mean"] == 2.0 and m["reward/first_std"] == 1.0
    assert m["reward/second_mean"] == 1.0 and m["reward/second_std"] == pytest.approx(math.sqrt(18))
    assert m["reward/unscored_fraction"] == 0.0
    picked = reward_metrics(columns.select(torch.tensor([1, 2])), world)
    assert picked["reward/first_mean"] == 2.5 and picked["reward/second_mean"] == -2.0
    assert math.isnan(picked["reward/second_std"])  # one applicable response: no spread
    none_apply = reward_metrics(columns.select(torch.tensor([1])), world)
    assert math.isnan(none_apply["reward/second_mean"])
    joined = RewardColumns.cat([columns.select(torch.tensor([2])), columns.select(torch.tensor([0]))])
    assert joined.parts["first"].tolist() == [3.0, 1.0]
    # one reward without dicts: no per-reward metrics (score_mean is its mean)
    assert reward_metrics(RewardColumns.of(score_rewards(first, PROMPTS3, RESPONSES3, where="s"), False), world) == {}


def length(prompts, responses):
    return [float(len(r)) for r in responses]


def odd(prompts, responses):
    # Applies to the prompts of even number (their number ends the prompt): 1.0 for an odd length.
    return [float(len(r) % 2) if int(p.split()[-1]) % 2 == 0 else None for p, r in zip(prompts, responses)]


def _expected(batch):
    lengths = [len(r) for r in batch.responses]
    applies = [int(p.split()[-1]) % 2 == 0 for p in batch.prompts]
    odds = [float(len(r) % 2) for r, a in zip(batch.responses, applies) if a]
    scores = [0.5 * n + (2.0 * (n % 2) if a else 0.0) for n, a in zip(lengths, applies)]
    # The batch tells a mean over the responses odd applies to from one over all of them.
    assert 0 < sum(odds) and len(odds) < len(lengths)
    return lengths, odds, scores


def test_a_step_logs_each_reward_over_the_responses_it_applies_to():
    trainer = make_trainer(small_config(steps=1, ppo_epochs=1), reward=[length, odd])
    assert isinstance(trainer.reward_fn, RewardSum)  # the list, before any weights: 1.0 each
    trainer = make_trainer(small_config(steps=1, ppo_epochs=1), reward=RewardSum([length, odd], [0.5, 2.0]))
    metrics, batch = trainer.step()
    lengths, odds, scores = _expected(batch)
    assert batch.raw_scores.tolist() == pytest.approx(scores)
    assert metrics["score_mean"] == pytest.approx(sum(scores) / len(scores))
    assert metrics["reward/length_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert metrics["reward/length_std"] == pytest.approx(torch.tensor(lengths, dtype=torch.float64).std().item())
    assert metrics["reward/odd_mean"] == pytest.approx(sum(odds) / len(odds))
    assert metrics["reward/unscored_fraction"] == 0.0


def test_dapo_filter_keeps_each_rewards_metrics_on_the_kept_responses():
    config = small_config(
        steps=1, ppo_epochs=1, samples_per_prompt=2, filter_groups=True, filter_groups_max_tries=3, max_new_tokens=4
    )
    metrics, batch = make_trainer(config, reward=[length, odd]).step()
    lengths, odds, _ = _expected(batch)
    assert metrics["filter_groups_tries"] > 1  # more than one draw: the kept rows are a selection
    assert metrics["reward/length_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert metrics["reward/odd_mean"] == pytest.approx(sum(odds) / len(odds))


def test_an_evaluation_logs_each_reward_over_the_held_out_responses_it_applies_to():
    from pyppo.run.evaluate import evaluate_prompts

    trainer = make_trainer(small_config(steps=1, batch_size=4), reward=RewardSum([length, odd], [0.5, 2.0]))
    prompts = PROMPTS[:5]  # two batches of 4, the second with one prompt
    metrics, rows = evaluate_prompts(trainer, prompts)
    assert [r["prompt"] for r in rows] == prompts
    lengths = [len(r["response"]) for r in rows]
    odds = [float(n % 2) for n, r in zip(lengths, rows) if int(r["prompt"].split()[-1]) % 2 == 0]
    assert 0 < len(odds) < len(rows)
    assert metrics["eval/reward/length_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert metrics["eval/reward/odd_mean"] == pytest.approx(sum(odds) / len(odds))
    assert metrics["eval/reward/unscored_fraction"] == 0.0
    assert metrics["eval/score_mean"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))


def test_per_reward_metrics_reach_metrics_jsonl_and_config_toml(tmp_path):
    import tomllib

    from pyppo import PPOTrainer
    from support.tiny_models import tiny_causal_lm, tiny_tokenizer

    config = small_config(steps=1, ppo_epochs=1)
    rewards = [length, odd]
    trainer = PPOTrainer(
        config, tiny_causal_lm(seed=0), None, None, tiny_tokenizer(), rewards, PROMPTS, reward_weights=[1, 0.25]
    )
    assert trainer.reward_fn.weights == (1.0, 0.25)
    trainer.train(tmp_path / "run", progress=False)
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/length_mean", "reward/length_std", "reward/odd_mean", "reward/unscored_fraction"} <= set(row)
    recorded = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert recorded["reward"] == ["test_reward_sum:length", "test_reward_sum:odd"]
    assert recorded["reward_weights"] == [1.0, 0.25]


# ----------------------------------------------------------------------------- veRL in a run


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "toy" and extra_info["index"] >= 0
    hit = len(solution_str) % 2 == int(ground_truth)
    return {"score": 1.0 if hit else 0.0, "acc": hit, "pred": solution_str[-3:]}


def test_a_verl_compute_score_trains_and_logs_its_extras():
    records = [
        {"prompt": p, "data_source": "toy", "ground_truth": "1", "extra_info": {"index": i}}
        for i, p in enumerate(PROMPTS)
    ]
    metrics, batch = make_trainer(small_config(steps=1, ppo_epochs=1), reward=compute_score, prompts=records).step()
    hits = [float(len(r) % 2 == 1) for r in batch.responses]
    assert batch.raw_scores.tolist() == hits
    assert metrics["reward/compute_score/acc_mean"] == pytest.approx(sum(hits) / len(hits))
    assert not any("pred" in k for k in metrics)  # a string is not a metric
    assert all(r["extra_info"] == {"index": i} for i, r in enumerate(records))  # not written to
    # in a list, beside another reward
    metrics, batch = make_trainer(
        small_config(steps=1, ppo_epochs=1), reward=[compute_score, length], prompts=records
    ).step()
    assert "reward/compute_score_mean" in metrics and "reward/compute_score/acc_mean" in metrics
