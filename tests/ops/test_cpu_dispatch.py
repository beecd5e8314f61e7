"""The per-ISA CPU kernels: every compiled instruction set the machine supports gives the
float64 reference's results, and PYPPO_CPU_CAPABILITY picks (and caps) the set. Also the
import-time checks of the build against the running torch."""

import json
import os
import subprocess
import sys

import pytest

import pyppo._C as C

SCRIPT = r"""
import json, sys, torch, pyppo._C as C
from pyppo import ops
sys.path.insert(0, sys.argv[1])
from support.reference import (random_turn_ids, ref_gae, ref_gather_logprobs, ref_group_advantages, ref_kl_penalty,
                               ref_masked_mean, ref_masked_whiten, ref_turn_gae)
g = torch.Generator().manual_seed(0)
out = {"isa": C.cpu_capability()}
for dtype in (torch.float32, torch.bfloat16):
    z = (torch.randn(5, 7, 2500, generator=g) * 3).to(dtype)
    y = torch.randint(0, 2500, (5, 7), generator=g)
    m = torch.rand(5, 7, generator=g) > 0.2
    zr = z.clone().requires_grad_()
    lp, ent = ops.gather_logprobs(zr, y, m, temperature=0.7, return_entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    zd = z.double().requires_grad_()
    ref_lp, ref_ent = ref_gather_logprobs(zd, y, m, temperature=0.7)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    out[str(dtype)] = [float((lp - ref_lp).abs().max()), float((ent - ref_ent).abs().max()),
                       float((zr.grad.double() - zd.grad).abs().max() / zd.grad.abs().max())]
a, b = torch.randn(64, 33, generator=g), torch.randn(64, 33, generator=g)
k3 = ops.kl_penalty(a, b, estimator="k3", clamp=(None, 5.0))
out["k3"] = float((k3 - ref_kl_penalty(a, b, estimator="k3", clamp=(None, 5.0))).abs().max())
x, v = torch.randn(9, 700, generator=g), torch.randn(9, 700, generator=g)
mask = torch.rand(9, 700, generator=g) > 0.3
adv, _ = ops.gae(x, v, mask, gamma=0.99, lam=0.95)
out["gae"] = float((adv - ref_gae(x, v, mask, gamma=0.99, lam=0.95)[0]).abs().max())
row_lam = torch.rand(9, generator=g)
_, ret = ops.gae(x, v, mask, gamma=0.99, lam=row_lam, lam_critic=1.0)
out["gae"] = max(out["gae"], float((ret - ref_gae(x, v, mask, gamma=0.99, lam=row_lam, lam_critic=1.0)[1]).abs().max()))
ids = random_turn_ids(9, 700, g)
adv, _ = ops.turn_gae(x, v, ids, gamma=0.99, lam=0.95)
out["turn_gae"] = float((adv - ref_turn_gae(x, v, ids, gamma=0.99, lam=0.95)[0]).abs().max())
out["masked"] = max(float((ops.masked_whiten(x, mask) - ref_masked_whiten(x, mask)).abs().max()),
                    float((ops.masked_mean(x, mask, dim=1) - ref_masked_mean(x, mask, 1)).abs().max()))
ids = torch.randint(0, 3, (9,), generator=g)
out["group"] = max(float((ops.group_advantages(x[:, 0], mask, group_ids=ids, estimator=e)
                          - ref_group_advantages(x[:, 0], mask, ids, estimator=e)).abs().max())
                   for e in ("grpo", "rloo"))
print(json.dumps(out))
"""


def _supported():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isas = ["default"]
    if " avx2 " in flags and " fma " in flags:
        isas.append("avx2")
    if all(f" {f} " in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
        isas.append("avx512")
    built = C.cpu_isas.lower().split()
    return [i for i in isas if i in built]


@pytest.mark.parametrize("isa", _supported())
def test_each_instruction_set_matches_the_float64_reference(isa):
    env = {**os.environ, "PYPPO_CPU_CAPABILITY": isa}
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, above tests/ops/
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tests_dir], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["isa"] == isa.upper()
    lp, ent, grad = res["torch.float32"]
    assert lp < 1e-5 and ent < 1e-5 and grad < 1e-5, res
    lp, ent, grad = res["torch.bfloat16"]  # inputs are rounded to bf16 first; the gradient is stored in bf16
    assert lp < 1e-5 and ent < 1e-5 and grad < 1e-2, res
    assert res["k3"] < 1e-5 and res["gae"] < 1e-4 and res["masked"] < 1e-5 and res["group"] < 1e-6, res
    assert res["turn_gae"] < 1e-4, res


def test_bad_capability_name_is_a_clear_error():
    env = {**os.environ, "PYPPO_CPU_CAPABILITY": "sse9"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, pyppo.ops as o; o.gae(torch.zeros(1,1), torch.zeros(1,1), torch.ones(1,1)); "
            "o.gather_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "PYPPO_CPU_CAPABILITY" in proc.stderr and "sse9" in proc.stderr


def test_torch_mismatch_is_an_import_error_naming_both_versions(monkeypatch):
    import torch

    import pyppo

    pyppo._check_torch_abi()  # the build under test matches
    monkeypatch.setattr(torch, "__version__", "9.9.9+cu999")
    with pytest.raises(ImportError) as e:
        pyppo._check_torch_abi()
    msg = str(e.value)
    assert f"built against torch {C.torch_version}" in msg and "torch 9.9.9+cu999 is installed" in msg
    assert "pip install --no-build-isolation --force-reinstall --no-deps ." in msg
    # the local tag alone (a CPU build under a CUDA torch) is a mismatch too
    monkeypatch.setattr(torch, "__version__", C.torch_version.split("+")[0] + "+cu128")
    with pytest.raises(ImportError, match=r"\+cu128"):
        pyppo._check_torch_abi()
