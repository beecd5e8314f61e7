"""Held-out success of a policy on a multi-turn environment, before training or after it: the
evaluation ``pyppo train --eval-prompts`` runs at its ``eval_every`` steps, on a model directory
(a run's ``policy/``) or the default model, with no step taken.

    python benchmarks/agent_eval.py --env arithmetic-retry --eval-prompts arithmetic-eval
    python benchmarks/agent_eval.py --model runs/X/policy --env arithmetic-retry
    python benchmarks/agent_eval.py --env calculator --max-turns 4 --max-new-tokens 64

``--eval-prompts`` defaults to the environment's held-out prompts (``default_eval_prompts()``,
which every built-in environment declares).

Prints the ``eval/*`` metrics (``eval/score_mean``: the mean score, for arithmetic-retry the
fraction solved within ``max_attempts``; ``eval/first_turn_success``: solved at the first turn;
``eval/turns_mean``; ``eval/tool_calls_mean``) as one JSON line. Sampling settings are
``pyppo train``'s (``--max-new-tokens`` per turn, temperature 1).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--env", required=True)
    p.add_argument("--eval-prompts", default=None, help="default: the environment's default_eval_prompts()")
    p.add_argument("--reward", default=None, help="default: the environment's own (pyppo train's rule)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()

    from pyppo import PPOConfig
    from pyppo.agents.registry import load_environment
    from pyppo.cli.build import build_trainer

    env_class = load_environment(args.env)
    reward = args.reward or getattr(env_class, "default_reward", None) or "none"
    if args.eval_prompts is None and getattr(env_class, "default_eval_prompts", None) is None:
        p.error(f"--env {args.env} declares no held-out prompts (default_eval_prompts): pass --eval-prompts")
    config = PPOConfig(
        batch_size=args.batch_size,
        mini_batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_turns=args.max_turns,
        advantage_estimator="reinforce_pp",
        kl_coef=0.0,
        seed=args.seed,
        dtype=args.dtype,
        eval_every=1,  # never trains; makes build_trainer default the eval prompts to the environment's
    )
    trainer = build_trainer(config, model=args.model, reward=reward, eval_prompts=args.eval_prompts, env=args.env)
    metrics, _ = trainer.evaluate_prompts()
    trainer.close()
    print(json.dumps({"model": args.model, "env": args.env, **metrics}))


if __name__ == "__main__":
    main()
