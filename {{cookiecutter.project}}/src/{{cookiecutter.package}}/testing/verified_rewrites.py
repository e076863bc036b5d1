"""A rewrite is printed as working only once it has run: built, exported, and compared with eager.

:func:`verify` builds the rewritten function (:class:`.rewrites.Rewrite`, or a
library's own setting: :class:`LibrarySetting`), puts it in place of the model's method
for the duration of the check, exports the model with it, and runs the program
against the unchanged eager model on the given inputs and on
:data:`OTHER_INPUT_SETS` more drawn like them: its outputs, and the gradients of the
trainable parameters (and differentiated inputs) under a fixed random cotangent, one
:func:`.runs.run_once` each. The inputs must also take the other
side of the decision (another outcome of the branch, an empty and a non-empty
token set): the :class:`Verification` says which sides its inputs took, and a side
no input took is reported as not verified.

Building runs the user's own function, rewritten, in its own module's globals: the
code is the user's, as the model's forward is.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import io
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import control_flow, data_dependence
from .branches import other_sides
from .comparison import close_mismatch
from .control_flow import Location, display_path
from .failures import CheckFailure
from .rewrites import Rewrite
from .runs import Cotangents, Run, run_once
from .subject import Subject
from .torch_text import in_words

__all__ = [
    "OTHER_INPUT_SETS",
    "InputSets",
    "LibrarySetting",
    "Varied",
    "Verdict",
    "Verification",
    "Watch",
    "library_settings",
    "verification_inputs",
    "verify",
]

# Input sets drawn besides the given ones: three draws at each of the scales below and
# three whose rows are all one row, enough for a branch on a mean, a router's expert
# loads or a confidence threshold in the tests' models to take both sides; the
# verdict says when the inputs did not.
OTHER_INPUT_SETS = 12
# One fixed random cotangent per output, the same for the eager model and the program.
_COTANGENTS = Cotangents(seed=0)
# Scales of the drawn inputs (standard normal times these): small, unit and large
# activations, where routers saturate and thresholds flip.
_SCALES = (0.3, 1.0, 10.0)


class Verdict(enum.Enum):
    VERIFIED = "verified"
    ONE_SIDE = "verified on one side only"
    NOT_EXPORTED = "does not export"
    DIFFERS = "differs from eager"
    NOT_BUILT = "could not be built"


@dataclass(frozen=True)
class LibrarySetting:
    """A library's own switch that takes the decision out: ``apply`` sets it on the
    model and returns what puts it back; ``explanation`` and ``code`` say it to the user."""

    explanation: str
    code: str
    apply: Callable[[nn.Module], Callable[[], None]]


class Varied(enum.Enum):
    """What the input sets of a verification must vary at a watched line."""

    BRANCH = "the branch's outcome"
    EMPTY = "whether the size made there is 0"
    COUNT = "the size made there (a loop's number of passes)"


@dataclass(frozen=True)
class Watch:
    """The line whose decision the inputs must vary, and what of it (:class:`Varied`)."""

    location: Location
    varied: Varied


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` found: ``verdict`` over ``input_sets`` input sets, ``seen`` the
    sides they took, ``problem`` why it failed (empty when verified)."""

    explanation: str
    code: str
    verdict: Verdict
    input_sets: int
    seen: str
    problem: str = ""

    def lines(self) -> list[str]:
        if self.verdict is Verdict.VERIFIED:
            head = (
                f"Verified rewrite (the check built it, exported it, and compared its outputs "
                f"and gradients with eager's on {self.input_sets} input sets, "
                f"{self.seen}): {self.explanation}"
            )
        elif self.verdict is Verdict.ONE_SIDE:
            head = (
                f"Rewrite verified on one side only (exported, its outputs and "
                f"gradients equal to eager's on {self.input_sets} input sets, but {self.seen}: "
                f"the other side is not verified): {self.explanation}"
            )
        else:
            head = f"Rewrite, not verified ({self.problem}): {self.explanation}"
        return [head, self.code]


