"""The CUDA ops in a training step's hot path neither copy nor synchronise with the host: they run
under ``torch.cuda.set_sync_debug_mode("error")`` and are captured into CUDA graphs, whose
replays give the eager results bit for bit (``group_advantages`` too, whose data checks are read
back outside capture only). A bad label under capture (where no error can be
raised) gives its row NaN, never an out-of-bounds read. CUDA only; the CPU holds nothing to test.
"""

from __future__ import annotations

import pytest
import torch

from pyppo import ops
from support.reference import bits_equal, gen, random_mask, random_turn_ids


def _has_cuda() -> bool:
    import pyppo

    return torch.cuda.is_available() and bool(getattr(pyppo._C, "with_cuda", False))


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device and pyppo built with CUDA"),
]

GATHER = torch.ops.pyppo.gather_logprobs.default
GATHER_BWD = torch.ops.pyppo.gather_logprobs_backward.default
LINEAR = torch.ops.pyppo.linear_logprobs.default
LINEAR_BWD = torch.ops.pyppo.linear_logprobs_backward.default


def _inputs(B=3, T=9, V=4099, H=32, seed=0):
    g = gen(seed)
    full = torch.randn(B, T + 4, V, generator=g) * 3
    d = torch.device("cuda")
    return dict(
        logits=full.to(d)[:, 3:-1],  # T-sliced, as the full-logits path passes it
        labels=torch.randint(0, V, (B, T), generator=g).to(d),
        mask=random_mask(B, T, g).to(d),
        hidden=torch.randn(B, T, H, generator=g).to(d),
        weight=(torch.randn(V, H, generator=g) * 0.2).to(d),
        rewards=torch.randn(B, T, generator=g).to(d),
        values=torch.randn(B, T, generator=g).to(d),
        ref=torch.randn(B, T, generator=g).to(d) - 5,
        turn_ids=random_turn_ids(B, T, g).to(d),
    )


def _step(x):
    """The ops of a PPO step that take device tensors only: gather forward and backward, the
    chunked head forward and backward (3 chunks), KL, GAE (with a decoupled critic λ too), turn GAE."""
    lp, ent, lse = GATHER(x["logits"], x["labels"], x["mask"], 0.9, -100, True)
    g_logits = GATHER_BWD(
        torch.ones_like(lp), torch.ones_like(ent), x["logits"], x["labels"], x["mask"], lse, ent, 0.9, -100
    )
    llp, lent, llse = LINEAR(x["hidden"], x["weight"], x["labels"], x["mask"], None, 1.0, -100, True, 10)
    gh, gw, _ = LINEAR_BWD(
        torch.ones_like(llp),
        torch.ones_like(lent),
        x["hidden"],
        x["weight"],
        x["labels"],
        x["mask"],
        None,
        llse,
        lent,
        1.0,
        -100,
        10,
        [True, True, False],
    )
    kl = ops.kl_penalty(lp, x["ref"], estimator="k3")
    adv, ret = ops.gae(x["rewards"], x["values"], x["mask"], gamma=0.99, lam=0.95)
    _, ret_c = ops.gae(x["rewards"], x["values"], x["mask"], gamma=0.99, lam=0.95, lam_critic=1.0)
    t_adv, t_ret = ops.turn_gae(x["rewards"], x["values"], x["turn_ids"], gamma=0.99, lam=0.95)
    return [lp, ent, g_logits, llp, lent, gh, gw, kl, adv, ret, ret_c, t_adv, t_ret]


def test_hot_path_makes_no_host_sync():
    x = _inputs(seed=1)
    _step(x)  # first call: cuBLAS handles, allocator pools
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(x)
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def _capture(fn, *args):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)  # warm-up on a side stream, as torch.cuda.graph's docs ask
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def test_step_is_capturable_and_replays_bit_for_bit():
    x = _inputs(seed=2)
    graph, static_out = _capture(_step, x)
    fresh = _inputs(seed=3)
    for k, v in fresh.items():  # new data in the captured buffers
        x[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    eager = _step(fresh)
    for i, (a, b) in enumerate(zip(static_out, eager)):
        assert bits_equal(a, b), i


def test_gae_with_row_lam_is_capturable():
    # row_lam's values are read back outside capture only; under capture an out-of-range λ gives
    # its row NaN advantages.
    x = _inputs(seed=5)
    row_lam = torch.tensor([0.9, 0.5, 1.0], device="cuda")

    def fn():
        return ops.gae(x["rewards"], x["values"], x["mask"], gamma=0.99, lam=row_lam, lam_critic=1.0)

    graph, (adv, ret) = _capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    eager = fn()
    assert bits_equal(adv, eager[0]) and bits_equal(ret, eager[1])
    row_lam[0] = 1.5  # row 0 of random_mask is all valid
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(adv[0]).all() and bits_equal(adv[1:], eager[0][1:]) and bits_equal(ret, eager[1])
    with pytest.raises(ValueError, match="row_lam"):
        fn()


def test_linear_ppo_loss_is_capturable():
    x = _inputs(seed=4)
    old = (x["ref"] + 4.5).contiguous()
    adv = x["rewards"].clone()
    weights = ops.loss_token_weights(x["mask"])

    def loss_fn():
        return torch.ops.pyppo.linear_ppo_loss.default(
            x["hidden"],
            x["weight"],
            x["labels"],
            old,
            adv,
            x["mask"],
            weights,
            x["ref"],
            None,
            1.0,
            -100,
            0.2,
            0.2,
            None,
            0.1,
            "k3",
            0.01,
            True,
            10,
            [True, True, False],
        )

    graph, static_out = _capture(loss_fn)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static_out, loss_fn()):
        assert bits_equal(a, b)


def test_group_advantages_is_capturable_and_replays_bit_for_bit():
    # Outside capture the op reads its data checks back (one sync); under capture it reads nothing.
    g = gen(6)
    d = torch.device("cuda")
    scores = torch.randn(64, generator=g).to(d)
    ids = (torch.arange(64) // 8).to(d)
    mask = random_mask(64, 33, g).to(d)

    def fn():
        return (
            ops.group_advantages(scores, mask, group_ids=ids),
            ops.group_advantages(scores, mask, group_ids=ids, estimator="rloo"),
        )

    graph, static_out = _capture(fn)
    scores.copy_(torch.randn(64, generator=g).to(d))
    ids.copy_(torch.randint(0, 64, (64,), generator=g).to(d))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static_out, fn()):
        assert bits_equal(a, b)


def test_a_bad_label_under_capture_gives_a_nan_row():
    x = _inputs(seed=5)
    x["mask"].fill_(True)
    graph, (lp, ent, lse) = _capture(lambda: GATHER(x["logits"], x["labels"], x["mask"], 1.0, -100, True))
    ok = GATHER(x["logits"], x["labels"], x["mask"], 1.0, -100, True)[0].clone()
    x["labels"][1, 4] = x["logits"].shape[-1] + 3
    x["labels"][2, 0] = -7
    graph.replay()
    torch.cuda.synchronize()
    bad = torch.zeros_like(ok, dtype=torch.bool)
    bad[1, 4] = bad[2, 0] = True
    assert torch.isnan(lp[bad]).all() and torch.isnan(ent[bad]).all() and torch.isnan(lse[bad]).all()
    assert bits_equal(lp[~bad], ok[~bad])
    # Outside capture the same labels raise the CPU's error.
    with pytest.raises(ValueError, match=r"labels\[13\] = 4102 is outside \[0, V=4099\)"):
        GATHER(x["logits"], x["labels"], x["mask"], 1.0, -100, True)
