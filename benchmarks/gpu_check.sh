#!/usr/bin/env bash
# GPU check of pyppo, in one go, on a fresh CUDA machine with no network whose image has torch
# (with CUDA), nvcc, cmake, ninja, pybind11, scikit-build-core, transformers, peft and accelerate.
# The Python packages pyppo needs that the image lacks travel as wheels in build/gpu_wheels
# (GPU_CHECK_WHEELS; scripts/gpu_rehearsal.sh builds that folder): when it holds any, they are
# installed first with pip install --no-index --no-deps.
# No downloaded model is needed: the training steps use a tiny random Llama
# (tests/support/tiny_models.py) written to a temporary directory. The Python programs it runs are
# files in gpu/ next to this script (benchmarks/gpu/*.py, each one's docstring gives its arguments),
# named below. First the environment check (gpu/env_check.py: python, torch, the devices and every
# Python package the steps import; no CUDA device with GPU_CHECK_DEVICE=cuda, or a missing package,
# named in one line = exit 1), then these steps, each with a timeout, in order:
#   build   scripts/build_cuda.sh -e --no-index: finds the CUDA toolkit and nvrtc (system, or
#           torch's nvidia-* wheels), then builds pyppo in place with the CUDA kernels
#           (PYPPO_CUDA=on: a CPU-only build is an error) for TORCH_CUDA_ARCH_LIST (default 9.0,
#           the H100/H200's sm_90), on nproc jobs; it needs nvcc, not a GPU, so it runs with
#           GPU_CHECK_DEVICE=cpu too; the built pyppo must import with CUDA;
#   tests   the CUDA tests (pytest -m cuda): the op tests on the device, the kernels against
#           their float32 replays (tests/ops/test_cuda_emulation.py), the contract checks (log-probs
#           <= 0 and exactly 0 where certain, huge finite logits, GAE bits under right padding,
#           T-sliced views read in place, the CPU's errors), no host sync under
#           torch.cuda.set_sync_debug_mode("error") and CUDA-graph capture
#           (tests/ops/test_cuda_graphs.py);
#   sanitize  compute-sanitizer memcheck, then racecheck, over every pyppo kernel on tiny shapes
#           (V = 7, 4099 and a misaligned 6144; T = 5, 1024, 2500; every dtype), pyppo's kernels
#           only (--kernel-name kns=pyppo where the sanitizer has that option), the workload being
#           gpu/sanitize_workload.py;
#   kernels the kernel table (gpu/kernel_table.py): gather_logprobs forward (with and without
#           entropy) and backward on logits [8, 1024, 151936] in bf16 and fp32, each against a
#           device-to-device copy of the same bytes (targets: forward >= 80% of copy bandwidth,
#           backward >= 60%); GAE and turn GAE on [256, 2048]; linear_logprobs forward+backward
#           with entropy at Liger-Kernel's fused linear cross-entropy shape (M = 16384, H = 4096, V = 131072,
#           bf16; target: no slower than Liger's, about 104 ms on an H100, or Liger itself when it
#           is installed);
#           writes kernels.json (to OUT when set);
#   bench   the GPU suite of the benchmark harness (pyppo bench --suite gpu --quick --check-targets);
#   train   pyppo train --device cuda --dtype bfloat16 --steps 3 on the tiny Llama, through a small
#           wrapper (gpu/train_and_check.py; the model, reward and prompts written first by
#           gpu/fixture.py) that calls pyppo.cli.main and then checks the run: 3 rows in
#           metrics.jsonl, first_max_abs_logratio == 0 and kl_mean == 0 at step 1 (the first
#           ratio is exactly 1), finite score_mean / policy_loss everywhere, policy/ loads with
#           AutoModelForCausalLM.from_pretrained and gives finite logits; reports the median
#           step_seconds and the peak memory (torch.cuda.max_memory_allocated);
#   lora    the same with --lora-rank 8;
#   fsdp    FSDP2 smoke test, two parts:
#           (a) torchrun -m pyppo train --fsdp --lora-rank 8 --steps 2 (same checks), with 2
#               processes when the machine has >= 2 GPUs, else 1. With ONE process the trainer does
#               not shard (pyppo.distributed.wrap is the identity when the world size is 1), so
#               this part then only checks that the --fsdp run works under torchrun;
#           (b) a one-process torchrun script that does shard (gpu/fsdp_shard_check.py): a 1-rank
#               NCCL group, fully_shard on every decoder block and then on the LogprobHead root
#               (the two steps of pyppo.distributed.wrap), sampling through the sharded head
#               (synced_gpus), one bf16-autocast forward (log-probs vs the unsharded twin) /
#               backward of the PPO policy loss on a RolloutBuffer, an AdamW step, and
#               pyppo.run.checkpoint.training_state's full-state-dict gather; all finite.
#           Not covered on one GPU: anything that needs several ranks (reduce-scatter of real
#           shards, the cross-rank whitening / metrics). Those run on CPU with gloo in
#           tests/test_distributed.py, and here in part (a) when there are >= 2 GPUs;
#   vllm    the train step sampled by vLLM (--rollout-engine vllm, on a tiny Llama with head_dim
#           32: model_vllm/ of the fixture), with the same checks plus a finite
#           mismatch_logprob_diff_max at every step (printed with mismatch_kl_k3 and
#           time_weight_sync); reported as skipped where vLLM does not import (the GPU image has
#           none, and its CUDA wheels are far over the 64 MiB a call carries).
# The whole script stops within GPU_CHECK_BUDGET seconds (default 360, 6 minutes: the first GPU
# run has about 15 minutes in all, machine start and one rerun included): every step's timeout is
# capped by the time left, and a step with under 20 s left is reported as TIMEOUT. The default
# steps (build, tests, sanitize, kernels) fit that budget with a cold build: about 15 s of
# environment check and wheels, the build about 80 s on 16 cores (scripts/gpu_rehearsal.sh's
# estimate from its ninja log; benchmarks/README.md) under a 150 s timeout, then 80 + 40 + 30 + 45;
# bench, train, lora, fsdp and vllm are selected with GPU_CHECK_STEPS. Step timeouts: build 150
# (GPU_CHECK_BUILD_TIMEOUT), tests 80, sanitize 40 + 30, kernels 45, bench 180, train 120,
# lora 120, fsdp 150 + 90, vllm 150.
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
#   OUT                   results go there as they come, so a run cut short keeps what it measured
#                         (at most 8 files, each capped at 16 MiB): gpu_check.log (all of this
#                         output, from the start), gpu_check_summary.tsv (rewritten after every
#                         step), build.log, kernels.json (rewritten after every row),
#                         gpu_bench.json (at the end of bench), and each training run's
#                         metrics.jsonl as train_<step>_metrics.jsonl
#                         (else the bench JSON is dated in benchmarks/results/)
#   PYTHON                the interpreter (default python)
#   GPU_CHECK_STEPS       comma list of steps to run (default build,tests,sanitize,kernels; all:
#                         build,tests,sanitize,kernels,bench,train,lora,fsdp,vllm)
#   GPU_CHECK_SKIP_BUILD  1 = no build step: use the pyppo already installed
#   GPU_CHECK_BUILD_TIMEOUT  seconds for the build step (default 150)
#   GPU_CHECK_WHEELS      folder of wheels installed first (default build/gpu_wheels; none = skip)
#   GPU_CHECK_DEVICE      cuda (default) or cpu: cpu runs train / lora / fsdp on the CPU (gloo
#                         instead of NCCL), builds (with CUDA, when selected: it needs nvcc, not a
#                         GPU) and reports tests / sanitize / kernels / bench as skipped; this is
#                         how tests/tools/test_gpu_check_script.py and scripts/gpu_rehearsal.sh
#                         run the script on a machine with no GPU
#   GPU_CHECK_NPROC       processes of the fsdp step's trainer run (default 2 with >= 2 GPUs, else 1)
#   GPU_CHECK_TRAIN_ARGS  extra flags appended to every pyppo train run (e.g. --gradient-checkpointing)
#   GPU_CHECK_BUDGET      seconds for the whole script (default 360)
#   GPU_CHECK_WORK        scratch directory, kept (default: a temporary one, removed at the end)
# Results: the log on stdout (and in $OUT/gpu_check.log).
set -uo pipefail
HELPERS=$(cd "$(dirname "$0")" && pwd)/gpu  # the steps' Python programs
cd "$(dirname "$0")/.."
T0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

