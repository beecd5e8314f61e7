"""python benchmarks/gpu/train_and_check.py MODE OUTPUT STEPS TABLE -- <pyppo train flags>:
pyppo.cli.main(["train", ..., "--output", OUTPUT, "--steps", STEPS]), then (rank 0) check the run
and append 'mode, s/step, peak memory, status' to TABLE.

The checks: pyppo train exited 0 on every rank; STEPS rows in OUTPUT/metrics.jsonl;
first_max_abs_logratio == 0 and kl_mean == 0 at step 1; finite score_mean and policy_loss at every
step; OUTPUT/policy loads with AutoModelForCausalLM.from_pretrained and gives finite logits; with
``--rollout-engine vllm``, a finite mismatch_logprob_diff_max at every step (printed). Prints
``gpu_check: MODE: N process(es), S s/step (median), peak P: pass|FAIL``; exit 0 = pass, 1 = FAIL.
gpu_check.sh's train, lora and vllm steps run it directly (STEPS 3), its fsdp step under
``torchrun --nproc-per-node N`` (STEPS 2, --fsdp --lora-rank 8); the ranks' exit codes and peak
memory (CUDA allocator, else max RSS) are gathered to rank 0."""

import json
import math
import resource
import statistics
import sys

mode, out, steps, table = sys.argv[1:5]
assert sys.argv[5] == "--"
argv = ["train", *sys.argv[6:], "--output", out, "--steps", steps]
import torch  # noqa: E402

from pyppo.cli import main  # noqa: E402

rc = main(argv)
cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rcs, peaks = [rc], [(cuda_peak, rss_peak)]
import torch.distributed as dist  # noqa: E402

if dist.is_available() and dist.is_initialized():  # under torchrun with several processes
    n = dist.get_world_size()
    rcs, peaks = [None] * n, [None] * n
    dist.all_gather_object(rcs, rc)
    dist.all_gather_object(peaks, (cuda_peak, rss_peak))
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        sys.exit(rc)

problems = [f"pyppo train exited {r} (rank {i})" for i, r in enumerate(rcs) if r]
s_per_step = math.nan
if not problems:
    from pathlib import Path

    out = Path(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if len(rows) != int(steps):
        problems.append(f"metrics.jsonl has {len(rows)} rows, expected {steps}")
    if rows:
        first = rows[0]
        if first.get("first_max_abs_logratio") != 0.0:
            problems.append(f"step 1 first_max_abs_logratio = {first.get('first_max_abs_logratio')!r}, expected 0.0")
        if first.get("kl_mean") != 0.0:
            problems.append(f"step 1 kl_mean = {first.get('kl_mean')!r}, expected 0.0")
        for row in rows:
            for key in ("score_mean", "policy_loss"):
                v = row.get(key)
                if not isinstance(v, (int, float)) or not math.isfinite(v):
                    problems.append(f"step {row.get('step')} {key} = {v!r}, not finite")
        s_per_step = statistics.median(float(r["step_seconds"]) for r in rows)
        if "vllm" in sys.argv[6:]:  # --rollout-engine vllm: the sampler's mismatch is logged every step
            diffs = [r.get("mismatch_logprob_diff_max") for r in rows]
            if not all(isinstance(d, (int, float)) and math.isfinite(d) for d in diffs):
                problems.append(f"mismatch_logprob_diff_max is missing or not finite: {diffs!r}")
            else:
                print(
                    f"gpu_check: {mode}: mismatch_logprob_diff_max per step {diffs}, mismatch_kl_k3 "
                    f"{[r.get('mismatch_kl_k3') for r in rows]}, time_weight_sync "
                    f"{[r.get('time_weight_sync') for r in rows]}"
                )
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out / "policy")
        with torch.no_grad():
            logits = model(input_ids=torch.arange(4, 12).unsqueeze(0)).logits
        if not torch.isfinite(logits).all():
            problems.append("policy/ gives non-finite logits")
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        problems.append(f"policy/ does not load: {type(exc).__name__}: {exc}")

if any(c is not None for c, _ in peaks):
    peak = f"{max(c or 0 for c, _ in peaks) / 2**20:.0f} MiB CUDA alloc"
else:
    peak = f"{max(r for _, r in peaks) / 2**20:.0f} MiB max RSS"
status = "pass" if not problems else "FAIL"
sps = f"{s_per_step:.3f}" if math.isfinite(s_per_step) else "-"
for p in problems:
    print("gpu_check: FAIL:", p)
print(f"gpu_check: {mode}: {len(rcs)} process(es), {sps} s/step (median), peak {peak}: {status}")
with open(table, "a") as f:
    f.write(f"{mode}\t{sps}\t{peak}\t{status}\n")
sys.exit(0 if not problems else 1)
