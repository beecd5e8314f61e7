"""``pyppo train``: PPO on a causal LM. With no arguments it runs the embedded default
(SmolLM2-135M-Instruct, VADER sentiment reward, built-in prompts). Settings come from, in
increasing priority: the trainer's defaults, :data:`TRAIN_DEFAULTS`, the ``config.toml`` of
``--resume DIR``, ``--config FILE.toml``, then the flags. The resolved settings are written to
``<output>/config.toml`` before training starts, so every run can be reproduced or resumed from its
own directory. SIGINT and SIGTERM stop a run without losing work (:mod:`pyppo.run.stopping`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

from ..run.rundir import OUTPUT_FILES, RunDir, check_output_dir
from .flags import (
    PROG,
    USER_ERRORS,
    CLIError,
    add_config_flags,
    add_source_flags,
    config_flag_values,
    field_defaults,
    flag_name,
    make_config,
)
from .run_file import RUN_KEYS, check_keys, read_toml, recorded_run_value, reward_specs, same_run_value, shown_run_value

__all__ = [
    "TRAIN_DEFAULTS",
    "RUN_KEYS",
    "add_train_arguments",
    "cmd_train",
    "resolve_train_config",
    "TrainPlan",
    "write_resolved_config",
    "resume_command",
]


#: What `pyppo train` changes from PPOConfig's library defaults: sized so that the embedded
#: default (SmolLM2-135M, sentiment reward) shows its mean score rising within 15 minutes on a
#: 2-core CPU. One epoch of two minibatches: each batch gives two optimizer steps and the second
#: is measured against the policy that sampled it, so PPO stays proximal (a second epoch doubled
#: the update's cost and pushed step 1's approx_kl to 0.9). Smaller batches or shorter responses
#: let the sentiment score's step-to-step noise (VADER on 16-token responses) hide the trend.
TRAIN_DEFAULTS = {
    "steps": 20,
    "batch_size": 32,
    "mini_batch_size": 16,
    "ppo_epochs": 1,
    "max_new_tokens": 16,
    "lr": 7e-5,
    "kl_coef": 0.06,
    # A checkpoint (~3.2 GB: two fp32 models and their Adam moments) every 10 steps, so that an
    # interrupted run loses at most 10 steps (~6 min).
    "save_every": 10,
}


class TrainPlan(NamedTuple):
    """What ``pyppo train`` will do: train ``config`` on ``run``'s ``model``, ``reward``, ``prompts``
    and ``eval_prompts`` (``None`` = built-in prompts / none) into ``output``, from the checkpoint
    of ``resume_dir`` at ``resume_step`` (``None``: from step 0)."""

    run: dict
    config: Any
    output: Path
    resume_dir: Optional[Path]
    resume_step: Optional[int]
    #: The settings a resume may change that differ from its checkpoint's
    #: (:class:`pyppo.config.ResumeChange`): applied, and said when the run starts.
    changes: tuple = ()


def resolve_train_config(args: argparse.Namespace, world_size: Optional[int] = None) -> TrainPlan:
    """Merge, in increasing priority: the field defaults, :data:`TRAIN_DEFAULTS`, ``--resume``'s
    config.toml, ``--config`` and the flags; then find the checkpoint to resume from and check
    the resolved settings against its own (:func:`pyppo.config.resume_conflicts`). Reads nothing
    larger than the config files and the checkpoint's small ``trainer_state.pt``.

    Args:
        world_size: the number of processes the run will have (default: torchrun's
            ``WORLD_SIZE``, 1 without torchrun).

    Raises:
        CLIError: unknown key, missing file, invalid value (PPOConfig's validation message), a
            size that ``world_size`` processes cannot share, a checkpoint to resume that was
            written by another number of processes, or a resume that changes its model, reward,
            prompts or a setting that a resume cannot change (all of those named in one line).
    """
    from pyppo.models import DEFAULT_MODEL
    from pyppo.prompts import resolve_prompt_source
    from pyppo.rewards import BUILTIN_REWARDS
    from pyppo.tasks.reasoning_gym import check_held_out

    merged: dict = {
        "model": DEFAULT_MODEL,
        "reward": None,
        "reward_weights": None,
        "prompts": None,
        "eval_prompts": None,
        "env": None,
        "value_model": None,
        **TRAIN_DEFAULTS,
    }
    resume_dir, resumed, saved_state, from_file = None, {}, None, {}
    if args.resume is not None:
        resume_dir = Path(args.resume).expanduser()
        if not resume_dir.is_dir():
            raise CLIError(f"--resume {args.resume!r}: no such run directory")
        if not RunDir(resume_dir).config.is_file():
            raise CLIError(f"--resume {args.resume!r}: no config.toml in it (not a pyppo run directory)")
        resumed_config = RunDir(resume_dir).config
        resumed = check_keys(read_toml(resumed_config, "--resume config"), str(resumed_config))
        merged.update(resumed)
        _check_python_run_sources(args, resumed_config, resumed)
        saved_state = _checkpoint_state(resume_dir)
    if args.config is not None:
        path = Path(args.config).expanduser()
        from_file = check_keys(read_toml(path, "--config"), str(path))
        merged.update(from_file)
    for key in RUN_KEYS:
        recorded = recorded_run_value(resumed, key)
        for source, value in ((f"{args.config}: {key} =", from_file.get(key)), (flag_name(key), getattr(args, key))):
            # A resumed run continues the same model, rewards and prompts: switching them mid-run
            # would make its checkpoint and its config.toml describe different experiments.
            if value is not None and recorded is not None and not same_run_value(key, value, recorded):
                raise CLIError(
                    f"{source} {shown_run_value(value)!r} differs from the resumed run's {key} "
                    f"{shown_run_value(recorded)!r}; start a new run (--output) to change it"
                )
            if value is not None and key == "value_model" and resume_dir is not None and key not in resumed:
                raise CLIError(
                    f"{source} {value!r}: a value model is warm-started when a run starts; the resumed run's "
                    "comes from its checkpoint (start a new run with --output to warm-start one)"
                )
        if getattr(args, key) is not None:
            merged[key] = getattr(args, key)
    flags = config_flag_values(args)
    merged.update(flags)
    if resume_dir is not None and merged.get("dtype", "auto") == "auto":
        # `auto` was resolved when the run started (its checkpoint and config.toml say to what):
        # it goes on in that dtype, whatever this machine would choose.
        started = ((saved_state or {}).get("config") or resumed).get("dtype", "auto")
        if started != "auto":
            merged["dtype"] = started
    # `--batch-size 8` alone should work: when the mini-batch size is still TRAIN_DEFAULTS' and does
    # not divide the batch, train on the whole batch at once.
    if (
        "batch_size" in flags
        and merged.get("mini_batch_size") == TRAIN_DEFAULTS["mini_batch_size"]
        and "mini_batch_size" not in flags
        and flags["batch_size"] % TRAIN_DEFAULTS["mini_batch_size"] != 0
    ):
        merged["mini_batch_size"] = flags["batch_size"]

    run = {key: merged.pop(key) for key in RUN_KEYS}
    # Paths are stored absolute in the resolved config, so `--resume` works from any directory;
    # a built-in set's name ("arithmetic") is kept as it is, a reasoning-gym spec in its canonical spelling
    # (the options at the task's default left out).
    for key in ("prompts", "eval_prompts"):
        if run[key]:
            try:
                run[key] = resolve_prompt_source(run[key], flag=flag_name(key))
            except (OSError, ValueError, ImportError) as exc:
                raise CLIError(str(exc)) from None
    try:
        check_held_out(run["prompts"], run["eval_prompts"])
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    model_path = Path(run["model"]).expanduser()
    if model_path.exists():
        run["model"] = str(model_path.resolve())
    if run["env"] is not None:
        run["env"] = _resolved_env(run["env"])
    if run["reward"] is None:  # the environment's own reward, else the default one
        run["reward"] = _env_reward(run["env"]) if run["env"] is not None else "sentiment"
    specs = [_resolved_reward(spec, BUILTIN_REWARDS) for spec in reward_specs(run["reward"])]
    run["reward"] = specs[0] if len(specs) == 1 else specs  # one reward is written as before
    if run["reward_weights"] is None:
        del run["reward_weights"]  # none given: the run's sources are what they were before weights
    else:
        from ..reward_sum import check_reward_weights

        if getattr(args, "reward_weights", None) is not None:
            what = "--reward-weights"
        elif "reward_weights" in from_file:
            what = f"{args.config}: reward_weights"
        else:
            what = "the resumed run's reward_weights"
        try:
            run["reward_weights"] = check_reward_weights(run["reward_weights"], len(specs), what=what)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    ppo_config = make_config(merged, flags)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    try:
        ppo_config.check_world_size(world)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if run["value_model"] is not None and not ppo_config.uses_critic:
        raise CLIError(
            f"--value-model {run['value_model']!r}: advantage_estimator {ppo_config.advantage_estimator!r} "
            "trains no value model; a warm start needs gae or gae_turn"
        )
    if ppo_config.eval_every and not run["eval_prompts"] and not _env_has_eval_prompts(run["env"]):
        raise CLIError(
            f"--eval-every {ppo_config.eval_every} needs --eval-prompts FILE.jsonl (held-out prompts), "
            "or an --env that declares its own (default_eval_prompts)"
        )
    if args.output is not None:
        output = Path(args.output).expanduser()
    elif resume_dir is not None:
        output = resume_dir
    else:
        output = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    check_output_dir(output)
    # A directory whose run has no checkpoint holds nothing to resume: the same command starts it
    # over there (see cmd_train); one with a checkpoint is only continued with --resume.
    output_step = RunDir(output).checkpoint_step()
    in_place = resume_dir is not None and output.resolve() == resume_dir.resolve()
    if output_step is not None and not in_place:
        raise CLIError(
            f"--output {str(output)!r} already holds a run with a checkpoint; "
            f"continue it with --resume {str(output)!r} or choose another --output"
        )
    resume_step = output_step if in_place else RunDir(resume_dir).checkpoint_step() if resume_dir is not None else None
    changes: tuple = ()
    if resume_step is not None:
        from ..config import resume_conflicts

        _check_resumed_world_size(resume_dir, saved_state, world)
        try:
            # A checkpoint from before it held its config is checked against its config.toml.
            changes = tuple(
                resume_conflicts(
                    saved_state.get("config", resumed),
                    ppo_config,
                    where=f"--resume {str(resume_dir)!r}: its checkpoint",
                    new_run="start a new run (--output) to change them",
                )
            )
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    if run["value_model"] is not None and resume_step is None:  # a checkpoint holds the resumed one
        run["value_model"] = _resolved_value_model(run["value_model"])
    from ..trainer.assemble import check_episode_knobs

    try:  # after the resume's checks, which name every changed setting in one line
        check_episode_knobs(ppo_config, agent=run["env"] is not None)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    return TrainPlan(run, ppo_config, output, resume_dir, resume_step, changes)


def _resolved_reward(spec: Any, builtin: Any) -> str:
    """One ``--reward`` spec, a model directory or ``file.py:function`` made absolute (found from any
    directory on ``--resume``); a built-in reward's name (``math``) stays one, even beside a
    directory of that name.

    Raises:
        CLIError: not a non-empty string.
    """
    if not isinstance(spec, str) or not spec:
        raise CLIError(
            "--reward must be 'sentiment', 'math', 'reasoning-gym', a model directory, 'module:function' or "
            f"'file.py:function', got {spec!r}"
        )
    path = Path(spec).expanduser()
    if path.is_dir() and spec not in builtin:
        return str(path.resolve())
    if ".py:" in spec:
        file, _, function = spec.rpartition(":")
        if Path(file).expanduser().is_file():
            return f"{Path(file).expanduser().resolve()}:{function}"
    return spec


def _checkpoint_state(resume_dir: Path) -> Optional[dict]:
    """The small ``trainer_state.pt`` of the checkpoint in ``resume_dir`` (``None``: it has none):
    what the checkpoint was trained with is checked before any model loads.

    Raises:
        CLIError: the file cannot be read, naming it.
    """
    found = RunDir(resume_dir).find_checkpoint()
    if found is None:
        return None
    import torch

    path = found / "trainer_state.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CLIError(f"checkpoint file {str(path)!r} cannot be read: {exc}") from None


def _check_resumed_world_size(resume_dir: Path, state: dict, world: int) -> None:
    """A checkpoint resumes exactly only with the number of processes that wrote it (every rank's
    RNG state is in it, and ``state`` is its ``trainer_state.pt``): said here, before anything loads.

    Raises:
        CLIError: another number, naming both and the command that resumes it.
    """
    saved = int(state.get("world_size", 1))
    if saved != world:
        raise CLIError(
            f"--resume {str(resume_dir)!r}: its checkpoint was written by {saved} process(es), this run "
            f"has {world}; resume it with: {resume_command(resume_dir, saved)}"
        )


def resume_command(directory: Path, world_size: int) -> str:
    """The command that continues the run in ``directory`` with ``world_size`` processes: ``pyppo
    train --resume DIR``, with ``--nproc N`` for several processes on this machine; torchrun's own
    launch when they span machines (``LOCAL_WORLD_SIZE`` < ``WORLD_SIZE``)."""
    command = f"pyppo train --resume {shlex.quote(str(directory))}"
    if world_size == 1:
        return command
    # torchrun's variables describe this launch only when its world is the one being resumed (a
    # library that ran in this process, such as vLLM, may have left them set).
    local, launched = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local and launched and int(launched) == world_size and int(local) < world_size:
        return f"torchrun <the same launch options> -m {command}"
    return f"{command} --nproc {world_size}"


def _resolved_env(spec: Any) -> str:
    """``--env``'s spec, checked by loading it; a ``file.py:Class`` made absolute (found from any
    directory on ``--resume``).

    Raises:
        CLIError: the spec names nothing loadable (the registry's message).
    """
    from ..agents.registry import load_environment

    if not isinstance(spec, str) or not spec:
        raise CLIError(f"--env must be a name, 'module:Class' or 'file.py:Class', got {spec!r}")
    try:
        load_environment(spec)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    if ".py:" in spec:
        file, _, name = spec.rpartition(":")
        if Path(file).expanduser().is_file():
            return f"{Path(file).expanduser().resolve()}:{name}"
    return spec


def _resolved_value_model(spec: Any) -> str:
    """``--value-model``'s directory, absolute, once it is known to hold a complete checkpoint (in
    it or in its ``checkpoint/``); what the checkpoint's weights are is checked when they load."""
    from ..run.checkpoint import find_in_run

    if not isinstance(spec, str) or not spec:
        raise CLIError(f"--value-model must be a run directory or its checkpoint/, got {spec!r}")
    path = Path(spec).expanduser()
    if path.exists() and not path.is_dir():
        raise CLIError(f"--value-model {spec!r} is a file; pass the earlier run's directory or its checkpoint/")
    if not path.is_dir():
        raise CLIError(f"--value-model {spec!r}: no such directory")
    if find_in_run(path) is None:
        raise CLIError(
            f"--value-model {spec!r}: no complete checkpoint in it or in its checkpoint/ "
            "(a pyppo run directory, or its checkpoint/)"
        )
    return str(path.resolve())


