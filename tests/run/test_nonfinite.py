"""Non-finite numbers and odd inputs in a run: a NaN loss or gradient skips its update (and
max_consecutive_skips of them stop the run, keeping the last checkpoint), a diverged model is
named before whitening, and a prompt longer than the context is cut with one warning."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo.config import PPOConfig
from pyppo.run.checkpoint import find as find_checkpoint
from pyppo.trainer.guards import NonFiniteUpdateError
from support.run_fixture import ckpt_step, prompts_file, read_rows, tiny_dir  # noqa: F401 (fixtures)
from support.trainer_fixture import PROMPTS, make_trainer, small_config

# ----------------------------------------------------------------------------- non-finite updates


def _adam_steps(opt) -> set:
    return {int(s["step"]) for s in opt.state.values()}


def test_nan_loss_skips_that_update_only(monkeypatch):
    from pyppo.ops.policy_losses import POLICY_LOSSES

    real = POLICY_LOSSES["ppo"]
    calls = {"n": 0}

    def nan_on_second_minibatch(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * math.nan if calls["n"] == 2 else loss), stats

    monkeypatch.setitem(POLICY_LOSSES, "ppo", nan_on_second_minibatch)
    # 8 sequences, minibatches of 4, no accumulation, 2 epochs: 4 updates, the 2nd one poisoned
    # (the loss from the log-probs, where ppo_policy_loss is called).
    tr = make_trainer(small_config(steps=1, micro_batch_size=None, fused_policy_loss=False))
    with pytest.warns(RuntimeWarning, match=r"epoch 1, minibatch 2: non-finite policy_loss=nan.*update skipped"):
        m = tr.step().metrics
    assert m["skipped_updates"] == 1 and tr.skips.total == 1 and tr.skips.consecutive == 0
    assert _adam_steps(tr.policy_optimizer) == {3} and _adam_steps(tr.critic.optimizer) == {3}
    assert all(math.isfinite(v) for v in m.values()), m  # averages over the applied updates
    assert all(torch.isfinite(p).all() for p in tr.policy.parameters())


def test_nan_gradient_stops_after_max_consecutive_skips_keeping_last_checkpoint(tmp_path):
    tr = make_trainer(small_config(steps=1, save_every=1))
    tr.train(tmp_path, progress=False)
    assert ckpt_step(tmp_path / "checkpoint") == 1
    weights = [p.detach().clone() for p in tr.policy.parameters()]
    adam = _adam_steps(tr.policy_optimizer)

    # From now on one parameter's gradient is NaN: every update is skipped.
    param = next(p for p in tr.policy.parameters() if p.requires_grad)
    param.register_hook(lambda g: torch.full_like(g, math.nan))
    tr.config.steps = 3
    with pytest.warns(RuntimeWarning, match="policy_grad_norm=nan"):
        with pytest.raises(NonFiniteUpdateError) as info:
            tr.train(tmp_path, progress=False)
    msg = str(info.value)
    assert "training stopped at step 2, epoch 2, minibatch 1: 3 updates in a row" in msg
    assert "max_consecutive_skips=3" in msg
    assert f"last good checkpoint is {str(tmp_path / 'checkpoint')!r} (step 1)" in msg
    assert ckpt_step(tmp_path / "checkpoint") == 1 and find_checkpoint(tmp_path / "checkpoint") is not None
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1]  # the failed step is not logged
    assert all(torch.equal(a, b) for a, b in zip(weights, tr.policy.parameters()))
    assert _adam_steps(tr.policy_optimizer) == adam


def test_all_skipped_step_reports_nan_losses_and_counts_across_steps():
    tr = make_trainer(small_config(steps=2, max_consecutive_skips=6, target_kl=1.0))
    param = next(p for p in tr.critic.model.parameters() if p.requires_grad)
    param.register_hook(lambda g: torch.full_like(g, math.inf))
    with pytest.warns(RuntimeWarning, match="value_grad_norm=inf"):
        m = tr.step().metrics
    assert m["skipped_updates"] == 4 and tr.skips.consecutive == 4
    assert math.isnan(m["policy_loss"]) and math.isnan(m["clipfrac"]) and math.isfinite(m["score_mean"])
    with pytest.warns(RuntimeWarning), pytest.raises(NonFiniteUpdateError, match="6 updates in a row"):
        tr.step()


def test_metrics_of_an_all_skipped_step_are_strict_json(tmp_path):
    import json

    from pyppo.run.plotting import plot_metrics
    from pyppo.run.rundir import RunDir

    def strict(line):
        def refuse(constant):
            raise AssertionError(f"bare {constant} in {line!r}")

        return json.loads(line, parse_constant=refuse)

    tr = make_trainer(small_config(steps=2, max_consecutive_skips=9))
    param = next(p for p in tr.critic.model.parameters() if p.requires_grad)
    handle = param.register_hook(lambda g: torch.full_like(g, math.inf))
    with pytest.warns(RuntimeWarning, match="value_grad_norm=inf"):
        history = tr.train(tmp_path, progress=False)
    handle.remove()
    assert math.isnan(history[0]["policy_loss"])  # the Python side keeps the float
    rows = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["policy_loss"] is None and rows[0]["clipfrac"] is None and rows[0]["skipped_updates"] == 4
    assert isinstance(rows[0]["score_mean"], float)
    # What reads the log still does: the curves, and the truncation a resume makes.
    assert plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "curves.png").stat().st_size > 0
    with pytest.warns(RuntimeWarning, match="dropped 1 line"):
        RunDir(tmp_path).truncate_logs(1)
    assert [strict(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_max_consecutive_skips_is_validated():
    assert PPOConfig().max_consecutive_skips == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_consecutive_skips"):
            PPOConfig(max_consecutive_skips=bad)


# ----------------------------------------------------------------------------- odd inputs


def test_diverged_model_is_reported_before_whitening_keeping_the_checkpoint(tmp_path, monkeypatch):
    import pyppo.distributed as distributed_mod

    def no_whitening(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("non-finite values reached the whitening")

    tr = make_trainer(small_config(steps=1, save_every=1))
    tr.train(tmp_path, progress=False)
    monkeypatch.setattr(distributed_mod, "whiten", no_whitening)
    with torch.no_grad():  # what --lr 1e30 does to the weights
        for p in tr.policy.parameters():
            p.fill_(math.nan)
    tr.config.steps = 2
    with pytest.raises(NonFiniteUpdateError) as info:
        tr.train(tmp_path, progress=False)
    msg = str(info.value)
    assert msg.startswith("step 2: the rollout has non-finite old_logprobs (")
    assert "response tokens)" in msg and "the model probably diverged" in msg
    assert f"last good checkpoint is {str(tmp_path / 'checkpoint')!r} (step 1)" in msg
    assert ckpt_step(tmp_path / "checkpoint") == 1 and [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1]


def test_lr_1e30_names_no_checkpoint_good_when_it_holds_the_weights_that_diverged(
    tiny_dir, prompts_file, tmp_path, capsys
):
    from pyppo import cli

    # The user's command: step 1's update takes the weights to about 1e30 (finite), step 2's
    # rollout from them is NaN; the checkpoint of step 1 holds those weights.
    out = tmp_path / "run"
    argv = [
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts_file),
        "--output",
        str(out),
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--mini-batch-size",
        "1",
        "--max-new-tokens",
        "4",
        "--lr",
        "1e30",
        "--save-every",
        "1",
    ]
    assert cli.main(argv) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pyppo: error: ")]
    assert line.startswith("pyppo: error: step 2: the rollout has non-finite ")
    assert "last good" not in line
    assert line.endswith(
        f"no checkpoint is good to resume from: {str(out / 'checkpoint')!r} (step 1) holds the "
        "weights that gave this rollout; start the run over"
    )
    weights = torch.load(out / "checkpoint" / "policy.pt", weights_only=True)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert max(float(w.abs().max()) for w in weights.values()) > 1e29


def test_an_update_that_overflows_the_weights_is_not_checkpointed_over_the_last_good_one(tmp_path):
    tr = make_trainer(small_config(steps=1, save_every=1, max_consecutive_skips=100))
    tr.train(tmp_path, progress=False)
    good = torch.load(tmp_path / "checkpoint" / "policy.pt", weights_only=True)
    # An Adam update is about lr per weight: with an lr past float32's range (set behind the
    # config's check) step 2's first update makes weights infinite, from finite gradients; the
    # later updates of the step are skipped (their losses are NaN), and the step ends.
    tr.config.steps, tr.config.lr = 2, 1e39
    with pytest.warns(RuntimeWarning, match="update skipped"), pytest.raises(NonFiniteUpdateError) as info:
        tr.train(tmp_path, progress=False)
    msg = str(info.value)
    assert msg.startswith("step 2: ") and "trained weights are NaN/inf" in msg and "not checkpointed" in msg
    assert msg.endswith(f"the last good checkpoint is {str(tmp_path / 'checkpoint')!r} (step 1)")
    assert ckpt_step(tmp_path / "checkpoint") == 1
    kept = torch.load(tmp_path / "checkpoint" / "policy.pt", weights_only=True)
    assert all(torch.equal(kept[k], good[k]) for k in good)


def test_non_finite_values_are_named(monkeypatch):
    import pyppo.trainer.critic as trainer_mod  # the value model's forwards

    real = trainer_mod.response_values

    def nan_values(*args, **kwargs):
        v = real(*args, **kwargs)
        return v * math.nan

    monkeypatch.setattr(trainer_mod, "response_values", nan_values)
    tr = make_trainer(small_config(steps=1))
    with pytest.raises(NonFiniteUpdateError, match=r"step 1: the rollout has non-finite values \((\d+) of \1 "):
        tr.step()


def test_prompt_longer_than_the_context_is_cut_with_one_warning():
    from transformers import LlamaForCausalLM

    from support.tiny_models import tiny_llama_config

    torch.manual_seed(0)
    policy = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=80))
    prompts = PROMPTS[:3] + ["x" * 200] + PROMPTS[3:]
    with pytest.warns(UserWarning) as record:
        tr = make_trainer(small_config(steps=1, max_new_tokens=8), policy=policy, prompts=prompts)
    messages = [str(w.message) for w in record if "longer than" in str(w.message)]
    assert len(messages) == 1
    assert messages[0].startswith("prompts: prompt 3 (")
    assert "longer than the 72 tokens the model's context leaves (80 positions minus max_new_tokens = 8)" in messages[0]
    batch = tr.rollout(["x" * 200, "Hi"])
    assert batch.query_ids.shape[1] == 72
    with pytest.raises(ValueError, match=r"prompts: prompt 3 \(\d+ tokens\) longer than the 72 tokens"):
        make_trainer(small_config(steps=1, max_new_tokens=8, truncate_prompts=False), policy=policy, prompts=prompts)
