"""SIGINT and SIGTERM never lose work: in process and as real signals at random moments, every
stop keeps a checkpoint of its last finished step and --resume gives the uninterrupted run's
metrics; a run stopped before its first checkpoint is started over by the same command."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pyppo import cli
from pyppo.run.checkpoint import find as find_checkpoint
from support.run_fixture import ckpt_step, prompts_file, read_rows, tiny_dir, untimed  # noqa: F401 (fixtures)

# ----------------------------------------------------------------------------- SIGINT / SIGTERM

# A tiny run checkpointed only at its end, so that every stop before it has to write one.
STOP_FLAGS = [
    "--steps",
    "3",
    "--batch-size",
    "2",
    "--mini-batch-size",
    "1",
    "--ppo-epochs",
    "1",
    "--max-new-tokens",
    "4",
    "--seed",
    "3",
    "--save-every",
    "100",
]

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
    assert (
        cli.main(["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(out), *STOP_FLAGS])
        == 0
    )
    return [untimed(r) for r in read_rows(out / "metrics.jsonl")]


def _signal_during(monkeypatch, method: str, plan: dict):
    """Make ``PPOTrainer.<method>`` send this process the signals ``plan[step]`` (a list) when it
    runs during that step (1-based). ``method = "generate"``: the rollout engine's sampling, whose
    k-th call is step k's (these runs evaluate nothing and sample once a step)."""
    if method == "generate":
        from pyppo.rollout.hf_generate import HFGenerateEngine

        real_generate, calls = HFGenerateEngine.generate, []

        def sampling(self, prompts):
            calls.append(1)
            for signum in plan.pop(len(calls), []):
                os.kill(os.getpid(), signum)
            return real_generate(self, prompts)

        monkeypatch.setattr(HFGenerateEngine, "generate", sampling)
        return
    from pyppo import PPOTrainer

    real = getattr(PPOTrainer, method)

    def patched(self, *args, **kwargs):
        for signum in plan.pop(self.step_count + 1, []):
            os.kill(os.getpid(), signum)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PPOTrainer, method, patched)