def _env_reward(spec: str) -> str:
    """The reward an environment's episodes get by default: its ``default_reward`` (a reward spec:
    a built-in name or ``module:function``), else ``"none"`` (what the environment pays is the
    score)."""
    from ..agents.registry import load_environment

    return getattr(load_environment(spec), "default_reward", None) or "none"


def _env_has_eval_prompts(spec: Optional[str]) -> bool:
    """Whether the environment ``spec`` declares held-out prompt records (``default_eval_prompts``),
    which ``--eval-every`` then evaluates on when ``--eval-prompts`` is not given."""
    from ..agents.registry import load_environment

    return spec is not None and getattr(load_environment(spec), "default_eval_prompts", None) is not None


def _check_python_run_sources(args: argparse.Namespace, config_path: Path, resumed: dict) -> None:
    """A run started from Python names in its config.toml only the sources it could
    (:func:`pyppo.run.config_file.record_python_run`): the others must be given, not defaulted.

    Raises:
        CLIError: the model, reward or prompts are neither in it nor given, naming the flags; or
            its environment has no name the command line loads and no ``--env`` is given.
    """
    from ..run.config_file import UNNAMED_ENV, written_from_python

    if not written_from_python(config_path):
        return
    missing = [key for key in ("model", "reward", "prompts") if key not in resumed and getattr(args, key) is None]
    if missing:
        flags = " ".join(f"{flag_name(key)} ..." for key in missing)
        raise CLIError(
            f"--resume {args.resume!r}: the run was started from Python, and its config.toml does not "
            f"name its {', '.join(missing)}; pass {flags} (what it started with)"
        )
    env = resumed.get("env")
    if isinstance(env, str) and env.startswith(UNNAMED_ENV):
        if args.env is None:
            raise CLIError(
                f"--resume {args.resume!r}: the run was started from Python with {env[len(UNNAMED_ENV) :]}, "
                "which the command line cannot load by name; pass --env NAME|module:Class|file.py:Class "
                "(the same environment), or continue the run from Python"
            )
        del resumed["env"]  # the given --env stands in for it


