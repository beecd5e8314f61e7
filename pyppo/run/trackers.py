"""Experiment trackers (``PPOConfig.report_to``): TensorBoard, Weights & Biases, Trackio and MLflow
get each step's metrics (the numbers of ``metrics.jsonl``), the samples (those of
``samples.jsonl`` and ``eval_samples.jsonl``) as a table, and the resolved configuration (the
run's ``config.toml``) once.

One small class per tracker, each behind the same four calls (:class:`Tracker`) and each using the
tracker's own package, imported only when a run asks for it. By default every tracker stays on
this machine, under the run directory (TensorBoard's ``tensorboard/``, W&B's offline
``wandb/``, Trackio's ``trackio/``, MLflow's ``mlruns/``); the user's own settings of the
trackers (``WANDB_MODE``, ``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``, ``TRACKIO_DIR``, ...) win
over those defaults. The trackers' own telemetry is switched off unless the user switched it on
(:data:`TELEMETRY_OFF`), and they print nothing into the run's output (W&B's ``silent``; what
Trackio prints held back, :func:`_trackio_quiet`). ``trackers.json`` in the run directory keeps
each tracker's run id, so that a resumed run goes on logging to the same tracker run.

Only rank 0 of a run with several processes reports (:func:`reporting`); the others create
nothing.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..config.knobs import TRACKER_MODULES, installed_trackers

if TYPE_CHECKING:
    from ..trainer import PPOTrainer

__all__ = [
    "PACKAGES",
    "DISTRIBUTIONS",
    "TRACKIO_SYSTEM_METRICS",
    "TELEMETRY_OFF",
    "STATE_FILE",
    "Tracker",
    "TensorBoardTracker",
    "WandbTracker",
    "TrackioTracker",
    "MlflowTracker",
    "CLASSES",
    "Trackers",
    "check_trackers",
    "installed_trackers",
    "tracker_versions",
    "reporting",
]

#: The modules each tracker needs (``pip install 'pyppo[<tracker>]'`` installs them).
PACKAGES = TRACKER_MODULES

#: Environment variables set (``os.environ.setdefault``: a value the user set wins) before a
#: tracker's package is imported, which switch off what it would send home: W&B's error reports
#: (wandb/env.py ``WANDB_ERROR_REPORTING``, read by its service process) and MLflow 3's usage
#: telemetry (mlflow/telemetry/utils.py ``MLFLOW_DISABLE_TELEMETRY``). TensorBoard's writer and
#: Trackio (0.43) send none.
TELEMETRY_OFF: Dict[str, Dict[str, str]] = {
    "wandb": {"WANDB_ERROR_REPORTING": "false"},
    "mlflow": {"MLFLOW_DISABLE_TELEMETRY": "true"},
}

#: The file of the run directory that keeps each tracker's run id, for a resume.
STATE_FILE = "trackers.json"

#: The project (W&B, Trackio) or experiment (MLflow) of a run, unless the user names one.
PROJECT = "pyppo"


def check_trackers(names: Sequence[str]) -> None:
    """Check that the package of each tracker in ``names`` is installed, without importing it
    (``importlib.util.find_spec``), so that a missing one is said before any model loads.

    Raises:
        ImportError: one line naming each missing tracker, its package and the extra to install
            (``pip install 'pyppo[wandb]'``).
    """
    missing = [name for name in names if any(importlib.util.find_spec(m) is None for m in PACKAGES[name])]
    if missing:
        raise ImportError("report_to: " + "; ".join(_missing(name) for name in missing))


#: The distributions that install each tracker's packages, for ``pyppo info``: one of each
#: tuple (the first one installed is named; MLflow's client comes as ``mlflow`` or
#: ``mlflow-skinny``).
DISTRIBUTIONS: Dict[str, Tuple[Tuple[str, ...], ...]] = {
    "tensorboard": (("tensorboard",),),
    "wandb": (("wandb",),),
    "trackio": (("trackio",),),
    "mlflow": (("mlflow", "mlflow-skinny"), ("pandas",)),
}


def tracker_versions() -> Dict[str, Optional[Dict[str, Any]]]:
    """Each tracker's installed distribution, from the packages' metadata (``importlib.metadata``:
    nothing is imported): ``{"package": ..., "version": ...}`` (with ``"missing"``: the other
    distributions it needs that are not installed, if any), or ``None`` when its own is not."""
    from importlib import metadata

    def found(names: Tuple[str, ...]) -> Optional[Tuple[str, str]]:
        for name in names:
            try:
                return name, metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    out: Dict[str, Optional[Dict[str, Any]]] = {}
    for tracker, (own, *others) in DISTRIBUTIONS.items():
        hit = found(own)
        if hit is None:
            out[tracker] = None
            continue
        out[tracker] = {"package": hit[0], "version": hit[1]}
        missing = [names[0] for names in others if found(names) is None]
        if missing:
            out[tracker]["missing"] = missing
    return out


def _missing(name: str) -> str:
    packages = " and ".join(PACKAGES[name])
    return f"{name} needs the {packages} package{'s' if len(PACKAGES[name]) > 1 else ''}: pip install 'pyppo[{name}]'"


def _import(name: str, module: str):
    """``module`` for the tracker ``name``, with its telemetry off first.

    Raises:
        ImportError: the one line of :func:`check_trackers` (a package that is missing or broken).
    """
    for key, value in TELEMETRY_OFF.get(name, {}).items():
        os.environ.setdefault(key, value)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"report_to: {_missing(name)} ({exc})") from exc


class Tracker(abc.ABC):
    """One experiment tracker of a run: :meth:`start` once, then :meth:`log` and
    :meth:`log_samples` for each step, :meth:`finish` at the end (also after an error)."""

    #: The ``report_to`` name.
    name = ""

    @abc.abstractmethod
    def start(self, run_dir: Path, config: Mapping[str, Any], resumed_step: int) -> None:
        """Open the tracker's run for the run directory ``run_dir``.

        Args:
            config: the resolved settings (the run's ``config.toml``: every ``PPOConfig`` key and
                the run's sources), logged once.
            resumed_step: the step the run goes on from (``trainer.step_count``); above 0, the
                tracker run named in ``trackers.json`` is continued where the tracker can.
        """

    @abc.abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Log a step's metrics (name -> float, a NaN or infinite one as it is) at ``step``."""

    @abc.abstractmethod
    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "samples") -> None:
        """Log ``rows`` (one dict per sample, as ``samples.jsonl``'s lines) as the table ``table``."""

    @abc.abstractmethod
    def finish(self, failed: bool = False) -> None:
        """Close the tracker's run; ``failed``: the run ended with an error."""