@pytest.mark.parametrize(
    "method, signals, status, kept",
    [
        ("generate", [signal.SIGTERM], 143, 2),  # step 2 finishes and is checkpointed
        ("generate", [signal.SIGINT, signal.SIGINT], 130, 1),  # step 2 abandoned before its update
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
        _signal_during(monkeypatch, "generate", {2: signals[:1]})
        from pyppo import PPOTrainer

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
    assert (
        f"pyppo: stopped by {name}; its checkpoint is at step {kept} of 3; continue with: pyppo train --resume {out}"
    ) in err
    assert ckpt_step(out / "checkpoint") == kept
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == list(range(1, kept + 1))
    assert (out / "curves.png").is_file()

    monkeypatch.undo()
    assert cli.main(["train", "--resume", str(out)]) == 0
    assert f"resuming {str(out)!r} from step {kept} of 3" in capsys.readouterr().err
    assert [untimed(r) for r in read_rows(out / "metrics.jsonl")] == stop_straight_rows


def test_signal_before_first_step_is_started_over_by_the_same_command(
    tiny_dir, prompts_file, stop_straight_rows, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(out), *STOP_FLAGS]
    _signal_during(monkeypatch, "generate", {1: [signal.SIGTERM, signal.SIGTERM]})
    assert cli.main(argv) == 143
    err = capsys.readouterr().err
    assert "no step finished, so there is nothing to keep: the same command, or " in err
    assert find_checkpoint(out / "checkpoint") is None and (out / "config.toml").is_file()
    monkeypatch.undo()
    # The same command starts it over in place (so does --resume: see the next test).
    assert cli.main(argv) == 0
    assert "holds a run stopped before its first checkpoint: starting it over in place" in capsys.readouterr().err
    assert [untimed(r) for r in read_rows(out / "metrics.jsonl")] == stop_straight_rows


def test_resume_of_a_run_without_checkpoint_starts_it_over(
    tiny_dir, prompts_file, stop_straight_rows, tmp_path, capsys
):
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--output", str(out), *STOP_FLAGS]
    assert cli.main(argv) == 0
    # What a run killed (SIGKILL, a crash) during step 2 leaves: step 1 logged, no checkpoint.
    shutil.rmtree(out / "checkpoint")
    (out / ".checkpoint.tmp-dead").mkdir()
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(out)]) == 0
    assert "has no checkpoint yet: starting it over in place from step 0" in capsys.readouterr().err
    assert [untimed(r) for r in read_rows(out / "metrics.jsonl")] == stop_straight_rows
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint"]

    # Nothing left to run: said, and nothing is rewritten.
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert cli.main(["train", "--resume", str(out), "--steps", "2"]) == 0
    captured = capsys.readouterr()
    assert "is at step 3 (its checkpoint), steps = 2: nothing left to run" in captured.err
    assert "run written to" not in captured.out
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def _run_child(
    script: Path, mode: str, signum: int, count: int, argv: list, rng, external: int, window: float, cwd: Path
) -> tuple:
    """Run the signalling child; send it ``external`` signals at random moments within ``window``
    seconds after it starts talking (its handlers are installed by then). Returns (status, stderr,
    signals sent)."""
    import threading
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYPPO_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(int(signum)), str(count), *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
        try:  # sleep, but not past the child's exit
            proc.wait(timeout=rng.uniform(0, window))
        except subprocess.TimeoutExpired:
            pass
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
    # Seconds from the child's first line in which the external signals land: loading and the
    # steps of the tiny run on a quiet machine. On a loaded one loading alone can outlast it, and
    # then every round would be stopped before its first checkpoint; so each round that makes no
    # progress doubles the window (the run then gets further before the signals come), and a
    # round that makes progress sets it back.
    base_window = window = 2.0
    total, runs, rounds = 0, 0, 0
    while total < 21:
        out = tmp_path / f"run{runs}"
        runs += 1
        while True:
            rounds += 1
            assert rounds < 60, f"seed {seed}: the run never finished"
            before = ckpt_step(find_checkpoint(out / "checkpoint")) if find_checkpoint(out / "checkpoint") else 0
            resume = find_checkpoint(out / "checkpoint") is not None
            argv = (
                ["train", "--resume", str(out)]
                if resume
                else [
                    "train",
                    "--model",
                    str(tiny_dir),
                    "--prompts",
                    str(prompts_file),
                    "--output",
                    str(out),
                    *STOP_FLAGS,
                ]
            )
            # Few rounds (each child imports torch: seconds), many signals each.
            mode = rng.choice(["none", "none", "none", "loading", "save1", "save3"])
            count = rng.choice([1, 2, 3]) if mode != "none" else 0
            external = rng.choice([2, 3, 3]) if mode == "none" else rng.choice([0, 1, 2])
            status, err, sent = _run_child(
                script, mode, rng.choice([signal.SIGINT, signal.SIGTERM]), count, argv, rng, external, window, tmp_path
            )
            where = f"seed {seed}, round {rounds}, mode {mode} x{count}, {sent} external: {err[-2000:]}"
            assert "Traceback" not in err, where
            # -2 / -15: the signal's default action, which Python has before pyppo installs its
            # handlers (imports) and again once the interpreter shuts down (it restores them):
            # outside the run, where nothing can be lost (what follows checks that nothing was).
            assert status in (0, 130, 143, -signal.SIGINT, -signal.SIGTERM), where
            fired = "signaller: firing" in err
            total += sent + (0 if not fired else 1 if mode == "loading" else count)
            rows = read_rows(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
            if "its checkpoint is at step" in err:  # a graceful stop: its last finished step is checkpointed
                done = int(err.split("its checkpoint is at step ")[1].split()[0])
                assert ckpt_step(find_checkpoint(out / "checkpoint")) == done == len(rows), where
            if (
                status == 0
                and len(rows) == 3
                and find_checkpoint(out / "checkpoint") is not None
                and ckpt_step(find_checkpoint(out / "checkpoint")) == 3
            ):
                break
            after = ckpt_step(find_checkpoint(out / "checkpoint")) if find_checkpoint(out / "checkpoint") else 0
            window = base_window if after > before else min(2 * window, 120.0)
        assert [untimed(r) for r in rows] == stop_straight_rows, f"seed {seed}"
    assert total >= 21
    print(f"seed {seed}: {total} signals in {rounds} rounds over {runs} runs")


def test_a_signal_while_loading_deletes_the_registered_scratch_directory(tmp_path):
    """The immediate exit while the models load (os._exit: no finally runs) still deletes what
    was registered with removed_at_exit (the vLLM engine's copy of the weights), and nothing else."""
    scratch, kept = tmp_path / "scratch", tmp_path / "kept"
    code = f"""
import os, pathlib, signal, time
from pyppo.run.stopping import GracefulStop
from pyppo.scratch import removed_at_exit
for d in ({str(scratch)!r}, {str(kept)!r}):
    pathlib.Path(d, "weights").mkdir(parents=True)
with GracefulStop(say=False).installed(), removed_at_exit({str(scratch)!r}):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert not scratch.exists() and kept.exists()
