"""A run's TOML files as ``pyppo train`` and ``pyppo export`` read them (``--config FILE.toml``
and a run's ``config.toml``): each key checked (a setting by its knob, a run source by its form),
and a run source compared with a resumed run's (paths resolved, a reasoning-gym spec by its
canonical spelling, rewards spec by spec)."""

from __future__ import annotations

from pathlib import Path

from ..tasks.reasoning_gym import canonical_task_spec, is_task_spec
from .flags import CLIError

__all__ = [
    "RUN_KEYS",
    "check_keys",
    "check_run_value",
    "read_toml",
    "recorded_run_value",
    "reward_specs",
    "same_run_value",
    "same_source",
    "shown_run_value",
]

#: Settings of a run that are not PPOConfig fields: where the model, reward and prompts come from.
#: ``reward`` is one spec or a list of them, ``reward_weights`` their weights (docs/rewards.md).
RUN_KEYS = ("model", "reward", "reward_weights", "prompts", "eval_prompts", "env", "value_model")


def read_toml(path: Path, what: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    if not path.is_file():
        raise CLIError(f"{what} {str(path)!r} does not exist")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise CLIError(f"{what} {str(path)!r}: invalid TOML: {exc}") from None


def same_source(a: str, b) -> bool:
    """Whether two model/reward/prompts specs name the same thing (paths compared resolved)."""
    if not isinstance(b, str):
        return False
    if is_task_spec(a) and is_task_spec(b):  # two spellings of one reasoning-gym set
        return canonical_task_spec(a) == canonical_task_spec(b)
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() or pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def reward_specs(value) -> list:
    """``reward`` as a list of specs (one spec is a list of one)."""
    return [value] if isinstance(value, str) else list(value)


def same_run_value(key: str, a, b) -> bool:
    """Whether two values of the run key ``key`` name the same thing: the rewards spec by spec, in
    order; the weights as numbers; a source as :func:`same_source`."""
    if key == "reward":
        a, b = reward_specs(a), reward_specs(b)
        return len(a) == len(b) and all(same_source(x, y) for x, y in zip(a, b))
    if key == "reward_weights":
        return [float(w) for w in a] == [float(w) for w in b]
    return same_source(a, b)


def shown_run_value(value):
    """A run key's value as a message shows it: one repeated flag's value (``--reward math``) as is."""
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) else value


def recorded_run_value(resumed: dict, key: str):
    """The resumed run's value of ``key``; its weights are 1.0 per reward when it names none."""
    if key == "reward_weights" and key not in resumed and "reward" in resumed:
        return [1.0] * len(reward_specs(resumed["reward"]))
    return resumed.get(key)


def check_run_value(key: str, value, where: str) -> None:
    """A config file's ``reward`` (a spec or a non-empty list of them), ``reward_weights`` (a list
    of numbers) or other source (a string).

    Raises:
        CLIError: naming ``where`` and the key.
    """
    if key == "reward" and isinstance(value, list):
        if not value or not all(isinstance(v, str) and v for v in value):
            raise CLIError(f"{where}: 'reward' must be a spec or a non-empty list of specs, got {value!r}")
    elif key == "reward_weights":
        numbers = isinstance(value, list) and all(type(w) in (int, float) for w in value)  # not a bool
        if not numbers:
            raise CLIError(f"{where}: 'reward_weights' must be a list of numbers, one per reward, got {value!r}")
    elif not isinstance(value, str):
        raise CLIError(f"{where}: {key!r} must be a string, got {value!r}")


def check_keys(table: dict, where: str) -> dict:
    """The settings of a flat TOML table, with ``"none"`` read as None for optional fields.

    Raises:
        CLIError: an unknown key or a table, naming it and the known keys.
    """
    from pyppo.config import config_knobs

    knobs = dict(config_knobs())
    out = {}
    for key, value in table.items():
        if key not in RUN_KEYS and key not in knobs:
            known = ", ".join(sorted(set(RUN_KEYS) | set(knobs)))
            if isinstance(value, dict):
                raise CLIError(f"{where}: unknown table [{key}]; settings are flat keys: {known}")
            raise CLIError(f"{where}: unknown key {key!r}; known keys: {known}")
        if key in knobs and knobs[key].optional and isinstance(value, str) and value.lower() == "none":
            value = None  # TOML has no null; config.toml writes None as "none"
        # Each source is checked on its own: a bad value that a flag overrides is still a mistake
        # in the file.
        if key in knobs:
            try:
                knobs[key].validate(key, value)
            except ValueError as exc:
                raise CLIError(f"{where}: {exc}") from None
        else:
            check_run_value(key, value, where)
        out[key] = value
    return out
