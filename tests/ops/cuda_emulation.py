"""float32 replays of the CUDA reductions in csrc/cuda/kernels/, run on the CPU with numpy.

No GPU has to be present to check what the kernels' order of operations guarantees: each
function here performs the kernel's operations in the kernel's order, one IEEE float32 rounding
per operation, vectorised over rows and threads.

* :func:`gather_fwd` replays ``gather_fwd_kernel`` (gather_logprobs_kernel.cu): 256 threads a
  row, chunks of ``kvec`` elements dealt round-robin, each thread's running (m, s, t), the warp
  shuffle tree and the tree over the 8 warps. Two instructions cannot be replayed bit for bit:
  ``ex2.approx`` (here 2^x rounded to float32, optionally off by up to ``ex2_ulps`` units in the
  last place, exact at 0 as the hardware is) and ``log2f``; ``fma`` is computed in float64 and
  rounded once more. The contract checks (log-probs never positive, exactly 0 where the row is
  one-hot or V = 1, finite for huge finite logits) hold whatever those last bits are.
* :func:`gae` replays ``gae_warp_kernel`` (gae_kernel.cu) bit for bit, with a decoupled
  ``lam_critic`` and a per-row ``row_lam`` too: every operation in the kernel is an explicit IEEE
  multiply, add or subtract.
* :func:`group_advantages` replays ``group_advantages_kernel`` (group_advantages_kernel.cu) bit
  for bit: the tiles of ids, the ballots of 32 lanes and the order in which a warp visits its
  group's rows, with the kernel's float64 operations (Python floats are IEEE float64).
* :func:`turn_gae` replays ``turn_gae_kernel`` (turn_gae_kernel.cu) bit for bit: a thread's two
  loops over its row, with the kernel's explicit IEEE float32 operations.
* :func:`kl_k3` replays the float ``k3`` of ``kl_fwd_kernel`` / ``kl_bwd_kernel`` (kl_kernel.cu,
  the arithmetic in csrc/kl_estimators.h): bit for bit where ``|ref - lp| <= 1`` (the series
  and the TwoSum correction are explicit ``__fmul_rn`` / ``__fadd_rn`` and subtractions, no FMA);
  elsewhere with numpy's float64 ``expm1`` for CUDA's, both within an ulp of float64 and then
  rounded to float32, so the results differ only where that double lies within about 1e-16 of a
  float32 rounding boundary.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32
THREADS = 256
WARPS = THREADS // 32
LOG2E = F32(1.4426950408889634)
LN2 = F32(0.6931471805599453)
LOWEST = F32(-3.402823466e38)
NINF = F32(-np.inf)
GAE_SEGMENT = 16  # kGaeSegment in csrc/cuda/kernels/kernels.h
GAE_TILE = 32 * GAE_SEGMENT
GROUP_ADV_TILE = 256  # kGroupAdvTile in csrc/cuda/kernels/kernels.h


def _ex2(x: np.ndarray, ulps: int, rng: np.random.Generator | None) -> np.ndarray:
    """ex2.approx.ftz.f32: 2^x, subnormal results flushed to 0; 2^0 = 1 exactly."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        e = np.exp2(x.astype(np.float64)).astype(F32)
    if ulps and rng is not None:
        steps = rng.integers(-ulps, ulps + 1, size=e.shape)
        noisy = e
        for i in range(ulps):
            noisy = np.where(
                steps > i, np.nextafter(noisy, F32(np.inf)), np.where(-steps > i, np.nextafter(noisy, F32(0)), noisy)
            ).astype(F32)
        e = np.where((x == 0) | ~np.isfinite(e) | (e == 0), e, noisy).astype(F32)
    return np.where(np.abs(e) < np.finfo(F32).tiny, F32(0), e).astype(F32)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


class _State:
    """Arrays of (m, s, t), one triple per row and thread."""

    def __init__(self, m, s, t):
        self.m, self.s, self.t = m, s, t

    def copy(self):
        return _State(self.m.copy(), self.s.copy(), self.t.copy())


