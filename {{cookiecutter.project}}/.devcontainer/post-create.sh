#!/usr/bin/env bash
# Runs once when the dev container is created (postCreateCommand): installs the
# project and the pre-commit hooks, then checks the environment with the doctor.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! git config --global --get-all safe.directory | grep -qxF "$PWD"; then
    git config --global --add safe.directory "$PWD"
fi

# PIP_CONSTRAINT (set in the image) keeps the image's torch: pip cannot replace it.
pip install --editable ".[dev]"

if git rev-parse --git-dir >/dev/null 2>&1; then
    pre-commit install
else
    echo "post-create: $PWD is not a git repository, so the pre-commit hooks are not" \
        "installed yet; after 'git init' run: pre-commit install"
fi

# The image's entrypoint (start-services) runs at every container start, in parallel
# with this script; waiting for it here (it takes a lock, and leaves running services
# alone) makes sure the doctor's SSH and Jupyter checks see the services.
start-services
if ! {{ cookiecutter.project }}-doctor; then
    echo "post-create: {{ cookiecutter.project }}-doctor reported problems (above); the container" \
        "works, but fix them before relying on the GPU" >&2
fi
