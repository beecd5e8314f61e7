"""What acts only with what: the rules of :data:`NEEDS` (one :class:`Needs` each) and
:func:`inert_settings`, which finds the knobs of a config that a rule leaves acting on nothing
(:class:`InertSettings`, the error that names them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Tuple


@dataclass(frozen=True)
class Needs:
    """One rule of :data:`NEEDS`: its ``knobs`` act only where ``holds(settings, world_size)``.

    A knob breaks the rule when it is set away from its field default where the rule does not
    hold. So a knob whose default is ``"auto"`` (a value resolved from other knobs) breaks it only
    once it names a value: ``auto`` always means "what acts here". ``holds`` reads fields only,
    not derived properties, so that :meth:`PPOConfig.with_changes` can ask it of settings that are
    not a valid config yet.

    Attributes:
        knobs: the field names the rule is about.
        when: the condition, as the docs' table shows it (``"lora_rank > 0"``).
        needs: completes "<knob> has no effect here: it needs ..."; ``str.format``-ed with the
            settings as ``c`` and the number of processes as ``world``.
        holds: ``(settings, world_size) -> bool``; ``world_size`` is ``None`` unless ``world``.
        world: the rule turns on the number of processes, which only
            :meth:`PPOConfig.check_world_size` knows: it is checked there.
        warn: a broken rule is a ``UserWarning``, not a ``ValueError``: for a rule whose outcome
            turns on what the config does not know (a single process may still be a test of a
            setting meant for several).
    """

    knobs: Tuple[str, ...]
    when: str
    needs: str
    holds: Callable[[Any, Optional[int]], bool]
    world: bool = False
    warn: bool = False


_VALUE_MODEL = ("value_lr", "vf_coef", "cliprange_value", "critic_warmup_steps", "value_lora")
_LORA = ("lora_alpha", "lora_target_modules", "value_lora", "merge_lora")

#: Every knob that acts only together with others, and what it needs. A knob that no rule names
#: is marked ``always_acts`` in its :func:`knob` (a test keeps the two complete).
NEEDS: Tuple[Needs, ...] = (
    Needs(
        _VALUE_MODEL,
        "advantage_estimator 'gae' or 'gae_turn'",
        "a value model (advantage_estimator 'gae' or 'gae_turn'; {c.advantage_estimator!r} trains none)",
        lambda c, n: c.advantage_estimator in ("gae", "gae_turn"),
    ),
    Needs(
        ("lam", "lam_critic", "lam_alpha"),
        "advantage_estimator = 'gae'",
        "token-level GAE (advantage_estimator = 'gae', not {c.advantage_estimator!r})",
        lambda c, n: c.advantage_estimator == "gae",
    ),
    Needs(
        ("gamma_turn", "lam_turn"),
        "advantage_estimator = 'gae_turn'",
        "GAE over agent turns (advantage_estimator = 'gae_turn', not {c.advantage_estimator!r})",
        lambda c, n: c.advantage_estimator == "gae_turn",
    ),
    Needs(
        ("gamma",),
        "advantage_estimator 'gae' or 'reinforce_pp'",
        "token returns (advantage_estimator 'gae' or 'reinforce_pp', not {c.advantage_estimator!r})",
        lambda c, n: c.advantage_estimator in ("gae", "reinforce_pp"),
    ),
    Needs(
        ("whiten_advantages",),
        "advantage_estimator other than 'grpo' and 'rloo'",
        "a batch-whitened estimator ({c.advantage_estimator!r} normalises within each group)",
        lambda c, n: c.advantage_estimator not in ("grpo", "rloo"),
    ),
    Needs(
        ("grpo_std_normalize",),
        "advantage_estimator = 'grpo'",
        "advantage_estimator = 'grpo', not {c.advantage_estimator!r}",
        lambda c, n: c.advantage_estimator == "grpo",
    ),
    Needs(
        ("dual_clip",),
        "policy_loss = 'ppo'",
        "policy_loss = 'ppo', not {c.policy_loss!r}",
        lambda c, n: c.policy_loss == "ppo",
    ),
    Needs(
        ("loss_agg_norm",),
        "loss_agg = 'seq-mean-token-sum-norm'",
        "loss_agg = 'seq-mean-token-sum-norm' (the one mode that divides by it), not {c.loss_agg!r}",
        lambda c, n: c.loss_agg == "seq-mean-token-sum-norm",
    ),
    # Without the hidden-state path there is no fused op to call: both settings take the log-probs' path.
    Needs(
        ("fused_policy_loss",),
        "logprobs_from_hidden = true",
        "logprobs_from_hidden = true (the fused loss is a step of the hidden-state path)",
        lambda c, n: c.logprobs_from_hidden,
    ),
    Needs(
        ("target_kl",),
        "kl_coef > 0",
        "kl_coef > 0 (the adaptive update is multiplicative: a coefficient of 0 never moves)",
        lambda c, n: c.kl_coef > 0,
    ),
    Needs(
        ("kl_horizon",),
        "target_kl set",
        "target_kl (the horizon is the adaptive controller's; without a target, kl_coef is fixed)",
        lambda c, n: c.target_kl is not None,
    ),
    Needs(
        ("kl_loss_estimator",),
        "kl_loss_coef > 0",
        "kl_loss_coef > 0 (without it the loss has no KL term)",
        lambda c, n: c.kl_loss_coef > 0,
    ),
    Needs(
        ("filter_groups",),
        "samples_per_prompt >= 2",
        "samples_per_prompt >= 2, got {c.samples_per_prompt} (it drops groups whose responses all scored the same)",
        lambda c, n: c.samples_per_prompt >= 2,
    ),
    Needs(("filter_groups_max_tries",), "filter_groups = true", "filter_groups = true", lambda c, n: c.filter_groups),
    Needs(("overlong_penalty",), "overlong_buffer > 0", "overlong_buffer > 0", lambda c, n: c.overlong_buffer > 0),
    Needs(_LORA, "lora_rank > 0", "lora_rank > 0 (LoRA is off)", lambda c, n: c.lora_rank > 0),
    # The transformers engine samples with the trainer's own forward: it returns no log-probs of
    # its own for the correction to weigh against.
    Needs(
        ("rollout_correction",),
        "rollout_engine = 'vllm'",
        "rollout_engine = 'vllm' (an engine that samples with numerics of its own and returns its log-probs), "
        "not {c.rollout_engine!r}",
        # "none" says what the transformers engine does anyway (config files of earlier runs name it).
        lambda c, n: c.rollout_engine == "vllm" or c.rollout_correction == "none",
    ),
    Needs(
        ("rollout_is_cap",),
        "a rollout_correction that acts (not 'none'; 'auto' with rollout_engine = 'vllm')",
        "a rollout_correction that acts (not 'none'; 'auto' acts with rollout_engine = 'vllm' only)",
        lambda c, n: c.rollout_engine == "vllm" if c.rollout_correction == "auto" else c.rollout_correction != "none",
    ),
    Needs(
        ("vllm_kv_cache_gib", "vllm_gpu_memory_utilization"),
        "rollout_engine = 'vllm'",
        "rollout_engine = 'vllm', not {c.rollout_engine!r}",
        lambda c, n: c.rollout_engine == "vllm",
    ),
    Needs(
        ("fsdp",),
        "several processes",
        "several processes, and this run has {world} (it shards over torchrun's processes: --nproc N or "
        "torchrun --nproc-per-node N)",
        lambda c, n: n > 1,
        world=True,
        warn=True,
    ),
)


class InertSettings(ValueError):
    """Settings that act on nothing where they are (:data:`NEEDS`).

    Attributes:
        groups: ``[(what they need, [(key, value), ...]), ...]``, one entry per broken rule.
    """

    def __init__(self, groups: List[Tuple[str, List[Tuple[str, Any]]]]):
        self.groups = groups
        super().__init__(self.describe())

    def describe(self, name: Callable[[str, Any], str] = lambda key, value: f"{key} = {value!r}") -> str:
        """The message, each setting shown as ``name(key, value)`` (the command line names its flags)."""
        parts = []
        for needs, settings in self.groups:
            shown = [name(key, value) for key, value in settings]
            one = len(shown) == 1
            listed = shown[0] if one else ", ".join(shown[:-1]) + " and " + shown[-1]
            parts.append(
                f"{listed} {'has' if one else 'have'} no effect here: {'it needs' if one else 'they need'} {needs}"
            )
        return "; ".join(parts)


def inert_settings(
    c: Any, defaults: Mapping[str, Any], world_size: Optional[int] = None, *, warn: bool = False
) -> List[Tuple[str, List[Tuple[str, Any]]]]:
    """The knobs of ``c`` (a config, or any object with its fields) set away from their defaults
    where their rule of :data:`NEEDS` does not hold, as :attr:`InertSettings.groups` (empty: none).

    Args:
        defaults: each knob's default (``PPOConfig``'s field defaults).
        world_size: check the rules that turn on the number of processes (only those).
        warn: check the rules that warn (only those), not the ones that refuse.
    """
    groups = []
    for rule in NEEDS:
        if rule.warn != warn or rule.world != (world_size is not None) or rule.holds(c, world_size):
            continue
        names = [name for name in rule.knobs if getattr(c, name) != defaults[name]]
        if names:
            groups.append((rule.needs.format(c=c, world=world_size), [(name, getattr(c, name)) for name in names]))
    return groups
