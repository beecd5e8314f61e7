"""LoRA (peft) in the trainer: only the adapters train, the reference is the same model with its
adapters disabled, checkpoints hold what trains and resume exactly, the policy export merges."""

from __future__ import annotations

import pytest
import torch

from support.tiny_models import save_tiny_causal_lm, tiny_causal_lm
from support.trainer_fixture import make_trainer, small_config


def lora_config(**overrides):
    return small_config(**{"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2, **overrides})


def trained_names(optimizer, model):
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_only_the_adapters_train_and_there_is_no_reference_copy():
    tr = make_trainer(lora_config())
    assert tr.models.reference is None
    names = trained_names(tr.policy_optimizer, tr.policy)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    adapted = {n.split(".lora_")[0] for n in names}
    # all-linear: every projection of every block, not the LM head.
    assert len(adapted) == 2 * 7 and not any("lm_head" in n for n in adapted)
    lora = tr.policy.peft_config["default"]
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (4, 8.0, 0.0)
    before = {n: p.detach().clone() for n, p in tr.policy.named_parameters()}
    tr.step()
    after = dict(tr.policy.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and moved <= names  # frozen base weights stay, adapters move
    assert any(".lora_B." in n for n in moved)
    # The value model is the full backbone copy by default.
    assert set(trained_names(tr.critic.optimizer, tr.critic.model)) == {
        n for n, _ in tr.critic.model.named_parameters()
    }


def test_reference_is_the_base_model_after_training():
    tr = make_trainer(lora_config(steps=2))
    tr.step()
    metrics, batch = tr.step()
    base = tiny_causal_lm(seed=0)  # make_trainer's initial policy
    mb = batch.select(torch.arange(2))
    from pyppo.trainer.logprob_head import LogprobHead

    with torch.no_grad():
        expected = LogprobHead(base, temperature=1.0)(mb)[0]
        assert torch.equal(tr.models.ref_logprobs(mb)[0], expected)
        assert not torch.equal(tr.models.policy_module(mb)[0], expected)  # the adapters are back on
    assert metrics["kl_mean"] != 0.0


def test_target_modules_and_alpha():
    tr = make_trainer(lora_config(lora_target_modules="q_proj,v_proj", lora_alpha=2.0))
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained_names(tr.policy_optimizer, tr.policy)}
    assert adapted == {"q_proj", "v_proj"}
    layer = tr.policy.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == 2.0 / 4
    with pytest.raises(ValueError, match="lora_target_modules 'nothing_here'"):
        make_trainer(lora_config(lora_target_modules="nothing_here"))
    with pytest.raises(ValueError, match="lora_target_modules must be"):
        lora_config(lora_target_modules="q_proj;v_proj")


def test_value_lora_trains_the_value_adapters_and_head_only():
    tr = make_trainer(lora_config(value_lora=True))
    names = trained_names(tr.critic.optimizer, tr.critic.model)
    assert {"head.weight", "head.bias"} <= names
    assert all(".lora_" in n for n in names - {"head.weight", "head.bias"}) and len(names) > 2
    with pytest.raises(ValueError, match="value_lora = True has no effect here: it needs lora_rank > 0"):
        small_config(value_lora=True)


def test_checkpoint_holds_what_trains_and_resumes_exactly(tmp_path):
    straight = make_trainer(lora_config(steps=3, value_lora=True))
    rows = straight.train(tmp_path / "straight", progress=False)

    first = make_trainer(lora_config(steps=2, value_lora=True))
    first.train(tmp_path / "run", progress=False)
    ckpt = tmp_path / "run" / "checkpoint"
    policy = torch.load(ckpt / "policy.pt", weights_only=True)
    value = torch.load(ckpt / "value_model.pt", weights_only=True)
    assert set(policy) == trained_names(first.policy_optimizer, first.policy)
    assert set(value) == trained_names(first.critic.optimizer, first.critic.model)
    full = sum(p.numel() for p in first.policy.parameters())
    assert sum(t.numel() for t in policy.values()) < full / 5

    resumed = make_trainer(lora_config(steps=3, value_lora=True))
    resumed.load_checkpoint(ckpt)
    last = resumed.train(tmp_path / "run", progress=False)[-1]
    untimed = lambda r: {k: v for k, v in r.items() if "time" not in k and "seconds" not in k}  # noqa: E731
    assert untimed(last) == untimed(rows[-1])
    for (n, a), (_, b) in zip(straight.policy.named_parameters(), resumed.policy.named_parameters()):
        assert torch.equal(a, b), n


def _claim_config(checkpoint, config):
    """Make a checkpoint's trainer_state claim ``config``, so that loading it gets past the
    settings check to the weights' own check (a checkpoint of an older pyppo, or edited by hand)."""
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    state["config"] = {**state["config"], **{k: v for k, v in config.to_dict().items() if k != "dtype"}}
    torch.save(state, checkpoint / "trainer_state.pt")


def test_a_lora_checkpoint_does_not_load_into_a_full_fine_tune(tmp_path):
    tr = make_trainer(lora_config(steps=1))
    tr.save_checkpoint(tmp_path / "ckpt")
    full = make_trainer(small_config(steps=1))
    before = {n: p.detach().clone() for n, p in full.policy.named_parameters()}
    with pytest.raises(ValueError, match=r"lora_rank 4 -> 0"):  # the settings say so first
        full.load_checkpoint(tmp_path / "ckpt")
    _claim_config(tmp_path / "ckpt", full.config)
    with pytest.raises(ValueError, match="policy weights do not match this run's trained weights"):
        full.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(before[n], p) for n, p in full.policy.named_parameters())


def test_a_checkpoint_of_another_lora_rank_is_refused_before_anything_changes(tmp_path):
    make_trainer(lora_config(steps=1, lora_rank=4)).save_checkpoint(tmp_path / "ckpt")
    other = make_trainer(lora_config(steps=1, lora_rank=8))
    before = {n: p.detach().clone() for n, p in other.policy.named_parameters()}
    with pytest.raises(ValueError, match=r"lora_rank 4 -> 8"):
        other.load_checkpoint(tmp_path / "ckpt")
    _claim_config(tmp_path / "ckpt", other.config)
    with pytest.raises(ValueError, match="has other shapes for"):
        other.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(before[n], p) for n, p in other.policy.named_parameters())


def test_ref_policy_with_lora_is_refused():
    with pytest.raises(ValueError, match="ref_policy must be None with lora_rank > 0"):
        make_trainer(lora_config(), ref=tiny_causal_lm(seed=0))


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter"])
def test_policy_export_merges_or_keeps_the_adapter(tmp_path, merge):
    from transformers import AutoModelForCausalLM

    from pyppo.models import load_model_and_tokenizer

    base_dir = save_tiny_causal_lm(tmp_path / "base")
    from transformers import AutoTokenizer

    tr = make_trainer(lora_config(steps=1, merge_lora=merge), policy=AutoModelForCausalLM.from_pretrained(base_dir))
    tr.base_model_source = str(base_dir)
    tr.train(tmp_path / "run", progress=False)
    out = tmp_path / "run" / "policy"
    assert (out / "adapter_config.json").is_file() is not merge
    model = AutoModelForCausalLM.from_pretrained(out) if merge else load_model_and_tokenizer(out)[0]
    assert all(p.requires_grad for p in model.parameters())  # trainable, as any loaded model
    assert AutoTokenizer.from_pretrained(out).eos_token_id == tr.tokenizer.eos_token_id
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = tr.policy(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(base_dir)(input_ids=ids).logits, expected)
