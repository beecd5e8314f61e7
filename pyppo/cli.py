"""The ``pyppo`` command line (``pyppo ...`` or ``python -m pyppo ...``), DESIGN.md §4.

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
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

__all__ = ["build_parser", "main", "resolve_train_config"]

PROG = "pyppo"

#: Settings of a run that are not PPOConfig fields: where the model, reward and prompts come from.
RUN_KEYS = ("model", "reward", "prompts")

#: ``pyppo train`` flags that set the PPOConfig field of the same name.
FLAG_FIELDS = ("steps", "batch_size", "mini_batch_size", "ppo_epochs", "max_new_tokens", "lr", "kl_coef",
               "target_kl", "seed")

#: What `pyppo train` changes from PPOConfig's library defaults: sized so that the embedded
#: default (SmolLM2-135M, sentiment reward) shows its mean score rising within about 10
#: minutes on 2 CPU cores (~30 s a step). Lower than these, the score's step-to-step noise
#: (VADER on 16-token responses) hides the trend; higher, a step takes minutes.
TRAIN_DEFAULTS = {
    "steps": 20,
    "batch_size": 32,
    "mini_batch_size": 16,
    "ppo_epochs": 2,
    "max_new_tokens": 16,
    "lr": 5e-5,
    "kl_coef": 0.03,
    # A checkpoint (~3.2 GB: two fp32 models and their Adam moments) every 5 steps, so that an
    # interrupted run loses at most 5 steps (~2.5 min).
    "save_every": 5,
}

#: Optional subcommands: name -> module implementing it (see the module docstring).
OPTIONAL_COMMANDS = {"bench": "pyppo.bench", "profile": "pyppo.profile"}

_OUTPUT_FILES = {
    "config.toml": "resolved configuration",
    "metrics.jsonl": "per-step metrics",
    "samples.jsonl": "prompts, responses and scores",
    "curves.png": "score, KL and losses over steps",
    "checkpoint": "policy, value model, optimizer, RNG and KL controller state (for --resume)",
}


class CLIError(Exception):
    """A user error: printed as one line, no traceback."""


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
    }


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
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


# --------------------------------------------------------------------------------------------
# pyppo train: configuration


def _ppo_config_class():
    try:
        from pyppo.trainer import PPOConfig
    except ImportError as exc:
        raise CLIError(f"the trainer is not available: {exc}") from exc
    return PPOConfig


def _field_map(config_cls) -> dict[str, str]:
    """Accepted config key -> PPOConfig field name (every field under its own name)."""
    return {f.name: f.name for f in dataclasses.fields(config_cls)}


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


def _coerce(value, default):
    """Fit a TOML value to the field's default type where TOML cannot say it (1 -> 1.0, list -> tuple)."""
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(default, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def _check_keys(table: dict, mapping: dict[str, str], where: str) -> dict:
    """Split a flat settings table into run keys and PPOConfig fields; reject unknown keys."""
    out = {}
    for key, value in table.items():
        if key in RUN_KEYS:
            out[key] = value
        elif key in mapping:
            out[mapping[key]] = value
        else:
            known = ", ".join(sorted(set(RUN_KEYS) | set(mapping)))
            if isinstance(value, dict):
                raise CLIError(f"{where}: unknown table [{key}]; settings are flat keys: {known}")
            raise CLIError(f"{where}: unknown key {key!r}; known keys: {known}")
    return out


def resolve_train_config(args: argparse.Namespace) -> tuple[dict, object, Path, Path | None]:
    """Merge defaults, ``--resume``'s config, ``--config`` and the flags.

    Returns:
        ``(run, ppo_config, output_dir, resume_dir)`` where ``run`` holds ``model``, ``reward`` and
        ``prompts`` (``None`` = built-in prompts) and ``ppo_config`` is a ``PPOConfig``.

    Raises:
        CLIError: unknown key, missing file, invalid value (PPOConfig's validation message).
    """
    from pyppo.models import DEFAULT_MODEL

    config_cls = _ppo_config_class()
    mapping = _field_map(config_cls)
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls) if f.default is not dataclasses.MISSING}
    merged: dict = {"model": DEFAULT_MODEL, "reward": "sentiment", "prompts": None, **TRAIN_DEFAULTS}

    resume_dir = None
    if args.resume is not None:
        resume_dir = Path(args.resume).expanduser()
        if not resume_dir.is_dir():
            raise CLIError(f"--resume {args.resume!r}: no such run directory")
        from pyppo.trainer import find_checkpoint

        if find_checkpoint(resume_dir / "checkpoint") is None:
            raise CLIError(f"--resume {args.resume!r}: no complete checkpoint/ in it (did the run save one?)")
        resumed = _read_toml(resume_dir / "config.toml", "--resume config")
        merged.update(_check_keys(resumed, mapping, f"{resume_dir / 'config.toml'}"))
    if args.config is not None:
        path = Path(args.config).expanduser()
        merged.update(_check_keys(_read_toml(path, "--config"), mapping, str(path)))
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
    for flag in FLAG_FIELDS:
        value = getattr(args, flag)
        if value is None:
            continue
        merged[flag] = value
    # `--batch-size 8` alone should work: when the mini-batch size came from TRAIN_DEFAULTS (no
    # flag, no config file set it) and does not divide the batch, train on the whole batch at once.
    if (args.batch_size is not None and args.mini_batch_size is None
            and merged.get("mini_batch_size") == TRAIN_DEFAULTS["mini_batch_size"]
            and args.batch_size % TRAIN_DEFAULTS["mini_batch_size"] != 0):
        merged["mini_batch_size"] = args.batch_size

    run = {key: merged.pop(key) for key in RUN_KEYS}
    for key in RUN_KEYS:
        if run[key] is not None and not isinstance(run[key], str):
            raise CLIError(f"{key!r} must be a string, got {run[key]!r}")
    # Paths are stored absolute in the resolved config, so `--resume` works from any directory.
    if run["prompts"]:
        prompts = Path(run["prompts"]).expanduser()
        if not prompts.is_file():
            raise CLIError(f"--prompts {run['prompts']!r}: no such file")
        run["prompts"] = str(prompts.resolve())
    model_path = Path(run["model"]).expanduser()
    if model_path.exists():
        run["model"] = str(model_path.resolve())
    reward_path = Path(run["reward"]).expanduser()
    if reward_path.is_dir():
        run["reward"] = str(reward_path.resolve())

    kwargs = {name: _coerce(value, defaults.get(name)) for name, value in merged.items()}
    try:
        ppo_config = config_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise CLIError(f"invalid configuration: {exc}") from None

    if args.output is not None:
        output = Path(args.output).expanduser()
    elif resume_dir is not None:
        output = resume_dir
    else:
        output = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if resume_dir is None or output.resolve() != resume_dir.resolve():
        taken = [name for name in ("metrics.jsonl", "checkpoint") if (output / name).exists()]
        if taken:
            raise CLIError(
                f"--output {str(output)!r} already holds a run ({', '.join(taken)}); "
                f"continue it with --resume {str(output)!r} or choose another --output"
            )
    return run, ppo_config, output, resume_dir


