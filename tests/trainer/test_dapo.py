"""DAPO's rollout rules in the trainer: dynamic sampling (filter_groups), overlong shaping and
truncated-sample masking, on a tiny random model."""

import warnings

import pytest
import torch

from pyppo import ops
from pyppo.trainer.buffer import RolloutBuffer
from pyppo.trainer.overlong import AllTruncatedWarning, overlong_penalty
from pyppo.trainer.sampling import varied_groups
from support.trainer_fixture import count_e, make_trainer, small_config


def group_config(**overrides):
    base = dict(
        batch_size=8,
        mini_batch_size=4,
        micro_batch_size=2,
        samples_per_prompt=4,
        advantage_estimator="grpo",
        kl_coef=0.0,
        steps=1,
    )
    return small_config(**{**base, **overrides})


# ------------------------------------------------------------------ overlong shaping


def test_overlong_penalty_is_dapo_eq_13():
    L, C = 20, 5
    lengths = torch.arange(0, L + 1)
    expected = [0.0 if l <= L - C else 0.5 * (l - (L - C)) / C for l in range(L + 1)]
    torch.testing.assert_close(overlong_penalty(lengths, L, C, 0.5), torch.tensor(expected), rtol=0, atol=1e-7)
    assert overlong_penalty(torch.tensor([15, 20]), 20, 5).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"overlong_buffer must be in \[1, max_new_tokens = 20\], got 21"):
        overlong_penalty(lengths, 20, 21)


def test_the_step_subtracts_the_overlong_penalty_from_the_scores():
    tr = make_trainer(small_config(steps=1, overlong_buffer=4, overlong_penalty=2.0))
    b = tr.step().batch
    length = b.response_mask.sum(1)  # tokens, the EOS included
    assert (length > 4).any() and (length < 8).any()  # the penalty is exercised, not everywhere full
    expected = b.raw_scores - 2.0 * ((length.float() - 4).clamp(0, 4) / 4)
    torch.testing.assert_close(b.scores, expected)


# ------------------------------------------------------------------ truncated responses


# An EOS bias of 2.8 makes EOS about 11 % of the tiny model's draws a token: about half the responses
# end within 6 tokens, so a batch of 8 holds both kinds under any seed (4-5 of 8 cut, seeds 0-7),
# not by the luck of one random stream.
MIXED_EOS_BIAS = 2.8


def test_mask_truncated_takes_responses_without_eos_out_of_the_loss_after_their_group_baseline():
    tr = make_trainer(group_config(mask_truncated=True, max_new_tokens=6), eos_bias=MIXED_EOS_BIAS)
    res = tr.step()
    b, m = res.batch, res.metrics
    truncated = ~b.has_eos
    assert 0 < int(truncated.sum()) < len(b)  # both kinds are in the batch
    assert m["truncated_masked"] == int(truncated.sum())
    assert not b.loss_mask[truncated].any() and (b.advantages[truncated] == 0).all()
    # only the loss mask is cleared: the truncated responses' tokens are still in the sequence
    assert b.response_mask[truncated].all() and torch.equal(b.loss_mask[~truncated], b.response_mask[~truncated])
    # the kept rows' advantages are GRPO's over every score of their group, truncated ones included
    full = ops.group_advantages(b.scores, torch.ones(8, 1, dtype=torch.bool), group_size=4)[:, 0]
    kept = b.loss_mask
    torch.testing.assert_close(b.advantages[kept], full[:, None].expand_as(kept)[kept])
    assert (full[truncated] != 0).any()  # had they been scored 0 instead, the kept rows' baseline would differ
    assert m["response_length_mean"] > 0 and m["eos_fraction"] == pytest.approx(float(b.has_eos.float().mean()))


