#!/usr/bin/env bash
# GPU check of pyppo, in one go, on a fresh CUDA machine with no network whose image has torch
# (with CUDA), nvcc, cmake, ninja, pybind11, scikit-build-core, transformers, peft and accelerate.
# No downloaded model is needed: the training steps use a tiny random Llama (tests/tiny_models.py)
# written to a temporary directory. Steps, each with a timeout, in this order:
#   build   build pyppo in place with the CUDA kernels (PYPPO_CUDA=on: a CPU-only build is an
#           error), for TORCH_CUDA_ARCH_LIST (default 9.0, the H100/H200's sm_90);
#   tests   the CUDA tests (pytest -m cuda): the op tests on the device, the kernels against
#           their float32 replays (tests/test_cuda_emulation.py), the contract checks (log-probs
#           <= 0 and exactly 0 where certain, huge finite logits, GAE bits under right padding,
#           T-sliced views read in place, the CPU's errors), no host sync under
#           torch.cuda.set_sync_debug_mode("error") and CUDA-graph capture (tests/test_cuda_graphs.py);
#   sanitize  compute-sanitizer memcheck, then racecheck, over every pyppo kernel on tiny shapes
#           (V = 7, 4099 and a misaligned 6144; T = 5, 1024, 2500; every dtype), pyppo's kernels
#           only (--kernel-name kns=pyppo where the sanitizer has that option);
#   kernels the kernel table: gather_logprobs forward (with and without entropy) and backward on
#           logits [8, 1024, 151936] in bf16 and fp32, each against a device-to-device copy of the
#           same bytes (targets: forward >= 80% of copy bandwidth, backward >= 60%); GAE on
#           [256, 2048]; linear_logprobs forward+backward with entropy at Liger-Kernel's fused
#           linear cross-entropy shape (M = 16384, H = 4096, V = 131072, bf16; target: no slower
#           than Liger's, about 104 ms on an H100, or Liger itself when it is installed);
#           writes kernels.json (to OUT when set);
#   bench   the GPU suite of the benchmark harness (pyppo bench --suite gpu --quick --check-targets);
#   train   pyppo train --device cuda --dtype bfloat16 --steps 3 on the tiny Llama, through a small
#           wrapper that calls pyppo.cli.main and then checks the run: 3 rows in metrics.jsonl,
#           first_max_abs_logratio == 0 and kl_mean == 0 at step 1 (the first ratio is exactly 1),
#           finite score_mean / policy_loss everywhere, policy/ loads with
#           AutoModelForCausalLM.from_pretrained and gives finite logits; reports the median
#           step_seconds and the peak memory (torch.cuda.max_memory_allocated);
#   lora    the same with --lora-rank 8;
#   fsdp    FSDP2 smoke test, two parts:
#           (a) torchrun -m pyppo train --fsdp --lora-rank 8 --steps 2 (same checks), with 2
#               processes when the machine has >= 2 GPUs, else 1. With ONE process the trainer does
#               not shard (pyppo.distributed.wrap is the identity when the world size is 1), so
#               this part then only checks that the --fsdp run works under torchrun;
#           (b) a one-process torchrun script that does shard: a 1-rank NCCL group, fully_shard on
#               every decoder block and then on the LogprobHead root (the two steps of
#               pyppo.distributed.wrap), sampling through the sharded head (synced_gpus), one
#               bf16-autocast forward (log-probs vs the unsharded twin) / backward of the PPO
#               policy loss on a RolloutBuffer, an AdamW step, and
#               pyppo.checkpoint.training_state's full-state-dict gather; all finite.
#           Not covered on one GPU: anything that needs several ranks (reduce-scatter of real
#           shards, the cross-rank whitening / metrics). Those run on CPU with gloo in
#           tests/test_distributed.py, and here in part (a) when there are >= 2 GPUs.
# The whole script stops within GPU_CHECK_BUDGET seconds (default 470, under 8 minutes): every
# step's timeout is capped by the time left, and a step with under 20 s left is reported as
# TIMEOUT. The default steps (build, tests, sanitize, kernels) fit that budget; bench, train,
# lora and fsdp are selected with GPU_CHECK_STEPS. Step timeouts: build 240, tests 120,
# sanitize 60 + 45, kernels 90, bench 180, train 120, lora 120, fsdp 150 + 90.
# A training table (mode, s/step, peak memory, status) and then a summary of every step (status,
# seconds) are printed last.
#
# Exit status: 1 = the environment check, the build or the import of the built pyppo failed;
# else the tests' (pytest's status, 124 = timed out); else 5 = a sanitizer found an error (or
# timed out); else the benchmark's (1 = an op disagreed with its eager reference, 3 = a target
# missed), else 3 = a kernel-table target missed, 5 = the kernel table failed to run; else 4 = a
# training or FSDP step failed or ran out of time; 64 = a bad GPU_CHECK_* setting; 0 =
# everything selected passed.
#
#   bash benchmarks/gpu_check.sh                 # TORCH_CUDA_ARCH_LIST defaults to 9.0
# Settings (environment):
#   OUT                   results go there: gpu_bench.json, kernels.json, gpu_check_summary.tsv, and each
#                         training run's metrics.jsonl as train_<step>_metrics.jsonl
#                         (else the bench JSON is dated in benchmarks/results/)
#   PYTHON                the interpreter (default python)
#   GPU_CHECK_STEPS       comma list of steps to run (default build,tests,sanitize,kernels; all:
#                         build,tests,sanitize,kernels,bench,train,lora,fsdp)
#   GPU_CHECK_SKIP_BUILD  1 = no build step: use the pyppo already installed
#   GPU_CHECK_DEVICE      cuda (default) or cpu: cpu runs train / lora / fsdp on the CPU (gloo
#                         instead of NCCL) and reports build / tests / sanitize / kernels / bench
#                         as skipped; this is
#                         how tests/test_gpu_check_script.py runs the script on a machine with no
#                         GPU
#   GPU_CHECK_NPROC       processes of the fsdp step's trainer run (default 2 with >= 2 GPUs, else 1)
#   GPU_CHECK_TRAIN_ARGS  extra flags appended to every pyppo train run (e.g. --gradient-checkpointing)
#   GPU_CHECK_BUDGET      seconds for the whole script (default 470)
#   GPU_CHECK_WORK        scratch directory, kept (default: a temporary one, removed at the end)
# Results: the log on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

