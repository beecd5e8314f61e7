"""``pyppo train --nproc 2`` under faults, with real torchrun (gloo, 2 processes; about a minute on
2 cores): a Ctrl-C during a step longer than torchrun's grace period keeps that step, exits 130
without a traceback, and prints a resume command that works; a reward that fails on rank 1 only is
shown as rank 1's error (not gloo's "Connection closed by peer"), and the last finished step kept."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from support.run_fixture import ckpt_step, prompts_file, read_rows, tiny_dir  # noqa: F401 (fixtures)

# Sleeps $PYPPO_TEST_SLEEP s a call; on rank 0 touches $PYPPO_TEST_MARK.<call> first; raises at its
# 2nd call on rank $PYPPO_TEST_FAIL_RANK.
REWARD = """\
import os, time
from pathlib import Path
calls = [0]
def reward(prompts, responses):
    calls[0] += 1
    rank = os.environ.get("RANK")
    if rank == "0" and os.environ.get("PYPPO_TEST_MARK"):
        Path(os.environ["PYPPO_TEST_MARK"] + f".{calls[0]}").touch()
    if rank == os.environ.get("PYPPO_TEST_FAIL_RANK") and calls[0] == 2:
        raise ValueError("rank 1's reward broke")
    time.sleep(float(os.environ.get("PYPPO_TEST_SLEEP", "0")))
    return [float(r.count("e")) - 0.1 * len(r) for r in responses]
"""
FLAGS = [
    "--nproc",
    "2",
    "--device",
    "cpu",
    "--steps",
    "3",
    "--batch-size",
    "2",
    "--mini-batch-size",
    "2",
    "--ppo-epochs",
    "1",
    "--max-new-tokens",
    "4",
    "--seed",
    "3",
    "--save-every",
    "100",
]


def _env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYPPO_DEBUG")
    }
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _argv(tiny_dir, prompts_file, tmp_path, out) -> list:
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return [
        sys.executable,
        "-m",
        "pyppo",
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts_file),
        "--reward",
        f"{reward}:reward",
        "--output",
        str(out),
        *FLAGS,
    ]


def test_ctrl_c_keeps_a_step_longer_than_torchruns_grace_period_and_the_resume_command_works(
    tiny_dir, prompts_file, tmp_path
):
    out, mark = tmp_path / "run", tmp_path / "mark"
    # torchrun's grace period shortened to 1 s; each step takes over 4 s (the reward sleeps).
    env = _env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1", PYPPO_TEST_SLEEP="4", PYPPO_TEST_MARK=str(mark))
    proc = subprocess.Popen(
        _argv(tiny_dir, prompts_file, tmp_path, out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "mark.2").exists():  # step 2 is scoring: 4 s of it are left
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the command's process group
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    # Step 2 finished, more than the grace period after the signal, and was checkpointed.
    assert ckpt_step(out / "checkpoint") == 2
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == [1, 2]
    command = err.split("its checkpoint is at step 2 of 3; continue with: ")[1].splitlines()[0]
    assert command == f"pyppo train --resume {out} --nproc 2"

    res = subprocess.run(
        [sys.executable, "-m", *shlex.split(command)], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == [1, 2, 3]


def test_a_reward_failing_on_rank_1_only_is_shown_and_the_last_finished_step_kept(tiny_dir, prompts_file, tmp_path):
    out = tmp_path / "run"
    argv = _argv(tiny_dir, prompts_file, tmp_path, out)
    res = subprocess.run(argv, env=_env(PYPPO_TEST_FAIL_RANK="1"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("pyppo: error: ")]
    assert errors == [
        f"pyppo: error: reward '{tmp_path / 'reward.py'}:reward' raised ValueError: rank 1's reward "
        f"broke (step 2, scoring 1 responses) (on process 1 of 2); its checkpoint is at step 1 of 3; "
        f"continue with: pyppo train --resume {out} --nproc 2"
    ], res.stderr[-3000:]
    assert "Connection closed" not in res.stderr and "Traceback" not in res.stderr
    assert ckpt_step(out / "checkpoint") == 1
