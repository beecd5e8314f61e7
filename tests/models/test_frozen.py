"""A frozen model's linear weights held in the autocast dtype: the same forward bit for bit under
that autocast, fewer bytes, embeddings and norms left in float32; the trainer's own reference and
a classifier reward held so in a bf16 run, a reference the caller passed left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pyppo.models import hold_linear_weights, make_reference
from support.tiny_models import tiny_causal_lm, tiny_llama_config
from support.trainer_fixture import make_trainer, small_config


def _tied_lm():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True)).eval()


def _logits(model, ids):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(ids).logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_same_logits_under_autocast_from_half_the_linear_bytes(tied):
    model = _tied_lm() if tied else tiny_causal_lm()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(4, 128, (3, 11), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    ref = make_reference(model)
    linear = sum(m.weight.numel() for m in ref.modules() if isinstance(m, nn.Linear))
    saved = hold_linear_weights(ref, torch.bfloat16)
    assert torch.equal(_logits(ref, ids), before)  # autocast's own rounding of the same weights
    for name, p in ref.named_parameters():
        in_linear = name.endswith("proj.weight") or name == "lm_head.weight"
        assert p.dtype == (torch.bfloat16 if in_linear else torch.float32), name
        assert not p.requires_grad
    # The tied head gets its own bf16 copy; the embedding keeps reading float32.
    assert ref.model.embed_tokens.weight.dtype == torch.float32
    head = ref.lm_head.weight.numel()
    assert saved == 2 * linear - (4 * head if tied else 0)
    assert model.lm_head.weight.dtype == torch.float32  # the source model is untouched


def test_refuses_a_trained_model_and_a_full_precision_dtype():
    model = tiny_causal_lm()
    with pytest.raises(ValueError, match=r"must be frozen; model\.embed_tokens\.weight requires grad"):
        hold_linear_weights(model, torch.bfloat16)
    ref = make_reference(model)
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float16, got torch.float32"):
        hold_linear_weights(ref, torch.float32)
    assert all(p.dtype == torch.float32 for p in ref.parameters())


def test_a_bf16_run_holds_its_own_reference_in_bf16_and_leaves_a_given_one_alone():
    tr = make_trainer(small_config(steps=1, dtype="bfloat16"))
    linears = [m for m in tr.models.reference.modules() if isinstance(m, nn.Linear)]
    assert linears and {m.weight.dtype for m in linears} == {torch.bfloat16}
    assert {p.dtype for p in tr.policy.parameters()} == {torch.float32}
    metrics, batch = tr.step()
    assert metrics["kl_mean"] == 0.0 and torch.equal(batch.old_logprobs, batch.ref_logprobs)

    mine = make_reference(tiny_causal_lm())
    given = make_trainer(small_config(steps=1, dtype="bfloat16"), ref=mine)
    assert given.models.reference is mine
    assert {p.dtype for p in mine.parameters()} == {torch.float32}
    fp32 = make_trainer(small_config(steps=1, dtype="float32"))
    assert {p.dtype for p in fp32.models.reference.parameters()} == {torch.float32}


def test_the_copy_is_deep():
    # The policy trains in float32 while the reference holds bf16 copies: no storage in common.
    tr = make_trainer(small_config(steps=1, dtype="bfloat16"))
    policy = {p.data_ptr() for p in tr.policy.parameters()}
    assert not policy & {p.data_ptr() for p in tr.models.reference.parameters()}
    before = copy.deepcopy(tr.models.reference.state_dict())
    tr.step()
    after = tr.models.reference.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
