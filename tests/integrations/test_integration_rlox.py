"""pyppo.integrations.rlox against the real rlox 1.2.0 functions: values, dtypes and shapes on
fresh random inputs (odd sizes, groups of one, equal scores, episode ends anywhere), errors,
patch()/unpatch(), and ``pyppo bench --peer rlox``.

Every comparison calls rlox's own function (captured before any patching) and the adapter on the
same numpy arrays. Tolerances: float64 rounding for the float64 functions (group advantages, GAE),
float32 rounding for the float32 ones (rlox sums a sequence's KL terms in float32, the adapter in
float64). These tests skip when rlox is not installed (``pip install 'pyppo[rlox]'`` or
``bash scripts/install_peers.sh``).
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import warnings
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyppo.integrations.rlox as prlox
from pyppo import cli
from pyppo.integrations import PeerVersionWarning, _patching
from support.peer_support import import_peer, pyppo_ops_called

NAMES = (
    "compute_batch_group_advantages",
    "compute_gae_batched_f32",
    "compute_gae_batched",
    "compute_batch_token_kl_schulman_f32",
    "compute_batch_token_kl_f32",
)
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GAMMA, LAM = 0.99, 0.95


@pytest.fixture(scope="module")
def peer():
    """rlox's own functions, captured unpatched."""
    core = import_peer("rlox._rlox_core")
    assert _patching.active(prlox.PEER) is None, "a previous test left rlox patched"
    return SimpleNamespace(**{n: getattr(core, n) for n in NAMES})


@pytest.fixture(scope="module", autouse=True)
def _always_unpatch():
    yield
    prlox.unpatch()


