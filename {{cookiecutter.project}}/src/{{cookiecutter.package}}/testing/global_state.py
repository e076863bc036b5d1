"""Snapshot, compare and restore the process-wide state that changes what torch computes.

A test that turns on deterministic mode or changes the default dtype and does not
undo it changes the results of the tests that run after it, in an order that
differs between ``pytest`` and ``pytest -n 4``. :func:`snapshot` records torch's
global settings and the random number generators (torch CPU, initialized CUDA
devices, ``random``, NumPy), :func:`differences` says which settings changed, in
words, and :func:`restore` puts settings and generators back. Generators are not
compared: reseeding and drawing are what tests do, so they are only restored.
torch is looked at only when something already imported it, and CUDA only when it
is already initialized: taking a snapshot never imports torch or starts CUDA.

TF32 settings are read and restored through the ``fp32_precision`` API: the legacy
``allow_tf32`` flags raise once the two APIs disagree. The float32 matmul precision
is a setting of its own (``set_float32_matmul_precision`` also sets the matmul
``fp32_precision`` values, which are restored after it).
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GlobalState",
    "RngState",
    "Setting",
    "differences",
    "restore",
    "rng_states",
    "snapshot",
    "torch_settings",
]


@dataclass(frozen=True)
class Setting:
    """One global torch setting: how to read it and how to set it back."""

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]


@dataclass(frozen=True)
class RngState:
    """One random number generator's state.

    ``key`` is the state in a form that compares by value; ``raw`` is the state as
    the generator gives it, which ``set_state`` takes back.
    """

    name: str
    key: Any
    raw: Any = field(compare=False, repr=False)
    set_state: Callable[[Any], None] = field(compare=False, repr=False)


@dataclass(frozen=True)
class GlobalState:
    """The global state at one moment: settings as ``(name, value)`` pairs and RNGs."""

    settings: tuple[tuple[str, Any], ...]
    rngs: tuple[RngState, ...]


def _attribute(owner: Any, attribute: str, name: str) -> Setting:
    return Setting(
        name, lambda: getattr(owner, attribute), lambda value: setattr(owner, attribute, value)
    )


def _default_device_setting(torch: Any) -> Setting:
    # set_default_device("cpu") would install a device mode that slows every torch call.
    def set_device(device: Any) -> None:
        torch.set_default_device(None if device == torch.device("cpu") else device)

    return Setting("torch.get_default_device()", torch.get_default_device, set_device)


def _sdpa_switch(cuda: Any, kind: str) -> tuple[Callable[[], bool], Callable[[bool], None]]:
    """Getter and setter of one scaled-dot-product-attention backend switch."""
    return getattr(cuda, f"{kind}_sdp_enabled"), getattr(cuda, f"enable_{kind}_sdp")


MIXED_TF32_APIS = "<unreadable: legacy and new TF32 APIs disagree>"


def _float32_matmul_precision_setting(torch: Any) -> Setting:
    def get() -> str:
        try:
            return torch.get_float32_matmul_precision()
        except RuntimeError:  # the matmul fp32_precision values of cuBLAS and oneDNN differ
            return MIXED_TF32_APIS

    def set_precision(value: str) -> None:
        if value != MIXED_TF32_APIS:
            torch.set_float32_matmul_precision(value)

    return Setting("torch.get_float32_matmul_precision()", get, set_precision)


@functools.cache
def torch_settings() -> tuple[Setting, ...]:
    """The torch settings that are snapshotted, in the order they are restored."""
    import torch

    backends = torch.backends
    return (
        Setting("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
        _default_device_setting(torch),
        Setting("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
        Setting(
            "anomaly mode (torch.is_anomaly_enabled(), check_nan)",
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            lambda value: torch.set_anomaly_enabled(*value),
        ),
        Setting(
            "deterministic algorithms (torch.are_deterministic_algorithms_enabled(), warn_only)",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
        ),
        _attribute(
            torch.utils.deterministic,
            "fill_uninitialized_memory",
            "torch.utils.deterministic.fill_uninitialized_memory",
        ),
        _attribute(backends.cudnn, "enabled", "torch.backends.cudnn.enabled"),
        _attribute(backends.cudnn, "deterministic", "torch.backends.cudnn.deterministic"),
        _attribute(backends.cudnn, "benchmark", "torch.backends.cudnn.benchmark"),
        _float32_matmul_precision_setting(torch),
        # Parents before children: setting a parent's precision changes its children's.
        _attribute(backends, "fp32_precision", "torch.backends.fp32_precision"),
        _attribute(
            backends.cuda.matmul, "fp32_precision", "torch.backends.cuda.matmul.fp32_precision"
        ),
        _attribute(backends.cudnn, "fp32_precision", "torch.backends.cudnn.fp32_precision"),
        _attribute(
            backends.cudnn.conv, "fp32_precision", "torch.backends.cudnn.conv.fp32_precision"
        ),
        _attribute(backends.cudnn.rnn, "fp32_precision", "torch.backends.cudnn.rnn.fp32_precision"),
        _attribute(backends.mkldnn, "fp32_precision", "torch.backends.mkldnn.fp32_precision"),
        _attribute(
            backends.mkldnn.matmul, "fp32_precision", "torch.backends.mkldnn.matmul.fp32_precision"
        ),
        _attribute(
            backends.mkldnn.conv, "fp32_precision", "torch.backends.mkldnn.conv.fp32_precision"
        ),
        _attribute(
            backends.mkldnn.rnn, "fp32_precision", "torch.backends.mkldnn.rnn.fp32_precision"
        ),
        _attribute(
            backends.cuda.matmul,
            "allow_fp16_reduced_precision_reduction",
            "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        ),
        _attribute(
            backends.cuda.matmul,
            "allow_bf16_reduced_precision_reduction",
            "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        ),
        *(
            Setting(f"torch.backends.cuda.{kind}_sdp_enabled()", *_sdpa_switch(backends.cuda, kind))
            for kind in ("flash", "mem_efficient", "math", "cudnn")
        ),
        Setting("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
    )


@functools.cache
def _settings_by_name() -> dict[str, Setting]:
    return {setting.name: setting for setting in torch_settings()}


def _byte_tensor_key(state: Any) -> bytes:
    try:
        return state.numpy().tobytes()
    except RuntimeError:  # torch without NumPy
        return bytes(state.tolist())


def _torch_rngs(torch: Any) -> list[RngState]:
    cpu = torch.default_generator.get_state()
    rngs = [
        RngState(
            "torch CPU RNG",
            _byte_tensor_key(cpu),
            cpu,
            torch.default_generator.set_state,
        )
    ]
    if torch.cuda.is_initialized():
        for index, generator in enumerate(torch.cuda.default_generators):
            state = generator.get_state()
            rngs.append(
                RngState(
                    f"torch cuda:{index} RNG",
                    _byte_tensor_key(state),
                    state,
                    generator.set_state,
                )
            )
    return rngs


def _numpy_rng(numpy: Any) -> RngState:
    state = numpy.random.get_state()
    name, keys, position, has_gauss, cached_gaussian = state
    key = (name, keys.tobytes(), position, has_gauss, cached_gaussian)
    return RngState("numpy.random (global RNG)", key, state, numpy.random.set_state)


def rng_states() -> tuple[RngState, ...]:
    """The global generators' states; torch's and NumPy's only if already imported."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    state = random.getstate()
    rngs = [RngState("random (Python)", state, state, random.setstate)]
    if torch is not None:
        rngs.extend(_torch_rngs(torch))
    if numpy is not None:
        rngs.append(_numpy_rng(numpy))
    return tuple(rngs)


