"""Dynamic PyTorch models: forwards whose graph depends on the data."""

from .models import (
    DynamicNet,
    MeanGatedNet,
    PerSampleNet,
    RecursiveNet,
    conditional_model,
    forward_with_condition,
)

__all__ = [
    "DynamicNet",
    "MeanGatedNet",
    "PerSampleNet",
    "RecursiveNet",
    "conditional_model",
    "forward_with_condition",
]
