"""The PPO trainer: the step and its stages (:mod:`.ppo`), how a trainer is put together
(:mod:`.assemble`), the rollout buffer (:mod:`.buffer`), the log-prob and value forwards
(:mod:`.logprob_head`), the value model's share of a step (:mod:`.critic`), the advantage
estimators (:mod:`.advantages`), the correction for the sampler's mismatch
(:mod:`.rollout_correction`), the KL controllers
(:mod:`.kl_controllers`), the step's statistics (:mod:`.step_stats`) and what it returns (:mod:`.results`)."""

from ..run.nonfinite import NonFiniteUpdateError
from .ppo import PPOTrainer
from .results import METRIC_KEYS, VALUE_METRIC_KEYS, MicroStepResult, StepResult

__all__ = ["PPOTrainer", "StepResult", "MicroStepResult", "METRIC_KEYS", "VALUE_METRIC_KEYS", "NonFiniteUpdateError"]