def snapshot() -> GlobalState:
    """The current global state; torch and NumPy parts only if they are already imported."""
    torch = sys.modules.get("torch")
    settings: tuple[tuple[str, Any], ...] = ()
    if torch is not None:
        settings = tuple((setting.name, setting.get()) for setting in torch_settings())
    return GlobalState(settings=settings, rngs=rng_states())


def differences(before: GlobalState, after: GlobalState) -> list[str]:
    """The settings that changed from ``before`` to ``after``, one ``"name: old -> new"``
    line each. Settings missing from ``before`` (torch imported in between) are not
    compared, and neither are generators.
    """
    if before.settings == after.settings:
        return []
    old_settings = dict(before.settings)
    return [
        f"{name}: {old_settings[name]!r} -> {value!r}"
        for name, value in after.settings
        if name in old_settings and old_settings[name] != value
    ]


def restore(state: GlobalState) -> None:
    """Set every setting and generator recorded in ``state`` back to its recorded value."""
    if state.settings:
        settings = _settings_by_name()
        for name, value in state.settings:
            setting = settings[name]
            if setting.get() != value:
                setting.set(value)
    current = {rng.name: rng for rng in rng_states()}
    for rng in state.rngs:
        if current.get(rng.name, rng) != rng:
            rng.set_state(rng.raw)
