"""``pyppo train --reward a --reward b --reward-weights ...``: several rewards from the command line
and from config.toml, kept by a resume, each logged; veRL's compute_score as a --reward; the
one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from pyppo import cli
from pyppo.cli.flags import CLIError
from pyppo.cli.train import TRAIN_DEFAULTS
from pyppo.config import PPOConfig
from pyppo.run.config_file import write_config
from support.run_fixture import read_rows, tiny_dir  # noqa: F401 (fixtures)

REWARDS = """\
def length(prompts, responses):
    return [float(len(r)) for r in responses]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    hit = ground_truth in solution_str
    return {"score": float(hit), "acc": hit}
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "rw.py").write_text(REWARDS)
    rows = [{"prompt": p, "data_source": "toy", "ground_truth": "e"} for p in ("Say hi.", "Why?", "Rain?")]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return tmp_path


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("pyppo: error: ")]
    assert len(errors) == 1 and not any("Traceback" in line for line in err), err
    return errors[0]


def _argv(tiny_dir, files, *extra):
    return [
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(files / "p.jsonl"),
        "--batch-size",
        "2",
        "--mini-batch-size",
        "1",
        "--max-new-tokens",
        "4",
        "--save-every",
        "1",
        *extra,
    ]


def test_several_rewards_train_are_recorded_and_kept_by_a_resume(tiny_dir, files, capsys, monkeypatch):
    import tomllib

    run = files / "run"
    rewards = ["--reward", "rw.py:length", "--reward", f"{files / 'rw.py'}:compute_score"]
    argv = _argv(tiny_dir, files, *rewards, "--reward-weights", "0.5", "2", "--steps", "1", "--output", str(run))
    monkeypatch.chdir(files)  # rw.py:length, relative: recorded absolute
    assert cli.main(argv) == 0
    recorded = tomllib.loads((run / "config.toml").read_text())
    assert recorded["reward"] == [f"{files / 'rw.py'}:length", f"{files / 'rw.py'}:compute_score"]
    assert recorded["reward_weights"] == [0.5, 2.0]
    (row,) = read_rows(run / "metrics.jsonl")
    assert row["score_mean"] == pytest.approx(0.5 * row["reward/length_mean"] + 2 * row["reward/compute_score_mean"])
    assert row["reward/compute_score/acc_mean"] == row["reward/compute_score_mean"]

    # The resume keeps them: other weights, or rewards, are refused before anything loads.
    for given, line in [
        (["--reward-weights", "0.5", "3"], "--reward-weights [0.5, 3.0] differs from the resumed run's reward_weights"),
        (["--reward-weights", "1", "1", "1"], "--reward-weights [1.0, 1.0, 1.0] differs from the resumed run's"),
        (["--reward", "sentiment"], "--reward 'sentiment' differs from the resumed run's reward ["),
    ]:
        capsys.readouterr()
        assert cli.main(["train", "--resume", str(run), "--steps", "2", *given]) == 2
        error = _one_error(capsys)
        assert line in error and error.endswith("start a new run (--output) to change it"), error
    assert cli.main(["train", "--resume", str(run), "--steps", "2", "--reward-weights", "0.5", "2"]) == 0
    rows = read_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and "reward/length_mean" in rows[1]
    assert tomllib.loads((run / "config.toml").read_text())["reward_weights"] == [0.5, 2.0]


def test_weights_that_do_not_match_the_rewards_are_one_line(tiny_dir, files, capsys):
    out = files / "o"
    argv = _argv(tiny_dir, files, "--reward", "math", "--reward", "sentiment", "--reward-weights", "1", "2", "3")
    assert cli.main([*argv, "--output", str(out)]) == 2
    assert _one_error(capsys) == (
        "pyppo: error: --reward-weights has 3 values for 2 rewards; give one weight per reward, in their order"
    )
    argv = _argv(tiny_dir, files, "--reward", "math", "--reward-weights", "1", "nan")
    assert cli.main([*argv, "--output", str(out)]) == 2
    assert "--reward-weights has 2 values for 1 reward;" in _one_error(capsys)
    assert (
        cli.main([*_argv(tiny_dir, files, "--reward", "length", "--reward-weights", "nan"), "--output", str(out)]) == 2
    )
    assert _one_error(capsys) == "pyppo: error: --reward-weights[0] must be a finite number, got nan"
    assert not out.exists()


def test_a_verl_compute_score_without_its_columns_is_refused_before_loading(tiny_dir, files, capsys):
    (files / "plain.jsonl").write_text(json.dumps({"prompt": "Hi.", "answer": "5"}))
    spec = f"{files / 'rw.py'}:compute_score"
    argv = _argv(tiny_dir, files, "--reward", "math", "--reward", spec, "--prompts", str(files / "plain.jsonl"))
    assert cli.main([*argv, "--output", str(files / "o")]) == 2
    assert _one_error(capsys).startswith(
        f"pyppo: error: reward {spec!r} needs the prompt fields 'data_source', 'ground_truth', missing from "
        f"--prompts {str(files / 'plain.jsonl')!r}"
    )


