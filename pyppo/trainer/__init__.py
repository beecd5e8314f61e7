"""The PPO algorithm, one step at a time: the step and its stages (:mod:`.ppo`), how a trainer's
models are put together (:mod:`.assemble`), sampling and scoring a batch (:mod:`.sampling`), the
rollout buffer (:mod:`.buffer`), the rollout's forwards (:mod:`.rollout_forwards`), the log-prob and
value heads and the policy objective (:mod:`.logprob_head`), the value model's share of a step
(:mod:`.critic`), the advantage estimators and point 5 (:mod:`.advantages`), DAPO's overlong rules
(:mod:`.overlong`), the correction for the sampler's mismatch (:mod:`.rollout_correction`), the KL
controllers (:mod:`.kl_controllers`), the non-finite guards (:mod:`.guards`), the step's statistics
(:mod:`.step_stats`) and what it returns (:mod:`.results`).

:class:`PPOTrainer` here is the algorithm; ``pyppo.PPOTrainer`` (:mod:`pyppo.run.trainer`) adds
the run around the steps. Nothing here imports :mod:`pyppo.run`."""

from .guards import NonFiniteUpdateError
from .ppo import PPOTrainer
from .results import METRIC_KEYS, VALUE_METRIC_KEYS, MicroStepResult, StepResult

__all__ = ["PPOTrainer", "StepResult", "MicroStepResult", "METRIC_KEYS", "VALUE_METRIC_KEYS", "NonFiniteUpdateError"]
