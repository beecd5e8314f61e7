"""What turn k of a multi-turn episode costs to sample against turn 1, with each rollout engine.

Each turn continues every live episode's whole context (prompt, earlier turns, the environment's
replies). ``transformers.generate`` prefills that context again at every turn; vLLM keeps the KV
of the context it has seen in its prefix cache, so the turns of one step reuse it. The workload:
SmolLM2-135M-Instruct (or ``--model``: a trained policy that ends its turns with EOS keeps more
episodes live), ``--episodes`` episodes of ``--prompts`` (the arithmetic problems), an
environment that answers every turn with the same short message and never ends an episode,
``--turns`` turns of at most ``--max-new-tokens`` tokens, one warm-up rollout, then ``--repeats``
measured rollouts per engine. Prints, per engine and turn: live episodes, mean context tokens,
seconds, and seconds per live episode relative to turn 1. ``--fixed-length`` makes every turn
sample exactly ``--max-new-tokens`` tokens (EOS masked until then: ``min_new_tokens`` in
``transformers``, ``min_tokens`` in vLLM; the last one is then replaced by EOS, so that the episode
goes on), so the turns differ only in their context: what is left of turn k's extra cost is
prefilling it, which vLLM's prefix cache saves.

    python benchmarks/agent_turns.py                          # both engines (vLLM when installed)
    python benchmarks/agent_turns.py --engines transformers --turns 4
    python benchmarks/agent_turns.py --fixed-length --max-new-tokens 32 --turns 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict


class GoOn:
    """Answers every turn; never ends an episode."""

    def reset(self, **row):
        return None

    def step(self, action):
        return "Go on.", 0.0, False


def fix_length(engine, engine_name: str) -> None:
    """Mask EOS until a turn holds ``max_new_tokens`` tokens (a benchmark's setting, off-policy
    for training)."""
    if engine_name == "transformers":
        real = engine.sample_continuations

        def at_length(sequences, max_new_tokens):
            engine.gen_config.min_new_tokens = max_new_tokens
            return real(sequences, max_new_tokens)

        engine.sample_continuations = at_length
        return
    from pyppo.rollout import vllm_engine

    real_params = vllm_engine.sampling_params

    def at_length(**kwargs):
        params = real_params(**kwargs)
        params.min_tokens = kwargs["max_new_tokens"]
        return params

    vllm_engine.sampling_params = at_length


def measure(engine_name: str, args) -> dict:
    import torch

    from pyppo import PPOConfig, PPOTrainer, prompts
    from pyppo.models import load_model_and_tokenizer

    torch.manual_seed(0)
    policy, tokenizer = load_model_and_tokenizer(args.model)
    config = PPOConfig(
        batch_size=args.episodes,
        mini_batch_size=args.episodes,
        max_new_tokens=args.max_new_tokens,
        max_turns=args.turns,
        rollout_engine=engine_name,
        advantage_estimator="reinforce_pp",
        kl_coef=0.0,
        dtype=args.dtype,
    )
    chosen = (
        [r["prompt"] for r in prompts.load_prompt_records(args.prompts)] if args.prompts else prompts.DEFAULT_PROMPTS
    )
    trainer = PPOTrainer(config, policy, None, None, tokenizer, None, chosen, environment=GoOn)
    base, timings = trainer.engine.engine, defaultdict(list)
    if args.fixed_length:
        fix_length(base, engine_name)
    real = base.sample_continuations

    def timed(sequences, max_new_tokens):
        t0 = time.perf_counter()
        out = real(sequences, max_new_tokens)
        if args.fixed_length:  # EOS in the last place, so that the episode goes on to the next turn
            out = [(ids[:-1] + [tokenizer.eos_token_id], logprobs) for ids, logprobs in out]
        turn = timed.turn
        sampled = statistics.mean(len(ids) for ids, _ in out)
        timings[turn].append((time.perf_counter() - t0, len(sequences), statistics.mean(map(len, sequences)), sampled))
        timed.turn += 1
        return out

    base.sample_continuations = timed
    batch = list(chosen[: args.episodes])
    for repeat in range(args.repeats + 1):
        timed.turn = 0
        if repeat == 0:  # warm-up
            trainer.rollout(batch)
            timings.clear()
            continue
        trainer.rollout(batch)
    trainer.close()
    rows = {}
    for turn, samples in sorted(timings.items()):
        seconds = statistics.median(s[0] for s in samples)
        live = statistics.median(s[1] for s in samples)
        context, sampled = (statistics.mean(s[i] for s in samples) for i in (2, 3))
        rows[turn + 1] = {
            "live": live,
            "context": context,
            "sampled": sampled,
            "seconds": seconds,
            "per_episode": seconds / live,
        }
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engines", default="transformers,vllm")
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument(
        "--prompts",
        default="arithmetic",
        help="a prompt set (name or .jsonl); '' = the default open-ended prompts, whose long answers a "
        "model may not end within --max-new-tokens (a turn without EOS cuts the episode)",
    )
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--fixed-length", action="store_true", help="every turn samples exactly --max-new-tokens tokens")
    args = p.parse_args()
    for name in args.engines.split(","):
        if name == "vllm":
            try:
                import vllm  # noqa: F401
            except ImportError:
                print("vllm: not installed, skipped")
                continue
        rows = measure(name, args)
        first = rows[1]["per_episode"]
        exactly = "exactly " if args.fixed_length else "at most "
        print(f"{name}: {args.episodes} episodes, {exactly}{args.max_new_tokens} new tokens a turn, {args.dtype}")
        print("  turn  live  context tokens  sampled tokens  seconds  s/episode vs turn 1")
        for turn, r in rows.items():
            print(
                f"  {turn:>4}  {r['live']:>4.0f}  {r['context']:>14.1f}  {r['sampled']:>14.1f}  {r['seconds']:>7.2f}"
                f"  {r['per_episode'] / first:>8.2f}x"
            )


if __name__ == "__main__":
    main()
