"""``pyppo train --nproc N``: N processes on this machine, started by torchrun
(``torch.distributed.run``) and supervised from here.

``torchrun --nproc-per-node N -m pyppo train ...`` runs the same processes; what this adds:

* **Checks first.** The settings are resolved for N processes before anything starts (the
  command's dispatcher, :mod:`pyppo.cli.main`, resolves them with
  :func:`pyppo.cli.train.resolve_train_config` and hands :func:`launch` the plan): a size that N
  processes cannot share, or a checkpoint written by another number of processes, is one line and
  exit status 2. The run directory is fixed here (``--output`` is passed on), so every process
  and the printed resume command name the same one.
* **Signals go to the workers, not to torchrun.** torchrun runs in a session of its own, so a
  Ctrl-C reaches only this process, which forwards each SIGINT / SIGTERM once to every worker,
  whose handlers count them (:mod:`pyppo.run.stopping`). torchrun never gets one: its own handling
  forwards the first and SIGKILLs every worker after its ``--shutdown-timeout`` (30 s by default),
  which one step of a real model outlasts, and the step and its checkpoint would be lost.
* **A quiet outcome.** torchrun runs inside :func:`agent`, which turns its report of a failed
  worker (a ``ChildFailedError`` traceback and log lines) into that worker's exit status: the
  workers say what happened themselves (rank 0 the stop and how to continue, or the error, a
  failing rank's included: :func:`pyppo.distributed.on_every_rank`). A worker killed by a signal
  (the OOM killer's SIGKILL) is named in one line.

Exit status: the first failed worker's (130 / 143 after a stop, 2 for a user error), 0 when every
worker succeeded.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
from typing import List, Optional

from .flags import PROG, CLIError

__all__ = ["check_launch", "launch", "agent", "worker_words", "worker_pids"]


def worker_words(argv: List[str], output: Optional[str]) -> List[str]:
    """The workers' command line: ``argv`` (``train ...``, as given) without ``--nproc N`` or
    ``--nproc=N`` (pyppo's parsers take no abbreviation of it), and with ``--output output``
    appended when ``output`` is not ``None``."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--nproc":
            skip = True
        elif not word.startswith("--nproc="):
            words.append(word)
    return words + (["--output", output] if output is not None else [])


def worker_pids(agent_pid: int) -> List[int]:
    """The processes torchrun started, the children of ``agent_pid`` (``[]`` before it has
    started them, or where they cannot be listed)."""
    try:
        import psutil  # a dependency of peft, and so of pyppo

        return [child.pid for child in psutil.Process(agent_pid).children()]
    except ImportError:  # pragma: no cover - psutil comes with peft
        pass
    except Exception:  # the agent is gone
        return []
    pids: List[int] = []  # pragma: no cover - Linux without psutil
    try:
        for task in os.listdir(f"/proc/{agent_pid}/task"):
            with open(f"/proc/{agent_pid}/task/{task}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
    except OSError:
        return []
    return pids


def check_launch(nproc: int) -> None:
    """What ``--nproc N`` needs before the settings are resolved for N processes.

    Raises:
        CLIError: N < 1, or this process runs under torchrun already.
    """
    if nproc < 1:
        raise CLIError(f"--nproc must be >= 1, got {nproc}")
    if "RANK" in os.environ:
        raise CLIError("--nproc inside torchrun: launch either with torchrun or with --nproc, not both")


def launch(args: argparse.Namespace, plan) -> int:
    """Run ``pyppo train`` (``args``, parsed from ``args.argv``) in ``args.nproc`` processes under
    torchrun and wait for them (see the module docstring); ``plan`` is its settings resolved for
    that many processes (:class:`pyppo.cli.train.TrainPlan`, after :func:`check_launch`). Returns
    the exit status."""
    nproc = args.nproc
    argv = getattr(args, "argv", None)
    words = worker_words(
        sys.argv[1:] if argv is None else list(argv), str(plan.output) if args.output is None else None
    )
    env = dict(os.environ)
    # torchrun would set 1 (and say so): the processes share the machine's cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    torchrun = ["--standalone", "--nproc-per-node", str(nproc), "-m", "pyppo", *words]
    print(f"{PROG}: running torchrun {shlex.join(torchrun)}", file=sys.stderr)
    agent_process = subprocess.Popen(
        [sys.executable, "-m", "pyppo.cli.nproc", *torchrun], env=env, start_new_session=True
    )

    def forward(signum, _frame):
        if agent_process.poll() is not None:
            return
        pids = worker_pids(agent_process.pid)
        if not pids:  # torchrun is still starting them: nothing is loaded; it stops what it started
            agent_process.send_signal(signal.SIGTERM)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = agent_process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - status if status < 0 else status


def agent(argv: List[str]) -> int:
    """torchrun (``torch.distributed.run``'s ``run``) with the command line ``argv``, its own
    output silenced; returns the exit status of the first worker that failed (128 + the signal
    for one killed by a signal, after one line naming it), or 0."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    config = parse_args(argv)
    say = sys.stderr
    # torchrun's log lines (torch's handlers hold the real stderr: logging itself is turned off)
    # and its failure report: the workers, which write to the inherited descriptor 2, have said
    # what there is to say.
    logging.disable(logging.CRITICAL)
    sys.stderr = open(os.devnull, "w")
    try:
        run(config)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        print(f"{PROG}: error: process {rank} of {config.nproc_per_node} was killed by {name}", file=say)
        return 128 - failure.exitcode
    except SignalException as exc:  # SIGTERM from launch() before the workers started
        return 128 + int(exc.sigval)
    except Exception as exc:
        if os.environ.get("PYPPO_DEBUG"):
            sys.stderr = say
            raise
        print(f"{PROG}: error: torchrun failed: {type(exc).__name__}: {exc}", file=say)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(agent(sys.argv[1:]))
