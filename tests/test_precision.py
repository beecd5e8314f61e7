"""Precision and memory knobs on tiny models: bfloat16 autocast with float32 master weights, the
exact first ratio and step-1 KL in every mode, and gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

from pyppo.precision import autocast, native_bf16, resolve_dtype
from pyppo.trainer.logprob_head import LogprobHead
from support.trainer_fixture import make_trainer, small_config


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_first_ratio_is_exactly_one_and_first_kl_exactly_zero(dtype, lora_rank):
    tr = make_trainer(small_config(steps=1, dtype=dtype, lora_rank=lora_rank))
    # `auto` is whatever this machine's CPU computes natively; the trainer keeps the answer.
    expected = dtype if dtype != "auto" else ("bfloat16" if native_bf16(torch.device("cpu"))[0] else "float32")
    assert tr.config.dtype == expected and tr.dtype == getattr(torch, expected)
    metrics, batch = tr.step()
    # The rollout pass and the first training pass ran the same computation, bit for bit.
    assert metrics["first_max_abs_logratio"] == 0.0 and metrics["first_ratio_max"] == 1.0
    # The reference is the initial policy (a copy, or the adapters disabled while B = 0).
    assert torch.equal(batch.old_logprobs, batch.ref_logprobs)
    assert metrics["kl_mean"] == 0.0
    assert metrics["policy_loss"] == metrics["policy_loss"]  # finite, not nan


def test_bfloat16_runs_the_forwards_in_bfloat16_and_keeps_float32_masters():
    tr = make_trainer(small_config(steps=1, dtype="bfloat16"))
    seen = set()
    layer = tr.policy.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    value_layer = tr.critic.model.backbone.layers[0].mlp.down_proj
    value_layer.register_forward_hook(lambda m, i, o: seen.add(("value", o.dtype)))
    metrics, batch = tr.step()
    assert seen == {torch.bfloat16, ("value", torch.bfloat16)}
    params = [p for m in (tr.policy, tr.critic.model) for p in m.parameters()]
    assert {p.dtype for p in params} == {torch.float32}
    states = [s for opt in (tr.policy_optimizer, tr.critic.optimizer) for s in opt.state.values()]
    assert states and {s["exp_avg"].dtype for s in states} == {torch.float32}
    # The per-token tensors the ops produce are float32 whatever the compute dtype.
    for name in ("old_logprobs", "ref_logprobs", "values", "advantages", "returns", "rewards"):
        assert getattr(batch, name).dtype == torch.float32, name


def test_bfloat16_logprobs_are_close_to_float32_but_not_equal():
    fp32, bf16 = (make_trainer(small_config(steps=1, dtype=d)) for d in ("float32", "bfloat16"))
    batch = fp32.rollout(["say something nice", "about 3"])
    mb = batch.select(torch.arange(2))
    with torch.no_grad():
        a = fp32.models.policy_module(mb)[0]
        with autocast(bf16.device, bf16.dtype):
            b = bf16.models.policy_module(mb)[0]
    assert not torch.equal(a, b)
    torch.testing.assert_close(b, a, atol=0.05, rtol=0)


def test_bfloat16_hidden_path_matches_the_sampled_logits_to_bfloat16_rounding():
    tr = make_trainer(small_config(steps=1, dtype="bfloat16"))
    mb = tr.rollout(["say something nice", "why"]).select(torch.arange(2))
    full = LogprobHead(tr.policy, temperature=1.0, from_hidden=False, dtype=torch.bfloat16)
    assert tr.models.policy_logprobs.uses_hidden and not full.uses_hidden
    with torch.no_grad(), autocast(tr.device, torch.bfloat16):
        hidden_path = tr.models.policy_logprobs(mb)[0]
        logits_path = full(mb)[0]  # log-softmax of the bf16 logits generate() samples from
    # The hidden-state path keeps the head's float32-accumulated logits unrounded.
    torch.testing.assert_close(hidden_path, logits_path, atol=2e-2, rtol=0)


def test_gradient_checkpointing_recomputes_the_blocks_and_gives_the_same_update():
    calls, trainers = {"plain": 0, "ckpt": 0}, {}
    for name in ("plain", "ckpt"):  # one after the other: each trainer seeds the global RNG
        trainers[name] = tr = make_trainer(small_config(steps=1, ppo_epochs=1, gradient_checkpointing=name == "ckpt"))
        # Inside the checkpointed block: runs again when the backward recomputes it (module hooks
        # do not fire during the recompute, so the forward itself is counted).
        mlp = tr.policy.model.layers[0].mlp
        mlp.forward = lambda *a, name=name, f=mlp.forward, **k: (calls.__setitem__(name, calls[name] + 1), f(*a, **k))[
            1
        ]
        tr.step()
    plain, ckpt = trainers["plain"], trainers["ckpt"]
    for model in (ckpt.policy.model, ckpt.critic.model.backbone):
        assert all(layer.gradient_checkpointing for layer in model.layers)
    # 8 sampling forwards (prefill + 7 decode steps), 4 no-grad rollout forwards (micro-batches
    # of 2 of 8 rows) and 4 training forwards; the checkpointed run recomputes the 4 training ones.
    assert calls == {"plain": 16, "ckpt": 20}
    for (name, a), (_, b) in zip(plain.policy.named_parameters(), ckpt.policy.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_gradient_checkpointing_on_a_model_without_it_is_refused():
    from pyppo.trainer.assemble import enable_gradient_checkpointing

    with pytest.raises(ValueError, match=r"gradient_checkpointing: the policy \(Linear\) does not support it"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2), "policy")


def _cpu_probes(monkeypatch, **flags):
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.setattr(torch.cpu, name, (lambda v: lambda: v)(flags.get(name, False)), raising=False)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({}, "float32"),
        ({"_is_avx512_bf16_supported": True}, "bfloat16"),
        ({"_is_amx_tile_supported": True}, "bfloat16"),
    ],
)
def test_auto_is_bfloat16_only_where_the_cpu_multiplies_it_natively(monkeypatch, flags, expected):
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    _cpu_probes(monkeypatch, **flags)
    name, why = resolve_dtype("auto", torch.device("cpu"))
    assert name == expected and why
    # An explicit dtype is never second-guessed.
    assert resolve_dtype("float32", torch.device("cpu")) == ("float32", "")
    assert resolve_dtype("bfloat16", torch.device("cpu")) == ("bfloat16", "")
    assert small_config(dtype="auto").torch_dtype == getattr(torch, expected)


@pytest.mark.parametrize(
    "var, cap, expected",
    [
        ("ONEDNN_MAX_CPU_ISA", "AVX2", "float32"),
        ("ONEDNN_MAX_CPU_ISA", "avx512_core", "float32"),
        ("DNNL_MAX_CPU_ISA", "AVX2_VNNI", "float32"),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", "bfloat16"),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", "bfloat16"),
        ("ONEDNN_MAX_CPU_ISA", "ALL", "bfloat16"),
    ],
)
def test_auto_follows_a_onednn_isa_cap_below_the_bf16_instructions(monkeypatch, var, cap, expected):
    # How an AVX2-only machine is emulated on a newer one: oneDNN then emulates bf16.
    for other in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(var, cap)
    _cpu_probes(monkeypatch, _is_avx512_bf16_supported=True, _is_amx_tile_supported=True)
    name, why = resolve_dtype("auto", torch.device("cpu"))
    assert name == expected
    if expected == "float32":
        assert why == f"{var}={cap.upper()} keeps oneDNN from this CPU's bf16 instructions"


def test_auto_survives_a_torch_without_the_probes(monkeypatch):
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert resolve_dtype("auto", torch.device("cpu"))[0] == "float32"


def test_resolve_dtype_names_a_bad_value():
    with pytest.raises(ValueError, match="dtype must be 'auto', 'float32' or 'bfloat16', got 'float16'"):
        resolve_dtype("float16", torch.device("cpu"))
