"""Every CUDA kernel file compiles, on every CI run, even where torch is a CPU build.

The kernel bodies (csrc/cuda/kernels/<family>_kernel.cu) include only CUDA headers and
csrc/cuda/kernels/{kernels,launch}.h, so the machine's nvcc compiles them for sm_80 and sm_90 with
no torch at all. The CUDA impls (csrc/cuda/<family>_impl.cpp: checks, allocation, launches and
the CUDA registration, the device-generic linear_* families' included) need torch's c10/cuda
headers; a CPU wheel ships them but not the generated c10/cuda/impl/cuda_cmake_macros.h, so the
impls are syntax-checked with the host compiler and C10_CUDA_NO_CMAKE_CONFIGURE_FILE (they cannot
be linked here: no libc10_cuda).

Skipped only when nvcc is absent. At most two compilers run at once (the CI machine has two
cores); the whole module takes about a minute.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
CUDA_DIR = CSRC / "cuda"
KERNEL_DIR = CUDA_DIR / "kernels"
CU_FILES = sorted(KERNEL_DIR.glob("*_kernel.cu"))
IMPL_FILES = sorted(CUDA_DIR.glob("*_impl.cpp"))
# Families with one device-generic implementation (ATen GEMMs and the device's pyppo kernels),
# registered for CUDA by their cuda/<family>_impl.cpp like the others.
GENERIC_FILES = sorted((CSRC / "linear").glob("*.cpp"))
ARCHS = ("80", "90")
TIMEOUT_S = 300


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for env in ("CUDACXX", "CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(env)
        if not v:
            continue
        cand = Path(v) if env == "CUDACXX" else Path(v) / "bin" / "nvcc"
        if cand.is_file():
            return str(cand)
    cand = Path("/usr/local/cuda/bin/nvcc")
    return str(cand) if cand.is_file() else None


NVCC = _find_nvcc()
pytestmark = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check the kernels)"
)

# The same device flags as cmake/cuda.cmake; -O2 keeps the check quick.
NVCC_FLAGS = ["-std=c++17", "-O2", "--expt-relaxed-constexpr", "-c", "-I", str(CSRC)]
for _a in ARCHS:
    NVCC_FLAGS += ["--generate-code", f"arch=compute_{_a},code=sm_{_a}"]


def _cuda_include_dirs() -> list[Path]:
    """The toolkit's include directories, found next to nvcc (following a wrapper script's exec)."""
    assert NVCC is not None
    candidates = [Path(NVCC).resolve().parent.parent]
    try:  # /usr/local/bin/nvcc may be a shell wrapper around the real one
        text = Path(NVCC).read_text(errors="ignore")[:4096]
        m = re.search(r"(/\S+)/bin/nvcc", text)
        if m:
            candidates.append(Path(m.group(1)))
    except OSError:
        pass
    candidates += [Path(os.environ[e]) for e in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(e)]
    candidates.append(Path("/usr/local/cuda"))
    for root in candidates:
        for inc in (root / "include", root / "targets" / "x86_64-linux" / "include"):
            if (inc / "cuda_runtime_api.h").is_file():
                return [inc]
    return []


def _run(cmd: list[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {TIMEOUT_S} s: {' '.join(cmd)}"
    return proc.returncode, proc.stdout + proc.stderr


def _impl_cmd(src: Path) -> list[str] | None:
    try:
        import torch.utils.cpp_extension as cpp_ext
    except Exception:  # pragma: no cover - torch is a test dependency
        return None
    torch_inc = [Path(p) for p in cpp_ext.include_paths()]
    if not any((p / "c10" / "cuda" / "CUDAStream.h").is_file() for p in torch_inc):
        return None
    cuda_inc = _cuda_include_dirs()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cuda_inc or not cxx:
        return None
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-w", "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-I", str(CSRC)]
    for p in torch_inc + cuda_inc:
        cmd += ["-isystem", str(p)]
    return cmd + [str(src)]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Compiles every .cu (and syntax-checks every CUDA impl .cpp), two at a time; name -> (rc, output)."""
    out_dir = tmp_path_factory.mktemp("cuda_objs")
    jobs: dict[str, list[str] | None] = {}
    for src in CU_FILES:
        jobs[src.name] = [NVCC, *NVCC_FLAGS, str(src), "-o", str(out_dir / (src.stem + ".o"))]
    for src in IMPL_FILES:
        jobs[src.name] = _impl_cmd(src)
    runnable = {k: v for k, v in jobs.items() if v is not None}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(_run, v) for k, v in runnable.items()}
        results = {k: f.result() for k, f in futures.items()}
    return results


def test_there_are_cuda_kernels():
    assert CU_FILES, f"no *_kernel.cu files under {KERNEL_DIR}"
    assert IMPL_FILES, f"no *_impl.cpp files under {CUDA_DIR}"


def _families(folder: Path, suffix: str) -> set[str]:
    return {p.name[: -len(suffix)] for p in folder.glob("*" + suffix)}


