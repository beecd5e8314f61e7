"""The models of a PPO run: loading a policy from a model source (:mod:`.loading`), the value
model and the frozen reference built from it (:mod:`.value`), a frozen model's linear weights
held in the autocast dtype (:mod:`.frozen`), LoRA adapters (:mod:`.lora`), and
writing a policy as a directory that ``transformers`` loads (:mod:`.export`)."""

from .export import check_exportable, is_export, save_policy
from .frozen import hold_linear_weights
from .loading import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    cache_root,
    load_model_and_tokenizer,
    local_model_dir,
    resolve_model_source,
)
from .lora import add_lora, is_lora, target_modules
from .value import ValueModel, make_reference, position_ids_from_mask, share_frozen_weights

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "ValueModel",
    "add_lora",
    "cache_root",
    "check_exportable",
    "hold_linear_weights",
    "is_export",
    "is_lora",
    "load_model_and_tokenizer",
    "local_model_dir",
    "make_reference",
    "position_ids_from_mask",
    "resolve_model_source",
    "save_policy",
    "share_frozen_weights",
    "target_modules",
]
