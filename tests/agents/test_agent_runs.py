"""``pyppo train --env``: a multi-turn run stopped by a signal resumes to the uninterrupted run's
metrics (the environments are seeded from the run's generator); samples.jsonl holds each
episode's transcript; a bad --env is a one-line error."""

from __future__ import annotations

import os
import signal

import pytest

from pyppo import cli
from support.run_fixture import TESTS, ckpt_step, prompts_file, read_rows, tiny_dir, untimed  # noqa: F401 (fixtures)

ECHO = TESTS / "support" / "echo_env.py"

FLAGS = ["--steps", "3", "--batch-size", "4", "--mini-batch-size", "2", "--ppo-epochs", "1"]
FLAGS += ["--max-new-tokens", "24", "--max-turns", "3", "--seed", "5", "--save-every", "100", "--dtype", "float32"]


@pytest.fixture(scope="module")
def env_file():
    return ECHO


@pytest.fixture(scope="module")
def straight(tiny_dir, env_file, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    argv = ["train", "--model", str(tiny_dir), "--env", f"{env_file}:Echo", "--prompts", str(prompts_file)]
    argv += ["--output", str(out), *FLAGS]
    assert cli.main(argv) == 0
    return out


def test_samples_hold_each_episodes_transcript_and_the_metrics_its_turns(straight):
    rows = read_rows(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("turns_mean", "episode_tokens_mean", "env_token_fraction", "tool_calls_mean", "tool_error_fraction"):
        assert all(key in r for r in rows), key
    assert all(r["first_max_abs_logratio"] == 0.0 for r in rows)
    samples = read_rows(straight / "samples.jsonl")
    assert len(samples) == 12
    multi = [s for s in samples if s["turns"] > 1]
    assert multi, "no episode of the tiny model reached a second turn"
    for s in multi:
        roles = [t["role"] for t in s["transcript"]]
        assert roles[:3] == ["agent", "environment", "agent"]
        assert "Say " in s["transcript"][1]["text"]
    config = (straight / "config.toml").read_text()
    assert "echo_env.py:Echo" in config and 'reward = "none"' in config


def test_a_signal_mid_run_resumes_to_the_uninterrupted_runs_metrics(
    straight, tiny_dir, env_file, prompts_file, tmp_path, capsys, monkeypatch
):
    from pyppo.agents.episodes import AgentEngine

    out = tmp_path / "run"
    real, calls = AgentEngine.run_episodes, []

    def sampling(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # during step 2's episodes: step 2 finishes, then stops
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AgentEngine, "run_episodes", sampling)
    argv = ["train", "--model", str(tiny_dir), "--env", f"{env_file}:Echo", "--prompts", str(prompts_file)]
    argv += ["--output", str(out), *FLAGS]
    assert cli.main(argv) == 143
    assert ckpt_step(out / "checkpoint") == 2
    monkeypatch.undo()
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(out)]) == 0
    expected = [untimed(r) for r in read_rows(straight / "metrics.jsonl")]
    assert [untimed(r) for r in read_rows(out / "metrics.jsonl")] == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--env", "no-such-env"], "--env 'no-such-env'"),
        (["--env", "nowhere.py:Env"], "--env 'nowhere.py:Env'"),
        (["--reward", "none"], "--reward none needs --env"),
    ],
)
def test_a_bad_env_is_a_one_line_error(argv, message, tiny_dir, tmp_path, capsys):
    status = cli.main(["train", "--model", str(tiny_dir), "--output", str(tmp_path / "run"), "--steps", "1", *argv])
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err, err


BROKEN_ENVS = """
import numpy as np


class Base:
    def reset(self, **kwargs):
        return None

    def step(self, action):
        return None, 0.0, True


class StepStr(Base):
    def step(self, action):
        return "just a string"


class NeedsArg(Base):
    def __init__(self, size):
        self.size = size


class EmptyPrompts(Base):
    @classmethod
    def default_prompts(cls):
        return []


class InstancePrompts(Base):
    def default_prompts(self):
        return [{"prompt": "Say hi."}]


class StringPrompts(Base):
    @classmethod
    def default_prompts(cls):
        return ["Say hi."]


class BadReward(Base):
    default_reward = "no-such-reward"

    @classmethod
    def default_prompts(cls):
        return [{"prompt": "Say hi."}]


class NumpyDone(Base):
    @classmethod
    def default_prompts(cls):
        return [{"prompt": "Say hi."}, {"prompt": "Why?"}]

    def step(self, action):
        return None, np.float32(1.0), np.True_
"""


@pytest.mark.parametrize(
    "env, with_prompts, message",
    [
        ("StepStr", True, "environment StepStr: step() must return (observation, reward, done)"),
        ("NeedsArg", True, "NeedsArg.__init__(size) needs arguments"),
        ("StepStr.reset", True, "Base.reset(self, **kwargs) needs arguments (missing a required argument: 'self')"),
        ("Base", False, "--env {file}:Base declares no prompts (default_prompts); pass --prompts FILE.jsonl"),
        ("EmptyPrompts", False, "--env {file}:EmptyPrompts declares no prompts (default_prompts); pass --prompts"),
        ("InstancePrompts", False, "environment InstancePrompts: default_prompts is an instance method"),
        ("StringPrompts", False, "environment StringPrompts: default_prompts() returned str 'Say hi.'"),
        ("BadReward", False, "environment BadReward's default_reward 'no-such-reward' is invalid: "),
    ],
)
def test_an_env_that_breaks_the_contract_is_a_one_line_error(
    env, with_prompts, message, tiny_dir, prompts_file, tmp_path, capsys
):
    file = tmp_path / "broken_envs.py"
    file.write_text(BROKEN_ENVS)
    argv = ["train", "--model", str(tiny_dir), "--env", f"{file}:{env}", "--output", str(tmp_path / "run")]
    argv += ["--steps", "1", "--batch-size", "2", "--mini-batch-size", "2", "--max-new-tokens", "8", "--max-turns", "2"]
    status = cli.main(argv + (["--prompts", str(prompts_file)] if with_prompts else []))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("pyppo: error: ")]
    assert status == 2 and "Traceback" not in err and len(errors) == 1, err
    assert message.format(file=file) in errors[0], err