#: The metrics the HParams table shows beside the settings (their scalars are in the same run).
_HPARAM_METRICS = ("score_mean", "kl_mean")


class TensorBoardTracker(Tracker):
    """TensorBoard event files in ``<run_dir>/tensorboard/`` (``torch.utils.tensorboard``): each
    metric as a scalar at its step, the configuration as text (step ``resumed_step``) and as the
    HParams plugin's session, each table as text (one JSON object a line). A resumed run's writer
    purges the events after ``resumed_step`` (``purge_step``: those a run killed before its
    checkpoint had written); a run started from step 0 purges every earlier event there."""

    name = "tensorboard"

    def start(self, run_dir: Path, config: Mapping[str, Any], resumed_step: int) -> None:
        _import(self.name, "tensorboard")
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resumed_step + 1 if resumed_step else 0)
        self.writer.add_text("config", _code_block(_toml(config)), resumed_step)
        if not resumed_step:
            for summary in hparams({k: _param_text(v) for k, v in config.items()}, dict.fromkeys(_HPARAM_METRICS)):
                self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a run killed later keeps what was logged

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "samples") -> None:
        text = "\n".join(json.dumps(row, ensure_ascii=False, default=str) for row in rows)
        self.writer.add_text(table, _code_block(text), step)
        self.writer.flush()

    def finish(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run: offline in ``<run_dir>/wandb/`` unless ``WANDB_MODE`` is set
    (``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later), project ``pyppo`` and the run
    directory's name unless ``WANDB_PROJECT`` / ``WANDB_NAME`` say otherwise; the configuration
    as the run's config, metrics with ``step=``, tables as ``wandb.Table``. A resume goes on with
    the same run id (``resume="allow"``), unless ``WANDB_RUN_ID`` is set."""

    name = "wandb"

    def start(self, run_dir: Path, config: Mapping[str, Any], resumed_step: int) -> None:
        self.wandb = _import(self.name, "wandb")
        saved = _read_state(run_dir).get(self.name) if resumed_step else None
        given = {
            "mode": ("WANDB_MODE", "offline"),
            "dir": ("WANDB_DIR", str(run_dir)),
            "project": ("WANDB_PROJECT", PROJECT),
            "name": ("WANDB_NAME", run_dir.resolve().name),
        }
        # Passed even when the user's: wandb reads its variables once per process, at its first init.
        kwargs = {arg: os.environ.get(env, value) for arg, (env, value) in given.items()}
        if "WANDB_RUN_ID" in os.environ:
            kwargs["id"] = os.environ["WANDB_RUN_ID"]
        elif saved:
            kwargs.update(id=saved["id"], resume="allow")
        # create_new: a run of the user's own, open in this process, stays open beside this one.
        settings = _wandb_settings(self.wandb)
        self.run = self.wandb.init(config=dict(config), reinit="create_new", settings=settings, **kwargs)
        _write_state(run_dir, self.name, {"id": self.run.id})

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "samples") -> None:
        columns, data = _table(rows)
        self.run.log({table: self.wandb.Table(columns=columns, data=data)}, step=step)

    def finish(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _wandb_settings(wandb):
    """The run's ``wandb.Settings``: silent (no ``wandb:`` lines: the run's header, its history
    and summary, the sync hint; its errors are still raised), unless the user set
    ``WANDB_SILENT`` or ``WANDB_QUIET``, which are then passed as they are (wandb reads its
    variables once per process)."""
    if "WANDB_SILENT" not in os.environ and "WANDB_QUIET" not in os.environ:
        return wandb.Settings(silent=True)
    return wandb.Settings(silent=os.environ.get("WANDB_SILENT", "false"), quiet=os.environ.get("WANDB_QUIET", "false"))


class TrackioTracker(Tracker):
    """A Trackio run: its local store (SQLite) in ``<run_dir>/trackio/`` unless ``TRACKIO_DIR`` is
    set (Trackio reads it once, when imported: a second run in the same Python process logs to
    the first one's store, and a warning says so); ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL``
    send it to a Space or a server instead. Project ``pyppo``, the run directory's name; metrics
    with ``step=``, tables as ``trackio.Table``. A resume goes on with the same run
    (``resume="allow"`` by its name).

    Trackio has no switch for its ``* Trackio ...`` lines (the project, the store, the dashboard
    command, the run created or resumed, "Uploading logs" at the end): what it prints on stdout
    during pyppo's calls is held back (:func:`_trackio_quiet`); its warnings (``warnings.warn``)
    and errors still reach the user. Its automatic CPU/GPU metrics (a sampling thread, on
    whenever psutil or a GPU is found) are off unless ``PYPPO_TRACKIO_SYSTEM_METRICS=1``."""

    name = "trackio"

    def start(self, run_dir: Path, config: Mapping[str, Any], resumed_step: int) -> None:
        self.trackio = _import_trackio(run_dir / "trackio")
        saved = _read_state(run_dir).get(self.name) if resumed_step else None
        name = saved["name"] if saved else run_dir.resolve().name
        with _trackio_quiet():
            self.run = self.trackio.init(
                project=PROJECT,
                name=name,
                config=dict(config),
                resume="allow" if saved else "never",
                **_trackio_system_metrics(self.trackio.init),
            )
        _write_state(run_dir, self.name, {"name": self.run.name, "id": self.run.id})

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        with _trackio_quiet():
            self.run.log(dict(metrics), step=step)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "samples") -> None:
        if not hasattr(self.trackio, "Table"):  # trackio before tables: the samples stay in the run's files
            return
        columns, data = _table(rows)
        with _trackio_quiet():
            self.run.log({table: self.trackio.Table(columns=columns, data=data)}, step=step)

    def finish(self, failed: bool = False) -> None:
        # trackio.finish() also forgets the current run, which its exit hook would finish again.
        current = getattr(getattr(self.trackio, "context_vars", None), "current_run", None)
        with _trackio_quiet():
            if current is not None and current.get() is self.run:
                self.trackio.finish()
            else:
                self.run.finish()


#: The environment variable that turns Trackio's automatic CPU/GPU metrics back on (``1``).
TRACKIO_SYSTEM_METRICS = "PYPPO_TRACKIO_SYSTEM_METRICS"

#: A line Trackio prints that is a problem, not news: passed on to stderr (its fallback
#: ``* Trackio warning: ...`` when ``warnings.warn`` raises, an ``* Error ...``).
_TRACKIO_PROBLEM = re.compile(r"\b(warning|error|failed)\b", re.IGNORECASE)


@contextlib.contextmanager
def _trackio_quiet() -> Iterator[None]:
    """What Trackio prints on stdout while in it held back, but for its lines that say a problem
    (:data:`_TRACKIO_PROBLEM`), passed on to stderr; also after an error."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    finally:
        for line in held.getvalue().splitlines():
            if _TRACKIO_PROBLEM.search(line):
                print(line, file=sys.stderr)


def _trackio_system_metrics(init) -> Dict[str, Any]:
    """``trackio.init``'s arguments that switch its automatic CPU and GPU metrics off (those it
    takes), or leave them to its detection with ``PYPPO_TRACKIO_SYSTEM_METRICS=1``."""
    if os.environ.get(TRACKIO_SYSTEM_METRICS, "").strip().lower() in ("1", "true", "yes", "on"):
        return {}
    try:
        params = inspect.signature(init).parameters
    except (TypeError, ValueError):  # pragma: no cover - a trackio whose init has no signature
        return {}
    return {arg: False for arg in ("auto_log_cpu", "auto_log_gpu") if arg in params}


def _import_trackio(store: Path):
    """``trackio``, with its store at ``store`` when the user has not set ``TRACKIO_DIR`` and
    trackio is not imported yet: it reads the variable once, when imported; the variable is then
    put back as it was."""
    if "trackio" not in sys.modules and "TRACKIO_DIR" not in os.environ:
        with _environment({"TRACKIO_DIR": str(store)}):
            trackio = _import("trackio", "trackio")
    else:
        trackio = _import("trackio", "trackio")
    where = getattr(getattr(trackio, "utils", None), "TRACKIO_DIR", None)
    if "TRACKIO_DIR" not in os.environ and where is not None and Path(where) != store:
        warnings.warn(
            f"report_to trackio: trackio was imported before this run, so it logs to its store {str(where)!r}, "
            f"not {str(store)!r} (set TRACKIO_DIR before importing trackio to choose)",
            UserWarning,
            stacklevel=3,
        )
    return trackio


class MlflowTracker(Tracker):
    """An MLflow run: in the file store ``file://<run_dir>/mlruns`` unless ``MLFLOW_TRACKING_URI``
    is set (MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE=true``, which is set
    around pyppo's own calls only, unless the user set it), experiment ``pyppo`` unless
    ``MLFLOW_EXPERIMENT_NAME`` is set, the run directory's name. Written through an
    :class:`mlflow.tracking.MlflowClient` of that store, so MLflow's active run and tracking URI
    of the process stay as they were. The configuration as params (a resume's changed settings
    as the tag ``pyppo.resumed_at_step_<N>``: params cannot change), metrics with ``step=`` (a
    name MLflow refuses has each other character replaced by ``_``), each table as the artifact
    ``<table>.json`` (``log_table``, which appends). A resume goes on with the same run id."""

    name = "mlflow"

    def start(self, run_dir: Path, config: Mapping[str, Any], resumed_step: int) -> None:
        _import(self.name, "mlflow")
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        user_uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = user_uri or (run_dir / "mlruns").resolve().as_uri()
        own = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}  # log_table's download bar, every step
        if not user_uri:
            own["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.env = {key: value for key, value in own.items() if key not in os.environ}
        saved = _read_state(run_dir).get(self.name) if resumed_step else None
        params = {k: str(_param_text(v)) for k, v in config.items()}
        with self._scoped():
            self.client = MlflowClient(tracking_uri=self.uri)
            run = None
            if saved and saved.get("tracking_uri") == self.uri:
                with contextlib.suppress(MlflowException):
                    run = self.client.get_run(saved["run_id"])
            if run is None:
                experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
                found = self.client.get_experiment_by_name(experiment)
                experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
                run = self.client.create_run(experiment_id, run_name=run_dir.resolve().name)
                logged: Dict[str, str] = {}
            else:
                self.client.update_run(run.info.run_id, status="RUNNING")
                logged = dict(run.data.params)
            self.run_id = run.info.run_id
            new = [Param(k, v) for k, v in params.items() if k not in logged]
            for i in range(0, len(new), _MAX_PARAMS):
                self.client.log_batch(self.run_id, params=new[i : i + _MAX_PARAMS])
            changed = [f"{k}: {logged[k]} -> {v}" for k, v in params.items() if k in logged and logged[k] != v]
            if changed:
                self.client.set_tag(self.run_id, f"pyppo.resumed_at_step_{resumed_step}", "; ".join(changed))
        _write_state(run_dir, self.name, {"run_id": self.run_id, "tracking_uri": self.uri})

    @contextlib.contextmanager
    def _scoped(self) -> Iterator[None]:
        with _environment(self.env):
            yield

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        with self._scoped():
            for i in range(0, len(batch), _MAX_METRICS):
                self.client.log_batch(self.run_id, metrics=batch[i : i + _MAX_METRICS])

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "samples") -> None:
        columns, data = _table(rows)
        with self._scoped(), warnings.catch_warnings():
            # MLflow's own pandas calls, deprecated by pandas 3: nothing the user can act on.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="mlflow")
            self.client.log_table(
                self.run_id, {c: [row[i] for row in data] for i, c in enumerate(columns)}, f"{table}.json"
            )

    def finish(self, failed: bool = False) -> None:
        with self._scoped():
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


