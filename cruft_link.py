"""Link a project generated from a plain folder of this template to the template, for cruft.

    python3 <template>/cruft_link.py [PROJECT_DIR] [--template GIT_URL_OR_PATH]

runs ``cruft link TEMPLATE --no-input --project-dir PROJECT_DIR --extra-context ANSWERS``
with the answers recorded in PROJECT_DIR/.template-answers.json (TEMPLATE defaults to
the folder this script is in, which must be a git clone). cruft renders every answer
as a Jinja template before any hook of the template runs, so an answers file holding
template syntax (planted by a change to the project) would run code on this machine:
such a file, a key that is not an answer, or an answer the template refuses stops
the link with one line per problem, and cruft is not started.
"""

from __future__ import annotations

import argparse
import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

TEMPLATE_DIR = Path(__file__).resolve().parent
ANSWERS_FILE = ".template-answers.json"


def _strings(value: Any) -> list[str]:
    """Every string in ``value``, keys of nested objects included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for key, item in value.items() for text in [key, *_strings(item)]]
    if isinstance(value, list):
        return [text for item in value for text in _strings(item)]
    return []


def answers_problems(answers: Any) -> list[str]:
    """One line per reason not to hand ``answers`` to cruft; empty when they are safe."""
    if not isinstance(answers, dict):
        return [f"error: {ANSWERS_FILE} must hold a JSON object of answers"]
    checks = runpy.run_path(str(TEMPLATE_DIR / "hooks" / "pre_gen_project.py"))
    template = json.loads((TEMPLATE_DIR / "cookiecutter.json").read_text(encoding="utf-8"))
    known = [name for name in template if not name.startswith("_")]
    lines = []
    for name, value in answers.items():
        if any(marker in text for text in [*_strings(value), name]
               for marker in checks["TEMPLATE_SYNTAX"]):  # fmt: skip
            lines.append(
                f"error: {name} = {value!r} is not allowed: it holds template syntax, which "
                f"cruft would run as code; restore {ANSWERS_FILE} from a version you trust"
            )
        elif name not in known:
            lines.append(f"error: {name!r} is not an answer of this template: {', '.join(known)}")
    if lines:
        return lines
    data = {name: value for name, value in template.items() if name.startswith("_")}
    return checks["problems"]({**answers, **data})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("project_dir", nargs="?", type=Path, default=Path())
    parser.add_argument("--template", default=str(TEMPLATE_DIR))
    args = parser.parse_args(argv)
    try:
        answers = json.loads((args.project_dir / ANSWERS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        print(f"error: cannot read {args.project_dir / ANSWERS_FILE}: {error}", file=sys.stderr)
        return 1
    lines = answers_problems(answers)
    if lines:
        print("\n".join(lines), file=sys.stderr)
        return 1
    cruft = shutil.which("cruft") or shutil.which("cruft", path=str(Path(sys.executable).parent))
    if cruft is None:
        print("error: cruft is not on PATH (pip install cruft)", file=sys.stderr)
        return 1
    command = [cruft, "link", args.template, "--no-input", "--project-dir", str(args.project_dir),
               "--extra-context", json.dumps(answers, ensure_ascii=False)]  # fmt: skip
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
