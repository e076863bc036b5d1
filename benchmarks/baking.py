"""What the benchmarks share: a project generated from this template with the default answers."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent.parent


def bake_default(output_dir: Path | str | None = None) -> Path:
    """Generate the default project (into a new temporary folder unless given); return it."""
    from cookiecutter.main import cookiecutter

    output = output_dir or tempfile.mkdtemp(prefix="template-benchmark-")
    return Path(cookiecutter(str(TEMPLATE_DIR), no_input=True, output_dir=str(output)))


def use_generated_src(src: str | None) -> Path:
    """Put a generated project's ``src`` (baked now unless given) first on ``sys.path``.

    Baking comes first: cookiecutter replaces ``sys.path`` while it runs.
    """
    path = Path(src) if src else bake_default() / "src"
    sys.path.insert(0, str(path))
    return path
