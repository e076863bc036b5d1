#!/usr/bin/env bash
# start-services [COMMAND...]: starts the container's services (SSH{% if cookiecutter.jupyter %}, JupyterLab{% endif %}),
# then runs COMMAND when one is given. The image's entrypoint for docker run, and
# devcontainer.json's postStartCommand: both run it at every container start.
# A service that fails to start is reported and the container goes on without it.
set -uo pipefail

start-sshd || echo "start-services: SSH is not available (see above)" >&2
if command -v start-jupyter >/dev/null; then
    start-jupyter || echo "start-services: JupyterLab is not available (see above)" >&2
fi
if [ "$#" -gt 0 ]; then
    exec "$@"
fi