def write_resolved_config(path: Path, run: dict, ppo_config) -> None:
    """Write the settings a run actually used as flat TOML; a None setting is written ``"none"``
    (TOML has no null), which ``--config`` and ``--resume`` read back as None
    (:func:`pyppo.run.config_file.write_config`)."""
    from ..run.config_file import write_config

    write_config(path, run, ppo_config)


def cmd_train(args: argparse.Namespace, plan: TrainPlan) -> int:
    """Run ``plan`` (:func:`resolve_train_config` of ``args``) in this process: under torchrun,
    this rank's share of it. Returns the exit status."""
    from ..run.stopping import GracefulStop

    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 writes or talks
    stop = GracefulStop(say=main_rank, single_process=int(os.environ.get("WORLD_SIZE", "1")) == 1)
    with stop.installed(keep=getattr(args, "command_line", False)):
        return _train(plan, stop, main_rank)


def _train(plan: TrainPlan, stop, main_rank: bool) -> int:
    import gc

    from .. import distributed
    from ..models.export import is_export
    from ..run.nonfinite import NonFiniteUpdateError
    from ..run.plotting import plot_metrics
    from ..run.quiet import quiet_libraries
    from .build import build_trainer

    say = (lambda text: print(text, file=sys.stderr)) if main_rank else (lambda text: None)
    run, config, output, resume_dir, done = plan.run, plan.config, plan.output, plan.resume_dir, plan.resume_step
    # resolve_train_config refused an output with a checkpoint that is not resumed.
    run_dir = RunDir(output)
    restart = done is None and run_dir.holds_a_run()
    if done is not None and done >= config.steps:
        missing = (
            ""
            if is_export(RunDir(resume_dir).policy)
            else f"; its policy/ is missing: write it with: pyppo export {shlex.quote(str(resume_dir))}"
        )
        say(
            f"{PROG}: {str(resume_dir)!r} is at step {done} (its checkpoint), steps = {config.steps}: nothing "
            f"left to run; pass --steps N with N > {done} to train further{missing}"
        )
        return 0
    if plan.changes:
        say(f"{PROG}: resuming with {', '.join(map(str, plan.changes))}")
    if resume_dir is not None:
        say(
            f"{PROG}: resuming {str(resume_dir)!r} from step {done} of {config.steps}"
            if done is not None
            else f"{PROG}: {str(resume_dir)!r} has no checkpoint yet: starting it over in place from step 0 "
            "with its config.toml"
        )
    elif restart:
        say(f"{PROG}: {str(output)!r} holds a run stopped before its first checkpoint: starting it over in place")

    # A resumed run's value model comes from its checkpoint, not from a warm start.
    sources = {**run, "value_model": None} if done is not None else run

    def before_loading():  # once the sources are checked: a refused input stays a one-line error
        from ..run.trackers import check_trackers

        check_trackers(config.report_to)  # a missing tracker package is said before the model loads
        if config.dtype == "auto":
            from ..distributed import resolve_device
            from ..precision import resolve_dtype

            say("{}: dtype auto -> {} ({})".format(PROG, *resolve_dtype("auto", resolve_device(config.device))))
        say(f"pyppo: loading {run['model']} ...")
        if sources["value_model"] is not None:
            say(f"pyppo: the value model starts from {sources['value_model']}'s (a warm start)")

    # Built before the output directory exists, so a bad model, reward or prompts file leaves nothing behind.
    with quiet_libraries():  # no loading bars of transformers' under pyppo's "loading" line
        trainer = build_trainer(config, **sources, before_loading=before_loading)
    # Loaded before config.toml is written: a refused resume leaves the run's files as they were.
    if done is not None:
        trainer.load_checkpoint(RunDir(resume_dir).checkpoint)
    elif restart:
        run_dir.clear()
    created = not output.exists()
    if main_rank:
        output.mkdir(parents=True, exist_ok=True)
        write_resolved_config(run_dir.config, run, trainer.config)  # with `auto` resolved
    stop.training()
    try:
        trainer.train(output, stop=stop)
    except BaseException as exc:
        if main_rank and resume_dir is None and not (run_dir.metrics.exists() or run_dir.checkpoint.exists()):
            # Failed before its first step was logged: leave no directory behind.
            run_dir.config.unlink(missing_ok=True)
            if created and output.is_dir() and not any(output.iterdir()):
                output.rmdir()
        if isinstance(exc, NonFiniteUpdateError) and not os.environ.get("PYPPO_DEBUG"):
            if main_rank:
                say(f"{PROG}: error: {exc}{_resumable_after(exc, run_dir, trainer.step_count, trainer.world.size)}")
            return 1
        hint = _kept_after(exc, run_dir, config.steps, trainer.world.size) if main_rank else None
        if hint is None:
            raise
        if isinstance(exc, USER_ERRORS) and not os.environ.get("PYPPO_DEBUG"):
            raise CLIError(f"{exc}; {hint}") from exc
        say(f"{PROG}: {hint}")  # above the traceback that follows
        raise
    stop.finishing()
    finished = trainer.step_count >= config.steps
    world, step = trainer.world, trainer.step_count
    trainer.close()
    del trainer
    gc.collect()
    distributed.leave(world)
    if not main_rank:
        # Rank 0 reports the stop and its status is the run's; exiting first with 130 would make
        # torchrun stop rank 0 before it has drawn the curves and said how to continue.
        return 0
    if run_dir.metrics.is_file():
        plot_metrics(run_dir.metrics, run_dir.curves)
    if not finished:
        if step == 0:
            hint = (
                f"no step finished, so there is nothing to keep: the same command, or "
                f"{resume_command(output, world.size)}, starts it over in place"
            )
        else:
            hint = (
                f"its checkpoint is at step {step} of {config.steps}; continue with: "
                f"{resume_command(output, world.size)}"
            )
        say(f"{PROG}: stopped by {stop.signal_name}; {hint}")
        return stop.exit_status
    print(f"pyppo: run written to {output}")
    for name in run_dir.existing_outputs():
        print(f"  {name:<18} {OUTPUT_FILES[name]}")
    return 0