PY=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
STEPS=${GPU_CHECK_STEPS:-build,tests,sanitize,kernels}
BUDGET=${GPU_CHECK_BUDGET:-360}
TRAIN_ARGS=${GPU_CHECK_TRAIN_ARGS:-}
BUILD_TIMEOUT=${GPU_CHECK_BUILD_TIMEOUT:-150}
WHEELS=${GPU_CHECK_WHEELS:-build/gpu_wheels}
ALL_STEPS="build tests sanitize kernels bench train lora fsdp vllm"

bad_setting() { echo "gpu_check: $*" >&2; exit 64; }
case "$DEVICE" in cuda|cpu) ;; *) bad_setting "GPU_CHECK_DEVICE must be cuda or cpu, got '$DEVICE'" ;; esac
case "$BUDGET" in ''|*[!0-9]*) bad_setting "GPU_CHECK_BUDGET must be a whole number of seconds, got '$BUDGET'" ;; esac
for s in ${STEPS//,/ }; do
  case " $ALL_STEPS " in *" $s "*) ;; *) bad_setting "unknown step '$s' in GPU_CHECK_STEPS (steps: ${ALL_STEPS// /,})" ;; esac
done
case "$BUILD_TIMEOUT" in ''|*[!0-9]*) bad_setting "GPU_CHECK_BUILD_TIMEOUT must be a whole number of seconds, got '$BUILD_TIMEOUT'" ;; esac
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then STEPS=",$STEPS,"; STEPS=${STEPS//,build,/,}; fi
STEPS=$(echo "$STEPS" | tr -s ',' | sed 's/^,//; s/,$//')
wants() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# ---- OUT: everything is written there as it happens (a run cut short keeps what it measured) --
# At most 8 files, each capped at 16 MiB: gpu_check.log (this output), build.log,
# gpu_check_summary.tsv (rewritten after every step), kernels.json (after every row),
# gpu_bench.json, train_{train,lora,fsdp}_metrics.jsonl.
OUT_CAP=16000000
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -p >(head -c "$OUT_CAP" > "$OUT/gpu_check.log")) 2>&1
  TEE_PID=$!
