"""The PPO loop on a tiny random Llama (2 layers, H=32, V=128) with a character tokenizer.

EOS == pad (as in SmolLM2), so these tests exercise the response-mask rules of DESIGN.md §2.2.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from pyppo.trainer import METRIC_KEYS, PPOConfig, PPOTrainer, response_mask_from_eos
from tiny_models import tiny_causal_lm, tiny_tokenizer

PROMPTS = [f"say something {'nice ' * (i % 4)}about {i}" for i in range(24)]
EOS = 2


def count_e(prompts, responses):
    # Any deterministic function of the text will do; this one varies with the sample.
    return [float(r.count("e")) - 0.1 * len(r) for r in responses]


def small_config(**overrides):
    cfg = dict(steps=2, batch_size=8, mini_batch_size=4, micro_batch_size=2, ppo_epochs=2,
               max_new_tokens=8, lr=1e-3, seed=0)
    cfg.update(overrides)
    return PPOConfig(**cfg)


def make_trainer(config=None, *, eos_bias=None, reward=count_e, prompts=PROMPTS):
    policy = tiny_causal_lm(seed=0)
    if eos_bias is not None:
        # An LM head with a bias on EOS: makes EOS (= pad) likely, or certain, at every position.
        head = nn.Linear(policy.lm_head.in_features, policy.lm_head.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(policy.lm_head.weight)
            head.bias.zero_()
            head.bias[EOS] = eos_bias
        policy.lm_head = head
    torch.manual_seed(1)  # the value head's init
    return PPOTrainer(config or small_config(), policy, None, None, tiny_tokenizer(), reward, prompts)


# --------------------------------------------------------------------------- response mask
def test_response_mask_from_first_eos_when_pad_is_eos():
    ids = torch.tensor([
        [5, 6, EOS, EOS, EOS],   # EOS then pad (= EOS): the first EOS stays in
        [EOS, EOS, EOS, EOS, EOS],  # only EOS: one valid position
        [5, 6, 7, 8, 9],         # cut by the length limit
        [5, EOS, 7, EOS, 9],     # junk after the first EOS is cut
    ])
    mask, lengths, has_eos = response_mask_from_eos(ids, EOS)
    assert lengths.tolist() == [3, 1, 5, 2]
    assert has_eos.tolist() == [True, True, False, True]
    assert mask.long().tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="response_ids"):
        response_mask_from_eos(torch.zeros(2, 0, dtype=torch.long), EOS)


def test_rollout_mask_matches_first_eos():
    tr = make_trainer(small_config(steps=1, max_new_tokens=12), eos_bias=2.0)
    tr.step()
    b = tr.last_batch
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
    tr = make_trainer(small_config(steps=1), eos_bias=100.0)
    m = tr.step()
    b = tr.last_batch
    assert b.response_ids.shape[1] == 1 and (b.response_ids == EOS).all()
    assert b.response_mask.all() and m["response_length_mean"] == 1.0
    assert b.responses == [""] * len(b)
    assert all(math.isfinite(v) for v in m.values())


# --------------------------------------------------------------------------- PPO step
def test_two_steps_first_ratio_exactly_one_and_metrics():
    tr = make_trainer()
    policy_before = [p.detach().clone() for p in tr.policy.parameters()]
    for step in (1, 2):
        m = tr.step()
        for k in METRIC_KEYS:
            assert k in m, k
        assert all(math.isfinite(v) for v in m.values()), m
        # Before the first optimizer step of a PPO step, π_θ is π_old: bit-identical log-probs.
        s = tr.first_minibatch_stats
        assert s["max_abs_logratio"] == 0.0
        assert s["ratio_min"] == 1.0 and s["ratio_max"] == 1.0 and s["ratio_mean"] == 1.0
        assert s["approx_kl"] == 0.0 and s["clipfrac"] == 0.0
        assert m["first_ratio_max"] == 1.0 and m["first_approx_kl"] == 0.0
        if step == 1:
            # the policy still equals the reference: KL exactly 0
            assert m["kl_mean"] == 0.0 and m["reward_mean"] == pytest.approx(m["score_mean"])
    assert m["kl_mean"] != 0.0  # after an update the policy has moved away from the reference
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, tr.policy.parameters()))
    for p in tr.ref_policy.parameters():
        assert not p.requires_grad
    assert tr.step_count == 2


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_logprobs_from_hidden_match_full_logits_over_two_steps(temperature):
    # linear_logprobs (default) and the full-logits path must train the same model: same
    # samples, metrics within float32 tolerance, parameters close after two steps.
    runs = {}
    for from_hidden in (True, False):
        tr = make_trainer(small_config(temperature=temperature, logprobs_from_hidden=from_hidden))
        metrics = [tr.step() for _ in range(2)]
        runs[from_hidden] = (tr, metrics)
    (a, ma), (b, mb) = runs[True], runs[False]
    assert torch.equal(a.last_batch.response_ids, b.last_batch.response_ids)
    torch.testing.assert_close(a.last_batch.old_logprobs, b.last_batch.old_logprobs, rtol=1e-4, atol=1e-5)
    for x, y in zip(ma, mb):
        for k in ("score_mean", "kl_mean", "policy_loss", "value_loss", "entropy_mean", "approx_kl"):
            assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-5), k
    for p, q in zip(a.policy.parameters(), b.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)


def test_logprobs_align_with_tokens_and_ignore_left_padding():
    temperature = 0.7
    tr = make_trainer(small_config(steps=1, temperature=temperature, ppo_epochs=1))
    tr.step()
    b = tr.last_batch
    ref = tr.ref_policy  # == the policy that sampled, at step 1
    for i in range(len(b)):
        # The row alone, without any left padding: logit at position t scores token t+1.
        q = b.query_ids[i][b.query_mask[i]]
        n = int(b.response_mask[i].sum())
        r = b.response_ids[i, :n]
        ids = torch.cat([q, r]).unsqueeze(0)
        with torch.no_grad():
            logits = ref(input_ids=ids).logits[0, len(q) - 1:-1].double() / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, r.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(b.old_logprobs[i, :n].double(), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.ref_logprobs[i, :n].double(), expected, rtol=1e-4, atol=1e-4)
        assert (b.old_logprobs[i, n:] == 0).all()


def test_adaptive_kl_controller_is_applied():
    tr = make_trainer(small_config(target_kl=0.5, kl_coef=0.2, kl_horizon=100))
    m1 = tr.step()
    m2 = tr.step()
    err = min(max(m1["kl_mean"] / 0.5 - 1, -0.2), 0.2)
    assert m1["kl_coef"] == 0.2
    assert m2["kl_coef"] == pytest.approx(0.2 * (1 + err * 8 / 100))


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
    # Reference run: two steps straight through.
    full = make_trainer(small_config(steps=2))
    full_metrics = full.train(tmp_path / "full", progress=False)

    # Interrupted run: one step, a checkpoint, then a fresh process-like trainer resumes.
    first = make_trainer(small_config(steps=1, save_every=1))
    first.train(tmp_path / "run", progress=False)
    ckpt = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["optimizers.pt", "policy.pt", "trainer_state.pt", "value_model.pt"]
    assert not [p for p in (tmp_path / "run").iterdir() if ".tmp-" in p.name or ".old-" in p.name]

    torch.manual_seed(12345)  # disturb the global RNG: the checkpoint must restore it
    resumed = make_trainer(small_config(steps=2))
    resumed.load_checkpoint(ckpt)
    assert resumed.step_count == 1
    resumed.train(tmp_path / "run", progress=False)
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


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "key, value",
    [
        ("steps", 0), ("batch_size", 0), ("mini_batch_size", 3), ("mini_batch_size", 32), ("micro_batch_size", 3),
        ("ppo_epochs", 0), ("max_new_tokens", 0), ("temperature", 0.0), ("top_p", 0.0), ("top_k", -1),
        ("lr", 0.0), ("lr", math.nan), ("kl_coef", -0.1), ("target_kl", 0.0), ("kl_horizon", 0.0),
        ("kl_estimator", "k4"), ("gamma", 1.5), ("lam", -0.1), ("cliprange", 1.0), ("cliprange_high", 0.0),
        ("dual_clip", 1.0), ("cliprange_value", 0.0), ("vf_coef", -1.0), ("entropy_coef", -0.1),
        ("max_grad_norm", 0.0), ("score_clip", -1.0), ("missing_eos_penalty", -1.0), ("loss_agg", "mean"),
        ("loss_agg_norm", 0.0), ("whiten_advantages", 1), ("use_chat_template", "yes"), ("seed", -1),
        ("save_every", -1), ("steps", 2.5), ("batch_size", True),
    ],
)
def test_config_validation_names_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        PPOConfig(**{key: value})


def test_config_from_dict():
    cfg = PPOConfig.from_dict({"steps": 3, "lr": 2e-5, "loss_agg": "seq-mean-token-sum-norm"})
    assert cfg.steps == 3 and cfg.lr == 2e-5 and cfg.effective_loss_agg_norm == cfg.max_new_tokens
    assert PPOConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="bogus, learning_rate"):
        PPOConfig.from_dict({"learning_rate": 1.0, "bogus": 2, "steps": 1})
    with pytest.raises(ValueError, match="kl_coef"):
        PPOConfig(kl_coef=0.0, target_kl=1.0)


def test_other_knobs_run(tmp_path, capsys):
    cfg = small_config(
        steps=1, loss_agg="seq-mean-token-sum-norm", dual_clip=3.0, cliprange_high=0.28, cliprange_value=None,
        entropy_coef=0.01, missing_eos_penalty=1.0, score_clip=0.5, whiten_advantages=False,
        use_chat_template=False, max_prompt_length=6, micro_batch_size=None, kl_estimator="k3", gamma=0.99,
        max_grad_norm=None, value_lr=1e-4,
    )
    tr = make_trainer(cfg, eos_bias=2.0)
    (m,) = tr.train(tmp_path, progress=True)
    assert all(math.isfinite(v) for v in m.values())
    assert tr.last_batch.query_ids.shape[1] <= 6
    err = capsys.readouterr().err
    assert "score=" in err and "kl=" in err  # the progress bar shows the live score and KL
    b = tr.last_batch
    assert 0 < int(b.has_eos.sum()) < len(b)
    # the reward saw the penalty for responses without EOS; the logged score is the raw one
    raw = torch.tensor(count_e(b.prompts, b.responses))
    torch.testing.assert_close(b.scores, raw - 1.0 * (~b.has_eos).float())
    assert m["score_mean"] == pytest.approx(raw.mean().item())
