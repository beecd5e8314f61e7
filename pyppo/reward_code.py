"""A reward from the user's own code (``--reward module:function``, ``--reward
file.py:function``): importing it, an import that fails named at the reward file's line, and a
hint for a ``.py`` spec without its function. :func:`pyppo.rewards.load_reward` calls these."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import linecache
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

__all__ = ["function_hint", "import_failed", "load_function"]


def load_function(spec: str) -> Callable:
    """Import ``module:function`` or ``file.py:function`` (``function`` may be dotted)."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected 'module:function'")
    if module_name.endswith(".py"):
        file = Path(module_name).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"reward {spec!r}: file {module_name!r} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"pyppo_user_reward_{file.stem}", file)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as exc:
            raise import_failed(spec, exc) from exc
    else:
        # A console script does not put the working directory on sys.path, but a user who writes
        # `--reward myreward:score` means the myreward.py they are looking at.
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.append(cwd)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise ModuleNotFoundError(f"reward {spec!r}: cannot import module {module_name!r}") from exc
            raise import_failed(spec, exc) from exc  # the module exists but one of *its* imports is missing
        except Exception as exc:
            raise import_failed(spec, exc) from exc
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        kind = type(obj).__name__
        raise TypeError(
            f"reward {spec!r}: {attr!r} is {'an' if kind[:1] in 'aeiouAEIOU' else 'a'} {kind}, not a function"
        )
    return obj


def import_failed(spec: str, exc: Exception) -> ImportError:
    """The error for a reward module whose own code raised ``exc`` while it was imported: it
    names the module's file and line (the first module-level frame of the traceback, i.e. the
    statement of the reward's file that failed, also when the fault is in what it imports) and
    the error. An ``ImportError`` (``ModuleNotFoundError`` for a missing module, keeping its
    ``name``), so the CLI says it in one line."""
    where = None
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        where = (exc.filename, exc.lineno)  # the file that cannot be compiled has no frame
    else:
        for frame, line in traceback.walk_tb(exc.__traceback__):
            if frame.f_code.co_name == "<module>" and not frame.f_code.co_filename.startswith("<"):
                where = (frame.f_code.co_filename, line)
                break
    at = ""
    if where is not None:
        statement = linecache.getline(where[0], where[1]).strip()
        at = f" at {where[0]}, line {where[1]}" + (f" ({statement})" if statement else "")
    message = f"reward {spec!r}: importing it failed{at}: {type(exc).__name__}: {exc}"
    if isinstance(exc, ModuleNotFoundError):
        return ModuleNotFoundError(message, name=exc.name)
    return ImportError(message)


def function_hint(spec: str) -> str:
    """For a spec naming a Python file without its function (``r.py``): "; did you mean
    'r.py:FUNCTION'?" and the file's top-level functions, read with ``ast`` (never imported)."""
    path = Path(spec).expanduser()
    if not spec.endswith(".py") and not (path.is_file() and path.suffix == ".py"):
        return ""
    hint = f"; did you mean '{spec}:FUNCTION'?"
    if not path.is_file():
        return f"{hint} (there is no file {spec!r})"
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return hint
    names = [
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
    ]
    if not names:
        return f"{hint} ({spec!r} defines no top-level function)"
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"{hint} (its functions: {shown})"
