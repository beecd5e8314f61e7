"""Every pyppo CUDA kernel on tiny shapes, for compute-sanitizer: gather_logprobs forward (with and
without entropy, temperature 1 and not) and backward, on V = 7, 4099 and 6144, contiguous, T-sliced
and misaligned (every row one element off 16 bytes); linear_logprobs and linear_ppo_loss;
kl_penalty, shape_rewards, gae (T = 5, 1024, 2500; also with a per-row and a critic lambda), turn_gae
(the same rows), masked_mean / masked_var / masked_whiten;
group_advantages (B = 3 and 300: one tile of ids and two, groups of 1 to 7); every dtype. Each result is
checked finite where it must be, so a wrong answer fails as well as a bad access.

gpu_check.sh's sanitize step runs it twice, with no arguments, under
``compute-sanitizer --tool memcheck|racecheck --error-exitcode 9 [--kernel-name kns=pyppo]
python benchmarks/gpu/sanitize_workload.py``; exit 0 = every result finite, 1 = a non-finite one
(the sanitizer's own finding exits 9). Needs CUDA."""

import torch

from pyppo import ops

P = torch.ops.pyppo
d = torch.device("cuda")
g = torch.Generator(device=d).manual_seed(0)
problems = []


def layouts(B, T, V, dtype):
    yield "contiguous", torch.randn(B, T, V, device=d, dtype=torch.float32, generator=g).to(dtype)
    yield "T-sliced", torch.randn(B, T + 2, V, device=d, dtype=torch.float32, generator=g).to(dtype)[:, 1:-1]
    flat = torch.randn(B * T * V + 1, device=d, dtype=torch.float32, generator=g).to(dtype)
    yield "misaligned", flat[1:].view(B, T, V)


for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for V in (7, 4099, 6144):
        for name, z in layouts(2, 3, V, dtype):
            labels = torch.randint(0, V, (2, 3), device=d, generator=g)
            labels[0, 0] = -100
            mask = torch.ones(2, 3, dtype=torch.bool, device=d)
            mask[1, 1] = False
            for tau, ent in ((1.0, True), (0.7, True), (1.0, False), (1.3, False)):
                lp, e, lse = P.gather_logprobs(z, labels, mask, tau, -100, ent)
                if not torch.isfinite(lp).all():
                    problems.append(f"gather_logprobs {dtype} V={V} {name}: non-finite log-probs")
                ge = torch.ones_like(lp) if ent else None
                gz = P.gather_logprobs_backward(
                    torch.ones_like(lp), ge, z, labels, mask, lse, e if ent else None, tau, -100
                )
                if not torch.isfinite(gz).all():
                    problems.append(f"gather_logprobs_backward {dtype} V={V} {name}: non-finite gradient")
    h = torch.randn(2, 5, 16, device=d, generator=g).to(dtype)
    w = (torch.randn(4099, 16, device=d, generator=g) * 0.2).to(dtype)
    y = torch.randint(0, 4099, (2, 5), device=d, generator=g)
    m = torch.ones(2, 5, dtype=torch.bool, device=d)
    lp, ent, lse = P.linear_logprobs(h, w, y, m, None, 1.0, -100, True, 3)
    P.linear_logprobs_backward(
        torch.ones_like(lp), torch.ones_like(ent), h, w, y, m, None, lse, ent, 1.0, -100, 3, [True, True, False]
    )
    tw = ops.loss_token_weights(m)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    P.linear_ppo_loss(
        h,
        w,
        y,
        lp.to(acc),
        torch.randn(2, 5, device=d, generator=g).to(acc),
        m,
        tw,
        lp.to(acc),
        None,
        1.0,
        -100,
        0.2,
        0.2,
        None,
        0.1,
        "k3",
        0.01,
        True,
        3,
        [True, True, False],
    )
    for T in (5, 1024, 2500):
        r = torch.randn(4, T, device=d, generator=g).to(dtype)
        v = torch.randn(4, T, device=d, generator=g).to(dtype)
        mk = torch.rand(4, T, device=d, generator=g) < 0.8
        mk[:, 0] = True
        mk[1] = False
        adv, ret = ops.gae(r, v, mk, gamma=0.99, lam=0.95, last_values=v[:, 0].contiguous())
        if not (torch.isfinite(adv).all() and torch.isfinite(ret).all()):
            problems.append(f"gae {dtype} T={T}: non-finite output")
        row_lam = torch.tensor([0.0, 0.5, 0.9, 1.0], device=d)
        adv, ret = ops.gae(r, v, mk, gamma=0.99, lam=row_lam, lam_critic=1.0)
        if not (torch.isfinite(adv).all() and torch.isfinite(ret).all()):
            problems.append(f"gae (row lam, lam_critic) {dtype} T={T}: non-finite output")
        turn_ids = torch.where(mk, torch.arange(T, device=d) // 7, -1)
        adv, ret = ops.turn_gae(r, v, turn_ids, gamma=0.99, lam=0.95, last_values=v[:, 0].contiguous())
        if not (torch.isfinite(adv).all() and torch.isfinite(ret).all()):
            problems.append(f"turn_gae {dtype} T={T}: non-finite output")
        mk[1, 0] = True
        ops.kl_penalty(r, v, estimator="k3")
        ops.shape_rewards(v[:, 0].contiguous(), r, v, mk, kl_coef=0.05)
        ops.masked_whiten(r, mk)
        ops.masked_mean(r, mk, dim=1)
        ops.masked_var(r, mk)
    for B in (3, 300):
        s = torch.randn(B, device=d, generator=g).to(dtype)
        ids = torch.randint(0, max(1, B // 4), (B,), device=d, generator=g)
        mk = torch.rand(B, 9, device=d, generator=g) < 0.8
        for est in ("grpo", "rloo"):
            if not torch.isfinite(ops.group_advantages(s, mk, group_ids=ids, estimator=est)).all():
                problems.append(f"group_advantages {dtype} B={B} {est}: non-finite output")
torch.cuda.synchronize()
for p in problems:
    print("gpu_check: FAIL:", p)
print(f"gpu_check: sanitizer workload: {'pass' if not problems else 'FAIL'}")
raise SystemExit(1 if problems else 0)