@dataclass(frozen=True)
class InputSets:
    """The input sets a rewrite is compared on, with the eager model's output on each and
    what the watched line decided there (``watch``): computed once for all rewrites."""

    arguments: tuple
    kwargs: dict[str, Any]
    watch: Watch | None
    sets: tuple[tuple, ...]
    eager: tuple[tuple[int, Any], ...]
    sides: tuple[tuple[Any, ...], ...]
    searched: str  # what the branch search added, for the report


def verification_inputs(
    module: nn.Module,
    arguments: tuple,
    kwargs: dict[str, Any],
    watch: Watch | None,
    failure: type[CheckFailure],
) -> InputSets:
    """The given input set, :data:`OTHER_INPUT_SETS` drawn like it, and, when none of them
    took the other side of the watched branch, one found by the branch search
    (:func:`.branches.other_sides`) on it."""
    sets = [arguments, *_drawn_like(arguments)]
    eager, sides = [], []

    def run(number: int, inputs: tuple) -> None:
        try:
            output, side = _eager(Subject(module, inputs, kwargs, failure=failure), watch)
        except Exception:  # a drawn input the model refuses is no input set
            if number == 0:
                raise
            return
        eager.append((number, output))
        sides.append(tuple(side))

    for number, inputs in enumerate(sets):
        run(number, inputs)
    searched = ""
    if watch is not None and watch.varied is Varied.BRANCH and not _sides_text(sides, watch)[1]:
        moved = _other_side(module, arguments, kwargs, watch.location, failure)
        if isinstance(moved, tuple):
            sets.append(moved)
            run(len(sets) - 1, moved)
            searched = "the last found by the branch search"
        else:
            searched = f"the branch search found no other side: {moved}"
    return InputSets(arguments, kwargs, watch, tuple(sets), tuple(eager), tuple(sides), searched)


def _other_side(
    module: nn.Module,
    arguments: tuple,
    kwargs: dict[str, Any],
    location: Location,
    failure: type[CheckFailure],
) -> tuple | str:
    """Inputs on which the branch at ``location`` goes the other way, moved from
    ``arguments`` along its margin; else why none was found."""
    leaves, spec = pytree.tree_flatten(arguments)
    movable = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    ]
    if not movable:
        return "no floating-point input to move"
    subject = Subject(module, arguments, kwargs, failure=failure)

    def evaluate(values: list[torch.Tensor]) -> Any:
        moved = list(leaves)
        for index, value in zip(movable, values, strict=True):
            moved[index] = value
        try:
            return module(*pytree.tree_unflatten(moved, spec), **kwargs)
        finally:
            subject.reset()

    values = [leaves[i].detach() for i in movable]
    eps = torch.finfo(values[0].dtype).eps ** 0.5
    try:
        sides = other_sides(evaluate, values, range(len(values)), eps=eps)
    except Exception as error:  # the search is a help here: say why it stopped
        return in_words(error)
    side = next((side for side in sides if side.location == location), None)
    if side is None:
        return "the search saw no decision there"
    if not side.found or side.values is None:
        return side.reason
    moved = list(leaves)
    for index, value in zip(movable, side.values, strict=True):
        moved[index] = value.detach().to(leaves[index].dtype)
    return pytree.tree_unflatten(moved, spec)


