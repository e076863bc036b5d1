"""The generated SSH setup against a real OpenSSH server on 127.0.0.1.

The generated ``start-sshd.sh`` starts Debian's sshd with the generated
``sshd_config``, exactly as in the container, for a throw-away local user. Only
the paths are moved into a temporary folder, and one test-only setting is added
in front of the generated policy: ``StrictModes no``, because the keys live
under /tmp, whose permissions sshd's ownership checks reject.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sshd tests need Linux"),
    pytest.mark.skipif(
        sys.platform.startswith("linux") and os.geteuid() != 0,
        reason="sshd tests need root (a local user is created)",
    ),
    pytest.mark.skipif(
        not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("useradd")),
        reason="needs openssh-server, openssh-client and useradd (.ci/apt-packages.txt)",
    ),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (sshd's parent may not reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def make_key(path: Path, *type_and_bits: str) -> Path:
    """A key pair at ``path`` and ``path.pub``: ed25519, or e.g. ``make_key(p, "rsa", "1024")``."""
    key_type, *bits = type_and_bits or ("ed25519",)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", key_type, *(["-b", *bits] if bits else []), "-N", "",
         "-C", path.name, "-f", str(path)],
        check=True,
    )  # fmt: skip
    return path


@dataclass
class SshServer:
    """A running sshd started by the generated start script, and how to reach it."""

    project: Path
    root: Path
    user: str
    port: int
    env: dict[str, str]

    @property
    def host_key_dir(self) -> Path:
        return self.root / "host-keys"

    @property
    def runtime(self) -> Path:
        return self.root / "runtime"

    def start(self, **extra_env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(self.project / ".devcontainer" / "start-sshd.sh")],
            env={**self.env, **extra_env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )

    def stop(self) -> None:
        pid_file = self.runtime / "sshd.pid"
        if not pid_file.exists():
            return
        pid = int(pid_file.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        for _ in range(100):  # until the port is free again
            if not running(pid):
                break
            time.sleep(0.05)
        pid_file.unlink(missing_ok=True)

    def ssh(self, user: str, key: Path | None, *command: str, extra: tuple[str, ...] = ()):
        options = [
            "-F", "/dev/null",
            "-p", str(self.port),
            "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=20",
            "-o", f"UserKnownHostsFile={self.root / 'known_hosts'}",
            "-o", "StrictHostKeyChecking=accept-new",
        ]  # fmt: skip
        if key is not None:
            options += ["-o", "IdentitiesOnly=yes", "-i", str(key)]
        return subprocess.run(
            ["ssh", *options, *extra, f"{user}@127.0.0.1", *command],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("client-keys")
    return {name: make_key(folder / name) for name in ("host_user", "env_key", "stranger")}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Path]):
    from conftest import bake_project

    port = free_port()
    project = bake_project(tmp_path_factory.mktemp("ssh-project"), ssh_port=str(port))
    # sshd reads the authorized keys as the user, who cannot enter pytest's
    # root-only temporary folders: this one is world-readable.
    root = Path(tempfile.mkdtemp(prefix="sshd-test-"))
    root.chmod(0o755)
    public_keys = root / "host-ssh-keys"
    public_keys.mkdir()
    shutil.copy(keys["host_user"].with_suffix(".pub"), public_keys / "id_ed25519.pub")
    test_policy = root / "test_sshd_config"
    test_policy.write_text(
        "# Test only: the keys live under /tmp, which StrictModes rejects.\n"
        "StrictModes no\n"
        f"Include {project / '.devcontainer' / 'sshd_config'}\n"
    )
    user = f"sshtest{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", user], check=True)
    subprocess.run(["usermod", "-p", "*", user], check=True)
    env = {
        "PATH": os.environ["PATH"],
        "DEV_USER": user,
        "SSH_HOST_KEY_DIR": str(root / "host-keys"),
        "SSHD_RUNTIME_DIR": str(root / "runtime"),
        "SSH_PUBLIC_KEYS_DIR": str(public_keys),
        "SSHD_CONFIG": str(test_policy),
        "SSH_AUTHORIZED_KEYS": keys["env_key"].with_suffix(".pub").read_text()
        + "not a key: ignored\n",
    }
    running = SshServer(project, root, user, port, env)
    running.first_start = running.start()
    try:
        yield running
    finally:
        running.stop()
        subprocess.run(["userdel", "--remove", user], capture_output=True)
        shutil.rmtree(root)


def test_start_reports_keys_and_prints_ssh_config_entry(server: SshServer):
    output = server.first_start.stdout
    assert f"sshd listens on port {server.port}" in output
    assert "2 public key(s) may log in" in output
    assert f"Host {server.project.name}\n" in output
    assert f"    Port {server.port}\n" in output
    assert f"    User {server.user}\n" in output
    # Each project its own known_hosts entry, whatever port it is reached on.
    assert f"    HostKeyAlias {server.project.name}\n" in output
    # The bad line is named by its number, never echoed (it could be a private key).
    assert "ignoring line 2 of SSH_AUTHORIZED_KEYS: not a public key" in server.first_start.stderr
    assert "not a key: ignored" not in server.first_start.stderr + output


def test_key_of_host_user_logs_in_as_dev_user(server: SshServer, keys):
    result = server.ssh(server.user, keys["host_user"], "id", "-un")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == server.user


def test_key_from_environment_variable_logs_in(server: SshServer, keys):
    result = server.ssh(server.user, keys["env_key"], "true")
    assert result.returncode == 0, result.stderr


def test_unknown_key_is_refused(server: SshServer, keys):
    result = server.ssh(server.user, keys["stranger"], "true")
    assert result.returncode == 255
    assert "Permission denied (publickey)" in result.stderr


def test_root_is_refused_even_with_an_authorized_key(server: SshServer, keys):
    root_keys = server.runtime / "authorized_keys" / "root"
    shutil.copy(keys["host_user"].with_suffix(".pub"), root_keys)
    try:
        result = server.ssh("root", keys["host_user"], "true")
    finally:
        root_keys.unlink()
    assert result.returncode == 255
    assert "Permission denied" in result.stderr


def test_passwords_and_keyboard_interactive_are_not_offered(server: SshServer):
    result = server.ssh(
        server.user,
        None,
        "true",
        extra=(
            "-o", "PubkeyAuthentication=no",
            "-o", "PreferredAuthentications=password,keyboard-interactive",
        ),
    )  # fmt: skip
    assert result.returncode == 255
    # The server lists what it accepts: public keys and nothing else.
    assert "Permission denied (publickey)." in result.stderr


def effective_configuration(server: SshServer) -> list[str]:
    """``sshd -T``: every setting as sshd applies it, one ``keyword value`` a line."""
    return subprocess.run(
        [SSHD, "-T", "-f", str(server.runtime / "sshd_config")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()


def test_effective_configuration_is_key_only(server: SshServer):
    effective = effective_configuration(server)
    for line in (
        "passwordauthentication no",
        "kbdinteractiveauthentication no",
        "permitrootlogin no",
        "pubkeyauthentication yes",
        "authenticationmethods publickey",
        f"allowusers {server.user}",
        f"port {server.port}",
        "allowagentforwarding no",
        "permituserenvironment no",
        "loglevel VERBOSE",
        "kexalgorithms sntrup761x25519-sha512@openssh.com,curve25519-sha256,"
        "curve25519-sha256@libssh.org",
        "macs hmac-sha2-256-etm@openssh.com,hmac-sha2-512-etm@openssh.com,umac-128-etm@openssh.com",
    ):
        assert line in effective
    # StrictModes is on in the shipped policy; only this test's wrapper turns it off.
    policy = (server.project / ".devcontainer" / "sshd_config").read_text().splitlines()
    assert "StrictModes yes" in policy


@pytest.mark.parametrize(
    ("option", "value", "refusal"),
    [
        ("KexAlgorithms", "diffie-hellman-group14-sha256", "no matching key exchange method"),
        ("MACs", "hmac-sha1", "no matching MAC found"),
    ],
)
def test_old_algorithms_are_refused(server: SshServer, keys, option, value, refusal):
    # An AEAD cipher carries its own integrity check: a MAC is negotiated only without one.
    extra = ("-o", f"{option}={value}", "-o", "Ciphers=aes128-ctr")
    result = server.ssh(server.user, keys["host_user"], "true", extra=extra)
    assert result.returncode == 255
    assert refusal in result.stderr
    modern = server.ssh(server.user, keys["host_user"], "true", extra=("-o", "Ciphers=aes128-ctr"))
    assert modern.returncode == 0, modern.stderr


def test_logins_are_logged_where_the_user_can_read_them(server: SshServer, keys):
    assert server.ssh(server.user, keys["host_user"], "true").returncode == 0
    log = server.runtime / "sshd.log"
    assert log.stat().st_mode & 0o777 == 0o640
    assert log.stat().st_gid == int(subprocess.check_output(["id", "-g", server.user]))
    text = log.read_text()
    assert f"Accepted publickey for {server.user}" in text
    assert "ED25519 SHA256:" in text  # VERBOSE: which key logged in


def test_only_plain_key_lines_are_authorized(server: SshServer, keys):
    """Options would let a line run a command or set the environment; certificates trust a
    CA; a private key pasted by mistake is refused with a warning, never echoed."""
    plain = keys["env_key"].with_suffix(".pub").read_text().strip()
    private = keys["stranger"].read_text()
    lines = [
        f'command="/bin/sh -c id" {plain}',
        f'from="127.0.0.1",no-pty {plain}',
        f'environment="LD_PRELOAD=/tmp/x.so" {plain}',
        f"cert-authority {plain}",
        "ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQtdjAxQG9wZW5zc2guY29t cert",
        plain,
    ]
    server.stop()
    try:
        result = server.start(SSH_AUTHORIZED_KEYS="\n".join(lines) + "\n" + private)
        errors = result.stderr
        for number in (1, 2, 3, 4):
            assert (
                f"ignoring line {number} of SSH_AUTHORIZED_KEYS: key options (command=, from=,"
            ) in errors
        assert "ignoring line 5 of SSH_AUTHORIZED_KEYS: a certificate" in errors
        assert "line 7 of SSH_AUTHORIZED_KEYS begins a PRIVATE key (ignored)" in errors
        assert "docker inspect" in errors
        assert errors.count("start-sshd:") == 6  # one line for the whole private key
        assert private.splitlines()[1] not in errors + result.stdout
        authorized = server.runtime / "authorized_keys" / server.user
        host_user = keys["host_user"].with_suffix(".pub").read_text().strip()
        assert authorized.read_text().splitlines() == [plain, host_user]
        # The plain line logs in; the options did not make it through.
        session = server.ssh(server.user, keys["env_key"], "echo", "plain")
        assert session.stdout.strip() == "plain", session.stderr
    finally:
        server.stop()
        server.start()


def test_session_gets_the_container_environment(server: SshServer, keys):
    """start-sshd hands PID 1's environment (the container's) to SSH sessions."""
    exported = (server.runtime / "session-env.sh").read_text()
    result = server.ssh(server.user, keys["host_user"], "echo", "$PATH")
    assert result.returncode == 0, result.stderr
    if "export PATH=" in exported:
        session_env = subprocess.run(
            ["bash", "-c", f"source {server.runtime / 'session-env.sh'}; echo $PATH"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert result.stdout == session_env


def test_host_keys_are_made_once_and_kept_across_restarts(server: SshServer, keys):
    files = sorted(server.host_key_dir.iterdir())
    assert [f.name for f in files] == [
        "ssh_host_ed25519_key",
        "ssh_host_ed25519_key.pub",
        "ssh_host_rsa_key",
        "ssh_host_rsa_key.pub",
    ]
    before = {f.name: f.read_bytes() for f in files}
    assert server.ssh(server.user, keys["host_user"], "true").returncode == 0  # known_hosts

    server.stop()
    restart = server.start()
    assert "generating" not in restart.stdout
    assert {f.name: f.read_bytes() for f in server.host_key_dir.iterdir()} == before
    # known_hosts from before the restart still matches: strict checking passes.
    result = server.ssh(
        server.user, keys["host_user"], "true", extra=("-o", "StrictHostKeyChecking=yes")
    )
    assert result.returncode == 0, result.stderr


def test_no_key_at_all_still_starts_and_says_how_to_add_one(server: SshServer):
    server.stop()
    try:
        result = server.start(SSH_AUTHORIZED_KEYS="", SSH_PUBLIC_KEYS_DIR="/nonexistent")
        assert "No public key is authorized yet" in result.stdout
        assert "SSH_AUTHORIZED_KEYS" in result.stdout
    finally:
        server.stop()
        server.start()


def test_bad_port_is_refused_with_its_name(server: SshServer):
    with pytest.raises(subprocess.CalledProcessError) as failure:
        server.start(PROJECT_SSH_PORT="22x")
    assert "PROJECT_SSH_PORT=22x is not a TCP port number" in failure.value.stderr


@contextlib.contextmanager
def stopped(server: SshServer):
    """The server stopped for the block, then started again as the fixture started it."""
    server.stop()
    try:
        yield
    finally:
        server.stop()
        server.start()


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def fingerprint(public_key: Path) -> str:
    """``SHA256:... comment``, as start-sshd names a refused key."""
    listed = subprocess.run(
        ["ssh-keygen", "-l", "-f", str(public_key)], capture_output=True, text=True, check=True
    ).stdout.split(" ", 1)[1]
    return listed.rsplit(" (", 1)[0]


# Key pairs by name: "rsa1024" is an RSA key of 1024 bits; under 2048 bits RSA is refused.
WEAK_KEYS = {"rsa1024": ("rsa", "1024"), "rsa1536": ("rsa", "1536")}
STRONG_KEYS = {
    "rsa2048": ("rsa", "2048"),
    "rsa3072": ("rsa", "3072"),
    "ecdsa256": ("ecdsa", "256"),
    "ecdsa521": ("ecdsa", "521"),
    "ed25519": ("ed25519",),
}


@pytest.fixture(scope="module")
def typed_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("typed-keys")
    return {
        name: make_key(folder / name, *kind) for name, kind in {**WEAK_KEYS, **STRONG_KEYS}.items()
    }


def test_rsa_keys_under_2048_bits_are_refused_by_name(server: SshServer, typed_keys):
    """OpenSSH accepts RSA keys from 1024 bits; start-sshd authorizes none under 2048 and
    names each refused key by its fingerprint and comment; every other key type logs in."""
    lines = [typed_keys[name].with_suffix(".pub").read_text().strip() for name in typed_keys]
    with stopped(server):
        result = server.start(SSH_AUTHORIZED_KEYS="\n".join(lines) + "\n")
        refusals = [line for line in result.stderr.splitlines() if "bits" in line]
        assert refusals == [
            f"start-sshd: ignoring line {number} of SSH_AUTHORIZED_KEYS: the RSA key "
            f"{fingerprint(typed_keys[name].with_suffix('.pub'))} has {WEAK_KEYS[name][1]} bits;"
            " RSA keys need at least 2048 (make a new key: ssh-keygen -t ed25519)"
            for number, name in enumerate(WEAK_KEYS, start=1)
        ]
        for name in WEAK_KEYS:
            refused = server.ssh(server.user, typed_keys[name], "true")
            assert refused.returncode == 255, name
            assert "Permission denied (publickey)" in refused.stderr
        for name in STRONG_KEYS:
            session = server.ssh(server.user, typed_keys[name], "echo", name)
            assert session.stdout.strip() == name, f"{name}: {session.stderr}"


def test_short_rsa_keys_in_the_users_own_authorized_keys_are_refused(server: SshServer, typed_keys):
    """~/.ssh/authorized_keys in the container is read by sshd itself: RequiredRSASize."""
    effective = effective_configuration(server)
    if not any(line.startswith("requiredrsasize ") for line in effective):
        pytest.skip("this sshd is older than OpenSSH 9.1, which added RequiredRSASize")
    assert "requiredrsasize 2048" in effective
    home = Path(subprocess.check_output(["getent", "passwd", server.user], text=True).split(":")[5])
    own = home / ".ssh" / "authorized_keys"
    own.parent.mkdir(exist_ok=True)
    own.write_text(
        "".join(typed_keys[name].with_suffix(".pub").read_text() for name in ("rsa1024", "rsa2048"))
    )
    try:
        assert server.ssh(server.user, typed_keys["rsa1024"], "true").returncode == 255
        session = server.ssh(server.user, typed_keys["rsa2048"], "echo", "own file")
        assert session.stdout.strip() == "own file", session.stderr
    finally:
        own.unlink()


POLICY = "{policy}"  # stands for the generated policy's path in the cases below
REFUSED_POLICIES = {
    # sshd -t passes for all of these, and sshd would run on the distribution's defaults
    # (passwords, keyboard-interactive, root with a key, agent forwarding) or be told to.
    "missing": (None, "is missing or not a file"),
    "a folder": ("", "is missing or not a file"),
    "empty": ("# nothing\n", "does not set 'authenticationmethods publickey'"),
    "includes a missing file": (
        "Include /nonexistent/devcontainer/sshd_config\n",
        "does not set 'authenticationmethods publickey'",
    ),
    "passwords back on": (
        f"PasswordAuthentication yes\nInclude {POLICY}\n",
        "does not set 'passwordauthentication no'",
    ),
    "keyboard-interactive back on": (
        f"KbdInteractiveAuthentication yes\nInclude {POLICY}\n",
        "does not set 'kbdinteractiveauthentication no'",
    ),
    "root with a key": (
        f"PermitRootLogin prohibit-password\nInclude {POLICY}\n",
        "does not set 'permitrootlogin no'",
    ),
}
ACCEPTED_POLICIES = {
    "the generated policy": f"StrictModes no\nInclude {POLICY}\n",
    "changed, still key-only": f"StrictModes no\nClientAliveInterval 30\nInclude {POLICY}\n",
}


def write_policy(server: SshServer, name: str, text: str | None) -> Path:
    path = server.root / f"policy-{name.replace(' ', '-')}"
    if text == "":
        path.mkdir()
    elif text is not None:
        generated = server.project / ".devcontainer" / "sshd_config"
        path.write_text(text.replace(POLICY, str(generated)))
    return path


@pytest.mark.parametrize("name", REFUSED_POLICIES)
def test_sshd_never_starts_without_its_key_only_policy(server: SshServer, keys, name):
    text, reason = REFUSED_POLICIES[name]
    policy = write_policy(server, name, text)
    with stopped(server):
        with pytest.raises(subprocess.CalledProcessError) as refused:
            server.start(SSHD_CONFIG=str(policy), SSH_AUTHORIZED_KEYS="")
        # One line of start-sshd's own (this machine may add cat's complaint that PID 1's
        # environment is not readable, as at every start here).
        own_lines = [
            line for line in refused.value.stderr.splitlines() if line.startswith("start-sshd: ")
        ]
        assert len(own_lines) == 1, refused.value.stderr
        (line,) = own_lines
        assert str(policy) in line
        assert reason in line
        assert "refusing to start sshd" in line
        assert not (server.runtime / "sshd.pid").exists()
        assert not listening(server.port)
    assert server.ssh(server.user, keys["host_user"], "true").returncode == 0


@pytest.mark.parametrize("name", ACCEPTED_POLICIES)
def test_a_key_only_policy_starts(server: SshServer, keys, name):
    policy = write_policy(server, name, ACCEPTED_POLICIES[name])
    with stopped(server):
        server.start(SSHD_CONFIG=str(policy))
        assert server.ssh(server.user, keys["host_user"], "true").returncode == 0


def test_collected_host_keys_are_public_keys_from_inside_ssh_only(
    server: SshServer, keys, typed_keys, tmp_path: Path
):
    """collect-host-ssh-keys on a hostile ~/.ssh, then sshd on what it collected.

    A .pub name proves nothing: links to private keys, links out of ~/.ssh, private keys
    saved under .pub names, pipes and devices. Nothing of a private key reaches the
    project folder, nothing outside ~/.ssh is read, and the good keys still log in.
    """
    ssh_dir = tmp_path / "home" / ".ssh"
    (ssh_dir / "keys").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    own = {
        "id_ed25519": keys["host_user"],
        "id_ecdsa": typed_keys["ecdsa256"],
        "id_rsa": typed_keys["rsa3072"],
        "keys/laptop": typed_keys["ed25519"],
        "weak": typed_keys["rsa1024"],
    }
    for name, key in own.items():
        shutil.copy(key, ssh_dir / name)
        shutil.copy(key.with_suffix(".pub"), ssh_dir / f"{name}.pub")
    stranger = keys["stranger"]
    shutil.copy(stranger, elsewhere / "stranger")
    shutil.copy(stranger.with_suffix(".pub"), elsewhere / "stranger.pub")
    private_text = stranger.read_text()
    public_line = keys["env_key"].with_suffix(".pub").read_text()

    hostile = {
        "private-link.pub": lambda p: p.symlink_to("id_ed25519"),
        "outside.pub": lambda p: p.symlink_to(elsewhere / "stranger.pub"),
        "outside-private.pub": lambda p: p.symlink_to(elsewhere / "stranger"),
        "device.pub": lambda p: p.symlink_to("/dev/zero"),
        "dangling.pub": lambda p: p.symlink_to("gone.pub"),
        "pasted.pub": lambda p: p.write_text(private_text),
        "mixed.pub": lambda p: p.write_text(public_line + private_text),
        "putty.pub": lambda p: p.write_text(
            "PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\nPublic-Lines: 2\n"
            "AAAAC3NzaC1lZDI1NTE5AAAAIJm7\nPrivate-Lines: 1\nAAAAIGHv\n"
        ),
        "options.pub": lambda p: p.write_text(f'command="/bin/sh" {public_line}'),
        "fifo.pub": os.mkfifo,
        "folder.pub": lambda p: p.mkdir(),
    }
    for name, make in hostile.items():
        make(ssh_dir / name)
    (ssh_dir / "current.pub").symlink_to("keys/laptop.pub")  # a link inside ~/.ssh: fine

    devcontainer = tmp_path / "project" / ".devcontainer"
    shutil.copytree(server.project / ".devcontainer", devcontainer)
    collected = subprocess.run(
        ["sh", str(devcontainer / "collect-host-ssh-keys.sh")],
        env={"HOME": str(ssh_dir.parent), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    folder = devcontainer / "host-ssh-keys"
    # Each collected file is its public key, line for line, and nothing else.
    expected = {f"{name}.pub": own[name] for name in ("id_ed25519", "id_ecdsa", "id_rsa", "weak")}
    expected["current.pub"] = own["keys/laptop"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(expected)
    for name, key in expected.items():
        assert not (folder / name).is_symlink()
        assert (folder / name).read_text() == key.with_suffix(".pub").read_text(), name
    skipped = collected.stderr.splitlines()
    assert len(skipped) == len(hostile), collected.stderr
    for name in hostile:
        (line,) = [line for line in skipped if f"/.ssh/{name}: " in line]
        assert line.startswith("collect-host-ssh-keys: skipping ")
    assert sum("outside" in line for line in skipped) == 3  # outside*.pub and /dev/zero
    assert sum("holds a PRIVATE key" in line for line in skipped) == 4

    with stopped(server):
        started = server.start(SSH_AUTHORIZED_KEYS="", SSH_PUBLIC_KEYS_DIR=str(folder))
        assert f"of {folder / 'weak.pub'}: the RSA key " in started.stderr
        assert "4 public key(s) may log in" in started.stdout
        for name in ("id_ed25519", "id_ecdsa", "id_rsa", "keys/laptop"):
            session = server.ssh(server.user, ssh_dir / name, "echo", "in")
            assert session.stdout.strip() == "in", f"{name}: {session.stderr}"
        for refused in (stranger, ssh_dir / "weak"):
            assert server.ssh(server.user, refused, "true").returncode == 255
