"""The ``transformers.generate`` rollout engine: sampling with exactly the configured distribution.

The log-probs PPO computes must be those of the distribution ``generate()`` really samples from.
``transformers`` fills every generation field the caller leaves unset from the model's own
``generation_config`` (a checkpoint's ``generation_config.json`` often carries ``top_k``,
``top_p``, ``repetition_penalty``...), so :func:`generate` pins every sampling filter to its
neutral value and hides the model's own config for the duration of the call. See
``docs/trainer.md`` (rollout).
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from ..precision import autocast
from .categorical import fast_multinomial
from .decode_attention import decode_attention_cache, float32_decode_attention
from .engine import Continuation, Rollout, RolloutEngine
from .tokens import PromptEncoder, cut_rollout, left_pad, response_mask_from_eos

__all__ = ["NEUTRAL_SAMPLING", "HFGenerateEngine", "generation_config", "generate", "packed_linear_weights"]

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
    return (
        isinstance(module, nn.Linear)
        and type(w.data) is torch.Tensor
        and w.device.type == "cpu"
        and w.dtype == torch.float32
    )


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
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and not torch.is_autocast_enabled("cpu")
        and any(_packable(m) for m in model.modules())
    )


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
                    module.forward = _packed_forward(
                        packed, module.weight, None if module.bias is None else module.bias.detach()
                    )
                    patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            del module.forward


@torch.no_grad()
def generate(model: nn.Module, query_ids: torch.Tensor, query_mask: torch.Tensor, gen_config, **kwargs: Any) -> Any:
    """``model.generate`` on left-padded prompts with exactly ``gen_config``; on a CPU in float32,
    with the linear layers' weights pre-packed for the batch (:func:`packed_linear_weights`), and
    on a CPU each token drawn by inverse transform in float64
    (:func:`pyppo.rollout.categorical.fast_multinomial`: the same distribution as
    ``torch.multinomial``'s, another random stream); under a CPU's bf16 autocast the decode steps
    attend in float32 over a float32 KV cache (:mod:`pyppo.rollout.decode_attention`).

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
        stack.enter_context(fast_multinomial())
        cache = decode_attention_cache(model, gen_config, kwargs)
        if cache is not None:
            stack.enter_context(float32_decode_attention())
            kwargs["past_key_values"] = cache
        return model.generate(
            input_ids=query_ids, attention_mask=query_mask.long(), generation_config=gen_config, **kwargs
        )


class HFGenerateEngine(RolloutEngine):
    """The rollout engine that samples with the policy itself, through ``transformers.generate``.

    Args:
        module: the policy's :class:`~pyppo.trainer.logprob_head.LogprobHead`, possibly DDP- or
            FSDP2-wrapped: sampling goes through its ``forward(None, sample=...)``, so that FSDP2
            gathers the weights it owns as it does for the training passes.
        tokenizer: the policy's tokenizer, ``padding_side == "left"``, with a pad token.
        gen_config: from :func:`generation_config`.
        device, dtype: where the prompts go, and the autocast dtype of the forwards.
        max_prompt_tokens: keep at most this many tokens of each prompt (from the end); ``None`` = all.
        use_chat_template: format each prompt with the chat template, a string as one user turn and a
            message list as its conversation (``PPOConfig.use_chat_template``).
        synced_gpus: keep every rank decoding until all are done (FSDP2: each decode step
            all-gathers).

    ``rollout_logprobs`` is ``None``: the trainer's own forwards give the log-probs, and
    ``generate`` samples from exactly that distribution (:data:`NEUTRAL_SAMPLING`). It samples
    with the policy itself, so it has no weights to sync and nothing to close.

    Attributes:
        gen_config: the ``GenerationConfig`` every call samples with.
    """

    def __init__(
        self,
        module: nn.Module,
        tokenizer: Any,
        gen_config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_prompt_tokens: Optional[int],
        use_chat_template: bool,
        synced_gpus: bool = False,
    ):
        self.module, self.tokenizer, self.gen_config = module, tokenizer, gen_config
        self.device, self.dtype = device, dtype
        self.max_prompt_tokens, self.use_chat_template = max_prompt_tokens, use_chat_template
        self.encode = PromptEncoder(tokenizer, use_chat_template, max_prompt_tokens)
        self.extra = {"synced_gpus": True} if synced_gpus else {}

    def generate(self, prompts: Sequence[str]) -> Rollout:
        """Sample one response per prompt and cut it after its first EOS."""
        prompts = list(prompts)
        query_ids, query_mask = self.encode(prompts, self.device)
        self.module.eval()
        with torch.no_grad(), autocast(self.device, self.dtype):  # no_grad: DDP then expects no backward
            sequences = self.module(None, sample=(query_ids, query_mask, self.gen_config, self.extra))
        response_ids = sequences[:, query_ids.shape[1] :]
        eos, pad = int(self.gen_config.eos_token_id), int(self.gen_config.pad_token_id)
        return cut_rollout(
            self.tokenizer, prompts, query_ids, query_mask, response_ids, eos_token_id=eos, pad_token_id=pad
        )

    def sample_continuations(self, sequences: Sequence[Sequence[int]], max_new_tokens: int) -> List[Continuation]:
        """Continue each token-id sequence, left-padded into one batch, by up to
        ``max_new_tokens`` tokens (the run's sampling distribution otherwise), each cut after its
        first EOS; no log-probs (as :meth:`generate`)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        eos, pad = int(self.gen_config.eos_token_id), int(self.gen_config.pad_token_id)
        ids, mask = left_pad(sequences, pad, self.device)
        gen_config = copy.deepcopy(self.gen_config)
        gen_config.max_new_tokens = int(max_new_tokens)
        self.module.eval()
        with torch.no_grad(), autocast(self.device, self.dtype):
            out = self.module(None, sample=(ids, mask, gen_config, self.extra))
        sampled = out[:, ids.shape[1] :]
        _, lengths, _ = response_mask_from_eos(sampled, eos)
        return [(row[:n].tolist(), None) for row, n in zip(sampled.cpu(), lengths.tolist())]
