"""What ``pyppo bench --peer`` times: each peer function, called the way the peer's trainer calls
it, at the peer's typical shapes, next to the pyppo adapter of the same name and signature
(:mod:`pyppo.integrations`).

Shapes (``full``): the ``[B, T]`` functions (GAE, KL, rewards, whitening, masked means, losses) on
``[256, 2048]`` float32 rollouts whose masks have right padding and observation-token holes
(:func:`~pyppo.bench.inputs.response_mask`); log-probs and entropy on ``[8, 1024, 151936]``
bfloat16 logits (a Qwen vocabulary), or fewer rows when the peers' own temporaries would not fit
in the memory available (:func:`logits_shape`). ``quick``: ``[64, 1024]`` and ``[1, 512, 151936]``;
``tiny``: ``[4, 32]`` and ``[2, 8, 1000]``. Group advantages (rlox) on float64 scores of
``n_prompts x group_size`` responses: ``512x8``, ``4096x8`` and ``64x64`` (``full`` and ``quick``),
``4x8`` and ``2x16`` (``tiny``).

Masks are int64, as both veRL (``attention_mask`` slices) and OpenRLHF (``action_mask``) hold them.
rlox takes and returns numpy arrays: its rows' calls convert the tensors with ``Tensor.numpy()``
(no copy) inside the timed call, for rlox and the adapter alike, and run on the CPU only.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pyppo.integrations._flash_attn_stub import flash_attn_is_stub, install_flash_attn_stub

from .case import Inputs, RowLabels
from .inputs import bt_inputs, nbytes

__all__ = [
    "PeerCase",
    "PEERS",
    "PINS",
    "CPU_ONLY",
    "SHAPES",
    "cases",
    "functions",
    "logits_shape",
    "input_sets",
    "clear_inputs",
    "peer_available",
    "import_peer",
    "install_flash_attn_stub",
    "flash_attn_state",
]

PEERS = ("verl", "openrlhf", "trl", "rlox")

#: The releases the adapters reproduce, and how to install each without its GPU-only dependencies.
PINS = {
    "verl": ("verl", "0.9.1", "pip install --no-deps verl==0.9.1"),
    "openrlhf": ("openrlhf", "0.11.2", "pip install --no-deps openrlhf==0.11.2 deepspeed==0.19.6"),
    "trl": ("trl", "1.16.0", "pip install --no-deps trl==1.16.0"),
    "rlox": ("rlox", "1.2.0", "pip install rlox==1.2.0"),
}

#: Peers whose functions take numpy arrays: their rows run on the CPU only.
CPU_ONLY = frozenset({"rlox"})

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
QWEN_VOCAB = 151936
# GRPO batches: 512 prompts x 8 responses (the trainer's default), 4096 x 8, 64 x 64.
_GROUPS = ((512, 8), (4096, 8), (64, 64))
SHAPES = {  # sizes -> (rollout [B, T], logits [B, T, V], group advantages [(n_prompts, group_size), ...])
    "full": ((256, 2048), (8, 1024, QWEN_VOCAB), _GROUPS),
    "quick": ((64, 1024), (1, 512, QWEN_VOCAB), _GROUPS),
    "tiny": ((4, 32), (2, 8, 1000), ((4, 8), (2, 16))),
}
# The inputs' dtype of each kind of row (a row may name another).
_KIND_DTYPE = {"rollout": F32, "logits": BF16, "group": F64}
# rlox's environment-style episodes: an episode ends after each step with this probability.
_EPISODE_END = 1 / 128

# Peak bytes the hungriest peer call needs beyond its logits, per byte of logits: veRL's
# entropy_from_logits forward+backward (softmax, softmax * logits and their gradients, the logits'
# gradient) was measured at ~6x on [1, 1024, 151936] bf16; 1.5 more for the inputs and the
# outputs held for the check.
_LOGITS_PEAK_FACTOR = 7.5
_PROCESS_BYTES = 2 * 2**30  # the peers' imports, the rollout inputs, the allocator's slack


@dataclass(frozen=True)
class PeerCase(RowLabels):
    """One row: ``call(fn, inputs)`` runs the peer function or its adapter ``fn``; in ``fwd+bwd``
    mode the outputs that require grad are back-propagated too, and the gradients of ``wrt``
    are part of what the check compares."""

    peer: str
    module: str  # the peer's defining module
    name: str  # the function's name there (and the adapter's)
    mode: str  # "fwd" | "fwd+bwd"
    kind: str  # "rollout" | "logits" | "group": which inputs
    shape: tuple[int, ...]
    dtype: torch.dtype
    call: Callable[[Callable, Inputs], Any]
    args: str  # the arguments beyond the tensors, as the table prints them
    reads: tuple[str, ...]  # the inputs it reads: what "extra memory %" is relative to
    wrt: tuple[str, ...] = ()
    # Back-propagate only the first output (a loss), as the trainer does: the losses' metrics
    # (veRL's ppo_kl) may carry a graph in the peer and none in the adapter.
    loss_first: bool = False

    @property
    def tol(self) -> float:
        """Allowed max |pyppo - peer| / max(1, max |peer|). In bf16 the peers round every
        intermediate (log_softmax, softmax * logits) to bf16: against float64 their entropies
        were measured up to 3 ulps off (0.17 at ~10) where the adapters are within half an ulp,
        so the bound is ~5 ulps of the output's magnitude (an ulp is 2^-8..2^-7 of it)."""
        return 4e-2 if self.dtype == BF16 else 1e-4


