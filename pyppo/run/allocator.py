"""Which ``malloc`` a training process runs on, and switching to a better one.

A PPO step allocates activations whose sizes change from step to step (prompt and response
lengths vary). glibc's heap keeps the holes this leaves, so a process's resident memory grows well
past its live memory; jemalloc and tcmalloc return it. They are chosen the way the field does
(vLLM's CPU backend preloads tcmalloc): ``LD_PRELOAD`` of a system library, set before the process
starts, since an allocator cannot be swapped once memory has been handed out.

``pyppo train`` and ``pyppo profile`` call :func:`reexec_with_allocator` first thing: when the
preferred allocator is installed and not yet loaded, the command re-executes itself with it
preloaded (the cost is one more interpreter start). ``PYPPO_ALLOCATOR`` picks it: ``auto`` (the
default: :data:`PREFERRED` when installed, else glibc's), ``jemalloc``, ``tcmalloc``, or
``system`` to keep whatever the process started with. The measurements behind the choice are in
docs/performance.md ("Memory allocator").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

__all__ = [
    "ALLOCATORS",
    "PREFERRED",
    "ENV",
    "active_allocator",
    "find_allocator",
    "wanted_allocator",
    "planned_allocator",
    "preload_env",
    "reexec_with_allocator",
]

#: The allocators pyppo knows, each with the shared libraries that provide it (Debian's
#: ``libjemalloc2`` and ``libtcmalloc-minimal4``/``libgoogle-perftools4``).
ALLOCATORS: Dict[str, Sequence[str]] = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
}

#: What ``auto`` preloads when it is installed (docs/performance.md has the comparison).
PREFERRED = "tcmalloc"

#: The environment variable that picks the allocator.
ENV = "PYPPO_ALLOCATOR"

# Set in the re-executed process, so that a library that does not load can never cause a loop.
_REEXEC_MARK = "PYPPO_ALLOCATOR_REEXEC"

_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib64",
    "/lib",
)


def find_allocator(name: str) -> Optional[str]:
    """The path of an installed library for allocator ``name``, or ``None``.

    Looks in the interpreter's prefix (a conda environment's ``lib``), then the system's library
    directories.

    Raises:
        ValueError: ``name`` is not in :data:`ALLOCATORS`.
    """
    if name not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}; got {name!r}")
    for directory in (os.path.join(sys.prefix, "lib"), *_LIB_DIRS):
        for lib in ALLOCATORS[name]:
            path = os.path.join(directory, lib)
            if os.path.isfile(path):
                return path
    return None


def active_allocator(maps: str = "/proc/self/maps") -> str:
    """The allocator this process runs on: ``jemalloc``, ``tcmalloc`` or ``glibc`` (the default
    one of the C library: what is left when neither is mapped). Read from the libraries mapped into
    the process, so it is right however the library got there (``LD_PRELOAD``, a wrapper script)."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return "unknown"
    for name in ALLOCATORS:
        if f"lib{name}" in text:
            return name
    return "glibc"


def wanted_allocator(env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The allocator ``PYPPO_ALLOCATOR`` asks for, ``None`` for ``system``.

    Raises:
        ValueError: an unknown value, naming the variable and the choices.
    """
    value = (env if env is not None else os.environ).get(ENV, "auto").strip().lower() or "auto"
    if value == "system":
        return None
    if value == "auto":
        return PREFERRED
    if value not in ALLOCATORS:
        raise ValueError(f"{ENV}={value!r}: expected auto, system, {', '.join(ALLOCATORS)}")
    return value


def preload_env(name: str, env: Optional[Dict[str, str]] = None) -> Optional[Dict[str, str]]:
    """A copy of ``env`` (default ``os.environ``) that preloads allocator ``name``, or ``None``
    when it is not installed. An existing ``LD_PRELOAD`` is kept, after the allocator."""
    path = find_allocator(name)
    if path is None:
        return None
    env = dict(os.environ if env is None else env)
    rest = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p and p != path]
    env["LD_PRELOAD"] = " ".join([path, *rest])
    return env


def planned_allocator() -> str:
    """The allocator ``pyppo train`` and ``pyppo profile`` run on when started like this process:
    the one already loaded when it is not glibc's (a preload cannot be swapped), else the one
    ``PYPPO_ALLOCATOR`` asks for when it is installed, else glibc's. What ``pyppo info`` reports
    and :func:`reexec_with_allocator` switches to.

    Raises:
        ValueError: ``PYPPO_ALLOCATOR`` holds an unknown value.
    """
    wanted, active = wanted_allocator(), active_allocator()
    if wanted is None or active != "glibc":
        return active
    return wanted if find_allocator(wanted) is not None else "glibc"


def reexec_with_allocator(argv: Optional[Sequence[str]] = None) -> None:
    """Re-execute this process with the allocator ``PYPPO_ALLOCATOR`` asks for preloaded, when it
    is installed and not loaded yet; otherwise return and change nothing.

    Args:
        argv: the command line to run again (default ``sys.orig_argv``: the interpreter, its
            options and the script or ``-m pyppo``, as they were given).

    Raises:
        ValueError: ``PYPPO_ALLOCATOR`` holds an unknown value.
    """
    name, active = planned_allocator(), active_allocator()
    if name == active or os.environ.get(_REEXEC_MARK) or not sys.platform.startswith("linux"):
        wanted, explicit = wanted_allocator(), os.environ.get(ENV, "auto").strip().lower() not in ("", "auto")
        if explicit and wanted not in (None, active) and active != "glibc":  # a preload cannot be swapped
            print(
                f"pyppo: {ENV}={wanted}: this process already runs on {active} (LD_PRELOAD), which "
                "cannot be swapped; keeping it",
                file=sys.stderr,
            )
        return
    env = preload_env(name)  # installed: planned_allocator found it
    env[_REEXEC_MARK] = "1"
    argv = list(argv if argv is not None else sys.orig_argv)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:  # not executable from here (a frozen or embedded interpreter): run on glibc's
        return