def _rebase(a: _State, mn: np.ndarray, where: np.ndarray, entropy: bool, ex2) -> None:
    with np.errstate(invalid="ignore", over="ignore"):
        diff = (a.m - mn).astype(F32)
        r = ex2((diff * LOG2E).astype(F32))
        if entropy:
            t = np.where(r == 0, F32(0), (r * _fma(diff, a.s, a.t)).astype(F32))
            a.t = np.where(where, t, a.t).astype(F32)
        a.s = np.where(where, (a.s * r).astype(F32), a.s).astype(F32)
        a.m = np.where(where, mn, a.m).astype(F32)


def _merge(a: _State, b: _State, entropy: bool, ex2) -> _State:
    """merge(a, b) of the kernel: an empty side (m = -inf) is the identity."""
    out = a.copy()
    b_empty, a_empty = b.m == NINF, a.m == NINF
    both = ~b_empty & ~a_empty
    mn = np.fmax(a.m, b.m)
    ra, rb = a.copy(), b.copy()
    _rebase(ra, mn, both, entropy, ex2)
    _rebase(rb, mn, both, entropy, ex2)
    with np.errstate(invalid="ignore", over="ignore"):
        s = (ra.s + rb.s).astype(F32)
        t = (ra.t + rb.t).astype(F32)
    take_b = a_empty & ~b_empty
    out.m = np.where(both, mn, np.where(take_b, b.m, a.m)).astype(F32)
    out.s = np.where(both, s, np.where(take_b, b.s, a.s)).astype(F32)
    out.t = np.where(both, t, np.where(take_b, b.t, a.t)).astype(F32)
    return out


def _shfl_down(x: np.ndarray, off: int) -> np.ndarray:
    """__shfl_down_sync over the last axis (32 lanes): lanes past the end read their own value."""
    out = x.copy()
    out[..., : 32 - off] = x[..., off:]
    return out


def _warp_tree(st: _State, entropy: bool, ex2) -> _State:
    for off in (16, 8, 4, 2, 1):
        other = _State(_shfl_down(st.m, off), _shfl_down(st.s, off), _shfl_down(st.t, off))
        st = _merge(st, other, entropy, ex2)
    return st


