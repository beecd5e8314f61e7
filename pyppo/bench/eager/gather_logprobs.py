"""Eager log-probs of chosen tokens (and entropy), as TRL / OpenRLHF write them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def logsoftmax_gather(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits, -1).gather(-1, labels[..., None])`` (OpenRLHF's
    ``log_probs_from_logits``, TRL's older ``logprobs_from_logits``).

    Materialises a full ``[*, V]`` log-softmax (in the logits' dtype) before gathering. Autograd
    through it gives the eager backward (``[*, V]`` gather-backward scatter plus the softmax
    backward).
    """
    logp = F.log_softmax(logits, dim=-1)
    return logp.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's ``selective_log_softmax`` (``trl/trainer/utils.py``), the memory-saving path.

    float32/float64: gather the chosen logits, then a Python loop over the batch rows computing
    ``torch.logsumexp`` one ``[T, V]`` row at a time ("loop to reduce peak mem consumption").
    bfloat16/float16: ``logsumexp`` is deemed unstable, so a loop over rows of
    ``log_softmax(row).gather(...)``.
    """
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        return selected - lse
    out = []
    for row_logits, row_labels in zip(logits, index):
        row_logps = F.log_softmax(row_logits, dim=-1)
        out.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs by ``log_softmax(...).gather(...)`` and entropy ``-(softmax * log_softmax).sum(-1)``.

    The entropy formula of TRL's PPO trainer / OpenRLHF's ``entropy_from_logits`` in its plain
    form: two more ``[*, V]`` temporaries (``softmax`` and the product) on top of the log-softmax.
    """
    logp = F.log_softmax(logits, dim=-1)
    lp = logp.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(F.softmax(logits, dim=-1) * logp).sum(-1)
    return lp, entropy
