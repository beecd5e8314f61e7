"""The rollout-engine interface and the advantage-estimator registry: what the trainer asks of
an engine, that any engine with that interface drives a step, and that estimators are found by
name."""

from __future__ import annotations

import pytest
import torch

from pyppo.rollout import HFGenerateEngine, Rollout, RolloutEngine
from pyppo.trainer.advantages import ADVANTAGE_ESTIMATORS, gae_advantages, get_estimator
from support.reference import ref_gae
from support.trainer_fixture import make_trainer, small_config


def test_the_default_engine_returns_a_rollout_of_the_prompts():
    tr = make_trainer(small_config(steps=1, max_new_tokens=6))
    assert isinstance(tr.engine, HFGenerateEngine)
    prompts = ["hello there", "a b", "x y z"]
    r = tr.engine.generate(prompts)
    assert isinstance(r, Rollout) and r.prompts == prompts and len(r.responses) == 3
    B, P = r.query_ids.shape
    assert (B, r.response_ids.shape[0], r.response_mask.shape, r.has_eos.shape) == (3, 3, r.response_ids.shape, (3,))
    assert r.query_mask.dtype == r.response_mask.dtype == torch.bool and r.rollout_logprobs is None
    assert bool(r.query_mask[:, -1].all())  # left-padded: every prompt ends where its response starts
    pad = tr.tokenizer.pad_token_id
    assert bool(((r.response_ids == pad) | r.response_mask).all())  # pad after the first EOS


class _ScriptedEngine(RolloutEngine):
    """An engine with the interface and nothing else (generate; the protocol's sync_weights and
    close do nothing): replays another engine's rollout, with
    log-probs of its own, and records the prompts it was asked for."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def generate(self, prompts):
        self.asked.append(list(prompts))
        r = self.inner.generate(prompts)
        r.rollout_logprobs = torch.where(r.response_mask, torch.full(r.response_ids.shape, -1.5), torch.zeros(()))
        return r


def test_any_engine_with_the_interface_drives_a_step():
    tr = make_trainer(small_config(steps=1))
    tr.engine = engine = _ScriptedEngine(tr.engine)
    result = tr.step()
    b = result.batch
    assert engine.asked == [b.prompts] and len(b.prompts) == tr.config.batch_size
    # The engine's own log-probs travel with the batch; PPO's old_logprobs are the trainer's own.
    assert b.rollout_logprobs is not None
    assert torch.equal(b.rollout_logprobs[b.response_mask], torch.full((int(b.response_mask.sum()),), -1.5))
    assert not torch.equal(b.old_logprobs[b.response_mask], b.rollout_logprobs[b.response_mask])
    assert result.metrics["first_max_abs_logratio"] == 0.0 and result.metrics["kl_mean"] == 0.0


def test_the_gae_estimator_is_registered_and_matches_the_reference():
    assert get_estimator("gae") is ADVANTAGE_ESTIMATORS["gae"] and ADVANTAGE_ESTIMATORS["gae"].fn is gae_advantages
    tr = make_trainer(small_config(steps=1, gamma=0.97, lam=0.9))
    b = tr.step().batch
    adv, ret = gae_advantages(b, tr.config)
    ref_adv, ref_ret = ref_gae(b.rewards, b.values, b.response_mask, gamma=0.97, lam=0.9)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-5)


def test_an_unknown_estimator_is_named_with_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"'dapo' is not one of \['gae', 'gae_turn', 'grpo', 'reinforce_pp', "
        r"'reinforce_pp_baseline', 'rloo'\]",
    ):
        get_estimator("dapo")


class _Broken(_ScriptedEngine):
    def __init__(self, inner, how):
        super().__init__(inner)
        self.how = how

    def generate(self, prompts):
        r = self.inner.generate(prompts)
        if self.how == "dict":
            return vars(r)
        if self.how == "fewer rows":
            return Rollout(**{k: v[:-1] for k, v in vars(r).items() if v is not None})
        if self.how == "float mask":
            r.response_mask = r.response_mask.float()
        if self.how == "other order":
            r.prompts = r.prompts[::-1]
        return r


@pytest.mark.parametrize(
    "how, error, match",
    [
        ("dict", TypeError, "must return a pyppo.rollout.Rollout, got dict"),
        ("fewer rows", ValueError, "returned 7 prompts for the 8"),
        ("float mask", TypeError, "response_mask must be a bool tensor, got torch.float32"),
        ("other order", ValueError, "not in their order"),
    ],
)
def test_what_an_engine_returns_is_checked_and_the_engine_named(how, error, match):
    tr = make_trainer(small_config(steps=1))
    tr.engine = _Broken(tr.engine, how)
    with pytest.raises(error, match=f"rollout engine _Broken: .*{match}"):
        tr.step()


def test_without_vllm_the_error_says_what_to_install(monkeypatch):
    import sys

    from pyppo.rollout.vllm_engine import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(
        ImportError, match=r"rollout_engine = 'vllm' needs vLLM.*scripts/install_vllm\.sh.*pyppo\[vllm\]"
    ):
        import_vllm()


def test_a_dead_process_s_engine_checkpoint_is_removed_and_a_live_one_kept(monkeypatch, tmp_path):
    import os
    import subprocess
    import sys
    import tempfile

    from pyppo.rollout import vllm_engine

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    paths = {name: tmp_path / f"pyppo-vllm-{name}-abc" for name in (dead, str(os.getppid()), str(os.getpid()))}
    other = tmp_path / "pyppo-vllm-notapid"
    for path in [*paths.values(), other]:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x")
    vllm_engine._remove_orphaned_checkpoints()
    assert not paths[dead].exists()
    assert paths[str(os.getppid())].exists() and paths[str(os.getpid())].exists() and other.exists()
