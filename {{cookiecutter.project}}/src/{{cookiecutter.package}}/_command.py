"""The name a command was started by, for its usage and error lines."""

from __future__ import annotations

import sys
from pathlib import Path


def command_name(module: str) -> str:
    """The installed script's name (``dynamic-model-doctor`` for ``<package>.doctor``) when
    that script started this process, else ``python -m <module>``."""
    suffix = "-" + module.rpartition(".")[2]
    started_as = Path(sys.argv[0]).name if sys.argv else ""
    return started_as if started_as.endswith(suffix) else f"python -m {module}"
