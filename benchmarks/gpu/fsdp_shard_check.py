"""One-process FSDP2 check: gpu_check.sh's fsdp step, part (b), runs
``torchrun --standalone --nproc-per-node 1 benchmarks/gpu/fsdp_shard_check.py DEVICE`` (argv[1]:
cuda or cpu, its GPU_CHECK_DEVICE); exit 0 = pass, 1 = a check failed.

pyppo.distributed.wrap is the identity with one process, so this applies its FSDP2 branch itself
(fully_shard on every transformer block, then on the LogprobHead root) in a 1-rank process group
(NCCL on cuda, gloo on cpu), and runs what the trainer runs through a sharded policy: sampling
(synced_gpus), a bf16-autocast log-prob forward (compared with an unsharded twin), the PPO policy
loss backward, an AdamW step and the full-state-dict gather of pyppo.run.checkpoint.training_state.
Covers: FSDP2 hooks, DTensor parameters and the gathers on this device with pyppo's ops and
autocast. Not covered: several ranks (real reduce-scatter, cross-rank reductions); those are in
tests/test_distributed.py (gloo, CPU) and, on >= 2 GPUs, the fsdp step's trainer run.
"""

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from pyppo import distributed
from pyppo.config import PPOConfig
from pyppo.ops import ppo_policy_loss
from pyppo.precision import autocast
from pyppo.rollout.hf_generate import generation_config
from pyppo.run import checkpoint
from pyppo.trainer.buffer import RolloutBuffer
from pyppo.trainer.logprob_head import LogprobHead
from support.tiny_models import tiny_causal_lm

kind = sys.argv[1]
if kind == "cuda":
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if kind == "cuda" else "gloo")
assert dist.get_world_size() == 1, "run with --nproc-per-node 1"
bf16 = torch.bfloat16
problems = []

model = tiny_causal_lm(seed=0).to(device)
twin = copy.deepcopy(model)  # unsharded, for comparing log-probs
head = LogprobHead(model, temperature=1.0, dtype=bf16)
twin_head = LogprobHead(twin, temperature=1.0, dtype=bf16)
start = {n: p.detach().cpu().clone() for n, p in head.named_parameters()}

# pyppo.distributed.wrap(head, world, fsdp=True) with several ranks: these two steps.
blocks = distributed._block_classes(head)
layers = [m for m in head.modules() if type(m).__name__ in blocks]
for layer in layers:
    fully_shard(layer)
fully_shard(head)
params = list(head.parameters())
n_dtensor = sum(type(p).__name__ == "DTensor" for p in params)
if not layers or not distributed.is_sharded(head) or n_dtensor != len(params):
    problems.append(f"not sharded: {len(layers)} blocks, {n_dtensor}/{len(params)} DTensor parameters")

# A batch: left-padded prompts, right-padded responses of lengths 8, 5, 3, 1 (EOS = pad = 2).
g = torch.Generator().manual_seed(0)
B, P, T = 4, 6, 8
query_ids = torch.randint(4, 99, (B, P), generator=g)
query_mask = torch.ones(B, P, dtype=torch.bool)
for i in range(B):
    query_mask[i, :i] = False
    query_ids[i, :i] = 2
response_mask = torch.arange(T) < torch.tensor([8, 5, 3, 1]).unsqueeze(1)
response_ids = torch.where(response_mask, torch.randint(4, 99, (B, T), generator=g), torch.full((B, T), 2))
mb = RolloutBuffer(
    query_ids=query_ids, query_mask=query_mask, response_ids=response_ids, response_mask=response_mask
).to(device)

# Sampling through the sharded head, as the trainer's rollout does.
gen = generation_config(PPOConfig(max_new_tokens=4), eos_token_id=2, pad_token_id=2)
head.eval()
with torch.no_grad(), autocast(device, bf16):
    seqs = head(None, sample=(mb.query_ids, mb.query_mask, gen, {"synced_gpus": True}))
if seqs.shape[0] != B or not P < seqs.shape[1] <= P + 4:
    problems.append(f"sampled sequences have shape {tuple(seqs.shape)}")

head.train()
with autocast(device, bf16):
    logprobs, entropy = head(mb, True)
    with torch.no_grad():
        twin_logprobs, _ = twin_head(mb, True)
diff = float((logprobs.detach() - twin_logprobs).abs().max())
if not (torch.isfinite(logprobs).all() and torch.isfinite(entropy).all()):
    problems.append("non-finite log-probs or entropy")
if not diff <= 2e-2:
    problems.append(f"sharded log-probs differ from the unsharded twin's by {diff:.3g}")
advantages = torch.randn(B, T, generator=g).to(device) * mb.response_mask
loss, _ = ppo_policy_loss(logprobs, logprobs.detach(), advantages, mb.response_mask)
loss.backward()
grads = [p.grad for p in head.parameters() if p.grad is not None]
local = [gr.to_local() if hasattr(gr, "to_local") else gr for gr in grads]
if len(grads) != len(params) or not all(torch.isfinite(x).all() for x in local):
    problems.append(
        f"gradients: {len(grads)}/{len(params)} present, finite: {all(torch.isfinite(x).all() for x in local)}"
    )
opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
opt.step()

weights, opt_state = checkpoint.training_state(head, opt, prefix="model.")
names = {n[len("model.") :] for n in start}
if set(weights) != names:
    problems.append(f"full state dict has {len(weights)} weights, expected {len(names)}")
bad = [n for n, w in weights.items() if w.shape != start["model." + n].shape or not torch.isfinite(w).all()]
moved = sum(not torch.equal(w.float(), start["model." + n].float()) for n, w in weights.items() if n not in bad)
if bad:
    problems.append(f"{len(bad)} gathered weights with a wrong shape or non-finite values, e.g. {bad[0]}")
if moved < len(weights) // 2:
    problems.append(f"the AdamW step moved only {moved}/{len(weights)} weights")
moments = [
    v
    for st in opt_state.get("state", {}).values()
    for v in st.values()
    if isinstance(v, torch.Tensor) and v.numel() > 1
]
if not moments or not all(torch.isfinite(v).all() for v in moments):
    problems.append(
        f"optimizer state: {len(moments)} moment tensors, finite: {all(torch.isfinite(v).all() for v in moments)}"
    )

dist.destroy_process_group()
for p in problems:
    print("gpu_check: FAIL:", p)
print(
    f"gpu_check: FSDP2 shard check on {device}: {len(layers)} blocks + root sharded, {n_dtensor} DTensor "
    f"params; log-prob max |diff| vs unsharded {diff:.2g}; loss {float(loss):.4f}; AdamW moved "
    f"{moved}/{len(weights)} gathered weights: {'pass' if not problems else 'FAIL'}"
)
sys.exit(1 if problems else 0)
