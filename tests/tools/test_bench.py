"""``pyppo bench`` on tiny sizes, and the eager references it times pyppo against.

The eager references (``pyppo.bench.eager``) are what users of TRL / OpenRLHF / veRL write; a
speed-up is only meaningful if they compute the same thing, so they are checked here against the
pyppo ops (and, where they differ by design, against each other).
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

import pyppo.ops as ops
from pyppo import bench, cli
from pyppo.bench import eager
from pyppo.bench.cases import group_advantages as group_cases
from pyppo.bench.environment import cuda_usable
from pyppo.bench.inputs import bt_inputs, linear_ppo_inputs
from pyppo.bench.memory import peak_extra_bytes
from pyppo.bench.timing import HostClock, measure

OPS = {
    "gather_logprobs",
    "linear_logprobs",
    "linear_ppo_loss",
    "kl_penalty",
    "shape_rewards",
    "gae",
    "turn_gae",
    "masked_whiten",
    "group_advantages",
}


# --------------------------------------------------------------------------- the harness


def _bench(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        status = cli.main(["bench", *argv])
    return status, buf.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    status, stdout = _bench("--sizes", "tiny", "--output", str(out), "--device", "cpu")
    return status, out, stdout


PACKAGE_DIR = Path(bench.__file__).resolve().parent.parent  # pyppo/


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_tiny_run_writes_table_json_and_png(tiny_run):
    status, out, stdout = tiny_run
    assert status == 0, stdout
    jsons = sorted(out.glob("bench-*.json"))
    pngs = sorted(out.glob("bench-*.png"))
    assert len(jsons) == 1 and len(pngs) == 1
    assert jsons[0].stem == pngs[0].stem
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(jsons[0].read_text())
    assert {"created", "sizes", "suites", "env", "rows", "sweeps"} <= set(result)
    assert result["suites"] == ["ops"] and result["sizes"] == "tiny"
    rows = result["rows"]
    assert {r["op"] for r in rows} == OPS
    labels = {(r["label"], r["dtype"]) for r in rows}
    for need in [
        ("gather_logprobs fwd", "float32"),
        ("gather_logprobs fwd", "bfloat16"),
        ("gather_logprobs fwd+bwd", "float32"),
        ("gather_logprobs+entropy fwd", "float32"),
    ]:
        assert need in labels
    eagers = {r["eager"] for r in rows if r["op"] == "gather_logprobs"}
    assert {"log_softmax.gather", "trl selective_log_softmax"} <= eagers
    for r in rows:
        assert r["suite"] == "ops"
        assert r["agree"], r  # pyppo == the eager reference (checks the references too)
        for key in ("pyppo_ms", "eager_ms", "floor_ms", "speedup", "floor_ratio"):
            assert r[key] > 0, (key, r)
        assert r["pyppo_extra_bytes"] is not None and r["eager_extra_bytes"] is not None
        assert r["device"] == "cpu" and r["input_sets"] >= 1
    fwd = [r for r in rows if r["label"] == "gather_logprobs fwd"]
    assert all(r["pyppo_gbps"] > 0 and r["bandwidth_pct"] > 0 for r in fwd)
    env = result["env"]
    assert env["torch_threads"] == torch.get_num_threads()
    assert env["cpu_capability"] and env["devices"] == ["cpu"]
    assert {s["axis"] for s in result["sweeps"]} == {"V", "T"}
    for s in result["sweeps"]:
        assert len(s["points"]) >= 2 and all(p["pyppo_ms"] > 0 for p in s["points"])


def test_tiny_run_prints_the_table_last(tiny_run):
    _, out, stdout = tiny_run
    header = next(line for line in stdout.splitlines() if line.startswith("op "))
    for col in ("op", "shape", "dtype", "pyppo ms", "eager ms", "speed-up", "x floor", "pyppo extra"):
        assert col in header
    assert "threads: torch" in stdout and "cpu kernel ISA" in stdout and "suite ops:" in stdout
    for op in OPS:
        assert op in stdout
    assert str(out) in stdout.split("pyppo bench (")[0]  # "wrote ..." comes before the table
    assert stdout.rstrip().splitlines()[-1].startswith("GB/s = ")


def test_cli_runs_only_the_named_ops(tmp_path):
    status, _ = _bench(
        "--sizes", "tiny", "--ops", "gae,kl_penalty", "--no-sweeps", "--memory", "off", "--output", str(tmp_path)
    )
    assert status == 0
    (path,) = tmp_path.glob("bench-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert {r["op"] for r in rows} == {"gae", "kl_penalty"}
    assert not list(tmp_path.glob("*.png"))  # no sweeps, no plot


def test_quick_run_writes_into_output_dir_and_nothing_into_the_package(tmp_path):
    before = _files(PACKAGE_DIR)
    out = tmp_path / "results"
    status, stdout = _bench(
        "--quick", "--ops", "kl_penalty,gae", "--no-sweeps", "--memory", "off", "--output", str(out)
    )
    assert status == 0, stdout
    (path,) = out.glob("bench-*.json")
    assert json.loads(path.read_text())["sizes"] == "quick"
    assert _files(PACKAGE_DIR) == before
    # Named targets with their own descriptions, nothing pointing outside the repository.
    assert "targets:" in stdout and "gae with holes >= 100x the Python loop" in stdout
    assert "issue" not in stdout.lower() and "DESIGN" not in stdout


def test_output_defaults_to_the_current_directory_and_json_names_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _bench("--sizes", "tiny", "--ops", "kl_penalty", "--no-sweeps", "--memory", "off")[0] == 0
    assert len(list(tmp_path.glob("bench-*.json"))) == 1
    target = tmp_path / "sub" / "gpu_bench.json"
    assert (
        _bench("--sizes", "tiny", "--ops", "kl_penalty", "--no-sweeps", "--memory", "off", "--json", str(target))[0]
        == 0
    )
    assert json.loads(target.read_text())["rows"][0]["op"] == "kl_penalty"
    assert len(list(tmp_path.glob("bench-*.json"))) == 1


def test_memory_suite_runs_in_the_same_harness(tmp_path):
    status, stdout = _bench("--suite", "memory", "--sizes", "tiny", "--device", "cpu", "--output", str(tmp_path))
    assert status == 0, stdout
    (path,) = tmp_path.glob("bench-*.json")
    result = json.loads(path.read_text())
    assert result["suites"] == ["memory"] and "suite memory:" in stdout
    rows = result["rows"]
    assert {r["op"] for r in rows} == {"linear_logprobs", "linear_ppo_loss", "gather_logprobs"}
    assert len({r["shape_str"] for r in rows if r["label"] == "linear_logprobs fwd+bwd"}) >= 2  # over N
    for r in rows:
        assert r["suite"] == "memory" and r["agree"], r
        assert r["pyppo_extra_bytes"] >= 0 and r["eager_extra_bytes"] > 0 and r["memory_ratio"] >= 0


@pytest.mark.skipif(cuda_usable(), reason="checks the behaviour without CUDA")
def test_gpu_suite_needs_cuda(tmp_path, capsys):
    assert cli.main(["bench", "--suite", "gpu", "--sizes", "tiny", "--output", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    status, _ = _bench(
        "--suite",
        "all",
        "--sizes",
        "tiny",
        "--ops",
        "kl_penalty",
        "--no-sweeps",
        "--memory",
        "off",
        "--output",
        str(tmp_path),
    )
    assert status == 0
    assert "gpu suite is skipped" in capsys.readouterr().err
    (path,) = tmp_path.glob("bench-*.json")
    assert json.loads(path.read_text())["suites"] == ["ops", "memory"]


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_usable(), reason="needs a CUDA device and pyppo built with CUDA")
def test_gpu_suite_runs_in_the_same_harness(tmp_path):
    status, stdout = _bench("--suite", "gpu", "--sizes", "tiny", "--json", str(tmp_path / "gpu.json"))
    assert status == 0, stdout
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["suites"] == ["gpu"] and "suite gpu:" in stdout
    rows = result["rows"]
    assert {r["op"] for r in rows} == OPS
    for r in rows:
        assert r["suite"] == "gpu" and r["device"].startswith("cuda") and r["agree"], r
        assert "cuda" in r["pyppo_extra_by_method"]
    copy_rows = [r for r in rows if r["floor"] == "logits.clone()"]
    assert copy_rows and all(r["bandwidth_pct"] > 0 for r in copy_rows)


def test_bad_ops_is_a_user_error(capsys):
    assert cli.main(["bench", "--sizes", "tiny", "--ops", "nope"]) == 2
    assert "unknown op" in capsys.readouterr().err


def test_peak_memory_methods_see_a_large_allocation():
    inp = {"n": 16 * 2**20}  # 64 MiB of float32
    big = lambda d: torch.ones(d["n"])  # noqa: E731  (touches every page)
    none = lambda d: None  # noqa: E731
    cpu = torch.device("cpu")
    got = peak_extra_bytes(big, inp, cpu, "both")
    assert got["alloc"] == 64 * 2**20
    assert 60 * 2**20 <= got["rss"] <= 72 * 2**20
    got = peak_extra_bytes(none, inp, cpu, "both")
    assert got["alloc"] == 0 and got["rss"] < 4 * 2**20


def test_measure_interleaves_rotates_inputs_and_counts():
    calls = []
    variants = {name: (lambda inp, n=name: calls.append((n, inp))) for name in ("a", "b", "c")}
    times = measure(variants, [0, 1, 2], HostClock(), warmup=1, min_reps=4, max_reps=4, budget_s=0.0)
    assert all(len(v) == 4 for v in times.values())
    names = [n for n, _ in calls]
    assert names[:3] == ["a", "b", "c"] and names[3:6] == ["a", "b", "c"] and names[6:9] == ["b", "c", "a"]
    assert [i for n, i in calls[3:] if n == "a"] == [0, 1, 2, 0]  # timed rounds walk the input sets


def test_quiet_stderr_is_public_for_the_profiler(capfd):
    import os

    with bench.quiet_stderr():
        os.write(2, b"kineto noise\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


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
    return bt_inputs((B, T), torch.float32, torch.device("cpu"), seed)


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


@pytest.mark.parametrize("gamma,lam,with_last", [(1.0, 0.95, False), (0.9, 0.8, True)])
def test_eager_turn_gae_loop_matches_pyppo(gamma, lam, with_last):
    from pyppo.bench.cases.turn_gae import turn_inputs

    inp = turn_inputs((16, 300), torch.float32, torch.device("cpu"), 7)
    ids = inp["turn_ids"].clone()
    ids[3] = -1  # a row without a turn
    ids[4, 100:] = -1
    ids[4, :100] = 0  # a row of one turn
    last = torch.randn(16, generator=torch.Generator().manual_seed(1)) if with_last else None
    got = eager.turn_gae_loop(inp["rewards"], inp["values"], ids, gamma, lam, last)
    want = ops.turn_gae(inp["rewards"], inp["values"], ids, gamma=gamma, lam=lam, last_values=last)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


def test_bench_turn_layouts_have_turns_environment_spans_and_padding():
    from pyppo.bench.cases.turn_gae import turn_inputs

    ids = turn_inputs((16, 512), torch.float32, torch.device("cpu"), 3)["turn_ids"]
    starts = ops.turn_start_mask(ids)
    assert (starts.sum(1) >= 2).all()  # several turns a row
    agent = ids >= 0
    last = torch.where(agent, torch.arange(512), -1).amax(1)
    assert (last < 511).any()  # right padding
    assert all((~agent[b, : int(last[b])]).any() for b in range(16))  # environment spans between turns


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


def test_eager_linear_ppo_loss_matches_pyppo():
    # The eager full-logits PPO loss and the fused op compute the same loss and gradients, with
    # clipped and unclipped tokens both present in the bench's inputs.
    inp = linear_ppo_inputs((2, 16, 8, 300), torch.float32, torch.device("cpu"), 3)
    h, w = inp["hidden"], inp["weight"]
    args = (inp["labels"], inp["old_logprobs"], inp["advantages"], inp["response_mask"])
    got, stats, _, _ = ops.linear_ppo_loss(h, w, *args)
    got_grads = torch.autograd.grad(got, (h, w))
    want = eager.linear_ppo_loss(h, w, *args)
    want_grads = torch.autograd.grad(want, (h, w))
    assert 0 < stats["clipfrac"] < 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def _group(seed, B=64, T=16):
    return group_cases.group_inputs((B, T), torch.float32, torch.device("cpu"), seed)


def test_group_inputs_put_the_score_at_the_last_valid_token():
    inp = _group(9)
    m, r = inp["mask"], inp["token_level_rewards"]
    last = torch.where(m, torch.arange(m.shape[1]), -1).amax(1)
    assert torch.equal(r.sum(-1), inp["scores"]) and torch.equal(r[torch.arange(64), last], inp["scores"])
    assert len(set(inp["index"])) == 64 // group_cases.GROUP_SIZE and inp["index"][:8] == [inp["index"][0]] * 8


@pytest.mark.parametrize(
    "make",
    [
        group_cases.grpo_case,
        lambda s, d: group_cases.grpo_case(s, d, vectorized=True),
        group_cases.rloo_case,
        group_cases.reinforce_pp_baseline_case,
    ],
    ids=["grpo", "grpo_vectorized", "rloo", "reinforce_pp_baseline"],
)
def test_eager_group_advantages_match_pyppo(make):
    case = make((64, 16), torch.float32)
    inp = _group(10)
    torch.testing.assert_close(case.eager(inp), case.pyppo(inp), atol=1e-5, rtol=1e-5)


def test_eager_group_advantages_are_verls_code():
    # The copies in pyppo.bench.eager give veRL 0.9.1's own results, bit for bit.
    from support.peer_support import import_peer

    core = import_peer("verl.trainer.ppo.core_algos")
    inp = _group(11)
    args = (inp["token_level_rewards"], inp["mask"], inp["index"])
    for ours, theirs in [
        (eager.verl_grpo, core.compute_grpo_outcome_advantage),
        (eager.verl_grpo_vectorized, core.compute_grpo_vectorized_outcome_advantage),
        (eager.verl_rloo, core.compute_rloo_outcome_advantage),
        (eager.verl_reinforce_pp_baseline, core.compute_reinforce_plus_plus_baseline_outcome_advantage),
    ]:
        torch.testing.assert_close(ours(*args), theirs(*args)[0], rtol=0, atol=1e-7)
    no_std = eager.verl_grpo(*args, norm_adv_by_std_in_grpo=False)
    assert torch.equal(no_std, core.compute_grpo_outcome_advantage(*args, norm_adv_by_std_in_grpo=False)[0])
