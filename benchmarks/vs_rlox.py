"""pyppo against rlox 1.2.0 (Rust) as their users call them: numpy in, numpy out.

    python benchmarks/vs_rlox.py                          # 5 repeats, the shapes below
    python benchmarks/vs_rlox.py --repeats 9 --json benchmarks/results/vs_rlox-DATE.json
    python benchmarks/vs_rlox.py --sizes tiny --repeats 1 # seconds (the test's)

Rows, each timed with its variants interleaved round by round in one process
(``pyppo.bench.timing.measure``: the order rotated each round, so machine noise hits them alike),
every conversion inside the timed call:

* group advantages at ``n_prompts x group_size`` = 512x8, 4096x8, 64x64 (float64 rewards):
  ``rlox.compute_batch_group_advantages(rewards, n)``; ``pyppo``: ``pyppo.ops.group_advantages``
  as a user with a numpy array calls it (``torch.from_numpy``, a ``[B, 1]`` mask,
  ``group_size=n``, ``.numpy()``: GRPO's sample std + eps, pyppo's own estimator); ``adapter``:
  ``pyppo.integrations.rlox.compute_batch_group_advantages`` (rlox's population std and zero rule);
* GAE at the peer bench's ``[B, T]`` = 64x1024 and 256x2048 (float32, gamma 0.99, lam 0.95):
  ``rlox.compute_gae_batched_f32`` against its adapter, with one episode per row (dones at each
  row's last step) and with episodes ending with probability 1/128 at every step; with one
  episode per row also ``pyppo``: ``pyppo.ops.gae`` as a user with numpy arrays calls it
  (``torch.from_numpy`` views ``[B, T]``, a new all-true mask, ``.numpy()``);
* per-sequence token KL at the same shapes: ``compute_batch_token_kl_schulman_f32`` and
  ``compute_batch_token_kl_f32`` against their adapters.

Each repeat prints a table; the summary gives, per row and variant, the median over repeats of
the per-repeat median time and of the per-repeat ratio (the median over rounds of variant / rlox
timed back to back: below 1 is faster than rlox), with the load average around each repeat.
Quote the numbers with the machine (printed: CPU, flags, torch threads); the machine may be
shared, so compare ratios, which interleaving protects, rather than absolute times.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

import pyppo.integrations.rlox as adapters
from pyppo.bench.environment import environment
from pyppo.bench.peers import _cpu_flags
from pyppo.bench.timing import HostClock, measure, paired_ratio
from pyppo.ops import gae, group_advantages

SIZES = {
    "full": {"groups": ((512, 8), (4096, 8), (64, 64)), "rollouts": ((64, 1024), (256, 2048)), "budget": 1.5},
    "tiny": {"groups": ((4, 8),), "rollouts": ((4, 32),), "budget": 0.02},
}
GAMMA, LAM = 0.99, 0.95


def pyppo_group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """pyppo's op as a user holding a numpy array calls it (GRPO: sample std + eps)."""
    scores = torch.from_numpy(rewards)
    mask = torch.ones(scores.shape[0], 1, dtype=torch.bool)
    return group_advantages(scores, mask, group_size=group_size).numpy().reshape(-1)


def pyppo_gae(rewards, values, dones, last_values, T: int):
    """pyppo's op on rows that each hold one episode (rlox's dones at the rows' last steps: no
    bootstrap, which the op gives without ``last_values``), as a user holding numpy arrays calls it."""
    del dones, last_values
    B = rewards.shape[0] // T
    adv, ret = gae(
        torch.from_numpy(rewards).view(B, T),
        torch.from_numpy(values).view(B, T),
        torch.ones(B, T, dtype=torch.bool),
        gamma=GAMMA,
        lam=LAM,
    )
    return adv.numpy().reshape(-1), ret.numpy().reshape(-1)