def test_rewards_and_weights_from_a_config_file(files, capsys):
    path = files / "run.toml"
    path.write_text('reward = ["math", "sentiment"]\nreward_weights = [1, 0.5]\n')
    plan = cli.resolve_train_config(cli.build_parser().parse_args(["train", "--config", str(path)]))
    assert plan.run["reward"] == ["math", "sentiment"] and plan.run["reward_weights"] == [1.0, 0.5]
    plan = cli.resolve_train_config(cli.build_parser().parse_args(["train", "--reward", "math"]))
    assert plan.run["reward"] == "math" and "reward_weights" not in plan.run  # one reward: as before
    for text, message in [
        ('reward = ["math", "sentiment"]\nreward_weights = [1]\n', f"{path}: reward_weights has 1 value for 2 rewards"),
        ('reward = "math"\nreward_weights = "1"\n', "'reward_weights' must be a list of numbers, one per reward"),
        ('reward = "math"\nreward_weights = [true]\n', "'reward_weights' must be a list of numbers"),
        ("reward = []\n", "'reward' must be a spec or a non-empty list of specs, got []"),
        ('reward = ["math", 3]\n', "'reward' must be a spec or a non-empty list of specs"),
    ]:
        path.write_text(text)
        assert cli.main(["train", "--config", str(path), "--output", str(files / "o")]) == 2
        assert message in _one_error(capsys)


def test_a_resumed_run_without_weights_has_one_each(tmp_path):
    config = PPOConfig(**{**TRAIN_DEFAULTS, "dtype": "float32"})
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    write_config(run / "config.toml", {"model": str(run / "no-model"), "reward": ["math", "sentiment"]}, config)
    for name in ("policy.pt", "value_model.pt", "optimizers.pt"):
        torch.save({}, run / "checkpoint" / name)
    torch.save({"step": 1, "world_size": 1, "config": config.to_dict()}, run / "checkpoint" / "trainer_state.pt")
    args = ["train", "--resume", str(run), "--reward-weights", "1", "1"]
    plan = cli.resolve_train_config(cli.build_parser().parse_args(args))
    assert plan.run["reward"] == ["math", "sentiment"] and plan.run["reward_weights"] == [1.0, 1.0]
    args[-1] = "2"
    with pytest.raises(CLIError, match=r"--reward-weights \[1.0, 2.0\] differs .* reward_weights \[1.0, 1.0\]"):
        cli.resolve_train_config(cli.build_parser().parse_args(args))


ASYNC_AND_BOOL = """\
import asyncio


async def async_r(prompts, responses):
    return [1.0 for _ in responses]


def sneaky(prompts, responses):  # a plain def that returns a coroutine: found only when it is called
    return async_r(prompts, responses)


def trl_bool(completions, **kwargs):  # TRL makes a float tensor of this
    return [len(c) > 2 for c in completions]
"""


def _no_model_loads(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_an_async_reward_is_one_line_before_any_model_loads(tiny_dir, files, capsys, monkeypatch):
    import gc
    import warnings

    (files / "ar.py").write_text(ASYNC_AND_BOOL)
    spec = f"{files / 'ar.py'}:async_r"
    _no_model_loads(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for reward in (["--reward", spec], ["--reward", "math", "--reward", spec]):
            assert cli.main([*_argv(tiny_dir, files, *reward), "--output", str(files / "o")]) == 2
            assert _one_error(capsys) == (
                f"pyppo: error: reward {spec!r} is an async function; pyppo calls rewards synchronously: wrap it "
                "(asyncio.run) in a plain def with the same parameters that returns asyncio.run(async_r(...))"
            )
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not (files / "o").exists()


def test_a_reward_that_returns_a_coroutine_is_one_line_without_a_runtime_warning(tiny_dir, files, capsys):
    import gc
    import warnings

    (files / "ar.py").write_text(ASYNC_AND_BOOL)
    spec = f"{files / 'ar.py'}:sneaky"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main([*_argv(tiny_dir, files, "--reward", spec, "--steps", "1"), "--output", str(files / "o")]) == 2
        gc.collect()
    err = capsys.readouterr().err
    assert "RuntimeWarning" not in err and "never awaited" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("pyppo: error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"pyppo: error: reward {spec!r} returned a coroutine; pyppo calls rewards synchronously"
    ), err
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_bool_reward_trains(tiny_dir, files, capsys):
    (files / "ar.py").write_text(ASYNC_AND_BOOL)
    run = files / "run"
    argv = _argv(tiny_dir, files, "--reward", f"{files / 'ar.py'}:trl_bool", "--steps", "1", "--output", str(run))
    assert cli.main(argv) == 0, capsys.readouterr().err
    (row,) = read_rows(run / "metrics.jsonl")
    assert 0.0 <= row["score_mean"] <= 1.0


def test_a_python_file_without_its_function_is_one_line_naming_its_functions(tiny_dir, files, capsys, monkeypatch):
    (files / "ar.py").write_text(ASYNC_AND_BOOL)
    monkeypatch.chdir(files)
    _no_model_loads(monkeypatch)
    assert cli.main([*_argv(tiny_dir, files, "--reward", "ar.py"), "--output", str(files / "o")]) == 2
    assert _one_error(capsys) == (
        "pyppo: error: reward 'ar.py' is not 'sentiment', 'math', 'reasoning-gym', an existing model directory, "
        "'module:function' or 'file.py:function'; did you mean 'ar.py:FUNCTION'? "
        "(its functions: async_r, sneaky, trl_bool)"
    )
    assert not (files / "o").exists()
