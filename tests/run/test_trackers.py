"""Experiment trackers (report_to): what each tracker wrote, read back with its own reader, is
metrics.jsonl, samples.jsonl and config.toml; a resume continues the same tracker run; only rank 0
reports; a missing package or an unknown name is one line, before any model loads."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import types

import pytest
import torch

from pyppo import PPOTrainer, cli
from pyppo.config import PPOConfig, knobs
from pyppo.config.knobs import TRACKERS
from pyppo.distributed import World
from pyppo.run import trackers
from support.run_fixture import TESTS, prompts_file, read_rows, run_toml, tiny_dir  # noqa: F401 (fixtures)
from support.tiny_models import tiny_causal_lm, tiny_tokenizer
from support.trainer_fixture import PROMPTS, count_e, make_trainer, small_config


def needs(*names):
    """Skip unless the packages of the trackers ``names`` are installed (the ``trackers`` extra)."""
    for name in names:
        for module in trackers.PACKAGES[name]:
            pytest.importorskip(module, reason=f"report_to {name} needs: pip install 'pyppo[{name}]'")


EVAL = ["held out 1?", "held out 2?", "held out 3?"]
#: A value no step logs: planted in TensorBoard as a run killed after step 2's checkpoint would have.
STALE = 12345.0
#: Every setting of the user's own that would move a tracker away from pyppo's defaults.
USER_SETTINGS = (
    "WANDB_MODE",
    "WANDB_DIR",
    "WANDB_PROJECT",
    "WANDB_NAME",
    "WANDB_RUN_ID",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_ALLOW_FILE_STORE",
    "TRACKIO_DIR",
)


#: The smallest steps that still sample, score and update.
TINY = dict(batch_size=4, mini_batch_size=4, micro_batch_size=2, ppo_epochs=1, max_new_tokens=4)


def _trainer(steps, report_to):
    config = small_config(steps=steps, eval_every=2, report_to=report_to, **TINY)
    return PPOTrainer(config, tiny_causal_lm(seed=0), None, None, tiny_tokenizer(), count_e, PROMPTS, eval_prompts=EVAL)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Three trackers at once: 2 steps, then a resume from step 2's checkpoint to step 3 (whose
    held-out evaluation is its last step's). Before the resume, TensorBoard gets a step 3 that a
    run killed before checkpointing it would have logged."""
    needs("tensorboard", "wandb", "mlflow")
    with pytest.MonkeyPatch.context() as mp:
        for key in USER_SETTINGS:
            mp.delenv(key, raising=False)
        run = tmp_path_factory.mktemp("trackers") / "run"
        names = ["tensorboard", "wandb", "mlflow"]
        _trainer(2, names).train(run, progress=False)
        first = json.loads((run / "trackers.json").read_text())
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(run / "tensorboard")) as stale:
            stale.add_scalar("score_mean", STALE, 3)
        resumed = _trainer(3, names)
        resumed.load_checkpoint(run / "checkpoint")
        resumed.train(run, progress=False)
        _wandb_written()
        yield run, first


def _same_number(logged, expected, rel=1e-12):
    if expected is None:  # metrics.jsonl's null: a NaN or infinite value
        return logged is None or not math.isfinite(logged)
    return logged == pytest.approx(expected, rel=rel, abs=1e-30)


def _check_metrics(read_back, rows, rel=1e-12):
    """``read_back``: {step: {name: value}} from a tracker; ``rows``: metrics.jsonl's."""
    assert sorted(read_back) == [row["step"] for row in rows]
    for row in rows:
        expected = {k: v for k, v in row.items() if k != "step"}
        got = read_back[row["step"]]
        assert set(got) == set(expected), row["step"]
        for key, value in expected.items():
            assert _same_number(got[key], value, rel), (row["step"], key, got[key], value)


def _expected_tables(run):
    """{(table, step): rows} of samples.jsonl and eval_samples.jsonl."""
    tables = {}
    for table in ("samples", "eval_samples"):
        for row in read_rows(run / f"{table}.jsonl") if (run / f"{table}.jsonl").is_file() else []:
            tables.setdefault((table, row["step"]), []).append(row)
    return tables


def _toml_loads(text):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def _config(run):
    return _toml_loads((run / "config.toml").read_text())


