"""The wheel declares torch as its only dependency, so everything a user of the wheel reaches
without a peer installed must import with no numpy. This is the fast form of the check in
test_wheel.py (which builds the wheel): numpy is made unimportable in a child process."""

from __future__ import annotations

import json
import subprocess
import sys

_BLOCK = "import sys; sys.modules['numpy'] = None\n"


def _run(code: str, cwd) -> str:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _BLOCK + code], capture_output=True, text=True, cwd=cwd, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_info_and_adapters_import_without_numpy(tmp_path):
    out = _run(
        "import pyppo.integrations.verl, pyppo.integrations.openrlhf, pyppo.integrations.trl\n"
        "import pyppo.integrations.rlox\n"
        "import pyppo.ops, pyppo.bench.suites\n"
        "from pyppo.cli.main import main\n"
        "sys.argv = ['pyppo', 'info', '--json']\n"
        "main()\n",
        tmp_path,
    )
    info = json.loads(out)
    assert set(info["integrations"]) == {"verl", "openrlhf", "trl", "rlox"}, info.keys()
    assert set(info["trackers"]) == {"tensorboard", "wandb", "trackio", "mlflow"}  # from metadata, not imported


def test_bench_runs_without_numpy(tmp_path):
    _run(
        "from pyppo.cli.main import main\n"
        "sys.argv = ['pyppo', 'bench', '--sizes', 'tiny', '--ops', 'kl_penalty,gae', '--no-sweeps',"
        " '--memory', 'off']\n"
        "main()\n",
        tmp_path,
    )
    (result,) = tmp_path.glob("bench-*.json")
    assert {r["op"] for r in json.loads(result.read_text())["rows"]} == {"kl_penalty", "gae"}
