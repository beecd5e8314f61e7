"""The critic's estimators in a step: decoupled GAE (``lam_critic``: the value targets' λ),
length-adaptive GAE (``lam_alpha``: a λ per response) and GAE over agent turns (``gae_turn``:
``gamma_turn``, ``lam_turn``; the value loss trains at each turn's first token only). Each checks
the step's batch against the ops called by hand on the same rewards and values, and that the knob
moved the result."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo import ops
from pyppo.trainer import PPOTrainer
from support.agent_fixture import Replies, Scripted
from support.tiny_models import tiny_causal_lm, tiny_tokenizer
from support.trainer_fixture import EOS, PROMPTS, make_trainer, small_config


def _returns(batch, lam, lam_critic=None, gamma=1.0):
    return ops.gae(batch.rewards, batch.values, batch.loss_mask, gamma=gamma, lam=lam, lam_critic=lam_critic)[1]


def test_lam_critic_sets_the_value_targets_lambda():
    batch = make_trainer(small_config(steps=1, lam_critic=1.0)).step().batch
    torch.testing.assert_close(batch.returns, _returns(batch, 0.95, 1.0), rtol=0, atol=0)
    # Monte Carlo targets (λ = 1): each token's return is the sum of the rewards from it on.
    mc = torch.flip(torch.cumsum(torch.flip(batch.rewards * batch.loss_mask, [1]), 1), [1]) * batch.loss_mask
    torch.testing.assert_close(batch.returns, mc, rtol=1e-5, atol=1e-5)
    assert (batch.returns - _returns(batch, 0.95))[batch.loss_mask].abs().max() > 1e-3


def test_lam_alpha_gives_each_response_its_length_adaptive_lambda():
    batch = make_trainer(small_config(steps=1, lam_alpha=0.5)).step().batch
    lam = ops.length_adaptive_lam(batch.loss_mask, 0.5)
    assert lam.unique().numel() > 1  # responses of several lengths
    torch.testing.assert_close(batch.returns, _returns(batch, lam), rtol=0, atol=0)
    assert (batch.returns - _returns(batch, 0.95))[batch.loss_mask].abs().max() > 1e-3


@pytest.fixture(scope="module")
def turn_step():
    """One gae_turn step on 3-turn episodes (each turn scripted), gamma_turn and lam_turn off
    their defaults, the ``ppo_value_loss`` masks it trained on recorded."""
    import pyppo.trainer.critic as critic

    tok = tiny_tokenizer()
    config = small_config(max_turns=3, steps=1, advantage_estimator="gae_turn", gamma_turn=0.8, lam_turn=0.7)
    trainer = PPOTrainer(config, tiny_causal_lm(0), None, None, tok, None, PROMPTS, environment=Replies)
    a, b = (tok(t, add_special_tokens=False)["input_ids"] for t in ("no", "maybe"))
    trainer.engine.engine = Scripted([a + [EOS], b + [EOS], [EOS]])
    real, masks = critic.ppo_value_loss, []
    critic.ppo_value_loss = lambda values, old, returns, mask, **kw: (
        masks.append(mask),
        real(values, old, returns, mask, **kw),
    )[1]
    try:
        result = trainer.step()
    finally:
        critic.ppo_value_loss = real
    return result, masks


def test_gae_turn_runs_gae_over_the_turns_with_gamma_turn_and_lam_turn(turn_step):
    result, _ = turn_step
    batch = result.batch
    ids = torch.where(batch.loss_mask, batch.turn_ids, torch.full_like(batch.turn_ids, -1))
    assert int(ids.max()) == 2  # three turns
    _, returns = ops.turn_gae(batch.rewards, batch.values, ids, gamma=0.8, lam=0.7)
    torch.testing.assert_close(batch.returns, returns, rtol=0, atol=0)
    _, default = ops.turn_gae(batch.rewards, batch.values, ids, gamma=1.0, lam=0.95)
    assert (batch.returns - default)[batch.loss_mask].abs().max() > 1e-3
    # Every token of a turn has its turn's return.
    for row, turns in zip(batch.returns, ids):
        for k in range(3):
            assert row[turns == k].unique().numel() == 1


def test_gae_turn_trains_the_value_model_at_each_turns_first_token_only(turn_step):
    result, masks = turn_step
    batch = result.batch
    starts = ops.turn_start_mask(torch.where(batch.loss_mask, batch.turn_ids, torch.full_like(batch.turn_ids, -1)))
    assert torch.equal(batch.value_mask, starts) and int(starts.sum(1).max()) == 3
    assert masks and sum(int(m.sum()) for m in masks) == int(starts.sum()) * small_config().ppo_epochs
    assert math.isfinite(result.metrics["value_loss"]) and math.isfinite(result.metrics["explained_variance"])


def test_critic_warmup_steps_train_the_value_model_only_then_the_policy_from_its_own_lr_warm_up():
    tr = make_trainer(small_config(steps=3, critic_warmup_steps=2, lr_warmup_steps=8))

    def weights(model):
        return [p.detach().clone() for p in model.parameters()]

    policy, value = weights(tr.policy), weights(tr.critic.model)
    for _ in range(2):
        m = tr.step().metrics
        assert math.isnan(m["policy_loss"]) and m["policy_grad_norm"] == 0.0 and math.isfinite(m["value_loss"])
    assert all(torch.equal(a, b) for a, b in zip(policy, tr.policy.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(value, tr.critic.model.parameters()))
    assert (tr.optimizer_steps, tr.policy_steps) == (8, 0)
    m = tr.step().metrics  # the policy's first step: 4 optimizer steps, its warm-up at 4 of 8
    assert math.isfinite(m["policy_loss"]) and m["policy_grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(policy, tr.policy.parameters()))
    assert (tr.optimizer_steps, tr.policy_steps) == (12, 4)
    assert tr.policy_optimizer.param_groups[0]["lr"] == pytest.approx(tr.config.lr * 4 / 8)
    assert tr.critic.optimizer.param_groups[0]["lr"] == pytest.approx(tr.config.effective_value_lr)
    # A checkpoint holds the policy's own count, so that a resumed run goes on from it.
    assert tr.state_dict()["policy_steps"] == 4


def test_value_statistics_are_weighted_by_the_value_loss_positions(monkeypatch):
    # Under gae_turn the value loss trains at each turn's first token only: vf_clipfrac is the
    # fraction of those positions, not of the policy's tokens.
    import pyppo.trainer.critic as critic

    config = small_config(
        advantage_estimator="gae_turn", cliprange_value=1e-4, mini_batch_size=4, micro_batch_size=1, ppo_epochs=2
    )
    tr = make_trainer(config, eos_bias=1.5)  # responses of several lengths
    real, calls = critic.ppo_value_loss, []

    def spy(values, old, returns, mask, **kw):
        loss, stats = real(values, old, returns, mask, **kw)
        calls.append((float(stats["vf_clipfrac"]), int(mask.sum()), int((returns != 0).sum())))
        return loss, stats

    monkeypatch.setattr(critic, "ppo_value_loss", spy)
    m = tr.step().metrics
    assert m["skipped_updates"] == 0 and all(n == 1 for _, n, _ in calls)  # one turn start a row
    by_starts = sum(f * n for f, n, _ in calls) / sum(n for _, n, _ in calls)
    by_tokens = sum(f * t for f, _, t in calls) / sum(t for _, _, t in calls)
    assert 0 < by_starts < 1 and abs(by_starts - by_tokens) > 1e-3  # the two weightings differ here
    assert m["vf_clipfrac"] == pytest.approx(by_starts, rel=1e-6)