def verify(
    rewrite: Rewrite | LibrarySetting,
    module: nn.Module,
    inputs: InputSets,
    *,
    dynamic_shapes: Any,
    strict: bool,
    failure: type[CheckFailure],
) -> Verification:
    """Build ``rewrite`` into ``module``, export it with the given input set, and compare
    it with the eager ``module`` on every input set of ``inputs``."""
    arguments, kwargs, watch, sets = inputs.arguments, inputs.kwargs, inputs.watch, inputs.sets
    eager_outputs, sides = inputs.eager, inputs.sides

    def verdict(kind: Verdict, seen: str = "", problem: str = "") -> Verification:
        return Verification(rewrite.explanation, rewrite.code, kind, len(sets), seen, problem)

    restore = _applied(rewrite, module)
    if isinstance(restore, str):
        return verdict(Verdict.NOT_BUILT, problem=restore)
    try:
        subject = Subject(module, arguments, kwargs, failure=failure)
        fresh = subject.fresh_inputs()
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                program = torch.export.export(
                    module, fresh.args, fresh.kwargs, dynamic_shapes=dynamic_shapes, strict=strict
                )
        except Exception as error:  # the rewrite's own failure is the verdict
            return verdict(
                Verdict.NOT_EXPORTED, problem=f"torch.export refused it: {in_words(error)}"
            )
        finally:
            subject.reset()
    finally:
        restore()
    exported = program.module()
    for number, eager in eager_outputs:
        subject = Subject(module, sets[number], kwargs, failure=failure)
        try:
            produced = run_once(subject, _COTANGENTS, call=exported)
        except Exception as error:  # the program's own failure is the verdict
            return verdict(
                Verdict.DIFFERS,
                problem=f"its program failed on input set {number}: {in_words(error)}",
            )
        finally:
            subject.reset()
        mismatch = _mismatch(eager, produced)
        if mismatch:
            return verdict(Verdict.DIFFERS, problem=f"on input set {number}: {mismatch}")
    seen, both = _sides_text(sides, watch)
    if inputs.searched:
        seen += f" ({inputs.searched})"
    return verdict(Verdict.VERIFIED if both else Verdict.ONE_SIDE, seen)


# transformers' experts implementations without a size that depends on the data, the
# dense one first: every token's k experts as batched matrix products.
_EXPERTS_IMPLEMENTATIONS = ("batched_mm", "grouped_mm")


def library_settings(module: nn.Module) -> list[LibrarySetting]:
    """The libraries' own switches that take a data-dependent decision out of ``module``:
    transformers' mixture-of-experts blocks with the eager experts (a loop over the
    experts hit, each on the tokens routed to it) run as ``batched_mm`` or
    ``grouped_mm`` instead."""
    configs = {
        id(config): config
        for sub in module.modules()
        if getattr(config := getattr(sub, "config", None), "_experts_implementation", None)
        == "eager"
    }
    if not configs:
        return []

    def switched(implementation: str) -> Callable[[nn.Module], Callable[[], None]]:
        def apply(_: nn.Module) -> Callable[[], None]:
            for config in configs.values():
                config._experts_implementation = implementation

            def restore() -> None:
                for config in configs.values():
                    config._experts_implementation = "eager"

            return restore

        return apply

    config_class = type(next(iter(configs.values()))).__name__
    return [
        LibrarySetting(
            f"transformers runs the experts as `{implementation}`, with no loop over the "
            "experts hit and no size that depends on the routing, when the model is built with",
            f"    config = {config_class}(..., "
            f'experts_implementation="{implementation}")\n'
            f'    # or: from_pretrained(..., experts_implementation="{implementation}")',
            switched(implementation),
        )
        for implementation in _EXPERTS_IMPLEMENTATIONS
    ]


def _drawn_like(arguments: tuple) -> list[tuple]:
    """Input sets with the shapes and dtypes of ``arguments``, floating tensors drawn anew
    (from a generator of their own: the test's RNG is left as it was)."""
    generator = torch.Generator().manual_seed(0)
    drawn = []
    for number in range(OTHER_INPUT_SETS):
        scale = _SCALES[number % len(_SCALES)]
        # Every row the same: a router sends all tokens to the same k experts, so the
        # others receive none (the load no random batch of a few tokens gives).
        one_row = number % 4 == 3

        def draw(leaf: Any, scale: float = scale, one_row: bool = one_row) -> Any:
            if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
                return leaf
            shape = leaf.shape[-1:] if one_row and leaf.dim() > 1 else leaf.shape
            values = torch.randn(shape, generator=generator, dtype=leaf.dtype) * scale
            values = values.expand(leaf.shape).clone()
            return values.to(leaf.device).requires_grad_(leaf.requires_grad)

        drawn.append(pytree.tree_map(draw, arguments))
    return drawn


def _eager(subject: Subject, watch: Watch | None) -> tuple[Run, list[Any]]:
    """The eager outputs and gradients on the subject's inputs (:func:`.runs.run_once`),
    and what the watched line decided."""
    try:
        with control_flow.record_decisions() as log, data_dependence.tracing() as trace:
            run = run_once(subject, _COTANGENTS)
    finally:
        subject.reset()
    if watch is None:
        return run, []
    if watch.varied is Varied.BRANCH:
        return run, [bool(d.value) for d in log if d.location == watch.location]
    source = trace.source_at(watch.location)
    return run, list(source.sizes if source else ())


