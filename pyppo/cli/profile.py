"""Profile one PPO step: wall time per phase and the share spent inside pyppo's ops.

Runs :class:`pyppo.trainer.PPOTrainer` for ``--warmup-steps`` steps (default 1, unprofiled: the
first step pays one-time costs such as allocator growth and lazy initialisation), then one step
under :mod:`torch.profiler`, and prints a table with one row per phase — generate, policy
forward, reference forward, value forward, score, advantages, update — giving its wall seconds
(the trainer's own per-phase timer, ``time_<phase>`` in its metrics), its share of the step, and
the seconds and share of it spent inside pyppo ops (profiler events whose name starts with
``pyppo::``; nested or overlapping op events are counted once). The trainer wraps each phase in
``torch.profiler.record_function("pyppo/<phase>")``, so the phases also show up as ranges in the
trace and in any profiler a user runs around their own training loop.

Per phase the table also gives the model work done in it:

* ``GFLOP``: model FLOPs (forward + backward matmuls) counted analytically by :mod:`pyppo.profile.flops`
  from each model's config and the shapes it was actually fed during the profiled step — forward
  pre-hooks on the policy's, the reference's and the value model's decoders and heads record every
  call's batch, new positions and keys (attention mask or KV cache), so the micro-batches, the
  KV-cached decode steps and skipped phases are counted as they ran, not as the batch suggests.
  Causal attention; backward 2× the forward for trained weights, 1× for frozen (LoRA) ones;
  recomputation (gradient checkpointing, the attention kernel's scores, ``linear_logprobs``'
  logits) is not in it but is given as ``recompute_flops`` and HFU. A model whose config is not
  understood (not a Llama / Qwen2 / SmolLM2-style decoder: missing names, mixture of experts,
  blocks that do not match the config) gets a note and no FLOPs; the reward model is not counted.
* ``GFLOP/s``: over the phase's wall seconds.
* ``ideal ms``: the seconds the phase's matrix products would take at the rates ``torch.mm``
  reaches at their own shapes (:mod:`pyppo.profile.floors`): per decoder call of ``m = batch ·
  q_len`` rows, the q/k/v/o projections, the MLP's gate/up and down, LoRA adapters, attention's
  scores and weighted values (``torch.bmm`` over ``batch · heads``, timed at the full ``q_len ×
  kv_len``), the heads, and in the update each product's input- and weight-gradient products at
  theirs; the sum over them of FLOPs / FLOP/s at that shape. Each distinct shape is timed once,
  in the compute dtype (bfloat16 under ``--dtype bfloat16`` autocast, else float32) on the
  models' device with the run's threads, after the step (its shapes are known only then), at
  most 0.2 s each.
* ``shape MFU %`` = ideal ms / ms: the model FLOPs utilization of PaLM (Chowdhery et al. 2022,
  appendix B) with the peak taken per product at its shape, so that a phase of skinny products
  (a decode step's ``[B, hidden]`` rows, the LM head's 49152 columns) is held to what the
  machine reaches there. The headline MFU; the step row's is the step's ideal seconds over its
  seconds. Above 100 % gets a note (other load on a shared machine between the measurement and
  the step, or the model's kernels beating ``torch.mm`` at a shape).
* ``square MFU %`` = GFLOP/s / the square peak: the median of timed ``torch.mm`` calls on
  ``--peak-size`` square matrices (default 2048) in the compute dtype (float32 shown beside it),
  measured just before and just after the step, the higher kept. ``--peak-size 0`` skips every
  measurement: no MFU, no floors.
* ``tokens``, ``pad`` and ``tokens/s``: generate: tokens sampled, ``B × T`` (pad: sampled after a
  row's EOS; the prompt positions prefilled and their padding are given below the table); a
  forward: positions fed, ``B × (P + T)`` as the micro-batches were fed (pad: padding positions);
  update: those × ``ppo_epochs`` (each through the policy and the value model, if any). The step row:
  total FLOPs, the step's MFU, tokens sampled per step second.

Below the table: the hardware FLOPs utilization (recomputation included), the three shapes that
take most of the step's ideal time with their rates, and the generate phase against its two
floors: the compute floor (its ideal ms) and the byte floor, the bytes its forwards must read
(every linear weight once a forward, 2 bytes each under bfloat16 autocast, 4 in float32, and the
KV cache of every position scored) over the read bandwidth measured after the step (``torch.sum``
of a 256 MiB float32 tensor); the larger floor is the bound: on a 2-core CPU at batch 32, the
compute one.

Files written to ``--output DIR`` (default: the current directory):

* ``trace.json``: the Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing);
* ``profile.json``: the table (each phase row with ``flops``, ``forward_flops``,
  ``backward_flops``, ``recompute_flops``, ``flops_per_s``, ``ideal_seconds``,
  ``recompute_ideal_seconds``, ``mfu`` and ``hfu`` (at the shapes), ``square_mfu`` and
  ``square_hfu``, ``tokens``, ``padding_tokens``, ``tokens_per_s``; generate also
  ``bytes_read`` and ``byte_floor_seconds``; ``null`` where unknown), ``flops`` (the step's
  totals; ``peak``: the square peak, every measured shape's rate under ``shapes`` and the
  ``bandwidth``; ``floors.generate``: both floors, the phase's time over each and which binds;
  the slowest products, each model's shape, notes), the pyppo ops by time, the step's metrics and
  the settings.

Times include the profiler's own overhead (a few percent for a model forward; more for phases
made of many tiny ops, e.g. token-by-token generation). On CUDA the pyppo seconds are host-side
(launch) time, and the device time of pyppo's kernels is reported alongside.

The measurement itself is :mod:`pyppo.profile`; this module is the command.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

from ..run.rundir import check_output_dir
from .flags import add_config_flags, add_source_flags, config_flag_values, field_defaults, make_config

__all__ = ["PROFILE_DEFAULTS", "add_arguments", "run"]


#: What ``pyppo profile`` changes from PPOConfig's defaults: one small step after the warm-up.
PROFILE_DEFAULTS = {"batch_size": 4, "mini_batch_size": 4, "ppo_epochs": 1, "max_new_tokens": 16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``pyppo profile`` options to ``parser``: the model, reward and prompts, every
    ``PPOConfig`` field (as ``pyppo train``), and the profiler's own options."""
    add_source_flags(parser, required_defaults=True, eval_prompts=False)
    prof = parser.add_argument_group("profiler")
    prof.add_argument(
        "--warmup-steps",
        type=int,
        default=1,
        metavar="N",
        help="unprofiled steps first, so one-time costs stay out (default 1)",
    )
    prof.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch.set_num_threads(N) first (default: torch's choice)",
    )
    prof.add_argument(
        "--peak-size",
        type=int,
        default=2048,
        metavar="N",
        help="the square peak: torch.mm of N x N matrices, measured around the step (default 2048; 0 = no "
        "measurement of the machine: no MFU, no floors)",
    )
    prof.add_argument("--record-shapes", action="store_true", help="record op input shapes in the trace")
    prof.add_argument("--with-stack", action="store_true", help="record Python stacks in the trace (slower)")
    prof.add_argument(
        "--output",
        metavar="DIR",
        default=".",
        help="where trace.json and profile.json go (default: the current directory)",
    )
    add_config_flags(parser, field_defaults(PROFILE_DEFAULTS))