def _toml_value(value):
    if isinstance(value, tuple):
        return [_toml_value(v) for v in value]
    if isinstance(value, (bool, int, float, str, list, dict)):
        return value
    return str(value)  # e.g. a torch.dtype: written readably; PPOConfig validates it on the way back


def write_resolved_config(path: Path, run: dict, ppo_config) -> None:
    """Write the settings a run actually used as flat TOML (``None`` values are omitted: TOML has no null)."""
    import tomli_w

    table = {k: v for k, v in run.items() if v is not None}
    for name, value in dataclasses.asdict(ppo_config).items():
        if value is not None:
            table[name] = _toml_value(value)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(
        "# Resolved pyppo configuration; `pyppo train --config` or `--resume` reads it back.\n"
        + tomli_w.dumps(table)
    )
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# pyppo train


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from pyppo.models import ValueModel, load_model_and_tokenizer, make_reference, resolve_model_source
    from pyppo.plotting import plot_metrics
    from pyppo.prompts import DEFAULT_PROMPTS, load_prompts
    from pyppo.rewards import load_reward

    run, config, output, resume_dir = resolve_train_config(args)
    try:
        from pyppo.trainer import NonFiniteUpdateError, PPOTrainer
    except ImportError as exc:
        raise CLIError(f"the trainer is not available: {exc}") from exc

    # Cheap checks first, so a typo in --model, --prompts or --reward fails before the model loads
    # and before the output directory is created.
    resolve_model_source(run["model"])
    prompts = load_prompts(run["prompts"]) if run["prompts"] else list(DEFAULT_PROMPTS)
    device = getattr(config, "device", "cpu") or "cpu"
    try:
        reward_fn = load_reward(run["reward"], device=device)
    except (AttributeError, TypeError) as exc:  # "module:function" naming a missing or non-callable attribute
        raise CLIError(str(exc)) from None

    print(f"pyppo: loading {run['model']} ...", file=sys.stderr)
    seed = getattr(config, "seed", None)
    if seed is not None:
        # The value head's init draws from the global RNG; seeding first makes runs repeatable.
        torch.manual_seed(seed)
    policy, tokenizer = load_model_and_tokenizer(run["model"], device=device)
    ref_policy = make_reference(policy)
    value_model = ValueModel.from_causal_lm(policy)

    output.mkdir(parents=True, exist_ok=True)
    write_resolved_config(output / "config.toml", run, config)

    trainer = PPOTrainer(config, policy, ref_policy, value_model, tokenizer, reward_fn, prompts)
    if resume_dir is not None:
        trainer.load_checkpoint(resume_dir / "checkpoint")
    try:
        trainer.train(output)
    except KeyboardInterrupt:
        metrics = output / "metrics.jsonl"
        if metrics.is_file():
            plot_metrics(metrics, output / "curves.png")
        has_ckpt = (output / "checkpoint").is_dir()
        hint = (f"continue from the last checkpoint with: pyppo train --resume {output}" if has_ckpt
                else "no checkpoint was written yet (see save_every)")
        print(f"\npyppo: interrupted; outputs so far are in {output}; {hint}", file=sys.stderr)
        return 130
    except NonFiniteUpdateError as exc:
        if os.environ.get("PYPPO_DEBUG"):
            raise
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1

    metrics = output / "metrics.jsonl"
    if metrics.is_file():
        plot_metrics(metrics, output / "curves.png")
    print(f"pyppo: run written to {output}")
    for name, what in _OUTPUT_FILES.items():
        if (output / name).exists():
            print(f"  {name:<14} {what}")
    return 0


