"""pyppo's critic estimators as veRL estimators (pyppo/integrations/verl/estimators.py): decoupled /
length-adaptive GAE ("pyppo_gae") and GAE over agent turns ("pyppo_gae_turn").

(a) against pyppo's own ops in float64, with the whitening and veRL's carry through masked
positions written out here; (b) through veRL 0.9.1's registry and its ray_trainer.compute_advantage
on a real DataProto; (c) unpatch(); (d) bad arguments. The registration machinery of
pyppo.integrations._patching is also checked on a throw-away package.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
import warnings

import numpy as np
import pytest
import torch

import pyppo.integrations.verl as pv
import pyppo.ops as ops
from pyppo.integrations import PeerVersionWarning, _patching
from pyppo.integrations._patching import Peer, Registration, Target
from support.peer_support import import_peer

F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# references, written independently of the adapters


def _mask(B: int, T: int, seed: int) -> torch.Tensor:
    """Rows of agent runs separated by environment spans, a trailing pad, and row 1 all masked."""
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        if b == 1:
            continue
        t = int(torch.randint(0, 2, (), generator=g))  # sometimes a leading observation
        end = T - int(torch.randint(0, 3, (), generator=g))
        while t < end:
            run = int(torch.randint(1, 5, (), generator=g))
            m[b, t : min(t + run, end)] = True
            t += run + int(torch.randint(1, 3, (), generator=g))
    return m


def _batch(B=5, T=13, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    values = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    return rewards, values, _mask(B, T, seed)


def _carry(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Each position takes the value at the first valid position at or after it (0: none)."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        nxt = 0.0
        for t in reversed(range(x.shape[1])):
            if m[b, t]:
                nxt = x[b, t]
            out[b, t] = nxt
    return out


def _whiten(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    sel = x[m].double()
    mean, var = sel.mean(), sel.var(unbiased=True)
    return (x.double() - mean) / torch.sqrt(var + 1e-8)


def _hand_turn_ids(m: torch.Tensor) -> torch.Tensor:
    ids = torch.full(m.shape, -1, dtype=torch.long)
    for b in range(m.shape[0]):
        k, prev = -1, False
        for t in range(m.shape[1]):
            if m[b, t] and not prev:
                k += 1
            if m[b, t]:
                ids[b, t] = k
            prev = bool(m[b, t])
    return ids


def _expected_decoupled(r, v, m, gamma, lam, lam_critic):
    adv, ret = ops.gae(r.double(), v.double(), m, gamma=gamma, lam=lam, lam_critic=lam_critic)
    v = v.double()
    returns = torch.where(m, ret, _carry(ret - v, m) + v)
    return _whiten(_carry(adv, m), m), returns


def _expected_turn(r, v, m, ids, gamma, lam):
    adv, ret = ops.turn_gae(r.double(), v.double(), ids, gamma=gamma, lam=lam)
    return _whiten(_carry(adv, m), m), _carry(ret, m)


def _close(a, b, tol=1e-12):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------------
# (a) the adapters against pyppo's ops


@pytest.mark.parametrize("lam, lam_critic", [(0.95, 1.0), (0.5, 0.9), (1.0, 0.0), (0.8, None)])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_decoupled_is_whitened_gae_with_a_separate_critic_lam(lam, lam_critic, mask_dtype):
    r, v, m = _batch(seed=1)
    config = {"gamma": 0.97, "lam": lam} | ({} if lam_critic is None else {"lam_critic": lam_critic})
    adv, ret = pv.compute_decoupled_gae_advantage_return(
        token_level_rewards=r, response_mask=m.to(mask_dtype), values=v, config=config, index=np.arange(5)
    )
    assert adv.dtype == ret.dtype == F64 and adv.shape == ret.shape == r.shape
    want_adv, want_ret = _expected_decoupled(r, v, m, 0.97, lam, lam if lam_critic is None else lam_critic)
    _close(adv, want_adv)
    _close(ret, want_ret)
    # The returns at valid positions are the op's, with λ_c; the advantages ignore λ_c.
    _close(ret[m], ops.gae(r, v, m, gamma=0.97, lam=lam if lam_critic is None else lam_critic)[1][m])
    assert torch.all(adv[1] == adv[1, 0])  # the all-masked row: the batch's whitened 0


def test_decoupled_critic_lam_moves_only_the_returns():
    r, v, m = _batch(seed=2)
    a1, r1 = pv.compute_decoupled_gae_advantage_return(r, m, v, config={"lam_critic": 1.0}, gamma=1.0, lam=0.9)
    a2, r2 = pv.compute_decoupled_gae_advantage_return(r, m, v, config={"lam_critic": 0.9}, gamma=1.0, lam=0.9)
    assert torch.equal(a1, a2)
    assert (r1 - r2)[m].abs().max() > 1e-3
    # λ_c = 1 and γ = 1: the value target of a valid token is the sum of the rewards from it on.
    suffix = torch.where(m, r, 0.0).flip(-1).cumsum(-1).flip(-1)
    _close(r1[m], suffix[m])


@pytest.mark.parametrize("alpha, T", [(0.05, 97), (0.3, 17), (2.0, 17)])
def test_lam_alpha_gives_each_row_its_length_adaptive_lam(alpha, T):
    r, v, m = _batch(B=6, T=T, seed=3)
    adv, ret = pv.compute_decoupled_gae_advantage_return(
        r, m.long(), v, config={"gamma": 0.99, "lam": 0.95, "lam_critic": 1.0, "lam_alpha": alpha}
    )
    rows = []
    op_lam = ops.length_adaptive_lam(m, alpha)  # float32, as the adapter hands it to gae
    for b in range(r.shape[0]):
        l = int(m[b].sum())
        lam_b = min(max(1.0 - 1.0 / (alpha * l), 0.0), 1.0) if l else 0.0  # VAPO: 1 - 1/(α l)
        assert math.isclose(float(op_lam[b]), lam_b, rel_tol=2**-24, abs_tol=2**-26)
        rows.append(ops.gae(r[b : b + 1], v[b : b + 1], m[b : b + 1], gamma=0.99, lam=float(op_lam[b]))[0])
    assert len(set(op_lam.tolist())) >= 3  # rows of different lengths get different λ
    _close(adv, _whiten(_carry(torch.cat(rows), m), m))
    _, want_ret = _expected_decoupled(r, v, m, 0.99, 0.95, 1.0)
    _close(ret, want_ret)  # the value targets keep λ_c
    fixed, _ = pv.compute_decoupled_gae_advantage_return(r, m, v, config={"lam_critic": 1.0}, gamma=0.99, lam=0.95)
    assert (adv - fixed)[m].abs().max() > 1e-3


def test_bf16_inputs_give_bf16_close_to_float64():
    r, v, m = _batch(B=7, T=29, seed=4, dtype=torch.bfloat16)
    adv, ret = pv.compute_decoupled_gae_advantage_return(r, m.long(), v, config={"lam_critic": 1.0}, gamma=1, lam=0.9)
    assert adv.dtype == ret.dtype == torch.bfloat16
    want_adv, want_ret = _expected_decoupled(r, v, m, 1.0, 0.9, 1.0)  # on the bf16 inputs, in float64
    torch.testing.assert_close(adv.double(), want_adv, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(ret.double(), want_ret, rtol=2**-8, atol=1e-5)

    ids = _hand_turn_ids(m)
    adv, ret = pv.compute_turn_gae_advantage_return(r, m.long(), v, gamma=0.9, lam=0.8)
    assert adv.dtype == ret.dtype == torch.bfloat16
    want_adv, want_ret = _expected_turn(r, v, m, ids, 0.9, 0.8)
    torch.testing.assert_close(adv.double(), want_adv, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(ret.double(), want_ret, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("seed", [5, 6])
def test_turns_derived_from_the_mask_runs(seed):
    r, v, m = _batch(B=5, T=19, seed=seed)
    ids = _hand_turn_ids(m)
    assert int(ids.max()) >= 2  # several turns per row
    adv, ret = pv.compute_turn_gae_advantage_return(
        token_level_rewards=r, response_mask=m, values=v, config={"gamma": 1.0, "lam": 0.95}
    )
    want_adv, want_ret = _expected_turn(r, v, m, ids, 1.0, 0.95)
    _close(adv, want_adv)
    _close(ret, want_ret)
    # gamma_turn / lam_turn override the token-level ones.
    adv2, ret2 = pv.compute_turn_gae_advantage_return(
        r, m, v, config={"gamma": 1.0, "lam": 0.95, "gamma_turn": 0.7, "lam_turn": 0.5}
    )
    want_adv, want_ret = _expected_turn(r, v, m, ids, 0.7, 0.5)
    _close(adv2, want_adv)
    _close(ret2, want_ret)
    assert (ret2 - ret)[m].abs().max() > 1e-3


def test_explicit_turn_ids_split_adjacent_turns_that_the_mask_merges():
    # Row 0: turn 0 at 0-1 and turn 1 at 2-3 back to back, an observation at 4, turn 2 at 5-6.
    m = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    given = torch.tensor([[0, 0, 1, 1, -1, 2, 2, -1], [0, 0, 0, -1, -1, 1, 1, 1]])
    r = torch.zeros(2, 8, dtype=F64)
    r[0, 1], r[0, 3], r[0, 6], r[1, 7] = 0.5, -1.0, 2.0, 1.0
    v = torch.linspace(-1, 1, 16, dtype=F64).reshape(2, 8)

    a_given, r_given = pv.compute_turn_gae_advantage_return(r, m, v, gamma=0.9, lam=0.8, turn_ids=given)
    _close(a_given, _expected_turn(r, v, m, given, 0.9, 0.8)[0])
    _close(r_given, _expected_turn(r, v, m, given, 0.9, 0.8)[1])
    merged = torch.tensor([[0, 0, 0, 0, -1, 1, 1, -1], [0, 0, 0, -1, -1, 1, 1, 1]])
    a_derived, r_derived = pv.compute_turn_gae_advantage_return(r, m, v, gamma=0.9, lam=0.8)
    _close(r_derived, _expected_turn(r, v, m, merged, 0.9, 0.8)[1])
    # Derived: one turn at 0-3, one return; given: two turns, two returns (A_k + V at s_k).
    assert torch.all(r_derived[0, :4] == r_derived[0, 0])
    assert r_given[0, 0] != r_given[0, 2]
    a1 = 0.9 * v[0, 5] + (-1.0) - v[0, 2] + 0.9 * 0.8 * (2.0 - v[0, 5])
    assert math.isclose(float(r_given[0, 2]), float(a1 + v[0, 2]), rel_tol=1e-12)


def test_a_batch_with_fewer_than_two_valid_tokens_is_refused():
    r, v = torch.zeros(2, 3), torch.zeros(2, 3)
    m = torch.tensor([[0, 1, 0], [0, 0, 0]])
    for fn in (pv.compute_decoupled_gae_advantage_return, pv.compute_turn_gae_advantage_return):
        with pytest.raises(ValueError, match="selects 1 position"):
            fn(r, m, v, gamma=1.0, lam=1.0)


# ----------------------------------------------------------------------------------------------
# (d) bad arguments


@pytest.mark.parametrize(
    "fn, config, name",
    [
        ("decoupled", {"lam_critic": 1.5}, "lam_critic"),
        ("decoupled", {"lam_critic": True}, "lam_critic"),
        ("decoupled", {"lam_alpha": -0.1}, "lam_alpha"),
        ("decoupled", {"lam_alpha": math.inf}, "lam_alpha"),
        ("decoupled", {"lam": 1.2}, "lam"),
        ("turn", {"lam_turn": 2.0}, "lam_turn"),
        ("turn", {"gamma_turn": math.nan}, "gamma_turn"),
        ("turn", {"gamma": "0.9"}, "gamma"),
    ],
)
def test_bad_config_values_name_the_key(fn, config, name):
    f = pv.compute_decoupled_gae_advantage_return if fn == "decoupled" else pv.compute_turn_gae_advantage_return
    r, v, m = _batch(seed=7)
    with pytest.raises(ValueError, match=rf": {name} must be a finite number"):
        f(r, m, v, config=config)


def test_bad_tensors_name_the_argument():
    r, v, m = _batch(seed=8)
    for f in (pv.compute_decoupled_gae_advantage_return, pv.compute_turn_gae_advantage_return):
        with pytest.raises(ValueError, match=r"values has shape \(5, 12\) but token_level_rewards has shape \(5, 13\)"):
            f(r, m, v[:, :12], gamma=1.0, lam=1.0)
        with pytest.raises(TypeError, match="values is required"):
            f(token_level_rewards=r, response_mask=m, config={}, index=np.arange(5))
        with pytest.raises(ValueError, match="response_mask must be bool or hold only 0 and 1"):
            f(r, m.double() * 2, v, gamma=1.0, lam=1.0)
    turn = pv.compute_turn_gae_advantage_return
    with pytest.raises(ValueError, match="turn_ids must be an integer tensor"):
        turn(r, m, v, gamma=1.0, lam=1.0, turn_ids=_hand_turn_ids(m).double())
    with pytest.raises(ValueError, match="turn_ids has shape"):
        turn(r, m, v, gamma=1.0, lam=1.0, turn_ids=_hand_turn_ids(m)[:, 1:])
    ids = _hand_turn_ids(m)
    ids[0, 0] = 0 if ids[0, 0] < 0 else -1
    with pytest.raises(ValueError, match=r"turn_ids must be >= 0 exactly where response_mask is 1; 1 position"):
        turn(r, m, v, gamma=1.0, lam=1.0, turn_ids=ids)


# ----------------------------------------------------------------------------------------------
# (b), (c) through veRL


def _import_trainer():
    """veRL's ray_trainer (it needs torchdata beside veRL's math: scripts/install_peers.sh)."""
    import_peer("verl.trainer.ppo.core_algos")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # veRL's own notices about engines absent on CPU
            return import_peer("verl.trainer.ppo.ray_trainer")
    except ImportError as exc:  # e.g. torchdata missing: veRL's trainer cannot run here either
        pytest.skip(f"verl.trainer.ppo.ray_trainer does not import: {exc}")


@pytest.fixture
def verl():
    rt = _import_trainer()
    ca = import_peer("verl.trainer.ppo.core_algos")
    assert _patching.active(pv.PEER) is None, "a previous test left veRL patched"
    yield types.SimpleNamespace(rt=rt, ca=ca, compute_advantage=rt.compute_advantage)
    if _patching.active(pv.PEER) is not None:
        pv.unpatch()


def _data(seed=9, dtype=torch.float32, turn_ids=False):
    from verl.protocol import DataProto

    r, v, m = _batch(B=6, T=11, seed=seed, dtype=dtype)
    tensors = {"token_level_rewards": r, "values": v, "response_mask": m.long()}
    if turn_ids:
        tensors["turn_ids"] = _hand_turn_ids(m)
    uid = np.array(["p0", "p0", "p1", "p1", "p2", "p2"], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


def _config(**extra):
    from omegaconf import OmegaConf

    return OmegaConf.create({"gamma": 0.99, "lam": 0.9, "use_pf_ppo": False, "norm_adv_by_std_in_grpo": True} | extra)


def test_patch_registers_the_estimators_and_routes_compute_advantage(verl):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = pv.patch()
    assert [a.where for a in p.added] == [
        "verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY['pyppo_gae']",
        "verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY['pyppo_gae_turn']",
    ]
    assert p.skipped == [] and "2 registry entries added" in repr(p)
    assert verl.ca.get_adv_estimator_fn(pv.PYPPO_GAE) is pv.compute_decoupled_gae_advantage_return
    assert verl.ca.get_adv_estimator_fn("pyppo_gae_turn") is pv.compute_turn_gae_advantage_return
    assert verl.rt.compute_advantage is pv.compute_advantage
    assert p.originals["verl.trainer.ppo.ray_trainer.compute_advantage"] is verl.compute_advantage

    config = _config(lam_critic=1.0, lam_alpha=0.1)
    data = verl.rt.compute_advantage(_data(), "pyppo_gae", gamma=0.99, lam=0.9, config=config)
    b = data.batch
    want = pv.compute_decoupled_gae_advantage_return(
        b["token_level_rewards"], b["response_mask"], b["values"], config=config, gamma=0.99, lam=0.9
    )
    assert torch.equal(b["advantages"], want[0]) and torch.equal(b["returns"], want[1])
    r, v, m = _batch(B=6, T=11, seed=9, dtype=torch.float32)
    rows = [
        ops.gae(r[i : i + 1], v[i : i + 1], m[i : i + 1], gamma=0.99, lam=float(lam))[0]
        for i, lam in enumerate(ops.length_adaptive_lam(m, 0.1))
    ]
    torch.testing.assert_close(b["advantages"].double(), _whiten(_carry(torch.cat(rows), m), m), rtol=1e-5, atol=1e-5)

    # The turn estimator: turns from the mask, or the batch's turn_ids; gamma_turn from the config.
    config = _config(gamma_turn=0.8)
    for with_ids in (False, True):
        data = verl.rt.compute_advantage(_data(seed=10, turn_ids=with_ids), "pyppo_gae_turn", 0.99, 0.9, config=config)
        r, v, m = _batch(B=6, T=11, seed=10, dtype=torch.float32)
        want_adv, want_ret = _expected_turn(r, v, m, _hand_turn_ids(m), 0.8, 0.9)
        torch.testing.assert_close(data.batch["advantages"].double(), want_adv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(data.batch["returns"].double(), want_ret, rtol=1e-5, atol=1e-5)


def test_turn_ids_in_the_batch_reach_the_estimator(verl):
    pv.patch()
    data = _data(seed=11, turn_ids=True)
    data.batch["turn_ids"] = data.batch["turn_ids"].clamp(max=0)  # one turn per row
    out = verl.rt.compute_advantage(data, "pyppo_gae_turn", 1.0, 1.0, config=_config())
    derived = verl.rt.compute_advantage(_data(seed=11), "pyppo_gae_turn", 1.0, 1.0, config=_config())
    r, v, m = _batch(B=6, T=11, seed=11, dtype=torch.float32)
    # One turn, γ = λ = 1: every token's return is the row's summed reward (A = R - V_0, + V_0).
    summed = torch.where(m, r, 0.0).sum(-1, keepdim=True).expand_as(r)
    torch.testing.assert_close(out.batch["returns"][m], summed[m], rtol=1e-6, atol=1e-6)
    assert (derived.batch["returns"] - summed)[m].abs().max() > 1e-2  # the mask's runs: several turns


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo"])
def test_verls_own_estimators_still_give_verls_results(verl, estimator):
    config = _config()
    base = verl.compute_advantage(_data(seed=12, dtype=F64), estimator, 0.99, 0.9, config=config)
    pv.patch()
    ours = verl.rt.compute_advantage(_data(seed=12, dtype=F64), estimator, 0.99, 0.9, config=config)
    for key in ("advantages", "returns"):
        torch.testing.assert_close(ours.batch[key], base.batch[key], rtol=1e-9, atol=1e-9)


def test_pyppo_gae_with_default_config_is_verls_gae(verl):
    config = _config()  # no lam_critic, no lam_alpha
    base = verl.compute_advantage(_data(seed=13, dtype=F64), "gae", 0.99, 0.9, config=config)
    pv.patch()
    ours = verl.rt.compute_advantage(_data(seed=13, dtype=F64), "pyppo_gae", 0.99, 0.9, config=config)
    for key in ("advantages", "returns"):
        torch.testing.assert_close(ours.batch[key], base.batch[key], rtol=1e-9, atol=1e-9)


def test_compute_advantage_fills_the_response_mask_and_needs_values(verl):
    pv.patch()
    data = _data(seed=14)
    want = verl.rt.compute_advantage(_data(seed=14), "pyppo_gae", 1.0, 0.95, config=_config())
    mask = data.batch.pop("response_mask")
    B, T = mask.shape
    data.batch["responses"] = torch.zeros(B, T, dtype=torch.long)
    data.batch["attention_mask"] = torch.cat([torch.ones(B, 4, dtype=torch.long), mask], dim=1)
    out = verl.rt.compute_advantage(data, "pyppo_gae", 1.0, 0.95, config=_config())
    assert torch.equal(out.batch["response_mask"], mask)
    assert torch.equal(out.batch["advantages"], want.batch["advantages"])

    data = _data(seed=14)
    data.batch.pop("values")
    with pytest.raises(ValueError, match=r"needs data.batch\['values'\].*critic.enable=True"):
        verl.rt.compute_advantage(data, "pyppo_gae_turn", 1.0, 0.95, config=_config())


def test_unpatch_removes_the_registrations_and_restores_compute_advantage(verl):
    p = pv.patch()
    assert pv.unpatch() is p
    assert "pyppo_gae" not in verl.ca.ADV_ESTIMATOR_REGISTRY and "pyppo_gae_turn" not in verl.ca.ADV_ESTIMATOR_REGISTRY
    with pytest.raises(ValueError, match="Unknown advantage estimator"):
        verl.ca.get_adv_estimator_fn("pyppo_gae")
    assert verl.rt.compute_advantage is verl.compute_advantage
    assert verl.ca.compute_gae_advantage_return is not pv.compute_gae_advantage_return


def test_a_taken_key_is_left_alone_with_a_warning(verl):
    def theirs(**kwargs):
        return None

    verl.ca.ADV_ESTIMATOR_REGISTRY["pyppo_gae"] = theirs
    try:
        with pytest.warns(PeerVersionWarning, match=r"not registered: .*\['pyppo_gae'\] \(held by"):
            p = pv.patch()
        assert verl.ca.ADV_ESTIMATOR_REGISTRY["pyppo_gae"] is theirs
        assert [a.fn for a in p.added] == [pv.compute_turn_gae_advantage_return]
        pv.unpatch()
        assert verl.ca.ADV_ESTIMATOR_REGISTRY["pyppo_gae"] is theirs
    finally:
        verl.ca.ADV_ESTIMATOR_REGISTRY.pop("pyppo_gae", None)


def test_unpatched_verl_passes_no_values_and_the_estimator_says_so(verl):
    pv.patch()
    original = _patching.active(pv.PEER).originals["verl.trainer.ppo.ray_trainer.compute_advantage"]
    with pytest.raises(TypeError, match="values is required.*patch\\(\\) replaces it"):
        original(_data(seed=15), "pyppo_gae", 1.0, 1.0, config=_config())


# ----------------------------------------------------------------------------------------------
# the registration machinery on a throw-away package

PACKAGE = "pyppo_fakepeer_registry"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text("def f(x):\n    return 'peer'\n\ndef g(x):\n    return 'peer-g'\n\nREG = {'f': f}\n")
    dist = tmp_path / f"{PACKAGE}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield importlib.import_module(f"{PACKAGE}.core")
    _patching._ACTIVE.pop("fakereg", None)
    for name in [n for n in sys.modules if n.startswith(PACKAGE)]:
        del sys.modules[name]


def _adapter(x):
    return "adapter"


def _added(x):
    return "added"


def test_registrations_and_optional_targets(fake):
    peer = Peer(
        "fakereg",
        PACKAGE,
        PACKAGE,
        ("1.0",),
        (Target(f"{PACKAGE}.core", "f", _adapter),),
        registrations=(Registration(f"{PACKAGE}.core", "REG", "new", _added),),
        optional_targets=(Target(f"{PACKAGE}.missing", "g", _adapter), Target(f"{PACKAGE}.core", "g", _adapter)),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither the optional target nor the registration warns
        p = _patching.patch(peer)
    assert fake.f is _adapter and fake.g is _adapter and fake.REG == {"f": _adapter, "new": _added}
    assert len(p) == 4 and [a.where for a in p.added] == [f"{PACKAGE}.core.REG['new']"]
    assert p.skipped == [f"{PACKAGE}.missing.g (cannot import {PACKAGE}.missing: No module named '{PACKAGE}.missing')"]
    assert _patching.original(peer, f"{PACKAGE}.core", "f")("x") == "peer"
    _patching.unpatch(peer)
    assert fake.REG == {"f": fake.f} and fake.f("x") == "peer" and fake.g("x") == "peer-g"
    assert _patching.original(peer, f"{PACKAGE}.core", "f") is fake.f

    # An entry re-assigned while patched is someone else's: left, with a warning.
    _patching.patch(peer)
    fake.REG["new"] = len
    with pytest.warns(PeerVersionWarning, match=r"re-assigned after patch\(\): .*REG\['new'\]"):
        _patching.unpatch(peer)
    assert fake.REG["new"] is len

    # A required module that fails still raises; a registry that is absent is warned about.
    broken = Peer(
        "fakereg", PACKAGE, PACKAGE, ("1.0",), (), registrations=(Registration(f"{PACKAGE}.nope", "R", 1, _added),)
    )
    with pytest.raises(ImportError, match=rf"cannot import {PACKAGE}\.nope"):
        _patching.patch(broken)
    absent = Peer(
        "fakereg", PACKAGE, PACKAGE, ("1.0",), (), registrations=(Registration(f"{PACKAGE}.core", "NONE", 1, _added),)
    )
    with pytest.warns(PeerVersionWarning, match=r"NONE\[1\] \(no such registry\)"):
        assert not _patching.patch(absent)
