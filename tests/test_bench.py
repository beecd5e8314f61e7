"""``pyppo bench`` on tiny sizes, and the eager references it times pyppo against.

The eager references (``benchmarks/eager/``) are what users of TRL / OpenRLHF / veRL write; a
speed-up is only meaningful if they compute the same thing, so they are checked here against the
pyppo ops (and, where they differ by design, against each other).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

import pyppo.ops as ops
from pyppo import bench

cases_mod = bench.load_benchmarks()
eager = importlib.import_module("pyppo.benchmarks.eager")

OPS = {"gather_logprobs", "linear_logprobs", "kl_penalty", "shape_rewards", "gae", "masked_whiten"}


# --------------------------------------------------------------------------- the harness


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        status = bench.main(["--sizes", "tiny", "--output", str(out), "--device", "cpu"])
    return status, out, buf.getvalue()


def test_tiny_run_writes_table_json_and_png(tiny_run):
    status, out, stdout = tiny_run
    assert status == 0, stdout
    jsons = sorted(out.glob("bench-*.json"))
    pngs = sorted(out.glob("bench-*.png"))
    assert len(jsons) == 1 and len(pngs) == 1
    assert jsons[0].stem == pngs[0].stem
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(jsons[0].read_text())
    rows = result["rows"]
    assert {r["op"] for r in rows} == OPS
    labels = {(r["label"], r["dtype"]) for r in rows}
    for need in [("gather_logprobs fwd", "float32"), ("gather_logprobs fwd", "bfloat16"),
                 ("gather_logprobs fwd+bwd", "float32"), ("gather_logprobs+entropy fwd", "float32")]:
        assert need in labels
    eagers = {r["eager"] for r in rows if r["op"] == "gather_logprobs"}
    assert {"log_softmax.gather", "trl selective_log_softmax"} <= eagers
    for r in rows:
        assert r["agree"], r  # pyppo == the eager reference (checks the references too)
        for key in ("pyppo_ms", "eager_ms", "floor_ms", "speedup", "floor_ratio"):
            assert r[key] > 0, (key, r)
        assert r["pyppo_extra_bytes"] is not None and r["eager_extra_bytes"] is not None
        assert r["device"] == "cpu"
    env = result["env"]
    assert env["torch_threads"] == torch.get_num_threads()
    assert env["cpu_capability"] and env["devices"] == ["cpu"]
    assert {s["axis"] for s in result["sweeps"]} == {"V", "T"}
    for s in result["sweeps"]:
        assert len(s["points"]) >= 2 and all(p["pyppo_ms"] > 0 for p in s["points"])


def test_tiny_run_prints_the_table(tiny_run):
    _, out, stdout = tiny_run
    header = next(line for line in stdout.splitlines() if line.startswith("op "))
    for col in ("op", "shape", "dtype", "pyppo ms", "eager ms", "speed-up", "x floor", "pyppo extra"):
        assert col in header
    assert "threads: torch" in stdout and "cpu kernel ISA" in stdout
    for op in OPS:
        assert op in stdout
    assert str(out) in stdout


def test_cli_subcommand_and_output_default(tmp_path, capsys):
    from pyppo import cli

    assert cli.main(["bench", "--sizes", "tiny", "--ops", "gae,kl_penalty", "--no-sweeps",
                     "--memory", "off", "--output", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("bench-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert {r["op"] for r in rows} == {"gae", "kl_penalty"}
    assert not list(tmp_path.glob("*.png"))  # no sweeps, no plot
    # from a source tree, results go to benchmarks/results/
    assert bench.default_output_dir() == Path(bench.__file__).resolve().parent.parent / "benchmarks" / "results"


def test_bad_ops_is_a_user_error(capsys):
    from pyppo import cli

    assert cli.main(["bench", "--sizes", "tiny", "--ops", "nope"]) == 2
    assert "unknown op" in capsys.readouterr().err


def test_peak_memory_methods_see_a_large_allocation():
    inp = {"n": 16 * 2**20}  # 64 MiB of float32
    big = lambda d: torch.ones(d["n"])  # noqa: E731  (touches every page)
    none = lambda d: None  # noqa: E731
    cpu = torch.device("cpu")
    got = bench.peak_extra_bytes(big, inp, cpu, "both")
    assert got["alloc"] == 64 * 2**20
    assert 60 * 2**20 <= got["rss"] <= 72 * 2**20
    got = bench.peak_extra_bytes(none, inp, cpu, "both")
    assert got["alloc"] == 0 and got["rss"] < 4 * 2**20


def test_measure_interleaves_and_counts():
    calls = []
    variants = {name: (lambda inp, n=name: calls.append(n)) for name in ("a", "b", "c")}
    times = bench.measure(variants, None, lambda: None, warmup=1, min_reps=4, max_reps=4, budget_s=0.0)
    assert all(len(v) == 4 for v in times.values())
    assert calls[:3] == ["a", "b", "c"] and calls[3:6] == ["a", "b", "c"] and calls[6:9] == ["b", "c", "a"]


# --------------------------------------------------------------------------- eager references


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_gather_logprobs_references(dtype):
    g = _gen(1)
    logits = (torch.randn(3, 7, 301, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 301, (3, 7), generator=g)
    want = ops.gather_logprobs(logits, labels)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=1e-2)
    torch.testing.assert_close(eager.logsoftmax_gather(logits, labels).float(), want, **tol)
    torch.testing.assert_close(eager.selective_log_softmax(logits, labels).float(), want, **tol)
    lp, ent = eager.logprobs_and_entropy(logits, labels)
    want_lp, want_ent = ops.gather_logprobs(logits, labels, return_entropy=True)
    torch.testing.assert_close(lp.float(), want_lp, **tol)
    torch.testing.assert_close(ent.float(), want_ent, **tol)


def test_eager_gather_logprobs_backward_matches():
    g = _gen(2)
    x = torch.randn(2, 5, 97, generator=g, requires_grad=True)
    labels = torch.randint(0, 97, (2, 5), generator=g)
    gout = torch.randn(2, 5, generator=g)
    eager.logsoftmax_gather(x, labels).backward(gout)
    want, x.grad = x.grad, None
    ops.gather_logprobs(x, labels).backward(gout)
    torch.testing.assert_close(x.grad, want, atol=1e-6, rtol=1e-5)


def _bt(seed, B=5, T=40):
    return cases_mod._bt_inputs((B, T), torch.float32, torch.device("cpu"), seed)


def test_bench_masks_have_holes_and_padding():
    inp = _bt(3, B=16, T=64)
    m = inp["mask"]
    assert m[:, 0].all()
    lengths = torch.where(m, torch.arange(64), -1).amax(1) + 1
    inner_holes = sum(int((~m[b, : lengths[b]]).sum()) for b in range(16))
    assert inner_holes > 0 and (lengths < 64).any()


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_eager_gae_loop_matches_pyppo_with_holes(gamma, lam):
    inp = _bt(4)
    adv, ret = eager.gae_loop(inp["rewards"], inp["values"], inp["mask"], gamma, lam)
    want_adv, want_ret = ops.gae(inp["rewards"], inp["values"], inp["mask"], gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, want_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, want_ret, atol=1e-5, rtol=1e-5)


def test_eager_trl_gae_equals_verl_without_holes_and_differs_with_them():
    inp = _bt(5)
    m = inp["mask"]
    lengths = torch.where(m, torch.arange(m.shape[1]), -1).amax(1) + 1
    padded = torch.arange(m.shape[1])[None, :] < lengths[:, None]  # right padding only
    a1, r1 = eager.gae_loop(inp["rewards"], inp["values"], padded, 0.99, 0.95)
    a2, r2 = eager.gae_loop_trl(inp["rewards"], inp["values"], padded, 0.99, 0.95)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)
    a3, _ = eager.gae_loop_trl(inp["rewards"], inp["values"], m, 0.99, 0.95)
    assert not torch.allclose(a3, eager.gae_loop(inp["rewards"], inp["values"], m, 0.99, 0.95)[0])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_eager_kl_matches_pyppo(estimator):
    inp = _bt(6)
    got = eager.compute_approx_kl(inp["logprobs"], inp["ref_logprobs"], estimator, clamp=(-10.0, 10.0))
    want = ops.kl_penalty(inp["logprobs"], inp["ref_logprobs"], estimator=estimator, clamp=(-10.0, 10.0))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("score_clip", [None, 0.5])
def test_eager_shape_rewards_matches_pyppo(score_clip):
    inp = _bt(7)
    args = (inp["scores"], inp["logprobs"], inp["ref_logprobs"], inp["mask"])
    rewards, kl = eager.shape_rewards(*args, 0.1, "k1", score_clip)
    want_r, want_kl = ops.shape_rewards(*args, kl_coef=0.1, estimator="k1", score_clip=score_clip)
    torch.testing.assert_close(rewards, want_r, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(kl, want_kl, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_eager_masked_whiten_matches_pyppo(shift_mean):
    inp = _bt(8)
    got = eager.masked_whiten_fill(inp["x"], inp["mask"], shift_mean)
    want = ops.masked_whiten(inp["x"], inp["mask"], shift_mean=shift_mean)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager.masked_mean(inp["x"], inp["mask"]), ops.masked_mean(inp["x"], inp["mask"]))
