"""Environments by name, as ``--env`` takes them: a built-in name, ``module:Class`` or ``path/to/file.py:Class``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from .envs import ArithmeticRetry, Calculator, GuessNumber
from .types import EnvironmentContractError

__all__ = ["BUILTIN_ENVIRONMENTS", "declared_prompts", "load_environment"]

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


def _import_failed(spec: str, where: str, exc: Exception) -> Exception:
    """The one-line error for an ``--env`` module or file that raised while importing: an
    ImportError (a missing package) or a ValueError (a syntax error, anything else it raised),
    naming ``--env``, the spec, the file and the original error."""
    if isinstance(exc, SyntaxError):
        line = f", line {exc.lineno}" if exc.lineno else ""
        detail = f"SyntaxError: {exc.msg} ({exc.filename or where}{line})"
    else:
        detail = f"{type(exc).__name__}: {exc}"
    message = f"--env {spec!r}: importing {where} failed: {detail}"
    return ImportError(message) if isinstance(exc, ImportError) else ValueError(message)


def _module_file(module_name: str) -> str:
    """``module 'name' (its file)``, for messages: the file where it can be found."""
    try:
        found = importlib.util.find_spec(module_name)
    except Exception:  # noqa: BLE001 - a parent package that fails to import; the name says enough
        found = None
    origin = getattr(found, "origin", None)
    return f"module {module_name!r} ({origin})" if origin else f"module {module_name!r}"


def _import_module(spec: str, module_name: str) -> Any:
    # A console script does not put the working directory on sys.path, but a user who writes
    # `--env my_env:MyEnv` means the my_env.py they are looking at (as `--reward module:function`).
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise _fail(spec, f"no module named {module_name!r}") from exc
        raise _import_failed(spec, _module_file(module_name), exc) from exc
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raised, as one line naming it
        raise _import_failed(spec, _module_file(module_name), exc) from exc


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
    except BaseException as exc:
        del sys.modules[module_name]
        if isinstance(exc, Exception):  # not KeyboardInterrupt / SystemExit
            raise _import_failed(spec, str(path), exc) from exc
        raise
    return module


def load_environment(spec: str) -> Any:
    """The environment class (or zero-argument factory) that ``spec`` names.

    Args:
        spec: a key of :data:`BUILTIN_ENVIRONMENTS`; ``module:Class`` (an importable module,
            ``Class`` may be dotted: ``Outer.Inner``; the module is looked for on ``sys.path`` and in
            the current directory); or ``path/to/file.py:Class`` (the file is imported by its path,
            as a module of its own).

    Raises:
        ValueError: an unknown name, a spec of neither form, a missing file or module, or no such
            callable in it; the message names ``--env``, the spec, what was expected and the
            built-in names. Also an exception the module or file raised while importing (a syntax
            error included), as ImportError where it was one (a package it imports is missing):
            the message names ``--env``, the file and the original error.
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
        module = _import_module(spec, where)
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise _fail(spec, f"{where!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise _fail(spec, f"{attribute!r} in {where!r} is a {type(target).__name__}, not a class or factory")
    return target


def declared_prompts(env: Any, attribute: str = "default_prompts") -> Optional[List[Mapping[str, Any]]]:
    """The prompt records an environment class declares: ``env.default_prompts()`` (or, with
    ``attribute``, ``default_eval_prompts()``), a class method; ``None`` when it declares none.

    Raises:
        EnvironmentContractError: the attribute is an instance method (pyppo calls it on the class,
            before any instance exists), not callable, or returned something else than a list of
            records (dicts with a ``"prompt"`` string); the message names the class.
    """
    method = getattr(env, attribute, None)
    if method is None:
        return None
    name = getattr(env, "__qualname__", None) or type(env).__name__
    expected = (
        f"a class method returning prompt records (@classmethod def {attribute}(cls) -> "
        '[{"prompt": ..., <fields reset takes>}, ...])'
    )
    if isinstance(env, type) and isinstance(inspect.getattr_static(env, attribute, None), types.FunctionType):
        raise EnvironmentContractError(
            f"environment {name}: {attribute} is an instance method, but pyppo calls it on the class before any "
            f"instance exists; expected {expected}"
        )
    if not callable(method):
        raise EnvironmentContractError(
            f"environment {name}: {attribute} is a {type(method).__name__}, not callable; expected {expected}"
        )
    records = method()
    if not isinstance(records, (list, tuple)):
        raise EnvironmentContractError(
            f"environment {name}: {attribute}() returned {type(records).__name__} {records!r:.200}; expected {expected}"
        )
    for record in records:
        if not isinstance(record, Mapping) or not isinstance(record.get("prompt"), str):
            raise EnvironmentContractError(
                f"environment {name}: {attribute}() returned {type(record).__name__} {record!r:.200} among its "
                f"records; expected {expected}"
            )
    return list(records)
