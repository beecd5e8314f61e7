"""A run directory's ``config.toml``: the settings a run used, which ``pyppo train --resume DIR``
reads back. ``pyppo train`` writes it before training; a trainer driven from Python
(``trainer.train(dir)``) gets one from :func:`record_python_run`, with the sources it can name.

The file is flat TOML: every ``PPOConfig`` field, and the run's sources (``model``, ``reward``,
``prompts``, ``eval_prompts``: :data:`pyppo.cli.run_file.RUN_KEYS`) as ``pyppo train`` takes them.
TOML has no null: a ``None`` field is written ``"none"``, which the command line reads back as
``None``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from typing import Any, Optional

__all__ = ["PYTHON_HEADER", "record_python_run", "write_config", "written_from_python"]

#: The first line of a ``config.toml`` written by :func:`record_python_run`: ``pyppo train
#: --resume`` then asks for the sources it lacks instead of taking the command line's defaults.
PYTHON_HEADER = "# Written by PPOTrainer.train for a run started from Python"

_CLI_HEADER = "# Resolved pyppo configuration; `pyppo train --config` or `--resume` reads it back."

#: The prompt sets of a run started from Python, written into its directory so that its
#: ``config.toml`` can name them.
PROMPT_FILES = {"prompts": "prompts.jsonl", "eval_prompts": "eval_prompts.jsonl"}


def write_config(path: Path, sources: dict, config: Any, *, header: str = _CLI_HEADER) -> None:
    """Write ``sources`` (the ``None`` ones left out) and every field of the ``PPOConfig``
    ``config`` to ``path`` as flat TOML, after a ``header`` comment line; atomically (a temporary
    file renamed over it)."""
    import tomli_w

    table = {k: v for k, v in sources.items() if v is not None}
    table.update({k: "none" if v is None else v for k, v in dataclasses.asdict(config).items()})
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(f"{header}\n" + tomli_w.dumps(table))
    os.replace(tmp, path)


def written_from_python(path: Path) -> bool:
    """Whether the ``config.toml`` at ``path`` was written by :func:`record_python_run`."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(PYTHON_HEADER)
    except (OSError, UnicodeDecodeError):
        return False


def record_python_run(trainer: Any, run: Any) -> None:
    """Write ``config.toml`` (and the prompt sets) into the :class:`~pyppo.run.rundir.RunDir`
    ``run`` of a trainer driven from Python, unless the command line wrote the one there (it
    names the sources itself). Called by :func:`pyppo.run.loop.train` on rank 0, each time, so
    that the file follows ``trainer.config`` (``steps`` raised for another ``train`` call).

    What it names, where it can (what it cannot name is left out, and ``pyppo train --resume``
    then asks for that flag):

    * ``model``: ``trainer.base_model_source``, else the policy's ``name_or_path`` (the directory
      ``from_pretrained`` loaded), when it is a model source pyppo loads (absolute when a path);
    * ``reward``: ``reward_fn.reward_name`` when :func:`pyppo.rewards.load_reward` made it from a
      spec, else ``"module:function"`` for a function importable from a module (not ``__main__``,
      not a lambda or a nested function); several rewards (:class:`pyppo.reward_sum.RewardSum`):
      the list of theirs, when each has one, and ``reward_weights``;
    * ``prompts``, ``eval_prompts``: the prompts the trainer was given, written as
      ``prompts.jsonl`` / ``eval_prompts.jsonl`` in ``run`` (``{"prompt": ...}`` per line, with
      the record's fields), when they are plain JSON;
    * ``env``: the environment, when the trainer was given its name, ``module:Class`` or
      ``file.py:Class``, or a class importable by ``module:Class``; else (a class of
      ``__main__``, standalone tools) ``"python:<what it was>"`` (:data:`UNNAMED_ENV`), which
      ``pyppo train --resume`` refuses to continue without an ``--env`` standing in for it.

    A run given its own ``ref_policy`` or ``value_model`` is resumed by the command line with
    the ones it builds from the model (the value model's trained weights come from the checkpoint).
    """
    if run.config.exists() and not written_from_python(run.config):
        return
    sources = {"model": _model_spec(trainer), **_reward_sources(trainer.reward_fn)}
    if trainer.agent:  # the environment, when it has a name the command line takes
        sources["env"] = getattr(trainer.engine, "spec", None) or _unnamed_env(trainer.engine)
        if trainer.reward_fn is None:
            sources["reward"] = "none"
    for key, records in (("prompts", trainer.sampler.prompts), ("eval_prompts", trainer.eval_prompts)):
        sources[key] = _write_prompts(run.path / PROMPT_FILES[key], records) if records else None
    write_config(
        run.config, sources, trainer.config, header=f"{PYTHON_HEADER}; `pyppo train --resume DIR` reads it back."
    )


#: The prefix of config.toml's ``env`` for an environment the command line cannot load by name.
UNNAMED_ENV = "python:"


def _unnamed_env(engine: Any) -> str:
    factory = engine.make_env
    names = ", ".join(t["function"]["name"] for t in factory.tools if "function" in t)
    what = f"tools [{names}]" if factory.name == "tools" else f"{factory.kind} environment {factory.name}"
    return f"{UNNAMED_ENV}{what}"


def _model_spec(trainer: Any) -> Optional[str]:
    from ..models import resolve_model_source

    spec = trainer.base_model_source
    if spec is None:
        policy = trainer.policy
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        spec = getattr(base, "name_or_path", None)
    if not spec:
        return None
    try:
        resolve_model_source(spec)
    except (OSError, ValueError, ImportError):
        return None
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else str(spec)


def _reward_sources(fn: Any) -> dict:
    """``reward`` (and, for several rewards, ``reward_weights``) as :func:`record_python_run` names them."""
    from ..reward_sum import RewardSum

    if not isinstance(fn, RewardSum):
        return {"reward": _reward_spec(fn)}
    specs = [_reward_spec(part) for part in fn.rewards]
    if None in specs:
        return {"reward": None}
    return {"reward": specs, "reward_weights": list(fn.weights)}


def _reward_spec(fn: Any) -> Optional[str]:
    from ..rewards import BUILTIN_REWARDS

    name = getattr(fn, "reward_name", None)
    if isinstance(name, str) and (name in BUILTIN_REWARDS or ":" in name or Path(name).expanduser().is_dir()):
        return name
    fn = getattr(fn, "__wrapped__", fn)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is fn else None


def _write_prompts(path: Path, records) -> Optional[str]:
    """``records`` (strings or ``{"prompt": ...}`` mappings) as a prompts file at ``path``; its
    absolute path, or ``None`` when a record is not plain JSON (nothing is written then)."""
    import json

    try:
        lines = [json.dumps({"prompt": r} if isinstance(r, str) else dict(r), allow_nan=False) + "\n" for r in records]
    except (TypeError, ValueError):
        return None
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, path)
    return str(path.resolve())
