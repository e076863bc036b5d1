"""One process of a launch: a rank of the group, or the single process.

:func:`child_main` is its life: it leads a process group of its own
(:mod:`.process_tree`), joins the launch's process group, and serves the test's
process's commands (:mod:`.messages`) until told to exit, answering each with events:
every collective the user's code calls (:class:`Spy`), before it runs, and what each
phase computed. What it raises goes to the test's process too, with the user's line.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import calls, decisions
from ..control_flow import Decision, Location, display_path, record_decisions, user_location
from ..frames import Origin, origin
from ..parameter_use import (
    MAX_FLIPS,
    UseRecorder,
    conditional_parameters,
    explain_unreached,
    reached_parameters,
)
from ..processes import dump_stack_on_request
from ..subject import FunctionModule, Subject
from ..trees import map_tensors, named_leaves
from .messages import (
    REFERENCE,
    Alone,
    AloneRuns,
    BackwardDone,
    CollectiveCalled,
    Command,
    Event,
    Exit,
    Explain,
    Explained,
    Files,
    ForwardDone,
    Idle,
    Job,
    Raised,
    Ready,
    Reference,
    ReferenceDone,
    ReferenceStep,
    SamplesDone,
    StepEvent,
    Time,
    Timed,
    Train,
    role_name,
)
from .process_tree import end_descendants, lead_own_group
from .results import DdpCheckFailure

__all__ = ["Spy", "child_main"]

# SGD's step for the default optimizer: small enough that a few steps keep the model
# near where the test put it, large enough that the parameters do change.
DEFAULT_LR = 0.01
# Steps timed per DDP configuration when a cost is measured: Job.timing_rounds blocks
# of TIMED_STEPS, each after WARMUP_STEPS that let DDP rebuild its buckets, the
# configurations alternating; the median of the slowest rank's times is reported.
TIMED_STEPS = 10
WARMUP_STEPS = 2

# The c10d ops by the name of the torch.distributed call that makes them.
_COLLECTIVES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "broadcast_": "broadcast",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather_into_tensor",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all_single",
    "barrier": "barrier",
    "send": "send",
    "recv_": "recv",
}


class Spy(TorchDispatchMode):
    """Reports each collective the user's code calls (a c10d op), before it runs."""

    def __init__(self, report: Callable[[str, Location], None]) -> None:
        super().__init__()
        self.report = report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            location = user_location(sys._getframe())
            if location is not None:  # not DDP's own (its buffer broadcast)
                name = func.__name__.split(".")[0]
                op = f"dist.{_COLLECTIVES[name]}" if name in _COLLECTIVES else f"c10d.{name}"
                self.report(op, location)
        return func(*args, **(kwargs or {}))


def child_main(
    payload: Job | bytes,
    role: int,
    folder: str,
    pipes: tuple[Any, Any],
    *,
    parent: int,
    counted: decisions.ChildRecording | None = None,
) -> None:
    """The life of a rank (or of the single process): join the group, serve commands;
    ``counted``: where its training steps' decisions go (pytest --decisions)."""
    lead_own_group(parent)
    job = payload if isinstance(payload, Job) else pickle.loads(payload)
    files = Files(Path(folder), role)
    stack_file = open(files.stack, "w")  # noqa: SIM115 (faulthandler writes to it until the end)
    dump_stack_on_request(stack_file)
    _Worker(job, role, pipes, files.error, counted).serve(str(files.store))


class _LaunchOver(Exception):
    """The test's process ended the launch while this process waited for it."""