fi
# to_out SRC NAME: a copy of SRC as $OUT/NAME, its last 16 MiB at most.
to_out() { [ -n "${OUT:-}" ] && [ -f "$1" ] && tail -c "$OUT_CAP" "$1" > "$OUT/$2"; return 0; }

# ---- step bookkeeping: the summary table, the time budget -----------------------------------
declare -A STATUS SECS NOTE
declare -A LABEL=([build]="build" [tests]="cuda tests" [sanitize]="sanitizer" [kernels]="kernel table"
                  [bench]="bench" [train]="bf16 train"
                  [lora]="bf16 LoRA train" [fsdp]="FSDP smoke" [vllm]="bf16 vLLM train")
for s in $ALL_STEPS; do
  if wants "$s"; then STATUS[$s]=not-run; NOTE[$s]="not reached"; else STATUS[$s]=skipped; NOTE[$s]="not selected"; fi
  SECS[$s]=0
done
[ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ] && NOTE[build]="GPU_CHECK_SKIP_BUILD=1: the installed pyppo"
record() { STATUS[$1]=$2; SECS[$1]=$3; NOTE[$1]=${4:-}; write_summary; }
write_summary() {
  [ -n "${OUT:-}" ] || return 0
  for s in $ALL_STEPS; do printf '%s\t%s\t%s\t%s\n' "$s" "${STATUS[$s]}" "${SECS[$s]}" "${NOTE[$s]}"; done \
    > "$OUT/gpu_check_summary.tsv.tmp" && mv "$OUT/gpu_check_summary.tsv.tmp" "$OUT/gpu_check_summary.tsv"
}
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
  write_summary
}
# finish STATUS: the summary, then (with OUT) gpu_check.log complete before the exit.
finish() {
  summary
  if [ -n "${TEE_PID:-}" ]; then exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null; sleep 0.2; fi
  exit "$1"
}

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