def test_a_minibatch_of_truncated_responses_only_is_skipped_without_error():
    tr = make_trainer(group_config(mask_truncated=True, max_new_tokens=4, steps=2), eos_bias=-30.0)  # never EOS
    before = [p.detach().clone() for p in tr.policy.parameters()]
    with pytest.warns(UserWarning) as said:
        m = tr.step().metrics
    assert m["truncated_masked"] == 8 and tr.optimizer_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, tr.policy.parameters()))
    # One line says so, naming the knobs that help; the next such step says nothing new.
    lines = [str(w.message) for w in said if "mask_truncated" in str(w.message)]
    assert lines == [
        "step 1: all 8 responses were cut without EOS (max_new_tokens = 4) and mask_truncated took them out "
        "of the loss: the step trained nothing; raise max_new_tokens, or turn mask_truncated off (said again "
        "only after a step that trains)"
    ]
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert tr.step().metrics["truncated_masked"] == 8
    assert not [w for w in again if "mask_truncated" in str(w.message)]


def _truncation_warnings(config, eos_bias):
    tr = make_trainer(config, eos_bias=eos_bias)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        m = tr.step().metrics
    return m, [w for w in said if "mask_truncated" in str(w.message)]


def test_no_truncation_warning_by_default_nor_while_some_responses_train():
    # The default (mask_truncated off): every response cut, as the default preset's 16 tokens are.
    m, said = _truncation_warnings(group_config(max_new_tokens=4), eos_bias=-30.0)
    assert "truncated_masked" not in m and not said
    m, said = _truncation_warnings(group_config(mask_truncated=True, max_new_tokens=6), eos_bias=MIXED_EOS_BIAS)
    assert 0 < m["truncated_masked"] < 8 and not said


def test_the_truncation_warning_is_said_again_only_after_a_step_that_trained():
    warn = AllTruncatedWarning(16)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step, masked in enumerate([8, 8, 3, 8, None, 8], start=1):
            warn(masked, 8, f"step {step}")
    assert [str(w.message).split(":")[0] for w in said] == ["step 1", "step 4"]
    assert all(w.category is UserWarning for w in said)
    episodes = AllTruncatedWarning(16, episodes=True)
    with pytest.warns(UserWarning, match="raise max_episode_tokens, max_turns or max_new_tokens, or turn"):
        episodes(4, 4, "step 1")
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        AllTruncatedWarning(16, say=False)(8, 8, "step 1")  # another rank than 0
    assert not quiet


# ------------------------------------------------------------------ dynamic sampling


def test_varied_groups():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 0.0, 0.0, 0.0])
    assert varied_groups(scores, 3).tolist() == [False, True, False]


def _half_constant(prompts, responses):
    """Constant scores for prompts ending in an even number, the sample's own score for the others."""
    varied = count_e(prompts, responses)
    return [0.5 if int(p.split()[-1]) % 2 == 0 else s for p, s in zip(prompts, varied)]


def test_filter_groups_keeps_varied_groups_and_samples_again_until_the_batch_is_full():
    tr = make_trainer(group_config(filter_groups=True, filter_groups_max_tries=8), reward=_half_constant)
    res = tr.step()
    b, m = res.batch, res.metrics
    assert len(b) == 8 and varied_groups(b.scores, 4).all()
    groups = [b.prompts[i] for i in range(0, 8, 4)]
    assert all(int(p.split()[-1]) % 2 == 1 for p in groups)
    assert all(b.prompts[i : i + 4] == [b.prompts[i]] * 4 for i in range(0, 8, 4))  # groups stay whole
    assert m["filter_groups_tries"] >= 2 and m["filter_groups_dropped"] >= 1 and m["filter_groups_filled"] == 0
    assert (b.advantages[b.response_mask] != 0).any()


def test_filter_groups_fills_the_batch_with_equal_groups_when_the_tries_run_out():
    tr = make_trainer(group_config(filter_groups=True, filter_groups_max_tries=2), reward=lambda p, r: [1.0] * len(r))
    res = tr.step()
    m = res.metrics
    assert len(res.batch) == 8
    assert m["filter_groups_tries"] == 2 and m["filter_groups_filled"] == 2 and m["filter_groups_dropped"] == 2
    assert (res.batch.advantages == 0).all()


