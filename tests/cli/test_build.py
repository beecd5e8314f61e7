"""pyppo.cli.build and the --prompts / --reward names: what the trainer is given (prompt strings, or
records with their fields), and built-in names resolved before paths."""

from __future__ import annotations

import json

import pytest

from pyppo import cli
from pyppo.cli import build
from pyppo.cli.flags import CLIError
from pyppo.config import PPOConfig
from pyppo.prompts import DEFAULT_PROMPTS, arithmetic_prompts
from support.run_fixture import prompts_file, tiny_dir  # noqa: F401 (fixtures)


@pytest.fixture
def captured(monkeypatch):
    """build_trainer with the model load and the trainer replaced by recorders of their arguments."""
    calls = {}
    monkeypatch.setattr(build.models, "load_model_and_tokenizer", lambda source: ("policy", "tokenizer"))

    def trainer(config, policy, ref, value, tokenizer, reward_fn, prompts, **kwargs):
        calls.update(reward_fn=reward_fn, prompts=prompts, **kwargs)
        return "trainer"

    monkeypatch.setattr(build, "PPOTrainer", trainer)
    return calls


def test_records_with_fields_reach_the_trainer(tiny_dir, captured):
    assert (
        build.build_trainer(
            PPOConfig(), model=str(tiny_dir), reward="math", prompts="arithmetic", eval_prompts="arithmetic-eval"
        )
        == "trainer"
    )
    assert captured["prompts"] == arithmetic_prompts("train")
    assert captured["eval_prompts"] == arithmetic_prompts("eval")
    assert captured["reward_fn"].reward_name == "math"


def test_prompts_without_fields_reach_the_trainer_as_strings(tiny_dir, prompts_file, captured):
    build.build_trainer(PPOConfig(), model=str(tiny_dir), prompts=str(prompts_file), eval_prompts=str(prompts_file))
    assert captured["prompts"] == captured["eval_prompts"] == ["Say hi.", "Describe rain.", "Why?"]
    build.build_trainer(PPOConfig(), model=str(tiny_dir))
    assert captured["prompts"] == list(DEFAULT_PROMPTS) and captured["eval_prompts"] is None


def test_fields_reach_the_trainer_when_the_reward_takes_them(tiny_dir, tmp_path, captured):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "Hi.", "answer": 1}) + "\n" + json.dumps({"prompt": "Yo.", "answer": 2}) + "\n"
    )
    build.build_trainer(PPOConfig(), model=str(tiny_dir), reward="math", prompts=str(path))
    assert captured["prompts"] == [{"prompt": "Hi.", "answer": 1}, {"prompt": "Yo.", "answer": 2}]
    # A reward that takes no field gets the prompts only, and lines may carry differing metadata.
    path.write_text(json.dumps({"prompt": "Hi.", "id": 1}) + "\n" + json.dumps({"prompt": "Yo.", "src": "x"}) + "\n")
    build.build_trainer(PPOConfig(), model=str(tiny_dir), reward="sentiment", prompts=str(path))
    assert captured["prompts"] == ["Hi.", "Yo."]


def test_builtin_names_are_kept_by_the_resolved_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "math").mkdir()  # a directory named like the built-in reward is not the reward
    args = cli.build_parser().parse_args(
        [
            "train",
            "--reward",
            "math",
            "--prompts",
            "arithmetic",
            "--eval-prompts",
            "arithmetic-eval",
            "--output",
            str(tmp_path / "o"),
        ]
    )
    run = cli.resolve_train_config(args).run
    assert (run["reward"], run["prompts"], run["eval_prompts"]) == ("math", "arithmetic", "arithmetic-eval")
    args = cli.build_parser().parse_args(["train", "--prompts", "arithmetics", "--output", str(tmp_path / "o")])
    with pytest.raises(CLIError, match="--prompts 'arithmetics': no such file"):
        cli.resolve_train_config(args)


def test_help_lists_the_builtin_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "'math' (1.0 when the response's final answer" in text
    assert "a built-in set: 'arithmetic'" in text and "'arithmetic-eval'" in text
