"""gpu_check.sh's environment check, its first step: prints the Python, torch and torch CUDA
versions and, with GPU_CHECK_DEVICE=cuda, every device's name, sm_XY and memory; exits non-zero
(with a gpu_check: message) when that torch has no CUDA or sees no device.

    GPU_CHECK_DEVICE=cuda|cpu python benchmarks/gpu/env_check.py

No arguments; GPU_CHECK_DEVICE must be set (gpu_check.sh passes its own). A non-zero exit makes
gpu_check.sh stop with status 1.
"""
import os, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
if os.environ["GPU_CHECK_DEVICE"] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device")
    if torch.version.cuda is None:
        sys.exit("gpu_check: this torch has no CUDA")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"device {i}:", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.0f} GiB")
