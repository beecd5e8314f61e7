"""FLOPs of a decoder-only transformer, counted from its config and the shapes it is fed, and the
square matmul peak (``pyppo profile``'s GFLOP, GFLOP/s and square MFU columns; the MFU at the
model's own shapes is :mod:`pyppo.profile.floors`').

What is counted (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1;
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM": for GPT blocks, dense attention and logits at every position this count gives
their ``72·B·s·l·h²·(1 + s/6h) + 6·B·s·h·V`` per training iteration, or ``96·B·s·l·h²·(1 + s/6h +
V/16lh)`` with the blocks recomputed): matrix products only, a multiply-add being 2 FLOPs —

* the blocks' weights: ``2 × P`` per position fed, ``P`` = :attr:`TransformerShape.matmul_params`
  (q, k, v, o projections with grouped-query ``k, v`` of ``kv_heads × head_dim`` columns, and the
  MLP: 3 matrices when gated as in Llama / Qwen2 / SmolLM2, else 2);
* attention: ``Q K^T`` and ``softmax · V``, each ``2 × head_dim`` per query head per scored
  query-key pair, in every layer: ``4 × layers × heads × head_dim × pairs`` (:func:`attention_pairs`);
* an output head: ``2 × in × out`` per position that computes it (the LM head ``[hidden, vocab]``
  or a value head ``[hidden, 1]``);
* LoRA adapters: ``2 × (r·in + out·r)`` per adapted matrix per position, while enabled.

Norms, rotary embeddings, softmax, activations, embedding lookups and the optimizer are not
counted; ``torch.utils.flop_counter.FlopCounterMode`` counts the same products, and
``tests/cli/test_profile.py`` checks the two agree on a tiny Llama and on SmolLM2.

Attention is counted causally by default: query ``i`` scores keys ``0..i`` of its own row, padding
included (the kernels compute padded positions too; it is work done, if not useful). Dense
attention kernels compute the whole square; ``causal=False`` counts that, which is what
FlopCounterMode reports for SDPA.

Backward (:func:`backward_flops`): the gradient of a product w.r.t. its input costs one forward,
and w.r.t. its weight one more: 2× the forward for trained weights, 1× for frozen ones (LoRA's
base weights pass the activation gradient only), always 2× for attention (two activation inputs).
With frozen embeddings (LoRA) the first block's ``q, k, v`` projections (and their adapters) need
no input gradient either; the count ignores that, an overcount of less than ``1 / (2 · layers)``
of the blocks' backward.
Recomputation (:func:`recompute_flops`: gradient checkpointing's second forward, the scores a
fused attention kernel recomputes, the logits ``linear_logprobs`` recomputes in its backward) is
kept apart: model FLOPs utilization (MFU) excludes it, hardware FLOPs utilization (HFU) includes
it, as PaLM defines them (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
appendix B).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, fields, replace
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

__all__ = [
    "TransformerShape",
    "UnsupportedConfig",
    "Flops",
    "transformer_shape",
    "check_against_model",
    "attention_pairs",
    "block_flops",
    "head_flops",
    "backward_flops",
    "recompute_flops",
    "generate_forwards",
    "measure_matmul_flops",
    "significant",
]

#: Config keys of a mixture-of-experts MLP, whose per-token work depends on the routing.
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


class UnsupportedConfig(ValueError):
    """The model's config (or its modules) do not fit the decoder-only transformer counted here;
    the message says why."""


@dataclass(frozen=True)
class TransformerShape:
    """The sizes the FLOP count needs (counts, not bytes).

    Attributes:
        layers: decoder blocks. hidden: model width. intermediate: MLP width.
        heads, kv_heads: query heads and key/value heads (grouped-query attention: ``kv_heads``
            divides ``heads``). head_dim: width of one head. vocab: LM head outputs.
        mlp_matrices: 3 for a gated MLP (gate, up, down), 2 for a plain one (up, down).
        model_type: the config's ``model_type``, for messages.
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp_matrices: int = 3
    model_type: str = "?"

    @property
    def layer_matmul_params(self) -> int:
        """Weights one block multiplies by: ``q, o`` are ``hidden × heads·head_dim``, ``k, v``
        ``hidden × kv_heads·head_dim``, the MLP ``mlp_matrices × hidden × intermediate``."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return attention + self.mlp_matrices * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Weights all blocks multiply by (embeddings and the LM head excluded)."""
        return self.layers * self.layer_matmul_params

    def describe(self) -> str:
        mlp = "gated MLP" if self.mlp_matrices == 3 else "MLP"
        return (
            f"{self.model_type}: {self.layers} layers, hidden {self.hidden}, {mlp} {self.intermediate}, "
            f"{self.heads} heads / {self.kv_heads} kv heads of {self.head_dim}, vocab {self.vocab}"
        )