# --------------------------------------------------------------------------- inputs


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _rollout(shape, dtype, device, seed) -> Inputs:
    inp = bt_inputs(shape, dtype, device, seed)
    g = _gen(seed + 7919)
    B, T = shape
    lp, values = inp["logprobs"].cpu(), inp["values"].cpu()
    more = {
        "old_logprobs": lp + 0.05 * torch.randn(B, T, generator=g),
        "advantages": torch.randn(B, T, generator=g),
        "returns": values + 0.5 * torch.randn(B, T, generator=g),
        "vpreds": values + 0.3 * torch.randn(B, T, generator=g),
        "kl": lp - inp["ref_logprobs"].cpu(),
        "grad": torch.randn(B, T, generator=g),
    }
    inp.update({k: v.to(dtype).to(device) for k, v in more.items()})
    inp["mask"] = inp["mask"].long()
    # rlox's GAE inputs, from a generator of their own so that the draws above stay as they were:
    # dones at each row's last step (one episode per row, as an LM rollout has it), dones of
    # environment-style episodes, and each row's value after its last step.
    g = _gen(seed + 104729)
    ends = torch.zeros(B, T)
    ends[:, -1] = 1.0
    episodes = (torch.rand(B, T, generator=g) < _EPISODE_END).float()
    last_values = torch.randn(B, generator=g)
    inp.update(
        {k: v.to(dtype).to(device) for k, v in (("dones", ends), ("env_dones", episodes), ("last_values", last_values))}
    )
    return inp


def _group(shape, dtype, device, seed) -> Inputs:
    """GRPO scores of ``n_prompts x group_size`` responses, flat; every eighth group's equal."""
    g = _gen(seed)
    P, n = shape
    scores = torch.randn(P, n, generator=g, dtype=torch.float64)
    scores[::8] = scores[::8, :1]
    return {"scores": scores.reshape(-1).to(dtype).to(device), "group_size": n}


