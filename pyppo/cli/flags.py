"""The command line's flags and settings that more than one command shares: one flag per
``PPOConfig`` field, generated from the fields' metadata (``pyppo train`` and ``pyppo profile``),
the model / reward / prompts flags, and the one-line user error. Imports nothing of the CLI."""

from __future__ import annotations

import argparse
import dataclasses

from pyppo.agents.types import EnvironmentContractError
from pyppo.rollout.vllm_support import VLLMStartError

__all__ = [
    "CLIError",
    "PROG",
    "USER_ERRORS",
    "add_config_flags",
    "add_source_flags",
    "config_flag_values",
    "field_defaults",
    "flag_name",
    "make_config",
    "shown_as_flag",
]

PROG = "pyppo"


class CLIError(Exception):
    """A user error: printed as one line, no traceback."""


# Exceptions that mean "the user asked for something that cannot be done" rather than a bug:
# missing files (OSError), bad values (ValueError), missing packages (ImportError), an --env that
# breaks the environment contract (EnvironmentContractError, a TypeError naming the environment;
# other TypeErrors stay tracebacks), a policy vLLM cannot run (VLLMStartError). The command line
# prints them as one line and exits 2.
USER_ERRORS = (CLIError, OSError, ValueError, ImportError, EnvironmentContractError, VLLMStartError)


def flag_name(name: str) -> str:
    """``lora_rank`` -> ``--lora-rank``."""
    return "--" + name.replace("_", "-")


def _flag_type(knob):
    base = {"int": int, "float": float}.get(knob.check.kind, str)

    def parse(text: str):
        if knob.optional and text.lower() == "none":
            return None
        return base(text)

    parse.__name__ = base.__name__  # argparse says "invalid int value: ..."
    return parse


