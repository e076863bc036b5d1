#!/usr/bin/env bash
# What the GPU machine has, before the other checks use it: the GPU and driver
# (nvidia-smi), torch and its CUDA build, and which of the Python packages the checks
# use are installed (those missing make the checks that need them skip, saying so;
# the machine has no network to install them). Seconds.
#
#   bash benchmarks/gpu_checks/environment_gpu.sh [--dry-run]
set -uo pipefail
# shellcheck source=benchmarks/gpu_checks/lib.sh
source "$(dirname "$0")/lib.sh" "$@"

check "nvidia-smi" --cuda --timeout 30 -- \
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,mig.mode.current --format=csv
check "python packages" --expect "^torch [0-9]" -- "$python" - <<'EOF'
import importlib.metadata
import sys

import torch

print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__)
for name in ("pytest", "pytest-xdist", "cookiecutter", "numpy"):
    try:
        print(name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        print(name, "not installed")
EOF
check "torch sees CUDA" --cuda --expect "^cuda ok" -- "$python" - <<'EOF'
import torch

print("torch", torch.__version__, "CUDA", torch.version.cuda, "arch list", torch.cuda.get_arch_list())
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
for index in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(index)
    print(f"cuda:{index}: {props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
print("cudnn", torch.backends.cudnn.version())
print("cuda ok")
EOF
finish_checks
