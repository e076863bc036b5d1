#!/bin/sh
# Runs on the host before the container is created or started (initializeCommand):
# copies the host user's public SSH keys, ~/.ssh/*.pub and never a private key,
# into host-ssh-keys/ beside this script; start-sshd authorizes them. A host
# without keys is fine: the container starts, and start-sshd says how to add one.
#
# When this host is a server you reached over SSH (VS Code Remote-SSH: then this
# runs there, with SSH_CONNECTION set), your keys are on your own machine, not
# here; the keys that log you in to the server are: the plain key lines of the
# server's ~/.ssh/authorized_keys (no options such as command= or from=) are
# collected too, so `ssh -J you@server` reaches the container with the same key.
set -eu
dest=$(dirname "$0")/host-ssh-keys
if [ -L "$dest" ]; then
    echo "collect-host-ssh-keys: $dest is a symbolic link; refusing to write the keys" \
        "through it. Remove it (the script makes a plain folder there)." >&2
    exit 1
fi
mkdir -p "$dest"
rm -f "$dest"/*.pub
for key in "$HOME"/.ssh/*.pub; do
    if [ -f "$key" ]; then
        cp "$key" "$dest/"
    fi
done

authorized=$HOME/.ssh/authorized_keys
if [ -n "${SSH_CONNECTION:-}" ] && [ -f "$authorized" ]; then
    # A key line is "type base64 [comment]"; start-sshd checks each line again.
    grep -E '^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com|sk-ecdsa-sha2-nistp256@openssh\.com) [A-Za-z0-9+/]+={0,3}( [^[:cntrl:]]*)?$' \
        "$authorized" >"$dest/server-authorized-keys.pub" || true
    if [ ! -s "$dest/server-authorized-keys.pub" ]; then
        rm -f "$dest/server-authorized-keys.pub"
    fi
fi
