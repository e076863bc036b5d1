"""Example models whose computation graph is decided by the data at run time.

Each forward uses ordinary Python control flow on tensor values (``if``, ``for``,
``while``, recursion). Autograd records only the path that was taken, so the
gradient is the gradient of that path. That is what makes these models easy to
write and debug (``print`` and ``breakpoint()`` work anywhere), and also what makes
them hard for tools that assume one fixed graph: ``torch.compile`` breaks the graph
at each data-dependent decision, and ``torch.export`` refuses them unless the
branches are rewritten with ``torch.cond``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def conditional_model(x: torch.Tensor, flag: bool) -> torch.Tensor:
    """``sum(x**2)`` when ``flag`` is true, else ``sum(x**3)``.

    Dynamic because a plain Python argument picks the graph: the two calls build
    different graphs and get different gradients (``2x`` or ``3x**2``).
    """
    if flag:
        return (x**2).sum()
    return (x**3).sum()


def forward_with_condition(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """``x**2`` when the mean of ``x`` exceeds ``threshold``, else ``x**3``.

    Dynamic because the branch is decided by a tensor value (``Tensor.__bool__``),
    so the same function differentiates differently for different inputs.
    """
    if x.mean() > threshold:
        return x**2
    return x**3


class MeanGatedNet(nn.Module):
    """A linear layer followed by ReLU or tanh, chosen by the sign of the mean activation.

    Dynamic because the activation is picked per call from the data: one batch may
    go through ``relu`` and the next through ``tanh``.
    """

    def __init__(self, in_features: int = 8, out_features: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if h.mean() > 0:
            return torch.relu(h)
        return torch.tanh(h)


class PerSampleNet(nn.Module):
    """Applies ReLU or tanh to each sample separately, by the sign of that sample's sum.

    Dynamic because the loop runs over the batch and each sample takes its own
    branch. The outputs are collected and stacked instead of written into ``x`` in
    place: an in-place write into a leaf that requires grad is an error, and into
    an intermediate it would overwrite values autograd still needs.
    """

    def __init__(self, features: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        rows = [torch.relu(row) if row.sum() > 0 else torch.tanh(row) for row in h]
        return torch.stack(rows)


class DynamicNet(nn.Module):
    """A residual block applied until the activations are small, at most ``max_steps`` times.

    Dynamic because the number of loop iterations depends on the data: the loop
    stops as soon as the mean absolute activation drops below ``tolerance``, so
    the depth of the graph, and the number of times ``block`` contributes to its
    own gradient, changes from batch to batch.
    """

    def __init__(
        self,
        in_features: int = 16,
        hidden: int = 32,
        out_features: int = 4,
        max_steps: int = 4,
        tolerance: float = 0.5,
    ) -> None:
        super().__init__()
        self.encoder = nn.Linear(in_features, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, out_features)
        self.max_steps = max_steps
        self.tolerance = tolerance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        for _ in range(self.max_steps):
            if h.abs().mean() < self.tolerance:
                break
            h = h + 0.5 * self.block(h)
        return self.head(h)


class RecursiveNet(nn.Module):
    """Reduces a sequence to one vector by recursive pairwise merging.

    Dynamic because the recursion depth and the shape of the merge tree follow
    the sequence length of each input: a sequence of 5 steps is merged as
    ``((1, 2), (3, (4, 5)))``, one of 8 steps as a balanced tree of depth 3.
    Input shape: ``(batch, steps, features)``; output: ``(batch, features)``.
    """

    def __init__(self, features: int = 8) -> None:
        super().__init__()
        self.merge = nn.Linear(2 * features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.size(1) == 0:
            shape = tuple(x.shape)
            raise ValueError(f"expected a non-empty (batch, steps, features) tensor, got {shape}")
        return self._reduce(x)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        steps = x.size(1)
        if steps == 1:
            return x[:, 0]
        middle = steps // 2
        left = self._reduce(x[:, :middle])
        right = self._reduce(x[:, middle:])
        return torch.tanh(self.merge(torch.cat([left, right], dim=-1)))


class TopKMixture(nn.Module):
    """A mixture of experts: each row goes through the ``k`` experts its gate scores highest.

    Dynamic because the routing is decided by the data: which experts run, and on
    how many rows each, changes from batch to batch (an expert no row picks does not
    run at all). The chosen experts' outputs are mixed with the gate's softmax
    weights, so the gate is trained through the mixture; the choice itself (top-k) is
    piecewise constant, with jumps where two gate scores tie.
    """

    def __init__(self, features: int = 8, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(features, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(features, features), nn.Tanh()) for _ in range(experts)
        )
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x).softmax(dim=-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows, slot = (chosen == index).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, weights[rows, slot, None] * expert(x[rows]))
        return out


class EarlyExitNet(nn.Module):
    """Blocks with a classifier after each; stops at the first one confident on every row.

    Dynamic because the depth is decided by the data: a batch the first classifier is
    sure of stops there, a hard one goes through every block. The confidence is the
    largest softmax probability, computed in float32 as mixed-precision code does
    (``logits.float()``); the check widens it to float64 like everything else.
    """

    def __init__(
        self, features: int = 8, classes: int = 3, blocks: int = 3, confidence: float = 0.9
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(features, features), nn.Tanh()) for _ in range(blocks)
        )
        self.exits = nn.ModuleList(nn.Linear(features, classes) for _ in range(blocks))
        self.confidence = confidence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block, exit_head in zip(self.blocks, self.exits, strict=True):
            h = block(h)
            logits = exit_head(h)
            probabilities = torch.softmax(logits.float(), dim=-1)
            if probabilities.max(dim=-1).values.min() > self.confidence:
                break
        return logits


class CheckpointedNet(nn.Module):
    """A residual block repeated ``steps`` times under activation checkpointing.

    The block's activations are not kept for backward but recomputed
    (``torch.utils.checkpoint`` with ``use_reentrant=False``, which works with
    ``torch.autograd.grad`` and with data-dependent code inside the block): memory
    for compute, as in long sequence models.
    """

    def __init__(self, features: int = 8, steps: int = 3) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(features, features), nn.Tanh())
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.steps):
            h = h + checkpoint(self.block, h, use_reentrant=False)
        return h


class CondGatedNet(MeanGatedNet):
    """``MeanGatedNet`` with its branch written as ``torch.cond``: it exports.

    ``torch.export`` records one graph for every input, so it refuses the Python
    ``if h.mean() > 0`` of ``MeanGatedNet`` (the branch depends on the data).
    ``torch.cond`` records both branches in the graph and picks one when the program
    runs, so this model exports, compiles without a graph break, and computes what
    ``MeanGatedNet`` computes, outputs and gradients, on both sides of the branch.
    Both branches take the same tensors and return tensors of the same shape and dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return torch.cond(h.mean() > 0, torch.relu, torch.tanh, (h,))


class RoutedRefineNet(nn.Module):
    """Rows whose encoding is large go through a refinement layer; the other rows skip it.

    Dynamic because the routing is decided by the data, row by row: ``refine`` runs
    only when some row of the batch needs it, so its parameters get no gradient from a
    batch where none does. Training never changes them unless batches take that side;
    under ``DistributedDataParallel`` a rank whose batch has no such row leaves them
    unused, which DDP must be told about (``find_unused_parameters=True``). Each row's
    output depends on that row only, so splitting a batch over ranks computes what
    the whole batch computes.
    """

    def __init__(self, features: int = 8, classes: int = 3, threshold: float = 2.0) -> None:
        super().__init__()
        self.encoder = nn.Linear(features, features)
        self.refine = nn.Linear(features, features)
        self.head = nn.Linear(features, classes)
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        hard = h.norm(dim=-1) > self.threshold
        if hard.any():
            rows = hard.nonzero(as_tuple=True)[0]
            h = h.index_add(0, rows, torch.tanh(self.refine(h[rows])))
        return self.head(h)
