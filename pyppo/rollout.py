"""Sampling responses: prompt encoding, the generation config, and the response mask.

The log-probs PPO computes must be those of the distribution ``generate()`` really samples from.
``transformers`` fills every generation field the caller leaves unset from the model's own
``generation_config`` (a checkpoint's ``generation_config.json`` often carries ``top_k``,
``top_p``, ``repetition_penalty``...), so :func:`generate` pins every sampling filter to its
neutral value and hides the model's own config for the duration of the call. See
``docs/trainer.md`` (rollout).
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["NEUTRAL_SAMPLING", "encode_prompts", "generation_config", "generate", "packed_linear_weights",
           "response_mask_from_eos"]

#: Every field of ``GenerationConfig`` that filters or reshapes the sampling distribution, at the
#: value that leaves ``softmax(z / temperature)`` untouched. (Fields whose neutral value is None,
#: e.g. ``min_p``, ``suppress_tokens``, ``bad_words_ids``, ``sequence_bias``, stay None; they cannot
#: leak in from the model because :func:`generate` swaps the model's config for ours.)
NEUTRAL_SAMPLING: Dict[str, Any] = {
    "do_sample": True,
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_new_tokens": 0,
    "renormalize_logits": False,
    # Leaves finite logits untouched; a diverged model's NaN/inf ones would make the sampler raise,
    # so they are replaced, the rollout finishes, and the trainer names its non-finite log-probs.
    "remove_invalid_values": True,
}


def generation_config(config, *, eos_token_id: int, pad_token_id: int):
    """The ``GenerationConfig`` of the rollout: pure sampling at ``config.temperature`` (with
    ``config.top_k`` / ``config.top_p``, neutral by default), up to ``config.max_new_tokens``."""
    from transformers import GenerationConfig

    return GenerationConfig(
        **NEUTRAL_SAMPLING,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        max_new_tokens=config.max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
    )


@contextmanager
def _only_this_generation_config(model: nn.Module, gen_config) -> Iterator[None]:
    # generate() fills unset fields from model.generation_config; while it runs that config is
    # ours, so nothing of the checkpoint's sampling defaults can reach the sampler.
    saved = getattr(model, "generation_config", None)
    model.generation_config = gen_config
    try:
        yield
    finally:
        model.generation_config = saved


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    # Plain CPU float32 weights only: not FSDP's DTensors, not quantised or half-precision layers.
    return (isinstance(module, nn.Linear) and type(w.data) is torch.Tensor and w.device.type == "cpu"
            and w.dtype == torch.float32)


def _packed_forward(packed: torch.Tensor, weight: torch.Tensor, bias):
    # The closure must not refer to itself: a reference cycle would keep the packed copy alive
    # until the cyclic garbage collector ran, possibly through the update that follows.
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return torch.nn.functional.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def packing_available(model: nn.Module, device: torch.device) -> bool:
    """Whether :func:`packed_linear_weights` applies: a float32 run on a CPU torch with oneDNN,
    outside autocast (under autocast the sampler must run the GEMMs in the autocast dtype, as the
    log-prob forwards do)."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and not torch.is_autocast_enabled("cpu")
            and any(_packable(m) for m in model.modules()))


@contextmanager
def packed_linear_weights(model: nn.Module, batch_size: int) -> Iterator[int]:
    """While sampling on a CPU, run every float32 ``nn.Linear`` of ``model`` (the LM head
    included) on a copy of its weight pre-packed by oneDNN for ``batch_size`` rows.

    Token-by-token decoding multiplies ``[B, H]`` activations by every weight matrix: a GEMM
    with few rows, which is bound by reading the weights. MKL's ``sgemm`` re-packs the weight on
    every call at these shapes and reads it at a fraction of the memory bandwidth; a weight packed
    once per rollout (the weights do not change while sampling) is read at close to it. This is
    the packing ``torch.compile`` applies to frozen CPU inference graphs, done here for the one
    phase where the weights are frozen. The packed copies (one more copy of the linear weights)
    are freed on exit.

    The outputs equal ``F.linear``'s to float32 rounding (a different summation order), so the
    sampled tokens follow the same distribution; the log-probs PPO trains on are computed again
    by the training-layout forwards in any case.

    Yields:
        the number of layers packed (0 when nothing applies; the model is then unchanged).
    """
    if not packing_available(model, next(model.parameters()).device):
        yield 0
        return
    patched = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if _packable(module) and "forward" not in module.__dict__:
                    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), max(1, batch_size))
                    module.forward = _packed_forward(packed, module.weight,
                                                     None if module.bias is None else module.bias.detach())
                    patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            del module.forward


@torch.no_grad()
def generate(model: nn.Module, query_ids: torch.Tensor, query_mask: torch.Tensor, gen_config,
             **kwargs: Any) -> Any:
    """``model.generate`` on left-padded prompts with exactly ``gen_config``; on a CPU in float32,
    with the linear layers' weights pre-packed for the batch (:func:`packed_linear_weights`).

    Args:
        model: a ``transformers`` causal LM.
        query_ids: ``[B, P]`` int64, left-padded.
        query_mask: ``[B, P]`` bool, 1 at real prompt tokens.
        gen_config: from :func:`generation_config`.
        kwargs: passed to ``generate`` (e.g. ``output_scores=True`` in tests).

    Returns:
        what ``generate`` returns: by default ``[B, P + T]`` int64 (prompt then response).
    """
    with ExitStack() as stack:
        stack.enter_context(_only_this_generation_config(model, gen_config))
        stack.enter_context(packed_linear_weights(model, query_ids.shape[0]))
        return model.generate(input_ids=query_ids, attention_mask=query_mask.long(),
                              generation_config=gen_config, **kwargs)