def _sides_text(sides: Sequence[Sequence[Any]], watch: Watch | None) -> tuple[str, bool]:
    if watch is None:
        return "on which nothing was to vary", True
    where = display_path(watch.location.filename) + f":{watch.location.line}"
    if watch.varied is Varied.EMPTY:
        empty = sum(0 in side for side in sides)
        full = sum(any(size > 0 for size in side) for side in sides)
        text = f"on which the size made at {where} was 0 in {empty} and above 0 in {full}"
        return text, bool(empty and full)
    if watch.varied is Varied.COUNT:
        counts = sorted({size for side in sides for size in side})
        spread = (
            f"{counts[0]} to {counts[-1]}"
            if len(counts) > 1
            else f"always {counts[0]}"
            if counts
            else "never"
        )
        return f"on which the size made at {where} was {spread}", len(counts) > 1
    true = sum(True in side for side in sides)
    false = sum(False in side for side in sides)
    text = f"on which the branch at {where} was True in {true} and False in {false}"
    return text, bool(true and false)


def _applied(rewrite: Rewrite | LibrarySetting, module: nn.Module) -> Callable[[], None] | str:
    """Put the rewrite in place in ``module``; what puts the model back, or why it cannot."""
    if isinstance(rewrite, LibrarySetting):
        return rewrite.apply(module)
    targets = [
        (owner, name, value)
        for owner in module.modules()
        for name, value in _functions(owner)
        if value.__code__.co_filename == rewrite.filename
        and value.__code__.co_firstlineno == rewrite.function_line
    ]
    if not targets:
        where = f"{display_path(rewrite.filename)}:{rewrite.function_line}"
        return f"no method of the model runs the function at {where}"
    function = targets[0][2]
    if function.__code__.co_freevars:
        return "the function uses variables of an enclosing scope (a closure, or super())"
    shown = f"<rewrite of {display_path(rewrite.filename)}:{rewrite.function_line}>"
    namespace: dict[str, Any] = {}
    try:
        code = compile(ast.Module(body=[rewrite.function], type_ignores=[]), shown, "exec")
        exec(code, function.__globals__, namespace)  # the user's own function, rewritten
    except Exception as error:  # a decorator that refuses the rebuilt function
        return f"defining it failed: {in_words(error)}"
    rebuilt = namespace[rewrite.function.name]
    undo: list[Callable[[], None]] = []
    for owner, name, value in targets:
        if name in vars(owner) and not isinstance(value, types.FunctionType | types.MethodType):
            continue
        if name in vars(owner):  # a function held by the instance (a wrapped function)
            vars(owner)[name] = rebuilt
            undo.append(
                lambda owner=owner, name=name, value=value: vars(owner).__setitem__(name, value)
            )
        else:
            vars(owner)[name] = types.MethodType(rebuilt, owner)
            undo.append(lambda owner=owner, name=name: vars(owner).pop(name))
    return lambda: [step() for step in undo] and None


def _functions(owner: nn.Module) -> Iterator[tuple[str, types.FunctionType]]:
    """The plain functions ``owner`` runs: its class's methods and functions it holds."""
    seen = set()
    for holder in (vars(owner), *(vars(cls) for cls in type(owner).__mro__)):
        for name, value in holder.items():
            if isinstance(value, types.FunctionType) and name not in seen:
                seen.add(name)
                yield name, value


def _mismatch(eager: Run, produced: Run) -> str:
    """The first value that differs; a gradient that is ``None`` on one side (the parameter
    was not used) equals zeros on the other (used on an empty selection)."""
    for key in [*eager.values, *(k for k in produced.values if k not in eager.values)]:
        left, right = eager.values.get(key), produced.values.get(key)
        if left is None and isinstance(right, torch.Tensor):
            left = torch.zeros_like(right)
        elif right is None and isinstance(left, torch.Tensor):
            right = torch.zeros_like(left)
        difference = close_mismatch(str(key), left, right, None, None, ("eager", "rewritten"))
        if difference:
            return difference.description
    return ""
