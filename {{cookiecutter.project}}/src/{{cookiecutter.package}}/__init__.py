"""Dynamic PyTorch models: forwards whose graph depends on the data.

The models are imported on first use, so that importing a submodule (the bundled
pytest plugin in ``testing``, say) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models import (
        CondGatedNet,
        DynamicNet,
        MeanGatedNet,
        PerSampleNet,
        RecursiveNet,
        RoutedRefineNet,
        conditional_model,
        forward_with_condition,
    )

__all__ = [
    "CondGatedNet",
    "DynamicNet",
    "MeanGatedNet",
    "PerSampleNet",
    "RecursiveNet",
    "RoutedRefineNet",
    "conditional_model",
    "forward_with_condition",
]


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module(".models", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
