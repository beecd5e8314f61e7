"""The wheel: built from this tree, installed into a fresh virtual environment that has only
torch, and used from outside the source tree — so a file missing from the wheel or a broken
RPATH fails here, not on a user's machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "PYTHON": sys.executable}
    _run(["bash", str(ROOT / "scripts" / "build_wheel.sh"), str(out)], timeout=1500, env=env)
    (whl,) = out.glob("pyppo-*.whl")
    return whl


def test_wheel_contents_and_metadata(wheel):
    release = torch.__version__.split("+")[0]
    major_minor = ".".join(release.split(".")[:2])
    accel = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
    # The local version tag names the torch it was built for; auditwheel gave it a manylinux tag.
    assert f"+torch{major_minor}{accel}" in wheel.name
    assert "manylinux" in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
    assert any(n.startswith("pyppo/_C") and n.endswith(".so") for n in names), names
    assert "pyppo/ops/gather_logprobs.py" in names
    # `pyppo bench` runs from the wheel: the harness and the eager references are pyppo.bench,
    # the only name they are importable under.
    assert {"pyppo/bench/__init__.py", "pyppo/bench/suites.py", "pyppo/bench/eager/gae.py"} <= set(names)
    assert not any(n.startswith(("benchmarks/", "pyppo/benchmarks/")) or "/results/" in n for n in names)
    # Pinned to the exact torch release, as torchvision and torchaudio are.
    assert f"Requires-Dist: torch=={release}" in meta


def test_wheel_runs_in_a_fresh_venv_with_only_torch(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}"], timeout=900)
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], timeout=300)

    work = tmp_path / "elsewhere"  # not the source tree: the installed files alone must work
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    script = r"""
import json, torch, pyppo
from pyppo import ops
assert "site-packages" in pyppo.__file__, pyppo.__file__
z = torch.randn(3, 5, 17); y = torch.randint(0, 17, (3, 5)); m = torch.rand(3, 5) > 0.3
lp = ops.gather_logprobs(z, y, m)
ref = torch.log_softmax(z.double(), -1).gather(-1, y[..., None])[..., 0] * m
adv, ret = ops.gae(torch.randn(3, 5), torch.randn(3, 5), m.long())
print(json.dumps({"err": float((lp - ref).abs().max()), "adv_finite": bool(torch.isfinite(adv).all())}))
"""
    out = json.loads(_run([str(py), "-c", script], cwd=work, env=env).strip().splitlines()[-1])
    assert out["err"] < 1e-5 and out["adv_finite"]

    info = json.loads(_run([str(env_dir / "bin" / "pyppo"), "info", "--json"], cwd=work, env=env))
    assert info["torch_built_against"] == torch.__version__
    assert info["torch_running"] == torch.__version__

    # pyppo bench from site-packages writes where it is run, not into the installed package.
    site_pkg = Path(
        _run([str(py), "-c", "import pyppo, os; print(os.path.dirname(pyppo.__file__))"], cwd=work, env=env).strip()
    )
    before = sorted(p for p in site_pkg.rglob("*") if "__pycache__" not in p.parts)
    _run(
        [
            str(env_dir / "bin" / "pyppo"),
            "bench",
            "--sizes",
            "tiny",
            "--ops",
            "kl_penalty,gae",
            "--no-sweeps",
            "--memory",
            "off",
        ],
        cwd=work,
        env=env,
    )
    (result,) = work.glob("bench-*.json")
    assert {r["op"] for r in json.loads(result.read_text())["rows"]} == {"kl_penalty", "gae"}
    assert sorted(p for p in site_pkg.rglob("*") if "__pycache__" not in p.parts) == before