def _int_attr(cfg: Any, name: str) -> Optional[int]:
    value = getattr(cfg, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def transformer_shape(config: Any) -> TransformerShape:
    """The :class:`TransformerShape` of a ``transformers`` causal LM's config, read from the usual
    names (``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: the heads), ``head_dim`` (default: hidden / heads),
    ``vocab_size``); the MLP is taken to be gated (:func:`check_against_model` corrects that
    from the modules).

    Raises:
        UnsupportedConfig: a name is missing or not an int, the head counts do not divide, or the
            MLP is a mixture of experts.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(cfg, "model_type", None) or type(cfg).__name__)
    names = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [n for n in names if _int_attr(cfg, n) is None]
    if missing:
        raise UnsupportedConfig(f"{model_type} config has no integer {', '.join(missing)}")
    moe = [k for k in _MOE_KEYS if getattr(cfg, k, None)]
    if moe:
        raise UnsupportedConfig(f"{model_type} config has a mixture-of-experts MLP ({', '.join(moe)})")
    heads, hidden = _int_attr(cfg, "num_attention_heads"), _int_attr(cfg, "hidden_size")
    kv_heads = _int_attr(cfg, "num_key_value_heads") or heads
    head_dim = _int_attr(cfg, "head_dim") or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None or heads % kv_heads:
        raise UnsupportedConfig(
            f"{model_type} config: {heads} heads, {kv_heads} kv heads, hidden {hidden} do not give a head width"
        )
    return TransformerShape(
        layers=_int_attr(cfg, "num_hidden_layers"),
        hidden=hidden,
        intermediate=_int_attr(cfg, "intermediate_size"),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=_int_attr(cfg, "vocab_size"),
        model_type=model_type,
    )


def _matmul_weights(module: nn.Module) -> int:
    """Elements of the matmul weights under ``module``: ``nn.Linear`` (and GPT-2's ``Conv1D``,
    a linear map too), LoRA adapters excluded (counted apart, while enabled)."""
    total = 0
    for name, m in module.named_modules():
        if "lora_" in name:
            continue
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            total += m.weight.numel()
    return total


def check_against_model(shape: TransformerShape, model: nn.Module) -> TransformerShape:
    """``shape`` checked against ``model``'s decoder blocks (the ``nn.ModuleList`` of
    ``shape.layers`` modules): their matmul weights must be what ``shape`` multiplies by, with a
    gated or a plain MLP. Returns ``shape`` with ``mlp_matrices`` as found.

    Raises:
        UnsupportedConfig: no such block list, or weights the config does not account for (fused
            or extra projections of other sizes, experts, cross-attention, ...).
    """
    blocks = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == shape.layers), None)
    if blocks is None:
        raise UnsupportedConfig(
            f"{shape.model_type}: no list of {shape.layers} decoder blocks in {type(model).__name__}"
        )
    per_layer = {_matmul_weights(block) for block in blocks}
    for matrices in (shape.mlp_matrices, 5 - shape.mlp_matrices):
        candidate = replace(shape, mlp_matrices=matrices)
        if per_layer == {candidate.layer_matmul_params}:
            return candidate
    raise UnsupportedConfig(
        f"{shape.model_type}: the blocks multiply by {sorted(per_layer)} weights each, the config implies "
        f"{replace(shape, mlp_matrices=3).layer_matmul_params} (gated MLP) or "
        f"{replace(shape, mlp_matrices=2).layer_matmul_params} (plain MLP)"
    )


@dataclass(frozen=True)
class Flops:
    """FLOPs by kind (ints): ``dense`` (the blocks' weights), ``attention`` (scores and values),
    ``head`` (output heads), ``adapters`` (LoRA). Add with ``+``, scale with ``*``."""

    dense: int = 0
    attention: int = 0
    head: int = 0
    adapters: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.attention + self.head + self.adapters

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, k: int) -> "Flops":
        return Flops(*(getattr(self, f.name) * k for f in fields(self)))

    __rmul__ = __mul__


def attention_pairs(q_len: int, kv_len: int, *, causal: bool = True) -> int:
    """Query-key pairs one row scores when its last ``q_len`` positions attend over ``kv_len`` keys
    (``kv_len - q_len`` cached, then the queries themselves). A prefill has ``q_len == kv_len``, a
    decode step ``q_len == 1``.

    Causal: the ``j``-th new query (0-based) scores ``kv_len - q_len + j + 1`` keys, so the sum is
    ``q_len · (kv_len - q_len) + q_len · (q_len + 1) / 2``. Dense (``causal=False``): ``q_len · kv_len``.

    Raises:
        ValueError: ``q_len > kv_len`` or a negative length.
    """
    if q_len < 0 or kv_len < q_len:
        raise ValueError(f"attention_pairs: need 0 <= q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")
    if not causal:
        return q_len * kv_len
    return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2


def block_flops(
    shape: TransformerShape, *, batch: int, q_len: int, kv_len: int, adapter_params: int = 0, causal: bool = True
) -> Flops:
    """Forward FLOPs of the decoder blocks on ``[batch, q_len]`` new positions attending over
    ``kv_len`` keys per row (see :func:`attention_pairs`).

    ``dense = 2 · batch · q_len · shape.matmul_params``;
    ``attention = 4 · layers · heads · head_dim · batch · pairs`` (Narayanan et al. 2021's
    ``4·b·s²·h`` per layer, with ``h = heads · head_dim`` and the pairs actually scored);
    ``adapters = 2 · batch · q_len · adapter_params`` (``adapter_params``: the enabled LoRA ``A``
    and ``B`` elements of all blocks).
    """
    positions = batch * q_len
    return Flops(
        dense=2 * positions * shape.matmul_params,
        attention=4
        * shape.layers
        * shape.heads
        * shape.head_dim
        * batch
        * attention_pairs(q_len, kv_len, causal=causal),
        adapters=2 * positions * adapter_params,
    )


def head_flops(positions: int, in_features: int, out_features: int) -> Flops:
    """Forward FLOPs of an output head ``[in_features, out_features]`` (``[hidden, vocab]`` for an
    LM head, ``[hidden, 1]`` for a value head) on ``positions`` positions: ``2 · positions · in · out``."""
    return Flops(head=2 * positions * in_features * out_features)


def backward_flops(forward: Flops, *, weights_trained: bool, head_trained: bool) -> Flops:
    """Backward FLOPs of a forward that cost ``forward``: activation gradients (1× every product)
    plus weight gradients (1× more for the trained weights: the blocks' when ``weights_trained``,
    the head's when ``head_trained``, the adapters' always); attention 2× (both inputs are
    activations). Full fine-tuning: 2× the forward (Kaplan et al. 2020's ``6N`` per token in all)."""
    dense = 2 if weights_trained else 1
    head = 2 if head_trained else 1
    return Flops(
        dense=dense * forward.dense,
        attention=2 * forward.attention,
        head=head * forward.head,
        adapters=2 * forward.adapters,
    )


def recompute_flops(
    forward: Flops, shape: TransformerShape, positions: int, *, checkpointing: bool, scores_recomputed: bool
) -> Flops:
    """FLOPs a trained blocks forward of ``positions`` positions that cost ``forward`` runs again
    during its backward (hardware FLOPs: in HFU, not in MFU):

    * ``checkpointing`` (each block checkpointed): the block's forward again, less its last
      matmul, the MLP's down projection ``2 · positions · layers · hidden · intermediate``
      (``torch.utils.checkpoint``'s non-reentrant mode stops recomputing once the tensors the
      backward needs are rebuilt, and nothing needs the block's output);
    * ``scores_recomputed`` (a fused attention kernel: SDPA's flash / memory-efficient kernels,
      FlashAttention; not ``eager``): ``Q K^T`` again in the attention backward, half the
      forward's attention.

    Exact for full fine-tuning (``tests/cli/test_profile.py``); with LoRA and checkpointing the stopping
    point moves within the last adapted matmul, so the first item is approximate.
    """
    out = Flops()
    if checkpointing:
        last = 2 * positions * shape.layers * shape.hidden * shape.intermediate
        out += replace(forward, dense=forward.dense - last)
    if scores_recomputed:
        out += Flops(attention=forward.attention // 2)
    return out


def generate_forwards(batch: int, prompt_length: int, new_tokens: int) -> List[Tuple[int, int, int]]:
    """``(batch, q_len, kv_len)`` of each forward of KV-cached sampling of ``new_tokens`` tokens
    after a ``prompt_length``-position (padded) prompt: one prefill ``(batch, P, P)``, which
    yields the first token, then ``(batch, 1, P + t)`` for ``t = 1 … new_tokens - 1``. Rows that
    finished early are still computed (``transformers`` ``generate`` keeps them in the batch)."""
    if new_tokens <= 0:
        return []
    return [(batch, prompt_length, prompt_length)] + [(batch, 1, prompt_length + t) for t in range(1, new_tokens)]


def device_timer(device: torch.device):
    """Seconds of ``fn()`` run ``repeat`` times: CUDA events on a GPU, ``perf_counter`` on a CPU."""
    if device.type == "cuda":

        def cuda_time(fn, repeat: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3

        return cuda_time

    def cpu_time(fn, repeat: int) -> float:
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return time.perf_counter() - t0

    return cpu_time


def measure_matmul_flops(
    m: int,
    k: Optional[int] = None,
    n: Optional[int] = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    warmup: int = 3,
    iters: int = 7,
    max_seconds: float = 3.0,
) -> float:
    """Achieved FLOP/s of ``torch.mm`` of ``[m, k] × [k, n]`` (square ``m × m`` by default): the
    median of up to ``iters`` timed calls (at least 3; fewer than ``iters`` once ``max_seconds``
    of timed calls have passed) after ``warmup`` untimed ones, ``2·m·k·n`` FLOPs per call. On
    CUDA each call is timed with CUDA events (float32 follows ``torch.backends.cuda.matmul``'s
    TF32 setting, as the run's matmuls do); on CPU it runs on ``torch.get_num_threads()`` threads
    (the caller's setting). With the default 2048² float32, a measured peak of the device
    as a PyTorch user sees it (what PaLM's MFU divides by is the vendor's peak; on a CPU that is
    rarely reachable, so pyppo measures it).

    Returns:
        FLOP/s (float, > 0).
    """
    k = m if k is None else k
    n = m if n is None else n
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    timed = device_timer(device)

    def once() -> float:
        return timed(lambda: torch.mm(a, b, out=out), 1)

    for _ in range(warmup):
        once()
    times: List[float] = []
    for _ in range(max(3, iters)):
        times.append(once())
        if len(times) >= 3 and sum(times) > max_seconds:
            break
    return 2.0 * m * k * n / max(statistics.median(times), 1e-12)


def significant(x: Optional[float], digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, without an exponent."""
    if x is None:
        return "-"
    if x == 0 or not math.isfinite(x):
        return f"{x:.0f}" if x == 0 else str(x)
    return f"{x:.{max(0, digits - 1 - int(math.floor(math.log10(abs(x)))))}f}"
