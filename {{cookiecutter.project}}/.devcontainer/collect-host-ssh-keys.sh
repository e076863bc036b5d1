#!/bin/sh
# Runs on the host before the container is created or started (initializeCommand):
# collects the host user's public SSH keys into host-ssh-keys/ beside this script;
# start-sshd authorizes them. A host without keys is fine: the container starts, and
# start-sshd says how to add one.
#
# Keys are chosen by content, not by name: of each ~/.ssh/*.pub only the plain
# public key lines ("type base64 [comment]") are written, and a file that holds a
# private key gives nothing at all, so no private key reaches the project folder
# whatever a .pub name points to. A link is followed only to a file inside ~/.ssh.
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

ssh_dir=$HOME/.ssh
# A key line is "type base64 [comment]"; start-sshd checks each line again.
plain_key='^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com|sk-ecdsa-sha2-nistp256@openssh\.com) [A-Za-z0-9+/]+={0,3}( [^[:cntrl:]]*)?$'

skip() { # FILE REASON...
    skipped=$1
    shift
    echo "collect-host-ssh-keys: skipping $skipped: $*" >&2
}

# collect FILE OUTPUT: the plain public key lines of FILE into OUTPUT (none: no OUTPUT).
collect() {
    file=$1
    if [ -L "$file" ]; then
        # readlink -f is in GNU, BusyBox and macOS 12.3+; where it fails, the link is skipped.
        target=$(readlink -f -- "$file" 2>/dev/null) || target=
        case $target in
            "$real_ssh_dir"/*) file=$target ;;
            *)
                skip "$1" "a link to ${target:-a path that cannot be resolved}, outside $ssh_dir"
                return
                ;;
        esac
    fi
    if [ ! -f "$file" ]; then
        skip "$1" "not a regular file"
        return
    fi
    if grep -a -q -E -e '-----BEGIN .*PRIVATE KEY-----' -e '^PuTTY-User-Key-File-' "$file"; then
        skip "$1" "it holds a PRIVATE key; a .pub file holds the public key only" \
            "(ssh-keygen -y -f <private key> > <private key>.pub)"
        return
    fi
    grep -a -E "$plain_key" "$file" >"$2" || true
    if [ ! -s "$2" ]; then
        rm -f "$2"
        skip "$1" "no plain public key line (type base64 [comment]) in it"
    fi
}

if [ -d "$ssh_dir" ]; then
    real_ssh_dir=$(cd -P "$ssh_dir" && pwd -P)
    for key in "$ssh_dir"/*.pub; do
        if [ -e "$key" ] || [ -L "$key" ]; then # not the unexpanded pattern
            collect "$key" "$dest/$(basename "$key")"
        fi
    done

    authorized=$ssh_dir/authorized_keys
    if [ -n "${SSH_CONNECTION:-}" ] && { [ -e "$authorized" ] || [ -L "$authorized" ]; }; then
        collect "$authorized" "$dest/server-authorized-keys.pub"
    fi
fi