def gather_fwd(
    z: np.ndarray,
    labels: np.ndarray,
    *,
    temperature: float = 1.0,
    kvec: int = 4,
    entropy: bool = True,
    ex2_ulps: int = 0,
    seed: int = 0,
):
    """(logprobs, entropy, lse) of rows ``z [R, V]`` (float32 values of the logits, already
    converted from their dtype) at ``labels [R]`` (all valid, in range), as the kernel computes
    them. ``kvec`` is the elements per 16-byte chunk: 4 for float32, 8 for bfloat16/float16."""
    z = np.asarray(z, dtype=F32)
    R, V = z.shape
    rng = np.random.default_rng(seed) if ex2_ulps else None
    ex2 = lambda x: _ex2(x, ex2_ulps, rng)  # noqa: E731
    inv_tau = (F32(1) / F32(temperature)).astype(F32)
    scaled = float(temperature) != 1.0
    per_pass = THREADS * kvec
    passes = -(-V // per_pass)
    padded = np.full((R, passes * per_pass), NINF, dtype=F32)
    padded[:, :V] = z
    chunks = padded.reshape(R, passes, THREADS, kvec)
    st = _State(np.full((R, THREADS), NINF, F32), np.zeros((R, THREADS), F32), np.zeros((R, THREADS), F32))
    bad = np.zeros((R, THREADS), dtype=bool)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for k in range(passes):
            c = chunks[:, k]
            cm = c[..., 0]
            for j in range(1, kvec):
                cm = np.fmax(cm, c[..., j])
            cmx = (cm * inv_tau).astype(F32) if scaled else cm
            grow = cmx > st.m
            _rebase(st, cmx, grow & (st.m != NINF), entropy, ex2)
            st.m = np.where(grow, cmx, st.m).astype(F32)
            empty = st.m == NINF
            bad |= empty & np.isnan(c).any(-1)
            for j in range(kvec):
                x = (c[..., j] * inv_tau).astype(F32) if scaled else c[..., j]
                d = (x - st.m).astype(F32)
                e = ex2((d * LOG2E).astype(F32))
                st.s = np.where(empty, st.s, (st.s + e).astype(F32))
                if entropy:
                    st.t = np.where(empty, st.t, _fma(e, np.fmax(d, LOWEST), st.t))
        bad |= st.m == F32(np.inf)
        row_bad = bad.any(-1)
        # The warp trees, then warp 0 over the warps' lane-0 results (lanes >= 8 empty).
        lanes = _State(st.m.reshape(R, WARPS, 32), st.s.reshape(R, WARPS, 32), st.t.reshape(R, WARPS, 32))
        lanes = _warp_tree(lanes, entropy, ex2)
        w = _State(np.full((R, 32), NINF, F32), np.zeros((R, 32), F32), np.zeros((R, 32), F32))
        w.m[:, :WARPS], w.s[:, :WARPS], w.t[:, :WARPS] = lanes.m[..., 0], lanes.s[..., 0], lanes.t[..., 0]
        w = _warp_tree(w, entropy, ex2)
        m, s, t = w.m[:, 0], w.s[:, 0], w.t[:, 0]
        ln_s = (LN2 * np.log2(s).astype(F32)).astype(F32)
        lse = (m + ln_s).astype(F32)
        ent = (ln_s - (t / s).astype(F32)).astype(F32)
        zl = z[np.arange(R), labels]
        x_label = (zl * inv_tau).astype(F32) if scaled else zl
        lp = ((x_label - m).astype(F32) - ln_s).astype(F32)
        lp = np.where(lp > 0, F32(0), lp)
    nan = F32(np.nan)
    return (
        np.where(row_bad, nan, lp).astype(F32),
        np.where(row_bad, nan, ent).astype(F32),
        np.where(row_bad, nan, lse).astype(F32),
    )


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray,
    *,
    gamma: float,
    lam: float,
    last_values: np.ndarray | None = None,
    lam_critic: float | None = None,
    row_lam: np.ndarray | None = None,
):
    """(advantages, returns) ``[B, T]`` float32, bit for bit as ``gae_warp_kernel`` computes them
    (with ``lam_critic``: its ``Two`` instance, a second composition for the returns; with
    ``row_lam``: each row's γ·λ from its own λ)."""
    rewards = np.asarray(rewards, F32)
    values = np.asarray(values, F32)
    mask = np.asarray(mask, bool)
    B, T = rewards.shape
    S = GAE_SEGMENT
    g = F32(gamma)
    # The kernel casts the double product; an out-of-range row λ gives NaN.
    if row_lam is None:
        gl = np.full((B, 1), F32(gamma * lam), F32)
    else:
        lam_b = np.asarray(row_lam, np.float64)
        gl = np.where((lam_b >= 0) & (lam_b <= 1), gamma * lam_b, np.nan).astype(F32)[:, None]
    two = lam_critic is not None
    gl_c = np.full((B, 1), F32(gamma * lam_critic), F32) if two else gl
    tiles = -(-T // GAE_TILE)
    Tp = tiles * GAE_TILE
    r_all = np.zeros((B, Tp), F32)
    v_all = np.zeros((B, Tp), F32)
    m_all = np.zeros((B, Tp), bool)
    r_all[:, :T], v_all[:, :T], m_all[:, :T] = rewards, values, mask
    adv = np.zeros((B, Tp), F32)
    ret = np.zeros((B, Tp), F32)
    carry_v = np.zeros(B, F32) if last_values is None else np.asarray(last_values, F32).copy()
    carry_a = np.zeros(B, F32)
    carry_c = np.zeros(B, F32)
    lane = np.arange(32)

    def compose_to_edge(C, D, carry):
        for off in (1, 2, 4, 8, 16):
            oC, oD = _shfl_down(C, off), _shfl_down(D, off)
            upd = lane + off < 32
            D, C = np.where(upd, (D + (C * oD).astype(F32)).astype(F32), D), np.where(upd, (C * oC).astype(F32), C)
        right_C, right_D = _shfl_down(C, 1), _shfl_down(D, 1)
        return np.where(
            lane < 31, (right_D + (right_C * carry[:, None]).astype(F32)).astype(F32), carry[:, None]
        ).astype(F32)

    def td(r, v, nv):
        return ((r + (g * nv).astype(F32)).astype(F32) - v).astype(F32)

    for tile in range(tiles - 1, -1, -1):
        sl = slice(tile * GAE_TILE, (tile + 1) * GAE_TILE)
        m = m_all[:, sl].reshape(B, 32, S)
        r = np.where(m, r_all[:, sl].reshape(B, 32, S), F32(0))
        v = np.where(m, v_all[:, sl].reshape(B, 32, S), F32(0))
        has = m.any(-1)
        first_v = np.where(has, np.take_along_axis(v, m.argmax(-1)[..., None], -1)[..., 0], F32(0))
        active = has.any(-1)
        # 1. V_next at each segment's right edge.
        sh, sv = has.copy(), first_v.copy()
        for off in (1, 2, 4, 8, 16):
            oh, ov = _shfl_down(sh, off), _shfl_down(sv, off)
            upd = (lane + off < 32) & ~sh
            sh, sv = np.where(upd, oh, sh), np.where(upd, ov, sv)
        right_h, right_v = _shfl_down(sh, 1), _shfl_down(sv, 1)
        v_edge = np.where((lane < 31) & right_h, right_v, carry_v[:, None]).astype(F32)
        # 2. Each segment's map (and the returns' with gl_c), then the suffix compositions.
        C, D = np.ones((B, 32), F32), np.zeros((B, 32), F32)
        Cc, Dc = C.copy(), D.copy()
        nv = v_edge.copy()
        for k in range(S - 1, -1, -1):
            mk = m[..., k]
            delta = td(r[..., k], v[..., k], nv)
            D = np.where(mk, (delta + (gl * D).astype(F32)).astype(F32), D)
            C = np.where(mk, (gl * C).astype(F32), C)
            Dc = np.where(mk, (delta + (gl_c * Dc).astype(F32)).astype(F32), Dc)
            Cc = np.where(mk, (gl_c * Cc).astype(F32), Cc)
            nv = np.where(mk, v[..., k], nv)
        a_edge = compose_to_edge(C, D, carry_a)
        c_edge = compose_to_edge(Cc, Dc, carry_c)
        # 3. The recurrence over each segment from its right edge.
        nv, na, nc = v_edge.copy(), a_edge.copy(), c_edge.copy()
        out_a = np.zeros((B, 32, S), F32)
        out_r = np.zeros((B, 32, S), F32)
        for k in range(S - 1, -1, -1):
            mk = m[..., k]
            delta = td(r[..., k], v[..., k], nv)
            na = np.where(mk, (delta + (gl * na).astype(F32)).astype(F32), na)
            nc = np.where(mk, (delta + (gl_c * nc).astype(F32)).astype(F32), nc)
            nv = np.where(mk, v[..., k], nv)
            out_a[..., k] = np.where(mk, na, F32(0))
            out_r[..., k] = np.where(mk, ((nc if two else na) + v[..., k]).astype(F32), F32(0))
        adv[:, sl] = np.where(active[:, None], out_a.reshape(B, GAE_TILE), F32(0))
        ret[:, sl] = np.where(active[:, None], out_r.reshape(B, GAE_TILE), F32(0))
        carry_v = np.where(active, nv[:, 0], carry_v).astype(F32)
        carry_a = np.where(active, na[:, 0], carry_a).astype(F32)
        carry_c = np.where(active, nc[:, 0], carry_c).astype(F32)
    return adv[:, :T], ret[:, :T]


def turn_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    turn_ids: np.ndarray,
    *,
    gamma: float,
    lam: float,
    last_values: np.ndarray | None = None,
):
    """(advantages, returns) ``[B, T]`` float32, bit for bit as ``turn_gae_kernel`` computes them
    (one thread a row: the loop over the turns right to left, then the broadcast left to right)."""
    rewards = np.asarray(rewards, F32)
    values = np.asarray(values, F32)
    turn_ids = np.asarray(turn_ids, np.int64)
    B, T = rewards.shape
    g, gl = F32(gamma), F32(gamma * lam)
    adv = np.zeros((B, T), F32)
    ret = np.zeros((B, T), F32)
    for b in range(B):
        ip, rp, vp, ap, op = turn_ids[b], rewards[b], values[b], adv[b], ret[b]
        next_value = F32(0) if last_values is None else F32(last_values[b])
        next_adv = F32(0)
        is_open, tid, start, reward = False, 0, 0, F32(0)
        for t in range(T - 1, -2, -1):
            i = int(ip[t]) if t >= 0 else -1
            if t >= 0 and i < 0:
                continue
            if is_open and (t < 0 or i != tid):
                v = vp[start]
                delta = F32(F32(reward + F32(g * next_value)) - v)
                next_adv = F32(delta + F32(gl * next_adv))
                next_value = v
                ap[start], op[start] = next_adv, F32(next_adv + v)
                is_open = False
            if t < 0:
                break
            if is_open:
                reward = F32(reward + rp[t])
            else:
                is_open, tid, reward = True, i, rp[t]
            start = t
        seen, a, r = False, F32(0), F32(0)
        for t in range(T):
            i = int(ip[t])
            if i < 0:
                ap[t] = op[t] = F32(0)
                continue
            if not seen or i != tid:
                seen, tid, a, r = True, i, ap[t], op[t]
            ap[t], op[t] = a, r
    return adv, ret


