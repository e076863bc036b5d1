#!/usr/bin/env bash
# create-user NAME UID GID: the image's non-root user, with passwordless sudo.
# Copes with a base image that already has a user or group with that UID/GID (the
# Ubuntu 24.04 images have "ubuntu" at 1000): that account is renamed and reused.
set -euo pipefail
name=$1 uid=$2 gid=$3

for pair in "DEV_UID=$uid" "DEV_GID=$gid"; do
    if [[ ! ${pair#*=} =~ ^[0-9]+$ ]]; then
        echo "create-user: $pair is not a number (a user or group ID)" >&2
        exit 1
    fi
done
if ((10#$uid == 0 || 10#$gid == 0)); then
    echo "create-user: DEV_UID=$uid DEV_GID=$gid is not allowed: the dev user must not be root" \
        "(UID or GID 0), whom SSH refuses. Build as the user who owns the project" \
        "(--build-arg DEV_UID=\$(id -u) run without sudo), or keep the default 1000." >&2
    exit 1
fi

group=$(getent group "$gid" | cut -d: -f1) || true
if [ -z "$group" ]; then
    groupadd --gid "$gid" "$name"
    group=$name
elif [ "$group" != "$name" ] && ! getent group "$name" >/dev/null; then
    groupmod --new-name "$name" "$group"
    group=$name
fi

existing=$(getent passwd "$uid" | cut -d: -f1) || true
if [ -n "$existing" ] && [ "$existing" != "$name" ]; then
    echo "create-user: renaming the existing user $existing (UID $uid) to $name"
    usermod --login "$name" --home "/home/$name" --move-home --gid "$group" --shell /bin/bash "$existing"
elif [ -z "$existing" ] && getent passwd "$name" >/dev/null; then
    usermod --uid "$uid" --gid "$group" --shell /bin/bash "$name"
elif [ -z "$existing" ]; then
    useradd --uid "$uid" --gid "$group" --create-home --shell /bin/bash "$name"
fi
mkdir -p "/home/$name"
chown "$uid:$gid" "/home/$name"

# "*" matches no password, yet unlike "!" it does not lock the account, which sshd
# would refuse even for key logins.
usermod --password '*' "$name"
echo "$name ALL=(ALL) NOPASSWD:ALL" >"/etc/sudoers.d/$name"
chmod 0440 "/etc/sudoers.d/$name"
