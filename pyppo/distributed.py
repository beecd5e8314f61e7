"""Several processes (``torchrun``): which one this is, how the models are wrapped, and the few
collectives a PPO step needs so that N processes compute what one would on the same global batch.

Each rank samples its share of the global batch. What must be global is reduced here: the
advantage-whitening moments, the loss normaliser (valid tokens of the whole minibatch), the
explained variance, the KL fed to the controller and the logged metrics. Gradients are averaged
by DDP, or sharded by FSDP2 (``fully_shard``); both come from ``torch.distributed``. With one
process every function here is the identity, and the trainer runs exactly as it does without
``torch.distributed``. ``docs/trainer.md`` ("Several processes") describes the contract.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping

import torch
from torch import nn

from .ops import masked_whiten

__all__ = [
    "World",
    "local_device",
    "join",
    "wrap",
    "unwrap",
    "is_sharded",
    "gradient_sync",
    "full_state_dict",
    "resolve_device",
    "all_sum",
    "reduce_metrics",
    "whiten",
    "explained_variance",
    "barrier",
    "leave",
    "gather_objects",
    "on_every_rank",
    "raised_on_every_rank",
    "mark_on_every_rank",
    "lost_a_peer",
]


@dataclass(frozen=True)
class World:
    """This process's place among ``size`` processes; ``device`` is where its models run and
    where collectives put their tensors (NCCL needs CUDA tensors, gloo CPU ones)."""

    rank: int
    size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes logs, samples, curves, exports and checkpoints."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1


def resolve_device(device: str) -> torch.device:
    """``torch.device`` for a config ``device`` value (``auto`` = CUDA when available).

    Raises:
        ValueError: a CUDA device is asked for and none is available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is available (torch {torch.__version__})")
    return dev


def local_device(device: str) -> torch.device:
    """``device`` resolved for this process: under torchrun a CUDA device is ``cuda:LOCAL_RANK``
    (one GPU per rank).

    Raises:
        ValueError: a CUDA device is asked for and none is available.
    """
    device_ = resolve_device(device)
    if device_.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device_


def join(device: str) -> World:
    """The :class:`World` of this process, joining torchrun's process group when there is one.

    Under ``torchrun`` (``WORLD_SIZE > 1``) the process group is initialised here unless the caller
    already did: NCCL when ``device`` resolves to CUDA (each rank on ``cuda:LOCAL_RANK``), gloo on
    CPU. Otherwise this is a single process on ``device``.

    Raises:
        ValueError: ``device`` names a CUDA device that does not exist, or a process group of
            another backend than the device needs is already initialised.
    """
    import torch.distributed as dist

    device_ = local_device(device)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_available() or (size <= 1 and not dist.is_initialized()):
        return World(0, 1, device_)
    if device_.type == "cuda":
        torch.cuda.set_device(device_)
    backend = "nccl" if device_.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    elif dist.get_backend() != backend:
        raise ValueError(
            f"device {device!r} needs the {backend} backend, but the process group uses {dist.get_backend()}"
        )
    return World(dist.get_rank(), dist.get_world_size(), device_)


