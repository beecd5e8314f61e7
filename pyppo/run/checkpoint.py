"""Checkpoints that survive SIGKILL, the trainer's state in them, and RNG capture.

A checkpoint is a directory of ``torch.save`` files (:data:`CHECKPOINT_FILES`). :func:`save` swaps
it in by :func:`pyppo.atomic_dir.swap_in`, so that at every instant a complete checkpoint is at a
known path: ``<name>``, or ``<name>.old`` when a save was killed between its two renames, where
:func:`find` looks too.
"""

from __future__ import annotations

import errno
import glob
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np
import torch

from .. import distributed
from ..atomic_dir import backup_of, swap_in
from ..config import resume_conflicts

if TYPE_CHECKING:
    from ..trainer import PPOTrainer

__all__ = [
    "CHECKPOINT_FILES",
    "PART_FILES",
    "save",
    "find",
    "load",
    "saved_step",
    "saved_world_size",
    "capture_rng",
    "restore_rng",
    "training_state",
    "restore_training_state",
    "save_trainer",
    "load_trainer",
    "load_trained_policy",
    "load_trained_value_model",
    "find_in_run",
]

CHECKPOINT_FILES = ("policy.pt", "value_model.pt", "optimizers.pt", "trainer_state.pt")


def _is_complete(d: Path) -> bool:
    return d.is_dir() and all((d / name).is_file() for name in CHECKPOINT_FILES)


#: Free bytes below which a failed write of ``torch.save``'s zip writer is taken for a full disk:
#: it reports one as a ``RuntimeError`` about its position or a failed write, not as ``ENOSPC``.
_NEARLY_FULL = 64 << 20
_ZIP_WRITER_ERRORS = ("inline_container", "PytorchStreamWriter")


