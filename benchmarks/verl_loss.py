"""veRL's PPO policy and value losses: the adapter's hand-written backward against pyppo's loss ops.

    python benchmarks/verl_loss.py                          # B,T = 64,1024 and 256,2048; fp32, bf16
    python benchmarks/verl_loss.py --shapes 64x1024 --dtypes fp32 --budget 5 --json out.json

For each shape and dtype, one forward + backward (the gradient w.r.t. ``log_prob`` / ``vpreds``,
by ``torch.autograd.grad``) of:

* ``adapter``: ``pyppo.integrations.verl.compute_policy_loss_vanilla`` / ``compute_value_loss``,
  whose per-token loss is an ``autograd.Function`` that computes its derivative in the forward
  (the backward is one multiply);
* ``op``: ``pyppo.ops.ppo_policy_loss`` / ``ppo_value_loss`` (plain PyTorch, torch's autograd)
  with veRL's conventions around them, as the adapter would have to call them: the same argument
  and mask checks, veRL's ``ppo_kl`` (a mean of the clamped ``old − new``, which the op does not
  report) by ``pyppo.ops.masked_mean``, the loss cast to veRL's dtype, the metrics as Python
  floats. Only the case timed here is wrapped (``token-mean``, no ``rollout_is_weights``): the
  op aggregates internally, so veRL's weights, which multiply the per-token loss before the
  aggregation, cannot be passed to it;
* ``verl`` (when veRL is installed, for scale): veRL 0.9.1's own function.

``loss_agg_mode="token-mean"``, a bool mask of right padding (lengths uniform in ``[T/4, T]``),
``clip_ratio 0.2 / 0.28``, ``clip_ratio_c 3``, ``cliprange_value 0.2``. Timing: the variants of one
case run in interleaved rounds, the order rotated each round (``pyppo.bench.timing``); the table
gives each variant's median and the median over rounds of its ratio to ``adapter`` (> 1: slower
than the adapter). Memory, per variant, one call after the timing (``pyppo.bench.memory``):

* ``peak alloc``: the peak of the running sum of allocations minus frees through torch's CPU
  allocator during the call (``torch.profiler(profile_memory=True)``), outputs and the gradient
  included, inputs not: exact for tensors;
* ``peak rss``: the growth of the process's resident high-water mark over the call (page
  granular, every allocation, ~1 MiB noise);
* ``saved``: bytes of the distinct tensors autograd keeps from the forward for the backward
  (``saved_tensors_hooks``), inputs excluded: what a trainer holds per loss call until
  ``backward()``.

A check first asserts that ``op`` (and, in float32, ``verl``) agrees with ``adapter`` (loss,
metrics, gradient). Quote the numbers with the machine they came from (the script prints
``lscpu``'s model name and the thread count); the machine is shared, so run it when ``uptime``
shows a load below the thread count.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
from types import SimpleNamespace

import torch

import pyppo.integrations.verl as pv
from pyppo.bench.memory import peak_extra_bytes, rss_available
from pyppo.bench.timing import HostClock, measure, paired_ratio
from pyppo.integrations.verl._checks import _acc, _bool_mask, _float_tensor, _mean_dtype, _promote
from pyppo.integrations.verl.torch_functional import _mean_impl
from pyppo.ops import ppo_policy_loss, ppo_value_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
CLIP_LOW, CLIP_HIGH, CLIP_C, CLIP_V = 0.2, 0.28, 3.0, 0.2


class _Config(SimpleNamespace):
    """The fields of veRL's ActorConfig that compute_policy_loss_vanilla reads."""

    def get(self, key, default=None):
        return getattr(self, key, default)


CONFIG = _Config(
    clip_ratio=CLIP_LOW, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C, global_batch_info={}
)


# ----------------------------------------------------------------------------------------------
# pyppo.ops' losses with veRL's conventions around them (token-mean, no rollout weights)


def _checked(fn, names, tensors, response_mask):
    for name, t in zip(names, tensors):
        _float_tensor(fn, name, t)
        if t.shape != tensors[0].shape:
            raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)} but {names[0]} has {tuple(tensors[0].shape)}")
    return _bool_mask(fn, "response_mask", response_mask, tensors[0])


