"""The ``pyppo`` command line (``pyppo ...`` or ``python -m pyppo ...``).

Subcommands:

* ``pyppo train``: PPO on a causal LM. With no arguments it runs the embedded default
  (SmolLM2-135M-Instruct, VADER sentiment reward, built-in prompts). Settings come from, in
  increasing priority: the trainer's defaults, the ``config.toml`` of ``--resume DIR``, ``--config
  FILE.toml``, then the flags. The resolved settings are written to ``<output>/config.toml`` before
  training starts, so every run can be reproduced or resumed from its own directory.
* ``pyppo info``: versions and build flags of the installed pyppo.
* ``pyppo bench`` / ``pyppo profile``: registered when the modules :mod:`pyppo.bench` /
  :mod:`pyppo.profile` exist. Such a module provides ``add_arguments(parser)`` and
  ``run(args) -> int | None`` (or, failing that, ``main(argv) -> int | None``, which then receives
  the remaining command-line words).

User errors (a bad flag, a missing file, a bad config key, a reward that raises or returns NaN) end
with one line ``pyppo: error: ...`` and exit status 2; a run stopped by ``max_consecutive_skips``
non-finite updates ends the same way with status 1 (its last good checkpoint kept for
``--resume``). ``PYPPO_DEBUG=1`` shows the traceback instead. All configuration errors are
reported before any model is loaded.

SIGINT and SIGTERM stop a run without losing work (:mod:`pyppo.stopping`): exit status 130 / 143
after a checkpoint of the last finished step, with one line saying how to continue.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

from .output_dir import check_output_dir

__all__ = ["build_parser", "main", "resolve_train_config"]

PROG = "pyppo"

#: Settings of a run that are not PPOConfig fields: where the model, reward and prompts come from.
RUN_KEYS = ("model", "reward", "prompts", "eval_prompts")

#: What `pyppo train` changes from PPOConfig's library defaults: sized so that the embedded
#: default (SmolLM2-135M, sentiment reward) shows its mean score rising within 15 minutes on a
#: 2-core CPU. One epoch of two minibatches: each batch gives two optimizer steps and the second
#: is measured against the policy that sampled it, so PPO stays proximal (a second epoch doubled
#: the update's cost and pushed step 1's approx_kl to 0.9). Smaller batches or shorter responses
#: let the sentiment score's step-to-step noise (VADER on 16-token responses) hide the trend.
TRAIN_DEFAULTS = {
    "steps": 20,
    "batch_size": 32,
    "mini_batch_size": 16,
    "ppo_epochs": 1,
    "max_new_tokens": 16,
    "lr": 7e-5,
    "kl_coef": 0.06,
    # A checkpoint (~3.2 GB: two fp32 models and their Adam moments) every 10 steps, so that an
    # interrupted run loses at most 10 steps (~6 min).
    "save_every": 10,
}

#: Optional subcommands: name -> module implementing it (see the module docstring).
OPTIONAL_COMMANDS = {"bench": "pyppo.bench", "profile": "pyppo.profile"}

_OUTPUT_FILES = {
    "config.toml": "resolved configuration",
    "metrics.jsonl": "per-step metrics",
    "samples.jsonl": "prompts, responses and scores",
    "curves.png": "score, KL and losses over steps",
    "eval_samples.jsonl": "held-out prompts' responses, scores and KL (with --eval-prompts)",
    "policy": "the trained policy as a Hugging Face model directory (from_pretrained, --model)",
    "checkpoint": "trained weights, optimizer, RNG and KL controller state (for --resume)",
}


class CLIError(Exception):
    """A user error: printed as one line, no traceback."""


class _Parser(argparse.ArgumentParser):
    """Argument errors as one ``pyppo: error: ...`` line (with where to look), not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


# --------------------------------------------------------------------------------------------
# pyppo info


