"""What a profiled phase cannot go below on this machine: its matrix products at the rates
``torch.mm`` reaches at their own shapes (the compute floor, and the MFU taken against it), and,
for sampling, the bytes its forwards must read at the measured memory bandwidth (the byte floor).

Compute floor. :func:`phase_gemms` turns the model calls a :class:`~pyppo.profile.counting.ShapeRecorder`
saw into the matrix products they ran, by shape (:class:`GemmShape`), each with the FLOPs
:mod:`pyppo.profile.flops` counts for it (their sum is the count's, per phase and per forward,
backward and recomputed part; ``tests/cli/test_profile.py`` checks it on real steps):

* per decoder call of ``m = batch · q_len`` rows and per layer: the ``q`` projection
  ``[m, hidden] × [hidden, heads·head_dim]``, ``o`` ``[m, heads·head_dim] × [heads·head_dim,
  hidden]``, ``k`` and ``v``
  ``[m, hidden] × [hidden, kv_heads·head_dim]``, the MLP's gate and up ``[m, hidden] ×
  [hidden, intermediate]`` (no gate in a plain MLP) and down ``[m, intermediate] ×
  [intermediate, hidden]``; each LoRA adapter ``[m, in] × [in, r]`` then ``[m, r] × [r, out]``;
* attention, per layer: the scores ``Q K^T`` and the weighted values ``P V`` as batched products,
  ``torch.bmm`` of ``batch · heads`` products ``[q_len, head_dim] × [head_dim, kv_len]`` and
  ``[q_len, kv_len] × [kv_len, head_dim]``. They carry the causal FLOPs of the count (the pairs
  actually scored) but are timed at the full ``q_len × kv_len`` shape, as a dense kernel runs them;
* an output head ``[positions, in] × [in, out]``;
* backward, for a product ``[m, k] × [k, n]``: the gradient of its first operand
  ``[m, n] × [n, k]``, always, and of its second ``[k, m] × [m, n]`` where that is a trained
  weight (the blocks' when fully trained, the head's when trained, the adapters') or an
  activation (attention's keys and values); recomputation (gradient checkpointing, the scores a
  fused attention kernel recomputes, the logits of ``linear_logprobs``) apart, as HFU keeps it.

The ideal seconds of a set of products (:func:`ideal_seconds`) is the sum over its shapes of
``FLOPs / FLOP/s at that shape`` (:func:`measure_gemm_rates`: ``torch.mm`` / ``torch.bmm`` of
contiguous operands in the compute dtype, on the run's device and threads, each distinct shape
once). The phase's MFU is ``ideal seconds / phase seconds``: PaLM's model FLOPs utilization
(Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", appendix B) with the
peak taken per product, so that a phase made of skinny products (a decode step's ``[B, hidden]``
rows, an LM head of 49152 columns) is held to what the machine's matmul reaches at those shapes,
not to a square matrix's rate. Each product is timed alone, call after call: a weight that fits
in the caches (a block matrix of SmolLM2 in bfloat16: under 2 MB) is then read from cache, where
a decode step reads it from memory once a forward, so the compute floor is the compute side; the
byte floor is the memory side. (A weight larger than the caches, such as an LM head of 49152
rows, streams from memory in the timing too.)

Byte floor (:func:`generate_bytes`). Every forward of the generate phase reads the model's linear
weights (the blocks' matrices, the enabled adapters, the LM head) in the dtype its products read
(2 bytes under bfloat16 autocast, 4 in float32) and, in every layer, the keys and values of all
``kv_len`` positions of each row (``2 · layers · kv_heads · head_dim`` elements per position, in
the compute dtype). Those bytes over the read bandwidth (:func:`measure_read_bandwidth`) are the
seconds no sampler of this model can beat on this machine; the larger of the two floors is the
one that binds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional

import torch

from .flops import attention_pairs, device_timer

__all__ = [
    "GemmShape",
    "Products",
    "phase_gemms",
    "ideal_seconds",
    "measure_gemm_flops",
    "measure_gemm_rates",
    "measure_read_bandwidth",
    "generate_bytes",
    "READ_BANDWIDTH_METHOD",
]


class GemmShape(NamedTuple):
    """``[m, k] × [k, n]``; ``batch > 1``: ``batch`` such products at once (``torch.bmm``)."""

    batch: int
    m: int
    k: int
    n: int

    def describe(self) -> str:
        prod = f"[{self.m}x{self.k}]x[{self.k}x{self.n}]"
        return f"{self.batch} x {prod}" if self.batch > 1 else prod

    @property
    def flops(self) -> int:
        """FLOPs of one call at this shape: ``2 · batch · m · k · n`` (a multiply-add is 2)."""
        return 2 * self.batch * self.m * self.k * self.n


#: shape -> FLOPs done at that shape (ints)
Products = Dict[GemmShape, int]


@dataclass(frozen=True)
class _Product:
    shape: GemmShape
    flops: int  # the FLOPs the count gives this product (all layers, all calls)
    second_grad: bool  # its backward computes the second operand's gradient too
    role: str = ""  # "down" and "scores" are what recomputation picks out

    def backward(self) -> List["_Product"]:
        b, m, k, n = self.shape
        out = [_Product(GemmShape(b, m, n, k), self.flops, False)]  # d first = d out · second^T
        if self.second_grad:
            out.append(_Product(GemmShape(b, k, m, n), self.flops, False))  # d second = first^T · d out
        return out


def _add(into: Products, products: Iterable[_Product]) -> None:
    for p in products:
        into[p.shape] = into.get(p.shape, 0) + p.flops


def _block_products(call, model, *, causal: bool) -> List[_Product]:
    """The products of one decoder call (see the module docstring), with the FLOPs of each
    summed over the layers; their total is :func:`~pyppo.profile.flops.block_flops`'."""
    s, m, trained = model.shape, call.batch * call.q_len, model.weights_trained
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def dense(k: int, n: int, count: int = 1, role: str = "") -> _Product:
        return _Product(GemmShape(1, m, k, n), count * 2 * m * k * n * s.layers, trained, role)

    # Half of the causal count each: the scores and the weighted values score the same pairs.
    half = 2 * s.layers * s.heads * s.head_dim * call.batch * attention_pairs(call.q_len, call.kv_len, causal=causal)
    bh = call.batch * s.heads
    products = [
        dense(s.hidden, q_width),  # q
        dense(s.hidden, kv_width, 2),  # k, v
        dense(q_width, s.hidden),  # o
        dense(s.hidden, s.intermediate, s.mlp_matrices - 1),  # gate (if gated), up
        dense(s.intermediate, s.hidden, role="down"),
        _Product(GemmShape(bh, call.q_len, s.head_dim, call.kv_len), half, True, "scores"),  # Q K^T
        _Product(GemmShape(bh, call.q_len, call.kv_len, s.head_dim), half, True),  # P V
    ]
    if call.adapter_params:
        products += [_Product(GemmShape(1, m, k, n), 2 * m * k * n, True) for k, n in model.adapter_shapes]
    return [p for p in products if p.flops]


