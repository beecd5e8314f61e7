"""Response log-probs on several model families: the hidden-state path only where it is exact,
the full logits elsewhere, and always the log-probs of what generate() samples from."""

from __future__ import annotations

import pytest
import torch

from pyppo.trainer.buffer import RolloutBuffer
from pyppo.trainer.logprob_head import LogprobHead
from support.tiny_models import ARCHITECTURES, tiny_arch


def _batch(V=128, B=3, P=5, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    query_mask = torch.ones(B, P, dtype=torch.bool)
    query_mask[1, :2] = False  # left padding
    response_mask = torch.ones(B, T, dtype=torch.bool)
    response_mask[2, 2:] = False
    return RolloutBuffer(
        query_ids=torch.randint(4, V, (B, P), generator=g),
        query_mask=query_mask,
        response_ids=torch.randint(4, V, (B, T), generator=g),
        response_mask=response_mask,
    )


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_match_the_full_logits_for_every_family(arch, temperature):
    model = tiny_arch(arch)
    head = LogprobHead(model, temperature=temperature, from_hidden=True)
    assert head.uses_hidden is ARCHITECTURES[arch][1]
    mb = _batch()
    with torch.no_grad():
        lp, ent = head(mb, return_entropy=True)
        logits = (
            model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
            .logits[:, mb.prompt_length - 1 : -1]
            .double()
            / temperature
        )
    expected = torch.log_softmax(logits, -1).gather(-1, mb.response_ids.unsqueeze(-1)).squeeze(-1)
    expected = torch.where(mb.response_mask, expected, torch.zeros_like(expected))
    torch.testing.assert_close(lp.double(), expected, rtol=1e-5, atol=1e-5)
    p = torch.softmax(logits, -1)
    ent_ref = torch.where(mb.response_mask, -(p * p.log()).sum(-1), torch.zeros_like(expected))
    torch.testing.assert_close(ent.double(), ent_ref, rtol=1e-5, atol=1e-5)


def test_soft_cap_declared_in_the_config_uses_full_logits_even_when_invisible():
    model = tiny_arch("gemma2", final_logit_softcapping=1000.0)  # numerically invisible on small logits
    assert not LogprobHead(model, temperature=1.0).uses_hidden


def test_from_hidden_off_uses_full_logits():
    assert not LogprobHead(tiny_arch("llama"), temperature=1.0, from_hidden=False).uses_hidden