class _Worker:
    """One child process: a rank of the group, or the single process (``REFERENCE``)."""

    def __init__(
        self,
        job: Job,
        role: int,
        pipes: tuple[Any, Any],
        error_file: Path,
        counted: decisions.ChildRecording | None,
    ) -> None:
        self.job = job
        self.role = role
        self.events, self.commands = pipes
        self.error_file = error_file
        self.step = 0
        self.phase = "start-up"
        self.log: Sequence[Decision] | None = None
        self.sent_decisions = 0
        self.counted = counted
        self.coverage = None if counted is None else decisions.child_coverage(counted)

    def send(self, kind: type[Event], **fields: Any) -> None:
        """An event of ``kind`` of this process's step and phase; one of a step, with the
        decisions recorded since the last."""
        if self.log is not None and issubclass(kind, StepEvent):
            fields["decisions"] = tuple(self.log[self.sent_decisions :])
            self.sent_decisions = len(self.log)
        event = kind(rank=self.role, step=self.step, phase=self.phase, **fields)
        self.events.send_bytes(pickle.dumps(event))

    def receive(self) -> Command:
        try:
            command = pickle.loads(self.commands.recv_bytes())
        except (EOFError, OSError):
            raise _LaunchOver from None
        if isinstance(command, Exit):
            raise _LaunchOver
        return command

    def serve(self, store: str) -> None:
        code = 0
        try:
            self._setup(store)
            self.send(Ready)
            while True:
                self._run(self.receive())
                self.send(Idle)
        except _LaunchOver:
            pass
        except Exception as error:
            self._report(error)
            code = 1
        end_descendants(os.getpid())  # DataLoader workers, subprocesses: none outlives it
        if self.counted is not None and self.coverage is not None:
            # Also after a raise: what the steps before it decided. The test's process reads
            # it once this process has ended.
            with contextlib.suppress(Exception):
                decisions.save_for_parent(self.coverage, self.counted)
        # Straight out: no finalizer to wait for (the process group goes with the
        # process, its store with the launch's folder).
        os._exit(code)

    def _run(self, command: Command) -> None:
        match command:
            case Train(options, steps):
                self._train(options, steps)
            case Time(configurations):
                self._time(configurations)
            case Reference(steps):
                self._reference(steps)
            case Explain(rank, names):
                self._explain(rank, names)
            case Alone():
                self._alone()
            case _:
                raise TypeError(f"ddp_check: {command!r} is no command for {role_name(self.role)}")

    def _report(self, error: BaseException) -> None:
        """Tell the test's process what was raised: in a file first, which it reads when it
        finds this process dead without the event (a send cut short), then in the pipe."""
        user = [
            frame
            for frame in traceback.extract_tb(error.__traceback__)
            if origin(frame.filename) not in (Origin.TORCH, Origin.PLUGIN)
        ]
        lines = str(error).strip().splitlines()
        event = Raised(
            rank=self.role,
            step=self.step,
            phase=self.phase,
            type_name=type(error).__name__,
            message=lines[0] if lines else "",
            location=Location(user[-1].filename, user[-1].lineno or 0) if user else None,
            frames=tuple(
                f"{display_path(frame.filename)}:{frame.lineno} in {frame.name}: {frame.line}"
                for frame in user[-4:]
            ),
        )
        with contextlib.suppress(Exception):
            written = self.error_file.with_suffix(".partial")
            written.write_bytes(pickle.dumps(event))
            written.replace(self.error_file)  # whole or absent: the reader never sees half
        with contextlib.suppress(Exception):
            self.events.send_bytes(pickle.dumps(event))

    def _setup(self, store: str) -> None:
        # No torch function mode of the test's process (pytest --decisions) in here.
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        # As torchrun does unless told otherwise: one thread per process.
        torch.set_num_threads(1)
        # Every process of the check runs on this machine: loopback only.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        # DDP's constructor imports torch._dynamo (seconds): a spawned process pays for it
        # here, in the start-up, rather than in its first step (a forked one has it).
        importlib.import_module("torch._dynamo")

        alone = self.role == REFERENCE
        rank, world_size = (0, 1) if alone else (self.role, self.job.world_size)
        if self.job.backend == "nccl":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(
            self.job.backend,
            store=dist.FileStore(store, world_size),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=self.job.timeout),
        )
        target = self.job.target
        if isinstance(target, nn.Module):
            self.module = target.to(self.device)
        else:
            modules = [module.to(self.device) for _, module in calls.reached_modules(target)]
            self.module = FunctionModule(target, tuple(modules))
        self.kwargs = self._on_device(self.job.kwargs)
        batch = self.job.concatenated if alone else self.job.batches[self.role]
        self.subject = Subject(
            target, self._on_device(batch), self.kwargs, failure=DdpCheckFailure, trains=True
        )
        self.parameters = self.subject.parameters

    def _on_device(self, value: Any) -> Any:
        return map_tensors(lambda t: t.to(self.device), value)

    def _loss(self, output: Any) -> torch.Tensor:
        if self.job.loss_fn is not None:
            return self.job.loss_fn(output)
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return output  # a model that returns its loss
        terms = [
            leaf.float().square().mean()
            for _, leaf in named_leaves(output, "")
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad
        ]
        if not terms:
            raise TypeError(
                "ddp_check: the output holds no floating-point tensor that requires grad, so "
                "there is no loss to differentiate: pass loss_fn"
            )
        return torch.stack(terms).sum()

    def _optimizer(self) -> torch.optim.Optimizer:
        tensors = [tensor for _, tensor in self.parameters]
        if self.job.optimizer is None:
            return torch.optim.SGD(tensors, lr=DEFAULT_LR)
        return self.job.optimizer(tensors)

    def _wrap(self, options: Mapping[str, Any]) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(self.module, device_ids=device_ids, **options)

    @contextlib.contextmanager
    def _watched(self, phase: str) -> Iterator[Sequence[Decision]]:
        """Decisions recorded and the user's collectives reported while the block runs."""
        self.phase = phase
        spy = Spy(lambda op, location: self.send(CollectiveCalled, op=op, location=location))
        with record_decisions() as log, spy:
            self.log, self.sent_decisions = log, 0
            try:
                yield log
            finally:
                self.log = None

    def _counted_steps(self) -> contextlib.AbstractContextManager[None]:
        """The training steps' decisions counted for the test (pytest --decisions)."""
        if self.coverage is None:
            return contextlib.nullcontext()
        return decisions.recording(self.coverage, self.coverage.test)

    def _gradients(self) -> dict[str, torch.Tensor | None]:
        return {name: _cpu(tensor.grad) for name, tensor in self.parameters}

    def _train(self, options: Mapping[str, Any], steps: int) -> None:
        self.subject.reset()
        network = self._wrap(options)
        optimizer = self._optimizer()
        for step in range(1, steps + 1):
            self.step = step
            inputs = self.subject.fresh_inputs()
            with self._watched("forward"), self._counted_steps():
                loss = self._loss(network(*inputs.args, **inputs.kwargs))
                self.send(ForwardDone, reached=tuple(reached_parameters(loss, self.parameters)))
            self.receive()  # Go: every rank's forward is in, and their collectives match
            with self._watched("backward"), self._counted_steps():
                loss.backward()
                self.send(BackwardDone, grads=self._gradients())
            self.phase = "optimizer step"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.step = steps + 1
        logs = []
        with torch.no_grad(), self._watched("same-sample forwards"):
            for batch in self.job.batches:
                with record_decisions() as log:
                    network(*self._on_device(batch), **self.kwargs)
                logs.append(tuple(log))
            state = {f"parameter {name}": _cpu(t) for name, t in self.parameters}
            state.update((f"buffer {name}", _cpu(b)) for name, b in self.module.named_buffers())
            self.send(SamplesDone, logs=tuple(logs), state=state)
        del network
        gc.collect()

    def _time(self, configurations: Sequence[tuple[Mapping[str, Any], bool]]) -> None:
        """Timed steps of each DDP configuration ``(options, touch every parameter)``, in
        alternating blocks, so that a machine busy in one block costs every one alike."""
        self.phase = "timed steps"
        tensors = [tensor for _, tensor in self.parameters]
        wall: list[list[float]] = [[] for _ in configurations]
        cpu: list[list[float]] = [[] for _ in configurations]
        for _ in range(self.job.timing_rounds):
            for index, (options, touch_all) in enumerate(configurations):
                self.subject.reset()
                network = self._wrap(options)
                optimizer = self._optimizer()
                for step in range(WARMUP_STEPS + TIMED_STEPS):
                    inputs = self.subject.fresh_inputs()
                    started, cpu_started = time.perf_counter(), time.process_time()
                    loss = self._loss(network(*inputs.args, **inputs.kwargs))
                    if touch_all:  # the rewrite: every parameter in the graph, used or not
                        loss = loss + sum(tensor.sum() for tensor in tensors) * 0.0
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    if step >= WARMUP_STEPS:
                        wall[index].append(time.perf_counter() - started)
                        cpu[index].append(time.process_time() - cpu_started)
                del network
                gc.collect()  # DDP's reducer sits in reference cycles
        self.send(Timed, wall=tuple(map(tuple, wall)), cpu=tuple(map(tuple, cpu)))

    # --- the single process -----------------------------------------------------------

    def _reference(self, steps: int) -> None:
        self.subject.reset()
        optimizer = self._optimizer()
        random = False
        dtype = torch.float32
        for step in range(1, steps + 1):
            self.step = step
            inputs = self.subject.fresh_inputs()
            generator = torch.random.get_rng_state()
            self.phase = "forward"
            with record_decisions() as log:
                loss = self._loss(self.module(*inputs.args, **inputs.kwargs))
            random = random or not torch.equal(generator, torch.random.get_rng_state())
            self.phase = "backward"
            loss.backward()
            grads = self._gradients()
            dtype = next((g.dtype for g in grads.values() if g is not None), dtype)
            self.send(ReferenceStep, grads=grads, decisions=tuple(log))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.phase = "flipped decisions"

        def run(recorder: UseRecorder) -> Any:
            self.subject.reset()
            fresh = self.subject.fresh_inputs()
            with recorder:
                return self._loss(self.module(*fresh.args, **fresh.kwargs))

        use = conditional_parameters(run, self.parameters, max_flips=MAX_FLIPS)
        self.send(
            ReferenceDone,
            random=random,
            dtype=dtype,
            at_risk=tuple(name for name in use.decided if name in use.reached),
        )

    def _explain(self, rank: int, names: Sequence[str]) -> None:
        batch = self._on_device(self.job.batches[rank])

        def run(recorder: UseRecorder) -> Any:
            self.subject.reset()
            inputs = map_tensors(lambda t: t.detach().clone(), batch)
            with recorder:
                return self._loss(self.module(*inputs, **self.kwargs))

        reasons = explain_unreached(run, self.parameters, list(names), max_flips=MAX_FLIPS)
        self.send(Explained, reasons=reasons)

    def _alone(self) -> None:
        """Each rank's batch through the forward here, in a group of one, where every
        collective returns at once: the collectives a whole forward calls, and why."""
        self.phase = "forwards alone"
        runs = []
        for batch in self.job.batches:
            self.subject.reset()
            inputs = map_tensors(lambda t: t.detach().clone(), self._on_device(batch))
            called: list[tuple[str, Location]] = []
            with (
                record_decisions() as log,
                Spy(lambda op, at, called=called: called.append((op, at))),
            ):
                self.module(*inputs, **self.kwargs)
            runs.append((tuple(called), tuple(log)))
        self.send(AloneRuns, runs=tuple(runs))


def _cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().to("cpu", copy=True)
