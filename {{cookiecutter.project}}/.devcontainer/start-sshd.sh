#!/usr/bin/env bash
# start-sshd: starts the dev container's SSH server (public keys only), or reloads it
# when it already runs. Runs at every container start (start-services); as root, or
# as the dev user, who gets root through sudo for it.
#
# Keys allowed to log in as the dev user (none is required to start):
#   SSH_AUTHORIZED_KEYS   public keys, one per line, e.g. for docker run:
#                         -e SSH_AUTHORIZED_KEYS="$(cat ~/.ssh/id_ed25519.pub)"
#   SSH_PUBLIC_KEYS_DIR   every *.pub file in it; devcontainer.json fills the default,
#                         /workspace/.devcontainer/host-ssh-keys, with the host's ~/.ssh/*.pub
#   ~/.ssh/authorized_keys of the dev user in the container
# Host keys are generated at the first start into SSH_HOST_KEY_DIR, a volume, so
# they survive rebuilds and the clients' known_hosts stays valid.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    exec sudo --non-interactive \
        --preserve-env=DEV_USER,PROJECT_SSH_PORT,SSH_AUTHORIZED_KEYS,SSH_PUBLIC_KEYS_DIR,SSH_HOST_KEY_DIR,SSHD_RUNTIME_DIR,SSHD_CONFIG \
        "$0" "$@"
fi

fail() {
    echo "start-sshd: $*" >&2
    exit 1
}

user=${DEV_USER:-}
port=${PROJECT_SSH_PORT:-{{ cookiecutter.ssh_port }}}
policy=${SSHD_CONFIG:-/etc/ssh/devcontainer/sshd_config}
host_key_dir=${SSH_HOST_KEY_DIR:-/etc/ssh/host-keys}
public_keys_dir=${SSH_PUBLIC_KEYS_DIR:-/workspace/.devcontainer/host-ssh-keys}
runtime=${SSHD_RUNTIME_DIR:-/run/devcontainer-sshd}
sshd=$(command -v sshd || echo /usr/sbin/sshd)

[ -n "$user" ] || fail "DEV_USER is not set: it names the one user who may log in"
getent passwd "$user" >/dev/null || fail "DEV_USER=$user is not a user of this container"
[[ $port =~ ^[0-9]{1,5}$ ]] && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] ||
    fail "PROJECT_SSH_PORT=$port is not a TCP port number (1-65535)"
[ -x "$sshd" ] || fail "no sshd found: install openssh-server"
# sshd ignores an Include that matches no file and would run on the distribution's
# defaults (password logins, agent forwarding): no policy, no start.
[ -f "$policy" ] || fail "the SSH policy $policy (SSHD_CONFIG) is missing or not a file;" \
    "refusing to start sshd without it, on the distribution's defaults (password logins)"

# Privilege separation directory: sshd refuses to start without it.
install -d -m 0755 /run/sshd
install -d -m 0700 "$host_key_dir"
install -d -m 0755 "$runtime" "$runtime/authorized_keys"

host_keys=()
for type in ed25519 rsa; do
    key=$host_key_dir/ssh_host_${type}_key
    if [ ! -s "$key" ]; then
        echo "start-sshd: generating the $type host key (once; kept in $host_key_dir)"
        rm -f "$key" "$key.pub"
        ssh-keygen -q -t "$type" -N '' -C "{{ cookiecutter.project }} dev container" -f "$key"
    fi
    host_keys+=("$key")
done

