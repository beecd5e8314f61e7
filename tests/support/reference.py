"""Float64 eager reference implementations of the pyppo ops, written from their definitions in
docs/ops.md.

These are deliberately naive and independent of the kernels: explicit loops where the
definition is a loop (GAE, the last valid position of shape_rewards), plain float64 formulas
elsewhere. Every function upcasts its inputs to float64 first, so a test compares a kernel
against the exact value of the op on the (already rounded) input it was given.

The gather_logprobs, kl_penalty and masked_mean references are differentiable by autograd,
which gives the gradient the kernels' hand-written backward formulas are checked against.

Also here: small helpers shared by the op tests (random inputs, tolerances, masks, running an
op on a device or its Meta kernel, comparing errors and bits).
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

F64 = torch.float64
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """Output dtype of every op: float64 for float64 input, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# gather_logprobs
# ---------------------------------------------------------------------------------------------


def valid_positions(labels: torch.Tensor, mask: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """Bool [*]: the positions that get a log-prob (mask true and label != ignore_index)."""
    valid = labels.long() != ignore_index
    if mask is not None:
        valid = valid & (mask != 0)
    return valid


def ref_gather_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [*], entropy [*]) in float64, 0 at masked / ignore_index positions.

    logprobs = z[label]/τ − logsumexp(z/τ);  entropy = −Σ p log p, p = softmax(z/τ).
    Differentiable w.r.t. ``logits`` (which may require grad; it is upcast, not detached).
    """
    z = logits.to(F64) / temperature
    valid = valid_positions(labels, mask, ignore_index)
    # Max-shifted logsumexp, written out. A row of all -inf has no finite max: shift by 0 there.
    m = z.max(dim=-1, keepdim=True).values.detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = (z - m).exp().sum(-1).log() + m.squeeze(-1)
    safe_labels = torch.where(valid, labels.long(), torch.zeros_like(labels.long()))
    z_label = z.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    logprobs = z_label - lse
    logp = z - lse.unsqueeze(-1)
    p = logp.exp()
    # p log p -> 0 as p -> 0 (a -inf logit): never 0 * -inf.
    plogp = torch.where(p > 0, p * torch.where(p > 0, logp, torch.zeros_like(logp)), torch.zeros_like(p))
    entropy = -plogp.sum(-1)
    zero = torch.zeros((), dtype=F64)
    return torch.where(valid, logprobs, zero), torch.where(valid, entropy, zero)


def ref_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    logits_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ref_gather_logprobs of ``hidden @ weight.T + bias``, the logits computed in float64.

    ``logits_dtype`` rounds the logits to that dtype first: the op's GEMM writes them in the
    inputs' dtype (as the model's own lm_head would), so for bfloat16/float16 inputs the exact
    value of the op is that of the rounded logits. Differentiable w.r.t. hidden, weight, bias.
    """
    logits = hidden.to(F64) @ weight.to(F64).T
    if bias is not None:
        logits = logits + bias.to(F64)
    if logits_dtype is not None:
        logits = logits.to(logits_dtype).to(F64)
    return ref_gather_logprobs(logits, labels, mask, temperature=temperature, ignore_index=ignore_index)


# ---------------------------------------------------------------------------------------------
# kl_penalty / shape_rewards
# ---------------------------------------------------------------------------------------------


def ref_kl_unclamped(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    lp = logprobs.to(F64)
    ref = ref_logprobs.to(F64)
    if estimator == "k1":
        return lp - ref
    if estimator == "k2":
        return 0.5 * (lp - ref) ** 2
    if estimator == "k3":
        r = ref - lp
        # exp(r) - r - 1 as written rounds at the scale of 1, which is all of k3 for small |r| even
        # in float64; expm1(r) - r does not, and below |r| = 1e-3, where it still cancels, the
        # Taylor series to r^7 is exact to float64's precision.
        small = r.abs() < 1e-3
        rs = torch.where(small, r, torch.zeros_like(r))
        series = rs * rs * (1 / 2 + rs * (1 / 6 + rs * (1 / 24 + rs * (1 / 120 + rs * (1 / 720 + rs / 5040)))))
        k3 = torch.where(small, series, torch.expm1(r) - r)
        # -> +inf as r -> +inf (never inf - inf = NaN)
        return torch.where(torch.isposinf(r), torch.full_like(r, math.inf), k3)
    if estimator == "abs":
        return (lp - ref).abs()
    raise ValueError(estimator)


def ref_kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    estimator: str = "k1",
    clamp: tuple[float | None, float | None] | None = None,
) -> torch.Tensor:
    """Schulman's per-token KL estimators in float64, optionally clipped (torch.clamp gradient)."""
    kl = ref_kl_unclamped(logprobs, ref_logprobs, estimator)
    if clamp is not None:
        lo, hi = clamp
        kl = torch.clamp(kl, min=lo, max=hi)
    return kl


