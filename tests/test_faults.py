"""Faults in a training run: a checkpoint save killed halfway, NaN losses and gradients, broken
rewards, bad configuration. Nothing may crash deep inside the loop or lose the last good state.

The exact-resume property itself (resuming from step k gives the uninterrupted run's step k+1)
is tested in test_trainer.py and test_cli.py; here it is checked after a SIGKILL.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pyppo import cli
from pyppo.rewards import RewardError, load_reward
from pyppo.checkpoint import CHECKPOINT_FILES
from pyppo.checkpoint import find as find_checkpoint
from pyppo.config import PPOConfig
from pyppo.skips import NonFiniteUpdateError
from test_trainer import PROMPTS, count_e, make_trainer, small_config
from tiny_models import save_tiny_causal_lm

TESTS = Path(__file__).resolve().parent

# A tiny CLI run: 3 steps, a checkpoint after every step.
RUN_TOML = """\
steps = 3
batch_size = 2
mini_batch_size = 1
ppo_epochs = 1
max_new_tokens = 4
seed = 3
save_every = 1
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say hi.", "Describe rain.", "Why?"]))
    return path


@pytest.fixture(scope="module")
def run_toml(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "run.toml"
    path.write_text(RUN_TOML)
    return path


def _rows(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(row):
    return {k: v for k, v in row.items() if "time" not in k and "seconds" not in k}


def _ckpt_step(d: Path) -> int:
    return int(torch.load(d / "trainer_state.pt", weights_only=True)["step"])


# ----------------------------------------------------------------------------- SIGKILL mid-save

# Runs `pyppo train` in a child process that SIGKILLs itself during the step-2 checkpoint save:
# "before_swap": the new checkpoint is complete in its temporary directory, nothing renamed yet;
# "between_renames": the previous checkpoint has been renamed to checkpoint.old, the new one not
# yet renamed into place (the only instant with no directory at checkpoint/).
_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    mode = sys.argv[1]
    real_rename = os.rename

    def rename(src, dst):
        src, dst = os.fspath(src), os.fspath(dst)
        if mode == "before_swap" and os.path.basename(src) == "checkpoint":
            os.kill(os.getpid(), signal.SIGKILL)
        if (mode == "between_renames" and os.path.basename(dst) == "checkpoint"
                and os.path.isdir(dst + ".old")):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst)

    os.rename = rename
    from pyppo import cli
    sys.exit(cli.main(sys.argv[2:]))
    """
)


@pytest.fixture(scope="module")
def straight_rows(tiny_dir, prompts_file, run_toml, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--config", str(run_toml),
            "--output", str(out)]
    assert cli.main(argv) == 0
    return _rows(out / "metrics.jsonl")


@pytest.mark.parametrize("mode", ["before_swap", "between_renames"])
def test_sigkill_during_checkpoint_save_keeps_previous_and_resume_continues(
    mode, tiny_dir, prompts_file, run_toml, straight_rows, tmp_path, capsys
):
    out = tmp_path / "run"
    script = tmp_path / "killer.py"
    script.write_text(_KILLER.format(tests=str(TESTS)))
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--config", str(run_toml),
            "--output", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = subprocess.run([sys.executable, str(script), mode, *argv], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]

    # Killed during the step-2 save: step 2 was logged, the step-1 checkpoint is intact.
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == [1, 2]
    assert [p.name for p in out.iterdir() if p.name.startswith(".checkpoint.tmp-")]  # the killed save's temp
    ckpt = find_checkpoint(out / "checkpoint")
    assert ckpt is not None and _ckpt_step(ckpt) == 1
    if mode == "before_swap":
        assert ckpt == out / "checkpoint" and not (out / "checkpoint.old").exists()
    else:
        assert not (out / "checkpoint").exists() and ckpt == out / "checkpoint.old"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(CHECKPOINT_FILES)

    # --resume continues from step 1; step 2's stale log rows are replaced, not duplicated.
    with pytest.warns(RuntimeWarning) as record:
        assert cli.main(["train", "--resume", str(out)]) == 0
    capsys.readouterr()
    messages = " ".join(str(w.message) for w in record)
    assert "dropped" in messages
    if mode == "between_renames":
        assert "resuming from the previous checkpoint" in messages
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # ... and takes exactly the steps the uninterrupted run took.
    assert [_untimed(r) for r in rows] == [_untimed(r) for r in straight_rows]
    assert len(_rows(out / "samples.jsonl")) == 3 * 2
    # The next save cleaned up: one complete checkpoint, no temporaries or backups.
    leftovers = sorted(p.name for p in out.iterdir() if "checkpoint" in p.name)
    assert leftovers == ["checkpoint"] and _ckpt_step(out / "checkpoint") == 3


# ----------------------------------------------------------------------------- checkpoints in-process


def test_checkpoint_holds_every_state_and_restores_rngs(tmp_path):
    tr = make_trainer(small_config(steps=1, ppo_epochs=1))
    tr.step()
    tr.save_checkpoint(tmp_path / "ck")
    st = torch.load(tmp_path / "ck" / "trainer_state.pt", weights_only=True)
    for key in ("step", "kl_ctl", "sampler", "shuffle_generator", "rng_torch", "rng_numpy", "rng_python",
                "consecutive_skips", "skipped_updates_total", "config"):
        assert key in st, key
    opt = torch.load(tmp_path / "ck" / "optimizers.pt", weights_only=True)
    assert set(opt) == {"policy", "value"} and opt["policy"]["state"]  # AdamW moments after a step
    expected = (torch.rand(4), np.random.rand(3), [__import__("random").random() for _ in range(3)],
                torch.randperm(16, generator=tr.shuffle_generator), tr.sampler.sample(5))

    torch.manual_seed(999), np.random.seed(999), __import__("random").seed(999)
    other = make_trainer(small_config(steps=1, ppo_epochs=1))
    assert other.load_checkpoint(tmp_path / "ck") == tmp_path / "ck"
    got = (torch.rand(4), np.random.rand(3), [__import__("random").random() for _ in range(3)],
           torch.randperm(16, generator=other.shuffle_generator), other.sampler.sample(5))
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and torch.equal(got[3], expected[3]) and got[4] == expected[4]
    assert other.step_count == 1
    for a, b in zip(tr.value_model.parameters(), other.value_model.parameters()):
        assert torch.equal(a, b)


def test_load_recovers_the_backup_and_next_save_cleans_up(tmp_path):
    tr = make_trainer(small_config(steps=1))
    ck = tmp_path / "ck"
    tr.save_checkpoint(ck)
    # The state a save killed between its two renames leaves: backup + a complete or partial temp.
    os.rename(ck, tmp_path / "ck.old")
    (tmp_path / ".ck.tmp-dead").mkdir()
    (tmp_path / ".ck.tmp-dead" / "policy.pt").write_bytes(b"partial")
    assert find_checkpoint(ck) == tmp_path / "ck.old"
    other = make_trainer(small_config(steps=1))
    with pytest.warns(RuntimeWarning, match="resuming from the previous checkpoint"):
        assert other.load_checkpoint(ck) == tmp_path / "ck.old"
    other.save_checkpoint(ck)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]

    # Older versions named the backup <name>.old-<pid>-<ns>.
    os.rename(ck, tmp_path / "ck.old-123-456")
    assert find_checkpoint(ck) == tmp_path / "ck.old-123-456"
    other.save_checkpoint(ck)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]

    # An incomplete directory at <name> never hides a complete backup, and is not promoted to it.
    other.save_checkpoint(ck)
    os.rename(ck, tmp_path / "ck.old")
    ck.mkdir()
    assert find_checkpoint(ck) == tmp_path / "ck.old"
    other.save_checkpoint(ck)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"] and find_checkpoint(ck) == ck


def test_corrupt_checkpoint_file_is_named_and_nothing_is_restored(tmp_path):
    tr = make_trainer(small_config(steps=1))
    tr.save_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "trainer_state.pt").write_bytes(b"\x00 not a torch file")
    other = make_trainer(small_config(steps=1))
    before = [p.detach().clone() for p in other.policy.parameters()]
    with pytest.raises(ValueError, match="trainer_state.pt.*cannot be read"):
        other.load_checkpoint(tmp_path / "ck")
    assert other.step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, other.policy.parameters()))
    with pytest.raises(FileNotFoundError, match="checkpoint file missing"):
        other.load_checkpoint(tmp_path / "nothing")


# ----------------------------------------------------------------------------- non-finite updates


def _adam_steps(opt) -> set:
    return {int(s["step"]) for s in opt.state.values()}


def test_nan_loss_skips_that_update_only(monkeypatch):
    import pyppo.forward as forward_mod

    real = forward_mod.ppo_policy_loss
    calls = {"n": 0}

    def nan_on_second_minibatch(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * math.nan if calls["n"] == 2 else loss), stats

    monkeypatch.setattr(forward_mod, "ppo_policy_loss", nan_on_second_minibatch)
    # 8 sequences, minibatches of 4, no accumulation, 2 epochs: 4 updates, the 2nd one poisoned
    # (the loss from the log-probs, where ppo_policy_loss is called).
    tr = make_trainer(small_config(steps=1, micro_batch_size=None, fused_policy_loss=False))
    with pytest.warns(RuntimeWarning, match=r"epoch 1, minibatch 2: non-finite policy_loss=nan.*update skipped"):
        m = tr.step().metrics
    assert m["skipped_updates"] == 1 and tr.skips.total == 1 and tr.skips.consecutive == 0
    assert _adam_steps(tr.policy_optimizer) == {3} and _adam_steps(tr.value_optimizer) == {3}
    assert all(math.isfinite(v) for v in m.values()), m  # averages over the applied updates
    assert all(torch.isfinite(p).all() for p in tr.policy.parameters())


def test_nan_gradient_stops_after_max_consecutive_skips_keeping_last_checkpoint(tmp_path):
    tr = make_trainer(small_config(steps=1, save_every=1))
    tr.train(tmp_path, progress=False)
    assert _ckpt_step(tmp_path / "checkpoint") == 1
    weights = [p.detach().clone() for p in tr.policy.parameters()]
    adam = _adam_steps(tr.policy_optimizer)

    # From now on one parameter's gradient is NaN: every update is skipped.
    param = next(p for p in tr.policy.parameters() if p.requires_grad)
    param.register_hook(lambda g: torch.full_like(g, math.nan))
    tr.config.steps = 3
    with pytest.warns(RuntimeWarning, match="policy_grad_norm=nan"):
        with pytest.raises(NonFiniteUpdateError) as info:
            tr.train(tmp_path, progress=False)
    msg = str(info.value)
    assert "training stopped at step 2, epoch 2, minibatch 1: 3 updates in a row" in msg
    assert "max_consecutive_skips=3" in msg
    assert f"last good checkpoint is {str(tmp_path / 'checkpoint')!r} (step 1)" in msg
    assert _ckpt_step(tmp_path / "checkpoint") == 1 and find_checkpoint(tmp_path / "checkpoint") is not None
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [1]  # the failed step is not logged
    assert all(torch.equal(a, b) for a, b in zip(weights, tr.policy.parameters()))
    assert _adam_steps(tr.policy_optimizer) == adam


def test_all_skipped_step_reports_nan_losses_and_counts_across_steps():
    tr = make_trainer(small_config(steps=2, max_consecutive_skips=6, target_kl=1.0))
    param = next(p for p in tr.value_model.parameters() if p.requires_grad)
    param.register_hook(lambda g: torch.full_like(g, math.inf))
    with pytest.warns(RuntimeWarning, match="value_grad_norm=inf"):
        m = tr.step().metrics
    assert m["skipped_updates"] == 4 and tr.skips.consecutive == 4
    assert math.isnan(m["policy_loss"]) and math.isnan(m["clipfrac"]) and math.isfinite(m["score_mean"])
    with pytest.warns(RuntimeWarning), pytest.raises(NonFiniteUpdateError, match="6 updates in a row"):
        tr.step()


def test_max_consecutive_skips_is_validated():
    assert PPOConfig().max_consecutive_skips == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_consecutive_skips"):
            PPOConfig(max_consecutive_skips=bad)


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
    import pyppo.trainer as trainer_mod

    def no_gae(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("a bad reward reached GAE")

    monkeypatch.setattr(trainer_mod, "gae", no_gae)
    tr = make_trainer(small_config(steps=1), reward=load_reward(fn) if wrap else fn)
    with pytest.raises(RewardError, match=pattern) as info:
        tr.step()
    assert info.value.reward == fn.__name__ and info.value.index == index
    assert "raised RewardError" not in str(info.value)  # a load_reward wrapper's error is not wrapped twice


def test_cli_reward_returning_nan_is_one_line(tiny_dir, prompts_file, tmp_path, capsys):
    (tmp_path / "myreward.py").write_text("def score(prompts, responses):\n    return [float('nan')] * len(responses)\n")
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(tmp_path / "o"),
            "--reward", f"{tmp_path / 'myreward.py'}:score", "--steps", "1", "--batch-size", "2",
            "--mini-batch-size", "1", "--max-new-tokens", "3"]
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
        ("kl_estimator = \"k9\"\n", [], "kl_estimator must be one of"),
        ("max_consecutive_skips = 0\n", [], "max_consecutive_skips must be an int >= 1"),
        ('reward = 3\n', [], "'reward' must be a string"),
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


def test_resume_without_complete_checkpoint_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "config.toml").write_text("steps = 2\n")
    assert cli.main(["train", "--resume", str(run)]) == 2
    assert "no complete checkpoint/" in capsys.readouterr().err
