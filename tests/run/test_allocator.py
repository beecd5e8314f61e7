"""The malloc a training process runs on: finding jemalloc/tcmalloc, reading which one is active,
and ``pyppo train`` re-executing itself with the preferred one preloaded (``PYPPO_ALLOCATOR``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pyppo.run import allocator
from support.run_fixture import prompts_file, tiny_dir  # noqa: F401 (fixtures)

INSTALLED = {name: allocator.find_allocator(name) for name in allocator.ALLOCATORS}


def _child_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV, "PYPPO_ALLOCATOR_REEXEC")}
    env.update(extra)
    return env


def test_find_allocator_names_a_library_file_or_nothing():
    for name, path in INSTALLED.items():
        assert path is None or (os.path.isfile(path) and f"lib{name}" in os.path.basename(path))
    with pytest.raises(ValueError, match="allocator must be one of jemalloc, tcmalloc; got 'mimalloc'"):
        allocator.find_allocator("mimalloc")


def test_wanted_allocator_reads_the_environment():
    assert allocator.wanted_allocator({}) == allocator.PREFERRED
    assert allocator.wanted_allocator({allocator.ENV: "auto"}) == allocator.PREFERRED
    assert allocator.wanted_allocator({allocator.ENV: " TCMalloc "}) == "tcmalloc"
    assert allocator.wanted_allocator({allocator.ENV: "system"}) is None
    with pytest.raises(ValueError, match=r"PYPPO_ALLOCATOR='glibc': expected auto, system, jemalloc, tcmalloc"):
        allocator.wanted_allocator({allocator.ENV: "glibc"})


def test_active_allocator_reads_the_mapped_libraries(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.active_allocator(str(maps)) == "glibc"
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    assert allocator.active_allocator(str(maps)) == "jemalloc"
    assert allocator.active_allocator(str(tmp_path / "none")) == "unknown"


def test_preload_env_puts_the_allocator_first_and_keeps_the_rest(monkeypatch):
    monkeypatch.setattr(allocator, "find_allocator", lambda name: f"/lib/lib{name}.so")
    env = allocator.preload_env("tcmalloc", {"LD_PRELOAD": "/x/liba.so:/lib/libtcmalloc.so /x/libb.so", "A": "1"})
    assert env == {"LD_PRELOAD": "/lib/libtcmalloc.so /x/liba.so /x/libb.so", "A": "1"}
    monkeypatch.setattr(allocator, "find_allocator", lambda name: None)
    assert allocator.preload_env("jemalloc", {}) is None


_PROBE = (
    "from pyppo.run.allocator import reexec_with_allocator, active_allocator\n"
    "reexec_with_allocator()\nprint(active_allocator())\n"
)


@pytest.mark.parametrize("name", sorted(allocator.ALLOCATORS))
def test_reexec_preloads_the_allocator_asked_for(name):
    if INSTALLED[name] is None:
        pytest.skip(f"{name} is not installed (scripts/setup.sh installs it)")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=_child_env(**{allocator.ENV: name}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [name]


def test_reexec_leaves_a_system_process_alone():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=_child_env(**{allocator.ENV: "system"}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.split() == ["glibc"], out.stderr[-2000:]


def test_a_bad_setting_is_one_line_for_train_and_ignored_by_info(tmp_path):
    bad = _child_env(**{allocator.ENV: "fast"})
    out = subprocess.run(
        [sys.executable, "-m", "pyppo", "train", "--output", str(tmp_path / "o")],
        env=bad,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "pyppo: error: PYPPO_ALLOCATOR='fast': expected auto, system, jemalloc, tcmalloc"
    )
    info = subprocess.run(
        [sys.executable, "-m", "pyppo", "info", "--json"], env=bad, capture_output=True, text=True, timeout=120
    )
    alloc = json.loads(info.stdout)["allocator"]
    assert info.returncode == 0 and alloc["train"] is None and "expected auto, system" in alloc["error"]


def test_a_preloaded_allocator_is_kept_said_and_reported():
    if INSTALLED["jemalloc"] is None:
        pytest.skip("jemalloc is not installed (scripts/setup.sh installs it)")
    env = _child_env(LD_PRELOAD=INSTALLED["jemalloc"], **{allocator.ENV: "tcmalloc"})
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["jemalloc"], out.stderr[-2000:]
    assert "PYPPO_ALLOCATOR=tcmalloc: this process already runs on jemalloc" in out.stderr
    # `auto` keeps a preloaded allocator without a word; info names it as the one the commands use.
    env[allocator.ENV] = "auto"
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["jemalloc"] and "already runs on" not in out.stderr
    info = subprocess.run(
        [sys.executable, "-m", "pyppo", "info", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    alloc = json.loads(info.stdout)["allocator"]
    assert alloc["active"] == "jemalloc" and alloc["train"] == "jemalloc"


def test_pyppo_train_runs_its_steps_on_the_preferred_allocator(tiny_dir, prompts_file, tmp_path):  # noqa: F811
    if INSTALLED[allocator.PREFERRED] is None:
        pytest.skip(f"{allocator.PREFERRED} is not installed (scripts/setup.sh installs it)")
    # The reward runs inside the training process: it reports the allocator the steps run on.
    (tmp_path / "probe_reward.py").write_text(
        "import os\nfrom pyppo.run.allocator import active_allocator\n"
        "def score(prompts, responses):\n"
        "    with open(os.environ['PROBE_OUT'], 'a') as f:\n"
        "        f.write(active_allocator() + '\\n')\n"
        "    return [0.0] * len(responses)\n"
    )
    seen = tmp_path / "seen.txt"
    argv = [
        sys.executable,
        "-m",
        "pyppo",
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts_file),
        "--reward",
        f"{tmp_path / 'probe_reward.py'}:score",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--mini-batch-size",
        "1",
        "--ppo-epochs",
        "1",
        "--max-new-tokens",
        "2",
        "--output",
        str(tmp_path / "run"),
    ]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=_child_env(PROBE_OUT=str(seen))
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert set(seen.read_text().split()) == {allocator.PREFERRED}