# --------------------------------------------------------------------------------------------
# Parser and entry point


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    from pyppo.models import DEFAULT_MODEL

    src = p.add_argument_group("what to train")
    src.add_argument("--model", metavar="NAME|DIR|FILE.gguf",
                     help=f"policy to start from: {DEFAULT_MODEL!r} (default), a local HF model dir or a .gguf file")
    src.add_argument("--reward", metavar="SPEC",
                     help="'sentiment' (default, VADER compound of the response), 'module:function', "
                          "or a local HF sequence-classification model dir")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='prompts, one {"prompt": ...} per line (default: the built-in set)')

    d = TRAIN_DEFAULTS
    ppo = p.add_argument_group("PPO settings (any other PPOConfig field can be set in --config)")
    ppo.add_argument("--steps", type=int, help=f"PPO steps (rollout + update) to run (default {d['steps']})")
    ppo.add_argument("--batch-size", type=int, help=f"prompts per rollout (default {d['batch_size']})")
    ppo.add_argument("--mini-batch-size", type=int,
                     help=f"sequences per optimizer step (default {d['mini_batch_size']})")
    ppo.add_argument("--ppo-epochs", type=int, help=f"passes over each rollout (default {d['ppo_epochs']})")
    ppo.add_argument("--max-new-tokens", type=int, help=f"response length limit (default {d['max_new_tokens']})")
    ppo.add_argument("--lr", type=float, help=f"learning rate (default {d['lr']})")
    ppo.add_argument("--kl-coef", type=float, help=f"(initial) KL penalty coefficient (default {d['kl_coef']})")
    ppo.add_argument("--target-kl", type=float, help="target KL of the adaptive controller (default: fixed kl_coef)")
    ppo.add_argument("--seed", type=int, help="random seed")

    io = p.add_argument_group("files")
    io.add_argument("--config", metavar="FILE.toml", help="settings file (flat keys; flags override it)")
    io.add_argument("--output", metavar="DIR", help="run directory (default: runs/<timestamp>, or the --resume dir)")
    io.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint/ and config.toml")


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
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="PPO for language models, with compiled ops.",
        epilog="Run `pyppo train` with no arguments for the embedded default (SmolLM2-135M, sentiment reward).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p_train = sub.add_parser("train", help="train a policy with PPO",
                             description="Train a causal LM with PPO. Flags override --config, which overrides --resume's config.")
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pyppo`` and ``python -m pyppo``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = args.func(args)
    except _USER_ERRORS as exc:
        if os.environ.get("PYPPO_DEBUG"):
            raise
        message = str(exc) or type(exc).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
