"""The model work of a profiled step: every forward's shapes, recorded by hooks on the models
(:class:`ShapeRecorder`), counted as FLOPs per phase (:mod:`pyppo.profile.flops`) and as matrix
products by shape (:mod:`pyppo.profile.floors`); the machine measured around the step (the
square matmul peak, the rates at the step's product shapes, the read bandwidth); MFU / HFU (PaLM,
Chowdhery et al. 2022, appendix B) against the products' rates at their shapes and against the
square peak, the generate phase's compute and byte floors; and :func:`profile_step`, which runs
one step under :mod:`torch.profiler` and builds the table."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from ..trainer.step_stats import current_phase
from .floors import (
    READ_BANDWIDTH_METHOD,
    GemmShape,
    generate_bytes,
    ideal_seconds,
    measure_gemm_rates,
    measure_read_bandwidth,
    phase_gemms,
)
from .flops import (
    Flops,
    TransformerShape,
    UnsupportedConfig,
    backward_flops,
    block_flops,
    check_against_model,
    head_flops,
    measure_matmul_flops,
    recompute_flops,
    transformer_shape,
)
from .phases import phase_table

__all__ = [
    "ShapeRecorder",
    "count_phases",
    "flop_table",
    "generate_floors",
    "measure_peak",
    "profile_step",
    "square_peaks",
    "step_shapes",
]

# ---------------------------------------------------------------------------------------------
# FLOPs, MFU and tokens

#: The phases whose work is model forwards (and, in the update, backwards).
MODEL_PHASES = ("generate", "policy_forward", "ref_forward", "value_forward", "update")
# A model phase that took longer than this with no call seen by the hooks gets a note: its model
# was called some way the hooks miss (a compiled or custom sampler), not merely skipped.
_UNSEEN_PHASE_SECONDS = 1e-3


@dataclass(frozen=True)
class Call:
    """One model call of a step. ``kind == "blocks"``: a model's decoder on ``[batch, q_len]`` new
    positions attending over ``kv_len`` keys per row, with ``adapter_params`` LoRA weights enabled.
    ``kind == "head"``: an output head ``[in_features, out_features]`` on ``positions`` positions;
    ``recomputed``: its backward recomputes it (``linear_logprobs``). ``grad``: a backward follows."""

    phase: str
    model: str
    kind: str
    batch: int = 0
    q_len: int = 0
    kv_len: int = 0
    positions: int = 0
    in_features: int = 0
    out_features: int = 0
    grad: bool = False
    adapter_params: int = 0
    recomputed: bool = False


@dataclass
class CountedModel:
    """A model of the step as the count sees it: its shape (``None`` with a ``note`` when its
    config is not understood), which weights train, its LoRA layers and its head's size."""

    name: str
    shape: Optional[TransformerShape]
    note: Optional[str]
    weights_trained: bool
    head_trained: bool
    head_size: Tuple[int, int]  # (in_features, out_features); (0, 0) = no head
    lora_layers: List[nn.Module] = field(default_factory=list)
    adapter_params: int = 0  # LoRA A and B elements of all blocks, while enabled
    adapter_shapes: List[Tuple[int, int]] = field(default_factory=list)  # (in, out) of each A and B
    scores_recomputed: bool = True  # a fused attention kernel: not transformers' "eager" attention

    def enabled_adapter_params(self) -> int:
        # peft disables (or merges) every adapter layer of a model at once, so one tells for all
        first = self.lora_layers[0] if self.lora_layers else None
        if first is None or getattr(first, "disable_adapters", False) or getattr(first, "merged", False):
            return 0
        return self.adapter_params