def _group_members(ids: np.ndarray, g: int) -> list[int]:
    """The rows a warp visits for group ``g``: tile by tile, a ballot of 32 lanes at a time,
    each ballot's set bits from the lowest (``__ffs``)."""
    B = len(ids)
    rows = []
    for base in range(0, B, GROUP_ADV_TILE):
        for k0 in range(0, GROUP_ADV_TILE, 32):
            lanes = np.arange(base + k0, min(base + k0 + 32, B))
            bits = lanes[ids[lanes] == g] if lanes.size else lanes
            rows.extend(int(j) for j in bits)
    return rows


def group_advantages(
    scores: np.ndarray,
    ids: np.ndarray,
    mask: np.ndarray,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
    std_normalize: bool = True,
) -> np.ndarray:
    """``[B, T]`` advantages (float32, float64 for float64 scores), as ``group_advantages_kernel``
    computes them."""
    out_dtype = np.float64 if scores.dtype == np.float64 else F32
    s = [float(x) for x in np.asarray(scores, out_dtype)]
    ids = np.asarray(ids, np.int64)
    mask = np.asarray(mask, bool)
    rloo = estimator == "rloo"
    adv = np.zeros(len(s), out_dtype)
    for b in range(len(s)):
        rows = _group_members(ids, int(ids[b]))
        n, total, lo, hi = 0, 0.0, 0.0, 0.0
        for j in rows:  # pass 1
            v = s[j]
            if n == 0:
                lo = hi = v
            else:
                lo = v if v < lo else lo
                hi = v if hi < v else hi
            n += 1
            total = total + v
        mean = total / n
        sq = 0.0
        for j in rows:  # pass 2
            d = s[j] - mean
            sq = sq + d * d
        if n == 1:
            a = s[b] / (1.0 + eps) if (std_normalize and not rloo) else s[b]
        elif lo == hi:
            a = 0.0
        elif rloo:
            a = (s[b] - mean) * (n / (n - 1))
        elif not std_normalize:
            a = s[b] - mean
        else:
            a = (s[b] - mean) / (math.sqrt(sq / (n - 1)) + eps)
        adv[b] = a
    return np.where(mask, adv[:, None], out_dtype(0)).astype(out_dtype)