# ---------------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------------
def test_tensorboard_has_every_metric_at_its_step_the_config_and_the_samples(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = resumed_run
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    read_back = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            read_back.setdefault(event.step, {})[tag] = event.value
    # float32 event values; the stale step 3 was purged by the resumed writer
    _check_metrics(read_back, read_rows(run / "metrics.jsonl"), rel=1e-6)
    assert STALE not in [e.value for e in events.Scalars("score_mean")]

    def texts(tag):
        return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")}

    for (table, step), rows in _expected_tables(run).items():
        logged = [json.loads(line) for line in texts(table)[step].splitlines()]
        assert logged == rows, (table, step)
    config = texts("config")
    assert sorted(config) == [0, 2]  # the start, and the resume from step 2
    assert _toml_loads("\n".join(line[4:] for line in config[2].splitlines())) == _config(run)
    assert events.PluginTagToContent("hparams")  # the settings as the HParams plugin's session


# ---------------------------------------------------------------------------------------------
# W&B: the offline run's transaction log (run-<id>.wandb), read as wandb-core writes it
# ---------------------------------------------------------------------------------------------
def _wandb_written():
    """Wait for wandb-core to write what the finished runs logged (finish() may return before
    it has): ending its service process flushes them."""
    import wandb

    wandb.teardown()


def _wandb_records(path):
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log blocks of 32 KiB whose chunks (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last) carry ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            pos += block - pos % block if pos % block else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _wandb_runs(run):
    """[(run id, config, {step: {key: value}})] of each offline run directory, oldest first."""
    out = []
    for directory in sorted((run / "wandb").glob("offline-run-*")):
        (log,) = directory.glob("run-*.wandb")
        run_id, config, history = None, {}, {}
        for record in _wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config = {i.key: json.loads(i.value_json) for i in record.run.config.update if i.key != "_wandb"}
            elif kind == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                history.setdefault(items["_step"], {}).update(items)
        out.append((run_id, config, history, directory))
    return out


def test_wandb_offline_history_has_every_metric_at_its_step_the_config_and_the_samples(resumed_run):
    run, first = resumed_run
    runs = _wandb_runs(run)
    assert [r[0] for r in runs] == [first["wandb"]["id"]] * 2  # the resume went on with the same run
    assert [sorted(r[2]) for r in runs] == [[1, 2], [3]]
    history = {step: items for _, _, h, _ in runs for step, items in h.items()}
    rows = read_rows(run / "metrics.jsonl")
    metrics = {
        step: {k: v for k, v in items.items() if not k.startswith(("_", "samples/", "eval_samples/"))}
        for step, items in history.items()
    }
    _check_metrics(metrics, rows)
    for (table, step), rows in _expected_tables(run).items():
        directory = next(d for _, _, h, d in runs if step in h)
        written = json.loads((directory / "files" / history[step][f"{table}/path"]).read_text())
        assert [dict(zip(written["columns"], r)) for r in written["data"]] == rows, (table, step)
    assert runs[1][1] == _config(run)


def test_wandb_keeps_the_users_own_settings(tmp_path, monkeypatch):
    needs("wandb")
    for key in USER_SETTINGS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_PROJECT", "theirs")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "their-dir"))
    (tmp_path / "their-dir").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    tracker = trackers.WandbTracker()
    tracker.start(run, {"lr": 1e-5}, 0)
    tracker.log({"score_mean": 0.5}, 1)
    tracker.finish()
    _wandb_written()
    assert not (run / "wandb").exists() and list((tmp_path / "their-dir" / "wandb").glob("offline-run-*"))
    (record,) = [
        r
        for r in _wandb_records(next((tmp_path / "their-dir" / "wandb").glob("offline-run-*/run-*.wandb")))
        if r.WhichOneof("record_type") == "run"
    ]
    assert record.run.project == "theirs"


# ---------------------------------------------------------------------------------------------
# MLflow: its file store, through MlflowClient
# ---------------------------------------------------------------------------------------------
def test_mlflow_has_every_metric_at_its_step_the_config_and_the_samples(resumed_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    run, first = resumed_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run / "mlruns").resolve().as_uri())
    run_id = first["mlflow"]["run_id"]
    assert json.loads((run / "trackers.json").read_text())["mlflow"]["run_id"] == run_id  # resumed: the same run
    (experiment,) = [e for e in client.search_experiments() if e.name == "pyppo"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    found = client.get_run(run_id)
    assert found.info.status == "FINISHED"
    read_back = {}
    for key in found.data.metrics:
        for metric in client.get_metric_history(run_id, key):
            read_back.setdefault(metric.step, {})[key] = metric.value
    _check_metrics(read_back, read_rows(run / "metrics.jsonl"))
    # params cannot change: those of the start, and the resume's change as a tag
    started = {k: str(trackers._param_text(v)) for k, v in {**_config(run), "steps": 2}.items()}
    assert found.data.params == started
    assert found.data.tags["pyppo.resumed_at_step_2"] == "steps: 2 -> 3"
    for table in ("samples", "eval_samples"):
        written = json.loads(
            (run / "mlruns" / experiment.experiment_id / run_id / "artifacts" / f"{table}.json").read_text()
        )
        got = [dict(zip(written["columns"], r)) for r in written["data"]]
        expected = [row for (t, _), rows in _expected_tables(run).items() if t == table for row in rows]
        # log_table writes with pandas' to_json: floats to 10 decimal places
        assert got == [{k: pytest.approx(v, abs=1e-10) for k, v in row.items()} for row in expected]


def test_mlflow_leaves_no_file_store_setting_behind_and_keeps_the_users_tracking_uri(tmp_path, monkeypatch):
    needs("mlflow")
    from mlflow.tracking import MlflowClient

    for key in USER_SETTINGS:
        monkeypatch.delenv(key, raising=False)
    theirs = (tmp_path / "their-store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", theirs)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # their store is a file store too
    run = tmp_path / "run"
    run.mkdir()
    tracker = trackers.MlflowTracker()
    tracker.start(run, {"lr": 1e-5}, 0)
    tracker.log({"score/mean": 0.25, "reward/a:b_mean": 1.0}, 4)
    tracker.finish()
    assert not (run / "mlruns").exists()
    history = MlflowClient(theirs).get_metric_history(tracker.run_id, "reward/a_b_mean")  # ':' is refused
    assert [(m.step, m.value) for m in history] == [(4, 1.0)]
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    own = trackers.MlflowTracker()
    own.start(run, {"lr": 1e-5}, 0)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # set around pyppo's own calls only
    own.finish()
    assert (run / "mlruns").is_dir()


# ---------------------------------------------------------------------------------------------
# Trackio: its SQLite store, read with its own reader (SQLiteStorage) in a fresh interpreter
# ---------------------------------------------------------------------------------------------
TRACKIO_RUN = """
import json, sys
from pathlib import Path
from pyppo import PPOTrainer
from support.tiny_models import tiny_causal_lm, tiny_tokenizer
from support.trainer_fixture import PROMPTS, count_e, small_config

run, tiny = Path(sys.argv[1]), json.loads(sys.argv[2])
ids = []
for steps in (2, 3):
    tr = PPOTrainer(small_config(steps=steps, report_to=["trackio"], **tiny), tiny_causal_lm(seed=0), None, None,
                    tiny_tokenizer(), count_e, PROMPTS)
    if steps == 3:
        tr.load_checkpoint(run / "checkpoint")
    tr.train(run, progress=False)
    ids.append(json.loads((run / "trackers.json").read_text())["trackio"])
from trackio.sqlite_storage import SQLiteStorage
from trackio.utils import TRACKIO_DIR
print(json.dumps({"ids": ids, "store": str(TRACKIO_DIR), "runs": SQLiteStorage.get_runs("pyppo"),
                  "logs": SQLiteStorage.get_logs("pyppo", run_id=ids[-1]["id"]),
                  "config": SQLiteStorage.get_run_config("pyppo", run_id=ids[-1]["id"])}, default=str))
"""


def test_trackio_store_has_every_metric_at_its_step_the_config_and_the_samples(tmp_path):
    needs("trackio")
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", TRACKIO_RUN, str(run), json.dumps(TINY)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert read["store"] == str(run / "trackio") and "TRACKIO_DIR" not in env
    first, resumed = read["ids"]
    assert first == resumed and read["runs"] == ["run"]  # the resume went on with the same run
    metrics, tables = {}, {}
    for entry in read["logs"]:
        for key, value in entry.items():
            if isinstance(value, dict) and value.get("_type") == "trackio.table":
                tables[(key, entry["step"])] = value["_value"]
            elif key not in ("step", "timestamp"):
                metrics.setdefault(entry["step"], {})[key] = value
    _check_metrics(metrics, read_rows(run / "metrics.jsonl"))
    assert tables == _expected_tables(run)
    assert {k: v for k, v in read["config"].items() if not k.startswith("_")} == _config(run)


# ---------------------------------------------------------------------------------------------
# rank 0 only, missing packages, unknown names, the flag
# ---------------------------------------------------------------------------------------------
def test_only_rank_0_creates_trackers(tmp_path, monkeypatch):
    needs("tensorboard")
    monkeypatch.setitem(sys.modules, "wandb", None)  # another rank need not even have the package
    config = PPOConfig(report_to=["tensorboard", "wandb"])
    for rank, created in ((1, []), (0, ["tensorboard"])):
        run = tmp_path / f"rank{rank}"
        run.mkdir()
        trainer = types.SimpleNamespace(config=config, world=World(rank, 2, torch.device("cpu")), step_count=0)
        if rank == 0:
            trainer.config = PPOConfig(report_to=["tensorboard"])
        with trackers.reporting(trainer, run) as reporting:
            reporting.log({"score_mean": 1.0}, 1)
        assert sorted(p.name for p in run.iterdir() if p.is_dir()) == created


def test_a_missing_package_is_one_line_naming_the_extra_before_anything_is_written(tmp_path, monkeypatch):
    needs("tensorboard")
    monkeypatch.setitem(sys.modules, "wandb", None)
    trainer = make_trainer(small_config(report_to=["tensorboard", "wandb"]))
    with pytest.raises(ImportError) as err:
        trainer.train(tmp_path / "run", progress=False)
    assert str(err.value) == "report_to: wandb needs the wandb package: pip install 'pyppo[wandb]'"
    assert not (tmp_path / "run").exists() and trainer.step_count == 0


def test_the_command_line_says_a_missing_package_before_the_model_loads(
    tiny_dir, prompts_file, run_toml, tmp_path, monkeypatch, capsys
):
    needs("tensorboard")  # installed, so not named
    import pyppo.models

    def refuse(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("the model loaded before the trackers were checked")

    monkeypatch.setattr(pyppo.models, "load_model_and_tokenizer", refuse)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "trackio", None)
    out = tmp_path / "out"
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--config", str(run_toml)]
    assert cli.main([*argv, "--output", str(out), "--report-to", "tensorboard", "trackio", "mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "pyppo: error: report_to: trackio needs the trackio package: pip install 'pyppo[trackio]'; "
        "mlflow needs the mlflow and pandas packages: pip install 'pyppo[mlflow]'"
    )
    assert not any("Traceback" in line for line in err) and not out.exists()


def test_an_unknown_tracker_is_refused_naming_the_known_ones(tmp_path, capsys):
    known = "('tensorboard', 'wandb', 'trackio', 'mlflow')"
    refused = rf"^report_to must be a name or a list of names from {re.escape(known)}, or alone 'all'"
    with pytest.raises(ValueError, match=rf"{refused}.*'none'.*got \['tensorboard', 'tensorbord'\]$"):
        PPOConfig(report_to=["tensorboard", "tensorbord"])
    for bad in ("tensorbord", ["all", "wandb"], ["none", "mlflow"], 3, [None]):
        with pytest.raises(ValueError, match=rf"{refused}.*got {re.escape(repr(bad))}$"):
            PPOConfig(report_to=bad)  # as given, not as the list it would have become
    assert cli.main(["train", "--report-to", "wandb", "tensorbord", "--output", str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pyppo: error: invalid configuration: report_to must be") and known in line
    assert cli.main(["train", "--report-to", "all", "wandb", "--output", str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("got ['all', 'wandb']")
    (tmp_path / "bad.toml").write_text('report_to = "tensorbord"\n')
    assert cli.main(["train", "--config", str(tmp_path / "bad.toml"), "--output", str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pyppo: error: ") and line.endswith("got 'tensorbord'") and known in line
    assert not (tmp_path / "o").exists()


def _without(monkeypatch, *modules):
    """The trackers' ``modules`` made uninstalled (``find_spec`` finds no module that is None)."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize(
    "given, expected",
    [
        ("wandb", ("wandb",)),  # one name, as HF's TrainingArguments takes it
        (["wandb"], ("wandb",)),
        (("mlflow", "wandb", "mlflow"), ("mlflow", "wandb")),
        ("none", ()),
        (["none"], ()),
        (None, ()),
        ([], ()),
        ("all", ("tensorboard", "wandb")),
        (["all"], ("tensorboard", "wandb")),
    ],
)
def test_report_to_takes_the_forms_of_hf_training_arguments(given, expected, monkeypatch):
    monkeypatch.setattr(knobs, "installed_trackers", lambda: ("tensorboard", "wandb"))  # "all": those
    config = PPOConfig(report_to=given)
    assert config.report_to == expected
    assert PPOConfig.from_dict(config.to_dict()) == config  # as config.toml holds it


def test_all_is_each_installed_tracker_and_none_when_none_is(monkeypatch):
    _without(monkeypatch, "wandb", "pandas")
    installed = tuple(n for n in TRACKERS if n not in ("wandb", "mlflow") and knobs._findable(n))
    assert knobs.installed_trackers() == installed
    assert PPOConfig(report_to="all").report_to == installed
    _without(monkeypatch, *{m for modules in trackers.PACKAGES.values() for m in modules})
    assert PPOConfig(report_to="all").report_to == () == knobs.installed_trackers()


def test_the_flag_and_a_config_file_take_a_name_all_and_none(tmp_path, monkeypatch):
    _without(monkeypatch, "trackio")

    def resolved(*flags):
        args = cli.build_parser().parse_args(["train", *flags, "--output", str(tmp_path / "o")])
        return cli.resolve_train_config(args).config

    installed = knobs.installed_trackers()
    assert "trackio" not in installed
    assert resolved("--report-to", "none").report_to == ()
    assert resolved("--report-to", "all").report_to == installed
    assert resolved("--report-to", "wandb").report_to == ("wandb",)
    for text, expected in (('"wandb"', ("wandb",)), ('"none"', ()), ('"all"', installed), ("[]", ())):
        (tmp_path / "run.toml").write_text(f"report_to = {text}\n")
        assert resolved("--config", str(tmp_path / "run.toml")).report_to == expected, text
    # config.toml records what "all" meant, so that a resume (or another machine) keeps the list
    config = resolved("--config", str(tmp_path / "run.toml"), "--report-to", "all")
    cli.write_resolved_config(tmp_path / "config.toml", {"model": "m"}, config)
    assert _toml_loads((tmp_path / "config.toml").read_text())["report_to"] == list(installed)
    monkeypatch.delitem(sys.modules, "trackio")  # installed again: the recorded list stays
    assert resolved("--config", str(tmp_path / "config.toml")).report_to == installed
    assert resolved("--config", str(tmp_path / "config.toml"), "--report-to", "none").report_to == ()


def test_the_flag_takes_several_names_and_config_toml_a_list(tmp_path):
    def resolved(*flags):
        args = cli.build_parser().parse_args(["train", *flags, "--output", str(tmp_path / "o")])
        return cli.resolve_train_config(args).config

    assert resolved().report_to == ()
    assert resolved("--report-to", "tensorboard", "wandb", "tensorboard").report_to == ("tensorboard", "wandb")
    config = resolved("--report-to", "mlflow", "trackio")
    cli.write_resolved_config(tmp_path / "config.toml", {"model": "m"}, config)
    assert 'report_to = [\n    "mlflow",\n    "trackio",\n]' in (tmp_path / "config.toml").read_text()
    assert resolved("--config", str(tmp_path / "config.toml")).report_to == ("mlflow", "trackio")
    assert resolved("--config", str(tmp_path / "config.toml"), "--report-to").report_to == ()  # none


def test_telemetry_is_off_unless_the_user_turned_it_on(tmp_path, monkeypatch):
    needs("wandb", "mlflow")
    for key in (*USER_SETTINGS, "WANDB_ERROR_REPORTING", "MLFLOW_DISABLE_TELEMETRY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "true")
    run = tmp_path / "run"
    run.mkdir()
    started = trackers.Trackers.start(["wandb", "mlflow"], run, 0)
    started.finish()
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"  # set before mlflow's telemetry reads it
    assert os.environ["WANDB_ERROR_REPORTING"] == "true"  # theirs
    assert set(trackers.TELEMETRY_OFF) <= set(TRACKERS)


def test_every_tracker_name_has_a_class_and_its_packages():
    assert tuple(trackers.CLASSES) == TRACKERS == tuple(trackers.PACKAGES)
    assert all(trackers.CLASSES[name].name == name for name in TRACKERS)


# ---------------------------------------------------------------------------------------------
# quiet: the trackers print nothing into the run's output
# ---------------------------------------------------------------------------------------------
#: A line of the run's output that is pyppo's own: its lines, the run directory's listing, the bar.
OWN_LINE = re.compile(r"^(pyppo: |  \S|ppo: |\s*$)")


def test_wandb_and_trackio_print_nothing_into_the_runs_output(tiny_dir, prompts_file, run_toml, tmp_path):
    """`pyppo train` with W&B and Trackio, then a resume: stdout and stderr hold pyppo's lines only
    (no `wandb:` header, history, summary or sync hint; no `* Trackio ...`, dashboard command,
    psutil notice, created / resumed run or "Uploading logs")."""
    needs("wandb", "trackio")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (*USER_SETTINGS, "WANDB_SILENT", "WANDB_QUIET", trackers.TRACKIO_SYSTEM_METRICS)
    }
    run = tmp_path / "run"
    base = [sys.executable, "-m", "pyppo", "train", "--model", str(tiny_dir), "--prompts", str(prompts_file)]
    outputs = []
    for argv in (
        ["--config", str(run_toml), "--steps", "2", "--report-to", "wandb", "trackio", "--output", str(run)],
        ["--resume", str(run), "--steps", "3", "--output", str(run)],
    ):
        done = subprocess.run([*base, *argv], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout + done.stderr)
    assert "resuming" in outputs[1]
    for text in outputs:
        strange = [line for line in text.splitlines() if not OWN_LINE.match(line)]
        assert not strange, strange
        assert not re.search(r"wandb: |\* Trackio|\* (Created new|Resumed existing) run|\x1b\[", text), text
    state = json.loads((run / "trackers.json").read_text())
    assert set(state) == {"wandb", "trackio"}  # both logged
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2


def test_trackio_prints_are_held_back_but_its_problems(capsys):
    with trackers._trackio_quiet():
        print("* Trackio project initialized: pyppo")
        print("* Trackio warning: Could not flush all logs within 30s.")
    with pytest.raises(RuntimeError), trackers._trackio_quiet():
        print("* Created new run: r")
        raise RuntimeError("trackio failed")
    out, err = capsys.readouterr()
    assert out == "" and err == "* Trackio warning: Could not flush all logs within 30s.\n"


def test_trackio_system_metrics_are_off_unless_asked(monkeypatch):
    def init(project, name=None, auto_log_gpu=None, auto_log_cpu=None): ...

    def old_init(project, name=None): ...

    monkeypatch.delenv(trackers.TRACKIO_SYSTEM_METRICS, raising=False)
    assert trackers._trackio_system_metrics(init) == {"auto_log_cpu": False, "auto_log_gpu": False}
    assert trackers._trackio_system_metrics(old_init) == {}  # a trackio without them
    monkeypatch.setenv(trackers.TRACKIO_SYSTEM_METRICS, "1")
    assert trackers._trackio_system_metrics(init) == {}  # trackio's own detection


def test_wandb_is_silent_unless_the_user_chose(monkeypatch):
    needs("wandb")
    import wandb

    monkeypatch.delenv("WANDB_SILENT", raising=False)
    monkeypatch.delenv("WANDB_QUIET", raising=False)
    assert trackers._wandb_settings(wandb).silent is True
    monkeypatch.setenv("WANDB_SILENT", "false")
    settings = trackers._wandb_settings(wandb)
    assert (settings.silent, settings.quiet) == (False, False)
    monkeypatch.delenv("WANDB_SILENT")
    monkeypatch.setenv("WANDB_QUIET", "true")
    settings = trackers._wandb_settings(wandb)
    assert (settings.silent, settings.quiet) == (False, True)
