"""Remove what the answers turned off, record the template for cruft, print the next steps
(not while cruft renders a copy to compare a project with).

Runs inside the new project folder. The answers arrive as JSON data (see
pre_gen_project.py); none is pasted into this source as code.
"""

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from cookiecutter.config import get_user_config
from cookiecutter.exceptions import UnknownRepoType
from cookiecutter.repository import expand_abbreviations, is_repo_url
from cookiecutter.vcs import identify_repo

# Single quotes on purpose: tojson output holds double quotes and never a single one.
ANSWERS = json.loads(r'{{ cookiecutter | tojson }}')  # fmt: skip

# Files that exist only for a yes/no answer: removed when that answer is "no".
FILES_BY_OPTION = {
    "jupyter": [".devcontainer/start-jupyter.sh", "notebooks"],
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


def git(repo, *args):
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def cruft_state(answers):
    """The ``.cruft.json`` that ``cruft check``/``update`` need, or None.

    Written for projects that cookiecutter generated from a git URL of the template
    (cookiecutter cloned it into ``_repo_dir``): the URL, the commit generated from,
    and the answers. From a plain folder there is no URL to record, and when cruft
    generates (its context has ``_commit``) cruft writes the file itself.
    """
    given = answers.get("_template")
    if not given or "_commit" in answers:
        return None
    template = expand_abbreviations(given, get_user_config()["abbreviations"])
    try:
        kind, url = identify_repo(template) if is_repo_url(template) else (None, None)
    except UnknownRepoType:
        return None
    if kind != "git":
        return None
    repo_dir = Path(answers["_repo_dir"]).resolve()
    commit = git(repo_dir, "rev-parse", "HEAD")
    directory = repo_dir.relative_to(Path(git(repo_dir, "rev-parse", "--show-toplevel")).resolve())
    recorded = {name: value for name, value in answers.items() if not name.startswith("_")}
    return {
        "template": url,
        "commit": commit,
        "checkout": answers.get("_checkout"),
        "context": {"cookiecutter": {**recorded, "_template": url, "_commit": commit}},
        "directory": None if directory == Path() else directory.as_posix(),
    }


def record_template(project, answers):
    state = cruft_state(answers)
    if state is not None:
        text = json.dumps(state, ensure_ascii=False, indent=2, separators=(",", ": "))
        (project / ".cruft.json").write_text(text + "\n", encoding="utf-8")


def dev_user(project):
    """The container's user as devcontainer.json names it (remoteUser), if it does."""
    config = project / ".devcontainer" / "devcontainer.json"
    if not config.exists():
        return "<user>"
    found = re.search(r'"remoteUser"\s*:\s*"([^"]+)"', config.read_text())
    return found.group(1) if found else "<user>"


def comparison_copy(project, answers):
    """Whether cruft renders the template to compare it with a project that exists
    (``cruft update``, ``cruft diff``), not to create one: then this folder is thrown
    away, and the next steps are not true.

    cruft marks every rendering with ``_commit``; it renders its comparison copies into
    a fresh ``tempfile.TemporaryDirectory`` of its own (``tmp`` and 8 random characters
    in the temporary folder), where ``cruft create`` writes the folder the user names.
    """
    output = project.resolve().parent
    return (
        "_commit" in answers
        and output.parent == Path(tempfile.gettempdir()).resolve()
        and re.fullmatch(r"tmp[a-z0-9_]{8}", output.name) is not None
    )


def next_steps(project, answers):
    name = answers["project"]
    lines = [
        f"Created {name}/. Next steps:",
        f"  1. cd {name} && git init && git add --all && git commit -m 'Start from template'",
        "  2. code .   then run 'Dev Containers: Reopen in Container' (F1) in VS Code",
        "  3. in the container: pytest (CPU tests), pytest --gpu (GPU tests too)",
        f"  4. SSH into the running container: ssh -p {answers['ssh_port']} "
        f"-o HostKeyAlias={project.name} {dev_user(project)}@localhost (its own known_hosts "
        "entry; see README.md for keys, the ~/.ssh/config entry and VS Code Remote-SSH)",
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
    record_template(project, ANSWERS)
    if not comparison_copy(project, ANSWERS):
        print("\n".join(next_steps(project, ANSWERS)))