def test_numpy_booleans_and_an_env_file_that_fails_to_import(tiny_dir, tmp_path, capsys):
    file = tmp_path / "numpy_envs.py"
    file.write_text(BROKEN_ENVS)
    argv = ["train", "--model", str(tiny_dir), "--steps", "1", "--batch-size", "2", "--mini-batch-size", "2"]
    argv += ["--max-new-tokens", "8", "--max-turns", "2"]
    assert cli.main([*argv, "--env", f"{file}:NumpyDone", "--output", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    broken = tmp_path / "syntax_env.py"
    broken.write_text("class Broken\n    pass\n")
    assert cli.main([*argv, "--env", f"{broken}:Broken", "--output", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"--env '{broken}:Broken': importing {broken} failed: SyntaxError" in err, err


def test_a_run_started_from_python_with_an_environment_is_continued_by_pyppo_train_resume(
    tiny_dir, env_file, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyppo import PPOConfig, PPOTrainer

    config = PPOConfig(steps=1, batch_size=2, mini_batch_size=2, ppo_epochs=1, max_new_tokens=8, max_turns=2)
    policy, tok = AutoModelForCausalLM.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    trainer = PPOTrainer(config, policy, None, None, tok, None, ["Say hi.", "Why?"], environment=f"{env_file}:Echo")
    trainer.train(tmp_path / "run", progress=False)
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert f'env = "{env_file}:Echo"' in saved and 'reward = "none"' in saved
    assert cli.main(["train", "--resume", str(tmp_path / "run"), "--steps", "2"]) == 0
    capsys.readouterr()
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and "turns_mean" in rows[1]


def test_eval_every_with_an_env_evaluates_on_its_held_out_prompts(tiny_dir, tmp_path, capsys):
    from pyppo.agents.envs.calculator import Calculator
    from pyppo.cli.build import check_sources

    _, _, held_out = check_sources(str(tiny_dir), "math", None, "cpu", None, "calculator", env_eval=True)
    assert held_out == Calculator.default_eval_prompts()
    assert check_sources(str(tiny_dir), "math", None, "cpu", None, "calculator")[2] is None  # no evaluation
    # An environment with no held-out set of its own needs --eval-prompts.
    argv = ["train", "--model", str(tiny_dir), "--env", f"{ECHO}:Echo", "--eval-every", "2"]
    assert cli.main([*argv, "--output", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert "--eval-every 2 needs --eval-prompts" in capsys.readouterr().err


def test_a_python_run_whose_environment_has_no_name_is_not_resumed_without_one(tiny_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyppo import PPOConfig, PPOTrainer
    from support.echo_env import Echo

    class Local(Echo):  # a class the command line cannot import by name
        pass

    config = PPOConfig(steps=1, batch_size=2, mini_batch_size=2, ppo_epochs=1, max_new_tokens=8, max_turns=2)
    policy, tok = AutoModelForCausalLM.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    trainer = PPOTrainer(config, policy, None, None, tok, None, ["Say hi.", "Why?"], environment=Local)
    trainer.train(tmp_path / "run", progress=False)
    assert 'env = "python:text environment Local"' in (tmp_path / "run" / "config.toml").read_text()
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(tmp_path / "run"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "started from Python with text environment Local" in err and "pass --env" in err, err
    # An --env stands in for it: the run goes on with its episodes.
    assert cli.main(["train", "--resume", str(tmp_path / "run"), "--steps", "2", "--env", f"{ECHO}:Echo"]) == 0
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and "turns_mean" in rows[1]


def test_episode_limits_without_an_environment_are_refused(tiny_dir, tmp_path, capsys):
    argv = ["train", "--model", str(tiny_dir), "--output", str(tmp_path / "run"), "--steps", "1", "--max-turns", "3"]
    assert cli.main(argv) == 2
    assert "max_turns = 3 has no effect here: it needs multi-turn episodes" in capsys.readouterr().err


def test_every_evaluation_gets_the_same_episodes_and_its_rows_their_transcripts(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyppo import PPOConfig, PPOTrainer
    from pyppo.run.evaluate import evaluate_prompts
    from support.echo_env import Echo

    config = PPOConfig(steps=1, batch_size=2, mini_batch_size=2, ppo_epochs=1, max_new_tokens=8, max_turns=3)
    policy, tok = AutoModelForCausalLM.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    held_out = ["Say hi.", "Why?", "Count to three."]
    trainer = PPOTrainer(config, policy, None, None, tok, None, ["Go."] * 2, environment=Echo, eval_prompts=held_out)
    first = evaluate_prompts(trainer)
    torch.rand(1000)  # the training's generator moved on: the evaluation does not follow it
    again = evaluate_prompts(trainer)
    assert first == again
    rows = first[1]
    assert [r["prompt"] for r in rows] == held_out
    assert all(r["transcript"] and r["transcript"][0]["role"] == "agent" and r["turns"] >= 1 for r in rows)