def _unwrap_peft(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _lora_layers(module: nn.Module) -> Tuple[List[nn.Module], List[Tuple[int, int]]]:
    """peft's LoRA layers under ``module`` and the ``(in, out)`` of each active adapter's ``A``
    (``in → r``) and ``B`` (``r → out``), both ``nn.Linear``."""
    layers, shapes = [], []
    for m in module.modules():
        a, b = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
        if isinstance(a, nn.ModuleDict) and isinstance(b, nn.ModuleDict) and len(a):
            layers.append(m)
            for name in getattr(m, "active_adapters", list(a)):
                if name in a and name in b:
                    shapes += [tuple(reversed(a[name].weight.shape)), tuple(reversed(b[name].weight.shape))]
    return layers, shapes


def _counted_model(name: str, config, body: nn.Module, head: Optional[nn.Module]) -> CountedModel:
    """``body``: the module holding the decoder blocks (peft unwrapped)."""
    try:
        shape, note = check_against_model(transformer_shape(config), body), None
    except UnsupportedConfig as exc:
        shape, note = None, str(exc)
    weight = getattr(head, "weight", None)
    layers, adapter_shapes = _lora_layers(body)
    return CountedModel(
        name=name,
        shape=shape,
        note=note,
        weights_trained=any(p.requires_grad for n, p in body.named_parameters() if "lora_" not in n),
        head_trained=bool(weight is not None and weight.requires_grad),
        head_size=(int(weight.shape[1]), int(weight.shape[0])) if isinstance(weight, torch.Tensor) else (0, 0),
        lora_layers=layers,
        adapter_params=sum(k * n for k, n in adapter_shapes),
        adapter_shapes=adapter_shapes,
        scores_recomputed=getattr(config, "_attn_implementation", None) != "eager",
    )


def _decoder(model: nn.Module) -> Optional[nn.Module]:
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


class ShapeRecorder:
    """Forward pre-hooks that note, as :class:`Call` s, what each model of a step was fed, by phase
    (:func:`pyppo.trainer.step_stats.current_phase`): the decoder of the policy, of the reference and of the
    value model (batch, new positions, keys from the attention mask or the KV cache), the LM and
    value heads (positions), and the trainer's ``LogprobHead`` s, whose hidden-state path feeds
    the LM head's weight to ``linear_logprobs`` directly (``b × T`` response positions). Hooks
    read shapes only: no device sync, no copy. Use as a context manager around the step.

    Attributes:
        calls: the :class:`Call` s recorded so far.
        models: name -> :class:`CountedModel`, for ``"policy"``, ``"reference"`` (its own model;
            with LoRA the reference is the policy with its adapters disabled, so its calls are the
            policy's) and ``"value"``.
    """

    def __init__(self, trainer):
        self.calls: List[Call] = []
        self.models: Dict[str, CountedModel] = {}
        self._targets: list = []  # (module, hook, with_kwargs)
        self._handles: list = []
        models = trainer.models
        self._add_lm("policy", models.policy, models.policy_logprobs)
        if models.reference is not None:
            ref_head = models.ref_logprobs if isinstance(models.ref_logprobs, nn.Module) else None
            self._add_lm("reference", models.reference, ref_head)
        if models.critic is not None:
            self._add_value(models.critic.model)

    def _add_lm(self, name: str, model: nn.Module, logprob_head: Optional[nn.Module]) -> None:
        base = _unwrap_peft(model)
        decoder = _decoder(base)
        get_head = getattr(base, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        counted = _counted_model(name, base.config, base, head)
        if decoder is None and counted.note is None:
            counted.shape, counted.note = None, f"{type(base).__name__} has no get_decoder(): its calls cannot be seen"
        self.models[name] = counted
        if decoder is not None:
            self._targets.append((decoder, partial(self._on_blocks, name), True))
        if isinstance(head, nn.Module):
            self._targets.append((head, partial(self._on_head, name), False))
            if logprob_head is not None:
                self._targets.append((logprob_head, partial(self._on_logprob_head, name, head), True))

    def _add_value(self, value_model: nn.Module) -> None:
        backbone = getattr(value_model, "backbone", None)
        head = getattr(value_model, "head", None)
        if not isinstance(backbone, nn.Module):
            self.models["value"] = CountedModel(
                "value",
                None,
                f"{type(value_model).__name__} has no .backbone (not a pyppo ValueModel): not counted",
                False,
                False,
                (0, 0),
            )
            return
        body = _unwrap_peft(backbone)
        config = getattr(value_model, "config", None) or getattr(body, "config", None)
        self.models["value"] = _counted_model("value", config, body, head)
        self._targets.append((backbone, partial(self._on_blocks, "value"), True))  # what ValueModel calls
        if isinstance(head, nn.Module):
            self._targets.append((head, partial(self._on_head, "value"), False))

    def __enter__(self) -> "ShapeRecorder":
        self._handles = [module.register_forward_pre_hook(hook, with_kwargs=kw) for module, hook, kw in self._targets]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_blocks(self, name, module, args, kwargs) -> None:
        phase = current_phase()
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        if phase is None or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return
        b, q = int(x.shape[0]), int(x.shape[1])
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] >= q:
            kv = int(mask.shape[1])  # generate's mask covers the cached positions too
        else:
            cache = kwargs.get("past_key_values", kwargs.get("cache"))
            kv = q + (int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0)
        self.calls.append(
            Call(
                phase,
                name,
                "blocks",
                batch=b,
                q_len=q,
                kv_len=kv,
                grad=torch.is_grad_enabled(),
                adapter_params=self.models[name].enabled_adapter_params(),
            )
        )

    def _on_head(self, name, module, args) -> None:
        phase = current_phase()
        x = args[0] if args else None
        if phase is None or not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.shape[-1]:
            return
        out_features, in_features = module.weight.shape
        self.calls.append(
            Call(
                phase,
                name,
                "head",
                positions=x.numel() // x.shape[-1],
                in_features=int(in_features),
                out_features=int(out_features),
                grad=torch.is_grad_enabled(),
            )
        )

    def _on_logprob_head(self, name, head, module, args, kwargs) -> None:
        phase = current_phase()
        mb = args[0] if args else kwargs.get("mb")
        if phase is None or mb is None or kwargs.get("sample") is not None or not getattr(module, "uses_hidden", False):
            return
        # linear_logprobs recomputes the logits in its backward; a fused loss computes the head's
        # gradients in its forward instead: the same products, none twice.
        fused = bool(getattr(kwargs.get("objective"), "fused", False))
        out_features, in_features = head.weight.shape
        self.calls.append(
            Call(
                phase,
                name,
                "head",
                positions=len(mb) * mb.response_length,
                in_features=int(in_features),
                out_features=int(out_features),
                grad=torch.is_grad_enabled(),
                recomputed=not fused,
            )
        )


def count_phases(
    calls: List[Call], models: Dict[str, CountedModel], *, checkpointing: bool = False, causal: bool = True
) -> Dict[str, dict]:
    """Per phase: ``forward``, ``backward`` (all in ``update``, where every backward runs) and
    ``recompute`` :class:`~pyppo.profile.flops.Flops`
    (recompute: :func:`~pyppo.profile.flops.recompute_flops` of the trained blocks, and the logits
    ``linear_logprobs`` recomputes in its backward), ``omitted`` (the models whose config is not understood; the
    phase's FLOPs are then unknown), ``positions`` (name -> positions fed to that model's
    decoder), ``forwards`` (decoder calls), ``prefill`` (positions of calls without cached keys)
    and ``sampled`` (rows of all decoder calls, which in ``generate`` is one token each)."""
    out: Dict[str, dict] = {}

    def phase_row(phase: str) -> dict:
        return out.setdefault(
            phase,
            {
                "forward": Flops(),
                "backward": Flops(),
                "recompute": Flops(),
                "omitted": set(),
                "positions": {},
                "forwards": 0,
                "prefill": 0,
                "sampled": 0,
            },
        )

    for call in calls:
        row = phase_row(call.phase)
        model = models[call.model]
        if call.kind == "blocks":
            row["positions"][call.model] = row["positions"].get(call.model, 0) + call.batch * call.q_len
            row["forwards"] += 1
            row["sampled"] += call.batch
            if call.kv_len == call.q_len:
                row["prefill"] += call.batch * call.q_len
        if model.shape is None:
            row["omitted"].add(call.model)
            continue
        if call.kind == "blocks":
            fwd = block_flops(
                model.shape,
                batch=call.batch,
                q_len=call.q_len,
                kv_len=call.kv_len,
                adapter_params=call.adapter_params,
                causal=causal,
            )
            bwd = backward_flops(fwd, weights_trained=model.weights_trained, head_trained=False)
            again = recompute_flops(
                fwd,
                model.shape,
                call.batch * call.q_len,
                checkpointing=checkpointing,
                scores_recomputed=model.scores_recomputed,
            )
        else:
            fwd = head_flops(call.positions, call.in_features, call.out_features)
            bwd = backward_flops(fwd, weights_trained=False, head_trained=model.head_trained)
            again = fwd if call.recomputed else Flops()
        row["forward"] += fwd
        if call.grad:
            # Every backward runs in the update, also that of the policy forward done with grad in
            # the rollout's forwards (the first micro-batch's, which the first update pass reuses).
            phase_row("update")["backward"] += bwd
            phase_row("update")["recompute"] += again
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def square_peaks(trainer, size: int = 2048) -> Dict[str, float]:
    """FLOP/s of ``torch.mm`` on ``size²`` matrices on the trainer's device and this process's
    threads: float32, and the compute dtype when it is another (e.g. bfloat16: under autocast the
    matmuls run in it). Keyed by dtype name."""
    device, dtype = trainer.device, trainer.dtype
    peaks = {"float32": measure_matmul_flops(size, device=device)}
    if dtype != torch.float32:
        peaks[_dtype_name(dtype)] = measure_matmul_flops(size, dtype=dtype, device=device)
    return peaks


def step_shapes(recorder: ShapeRecorder, checkpointing: bool = False) -> Set[GemmShape]:
    """The distinct product shapes of the step the ``recorder`` saw, forward, backward and
    recomputed (:func:`~pyppo.profile.floors.phase_gemms`)."""
    gemms = phase_gemms(recorder.calls, recorder.models, checkpointing=checkpointing)
    return {shape for g in gemms.values() for part in ("forward", "backward", "recompute") for shape in g[part]}


def measure_peak(
    trainer,
    shapes: Iterable[GemmShape] = (),
    size: int = 2048,
    before: Optional[Dict[str, float]] = None,
    shape_seconds: float = 0.2,
) -> dict:
    """What the MFU columns and the floors divide by, measured on the trainer's device and this
    process's threads, in this order after the step:

    * the square peak: :func:`square_peaks` now and, given, ``before`` (the same measured before
      the step), keeping the higher of the two: on a shared machine the other load changes while
      the step runs, and a peak taken in a busier moment than the step's would overstate the MFU;
    * ``shapes``: FLOP/s of ``torch.mm`` / ``torch.bmm`` at each distinct product shape of the
      step in the compute dtype (:func:`~pyppo.profile.floors.measure_gemm_rates`, at most
      ``shape_seconds`` of samples each), after the step only: the shapes are known once it has
      run (the prompt and response lengths change from step to step);
    * ``bandwidth``: :func:`~pyppo.profile.floors.measure_read_bandwidth`.

    Returns ``{"size", "dtype", "flops_per_s" (the square peak of the compute dtype), "by_dtype",
    "before_step", "after_step", "threads", "device", "shapes": [{"batch", "m", "k", "n",
    "flops_per_s"}, ...], "shape_max_seconds", "bandwidth": {"bytes_per_s", "method"},
    "seconds": {"square", "shapes", "bandwidth"}}`` (FLOP/s, bytes/s; seconds each measurement
    took after the step)."""
    device, dtype = trainer.device, trainer.dtype
    t0 = time.perf_counter()
    after = square_peaks(trainer, size)
    t1 = time.perf_counter()
    rates = measure_gemm_rates(shapes, dtype=dtype, device=device, max_seconds=shape_seconds)
    t2 = time.perf_counter()
    bandwidth = measure_read_bandwidth(device)
    t3 = time.perf_counter()
    by_dtype = {k: max(v, (before or {}).get(k, 0.0)) for k, v in after.items()}
    return {
        "size": size,
        "dtype": _dtype_name(dtype),
        "flops_per_s": by_dtype[_dtype_name(dtype)],
        "by_dtype": by_dtype,
        "before_step": before,
        "after_step": after,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "shapes": [{**shape._asdict(), "flops_per_s": fps} for shape, fps in rates.items()],
        "shape_max_seconds": shape_seconds,
        "bandwidth": {"bytes_per_s": bandwidth, "method": READ_BANDWIDTH_METHOD},
        "seconds": {"square": t1 - t0, "shapes": t2 - t1, "bandwidth": t3 - t2},
    }


def _ratio(num, den):
    return num / den if num is not None and den else None


def _shape_rates(peak: Optional[dict]) -> Optional[Dict[GemmShape, float]]:
    if not peak or "shapes" not in peak:
        return None
    return {GemmShape(s["batch"], s["m"], s["k"], s["n"]): s["flops_per_s"] for s in peak["shapes"]}


def _ideal(gemms: Optional[dict], rates: Optional[Dict[GemmShape, float]]) -> Tuple[Optional[float], Optional[float]]:
    """(model, recomputed) ideal seconds of a phase's products; ``None`` s without rates."""
    if gemms is None or rates is None or gemms["omitted"]:
        return None, None
    model = ideal_seconds(gemms["forward"], rates) + ideal_seconds(gemms["backward"], rates)
    return model, ideal_seconds(gemms["recompute"], rates)


def generate_floors(seconds: float, ideal: Optional[float], read: Optional[dict], bandwidth: Optional[float]) -> dict:
    """The generate phase against its two floors: ``compute_floor_seconds`` (``ideal``, its
    products at their shapes' rates), ``byte_floor_seconds`` (``read["total"]`` bytes, from
    :func:`~pyppo.profile.floors.generate_bytes`, over ``bandwidth`` bytes/s), the phase's
    ``seconds`` over each, and ``bound``: ``"compute"`` or ``"memory"``, the larger floor (``None``
    where a floor is unknown)."""
    byte_floor = _ratio(read["total"], bandwidth) if read else None
    bound = None
    if ideal is not None and byte_floor is not None:
        bound = "compute" if ideal >= byte_floor else "memory"
    return {
        "seconds": seconds,
        "compute_floor_seconds": ideal,
        "byte_floor_seconds": byte_floor,
        "time_over_compute_floor": _ratio(seconds, ideal),
        "time_over_byte_floor": _ratio(seconds, byte_floor),
        "bound": bound,
        "bytes": read,
        "bandwidth_bytes_per_s": bandwidth,
    }


def flop_table(trainer, batch, recorder: ShapeRecorder, table: dict, peak: Optional[dict]) -> dict:
    """The FLOP, MFU and token columns of :func:`phase_table`'s ``table`` (its rows are updated in
    place) and the step's totals. Each row gains ``flops`` (model FLOPs: forward + backward),
    ``forward_flops``, ``backward_flops``, ``recompute_flops``, ``flops_per_s``,
    ``ideal_seconds`` (its model FLOPs at the rates ``peak["shapes"]`` measured at their shapes:
    :func:`~pyppo.profile.floors.ideal_seconds`), ``recompute_ideal_seconds``, ``mfu`` (``ideal
    seconds / seconds``), ``hfu`` (the same with the recomputed products), ``square_mfu`` and
    ``square_hfu`` (FLOP/s over ``peak["flops_per_s"]``, the square peak), ``tokens``,
    ``padding_tokens`` and ``tokens_per_s``; ``generate`` also ``prefill_tokens``,
    ``prefill_padding_tokens``, ``decode_forwards``, ``bytes_read`` and ``byte_floor_seconds``
    (:func:`generate_floors`). ``None`` where unknown or not applicable. Returns ``{"step": ...,
    "peak": peak, "floors": {"generate": ...}, "models": ..., "notes": [...]}``."""
    c, models = trainer.config, recorder.models
    counted = count_phases(recorder.calls, models, checkpointing=c.gradient_checkpointing)
    gemms = phase_gemms(recorder.calls, models, checkpointing=c.gradient_checkpointing)
    peak_fps = peak["flops_per_s"] if peak else None
    rates = _shape_rates(peak)
    bandwidth = ((peak or {}).get("bandwidth") or {}).get("bytes_per_s")
    real_prompt, real_response = int(batch.query_mask.sum()), int(batch.response_mask.sum())
    sampled_total = None
    total = recompute_total = ideal_total = again_total = 0
    known = True
    floors = {}
    for row in table["phases"]:
        phase, seconds = row["phase"], row["seconds"]
        n = counted.get(phase)
        cols = dict.fromkeys(
            (
                "flops",
                "forward_flops",
                "backward_flops",
                "recompute_flops",
                "flops_per_s",
                "ideal_seconds",
                "recompute_ideal_seconds",
                "mfu",
                "hfu",
                "square_mfu",
                "square_hfu",
                "tokens",
                "padding_tokens",
                "tokens_per_s",
            )
        )
        if n is not None:
            flops = None if n["omitted"] else n["forward"].total + n["backward"].total
            recompute = None if n["omitted"] else n["recompute"].total
            ideal, again = _ideal(gemms.get(phase), rates)
            if phase == "generate":
                tokens, padding = n["sampled"], n["sampled"] - real_response
                read = None if n["omitted"] else generate_bytes(recorder.calls, models, _element_size(trainer.dtype))
                floors["generate"] = generate_floors(seconds, ideal, read, bandwidth)
                cols.update(
                    prefill_tokens=n["prefill"],
                    prefill_padding_tokens=max(0, n["prefill"] - real_prompt),
                    decode_forwards=max(0, n["forwards"] - 1),
                    bytes_read=read["total"] if read else None,
                    byte_floor_seconds=floors["generate"]["byte_floor_seconds"],
                )
                sampled_total = (tokens, padding)
            else:
                passes = c.ppo_epochs if phase == "update" else 1
                tokens = max(n["positions"].values(), default=0)
                padding = max(0, tokens - passes * (real_prompt + real_response))
            cols.update(
                flops=flops,
                forward_flops=None if flops is None else n["forward"].total,
                backward_flops=None if flops is None else n["backward"].total,
                recompute_flops=recompute,
                flops_per_s=_ratio(flops, seconds),
                ideal_seconds=ideal,
                recompute_ideal_seconds=again,
                mfu=_ratio(ideal, seconds),
                hfu=None if ideal is None else _ratio(ideal + again, seconds),
                tokens=tokens,
                padding_tokens=padding,
                tokens_per_s=_ratio(tokens, seconds),
            )
            cols["square_mfu"] = _ratio(cols["flops_per_s"], peak_fps)
            cols["square_hfu"] = None if flops is None else _ratio(_ratio(flops + recompute, seconds), peak_fps)
            if flops is None:
                known = False
            else:
                total += flops
                recompute_total += recompute
                if ideal is not None:
                    ideal_total += ideal
                    again_total += again
        row.update(cols)
    step_s = table["step_seconds"]
    step_flops = total if known else None
    step_ideal = ideal_total if known and rates is not None else None
    tokens, padding = sampled_total or (None, None)
    step = {
        "flops": step_flops,
        "recompute_flops": recompute_total if known else None,
        "flops_per_s": _ratio(step_flops, step_s),
        "ideal_seconds": step_ideal,
        "recompute_ideal_seconds": again_total if step_ideal is not None else None,
        "mfu": _ratio(step_ideal, step_s),
        "hfu": None if step_ideal is None else _ratio(step_ideal + again_total, step_s),
        "tokens": tokens,
        "padding_tokens": padding,
        "tokens_per_s": _ratio(tokens, step_s),
    }
    step["square_mfu"] = _ratio(step["flops_per_s"], peak_fps)
    step["square_hfu"] = None if step_flops is None else _ratio(_ratio(step_flops + recompute_total, step_s), peak_fps)

    notes = [
        f"FLOPs/MFU omitted for the {m.name} model: its config is not understood ({m.note})"
        for m in models.values()
        if m.note
    ]
    notes += [
        f"{row['title']}: MFU above 100 %: the phase ran faster than its products at the rates measured at "
        "their shapes (other load on the machine changed between the measurement and the step, or the "
        "model's kernels beat torch.mm at those shapes?)"
        for row in table["phases"]
        if (row.get("mfu") or 0) > 1
    ]
    notes += [
        f"{row['title']}: the hooks saw no model call in its {1e3 * row['seconds']:.1f} ms, so none is counted"
        for row in table["phases"]
        if row["phase"] in MODEL_PHASES and row["phase"] not in counted and row["seconds"] > _UNSEEN_PHASE_SECONDS
    ]
    return {
        "step": step,
        "peak": peak,
        "floors": floors,
        "attention": "causal",
        "ppo_epochs": c.ppo_epochs,
        "gradient_checkpointing": c.gradient_checkpointing,
        "models": {m.name: (m.shape.describe() if m.shape else None) for m in models.values()},
        "trained": {
            m.name: {"weights": m.weights_trained, "head": m.head_trained, "lora_params": m.adapter_params}
            for m in models.values()
        },
        "slowest_products": _slowest_products(gemms, rates),
        "notes": notes,
    }


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _slowest_products(gemms: Dict[str, dict], rates: Optional[Dict[GemmShape, float]], top: int = 3) -> List[dict]:
    """The ``top`` shapes that take the most of the step's ideal seconds (model products, all
    phases), with their measured rates: where the ideal time goes."""
    if rates is None:
        return []
    by_shape: Dict[GemmShape, int] = {}
    for g in gemms.values():
        if not g["omitted"]:
            for part in ("forward", "backward"):
                for shape, flops in g[part].items():
                    by_shape[shape] = by_shape.get(shape, 0) + flops
    ranked = sorted(by_shape.items(), key=lambda item: -item[1] / rates[item[0]])[:top]
    return [
        {**shape._asdict(), "flops": flops, "flops_per_s": rates[shape], "ideal_seconds": flops / rates[shape]}
        for shape, flops in ranked
    ]


# ---------------------------------------------------------------------------------------------
# the run


def profile_step(
    trainer,
    output_dir: Path,
    *,
    warmup_steps: int = 1,
    record_shapes: bool = False,
    with_stack: bool = False,
    peak_size: int = 2048,
    shape_seconds: float = 0.2,
) -> dict:
    """Run ``warmup_steps`` unprofiled steps, then one step under the profiler (and a
    :class:`ShapeRecorder`); measure the square matmul peak just before and after it, the rates at
    the step's product shapes and the read bandwidth after it (:func:`measure_peak`, ``size =
    peak_size``, ``shape_seconds`` per shape; ``peak_size`` 0 skips all three, and with them the
    MFU and the floors); write ``trace.json`` to ``output_dir`` and return ``{"metrics": ...,
    "flops": flop_table(...), **phase_table(...)}``."""
    from torch.profiler import ProfilerActivity, profile

    from ..bench import quiet_stderr

    for _ in range(warmup_steps):
        trainer.step()
    before = square_peaks(trainer, peak_size) if peak_size else None
    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, record_shapes=record_shapes, with_stack=with_stack)
    with ShapeRecorder(trainer) as recorder:
        with quiet_stderr():  # kineto prints profiler_start / profiler_stop lines on stderr
            prof.start()
        try:
            result = trainer.step()
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
        finally:
            with quiet_stderr():
                prof.stop()
    metrics = result.metrics
    output_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(output_dir / "trace.json"))
    table = phase_table(prof.events(), metrics)
    table["metrics"] = {k: float(v) for k, v in metrics.items()}
    peak = None
    if peak_size:
        shapes = step_shapes(recorder, trainer.config.gradient_checkpointing)
        peak = measure_peak(trainer, shapes, peak_size, before, shape_seconds)
    table["flops"] = flop_table(trainer, result.batch, recorder, table, peak)
    return table
