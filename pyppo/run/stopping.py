"""Stopping a run on SIGINT (Ctrl-C) and SIGTERM (what SLURM, Kubernetes and ``kill`` send before
they kill) without losing work. Both signals are handled alike:

1. the first asks the run to stop after the current step: the step finishes, a checkpoint of it is
   written, and the run returns;
2. the second abandons the current step, when nothing of it has reached the weights yet (no
   optimizer step of it applied): its rollout is thrown away and the state of the last finished
   step (RNGs, prompt position, shuffle generator, counters) put back, so the checkpoint written
   is that step's, exactly. Once an optimizer step of it has been applied, the weights of the last
   finished step no longer exist, so the step is finished instead (its remaining updates) and
   checkpointed. A checkpoint save in progress always completes. The handler itself raises
   nothing: :class:`StepAbandoned` is raised at the next model forward or optimizer step
   (:meth:`GracefulStop.poll`, called from hooks), places where unwinding runs every cleanup,
   never from inside one (an exception raised by a handler could land in a ``finally``);
3. the third exits at once (status 128 + signal number). Checkpoints are swapped in atomically
   (:mod:`pyppo.run.checkpoint`), so the last complete one is kept, as after SIGKILL.

While the models load (until :meth:`GracefulStop.training`) there is nothing to keep: the first
signal exits at once. Messages are written with ``os.write``: a handler calling ``print`` while the
main code writes to the same stream (tqdm's bar) would raise a reentrant-call error.

Under several processes every rank receives the signal (``pyppo train --nproc``'s launcher sends
each one to every worker, :mod:`pyppo.cli.nproc`; plain torchrun forwards its own); the ranks agree
at each step boundary (:meth:`GracefulStop.should_stop`), and a step is never abandoned on one rank
alone: the second signal waits for the step's end there.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Callable, Iterator, List, Optional

from ..scratch import remove_all

__all__ = ["GracefulStop", "StepAbandoned", "STOP_SIGNALS"]

#: The signals handled (SIGINT and SIGTERM; SIGKILL cannot be caught).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _exit_now(status: int) -> None:
    remove_all()  # os._exit runs no finally and no atexit
    os._exit(status)


class StepAbandoned(BaseException):
    """Raised inside a step by the second signal. A ``BaseException``, like ``KeyboardInterrupt``,
    so that code catching ``Exception`` (a reward function, a library) lets it through."""


class GracefulStop:
    """The signal handlers of one run and what they have asked for.

    Args:
        say: whether this process writes the messages (rank 0 of a multi-process run).
        single_process: whether a step may be abandoned (not under several processes, whose
            collectives would wait forever for a rank that left the step).

    Attributes:
        signum: the first signal received, or ``None``.
        count: how many signals were received.
    """

    def __init__(self, *, say: bool = True, single_process: bool = True):
        self.say = say
        self.single_process = single_process
        self.signum: Optional[int] = None
        self.count = 0
        self.phase = "loading"
        self.abandonable = False
        self.abandon = False
        self.saving = False
        self._previous: List = []

    # ---------------------------------------------------------------------------- installation
    def install(self) -> "GracefulStop":
        """Handle SIGINT and SIGTERM from now on (main thread only); :meth:`uninstall` restores
        the previous handlers."""
        self._previous = [(s, signal.signal(s, self._handle)) for s in STOP_SIGNALS]
        return self

    def uninstall(self) -> None:
        for s, handler in self._previous:
            signal.signal(s, handler)
        self._previous = []

    @contextlib.contextmanager
    def installed(self, *, keep: bool = False) -> Iterator["GracefulStop"]:
        """The handlers for the ``with`` block. ``keep``: leave them installed after it (the
        process is about to exit; restoring Python's default would let a signal in the gap end it
        with a ``KeyboardInterrupt`` instead of the exit status of :meth:`_handle`)."""
        self.install()
        try:
            yield self
        finally:
            if not keep:
                self.uninstall()

    # ---------------------------------------------------------------------------- phases
    def training(self) -> None:
        """The models are loaded and the run directory exists: from now on signals stop gracefully."""
        self.phase = "training"

    def finishing(self) -> None:
        """Every step ran and was saved: a signal now exits at once (nothing is left to lose)."""
        self.phase = "done"

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_status(self) -> int:
        """``128 + signal number`` (130 for SIGINT, 143 for SIGTERM), the shells' convention."""
        return 128 + int(self.signum or signal.SIGINT)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one training step: a second signal may abandon it until :meth:`commit`."""
        self.abandonable = self.single_process
        try:
            yield
        finally:
            self.abandonable = False

    def poll(self, *_args) -> None:
        """Raise :class:`StepAbandoned` if a second signal asked to abandon this step (a forward
        pre-hook of each model calls this)."""
        if self.abandon and self.abandonable:
            self.abandonable = False
            raise StepAbandoned(self.signal_name)

    def commit(self, *_args) -> None:
        """The step is about to change the weights (an optimizer pre-step hook calls this): it is
        abandoned now if asked, else it can no longer be."""
        self.poll()
        self.abandonable = False

    @contextlib.contextmanager
    def save(self) -> Iterator[None]:
        """Around a checkpoint save: a second signal does not interrupt it."""
        self.saving, abandonable = True, self.abandonable
        self.abandonable = False
        try:
            yield
        finally:
            self.saving, self.abandonable = False, abandonable

    def should_stop(self, all_sum: Callable[[list], list]) -> bool:
        """Whether any rank received a signal (``all_sum`` sums a list over the ranks; a collective,
        so every rank calls this at the same point of each step)."""
        return all_sum([int(self.requested)])[0] > 0

    # ---------------------------------------------------------------------------- the handler
    def _write(self, text: str) -> None:
        if self.say:
            try:
                os.write(2, ("\n" + text + "\n").encode())
            except OSError:  # stderr closed: the status still says what happened
                pass

    def _handle(self, signum: int, _frame) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.phase != "training":
            what = "while loading" if self.phase == "loading" else "while finishing"
            self._write(f"pyppo: {name} {what}; exiting")
            _exit_now(128 + signum)
        if self.count == 1:
            self.signum = signum
            self._write(
                f"pyppo: {name}: stopping after the current step, then saving a checkpoint "
                "(again: abandon the step; a third time: exit at once)"
            )
            return
        if self.count == 2:
            if self.abandonable:
                self.abandon = True
                self._write(f"pyppo: {name}: abandoning the current step; saving the last finished one")
                return
            why = (
                "a checkpoint is being written"
                if self.saving
                else "the step is already updating the weights"
                if self.single_process
                else "the other processes are inside the step"
            )
            self._write(f"pyppo: {name}: {why}; it finishes first (a third time: exit at once)")
            return
        self._write(
            f"pyppo: {name}: exiting at once; a checkpoint already complete is kept (with none, "
            "the same command starts the run over)"
        )
        _exit_now(128 + signum)
