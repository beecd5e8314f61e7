"""The model forwards of a PPO step: response log-probs (and entropies) and values.

Log-probs come from the last hidden states through :func:`pyppo.ops.linear_logprobs` (the
``[B, T, V]`` logits never exist) when the model's logits are a plain linear map of those hidden
states; otherwise from the full logits through :func:`pyppo.ops.gather_logprobs`. Which one is
decided once per model by :class:`LogprobHead`, with one short forward: some families transform
the logits after the LM head (Gemma 2's soft-capping, Cohere's ``logit_scale``, Granite's
``logits_scaling``...), and only the full logits are what ``generate()`` samples from.

Alignment: the batch is a left-padded prompt of ``P`` positions then ``T`` response positions;
the logit at position ``P - 1 + t`` scores response token ``t``, and the value at that position is
the value of the state before token ``t``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from .buffer import RolloutBuffer
from .ops import gather_logprobs, linear_logprobs

__all__ = ["LogprobHead", "response_values"]

# The head path is kept when it reproduces model(...).logits to float32 rounding (relative to the
# logits' scale); a transform after the head (scale, soft-cap) is far outside this.
_HEAD_RTOL = 1e-5


def _linear_head_candidate(model: nn.Module) -> Optional[Tuple[nn.Module, nn.Linear]]:
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    # Soft-capping can be numerically invisible on a probe with small logits: trust the config.
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        return None
    try:
        backbone, head = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if backbone is None or backbone is model or not isinstance(head, nn.Linear):
        return None
    return backbone, head


@torch.no_grad()
def _head_matches_logits(model: nn.Module, backbone: nn.Module, head: nn.Linear) -> bool:
    device = head.weight.device
    V = head.weight.shape[0]
    ids = (torch.arange(8, device=device) * 7919 % V).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state
        via_head = head(hidden).float()
        logits = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        model.train(was_training)
    if via_head.shape != logits.shape:
        return False
    scale = max(1.0, float(logits.abs().max()))
    return bool((via_head - logits).abs().max() <= _HEAD_RTOL * scale)


class LogprobHead:
    """Response log-probs of one causal LM, from hidden states when that is exact.

    Args:
        model: a ``transformers`` causal LM.
        temperature: ``τ``; log-probs are of ``softmax(logits / τ)``, the sampling distribution.
        from_hidden: try the hidden-state path (``PPOConfig.logprobs_from_hidden``); it is used
            only when one probe forward shows ``head(backbone(x)) == model(x).logits``.

    Attributes:
        uses_hidden: whether the hidden-state path was chosen.
    """

    def __init__(self, model: nn.Module, *, temperature: float, from_hidden: bool = True):
        self.model = model
        self.temperature = temperature
        self._head = _linear_head_candidate(model) if from_hidden else None
        if self._head is not None and not _head_matches_logits(model, *self._head):
            self._head = None
        self.uses_hidden = self._head is not None

    def __call__(self, mb: RolloutBuffer, *, return_entropy: bool = False
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(logprobs [b, T], entropy [b, T] or None)`` float32, 0 at masked positions."""
        T = mb.response_length
        inputs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                      use_cache=False)
        kwargs = dict(temperature=self.temperature, return_entropy=return_entropy)
        if self._head is not None:
            backbone, head = self._head
            hidden = backbone(**inputs).last_hidden_state[:, -(T + 1):-1]
            out = linear_logprobs(hidden, head.weight, mb.response_ids, mb.response_mask, bias=head.bias, **kwargs)
        else:
            # Slicing from the end works whether or not the model honours logits_to_keep.
            logits = self.model(**inputs, logits_to_keep=T + 1).logits[:, -(T + 1):-1]
            out = gather_logprobs(logits, mb.response_ids, mb.response_mask, **kwargs)
        return out if return_entropy else (out, None)


def response_values(value_model: nn.Module, mb: RolloutBuffer) -> torch.Tensor:
    """Values at response positions, ``[b, T]`` float32, 0 where masked.

    ``value_model(input_ids, attention_mask, position_ids) -> [b, P + T]`` (a
    :class:`pyppo.models.ValueModel`).
    """
    P, T = mb.prompt_length, mb.response_length
    v = value_model(mb.input_ids, mb.attention_mask, mb.position_ids)[:, P - 1:P + T - 1].float()
    return torch.where(mb.response_mask, v, torch.zeros((), dtype=v.dtype, device=v.device))