def phase_gemms(calls, models, *, checkpointing: bool = False, causal: bool = True) -> Dict[str, dict]:
    """The products of a step's model calls, per phase, as :func:`~pyppo.profile.counting.count_phases`
    counts them: ``{"forward": Products, "backward": Products, "recompute": Products,
    "omitted": set of model names}``. Every backward (and its recomputation) goes to ``update``;
    the calls of a model whose config is not understood are left out and named in ``omitted``.

    Args:
        calls: :class:`~pyppo.profile.counting.Call` s. models: name ->
            :class:`~pyppo.profile.counting.CountedModel`.
        checkpointing: each trained block's forward runs again in its backward, less its down
            projection (:func:`~pyppo.profile.flops.recompute_flops`).
        causal: attention's FLOPs counted over the causal pairs (as the count does).
    """
    out: Dict[str, dict] = {}

    def phase_row(phase: str) -> dict:
        return out.setdefault(phase, {"forward": {}, "backward": {}, "recompute": {}, "omitted": set()})

    for call in calls:
        row, model = phase_row(call.phase), models[call.model]
        if model.shape is None:
            row["omitted"].add(call.model)
            continue
        if call.kind == "blocks":
            products = _block_products(call, model, causal=causal)
            again = [p for p in products if p.role != "down"] if checkpointing else []
            if model.scores_recomputed:
                again += [p for p in products if p.role == "scores"]
        else:
            m, k, n = call.positions, call.in_features, call.out_features
            products = [_Product(GemmShape(1, m, k, n), 2 * m * k * n, model.head_trained)]
            again = products if call.recomputed else []
        _add(row["forward"], products)
        if call.grad:
            update = phase_row("update")
            _add(update["backward"], (g for p in products for g in p.backward()))
            _add(update["recompute"], again)
    return out


def ideal_seconds(products: Products, rates: Mapping[GemmShape, float]) -> float:
    """``Σ FLOPs / FLOP/s`` over ``products``' shapes: the seconds they take at the rates measured
    at their shapes (``rates``: :func:`measure_gemm_rates`)."""
    return sum(flops / rates[shape] for shape, flops in products.items())


