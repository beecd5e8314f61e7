"""The ``pyppo`` command line (``pyppo ...`` or ``python -m pyppo ...``).

Subcommands:

* ``pyppo train``: PPO on a causal LM. With no arguments it runs the embedded default
  (SmolLM2-135M-Instruct, VADER sentiment reward, built-in prompts). Settings come from, in
  increasing priority: the trainer's defaults, the ``config.toml`` of ``--resume DIR``, ``--config
  FILE.toml``, then the flags. The resolved settings are written to ``<output>/config.toml`` before
  training starts, so every run can be reproduced or resumed from its own directory.
* ``pyppo info``: versions and build flags of the installed pyppo.
* ``pyppo bench``: pyppo's ops against the peers' eager code (:mod:`pyppo.cli.bench`, on :mod:`pyppo.bench`);
* ``pyppo profile``: where one PPO step's time and FLOPs go (:mod:`pyppo.cli.profile`).
* ``pyppo export DIR``: a run's ``policy/`` written again from its checkpoint (:mod:`pyppo.cli.export`).

User errors (a bad flag, a missing file, a bad config key, a reward that raises or returns NaN) end
with one line ``pyppo: error: ...`` and exit status 2; a run stopped by ``max_consecutive_skips``
non-finite updates ends the same way with status 1 (its last good checkpoint kept for
``--resume``). ``PYPPO_DEBUG=1`` shows the traceback instead. All configuration errors are
reported before any model is loaded.

SIGINT and SIGTERM stop a run without losing work (:mod:`pyppo.run.stopping`): exit status 130 / 143
after a checkpoint of the last finished step, with one line saying how to continue; an error in a
step (a reward that raises) checkpoints the last finished step too, and says how to continue. Under
torchrun an error every process raised is said once, by rank 0 (the others exit 0); another is said
by the process that raised it, naming it (``process R of N``). Output into a
pipe whose reader has gone (``pyppo info | head``) ends the command quietly with status 141, as
SIGPIPE ends a C tool.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path

from . import bench, export, nproc, profile
from .flags import PROG, USER_ERRORS
from .info import cmd_info
from .train import add_train_arguments, cmd_train, resolve_train_config

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """Argument errors as one ``pyppo: error: ...`` line (with where to look), not a usage dump;
    no abbreviated flags. The subcommands' parsers are of this class too (``parser_class``)."""

    def __init__(self, *args, **kwargs):
        # An abbreviation is a guess at the flag meant: `pyppo train --grpo` would be
        # --grpo-std-normalize (already the default) and silently train GAE-PPO.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def plain_text(doc: str) -> str:
    """A docstring as ``--help`` shows it: reST's roles (``:mod:`x```, ``:func:`~x```) and double
    backquotes become plain single backquotes."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", doc)
    return doc.replace("``", "`")


def _add_command(sub, name: str, module) -> None:
    """``pyppo <name>`` from a module with ``add_arguments(parser)`` and ``run(args)``; its
    docstring's first line is the help."""
    doc = plain_text((module.__doc__ or "").strip())
    p = sub.add_parser(
        name,
        help=doc.splitlines()[0] if doc else None,
        description=doc or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    module.add_arguments(p)
    p.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="PPO for language models, with compiled ops.",
        epilog="Run `pyppo train` with no arguments for the embedded default (SmolLM2-135M, sentiment reward).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p_train = sub.add_parser(
        "train",
        help="train a policy with PPO",
        description="Train a causal LM with PPO. Flags override --config, which overrides "
        "--resume's config. Every setting is explained in docs/trainer.md. "
        "--batch-size alone (no --mini-batch-size) trains on the whole batch "
        "at once when the preset mini-batch size does not divide it.",
        allow_abbrev=False,
    )
    add_train_arguments(p_train)
    p_train.set_defaults(func=_train_command)

    p_info = sub.add_parser("info", help="versions and build flags", allow_abbrev=False)
    p_info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_info.set_defaults(func=cmd_info)

    _add_command(sub, "bench", bench)
    _add_command(sub, "profile", profile)
    _add_command(sub, "export", export)
    return parser


def _train_command(args: argparse.Namespace) -> int:
    """``pyppo train``: its settings resolved first (with ``--nproc N``, for N processes), then
    launched in N processes (:mod:`.nproc`) or trained in this one (:mod:`.train`). Neither module
    imports the other: this is where they meet."""
    if args.nproc is not None:
        nproc.check_launch(args.nproc)
        return nproc.launch(args, resolve_train_config(args, world_size=args.nproc))
    try:
        plan = resolve_train_config(args)
    except USER_ERRORS as exc:  # the settings are the same on every rank, and so is their error
        from ..distributed import mark_on_every_rank

        raise mark_on_every_rank(exc)
    return cmd_train(args, plan)


# Printed as one line, exit status 2 (flags.USER_ERRORS says which and why).
_USER_ERRORS = USER_ERRORS