def _logits(shape, dtype, device, seed) -> Inputs:
    g = _gen(seed)
    *lead, V = shape
    logits = torch.empty(shape, dtype=dtype)
    # Row blocks, so that drawing 1.2G bf16 logits does not need a float32 copy of them all.
    for rows in logits.view(-1, V).split(max(1, 2**24 // V)):
        rows.copy_(torch.randn(rows.shape, generator=g) * 2.0)
    return {
        "logits": logits.to(device),
        "labels": torch.randint(0, V, tuple(lead), generator=g).to(device),
        "grad": torch.randn(tuple(lead), generator=g).to(device),
    }


_MAKERS = {"rollout": _rollout, "logits": _logits, "group": _group}
_CACHE: dict[tuple, Inputs] = {}


def clear_inputs() -> None:
    _CACHE.clear()


def _base(kind: str, shape, dtype, device, seed) -> Inputs:
    key = (kind, tuple(shape), dtype, str(device), seed)
    if key not in _CACHE:
        if kind == "logits":  # one logits tensor at a time: at full size each is gigabytes
            for k in [k for k in _CACHE if k[0] == "logits"]:
                del _CACHE[k]
        _CACHE[key] = _MAKERS[kind](shape, dtype, device, seed)
    return _CACHE[key]


def input_sets(case: PeerCase, device: torch.device, seed: int, cache_bytes: int, max_sets: int = 64) -> list[Inputs]:
    """The case's input sets, enough to span twice ``cache_bytes`` (see :mod:`pyppo.bench.timing`).
    The tensors in ``case.wrt`` are fresh leaves that require grad, sharing the cached storage,
    so cases of one peer (and of the next) reuse one draw of the inputs."""
    first = _base(case.kind, case.shape, case.dtype, device, seed)
    per_set = max(1, nbytes(*case.reads)(first))
    wanted = min(max_sets, max(1, -(-2 * cache_bytes // per_set)))
    sets = []
    for i in range(wanted):
        inp = dict(_base(case.kind, case.shape, case.dtype, device, seed + i))
        for name in case.wrt:
            inp[name] = inp[name].detach().requires_grad_(True)
        sets.append(inp)
    return sets


def logits_shape(sizes: str, device: torch.device) -> tuple[tuple[int, ...], str]:
    """The logits shape for ``sizes``, and why it is not the peers' typical one ('' if it is):
    at ``full``, B halves from 8 until the peers' peak fits in the memory available."""
    B, T, V = SHAPES[sizes][1]
    if sizes != "full":
        return (B, T, V), ""
    available = _available_bytes(device)
    if available is None:
        return (B, T, V), ""
    need = lambda b: _LOGITS_PEAK_FACTOR * b * T * V * 2 + _PROCESS_BYTES  # noqa: E731
    b = B
    while b > 1 and need(b) > available:
        b //= 2
    if b == B:
        return (B, T, V), ""
    return (b, T, V), (
        f"B={b}, not {B}: the peers' peak at B={B} would be ~{need(B) / 2**30:.0f} GiB, "
        f"{available / 2**30:.0f} GiB available"
    )


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------- flash-attn


def flash_attn_state() -> str:
    """What OpenRLHF's log-prob path ran on, as the table and JSON say it."""
    if sys.modules.get("flash_attn") is None or flash_attn_is_stub():
        return "flash-attn not installed: OpenRLHF's torch fallback path was timed (what a CPU user of OpenRLHF runs)"
    return "flash-attn installed: OpenRLHF's flash-attn path was timed where it takes one"


# --------------------------------------------------------------------------- the calls


def _actor_config():
    """veRL's ActorConfig as a PPO actor has it (clip ratio 0.2, dual-clip c = 3)."""
    from verl.workers.config.actor import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=4, clip_ratio=0.2)


def _logprobs_row(module: str, name: str, note: str = "") -> tuple:
    """A ``(logits, labels) -> log-probs`` row (each peer has one, under its own name)."""
    return (module, name, "logits", lambda f, i: f(i["logits"], i["labels"]), note, ("logits", "labels"), ("logits",))


def _entropy_row(module: str, name: str, note: str = "") -> tuple:
    """A ``logits -> entropy`` row."""
    return (module, name, "logits", lambda f, i: f(i["logits"]), note, ("logits",), ("logits",))


def _verl() -> list[tuple]:
    core, tf = "verl.trainer.ppo.core_algos", "verl.utils.torch_functional"
    config: list = []
    policy_inputs = ("old_logprobs", "logprobs", "advantages", "mask")  # both policy losses' tensors

    def vanilla(f, i):
        if not config:
            config.append(_actor_config())
        return f(
            i["old_logprobs"], i["logprobs"], i["advantages"], i["mask"], loss_agg_mode="token-mean", config=config[0]
        )

    return [
        (
            core,
            "compute_gae_advantage_return",
            "rollout",
            lambda f, i: f(i["rewards"], i["values"], i["mask"], gamma=0.99, lam=0.95),
            "gamma=0.99, lam=0.95",
            ("rewards", "values", "mask"),
            (),
        ),
        (
            core,
            "kl_penalty",
            "rollout",
            lambda f, i: f(i["logprobs"], i["ref_logprobs"], kl_penalty="low_var_kl"),
            "kl_penalty='low_var_kl'",
            ("logprobs", "ref_logprobs"),
            ("logprobs",),
        ),
        (
            core,
            "agg_loss",
            "rollout",
            lambda f, i: f(loss_mat=i["x"], loss_mask=i["mask"], loss_agg_mode="token-mean"),
            "loss_agg_mode='token-mean'",
            ("x", "mask"),
            (),
        ),
        (
            core,
            "compute_policy_loss",
            "rollout",
            lambda f, i: f(i["old_logprobs"], i["logprobs"], i["advantages"], i["mask"], cliprange=0.2),
            "cliprange=0.2 (deprecated API)",
            policy_inputs,
            ("logprobs",),
        ),
        (
            core,
            "compute_policy_loss_vanilla",
            "rollout",
            vanilla,
            "ActorConfig(clip_ratio=0.2)",
            policy_inputs,
            ("logprobs",),
        ),
        (
            core,
            "compute_value_loss",
            "rollout",
            lambda f, i: f(i["vpreds"], i["returns"], i["values"], i["mask"], cliprange_value=0.5),
            "cliprange_value=0.5",
            ("vpreds", "returns", "values", "mask"),
            ("vpreds",),
        ),
        (tf, "masked_whiten", "rollout", lambda f, i: f(i["x"], i["mask"]), "", ("x", "mask"), ()),
        (tf, "masked_mean", "rollout", lambda f, i: f(i["x"], i["mask"]), "", ("x", "mask"), ()),
        _logprobs_row(tf, "logprobs_from_logits"),
        _entropy_row(tf, "entropy_from_logits"),
    ]


def _openrlhf() -> list[tuple]:
    m = "openrlhf.models.utils"
    return [
        (
            m,
            "compute_approx_kl",
            "rollout",
            lambda f, i: f(i["logprobs"], i["ref_logprobs"], kl_estimator="k3"),
            "kl_estimator='k3'",
            ("logprobs", "ref_logprobs"),
            ("logprobs",),
        ),
        (
            m,
            "compute_reward",
            "rollout",
            lambda f, i: f(i["scores"], 0.01, i["kl"], action_mask=i["mask"]),
            "kl_coef=0.01",
            ("scores", "kl", "mask"),
            (),
        ),
        (m, "masked_mean", "rollout", lambda f, i: f(i["x"], i["mask"], dim=-1), "dim=-1", ("x", "mask"), ()),
        _logprobs_row(m, "log_probs_from_logits"),
        _entropy_row(m, "compute_entropy", "(torch.compile'd by OpenRLHF)"),
    ]


def _trl() -> list[tuple]:
    m = "trl.trainer.utils"
    return [
        _logprobs_row(m, "selective_log_softmax"),
        _entropy_row(m, "entropy_from_logits"),
        _logprobs_row(m, "selective_log_softmax_and_entropy"),
    ]


def _flat(t: torch.Tensor):
    """A tensor as the flat numpy array rlox takes (a view: nothing is copied)."""
    return t.numpy().reshape(-1)


def _rlox_gae(dones: str):
    """``compute_gae_batched*`` on the rollout's rows as rlox's environments (env-major, as a
    ``[B, T]`` tensor is laid out), with the episode ends ``inputs[dones]``."""

    def call(f, i):
        T = i["rewards"].shape[1]
        return f(_flat(i["rewards"]), _flat(i["values"]), _flat(i[dones]), _flat(i["last_values"]), T, 0.99, 0.95)

    return call


def _rlox() -> list[tuple]:
    m = "rlox._rlox_core"
    gae_reads = ("rewards", "values", "last_values")
    kl_reads = ("logprobs", "ref_logprobs")
    kl = lambda f, i: f(_flat(i["logprobs"]), _flat(i["ref_logprobs"]), i["logprobs"].shape[1])  # noqa: E731
    return [
        (
            m,
            "compute_batch_group_advantages",
            "group",
            lambda f, i: f(_flat(i["scores"]), i["group_size"]),
            "",
            ("scores",),
            (),
        ),
        (
            m,
            "compute_gae_batched_f32",
            "rollout",
            _rlox_gae("dones"),
            "gamma=0.99, lam=0.95, one episode per row",
            gae_reads + ("dones",),
            (),
        ),
        (
            m,
            "compute_gae_batched_f32",
            "rollout",
            _rlox_gae("env_dones"),
            f"gamma=0.99, lam=0.95, episodes end w.p. 1/{round(1 / _EPISODE_END)} a step",
            gae_reads + ("env_dones",),
            (),
        ),
        (
            m,
            "compute_gae_batched",
            "rollout",
            _rlox_gae("dones"),
            "gamma=0.99, lam=0.95, one episode per row",
            gae_reads + ("dones",),
            (),
            F64,
        ),
        (m, "compute_batch_token_kl_schulman_f32", "rollout", kl, "", kl_reads, ()),
        (m, "compute_batch_token_kl_f32", "rollout", kl, "", kl_reads, ()),
    ]


_SPECS = {"verl": _verl, "openrlhf": _openrlhf, "trl": _trl, "rlox": _rlox}
_LOSSES = {"compute_policy_loss", "compute_policy_loss_vanilla", "compute_value_loss"}


def cases(
    peer: str, bt_shape: tuple[int, int], logits: tuple[int, int, int], groups: tuple[tuple[int, int], ...] = ()
) -> list[PeerCase]:
    """Every row of ``peer``: each function forward, and forward+backward where it is differentiable
    (where the spec names inputs to take gradients of); a group row once per shape of ``groups``.
    A spec is ``(module, name, kind, call, args, reads, wrt)``, and optionally the inputs' dtype
    (else the kind's)."""
    out = []
    for module, name, kind, call, args, reads, wrt, *dtype in _SPECS[peer]():
        dtype = dtype[0] if dtype else _KIND_DTYPE[kind]
        shapes = {"rollout": [bt_shape], "logits": [logits], "group": list(groups)}[kind]
        for shape in shapes:
            for mode in ("fwd", "fwd+bwd") if wrt else ("fwd",):
                out.append(
                    PeerCase(
                        peer,
                        module,
                        name,
                        mode,
                        kind,
                        tuple(shape),
                        dtype,
                        call,
                        args,
                        reads,
                        wrt if mode == "fwd+bwd" else (),
                        loss_first=name in _LOSSES,
                    )
                )
    return out


def functions(peer: str) -> list[str]:
    """The peer functions ``peer``'s rows cover, in table order."""
    return list(dict.fromkeys(spec[1] for spec in _SPECS[peer]()))


def peer_available(peer: str) -> str | None:
    """None when ``peer`` is importable, else the one-line reason and the install command."""
    dist, version, pip = PINS[peer]
    if importlib.util.find_spec(dist) is None:
        return f"{dist} is not installed; install the release the adapters reproduce with `{pip}`"
    return None


def import_peer(peer: str) -> None:
    """Import the peer's defining modules (OpenRLHF's behind the flash-attn stub); a failure is
    an ImportError naming the module and the install command."""
    if peer == "openrlhf":
        install_flash_attn_stub()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for module in sorted({c[0] for c in _SPECS[peer]()}):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(
                f"--peer {peer}: cannot import {module} ({exc}); `{PINS[peer][2]}` installs "
                f"the release the adapters reproduce"
            ) from None
