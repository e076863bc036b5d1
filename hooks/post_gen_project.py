"""Remove what the answers turned off, then print the next steps.

Runs inside the new project folder. The answers arrive as JSON data (see
pre_gen_project.py); none is pasted into this source as code.
"""

import json
import re
import shutil
from pathlib import Path

# Single quotes on purpose: tojson output holds double quotes and never a single one.
ANSWERS = json.loads(r'{{ cookiecutter | tojson }}')  # fmt: skip

# Files that exist only for a yes/no answer: removed when that answer is "no".
FILES_BY_OPTION = {
    "jupyter": [".devcontainer/start-jupyter.sh"],
}
# Caches that a template checkout may hold (its tests and linters run in it) and
# cookiecutter would copy along; never part of a new project.
CACHE_DIRS = ("__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache")


def remove_unused(project, answers):
    """Delete the files and folders of every option that is off."""
    for option, paths in FILES_BY_OPTION.items():
        if answers[option]:
            continue
        for relative in paths:
            path = project / relative
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


def remove_caches(project):
    for name in CACHE_DIRS:
        for path in sorted(project.rglob(name), reverse=True):
            shutil.rmtree(path, ignore_errors=True)


def dev_user(project):
    """The container's user as devcontainer.json names it (remoteUser), if it does."""
    config = project / ".devcontainer" / "devcontainer.json"
    if not config.exists():
        return "<user>"
    found = re.search(r'"remoteUser"\s*:\s*"([^"]+)"', config.read_text())
    return found.group(1) if found else "<user>"


def next_steps(project, answers):
    name = answers["project"]
    lines = [
        f"Created {name}/. Next steps:",
        f"  1. cd {name} && git init && git add --all && git commit -m 'Start from template'",
        "  2. code .   then run 'Dev Containers: Reopen in Container' (F1) in VS Code",
        "  3. in the container: pytest (CPU tests), pytest --gpu (GPU tests too)",
        f"  4. SSH into the running container: ssh -p {answers['ssh_port']} "
        f"{dev_user(project)}@localhost (see README.md for keys and VS Code Remote-SSH)",
    ]
    if answers["jupyter"]:
        lines.append(
            f"  5. JupyterLab: http://localhost:{answers['jupyter_port']}/ "
            "(the container prints the URL with its token)"
        )
    return lines


if __name__ == "__main__":
    project = Path.cwd()
    remove_unused(project, ANSWERS)
    remove_caches(project)
    print("\n".join(next_steps(project, ANSWERS)))
