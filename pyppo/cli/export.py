"""Write a run's policy/ again from its checkpoint: pyppo export DIR.

pyppo train writes policy/ with its periodic and final checkpoints (not with the one a stop
writes). When that write failed after the checkpoint was saved (a full disk, say), for a stopped
run, or to have the other form of a LoRA policy (--no-merge-lora: the adapter alone;
--merge-lora: the merged model), this writes it from the run's checkpoint/ and config.toml: the
policy is built from the run's model with the run's settings, the checkpoint's trained policy
weights are loaded into it, and policy/ is swapped in atomically, as pyppo train writes it. A
checkpoint written by several processes is read in one. With a new merge setting the run's
config.toml is updated to match what policy/ holds.

Nothing but the model is loaded: the run's reward, prompts and environment are not needed. A run
started from Python with a model built in memory has no model named in its config.toml: give the
base model it started from with --model.
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
        "--model",
        default=None,
        metavar="NAME|DIR|FILE.gguf",
        help="the base model the checkpoint's trained weights go onto, for a run whose config.toml names "
        "none (one started from Python with a model built in memory); default: the run's model",
    )
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
    from .. import models
    from ..run.checkpoint import load_trained_policy
    from ..run.quiet import quiet_libraries
    from ..run.rundir import RunDir
    from ..run.trainer import PPOTrainer
    from ..trainer.assemble import EPISODE_KNOBS
    from .flags import make_config

    run_dir = RunDir(Path(args.run_dir).expanduser())
    found = _checked_run_dir(run_dir, args.run_dir)
    sources, knobs = _recorded_settings(run_dir)
    model = _base_model(args, sources.get("model"))
    models.resolve_model_source(model)  # a missing model is said before anything loads
    flags = {} if args.merge_lora is None else {"merge_lora": args.merge_lora}
    trained = make_config({**knobs, **flags}, flags)
    # One process on `--device`, sampling with transformers (the vLLM knobs go with vLLM), no
    # evaluation and no episodes: building the policy as the run built it needs no more, and so
    # no prompts, reward or environment of the run.
    defaults = type(trained).__dataclass_fields__
    config = trained.with_changes(
        device=args.device,
        fsdp=False,
        rollout_engine="transformers",
        eval_every=0,
        **{key: defaults[key].default for key in EPISODE_KNOBS},
    )
    print(
        f"{PROG}: writing {run_dir.policy} from the checkpoint of step {run_dir.checkpoint_step()} ...", file=sys.stderr
    )
    policy, tokenizer = models.load_model_and_tokenizer(model)
    trainer = PPOTrainer(config, policy, None, None, tokenizer, _no_reward, ["-"], base_model_source=model)
    load_trained_policy(trainer, found)
    with quiet_libraries():  # DeepSpeed's CPU warning and transformers' shard bar (save_pretrained)
        trainer.export_policy(run_dir.policy)
    trainer.close()
    if trained.merge_lora != knobs.get("merge_lora", True):
        _rewrite_config(run_dir, sources, trained)  # config.toml says what policy/ holds
    print(f"pyppo: policy written to {run_dir.policy}")
    return 0


def _no_reward(prompts, responses):
    """The trainer's reward: the export samples nothing, so nothing is scored."""
    return [0.0] * len(responses)


def _checked_run_dir(run_dir, given: str) -> Path:
    """The complete checkpoint of the run directory ``run_dir`` (``given`` as the user wrote it).

    Raises:
        CLIError: no such directory, no config.toml or checkpoint/ in it (not a pyppo run
            directory), or a run with no complete checkpoint yet.
    """
    from ..run.checkpoint import find

    if not run_dir.path.is_dir():
        raise CLIError(f"{given!r}: no such directory")
    found = run_dir.find_checkpoint()
    if not run_dir.config.is_file():
        missing = "config.toml" if found is not None else "config.toml or checkpoint/"
        # The checkpoint itself is a likely mistake for the run that holds it.
        hint = "the run directory holding it" if find(run_dir.path) is not None else "the directory"
        raise CLIError(
            f"{given!r} is not a pyppo run directory (no {missing} in it); "
            f"pass {hint}, which pyppo train or PPOTrainer.train wrote"
        )
    if found is None:
        raise CLIError(f"{given!r}: the run has no complete checkpoint/ to export yet")
    return found


def _recorded_settings(run_dir) -> tuple:
    """``(sources, knobs)`` of the run's config.toml: the model, reward, ... it names, and its
    PPOConfig settings (``"none"`` read back as None).

    Raises:
        CLIError: the file is not valid TOML or has an unknown key or a bad value, naming it.
    """
    from .run_file import RUN_KEYS, check_keys, read_toml

    table = check_keys(read_toml(run_dir.config, "config.toml"), str(run_dir.config))
    sources = {key: table.pop(key) for key in RUN_KEYS if key in table}
    return sources, table


def _base_model(args: argparse.Namespace, recorded) -> str:
    """The model the policy is built from: the run's, else ``--model`` (absolute when a path).

    Raises:
        CLIError: neither is there (saying to pass ``--model``), or ``--model`` is not the run's.
    """
    from .run_file import same_source

    if args.model is None and recorded is None:
        raise CLIError(
            f"{args.run_dir!r}: the run's config.toml names no model (a run started from Python with a model "
            "built in memory); pass --model NAME|DIR|FILE.gguf: the base model it started from, which the "
            "checkpoint's trained weights go onto (no reward is needed)"
        )
    if args.model is not None and recorded is not None and not same_source(args.model, recorded):
        raise CLIError(
            f"--model {args.model!r}: the run's checkpoint was trained from its model {recorded!r} "
            "(its config.toml); leave --model out, it is for a run whose config.toml names none"
        )
    model = recorded if args.model is None else args.model
    path = Path(model).expanduser()
    # An exported adapter names this as its base: absolute, found from anywhere.
    return str(path.resolve()) if path.exists() else model


def _rewrite_config(run_dir, sources: dict, config) -> None:
    """Write the run's config.toml again with ``config``'s settings and its own sources; a Python
    run's keeps its header, so that pyppo train --resume still asks for what it does not name."""
    from ..run.config_file import write_config, written_from_python

    header = {}
    if written_from_python(run_dir.config):
        header["header"] = run_dir.config.read_text(encoding="utf-8").splitlines()[0]
    write_config(run_dir.config, sources, config, **header)
