"""``pyppo bench --peer``: every peer function against its pyppo adapter, on tiny sizes.

A peer that is not installed skips its run (``bash scripts/install_peers.sh`` installs the
pinned releases); the missing-peer error itself is tested by hiding an installed peer.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
from contextlib import redirect_stdout

import pytest
import torch

from pyppo import cli
from pyppo.bench import peer_cases as pc
from pyppo.bench.peers import LEGEND, compare, resolve_peers


def _bench(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        status = cli.main(["bench", *argv])
    return status, buf.getvalue()


@pytest.fixture(scope="module", params=pc.PEERS)
def peer_run(request, tmp_path_factory):
    peer = request.param
    if importlib.util.find_spec(pc.PINS[peer][0]) is None:
        pytest.skip(f"{peer} is not installed (bash scripts/install_peers.sh installs the pinned peers)")
    out = tmp_path_factory.mktemp(f"peer-{peer}")
    status, stdout = _bench("--peer", peer, "--sizes", "tiny", "--device", "cpu", "--output", str(out))
    return peer, status, out, stdout


def test_peer_run_times_and_checks_every_function(peer_run):
    peer, status, out, stdout = peer_run
    assert status == 0, stdout
    (path,) = out.glob(f"bench-peer-{peer}-*.json")
    result = json.loads(path.read_text())
    assert result["kind"] == "peer" and result["peers"] == [peer] and result["sizes"] == "tiny"
    rows = result["rows"]
    want = {(c.name, c.mode) for c in pc.cases(peer, *pc.SHAPES["tiny"])}
    assert {(r["function"], r["mode"]) for r in rows} == want
    assert {r["function"] for r in rows} == set(pc.functions(peer))
    if peer not in pc.CPU_ONLY:  # rlox's functions take numpy arrays: nothing to differentiate
        assert any(r["mode"] == "fwd+bwd" for r in rows)
    for r in rows:
        assert "error" not in r, r
        assert r["agree"] and r["mismatch"] == "" and r["max_error"] <= r["tol"], r
        assert math.isfinite(r["max_abs_error"]) and r["max_abs_error"] >= 0
        for key in ("peer_ms", "pyppo_ms", "speedup"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["peer_extra_bytes"] >= 0 and r["pyppo_extra_bytes"] >= 0
        assert r["device"] == "cpu" and r["shape"] and r["dtype"] in ("float32", "bfloat16", "float64")
    env = result["env"]
    assert env["peers"][peer]["version"] == pc.PINS[peer][1]
    assert env["cpu"] and env["cpu_capability"] and env["torch"] == torch.__version__
    assert env["torch_threads"] == torch.get_num_threads()
    assert result["shapes"]["cpu"]["logits"] == list(pc.SHAPES["tiny"][1])
    if peer == "openrlhf":
        assert "torch fallback path was timed" in env["flash_attn"]


def test_peer_run_prints_the_table_last(peer_run):
    peer, _, out, stdout = peer_run
    assert str(out) in stdout.split("pyppo bench (")[0]  # "wrote ..." before the table
    header = next(line for line in stdout.splitlines() if line.startswith("function "))
    for col in (
        "shape",
        "dtype",
        "peer ms",
        "pyppo ms",
        "speed-up",
        "peer extra",
        "pyppo extra",
        "extra ratio",
        "max abs err",
        "check",
    ):
        assert col in header
    assert f"peer {peer} {pc.PINS[peer][1]} against pyppo.integrations.{peer}:" in stdout
    assert "shapes (cpu):" in stdout and "threads: torch" in stdout
    for name in pc.functions(peer):
        assert name in stdout
    assert "FAIL" not in stdout and "ERROR" not in stdout
    if peer == "openrlhf":
        assert "OpenRLHF's torch fallback path was timed" in stdout
    assert stdout.rstrip().splitlines()[-1] == LEGEND


@pytest.fixture
def hide(monkeypatch):
    """``hide("verl")``: make the peer look uninstalled."""
    real = importlib.util.find_spec

    def hide(*names):
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, **k: None if name.split(".")[0] in names else real(name, *a, **k),
        )

    return hide


@pytest.mark.parametrize("peer", pc.PEERS)
def test_missing_peer_is_one_line_naming_the_pip_command(peer, hide, tmp_path, capsys):
    hide(peer)
    assert cli.main(["bench", "--peer", peer, "--sizes", "tiny", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("pyppo: error: --peer ") and pc.PINS[peer][2] in err
    assert f"{peer}=={pc.PINS[peer][1]}" in err
    assert not list(tmp_path.iterdir())


def test_peer_all_with_no_peer_installed_is_an_error(hide, tmp_path, capsys):
    hide(*pc.PEERS)
    assert cli.main(["bench", "--peer", "all", "--sizes", "tiny", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no peer is installed" in err and all(pc.PINS[p][2] in err for p in pc.PEERS)


def test_peer_all_skips_a_missing_peer_in_one_line(hide):
    hide("rlox")
    try:
        run, skipped = resolve_peers("all")
    except ImportError:
        pytest.skip("no peer but rlox is installed")
    assert "rlox" not in run
    (line,) = [s for s in skipped if s.startswith("--peer rlox:")]
    assert line.startswith("--peer rlox: skipped, rlox is not installed") and line.endswith(f"`{pc.PINS['rlox'][2]}`")


def test_peer_flags_are_checked_before_running(capsys):
    assert cli.main(["bench", "--peer", "trl", "--suite", "ops", "--sizes", "tiny"]) == 2
    assert "--peer and --suite" in capsys.readouterr().err
    if importlib.util.find_spec("trl") is not None:
        assert cli.main(["bench", "--peer", "trl", "--sizes", "tiny", "--ops", "nope"]) == 2
        assert "unknown function(s) nope" in capsys.readouterr().err


def test_compare_flags_values_dtypes_and_structure():
    x = torch.tensor([1.0, 2.0, float("nan")])
    ok = compare((x, {"a": 0.5}), (x.clone(), {"a": 0.5}))
    assert ok == {"max_abs_error": 0.0, "max_error": 0.0, "mismatch": ""}
    off = compare(torch.tensor([10.0, 4.0]), torch.tensor([10.0, 4.5]))
    assert off["max_abs_error"] == 0.5 and off["max_error"] == 0.05 and not off["mismatch"]
    assert "bfloat16" in compare(x.bfloat16(), x)["mismatch"]  # peer bf16, adapter fp32: not a drop-in
    assert compare((x,), (x, x))["mismatch"]
    assert "non-finite" in compare(torch.tensor([1.0, 2.0, 3.0]), x)["mismatch"]
    assert compare({"k": 1.0}, {"k": 1.5})["max_abs_error"] == 0.5
