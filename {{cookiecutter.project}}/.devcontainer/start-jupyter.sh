#!/usr/bin/env bash
# start-jupyter: JupyterLab on 0.0.0.0:$PROJECT_JUPYTER_PORT in the background, as
# the dev user, never without a token: JUPYTER_TOKEN when set, else one generated
# at the first start and kept in ~/.jupyter/devcontainer-token.
set -euo pipefail

port=${PROJECT_JUPYTER_PORT:-{{ cookiecutter.jupyter_port }}}
root_dir=${JUPYTER_ROOT_DIR:-/workspace}
state=$HOME/.local/state/devcontainer-jupyter
log=$state/jupyter.log

if [[ ! $port =~ ^[0-9]{1,5}$ ]] || [ "$port" -lt 1 ] || [ "$port" -gt 65535 ]; then
    echo "start-jupyter: PROJECT_JUPYTER_PORT=$port is not a TCP port number (1-65535)" >&2
    exit 1
fi
mkdir -p "$state" "$HOME/.jupyter"

token=${JUPYTER_TOKEN:-}
if [ -z "$token" ]; then
    token_file=$HOME/.jupyter/devcontainer-token
    if [ ! -s "$token_file" ]; then
        (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(24))' >"$token_file")
    fi
    token=$(<"$token_file")
fi
url="http://localhost:$port/lab?token=$token"

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; }

pid=$(cat "$state/jupyter.pid" 2>/dev/null) || pid=
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    echo "start-jupyter: JupyterLab already runs: $url"
    exit 0
fi

# setsid and nohup: the server outlives the command that started it (post-create
# runs it through devcontainer exec, whose session closes when it ends).
JUPYTER_TOKEN=$token setsid nohup jupyter lab --no-browser \
    --ServerApp.ip=0.0.0.0 --ServerApp.port="$port" --ServerApp.port_retries=0 \
    --ServerApp.root_dir="$root_dir" >"$log" 2>&1 </dev/null &
echo $! >"$state/jupyter.pid"

for _ in $(seq 120); do
    if listening; then
        echo "start-jupyter: JupyterLab is up: $url"
        exit 0
    fi
    if ! kill -0 "$!" 2>/dev/null; then
        echo "start-jupyter: JupyterLab exited at start; the end of $log:" >&2
        tail -n 20 "$log" >&2
        exit 1
    fi
    sleep 0.5
done
echo "start-jupyter: JupyterLab is still starting after 60 s (log: $log): $url"
