"""Exporting the policy as a directory that ``transformers`` (or pyppo) loads on its own.

:func:`save_policy` is called every ``save_every`` steps while training goes on, so it must leave
the model exactly as it found it, and peft's own ways of producing merged weights do not:
``merge_and_unload()`` removes the adapter for good; ``merge_adapter()`` adds the LoRA delta into
the base weights in place, and the ``unmerge_adapter()`` that would follow subtracts it again,
which in floating point does not give back the same bits (the frozen base would drift a little
with every export); and merging into a deep copy doubles the memory of the whole model. The merge
is therefore computed out of place: the merged state dict holds the base model's own tensors
(shared, not copied) for every weight LoRA does not touch and a new tensor
``W + layer.get_delta_weight(adapter)`` for each one it does, so the extra memory is one copy of
the targeted weights, for the duration of the write. The directory is swapped in the way
:func:`pyppo.atomic_dir.swap_in` swaps checkpoints: a reader sees the previous export or the new one,
never a half-written one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from ..atomic_dir import fsync_tree, swap_in

__all__ = ["save_policy", "check_exportable", "is_export"]


def save_policy(
    model, tokenizer, directory: str | os.PathLike, *, merge_lora: bool = True, base_model: str | None = None
) -> Path:
    """Write the policy and its tokenizer as a loadable directory, swapped in atomically.

    ``model`` is only read: its weights, adapters and their state (enabled, merged or not) are the
    same after the call, so training can go on.

    Args:
        model: a ``transformers`` causal LM, or a ``peft.PeftModel`` wrapping one with a single
            active LoRA adapter.
        tokenizer: the policy's tokenizer (anything with ``save_pretrained``).
        directory: where the export goes, e.g. ``runs/<id>/policy``. Its parent is created if
            needed; a previous export there is replaced.
        merge_lora: for a ``PeftModel``: ``True`` writes a plain model with the LoRA delta merged
            into the weights, ``False`` the adapter only. Ignored for a plain model.
        base_model: for ``merge_lora=False``: the model source the adapter was trained on (any
            :func:`pyppo.models.load_model_and_tokenizer` accepts: ``"smollm2-135m-instruct"``, a
            Hugging Face directory, a ``.gguf`` file, a LoRA adapter directory); ``None`` = the
            base model's ``name_or_path`` (what peft would record). Ignored otherwise.

    What is written:
        * a plain model, or a ``PeftModel`` with ``merge_lora=True``: a Hugging Face model
          directory (``config.json``, ``generation_config.json``, ``model.safetensors``, the
          tokenizer files) that ``AutoModelForCausalLM.from_pretrained`` loads; its config has no
          peft entries and tied weights (``tie_word_embeddings``) are stored once, as
          ``save_pretrained`` stores them;
        * a ``PeftModel`` with ``merge_lora=False``: peft's adapter directory
          (``adapter_config.json``, ``adapter_model.safetensors``) and the tokenizer files, whose
          ``base_model_name_or_path`` is the absolute path of a local Hugging Face directory that
          ``AutoModelForCausalLM.from_pretrained`` loads, so that ``PeftModel.from_pretrained``
          and ``AutoPeftModelForCausalLM.from_pretrained`` load the export offline: the
          ``base_model`` directory itself; for ``"smollm2-135m-instruct"`` or a ``.gguf`` file,
          the converted copy in pyppo's cache (:func:`pyppo.models.cache_root`; loading that
          source again rebuilds it if it was deleted); otherwise (a base that is itself an
          adapter directory, a name that is no local model, a model built in memory) the base
          model's weights without the adapter, written inside the export as ``base/`` (a full
          model directory, as large as the model), which the record then names.

        The files are written into a sibling ``.<name>.tmp-*`` directory and fsync'ed; then
        ``<name>`` is renamed to ``<name>.old``, the temporary directory to ``<name>``, and
        ``<name>.old`` is deleted. A crash leaves the previous export at ``<name>`` (or, between
        the two renames, at ``<name>.old``).

    Returns:
        the export directory, ``Path(directory)``.

    Raises:
        ValueError: ``model`` is not a causal LM (or a ``PeftModel`` of one), carries adapters in
            a form that cannot be exported (transformers' own adapter integration, several active
            adapters, DoRA, LoRA biases, ``target_parameters``, trainable tokens, LoRA on a weight
            tied to another one, or with ``merge_lora=False`` an adapter not named ``"default"``),
            or the merged weights' names (or, for a base written beside an adapter, the base
            weights') differ from a plain model's; ``tokenizer`` has no ``save_pretrained``.
        OSError: writing failed; the previous export is left in place.
    """
    peft_model = _as_peft_model(model)
    base = peft_model.get_base_model() if peft_model is not None else model
    _check_causal_lm(base, "model" if peft_model is None else "model (the PeftModel's base model)")
    if not callable(getattr(tokenizer, "save_pretrained", None)):
        raise ValueError(
            f"tokenizer: expected a transformers tokenizer with save_pretrained(), got {type(tokenizer).__name__}"
        )

    if peft_model is None:
        _check_no_adapters(model)

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    else:
        adapter = _lora_adapter(peft_model, merge_lora)
        if merge_lora:

            def write(tmp: Path) -> None:
                merged = _merged_state_dict(peft_model, adapter)
                # save_pretrained pops the tensors out of the dict it is given as it writes them.
                base.save_pretrained(tmp, state_dict=merged, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
        else:
            spec = base_model if base_model is not None else peft_model.peft_config[adapter].base_model_name_or_path
            base_dir = _local_base_dir(spec)
            # Recorded absolute: peft and transformers read a relative path from the current
            # directory, not from the adapter's.
            beside = Path(os.path.abspath(directory)) / BASE_DIR

            def write(tmp: Path) -> None:
                # save_embedding_layers=False: peft's "auto" looks the base model up on the Hub to
                # see whether the vocabulary was resized; pyppo never resizes it nor goes online.
                peft_model.save_pretrained(
                    tmp, selected_adapters=[adapter], safe_serialization=True, save_embedding_layers=False
                )
                if base_dir is None:
                    base.save_pretrained(
                        tmp / BASE_DIR, state_dict=_base_state_dict(peft_model), safe_serialization=True
                    )
                    tokenizer.save_pretrained(tmp / BASE_DIR)
                config_path = tmp / "adapter_config.json"
                config = json.loads(config_path.read_text())
                config["base_model_name_or_path"] = str(base_dir if base_dir is not None else beside)
                config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                tokenizer.save_pretrained(tmp)

    return _write_atomically(Path(directory), write)


# ------------------------------------------------------------------------------ checks


def check_exportable(model, *, merge_lora: bool = True) -> None:
    """Raise the ``ValueError`` that :func:`save_policy` would raise for ``model``'s structure
    (adapter kind, LoRA on a tied weight with ``merge_lora``, merged names), computing no merged
    weight and writing nothing: the trainer calls it when it is built, so that a run cannot train
    every step and then fail to write its ``policy/``.

    Raises:
        ValueError: as :func:`save_policy`, for everything but the tokenizer and the writing.
    """
    peft_model = _as_peft_model(model)
    base = peft_model.get_base_model() if peft_model is not None else model
    _check_causal_lm(base, "model" if peft_model is None else "model (the PeftModel's base model)")
    if peft_model is None:
        _check_no_adapters(model)
        return
    adapter = _lora_adapter(peft_model, merge_lora)
    if merge_lora:
        _merged_state_dict(peft_model, adapter, deltas=False)


def _as_peft_model(model):
    """``model`` when it is a ``peft.PeftModel``, else ``None`` (peft need not be installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return model if isinstance(model, PeftModel) else None


def _check_causal_lm(model, what: str) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"{what}: expected a transformers causal LM or a peft.PeftModel wrapping one, got {type(model).__name__}"
        )
    config = getattr(model, "config", None)
    if not model.can_generate() or getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{what}: expected a causal LM (a model with a language-modelling head that "
            f"generates), got {type(model).__name__}"
        )