PY=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
STEPS=${GPU_CHECK_STEPS:-build,tests,sanitize,kernels}
BUDGET=${GPU_CHECK_BUDGET:-470}
TRAIN_ARGS=${GPU_CHECK_TRAIN_ARGS:-}
ALL_STEPS="build tests sanitize kernels bench train lora fsdp"

bad_setting() { echo "gpu_check: $*" >&2; exit 64; }
case "$DEVICE" in cuda|cpu) ;; *) bad_setting "GPU_CHECK_DEVICE must be cuda or cpu, got '$DEVICE'" ;; esac
case "$BUDGET" in ''|*[!0-9]*) bad_setting "GPU_CHECK_BUDGET must be a whole number of seconds, got '$BUDGET'" ;; esac
for s in ${STEPS//,/ }; do
  case " $ALL_STEPS " in *" $s "*) ;; *) bad_setting "unknown step '$s' in GPU_CHECK_STEPS (steps: ${ALL_STEPS// /,})" ;; esac
done
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then STEPS=",$STEPS,"; STEPS=${STEPS//,build,/,}; fi
STEPS=$(echo "$STEPS" | tr -s ',' | sed 's/^,//; s/,$//')
wants() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# ---- step bookkeeping: the summary table, the time budget -----------------------------------
declare -A STATUS SECS NOTE
declare -A LABEL=([build]="build" [tests]="cuda tests" [sanitize]="sanitizer" [kernels]="kernel table"
                  [bench]="bench" [train]="bf16 train"
                  [lora]="bf16 LoRA train" [fsdp]="FSDP smoke")
for s in $ALL_STEPS; do
  if wants "$s"; then STATUS[$s]=not-run; NOTE[$s]="not reached"; else STATUS[$s]=skipped; NOTE[$s]="not selected"; fi
  SECS[$s]=0
done
[ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ] && NOTE[build]="GPU_CHECK_SKIP_BUILD=1: the installed pyppo"
record() { STATUS[$1]=$2; SECS[$1]=$3; NOTE[$1]=${4:-}; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi; }
NEW_FAIL=0
TEST_RC=0
SAN_RC=0
KERNEL_RC=0
BENCH_RC=0

summary() {
  if [ -s "${TABLE:-/nonexistent}" ]; then
    echo
    printf '%-16s %8s  %-24s %s\n' "mode" "s/step" "peak memory" "status"
    while IFS=$'\t' read -r mode sps peak st; do printf '%-16s %8s  %-24s %s\n' "$mode" "$sps" "$peak" "$st"; done < "$TABLE"
  fi
  echo
  stamp "summary (device $DEVICE)"
  printf '%-16s %-8s %7s  %s\n' "step" "status" "seconds" "note"
  for s in $ALL_STEPS; do
    printf '%-16s %-8s %7s  %s\n' "${LABEL[$s]}" "${STATUS[$s]}" "${SECS[$s]}" "${NOTE[$s]}"
  done
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    for s in $ALL_STEPS; do printf '%s\t%s\t%s\t%s\n' "$s" "${STATUS[$s]}" "${SECS[$s]}" "${NOTE[$s]}"; done \
      > "$OUT/gpu_check_summary.tsv"
  fi
}
finish() { summary; exit "$1"; }

# ---- scratch directory ----------------------------------------------------------------------
if [ -n "${GPU_CHECK_WORK:-}" ]; then
  WORK=$GPU_CHECK_WORK; mkdir -p "$WORK"
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/pyppo_gpu_check.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
fi
WORK=$(cd "$WORK" && pwd)
TABLE=$WORK/train_table.tsv
: > "$TABLE"

stamp "environment (device $DEVICE, steps ${STEPS:-none}, budget $BUDGET s)"
GPU_CHECK_DEVICE=$DEVICE $PY - <<'PYEOF' || finish 1
import os, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
if os.environ["GPU_CHECK_DEVICE"] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device")
    if torch.version.cuda is None:
        sys.exit("gpu_check: this torch has no CUDA")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"device {i}:", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
PYEOF
if [ "$DEVICE" = cuda ]; then command -v nvcc >/dev/null && nvcc --version | tail -n 2; fi
nproc

# ---- 1. build -------------------------------------------------------------------------------
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
if wants build && [ "$DEVICE" = cpu ]; then
  record build skipped 0 "needs CUDA"
elif wants build; then
  stamp "build (pip install --no-build-isolation --no-deps -e ., PYPPO_CUDA=on, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
  t=$(cap 240); s0=$(date +%s)
  if [ "$t" -lt 20 ] || ! timeout "$t" $PY -m pip install --no-build-isolation --no-deps --no-index -e . \
        -Ccmake.define.PYPPO_CUDA=on -Cbuild.verbose=false > /tmp/pyppo_build.log 2>&1; then
    tail -n 80 /tmp/pyppo_build.log 2>/dev/null
    record build FAIL $(( $(date +%s) - s0 )) "see the build log above"
    stamp "BUILD FAILED"
    finish 1
  fi
  grep -E "pyppo: (CUDA|CPU)" /tmp/pyppo_build.log || true
  record build pass $(( $(date +%s) - s0 )) "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
fi
if [ "$DEVICE" = cuda ]; then
  $PY -c "import pyppo, pyppo._C as C; print('pyppo', pyppo.__version__, '| with_cuda', C.with_cuda, '| archs', C.cuda_archs); assert C.with_cuda" || finish 1
else
  $PY -c "import pyppo, pyppo._C as C; print('pyppo', pyppo.__version__, '| with_cuda', C.with_cuda)" || finish 1
fi

# ---- 2. CUDA tests --------------------------------------------------------------------------
if wants tests && [ "$DEVICE" = cpu ]; then
  record tests skipped 0 "needs CUDA"
elif wants tests; then
  stamp "tests (pytest -m cuda)"
  t=$(cap 120); s0=$(date +%s)
  if [ "$t" -lt 20 ]; then
    TEST_RC=124
  else
    HYPOTHESIS_PROFILE=ci timeout "$t" $PY -m pytest -m cuda -q -p no:cacheprovider --maxfail=25 --durations=5
    TEST_RC=$?
  fi
  stamp "tests exit status $TEST_RC"
  if [ "$TEST_RC" -eq 0 ]; then record tests pass $(( $(date +%s) - s0 )) "pytest -m cuda"
  elif [ "$TEST_RC" -eq 124 ]; then record tests TIMEOUT $(( $(date +%s) - s0 )) "pytest -m cuda, limit $t s"
  else record tests FAIL $(( $(date +%s) - s0 )) "pytest exit status $TEST_RC"; fi
fi

# run_logged STEP LOG LIMIT CMD...: CMD under timeout, its output in LOG; prints the gpu_check
# lines, or the log's tail on failure. Returns CMD's status (124 = timed out).
run_logged() {
  local step=$1 log=$2 limit=$3; shift 3
  local rc
  timeout -k 10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then tail -n 60 "$log"; else grep '^gpu_check' "$log"; fi
  [ "$rc" -eq 124 ] && echo "gpu_check: $step: timed out after $limit s"
  return "$rc"
}

# ---- 3. compute-sanitizer and 4. the kernel table: helper files ------------------------------
write_kernel_helpers() {
cat > "$WORK/sanitize_workload.py" <<'PYEOF'
"""Every pyppo CUDA kernel on tiny shapes, for compute-sanitizer: gather_logprobs forward (with and
without entropy, temperature 1 and not) and backward, on V = 7, 4099 and 6144, contiguous, T-sliced
and misaligned (every row one element off 16 bytes); linear_logprobs and linear_ppo_loss;
kl_penalty, shape_rewards, gae (T = 5, 1024, 2500), masked_mean / masked_var / masked_whiten; every
dtype. Each result is checked finite where it must be, so a wrong answer fails as well as a bad access."""
import torch

from pyppo import ops

P = torch.ops.pyppo
d = torch.device("cuda")
g = torch.Generator(device=d).manual_seed(0)
problems = []


def layouts(B, T, V, dtype):
    yield "contiguous", torch.randn(B, T, V, device=d, dtype=torch.float32, generator=g).to(dtype)
    yield "T-sliced", torch.randn(B, T + 2, V, device=d, dtype=torch.float32, generator=g).to(dtype)[:, 1:-1]
    flat = torch.randn(B * T * V + 1, device=d, dtype=torch.float32, generator=g).to(dtype)
    yield "misaligned", flat[1:].view(B, T, V)


for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for V in (7, 4099, 6144):
        for name, z in layouts(2, 3, V, dtype):
            labels = torch.randint(0, V, (2, 3), device=d, generator=g)
            labels[0, 0] = -100
            mask = torch.ones(2, 3, dtype=torch.bool, device=d)
            mask[1, 1] = False
            for tau, ent in ((1.0, True), (0.7, True), (1.0, False), (1.3, False)):
                lp, e, lse = P.gather_logprobs(z, labels, mask, tau, -100, ent)
                if not torch.isfinite(lp).all():
                    problems.append(f"gather_logprobs {dtype} V={V} {name}: non-finite log-probs")
                ge = torch.ones_like(lp) if ent else None
                gz = P.gather_logprobs_backward(torch.ones_like(lp), ge, z, labels, mask, lse, e if ent else None,
                                                tau, -100)
                if not torch.isfinite(gz).all():
                    problems.append(f"gather_logprobs_backward {dtype} V={V} {name}: non-finite gradient")
    h = torch.randn(2, 5, 16, device=d, generator=g).to(dtype)
    w = (torch.randn(4099, 16, device=d, generator=g) * 0.2).to(dtype)
    y = torch.randint(0, 4099, (2, 5), device=d, generator=g)
    m = torch.ones(2, 5, dtype=torch.bool, device=d)
    lp, ent, lse = P.linear_logprobs(h, w, y, m, None, 1.0, -100, True, 3)
    P.linear_logprobs_backward(torch.ones_like(lp), torch.ones_like(ent), h, w, y, m, None, lse, ent, 1.0, -100, 3,
                               [True, True, False])
    tw = ops.loss_token_weights(m)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    P.linear_ppo_loss(h, w, y, lp.to(acc), torch.randn(2, 5, device=d, generator=g).to(acc), m, tw, lp.to(acc), None,
                      1.0, -100, 0.2, 0.2, None, 0.1, "k3", 0.01, True, 3, [True, True, False])
    for T in (5, 1024, 2500):
        r = torch.randn(4, T, device=d, generator=g).to(dtype)
        v = torch.randn(4, T, device=d, generator=g).to(dtype)
        mk = torch.rand(4, T, device=d, generator=g) < 0.8
        mk[:, 0] = True
        mk[1] = False
        adv, ret = ops.gae(r, v, mk, gamma=0.99, lam=0.95, last_values=v[:, 0].contiguous())
        if not (torch.isfinite(adv).all() and torch.isfinite(ret).all()):
            problems.append(f"gae {dtype} T={T}: non-finite output")
        mk[1, 0] = True
        ops.kl_penalty(r, v, estimator="k3")
        ops.shape_rewards(v[:, 0].contiguous(), r, v, mk, kl_coef=0.05)
        ops.masked_whiten(r, mk)
        ops.masked_mean(r, mk, dim=1)
        ops.masked_var(r, mk)
torch.cuda.synchronize()
for p in problems:
    print("gpu_check: FAIL:", p)
print(f"gpu_check: sanitizer workload: {'pass' if not problems else 'FAIL'}")
raise SystemExit(1 if problems else 0)
PYEOF

cat > "$WORK/kernel_table.py" <<'PYEOF'
"""The kernel table: python kernel_table.py OUT_JSON [quick]. Times with CUDA events (median of
several repetitions after a warm-up); bandwidth is bytes moved / time, the copy's bytes being a read
and a write of the logits."""
import json, statistics, sys

import torch

from pyppo import ops

out_path = sys.argv[1]
quick = len(sys.argv) > 2 and sys.argv[2] == "quick"
P = torch.ops.pyppo
d = torch.device("cuda")
rows, problems = [], []


def timed(fn, reps=10, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def row(name, seconds, nbytes=None, copy_bw=None, target=None):
    r = {"case": name, "ms": round(seconds * 1e3, 4)}
    if nbytes is not None:
        r["GB/s"] = round(nbytes / seconds / 1e9, 1)
    if copy_bw is not None:
        r["of copy"] = round(nbytes / seconds / copy_bw, 3)
    if target is not None:
        r["target"] = target[0]
        r["status"] = "pass" if target[1] else "MISS"
    rows.append(r)
    print("gpu_check: kernel", json.dumps(r))


shape = (8, 1024, 151936) if not quick else (2, 256, 151936)
for dtype in (torch.bfloat16, torch.float32):
    N = shape[0] * shape[1]
    z = torch.randn(*shape, device=d, dtype=dtype)
    labels = torch.randint(0, shape[2], shape[:2], device=d)
    nbytes = z.numel() * z.element_size()
    t_copy = timed(lambda: z.clone())
    copy_bw = 2 * nbytes / t_copy
    tag = f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} {list(shape)}"
    row(f"device-to-device copy {tag}", t_copy, 2 * nbytes, copy_bw)
    t = timed(lambda: P.gather_logprobs(z, labels, None, 1.0, -100, False))
    row(f"gather_logprobs fwd {tag}", t, nbytes, copy_bw, (">= 0.80 of copy", nbytes / t >= 0.8 * copy_bw))
    t = timed(lambda: P.gather_logprobs(z, labels, None, 1.0, -100, True))
    row(f"gather_logprobs fwd+entropy {tag}", t, nbytes, copy_bw, (">= 0.80 of copy", nbytes / t >= 0.8 * copy_bw))
    lp, ent, lse = P.gather_logprobs(z, labels, None, 1.0, -100, True)
    g1 = torch.ones_like(lp)
    t = timed(lambda: P.gather_logprobs_backward(g1, g1, z, labels, None, lse, ent, 1.0, -100))
    row(f"gather_logprobs bwd (entropy) {tag}", t, 2 * nbytes, copy_bw, (">= 0.60 of copy", 2 * nbytes / t >= 0.6 * copy_bw))
    del z, lp, ent, lse, g1
    torch.cuda.empty_cache()

B, T = 256, 2048
r = torch.randn(B, T, device=d)
v = torch.randn(B, T, device=d)
m = torch.rand(B, T, device=d) < 0.9
t = timed(lambda: ops.gae(r, v, m, gamma=0.99, lam=0.95), reps=20)
row(f"gae fp32 [{B}, {T}]", t, B * T * (4 * 4 + 1))

M, H, V = (16384, 4096, 131072) if not quick else (2048, 4096, 131072)
hid = (torch.randn(M, H, device=d) * 0.5).to(torch.bfloat16).requires_grad_()
w = (torch.randn(V, H, device=d) * 0.02).to(torch.bfloat16).requires_grad_()
y = torch.randint(0, V, (M,), device=d)


def pyppo_linear():
    lp, ent = ops.linear_logprobs(hid, w, y, return_entropy=True)
    (lp.sum() + 0.01 * ent.sum()).backward()
    hid.grad = w.grad = None


ref_ms, ref_name = 104.0 * M / 16384, "Liger-Kernel FLCE, ~104 ms on an H100 (scaled to M)"
try:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def liger():
        loss = liger_fused_linear_cross_entropy(hid, w, y)
        loss.backward()
        hid.grad = w.grad = None

    ref_ms, ref_name = timed(liger, reps=3, warmup=1) * 1e3, "Liger-Kernel FLCE on this GPU"
    row(f"liger fused linear CE bf16 M={M} H={H} V={V}", ref_ms / 1e3)
except Exception as exc:  # noqa: BLE001 - Liger is optional here
    print(f"gpu_check: kernel: Liger-Kernel not run ({type(exc).__name__}: {exc}); comparing with {ref_ms:.0f} ms")
t = timed(pyppo_linear, reps=3, warmup=1)
row(f"linear_logprobs fwd+bwd+entropy bf16 M={M} H={H} V={V}", t, None, None,
    (f"<= {ref_ms:.1f} ms ({ref_name})", t * 1e3 <= ref_ms))

device = torch.cuda.get_device_name()
with open(out_path, "w") as f:
    json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)
missed = [r["case"] for r in rows if r.get("status") == "MISS"]
print(f"gpu_check: kernel table on {device}: {len(rows)} rows, {len(missed)} target(s) missed")
raise SystemExit(3 if missed else 0)
PYEOF
}