# The commands that run PPO steps, and so run them on the allocator pyppo.run.allocator picks.
_PRELOADED = ("train", "profile")


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

    shown = warnings.showwarning

    # A warning said while the progress bar is drawn gets a line of its own, and the bar is drawn
    # again below it, not the text glued to the bar's: on a terminal the bar is cleared first
    # (tqdm.write's way); in a log file, which keeps every redraw, a new line is started.
    def clear_of_bars(message, category, filename, lineno, file=None, line=None):
        from tqdm import tqdm

        stream = file or sys.stderr
        isatty = getattr(stream, "isatty", None)
        if tqdm._instances and not (isatty and isatty()):
            stream.write("\n")
            shown(message, category, filename, lineno, file, line)
            return
        with tqdm.external_write_mode(file=stream):
            shown(message, category, filename, lineno, file, line)

    warnings.formatwarning, warnings.showwarning = plain, clear_of_bars
    try:
        yield
    finally:
        if warnings.formatwarning is plain:
            warnings.formatwarning = formatted
        if warnings.showwarning is clear_of_bars:
            warnings.showwarning = shown


#: The exit status when the reader of pyppo's output went away (``pyppo info | head``): what a
#: shell reports for a process that SIGPIPE ended, which is how C tools such as ``yes`` end.
CLOSED_OUTPUT_STATUS = 128 + 13  # SIGPIPE

_output_gone = False


def _reader_gone(fd: int) -> bool:
    """Whether ``fd`` is the write end of a pipe that no one reads any more (poll's POLLERR);
    a file or a terminal never is."""
    import select

    if not hasattr(select, "poll"):
        return True  # no poll (Windows): the BrokenPipeError was this stream's
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(event & select.POLLERR for _, event in poller.poll(0))


def _output_closed() -> bool:
    """Whether stdout or stderr is a pipe whose reader has gone; if so, that stream is pointed at
    /dev/null, so that nothing, not even the interpreter's last flush, tries it again."""
    global _output_gone
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if not _reader_gone(fd):
                continue
        except (OSError, ValueError, AttributeError):
            continue  # closed or replaced by the caller (no file descriptor): not ours to judge
        _output_gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return _output_gone


def _quiet_when_output_closes(entry):
    """``entry`` ending quietly with :data:`CLOSED_OUTPUT_STATUS` when its output's reader has
    gone, also while argparse prints ``--help`` or when the buffered output is flushed at the end
    (Python would print ``[Errno 32] Broken pipe`` or an ``Exception ignored`` traceback)."""
    import functools

    @functools.wraps(entry)
    def run(argv: list[str] | None = None) -> int:
        try:
            try:
                return entry(argv)
            finally:
                if not _output_gone:
                    sys.stdout.flush()
        except BrokenPipeError:
            if not _output_closed():
                raise
            return CLOSED_OUTPUT_STATUS

    return run


@_quiet_when_output_closes
def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pyppo`` and ``python -m pyppo``; returns the exit status
    (:data:`CLOSED_OUTPUT_STATUS` when the reader of its output went away)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = argv is None  # this process is the command: it exits when main returns
    args.argv = sys.argv[1:] if argv is None else list(argv)  # as given (pyppo train --nproc passes it on)
    try:
        if argv is None and args.command in _PRELOADED:
            from ..run.allocator import reexec_with_allocator

            reexec_with_allocator()  # returns unless it restarts this command with another malloc
        with _plain_warnings():
            status = args.func(args)
    except _USER_ERRORS as exc:
        if isinstance(exc, BrokenPipeError) and _output_closed():
            return CLOSED_OUTPUT_STATUS
        if os.environ.get("PYPPO_DEBUG"):
            raise
        status = _report(str(exc) or type(exc).__name__, exc, 2)
    except Exception as exc:
        from ..distributed import lost_a_peer

        if os.environ.get("PYPPO_DEBUG") or int(os.environ.get("WORLD_SIZE", "1")) < 2 or not lost_a_peer(exc):
            raise
        # gloo's "Connection closed by peer" says nothing that the other process's own error does not.
        status = _report(
            "another process stopped, so this one cannot go on (that process's own error says why; "
            "PYPPO_DEBUG=1 shows this one's traceback)",
            exc,
            1,
        )
    if argv is None:  # the command line: a signal while the process exits ends it quietly
        _exit_on_signals(int(status or 0))
    return int(status or 0)


def _report(message: str, exc: BaseException, status: int) -> int:
    """Print the error line (under torchrun, naming the process unless it is rank 0) and return
    the exit status.

    An error that every process raised at the same point (``distributed.raised_on_every_rank``: a
    reward that failed on any of them, a bad setting) is said once, by rank 0, whose status is the
    run's; the other ranks exit 0, so that torchrun does not stop rank 0 before it has said it.
    """
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return status
    from ..distributed import raised_on_every_rank  # torch: only under torchrun

    if raised_on_every_rank(exc):
        return 0
    print(f"{PROG}: error: process {rank} of {world}: {message}", file=sys.stderr)
    return status


def _exit_on_signals(status: int) -> None:
    """From now on SIGINT and SIGTERM end the process at once with ``status`` (its work is done;
    Python's default would print a ``KeyboardInterrupt`` traceback during shutdown)."""
    import signal

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: os._exit(status))


if __name__ == "__main__":
    sys.exit(main())