def run(args: argparse.Namespace) -> int:
    """Run ``pyppo profile`` with parsed ``args``; returns the exit status."""
    import torch

    import pyppo
    from pyppo import _C

    from ..profile.counting import profile_step
    from ..profile.phases import format_table
    from .build import build_trainer

    if args.warmup_steps < 0:
        raise ValueError("--warmup-steps must be >= 0")
    if args.peak_size < 0:
        raise ValueError("--peak-size must be >= 0")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    flags = config_flag_values(args)
    settings = {**PROFILE_DEFAULTS, **flags, "steps": args.warmup_steps + 1}
    if "mini_batch_size" not in flags:  # one minibatch: the whole profiled batch
        settings["mini_batch_size"] = settings["batch_size"]
    config = make_config(settings, flags)
    output = Path(args.output).expanduser()
    check_output_dir(output)  # before the model loads, not after the profiled step

    trainer = build_trainer(
        config,
        model=args.model,
        reward=args.reward,
        prompts=args.prompts,
        env=args.env,
        before_loading=lambda: print(f"pyppo profile: loading {args.model} ...", file=sys.stderr),
    )
    print(f"pyppo profile: {args.warmup_steps} warm-up step(s), then one profiled step ...", file=sys.stderr)
    options = {k: getattr(args, k) for k in ("warmup_steps", "record_shapes", "with_stack", "peak_size")}
    table = profile_step(trainer, output, **options)

    device = trainer.device
    env = {
        "pyppo": getattr(pyppo, "__version__", "unknown"),
        "torch": torch.__version__,
        "device": str(device) if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": _C.cpu_capability(),
    }
    header = (
        f"pyppo profile: {args.model} on {env['device']}, {env['torch_threads']} threads "
        f"({env['cpu_capability']}); batch {config.batch_size}, mini-batch {config.mini_batch_size}, "
        f"{config.ppo_epochs} epoch(s), max {config.max_new_tokens} new tokens "
        f"(mean response {table['metrics'].get('response_length_mean', float('nan')):.1f})"
    )
    result = {
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "model": args.model,
        "reward": args.reward,
        "config": config.to_dict(),
        "warmup_steps": args.warmup_steps,
        "env": env,
        "trace": "trace.json",
        **table,
    }
    (output / "profile.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(format_table(table, header))
    print()
    print(f"wrote {output / 'trace.json'} and {output / 'profile.json'}")
    return 0
