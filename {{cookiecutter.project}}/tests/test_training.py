"""Every parameter of the example models learns: a few real optimizer steps on one batch.

``training_check(model, (x, y), loss_fn)`` runs five Adam steps on the same batch and
puts everything back afterwards. It fails naming each parameter never given a
gradient (with the branch decision that would give it one), not held by the
optimizer, or not changed; the first NaN or inf with the op that made it; a loss that
does not fall; and, with ``accumulation_steps=k``, micro-batch gradients that do not
add up to the whole batch's. ``pytest -v`` prints each check's report.
"""

import pytest
import torch
from torch import nn

from {{ cookiecutter.package }} import DynamicNet, PerSampleNet, RecursiveNet, RoutedRefineNet
from {{ cookiecutter.package }}.testing.training_check import ParametersWithoutGradient

cross_entropy = nn.CrossEntropyLoss()


def batch(scale: float = 1.0, rows: int = 8, shape: tuple[int, ...] = (8,)):
    return torch.randn(rows, *shape) * scale, torch.randint(0, 3, (rows,))


# model, input scale, input shape after the batch dimension
CASES = {
    "hard rows refined": (RoutedRefineNet, 3.0, (8,)),
    "loop length decided by the data": (
        lambda: DynamicNet(in_features=8, out_features=3, tolerance=0.3),
        4.0,
        (8,),
    ),
    "branch per sample": (PerSampleNet, 1.0, (8,)),
    "recursion": (RecursiveNet, 1.0, (5, 8)),
}


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_learns(training_check, case):
    torch.manual_seed(0)
    make, scale, shape = CASES[case]
    result = training_check(make(), batch(scale, shape=shape), cross_entropy)
    assert result.final_loss < result.losses[0]


def test_a_batch_without_hard_rows_never_trains_the_refine_layer(training_check):
    torch.manual_seed(0)
    with pytest.raises(ParametersWithoutGradient) as failure:
        training_check(RoutedRefineNet(), batch(0.1), cross_entropy)
    assert failure.value.parameters == ("refine.weight", "refine.bias")
    reach = failure.value.reasons["refine.weight"]
    assert (reach.decision.location.source, reach.outcome) == ("if hard.any():", True)


def test_micro_batches_of_per_sample_branches_add_up(training_check):
    torch.manual_seed(0)
    training_check(PerSampleNet(), batch(), cross_entropy, accumulation_steps=4)
