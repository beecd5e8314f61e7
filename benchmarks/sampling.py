"""Sampling speed of the rollout engines against their floor, on this machine, in one process.

    python benchmarks/sampling.py                     # SmolLM2-135M, every shape, fp32 and bf16, both engines
    python benchmarks/sampling.py --shapes 8x32 --dtypes float32 --engines transformers
    python benchmarks/sampling.py --json benchmarks/results/sampling-vllm.json

For each dtype and each shape (``B x T``: ``B`` prompts, exactly ``T`` sampled tokens each; EOS
does not stop a response here, so every round does the same work) it times, interleaved round by
round with the same prompts and seed:

- ``transformers``: :func:`pyppo.rollout.hf_generate.generate` (what the default engine samples
  with: oneDNN-packed linear weights on a CPU in float32, under the trainer's autocast in bf16);
- ``plain`` (only when asked for, ``--engines plain,transformers``): the same without the packed
  weights (``F.linear``), what packing is measured against;
- ``multinomial`` (only when asked for): the same, each token drawn by ``torch.multinomial`` instead
  of :func:`pyppo.rollout.categorical.sample_categorical`, what the float64 inverse-transform draw
  is measured against;
- ``autocast-attention`` (only when asked for): the same with every attention call left to
  autocast (a bf16 KV cache and bf16 decode-step attention), what
  :mod:`pyppo.rollout.decode_attention`'s float32 decode steps are measured against (the same
  as ``transformers`` in float32);
- ``vllm``: the vLLM rollout engine's ``vllm.LLM.generate`` (:class:`pyppo.rollout.vllm_engine.VLLMEngine`,
  built once per dtype from the same model), plus its ``sync_weights`` after a change of every
  weight (timed apart, and added: the vLLM engine pays it every step); with ``--lora-rank`` (8 by
  default) also the sync of a LoRA policy, merged, after a change of its adapters.

It reports the median seconds of each, the ratio ``transformers / (vllm + sync)``, and the per-row
memory floor: ``T`` decode steps, each at least the model's linear weights' bytes in the compute
dtype (4 bytes a weight in float32, 2 in bf16) over the copy bandwidth measured here (read and
write bytes both counted). On a CPU with few cores the decode step's FLOPs can bind first: at 32
rows each weight is used 64 times a step; ``pyppo profile`` reports both floors of its generate
phase. Quote ratios with the machine they
came from: the machine is shared and noisy, so run it when ``uptime`` shows a load below the
thread count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

DEFAULT_SHAPES = "8x32,32x16,32x128,64x256"


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(torch) -> float:
    """Bytes moved per second by a 512 MB ``copy_``, read and write counted (the rate at which this
    machine streams memory, the bound of a weight-reading decode step), median of 5."""
    src = torch.randn(128 * 1024 * 1024)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), 5)


def _sync_seconds(torch, engine, model, change, rounds: int) -> float:
    """Median seconds of ``engine.sync_weights(model)`` right after ``change()`` (untimed), a
    stand-in for an update (a sync copies the trainable weights)."""
    times = []
    for _ in range(rounds + 1):  # the first is a warm-up
        with torch.no_grad():
            change()
        t = time.perf_counter()
        engine.sync_weights(model)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _lora_sync_seconds(torch, engine, model, rank: int, rounds: int) -> float:
    """The sync of a LoRA copy of ``model`` after each change of its adapters (an update); the
    engine then gets ``model``'s own weights back."""
    import copy

    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    bs = [p for n, p in lora.named_parameters() if "lora_B" in n]
    seconds = _sync_seconds(torch, engine, lora, lambda: [p.add_(1e-3) for p in bs], rounds)
    del lora
    engine.sync_weights(model, trainable_only=False)
    return seconds


