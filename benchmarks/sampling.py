"""Sampling speed of the rollout against its floor, on this machine, in one process.

    python benchmarks/sampling.py                       # SmolLM2-135M, 8 prompts x 32 tokens, 2 threads
    python benchmarks/sampling.py --batch 32 --tokens 16 --json benchmarks/results/sampling.json

Times :func:`pyppo.rollout.hf_generate.generate` (what the trainer samples with) twice per round, interleaved:
with the linear layers' weights packed by oneDNN (the trainer's CPU float32 path,
``pyppo.rollout.hf_generate.packed_linear_weights``) and with plain ``F.linear`` (MKL), the same prompts and
seed each time, exactly ``--tokens`` decode steps (EOS does not stop generation here, so every
round does the same work). It reports the median seconds of each, their ratio, ms per decode
step (prefill measured apart and subtracted), and the per-step floor: the larger of (the model's
weight bytes / the copy bandwidth measured here, read and write bytes both counted) and (the decode step's FLOPs / the ``torch.mm``
peak measured here at 2048^2 float32). Quote ratios with the machine they came from: the
machine is shared and noisy, so run it when ``uptime`` shows a load below the thread count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time


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


def mm_peak(torch, n: int = 2048) -> float:
    """FLOP/s of ``torch.mm`` on ``[n, n]`` float32, median of 5 after a warm-up."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    return 2 * n**3 / _median_time(lambda: torch.mm(a, b), 5)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    import pyppo.rollout.hf_generate as rollout
    from pyppo.rollout.tokens import encode_prompts
    from pyppo.config import PPOConfig
    from pyppo.models import load_model_and_tokenizer
    from pyppo.prompts import DEFAULT_PROMPTS

    model, tok = load_model_and_tokenizer(args.model)
    model.eval()
    tok.padding_side = "left"
    prompts = (list(DEFAULT_PROMPTS) * (args.batch // len(DEFAULT_PROMPTS) + 1))[:args.batch]
    ids, mask = encode_prompts(tok, prompts, use_chat_template=True, max_prompt_length=None, device="cpu")
    gen = rollout.generation_config(PPOConfig(max_new_tokens=args.tokens), eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.eos_token_id)
    gen.eos_token_id = None  # every round runs exactly --tokens decode steps

    packed_ctx = rollout.packed_linear_weights

    @contextlib.contextmanager
    def plain(model, batch_size):
        yield 0

    def sample(ctx, tokens=args.tokens):
        rollout.packed_linear_weights = ctx
        gen.max_new_tokens = tokens
        torch.manual_seed(0)
        try:
            return rollout.generate(model, ids, mask, gen)
        finally:
            rollout.packed_linear_weights = packed_ctx

    times = {"packed": [], "plain": []}
    prefill = {"packed": [], "plain": []}
    sample(packed_ctx), sample(plain)  # warm-up
    for _ in range(args.rounds):
        for name, ctx in (("packed", packed_ctx), ("plain", plain)):
            t = time.perf_counter()
            sample(ctx, 1)
            prefill[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            out = sample(ctx)
            times[name].append(time.perf_counter() - t)
            assert out.shape[1] == ids.shape[1] + args.tokens
    med = {k: statistics.median(v) for k, v in times.items()}
    pre = {k: statistics.median(v) for k, v in prefill.items()}
    per_step = {k: (med[k] - pre[k]) / max(1, args.tokens - 1) for k in med}

    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                       if isinstance(m, torch.nn.Linear))
    params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    bandwidth, peak = copy_bandwidth(torch), mm_peak(torch)
    floor = max(weight_bytes / bandwidth, 2 * args.batch * params / peak)
    result = {
        "model": args.model, "batch": args.batch, "tokens": args.tokens, "threads": args.threads,
        "prompt_length": ids.shape[1], "seconds": med, "prefill_seconds": pre, "decode_step_ms":
        {k: v * 1e3 for k, v in per_step.items()}, "speedup": med["plain"] / med["packed"],
        "floor_step_ms": floor * 1e3, "linear_weight_bytes": weight_bytes, "copy_bandwidth_GBps": bandwidth / 1e9,
        "mm_peak_GFLOPs": peak / 1e9, "rounds": times, "load_average": os.getloadavg(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }
    print(f"sampling {args.batch} x {args.tokens} tokens ({args.model}, prompts of {ids.shape[1]} positions, "
          f"{args.threads} threads, {result['cpu']}; load {result['load_average'][0]:.1f})")
    print("| sampler | s | prefill s | ms / decode step | x floor |")
    print("|---|---:|---:|---:|---:|")
    for k in ("plain", "packed"):
        print(f"| {k} | {med[k]:.2f} | {pre[k]:.2f} | {per_step[k] * 1e3:.1f} | {per_step[k] / floor:.2f} |")
    print(f"packed is {result['speedup']:.2f}x plain; floor {floor * 1e3:.1f} ms/step "
          f"({weight_bytes / 1e6:.0f} MB of linear weights at {bandwidth / 1e9:.1f} GB/s, or "
          f"{2 * args.batch * params / 1e9:.2f} GFLOP at {peak / 1e9:.0f} GFLOP/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
