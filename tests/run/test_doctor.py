"""The run's doctor (pyppo.run.doctor): each check says one warning, of its own class, on a tiny
run built to trigger it (or on crafted step results where a run cannot provoke it cheaply), once
per condition; the default preset's first steps stay silent; ``doctor = false`` turns it off; it
changes nothing of the run; under torchrun it judges the global batch and rank 0 alone says it."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pyppo import distributed
from pyppo.cli import TRAIN_DEFAULTS
from pyppo.config import PPOConfig
from pyppo.run import doctor
from pyppo.run.doctor import (
    Doctor,
    DoctorWarning,
    EntropyCollapseWarning,
    KLJumpWarning,
    NoGroupSignalWarning,
    NoSignalWarning,
    RewardIgnoresResponseWarning,
    TruncationWarning,
    ValueModelWarning,
    ZeroAdvantagesWarning,
)
from pyppo.trainer.buffer import RolloutBuffer
from pyppo.trainer.overlong import AllTruncatedWarning
from pyppo.trainer.results import StepResult
from support.trainer_fixture import make_trainer, small_config

TESTS = Path(__file__).resolve().parents[1]


def fast(**overrides) -> PPOConfig:
    """A 2-step run of 8 responses of at most 4 tokens, one minibatch, one epoch."""
    settings = dict(steps=2, batch_size=8, mini_batch_size=8, micro_batch_size=None, ppo_epochs=1, max_new_tokens=4)
    return small_config(**{**settings, **overrides})


def prompt_only(prompts, responses):  # a reward that reads the prompt only, one value a prompt
    return [float(sum(map(ord, p))) for p in prompts]


def train(trainer, tmp_path):
    """``trainer.train``: its metrics and every warning it raised, in order."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        history = trainer.train(tmp_path / "run", progress=False)
    return history, said


def doctor_said(said) -> list:
    """(class name, step) of each doctor warning."""
    return [(w.category.__name__, str(w.message).split(":")[0]) for w in said if issubclass(w.category, DoctorWarning)]


def flags(history, check: str) -> list:
    return [row[f"doctor/{check}"] for row in history]


# ----------------------------------------------------------------------------- end to end, tiny runs


def test_a_constant_reward_says_no_signal_once(tmp_path):
    history, said = train(
        make_trainer(fast(steps=3, batch_size=4, mini_batch_size=4), reward=lambda p, r: [0.5] * len(r)), tmp_path
    )
    assert doctor_said(said) == [("NoSignalWarning", "step 1")]
    (warning,) = [w for w in said if w.category is NoSignalWarning]
    line = str(warning.message)
    assert "all 4 responses scored 0.5" in line and "docs/rewards.md" in line and "Why isn't it learning" in line
    assert flags(history, "no_signal") == [1.0, 1.0, 1.0]
    # Said from inside pyppo, which the command line prints as one `pyppo: warning: ...` line.
    assert str(warning.filename).startswith(str(Path(doctor.__file__).parent))


def test_a_reward_that_ignores_the_response_is_said_after_three_steps(tmp_path):
    # Two samples of each of 4 prompts, which differ, and one score per prompt.
    config = fast(steps=3, samples_per_prompt=2)
    history, said = train(make_trainer(config, reward=prompt_only), tmp_path)
    assert doctor_said(said) == [("RewardIgnoresResponseWarning", "step 3")]
    assert flags(history, "reward_ignores_response") == [1.0, 1.0, 1.0]  # seen each step, said at the third
    assert flags(history, "no_signal") == [0.0, 0.0, 0.0]  # the scores differ between prompts
    # A reward of the responses, on the same run, says nothing.
    history, said = train(make_trainer(config), tmp_path / "reads")
    assert doctor_said(said) == [] and flags(history, "reward_ignores_response") == [0.0, 0.0, 0.0]


