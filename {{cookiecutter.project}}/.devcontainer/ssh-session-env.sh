# shellcheck shell=sh
# SSH logins get the container's environment (PATH with the project's virtual
# environment, CUDA variables), which the login profile would otherwise reset.
# start-sshd writes the file at every container start.
if [ -n "${SSH_CONNECTION:-}" ] && [ -r /run/devcontainer-sshd/session-env.sh ]; then
    # shellcheck source=/dev/null  # written at run time by start-sshd
    . /run/devcontainer-sshd/session-env.sh
fi
