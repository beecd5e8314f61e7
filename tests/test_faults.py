"""Faults in a training run: a checkpoint save killed halfway, NaN losses and gradients, broken
rewards, bad configuration. Nothing may crash deep inside the loop or lose the last good state.

The exact-resume property itself (resuming from step k gives the uninterrupted run's step k+1)
is tested in test_trainer.py and test_cli.py; here it is checked after a SIGKILL.
"""

from __future__ import annotations

import json
import math
import os
import shutil
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
from pyppo.run.checkpoint import CHECKPOINT_FILES
from pyppo.run.checkpoint import find as find_checkpoint
from pyppo.config import PPOConfig
from pyppo.run.nonfinite import NonFiniteUpdateError
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
    import pyppo.trainer.logprob_head as forward_mod

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


def test_resume_of_a_directory_without_config_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    assert cli.main(["train", "--resume", str(run)]) == 2
    assert "no config.toml in it (not a pyppo run directory)" in capsys.readouterr().err


# ----------------------------------------------------------------------------- SIGINT / SIGTERM

# A tiny run checkpointed only at its end, so that every stop before it has to write one.
STOP_FLAGS = ["--steps", "3", "--batch-size", "2", "--mini-batch-size", "1", "--ppo-epochs", "1",
              "--max-new-tokens", "4", "--seed", "3", "--save-every", "100"]

# `pyppo train` in a child process that may also signal itself at a chosen moment: "loading" (as
# the model loads), "saveN" (before the N-th file a checkpoint save writes) or "none".
_SIGNALLER = textwrap.dedent(
    """
    import os, sys
    mode, signum, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from pyppo import cli, models
    from pyppo.run import checkpoint

    def fire():
        os.write(2, b"signaller: firing\\n")
        for _ in range(count):
            os.kill(os.getpid(), signum)

    if mode == "loading":
        real_load = models.load_model_and_tokenizer
        def load(*args, **kwargs):
            fire()
            return real_load(*args, **kwargs)
        models.load_model_and_tokenizer = load
    elif mode.startswith("save"):
        nth, calls, real_save = int(mode[4:]), [0], checkpoint.torch.save
        def save(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth:
                fire()
            return real_save(*args, **kwargs)
        checkpoint.torch.save = save
    sys.argv = ["pyppo", *sys.argv[4:]]
    sys.exit(cli.main())  # as the pyppo command calls it
    """
)


@pytest.fixture(scope="module")
def stop_straight_rows(tiny_dir, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("stop-straight") / "run"
    assert cli.main(["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(out),
                     *STOP_FLAGS]) == 0
    return [_untimed(r) for r in _rows(out / "metrics.jsonl")]


def _signal_during(monkeypatch, method: str, plan: dict):
    """Make ``PPOTrainer.<method>`` send this process the signals ``plan[step]`` (a list) when it
    runs during that step (1-based)."""
    from pyppo.trainer import PPOTrainer

    real = getattr(PPOTrainer, method)

    def patched(self, *args, **kwargs):
        for signum in plan.pop(self.step_count + 1, []):
            os.kill(os.getpid(), signum)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PPOTrainer, method, patched)


@pytest.mark.parametrize(
    "method, signals, status, kept",
    [
        ("rollout", [signal.SIGTERM], 143, 2),  # step 2 finishes and is checkpointed
        ("rollout", [signal.SIGINT, signal.SIGINT], 130, 1),  # step 2 abandoned before its update
        ("warm_up_learning_rates", [signal.SIGINT, signal.SIGTERM], 130, 1),  # ... at its first optimizer step
        ("clip_grad_norm", [signal.SIGTERM, signal.SIGINT], 143, 2),  # late enough: ... finished
    ],
    ids=["once", "twice-in-rollout", "twice-before-first-update", "twice-in-update"],
)
def test_signal_in_process_checkpoints_last_finished_step_and_resume_is_exact(
    method, signals, status, kept, tiny_dir, prompts_file, stop_straight_rows, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(out), *STOP_FLAGS]
    plan = {2: list(signals)}
    if method == "clip_grad_norm":  # the second signal after step 2's first optimizer step
        _signal_during(monkeypatch, "rollout", {2: signals[:1]})
        from pyppo.trainer import PPOTrainer

        real, calls = PPOTrainer.clip_grad_norm, []

        def clip(self, model):
            calls.append(self.step_count)
            if calls.count(1) == 3:  # 2nd minibatch of step 2 (two norms per minibatch)
                os.kill(os.getpid(), signals[1])
            return real(self, model)

        monkeypatch.setattr(PPOTrainer, "clip_grad_norm", clip)
    else:
        _signal_during(monkeypatch, method, plan)
    assert cli.main(argv) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    name = signal.Signals(signals[0]).name
    assert (f"pyppo: stopped by {name}; its checkpoint is at step {kept} of 3; "
            f"continue with: pyppo train --resume {out}") in err
    assert _ckpt_step(out / "checkpoint") == kept
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == list(range(1, kept + 1))
    assert (out / "curves.png").is_file()

    monkeypatch.undo()
    assert cli.main(["train", "--resume", str(out)]) == 0
    assert f"resuming {str(out)!r} from step {kept} of 3" in capsys.readouterr().err
    assert [_untimed(r) for r in _rows(out / "metrics.jsonl")] == stop_straight_rows