# The sources are user-supplied text. Only plain public key lines, "type base64
# [comment]", that ssh-keygen reads as keys are authorized: lines with options
# (command=, from=, environment=, cert-authority, ...) and certificates are refused,
# and so are RSA keys under min_rsa_bits (OpenSSH still accepts 1024). Refused lines
# are reported by number, never echoed (they may be a private key pasted by
# mistake, which gets a warning of its own); a short RSA key by its fingerprint.
authorized=$runtime/authorized_keys/$user
# NIST SP 800-131A: RSA below 2048 bits is disallowed for authentication.
min_rsa_bits=2048
key_types='ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp256|ecdsa-sha2-nistp384|ecdsa-sha2-nistp521|sk-ssh-ed25519@openssh\.com|sk-ecdsa-sha2-nistp256@openssh\.com'
plain_key="^($key_types) [A-Za-z0-9+/]+={0,3}( [^[:cntrl:]]*)?$"
add_keys() { # SOURCE-NAME < lines
    local line number=0 private=0
    while IFS= read -r line || [ -n "$line" ]; do
        number=$((number + 1))
        line=${line%$'\r'}
        if ((private)); then
            [[ $line == *"-----END "*"PRIVATE KEY-----"* ]] && private=0
            continue
        fi
        case $line in "" | "#"*) continue ;; esac
        if [[ $line == *"-----BEGIN "*"PRIVATE KEY-----"* ]]; then
            private=1
            private_key_warning "$1" "$number"
        elif [[ $line =~ $plain_key ]] && fingerprint=$(ssh-keygen -l -f - <<<"$line" 2>/dev/null); then
            # "BITS SHA256:... COMMENT (TYPE)"
            bits=${fingerprint%% *}
            if [[ $fingerprint == *" (RSA)" ]] && ((bits < min_rsa_bits)); then
                fingerprint=${fingerprint#* }
                echo "start-sshd: ignoring line $number of $1: the RSA key ${fingerprint% (RSA)} has" \
                    "$bits bits; RSA keys need at least $min_rsa_bits (make a new key: ssh-keygen -t ed25519)" >&2
            else
                printf '%s\n' "$line" >>"$authorized.new"
            fi
        elif [[ $line =~ -cert-v01@openssh\.com[[:space:]] ]]; then
            echo "start-sshd: ignoring line $number of $1: a certificate; give the plain public key" >&2
        elif [[ $line =~ [[:space:]]($key_types)[[:space:]] ]]; then
            echo "start-sshd: ignoring line $number of $1: key options (command=, from=," \
                "environment=, cert-authority, ...) are not accepted; give the plain key line" >&2
        else
            echo "start-sshd: ignoring line $number of $1: not a public key line (type base64 [comment])" >&2
        fi
    done
}
private_key_warning() { # SOURCE-NAME LINE-NUMBER
    local where
    if [ "$1" = SSH_AUTHORIZED_KEYS ]; then
        where="the container's environment, which anyone who can run docker inspect on it can read"
    else
        where=$1
    fi
    echo "start-sshd: WARNING: line $2 of $1 begins a PRIVATE key (ignored). It is now stored in" \
        "$where: remove it there, and replace the key (ssh-keygen -t ed25519); give only the" \
        "public key, the line of the .pub file." >&2
}
: >"$authorized.new"
add_keys SSH_AUTHORIZED_KEYS <<<"${SSH_AUTHORIZED_KEYS:-}"
if [ -d "$public_keys_dir" ]; then
    for file in "$public_keys_dir"/*.pub; do
        # shellcheck disable=SC2094  # add_keys writes $authorized.new, not $file
        if [ -f "$file" ]; then add_keys "$file" <"$file"; fi
    done
fi
chmod 0644 "$authorized.new"
mv "$authorized.new" "$authorized"
home=$(getent passwd "$user" | cut -d: -f6)
key_count=$({ cat "$authorized" "$home/.ssh/authorized_keys" 2>/dev/null || true; } | sort -u | grep -c .) || true

# SSH sessions start with a clean environment; give them the container's (PATH with
# the project's virtual environment, CUDA and NVIDIA variables), as PID 1 has it.
# SetEnv covers commands (ssh host cmd); session-env.sh, sourced from
# /etc/profile.d, covers login shells, whose profile resets PATH. Root may lack
# CAP_SYS_PTRACE (Docker's default), so PID 1's environment is read as its owner.
pid1_environ() {
    cat /proc/1/environ 2>/dev/null ||
        setpriv --reuid="$(stat -c %u /proc/1)" --regid="$(stat -c %g /proc/1)" --clear-groups \
            cat /proc/1/environ
}
set_env=()
: >"$runtime/session-env.sh"
while IFS= read -r -d '' entry; do
    name=${entry%%=*} value=${entry#*=}
    case $name in
        HOME | USER | LOGNAME | SHELL | MAIL | HOSTNAME | TERM | PWD | OLDPWD | SHLVL | _) continue ;;
        SSH_* | JUPYTER_TOKEN) continue ;;
    esac
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
    [[ $value == *[\"\\$'\n']* ]] && continue
    set_env+=("$name=\"$value\"")
    printf 'export %s=%q\n' "$name" "$value" >>"$runtime/session-env.sh"
done < <(pid1_environ)
chgrp "$(id -g "$user")" "$runtime/session-env.sh"
chmod 0640 "$runtime/session-env.sh"

# LogLevel VERBOSE (logins with the key fingerprint, refusals) goes to this file,
# which the dev user can read.
log=$runtime/sshd.log
touch "$log"
chgrp "$(id -g "$user")" "$log"
chmod 0640 "$log"

config=$runtime/sshd_config
{
    echo "# Written by start-sshd at each start. The policy is in $policy."
    echo "Port $port"
    echo "AllowUsers $user"
    printf 'HostKey %s\n' "${host_keys[@]}"
    echo "AuthorizedKeysFile $authorized .ssh/authorized_keys"
    # The same minimum for ~/.ssh/authorized_keys, which sshd reads itself (OpenSSH 9.1
    # and newer; older servers refuse the keyword).
    if "$sshd" -t -f /dev/null -h "${host_keys[0]}" -o RequiredRSASize=$min_rsa_bits 2>/dev/null; then
        echo "RequiredRSASize $min_rsa_bits"
    fi
    echo "PidFile $runtime/sshd.pid"
    [ -z "${set_env[*]:-}" ] || echo "SetEnv ${set_env[*]}"
    echo "Include $policy"
} >"$config"
chmod 0600 "$config"
effective=$("$sshd" -T -f "$config") || fail "sshd rejected its configuration $config (see above)"
# What the policy must keep in force, whatever else it changes: logins with keys only.
for setting in "authenticationmethods publickey" "passwordauthentication no" \
    "kbdinteractiveauthentication no" "permitrootlogin no"; do
    grep -qxF "$setting" <<<"$effective" || fail "the SSH policy $policy does not set" \
        "'$setting' (sshd -T -f $config); refusing to start sshd with logins other than by key"
done

pid=$(cat "$runtime/sshd.pid" 2>/dev/null) || pid=
if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = sshd ]; then
    kill -HUP "$pid"
    echo "start-sshd: sshd reloaded (port $port)"
else
    "$sshd" -f "$config" -E "$log"
    echo "start-sshd: sshd listens on port $port; only $user may log in, with a key"
fi
# Return once sshd accepts connections (a reload re-executes it).
for _ in $(seq 100); do
    sleep 0.1
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
done

echo "Host key fingerprints (compare on the first connection):"
for key in "${host_keys[@]}"; do
    echo "  $(ssh-keygen -l -f "$key.pub")"
done
if [ "$key_count" -eq 0 ]; then
    cat <<EOF
No public key is authorized yet, so nobody can log in over SSH. Add one:
  - VS Code: put it in ~/.ssh/*.pub on the host (ssh-keygen -t ed25519) and rebuild
    or restart the container;
  - docker run: -e SSH_AUTHORIZED_KEYS="\$(cat ~/.ssh/id_ed25519.pub)";
  - inside the container: append it to ~/.ssh/authorized_keys.
EOF
else
    echo "$key_count public key(s) may log in as $user."
fi
cat <<EOF
Add this to ~/.ssh/config on your machine, then run: ssh {{ cookiecutter.project }}
(HostName is the machine running Docker; keep localhost when that is this machine.
HostKeyAlias gives this project its own known_hosts entry. sshd's log: $log)

Host {{ cookiecutter.project }}
    HostName localhost
    Port $port
    User $user
    HostKeyAlias {{ cookiecutter.project }}

EOF