def _disk_full(path: Path, exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not any(mark in str(exc) for mark in _ZIP_WRITER_ERRORS):
        return False
    try:
        return shutil.disk_usage(path).free < _NEARLY_FULL
    except OSError:
        return False


def _disk_full_error(directory: str | os.PathLike, tmp: Path) -> OSError:
    """The ``ENOSPC`` error :func:`save` raises when the disk filled up while it wrote ``tmp``."""
    written = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
    previous = find(directory)
    then = (
        f"the previous checkpoint ({str(previous)!r}) is kept: free some space (a checkpoint holds the "
        "models and their optimizer state) and resume from it with --resume"
        if previous is not None
        else "there is no earlier checkpoint to resume from: free some space (a checkpoint holds the "
        "models and their optimizer state) and start the run again"
    )
    return OSError(
        errno.ENOSPC,
        f"no space left on the disk of {str(directory)!r} while saving the checkpoint "
        f"({written / 2**30:.2f} GiB written, {shutil.disk_usage(tmp).free / 2**20:.0f} MiB free); "
        f"the partial checkpoint is removed, and {then}",
    )


def save(directory: str | os.PathLike, payloads: Dict[str, Any]) -> Path:
    """Write ``payloads`` (file name -> object for ``torch.save``) as the checkpoint ``directory``,
    swapped in atomically (see the module docstring). Returns the directory.

    Raises:
        OSError: ``ENOSPC`` when the disk filled up while writing (an ``OSError`` of ``ENOSPC`` or
            ``EDQUOT``, or the zip writer's error with less than 64 MiB left), saying so and what to
            do; the partial write is removed and the previous checkpoint stays where it was. Any
            other error of the writes or renames as it is, with the same guarantee.
    """

    def write(tmp: Path) -> None:
        for name, obj in payloads.items():
            try:
                with open(tmp / name, "wb") as f:
                    torch.save(obj, f)
                    f.flush()
                    os.fsync(f.fileno())
            except (OSError, RuntimeError) as exc:
                if not _disk_full(tmp, exc):
                    raise
                raise _disk_full_error(directory, tmp) from exc

    return swap_in(directory, write, _is_complete)


def find(directory: str | os.PathLike) -> Optional[Path]:
    """The complete checkpoint to resume from for ``directory``, or ``None``.

    ``directory`` itself when it holds every file; otherwise the previous checkpoint that an
    interrupted :func:`save` left at ``<directory>.old`` (or ``<directory>.old-*``, as older
    versions named it), when that one is complete.
    """
    target = Path(directory)
    if _is_complete(target):
        return target
    for cand in [backup_of(target)] + sorted(target.parent.glob(f"{glob.escape(target.name)}.old-*"), reverse=True):
        if _is_complete(cand):
            return cand
    return None


def load(directory: str | os.PathLike, map_location) -> tuple[Path, Dict[str, Any]]:
    """Read every file of the checkpoint :func:`find` picks for ``directory``.

    Everything is read before anything is returned, so a caller that restores only after this
    returns leaves its state untouched by a failed load. ``trainer_state.pt`` is mapped to CPU.

    Returns:
        ``(the directory actually read, {file name: object})``.

    Raises:
        FileNotFoundError: no complete checkpoint (the message names the missing files).
        ValueError: a file cannot be read (truncated or corrupt); the message names it.
    """
    requested = Path(directory)
    d = find(requested)
    if d is None:
        missing = [str(requested / n) for n in CHECKPOINT_FILES if not (requested / n).is_file()]
        raise FileNotFoundError(f"checkpoint file missing: {', '.join(missing)}")
    if d != requested:
        warnings.warn(
            f"checkpoint {str(requested)!r} is missing or incomplete (a save was interrupted); "
            f"resuming from the previous checkpoint {str(d)!r}",
            RuntimeWarning,
            stacklevel=3,
        )
    out = {}
    for name in CHECKPOINT_FILES:
        try:
            out[name] = torch.load(
                d / name, map_location="cpu" if name == "trainer_state.pt" else map_location, weights_only=True
            )
        except Exception as exc:
            raise ValueError(f"checkpoint file {str(d / name)!r} cannot be read: {exc}") from exc
    return d, out


def saved_step(directory: str | os.PathLike) -> int:
    """The step counter stored in a checkpoint directory."""
    return int(torch.load(Path(directory) / "trainer_state.pt", map_location="cpu", weights_only=True)["step"])


def saved_world_size(directory: str | os.PathLike) -> int:
    """The number of processes that wrote a checkpoint directory (1 for one written before that
    was recorded)."""
    state = torch.load(Path(directory) / "trainer_state.pt", map_location="cpu", weights_only=True)
    return int(state.get("world_size", 1))


def capture_rng() -> Dict[str, Any]:
    """torch (CPU and every CUDA device), numpy and python RNG states, as ``weights_only`` values."""
    np_state = np.random.get_state()
    state = {
        "rng_torch": torch.get_rng_state(),
        # numpy's state as plain python values, so that the file loads with weights_only=True.
        "rng_numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "rng_python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    """Undo :func:`capture_rng`."""
    torch.set_rng_state(state["rng_torch"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    kind, keys, pos, has_gauss, cached = state["rng_numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    py = state["rng_python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


# ---------------------------------------------------------------------------------------------
# what a checkpoint holds of a model: its trained weights and its optimizer's state
# ---------------------------------------------------------------------------------------------
def _trained_names(module: torch.nn.Module) -> List[str]:
    return [name for name, p in module.named_parameters() if p.requires_grad]


def training_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, prefix: str = "") -> tuple[dict, dict]:
    """``(weights, optimizer state)`` of what trains in ``module`` (a plain, DDP- or
    FSDP2-wrapped module): every parameter with ``requires_grad`` (all of a full fine-tune, only
    the adapters and heads with LoRA; frozen weights are rebuilt from the initial model). Weight
    names lose ``prefix`` (``"model."`` of a :class:`~pyppo.trainer.logprob_head.LogprobHead`), so they are the
    model's own. Under FSDP2 this is a collective and only rank 0 gets the full tensors."""
    inner = distributed.unwrap(module)
    names = _trained_names(inner)
    if distributed.is_sharded(inner):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(inner, options=options)
        return (
            {n[len(prefix) :]: full[n] for n in names if n in full},
            get_optimizer_state_dict(inner, optimizer, options=options),
        )
    params = dict(inner.named_parameters())
    return {n[len(prefix) :]: params[n].detach() for n in names}, optimizer.state_dict()


def restore_training_state(
    module: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    weights: dict,
    optimizer_state: Optional[dict],
    *,
    prefix: str = "",
    what: str = "model",
) -> None:
    """Undo :func:`training_state` (a checkpoint of the previous format, with every weight, loads
    too). Both are checked before anything is changed. ``optimizer=None``: the weights only.

    Raises:
        ValueError: ``weights`` lacks a trained weight or has one ``module`` does not know (a LoRA
            checkpoint into a full fine-tune, or the reverse), naming a few of them.
    """
    inner = distributed.unwrap(module)
    known = {k[len(prefix) :] for k in inner.state_dict() if k.startswith(prefix)}
    missing = sorted(set(n[len(prefix) :] for n in _trained_names(inner)) - set(weights))
    unknown = sorted(set(weights) - known)
    shapes = {n[len(prefix) :]: tuple(p.shape) for n, p in inner.named_parameters()}
    resized = sorted(
        n for n, w in weights.items() if n in shapes and shapes[n] and tuple(w.shape) != shapes[n]
    )  # FSDP2 shards: () skipped
    if missing or unknown or resized:
        detail = "; ".join(
            f"{label} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (("lacks", missing), ("has unknown", unknown), ("has other shapes for", resized))
            if names
        )
        raise ValueError(
            f"the checkpoint's {what} weights do not match this run's trained weights: {detail} "
            "(was it written with other lora_rank / value_lora settings?)"
        )
    weights = {prefix + k: v for k, v in weights.items()}
    if distributed.is_sharded(inner):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(inner, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        if optimizer is not None:
            set_optimizer_state_dict(inner, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))
        return
    inner.load_state_dict(weights, strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)


#: The checkpoint file of each of :meth:`~pyppo.trainer.PPOTrainer.checkpoint_parts`.
PART_FILES = {"policy": "policy.pt", "value": "value_model.pt"}


def save_trainer(trainer: PPOTrainer, directory: str | os.PathLike) -> Optional[Path]:
    """Write everything needed to resume exactly, swapped in atomically (SIGKILL-safe:
    :func:`save`): the trained weights of each of ``trainer.checkpoint_parts()`` (every weight, or
    only the LoRA adapters and the value head; a critic-free run's ``value_model.pt`` is empty),
    their AdamW states, and the trainer state (step, KL controller, prompt position, shuffle
    generator, every rank's RNGs, skip counters, config). The warm-up's learning rate is a
    function of the applied optimizer steps, which are saved. Every rank calls it; rank 0 writes
    and gets the directory, the others ``None``."""
    weights, optimizers = {}, {}
    for name, part in trainer.checkpoint_parts().items():
        weights[PART_FILES[name]], optimizers[name] = (
            training_state(part.module, part.optimizer, prefix=part.prefix) if part is not None else ({}, None)
        )
    rngs = distributed.gather_objects(capture_rng(), trainer.world)
    saved = None
    if trainer.world.is_main:
        state = {
            "format": 2,
            **trainer.state_dict(),
            **rngs[0],
            "world_size": trainer.world.size,
            "rank_rng": rngs,
            "config": trainer.config.to_dict(),
        }
        saved = save(directory, {**weights, "optimizers.pt": optimizers, "trainer_state.pt": state})
    distributed.barrier(trainer.world)
    return saved


def load_trainer(trainer: PPOTrainer, directory: str | os.PathLike) -> Path:
    """Restore a checkpoint written by :func:`save_trainer` into ``trainer``, so that the next step is the
    one the saving run would have taken. A checkpoint left half-swapped by a killed save is
    recovered from ``<directory>.old``, with a warning. Every file is read before anything is
    restored. The reference and the frozen base weights are not in the checkpoint: build the
    trainer from the same initial policy. Every rank calls it.

    Returns:
        the directory actually loaded.

    Raises:
        FileNotFoundError: no complete checkpoint (naming the missing files).
        ValueError: a corrupt file; a different KL controller type or prompt count; weights that
            do not match the trained ones (e.g. a LoRA checkpoint into a full fine-tune); a
            checkpoint with a value model into a critic-free run or the reverse; or a checkpoint
            of another number of processes.
    """
    d, files = load(directory, trainer.device)
    st = files["trainer_state.pt"]
    saved_n = int(st.get("world_size", 1))
    if saved_n != trainer.world.size:
        raise ValueError(
            f"checkpoint {str(d)!r} was written by {saved_n} process(es), this run has "
            f"{trainer.world.size}; resume with torchrun --nproc-per-node {saved_n}"
        )
    parts = trainer.checkpoint_parts()
    if (parts["value"] is None) != (not files["value_model.pt"]):
        has, run = ("no", "trains one") if parts["value"] is not None else ("a", "trains none")
        raise ValueError(
            f"checkpoint {str(d)!r} has {has} value model, and this run (advantage_estimator = "
            f"{trainer.config.advantage_estimator!r}) {run}: resume with the checkpoint's estimator"
        )
    resume_conflicts(st.get("config"), trainer.config, where=f"checkpoint {str(d)!r}")
    # Checked before anything is restored: the sampler's own check comes after the weights.
    saved_prompts, prompts = int(st["sampler"]["n"]), len(trainer.sampler.prompts)
    if saved_prompts != prompts:
        raise ValueError(
            f"checkpoint {str(d)!r} was written by a run of {saved_prompts} prompts, this run has {prompts}; "
            "resume with the checkpoint's prompts"
        )
    for name, part in parts.items():
        if part is not None:
            restore_training_state(
                part.module,
                part.optimizer,
                files[PART_FILES[name]],
                files["optimizers.pt"][name],
                prefix=part.prefix,
                what="policy" if name == "policy" else "value model",
            )
    trainer.load_state_dict(st)
    restore_rng(st["rank_rng"][trainer.world.rank] if "rank_rng" in st else st)
    trainer.resumed_step = trainer.step_count
    trainer.weights_loaded()
    return d


def load_trained_policy(trainer: PPOTrainer, directory: str | os.PathLike) -> Path:
    """Put the policy's trained weights of a checkpoint (:func:`find` picks it) into ``trainer``,
    and nothing else (no optimizer, RNG or step): what writing a run's ``policy/`` from its
    checkpoint needs. The full weights are in the checkpoint whatever number of processes wrote
    it, so any number may read them.

    Returns:
        the directory read.

    Raises:
        FileNotFoundError: no complete checkpoint.
        ValueError: ``policy.pt`` cannot be read, or its weights are not this policy's trained ones.
    """
    d = find(directory)
    if d is None:
        raise FileNotFoundError(f"no complete checkpoint at {str(directory)!r}")
    try:
        weights = torch.load(d / "policy.pt", map_location=trainer.device, weights_only=True)
    except Exception as exc:
        raise ValueError(f"checkpoint file {str(d / 'policy.pt')!r} cannot be read: {exc}") from exc
    policy = trainer.checkpoint_parts()["policy"]
    restore_training_state(policy.module, None, weights, None, prefix=policy.prefix, what="policy")
    return d


def find_in_run(directory: str | os.PathLike) -> Optional[Path]:
    """The complete checkpoint of ``directory``: a run directory (its ``checkpoint/``) or a
    checkpoint directory itself, as :func:`find` picks it; ``None`` if neither holds one."""
    d = Path(directory).expanduser()
    return find(d / "checkpoint") or find(d)


def load_trained_value_model(trainer: PPOTrainer, directory: str | os.PathLike) -> Path:
    """Start ``trainer``'s value model from an earlier run's: put the trained value weights of the
    checkpoint in ``directory`` (a run directory or its ``checkpoint/``) into it, and nothing else
    (the policy, the optimizers, the step and the RNGs stay this run's). This is the warm start of
    a critic trained before (``pyppo train --value-model DIR``; docs/trainer.md, "Value warm-up").
    The checkpoint holds the trained weights only (every weight, or with ``value_lora`` the
    adapters and the head), so the earlier run must have built its value model the same way:
    from the same ``--model``, with the same ``lora_*`` / ``value_lora`` settings. Any number of
    processes may read a checkpoint of any other. Every rank calls it, before the first step.

    Returns:
        the checkpoint directory read.

    Raises:
        ValueError: this run trains no value model (a critic-free estimator); it has taken a step
            already; the checkpoint has no value model (its run was critic-free), cannot be read,
            or its weights are not this value model's trained ones (other ``lora_*`` /
            ``value_lora`` settings, another model's shapes).
        FileNotFoundError: no complete checkpoint in ``directory``.
    """
    value = trainer.checkpoint_parts()["value"]
    if value is None:
        raise ValueError(
            f"value_model {str(directory)!r}: this run trains no value model (advantage_estimator = "
            f"{trainer.config.advantage_estimator!r}); a warm start needs gae or gae_turn"
        )
    if trainer.step_count:
        raise ValueError(
            f"value_model {str(directory)!r}: the run has taken {trainer.step_count} step(s); a value model "
            "is warm-started before the first step"
        )
    d = find_in_run(directory)
    if d is None:
        raise FileNotFoundError(
            f"value_model {str(directory)!r}: no complete checkpoint in it or in its checkpoint/ "
            "(a pyppo run directory, or its checkpoint/)"
        )
    try:
        weights = torch.load(d / PART_FILES["value"], map_location=trainer.device, weights_only=True)
    except Exception as exc:
        raise ValueError(f"checkpoint file {str(d / PART_FILES['value'])!r} cannot be read: {exc}") from exc
    if not weights:
        raise ValueError(
            f"value_model {str(directory)!r}: checkpoint {str(d)!r} has no value model (its run used a "
            "critic-free estimator)"
        )
    try:
        restore_training_state(value.module, None, weights, None, prefix=value.prefix, what="value model")
    except ValueError as exc:  # say which warm start it was
        raise ValueError(f"value_model {str(directory)!r}: {exc}") from None
    return d
