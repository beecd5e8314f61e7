"""The PPO trainer: the step and its stages (:mod:`.ppo`), how a trainer is put together
(:mod:`.assemble`), the rollout buffer (:mod:`.buffer`), the log-prob and value forwards
(:mod:`.logprob_head`), the advantage estimators (:mod:`.advantages`), the KL controllers
(:mod:`.kl_controllers`), the step's statistics (:mod:`.step_stats`) and what it returns (:mod:`.results`)."""

from ..run.nonfinite import NonFiniteUpdateError
from .ppo import PPOTrainer
from .results import METRIC_KEYS, MicroStepResult, StepResult

__all__ = ["PPOTrainer", "StepResult", "MicroStepResult", "METRIC_KEYS", "NonFiniteUpdateError"]