# MLflow's limits of one log_batch call (mlflow/utils/validation.py).
_MAX_PARAMS = 100
_MAX_METRICS = 1000


def _mlflow_key(key: str) -> str:
    """``key`` with each character MLflow refuses in a metric name on some system replaced by
    ``_`` (mlflow/utils/validation.py: letters, digits, ``_ - . /`` and space are allowed
    everywhere; ``:`` not on Windows)."""
    return re.sub(r"[^\w\-. /]", "_", key)


#: The tracker classes by ``report_to`` name.
CLASSES = {cls.name: cls for cls in (TensorBoardTracker, WandbTracker, TrackioTracker, MlflowTracker)}


class Trackers:
    """The trackers of a run, called together; :meth:`start` opens them. With no names every call
    does nothing."""

    def __init__(self, trackers: Sequence[Tracker] = ()):
        self.trackers = list(trackers)

    @classmethod
    def start(cls, names: Sequence[str], run_dir: str | os.PathLike, resumed_step: int) -> "Trackers":
        """Open the trackers ``names`` for the run directory ``run_dir`` (which exists, with its
        ``config.toml``), the run going on from step ``resumed_step`` (0: a new tracker run).
        A tracker that fails to start closes those already started.

        Raises:
            ImportError: a tracker's package is missing or broken (:func:`check_trackers`).
            Exception: what a tracker's package raised.
        """
        run_dir = Path(run_dir)
        config = _read_config(run_dir)
        started = cls()
        try:
            for name in names:
                tracker = CLASSES[name]()
                tracker.start(run_dir, config, resumed_step)
                started.trackers.append(tracker)
        except BaseException:
            started.finish(failed=True)
            raise
        return started

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log a step's metrics: every number of ``metrics`` (as a float) but ``step``, which is
        ``step``. A NaN or infinite value (``null`` in ``metrics.jsonl``) is logged as it is."""
        numbers = {
            k: float(v)
            for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if numbers:
            for tracker in self.trackers:
                tracker.log(numbers, step)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int, table: str = "samples") -> None:
        """Log ``rows`` as the table ``table`` (nothing when there are none)."""
        if rows:
            for tracker in self.trackers:
                tracker.log_samples(rows, step, table)

    def finish(self, failed: bool = False) -> None:
        """Close every tracker, even when one fails to.

        Raises:
            Exception: the first tracker's error, once every tracker is closed (only a warning
                when ``failed``: the run's own error is the one to report).
        """
        error: Optional[BaseException] = None
        for tracker in self.trackers:
            try:
                tracker.finish(failed)
            except Exception as exc:
                if failed:
                    warnings.warn(f"report_to {tracker.name}: could not finish: {exc}", RuntimeWarning, stacklevel=2)
                elif error is None:
                    error = exc
        self.trackers = []
        if error is not None:
            raise error


@contextlib.contextmanager
def reporting(trainer: PPOTrainer, run_dir: str | os.PathLike) -> Iterator[Trackers]:
    """The trackers of ``trainer.config.report_to`` for the run in ``run_dir``, open while in it
    and finished on the way out (as failed after an error). Only on rank 0
    (``trainer.world.is_main``); every other rank gets a :class:`Trackers` that does nothing. A
    run going on from ``trainer.step_count > 0`` continues the tracker runs that
    ``trackers.json`` names.

    Raises:
        as :meth:`Trackers.start`.
    """
    names = trainer.config.report_to if trainer.world.is_main else ()
    trackers = Trackers.start(names, run_dir, trainer.step_count) if names else Trackers()
    failed = True
    try:
        yield trackers
        failed = False
    finally:
        trackers.finish(failed=failed)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while in it; each put back as it was (or removed) after."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _read_config(run_dir: Path) -> Dict[str, Any]:
    """The run's ``config.toml`` as a dict (``{}`` when there is none)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    path = run_dir / "config.toml"
    if not path.is_file():
        return {}
    with path.open("rb") as f:
        return tomllib.load(f)