def test_signal_before_first_step_is_started_over_by_the_same_command(
    tiny_dir, prompts_file, stop_straight_rows, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(out), *STOP_FLAGS]
    _signal_during(monkeypatch, "rollout", {1: [signal.SIGTERM, signal.SIGTERM]})
    assert cli.main(argv) == 143
    err = capsys.readouterr().err
    assert "no step finished, so there is nothing to keep: the same command, or " in err
    assert find_checkpoint(out / "checkpoint") is None and (out / "config.toml").is_file()
    monkeypatch.undo()
    # The same command starts it over in place (so does --resume: see the next test).
    assert cli.main(argv) == 0
    assert "holds a run stopped before its first checkpoint: starting it over in place" in capsys.readouterr().err
    assert [_untimed(r) for r in _rows(out / "metrics.jsonl")] == stop_straight_rows


def test_resume_of_a_run_without_checkpoint_starts_it_over(tiny_dir, prompts_file, stop_straight_rows, tmp_path,
                                                            capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(out), *STOP_FLAGS]
    assert cli.main(argv) == 0
    # What a run killed (SIGKILL, a crash) during step 2 leaves: step 1 logged, no checkpoint.
    shutil.rmtree(out / "checkpoint")
    (out / ".checkpoint.tmp-dead").mkdir()
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(out)]) == 0
    assert "has no checkpoint yet: starting it over in place from step 0" in capsys.readouterr().err
    assert [_untimed(r) for r in _rows(out / "metrics.jsonl")] == stop_straight_rows
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint"]

    # Nothing left to run: said, and nothing is rewritten.
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert cli.main(["train", "--resume", str(out), "--steps", "2"]) == 0
    captured = capsys.readouterr()
    assert "is at step 3 (its checkpoint), steps = 2: nothing left to run" in captured.err
    assert "run written to" not in captured.out
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def _run_child(script: Path, mode: str, signum: int, count: int, argv: list, rng, external: int, window: float,
               cwd: Path) -> tuple:
    """Run the signalling child; send it ``external`` signals at random moments within ``window``
    seconds after it starts talking (its handlers are installed by then). Returns (status, stderr,
    signals sent)."""
    import threading
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYPPO_DEBUG", None)
    proc = subprocess.Popen([sys.executable, str(script), mode, str(int(signum)), str(count), *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, talking = [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("pyppo:"):
                talking.set()
        talking.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = 0
    if external:
        talking.wait(timeout=120)
        time.sleep(rng.uniform(0, window))
        for _ in range(external):
            if proc.poll() is not None:
                break
            proc.send_signal(rng.choice([signal.SIGINT, signal.SIGTERM]))
            sent += 1
            time.sleep(rng.uniform(0.0, 0.4))
    proc.stdout.read()
    status = proc.wait(timeout=300)
    reader.join(timeout=10)
    return status, "".join(lines), sent


def test_random_signals_never_lose_work(tiny_dir, prompts_file, stop_straight_rows, tmp_path):
    """Real SIGINT / SIGTERM at random moments (loading, steps, saves; one, two or three in a
    row), then the same command or --resume until the run is done: no traceback, every stop keeps
    a checkpoint of its last finished step, and the metrics are the uninterrupted run's."""
    import random
    import time

    seed = int(os.environ.get("PYPPO_SIGNAL_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    script = tmp_path / "signaller.py"
    script.write_text(_SIGNALLER)
    window = 2.0  # seconds from the child's first line: loading and the steps of the tiny run
    total, runs, rounds = 0, 0, 0
    while total < 21:
        out = tmp_path / f"run{runs}"
        runs += 1
        while True:
            rounds += 1
            assert rounds < 60, f"seed {seed}: the run never finished"
            resume = find_checkpoint(out / "checkpoint") is not None
            argv = (["train", "--resume", str(out)] if resume else
                    ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(out),
                     *STOP_FLAGS])
            # Few rounds (each child imports torch: seconds), many signals each.
            mode = rng.choice(["none", "none", "none", "loading", "save1", "save3"])
            count = rng.choice([1, 2, 3]) if mode != "none" else 0
            external = rng.choice([2, 3, 3]) if mode == "none" else rng.choice([0, 1, 2])
            status, err, sent = _run_child(script, mode, rng.choice([signal.SIGINT, signal.SIGTERM]), count,
                                           argv, rng, external, window, tmp_path)
            where = f"seed {seed}, round {rounds}, mode {mode} x{count}, {sent} external: {err[-2000:]}"
            assert "Traceback" not in err, where
            assert status in (0, 130, 143), where
            fired = "signaller: firing" in err
            total += sent + (0 if not fired else 1 if mode == "loading" else count)
            rows = _rows(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
            if "its checkpoint is at step" in err:  # a graceful stop: its last finished step is checkpointed
                done = int(err.split("its checkpoint is at step ")[1].split()[0])
                assert _ckpt_step(find_checkpoint(out / "checkpoint")) == done == len(rows), where
            if status == 0 and len(rows) == 3 and find_checkpoint(out / "checkpoint") is not None \
                    and _ckpt_step(find_checkpoint(out / "checkpoint")) == 3:
                break
        assert [_untimed(r) for r in rows] == stop_straight_rows, f"seed {seed}"
    assert total >= 21
    print(f"seed {seed}: {total} signals in {rounds} rounds over {runs} runs")


# ----------------------------------------------------------------------------- odd inputs


def test_diverged_model_is_reported_before_whitening_keeping_the_checkpoint(tmp_path, monkeypatch):
    import pyppo.distributed as distributed_mod

    def no_whitening(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("non-finite values reached the whitening")

    tr = make_trainer(small_config(steps=1, save_every=1))
    tr.train(tmp_path, progress=False)
    monkeypatch.setattr(distributed_mod, "whiten", no_whitening)
    with torch.no_grad():  # what --lr 1e30 does to the weights
        for p in tr.policy.parameters():
            p.fill_(math.nan)
    tr.config.steps = 2
    with pytest.raises(NonFiniteUpdateError) as info:
        tr.train(tmp_path, progress=False)
    msg = str(info.value)
    assert msg.startswith("step 2: the rollout has non-finite old_logprobs (")
    assert "response tokens)" in msg and "the model probably diverged" in msg
    assert f"last good checkpoint is {str(tmp_path / 'checkpoint')!r} (step 1)" in msg
    assert _ckpt_step(tmp_path / "checkpoint") == 1 and [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [1]


def test_non_finite_values_are_named(monkeypatch):
    import pyppo.trainer.ppo as trainer_mod

    real = trainer_mod.response_values

    def nan_values(*args, **kwargs):
        v = real(*args, **kwargs)
        return v * math.nan

    monkeypatch.setattr(trainer_mod, "response_values", nan_values)
    tr = make_trainer(small_config(steps=1))
    with pytest.raises(NonFiniteUpdateError, match=r"step 1: the rollout has non-finite values \((\d+) of \1 "):
        tr.step()


def test_prompt_longer_than_the_context_is_cut_with_one_warning():
    from transformers import LlamaForCausalLM

    from tiny_models import tiny_llama_config

    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=80))
    prompts = PROMPTS[:3] + ["x" * 200] + PROMPTS[3:]
    with pytest.warns(UserWarning) as record:
        tr = make_trainer(small_config(steps=1, max_new_tokens=8), policy=policy, prompts=prompts)
    messages = [str(w.message) for w in record if "longer than" in str(w.message)]
    assert len(messages) == 1
    assert messages[0].startswith("prompts: prompt 3 (")
    assert "longer than the 72 tokens the model's context leaves (80 positions minus max_new_tokens = 8)" in messages[0]
    batch = tr.rollout(["x" * 200, "Hi"])
    assert batch.query_ids.shape[1] == 72
    with pytest.raises(ValueError, match=r"prompts: prompt 3 \(\d+ tokens\) longer than the 72 tokens"):
        make_trainer(small_config(steps=1, max_new_tokens=8, truncate_prompts=False), policy=policy, prompts=prompts)
