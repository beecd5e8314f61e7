"""Drop-in adapters for rlox 1.2.0's batched advantage and KL functions, computed with pyppo's ops.

rlox (a reinforcement-learning library written in Rust) exposes its numerics as functions of flat
numpy arrays in ``rlox._rlox_core``, re-exported as ``rlox.<name>``. Covered, each with rlox's
name, signature, argument order, numpy input and output dtypes and shapes:

* ``compute_batch_group_advantages`` (GRPO's per-group z-scores, population std, zeros where a
  group's std is below 1e-8) with ``pyppo.ops.group_advantages``;
* ``compute_gae_batched_f32`` and ``compute_gae_batched`` (GAE over ``n_envs`` rows of ``n_steps``
  steps, episodes ending where ``dones`` is 1) with ``pyppo.ops.gae``;
* ``compute_batch_token_kl_schulman_f32`` and ``compute_batch_token_kl_f32`` (per-sequence sums
  of a token-level KL estimate) with ``pyppo.ops.kl_penalty``.

Arrays cross into torch with ``torch.from_numpy`` (no copy) and back with ``Tensor.numpy()``;
importing this module imports neither rlox nor numpy (the adapters import numpy when called, for
the arithmetic around the ops). ``docs/integrations.md`` lists what plain torch and numpy do
around each op, the deliberate differences and the tolerances tested.

Usage: ``import pyppo.integrations.rlox as r; r.patch()`` (``r.unpatch()`` restores, or
``with r.patched(): ...``); ``patch()`` replaces the functions in ``rlox._rlox_core`` and the
``rlox`` namespace, which rlox's own algorithms (``rlox.algorithms.grpo``, ``rlox.collectors``)
call them through. The adapters also work called directly.
"""

from __future__ import annotations

import operator
import warnings

import torch

from pyppo.ops import gae, group_advantages, kl_penalty

from . import _patching
from ._patching import Patch

__all__ = [
    "STD_THRESHOLD",
    "compute_batch_group_advantages",
    "compute_gae_batched_f32",
    "compute_gae_batched",
    "compute_batch_token_kl_schulman_f32",
    "compute_batch_token_kl_f32",
    "PEER",
    "patch",
    "unpatch",
    "patched",
]

#: rlox 1.2.0 gives a group whose population std is below this advantages of exactly 0.
STD_THRESHOLD = 1e-8

_NUMPY_NAMES = {torch.float32: "float32", torch.float64: "float64"}


def _vector(fn: str, name: str, x, dtype: torch.dtype) -> torch.Tensor:
    """``x``, a 1-D numpy array of ``dtype``, as a tensor sharing its memory. rlox accepts nothing
    else (its PyO3 bindings raise TypeError for lists, tensors, other dtypes and ranks)."""
    try:
        if getattr(getattr(x, "flags", None), "writeable", True):
            t = torch.from_numpy(x)
        else:  # rlox takes read-only arrays; nothing here writes into the caller's arrays
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(x)
    except TypeError:
        raise TypeError(
            f"{fn}: {name} must be a 1-D numpy array of {_NUMPY_NAMES[dtype]}, got {type(x).__name__}"
        ) from None
    if t.dtype != dtype or t.dim() != 1:
        raise TypeError(
            f"{fn}: {name} must be a 1-D numpy array of {_NUMPY_NAMES[dtype]}, got {x.dtype} with shape {x.shape}"
        )
    return t


def _count(fn: str, name: str, value, least: int) -> int:
    """An integer argument (anything with ``__index__``, as rlox's ``usize`` takes) ``>= least``."""
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}") from None
    if n < least:
        raise ValueError(f"{fn}: {name} must be >= {least}, got {n}")
    return n


# --------------------------------------------------------------------------- group advantages


