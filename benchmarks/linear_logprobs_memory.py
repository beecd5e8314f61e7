"""Peak memory and time of linear_logprobs against the eager full-logits path (issue 5).

Each variant runs in its own process so that one variant's freed-but-cached memory cannot
hide the other's peak. Peak memory is the process's resident-set high-water mark
(``ru_maxrss``) minus its value once the inputs exist: the extra memory the forward+backward
needs on top of hidden states and weights.

    python benchmarks/linear_logprobs_memory.py [--n 8192 --h 576 --v 49152 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _child(variant: str, n: int, h: int, v: int, repeats: int, seed: int) -> dict:
    import torch

    import pyppo.ops as ops

    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)

    def eager():
        logits = hidden @ weight.T
        lp = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
        lp.sum().backward()
        return lp

    def fused():
        lp = ops.linear_logprobs(hidden, weight, labels)
        lp.sum().backward()
        return lp

    fn = eager if variant == "eager" else fused
    base = _rss_mb()
    times = []
    for _ in range(repeats):
        hidden.grad = None
        weight.grad = None
        t0 = time.perf_counter()
        lp = fn()
        times.append(time.perf_counter() - t0)
    peak = _rss_mb()
    times.sort()
    return {
        "variant": variant,
        "median_s": times[len(times) // 2],
        "peak_extra_mb": peak - base,
        "logprobs_sum": float(lp.detach().double().sum()),
        "grad_hidden_norm": float(hidden.grad.double().norm()),
        "grad_weight_norm": float(weight.grad.double().norm()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--h", type=int, default=576)
    p.add_argument("--v", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=["eager", "fused"])
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.n, a.h, a.v, a.repeats, a.seed)))
        return 0
    rows = {}
    for variant in ("eager", "fused"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant, "--n", str(a.n), "--h", str(a.h), "--v", str(a.v),
             "--repeats", str(a.repeats), "--seed", str(a.seed)],
            check=True, capture_output=True, text=True,
        ).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    e, f = rows["eager"], rows["fused"]
    print(f"linear_logprobs fwd+bwd, N={a.n} H={a.h} V={a.v} float32")
    for r in (e, f):
        print(f"  {r['variant']:6s} {r['median_s'] * 1e3:9.1f} ms   peak extra {r['peak_extra_mb']:9.1f} MB")
    print(f"  time ratio fused/eager   {f['median_s'] / e['median_s']:.2f}")
    print(f"  memory ratio fused/eager {f['peak_extra_mb'] / max(e['peak_extra_mb'], 1e-9):.3f}")
    rel = lambda k: abs(f[k] - e[k]) / max(abs(e[k]), 1e-30)  # noqa: E731
    print(f"  rel. diff: logprobs sum {rel('logprobs_sum'):.1e}, |grad_hidden| {rel('grad_hidden_norm'):.1e}, "
          f"|grad_weight| {rel('grad_weight_norm'):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
