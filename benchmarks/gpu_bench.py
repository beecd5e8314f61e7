"""Short CUDA benchmark of pyppo's kernels (run by benchmarks/gpu_check.sh on a GPU machine).

  * gather_logprobs forward on [4, 512, 49152] (float32 and bfloat16 logits) against
      - a device-to-device copy of the same bytes, timed in the same run (the bandwidth bar:
        the kernel reads the logits once, the copy reads and writes them once, so the kernel's
        share of copy bandwidth is (bytes / t_kernel) / (2 * bytes / t_copy));
      - eager `log_softmax(-1).gather(-1, labels)`;
      - TRL's `selective_log_softmax`, when trl is importable;
  * gae on [256, 4096] against the Python loop over time steps (TRL-style, one vector op per step).

Targets (issue 4): gather_logprobs >= 80% of copy bandwidth and no slower than TRL; gae >= 100x
the Python loop. Prints a table last; exits 3 when a target is missed (1 on an error).
Usage: python benchmarks/gpu_bench.py [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def cuda_time(fn, iters: int, reps: int = 5, warmup: int = 2) -> float:
    """Median seconds per call over `reps` batches of `iters` calls, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def find_trl():
    """TRL's selective_log_softmax (the import path moved between releases), or None."""
    for mod, name in (("trl.trainer.utils", "selective_log_softmax"), ("trl.models.utils", "selective_log_softmax")):
        try:
            m = __import__(mod, fromlist=[name])
            fn = getattr(m, name, None)
            if fn is not None:
                return fn, f"{mod}.{name}"
        except Exception:  # noqa: BLE001 - any import problem means "not available"
            continue
    return None, None


def gae_python_loop(rewards, values, gamma: float, lam: float):
    """The per-time-step loop most PPO code uses (TRL, CleanRL): a few vector ops per step."""
    T = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    adv_rev = []
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t < T - 1 else torch.zeros_like(values[:, 0])
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        adv_rev.append(last)
    adv = torch.stack(adv_rev[::-1], dim=1)
    return adv, adv + values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 1
    import pyppo
    from pyppo.ops import gae, gather_logprobs

    if not pyppo._C.with_cuda:
        print("gpu_bench: pyppo was built without CUDA", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}; "
          f"torch {torch.__version__} (CUDA {torch.version.cuda}); pyppo archs {pyppo._C.cuda_archs}")
    reps = 3 if args.quick else 5
    trl_fn, trl_name = find_trl()
    print(f"trl: {trl_name or 'not importable'}")
    rows: list[dict] = []
    missed: list[str] = []
    t_start = time.time()

    # ---- gather_logprobs forward ----
    B, T, V = 4, 512, 49152
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(B, T, V, device=dev, generator=g) * 3).to(dtype)
        labels = torch.randint(0, V, (B, T), device=dev, generator=g)
        nbytes = logits.numel() * logits.element_size()
        dst = torch.empty_like(logits)
        t_copy = cuda_time(lambda: dst.copy_(logits), iters=10, reps=reps)
        del dst
        t_ours = cuda_time(lambda: gather_logprobs(logits, labels), iters=10, reps=reps)

        def eager():
            return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

        t_eager = cuda_time(eager, iters=3, reps=reps)
        # correctness spot check against eager float32
        ref = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        err = (gather_logprobs(logits, labels) - ref).abs().max().item()
        del ref
        t_trl = None
        if trl_fn is not None:
            try:
                t_trl = cuda_time(lambda: trl_fn(logits, labels), iters=3, reps=reps)
            except Exception as e:  # noqa: BLE001
                print(f"trl selective_log_softmax failed on {dtype}: {e}")
        copy_bw = 2 * nbytes / t_copy
        ours_bw = nbytes / t_ours
        pct = 100 * ours_bw / copy_bw
        name = f"gather_logprobs fwd {str(dtype).replace('torch.', '')}"
        rows.append(dict(op=name, shape=f"[{B},{T},{V}]", ms=t_ours * 1e3, gbps=ours_bw / 1e9, pct_copy=pct,
                         copy_gbps=copy_bw / 1e9, eager_ms=t_eager * 1e3, trl_ms=None if t_trl is None else t_trl * 1e3,
                         max_abs_err_vs_fp32_eager=err))
        if pct < 80:
            missed.append(f"{name}: {pct:.0f}% of copy bandwidth (< 80%)")
        if t_trl is not None and t_ours > t_trl:
            missed.append(f"{name}: {t_ours * 1e3:.3f} ms, slower than TRL ({t_trl * 1e3:.3f} ms)")
        del logits, labels
        torch.cuda.empty_cache()

    # ---- gae ----
    B, T = 256, 4096
    rewards = torch.randn(B, T, device=dev, generator=g)
    values = torch.randn(B, T, device=dev, generator=g)
    mask = torch.ones(B, T, device=dev, dtype=torch.bool)
    t_gae = cuda_time(lambda: gae(rewards, values, mask, gamma=0.99, lam=0.95), iters=20, reps=reps)
    t_loop = cuda_time(lambda: gae_python_loop(rewards, values, 0.99, 0.95), iters=1, reps=3, warmup=1)
    a_ours, _ = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    a_loop, _ = gae_python_loop(rewards, values, 0.99, 0.95)
    err = (a_ours - a_loop).abs().max().item()
    speedup = t_loop / t_gae
    rows.append(dict(op="gae", shape=f"[{B},{T}]", ms=t_gae * 1e3, python_loop_ms=t_loop * 1e3, speedup=speedup,
                     max_abs_err_vs_loop=err))
    if speedup < 100:
        missed.append(f"gae: {speedup:.0f}x the Python loop (< 100x)")

    # ---- table (last) ----
    print(f"\n(benchmark took {time.time() - t_start:.0f} s)")
    print(f"{'op':<28} {'shape':<16} {'pyppo ms':>9} {'GB/s':>7} {'%copy':>6} {'eager ms':>9} {'TRL ms':>8} {'loop ms':>9} {'speedup':>8} {'max|err|':>9}")
    for r in rows:
        print(f"{r['op']:<28} {r['shape']:<16} {r['ms']:>9.3f} "
              f"{r.get('gbps', float('nan')):>7.0f} {r.get('pct_copy', float('nan')):>6.1f} "
              f"{r.get('eager_ms') if r.get('eager_ms') is not None else float('nan'):>9.3f} "
              f"{r.get('trl_ms') if r.get('trl_ms') is not None else float('nan'):>8.3f} "
              f"{r.get('python_loop_ms') if r.get('python_loop_ms') is not None else float('nan'):>9.2f} "
              f"{r.get('speedup') if r.get('speedup') is not None else float('nan'):>8.0f} "
              f"{r.get('max_abs_err_vs_fp32_eager', r.get('max_abs_err_vs_loop', float('nan'))):>9.2e}")
    copy_rows = [r for r in rows if "copy_gbps" in r]
    if copy_rows:
        print("copy bandwidth (read + write) measured in this run: "
              + ", ".join(f"{r['op'].split()[-1]} {r['copy_gbps']:.0f} GB/s" for r in copy_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props.name, torch=torch.__version__, trl=trl_name, rows=rows, missed=missed), f, indent=1)
    if missed:
        print("TARGETS MISSED: " + "; ".join(missed))
        return 3
    print("all targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