# ---- 3. compute-sanitizer -------------------------------------------------------------------
if wants sanitize && [ "$DEVICE" = cpu ]; then
  record sanitize skipped 0 "needs CUDA"
elif wants sanitize; then
  write_kernel_helpers
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  s0=$(date +%s); parts=""
  if [ ! -x "$SAN" ]; then
    SAN_RC=5; parts="compute-sanitizer not found"
  else
    SAN_FILTER=()
    "$SAN" --help 2>/dev/null | grep -q -- "--kernel-name" && SAN_FILTER=(--kernel-name kns=pyppo)
    for tool in memcheck racecheck; do
      lim=60; [ "$tool" = racecheck ] && lim=45
      t=$(cap "$lim")
      if [ "$t" -lt 20 ]; then SAN_RC=5; parts="$parts $tool: no time"; continue; fi
      stamp "sanitizer: compute-sanitizer --tool $tool ${SAN_FILTER[*]} (timeout $t s)"
      run_logged sanitize "$WORK/sanitize_$tool.log" "$t" "$SAN" --tool "$tool" --error-exitcode 9 \
        "${SAN_FILTER[@]}" $PY "$WORK/sanitize_workload.py"
      rc=$?
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$WORK/sanitize_$tool.log" | tail -n 1
      if [ "$rc" -eq 0 ]; then parts="$parts $tool pass"; else SAN_RC=5; parts="$parts $tool exit $rc"; fi
    done
  fi
  if [ "$SAN_RC" -eq 0 ]; then record sanitize pass $(( $(date +%s) - s0 )) "${parts# }"
  else record sanitize FAIL $(( $(date +%s) - s0 )) "${parts# }"; fi
  stamp "sanitizer: ${STATUS[sanitize]}"