K3_SERIES_LAST = 9  # K3Series<float>::kLast in csrc/kl_estimators.h


def kl_k3(lp: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k3, exp(x) - 1) float32 at x = ref - lp, as ``k3_value<float>`` computes them: k3 is the
    ``kl_penalty`` estimate, ``-(exp(x) - 1)`` its derivative in ``lp``."""
    lp = np.asarray(lp, F32)
    ref = np.asarray(ref, F32)
    with np.errstate(all="ignore"):
        x = ref - lp
        z = x - ref
        x_lo = (ref - (x - z)) + ((F32(0) - lp) - z)
        p = np.full_like(x, F32(1.0 / math.factorial(K3_SERIES_LAST + 2)))
        for k in range(K3_SERIES_LAST - 1, -1, -1):
            p = p * x + F32(1.0 / math.factorial(k + 2))
        f = (x * x) * p
        e = x + f
        em1_series = e + (e + F32(1)) * x_lo
        v_series = f + e * x_lo
        xd = ref.astype(np.float64) - lp.astype(np.float64)
        ed = np.expm1(xd)
        vd = np.where(ed == np.inf, ed, ed - xd)
        series = (x >= -1) & (x <= 1)
        same = lp == ref
        v = np.where(same, F32(0), np.where(series, v_series, vd.astype(F32)))
        em1 = np.where(same, F32(0), np.where(series, em1_series, ed.astype(F32)))
    return v.astype(F32), em1.astype(F32)