def prompt_token_limit(model: nn.Module, *, max_new_tokens: int, max_prompt_length: Optional[int]) -> tuple:
    """``(limit, room)``: the most tokens a prompt keeps (``max_prompt_length``, and at most the
    ``room`` the model's context leaves: its ``max_position_embeddings`` minus ``max_new_tokens``);
    ``None`` for no limit / no known context.

    Raises:
        ValueError: ``max_new_tokens`` leaves no room in the model's context.
    """
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    room = None
    if isinstance(context, int) and context > 0:
        room = context - max_new_tokens
        if room < 1:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) leaves no room for a prompt in the model's "
                             f"context of {context} positions")
    limits = [n for n in (max_prompt_length, room) if n is not None]
    return (min(limits) if limits else None), room


def check_prompt_lengths(tokenizer, prompts: Sequence[str], *, use_chat_template: bool, room: Optional[int],
                         max_new_tokens: int, max_prompt_length: Optional[int], truncate: bool,
                         what: str = "prompts") -> None:
    """Say which prompts the model's context cannot hold (more tokens than ``room``, what
    :func:`prompt_token_limit` returns): a warning that they are cut from the left (``truncate``),
    else an error. Prompts that only ``max_prompt_length`` (asked for) cuts are not reported.
    Indices are positions in ``prompts``.

    Raises:
        ValueError: with ``truncate`` false, a prompt longer than ``room`` (naming it).
    """
    if not prompts or room is None or (max_prompt_length is not None and max_prompt_length <= room):
        return
    texts = _prompt_texts(tokenizer, prompts, use_chat_template)
    encoded = tokenizer(texts, add_special_tokens=not _uses_template(tokenizer, use_chat_template))
    long = [(i, len(ids)) for i, ids in enumerate(encoded["input_ids"]) if len(ids) > room]
    if not long:
        return
    listed = ", ".join(f"{i} ({n} tokens)" for i, n in long[:5]) + (f" and {len(long) - 5} more" if len(long) > 5 else "")
    head = (f"{what}: prompt{'s' if len(long) > 1 else ''} {listed} longer than the {room} tokens the model's "
            f"context leaves ({room + max_new_tokens} positions minus max_new_tokens = {max_new_tokens})")
    if not truncate:
        raise ValueError(f"{head}; shorten {'them' if len(long) > 1 else 'it'}, lower max_new_tokens, or set "
                         "truncate_prompts = true to cut from the left")
    warnings.warn(f"{head}: cut from the left to the last {room} tokens", UserWarning, stacklevel=2)


def _uses_template(tokenizer, use_chat_template: bool) -> bool:
    return bool(use_chat_template and getattr(tokenizer, "chat_template", None))


def _prompt_texts(tokenizer, prompts: Sequence[str], use_chat_template: bool) -> List[str]:
    if _uses_template(tokenizer, use_chat_template):
        return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) for p in prompts]
    return list(prompts)


def encode_prompts(tokenizer, prompts: List[str], *, use_chat_template: bool, max_prompt_length,
                   device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tokenise prompts, left-padded (through the chat template when the tokenizer has one).

    Args:
        tokenizer: a ``transformers`` tokenizer with ``padding_side == "left"``.
        prompts: ``B`` strings.
        use_chat_template: format each prompt as one user turn with the generation prompt.
        max_prompt_length: keep at most this many tokens of each prompt, from the end (next to the
            response); ``None`` = all.
        device: where the tensors go.

    Returns:
        ``(query_ids [B, P] int64, query_mask [B, P] bool)``.

    Raises:
        ValueError: a prompt encodes to zero tokens.
    """
    use_template = _uses_template(tokenizer, use_chat_template)
    texts = _prompt_texts(tokenizer, prompts, use_chat_template)
    kwargs: Dict[str, Any] = {}
    if max_prompt_length is not None:
        kwargs.update(truncation=True, max_length=max_prompt_length)
    old_side = getattr(tokenizer, "truncation_side", "right")
    tokenizer.truncation_side = "left"
    try:
        # The chat template already holds the special tokens it wants.
        enc = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=not use_template, **kwargs)
    finally:
        tokenizer.truncation_side = old_side
    ids = enc["input_ids"].to(device)
    mask = enc["attention_mask"].to(device).bool()
    if not bool(mask.any(dim=1).all()):
        raise ValueError("prompts: a prompt encoded to zero tokens")
    return ids, mask


def response_mask_from_eos(
    response_ids: torch.Tensor, eos_token_id: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask of each response up to and including its first EOS.

    Built from the position of the first EOS, never from ``token != pad``: the pad token may equal
    EOS (it does for SmolLM2) and the real EOS must stay in. A response that is only EOS has one
    valid position; a response without EOS (cut by the length limit) is valid everywhere.

    Args:
        response_ids: ``[B, T]`` int64, right-padded generated tokens, ``T >= 1``.
        eos_token_id: the EOS id.

    Returns:
        ``(response_mask [B, T] bool, lengths [B] int64, has_eos [B] bool)``; every length >= 1.

    Raises:
        ValueError: ``response_ids`` not 2-D or with ``T == 0``.
    """
    if response_ids.dim() != 2 or response_ids.shape[1] == 0:
        raise ValueError(f"response_ids must be [B, T] with T >= 1, got shape {tuple(response_ids.shape)}")
    T = response_ids.shape[1]
    is_eos = response_ids == eos_token_id
    has_eos = is_eos.any(dim=1)
    first = is_eos.to(torch.uint8).argmax(dim=1)  # argmax returns the first maximal index
    lengths = torch.where(has_eos, first + 1, torch.full_like(first, T))
    mask = torch.arange(T, device=response_ids.device).unsqueeze(0) < lengths.unsqueeze(1)
    return mask, lengths, has_eos
