#!/bin/sh
# Runs on the host before the container is created or started (initializeCommand):
# copies the host user's public SSH keys, ~/.ssh/*.pub and never a private key,
# into host-ssh-keys/ beside this script; start-sshd authorizes them. A host
# without keys is fine: the container starts, and start-sshd says how to add one.
set -eu
dest=$(dirname "$0")/host-ssh-keys
mkdir -p "$dest"
rm -f "$dest"/*.pub
for key in "$HOME"/.ssh/*.pub; do
    if [ -f "$key" ]; then
        cp "$key" "$dest/"
    fi
done
