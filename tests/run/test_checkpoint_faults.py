"""Checkpoints under faults: a save SIGKILLed halfway keeps the previous checkpoint and --resume
continues exactly; a checkpoint holds every state; a backup left by a killed swap is recovered; a
corrupt file is named and nothing is restored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pyppo import cli
from pyppo.run.checkpoint import CHECKPOINT_FILES
from pyppo.run.checkpoint import find as find_checkpoint
from support.run_fixture import TESTS, ckpt_step, prompts_file, read_rows, run_toml, tiny_dir, untimed  # noqa: F401 (fixtures)
from support.trainer_fixture import make_trainer, small_config

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
    argv = [
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts_file),
        "--config",
        str(run_toml),
        "--output",
        str(out),
    ]
    assert cli.main(argv) == 0
    return read_rows(out / "metrics.jsonl")


@pytest.mark.parametrize("mode", ["before_swap", "between_renames"])
def test_sigkill_during_checkpoint_save_keeps_previous_and_resume_continues(
    mode, tiny_dir, prompts_file, run_toml, straight_rows, tmp_path, capsys
):
    out = tmp_path / "run"
    script = tmp_path / "killer.py"
    script.write_text(_KILLER.format(tests=str(TESTS)))
    argv = [
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts_file),
        "--config",
        str(run_toml),
        "--output",
        str(out),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = subprocess.run(
        [sys.executable, str(script), mode, *argv], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]

    # Killed during the step-2 save: step 2 was logged, the step-1 checkpoint is intact.
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == [1, 2]
    assert [p.name for p in out.iterdir() if p.name.startswith(".checkpoint.tmp-")]  # the killed save's temp
    ckpt = find_checkpoint(out / "checkpoint")
    assert ckpt is not None and ckpt_step(ckpt) == 1
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
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # ... and takes exactly the steps the uninterrupted run took.
    assert [untimed(r) for r in rows] == [untimed(r) for r in straight_rows]
    assert len(read_rows(out / "samples.jsonl")) == 3 * 2
    # The next save cleaned up: one complete checkpoint, no temporaries or backups.
    leftovers = sorted(p.name for p in out.iterdir() if "checkpoint" in p.name)
    assert leftovers == ["checkpoint"] and ckpt_step(out / "checkpoint") == 3


# ----------------------------------------------------------------------------- checkpoints in-process


def test_checkpoint_holds_every_state_and_restores_rngs(tmp_path):
    tr = make_trainer(small_config(steps=1, ppo_epochs=1))
    tr.step()
    tr.save_checkpoint(tmp_path / "ck")
    st = torch.load(tmp_path / "ck" / "trainer_state.pt", weights_only=True)
    for key in (
        "step",
        "kl_ctl",
        "sampler",
        "shuffle_generator",
        "rng_torch",
        "rng_numpy",
        "rng_python",
        "consecutive_skips",
        "skipped_updates_total",
        "config",
    ):
        assert key in st, key
    opt = torch.load(tmp_path / "ck" / "optimizers.pt", weights_only=True)
    assert set(opt) == {"policy", "value"} and opt["policy"]["state"]  # AdamW moments after a step
    expected = (
        torch.rand(4),
        np.random.rand(3),
        [__import__("random").random() for _ in range(3)],
        torch.randperm(16, generator=tr.shuffle_generator),
        tr.sampler.sample(5),
    )

    torch.manual_seed(999), np.random.seed(999), __import__("random").seed(999)
    other = make_trainer(small_config(steps=1, ppo_epochs=1))
    assert other.load_checkpoint(tmp_path / "ck") == tmp_path / "ck"
    got = (
        torch.rand(4),
        np.random.rand(3),
        [__import__("random").random() for _ in range(3)],
        torch.randperm(16, generator=other.shuffle_generator),
        other.sampler.sample(5),
    )
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and torch.equal(got[3], expected[3]) and got[4] == expected[4]
    assert other.step_count == 1
    for a, b in zip(tr.critic.model.parameters(), other.critic.model.parameters()):
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


# ----------------------------------------------------------------------------- a full disk


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 442535168 vs 442535056"),
        OSError(28, "No space left on device"),
    ],
)
def test_a_full_disk_while_saving_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failure):
    # torch.save reports a full disk as a RuntimeError about its zip writer; the user is told
    # what happened, and the previous checkpoint is left as it was.
    import shutil

    from pyppo.run import checkpoint

    target = tmp_path / "checkpoint"
    checkpoint.save(target, {name: {"step": 1} for name in CHECKPOINT_FILES})
    real_save, calls = torch.save, []

    def filling_save(obj, f):
        calls.append(f.name)
        if len(calls) == 2:  # the disk fills during the second file
            f.write(b"partial")
            raise failure
        real_save(obj, f)

    Usage = type(shutil.disk_usage(tmp_path))
    monkeypatch.setattr(torch, "save", filling_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(OSError, match="no space left on the disk of .* while saving the checkpoint") as info:
        checkpoint.save(target, {name: {"step": 2} for name in CHECKPOINT_FILES})
    assert info.value.errno == 28
    assert "the previous checkpoint" in str(info.value) and "--resume" in str(info.value)
    monkeypatch.undo()
    assert find_checkpoint(target) == target
    assert all(torch.load(target / name)["step"] == 1 for name in CHECKPOINT_FILES)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]  # no partial directory left


def test_a_full_disk_at_the_first_save_says_there_is_nothing_to_resume(tmp_path, monkeypatch):
    import shutil

    from pyppo.run import checkpoint

    def full(obj, f):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="no earlier checkpoint to resume from"):
        checkpoint.save(tmp_path / "checkpoint", {name: {} for name in CHECKPOINT_FILES})
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [] and shutil.disk_usage(tmp_path).free > 0


@pytest.mark.parametrize("free", [1 << 20, 100 << 30])
def test_another_save_error_is_raised_as_it_is_even_on_a_nearly_full_disk(tmp_path, monkeypatch, free):
    import shutil

    from pyppo.run import checkpoint

    def failing_save(obj, f):
        raise RuntimeError("a bug in my object's pickling")

    Usage = type(shutil.disk_usage(tmp_path))
    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(200 << 30, 200 << 30, free))
    with pytest.raises(RuntimeError, match="a bug in my object's pickling"):
        checkpoint.save(tmp_path / "checkpoint", {name: {} for name in CHECKPOINT_FILES})
