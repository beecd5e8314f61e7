"""The run loop: steps until ``config.steps``, with logs, the progress bar, held-out evaluation,
checkpoint and export cadences, and the signal hooks that stop a run without losing work.

The loop drives the algorithm of :class:`pyppo.trainer.PPOTrainer` (``step``, ``state_dict``)
and calls this package's checkpoint, evaluation and export on it; :class:`pyppo.run.trainer.PPOTrainer`
sits above the loop and calls it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .. import distributed
from . import checkpoint, evaluate, export, trackers
from .config_file import record_python_run
from .doctor import Doctor
from .nonfinite import NonFiniteRolloutError, NonFiniteUpdateError, check_weights_finite
from .quiet import quiet_libraries
from .rundir import RunDir
from .stopping import GracefulStop, StepAbandoned

if TYPE_CHECKING:
    from ..trainer import PPOTrainer

__all__ = ["train"]


def train(
    trainer: PPOTrainer, output_dir: str | os.PathLike, *, progress: bool = True, stop: Optional[GracefulStop] = None
) -> List[Dict[str, float]]:
    """Run ``trainer``'s steps ``step_count + 1 … config.steps``, logging to ``output_dir``.

    Appends one JSON object per step to ``metrics.jsonl`` and, with ``log_samples``, one per
    sample (``step``, ``prompt``, ``response``, raw ``score``) to ``samples.jsonl``; with
    ``eval_every``, evaluates on the eval prompts (:func:`~pyppo.run.evaluate.evaluate_prompts`), adds ``eval/*``
    to that step's row and appends the samples to ``eval_samples.jsonl``. After each step the
    doctor (:class:`~pyppo.run.doctor.Doctor`, ``config.doctor``) adds ``doctor/*`` to its row and
    warns when the step could not have taught anything. Every ``save_every``
    steps and after the last step it writes ``checkpoint/`` and the policy as a Hugging Face
    directory, ``policy/``. Rows logged after the checkpoint being resumed (a run killed before
    it checkpointed them) and a torn last line are dropped first, with a warning. With
    ``report_to``, rank 0 also logs each step's metrics and samples to those experiment trackers
    (:func:`pyppo.run.trackers.reporting`), finished when this returns or raises. To resume,
    call :func:`~pyppo.run.checkpoint.load_trainer` first. With several processes every rank calls this; rank 0
    writes.

    ``stop`` (installed :class:`~pyppo.run.stopping.GracefulStop` handlers): after a SIGINT or
    SIGTERM the loop ends after the current step, or without it when a second signal abandons
    it (the state of the last finished step is put back), and a checkpoint of the last
    finished step is written if none is; then this returns (``trainer.step_count`` tells where
    it stopped).

    An error in a step (a reward that raises, say) is treated like that second signal: when none
    of the step's optimizer steps ran, the state of the last finished step is put back and
    checkpointed (if no checkpoint holds it yet) before the error propagates, so that
    ``--resume`` loses nothing. Under several processes only errors that every rank raises at the
    same point (:func:`pyppo.distributed.on_every_rank`: the reward's) can be checkpointed so. An
    error in the held-out evaluation comes after its step finished: that step is logged (without
    ``eval/*``) and checkpointed first.

    Returns:
        the metrics of the steps run now.

    Raises:
        ImportError: a tracker of ``report_to`` is not installed (one line naming the extra to
            install), before anything is written.
        NonFiniteUpdateError: as ``trainer.step``, or a checkpoint due while a trained weight is
            NaN/inf (it is not written, so that it cannot replace a good one); the step is not
            checkpointed, and the message names the last good checkpoint (the last one whose
            weights are finite and did not give the non-finite rollout), or says that none is.
            When the step's updates were all skipped (none reached the weights), the last finished
            step is checkpointed first, as after any other error, and named.
        Exception: whatever a step raised, after the checkpoint above.
    """
    from tqdm.auto import tqdm

    run, c, main = RunDir(output_dir), trainer.config, trainer.world.is_main
    trackers.check_trackers(c.report_to)  # before the run directory is made
    if main:
        run.path.mkdir(parents=True, exist_ok=True)
        run.truncate_logs(trainer.step_count)
        record_python_run(trainer, run)  # config.toml, unless `pyppo train` wrote it
    history: List[Dict[str, float]] = []
    # The step the newest checkpoint holds, when it is the current state (0: nothing to save).
    saved_step = trainer.step_count if trainer.step_count in (0, trainer.resumed_step) else None
    stopped = False
    saving = stop.save if stop is not None else contextlib.nullcontext
    updates = _UpdateWatch(trainer)
    doctor = Doctor(trainer, log=run.metrics)  # says what a step could not teach; resumes its state
    with (
        trackers.reporting(trainer, run.path) as reporting,  # config.report_to, on rank 0
        tqdm(
            total=c.steps, initial=trainer.step_count, desc="ppo", disable=not (progress and main), dynamic_ncols=True
        ) as bar,
        _signal_hooks(trainer, stop),
        updates,
        quiet_libraries(),
        doctor,
    ):
        while trainer.step_count < c.steps:
            if stop is not None and stop.should_stop(lambda v: distributed.all_sum(v, trainer.world)):
                stopped = True
                break
            start_state = _step_start_state(trainer)
            updates.reset()
            try:
                with stop.step() if stop is not None else contextlib.nullcontext():
                    result = trainer.step()
            except StepAbandoned:
                _restore_step_start(trainer, start_state)
                stopped = True
                break
            except NonFiniteUpdateError as exc:
                # Skipped updates left the weights as they were (a huge score, say): keep the last
                # finished step as for any error. Not after a non-finite rollout: those weights gave it.
                if not isinstance(exc, NonFiniteRolloutError) and not updates.applied and _together(exc, trainer):
                    saved_step = _keep_finished_step(trainer, run, start_state, saving, saved_step)
                raise _naming_last_good(exc, run, saved_step == trainer.step_count) from exc
            except Exception as exc:
                if not updates.applied and _together(exc, trainer):
                    # Nothing of the step reached the weights: keep the last finished step, as a
                    # second signal would.
                    saved_step = _keep_finished_step(trainer, run, start_state, saving, saved_step)
                raise
            doctor.examine(result)  # adds doctor/* to the step's metrics
            last_step = trainer.step_count == c.steps
            eval_rows: List[dict] = []
            eval_error: Optional[Exception] = None
            if trainer.eval_prompts and (last_step or (c.eval_every and trainer.step_count % c.eval_every == 0)):
                try:
                    eval_metrics, eval_rows = evaluate.evaluate_prompts(trainer)
                    result.metrics.update(eval_metrics)
                except Exception as exc:
                    if not _together(exc, trainer):
                        raise
                    eval_error = exc  # raised once the finished step is logged and checkpointed
            history.append(result.metrics)
            _log(trainer, run, result, eval_rows, reporting)
            bar.update(1)
            bar.set_postfix(score=f"{result.metrics['score_mean']:.3f}", kl=f"{result.metrics['kl_mean']:.3f}")
            due = last_step or (c.save_every and trainer.step_count % c.save_every == 0)
            if due or eval_error is not None:
                try:  # a checkpoint of non-finite weights would replace the last good one
                    check_weights_finite(trainer, f"step {trainer.step_count}")
                except NonFiniteUpdateError as exc:
                    raise _naming_last_good(exc, run, False) from exc
                with saving():
                    checkpoint.save_trainer(trainer, run.checkpoint)
                    if due:
                        export.export_trainer_policy(trainer, run.policy)
                saved_step = trainer.step_count
            if eval_error is not None:
                raise eval_error
        if stopped and saved_step != trainer.step_count:
            try:
                check_weights_finite(trainer, f"step {trainer.step_count}")
            except NonFiniteUpdateError as exc:
                raise _naming_last_good(exc, run, False) from exc
            with stop.save():  # the last finished step, so that --resume loses nothing
                checkpoint.save_trainer(trainer, run.checkpoint)
    return history


def _keep_finished_step(
    trainer: PPOTrainer, run: RunDir, start_state: dict, saving, saved_step: Optional[int]
) -> Optional[int]:
    """Put back the state of the last finished step (``start_state``) after a step that failed
    before any optimizer step, and checkpoint it unless ``saved_step`` (the step the newest
    checkpoint holds) is it. Returns the step the newest checkpoint holds now. A checkpoint that
    cannot be written (or whose weights are NaN/inf) is a warning: the step's error is the one
    to report."""
    _restore_step_start(trainer, start_state)
    if saved_step == trainer.step_count:
        return saved_step
    try:
        check_weights_finite(trainer, f"step {trainer.step_count}")
        with saving():
            checkpoint.save_trainer(trainer, run.checkpoint)
    except Exception as save_error:
        warnings.warn(
            f"the checkpoint of step {trainer.step_count} could not be written: {save_error}",
            RuntimeWarning,
            stacklevel=3,
        )
        return saved_step
    return trainer.step_count


def _together(exc: BaseException, trainer: PPOTrainer) -> bool:
    """Whether every rank raised ``exc`` at the same point, so that they can checkpoint together
    (always, with one process)."""
    return not trainer.world.active or distributed.raised_on_every_rank(exc)


def _naming_last_good(exc: NonFiniteUpdateError, run: RunDir, holds_current: bool) -> NonFiniteUpdateError:
    """``exc`` (same class) with the checkpoint to go back to appended. ``holds_current``: the
    newest checkpoint holds the current weights, which gave a non-finite rollout if ``exc`` is a
    :class:`NonFiniteRolloutError`: that checkpoint is not good either (``--lr 1e30`` reaches
    finite but useless weights in one step)."""
    last = run.find_checkpoint()
    if last is None:
        where = "no checkpoint was written"
    elif holds_current and isinstance(exc, NonFiniteRolloutError):
        where = (
            f"no checkpoint is good to resume from: {str(last)!r} (step {checkpoint.saved_step(last)}) holds "
            "the weights that gave this rollout; start the run over"
        )
    else:
        where = f"the last good checkpoint is {str(last)!r} (step {checkpoint.saved_step(last)})"
    return type(exc)(f"{exc}; {where}")


class _UpdateWatch:
    """Whether an optimizer step ran since :meth:`reset`: until one does, the weights are still
    those of the last finished step (a pre-hook of each optimizer's ``step`` tells)."""

    def __init__(self, trainer: PPOTrainer):
        self.optimizers = _optimizers(trainer)
        self.applied = False
        self._handles: list = []

    def reset(self) -> None:
        self.applied = False

    def _seen(self, *_args) -> None:
        self.applied = True

    def __enter__(self) -> "_UpdateWatch":
        self._handles = [o.register_step_pre_hook(self._seen) for o in self.optimizers]
        return self

    def __exit__(self, *_exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _optimizers(trainer: PPOTrainer) -> list:
    return [part.optimizer for part in trainer.checkpoint_parts().values() if part is not None]


@contextlib.contextmanager
def _signal_hooks(trainer: PPOTrainer, stop: Optional[GracefulStop]):
    """While the loop runs: a signal is acted on at the next forward of any model (a step may be
    abandoned there) and no optimizer step starts once it may not (``stop.commit``)."""
    handles = (
        []
        if stop is None
        else (
            [opt.register_step_pre_hook(stop.commit) for opt in _optimizers(trainer)]
            + [m.register_forward_pre_hook(stop.poll) for m in trainer.models.forward_models()]
        )
    )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _step_start_state(trainer: PPOTrainer) -> dict:
    """What a step changes before its first optimizer step (cheap to copy): put back by
    :func:`_restore_step_start` when the step is abandoned, so that a checkpoint written then is
    exactly the last finished step's."""
    return {"rng": checkpoint.capture_rng(), **trainer.state_dict()}


def _restore_step_start(trainer: PPOTrainer, state: dict) -> None:
    checkpoint.restore_rng(state["rng"])
    trainer.load_state_dict(state)
    trainer.zero_grad()


def _log(trainer: PPOTrainer, run: RunDir, result: Any, eval_rows: List[dict], reporting: trackers.Trackers) -> None:
    """Append the step's metrics, and its samples (every rank's, with ``log_samples``) and
    held-out rows, to the run's logs and ``reporting``'s trackers (rank 0 writes)."""
    b = result.batch
    samples = (
        [
            {"step": trainer.step_count, "prompt": p, "response": r, "score": s}
            for p, r, s in zip(b.prompts, b.responses, b.raw_scores.tolist())
        ]
        if trainer.config.log_samples
        else []
    )
    if samples and b.episodes is not None:  # each episode's transcript, turn by turn
        for row, e in zip(samples, b.episodes):
            row.update(
                group=e.group, turns=e.turns, truncated=e.truncated, tool_calls=e.tool_calls, transcript=e.transcript
            )
    samples = [row for rank_rows in distributed.gather_objects(samples, trainer.world) for row in rank_rows]
    if not trainer.world.is_main:
        return
    run.append("metrics.jsonl", [result.metrics])
    run.append("samples.jsonl", samples)
    run.append("eval_samples.jsonl", eval_rows)
    reporting.log(result.metrics, trainer.step_count)
    reporting.log_samples(samples, trainer.step_count)
    reporting.log_samples(eval_rows, trainer.step_count, "eval_samples")