def test_a_resumed_run_takes_the_doctor_up_where_its_checkpoint_left_it(tmp_path):
    # The 3 steps in a row that the ignored response needs span the resume: said at step 3 as in
    # the uninterrupted run, with the same doctor/* metrics.
    def config(steps):
        return fast(steps=steps, samples_per_prompt=2)

    straight, said_straight = train(make_trainer(config(3), reward=prompt_only), tmp_path / "straight")
    _, said_first = train(make_trainer(config(2), reward=prompt_only), tmp_path / "resumed")
    resumed = make_trainer(config(3), reward=prompt_only)
    resumed.load_checkpoint(tmp_path / "resumed" / "run" / "checkpoint")
    later, said_later = train(resumed, tmp_path / "resumed")
    assert doctor_said(said_straight) == doctor_said(said_first) + doctor_said(said_later)
    assert doctor_said(said_later) == [("RewardIgnoresResponseWarning", "step 3")]
    doctor_rows = [{k: v for k, v in row.items() if k.startswith("doctor/")} for row in straight]
    assert [{k: v for k, v in row.items() if k.startswith("doctor/")} for row in later] == doctor_rows[2:]


def test_groups_that_all_scored_alike_give_grpo_no_signal(tmp_path):
    config = fast(samples_per_prompt=4, advantage_estimator="grpo", kl_coef=0.0)
    history, said = train(make_trainer(config, reward=prompt_only), tmp_path)
    # Every advantage is 0 too, which the groups explain: one warning.
    assert doctor_said(said) == [("NoGroupSignalWarning", "step 1")]
    (line,) = [str(w.message) for w in said if w.category is NoGroupSignalWarning]
    assert "each of the 2 groups of 4 responses scored alike" in line and "filter_groups" in line
    assert flags(history, "no_group_signal") == flags(history, "zero_advantages") == [1.0, 1.0]


def test_missing_eos_penalty_on_every_response_is_said(tmp_path):
    history, said = train(make_trainer(fast(missing_eos_penalty=1.0), eos_bias=-30.0), tmp_path)  # never EOS
    assert doctor_said(said) == [("TruncationWarning", "step 1")]
    (line,) = [str(w.message) for w in said if w.category is TruncationWarning]
    assert "missing_eos_penalty lowered every score alike" in line and "raise max_new_tokens" in line
    assert flags(history, "truncation") == [1.0, 1.0]
    # Cut without a penalty (as the default preset's 16-token responses are): nothing to say.
    history, said = train(make_trainer(fast(), eos_bias=-30.0), tmp_path / "plain")
    assert doctor_said(said) == [] and "doctor/truncation" not in history[0]


def test_mask_truncated_on_every_response_is_said_once_by_the_doctor_alone(tmp_path):
    config = fast(samples_per_prompt=4, advantage_estimator="grpo", kl_coef=0.0, mask_truncated=True)
    trainer = make_trainer(config, eos_bias=-30.0)
    history, said = train(trainer, tmp_path)
    # The trainer's own UserWarning is not said beside it, nor the zero advantages it causes.
    user_warnings = [w for w in said if issubclass(w.category, UserWarning)]
    assert [w.category for w in user_warnings] == [TruncationWarning]
    expected = trainer.all_truncated.describe(8)
    assert str(user_warnings[0].message).startswith(f"step 1: {expected}; docs/trainer.md")
    assert flags(history, "truncation") == flags(history, "zero_advantages") == [1.0, 1.0]
    assert trainer.all_truncated.say  # given back after the run
    with pytest.warns(UserWarning, match="mask_truncated took them out"):  # a bare step says it as before
        make_trainer(config, eos_bias=-30.0).step()


def jump_kl_at_step_2(trainer, monkeypatch) -> None:
    """``trainer``'s step 2 reports the KL a diverged update would leave: 2 nats a token."""
    real = trainer.step

    def jumping_kl():
        result = real()
        if trainer.step_count == 2:
            result.metrics["kl_mean"] = 2.0 * result.metrics["response_length_mean"]
        return result

    monkeypatch.setattr(trainer, "step", jumping_kl)


