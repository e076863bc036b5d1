#!/usr/bin/env bash
# GPU checks of the doctor and train commands (issue 7), on a machine with an NVIDIA GPU.
#
#   bash benchmarks/gpu_checks/commands_gpu.sh [--dry-run]    # or through all.sh
#
# Needs a CUDA build of torch in $PYTHON (default: python3), and pytest for the
# generated tests. No network: the project is baked as bake.sh says, and the commands
# run as `python -m dynamic_model.<command>` from its src folder. About 3 minutes.
# Checks: doctor --require-gpu passes (and its time), --json says ok, a GPU hidden by
# CUDA_VISIBLE_DEVICES= makes it fail with that reason; train --device cuda (the seed
# command line, 1 epoch); --resume on the GPU ends bitwise equal to an uninterrupted
# run; cuda:N beyond the GPUs is a clear error; torchrun --nproc_per_node 1 with NCCL;
# DDP over gloo with 2 ranks sharing the one GPU (ddp_one_device.py), and what train
# does with 2 ranks and 1 GPU; train's throughput on cuda against cpu (throughput.py);
# the generated tests/test_commands.py with --gpu. In a dry run the train checks that
# take a device run on the CPU.
set -uo pipefail
# shellcheck source=benchmarks/gpu_checks/lib.sh
source "$(dirname "$0")/lib.sh" "$@"
bake test_commands.py
cd "$project" || exit 1
unset PROJECT_SSH_PORT PROJECT_JUPYTER_PORT
torchrun=("$python" -m torch.distributed.run --standalone)
# A dry run trains on fewer samples: it checks the command lines, not the numbers.
samples=()
throughput_options=()
if [ "$dry_run" = 1 ]; then samples=(--samples 1024); throughput_options=(--batch-size 64); fi

collect_tests tests/test_commands.py

check "doctor --require-gpu" --cuda -- \
    "$python" -m dynamic_model.doctor --require-gpu
check "doctor --json --require-gpu" --cuda -- \
    "${stdout_to[@]}" "$work/doctor.json" "$python" -m dynamic_model.doctor --json --require-gpu
check "doctor --json says ok" --cuda --expect "^json ok: True" -- "$python" -c \
    'import json, sys; r = json.load(open(sys.argv[1])); print("json ok:", r["ok"]); assert r["ok"]' \
    "$work/doctor.json"
check "doctor --require-gpu with CUDA_VISIBLE_DEVICES=''" --cuda --status 1 \
    --expect "hides every GPU" -- \
    env CUDA_VISIBLE_DEVICES= "$python" -m dynamic_model.doctor --require-gpu

check "train --device cuda (the seed command line)" --cuda --expect "trained 1 epochs on cuda" -- \
    "$python" -m dynamic_model.train --device cuda --batch-size 64 --epochs 1
check "train 2 epochs" -- "$python" -m dynamic_model.train --device "$device" --epochs 2 \
    --checkpoint-dir "$work/whole" "${samples[@]}"
check "train 1 epoch" -- "$python" -m dynamic_model.train --device "$device" --epochs 1 \
    --checkpoint-dir "$work/split" "${samples[@]}"
check "train --resume to 2 epochs" -- "$python" -m dynamic_model.train --device "$device" \
    --epochs 2 --checkpoint-dir "$work/split" --resume "${samples[@]}"
check "resumed run bitwise equal to the whole run" --expect "bitwise equal: True" -- \
    "$python" - "$work/whole/latest.pt" "$work/split/latest.pt" <<'EOF'
import sys

import torch

whole, split = (torch.load(path, weights_only=True) for path in sys.argv[1:])
differing = [name for name, tensor in whole["model"].items() if not torch.equal(tensor, split["model"][name])]
print("resumed on", whole["model"]["head.weight"].device, "bitwise equal:", not differing, differing)
assert not differing
EOF
gpus=0
if [ "$dry_run" = 0 ]; then gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())'); fi
check "train --device cuda:$gpus, beyond the GPUs" --cuda --status 2 --expect "does not exist" -- \
    "$python" -m dynamic_model.train --device "cuda:$gpus" --epochs 1

check "torchrun --nproc_per_node 1, NCCL" --cuda --timeout 90 \
    --expect "on 1 processes on cuda \(nccl\)" -- \
    "${torchrun[@]}" --nproc_per_node 1 -m dynamic_model.train --device cuda --epochs 1 \
    --checkpoint-dir "$work/ddp"
check "DDP over gloo, 2 ranks on one $device device" --timeout 90 --expect "^ddp over gloo ok" -- \
    "${torchrun[@]}" --nproc_per_node 2 "$gpu_checks_dir/ddp_one_device.py" "$device"
check "train --device cuda under torchrun, 2 ranks and 1 GPU: a clear error" --cuda --timeout 90 \
    --status 1 --expect "torchrun started 2 processes on this node, but only 1 CUDA device" -- \
    env CUDA_VISIBLE_DEVICES=0 "${torchrun[@]}" --nproc_per_node 2 -m dynamic_model.train \
    --device cuda --epochs 1
check "train --device auto under torchrun, 2 ranks and 1 GPU: the CPU over gloo" --cuda --timeout 90 \
    --expect "on 2 processes on cpu \(gloo\)" -- \
    env CUDA_VISIBLE_DEVICES=0 "${torchrun[@]}" --nproc_per_node 2 -m dynamic_model.train \
    --device auto --epochs 1

check "train throughput, $device against cpu" --timeout 150 --expect "relative to cpu" -- \
    "$python" "$gpu_checks_dir/throughput.py" "${samples[@]}" \
    "${throughput_options[@]}" "$device" cpu

check "generated tests/test_commands.py with --gpu" --cuda --needs pytest --timeout 150 -- \
    "${pytest_command[@]}" --gpu -q -rs tests/test_commands.py

finish_checks