def compute_batch_group_advantages(rewards, group_size):
    r"""GRPO's group-relative advantages of ``n_prompts`` groups of ``group_size`` consecutive
    rewards. Matches rlox 1.2.0 ``rlox.compute_batch_group_advantages``.

    For a group with mean ``m`` and **population** standard deviation
    ``σ = sqrt((1/n) Σ (r_i − m)²)``: ``a_i = (r_i − m) / σ``, and ``a_i = 0`` for every member
    when ``σ < 1e-8`` (:data:`STD_THRESHOLD`: equal rewards, and every group of one).

    Args:
        rewards: ``(n_prompts * group_size,)`` float64 numpy array.
        group_size: ``n ≥ 1``.

    Returns:
        ``(n_prompts * group_size,)`` float64 numpy array (a new one).

    Raises:
        TypeError: ``rewards`` not a 1-D float64 numpy array (as rlox).
        ValueError: ``group_size < 1`` (rlox: ValueError for 0, OverflowError below); ``len(rewards)``
            not a multiple of ``group_size`` (as rlox); a non-finite reward (rlox returns NaN for
            that group).

    Work: ``pyppo.ops.group_advantages(estimator="grpo", std_normalize=False)`` gives
    ``r_i − m`` (float64 group sums in row order); ``σ``, the zero rule and the division are
    numpy operations on that ``[n_prompts, n]`` result, in place. rlox's ``σ`` has its own summation
    order: the two agree to float64 rounding, except on which side of 1e-8 a σ within rounding
    of it falls.
    """
    fn = "compute_batch_group_advantages"
    scores = _vector(fn, "rewards", rewards, torch.float64)
    n = _count(fn, "group_size", group_size, 1)
    B = scores.shape[0]
    if B % n:
        raise ValueError(f"{fn}: len(rewards) = {B} is not a multiple of group_size = {n}")
    if n == 1:  # σ = 0 for a group of one: rlox's zero rule
        return torch.zeros(B, dtype=torch.float64).numpy()
    import numpy as np  # rlox's users have it; importing this module must not need it

    # The op's output is a fresh array: normalised in place, in numpy (a few microseconds less
    # per operation than torch at these sizes).
    centered = (
        group_advantages(scores, torch.ones(B, 1, dtype=torch.bool), group_size=n, std_normalize=False)
        .numpy()
        .reshape(-1, n)
    )
    std = np.sqrt(np.einsum("ij,ij->i", centered, centered) / n)
    small = std < STD_THRESHOLD
    centered[small] = 0.0
    std[small] = 1.0
    centered /= std[:, None]
    return centered.reshape(-1)


# --------------------------------------------------------------------------- GAE


_ALL_VALID: dict[tuple[int, int], torch.Tensor] = {}


def _all_valid(E: int, N: int) -> torch.Tensor:
    """An all-true ``[E, N]`` mask, kept for the next call of the same shape (a rollout's shape
    repeats; building it costs up to a tenth of the op's time). The op only reads it."""
    mask = _ALL_VALID.get((E, N))
    if mask is None:
        _ALL_VALID.clear()
        mask = _ALL_VALID[(E, N)] = torch.ones(E, N, dtype=torch.bool)
    return mask