fi

# ---- 4. the kernel table --------------------------------------------------------------------
if wants kernels && [ "$DEVICE" = cpu ]; then
  record kernels skipped 0 "needs CUDA"
elif wants kernels; then
  write_kernel_helpers
  t=$(cap 90); s0=$(date +%s)
  if [ "$t" -lt 20 ]; then
    KERNEL_RC=5; record kernels TIMEOUT 0 "under 20 s left of the $BUDGET s budget"
  else
    stamp "kernel table (timeout $t s)"
    run_logged kernels "$WORK/kernels.log" "$t" $PY "$WORK/kernel_table.py" "${OUT:-$WORK}/kernels.json"
    rc=$?
    case $rc in
      0) record kernels pass $(( $(date +%s) - s0 )) "every target met; ${OUT:-$WORK}/kernels.json" ;;
      3) KERNEL_RC=3; record kernels FAIL $(( $(date +%s) - s0 )) "a target missed (3); ${OUT:-$WORK}/kernels.json" ;;
      124) KERNEL_RC=5; record kernels TIMEOUT $(( $(date +%s) - s0 )) "limit $t s" ;;
      *) KERNEL_RC=5; record kernels FAIL $(( $(date +%s) - s0 )) "exit status $rc (log above)" ;;
    esac
  fi
  stamp "kernel table: ${STATUS[kernels]}"