def ref_shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
    score_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, kl) in float64: −kl_coef·kl on valid positions, + score at each row's last valid one."""
    B, T = logprobs.shape
    kl_full = ref_kl_unclamped(logprobs, ref_logprobs, estimator)
    kl = torch.zeros(B, T, dtype=F64)
    rewards = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        last = None
        for t in range(T):
            if response_mask[b, t] != 0:
                kl[b, t] = kl_full[b, t]
                rewards[b, t] = -kl_coef * kl_full[b, t]
                last = t
        if last is None:
            raise ValueError(f"row {b} has no valid position")
        s = float(scores[b])
        if score_clip is not None:
            s = min(max(s, -score_clip), score_clip)
        rewards[b, last] += s
    return rewards, kl


def ref_sequence_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_ids: torch.Tensor, eos: int, estimator: str = "k1"
) -> list[float]:
    """Each response's KL in nats, float64: the per-token estimator summed over its sampled tokens,
    up to and including the first ``eos`` (every token when there is none)."""
    kl = ref_kl_unclamped(logprobs, ref_logprobs, estimator)
    out = []
    for row, ids in zip(kl, response_ids):
        first = (ids == eos).nonzero()
        n = int(first[0]) + 1 if len(first) else len(ids)
        out.append(math.fsum(row[:n].tolist()))
    return out


def ref_adaptive_kl_coef(beta: float, kl: float, target: float, n_samples: int, horizon: float) -> float:
    """One step of the adaptive KL controller (Ziegler et al. 2019, §2.2), from its definition:
    ``e = clip(KL / target − 1, −0.2, 0.2)``, ``β ← β · (1 + e · n_samples / horizon)``, with ``KL``
    in nats per sequence."""
    return beta * (1 + min(max(kl / target - 1, -0.2), 0.2) * n_samples / horizon)


# ---------------------------------------------------------------------------------------------
# gae
# ---------------------------------------------------------------------------------------------


def ref_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
    last_values: torch.Tensor | None = None,
    lam_critic: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2015, eq. 16) over the valid positions of each row, as a Python loop.

    The valid positions of a row are gathered into a list first; the recursion then runs over
    that list only, so masked positions in the middle neither add a TD term nor break the chain.
    ``lam`` may be a ``[B]`` tensor (a λ per row, VAPO). The returns are ``A' + V`` with ``A'``
    the same recursion with ``lam_critic`` (decoupled λ, VC-PPO), or with the row's λ when it
    is None.
    """
    B, T = rewards.shape
    r = rewards.to(F64)
    v = values.to(F64)
    adv = torch.zeros(B, T, dtype=F64)
    ret = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        lam_b = float(lam[b]) if isinstance(lam, torch.Tensor) else float(lam)
        lam_c = lam_b if lam_critic is None else float(lam_critic)
        idx = [t for t in range(T) if response_mask[b, t] != 0]
        next_value = float(last_values[b].to(F64)) if last_values is not None else 0.0
        next_adv = 0.0
        next_adv_c = 0.0
        for t in reversed(idx):
            delta = float(r[b, t]) + gamma * next_value - float(v[b, t])
            a = delta + gamma * lam_b * next_adv
            a_c = delta + gamma * lam_c * next_adv_c
            adv[b, t] = a
            ret[b, t] = a_c + float(v[b, t])
            next_value = float(v[b, t])
            next_adv = a
            next_adv_c = a_c
    return adv, ret


def ref_gae_compact(rewards, values, *, gamma, lam, last_value=0.0):
    """Textbook GAE on a dense 1-D episode (no mask): A_t = Σ_l (γλ)^l δ_{t+l}."""
    T = len(rewards)
    vals = [float(x) for x in values] + [float(last_value)]
    deltas = [float(rewards[t]) + gamma * vals[t + 1] - vals[t] for t in range(T)]
    adv = []
    for t in range(T):
        adv.append(sum((gamma * lam) ** l * deltas[t + l] for l in range(T - t)))
    return adv


def ref_length_adaptive_lam(loss_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's λ = 1 − 1/(α·l) per row, l its number of valid positions, clamped to [0, 1] (0 for l = 0)."""
    out = []
    for row in loss_mask:
        l = sum(1 for x in row.tolist() if x != 0)
        out.append(0.0 if l == 0 else min(1.0, max(0.0, 1.0 - 1.0 / (alpha * l))))
    return torch.tensor(out, dtype=F64)