write_summary
stamp "environment (device $DEVICE, steps ${STEPS:-none}, budget $BUDGET s)"
# The Python packages the image lacks travel as wheels (scripts/gpu_rehearsal.sh builds the folder).
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  stamp "wheels: pip install --no-index --no-deps $WHEELS/*.whl ($(ls "$WHEELS"/*.whl | wc -l) wheels)"
  $PY -m pip install --quiet --no-index --no-deps --disable-pip-version-check "$WHEELS"/*.whl || finish 1
fi
GPU_CHECK_BUILDS=$(wants build && echo 1 || echo 0) GPU_CHECK_DEVICE=$DEVICE $PY "$HELPERS/env_check.py" || finish 1
if [ "$DEVICE" = cuda ]; then command -v nvcc >/dev/null && nvcc --version | tail -n 2; fi
nproc

# ---- 1. build -------------------------------------------------------------------------------
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
BUILT=0
if wants build; then
  # scripts/build_cuda.sh finds the toolkit and nvrtc (system or torch's nvidia-* wheels) and runs
  # pip install -e . with PYPPO_CUDA=on. It needs nvcc, not a GPU: GPU_CHECK_DEVICE=cpu builds too.
  stamp "build (scripts/build_cuda.sh -e --no-index: PYPPO_CUDA=on, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, $CMAKE_BUILD_PARALLEL_LEVEL jobs)"
  t=$(cap "$BUILD_TIMEOUT"); s0=$(date +%s)
  if [ "$t" -lt 20 ]; then
    record build TIMEOUT 0 "under 20 s left of the $BUDGET s budget"; stamp "BUILD NOT RUN"; finish 1
  fi
  PYTHON=$PY PYPPO_BUILD_LOG=$WORK/build.log timeout -k 10 "$t" bash scripts/build_cuda.sh -e --no-index
  rc=$?
  to_out "$WORK/build.log" build.log
  if [ "$rc" -ne 0 ]; then
    if [ "$rc" -eq 124 ]; then record build TIMEOUT $(( $(date +%s) - s0 )) "limit $t s (build.log)"
    else record build FAIL $(( $(date +%s) - s0 )) "exit status $rc (build_cuda: line above, build.log)"; fi
    stamp "BUILD FAILED"
    finish 1
  fi
  BUILT=1
  record build pass $(( $(date +%s) - s0 )) "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
fi
if [ "$DEVICE" = cuda ] || [ "$BUILT" = 1 ]; then
  $PY -c "import pyppo, pyppo._C as C; print('pyppo', pyppo.__version__, '| with_cuda', C.with_cuda, '| archs', C.cuda_archs); assert C.with_cuda" || finish 1
else
  $PY -c "import pyppo, pyppo._C as C; print('pyppo', pyppo.__version__, '| with_cuda', C.with_cuda)" || finish 1
fi

# ---- 2. CUDA tests --------------------------------------------------------------------------
if wants tests && [ "$DEVICE" = cpu ]; then
  record tests skipped 0 "needs CUDA"
elif wants tests; then
  stamp "tests (pytest -m cuda)"
  t=$(cap 80); s0=$(date +%s)
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

# ---- 3. compute-sanitizer -------------------------------------------------------------------
if wants sanitize && [ "$DEVICE" = cpu ]; then
  record sanitize skipped 0 "needs CUDA"
elif wants sanitize; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  s0=$(date +%s); parts=""
  if [ ! -x "$SAN" ]; then
    SAN_RC=5; parts="compute-sanitizer not found"
  else
    SAN_FILTER=()
    "$SAN" --help 2>/dev/null | grep -q -- "--kernel-name" && SAN_FILTER=(--kernel-name kns=pyppo)
    for tool in memcheck racecheck; do
      lim=40; [ "$tool" = racecheck ] && lim=30
      t=$(cap "$lim")
      if [ "$t" -lt 20 ]; then SAN_RC=5; parts="$parts $tool: no time"; continue; fi
      stamp "sanitizer: compute-sanitizer --tool $tool ${SAN_FILTER[*]} (timeout $t s)"
      run_logged sanitize "$WORK/sanitize_$tool.log" "$t" "$SAN" --tool "$tool" --error-exitcode 9 \
        "${SAN_FILTER[@]}" $PY "$HELPERS/sanitize_workload.py"
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
  t=$(cap 45); s0=$(date +%s)
  if [ "$t" -lt 20 ]; then
    KERNEL_RC=5; record kernels TIMEOUT 0 "under 20 s left of the $BUDGET s budget"
  else
    stamp "kernel table (timeout $t s)"
    run_logged kernels "$WORK/kernels.log" "$t" $PY "$HELPERS/kernel_table.py" "${OUT:-$WORK}/kernels.json"
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
    timeout "$t" $PY -m pyppo bench --suite gpu --quick --check-targets --output benchmarks/results \
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

# ---- 6-8. training on the device --------------------------------------------------------------
# fixture.py, train_and_check.py and fsdp_shard_check.py are parameterised by the device
# (GPU_CHECK_DEVICE), so tests/tools/test_gpu_check_script.py runs the very same code on CPU.
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
  run_logged "$step" "$WORK/$step.log" "$t" $PY "$HELPERS/train_and_check.py" "$mode" "$WORK/run_$step" 3 "$TABLE" \
    -- "${TRAIN_FLAGS[@]}" "$@" ${EXTRA_FLAGS[@]+"${EXTRA_FLAGS[@]}"}
  rc=$?
  # vllm's rows stay in the log (train_and_check.py prints its mismatch): OUT holds 8 files at most.
  [ "$step" = vllm ] || to_out "$WORK/run_$step/metrics.jsonl" "train_${step}_metrics.jsonl"
  if [ "$rc" -eq 0 ]; then record "$step" pass $(( $(date +%s) - s0 )) "$(grep -o '[0-9.]* s/step.*peak [^:]*' "$WORK/$step.log" | tail -n 1)"
  elif [ "$rc" -eq 124 ]; then record "$step" TIMEOUT $(( $(date +%s) - s0 )) "limit $t s"; NEW_FAIL=1; printf '%s\t-\t-\tTIMEOUT\n' "$mode" >> "$TABLE"
  else record "$step" FAIL $(( $(date +%s) - s0 )) "exit status $rc (log above)"; NEW_FAIL=1
       grep -q "^$mode"$'\t' "$TABLE" || printf '%s\t-\t-\tFAIL\n' "$mode" >> "$TABLE"; fi
  stamp "${LABEL[$step]}: ${STATUS[$step]}"
}

if wants train || wants lora || wants fsdp || wants vllm; then
  stamp "fixture (tiny random Llama, reward, prompts in $WORK)"
  t=$(cap 60)
  if [ "$t" -lt 20 ]; then
    for s in train lora fsdp vllm; do wants $s && record $s TIMEOUT 0 "under 20 s left of the $BUDGET s budget"; done
    NEW_FAIL=1
    STEPS=""
  elif ! run_logged fixture "$WORK/fixture.log" "$t" $PY "$HELPERS/fixture.py" "$WORK"; then
    for s in train lora fsdp vllm; do wants $s && record $s FAIL 0 "the tiny model fixture failed"; done
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
    run_logged fsdp "$WORK/fsdp_train.log" "$t" "${TORCHRUN[@]}" "$NPROC" "$HELPERS/train_and_check.py" \
      "FSDP LoRA ${NPROC}p" "$WORK/run_fsdp" 2 "$TABLE" -- "${TRAIN_FLAGS[@]}" --fsdp --lora-rank 8 \
      ${EXTRA_FLAGS[@]+"${EXTRA_FLAGS[@]}"}
    rc=$?
    to_out "$WORK/run_fsdp/metrics.jsonl" train_fsdp_metrics.jsonl
    if [ "$rc" -eq 0 ]; then parts="trainer ${NPROC}p pass"
    else ok=0; [ "$rc" -eq 124 ] && timed_out=1; parts="trainer ${NPROC}p exit $rc"
         grep -q "^FSDP LoRA ${NPROC}p"$'\t' "$TABLE" || printf '%s\t-\t-\tFAIL\n' "FSDP LoRA ${NPROC}p" >> "$TABLE"; fi
  fi
  t=$(cap 90)
  if [ "$t" -lt 20 ]; then
    ok=0; timed_out=1; parts="$parts, shard check: no time"
  else
    stamp "FSDP smoke (b): one-process fully_shard check on $DEVICE (timeout $t s)"
    run_logged fsdp "$WORK/fsdp_shard.log" "$t" "${TORCHRUN[@]}" 1 "$HELPERS/fsdp_shard_check.py" "$DEVICE"
    rc=$?
    if [ "$rc" -eq 0 ]; then parts="$parts, 1-rank shard check pass"
    else ok=0; [ "$rc" -eq 124 ] && timed_out=1; parts="$parts, 1-rank shard check exit $rc"; fi
  fi
  if [ "$ok" -eq 1 ]; then record fsdp pass $(( $(date +%s) - s0 )) "$parts"
  elif [ "$timed_out" -eq 1 ]; then record fsdp TIMEOUT $(( $(date +%s) - s0 )) "$parts"; NEW_FAIL=1
  else record fsdp FAIL $(( $(date +%s) - s0 )) "$parts"; NEW_FAIL=1; fi
  stamp "FSDP smoke: ${STATUS[fsdp]}"
fi

# ---- 9. bf16 training run sampled by vLLM --------------------------------------------------------
# Only where vLLM imports: the GPU image has none, and vLLM's CUDA wheels (hundreds of MB, built
# for one torch) cannot travel in the 64 MiB a call carries; install vllm on the image for it.
if wants vllm; then
  if ! VLLM_ENABLE_V1_MULTIPROCESSING=0 $PY -c "import vllm" > "$WORK/vllm_import.log" 2>&1; then
    record vllm skipped 0 "vLLM is not importable here: $(tail -n 1 "$WORK/vllm_import.log" | cut -c1-160)"
    stamp "bf16 vLLM train: skipped (vLLM is not importable)"
  elif [ "$DEVICE" = cuda ]; then
    train_step vllm "bf16 vLLM" 150 --model "$WORK/model_vllm" --rollout-engine vllm --vllm-gpu-memory-utilization 0.25
  else
    train_step vllm "bf16 vLLM" 150 --model "$WORK/model_vllm" --rollout-engine vllm --vllm-kv-cache-gib 0.125
  fi
fi

stamp "done: tests $TEST_RC, sanitizer $SAN_RC, kernel table $KERNEL_RC, benchmark $BENCH_RC, training/FSDP $([ "$NEW_FAIL" -eq 0 ] && echo pass || echo FAIL)"
if [ "$TEST_RC" -ne 0 ]; then finish "$TEST_RC"; fi
if [ "$SAN_RC" -ne 0 ]; then finish "$SAN_RC"; fi
if [ "$BENCH_RC" -ne 0 ]; then finish "$BENCH_RC"; fi
if [ "$KERNEL_RC" -ne 0 ]; then finish "$KERNEL_RC"; fi
if [ "$NEW_FAIL" -ne 0 ]; then finish 4; fi
finish 0