fi

# ---- 5. benchmark ---------------------------------------------------------------------------
if wants bench && [ "$DEVICE" = cpu ]; then
  record bench skipped 0 "needs CUDA"
elif wants bench; then
  stamp "benchmark (pyppo bench --suite gpu --quick)"
  t=$(cap 180); s0=$(date +%s)
  if [ "$t" -lt 20 ]; then
    BENCH_RC=124
  else
    timeout "$t" $PY -m pyppo.bench --suite gpu --quick --check-targets --output benchmarks/results \
      ${OUT:+--json "$OUT/gpu_bench.json"}
    BENCH_RC=$?
  fi
  stamp "benchmark exit status $BENCH_RC"
  case $BENCH_RC in
    0) record bench pass $(( $(date +%s) - s0 )) "--suite gpu --quick --check-targets" ;;
    3) record bench FAIL $(( $(date +%s) - s0 )) "a performance target missed (3)" ;;
    124) record bench TIMEOUT $(( $(date +%s) - s0 )) "limit $t s" ;;
    *) record bench FAIL $(( $(date +%s) - s0 )) "exit status $BENCH_RC" ;;
  esac
fi

# ---- 6-8. training on the device: helper files ----------------------------------------------
# Parameterised by the device (GPU_CHECK_DEVICE), so tests/test_gpu_check_script.py runs the very
# same code on CPU.
write_helpers() {
cat > "$WORK/fixture.py" <<'PYEOF'
"""The tiny random Llama + character tokenizer, a reward file and a prompts file, in argv[1]."""
import json, sys
from pathlib import Path

sys.path.insert(0, "tests")
from tiny_models import save_tiny_causal_lm

work = Path(sys.argv[1])
save_tiny_causal_lm(work / "model")
(work / "reward.py").write_text(
    "def reward(prompts, responses):\n"
    "    return [r.count('e') - 0.1 * len(r) for r in responses]\n")
topics = ["the sea", "a tree", "the weather", "breakfast", "a letter", "the street", "evening", "a melody"]
with open(work / "prompts.jsonl", "w") as f:
    for t in topics:
        f.write(json.dumps({"prompt": f"Tell me about {t}."}) + "\n")
        f.write(json.dumps({"prompt": f"Describe {t} in one line."}) + "\n")
print("gpu_check: fixture in", work)
PYEOF

cat > "$WORK/train_and_check.py" <<'PYEOF'
"""python train_and_check.py MODE OUTPUT STEPS TABLE -- <pyppo train flags>: pyppo.cli.main(["train",
...]), then (rank 0) check the run and append 'mode, s/step, peak memory, status' to TABLE."""
import json, math, resource, statistics, sys

mode, out, steps, table = sys.argv[1:5]
assert sys.argv[5] == "--"
argv = ["train", *sys.argv[6:], "--output", out, "--steps", steps]
import torch
from pyppo.cli import main

rc = main(argv)
cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rcs, peaks = [rc], [(cuda_peak, rss_peak)]
import torch.distributed as dist

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
PYEOF

cat > "$WORK/fsdp_shard_check.py" <<'PYEOF'
"""One-process FSDP2 check, run under torchrun --nproc-per-node 1 (argv[1]: cuda or cpu).

pyppo.distributed.wrap is the identity with one process, so this applies its FSDP2 branch itself
(fully_shard on every transformer block, then on the LogprobHead root) in a 1-rank process group
(NCCL on cuda, gloo on cpu), and runs what the trainer runs through a sharded policy: sampling
(synced_gpus), a bf16-autocast log-prob forward (compared with an unsharded twin), the PPO policy
loss backward, an AdamW step and the full-state-dict gather of pyppo.checkpoint.training_state.
Covers: FSDP2 hooks, DTensor parameters and the gathers on this device with pyppo's ops and
autocast. Not covered: several ranks (real reduce-scatter, cross-rank reductions); those are in
tests/test_distributed.py (gloo, CPU) and, on >= 2 GPUs, the fsdp step's trainer run.
"""
import copy, os, sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, "tests")
from tiny_models import tiny_causal_lm

