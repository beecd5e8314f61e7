"""The CUDA reductions' contract, checked on the CPU through their float32 replays (cuda_emulation.py),
and, where a GPU is present, the kernels against those replays.

The replays perform the kernels' operations in the kernels' order, so what they guarantee here
the kernels guarantee on the device: log-probs never positive and exactly 0 for one-hot rows and
V = 1 (whatever the last bits of ex2.approx), huge finite logits finite, GAE bits that do not
change when other rows make the padded batch longer, group advantages that are the CPU's bits
and depend only on their group, and k3 values and gradients that are the CPU kernel's bits.
"""

from __future__ import annotations

import cuda_emulation as emu
import numpy as np
import pytest
import torch

from support.reference import F64, bits_equal, random_turn_ids, ref_gae, ref_kl_penalty


def _has_cuda() -> bool:
    import pyppo

    return torch.cuda.is_available() and bool(getattr(pyppo._C, "with_cuda", False))


HAS_CUDA = _has_cuda()

KVEC = {torch.float32: 4, torch.bfloat16: 8, torch.float16: 8}


def _rows(R: int, V: int, seed: int, scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((R, V)) * scale).astype(np.float32), rng.integers(0, V, R)


def _one_hot_rows(R: int, V: int, seed: int, gap: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose label's logit is an arbitrary float and every other logit lies `gap` below it
    or further: the softmax is one-hot in float32, so the log-prob must be exactly 0."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, V, R)
    top = (rng.standard_normal(R) * 50).astype(np.float32)
    z = (top[:, None] - gap - rng.random((R, V)) * 100).astype(np.float32)
    z[np.arange(R), labels] = top
    return z, labels


# --------------------------------------------------------------------------- gather_logprobs fwd


@pytest.mark.parametrize("kvec", [4, 8])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("ex2_ulps", [0, 2])
def test_emulated_logprobs_are_never_positive(kvec, temperature, ex2_ulps):
    # Sharp rows (scale 40) put nearly all the mass on the max, where a log-prob rounding above
    # 0 would show; V = 3000 spans a partial pass.
    for scale in (3.0, 40.0):
        z, labels = _rows(64, 3000, seed=int(scale) + kvec, scale=scale)
        labels[:32] = z[:32].argmax(-1)
        lp, ent, lse = emu.gather_fwd(z, labels, temperature=temperature, kvec=kvec, ex2_ulps=ex2_ulps)
        assert np.isfinite(lp).all() and (lp <= 0).all(), lp.max()
        assert np.isfinite(ent).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("kvec", [4, 8])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("ex2_ulps", [0, 2])
def test_emulated_one_hot_rows_and_single_token_vocab_give_exactly_zero(kvec, temperature, ex2_ulps):
    gap = 120.0 * temperature  # e^(-gap / temperature) underflows float32
    for V in (1, 7, 1025, 4099):
        z, labels = _one_hot_rows(128, V, seed=V + kvec, gap=gap)
        lp, ent, _ = emu.gather_fwd(z, labels, temperature=temperature, kvec=kvec, ex2_ulps=ex2_ulps)
        assert (lp == 0).all(), (V, lp[lp != 0][:5])
        assert (ent == 0).all(), (V, ent[ent != 0][:5])


def test_emulated_huge_finite_logits_stay_finite():
    # |z / temperature| between FLT_MAX / log2(e) (2.36e38) and FLT_MAX: a base-2 scaling before
    # the max would overflow; the kernel scales differences only.
    rng = np.random.default_rng(3)
    z = (np.sign(rng.standard_normal((8, 300))) * rng.uniform(2.4e38, 3.4e38, (8, 300))).astype(np.float32)
    labels = z.argmax(-1)
    labels[4:] = rng.integers(0, 300, 4)
    lp, ent, lse = emu.gather_fwd(z, labels)
    assert np.isfinite(lse).all() and np.isfinite(ent).all() and np.isfinite(lp[:4]).all()
    assert (lp[:4] <= 0).all() and np.array_equal(lse, z.max(-1))
    # The CPU kernel gives the same (finite) results.
    from pyppo.ops import gather_logprobs

    cpu_lp, cpu_ent = gather_logprobs(torch.from_numpy(z), torch.from_numpy(labels), return_entropy=True)
    assert torch.isfinite(cpu_ent).all() and torch.equal(torch.isfinite(cpu_lp), torch.from_numpy(np.isfinite(lp)))


@pytest.mark.parametrize("V", [7, 4099, 6144])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_emulated_values_match_float64(V, temperature):
    z, labels = _rows(8, V, seed=V)
    lp, ent, lse = emu.gather_fwd(z, labels, temperature=temperature)
    x = torch.from_numpy(z).to(F64) / temperature
    logp = torch.log_softmax(x, -1)
    ref_lp = logp[torch.arange(8), torch.from_numpy(labels)]
    ref_ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(torch.from_numpy(lp).to(F64), ref_lp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(torch.from_numpy(ent).to(F64), ref_ent, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(torch.from_numpy(lse).to(F64), torch.logsumexp(x, -1), rtol=1e-6, atol=1e-5)


def test_emulated_nonfinite_rows():
    z, labels = _rows(4, 700, seed=9)
    z[0, 5] = np.nan
    z[1, 9] = np.inf
    z[2, :] = -np.inf
    lp, ent, lse = emu.gather_fwd(z, labels)
    assert np.isnan(lp[:3]).all() and np.isnan(ent[:3]).all() and np.isfinite(lp[3])


# ------------------------------------------------------------------------------------------- gae


def _gae_inputs(B: int, T: int, seed: int):
    """Rows of several valid lengths (all within T), holes in the middle, junk where masked."""
    rng = np.random.default_rng(seed)
    rewards = rng.standard_normal((B, T)).astype(np.float32)
    values = rng.standard_normal((B, T)).astype(np.float32)
    lengths = rng.integers(1, T + 1, B)
    lengths[0] = T
    mask = (np.arange(T) < lengths[:, None]) & (rng.random((B, T)) < 0.85)
    mask[:, 0] = True
    mask[1] = False  # an all-masked row
    last = rng.standard_normal(B).astype(np.float32)
    return rewards, values, mask, last


def _padded(x: np.ndarray, T: int, fill) -> np.ndarray:
    out = np.full((x.shape[0], T), fill, dtype=x.dtype)
    out[:, : x.shape[1]] = x
    return out


@pytest.mark.parametrize("with_last", [False, True])
def test_emulated_gae_bits_do_not_change_with_right_padding(with_last):
    rewards, values, mask, last = _gae_inputs(6, 1000, seed=1)
    lv = last if with_last else None
    adv, ret = emu.gae(rewards, values, mask, gamma=0.99, lam=0.95, last_values=lv)
    for T in (1023, 1024, 1300, 2048):
        # Junk rewards and values at the padding: masked, so never read.
        a, r = emu.gae(
            _padded(rewards, T, 7.0),
            _padded(values, T, -3.0),
            _padded(mask, T, False),
            gamma=0.99,
            lam=0.95,
            last_values=lv,
        )
        assert np.array_equal(a[:, :1000].view(np.uint32), adv.view(np.uint32)), T
        assert np.array_equal(r[:, :1000].view(np.uint32), ret.view(np.uint32)), T
        assert (a[:, 1000:] == 0).all() and (r[:, 1000:] == 0).all()


@pytest.mark.parametrize("T", [5, 16, 513, 1024, 2500])
def test_emulated_gae_matches_reference(T):
    rewards, values, mask, last = _gae_inputs(5, T, seed=T)
    adv, ret = emu.gae(rewards, values, mask, gamma=0.99, lam=0.95, last_values=last)
    ref_a, ref_r = ref_gae(
        torch.from_numpy(rewards),
        torch.from_numpy(values),
        torch.from_numpy(mask),
        gamma=0.99,
        lam=0.95,
        last_values=torch.from_numpy(last),
    )
    t = dict(rtol=1e-4, atol=1e-4 * max(1.0, T / 256))
    torch.testing.assert_close(torch.from_numpy(adv).to(F64), ref_a, **t)
    torch.testing.assert_close(torch.from_numpy(ret).to(F64), ref_r, **t)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_emulated_gae_equals_the_serial_loop_inside_one_segment():
    # A row whose valid positions all lie in one lane's segment is the CPU loop verbatim.
    rewards, values, mask, last = _gae_inputs(4, emu.GAE_SEGMENT, seed=2)
    adv, _ = emu.gae(rewards, values, mask, gamma=0.9, lam=0.8, last_values=last)
    from pyppo.ops import gae

    cpu, _ = gae(
        torch.from_numpy(rewards),
        torch.from_numpy(values),
        torch.from_numpy(mask),
        gamma=0.9,
        lam=0.8,
        last_values=torch.from_numpy(last),
    )
    assert bits_equal(torch.from_numpy(adv), cpu)


@pytest.mark.parametrize("T", [5, 513, 2500])
def test_emulated_gae_decoupled_and_row_lam(T):
    # The kernel's second composition (lam_critic) gives the returns of a call with that λ, bit
    # for bit, and its per-row γ·λ the bits of per-row calls; both against the float64 reference.
    rewards, values, mask, last = _gae_inputs(6, T, seed=100 + T)
    row_lam = np.random.default_rng(T).random(6)
    row_lam[:2] = [0.0, 1.0]
    for lam, lam_critic in [(0.9, 1.0), (row_lam, None), (row_lam, 0.5)]:
        kw = dict(gamma=0.99, last_values=last, lam_critic=lam_critic)
        if isinstance(lam, np.ndarray):
            adv, ret = emu.gae(rewards, values, mask, lam=1.0, row_lam=lam, **kw)
            for b in range(6):
                a, r = emu.gae(
                    rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], gamma=0.99, lam=float(lam[b]),
                    last_values=last[b : b + 1], lam_critic=lam_critic,
                )  # fmt: skip
                assert np.array_equal(a.view(np.uint32), adv[b : b + 1].view(np.uint32))
                assert np.array_equal(r.view(np.uint32), ret[b : b + 1].view(np.uint32))
        else:
            adv, ret = emu.gae(rewards, values, mask, lam=lam, **kw)
            a_only, _ = emu.gae(rewards, values, mask, gamma=0.99, lam=lam, last_values=last)
            _, r_only = emu.gae(rewards, values, mask, gamma=0.99, lam=lam_critic, last_values=last)
            assert np.array_equal(adv.view(np.uint32), a_only.view(np.uint32))
            assert np.array_equal(ret.view(np.uint32), r_only.view(np.uint32))
        ref_a, ref_r = ref_gae(
            torch.from_numpy(rewards),
            torch.from_numpy(values),
            torch.from_numpy(mask),
            gamma=0.99,
            lam=torch.from_numpy(lam) if isinstance(lam, np.ndarray) else lam,
            last_values=torch.from_numpy(last),
            lam_critic=lam_critic,
        )
        t = dict(rtol=1e-4, atol=1e-4 * max(1.0, T / 256))
        torch.testing.assert_close(torch.from_numpy(adv).to(F64), ref_a, **t)
        torch.testing.assert_close(torch.from_numpy(ret).to(F64), ref_r, **t)


def test_emulated_gae_out_of_range_row_lam_gives_nan():
    # What a captured graph (no read-back of the check) gives for a row λ outside [0, 1].
    rewards, values, mask, last = _gae_inputs(4, 40, seed=3)
    adv, _ = emu.gae(rewards, values, mask, gamma=0.99, lam=1.0, row_lam=np.array([0.5, 0.5, 1.5, 0.5]))
    assert np.isnan(adv[2][mask[2]]).all() and np.isfinite(adv[[0, 3]]).all()


# -------------------------------------------------------------------------------------- turn_gae


@pytest.mark.parametrize("with_last", [False, True])
def test_emulated_turn_gae_is_the_cpu_bits(with_last):
    # One thread a row runs the CPU loops' float32 operations in their order: the CPU's bits.
    from pyppo.ops import turn_gae

    g = torch.Generator().manual_seed(5)
    B, T = 9, 70
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    ids = random_turn_ids(B, T, g, max_span=9)
    last = torch.randn(B, generator=g) if with_last else None
    adv, ret = emu.turn_gae(
        rewards.numpy(), values.numpy(), ids.numpy(), gamma=0.99, lam=0.95,
        last_values=None if last is None else last.numpy(),
    )  # fmt: skip
    cpu = turn_gae(rewards, values, ids, gamma=0.99, lam=0.95, last_values=last)
    assert bits_equal(torch.from_numpy(adv), cpu[0]) and bits_equal(torch.from_numpy(ret), cpu[1])


# ------------------------------------------------------------------------------ group_advantages


GROUP_CASES = [("grpo", True), ("grpo", False), ("rloo", True)]


def _group_inputs(B: int, T: int, seed: int, dtype=np.float32, n_groups: int | None = None):
    """Shuffled groups of several sizes (ids anywhere in [0, B)), some all-equal groups."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(B)[: n_groups or max(1, B // 4)]
    ids = labels[rng.integers(0, len(labels), B)]
    scores = (rng.standard_normal(B) * 2).astype(dtype)
    scores[ids == ids[0]] = dtype(0.1)  # a constant group
    mask = rng.random((B, T)) < 0.8
    mask[min(1, B - 1)] = False
    return scores, ids, mask


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("estimator,std_normalize", GROUP_CASES)
@pytest.mark.parametrize("B", [1, 7, 33, 300])
def test_emulated_group_advantages_are_the_cpu_bits(dtype, estimator, std_normalize, B):
    # The kernel's order of additions (tiles of 256 ids, ballots of 32 lanes) is row order, the
    # CPU kernel's: the same float64 operations, the same bits.
    from pyppo.ops import group_advantages

    scores, ids, mask = _group_inputs(B, 5, seed=B, dtype=dtype)
    emu_out = emu.group_advantages(scores, ids, mask, estimator=estimator, std_normalize=std_normalize)
    cpu = group_advantages(
        torch.from_numpy(scores),
        torch.from_numpy(mask),
        group_ids=torch.from_numpy(ids),
        estimator=estimator,
        std_normalize=std_normalize,
    )
    assert bits_equal(torch.from_numpy(emu_out), cpu)
    if (ids == ids[0]).sum() > 1:
        assert (emu_out[ids == ids[0]] == 0).all()


def test_emulated_group_advantages_visit_rows_in_order():
    ids = np.array([3, 1, 3, 3] * 100 + [3])
    assert emu._group_members(ids, 3) == [j for j in range(len(ids)) if ids[j] == 3]
    assert emu._group_members(ids, 1) == list(range(1, 400, 4))


def test_emulated_group_advantages_depend_only_on_the_group():
    # The group's rows moved across tile boundaries, between other groups: the same bits.
    rng = np.random.default_rng(4)
    member = (rng.standard_normal(9) * 3).astype(np.float32)
    alone = emu.group_advantages(member, np.zeros(9, np.int64), np.ones((9, 2), bool))
    B = 700
    scores = (rng.standard_normal(B) * 3).astype(np.float32)
    ids = rng.integers(1, 40, B)
    rows = np.sort(rng.choice(B, 9, replace=False))
    scores[rows], ids[rows] = member, 0
    out = emu.group_advantages(scores, ids, np.ones((B, 2), bool))
    assert np.array_equal(out[rows].view(np.uint32), alone.view(np.uint32))


# --------------------------------------------------------------------------------------- kl k3


def _k3_inputs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Log-probs in [-8, 0) and references |lp - ref| from 1e-7 to 60 nats, both signs, with
    the edge cases: lp == ref (-inf included), an infinite side, NaN, exp's float32 overflow."""
    rng = np.random.default_rng(seed)
    lp = -rng.random(n) * 8
    d = np.exp(rng.uniform(np.log(1e-7), np.log(60.0), n)) * rng.choice([-1.0, 1.0], n)
    ref = lp - d
    inf = np.inf
    lp_edge = [-1.0, -inf, -1.0, -inf, np.nan, -88.72, -89.0, -0.5, -1.0]
    ref_edge = [-1.0, -inf, -inf, -1.0, -1.0, 0.0, 0.0, -1.5, 0.0]
    return (np.concatenate([lp, lp_edge]).astype(np.float32), np.concatenate([ref, ref_edge]).astype(np.float32))


def test_emulated_k3_is_the_cpu_kernels_bits():
    # The CUDA kernel's k3 (its replay) and the CPU's vectorised one: the same bits, value and
    # gradient, so a run's KL does not depend on the device it ran on.
    from pyppo.ops import kl_penalty

    lp, ref = _k3_inputs(5000, seed=3)
    v, em1 = emu.kl_k3(lp, ref)
    got = kl_penalty(torch.from_numpy(lp), torch.from_numpy(ref), estimator="k3")
    grad = torch.ops.pyppo.kl_penalty_backward(
        torch.ones(len(lp)), torch.from_numpy(lp), torch.from_numpy(ref), "k3", None, None
    )
    assert bits_equal(got, torch.from_numpy(v))
    assert bits_equal(grad, torch.from_numpy(np.float32(0) - em1))


def test_emulated_k3_within_a_few_ulps_of_float64():
    lp, ref = _k3_inputs(20000, seed=4)
    v, em1 = emu.kl_k3(lp, ref)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(lp) & np.isfinite(ref) & (ref.astype(np.float64) - lp < 88.0)
    x = torch.from_numpy(ref[finite]).to(F64) - torch.from_numpy(lp[finite]).to(F64)
    exact_v = ref_kl_penalty(torch.from_numpy(lp[finite]), torch.from_numpy(ref[finite]), estimator="k3")
    for got, exact in ((v[finite], exact_v), (em1[finite], torch.expm1(x))):
        spacing = torch.from_numpy(np.spacing(np.abs(exact.float().numpy()))).to(F64)
        ulps = (torch.from_numpy(got).to(F64) - exact).abs() / spacing
        assert ulps.max() <= 3.0, ulps.max()
    inf = np.inf
    assert v[-9] == 0 and v[-8] == 0 and em1[-9] == 0  # lp == ref, -inf == -inf included
    assert v[-7] == inf and em1[-7] == -1 and v[-6] == inf and em1[-6] == inf  # an infinite side
    assert np.isnan(v[-5]) and np.isnan(em1[-5])
    assert np.isfinite(v[-4]) and v[-3] == inf  # exp(88.72) is a float32, exp(89) is not


# ---------------------------------------------------------------------- the kernels, on a GPU


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("estimator,std_normalize", GROUP_CASES)
@pytest.mark.parametrize("B", [7, 300, 1000])
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and pyppo built with CUDA")
def test_cuda_group_advantages_match_their_replay_bit_for_bit(dtype, estimator, std_normalize, B):
    from pyppo.ops import group_advantages

    scores, ids, mask = _group_inputs(B, 9, seed=B + 1, dtype=dtype)
    want = emu.group_advantages(scores, ids, mask, estimator=estimator, std_normalize=std_normalize)
    got = group_advantages(
        torch.from_numpy(scores).cuda(),
        torch.from_numpy(mask).cuda(),
        group_ids=torch.from_numpy(ids).cuda(),
        estimator=estimator,
        std_normalize=std_normalize,
    )
    assert bits_equal(got.cpu(), torch.from_numpy(want))


@pytest.mark.parametrize("T", [5, 1000, 1024, 2500])
@pytest.mark.parametrize("with_last", [False, True])
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and pyppo built with CUDA")
def test_cuda_gae_matches_its_replay_bit_for_bit(T, with_last):
    from pyppo.ops import gae

    rewards, values, mask, last = _gae_inputs(9, T, seed=T + 3)
    lv = last if with_last else None
    adv, ret = emu.gae(rewards, values, mask, gamma=0.99, lam=0.95, last_values=lv)
    a, r = gae(
        torch.from_numpy(rewards).cuda(),
        torch.from_numpy(values).cuda(),
        torch.from_numpy(mask).cuda(),
        gamma=0.99,
        lam=0.95,
        last_values=None if lv is None else torch.from_numpy(lv).cuda(),
    )
    assert bits_equal(a.cpu(), torch.from_numpy(adv)) and bits_equal(r.cpu(), torch.from_numpy(ret))


@pytest.mark.parametrize("T", [5, 1024, 2500])
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and pyppo built with CUDA")
def test_cuda_gae_decoupled_and_row_lam_match_their_replay_bit_for_bit(T):
    from pyppo.ops import gae

    rewards, values, mask, last = _gae_inputs(9, T, seed=T + 4)
    row_lam = np.random.default_rng(T).random(9)
    cuda = [torch.from_numpy(x).cuda() for x in (rewards, values, mask, last, row_lam)]
    for lam, lam_critic in [(0.9, 1.0), (row_lam, None), (row_lam, 0.5)]:
        per_row = isinstance(lam, np.ndarray)
        adv, ret = emu.gae(
            rewards, values, mask, gamma=0.99, lam=1.0 if per_row else lam, last_values=last,
            lam_critic=lam_critic, row_lam=lam if per_row else None,
        )  # fmt: skip
        a, r = gae(*cuda[:3], gamma=0.99, lam=cuda[4] if per_row else lam, last_values=cuda[3], lam_critic=lam_critic)
        assert bits_equal(a.cpu(), torch.from_numpy(adv)) and bits_equal(r.cpu(), torch.from_numpy(ret))


@pytest.mark.parametrize("T", [1, 300, 2500])
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and pyppo built with CUDA")
def test_cuda_turn_gae_matches_its_replay_bit_for_bit(T):
    from pyppo.ops import turn_gae

    g = torch.Generator().manual_seed(T)
    rewards, values = torch.randn(130, T, generator=g), torch.randn(130, T, generator=g)
    ids, last = random_turn_ids(130, T, g, max_span=30), torch.randn(130, generator=g)
    adv, ret = emu.turn_gae(
        rewards.numpy(), values.numpy(), ids.numpy(), gamma=0.99, lam=0.95, last_values=last.numpy()
    )
    a, r = turn_gae(rewards.cuda(), values.cuda(), ids.cuda(), gamma=0.99, lam=0.95, last_values=last.cuda())
    assert bits_equal(a.cpu(), torch.from_numpy(adv)) and bits_equal(r.cpu(), torch.from_numpy(ret))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("V", [7, 4099, 6144])
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and pyppo built with CUDA")
def test_cuda_gather_forward_matches_its_replay(dtype, V):
    from pyppo.ops import gather_logprobs

    z, labels = _rows(16, V, seed=V + 1)
    zt = torch.from_numpy(z).to(dtype)
    z32 = zt.float().numpy()
    lp, ent, lse = emu.gather_fwd(z32, labels, temperature=0.8, kvec=KVEC[dtype])
    got_lp, got_ent = gather_logprobs(zt.cuda(), torch.from_numpy(labels).cuda(), temperature=0.8, return_entropy=True)
    # ex2.approx and log2f differ from the replay's last bits; the operations are the same.
    torch.testing.assert_close(got_lp.cpu(), torch.from_numpy(lp), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got_ent.cpu(), torch.from_numpy(ent), rtol=2e-6, atol=2e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and pyppo built with CUDA")
def test_cuda_k3_matches_its_replay():
    from pyppo.ops import kl_penalty

    lp, ref = _k3_inputs(5000, seed=5)
    v, em1 = emu.kl_k3(lp, ref)
    a, b = torch.from_numpy(lp).cuda(), torch.from_numpy(ref).cuda()
    got = kl_penalty(a, b, estimator="k3").cpu()
    grad = torch.ops.pyppo.kl_penalty_backward(torch.ones(len(lp), device="cuda"), a, b, "k3", None, None).cpu()
    series = np.abs(ref.astype(np.float64) - lp) <= 1
    series_t = torch.from_numpy(series)
    assert bits_equal(got[series_t], torch.from_numpy(v[series]))
    assert bits_equal(grad[series_t], torch.from_numpy(np.float32(0) - em1[series]))
    # Elsewhere CUDA's double expm1 against numpy's: the same float32 but for a near-tie.
    torch.testing.assert_close(got, torch.from_numpy(v), rtol=2.4e-7, atol=0, equal_nan=True)
    torch.testing.assert_close(grad, torch.from_numpy(np.float32(0) - em1), rtol=2.4e-7, atol=0, equal_nan=True)
