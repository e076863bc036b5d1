"""Keep torch's own log records out of a check's report, unless the user asked for them.

While ``torch.compile`` and ``torch.export`` work, torch logs what it meets: warnings
such as "Unable to find user code corresponding to {u0}" or a backend's exception
with its developer context, and structured trace events (the ``torch.__trace``
logger, for ``tlparse``). pytest captures every handler's records, so a failing
check's report would open with them, before the check's own message, which says
the same thing at the user's line. Inside :func:`quiet`, records of torch's loggers
below ``ERROR`` and every trace event are dropped on their way to handlers that
are not torch's own trace file, and put back as they were after the block.

Set ``TORCH_LOGS`` or ``TORCH_TRACE`` to see them: then nothing is dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

__all__ = ["quiet"]

_TRACE_LOGGER = "torch.__trace"
# What the user sets to ask torch for its logs (torch._logging reads the same).
_ASKED = ("TORCH_LOGS", "TORCH_TRACE")


class _DropTorchRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        torch_record = record.name == "torch" or record.name.startswith("torch.")
        if not torch_record:
            return True
        return record.name != _TRACE_LOGGER and record.levelno >= logging.ERROR


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Drop torch's log records below ``ERROR`` and its trace events inside the block."""
    if any(os.environ.get(name) for name in _ASKED):
        yield
        return
    from torch._logging._internal import LazyTraceHandler  # private: torch's trace file

    drop = _DropTorchRecords()
    trace = logging.getLogger(_TRACE_LOGGER)
    # Handlers of other parties on the trace logger (pytest's log capture) would make
    # torch build every trace event (it builds them when the logger has handlers).
    borrowed = [h for h in trace.handlers if not isinstance(h, LazyTraceHandler)]
    filtered = set(logging.getLogger().handlers)
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger):
            filtered.update(logger.handlers)
    for handler in borrowed:
        trace.removeHandler(handler)
    for handler in filtered:
        handler.addFilter(drop)
    try:
        yield
    finally:
        for handler in filtered:
            handler.removeFilter(drop)
        for handler in borrowed:
            if handler not in trace.handlers:
                trace.addHandler(handler)
