"""The ``pyppo`` command line (``pyppo ...`` or ``python -m pyppo ...``).

Subcommands:

* ``pyppo train``: PPO on a causal LM. With no arguments it runs the embedded default
  (SmolLM2-135M-Instruct, VADER sentiment reward, built-in prompts). Settings come from, in
  increasing priority: the trainer's defaults, the ``config.toml`` of ``--resume DIR``, ``--config
  FILE.toml``, then the flags. The resolved settings are written to ``<output>/config.toml`` before
  training starts, so every run can be reproduced or resumed from its own directory.
* ``pyppo info``: versions and build flags of the installed pyppo.
* ``pyppo bench``: pyppo's ops against the peers' eager code (:mod:`pyppo.bench`);
* ``pyppo profile``: where one PPO step's time and FLOPs go (:mod:`pyppo.cli.profile`).

User errors (a bad flag, a missing file, a bad config key, a reward that raises or returns NaN) end
with one line ``pyppo: error: ...`` and exit status 2; a run stopped by ``max_consecutive_skips``
non-finite updates ends the same way with status 1 (its last good checkpoint kept for
``--resume``). ``PYPPO_DEBUG=1`` shows the traceback instead. All configuration errors are
reported before any model is loaded.

SIGINT and SIGTERM stop a run without losing work (:mod:`pyppo.run.stopping`): exit status 130 / 143
after a checkpoint of the last finished step, with one line saying how to continue.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from .. import bench
from . import profile
from .flags import PROG, CLIError
from .info import cmd_info
from .train import add_train_arguments, cmd_train

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """Argument errors as one ``pyppo: error: ...`` line (with where to look), not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def _add_command(sub, name: str, module) -> None:
    """``pyppo <name>`` from a module with ``add_arguments(parser)`` and ``run(args)``; its
    docstring's first line is the help."""
    doc = (module.__doc__ or "").strip()
    p = sub.add_parser(name, help=doc.splitlines()[0] if doc else None, description=doc or None,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    p.set_defaults(func=module.run)


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
    add_train_arguments(p_train)
    p_train.set_defaults(func=cmd_train)

    p_info = sub.add_parser("info", help="versions and build flags")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_info.set_defaults(func=cmd_info)

    _add_command(sub, "bench", bench)
    _add_command(sub, "profile", profile)
    return parser


# Exceptions that mean "the user asked for something that cannot be done" rather than a bug:
# missing files (OSError), bad values (ValueError), missing packages (ImportError).
_USER_ERRORS = (CLIError, OSError, ValueError, ImportError)


@contextlib.contextmanager
def _plain_warnings():
    """pyppo's own warnings as ``pyppo: warning: ...`` lines: their file and line inside pyppo
    say nothing to a user. Other packages' warnings keep Python's format."""
    import warnings

    package = str(Path(__file__).resolve().parent.parent)
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
    args.command_line = argv is None  # this process is the command: it exits when main returns
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
