"""The peers' own tests, run with pyppo in place of the peer's functions.

* veRL 0.9.1 ships its CPU unit tests in its wheel (a top-level ``tests`` package). The files that
  reach what ``pyppo.integrations.verl.patch()`` replaces (core_algos, loss aggregation,
  value-loss normalisation, REINFORCE++ multi-turn, rollout correction, the dynamic policy
  losses) run in a child pytest with pyppo patched in before collection: every test must pass,
  and pyppo's operators must have run in every file.
* OpenRLHF 0.11.2 ships its tests too, but they load private copies of its modules, which
  ``patch()`` never reaches; its KL estimator tests (test_kl_estimator_gradient.py, the k3 legacy
  check among them) run with pyppo's ``compute_approx_kl`` standing in for the copy's.

The child loads tests/support/peer_suite_plugin.py (the patching and a recorder of the pyppo
operators each test dispatched). Skips when the peer or its shipped tests are not installed.
About 20 s.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]

VERL_FILES = (
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
    "tests/trainer/ppo/test_value_loss_normalization_on_cpu.py",
    "tests/trainer/ppo/test_reinforce_pp_multiturn_on_cpu.py",
    "tests/trainer/ppo/test_rollout_corr.py",
    "tests/trainer/ppo/test_rollout_corr_integration.py",
    "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
)
OPENRLHF_FILES = ("tests/test_kl_estimator_gradient.py",)


def shipped_tests(distribution: str, files: tuple[str, ...]) -> Path:
    """The directory that holds ``distribution``'s shipped test ``files`` (site-packages), or skip."""
    if importlib.util.find_spec(distribution) is None:
        pytest.skip(f"{distribution} is not installed (bash scripts/setup.sh installs the pinned peers)")
    located = {str(f): f.locate() for f in importlib.metadata.files(distribution) or () if str(f) in files}
    missing = [f for f in files if f not in located]
    if missing:
        pytest.skip(f"{distribution}'s wheel does not ship {', '.join(missing)}")
    root = Path(located[files[0]]).resolve()
    for _ in Path(files[0]).parts:
        root = root.parent
    return root


def run_suite(peer: str, root: Path, files: tuple[str, ...], tmp_path: Path) -> dict[str, dict]:
    """Run ``files`` (relative to ``root``) in a child pytest with pyppo in place of ``peer``'s
    functions; returns the plugin's report, after checking that every test passed."""
    report = tmp_path / "report.json"
    env = dict(os.environ, PYPPO_PEER_SUITE=peer, PYPPO_PEER_SUITE_REPORT=str(report), PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    # -c: none of this repository's or the peer's pytest settings; no cache (nor bytecode) is
    # written into site-packages.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "support.peer_suite_plugin",
        "-p",
        "no:cacheprovider",
        "-c",
        os.devnull,
        "--rootdir",
        str(root),
        *files,
    ]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"{peer}'s own tests failed with pyppo patched in:\n{tail}"
    results = json.loads(report.read_text())
    not_passed = {k: v.get("outcome") for k, v in results.items() if v.get("outcome") != "passed"}
    assert not not_passed, (not_passed, tail)
    return results


def by_file(results: dict[str, dict]) -> dict[str, list[dict]]:
    files: dict[str, list[dict]] = {}
    for nodeid, entry in results.items():
        files.setdefault(nodeid.split("::", 1)[0], []).append(entry)
    return files


def test_verl_cpu_suite_passes_with_pyppo_patched_in(tmp_path):
    pytest.importorskip("verl.trainer.ppo.core_algos", reason="veRL or its dependencies are not installed")
    root = shipped_tests("verl", VERL_FILES)
    results = run_suite("verl", root, VERL_FILES, tmp_path)
    files = by_file(results)
    assert sorted(files) == sorted(VERL_FILES), sorted(files)
    assert len(results) >= 90, len(results)  # 92 tests in veRL 0.9.1
    ran = {op for entries in files.values() for e in entries for op in e["ops"]}
    for name, entries in files.items():
        assert any(e["ops"] for e in entries), f"no pyppo op ran in veRL's {name}"
    # The op families patch() routes veRL through, each reached by veRL's own tests (agg_loss and
    # the value and policy losses through masked_mean).
    for op in (
        "gae",
        "kl_penalty",
        "kl_penalty_backward",
        "group_advantages",
        "masked_mean",
        "masked_var",
        "masked_whiten",
    ):
        assert f"pyppo::{op}" in ran, (op, sorted(ran))


def test_openrlhf_kl_tests_pass_with_pyppo_standing_in(tmp_path):
    root = shipped_tests("openrlhf", OPENRLHF_FILES)
    results = run_suite("openrlhf", root, OPENRLHF_FILES, tmp_path)
    legacy = [e for k, e in results.items() if k.endswith("::test_flag_off_matches_legacy")]
    assert len(legacy) == 1 and "pyppo::kl_penalty" in legacy[0]["ops"], legacy
    assert all(e["ops"] for e in results.values()), {k: e["ops"] for k, e in results.items()}
    assert len(results) >= 12, len(results)