# ---------------------------------------------------------------------------------------------
# turn_gae
# ---------------------------------------------------------------------------------------------


def ref_turns(turn_ids_row) -> list[list[int]]:
    """The turns of one row, left to right, each the list of its agent positions: maximal runs of
    agent positions (id >= 0) with one id, the positions between them that are not agent
    positions skipped (docs/ops.md#turn_gae)."""
    turns: list[list[int]] = []
    prev = None
    for t, i in enumerate(int(x) for x in turn_ids_row):
        if i < 0:
            continue
        if prev is None or i != prev:
            turns.append([])
        turns[-1].append(t)
        prev = i
    return turns


def ref_turn_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    turn_ids: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    last_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over each row's agent turns, as a Python loop over the turns (Schulman et al. 2015,
    eq. 16 with a turn as the time step): R_k the sum of the turn's rewards, V_k the value at its
    first position, A_k broadcast onto its agent positions, returns A_k + V_k, 0 elsewhere."""
    B, T = rewards.shape
    r = rewards.to(F64)
    v = values.to(F64)
    adv = torch.zeros(B, T, dtype=F64)
    ret = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        turns = ref_turns(turn_ids[b])
        next_value = float(last_values[b].to(F64)) if last_values is not None else 0.0
        next_adv = 0.0
        for positions in reversed(turns):
            R = sum(float(r[b, t]) for t in positions)
            V = float(v[b, positions[0]])
            a = R + gamma * next_value - V + gamma * lam * next_adv
            for t in positions:
                adv[b, t] = a
                ret[b, t] = a + V
            next_value, next_adv = V, a
    return adv, ret


def random_turn_ids(B: int, T: int, g: torch.Generator, *, max_span: int = 6) -> torch.Tensor:
    """int64 ``[B, T]`` turn layouts: a row is an optional environment span, then agent turns
    (spans of 1..max_span tokens, ids 0, 1, ...) alternating with environment spans (possibly
    empty, so two turns can touch), then trailing padding; when B allows, row 1 is all -1, row 2
    a single turn (a single-turn response) and row 3 one-token turns only."""
    ids = torch.full((B, T), -1, dtype=torch.int64)
    for b in range(B):
        t = int(torch.randint(0, 3, (1,), generator=g))
        end = T - int(torch.randint(0, max(1, T // 4) + 1, (1,), generator=g))
        k = 0
        while t < end:
            n = int(torch.randint(1, max_span + 1, (1,), generator=g))
            ids[b, t : min(t + n, end)] = k
            k += 1
            t += n + int(torch.randint(0, max_span, (1,), generator=g))
    if B >= 2:
        ids[1] = -1
    if B >= 3 and T >= 1:
        ids[2] = -1
        ids[2, : int(torch.randint(1, T + 1, (1,), generator=g))] = 0  # one turn, then padding
    if B >= 4:
        ids[3] = -1
        for k, t in enumerate(range(0, T, 2)):
            ids[3, t] = k
    return ids


# ---------------------------------------------------------------------------------------------
# group_advantages
# ---------------------------------------------------------------------------------------------


def ref_group_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
    std_normalize: bool = True,
) -> torch.Tensor:
    """GRPO / Dr. GRPO / RLOO advantages from their definitions (docs/ops.md#group_advantages),
    one group at a time in exact-ish float64 (``math.fsum``): a group of one has baseline 0 and
    std 1; a group of equal scores gets 0; RLOO is written as the mean of the *other* scores."""
    s = [float(x) for x in scores.to(F64).tolist()]
    ids = [int(i) for i in group_ids.tolist()]
    members: dict[int, list[int]] = {}
    for b, g in enumerate(ids):
        members.setdefault(g, []).append(b)
    adv = [0.0] * len(s)
    for rows in members.values():
        vals = [s[b] for b in rows]
        n = len(vals)
        for b in rows:
            if n == 1:
                adv[b] = s[b] / (1.0 + eps) if (estimator == "grpo" and std_normalize) else s[b]
            elif min(vals) == max(vals):
                adv[b] = 0.0
            elif estimator == "rloo":
                adv[b] = s[b] - (math.fsum(vals) - s[b]) / (n - 1)
            else:
                mean = math.fsum(vals) / n
                a = s[b] - mean
                if std_normalize:
                    a /= math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1)) + eps
                adv[b] = a
    out = torch.tensor(adv, dtype=F64)[:, None].expand(response_mask.shape)
    return torch.where(response_mask != 0, out, torch.zeros_like(out))


# ---------------------------------------------------------------------------------------------
# masked statistics
# ---------------------------------------------------------------------------------------------


def ref_masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked-in elements, float64, differentiable w.r.t. x."""
    xf = x.to(F64)
    m = (mask != 0).to(F64)
    if dim is None:
        n = m.sum()
        if n == 0:
            raise ValueError("all masked")
        return (xf * m).sum() / n
    n = m.sum(dim)
    if (n == 0).any():
        raise ValueError("all masked slice")
    return (xf * m).sum(dim) / n


def ref_masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    vals = [float(a) for a, k in zip(x.to(F64).flatten().tolist(), mask.flatten().tolist()) if k != 0]
    n = len(vals)
    if n == 0 or (unbiased and n < 2):
        raise ValueError("too few")
    mean = math.fsum(vals) / n
    ss = math.fsum((a - mean) ** 2 for a in vals)
    return torch.tensor(ss / (n - 1 if unbiased else n), dtype=F64)


def ref_masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    xf = x.to(F64)
    mean = float(ref_masked_mean(xf, mask))
    var = float(ref_masked_var(xf, mask, unbiased))
    out = (xf - mean) / math.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask != 0, out, torch.zeros_like(out))


