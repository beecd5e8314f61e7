"""Every piece of trainer state a checkpoint holds comes back on a resume, each pinned by a test
that fails when that piece is not restored. Here: the adaptive KL controller (library and ``pyppo
train --resume``), with both models' weights and AdamW states; the step counters (the policy's own
after a critic warm-up, and the applied optimizer steps); the skip counters; the prompt sampler's
epoch and position; each global RNG (torch, numpy, python; each rank its own; the CUDA ones; those
of a checkpoint from before ``rank_rng``); and the refusals of a checkpoint of another number of
processes or another prompt set, before anything is restored. The minibatch shuffle generator is
pinned by tests/run/test_checkpoint_faults.py, the fixed settings by tests/cli/test_resume_rules.py."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pyppo import cli
from pyppo.distributed import World
from pyppo.prompts import PromptSampler
from pyppo.run.checkpoint import capture_rng
from pyppo.trainer.guards import NonFiniteUpdateError
from support.run_fixture import prompts_file, read_rows, tiny_dir, untimed  # noqa: F401 (fixtures)
from support.trainer_fixture import PROMPTS, make_trainer, small_config


def _draws():
    """One draw from each global RNG: torch, numpy and python."""
    return torch.rand(4), np.random.rand(3), [random.random() for _ in range(3)]


def _same_draws(a, b) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def _edit_state(checkpoint, **changes):
    """Rewrite ``trainer_state.pt`` with ``changes`` (``None`` removes a key)."""
    path = checkpoint / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    for key, value in changes.items():
        if value is None:
            state.pop(key)
        else:
            state[key] = value
    torch.save(state, path)


# ------------------------------------------------------------------ the adaptive KL controller
# A target far from the tiny model's KL (0 at step 1, where the policy is the reference; far above
# it once the policy has moved) and a short horizon: the coefficient moves by 10 % a step (the
# error is clipped at ±0.2; K = batch_size / horizon = 0.5), down and then up, so a resume that
# restarted it from kl_coef is off from the first resumed step.
ADAPTIVE = dict(kl_coef=0.05, target_kl=0.01, kl_horizon=16.0)


def test_the_adaptive_kl_controller_resumes_step_for_step(tmp_path):
    """A checkpoint after step 2 of 4, loaded by load_checkpoint: steps 3 and 4 use the
    uninterrupted run's kl_coef and give its metrics, weights and final controller state; the
    checkpoint holds the coefficient step 3 uses."""
    cfg = small_config(steps=4, ppo_epochs=1, **ADAPTIVE)
    straight = make_trainer(cfg)
    want = [straight.step().metrics for _ in range(2)]
    # Saved mid-run by the uninterrupted run itself: a save that changed anything of it would
    # make its steps 3 and 4 differ from the resumed ones.
    straight.save_checkpoint(tmp_path / "ck")
    want += [straight.step().metrics for _ in range(2)]
    coefs = [m["kl_coef"] for m in want]
    # The controller moves every step (else this test could not tell a restored one from a fresh one).
    assert coefs[0] == 0.05 and len(set(coefs)) == 4
    saved = torch.load(tmp_path / "ck" / "trainer_state.pt", weights_only=True)["kl_ctl"]
    assert saved == {"type": "adaptive", "value": coefs[2], "target": 0.01, "horizon": 16.0}

    torch.manual_seed(123)  # disturb the global RNG: the checkpoint restores it
    resumed = make_trainer(cfg)
    resumed.load_checkpoint(tmp_path / "ck")
    assert resumed.kl_ctl.value == coefs[2]
    got = [resumed.step().metrics for _ in range(2)]
    assert [m["kl_coef"] for m in got] == coefs[2:]
    assert [untimed(m) for m in got] == [untimed(m) for m in want[2:]]
    assert resumed.kl_ctl.state_dict() == straight.kl_ctl.state_dict()
    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(straight.critic.model.parameters(), resumed.critic.model.parameters()):
        assert torch.equal(a, b)


def test_pyppo_train_resume_keeps_the_adaptive_kl_coefficient(tiny_dir, prompts_file, tmp_path, capsys):
    """`pyppo train --steps 1`, then `--resume --steps 3`: every row of metrics.jsonl (kl_coef
    first) and the final controller state are those of an uninterrupted 3-step run."""
    flags = ["--model", str(tiny_dir), "--prompts", str(prompts_file), "--reward", "support.trainer_fixture:count_e"]
    flags += ["--batch-size", "2", "--mini-batch-size", "1", "--ppo-epochs", "1", "--max-new-tokens", "4"]
    # K = 2 / 4 = 0.5: the coefficient moves by 10 % a step.
    flags += ["--seed", "3", "--kl-coef", "0.05", "--target-kl", "0.01", "--kl-horizon", "4"]
    run, straight = tmp_path / "run", tmp_path / "straight"
    assert cli.main(["train", *flags, "--steps", "1", "--output", str(run)]) == 0
    assert cli.main(["train", "--resume", str(run), "--steps", "3"]) == 0
    assert cli.main(["train", *flags, "--steps", "3", "--output", str(straight)]) == 0
    capsys.readouterr()

    want, got = read_rows(straight / "metrics.jsonl"), read_rows(run / "metrics.jsonl")
    coefs = [r["kl_coef"] for r in want]
    assert coefs[0] == 0.05 and len(set(coefs)) == 3  # it moves: a fresh controller would be seen
    assert [r["kl_coef"] for r in got] == coefs
    assert [untimed(r) for r in got] == [untimed(r) for r in want]
    states = [torch.load(d / "checkpoint" / "trainer_state.pt", weights_only=True)["kl_ctl"] for d in (run, straight)]
    assert states[0] == states[1] and states[0]["type"] == "adaptive" and states[0]["value"] not in coefs


# ------------------------------------------------------------------ step counters
def test_the_policy_lr_warm_up_resumes_from_the_policys_own_step_count(tmp_path):
    """After a one-step critic warm-up the policy has taken fewer optimizer steps than the value
    model: a resume restores both counts (policy_steps, optimizer_steps), so each model's
    learning rate goes on along its own warm-up, not the other's."""
    cfg = small_config(steps=3, ppo_epochs=1, critic_warmup_steps=1, lr=1e-3, value_lr=2e-3, lr_warmup_steps=8)
    tr = make_trainer(cfg)
    tr.step(), tr.step()  # two optimizer steps a step; the policy's start at step 2
    assert (tr.optimizer_steps, tr.policy_steps) == (4, 2)
    tr.save_checkpoint(tmp_path / "ck")

    resumed = make_trainer(cfg)
    resumed.load_checkpoint(tmp_path / "ck")
    assert (resumed.step_count, resumed.optimizer_steps, resumed.policy_steps) == (2, 4, 2)
    lrs = {"policy": [], "value": []}
    resumed.policy_optimizer.register_step_pre_hook(lambda o, *a: lrs["policy"].append(o.param_groups[0]["lr"]))
    resumed.critic.optimizer.register_step_pre_hook(lambda o, *a: lrs["value"].append(o.param_groups[0]["lr"]))
    resumed.step()
    # lr · min(1, (n + 1) / 8) before a model's applied step n: the policy's n = 2, 3 (its own
    # count: falling back on optimizer_steps would give 5/8, 6/8), the value model's n = 4, 5.
    assert lrs["policy"] == pytest.approx([1e-3 * 3 / 8, 1e-3 * 4 / 8], rel=1e-12)
    assert lrs["value"] == pytest.approx([2e-3 * 5 / 8, 2e-3 * 6 / 8], rel=1e-12)