def rows(rlox, sizes: str, seed: int) -> list[dict]:
    """Each row: its label, the variants (rlox's first) and their one input set."""
    rng = np.random.default_rng(seed)
    out = []
    for P, n in SIZES[sizes]["groups"]:
        rewards = rng.normal(size=P * n)
        out.append(
            {
                "row": f"group advantages {P}x{n}",
                "variants": {
                    "rlox": lambda r, n=n: rlox.compute_batch_group_advantages(r, n),
                    "pyppo": lambda r, n=n: pyppo_group_advantages(r, n),
                    "adapter": lambda r, n=n: adapters.compute_batch_group_advantages(r, n),
                },
                "input": rewards,
            }
        )
    for B, T in SIZES[sizes]["rollouts"]:
        f32 = lambda: rng.normal(size=B * T).astype(np.float32)  # noqa: E731
        last = np.zeros((B, T), np.float32)
        last[:, -1] = 1.0
        episodes = (rng.random(B * T) < 1 / 128).astype(np.float32)
        rewards, values, last_values = f32(), f32(), rng.normal(size=B).astype(np.float32)
        for label, dones in (("one episode per row", last.reshape(-1)), ("episodes end w.p. 1/128", episodes)):
            variants = {
                "rlox": lambda x, T=T: rlox.compute_gae_batched_f32(*x, T, GAMMA, LAM),
                "adapter": lambda x, T=T: adapters.compute_gae_batched_f32(*x, T, GAMMA, LAM),
            }
            if dones is not episodes:
                variants["pyppo"] = lambda x, T=T: pyppo_gae(*x, T)
            out.append(
                {"row": f"gae {B}x{T} ({label})", "variants": variants, "input": (rewards, values, dones, last_values)}
            )
        policy = (f32() - 2.0).astype(np.float32)
        ref = (policy + 0.3 * rng.normal(size=B * T)).astype(np.float32)
        for name in ("compute_batch_token_kl_schulman_f32", "compute_batch_token_kl_f32"):
            out.append(
                {
                    "row": f"{name.removeprefix('compute_batch_')} {B}x{T}",
                    "variants": {
                        "rlox": lambda x, f=getattr(rlox, name), T=T: f(*x, T),
                        "adapter": lambda x, f=getattr(adapters, name), T=T: f(*x, T),
                    },
                    "input": (policy, ref),
                }
            )
    return out


def run_once(cases: list[dict], budget: float) -> list[dict]:
    results = []
    for case in cases:
        times = measure(
            case["variants"], [case["input"]], HostClock(), warmup=3, min_reps=20, max_reps=2000, budget_s=budget
        )
        results.append(
            {
                "row": case["row"],
                "us": {k: statistics.median(v) * 1e6 for k, v in times.items()},
                "ratio": {k: paired_ratio(v, times["rlox"]) for k, v in times.items() if k != "rlox"},
                "rounds": len(times["rlox"]),
            }
        )
    return results


def _table(results: list[dict]) -> str:
    lines = [f"{'row':<52} {'rlox us':>10} {'pyppo us':>10} {'x rlox':>7} {'adapter us':>11} {'x rlox':>7}"]
    for r in results:
        us, ratio = r["us"], r["ratio"]
        pyppo = f"{us['pyppo']:10.1f} {ratio['pyppo']:7.2f}" if "pyppo" in us else f"{'-':>10} {'-':>7}"
        lines.append(f"{r['row']:<52} {us['rlox']:10.1f} {pyppo} {us['adapter']:11.1f} {ratio['adapter']:7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", choices=sorted(SIZES), default="full")
    parser.add_argument("--repeats", type=int, default=5, help="whole runs, each interleaved (default 5)")
    parser.add_argument("--budget", type=float, default=None, help="seconds of rounds per row and repeat")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the repeats and the summary here")
    args = parser.parse_args(argv)
    try:
        import rlox
    except ImportError:
        print("vs_rlox: rlox is not installed (pip install rlox==1.2.0, or pip install 'pyppo[rlox]')", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment([torch.device("cpu")])
    env.update(rlox=rlox.__version__, cpu_flags=_cpu_flags(), date=dt.date.today().isoformat())
    print(f"cpu: {env['cpu']} ({os.cpu_count()} logical), flags: {' '.join(env['cpu_flags'])}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; rlox {rlox.__version__}")
    cases = rows(rlox, args.sizes, args.seed)
    budget = SIZES[args.sizes]["budget"] if args.budget is None else args.budget
    repeats = []
    for k in range(args.repeats):
        before = os.getloadavg()
        results = run_once(cases, budget)
        after = os.getloadavg()
        repeats.append({"load_before": before, "load_after": after, "rows": results})
        print(f"\nrepeat {k + 1}/{args.repeats}  load average {before[0]:.2f} -> {after[0]:.2f}")
        print(_table(results))
    summary = []
    for i, case in enumerate(cases):
        per = [rep["rows"][i] for rep in repeats]
        summary.append(
            {
                "row": case["row"],
                "us": {v: statistics.median(p["us"][v] for p in per) for v in per[0]["us"]},
                "ratio": {v: statistics.median(p["ratio"][v] for p in per) for v in per[0]["ratio"]},
                "ratio_range": {
                    v: [min(p["ratio"][v] for p in per), max(p["ratio"][v] for p in per)] for v in per[0]["ratio"]
                },
            }
        )
    loads = [rep["load_before"][0] for rep in repeats] + [rep["load_after"][0] for rep in repeats]
    print(f"\nmedians over {args.repeats} repeats (load average {min(loads):.2f} to {max(loads):.2f}):")
    print(_table(summary))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"env": env, "sizes": args.sizes, "repeats": repeats, "summary": summary}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
