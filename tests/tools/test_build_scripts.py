"""scripts/build_cuda.sh's discovery of the CUDA toolkit and nvrtc, and its one-line errors, on fake
toolkit directories (``--print``: it reports what it found and builds nothing), plus the syntax and
documented settings of scripts/gpu_rehearsal.sh. A fake ``python`` stands in for torch, so these run
in a second each, without a CUDA torch."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "scripts" / "build_cuda.sh"
REHEARSAL = ROOT / "scripts" / "gpu_rehearsal.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_python(tmp: Path, torch: str = "2.11.0+cu130", cuda: str = "13.0", importable: bool = True) -> Path:
    """A `python` that answers build_cuda.sh's one question (torch's version, CUDA and site-packages)."""
    site = tmp / "site-packages"
    site.mkdir(exist_ok=True)
    body = f"cat > /dev/null\nprintf '%s\\n%s\\n%s\\n' '{torch}' '{cuda}' '{site}'\n" if importable else "exit 1\n"
    return _exe(tmp / "fakepy" / "python", "#!/bin/sh\n" + body)


def fake_toolkit(root: Path, release: str = "13.0", nvrtc_in: str | None = "lib64") -> Path:
    """bin/nvcc (answers --version and --dryrun as nvcc does), include/cuda_runtime.h, maybe lib64/libnvrtc.so."""
    _exe(
        root / "bin" / "nvcc",
        "#!/bin/sh\n"
        f'case "$*" in *--version*) echo "Cuda compilation tools, release {release}, V{release}.88" ;;\n'
        f'  *--dryrun*) echo "#\\$ TOP={root}/bin/.." >&2 ;; esac\n',
    )
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / "include" / "cuda_runtime.h").write_text("")
    if nvrtc_in:
        (root / nvrtc_in).mkdir(parents=True, exist_ok=True)
        (root / nvrtc_in / "libnvrtc.so").write_text("")
    return root


def run_build(tmp: Path, python: Path, *args: str, path_dirs: tuple[Path, ...] = (), **env: str):
    clean = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CUDACXX", "PYPPO_NVRTC")}
    clean.update(
        PYTHON=str(python),
        PYPPO_CUDA_DIRS="",
        TORCH_CUDA_ARCH_LIST="9.0",
        CMAKE_BUILD_PARALLEL_LEVEL="2",
        PATH=os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"]),
    )
    clean.update(env)
    return subprocess.run(["bash", str(BUILD), "--print", *args], capture_output=True, text=True, env=clean, timeout=60)


def found(res: subprocess.CompletedProcess) -> dict[str, str]:
    assert res.returncode == 0, res.stdout + res.stderr
    return dict(line[len("build_cuda: ") :].split("=", 1) for line in res.stdout.splitlines() if "=" in line)


def test_toolkit_from_cuda_home_and_nvrtc_from_torchs_nvidia_wheels(tmp_path):
    # The GPU-less machine's case: the system toolkit has no nvrtc, torch's nvidia/cu13 wheel does.
    py = fake_python(tmp_path)
    tk = fake_toolkit(tmp_path / "cuda-13.0", nvrtc_in=None)
    wheel_lib = tmp_path / "site-packages" / "nvidia" / "cu13" / "lib"
    wheel_lib.mkdir(parents=True)
    (wheel_lib / "libnvrtc.so.13").write_text("")  # the wheels ship only the versioned name
    got = found(run_build(tmp_path, py, CUDA_HOME=str(tk)))
    assert got["ROOT"] == str(tk) and got["NVCC"] == f"{tk}/bin/nvcc" and got["NVCC_VERSION"] == "13.0"
    assert got["NVRTC"] == str(wheel_lib / "libnvrtc.so.13")
    assert got["TORCH_CUDA"] == "13.0" and got["ARCHS"] == "9.0" and got["JOBS"] == "2"


def test_a_wrapper_nvcc_on_path_resolves_to_its_toolkit(tmp_path):
    # /usr/local/bin/nvcc here is `exec /usr/local/cuda-13.0/bin/nvcc "$@"`: its directory is no toolkit.
    py = fake_python(tmp_path)
    tk = fake_toolkit(tmp_path / "cuda-13.0")
    wrapper = _exe(tmp_path / "wrapbin" / "nvcc", f'#!/bin/sh\nexec {tk}/bin/nvcc "$@"\n')
    got = found(run_build(tmp_path, py, path_dirs=(wrapper.parent,)))
    assert got["ROOT"] == str(tk) and got["NVRTC"] == str(tk / "lib64" / "libnvrtc.so")


def test_the_toolkits_own_nvrtc_comes_first(tmp_path):
    py = fake_python(tmp_path)
    tk = fake_toolkit(tmp_path / "tk", nvrtc_in="targets/x86_64-linux/lib")
    wheel_lib = tmp_path / "site-packages" / "nvidia" / "cu13" / "lib"
    wheel_lib.mkdir(parents=True)
    (wheel_lib / "libnvrtc.so.13").write_text("")
    got = found(run_build(tmp_path, py, CUDA_HOME=str(tk)))
    assert got["NVRTC"] == str(tk / "targets" / "x86_64-linux" / "lib" / "libnvrtc.so")


def test_a_toolkit_of_another_cuda_major_is_passed_over(tmp_path):
    py = fake_python(tmp_path)
    old = fake_toolkit(tmp_path / "cuda-12.8", release="12.8")
    new = fake_toolkit(tmp_path / "cuda-13.0")
    got = found(run_build(tmp_path, py, CUDA_HOME=str(old), PYPPO_CUDA_DIRS=str(new)))
    assert got["ROOT"] == str(new)


def test_a_toolkit_in_torchs_nvidia_wheels_is_found(tmp_path):
    py = fake_python(tmp_path)
    tk = fake_toolkit(tmp_path / "site-packages" / "nvidia" / "cu13", nvrtc_in="lib")
    got = found(run_build(tmp_path, py))
    assert got["ROOT"] == str(tk)


def one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_cuda: "), res.stderr
    return lines[0]


def test_no_toolkit_is_one_line_naming_it(tmp_path):
    line = one_error_line(run_build(tmp_path, fake_python(tmp_path)))
    assert "CUDA 13.x toolkit (bin/nvcc + include/cuda_runtime.h) not found" in line and "set CUDA_HOME" in line


def test_only_a_toolkit_of_the_wrong_major_is_one_line_naming_what_was_tried(tmp_path):
    old = fake_toolkit(tmp_path / "cuda-12.8", release="12.8")
    line = one_error_line(run_build(tmp_path, fake_python(tmp_path), CUDA_HOME=str(old)))
    assert "CUDA 13.x toolkit" in line and f"{old} (nvcc 12)" in line


def test_no_nvrtc_is_one_line_naming_it(tmp_path):
    tk = fake_toolkit(tmp_path / "tk", nvrtc_in=None)
    line = one_error_line(run_build(tmp_path, fake_python(tmp_path), CUDA_HOME=str(tk)))
    assert "libnvrtc.so.13 not found" in line and "nvidia/cu13/lib" in line and "PYPPO_NVRTC" in line


def test_a_cpu_torch_is_one_line(tmp_path):
    line = one_error_line(run_build(tmp_path, fake_python(tmp_path, torch="2.13.0+cpu", cuda="")))
    assert "CUDA not found in torch 2.13.0+cpu" in line


def test_no_torch_is_one_line(tmp_path):
    line = one_error_line(run_build(tmp_path, fake_python(tmp_path, importable=False)))
    assert "torch not importable" in line


def test_pyppo_nvrtc_must_exist(tmp_path):
    tk = fake_toolkit(tmp_path / "tk")
    line = one_error_line(
        run_build(tmp_path, fake_python(tmp_path), CUDA_HOME=str(tk), PYPPO_NVRTC=str(tmp_path / "nope.so"))
    )
    assert "libnvrtc not found at PYPPO_NVRTC=" in line


def test_help_is_the_header():
    res = subprocess.run(["bash", str(BUILD), "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "Builds pyppo with its CUDA kernels" in res.stdout and "set -uo" not in res.stdout


def test_rehearsal_syntax_and_documented_settings():
    assert subprocess.run(["bash", "-n", str(REHEARSAL)]).returncode == 0
    text = REHEARSAL.read_text()
    header = text.split("\nset -uo pipefail", 1)[0]
    for setting in (
        "REHEARSAL_DIR",
        "REHEARSAL_PYTHON",
        "REHEARSAL_JOBS",
        "REHEARSAL_PEERS",
        "REHEARSAL_PYTEST_ARGS",
        "REHEARSAL_OFFLINE",
    ):
        assert setting in header and f"${{{setting}:-" in text, setting
    assert "torch==2.11.0 transformers==5.17.0 triton==3.6.0" in text


def test_gpu_check_builds_through_build_cuda():
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    assert "bash scripts/build_cuda.sh -e --no-index" in text


def _timeouts(text: str) -> dict[str, int]:
    return {
        "build": int(re.search(r"BUILD_TIMEOUT=\$\{GPU_CHECK_BUILD_TIMEOUT:-(\d+)\}", text).group(1)),
        "tests": int(re.search(r'stamp "tests \(pytest -m cuda\)"\n  t=\$\(cap (\d+)\)', text).group(1)),
        "sanitize": sum(map(int, re.search(r'lim=(\d+); \[ "\$tool" = racecheck \] && lim=(\d+)', text).groups())),
        "kernels": int(re.search(r"wants kernels; then\n  t=\$\(cap (\d+)\)", text).group(1)),
    }


def test_gpu_check_default_steps_fit_six_minutes():
    # The first GPU run has ~15 minutes, start and one rerun included: the defaults get 6 of them.
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    budget = int(re.search(r"BUDGET=\$\{GPU_CHECK_BUDGET:-(\d+)\}", text).group(1))
    assert budget <= 6 * 60
    t = _timeouts(text)
    assert sum(t.values()) + 15 <= budget, t  # + the environment check and the wheels
    header = text.split("\nset -uo pipefail", 1)[0]
    assert f"default {budget}, 6 minutes" in header
    assert (
        f"build {t['build']}" in header and f"tests {t['tests']}" in header and f"kernels {t['kernels']}" in header
    ), header


def _gpu_check(tmp: Path, **settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    env.update(
        PYTHON=sys.executable,
        GPU_CHECK_DEVICE="cpu",
        GPU_CHECK_WORK=str(tmp / "work"),
        OUT=str(tmp / "out"),
        GPU_CHECK_WHEELS=str(tmp / "no_wheels"),
    )
    env.update(settings)
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp,
    )


def test_gpu_check_writes_its_log_and_summary_to_out_as_it_goes(tmp_path):
    res = _gpu_check(tmp_path, GPU_CHECK_SKIP_BUILD="1", GPU_CHECK_STEPS="tests,sanitize,kernels")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.log", "gpu_check_summary.tsv"], files
    log = (out / "gpu_check.log").read_text()
    assert "== [" in log and "summary (device cpu)" in log and log.strip() == res.stdout.strip()
    rows = [line.split("\t") for line in (out / "gpu_check_summary.tsv").read_text().splitlines()]
    assert [r[:2] for r in rows[1:4]] == [["tests", "skipped"], ["sanitize", "skipped"], ["kernels", "skipped"]]


def test_gpu_check_out_of_time_for_the_build_still_leaves_its_summary(tmp_path):
    res = _gpu_check(tmp_path, GPU_CHECK_STEPS="build", GPU_CHECK_BUDGET="0")
    assert res.returncode == 1, res.stdout[-3000:]
    rows = [line.split("\t") for line in (tmp_path / "out" / "gpu_check_summary.tsv").read_text().splitlines()]
    assert rows[0][:2] == ["build", "TIMEOUT"]


def test_gpu_check_names_a_missing_package(tmp_path):
    # env_check.py: every Python package the steps import, named in one line when absent.
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        import env_check
    finally:
        sys.path.pop(0)
    assert env_check.missing_packages(builds=True) == []
    assert set(env_check.RUNTIME.values()) >= {"transformers", "peft", "accelerate", "gguf", "matplotlib", "tomli-w"}


def test_rehearsal_default_pytest_args_are_two_words():
    # `-m "not cuda"` must reach pytest as ["-m", "not cuda"] (the first rehearsal passed "cuda" as a path).
    line = next(ln for ln in REHEARSAL.read_text().splitlines() if ln.startswith("PYTEST_ARGS="))
    script = line + '\neval "PYTEST=($PYTEST_ARGS)"\nprintf "<%s>" "${PYTEST[@]}"'
    env = {k: v for k, v in os.environ.items() if k != "REHEARSAL_PYTEST_ARGS"}
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert res.stdout.startswith("<-m><not cuda><--deselect>"), res.stdout + res.stderr


# ---------------------------------------------------------------- supported versions


def _torch_pin():
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_pin", ROOT / "build_support" / "torch_pin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.0.dev20270101"])
def test_supported_torch_builds(version):
    _torch_pin().check_supported_torch(version)


@pytest.mark.parametrize("version", ["2.10.0+cu128", "1.13.1"])
def test_older_torch_is_refused_naming_the_range(version):
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(version)} is older than the supported 2\.11"):
        _torch_pin().check_supported_torch(version)


def test_setup_pins_the_newest_supported_transformers():
    pin = re.search(
        r"PYPPO_TRANSFORMERS:-transformers==(\d+\.\d+)\.\d+", (ROOT / "scripts" / "setup.sh").read_text()
    ).group(1)
    floor = re.search(r'"transformers>=(\d+\.\d+)"', (ROOT / "build_support" / "torch_pin.py").read_text()).group(1)
    readme = (ROOT / "README.md").read_text()
    assert f"transformers {floor} to {pin}" in readme
    assert f"torch {_torch_pin().OLDEST_TORCH[0]}.{_torch_pin().OLDEST_TORCH[1]} to 2.13" in readme


def test_readme_python_snippets_import_what_they_use():
    """Each ```python block of README.md: its imports run; in it and the docs, a block that calls
    ``trainer.train`` imports a trainer that has it."""
    readme = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert readme
    docs = [
        b for f in sorted((ROOT / "docs").glob("*.md")) for b in re.findall(r"```python\n(.*?)```", f.read_text(), re.S)
    ]
    for block in readme + [b for b in docs if "trainer.train(" in b]:
        # pyppo's own imports (a docs example may import the user's module it just defined)
        imports = "\n".join(line for line in block.splitlines() if line.startswith(("import pyppo", "from pyppo")))
        names: dict = {}
        exec(imports, names)
        if "trainer.train(" in block:
            assert callable(getattr(names["PPOTrainer"], "train", None)), imports
