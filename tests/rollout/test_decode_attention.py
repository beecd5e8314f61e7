"""The decode steps' float32 attention under a CPU's bf16 autocast: one query position attends in
float32, everything else is autocast's own call bit for bit, and generate's prefill is unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pyppo.rollout.hf_generate as hf
from pyppo.config import PPOConfig
from pyppo.rollout.decode_attention import decode_attention_cache, float32_decode_attention
from support.tiny_models import tiny_causal_lm


def _qkv(q_len, kv_len=7, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 6, q_len, 8, generator=g).to(dtype)
    k = torch.randn(3, 2, kv_len, 8, generator=g).to(dtype)
    v = torch.randn(3, 2, kv_len, 8, generator=g).to(dtype)
    mask = torch.rand(3, 1, q_len, kv_len, generator=g) > 0.3
    mask[..., -1] = True  # every query sees a key
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_query_position_attends_in_float32_and_returns_the_autocast_dtype(dtype):
    q, k, v, mask = _qkv(1, dtype=torch.float32)
    v = v.to(dtype)  # the cache's values as v_proj gives them under autocast
    with torch.autocast("cpu", dtype=dtype), float32_decode_attention():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out.dtype == dtype
    in_float32 = F.scaled_dot_product_attention(q, k, v.float(), attn_mask=mask, enable_gqa=True)
    assert torch.equal(out, in_float32.to(dtype))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=float(exact.abs().max()) * 2**-7)
    with torch.autocast("cpu", dtype=dtype):
        autocast_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    # autocast's own call rounds q and k to the low dtype first: a different result, as close
    assert (out.double() - autocast_out.double()).abs().max() < 0.05


def test_an_additive_float_mask_is_cast_with_the_query():
    q, k, v, mask = _qkv(1)
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
    with torch.autocast("cpu", dtype=torch.bfloat16), float32_decode_attention():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, expected.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("q_len, autocast_on", [(5, True), (1, False)])
def test_other_calls_are_autocasts_own_bit_for_bit(q_len, autocast_on):
    q, k, v, mask = _qkv(q_len)

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_on):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    plain = call()
    with float32_decode_attention():
        swapped = call()
    assert swapped.dtype == plain.dtype
    assert torch.equal(swapped, plain)


def test_the_real_attention_is_back_after_an_error():
    real = F.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="inside"):
        with float32_decode_attention():
            assert F.scaled_dot_product_attention is not real
            raise RuntimeError("inside")
    assert F.scaled_dot_product_attention is real


def _gen(max_new_tokens=6):
    gen = hf.generation_config(PPOConfig(max_new_tokens=max_new_tokens), eos_token_id=2, pad_token_id=2)
    gen.eos_token_id = None
    return gen


def test_the_cache_is_used_only_under_a_cpus_reduced_autocast():
    model, gen = tiny_causal_lm(), _gen()
    assert decode_attention_cache(model, gen, {}) is None  # float32: nothing to change
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = decode_attention_cache(model, gen, {})
        assert cache is not None
        assert decode_attention_cache(model, gen, {"past_key_values": object()}) is None  # the caller's cache
        gen.cache_implementation = "static"
        assert decode_attention_cache(model, gen, {}) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert decode_attention_cache(model, _gen(), {"cache_implementation": "static"}) is None
        assert decode_attention_cache(model, _gen(), {"use_cache": False}) is None
    k = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16)
    keys, values = cache.update(k, k, 0)
    assert keys.dtype == values.dtype == torch.float32 and torch.equal(values, k.float())


def _generate(model, ids, mask, gen, monkeypatch, new_path):
    if not new_path:
        monkeypatch.setattr(hf, "decode_attention_cache", lambda *a: None)
    torch.manual_seed(0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = hf.generate(model, ids, mask, gen, output_logits=True, return_dict_in_generate=True)
    monkeypatch.undo()
    return out


def test_generates_prefill_is_unchanged_and_its_decode_steps_as_close(monkeypatch):
    model, gen = tiny_causal_lm(), _gen()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 99, (4, 9), generator=g)
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[0, :4] = mask[2, :7] = False  # left padding
    ids[~mask] = 2
    old = _generate(model, ids, mask, gen, monkeypatch, new_path=False)
    new = _generate(model, ids, mask, gen, monkeypatch, new_path=True)
    assert torch.equal(old.logits[0], new.logits[0])  # the prefill's next-token logits
    # The same tokens continued by both paths: feed the new path's tokens to the old one.
    gen_old = _gen()
    gen_old.max_new_tokens = 1
    for step in range(1, len(new.logits)):
        prefix = new.sequences[:, : ids.shape[1] + step]
        pmask = torch.cat([mask, torch.ones(4, step, dtype=torch.bool)], 1)
        ref = _generate(model, prefix, pmask, gen_old, monkeypatch, new_path=False).logits[0]
        diff = (torch.log_softmax(new.logits[step].float(), -1) - torch.log_softmax(ref.float(), -1)).abs().max()
        assert float(diff) < 0.05, (step, float(diff))


def test_a_model_without_a_kv_cache_samples_as_before_under_bf16():
    # Mamba keeps a recurrent state (transformers' cache_params), not a KV cache.
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=32, state_size=4, num_hidden_layers=2)).eval()
    ids = torch.randint(4, 128, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert decode_attention_cache(model, _gen(), {}) is None
        out = hf.generate(model, ids, mask, _gen(3))
    assert out.shape == (2, 8)