def _wrong_or_varied(prompts, responses):
    """0 for every response to a prompt ending in an even number (all wrong), the sample's own
    score for the others."""
    varied = count_e(prompts, responses)
    return [0.0 if int(p.split()[-1]) % 2 == 0 else s for p, s in zip(prompts, varied)]


def test_filter_groups_drops_all_wrong_groups_whose_length_penalties_differ(monkeypatch):
    # DAPO as the README combines it: the overlong penalty makes a group of equally wrong answers
    # differ by length; the filter must still see them as equal (the reward's own scores).
    from pyppo.trainer import sampling

    scored = []

    def recording(batch, raw, *args, **kwargs):
        scores = real(batch, raw, *args, **kwargs)
        scored.append((list(batch.prompts), raw.clone(), scores.clone()))
        return scores

    real = sampling.shaped_scores
    monkeypatch.setattr(sampling, "shaped_scores", recording)
    config = group_config(
        filter_groups=True, filter_groups_max_tries=8, overlong_buffer=4, mask_truncated=True, max_new_tokens=8
    )
    tr = make_trainer(config, eos_bias=MIXED_EOS_BIAS, reward=_wrong_or_varied)
    res = tr.step()
    b, m = res.batch, res.metrics
    wrong = shaped_apart = 0
    for prompts, raw, scores in scored:
        for g in range(0, len(prompts), 4):
            if int(prompts[g].split()[-1]) % 2 == 0:
                assert (raw[g : g + 4] == 0).all()
                wrong += 1
                shaped_apart += int(bool((scores[g : g + 4] != scores[g]).any()))
    assert shaped_apart >= 1  # the case at hand: all wrong, apart by the length penalty only
    assert m["filter_groups_dropped"] == wrong and m["filter_groups_filled"] == 0
    assert len(b) == 8 and all(int(p.split()[-1]) % 2 == 1 for p in b.prompts)  # the mixed groups, kept
    assert varied_groups(b.raw_scores, 4).all()
    assert not torch.equal(b.scores, b.raw_scores)  # the training still uses the shaped scores


def test_without_filter_groups_one_draw_and_no_filter_metrics():
    tr = make_trainer(group_config(), reward=lambda p, r: [1.0] * len(r))
    drawn = []
    real = tr.sampler.sample_groups
    tr.sampler.sample_groups = lambda *a: (drawn.append(a), real(*a))[1]
    m = tr.step().metrics
    assert len(drawn) == 1 and not any(k.startswith("filter_groups") for k in m)


def test_cat_pads_prompts_left_and_responses_right():
    a = RolloutBuffer(
        torch.ones(2, 3, dtype=torch.long),
        torch.ones(2, 3, dtype=torch.bool),
        torch.ones(2, 2, dtype=torch.long),
        torch.ones(2, 2, dtype=torch.bool),
        scores=torch.ones(2),
        prompts=["a", "b"],
    )
    b = RolloutBuffer(
        torch.full((1, 1), 2),
        torch.ones(1, 1, dtype=torch.bool),
        torch.full((1, 4), 3),
        torch.ones(1, 4, dtype=torch.bool),
        scores=torch.zeros(1),
        prompts=["c"],
    )
    c = RolloutBuffer.cat([a, b])
    assert c.query_ids.tolist()[2] == [0, 0, 2] and c.query_mask.tolist()[2] == [False, False, True]
    assert c.response_ids.tolist()[0] == [1, 1, 0, 0] and c.response_mask.tolist()[0] == [True, True, False, False]
    assert c.scores.tolist() == [1.0, 1.0, 0.0] and c.prompts == ["a", "b", "c"]
    with pytest.raises(ValueError, match="cat: scores is set in some buffers only"):
        RolloutBuffer.cat([a, RolloutBuffer(b.query_ids, b.query_mask, b.response_ids, b.response_mask, prompts=["c"])])