def test_cpu_and_cuda_files_are_named_alike():
    """Each family is cpu/<family>_impl.cpp + cpu/kernels/<family>_kernel.cpp on CPU and
    cuda/<family>_impl.cpp + cuda/kernels/<family>_kernel.cu on CUDA (the device-generic ones,
    implemented once in csrc/linear/, have impl files but no kernels), so a reader finds one side
    from the other; a file named otherwise would also escape the build globs. CONTRIBUTING.md's
    table of every family's files is tests/ops/test_layout.py's."""
    cpu_dir = CSRC / "cpu"
    assert sorted(p.name for p in KERNEL_DIR.glob("*.cu")) == [p.name for p in CU_FILES]
    assert sorted(p.name for p in CUDA_DIR.glob("*.cpp")) == [p.name for p in IMPL_FILES]
    assert sorted(p.name for p in cpu_dir.glob("*.cpp")) == sorted(p.name for p in cpu_dir.glob("*_impl.cpp"))
    kernel_families = _families(KERNEL_DIR, "_kernel.cu")
    cpu_kernels = {p.name for p in (cpu_dir / "kernels").glob("*.cpp")} - {"dispatch.cpp"}
    assert all(n.endswith("_kernel.cpp") for n in cpu_kernels)
    assert _families(cpu_dir / "kernels", "_kernel.cpp") == kernel_families
    generic = {p.stem for p in GENERIC_FILES}
    assert generic == {"linear_logprobs", "linear_ppo_loss"}
    impl_families = _families(CUDA_DIR, "_impl.cpp")
    assert impl_families == _families(cpu_dir, "_impl.cpp") == kernel_families | generic
    # The fake kernels (what torch.compile traces) cover every family.
    meta_dir = CSRC / "meta"
    assert sorted(p.name for p in meta_dir.glob("*.cpp")) == sorted(p.name for p in meta_dir.glob("*_fake.cpp"))
    assert _families(meta_dir, "_fake.cpp") == impl_families


@pytest.mark.parametrize("name", [p.name for p in CU_FILES])
def test_cu_compiles_for_sm80_and_sm90(compiled, name):
    rc, out = compiled[name]
    assert rc == 0, f"nvcc failed on csrc/cuda/kernels/{name} (sm_{', sm_'.join(ARCHS)}):\n{out}"
    # Warnings in our own sources (not the toolkit's) are bugs waiting to happen on device.
    ours = [ln for ln in out.splitlines() if "warning" in ln and "csrc/" in ln]
    assert not ours, f"nvcc warnings in csrc/cuda/kernels/{name}:\n" + "\n".join(ours)


@pytest.mark.parametrize("name", [p.name for p in IMPL_FILES])
def test_impl_syntax_checks_against_torch_headers(compiled, name):
    if name not in compiled:
        pytest.skip("torch's c10/cuda headers, the CUDA include directory or a C++ compiler is missing")
    rc, out = compiled[name]
    assert rc == 0, f"the C++ compiler rejected csrc/cuda/{name}:\n{out}"


_ALLOWED_CU_INCLUDES = re.compile(
    r'^(cuda[a-z_0-9]*\.h|cub/.*|cuda/std/.*|cstdint|cstddef|"cuda/kernels/kernels\.h"|"cuda/kernels/launch\.h")$'
)


@pytest.mark.parametrize("path", [*CU_FILES, KERNEL_DIR / "kernels.h", KERNEL_DIR / "launch.h"], ids=lambda p: p.name)
def test_kernels_include_only_cuda_headers(path):
    """Kernel files and kernels/kernels.h never include torch (that is what keeps them compilable here)."""
    for line in path.read_text().splitlines():
        m = re.match(r"\s*#\s*include\s*([<\"])([^>\"]+)[>\"]", line)
        if not m:
            continue
        name = m.group(2) if m.group(1) == "<" else f'"{m.group(2)}"'
        if path.name == "kernels.h" and name in ('"kl_estimators.h"', '"row_layout.h"'):
            continue  # plain C++ shared with the CPU kernels (PYPPO_HD, PYPPO_ROW_HD)
        assert _ALLOWED_CU_INCLUDES.match(name), (
            f"{path.name} includes {name}; kernels may include only CUDA headers, cuda/kernels/kernels.h "
            "and cuda/kernels/launch.h"
        )


@pytest.mark.cuda
def test_build_covers_this_gpu():
    """The architectures pyppo was built for include this GPU's (a cubin for sm_XY runs on sm_XZ, Z >= Y)."""
    import torch

    pyppo = pytest.importorskip("pyppo", reason="pyppo is not built")
    if not (torch.cuda.is_available() and pyppo._C.with_cuda):
        pytest.skip("needs a CUDA device and pyppo built with CUDA (pyppo._C.with_cuda)")

    archs = pyppo._C.cuda_archs
    assert archs, "pyppo._C.cuda_archs is empty in a CUDA build"
    major, minor = torch.cuda.get_device_capability()
    built = [tuple(int(v) for v in a.split("+")[0].rstrip("abf").split(".")) for a in archs.split(",")]
    assert any(bmaj == major and bmin <= minor for bmaj, bmin in built), (
        f"pyppo was built for {archs} but this GPU is sm_{major}{minor}; rebuild with TORCH_CUDA_ARCH_LIST"
    )
