"""User errors end in one line before anything large loads: a reward that raises or returns a
non-finite or non-number score is named (with the step and the prompt), and configuration errors
come before any model is loaded."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo import cli
from pyppo.config import PPOConfig
from pyppo.rewards import RewardError, load_reward
from support.run_fixture import prompts_file, tiny_dir  # noqa: F401 (fixtures)
from support.trainer_fixture import make_trainer, small_config

# ----------------------------------------------------------------------------- rewards


def boom(prompts, responses):
    return [1.0 / 0.0 for _ in responses]


def too_few(prompts, responses):
    return [0.0] * (len(responses) - 1)


def nan_at_3(prompts, responses):
    return [math.nan if i == 3 else 0.5 for i in range(len(responses))]


def word_at_2(prompts, responses):
    return [0.0, 1.0, "great", 0.0, 0.0, 0.0, 0.0, 0.0]


def inf_tensor(prompts, responses):
    s = torch.zeros(len(responses))
    s[5] = -math.inf
    return s


@pytest.mark.parametrize("wrap", [False, True], ids=["callable", "load_reward"])
@pytest.mark.parametrize(
    "fn, pattern, index",
    [
        (boom, r"reward 'boom' raised ZeroDivisionError: float division by zero \(step 1, scoring 8 responses\)", None),
        (too_few, r"reward 'too_few' returned 7 scores for 8 responses \(step 1\)", None),
        (nan_at_3, r"reward 'nan_at_3' returned a non-finite score at index 3: nan \(step 1; prompt 3: '", 3),
        (word_at_2, r"reward 'word_at_2' returned a non-number at index 2: 'great'", 2),
        (inf_tensor, r"reward 'inf_tensor' returned a non-finite score at index 5: -inf", 5),
    ],
)
def test_bad_reward_is_named_before_advantages(fn, pattern, index, wrap, monkeypatch):
    import pyppo.trainer.advantages as advantages_mod

    def no_gae(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("a bad reward reached GAE")

    monkeypatch.setattr(advantages_mod, "gae", no_gae)
    tr = make_trainer(small_config(steps=1), reward=load_reward(fn) if wrap else fn)
    with pytest.raises(RewardError, match=pattern) as info:
        tr.step()
    assert info.value.reward == fn.__name__ and info.value.index == index
    assert "raised RewardError" not in str(info.value)  # a load_reward wrapper's error is not wrapped twice


def test_cli_reward_returning_nan_is_one_line(tiny_dir, prompts_file, tmp_path, capsys):
    (tmp_path / "myreward.py").write_text(
        "def score(prompts, responses):\n    return [float('nan')] * len(responses)\n"
    )
    argv = [
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts_file),
        "--output",
        str(tmp_path / "o"),
        "--reward",
        f"{tmp_path / 'myreward.py'}:score",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--mini-batch-size",
        "1",
        "--max-new-tokens",
        "3",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("pyppo: error: ")]
    assert len(errors) == 1 and errors[0].startswith("pyppo: error: reward ")
    assert "returned a non-finite score at index 0: nan (step 1; prompt 0:" in errors[0]
    assert not (tmp_path / "o").exists()  # nothing half-written: no run directory to trip over


# ----------------------------------------------------------------------------- configuration first


@pytest.mark.parametrize(
    "toml, flags, expected",
    [
        ("stepz = 2\n", [], "unknown key 'stepz'"),
        ("[ppo]\nlam = 0.9\n", [], "unknown table [ppo]"),
        ("lam = 1.5\n", [], "lam must be a finite number in [0.0, 1.0]"),
        ("lam = -0.01\n", [], "lam must be"),
        ("gamma = 2\n", [], "gamma must be"),
        ("", ["--kl-coef", "-0.1"], "kl_coef must be"),
        ("kl_coef = -1e-9\n", [], "kl_coef must be"),
        ("", ["--lr", "nan"], "lr must be"),
        ('lr = "fast"\n', [], "lr must be a finite number"),
        ("batch_size = 6\nmini_batch_size = 4\n", [], "mini_batch_size (4) must divide batch_size (6)"),
        ("mini_batch_size = 4\nmicro_batch_size = 3\n", [], "micro_batch_size (3) must divide mini_batch_size (4)"),
        ("steps = 2.0\n", [], "steps must be an int"),
        ("use_chat_template = 1\n", [], "use_chat_template must be a bool"),
        ('kl_estimator = "k9"\n', [], "kl_estimator must be one of"),
        ("max_consecutive_skips = 0\n", [], "max_consecutive_skips must be an int >= 1"),
        ("reward = 3\n", [], "'reward' must be a string"),
    ],
)
def test_config_errors_come_before_any_loading(toml, flags, expected, tmp_path, capsys, monkeypatch):
    import pyppo.models

    def no_loading(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("a model was loaded before the configuration was checked")

    monkeypatch.setattr(pyppo.models, "load_model_and_tokenizer", no_loading)
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    out = tmp_path / "out"
    argv = ["train", "--model", str(tmp_path / "no-such-model"), "--config", str(cfg), "--output", str(out), *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pyppo: error: "), err
    assert expected in err[0] and "no-such-model" not in err[0]
    assert not out.exists()


def test_seed_beyond_torch_range_is_rejected():
    PPOConfig(seed=2**63 - 1)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        PPOConfig(seed=2**63)


def test_resume_of_a_directory_without_config_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    assert cli.main(["train", "--resume", str(run)]) == 2
    assert "no config.toml in it (not a pyppo run directory)" in capsys.readouterr().err


# ----------------------------------------------------------------------------- prompt fields


def _no_loading(monkeypatch):
    import pyppo.models

    def no_loading(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("a model was loaded before the prompts' fields were checked")

    monkeypatch.setattr(pyppo.models, "load_model_and_tokenizer", no_loading)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            [],
            "reward 'math' needs the prompt field 'answer', missing from the default prompts (no --prompts), whose "
            'fields besides "prompt" are: none; the built-in set --prompts arithmetic has what it needs',
        ),
        (
            ["--prompts", "{fields}"],
            "reward 'math' needs the prompt field 'answer', missing from --prompts '{fields}', "
            "whose fields besides \"prompt\" are: 'level', 'solution'; the built-in set "
            "--prompts arithmetic has what it needs",
        ),
        (
            ["--prompts", "arithmetic", "--eval-prompts", "{plain}"],
            "reward 'math' needs the prompt field 'answer', missing from --eval-prompts '{plain}', "
            "whose fields besides "
            '"prompt" are: none; the built-in set --eval-prompts arithmetic-eval has what it needs',
        ),
        (
            ["--prompts", "{mixed}"],
            "{mixed}:2: its fields besides \"prompt\" are 'answer', 'level', but {mixed}:1's "
            "are 'answer'; every line needs the same fields",
        ),
    ],
)
def test_prompts_without_the_rewards_fields_fail_before_loading(
    flags, expected, tiny_dir, tmp_path, capsys, monkeypatch
):
    _no_loading(monkeypatch)
    paths = {"fields": tmp_path / "fields.jsonl", "plain": tmp_path / "plain.jsonl", "mixed": tmp_path / "mixed.jsonl"}
    paths["fields"].write_text('{"prompt": "1+1?", "solution": "2", "level": 1}\n')
    paths["plain"].write_text('{"prompt": "1+1?"}\n')
    paths["mixed"].write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4", "level": 1}\n')
    names = {key: str(path) for key, path in paths.items()}
    out = tmp_path / "o"
    argv = [
        "train",
        "--model",
        str(tiny_dir),
        "--reward",
        "math",
        "--output",
        str(out),
        *[flag.format(**names) for flag in flags],
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pyppo: error: "), err
    assert expected.format(**names) in err[0]
    assert not out.exists()


def test_a_user_reward_that_needs_a_field_is_named(tiny_dir, prompts_file, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    (tmp_path / "graded.py").write_text("def score(prompts, responses, reference, **rest):\n    return [0.0]\n")
    argv = [
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts_file),
        "--output",
        str(tmp_path / "o"),
        "--reward",
        f"{tmp_path / 'graded.py'}:score",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"pyppo: error: reward '{tmp_path / 'graded.py'}:score' needs the prompt field 'reference', "
        f'missing from --prompts {str(prompts_file)!r}, whose fields besides "prompt" are: none'
    ]


@pytest.mark.parametrize("flag", ["--prompts", "--eval-prompts"])
def test_a_prompts_file_that_is_not_utf8_names_its_line(flag, tiny_dir, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "Say hi."}\n{"prompt": "Describe a café."}\n'.encode("latin-1"))
    argv = ["train", "--model", str(tiny_dir), flag, str(latin1), "--output", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"pyppo: error: {latin1}:2: not UTF-8 (byte 0xe9 at byte 27 of the line); save the file as UTF-8"
    assert not any("Traceback" in line for line in err)
    # A byte-order mark (what some editors put first in a UTF-8 file) is not a prompt error.
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode() + '{"prompt": "Describe a café."}\n'.encode())
    from pyppo.prompts import load_prompts

    assert load_prompts(bom) == ["Describe a café."]