def parse_shapes(text: str):
    shapes = []
    for part in text.split(","):
        b, _, t = part.strip().partition("x")
        if not (b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 0):
            raise SystemExit(f"sampling.py: --shapes: {part!r} is not BxT (e.g. 8x32)")
        shapes.append((int(b), int(t)))
    return shapes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of BxT (default {DEFAULT_SHAPES})")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--engines", default="transformers,vllm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument(
        "--lora-rank",
        type=int,
        default=8,
        help="also time the sync of a LoRA policy of this rank (adapters on every linear layer of the "
        "blocks, as pyppo's default), merged; 0 = not",
    )
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    shapes, dtypes = parse_shapes(args.shapes), args.dtypes.split(",")
    engines = args.engines.split(",")
    for name in engines:
        if name not in ("transformers", "plain", "multinomial", "autocast-attention", "vllm"):
            raise SystemExit(
                f"sampling.py: --engines: {name!r} is not transformers, plain, multinomial, autocast-attention or vllm"
            )
    for name in dtypes:
        if name not in ("float32", "bfloat16"):
            raise SystemExit(f"sampling.py: --dtypes: {name!r} is not float32 or bfloat16")

    import torch

    torch.set_num_threads(args.threads)
    import pyppo.rollout.hf_generate as hf
    from pyppo.config import PPOConfig
    from pyppo.models import load_model_and_tokenizer
    from pyppo.precision import autocast
    from pyppo.prompts import DEFAULT_PROMPTS
    from pyppo.rollout.tokens import encode_prompts

    model, tok = load_model_and_tokenizer(args.model)
    model.eval()
    tok.padding_side = "left"
    # The GEMMs read each weight in the compute dtype: float32 (the packed copies), or the bf16
    # copies autocast casts them to.
    weight_elements = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    bandwidth = copy_bandwidth(torch)
    cpu = torch.backends.cpu.get_cpu_capability()
    rows, lora_sync = [], {}
    print(
        f"sampling ({args.model}, {args.threads} threads, {cpu}; load {os.getloadavg()[0]:.1f}); "
        f"floor = T x {weight_elements / 1e6:.3g} M linear weights x the dtype's bytes at {bandwidth / 1e9:.1f} GB/s"
    )
    cols = [f"{name} s" for name in engines] + (["vllm sync s"] if "vllm" in engines else [])
    both = {"transformers", "vllm"} <= set(engines)
    cols += (["transformers / (vllm + sync)"] if both else []) + ["floor s"]
    print("| dtype | B x T | " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        engine = None
        sync_s = None
        if "vllm" in engines:
            from pyppo.rollout.vllm_engine import VLLMEngine, sampling_params

            engine = VLLMEngine(
                model,
                tok,
                max_new_tokens=max(t for _, t in shapes),
                seed=0,
                dtype=dtype,
                kv_cache_gib=args.kv_cache_gib,
            )
            torch.set_num_threads(args.threads)
            sync_s = _sync_seconds(torch, engine, model, lambda: None, args.rounds)
            if args.lora_rank:
                lora_sync[dtype_name] = _lora_sync_seconds(torch, engine, model, args.lora_rank, args.rounds)
        for B, T in shapes:
            prompts = (list(DEFAULT_PROMPTS) * (B // len(DEFAULT_PROMPTS) + 1))[:B]
            ids, mask = encode_prompts(tok, prompts, use_chat_template=True, max_prompt_length=None, device="cpu")
            gen = hf.generation_config(
                PPOConfig(max_new_tokens=T), eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id
            )
            gen.eos_token_id = None  # exactly T tokens

            def run_hf():
                torch.manual_seed(0)
                with torch.no_grad(), autocast(torch.device("cpu"), dtype):
                    out = hf.generate(model, ids, mask, gen)
                assert out.shape[1] == ids.shape[1] + T

            def run_vllm():
                from vllm.inputs import TokensPrompt

                requests = [TokensPrompt(prompt_token_ids=row[m].tolist()) for row, m in zip(ids, mask)]
                params = sampling_params(temperature=1.0, max_new_tokens=T, eos_token_id=tok.eos_token_id, seed=0)
                params.ignore_eos, params.min_tokens = True, T
                outs = engine.llm.generate(requests, params, use_tqdm=False)
                assert all(len(o.outputs[0].token_ids) == T for o in outs)

            @contextlib.contextmanager
            def unpacked(model, batch_size):
                yield 0

            def run_without(name, stand_in):
                # run_hf with one of generate()'s contexts replaced, then put back
                real = getattr(hf, name)
                setattr(hf, name, stand_in)
                try:
                    run_hf()
                finally:
                    setattr(hf, name, real)

            def run_plain():
                run_without("packed_linear_weights", unpacked)

            def run_multinomial():
                run_without("fast_multinomial", contextlib.nullcontext)

            def run_autocast_attention():
                run_without("decode_attention_cache", lambda *args: None)

            runs = {
                "transformers": run_hf,
                "plain": run_plain,
                "multinomial": run_multinomial,
                "autocast-attention": run_autocast_attention,
                "vllm": run_vllm,
            }
            times = {name: [] for name in engines}
            if (B, T) == shapes[0]:  # warm-up, once per dtype (the later shapes reuse what it set up)
                for name in engines:
                    runs[name]()
            for _ in range(args.rounds):
                for name in engines:
                    t = time.perf_counter()
                    runs[name]()
                    times[name].append(time.perf_counter() - t)
            med = {k: statistics.median(v) for k, v in times.items()}
            floor = T * weight_elements * dtype.itemsize / bandwidth
            row = {
                "dtype": dtype_name,
                "batch": B,
                "tokens": T,
                "seconds": med,
                "rounds": times,
                "vllm_sync_seconds": sync_s,
                "floor_seconds": floor,
                "prompt_length": int(ids.shape[1]),
            }
            cells = [f"{med[name]:.2f}" for name in engines] + ([f"{sync_s:.3f}"] if "vllm" in engines else [])
            if both:
                row["transformers_over_vllm_with_sync"] = med["transformers"] / (med["vllm"] + sync_s)
                cells.append(f"{row['transformers_over_vllm_with_sync']:.2f}x")
            rows.append(row)
            print(f"| {dtype_name} | {B} x {T} | " + " | ".join(cells + [f"{floor:.2f}"]) + " |", flush=True)
        if engine is not None:
            engine.close()
            del engine
    result = {
        "model": args.model,
        "threads": args.threads,
        "cpu": cpu,
        "load_average": os.getloadavg(),
        "linear_weight_elements": weight_elements,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "vllm_lora_sync_seconds": lora_sync,
        "lora_rank": args.lora_rank,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    for dtype_name, seconds in lora_sync.items():
        print(
            f"vLLM weight sync of a LoRA policy (r = {args.lora_rank}, every linear layer of the blocks, merged), "
            f"{dtype_name}: {seconds:.3f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
