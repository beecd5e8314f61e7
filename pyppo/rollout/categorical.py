"""One draw per row from a categorical distribution, by inverse transform in float64: what the
``transformers`` sampler draws the next token with on a CPU (:func:`fast_multinomial`).

``torch.multinomial(probs, 1)`` draws one exponential variate per vocabulary entry and takes
``argmax(probs / q)``: at a vocabulary of 49152 and 32 rows that is 1.6 M logarithms per decode
step, single-threaded on a CPU, about a fifth of SmolLM2's whole sampling time at the default
preset (docs/performance.md, "Sampling"). Inverse transform sampling draws one uniform per row and
finds where it falls in the row's cumulative sum: a read of the probabilities and a scan of one
block of them. Both draw each token with probability ``p_i / Σ p`` (Devroye 1986, "Non-Uniform
Random Variate Generation", §III.2.1): the sampled distribution is unchanged, the random stream
is another (a seed gives other tokens than ``torch.multinomial``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

__all__ = ["sample_categorical", "fast_multinomial"]

#: Entries summed per block: the block sums locate the draw, then one block is scanned.
_BLOCK = 512


def sample_categorical(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    r"""One index per row of ``probs``, index ``i`` drawn with probability ``probs[b, i] / Σ_j probs[b, j]``.

    Inverse transform in float64: with ``u ~ U[0, 1)`` and the row's cumulative sums ``c_i``,
    the draw is the first ``i`` with ``c_i > u · c_{V-1}``. The cumulative sums are taken in
    blocks of 512 entries (block sums, then the prefix sums of one block), all in float64, so a
    token's probability is resolved to about ``1e-16`` of the row's mass (float32's
    ``torch.multinomial`` resolves about ``1e-7``). An entry of probability 0 is never drawn.

    Args:
        probs: ``[B, V]`` float32, float64, bfloat16 or float16, non-negative and finite, each row
            with a positive sum (need not be normalised), on any device.
        generator: the generator the uniforms are drawn from; ``None`` = the default one (so
            ``torch.manual_seed`` makes a run repeatable).

    Returns:
        ``[B]`` int64 indices in ``[0, V)``.

    Raises:
        ValueError: ``probs`` not a 2-D floating tensor with ``V >= 1``, or a row with a negative,
            non-finite or all-zero probability (naming the row).
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or not probs.is_floating_point() or probs.shape[1] < 1:
        got = f"{probs.dtype} {list(probs.shape)}" if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"sample_categorical: probs must be a [B, V] floating tensor with V >= 1, got {got}")
    B, V = probs.shape
    if B == 0:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    blocks = -(-V // _BLOCK)
    padded = probs if blocks * _BLOCK == V else torch.nn.functional.pad(probs, (0, blocks * _BLOCK - V))
    tiles = padded.view(B, blocks, _BLOCK)
    sums = tiles.sum(-1, dtype=torch.float64)  # [B, blocks]
    _check_rows(probs, sums)
    ends = sums.cumsum(-1)
    starts = ends - sums
    total = ends[:, -1:]
    target = torch.rand(B, 1, dtype=torch.float64, device=probs.device, generator=generator) * total
    arange = torch.arange(blocks, device=probs.device)
    # u·total may round up to total: the last block with mass takes it (never an empty block).
    last_block = torch.where(sums > 0, arange, -1).amax(-1, keepdim=True)
    k = torch.minimum(torch.searchsorted(ends, target, right=True), last_block)  # [B, 1]
    tile = tiles.gather(1, k.unsqueeze(-1).expand(B, 1, _BLOCK)).squeeze(1)  # [B, BLOCK]
    within = tile.to(torch.float64).cumsum(-1)
    columns = torch.arange(_BLOCK, device=probs.device)
    last_entry = torch.where(tile > 0, columns, -1).amax(-1, keepdim=True)
    j = torch.minimum(torch.searchsorted(within, target - starts.gather(1, k), right=True), last_entry)
    return (k * _BLOCK + j).squeeze(1)


def _check_rows(probs: torch.Tensor, sums: torch.Tensor) -> None:
    # One sync for the three conditions; the rare bad row is then named.
    row_ok = torch.isfinite(sums).all(-1) & (sums.sum(-1) > 0)
    if bool(row_ok.all()) and not bool((probs < 0).any()):
        return
    bad = (~row_ok | (probs < 0).any(-1)).nonzero()[0, 0].item()
    raise ValueError(
        f"sample_categorical: probs[{bad}] must be finite and non-negative with a positive sum, "
        f"got sum {float(probs[bad].double().sum())} and min {float(probs[bad].min())}"
    )


@contextmanager
def fast_multinomial() -> Iterator[None]:
    """While it is open, ``torch.multinomial(probs, 1)`` on a CPU tensor draws with
    :func:`sample_categorical`; every other call (a CUDA tensor, several samples, ``out=``, a
    1-D or integer input, invalid probabilities, whose error ``torch.multinomial`` raises) goes
    to ``torch.multinomial`` itself. ``transformers`` calls ``torch.multinomial`` by that name in
    its sampler, so this is how a pyppo rollout reaches it; the replacement is process-wide for
    the duration (other threads sampling meanwhile draw from the same distribution too).
    Re-entrant: an inner one leaves the outer's replacement in place."""
    original = torch.multinomial
    if getattr(original, "_pyppo_fast", False):
        yield
        return

    def multinomial(input, num_samples, replacement=False, *, generator=None, out=None):
        if (
            out is None
            and num_samples == 1
            and isinstance(input, torch.Tensor)
            and input.device.type == "cpu"
            and input.dim() == 2
            and input.is_floating_point()
            and input.shape[1] >= 1
        ):
            try:
                return sample_categorical(input, generator).unsqueeze(1)
            except ValueError:
                pass  # torch.multinomial raises its own error for these probabilities
        return original(input, num_samples, replacement, generator=generator, out=out)

    multinomial._pyppo_fast = True
    torch.multinomial = multinomial
    try:
        yield
    finally:
        torch.multinomial = original