def _toml(config: Mapping[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(dict(config))


def _code_block(text: str) -> str:
    """``text`` as a Markdown code block (TensorBoard's text plugin renders Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def _param_text(value: Any) -> Any:
    """A config value as a scalar that MLflow's params and TensorBoard's HParams take: a list as
    JSON, the rest as it is."""
    return json.dumps(list(value)) if isinstance(value, (list, tuple)) else value


def _table(rows: Sequence[Mapping[str, Any]]) -> Tuple[List[str], List[List[Any]]]:
    """``rows`` as (columns, data): the columns in their first appearance's order, a missing
    value ``None``; a value that is not a string, a number, a bool or ``None`` (an episode's
    transcript) as JSON text, and a NaN or infinite number as ``None``."""
    columns: Dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return list(columns), [[_cell(row.get(c)) for c in columns] for row in rows]


def _cell(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _read_state(run_dir: Path) -> Dict[str, Any]:
    """``trackers.json`` of ``run_dir`` (``{}`` when there is none, or it is unreadable)."""
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(run_dir: Path, name: str, entry: Dict[str, Any]) -> None:
    """Set tracker ``name``'s entry of ``trackers.json`` (written atomically)."""
    state = _read_state(run_dir)
    state[name] = entry
    tmp = run_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, run_dir / STATE_FILE)
