"""Drop-in replacements for veRL 0.9.1's PPO math, computed with pyppo's ops.

Covered, each with veRL's exact signature, return types, output dtypes and masking conventions:

* ``verl.trainer.ppo.core_algos``: :func:`compute_gae_advantage_return` (also registered as
  ``ADV_ESTIMATOR_REGISTRY["gae"]``); the critic-free outcome estimators
  :func:`compute_grpo_outcome_advantage` (``"grpo"``, Dr. GRPO with
  ``norm_adv_by_std_in_grpo=False``), :func:`compute_grpo_vectorized_outcome_advantage`
  (``"grpo_vectorized"``), :func:`compute_rloo_outcome_advantage` (``"rloo"``),
  :func:`compute_rloo_vectorized_outcome_advantage` (``"rloo_vectorized"``),
  :func:`compute_reinforce_plus_plus_baseline_outcome_advantage`
  (``"reinforce_plus_plus_baseline"``), :func:`compute_reinforce_plus_plus_outcome_advantage`
  (``"reinforce_plus_plus"``); :func:`kl_penalty`, :func:`kl_penalty_forward`,
  :func:`agg_loss`, :func:`compute_policy_loss` (deprecated in veRL, warns the same way),
  :func:`compute_policy_loss_vanilla` (``POLICY_LOSS_REGISTRY["vanilla"]``),
  :func:`compute_policy_loss_gspo` (``["gspo"]``), :func:`compute_policy_loss_cispo`
  (``["cispo"]``), :func:`compute_value_loss`;
* ``verl.utils.torch_functional``: :func:`masked_mean`, :func:`masked_var`,
  :func:`masked_whiten`, :func:`logprobs_from_logits`, :func:`entropy_from_logits`,
  :func:`entropy_from_logits_with_chunking`;
* ``verl.trainer.ppo.ray_trainer``: :func:`compute_advantage`, which computes what veRL does and
  also hands the critic's values to pyppo's critic estimators (an optional target: where that
  module does not import, e.g. without ``torchdata``, it is skipped and named in
  ``Patch.skipped``).

Added, under new names of ``ADV_ESTIMATOR_REGISTRY`` (:mod:`.estimators`, estimators veRL lacks):
:func:`compute_decoupled_gae_advantage_return` (:data:`PYPPO_GAE`, ``"pyppo_gae"``: VC-PPO's
decoupled λ and VAPO's length-adaptive λ) and :func:`compute_turn_gae_advantage_return`
(:data:`PYPPO_GAE_TURN`, ``"pyppo_gae_turn"``: GAE over agent turns). veRL's own
``compute_advantage`` passes such estimators no values; the replacement above does.

Usage: ``import pyppo.integrations.verl as pv; pv.patch()`` (or ``with pv.patched(): ...``), or
call the functions here directly; this package does not import veRL. It is split as veRL splits
those functions: :mod:`.core_algos`, :mod:`.torch_functional` and :mod:`.estimators` (the
estimators veRL lacks, and ``compute_advantage``; the shared argument checks and
dtype bookkeeping in ``_checks``); every adapter is exported here and documented under this
package's name (its ``__module__``), which is where :data:`PEER` and pickling find it.

Half-precision inputs are computed in float32 (float64 when veRL's result is float64) and the
result is cast to the dtype veRL returns, so bf16/fp16 results are at least as close to a float64
computation as veRL's own. Masks must be bool or hold only 0 and 1 (veRL would also accept
fractional weights); any other value is a ``ValueError`` naming the argument. Every deliberate
difference from veRL is listed in ``docs/integrations.md``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from .. import _patching
from .._patching import Patch
from . import core_algos, estimators, torch_functional
from .core_algos import (
    agg_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    compute_value_loss,
    kl_penalty,
    kl_penalty_forward,
)
from .estimators import (
    PYPPO_GAE,
    PYPPO_GAE_TURN,
    compute_advantage,
    compute_decoupled_gae_advantage_return,
    compute_turn_gae_advantage_return,
)
from .torch_functional import (
    entropy_from_logits,
    entropy_from_logits_with_chunking,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
)

__all__ = [
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "kl_penalty",
    "kl_penalty_forward",
    "agg_loss",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_cispo",
    "compute_value_loss",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "logprobs_from_logits",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "compute_advantage",
    "compute_decoupled_gae_advantage_return",
    "compute_turn_gae_advantage_return",
    "PYPPO_GAE",
    "PYPPO_GAE_TURN",
    "PEER",
    "patch",
    "unpatch",
    "patched",
]

_CORE_ADAPTERS = (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    kl_penalty,
    kl_penalty_forward,
    agg_loss,
    compute_policy_loss,
    compute_policy_loss_vanilla,
    compute_policy_loss_gspo,
    compute_policy_loss_cispo,
    compute_value_loss,
)
_TF_ADAPTERS = (
    masked_mean,
    masked_var,
    masked_whiten,
    logprobs_from_logits,
    entropy_from_logits,
    entropy_from_logits_with_chunking,
)
for _adapter in _CORE_ADAPTERS + _TF_ADAPTERS + (compute_advantage, *estimators._ESTIMATORS.values()):
    # The public name of each adapter is this package's, wherever it is defined.
    _adapter.__module__ = __name__
del _adapter

PEER = _patching.Peer.named(
    "verl",
    versions=("0.9.1",),
    targets=_patching.targets(core_algos.PEER_MODULE, *_CORE_ADAPTERS)
    + _patching.targets(torch_functional.PEER_MODULE, *_TF_ADAPTERS),
    import_help="veRL's modules import ray, tensordict and omegaconf; install veRL's dependencies.",
    registrations=tuple(
        _patching.Registration(core_algos.PEER_MODULE, estimators.REGISTRY, key, fn)
        for key, fn in estimators._ESTIMATORS.items()
    ),
    # veRL's trainer module also needs torchdata (its data loader), which veRL's math does not.
    optional_targets=_patching.targets(estimators.TRAINER_MODULE, compute_advantage),
)


def patch(*, force: bool = False) -> Patch:
    """Replace veRL's functions listed in :data:`PEER` with this package's adapters, everywhere
    veRL's package refers to them (defining modules, modules that imported them by name,
    ``ADV_ESTIMATOR_REGISTRY["gae"]``, ``["grpo"]``, ``["rloo"]``, ... ,
    ``POLICY_LOSS_REGISTRY["vanilla"]``, ``["gspo"]``, ``["cispo"]``), and register
    ``ADV_ESTIMATOR_REGISTRY["pyppo_gae"]`` and ``["pyppo_gae_turn"]``.

    Returns the :class:`~pyppo.integrations.Patch` (what was replaced and added; the active one if
    already patched). A veRL release other than 0.9.1 is warned about (``PeerVersionWarning``) and
    left unpatched unless ``force=True``. Raises ImportError when veRL is not installed or its
    modules fail to import; ``verl.trainer.ppo.ray_trainer`` failing to import only skips
    ``compute_advantage`` (listed in ``Patch.skipped``).
    """
    return _patching.patch(PEER, force=force)


def unpatch() -> Patch | None:
    """Put veRL's originals back; returns the patch that was undone, or None if none was active."""
    return _patching.unpatch(PEER)


def patched(*, force: bool = False) -> AbstractContextManager[Patch]:
    """``with patched(): ...`` patches veRL for the block and restores the originals on exit."""
    return _patching.patched(PEER, force=force)
