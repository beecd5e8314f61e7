"""The kernel table: python benchmarks/gpu/kernel_table.py OUT_JSON [quick]. Times with CUDA events
(median of several repetitions after a warm-up); bandwidth is bytes moved / time, the copy's bytes
being a read and a write of the logits.

Rows: gather_logprobs forward (with and without entropy) and backward on logits [8, 1024, 151936]
in bf16 and fp32, each against a device-to-device copy (targets: forward >= 0.80 of the copy's
bandwidth, backward >= 0.60); GAE and turn GAE on [256, 2048]; linear_logprobs forward+backward with entropy at
M = 16384, H = 4096, V = 131072 in bf16 (target: no slower than Liger-Kernel's fused linear
cross-entropy, run here when installed, else ~104 ms). ``quick`` shrinks the shapes.
gpu_check.sh's kernels step calls it as ``kernel_table.py "${OUT:-$WORK}/kernels.json"`` (not
quick). Writes OUT_JSON after every row (a run cut short keeps the rows it measured; "complete" says whether
it finished); exit 0 = every target met, 3 = a target missed. Needs CUDA."""

import json
import os
import statistics
import sys

import torch

from pyppo import ops

out_path = sys.argv[1]
quick = len(sys.argv) > 2 and sys.argv[2] == "quick"
P = torch.ops.pyppo
d = torch.device("cuda")
rows, problems = [], []


def save(complete=False):
    with open(out_path + ".tmp", "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "complete": complete, "rows": rows},
            f,
            indent=1,
        )
    os.replace(out_path + ".tmp", out_path)


def timed(fn, reps=10, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def row(name, seconds, nbytes=None, copy_bw=None, target=None):
    r = {"case": name, "ms": round(seconds * 1e3, 4)}
    if nbytes is not None:
        r["GB/s"] = round(nbytes / seconds / 1e9, 1)
    if copy_bw is not None:
        r["of copy"] = round(nbytes / seconds / copy_bw, 3)
    if target is not None:
        r["target"] = target[0]
        r["status"] = "pass" if target[1] else "MISS"
    rows.append(r)
    print("gpu_check: kernel", json.dumps(r))
    save()


shape = (8, 1024, 151936) if not quick else (2, 256, 151936)


def gather_logprobs_rows(dtype):
    z = torch.randn(*shape, device=d, dtype=dtype)
    labels = torch.randint(0, shape[2], shape[:2], device=d)
    nbytes = z.numel() * z.element_size()
    t_copy = timed(lambda: z.clone())
    copy_bw = 2 * nbytes / t_copy
    tag = f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} {list(shape)}"
    row(f"device-to-device copy {tag}", t_copy, 2 * nbytes, copy_bw)
    t = timed(lambda: P.gather_logprobs(z, labels, None, 1.0, -100, False))
    row(f"gather_logprobs fwd {tag}", t, nbytes, copy_bw, (">= 0.80 of copy", nbytes / t >= 0.8 * copy_bw))
    t = timed(lambda: P.gather_logprobs(z, labels, None, 1.0, -100, True))
    row(f"gather_logprobs fwd+entropy {tag}", t, nbytes, copy_bw, (">= 0.80 of copy", nbytes / t >= 0.8 * copy_bw))
    lp, ent, lse = P.gather_logprobs(z, labels, None, 1.0, -100, True)
    g1 = torch.ones_like(lp)
    t = timed(lambda: P.gather_logprobs_backward(g1, g1, z, labels, None, lse, ent, 1.0, -100))
    row(
        f"gather_logprobs bwd (entropy) {tag}",
        t,
        2 * nbytes,
        copy_bw,
        (">= 0.60 of copy", 2 * nbytes / t >= 0.6 * copy_bw),
    )


for dtype in (torch.bfloat16, torch.float32):
    gather_logprobs_rows(dtype)  # its tensors are freed when it returns
    torch.cuda.empty_cache()

B, T = 256, 2048
r = torch.randn(B, T, device=d)
v = torch.randn(B, T, device=d)
m = torch.rand(B, T, device=d) < 0.9
t = timed(lambda: ops.gae(r, v, m, gamma=0.99, lam=0.95), reps=20)
row(f"gae fp32 [{B}, {T}]", t, B * T * (4 * 4 + 1))
# turns of 32 agent tokens between 32 environment tokens (one thread a row; bytes: rewards,
# values, int64 ids and both outputs once)
pos = torch.arange(T, device=d)
ids = torch.where((pos // 32) % 2 == 0, pos // 64, -1).expand(B, T).contiguous()
t = timed(lambda: ops.turn_gae(r, v, ids, gamma=0.99, lam=0.95), reps=20)
row(f"turn_gae fp32 [{B}, {T}]", t, B * T * (4 * 4 + 8))

M, H, V = (16384, 4096, 131072) if not quick else (2048, 4096, 131072)
hid = (torch.randn(M, H, device=d) * 0.5).to(torch.bfloat16).requires_grad_()
w = (torch.randn(V, H, device=d) * 0.02).to(torch.bfloat16).requires_grad_()
y = torch.randint(0, V, (M,), device=d)


def pyppo_linear():
    lp, ent = ops.linear_logprobs(hid, w, y, return_entropy=True)
    (lp.sum() + 0.01 * ent.sum()).backward()
    hid.grad = w.grad = None


ref_ms, ref_name = 104.0 * M / 16384, "Liger-Kernel FLCE, ~104 ms on an H100 (scaled to M)"
try:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def liger():
        loss = liger_fused_linear_cross_entropy(hid, w, y)
        loss.backward()
        hid.grad = w.grad = None

    ref_ms, ref_name = timed(liger, reps=3, warmup=1) * 1e3, "Liger-Kernel FLCE on this GPU"
    row(f"liger fused linear CE bf16 M={M} H={H} V={V}", ref_ms / 1e3)
except Exception as exc:  # noqa: BLE001 - Liger is optional here
    print(f"gpu_check: kernel: Liger-Kernel not run ({type(exc).__name__}: {exc}); comparing with {ref_ms:.0f} ms")
t = timed(pyppo_linear, reps=3, warmup=1)
row(
    f"linear_logprobs fwd+bwd+entropy bf16 M={M} H={H} V={V}",
    t,
    None,
    None,
    (f"<= {ref_ms:.1f} ms ({ref_name})", t * 1e3 <= ref_ms),
)

device = torch.cuda.get_device_name()
save(complete=True)
missed = [r["case"] for r in rows if r.get("status") == "MISS"]
print(f"gpu_check: kernel table on {device}: {len(rows)} rows, {len(missed)} target(s) missed")
raise SystemExit(3 if missed else 0)
