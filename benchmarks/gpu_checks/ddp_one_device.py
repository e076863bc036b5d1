"""DistributedDataParallel over gloo with every rank on the same device.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/gpu_checks/ddp_one_device.py cuda      # or cpu

NCCL refuses two ranks on one GPU; gloo reduces CUDA tensors too, so one GPU can
stand in for several. Each rank trains a `DynamicNet` (the baked project's) on
batches of its own: rank 0's first batch is too small for the residual block to run,
so that step DDP must account for parameters one rank did not use
(``find_unused_parameters=True``). Checks that the ranks end with bitwise equal
parameters, and that these match one process applying the ranks' averaged gradients
(an unused parameter's gradient counted as zero). Prints "ddp over gloo ok" on rank 0.
"""

from __future__ import annotations

import copy
import gc
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dynamic_model import DynamicNet
from torch.nn.parallel import DistributedDataParallel

STEPS = 4
LR = 0.1


def batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    scale = 0.01 if (rank, step) == (0, 0) else 3.0  # small inputs: the block is skipped
    inputs = torch.randn(32, 16, generator=generator) * scale
    labels = torch.randint(0, 4, (32,), generator=generator)
    return inputs.to(device), labels.to(device)


def averaged_by_hand(model: DynamicNet, world_size: int, device: torch.device) -> DynamicNet:
    """The same training in one process: each step, the ranks' gradients averaged."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        grads = [torch.zeros_like(parameter) for parameter in model.parameters()]
        for rank in range(world_size):
            model.zero_grad(set_to_none=True)
            inputs, labels = batch(rank, step, device)
            F.cross_entropy(model(inputs), labels).backward()
            for total, parameter in zip(grads, model.parameters(), strict=True):
                if parameter.grad is not None:
                    total += parameter.grad / world_size
        for parameter, grad in zip(model.parameters(), grads, strict=True):
            parameter.grad = grad
        optimizer.step()
    return model


def main(device_type: str) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = DynamicNet().to(device)
    initial = copy.deepcopy(model)
    block_runs: list[int] = []
    model.block.register_forward_hook(lambda *_: block_runs.append(1))
    runs_per_step = []
    network = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=True,
    )
    optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    for step in range(STEPS):
        runs_before = len(block_runs)
        inputs, labels = batch(rank, step, device)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(network(inputs), labels).backward()
        optimizer.step()
        runs_per_step.append(len(block_runs) - runs_before)
    print(f"rank {rank} on {device}: residual block runs per step {runs_per_step}")
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    # DDP's reducer sits in reference cycles: collect it while the process group and the
    # interpreter are alive, or gloo's threads die at interpreter exit (as in train.py).
    gc.collect()
    dist.destroy_process_group()
    skipped = [runs == 0 for runs in runs_per_step]
    assert skipped == [rank == 0 and step == 0 for step in range(STEPS)], "the block ran otherwise"
    if rank != 0:
        return
    assert all(torch.equal(other, flat) for other in gathered), "the ranks' parameters differ"
    expected = averaged_by_hand(initial, world_size, device)
    reference = torch.nn.utils.parameters_to_vector(expected.parameters()).detach().cpu()
    difference = (reference - flat).abs().max().item()
    print(
        f"{world_size} ranks on {device}: parameters equal; max difference to averaging by hand "
        f"{difference:.3g}"
    )
    torch.testing.assert_close(flat, reference)
    print("ddp over gloo ok")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")