def add_config_flags(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """Add a flag for every ``PPOConfig`` field, grouped as in ``docs/trainer.md``.

    ``defaults`` are the values shown in ``--help`` (the command's own preset over the field
    defaults). A flag not given leaves no attribute, so flags only override what they name.
    """
    from pyppo.config import config_knobs

    groups: dict = {}
    for name, knob in config_knobs():
        if knob.group not in groups:
            groups[knob.group] = parser.add_argument_group(f"PPO settings: {knob.group}")
        shown = defaults[name]
        if shown is None or shown == ():
            shown = "none"
        elif isinstance(shown, tuple):
            shown = " ".join(shown)
        kwargs = dict(dest=name, default=argparse.SUPPRESS, help=f"{knob.help} (default: {shown})")
        if knob.check.kind == "bool":
            groups[knob.group].add_argument(flag_name(name), action=argparse.BooleanOptionalAction, **kwargs)
        elif knob.check.kind == "list":  # several words; none at all sets the empty list
            groups[knob.group].add_argument(flag_name(name), nargs="*", metavar=knob.check.metavar, **kwargs)
        else:
            metavar = knob.check.metavar + ("|none" if knob.optional else "")
            groups[knob.group].add_argument(flag_name(name), type=_flag_type(knob), metavar=metavar, **kwargs)


def config_flag_values(args: argparse.Namespace) -> dict:
    """The ``PPOConfig`` fields that were given as flags."""
    from pyppo.config import config_knobs

    return {name: getattr(args, name) for name, _ in config_knobs() if hasattr(args, name)}


def field_defaults(preset: dict) -> dict:
    """Every field's default, with ``preset`` over it."""
    from pyppo.config import PPOConfig

    return {f.name: f.default for f in dataclasses.fields(PPOConfig)} | preset


def shown_as_flag(name: str, value) -> str:
    """A setting as the flag that gives it: ``--lora-alpha 8.0``, ``--no-merge-lora``, ``--target-kl none``,
    ``--report-to tensorboard wandb``."""
    if isinstance(value, bool):
        return flag_name(name) if value else "--no-" + name.replace("_", "-")
    if isinstance(value, (list, tuple)):
        return " ".join([flag_name(name), *value])
    return f"{flag_name(name)} {'none' if value is None else value}"


def make_config(settings: dict, flags: dict | None = None):
    """``PPOConfig(**settings)`` (its checks take a TOML integer where a float is expected).
    ``flags``: the settings given as flags, which a message names as the flag.

    Raises:
        CLIError: an invalid value (the config's message, naming the key, or the flag that set it).
    """
    from pyppo.config import InertSettings, PPOConfig

    try:
        return PPOConfig(**settings)
    except InertSettings as exc:
        given = flags or {}
        raise CLIError(
            "invalid configuration: "
            + exc.describe(lambda key, value: shown_as_flag(key, value) if key in given else f"{key} = {value!r}")
        ) from None
    except (TypeError, ValueError) as exc:
        raise CLIError(f"invalid configuration: {exc}") from None


def add_source_flags(
    p: argparse.ArgumentParser,
    *,
    required_defaults: bool = False,
    eval_prompts: bool = True,
    value_model: bool = False,
    several_rewards: bool = False,
) -> None:
    """``--model``, ``--reward``, ``--prompts`` (what to train; shared with ``pyppo profile``) and,
    with ``eval_prompts``, ``--eval-prompts``; with ``value_model``, ``--value-model``; with
    ``several_rewards``, ``--reward`` may be repeated (a list) and ``--reward-weights`` weighs them."""
    from pyppo.models import DEFAULT_MODEL

    src = p.add_argument_group("what to train")
    src.add_argument(
        "--model",
        metavar="NAME|DIR|FILE.gguf",
        default=DEFAULT_MODEL if required_defaults else None,
        help=f"policy to start from: {DEFAULT_MODEL!r} (default), a local HF model dir or a .gguf file",
    )
    src.add_argument(
        "--reward",
        metavar="SPEC",
        default="sentiment" if required_defaults else None,
        action="append" if several_rewards else "store",
        help="'sentiment' (default, VADER compound of the response), 'math' (1.0 when the response's "
        'final answer, its last \\boxed{} or number, equals the prompt\'s "answer", else 0.0), '
        "'module:function', 'file.py:function' (a function of (prompts, responses) and any prompt "
        "fields it names, TRL's reward function or veRL's compute_score), a local HF sequence-classification "
        "model dir, or 'none' with --env (the environment pays alone)"
        + ("; repeat it for several rewards: the score is their weighted sum" if several_rewards else ""),
    )
    if several_rewards:
        src.add_argument(
            "--reward-weights",
            metavar="W",
            nargs="+",
            type=float,
            help="one weight per --reward, in their order: the score is the sum of weight x reward over the "
            "rewards that apply (not None) (default: 1.0 each)",
        )
    src.add_argument(
        "--prompts",
        metavar="FILE.jsonl|NAME",
        help='prompts, one {"prompt": ..., <fields for the reward>} per line, or a built-in set: '
        "'arithmetic' (sums and differences of numbers from 1 to 20, with an \"answer\" for "
        "--reward math) (default: open-ended prompts for the sentiment reward)",
    )
    src.add_argument(
        "--env",
        metavar="NAME|module:Class|file.py:Class",
        help="train multi-turn episodes with an environment (docs/agents.md): a built-in one ('arithmetic-retry', "
        "'calculator', 'guess-number'), or a class in TRL's environment_factory convention or a text "
        "environment's (reset / step), found in the current directory too; its prompts (default_prompts) and "
        "reward (default_reward) are the defaults of --prompts and --reward, and one that declares no prompts "
        "needs --prompts (default: no environment, one response per prompt)",
    )
    if eval_prompts:
        src.add_argument(
            "--eval-prompts",
            metavar="FILE.jsonl|NAME",
            help="held-out prompts (same format, or 'arithmetic-eval': arithmetic problems that "
            "'arithmetic' holds out), evaluated every --eval-every steps and after the last "
            "(default with --env and --eval-every: the environment's held-out prompts)",
        )
    if value_model:
        src.add_argument(
            "--value-model",
            metavar="DIR",
            help="start the value model from an earlier run's (gae, gae_turn): its run directory or checkpoint/, "
            "from the same --model and LoRA settings; the policy and the optimizers start fresh "
            "(default: the value model starts from --model with a new head)",
        )