from pyppo import checkpoint, distributed
from pyppo.buffer import RolloutBuffer
from pyppo.config import PPOConfig
from pyppo.forward import LogprobHead, autocast
from pyppo.ops import ppo_policy_loss
from pyppo.rollout import generation_config

kind = sys.argv[1]
if kind == "cuda":
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if kind == "cuda" else "gloo")
assert dist.get_world_size() == 1, "run with --nproc-per-node 1"
bf16 = torch.bfloat16
problems = []

model = tiny_causal_lm(seed=0).to(device)
twin = copy.deepcopy(model)  # unsharded, for comparing log-probs
head = LogprobHead(model, temperature=1.0, dtype=bf16)
twin_head = LogprobHead(twin, temperature=1.0, dtype=bf16)
start = {n: p.detach().cpu().clone() for n, p in head.named_parameters()}

# pyppo.distributed.wrap(head, world, fsdp=True) with several ranks: these two steps.
blocks = distributed._block_classes(head)
layers = [m for m in head.modules() if type(m).__name__ in blocks]
for layer in layers:
    fully_shard(layer)
fully_shard(head)
params = list(head.parameters())
n_dtensor = sum(type(p).__name__ == "DTensor" for p in params)
if not layers or not distributed.is_sharded(head) or n_dtensor != len(params):
    problems.append(f"not sharded: {len(layers)} blocks, {n_dtensor}/{len(params)} DTensor parameters")

# A batch: left-padded prompts, right-padded responses of lengths 8, 5, 3, 1 (EOS = pad = 2).
g = torch.Generator().manual_seed(0)
B, P, T = 4, 6, 8
query_ids = torch.randint(4, 99, (B, P), generator=g)
query_mask = torch.ones(B, P, dtype=torch.bool)
for i in range(B):
    query_mask[i, :i] = False
    query_ids[i, :i] = 2
