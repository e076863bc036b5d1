#!/usr/bin/env bash
# start-services [COMMAND...]: starts the container's services (SSH{% if cookiecutter.jupyter %}, JupyterLab{% endif %}),
# then runs COMMAND when one is given. The image's entrypoint: it runs at every
# container start, however the container is started (docker run, docker start,
# a reboot with a restart policy, or the Dev Containers tooling, which keeps the
# entrypoint because devcontainer.json sets overrideCommand to false).
# A service that fails to start is reported and the container goes on without it.
set -uo pipefail

# One run at a time: post-create runs it too, while the entrypoint's may still run.
exec 9>"${TMPDIR:-/tmp}/start-services-$(id -u).lock"
flock 9

# 9>&-: the services must not inherit (and so hold) the lock.
start-sshd 9>&- || echo "start-services: SSH is not available (see above)" >&2
if command -v start-jupyter >/dev/null; then
    start-jupyter 9>&- || echo "start-services: JupyterLab is not available (see above)" >&2
fi
exec 9>&-
if [ "$#" -gt 0 ]; then
    exec "$@"
fi