# ---------------------------------------------------------------------------------------------
# wrapping
# ---------------------------------------------------------------------------------------------
def _block_classes(module: nn.Module) -> set:
    # transformers lists the classes that must stay whole on one device: the decoder blocks.
    names = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def wrap(module: nn.Module, world: World, *, fsdp: bool) -> nn.Module:
    """``module`` ready for data-parallel training: itself with one process; with several,
    ``DistributedDataParallel`` or, with ``fsdp``, FSDP2 applied to every transformer block and
    then to ``module`` (``fully_shard``, in place). The trainer calls the returned module for every
    forward, rollout and training alike, so both run the same computation.

    Raises:
        ValueError: ``fsdp`` and no transformer block classes to shard were found.
    """
    if not world.active:
        return module
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        blocks = _block_classes(module)
        layers = [m for m in module.modules() if type(m).__name__ in blocks]
        if not layers:
            raise ValueError(
                f"fsdp: no transformer blocks to shard in {type(module).__name__} "
                "(its model lists no _no_split_modules)"
            )
        for layer in layers:
            fully_shard(layer)
        fully_shard(module)
        return module
    from torch.nn.parallel import DistributedDataParallel

    # Every rank built the same weights from the same seed; DDP still broadcasts rank 0's.
    return DistributedDataParallel(module, device_ids=[world.device] if world.device.type == "cuda" else None)


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 shards in place, so that module is itself)."""
    return getattr(module, "module", module) if type(module).__name__ == "DistributedDataParallel" else module


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) of a micro-batch that is not
    the last of its minibatch; the last one reduces the accumulated gradient once."""
    if enabled:
        yield
    elif type(module).__name__ == "DistributedDataParallel":
        with module.no_sync():
            yield
    elif is_sharded(module):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def full_state_dict(module: nn.Module, *, prefix: str = "") -> Dict[str, torch.Tensor]:
    """Every weight of an FSDP2-sharded ``module``, whole and on the CPU, on rank 0 (an empty dict
    elsewhere); a collective. Names lose ``prefix``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}


# ---------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------
def all_sum(values: List[float], world: World) -> List[float]:
    """Sum each number over the ranks (float64)."""
    if not world.active:
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return t.tolist()


#: Step metrics that count what each rank saw of its own share: summed over the ranks. Counts
#: that every rank takes of the same global event (``skipped_updates``, ``filter_groups_tries``:
#: decided on reduced values) are the same on every rank and, averaged, stay that count.
SUMMED_METRICS = frozenset({"filter_groups_dropped", "filter_groups_filled", "truncated_masked"})


def _reduction(key: str) -> str:
    if key in SUMMED_METRICS:
        return "sum"
    name = key.removeprefix("first_")
    if name.endswith("_max") or name.startswith("max_") or key.startswith("time_") or key == "step_seconds":
        return "max"  # the slowest rank sets the pace
    if name.endswith("_min"):
        return "min"
    return "mean"


def reduce_metrics(metrics: Mapping[str, float], world: World) -> Dict[str, float]:
    """A step's metrics over all ranks: the counts of :data:`SUMMED_METRICS` summed, maxima
    (``*_max``, ``max_*``, times) as maxima, ``*_min`` as minima, everything else the mean of the
    ranks' values (each rank holds the same number of sequences, so a per-sequence mean of ranks'
    means is the global mean; a mean over tokens or calls is made global where it is computed).
    ``nan`` stays ``nan``; an ``int`` stays an ``int``."""
    if not world.active:
        return dict(metrics)
    import torch.distributed as dist

    keys = sorted(metrics)
    out: Dict[str, float] = {}
    for how, op in (
        ("mean", dist.ReduceOp.SUM),
        ("sum", dist.ReduceOp.SUM),
        ("max", dist.ReduceOp.MAX),
        ("min", dist.ReduceOp.MIN),
    ):
        group = [k for k in keys if _reduction(k) == how]
        if not group:
            continue
        t = torch.tensor([float(metrics[k]) for k in group], dtype=torch.float64, device=world.device)
        dist.all_reduce(t, op=op)
        if how == "mean":
            t /= world.size
        out.update(zip(group, t.tolist()))
    return {
        k: (
            int(out[k])
            if isinstance(metrics[k], int) and not isinstance(metrics[k], bool) and math.isfinite(out[k])
            else out[k]
        )
        for k in metrics
    }


def whiten(x: torch.Tensor, mask: torch.Tensor, world: World) -> torch.Tensor:
    """:func:`pyppo.ops.masked_whiten` with the mean and unbiased variance over every rank's valid
    elements; with one process it is that op. 0 at masked positions.

    Raises:
        ValueError: fewer than 2 valid elements over all ranks.
    """
    if not world.active:
        return masked_whiten(x, mask)
    m = mask.bool()
    xd = torch.where(m, x.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    n, s = all_sum([int(m.sum()), float(xd.sum())], world)
    if n < 2:
        raise ValueError(f"whitening needs at least 2 valid elements over all ranks, got {int(n)}")
    mean = s / n
    (sq,) = all_sum([float(torch.where(m, (xd - mean) ** 2, torch.zeros_like(xd)).sum())], world)
    var = sq / (n - 1)
    out = (xd - mean) / math.sqrt(var + 1e-8)
    return torch.where(m, out, torch.zeros_like(out)).to(torch.float32)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, world: World) -> float:
    """``1 - Var[R - V] / Var[R]`` over every rank's valid tokens (0 when ``Var[R] = 0``), the
    same quantity as :func:`pyppo.ops.losses.explained_variance`."""
    from .ops.losses import explained_variance as local

    if not world.active:
        return float(local(values, returns, mask))
    m = mask.bool()
    r, d = returns.double()[m], (returns.double() - values.double())[m]
    n, sr, sr2, sd, sd2 = all_sum([r.numel(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()], world)
    ss_r, ss_d = sr2 - sr * sr / n if n else 0.0, sd2 - sd * sd / n if n else 0.0
    return 0.0 if ss_r <= 0 else 1.0 - ss_d / ss_r


def barrier(world: World) -> None:
    """Wait for every rank (e.g. until rank 0 has written a checkpoint)."""
    if world.active:
        import torch.distributed as dist

        dist.barrier()


def leave(world: World) -> None:
    """Wait for every rank, then destroy the process group. Call it once the DDP/FSDP-wrapped
    models are gone: torn down after the group, a rank's reducer can block at exit."""
    if world.active:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def gather_objects(obj: Any, world: World) -> List[Any]:
    """Every rank's ``obj``, in rank order, on every rank (pickled; for small things: RNG
    states, sample texts)."""
    if not world.active:
        return [obj]
    import torch.distributed as dist

    out: List[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
# Set on an exception that every rank raised at the same point of the run, so that the ranks can
# still act together (checkpoint the last finished step) and rank 0 alone need report it.
_EVERY_RANK = "_pyppo_on_every_rank"


def mark_on_every_rank(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised by every rank at the same point (see :func:`raised_on_every_rank`);
    returns it."""
    setattr(exc, _EVERY_RANK, True)
    return exc


def raised_on_every_rank(exc: BaseException) -> bool:
    """Whether every rank raised ``exc`` (or its copy) at the same point, as :func:`on_every_rank`
    marks its errors. (In a single process every error is, trivially; this tells only the marked.)"""
    return bool(getattr(exc, _EVERY_RANK, False))


def on_every_rank(fn, world: World, *args, **kwargs):
    """``fn(*args, **kwargs)`` on this rank, raising on every rank when it raises on any: a
    collective (one ``all_gather_object`` of ``None`` or the error's class and message), so every
    rank must call it at the same point. With one process it is ``fn(...)``.

    A rank where ``fn`` raised re-raises its own exception; the others raise one of the same class
    (``RuntimeError`` when that class cannot be built from a message) whose message is the failing
    rank's, followed by ``(on process R of N)``; the lowest failing rank's error is the one raised.
    Every one is marked (:func:`raised_on_every_rank`).

    Returns:
        what ``fn`` returned.
    """
    if not world.active:
        return fn(*args, **kwargs)
    error, out = None, None
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:
        error = exc
    failures = gather_objects(None if error is None else (type(error), str(error)), world)
    failed = [(rank, f) for rank, f in enumerate(failures) if f is not None]
    if not failed:
        return out
    rank, (cls, message) = failed[0]
    if error is not None and rank == world.rank:
        raise mark_on_every_rank(error)
    message = f"{message} (on process {rank} of {world.size})"
    try:
        copy = cls(message)
    except Exception:  # a class that is not built from one message
        copy = RuntimeError(message)
    raise mark_on_every_rank(copy) from error


# What gloo, NCCL and the TCP store say when another process of the group went away.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker",
    "NCCL communicator was aborted",
    "Socket Timeout",
)


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure because another process of the group stopped
    (gloo's "Connection closed by peer", a ``torch.distributed.DistNetworkError``), not an error of
    this process's own."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistNetworkError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _PEER_GONE)