def collect_info() -> dict:
    """Versions and build flags, as a flat dict (what ``pyppo info --json`` prints)."""
    import torch

    import pyppo
    from pyppo import _C

    return {
        "pyppo": getattr(pyppo, "__version__", "unknown"),
        "torch_built_against": getattr(_C, "torch_version", "unknown"),
        "torch_running": torch.__version__,
        "cuda": bool(getattr(_C, "with_cuda", False)),
        "cuda_archs": getattr(_C, "cuda_archs", ""),
        "cuda_available": torch.cuda.is_available(),
        "openmp": bool(getattr(_C, "with_openmp", False)),
        "num_threads": int(_C.num_threads()),
        "cpu_capability": _cpu_capability(_C),
        "cpu_isas": _C.cpu_isas,
        "build_type": getattr(_C, "build_type", "unknown"),
        "compiler": getattr(_C, "compiler", "unknown"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "integrations": _integrations(),
    }


def _integrations() -> dict:
    from pyppo.integrations import peer_status

    return peer_status()


def _cpu_capability(C) -> str:
    try:
        return C.cpu_capability()
    except (RuntimeError, ValueError) as exc:  # a bad PYPPO_CPU_CAPABILITY: info is where one looks
        return f"invalid ({str(exc).splitlines()[0]})"


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    cuda = _on_off(info["cuda"])
    if info["cuda"]:
        cuda += f" (archs {info['cuda_archs'] or '?'}; device {'available' if info['cuda_available'] else 'not available'})"
    torch_line = info["torch_running"]
    if info["torch_built_against"] != info["torch_running"]:
        torch_line += f"  (MISMATCH: built against {info['torch_built_against']})"
    rows = [
        ("pyppo", info["pyppo"]),
        ("torch (running)", torch_line),
        ("torch (built against)", info["torch_built_against"]),
        ("CUDA kernels", cuda),
        ("OpenMP", f"{_on_off(info['openmp'])}, {info['num_threads']} threads"),
        ("CPU kernels", f"{info['cpu_capability']} (built: {info['cpu_isas']})"),
        ("build", f"{info['build_type']}, {info['compiler']}"),
        ("python", info["python"]),
        ("platform", info["platform"]),
    ]
    for peer, st in info["integrations"].items():
        written = ", ".join(st["written_for"])
        if st["installed"] is None:
            value = f"not installed (adapters written for {written})"
        elif st["supported"]:
            value = f"{st['installed']} (patch() supported)"
        else:
            value = f"{st['installed']} (adapters written for {written}: patch() needs force=True)"
        rows.append((f"integration {peer}", value))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


# --------------------------------------------------------------------------------------------
# config flags: one per PPOConfig field, from the field metadata (shared with `pyppo profile`)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_type(knob):
    base = {"int": int, "float": float}.get(knob.check.kind, str)

    def parse(text: str):
        if knob.optional and text.lower() == "none":
            return None
        return base(text)

    parse.__name__ = base.__name__  # argparse says "invalid int value: ..."
    return parse


def add_config_flags(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """Add a flag for every ``PPOConfig`` field, grouped as in ``docs/trainer.md``.

    ``defaults`` are the values shown in ``--help`` (the command's own preset over the field
    defaults). A flag not given leaves no attribute, so flags only override what they name.
    """
    from pyppo.config import config_knobs

    groups: dict = {}
    for name, knob in config_knobs():
        if knob.group not in groups:
            groups[knob.group] = parser.add_argument_group(f"PPO settings: {knob.group}")
        shown = "none" if defaults[name] is None else defaults[name]
        kwargs = dict(dest=name, default=argparse.SUPPRESS, help=f"{knob.help} (default: {shown})")
        if knob.check.kind == "bool":
            groups[knob.group].add_argument(_flag(name), action=argparse.BooleanOptionalAction, **kwargs)
        else:
            metavar = knob.check.metavar + ("|none" if knob.optional else "")
            groups[knob.group].add_argument(_flag(name), type=_flag_type(knob), metavar=metavar, **kwargs)


def config_flag_values(args: argparse.Namespace) -> dict:
    """The ``PPOConfig`` fields that were given as flags."""
    from pyppo.config import config_knobs

    return {name: getattr(args, name) for name, _ in config_knobs() if hasattr(args, name)}


def field_defaults(preset: dict) -> dict:
    """Every field's default, with ``preset`` over it."""
    from pyppo.config import PPOConfig

    return {f.name: f.default for f in dataclasses.fields(PPOConfig)} | preset


def _read_toml(path: Path, what: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    if not path.is_file():
        raise CLIError(f"{what} {str(path)!r} does not exist")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise CLIError(f"{what} {str(path)!r}: invalid TOML: {exc}") from None


def _same_source(a: str, b) -> bool:
    """Whether two model/reward/prompts specs name the same thing (paths compared resolved)."""
    if not isinstance(b, str):
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() or pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def _check_keys(table: dict, where: str) -> dict:
    """The settings of a flat TOML table, with ``"none"`` read as None for optional fields.

    Raises:
        CLIError: an unknown key or a table, naming it and the known keys.
    """
    from pyppo.config import config_knobs

    knobs = dict(config_knobs())
    out = {}
    for key, value in table.items():
        if key not in RUN_KEYS and key not in knobs:
            known = ", ".join(sorted(set(RUN_KEYS) | set(knobs)))
            if isinstance(value, dict):
                raise CLIError(f"{where}: unknown table [{key}]; settings are flat keys: {known}")
            raise CLIError(f"{where}: unknown key {key!r}; known keys: {known}")
        if key in knobs and knobs[key].optional and isinstance(value, str) and value.lower() == "none":
            value = None  # TOML has no null; config.toml writes None as "none"
        # Each source is checked on its own: a bad value that a flag overrides is still a mistake
        # in the file.
        if key in knobs:
            try:
                knobs[key].validate(key, value)
            except ValueError as exc:
                raise CLIError(f"{where}: {exc}") from None
        elif not isinstance(value, str):
            raise CLIError(f"{where}: {key!r} must be a string, got {value!r}")
        out[key] = value
    return out


def make_config(settings: dict):
    """``PPOConfig(**settings)`` (its checks take a TOML integer where a float is expected).

    Raises:
        CLIError: an invalid value (the config's message, naming the key).
    """
    from pyppo.config import PPOConfig

    try:
        return PPOConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise CLIError(f"invalid configuration: {exc}") from None


def resolve_train_config(args: argparse.Namespace) -> tuple[dict, object, Path, Path | None]:
    """Merge, in increasing priority: the field defaults, :data:`TRAIN_DEFAULTS`, ``--resume``'s
    config.toml, ``--config`` and the flags.

    Returns:
        ``(run, ppo_config, output_dir, resume_dir)`` where ``run`` holds ``model``, ``reward`` and
        ``prompts`` (``None`` = built-in prompts) and ``ppo_config`` is a ``PPOConfig``.

    Raises:
        CLIError: unknown key, missing file, invalid value (PPOConfig's validation message).
    """
    from pyppo import checkpoint
    from pyppo.models import DEFAULT_MODEL

    merged: dict = {"model": DEFAULT_MODEL, "reward": "sentiment", "prompts": None, "eval_prompts": None,
                    **TRAIN_DEFAULTS}
    resume_dir, resumed = None, {}
    if args.resume is not None:
        resume_dir = Path(args.resume).expanduser()
        if not resume_dir.is_dir():
            raise CLIError(f"--resume {args.resume!r}: no such run directory")
        if not (resume_dir / "config.toml").is_file():
            raise CLIError(f"--resume {args.resume!r}: no config.toml in it (not a pyppo run directory)")
        resumed = _check_keys(_read_toml(resume_dir / "config.toml", "--resume config"),
                              str(resume_dir / "config.toml"))
        merged.update(resumed)
    if args.config is not None:
        path = Path(args.config).expanduser()
        merged.update(_check_keys(_read_toml(path, "--config"), str(path)))
    for key in RUN_KEYS:
        value = getattr(args, key)
        if value is None:
            continue
        # A resumed run continues the same model, reward and prompts: switching them mid-run
        # would make its checkpoint and its config.toml describe different experiments.
        if resume_dir is not None and key in resumed and not _same_source(value, resumed[key]):
            raise CLIError(f"--{key} {value!r} differs from the resumed run's {key} {resumed[key]!r}; "
                           "start a new run (--output) to change it")
        merged[key] = value
    flags = config_flag_values(args)
    _check_lora_flags(flags, resumed if resume_dir is not None else None)
    merged.update(flags)
    # `--batch-size 8` alone should work: when the mini-batch size is still TRAIN_DEFAULTS' and does
    # not divide the batch, train on the whole batch at once.
    if ("batch_size" in flags and merged.get("mini_batch_size") == TRAIN_DEFAULTS["mini_batch_size"]
            and "mini_batch_size" not in flags and flags["batch_size"] % TRAIN_DEFAULTS["mini_batch_size"] != 0):
        merged["mini_batch_size"] = flags["batch_size"]

    run = {key: merged.pop(key) for key in RUN_KEYS}
    # Paths are stored absolute in the resolved config, so `--resume` works from any directory.
    for key in ("prompts", "eval_prompts"):
        if run[key]:
            path = Path(run[key]).expanduser()
            if not path.is_file():
                raise CLIError(f"{_flag(key)} {run[key]!r}: no such file")
            run[key] = str(path.resolve())
    model_path = Path(run["model"]).expanduser()
    if model_path.exists():
        run["model"] = str(model_path.resolve())
    if not isinstance(run["reward"], str) or not run["reward"]:
        raise CLIError(f"--reward must be 'sentiment', a model directory or 'module:function', got {run['reward']!r}")
    reward_path = Path(run["reward"]).expanduser()
    if reward_path.is_dir():
        run["reward"] = str(reward_path.resolve())
    elif ".py:" in run["reward"]:  # file.py:function: the file, found from any directory later
        file, _, function = run["reward"].rpartition(":")
        if Path(file).expanduser().is_file():
            run["reward"] = f"{Path(file).expanduser().resolve()}:{function}"
    ppo_config = make_config(merged)
    if not ppo_config.lora_rank:
        useless = [_flag(k) for k in ("lora_alpha", "lora_target_modules") if k in flags]
        if useless:
            verb = "applies" if len(useless) == 1 else "apply"
            raise CLIError(f"{' and '.join(useless)} only {verb} with --lora-rank N > 0 (LoRA is off)")
    if ppo_config.fsdp and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        import warnings

        warnings.warn("fsdp has no effect in a single process (it shards over torchrun's processes: "
                      "--nproc N or torchrun --nproc-per-node N)", UserWarning, stacklevel=2)
    if ppo_config.eval_every and not run["eval_prompts"]:
        raise CLIError(f"--eval-every {ppo_config.eval_every} needs --eval-prompts FILE.jsonl (held-out prompts)")
    if args.output is not None:
        output = Path(args.output).expanduser()
    elif resume_dir is not None:
        output = resume_dir
    else:
        output = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    check_output_dir(output)
    # A directory whose run has no checkpoint holds nothing to resume: the same command starts it
    # over there (see cmd_train); one with a checkpoint is only continued with --resume.
    if resume_dir is None or output.resolve() != resume_dir.resolve():
        if checkpoint.find(output / "checkpoint") is not None:
            raise CLIError(
                f"--output {str(output)!r} already holds a run with a checkpoint; "
                f"continue it with --resume {str(output)!r} or choose another --output"
            )
    return run, ppo_config, output, resume_dir


#: What a checkpoint's trained weights depend on: a resumed run cannot change them.
_LORA_KEYS = ("lora_rank", "lora_alpha", "lora_target_modules", "value_lora")


def _check_lora_flags(flags: dict, resumed: dict | None) -> None:
    """A resumed run's LoRA settings are those its checkpoint was trained with.

    Raises:
        CLIError: a LoRA flag that differs from the resumed run's config.toml.
    """
    if resumed is None:
        return
    for key in _LORA_KEYS:
        if key in flags and key in resumed and flags[key] != resumed[key]:
            raise CLIError(f"{_flag(key)} {flags[key]!r} differs from the resumed run's {key} {resumed[key]!r}: "
                           "its checkpoint holds weights trained with it; start a new run (--output) to change it")


def write_resolved_config(path: Path, run: dict, ppo_config) -> None:
    """Write the settings a run actually used as flat TOML; a None setting is written ``"none"``
    (TOML has no null), which ``--config`` and ``--resume`` read back as None."""
    import tomli_w

    table = {k: v for k, v in run.items() if v is not None}
    table.update({k: "none" if v is None else v for k, v in dataclasses.asdict(ppo_config).items()})
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text("# Resolved pyppo configuration; `pyppo train --config` or `--resume` reads it back.\n"
                   + tomli_w.dumps(table))
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# pyppo train


def cmd_train(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        return _relaunch_with_torchrun(args.nproc)
    from pyppo.stopping import GracefulStop

    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 writes or talks
    stop = GracefulStop(say=main_rank, single_process=int(os.environ.get("WORLD_SIZE", "1")) == 1)
    with stop.installed():
        return _train(args, stop, main_rank)


def _train(args: argparse.Namespace, stop, main_rank: bool) -> int:
    import gc

    from pyppo import distributed
    from pyppo.builder import build_trainer
    from pyppo.plotting import plot_metrics
    from pyppo.skips import NonFiniteUpdateError

    say = (lambda text: print(text, file=sys.stderr)) if main_rank else (lambda text: None)
    run, config, output, resume_dir = resolve_train_config(args)
    done = _checkpoint_step(resume_dir)
    if done is not None and done >= config.steps:
        say(f"{PROG}: {str(resume_dir)!r} is at step {done} (its checkpoint), steps = {config.steps}: nothing "
            f"left to run; pass --steps N with N > {done} to train further")
        return 0
    if resume_dir is not None:
        say(f"{PROG}: resuming {str(resume_dir)!r} from step {done} of {config.steps}" if done is not None else
            f"{PROG}: {str(resume_dir)!r} has no checkpoint yet: starting it over in place from step 0 "
            "with its config.toml")
    elif _restartable(output):
        say(f"{PROG}: {str(output)!r} holds a run stopped before its first checkpoint: starting it over in place")
    # Built before the output directory exists, so a bad model, reward or prompts file leaves nothing behind.
    trainer = build_trainer(config, **run, before_loading=lambda: say(f"pyppo: loading {run['model']} ..."))
    # Loaded before config.toml is written: a refused resume leaves the run's files as they were.
    if done is not None:
        trainer.load_checkpoint(resume_dir / "checkpoint")
    elif _restartable(output):
        _clear_run(output)
    created = not output.exists()
    if main_rank:
        output.mkdir(parents=True, exist_ok=True)
        write_resolved_config(output / "config.toml", run, config)
    stop.training()
    try:
        trainer.train(output, stop=stop)
    except BaseException as exc:
        if main_rank and resume_dir is None and not any((output / n).exists() for n in ("metrics.jsonl", "checkpoint")):
            # Failed before its first step was logged: leave no directory behind.
            (output / "config.toml").unlink(missing_ok=True)
            if created and output.is_dir() and not any(output.iterdir()):
                output.rmdir()
        if isinstance(exc, NonFiniteUpdateError) and not os.environ.get("PYPPO_DEBUG"):
            say(f"{PROG}: error: {exc}")
            return 1
        raise
    stop.finishing()
    finished = trainer.step_count >= config.steps
    world, step = trainer.world, trainer.step_count
    del trainer
    gc.collect()
    distributed.leave(world)
    if not main_rank:
        return stop.exit_status if not finished else 0
    if (output / "metrics.jsonl").is_file():
        plot_metrics(output / "metrics.jsonl", output / "curves.png")
    if not finished:
        if step == 0:
            hint = (f"no step finished, so there is nothing to keep: the same command, or "
                    f"pyppo train --resume {output}, starts it over in place")
        else:
            hint = f"its checkpoint is at step {step} of {config.steps}; continue with: pyppo train --resume {output}"
        say(f"{PROG}: stopped by {stop.signal_name}; {hint}")
        return stop.exit_status
    print(f"pyppo: run written to {output}")
    for name, what in _OUTPUT_FILES.items():
        if (output / name).exists():
            print(f"  {name:<18} {what}")
    return 0


def _checkpoint_step(resume_dir: Path | None) -> int | None:
    """The step of ``resume_dir``'s checkpoint; ``None`` without one (or without ``--resume``)."""
    from pyppo import checkpoint

    found = checkpoint.find(resume_dir / "checkpoint") if resume_dir is not None else None
    return checkpoint.saved_step(found) if found is not None else None


def _restartable(output: Path) -> bool:
    """Whether ``output`` holds a run that has no checkpoint: stopped or failed before its first
    one, it has nothing to resume, so the same command starts it over there."""
    from pyppo import checkpoint

    return output.is_dir() and any((output / name).exists() for name in _OUTPUT_FILES) \
        and checkpoint.find(output / "checkpoint") is None


def _clear_run(output: Path) -> None:
    """Remove what a run without a checkpoint left (logs, curves, debris of a first save)."""
    import shutil

    for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl", "curves.png"):
        (output / name).unlink(missing_ok=True)
    for debris in [output / "checkpoint", *output.glob(".checkpoint.tmp-*")]:
        shutil.rmtree(debris, ignore_errors=True)


def _relaunch_with_torchrun(nproc: int) -> int:
    """``pyppo train --nproc N ...`` is ``torchrun --nproc-per-node N -m pyppo train ...``: the same
    words without ``--nproc``, run by torchrun (which stays in charge of the processes)."""
    import subprocess

    if nproc < 1:
        raise CLIError(f"--nproc must be >= 1, got {nproc}")
    if "RANK" in os.environ:
        raise CLIError("--nproc inside torchrun: launch either with torchrun or with --nproc, not both")
    words, skip = [], False
    for word in sys.argv[1:]:
        if skip:
            skip = False
        elif word == "--nproc":
            skip = True
        elif not word.startswith("--nproc="):
            words.append(word)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "pyppo", *words]
    print(f"pyppo: running {' '.join(command[2:])}", file=sys.stderr)
    # torchrun runs in a session of its own, so that a Ctrl-C reaches it once, from here, and this
    # process stays until it has stopped its workers (each signal forwarded; see pyppo.stopping).
    import signal

    child = subprocess.Popen(command, start_new_session=True)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - status if status < 0 else status


# --------------------------------------------------------------------------------------------
# Parser and entry point


def add_source_flags(p: argparse.ArgumentParser, *, required_defaults: bool = False,
                     eval_prompts: bool = True) -> None:
    """``--model``, ``--reward``, ``--prompts`` (what to train; shared with ``pyppo profile``) and,
    with ``eval_prompts``, ``--eval-prompts``."""
    from pyppo.models import DEFAULT_MODEL

    src = p.add_argument_group("what to train")
    src.add_argument("--model", metavar="NAME|DIR|FILE.gguf", default=DEFAULT_MODEL if required_defaults else None,
                     help=f"policy to start from: {DEFAULT_MODEL!r} (default), a local HF model dir or a .gguf file")
    src.add_argument("--reward", metavar="SPEC", default="sentiment" if required_defaults else None,
                     help="'sentiment' (default, VADER compound of the response), 'module:function', "
                          "'file.py:function', or a local HF sequence-classification model dir")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='prompts, one {"prompt": ...} per line (default: the built-in set)')
    if eval_prompts:
        src.add_argument("--eval-prompts", metavar="FILE.jsonl",
                         help="held-out prompts (same format), evaluated every --eval-every steps and after the last")


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    add_source_flags(p)
    io = p.add_argument_group("files")
    io.add_argument("--config", metavar="FILE.toml", help="settings file (flat keys, as the flags; flags override it)")
    io.add_argument("--output", metavar="DIR", help="run directory (default: runs/<timestamp>, or the --resume dir)")
    io.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint/ and config.toml")
    io.add_argument("--nproc", metavar="N", type=int,
                    help="run N processes: shorthand for torchrun --nproc-per-node N -m pyppo train ...")
    add_config_flags(p, field_defaults(TRAIN_DEFAULTS))


def _register_optional(sub, name: str, module_name: str) -> None:
    """Add ``pyppo <name>`` if ``module_name`` exists; a broken module is reported when used."""
    try:
        if importlib.util.find_spec(module_name) is None:
            return
    except (ImportError, ValueError):
        return
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the module exists but fails to import: say so when it is invoked
        p = sub.add_parser(name, help=f"(unavailable: {module_name} failed to import)")
        p.set_defaults(func=lambda args, exc=exc: _raise(CLIError(f"{name}: cannot import {module_name}: {exc}")))
        return
    doc = (module.__doc__ or "").strip()
    summary = doc.splitlines()[0] if doc else None
    if hasattr(module, "add_arguments") and hasattr(module, "run"):
        p = sub.add_parser(name, help=summary, description=doc or None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    elif hasattr(module, "main"):
        p = sub.add_parser(name, help=summary, add_help=False)
        p.add_argument("argv", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda args: module.main(args.argv))


def _raise(exc: Exception):
    raise exc


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="PPO for language models, with compiled ops.",
        epilog="Run `pyppo train` with no arguments for the embedded default (SmolLM2-135M, sentiment reward).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p_train = sub.add_parser("train", help="train a policy with PPO",
                             description="Train a causal LM with PPO. Flags override --config, which overrides "
                                         "--resume's config. Every setting is explained in docs/trainer.md. "
                                         "--batch-size alone (no --mini-batch-size) trains on the whole batch "
                                         "at once when the preset mini-batch size does not divide it.")
    _add_train_arguments(p_train)
    p_train.set_defaults(func=cmd_train)

    p_info = sub.add_parser("info", help="versions and build flags")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_info.set_defaults(func=cmd_info)

    for name, module_name in OPTIONAL_COMMANDS.items():
        _register_optional(sub, name, module_name)
    return parser


# Exceptions that mean "the user asked for something that cannot be done" rather than a bug:
# missing files (OSError), bad values (ValueError), missing packages (ImportError).
_USER_ERRORS = (CLIError, OSError, ValueError, ImportError)


@contextlib.contextmanager
def _plain_warnings():
    """pyppo's own warnings as ``pyppo: warning: ...`` lines: their file and line inside pyppo
    say nothing to a user. Other packages' warnings keep Python's format."""
    import warnings

    package = str(Path(__file__).resolve().parent)
    formatted = warnings.formatwarning

    # formatwarning, not showwarning: recording warnings (catch_warnings(record=True)) keeps working.
    def plain(message, category, filename, lineno, line=None):
        if str(filename).startswith(package):
            return f"{PROG}: warning: {message}\n"
        return formatted(message, category, filename, lineno, line)

    warnings.formatwarning = plain
    try:
        yield
    finally:
        if warnings.formatwarning is plain:
            warnings.formatwarning = formatted


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pyppo`` and ``python -m pyppo``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _plain_warnings():
            status = args.func(args)
    except _USER_ERRORS as exc:
        if os.environ.get("PYPPO_DEBUG"):
            raise
        message = str(exc) or type(exc).__name__
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank fails alike: say it once
            print(f"{PROG}: error: {message}", file=sys.stderr)
        status = 2
    if argv is None:  # the command line: a signal while the process exits ends it quietly
        _exit_on_signals(int(status or 0))
    return int(status or 0)


def _exit_on_signals(status: int) -> None:
    """From now on SIGINT and SIGTERM end the process at once with ``status`` (its work is done;
    Python's default would print a ``KeyboardInterrupt`` traceback during shutdown)."""
    import signal

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: os._exit(status))


if __name__ == "__main__":
    sys.exit(main())
