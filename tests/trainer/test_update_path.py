"""How a step spends its compute, checked for what it must not change: the first update pass
standing in for the rollout's policy forward (with every loss term on), the policy's backward
before the value model's forward, the KL term of the loss, and every loss knob on each path a
policy loss can take (fused, eager, full logits) against float64."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo.ops import aggregate_loss, kl_penalty, ppo_policy_loss
from pyppo.ops.policy_losses import GSPO_LOG_RATIO_MAX
from pyppo.trainer import METRIC_KEYS
from pyppo.trainer.logprob_head import PolicyObjective, policy_objective
from pyppo.trainer.rollout_forwards import rollout_forwards
from pyppo.trainer.step_stats import PhaseTimer, RunningStats
from support.reference import ref_aggregate_loss, ref_kl_unclamped, ref_pg_token, ref_ppo_value_loss
from support.tiny_models import tiny_causal_lm
from support.trainer_fixture import PROMPTS, make_trainer, small_config

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


# Every term of the loss on: the entropy bonus, the KL in the loss (against a reference unlike
# the policy, so it is not 0 from the first step), and the value loss with its clip acting.
ALL_TERMS = dict(entropy_coef=0.05, kl_loss_coef=0.2, kl_loss_estimator="k2", vf_coef=0.5, cliprange_value=0.05)


def _gradients_at_each_optimizer_step(tr):
    seen = []
    for model, opt in ((tr.policy, tr.policy_optimizer), (tr.critic.model, tr.critic.optimizer)):
        opt.register_step_pre_hook(
            lambda o, *a, model=model: seen.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        )
    return seen


@pytest.mark.parametrize(
    "layout, terms",
    [(WHOLE, {}), (WHOLE, ALL_TERMS), (HALVES, ALL_TERMS)],
    ids=["one-minibatch", "one-minibatch-every-term", "two-minibatches-every-term"],
)
def test_reusing_the_first_pass_changes_nothing_but_the_work(monkeypatch, layout, terms):
    runs = {}
    for reuse in (True, False):
        tr = make_trainer(small_config(**layout, **terms, steps=2), ref=tiny_causal_lm(seed=1) if terms else None)
        if not reuse:
            monkeypatch.setattr(tr, "first_pass_is_rollout_pass", lambda: False)
        forwards, policy_rows = [], []
        tr.critic.model.register_forward_pre_hook(lambda *a: forwards.append(torch.is_grad_enabled()))
        tr.models.policy_module.register_forward_pre_hook(
            lambda m, args, kwargs: policy_rows.append((torch.is_grad_enabled(), args[0] and len(args[0]))),
            with_kwargs=True,
        )
        grads = _gradients_at_each_optimizer_step(tr)
        metrics = [tr.step().metrics for _ in range(2)]
        runs[reuse] = (tr, metrics, forwards, policy_rows, grads)
    (a, ma, fa, pa, ga), (b, mb, fb, pb, gb) = runs[True], runs[False]
    # Every optimizer step of both models got the same gradient: the first minibatch's included,
    # whose policy loss the folded run builds from the rollout's live forward (each term's gradient
    # flows through it).
    assert len(ga) == len(gb) == 2 * 2 * 2 * (4 // layout["mini_batch_size"])
    for x, y in zip(ga, gb):
        assert len(x) == len(y)
        scale = max(float(g.abs().max()) for g in y)
        for g, h in zip(x, y):
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-5 * scale)
    n_mb = layout["batch_size"] // layout["mini_batch_size"]
    # The value model's rollout forward stays (without gradients), then once per minibatch and
    # epoch with them.
    assert fa == fb == ([False] * n_mb + [True] * n_mb * 2) * 2

    # Reused: the policy's no-grad rollout forward covers every minibatch but the first.
    def rollout_rows(rows):
        return sum(n for grad, n in rows if not grad and n)  # (sampling passes no batch)

    assert rollout_rows(pb) == 2 * 4
    assert rollout_rows(pa) == 2 * (4 - layout["mini_batch_size"])
    for x, y in zip(ma, mb):
        assert x["first_max_abs_logratio"] == y["first_max_abs_logratio"] == 0.0
        assert x["time_policy_forward"] > 0 and y["time_policy_forward"] > 0  # the folded forward is timed too
        for k in (
            "score_mean",
            "kl_mean",
            "policy_loss",
            "value_loss",
            "approx_kl",
            "clipfrac",
            "entropy_mean",
            "explained_variance",
        ) + (("entropy_loss", "kl_loss") if terms else ()):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), k
    for p, q in zip(_params(a.policy) + _params(a.critic.model), _params(b.policy) + _params(b.critic.model)):
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
        torch.testing.assert_close(getattr(out[True], name), getattr(out[False], name), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", [dict(ppo_epochs=1), WHOLE])
def test_the_policys_backward_runs_before_the_value_models_forward(layout):
    tr = make_trainer(small_config(steps=1, **layout))
    events = []
    tr.critic.model.register_forward_pre_hook(
        lambda *a: events.append("value forward") if torch.is_grad_enabled() else None
    )
    head = tr.policy.get_output_embeddings().weight
    head.register_post_accumulate_grad_hook(lambda p: events.append("policy backward"))
    tr.step()
    assert events and events == ["policy backward", "value forward"] * (len(events) // 2)


def _micro_batch(tr):
    batch = tr.rollout(["hello there", "a b", "x y z", "the cat"])
    batch.raw_scores, batch.scores = tr.score(batch)
    rollout_forwards(tr.models, batch, torch.arange(len(batch)), tr.micro_batch_size, PhaseTimer())
    tr.advantages(batch, 0.05)
    return batch


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_policy_objective_adds_the_kl_and_entropy_terms(estimator):
    tr = make_trainer(small_config(steps=1))
    mb = _micro_batch(tr)
    lp = (mb.old_logprobs + 0.05 * torch.randn_like(mb.old_logprobs)).requires_grad_()
    ent = torch.rand_like(lp).requires_grad_()
    o = PolicyObjective(
        cliprange_low=0.2,
        cliprange_high=0.25,
        dual_clip=3.0,
        loss_agg="seq-mean-token-mean",
        loss_agg_norm=None,
        entropy_coef=0.01,
        kl_loss_coef=0.3,
        kl_loss_estimator=estimator,
    )
    loss, stats = policy_objective(lp, ent, mb, o, 4)
    agg = dict(loss_agg="seq-mean-token-mean", normalizer=4)
    pg, _ = ppo_policy_loss(
        lp,
        mb.old_logprobs,
        mb.advantages,
        mb.response_mask,
        cliprange_low=0.2,
        cliprange_high=0.25,
        dual_clip=3.0,
        **agg,
    )
    kl = aggregate_loss(kl_penalty(lp, mb.ref_logprobs, estimator=estimator), mb.response_mask, **agg)
    en = aggregate_loss(ent, mb.response_mask, **agg)
    torch.testing.assert_close(loss, pg + 0.3 * kl - 0.01 * en)
    torch.testing.assert_close(stats["kl_loss"], kl.detach())
    torch.testing.assert_close(stats["entropy_loss"], en.detach())
    torch.testing.assert_close(stats["policy_loss"], pg.detach())
    assert "kl_loss" not in policy_objective(lp, ent, mb, PolicyObjective(**{**o.__dict__, "kl_loss_coef": 0.0}), 4)[1]


def test_kl_loss_coef_moves_the_policy_and_is_logged():
    def run(coef):
        # One optimizer step per PPO step: step 1's loss sees the policy still equal to the reference.
        estimator = dict(kl_loss_estimator="k2") if coef else {}  # the estimator acts only with the term
        tr = make_trainer(small_config(steps=2, ppo_epochs=1, mini_batch_size=8, kl_loss_coef=coef, **estimator))
        ms = [tr.step().metrics for _ in range(2)]
        return _params(tr.policy), ms

    a, ma = run(0.0)
    b, mb = run(1.0)
    assert "kl_loss" not in ma[-1] and all(k in mb[-1] for k in METRIC_KEYS)
    assert mb[0]["kl_loss"] == 0.0  # step 1: the policy is the reference
    assert mb[1]["kl_loss"] > 0.0 and math.isfinite(mb[1]["kl_loss"])
    assert any(not torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- every loss knob, every loss path
# Each case sets several loss knobs away from their defaults; together they give every policy
# loss, every KL estimator and every loss_agg mode. Each runs on the three paths a micro-batch's
# policy loss can take, which must all give the float64 gradient of docs/trainer.md's loss.
LOSS_CASES = [
    dict(
        policy_loss="ppo",
        kl_loss_estimator="k1",
        loss_agg="token-mean",
        cliprange=0.1,
        cliprange_high=0.3,
        dual_clip=2.0,
        entropy_coef=0.05,
        kl_loss_coef=0.3,
    ),
    dict(
        policy_loss="ppo",
        kl_loss_estimator="k2",
        loss_agg="seq-mean-token-mean",
        entropy_coef=0.01,
        kl_loss_coef=0.5,
        temperature=0.7,
        cliprange_value=0.05,
        vf_coef=0.3,
    ),
    dict(
        policy_loss="ppo",
        kl_loss_estimator="k3",
        loss_agg="seq-mean-token-sum",
        kl_loss_coef=0.2,
        cliprange_high=0.25,
        cliprange_value=None,
    ),
    dict(
        policy_loss="ppo",
        kl_loss_estimator="abs",
        loss_agg="seq-mean-token-sum-norm",
        loss_agg_norm=5.0,
        kl_loss_coef=0.4,
        entropy_coef=0.02,
    ),
    dict(
        policy_loss="gspo",
        kl_loss_estimator="k3",
        loss_agg="seq-mean-token-mean",
        cliprange=0.03,
        cliprange_high=0.05,
        entropy_coef=0.03,
        kl_loss_coef=0.1,
    ),
    dict(policy_loss="gspo", loss_agg="token-mean", cliprange=0.02, temperature=1.3),
    dict(
        policy_loss="cispo",
        kl_loss_estimator="k2",
        loss_agg="token-mean",
        cliprange=0.5,
        cliprange_high=0.1,
        kl_loss_coef=0.2,
        entropy_coef=0.04,
    ),
    # loss_agg_norm's default is max_new_tokens, not the batch's response length (shorter here).
    dict(
        policy_loss="cispo",
        kl_loss_estimator="abs",
        loss_agg="seq-mean-token-sum-norm",
        kl_loss_coef=0.3,
        temperature=0.8,
        max_new_tokens=16,
    ),
]
LOSS_PATHS = {
    "fused": dict(fused_policy_loss=True),
    "eager": dict(fused_policy_loss=False),
    "full-logits": dict(logprobs_from_hidden=False),
}


def _ref_policy_rows(name, lp, old, adv, mask, lo, hi, dual):
    """Float64 per-token policy losses, one list per row (docs/ops.md: ppo, gspo, cispo)."""
    rows = []
    for b in range(lp.shape[0]):
        valid = [t for t in range(lp.shape[1]) if mask[b, t]]
        if name == "ppo":
            rows.append([ref_pg_token(lp[b, t], old[b, t], adv[b, t], lo, hi, dual)[0] for t in valid])
        elif name == "gspo":  # GSPO-token: the row's geometric-mean ratio, each token's own gradient
            log_s = math.fsum(float(torch.clamp(lp[b, t] - old[b, t], -20, 20).detach()) for t in valid) / len(valid)
            row = []
            for t in valid:
                r = torch.exp(torch.clamp(lp[b, t] - lp[b, t].detach() + log_s, max=GSPO_LOG_RATIO_MAX))
                row.append(torch.maximum(-adv[b, t] * r, -adv[b, t] * torch.clamp(r, 1 - lo, 1 + hi)))
            rows.append(row)
        else:  # cispo: −sg(clip(r)) · A · log π
            rows.append(
                [
                    -min(max(math.exp(float((lp[b, t] - old[b, t]).detach())), 1 - lo), 1 + hi) * adv[b, t] * lp[b, t]
                    for t in valid
                ]
            )
    return rows


def _ref_minibatch_gradients(policy, value_model, mb, cfg):
    """The policy's and the value model's loss gradients on the whole minibatch ``mb``, in float64
    from copies of the models: ``policy_loss + kl_loss_coef·kl_loss − entropy_coef·entropy`` and
    ``vf_coef·value_loss``, each aggregated with ``loss_agg`` over ``mb``'s responses; and the
    value of each term (the step's metrics of that name)."""
    import copy

    P, T, m = mb.prompt_length, mb.response_length, mb.response_mask
    inputs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
    norm = cfg.loss_agg_norm if cfg.loss_agg_norm is not None else cfg.max_new_tokens
    agg = lambda rows: ref_aggregate_loss(rows, cfg.loss_agg, norm)  # noqa: E731
    rows_of = lambda x: [[x[b, t] for t in range(T) if m[b, t]] for b in range(len(mb))]  # noqa: E731

    pol = copy.deepcopy(policy).double()
    logits = pol(**inputs).logits[:, P - 1 : P + T - 1] / cfg.temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, mb.response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    old, adv = mb.old_logprobs.double(), mb.advantages.double()
    terms = {
        "policy_loss": agg(
            _ref_policy_rows(
                cfg.policy_loss, lp, old, adv, m, cfg.cliprange, cfg.effective_cliprange_high, cfg.dual_clip
            )
        )
    }
    loss = terms["policy_loss"]
    if cfg.kl_loss_coef > 0:
        terms["kl_loss"] = agg(rows_of(ref_kl_unclamped(lp, mb.ref_logprobs, cfg.kl_loss_estimator)))
        loss = loss + cfg.kl_loss_coef * terms["kl_loss"]
    if cfg.entropy_coef > 0:
        terms["entropy_loss"] = agg(rows_of(entropy))
        loss = loss - cfg.entropy_coef * terms["entropy_loss"]
    loss.backward()

    val = copy.deepcopy(value_model).double()
    values = val(mb.input_ids, mb.attention_mask, mb.position_ids)[:, P - 1 : P + T - 1]
    terms["value_loss"], _ = ref_ppo_value_loss(
        values, mb.values, mb.returns, m, eps=cfg.cliprange_value, mode=cfg.loss_agg, norm=norm
    )
    (cfg.vf_coef * terms["value_loss"]).backward()
    return (
        {n: p.grad for n, p in pol.named_parameters() if p.grad is not None},
        {n: p.grad for n, p in val.named_parameters() if p.grad is not None},
        {k: float(v.detach()) for k, v in terms.items()},
    )


def _minibatch_gradients(tr, mb):
    """The gradients ``minibatch_step`` hands each optimizer (not clipped: max_grad_norm is None),
    and the statistics it records."""
    grads = {}
    for name, model, opt in (
        ("policy", tr.policy, tr.policy_optimizer),
        ("value", tr.critic.model, tr.critic.optimizer),
    ):
        opt.register_step_pre_hook(
            lambda o, *a, name=name, model=model: grads.__setitem__(
                name, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            )
        )
    tr.train_mode(True)
    stats = RunningStats()
    tr.minibatch_step(mb, stats, "test")
    return grads["policy"], grads["value"], stats.means()


@pytest.mark.parametrize("knobs", LOSS_CASES, ids=lambda k: "-".join(str(v) for v in k.values())[:60])
def test_every_loss_knob_gives_the_float64_loss_and_gradient_on_every_loss_path(knobs):
    # One minibatch of two micro-batches (the normaliser of gradient accumulation), a reference
    # unlike the policy (the KL term is not 0) and old log-probs moved off the policy's (ratios
    # away from 1, so that the clip ranges act).
    def cfg(**path):
        sizes = dict(steps=1, batch_size=4, mini_batch_size=4, micro_batch_size=2, ppo_epochs=1, max_new_tokens=8)
        return small_config(**{**sizes, "max_grad_norm": None, **knobs, **path})

    trainers = {
        path: make_trainer(cfg(**flags), eos_bias=3.0, ref=tiny_causal_lm(seed=1)) for path, flags in LOSS_PATHS.items()
    }
    assert (
        trainers["fused"].models.policy_logprobs.uses_hidden
        and not trainers["full-logits"].models.policy_logprobs.uses_hidden
    )
    tr = trainers["fused"]
    mb = tr.rollout(PROMPTS[:4])
    mb.raw_scores, mb.scores = tr.score(mb)
    rollout_forwards(tr.models, mb, torch.arange(4), tr.micro_batch_size, PhaseTimer())
    tr.advantages(mb, 0.05)
    m = mb.response_mask
    assert int(m.sum(1).min()) < int(m.sum(1).max())  # responses of several lengths
    if "max_new_tokens" in knobs:
        assert mb.response_length < knobs["max_new_tokens"]
    mb.old_logprobs = torch.where(
        m, mb.old_logprobs + 0.3 * torch.randn(m.shape, generator=torch.Generator().manual_seed(0)), mb.old_logprobs
    )
    ref_policy, ref_value, ref_terms = _ref_minibatch_gradients(tr.policy, tr.critic.model, mb, tr.config)
    for path, trainer in trainers.items():
        policy, value, stats = _minibatch_gradients(trainer, mb)
        # The logged terms too: only the terms that are on, each the float64 value.
        assert {k for k in stats if k.endswith("_loss")} == set(ref_terms), path
        for k, v in ref_terms.items():
            assert stats[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (path, k)
        for got, want, what in ((policy, ref_policy, "policy"), (value, ref_value, "value")):
            assert got.keys() == want.keys(), (path, what)
            scale = max(float(g.abs().max()) for g in want.values())
            assert scale > 0
            for n, g in want.items():
                torch.testing.assert_close(got[n].double(), g, rtol=1e-4, atol=1e-5 * scale, msg=f"{path} {what} {n}")