# ---------------------------------------------------------------------------------------------
# helpers for the tests
# ---------------------------------------------------------------------------------------------


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to dtype: the tensor the kernel sees (its float64 upcast is the reference's input)."""
    return x.to(dtype)


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """assert_close tolerances for a float32 (float64 for float64 input) output computed from
    ``dtype`` inputs, compared against float64 math on the same rounded inputs. The input
    rounding is already in the reference, so only float32 accumulation error remains."""
    if dtype == torch.float64:
        return dict(rtol=1e-10 * scale, atol=1e-10 * scale)
    return dict(rtol=2e-5 * scale, atol=2e-5 * scale)


def random_mask(B: int, T: int, g: torch.Generator, *, p_valid: float = 0.7) -> torch.Tensor:
    """A bool mask with holes in the middle, plus (when B allows) an all-masked row, a
    single-token row and a full row."""
    m = torch.rand(B, T, generator=g) < p_valid
    if B >= 1 and T >= 1:
        m[0] = True  # full row
    if B >= 2:
        m[1] = False  # all masked
    if B >= 3 and T >= 1:
        m[2] = False
        m[2, int(torch.randint(0, T, (1,), generator=g))] = True  # single token
    if B >= 4 and T >= 3:
        m[3] = True
        m[3, 1 : T - 1] = False  # hole in the middle
        m[3, T // 2] = True
    return m


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# ppo_policy_loss / ppo_value_loss / aggregate_loss / explained_variance (pyppo.ops.losses)
# ---------------------------------------------------------------------------------------------


def ref_aggregate_loss(rows: list, mode: str, norm: float | None, normalizer: float | None = None) -> torch.Tensor:
    """rows: one list per sequence of its valid tokens' float64 losses (0-d tensors; may be empty).

    token-mean: mean over all tokens. seq-*: over the sequences with at least one token, the
    mean of (token mean | token sum | token sum / norm). ``normalizer`` replaces the count of
    tokens (token-mean) or sequences (seq-*) the mean divides by.
    """
    if mode == "token-mean":
        toks = [x for r in rows for x in r]
        return sum(toks) / (normalizer if normalizer is not None else len(toks))
    kept = [r for r in rows if len(r) > 0]
    count = normalizer if normalizer is not None else len(kept)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in kept) / count
    seq_mean = sum(sum(r) for r in kept) / count
    if mode == "seq-mean-token-sum":
        return seq_mean
    if mode == "seq-mean-token-sum-norm":
        return seq_mean / norm
    raise ValueError(mode)


def ref_pg_token(lp, old, a, lo=0.2, hi=0.2, dual=None, log_ratio_clamp=20.0):
    """One valid token's clipped surrogate (0-d float64 tensors in, differentiable w.r.t. ``lp``):
    ``(loss, {"d", "r", "clamped", "clipped", "lower"})``, d the (clamped) log-ratio, r the ratio."""
    d = lp - old
    clamped = 0
    if log_ratio_clamp is not None:
        clamped = int(abs(float(d.detach())) > log_ratio_clamp)
        d = torch.clamp(d, -log_ratio_clamp, log_ratio_clamp)
    r = torch.exp(d)
    l1 = -a * r
    l2 = -a * min(max(r, 1 - lo), 1 + hi)
    l = l1 if l1 >= l2 else l2
    lower = 0
    if dual is not None and a < 0:
        l3 = -a * dual
        lower = int(l3 < l)
        l = l if l <= l3 else l3
    return l, dict(d=d, r=r, clamped=clamped, clipped=int(l2 > l1), lower=lower)


def ref_ppo_policy_loss(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    lo: float = 0.2,
    hi: float = 0.2,
    dual: float | None = None,
    mode: str = "token-mean",
    norm: float | None = None,
    log_ratio_clamp: float | None = 20.0,
) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate token by token (PPO eq. 7, dual clip of Ye et al. 2020), float64.

    ``lp`` may require grad: the loss is built from its 0-d elements, so autograd gives the
    reference gradient. ``log_ratio_clamp=None`` is the textbook formula without the bound.
    Returns (loss, stats) with the stats as Python floats.
    """
    B, T = lp.shape
    lp64, old64, adv64 = lp.to(F64), old.to(F64), adv.to(F64)
    rows, n, clipped, lower, clamped, kl, ratios = [], 0, 0, 0, 0, 0.0, []
    for b in range(B):
        row = []
        for t in range(T):
            if not mask[b, t]:
                continue
            l, tok = ref_pg_token(lp64[b, t], old64[b, t], adv64[b, t], lo, hi, dual, log_ratio_clamp)
            clamped += tok["clamped"]
            clipped += tok["clipped"]
            lower += tok["lower"]
            row.append(l)
            n += 1
            kl += float((tok["r"] - 1 - tok["d"]).detach())
            ratios.append(float(tok["r"].detach()))
        rows.append(row)
    stats = dict(
        clipfrac=clipped / n,
        clipfrac_lower=lower / n,
        approx_kl=kl / n,
        ratio_mean=sum(ratios) / n,
        ratio_max=max(ratios),
        logratio_clampfrac=clamped / n,
    )
    return ref_aggregate_loss(rows, mode, norm), stats


def ref_linear_ppo_loss(
    hidden,
    weight,
    labels,
    old,
    adv,
    mask,
    *,
    bias=None,
    ref=None,
    kl_coef=0.0,
    estimator="k3",
    entropy_coef=0.0,
    lo=0.2,
    hi=0.2,
    dual=None,
    mode="token-mean",
    norm=None,
    normalizer=None,
    temperature=1.0,
    logits_dtype=None,
):
    """linear_ppo_loss in float64, token by token: ``(loss, logprobs, entropy)``.

    ``ℓ = L_pg + kl_coef·KL − entropy_coef·H`` per valid token (ref_pg_token, ref_kl_unclamped,
    the entropy of ref_linear_logprobs), reduced with ``mode`` (``norm`` defaults to T).
    Differentiable w.r.t. hidden, weight and bias.
    """
    lp, ent = ref_linear_logprobs(
        hidden, weight, labels, mask, bias=bias, temperature=temperature, logits_dtype=logits_dtype
    )
    kl = ref_kl_unclamped(lp, ref, estimator) if kl_coef > 0 else None
    old64, adv64 = old.to(F64), adv.to(F64)
    rows = []
    for b in range(lp.shape[0]):
        row = []
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            l, _ = ref_pg_token(lp[b, t], old64[b, t], adv64[b, t], lo, hi, dual)
            if kl_coef > 0:
                l = l + kl_coef * kl[b, t]
            if entropy_coef > 0:
                l = l - entropy_coef * ent[b, t]
            row.append(l)
        rows.append(row)
    loss = ref_aggregate_loss(rows, mode, norm if norm is not None else lp.shape[1], normalizer)
    return loss, lp, ent


def ref_explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var[R − V] / Var[R] over the valid tokens, with math.fsum; 0.0 where Var[R] = 0."""
    pairs = [
        (float(v), float(r))
        for v, r, k in zip(
            values.to(F64).flatten().tolist(), returns.to(F64).flatten().tolist(), mask.flatten().tolist()
        )
        if k != 0
    ]
    n = len(pairs)
    if n == 0:
        return 0.0
    rs = [r for _, r in pairs]
    ds = [r - v for v, r in pairs]
    mean_r, mean_d = math.fsum(rs) / n, math.fsum(ds) / n
    ss_r = math.fsum((x - mean_r) ** 2 for x in rs)
    if ss_r == 0.0:
        return 0.0
    return 1.0 - math.fsum((x - mean_d) ** 2 for x in ds) / ss_r


explained_variance_ref = ref_explained_variance


def ref_ppo_value_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    ret: torch.Tensor,
    mask: torch.Tensor,
    eps: float | None = 0.2,
    mode: str = "token-mean",
    norm: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """½·max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²) token by token, float64; ``v`` may require grad."""
    B, T = v.shape
    v64, old64, ret64 = v.to(F64), v_old.to(F64), ret.to(F64)
    rows, n, clipped = [], 0, 0
    for b in range(B):
        row = []
        for t in range(T):
            if not mask[b, t]:
                continue
            e1 = (v64[b, t] - ret64[b, t]) ** 2
            if eps is None:
                l = 0.5 * e1
            else:
                vc = old64[b, t] + min(max(v64[b, t] - old64[b, t], -eps), eps)
                e2 = (vc - ret64[b, t]) ** 2
                clipped += int(e2 > e1)
                l = 0.5 * (e1 if e1 >= e2 else e2)
            row.append(l)
            n += 1
        rows.append(row)
    stats = dict(vf_clipfrac=clipped / n, explained_variance=ref_explained_variance(v.detach(), ret, mask))
    return ref_aggregate_loss(rows, mode, norm), stats


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN payloads included)."""
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def grad_tol(dtype: torch.dtype) -> dict:
    """Tolerances for a gradient returned in the input dtype (so rounded to it), against float64."""
    return {
        F64: dict(rtol=1e-10, atol=1e-12),
        torch.float32: dict(rtol=1e-4, atol=1e-6),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1e-4),
        torch.float16: dict(rtol=2e-3, atol=1e-5),
    }[dtype]


def call_on(path: str, fn, *args):
    """fn(*args) with every tensor argument moved to ``path``: a device ("cpu", "cuda"), "meta"
    (meta tensors: the op's Meta kernel) or "fake" (FakeTensorMode, as torch.compile traces)."""
    if path == "fake":
        with FakeTensorMode() as mode:
            return fn(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    return fn(*(a.to(path) if isinstance(a, torch.Tensor) else a for a in args))


def error_of(fn, *args, path: str = "cpu"):
    """(exception type, first line of its message) that fn(*args) raises on ``path``, or None."""
    try:
        call_on(path, fn, *args)
    except Exception as e:  # noqa: BLE001 - the type is compared too
        return type(e), str(e).split("\n")[0]
    return None


def assert_same_error(path: str, fn, *args) -> None:
    """fn(*args) raises on ``path`` exactly what it raises on CPU: same type, same message."""
    expected = error_of(fn, *args)
    assert expected is not None, "the CPU kernel raised nothing"
    assert error_of(fn, *args, path=path) == expected
