"""The rollout's token draw: inverse transform in float64 draws each index with probability
p_i / sum(p), never one of probability 0 (at block edges and in padded blocks too), repeats with a
seed, refuses invalid rows by name, and replaces torch.multinomial only where it applies."""

from __future__ import annotations

import math

import pytest
import torch

from pyppo.rollout.categorical import _BLOCK, fast_multinomial, sample_categorical


def _within_five_sigma(counts: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    # Over at most 16 bins of neighbouring indices, so that every bin expects many draws (a
    # per-index bound would fail by chance where n·p is far below 1).
    bins = torch.arange(len(probs)) * min(16, len(probs)) // len(probs)
    counts = torch.zeros(int(bins.max()) + 1, dtype=torch.float64).index_add_(0, bins, counts.double())
    probs = torch.zeros_like(counts).index_add_(0, bins, probs.double())
    p = probs / probs.sum()
    sigma = (n * p * (1 - p)).sqrt()
    assert bool(((counts.double() - n * p).abs() <= 5 * sigma + 1e-9).all()), (counts, n * p)


@pytest.mark.parametrize("V", [1, 7, _BLOCK, _BLOCK + 1, 3 * _BLOCK - 5])
def test_frequencies_match_the_probabilities(V):
    g = torch.Generator().manual_seed(V)
    probs = torch.rand(V, generator=g) ** 3
    probs[torch.rand(V, generator=g) < 0.3] = 0.0  # holes
    probs[-1] = 0.0 if V > 1 else 1.0
    probs[0] = max(float(probs[0]), 0.05)
    n = 40000
    draws = sample_categorical(probs.expand(n, V).contiguous(), torch.Generator().manual_seed(1))
    assert draws.dtype == torch.long and draws.shape == (n,)
    counts = torch.bincount(draws, minlength=V)
    assert bool((counts[probs == 0] == 0).all())
    _within_five_sigma(counts, probs, n)


def test_mass_only_at_block_edges_and_in_the_padded_last_block():
    V = 2 * _BLOCK + 3
    probs = torch.zeros(6, V)
    edges = [_BLOCK - 1, _BLOCK, 2 * _BLOCK + 2]
    probs[:, edges] = torch.tensor([1.0, 2.0, 1.0])
    draws = sample_categorical(probs.repeat(5000, 1), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=V)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(edges)
    _within_five_sigma(counts[edges], torch.tensor([1.0, 2.0, 1.0]), len(draws))


def test_an_unnormalised_row_a_one_hot_row_and_low_precision_inputs():
    probs = torch.tensor([[0.0, 3.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1e-6], [2.0, 0.0, 0.0, 0.0]])
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        draws = sample_categorical(probs.to(dtype).repeat(2000, 1), torch.Generator().manual_seed(3)).view(2000, 3)
        assert set(draws[:, 0].tolist()) <= {1, 3}
        assert bool((draws[:, 1] == 3).all())
        assert bool((draws[:, 2] == 0).all())
        share = float((draws[:, 0] == 1).double().mean())
        assert abs(share - 0.75) < 5 * math.sqrt(0.75 * 0.25 / 2000)
    assert sample_categorical(torch.ones(0, 5)).shape == (0,)


def test_a_seed_repeats_the_draws():
    probs = torch.softmax(torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)), -1)
    a = sample_categorical(probs, torch.Generator().manual_seed(7))
    torch.manual_seed(7)
    b = sample_categorical(probs)
    assert torch.equal(a, b)
    assert not torch.equal(a, sample_categorical(probs, torch.Generator().manual_seed(8)))


@pytest.mark.parametrize(
    "row, match",
    [
        ([0.5, float("nan")], r"probs\[1\] must be finite and non-negative"),
        ([0.5, float("inf")], r"probs\[1\] must be finite"),
        ([0.5, -0.1], r"probs\[1\] must be finite and non-negative"),
        ([0.0, 0.0], r"probs\[1\] .* positive sum, got sum 0.0"),
    ],
)
def test_invalid_rows_are_named(row, match):
    with pytest.raises(ValueError, match=match):
        sample_categorical(torch.tensor([[1.0, 0.0], row]))


def test_bad_shapes_are_refused():
    for bad in (torch.ones(3), torch.ones(2, 3, 4), torch.ones(2, 3, dtype=torch.long), torch.ones(2, 0), [[1.0]]):
        with pytest.raises(ValueError, match=r"probs must be a \[B, V\] floating tensor"):
            sample_categorical(bad)


def test_fast_multinomial_replaces_only_the_one_sample_case_and_restores():
    original = torch.multinomial
    probs = torch.softmax(torch.randn(4, 300), -1)
    with fast_multinomial():
        assert torch.multinomial is not original
        with fast_multinomial():  # re-entrant: the inner one changes nothing
            inner = torch.multinomial
        assert torch.multinomial is inner
        g = torch.Generator().manual_seed(5)
        drawn = torch.multinomial(probs, 1, generator=g)
        assert torch.equal(drawn, sample_categorical(probs, torch.Generator().manual_seed(5)).unsqueeze(1))
        # Everything else is torch.multinomial's: several samples, 1-D input, out=, its errors.
        g1, g2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
        assert torch.equal(torch.multinomial(probs, 3, generator=g1), original(probs, 3, generator=g2))
        assert torch.multinomial(probs[0], 1).shape == (1,)
        out = torch.empty(4, 1, dtype=torch.long)
        torch.multinomial(probs, 1, out=out)
        assert bool((out >= 0).all())
        with pytest.raises(RuntimeError, match="invalid multinomial distribution|probability tensor contains"):
            torch.multinomial(torch.tensor([[0.5, float("nan")]]), 1)
    assert torch.multinomial is original
    with pytest.raises(KeyError):
        with fast_multinomial():
            raise KeyError("x")
    assert torch.multinomial is original
