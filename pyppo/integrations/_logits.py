"""What the adapters share around ``torch.ops.pyppo.gather_logprobs``: the raw op call with the
peers' conventions (no ignored label value, errors in the adapter's own words), and the checks of
its peers' arguments."""

from __future__ import annotations

import math
import operator
import re

import torch

import pyppo  # noqa: F401  (registers torch.ops.pyppo)

# The peers index logits[label] for every label, so a label of -100 is an out-of-range index
# there, not a "skip this position" marker. pyppo has no "no ignore_index" setting; int64's
# minimum is the one value no real label (nor any int32 label) can hold.
NO_IGNORE_INDEX = -(2**63)

_LABEL_RANGE = re.compile(r"labels\[(\d+)\] = (-?\d+) is outside \[0, V=(\d+)\) at an unmasked position")


def check_temperature(fn: str, temperature) -> float:
    """``float(temperature)``, or ValueError("temperature must be positive") naming ``fn``."""
    t = float(temperature)
    if not (t > 0):
        raise ValueError(f"{fn}: temperature must be positive, got {temperature}")
    if not math.isfinite(t):
        raise ValueError(f"{fn}: temperature must be finite, got {temperature}")
    return t


def positive_index(n) -> bool:
    """``n`` is an integer > 0 as the peers' slicing and ``split`` take it (int, numpy integer,
    0-d integer tensor; not bool): their ``chunk_size``."""
    if isinstance(n, bool):
        return False
    try:
        return operator.index(n) > 0
    except TypeError:
        return False


def gather_raw(
    fn: str,
    label_name: str,
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    temperature: float,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.pyppo.gather_logprobs`` (autograd included) → (logprobs, entropy, lse), every
    label read. The op's ValueErrors come back prefixed with ``fn`` and with its ``labels``
    renamed to the peer's argument name."""
    try:
        return torch.ops.pyppo.gather_logprobs.default(
            logits, labels, mask, temperature, NO_IGNORE_INDEX, return_entropy
        )
    except ValueError as e:
        msg = str(e)
        m = _LABEL_RANGE.search(msg)
        if m is not None:
            i, v, V = m.groups()
            msg = f"{label_name} = {v} at flattened position {i} is outside [0, V={V}) (V = logits.shape[-1])"
        else:
            msg = msg.replace("pyppo.gather_logprobs: ", "").replace("labels", label_name)
        raise ValueError(f"{fn}: {msg}") from None


def zero_labels(logits: torch.Tensor) -> torch.Tensor:
    """A valid label per row, for calls that only want the entropy or the logsumexp."""
    return torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