def measure_gemm_flops(
    shape: GemmShape,
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    max_seconds: float = 0.2,
    samples: int = 7,
    min_sample_seconds: float = 1e-3,
) -> float:
    """Achieved FLOP/s of ``torch.mm`` of ``[m, k] × [k, n]`` (``torch.bmm`` when
    ``shape.batch > 1``), contiguous operands of ``dtype`` on ``device``, on this process's
    threads: the median of up to ``samples`` timed samples (at least 3; fewer once
    ``max_seconds`` of samples have passed), after two untimed calls. A sample repeats the call
    until it lasts ``min_sample_seconds``, so that a product of microseconds (a decode step's
    attention) is not timed below the clock's resolution; the per-call overheads stay in, as they
    are in the run. ``shape.flops`` FLOPs per call.

    Returns:
        FLOP/s (float, > 0).
    """
    device = torch.device(device)
    b, m, k, n = shape
    # Constant operands: the rate of a GEMM does not depend on finite values, and torch's global
    # generator, which the run's sampling draws from, is left alone.
    dims = (lambda r, c: (b, r, c)) if b > 1 else (lambda r, c: (r, c))
    x = torch.full(dims(m, k), 0.5, dtype=dtype, device=device)
    w = torch.full(dims(k, n), 0.25, dtype=dtype, device=device)
    out = torch.empty(dims(m, n), dtype=dtype, device=device)
    mm = torch.bmm if b > 1 else torch.mm

    def call() -> None:
        mm(x, w, out=out)

    timed = device_timer(device)
    first = timed(call, 1)
    timed(call, 1)
    repeat = max(1, min(10_000, int(min_sample_seconds / max(first, 1e-9)) + 1))
    times: List[float] = []
    while len(times) < max(3, samples):
        times.append(timed(call, repeat) / repeat)
        if len(times) >= 3 and sum(times) * repeat > max_seconds:
            break
    return shape.flops / max(statistics.median(times), 1e-12)


def measure_gemm_rates(
    shapes: Iterable[GemmShape], *, dtype: torch.dtype, device: Any, max_seconds: float = 0.2
) -> Dict[GemmShape, float]:
    """FLOP/s at each distinct shape of ``shapes`` (:func:`measure_gemm_flops`, each measured
    once, ``max_seconds`` of samples at most per shape), largest products first."""
    distinct = sorted(set(shapes), key=lambda s: -s.flops)
    return {s: measure_gemm_flops(s, dtype=dtype, device=device, max_seconds=max_seconds) for s in distinct}


#: How :func:`measure_read_bandwidth` measures, for the notes and profile.json.
READ_BANDWIDTH_METHOD = "torch.sum of a 256 MiB float32 tensor, bytes read, median of 5"


def measure_read_bandwidth(device: Any = "cpu", nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second read from memory by ``torch.sum`` of an ``nbytes`` float32 tensor (far
    larger than the caches; the sum is read-bound: one add per 4 bytes read), on this process's
    threads: the median of ``repeats`` timed sums after an untimed one. The rate at which a
    decode step can stream the weights it reads.

    Returns:
        bytes / s (float, > 0).
    """
    device = torch.device(device)
    x = torch.full((nbytes // 4,), 1.0, dtype=torch.float32, device=device)
    timed = device_timer(device)

    def read() -> None:
        x.sum()

    timed(read, 1)
    seconds = statistics.median(timed(read, 1) for _ in range(repeats))
    return x.numel() * 4 / max(seconds, 1e-12)


def generate_bytes(calls, models, element_size: int) -> Optional[dict]:
    """Bytes the generate phase's forwards must read from memory (see the module docstring):
    ``{"weights": ..., "kv_cache": ..., "total": ..., "forwards": decoder calls,
    "weights_per_forward": weights / forwards, "element_size": ...}`` (bytes), ``None`` when the
    phase has no call or one of its models is not understood.

    Args:
        calls: the step's :class:`~pyppo.profile.counting.Call` s (only ``generate``'s are read).
        models: name -> :class:`~pyppo.profile.counting.CountedModel`.
        element_size: bytes per weight and per cached key or value element as the products read
            them: 2 under bfloat16 autocast, 4 in float32.
    """
    weights = kv = forwards = 0
    for call in calls:
        if call.phase != "generate":
            continue
        model = models[call.model]
        if model.shape is None:
            return None
        if call.kind == "blocks":
            s = model.shape
            read = (s.matmul_params + call.adapter_params) * element_size
            kv += 2 * s.layers * s.kv_heads * s.head_dim * call.batch * call.kv_len * element_size
            forwards += 1
        else:
            read = call.in_features * call.out_features * element_size
        weights += read
    if not forwards:
        return None
    return {
        "weights": weights,
        "kv_cache": kv,
        "total": weights + kv,
        "forwards": forwards,
        "weights_per_forward": weights // forwards,
        "element_size": element_size,
    }
