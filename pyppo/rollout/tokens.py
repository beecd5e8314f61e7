"""Prompts to token ids and sampled tokens to a response mask: what every rollout engine shares.

A prompt is a string (one user turn through the chat template, or the text itself without one)
or a list of chat messages (the conversation through the chat template: :mod:`pyppo.data.messages`).

Shapes: ``B`` prompts, ``P`` prompt tokens (left-padded), ``T`` response tokens (right-padded).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..data.messages import check_renderable, is_messages, render_messages
from .engine import Rollout

__all__ = [
    "PromptEncoder",
    "check_prompt_lengths",
    "cut_rollout",
    "encode_prompts",
    "left_pad",
    "prompt_token_limit",
    "response_mask_from_eos",
]


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
            raise ValueError(
                f"max_new_tokens ({max_new_tokens}) leaves no room for a prompt in the model's "
                f"context of {context} positions"
            )
    limits = [n for n in (max_prompt_length, room) if n is not None]
    return (min(limits) if limits else None), room


def check_prompt_lengths(
    tokenizer,
    prompts: Sequence[Any],
    *,
    use_chat_template: bool,
    room: Optional[int],
    max_new_tokens: int,
    max_prompt_length: Optional[int],
    truncate: bool,
    what: str = "prompts",
) -> None:
    """Say which prompts the model's context cannot hold (more tokens than ``room``, what
    :func:`prompt_token_limit` returns): a warning that they are cut from the left (``truncate``),
    else an error. Prompts that only ``max_prompt_length`` (asked for) cuts are not reported.
    Indices are positions in ``prompts`` (strings or message lists).

    Raises:
        ValueError: a message prompt without a chat template to render it
            (:func:`pyppo.data.messages.check_renderable`); with ``truncate`` false, a prompt
            longer than ``room`` (naming it).
    """
    check_renderable(prompts, uses_template=_uses_template(tokenizer, use_chat_template), what=what)
    if not prompts or room is None or (max_prompt_length is not None and max_prompt_length <= room):
        return
    texts = _prompt_texts(tokenizer, prompts, use_chat_template)
    encoded = tokenizer(texts, add_special_tokens=not _uses_template(tokenizer, use_chat_template))
    long = [(i, len(ids)) for i, ids in enumerate(encoded["input_ids"]) if len(ids) > room]
    if not long:
        return
    listed = ", ".join(f"{i} ({n} tokens)" for i, n in long[:5]) + (
        f" and {len(long) - 5} more" if len(long) > 5 else ""
    )
    head = (
        f"{what}: prompt{'s' if len(long) > 1 else ''} {listed} longer than the {room} tokens the model's "
        f"context leaves ({room + max_new_tokens} positions minus max_new_tokens = {max_new_tokens})"
    )
    if not truncate:
        raise ValueError(
            f"{head}; shorten {'them' if len(long) > 1 else 'it'}, lower max_new_tokens, or set "
            "truncate_prompts = true to cut from the left"
        )
    warnings.warn(f"{head}: cut from the left to the last {room} tokens", UserWarning, stacklevel=2)


def _uses_template(tokenizer, use_chat_template: bool) -> bool:
    return bool(use_chat_template and getattr(tokenizer, "chat_template", None))


def _prompt_texts(tokenizer, prompts: Sequence[Any], use_chat_template: bool) -> List[str]:
    """Each prompt's text: through the chat template (a string as one user turn, a message list
    as it is), or without one the string itself (a message list is then refused)."""
    if _uses_template(tokenizer, use_chat_template):
        return [render_messages(tokenizer, p if is_messages(p) else [{"role": "user", "content": p}]) for p in prompts]
    check_renderable(prompts, uses_template=False)
    return list(prompts)


def encode_prompts(
    tokenizer, prompts: List[Any], *, use_chat_template: bool, max_prompt_length, device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tokenise prompts, left-padded (through the chat template when the tokenizer has one).

    Args:
        tokenizer: a ``transformers`` tokenizer with ``padding_side == "left"``.
        prompts: ``B`` prompts: strings, or lists of chat messages.
        use_chat_template: render each prompt with the chat template and the generation prompt:
            a string as one user turn, a message list as the conversation it is (TRL's
            ``apply_chat_template(messages, add_generation_prompt=True)``).
        max_prompt_length: keep at most this many tokens of each prompt, from the end (next to the
            response); ``None`` = all.
        device: where the tensors go.

    Returns:
        ``(query_ids [B, P] int64, query_mask [B, P] bool)``.

    Raises:
        ValueError: a prompt encodes to zero tokens; a message prompt without a chat template.
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


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, L] int64, mask [B, L] bool)``: token-id sequences left-padded with
    ``pad_token_id`` to the longest, ``mask`` 1 at their tokens.

    Raises:
        ValueError: no sequence, or an empty one (naming its index).
    """
    rows = [list(map(int, s)) for s in sequences]
    if not rows:
        raise ValueError("sequences: expected at least one token-id sequence")
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"sequences[{i}] is empty: a sequence to continue needs at least one token")
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, L - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, L - len(row) :] = True
    return ids.to(device), mask.to(device)


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


@dataclass(frozen=True)
class PromptEncoder:
    """:func:`encode_prompts` with an engine's settings: ``encoder(prompts, device)``."""

    tokenizer: Any
    use_chat_template: bool
    max_prompt_length: Optional[int]

    def __call__(self, prompts: Sequence[Any], device) -> Tuple[torch.Tensor, torch.Tensor]:
        return encode_prompts(
            self.tokenizer,
            prompts,
            use_chat_template=self.use_chat_template,
            max_prompt_length=self.max_prompt_length,
            device=device,
        )


def cut_rollout(
    tokenizer: Any,
    prompts: List[str],
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    response_ids: torch.Tensor,
    *,
    eos_token_id: int,
    pad_token_id: int,
    rollout_logprobs: Optional[torch.Tensor] = None,
    device=None,
) -> Rollout:
    """What every engine returns from its sampled tokens: each response cut after its first EOS
    (:func:`response_mask_from_eos`), the pad token after it (and log-prob 0), decoded with the
    special tokens skipped, as a :class:`~pyppo.rollout.Rollout` on ``device`` (``None``: where
    the tensors are).

    Args:
        response_ids: ``[B, T]`` int64, the sampled tokens, right-padded with anything.
        rollout_logprobs: ``[B, T]`` float32, the sampler's log-probs of them, or ``None``.
    """
    response_mask, lengths, has_eos = response_mask_from_eos(response_ids, eos_token_id)
    response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, pad_token_id))
    rows = [row[:n].tolist() for row, n in zip(response_ids.cpu(), lengths.tolist())]
    responses = tokenizer.batch_decode(rows, skip_special_tokens=True)
    if rollout_logprobs is not None:
        rollout_logprobs = torch.where(response_mask, rollout_logprobs, torch.zeros(())).to(device)
    tensors = dict(
        query_ids=query_ids,
        query_mask=query_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        has_eos=has_eos,
    )
    tensors = {name: t.to(device) for name, t in tensors.items()} if device is not None else tensors
    return Rollout(**tensors, prompts=prompts, responses=responses, rollout_logprobs=rollout_logprobs)
