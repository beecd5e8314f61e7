"""What a `pyppo train` run costs on this machine, one configuration after the other in one go:
seconds per step, peak resident memory (summed over every process of the run) and checkpoint size.

    python benchmarks/train_costs.py                       # the default model, every configuration
    python benchmarks/train_costs.py --only full lora --steps 3

Each configuration is the default run (`pyppo train` with its preset) cut to ``--steps`` steps, plus
the configuration's own flags. s/step is the median ``step_seconds`` of the steps after the first
(which warms up). Peak RSS is sampled every 0.2 s over the whole process tree (torchrun's workers
included), so it is the peak of the sum, not of one process. Results go to stdout as a Markdown
table and, with ``--json``, to a file. Quote them with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

CONFIGS = {
    "full": ("full fine-tune, fp32, 1 process", []),
    "lora": ("LoRA rank 16, fp32, 1 process", ["--lora-rank", "16"]),
    "lora-value": ("LoRA rank 16 on the policy and the value model", ["--lora-rank", "16", "--value-lora"]),
    "full-ckpt": ("full fine-tune, fp32, gradient checkpointing", ["--gradient-checkpointing"]),
    "full-2proc": ("full fine-tune, fp32, 2 gloo processes (torchrun)", ["--nproc", "2"]),
    "lora-2proc": ("LoRA rank 16, fp32, 2 gloo processes (torchrun)", ["--lora-rank", "16", "--nproc", "2"]),
}


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run(name: str, steps: int, extra: list[str], workdir: Path) -> dict:
    out = workdir / name
    flags = CONFIGS[name][1]
    cmd = [
        sys.executable,
        "-m",
        "pyppo",
        "train",
        "--steps",
        str(steps),
        "--save-every",
        str(steps),
        "--device",
        "cpu",
        "--output",
        str(out),
        *flags,
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ps, peak, done = psutil.Process(proc.pid), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(ps))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    done.set()
    sampler.join()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name}: pyppo train failed ({proc.returncode}):\n{err[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["step_seconds"] for r in rows[1:]] or [rows[0]["step_seconds"]]
    ckpt = sum(f.stat().st_size for f in (out / "checkpoint").iterdir())
    policy = sum(f.stat().st_size for f in (out / "policy").rglob("*") if f.is_file())
    return {
        "config": name,
        "what": CONFIGS[name][0],
        "s_per_step": statistics.median(seconds),
        "peak_rss_gb": peak[0] / 1e9,
        "checkpoint_gb": ckpt / 1e9,
        "policy_dir_gb": policy / 1e9,
        "wall_s": wall,
        "score_mean": [r["score_mean"] for r in rows],
        "kl_mean": rows[-1]["kl_mean"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("extra", nargs="*", help="more pyppo train flags, after --")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="pyppo-costs-") as tmp:
        for name in args.only:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            results.append(run(name, args.steps, args.extra, Path(tmp)))
    base = results[0]
    print(f"| configuration | s/step | peak RSS | checkpoint | policy/ | s/step vs {base['config']} |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['what']} | {r['s_per_step']:.1f} | {r['peak_rss_gb']:.2f} GB | {r['checkpoint_gb']:.3f} GB "
            f"| {r['policy_dir_gb']:.3f} GB | {r['s_per_step'] / base['s_per_step']:.2f}x |"
        )
    if args.json:
        env = {"cpu": psutil.cpu_count(), "torch_threads": os.environ.get("OMP_NUM_THREADS")}
        Path(args.json).write_text(json.dumps({"env": env, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