def test_a_kl_jump_is_said(tmp_path, monkeypatch):
    trainer = make_trainer(fast(steps=3))
    jump_kl_at_step_2(trainer, monkeypatch)
    history, said = train(trainer, tmp_path)
    assert doctor_said(said) == [("KLJumpWarning", "step 2")]
    (line,) = [str(w.message) for w in said if w.category is KLJumpWarning]
    assert "nats per token in one step" in line and "lower lr" in line
    assert flags(history, "kl_jump") == [0.0, 1.0, 0.0]


def test_a_kl_jump_at_the_first_step_after_a_resume_is_said(tmp_path, monkeypatch):
    # The jump is measured from the last step before the checkpoint, which the log holds.
    train(make_trainer(fast(steps=1)), tmp_path)
    trainer = make_trainer(fast(steps=3))
    trainer.load_checkpoint(tmp_path / "run" / "checkpoint")
    jump_kl_at_step_2(trainer, monkeypatch)
    history, said = train(trainer, tmp_path)
    assert doctor_said(said) == [("KLJumpWarning", "step 2")]
    assert flags(history, "kl_jump") == [1.0, 0.0]


def test_the_default_presets_first_steps_are_silent(tmp_path):
    # pyppo train's preset on the tiny model, with a reward that reads the responses; none of its
    # 32 responses of 16 tokens ends with EOS, as none of SmolLM2's does at the preset's first step.
    config = PPOConfig(**{**TRAIN_DEFAULTS, "steps": 3, "dtype": "float32"})
    history, said = train(make_trainer(config, eos_bias=-30.0), tmp_path)
    assert [w.category for w in said if issubclass(w.category, UserWarning)] == []
    assert history[0]["eos_fraction"] == 0.0  # every response was cut
    checks = ("no_signal", "zero_advantages", "kl_jump", "entropy_collapse", "value_model")
    assert {k for k in history[0] if k.startswith("doctor/")} == {f"doctor/{c}" for c in checks}
    assert all(row[f"doctor/{c}"] == 0.0 for row in history for c in checks)


def test_doctor_false_runs_no_check_and_logs_no_doctor_metric(tmp_path):
    from pyppo import cli
    from pyppo.cli.flags import config_flag_values

    history, said = train(make_trainer(fast(doctor=False), reward=lambda p, r: [0.5] * len(r)), tmp_path)
    assert doctor_said(said) == [] and not [k for k in history[0] if k.startswith("doctor/")]
    args = cli.build_parser().parse_args(["train", "--no-doctor"])
    assert config_flag_values(args) == {"doctor": False}


def test_the_doctor_changes_nothing_of_the_run(tmp_path):
    # Every check of a critic run with groups applies (truncation through the penalty).
    config = fast(samples_per_prompt=2, missing_eos_penalty=0.5)
    runs = {}
    for on in (True, False):
        trainer = make_trainer(config.with_changes(doctor=on))
        history, _ = train(trainer, tmp_path / str(on))
        runs[on] = (history, [p.detach().clone() for p in trainer.policy.parameters()], trainer.critic.model)
    (with_doctor, policy_on, critic_on), (without, policy_off, critic_off) = runs[True], runs[False]

    def run_metrics(rows):
        timing = ("time_", "step_seconds", "doctor/")
        return [{k: v for k, v in row.items() if not k.startswith(timing)} for row in rows]

    assert any(k.startswith("doctor/") for k in with_doctor[0])
    assert run_metrics(with_doctor) == run_metrics(without)
    assert all(torch.equal(a, b) for a, b in zip(policy_on, policy_off))
    assert all(torch.equal(a, b) for a, b in zip(critic_on.parameters(), critic_off.parameters()))


# ----------------------------------------------------------------------------- crafted step results


def fake_trainer(**overrides):
    """What the doctor reads of a trainer, for a run of ``fast(**overrides)``."""
    config = fast(**overrides)
    critic = object() if config.advantage_estimator in ("gae", "gae_turn") else None
    world = distributed.World(0, 1, torch.device("cpu"))
    return SimpleNamespace(config=config, world=world, critic=critic, all_truncated=AllTruncatedWarning(4))