def _kept_after(exc: BaseException, run_dir: RunDir, steps: int, world_size: int) -> Optional[str]:
    """What a failed run kept, and the command that goes on from there (``None``: no checkpoint, so
    nothing to go on from; the same command starts the run over and says so)."""
    if not isinstance(exc, Exception):
        return None  # KeyboardInterrupt, SystemExit: not a failure of the run
    kept = run_dir.checkpoint_step()
    if kept is None:
        return None
    if kept >= steps:
        return (
            f"every step is done and checkpointed (step {kept}); (re)write policy/ from it with: "
            f"pyppo export {shlex.quote(str(run_dir.path))}"
        )
    return f"its checkpoint is at step {kept} of {steps}; continue with: {resume_command(run_dir.path, world_size)}"


def _resumable_after(exc: BaseException, run_dir: RunDir, step: int, world_size: int) -> str:
    """``"; continue with: <command>"`` when the run's checkpoint (named by ``exc``'s message) holds
    ``step``, the last finished one, and a resume from it is worth trying: not after a
    non-finite rollout, whose weights those are; ``""`` otherwise."""
    from ..run.nonfinite import NonFiniteRolloutError

    if isinstance(exc, NonFiniteRolloutError) or run_dir.checkpoint_step() != step:
        return ""
    return f"; once its cause is fixed, continue with: {resume_command(run_dir.path, world_size)}"


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    add_source_flags(p, value_model=True, several_rewards=True)
    io = p.add_argument_group("files")
    io.add_argument("--config", metavar="FILE.toml", help="settings file (flat keys, as the flags; flags override it)")
    io.add_argument("--output", metavar="DIR", help="run directory (default: runs/<timestamp>, or the --resume dir)")
    io.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint/ and config.toml")
    io.add_argument(
        "--nproc",
        metavar="N",
        type=int,
        help="run N processes on this machine (torchrun --nproc-per-node N -m pyppo train ..., with the "
        "settings checked first and each Ctrl-C forwarded to every process)",
    )
    add_config_flags(p, field_defaults(TRAIN_DEFAULTS))