def test_the_skip_counters_carry_across_a_resume(tmp_path):
    """Four updates skipped in a row before the checkpoint and two after it stop the run at
    max_consecutive_skips = 6, as without the resume; the total is restored too."""
    cfg = small_config(steps=3, max_consecutive_skips=6)
    tr = make_trainer(cfg)
    param = next(p for p in tr.critic.model.parameters() if p.requires_grad)
    param.register_hook(lambda g: torch.full_like(g, math.inf))
    with pytest.warns(RuntimeWarning, match="value_grad_norm=inf"):
        assert tr.step().metrics["skipped_updates"] == 4  # 2 epochs of 2 minibatches
    tr.save_checkpoint(tmp_path / "ck")

    resumed = make_trainer(cfg)
    resumed.load_checkpoint(tmp_path / "ck")
    param = next(p for p in resumed.critic.model.parameters() if p.requires_grad)
    param.register_hook(lambda g: torch.full_like(g, math.inf))
    # Counted from 0 again, the sixth skip in a row would not come before step 3.
    with pytest.warns(RuntimeWarning), pytest.raises(NonFiniteUpdateError, match="step 2, epoch 1, minibatch 2: 6 "):
        resumed.step()
    assert (resumed.skips.consecutive, resumed.skips.total) == (6, 6)


# ------------------------------------------------------------------ the prompt sampler
def test_the_prompt_sampler_resumes_in_its_epoch_at_its_position(tmp_path):
    """A checkpoint taken 6 prompts into the sampler's second epoch: the resumed sampler draws
    the prompts the saving one would, which a first-epoch permutation would not give."""
    tr = make_trainer(small_config())
    tr.sampler.sample(len(PROMPTS) + 6)
    assert (tr.sampler.epoch, tr.sampler.position) == (1, 6)
    tr.save_checkpoint(tmp_path / "ck")
    want = tr.sampler.sample(len(PROMPTS))

    # Neither a sampler left at the start nor one at position 6 of the first epoch draws them.
    for epoch0_position in (0, 6):
        other = PromptSampler(PROMPTS, seed=0)
        other.sample(epoch0_position)
        assert other.sample(len(PROMPTS)) != want

    resumed = make_trainer(small_config())
    resumed.load_checkpoint(tmp_path / "ck")
    assert (resumed.sampler.epoch, resumed.sampler.position) == (1, 6)
    assert resumed.sampler.sample(len(PROMPTS)) == want