response_mask = torch.arange(T) < torch.tensor([8, 5, 3, 1]).unsqueeze(1)
response_ids = torch.where(response_mask, torch.randint(4, 99, (B, T), generator=g), torch.full((B, T), 2))
mb = RolloutBuffer(query_ids=query_ids, query_mask=query_mask, response_ids=response_ids,
                   response_mask=response_mask).to(device)

# Sampling through the sharded head, as the trainer's rollout does.
gen = generation_config(PPOConfig(max_new_tokens=4), eos_token_id=2, pad_token_id=2)
head.eval()
with torch.no_grad(), autocast(device, bf16):
    seqs = head(None, sample=(mb.query_ids, mb.query_mask, gen, {"synced_gpus": True}))
if seqs.shape[0] != B or not P < seqs.shape[1] <= P + 4:
    problems.append(f"sampled sequences have shape {tuple(seqs.shape)}")

head.train()
with autocast(device, bf16):
    logprobs, entropy = head(mb, True)
    with torch.no_grad():
        twin_logprobs, _ = twin_head(mb, True)
diff = float((logprobs.detach() - twin_logprobs).abs().max())
if not (torch.isfinite(logprobs).all() and torch.isfinite(entropy).all()):
    problems.append("non-finite log-probs or entropy")
if not diff <= 2e-2:
    problems.append(f"sharded log-probs differ from the unsharded twin's by {diff:.3g}")
advantages = torch.randn(B, T, generator=g).to(device) * mb.response_mask
loss, _ = ppo_policy_loss(logprobs, logprobs.detach(), advantages, mb.response_mask)
loss.backward()
grads = [p.grad for p in head.parameters() if p.grad is not None]
local = [gr.to_local() if hasattr(gr, "to_local") else gr for gr in grads]
if len(grads) != len(params) or not all(torch.isfinite(x).all() for x in local):
    problems.append(f"gradients: {len(grads)}/{len(params)} present, finite: {all(torch.isfinite(x).all() for x in local)}")
opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
opt.step()

weights, opt_state = checkpoint.training_state(head, opt, prefix="model.")
names = {n[len("model."):] for n in start}
if set(weights) != names:
    problems.append(f"full state dict has {len(weights)} weights, expected {len(names)}")
bad = [n for n, w in weights.items() if w.shape != start["model." + n].shape or not torch.isfinite(w).all()]
moved = sum(not torch.equal(w.float(), start["model." + n].float()) for n, w in weights.items() if n not in bad)
if bad:
    problems.append(f"{len(bad)} gathered weights with a wrong shape or non-finite values, e.g. {bad[0]}")
if moved < len(weights) // 2:
    problems.append(f"the AdamW step moved only {moved}/{len(weights)} weights")
moments = [v for st in opt_state.get("state", {}).values() for v in st.values()
           if isinstance(v, torch.Tensor) and v.numel() > 1]
if not moments or not all(torch.isfinite(v).all() for v in moments):
    problems.append(f"optimizer state: {len(moments)} moment tensors, finite: {all(torch.isfinite(v).all() for v in moments)}")

dist.destroy_process_group()
for p in problems:
    print("gpu_check: FAIL:", p)
print(f"gpu_check: FSDP2 shard check on {device}: {len(layers)} blocks + root sharded, {n_dtensor} DTensor "
      f"params; log-prob max |diff| vs unsharded {diff:.2g}; loss {float(loss):.4f}; AdamW moved "
      f"{moved}/{len(weights)} gathered weights: {'pass' if not problems else 'FAIL'}")
sys.exit(1 if problems else 0)
PYEOF
}


TRAIN_FLAGS=(--model "$WORK/model" --reward "$WORK/reward.py:reward" --prompts "$WORK/prompts.jsonl"
             --device "$DEVICE" --dtype bfloat16 --batch-size 8 --mini-batch-size 4 --ppo-epochs 1
             --max-new-tokens 16 --save-every 3)
# shellcheck disable=SC2206
EXTRA_FLAGS=($TRAIN_ARGS)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

# train_step STEP MODE LIMIT [flags...]: one checked pyppo train run, 3 steps.
train_step() {
  local step=$1 mode=$2 limit=$3; shift 3
  local t s0 rc
  t=$(cap "$limit")
  if [ "$t" -lt 20 ]; then record "$step" TIMEOUT 0 "under 20 s left of the $BUDGET s budget"; NEW_FAIL=1; return; fi
  stamp "${LABEL[$step]} (pyppo train --device $DEVICE --dtype bfloat16 --steps 3 $*; timeout $t s)"
  s0=$(date +%s)
  run_logged "$step" "$WORK/$step.log" "$t" $PY "$WORK/train_and_check.py" "$mode" "$WORK/run_$step" 3 "$TABLE" \
    -- "${TRAIN_FLAGS[@]}" "$@" ${EXTRA_FLAGS[@]+"${EXTRA_FLAGS[@]}"}
  rc=$?
  [ -n "${OUT:-}" ] && [ -f "$WORK/run_$step/metrics.jsonl" ] && mkdir -p "$OUT" \
    && cp "$WORK/run_$step/metrics.jsonl" "$OUT/train_${step}_metrics.jsonl"
  if [ "$rc" -eq 0 ]; then record "$step" pass $(( $(date +%s) - s0 )) "$(grep -o '[0-9.]* s/step.*peak [^:]*' "$WORK/$step.log" | tail -n 1)"
  elif [ "$rc" -eq 124 ]; then record "$step" TIMEOUT $(( $(date +%s) - s0 )) "limit $t s"; NEW_FAIL=1; printf '%s\t-\t-\tTIMEOUT\n' "$mode" >> "$TABLE"
  else record "$step" FAIL $(( $(date +%s) - s0 )) "exit status $rc (log above)"; NEW_FAIL=1
       grep -q "^$mode"$'\t' "$TABLE" || printf '%s\t-\t-\tFAIL\n' "$mode" >> "$TABLE"; fi
  stamp "${LABEL[$step]}: ${STATUS[$step]}"
}