def crafted(step, scores=None, *, responses=None, advantages=None, **metrics) -> StepResult:
    """A step of 8 responses of 3 tokens: each different, scored ``scores`` (default 0..7), with
    advantages ``advantages`` (default varied) and every response ended by EOS."""
    scores = torch.arange(8.0) if scores is None else torch.as_tensor(scores, dtype=torch.float32)
    ones = torch.ones(8, 3, dtype=torch.bool)
    ids = torch.arange(24).reshape(8, 3) if responses is None else torch.as_tensor(responses)
    batch = RolloutBuffer(torch.zeros(8, 2, dtype=torch.long), torch.ones(8, 2), ids, ones)
    batch.scores, batch.raw_scores, batch.has_eos = scores, scores.clone(), torch.ones(8, dtype=torch.bool)
    batch.advantages = torch.linspace(-1, 1, 24).reshape(8, 3) if advantages is None else advantages
    row = dict(step=step, kl_mean=0.3, response_length_mean=3.0, entropy_mean=2.0, explained_variance=0.2)
    return StepResult({**row, **metrics}, batch)


def examine(d: Doctor, results) -> list:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for result in results:
            d.examine(result)
    return doctor_said(said)


def test_entropy_near_zero_is_said():
    d = Doctor(fake_trainer())
    said = examine(d, [crafted(1, entropy_mean=0.3), crafted(2, entropy_mean=0.01), crafted(3, entropy_mean=0.02)])
    assert said == [("EntropyCollapseWarning", "step 2")]
    result = crafted(4, entropy_mean=0.049)
    with pytest.warns(EntropyCollapseWarning, match=r"entropy is 0.049 nats per token \(under 0.05\).*entropy_coef"):
        Doctor(fake_trainer()).examine(result)
    assert result.metrics["doctor/entropy_collapse"] == 1.0


def test_an_explained_variance_that_stays_negative_is_said_after_five_judged_steps():
    d = Doctor(fake_trainer())
    ev = [-0.5] * 7 + [0.1] + [-0.2] * 5  # negative through step 7, positive at 8, then 5 negative
    results = [crafted(step, explained_variance=v) for step, v in enumerate(ev, start=1)]
    assert examine(d, results) == [("ValueModelWarning", "step 13")]
    # Judged from step 6 on: the value model's first steps learn the returns' scale.
    assert [r.metrics["doctor/value_model"] for r in results] == [0.0] * 5 + [1.0, 1.0, 0.0] + [1.0] * 5
    # Negative from the start: said at step 10, the fifth judged.
    results = [crafted(step, explained_variance=-0.1) for step in range(1, 11)]
    assert examine(Doctor(fake_trainer()), results) == [("ValueModelWarning", "step 10")]
    # Without a value model there is nothing to judge, nor a metric.
    d = Doctor(fake_trainer(advantage_estimator="reinforce_pp"))
    results = [crafted(step, explained_variance=-0.1) for step in range(1, 11)]
    assert examine(d, results) == [] and "doctor/value_model" not in results[0].metrics


def test_zero_advantages_alone_are_said():
    # Varied scores, and still every advantage at the policy's tokens is 0 (masked ones may not be).
    zero = torch.zeros(8, 3)
    said = examine(Doctor(fake_trainer()), [crafted(1, advantages=zero)])
    assert said == [("ZeroAdvantagesWarning", "step 1")]
    result = crafted(1, advantages=torch.full((8, 3), 1e-3))
    examine(Doctor(fake_trainer()), [result])
    assert result.metrics["doctor/zero_advantages"] == 0.0


def test_a_warning_is_said_again_only_after_its_condition_cleared():
    d = Doctor(fake_trainer())
    same = [1.0] * 8
    results = [crafted(1, same), crafted(2, same), crafted(3), crafted(4, same), crafted(5, same)]
    assert examine(d, results) == [("NoSignalWarning", "step 1"), ("NoSignalWarning", "step 4")]
    assert [r.metrics["doctor/no_signal"] for r in results] == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_scores_equal_up_to_float32_rounding_are_equal():
    assert examine(Doctor(fake_trainer()), [crafted(1, [0.3 + 1e-8 * i for i in range(8)])])[0][0] == "NoSignalWarning"
    assert examine(Doctor(fake_trainer()), [crafted(1, [0.3 + 1e-4 * i for i in range(8)])]) == []