def _moved(trainer):
    """Move ``trainer`` off a new trainer's state without a step: a policy weight, the KL
    coefficient, the sampler's position."""
    with torch.no_grad():
        next(trainer.policy.parameters()).add_(1.0)
    trainer.kl_ctl.value = 0.02
    trainer.sampler.sample(3)
    return trainer


def _unchanged(trainer, policy_before):
    return (
        trainer.step_count == 0
        and trainer.kl_ctl.value == 0.05
        and trainer.sampler.state_dict()["position"] == 0
        and all(torch.equal(a, b) for a, b in zip(policy_before, trainer.policy.parameters()))
    )


def test_a_checkpoint_of_another_prompt_set_is_refused_before_anything_is_restored(tmp_path):
    """The sampler's position means nothing for another number of prompts: the load is refused,
    naming both counts, and leaves the trainer as it was (the weights and the KL controller too,
    which the sampler's own check came after)."""
    _moved(make_trainer(small_config(**ADAPTIVE))).save_checkpoint(tmp_path / "ck")
    other = make_trainer(small_config(**ADAPTIVE), prompts=PROMPTS[:10])
    before = [p.detach().clone() for p in other.policy.parameters()]
    with pytest.raises(ValueError) as refused:
        other.load_checkpoint(tmp_path / "ck")
    assert _unchanged(other, before)
    assert "was written by a run of 24 prompts, this run has 10; resume with the checkpoint's" in str(refused.value)


# ------------------------------------------------------------------ RNGs
def test_every_global_rng_is_restored_not_reseeded(tmp_path):
    """torch, numpy and python RNGs moved off the seed's state before the save: a new trainer
    (which reseeds all three) draws what the saving one would after the load."""
    tr = make_trainer(small_config())
    fresh = _draws()  # what a new trainer draws before any load
    tr.save_checkpoint(tmp_path / "ck")
    want = _draws()
    # No RNG repeats its draws: a trainer that kept its fresh state would be seen.
    assert not any(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(fresh, want))

    other = make_trainer(small_config())
    other.load_checkpoint(tmp_path / "ck")
    assert _same_draws(_draws(), want)


def test_each_rank_restores_its_own_rngs(tmp_path):
    """A checkpoint of two processes: rank 1 restores rank 1's RNG states, not rank 0's (which
    the top-level entries are). The second rank is this process, told it is rank 1 of 2."""
    tr = make_trainer(small_config())
    tr.save_checkpoint(tmp_path / "ck")
    rank0 = torch.load(tmp_path / "ck" / "trainer_state.pt", weights_only=True)["rank_rng"][0]
    _draws()
    rank1 = capture_rng()
    want = _draws()
    _edit_state(tmp_path / "ck", world_size=2, rank_rng=[rank0, rank1])

    other = make_trainer(small_config())
    other.world = World(rank=1, size=2, device=other.world.device)
    other.load_checkpoint(tmp_path / "ck")
    assert _same_draws(_draws(), want)


def test_a_checkpoint_without_rank_rngs_restores_its_top_level_ones(tmp_path):
    """A checkpoint of a pyppo before ``rank_rng``: its one set of RNG states is restored."""
    tr = make_trainer(small_config())
    _draws()  # off the state a new trainer starts in
    tr.save_checkpoint(tmp_path / "ck")
    want = _draws()
    _edit_state(tmp_path / "ck", rank_rng=None)

    other = make_trainer(small_config())
    other.load_checkpoint(tmp_path / "ck")
    assert _same_draws(_draws(), want)


def test_the_cuda_rngs_are_saved_and_restored(tmp_path, monkeypatch):
    """Every CUDA device's RNG state goes into the checkpoint and comes back (CUDA stood in for by
    one fake device's state, so that this runs on every machine)."""
    tr = make_trainer(small_config())
    device_states = [torch.arange(8, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in device_states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: device_states.__setitem__(0, states[0]))
    tr.save_checkpoint(tmp_path / "ck")
    saved = torch.load(tmp_path / "ck" / "trainer_state.pt", weights_only=True)["rank_rng"][0]["rng_cuda"]
    assert len(saved) == 1 and torch.equal(saved[0], torch.arange(8, dtype=torch.uint8))

    device_states[0] = torch.zeros(8, dtype=torch.uint8)  # the device's RNG moves on
    tr.load_checkpoint(tmp_path / "ck")
    assert torch.equal(device_states[0], torch.arange(8, dtype=torch.uint8))


# ------------------------------------------------------------------ the number of processes
def test_a_checkpoint_of_another_number_of_processes_is_refused_by_load_checkpoint(tmp_path):
    """Its RNGs and shards are per rank: load_checkpoint refuses it, naming both counts and the
    command, before anything is restored."""
    _moved(make_trainer(small_config(**ADAPTIVE))).save_checkpoint(tmp_path / "ck")
    _edit_state(tmp_path / "ck", world_size=2)
    other = make_trainer(small_config(**ADAPTIVE))
    before = [p.detach().clone() for p in other.policy.parameters()]
    with pytest.raises(ValueError, match=r"written by 2 process\(es\), this run has 1; resume with torchrun"):
        other.load_checkpoint(tmp_path / "ck")
    assert _unchanged(other, before)