def _check_no_adapters(model) -> None:
    if getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError(
            "model: has adapters loaded through transformers' peft integration "
            "(model.load_adapter/add_adapter), which save_pretrained would write as an "
            "adapter only; wrap the base model in a peft.PeftModel instead"
        )
    for name, module in model.named_modules():
        if type(module).__module__.startswith("peft."):
            raise ValueError(
                f"model: module {name!r} is a peft layer ({type(module).__name__}) but "
                "model is not a peft.PeftModel; pass the PeftModel"
            )


def _lora_adapter(peft_model, merge_lora: bool) -> str:
    """The one active adapter's name, after checking that its kind can be exported."""
    from peft import PeftType

    active = peft_model.active_adapters
    if len(active) != 1:
        raise ValueError(f"model: expected exactly one active adapter, got {list(active)}")
    adapter = active[0]
    config = peft_model.peft_config[adapter]
    if config.peft_type != PeftType.LORA:
        raise ValueError(f"model: adapter {adapter!r} is {config.peft_type}, only LoRA adapters are supported")
    if not merge_lora and adapter != "default":
        raise ValueError(
            f"model: merge_lora=False exports the adapter named 'default' (peft writes any "
            f"other one into a subdirectory), got {adapter!r}"
        )
    unsupported = [
        name
        for name, on in [
            ("use_dora", getattr(config, "use_dora", False)),
            ("lora_bias", getattr(config, "lora_bias", False)),
            ("target_parameters", getattr(config, "target_parameters", None)),
            ("trainable_token_indices", getattr(config, "trainable_token_indices", None)),
        ]
        if on
    ]
    if merge_lora and unsupported:
        raise ValueError(
            f"model: adapter {adapter!r} sets {', '.join(unsupported)}, which the merged "
            "export does not handle; use merge_lora=False"
        )
    return adapter


