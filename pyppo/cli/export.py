"""Write a run's policy/ again from its checkpoint: pyppo export DIR.

``pyppo train`` writes ``policy/`` with its periodic and final checkpoints (not with the one a
stop writes). When that write failed after the checkpoint was saved (a full disk, say), for a
stopped run, or to have the other form of a LoRA policy
(``--no-merge-lora``: the adapter alone; ``--merge-lora``: the merged model), this writes it from
the run's ``checkpoint/`` and ``config.toml``: the policy is built as the run built it, the
checkpoint's trained policy weights are loaded into it, and ``policy/`` is swapped in atomically,
as ``pyppo train`` writes it. A checkpoint written by several processes is read in one. With a
new merge setting the run's ``config.toml`` is updated to match what ``policy/`` holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .flags import PROG, CLIError

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="DIR", help="a pyppo run directory (its config.toml and checkpoint/)")
    p.add_argument(
        "--merge-lora",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with LoRA: write the merged model, or the adapter alone (default: the run's merge_lora)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help="where the policy is built for the export (default: cpu; the run's own device is not needed)",
    )


def run(args: argparse.Namespace) -> int:
    from ..run.checkpoint import load_trained_policy, saved_world_size
    from ..run.rundir import RunDir
    from .build import build_trainer
    from .train import resolve_train_config, write_resolved_config

    run_dir = RunDir(Path(args.run_dir).expanduser())
    found = run_dir.find_checkpoint() if run_dir.path.is_dir() else None
    if found is None:
        reason = "no such directory" if not run_dir.path.is_dir() else "it has no checkpoint/ to export"
        raise CLIError(f"{args.run_dir!r}: {reason}")
    flags = {} if args.merge_lora is None else {"merge_lora": args.merge_lora}
    resume = argparse.Namespace(
        resume=str(run_dir.path),
        config=None,
        output=None,
        model=None,
        reward=None,
        prompts=None,
        eval_prompts=None,
        env=None,
        **flags,
    )
    # The run's settings, checked as they were trained (with as many processes as wrote it).
    plan = resolve_train_config(resume, world_size=saved_world_size(found))
    sources, trained, step = plan.run, plan.config, plan.resume_step
    # One process on `--device`, sampling with transformers (the vLLM knobs go with vLLM): the
    # export needs no more.
    config = trained.with_changes(device=args.device, fsdp=False, rollout_engine="transformers")
    print(f"{PROG}: writing {run_dir.policy} from the checkpoint of step {step} ...", file=sys.stderr)
    from ..run.quiet import quiet_libraries

    trainer = build_trainer(config, **sources)
    load_trained_policy(trainer, found)
    with quiet_libraries():  # DeepSpeed's CPU warning and transformers' shard bar (save_pretrained)
        trainer.export_policy(run_dir.policy)
    trainer.close()
    if trained.merge_lora != _recorded_merge_lora(run_dir):
        write_resolved_config(run_dir.config, sources, trained)  # config.toml says what policy/ holds
    print(f"pyppo: policy written to {run_dir.policy}")
    return 0


def _recorded_merge_lora(run_dir) -> bool:
    """The ``merge_lora`` of the run's config.toml (the default, true, when it has none)."""
    from .train import _read_toml

    return bool(_read_toml(run_dir.config, "config.toml").get("merge_lora", True))
