"""An error in a step keeps the last finished step, as a signal does: a reward that fails at step 3
of 5 (the default save_every, so no periodic checkpoint yet) leaves the checkpoint of step 2 and one
line saying how to continue; the same command neither starts the run over nor clears its logs, and
--resume ends where the uninterrupted run ends. An error in the held-out evaluation keeps the step
it follows."""

from __future__ import annotations

import pytest

from pyppo import PPOTrainer, cli
from pyppo.rewards import RewardError
from support.run_fixture import ckpt_step, prompts_file, read_rows, tiny_dir, untimed  # noqa: F401 (fixtures)
from support.tiny_models import tiny_causal_lm, tiny_tokenizer
from support.trainer_fixture import PROMPTS, small_config

# save_every is left at pyppo train's default (10): nothing is checkpointed before step 5.
FLAGS = [
    "--steps",
    "5",
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
]

# Fails at its N-th call (one call a step), N = $PYPPO_TEST_FAIL_AT; each run loads the file afresh.
FLAKY = """\
import os
calls = [0]
def flaky(prompts, responses):
    calls[0] += 1
    if calls[0] == int(os.environ.get("PYPPO_TEST_FAIL_AT", "0")):
        raise ConnectionError("the scoring service is down")
    return [float(r.count("e")) - 0.1 * len(r) for r in responses]
"""


def test_a_reward_failing_at_step_3_of_5_keeps_step_2_and_resume_continues_exactly(
    tiny_dir, prompts_file, tmp_path, capsys, monkeypatch
):
    reward = tmp_path / "flaky.py"
    reward.write_text(FLAKY)

    def argv(out):
        return [
            "train",
            "--model",
            str(tiny_dir),
            "--prompts",
            str(prompts_file),
            "--reward",
            f"{reward}:flaky",
            "--output",
            str(out),
            *FLAGS,
        ]

    straight = tmp_path / "straight"
    assert cli.main(argv(straight)) == 0
    capsys.readouterr()

    out = tmp_path / "run"
    monkeypatch.setenv("PYPPO_TEST_FAIL_AT", "3")
    assert cli.main(argv(out)) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pyppo: error: ")]
    assert len(errors) == 1, errors
    assert "raised ConnectionError: the scoring service is down (step 3, scoring 2 responses)" in errors[0]
    assert errors[0].endswith(f"; its checkpoint is at step 2 of 5; continue with: pyppo train --resume {out}")
    assert ckpt_step(out / "checkpoint") == 2
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == [1, 2]

    # The same command again (the reward mended) refuses to start over: the logs stay.
    monkeypatch.delenv("PYPPO_TEST_FAIL_AT")
    logs = (out / "metrics.jsonl").read_bytes()
    assert cli.main(argv(out)) == 2
    assert "already holds a run with a checkpoint; continue it with --resume" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_bytes() == logs

    # The printed command continues it: the uninterrupted run's metrics, step for step.
    assert cli.main(["train", "--resume", str(out)]) == 0
    assert "resuming" in capsys.readouterr().err
    assert [untimed(r) for r in read_rows(out / "metrics.jsonl")] == [
        untimed(r) for r in read_rows(straight / "metrics.jsonl")
    ]


# Scores 1e30 from its N-th call on (N = $PYPPO_TEST_HUGE_FROM): finite, but the value loss squares it.
HUGE = """\
import os
calls = [0]
def huge(prompts, responses):
    calls[0] += 1
    if calls[0] >= int(os.environ.get("PYPPO_TEST_HUGE_FROM") or 10**9):
        return [1e30] * len(responses)
    return [float(r.count("e")) - 0.1 * len(r) for r in responses]
"""


def test_a_huge_score_that_makes_every_update_non_finite_keeps_the_last_finished_step(
    tiny_dir, prompts_file, tmp_path, capsys, monkeypatch
):
    # Two minibatches a step and max_consecutive_skips = 3: step 3's updates are both skipped
    # (the step finishes, its weights those of step 2), and step 4's first one stops the run.
    reward = tmp_path / "huge.py"
    reward.write_text(HUGE)
    out = tmp_path / "run"
    flags = ["--model", str(tiny_dir), "--prompts", str(prompts_file), "--reward", f"{reward}:huge", *FLAGS]
    monkeypatch.setenv("PYPPO_TEST_HUGE_FROM", "3")
    assert cli.main(["train", *flags, "--output", str(out)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pyppo: error: ")]
    assert len(errors) == 1, errors
    assert "training stopped at step 4, epoch 1, minibatch 1: 3 updates in a row had a non-finite" in errors[0]
    assert errors[0].endswith(
        f"; the last good checkpoint is {str(out / 'checkpoint')!r} (step 3); "
        f"once its cause is fixed, continue with: pyppo train --resume {out}"
    )
    assert ckpt_step(out / "checkpoint") == 3
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == [1, 2, 3]

    # The reward mended, the printed command finishes the run.
    monkeypatch.delenv("PYPPO_TEST_HUGE_FROM")
    assert cli.main(["train", "--resume", str(out)]) == 0
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_an_error_in_the_evaluation_keeps_the_step_it_follows(tmp_path):
    held_out = ["a held-out prompt", "another held-out prompt"]

    def reward(prompts, responses):
        if prompts[0] in held_out:
            raise RuntimeError("the judge of held-out prompts is down")
        return [float(r.count("e")) for r in responses]

    tr = PPOTrainer(
        small_config(steps=3, eval_every=2),
        tiny_causal_lm(seed=0),
        None,
        None,
        tiny_tokenizer(),
        reward,
        PROMPTS,
        eval_prompts=held_out,
    )
    with pytest.raises(RewardError, match="the judge of held-out prompts is down"):
        tr.train(tmp_path, progress=False)
    # Step 2 finished before its evaluation failed: logged (without eval/*) and checkpointed.
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and not any(k.startswith("eval/") for k in rows[1])
    assert ckpt_step(tmp_path / "checkpoint") == 2
