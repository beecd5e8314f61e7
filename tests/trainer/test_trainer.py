"""The PPO loop on tiny random models with a character tokenizer.

EOS == pad (as in SmolLM2), so these tests exercise the response-mask rules. The wiring tests
check what the trainer hands the ops against independent float64 references (tests/support/reference.py)
computed with the config's own knobs, so that a swapped argument or an ignored knob fails.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from pyppo.rollout.tokens import response_mask_from_eos
from pyppo.trainer import METRIC_KEYS, VALUE_METRIC_KEYS
from support.reference import ref_adaptive_kl_coef, ref_gae, ref_masked_whiten, ref_sequence_kl, ref_shape_rewards
from support.tiny_models import tiny_batch_mixing_lm, tiny_causal_lm, tiny_dropout_lm
from support.trainer_fixture import EOS, PROMPTS, count_e, make_trainer, small_config


# --------------------------------------------------------------------------- response mask
def test_response_mask_from_first_eos_when_pad_is_eos():
    ids = torch.tensor(
        [
            [5, 6, EOS, EOS, EOS],  # EOS then pad (= EOS): the first EOS stays in
            [EOS, EOS, EOS, EOS, EOS],  # only EOS: one valid position
            [5, 6, 7, 8, 9],  # cut by the length limit
            [5, EOS, 7, EOS, 9],  # junk after the first EOS is cut
        ]
    )
    mask, lengths, has_eos = response_mask_from_eos(ids, EOS)
    assert lengths.tolist() == [3, 1, 5, 2]
    assert has_eos.tolist() == [True, True, False, True]
    assert mask.long().tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="response_ids"):
        response_mask_from_eos(torch.zeros(2, 0, dtype=torch.long), EOS)


def test_rollout_mask_matches_first_eos():
    b = make_trainer(small_config(steps=1, max_new_tokens=12), eos_bias=2.0).step().batch
    assert 0 < int(b.has_eos.sum()) < len(b)  # a mix of finished and truncated responses
    T = b.response_length
    for row, mask, eos in zip(b.response_ids, b.response_mask, b.has_eos):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        if eos:
            assert row[n - 1] == EOS and not (row[: n - 1] == EOS).any()
        else:
            assert n == T and not (row == EOS).any()


def test_response_that_is_only_eos_has_one_valid_position():
    m, b = tuple(make_trainer(small_config(steps=1), eos_bias=100.0).step())
    assert b.response_ids.shape[1] == 1 and (b.response_ids == EOS).all()
    assert b.response_mask.all() and m["response_length_mean"] == 1.0
    assert b.responses == [""] * len(b)
    assert all(math.isfinite(v) for v in m.values())


def test_batch_of_one_with_an_eos_only_response_does_not_crash():
    # One valid token in the whole batch: whitening needs two, so the raw advantages are used.
    cfg = small_config(steps=1, batch_size=1, mini_batch_size=1, micro_batch_size=None)
    m, b = tuple(make_trainer(cfg, eos_bias=100.0).step())
    assert int(b.response_mask.sum()) == 1
    torch.testing.assert_close(b.advantages, b.returns - b.values)  # not whitened (whitening gives 0)
    assert m["explained_variance"] == 0.0  # Var[returns] = 0 over one token: defined as 0
    assert all(math.isfinite(v) for v in m.values()), m


# --------------------------------------------------------------------------- PPO step
def test_two_steps_first_ratio_exactly_one_and_metrics():
    tr = make_trainer()
    policy_before = [p.detach().clone() for p in tr.policy.parameters()]
    for step in (1, 2):
        m = tr.step().metrics
        for k in METRIC_KEYS + VALUE_METRIC_KEYS:
            assert k in m, k
        assert all(math.isfinite(v) for v in m.values()), m
        # Before the first optimizer step of a PPO step, π_θ is π_old: bit-identical log-probs.
        assert m["first_max_abs_logratio"] == 0.0
        assert m["first_ratio_min"] == m["first_ratio_max"] == m["first_ratio_mean"] == 1.0
        assert m["first_approx_kl"] == 0.0
        if step == 1:
            # the policy still equals the reference: KL exactly 0
            assert m["kl_mean"] == 0.0 and m["reward_mean"] == pytest.approx(m["score_mean"])
    assert m["kl_mean"] != 0.0  # after an update the policy has moved away from the reference
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, tr.policy.parameters()))
    for p in tr.models.reference.parameters():
        assert not p.requires_grad
    assert tr.step_count == 2


def test_first_ratio_is_exact_for_a_model_that_is_not_batch_invariant():
    # The layout mechanism, not the model, makes the first ratio 1: a row's log-probs here
    # depend on its batch-mates, so a training forward on other micro-batches than the rollout's
    # (a reshuffled first epoch, other chunks) would give a ratio != 1.
    tr = make_trainer(small_config(steps=1, ppo_epochs=1, micro_batch_size=2), policy=tiny_batch_mixing_lm())
    m, b = tuple(tr.step())
    assert m["first_max_abs_logratio"] == 0.0 and m["first_ratio_min"] == m["first_ratio_max"] == 1.0
    # ... and the model really is not batch-invariant: rows 0 and 1 together vs rows 1 and 0.
    with torch.no_grad():
        a = tr.models.ref_logprobs(b.select(torch.tensor([0, 1])))[0][0]
        c = tr.models.ref_logprobs(b.select(torch.tensor([0, 2])))[0][0]
    assert not torch.equal(a, c)


@pytest.mark.parametrize("disable", [True, False])
def test_disable_dropout(disable):
    tr = make_trainer(small_config(steps=1, ppo_epochs=1, disable_dropout=disable), policy=tiny_dropout_lm(p=0.3))
    ps = {m.p for model in (tr.policy, tr.critic.model) for m in model.modules() if isinstance(m, nn.Dropout)}
    assert ps == ({0.0} if disable else {0.3})
    m = tr.step().metrics
    if disable:  # training forwards (train mode) repeat the rollout's (eval mode) bit for bit
        assert m["first_max_abs_logratio"] == 0.0
    else:  # dropout on in train mode: the first ratio is not 1
        assert m["first_max_abs_logratio"] > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_logprobs_from_hidden_match_full_logits_over_two_steps(temperature):
    # linear_logprobs (default) and the full-logits path must train the same model: same
    # samples, metrics within float32 tolerance, parameters close after two steps.
    runs = {}
    for from_hidden in (True, False):
        tr = make_trainer(small_config(temperature=temperature, logprobs_from_hidden=from_hidden))
        assert tr.models.policy_logprobs.uses_hidden is from_hidden
        results = [tr.step() for _ in range(2)]
        runs[from_hidden] = (tr, results)
    (a, ra), (b, rb) = runs[True], runs[False]
    assert torch.equal(ra[-1].batch.response_ids, rb[-1].batch.response_ids)
    torch.testing.assert_close(ra[-1].batch.old_logprobs, rb[-1].batch.old_logprobs, rtol=1e-4, atol=1e-5)
    for x, y in zip(ra, rb):
        for k in ("score_mean", "kl_mean", "policy_loss", "value_loss", "entropy_mean", "approx_kl"):
            assert x.metrics[k] == pytest.approx(y.metrics[k], rel=1e-3, abs=1e-5), k
    for p, q in zip(a.policy.parameters(), b.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)


def test_logprobs_align_with_tokens_and_ignore_left_padding():
    temperature = 0.7
    tr = make_trainer(small_config(steps=1, temperature=temperature, ppo_epochs=1))
    b = tr.step().batch
    ref = tr.models.reference  # == the policy that sampled, at step 1
    for i in range(len(b)):
        # The row alone, without any left padding: logit at position t scores token t+1.
        q = b.query_ids[i][b.query_mask[i]]
        n = int(b.response_mask[i].sum())
        r = b.response_ids[i, :n]
        ids = torch.cat([q, r]).unsqueeze(0)
        with torch.no_grad():
            logits = ref(input_ids=ids).logits[0, len(q) - 1 : -1].double() / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, r.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(b.old_logprobs[i, :n].double(), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.ref_logprobs[i, :n].double(), expected, rtol=1e-4, atol=1e-4)
        assert (b.old_logprobs[i, n:] == 0).all()
        # The rollout's entropy is that of the sampling distribution.
        p = torch.softmax(logits, -1)
        torch.testing.assert_close(b.entropy[i, :n].double(), -(p * p.log()).sum(-1), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- wiring against references
@pytest.mark.parametrize("estimator, whiten", [("k1", True), ("k3", False)])
def test_rollout_tensors_match_the_references_with_the_config_knobs(estimator, whiten):
    # A reference that differs from the policy, so the KL is not 0 and its sign matters; gamma
    # and lam far apart, so swapping them shows; a clip and a penalty that both act.
    cfg = small_config(
        steps=1,
        ppo_epochs=1,
        kl_estimator=estimator,
        kl_coef=0.3,
        gamma=0.9,
        lam=0.6,
        whiten_advantages=whiten,
        score_clip=0.4,
        missing_eos_penalty=0.25,
        max_new_tokens=10,
    )
    tr = make_trainer(cfg, eos_bias=2.0, ref=tiny_causal_lm(seed=1))
    b = tr.step().batch
    assert 0 < int(b.has_eos.sum()) < len(b)
    raw = torch.tensor(count_e(b.prompts, b.responses), dtype=torch.float64)
    torch.testing.assert_close(b.raw_scores.double(), raw)
    # The clip acts on the raw score; the penalty comes after it, so the clip cannot absorb it.
    scores = raw.clamp(-0.4, 0.4) - 0.25 * (~b.has_eos).double()
    torch.testing.assert_close(b.scores.double(), scores, rtol=1e-6, atol=1e-6)
    rewards, kl = ref_shape_rewards(
        scores, b.old_logprobs, b.ref_logprobs, b.response_mask, kl_coef=0.3, estimator=estimator
    )
    assert kl[b.response_mask].abs().max() > 1e-3
    torch.testing.assert_close(b.kl.double(), kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.rewards.double(), rewards, rtol=1e-5, atol=1e-6)
    adv, ret = ref_gae(rewards, b.values, b.response_mask, gamma=0.9, lam=0.6)
    torch.testing.assert_close(b.returns.double(), ret, rtol=1e-5, atol=1e-6)
    if whiten:
        adv = ref_masked_whiten(adv, b.response_mask)
    torch.testing.assert_close(b.advantages.double(), adv, rtol=1e-4, atol=1e-5)


def test_ratio_and_kl_use_the_sampling_temperature():
    # The rollout's log-probs are of softmax(z / temperature) (checked in the alignment test);
    # here the update's too: a policy that has not moved gives ratio 1 at any temperature only if
    # both sides use the same one.
    tr = make_trainer(small_config(steps=1, ppo_epochs=1, temperature=0.5, mini_batch_size=8, micro_batch_size=None))
    assert tr.models.policy_logprobs.temperature == tr.models.ref_logprobs.temperature == 0.5
    m = tr.step().metrics
    assert m["first_max_abs_logratio"] == 0.0


@pytest.mark.parametrize("micro", [1, 2])
def test_explained_variance_does_not_depend_on_micro_batch_size(micro):
    # Gradient accumulation gives the same update whatever the micro-batch size, so the logged
    # explained variance (over every token of the update) must agree too; a mean of
    # per-micro-batch values would not.
    m = make_trainer(small_config(steps=1, micro_batch_size=micro)).step().metrics
    whole = make_trainer(small_config(steps=1, micro_batch_size=4)).step().metrics
    assert m["explained_variance"] == pytest.approx(whole["explained_variance"], rel=1e-4, abs=1e-6)
    assert m["explained_variance"] != 0.0


def _sequence_kl(b, estimator: str) -> float:
    # The KL the adaptive controller is fed (docs/trainer.md, point 7): nats per sequence, over
    # every sampled token (truncated responses too), averaged over the responses.
    kls = ref_sequence_kl(b.old_logprobs, b.ref_logprobs, b.response_ids, EOS, estimator)
    return sum(kls) / len(kls)


@pytest.mark.parametrize("estimator, mask_truncated", [("k1", False), ("k3", True)])
def test_adaptive_kl_controller_is_applied(estimator, mask_truncated):
    # A reference unlike the policy, so step 1's KL is not 0. The target is the KL the batch will
    # have (a first trainer, same seed, measures it) over 1.1: the controller's error, 0.1, is
    # then inside its ±0.2 clip, and the new coefficient depends on the KL's size, not only on
    # which side of the target it lies. Some responses hit the length limit: with
    # mask_truncated they leave the loss, but their KL is still the rollout's.
    def trainer(target):
        cfg = small_config(
            steps=2,
            kl_estimator=estimator,
            kl_coef=0.2,
            target_kl=target,
            kl_horizon=40,
            mask_truncated=mask_truncated,
            max_new_tokens=10,
        )
        return make_trainer(cfg, eos_bias=2.0, ref=tiny_causal_lm(seed=1))

    measured = _sequence_kl(trainer(1.0).step().batch, estimator)
    assert measured > 0.05
    target = measured / 1.1
    tr = trainer(target)
    m1, b1 = tuple(tr.step())
    assert 0 < int(b1.has_eos.sum()) < len(b1)
    kl1 = _sequence_kl(b1, estimator)
    assert kl1 == pytest.approx(measured, rel=1e-6)  # the same batch as the probe's
    beta1 = ref_adaptive_kl_coef(0.2, kl1, target, 8, 40)
    assert m1["kl_coef"] == 0.2 and m1["kl_mean"] == pytest.approx(kl1, rel=1e-5)
    assert tr.kl_ctl.value == pytest.approx(beta1, rel=1e-6)
    # Step 2's rewards are shaped with the updated coefficient, which then moves on with step 2's KL.
    m2, b2 = tuple(tr.step())
    assert m2["kl_coef"] == pytest.approx(beta1, rel=1e-6)
    rewards, _ = ref_shape_rewards(
        b2.scores,
        b2.old_logprobs,
        b2.ref_logprobs,
        response_mask_from_eos(b2.response_ids, EOS)[0],
        kl_coef=beta1,
        estimator=estimator,
    )
    torch.testing.assert_close(b2.rewards.double(), rewards, rtol=1e-5, atol=1e-6)
    beta2 = ref_adaptive_kl_coef(beta1, _sequence_kl(b2, estimator), target, 8, 40)
    assert tr.kl_ctl.value == pytest.approx(beta2, rel=1e-6)


def test_phases_are_visible_to_the_profiler():
    tr = make_trainer(small_config(steps=1, ppo_epochs=1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tr.step()
    names = {e.name for e in prof.events()}
    for phase in ("generate", "policy_forward", "ref_forward", "value_forward", "score", "advantages", "update"):
        assert f"pyppo/{phase}" in names


# --------------------------------------------------------------------------- train / checkpoints
def _comparable(m):
    return {k: v for k, v in m.items() if not k.startswith("time_") and k != "step_seconds"}


def test_train_outputs_and_exact_resume(tmp_path):
    # Reference run: two steps straight through. Four optimizer steps a step; the learning-rate
    # warm-up (6 of them) runs across the resume.
    full = make_trainer(small_config(steps=2, lr_warmup_steps=6))
    full_metrics = full.train(tmp_path / "full", progress=False)

    # Interrupted run: one step, a checkpoint, then a fresh process-like trainer resumes.
    first = make_trainer(small_config(steps=1, save_every=1, lr_warmup_steps=6))
    first.train(tmp_path / "run", progress=False)
    ckpt = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "optimizers.pt",
        "policy.pt",
        "trainer_state.pt",
        "value_model.pt",
    ]
    assert not [p for p in (tmp_path / "run").iterdir() if ".tmp-" in p.name or ".old-" in p.name]

    torch.manual_seed(12345)  # disturb the global RNG: the checkpoint must restore it
    resumed = make_trainer(small_config(steps=2, lr_warmup_steps=6))
    resumed.load_checkpoint(ckpt)
    assert resumed.step_count == 1
    lrs = []
    resumed.policy_optimizer.register_step_pre_hook(lambda o, *a: lrs.append(o.param_groups[0]["lr"]))
    resumed.train(tmp_path / "run", progress=False)
    assert lrs == pytest.approx([1e-3 * 5 / 6, 1e-3, 1e-3, 1e-3])  # lr · min(1, (n + 1) / 6), n = 4 ... 7
    assert resumed.step_count == 2

    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert _comparable(lines[1]) == _comparable(full_metrics[1])
    assert _comparable(lines[0]) == _comparable(full_metrics[0])
    for a, b in zip(full.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)

    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 8
    assert set(samples[0]) == {"step", "prompt", "response", "score"}
    assert all(s["prompt"] in PROMPTS for s in samples)

    # Saving again over an existing checkpoint replaces it atomically.
    resumed.save_checkpoint(ckpt)
    assert torch.load(ckpt / "trainer_state.pt", weights_only=True)["step"] == 2


def test_prompt_order_is_a_seeded_permutation_per_epoch():
    tr = make_trainer(small_config(batch_size=8, mini_batch_size=8, micro_batch_size=None))
    got = tr.sampler.sample(24) + tr.sampler.sample(24)
    assert sorted(got[:24]) == sorted(PROMPTS) and sorted(got[24:]) == sorted(PROMPTS)
    assert got[:24] != got[24:] and got[:24] != PROMPTS
    other = make_trainer(small_config())
    assert other.sampler.sample(24) == got[:24]


def test_missing_checkpoint_file(tmp_path):
    tr = make_trainer(small_config(steps=1))
    tr.save_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "policy.pt").unlink()
    with pytest.raises(FileNotFoundError, match="policy.pt"):
        tr.load_checkpoint(tmp_path / "ck")


def test_samples_log_the_raw_score(tmp_path):
    tr = make_trainer(small_config(steps=1, missing_eos_penalty=1.0, score_clip=0.5, max_new_tokens=10), eos_bias=2.0)
    (m,) = tr.train(tmp_path, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    raw = count_e([r["prompt"] for r in rows], [r["response"] for r in rows])
    assert [r["score"] for r in rows] == pytest.approx(raw)
    assert m["score_mean"] == pytest.approx(sum(raw) / len(raw))