#: The subdirectory of an adapter-only export that holds its base model, when no other local
#: directory does.
BASE_DIR = "base"


def _local_base_dir(spec) -> Optional[Path]:
    """The local Hugging Face directory of the model source ``spec``
    (:func:`pyppo.models.loading.local_model_dir`), or ``None`` when there is none: ``spec`` is
    empty, names nothing local, or is a LoRA adapter directory (the base to record is then its
    base with its adapter merged in, which exists nowhere but in memory)."""
    from .loading import local_model_dir

    if not spec:
        return None
    try:
        return local_model_dir(spec)
    except (OSError, ValueError, ImportError):
        return None


def _base_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """The base model's own weights under a plain model's names: peft's ``<module>.base_layer.``
    becomes ``<module>.``, a ``modules_to_save`` wrapper gives its original module, and the
    adapter's parameters (``lora_*``, the trained copies) are left out. The tensors are the
    model's (nothing is copied); checked against a fresh model's names."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    base = peft_model.get_base_model()
    wrappers = [
        (name, isinstance(module, LoraLayer))
        for name, module in base.named_modules()
        if isinstance(module, (LoraLayer, ModulesToSaveWrapper))
    ]
    wrappers.sort(key=lambda wrapper: wrapper[0].count("."), reverse=True)  # the deepest first

    def plain_key(key: str) -> Optional[str]:
        for name, lora in wrappers:
            prefix = f"{name}." if name else ""
            if key.startswith(prefix):
                head, _, tail = key[len(prefix) :].partition(".")
                if head != ("base_layer" if lora else "original_module"):
                    return None
                key = prefix + tail
        return key

    state = {
        new: tensor for new, tensor in ((plain_key(k), t) for k, t in base.state_dict().items()) if new is not None
    }
    _check_plain_names(state, base, "base weights", "pass base_model, a local model directory of the base")
    return state


# ------------------------------------------------------------------------------ the merge


def _merged_state_dict(peft_model, adapter: str, *, deltas: bool = True) -> dict[str, torch.Tensor]:
    """The plain causal LM's state dict with ``adapter`` merged in, computed out of place
    (``deltas=False``: every check, but the base weights left as they are).

    Keys are those of the unwrapped model (peft's ``<module>.base_layer.`` becomes ``<module>.``, a
    ``modules_to_save`` copy replaces its original, the ``lora_*`` parameters are dropped), checked
    against a fresh model of the same class built on the meta device.
    """
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    base = peft_model.get_base_model()
    # (module name, how to rename the keys below it); deepest first, so that each rule rewrites
    # only what comes after its own, not yet rewritten, prefix.
    rules: list[tuple[str, object]] = []
    lora_layers: list[tuple[str, LoraLayer]] = []
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            rules.append((name, _lora_rule(module)))
            lora_layers.append((name, module))
        elif isinstance(module, ModulesToSaveWrapper):
            rules.append((name, _modules_to_save_rule(adapter)))
        elif isinstance(module, BaseTunerLayer) or type(module).__module__.startswith("peft."):
            raise ValueError(
                f"model: module {name!r} is a {type(module).__name__}, which the merged "
                "export does not handle; use merge_lora=False"
            )
    rules.sort(key=lambda rule: rule[0].count("."), reverse=True)

    def plain_key(key: str) -> str | None:
        for name, rule in rules:
            prefix = f"{name}." if name else ""
            if key.startswith(prefix):
                key = rule(prefix, key[len(prefix) :])
                if key is None:
                    return None
        return key

    merged: dict[str, torch.Tensor] = {}
    for key, tensor in base.state_dict().items():
        new = plain_key(key)
        if new is None:
            continue
        if new in merged:
            raise ValueError(f"model: two weights map to {new!r} once peft's wrappers are removed")
        merged[new] = tensor

    # Weights that share storage are tied (lm_head and embed_tokens under tie_word_embeddings);
    # save_pretrained keeps one of them, so a delta on one would be lost or untie them.
    storage_names: dict[tuple, list[str]] = {}
    for key, tensor in merged.items():
        storage_names.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(key)
    tied = {key for names in storage_names.values() if len(names) > 1 for key in names}

    with torch.no_grad():
        for name, layer in lora_layers:
            if adapter not in layer.lora_A and adapter not in getattr(layer, "lora_embedding_A", {}):
                continue  # this layer has no weights of the exported adapter
            if adapter in getattr(layer, "merged_adapters", []):
                continue  # merge_adapter() already added it to the base weight
            key = plain_key(f"{name}.base_layer.weight")
            if key is None or key not in merged:
                raise ValueError(f"model: cannot find the base weight of LoRA layer {name!r}")
            if key in tied:
                raise ValueError(
                    f"model: LoRA layer {name!r} adapts {key!r}, which is tied to "
                    f"{sorted(tied - {key})}; a merged export would untie them; use "
                    "merge_lora=False"
                )
            if not deltas:
                continue
            weight = merged[key]
            delta = layer.get_delta_weight(adapter)
            merged[key] = (weight + delta.to(weight.device)).to(weight.dtype)

    _check_plain_names(merged, base, "merged weights", "use merge_lora=False")
    return merged


def _lora_rule(layer):
    adapter_attrs = set(layer.adapter_layer_names) | set(layer.other_param_names)

    def rule(prefix: str, rest: str) -> str | None:
        head, _, tail = rest.partition(".")
        if head == "base_layer":
            return prefix + tail
        if head in adapter_attrs:
            return None
        raise ValueError(f"model: unexpected weight {prefix + rest!r} in a LoRA layer")

    return rule


def _modules_to_save_rule(adapter: str):
    def rule(prefix: str, rest: str) -> str | None:
        head, _, tail = rest.partition(".")
        if head == "modules_to_save":
            name, _, tail = tail.partition(".")
            return prefix + tail if name == adapter else None
        if head == "original_module":
            return None
        raise ValueError(f"model: unexpected weight {prefix + rest!r} in a modules_to_save wrapper")

    return rule


def _check_plain_names(state: dict, base, what: str, remedy: str) -> None:
    """Raise ``ValueError`` naming a few keys when ``state``'s keys are not those of a plain
    model of ``base``'s class (:func:`_fresh_state_dict_keys`)."""
    expected = set(_fresh_state_dict_keys(base))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        more = lambda names: "..." if len(names) > 5 else ""  # noqa: E731
        raise ValueError(
            f"model: the {what}' names differ from a plain {type(base).__name__}'s (missing {missing[:5]}"
            f"{more(missing)}, unexpected {extra[:5]}{more(extra)}); {remedy}"
        )