if wants train || wants lora || wants fsdp; then
  stamp "fixture (tiny random Llama, reward, prompts in $WORK)"
  write_helpers
  t=$(cap 60)
  if [ "$t" -lt 20 ]; then
    for s in train lora fsdp; do wants $s && record $s TIMEOUT 0 "under 20 s left of the $BUDGET s budget"; done
    NEW_FAIL=1
    STEPS=""
  elif ! run_logged fixture "$WORK/fixture.log" "$t" $PY "$WORK/fixture.py" "$WORK"; then
    for s in train lora fsdp; do wants $s && record $s FAIL 0 "the tiny model fixture failed"; done
    NEW_FAIL=1
    STEPS=""
  fi
fi

# ---- 6. bf16 training run -------------------------------------------------------------------
wants train && train_step train "bf16" 120
# ---- 7. bf16 LoRA training run --------------------------------------------------------------
wants lora && train_step lora "bf16 LoRA r8" 120 --lora-rank 8

# ---- 8. FSDP2 smoke test --------------------------------------------------------------------
if wants fsdp; then
  if [ -n "${GPU_CHECK_NPROC:-}" ]; then NPROC=$GPU_CHECK_NPROC
  elif [ "$DEVICE" = cuda ] && [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then NPROC=2
  else NPROC=1; fi
  TORCHRUN=($PY -m torch.distributed.run --standalone --nproc-per-node)
  s0=$(date +%s); parts=""; ok=1; timed_out=0
  t=$(cap 150)
  if [ "$t" -lt 20 ]; then
    ok=0; timed_out=1; parts="trainer: no time"
  else
    stamp "FSDP smoke (a): torchrun --nproc-per-node $NPROC pyppo train --fsdp --lora-rank 8 --steps 2 (timeout $t s)"
    run_logged fsdp "$WORK/fsdp_train.log" "$t" "${TORCHRUN[@]}" "$NPROC" "$WORK/train_and_check.py" \
      "FSDP LoRA ${NPROC}p" "$WORK/run_fsdp" 2 "$TABLE" -- "${TRAIN_FLAGS[@]}" --fsdp --lora-rank 8 \
      ${EXTRA_FLAGS[@]+"${EXTRA_FLAGS[@]}"}
    rc=$?
    [ -n "${OUT:-}" ] && [ -f "$WORK/run_fsdp/metrics.jsonl" ] && mkdir -p "$OUT" \
      && cp "$WORK/run_fsdp/metrics.jsonl" "$OUT/train_fsdp_metrics.jsonl"
    if [ "$rc" -eq 0 ]; then parts="trainer ${NPROC}p pass"
    else ok=0; [ "$rc" -eq 124 ] && timed_out=1; parts="trainer ${NPROC}p exit $rc"
         grep -q "^FSDP LoRA ${NPROC}p"$'\t' "$TABLE" || printf '%s\t-\t-\tFAIL\n' "FSDP LoRA ${NPROC}p" >> "$TABLE"; fi
  fi
  t=$(cap 90)
  if [ "$t" -lt 20 ]; then
    ok=0; timed_out=1; parts="$parts, shard check: no time"
  else
    stamp "FSDP smoke (b): one-process fully_shard check on $DEVICE (timeout $t s)"
    run_logged fsdp "$WORK/fsdp_shard.log" "$t" "${TORCHRUN[@]}" 1 "$WORK/fsdp_shard_check.py" "$DEVICE"
    rc=$?
    if [ "$rc" -eq 0 ]; then parts="$parts, 1-rank shard check pass"
    else ok=0; [ "$rc" -eq 124 ] && timed_out=1; parts="$parts, 1-rank shard check exit $rc"; fi
  fi
  if [ "$ok" -eq 1 ]; then record fsdp pass $(( $(date +%s) - s0 )) "$parts"
  elif [ "$timed_out" -eq 1 ]; then record fsdp TIMEOUT $(( $(date +%s) - s0 )) "$parts"; NEW_FAIL=1
  else record fsdp FAIL $(( $(date +%s) - s0 )) "$parts"; NEW_FAIL=1; fi
  stamp "FSDP smoke: ${STATUS[fsdp]}"
fi

stamp "done: tests $TEST_RC, sanitizer $SAN_RC, kernel table $KERNEL_RC, benchmark $BENCH_RC, training/FSDP $([ "$NEW_FAIL" -eq 0 ] && echo pass || echo FAIL)"
if [ "$TEST_RC" -ne 0 ]; then finish "$TEST_RC"; fi
if [ "$SAN_RC" -ne 0 ]; then finish "$SAN_RC"; fi
if [ "$BENCH_RC" -ne 0 ]; then finish "$BENCH_RC"; fi
if [ "$KERNEL_RC" -ne 0 ]; then finish "$KERNEL_RC"; fi
if [ "$NEW_FAIL" -ne 0 ]; then finish 4; fi
finish 0