def test_identical_responses_in_each_group_are_no_ignored_response():
    # Samples of one prompt that are all the same response cannot tell whether the reward reads it.
    responses = torch.arange(4).repeat_interleave(2)[:, None].expand(8, 3)
    d = Doctor(fake_trainer(samples_per_prompt=2))
    results = [crafted(s, [0, 0, 1, 1, 2, 2, 3, 3], responses=responses) for s in (1, 2, 3)]
    assert examine(d, results) == []
    d = Doctor(fake_trainer(samples_per_prompt=2))
    results = [crafted(s, [0, 0, 1, 1, 2, 2, 3, 3]) for s in (1, 2, 3)]
    assert examine(d, results) == [("RewardIgnoresResponseWarning", "step 3")]


def test_a_right_or_wrong_reward_on_prompts_all_solved_or_all_failed_is_no_ignored_response():
    # One score a group, as from a reward that reads the prompt only, but of two values.
    d = Doctor(fake_trainer(samples_per_prompt=2))
    results = [crafted(s, [0, 0, 1, 1, 1, 1, 0, 0]) for s in (1, 2, 3)]
    assert examine(d, results) == [] and results[0].metrics["doctor/reward_ignores_response"] == 0.0
    d = Doctor(fake_trainer(samples_per_prompt=2))
    results = [crafted(s, [0, 0, 1, 1, 2, 2, 1, 1]) for s in (1, 2, 3)]
    assert examine(d, results) == [("RewardIgnoresResponseWarning", "step 3")]


def test_every_check_has_its_own_warning_class_of_the_doctors():
    classes = set(doctor.CHECKS.values())
    assert len(classes) == len(doctor.CHECKS) == 8 and all(issubclass(c, DoctorWarning) for c in classes)
    assert issubclass(DoctorWarning, UserWarning)
    named = {
        NoSignalWarning,
        NoGroupSignalWarning,
        RewardIgnoresResponseWarning,
        ZeroAdvantagesWarning,
        TruncationWarning,
        KLJumpWarning,
        EntropyCollapseWarning,
        ValueModelWarning,
    }
    assert classes == named


# ----------------------------------------------------------------------------- several processes


def test_under_torchrun_the_checks_are_global_and_rank_0_alone_warns(tmp_path):
    # This file is the worker (its __main__ below). Run 1: rank r scores everything r, so each
    # rank's own scores are all equal but the batch's are not. Run 2: every score is 1.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = tmp_path / "ranks.pt"
    command = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", __file__, str(tmp_path)]
    res = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=600, env=env, cwd=TESTS)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    ranks = torch.load(out, weights_only=False)
    assert ranks["per_rank"] == {"said": [[], []], "no_signal": [[0.0], [0.0]]}
    assert ranks["constant"] == {"said": [[("NoSignalWarning", "step 1")], []], "no_signal": [[1.0], [1.0]]}


def _ranks_worker(directory: str) -> None:
    world = distributed.join("cpu")
    out = {}
    for name, reward in (
        ("per_rank", lambda p, r: [float(os.environ["RANK"])] * len(r)),
        ("constant", lambda p, r: [1.0] * len(r)),
    ):
        trainer = make_trainer(fast(steps=1, mini_batch_size=4, device="cpu"), reward=reward)
        history, said = train(trainer, Path(directory) / name)
        mine = {"said": doctor_said(said), "no_signal": flags(history, "no_signal")}
        gathered = distributed.gather_objects(mine, world)
        out[name] = {key: [rank[key] for rank in gathered] for key in mine}
        trainer.close()
    if world.is_main:
        torch.save(out, Path(directory) / "ranks.pt")
    distributed.barrier(world)
    distributed.leave(world)


if __name__ == "__main__":  # the worker of the torchrun test above
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)  # a rank stuck in a collective fails the test
    _ranks_worker(sys.argv[1])