def assert_same_array(ours, theirs, *, rtol, atol):
    """Same numpy type, dtype and shape, values within the tolerance (NaN and inf at the same places)."""
    assert isinstance(ours, np.ndarray) and ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(torch.from_numpy(ours), torch.from_numpy(theirs), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- group advantages


def group_rewards(rng, n_prompts, group_size, kind):
    """Rewards of ``n_prompts`` groups: Gaussian, 0/1 (GRPO's verifiable rewards, so many equal
    groups) or a few levels (ties), plus some groups of one value."""
    shape = (n_prompts, group_size)
    if kind == "binary":
        r = (rng.random(shape) < 0.4).astype(np.float64)
    elif kind == "levels":
        r = rng.integers(0, 3, shape) * 0.1
    else:
        r = rng.normal(size=shape) * rng.choice([1e-3, 1.0, 50.0])
    r[::5] = r[::5, :1]  # equal scores
    return np.ascontiguousarray(r.reshape(-1))


@HYP
@given(
    n_prompts=st.integers(0, 41),
    group_size=st.sampled_from([1, 2, 3, 5, 7, 8, 16, 64]),
    kind=st.sampled_from(["normal", "binary", "levels"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_group_advantages_match_rlox(peer, n_prompts, group_size, kind, seed):
    rewards = group_rewards(np.random.default_rng(seed), n_prompts, group_size, kind)
    keep = rewards.copy()
    theirs = peer.compute_batch_group_advantages(rewards, group_size)
    ours = prlox.compute_batch_group_advantages(rewards, group_size)
    assert_same_array(ours, theirs, rtol=1e-12, atol=1e-12)
    assert np.array_equal(rewards, keep) and not np.shares_memory(ours, rewards)
    equal = (rewards.reshape(-1, group_size) == rewards.reshape(-1, group_size)[:, :1]).all(1)
    assert (ours.reshape(-1, group_size)[equal] == 0).all()  # equal scores and groups of one: exactly 0


def test_group_advantages_zero_rule_is_rloxs_threshold(peer):
    # Population stds of 5e-9 (below rlox's 1e-8: zeros) and 2e-8 (above: z-scores of ±1).
    rewards = np.array([1.0, 1.0 + 1e-8, 3.0, 3.0 + 4e-8])
    theirs = peer.compute_batch_group_advantages(rewards, 2)
    ours = prlox.compute_batch_group_advantages(rewards, 2)
    assert_same_array(ours, theirs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours, [0.0, 0.0, -1.0, 1.0], atol=1e-6)
    assert prlox.STD_THRESHOLD == 1e-8


def test_read_only_arrays_are_taken_without_a_warning(peer):
    rewards = np.random.default_rng(6).normal(size=12)
    rewards.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = prlox.compute_batch_group_advantages(rewards, 4)
        policy = rewards.astype(np.float32)
        policy.flags.writeable = False
        kl = prlox.compute_batch_token_kl_schulman_f32(policy, policy, 3)
    assert_same_array(ours, peer.compute_batch_group_advantages(rewards, 4), rtol=1e-12, atol=1e-12)
    assert (kl == 0).all()


def test_group_advantages_run_pyppos_op():
    with pyppo_ops_called() as ops:
        prlox.compute_batch_group_advantages(np.arange(12, dtype=np.float64), 4)
    assert ops == ["pyppo::group_advantages.group_size"]


# --------------------------------------------------------------------------- GAE


def gae_inputs(rng, n_envs, n_steps, dones, dtype, extra=0):
    size = n_envs * n_steps + extra
    rewards = rng.normal(size=size).astype(dtype)
    values = rng.normal(size=size).astype(dtype)
    if dones == "none":
        d = np.zeros(size)
    elif dones == "last":  # one episode per row, as an LM rollout
        d = np.zeros(size)
        if n_steps:
            d[n_steps - 1 : n_envs * n_steps : n_steps] = 1.0
    elif dones == "all":
        d = np.ones(size)
    else:
        d = (rng.random(size) < float(dones)).astype(np.float64)
    return rewards, values, d.astype(dtype), rng.normal(size=n_envs).astype(dtype)


@HYP
@given(
    n_envs=st.integers(0, 9),
    n_steps=st.integers(0, 70),
    dones=st.sampled_from(["none", "last", "all", "0.02", "0.2", "0.7"]),
    f32=st.booleans(),
    extra=st.sampled_from([0, 0, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_gae_matches_rlox(peer, n_envs, n_steps, dones, f32, extra, seed):
    dtype = np.float32 if f32 else np.float64
    name = "compute_gae_batched_f32" if f32 else "compute_gae_batched"
    args = gae_inputs(np.random.default_rng(seed), n_envs, n_steps, dones, dtype, extra)
    theirs = getattr(peer, name)(*args, n_steps, GAMMA, LAM)
    ours = getattr(prlox, name)(*args, n_steps, GAMMA, LAM)
    assert isinstance(ours, tuple) and len(ours) == 2
    tol = dict(rtol=1e-5, atol=1e-5) if f32 else dict(rtol=1e-12, atol=1e-12)
    for a, b in zip(ours, theirs):
        assert_same_array(a, b, **tol)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.0), (0.0, 0.5)])
def test_gae_edge_coefficients(peer, gamma, lam):
    args = gae_inputs(np.random.default_rng(3), 5, 40, "0.1", np.float32)
    for a, b in zip(
        prlox.compute_gae_batched_f32(*args, 40, gamma, lam), peer.compute_gae_batched_f32(*args, 40, gamma, lam)
    ):
        assert_same_array(a, b, rtol=1e-5, atol=1e-5)


def test_gae_episodes_inside_rows_take_one_op_call_per_width():
    # Episodes of lengths 1..33 inside 2 rows: rows of 1, 2, 4, ..., 64 positions.
    rng = np.random.default_rng(4)
    rewards, values, dones, last_values = gae_inputs(rng, 2, 100, "none", np.float32)
    for end in (0, 1, 3, 6, 20, 53, 60, 99, 100 + 33, 100 + 40):
        dones[end] = 1.0
    with pyppo_ops_called() as ops:
        prlox.compute_gae_batched_f32(rewards, values, dones, last_values, 100, GAMMA, LAM)
    assert ops and set(ops) == {"pyppo::gae"} and len(ops) <= 8
    with pyppo_ops_called() as ops:
        prlox.compute_gae_batched_f32(rewards, values, np.zeros_like(dones), last_values, 100, GAMMA, LAM)
    assert ops == ["pyppo::gae"]


# --------------------------------------------------------------------------- token KL


@HYP
@given(
    batch=st.integers(0, 9),
    seq_len=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 0.3, 2.0, 5.0]),  # overflow: test_token_kl_direction_and_overflow
    schulman=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_token_kl_matches_rlox(peer, batch, seq_len, scale, schulman, seed):
    rng = np.random.default_rng(seed)
    policy = (rng.normal(size=batch * seq_len) - 2.0).astype(np.float32)
    ref = (policy + scale * rng.normal(size=policy.shape)).astype(np.float32)
    name = "compute_batch_token_kl_schulman_f32" if schulman else "compute_batch_token_kl_f32"
    theirs = getattr(peer, name)(policy, ref, seq_len)
    ours = getattr(prlox, name)(policy, ref, seq_len)
    # rlox's float32 running sum: ~sqrt(seq_len) roundings of the largest partial sum.
    scale_out = max(1.0, float(np.abs(theirs).max(initial=0.0)))
    assert_same_array(ours, theirs, rtol=1e-5, atol=2e-6 * math.sqrt(seq_len) * scale_out)


def test_token_kl_direction_and_overflow(peer):
    # exp(log π − log π_ref) − (log π − log π_ref) − 1: +inf past float32's exp, as in rlox.
    policy = np.array([0.0, -100.0, -1.0, -1.0], np.float32)
    ref = np.array([-100.0, 0.0, -1.5, -0.5], np.float32)
    for name in ("compute_batch_token_kl_schulman_f32", "compute_batch_token_kl_f32"):
        ours, theirs = getattr(prlox, name)(policy, ref, 1), getattr(peer, name)(policy, ref, 1)
        assert_same_array(ours, theirs, rtol=1e-6, atol=1e-6)
    assert math.isinf(prlox.compute_batch_token_kl_schulman_f32(policy, ref, 1)[0])
    x = np.float64(0.5)
    np.testing.assert_allclose(prlox.compute_batch_token_kl_schulman_f32(policy, ref, 1)[2], math.exp(x) - x - 1, 1e-6)


# --------------------------------------------------------------------------- errors


def _error_cases():
    f64, f32 = np.arange(6, dtype=np.float64), np.zeros(6, np.float32)
    lv = np.zeros(2, np.float32)
    return {
        "group_float32": ("compute_batch_group_advantages", (f64.astype(np.float32), 3), TypeError),
        "group_list": ("compute_batch_group_advantages", (list(f64), 3), TypeError),
        "group_2d": ("compute_batch_group_advantages", (f64.reshape(2, 3), 3), TypeError),
        "group_not_dividing": ("compute_batch_group_advantages", (f64, 4), ValueError),
        "group_size_zero": ("compute_batch_group_advantages", (f64, 0), ValueError),
        "gae_float64": ("compute_gae_batched_f32", (f64, f64, f64, lv.astype(np.float64), 3, GAMMA, LAM), TypeError),
        "kl_lengths": ("compute_batch_token_kl_schulman_f32", (f32, f32[:5], 1), ValueError),
        "kl_not_dividing": ("compute_batch_token_kl_f32", (f32, f32, 4), ValueError),
        "kl_seq_len_zero": ("compute_batch_token_kl_schulman_f32", (f32, f32, 0), ValueError),
        "kl_float64": ("compute_batch_token_kl_f32", (f64, f64, 2), TypeError),
    }


@pytest.mark.parametrize("case", sorted(_error_cases()))
def test_errors_have_rloxs_types(peer, case):
    name, args, kind = _error_cases()[case]
    with pytest.raises(kind):
        getattr(peer, name)(*args)
    with pytest.raises(kind, match=name):
        getattr(prlox, name)(*args)


def test_deliberate_errors():
    # Where rlox computes something anyway (or panics), the adapters raise a ValueError naming why.
    f32 = np.zeros(6, np.float32)
    lv = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="dones must hold only 0 and 1"):
        prlox.compute_gae_batched_f32(f32, f32, f32 + 0.5, lv, 3, GAMMA, LAM)
    with pytest.raises(ValueError, match="fewer than len"):
        prlox.compute_gae_batched_f32(f32[:5], f32, f32, lv, 3, GAMMA, LAM)
    with pytest.raises(ValueError, match="gamma"):
        prlox.compute_gae_batched_f32(f32, f32, f32, lv, 3, 1.5, LAM)
    with pytest.raises(ValueError, match="not finite"):
        prlox.compute_batch_group_advantages(np.array([1.0, math.nan]), 2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        prlox.compute_batch_group_advantages(np.zeros(4), -2)


# --------------------------------------------------------------------------- patch()


def test_patch_routes_rlox_through_pyppo(peer):
    import rlox
    import rlox._rlox_core as core

    rewards = np.random.default_rng(5).normal(size=24)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PeerVersionWarning)
        p = prlox.patch()
    try:
        for n in NAMES:
            assert getattr(core, n) is getattr(prlox, n) and getattr(rlox, n) is getattr(prlox, n)
            assert p.originals[f"rlox._rlox_core.{n}"] is getattr(peer, n)
        with pyppo_ops_called() as ops:
            got = rlox.compute_batch_group_advantages(rewards, 6)  # as rlox.algorithms.grpo calls it
        assert ops == ["pyppo::group_advantages.group_size"]
        assert_same_array(got, peer.compute_batch_group_advantages(rewards, 6), rtol=1e-12, atol=1e-12)
    finally:
        prlox.unpatch()
    for n in NAMES:
        assert getattr(core, n) is getattr(peer, n) and getattr(rlox, n) is getattr(peer, n)


# --------------------------------------------------------------------------- pyppo bench --peer rlox


def test_bench_peer_rlox_reports_agreement_and_ratios(peer, tmp_path):
    buf = io.StringIO()
    with redirect_stdout(buf):
        status = cli.main(["bench", "--peer", "rlox", "--sizes", "tiny", "--memory", "off", "--output", str(tmp_path)])
    assert status == 0, buf.getvalue()
    (path,) = tmp_path.glob("bench-peer-rlox-*.json")
    result = json.loads(path.read_text())
    rows = result["rows"]
    assert {r["function"] for r in rows} == set(NAMES)
    assert all(r["device"] == "cpu" and r["agree"] and "error" not in r for r in rows), rows
    groups = sorted(r["shape_str"] for r in rows if r["function"] == "compute_batch_group_advantages")
    assert groups == ["2x16", "4x8"] and result["shapes"]["cpu"]["groups"] == [[4, 8], [2, 16]]
    assert all(math.isfinite(r["speedup"]) and r["speedup"] > 0 for r in rows)
    assert {r["dtype"] for r in rows} == {"float32", "float64"}
    assert "group advantages (rlox) [n_prompts x group_size]: 4x8, 2x16" in buf.getvalue()


def test_vs_rlox_benchmark_script(peer, tmp_path):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_rlox.py"
    spec = importlib.util.spec_from_file_location("vs_rlox", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "vs_rlox.json"
    with redirect_stdout(io.StringIO()) as buf:
        assert script.main(["--sizes", "tiny", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["summary"]}
    assert set(rows) == {
        "group advantages 4x8",
        "gae 4x32 (one episode per row)",
        "gae 4x32 (episodes end w.p. 1/128)",
        "token_kl_schulman_f32 4x32",
        "token_kl_f32 4x32",
    }
    assert set(rows["group advantages 4x8"]["ratio"]) == {"pyppo", "adapter"}
    assert all(v > 0 and math.isfinite(v) for r in rows.values() for v in r["ratio"].values())
    assert len(result["repeats"]) == 2 and result["env"]["rlox"] == "1.2.0"
    assert "medians over 2 repeats" in buf.getvalue()


@pytest.mark.parametrize("where", ["inside", "last"])
@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, math.nan, math.inf])
def test_gae_dones_check_on_both_paths(peer, where, bad):
    # A done on a row's last step only is checked on that column alone; elsewhere on the whole
    # array. Both reject any value but 0 and 1, and both read -0.0 as 0, as rlox does.
    args = list(gae_inputs(np.random.default_rng(5), 4, 16, "last", np.float32))
    at = 16 * 2 + (5 if where == "inside" else 15)
    dones = args[2].copy()
    dones[at] = bad
    with pytest.raises(ValueError, match="dones must hold only 0 and 1"):
        prlox.compute_gae_batched_f32(*args[:2], dones, args[3], 16, GAMMA, LAM)
    for zero_at in (at, 16 * 2 + 5, 16 * 3 + 15):
        dones = args[2].copy()
        dones[zero_at] = -0.0
        ours = prlox.compute_gae_batched_f32(*args[:2], dones, args[3], 16, GAMMA, LAM)
        for a, b in zip(ours, peer.compute_gae_batched_f32(*args[:2], dones, args[3], 16, GAMMA, LAM)):
            assert_same_array(a, b, rtol=1e-5, atol=1e-5)
