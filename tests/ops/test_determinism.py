"""Determinism (same bits whatever the thread count, call after call) and batch invariance (a row's
result does not depend on the other rows); and torch.compile(fullgraph=True) over the ops.

Tests taking ``device`` run on every device present (conftest.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pyppo.ops import (
    gae,
    gather_logprobs,
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    shape_rewards,
    turn_gae,
)
from support.reference import (
    F64,
    bits_equal,
    gen,
    random_mask,
    random_turn_ids,
    ref_gae,
    ref_gather_logprobs,
    ref_turn_gae,
    tol,
)


@contextlib.contextmanager
def num_threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def bitwise_equal(a, b):
    if isinstance(a, (tuple, list)):
        return all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def run_with_threads(fn):
    """fn() with 1 thread, with 2 threads, and twice more with 2: all must be the same bits."""
    with num_threads(1):
        one = fn()
    with num_threads(2):
        two = fn()
        again = fn()
    return one, two, again


def _gather_case(dtype, seed):
    g = gen(seed)
    B, T, V = 8, 9, 4099  # 72 rows, grain 16384 // V = 3 rows: the rows are split across threads
    logits = (torch.randn(B, T, V, generator=g, dtype=F64) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = random_mask(B, T, g)
    return logits, labels, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_gather_logprobs_thread_count_and_repeat(dtype):
    logits, labels, mask = _gather_case(dtype, 1)
    up = torch.randn(labels.shape, generator=gen(2))

    def fwd():
        return gather_logprobs(logits, labels, mask, temperature=0.8, return_entropy=True)

    def bwd():
        x = logits.clone().requires_grad_()
        lp, ent = gather_logprobs(x, labels, mask, temperature=0.8, return_entropy=True)
        ((lp + 0.1 * ent) * up).sum().backward()
        return x.grad

    one, two, again = run_with_threads(fwd)
    assert bitwise_equal(one, two) and bitwise_equal(two, again)
    one, two, again = run_with_threads(bwd)
    assert bitwise_equal(one, two) and bitwise_equal(two, again)


def test_gae_thread_count_and_repeat():
    g = gen(3)
    B, T = 300, 64  # grain 2048 // T = 32 rows
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    mask = random_mask(B, T, g)
    last = torch.randn(B, generator=g)
    one, two, again = run_with_threads(lambda: gae(rewards, values, mask, gamma=0.99, lam=0.95, last_values=last))
    assert bitwise_equal(one, two) and bitwise_equal(two, again)
    row_lam = torch.rand(B, generator=g)
    one, two, again = run_with_threads(
        lambda: gae(rewards, values, mask, gamma=0.99, lam=row_lam, last_values=last, lam_critic=1.0)
    )
    assert bitwise_equal(one, two) and bitwise_equal(two, again)


def test_turn_gae_thread_count_and_repeat():
    g = gen(11)
    B, T = 2100, 32  # grain 65536 // T = 2048 rows: two threads split the rows
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    ids = random_turn_ids(B, T, g)
    last = torch.randn(B, generator=g)
    one, two, again = run_with_threads(lambda: turn_gae(rewards, values, ids, gamma=0.99, lam=0.95, last_values=last))
    assert bitwise_equal(one, two) and bitwise_equal(two, again)
    torch.testing.assert_close(one[0].double(), ref_turn_gae(rewards, values, ids, gamma=0.99, lam=0.95,
                               last_values=last)[0], **tol(torch.float32, 8))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_masked_thread_count_and_repeat(dtype):
    g = gen(4)
    x = (torch.randn(50_001, generator=g, dtype=F64) * 3 + 1).to(dtype)  # 13 blocks of 4096
    mask = torch.rand(50_001, generator=g) < 0.7
    for fn in (
        lambda: masked_whiten(x, mask),
        lambda: masked_whiten(x, mask, shift_mean=False, unbiased=False),
        lambda: masked_mean(x, mask),
        lambda: masked_var(x, mask),
        lambda: masked_mean(x.view(3, 16667), mask.view(3, 16667), dim=1),
    ):
        one, two, again = run_with_threads(fn)
        assert bitwise_equal(one, two) and bitwise_equal(two, again)


def test_kl_and_shape_rewards_thread_count_and_repeat():
    g = gen(5)
    lp = -torch.rand(64, 300, generator=g) * 4
    ref = lp + torch.randn(64, 300, generator=g) * 0.3
    scores = torch.randn(64, generator=g)
    mask = random_mask(64, 300, g)
    mask[1, 0] = True
    for est in ("k1", "k3"):
        one, two, again = run_with_threads(lambda: kl_penalty(lp, ref, estimator=est, clamp=(-1.0, 1.0)))
        assert bitwise_equal(one, two) and bitwise_equal(two, again)
        one, two, again = run_with_threads(lambda: shape_rewards(scores, lp, ref, mask, kl_coef=0.1, estimator=est))
        assert bitwise_equal(one, two) and bitwise_equal(two, again)


def test_group_advantages_thread_count_and_repeat():
    g = gen(9)
    B, T = 3000, 64  # grain 65536 // T = 1024 rows: the broadcast is split across threads
    scores = torch.randn(B, generator=g)
    ids = torch.randint(0, 400, (B,), generator=g)
    mask = random_mask(B, T, g)
    for estimator, std_normalize in (("grpo", True), ("grpo", False), ("rloo", True)):
        one, two, again = run_with_threads(
            lambda: group_advantages(scores, mask, group_ids=ids, estimator=estimator, std_normalize=std_normalize)
        )
        assert bitwise_equal(one, two) and bitwise_equal(two, again)


# ------------------------------------------------------------------------------ batch invariance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("V", [3, 100, 2049, 4099])
def test_gather_logprobs_batch_invariance(dtype, V):
    g = gen(V)
    T = 6
    row = (torch.randn(T, V, generator=g, dtype=F64) * 3).to(dtype)
    row_labels = torch.randint(0, V, (T,), generator=g)
    alone, alone_ent = gather_logprobs(row[None], row_labels[None], temperature=0.7, return_entropy=True)
    alone_lp_only = gather_logprobs(row[None], row_labels[None], temperature=0.7)

    # in a batch of 7, at position 4
    batch = (torch.randn(7, T, V, generator=g, dtype=F64) * 3).to(dtype)
    batch[4] = row
    labels = torch.randint(0, V, (7, T), generator=g)
    labels[4] = row_labels
    b7, b7_ent = gather_logprobs(batch, labels, temperature=0.7, return_entropy=True)
    assert bitwise_equal(b7[4], alone[0]) and bitwise_equal(b7_ent[4], alone_ent[0])

    # inside a larger right-padded batch: 19 rows of length 11, the row at [13, 2:2+T], padding masked
    big = (torch.randn(19, 11, V, generator=g, dtype=F64) * 3).to(dtype)
    big[13, 2 : 2 + T] = row
    big_labels = torch.randint(0, V, (19, 11), generator=g)
    big_labels[13, 2 : 2 + T] = row_labels
    big_labels[13, 2 + T :] = -100
    mask = random_mask(19, 11, g)
    mask[13] = False
    mask[13, 2 : 2 + T] = True
    bb, bb_ent = gather_logprobs(big, big_labels, mask, temperature=0.7, return_entropy=True)
    assert bitwise_equal(bb[13, 2 : 2 + T], alone[0]) and bitwise_equal(bb_ent[13, 2 : 2 + T], alone_ent[0])

    # the same without the entropy: in a batch of 7 and inside the padded batch
    assert bitwise_equal(gather_logprobs(batch, labels, temperature=0.7)[4], alone_lp_only[0])
    assert bitwise_equal(gather_logprobs(big, big_labels, mask, temperature=0.7)[13, 2 : 2 + T], alone_lp_only[0])

    # one position alone, as a [V] vector with a 0-d label
    for t in (0, T - 1):
        single, single_ent = gather_logprobs(row[t], row_labels[t], temperature=0.7, return_entropy=True)
        assert bitwise_equal(single, alone[0, t]) and bitwise_equal(single_ent, alone_ent[0, t])
        assert bitwise_equal(gather_logprobs(row[t], row_labels[t], temperature=0.7), alone_lp_only[0, t])

    # and a (strided) view of the big batch gives the same bits
    view = big.transpose(0, 1)[2 : 2 + T, 13]
    v_lp, v_ent = gather_logprobs(view, row_labels, temperature=0.7, return_entropy=True)
    assert bitwise_equal(v_lp, alone[0]) and bitwise_equal(v_ent, alone_ent[0])
    assert bitwise_equal(gather_logprobs(view, row_labels, temperature=0.7), alone_lp_only[0])

    # rows stay correct, not just consistent
    ref_lp, _ = ref_gather_logprobs(row, row_labels, temperature=0.7)
    torch.testing.assert_close(alone[0].double(), ref_lp, **tol(dtype, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("V", [50, 100, 2049, 4099])
def test_gather_logprobs_same_bits_with_or_without_entropy(dtype, V):
    # Rollout computes log-probs alone; training asks for the entropy too (for the bonus).
    # The log-probs must agree bit for bit or the first PPO ratio is not exactly 1.
    logits, labels, mask = _gather_case(dtype, V)
    logits = logits[..., :V]
    labels = labels % V
    for temperature in (1.0, 0.7):
        lp = gather_logprobs(logits, labels, mask, temperature=temperature)
        lp2, _ = gather_logprobs(logits, labels, mask, temperature=temperature, return_entropy=True)
        assert bitwise_equal(lp, lp2), (lp - lp2).abs().max()


def test_gather_logprobs_backward_batch_invariance():
    g = gen(6)
    V = 2100
    row = torch.randn(4, V, generator=g)
    row_labels = torch.randint(0, V, (4,), generator=g)
    x = row.clone().requires_grad_()
    lp, ent = gather_logprobs(x, row_labels, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    batch = torch.randn(7, 4, V, generator=g)
    batch[3] = row
    labels = torch.randint(0, V, (7, 4), generator=g)
    labels[3] = row_labels
    xb = batch.clone().requires_grad_()
    lpb, entb = gather_logprobs(xb, labels, return_entropy=True)
    (lpb.sum() + entb.sum()).backward()
    assert bitwise_equal(xb.grad[3], x.grad)


def test_gae_batch_invariance():
    g = gen(7)
    T = 15
    r = torch.randn(1, T, generator=g)
    v = torch.randn(1, T, generator=g)
    m = random_mask(1, T, g)
    m[0, 5:9] = False
    alone = gae(r, v, m, gamma=0.99, lam=0.95)
    R = torch.randn(9, T, generator=g)
    Vv = torch.randn(9, T, generator=g)
    M = random_mask(9, T, g)
    R[6], Vv[6], M[6] = r[0], v[0], m[0]
    batch = gae(R, Vv, M, gamma=0.99, lam=0.95)
    assert bitwise_equal(batch[0][6], alone[0][0]) and bitwise_equal(batch[1][6], alone[1][0])
    exp_adv, _ = ref_gae(r, v, m, gamma=0.99, lam=0.95)
    torch.testing.assert_close(alone[0].double(), exp_adv, **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gather_logprobs_device_repeat_and_batch_invariance(device, dtype):
    # V = 4099: rows of 4099 elements are not 16-byte aligned in turn, so the same row takes the
    # vector path in one batch and the element-by-element path in another: same bits required.
    g = gen(21)
    logits = (torch.randn(20, 4099, generator=g, dtype=F64) * 3).to(dtype).to(device)
    labels = torch.randint(0, 4099, (20,), generator=g).to(device)
    mask = (torch.rand(20, generator=g) < 0.75).to(device)
    kw = dict(temperature=0.8, return_entropy=True)
    full = gather_logprobs(logits, labels, mask, **kw)
    again = gather_logprobs(logits, labels, mask, **kw)
    assert bits_equal(full[0], again[0]) and bits_equal(full[1], again[1])
    shifted = gather_logprobs(logits[1:].contiguous(), labels[1:], mask[1:], **kw)
    assert bits_equal(full[0][1:], shifted[0]) and bits_equal(full[1][1:], shifted[1])
    for i in (0, 7, 19):
        alone = gather_logprobs(logits[i : i + 1].clone(), labels[i : i + 1], mask[i : i + 1], **kw)
        assert bits_equal(full[0][i : i + 1], alone[0]) and bits_equal(full[1][i : i + 1], alone[1])
    # the log-probs do not depend on whether the entropy is asked for
    assert bits_equal(gather_logprobs(logits, labels, mask, temperature=0.8), full[0])
    up = torch.randn(20, generator=gen(22)).to(device)

    def bwd():
        x = logits.clone().requires_grad_()
        lp, ent = gather_logprobs(x, labels, mask, **kw)
        ((lp + 0.1 * ent) * up).sum().backward()
        return x.grad

    assert bits_equal(bwd(), bwd())


@pytest.mark.parametrize("T", [64, 2048])
def test_gae_device_repeat_and_batch_invariance(device, T):
    # T = 2048 takes CUDA's block-per-row scan: its segments must not depend on the batch either.
    g = gen(81)
    B = 9
    r, v = torch.randn(B, T, generator=g).to(device), torch.randn(B, T, generator=g).to(device)
    m = (torch.rand(B, T, generator=g) < 0.75).to(device)
    a1, r1 = gae(r, v, m, gamma=0.99, lam=0.95)
    a2, r2 = gae(r, v, m, gamma=0.99, lam=0.95)
    assert bits_equal(a1, a2) and bits_equal(r1, r2)
    a3, r3 = gae(r[4:5].clone(), v[4:5].clone(), m[4:5].clone(), gamma=0.99, lam=0.95)
    assert bits_equal(a1[4:5], a3) and bits_equal(r1[4:5], r3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_group_advantages_device_repeat_and_batch_invariance(device, dtype):
    # A group's bits depend only on its members' scores and order: the same in a batch of other
    # groups, alone, and padded to a longer T.
    g = gen(82)
    B, T, n = 64, 33, 8
    scores = torch.randn(B, generator=g, dtype=F64).to(dtype).to(device)
    mask = random_mask(B, T, g).to(device)
    full = group_advantages(scores, mask, group_size=n)
    assert bits_equal(full, group_advantages(scores, mask, group_size=n))
    for k in (0, 3, 7):
        rows = slice(k * n, (k + 1) * n)
        alone = group_advantages(scores[rows].clone(), mask[rows].clone(), group_size=n)
        assert bits_equal(full[rows], alone)
        padded = torch.nn.functional.pad(mask[rows], (0, 100), value=False)
        assert bits_equal(group_advantages(scores[rows].clone(), padded, group_size=n)[:, :T], alone)


# ------------------------------------------------------------------------------ torch.compile


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    g = gen(8)
    B, T, V = 3, 5, 37
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = random_mask(B, T, g)
    mask[1, 0] = True
    ref_lp = -torch.rand(B, T, generator=g) * 3
    values = torch.randn(B, T, generator=g)

    def step(logits, labels, mask, ref_lp, values):
        lp, ent = gather_logprobs(logits, labels, mask, temperature=0.9, return_entropy=True)
        kl = kl_penalty(lp, ref_lp, estimator="k3", clamp=(-10.0, 10.0))
        rewards = -0.1 * kl.detach() * mask  # advantages are constants in PPO (gae is not differentiable)
        adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
        loss = -(lp * adv).sum() + 0.01 * kl.sum() - 0.01 * ent.sum()
        return loss, lp, adv, ret

    compiled = torch.compile(step, fullgraph=True)  # the default (inductor) backend, as users get it
    x1 = logits.clone().requires_grad_()
    out_c = compiled(x1, labels, mask, ref_lp, values)
    out_c[0].backward()
    x2 = logits.clone().requires_grad_()
    out_e = step(x2, labels, mask, ref_lp, values)
    out_e[0].backward()
    for a, b in zip(out_c, out_e, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(x1.grad, x2.grad)
    assert x1.grad.abs().sum() > 0
    # a second call with other values (same shapes) reuses the graph and is still right
    logits2 = torch.randn(B, T, V, generator=g)
    torch.testing.assert_close(
        compiled(logits2, labels, mask, ref_lp, values), step(logits2, labels, mask, ref_lp, values)
    )


def test_torch_compile_turn_gae_and_gae_options_fullgraph():
    torch._dynamo.reset()
    g = gen(12)
    B, T = 4, 9
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    mask = random_mask(B, T, g)
    ids = random_turn_ids(B, T, g)
    row_lam = torch.rand(B, generator=g)

    def advantages(rewards, values, mask, ids, row_lam):
        return (
            *gae(rewards, values, mask, gamma=0.99, lam=row_lam, lam_critic=1.0),
            *turn_gae(rewards, values, ids, gamma=0.99, lam=0.9, last_values=values[:, 0]),
        )

    compiled = torch.compile(advantages, fullgraph=True)
    for a, b in zip(compiled(rewards, values, mask, ids, row_lam), advantages(rewards, values, mask, ids, row_lam)):
        assert bitwise_equal(a, b)


def test_torch_compile_group_advantages_fullgraph():
    torch._dynamo.reset()
    g = gen(10)
    scores = torch.randn(12, generator=g)
    mask = random_mask(12, 7, g)

    def advantages(scores, mask):
        return group_advantages(scores, mask, group_size=4), group_advantages(
            scores, mask, group_size=3, estimator="rloo"
        )

    compiled = torch.compile(advantages, fullgraph=True)
    for a, b in zip(compiled(scores, mask), advantages(scores, mask), strict=True):
        assert bitwise_equal(a, b)
