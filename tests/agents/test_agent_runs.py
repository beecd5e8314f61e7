"""``pyppo train --env``: a multi-turn run stopped by a signal resumes to the uninterrupted run's
metrics (the environments are seeded from the run's generator); samples.jsonl holds each
episode's transcript; a bad --env is a one-line error."""

from __future__ import annotations

import os
import signal

import pytest

from pyppo import cli
from support.run_fixture import TESTS, ckpt_step, read_rows, tiny_dir, untimed  # noqa: F401 (fixtures)

ECHO = TESTS / "support" / "echo_env.py"

FLAGS = ["--steps", "3", "--batch-size", "4", "--mini-batch-size", "2", "--ppo-epochs", "1"]
FLAGS += ["--max-new-tokens", "24", "--max-turns", "3", "--seed", "5", "--save-every", "100", "--dtype", "float32"]


@pytest.fixture(scope="module")
def env_file():
    return ECHO


@pytest.fixture(scope="module")
def straight(tiny_dir, env_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    argv = ["train", "--model", str(tiny_dir), "--env", f"{env_file}:Echo", "--output", str(out), *FLAGS]
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
    straight, tiny_dir, env_file, tmp_path, capsys, monkeypatch
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
    argv = ["train", "--model", str(tiny_dir), "--env", f"{env_file}:Echo", "--output", str(out), *FLAGS]
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
