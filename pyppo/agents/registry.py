"""Environments by name, as ``--env`` takes them: a built-in name, ``module:Class`` or ``path/to/file.py:Class``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Dict

from .envs import ArithmeticRetry, Calculator, GuessNumber

__all__ = ["BUILTIN_ENVIRONMENTS", "load_environment"]

#: The built-in environments by ``--env`` name (:mod:`pyppo.agents.envs`).
BUILTIN_ENVIRONMENTS: Dict[str, type] = {
    "arithmetic-retry": ArithmeticRetry,
    "calculator": Calculator,
    "guess-number": GuessNumber,
}

_EXPECTED = "a built-in name ({names}), module:Class, or path/to/file.py:Class"


def _fail(spec: str, why: str) -> ValueError:
    expected = _EXPECTED.format(names=", ".join(sorted(BUILTIN_ENVIRONMENTS)))
    return ValueError(f"--env {spec!r}: {why}; expected {expected}")


def _import_file(spec: str, path_text: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise _fail(spec, f"no file {str(path)!r}")
    resolved = path.resolve()
    # One module per file, named after its path, so a second load reuses it and classes stay identical.
    module_name = "pyppo_env_" + "".join(c if c.isalnum() else "_" for c in str(resolved))
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise _fail(spec, f"cannot import {str(path)!r} as Python")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running it: dataclasses and pickling look the module up by name.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_environment(spec: str) -> Any:
    """The environment class (or zero-argument factory) that ``spec`` names.

    Args:
        spec: a key of :data:`BUILTIN_ENVIRONMENTS`; ``module:Class`` (an importable module,
            ``Class`` may be dotted: ``Outer.Inner``); or ``path/to/file.py:Class`` (the file is
            imported by its path, as a module of its own).

    Raises:
        ValueError: an unknown name, a spec of neither form, a missing file or module, or no such
            callable in it; the message names ``--env``, the spec, what was expected and the
            built-in names. An exception the module raises while importing propagates.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise _fail(str(spec), "empty")
    spec = spec.strip()
    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec]
    where, sep, attribute = spec.rpartition(":")
    if not sep or not where or not attribute:
        raise _fail(spec, "not a built-in environment name, and not of the form module:Class")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(spec, where)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (where == exc.name or where.startswith(exc.name + ".")):
                raise _fail(spec, f"no module named {where!r}") from exc
            raise
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise _fail(spec, f"{where!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise _fail(spec, f"{attribute!r} in {where!r} is a {type(target).__name__}, not a class or factory")
    return target
