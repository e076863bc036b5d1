#!/usr/bin/env bash
# GPU checks of the doctor and train commands (issue 7), on a machine with an NVIDIA GPU.
#
#   bash benchmarks/gpu_checks/commands_gpu.sh      # from the template repository root
#
# Needs a CUDA build of torch and pytest in $PYTHON (default: python3). No network:
# the project is baked with cookiecutter when it is installed, else its src folder is
# copied as is (the template copies src/ without rendering) and the one rendered test
# file gets the package name. Under 2 minutes. Checks:
#   doctor --require-gpu passes (and its time), --json says ok, a GPU hidden by
#   CUDA_VISIBLE_DEVICES= makes it fail with that reason;
#   train --device cuda (the seed command line, 1 epoch); --resume on the GPU ends
#   bitwise equal to an uninterrupted run; cuda:N beyond the GPUs is a clear error;
#   torchrun --nproc_per_node 1 with NCCL; the generated tests/test_commands.py with --gpu.
set -uo pipefail

python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=benchmarks/gpu_checks/bake.sh
source "$(dirname "$0")/bake.sh"
project=$(bake_project "$work" test_commands.py) || exit 1
cd "$project" || exit 1
export PYTHONPATH="$project/src" PYTHONUNBUFFERED=1
unset PROJECT_SSH_PORT PROJECT_JUPYTER_PORT

failed=0
check() {  # check NAME EXPECTED_STATUS COMMAND...: run it, show its output, compare the status
    local name=$1 expected=$2
    shift 2
    echo "=== $name: $*"
    "$@"
    local status=$?
    if [ "$status" -ne "$expected" ]; then
        echo "!!! $name: exit status $status, expected $expected"
        failed=1
    fi
}
expect_in() {  # expect_in NAME FILE TEXT: FILE contains TEXT
    if ! grep -qF -- "$3" "$2"; then
        echo "!!! $1: '$3' not in the output"
        failed=1
    fi
}

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
"$python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_arch_list())"

start=$(date +%s%N)
check doctor 0 "$python" -m dynamic_model.doctor --require-gpu
echo "doctor --require-gpu took $((($(date +%s%N) - start) / 1000000)) ms"
check doctor-json 0 sh -c "\"$python\" -m dynamic_model.doctor --json --require-gpu >'$work/doctor.json'"
"$python" -c "import json, sys; r = json.load(open(sys.argv[1])); print('json ok:', r['ok']); assert r['ok']" \
    "$work/doctor.json" || failed=1
CUDA_VISIBLE_DEVICES= check doctor-hidden-gpu 1 sh -c "\"$python\" -m dynamic_model.doctor --require-gpu >'$work/hidden.txt'"
cat "$work/hidden.txt"
expect_in doctor-hidden-gpu "$work/hidden.txt" "hides every GPU"

check train-seed-command 0 "$python" -m dynamic_model.train --device cuda --batch-size 64 --epochs 1
check train-whole 0 "$python" -m dynamic_model.train --device cuda --epochs 2 --checkpoint-dir "$work/whole"
check train-first 0 "$python" -m dynamic_model.train --device cuda --epochs 1 --checkpoint-dir "$work/split"
check train-resume 0 "$python" -m dynamic_model.train --device cuda --epochs 2 --checkpoint-dir "$work/split" --resume
"$python" - "$work/whole/latest.pt" "$work/split/latest.pt" <<'EOF' || failed=1
import sys

import torch

whole, split = (torch.load(path, weights_only=True) for path in sys.argv[1:])
differing = [name for name, tensor in whole["model"].items() if not torch.equal(tensor, split["model"][name])]
print("resume on cuda bitwise equal:", not differing, differing)
assert not differing
EOF
count=$("$python" -c "import torch; print(torch.cuda.device_count())")
check train-missing-gpu 2 "$python" -m dynamic_model.train --device "cuda:$count" --epochs 1

check torchrun-nccl 0 sh -c "\"$python\" -m torch.distributed.run --standalone --nproc_per_node 1 \
    -m dynamic_model.train --device cuda --epochs 1 --checkpoint-dir '$work/ddp' >'$work/ddp.txt'"
cat "$work/ddp.txt"
expect_in torchrun-nccl "$work/ddp.txt" "on 1 processes on cuda (nccl)"

check generated-tests 0 "$python" -m pytest -p dynamic_model.testing.plugin --gpu -q -rs \
    -p no:cacheprovider tests/test_commands.py

if [ "$failed" -ne 0 ]; then
    echo "commands_gpu: FAILED"
    exit 1
fi
echo "commands_gpu: all checks passed"
