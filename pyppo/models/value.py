"""The value model and the reference: a causal LM's backbone with a scalar head, a frozen copy of
the policy, and the weights a reward model can share with that copy.

Shapes: ``B`` batch, ``L`` sequence length (prompt + response, left-padded), ``H`` hidden size.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["ValueModel", "make_reference", "position_ids_from_mask", "share_frozen_weights"]


def _backbone_of(causal_lm: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (without its LM head), e.g. ``LlamaModel``."""
    backbone = getattr(causal_lm, "base_model", None)
    if backbone is None or backbone is causal_lm:
        get_decoder = getattr(causal_lm, "get_decoder", None)
        backbone = get_decoder() if callable(get_decoder) else None
    if backbone is None or backbone is causal_lm:
        raise TypeError(
            f"causal_lm: cannot find the backbone of {type(causal_lm).__name__} "
            "(expected a transformers causal LM with .base_model or .get_decoder())"
        )
    return backbone


def _hidden_size(config) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("hidden_size", "n_embd", "d_model"):
        size = getattr(text_config, attr, None)
        if isinstance(size, int):
            return size
    raise TypeError(f"cannot read the hidden size from {type(config).__name__}")


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at each row's first real token, counting up.

    ``attention_mask [B, L]`` (0/1 or bool) -> ``position_ids [B, L]`` int64; padding positions get
    0 (they are masked out of attention anyway). This is what ``generate()`` uses, so values scored
    here line up with the policy's positions.
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).clamp_min(0)


class ValueModel(nn.Module):
    """Critic: a transformer backbone with a scalar head, one value per token.

    It is a separate network from the policy (a deep copy of the policy's backbone by default), so
    value-loss gradients never touch the policy's weights.

    Args:
        backbone: a ``transformers`` base model whose output has ``last_hidden_state [B, L, H]``.
        hidden_size: ``H``.
        head_std: std of the head's normal init; the bias starts at 0. Small, so that initial values
            are close to 0 and the first advantages are dominated by the rewards, not by noise.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, *, head_std: float = 1e-3):
        super().__init__()
        self.backbone = backbone
        self.config = getattr(backbone, "config", None)
        self.head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.head.weight, std=head_std)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_causal_lm(cls, causal_lm: nn.Module, *, head_std: float = 1e-3) -> "ValueModel":
        """A value model whose backbone is a deep copy of ``causal_lm``'s (the LM head is dropped).

        The copy is in train mode with gradients on, whatever the state of ``causal_lm``; the head
        is created on the backbone's device and in float32.
        """
        backbone = copy.deepcopy(_backbone_of(causal_lm))
        backbone.requires_grad_(True)
        backbone.train()
        model = cls(backbone, _hidden_size(causal_lm.config), head_std=head_std)
        device = next(backbone.parameters()).device
        model.head.to(device)
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values of every position.

        Args:
            input_ids: ``[B, L]`` int64.
            attention_mask: ``[B, L]`` 0/1, 0 at (left) padding; ``None`` means all ones.
            position_ids: ``[B, L]`` int64; by default derived from ``attention_mask`` with
                :func:`position_ids_from_mask` so that left padding does not shift positions.

        Returns:
            ``values [B, L]`` float32; ``values[:, t]`` is the value of the state after token ``t``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_from_mask(attention_mask)
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # The head runs in its own dtype (float32 unless the whole module was cast), so a bf16
        # backbone still yields float32 values.
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


def share_frozen_weights(source: nn.Module, target: nn.Module) -> int:
    """Make ``target``'s parameters use ``source``'s tensors wherever both are frozen and equal.

    A reward model that is a score head on the reference's checkpoint (or was fine-tuned from it
    in part) holds the reference's weights, or some of them, a second time. Both models are
    frozen for the whole run, so one copy serves both, and every output stays bit for bit what it
    was. A parameter is shared when it has the same name in both models (``model.layers.0
    .mlp.up_proj.weight``), the same shape, dtype and device, is a plain tensor (not a DTensor or a
    quantised weight), has ``requires_grad=False`` on both sides, and holds the same values
    (``torch.equal``).

    Args:
        source: the model whose tensors are kept (the frozen reference).
        target: the model whose equal parameters are pointed at ``source``'s (the reward model).

    Returns:
        the bytes no longer held twice (0 when nothing matched).
    """
    if source is target:
        return 0
    kept = dict(source.named_parameters())
    saved = 0
    with torch.no_grad():
        for name, param in target.named_parameters():
            other = kept.get(name)
            if (
                other is None
                or param.requires_grad
                or other.requires_grad
                or type(param.data) is not torch.Tensor
                or type(other.data) is not torch.Tensor
                or param.shape != other.shape
                or param.dtype != other.dtype
                or param.device != other.device
                or param.data_ptr() == other.data_ptr()
                or not torch.equal(param, other)
            ):
                continue
            param.data = other.data
            saved += param.numel() * param.element_size()
    return saved


def make_reference(policy: nn.Module) -> nn.Module:
    """Frozen copy of ``policy``: a deep copy in eval mode with ``requires_grad=False`` everywhere.

    It anchors the KL penalty, so it must not move when the policy is updated.
    """
    ref = copy.deepcopy(policy)
    ref.requires_grad_(False)
    ref.eval()
    return ref