def _fresh_state_dict_keys(base) -> list[str]:
    """The state dict keys of a new, unwrapped model of ``base``'s class and config (built on the
    meta device: no memory)."""
    import copy

    with torch.device("meta"):
        fresh = type(base)._from_config(copy.deepcopy(base.config))
    return list(fresh.state_dict().keys())


# ------------------------------------------------------------------------------ the swap


def is_export(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a finished export (a model, or an adapter, with its weights)."""
    return _is_export(Path(directory))


def _is_export(d: Path) -> bool:
    """Whether ``d`` looks like a finished export: a model config with weights, or an adapter
    config with adapter weights. (Only a fully written temporary directory is ever renamed to the
    export's name, so this only tells a backup worth keeping from debris left by something else.)"""
    if not d.is_dir():
        return False
    if (d / "config.json").is_file():
        return any(d.glob("model*.safetensors")) or any(d.glob("pytorch_model*.bin"))
    return (d / "adapter_config.json").is_file() and any(d.glob("adapter_model.*"))


def _write_atomically(target: Path, write) -> Path:
    """``write(tmp)`` into a fresh sibling temporary directory, swapped in as ``target`` by
    :func:`pyppo.atomic_dir.swap_in`."""

    def write_and_sync(tmp: Path) -> None:
        # mkdtemp makes the directory private (0700); an export is an ordinary readable directory.
        tmp.chmod(0o755)
        write(tmp)
        fsync_tree(tmp)

    return swap_in(target, write_and_sync, _is_export)
