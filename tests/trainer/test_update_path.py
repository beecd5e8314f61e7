"""How a step spends its compute, checked for what it must not change: the first update pass
standing in for the rollout's policy forward, the policy's backward before the value model's
forward, and the KL term of the loss."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo.trainer.logprob_head import PolicyObjective, policy_objective
from pyppo.ops import aggregate_loss, kl_penalty, ppo_policy_loss
from pyppo.trainer import METRIC_KEYS
from pyppo.trainer.rollout_forwards import rollout_forwards
from pyppo.trainer.step_stats import PhaseTimer
from support.trainer_fixture import make_trainer, small_config

# One minibatch of one micro-batch: the first pass is the rollout's for every row.
WHOLE = dict(batch_size=4, mini_batch_size=4, micro_batch_size=None, ppo_epochs=2)
# Two minibatches of one micro-batch each: for the first minibatch's rows only.
HALVES = dict(batch_size=4, mini_batch_size=2, micro_batch_size=None, ppo_epochs=2)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_the_first_pass_is_the_rollout_pass_only_when_the_first_minibatch_is_one_micro_batch():
    assert make_trainer(small_config(**WHOLE)).first_pass_is_rollout_pass()
    assert make_trainer(small_config(**HALVES)).first_pass_is_rollout_pass()
    assert not make_trainer(small_config()).first_pass_is_rollout_pass()  # 2 minibatches of 2 micro-batches
    assert not make_trainer(small_config(**{**WHOLE, "micro_batch_size": 2})).first_pass_is_rollout_pass()
    assert not make_trainer(small_config(**WHOLE, disable_dropout=False)).first_pass_is_rollout_pass()


@pytest.mark.parametrize("layout", [WHOLE, HALVES], ids=["one-minibatch", "two-minibatches"])
def test_reusing_the_first_pass_changes_nothing_but_the_work(monkeypatch, layout):
    runs = {}
    for reuse in (True, False):
        tr = make_trainer(small_config(**layout, steps=2))
        if not reuse:
            monkeypatch.setattr(tr, "first_pass_is_rollout_pass", lambda: False)
        forwards, policy_rows = [], []
        tr.value_model.register_forward_pre_hook(lambda *a: forwards.append(torch.is_grad_enabled()))
        tr.policy_module.register_forward_pre_hook(
            lambda m, args, kwargs: policy_rows.append((torch.is_grad_enabled(), args[0] and len(args[0]))),
            with_kwargs=True)
        metrics = [tr.step().metrics for _ in range(2)]
        runs[reuse] = (tr, metrics, forwards, policy_rows)
    (a, ma, fa, pa), (b, mb, fb, pb) = runs[True], runs[False]
    n_mb = layout["batch_size"] // layout["mini_batch_size"]
    # The value model's rollout forward stays (without gradients), then once per minibatch and
    # epoch with them.
    assert fa == fb == ([False] * n_mb + [True] * n_mb * 2) * 2
    # Reused: the policy's no-grad rollout forward covers every minibatch but the first.
    rollout_rows = lambda rows: sum(n for grad, n in rows if not grad and n)  # (sampling passes no batch)
    assert rollout_rows(pb) == 2 * 4
    assert rollout_rows(pa) == 2 * (4 - layout["mini_batch_size"])
    for x, y in zip(ma, mb):
        assert x["first_max_abs_logratio"] == y["first_max_abs_logratio"] == 0.0
        assert x["time_policy_forward"] > 0 and y["time_policy_forward"] > 0  # the folded forward is timed too
        for k in ("score_mean", "kl_mean", "policy_loss", "value_loss", "approx_kl", "clipfrac", "entropy_mean",
                  "explained_variance"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), k
    for p, q in zip(_params(a.policy) + _params(a.value_model), _params(b.policy) + _params(b.value_model)):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout", [WHOLE, HALVES], ids=["one-minibatch", "two-minibatches"])
def test_reused_pass_fills_the_batch_like_the_rollout_forwards(monkeypatch, layout):
    # The step's batch carries the rollout tensors; reused or not they agree.
    out = {}
    for reuse in (True, False):
        tr = make_trainer(small_config(**layout, steps=1))
        if not reuse:
            monkeypatch.setattr(tr, "first_pass_is_rollout_pass", lambda: False)
        out[reuse] = tr.step().batch
    for name in ("old_logprobs", "entropy", "values", "ref_logprobs", "rewards", "advantages", "returns"):
        torch.testing.assert_close(getattr(out[True], name), getattr(out[False], name), rtol=1e-5, atol=1e-6,
                                   msg=name)


@pytest.mark.parametrize("layout", [dict(ppo_epochs=1), WHOLE])
def test_the_policys_backward_runs_before_the_value_models_forward(layout):
    tr = make_trainer(small_config(steps=1, **layout))
    events = []
    tr.value_model.register_forward_pre_hook(
        lambda *a: events.append("value forward") if torch.is_grad_enabled() else None)
    head = tr.policy.get_output_embeddings().weight
    head.register_post_accumulate_grad_hook(lambda p: events.append("policy backward"))
    tr.step()
    assert events and events == ["policy backward", "value forward"] * (len(events) // 2)


def _micro_batch(tr):
    batch = tr.rollout(["hello there", "a b", "x y z", "the cat"])
    batch.raw_scores, batch.scores = tr.score(batch)
    rollout_forwards(tr, batch, torch.arange(len(batch)), PhaseTimer())
    tr.advantages(batch, 0.05)
    return batch


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_policy_objective_adds_the_kl_and_entropy_terms(estimator):
    tr = make_trainer(small_config(steps=1))
    mb = _micro_batch(tr)
    lp = (mb.old_logprobs + 0.05 * torch.randn_like(mb.old_logprobs)).requires_grad_()
    ent = torch.rand_like(lp).requires_grad_()
    o = PolicyObjective(cliprange_low=0.2, cliprange_high=0.25, dual_clip=3.0, loss_agg="seq-mean-token-mean",
                        loss_agg_norm=None, normalizer=4, entropy_coef=0.01, kl_loss_coef=0.3,
                        kl_loss_estimator=estimator)
    loss, stats = policy_objective(lp, ent, mb, o)
    agg = dict(loss_agg="seq-mean-token-mean", normalizer=4)
    pg, _ = ppo_policy_loss(lp, mb.old_logprobs, mb.advantages, mb.response_mask, cliprange_low=0.2,
                            cliprange_high=0.25, dual_clip=3.0, **agg)
    kl = aggregate_loss(kl_penalty(lp, mb.ref_logprobs, estimator=estimator), mb.response_mask, **agg)
    en = aggregate_loss(ent, mb.response_mask, **agg)
    torch.testing.assert_close(loss, pg + 0.3 * kl - 0.01 * en)
    torch.testing.assert_close(stats["kl_loss"], kl.detach())
    torch.testing.assert_close(stats["entropy_loss"], en.detach())
    torch.testing.assert_close(stats["policy_loss"], pg.detach())
    assert "kl_loss" not in policy_objective(lp, ent, mb, PolicyObjective(**{**o.__dict__, "kl_loss_coef": 0.0}))[1]


def test_kl_loss_coef_moves_the_policy_and_is_logged():
    def run(coef):
        # One optimizer step per PPO step: step 1's loss sees the policy still equal to the reference.
        tr = make_trainer(small_config(steps=2, ppo_epochs=1, mini_batch_size=8, kl_loss_coef=coef,
                                       kl_loss_estimator="k2"))
        ms = [tr.step().metrics for _ in range(2)]
        return _params(tr.policy), ms

    a, ma = run(0.0)
    b, mb = run(1.0)
    assert "kl_loss" not in ma[-1] and all(k in mb[-1] for k in METRIC_KEYS)
    assert mb[0]["kl_loss"] == 0.0  # step 1: the policy is the reference
    assert mb[1]["kl_loss"] > 0.0 and math.isfinite(mb[1]["kl_loss"])
    assert any(not torch.equal(x, y) for x, y in zip(a, b))