def op_policy_loss_vanilla(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    fn = "compute_policy_loss_vanilla"
    if loss_agg_mode != "token-mean" or rollout_is_weights is not None or config.global_batch_info:
        raise NotImplementedError(f"{fn}: only token-mean without rollout_is_weights is wrapped here")
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    c = config.get("clip_ratio_c", 3.0)
    if not c > 1.0:
        raise AssertionError(f"{fn}: clip_ratio_c must be > 1, got {c}")
    m = _checked(fn, ("log_prob", "old_log_prob", "advantages"), (log_prob, old_log_prob, advantages), response_mask)
    loss_dtype = _promote(old_log_prob.dtype, log_prob.dtype, advantages.dtype)
    acc = _acc(loss_dtype)
    loss, stats = ppo_policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        m,
        cliprange_low=low,
        cliprange_high=high,
        dual_clip=c,
        loss_agg="token-mean",
    )
    with torch.no_grad():
        neg_kl = (log_prob.detach().to(acc) - old_log_prob.to(acc)).clamp(-20.0, 20.0)
        ppo_kl = _mean_impl(-neg_kl, m, None, response_mask.dtype)
        clipfrac, ppo_kl, lower = torch.stack([stats["clipfrac"], ppo_kl.float(), stats["clipfrac_lower"]]).tolist()
    pg_loss = loss.to(_promote(loss_dtype, response_mask.dtype))
    return pg_loss, {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": lower}


def op_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean"):
    fn = "compute_value_loss"
    if loss_agg_mode != "token-mean":
        raise NotImplementedError(f"{fn}: only token-mean is wrapped here")
    m = _checked(fn, ("vpreds", "returns", "values"), (vpreds, returns, values), response_mask)
    loss_dtype = _promote(vpreds.dtype, returns.dtype, values.dtype)
    loss, stats = ppo_value_loss(
        vpreds, values, returns, m, cliprange_value=float(cliprange_value), loss_agg="token-mean"
    )
    vf_clipfrac = stats["vf_clipfrac"].to(_mean_dtype(torch.float32, response_mask.dtype))
    return loss.to(_promote(loss_dtype, response_mask.dtype)), vf_clipfrac


# ----------------------------------------------------------------------------------------------
# cases


def make_inputs(B, T, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def randn(scale=1.0, shift=0.0):
        return torch.randn(B, T, generator=g) * scale + shift

    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = randn(1.0, -2.0)
    new = old + randn(0.1)  # ratios near 1, a few percent of the tokens clipped
    values = randn()
    return SimpleNamespace(
        old=old.to(dtype),
        new=new.to(dtype),
        adv=randn().to(dtype),
        mask=mask,
        values=values.to(dtype),
        vpreds=(values + randn(0.2)).to(dtype),
        returns=randn().to(dtype),
    )


def policy_call(f, config):
    def run(x):
        lp = x.new.detach().requires_grad_(True)
        loss, metrics = f(x.old, lp, x.adv, x.mask, "token-mean", config)
        (grad,) = torch.autograd.grad(loss, lp)
        return loss.detach(), metrics, grad

    return run


def value_call(f):
    def run(x):
        v = x.vpreds.detach().requires_grad_(True)
        loss, clipfrac = f(v, x.returns, x.values, x.mask, CLIP_V, "token-mean")
        (grad,) = torch.autograd.grad(loss, v)
        return loss.detach(), {"vf_clipfrac": float(clipfrac)}, grad

    return run


def saved_bytes(run, x) -> int:
    """Bytes of the distinct non-input tensors autograd saves in ``run``'s forward."""
    inputs = {t.untyped_storage().data_ptr() for t in vars(x).values()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in inputs:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(x)
    return sum(seen.values())


def check_agree(name, ours, ref, dtype):
    (l1, m1, g1), (l2, m2, g2) = ours, ref
    rtol = {torch.float32: 1e-5, torch.float64: 1e-9}.get(dtype, 1e-2)
    torch.testing.assert_close(l1.double(), l2.double(), rtol=rtol, atol=rtol * 1e-2, msg=f"{name}: loss")
    torch.testing.assert_close(
        g1.double(), g2.double(), rtol=rtol, atol=rtol * g2.abs().max().item(), msg=f"{name}: gradient"
    )
    for k in m2:
        assert abs(m1[k] - m2[k]) <= 1e-5 * max(1.0, abs(m2[k])), (name, k, m1[k], m2[k])


def verl_functions():
    try:
        from omegaconf import OmegaConf
        from verl.trainer.ppo import core_algos
    except Exception:  # veRL or its dependencies are absent
        return None
    cfg = OmegaConf.create(
        {
            "clip_ratio": CLIP_LOW,
            "clip_ratio_low": CLIP_LOW,
            "clip_ratio_high": CLIP_HIGH,
            "clip_ratio_c": CLIP_C,
            "global_batch_info": {},
        }
    )
    return core_algos.compute_policy_loss_vanilla, core_algos.compute_value_loss, cfg


def run_case(loss, B, T, dtype_name, args, verl):
    dtype = DTYPES[dtype_name]
    sets = [make_inputs(B, T, dtype, seed) for seed in range(args.sets)]
    if loss == "policy":
        variants = {
            "adapter": policy_call(pv.compute_policy_loss_vanilla, CONFIG),
            "op": policy_call(op_policy_loss_vanilla, CONFIG),
        }
        if verl:
            variants["verl"] = policy_call(verl[0], verl[2])
    else:
        variants = {"adapter": value_call(pv.compute_value_loss), "op": value_call(op_value_loss)}
        if verl:
            variants["verl"] = value_call(verl[1])
    ref = variants["adapter"](sets[0])
    for name, run in variants.items():
        # veRL computes bf16/fp16 in the input dtype: only its float32/float64 results are compared.
        if name == "op" or (name == "verl" and dtype in (torch.float32, torch.float64)):
            check_agree(f"{loss} {name}", run(sets[0]), ref, dtype)
    del ref
    times = measure(
        variants,
        sets,
        HostClock(),
        warmup=args.warmup,
        min_reps=args.min_reps,
        max_reps=args.max_reps,
        budget_s=args.budget,
    )
    method = "both" if rss_available() else "alloc"
    rows = []
    for name, run in variants.items():
        gc.collect()
        mem = peak_extra_bytes(run, sets[0], torch.device("cpu"), method)
        rows.append(
            {
                "loss": loss,
                "B": B,
                "T": T,
                "dtype": dtype_name,
                "variant": name,
                "rounds": len(times[name]),
                "median_ms": statistics.median(times[name]) * 1e3,
                "ratio_to_adapter": paired_ratio(times[name], times["adapter"]),
                "peak_alloc_bytes": mem.get("alloc"),
                "peak_rss_bytes": mem.get("rss"),
                "saved_bytes": saved_bytes(run, sets[0]),
            }
        )
    return rows


def _mib(b) -> str:
    return "–" if b is None else f"{b / 2**20:.1f}"


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        names = [ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")]
        info["cpu"] = names[0] if names else "?"
    except (OSError, subprocess.SubprocessError):
        info["cpu"] = platform.processor() or "?"
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["64x1024", "256x2048"], help="BxT ...")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--losses", nargs="+", default=["policy", "value"], choices=["policy", "value"])
    p.add_argument("--budget", type=float, default=8.0, help="seconds of timed rounds per case")
    p.add_argument("--min-reps", type=int, default=11)
    p.add_argument("--max-reps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sets", type=int, default=3, help="input sets rotated between calls")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-verl", action="store_true", help="do not time veRL's own functions")
    p.add_argument("--json", help="also write the rows and the machine to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    verl = None if args.no_verl else verl_functions()
    info = machine()
    print(f"# {info['cpu']}, {info['threads']} threads, torch {info['torch']}{'' if verl else ' (veRL not timed)'}")
    print("| loss | B×T | dtype | variant | median ms | ratio to adapter | peak alloc MiB | peak rss MiB | saved MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in args.shapes:
        B, T = (int(s) for s in shape.lower().split("x"))
        for dtype_name in args.dtypes:
            for loss in args.losses:
                for r in run_case(loss, B, T, dtype_name, args, verl):
                    rows.append(r)
                    print(
                        f"| {loss} | {B}×{T} | {dtype_name} | {r['variant']} | {r['median_ms']:.2f} | "
                        f"{r['ratio_to_adapter']:.2f} | {_mib(r['peak_alloc_bytes'])} | "
                        f"{_mib(r['peak_rss_bytes'])} | {_mib(r['saved_bytes'])} |",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
