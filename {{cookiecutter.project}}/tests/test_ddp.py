"""The example models under real DistributedDataParallel: one process per rank, gloo on the CPU.

``ddp_check(model, batch_0, batch_1)`` trains the model for a few steps in two ranks
and, alone, on both batches at once, and fails naming parameters unused on some
ranks (with the decision and each rank's outcome, and what
``find_unused_parameters=True`` costs here), collectives called differently per rank,
ranks that decide differently on the same samples, and gradients that differ from
the single process. This test process never joins the process group, and no process
of the check outlives it. The NCCL variant runs with ``pytest --gpu``.
"""

import pytest
import torch

from {{ cookiecutter.package }} import PerSampleNet, RoutedRefineNet
from {{ cookiecutter.package }}.testing.ddp_check import UnusedParameters


def test_per_sample_branches_train_as_one_process(ddp_check):
    torch.manual_seed(0)
    result = ddp_check(PerSampleNet(), torch.randn(4, 8), torch.randn(4, 8))
    assert not result.find_unused_needed
    assert result.static_graph_safe


# Slow: the failure measures what find_unused_parameters=True costs, in more DDP runs.
@pytest.mark.slow
def test_the_refine_layer_needs_find_unused_parameters(ddp_check):
    torch.manual_seed(0)
    model, x = RoutedRefineNet(), torch.randn(4, 8)
    with pytest.raises(UnusedParameters) as failure:
        ddp_check(model, 3 * x, 0.1 * x)  # rank 1's batch has no hard row
    assert failure.value.parameters == ("refine.weight", "refine.bias")
    result = ddp_check(model, 3 * x, 0.1 * x, find_unused_parameters=True)
    assert result.find_unused_needed
    assert not result.static_graph_safe


def test_nccl_on_the_gpus(gpu, ddp_check):
    model, x = PerSampleNet(), torch.randn(4, 8)
    world_size = min(torch.cuda.device_count(), 2)
    ddp_check(model, x, world_size=world_size, backend="nccl")