def _episode_gae(rewards, values, done, last_done, last_values, gamma, lam):
    """GAE over ``[E, N]`` rows whose episodes end where ``done`` is true: rlox's semantics, no
    bootstrap and no carried advantage past such a step; the last step of a row not done
    bootstraps from ``last_values``. ``rewards``, ``values`` and ``last_values`` are numpy arrays,
    ``done`` a bool numpy ``[E, N]`` array, or None when no episode ends before a row's last step
    (``last_done``, bool ``[E]``, says where the last step ends one). Returns flat
    ``(advantages, returns)`` numpy arrays.

    ``pyppo.ops.gae`` runs one episode per row (its chain skips masked positions instead of
    cutting there), so each episode becomes a row of its own: with no episode end inside a row
    the rows are the op's rows; otherwise the segments between ends are laid out as rows of
    ``W`` positions, ``W`` the power of two at or above their length (so the padding at most
    doubles the memory), one op call per width. The index arithmetic is numpy's: its cumulative
    and gather operations are several times faster than torch's on the CPU.
    """
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    E, N = rewards.shape
    if done is None:
        boot = np.where(last_done, 0.0, last_values).astype(last_values.dtype)
        adv, ret = gae(
            torch.from_numpy(rewards),
            torch.from_numpy(values),
            _all_valid(E, N),
            gamma=gamma,
            lam=lam,
            last_values=torch.from_numpy(boot),
        )
        return adv.numpy().reshape(-1), ret.numpy().reshape(-1)

    P = E * N
    flat_done = done.reshape(-1)
    start = np.empty(P, dtype=bool)
    start[0] = True
    start[1:] = flat_done[:-1]
    start[::N] = True
    first = np.flatnonzero(start)  # each episode segment's first step
    length = np.diff(first, append=P)
    last = first + length - 1
    boot = np.where(flat_done[last], 0.0, last_values[last // N]).astype(last_values.dtype)
    log_width = np.ceil(np.log2(length)).astype(np.int64)
    order = np.argsort(log_width, kind="stable")  # segments by width, in step order within one
    width = np.left_shift(1, log_width)
    sorted_width = width[order]
    offset = np.empty_like(width)
    offset[order] = np.cumsum(sorted_width) - sorted_width
    # Where each step sits in the concatenated [rows, W] blocks: its segment's row plus its column.
    dest = np.repeat(offset - first, length) + np.arange(P)
    # A segment's row is the window of W steps from its first one (a view; the steps past the
    # segment are masked), so a block is a copy of whole rows, not a gather of single steps.
    pad = int(width.max())
    windows = {}
    for name, x in (("rewards", rewards), ("values", values)):
        padded = np.zeros(P + pad, dtype=x.dtype)
        padded[:P] = x.reshape(-1)
        windows[name] = padded
    advs, rets = [], []
    rows = 0
    for log_w, count in zip(*np.unique(log_width[order], return_counts=True)):
        w, segments = 1 << int(log_w), order[rows : rows + count]
        starts = first[segments]
        adv, ret = gae(
            torch.from_numpy(sliding_window_view(windows["rewards"], w)[starts]),
            torch.from_numpy(sliding_window_view(windows["values"], w)[starts]),
            torch.from_numpy(np.arange(w) < length[segments, None]),
            gamma=gamma,
            lam=lam,
            last_values=torch.from_numpy(boot[segments]),
        )
        advs.append(adv.numpy().reshape(-1))
        rets.append(ret.numpy().reshape(-1))
        rows += count
    return np.concatenate(advs).take(dest), np.concatenate(rets).take(dest)


_DONES_01 = (
    "{fn}: dones must hold only 0 and 1 (an episode ends at a step or not); rlox weighs the next "
    "step by 1 - done, which no episode boundary reproduces"
)


def _gae_batched(fn, dtype, rewards, values, dones, last_values, n_steps, gamma, lam):
    """``compute_gae_batched*`` for arrays of ``dtype``: rlox's argument checks, then
    :func:`_episode_gae`."""
    arrays = {
        name: _vector(fn, name, x, dtype)
        for name, x in (("rewards", rewards), ("values", values), ("dones", dones), ("last_values", last_values))
    }
    N = _count(fn, "n_steps", n_steps, 0)
    lv = arrays.pop("last_values")
    E = lv.shape[0]
    P = E * N
    for name, t in arrays.items():
        # rlox reads the first n_envs * n_steps elements (n_envs = len(last_values)) and panics
        # when there are fewer.
        if t.shape[0] < P:
            raise ValueError(
                f"{fn}: {name} has {t.shape[0]} elements, fewer than len(last_values) * n_steps = {E} * {N}"
            )
    if P == 0:
        empty = torch.zeros(0, dtype=dtype)
        return empty.numpy(), empty.clone().numpy()
    import numpy as np  # rlox's users have it; importing this module must not need it

    # The checks on dones in numpy: torch's float comparisons to bool are ~10x slower on CPU.
    # First the elements with any bit set, read as integers (several times faster than a float
    # comparison): when they all sit in the rows' last column, which the usual rollout's dones
    # are (an episode ending at a row's end, or not at all), only that column needs checking.
    d = dones[:P]
    as_int = d.view(f"i{d.itemsize}")
    set_bits = np.count_nonzero(as_int)
    d = d.reshape(E, N)
    last = d[:, -1]
    if set_bits == np.count_nonzero(as_int.reshape(E, N)[:, -1]):
        ends, inside = None, False
        last_done = last == 1
        if not (last_done | (last == 0)).all():
            raise ValueError(_DONES_01.format(fn=fn))
    else:
        ends = d == 1
        n_ends = np.count_nonzero(ends)
        # Every element with a bit set equal to 1 proves the 0/1 rule at once; only a -0.0 (or a
        # wrong value) sends the check to the float comparison.
        if n_ends != set_bits and n_ends != np.count_nonzero(d):
            raise ValueError(_DONES_01.format(fn=fn))
        last_done = ends[:, -1]
        inside = n_ends != np.count_nonzero(last_done)
    return _episode_gae(
        rewards[:P].reshape(E, N),
        values[:P].reshape(E, N),
        ends if inside else None,
        last_done,
        last_values,
        float(gamma),
        float(lam),
    )


def compute_gae_batched_f32(rewards, values, dones, last_values, n_steps, gamma, lam):
    r"""GAE (Schulman et al. 2015, eq. 16) over ``n_envs`` environments of ``n_steps`` steps each.
    Matches rlox 1.2.0 ``rlox.compute_gae_batched_f32``.

    Env-major layout (``[env0_step0, env0_step1, …, env1_step0, …]``), ``n_envs = len(last_values)``.
    For step ``t`` of an environment, with ``c_t = 1 − dones[t]``:

    ``δ_t = r_t + γ·c_t·V_{t+1} − V_t``,  ``A_t = δ_t + γλ·c_t·A_{t+1}``,  ``R_t = A_t + V_t``,

    where after the last step ``V = last_values[env]`` and ``A = 0``: ``dones[t] = 1`` ends an
    episode at step ``t`` (no bootstrap, no carried advantage).

    Args:
        rewards, values, dones: ``(n_envs * n_steps,)`` float32 numpy arrays (longer ones: only the
            first ``n_envs * n_steps`` elements are read, as rlox does); ``dones`` 0 or 1.
        last_values: ``(n_envs,)`` float32 numpy array: each environment's value after its last step.
        n_steps: steps per environment, ``≥ 0``.
        gamma, lam: in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, each a ``(n_envs * n_steps,)`` float32 numpy array.

    Raises:
        TypeError: an array not 1-D float32 numpy (as rlox).
        ValueError: an array shorter than ``n_envs * n_steps`` (rlox panics); ``dones`` other than
            0/1, ``gamma`` or ``lam`` outside ``[0, 1]`` (rlox computes with them); ``n_steps < 0``.

    Work: ``pyppo.ops.gae`` on the ``[n_envs, n_steps]`` view when no episode ends inside a row (a
    done on a row's last step only drops its bootstrap); otherwise on each episode as a row of its
    own (:func:`_episode_gae`). The results agree with rlox's to float32 rounding (bit for bit on
    every input tested).
    """
    return _gae_batched(
        "compute_gae_batched_f32", torch.float32, rewards, values, dones, last_values, n_steps, gamma, lam
    )


def compute_gae_batched(rewards, values, dones, last_values, n_steps, gamma, lam):
    r""":func:`compute_gae_batched_f32` on float64 arrays, returning float64 arrays. Matches rlox
    1.2.0 ``rlox.compute_gae_batched``.

    Args, Returns, Raises: as :func:`compute_gae_batched_f32`, every array float64.
    """
    return _gae_batched("compute_gae_batched", torch.float64, rewards, values, dones, last_values, n_steps, gamma, lam)


# --------------------------------------------------------------------------- token KL


def _per_sequence(fn, log_probs_policy, log_probs_ref, seq_len):
    """The two arrays as ``[batch, seq_len]`` float32 tensors, rlox's checks applied."""
    p = _vector(fn, "log_probs_policy", log_probs_policy, torch.float32)
    q = _vector(fn, "log_probs_ref", log_probs_ref, torch.float32)
    L = _count(fn, "seq_len", seq_len, 1)
    if p.shape != q.shape:
        raise ValueError(f"{fn}: log_probs_ref has {q.shape[0]} elements, log_probs_policy {p.shape[0]}")
    if p.shape[0] % L:
        raise ValueError(f"{fn}: len(log_probs_policy) = {p.shape[0]} is not a multiple of seq_len = {L}")
    return p.view(-1, L), q.view(-1, L)


def compute_batch_token_kl_schulman_f32(log_probs_policy, log_probs_ref, seq_len):
    r"""Per-sequence sum of Schulman's estimator as rlox writes it. Matches rlox 1.2.0
    ``rlox.compute_batch_token_kl_schulman_f32``.

    With ``x = log_probs_policy − log_probs_ref`` at each token: ``Σ_t exp(x_t) − x_t − 1``
    (J. Schulman, "Approximating KL Divergence", 2020, k3 with the ratio π/π_ref; pyppo's ``k3``
    takes π_ref/π, so the adapter swaps the arguments).

    Args:
        log_probs_policy, log_probs_ref: ``(batch * seq_len,)`` float32 numpy arrays.
        seq_len: tokens per sequence, ``≥ 1``.

    Returns:
        ``(batch,)`` float32 numpy array.

    Raises:
        TypeError: an array not 1-D float32 numpy (as rlox).
        ValueError: different lengths, a length not a multiple of ``seq_len``, ``seq_len < 1`` (as
            rlox).

    Work: ``pyppo.ops.kl_penalty(log_probs_ref, log_probs_policy, estimator="k3")`` (within 3 ulps
    of the exact value, without ``exp(x) − 1``'s cancellation), summed over each sequence in
    float64 and rounded once; rlox sums float32 terms in float32, 2.5e-6 relative off the exact
    sum at 4,096 tokens. An ``x`` past ``exp``'s float32 range gives ``+inf``, as in rlox.
    """
    p, q = _per_sequence("compute_batch_token_kl_schulman_f32", log_probs_policy, log_probs_ref, seq_len)
    kl = kl_penalty(q, p, estimator="k3")
    return kl.sum(1, dtype=torch.float64).to(torch.float32).numpy()


def compute_batch_token_kl_f32(log_probs_policy, log_probs_ref, seq_len):
    r"""Per-sequence sum of ``exp(log π) · (log π − log π_ref)``. Matches rlox 1.2.0
    ``rlox.compute_batch_token_kl_f32``.

    Args, Returns, Raises: as :func:`compute_batch_token_kl_schulman_f32`.

    Work: ``pyppo.ops.kl_penalty(log_probs_policy, log_probs_ref, estimator="k1")`` is the
    difference; the weight ``exp(log π)`` and the product are plain torch (pyppo has no such
    estimator), summed in float64 and rounded once.
    """
    p, q = _per_sequence("compute_batch_token_kl_f32", log_probs_policy, log_probs_ref, seq_len)
    kl = kl_penalty(p, q, estimator="k1").mul_(p.exp())
    return kl.sum(1, dtype=torch.float64).to(torch.float32).numpy()


PEER = _patching.Peer.named(
    "rlox",
    versions=("1.2.0",),
    targets=_patching.targets(
        "rlox._rlox_core",
        compute_batch_group_advantages,
        compute_gae_batched_f32,
        compute_gae_batched,
        compute_batch_token_kl_schulman_f32,
        compute_batch_token_kl_f32,
    ),
)


def patch(*, force: bool = False) -> Patch:
    """Swap the adapters into the installed rlox (see :mod:`pyppo.integrations`); returns what was
    replaced. rlox other than 1.2.0 is warned about and left alone unless ``force``."""
    return _patching.patch(PEER, force=force)


def unpatch() -> Patch | None:
    """Put rlox's own functions back; returns the patch undone (None if none was active)."""
    return _patching.unpatch(PEER)


def patched(*, force: bool = False):
    """``with patched(): ...``: rlox patched for the block only."""
    return _patching.patched(PEER, force=force)
